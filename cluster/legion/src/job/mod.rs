//! A training job: data, initial weights, the training loop, periodic and final checkpoints, the
//! trace. The front door of training from Rust ([`Training`]), and what `legion-rs train` and the
//! example programs run.
//!
//! [`Training`] collects the [`TrainOptions`]; [`Job::start`] validates them and starts an
//! engine; [`Job::run`] steps it and reports what happens as [`JobEvent`]s. The job prints
//! nothing itself, so that a caller shows a run its own way.
//!
//! - `events.rs`: what a job reports; `strategy.rs`: [`Strategy`] and how its configs are chosen;
//!   `checks.rs`: what is refused before anything is loaded; `run.rs`: the step loop.

mod checks;
mod events;
mod run;
mod strategy;
mod verify;

pub use checks::check_output_path;
pub use events::{
    Evaluation, JobEvent, LossTrend, PlannedRun, Recovered, Rejoined, StepDone, TrainSummary,
};
pub use strategy::{
    Chosen, Strategy, choose_strategy, choose_strategy_for, choose_strategy_ranked,
    choose_strategy_reporting, strategy_names,
};
pub use verify::{Candidate, TRIAL_STEPS, Tried, Verification};

use crate::costs::{self, CacheKey, CostCache, CostReport, Costs};
use crate::device::{self, DeviceKind};
use crate::machine::{cluster_machine, embedded_machine, gpus_machine};
use crate::precision;
use anyhow::{Context, bail};
use checks::{ModelShape, check_device_memory, check_options, classes_mismatch, initial_state};
use legion_cluster::engine::{self, Engine, JobStart, OneGpu, Place};
use legion_cluster::hosts::Hosts;
use legion_cluster::launch;
use legion_ops::capture::CaptureSetting;
use legion_ops::checkpoint::Checkpoint;
use legion_ops::data::{self, BatchFeed, Data, Dataset, OpenProgress, Transforms};
use legion_ops::train::{LossReadback, LrSchedule, Sgd};
use legion_ops::{Graph, Precision};
use legion_planner::progress::Progress;
use legion_planner::search::SearchKind;
use legion_planner::{MachineModel, ParallelConfig, Strategy as StrategyFile};
use std::path::PathBuf;
use std::sync::Arc;
use strategy::strategy_file_configs;

/// Everything a training run needs besides the model. [`Training`] sets them one by one.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Devices of the embedded cluster (1: the single-device trainer); a cluster's own count
    /// replaces it.
    pub devices: usize,
    pub steps: u64,
    /// Train this many passes over the data instead (`steps` is then epochs × its batches).
    pub epochs: Option<u64>,
    pub data: Data,
    /// How the samples are cropped, mirrored and normalised; `None`: the data's own default
    /// ([`Data::default_transforms`]: torchvision's training recipe for a folder of images).
    pub transforms: Option<Transforms>,
    /// A sample that cannot be read stops the run, instead of being skipped and counted.
    pub strict_data: bool,
    /// On a cluster, the driver reads the samples and sends them to the workers (8-bit pixels
    /// where it can), instead of each worker reading its devices' own from the data's path.
    pub data_on_driver: bool,
    /// Held-out data scored during the run and at its end.
    pub validation: Option<Validation>,
    pub init: Option<PathBuf>,
    /// The weights the model file carried (an ONNX file's initializers): the run starts from them
    /// unless `init` or `resume` says otherwise.
    pub model_weights: Option<Checkpoint>,
    pub save: Option<PathBuf>,
    pub sgd: Sgd,
    /// How the learning rate moves over the steps from `sgd.lr`.
    pub lr_schedule: LrSchedule,
    pub seed: u64,
    /// With several devices: a search or a strategy file.
    pub strategy: Strategy,
    /// What a search prices tiles with.
    pub costs: Costs,
    /// Where measured costs are kept between runs; `None`: nowhere (a search then prices by
    /// roofline, and says why).
    pub cost_cache: Option<CostCache>,
    /// With `resume`: search the strategy again instead of training on with the checkpoint's.
    pub replan: bool,
    /// Alternatives to the search's strategy that the run trains a few steps each on the
    /// devices, keeping the one measured fastest (0: none).
    pub verify: usize,
    /// What a run on a cluster does when it loses a worker.
    pub recovery: Recovery,
    /// Write the strategy the devices run here (a strategy JSON file).
    pub save_strategy: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the last step here.
    pub trace: Option<PathBuf>,
    /// Also save the state to `save` every this many steps (atomically, so a crash leaves the
    /// previous checkpoint whole).
    pub checkpoint_every: Option<u64>,
    /// Continue from a checkpoint: its weights, momentum and step; `steps` counts from the start.
    pub resume: Option<PathBuf>,
    /// Train on the workers of this cluster (started by `legion-rs up`) instead of in-process.
    pub cluster: Option<PathBuf>,
    /// Train on the workers `legion-rs up --slurm` started in the Slurm job this runs in.
    pub slurm: bool,
    /// The cluster's state directory, if not the default of its hosts file (or Slurm job).
    pub cluster_state: Option<PathBuf>,
    /// A GPU where the run can use one (`Auto`), the CPU, or a GPU or an error.
    pub device: DeviceKind,
    /// Each device's memory, GiB, which the strategy must fit.
    pub memory_gib: Option<f64>,
    /// What the run computes in; `None`: a cluster's hosts-file `precision`, else fp32. bf16 is
    /// refused where it cannot run as asked (`crate::precision`).
    pub precision: Option<Precision>,
    /// The GPUs the devices spread over, by ordinal (one listed twice: logical GPUs on one
    /// device); `None`: as many of those found as there are devices.
    pub gpus: Option<Vec<usize>>,
    /// How a GPU runs the steps.
    pub gpu: GpuOptions,
    /// Where a search for the strategy reports its progress.
    pub search_progress: Reported<dyn Progress>,
    /// Where opening a folder of images reports its check of the files.
    pub open_progress: Reported<dyn OpenProgress>,
    /// Set by the caller to stop the run before its next step (a Ctrl-C): the run then ends as
    /// at its last step, its state saved where `save` asks.
    pub stop: StopSignal,
}

/// A flag the caller raises to stop a run between steps.
#[derive(Clone, Debug, Default)]
pub struct StopSignal(Arc<std::sync::atomic::AtomicBool>);

impl StopSignal {
    pub fn new() -> StopSignal {
        StopSignal::default()
    }

    /// Asks the run to stop before its next step.
    pub fn raise(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_raised(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Held-out data a run scores (top-1, top-5, loss) with the weights it has trained so far.
#[derive(Clone, Debug)]
pub struct Validation {
    pub data: HeldOut,
    /// Every this many steps, and at the end; `None`: at the end only.
    pub every: Option<u64>,
}

/// Where held-out samples come from.
#[derive(Clone, Debug)]
pub enum HeldOut {
    /// A dataset of their own (`--val-data`), of the training data's classes.
    Data(Data),
    /// This fraction of the training data's samples, seeded by the run's seed, which the run
    /// then does not train on (`--val-split`).
    Split(f64),
}

/// Where a run reports the progress of a long part of its start (the strategy search's phases,
/// [`Progress`]; the check of a folder's files, [`OpenProgress`]): nowhere by default.
pub struct Reported<T: ?Sized>(Option<Arc<T>>);

impl<T: ?Sized> Reported<T> {
    pub fn to(progress: Arc<T>) -> Reported<T> {
        Reported(Some(progress))
    }

    pub fn get(&self) -> Option<&T> {
        self.0.as_deref()
    }
}

impl<T: ?Sized> Default for Reported<T> {
    fn default() -> Self {
        Reported(None)
    }
}

impl<T: ?Sized> Clone for Reported<T> {
    fn clone(&self) -> Self {
        Reported(self.0.clone())
    }
}

impl<T: ?Sized> std::fmt::Debug for Reported<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "Reported(to a listener)",
            None => "Reported(nowhere)",
        })
    }
}

