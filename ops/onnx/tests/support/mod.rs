//! ONNX models written with the schema's types, the way an exporter writes them, for the tests.

#![allow(dead_code)]

use legion_onnx::proto::tensor_proto::DataType;
use legion_onnx::proto::tensor_shape_proto::{Dimension, dimension};
use legion_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_proto, type_proto,
};
use prost::Message;

/// Builds a model node by node.
pub struct OnnxModel {
    pub graph: GraphProto,
    pub opset: i64,
}

impl OnnxModel {
    pub fn new(opset: i64) -> OnnxModel {
        OnnxModel {
            graph: GraphProto {
                name: Some("main_graph".into()),
                ..Default::default()
            },
            opset,
        }
    }

    /// A FLOAT graph input; `None` dims are symbolic (`batch`).
    pub fn input(&mut self, name: &str, dims: &[Option<i64>]) {
        self.graph.input.push(value_info(name, dims));
    }

    pub fn output(&mut self, name: &str, dims: &[Option<i64>]) {
        self.graph.output.push(value_info(name, dims));
    }

    pub fn initializer(&mut self, name: &str, dims: &[i64], values: &[f32]) {
        self.graph.initializer.push(TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(DataType::Float as i32),
            raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            ..Default::default()
        });
    }

    pub fn node(
        &mut self,
        op_type: &str,
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        attribute: Vec<AttributeProto>,
    ) {
        self.graph.node.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            name: Some(name.into()),
            op_type: Some(op_type.into()),
            attribute,
            ..Default::default()
        });
    }

    pub fn model(&self) -> ModelProto {
        ModelProto {
            ir_version: Some(8),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(self.opset),
            }],
            producer_name: Some("legion-onnx tests".into()),
            graph: Some(self.graph.clone()),
            ..Default::default()
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.model().encode_to_vec()
    }
}

pub fn value_info(name: &str, dims: &[Option<i64>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Some(v) => dimension::Value::DimValue(*v),
                None => dimension::Value::DimParam("batch".into()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(DataType::Float as i32),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    }
}

pub fn int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

pub fn float(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Float as i32),
        f: Some(v),
        ..Default::default()
    }
}

