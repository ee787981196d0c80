//! A training job: data, initial weights, the training loop, periodic and final checkpoints, the
//! trace. Shared by `legion-rs train` and the example programs.
//!
//! [`Job::start`] validates the options and starts an engine; [`Job::run`] steps it and reports
//! what happens as [`JobEvent`]s; a [`Printer`] turns those into what the user sees (text lines,
//! a progress bar, or JSON lines). [`train`] is the three together. The job prints nothing itself,
//! so that a caller can show a run its own way.

use crate::device::{self, DeviceKind};
use crate::machine::{cluster_machine, embedded_machine, gpus_machine};
use crate::precision;
use anyhow::{Context, bail};
use legion_cluster::engine::{self, Engine, JobStart, NextBatch, OneGpu, Place, StepBatch};
use legion_cluster::launch;
use legion_ops::capture::{CaptureSetting, CaptureStatus};
use legion_ops::checkpoint;
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::train::{LossReadback, ParamStore, Sgd, StepStats, TrainingState};
use legion_ops::{Graph, Precision};
use legion_planner::search::{self, SearchKind};
use legion_planner::{
    CostModel, CostTables, MachineModel, ParallelConfig, RooflineCost, SearchSpace, Strategy,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

pub use crate::progress::Printer;

/// Everything a training run needs besides the model.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub devices: usize,
    pub steps: u64,
    /// `synthetic`, `synthetic:N`, `cifar10:DIR`, `folder:DIR`.
    pub data: String,
    pub init: Option<PathBuf>,
    /// The weights the model file carried (an ONNX file's initializers): the run starts from them
    /// unless `init` or `resume` says otherwise.
    pub model_weights: Option<checkpoint::Checkpoint>,
    pub save: Option<PathBuf>,
    pub sgd: Sgd,
    pub seed: u64,
    /// How [`train`] prints: one JSON object per step and a summary object, instead of human
    /// output. The job itself prints nothing.
    pub json: bool,
    /// With several devices: a search (`optcnn`, `data`, `model`, `owt`) or a strategy JSON file.
    pub strategy: String,
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
    /// `--device`: a GPU where the run can use one (`auto`), the CPU, or a GPU or an error.
    pub device: DeviceKind,
    /// `--memory-gib`: each device's memory, which the strategy must fit.
    pub memory_gib: Option<f64>,
    /// `--precision` (`--tf32`: tf32): what the run computes in; `None`: a cluster's hosts-file
    /// `precision`, else fp32. bf16 is refused, naming the flag, where it cannot run as asked
    /// (`crate::precision`).
    pub precision: Option<Precision>,
    /// `--conv-algos`: how a GPU picks its convolution algorithms.
    pub conv_algos: legion_cuda::ConvAlgos,
    /// Where a GPU's convolutions apply bias and ReLU (`--no-fused-epilogue`: separately, to
    /// measure what fusing saves).
    pub conv_epilogue: legion_cuda::ConvEpilogue,
    /// Whether the one-device trainer stages the next batch while a step computes
    /// (`--no-prefetch` turns it off, to measure what it saves).
    pub prefetch: bool,
    /// Whether the one-device trainer on a GPU records its step as a CUDA graph after the first
    /// and replays it (`--no-capture` turns it off, to measure what it saves).
    pub capture: CaptureSetting,
    /// Whether the one-device trainer on a GPU draws synthetic batches on the GPU from their
    /// description (`--synthetic-on-host` draws them on the host and copies them, as other data
    /// is, to measure what drawing them on the device saves).
    pub synthetic_on_device: bool,
    /// Whether the one-device trainer reads a step's loss one step late, while the next step
    /// runs (`--sync-every-step` reads it at the step's end, to measure what that costs).
    pub loss_readback: LossReadback,
    /// `--gpus`: the GPUs the devices spread over, by ordinal (one listed twice: logical GPUs on
    /// one device); `None`: as many of those found as there are devices.
    pub gpus: Option<Vec<usize>>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            devices: 1,
            steps: 100,
            data: "synthetic".into(),
            init: None,
            model_weights: None,
            save: None,
            sgd: Sgd::default(),
            seed: 1,
            json: false,
            strategy: "optcnn".into(),
            trace: None,
            checkpoint_every: None,
            device: DeviceKind::Auto,
            resume: None,
            cluster: None,
            slurm: false,
            cluster_state: None,
            memory_gib: None,
            precision: None,
            conv_algos: legion_cuda::ConvAlgos::default(),
            conv_epilogue: legion_cuda::ConvEpilogue::default(),
            prefetch: true,
            capture: CaptureSetting::On,
            synthetic_on_device: true,
            loss_readback: LossReadback::OneStepLate,
            gpus: None,
        }
    }
}

