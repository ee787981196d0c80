//! The profiler: measures the planner's t_c, and the transport's links, on real steps of the
//! embedded cluster. On a GPU, [`gpu`] times tiles with CUDA events instead.
//!
//! Kernels are timed where they really run: inside training steps of N devices that share this
//! machine's cores and memory, each by its own seconds (see "own seconds" below: the share of the
//! cores a task got is taken out, the memory and cache traffic beside it stays in). For each
//! strategy the
//! profiler starts a cluster, runs untimed warm-up steps, then traced steps on one synthetic batch,
//! and attributes each compute task to the tile of its layer on its device:
//!
//! - forward phase: `LoadInput`, `Forward`, `BnMoments`, `BnNormalize`, `BnRunning`;
//! - backward phase: `Backward`, `BnGradSums`, `BnInputGrad`;
//! - left out: `Update` (parameter synchronisation, which the planner prices as t_s, not t_c) and
//!   folds (sums of partial results: part of moving data between tiles, not of a tile's kernel).
//!
//! One (strategy, step, layer, device) gives one sample of a tile's forward and backward seconds;
//! samples with the same [`ProfileKey`] (the same op over the same shapes, whichever strategy or
//! device ran it) are kept as their median: devices of one kind price alike, and one step a
//! device lost to the OS does not move the entry.
//!
//! Runtime costs ([`RuntimeCosts`], what the simulator charges besides kernels and transfers):
//!
//! - folds: bytes streamed ([`fold_bytes`] of the fold's terms, plus the destination when it
//!   accumulates, over its rect) over seconds, summed over every fold;
//! - updates: [`update_bytes`] of each `Update` task's slice over seconds, summed likewise;
//! - dispatch: for every compute op (kernel, fold, update), the time from when its device could
//!   have started it (its local dependences done, including receives, and the device's previous
//!   compute op finished; the step's start for the first) to its kernel starting, less the
//!   device's own actor's copies in that window (the simulator prices them as copies), over the
//!   ops for which a core and an actor thread were free that whole window: the other devices'
//!   compute ops and copies together left a core free (a copy holds a core as a kernel does), and
//!   their copies an actor thread (waiting for either the simulator models itself). The mean of
//!   those: the simulator charges it to every op that becomes startable with a core idle (with
//!   every core busy, only the runtime CPU below), and the expected step time wants the expected
//!   delay, tail included (a woken thread waiting for a core the OS has given to another device
//!   for a time slice). On a rayon pool shared by every device the tail also held other devices'
//!   whole kernels (a thread waiting inside one kernel stole another), which made the mean
//!   overprice steps by 15–45% and the median the better guess; the pools of `compute` run each
//!   kernel alone on its thread, so it does not.
//!   Their spread too (`dispatch_bins_s`, means of sixteenths): a step of many small ops on
//!   parallel paths waits for the slowest path, so it costs more than each op paying the mean;
//! - own seconds: kernels, folds, updates and copies are timed by their own seconds (`cpu_share`),
//!   not their wall time: with more busy threads than cores, the OS stretched every task's wall time
//!   by what ran beside it in the profiled step, and the simulator shares the cores out again
//!   ([`MachineModel::compute_slots`](legion_planner::MachineModel::compute_slots));
//! - copies: bytes over seconds of every data-movement op that copies (a gather out of, or a store
//!   into, a larger instance; whole instances are shared), summed;
//! - runtime CPU: per compute op, the CPU time of the actors' threads over each traced step, less
//!   their copies' own seconds: the actors' message handling, handing ops to the pools, waking
//!   threads and parking (`cpu_share::CpuMeter`, each thread's scheduler statistics). On workers
//!   the devices share (`compute::shares_workers`), their CPU beyond their kernels' and folds' own
//!   seconds counts too: each runs one op at a time, and what it spends around the kernel (taking
//!   the job, timing it, telling the actor, a brief spin before parking) is per op; left out, the
//!   simulator under-predicted LeNet-5 owt and optcnn by 3.6–4.4%, counted, it was within 2.5%
//!   (BENCHMARKS.md, "predicted vs measured"). On a pool per device it is left out: it is mostly idle threads
//!   spinning for more work (`sched_yield` rounds before a thread parks), which gives way to a
//!   thread with work on the same core; charged, with kernels timed by their threads' CPU clocks,
//!   it fitted AlexNet and over-predicted LeNet-5 by 6–18%. Where the pools
//!   used less CPU than those own seconds, the difference is taken off:
//!   the actors' threads took that time from the kernels, so the own seconds hold it already. A
//!   real share of a step of many small ops, nothing beside large kernels (BENCHMARKS.md,
//!   "predicted vs measured"). Where the OS keeps no per-thread statistics, the process's CPU less
//!   every timed op's stands in. The simulator has it hold a core at the end of each compute op's
//!   dispatch;
//! - actor threads: the worker count of the runtime the device actors run on.
//!
//! Links: a transfer between devices takes from its `Send` ending (after the gather on the sender)
//! to its `Recv` starting (before the store on the receiver): the simulator prices gathers and
//! stores as the actors' copies. A least-squares line `latency + bytes / bandwidth`
//! through those points is the measured link. Only transfers whose receive waited for nothing but
//! the data are used: a receive held back by a local dependence would count that wait as transport,
//! and so would one whose receiver's actor was copying, or whose actors' threads were all copying,
//! while it was in flight (the simulator prices those copies).

