//! ONNX import against the JSON model it should equal, export round trips, refusals and hostile
//! bytes.

mod support;

use legion_onnx::{Imported, import};
use legion_ops::checkpoint::{self, NamedTensor};
use legion_ops::train::{ParamStore, Sgd, Trainer};
use legion_ops::{Graph, Shape};
use proptest::prelude::*;
use std::collections::BTreeMap;
use support::{OnnxModel, SMALL_JSON, float, int, ints, small_model, small_weights};

fn import_small(bytes: &[u8]) -> Imported {
    import(bytes, "small", "small.onnx").unwrap_or_else(|e| panic!("{e}"))
}

/// The small model's weights in the graph's layout (fc2's transposed to `[out, in]`).
fn graph_layout_weights() -> Vec<NamedTensor> {
    small_weights()
        .into_iter()
        .map(|(name, dims, v)| {
            let dims: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
            if name == "fc2.weight" {
                let (rows, cols) = (dims[0], dims[1]);
                let t = (0..rows * cols)
                    .map(|i| v[(i % rows) * cols + i / rows])
                    .collect();
                NamedTensor::new(name, Shape::new(&[cols, rows]), t)
            } else {
                NamedTensor::new(name, Shape::new(&dims), v)
            }
        })
        .collect()
}

fn by_name(tensors: &[NamedTensor]) -> BTreeMap<&str, &NamedTensor> {
    tensors.iter().map(|t| (t.name.as_str(), t)).collect()
}

#[test]
fn one_training_step_from_the_initializers_equals_the_json_models_from_the_same_safetensors() {
    let batch = 4;
    let imported = import_small(&small_model().bytes());
    let onnx_graph = imported.graph.with_batch(batch).unwrap();
    let json_graph = Graph::from_json(SMALL_JSON, "small.json")
        .unwrap()
        .with_batch(batch)
        .unwrap();
    assert_eq!(
        onnx_graph, json_graph,
        "the import is the JSON model's graph"
    );

    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init.safetensors");
    let tensors = graph_layout_weights();
    let views: Vec<_> = tensors.iter().map(NamedTensor::view).collect();
    checkpoint::save(&init, &views, &BTreeMap::new()).unwrap();
    let json_params =
        ParamStore::from_checkpoint(&json_graph, checkpoint::load(&init).unwrap()).unwrap();
    let onnx_params =
        ParamStore::from_checkpoint(&onnx_graph, imported.weights.expect("weights")).unwrap();
    assert_eq!(onnx_params.values, json_params.values);

    let images = support::values(batch * 3 * 8 * 8, 99);
    let labels = [0, 3, 1, 4];
    let step = |graph: Graph, params: ParamStore| {
        let mut t = Trainer::new(graph, params, Sgd::default(), 7);
        let stats = t.step(&images, &labels).unwrap();
        (stats.loss, t.params().unwrap().values)
    };
    let (onnx_loss, onnx_after) = step(onnx_graph, onnx_params);
    let (json_loss, json_after) = step(json_graph, json_params);
    assert_eq!(onnx_loss.to_bits(), json_loss.to_bits());
    assert_eq!(onnx_after, json_after);
    assert_ne!(
        onnx_after,
        ParamStore::init(&Graph::from_json(SMALL_JSON, "s").unwrap(), 7).values
    );
}

#[test]
fn initializers_keep_their_names_and_a_graph_only_file_has_no_weights() {
    let imported = import_small(&small_model().bytes());
    let weights = imported.weights.unwrap();
    let expected = graph_layout_weights();
    assert_eq!(by_name(&weights.tensors), by_name(&expected));

    // the same graph with every weight a graph input of its shape (export_params=False)
    let mut m = small_model();
    let shapes: Vec<_> = m
        .graph
        .initializer
        .drain(..)
        .filter(|t| t.name.as_deref() != Some("/drop/ratio"))
        .collect();
    m.initializer("/drop/ratio", &[], &[0.25]);
    for t in &shapes {
        let dims: Vec<Option<i64>> = t.dims.iter().map(|&d| Some(d)).collect();
        m.input(t.name.as_deref().unwrap(), &dims);
    }
    let graph_only = import_small(&m.bytes());
    assert_eq!(graph_only.graph, imported.graph);
    assert!(graph_only.weights.is_none());
}

