//! The driver of a training job on a cluster of worker processes (`legion-rs train --cluster`):
//! the multi-process counterpart of the runtime's `EmbeddedCluster`, with the same interface. It
//! plans nothing itself beyond the step plan both sides derive; it sends the job to every worker,
//! loads their initial instances, sends each step's batch, and gathers the weights back.
//!
//! Failure detection: every worker of a running job sends a heartbeat every
//! [`HEARTBEAT_INTERVAL`]; whenever the driver waits on workers it also checks that each one was
//! heard from (a heartbeat, or any data on its connection's streams) within [`HEARTBEAT_TIMEOUT`]
//! and that its connection is open, and fails naming the first one that is not.

use crate::control::{
    self, Control, JobHost, JobSpec, PeerAddress, Piece, PieceData, PieceRef, SampleImages,
    StepSamples,
};
use crate::hosts::{Host, Hosts};
use crate::net::quic::{
    CLOSE_MALFORMED, CLOSE_SHUTDOWN, Inbound, QuicNode, QuicOptions, send_control,
};
use crate::net::tls::{NodeIdentity, node_name};
use crate::worker::HEARTBEAT_INTERVAL;
use anyhow::{Context as _, bail};
use legion_ops::data::{ByteImages, DataSource};
use legion_ops::partition::ParallelConfig;
use legion_ops::strategy::Strategy;
use legion_ops::train::{ParamStore, Sgd, StepStats, TrainingState};
use legion_ops::{Graph, Rect};
use legion_runtime::Buffer;
use legion_runtime::plan::{SamplesRead, StepPlan};
use legion_runtime::region::{DType, RegionId};
use legion_runtime::{BatchView, TaskOutcome};
use legion_runtime::{OpEvent, StepReport};
use legion_runtime::{StepResult, check_batch, initial_instances};
use quinn::Connection;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A worker not heard from for this long is taken for dead (six missed heartbeats: a loaded
/// 2-core machine can delay one by a second).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long to wait for a worker to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a worker busy with another driver's job is waited for: a driver that died without
/// closing its connections leaves its job until the worker's QUIC idle timeout (10 s) ends it.
pub const BUSY_WAIT: Duration = Duration::from_secs(12);
/// The name of the launcher's and drivers' certificate in the state directory.
pub const LAUNCHER_NAME: &str = "launcher";

/// A worker of a running job that is gone (its connection closed) or silent for
/// [`HEARTBEAT_TIMEOUT`]: what a job may recover from by re-planning on the workers left.
#[derive(Debug, thiserror::Error)]
#[error("{who} {why}")]
pub struct WorkerLost {
    /// The worker's index in the hosts file.
    pub worker: usize,
    /// `worker NAME (ADDRESS)`.
    pub who: String,
    pub why: String,
}

impl WorkerLost {
    /// The lost worker `error` (or any error it was given as context for) reports, if any.
    pub fn in_error(error: &anyhow::Error) -> Option<&WorkerLost> {
        error.chain().find_map(|e| e.downcast_ref::<WorkerLost>())
    }
}

/// Samples of a step's batch that the workers could not read themselves: the step did not run,
/// and runs once its batch replaces them (`Loader::mark_unreadable`).
#[derive(Debug, thiserror::Error)]
#[error(
    "step {step}: the workers could not read {} sample(s), the first: {}",
    samples.len(),
    samples.first().map_or("", |(_, why)| why.as_str())
)]
pub struct UnreadableSamples {
    pub step: u64,
    /// Dataset index and why.
    pub samples: Vec<(usize, String)>,
}

impl UnreadableSamples {
    pub fn in_error(error: &anyhow::Error) -> Option<&UnreadableSamples> {
        error
            .chain()
            .find_map(|e| e.downcast_ref::<UnreadableSamples>())
    }

    /// `Ok` where nothing was unreadable.
    fn check(step: u64, unreadable: Vec<(u64, String)>) -> anyhow::Result<()> {
        if unreadable.is_empty() {
            return Ok(());
        }
        let samples = unreadable
            .into_iter()
            .map(|(i, why)| (usize::try_from(i).unwrap_or(usize::MAX), why))
            .collect();
        Err(UnreadableSamples { step, samples }.into())
    }
}

/// A client of the workers of a cluster: the launcher (`up`, `status`, `down`) and job drivers.
pub struct WorkerClient {
    pub runtime: tokio::runtime::Runtime,
    node: QuicNode,
    hosts: Vec<Host>,
    conns: Vec<Option<Connection>>,
    replies: Vec<tokio::sync::Mutex<mpsc::UnboundedReceiver<Control>>>,
    conn_index: Arc<RwLock<HashMap<usize, usize>>>,
    health: Arc<Health>,
}