pub mod cache;
pub mod gpu;

use legion_ops::data::{DataError, Dataset, Synthetic};
use legion_ops::op::partial_input_shapes;
use legion_ops::train::ParamStore;
use legion_ops::{Graph, LayerId, Rect, Shape};
use legion_planner::profile::{LinkProfile, ProfileKey};
use legion_planner::progress::{Phase as PlanPhase, Progress};
use legion_planner::runtime_costs::{RuntimeCosts, fold_bytes, update_bytes};
use legion_planner::{
    ConfigSpace, DeviceId, ParallelConfig, PhaseTimes, ProfileDb, SearchSpace, tile_rect,
};
use legion_runtime::StepReport;
use legion_runtime::plan::StepPlan;
use legion_runtime::program::LocalOpKind;
use legion_runtime::task::TaskKind;
use legion_runtime::{CpuMeter, CpuSpan, StepCpu, alone_seconds};
use legion_runtime::{EmbeddedCluster, RuntimeError};
use std::collections::HashMap;
use std::time::Instant;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ProfileRunError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("synthetic data: {0}")]
    Data(#[from] DataError),
    #[error("strategy {strategy}: {source}")]
    Strategy {
        strategy: String,
        source: RuntimeError,
    },
    #[error("--repeats must be at least 1")]
    NoRepeats,
    #[error("GPU: {0}")]
    Gpu(String),
}

/// How to profile.
#[derive(Clone, Debug)]
pub struct ProfileSettings {
    /// Untimed steps before measuring (first-touch allocation, caches, thread pools).
    pub warmup: usize,
    /// Traced steps per strategy.
    pub repeats: usize,
    /// The machine model's device kind the entries are stored under (`cpu`).
    pub device_kind: String,
    pub seed: u64,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        ProfileSettings {
            warmup: 2,
            repeats: 5,
            device_kind: "cpu".into(),
            seed: 1,
        }
    }
}

/// What profiling one strategy saw.
#[derive(Clone, Debug)]
pub struct StrategyRun {
    pub name: String,
    /// Wall-clock seconds of each traced step.
    pub step_s: Vec<f64>,
    /// Compute tasks timed (over all traced steps).
    pub tasks: usize,
}

/// The profiler's result.
#[derive(Clone, Debug)]
pub struct Profile {
    pub db: ProfileDb,
    pub runs: Vec<StrategyRun>,
}

/// Profiles `graph` on `devices` embedded devices under each named strategy (configs by layer).
pub fn profile(
    graph: &Graph,
    devices: usize,
    strategies: &[(String, Vec<ParallelConfig>)],
    settings: &ProfileSettings,
) -> Result<Profile, ProfileRunError> {
    profile_reporting(graph, devices, strategies, settings, None)
}

/// [`profile`], reporting the strategies done to `progress`.
pub fn profile_reporting(
    graph: &Graph,
    devices: usize,
    strategies: &[(String, Vec<ParallelConfig>)],
    settings: &ProfileSettings,
    progress: Option<&dyn Progress>,
) -> Result<Profile, ProfileRunError> {
    let total = strategies.len() as u64;
    let report = |done: usize| {
        if let Some(p) = progress {
            p.update(PlanPhase::Measuring, done as u64, total);
        }
    };
    report(0);
    if settings.repeats == 0 {
        return Err(ProfileRunError::NoRepeats);
    }
    let (images, labels) = synthetic_batch(graph, settings.seed)?;
    let params = ParamStore::init(graph, settings.seed);
    let mut profiler = Profiler::new(devices, settings);
    let mut runs = Vec::new();
    for (name, configs) in strategies {
        let in_strategy = |source| ProfileRunError::Strategy {
            strategy: name.clone(),
            source,
        };
        let mut cluster = EmbeddedCluster::launch(graph, configs, devices, &params)
            .seed(settings.seed)
            .start()
            .map_err(in_strategy)?;
        for _ in 0..settings.warmup {
            cluster
                .step(images.clone(), labels.clone(), false)
                .map_err(in_strategy)?;
        }
        let mut run = StrategyRun {
            name: name.clone(),
            step_s: Vec::new(),
            tasks: 0,
        };
        for _ in 0..settings.repeats {
            let meter = CpuMeter::start();
            let t = Instant::now();
            let result = cluster
                .step(images.clone(), labels.clone(), true)
                .map_err(in_strategy)?;
            run.step_s.push(t.elapsed().as_secs_f64());
            let cpu = meter.stop();
            run.tasks += profiler.add_step(graph, cluster.plan(), &result.reports, cpu);
        }
        runs.push(run);
        report(runs.len());
    }
    Ok(Profile {
        db: profiler.finish(graph),
        runs,
    })
}

/// Accumulates traced steps of embedded clusters (of the same device count, on this process's
/// pools) into a [`ProfileDb`]. [`profile`] runs the steps itself; a caller that also times
/// untraced steps of the same cluster interleaves them with the traced ones, so that both see
/// the same load on a shared machine.
pub struct Profiler {
    settings: ProfileSettings,
    tiles: TileTimes,
    links: LinkFit,
    overheads: RuntimeFit,
    threads: Threads,
}