/// How a GPU runs the steps: each switch exists to measure what the default saves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuOptions {
    /// How a GPU picks its convolution algorithms.
    pub conv_algos: legion_cuda::ConvAlgos,
    /// Where a GPU's convolutions apply bias and ReLU (separately, to measure what fusing saves).
    pub conv_epilogue: legion_cuda::ConvEpilogue,
    /// Whether the one-device trainer stages the next batch while a step computes.
    pub prefetch: bool,
    /// Whether the one-device trainer on a GPU records its step as a CUDA graph after the first
    /// and replays it.
    pub capture: CaptureSetting,
    /// Whether the one-device trainer on a GPU draws synthetic batches on the GPU from their
    /// description (else on the host, copied as other data is).
    pub synthetic_on_device: bool,
    /// Whether the one-device trainer reads a step's loss one step late, while the next step
    /// runs, or at the step's end.
    pub loss_readback: LossReadback,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            conv_algos: legion_cuda::ConvAlgos::default(),
            conv_epilogue: legion_cuda::ConvEpilogue::default(),
            prefetch: true,
            capture: CaptureSetting::On,
            synthetic_on_device: true,
            loss_readback: LossReadback::OneStepLate,
        }
    }
}

/// How a run on a cluster survives losing a worker (one that dies, hangs or drops off the
/// network): it plans again for the devices left, with the search it started with, restores its
/// latest snapshot onto them and trains on from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// The most lost workers a run recovers from; 0: a lost worker ends the run.
    pub max_recoveries: u32,
    /// Steps between the snapshots the driver keeps of the whole state (weights, buffers,
    /// momentum), gathered from the workers: a recovery trains at most this many steps again.
    /// `None`: as many as keep the gathering within [`SNAPSHOT_BUDGET`] of the training time
    /// (the first after [`FIRST_SNAPSHOT`] steps). A checkpoint saved by `checkpoint_every` is a
    /// snapshot too.
    pub snapshot_every: Option<u64>,
}

/// The share of a run's time that snapshots chosen by [`Recovery::interval_after`] take.
pub const SNAPSHOT_BUDGET: f64 = 0.05;
/// Steps before a run's first snapshot, where the interval is left to the run.
pub const FIRST_SNAPSHOT: u64 = 10;

impl Default for Recovery {
    fn default() -> Self {
        Recovery {
            max_recoveries: 3,
            snapshot_every: None,
        }
    }
}

impl Recovery {
    /// Steps to the next snapshot after one that took `gather_s` seconds, the steps before it
    /// `step_s` each: the interval asked for, or the fewest steps whose training time is
    /// 1/[`SNAPSHOT_BUDGET`] times the gathering (so a recovery trains again at most that).
    pub fn interval_after(&self, gather_s: f64, step_s: f64) -> u64 {
        if let Some(k) = self.snapshot_every {
            return k;
        }
        let steps = gather_s / (SNAPSHOT_BUDGET * step_s);
        match steps.is_finite() {
            true => (steps.ceil() as u64).max(1),
            false => FIRST_SNAPSHOT,
        }
    }
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            devices: 1,
            steps: 100,
            epochs: None,
            data: Data::default(),
            transforms: None,
            strict_data: false,
            data_on_driver: false,
            validation: None,
            init: None,
            model_weights: None,
            save: None,
            sgd: Sgd::default(),
            lr_schedule: LrSchedule::CONSTANT,
            seed: 1,
            strategy: Strategy::default(),
            costs: Costs::default(),
            cost_cache: CostCache::default_location(),
            replan: false,
            verify: verify::DEFAULT_ALTERNATIVES,
            recovery: Recovery::default(),
            save_strategy: None,
            trace: None,
            checkpoint_every: None,
            device: DeviceKind::Auto,
            resume: None,
            cluster: None,
            slurm: false,
            cluster_state: None,
            memory_gib: None,
            precision: None,
            gpus: None,
            gpu: GpuOptions::default(),
            search_progress: Reported::default(),
            open_progress: Reported::default(),
            stop: StopSignal::default(),
        }
    }
}

/// A training run, built up option by option (each defaults as [`TrainOptions::default`]):
///
/// ```no_run
/// use legion::{Data, SearchKind, Training, ZooConfig};
///
/// let size = ZooConfig { batch: 16, image_size: 64, channels: 3, classes: 10 };
/// let model = legion::zoo("alexnet", size)?;
/// let summary = Training::new(model)
///     .devices(4)
///     .strategy(SearchKind::OptCnn)
///     .data(Data::Folder("images".into()))
///     .steps(100)
///     .run(|_event| {})?;
/// println!("{:?} images/s", summary.images_per_sec);
/// # anyhow::Ok(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a Training does nothing until it is run or started"]
pub struct Training {
    graph: Graph,
    options: TrainOptions,
}

impl Training {
    /// Trains `graph` (its input's N is the global batch) with the default options: one device,
    /// 100 steps of synthetic data, SGD with momentum.
    pub fn new(graph: Graph) -> Training {
        Training::with_options(graph, TrainOptions::default())
    }

    /// Trains `graph` with `options` set all at once (as the command line does).
    pub fn with_options(graph: Graph, options: TrainOptions) -> Training {
        Training { graph, options }
    }

    /// The options so far.
    pub fn options(&self) -> &TrainOptions {
        &self.options
    }

    /// Devices of the embedded cluster: device actors in this process (1: the single-device
    /// trainer).
    pub fn devices(mut self, devices: usize) -> Self {
        self.options.devices = devices;
        self
    }

    /// Trains on the workers of the cluster of this hosts file (started by `legion-rs up`).
    pub fn cluster(mut self, hosts: impl Into<PathBuf>) -> Self {
        self.options.cluster = Some(hosts.into());
        self
    }

    /// Trains on the workers `legion-rs up --slurm` started in the Slurm job this runs in.
    pub fn slurm(mut self) -> Self {
        self.options.slurm = true;
        self
    }

    /// The cluster's state directory, where `up` was given one.
    pub fn cluster_state(mut self, dir: impl Into<PathBuf>) -> Self {
        self.options.cluster_state = Some(dir.into());
        self
    }

    /// How each layer is parallelised: a search ([`SearchKind`](crate::SearchKind) converts) or
    /// a strategy file.
    pub fn strategy(mut self, strategy: impl Into<Strategy>) -> Self {
        self.options.strategy = strategy.into();
        self
    }

    /// What the search prices tiles with (default: what the devices measure, kept in the
    /// cost cache).
    pub fn costs(mut self, costs: Costs) -> Self {
        self.options.costs = costs;
        self
    }

