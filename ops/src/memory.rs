//! What a training step keeps in each device's memory under a strategy, computed from shapes alone
//! so that a run can be refused (and a plan warned about) before anything is allocated.
//!
//! [`per_device`] counts, instance by instance, the buffers the runtime's device actors allocate
//! for a job: it walks a step as the runtime lowers it (`runtime/src/lower.rs`: every layer's
//! forward, then from the loss back each layer's backward and its parameters' update) and counts
//! - one buffer per tensor, device and rect that a task reads or writes: a tile's output and its
//!   gradient, the input rects it reads (a producer's own buffer when the rect is the same, a
//!   received copy otherwise, halos included), its parameter slices, each owner's block of a
//!   parameter with its momentum and summed gradient, the updated slices sent back to replicas;
//! - one buffer per term of a sum: each tile's contribution to an input gradient, a parameter
//!   gradient, a reduction split's partial sum or a batch norm's statistics;
//! - where a sum is first read, one staging buffer per term from another device (its overlap with
//!   what is read), which the reader folds; on several nodes a relay stages its members' terms of
//!   a parameter block and the owner the relay's sum in their place.
//!
//! The figure equals the runtime's `StepPlan::device_bytes` (`integration/tests/device_memory.rs`
//! keeps the two equal on every strategy family). Kernels' scratch (cuDNN workspaces) and slices
//! in flight between processes come on top.
//!
//! In bf16 ([`per_device_at`], [`Precision::Bf16`]) activations, their gradients and a
//! reduction split's partial sums take 2 bytes an element; parameters, their gradients and momentum
//! stay 4 (batch norm's statistics 8), and every conv2d or dense parameter slice a tile reads also
//! has a bf16 working copy (2 bytes an element), as a GPU casts it before its products. The
//! runtime's equality with `device_bytes` is checked in fp32.
//!
//! A pure function of the graph and the configs: the planner compares it with a machine's device
//! memory, a training job and each cluster worker with their host's.

use crate::fast_hash::FastHashSet;
use crate::op::{
    Op, OpSpec, ParamSpec, batch_norm_sums_rect, batch_norm_tile_sums_rect, partial_param_rect,
    project_partial,
};
use crate::partition::{
    DeviceId, Nodes, ParallelConfig, ParamHome, Point, Relay, param_homes, points, tile_rect,
};
use crate::precision::Precision;
use crate::{Graph, LayerId, Rect, Shape};

/// `b` bytes in the largest binary unit that keeps it at least 1 (`1.50 GiB`).
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 40 => format!("{:.2} TiB", b as f64 / (1u64 << 40) as f64),
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Bytes of one f32 element, the type of every activation and parameter in fp32.
const F32_BYTES: u64 = 4;

/// What one device holds during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: DeviceId,
    pub bytes: u64,
    /// The layer that takes most of it, and how much.
    pub largest_layer: Option<(LayerId, u64)>,
}

/// The memory of every device of `devices` (a count: one node; or [`Nodes`], where parameter sync
/// goes through relays and their staging buffers) when `graph` runs with `configs` (one per
/// layer): every buffer its actor allocates for a step, as the module docs list them. Instances on
/// devices past the last are not counted. Element counts are bounded by the graph builder, so the
/// byte counts cannot overflow; the sums saturate all the same.
pub fn per_device(
    graph: &Graph,
    configs: &[ParallelConfig],
    devices: impl Into<Nodes>,
) -> Vec<DeviceMemory> {
    per_device_at(graph, configs, devices, Precision::Fp32)
}

