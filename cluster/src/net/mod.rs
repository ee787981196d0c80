//! The cluster network: region slices between processes over mutually authenticated QUIC.
//!
//! - `tls`: the cluster CA, node certificates in the state directory, mutual-TLS configurations.
//! - `frame`: the wire format of a slice or control message, and its validation (pure).
//! - `stream`: frames over an async byte stream (the thin layer between `frame` and a socket).
//! - `quic`: quinn endpoints and the runtime `Transport` over them.
//! - `fault`: user-space fault injection (delay, loss, disconnect) for tests.

pub mod fault;
pub mod frame;
pub mod quic;
pub mod stream;
pub mod tls;

/// The tokio runtime of a process on the cluster network (worker, launcher, job driver): two
/// workers, as the device actors only track dependences and move data, while kernels run on the
/// rayon pool, plus the I/O and timer drivers QUIC needs.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("legion-net")
        .enable_all()
        .build()
}
