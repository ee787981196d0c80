//! Single-device reference training: whole-tensor forward and backward through the CPU kernels, then
//! SGD with momentum and weight decay.
//!
//! This is deliberately independent of the distributed runtime: it is the reference every strategy is
//! checked against (same weights after N steps), so it shares only the kernels and the initialisation.

use crate::checkpoint::{self, TensorRef};
use crate::graph::{Graph, GraphParam, LayerId};
use crate::kernels::softmax_ce::LabelOutOfRange;
use crate::kernels::{self, View, ViewMut};
use crate::op::{Init, Op};
use crate::rng::{self, Rng};
use crate::shape::Shape;
use std::collections::BTreeMap;

/// Stochastic gradient descent with PyTorch's momentum and (coupled) weight decay:
/// `d = g + wd·w; v = μ·v + d; w -= lr·v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            lr: 0.03,
            momentum: 0.9,
            weight_decay: 5e-4,
        }
    }
}

impl Sgd {
    /// Applies one update to `w` given its gradient and momentum buffer.
    pub fn update(&self, w: &mut [f32], grad: &[f32], velocity: &mut [f32]) {
        for ((w, &g), v) in w.iter_mut().zip(grad).zip(velocity.iter_mut()) {
            let d = g + self.weight_decay * *w;
            *v = self.momentum * *v + d;
            *w -= self.lr * *v;
        }
    }
}

/// The values of every parameter and buffer of a graph, in `Graph::params` order.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamStore {
    pub params: Vec<GraphParam>,
    pub values: Vec<Vec<f32>>,
    /// Index of each layer's first parameter in `params`.
    first: Vec<usize>,
}

impl ParamStore {
    /// Seeded initialisation: parameter `i` draws from its own stream, a pure function of
    /// (seed, i), so a model's initial weights never depend on how it will be partitioned.
    pub fn init(graph: &Graph, seed: u64) -> ParamStore {
        let params = graph.params();
        let values = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.spec.shape.numel();
                let mut r = Rng::new(rng::hash(&[seed, i as u64]));
                match p.spec.init {
                    Init::FanInUniform { fan_in } => {
                        let b = 1.0 / (fan_in as f32).sqrt();
                        (0..n).map(|_| r.uniform(-b, b)).collect()
                    }
                    Init::Zeros => vec![0.0; n],
                    Init::Ones => vec![1.0; n],
                }
            })
            .collect();
        ParamStore::from_parts(graph, params, values)
    }

    /// Values in `Graph::params` order (e.g. gathered from the devices of a distributed run).
    pub fn from_values(graph: &Graph, values: Vec<Vec<f32>>) -> ParamStore {
        let params = graph.params();
        assert_eq!(params.len(), values.len(), "one value vector per parameter");
        ParamStore::from_parts(graph, params, values)
    }

    fn from_parts(graph: &Graph, params: Vec<GraphParam>, values: Vec<Vec<f32>>) -> ParamStore {
        // `Graph::params` lists parameters in layer order, so a layer's first slot is the number of
        // parameters of the layers before it.
        let first = (0..graph.layers().len())
            .map(|l| params.partition_point(|p| p.layer.0 < l))
            .collect();
        ParamStore {
            params,
            values,
            first,
        }
    }

    /// Values from a checkpoint, which must hold exactly the graph's parameters and buffers.
    pub fn from_checkpoint(
        graph: &Graph,
        ckpt: checkpoint::Checkpoint,
    ) -> Result<ParamStore, checkpoint::CheckpointError> {
        let params = graph.params();
        let expected: Vec<(String, Shape)> = params
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape))
            .collect();
        ckpt.check_against(&expected)?;
        let mut by_name: BTreeMap<String, Vec<f32>> =
            ckpt.tensors.into_iter().map(|t| (t.name, t.data)).collect();
        let values = params
            .iter()
            .map(|p| by_name.remove(&p.name).expect("checked above"))
            .collect();
        Ok(ParamStore::from_parts(graph, params, values))
    }

    pub fn slot(&self, layer: LayerId, index: usize) -> usize {
        self.first[layer.0] + index
    }

    pub fn get(&self, layer: LayerId, index: usize) -> &[f32] {
        &self.values[self.slot(layer, index)]
    }

    /// Borrowed views of every parameter and buffer, for `checkpoint::save`.
    pub fn tensors(&self) -> Vec<TensorRef<'_>> {
        self.params
            .iter()
            .zip(&self.values)
            .map(|(p, v)| TensorRef {
                name: &p.name,
                shape: p.spec.shape,
                data: v,
            })
            .collect()
    }
}