/// The threads the profiled steps ran on.
#[derive(Clone, Copy)]
struct Threads {
    /// The cores the devices' pools and the actors share.
    cores: usize,
    /// Each device pool's threads.
    device_threads: usize,
    /// The actors' pool.
    actor_threads: usize,
    /// Whether the devices share single-threaded workers (`compute::shares_workers`).
    shared_workers: bool,
}

impl Profiler {
    pub fn new(devices: usize, settings: &ProfileSettings) -> Profiler {
        let cores = rayon::current_num_threads();
        let threads = Threads {
            cores,
            device_threads: legion_runtime::threads_per_device(devices),
            shared_workers: legion_runtime::shares_workers(devices, cores),
            // The clusters run on `embedded::device_runtime`, which has this many.
            actor_threads: legion_runtime::actor_threads(),
        };
        Profiler {
            settings: settings.clone(),
            tiles: TileTimes::default(),
            links: LinkFit::default(),
            overheads: RuntimeFit::default(),
            threads,
        }
    }

    /// Adds one traced step's reports and the CPU it took ([`CpuMeter`] around the step); returns
    /// the compute tasks timed.
    pub fn add_step(
        &mut self,
        graph: &Graph,
        plan: &StepPlan,
        reports: &[StepReport],
        cpu: StepCpu,
    ) -> usize {
        let Threads {
            cores,
            device_threads,
            actor_threads,
            ..
        } = self.threads;
        let own = own_seconds(plan, reports, cores, device_threads);
        let tasks = self
            .tiles
            .add_step(graph, plan, reports, &own, &self.settings);
        self.links.add_step(plan, reports, actor_threads);
        self.overheads
            .add_step(plan, reports, &own, cpu, self.threads);
        tasks
    }

    pub fn finish(self, graph: &Graph) -> ProfileDb {
        let mut db = self.tiles.into_db(graph, &self.settings.device_kind);
        db.links = self.links.fit();
        // Kernels the cores run at once at full speed (see `compute::ComputePool::for_devices`).
        db.compute_threads = Some((self.threads.cores / self.threads.device_threads).max(1));
        db.runtime = self.overheads.costs(self.threads.actor_threads);
        db
    }
}

/// The mean wall-clock seconds of `steps` untraced steps of `cluster` on a synthetic batch, after
/// `warmup` untimed ones.
pub fn mean_step_time(
    cluster: &mut EmbeddedCluster,
    graph: &Graph,
    warmup: usize,
    steps: usize,
    seed: u64,
) -> Result<f64, ProfileRunError> {
    let (images, labels) = synthetic_batch(graph, seed)?;
    for _ in 0..warmup {
        cluster.step(images.clone(), labels.clone(), false)?;
    }
    let t = Instant::now();
    for _ in 0..steps {
        cluster.step(images.clone(), labels.clone(), false)?;
    }
    Ok(t.elapsed().as_secs_f64() / steps.max(1) as f64)
}

/// One batch of the seeded synthetic task, laid out like the graph's input. Timing does not depend
/// on the values, so every step reuses it.
pub fn synthetic_batch(graph: &Graph, seed: u64) -> Result<(Vec<f32>, Vec<u32>), DataError> {
    let input = graph.layer(graph.input()).shape;
    if input.ndim() != 4 {
        return Err(DataError::Config(format!(
            "the input layer must be images (N,C,H,W), got {input}"
        )));
    }
    let classes = graph
        .logits()
        .map_or(1, |logits| graph.layer(logits).shape.dim(1));
    let batch = input.dim(0);
    let data = Synthetic::new(
        seed,
        batch,
        classes,
        [input.dim(1), input.dim(2), input.dim(3)],
    )?;
    let len = data.sample_len();
    let mut images = vec![0.0; batch * len];
    let mut labels = Vec::with_capacity(batch);
    for (i, out) in images.chunks_exact_mut(len).enumerate() {
        labels.push(data.sample(i, 0, out)?);
    }
    Ok((images, labels))
}

/// Per report, per event: the op's own seconds, what it would have taken with the cores to itself
/// ([`alone_seconds`]). Kernels and folds run on their device's pool of `device_threads`; copies on
/// one actor thread each; all of them on `cores` cores. The simulator then shares the cores out
/// again as the simulated schedule needs them, rather than as this profiled step happened to.
fn own_seconds(
    plan: &StepPlan,
    reports: &[StepReport],
    cores: usize,
    device_threads: usize,
) -> Vec<Vec<f64>> {
    let mut spans = Vec::new();
    let mut at = Vec::new();
    for (i, r) in reports.iter().enumerate() {
        let program = &plan.programs[r.device];
        for (k, e) in r.events.iter().enumerate() {
            let op = &program.ops[e.op as usize];
            let threads = if pooled(op) {
                device_threads
            } else if copied(program, &op.kind).1 > 0 {
                1
            } else {
                continue;
            };
            spans.push(CpuSpan {
                start: e.start,
                end: e.end,
                threads,
            });
            at.push((i, k));
        }
    }
    let mut own: Vec<Vec<f64>> = reports
        .iter()
        .map(|r| r.events.iter().map(|e| e.end - e.start).collect())
        .collect();
    for ((i, k), seconds) in at.into_iter().zip(alone_seconds(&spans, cores)) {
        own[i][k] = seconds;
    }
    own
}

