//! What the example programs share: their flags and how they run a model the user built.
//!
//! Each program (`src/bin/*.rs`) only defines its model with the `legion-ops` builder API and its
//! defaults; training, `--compare` and the output are the same everywhere.

use anyhow::Context;
use clap::Args;
use legion::Graph;
use legion::job::check_output_path;
use legion_cli::compare::{self, ClusterTarget, CompareSettings};
use legion_cli::flags::{TrainDefaults, TrainFlags};
use std::path::PathBuf;

/// Flags every example takes: `legion-rs train`'s (without `--model`), the sizes, and
/// `--compare`. Unset sizes take the example's defaults.
#[derive(Args, Debug)]
pub struct ExampleArgs {
    /// Global batch size.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Input height and width.
    #[arg(long)]
    pub image_size: Option<usize>,
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    #[command(flatten)]
    pub train: TrainFlags,
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
}

/// Devices of the embedded cluster an example trains on unless `--devices` says otherwise.
pub const DEVICES: usize = 4;

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
    let flags = &args.train;
    let lr = flags.lr.unwrap_or(defaults.lr);
    let graph = build(batch, image_size, args.classes)?;
    if !flags.json {
        println!(
            "{} {image_size}x{image_size} batch {batch}, {} classes, {} parameters, lr {lr}",
            graph.name,
            args.classes,
            graph.param_count()
        );
    }
    // Checked before the strategies are measured, which takes minutes.
    if let Some(path) = &args.chart {
        check_output_path("--chart", path)?;
    }
    if args.compare {
        // --compare prices its simulation with a profile, and runs its strategies, in fp32:
        // bf16 there would silently be an fp32 comparison.
        if flags.precision.given() == Some(legion::Precision::Bf16) {
            anyhow::bail!(
                "{} (--compare profiles each strategy)",
                legion::precision::BF16_NO_PROFILE
            );
        }
        let cluster = match (&flags.cluster, flags.slurm) {
            (None, false) => None,
            (path, _) => {
                let located =
                    legion::cluster::launch::locate(path.as_deref(), flags.state.as_deref())?;
                Some(ClusterTarget {
                    hosts: located.load_hosts()?,
                    state: located.state,
                })
            }
        };
        let settings = CompareSettings {
            devices: flags.devices.unwrap_or(DEVICES),
            warmup: 2,
            steps: flags.steps.unwrap_or(defaults.compare_steps).max(1) as usize,
            seed: 1,
            cluster,
            strategies: compare::strategies_from(&args.strategies),
            traces: flags.trace.clone(),
            costs: flags.costs.clone(),
            cost_cache: legion::costs::CostCache::default_location(),
        };
        if let Some(dir) = &flags.trace {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the trace directory {}", dir.display()))?;
        }
        let rows = compare::compare(&graph, &settings)?;
        if flags.json {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        } else {
            print!("{}", compare::table(&rows));
        }
        if let Some(path) = &args.chart {
            let title = match (&flags.cluster, flags.slurm) {
                (Some(path), _) => format!("{} on the cluster {}", graph.name, path.display()),
                (None, true) => format!("{} on the Slurm job's cluster", graph.name),
                (None, false) => format!(
                    "{} on {} embedded devices",
                    graph.name,
                    flags.devices.unwrap_or(DEVICES)
                ),
            };
            compare::chart(&rows, &title, path)?;
            if !flags.json {
                println!("chart: {}", path.display());
            }
        }
        return Ok(());
    }
    let options = flags.options(TrainDefaults {
        devices: DEVICES,
        steps: defaults.steps,
        lr,
    })?;
    legion_cli::train(legion::Training::with_options(graph, options), flags.json)
        .context("training")?;
    Ok(())
}
