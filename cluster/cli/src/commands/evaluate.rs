//! `legion-rs eval` and `legion-rs predict`: a checkpoint's accuracy on a dataset, and the classes
//! it sees in images, with the class names its training run saved in it.

use clap::Args;
use legion::evaluate::{Trained, image_files};
use legion::ops::data::{Data, Transforms};
use serde_json::json;
use std::path::PathBuf;

/// The model and the weights both commands load.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// A zoo model name, a JSON model file or an ONNX file (as `train --model` took).
    #[arg(long)]
    model: String,
    /// The weights: a checkpoint `train --save` wrote.
    #[arg(long, value_name = "FILE")]
    checkpoint: PathBuf,
    /// Images scored at once.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Input height and width for zoo models, as trained (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models, as trained (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<Trained> {
        let model = super::resolve_model(&self.model, self.batch, self.image_size, self.classes)?;
        Trained::load(model.graph, &self.checkpoint)
    }
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The data to score: `folder:DIR` (its classes as in training), `cifar10:FILE`, ...
    #[arg(long)]
    data: String,
    /// Score the whole image resized instead of its centre crop (torchvision's evaluation
    /// recipe: the shorter side to 256/224 of the model's, then the centre).
    #[arg(long)]
    whole: bool,
    /// Stop at an image that cannot be read instead of skipping it.
    #[arg(long)]
    strict_data: bool,
}

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let trained = a.model.load()?;
    let data: Data = a
        .data
        .parse()
        .map_err(|e| anyhow::anyhow!("--data {}: {e}", a.data))?;
    let transforms = match (&data, a.whole) {
        (Data::Folder(_), false) => Transforms::EVAL,
        _ => Transforms::PLAIN,
    };
    let acc = trained.evaluate(&data, transforms, a.strict_data)?;
    if a.model.json {
        println!(
            "{}",
            json!({"data": a.data, "samples": acc.samples, "top1": acc.top1,
                   "top5": acc.top5, "loss": acc.loss})
        );
    } else {
        println!(
            "{}: {} samples, top-1 {:.2}%, top-5 {:.2}%, loss {:.4}",
            a.data,
            acc.samples,
            100.0 * acc.top1,
            100.0 * acc.top5,
            acc.loss
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PredictArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Classes shown per image.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Image files, or folders of them (their `.png`, `.jpg` and `.jpeg` files).
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

pub fn predict(a: PredictArgs) -> anyhow::Result<()> {
    let trained = a.model.load()?;
    let files = image_files(&a.images)?;
    let predictions = trained.predict(&files, a.top.max(1))?;
    let name = |label: usize, name: &Option<String>| {
        name.clone().unwrap_or_else(|| format!("class {label}"))
    };
    if a.model.json {
        let rows: Vec<_> = predictions
            .iter()
            .map(|p| {
                json!({"file": p.file.display().to_string(),
                       "classes": p.classes.iter().map(|(label, n, prob)| json!({
                           "label": label, "name": name(*label, n), "probability": prob
                       })).collect::<Vec<_>>()})
            })
            .collect();
        println!("{}", json!({ "predictions": rows }));
    } else {
        for p in &predictions {
            let classes: Vec<String> = p
                .classes
                .iter()
                .map(|(label, n, prob)| format!("{} {:.1}%", name(*label, n), 100.0 * prob))
                .collect();
            println!("{}: {}", p.file.display(), classes.join(", "));
        }
    }
    Ok(())
}
