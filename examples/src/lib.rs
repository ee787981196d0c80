//! What the example programs share: their flags and how they run a model the user built.
//!
//! Each program (`src/bin/*.rs`) only defines its model with the `legion-ops` builder API and its
//! defaults; training, `--compare` and the output are the same everywhere.

use anyhow::Context;
use clap::Args;
use legion_cli::compare::{self, ClusterTarget, CompareSettings};
use legion_cli::device::DeviceKind;
use legion_cli::job::{self, TrainOptions};
use legion_ops::Graph;
use legion_ops::train::Sgd;
use std::path::PathBuf;

/// Flags every example takes. Unset sizes take the example's defaults.
#[derive(Args, Debug)]
pub struct ExampleArgs {
    /// Training steps (batches).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Global batch size.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Input height and width.
    #[arg(long)]
    pub image_size: Option<usize>,
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Devices of the embedded cluster (device actors in this process, on its GPUs or its cores
    /// as --device says); 1 trains with the single-device trainer.
    #[arg(long, default_value_t = 4)]
    pub devices: usize,
    /// Train on the workers of a running cluster (`legion-rs up HOSTS`) instead of the embedded
    /// one; its devices replace --devices.
    #[arg(long, value_name = "HOSTS")]
    pub cluster: Option<PathBuf>,
    /// Train on the workers `legion-rs up --slurm` started in the Slurm job this runs in; its
    /// devices replace --devices.
    #[arg(long, conflicts_with = "cluster")]
    pub slurm: bool,
    /// The cluster's state directory, if `up` was given one.
    #[arg(long)]
    pub state: Option<PathBuf>,
    #[arg(long, default_value = "optcnn", help = job::strategy_help())]
    pub strategy: String,
    /// `synthetic`, `synthetic:N`, `cifar10:DIR`, `folder:DIR`.
    #[arg(long, default_value = "synthetic")]
    pub data: String,
    /// Start from these weights (safetensors).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Save the trained weights here (safetensors, with momentum and step for --resume).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also write the --save checkpoint every K steps.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Continue a run from a --save checkpoint (--steps counts from the start of the run).
    #[arg(long, conflicts_with = "init")]
    pub resume: Option<PathBuf>,
    /// SGD learning rate (momentum 0.9); unset, the example's own (alexnet: 0.01, the others:
    /// 0.03).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Write a Chrome/Perfetto trace of the last step. With --compare: a directory, to which each
    /// strategy's measured and simulated traces go (`<strategy>.measured.json`,
    /// `<strategy>.simulated.json`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Run data, model, owt and optcnn one after another on the same cluster instead of training:
    /// one table of measured and simulated step times, and of how far each strategy's weights are
    /// from the single-device trainer's after the same steps.
    #[arg(long)]
    pub compare: bool,
    /// With --compare: what to run instead, comma-separated (searches or strategy files), or
    /// `all`: data, model, owt, optcnn, refine and the other papers' planners soybean, tofu,
    /// hypar, spartan. Data parallelism always runs first.
    #[arg(long, requires = "compare", default_value = "data,model,owt,optcnn")]
    pub strategies: String,
    /// With --compare: also draw the comparison as an SVG bar chart here.
    #[arg(long, requires = "compare")]
    pub chart: Option<PathBuf>,
    /// One JSON object per step (or per strategy with --compare) and a summary.
    #[arg(long)]
    pub json: bool,
    /// Where to train (`auto`, `cpu`, `cuda`): see `legion-rs train --help`.
    #[arg(long, value_parser = DeviceKind::parse_flag, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// What the run computes in (`fp32`, `tf32`, `bf16`; `--tf32` is `--precision tf32`): see
    /// `legion-rs train --help`.
    #[command(flatten)]
    pub precision: legion_cli::precision::PrecisionArgs,
    /// On a GPU, how convolution algorithms are picked (`fastest`, `precise`, `heuristic`): see
    /// `legion-rs train --help`.
    #[arg(long, default_value_t = legion_cli::ConvAlgos::default())]
    pub conv_algos: legion_cli::ConvAlgos,
}

/// An example's sizes and learning rate when the flags leave them out.
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    /// Training steps.
    pub steps: u64,
    /// Steps each strategy is timed for with `--compare`: a step time settles in far fewer steps
    /// than a model takes to learn.
    pub compare_steps: u64,
    pub batch: usize,
    pub image_size: usize,
    /// SGD learning rate; momentum and weight decay are `Sgd::default()`'s.
    pub lr: f32,
}