#[test]
fn import_export_import_gives_the_same_graph_and_weights() {
    let first = import_small(&small_model().bytes());
    let params = ParamStore::from_checkpoint(&first.graph, first.weights.clone().unwrap()).unwrap();
    let bytes = legion_onnx::export(&first.graph, &params).unwrap();
    let second = import_small(&bytes);
    assert_eq!(second.graph, first.graph);
    let (a, b) = (first.weights.unwrap(), second.weights.unwrap());
    assert_eq!(by_name(&a.tensors), by_name(&b.tensors));

    // graph-only torchvision exports, with the seeded weights
    for model in ["alexnet", "resnet50", "inception_v3"] {
        let path = format!(
            "{}/../../integration/onnx/{model}.onnx",
            env!("CARGO_MANIFEST_DIR")
        );
        let graph = legion_onnx::load(path.as_ref()).unwrap().graph;
        let params = ParamStore::init(&graph, 3);
        let again = import(&legion_onnx::export(&graph, &params).unwrap(), model, model).unwrap();
        assert_eq!(again.graph, graph, "{model}");
        let back = ParamStore::from_checkpoint(&graph, again.weights.unwrap()).unwrap();
        assert_eq!(back.values, params.values, "{model}");
    }

    // the zoo's models of depthwise convolutions, ReLU6, SiLU and channel scales
    for model in ["mobilenet_v2", "efficientnet_b0"] {
        let zoo = legion_ops::zoo::find(model).unwrap();
        // 64 pixels: the last feature map 2×2, whose average the import keeps (a 1×1 one's is
        // the identity, and dropped)
        let config = legion_ops::zoo::ZooConfig {
            image_size: 64,
            ..zoo.default_config(1)
        };
        let graph = zoo.build(&config).unwrap();
        let params = ParamStore::init(&graph, 3);
        let again = import(&legion_onnx::export(&graph, &params).unwrap(), model, model).unwrap();
        assert_eq!(again.graph, graph, "{model}");
        let back = ParamStore::from_checkpoint(&graph, again.weights.unwrap()).unwrap();
        assert_eq!(back.values, params.values, "{model}");
    }
}

#[test]
fn export_is_written_atomically_and_reads_back() {
    let first = import_small(&small_model().bytes());
    let params = ParamStore::from_checkpoint(&first.graph, first.weights.unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.onnx");
    legion_onnx::save(&path, &first.graph, &params).unwrap();
    assert_eq!(legion_onnx::load(&path).unwrap().graph, first.graph);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["small.onnx"], "no temporary file is left");
    let e = legion_onnx::save(
        &dir.path().join("no/such/dir/x.onnx"),
        &first.graph,
        &params,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no/such/dir/x.onnx: writing:"), "{e}");
}

/// The error of importing `small_model` after `change`.
#[track_caller]
fn refusal(change: impl FnOnce(&mut OnnxModel)) -> String {
    let mut m = small_model();
    change(&mut m);
    match import(&m.bytes(), "small", "small.onnx") {
        Ok(_) => panic!("the changed model imported"),
        Err(e) => e.to_string(),
    }
}

fn node<'m>(m: &'m mut OnnxModel, name: &str) -> &'m mut legion_onnx::proto::NodeProto {
    m.graph
        .node
        .iter_mut()
        .find(|n| n.name.as_deref() == Some(name))
        .unwrap()
}