    /// Keeps measured costs in this folder instead of the user's cache.
    pub fn cost_cache(mut self, dir: impl Into<PathBuf>) -> Self {
        self.options.cost_cache = Some(CostCache::at(dir));
        self
    }

    /// Trains the search's strategy and up to `alternatives` others a few steps each
    /// ([`TRIAL_STEPS`]), then trains on with the one measured fastest (0: the search's, as it
    /// is). Default 3.
    pub fn verify(mut self, alternatives: usize) -> Self {
        self.options.verify = alternatives;
        self
    }

    /// On a cluster: recovers from at most `max` lost workers (0: a lost worker ends the run),
    /// from snapshots of the state taken every `snapshot_every` steps (`None`: as often as
    /// [`SNAPSHOT_BUDGET`] of the training time allows). Default: 3, `None`.
    pub fn recovery(mut self, max: u32, snapshot_every: Option<u64>) -> Self {
        self.options.recovery = Recovery {
            max_recoveries: max,
            snapshot_every,
        };
        self
    }

    /// With [`Training::resume`]: searches the strategy again instead of training on with the
    /// one the checkpoint's run trained with.
    pub fn replan(mut self) -> Self {
        self.options.replan = true;
        self
    }

    /// Writes the strategy the devices run to this strategy JSON file.
    pub fn save_strategy(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.save_strategy = Some(path.into());
        self
    }

    /// Where the samples come from.
    pub fn data(mut self, data: Data) -> Self {
        self.options.data = data;
        self
    }

    /// How the samples are cropped, mirrored and normalised (else the data's own default).
    pub fn transforms(mut self, transforms: Transforms) -> Self {
        self.options.transforms = Some(transforms);
        self
    }

    /// Scores held-out data during the run (every `validation.every` steps) and at its end.
    pub fn validation(mut self, validation: Validation) -> Self {
        self.options.validation = Some(validation);
        self
    }

    /// Stops the run at a sample that cannot be read, instead of skipping and counting it.
    pub fn strict_data(mut self) -> Self {
        self.options.strict_data = true;
        self
    }

    /// On a cluster, reads the samples here and sends them to the workers, instead of each
    /// worker reading its devices' own (for data at a path other hosts cannot read).
    pub fn data_on_driver(mut self) -> Self {
        self.options.data_on_driver = true;
        self
    }

    /// Trains on a dataset of the caller's own.
    pub fn dataset(self, dataset: impl Dataset + 'static) -> Self {
        self.data(Data::Dataset(Arc::new(dataset)))
    }

    /// Trains on whole batches of the caller's, in the order the feed gives them.
    pub fn feed(self, feed: impl BatchFeed + 'static) -> Self {
        self.data(Data::Feed(Arc::new(feed)))
    }

    /// Stops the run before its next step once `signal` is raised.
    pub fn stop_on(mut self, signal: StopSignal) -> Self {
        self.options.stop = signal;
        self
    }

    /// Steps to train, counted from the start of the run (a resumed run's earlier steps too).
    pub fn steps(mut self, steps: u64) -> Self {
        self.options.steps = steps;
        self
    }

    /// Reports the strategy search's phases to `progress`.
    pub fn search_progress(mut self, progress: Arc<dyn Progress>) -> Self {
        self.options.search_progress = Reported::to(progress);
        self
    }

    /// Reports the check of a folder's image files, as it opens, to `progress`.
    pub fn open_progress(mut self, progress: Arc<dyn OpenProgress>) -> Self {
        self.options.open_progress = Reported::to(progress);
        self
    }

    pub fn sgd(mut self, sgd: Sgd) -> Self {
        self.options.sgd = sgd;
        self
    }

    /// How the learning rate moves over the run from the SGD's.
    pub fn lr_schedule(mut self, schedule: LrSchedule) -> Self {
        self.options.lr_schedule = schedule;
        self
    }

    /// Passes over the data to train, instead of a number of steps.
    pub fn epochs(mut self, epochs: u64) -> Self {
        self.options.epochs = Some(epochs);
        self
    }

    /// Seed of the initialisation, the data order and dropout's masks.
    pub fn seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// Starts from these weights rather than the seeded initialisation.
    pub fn weights(mut self, weights: Checkpoint) -> Self {
        self.options.model_weights = Some(weights);
        self
    }

    /// Starts from the weights of this safetensors checkpoint.
    pub fn init(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.init = Some(path.into());
        self
    }

    /// Continues from this checkpoint: its weights, momentum and step.
    pub fn resume(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.resume = Some(path.into());
        self
    }

    /// Writes the trained state (weights, momentum, step) to this safetensors file.
    pub fn save(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.save = Some(path.into());
        self
    }

    /// Also saves every `steps` steps (needs [`save`](Self::save)).
    pub fn checkpoint_every(mut self, steps: u64) -> Self {
        self.options.checkpoint_every = Some(steps);
        self
    }

    /// Writes a Chrome/Perfetto trace of the last step here.
    pub fn trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.trace = Some(path.into());
        self
    }

    /// Where the steps run: a GPU where one is usable, the CPU, or a GPU or an error.
    pub fn device(mut self, device: DeviceKind) -> Self {
        self.options.device = device;
        self
    }

    /// The GPUs the devices spread over, by CUDA ordinal.
    pub fn gpus(mut self, ordinals: Vec<usize>) -> Self {
        self.options.gpus = Some(ordinals);
        self
    }

    /// Each device's memory, GiB: the strategy must fit it.
    pub fn memory_gib(mut self, gib: f64) -> Self {
        self.options.memory_gib = Some(gib);
        self
    }

    pub fn precision(mut self, precision: Precision) -> Self {
        self.options.precision = Some(precision);
        self
    }

    pub fn gpu(mut self, gpu: GpuOptions) -> Self {
        self.options.gpu = gpu;
        self
    }

    /// Validates the options, plans, and starts the engine; nothing is stepped yet.
    pub fn start(self) -> anyhow::Result<Job> {
        Job::start(self.graph, &self.options)
    }

    /// Starts and runs the job, reporting each event to `on_event`.
    pub fn run(self, on_event: impl FnMut(JobEvent<'_>)) -> anyhow::Result<TrainSummary> {
        self.start()?.run(on_event)
    }
}

/// The devices of `0..devices` that no layer of `configs` uses.
pub(crate) fn idle_devices(configs: &[ParallelConfig], devices: usize) -> Vec<usize> {
    let mut used = vec![false; devices];
    for c in configs {
        for d in c.devices() {
            if let Some(u) = used.get_mut(d) {
                *u = true;
            }
        }
    }
    (0..devices).filter(|&d| !used[d]).collect()
}