/// Refuses `configs` (the strategy `choice`) where a device of `machine` with memory of its own
/// (`--memory-gib`) cannot hold its share, before anything is allocated: the memory model the
/// searches use (`legion_planner::memory::check_fits`) counts every buffer the device actors will
/// allocate, and the error names the device, what it needs and the layer that needs most.
fn check_device_memory(
    graph: &Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
    choice: &str,
) -> anyhow::Result<()> {
    legion_planner::memory::check_fits(graph, machine, configs).map_err(|e| {
        anyhow::anyhow!(
            "the {choice} strategy does not fit the devices' memory (--memory-gib): {e}"
        )
    })
}

/// Every name `--strategy` (and `profile --strategies`, `--compare --strategies`) accepts for a
/// search, in the order help and errors list them: the searches of our space, then the other
/// papers' planners. Parsing, help and errors all use this list.
pub fn strategy_names() -> Vec<&'static str> {
    SearchKind::ALL
        .into_iter()
        .chain(SearchKind::SEEDS)
        .map(SearchKind::name)
        .collect()
}

/// The help of a `--strategy` flag, naming every search [`strategy_names`] lists.
pub fn strategy_help() -> String {
    format!(
        "How to parallelise each layer over the devices: a search ({}; refine with its default \
         budget and seed) or a strategy JSON file (as `legion-rs plan --out` writes)",
        strategy_names().join(", ")
    )
}

/// The configs of `choice` (a search name or a strategy file) for `graph` on `machine`.
pub fn choose_strategy(
    graph: &Graph,
    machine: &MachineModel,
    choice: &str,
) -> anyhow::Result<Vec<ParallelConfig>> {
    choose_strategy_for("--strategy", graph, machine, choice)
}

/// [`choose_strategy`] for a choice given by the command-line option `flag`, which errors name.
pub fn choose_strategy_for(
    flag: &str,
    graph: &Graph,
    machine: &MachineModel,
    choice: &str,
) -> anyhow::Result<Vec<ParallelConfig>> {
    match SearchKind::parse(choice) {
        Some(kind) => {
            let provider = RooflineCost::new(machine);
            let cost = CostModel::new(graph, machine, &provider);
            // the space `plan` searches by default: reduction splits included
            let tables = CostTables::build_in(&cost, SearchSpace::WithReductions);
            Ok(search::find(kind, &tables, search::DEFAULT_BUDGET)
                .with_context(|| format!("{flag} {choice}"))?
                .configs)
        }
        None => strategy_file_configs(flag, graph, machine.num_devices(), choice),
    }
}

