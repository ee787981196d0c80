//! ONNX → `Graph`: each supported node becomes the layer a JSON model would have, a Relu that
//! alone reads a Conv, Gemm, MatMul or BatchNormalization is fused into it (as the zoo's models
//! fuse theirs), and the loss is appended to the logits.

use crate::OnnxError;
use crate::proto::{self, AttributeProto, ModelProto, NodeProto, TensorProto, attribute_proto};
use legion_ops::checkpoint::{Checkpoint, NamedTensor};
use legion_ops::op::{self, Activation, Op, PoolKind};
use legion_ops::{Graph, GraphBuilder, LayerId, Shape};
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The ops `import` maps, with what each accepts, the element-wise unary family (`op::Unary`)
/// last; the table of `docs/formats.md` says the same.
pub fn supported_ops() -> Vec<(String, &'static str)> {
    let (with_alpha, plain): (Vec<op::Unary>, Vec<op::Unary>) = op::Unary::ALL
        .iter()
        .filter(|u| u.onnx_op().is_some())
        .partition(|u| u.default_alpha().is_some());
    let names = |ops: Vec<op::Unary>| {
        let names: Vec<&str> = ops.iter().filter_map(|u| u.onnx_op()).collect();
        names.join(", ")
    };
    MAPPED
        .iter()
        .map(|&(ops, what)| (ops.to_string(), what))
        .chain([
            (names(plain), "elementwise, no attributes"),
            (
                names(with_alpha),
                "elementwise, its alpha (LeakyRelu's: PyTorch's negative_slope)",
            ),
        ])
        .collect()
}

/// [`supported_ops`] but the unary family.
const MAPPED: &[(&str, &str)] = &[
    (
        "Conv",
        "2-D, group, strides, symmetric pads, dilations 1; a Relu reading it alone is fused",
    ),
    (
        "Gemm",
        "transA 0, transB 0 or 1, alpha and beta 1, bias [out] or [1, out]",
    ),
    (
        "MatMul",
        "by a constant [in, out] matrix; an Add of a constant [out] after it is its bias",
    ),
    ("Relu", "elementwise"),
    (
        "Clip",
        "to [0, 6] (ReLU6) or [0, none] (ReLU), its bounds constant",
    ),
    (
        "HardSigmoid",
        "alpha 1/6 and beta 1/2, as PyTorch's hardsigmoid exports",
    ),
    (
        "Mul",
        "x · Sigmoid(x) (SiLU, the Sigmoid read by nothing else); two layers of one shape; a \
         layer by a [N, C, 1, 1] one (squeeze-and-excitation's scale)",
    ),
    (
        "MaxPool, AveragePool",
        "2-D, symmetric pads, dilations 1, ceil_mode 0 or 1; AveragePool \
         counts padding (count_include_pad 1) when it pads; a 1×1 window of stride 1 is dropped",
    ),
    ("GlobalAveragePool", "over H and W"),
    (
        "ReduceMean",
        "over H and W (axes 2 and 3), keepdims 0 or 1: a global average pool",
    ),
    (
        "BatchNormalization",
        "per channel; training_mode ignored, its extra outputs unused",
    ),
    ("Concat", "over channels (axis 1)"),
    ("Add", "of two layers of one shape"),
    ("Flatten", "axis 1"),
    ("Reshape", "to [N, C·H·W] by a constant shape"),
    ("Dropout", "its ratio constant; the mask output unused"),
    (
        "Softmax",
        "last, over the logits' classes: dropped, the loss applies it",
    ),
    (
        "Identity, Constant",
        "pass a value on; a constant `value` tensor",
    ),
];

/// An imported model: its graph (the loss appended) and, where the file holds every weight's
/// values, those weights under the graph's parameter names.
#[derive(Debug)]
pub struct Imported {
    pub graph: Graph,
    /// `None` when the file has no weight values (a graph-only export): the model then trains from
    /// the project's own initialisation.
    pub weights: Option<Checkpoint>,
    /// What the file held and became, with what looks wrong in it.
    pub summary: ImportSummary,
}

/// What an import read and made: the file's nodes by op type, its BatchNorm nodes, the model's
/// layers and parameters, and warnings about graphs that import but are unlikely to be what the
/// user trained (BatchNorm folded away by an eval-mode export).
#[derive(Clone, Debug, PartialEq)]
pub struct ImportSummary {
    pub source_name: String,
    /// Nodes of each op type, by op type.
    pub op_counts: std::collections::BTreeMap<String, usize>,
    pub layers: usize,
    pub parameters: u64,
    /// Whether the file carries the weights' values (else the model trains from its own
    /// initialisation).
    pub has_weights: bool,
    pub warnings: Vec<String>,
}

impl ImportSummary {
    /// The file's BatchNormalization nodes.
    pub fn batch_norms(&self) -> usize {
        self.op_counts
            .get("BatchNormalization")
            .copied()
            .unwrap_or(0)
    }
}

impl std::fmt::Display for ImportSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: usize = self.op_counts.values().sum();
        let mut by_count: Vec<(&String, &usize)> = self.op_counts.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let ops: Vec<String> = by_count.iter().map(|(op, n)| format!("{op} {n}")).collect();
        write!(
            f,
            "imported {}: {nodes} nodes ({}) as {} layers, {} BatchNorm, {} parameters, {}",
            self.source_name,
            ops.join(", "),
            self.layers,
            self.batch_norms(),
            self.parameters,
            if self.has_weights {
                "weights from the file"
            } else {
                "no weights in the file (initialised)"
            }
        )?;
        for w in &self.warnings {
            write!(f, "\nwarning: {w}")?;
        }
        Ok(())
    }
}

/// Reads and imports the ONNX file at `path`; the model is named after the file's stem.
pub fn load(path: &Path) -> Result<Imported, OnnxError> {
    let source_name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| OnnxError {
        source_name: source_name.clone(),
        location: "reading".into(),
        message: e.to_string(),
    })?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = path.parent().unwrap_or(Path::new("."));
    import_with_external_data(&bytes, &name, &source_name, Some(dir))
}

/// Imports an ONNX model from its bytes as a model named `model_name`; `source_name` (a file
/// name) starts every error. A dynamic batch dimension is imported as 1: `Graph::with_batch` sets
/// the run's. Tensors kept in external data files are refused: [`load`] reads them.
pub fn import(bytes: &[u8], model_name: &str, source_name: &str) -> Result<Imported, OnnxError> {
    import_with_external_data(bytes, model_name, source_name, None)
}

/// [`import`], reading tensors kept in external data files (the dynamo exporter's
/// `model.onnx.data`) from `external_dir`, the model file's folder.
fn import_with_external_data(
    bytes: &[u8],
    model_name: &str,
    source_name: &str,
    external_dir: Option<&Path>,
) -> Result<Imported, OnnxError> {
    let err = |location: &str, message: String| OnnxError {
        source_name: source_name.to_string(),
        location: location.to_string(),
        message,
    };
    // prost's error names the message and field it failed in (`ModelProto.graph: GraphProto.node:
    // ...`), which is where the file is malformed.
    let model = ModelProto::decode(bytes)
        .map_err(|e| err("protobuf", format!("not a valid ONNX model file: {e}")))?;
    let opset = default_opset(&model).map_err(|m| err("opset_import", m))?;
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| err("model", "the model has no graph".into()))?;
    if graph.output.len() != 1 {
        return Err(err(
            "graph",
            format!(
                "the graph has {} outputs; a model to train has one, its logits",
                graph.output.len()
            ),
        ));
    }
    let mut importer = Importer::new(graph, opset, model_name, source_name, external_dir)?;
    importer.inputs()?;
    for (index, node) in graph.node.iter().enumerate() {
        if importer.fused.contains(&index) {
            continue;
        }
        importer
            .node(node)
            .map_err(|m| err(&node_location(index, node), m))?;
    }
    importer.finish()
}

/// The version of the default (`ai.onnx`) operator set the model imports.
fn default_opset(model: &ModelProto) -> Result<i64, String> {
    let version = model
        .opset_import
        .iter()
        .find(|o| matches!(o.domain.as_deref(), None | Some("") | Some("ai.onnx")))
        .and_then(|o| o.version)
        .ok_or("the model imports no version of the default (ai.onnx) operator set")?;
    if version < MIN_OPSET {
        return Err(format!(
            "operator set {version} is older than the oldest supported, {MIN_OPSET}: re-export \
             with a newer opset"
        ));
    }
    Ok(version)
}

/// Dropout takes its ratio as an attribute before opset 12 and as an input from it on; opsets
/// before 7 had Dropout's `is_test` and Add's `broadcast`, which are not mapped.
const MIN_OPSET: i64 = 7;

fn node_location(index: usize, node: &NodeProto) -> String {
    let op_type = node.op_type.as_deref().unwrap_or("");
    match node.name.as_deref() {
        Some(name) if !name.is_empty() => format!("node {index} '{name}' ({op_type})"),
        _ => format!(
            "node {index} ({op_type}, output '{}')",
            node.output.first().map(String::as_str).unwrap_or("")
        ),
    }
}