#[test]
fn refusals_name_the_node_its_op_and_what_is_supported() {
    let e = refusal(|m| node(m, "relu").op_type = Some("Elu".into()));
    assert!(
        e.starts_with(
            "small.onnx: node 6 'relu' (Elu): op 'Elu' is not supported; supported: Conv, Gemm"
        ),
        "{e}"
    );
    assert!(
        e.ends_with("Hardsigmoid are supported: use one of those."),
        "{e}"
    );

    let e = refusal(|m| {
        node(m, "/conv1/Conv")
            .attribute
            .push(ints("dilations", &[2, 2]))
    });
    assert!(
        e.starts_with(
            "small.onnx: node 0 '/conv1/Conv' (Conv): dilations [2, 2] are not supported"
        ),
        "{e}"
    );

    let e = refusal(|m| node(m, "/conv1/Conv").attribute.push(int("bogus", 1)));
    assert!(
        e.contains(
            "(Conv): attribute 'bogus' is not supported; supported: auto_pad, dilations, group"
        ),
        "{e}"
    );

    let e = refusal(|m| {
        *node(m, "/conv1/Conv")
            .attribute
            .iter_mut()
            .find(|a| a.name.as_deref() == Some("pads"))
            .unwrap() = ints("pads", &[0, 0, 1, 1])
    });
    assert!(
        e.contains("(Conv): pads [0, 0, 1, 1] pad the two sides of an axis differently"),
        "{e}"
    );

    // 3×3 windows of stride 2 over 8: 3 with floor rounding, 4 with ceil (SqueezeNet's pools)
    let mut m = small_model();
    node(&mut m, "pool").attribute = vec![
        ints("kernel_shape", &[3, 3]),
        ints("strides", &[2, 2]),
        int("ceil_mode", 1),
    ];
    let imported = import(&m.bytes(), "small", "small.onnx").expect("ceil_mode imports");
    let pool = imported
        .graph
        .layer(imported.graph.find("pool").expect("the pool layer"));
    let legion_ops::op::Op::Pool2d(p) = &pool.op else {
        panic!("{:?}", pool.op)
    };
    assert!(p.ceil_mode);
    assert_eq!(pool.shape.dim(2), 4, "{}", pool.shape);
    let e = refusal(|m| node(m, "pool").attribute.push(int("ceil_mode", 2)));
    assert!(
        e.contains("'pool' (MaxPool): ceil_mode 2 is not 0 or 1"),
        "{e}"
    );

    let e =
        refusal(|m| *node(m, "avg").attribute.last_mut().unwrap() = int("count_include_pad", 0));
    assert!(
        e.contains("'avg' (AveragePool): count_include_pad 0 with padding is not supported"),
        "{e}"
    );

    let e = refusal(|m| node(m, "cat").attribute = vec![int("axis", 2)]);
    assert!(
        e.contains("'cat' (Concat): axis 2 over inputs of rank 4: only the channel axis"),
        "{e}"
    );

    let e = refusal(|m| node(m, "/fc1/Gemm").attribute.push(int("transA", 1)));
    assert!(
        e.contains("'/fc1/Gemm' (Gemm): transA 1 is not supported"),
        "{e}"
    );

    let e = refusal(|m| node(m, "/fc1/Gemm").domain = Some("com.microsoft".into()));
    assert!(
        e.contains("(Gemm): domain 'com.microsoft' is not supported"),
        "{e}"
    );

    let e = refusal(|m| m.node("Relu", "reads_mask", &["mask"], &["x"], vec![]));
    assert!(
        e.contains(
            "'drop' (Dropout): output 'mask' (the mask) is read; only the first output is supported"
        ),
        "{e}"
    );

    let e = refusal(|m| {
        m.graph.input[0] = support::value_info("data", &[None, Some(3), None, Some(8)]);
    });
    assert_eq!(
        e,
        "small.onnx: graph input 'data': dimension 2 is dynamic ('batch'); only the batch \
         (dimension 0) may be: export with a fixed image size"
    );

    let e = refusal(|m| {
        m.graph
            .node
            .retain(|n| n.name.as_deref() != Some("/branch/Conv"))
    });
    assert!(e.contains("'add' (Add): input 'bc' is neither a graph input, an initializer nor an earlier node's output"), "{e}");

    let e = refusal(|m| m.graph.initializer[0].dims = vec![4, 3, 5, 3]);
    assert!(
        e.contains("(Conv): kernel_shape [3, 3] differs from the weight's [5, 3]")
            || e.contains("conv1.weight"),
        "{e}"
    );

    let e = refusal(|m| {
        m.graph.initializer[0]
            .raw_data
            .as_mut()
            .unwrap()
            .pop()
            .map(drop)
            .unwrap()
    });
    assert!(e.starts_with("small.onnx: initializer 'conv1.weight': holds 431 raw bytes; its shape needs 108 values of 4 bytes"), "{e}");

    let e = refusal(|m| {
        m.graph.node.pop();
        m.graph.output[0] = support::value_info("logits", &[None, Some(5)]);
        m.node(
            "Softmax",
            "prob",
            &["logits"],
            &["prob"],
            vec![int("axis", 1)],
        );
        m.node("Relu", "after", &["prob"], &["out"], vec![]);
        m.graph.output[0] = support::value_info("out", &[None, Some(5)]);
    });
    assert!(
        e.contains("'prob' (Softmax): Softmax is supported only as the model's output"),
        "{e}"
    );

    let e = refusal(|m| m.output("c1", &[None, Some(4), Some(8), Some(8)]));
    assert!(
        e.contains("graph: the graph has 2 outputs; a model to train has one, its logits"),
        "{e}"
    );

    let e = refusal(|m| m.opset = 6);
    assert!(
        e.contains("opset_import: operator set 6 is older than the oldest supported, 7"),
        "{e}"
    );

    // some weights with values and others with a shape alone
    let e = refusal(|m| {
        let t = m.graph.initializer.remove(0);
        m.input(
            t.name.as_deref().unwrap(),
            &[Some(4), Some(3), Some(3), Some(3)],
        );
    });
    assert!(
        e.contains(
            "initializers: 10 weight(s) have values and 1 have only a shape (e.g. 'conv1.weight')"
        ),
        "{e}"
    );

    let e = refusal(|m| m.graph.initializer[1].dims = vec![1, 4]);
    assert!(
        e.contains("(Conv): bias 'conv1.bias' has shape [1, 4]; expected [4]"),
        "{e}"
    );

    // Gemm's bias may be [1, out] (it broadcasts); the layer's is [out]
    let mut m = small_model();
    m.graph.initializer[8].dims = vec![1, 16];
    let imported = import(&m.bytes(), "small", "small.onnx").unwrap();
    let bias = imported.weights.as_ref().unwrap().get("fc1.bias").unwrap();
    assert_eq!(bias.shape, Shape::new(&[16]));
    ParamStore::from_checkpoint(&imported.graph, imported.weights.unwrap()).unwrap();

    // a Relu reading a layer that something else reads too stays a layer of its own
    let mut m = small_model();
    m.node("Relu", "extra", &["c1"], &["unused"], vec![]);
    let g = import(&m.bytes(), "small", "small.onnx").unwrap().graph;
    assert!(g.find("/relu1/Relu").is_some() && g.find("extra").is_some());
}