/// `n` deterministic values in [-0.5, 0.5), different for each `seed`.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The weights of [`small_model`] by name, in the file's layout (fc2's `[in, out]`).
pub fn small_weights() -> Vec<(&'static str, Vec<i64>, Vec<f32>)> {
    let w = |name, dims: Vec<i64>, seed| {
        let n = dims.iter().product::<i64>() as usize;
        (name, dims, values(n, seed))
    };
    let positive = |name, dims: Vec<i64>, seed| {
        let (name, dims, v): (&'static str, Vec<i64>, Vec<f32>) = w(name, dims, seed);
        (name, dims, v.iter().map(|x| x + 1.0).collect())
    };
    vec![
        w("conv1.weight", vec![4, 3, 3, 3], 1),
        w("conv1.bias", vec![4], 2),
        positive("bn1.weight", vec![4], 3),
        w("bn1.bias", vec![4], 4),
        w("bn1.running_mean", vec![4], 5),
        positive("bn1.running_var", vec![4], 6),
        w("branch.weight", vec![4, 4, 1, 1], 7),
        w("fc1.weight", vec![16, 128], 8),
        w("fc1.bias", vec![16], 9),
        w("fc2.weight", vec![16, 5], 10),
        w("fc2.bias", vec![5], 11),
    ]
}

/// A small CNN with weights as PyTorch's exporter writes one (opset 17): Conv and Relu, batch
/// norm and Relu, a 1×1 branch added back and concatenated, max and average pooling, Flatten,
/// Gemm and Relu, Dropout, MatMul and Add, Softmax. Its JSON twin is [`SMALL_JSON`].
pub fn small_model() -> OnnxModel {
    let mut m = OnnxModel::new(17);
    m.input("data", &[None, Some(3), Some(8), Some(8)]);
    for (name, dims, v) in small_weights() {
        m.initializer(name, &dims, &v);
    }
    m.initializer("/drop/ratio", &[], &[0.25]);
    m.node(
        "Conv",
        "/conv1/Conv",
        &["data", "conv1.weight", "conv1.bias"],
        &["c1"],
        vec![
            ints("kernel_shape", &[3, 3]),
            ints("pads", &[1, 1, 1, 1]),
            ints("strides", &[1, 1]),
        ],
    );
    m.node("Relu", "/relu1/Relu", &["c1"], &["r1"], vec![]);
    m.node(
        "BatchNormalization",
        "/bn1/BatchNormalization",
        &[
            "r1",
            "bn1.weight",
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
        ],
        &["b1"],
        vec![float("epsilon", 1e-5), float("momentum", 0.9)],
    );
    m.node("Relu", "/bn1/Relu", &["b1"], &["br"], vec![]);
    m.node(
        "Conv",
        "/branch/Conv",
        &["br", "branch.weight"],
        &["bc"],
        vec![],
    );
    m.node("Add", "add", &["br", "bc"], &["sum"], vec![]);
    m.node("Relu", "relu", &["sum"], &["rs"], vec![]);
    m.node(
        "Concat",
        "cat",
        &["rs", "br"],
        &["cat"],
        vec![int("axis", 1)],
    );
    m.node(
        "MaxPool",
        "pool",
        &["cat"],
        &["p"],
        vec![ints("kernel_shape", &[2, 2]), ints("strides", &[2, 2])],
    );
    m.node(
        "AveragePool",
        "avg",
        &["p"],
        &["a"],
        vec![
            ints("kernel_shape", &[3, 3]),
            ints("pads", &[1, 1, 1, 1]),
            int("count_include_pad", 1),
        ],
    );
    m.node("Flatten", "flat", &["a"], &["f"], vec![int("axis", 1)]);
    m.node(
        "Gemm",
        "/fc1/Gemm",
        &["f", "fc1.weight", "fc1.bias"],
        &["g"],
        vec![float("alpha", 1.0), float("beta", 1.0), int("transB", 1)],
    );
    m.node("Relu", "/fc1/Relu", &["g"], &["gr"], vec![]);
    m.node(
        "Dropout",
        "drop",
        &["gr", "/drop/ratio"],
        &["d", "mask"],
        vec![],
    );
    m.node(
        "MatMul",
        "/fc2/MatMul",
        &["d", "fc2.weight"],
        &["mm"],
        vec![],
    );
    m.node("Add", "/fc2/Add", &["mm", "fc2.bias"], &["logits"], vec![]);
    m.node(
        "Softmax",
        "prob",
        &["logits"],
        &["prob"],
        vec![int("axis", 1)],
    );
    m.output("prob", &[None, Some(5)]);
    m
}

/// [`small_model`] as a JSON model file, at batch 1.
pub const SMALL_JSON: &str = r#"{"name": "small", "layers": [
  {"name": "data", "op": "input", "shape": [1, 3, 8, 8]},
  {"name": "conv1", "op": "conv2d", "inputs": ["data"], "out_channels": 4, "kernel": [3, 3],
   "padding": [1, 1], "activation": "relu"},
  {"name": "bn1", "op": "batch_norm", "inputs": ["conv1"], "relu": true},
  {"name": "branch", "op": "conv2d", "inputs": ["bn1"], "out_channels": 4, "kernel": [1, 1],
   "bias": false},
  {"name": "add", "op": "add", "inputs": ["bn1", "branch"]},
  {"name": "relu", "op": "relu", "inputs": ["add"]},
  {"name": "cat", "op": "concat", "inputs": ["relu", "bn1"]},
  {"name": "pool", "op": "pool2d", "inputs": ["cat"], "kind": "max", "kernel": [2, 2], "stride": [2, 2]},
  {"name": "avg", "op": "pool2d", "inputs": ["pool"], "kind": "avg", "kernel": [3, 3], "stride": [1, 1],
   "padding": [1, 1]},
  {"name": "flat", "op": "flatten", "inputs": ["avg"]},
  {"name": "fc1", "op": "dense", "inputs": ["flat"], "out_features": 16, "activation": "relu"},
  {"name": "drop", "op": "dropout", "inputs": ["fc1"], "rate": 0.25},
  {"name": "fc2", "op": "dense", "inputs": ["drop"], "out_features": 5},
  {"name": "loss", "op": "softmax_cross_entropy", "inputs": ["fc2"]}
]}"#;
