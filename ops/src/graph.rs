//! The layer graph, its builder API and its JSON form.
//!
//! Every layer has exactly one output tensor, so a tensor is named by the layer that produces it.
//! Layers are stored in a topological order (the builder only accepts inputs that already exist).

use crate::op::{self, Flops, Op, ParamSpec};
use crate::shape::{Shape, bounded_elements};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerId(pub usize);

/// The most FLOPs (forward and backward, all layers) one training step of a model may take: 2^62,
/// some 10^18, a million times AlexNet's step at batch 128. With every tensor within
/// [`crate::shape::MAX_ELEMENTS`], this keeps the planner's integer costs inside `u64`.
pub const MAX_STEP_FLOPS: u64 = 1 << 62;

#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<LayerId>,
    /// Shape of the layer's output tensor.
    pub shape: Shape,
}

/// What went wrong while building or loading a model; the message names the layer or JSON location.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{kind} '{layer}': {message}")]
    Layer {
        kind: &'static str,
        layer: String,
        message: String,
    },
    #[error("{source_name}: {location}: {message}")]
    Json {
        source_name: String,
        location: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// A parameter or buffer of the graph with its full name (`conv1.weight`).
#[derive(Clone, Debug, PartialEq)]
pub struct GraphParam {
    pub name: String,
    pub layer: LayerId,
    /// Index among the layer's `params()`.
    pub index: usize,
    pub spec: ParamSpec,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub name: String,
    layers: Vec<Layer>,
}

impl Graph {
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub fn layer(&self, id: LayerId) -> &Layer {
        &self.layers[id.0]
    }

    pub fn ids(&self) -> impl DoubleEndedIterator<Item = LayerId> + '_ {
        (0..self.layers.len()).map(LayerId)
    }

    pub fn find(&self, name: &str) -> Option<LayerId> {
        self.layers.iter().position(|l| l.name == name).map(LayerId)
    }

    pub fn input_shapes(&self, id: LayerId) -> Vec<Shape> {
        self.layer(id)
            .inputs
            .iter()
            .map(|&i| self.layer(i).shape)
            .collect()
    }

    /// Layers that read `id`'s output, in order.
    pub fn consumers(&self, id: LayerId) -> Vec<LayerId> {
        self.ids()
            .filter(|&l| self.layer(l).inputs.contains(&id))
            .collect()
    }

    /// The model's single input layer.
    pub fn input(&self) -> LayerId {
        self.ids()
            .find(|&l| matches!(self.layer(l).op, Op::Input(_)))
            .expect("a built graph has an input layer")
    }

    /// The loss layer, if the model has one.
    pub fn loss(&self) -> Option<LayerId> {
        self.ids()
            .find(|&l| matches!(self.layer(l).op, Op::SoftmaxCrossEntropy(_)))
    }

    /// The layer whose output feeds the loss (the logits).
    pub fn logits(&self) -> Option<LayerId> {
        self.loss().map(|l| self.layer(l).inputs[0])
    }

    pub fn batch(&self) -> usize {
        self.layer(self.input()).shape.dim(0)
    }

    /// Values of one sample of the input (`C·H·W` of an image).
    pub fn input_sample_len(&self) -> usize {
        self.layer(self.input()).shape.numel() / self.batch().max(1)
    }

    /// By layer, whether a training step computes the gradient of its output: the loss and every
    /// layer upstream of it except the input.
    pub fn layers_with_gradient(&self) -> Vec<bool> {
        let mut has = vec![false; self.layers.len()];
        for id in self.ids().rev() {
            has[id.0] = match self.layer(id).op {
                Op::Input(_) => false,
                Op::SoftmaxCrossEntropy(_) => true,
                _ => self.consumers(id).iter().any(|c| has[c.0]),
            };
        }
        has
    }

    /// Whether layer `id`'s backward computes the gradient of its `k`-th input: only an input fed
    /// by another layer (not the data) needs one.
    pub fn input_needs_gradient(&self, id: LayerId, k: usize) -> bool {
        !matches!(self.layer(self.layer(id).inputs[k]).op, Op::Input(_))
    }

    pub fn layer_params(&self, id: LayerId) -> Vec<ParamSpec> {
        self.layer(id).op.spec().params(&self.input_shapes(id))
    }

    /// All parameters and buffers, in layer order.
    pub fn params(&self) -> Vec<GraphParam> {
        let mut out = Vec::new();
        for id in self.ids() {
            for (index, spec) in self.layer_params(id).into_iter().enumerate() {
                out.push(GraphParam {
                    name: format!("{}.{}", self.layer(id).name, spec.suffix),
                    layer: id,
                    index,
                    spec,
                });
            }
        }
        out
    }

    /// Number of trainable scalars.
    pub fn param_count(&self) -> u64 {
        self.params()
            .iter()
            .filter(|p| p.spec.trainable)
            .map(|p| p.spec.shape.numel() as u64)
            .sum()
    }

    pub fn layer_flops(&self, id: LayerId) -> Flops {
        let l = self.layer(id);
        l.op.spec()
            .flops(&self.input_shapes(id), &l.shape)
            .expect("the builder checked every layer's FLOP count")
    }

    /// FLOPs of one training step over the whole batch (at most [`MAX_STEP_FLOPS`] together).
    pub fn flops(&self) -> Flops {
        self.ids().fold(Flops::default(), |acc, id| {
            let f = self.layer_flops(id);
            Flops {
                forward: acc.forward + f.forward,
                backward: acc.backward + f.backward,
            }
        })
    }

    /// The same model at another batch size (shapes re-inferred).
    pub fn with_batch(&self, batch: usize) -> Result<Graph, ModelError> {
        let mut b = GraphBuilder::new(&self.name);
        for l in &self.layers {
            let mut op = l.op.clone();
            if let Op::Input(i) = &mut op {
                let mut dims = i.shape.dims().to_vec();
                dims[0] = batch;
                i.shape = Shape::new(&dims);
            }
            b.layer(&l.name, op, &l.inputs)?;
        }
        Ok(b.finish())
    }

    pub fn to_json(&self) -> String {
        let layers: Vec<serde_json::Value> = self
            .layers
            .iter()
            .map(|l| {
                let mut v = serde_json::to_value(&l.op).expect("ops serialize");
                let obj = v.as_object_mut().expect("ops serialize as objects");
                obj.insert("name".into(), l.name.clone().into());
                if !l.inputs.is_empty() {
                    let names: Vec<_> = l
                        .inputs
                        .iter()
                        .map(|&i| self.layer(i).name.clone())
                        .collect();
                    obj.insert("inputs".into(), names.into());
                }
                v
            })
            .collect();
        let doc = ModelJson {
            name: self.name.clone(),
            layers,
        };
        serde_json::to_string_pretty(&doc).expect("model json serializes")
    }

    /// Parses a model from JSON text. `source_name` (a file name) prefixes every error.
    pub fn from_json(text: &str, source_name: &str) -> Result<Graph, ModelError> {
        let json_err = |location: String, message: String| ModelError::Json {
            source_name: source_name.to_string(),
            location,
            message,
        };
        let doc: ModelJson = serde_json::from_str(text).map_err(|e| {
            json_err(
                format!("line {} column {}", e.line(), e.column()),
                e.to_string(),
            )
        })?;
        let mut b = GraphBuilder::new(&doc.name);
        for (i, mut v) in doc.layers.into_iter().enumerate() {
            let loc = format!("layers[{i}]");
            let obj = v
                .as_object_mut()
                .ok_or_else(|| json_err(loc.clone(), "expected an object".into()))?;
            let name = match obj.remove("name") {
                Some(serde_json::Value::String(s)) => s,
                _ => return Err(json_err(loc, "missing string field \"name\"".into())),
            };
            let loc = format!("{loc} ('{name}')");
            let inputs: Vec<String> = match obj.remove("inputs") {
                None => Vec::new(),
                Some(v) => serde_json::from_value(v).map_err(|e| {
                    json_err(
                        loc.clone(),
                        format!("\"inputs\" must be a list of layer names: {e}"),
                    )
                })?,
            };
            let op: Op =
                serde_json::from_value(v).map_err(|e| json_err(loc.clone(), e.to_string()))?;
            let mut ids = Vec::with_capacity(inputs.len());
            for input in &inputs {
                match b.names.get(input) {
                    Some(&id) => ids.push(id),
                    None => {
                        return Err(json_err(
                            loc,
                            format!("input '{input}' is not a layer defined before this one"),
                        ));
                    }
                }
            }
            b.layer(&name, op, &ids)
                .map_err(|e| json_err(loc, e.to_string()))?;
        }
        b.check_complete()
            .map_err(|m| json_err("layers".into(), m))?;
        Ok(b.finish())
    }

    pub fn load_json(path: &Path) -> Result<Graph, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Graph::from_json(&text, &path.display().to_string())
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelJson {
    name: String,
    layers: Vec<serde_json::Value>,
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "model {} ({} layers)", self.name, self.layers.len())?;
        for l in &self.layers {
            let inputs: Vec<_> = l
                .inputs
                .iter()
                .map(|&i| self.layer(i).name.as_str())
                .collect();
            writeln!(
                f,
                "  {:<24} {:<22} {:<20} <- {}",
                l.name,
                l.op.kind(),
                l.shape.to_string(),
                inputs.join(", ")
            )?;
        }
        Ok(())
    }
}

