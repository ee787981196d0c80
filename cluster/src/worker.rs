//! The worker process (`legion-rs worker`, started by `legion-rs up`): one per host, owning that
//! host's devices. It answers the launcher (`Hello`, `MeasureLinks`, `Shutdown`), measures a
//! model's op costs on its devices for a driver's search (`MeasureCosts`), and runs one job
//! at a time for a driver (`legion-rs train --cluster`): builds the job's step plan, spawns a device
//! actor per local device, dials the other workers, and then runs steps when told, exchanging
//! region slices with the other workers directly over QUIC.
//!
//! Requests are handled in order by one loop; a step runs as a task of its own so that the loop
//! stays free for `EndJob`, `Shutdown` and the `Stage` of the next step's samples. Heartbeats go to the job's driver every
//! [`HEARTBEAT_INTERVAL`] from a task of their own. A job ends when its driver says so or its
//! connection closes (the driver died): the worker then drops the job's actors and waits for the
//! next one.

use crate::control::{
    self, Control, DeviceReport, JobSpec, LinkMeasurement, MeasuredCosts, NicMeasurement,
    PeerAddress, Piece, PieceData, PieceRef, SampleImages, StepSamples,
};
use crate::net::quic::{
    CLOSE_MALFORMED, Inbound, QuicNode, QuicOptions, QuicTransport, send_control, send_heartbeat,
};
use crate::net::stream::BufferSource;
use crate::net::tls::{NodeIdentity, node_name};
use anyhow::Context as _;
use kameo::actor::ActorRef;
use legion_ops::data::{DataSource, Dataset};
use legion_ops::partition::Nodes;
use legion_ops::strategy::Strategy;
use legion_ops::{Graph, Rect};
use legion_runtime::Buffer;
use legion_runtime::InProcessTransport;
use legion_runtime::StepInput;
use legion_runtime::plan::{SamplesRead, StepPlan};
use legion_runtime::program::{DeviceProgram, Part};
use legion_runtime::{DeviceActor, Load, ReadInstance};
use legion_runtime::{Placement, check_batch, run_step, spawn_local_devices};
use quinn::Connection;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// How often a worker running a job tells its driver it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

pub struct WorkerConfig {
    pub name: String,
    pub listen: SocketAddr,
    pub state: PathBuf,
    pub devices: usize,
    /// Where its devices run (its GPUs, started by the caller, or its cores).
    pub placement: Placement,
    /// How it measures a model's op costs on its cores when a driver asks.
    pub measure_costs: Arc<MeasureCosts>,
}

/// Measures what this host keeps no cost of among `graph`'s tiles on that many of its cores, at
/// that precision, keeping them for later runs. The planner's side of a worker: the engine does
/// not depend on the planner, so the program that runs the worker gives it one.
pub type MeasureCosts =
    dyn Fn(&Graph, usize, legion_ops::Precision) -> anyhow::Result<MeasuredCosts> + Send + Sync;

/// Runs a worker until it is told to shut down.
pub fn run(config: WorkerConfig) -> anyhow::Result<()> {
    let runtime = crate::net::runtime()?;
    let served = runtime.block_on(serve(config));
    // Nothing left to wait for once the requests stop: a task stuck on a dead peer must not keep
    // the process alive after `down`.
    runtime.shutdown_timeout(Duration::from_secs(1));
    served
}

enum Event {
    Request(Connection, Control),
    /// The connection of the job's driver closed.
    DriverGone(usize),
}

/// What the network handler needs, shared with the request loop.
struct Shared {
    name: String,
    devices: usize,
    placement: Placement,
    measure: Arc<MeasureCosts>,
    started: Instant,
    /// The local devices of the running job, for slices arriving from other workers. Written when
    /// a job starts and ends, read once per slice (an uncontended read lock: cheaper than a hop
    /// through the request loop, which may be busy).
    job_devices: RwLock<Option<Arc<InProcessTransport>>>,
    /// The driver endpoint of the running job, for `Welcome`.
    job_of: Mutex<Option<String>>,
    /// Probes this worker sent and waits on, by id.
    probes: Mutex<HashMap<u64, oneshot::Sender<(f64, f64)>>>,
}

