//! Logical regions: every tensor a training step touches, named and shaped, plus the partitions the
//! lowering cuts them into.
//!
//! A region is only a name over an index space (its shape); where its data lives is decided per task
//! by the analysis (physical instances, see `analysis`). Regions are created once per (graph,
//! strategy) and are the same on every device.

use legion_ops::op::{Op, OpSpec};
use legion_ops::partition::ParallelConfig;
use legion_ops::partition::tile_rect;
use legion_ops::{Graph, LayerId, Precision, Rect, Shape};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

impl RegionId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a region holds. Decides its element type and what reading it before any write means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// A layer's output.
    Activation,
    /// The gradient of the loss w.r.t. a layer's output: the sum of its consumers' contributions.
    Gradient,
    /// A parameter or buffer (batch-norm running statistics). Lives across steps.
    Param,
    /// The gradient of a trainable parameter: the sum of its tiles' contributions.
    ParamGrad,
    /// SGD momentum of a trainable parameter. Lives across steps.
    Velocity,
    /// Batch-norm forward sums, `[3, C]` f64: element count, Σx, Σx² per channel.
    BnMoments,
    /// Batch-norm backward sums, `[3, C]` f64: element count, Σdy, Σdy·x̂ per channel.
    BnGradSums,
    /// A conv2d or dense layer's output before its activation, as the sum of a reduction split's
    /// partials (see `legion_ops::partition`).
    Partial,
    /// The gradient w.r.t. that sum: what the partials' backward reads.
    PartialGrad,
}

impl RegionKind {
    /// Sums of contributions start at zero: reading a part nobody contributed to reads zeros
    /// (e.g. input pixels a strided convolution never touches get a zero gradient). Any other
    /// region read before it is written is a bug in the program, reported by the analysis.
    pub fn zero_initialized(self) -> bool {
        matches!(
            self,
            RegionKind::Gradient
                | RegionKind::ParamGrad
                | RegionKind::BnMoments
                | RegionKind::BnGradSums
                | RegionKind::Partial
        )
    }

    /// Regions whose values must survive from one step to the next.
    pub fn persistent(self) -> bool {
        matches!(self, RegionKind::Param | RegionKind::Velocity)
    }

    /// The element type of a region of this kind for a layer computing `op` in `precision`:
    /// f64 for batch-norm sums; f32 for parameters, their gradients and momentum (the masters, in
    /// every precision); for activations, their gradients and partial sums, the layer's output
    /// type ([`DType::output`]: bf16 in a bf16 run, but f32 for the per-sample losses).
    pub fn dtype(self, op: &Op, precision: Precision) -> DType {
        match self {
            RegionKind::BnMoments | RegionKind::BnGradSums => DType::F64,
            RegionKind::Param | RegionKind::ParamGrad | RegionKind::Velocity => DType::F32,
            RegionKind::Activation
            | RegionKind::Gradient
            | RegionKind::Partial
            | RegionKind::PartialGrad => DType::output(op, precision),
        }
    }
}

/// Element type of a region (batch-norm sums are f64).
pub use legion_ops::backend::DType;

#[derive(Clone, Debug, PartialEq)]
pub struct RegionInfo {
    pub name: String,
    pub kind: RegionKind,
    pub shape: Shape,
    /// The element type of its instances ([`RegionKind::dtype`]).
    pub dtype: DType,
}

/// Every region of a training step of one graph, with lookups by what it holds.
#[derive(Clone, Debug)]
pub struct Regions {
    infos: Vec<RegionInfo>,
    activation: Vec<RegionId>,
    gradient: Vec<RegionId>,
    /// By parameter slot (`Graph::params` order).
    param: Vec<RegionId>,
    param_grad: Vec<Option<RegionId>>,
    velocity: Vec<Option<RegionId>>,
    bn_moments: Vec<Option<RegionId>>,
    bn_grad_sums: Vec<Option<RegionId>>,
    /// Of layers whose op can be computed as partial sums (after every other region, so that
    /// adding them renumbered nothing).
    partial: Vec<Option<(RegionId, RegionId)>>,
    /// First parameter slot of each layer.
    first_slot: Vec<usize>,
    /// What the step computes in.
    precision: Precision,
}

