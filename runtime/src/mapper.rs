//! The mapper: where each point of each layer's launches runs, and which device owns each slice of
//! each parameter.
//!
//! Tile `t` of a layer runs on its config's device `first + t` (the planner's placement). A slice of
//! a trainable parameter used by several tiles (replicas) is cut into blocks of rows, one per
//! replica (`legion_ops::partition::owned_blocks`): each block's owner keeps its master copy and
//! momentum, sums the replicas' gradients of it and applies the update, then sends the new values
//! back — the scheme the planner's t_s costs; `tests::owners_match_planner_sync` keeps the two in
//! step. Buffers (batch-norm running statistics) are not synchronised: each slice is kept by the
//! first device using it.

use crate::region::Partition;
use legion_ops::partition::{DeviceId, ParallelConfig, param_homes};
use legion_ops::{Graph, LayerId, Rect};

pub use legion_ops::partition::ParamHome;

/// One point of a layer's launch domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    /// The output block (which a reduction split's partials share).
    pub tile: Rect,
    pub device: DeviceId,
    /// Which partial of its block this point computes, of how many (`(0, 1)`: the whole block).
    pub partial: (usize, usize),
}

pub struct Mapper<'g> {
    graph: &'g Graph,
    configs: &'g [ParallelConfig],
}

impl<'g> Mapper<'g> {
    pub fn new(graph: &'g Graph, configs: &'g [ParallelConfig]) -> Mapper<'g> {
        assert_eq!(graph.layers().len(), configs.len(), "one config per layer");
        Mapper { graph, configs }
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
        let config = &self.configs[layer.0];
        Partition::blocks(&self.graph.layer(layer).shape, config)
            .rects
            .into_iter()
            .enumerate()
            .map(|(t, tile)| Point {
                tile,
                device: config.device_of_tile(t),
                partial: (config.reduction_of(t), config.reduction()),
            })
            .collect()
    }

    /// Every block of every parameter and buffer of `layer`, trainable or not
    /// ([`legion_ops::partition::param_homes`]).
    pub fn param_homes(&self, layer: LayerId) -> Vec<ParamHome> {
        param_homes(self.graph, layer, &self.configs[layer.0])
    }
}
