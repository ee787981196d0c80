//! `Graph` → ONNX: the inference graph (every layer up to the logits; the loss is left out) with
//! its weights as initializers named as the graph names its parameters, so that importing the
//! file gives the same graph and weights back. Batch norm is written as an inference node (its
//! running statistics) and dropout as a Dropout node, which a runtime passes through.

use crate::OnnxError;
use crate::proto::tensor_proto::DataType;
use crate::proto::tensor_shape_proto::{Dimension, dimension};
use crate::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_proto, type_proto,
};
use legion_ops::op::{Activation, Op, PoolKind, Unary, UnaryOp};
use legion_ops::train::ParamStore;
use legion_ops::{Graph, LayerId, Shape};
use prost::Message;
use std::path::Path;

/// The operator set the export targets: Dropout's ratio as an input (12+), the attributes every
/// runtime of the last years reads.
const OPSET: i64 = 17;
/// IR version 8 goes with opset 17 (onnxruntime reads it from 1.12 on).
const IR_VERSION: i64 = 8;
/// The name of the data input's first dimension: the batch is left to the runtime.
const BATCH: &str = "batch";

/// The model's inference graph with `params` (in `Graph::params` order) as an ONNX file's bytes;
/// an error names a layer ONNX has no operator for (`source_name` starts it).
pub fn export(graph: &Graph, params: &ParamStore) -> Result<Vec<u8>, OnnxError> {
    model(graph, params, &graph.name).map(|m| m.encode_to_vec())
}

/// [`export`] written to `path` atomically (a temporary file beside it, renamed over it).
pub fn save(path: &Path, graph: &Graph, params: &ParamStore) -> Result<(), OnnxError> {
    let source_name = path.display().to_string();
    let bytes = model(graph, params, &source_name)?.encode_to_vec();
    legion_ops::atomic_file::write(path, &bytes).map_err(|e| OnnxError {
        source_name,
        location: "writing".into(),
        message: e.to_string(),
    })
}