#[test]
fn malformed_files_get_a_located_error() {
    let bytes = small_model().bytes();
    let e = import(&bytes[..bytes.len() / 2], "small", "small.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("small.onnx: protobuf: not a valid ONNX model file: "),
        "{e}"
    );
    assert!(
        e.contains("ModelProto.graph"),
        "the error names the message it failed in: {e}"
    );
    let e = import(b"not a model", "m", "m.onnx")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("m.onnx: protobuf: "), "{e}");
    let e = import(&[], "m", "m.onnx").unwrap_err().to_string();
    assert!(e.contains("opset_import"), "{e}");
    let e = legion_onnx::load("/no/such/file.onnx".as_ref())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("/no/such/file.onnx: reading: "), "{e}");
    let _ = float("unused", 0.0);
}

/// Every file the tests know, as bytes to mutate: the small model and torchvision's exports.
fn seeds() -> Vec<Vec<u8>> {
    let dir = format!("{}/../../integration/onnx", env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![small_model().bytes()];
    for model in ["alexnet", "resnet50"] {
        files.push(std::fs::read(format!("{dir}/{model}.onnx")).unwrap());
    }
    files
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Hostile bytes: flipped, overwritten, inserted and cut bytes of valid files import or fail
    /// with an error, never a panic (the decoder's limits and the mapping's checked sizes).
    #[test]
    fn mutated_files_never_panic(
        seed in 0usize..3,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..12),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = seeds().swap_remove(seed);
        for (at, byte, kind) in edits {
            let i = at.index(bytes.len());
            match kind {
                0 => bytes[i] ^= byte | 1,
                1 => bytes[i] = byte,
                2 => bytes.insert(i, byte),
                _ => { bytes.remove(i); }
            }
        }
        let _ = import(&bytes, "m", "m.onnx");
        let end = cut.index(bytes.len() + 1);
        let _ = import(&bytes[..end], "m", "m.onnx");
    }
}