async fn serve(config: WorkerConfig) -> anyhow::Result<()> {
    let identity =
        NodeIdentity::load(&config.state, &node_name(&config.name)).with_context(|| {
            format!(
                "worker {}: loading its certificate from {}",
                config.name,
                config.state.display()
            )
        })?;
    let tls = identity.tls()?;
    let shared = Arc::new(Shared {
        name: config.name.clone(),
        devices: config.devices,
        placement: config.placement.clone(),
        measure: Arc::clone(&config.measure_costs),
        started: Instant::now(),
        job_devices: RwLock::new(None),
        job_of: Mutex::new(None),
        probes: Mutex::new(HashMap::new()),
    });
    let (events, mut inbox) = mpsc::unbounded_channel();
    let handler = {
        let shared = Arc::clone(&shared);
        let events = events.clone();
        Arc::new(move |inbound: Inbound| handle_inbound(&shared, &events, inbound))
    };
    // Slices from other workers are read into buffers the running job's devices handed back.
    let buffers: BufferSource = {
        let shared = Arc::clone(&shared);
        Arc::new(move |dtype, len| {
            let devices = shared.job_devices.read().unwrap_or_else(|e| e.into_inner());
            devices.as_ref()?.buffers()?.take(dtype, len)
        })
    };
    let node = Arc::new(
        QuicNode::bind_with_buffers(
            config.listen,
            &tls,
            &QuicOptions::default(),
            handler,
            Some(buffers),
        )
        .with_context(|| format!("worker {}: binding {}", config.name, config.listen))?,
    );
    tracing::info!(name = %config.name, addr = %node.local_addr()?, "worker listening");
    println!("worker {} listening on {}", config.name, node.local_addr()?);

    let mut job: Option<Job> = None;
    while let Some(event) = inbox.recv().await {
        let (conn, request) = match event {
            Event::Request(conn, request) => (conn, request),
            Event::DriverGone(id) => {
                if job.as_ref().is_some_and(|j| j.driver.stable_id() == id) {
                    tracing::warn!("the job's driver went away; ending the job");
                    end_job(&shared, job.take());
                }
                continue;
            }
        };
        let answer = match request {
            Control::Shutdown => {
                end_job(&shared, job.take());
                reply(&conn, &Control::Bye).await;
                // Let the Bye leave before the endpoint closes every connection.
                tokio::time::sleep(Duration::from_millis(100)).await;
                // Closing waits for peers to acknowledge; a peer that is gone never does.
                if tokio::time::timeout(Duration::from_secs(2), node.shutdown())
                    .await
                    .is_err()
                {
                    // Routine: peers that are gone never acknowledge.
                    tracing::info!("connections did not close within 2 s; exiting anyway");
                }
                return Ok(());
            }
            Control::MeasureLinks { peers, probe_bytes } => {
                match measure_links(&node, &shared, &peers, probe_bytes).await {
                    Ok((links, nic)) => Control::Links { links, nic },
                    Err(e) => failed(e),
                }
            }
            Control::MeasureCosts {
                graph_json,
                precision,
            } => match &job {
                Some(_) => Control::Failed {
                    message: format!(
                        "worker {} is running a job; it measures op costs between jobs",
                        shared.name
                    ),
                },
                None => match measure_costs(&shared, graph_json, &precision).await {
                    Ok(costs) => Control::Costs(costs),
                    Err(e) => failed(e),
                },
            },
            Control::StartJob(spec) => {
                end_job(&shared, job.take());
                match start_job(&node, &shared, &conn, spec, &events).await {
                    Ok(j) => {
                        job = Some(j);
                        Control::JobReady
                    }
                    Err(e) => failed(e),
                }
            }
            Control::EndJob => {
                end_job(&shared, job.take());
                Control::JobEnded
            }
            request @ (Control::Load { .. }
            | Control::Step { .. }
            | Control::Infer { .. }
            | Control::Stage { .. }
            | Control::Read { .. }) => {
                match &job {
                    Some(j) if j.driver.stable_id() == conn.stable_id() => {
                        match j.handle(request, &conn).await {
                            // A step replies from its own task; a stage not at all.
                            None => continue,
                            Some(reply) => reply,
                        }
                    }
                    Some(_) => Control::Failed {
                        message: format!("worker {} is running another driver's job", shared.name),
                    },
                    None => Control::Failed {
                        message: format!("worker {} has no job (StartJob first)", shared.name),
                    },
                }
            }
            other => Control::Failed {
                message: format!(
                    "worker {}: unexpected request {}",
                    shared.name,
                    other.name()
                ),
            },
        };
        reply(&conn, &answer).await;
    }
    Ok(())
}

/// Measures what this worker's cost cache lacks of `graph_json`'s tiles, on its devices, off the
/// request loop's thread (the steps run pools of their own).
async fn measure_costs(
    shared: &Shared,
    graph_json: String,
    precision: &str,
) -> anyhow::Result<MeasuredCosts> {
    let who = format!("worker {}", shared.name);
    if matches!(shared.placement, Placement::Gpus(_)) {
        anyhow::bail!(
            "{who}: its devices are GPUs, which do not measure op costs before a search yet \
             (`legion-rs profile --device cuda` on the host and --costs FILE price them)"
        );
    }
    let precision: legion_ops::Precision = precision
        .parse()
        .map_err(|e| anyhow::anyhow!("{who}: MeasureCosts precision {precision:?}: {e}"))?;
    let (devices, measure) = (shared.devices, shared.measure.clone());
    let (done, result) = oneshot::channel();
    std::thread::Builder::new()
        .name("measure-costs".into())
        .spawn(move || {
            let measured = Graph::from_json(&graph_json, "the model to measure")
                .map_err(anyhow::Error::from)
                .and_then(|graph| measure(&graph, devices, precision));
            let _ = done.send(measured);
        })
        .with_context(|| format!("{who}: starting the measuring thread"))?;
    result
        .await
        .with_context(|| format!("{who}: the measuring thread ended without an answer"))?
        .with_context(|| who.clone())
}

fn failed(e: anyhow::Error) -> Control {
    Control::Failed {
        message: format!("{e:#}"),
    }
}

async fn reply(conn: &Connection, msg: &Control) {
    if let Err(e) = send_control(conn, &control::encode(msg)).await {
        tracing::warn!(peer = %conn.remote_address(), "reply {} not sent: {e}", msg.name());
    }
}