/// A started job: validated, its engine running, not yet stepped.
pub struct Job {
    graph: Graph,
    opts: TrainOptions,
    engine: Box<dyn Engine>,
    source: Source,
    /// The held-out samples the run scores, if any.
    validation: Option<Arc<dyn Dataset>>,
    plan: Option<PlannedRun>,
    devices: usize,
    first_step: u64,
    /// `device: ...`, the line that says where the steps run.
    device: String,
    /// Whether the devices are actors on GPUs (which do not record their steps).
    actors_on_gpus: bool,
    /// Whether synthetic batches come described, for the one GPU to draw.
    describe_synthetic: bool,
    /// Whether 8-bit images come as their bytes, for a cluster's workers to make values.
    images_as_bytes: bool,
    /// Where a cluster's workers read the training samples themselves: what they open.
    workers_read: Option<data::DataSource>,
    /// What the steps compute in.
    precision: Precision,
    /// What the user should know about the run's inputs, said after the device line.
    init_note: Option<String>,
    /// What opening the data found, said after the device line.
    data_note: Option<String>,
    /// A cost cache file that could not be used, said as a warning.
    cost_warning: Option<String>,
    /// Where the steps' measured tile costs are added, where the run measures them.
    cost_cache: Option<(CostCache, CacheKey)>,
    /// The strategies to verify, the search's first (none where it is not verified).
    candidates: Vec<verify::Candidate>,
    /// How to start the devices again on another strategy, where they can be.
    restart: Option<Restart>,
    /// Whether the devices plan inference beside the step.
    inference: bool,
    /// The state the run starts from, kept where a lost worker can be recovered from.
    snapshot: Option<legion_ops::train::TrainingState>,
}

/// Where a job's devices are, owned, so that an engine can be started there again.
pub(crate) enum Restart {
    Embedded {
        devices: usize,
    },
    Cluster {
        hosts: Hosts,
        state_dir: PathBuf,
        gpu: legion_cuda::Settings,
    },
}

impl Restart {
    /// Where the devices start again; a cluster's workers read `data` where it is given.
    pub(crate) fn place<'a>(&'a self, data: Option<&'a data::DataSource>) -> Place<'a> {
        match self {
            Restart::Embedded { devices } => Place::Embedded {
                devices: *devices,
                placement: legion_runtime::Placement::Cpu,
            },
            Restart::Cluster {
                hosts,
                state_dir,
                gpu,
            } => Place::Cluster {
                hosts,
                state_dir,
                gpu: *gpu,
                data,
            },
        }
    }
}

impl Job {
    /// Validates `opts` against `graph`, chooses the strategy, checks that the run fits this host,
    /// loads the weights it starts from and starts its engine.
    pub fn start(graph: Graph, opts: &TrainOptions) -> anyhow::Result<Job> {
        let shape = check_options(&graph, opts)?;
        // The run's outputs are checked before any work, so that a run is never lost to an
        // output it cannot write.
        if let Some(path) = &opts.save {
            check_output_path("--save", path)?;
        }
        if let Some(path) = &opts.trace {
            check_output_path("--trace", path)?;
        }
        if let Some(path) = &opts.save_strategy {
            check_output_path("--save-strategy", path)?;
        }
        let cluster = target_cluster(opts)?;
        let devices = cluster
            .as_ref()
            .map_or(opts.devices, |(_, h, _)| h.num_devices());
        let distributed = devices > 1 || cluster.is_some();
        // First: an embedded run on GPUs is planned for them.
        let mut device = device::choose_listed(
            opts.device,
            devices,
            cluster.is_some(),
            opts.gpus.as_deref(),
            legion_cuda::probe,
        )?;
        // A precision the devices cannot compute is refused before a GPU starts.
        let precision = match &cluster {
            Some((label, hosts, _)) => precision::resolve(opts.precision, hosts.precision, label)?,
            None => opts.precision.unwrap_or_default(),
        };
        let math = precision::gpu_math(precision);
        let settings = legion_cuda::Settings {
            math,
            conv_algos: opts.gpu.conv_algos,
            conv_epilogue: opts.gpu.conv_epilogue,
            // One device's buffers never leave its stream; device actors sharing a GPU hand
            // theirs to each other.
            sharing: match distributed {
                false => legion_cuda::Sharing::WithinStreams,
                true => legion_cuda::Sharing::AcrossStreams,
            },
        };
        let gpus = device::start_gpus(&mut device, opts.device, devices, settings)?;
        // After the flags are checked, before the cluster's measured links are read.
        if cluster.is_some() {
            launch::locate(opts.cluster.as_deref(), opts.cluster_state.as_deref())?
                .require_state()?;
        }
        let gpu_workers = cluster.as_ref().is_some_and(|(_, hosts, _)| {
            hosts
                .hosts
                .iter()
                .any(|h| h.device_kind == legion_cluster::hosts::GPU_KIND)
        });
        if opts.sgd.nesterov && (gpus.is_some() || gpu_workers) {
            bail!(
                "--nesterov runs on the CPU only: the GPU's SGD kernel has no Nesterov step yet \
                 (train with --device cpu, or without --nesterov)"
            );
        }
        let Planned {
            configs,
            place,
            costs,
            cost_cache,
            cost_warning,
            candidates,
        } = plan(
            &graph,
            opts,
            cluster.as_ref(),
            gpus.as_ref(),
            devices,
            distributed,
            precision,
        )?;
        let strategy = StrategyFile::from_configs(&graph, &configs);
        if let Some(path) = &opts.save_strategy {
            strategy
                .save(path)
                .with_context(|| format!("--save-strategy {}", path.display()))?;
        }
        // Before any weight is allocated: a model too large must get an error, not an abort. The
        // workers of a cluster check their own devices when the job reaches them; on a GPU the
        // host keeps only the job's state and the device's share goes to the GPU's memory.
        match &gpus {
            Some(started) => {
                legion_cluster::memory::check_this_host(&graph, None)?;
                device::check_gpus_fit(&graph, &configs, devices, &started.info)?;
            }
            None => {
                let embedded = cluster.is_none().then_some((&configs[..], devices));
                legion_cluster::memory::check_this_host(&graph, embedded)?;
            }
        }

        // After the model is known to fit (a synthetic dataset is sized by its classes), before
        // the weights are loaded and the engine started.
        let (source, validation) = open_datasets(&graph, opts, &shape)?;
        let workers_read = match (&cluster, &source) {
            (Some(_), Source::Samples(dataset)) if !opts.data_on_driver => {
                workers_data(opts, dataset.as_ref(), &shape)
            }
            _ => None,
        };
        let opts = &with_steps(opts, source.batches_per_epoch(graph.batch()))?;
        let data_note = source.census().map(|census| {
            let held = match &validation {
                Some(v) => format!("; scored on {}", v.describe()),
                None => String::new(),
            };
            format!("--data {}: {}{held}", opts.data, census.describe())
        });
        let (state, init_note) = initial_state(&graph, opts)?;
        let first_step = state.step;
        if first_step > opts.steps {
            bail!(
                "--resume: the checkpoint is at step {first_step}, past --steps {}",
                opts.steps
            );
        }
        // Device actors on GPUs enqueue op by op: said in the summary, as a recording's fallback is.
        let actors_on_gpus = cluster.is_none() && distributed && gpus.is_some();
        // Only the one-device trainer on a GPU draws batches on its device.
        let describe_synthetic = opts.gpu.synthetic_on_device
            && cluster.is_none()
            && !distributed
            && gpus.is_some()
            && matches!(&source, Source::Samples(d) if d.as_synthetic().is_some());
        // A cluster run can start again elsewhere: on other strategies, or other workers.
        let restart = match (&cluster, &gpus) {
            (None, _) if candidates.len() < 2 => None,
            (Some((_, hosts, state_dir)), _) => Some(Restart::Cluster {
                hosts: hosts.clone(),
                state_dir: state_dir.clone(),
                gpu: settings,
            }),
            (None, None) => Some(Restart::Embedded { devices }),
            // GPUs started once for the run are not started again
            (None, Some(_)) => None,
        };
        let validation_wanted = validation.is_some();
        let snapshot = (cluster.as_ref())
            .is_some_and(|(_, hosts, _)| hosts.hosts.len() > 1 && opts.recovery.max_recoveries > 0)
            .then(|| state.clone());
        let engine_place = match (&cluster, gpus) {
            (Some((_, hosts, state_dir)), _) => Place::Cluster {
                hosts,
                state_dir,
                gpu: settings,
                data: workers_read.as_ref(),
            },
            (None, gpus) if distributed => Place::Embedded {
                devices,
                placement: gpus
                    .map(device::StartedGpus::into_placement)
                    .unwrap_or_default(),
            },
            (None, Some(started)) => {
                let (cuda, stream) = started.into_one();
                Place::OneGpu(Box::new(OneGpu {
                    cuda,
                    stream,
                    prefetch: opts.gpu.prefetch,
                    // A recorded step replays the rate it was recorded with.
                    capture: match opts.lr_schedule.is_constant() {
                        true => opts.gpu.capture,
                        false => CaptureSetting::Off,
                    },
                    readback: opts.gpu.loss_readback,
                }))
            }
            (None, None) => Place::OneDevice(opts.gpu.loss_readback),
        };
        let engine = engine::start(
            engine_place,
            JobStart {
                graph: &graph,
                configs: &configs,
                state,
                sgd: opts.sgd,
                seed: opts.seed,
                precision,
                inference: validation.is_some(),
            },
        )?;
        let plan = distributed.then(|| PlannedRun {
            choice: opts.strategy.clone(),
            devices,
            place,
            remote_bytes: engine.plan().expect("a distributed engine").remote_bytes(),
            strategy,
            idle_devices: idle_devices(&configs, devices),
            costs,
            verification: None,
        });
        Ok(Job {
            graph,
            opts: opts.clone(),
            engine,
            source,
            validation,
            plan,
            devices,
            first_step,
            device: device.line,
            actors_on_gpus,
            describe_synthetic,
            images_as_bytes: cluster.is_some(),
            workers_read,
            precision,
            init_note,
            data_note,
            cost_warning,
            cost_cache,
            candidates,
            restart,
            inference: validation_wanted,
            snapshot,
        })
    }
}

