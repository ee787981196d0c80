use crate::device::DeviceKind;
use crate::job::{self, TrainOptions};
use clap::Args;
use legion_ops::capture::CaptureSetting;
use legion_ops::train::{LossReadback, Sgd};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A zoo model name (see `legion-rs models`), a JSON model file or an ONNX file (its
    /// initializers, if it has them, are the initial weights).
    #[arg(long)]
    model: String,
    /// Number of devices to train on (more than one: the embedded cluster, N device actors in this
    /// process, on its GPUs or its cores as --device says). With --cluster: the cluster's devices.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Train on the workers of a running cluster (`legion-rs up HOSTS`) over QUIC, planned with
    /// the links `up` measured.
    #[arg(long, value_name = "HOSTS")]
    cluster: Option<PathBuf>,
    /// Train on the workers `legion-rs up --slurm` started in the Slurm job this runs in (an
    /// `salloc` shell, an `sbatch` script), planned as --cluster is.
    #[arg(long, conflicts_with = "cluster")]
    slurm: bool,
    /// The cluster's state directory, if `up` was given one.
    #[arg(long)]
    state: Option<PathBuf>,
    #[arg(long, default_value = "optcnn", help = job::strategy_help())]
    strategy: String,
    /// Write a Chrome/Perfetto trace (JSON) of the last step: each device's timeline with several
    /// devices, each call of the step timed on the device with one.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Training steps (batches).
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Global batch size.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Input height and width for zoo models (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    /// Training data: `synthetic`, `synthetic:N`, `cifar10:DIR_OR_FILE`, `folder:DIR`.
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Initial weights from a safetensors checkpoint instead of the seeded initialisation.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Write the trained weights (with momentum and step, for --resume) to this safetensors file.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also write the --save checkpoint every K steps (atomically: a crash keeps the last one).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    checkpoint_every: Option<u64>,
    /// Continue a run from a checkpoint written by --save: its weights, momentum and step
    /// (--steps counts from the start of the run).
    #[arg(long, conflicts_with = "init")]
    resume: Option<PathBuf>,
    /// SGD learning rate: the step size of each update (lower it if the loss turns NaN).
    #[arg(long, default_value_t = Sgd::default().lr)]
    lr: f32,
    /// SGD momentum: the fraction of the previous update each update keeps (0: plain SGD).
    #[arg(long, default_value_t = Sgd::default().momentum)]
    momentum: f32,
    /// L2 weight decay: the multiple of each weight added to its gradient (0: none).
    #[arg(long, default_value_t = Sgd::default().weight_decay)]
    weight_decay: f32,
    /// Seed of the initialisation, data order and dropout masks.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object per step (`step`, `loss`, ...) and a final summary object.
    #[arg(long)]
    json: bool,
    /// Where to train (auto, cpu, cuda): `auto` uses the GPUs when one is usable (N devices spread over them, a
    /// stream each), else the CPU, saying which; `cuda` fails with what is missing rather than use
    /// the CPU. With --cluster, each host's `device` decides.
    #[arg(long, value_parser = DeviceKind::parse_flag, default_value_t = DeviceKind::Auto)]
    device: DeviceKind,
    /// The GPUs the devices spread over, by CUDA ordinal, in order (`0,1`); a GPU listed twice
    /// is two logical GPUs on it, each with its own streams, whose devices exchange slices
    /// through page-locked host memory as devices on GPUs without peer access do (`0,0`: the
    /// multi-GPU path on one GPU). Default: the first GPUs found, one per device at most.
    #[arg(long, value_parser = crate::device::GpuList::parse, value_name = "ORDINALS")]
    gpus: Option<crate::device::GpuList>,
    /// Memory of each device, GiB: the strategy must fit it (a search returns only strategies
    /// that do; a named strategy that does not is refused), checked before anything is allocated.
    #[arg(long)]
    memory_gib: Option<f64>,
    #[command(flatten)]
    precision: crate::precision::PrecisionArgs,
    /// On a GPU, how convolution algorithms are picked: `fastest` times each problem's
    /// algorithms once and keeps the fastest (FFT, Winograd and atomic sums included);
    /// `precise` does so among the deterministic ones that sum directly, whose results differ
    /// from the CPU's by the order of the sums alone; `heuristic` takes cuDNN's pick untimed
    /// (the same bits in every run).
    #[arg(long, default_value_t = legion_cuda::ConvAlgos::default())]
    conv_algos: legion_cuda::ConvAlgos,
    /// On a GPU, add a convolution's bias and apply its ReLU in a kernel of their own after
    /// cuDNN's convolution, instead of inside cuDNN's fused convolution (fp32 and tf32): to
    /// measure what fusing saves.
    #[arg(long)]
    no_fused_epilogue: bool,
    /// On one device, do not stage the next batch on the device while a step computes (each
    /// step then moves its own batch first): to measure what prefetching saves.
    #[arg(long)]
    no_prefetch: bool,
    /// On one GPU device, enqueue every step's kernels one by one instead of recording the
    /// step as a CUDA graph after the first and replaying it: to measure what capture saves.
    #[arg(long)]
    no_capture: bool,
    /// On one GPU device, draw synthetic batches on the host and copy them, as other data is,
    /// instead of having the GPU draw them from their description (the same values either way):
    /// to measure what drawing them on the device saves.
    #[arg(long)]
    synthetic_on_host: bool,
    /// On one device, wait for every step's work and read its loss before the next step is
    /// enqueued, instead of reading it one step late while the next step runs (the same losses
    /// and weights either way): to measure what the late read saves.
    #[arg(long)]
    sync_every_step: bool,
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let (graph, model_weights) =
        super::load_model_and_weights(&a.model, a.batch, a.image_size, a.classes)?;
    let opts = TrainOptions {
        model_weights,
        devices: a.devices,
        steps: a.steps,
        data: a.data,
        init: a.init,
        save: a.save,
        sgd: Sgd {
            lr: a.lr,
            momentum: a.momentum,
            weight_decay: a.weight_decay,
        },
        seed: a.seed,
        json: a.json,
        strategy: a.strategy,
        trace: a.trace,
        checkpoint_every: a.checkpoint_every,
        resume: a.resume,
        cluster: a.cluster,
        slurm: a.slurm,
        cluster_state: a.state,
        device: a.device,
        memory_gib: a.memory_gib,
        precision: a.precision.given(),
        conv_algos: a.conv_algos,
        conv_epilogue: match a.no_fused_epilogue {
            true => legion_cuda::ConvEpilogue::Separate,
            false => legion_cuda::ConvEpilogue::Fused,
        },
        prefetch: !a.no_prefetch,
        capture: match a.no_capture {
            true => CaptureSetting::Off,
            false => CaptureSetting::On,
        },
        synthetic_on_device: !a.synthetic_on_host,
        loss_readback: match a.sync_every_step {
            true => LossReadback::EveryStep,
            false => LossReadback::OneStepLate,
        },
        gpus: a.gpus.map(|g| g.0),
    };
    job::train(graph, &opts)?;
    Ok(())
}