/// Everything a run needs to continue exactly: parameters and buffers, SGD momentum (by parameter
/// slot; zeros for buffers) and the steps taken.
///
/// As a checkpoint: a safetensors file with the parameters and buffers under their own names (so it
/// also serves as plain weights, e.g. for `--init`), the momentum of each trainable parameter as
/// `momentum/<name>`, and the step in the metadata (`step`).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingState {
    pub params: ParamStore,
    pub momentum: Vec<Vec<f32>>,
    pub step: u64,
}

/// Name prefix of momentum tensors in a checkpoint.
pub const MOMENTUM_PREFIX: &str = "momentum/";

impl TrainingState {
    /// Step 0: the given weights, no momentum yet.
    pub fn start(params: ParamStore) -> TrainingState {
        let momentum = params.values.iter().map(|v| vec![0.0; v.len()]).collect();
        TrainingState {
            params,
            momentum,
            step: 0,
        }
    }

    /// Writes the state atomically, with `metadata` added (e.g. the model name).
    pub fn save(
        &self,
        path: &std::path::Path,
        mut metadata: BTreeMap<String, String>,
    ) -> Result<(), checkpoint::CheckpointError> {
        let momentum_names: Vec<String> = self
            .params
            .params
            .iter()
            .map(|p| format!("{MOMENTUM_PREFIX}{}", p.name))
            .collect();
        let mut tensors = self.params.tensors();
        for ((p, v), name) in self
            .params
            .params
            .iter()
            .zip(&self.momentum)
            .zip(&momentum_names)
        {
            if p.spec.trainable {
                tensors.push(TensorRef {
                    name,
                    shape: p.spec.shape,
                    data: v,
                });
            }
        }
        metadata.insert("step".into(), self.step.to_string());
        checkpoint::save(path, &tensors, &metadata)
    }

    /// Reads a state saved by [`save`](Self::save); a plain weights file (no momentum, no step)
    /// starts at step 0 with zero momentum.
    pub fn from_checkpoint(
        graph: &Graph,
        mut ckpt: checkpoint::Checkpoint,
    ) -> Result<TrainingState, checkpoint::CheckpointError> {
        let step = match ckpt.metadata.get("step") {
            Some(s) => s
                .parse()
                .map_err(|_| checkpoint::CheckpointError::BadMetadata {
                    key: "step".into(),
                    value: s.clone(),
                })?,
            None => 0,
        };
        let (momentum, weights): (Vec<_>, Vec<_>) = std::mem::take(&mut ckpt.tensors)
            .into_iter()
            .partition(|t| t.name.starts_with(MOMENTUM_PREFIX));
        ckpt.tensors = weights;
        let params = ParamStore::from_checkpoint(graph, ckpt)?;
        let mut by_name: BTreeMap<String, checkpoint::NamedTensor> = momentum
            .into_iter()
            .map(|t| (t.name[MOMENTUM_PREFIX.len()..].to_string(), t))
            .collect();
        let mut state = TrainingState::start(params);
        state.step = step;
        for (p, v) in state.params.params.iter().zip(&mut state.momentum) {
            if let Some(t) = by_name.remove(&p.name) {
                if t.shape != p.spec.shape {
                    return Err(checkpoint::CheckpointError::WrongShape {
                        name: t.name,
                        expected: p.spec.shape,
                        found: t.shape,
                    });
                }
                *v = t.data;
            }
        }
        if let Some((_, t)) = by_name.into_iter().next() {
            return Err(checkpoint::CheckpointError::UnexpectedTensor {
                name: t.name,
                found: t.shape,
            });
        }
        Ok(state)
    }
}