impl Regions {
    /// What the step these regions belong to computes in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The regions of a training step of `graph` computed in `precision` (which decides the
    /// element types of activations and their gradients, [`RegionKind::dtype`]).
    pub fn for_graph(graph: &Graph, precision: Precision) -> Regions {
        let mut r = Regions::from_infos(Vec::new());
        r.precision = precision;
        for layer in graph.layers() {
            let op = &layer.op;
            let act = r.add(layer.name.clone(), RegionKind::Activation, layer.shape, op);
            r.activation.push(act);
            let grad = r.add(
                format!("{}.grad", layer.name),
                RegionKind::Gradient,
                layer.shape,
                op,
            );
            r.gradient.push(grad);
            let bn = matches!(layer.op, Op::BatchNorm(_)).then(|| Shape::nc(3, layer.shape.dim(1)));
            let moments = bn.map(|s| {
                r.add(
                    format!("{}.moments", layer.name),
                    RegionKind::BnMoments,
                    s,
                    op,
                )
            });
            let sums = bn.map(|s| {
                r.add(
                    format!("{}.grad_sums", layer.name),
                    RegionKind::BnGradSums,
                    s,
                    op,
                )
            });
            r.bn_moments.push(moments);
            r.bn_grad_sums.push(sums);
        }
        for p in graph.params() {
            let op = &graph.layer(p.layer).op;
            if r.first_slot.len() <= p.layer.0 {
                let next = r.param.len();
                r.first_slot.resize(p.layer.0 + 1, next);
            }
            let param = r.add(p.name.clone(), RegionKind::Param, p.spec.shape, op);
            r.param.push(param);
            let trainable = p.spec.trainable;
            let grad = trainable.then(|| {
                r.add(
                    format!("{}.grad", p.name),
                    RegionKind::ParamGrad,
                    p.spec.shape,
                    op,
                )
            });
            let velocity = trainable.then(|| {
                r.add(
                    format!("{}.velocity", p.name),
                    RegionKind::Velocity,
                    p.spec.shape,
                    op,
                )
            });
            r.param_grad.push(grad);
            r.velocity.push(velocity);
        }
        let total = r.param.len();
        r.first_slot.resize(graph.layers().len(), total);
        for id in graph.ids() {
            let layer = graph.layer(id);
            let op = &layer.op;
            let splits = layer
                .op
                .spec()
                .reduction_channels(&graph.input_shapes(id))
                .is_some();
            let partial = splits.then(|| {
                let sum = r.add(
                    format!("{}.partial", layer.name),
                    RegionKind::Partial,
                    layer.shape,
                    op,
                );
                let grad = r.add(
                    format!("{}.partial.grad", layer.name),
                    RegionKind::PartialGrad,
                    layer.shape,
                    op,
                );
                (sum, grad)
            });
            r.partial.push(partial);
        }
        r
    }

    /// A region of a layer computing `op`.
    fn add(&mut self, name: String, kind: RegionKind, shape: Shape, op: &Op) -> RegionId {
        let dtype = kind.dtype(op, self.precision);
        self.infos.push(RegionInfo {
            name,
            kind,
            shape,
            dtype,
        });
        RegionId((self.infos.len() - 1) as u32)
    }

    /// Regions from explicit infos (for tests of the analysis on hand-made programs).
    pub fn from_infos(infos: Vec<RegionInfo>) -> Regions {
        Regions {
            infos,
            activation: Vec::new(),
            gradient: Vec::new(),
            param: Vec::new(),
            param_grad: Vec::new(),
            velocity: Vec::new(),
            bn_moments: Vec::new(),
            bn_grad_sums: Vec::new(),
            partial: Vec::new(),
            first_slot: Vec::new(),
            precision: Precision::Fp32,
        }
    }