/// [`per_device`] in `precision`: each tensor at its element size there (the module doc).
pub fn per_device_at(
    graph: &Graph,
    configs: &[ParallelConfig],
    devices: impl Into<Nodes>,
    precision: Precision,
) -> Vec<DeviceMemory> {
    assert_eq!(graph.layers().len(), configs.len(), "one config per layer");
    let nodes = devices.into();
    let num_devices = nodes.devices();
    let layers: Vec<LayerTiles> = graph
        .ids()
        .map(|id| LayerTiles::of(graph, id, &configs[id.0]))
        .collect();
    let mut step = StepBuffers::new(&layers, num_devices, precision);
    for layer in &layers {
        step.forward(graph, layer);
    }
    let has_gradient = graph.layers_with_gradient();
    for layer in layers.iter().rev().filter(|l| has_gradient[l.id.0]) {
        step.backward(graph, layer);
        step.update(layer, &nodes);
    }
    step.devices()
}

/// A tensor of a training step: what the runtime keeps a region for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tensor {
    Activation(LayerId),
    Gradient(LayerId),
    Param(LayerId, usize),
    ParamGrad(LayerId, usize),
    Velocity(LayerId, usize),
    /// The bf16 working copy of a conv2d or dense parameter's slice that a kernel reads.
    ParamCopy(LayerId, usize),
    /// Batch norm's per-channel count, Σx, Σx² (f64).
    Moments(LayerId),
    /// Batch norm's per-channel count, Σdy, Σdy·x̂ (f64).
    GradSums(LayerId),
    /// A reduction split's sum of partials, and its gradient.
    Partial(LayerId),
    PartialGrad(LayerId),
}

impl Tensor {
    fn element_bytes(self, precision: Precision) -> u64 {
        match self {
            Tensor::Moments(_) | Tensor::GradSums(_) => 8,
            Tensor::Activation(_)
            | Tensor::Gradient(_)
            | Tensor::Partial(_)
            | Tensor::PartialGrad(_) => precision.activation_bytes(),
            Tensor::Param(..) | Tensor::ParamGrad(..) | Tensor::Velocity(..) => {
                precision.weight_bytes()
            }
            Tensor::ParamCopy(..) => precision.weight_copy_bytes().unwrap_or(F32_BYTES),
        }
    }

    /// A dense index: `stride` slots per layer, six for the layer's own tensors and four per
    /// parameter.
    fn slot(self, stride: usize) -> usize {
        let (layer, offset) = match self {
            Tensor::Activation(l) => (l, 0),
            Tensor::Gradient(l) => (l, 1),
            Tensor::Moments(l) => (l, 2),
            Tensor::GradSums(l) => (l, 3),
            Tensor::Partial(l) => (l, 4),
            Tensor::PartialGrad(l) => (l, 5),
            Tensor::Param(l, i) => (l, 6 + 4 * i),
            Tensor::ParamGrad(l, i) => (l, 7 + 4 * i),
            Tensor::Velocity(l, i) => (l, 8 + 4 * i),
            Tensor::ParamCopy(l, i) => (l, 9 + 4 * i),
        };
        layer.0 * stride + offset
    }
}

/// The buffers of a step so far, by device and by the layer whose tasks made them. Keyed by
/// [`Tensor::slot`]: the exhaustive search and refine check the memory of every strategy they
/// accept.
struct StepBuffers {
    num_devices: usize,
    precision: Precision,
    stride: usize,
    /// `[layer * num_devices + device]`
    bytes: Vec<u64>,
    /// Every tensor's buffers as the runtime keys them: one per (tensor slot, device, rect).
    /// Hashed, not a list per tensor: a parameter replicated on a thousand devices has a thousand
    /// buffers, and looking each up in a list took seconds per strategy there.
    buffers: FastHashSet<(usize, DeviceId, Rect)>,
    /// Per sum, its terms: the device and rect of each contribution.
    terms: Vec<Vec<(DeviceId, Rect)>>,
    /// The (sum's slot, rect)s already folded: later readers copy the folded value.
    folded: FastHashSet<(usize, Rect)>,
}

impl StepBuffers {
    fn new(layers: &[LayerTiles], num_devices: usize, precision: Precision) -> StepBuffers {
        let params = layers.iter().map(|l| l.params.len()).max().unwrap_or(0);
        let stride = 6 + 4 * params;
        let slots = layers.len() * stride;
        StepBuffers {
            num_devices,
            precision,
            stride,
            bytes: vec![0; layers.len() * num_devices],
            buffers: FastHashSet::default(),
            terms: vec![Vec::new(); slots],
            folded: FastHashSet::default(),
        }
    }