/// What a run trains on: samples its loader batches, or the caller's whole batches.
pub(crate) enum Source {
    Samples(Arc<dyn Dataset>),
    /// With the shape each of its batches must have.
    Feed(Arc<dyn BatchFeed>, data::FeedShape),
}

impl Source {
    /// Batches in one pass over the data, where that is known.
    fn batches_per_epoch(&self, batch: usize) -> Option<u64> {
        match self {
            Source::Samples(dataset) => Some((dataset.num_samples() / batch) as u64),
            Source::Feed(feed, _) => feed.batches(),
        }
    }

    fn census(&self) -> Option<&data::Census> {
        match self {
            Source::Samples(dataset) => dataset.census(),
            Source::Feed(..) => None,
        }
    }
}

/// `opts` with the steps `--epochs` asks for over `batches` a pass, its schedule checked.
fn with_steps(opts: &TrainOptions, batches: Option<u64>) -> anyhow::Result<TrainOptions> {
    let mut opts = opts.clone();
    if let Some(epochs) = opts.epochs {
        if epochs == 0 {
            bail!("--epochs 0: train at least one pass");
        }
        let Some(batches) = batches else {
            bail!(
                "--epochs: {} does not say how many batches it holds; give a number of steps",
                opts.data
            );
        };
        opts.steps = epochs
            .checked_mul(batches)
            .context("--epochs: too many steps")?;
    }
    opts.lr_schedule
        .check(opts.sgd.lr, opts.steps)
        .map_err(|why| anyhow::anyhow!("--lr-schedule {}: {why}", opts.lr_schedule))?;
    Ok(opts)
}

/// The cluster a run trains on, if any (`--cluster` or `--slurm`): its label, its hosts and its
/// state directory, the devices given checked against the cluster's.
fn target_cluster(opts: &TrainOptions) -> anyhow::Result<Option<(String, Hosts, PathBuf)>> {
    let located = match (&opts.cluster, opts.slurm) {
        (Some(_), true) => bail!("--cluster and --slurm: give one of them"),
        (Some(path), false) => Some(launch::locate(Some(path), opts.cluster_state.as_deref())?),
        (None, true) => Some(launch::locate(None, opts.cluster_state.as_deref())?),
        (None, false) if opts.cluster_state.is_some() => {
            bail!("--state is the state directory of a --cluster or --slurm cluster; give one")
        }
        (None, false) => None,
    };
    Ok(match located {
        Some(located) => {
            let hosts = located.load_hosts()?;
            if opts.devices != 1 && opts.devices != hosts.num_devices() {
                bail!(
                    "--devices {} but the cluster {} has {} device(s); leave --devices out with --cluster",
                    opts.devices,
                    located.label(),
                    hosts.num_devices()
                );
            }
            Some((located.label(), hosts, located.state))
        }
        None => None,
    })
}

/// What [`plan`] decided.
struct Planned {
    configs: Vec<ParallelConfig>,
    /// Where the devices are, as the plan line says it.
    place: String,
    /// What the search priced tiles with, where a search ran.
    costs: Option<CostReport>,
    cost_cache: Option<(CostCache, CacheKey)>,
    cost_warning: Option<String>,
    /// The strategies to verify on the devices, the search's first; empty where none are.
    candidates: Vec<verify::Candidate>,
}