/// Builds a graph layer by layer, FlexFlow style:
///
/// ```
/// use legion_ops::{GraphBuilder, Shape, op::{Conv2d, Pool2d, Dense}};
/// let mut m = GraphBuilder::new("tiny");
/// let x = m.input("data", Shape::nchw(8, 3, 32, 32))?;
/// let x = m.conv2d("conv1", x, Conv2d::new(16, 3).padding(1).relu())?;
/// let x = m.pool2d("pool1", x, Pool2d::max(2))?;
/// let x = m.flatten("flat", x)?;
/// let x = m.dense("fc", x, Dense::new(10))?;
/// m.softmax_cross_entropy("loss", x)?;
/// let graph = m.finish();
/// assert_eq!(graph.layers().len(), 6);
/// # Ok::<(), legion_ops::ModelError>(())
/// ```
pub struct GraphBuilder {
    name: String,
    layers: Vec<Layer>,
    names: HashMap<String, LayerId>,
    /// FLOPs of a training step over the layers so far (at most [`MAX_STEP_FLOPS`]).
    step_flops: u64,
}

impl GraphBuilder {
    pub fn new(name: &str) -> GraphBuilder {
        GraphBuilder {
            name: name.to_string(),
            layers: Vec::new(),
            names: HashMap::new(),
            step_flops: 0,
        }
    }

