//! The OptCNN cost model (Eq. 1): the per-iteration time of a strategy is
//!
//! ```text
//! t_o = Σ_layers [ t_c(l, c_l) + t_s(l, c_l) ] + Σ_edges t_x(e, c_src, c_dst)
//! ```
//!
//! - t_c: forward + backward of the layer's slowest tile ([`CostProvider`]); tiles of one layer run in
//!   parallel on distinct devices. Under a reduction split a tile is one partial: the op over its
//!   block of the input channels;
//! - t_s: parameter synchronisation ([`crate::sync`]), fp32 gradients and weights in every
//!   precision;
//! - t_x: input movement, forward and backward ([`crate::transfer`]). A reduction split adds its
//!   own, counted with the layer as t_r: each partial sum to its block's first partial, and the
//!   block's output gradient back to every partial ([`partial_sum_messages`]).
//!
//! [`CostModel::evaluate`] computes Eq. 1 for any strategy straight from the geometry; searches read
//! the same numbers from [`crate::tables::CostTables`].

use crate::config::{ParallelConfig, tile_rect};
use crate::machine::MachineModel;
use crate::progress::{Phase, Progress};
use crate::provider::CostProvider;
use crate::simulate::SyncSimulation;
use crate::sync::layer_sync;
use crate::transfer::{
    Edge, TileOverlap, edge_overlaps, graph_edges, partial_sum_messages, transfer_bytes,
    transfer_time,
};
use legion_ops::op::partial_input_shapes;
use legion_ops::{Graph, LayerId, Shape};

/// A model graph on a machine with a source of compute times.
pub struct CostModel<'a> {
    graph: &'a Graph,
    machine: &'a MachineModel,
    provider: &'a dyn CostProvider,
    edges: Vec<Edge>,
    inputs: Vec<Vec<Shape>>,
    sync_simulation: SyncSimulation,
    progress: Option<&'a dyn Progress>,
}

/// Eq. 1 terms of one layer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerCost {
    /// t_c, seconds.
    pub compute: f64,
    /// t_s, seconds.
    pub sync: f64,
    /// Bytes moved by the parameter synchronisation.
    pub sync_bytes: u64,
    /// t_r, seconds: a reduction split's partial sums and output gradients (0 without one).
    pub reduce: f64,
    /// Bytes they move.
    pub reduce_bytes: u64,
}

/// Eq. 1 term of one edge.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EdgeCost {
    /// t_x, seconds.
    pub time: f64,
    /// Bytes moved between devices, forward and backward.
    pub bytes: u64,
}

/// Eq. 1 for a whole strategy, term by term.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostBreakdown {
    /// By layer id.
    pub layers: Vec<LayerCost>,
    /// In the order of [`CostModel::edges`].
    pub edges: Vec<EdgeCost>,
    /// t_o, seconds: the layers' terms in layer order, then the edges'.
    pub total: f64,
    /// All bytes moved between devices (transfers and synchronisation).
    pub comm_bytes: u64,
    /// The part of `comm_bytes` that is activations and their gradients (t_x, and a reduction
    /// split's partial sums and output gradients, t_r): at the machine's
    /// [`MachineModel::activation_bytes`], so half in bf16.
    pub activation_bytes: u64,
    /// The part of `comm_bytes` that is parameter synchronisation (t_s): fp32 gradients in and
    /// updated weights out, the same in every precision.
    pub sync_bytes: u64,
    /// The part of `comm_bytes` moved between devices of different nodes: what the nodes'
    /// network interfaces carry.
    pub inter_node_bytes: u64,
}