/// When each worker was last heard from, in milliseconds since `epoch`: a heartbeat, or any data
/// its application sent (a worker sending a large reply over a slow link is alive even when its
/// heartbeats queue behind the reply in the connection's send buffer). Only stream frames count:
/// QUIC's own keep-alives and acknowledgements would keep a stuck worker's connection looking
/// alive.
struct Health {
    epoch: Instant,
    last_beat: Vec<AtomicU64>,
    /// Stream frames received on each worker's connection at the last check.
    last_rx_frames: Vec<AtomicU64>,
    watching: AtomicBool,
}

impl Health {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl WorkerClient {
    /// A client with the launcher identity of the cluster whose state is in `state`; connects to
    /// no one yet.
    pub fn new(hosts: &Hosts, state: &Path) -> anyhow::Result<WorkerClient> {
        let identity = NodeIdentity::load(state, LAUNCHER_NAME).with_context(|| {
            format!(
                "no cluster state in {} (start the cluster with `legion-rs up HOSTS` first)",
                state.display()
            )
        })?;
        let tls = identity.tls()?;
        let runtime = crate::net::runtime()?;
        let n = hosts.hosts.len();
        let (sinks, receivers): (Vec<_>, Vec<_>) =
            (0..n).map(|_| mpsc::unbounded_channel()).unzip();
        let conn_index: Arc<RwLock<HashMap<usize, usize>>> = Arc::default();
        let health = Arc::new(Health {
            epoch: Instant::now(),
            last_beat: (0..n).map(|_| AtomicU64::new(0)).collect(),
            last_rx_frames: (0..n).map(|_| AtomicU64::new(0)).collect(),
            watching: AtomicBool::new(false),
        });
        let handler = {
            let conn_index = Arc::clone(&conn_index);
            let health = Arc::clone(&health);
            Arc::new(move |inbound: Inbound| {
                let Inbound::Control { peer, conn, bytes } = inbound else {
                    tracing::warn!("a slice reached the driver; dropped");
                    return;
                };
                let index = conn_index
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&conn.stable_id())
                    .copied();
                let Some(i) = index else {
                    tracing::warn!(%peer, "control message from a connection of no worker");
                    return;
                };
                match control::decode(&bytes) {
                    Ok(Control::Heartbeat { .. }) => {
                        health.last_beat[i].store(health.now_ms(), Ordering::Relaxed)
                    }
                    Ok(msg) => {
                        let _ = sinks[i].send(msg);
                    }
                    Err(e) => {
                        tracing::error!(%peer, "{e}; closing the connection");
                        conn.close(CLOSE_MALFORMED, b"malformed control message");
                    }
                }
            })
        };
        let bind: SocketAddr = if hosts.hosts.iter().any(|h| h.address.contains(':')) {
            "[::]:0".parse()?
        } else {
            "0.0.0.0:0".parse()?
        };
        let node = {
            let _guard = runtime.enter();
            QuicNode::bind(bind, &tls, &QuicOptions::default(), handler)?
        };
        Ok(WorkerClient {
            runtime,
            node,
            hosts: hosts.hosts.clone(),
            conns: vec![None; n],
            replies: receivers.into_iter().map(tokio::sync::Mutex::new).collect(),
            conn_index,
            health,
        })
    }

    fn who(&self, i: usize) -> String {
        format!(
            "worker {} ({})",
            self.hosts[i].name,
            self.hosts[i].endpoint()
        )
    }