/// A constant of the file: an initializer, a `Constant` node, or a weight given as a graph input
/// with its shape only (`export_params=False`).
#[derive(Clone, Debug)]
struct Constant {
    /// The tensor's name in the file.
    name: String,
    dims: Vec<usize>,
    data: Option<Data>,
}

#[derive(Clone, Debug)]
enum Data {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

#[derive(Clone, Debug)]
enum Value {
    Layer(LayerId),
    Constant(Constant),
}

struct Importer<'g> {
    graph: &'g proto::GraphProto,
    opset: i64,
    source_name: String,
    /// Where external tensor data is read from; `None` refuses it.
    external_dir: Option<&'g Path>,
    builder: GraphBuilder,
    values: HashMap<String, Value>,
    /// Node indices reading each value; a graph output counts as a reader too (`None`).
    readers: HashMap<String, Vec<Option<usize>>>,
    /// Nodes mapped together with an earlier node (a fused Relu, a MatMul's bias Add).
    fused: HashSet<usize>,
    weights: Vec<NamedTensor>,
    /// Weight tensors the file gives a shape but no values.
    valueless: Vec<String>,
}

impl<'g> Importer<'g> {
    fn new(
        graph: &'g proto::GraphProto,
        opset: i64,
        model_name: &str,
        source_name: &str,
        external_dir: Option<&'g Path>,
    ) -> Result<Importer<'g>, OnnxError> {
        let mut readers: HashMap<String, Vec<Option<usize>>> = HashMap::new();
        for (index, node) in graph.node.iter().enumerate() {
            for input in node.input.iter().filter(|i| !i.is_empty()) {
                readers.entry(input.clone()).or_default().push(Some(index));
            }
        }
        for output in &graph.output {
            let name = output.name.clone().unwrap_or_default();
            readers.entry(name).or_default().push(None);
        }
        Ok(Importer {
            graph,
            opset,
            source_name: source_name.to_string(),
            external_dir,
            builder: GraphBuilder::new(model_name),
            values: HashMap::new(),
            readers,
            fused: HashSet::new(),
            weights: Vec::new(),
            valueless: Vec::new(),
        })
    }

    fn err(&self, location: String, message: String) -> OnnxError {
        OnnxError {
            source_name: self.source_name.clone(),
            location,
            message,
        }
    }

    /// Initializers become constants; of the graph inputs that are not initializers, the first is
    /// the data (the input layer) and the others weights given by shape alone.
    fn inputs(&mut self) -> Result<(), OnnxError> {
        if !self.graph.sparse_initializer.is_empty() {
            return Err(self.err(
                "graph".into(),
                "sparse initializers are not supported".into(),
            ));
        }
        for t in &self.graph.initializer {
            let name = t.name.clone().unwrap_or_default();
            let c = constant(t, self.external_dir)
                .map_err(|m| self.err(format!("initializer '{name}'"), m))?;
            self.values.insert(name, Value::Constant(c));
        }
        let mut data_input = None;
        for input in &self.graph.input {
            let name = input.name.clone().unwrap_or_default();
            if self.values.contains_key(&name) {
                continue;
            }
            let location = format!("graph input '{name}'");
            let dims = tensor_dims(input).map_err(|m| self.err(location.clone(), m))?;
            if data_input.is_none() {
                let shape = data_shape(&dims).map_err(|m| self.err(location.clone(), m))?;
                let id = self
                    .builder
                    .input(&name, shape)
                    .map_err(|e| self.err(location, e.to_string()))?;
                self.values.insert(name, Value::Layer(id));
                data_input = Some(());
            } else {
                let dims = dims
                    .iter()
                    .enumerate()
                    .map(|(i, d)| match d {
                        Dim::Fixed(n) => Ok(*n),
                        Dim::Dynamic(p) => Err(format!(
                            "dimension {i} of this weight is dynamic ('{p}'); weights need \
                             fixed shapes"
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|m| self.err(location, m))?;
                let c = Constant {
                    name: name.clone(),
                    dims,
                    data: None,
                };
                self.values.insert(name, Value::Constant(c));
            }
        }
        if data_input.is_none() {
            return Err(self.err(
                "graph".into(),
                "no graph input is left for the data once the initializers are taken".into(),
            ));
        }
        Ok(())
    }

    fn value(&self, name: &str) -> Result<&Value, String> {
        self.values
            .get(name)
            .ok_or_else(|| format!("input '{name}' is neither a graph input, an initializer nor an earlier node's output"))
    }

    fn layer(&self, node: &NodeProto, k: usize) -> Result<LayerId, String> {
        let name = input_name(node, k)?;
        match self.value(name)? {
            Value::Layer(id) => Ok(*id),
            Value::Constant(_) => Err(format!(
                "input {k} ('{name}') is a constant; expected a layer's output"
            )),
        }
    }

    fn constant(&self, node: &NodeProto, k: usize) -> Result<&Constant, String> {
        let name = input_name(node, k)?;
        match self.value(name)? {
            Value::Constant(c) => Ok(c),
            Value::Layer(_) => Err(format!(
                "input {k} ('{name}') is a layer's output; expected a constant (an initializer)"
            )),
        }
    }

    /// An optional constant input: absent when the node has fewer inputs or an empty name.
    fn optional_constant(&self, node: &NodeProto, k: usize) -> Result<Option<&Constant>, String> {
        match node.input.get(k) {
            None => Ok(None),
            Some(name) if name.is_empty() => Ok(None),
            Some(_) => self.constant(node, k).map(Some),
        }
    }

    fn shape(&self, id: LayerId) -> Shape {
        self.builder.shape(id)
    }

    /// The one node reading `value`, if exactly one node (and no graph output) reads it.
    fn sole_reader(&self, value: &str) -> Option<usize> {
        match self.readers.get(value).map(Vec::as_slice) {
            Some([Some(index)]) => Some(*index),
            _ => None,
        }
    }

    /// Where `node`'s output alone feeds a Relu: that Relu's index, to be fused.
    fn relu_after(&self, output: &str) -> Option<usize> {
        self.sole_reader(output).filter(|&j| {
            let relu = &self.graph.node[j];
            relu.op_type.as_deref() == Some("Relu")
                && is_default_domain(relu)
                && relu.input.len() == 1
                && relu.output.len() == 1
                && relu.attribute.is_empty()
        })
    }

    /// The layer name of a node with weights: their common `<prefix>` where the file names them
    /// `<prefix>.weight`, ... (so that `--save` writes them back under the user's names), else
    /// the node's name; the node's name too where the prefix is taken already, by a node reading
    /// the same tensors (an exporter shares one initializer among parameters of equal values).
    fn layer_name(&self, node: &NodeProto, params: &[(&str, Option<&Constant>)]) -> String {
        let names: Vec<(&str, &str)> = params
            .iter()
            .filter_map(|(suffix, c)| c.map(|c| (*suffix, c.name.as_str())))
            .collect();
        match common_param_prefix(&names) {
            Some(prefix) if !self.builder.contains(&prefix) => prefix,
            _ => unique_name(&self.builder, &node_layer_name(node)),
        }
    }

    fn bind(&mut self, name: &str, value: Value) {
        self.values.insert(name.to_string(), value);
    }

    /// Adds `op` as the layer `name` reading `inputs`, bound to `output`.
    fn add(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[LayerId],
        output: &str,
    ) -> Result<LayerId, String> {
        let id = self
            .builder
            .layer(name, op, inputs)
            .map_err(|e| e.to_string())?;
        self.bind(output, Value::Layer(id));
        Ok(id)
    }

    /// Records a layer's weights: the values under `<layer>.<suffix>`, or that it has none.
    fn weight(&mut self, layer: &str, suffix: &str, c: &Constant, values: Option<Vec<f32>>) {
        match values {
            Some(data) => self.weights.push(NamedTensor::new(
                format!("{layer}.{suffix}"),
                Shape::new(&c.dims),
                data,
            )),
            None => self.valueless.push(c.name.clone()),
        }
    }

    fn node(&mut self, node: &NodeProto) -> Result<(), String> {
        if !is_default_domain(node) {
            return Err(format!(
                "domain '{}' is not supported; only the default ONNX operator set is",
                node.domain.as_deref().unwrap_or("")
            ));
        }
        let op_type = node.op_type.as_deref().unwrap_or("");
        let Some(allowed) = allowed_attributes(op_type, self.opset) else {
            return Err(unsupported_op(op_type));
        };
        check_attributes(node, allowed)?;
        let output = first_output(node)?.to_string();
        match op_type {
            "Conv" => self.conv(node, &output),
            "Gemm" => self.gemm(node, &output),
            "MatMul" => self.matmul(node, &output),
            "Relu" => {
                let x = self.layer(node, 0)?;
                self.add(&node_layer_name(node), Op::Relu(op::Relu {}), &[x], &output)
                    .map(drop)
            }
            "Sigmoid" if let Some(mul) = self.silu_after(node) => {
                let x = self.layer(node, 0)?;
                self.fused.insert(mul);
                let output = first_output(&self.graph.node[mul])?.to_string();
                let name = node_layer_name(&self.graph.node[mul]);
                self.add(&name, Op::unary(op::Unary::Silu), &[x], &output)
                    .map(drop)
            }
            "Clip" => self.clip(node, &output),
            "HardSigmoid" => {
                let x = self.layer(node, 0)?;
                let alpha = float_attribute(node, "alpha")?.unwrap_or(0.2);
                let beta = float_attribute(node, "beta")?.unwrap_or(0.5);
                if (alpha - 1.0 / 6.0).abs() > 1e-6 || (beta - 0.5).abs() > 1e-6 {
                    return Err(format!(
                        "alpha {alpha} and beta {beta} are not supported; only PyTorch's \
                         hardsigmoid (alpha 1/6, beta 1/2) is: use nn.Hardsigmoid"
                    ));
                }
                self.add(
                    &node_layer_name(node),
                    Op::unary(op::Unary::Hardsigmoid),
                    &[x],
                    &output,
                )
                .map(drop)
            }
            unary if let Some(unary) = op::Unary::from_onnx(unary) => {
                let x = self.layer(node, 0)?;
                // the family's defaults are ONNX's (LeakyRelu's alpha: 0.01)
                let op = match float_attribute(node, "alpha")? {
                    Some(alpha) => op::UnaryOp::with_alpha(unary, alpha),
                    None => unary.into(),
                };
                self.add(&node_layer_name(node), Op::Unary(op), &[x], &output)
                    .map(drop)
            }
            "MaxPool" | "AveragePool" => self.pool(node, &output),
            "GlobalAveragePool" => {
                let x = self.layer(node, 0)?;
                if self.shape(x).ndim() != 4 {
                    return Err(format!(
                        "input has shape {}; expected N,C,H,W",
                        self.shape(x)
                    ));
                }
                let id = self
                    .builder
                    .global_avg_pool(&node_layer_name(node), x)
                    .map_err(|e| e.to_string())?;
                self.bind(&output, Value::Layer(id));
                Ok(())
            }
            "BatchNormalization" => self.batch_norm(node, &output),
            "ReduceMean" => self.reduce_mean(node, &output),
            "Concat" => {
                let xs = (0..node.input.len())
                    .map(|k| self.layer(node, k))
                    .collect::<Result<Vec<_>, _>>()?;
                let rank = xs.first().map(|&x| self.shape(x).ndim()).unwrap_or(0);
                let axis = required_int(node, "axis")?;
                if normalize_axis(axis, rank) != Some(1) {
                    return Err(format!(
                        "axis {axis} over inputs of rank {rank}: only the channel axis (1) is \
                         supported"
                    ));
                }
                if let [x] = xs[..] {
                    self.bind(&output, Value::Layer(x));
                    return Ok(());
                }
                self.add(
                    &node_layer_name(node),
                    Op::Concat(op::Concat {}),
                    &xs,
                    &output,
                )
                .map(drop)
            }
            "Add" => {
                let (a, b) = self.two_layers(
                    node,
                    "Add of a constant is supported only as the bias right after a MatMul; \
                     expected two layers' outputs",
                )?;
                if self.shape(a) != self.shape(b) {
                    return Err(format!(
                        "inputs of shapes {} and {}: broadcasting is not supported",
                        self.shape(a),
                        self.shape(b)
                    ));
                }
                self.add(
                    &node_layer_name(node),
                    Op::Add(op::Add {}),
                    &[a, b],
                    &output,
                )
                .map(drop)
            }
            "Mul" => {
                let (a, b) = self.two_layers(
                    node,
                    "Mul by a constant is not supported; expected two layers' outputs (a \
                     learned scale is a layer: a 1×1 Conv or a BatchNormalization)",
                )?;
                // the channel scale second, whichever order the file has
                let (x, s) = match (self.shape(a), self.shape(b)) {
                    (sa, sb) if sa.ndim() == 4 && sa.dim(2) * sa.dim(3) == 1 && sb != sa => (b, a),
                    _ => (a, b),
                };
                self.add(
                    &node_layer_name(node),
                    Op::Mul(op::Mul {}),
                    &[x, s],
                    &output,
                )
                .map(drop)
            }
            "Flatten" => {
                let x = self.layer(node, 0)?;
                let rank = self.shape(x).ndim();
                let axis = int_attribute(node, "axis")?.unwrap_or(1);
                if normalize_axis(axis, rank) != Some(1) {
                    return Err(format!(
                        "axis {axis} over an input of rank {rank}: only axis 1 ([N, rest]) is \
                         supported"
                    ));
                }
                self.flatten(node, x, &output)
            }
            "Reshape" => {
                let x = self.layer(node, 0)?;
                let shape = self.constant(node, 1)?;
                let target = match &shape.data {
                    Some(Data::I64(v)) => v.clone(),
                    _ => {
                        return Err(format!(
                            "the shape '{}' must be a constant INT64 tensor",
                            shape.name
                        ));
                    }
                };
                let allow_zero = int_attribute(node, "allowzero")?.unwrap_or(0) != 0;
                let dims = self.shape(x).dims().to_vec();
                if !reshape_is_flatten(&dims, &target, allow_zero) {
                    return Err(format!(
                        "reshape of {} to {target:?}: only a reshape to [N, C·H·W] is supported",
                        self.shape(x)
                    ));
                }
                self.flatten(node, x, &output)
            }
            "Dropout" => {
                let x = self.layer(node, 0)?;
                unused_outputs(node, 1, &self.readers, "the mask")?;
                let rate = if self.opset < 12 {
                    float_attribute(node, "ratio")?.unwrap_or(0.5)
                } else {
                    match self.optional_constant(node, 1)? {
                        None => 0.5,
                        Some(c) => scalar_f32(c)?,
                    }
                };
                self.add(
                    &node_layer_name(node),
                    Op::Dropout(op::Dropout { rate }),
                    &[x],
                    &output,
                )
                .map(drop)
            }
            "Softmax" => {
                let x = self.layer(node, 0)?;
                let is_last = matches!(self.readers.get(&output).map(Vec::as_slice), Some([None]))
                    && self.graph.output.len() == 1;
                let rank = self.shape(x).ndim();
                let axis =
                    int_attribute(node, "axis")?.unwrap_or(if self.opset < 13 { 1 } else { -1 });
                if !is_last || rank != 2 || normalize_axis(axis, rank) != Some(1) {
                    return Err(
                        "Softmax is supported only as the model's output, over the classes of \
                         [N, classes] logits (it is dropped: the loss applies it)"
                            .into(),
                    );
                }
                self.bind(&output, Value::Layer(x));
                Ok(())
            }
            "Identity" => {
                // a constant passed on takes the output's name: PyTorch's exporter shares one
                // initializer among parameters of equal values and names each through an
                // Identity (`Identity(bn1.weight) -> layer1.0.bn1.weight`)
                let v = match self.value(input_name(node, 0)?)?.clone() {
                    Value::Constant(c) => Value::Constant(Constant {
                        name: output.clone(),
                        ..c
                    }),
                    layer => layer,
                };
                self.bind(&output, v);
                Ok(())
            }
            "Constant" => {
                let t = node
                    .attribute
                    .iter()
                    .find(|a| a.name.as_deref() == Some("value"))
                    .and_then(|a| a.t.as_ref())
                    .ok_or("only a Constant with a `value` tensor is supported")?;
                let mut c = constant(t, self.external_dir)?;
                c.name = output.clone();
                self.bind(&output, Value::Constant(c));
                Ok(())
            }
            other => Err(unsupported_op(other)),
        }
    }

    /// The two layers a binary node reads, or `constant_refusal` where one is a constant (a
    /// missing input is named as such first).
    fn two_layers(
        &self,
        node: &NodeProto,
        constant_refusal: &str,
    ) -> Result<(LayerId, LayerId), String> {
        match (self.layer(node, 0), self.layer(node, 1)) {
            (Ok(a), Ok(b)) => Ok((a, b)),
            _ => {
                for k in 0..2 {
                    self.value(input_name(node, k)?)?;
                }
                Err(constant_refusal.to_string())
            }
        }
    }

    /// Where `sigmoid`'s output is read by one Mul alone, whose other factor is the Sigmoid's
    /// input (x · σ(x): SiLU as PyTorch exports it), that Mul's index, to be fused.
    fn silu_after(&self, sigmoid: &NodeProto) -> Option<usize> {
        let (x, s) = (sigmoid.input.first()?, sigmoid.output.first()?);
        self.sole_reader(s).filter(|&j| {
            let mul = &self.graph.node[j];
            mul.op_type.as_deref() == Some("Mul")
                && is_default_domain(mul)
                && mul.attribute.is_empty()
                && (mul.input[..] == [x.clone(), s.clone()]
                    || mul.input[..] == [s.clone(), x.clone()])
        })
    }

    /// A Clip to [0, 6] is ReLU6 and to [0, none] ReLU; its bounds are attributes before opset
    /// 11 and constant inputs from it on.
    fn clip(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let (min, max) = if self.opset < 11 {
            (float_attribute(node, "min")?, float_attribute(node, "max")?)
        } else {
            let bound = |k| -> Result<Option<f32>, String> {
                self.optional_constant(node, k)?.map(scalar_f32).transpose()
            };
            (bound(1)?, bound(2)?)
        };
        let op = match (min, max) {
            (Some(0.0), Some(6.0)) => Op::unary(op::Unary::Relu6),
            (Some(0.0), None) => Op::Relu(op::Relu {}),
            (Some(0.0), Some(max)) if max == f32::INFINITY => Op::Relu(op::Relu {}),
            _ => {
                let show = |b: Option<f32>| b.map_or("none".to_string(), |v| v.to_string());
                return Err(format!(
                    "a Clip to [{}, {}] is not supported; only [0, 6] (nn.ReLU6) and [0, none] \
                     (nn.ReLU) are: write the model with one of those",
                    show(min),
                    show(max)
                ));
            }
        };
        self.add(&node_layer_name(node), op, &[x], output).map(drop)
    }

    /// A mean over H and W (the dynamo exporter's adaptive average pool to 1×1): a global
    /// average pool, flattened to [N, C] where the node does not keep the reduced dims.
    fn reduce_mean(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let input = self.shape(x);
        let axes = if self.opset < 18 {
            ints_attribute(node, "axes")?
        } else {
            match self.optional_constant(node, 1)? {
                None => None,
                Some(c) => match &c.data {
                    Some(Data::I64(v)) => Some(v.clone()),
                    _ => {
                        return Err(format!(
                            "the axes '{}' must be a constant INT64 tensor",
                            c.name
                        ));
                    }
                },
            }
        };
        let mut normalized: Vec<Option<usize>> = axes
            .iter()
            .flatten()
            .map(|&a| normalize_axis(a, input.ndim()))
            .collect();
        normalized.sort();
        if input.ndim() != 4 || normalized != [Some(2), Some(3)] {
            return Err(format!(
                "a mean over axes {} of an input of shape {input}: only the mean over H and W \
                 (axes 2 and 3) of an N,C,H,W input is supported",
                axes.map_or("(all)".to_string(), |a| format!("{a:?}"))
            ));
        }
        let name = node_layer_name(node);
        let pooled = self
            .builder
            .global_avg_pool(&name, x)
            .map_err(|e| e.to_string())?;
        match int_attribute(node, "keepdims")?.unwrap_or(1) {
            1 => {
                self.bind(output, Value::Layer(pooled));
                Ok(())
            }
            0 => {
                let flat = unique_name(&self.builder, &format!("{name}.flatten"));
                self.add(&flat, Op::Flatten(op::Flatten {}), &[pooled], output)
                    .map(drop)
            }
            other => Err(format!("keepdims {other} is not 0 or 1")),
        }
    }

    fn flatten(&mut self, node: &NodeProto, x: LayerId, output: &str) -> Result<(), String> {
        if self.shape(x).ndim() == 2 {
            self.bind(output, Value::Layer(x));
            return Ok(());
        }
        self.add(
            &node_layer_name(node),
            Op::Flatten(op::Flatten {}),
            &[x],
            output,
        )
        .map(drop)
    }

    /// The output a fused Relu leaves, and the activation: the Relu's when one is fused.
    fn fuse_relu(&mut self, output: &str) -> (String, Activation) {
        match self.relu_after(output) {
            Some(j) => {
                self.fused.insert(j);
                (self.graph.node[j].output[0].clone(), Activation::Relu)
            }
            None => (output.to_string(), Activation::None),
        }
    }

    fn conv(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let w = self.constant(node, 1)?.clone();
        let b = self.optional_constant(node, 2)?.cloned();
        let input = self.shape(x);
        if input.ndim() != 4 {
            return Err(format!("input has shape {input}; expected N,C,H,W"));
        }
        let groups = positive(int_attribute(node, "group")?.unwrap_or(1), "group")?;
        let [out_channels, per_group, kh, kw] = w.dims[..] else {
            return Err(format!(
                "weight '{}' has shape {:?}; a 2-D convolution's weight has 4 dims",
                w.name, w.dims
            ));
        };
        if per_group.checked_mul(groups) != Some(input.dim(1)) {
            return Err(format!(
                "weight '{}' has shape {:?}; over {} input channels in {groups} group(s) it \
                 needs [out, {}, kh, kw]",
                w.name,
                w.dims,
                input.dim(1),
                input.dim(1) / groups
            ));
        }
        if let Some(kernel) = ints_attribute(node, "kernel_shape")?
            && kernel != [kh as i64, kw as i64]
        {
            return Err(format!(
                "kernel_shape {kernel:?} differs from the weight's {:?}",
                [kh, kw]
            ));
        }
        let window = window_attributes(node)?;
        if let Some(b) = &b
            && b.dims != [out_channels]
        {
            return Err(format!(
                "bias '{}' has shape {:?}; expected [{out_channels}]",
                b.name, b.dims
            ));
        }
        let (output, activation) = self.fuse_relu(output);
        let name = self.layer_name(node, &[("weight", Some(&w)), ("bias", b.as_ref())]);
        let conv = op::Conv2d {
            out_channels,
            kernel: [kh, kw],
            stride: window.stride,
            padding: window.padding,
            groups,
            bias: b.is_some(),
            activation,
        };
        self.add(&name, Op::Conv2d(conv), &[x], &output)?;
        self.weight(&name, "weight", &w, w.f32_values());
        if let Some(b) = &b {
            self.weight(&name, "bias", b, b.f32_values());
        }
        Ok(())
    }

    fn gemm(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let w = self.constant(node, 1)?.clone();
        let b = self.optional_constant(node, 2)?.cloned();
        if int_attribute(node, "transA")?.unwrap_or(0) != 0 {
            return Err("transA 1 is not supported: the data must be [N, features]".into());
        }
        for (attr, default) in [("alpha", 1.0), ("beta", 1.0)] {
            let v = float_attribute(node, attr)?.unwrap_or(default);
            if v != 1.0 && !(attr == "beta" && b.is_none()) {
                return Err(format!("{attr} {v} is not supported; only 1"));
            }
        }
        let transposed = int_attribute(node, "transB")?.unwrap_or(0) != 0;
        self.dense(node, x, w, b, transposed, output)
    }

    fn matmul(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let w = self.constant(node, 1)?.clone();
        // An Add of a constant [out] that alone reads the product is its bias.
        let out = w.dims.get(1).copied();
        let bias_add = self.sole_reader(output).and_then(|j| {
            let add = &self.graph.node[j];
            if add.op_type.as_deref() != Some("Add")
                || !is_default_domain(add)
                || add.input.len() != 2
            {
                return None;
            }
            let other = if add.input[0] == output {
                &add.input[1]
            } else {
                &add.input[0]
            };
            match self.values.get(other) {
                Some(Value::Constant(c)) if is_bias_shape(&c.dims, out?) => Some((j, c.clone())),
                _ => None,
            }
        });
        let (output, b) = match bias_add {
            Some((j, c)) => {
                self.fused.insert(j);
                (first_output(&self.graph.node[j])?.to_string(), Some(c))
            }
            None => (output.to_string(), None),
        };
        self.dense(node, x, w, b, false, &output)
    }

    /// A dense layer from a [in, out] weight (`transposed`: [out, in], PyTorch's layout).
    fn dense(
        &mut self,
        node: &NodeProto,
        x: LayerId,
        w: Constant,
        b: Option<Constant>,
        transposed: bool,
        output: &str,
    ) -> Result<(), String> {
        let input = self.shape(x);
        if input.ndim() != 2 {
            return Err(format!(
                "input has shape {input}; expected [N, features] (flatten first)"
            ));
        }
        let [rows, cols] = w.dims[..] else {
            return Err(format!(
                "weight '{}' has shape {:?}; expected a matrix",
                w.name, w.dims
            ));
        };
        let (in_features, out_features) = if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        if in_features != input.dim(1) {
            return Err(format!(
                "weight '{}' has shape {:?}, which takes {in_features} features; the input has {}",
                w.name,
                w.dims,
                input.dim(1)
            ));
        }
        check_bias(b.as_ref(), out_features)?;
        let (output, activation) = self.fuse_relu(output);
        let name = self.layer_name(node, &[("weight", Some(&w)), ("bias", b.as_ref())]);
        let dense = op::Dense {
            out_features,
            bias: b.is_some(),
            activation,
        };
        self.add(&name, Op::Dense(dense), &[x], &output)?;
        let values = w.f32_values().map(|v| {
            if transposed {
                v
            } else {
                transpose(&v, rows, cols)
            }
        });
        let stored = Constant {
            dims: vec![out_features, in_features],
            ..w
        };
        self.weight(&name, "weight", &stored, values);
        if let Some(b) = &b {
            let flat = Constant {
                dims: vec![out_features],
                ..b.clone()
            };
            self.weight(&name, "bias", &flat, b.f32_values());
        }
        Ok(())
    }

    fn pool(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let input = self.shape(x);
        if input.ndim() != 4 {
            return Err(format!("input has shape {input}; expected N,C,H,W"));
        }
        unused_outputs(node, 1, &self.readers, "the indices")?;
        let kernel = match ints_attribute(node, "kernel_shape")? {
            Some(k) => pair(&k, "kernel_shape")?,
            None => return Err("kernel_shape is required".into()),
        };
        let window = window_attributes(node)?;
        let max = node.op_type.as_deref() == Some("MaxPool");
        if !max
            && window.padding != [0, 0]
            && int_attribute(node, "count_include_pad")?.unwrap_or(0) == 0
        {
            return Err(
                "count_include_pad 0 with padding is not supported: legion-rs averages over the \
                 padded window (PyTorch's count_include_pad=True)"
                    .into(),
            );
        }
        if int_attribute(node, "storage_order")?.unwrap_or(0) != 0 {
            return Err("storage_order 1 (column-major indices) is not supported".into());
        }
        let ceil_mode = match int_attribute(node, "ceil_mode")?.unwrap_or(0) {
            0 => false,
            1 => true,
            other => return Err(format!("ceil_mode {other} is not 0 or 1")),
        };
        if is_identity_window(kernel, window.stride, window.padding) {
            self.bind(output, Value::Layer(x));
            return Ok(());
        }
        let pool = op::Pool2d {
            kind: if max { PoolKind::Max } else { PoolKind::Avg },
            kernel,
            stride: window.stride,
            padding: window.padding,
            ceil_mode,
        };
        self.add(&node_layer_name(node), Op::Pool2d(pool), &[x], output)
            .map(drop)
    }

    fn batch_norm(&mut self, node: &NodeProto, output: &str) -> Result<(), String> {
        let x = self.layer(node, 0)?;
        let input = self.shape(x);
        if input.ndim() != 4 && input.ndim() != 2 {
            return Err(format!("input has shape {input}; expected N,C,H,W or N,C"));
        }
        if int_attribute(node, "spatial")?.unwrap_or(1) != 1 {
            return Err("spatial 0 (statistics per element) is not supported".into());
        }
        unused_outputs(node, 1, &self.readers, "the running statistics")?;
        const SUFFIXES: [&str; 4] = ["weight", "bias", "running_mean", "running_var"];
        let mut params = Vec::with_capacity(4);
        for k in 1..=4 {
            let c = self.constant(node, k)?.clone();
            if c.dims != [input.dim(1)] {
                return Err(format!(
                    "'{}' has shape {:?}; expected [{}], one per channel",
                    c.name,
                    c.dims,
                    input.dim(1)
                ));
            }
            params.push(c);
        }
        let eps = float_attribute(node, "epsilon")?.unwrap_or(1e-5);
        let momentum = bn_momentum(float_attribute(node, "momentum")?.unwrap_or(0.9));
        let (output, activation) = self.fuse_relu(output);
        let named: Vec<(&str, Option<&Constant>)> = SUFFIXES
            .iter()
            .copied()
            .zip(params.iter().map(Some))
            .collect();
        let name = self.layer_name(node, &named);
        let bn = op::BatchNorm {
            eps,
            momentum,
            relu: activation == Activation::Relu,
        };
        self.add(&name, Op::BatchNorm(bn), &[x], &output)?;
        for (suffix, c) in SUFFIXES.iter().zip(&params) {
            self.weight(&name, suffix, c, c.f32_values());
        }
        Ok(())
    }

    fn finish(self) -> Result<Imported, OnnxError> {
        let outputs = &self.graph.output;
        let [output] = &outputs[..] else {
            return Err(self.err(
                "graph".into(),
                format!(
                    "the graph has {} outputs; a model to train has one, its logits",
                    outputs.len()
                ),
            ));
        };
        let name = output.name.clone().unwrap_or_default();
        let location = format!("graph output '{name}'");
        let logits = match self.values.get(&name) {
            Some(Value::Layer(id)) => *id,
            _ => {
                return Err(self.err(location, "is not the output of a layer".into()));
            }
        };
        let shape = self.builder.shape(logits);
        if shape.ndim() != 2 {
            return Err(self.err(
                location,
                format!("has shape {shape}; the logits a loss reads are [N, classes]"),
            ));
        }
        let mut builder = self.builder;
        let loss = unique_name(&builder, "loss");
        builder
            .softmax_cross_entropy(&loss, logits)
            .map_err(|e| OnnxError {
                source_name: self.source_name.clone(),
                location: "loss".into(),
                message: e.to_string(),
            })?;
        let graph = builder.finish();
        let mut op_counts = std::collections::BTreeMap::new();
        for node in &self.graph.node {
            *op_counts
                .entry(node.op_type.clone().unwrap_or_default())
                .or_insert(0) += 1;
        }
        let summary = ImportSummary {
            source_name: self.source_name.clone(),
            op_counts,
            layers: graph.layers().len(),
            parameters: graph.param_count(),
            has_weights: !self.weights.is_empty(),
            warnings: folded_batch_norm(&self.graph.node).into_iter().collect(),
        };
        let weights = match (self.weights.is_empty(), self.valueless.first()) {
            (true, _) => None,
            (false, None) => Some(Checkpoint {
                tensors: self.weights,
                ..Checkpoint::default()
            }),
            (false, Some(example)) => {
                return Err(OnnxError {
                    source_name: self.source_name,
                    location: "initializers".into(),
                    message: format!(
                        "{} weight(s) have values and {} have only a shape (e.g. '{example}'): \
                         a model's weights must all be in the file, or none",
                        self.weights.len(),
                        self.valueless.len()
                    ),
                });
            }
        };
        Ok(Imported {
            graph,
            weights,
            summary,
        })
    }
}

/// A warning where the graph looks like an eval-mode export whose BatchNorm the exporter folded
/// into the convolutions: convolutions that read a tensor that is no module's parameter
/// (TorchScript's `onnx::Conv_193`, the dynamo exporter's `conv1.weight_bias`: what folding
/// writes), or that have no bias and feed an activation or a residual sum directly (a BatchNorm
/// of zero bias folded away: PyTorch's convolutions have a bias unless a BatchNorm follows, and
/// DenseNet's, whose BatchNorm comes first, feed a Concat or a pool; the dynamo exporter also
/// drops biases that are zero). Such a model trains without those BatchNorms and biases.
fn folded_batch_norm(nodes: &[NodeProto]) -> Option<String> {
    let is = |n: &NodeProto, op: &str| n.op_type.as_deref() == Some(op);
    let batch_norms = nodes.iter().filter(|n| is(n, "BatchNormalization")).count();
    let convs: Vec<&NodeProto> = nodes.iter().filter(|n| is(n, "Conv")).collect();
    let bias = |n: &NodeProto| n.input.get(2).filter(|b| !b.is_empty()).cloned();
    let mut readers: HashMap<&str, Vec<&NodeProto>> = HashMap::new();
    for node in nodes {
        for input in &node.input {
            readers.entry(input.as_str()).or_default().push(node);
        }
    }
    let feeds_an_activation = |n: &NodeProto| {
        const AFTER_A_NORM: [&str; 7] = [
            "Relu",
            "Clip",
            "Add",
            "LeakyRelu",
            "Sigmoid",
            "HardSigmoid",
            "HardSwish",
        ];
        let readers = n
            .output
            .first()
            .and_then(|o| readers.get(o.as_str()))
            .map_or(&[][..], Vec::as_slice);
        readers
            .iter()
            .any(|r| AFTER_A_NORM.iter().any(|op| is(r, op)))
            && !readers.iter().any(|r| is(r, "BatchNormalization"))
    };
    let folded: Vec<&&NodeProto> = convs
        .iter()
        .filter(|n| {
            let module = n.input.get(1).and_then(|w| w.strip_suffix(".weight"));
            match (module, bias(n)) {
                (None, _) => true,
                (Some(module), Some(bias)) => bias.strip_suffix(".bias") != Some(module),
                (Some(_), None) => feeds_an_activation(n),
            }
        })
        .collect();
    let example = folded.first()?;
    Some(format!(
        "{} of the {} Conv nodes read a weight or bias that is no module's parameter, or no bias \
         where a BatchNorm would follow (node '{}' reads '{}'; the graph has {batch_norms} \
         BatchNormalization node(s)): this looks like an export that optimised the model, with \
         BatchNorm folded into the convolutions (an eval-mode export) or zero biases dropped (the \
         dynamo exporter's), and it would train without them. To keep them, export with \
         torch.onnx.export(model, args, f, dynamo=False, \
         training=torch.onnx.TrainingMode.PRESERVE)",
        folded.len(),
        convs.len(),
        node_layer_name(example),
        example.input[1..].join("', '"),
    ))
}

impl Constant {
    fn f32_values(&self) -> Option<Vec<f32>> {
        match &self.data {
            Some(Data::F32(v)) => Some(v.clone()),
            _ => None,
        }
    }
}

fn unique_name(builder: &GraphBuilder, base: &str) -> String {
    let taken = |n: &str| builder.contains(n);
    if !taken(base) {
        return base.to_string();
    }
    (1..)
        .map(|i| format!("{base}_{i}"))
        .find(|n| !taken(n))
        .expect("some suffix is free")
}

fn is_default_domain(node: &NodeProto) -> bool {
    matches!(node.domain.as_deref(), None | Some("") | Some("ai.onnx"))
}

fn input_name(node: &NodeProto, k: usize) -> Result<&str, String> {
    match node.input.get(k) {
        Some(name) if !name.is_empty() => Ok(name),
        _ => Err(format!("input {k} is missing")),
    }
}

fn first_output(node: &NodeProto) -> Result<&str, String> {
    match node.output.first() {
        Some(name) if !name.is_empty() => Ok(name),
        _ => Err("the node has no output".into()),
    }
}

/// Refuses a node whose outputs from `from` on are read: the mask of a Dropout, the indices of a
/// MaxPool, the running statistics of a training BatchNormalization.
fn unused_outputs(
    node: &NodeProto,
    from: usize,
    readers: &HashMap<String, Vec<Option<usize>>>,
    what: &str,
) -> Result<(), String> {
    for name in node.output.iter().skip(from).filter(|n| !n.is_empty()) {
        if readers.get(name).is_some_and(|r| !r.is_empty()) {
            return Err(format!(
                "output '{name}' ({what}) is read; only the first output is supported"
            ));
        }
    }
    Ok(())
}

/// The `<prefix>` of the `(suffix, name)`s named `<prefix>.<suffix>`, if there are some and they
/// agree. A name of another form is left out: PyTorch names a Linear's weight, transposed for a
/// MatMul, `onnx::MatMul_12`, while its bias keeps `fc.bias`, so that the layer `fc` saves
/// `fc.weight` in PyTorch's layout, as the user's `state_dict` has it.
pub(crate) fn common_param_prefix(names: &[(&str, &str)]) -> Option<String> {
    let mut prefix: Option<&str> = None;
    for (suffix, name) in names {
        let Some(p) = name.strip_suffix(suffix).and_then(|p| p.strip_suffix('.')) else {
            continue;
        };
        if p.is_empty() || prefix.is_some_and(|q| q != p) {
            return None;
        }
        prefix = Some(p);
    }
    prefix.map(str::to_string)
}

fn node_layer_name(node: &NodeProto) -> String {
    match node.name.as_deref() {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => node.output.first().cloned().unwrap_or_default(),
    }
}

/// Attributes each supported op may carry (any other is refused by name); `None` for an op
/// the importer does not map.
fn allowed_attributes(op_type: &str, opset: i64) -> Option<&'static [&'static str]> {
    Some(match op_type {
        "Conv" => &[
            "auto_pad",
            "dilations",
            "group",
            "kernel_shape",
            "pads",
            "strides",
        ],
        "Gemm" => &["alpha", "beta", "transA", "transB"],
        "MaxPool" => &[
            "auto_pad",
            "ceil_mode",
            "dilations",
            "kernel_shape",
            "pads",
            "storage_order",
            "strides",
        ],
        "AveragePool" => &[
            "auto_pad",
            "ceil_mode",
            "count_include_pad",
            "dilations",
            "kernel_shape",
            "pads",
            "strides",
        ],
        "BatchNormalization" => &["epsilon", "momentum", "training_mode", "spatial"],
        "Concat" | "Flatten" | "Softmax" => &["axis"],
        "Reshape" => &["allowzero"],
        "Dropout" if opset < 12 => &["ratio", "seed"],
        "Dropout" => &["seed"],
        "Constant" => &["value"],
        "HardSigmoid" => &["alpha", "beta"],
        "Clip" if opset < 11 => &["min", "max"],
        "ReduceMean" => &["axes", "keepdims", "noop_with_empty_axes"],
        "MatMul" | "Relu" | "Clip" | "Mul" | "Add" | "GlobalAveragePool" | "Identity" => &[],
        unary if let Some(unary) = op::Unary::from_onnx(unary) => match unary.default_alpha() {
            Some(_) => &["alpha"],
            None => &[],
        },
        _ => return None,
    })
}

/// What to say of an op the importer does not map: the supported ones, and for ops PyTorch
/// models commonly export, what to change in the model.
fn unsupported_op(op_type: &str) -> String {
    let hint = match op_type {
        "Resize" | "Upsample" => {
            " Upsampling is not supported: legion-rs trains classification CNNs."
        }
        "Gelu" | "Elu" | "Selu" | "Softplus" | "Mish" => {
            " Of the activations, ReLU, ReLU6, LeakyReLU, SiLU, Sigmoid, Tanh, Hardswish and \
             Hardsigmoid are supported: use one of those."
        }
        "Sub" | "Div" | "Pow" | "Sqrt" => {
            " Arithmetic on activations beyond Add and Mul is not supported; normalise the \
             input in the data pipeline rather than in the model."
        }
        "Pad" => " Pad inside the Conv or pool (its padding argument) instead.",
        "Transpose" | "Squeeze" | "Unsqueeze" | "Gather" | "Slice" => {
            " Shape manipulation beyond a flatten to [N, C·H·W] is not supported."
        }
        _ => "",
    };
    let supported: Vec<String> = supported_ops().into_iter().map(|(ops, _)| ops).collect();
    format!(
        "op '{op_type}' is not supported; supported: {}.{hint}",
        supported.join(", ")
    )
}

fn check_attributes(node: &NodeProto, allowed: &[&str]) -> Result<(), String> {
    for a in &node.attribute {
        let name = a.name.as_deref().unwrap_or("");
        if !allowed.contains(&name) {
            return Err(if allowed.is_empty() {
                format!("attribute '{name}' is not supported; this op takes none")
            } else {
                format!(
                    "attribute '{name}' is not supported; supported: {}",
                    allowed.join(", ")
                )
            });
        }
    }
    Ok(())
}

fn attribute<'n>(node: &'n NodeProto, name: &str) -> Option<&'n AttributeProto> {
    node.attribute
        .iter()
        .find(|a| a.name.as_deref() == Some(name))
}