impl<'a> CostModel<'a> {
    pub fn new(
        graph: &'a Graph,
        machine: &'a MachineModel,
        provider: &'a dyn CostProvider,
    ) -> CostModel<'a> {
        CostModel {
            graph,
            machine,
            provider,
            edges: graph_edges(graph),
            inputs: graph.ids().map(|id| graph.input_shapes(id)).collect(),
            sync_simulation: SyncSimulation::default(),
            progress: None,
        }
    }

    /// The same model, its simulations scheduling parameter synchronisation as `detail` says
    /// (Eq. 1 does not change).
    pub fn with_sync_simulation(mut self, detail: SyncSimulation) -> CostModel<'a> {
        self.sync_simulation = detail;
        self
    }

    /// Reports the tables' build and the searches' progress to `progress`.
    pub fn with_progress(mut self, progress: &'a dyn Progress) -> CostModel<'a> {
        self.progress = Some(progress);
        self
    }

    /// Tells the model's [`Progress`], if it has one, how far `phase` is.
    pub(crate) fn progress(&self, phase: Phase, done: u64, total: u64) {
        if let Some(p) = self.progress {
            p.update(phase, done, total);
        }
    }

    /// How [`crate::simulate`] schedules parameter synchronisation for this model.
    pub fn sync_simulation(&self) -> SyncSimulation {
        self.sync_simulation
    }

    pub fn graph(&self) -> &'a Graph {
        self.graph
    }

    pub fn machine(&self) -> &'a MachineModel {
        self.machine
    }

    pub fn provider(&self) -> &'a dyn CostProvider {
        self.provider
    }

    /// The graph's edges ([`graph_edges`]).
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    pub fn input_shapes(&self, layer: LayerId) -> &[Shape] {
        &self.inputs[layer.0]
    }

    /// t_c: the slowest tile's forward + backward time (a reduction split's partial computes the
    /// op over its block of the input channels).
    pub fn compute_time(&self, layer: LayerId, config: &ParallelConfig) -> f64 {
        let l = self.graph.layer(layer);
        let inputs = self.input_shapes(layer);
        let red = config.reduction();
        (0..config.total())
            .map(|t| {
                let rect = tile_rect(&l.shape, config, t);
                let device = config.device_of_tile(t);
                if red == 1 {
                    return self.provider.compute_time(l, inputs, &rect, device);
                }
                let partial = partial_input_shapes(inputs, config.reduction_of(t), red);
                self.provider.compute_time(l, &partial, &rect, device)
            })
            .fold(0.0, f64::max)
    }

    /// t_r of a layer under a config: its reduction split's own messages, forward and back.
    pub fn reduce_time(&self, layer: LayerId, config: &ParallelConfig) -> f64 {
        let messages = partial_sum_messages(self.graph, layer, config);
        transfer_time(&messages, self.machine, true)
    }

    /// t_s of a layer under a config.
    pub fn sync_time(&self, layer: LayerId, config: &ParallelConfig) -> f64 {
        layer_sync(self.graph, layer, config, self.machine).time
    }

    /// t_x of an edge under the configs of its two ends.
    pub fn transfer_time(&self, edge: &Edge, src: &ParallelConfig, dst: &ParallelConfig) -> f64 {
        let overlaps = edge_overlaps(self.graph, edge, src, dst);
        transfer_time(&overlaps, self.machine, edge.carries_gradient(self.graph))
    }

    /// Eq. 1 for `configs` (indexed by layer id), term by term.
    pub fn evaluate(&self, configs: &[ParallelConfig]) -> CostBreakdown {
        assert_eq!(
            configs.len(),
            self.graph.layers().len(),
            "one config per layer"
        );
        let mut out = CostBreakdown::default();
        for id in self.graph.ids() {
            let config = &configs[id.0];
            let sync = layer_sync(self.graph, id, config, self.machine);
            out.inter_node_bytes += sync.between_nodes;
            let messages = partial_sum_messages(self.graph, id, config);
            out.inter_node_bytes += self.inter_node_bytes(&messages, true);
            out.layers.push(LayerCost {
                compute: self.compute_time(id, config),
                sync: sync.time,
                sync_bytes: sync.bytes,
                reduce: transfer_time(&messages, self.machine, true),
                reduce_bytes: transfer_bytes(&messages, true, self.machine.activation_bytes()),
            });
        }
        for e in &self.edges {
            let overlaps = edge_overlaps(self.graph, e, &configs[e.src.0], &configs[e.dst.0]);
            let gradient = e.carries_gradient(self.graph);
            out.inter_node_bytes += self.inter_node_bytes(&overlaps, gradient);
            out.edges.push(EdgeCost {
                time: transfer_time(&overlaps, self.machine, gradient),
                bytes: transfer_bytes(&overlaps, gradient, self.machine.activation_bytes()),
            });
        }
        out.total = total(&out.layers, &out.edges);
        out.sync_bytes = out.layers.iter().map(|l| l.sync_bytes).sum::<u64>();
        out.activation_bytes = out.layers.iter().map(|l| l.reduce_bytes).sum::<u64>()
            + out.edges.iter().map(|e| e.bytes).sum::<u64>();
        out.comm_bytes = out.sync_bytes + out.activation_bytes;
        out
    }

    /// The bytes of `overlaps` (forward and, with `gradient`, backward) that cross between nodes.
    fn inter_node_bytes(&self, overlaps: &[TileOverlap], gradient: bool) -> u64 {
        let across: Vec<TileOverlap> = overlaps
            .iter()
            .filter(|o| self.machine.node_of(o.src_device) != self.machine.node_of(o.dst_device))
            .copied()
            .collect();
        transfer_bytes(&across, gradient, self.machine.activation_bytes())
    }

    /// t_o alone.
    pub fn total(&self, configs: &[ParallelConfig]) -> f64 {
        self.evaluate(configs).total
    }
}

