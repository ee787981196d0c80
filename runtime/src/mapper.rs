//! The mapper: where each point of each layer's launches runs, and which device owns each slice of
//! each parameter.
//!
//! Tile `t` of a layer runs on its config's device `first + t` (the planner's placement). A slice of
//! a trainable parameter used by several tiles (replicas) is cut into blocks of rows, one per
//! replica (`legion_ops::partition::owned_blocks`): each block's owner keeps its master copy and
//! momentum, sums the replicas' gradients of it and applies the update, then sends the new values
//! back — the scheme the planner's t_s costs; `tests::owners_match_planner_sync` keeps the two in
//! step. Where the devices are in several nodes, replicas on another node than the owner's go
//! through one relay of theirs (`ParamHome::relays`), so one message a node crosses between
//! nodes each way. Buffers (batch-norm running statistics) are not synchronised: each slice is
//! kept by the first device using it.

use legion_ops::partition::{Nodes, ParallelConfig, param_homes, points};
use legion_ops::{Graph, LayerId};

pub use legion_ops::partition::{ParamHome, Point, Relay};

pub struct Mapper<'g> {
    graph: &'g Graph,
    configs: &'g [ParallelConfig],
    nodes: Nodes,
}

impl<'g> Mapper<'g> {
    /// The mapper of a run on one node.
    pub fn new(graph: &'g Graph, configs: &'g [ParallelConfig]) -> Mapper<'g> {
        Mapper::on_nodes(graph, configs, Nodes::one(usize::MAX))
    }

    /// The mapper of a run whose devices are in `nodes`.
    pub fn on_nodes(graph: &'g Graph, configs: &'g [ParallelConfig], nodes: Nodes) -> Mapper<'g> {
        assert_eq!(graph.layers().len(), configs.len(), "one config per layer");
        Mapper {
            graph,
            configs,
            nodes,
        }
    }

    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    pub fn config(&self, layer: LayerId) -> &ParallelConfig {
        &self.configs[layer.0]
    }

    /// The devices any layer uses: `0..num_devices`.
    pub fn num_devices(&self) -> usize {
        self.configs
            .iter()
            .map(|c| c.first_device() + c.total())
            .max()
            .unwrap_or(1)
    }

    pub fn points(&self, layer: LayerId) -> Vec<Point> {
        points(&self.graph.layer(layer).shape, &self.configs[layer.0])
    }

    /// Every block of every parameter and buffer of `layer`, trainable or not
    /// ([`legion_ops::partition::param_homes`]).
    pub fn param_homes(&self, layer: LayerId) -> Vec<ParamHome> {
        param_homes(self.graph, layer, &self.configs[layer.0])
    }
}