    /// `elements` of `tensor` on `device`, made by `layer`'s tasks.
    fn add(&mut self, layer: LayerId, device: DeviceId, tensor: Tensor, elements: usize) {
        if device < self.num_devices {
            let b = &mut self.bytes[layer.0 * self.num_devices + device];
            *b = b.saturating_add(tensor.element_bytes(self.precision) * elements as u64);
        }
    }

    /// The buffer of `tensor[rect]` on `device`, read or written there.
    fn buffer(&mut self, layer: LayerId, device: DeviceId, tensor: Tensor, rect: Rect) {
        if self
            .buffers
            .insert((tensor.slot(self.stride), device, rect))
        {
            self.add(layer, device, tensor, rect.volume());
        }
    }

    /// A term of the sum `tensor`: a buffer of its own.
    fn contribute(&mut self, layer: LayerId, device: DeviceId, tensor: Tensor, rect: Rect) {
        self.add(layer, device, tensor, rect.volume());
        self.terms[tensor.slot(self.stride)].push((device, rect));
    }

    /// `tensor[rect]`, a sum, read on `device`: its buffer there and, where it is first read, a
    /// staging buffer for each term from another device.
    fn read_sum(&mut self, layer: LayerId, device: DeviceId, tensor: Tensor, rect: Rect) {
        self.read_relayed_sum(layer, device, tensor, rect, &[]);
    }

    /// [`read_sum`](Self::read_sum) where `relays` first sum their members' terms of `rect`
    /// onto their own: each relay stages its members' terms, and the reader the terms left.
    fn read_relayed_sum(
        &mut self,
        layer: LayerId,
        device: DeviceId,
        tensor: Tensor,
        rect: Rect,
        relays: &[Relay],
    ) {
        self.buffer(layer, device, tensor, rect);
        let slot = tensor.slot(self.stride);
        if !self.folded.insert((slot, rect)) {
            return;
        }
        // (member, its relay), ascending: relays come node by node, their members ascending
        let relay_of: Vec<(DeviceId, DeviceId)> = relays
            .iter()
            .flat_map(|r| r.members.iter().map(|&m| (m, r.device)))
            .collect();
        let mut at_relays: Vec<(DeviceId, usize)> = Vec::new();
        let mut staged = 0;
        for &(d, term) in &self.terms[slot] {
            if d == device || !term.overlaps(&rect) {
                continue;
            }
            let volume = term.intersect(&rect).volume();
            match relay_of.binary_search_by_key(&d, |&(m, _)| m) {
                Ok(i) => at_relays.push((relay_of[i].1, volume)),
                Err(_) => staged += volume,
            }
        }
        for (relay, volume) in at_relays {
            self.add(layer, relay, tensor, volume);
        }
        self.add(layer, device, tensor, staged);
    }

