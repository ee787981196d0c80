//! What a run trains and saves: the optimiser, the parameters, and the state a checkpoint holds.

use super::*;

/// Stochastic gradient descent with PyTorch's momentum and (coupled) weight decay:
/// `d = g + wd·w; v = μ·v + d; w -= lr·v`, or with Nesterov momentum `w -= lr·(d + μ·v)`
/// (`torch.optim.SGD(..., nesterov=True)`, dampening 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            lr: 0.03,
            momentum: 0.9,
            weight_decay: 5e-4,
            nesterov: false,
        }
    }
}

impl Sgd {
    /// Applies one update to `w` given its gradient and momentum buffer.
    pub fn update(&self, w: &mut [f32], grad: &[f32], velocity: &mut [f32]) {
        for ((w, &g), v) in w.iter_mut().zip(grad).zip(velocity.iter_mut()) {
            let d = g + self.weight_decay * *w;
            *v = self.momentum * *v + d;
            let step = if self.nesterov {
                d + self.momentum * *v
            } else {
                *v
            };
            *w -= self.lr * step;
        }
    }

    /// These settings at a step's rate, where a schedule gives one.
    pub fn at(self, lr: Option<f32>) -> Sgd {
        Sgd {
            lr: lr.unwrap_or(self.lr),
            ..self
        }
    }
}

/// The values of every parameter and buffer of a graph, in `Graph::params` order.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamStore {
    pub params: Vec<GraphParam>,
    pub values: Vec<Vec<f32>>,
    /// Index of each layer's first parameter in `params`.
    pub(super) first: Vec<usize>,
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
