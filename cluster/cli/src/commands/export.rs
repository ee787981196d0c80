//! `legion-rs export`: a model's inference graph with its weights as an ONNX file, for a
//! deployment runtime (onnxruntime, TensorRT).

use anyhow::Context;
use clap::Args;
use legion_ops::checkpoint;
use legion_ops::train::{ParamStore, TrainingState};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The ONNX file to write (atomically: a temporary file beside it, renamed over it).
    #[arg(long, value_name = "FILE")]
    onnx: PathBuf,
    /// A zoo model name, a JSON model file or an ONNX file.
    #[arg(long)]
    model: String,
    /// The weights: a safetensors checkpoint (`train --save`); without it, an ONNX model's own
    /// weights, else the seeded initialisation of --seed.
    #[arg(long)]
    init: Option<PathBuf>,
    /// The batch size the graph is built at; the file leaves the batch to the runtime.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Input height and width for zoo models (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    /// Seed of the initialisation, when the weights come from neither --init nor the model file.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    legion::job::check_output_path("--onnx", &a.onnx)?;
    let legion::ResolvedModel {
        graph,
        weights: model_weights,
        ..
    } = super::resolve_model(&a.model, a.batch, a.image_size, a.classes)?;
    let (params, from) = match (&a.init, model_weights) {
        (Some(path), _) => {
            let ckpt = checkpoint::load(path)?;
            let state = TrainingState::from_checkpoint(&graph, ckpt).with_context(|| {
                format!("{}: does not fit model '{}'", path.display(), graph.name)
            })?;
            (state.params, format!("the weights of {}", path.display()))
        }
        (None, Some(weights)) => (
            ParamStore::from_checkpoint(&graph, weights)
                .with_context(|| format!("the weights of {} do not fit it", a.model))?,
            format!("the weights of {}", a.model),
        ),
        (None, None) => (
            ParamStore::init(&graph, a.seed),
            format!("the seeded initialisation (--seed {})", a.seed),
        ),
    };
    legion_onnx::save(&a.onnx, &graph, &params)?;
    println!(
        "{}: model '{}', {} layers, {} parameters, from {from}",
        a.onnx.display(),
        graph.name,
        graph.layers().len(),
        graph.param_count()
    );
    Ok(())
}