/// What one training step measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean softmax cross-entropy over the batch.
    pub loss: f32,
    /// Samples whose arg-max logit is the label.
    pub correct: usize,
}

/// Trains a graph on one device.
pub struct Trainer {
    graph: Graph,
    params: ParamStore,
    velocity: Vec<Vec<f32>>,
    sgd: Sgd,
    seed: u64,
    step: u64,
}

impl Trainer {
    pub fn new(graph: Graph, params: ParamStore, sgd: Sgd, seed: u64) -> Trainer {
        let state = TrainingState::start(params);
        Trainer::resume(graph, state, sgd, seed)
    }

    /// Continues from a saved state: same weights, momentum and step count (dropout masks and
    /// data order depend on the step), so the run goes on as if it had never stopped.
    pub fn resume(graph: Graph, state: TrainingState, sgd: Sgd, seed: u64) -> Trainer {
        Trainer {
            graph,
            params: state.params,
            velocity: state.momentum,
            sgd,
            seed,
            step: state.step,
        }
    }

    /// The state to checkpoint.
    pub fn state(&self) -> TrainingState {
        TrainingState {
            params: self.params.clone(),
            momentum: self.velocity.clone(),
            step: self.step,
        }
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One forward, backward and update on a batch of `graph.batch()` samples.
    pub fn step(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, LabelOutOfRange> {
        let pass = Pass::new(&self.graph, &self.params, self.seed, self.step);
        let (acts, stats, saved) = pass.forward(images, labels)?;
        let grads = pass.backward(&acts, &saved, labels)?;
        let Grads {
            params: param_grads,
        } = grads;
        for (slot, g) in param_grads.into_iter().enumerate() {
            if let Some(g) = g {
                self.sgd
                    .update(&mut self.params.values[slot], &g, &mut self.velocity[slot]);
            }
        }
        for (slot, value) in saved.buffer_updates {
            self.params.values[slot] = value;
        }
        self.step += 1;
        Ok(stats)
    }
}

/// Per-layer state the backward pass needs from the forward pass.
#[derive(Default)]
struct Saved {
    /// Batch statistics of each batch-norm layer, by layer index.
    bn: BTreeMap<usize, kernels::batch_norm::BatchStats>,
    /// New values of buffers (running statistics) by parameter slot.
    buffer_updates: Vec<(usize, Vec<f32>)>,
}

struct Grads {
    params: Vec<Option<Vec<f32>>>,
}

/// One forward/backward pass over the whole batch.
struct Pass<'a> {
    graph: &'a Graph,
    params: &'a ParamStore,
    seed: u64,
    step: u64,
}

impl<'a> Pass<'a> {
    fn new(graph: &'a Graph, params: &'a ParamStore, seed: u64, step: u64) -> Pass<'a> {
        Pass {
            graph,
            params,
            seed,
            step,
        }
    }

    fn view(&self, layer: LayerId, data: &'a [f32]) -> View<'a> {
        View::new(self.graph.layer(layer).shape.full_rect(), data)
    }

    fn param_view(&self, layer: LayerId, index: usize) -> View<'a> {
        let slot = self.params.slot(layer, index);
        View::new(
            self.params.params[slot].spec.shape.full_rect(),
            &self.params.values[slot],
        )
    }