    pub fn shape(&self, id: LayerId) -> Shape {
        self.layers[id.0].shape
    }

    /// Whether a layer of this name was added.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// Adds a layer of any op; the typed helpers below call this.
    pub fn layer(&mut self, name: &str, op: Op, inputs: &[LayerId]) -> Result<LayerId, ModelError> {
        let err = |message: String| ModelError::Layer {
            kind: op.kind(),
            layer: name.to_string(),
            message,
        };
        if name.is_empty() {
            return Err(err("a layer needs a non-empty name".into()));
        }
        if self.names.contains_key(name) {
            return Err(err("a layer with this name already exists".into()));
        }
        match op.arity() {
            Some(n) if n != inputs.len() => {
                return Err(err(format!("takes {n} input(s), got {}", inputs.len())));
            }
            None if inputs.len() < 2 => {
                return Err(err(format!("takes 2 or more inputs, got {}", inputs.len())));
            }
            _ => {}
        }
        if matches!(op, Op::Input(_)) && self.layers.iter().any(|l| matches!(l.op, Op::Input(_))) {
            return Err(err("a model has exactly one input layer".into()));
        }
        if let Some(bad) = inputs.iter().find(|i| i.0 >= self.layers.len()) {
            return Err(err(format!("input {} does not exist", bad.0)));
        }
        if self
            .layers
            .iter()
            .any(|l| matches!(l.op, Op::SoftmaxCrossEntropy(_)))
        {
            return Err(err("the loss must be the last layer".into()));
        }
        let shapes: Vec<Shape> = inputs.iter().map(|&i| self.shape(i)).collect();
        let shape = op.spec().infer_shape(&shapes).map_err(err)?;
        let step_flops = self.check_sizes(&op, &shapes, &shape).map_err(err)?;
        self.step_flops = step_flops;
        let id = LayerId(self.layers.len());
        self.names.insert(name.to_string(), id);
        self.layers.push(Layer {
            name: name.to_string(),
            op,
            inputs: inputs.to_vec(),
            shape,
        });
        Ok(id)
    }