/// The small model with its ReLU `relu` (reading `sum`, writing `rs`) replaced by the nodes
/// `change` appends, moved to where the ReLU was.
fn with_activation(change: impl FnOnce(&mut OnnxModel)) -> OnnxModel {
    let mut m = small_model();
    let at = m
        .graph
        .node
        .iter()
        .position(|n| n.name.as_deref() == Some("relu"))
        .unwrap();
    m.graph.node.remove(at);
    let before = m.graph.node.len();
    change(&mut m);
    let appended: Vec<_> = m.graph.node.drain(before..).collect();
    m.graph.node.splice(at..at, appended);
    m
}

fn layer_op(m: &OnnxModel, layer: &str) -> legion_ops::op::Op {
    let imported = import_small(&m.bytes());
    let graph = imported.graph;
    let found = graph.layers().iter().find(|l| l.name == layer);
    found
        .unwrap_or_else(|| panic!("no layer {layer}"))
        .op
        .clone()
}

#[test]
fn relu6_leaky_relu_hardsigmoid_silu_and_channel_scales_import() {
    use legion_ops::op::{Mul, Op, Unary, UnaryOp};
    let clip = |min: f32, max: f32| {
        with_activation(|m| {
            m.initializer("clip.min", &[], &[min]);
            m.initializer("clip.max", &[], &[max]);
            m.node(
                "Clip",
                "clip",
                &["sum", "clip.min", "clip.max"],
                &["rs"],
                vec![],
            );
        })
    };
    assert_eq!(layer_op(&clip(0.0, 6.0), "clip"), Op::unary(Unary::Relu6));
    let e = import(&clip(0.0, 3.0).bytes(), "small", "small.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'clip' (Clip): a Clip to [0, 3] is not supported; only [0, 6] (nn.ReLU6) and [0, none] (nn.ReLU) are"),
        "{e}"
    );

    let leaky = with_activation(|m| {
        m.node(
            "LeakyRelu",
            "leaky",
            &["sum"],
            &["rs"],
            vec![float("alpha", 0.2)],
        )
    });
    assert_eq!(
        layer_op(&leaky, "leaky"),
        Op::Unary(UnaryOp::with_alpha(Unary::LeakyRelu, 0.2))
    );

    let hard = |alpha: f32| {
        with_activation(|m| {
            let attrs = vec![float("alpha", alpha), float("beta", 0.5)];
            m.node("HardSigmoid", "hard", &["sum"], &["rs"], attrs)
        })
    };
    assert_eq!(
        layer_op(&hard(1.0 / 6.0), "hard"),
        Op::unary(Unary::Hardsigmoid)
    );
    let e = import(&hard(0.2).bytes(), "small", "small.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'hard' (HardSigmoid): alpha 0.2 and beta 0.5 are not supported"),
        "{e}"
    );
    assert!(e.ends_with("use nn.Hardsigmoid"), "{e}");

    // x · σ(x) as PyTorch exports nn.SiLU: one layer, named after the Mul
    let silu = with_activation(|m| {
        m.node("Sigmoid", "/act/Sigmoid", &["sum"], &["sig"], vec![]);
        m.node("Mul", "/act/Mul", &["sum", "sig"], &["rs"], vec![]);
    });
    assert_eq!(layer_op(&silu, "/act/Mul"), Op::unary(Unary::Silu));
    let graph = import_small(&silu.bytes()).graph;
    assert!(!graph.layers().iter().any(|l| l.name == "/act/Sigmoid"));

    // squeeze-and-excitation: the scale σ(mean over H, W) multiplies the channels, written
    // scale first
    let se = with_activation(|m| {
        m.node("Relu", "relu", &["sum"], &["r"], vec![]);
        m.node("GlobalAveragePool", "/se/pool", &["r"], &["g"], vec![]);
        m.node("Sigmoid", "/se/Sigmoid", &["g"], &["gs"], vec![]);
        m.node("Mul", "/se/Mul", &["gs", "r"], &["rs"], vec![]);
    });
    let graph = import_small(&se.bytes()).graph;
    let mul = graph
        .layers()
        .iter()
        .position(|l| l.name == "/se/Mul")
        .unwrap();
    let mul = graph.layer(legion_ops::LayerId(mul));
    assert_eq!(mul.op, Op::Mul(Mul {}));
    let inputs: Vec<&str> = mul
        .inputs
        .iter()
        .map(|&i| graph.layer(i).name.as_str())
        .collect();
    assert_eq!(inputs, ["relu", "/se/Sigmoid"]);

    // the same mean as the dynamo exporter writes it: ReduceMean over H and W, dims kept
    let mean = |axes: &[i64]| {
        with_activation(|m| {
            m.node("Relu", "relu", &["sum"], &["r"], vec![]);
            let attrs = vec![ints("axes", axes), int("keepdims", 1)];
            m.node("ReduceMean", "/se/mean", &["r"], &["g"], attrs);
            m.node("Sigmoid", "/se/Sigmoid", &["g"], &["gs"], vec![]);
            m.node("Mul", "/se/Mul", &["r", "gs"], &["rs"], vec![]);
        })
    };
    let by_mean = import_small(&mean(&[-1, -2]).bytes()).graph;
    let pooled = |g: &Graph, name: &str| g.layer(g.find(name).unwrap()).op.clone();
    assert_eq!(pooled(&by_mean, "/se/mean"), pooled(&graph, "/se/pool"));
    let e = import(&mean(&[1]).bytes(), "small", "small.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "'/se/mean' (ReduceMean): a mean over axes [1] of an input of shape (1, 4, 8, 8): \
             only the mean over H and W (axes 2 and 3) of an N,C,H,W input is supported"
        ),
        "{e}"
    );

    let by_constant = with_activation(|m| {
        m.initializer("two", &[], &[2.0]);
        m.node("Mul", "/twice/Mul", &["sum", "two"], &["rs"], vec![]);
    });
    let e = import(&by_constant.bytes(), "small", "small.onnx")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'/twice/Mul' (Mul): Mul by a constant is not supported"),
        "{e}"
    );
}

