//! `--model FILE.onnx` through the binary: torchvision's graph-only exports against the zoo
//! (parameters, FLOPs, tensor names, `plan --json`) and beyond it, training from an ONNX file's
//! initializers, `export`, and refusals.

mod common;

use common::{assert_clean_failure, legion, ok};
use legion_ops::op::Op;
use legion_ops::{Graph, GraphBuilder, LayerId, zoo};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

fn onnx_file(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../integration/onnx/{model}.onnx"))
}

/// `legion-rs plan --json` of `model` without what names it (the model's and layers' names) and
/// the search's wall time: what is planned, priced and simulated.
fn plan(model: &str) -> serde_json::Value {
    let out = ok(legion(&[
        "plan",
        "--model",
        model,
        "--batch",
        "64",
        "--machine",
        "paper:4",
        "--json",
    ]));
    let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_object_mut().unwrap().remove("model");
    for search in v["searches"].as_array_mut().unwrap() {
        search.as_object_mut().unwrap().remove("search_ms");
        for layer in search["strategy"].as_array_mut().unwrap() {
            layer.as_object_mut().unwrap().remove("layer");
        }
        for layer in search["eq1_parts"]["layers"].as_array_mut().unwrap() {
            layer.as_object_mut().unwrap().remove("layer");
        }
    }
    v
}

/// `zoo` in the form torchvision's export has, where it differs without changing a parameter or
/// a FLOP: PyTorch's exporter merges a concat of concats over the same axis into one Concat
/// (Inception-E's 1×3/3×1 forks), and with `dropout_first` a dropout right after a flatten moves
/// before it (torchvision's Inception applies dropout before flatten, the zoo's after).
fn as_exported(zoo: &Graph, dropout_first: bool) -> Graph {
    let sole_consumer = |id: LayerId| match zoo.consumers(id)[..] {
        [c] => Some(c),
        _ => None,
    };
    let is = |id: LayerId, f: fn(&Op) -> bool| f(&zoo.layer(id).op);
    let merged = |id: LayerId| {
        is(id, |op| matches!(op, Op::Concat(_)))
            && sole_consumer(id).is_some_and(|c| is(c, |op| matches!(op, Op::Concat(_))))
    };
    let mut b = GraphBuilder::new(&zoo.name);
    let mut map: HashMap<LayerId, Vec<LayerId>> = HashMap::new();
    for id in zoo.ids() {
        let layer = zoo.layer(id);
        let inputs: Vec<LayerId> = layer.inputs.iter().flat_map(|i| map[i].clone()).collect();
        if merged(id) {
            map.insert(id, inputs);
            continue;
        }
        if map.contains_key(&id) {
            continue; // a dropout moved before its flatten
        }
        if let (Op::Flatten(_), Some(d)) = (&layer.op, sole_consumer(id))
            && dropout_first
            && is(d, |op| matches!(op, Op::Dropout(_)))
        {
            let dropped = zoo.layer(d);
            let dropout = b.layer(&dropped.name, dropped.op.clone(), &inputs).unwrap();
            let flat = b.layer(&layer.name, layer.op.clone(), &[dropout]).unwrap();
            map.insert(id, vec![flat]);
            map.insert(d, vec![flat]);
            continue;
        }
        let new = b.layer(&layer.name, layer.op.clone(), &inputs).unwrap();
        map.insert(id, vec![new]);
    }
    b.finish()
}

/// The zoo's models that torchvision exports are in `integration/onnx`.
const EXPORTED_ZOO_MODELS: [&str; 10] = [
    "alexnet",
    "vgg16",
    "inception_v3",
    "resnet18",
    "resnet50",
    "resnext50_32x4d",
    "mobilenet_v2",
    "efficientnet_b0",
    "densenet121",
    "squeezenet1_0",
];

/// Zoo models under the papers' layer names (`conv1` … `fc8`, VGG's `conv1_1` …), which strategy
/// files, tests and documents name, where torchvision's are `features.0` … `classifier.6`.
const PAPER_NAMED: [&str; 2] = ["alexnet", "vgg16"];