    fn forward(&mut self, graph: &Graph, tiles: &LayerTiles) {
        let (id, spec, inputs) = (tiles.id, tiles.spec, &tiles.inputs);
        let layer = graph.layer(id);
        let out = Tensor::Activation(id);
        match &layer.op {
            Op::Input(_) => {
                for (tile, device, _) in tiles.iter() {
                    self.buffer(id, device, out, tile);
                }
            }
            Op::BatchNorm(_) => {
                let x = Tensor::Activation(layer.inputs[0]);
                for (tile, device, _) in tiles.iter() {
                    self.buffer(id, device, x, tile);
                    self.contribute(
                        id,
                        device,
                        Tensor::Moments(id),
                        batch_norm_tile_sums_rect(&tile),
                    );
                }
                for (tile, device, partial) in tiles.iter() {
                    self.read_sum(
                        id,
                        device,
                        Tensor::Moments(id),
                        batch_norm_tile_sums_rect(&tile),
                    );
                    self.params(tiles, device, &tile, partial, |i| i < 2);
                    self.buffer(id, device, out, tile);
                }
                // the running statistics, by the first device of each channel slice
                for home in tiles.homes.iter().filter(|h| h.param == 2) {
                    let sums = batch_norm_sums_rect(home.slice.lo[0]..home.slice.hi[0]);
                    self.read_sum(id, home.owner, Tensor::Moments(id), sums);
                    for k in [2, 3] {
                        self.buffer(id, home.owner, Tensor::Param(id, k), home.slice);
                    }
                }
            }
            _ if tiles.reduction > 1 => {
                // each partial sums its block over its channels, the first applies the activation
                let sum = Tensor::Partial(id);
                for (tile, device, (r, red)) in tiles.iter() {
                    let rects = project_partial(spec, inputs, &tile, r, red);
                    self.inputs(graph, id, device, &rects);
                    self.params(tiles, device, &tile, (r, red), |_| true);
                    self.contribute(id, device, sum, tile);
                }
                for (tile, device, _) in tiles.iter().filter(|(_, _, (r, _))| *r == 0) {
                    self.read_sum(id, device, sum, tile);
                    self.buffer(id, device, out, tile);
                }
            }
            _ => {
                for (tile, device, partial) in tiles.iter() {
                    self.inputs(graph, id, device, &spec.project(inputs, &tile));
                    self.params(tiles, device, &tile, partial, |_| true);
                    self.buffer(id, device, out, tile);
                }
            }
        }
    }

    fn backward(&mut self, graph: &Graph, tiles: &LayerTiles) {
        let (id, spec, inputs) = (tiles.id, tiles.spec, &tiles.inputs);
        let layer = graph.layer(id);
        let (y, dy) = (Tensor::Activation(id), Tensor::Gradient(id));
        match &layer.op {
            Op::Input(_) => {}
            Op::BatchNorm(bn) => {
                let x = Tensor::Activation(layer.inputs[0]);
                let phase = |s: &mut StepBuffers, tile: Rect, device: DeviceId| {
                    s.buffer(id, device, x, tile);
                    if bn.relu {
                        s.buffer(id, device, y, tile);
                    }
                    s.read_sum(id, device, dy, tile);
                    s.read_sum(
                        id,
                        device,
                        Tensor::Moments(id),
                        batch_norm_tile_sums_rect(&tile),
                    );
                };
                for (tile, device, partial) in tiles.iter() {
                    phase(self, tile, device);
                    self.contribute(
                        id,
                        device,
                        Tensor::GradSums(id),
                        batch_norm_tile_sums_rect(&tile),
                    );
                    self.param_grads(tiles, device, &tile, partial);
                }
                if graph.input_needs_gradient(id, 0) {
                    let dx = Tensor::Gradient(layer.inputs[0]);
                    for (tile, device, partial) in tiles.iter() {
                        phase(self, tile, device);
                        self.params(tiles, device, &tile, partial, |i| i == 0);
                        self.read_sum(
                            id,
                            device,
                            Tensor::GradSums(id),
                            batch_norm_tile_sums_rect(&tile),
                        );
                        self.contribute(id, device, dx, tile);
                    }
                }
            }
            _ if tiles.reduction > 1 => {
                // the gradient before the activation, once per block, then each partial's
                let dsum = Tensor::PartialGrad(id);
                for (tile, device, _) in tiles.iter().filter(|(_, _, (r, _))| *r == 0) {
                    self.buffer(id, device, y, tile);
                    self.read_sum(id, device, dy, tile);
                    self.buffer(id, device, dsum, tile);
                }
                for (tile, device, (r, red)) in tiles.iter() {
                    let rects = project_partial(spec, inputs, &tile, r, red);
                    self.inputs(graph, id, device, &rects);
                    self.buffer(id, device, dsum, tile);
                    self.params(tiles, device, &tile, (r, red), |_| true);
                    self.param_grads(tiles, device, &tile, (r, red));
                    self.input_grads(graph, id, device, &rects);
                }
            }
            op => {
                let reads = op.backward_reads();
                for (tile, device, partial) in tiles.iter() {
                    let rects = spec.project(inputs, &tile);
                    if reads.inputs {
                        self.inputs(graph, id, device, &rects);
                    }
                    if reads.output {
                        self.buffer(id, device, y, tile);
                    }
                    if reads.output_grad {
                        self.read_sum(id, device, dy, tile);
                    }
                    self.params(tiles, device, &tile, partial, |_| true);
                    self.param_grads(tiles, device, &tile, partial);
                    self.input_grads(graph, id, device, &rects);
                }
            }
        }
    }

