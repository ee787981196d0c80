//! What a job refuses before anything is loaded or allocated.

use super::TrainOptions;
use anyhow::{Context, bail};
use legion_ops::Graph;
use legion_ops::checkpoint;
use legion_ops::train::{ParamStore, TrainingState};
use legion_planner::{MachineModel, ParallelConfig};
use std::path::PathBuf;

/// What training needs of a model, from its shapes.
pub(super) struct ModelShape {
    /// C, H, W of an input image.
    pub image: [usize; 3],
    pub classes: usize,
}

/// Refuses `configs` (the strategy `choice`) where a device of `machine` with memory of its own
/// (`--memory-gib`) cannot hold its share, before anything is allocated: the memory model the
/// searches use (`legion_planner::memory::check_fits`) counts every buffer the device actors will
/// allocate, and the error names the device, what it needs and the layer that needs most.
pub(super) fn check_device_memory(
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

/// The checks of `opts` that need nothing but the model: done before anything is loaded.
pub(super) fn check_options(graph: &Graph, opts: &TrainOptions) -> anyhow::Result<ModelShape> {
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
    if opts.recovery.max_recoveries > 0 && opts.recovery.snapshot_every == Some(0) {
        bail!(
            "--snapshot-every 0: give the steps between snapshots (at least 1), or turn \
             recovery off with --no-recover"
        );
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
pub(super) fn classes_mismatch(
    flag: &str,
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
        "{flag} {spec}: {dataset} has {found} classes, but model '{}' has {head} outputs; {fix}",
        graph.name
    )
}

/// The weights, momentum and step the run starts from: a checkpoint to resume, one's weights to
/// start afresh from, the model file's weights, or the seeded initialisation; with a note naming
/// the tensors of the file that were not loaded (a PyTorch `state_dict`'s unused buffers).
pub(super) fn initial_state(
    graph: &Graph,
    opts: &TrainOptions,
) -> anyhow::Result<(TrainingState, Option<String>)> {
    let mut note = None;
    let mut load_state = |path: &PathBuf| -> anyhow::Result<TrainingState> {
        let ckpt = checkpoint::load(path)?;
        note = skipped_note(path, &ckpt.skipped);
        if opts.resume.as_ref() == Some(path) {
            check_same_schedule(path, &ckpt.metadata, opts)?;
        }
        TrainingState::from_checkpoint(graph, ckpt)
            .with_context(|| format!("{}: does not fit model '{}'", path.display(), graph.name))
    };
    let state = match (&opts.init, &opts.resume) {
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
    };
    Ok((state, note))
}

/// The checkpoint metadata of a run's schedule: what a resumed run must repeat to continue the
/// same rates.
pub(super) fn schedule_metadata(opts: &TrainOptions) -> [(String, String); 3] {
    [
        (SCHEDULE_KEY.into(), opts.lr_schedule.to_string()),
        (LR_KEY.into(), opts.sgd.lr.to_string()),
        (STEPS_KEY.into(), opts.steps.to_string()),
    ]
}

const SCHEDULE_KEY: &str = "lr_schedule";
const LR_KEY: &str = "lr";
const STEPS_KEY: &str = "total_steps";

/// A resumed run under a schedule continues the rates its checkpoint's run had: the same
/// schedule, base rate and length (a cosine's rates depend on it).
fn check_same_schedule(
    path: &std::path::Path,
    metadata: &std::collections::BTreeMap<String, String>,
    opts: &TrainOptions,
) -> anyhow::Result<()> {
    let saved = metadata.get(SCHEDULE_KEY);
    let scheduled = !opts.lr_schedule.is_constant() || saved.is_some_and(|s| s != "constant");
    if !scheduled {
        return Ok(());
    }
    let now = schedule_metadata(opts);
    let same = now
        .iter()
        .all(|(key, value)| metadata.get(key) == Some(value));
    if !same {
        let then = |key: &str| metadata.get(key).map_or("?", String::as_str);
        bail!(
            "--resume {}: its run had --lr-schedule {} --lr {} over {} steps, this one --lr-schedule \
             {} --lr {} over {}; give the same to continue its rates (or --init to start a new run \
             from its weights)",
            path.display(),
            then(SCHEDULE_KEY),
            then(LR_KEY),
            then(STEPS_KEY),
            now[0].1,
            now[1].1,
            now[2].1
        );
    }
    Ok(())
}

/// What a checkpoint's skipped tensors were, or `None` where it skipped none.
fn skipped_note(path: &std::path::Path, skipped: &[String]) -> Option<String> {
    let (first, rest) = skipped.split_first()?;
    let more = match rest.len() {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    Some(format!(
        "{}: skipped {} tensor(s) the model has no use for: '{first}'{more} (PyTorch \
         BatchNorm's step counters)",
        path.display(),
        skipped.len()
    ))
}