/// That `import` has `zoo`'s parameter and buffer tensors: the same names (torchvision's
/// `state_dict` keys, as the export names its inputs) or, for the [`PAPER_NAMED`], the same
/// suffixes and shapes in the same order.
fn assert_same_tensors(name: &str, import: &Graph, zoo: &Graph) {
    if PAPER_NAMED.contains(&name) {
        let tensors = |g: &Graph| {
            g.params()
                .into_iter()
                .map(|p| (p.spec.suffix, p.spec.shape))
                .collect::<Vec<_>>()
        };
        assert_eq!(tensors(import), tensors(zoo), "{name}: tensors in order");
        return;
    }
    let names = |g: &Graph| {
        g.params()
            .into_iter()
            .map(|p| p.name)
            .collect::<BTreeSet<_>>()
    };
    let (import, zoo) = (names(import), names(zoo));
    assert_eq!(
        (
            import.difference(&zoo).collect::<Vec<_>>(),
            zoo.difference(&import).collect::<Vec<_>>()
        ),
        (vec![], vec![]),
        "{name}: tensors only the import has, only the zoo has"
    );
}

#[test]
fn torchvision_exports_import_with_the_zoos_parameters_flops_tensor_names_and_plan() {
    let dir = tempfile::tempdir().unwrap();
    for name in EXPORTED_ZOO_MODELS {
        let file = onnx_file(name);
        let imported = legion_onnx::load(&file).unwrap();
        assert!(imported.weights.is_none(), "{name}: a graph-only export");
        let graph = imported.graph.with_batch(64).unwrap();
        let z = zoo::find(name).unwrap();
        let zoo_graph = z.build(&z.default_config(64)).unwrap();
        assert_eq!(graph.param_count(), zoo_graph.param_count(), "{name}");
        assert_eq!(graph.flops(), zoo_graph.flops(), "{name}");
        assert_same_tensors(name, &graph, &zoo_graph);
        // the zoo model of the export's shapes: the zoo's itself, but for Inception-v3
        let twin = as_exported(&zoo_graph, name == "inception_v3");
        let zoo_model = if twin.layers().len() == zoo_graph.layers().len()
            && twin
                .layers()
                .iter()
                .zip(zoo_graph.layers())
                .all(|(a, b)| a.op == b.op)
        {
            name.to_string()
        } else {
            assert_eq!(name, "inception_v3", "only Inception-v3 differs in form");
            assert_eq!(
                zoo_graph.layers().len() - twin.layers().len(),
                4,
                "two merged concats in each of Mixed_7b and Mixed_7c"
            );
            assert_eq!(twin.param_count(), zoo_graph.param_count());
            assert_eq!(twin.flops(), zoo_graph.flops());
            let path = dir.path().join(format!("{name}.json"));
            std::fs::write(&path, twin.to_json()).unwrap();
            path.display().to_string()
        };
        let ops = |g: &Graph| g.layers().iter().map(|l| l.op.clone()).collect::<Vec<_>>();
        let expected = Graph::from_json(&twin.to_json(), "twin").unwrap();
        assert_eq!(
            ops(&graph),
            ops(&expected),
            "{name}: the same layers in the same order"
        );
        assert_eq!(plan(file.to_str().unwrap()), plan(&zoo_model), "{name}");
        println!(
            "{name}: {} layers, {} parameters, {} FLOPs a step at batch 64: as {zoo_model}",
            graph.layers().len(),
            graph.param_count(),
            graph.flops().forward + graph.flops().backward
        );
    }
}

/// torchvision's models the zoo does not hold import with torchvision's parameter counts:
/// GoogLeNet without its auxiliary classifiers, and RegNet-Y-400MF (squeeze-and-excitation,
/// grouped convolutions).
#[test]
fn torchvision_exports_beyond_the_zoo_import_with_torchvisions_parameter_counts() {
    for (name, params) in [("googlenet", 6_624_904), ("regnet_y_400mf", 4_344_144)] {
        let imported = legion_onnx::load(&onnx_file(name)).unwrap();
        assert!(imported.weights.is_none(), "{name}: a graph-only export");
        assert_eq!(imported.graph.param_count(), params, "{name}");
    }
}