    /// Each trainable block's owner sums its gradient, keeps it with its momentum and updates it;
    /// the new values go to every device reading the slice.
    fn update(&mut self, tiles: &LayerTiles, nodes: &Nodes) {
        let id = tiles.id;
        for home in &tiles.homes {
            if !tiles.params[home.param].trainable {
                continue;
            }
            let (owner, k) = (home.owner, home.param);
            let relays = home.relays(nodes);
            self.read_relayed_sum(id, owner, Tensor::ParamGrad(id, k), home.slice, &relays);
            self.buffer(id, owner, Tensor::Param(id, k), home.slice);
            self.buffer(id, owner, Tensor::Velocity(id, k), home.slice);
            for &device in std::iter::once(&owner).chain(&home.replicas) {
                self.buffer(id, device, Tensor::Param(id, k), home.read_slice);
            }
        }
    }

    fn inputs(&mut self, graph: &Graph, id: LayerId, device: DeviceId, rects: &[Rect]) {
        for (&from, &rect) in graph.layer(id).inputs.iter().zip(rects) {
            self.buffer(id, device, Tensor::Activation(from), rect);
        }
    }

    fn input_grads(&mut self, graph: &Graph, id: LayerId, device: DeviceId, rects: &[Rect]) {
        for (k, (&from, &rect)) in graph.layer(id).inputs.iter().zip(rects).enumerate() {
            if graph.input_needs_gradient(id, k) {
                self.contribute(id, device, Tensor::Gradient(from), rect);
            }
        }
    }

    /// The tile's slices of the parameters `which(index)` selects.
    fn params(
        &mut self,
        layer: &LayerTiles,
        device: DeviceId,
        tile: &Rect,
        (r, red): (usize, usize),
        which: impl Fn(usize) -> bool,
    ) {
        for (i, param) in layer.params.iter().enumerate().filter(|(i, _)| which(*i)) {
            if let Some(rect) = partial_param_rect(layer.spec, i, param, tile, r, red) {
                self.buffer(layer.id, device, Tensor::Param(layer.id, i), rect);
                if layer.casts_params && self.precision.weight_copy_bytes().is_some() {
                    self.buffer(layer.id, device, Tensor::ParamCopy(layer.id, i), rect);
                }
            }
        }
    }

    /// The tile's term of each trainable parameter's gradient.
    fn param_grads(
        &mut self,
        layer: &LayerTiles,
        device: DeviceId,
        tile: &Rect,
        (r, red): (usize, usize),
    ) {
        for (i, param) in layer.params.iter().enumerate().filter(|(_, p)| p.trainable) {
            if let Some(rect) = partial_param_rect(layer.spec, i, param, tile, r, red) {
                self.contribute(layer.id, device, Tensor::ParamGrad(layer.id, i), rect);
            }
        }
    }

    /// Every device's total and the layer that takes most of it.
    fn devices(&self) -> Vec<DeviceMemory> {
        (0..self.num_devices)
            .map(|device| {
                let mut memory = DeviceMemory {
                    device,
                    bytes: 0,
                    largest_layer: None,
                };
                for (l, by_device) in self.bytes.chunks(self.num_devices.max(1)).enumerate() {
                    let taken = by_device[device];
                    memory.bytes = memory.bytes.saturating_add(taken);
                    if taken > 0 && memory.largest_layer.is_none_or(|(_, most)| taken > most) {
                        memory.largest_layer = Some((LayerId(l), taken));
                    }
                }
                memory
            })
            .collect()
    }
}