/// The configs of the strategy file `choice` for `graph` on `devices` devices, checked against
/// the model it was made for, the devices it places layers on and the batch its sample splits
/// need, each error naming the file and the flag to change.
fn strategy_file_configs(
    flag: &str,
    graph: &Graph,
    devices: usize,
    choice: &str,
) -> anyhow::Result<Vec<ParallelConfig>> {
    let path = std::path::Path::new(choice);
    if !path.exists() {
        bail!(
            "{flag} '{choice}' is neither a search ({}) nor an existing strategy file",
            strategy_names().join(", ")
        );
    }
    let strategy = Strategy::load(path)?;
    if let Some(made_for) = &strategy.model
        && made_for != &graph.name
    {
        bail!(
            "{flag} {choice}: the strategy was made for model '{made_for}', but --model is '{}' \
             (plan one for it: `legion-rs plan --model {} ... --out FILE`)",
            graph.name,
            graph.name
        );
    }
    strategy.to_configs(graph, devices).map_err(|e| {
        let needs = strategy
            .layers
            .iter()
            .flat_map(|l| l.devices.iter().map(|&d| d.saturating_add(1)))
            .max()
            .unwrap_or(1);
        let batch = graph.batch();
        let short_batch = strategy.layers.iter().find_map(|l| {
            let degree = l.degrees.get("n").copied().unwrap_or(1);
            (degree > batch).then_some((l.layer.as_str(), degree))
        });
        // What to change, where the flags can fix it: a device count the planner could run, or a
        // batch the sample splits divide.
        let fix = match short_batch {
            _ if needs > devices && needs <= legion_cluster::hosts::MAX_DEVICES => {
                format!("; it places layers on {needs} devices: give --devices {needs}")
            }
            Some((layer, degree)) if degree <= devices => format!(
                "; layer '{layer}' splits the batch (--batch {batch}) {degree} ways: give --batch \
                 {degree} or more"
            ),
            _ => String::new(),
        };
        anyhow::anyhow!(
            "{flag} {choice} (for model '{}' on {devices} device(s)): {e}{fix}",
            graph.name
        )
    })
}

/// The devices of `0..devices` that no layer of `configs` uses.
fn idle_devices(configs: &[ParallelConfig], devices: usize) -> Vec<usize> {
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

/// What a running job reports, in order: its plan (distributed runs only), each step, the end.
#[derive(Clone, Copy, Debug)]
pub enum JobEvent<'a> {
    /// Which device trains, and why (one line), before anything else.
    Device(&'a str),
    /// The strategy the devices run, before the first step.
    Planned(&'a PlannedRun),
    /// A step finished.
    Step(&'a StepDone),
    /// The run finished and its final checkpoint (if any) is saved.
    Finished(&'a TrainSummary),
}

/// A distributed run's plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRun {
    /// The `--strategy` choice: a search name or a strategy file.
    pub choice: String,
    pub devices: usize,
    /// Where the devices are: `embedded device(s)`, `3 worker(s) of hosts.toml`.
    pub place: String,
    /// Bytes moved between devices per step.
    pub remote_bytes: u64,
    pub strategy: Strategy,
    /// The devices no layer of the strategy uses: they stay idle.
    pub idle_devices: Vec<usize>,
}

/// One finished step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDone {
    /// Counted from 1.
    pub step: u64,
    /// Of `total_steps`, the run's last step.
    pub total_steps: u64,
    pub loss: f32,
    pub accuracy: f64,
    pub seconds: f64,
    pub images_per_sec: f64,
    /// The one-device trainer's split of the step on its thread.
    pub host: Option<legion_ops::train::HostTiming>,
}

/// What a finished run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    pub model: String,
    pub devices: usize,
    /// Where there were several devices.
    pub plan: Option<PlannedRun>,
    /// The step the run ended at, counted from the start (a resumed run's earlier steps too).
    pub steps: u64,
    /// The step this run started from: 0, or the step of the checkpoint it resumed.
    pub first_step: u64,
    pub batch: usize,
    /// One per step this run took.
    pub losses: Vec<f32>,
    /// Over the steps this run took; `None` when it took none.
    pub images_per_sec: Option<f64>,
    pub wall_secs: f64,
    pub saved: Option<PathBuf>,
    /// Whether the one-device trainer recorded and replayed its steps (`None` elsewhere).
    pub capture: Option<CaptureStatus>,
    /// Whether the batches were synthetic data that the GPU drew itself from their description.
    pub synthetic_on_device: bool,
    /// Whether each step's loss was read one step late, while the next step ran (the one-device
    /// trainer unless `--sync-every-step`), rather than at the step's end.
    pub loss_read_late: bool,
    /// What the run computed in.
    pub precision: Precision,
}

/// How the loss moved over a run: the means of its first and its last `window` losses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossTrend {
    pub first: f64,
    pub last: f64,
    /// At most 10, and at most half the steps taken, so that the two windows never share a step.
    pub window: usize,
}

impl TrainSummary {
    /// The steps this run took (a resumed run's earlier steps not counted).
    pub fn steps_taken(&self) -> usize {
        self.losses.len()
    }

