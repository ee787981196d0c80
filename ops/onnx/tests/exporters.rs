//! One small CNN as PyTorch's two ONNX exporters write it (`integration/onnx/exporters`, made by
//! its `export_exporters.py`): each imports, the import's summary says what it holds, a graph
//! whose BatchNorm the exporter folded away is warned about with how to keep it, and weights in
//! an external data file are read from beside the model, and only from there.

use legion_onnx::proto::ModelProto;
use legion_onnx::{Imported, load};
use legion_ops::checkpoint;
use legion_ops::op::{Op, PoolKind};
use prost::Message;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../integration/onnx/exporters")
        .join(name)
}

fn weights(imported: &Imported) -> BTreeMap<String, Vec<f32>> {
    let ckpt = imported
        .weights
        .as_ref()
        .expect("the exports carry weights");
    ckpt.tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.clone()))
        .collect()
}

#[test]
fn a_batch_norm_preserving_export_keeps_the_modules_names_and_weights() {
    let imported = load(&fixture("torchscript_preserve.onnx")).unwrap();
    let s = &imported.summary;
    assert_eq!(s.batch_norms(), 2, "{s}");
    assert_eq!(s.parameters, 365, "torch's parameter count");
    assert!(s.has_weights && s.warnings.is_empty(), "{s}");
    assert_eq!(s.op_counts["Conv"], 2, "{s}");
    let text = s.to_string();
    assert!(
        text.starts_with("imported ") && text.contains("torchscript_preserve.onnx: 12 nodes ("),
        "{text}"
    );
    assert!(
        text.contains("as 11 layers, 2 BatchNorm, 365 parameters"),
        "{text}"
    );
    // the module's state_dict, as torch wrote it: every tensor under its own name, its BatchNorm
    // step counters (I64) named and skipped
    let state = checkpoint::load(&fixture("state_dict.safetensors")).unwrap();
    assert_eq!(
        state.skipped,
        ["bn1.num_batches_tracked", "bn2.num_batches_tracked"]
    );
    let from_torch: BTreeMap<String, Vec<f32>> = state
        .tensors
        .into_iter()
        .map(|t| (t.name, t.data))
        .collect();
    assert_eq!(weights(&imported), from_torch);
}

#[test]
fn a_folded_batch_norm_is_warned_about_by_either_exporter() {
    for file in ["torchscript_folded.onnx", "dynamo.onnx"] {
        let imported = load(&fixture(file)).unwrap();
        let s = &imported.summary;
        assert_eq!(s.batch_norms(), 0, "{file}");
        assert_eq!(s.parameters, 349, "{file}: no BatchNorm parameters left");
        let [warning] = &s.warnings[..] else {
            panic!("{file}: {:?}", s.warnings)
        };
        let (made, fix) = match file {
            "dynamo.onnx" => ("reads 'conv1.weight', 'conv1.weight_bias'", "dynamo=False"),
            _ => ("reads 'onnx::Conv_", "dynamo=False"),
        };
        assert!(
            warning.starts_with(
                "2 of the 2 Conv nodes read a weight or bias that is no module's parameter, or no bias"
            ) && warning.contains(made)
                && warning.contains("BatchNorm folded into the convolutions")
                && warning.contains(fix)
                && warning.contains("training=torch.onnx.TrainingMode.PRESERVE"),
            "{file}: {warning}"
        );
        assert!(
            s.to_string().contains(&format!("\nwarning: {warning}")),
            "{file}"
        );
    }
}

#[test]
fn the_dynamo_exporters_files_import_with_their_weights_inside_or_beside_them() {
    let inside = load(&fixture("dynamo.onnx")).unwrap();
    let beside = load(&fixture("dynamo_external.onnx")).unwrap();
    assert_eq!(inside.graph.layers().len(), beside.graph.layers().len());
    for (a, b) in inside.graph.layers().iter().zip(beside.graph.layers()) {
        assert_eq!(a.op, b.op);
        assert_eq!(a.shape, b.shape);
    }
    assert_eq!(weights(&inside), weights(&beside));
    // ReduceMean over H and W, kept dims then reshaped: a global average pool and a flatten
    let pools: Vec<_> = inside
        .graph
        .layers()
        .iter()
        .filter_map(|l| match &l.op {
            Op::Pool2d(p) => Some(p.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(pools.len(), 2, "the ceil_mode max pool and the mean");
    assert!(pools[0].ceil_mode && pools[0].kind == PoolKind::Max);
    assert_eq!(pools[1].kind, PoolKind::Avg);
    // from bytes alone, the external file cannot be found: the error says what to do
    let bytes = std::fs::read(fixture("dynamo_external.onnx")).unwrap();
    let e = legion_onnx::import(&bytes, "m", "m.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "its data is in the external file 'dynamo_external.onnx.data'; load the model \
             from its file"
        ),
        "{e}"
    );
}

/// The external export with its first external tensor's `key` set to `value`, written beside a
/// copy of its data file; the import's error.
fn external_refusal(key: &str, value: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let data = "dynamo_external.onnx.data";
    std::fs::copy(fixture(data), dir.path().join(data)).unwrap();
    let mut model =
        ModelProto::decode(&std::fs::read(fixture("dynamo_external.onnx")).unwrap()[..]).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let tensor = graph
        .initializer
        .iter_mut()
        .find(|t| !t.external_data.is_empty())
        .expect("an external tensor");
    let entry = tensor
        .external_data
        .iter_mut()
        .find(|e| e.key.as_deref() == Some(key))
        .expect("the key");
    entry.value = Some(value.into());
    let path = dir.path().join("m.onnx");
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    load(&path).unwrap_err().to_string()
}

#[test]
fn external_data_is_read_only_from_inside_the_models_folder_and_within_its_file() {
    let e = external_refusal("location", "../dynamo_external.onnx.data");
    assert!(
        e.contains(
            "external data location '../dynamo_external.onnx.data' must be a plain path \
             inside the model's folder"
        ),
        "{e}"
    );
    let e = external_refusal("location", "/etc/passwd");
    assert!(e.contains("must be a plain path inside"), "{e}");
    let e = external_refusal("offset", "1000000");
    assert!(
        e.contains("bytes from offset 1000000, runs past the end of") && e.contains("(1152 bytes)"),
        "{e}"
    );
    let e = external_refusal("offset", "-4");
    assert!(
        e.contains("external data offset '-4' is not a byte count"),
        "{e}"
    );
    let e = external_refusal("location", "missing.data");
    assert!(
        e.contains("initializer '") && e.contains("reading its external data"),
        "{e}"
    );
}

#[test]
fn tensors_the_exporter_shares_keep_each_parameters_name() {
    // a fresh module's BatchNorm tensors of equal values are one initializer, renamed through
    // Identity nodes: each layer is still named after its module
    let imported = load(&fixture("torchscript_fresh.onnx")).unwrap();
    let names: Vec<String> = weights(&imported).into_keys().collect();
    let bn: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with("bn"))
        .collect();
    assert_eq!(
        bn,
        [
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
            "bn1.weight",
            "bn2.bias",
            "bn2.running_mean",
            "bn2.running_var",
            "bn2.weight"
        ]
    );
    assert_eq!(imported.summary.parameters, 365);
}
