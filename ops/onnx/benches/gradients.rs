//! One forward and backward pass of an ONNX model over a given batch, on the CPU, as a training
//! step takes it (batch norm on the batch's statistics): its loss and every trainable parameter's
//! gradient, under the model's own parameter names, written as safetensors for
//! `integration/torchvision_check.py` to compare with PyTorch's float64 autograd.
//!
//! ```text
//! cargo bench -p legion-onnx --bench gradients -- MODEL.onnx BATCH.safetensors OUT.safetensors
//! ```
//!
//! BATCH holds `images` (`[N, C, H, W]`) and `labels` (`[N]`, class indices as floats); OUT gets
//! the gradients and the mean loss as `loss` (`[1]`). The model must carry its weights.

use legion_ops::Shape;
use legion_ops::checkpoint::{self, Checkpoint, NamedTensor};
use legion_ops::train::{ParamStore, loss_gradients};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    // `cargo bench` adds `--bench`
    let args: Vec<PathBuf> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--bench")
        .map(PathBuf::from)
        .collect();
    let [model, batch, out] = &args[..] else {
        eprintln!("usage: gradients MODEL.onnx BATCH.safetensors OUT.safetensors");
        return ExitCode::from(2);
    };
    match run(model, batch, out) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(model: &Path, batch: &Path, out: &Path) -> Result<String, String> {
    let imported = legion_onnx::load(model).map_err(|e| e.to_string())?;
    let weights = imported
        .weights
        .ok_or_else(|| format!("{}: the model carries no weights", model.display()))?;
    let data = checkpoint::load(batch).map_err(|e| e.to_string())?;
    let tensor = |name: &str| {
        data.get(name)
            .ok_or_else(|| format!("{}: no tensor '{name}'", batch.display()))
    };
    let (images, labels) = (tensor("images")?, tensor("labels")?);
    let n = images.shape.dim(0);
    let graph = imported.graph.with_batch(n).map_err(|e| e.to_string())?;
    let params = ParamStore::from_checkpoint(&graph, weights).map_err(|e| e.to_string())?;
    let labels: Vec<u32> = labels.data.iter().map(|&l| l as u32).collect();
    let result =
        loss_gradients(&graph, &params, &images.data, &labels, 0, 0).map_err(|e| e.to_string())?;
    let count = result.gradients.len();
    let mut tensors = result.gradients;
    tensors.push(NamedTensor::new(
        "loss",
        Shape::new(&[1]),
        vec![result.loss as f32],
    ));
    Checkpoint {
        tensors,
        ..Checkpoint::default()
    }
    .save(out)
    .map_err(|e| e.to_string())?;
    Ok(format!(
        "{{\"loss\": {}, \"gradients\": {count}}}",
        result.loss
    ))
}