    /// The loss trend over the steps this run took; `None` with fewer than two, where there is
    /// nothing to compare.
    pub fn loss_trend(&self) -> Option<LossTrend> {
        let losses = &self.losses;
        let window = (losses.len() / 2).min(10);
        if window == 0 {
            return None;
        }
        let mean = |xs: &[f32]| xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
        Some(LossTrend {
            first: mean(&losses[..window]),
            last: mean(&losses[losses.len() - window..]),
            window,
        })
    }
}

/// Trains `graph` (batch size = its input's N) as `opts` says, printing progress to stdout.
pub fn train(graph: Graph, opts: &TrainOptions) -> anyhow::Result<TrainSummary> {
    let mut printer = Printer::new(opts.json);
    Job::start(graph, opts)?.run(|event| printer.show(event))
}

/// A started job: validated, its engine running, not yet stepped.
pub struct Job {
    graph: Graph,
    opts: TrainOptions,
    engine: Box<dyn Engine>,
    dataset: Box<dyn data::Dataset>,
    plan: Option<PlannedRun>,
    devices: usize,
    first_step: u64,
    /// `device: ...`, the line that says where the steps run.
    device: String,
    /// Whether the devices are actors on GPUs (which do not record their steps).
    actors_on_gpus: bool,
    /// Whether synthetic batches come described, for the one GPU to draw.
    describe_synthetic: bool,
    /// What the steps compute in.
    precision: Precision,
}