/// The configs the devices run and where they are: a search's or a strategy file's on several
/// devices (priced on the run's machine as `opts.costs` says, and checked to fit its devices'
/// memory), or the plan of the checkpoint a run resumes; every layer serial on one.
fn plan(
    graph: &Graph,
    opts: &TrainOptions,
    cluster: Option<&(String, Hosts, PathBuf)>,
    gpus: Option<&device::StartedGpus>,
    devices: usize,
    distributed: bool,
    precision: Precision,
) -> anyhow::Result<Planned> {
    let with_memory = |machine: MachineModel| match opts.memory_gib {
        Some(gib) => machine.with_device_memory_gib(gib),
        None => Ok(machine),
    };
    let planned = |configs, place| Planned {
        configs,
        place,
        costs: None,
        cost_cache: None,
        cost_warning: None,
        candidates: Vec::new(),
    };
    if !distributed {
        // One device runs every layer serially; a strategy file given is still checked
        // against the model and the device count, so that a wrong one is never ignored.
        if let Strategy::File(path) = &opts.strategy {
            strategy_file_configs("--strategy", graph, devices, path)?;
        }
        let serial = vec![ParallelConfig::serial(0); graph.layers().len()];
        check_device_memory(
            graph,
            &with_memory(embedded_machine(1)?)?,
            &serial,
            "serial",
        )?;
        return Ok(planned(serial, "one device".to_string()));
    }
    let (machine, place, measure_on) = match cluster {
        Some((label, hosts, state)) => (
            cluster_machine(hosts, state)?.with_precision(precision),
            format!("{} worker(s) of {label}", hosts.hosts.len()),
            costs::Devices::Workers {
                hosts,
                state: state.as_path(),
            },
        ),
        None => match gpus {
            Some(started) => (
                gpus_machine(devices, &started.info, precision)?,
                "embedded device(s) on GPUs".to_string(),
                costs::Devices::Elsewhere {
                    why: "a run on GPUs does not measure its op costs before its search yet \
                          (`legion-rs profile --device cuda` and --costs FILE price them)",
                },
            ),
            // priced in the run's precision: bf16 slices move half the bytes
            None => (
                embedded_machine(devices)?.with_precision(precision),
                "embedded device(s)".to_string(),
                costs::Devices::EmbeddedCpu { devices },
            ),
        },
    };
    let machine = with_memory(machine)?;
    if let Some(saved) = resumed_plan(graph, opts, devices)? {
        check_device_memory(graph, &machine, &saved, "the checkpoint's strategy")?;
        return Ok(planned(saved, place));
    }
    let Strategy::Search(kind) = &opts.strategy else {
        let configs = choose_strategy_for("--strategy", graph, &machine, &opts.strategy)?;
        check_device_memory(graph, &machine, &configs, &opts.strategy.to_string())?;
        return Ok(planned(configs, place));
    };
    let pricing = costs::prepare(
        &opts.costs,
        graph,
        measure_on,
        precision,
        opts.cost_cache.as_ref(),
        opts.search_progress.get(),
    )?;
    // A profile measured here also gives the devices' links, cores and runtime costs.
    let machine = match &pricing.db {
        Some(db) if cluster.is_none() && gpus.is_none() => db.apply_to(machine),
        _ => machine,
    };
    // What a search optimises under the cost model is verified on the devices; a fixed scheme
    // asked for by name (data, OWT, another paper's planner) is trained as asked. GPUs are
    // started once a run: their strategies are not verified.
    let optimised = matches!(
        kind,
        SearchKind::OptCnn | SearchKind::Exhaustive | SearchKind::Refine
    );
    let alternatives = match gpus {
        None if optimised => opts.verify,
        _ => 0,
    };
    let Chosen {
        configs,
        priced,
        candidates,
    } = choose_strategy_ranked(
        "--strategy",
        graph,
        &machine,
        &opts.strategy,
        pricing.db.as_ref(),
        opts.search_progress.get(),
        alternatives,
    )?;
    check_device_memory(graph, &machine, &configs, &opts.strategy.to_string())?;
    // An alternative is tried only where it fits the devices as the search's strategy does.
    let candidates: Vec<verify::Candidate> = candidates
        .into_iter()
        .filter(|c| check_device_memory(graph, &machine, &c.configs, &c.label).is_ok())
        .collect();
    Ok(Planned {
        configs,
        place,
        costs: Some(pricing.report.searched(priced)),
        cost_cache: pricing.cache,
        cost_warning: pricing.refused,
        candidates,
    })
}

/// The configs for `hosts`, the workers a cluster run has now (after losing one, or taking one
/// back), under the search or scheme the run started with, on the links `up` measured, checked to
/// fit their memory; and, for a search, what it priced the tiles with. A search prices them as
/// the run's first did: by what the workers measure, which for a worker of the first plan is what
/// its cache kept then, so nothing is timed again.
fn replan_cluster(
    graph: &Graph,
    opts: &TrainOptions,
    hosts: &Hosts,
    state: &std::path::Path,
    precision: Precision,
) -> anyhow::Result<(Vec<ParallelConfig>, Option<CostReport>)> {
    let mut machine = cluster_machine(hosts, state)?.with_precision(precision);
    if let Some(gib) = opts.memory_gib {
        machine = machine.with_device_memory_gib(gib)?;
    }
    let (configs, report) = match &opts.strategy {
        Strategy::Search(_) => {
            let workers = costs::Devices::Workers { hosts, state };
            let pricing = costs::prepare(&opts.costs, graph, workers, precision, None, None)?;
            let chosen = choose_strategy_ranked(
                "--strategy",
                graph,
                &machine,
                &opts.strategy,
                pricing.db.as_ref(),
                None,
                0,
            )?;
            (chosen.configs, Some(pricing.report.searched(chosen.priced)))
        }
        scheme => (
            choose_strategy_for("--strategy", graph, &machine, scheme)?,
            None,
        ),
    };
    check_device_memory(graph, &machine, &configs, &opts.strategy.to_string())?;
    Ok((configs, report))
}

/// The checkpoint metadata key of the strategy a run trained with (strategy JSON).
pub(crate) const STRATEGY_KEY: &str = "strategy";
/// The checkpoint metadata key of the devices that strategy ran on.
pub(crate) const DEVICES_KEY: &str = "devices";

/// The strategy of the checkpoint `opts` resumes, unless it is asked to plan again or to run a
/// strategy file; refused where the checkpoint's run had other devices.
fn resumed_plan(
    graph: &Graph,
    opts: &TrainOptions,
    devices: usize,
) -> anyhow::Result<Option<Vec<ParallelConfig>>> {
    let Some(path) = &opts.resume else {
        return Ok(None);
    };
    if opts.replan || matches!(opts.strategy, Strategy::File(_)) {
        return Ok(None);
    }
    let metadata = legion_ops::checkpoint::load_metadata(path)?;
    let Some(text) = metadata.get(STRATEGY_KEY) else {
        return Ok(None);
    };
    let file = format!("{} (its strategy)", path.display());
    let trained_on = metadata
        .get(DEVICES_KEY)
        .and_then(|d| d.parse::<usize>().ok());
    if let Some(trained_on) = trained_on.filter(|&d| d != devices) {
        bail!(
            "--resume {}: its run trained on {trained_on} devices, this one has {devices}: give \
             --replan to search a strategy for {devices}",
            path.display()
        );
    }
    let saved = StrategyFile::from_json(text, &file)?;
    let configs = saved.to_configs(graph, devices).map_err(|e| {
        anyhow::anyhow!(
            "--resume {file}: {e}; the checkpoint's run trained with another plan: give \
             --replan to search one for these devices"
        )
    })?;
    Ok(Some(configs))
}

/// The samples a run scores, where it scores any.
type HeldOutSamples = Option<Arc<dyn Dataset>>;