/// Runs on the network tasks: slices go straight to the local device; what needs no state of the
/// request loop (greetings, probes) is answered here, so it is never queued behind a step.
fn handle_inbound(shared: &Arc<Shared>, events: &mpsc::UnboundedSender<Event>, inbound: Inbound) {
    match inbound {
        Inbound::Slice(msg) => {
            let devices = shared
                .job_devices
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            match devices {
                Some(devices) => match devices.local(msg.to) {
                    Some(_) => legion_runtime::Transport::send(&*devices, msg),
                    None => {
                        tracing::error!(device = msg.to, "slice for a device not on this worker")
                    }
                },
                None => tracing::warn!(step = msg.step, "slice outside a job dropped"),
            }
        }
        Inbound::Control { peer, conn, bytes } => match timed(|| control::decode(&bytes)) {
            (Err(e), _) => {
                tracing::error!(%peer, "{e}; closing the connection");
                conn.close(CLOSE_MALFORMED, b"malformed control message");
            }
            (Ok(Control::Hello { .. }), _) => {
                let welcome = Control::Welcome {
                    name: shared.name.clone(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    devices: shared.devices as u32,
                    pid: std::process::id(),
                    uptime_s: shared.started.elapsed().as_secs_f64(),
                    job_of: shared
                        .job_of
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone(),
                };
                tokio::spawn(async move { reply(&conn, &welcome).await });
            }
            (Ok(Control::Probe { id, .. }), decode_s) => {
                let ack = Control::ProbeAck {
                    id,
                    cpu_s: process_cpu_s(),
                    decode_s,
                };
                tokio::spawn(async move { reply(&conn, &ack).await });
            }
            (
                Ok(Control::ProbeAck {
                    id,
                    cpu_s,
                    decode_s,
                }),
                _,
            ) => {
                let waiter = shared
                    .probes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
                if let Some(waiter) = waiter {
                    let _ = waiter.send((cpu_s, decode_s));
                }
            }
            (Ok(request), _) => {
                let _ = events.send(Event::Request(conn, request));
            }
        },
    }
}

/// Probes of 64 bytes, `probe_bytes / 4` and `probe_bytes` to each peer, one at a time. Latency:
/// half the small round trip. Bandwidth: from the two large ones, whose difference cancels what
/// both pay alike (a shaper's burst allowance, the congestion window's ramp), which a small-large
/// pair would count as bandwidth. The transport's CPU per byte, from the same difference: this
/// process's CPU time across each round trip (sending), the peer's between its acks (receiving;
/// neither worker does anything else while `up` measures). Times and CPU leave out encoding the
/// probe as a control message and decoding it, which slices do not pay.
///
/// Then the host's network interface: the two large probes to every peer at once, the bytes of
/// their difference over the difference of the times until the last ack. Where one interface
/// carries all of a host's traffic (a NIC, a shaped veth), that is about one peer's bandwidth
/// however many peers there are.
async fn measure_links(
    node: &QuicNode,
    shared: &Arc<Shared>,
    peers: &[PeerAddress],
    probe_bytes: u64,
) -> anyhow::Result<(Vec<LinkMeasurement>, Option<NicMeasurement>)> {
    let large = probe_bytes.clamp(4 << 10, 256 << 20) as usize;
    let sizes = [64, large / 4, large];
    let extra = (large - large / 4) as f64;
    let mut links = Vec::new();
    let mut conns = Vec::new();
    for peer in peers {
        let conn = dial(node, peer).await?;
        // The first round trips warm the connection (congestion window, path MTU).
        round_trip(shared, &conn, peer, large).await?;
        let mut best = [f64::INFINITY; 3];
        let (mut send_cpu, mut recv_cpu) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let mut trial = [ProbeTiming::default(); 3];
            for (k, &bytes) in sizes.iter().enumerate() {
                trial[k] = round_trip(shared, &conn, peer, bytes).await?;
                best[k] = best[k].min(trial[k].seconds);
            }
            send_cpu.push((trial[2].cpu_s - trial[1].cpu_s) / extra);
            // the peer's CPU for receiving probe k: from the ack before it to its own, less its
            // decoding
            let received =
                |k: usize| trial[k].peer_cpu_s - trial[k - 1].peer_cpu_s - trial[k].decode_s;
            recv_cpu.push((received(2) - received(1)) / extra);
        }
        let cpu = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2].max(0.0)
        };
        links.push(LinkMeasurement {
            to: peer.name.clone(),
            bytes_per_s: extra / (best[2] - best[1]).max(1e-9),
            latency_s: best[0] / 2.0,
            send_cpu_s_per_byte: cpu(send_cpu),
            recv_cpu_s_per_byte: cpu(recv_cpu),
        });
        conns.push(conn);
    }
    let nic = if conns.is_empty() {
        None
    } else {
        // every peer at once: the seconds until the last ack, each probe's less its own encoding
        // and its peer's decoding (as each link's are), which slices do not pay
        let all_at_once = async |bytes: usize| -> anyhow::Result<f64> {
            let mut probes = tokio::task::JoinSet::new();
            for (conn, peer) in conns.iter().zip(peers) {
                let (shared, conn, peer) = (Arc::clone(shared), conn.clone(), peer.clone());
                probes.spawn(async move { round_trip(&shared, &conn, &peer, bytes).await });
            }
            let mut last = 0.0f64;
            while let Some(done) = probes.join_next().await {
                last = last.max(done.context("a probe task failed")??.seconds);
            }
            Ok(last)
        };
        let mut best = [f64::INFINITY; 2];
        for _ in 0..3 {
            for (k, &bytes) in sizes[1..].iter().enumerate() {
                best[k] = best[k].min(all_at_once(bytes).await?);
            }
        }
        Some(NicMeasurement {
            peers: conns.len() as u32,
            bytes_per_s: conns.len() as f64 * extra / (best[1] - best[0]).max(1e-9),
        })
    };
    for conn in &conns {
        conn.close(0u32.into(), b"measured");
    }
    Ok((links, nic))
}

/// One probe's round trip: its seconds and this process's CPU seconds over it, both without
/// encoding the probe as a control message, which a slice does not pay; the peer's CPU seconds so
/// far at its ack, and the seconds it spent decoding this probe, which a slice does not pay either.
#[derive(Clone, Copy, Debug, Default)]
struct ProbeTiming {
    seconds: f64,
    cpu_s: f64,
    peer_cpu_s: f64,
    decode_s: f64,
}