/// What training needs of a model, from its shapes.
struct ModelShape {
    /// C, H, W of an input image.
    image: [usize; 3],
    classes: usize,
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
        let located = match (&opts.cluster, opts.slurm) {
            (Some(_), true) => bail!("--cluster and --slurm: give one of them"),
            (Some(path), false) => Some(launch::locate(Some(path), opts.cluster_state.as_deref())?),
            (None, true) => Some(launch::locate(None, opts.cluster_state.as_deref())?),
            (None, false) if opts.cluster_state.is_some() => {
                bail!("--state is the state directory of a --cluster or --slurm cluster; give one")
            }
            (None, false) => None,
        };
        let cluster = match located {
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
        };
        let devices = cluster
            .as_ref()
            .map_or(opts.devices, |(_, h, _)| h.num_devices());
        let distributed = devices > 1 || cluster.is_some();
        let with_memory = |machine: MachineModel| match opts.memory_gib {
            Some(gib) => machine.with_device_memory_gib(gib),
            None => Ok(machine),
        };
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
            conv_algos: opts.conv_algos,
            conv_epilogue: opts.conv_epilogue,
            // One device's buffers never leave its stream; device actors sharing a GPU hand
            // theirs to each other.
            sharing: match distributed {
                false => legion_cuda::Sharing::WithinStreams,
                true => legion_cuda::Sharing::AcrossStreams,
            },
        };
        let gpus = device::start_gpus(&mut device, opts.device, devices, settings)?;
        let (configs, place) = if distributed {
            let (machine, place) = match &cluster {
                Some((label, hosts, state)) => (
                    cluster_machine(hosts, state)?.with_precision(precision),
                    format!("{} worker(s) of {label}", hosts.hosts.len()),
                ),
                None => match &gpus {
                    Some(started) => (
                        gpus_machine(devices, &started.info, precision)?,
                        "embedded device(s) on GPUs".to_string(),
                    ),
                    // priced in the run's precision: bf16 slices move half the bytes
                    None => (
                        embedded_machine(devices)?.with_precision(precision),
                        "embedded device(s)".to_string(),
                    ),
                },
            };
            let machine = with_memory(machine)?;
            let configs = choose_strategy(&graph, &machine, &opts.strategy)?;
            check_device_memory(&graph, &machine, &configs, &opts.strategy)?;
            (configs, place)
        } else {
            // One device runs every layer serially; a strategy file given is still checked
            // against the model and the device count, so that a wrong one is never ignored.
            if SearchKind::parse(&opts.strategy).is_none() {
                strategy_file_configs("--strategy", &graph, devices, &opts.strategy)?;
            }
            let serial = vec![ParallelConfig::serial(0); graph.layers().len()];
            check_device_memory(
                &graph,
                &with_memory(embedded_machine(1)?)?,
                &serial,
                "serial",
            )?;
            (serial, "one device".to_string())
        };
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
        let dataset = match data::open(&opts.data, shape.image, shape.classes, opts.seed) {
            Err(data::DataError::TooManyClasses {
                dataset,
                dataset_classes,
                ..
            }) => {
                return Err(classes_mismatch(
                    &opts.data,
                    &dataset,
                    dataset_classes,
                    &graph,
                    shape.classes,
                ));
            }
            opened => opened.with_context(|| format!("--data {}", opts.data))?,
        };
        if dataset.num_classes() != shape.classes {
            return Err(classes_mismatch(
                &opts.data,
                &dataset.describe(),
                dataset.num_classes(),
                &graph,
                shape.classes,
            ));
        }
        let state = initial_state(&graph, opts)?;
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
        let describe_synthetic = opts.synthetic_on_device
            && cluster.is_none()
            && !distributed
            && gpus.is_some()
            && dataset.as_synthetic().is_some();
        let engine_place = match (&cluster, gpus) {
            (Some((_, hosts, state_dir)), _) => Place::Cluster {
                hosts,
                state_dir,
                gpu: settings,
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
                    prefetch: opts.prefetch,
                    capture: opts.capture,
                    readback: opts.loss_readback,
                }))
            }
            (None, None) => Place::OneDevice(opts.loss_readback),
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
            },
        )?;
        let plan = distributed.then(|| PlannedRun {
            choice: opts.strategy.clone(),
            devices,
            place,
            remote_bytes: engine.plan().expect("a distributed engine").remote_bytes(),
            strategy: Strategy::from_configs(&graph, &configs),
            idle_devices: idle_devices(&configs, devices),
        });
        Ok(Job {
            graph,
            opts: opts.clone(),
            engine,
            dataset,
            plan,
            devices,
            first_step,
            device: device.line,
            actors_on_gpus,
            describe_synthetic,
            precision,
        })
    }

    /// Runs the steps left, saving checkpoints and the trace as the options say, and reports each
    /// to `on_event`.
    pub fn run(self, mut on_event: impl FnMut(JobEvent<'_>)) -> anyhow::Result<TrainSummary> {
        let Job {
            graph,
            opts,
            mut engine,
            dataset,
            plan,
            devices,
            first_step,
            device,
            actors_on_gpus,
            describe_synthetic,
            precision,
        } = self;
        on_event(JobEvent::Device(&device));
        if let Some(plan) = &plan {
            on_event(JobEvent::Planned(plan));
        }
        let batch = graph.batch();
        let loader = Loader::new(
            dataset.into(),
            LoaderConfig {
                seed: opts.seed,
                describe_synthetic,
                ..LoaderConfig::new(batch)
            },
        )?;
        let mut batches = loader.steps(first_step);
        let started = Instant::now();
        let mut reported = Reported {
            awaiting: std::collections::VecDeque::with_capacity(2),
            last: started,
            losses: Vec::with_capacity(opts.steps as usize),
            batch,
            total_steps: opts.steps,
        };
        let save = |engine: &mut dyn Engine| -> anyhow::Result<()> {
            if let Some(path) = &opts.save {
                let meta = BTreeMap::from([("model".to_string(), graph.name.clone())]);
                engine.state()?.save(path, meta)?;
            }
            Ok(())
        };
        let mut next_batch = || -> anyhow::Result<data::Batch> {
            batches
                .next()
                .context("the data loader stopped early")?
                .context("loading a batch")
        };
        let mut upcoming = (first_step < opts.steps)
            .then(&mut next_batch)
            .transpose()?;
        let mut traced_reports = None;
        for step in first_step + 1..=opts.steps {
            let batch_data = upcoming.take().expect("a batch for every step");
            upcoming = (step < opts.steps).then(&mut next_batch).transpose()?;
            let traced = opts.trace.is_some() && step == opts.steps;
            reported.awaiting.push_back((step, Instant::now()));
            let (stats, reports) = engine.step(StepBatch {
                images: batch_data.images,
                labels: batch_data.labels,
                synthetic: batch_data.synthetic,
                next: upcoming.as_ref().map(|b| match &b.synthetic {
                    Some(described) => NextBatch::Synthetic(described),
                    None => NextBatch::Images(&b.images, &b.labels),
                }),
                trace: traced,
            })?;
            if traced {
                traced_reports = Some(reports);
            }
            if let Some(stats) = stats {
                reported.read(stats, &mut on_event)?;
            }
            if opts.checkpoint_every.is_some_and(|k| step % k == 0) && step < opts.steps {
                // The step's loss is checked before its weights are saved.
                if let Some(stats) = engine.finish()? {
                    reported.read(stats, &mut on_event)?;
                }
                save(engine.as_mut())?;
            }
        }
        if let Some(stats) = engine.finish()? {
            reported.read(stats, &mut on_event)?;
        }
        if let Some(&(step, _)) = reported.awaiting.front() {
            bail!("step {step}: its loss was never read back");
        }
        let wall_secs = started.elapsed().as_secs_f64();
        if let (Some(path), Some(reports)) = (&opts.trace, traced_reports) {
            let trace = match engine.plan() {
                Some(step_plan) => Some(legion_runtime::chrome_trace(step_plan, &graph, &reports)),
                None => engine.own_trace(),
            };
            if let Some(trace) = trace {
                legion_ops::atomic_file::write(path, serde_json::to_string(&trace)?.as_bytes())
                    .with_context(|| format!("writing the trace {}", path.display()))?;
            }
        }
        save(engine.as_mut())?;

        let losses = reported.losses;
        let images = (losses.len() * batch) as f64;
        let summary = TrainSummary {
            model: graph.name.clone(),
            devices,
            plan,
            steps: opts.steps,
            first_step,
            batch,
            images_per_sec: (!losses.is_empty()).then(|| images / wall_secs),
            losses,
            wall_secs,
            saved: opts.save.clone(),
            capture: match actors_on_gpus {
                true => Some(CaptureStatus::NotApplied(
                    "several devices exchange slices in mid-step: their actors enqueue op by op"
                        .into(),
                )),
                false => engine.capture_status(),
            },
            synthetic_on_device: describe_synthetic,
            loss_read_late: engine.reads_loss_late(),
            precision,
        };
        on_event(JobEvent::Finished(&summary));
        Ok(summary)
    }
}

