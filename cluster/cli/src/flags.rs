//! The flags of a training run, defined once: `legion-rs train` and the example programs flatten
//! [`TrainFlags`] into their own arguments, and [`TrainFlags::options`] turns them into the
//! library's [`TrainOptions`]. A new flag is a field here and its use in `legion::job`.

use anyhow::Context;
use clap::{Args, ValueEnum};
use legion::costs::Costs;
use legion::device::{DeviceKind, GpuList};
use legion::job::{GpuOptions, HeldOut, Strategy, TrainOptions, Validation, strategy_names};
use legion::ops::capture::CaptureSetting;
use legion::ops::data::{Geometry, Normalize, Transforms};
use legion::ops::train::{LossReadback, LrSchedule};
use legion::{Data, Sgd};
use std::path::PathBuf;

/// The defaults that differ between `train` and the examples.
#[derive(Clone, Copy, Debug)]
pub struct TrainDefaults {
    pub devices: usize,
    pub steps: u64,
    pub lr: f32,
}

impl Default for TrainDefaults {
    /// `legion-rs train`'s.
    fn default() -> Self {
        let options = TrainOptions::default();
        TrainDefaults {
            devices: options.devices,
            steps: options.steps,
            lr: options.sgd.lr,
        }
    }
}

/// `--costs`: measured, roofline or a profile file.
pub fn parse_costs(choice: &str) -> Result<Costs, String> {
    choice.parse()
}

/// The help of `--strategy`, naming every search.
pub fn strategy_help() -> String {
    format!(
        "How to parallelise each layer over the devices: a search ({}; refine with its default \
         budget and seed) or a strategy JSON file (as `legion-rs plan --out` writes)",
        strategy_names().join(", ")
    )
}

