//! Region-slice throughput on loopback: QUIC (mutual TLS, one uni-stream per slice) against plain
//! TCP with the same framing, in the same run.
//!
//! `cargo bench -p legion-cluster --bench slice_throughput [-- --mib 256 --runs 3]`

use legion_cluster::net::frame::Limits;
use legion_cluster::net::quic::{Handler, Inbound, QuicNode, QuicOptions, send_slice};
use legion_cluster::net::stream::{read_frame, write_slice};
use legion_cluster::net::tls::ClusterCa;
use legion_runtime::buffer::Buffer;
use legion_runtime::transport::SliceMessage;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

/// Slices in flight at once on QUIC (each on its own stream), as a step's many copies would be.
const IN_FLIGHT: usize = 8;

struct Counter {
    bytes: AtomicU64,
    target: AtomicU64,
    done: Notify,
}

impl Counter {
    fn new() -> Arc<Counter> {
        Arc::new(Counter {
            bytes: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            done: Notify::new(),
        })
    }

    fn add(&self, n: u64) {
        let total = self.bytes.fetch_add(n, Ordering::SeqCst) + n;
        if total >= self.target.load(Ordering::SeqCst) {
            self.done.notify_one();
        }
    }

    fn arm(&self, target: u64) {
        self.bytes.store(0, Ordering::SeqCst);
        self.target.store(target, Ordering::SeqCst);
    }
}

fn slice(bytes: usize) -> Arc<SliceMessage> {
    Arc::new(SliceMessage {
        step: 0,
        copy: 0,
        to: 1,
        data: Buffer::F32((0..bytes / 4).map(|i| i as f32).collect()).into(),
    })
}

async fn quic_run(options: &QuicOptions, slice_bytes: usize, count: usize) -> Duration {
    let ca = ClusterCa::generate().unwrap();
    let counter = Counter::new();
    let c = counter.clone();
    let handler: Handler = Arc::new(move |m| {
        if let Inbound::Slice(msg) = m {
            c.add(msg.data.byte_len() as u64);
        }
    });
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let tls_b = ca.issue("node-b", &[]).unwrap().tls().unwrap();
    let tls_a = ca.issue("node-a", &[]).unwrap().tls().unwrap();
    let b = QuicNode::bind(any, &tls_b, options, handler).unwrap();
    let a = QuicNode::bind(any, &tls_a, options, Arc::new(|_| {})).unwrap();
    let conn = a.connect(b.local_addr().unwrap(), "node-b").await.unwrap();
    let msg = slice(slice_bytes);

    // Warm up the congestion window before timing.
    counter.arm(4 * slice_bytes as u64);
    for _ in 0..4 {
        send_slice(&conn, &msg).await.unwrap();
    }
    counter.done.notified().await;

    counter.arm((slice_bytes * count) as u64);
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    let start = Instant::now();
    for _ in 0..count {
        let permit = permits.clone().acquire_owned().await.unwrap();
        let (conn, msg) = (conn.clone(), msg.clone());
        tokio::spawn(async move {
            // Returns once the slice is queued (bounded by the send window), as the transport's
            // per-slice task does.
            send_slice(&conn, &msg).await.unwrap();
            drop(permit);
        });
    }
    counter.done.notified().await;
    let elapsed = start.elapsed();
    a.shutdown().await;
    b.shutdown().await;
    elapsed
}

async fn tcp_run(slice_bytes: usize, count: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counter = Counter::new();
    let c = counter.clone();
    let reader = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let limits = Limits::default();
        while let Some(frame) = read_frame(&mut stream, &limits).await.unwrap() {
            if let legion_cluster::net::frame::Frame::Slice(msg) = frame {
                c.add(msg.data.byte_len() as u64);
            }
        }
    });
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let msg = slice(slice_bytes);
    counter.arm(4 * slice_bytes as u64);
    for _ in 0..4 {
        write_slice(&mut stream, &msg).await.unwrap();
    }
    counter.done.notified().await;

    counter.arm((slice_bytes * count) as u64);
    let start = Instant::now();
    for _ in 0..count {
        write_slice(&mut stream, &msg).await.unwrap();
    }
    counter.done.notified().await;
    let elapsed = start.elapsed();
    stream.shutdown().await.unwrap();
    reader.await.unwrap();
    elapsed
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let total_mib = arg("--mib", 256);
    let runs = arg("--runs", 3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let tuned = QuicOptions::default();
    // quinn's own flow-control defaults and the system's socket buffers, for comparison.
    let stock = QuicOptions {
        stream_receive_window: 1_250_000,
        send_window: 10_000_000,
        udp_buffer: 0,
        ..QuicOptions::default()
    };
    println!(
        "loopback, {total_mib} MiB per run, best of {runs} runs, {IN_FLIGHT} QUIC streams in flight"
    );
    println!("| slice | TCP GB/s | QUIC stock GB/s | QUIC tuned GB/s | tuned/TCP |");
    println!("|---|---|---|---|---|");
    for slice_mib in [1usize, 16] {
        let slice_bytes = slice_mib << 20;
        let count = (total_mib / slice_mib).max(1);
        let bytes = (slice_bytes * count) as f64;
        let best = |f: &dyn Fn() -> Duration| (0..runs).map(|_| f()).min().unwrap();
        let tcp = best(&|| rt.block_on(tcp_run(slice_bytes, count)));
        let stock = best(&|| rt.block_on(quic_run(&stock, slice_bytes, count)));
        let quic = best(&|| rt.block_on(quic_run(&tuned, slice_bytes, count)));
        let gbs = |d: Duration| bytes / d.as_secs_f64() / 1e9;
        let (tcp, stock, quic) = (gbs(tcp), gbs(stock), gbs(quic));
        println!(
            "| {slice_mib} MiB | {tcp:.2} | {stock:.2} | {quic:.2} | {:.0}% |",
            100.0 * quic / tcp
        );
    }
}