/// What a run trains on and the samples it scores (`--val-data`, or the `--val-split` it holds
/// out of the training data, seen through the evaluation recipe).
fn open_datasets(
    graph: &Graph,
    opts: &TrainOptions,
    shape: &ModelShape,
) -> anyhow::Result<(Source, HeldOutSamples)> {
    let transforms = opts
        .transforms
        .unwrap_or_else(|| opts.data.default_transforms());
    let train = match &opts.data {
        Data::Feed(feed) => {
            if opts.transforms.is_some_and(|t| t != Transforms::PLAIN) {
                bail!(
                    "--data {}: whole batches are trained on as they are given; crops, flips \
                     and normalisation apply to folder: and cifar10: data",
                    feed.describe()
                );
            }
            if let Some(HeldOut::Split(_)) = opts.validation.as_ref().map(|v| &v.data) {
                bail!(
                    "--val-split: {} hands over whole batches, none of which can be held out; \
                     give held-out data of its own",
                    feed.describe()
                );
            }
            None
        }
        data => Some(open_dataset(
            "--data", data, transforms, opts.seed, graph, opts, shape,
        )?),
    };
    let source = |train: Option<Arc<dyn Dataset>>| match (train, &opts.data) {
        (Some(dataset), _) => Source::Samples(dataset),
        (None, Data::Feed(feed)) => Source::Feed(
            feed.clone(),
            data::FeedShape {
                batch: graph.batch(),
                image: shape.image,
                classes: shape.classes,
            },
        ),
        (None, _) => unreachable!("only a feed is not opened"),
    };
    let Some(validation) = &opts.validation else {
        return Ok((source(train), None));
    };
    if validation.every == Some(0) {
        bail!("--eval-every 0: score every K steps, K at least 1");
    }
    // Scored as evaluated: the evaluation recipe, normalised as the training data is.
    let scored = |data: &Data| Transforms {
        normalize: transforms.normalize,
        ..data.eval_transforms()
    };
    Ok(match &validation.data {
        HeldOut::Data(data) => {
            let held = {
                // Held-out synthetic samples are drawn apart from the training ones.
                let seed = opts.seed ^ HELD_OUT_SEED;
                open_dataset("--val-data", data, scored(data), seed, graph, opts, shape)?
            };
            if let (Some(a), Some(b)) = (train.as_ref().and_then(|t| t.census()), held.census())
                && a.class_names != b.class_names
            {
                bail!(
                    "--val-data {data}: its classes {:?} are not the training data's {:?} (labels follow the sorted folder names)",
                    b.class_names,
                    a.class_names
                );
            }
            (source(train), Some(held))
        }
        HeldOut::Split(fraction) => {
            let train = train.expect("a feed is refused a split above");
            let (train_part, held_part) = data::split(train.num_samples(), *fraction, opts.seed)
                .with_context(|| format!("--val-split {fraction}"))?;
            let held = match train.seen_through(scored(&opts.data)) {
                Some(held) => held,
                None => {
                    let scored = scored(&opts.data);
                    open_dataset("--data", &opts.data, scored, opts.seed, graph, opts, shape)?
                }
            };
            (
                Source::Samples(Arc::new(data::Subset::new(
                    train,
                    train_part,
                    "the training part",
                )?)),
                Some(Arc::new(data::Subset::new(
                    held,
                    held_part,
                    &format!("{fraction} held out"),
                )?)),
            )
        }
    })
}

/// What a cluster's workers open to read the training samples `dataset` themselves, where they
/// can: as `open_datasets` opened it, from a path (or synthetic data) every host can use.
fn workers_data(
    opts: &TrainOptions,
    dataset: &dyn Dataset,
    shape: &ModelShape,
) -> Option<data::DataSource> {
    let held_out = match opts.validation.as_ref().map(|v| &v.data) {
        Some(HeldOut::Split(fraction)) => Some(*fraction),
        _ => None,
    };
    let transforms = opts
        .transforms
        .unwrap_or_else(|| opts.data.default_transforms());
    let (image, classes, seed) = (shape.image, shape.classes, opts.seed);
    data::DataSource::of(
        &opts.data, dataset, image, classes, seed, transforms, held_out,
    )
}

/// What the seed of `--val-data` differs from the run's by (`--seed`).
const HELD_OUT_SEED: u64 = 0x4845_4c44_4f55_5421;

