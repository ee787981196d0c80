//! What a PyTorch user brings, through the binary: an ONNX export's import summary and warnings
//! on stderr (stdout stays JSON), and `--init` of a `state_dict` saved by
//! `safetensors.torch.save_file`, whose unused buffers are named and skipped.

mod common;

use common::{legion, ok, stderr};
use std::path::{Path, PathBuf};

fn exported(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../integration/onnx/exporters/{name}"))
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_state_dict_from_pytorch_initialises_its_exported_model() {
    let (model, state) = (
        exported("torchscript_preserve.onnx"),
        exported("state_dict.safetensors"),
    );
    let out = ok(legion(&[
        "train",
        "--model",
        path_str(&model),
        "--init",
        path_str(&state),
        "--batch",
        "2",
        "--steps",
        "1",
        "--json",
    ]));
    let err = stderr(&out);
    assert!(
        err.contains("torchscript_preserve.onnx: 12 nodes (")
            && err.contains("as 11 layers, 2 BatchNorm, 365 parameters, weights from the file"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "note: {}: skipped 2 tensor(s) the model has no use for: \
             'bn1.num_batches_tracked' and 1 more (PyTorch BatchNorm's step counters)",
            state.display()
        )),
        "{err}"
    );
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        serde_json::from_str::<serde_json::Value>(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
    }
}

#[test]
fn a_folded_batch_norm_export_plans_with_a_warning_that_says_how_to_keep_it() {
    let model = exported("torchscript_folded.onnx");
    let out = ok(legion(&[
        "plan",
        "--model",
        path_str(&model),
        "--batch",
        "2",
        "--machine",
        "paper:2",
        "--search",
        "data",
        "--json",
    ]));
    let err = stderr(&out);
    assert!(
        err.contains("0 BatchNorm, 349 parameters")
            && err.contains(
                "\nwarning: 2 of the 2 Conv nodes read a weight or bias that is no module's"
            )
            && err.contains("training=torch.onnx.TrainingMode.PRESERVE"),
        "{err}"
    );
    serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("stdout is the plan's JSON");
}

/// A torchvision `state_dict` of ResNet-18 as `safetensors.torch.save_file` writes it: every
/// parameter and buffer under torchvision's names (those of its ONNX export), BatchNorm's
/// `num_batches_tracked` as I64 scalars among them; `rename` changes one name.
fn torchvision_state_dict(path: &Path, rename: Option<(&str, &str)>) {
    let export = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration/onnx/resnet18.onnx");
    let graph = legion_onnx::load(&export).unwrap().graph;
    let params = legion_ops::train::ParamStore::init(&graph, 7);
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)> = Vec::new();
    for (p, v) in params.params.iter().zip(&params.values) {
        let name = match rename {
            Some((from, to)) if p.name == from => to.to_string(),
            _ => p.name.clone(),
        };
        let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes.push((
            name,
            p.spec.shape.dims().to_vec(),
            data,
            safetensors::Dtype::F32,
        ));
        if let Some(bn) = p.name.strip_suffix(".running_var") {
            let counter = format!("{bn}.num_batches_tracked");
            bytes.push((
                counter,
                vec![],
                9i64.to_le_bytes().to_vec(),
                safetensors::Dtype::I64,
            ));
        }
    }
    let views = bytes.iter().map(|(name, shape, data, dtype)| {
        let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
        (name.as_str(), view)
    });
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn the_zoos_resnet18_starts_from_a_torchvision_state_dict() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("resnet18.safetensors");
    torchvision_state_dict(&state, None);
    let run = |init: &Path| {
        legion(&[
            "train",
            "--model",
            "resnet18",
            "--image-size",
            "32",
            "--batch",
            "2",
            "--steps",
            "1",
            "--init",
            path_str(init),
        ])
    };
    let out = ok(run(&state));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "note: {}: skipped 20 tensor(s) the model has no use for: \
             'bn1.num_batches_tracked' and 19 more",
            state.display()
        )),
        "{err}"
    );
    // a name of another model is refused by name, not skipped
    let wrong = dir.path().join("wrong.safetensors");
    torchvision_state_dict(
        &wrong,
        Some(("layer1.0.conv1.weight", "layer1.0.conv_a.weight")),
    );
    common::assert_clean_failure(&run(&wrong), &["layer1.0.conv1.weight"]);
}