    /// Connects to worker `i` within `timeout`.
    pub fn connect(&mut self, i: usize, timeout: Duration) -> anyhow::Result<()> {
        let host = &self.hosts[i];
        let who = self.who(i);
        let lost = |why: String| WorkerLost {
            worker: i,
            who: who.clone(),
            why,
        };
        let conn: anyhow::Result<Connection> = self.runtime.block_on(async {
            let addr = tokio::net::lookup_host(host.endpoint())
                .await
                .with_context(|| format!("{who}: resolving the address"))?
                .next()
                .with_context(|| format!("{who}: the address resolves to nothing"))?;
            match tokio::time::timeout(timeout, self.node.connect(addr, &node_name(&host.name)))
                .await
            {
                Err(_) => Err(lost(format!("did not answer within {timeout:?}")).into()),
                Ok(Err(e)) => Err(lost(format!("is not reachable: {e:#}")).into()),
                Ok(Ok(conn)) => Ok(conn),
            }
        });
        let conn: Connection = conn?;
        self.conn_index
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn.stable_id(), i);
        self.conns[i] = Some(conn);
        Ok(())
    }

    /// Connects to every worker, naming the first one that does not answer.
    pub fn connect_all(&mut self) -> anyhow::Result<()> {
        for i in 0..self.hosts.len() {
            self.connect(i, CONNECT_TIMEOUT).with_context(|| {
                "is the cluster up? (`legion-rs up HOSTS`, `legion-rs status HOSTS`)".to_string()
            })?;
        }
        Ok(())
    }

    fn conn(&self, i: usize) -> anyhow::Result<&Connection> {
        self.conns[i]
            .as_ref()
            .with_context(|| format!("{}: not connected", self.who(i)))
    }

    /// Sends already encoded `bytes` to worker `i`.
    pub async fn send_encoded(&self, i: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let sent = send_control(self.conn(i)?, bytes)
            .await
            .with_context(|| format!("{}: sending a request", self.who(i)));
        // A connection that closed between requests is a lost worker, as one found closed
        // while waiting for a reply is.
        match (sent, self.lost(i)) {
            (Err(_), Some(lost)) => Err(lost.into()),
            (sent, _) => sent,
        }
    }

    pub async fn send(&self, i: usize, msg: &Control) -> anyhow::Result<()> {
        self.send_encoded(i, &control::encode(msg)).await
    }

    /// The next reply of worker `i`, checking meanwhile that every worker is alive while a job
    /// runs (only worker `i` otherwise). A `Failed` reply is an error naming the worker.
    pub async fn reply(&self, i: usize, timeout: Option<Duration>) -> anyhow::Result<Control> {
        let mut replies = self.replies[i].lock().await;
        let mut check = tokio::time::interval(Duration::from_millis(100));
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            tokio::select! {
                msg = replies.recv() => return match msg {
                    Some(Control::Failed { message }) => bail!("{}: {message}", self.who(i)),
                    Some(msg) => Ok(msg),
                    None => bail!("{}: the reply channel closed", self.who(i)),
                },
                _ = check.tick() => {
                    // A job needs every worker; a launcher's request only the one it asked.
                    match self.health.watching.load(Ordering::Relaxed) {
                        true => self.check_health()?,
                        false => if let Some(lost) = self.lost(i) {
                            return Err(lost.into());
                        },
                    }
                    if deadline.is_some_and(|d| Instant::now() > d) {
                        bail!("{} did not reply within {:?}", self.who(i), timeout.unwrap());
                    }
                }
            }
        }
    }

    /// Sends `msg` to worker `i` and waits for its reply.
    pub fn request(
        &self,
        i: usize,
        msg: &Control,
        timeout: Option<Duration>,
    ) -> anyhow::Result<Control> {
        self.runtime.block_on(async {
            self.send(i, msg).await?;
            self.reply(i, timeout).await
        })
    }

    /// Fails naming the first worker whose connection closed or (while a job runs) whose
    /// heartbeats stopped.
    fn check_health(&self) -> anyhow::Result<()> {
        match (0..self.conns.len()).find_map(|i| self.lost(i)) {
            Some(lost) => Err(lost.into()),
            None => Ok(()),
        }
    }

    /// Whether worker `i`'s connection closed or (while a job runs) its heartbeats stopped.
    fn lost(&self, i: usize) -> Option<WorkerLost> {
        let conn = self.conns[i].as_ref()?;
        if let Some(reason) = conn.close_reason() {
            return Some(WorkerLost {
                worker: i,
                who: self.who(i),
                why: format!("is gone: {reason}"),
            });
        }
        if !self.health.watching.load(Ordering::Relaxed) {
            return None;
        }
        let received = conn.stats().frame_rx.stream;
        if received > self.health.last_rx_frames[i].swap(received, Ordering::Relaxed) {
            self.health.last_beat[i].store(self.health.now_ms(), Ordering::Relaxed);
        }
        let silent = self
            .health
            .now_ms()
            .saturating_sub(self.health.last_beat[i].load(Ordering::Relaxed));
        (silent > HEARTBEAT_TIMEOUT.as_millis() as u64).then(|| WorkerLost {
            worker: i,
            who: self.who(i),
            why: format!(
                "stopped responding: nothing heard from it (no heartbeat, no data) for {:.1} s",
                silent as f64 / 1e3
            ),
        })
    }

    /// From now on, a worker without a heartbeat for [`HEARTBEAT_TIMEOUT`] is an error.
    fn watch_heartbeats(&self) {
        let now = self.health.now_ms();
        for beat in &self.health.last_beat {
            beat.store(now, Ordering::Relaxed);
        }
        self.health.watching.store(true, Ordering::Relaxed);
    }

    /// Closes every connection.
    pub fn close(&self) {
        for conn in self.conns.iter().flatten() {
            conn.close(CLOSE_SHUTDOWN, b"done");
        }
    }
}

