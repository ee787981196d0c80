//! onnxruntime runs an exported model and gets legion-rs's inference logits.
//!
//! Needs Python with onnxruntime (and numpy, its dependency): the `python3` on the path, with
//! `LEGION_ONNXRUNTIME_PATH` added to its module path when set (`.ci/run` installs onnxruntime
//! there with pip). Without it the test skips with the reason, unless `LEGION_REQUIRE` lists
//! `onnxruntime`.

mod support;

use legion_ops::require::{self, Need};
use legion_ops::train::ParamStore;
use std::process::Command;

/// Runs `model` in onnxruntime on the `[N, C, H, W]` little-endian f32 batch in `input`, writing
/// the logits to `output` (f32, little-endian).
const RUN: &str = r#"
import sys, numpy as np, onnxruntime as ort
model, input, output, n, c, h, w = sys.argv[1:8]
x = np.fromfile(input, dtype="<f4").reshape(int(n), int(c), int(h), int(w))
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
(logits,) = session.run(None, {session.get_inputs()[0].name: x})
np.asarray(logits, dtype="<f4").tofile(output)
"#;

fn python() -> Command {
    let mut cmd = Command::new("python3");
    if let Some(path) = std::env::var_os("LEGION_ONNXRUNTIME_PATH") {
        cmd.env("PYTHONPATH", path);
    }
    cmd
}

/// Why onnxruntime cannot run here, if it cannot.
fn missing() -> Option<String> {
    match python().args(["-c", "import onnxruntime, numpy"]).output() {
        Err(e) => Some(format!("python3 does not start: {e}")),
        Ok(out) if !out.status.success() => Some(format!(
            "python3 cannot import onnxruntime: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Ok(_) => None,
    }
}

#[test]
fn onnxruntime_reproduces_the_exported_models_logits() {
    if let Some(reason) = missing() {
        require::skip(Need::Onnxruntime, reason);
        return;
    }
    let batch = 3;
    let imported =
        legion_onnx::import(&support::small_model().bytes(), "small", "small.onnx").unwrap();
    let graph = imported.graph.with_batch(batch).unwrap();
    // weights with running statistics away from (0, 1), so that inference-mode batch norm shows
    let params = ParamStore::from_checkpoint(&graph, imported.weights.unwrap()).unwrap();
    let images = support::values(batch * 3 * 8 * 8, 42);
    let ours = legion_ops::infer::logits(&graph, &params, &images).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (model, input, output) = (
        dir.path().join("small.onnx"),
        dir.path().join("input.f32"),
        dir.path().join("logits.f32"),
    );
    legion_onnx::save(&model, &graph, &params).unwrap();
    let bytes: Vec<u8> = images.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&input, bytes).unwrap();
    let out = python()
        .args(["-c", RUN])
        .args([&model, &input, &output])
        .args([batch, 3, 8, 8].map(|d| d.to_string()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "onnxruntime failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<f32> = std::fs::read(&output)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(theirs.len(), ours.len());
    let worst = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "largest difference from onnxruntime: {worst:e} over {} logits",
        ours.len()
    );
    assert!(worst <= 1e-5, "ours {ours:?}\nonnxruntime {theirs:?}");
}