/// Which phase of its tile's t_c a task belongs to, if any.
pub(crate) fn phase(kind: TaskKind) -> Option<Phase> {
    match kind {
        TaskKind::LoadInput
        | TaskKind::Forward
        | TaskKind::BnMoments
        | TaskKind::BnNormalize
        | TaskKind::BnRunning
        | TaskKind::PartialForward
        | TaskKind::Finish => Some(Phase::Forward),
        TaskKind::Backward
        | TaskKind::BnGradSums
        | TaskKind::BnInputGrad
        | TaskKind::PartialBackward
        | TaskKind::FinishBackward => Some(Phase::Backward),
        // Inference runs apart from the steps it would be priced in.
        TaskKind::Update { .. } | TaskKind::Empty | TaskKind::Infer => None,
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Phase {
    Forward,
    Backward,
}

/// Tile times by key, in first-seen order (so the file is deterministic).
#[derive(Default)]
struct TileTimes {
    index: HashMap<ProfileKey, usize>,
    /// (layer, the input shapes the tile computes over, tile, every sample's times)
    samples: Vec<(LayerId, Vec<Shape>, Rect, Vec<PhaseTimes>)>,
}

impl TileTimes {
    /// Adds one sample per (layer, device) that computed in this step; returns the tasks timed.
    fn add_step(
        &mut self,
        graph: &Graph,
        plan: &StepPlan,
        reports: &[StepReport],
        own: &[Vec<f64>],
        settings: &ProfileSettings,
    ) -> usize {
        let mut step: HashMap<(LayerId, DeviceId), PhaseTimes> = HashMap::new();
        let mut tasks = 0;
        for (r, own) in reports.iter().zip(own) {
            let program = &plan.programs[r.device];
            for (e, &seconds) in r.events.iter().zip(own) {
                let LocalOpKind::Task { task, .. } = &program.ops[e.op as usize].kind else {
                    continue;
                };
                let Some(phase) = phase(task.kind) else {
                    continue;
                };
                tasks += 1;
                let times = step.entry((task.layer, r.device)).or_default();
                match phase {
                    Phase::Forward => times.forward += seconds,
                    Phase::Backward => times.backward += seconds,
                }
            }
        }
        let mut samples: Vec<_> = step.into_iter().collect();
        // Deterministic first-seen order.
        samples.sort_by_key(|&((layer, device), _)| (layer.0, device));
        for ((layer, device), times) in samples {
            // A device holds at most one tile of a layer (tile t on device first + t), so the device
            // names the tile even for tasks whose own rect is not the tile (running statistics).
            let config = &plan.configs[layer.0];
            let Some(t) = device
                .checked_sub(config.first_device())
                .filter(|&t| t < config.total())
            else {
                continue;
            };
            let tile = Tile::of(graph, layer, config, t, &settings.device_kind);
            let next = self.samples.len();
            let i = *self.index.entry(tile.key).or_insert(next);
            if i == next {
                self.samples
                    .push((layer, tile.inputs, tile.rect, Vec::new()));
            }
            self.samples[i].3.push(times);
        }
        tasks
    }

    fn into_db(self, graph: &Graph, device_kind: &str) -> ProfileDb {
        let mut db = ProfileDb::default();
        for (layer, inputs, tile, mut samples) in self.samples {
            let n = u32::try_from(samples.len()).unwrap_or(u32::MAX);
            let median = PhaseTimes {
                forward: median(&mut samples, |t| t.forward),
                backward: median(&mut samples, |t| t.backward),
            };
            db.record(graph.layer(layer), &inputs, &tile, device_kind, median, n);
        }
        db
    }
}

/// The median of `of` over `samples` (the mean of the middle two of an even count).
fn median(samples: &mut [PhaseTimes], of: impl Fn(&PhaseTimes) -> f64) -> f64 {
    samples.sort_by(|a, b| of(a).total_cmp(&of(b)));
    match samples.len() {
        0 => 0.0,
        n if n % 2 == 1 => of(&samples[n / 2]),
        n => 0.5 * (of(&samples[n / 2 - 1]) + of(&samples[n / 2])),
    }
}

/// Tile `t` of a layer under its config, as the profile keys it.
pub struct Tile {
    /// The shapes of the inputs the tile computes over.
    pub inputs: Vec<Shape>,
    pub rect: Rect,
    pub key: ProfileKey,
}

impl Tile {
    pub fn of(
        graph: &Graph,
        layer: LayerId,
        config: &ParallelConfig,
        t: usize,
        device_kind: &str,
    ) -> Tile {
        let rect = tile_rect(&graph.layer(layer).shape, config, t);
        // A reduction split's partial is the op over its block of the input channels, which
        // is how the planner prices it (its block's first partial also finishes the block:
        // an element-wise pass, counted with it).
        let inputs = partial_input_shapes(
            &graph.input_shapes(layer),
            config.reduction_of(t),
            config.reduction(),
        );
        let key = ProfileKey::for_tile(graph.layer(layer), &inputs, &rect, device_kind);
        Tile { inputs, rect, key }
    }
}

/// The keys of every tile that `configs` (by layer) computes, on devices of `device_kind`.
pub fn tile_keys(
    graph: &Graph,
    configs: &[ParallelConfig],
    device_kind: &str,
) -> impl Iterator<Item = ProfileKey> {
    graph.ids().zip(configs).flat_map(move |(layer, config)| {
        (0..config.total()).map(move |t| Tile::of(graph, layer, config, t, device_kind).key)
    })
}

/// Every tile shape the searches may give each layer on `devices` devices, as strategies:
/// strategy k gives each layer its k-th layout (degree vector and reduction split, as the
/// searches' default space holds them; its last where it has fewer) on the first devices.
/// Where on the machine a layout sits changes no tile's shape, so these tiles price every config.
/// Layouts over the most devices come first: their tiles are the smallest (quickest to time) and
/// the ones a search over the whole machine uses most, so a time limit cuts the largest.
pub fn space_strategies(graph: &Graph, devices: usize) -> Vec<(String, Vec<ParallelConfig>)> {
    let layouts: Vec<Vec<ParallelConfig>> = graph
        .ids()
        .map(|id| {
            let space = ConfigSpace::of_layer(graph, id, devices, SearchSpace::WithReductions);
            let mut layouts: Vec<ParallelConfig> = (0..space.layouts().len())
                .map(|k| space.config(space.layout_configs(k).start))
                .collect();
            layouts.sort_by_key(|c| std::cmp::Reverse(c.total()));
            layouts
        })
        .collect();
    let most = layouts.iter().map(Vec::len).max().unwrap_or(0);
    (0..most)
        .map(|k| {
            let configs = layouts.iter().map(|l| l[k.min(l.len() - 1)]).collect();
            (format!("space-{k}"), configs)
        })
        .collect()
}

/// Sums for [`RuntimeCosts`] (see the module docs).
#[derive(Default)]
struct RuntimeFit {
    fold_bytes: f64,
    fold_s: f64,
    update_bytes: f64,
    update_s: f64,
    /// Qualifying dispatch delays, seconds.
    dispatches: Vec<f64>,
    copy_bytes: f64,
    copy_s: f64,
    /// The runtime's own CPU seconds in the steps (see the module docs).
    untimed_cpu_s: f64,
    /// Compute ops (kernels, folds, updates) in the steps.
    compute_ops: usize,
}

impl RuntimeFit {
    /// Adds a traced step that used `cpu`, run on `threads`.
    fn add_step(
        &mut self,
        plan: &StepPlan,
        reports: &[StepReport],
        own: &[Vec<f64>],
        cpu: StepCpu,
        threads: Threads,
    ) {
        let Threads {
            cores,
            device_threads,
            actor_threads,
            shared_workers,
        } = threads;
        // Every device's compute ops and copies, (start, end), to tell whether the pools had a
        // free thread.
        let spans = |moves: bool| -> Vec<Vec<(f64, f64)>> {
            reports
                .iter()
                .map(|r| {
                    let program = &plan.programs[r.device];
                    r.events
                        .iter()
                        .filter(|e| {
                            let op = &program.ops[e.op as usize];
                            if moves {
                                copied(program, &op.kind).1 > 0
                            } else {
                                pooled(op)
                            }
                        })
                        .map(|e| (e.start, e.end))
                        .collect()
                })
                .collect()
        };
        let (busy, copying) = (spans(false), spans(true));
        // The CPU of the kernels and folds the trace times, and of the copies.
        let (mut pooled_cpu_s, mut copies_cpu_s) = (0.0, 0.0);
        for (i, r) in reports.iter().enumerate() {
            let program = &plan.programs[r.device];
            let end_of: HashMap<u32, f64> = r.events.iter().map(|e| (e.op, e.end)).collect();
            let mut compute: Vec<_> = r
                .events
                .iter()
                .zip(&own[i])
                .filter(|(e, _)| pooled(&program.ops[e.op as usize]))
                .collect();
            compute.sort_by(|(a, _), (b, _)| a.start.total_cmp(&b.start));
            for (e, &seconds) in r.events.iter().zip(&own[i]) {
                let op = &program.ops[e.op as usize];
                let (bytes, copies) = copied(program, &op.kind);
                if pooled(op) {
                    pooled_cpu_s += seconds * device_threads as f64;
                    self.compute_ops += 1;
                } else if copies > 0 {
                    self.copy_bytes += (bytes * copies) as f64;
                    self.copy_s += seconds;
                    copies_cpu_s += seconds;
                }
            }
            let mut device_free = 0.0f64;
            for (e, &seconds) in compute {
                let op = &program.ops[e.op as usize];
                match &op.kind {
                    LocalOpKind::Fold {
                        srcs,
                        dst,
                        rect,
                        accumulate,
                    } => {
                        let size = program.instances[*dst as usize].dtype.size() as u64;
                        let terms = srcs.len() + usize::from(*accumulate);
                        self.fold_bytes += fold_bytes(terms, rect.volume() as u64 * size) as f64;
                        self.fold_s += seconds;
                    }
                    LocalOpKind::Task { task, .. }
                        if matches!(task.kind, TaskKind::Update { .. }) =>
                    {
                        self.update_bytes += update_bytes(4 * task.tile.volume() as u64) as f64;
                        self.update_s += seconds;
                    }
                    _ => {}
                }
                let ready = op
                    .deps
                    .iter()
                    .filter_map(|d| end_of.get(d))
                    .fold(device_free, |a, &b| a.max(b));
                device_free = e.end;
                let others = |all: &[Vec<(f64, f64)>]| {
                    all.iter()
                        .enumerate()
                        .filter(|&(j, _)| j != i)
                        .flat_map(|(_, spans)| spans.iter().copied())
                        .collect::<Vec<_>>()
                };
                // The actor's own copies while the op waited are priced as copies, not dispatch.
                let moved: f64 = r
                    .events
                    .iter()
                    .filter(|m| !program.ops[m.op as usize].is_compute())
                    .map(|m| (m.end.min(e.start) - m.start.max(ready)).max(0.0))
                    .sum();
                let pools = Pools {
                    threads: cores,
                    actor_threads,
                };
                if pools.free_throughout(&others(&busy), &others(&copying), ready, e.start) {
                    self.dispatches.push((e.start - ready - moved).max(0.0));
                }
            }
        }
        self.untimed_cpu_s += runtime_cpu_s(cpu, pooled_cpu_s, copies_cpu_s, shared_workers);
    }

    fn costs(&self, actor_threads: usize) -> Option<RuntimeCosts> {
        let costs = RuntimeCosts {
            dispatch_s: self.dispatches.iter().sum::<f64>() / self.dispatches.len() as f64,
            // Own seconds can exceed the CPU they stand for (a kernel waiting on a page fault is
            // not computing): then nothing is left over for the runtime.
            runtime_cpu_s: (self.untimed_cpu_s / self.compute_ops as f64).max(0.0),
            dispatch_bins_s: RuntimeCosts::dispatch_bins(&self.dispatches),
            fold_bytes_per_s: self.fold_bytes / self.fold_s,
            update_bytes_per_s: self.update_bytes / self.update_s,
            copy_bytes_per_s: self.copy_bytes / self.copy_s,
            actor_threads,
        };
        costs.validate().is_ok().then_some(costs)
    }
}

/// The runtime's own CPU seconds in a step that used `cpu`, whose timed kernels and folds had
/// `pooled_cpu_s` of own seconds (times their pools' threads) and its copies `copies_cpu_s`, on
/// workers shared by the devices (`shared_workers`) or on a pool per device.
fn runtime_cpu_s(cpu: StepCpu, pooled_cpu_s: f64, copies_cpu_s: f64, shared_workers: bool) -> f64 {
    match cpu.threads {
        // The pools' CPU beyond their ops' own seconds: on shared workers, each op's handling
        // around its kernel (counted); on a pool per device, mostly idle threads spinning, which
        // yields to a thread with work on its core (left out; see the module docs). Short of
        // them, the own seconds counted time the actors' threads took from the kernels, which
        // the actors' CPU holds already.
        Some(t) => {
            let beyond = t.pools_s - pooled_cpu_s;
            (t.actors_s - copies_cpu_s)
                + if shared_workers {
                    beyond
                } else {
                    beyond.min(0.0)
                }
        }
        None => cpu.process_s - pooled_cpu_s - copies_cpu_s,
    }
}

/// The bytes a data-movement op copies and how many times it copies them: a piece of an instance
/// is gathered out of it, a piece is stored into a larger instance, a piece of one instance is
/// copied straight into a piece of another on the same device; whole instances are shared.
fn copied(program: &legion_runtime::program::DeviceProgram, kind: &LocalOpKind) -> (u64, u64) {
    let layout = |i: &u32| program.instances[*i as usize].rect;
    let size = |i: &u32| program.instances[*i as usize].dtype.size() as u64;
    match kind {
        LocalOpKind::Copy { src, dst, rect } => (
            rect.volume() as u64 * size(dst),
            u64::from(layout(src) != *rect || layout(dst) != *rect),
        ),
        LocalOpKind::Send { src, rect, .. } => (
            rect.volume() as u64 * size(src),
            u64::from(layout(src) != *rect),
        ),
        LocalOpKind::Recv { dst, rect, .. } => (
            rect.volume() as u64 * size(dst),
            u64::from(layout(dst) != *rect),
        ),
        _ => (0, 0),
    }
}

/// Whether `op` runs on the compute pool (kernels and folds; tasks without data run on the actor).
fn pooled(op: &legion_runtime::program::LocalOp) -> bool {
    op.is_compute() && !op.touches_no_data()
}

/// The most of `spans` (start, end) running at once at any time in `[from, to)`.
/// The threads a delay can wait for: the cores of the compute pool and the actors' runtime.
struct Pools {
    threads: usize,
    actor_threads: usize,
}

impl Pools {
    /// Whether, over `[from, to)`, the other devices' kernels and copies left a core free and
    /// their copies left an actor thread free. A copy holds a core as a kernel does, and the
    /// simulator makes a task wait for a core itself: a delay with every core taken is that wait,
    /// not dispatch.
    fn free_throughout(
        &self,
        kernels: &[(f64, f64)],
        copies: &[(f64, f64)],
        from: f64,
        to: f64,
    ) -> bool {
        let copiers = most_running(copies.iter().copied(), from, to);
        let taken = most_running(kernels.iter().chain(copies).copied(), from, to);
        taken < self.threads && copiers < self.actor_threads
    }
}

fn most_running(spans: impl Iterator<Item = (f64, f64)>, from: f64, to: f64) -> usize {
    // +1 where a span starts, −1 where it ends, clipped to the window; ends before starts at ties.
    let mut edges: Vec<(f64, i32)> = Vec::new();
    for (s, e) in spans {
        if s < to && e > from {
            edges.push((s.max(from), 1));
            edges.push((e.min(to), -1));
        }
    }
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut running, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        running += d;
        most = most.max(running);
    }
    most as usize
}

/// (bytes, seconds) of transfers between devices, for the link fit.
#[derive(Default)]
struct LinkFit {
    points: Vec<(f64, f64)>,
}

/// Trace timestamps come from `Instant`, in nanoseconds.
const CLOCK_RESOLUTION_S: f64 = 1e-9;

impl LinkFit {
    fn add_step(&mut self, plan: &StepPlan, reports: &[StepReport], actor_threads: usize) {
        let sent = legion_runtime::send_ends(plan, reports);
        // Every device's copies, (start, end): a receiver's actor busy copying, or every actor
        // thread taken, holds the slice in the mailbox, which the simulator prices as the copies.
        let copying: Vec<Vec<(f64, f64)>> = reports
            .iter()
            .map(|r| {
                let program = &plan.programs[r.device];
                r.events
                    .iter()
                    .filter(|e| copied(program, &program.ops[e.op as usize].kind).1 > 0)
                    .map(|e| (e.start, e.end))
                    .collect()
            })
            .collect();
        for (i, r) in reports.iter().enumerate() {
            let program = &plan.programs[r.device];
            let end_of: HashMap<u32, f64> = r.events.iter().map(|e| (e.op, e.end)).collect();
            for e in &r.events {
                let op = &program.ops[e.op as usize];
                let LocalOpKind::Recv { copy, dst, rect } = &op.kind else {
                    continue;
                };
                let Some(&(_, start)) = sent.get(copy) else {
                    continue;
                };
                let held = op
                    .deps
                    .iter()
                    .filter_map(|d| end_of.get(d))
                    .any(|&end| end > start);
                let own = most_running(copying[i].iter().copied(), start, e.start);
                let all = most_running(copying.iter().flatten().copied(), start, e.start);
                if held || own > 0 || all >= actor_threads {
                    continue;
                }
                let bytes = rect.volume() * program.instances[*dst as usize].dtype.size();
                self.points.push((bytes as f64, (e.start - start).max(0.0)));
            }
        }
    }

    /// Least squares `seconds = latency + bytes · s_per_byte`. A negative intercept (noise on small
    /// messages) refits through the origin; without two distinct sizes there is no line to fit.
    /// When time does not grow with size (the in-process transport hands buffers over without
    /// copying, and the actors' copies are priced on their own), the link is its mean latency, with
    /// a per-byte cost below the clock's resolution for the largest message.
    fn fit(&self) -> Option<LinkProfile> {
        let n = self.points.len() as f64;
        if self.points.len() < 2 {
            return None;
        }
        let mean_x = self.points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = self.points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = self.points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        let sxy: f64 = self
            .points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum();
        if sxx <= 0.0 {
            return None;
        }
        let mut slope = sxy / sxx;
        if slope <= 0.0 {
            let largest = self.points.iter().map(|p| p.0).fold(0.0, f64::max);
            return Some(LinkProfile {
                bytes_per_s: largest / CLOCK_RESOLUTION_S,
                latency_s: mean_y,
                samples: self.points.len() as u32,
            });
        }
        let mut latency = mean_y - slope * mean_x;
        if latency < 0.0 {
            let sxx0: f64 = self.points.iter().map(|p| p.0 * p.0).sum();
            let sxy0: f64 = self.points.iter().map(|p| p.0 * p.1).sum();
            slope = sxy0 / sxx0;
            latency = 0.0;
        }
        (slope > 0.0 && slope.is_finite()).then(|| LinkProfile {
            bytes_per_s: 1.0 / slope,
            latency_s: latency,
            samples: self.points.len() as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::{Dim, zoo};
    use legion_runtime::RuntimeThreadsCpu;

    #[test]
    fn a_local_copy_between_two_pieces_counts_once() {
        // LeNet-5's conv1 split by rows, pool1 by columns: on each device, a piece of conv1's tile
        // goes into a piece of pool1's input instance.
        let z = zoo::find("lenet5").unwrap();
        let g = z.build(&z.default_config(2)).unwrap();
        let mut configs = vec![ParallelConfig::serial(0); g.layers().len()];
        configs[1] = ParallelConfig::split(Dim::H, 2, 0);
        configs[2] = ParallelConfig::split(Dim::W, 2, 0);
        let plan = StepPlan::build(&g, &configs, 2).unwrap();
        let mut both_partial = 0;
        for program in &plan.programs {
            for op in &program.ops {
                let LocalOpKind::Copy { src, dst, rect } = &op.kind else {
                    continue;
                };
                let layout = |i: &u32| program.instances[*i as usize].rect;
                if layout(src) != *rect && layout(dst) != *rect {
                    both_partial += 1;
                    assert_eq!(copied(program, &op.kind), (4 * rect.volume() as u64, 1));
                }
            }
        }
        assert!(both_partial >= 2, "{both_partial} copies between pieces");
    }

    #[test]
    fn runtime_cpu_is_the_actors_untimed_cpu_and_the_shared_workers_handling() {
        let cpu = |actors_s, pools_s| StepCpu {
            process_s: actors_s + pools_s + 0.5,
            threads: Some(RuntimeThreadsCpu { actors_s, pools_s }),
        };
        // Kernels timed at 8 s on pools that used 9 s. The actors used 3 s, 1 s of it copying.
        // On a pool per device the extra second is idle threads spinning; on shared workers it
        // is their handling of each op.
        assert_eq!(runtime_cpu_s(cpu(3.0, 9.0), 8.0, 1.0, false), 2.0);
        assert_eq!(runtime_cpu_s(cpu(3.0, 9.0), 8.0, 1.0, true), 3.0);
        // Pools that used 7 s for 8 s of kernels lost 1 s to the actors: their own seconds hold it.
        for shared in [false, true] {
            assert_eq!(runtime_cpu_s(cpu(3.0, 7.0), 8.0, 1.0, shared), 1.0);
        }
        // Without per-thread statistics, the process's CPU less every timed op's.
        let process = StepCpu {
            process_s: 12.5,
            threads: None,
        };
        assert_eq!(runtime_cpu_s(process, 8.0, 1.0, true), 3.5);
    }

    #[test]
    fn most_running_counts_overlaps_inside_the_window() {
        let spans = [(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (5.0, 6.0)];
        assert_eq!(most_running(spans.into_iter(), 0.0, 10.0), 2);
        // [0, 2) and [2, 4) touch but do not overlap
        assert_eq!(
            most_running([(0.0, 2.0), (2.0, 4.0)].into_iter(), 0.0, 4.0),
            1
        );
        assert_eq!(most_running(spans.into_iter(), 4.0, 5.0), 0);
        assert_eq!(most_running(spans.into_iter(), 2.5, 2.5), 0, "empty window");
        assert_eq!(most_running(spans.into_iter(), 1.5, 1.8), 2);
    }

    #[test]
    fn a_delay_with_every_core_taken_by_kernels_and_copies_is_not_dispatch() {
        let pools = Pools {
            threads: 2,
            actor_threads: 2,
        };
        let kernel = [(0.0, 10.0)];
        let copy = [(2.0, 4.0)];
        assert!(pools.free_throughout(&kernel, &[], 0.0, 10.0));
        assert!(pools.free_throughout(&[], &copy, 0.0, 10.0));
        // one kernel and one copy together fill both cores for [2, 4)
        assert!(!pools.free_throughout(&kernel, &copy, 0.0, 10.0));
        assert!(pools.free_throughout(&kernel, &copy, 4.0, 10.0));
        // copies alone fill the actors' pool even with cores to spare
        let wide = Pools {
            threads: 8,
            actor_threads: 2,
        };
        assert!(!wide.free_throughout(&[], &[(0.0, 5.0), (1.0, 6.0)], 0.0, 10.0));
        assert!(wide.free_throughout(&kernel, &copy, 0.0, 10.0));
    }

    #[test]
    fn link_fit_recovers_a_line_and_needs_two_sizes() {
        let line = |b: f64| 50e-6 + b / 2e9;
        let fit = LinkFit {
            points: [1e3, 1e5, 1e6, 4e6].iter().map(|&b| (b, line(b))).collect(),
        }
        .fit()
        .unwrap();
        assert!((fit.bytes_per_s / 2e9 - 1.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.latency_s / 50e-6 - 1.0).abs() < 1e-6, "{fit:?}");
        assert_eq!(fit.samples, 4);
        let same_size = LinkFit {
            points: vec![(1e3, 1e-5), (1e3, 2e-5)],
        };
        assert_eq!(same_size.fit(), None);
        // noise below the origin: a line through it
        let fit = LinkFit {
            points: vec![(1e3, 0.0), (1e6, 1e-3), (2e6, 2.2e-3)],
        }
        .fit()
        .unwrap();
        assert_eq!(fit.latency_s, 0.0);
        assert!(fit.bytes_per_s > 0.0);
        // time that does not grow with size: latency only
        let fit = LinkFit {
            points: vec![(1e3, 3e-5), (1e6, 1e-5), (4e6, 2e-5)],
        }
        .fit()
        .unwrap();
        assert!((fit.latency_s - 2e-5).abs() < 1e-12, "{fit:?}");
        assert_eq!(fit.bytes_per_s, 4e6 / CLOCK_RESOLUTION_S);
        assert_eq!(fit.samples, 3);
    }
}