/// A training job running on the workers of a cluster.
pub struct RemoteCluster {
    client: WorkerClient,
    plan: StepPlan,
    graph: Graph,
    ranges: Vec<Range<usize>>,
    /// Per worker, the samples of each batch its devices read.
    samples: Vec<SamplesRead>,
    /// The step whose samples the workers already hold (sent by `Stage`).
    staged: Option<u64>,
    next_step: u64,
    /// Inference's runs so far (numbered apart from the steps).
    inference_runs: u64,
    /// The rate the next steps update at, where a schedule set one.
    lr: Option<f32>,
    /// Bytes of the messages that carried the steps' samples, staged ones included.
    input_bytes_sent: u64,
    /// Samples of the staged step that the workers could not read.
    unreadable_ahead: Option<(u64, Vec<(u64, String)>)>,
}

/// A step's images, as the caller holds them.
#[derive(Clone, Copy, Debug)]
pub enum Images<'a> {
    /// `N·C·H·W` values.
    Values(&'a [f32]),
    /// Their bytes: a quarter of the values' size, made values on the workers.
    Bytes(&'a ByteImages),
    /// Their dataset indices in `epoch`: the workers read them from the job's data.
    Read { epoch: u64, indices: &'a [usize] },
}

impl Images<'_> {
    fn read_by_workers(&self) -> bool {
        matches!(self, Images::Read { .. })
    }
}

impl RemoteCluster {
    /// Starts a job on the running cluster `hosts` (state in `state`): every worker builds the
    /// plan of `graph` under `configs` (with inference beside the step where `inference`, for
    /// [`RemoteCluster::logits`]), and its devices load their part of `state`. With `data`, the
    /// workers open it and read the samples their devices consume ([`Images::Read`]).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        hosts: &Hosts,
        cluster_state: &Path,
        graph: &Graph,
        configs: &[ParallelConfig],
        state: &TrainingState,
        sgd: Sgd,
        seed: u64,
        gpu: legion_cuda::Settings,
        inference: bool,
        data: Option<&DataSource>,
    ) -> anyhow::Result<RemoteCluster> {
        let data_json = data
            .map(serde_json::to_string)
            .transpose()
            .context("the data the workers read")?;
        let gpu_fields = JobSpec::gpu_fields(gpu);
        // The workers plan in the job's precision (`JobSpec::precision`), each host a node: so
        // does the driver.
        let precision = gpu.math.precision();
        let nodes = hosts.nodes();
        let plan = match inference {
            true => StepPlan::build_with_inference(graph, configs, nodes, precision)?,
            false => StepPlan::build_in(graph, configs, nodes, precision)?,
        };
        let started = Instant::now();
        let mut client = WorkerClient::new(hosts, cluster_state)?;
        client.connect_all()?;
        tracing::info!("job start: connected in {:?}", started.elapsed());
        let ranges = hosts.device_ranges();
        let job_hosts: Vec<JobHost> = hosts
            .hosts
            .iter()
            .zip(&ranges)
            .map(|(h, r)| JobHost {
                peer: PeerAddress {
                    name: h.name.clone(),
                    endpoint: h.endpoint(),
                },
                first_device: r.start as u32,
                devices: h.devices as u32,
            })
            .collect();
        let graph_json = graph.to_json();
        let strategy_json = Strategy::from_configs(graph, configs).to_json();
        let n = hosts.hosts.len();
        client.runtime.block_on(async {
            let busy_until = Instant::now() + BUSY_WAIT;
            for i in 0..n {
                greet(&client, i, hosts.hosts[i].devices, busy_until).await?;
            }
            tracing::info!("job start: greeted in {:?}", started.elapsed());
            for i in 0..n {
                let spec = JobSpec {
                    graph_json: graph_json.clone(),
                    strategy_json: strategy_json.clone(),
                    hosts: job_hosts.clone(),
                    me: i as u32,
                    seed,
                    lr: sgd.lr,
                    momentum: sgd.momentum,
                    weight_decay: sgd.weight_decay,
                    nesterov: sgd.nesterov,
                    gpu_math: gpu_fields.gpu_math.clone(),
                    conv_algos: gpu_fields.conv_algos.clone(),
                    conv_epilogue: gpu_fields.conv_epilogue.clone(),
                    inference,
                    data_json: data_json.clone(),
                };
                client.send(i, &Control::StartJob(spec)).await?;
            }
            for i in 0..n {
                expect(&client, i, "StartJob", client.reply(i, None).await?, |m| {
                    matches!(m, Control::JobReady)
                })?;
            }
            tracing::info!("job start: ready in {:?}", started.elapsed());
            client.watch_heartbeats();
            let mut per_worker: Vec<Vec<Piece>> = vec![Vec::new(); n];
            let per_device = initial_instances(&plan, &state.params, Some(&state.momentum));
            for (device, pieces) in per_device.into_iter().enumerate() {
                let w = ranges
                    .iter()
                    .position(|r| r.contains(&device))
                    .expect("device of a host");
                for (instance, rect, data) in pieces {
                    per_worker[w].push(Piece {
                        at: PieceRef::new(device, instance, &rect),
                        data: data.into(),
                    });
                }
            }
            for (i, pieces) in per_worker.into_iter().enumerate() {
                client.send(i, &Control::Load { pieces }).await?;
            }
            for i in 0..n {
                expect(&client, i, "Load", client.reply(i, None).await?, |m| {
                    matches!(m, Control::Loaded)
                })?;
            }
            tracing::info!("job start: loaded in {:?}", started.elapsed());
            Ok::<_, anyhow::Error>(())
        })?;
        let samples = ranges
            .iter()
            .map(|r| plan.samples_read(graph, r.clone()))
            .collect();
        Ok(RemoteCluster {
            client,
            plan,
            graph: graph.clone(),
            samples,
            ranges,
            staged: None,
            next_step: state.step,
            inference_runs: 0,
            lr: None,
            input_bytes_sent: 0,
            unreadable_ahead: None,
        })
    }

    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    /// The checks of a batch's values, of its labels alone: their count and classes.
    fn check_labels(&self, labels: &[u32]) -> anyhow::Result<()> {
        let batch = self.graph.batch();
        let labels_only = SamplesRead {
            images: 0..0,
            labels: 0..batch,
        };
        let view = BatchView {
            images: &[],
            image_samples: 0..0,
            labels,
            label_samples: 0..batch,
        };
        Ok(check_batch(&self.graph, &view, &labels_only)?)
    }

    /// Checks a whole batch and cuts it into what each worker's devices read: under data
    /// parallelism a worker's share of the batch, under model parallelism nothing unless it holds
    /// the input or the loss layer.
    fn split(&self, images: Images<'_>, labels: &[u32]) -> anyhow::Result<Vec<StepSamples>> {
        let batch = self.graph.batch();
        let per_sample = self.graph.input_sample_len();
        let all = SamplesRead {
            images: 0..batch,
            labels: 0..batch,
        };
        match images {
            Images::Values(values) => {
                check_batch(&self.graph, &BatchView::whole(values, labels, batch), &all)?;
            }
            Images::Read { indices, .. } => {
                self.check_labels(labels)?;
                anyhow::ensure!(
                    indices.len() == batch,
                    "{} samples to read, where the model reads {batch}",
                    indices.len()
                );
            }
            Images::Bytes(b) => {
                self.check_labels(labels)?;
                let [c, h, w] = b.image;
                anyhow::ensure!(
                    c * h * w == per_sample && b.bytes.len() == batch * per_sample,
                    "a batch of {} image bytes of {c}x{h}x{w}, where the model reads {batch} \
                     samples of {per_sample} values",
                    b.bytes.len()
                );
            }
        }
        Ok(self
            .samples
            .iter()
            .map(|read| {
                let values = read.images.start * per_sample..read.images.end * per_sample;
                StepSamples {
                    images: match images {
                        Images::Values(v) => SampleImages::Values(v[values].to_vec()),
                        Images::Bytes(b) => {
                            SampleImages::bytes(b.bytes[values].to_vec(), b.image, &b.normalization)
                        }
                        Images::Read { epoch, indices } => SampleImages::Read {
                            epoch,
                            indices: indices[read.images.clone()]
                                .iter()
                                .map(|&i| i as u64)
                                .collect(),
                        },
                    },
                    image_samples: read.images.start as u64..read.images.end as u64,
                    labels: labels[read.labels.clone()].to_vec(),
                    label_samples: read.labels.start as u64..read.labels.end as u64,
                }
            })
            .collect())
    }

    /// Bytes of the steps' and staged batches' messages sent to the workers so far.
    pub fn input_bytes_sent(&self) -> u64 {
        self.input_bytes_sent
    }

    /// The learning rate of the steps from the next on (a schedule's), instead of the job's.
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = Some(lr);
    }

    /// One training step on a batch, as `EmbeddedCluster::step`. With `next`, the batch of the
    /// step after this one, that batch's samples go out to the workers while this step runs, and
    /// the next call (which must pass the same batch) sends none: on a slow network delivering a
    /// batch then overlaps computing the one before.
    pub fn step(
        &mut self,
        images: Images<'_>,
        labels: &[u32],
        next: Option<(Images<'_>, &[u32])>,
        trace: bool,
    ) -> anyhow::Result<StepResult> {
        let step = self.next_step;
        let batch = self.graph.batch();
        let n = self.ranges.len();
        if let Some((ahead, unreadable)) = self.unreadable_ahead.take()
            && ahead == step
        {
            UnreadableSamples::check(step, unreadable)?;
        }
        let mut samples: Vec<Option<StepSamples>> = if self.staged == Some(step) {
            vec![None; n]
        } else {
            self.split(images, labels)?.into_iter().map(Some).collect()
        };
        // Samples the workers read are read before the step starts anywhere: one that cannot be
        // read then stops the step on every worker, and the step runs on its replaced batch.
        if images.read_by_workers() && self.staged != Some(step) {
            let stages: Vec<Vec<u8>> = samples
                .iter_mut()
                .map(|s| {
                    let samples = s.take().expect("split for every worker");
                    control::encode(&Control::Stage { step, samples })
                })
                .collect();
            self.input_bytes_sent += stages.iter().map(|m| m.len() as u64).sum::<u64>();
            let client = &self.client;
            let unreadable = client.runtime.block_on(async {
                for (i, stage) in stages.iter().enumerate() {
                    client.send_encoded(i, stage).await?;
                }
                let mut unreadable = Vec::new();
                for i in 0..n {
                    unreadable.extend(staged_reply(client, i, step, client.reply(i, None).await?)?);
                }
                Ok::<_, anyhow::Error>(unreadable)
            })?;
            UnreadableSamples::check(step, unreadable)?;
        }
        let requests: Vec<Vec<u8>> = samples
            .into_iter()
            .map(|samples| {
                control::encode(&Control::Step {
                    step,
                    samples,
                    trace,
                    lr: self.lr,
                })
            })
            .collect();
        // A next batch that fails its checks is not staged: its own step reports the error.
        let read_ahead = next.is_some_and(|(images, _)| images.read_by_workers());
        let stages: Vec<Vec<u8>> = next
            .and_then(|(images, labels)| self.split(images, labels).ok())
            .map(|per_worker| {
                per_worker
                    .into_iter()
                    .map(|samples| {
                        control::encode(&Control::Stage {
                            step: step + 1,
                            samples,
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.staged = (!stages.is_empty()).then_some(step + 1);
        self.input_bytes_sent += requests
            .iter()
            .chain(&stages)
            .map(|m| m.len() as u64)
            .sum::<u64>();
        let read_ahead = read_ahead && !stages.is_empty();
        let client = &self.client;
        let (mut reports, unreadable_ahead) = client.runtime.block_on(async {
            for (i, request) in requests.iter().enumerate() {
                client.send_encoded(i, request).await?;
            }
            for (i, stage) in stages.iter().enumerate() {
                client.send_encoded(i, stage).await?;
            }
            let mut reports = Vec::new();
            let mut unreadable = Vec::new();
            for i in 0..n {
                // The step's end and the next step's samples read, in either order.
                let (mut done, mut read) = (false, !read_ahead);
                while !(done && read) {
                    match client.reply(i, None).await? {
                        Control::StepDone {
                            step: finished,
                            reports: r,
                        } if finished == step && !done => {
                            reports.extend(r);
                            done = true;
                        }
                        other if !read && matches!(other, Control::Staged { .. }) => {
                            unreadable.extend(staged_reply(client, i, step + 1, other)?);
                            read = true;
                        }
                        other => bail!(
                            "{}: answered step {step} with {}",
                            client.who(i),
                            other.name()
                        ),
                    }
                }
            }
            Ok((reports, unreadable))
        })?;
        if !unreadable_ahead.is_empty() {
            self.staged = None;
            self.unreadable_ahead = Some((step + 1, unreadable_ahead));
        }
        self.next_step += 1;
        reports.sort_by_key(|r| r.device);
        if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
            bail!(
                "step {step}: device {}: {}",
                r.device,
                r.error.as_deref().unwrap_or_default()
            );
        }
        let loss_sum: f64 = reports.iter().map(|r| r.loss_sum).sum();
        let correct = reports.iter().map(|r| r.correct as usize).sum();
        Ok(StepResult {
            stats: StepStats {
                loss: (loss_sum / batch as f64) as f32,
                correct,
                host: None,
            },
            reports: if trace {
                reports
                    .into_iter()
                    .map(|r| StepReport {
                        device: r.device as usize,
                        outcome: TaskOutcome {
                            loss_sum: r.loss_sum,
                            correct: r.correct as usize,
                        },
                        error: r.error,
                        events: r
                            .events
                            .into_iter()
                            .map(|(op, start, end)| OpEvent { op, start, end })
                            .collect(),
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })
    }

    /// The logits of inference on a batch on the workers' devices, as `EmbeddedCluster::logits`:
    /// each worker is sent the images its devices read, and the logits are read back from the
    /// devices holding them.
    pub fn logits(&mut self, images: &[f32]) -> anyhow::Result<Vec<f32>> {
        let Some(inference) = &self.plan.inference else {
            bail!("internal: this job was started without inference");
        };
        let batch = self.graph.batch();
        let labels = vec![0; batch];
        let run = self.inference_runs;
        self.inference_runs += 1;
        let requests: Vec<Vec<u8>> = self
            .split(Images::Values(images), &labels)?
            .into_iter()
            .map(|samples| {
                control::encode(&Control::Infer {
                    run,
                    samples: StepSamples {
                        labels: Vec::new(),
                        label_samples: 0..0,
                        ..samples
                    },
                })
            })
            .collect();
        let n = self.ranges.len();
        let mut asks: Vec<Vec<(Rect, PieceRef)>> = vec![Vec::new(); n];
        for at in &inference.logits {
            let w = self.worker_of(at.device);
            asks[w].push((at.rect, PieceRef::new(at.device, at.instance, &at.rect)));
        }
        let client = &self.client;
        let answers = client.runtime.block_on(async {
            for (i, request) in requests.iter().enumerate() {
                client.send_encoded(i, request).await?;
            }
            for i in 0..n {
                match client.reply(i, None).await? {
                    Control::StepDone { step, reports } if step == run => {
                        if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
                            bail!(
                                "inference: device {}: {}",
                                r.device,
                                r.error.as_deref().unwrap_or_default()
                            );
                        }
                    }
                    other => bail!("{}: answered Infer with {}", client.who(i), other.name()),
                }
            }
            for (i, ask) in asks.iter().enumerate() {
                let pieces = ask.iter().map(|(_, p)| p.clone()).collect();
                client.send(i, &Control::Read { pieces }).await?;
            }
            let mut answers = Vec::new();
            for (i, ask) in asks.iter().enumerate() {
                match client.reply(i, None).await? {
                    Control::ReadDone { pieces } if pieces.len() == ask.len() => {
                        answers.push(pieces)
                    }
                    other => bail!("{}: answered Read with {}", client.who(i), other.name()),
                }
            }
            Ok(answers)
        })?;
        let mut pieces = Vec::with_capacity(inference.logits.len());
        for (ask, data) in asks.into_iter().zip(answers) {
            for ((rect, _), data) in ask.into_iter().zip(data) {
                let data = match data {
                    PieceData::F32(v) => Buffer::F32(v),
                    PieceData::Bf16(v) => Buffer::Bf16(v),
                    PieceData::F64(_) => bail!("a worker sent logits of the wrong type"),
                };
                if data.len() != rect.volume() {
                    bail!("a worker sent logits of the wrong size");
                }
                pieces.push((rect, data));
            }
        }
        Ok(inference.assemble(&self.graph, &pieces))
    }

    fn worker_of(&self, device: usize) -> usize {
        self.ranges
            .iter()
            .position(|r| r.contains(&device))
            .expect("device of a host")
    }

    /// The current parameters, gathered from the workers.
    pub fn params(&self) -> anyhow::Result<ParamStore> {
        let regions: Vec<RegionId> = (0..self.graph.params().len())
            .map(|slot| self.plan.regions.param(slot))
            .collect();
        Ok(ParamStore::from_values(&self.graph, self.gather(&regions)?))
    }

    /// Weights, momentum and steps taken, as `EmbeddedCluster::state`.
    pub fn state(&self) -> anyhow::Result<TrainingState> {
        let params = self.params()?;
        let slots: Vec<(usize, RegionId)> = (0..params.values.len())
            .filter_map(|slot| self.plan.regions.velocity(slot).map(|r| (slot, r)))
            .collect();
        let gathered = self.gather(&slots.iter().map(|&(_, r)| r).collect::<Vec<_>>())?;
        let mut momentum: Vec<Vec<f32>> =
            params.values.iter().map(|v| vec![0.0; v.len()]).collect();
        for ((slot, _), values) in slots.into_iter().zip(gathered) {
            momentum[slot] = values;
        }
        Ok(TrainingState {
            params,
            momentum,
            step: self.next_step,
        })
    }

    /// The whole values of persistent f32 regions, one request per worker.
    fn gather(&self, regions: &[RegionId]) -> anyhow::Result<Vec<Vec<f32>>> {
        let n = self.ranges.len();
        let mut asks: Vec<Vec<(usize, PieceRef)>> = vec![Vec::new(); n];
        for (k, &region) in regions.iter().enumerate() {
            for at in self.plan.sources(region) {
                let w = self.worker_of(at.device);
                asks[w].push((k, PieceRef::new(at.device, at.instance, &at.rect)));
            }
        }
        let mut out: Vec<Buffer> = regions
            .iter()
            .map(|&r| Buffer::zeros(DType::F32, self.plan.regions.info(r).shape.numel()))
            .collect();
        let client = &self.client;
        let answers = client.runtime.block_on(async {
            for (i, ask) in asks.iter().enumerate() {
                let pieces = ask.iter().map(|(_, p)| p.clone()).collect();
                client.send(i, &Control::Read { pieces }).await?;
            }
            let mut answers = Vec::new();
            for (i, ask) in asks.iter().enumerate() {
                match client.reply(i, None).await? {
                    Control::ReadDone { pieces } if pieces.len() == ask.len() => {
                        answers.push(pieces)
                    }
                    other => bail!("{}: answered Read with {}", client.who(i), other.name()),
                }
            }
            Ok(answers)
        })?;
        for (ask, pieces) in asks.iter().zip(answers) {
            for ((k, at), data) in ask.iter().zip(pieces) {
                let full = self.plan.regions.info(regions[*k]).shape.full_rect();
                let rect = at.rect(full.ndim()).expect("a rect of this plan");
                let data = match data {
                    PieceData::F32(v) if v.len() == rect.volume() => Buffer::F32(v),
                    _ => bail!("a worker sent a piece of the wrong size or type"),
                };
                out[*k].copy_from(&full, &data, &rect, &rect);
            }
        }
        Ok(out.into_iter().map(Buffer::into_f32).collect())
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        // Best effort: a worker whose driver disconnects ends the job by itself too, but only once
        // its connection closes or times out; a lost worker's peers are told at once, so that the
        // job a recovery starts on them finds them free. Each reply is waited for on its own
        // (another worker being lost is no reason to stop waiting), a lost worker's not at all.
        let client = &self.client;
        client.runtime.block_on(async {
            let mut told = Vec::new();
            for i in 0..self.ranges.len() {
                let send = client.send(i, &Control::EndJob);
                if client.lost(i).is_none()
                    && matches!(
                        tokio::time::timeout(Duration::from_secs(2), send).await,
                        Ok(Ok(()))
                    )
                {
                    told.push(i);
                }
            }
            for i in told {
                let ended = async {
                    let mut replies = client.replies[i].lock().await;
                    while let Some(reply) = replies.recv().await {
                        if matches!(reply, Control::JobEnded) {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(2), ended).await;
            }
            // The close goes out before the endpoint is dropped: a worker that hung and comes
            // back then learns that this job's driver is gone, and is free for the next job.
            client.close();
            let _ = tokio::time::timeout(Duration::from_millis(300), client.node.shutdown()).await;
        });
    }
}

/// Says hello to worker `i`, checking that it runs this version with `devices` devices and is
/// free: one busy with another driver's job is asked again until `busy_until`.
pub(crate) async fn greet(
    client: &WorkerClient,
    i: usize,
    devices: usize,
    busy_until: Instant,
) -> anyhow::Result<()> {
    let version = env!("CARGO_PKG_VERSION");
    loop {
        let hello = Control::Hello {
            version: version.into(),
        };
        client.send(i, &hello).await?;
        let (runs, theirs, job_of) = match client.reply(i, Some(CONNECT_TIMEOUT)).await? {
            Control::Welcome {
                devices,
                version,
                job_of,
                ..
            } => (devices as usize, version, job_of),
            other => bail!("{}: answered Hello with {}", client.who(i), other.name()),
        };
        if runs != devices {
            bail!(
                "{}: runs {runs} device(s), the hosts file says {devices}; restart it \
                 (`legion-rs down`, `up`)",
                client.who(i)
            );
        }
        if theirs != version {
            bail!(
                "{}: runs legion-rs {theirs}, this is {version}",
                client.who(i)
            );
        }
        match job_of {
            None => return Ok(()),
            // The job of a driver that has just died ends within the wait.
            Some(_) if Instant::now() < busy_until => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Some(driver) => bail!(
                "{}: busy with a job driven from {driver} for over {} s (stop that run, or \
                 restart the worker: `legion-rs down`, `up`)",
                client.who(i),
                BUSY_WAIT.as_secs()
            ),
        }
    }
}

/// The samples worker `i` could not read of those staged for `step`, from its `reply`.
fn staged_reply(
    client: &WorkerClient,
    i: usize,
    step: u64,
    reply: Control,
) -> anyhow::Result<Vec<(u64, String)>> {
    match reply {
        Control::Staged {
            step: staged,
            unreadable,
        } if staged == step => Ok(unreadable),
        other => bail!(
            "{}: answered the samples of step {step} with {}",
            client.who(i),
            other.name()
        ),
    }
}

fn expect(
    client: &WorkerClient,
    i: usize,
    request: &str,
    reply: Control,
    ok: impl Fn(&Control) -> bool,
) -> anyhow::Result<()> {
    if ok(&reply) {
        Ok(())
    } else {
        bail!(
            "{}: answered {request} with {}",
            client.who(i),
            reply.name()
        )
    }
}

/// Heartbeats are sent this often; the timeout must leave room for several.
const _: () = assert!(HEARTBEAT_TIMEOUT.as_millis() >= 4 * HEARTBEAT_INTERVAL.as_millis());