/// The attribute's declared type, which must be `expected` where declared.
fn check_type(a: &AttributeProto, expected: attribute_proto::AttributeType) -> Result<(), String> {
    match a.r#type {
        Some(t) if t != expected as i32 => Err(format!(
            "attribute '{}' is of type {}, expected {}",
            a.name.as_deref().unwrap_or(""),
            attribute_proto::AttributeType::try_from(t)
                .map(|t| t.as_str_name())
                .unwrap_or("unknown"),
            expected.as_str_name()
        )),
        _ => Ok(()),
    }
}

fn int_attribute(node: &NodeProto, name: &str) -> Result<Option<i64>, String> {
    match attribute(node, name) {
        None => Ok(None),
        Some(a) => {
            check_type(a, attribute_proto::AttributeType::Int)?;
            a.i.map(Some)
                .ok_or_else(|| format!("attribute '{name}' has no integer value"))
        }
    }
}

fn required_int(node: &NodeProto, name: &str) -> Result<i64, String> {
    int_attribute(node, name)?.ok_or_else(|| format!("attribute '{name}' is required"))
}

fn float_attribute(node: &NodeProto, name: &str) -> Result<Option<f32>, String> {
    match attribute(node, name) {
        None => Ok(None),
        Some(a) => {
            check_type(a, attribute_proto::AttributeType::Float)?;
            a.f.map(Some)
                .ok_or_else(|| format!("attribute '{name}' has no float value"))
        }
    }
}