/// What the walk needs of a layer, computed once: its op, input shapes and parameters, its
/// points under its config in launch order, and who owns each block of its parameters.
struct LayerTiles<'g> {
    id: LayerId,
    spec: &'g dyn OpSpec,
    inputs: Vec<Shape>,
    params: Vec<ParamSpec>,
    reduction: usize,
    points: Vec<Point>,
    homes: Vec<ParamHome>,
    /// A conv2d or dense layer, whose products read a cast copy of its parameters in bf16.
    casts_params: bool,
}

impl<'g> LayerTiles<'g> {
    fn of(graph: &'g Graph, id: LayerId, config: &ParallelConfig) -> LayerTiles<'g> {
        let layer = graph.layer(id);
        LayerTiles {
            id,
            spec: layer.op.spec(),
            inputs: graph.input_shapes(id),
            params: graph.layer_params(id),
            reduction: config.reduction(),
            points: points(&layer.shape, config),
            homes: param_homes(graph, id, config),
            casts_params: matches!(layer.op, Op::Conv2d(_) | Op::Dense(_)),
        }
    }

    /// Each point as (tile, device, (partial, of how many)).
    fn iter(&self) -> impl Iterator<Item = (Rect, DeviceId, (usize, usize))> + '_ {
        self.points.iter().map(|p| (p.tile, p.device, p.partial))
    }
}

/// What tile `tile` of `layer` under `config` keeps on its device that its own config decides:
/// its output and that output's gradient, its term of each input's gradient, and for every
/// parameter slice it reads, four slices' worth for a trainable one (the slice, its gradient term,
/// and the device's share of the owners' work: summed gradient, the other devices' terms, the
/// updated block and its momentum, at most two more slices) or the slice of a buffer. A function
/// of the layer's config alone: the searches' per-layer proxy of memory, where [`per_device`]
/// counts the step exactly (received input slices and folds depend on the neighbours' configs).
pub fn tile_bytes(graph: &Graph, layer: LayerId, config: &ParallelConfig, tile: usize) -> u64 {
    tile_bytes_at(graph, layer, config, tile, Precision::Fp32)
}

/// [`tile_bytes`] in `precision`: outputs, gradients and partial sums at its activation size,
/// parameter slices at 4 bytes plus, for a conv2d or dense layer in bf16, their working copy.
pub fn tile_bytes_at(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
    tile: usize,
    precision: Precision,
) -> u64 {
    let l = graph.layer(layer);
    let out = tile_rect(&l.shape, config, tile);
    // A reduction split's partial holds its term of the block's sum and that sum's gradient; the
    // first partial also the folded sum, the other partials' terms staged for it, the block's
    // output and output gradient: `red + 4` blocks.
    let (r, red) = (config.reduction_of(tile), config.reduction());
    let blocks = if red > 1 && r == 0 { red as u64 + 4 } else { 2 };
    let mut activations = blocks * out.volume() as u64;
    let inputs = graph.input_shapes(layer);
    for (k, rect) in project_partial(l.op.spec(), &inputs, &out, r, red)
        .iter()
        .enumerate()
    {
        if graph.input_needs_gradient(layer, k) {
            activations += rect.volume() as u64;
        }
    }
    let (mut weights, mut copies_read) = (0u64, 0u64);
    let casts = matches!(l.op, Op::Conv2d(_) | Op::Dense(_));
    for (i, p) in graph.layer_params(layer).iter().enumerate() {
        let copies = if p.trainable { 4 } else { 1 };
        if let Some(slice) = partial_param_rect(l.op.spec(), i, p, &out, r, red) {
            weights += copies * slice.volume() as u64;
            if casts {
                copies_read += slice.volume() as u64;
            }
        }
    }
    let copy_bytes = precision.weight_copy_bytes().map_or(0, |b| b * copies_read);
    activations
        .saturating_mul(precision.activation_bytes())
        .saturating_add(weights.saturating_mul(precision.weight_bytes()))
        .saturating_add(copy_bytes)
}