/// Builds the model with the chosen sizes and trains or compares it.
pub fn run(
    args: &ExampleArgs,
    defaults: Defaults,
    build: impl FnOnce(usize, usize, usize) -> anyhow::Result<Graph>,
) -> anyhow::Result<()> {
    let batch = args.batch.unwrap_or(defaults.batch);
    let image_size = args.image_size.unwrap_or(defaults.image_size);
    let lr = args.lr.unwrap_or(defaults.lr);
    let graph = build(batch, image_size, args.classes)?;
    if !args.json {
        println!(
            "{} {image_size}x{image_size} batch {batch}, {} classes, {} parameters, lr {lr}",
            graph.name,
            args.classes,
            graph.param_count()
        );
    }
    // Checked before the strategies are measured, which takes minutes.
    if let Some(path) = &args.chart {
        job::check_output_path("--chart", path)?;
    }
    if args.compare {
        // --compare prices its simulation with a profile, and runs its strategies, in fp32:
        // bf16 there would silently be an fp32 comparison.
        if args.precision.given() == Some(legion_ops::Precision::Bf16) {
            anyhow::bail!(
                "{} (--compare profiles each strategy)",
                legion_cli::precision::BF16_NO_PROFILE
            );
        }
        let cluster = match (&args.cluster, args.slurm) {
            (None, false) => None,
            (path, _) => {
                let located =
                    legion_cluster::launch::locate(path.as_deref(), args.state.as_deref())?;
                Some(ClusterTarget {
                    hosts: located.load_hosts()?,
                    state: located.state,
                })
            }
        };
        let settings = CompareSettings {
            devices: args.devices,
            warmup: 2,
            steps: args.steps.unwrap_or(defaults.compare_steps).max(1) as usize,
            seed: 1,
            cluster,
            strategies: compare::strategies_from(&args.strategies),
            traces: args.trace.clone(),
        };
        if let Some(dir) = &args.trace {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the trace directory {}", dir.display()))?;
        }
        let rows = compare::compare(&graph, &settings)?;
        if args.json {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        } else {
            print!("{}", compare::table(&rows));
        }
        if let Some(path) = &args.chart {
            let title = match (&args.cluster, args.slurm) {
                (Some(path), _) => format!("{} on the cluster {}", graph.name, path.display()),
                (None, true) => format!("{} on the Slurm job's cluster", graph.name),
                (None, false) => format!("{} on {} embedded devices", graph.name, args.devices),
            };
            compare::chart(&rows, &title, path)?;
            if !args.json {
                println!("chart: {}", path.display());
            }
        }
        return Ok(());
    }
    let steps = args.steps.unwrap_or(defaults.steps);
    let opts = TrainOptions {
        devices: if args.cluster.is_some() || args.slurm {
            1
        } else {
            args.devices
        },
        cluster: args.cluster.clone(),
        slurm: args.slurm,
        cluster_state: args.state.clone(),
        steps,
        data: args.data.clone(),
        init: args.init.clone(),
        save: args.save.clone(),
        sgd: Sgd {
            lr,
            ..Sgd::default()
        },
        json: args.json,
        strategy: args.strategy.clone(),
        trace: args.trace.clone(),
        checkpoint_every: args.checkpoint_every,
        resume: args.resume.clone(),
        device: args.device,
        precision: args.precision.given(),
        conv_algos: args.conv_algos,
        ..TrainOptions::default()
    };
    job::train(graph, &opts).context("training")?;
    Ok(())
}