#[derive(Args, Clone, Debug)]
pub struct TrainFlags {
    /// Number of devices to train on (more than one: the embedded cluster, N device actors in this
    /// process, on its GPUs or its cores as --device says; 1: the single-device trainer)
    /// [default: 1; the examples: 4]. With --cluster: the cluster's devices.
    #[arg(long)]
    pub devices: Option<usize>,
    /// Train on the workers of a running cluster (`legion-rs up HOSTS`) over QUIC, planned with
    /// the links `up` measured.
    #[arg(long, value_name = "HOSTS")]
    pub cluster: Option<PathBuf>,
    /// Train on the workers `legion-rs up --slurm` started in the Slurm job this runs in (an
    /// `salloc` shell, an `sbatch` script), planned as --cluster is.
    #[arg(long, conflicts_with = "cluster")]
    pub slurm: bool,
    /// The cluster's state directory, if `up` was given one.
    #[arg(long)]
    pub state: Option<PathBuf>,
    #[arg(long, default_value = "optcnn", help = strategy_help())]
    pub strategy: String,
    /// What the search prices each layer's tiles with: `measured` (timed on the run's devices
    /// before the search, each tile once, and kept in the cost cache, $LEGION_RS_COST_CACHE or
    /// ~/.cache/legion-rs/costs, so that the next run times only what is new), `roofline` (peak
    /// FLOP/s and memory bandwidth), or a profile file (as `legion-rs profile --out` writes).
    #[arg(long, default_value = "measured", value_parser = parse_costs)]
    pub costs: Costs,
    /// With --resume: search the strategy again instead of training on with the checkpoint's.
    #[arg(long, requires = "resume")]
    pub replan: bool,
    /// After a search that optimises the cost model (optcnn, refine, exhaustive), train its
    /// strategy and up to N alternatives (data parallelism, OWT,
    /// then the other searches' by simulated step) a few steps each on the devices, and train
    /// on with the one measured fastest; 0: train the search's strategy as it is. The trial
    /// steps are training steps (not on GPUs; a run of fewer than (N+2)×3 steps is not
    /// verified).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub verify: usize,
    /// With --cluster or --slurm: when a worker dies, hangs or drops off the network, end the
    /// run (saying how to go on) instead of re-planning for the devices left and training on
    /// from the latest snapshot.
    #[arg(long)]
    pub no_recover: bool,
    /// With --cluster or --slurm: the most lost workers a run recovers from before it ends.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub max_recoveries: u32,
    /// With --cluster or --slurm: gather the whole state from the workers every K steps into a
    /// snapshot the run restarts from when it loses one (a --checkpoint-every checkpoint is one
    /// too): a recovery trains at most K steps again, and each snapshot moves the weights and
    /// momentum once; `auto`: the first after 10 steps, then as often as keeps the gathering
    /// within 5% of the training time.
    #[arg(long, value_name = "K|auto", default_value = "auto", value_parser = parse_snapshot_every)]
    pub snapshot_every: SnapshotEvery,
    /// Write the strategy the devices run (a search's result, or the file given) as a strategy
    /// JSON file here, which `--strategy FILE` and `legion-rs plan --evaluate` read back.
    #[arg(long, value_name = "FILE")]
    pub save_strategy: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace (JSON) of the last step: each device's timeline with several
    /// devices, each call of the step timed on the device with one. With an example's --compare:
    /// a directory, to which each strategy's measured and simulated traces go.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Training steps (batches) [default: 100; the examples: their own].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Train this many passes over the data instead of --steps (each pass its whole batches).
    #[arg(long, conflicts_with = "steps", value_name = "N")]
    pub epochs: Option<u64>,
    /// Training data: `synthetic`, `synthetic:N`, `cifar10:DIR_OR_FILE`, `folder:DIR`.
    #[arg(long, default_value = "synthetic")]
    pub data: String,
    /// How a sample is cut from its image: `random-resized` (torchvision's RandomResizedCrop:
    /// 8-100% of the area, aspect 3/4-4/3), `center` (the shorter side resized to 256/224 of the
    /// model's, then its centre), `whole` (the whole image resized). Default: `random-resized`
    /// for a folder of images, `whole` for CIFAR-10.
    #[arg(long, value_enum)]
    pub crop: Option<CropFlag>,
    /// Do not mirror samples at random (on by default for a folder of images and CIFAR-10).
    #[arg(long)]
    pub no_flip: bool,
    /// Per-channel normalisation: `dataset` (its own statistics: ImageNet's for a folder,
    /// CIFAR-10's), `none` (values in [0, 1]), or `MEAN,MEAN,MEAN/STD,STD,STD`.
    #[arg(long, value_parser = parse_normalize, default_value = "dataset")]
    pub normalize: Normalize,
    /// Held-out data to score (top-1, top-5, loss) every --eval-every steps and at the end,
    /// through the evaluation recipe (for a folder: resize and centre crop): a spec as --data,
    /// of the same classes.
    #[arg(long, value_name = "SPEC")]
    pub val_data: Option<String>,
    /// Hold out this fraction of --data's samples (seeded by --seed) to score instead, and train
    /// on the rest.
    #[arg(long, value_name = "F", conflicts_with = "val_data")]
    pub val_split: Option<f64>,
    /// Score the held-out data every K steps as well as at the end.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_every: Option<u64>,
    /// Stop at an image that cannot be read instead of skipping it (in its place: another
    /// sample of the epoch) and counting it in the summary.
    #[arg(long)]
    pub strict_data: bool,
    /// On a cluster, read the samples here and send them to the workers (8-bit pixels where
    /// they are), instead of each worker reading its devices' own from --data's path: for data
    /// that only this host can read.
    #[arg(long)]
    pub data_on_driver: bool,
    /// Initial weights from a safetensors checkpoint instead of the seeded initialisation.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the trained weights (with momentum and step, for --resume) to this safetensors file.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also write the --save checkpoint every K steps (atomically: a crash keeps the last one).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Continue a run from a checkpoint written by --save: its weights, momentum and step
    /// (--steps counts from the start of the run).
    #[arg(long, conflicts_with = "init")]
    pub resume: Option<PathBuf>,
    /// SGD learning rate: the step size of each update (lower it if the loss turns NaN)
    /// [default: 0.03; the examples: their own].
    #[arg(long)]
    pub lr: Option<f32>,
    /// SGD momentum: the fraction of the previous update each update keeps (0: plain SGD).
    #[arg(long, default_value_t = Sgd::default().momentum)]
    pub momentum: f32,
    /// Nesterov momentum (PyTorch's `nesterov=True`): each update looks one momentum step ahead.
    #[arg(long)]
    pub nesterov: bool,
    /// How the learning rate moves from --lr over the run, once a step: `constant`,
    /// `step:EVERY:GAMMA` (times GAMMA every EVERY steps, PyTorch's StepLR), `cosine` or
    /// `cosine:MIN_LR` (CosineAnnealingLR down to MIN_LR at the end).
    #[arg(long, default_value = "constant", value_parser = parse_schedule)]
    pub lr_schedule: LrSchedule,
    /// Raise the learning rate linearly over the first N steps, from --lr / N to --lr, before the
    /// schedule.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_steps: u64,
    /// L2 weight decay: the multiple of each weight added to its gradient (0: none).
    #[arg(long, default_value_t = Sgd::default().weight_decay)]
    pub weight_decay: f32,
    /// Seed of the initialisation, data order and dropout masks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per step (`step`, `loss`, ...) and a final summary object.
    #[arg(long)]
    pub json: bool,
    /// Where to train (auto, cpu, cuda): `auto` uses the GPUs when one is usable (N devices spread over them, a
    /// stream each), else the CPU, saying which; `cuda` fails with what is missing rather than use
    /// the CPU. With --cluster, each host's `device` decides.
    #[arg(long, value_parser = DeviceKind::parse_flag, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// The GPUs the devices spread over, by CUDA ordinal, in order (`0,1`); a GPU listed twice
    /// is two logical GPUs on it, each with its own streams, whose devices exchange slices
    /// through page-locked host memory as devices on GPUs without peer access do (`0,0`: the
    /// multi-GPU path on one GPU). Default: the first GPUs found, one per device at most.
    #[arg(long, value_parser = GpuList::parse, value_name = "ORDINALS")]
    pub gpus: Option<GpuList>,
    /// Memory of each device, GiB: the strategy must fit it (a search returns only strategies
    /// that do; a named strategy that does not is refused), checked before anything is allocated.
    #[arg(long)]
    pub memory_gib: Option<f64>,
    #[command(flatten)]
    pub precision: crate::precision::PrecisionArgs,
    /// On a GPU, how convolution algorithms are picked: `fastest` times each problem's
    /// algorithms once and keeps the fastest (FFT, Winograd and atomic sums included);
    /// `precise` does so among the deterministic ones that sum directly, whose results differ
    /// from the CPU's by the order of the sums alone; `heuristic` takes cuDNN's pick untimed
    /// (the same bits in every run).
    #[arg(long, default_value_t = legion_cuda::ConvAlgos::default())]
    pub conv_algos: legion_cuda::ConvAlgos,
    /// On a GPU, add a convolution's bias and apply its ReLU in a kernel of their own after
    /// cuDNN's convolution, instead of inside cuDNN's fused convolution (fp32 and tf32): to
    /// measure what fusing saves.
    #[arg(long)]
    pub no_fused_epilogue: bool,
    /// On one device, do not stage the next batch on the device while a step computes (each
    /// step then moves its own batch first): to measure what prefetching saves.
    #[arg(long)]
    pub no_prefetch: bool,
    /// On one GPU device, enqueue every step's kernels one by one instead of recording the
    /// step as a CUDA graph after the first and replaying it: to measure what capture saves.
    #[arg(long)]
    pub no_capture: bool,
    /// On one GPU device, draw synthetic batches on the host and copy them, as other data is,
    /// instead of having the GPU draw them from their description (the same values either way):
    /// to measure what drawing them on the device saves.
    #[arg(long)]
    pub synthetic_on_host: bool,
    /// On one device, wait for every step's work and read its loss before the next step is
    /// enqueued, instead of reading it one step late while the next step runs (the same losses
    /// and weights either way): to measure what the late read saves.
    #[arg(long)]
    pub sync_every_step: bool,
}