fn model(graph: &Graph, params: &ParamStore, source_name: &str) -> Result<ModelProto, OnnxError> {
    let mut g = GraphProto {
        name: Some(graph.name.clone()),
        ..Default::default()
    };
    let output = graph
        .logits()
        .unwrap_or_else(|| LayerId(graph.layers().len() - 1));
    for id in graph.ids() {
        let layer = graph.layer(id);
        let name = layer.name.as_str();
        let inputs: Vec<String> = layer
            .inputs
            .iter()
            .map(|&i| graph.layer(i).name.clone())
            .collect();
        let mut weights = Vec::new();
        for (k, p) in graph.layer_params(id).iter().enumerate() {
            let tensor_name = format!("{name}.{}", p.suffix);
            g.initializer.push(float_tensor(
                &tensor_name,
                p.shape.dims(),
                params.get(id, k),
            ));
            weights.push(tensor_name);
        }
        let all_inputs = || inputs.iter().chain(&weights).cloned().collect::<Vec<_>>();
        match &layer.op {
            Op::Input(_) => g.input.push(value_info(name, &layer.shape)),
            Op::Conv2d(c) => {
                let attrs = vec![
                    ints("kernel_shape", &c.kernel),
                    ints("strides", &c.stride),
                    ints(
                        "pads",
                        &[c.padding[0], c.padding[1], c.padding[0], c.padding[1]],
                    ),
                    ints("dilations", &[1, 1]),
                    int("group", c.groups as i64),
                ];
                with_activation(&mut g, "Conv", name, all_inputs(), attrs, c.activation);
            }
            Op::Dense(d) => {
                let attrs = vec![float("alpha", 1.0), float("beta", 1.0), int("transB", 1)];
                with_activation(&mut g, "Gemm", name, all_inputs(), attrs, d.activation);
            }
            Op::BatchNorm(bn) => {
                let attrs = vec![
                    float("epsilon", bn.eps),
                    float("momentum", onnx_momentum(bn.momentum)),
                ];
                let relu = if bn.relu {
                    Activation::Relu
                } else {
                    Activation::None
                };
                with_activation(
                    &mut g,
                    "BatchNormalization",
                    name,
                    all_inputs(),
                    attrs,
                    relu,
                );
            }
            Op::Pool2d(p) => {
                let p_ = &p.padding;
                let mut attrs = vec![
                    ints("kernel_shape", &p.kernel),
                    ints("strides", &p.stride),
                    ints("pads", &[p_[0], p_[1], p_[0], p_[1]]),
                ];
                if p.ceil_mode {
                    attrs.push(int("ceil_mode", 1));
                }
                let op_type = match p.kind {
                    PoolKind::Max => "MaxPool",
                    PoolKind::Avg => {
                        attrs.push(int("count_include_pad", 1));
                        "AveragePool"
                    }
                };
                g.node.push(node(op_type, name, inputs, name, attrs));
            }
            Op::AdaptiveAvgPool2d(a) => {
                let input = graph.layer(layer.inputs[0]).shape;
                let (op_type, attrs) = adaptive_as_pool(a, input).map_err(|message| OnnxError {
                    source_name: source_name.to_string(),
                    location: format!("layer '{name}' (adaptive_avg_pool2d)"),
                    message,
                })?;
                g.node.push(node(op_type, name, inputs, name, attrs));
            }
            Op::Relu(_) => g.node.push(node("Relu", name, inputs, name, vec![])),
            Op::Unary(u) => unary(&mut g, u, name, inputs),
            Op::Flatten(_) => {
                g.node
                    .push(node("Flatten", name, inputs, name, vec![int("axis", 1)]))
            }
            Op::Concat(_) => g
                .node
                .push(node("Concat", name, inputs, name, vec![int("axis", 1)])),
            Op::Add(_) => g.node.push(node("Add", name, inputs, name, vec![])),
            // ONNX's Mul broadcasts a [N, C, 1, 1] factor over H and W as legion-rs's does
            Op::Mul(_) => g.node.push(node("Mul", name, inputs, name, vec![])),
            Op::Dropout(d) => {
                let ratio = format!("{name}.ratio");
                g.initializer.push(float_tensor(&ratio, &[], &[d.rate]));
                let inputs = inputs.into_iter().chain([ratio]).collect();
                g.node.push(node("Dropout", name, inputs, name, vec![]));
            }
            Op::SoftmaxCrossEntropy(_) => {}
        }
        if id == output {
            g.output.push(value_info(name, &layer.shape));
        }
    }
    Ok(ModelProto {
        ir_version: Some(IR_VERSION),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(OPSET),
        }],
        producer_name: Some("legion-rs".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        graph: Some(g),
        ..Default::default()
    })
}

/// An adaptive average pool as the ONNX pool that computes it, as PyTorch exports one: a
/// `GlobalAveragePool` to 1×1, an `AveragePool` where the output divides the input (windows of
/// `in/out` side by side). Other sizes have overlapping windows of varying size, which no ONNX
/// pool computes.
fn adaptive_as_pool(
    a: &legion_ops::op::AdaptiveAvgPool2d,
    input: Shape,
) -> Result<(&'static str, Vec<AttributeProto>), String> {
    let (h, w) = (input.dim(2), input.dim(3));
    if a.output == [1, 1] {
        return Ok(("GlobalAveragePool", vec![]));
    }
    let [oh, ow] = a.output;
    if h % oh != 0 || w % ow != 0 {
        return Err(format!(
            "an average pool of {h}x{w} to {oh}x{ow} has windows of different sizes, which no \
             ONNX operator computes; export at an input size whose feature map here is a \
             multiple of {oh}x{ow} (as PyTorch's exporter requires too)"
        ));
    }
    let kernel = [h / oh, w / ow];
    let attrs = vec![
        ints("kernel_shape", &kernel),
        ints("strides", &kernel),
        ints("pads", &[0, 0, 0, 0]),
    ];
    Ok(("AveragePool", attrs))
}