fn ints_attribute(node: &NodeProto, name: &str) -> Result<Option<Vec<i64>>, String> {
    match attribute(node, name) {
        None => Ok(None),
        Some(a) => {
            check_type(a, attribute_proto::AttributeType::Ints)?;
            Ok(Some(a.ints.clone()))
        }
    }
}

fn string_attribute(node: &NodeProto, name: &str) -> Result<Option<String>, String> {
    match attribute(node, name) {
        None => Ok(None),
        Some(a) => {
            check_type(a, attribute_proto::AttributeType::String)?;
            Ok(Some(
                String::from_utf8_lossy(a.s.as_deref().unwrap_or(&[])).into_owned(),
            ))
        }
    }
}

fn positive(v: i64, what: &str) -> Result<usize, String> {
    usize::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("{what} {v} must be positive"))
}

fn pair(v: &[i64], what: &str) -> Result<[usize; 2], String> {
    match v {
        [a, b] => Ok([positive(*a, what)?, positive(*b, what)?]),
        _ => Err(format!(
            "{what} {v:?} has {} values; only 2-D windows are supported",
            v.len()
        )),
    }
}

/// Strides and padding of a convolution or pooling window.
struct Window {
    stride: [usize; 2],
    padding: [usize; 2],
}

fn window_attributes(node: &NodeProto) -> Result<Window, String> {
    let stride = match ints_attribute(node, "strides")? {
        Some(s) => pair(&s, "strides")?,
        None => [1, 1],
    };
    if let Some(d) = ints_attribute(node, "dilations")?
        && d.iter().any(|&d| d != 1)
    {
        return Err(format!(
            "dilations {d:?} are not supported: legion-rs windows are dense (dilation 1)"
        ));
    }
    let auto_pad = string_attribute(node, "auto_pad")?.unwrap_or_default();
    let pads = ints_attribute(node, "pads")?;
    let padding = match auto_pad.as_str() {
        "" | "NOTSET" => match pads {
            Some(p) => symmetric_pads(&p)?,
            None => [0, 0],
        },
        "VALID" => [0, 0],
        other => {
            return Err(format!(
                "auto_pad {other} is not supported: export with explicit pads"
            ));
        }
    };
    Ok(Window { stride, padding })
}