/// `--crop`'s choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CropFlag {
    RandomResized,
    Center,
    Whole,
}

impl CropFlag {
    fn geometry(self) -> Geometry {
        match self {
            CropFlag::RandomResized => Geometry::RANDOM_RESIZED_CROP,
            CropFlag::Center => Geometry::CENTER_CROP,
            CropFlag::Whole => Geometry::Stretch,
        }
    }
}

fn parse_schedule(text: &str) -> Result<LrSchedule, String> {
    text.parse()
}

/// `--normalize`: `dataset`, `none` or `M,M,M/S,S,S`.
fn parse_normalize(text: &str) -> Result<Normalize, String> {
    text.parse()
}

impl TrainFlags {
    /// The held-out data these flags ask for.
    pub fn validation(&self) -> anyhow::Result<Option<Validation>> {
        let data = match (&self.val_data, self.val_split) {
            (Some(spec), _) => {
                HeldOut::Data(spec.parse().with_context(|| format!("--val-data {spec}"))?)
            }
            (None, Some(fraction)) => HeldOut::Split(fraction),
            (None, None) if self.eval_every.is_some() => {
                anyhow::bail!("--eval-every scores held-out data: give --val-data or --val-split")
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(Validation {
            data,
            every: self.eval_every,
        }))
    }

    /// The transforms these flags ask of `data`: its default, changed where a flag says.
    pub fn transforms(&self, data: &Data) -> Option<Transforms> {
        let asked = self.crop.is_some() || self.no_flip || self.normalize != Normalize::Dataset;
        asked.then(|| {
            let default = data.default_transforms();
            Transforms {
                geometry: self.crop.map_or(default.geometry, CropFlag::geometry),
                flip: default.flip && !self.no_flip,
                normalize: self.normalize,
            }
        })
    }

    /// The options these flags give, the unset ones taken from `defaults`.
    pub fn options(&self, defaults: TrainDefaults) -> anyhow::Result<TrainOptions> {
        let data: Data = self
            .data
            .parse()
            .with_context(|| format!("--data {}", self.data))?;
        Ok(TrainOptions {
            devices: match (&self.cluster, self.slurm, self.devices) {
                // a cluster's own count replaces the default
                (Some(_), _, None) | (None, true, None) => 1,
                (_, _, given) => given.unwrap_or(defaults.devices),
            },
            steps: self.steps.unwrap_or(defaults.steps),
            epochs: self.epochs,
            lr_schedule: LrSchedule {
                warmup: match self.warmup_steps {
                    0 => self.lr_schedule.warmup,
                    n => n,
                },
                ..self.lr_schedule
            },
            transforms: self.transforms(&data),
            strict_data: self.strict_data,
            data_on_driver: self.data_on_driver,
            validation: self.validation()?,
            data,
            init: self.init.clone(),
            model_weights: None,
            save: self.save.clone(),
            sgd: Sgd {
                lr: self.lr.unwrap_or(defaults.lr),
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                nesterov: self.nesterov,
            },
            seed: self.seed,
            strategy: Strategy::from(self.strategy.as_str()),
            costs: self.costs.clone(),
            cost_cache: legion::costs::CostCache::default_location(),
            replan: self.replan,
            verify: self.verify,
            recovery: legion::Recovery {
                max_recoveries: match self.no_recover {
                    true => 0,
                    false => self.max_recoveries,
                },
                snapshot_every: self.snapshot_every.0,
            },
            save_strategy: self.save_strategy.clone(),
            trace: self.trace.clone(),
            checkpoint_every: self.checkpoint_every,
            resume: self.resume.clone(),
            cluster: self.cluster.clone(),
            slurm: self.slurm,
            cluster_state: self.state.clone(),
            device: self.device,
            memory_gib: self.memory_gib,
            precision: self.precision.given(),
            gpus: self.gpus.clone().map(|g| g.0),
            search_progress: legion::job::Reported::default(),
            open_progress: legion::job::Reported::default(),
            stop: legion::StopSignal::default(),
            gpu: GpuOptions {
                conv_algos: self.conv_algos,
                conv_epilogue: match self.no_fused_epilogue {
                    true => legion_cuda::ConvEpilogue::Separate,
                    false => legion_cuda::ConvEpilogue::Fused,
                },
                prefetch: !self.no_prefetch,
                capture: match self.no_capture {
                    true => CaptureSetting::Off,
                    false => CaptureSetting::On,
                },
                synthetic_on_device: !self.synthetic_on_host,
                loss_readback: match self.sync_every_step {
                    true => LossReadback::EveryStep,
                    false => LossReadback::OneStepLate,
                },
            },
        })
    }
}

/// `--snapshot-every`: a number of steps, or `None` for `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotEvery(pub Option<u64>);

fn parse_snapshot_every(text: &str) -> Result<SnapshotEvery, String> {
    match text {
        "auto" => Ok(SnapshotEvery(None)),
        steps => steps
            .parse()
            .map(|k| SnapshotEvery(Some(k)))
            .map_err(|_| format!("expected a number of steps or `auto`, got `{steps}`")),
    }
}
