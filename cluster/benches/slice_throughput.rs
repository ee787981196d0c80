//! Region-slice throughput on loopback, in the same run: QUIC (mutual TLS, one uni-stream per
//! slice, over one or several connections) against TCP with the same framing, plaintext and with
//! TLS 1.3 (rustls, the same ring AES-GCM and the same cluster certificates as QUIC), the
//! like-for-like baseline for an authenticated transport.
//!
//! `cargo bench -p legion-cluster --bench slice_throughput [-- --mib 256 --runs 3]`
//!
//! Each of `--runs` rounds measures every column once, back to back, and the table gives each
//! column's median and the median of the rounds' ratios (the best QUIC column over each TCP one).
//! A second table gives what each column costs the CPU: bytes moved per CPU second of this
//! process (both ends, every thread), so that a column that only goes faster by taking more cores
//! shows it.
//!
//! Experiment flags: `--conns 1,2` QUIC connections per run (slices striped over them),
//! `--slices 1,16` slice sizes in MiB, `--max-mtu N` (default: `QuicOptions::default()`),
//! `--receive-window BYTES` and `--stream-window BYTES` (QUIC's connection and stream
//! flow-control windows), `--only tcp,tls,old,quic` which columns to measure, `--stats` (prints
//! each QUIC connection's path statistics after a run).

use legion_cluster::net::frame::{Frame, Limits};
use legion_cluster::net::quic::{Handler, Inbound, QuicNode, QuicOptions, send_slice};
use legion_cluster::net::stream::{read_frame, write_slice};
use legion_cluster::net::tls::{ClusterCa, NodeTls};
use legion_runtime::Buffer;
use legion_runtime::SliceMessage;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Slices in flight at once on QUIC (each on its own stream), as a step's many copies would be.
const IN_FLIGHT: usize = 8;

/// A timed run: its wall time and this process's CPU seconds over it.
#[derive(Clone, Copy)]
struct Timed {
    wall: Duration,
    cpu_s: f64,
}

/// This process's CPU seconds so far, user and system, every thread.
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Starts timing a run.
fn start_timing() -> (Instant, f64) {
    (Instant::now(), process_cpu_s())
}

fn stop_timing((start, cpu): (Instant, f64)) -> Timed {
    Timed {
        wall: start.elapsed(),
        cpu_s: process_cpu_s() - cpu,
    }
}

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

/// Two nodes' TLS configurations signed by one fresh cluster CA.
fn tls_pair() -> (NodeTls, NodeTls) {
    let ca = ClusterCa::generate().unwrap();
    let a = ca.issue("node-a", &[]).unwrap().tls().unwrap();
    let b = ca.issue("node-b", &[]).unwrap().tls().unwrap();
    (a, b)
}

async fn quic_run(
    options: &QuicOptions,
    conns: usize,
    slice_bytes: usize,
    count: usize,
    stats: bool,
) -> Timed {
    let (tls_a, tls_b) = tls_pair();
    let counter = Counter::new();
    let c = counter.clone();
    let handler: Handler = Arc::new(move |m| {
        if let Inbound::Slice(msg) = m {
            c.add(msg.data.byte_len() as u64);
        }
    });
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let b = QuicNode::bind(any, &tls_b, options, handler).unwrap();
    let a = QuicNode::bind(any, &tls_a, options, Arc::new(|_| {})).unwrap();
    let conns = a
        .connect_many(b.local_addr().unwrap(), "node-b", conns)
        .await
        .unwrap();
    let msg = slice(slice_bytes);

    // Warm up every connection (congestion window, MTU discovery) before timing.
    let warm_up = 4 * conns.len();
    counter.arm((warm_up * slice_bytes) as u64);
    for i in 0..warm_up {
        send_slice(&conns[i % conns.len()], &msg).await.unwrap();
    }
    counter.done.notified().await;

    counter.arm((slice_bytes * count) as u64);
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    let timing = start_timing();
    for i in 0..count {
        let permit = permits.clone().acquire_owned().await.unwrap();
        // Round robin, as `QuicTransport::route_many` does.
        let (conn, msg) = (conns[i % conns.len()].clone(), msg.clone());
        tokio::spawn(async move {
            // Returns once the slice is queued (bounded by the send window), as the transport's
            // per-slice task does.
            send_slice(&conn, &msg).await.unwrap();
            drop(permit);
        });
    }
    counter.done.notified().await;
    let elapsed = stop_timing(timing);
    if stats {
        for conn in &conns {
            let s = conn.stats();
            eprintln!(
                "  conn: mtu {} cwnd {} rtt {:?} sent {} lost {} congestion events {} \
                 black holes {} udp tx {} datagrams in {} sendmsg",
                s.path.current_mtu,
                s.path.cwnd,
                s.path.rtt,
                s.path.sent_packets,
                s.path.lost_packets,
                s.path.congestion_events,
                s.path.black_holes_detected,
                s.udp_tx.datagrams,
                s.udp_tx.ios,
            );
        }
    }
    a.shutdown().await;
    b.shutdown().await;
    elapsed
}