fn total(layers: &[LayerCost], edges: &[EdgeCost]) -> f64 {
    let mut t = 0.0;
    for l in layers {
        t += l.compute + l.sync + l.reduce;
    }
    for e in edges {
        t += e.time;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::MachineModel;
    use crate::provider::RooflineCost;
    use legion_ops::op::Dense;
    use legion_ops::{Dim, GraphBuilder, Shape};

    /// A dense layer on node 0's four GPUs feeding one on node 1's: every activation crosses the
    /// network forward and its gradient backward; the weights' sync stays inside each node.
    #[test]
    fn bytes_between_nodes_are_counted_apart() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(16, 64)).unwrap();
        let x = m.dense("a", x, Dense::new(32)).unwrap();
        let x = m.dense("b", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:8").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let on = |first| ParallelConfig::split(Dim::N, 4, first);
        let cost = model.evaluate(&[on(0), on(0), on(4), on(4)]);
        // a's 16 × 32 outputs, forward and back
        assert_eq!(cost.inter_node_bytes, 2 * 16 * 32 * 4);
        assert!(
            cost.comm_bytes > cost.inter_node_bytes,
            "the syncs inside nodes"
        );
        let one_node = model.evaluate(&[on(0), on(0), on(0), on(0)]);
        assert_eq!(one_node.inter_node_bytes, 0);
        assert!(one_node.comm_bytes > 0);
    }

    /// A dense layer split in two partial sums computes half its product per tile: under the
    /// roofline, where it is compute-bound, t_c halves; t_r prices the partial sum and gradient.
    #[test]
    fn a_reduction_split_partial_computes_its_channel_block() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(512, 4096)).unwrap();
        let x = m.dense("fc", x, Dense::new(4096)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:2").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let fc = g.find("fc").unwrap();
        let whole = model.compute_time(fc, &ParallelConfig::serial(0));
        let halves = model.compute_time(fc, &ParallelConfig::serial(0).with_reduction(2));
        assert!((halves / whole - 0.5).abs() < 0.02, "{halves} vs {whole}");
        assert_eq!(model.reduce_time(fc, &ParallelConfig::serial(0)), 0.0);
        let cost = model.evaluate(&[
            ParallelConfig::serial(0),
            ParallelConfig::serial(0).with_reduction(2),
            ParallelConfig::serial(0),
        ]);
        assert_eq!(cost.layers[fc.0].reduce_bytes, 2 * 512 * 4096 * 4);
        assert!(cost.layers[fc.0].reduce > 0.0);
    }
}