async fn round_trip(
    shared: &Shared,
    conn: &Connection,
    peer: &PeerAddress,
    bytes: usize,
) -> anyhow::Result<ProbeTiming> {
    static NEXT_PROBE: AtomicU64 = AtomicU64::new(0);
    let id = NEXT_PROBE.fetch_add(1, Ordering::Relaxed);
    let (done, wait) = oneshot::channel();
    shared
        .probes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, done);
    let payload = vec![0; bytes];
    let (start, cpu) = (Instant::now(), process_cpu_s());
    let (msg, encode_s) = timed(|| control::encode(&Control::Probe { id, payload }));
    send_control(conn, &msg).await?;
    let (peer_cpu_s, decode_s) = tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .with_context(|| format!("no answer from {} to a {bytes}-byte probe", peer.name))?
        .context("probe abandoned")?;
    Ok(ProbeTiming {
        seconds: start.elapsed().as_secs_f64() - encode_s - decode_s,
        cpu_s: process_cpu_s() - cpu - encode_s,
        peer_cpu_s,
        decode_s,
    })
}

/// `f()` and the seconds it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}

/// CPU seconds this process has used, user and system.
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

async fn dial(node: &QuicNode, peer: &PeerAddress) -> anyhow::Result<Connection> {
    let addr = tokio::net::lookup_host(&peer.endpoint)
        .await
        .with_context(|| format!("resolving {} ({})", peer.name, peer.endpoint))?
        .next()
        .with_context(|| format!("{} ({}) resolves to no address", peer.name, peer.endpoint))?;
    node.connect(addr, &node_name(&peer.name))
        .await
        .with_context(|| format!("connecting to {} ({})", peer.name, peer.endpoint))
}

/// A running job on this worker.
struct Job {
    driver: Connection,
    graph: Arc<Graph>,
    plan: Arc<StepPlan>,
    /// The samples of each step's batch that this worker's devices read.
    samples: SamplesRead,
    staged: Arc<Staged>,
    /// The training samples, where this worker reads its devices' own.
    dataset: Option<Arc<dyn Dataset>>,
    first_device: usize,
    devices: Vec<ActorRef<DeviceActor>>,
    peers: Vec<Connection>,
    heartbeat: tokio::task::JoinHandle<()>,
    watch_driver: tokio::task::JoinHandle<()>,
}