    fn forward(
        &self,
        images: &[f32],
        labels: &[u32],
    ) -> Result<(Vec<Vec<f32>>, StepStats, Saved), LabelOutOfRange> {
        let g = self.graph;
        let mut acts: Vec<Vec<f32>> = Vec::with_capacity(g.layers().len());
        let mut saved = Saved::default();
        let mut stats = StepStats {
            loss: 0.0,
            correct: 0,
        };
        for id in g.ids() {
            let layer = g.layer(id);
            let out_rect = layer.shape.full_rect();
            let mut y = vec![0.0; layer.shape.numel()];
            let input = |k: usize| -> View<'_> {
                let src = layer.inputs[k];
                View::new(g.layer(src).shape.full_rect(), &acts[src.0])
            };
            let in_shape = |k: usize| g.layer(layer.inputs[k]).shape;
            match &layer.op {
                Op::Input(_) => {
                    assert_eq!(
                        images.len(),
                        y.len(),
                        "batch images do not match the input shape"
                    );
                    y.copy_from_slice(images);
                }
                Op::Conv2d(op) => {
                    let b = op.bias.then(|| self.param_view(id, 1));
                    kernels::conv2d::conv2d_forward(
                        op,
                        in_shape(0),
                        input(0),
                        self.param_view(id, 0),
                        b,
                        ViewMut::new(out_rect, &mut y),
                    );
                }
                Op::Pool2d(op) => kernels::pool2d::pool2d_forward(
                    op,
                    in_shape(0),
                    input(0),
                    ViewMut::new(out_rect, &mut y),
                ),
                Op::Dense(op) => {
                    let b = op.bias.then(|| self.param_view(id, 1));
                    kernels::dense::dense_forward(
                        op,
                        input(0),
                        self.param_view(id, 0),
                        b,
                        ViewMut::new(out_rect, &mut y),
                    );
                }
                Op::Relu(_) => {
                    kernels::relu::relu_forward(input(0), ViewMut::new(out_rect, &mut y))
                }
                Op::Flatten(_) => y.copy_from_slice(input(0).data),
                Op::Concat(_) => {
                    let ins: Vec<View> = (0..layer.inputs.len()).map(input).collect();
                    kernels::concat::concat_forward(
                        &g.input_shapes(id),
                        &ins,
                        ViewMut::new(out_rect, &mut y),
                    );
                }
                Op::Add(_) => {
                    kernels::add::add_forward(input(0), input(1), ViewMut::new(out_rect, &mut y))
                }
                Op::BatchNorm(op) => {
                    let channels = Shape::new(&[layer.shape.dim(1)]).full_rect();
                    let mut running_mean = self.param_view(id, 2).data.to_vec();
                    let mut running_var = self.param_view(id, 3).data.to_vec();
                    let stats = kernels::batch_norm::batch_norm_forward(
                        op,
                        input(0),
                        self.param_view(id, 0),
                        self.param_view(id, 1),
                        ViewMut::new(channels, &mut running_mean),
                        ViewMut::new(channels, &mut running_var),
                        ViewMut::new(out_rect, &mut y),
                    );
                    saved
                        .buffer_updates
                        .push((self.params.slot(id, 2), running_mean));
                    saved
                        .buffer_updates
                        .push((self.params.slot(id, 3), running_var));
                    saved.bn.insert(id.0, stats);
                }
                Op::Dropout(op) => kernels::dropout::dropout_forward(
                    &self.dropout_mask(id, op.rate),
                    input(0),
                    ViewMut::new(out_rect, &mut y),
                ),
                Op::SoftmaxCrossEntropy(_) => {
                    let logits = input(0);
                    let total = kernels::softmax_ce::softmax_ce_forward(
                        logits,
                        labels,
                        ViewMut::new(out_rect, &mut y),
                    )?;
                    stats.loss = (total / y.len() as f64) as f32;
                    stats.correct = kernels::softmax_ce::count_correct(logits, labels);
                }
            }
            acts.push(y);
        }
        Ok((acts, stats, saved))
    }

    /// Dropout layers are salted with their layer index, which every partition of the graph shares.
    fn dropout_mask(&self, layer: LayerId, rate: f32) -> kernels::dropout::DropoutMask {
        kernels::dropout::DropoutMask {
            rate,
            seed: self.seed,
            step: self.step,
            layer_salt: layer.0 as u64,
            shape: self.graph.layer(layer).shape,
        }
    }

    fn backward(
        &self,
        acts: &[Vec<f32>],
        saved: &Saved,
        labels: &[u32],
    ) -> Result<Grads, LabelOutOfRange> {
        let g = self.graph;
        let n_layers = g.layers().len();
        // Gradient w.r.t. each layer's output, summed over its consumers.
        let mut dout: Vec<Option<Vec<f32>>> = vec![None; n_layers];
        let mut param_grads: Vec<Option<Vec<f32>>> = vec![None; self.params.params.len()];
        let accumulate = |slot: &mut Option<Vec<f32>>, g: Vec<f32>| match slot {
            Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += *b),
            None => *slot = Some(g),
        };
        for id in g.ids().rev() {
            let layer = g.layer(id);
            let out_rect = layer.shape.full_rect();
            let y = self.view(id, &acts[id.0]);
            let dy_buf = match &layer.op {
                Op::SoftmaxCrossEntropy(_) => None,
                _ => match dout[id.0].take() {
                    Some(d) => Some(d),
                    // Nothing downstream depends on this layer (or it is the input).
                    None => continue,
                },
            };
            let dy = dy_buf.as_deref().map(|d| View::new(out_rect, d));
            let input = |k: usize| -> View<'_> {
                let src = layer.inputs[k];
                View::new(g.layer(src).shape.full_rect(), &acts[src.0])
            };
            let in_shape = |k: usize| g.layer(layer.inputs[k]).shape;
            // The first input of a layer fed by the data needs no gradient.
            let needs_dx = |k: usize| !matches!(g.layer(layer.inputs[k]).op, Op::Input(_));
            let zeros_like = |k: usize| vec![0.0; in_shape(k).numel()];
            let mut dxs: Vec<Option<Vec<f32>>> = Vec::new();
            match &layer.op {
                Op::Input(_) => {}
                Op::Conv2d(op) => {
                    let w = self.param_view(id, 0);
                    let mut dw = vec![0.0; w.data.len()];
                    let mut db = op.bias.then(|| vec![0.0; op.out_channels]);
                    let mut dx = needs_dx(0).then(|| zeros_like(0));
                    let x = input(0);
                    kernels::conv2d::conv2d_backward(
                        op,
                        in_shape(0),
                        x,
                        w,
                        y,
                        dy.unwrap(),
                        dx.as_deref_mut().map(|d| ViewMut::new(x.rect, d)),
                        ViewMut::new(w.rect, &mut dw),
                        db.as_deref_mut()
                            .map(|d| ViewMut::new(Shape::new(&[op.out_channels]).full_rect(), d)),
                    );
                    accumulate(&mut param_grads[self.params.slot(id, 0)], dw);
                    if let Some(db) = db {
                        accumulate(&mut param_grads[self.params.slot(id, 1)], db);
                    }
                    dxs.push(dx);
                }
                Op::Pool2d(op) => {
                    let x = input(0);
                    let mut dx = zeros_like(0);
                    kernels::pool2d::pool2d_backward(
                        op,
                        in_shape(0),
                        x,
                        dy.unwrap(),
                        ViewMut::new(x.rect, &mut dx),
                    );
                    dxs.push(Some(dx));
                }
                Op::Dense(op) => {
                    let w = self.param_view(id, 0);
                    let mut dw = vec![0.0; w.data.len()];
                    let mut db = op.bias.then(|| vec![0.0; op.out_features]);
                    let mut dx = needs_dx(0).then(|| zeros_like(0));
                    let x = input(0);
                    kernels::dense::dense_backward(
                        op,
                        x,
                        w,
                        y,
                        dy.unwrap(),
                        dx.as_deref_mut().map(|d| ViewMut::new(x.rect, d)),
                        ViewMut::new(w.rect, &mut dw),
                        db.as_deref_mut()
                            .map(|d| ViewMut::new(Shape::new(&[op.out_features]).full_rect(), d)),
                    );
                    accumulate(&mut param_grads[self.params.slot(id, 0)], dw);
                    if let Some(db) = db {
                        accumulate(&mut param_grads[self.params.slot(id, 1)], db);
                    }
                    dxs.push(dx);
                }
                Op::Relu(_) => {
                    let mut dx = zeros_like(0);
                    kernels::relu::relu_backward(y, dy.unwrap(), ViewMut::new(out_rect, &mut dx));
                    dxs.push(Some(dx));
                }
                Op::Flatten(_) => dxs.push(dy_buf.clone()),
                Op::Concat(_) => {
                    let mut bufs: Vec<Vec<f32>> = (0..layer.inputs.len()).map(zeros_like).collect();
                    {
                        let mut views: Vec<ViewMut> = bufs
                            .iter_mut()
                            .enumerate()
                            .map(|(k, b)| ViewMut::new(in_shape(k).full_rect(), b))
                            .collect();
                        kernels::concat::concat_backward(
                            &g.input_shapes(id),
                            dy.unwrap(),
                            &mut views,
                        );
                    }
                    dxs.extend(bufs.into_iter().map(Some));
                }
                Op::Add(_) => {
                    dxs.push(dy_buf.clone());
                    dxs.push(dy_buf.clone());
                }
                Op::BatchNorm(op) => {
                    let x = input(0);
                    let mut dx = zeros_like(0);
                    let channels = Shape::new(&[layer.shape.dim(1)]).full_rect();
                    let mut dgamma = vec![0.0; channels.volume()];
                    let mut dbeta = vec![0.0; channels.volume()];
                    kernels::batch_norm::batch_norm_backward(
                        op,
                        x,
                        y,
                        dy.unwrap(),
                        &saved.bn[&id.0],
                        self.param_view(id, 0),
                        ViewMut::new(x.rect, &mut dx),
                        ViewMut::new(channels, &mut dgamma),
                        ViewMut::new(channels, &mut dbeta),
                    );
                    accumulate(&mut param_grads[self.params.slot(id, 0)], dgamma);
                    accumulate(&mut param_grads[self.params.slot(id, 1)], dbeta);
                    dxs.push(Some(dx));
                }
                Op::Dropout(op) => {
                    let mut dx = zeros_like(0);
                    kernels::dropout::dropout_backward(
                        &self.dropout_mask(id, op.rate),
                        dy.unwrap(),
                        ViewMut::new(out_rect, &mut dx),
                    );
                    dxs.push(Some(dx));
                }
                Op::SoftmaxCrossEntropy(_) => {
                    let logits = input(0);
                    let mut dx = zeros_like(0);
                    kernels::softmax_ce::softmax_ce_backward(
                        logits,
                        labels,
                        1.0 / g.batch() as f32,
                        ViewMut::new(logits.rect, &mut dx),
                    )?;
                    dxs.push(Some(dx));
                }
            }
            for (k, dx) in dxs.into_iter().enumerate() {
                if let Some(dx) = dx {
                    accumulate(&mut dout[layer.inputs[k].0], dx);
                }
            }
        }
        Ok(Grads {
            params: param_grads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GraphBuilder;
    use crate::kernels::check;
    use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};

    /// Branches, a concat, a residual add, batch norm and pooling: every way gradients meet.
    fn branchy(batch: usize) -> Graph {
        let mut m = GraphBuilder::new("branchy");
        let x = m.input("data", Shape::nchw(batch, 2, 8, 8)).unwrap();
        let a = m.conv2d("a", x, Conv2d::new(4, 3).padding(1)).unwrap();
        let a = m.batch_norm("a_bn", a, BatchNorm::default()).unwrap();
        let b = m.conv2d("b", x, Conv2d::new(2, 1).no_bias()).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(2, 3).padding(1)).unwrap();
        let bc = m.concat("bc", &[b, c]).unwrap();
        let s = m.add("sum", a, bc).unwrap();
        let p = m.pool2d("pool", s, Pool2d::avg(2)).unwrap();
        let f = m.flatten("flat", p).unwrap();
        let d = m.dense("fc", f, Dense::new(3)).unwrap();
        m.softmax_cross_entropy("loss", d).unwrap();
        m.finish()
    }

    #[test]
    fn training_state_round_trips_and_rejects_a_bad_step() {
        let g = branchy(2);
        let mut t = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let images = check::random(g.layer(g.input()).shape.numel(), 9);
        t.step(&images, &[0, 2]).unwrap();
        let state = t.state();
        assert!(state.momentum.iter().flatten().any(|&v| v != 0.0));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        state.save(&path, BTreeMap::new()).unwrap();
        let back = TrainingState::from_checkpoint(&g, checkpoint::load(&path).unwrap()).unwrap();
        assert_eq!(back, state);

        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), "soon".to_string());
        checkpoint::save(&path, &state.params.tensors(), &meta).unwrap();
        let err = TrainingState::from_checkpoint(&g, checkpoint::load(&path).unwrap()).unwrap_err();
        assert!(err.to_string().contains("'step' is 'soon'"), "{err}");
    }

    #[test]
    fn parameter_gradients_match_finite_differences() {
        let graph = branchy(4);
        let params = ParamStore::init(&graph, 3);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 11);
        let labels = [0, 1, 2, 1];
        let pass = Pass::new(&graph, &params, 5, 0);
        let (acts, _, saved) = pass.forward(&images, &labels).unwrap();
        let grads = pass.backward(&acts, &saved, &labels).unwrap();
        for (slot, p) in params.params.iter().enumerate() {
            if !p.spec.trainable {
                continue;
            }
            let analytic = grads.params[slot]
                .as_ref()
                .expect("every parameter gets a gradient");
            check::assert_grad(&p.name, &params.values[slot], analytic, 12, |w| {
                let mut probe = params.clone();
                probe.values[slot] = w.to_vec();
                let (_, stats, _) = Pass::new(&graph, &probe, 5, 0)
                    .forward(&images, &labels)
                    .unwrap();
                stats.loss as f64
            });
        }
    }

    #[test]
    fn init_is_seeded_and_checkpoints_restore_it() {
        let graph = branchy(2);
        let a = ParamStore::init(&graph, 9);
        assert_eq!(a, ParamStore::init(&graph, 9));
        assert_ne!(a.values, ParamStore::init(&graph, 10).values);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        checkpoint::save(&path, &a.tensors(), &BTreeMap::new()).unwrap();
        let back = ParamStore::from_checkpoint(&graph, checkpoint::load(&path).unwrap()).unwrap();
        assert_eq!(a, back);
    }

    #[test]
    fn sgd_matches_pytorch_momentum_and_weight_decay() {
        let sgd = Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let mut w = [1.0f32];
        let mut v = [0.0f32];
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.5 + 0.01·1 = 0.51; v = 0.51; w = 1 − 0.051
        assert!((w[0] - 0.949).abs() < 1e-6 && (v[0] - 0.51).abs() < 1e-6);
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.5 + 0.00949 = 0.50949; v = 0.9·0.51 + 0.50949 = 0.96849; w = 0.949 − 0.096849
        assert!((w[0] - 0.852151).abs() < 1e-5, "{}", w[0]);
    }

    #[test]
    fn training_reduces_the_loss_and_updates_running_stats() {
        let graph = branchy(8);
        let params = ParamStore::init(&graph, 1);
        let before = params.clone();
        let mut t = Trainer::new(graph.clone(), params, Sgd::default(), 1);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 2);
        let labels = [0, 1, 2, 0, 1, 2, 0, 1];
        let first = t.step(&images, &labels).unwrap().loss;
        let mut last = first;
        for _ in 0..30 {
            last = t.step(&images, &labels).unwrap().loss;
        }
        assert!(last < 0.5 * first, "{first} -> {last}");
        let rm = t.params().slot(graph.find("a_bn").unwrap(), 2);
        assert_ne!(t.params().values[rm], before.values[rm]);
        assert_eq!(t.steps(), 31);
    }
}