/// One dataset of a run, refused where its classes are not the model's outputs.
fn open_dataset(
    flag: &str,
    data: &Data,
    transforms: Transforms,
    seed: u64,
    graph: &Graph,
    opts: &TrainOptions,
    shape: &ModelShape,
) -> anyhow::Result<Arc<dyn Dataset>> {
    let spec = data.to_string();
    let progress = opts.open_progress.get().unwrap_or(&());
    let dataset = match data.open_reporting(shape.image, shape.classes, seed, transforms, progress)
    {
        Err(data::DataError::TooManyClasses {
            dataset,
            dataset_classes,
            ..
        }) => {
            return Err(classes_mismatch(
                flag,
                &spec,
                &dataset,
                dataset_classes,
                graph,
                shape.classes,
            ));
        }
        opened => opened.with_context(|| format!("{flag} {spec}"))?,
    };
    if opts.strict_data
        && let Some((path, why)) = dataset.census().and_then(|c| c.unreadable.first())
    {
        bail!(
            "{flag} {spec}: {}: {why} (--strict-data: every image must be readable; leave it \
             out to skip such files)",
            path.display()
        );
    }
    if dataset.num_classes() != shape.classes {
        return Err(classes_mismatch(
            flag,
            &spec,
            &dataset.describe(),
            dataset.num_classes(),
            graph,
            shape.classes,
        ));
    }
    Ok(dataset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_keep_to_their_budget_unless_an_interval_is_asked_for() {
        let auto = Recovery::default();
        // AlexNet 224 on two hosts over 1 Gbit/s: 5.3 s a snapshot, 1.1 s a step
        assert_eq!(auto.interval_after(5.3, 1.1), 97);
        let k = auto.interval_after(5.3, 1.1) as f64;
        assert!(5.3 / (k * 1.1) <= SNAPSHOT_BUDGET);
        assert!(5.3 / ((k - 1.0) * 1.1) > SNAPSHOT_BUDGET);
        // a cheap snapshot: every step
        assert_eq!(auto.interval_after(1e-6, 0.1), 1);
        // nothing measured: the first interval again
        assert_eq!(auto.interval_after(1.0, 0.0), FIRST_SNAPSHOT);
        let fixed = Recovery {
            snapshot_every: Some(7),
            ..auto
        };
        assert_eq!(fixed.interval_after(5.3, 1.1), 7);
    }

    #[test]
    fn a_recovery_says_what_was_lost_and_what_it_cost() {
        let r = Recovered {
            lost: "worker w1 (127.0.0.1:7001) stopped responding".into(),
            from_step: 10,
            steps_lost: 4,
            devices: 2,
            strategy: "optcnn".into(),
            costs: Some(CostReport {
                choice: "measured".into(),
                measuring: None,
                workers: Vec::new(),
                priced: Some((12, 3, 0)),
                roofline_because: None,
            }),
            seconds: 1.5,
            search_s: 0.25,
            restore_s: 1.0,
            count: 1,
            max: 3,
        };
        let line = r.to_string();
        for part in [
            "(1 of at most 3): worker w1 (127.0.0.1:7001) stopped responding",
            "re-planned optcnn on the 2 device(s) left",
            "snapshot of step 10 in 1.50 s (search 0.25 s, restoring the state 1.00 s)",
            "(4 step(s) trained again); costs: measured",
        ] {
            assert!(line.contains(part), "{line}");
        }
        assert!(
            !Recovered { steps_lost: 0, ..r }
                .to_string()
                .contains("trained again")
        );
    }

    fn events_of(opts: &TrainOptions) -> (Vec<String>, TrainSummary) {
        let graph = crate::model::load_model("lenet5", 4, None, None).unwrap();
        let mut seen = Vec::new();
        let summary = Job::start(graph, opts)
            .unwrap()
            .run(|event| {
                seen.push(match event {
                    JobEvent::Device(line) | JobEvent::Note(line) | JobEvent::Warning(line) => {
                        line.to_string()
                    }
                    JobEvent::Planned(p) => format!("planned {} on {}", p.choice, p.devices),
                    JobEvent::Step(s) => format!("step {}/{}", s.step, s.total_steps),
                    JobEvent::Finished(s) => format!("finished after {} steps", s.losses.len()),
                    JobEvent::Evaluated(e) => format!("scored at {}", e.step),
                    JobEvent::Recovered(r) => r.to_string(),
                    JobEvent::Rejoined(r) => r.to_string(),
                })
            })
            .unwrap();
        (seen, summary)
    }

    /// A dataset of the caller's own: every pixel of sample `i` is `i` scaled, its label `i % 10`.
    struct Ramp {
        shape: [usize; 3],
    }

    impl Dataset for Ramp {
        fn num_samples(&self) -> usize {
            64
        }
        fn image_shape(&self) -> data::ImageShape {
            self.shape
        }
        fn num_classes(&self) -> usize {
            10
        }
        fn sample(
            &self,
            index: usize,
            _epoch: u64,
            out: &mut [f32],
        ) -> Result<u32, data::DataError> {
            out.fill(index as f32 / 64.0);
            Ok((index % 10) as u32)
        }
        fn describe(&self) -> String {
            "ramp".into()
        }
    }

    #[test]
    fn the_builder_trains_a_dataset_of_the_callers_own_and_checks_its_shape() {
        let graph = crate::model::load_model("lenet5", 4, None, None).unwrap();
        let training = Training::new(graph.clone())
            .devices(2)
            .strategy(legion_planner::search::SearchKind::Data)
            .dataset(Ramp { shape: [1, 28, 28] })
            .steps(2)
            .device(DeviceKind::Cpu);
        assert_eq!(training.options().devices, 2);
        let mut steps = 0;
        let summary = training
            .run(|event| steps += matches!(event, JobEvent::Step(_)) as usize)
            .unwrap();
        assert_eq!((steps, summary.losses.len()), (2, 2));
        assert_eq!(summary.plan.unwrap().choice.to_string(), "data");

        let e = Training::new(graph)
            .dataset(Ramp { shape: [3, 28, 28] })
            .device(DeviceKind::Cpu)
            .start()
            .err()
            .unwrap();
        let e = format!("{e:#}");
        assert!(
            e.contains("--data ramp") && e.contains("[3, 28, 28]"),
            "{e}"
        );
    }

    /// Batches of the ramp's samples in order, `batches` of them, then the end.
    struct RampBatches {
        batches: u64,
        taken: std::sync::Mutex<u64>,
    }

    impl BatchFeed for RampBatches {
        fn next_batch(&self) -> Result<Option<data::FedBatch>, data::DataError> {
            let mut taken = self.taken.lock().unwrap();
            if *taken == self.batches {
                return Ok(None);
            }
            let ramp = Ramp { shape: [1, 28, 28] };
            let mut images = vec![0.0; 4 * 28 * 28];
            let mut labels = Vec::new();
            for (i, out) in images.chunks_mut(28 * 28).enumerate() {
                labels.push(ramp.sample(*taken as usize * 4 + i, 0, out)?);
            }
            *taken += 1;
            Ok(Some(data::FedBatch { images, labels }))
        }
        fn describe(&self) -> String {
            "ramp batches".into()
        }
        fn batches(&self) -> Option<u64> {
            Some(self.batches)
        }
    }

    #[test]
    fn a_feed_trains_as_the_dataset_it_hands_over_and_a_stop_ends_the_run_after_its_step() {
        let graph = crate::model::load_model("lenet5", 4, None, None).unwrap();
        // A feed's batches are trained on as given: the ramp's samples in order.
        let fed = Training::new(graph.clone())
            .feed(RampBatches {
                batches: 3,
                taken: Default::default(),
            })
            .epochs(1)
            .device(DeviceKind::Cpu)
            .start()
            .unwrap()
            .run_keeping_state(|_| {})
            .unwrap();
        assert_eq!(fed.0.steps, 3);
        let params = legion_ops::train::ParamStore::init(&graph, 1);
        let mut trainer = legion_ops::train::Trainer::new(graph.clone(), params, Sgd::default(), 1);
        let ramp = Ramp { shape: [1, 28, 28] };
        for b in 0..3 {
            let mut images = vec![0.0; 4 * 28 * 28];
            let mut labels = Vec::new();
            for (i, out) in images.chunks_mut(28 * 28).enumerate() {
                labels.push(ramp.sample(b * 4 + i, 0, out).unwrap());
            }
            trainer.step(&images, &labels).unwrap();
        }
        assert_eq!(fed.1.params.values, trainer.params().unwrap().values);

        let stop = StopSignal::new();
        let raise = stop.clone();
        let summary = Training::new(graph)
            .steps(50)
            .device(DeviceKind::Cpu)
            .stop_on(stop)
            .run(|event| {
                if let JobEvent::Step(s) = event
                    && s.step == 2
                {
                    raise.raise();
                }
            })
            .unwrap();
        // The one-device trainer reads a step's loss one step late: step 3 was under way.
        assert!(summary.stopped && summary.steps < 50, "{summary:?}");
        assert_eq!(summary.losses.len() as u64, summary.steps);
    }

    #[test]
    fn a_distributed_run_reports_its_plan_then_each_step_then_the_end() {
        let opts = TrainOptions {
            devices: 2,
            steps: 3,
            strategy: "data".into(),
            device: DeviceKind::Cpu,
            ..TrainOptions::default()
        };
        let (seen, summary) = events_of(&opts);
        assert_eq!(
            seen,
            [
                "device: cpu (2 device(s))",
                "planned data on 2",
                "step 1/3",
                "step 2/3",
                "step 3/3",
                "finished after 3 steps"
            ]
        );
        let plan = summary.plan.unwrap();
        assert_eq!(plan.strategy.model.as_deref(), Some("lenet5"));
        assert!(plan.remote_bytes > 0, "data parallelism moves gradients");
    }

    #[test]
    fn the_last_step_read_one_step_late_is_timed_as_a_step() {
        let graph = crate::model::load_model("lenet5", 16, None, None).unwrap();
        let opts = TrainOptions {
            steps: 6,
            device: DeviceKind::Cpu,
            ..TrainOptions::default()
        };
        let mut seconds = Vec::new();
        let summary = Job::start(graph, &opts)
            .unwrap()
            .run(|event| {
                if let JobEvent::Step(s) = event {
                    seconds.push(s.seconds);
                }
            })
            .unwrap();
        assert!(summary.loss_read_late, "the default reads one step late");
        let (last, earlier) = seconds.split_last().unwrap();
        let fastest = earlier.iter().copied().fold(f64::INFINITY, f64::min);
        // Read at the finish, right after the step before's read, the last step used to be
        // timed at nearly nothing.
        assert!(*last > fastest / 10.0, "{seconds:?}");
    }

    #[test]
    fn a_one_device_run_has_no_plan() {
        let opts = TrainOptions {
            steps: 2,
            device: DeviceKind::Cpu,
            ..TrainOptions::default()
        };
        let (seen, summary) = events_of(&opts);
        assert_eq!(
            seen,
            [
                "device: cpu (1 device(s))",
                "step 1/2",
                "step 2/2",
                "finished after 2 steps"
            ]
        );
        assert_eq!(summary.plan, None);
        assert_eq!((summary.steps, summary.batch), (2, 4));
    }
}
