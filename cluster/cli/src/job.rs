//! A training job: data, initial weights, the training loop, progress output and the final checkpoint.
//! Shared by `legion-rs train` and the example programs.

use crate::machine::{cluster_machine, embedded_machine};
use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use legion_cluster::engine::{self, Engine, JobStart, Place, StepBatch};
use legion_cluster::hosts::Hosts;
use legion_cluster::launch;
use legion_cluster::memory::human_bytes;
use legion_ops::Graph;
use legion_ops::checkpoint;
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::train::{ParamStore, Sgd, TrainingState};
use legion_planner::search::{self, SearchKind};
use legion_planner::{CostModel, CostTables, MachineModel, ParallelConfig, RooflineCost, Strategy};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

/// Everything a training run needs besides the model.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub devices: usize,
    pub steps: u64,
    /// `synthetic`, `synthetic:N`, `cifar10:DIR`, `folder:DIR`.
    pub data: String,
    pub init: Option<PathBuf>,
    pub save: Option<PathBuf>,
    pub sgd: Sgd,
    pub seed: u64,
    /// One JSON object per step and a summary object, instead of human output.
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
    /// The cluster's state directory, if not the default of its hosts file.
    pub cluster_state: Option<PathBuf>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            devices: 1,
            steps: 100,
            data: "synthetic".into(),
            init: None,
            save: None,
            sgd: Sgd::default(),
            seed: 1,
            json: false,
            strategy: "optcnn".into(),
            trace: None,
            checkpoint_every: None,
            resume: None,
            cluster: None,
            cluster_state: None,
        }
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    pub losses: Vec<f32>,
    pub images_per_sec: f64,
    pub wall_secs: f64,
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
            let tables = CostTables::build(&cost);
            Ok(search::find(kind, &tables, search::DEFAULT_BUDGET)
                .with_context(|| format!("{flag} {choice}"))?
                .configs)
        }
        None => {
            let path = std::path::Path::new(choice);
            if !path.exists() {
                bail!(
                    "{flag} '{choice}' is neither a search (optcnn, data, model, owt, \
                     exhaustive) nor an existing strategy file"
                );
            }
            Ok(Strategy::load(path)?.to_configs(graph, machine.num_devices())?)
        }
    }
}