/// ONNX pads `[top, left, bottom, right]` as legion-rs's `[h, w]`, which pads both sides alike.
pub(crate) fn symmetric_pads(p: &[i64]) -> Result<[usize; 2], String> {
    let [top, left, bottom, right] = p[..] else {
        return Err(format!(
            "pads {p:?} has {} values; a 2-D window has 4",
            p.len()
        ));
    };
    if top != bottom || left != right {
        return Err(format!(
            "pads {p:?} pad the two sides of an axis differently; only symmetric padding is \
             supported"
        ));
    }
    let non_negative = |v: i64| usize::try_from(v).map_err(|_| format!("pads {p:?} are negative"));
    Ok([non_negative(top)?, non_negative(left)?])
}

/// A pooling window that outputs its input unchanged (torchvision's adaptive pool exported at the
/// size it adapts to): 1×1, stride 1, no padding.
pub(crate) fn is_identity_window(
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
) -> bool {
    kernel == [1, 1] && stride == [1, 1] && padding == [0, 0]
}

/// An axis in `[-rank, rank)` as an index.
pub(crate) fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let rank = i64::try_from(rank).ok()?;
    let a = if axis < 0 { axis + rank } else { axis };
    (0..rank).contains(&a).then_some(a as usize)
}

/// Whether reshaping `dims` to `target` (ONNX semantics: 0 copies the dim unless `allow_zero`, −1
/// is inferred) gives `[N, rest]`, what `flatten` does.
pub(crate) fn reshape_is_flatten(dims: &[usize], target: &[i64], allow_zero: bool) -> bool {
    let [n, rest] = target else { return false };
    let Some(&batch) = dims.first() else {
        return false;
    };
    let numel: Option<usize> = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let Some(numel) = numel else { return false };
    let features = numel / batch.max(1);
    let resolve = |v: i64, copied: usize, inferred: usize| -> Option<usize> {
        match v {
            0 if !allow_zero => Some(copied),
            -1 => Some(inferred),
            v => usize::try_from(v).ok(),
        }
    };
    if *n == -1 && *rest == -1 {
        return false;
    }
    let second = dims.get(1).copied().unwrap_or(0);
    resolve(*n, batch, batch) == Some(batch) && resolve(*rest, second, features) == Some(features)
}