#[test]
fn training_starts_from_the_initializers_and_export_writes_what_was_trained() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    std::fs::write(
        path("tiny.json"),
        r#"{"name": "tiny", "layers": [
          {"name": "data", "op": "input", "shape": [4, 3, 16, 16]},
          {"name": "conv1", "op": "conv2d", "inputs": ["data"], "out_channels": 8, "kernel": [3, 3],
           "padding": [1, 1], "activation": "relu"},
          {"name": "bn1", "op": "batch_norm", "inputs": ["conv1"], "relu": true},
          {"name": "pool1", "op": "pool2d", "inputs": ["bn1"], "kind": "max", "kernel": [2, 2], "stride": [2, 2]},
          {"name": "flatten", "op": "flatten", "inputs": ["pool1"]},
          {"name": "drop", "op": "dropout", "inputs": ["flatten"], "rate": 0.25},
          {"name": "fc", "op": "dense", "inputs": ["drop"], "out_features": 10},
          {"name": "loss", "op": "softmax_cross_entropy", "inputs": ["fc"]}
        ]}"#,
    )
    .unwrap();
    let model = ["--batch", "4", "--device", "cpu", "--lr", "0.05"];
    // weights after a few steps, so that they are not the seeded ones the ONNX run would also get
    let json = path("tiny.json");
    let mut args = vec!["train", "--model", &json];
    let (trained, onnx) = (path("trained.safetensors"), path("tiny.onnx"));
    args.extend(model);
    args.extend(["--steps", "3", "--save", &trained]);
    ok(legion(&args));
    let out = ok(legion(&[
        "export", "--onnx", &onnx, "--model", &json, "--init", &trained,
    ]));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("tiny.onnx: model 'tiny', 8 layers") && said.contains("from the weights of"),
        "{said}"
    );

    // two more steps from the ONNX file's initializers, and from the JSON model and the checkpoint
    let (a, b) = (path("a.safetensors"), path("b.safetensors"));
    let mut from_onnx = vec!["train", "--model", &onnx, "--steps", "2", "--save", &a];
    from_onnx.extend(model);
    ok(legion(&from_onnx));
    let mut from_json = vec!["train", "--model", &json, "--init", &trained];
    from_json.extend(["--steps", "2", "--save", &b]);
    from_json.extend(model);
    ok(legion(&from_json));
    let (a, b) = (
        legion_ops::checkpoint::load(Path::new(&a)).unwrap(),
        legion_ops::checkpoint::load(Path::new(&b)).unwrap(),
    );
    assert_eq!(a.tensors, b.tensors, "the same weights, bit for bit");

    // --save writes the weights back under the file's names
    let imported = legion_onnx::load(Path::new(&onnx)).unwrap();
    let mut names: Vec<_> = imported
        .weights
        .unwrap()
        .tensors
        .into_iter()
        .map(|t| t.name)
        .collect();
    let mut saved: Vec<_> = a
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| !n.starts_with("momentum/"))
        .collect();
    names.sort();
    saved.sort();
    assert_eq!(names, saved);
}

#[test]
fn onnx_refusals_exit_with_the_file_and_node() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.onnx");
    let mut bytes = std::fs::read(onnx_file("alexnet")).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&bad, &bytes).unwrap();
    let out = legion(&[
        "plan",
        "--model",
        bad.to_str().unwrap(),
        "--machine",
        "paper:4",
    ]);
    assert_clean_failure(&out, &["bad.onnx: protobuf: not a valid ONNX model file"]);

    let file = onnx_file("alexnet");
    let out = legion(&[
        "train",
        "--model",
        file.to_str().unwrap(),
        "--image-size",
        "64",
    ]);
    assert_clean_failure(&out, &["a JSON or ONNX model fixes its own shapes"]);

    let out = legion(&[
        "export",
        "--onnx",
        dir.path().join("no/such/x.onnx").to_str().unwrap(),
        "--model",
        "lenet5",
    ]);
    assert_clean_failure(&out, &["--onnx", "does not exist"]);
}