/// Frames back to back on one TCP connection, plaintext or in TLS.
async fn tcp_run(slice_bytes: usize, count: usize, tls: bool) -> Timed {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counter = Counter::new();
    let (tls_a, tls_b) = tls_pair();
    let c = counter.clone();
    let reader = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        if tls {
            let stream = TlsAcceptor::from(tls_b.server)
                .accept(stream)
                .await
                .unwrap();
            read_all(stream, &c).await;
        } else {
            read_all(stream, &c).await;
        }
    });
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let elapsed = if tls {
        let name = "node-b".try_into().unwrap();
        let stream = TlsConnector::from(tls_a.client)
            .connect(name, stream)
            .await
            .unwrap();
        write_all(stream, &counter, slice_bytes, count).await
    } else {
        write_all(stream, &counter, slice_bytes, count).await
    };
    reader.await.unwrap();
    elapsed
}

async fn read_all<R: AsyncRead + Unpin>(mut stream: R, counter: &Counter) {
    let limits = Limits::default();
    while let Some(frame) = read_frame(&mut stream, &limits).await.unwrap() {
        if let Frame::Slice(msg) = frame {
            counter.add(msg.data.byte_len() as u64);
        }
    }
}

async fn write_all<W: AsyncWrite + Unpin>(
    mut stream: W,
    counter: &Counter,
    slice_bytes: usize,
    count: usize,
) -> Timed {
    let msg = slice(slice_bytes);
    counter.arm(4 * slice_bytes as u64);
    for _ in 0..4 {
        write_slice(&mut stream, &msg).await.unwrap();
    }
    stream.flush().await.unwrap();
    counter.done.notified().await;

    counter.arm((slice_bytes * count) as u64);
    let timing = start_timing();
    for _ in 0..count {
        write_slice(&mut stream, &msg).await.unwrap();
    }
    // TLS buffers the last record until flushed.
    stream.flush().await.unwrap();
    counter.done.notified().await;
    let elapsed = stop_timing(timing);
    stream.shutdown().await.unwrap();
    elapsed
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn num<T: std::str::FromStr>(name: &str, default: T) -> T {
    arg(name).map_or(default, |v| v.parse().ok().expect("a number"))
}

fn list(name: &str, default: &[usize]) -> Vec<usize> {
    arg(name).map_or(default.to_vec(), |v| {
        v.split(',').map(|n| n.parse().expect("a number")).collect()
    })
}

fn main() {
    let total_mib: usize = num("--mib", 256);
    let rounds: usize = num("--runs", 3);
    let conn_counts = list("--conns", &[1, 2]);
    let slice_sizes = list("--slices", &[1, 16]);
    let only = arg("--only").unwrap_or("tcp,tls,quic,old".into());
    let stats = std::env::args().any(|a| a == "--stats");
    let tuned = QuicOptions {
        max_mtu: num("--max-mtu", QuicOptions::default().max_mtu),
        receive_window: num("--receive-window", QuicOptions::default().receive_window),
        stream_receive_window: num(
            "--stream-window",
            QuicOptions::default().stream_receive_window,
        ),
        ..QuicOptions::default()
    };
    // The options before this benchmark's tuning (MTU discovery capped at Ethernet's 1452), for a
    // before/after comparison in the same run.
    let old = QuicOptions {
        max_mtu: 1452,
        ..QuicOptions::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "loopback, {total_mib} MiB per run, {rounds} rounds (every column once per round), \
         medians; {IN_FLIGHT} QUIC streams in flight, QUIC max_mtu {}",
        tuned.max_mtu
    );
    let quic_cols: Vec<String> = conn_counts
        .iter()
        .map(|n| format!("QUIC {n} conn"))
        .collect();
    println!(
        "| slice | TCP | TCP+TLS | QUIC old (1452, 1 conn) | {} | best QUIC / TCP | best QUIC / TCP+TLS |",
        quic_cols.join(" | ")
    );
    println!(
        "|---|---|---|---|{}---|---|",
        "---|".repeat(quic_cols.len())
    );
    let wanted = |what: &str| only.split(',').any(|o| o == what);
    // Per slice size, each column's median GB per CPU second, printed after the throughput.
    let mut per_cpu_rows = Vec::new();
    for slice_mib in slice_sizes {
        let slice_bytes = slice_mib << 20;
        let count = (total_mib / slice_mib).max(1);
        let bytes = (slice_bytes * count) as f64;
        let gbs = |t: Timed| bytes / t.wall.as_secs_f64() / 1e9;
        let per_cpu = |t: Timed| bytes / t.cpu_s.max(1e-9) / 1e9;
        // Columns: TCP, TCP+TLS, old QUIC, then one per connection count. The machine is shared
        // and its speed drifts over seconds, so every round measures each column once, and the
        // ratios are taken within a round before their median.
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 3 + conn_counts.len()];
        let mut cpu_samples: Vec<Vec<f64>> = vec![Vec::new(); 3 + conn_counts.len()];
        let mut over_tcp = Vec::new();
        let mut over_tls = Vec::new();
        for _ in 0..rounds {
            let mut timed: Vec<Option<Timed>> = Vec::new();
            timed.push(wanted("tcp").then(|| rt.block_on(tcp_run(slice_bytes, count, false))));
            timed.push(wanted("tls").then(|| rt.block_on(tcp_run(slice_bytes, count, true))));
            timed.push(
                wanted("old").then(|| rt.block_on(quic_run(&old, 1, slice_bytes, count, stats))),
            );
            for &n in &conn_counts {
                timed.push(
                    wanted("quic")
                        .then(|| rt.block_on(quic_run(&tuned, n, slice_bytes, count, stats))),
                );
            }
            let round: Vec<Option<f64>> = timed.iter().map(|t| t.map(gbs)).collect();
            for (column, x) in samples.iter_mut().zip(&round) {
                column.extend(x);
            }
            for (column, t) in cpu_samples.iter_mut().zip(&timed) {
                column.extend(t.map(per_cpu));
            }
            let top = round[3..].iter().flatten().copied().reduce(f64::max);
            if let (Some(q), Some(t)) = (top, round[0]) {
                over_tcp.push(q / t);
            }
            if let (Some(q), Some(t)) = (top, round[1]) {
                over_tls.push(q / t);
            }
        }
        let cell = |xs: &mut Vec<f64>| median(xs).map_or("-".into(), |x| format!("{x:.2}"));
        let ratio =
            |xs: &mut Vec<f64>| median(xs).map_or("-".into(), |x| format!("{:.0}%", 100.0 * x));
        let cells: Vec<String> = samples.iter_mut().map(cell).collect();
        println!(
            "| {slice_mib} MiB | {} | {} | {} |",
            cells.join(" | "),
            ratio(&mut over_tcp),
            ratio(&mut over_tls),
        );
        let cells: Vec<String> = cpu_samples.iter_mut().map(cell).collect();
        per_cpu_rows.push(format!("| {slice_mib} MiB | {} |", cells.join(" | ")));
    }
    println!();
    println!("GB moved per CPU second of this process (sender and receiver together), medians:");
    println!(
        "| slice | TCP | TCP+TLS | QUIC old (1452, 1 conn) | {} |",
        quic_cols.join(" | ")
    );
    println!("|---|---|---|---|{}", "---|".repeat(quic_cols.len()));
    for row in per_cpu_rows {
        println!("{row}");
    }
}

fn median(xs: &mut [f64]) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(xs[n / 2]),
        _ => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
    }
}