/// legion-rs's batch-norm momentum (PyTorch's: the weight of the new batch statistics) from
/// ONNX's (the weight of the running ones). PyTorch's 0.1 is stored as the f32 0.9; complementing
/// its shortest decimal form gives 0.1 back exactly, where `1.0 - 0.9f32` gives 0.10000002.
pub(crate) fn bn_momentum(onnx: f32) -> f32 {
    let decimal: f64 = onnx.to_string().parse().expect("a float's display parses");
    (1.0 - decimal) as f32
}

fn is_bias_shape(dims: &[usize], out: usize) -> bool {
    dims == [out] || dims == [1, out]
}

fn check_bias(b: Option<&Constant>, out: usize) -> Result<(), String> {
    match b {
        Some(b) if !is_bias_shape(&b.dims, out) => Err(format!(
            "bias '{}' has shape {:?}; expected [{out}]",
            b.name, b.dims
        )),
        _ => Ok(()),
    }
}

fn scalar_f32(c: &Constant) -> Result<f32, String> {
    match &c.data {
        Some(Data::F32(v)) if v.len() == 1 => Ok(v[0]),
        _ => Err(format!("'{}' must be a constant FLOAT scalar", c.name)),
    }
}

fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// A dimension of a graph input's shape.
#[derive(Clone, Debug, PartialEq)]
enum Dim {
    Fixed(usize),
    Dynamic(String),
}

