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
