//! Lowering: a graph under a strategy becomes the tasks of one training step, launched in program
//! order into the analysis. This is the only place that knows which kernels a layer runs and which
//! regions they touch; the analysis and the devices treat every task alike.
//!
//! Program order: the forward of every layer, then, from the loss back, each layer's backward
//! followed at once by the update of its parameters and the broadcast of the new values to the
//! replicas, so that synchronisation overlaps the backward of the layers below.

use crate::analysis::{Analysis, AnalysisError};
use crate::mapper::{Mapper, Point, Relay};
use crate::region::Regions;
use crate::task::{Privilege, Role, TaskKind, TaskSpec};
use legion_ops::op::{
    Op, batch_norm_sums_rect, batch_norm_tile_sums_rect, partial_param_rect, project_partial,
};
use legion_ops::partition::DeviceId;
use legion_ops::{Graph, LayerId, Rect};

use Privilege::{ReadOnly, ReadWrite, Reduce, WriteDiscard};

/// Places the persistent data where a first step expects it: every parameter slice and momentum
/// slice on its owner.
pub fn place_on_owners(analysis: &mut Analysis, regions: &Regions, mapper: &Mapper) {
    let graph = mapper.graph();
    for id in graph.ids() {
        for home in mapper.param_homes(id) {
            let slot = regions.slot(id, home.param);
            analysis.place(regions.param(slot), home.slice, &[home.owner]);
            if let Some(v) = regions.velocity(slot) {
                analysis.place(v, home.slice, &[home.owner]);
            }
        }
    }
}

/// Launches one training step.
pub fn lower_step(
    analysis: &mut Analysis,
    regions: &Regions,
    mapper: &Mapper,
) -> Result<(), AnalysisError> {
    let graph = mapper.graph();
    let has_grad = graph.layers_with_gradient();
    let lower = Lowering {
        graph,
        regions,
        mapper,
        has_grad: &has_grad,
        inference: false,
    };
    for id in graph.ids() {
        lower.forward(analysis, id)?;
    }
    for id in graph.ids().rev() {
        if has_grad[id.0] {
            lower.backward(analysis, id)?;
            lower.update(analysis, id)?;
        }
    }
    Ok(())
}

/// Launches inference on a batch, on the training step's tiles: the forward of every layer up to
/// the logits (the layer before the loss), batch norm normalising with its running statistics
/// and dropout passing through ([`TaskKind::Infer`]). It reads the parameters and writes none.
pub fn lower_inference(
    analysis: &mut Analysis,
    regions: &Regions,
    mapper: &Mapper,
    logits: LayerId,
) -> Result<(), AnalysisError> {
    let graph = mapper.graph();
    let lower = Lowering {
        graph,
        regions,
        mapper,
        has_grad: &[],
        inference: true,
    };
    for id in graph.ids().take(logits.0 + 1) {
        lower.forward(analysis, id)?;
    }
    Ok(())
}

struct Lowering<'a> {
    graph: &'a Graph,
    regions: &'a Regions,
    mapper: &'a Mapper<'a>,
    has_grad: &'a [bool],
    /// Whether the forward is inference's ([`lower_inference`]) rather than a training step's.
    inference: bool,
}