fn tensor_dims(input: &proto::ValueInfoProto) -> Result<Vec<Dim>, String> {
    use proto::tensor_shape_proto::dimension::Value as D;
    use proto::type_proto::Value as T;
    let tensor = match input.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(T::TensorType(t)) => t,
        _ => return Err("is not a tensor".into()),
    };
    if tensor.elem_type != Some(proto::tensor_proto::DataType::Float as i32) {
        return Err(format!(
            "has element type {}; only FLOAT is supported",
            data_type_name(tensor.elem_type.unwrap_or(0))
        ));
    }
    let shape = tensor
        .shape
        .as_ref()
        .ok_or("has no shape; legion-rs needs every input's shape")?;
    shape
        .dim
        .iter()
        .map(|d| match &d.value {
            Some(D::DimValue(v)) => usize::try_from(*v)
                .map(Dim::Fixed)
                .map_err(|_| format!("has a negative dimension {v}")),
            Some(D::DimParam(p)) => Ok(Dim::Dynamic(p.clone())),
            None => Ok(Dim::Dynamic(String::new())),
        })
        .collect()
}

/// The data input's shape: N,C,H,W or N,C with every dim but N fixed; a dynamic N is 1.
fn data_shape(dims: &[Dim]) -> Result<Shape, String> {
    if dims.len() != 4 && dims.len() != 2 {
        return Err(format!(
            "has {} dims; the data must be N,C,H,W (images) or N,C",
            dims.len()
        ));
    }
    let mut fixed = Vec::with_capacity(dims.len());
    for (i, d) in dims.iter().enumerate() {
        fixed.push(match d {
            Dim::Fixed(n) => *n,
            Dim::Dynamic(_) if i == 0 => 1,
            Dim::Dynamic(p) => {
                return Err(format!(
                    "dimension {i} is dynamic ('{p}'); only the batch (dimension 0) may be: \
                     export with a fixed image size"
                ));
            }
        });
    }
    Ok(Shape::new(&fixed))
}

fn data_type_name(t: i32) -> &'static str {
    proto::tensor_proto::DataType::try_from(t)
        .map(|t| t.as_str_name())
        .unwrap_or("unknown")
}

/// A tensor of the file as a constant: FLOAT or INT64 values, inline (raw or typed).
fn constant(t: &TensorProto, external_dir: Option<&Path>) -> Result<Constant, String> {
    use proto::tensor_proto::{DataLocation, DataType};
    let name = t.name.clone().unwrap_or_default();
    let external = if t.data_location == Some(DataLocation::External as i32) {
        Some(external_data(t, external_dir)?)
    } else {
        None
    };
    if t.segment.is_some() {
        return Err("segmented tensors are not supported".into());
    }
    let dims = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("has a negative dimension {d}")))
        .collect::<Result<Vec<_>, _>>()?;
    let numel = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {dims:?} has more elements than fit in memory"))?;
    let raw = external.as_deref().or(t.raw_data.as_deref());
    let data_type = t.data_type.unwrap_or(0);
    let data = if data_type == DataType::Float as i32 {
        Data::F32(typed_or_raw(&t.float_data, raw, numel, f32::from_le_bytes)?)
    } else if data_type == DataType::Int64 as i32 {
        Data::I64(typed_or_raw(&t.int64_data, raw, numel, i64::from_le_bytes)?)
    } else if data_type == DataType::Bool as i32 {
        // Dropout's `training_mode` flag (stored in int32_data, or a byte each when raw).
        let flags = typed_or_raw(&t.int32_data, raw, numel, |[b]: [u8; 1]| i32::from(b))?;
        Data::I64(flags.into_iter().map(i64::from).collect())
    } else {
        return Err(format!(
            "has data type {}; only FLOAT weights, INT64 shapes and BOOL flags are supported",
            data_type_name(data_type)
        ));
    };
    Ok(Constant {
        name,
        dims,
        data: Some(data),
    })
}

