//! A training job: data, initial weights, the training loop, progress output and the final checkpoint.
//! Shared by `legion-rs train` and the example programs.

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use legion_ops::Graph;
use legion_ops::checkpoint;
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::train::{ParamStore, Sgd, Trainer};
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

/// Trains `graph` (batch size = its input's N) as `opts` says, printing progress to stdout.
pub fn train(graph: Graph, opts: &TrainOptions) -> anyhow::Result<TrainSummary> {
    if opts.devices != 1 {
        bail!(
            "--devices {}: training on several devices needs the distributed runtime, which this \
             build does not include yet; use --devices 1",
            opts.devices
        );
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

    let params = match &opts.init {
        Some(path) => {
            let ckpt = checkpoint::load(path)?;
            ParamStore::from_checkpoint(&graph, ckpt).with_context(|| {
                format!("{}: does not fit model '{}'", path.display(), graph.name)
            })?
        }
        None => ParamStore::init(&graph, opts.seed),
    };
    let dataset = data::open(
        &opts.data,
        [input.dim(1), input.dim(2), input.dim(3)],
        classes,
        opts.seed,
    )?;
    let model_name = graph.name.clone();
    let mut trainer = Trainer::new(graph, params, opts.sgd, opts.seed);
    let loader = Loader::new(
        dataset.into(),
        LoaderConfig {
            seed: opts.seed,
            ..LoaderConfig::new(batch)
        },
    )?;
    let mut batches = loader.steps(0);

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
    for step in 1..=opts.steps {
        let batch_data = batches
            .next()
            .context("the data loader stopped early")?
            .context("loading a batch")?;
        let t = Instant::now();
        let stats = trainer.step(&batch_data.images, &batch_data.labels)?;
        let secs = t.elapsed().as_secs_f64();
        let images_per_sec = batch as f64 / secs;
        if !stats.loss.is_finite() {
            bail!(
                "step {step}: the loss is {} (try a smaller --lr)",
                stats.loss
            );
        }
        losses.push(stats.loss);
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

    if let Some(path) = &opts.save {
        let mut meta = BTreeMap::new();
        meta.insert("model".to_string(), model_name.clone());
        meta.insert("step".to_string(), trainer.steps().to_string());
        checkpoint::save(path, &trainer.params().tensors(), &meta)?;
    }

    let window = losses.len().min(10);
    let mean = |xs: &[f32]| xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len().max(1) as f64;
    let first = mean(&losses[..window]);
    let last = mean(&losses[losses.len() - window..]);
    let images_per_sec = (opts.steps as f64 * batch as f64) / wall_secs;
    if opts.json {
        println!(
            "{}",
            json!({"summary": true, "model": model_name, "devices": opts.devices,
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