/// The most any one device keeps for `layer` under `config`: its largest tile's
/// [`tile_bytes`] (a config puts each tile on a device of its own).
pub fn largest_tile_bytes(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> u64 {
    largest_tile_bytes_at(graph, layer, config, Precision::Fp32)
}

/// [`largest_tile_bytes`] in `precision` ([`tile_bytes_at`]).
pub fn largest_tile_bytes_at(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
    precision: Precision,
) -> u64 {
    (0..config.total())
        .map(|tile| tile_bytes_at(graph, layer, config, tile, precision))
        .max()
        .unwrap_or(0)
}

/// The bytes of every trainable parameter and its momentum, as a training job's own state (the
/// weights it starts from and saves) holds them beside the devices.
pub fn job_state_bytes(graph: &Graph) -> u64 {
    graph
        .params()
        .iter()
        .map(|p| {
            let copies = if p.spec.trainable { 2 } else { 1 };
            copies * p.spec.shape.numel() as u64 * F32_BYTES
        })
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dim;
    use crate::op::{Conv2d, Dense};
    use crate::{GraphBuilder, Shape};

    /// x [4, 8] → fc (10 outputs: weight [10, 8], bias [10]) → loss [4, 1].
    fn mlp() -> Graph {
        let mut m = GraphBuilder::new("mlp");
        let x = m.input("x", Shape::nc(4, 8)).unwrap();
        let x = m.dense("fc", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    /// On one device, in f32 elements: the activations x 32, fc 40, loss 4; fc's output gradient
    /// twice (the loss's term and the sum fc's backward reads, 40 each); the 90 weights four
    /// times (the weights, their gradient term, the summed gradient the update reads, momentum).
    #[test]
    fn one_device_holds_each_buffer_of_the_step_once() {
        let g = mlp();
        let serial = vec![ParallelConfig::serial(0); 3];
        let mem = per_device(&g, &serial, 1);
        assert_eq!(mem[0].bytes, 4 * ((32 + 40 + 4) + 2 * 40 + 4 * 90));
        assert_eq!(mem[0].largest_layer.map(|(l, _)| l), g.find("fc"));
        assert_eq!(job_state_bytes(&g), 4 * 2 * 90);
    }

    /// The same step in bf16: the 76 activation and 80 gradient elements at 2 bytes, the 90
    /// weights' four fp32 buffers at 4, and one bf16 working copy of the 90 weights fc reads.
    #[test]
    fn in_bf16_activations_halve_and_weights_gain_a_working_copy() {
        let g = mlp();
        let serial = vec![ParallelConfig::serial(0); 3];
        let mem = per_device_at(&g, &serial, 1, Precision::Bf16);
        assert_eq!(
            mem[0].bytes,
            2 * ((32 + 40 + 4) + 2 * 40) + 4 * 4 * 90 + 2 * 90
        );
        for p in [Precision::Fp32, Precision::Tf32] {
            assert_eq!(per_device_at(&g, &serial, 1, p), per_device(&g, &serial, 1));
        }
        let fc = g.find("fc").unwrap();
        let split = ParallelConfig::serial(0).with_reduction(2);
        assert_eq!(
            tile_bytes_at(&g, fc, &split, 0, Precision::Bf16),
            2 * 6 * 40 + 4 * 4 * 50 + 2 * 50
        );
        assert_eq!(
            largest_tile_bytes_at(&g, fc, &split, Precision::Tf32),
            largest_tile_bytes(&g, fc, &split)
        );
    }

    /// fc split into 2 partial sums over x's 8 features, in f32 elements: the first partial keeps
    /// its term of the sum, the folded sum, the second's term staged, the output, its gradient
    /// and the sum's gradient (6 × 40), and four slices' worth of its weight block and the bias
    /// (4 × (10 × 4 + 10)); the second its term and the sum's gradient (2 × 40) and four of its
    /// weight block (4 × 40). The data layer needs no input gradient.
    #[test]
    fn a_reduction_splits_first_partial_keeps_the_folded_sum_and_the_staged_terms() {
        let g = mlp();
        let fc = g.find("fc").unwrap();
        let split = ParallelConfig::serial(0).with_reduction(2);
        assert_eq!(tile_bytes(&g, fc, &split, 0), 4 * (6 * 40 + 4 * 50));
        assert_eq!(tile_bytes(&g, fc, &split, 1), 4 * (2 * 40 + 4 * 40));
        assert_eq!(largest_tile_bytes(&g, fc, &split), 4 * (6 * 40 + 4 * 50));
    }

    /// Data parallelism on 2 devices: each holds half of every activation and of fc's output
    /// gradient (term and sum, the loss's tile being on the same device), the whole weights and
    /// a whole gradient term; each owns half the rows of the weight and bias (45 elements), for
    /// which it keeps the summed gradient, the other device's term of it (staged), the updated
    /// block and its momentum.
    #[test]
    fn data_parallelism_stages_the_other_replicas_gradient_terms_on_each_owner() {
        let g = mlp();
        let data = vec![ParallelConfig::split(Dim::N, 2, 0); 3];
        let mem = per_device(&g, &data, 2);
        let each = (16 + 20 + 2) + 2 * 20 + 2 * 90 + 4 * 45;
        assert_eq!([mem[0].bytes, mem[1].bytes], [4 * each, 4 * each]);
    }

    /// A 3×3 convolution `b` (padding 1, 1 channel, 8×8, 10 weights) split over height on 2
    /// devices, every other layer on device 0, in f32 elements.
    ///
    /// Device 1 computes rows 4..8: it receives rows 3..8 of its input (40), writes its output
    /// rows (32), sums its output gradient's rows there (32) from a staged copy of the flatten's
    /// term on device 0 (32), reads the weights (10), contributes a gradient term of them (10)
    /// and of its input rows (40): 196.
    ///
    /// Device 0, against the serial run: b's input rows 0..5 are a copy of their own (+40), its
    /// output and output-gradient sum shrink to rows 0..4 (−32, −32), the flatten reads the whole
    /// output in a buffer of its own (+64), b's input-gradient term shrinks to rows 0..5 (−24), a
    /// folds device 1's term of rows 3..8 (+40), and the owner of b's weights stages device 1's
    /// term of them (+10): +66.
    #[test]
    fn a_spatial_split_receives_its_halo_and_stages_the_terms_it_folds() {
        let mut m = GraphBuilder::new("halo");
        let x = m.input("x", Shape::nchw(1, 1, 8, 8)).unwrap();
        let x = m.conv2d("a", x, Conv2d::new(1, 1)).unwrap();
        let x = m.conv2d("b", x, Conv2d::new(1, 3).padding(1)).unwrap();
        let x = m.flatten("flat", x).unwrap();
        let x = m.dense("fc", x, Dense::new(2)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        let g = m.finish();
        let b = g.find("b").unwrap();
        let serial = vec![ParallelConfig::serial(0); g.layers().len()];
        let mut split = serial.clone();
        split[b.0] = ParallelConfig::split(Dim::H, 2, 0);
        let one = per_device(&g, &serial, 2);
        let two = per_device(&g, &split, 2);
        assert_eq!(one[1].bytes, 0);
        assert_eq!(two[1].bytes, 4 * (40 + 32 + 32 + 32 + 10 + 10 + 40));
        assert_eq!(two[1].largest_layer, Some((b, two[1].bytes)));
        assert_eq!(
            two[0].bytes,
            (one[0].bytes as i64 + 4 * (40 - 32 - 32 + 64 - 24 + 40 + 10)) as u64
        );
    }
}