#[test]
fn adaptive_pools_export_as_the_onnx_pool_that_computes_them() {
    let net = |input: usize, output: [usize; 2]| {
        let mut b = legion_ops::GraphBuilder::new("adaptive");
        let x = b.input("data", Shape::nchw(2, 3, input, input)).unwrap();
        let c = b
            .conv2d("conv", x, legion_ops::op::Conv2d::new(4, 3).padding(1))
            .unwrap();
        let p = b.adaptive_avg_pool2d("pool", c, output).unwrap();
        let f = b.flatten("flat", p).unwrap();
        let d = b.dense("fc", f, legion_ops::op::Dense::new(5)).unwrap();
        b.softmax_cross_entropy("loss", d).unwrap();
        b.finish()
    };
    // 8 into 2: windows of 4 side by side, an AveragePool of kernel and stride 4
    let graph = net(8, [2, 2]);
    let params = ParamStore::init(&graph, 1);
    let again = import(
        &legion_onnx::export(&graph, &params).unwrap(),
        "a",
        "a.onnx",
    )
    .unwrap();
    let pool = again.graph.layer(again.graph.find("pool").unwrap());
    assert_eq!(
        pool.op,
        legion_ops::op::Op::Pool2d(legion_ops::op::Pool2d::avg(4))
    );
    assert_eq!(again.graph.param_count(), graph.param_count());
    // 7 into 2 overlaps: refused, naming the layer and what to do
    let graph = net(7, [2, 2]);
    let params = ParamStore::init(&graph, 1);
    let e = legion_onnx::export(&graph, &params)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "adaptive: layer 'pool' (adaptive_avg_pool2d): an average pool of 7x7 to \
             2x2 has windows of different sizes"
        ) && e.contains("export at an input size"),
        "{e}"
    );
}