    pub fn len(&self) -> usize {
        self.infos.len()
    }

    pub fn is_empty(&self) -> bool {
        self.infos.is_empty()
    }

    pub fn info(&self, id: RegionId) -> &RegionInfo {
        &self.infos[id.index()]
    }

    pub fn ids(&self) -> impl Iterator<Item = RegionId> + '_ {
        (0..self.infos.len() as u32).map(RegionId)
    }

    pub fn activation(&self, layer: LayerId) -> RegionId {
        self.activation[layer.0]
    }

    pub fn gradient(&self, layer: LayerId) -> RegionId {
        self.gradient[layer.0]
    }

    /// Parameter slot of a layer's `index`-th parameter.
    pub fn slot(&self, layer: LayerId, index: usize) -> usize {
        self.first_slot[layer.0] + index
    }

    pub fn param(&self, slot: usize) -> RegionId {
        self.param[slot]
    }

    pub fn param_grad(&self, slot: usize) -> Option<RegionId> {
        self.param_grad[slot]
    }

    pub fn velocity(&self, slot: usize) -> Option<RegionId> {
        self.velocity[slot]
    }

    pub fn bn_moments(&self, layer: LayerId) -> Option<RegionId> {
        self.bn_moments[layer.0]
    }

    pub fn bn_grad_sums(&self, layer: LayerId) -> Option<RegionId> {
        self.bn_grad_sums[layer.0]
    }

    /// The sum of a layer's partials and its gradient, where its op can be split so.
    pub fn partial(&self, layer: LayerId) -> Option<(RegionId, RegionId)> {
        self.partial.get(layer.0).copied().flatten()
    }
}

impl fmt::Display for RegionInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)
    }
}

/// Rects of one region, one per point of a launch domain. A *disjoint* partition (a layer's output
/// tiles) covers each element at most once; an *aliased* one (input requirements with halos, or
/// a channel split reading all input channels) may overlap.
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    pub rects: Vec<Rect>,
}

impl Partition {
    /// The block tiling of a layer's output under its config (the planner's `tile_rect`).
    pub fn blocks(shape: &Shape, config: &ParallelConfig) -> Partition {
        Partition {
            rects: (0..config.total())
                .map(|t| tile_rect(shape, config, t))
                .collect(),
        }
    }

    /// What each tile of `outputs` reads of input `input` of `op` (its projection, halos included).
    pub fn projected(
        op: &dyn OpSpec,
        inputs: &[Shape],
        outputs: &Partition,
        input: usize,
    ) -> Partition {
        Partition {
            rects: outputs
                .rects
                .iter()
                .map(|tile| op.project(inputs, tile)[input])
                .collect(),
        }
    }

    pub fn is_disjoint(&self) -> bool {
        self.rects
            .iter()
            .enumerate()
            .all(|(i, a)| self.rects[i + 1..].iter().all(|b| !a.overlaps(b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::Dim;
    use legion_ops::op::Conv2d;

    #[test]
    fn output_blocks_are_disjoint_and_halos_alias() {
        let out = Shape::nchw(2, 4, 8, 8);
        let config = ParallelConfig::split(Dim::H, 2, 0);
        let tiles = Partition::blocks(&out, &config);
        assert!(tiles.is_disjoint());
        let conv = Conv2d::new(4, 3).padding(1);
        let input = [Shape::nchw(2, 4, 8, 8)];
        let halo = Partition::projected(&conv, &input, &tiles, 0);
        assert!(!halo.is_disjoint());
        assert_eq!(halo.rects[0], Rect::new(&[0, 0, 0, 0], &[2, 4, 5, 8]));
        assert_eq!(halo.rects[1], Rect::new(&[0, 0, 3, 0], &[2, 4, 8, 8]));
    }
}