/// The steps a job gave its engine whose stats are still to come back, matched to the stats as
/// the engine reads them back (in order: this step's, or one step late the previous step's),
/// and reported.
struct Reported {
    /// Oldest first, each with when its step was given to the engine.
    awaiting: std::collections::VecDeque<(u64, Instant)>,
    /// When the last step was reported (the run's start before the first).
    last: Instant,
    losses: Vec<f32>,
    batch: usize,
    total_steps: u64,
}

impl Reported {
    /// Reports `stats` as the oldest awaited step's, refusing a loss that is not finite.
    fn read(
        &mut self,
        stats: StepStats,
        on_event: &mut impl FnMut(JobEvent<'_>),
    ) -> anyhow::Result<()> {
        let (step, given) = self
            .awaiting
            .pop_front()
            .context("the engine read back more steps than it was given")?;
        let now = Instant::now();
        // From the later of its start and the last report: each step's own time when it is
        // read at its end, the run's pace when it is read one step late.
        let seconds = (now - given.max(self.last)).as_secs_f64();
        self.last = now;
        if !stats.loss.is_finite() {
            bail!(
                "step {step}: the loss is {} (try a smaller --lr)",
                stats.loss
            );
        }
        self.losses.push(stats.loss);
        on_event(JobEvent::Step(&StepDone {
            step,
            total_steps: self.total_steps,
            loss: stats.loss,
            accuracy: stats.correct as f64 / self.batch as f64,
            seconds,
            images_per_sec: self.batch as f64 / seconds,
            host: stats.host,
        }));
        Ok(())
    }
}

/// The checks of `opts` that need nothing but the model: done before anything is loaded.
fn check_options(graph: &Graph, opts: &TrainOptions) -> anyhow::Result<ModelShape> {
    if opts.devices == 0 {
        bail!("--devices must be at least 1");
    }
    let input = graph.layer(graph.input()).shape;
    if input.ndim() != 4 {
        bail!(
            "model '{}': training needs an image input (N,C,H,W), got {input}",
            graph.name
        );
    }
    let logits = graph.logits().with_context(|| {
        format!(
            "model '{}' has no softmax_cross_entropy loss layer",
            graph.name
        )
    })?;
    if opts.init.is_some() && opts.resume.is_some() {
        bail!("--init and --resume exclude each other");
    }
    if opts.checkpoint_every.is_some() && opts.save.is_none() {
        bail!("--checkpoint-every needs --save PATH (where the checkpoints go)");
    }
    Ok(ModelShape {
        image: [input.dim(1), input.dim(2), input.dim(3)],
        classes: graph.layer(logits).shape.dim(1),
    })
}

/// Refuses an output path the run could not write, naming `flag`: its folder must exist and be
/// writable, and the path must not be a folder itself. Checked by creating (and removing) a file
/// beside it, which is what writing it atomically will do.
pub fn check_output_path(flag: &str, path: &std::path::Path) -> anyhow::Result<()> {
    if path.is_dir() {
        bail!(
            "{flag} {}: is a folder; expected a file path",
            path.display()
        );
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !folder.is_dir() {
        bail!(
            "{flag} {}: the folder {} does not exist",
            path.display(),
            folder.display()
        );
    }
    let probe = folder.join(format!(".legion-rs-write-check-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => bail!(
            "{flag} {}: cannot write in the folder {}: {e}",
            path.display(),
            folder.display()
        ),
    }
}

/// The error for data whose classes do not match the model's head: more classes than it has
/// outputs (labels past them), or fewer (outputs no label trains), naming the flag to change.
fn classes_mismatch(
    spec: &str,
    dataset: &str,
    found: usize,
    graph: &Graph,
    head: usize,
) -> anyhow::Error {
    let fix = match legion_ops::zoo::find(&graph.name) {
        Some(_) => format!("give --classes {found}"),
        None => format!(
            "give the model's last dense layer {found} out_features (a JSON model fixes its head)"
        ),
    };
    anyhow::anyhow!(
        "--data {spec}: {dataset} has {found} classes, but model '{}' has {head} outputs; {fix}",
        graph.name
    )
}

/// The weights, momentum and step the run starts from: a checkpoint to resume, one's weights to
/// start afresh from, the model file's weights, or the seeded initialisation.
fn initial_state(graph: &Graph, opts: &TrainOptions) -> anyhow::Result<TrainingState> {
    let load_state = |path: &PathBuf| -> anyhow::Result<TrainingState> {
        let ckpt = checkpoint::load(path)?;
        TrainingState::from_checkpoint(graph, ckpt)
            .with_context(|| format!("{}: does not fit model '{}'", path.display(), graph.name))
    };
    Ok(match (&opts.init, &opts.resume) {
        (None, Some(path)) => load_state(path)?,
        // Weights only: a fresh run from them.
        (Some(path), _) => TrainingState::start(load_state(path)?.params),
        (None, None) => match &opts.model_weights {
            Some(weights) => TrainingState::start(
                ParamStore::from_checkpoint(graph, weights.clone()).with_context(|| {
                    format!("the weights of model '{}' do not fit it", graph.name)
                })?,
            ),
            None => TrainingState::start(ParamStore::init(graph, opts.seed)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events_of(opts: &TrainOptions) -> (Vec<String>, TrainSummary) {
        let graph = crate::load_model("lenet5", 4, None, None).unwrap();
        let mut seen = Vec::new();
        let summary = Job::start(graph, opts)
            .unwrap()
            .run(|event| {
                seen.push(match event {
                    JobEvent::Device(line) => line.to_string(),
                    JobEvent::Planned(p) => format!("planned {} on {}", p.choice, p.devices),
                    JobEvent::Step(s) => format!("step {}/{}", s.step, s.total_steps),
                    JobEvent::Finished(s) => format!("finished after {} steps", s.losses.len()),
                })
            })
            .unwrap();
        (seen, summary)
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