/// Trains `graph` (batch size = its input's N) as `opts` says, printing progress to stdout.
pub fn train(graph: Graph, opts: &TrainOptions) -> anyhow::Result<TrainSummary> {
    if opts.devices == 0 {
        bail!("--devices must be at least 1");
    }
    let batch = graph.batch();
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
    let classes = graph.layer(logits).shape.dim(1);

    if opts.init.is_some() && opts.resume.is_some() {
        bail!("--init and --resume exclude each other");
    }
    if opts.checkpoint_every.is_some() && opts.save.is_none() {
        bail!("--checkpoint-every needs --save PATH (where the checkpoints go)");
    }
    let model_name = graph.name.clone();
    let cluster = match &opts.cluster {
        Some(path) => {
            let hosts = Hosts::load(path)?;
            if opts.devices != 1 && opts.devices != hosts.num_devices() {
                bail!(
                    "--devices {} but the cluster {} has {} device(s); leave --devices out with --cluster",
                    opts.devices,
                    path.display(),
                    hosts.num_devices()
                );
            }
            let state = launch::state_dir(path, opts.cluster_state.as_deref())?;
            Some((hosts, state))
        }
        None => None,
    };
    let devices = cluster
        .as_ref()
        .map_or(opts.devices, |(h, _)| h.num_devices());
    let distributed = devices > 1 || opts.trace.is_some() || cluster.is_some();
    let (configs, where_text) = if distributed {
        let (machine, where_text) = match &cluster {
            Some((hosts, state)) => (
                cluster_machine(hosts, state)?,
                format!(
                    "{} worker(s) of {}",
                    hosts.hosts.len(),
                    opts.cluster.as_ref().unwrap().display()
                ),
            ),
            None => (embedded_machine(devices)?, "embedded device(s)".to_string()),
        };
        (
            choose_strategy(&graph, &machine, &opts.strategy)?,
            where_text,
        )
    } else {
        let serial = vec![ParallelConfig::serial(0); graph.layers().len()];
        (serial, "one device".to_string())
    };
    // Before any weight is allocated: a model too large must get an error, not an abort. The
    // workers of a cluster check their own devices when the job reaches them.
    let embedded = cluster.is_none().then_some((&configs[..], devices));
    legion_cluster::memory::check_this_host(&graph, embedded)?;

    let load_state = |path: &PathBuf| -> anyhow::Result<TrainingState> {
        let ckpt = checkpoint::load(path)?;
        TrainingState::from_checkpoint(&graph, ckpt)
            .with_context(|| format!("{}: does not fit model '{}'", path.display(), graph.name))
    };
    let state_to_load = match (&opts.init, &opts.resume) {
        (None, Some(path)) => load_state(path)?,
        // Weights only: a fresh run from them.
        (Some(path), _) => TrainingState::start(load_state(path)?.params),
        (None, None) => TrainingState::start(ParamStore::init(&graph, opts.seed)),
    };
    let first_step = state_to_load.step;
    if first_step > opts.steps {
        bail!(
            "--resume: the checkpoint is at step {first_step}, past --steps {}",
            opts.steps
        );
    }
    let dataset = data::open(
        &opts.data,
        [input.dim(1), input.dim(2), input.dim(3)],
        classes,
        opts.seed,
    )?;
    // What the summary reports of the distributed plan: per-layer configs and bytes moved per step.
    let mut plan_summary = serde_json::Value::Null;
    let place = match &cluster {
        Some((hosts, state_dir)) => Place::Cluster { hosts, state_dir },
        None if distributed => Place::Embedded { devices },
        None => Place::OneDevice,
    };
    let job = JobStart {
        graph: &graph,
        configs: &configs,
        state: state_to_load,
        sgd: opts.sgd,
        seed: opts.seed,
    };
    let mut engine = engine::start(place, job)?;
    if distributed {
        let remote_bytes = engine.plan().expect("a distributed engine").remote_bytes();
        plan_summary = json!({
            "strategy": opts.strategy,
            "layers": Strategy::from_configs(&graph, &configs).layers,
            "comm_bytes_per_step": remote_bytes,
        });
        if !opts.json {
            println!(
                "strategy {} on {devices} device(s) ({where_text}), {} moved between devices per step:\n{}",
                opts.strategy,
                human_bytes(remote_bytes),
                Strategy::from_configs(&graph, &configs)
            );
        }
    }
    let loader = Loader::new(
        dataset.into(),
        LoaderConfig {
            seed: opts.seed,
            ..LoaderConfig::new(batch)
        },
    )?;
    let mut batches = loader.steps(first_step);

    let progress = (!opts.json && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(opts.steps);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
                .expect("valid progress template"),
        );
        bar
    });
    let started = Instant::now();
    let mut losses = Vec::with_capacity(opts.steps as usize);
    let save = |engine: &dyn Engine| -> anyhow::Result<()> {
        if let Some(path) = &opts.save {
            let meta = BTreeMap::from([("model".to_string(), model_name.clone())]);
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
    for step in first_step + 1..=opts.steps {
        let batch_data = upcoming.take().expect("a batch for every step");
        upcoming = (step < opts.steps).then(&mut next_batch).transpose()?;
        let t = Instant::now();
        let traced = opts.trace.is_some() && step == opts.steps;
        let (stats, reports) = engine.step(StepBatch {
            images: batch_data.images,
            labels: batch_data.labels,
            next: upcoming.as_ref().map(|b| (&b.images[..], &b.labels[..])),
            trace: traced,
        })?;
        if traced && let (Some(path), Some(plan)) = (&opts.trace, engine.plan()) {
            let trace = legion_runtime::trace::chrome_trace(plan, &graph, &reports);
            legion_ops::atomic_file::write(path, serde_json::to_string(&trace)?.as_bytes())
                .with_context(|| format!("writing the trace {}", path.display()))?;
        }
        let secs = t.elapsed().as_secs_f64();
        let images_per_sec = batch as f64 / secs;
        if !stats.loss.is_finite() {
            bail!(
                "step {step}: the loss is {} (try a smaller --lr)",
                stats.loss
            );
        }
        losses.push(stats.loss);
        if opts.checkpoint_every.is_some_and(|k| step % k == 0) && step < opts.steps {
            save(engine.as_ref())?;
        }
        let accuracy = stats.correct as f64 / batch as f64;
        if opts.json {
            println!(
                "{}",
                json!({"step": step, "loss": stats.loss, "accuracy": accuracy,
                       "step_ms": secs * 1e3, "images_per_sec": images_per_sec})
            );
        } else if let Some(bar) = &progress {
            bar.set_position(step);
            bar.set_message(format!("loss {:.4}  {images_per_sec:.1} img/s", stats.loss));
        } else {
            println!(
                "step {step:>5}  loss {:.4}  acc {accuracy:.3}  {images_per_sec:.1} img/s",
                stats.loss
            );
        }
    }
    if let Some(bar) = progress {
        bar.finish();
    }
    let wall_secs = started.elapsed().as_secs_f64();

    save(engine.as_ref())?;

    let window = losses.len().min(10);
    let mean = |xs: &[f32]| xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len().max(1) as f64;
    let first = mean(&losses[..window]);
    let last = mean(&losses[losses.len() - window..]);
    let images_per_sec = (opts.steps as f64 * batch as f64) / wall_secs;
    if opts.json {
        println!(
            "{}",
            json!({"summary": true, "model": model_name, "devices": devices,
                   "plan": plan_summary,
                   "steps": opts.steps, "batch": batch, "first10_loss": first,
                   "last10_loss": last, "final_loss": losses.last(),
                   "images_per_sec": images_per_sec, "wall_s": wall_secs,
                   "saved": opts.save.as_ref().map(|p| p.display().to_string())})
        );
    } else {
        println!(
            "trained {model_name} for {} steps at batch {batch}: loss {first:.4} -> {last:.4} \
             (means of the first and last {window}), {images_per_sec:.1} img/s, {wall_secs:.1} s",
            opts.steps
        );
        if let Some(path) = &opts.save {
            println!("saved {}", path.display());
        }
    }
    Ok(TrainSummary {
        losses,
        images_per_sec,
        wall_secs,
    })
}