/// The bytes of a tensor kept in an external data file: `location` (a path relative to the model
/// file's folder, inside it), from `offset`, `length` bytes or to the file's end; checked against
/// the file's size before anything is read.
fn external_data(t: &TensorProto, dir: Option<&Path>) -> Result<Vec<u8>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key.as_deref() == Some(key))
            .and_then(|e| e.value.as_deref())
    };
    let location = entry("location").ok_or("its data is external but names no `location`")?;
    let Some(dir) = dir else {
        return Err(format!(
            "its data is in the external file '{location}'; load the model from its file (next \
             to '{location}'), or export it with external_data=False"
        ));
    };
    let relative = Path::new(location);
    if relative.is_absolute()
        || relative
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!(
            "external data location '{location}' must be a plain path inside the model's folder"
        ));
    }
    let number = |key: &str| -> Result<Option<u64>, String> {
        entry(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| format!("external data {key} '{v}' is not a byte count"))
            })
            .transpose()
    };
    let offset = number("offset")?.unwrap_or(0);
    let path = dir.join(relative);
    let mut file = std::fs::File::open(&path)
        .map_err(|e| format!("reading its external data {}: {e}", path.display()))?;
    let size = file
        .metadata()
        .map_err(|e| format!("reading its external data {}: {e}", path.display()))?
        .len();
    let length = match number("length")? {
        Some(length) => length,
        None => size.saturating_sub(offset),
    };
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(format!(
            "its external data, {length} bytes from offset {offset}, runs past the end of {} \
             ({size} bytes)",
            path.display()
        ));
    }
    let length = usize::try_from(length).map_err(|_| "its external data is too large")?;
    let mut bytes = vec![0; length];
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(&mut bytes))
        .map_err(|e| format!("reading its external data {}: {e}", path.display()))?;
    Ok(bytes)
}

/// `numel` values from the typed field or, where that is empty, the little-endian raw bytes;
/// the count must match the shape (checked before anything is allocated from it).
fn typed_or_raw<T: Copy, const B: usize>(
    typed: &[T],
    raw: Option<&[u8]>,
    numel: usize,
    from_le: fn([u8; B]) -> T,
) -> Result<Vec<T>, String> {
    if !typed.is_empty() || raw.is_none() {
        if typed.len() != numel {
            return Err(format!(
                "holds {} values; its shape has {numel}",
                typed.len()
            ));
        }
        return Ok(typed.to_vec());
    }
    let raw = raw.unwrap_or_default();
    if Some(raw.len()) != numel.checked_mul(B) {
        return Err(format!(
            "holds {} raw bytes; its shape needs {numel} values of {B} bytes",
            raw.len()
        ));
    }
    Ok(raw
        .chunks_exact(B)
        .map(|c| from_le(c.try_into().expect("chunks of B bytes")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_keep_their_weights_names_where_those_share_a_prefix() {
        assert_eq!(
            common_param_prefix(&[("weight", "features.0.weight"), ("bias", "features.0.bias")]),
            Some("features.0".into())
        );
        assert_eq!(
            common_param_prefix(&[("weight", "a.weight"), ("bias", "b.bias")]),
            None
        );
        assert_eq!(common_param_prefix(&[("weight", "onnx::Conv_12")]), None);
        assert_eq!(
            common_param_prefix(&[("weight", "onnx::MatMul_12"), ("bias", "fc.bias")]),
            Some("fc".into())
        );
        assert_eq!(common_param_prefix(&[("weight", ".weight")]), None);
        assert_eq!(common_param_prefix(&[("weight", "xweight")]), None);
    }

    #[test]
    fn pads_must_be_symmetric_and_non_negative() {
        assert_eq!(symmetric_pads(&[1, 2, 1, 2]), Ok([1, 2]));
        assert!(
            symmetric_pads(&[0, 0, 1, 1])
                .unwrap_err()
                .contains("differently")
        );
        assert!(
            symmetric_pads(&[-1, 0, -1, 0])
                .unwrap_err()
                .contains("negative")
        );
        assert!(
            symmetric_pads(&[1, 1])
                .unwrap_err()
                .contains("has 2 values")
        );
    }

    #[test]
    fn only_a_one_by_one_unit_stride_window_is_the_identity() {
        assert!(is_identity_window([1, 1], [1, 1], [0, 0]));
        assert!(!is_identity_window([1, 1], [2, 2], [0, 0]));
        assert!(!is_identity_window([3, 3], [1, 1], [1, 1]));
    }

    #[test]
    fn reshapes_to_batch_by_features_are_flattens() {
        let dims = [8, 256, 6, 6];
        assert!(reshape_is_flatten(&dims, &[8, 9216], false));
        assert!(reshape_is_flatten(&dims, &[0, -1], false));
        assert!(reshape_is_flatten(&dims, &[-1, 9216], false));
        assert!(reshape_is_flatten(&dims, &[8, -1], false));
        assert!(!reshape_is_flatten(&dims, &[0, -1], true));
        assert!(!reshape_is_flatten(&dims, &[-1, -1], false));
        assert!(!reshape_is_flatten(&dims, &[16, 4608], false));
        assert!(!reshape_is_flatten(&dims, &[8, 256, 36], false));
        // 0 copies dim 1, which is the features only for a 2-D input
        assert!(!reshape_is_flatten(&dims, &[8, 0], false));
        assert!(reshape_is_flatten(&[8, 10], &[8, 0], false));
    }

    #[test]
    fn folded_batch_norm_is_told_from_a_model_without_one() {
        let node = |op: &str, inputs: &[&str], output: &str| NodeProto {
            op_type: Some(op.into()),
            name: Some(format!("/{op}")),
            input: inputs.iter().map(|i| i.to_string()).collect(),
            output: vec![output.into()],
            ..Default::default()
        };
        let conv = |w: &str, b: Option<&str>| {
            let mut inputs = vec!["x", w];
            inputs.extend(b);
            node("Conv", &inputs, "c")
        };
        let relu = node("Relu", &["c"], "r");
        let bn = node("BatchNormalization", &["c", "bn.weight"], "n");
        let concat = node("Concat", &["c", "x"], "cat");
        let pre_activation = node("BatchNormalization", &["r", "bn.weight"], "n");
        // AlexNet: convolutions with their own biases, no BatchNorm
        let alexnet = [conv("c.weight", Some("c.bias")), relu.clone()];
        assert_eq!(folded_batch_norm(&alexnet), None);
        // BatchNorm kept: a bias-less convolution feeds it; DenseNet's feeds a Concat
        let kept = [
            conv("c.weight", None),
            bn.clone(),
            node("Relu", &["n"], "r"),
        ];
        assert_eq!(folded_batch_norm(&kept), None);
        assert_eq!(folded_batch_norm(&[conv("c.weight", None), concat]), None);
        // folded, by either exporter, with or without BatchNorms left (DenseNet's pre-activation
        // ones cannot be folded)
        for (nodes, count) in [
            (
                vec![conv("onnx::Conv_7", Some("onnx::Conv_8")), relu.clone()],
                0,
            ),
            (vec![conv("c.weight", Some("c.weight_bias")), bn.clone()], 1),
            (
                vec![conv("c.weight", None), relu.clone(), pre_activation],
                1,
            ),
        ] {
            let w = folded_batch_norm(&nodes).expect("a warning");
            assert!(
                w.contains(&format!("the graph has {count} BatchNormalization node(s)")),
                "{w}"
            );
        }
    }

    #[test]
    fn onnx_momentum_is_the_complement_of_legion_rs() {
        assert_eq!(bn_momentum(0.9), 0.1);
        assert_eq!(bn_momentum(0.99), 0.01);
        assert_eq!(bn_momentum(0.0), 1.0);
    }

    #[test]
    fn axes_count_from_the_end_when_negative() {
        assert_eq!(normalize_axis(1, 4), Some(1));
        assert_eq!(normalize_axis(-3, 4), Some(1));
        assert_eq!(normalize_axis(-1, 2), Some(1));
        assert_eq!(normalize_axis(4, 4), None);
        assert_eq!(normalize_axis(-5, 4), None);
        assert_eq!(normalize_axis(i64::MIN, 4), None);
    }

    #[test]
    fn tensor_values_must_match_their_shape() {
        let t = |dims: Vec<i64>, raw: Vec<u8>| TensorProto {
            dims,
            data_type: Some(proto::tensor_proto::DataType::Float as i32),
            raw_data: Some(raw),
            ..Default::default()
        };
        let c = constant(&t(vec![2], 1.5f32.to_le_bytes().repeat(2)), None).unwrap();
        assert!(matches!(c.data, Some(Data::F32(v)) if v == [1.5, 1.5]));
        assert!(
            constant(&t(vec![3], vec![0; 8]), None)
                .unwrap_err()
                .contains("needs 3 values")
        );
        assert!(
            constant(&t(vec![1 << 40, 1 << 40], vec![]), None)
                .unwrap_err()
                .contains("more elements")
        );
        assert!(
            constant(&t(vec![-2], vec![]), None)
                .unwrap_err()
                .contains("negative")
        );
    }
}