impl Lowering<'_> {
    fn forward(&self, a: &mut Analysis, id: LayerId) -> Result<(), AnalysisError> {
        let layer = self.graph.layer(id);
        let out = self.regions.activation(id);
        let points = self.mapper.points(id);
        match &layer.op {
            Op::Input(_) => {
                for p in &points {
                    let mut t = TaskSpec::new(TaskKind::LoadInput, id, p.tile, p.device);
                    t.require(out, p.tile, WriteDiscard, Role::Output);
                    a.launch(t)?;
                }
            }
            Op::BatchNorm(_) if self.inference => {
                let x = self.regions.activation(layer.inputs[0]);
                for p in &points {
                    let mut t = TaskSpec::new(TaskKind::Infer, id, p.tile, p.device);
                    t.require(x, p.tile, ReadOnly, Role::Input(0));
                    self.params(&mut t, p, ReadOnly, |_| true);
                    t.require(out, p.tile, WriteDiscard, Role::Output);
                    a.launch(t)?;
                }
            }
            Op::BatchNorm(_) => {
                let x = self.regions.activation(layer.inputs[0]);
                let moments = self.regions.bn_moments(id).expect("batch norm has moments");
                for p in &points {
                    let mut t = TaskSpec::new(TaskKind::BnMoments, id, p.tile, p.device);
                    t.require(x, p.tile, ReadOnly, Role::Input(0));
                    t.require(
                        moments,
                        batch_norm_tile_sums_rect(&p.tile),
                        Reduce,
                        Role::Moments,
                    );
                    a.launch(t)?;
                }
                for p in &points {
                    let mut t = TaskSpec::new(TaskKind::BnNormalize, id, p.tile, p.device);
                    t.require(x, p.tile, ReadOnly, Role::Input(0));
                    t.require(
                        moments,
                        batch_norm_tile_sums_rect(&p.tile),
                        ReadOnly,
                        Role::Moments,
                    );
                    self.params(&mut t, p, ReadOnly, |i| i < 2);
                    t.require(out, p.tile, WriteDiscard, Role::Output);
                    a.launch(t)?;
                }
                // Running statistics: once per channel slice, by its owner (the first tile using it).
                for home in self.mapper.param_homes(id).iter().filter(|h| h.param == 2) {
                    let mut t = TaskSpec::new(TaskKind::BnRunning, id, home.slice, home.owner);
                    let sums = batch_norm_sums_rect(home.slice.lo[0]..home.slice.hi[0]);
                    t.require(moments, sums, ReadOnly, Role::Moments);
                    for k in [2, 3] {
                        let slot = self.regions.slot(id, k);
                        t.require(
                            self.regions.param(slot),
                            home.slice,
                            ReadWrite,
                            Role::Param(k as u8),
                        );
                    }
                    a.launch(t)?;
                }
            }
            _ if self.mapper.config(id).reduction() > 1 => {
                let (sum, _) = self
                    .regions
                    .partial(id)
                    .expect("a layer split into partials");
                let spec = layer.op.spec();
                let inputs = self.graph.input_shapes(id);
                // Each partial sums its block over its channels into the block's sum...
                for p in &points {
                    let (r, red) = p.partial;
                    let mut t = TaskSpec::new(TaskKind::PartialForward, id, p.tile, p.device);
                    let rects = project_partial(spec, &inputs, &p.tile, r, red);
                    self.inputs(&mut t, &rects);
                    self.params(&mut t, p, ReadOnly, |_| true);
                    t.require(sum, p.tile, Reduce, Role::Output);
                    a.launch(t)?;
                }
                // ... and the first partial's device applies the activation to the sum.
                for p in points.iter().filter(|p| p.partial.0 == 0) {
                    let mut t = TaskSpec::new(TaskKind::Finish, id, p.tile, p.device);
                    t.require(sum, p.tile, ReadOnly, Role::Input(0));
                    t.require(out, p.tile, WriteDiscard, Role::Output);
                    a.launch(t)?;
                }
            }
            _ => {
                let spec = layer.op.spec();
                let inputs = self.graph.input_shapes(id);
                let kind = match self.inference {
                    true => TaskKind::Infer,
                    false => TaskKind::Forward,
                };
                for p in &points {
                    let mut t = TaskSpec::new(kind, id, p.tile, p.device);
                    self.inputs(&mut t, &spec.project(&inputs, &p.tile));
                    self.params(&mut t, p, ReadOnly, |_| true);
                    t.require(out, p.tile, WriteDiscard, Role::Output);
                    a.launch(t)?;
                }
            }
        }
        Ok(())
    }

    fn backward(&self, a: &mut Analysis, id: LayerId) -> Result<(), AnalysisError> {
        let layer = self.graph.layer(id);
        let points = self.mapper.points(id);
        let y = self.regions.activation(id);
        let dy = self.regions.gradient(id);
        let spec = layer.op.spec();
        let inputs = self.graph.input_shapes(id);
        match &layer.op {
            Op::Input(_) => {}
            Op::BatchNorm(bn) => {
                let x = self.regions.activation(layer.inputs[0]);
                let moments = self.regions.bn_moments(id).expect("batch norm has moments");
                let sums = self
                    .regions
                    .bn_grad_sums(id)
                    .expect("batch norm has grad sums");
                // Both backward phases read the input, the output when the ReLU is fused, the
                // output gradient and the forward statistics.
                let phase = |kind: TaskKind, p: &Point| {
                    let mut t = TaskSpec::new(kind, id, p.tile, p.device);
                    t.require(x, p.tile, ReadOnly, Role::Input(0));
                    if bn.relu {
                        t.require(y, p.tile, ReadOnly, Role::Output);
                    }
                    t.require(dy, p.tile, ReadOnly, Role::OutputGrad);
                    t.require(
                        moments,
                        batch_norm_tile_sums_rect(&p.tile),
                        ReadOnly,
                        Role::Moments,
                    );
                    t
                };
                for p in &points {
                    let mut t = phase(TaskKind::BnGradSums, p);
                    t.require(
                        sums,
                        batch_norm_tile_sums_rect(&p.tile),
                        Reduce,
                        Role::GradSums,
                    );
                    self.param_grads(&mut t, p);
                    a.launch(t)?;
                }
                if self.graph.input_needs_gradient(id, 0) {
                    let dx = self.regions.gradient(layer.inputs[0]);
                    for p in &points {
                        let mut t = phase(TaskKind::BnInputGrad, p);
                        self.params(&mut t, p, ReadOnly, |i| i == 0);
                        t.require(
                            sums,
                            batch_norm_tile_sums_rect(&p.tile),
                            ReadOnly,
                            Role::GradSums,
                        );
                        t.require(dx, p.tile, Reduce, Role::InputGrad(0));
                        a.launch(t)?;
                    }
                }
            }
            _ if self.mapper.config(id).reduction() > 1 => {
                let (_, dsum) = self
                    .regions
                    .partial(id)
                    .expect("a layer split into partials");
                // The gradient before the activation, once per block...
                for p in points.iter().filter(|p| p.partial.0 == 0) {
                    let mut t = TaskSpec::new(TaskKind::FinishBackward, id, p.tile, p.device);
                    t.require(y, p.tile, ReadOnly, Role::Output);
                    t.require(dy, p.tile, ReadOnly, Role::OutputGrad);
                    t.require(dsum, p.tile, WriteDiscard, Role::InputGrad(0));
                    a.launch(t)?;
                }
                // ... then each partial's gradients of its channels.
                for p in &points {
                    let (r, red) = p.partial;
                    let mut t = TaskSpec::new(TaskKind::PartialBackward, id, p.tile, p.device);
                    let rects = project_partial(spec, &inputs, &p.tile, r, red);
                    self.inputs(&mut t, &rects);
                    t.require(dsum, p.tile, ReadOnly, Role::OutputGrad);
                    self.params(&mut t, p, ReadOnly, |_| true);
                    self.param_grads(&mut t, p);
                    self.input_grads(&mut t, &rects);
                    a.launch(t)?;
                }
            }
            op => {
                let reads = op.backward_reads();
                for p in &points {
                    let mut t = TaskSpec::new(TaskKind::Backward, id, p.tile, p.device);
                    let rects = spec.project(&inputs, &p.tile);
                    if reads.inputs {
                        self.inputs(&mut t, &rects);
                    }
                    if reads.output {
                        t.require(y, p.tile, ReadOnly, Role::Output);
                    }
                    if reads.output_grad {
                        t.require(dy, p.tile, ReadOnly, Role::OutputGrad);
                    }
                    self.params(&mut t, p, ReadOnly, |_| true);
                    self.param_grads(&mut t, p);
                    self.input_grads(&mut t, &rects);
                    a.launch(t)?;
                }
            }
        }
        Ok(())
    }

    /// The SGD step of every trainable block on its owner, then the new values to every device
    /// reading the slice (replicas, and owners of the slice's other blocks). A block's relays sum
    /// their members' gradients before the owner reads them, and pass the new values on to them.
    fn update(&self, a: &mut Analysis, id: LayerId) -> Result<(), AnalysisError> {
        debug_assert!(self.has_grad[id.0]);
        let mut readers: Vec<(usize, Rect, DeviceId)> = Vec::new();
        // (slot, block, read slice, relay) of every relayed block
        let mut relayed: Vec<(usize, Rect, Rect, Relay)> = Vec::new();
        for home in self.mapper.param_homes(id) {
            let slot = self.regions.slot(id, home.param);
            let (Some(grad), Some(velocity)) =
                (self.regions.param_grad(slot), self.regions.velocity(slot))
            else {
                continue;
            };
            for relay in home.relays(self.mapper.nodes()) {
                a.combine_terms(grad, home.slice, &relay.members, relay.device);
                relayed.push((slot, home.slice, home.read_slice, relay));
            }
            let k = home.param as u8;
            let mut t = TaskSpec::new(TaskKind::Update { param: k }, id, home.slice, home.owner);
            t.require(grad, home.slice, ReadOnly, Role::ParamGrad(k));
            t.require(
                self.regions.param(slot),
                home.slice,
                ReadWrite,
                Role::Param(k),
            );
            t.require(velocity, home.slice, ReadWrite, Role::Velocity(k));
            a.launch(t)?;
            for d in std::iter::once(home.owner).chain(home.replicas) {
                if !readers.contains(&(slot, home.read_slice, d)) {
                    readers.push((slot, home.read_slice, d));
                }
            }
        }
        for (slot, read_slice, device) in readers {
            let via = |fragment: &Rect| {
                relayed
                    .iter()
                    .find(|(s, block, read, relay)| {
                        *s == slot
                            && *read == read_slice
                            && block.contains(fragment)
                            && relay.members.contains(&device)
                    })
                    .map(|(_, _, read, relay)| (relay.device, *read))
            };
            a.prefetch_via(self.regions.param(slot), read_slice, device, &via)?;
        }
        Ok(())
    }

    /// Reads `rects[k]` of the layer's `k`-th input.
    fn inputs(&self, t: &mut TaskSpec, rects: &[Rect]) {
        let layer = self.graph.layer(t.layer);
        for (k, &rect) in rects.iter().enumerate() {
            let src = self.regions.activation(layer.inputs[k]);
            t.require(src, rect, ReadOnly, Role::Input(k as u8));
        }
    }

    /// Contributes to the gradient of `rects[k]` of the layer's `k`-th input, where one is needed.
    fn input_grads(&self, t: &mut TaskSpec, rects: &[Rect]) {
        for (k, &rect) in rects.iter().enumerate() {
            if self.graph.input_needs_gradient(t.layer, k) {
                let dx = self.regions.gradient(self.graph.layer(t.layer).inputs[k]);
                t.require(dx, rect, Reduce, Role::InputGrad(k as u8));
            }
        }
    }

    /// The tile's slices of the layer's parameters `which(index)` selects.
    fn params(
        &self,
        t: &mut TaskSpec,
        p: &Point,
        privilege: Privilege,
        which: impl Fn(usize) -> bool,
    ) {
        let inputs = self.graph.input_shapes(t.layer);
        let spec = self.graph.layer(t.layer).op.spec();
        for (i, param) in spec
            .params(&inputs)
            .iter()
            .enumerate()
            .filter(|(i, _)| which(*i))
        {
            let slot = self.regions.slot(t.layer, i);
            let (r, red) = p.partial;
            // a partial past the first adds no bias
            let Some(rect) = partial_param_rect(spec, i, param, &p.tile, r, red) else {
                continue;
            };
            t.require(
                self.regions.param(slot),
                rect,
                privilege,
                Role::Param(i as u8),
            );
        }
    }

    /// The tile's contribution to the gradient of each trainable parameter.
    fn param_grads(&self, t: &mut TaskSpec, p: &Point) {
        let inputs = self.graph.input_shapes(t.layer);
        let spec = self.graph.layer(t.layer).op.spec();
        for (i, param) in spec.params(&inputs).iter().enumerate() {
            let slot = self.regions.slot(t.layer, i);
            let (r, red) = p.partial;
            if let (Some(grad), Some(rect)) = (
                self.regions.param_grad(slot),
                partial_param_rect(spec, i, param, &p.tile, r, red),
            ) {
                t.require(grad, rect, Reduce, Role::ParamGrad(i as u8));
            }
        }
    }
}