/// The node `op_type` named and writing `name`, followed by a Relu where `activation` fuses one
/// (the node then writes `<name>.pre_relu` and the Relu `name`).
fn with_activation(
    g: &mut GraphProto,
    op_type: &str,
    name: &str,
    inputs: Vec<String>,
    attrs: Vec<AttributeProto>,
    activation: Activation,
) {
    match activation {
        Activation::None => g.node.push(node(op_type, name, inputs, name, attrs)),
        Activation::Relu => {
            let pre = format!("{name}.pre_relu");
            g.node.push(node(op_type, name, inputs, &pre, attrs));
            g.node.push(node(
                "Relu",
                &format!("{name}.relu"),
                vec![pre],
                name,
                vec![],
            ));
        }
    }
}

/// The nodes of a unary op writing `name`: its ONNX operator where it has one (with its alpha
/// where it takes one), else the pattern PyTorch exports: ReLU6 as a Clip to [0, 6], the hard sigmoid as a
/// HardSigmoid of alpha 1/6 and beta 1/2, SiLU as a Sigmoid that a Mul multiplies by its input.
fn unary(g: &mut GraphProto, u: &UnaryOp, name: &str, inputs: Vec<String>) {
    match u.op {
        Unary::Sigmoid | Unary::Tanh | Unary::Hardswish | Unary::LeakyRelu => {
            let op_type =
                u.op.onnx_op()
                    .expect("these have an ONNX operator of their own");
            let attrs = match u.op.default_alpha() {
                Some(_) => vec![float("alpha", u.alpha())],
                None => vec![],
            };
            g.node.push(node(op_type, name, inputs, name, attrs));
        }
        Unary::Relu6 => {
            let bounds = [("min", 0.0), ("max", 6.0)].map(|(which, value)| {
                let bound = format!("{name}.{which}");
                g.initializer.push(float_tensor(&bound, &[], &[value]));
                bound
            });
            let inputs = inputs.into_iter().chain(bounds).collect();
            g.node.push(node("Clip", name, inputs, name, vec![]));
        }
        Unary::Hardsigmoid => {
            let attrs = vec![float("alpha", 1.0 / 6.0), float("beta", 0.5)];
            g.node.push(node("HardSigmoid", name, inputs, name, attrs));
        }
        Unary::Silu => {
            let sigmoid = format!("{name}.sigmoid");
            let x = inputs[0].clone();
            g.node
                .push(node("Sigmoid", &sigmoid, inputs, &sigmoid, vec![]));
            g.node
                .push(node("Mul", name, vec![x, sigmoid], name, vec![]));
        }
    }
}

/// ONNX's batch-norm momentum (the weight of the running statistics) from legion-rs's, through
/// the shortest decimal form as the import does, so that 0.1 is written as 0.9 and read back as
/// 0.1.
fn onnx_momentum(momentum: f32) -> f32 {
    let decimal: f64 = momentum
        .to_string()
        .parse()
        .expect("a float's display parses");
    (1.0 - decimal) as f32
}

fn node(
    op_type: &str,
    name: &str,
    inputs: Vec<String>,
    output: &str,
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        input: inputs,
        output: vec![output.to_string()],
        name: Some(name.to_string()),
        op_type: Some(op_type.to_string()),
        domain: Some(String::new()),
        attribute,
        ..Default::default()
    }
}

fn ints(name: &str, values: &[usize]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Ints as i32),
        ints: values.iter().map(|&v| v as i64).collect(),
        ..Default::default()
    }
}

fn int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Int as i32),
        i: Some(value),
        ..Default::default()
    }
}

fn float(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(attribute_proto::AttributeType::Float as i32),
        f: Some(value),
        ..Default::default()
    }
}

fn float_tensor(name: &str, dims: &[usize], values: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: Some(DataType::Float as i32),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

/// A FLOAT tensor's type and shape, its first dimension the symbolic batch.
fn value_info(name: &str, shape: &Shape) -> ValueInfoProto {
    let dim = shape
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| Dimension {
            value: Some(if i == 0 {
                dimension::Value::DimParam(BATCH.into())
            } else {
                dimension::Value::DimValue(d as i64)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn momentum_is_written_as_its_decimal_complement() {
        assert_eq!(onnx_momentum(0.1), 0.9);
        assert_eq!(crate::import::bn_momentum(onnx_momentum(0.1)), 0.1);
        assert_eq!(crate::import::bn_momentum(onnx_momentum(0.03)), 0.03);
    }
}