async fn start_job(
    node: &QuicNode,
    shared: &Arc<Shared>,
    driver: &Connection,
    spec: JobSpec,
    events: &mpsc::UnboundedSender<Event>,
) -> anyhow::Result<Job> {
    let me = spec.me as usize;
    let this = spec
        .hosts
        .get(me)
        .with_context(|| format!("job: worker index {me} of {} hosts", spec.hosts.len()))?;
    if this.peer.name != shared.name || this.devices as usize != shared.devices {
        anyhow::bail!(
            "job: sent to {} with {} device(s), but this is worker {} with {}",
            this.peer.name,
            this.devices,
            shared.name,
            shared.devices
        );
    }
    let mut next = 0u32;
    for h in &spec.hosts {
        if h.first_device != next {
            anyhow::bail!(
                "job: host {} starts at device {}, expected {next}",
                h.peer.name,
                h.first_device
            );
        }
        next += h.devices;
    }
    let total = next as usize;
    let graph = Graph::from_json(&spec.graph_json, "the job's model")?;
    // The driver's hosts file was held to this bound; a job from elsewhere is held to it here,
    // before anything is sized by the device count.
    if total > crate::hosts::MAX_DEVICES {
        anyhow::bail!(
            "job: {total} devices in all, more than the {} a cluster may have",
            crate::hosts::MAX_DEVICES
        );
    }
    let configs = Strategy::from_json(&spec.strategy_json, "the job's strategy")?
        .to_configs(&graph, total)?;
    // Refused before the plan and the devices allocate anything; the driver checked its own share.
    let first_device = this.first_device as usize;
    // each host is one node, as the driver plans it
    let nodes = Nodes::of_sizes(spec.hosts.iter().map(|h| h.devices as usize));
    let device_memory = legion_ops::memory::per_device(&graph, &configs, nodes.clone());
    let need = crate::memory::HostNeed {
        devices: &device_memory[first_device..first_device + shared.devices],
        job_state: 0,
        place: format!("worker {}'s {} device(s)", shared.name, shared.devices),
    };
    match &shared.placement {
        // Devices on GPUs keep their instances in GPU memory, which workers sharing a GPU share.
        Placement::Gpus(gpus) => {
            let ordinals: Vec<usize> = gpus.iter().map(|g| g.context().ordinal()).collect();
            crate::memory::check_gpus_free(&graph, need.devices, &ordinals, &need.place, |o| {
                let cuda = gpus
                    .iter()
                    .find(|g| g.context().ordinal() == o)
                    .expect("an ordinal of these GPUs");
                cuda.available_memory_bytes()
                    .with_context(|| format!("reading GPU {o}'s free memory"))
            })?;
        }
        _ => {
            if let Some(available) = crate::memory::available() {
                crate::memory::check_fits(&graph, &need, available)?;
            }
        }
    }
    let precision = spec.precision().map_err(anyhow::Error::msg)?;
    let dataset = match &spec.data_json {
        Some(json) => Some(open_job_data(json, &graph, &shared.name).await?),
        None => None,
    };
    let plan = Arc::new(match spec.inference {
        true => StepPlan::build_with_inference(&graph, &configs, nodes, precision)?,
        false => StepPlan::build_in(&graph, &configs, nodes, precision)?,
    });
    let graph = Arc::new(graph);

    let quic = Arc::new(QuicTransport::new(tokio::runtime::Handle::current(), None));
    let mut peers = Vec::new();
    for (i, h) in spec.hosts.iter().enumerate() {
        if i == me {
            continue;
        }
        let conn = dial(node, &h.peer).await?;
        for d in h.first_device..h.first_device + h.devices {
            quic.route(d as usize, conn.clone());
        }
        peers.push(conn);
    }
    let first_device = this.first_device as usize;
    let programs: Vec<Arc<DeviceProgram>> = plan.programs
        [first_device..first_device + shared.devices]
        .iter()
        .cloned()
        .map(Arc::new)
        .collect();
    let transport = Arc::new(InProcessTransport::with_remote(first_device, quic));
    let sgd = legion_ops::train::Sgd {
        lr: spec.lr,
        momentum: spec.momentum,
        weight_decay: spec.weight_decay,
        nesterov: spec.nesterov,
    };
    let placement = job_placement(&shared.placement, &spec)?;
    let devices = spawn_local_devices(
        &programs,
        &graph,
        spec.seed,
        sgd,
        Arc::clone(&transport),
        &placement,
    )?;
    *shared
        .job_devices
        .write()
        .unwrap_or_else(|e| e.into_inner()) = Some(transport);
    *shared.job_of.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(driver.remote_address().to_string());

    let heartbeat = {
        let driver = driver.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(HEARTBEAT_INTERVAL);
            for seq in 0u64.. {
                ticks.tick().await;
                if send_heartbeat(&driver, &control::encode(&Control::Heartbeat { seq }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let watch_driver = {
        let driver = driver.clone();
        let events = events.clone();
        tokio::spawn(async move {
            driver.closed().await;
            let _ = events.send(Event::DriverGone(driver.stable_id()));
        })
    };
    tracing::info!(devices = ?(first_device..first_device + shared.devices), total, "job started");
    let samples = plan.samples_read(&graph, first_device..first_device + shared.devices);
    Ok(Job {
        driver: driver.clone(),
        graph,
        plan,
        samples,
        staged: Arc::default(),
        dataset,
        first_device,
        devices,
        peers,
        heartbeat,
        watch_driver,
    })
}

/// Opens the job's training data as the driver did (`DataSource`), in samples of the model's
/// input, off the request loop (a folder's headers are read).
async fn open_job_data(
    json: &str,
    graph: &Graph,
    worker: &str,
) -> anyhow::Result<Arc<dyn Dataset>> {
    let source: DataSource =
        serde_json::from_str(json).context("job: the data the workers read (data_json)")?;
    let spec = source.spec.clone();
    let dataset = tokio::task::spawn_blocking(move || source.open())
        .await
        .context("opening the job's data")?
        .with_context(|| {
            format!(
                "worker {worker} cannot open --data {spec}: every host must read the same                  files at that path (or train with --data-on-driver)"
            )
        })?;
    anyhow::ensure!(
        dataset.sample_len() == graph.input_sample_len(),
        "job: --data {spec} has samples of {} values, where the model reads {}",
        dataset.sample_len(),
        graph.input_sample_len()
    );
    Ok(dataset)
}

/// Reads a `Stage`'s samples (`SampleImages::Read`, at most a `batch`) from `dataset` and
/// stages their values; the answer lists the samples that could not be read, or is `Failed`
/// where the request is impossible or the labels read are not the driver's (other files).
async fn read_stage(
    dataset: Arc<dyn Dataset>,
    staged: &Staged,
    step: u64,
    batch: usize,
    samples: StepSamples,
) -> Control {
    let StepSamples {
        images,
        image_samples,
        labels,
        label_samples,
    } = samples;
    let SampleImages::Read { epoch, indices } = images else {
        unreachable!("only samples to read are read")
    };
    let range = as_usize(image_samples.clone());
    let read = tokio::task::spawn_blocking(move || {
        // Sized before anything is allocated for them.
        anyhow::ensure!(
            indices.len() == range.len() && range.len() <= batch,
            "step {step}: {} samples to read for samples {range:?} of a batch of {batch}",
            indices.len()
        );
        let len = dataset.num_samples();
        let indices: Vec<usize> = indices
            .iter()
            .map(|&i| usize::try_from(i).ok().filter(|&i| i < len))
            .collect::<Option<_>>()
            .with_context(|| format!("step {step}: a sample beyond the data's {len}"))?;
        let read = legion_ops::data::read_at(dataset.as_ref(), epoch, &indices)?;
        Ok((indices, range, read))
    })
    .await
    .map_err(anyhow::Error::from)
    .and_then(|r| r);
    let (indices, range, read) = match read {
        Ok(read) => read,
        Err(e) => return failed(e),
    };
    if !read.unreadable.is_empty() {
        let unreadable = read.unreadable.into_iter();
        return Control::Staged {
            step,
            unreadable: unreadable.map(|(i, why)| (i as u64, why)).collect(),
        };
    }
    // Where this worker reads a sample's image and its label, the label it read is the driver's.
    let given = as_usize(label_samples.clone());
    for (at, &label) in range.clone().zip(&read.labels) {
        if let Some(&want) = at.checked_sub(given.start).and_then(|k| labels.get(k))
            && given.contains(&at)
            && want != label
        {
            return failed(anyhow::anyhow!(
                "step {step}: sample {} has label {label} here and {want} at the driver: the \
                 hosts read different files",
                indices[at - range.start]
            ));
        }
    }
    let samples = StepSamples {
        images: SampleImages::Values(read.values),
        image_samples,
        labels,
        label_samples,
    };
    staged.put(step, samples);
    Control::Staged {
        step,
        unreadable: Vec::new(),
    }
}

/// Where the job's devices run: the worker's own placement, its GPUs computing as the job asks
/// (`--tf32`, `--conv-algos`, `--no-fused-epilogue` of the driver). A GPU the worker started
/// with other settings gets a backend of its own for the job (the same device and context; the
/// kernels were compiled when the worker started). A worker on cores ignores the GPU settings.
fn job_placement(placement: &Placement, spec: &JobSpec) -> anyhow::Result<Placement> {
    let Placement::Gpus(gpus) = placement else {
        return Ok(placement.clone());
    };
    let settings = spec.gpu_settings().map_err(anyhow::Error::msg)?;
    let gpus = gpus
        .iter()
        .map(|cuda| {
            if cuda.math() == settings.math
                && cuda.conv_algos() == settings.conv_algos
                && cuda.conv_epilogue() == settings.conv_epilogue
            {
                return Ok(Arc::clone(cuda));
            }
            let ordinal = cuda.context().ordinal();
            legion_cuda::Cuda::with_settings(ordinal, settings)
                .map(Arc::new)
                .with_context(|| {
                    format!(
                        "job: GPU {ordinal} with gpu_math {}, conv_algos {} and conv_epilogue {}",
                        spec.gpu_math, spec.conv_algos, spec.conv_epilogue
                    )
                })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Placement::Gpus(gpus))
}

/// How long a `Step` without samples waits for the `Stage` that carries them.
const STAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Samples `Stage`s sent ahead, by step, waiting for their steps. A `Step` may arrive before its
/// samples (every control message is a QUIC stream of its own, and a large one can finish after a
/// later small one), and the next step's may arrive before a step has taken its own; so steps
/// wait here for theirs, and at most a few are held at once.
#[derive(Default)]
struct Staged {
    by_step: Mutex<BTreeMap<u64, StepSamples>>,
    arrived: tokio::sync::Notify,
}

impl Staged {
    fn put(&self, step: u64, samples: StepSamples) {
        self.by_step
            .lock()
            .expect("staged samples")
            .insert(step, samples);
        self.arrived.notify_waiters();
    }

    async fn take(&self, step: u64) -> anyhow::Result<StepSamples> {
        let deadline = tokio::time::Instant::now() + STAGE_TIMEOUT;
        loop {
            // Registered before the check, so a `put` in between is not missed.
            let arrived = self.arrived.notified();
            {
                let mut by_step = self.by_step.lock().expect("staged samples");
                if let Some(samples) = by_step.remove(&step) {
                    // Anything older belongs to steps that ran without it.
                    by_step.retain(|&s, _| s > step);
                    return Ok(samples);
                }
            }
            tokio::time::timeout_at(deadline, arrived)
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "step {step}: its samples, sent ahead, did not arrive within {}s",
                        STAGE_TIMEOUT.as_secs()
                    )
                })?;
        }
    }
}

/// The input of step `step`: the samples it came with or those staged for it, checked against
/// what this worker's devices read (the bytes came from the network).
async fn step_input(
    step: u64,
    samples: Option<StepSamples>,
    staged: &Staged,
    graph: &Graph,
    needed: &SamplesRead,
) -> anyhow::Result<StepInput> {
    let samples = match samples {
        Some(s) => s,
        None => staged.take(step).await?,
    };
    let input = StepInput {
        step,
        images: samples.images.into_values(graph.input_sample_len())?,
        image_samples: as_usize(samples.image_samples),
        labels: samples.labels,
        label_samples: as_usize(samples.label_samples),
        lr: None,
    };
    check_batch(graph, &input.view(), needed)?;
    Ok(input)
}

/// `input` at the step's learning rate, refused where the bytes say something no SGD step takes.
fn with_lr(input: StepInput, lr: Option<f32>) -> anyhow::Result<StepInput> {
    if let Some(lr) = lr
        && !(lr.is_finite() && lr >= 0.0)
    {
        anyhow::bail!("step {}: a learning rate of {lr}", input.step);
    }
    Ok(StepInput { lr, ..input })
}

/// Runs a step on the local devices and makes the driver's answer.
async fn step_answer(
    devices: &[ActorRef<DeviceActor>],
    part: Part,
    step: u64,
    input: StepInput,
    trace: bool,
) -> Control {
    match run_step(devices, part, step, Arc::new(input), trace).await {
        Ok(reports) => Control::StepDone {
            step,
            reports: reports
                .into_iter()
                .map(|r| DeviceReport {
                    device: r.device as u32,
                    loss_sum: r.outcome.loss_sum,
                    correct: r.outcome.correct as u64,
                    error: r.error,
                    events: r.events.iter().map(|e| (e.op, e.start, e.end)).collect(),
                })
                .collect(),
        },
        Err(e) => failed(e.into()),
    }
}

/// A sample range from the network; an impossible one (beyond `usize`) becomes an empty range
/// that `check_batch` then refuses if the devices need samples.
fn as_usize(r: std::ops::Range<u64>) -> std::ops::Range<usize> {
    match (usize::try_from(r.start), usize::try_from(r.end)) {
        (Ok(start), Ok(end)) => start..end,
        _ => 0..0,
    }
}

fn end_job(shared: &Shared, job: Option<Job>) {
    let Some(job) = job else { return };
    *shared
        .job_devices
        .write()
        .unwrap_or_else(|e| e.into_inner()) = None;
    *shared.job_of.lock().unwrap_or_else(|e| e.into_inner()) = None;
    job.heartbeat.abort();
    job.watch_driver.abort();
    for d in &job.devices {
        d.kill();
    }
    for p in &job.peers {
        p.close(0u32.into(), b"job ended");
    }
    // Other workers sharing the GPU count this process's pooled memory as used: what the ended
    // job's devices have already freed goes back to the driver (their actors stop on their own
    // time, so a later job's check also counts this process's pool as its own, see
    // `Cuda::available_memory_bytes`).
    if let Placement::Gpus(gpus) = &shared.placement {
        for cuda in gpus {
            if let Err(e) = cuda.release_pooled_memory() {
                tracing::warn!("releasing GPU memory after the job: {e}");
            }
        }
    }
    tracing::info!("job ended");
}

impl Job {
    /// Handles a job request; `None` when the reply is sent later by a task of its own.
    async fn handle(&self, request: Control, conn: &Connection) -> Option<Control> {
        match request {
            Control::Load { pieces } => Some(match self.load(pieces).await {
                Ok(()) => Control::Loaded,
                Err(e) => failed(e),
            }),
            Control::Read { pieces } => Some(match self.read(pieces).await {
                Ok(pieces) => Control::ReadDone { pieces },
                Err(e) => failed(e),
            }),
            Control::Stage { step, samples } => {
                if !matches!(samples.images, SampleImages::Read { .. }) {
                    self.staged.put(step, samples);
                    return None;
                }
                let Some(dataset) = self.dataset.clone() else {
                    return Some(Control::Failed {
                        message: "samples to read, in a job that reads no data".into(),
                    });
                };
                let (conn, staged) = (conn.clone(), self.staged.clone());
                let batch = self.graph.batch();
                tokio::spawn(async move {
                    let answer = read_stage(dataset, &staged, step, batch, samples).await;
                    reply(&conn, &answer).await;
                });
                None
            }
            Control::Step {
                step,
                samples,
                trace,
                lr,
            } => {
                let devices = self.devices.clone();
                let conn = conn.clone();
                let graph = self.graph.clone();
                let needed = self.samples.clone();
                let staged = self.staged.clone();
                tokio::spawn(async move {
                    let input = step_input(step, samples, &staged, &graph, &needed).await;
                    let answer = match input.and_then(|input| with_lr(input, lr)) {
                        Ok(input) => step_answer(&devices, Part::Step, step, input, trace).await,
                        Err(e) => failed(e),
                    };
                    reply(&conn, &answer).await;
                });
                None
            }
            Control::Infer { run, samples } => {
                if self.plan.inference.is_none() {
                    return Some(Control::Failed {
                        message: "this job was started without inference".into(),
                    });
                }
                let devices = self.devices.clone();
                let conn = conn.clone();
                let images_only = SamplesRead {
                    images: self.samples.images.clone(),
                    labels: 0..0,
                };
                let checked = samples
                    .images
                    .into_values(self.graph.input_sample_len())
                    .and_then(|images| {
                        let input = StepInput {
                            step: run,
                            images,
                            image_samples: as_usize(samples.image_samples),
                            labels: Vec::new(),
                            label_samples: 0..0,
                            lr: None,
                        };
                        check_batch(&self.graph, &input.view(), &images_only)?;
                        Ok(input)
                    });
                tokio::spawn(async move {
                    let answer = match checked {
                        Ok(input) => {
                            step_answer(&devices, Part::Inference, run, input, false).await
                        }
                        Err(e) => failed(e),
                    };
                    reply(&conn, &answer).await;
                });
                None
            }
            other => Some(Control::Failed {
                message: format!("not a job request: {}", other.name()),
            }),
        }
    }

    /// The local actor, instance and rect a piece names, checked against the plan (the bytes came
    /// from the network).
    fn locate(
        &self,
        at: &PieceRef,
    ) -> anyhow::Result<(
        &ActorRef<DeviceActor>,
        u32,
        Rect,
        legion_runtime::region::DType,
    )> {
        let local = (at.device as usize)
            .checked_sub(self.first_device)
            .filter(|&i| i < self.devices.len())
            .with_context(|| format!("device {} is not on this worker", at.device))?;
        let program = &self.plan.programs[at.device as usize];
        let instance = program
            .instances
            .get(at.instance as usize)
            .with_context(|| format!("device {} has no instance {}", at.device, at.instance))?;
        let ndim = instance.rect.ndim();
        let rect = at.rect(ndim).with_context(|| {
            format!("piece rect {:?}..{:?} is not a {ndim}-d rect", at.lo, at.hi)
        })?;
        if !instance.rect.contains(&rect) {
            anyhow::bail!(
                "piece rect {:?}..{:?} is outside instance {} of device {}",
                at.lo,
                at.hi,
                at.instance,
                at.device
            );
        }
        Ok((&self.devices[local], at.instance, rect, instance.dtype))
    }

    async fn load(&self, pieces: Vec<Piece>) -> anyhow::Result<()> {
        let mut per_device: HashMap<u32, Vec<(u32, Rect, Buffer)>> = HashMap::new();
        for piece in pieces {
            let (_, instance, rect, dtype) = self.locate(&piece.at)?;
            let data = Buffer::from(piece.data);
            if data.dtype() != dtype || data.len() != rect.volume() {
                anyhow::bail!(
                    "piece of instance {} on device {}: {} {:?} values for a rect of {} {:?}",
                    instance,
                    piece.at.device,
                    data.len(),
                    data.dtype(),
                    rect.volume(),
                    dtype
                );
            }
            per_device
                .entry(piece.at.device)
                .or_default()
                .push((instance, rect, data));
        }
        for (device, pieces) in per_device {
            let actor = &self.devices[device as usize - self.first_device];
            actor
                .ask(Load(pieces))
                .await
                .map_err(|e| anyhow::anyhow!("device {device}: {e}"))?;
        }
        Ok(())
    }

    async fn read(&self, pieces: Vec<PieceRef>) -> anyhow::Result<Vec<PieceData>> {
        let mut out = Vec::with_capacity(pieces.len());
        for at in &pieces {
            let (actor, instance, rect, _) = self.locate(at)?;
            let piece = actor
                .ask(ReadInstance { instance, rect })
                .await
                .map_err(|e| anyhow::anyhow!("device {}: {e}", at.device))?;
            out.push(PieceData::from(piece.0));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::SampleImages;

    fn samples(label: u32) -> StepSamples {
        StepSamples {
            images: SampleImages::none(),
            image_samples: 0..0,
            labels: vec![label],
            label_samples: 0..1,
        }
    }

    #[test]
    fn staged_samples_reach_their_step_in_any_order() {
        let runtime = crate::net::runtime().unwrap();
        runtime.block_on(async {
            let staged = Arc::new(Staged::default());
            // The step asks before its samples arrive, and the next step's arrive first.
            let waiting = tokio::spawn({
                let staged = staged.clone();
                async move { staged.take(4).await.unwrap() }
            });
            tokio::task::yield_now().await;
            staged.put(5, samples(5));
            staged.put(4, samples(4));
            assert_eq!(waiting.await.unwrap(), samples(4));
            assert_eq!(staged.take(5).await.unwrap(), samples(5));
            // Samples of a step that ran without them are dropped once a later step takes its own.
            staged.put(6, samples(6));
            staged.put(7, samples(7));
            staged.take(7).await.unwrap();
            assert!(staged.by_step.lock().unwrap().is_empty());
        });
    }

    /// A folder of 2 classes of 3 PNGs, the last of class 1 cut short after opening.
    fn folder() -> (tempfile::TempDir, Arc<dyn Dataset>) {
        let dir = tempfile::tempdir().unwrap();
        for class in 0..2u8 {
            let sub = dir.path().join(format!("c{class}"));
            std::fs::create_dir(&sub).unwrap();
            for i in 0..3u8 {
                let image = image::RgbImage::from_fn(9, 7, |x, y| {
                    image::Rgb([x as u8 * 20, y as u8 * 20 + class * 100, i * 60])
                });
                image.save(sub.join(format!("{i}.png"))).unwrap();
            }
        }
        let data = legion_ops::data::Data::Folder(dir.path().to_path_buf());
        let dataset = data
            .open([3, 4, 4], 2, 1, legion_ops::data::Transforms::TRAIN)
            .unwrap();
        let cut = dir.path().join("c1/2.png");
        let whole = std::fs::read(&cut).unwrap();
        std::fs::write(&cut, &whole[..whole.len() / 2]).unwrap();
        (dir, dataset)
    }

    fn to_read(indices: Vec<u64>, labels: Vec<u32>) -> StepSamples {
        let n = indices.len() as u64;
        StepSamples {
            images: SampleImages::Read { epoch: 1, indices },
            image_samples: 0..n,
            labels,
            label_samples: 0..n,
        }
    }

    #[test]
    fn data_a_worker_cannot_open_is_named_with_the_way_out() {
        let (dir, dataset) = folder();
        let data = legion_ops::data::Data::Folder(dir.path().to_path_buf());
        let transforms = legion_ops::data::Transforms::TRAIN;
        let source = DataSource::of(&data, dataset.as_ref(), [3, 4, 4], 2, 1, transforms, None);
        let elsewhere = DataSource {
            spec: "folder:/nonexistent/legion-rs-images".into(),
            ..source.unwrap()
        };
        let json = serde_json::to_string(&elsewhere).unwrap();
        let graph = legion_ops::zoo::find("lenet5").unwrap();
        let graph = graph.build(&graph.default_config(2)).unwrap();
        let runtime = crate::net::runtime().unwrap();
        let err = runtime
            .block_on(open_job_data(&json, &graph, "w1"))
            .err()
            .unwrap();
        let err = format!("{err:#}");
        for part in [
            "worker w1",
            "/nonexistent/legion-rs-images",
            "--data-on-driver",
        ] {
            assert!(err.contains(part), "{err}");
        }
    }

    #[test]
    fn samples_a_worker_reads_are_staged_listed_unreadable_or_refused() {
        let (_dir, dataset) = folder();
        let runtime = crate::net::runtime().unwrap();
        runtime.block_on(async {
            let staged = Staged::default();
            let read =
                |step, batch, samples| read_stage(dataset.clone(), &staged, step, batch, samples);
            // read and staged: the values one device reads
            let answer = read(1, 2, to_read(vec![4, 0], vec![1, 0])).await;
            assert_eq!(
                answer,
                Control::Staged {
                    step: 1,
                    unreadable: vec![]
                }
            );
            let got = staged.take(1).await.unwrap();
            let mut want = vec![0.0; 2 * 48];
            dataset.sample(4, 1, &mut want[..48]).unwrap();
            dataset.sample(0, 1, &mut want[48..]).unwrap();
            assert_eq!(got.images, SampleImages::Values(want));
            // the cut-short file is listed, and nothing is staged
            let answer = read(2, 2, to_read(vec![5, 1], vec![1, 0])).await;
            let Control::Staged { unreadable, .. } = answer else {
                panic!("{answer:?}")
            };
            assert_eq!(unreadable.len(), 1, "{unreadable:?}");
            assert_eq!(unreadable[0].0, 5);
            assert!(unreadable[0].1.contains("2.png"), "{unreadable:?}");
            assert!(staged.by_step.lock().unwrap().is_empty());
            // another label than the driver's: other files; more than a batch; beyond the data
            let refused = [
                (to_read(vec![0], vec![1]), "the hosts read different files"),
                (to_read(vec![0, 1, 2], vec![0, 0, 0]), "of a batch of 2"),
                (to_read(vec![6], vec![0]), "beyond the data's 6"),
            ];
            for (samples, why) in refused {
                match read(3, 2, samples).await {
                    Control::Failed { message } => assert!(message.contains(why), "{message}"),
                    other => panic!("{other:?}"),
                }
            }
        });
    }
}