    pub fn input(&mut self, name: &str, shape: Shape) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Input(op::Input { shape }), &[])
    }

    pub fn conv2d(
        &mut self,
        name: &str,
        x: LayerId,
        conv: op::Conv2d,
    ) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Conv2d(conv), &[x])
    }

    pub fn pool2d(
        &mut self,
        name: &str,
        x: LayerId,
        pool: op::Pool2d,
    ) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Pool2d(pool), &[x])
    }

    /// Average pooling to `output` (rows, columns) whatever the input's size: PyTorch's
    /// `nn.AdaptiveAvgPool2d(output)`.
    pub fn adaptive_avg_pool2d(
        &mut self,
        name: &str,
        x: LayerId,
        output: [usize; 2],
    ) -> Result<LayerId, ModelError> {
        let pool = op::AdaptiveAvgPool2d { output };
        self.layer(name, Op::AdaptiveAvgPool2d(pool), &[x])
    }

    /// Average pooling over the whole remaining spatial extent (torchvision's adaptive pool to 1×1).
    pub fn global_avg_pool(&mut self, name: &str, x: LayerId) -> Result<LayerId, ModelError> {
        let s = self.shape(x);
        if s.ndim() != 4 {
            return self.layer(name, Op::Pool2d(op::Pool2d::avg(1)), &[x]);
        }
        let pool = op::Pool2d {
            kind: op::PoolKind::Avg,
            kernel: [s.dim(2), s.dim(3)],
            stride: [s.dim(2), s.dim(3)],
            padding: [0, 0],
            ceil_mode: false,
        };
        self.layer(name, Op::Pool2d(pool), &[x])
    }

    pub fn dense(
        &mut self,
        name: &str,
        x: LayerId,
        dense: op::Dense,
    ) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Dense(dense), &[x])
    }

    pub fn relu(&mut self, name: &str, x: LayerId) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Relu(op::Relu {}), &[x])
    }

    /// An element-wise unary op (`op::Unary`: sigmoid, tanh, ..., or an `op::UnaryOp` with its
    /// attribute: `UnaryOp::with_alpha(Unary::LeakyRelu, 0.2)`).
    pub fn unary(
        &mut self,
        name: &str,
        x: LayerId,
        op: impl Into<op::UnaryOp>,
    ) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Unary(op.into()), &[x])
    }

    pub fn flatten(&mut self, name: &str, x: LayerId) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Flatten(op::Flatten {}), &[x])
    }

    pub fn concat(&mut self, name: &str, xs: &[LayerId]) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Concat(op::Concat {}), xs)
    }

    pub fn add(&mut self, name: &str, a: LayerId, b: LayerId) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Add(op::Add {}), &[a, b])
    }

    /// `x · s`: `s` of `x`'s shape, or an `[N, C, 1, 1]` channel scale (squeeze-and-excitation).
    pub fn mul(&mut self, name: &str, x: LayerId, s: LayerId) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Mul(op::Mul {}), &[x, s])
    }

    pub fn batch_norm(
        &mut self,
        name: &str,
        x: LayerId,
        bn: op::BatchNorm,
    ) -> Result<LayerId, ModelError> {
        self.layer(name, Op::BatchNorm(bn), &[x])
    }

    pub fn dropout(&mut self, name: &str, x: LayerId, rate: f32) -> Result<LayerId, ModelError> {
        self.layer(name, Op::Dropout(op::Dropout { rate }), &[x])
    }

    pub fn softmax_cross_entropy(
        &mut self,
        name: &str,
        logits: LayerId,
    ) -> Result<LayerId, ModelError> {
        self.layer(
            name,
            Op::SoftmaxCrossEntropy(op::SoftmaxCrossEntropy {}),
            &[logits],
        )
    }

    /// Checks that the layer's output and parameters are within [`crate::shape::MAX_ELEMENTS`]
    /// and the step's FLOPs with this layer within [`MAX_STEP_FLOPS`]; returns those FLOPs. After
    /// this, element, byte and FLOP counts derived from the layer cannot overflow.
    fn check_sizes(&self, op: &Op, inputs: &[Shape], shape: &Shape) -> Result<u64, String> {
        if shape.dims().contains(&0) {
            return Err(format!("output shape {shape} has a zero extent"));
        }
        bounded_elements(shape.dims()).map_err(|e| format!("output {e}"))?;
        for p in op.spec().params(inputs) {
            bounded_elements(p.shape.dims()).map_err(|e| format!("{} {e}", p.suffix))?;
        }
        op.spec()
            .flops(inputs, shape)
            .and_then(Flops::checked_total)
            .and_then(|f| f.checked_add(self.step_flops))
            .filter(|&f| f <= MAX_STEP_FLOPS)
            .ok_or_else(|| {
                "with this layer a training step takes more than 2^62 FLOPs (the most a model may)"
                    .to_string()
            })
    }

    fn check_complete(&self) -> Result<(), String> {
        if !self.layers.iter().any(|l| matches!(l.op, Op::Input(_))) {
            return Err("the model has no input layer".into());
        }
        Ok(())
    }

    /// The finished graph.
    ///
    /// # Panics
    /// If no input layer was added (every builder method already validated the rest).
    pub fn finish(self) -> Graph {
        if let Err(e) = self.check_complete() {
            panic!("model '{}': {e}", self.name);
        }
        Graph {
            name: self.name,
            layers: self.layers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Conv2d, Dense, Pool2d};

    fn tiny() -> Graph {
        let mut m = GraphBuilder::new("tiny");
        let x = m.input("data", Shape::nchw(4, 3, 16, 16)).unwrap();
        let a = m
            .conv2d("a", x, Conv2d::new(8, 3).padding(1).relu())
            .unwrap();
        let b = m.conv2d("b", x, Conv2d::new(8, 1)).unwrap();
        let c = m.concat("cat", &[a, b]).unwrap();
        let p = m.pool2d("pool", c, Pool2d::max(2)).unwrap();
        let f = m.flatten("flat", p).unwrap();
        let d = m.dense("fc", f, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", d).unwrap();
        m.finish()
    }

    #[test]
    fn json_round_trip() {
        let g = tiny();
        let text = g.to_json();
        let back = Graph::from_json(&text, "tiny.json").unwrap();
        assert_eq!(g, back);
    }

    #[test]
    fn layer_errors_name_the_layer() {
        let mut m = GraphBuilder::new("bad");
        let x = m.input("data", Shape::nc(4, 10)).unwrap();
        let e = m.conv2d("conv3", x, Conv2d::new(4, 3)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "conv2d 'conv3': input has 2 dims, expected 4 (N,C,H,W)"
        );
    }

    #[test]
    fn json_errors_have_locations() {
        let text = r#"{"name":"m","layers":[
            {"name":"data","op":"input","shape":[2,3,8,8]},
            {"name":"c","op":"conv2d","inputs":["nope"],"out_channels":4,"kernel":[3,3]}]}"#;
        let e = Graph::from_json(text, "m.json").unwrap_err().to_string();
        assert!(
            e.starts_with("m.json: layers[1] ('c'): input 'nope'"),
            "{e}"
        );

        let text = r#"{"name":"m","layers":[{"name":"data","op":"inptu","shape":[2,3]}]}"#;
        let e = Graph::from_json(text, "m.json").unwrap_err().to_string();
        assert!(
            e.contains("layers[0] ('data')")
                && e.contains("unknown op `inptu`, expected one of `input`, `conv2d`,"),
            "{e}"
        );

        let text = r#"{"name":"m","layers":[{"name":"data","op":"input","shape":[2,3]},
            {"name":"fc","op":"dense","inputs":["data"],"out_featurs":3}]}"#;
        let e = Graph::from_json(text, "m.json").unwrap_err().to_string();
        assert!(
            e.contains("layers[1] ('fc')") && e.contains("out_featurs"),
            "{e}"
        );

        let e = Graph::from_json("{\"name\": \"m\", \"layers\": [", "m.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("m.json: line 1 column"), "{e}");
    }

    #[test]
    fn sizes_past_the_bounds_are_errors_naming_the_layer() {
        let err = |r: Result<LayerId, ModelError>| r.unwrap_err().to_string();
        let mut m = GraphBuilder::new("big");
        let huge = 1 << 32;
        assert_eq!(
            err(m.input("data", Shape::nchw(8, huge, huge, huge))),
            "input 'data': output [8, 4294967296, 4294967296, 4294967296] has more than 2^40 \
             elements (the most a tensor may have)"
        );
        assert!(
            err(m.input("data", Shape::nchw(0, 3, 8, 8))).ends_with("has a zero extent"),
            "a zero batch"
        );
        let x = m.input("data", Shape::nchw(2, 3, 8, 8)).unwrap();
        // the padded extent overflows rather than wrapping to a window that fits
        let conv = Conv2d::new(4, 3).padding(usize::MAX / 2 + 1);
        assert!(err(m.conv2d("c", x, conv)).contains("does not fit"));
        let conv = Conv2d::new(1 << 38, 3);
        assert_eq!(
            err(m.conv2d("c", x, conv)),
            "conv2d 'c': weight [274877906944, 3, 3, 3] has more than 2^40 elements (the most \
             a tensor may have)"
        );

        // 2^20 × 2^20 features into 2^20: every tensor within bounds, 2^60 multiply-adds
        let mut m = GraphBuilder::new("slow");
        let x = m.input("data", Shape::nc(1 << 20, 1 << 20)).unwrap();
        assert!(err(m.dense("fc", x, Dense::new(1 << 20))).ends_with(
            "with this layer a training step takes more than 2^62 FLOPs (the most a model may)"
        ));
        assert!(m.dense("fc", x, Dense::new(1 << 10)).is_ok());

        let g = tiny();
        assert!(
            g.with_batch(0)
                .unwrap_err()
                .to_string()
                .starts_with("input 'data': output shape (0, 3, 16, 16) has a zero extent")
        );
    }

    #[test]
    fn with_batch_reinfers_shapes() {
        let g = tiny().with_batch(32).unwrap();
        assert_eq!(g.batch(), 32);
        assert_eq!(g.layer(g.find("fc").unwrap()).shape, Shape::nc(32, 10));
    }
}
