use crate::flags::{TrainDefaults, TrainFlags};
use clap::Args;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A zoo model name (see `legion-rs models`), a JSON model file or an ONNX file (its
    /// initializers, if it has them, are the initial weights).
    #[arg(long)]
    model: String,
    /// Global batch size.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Input height and width for zoo models (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    #[command(flatten)]
    flags: TrainFlags,
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let model = super::resolve_model(&a.model, a.batch, a.image_size, a.classes)?;
    let graph = model.graph;
    let options = legion::TrainOptions {
        model_weights: model.weights,
        ..a.flags.options(TrainDefaults::default())?
    };
    crate::progress::train(legion::Training::with_options(graph, options), a.flags.json)?;
    Ok(())
}
