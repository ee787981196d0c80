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
use legion_ops::op::partial_param_rect;
use legion_ops::partition::owned_blocks;
use legion_ops::partition::{DeviceId, ParallelConfig};
use legion_ops::{Graph, LayerId, Rect};

/// One point of a layer's launch domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    /// The output block (which a reduction split's partials share).
    pub tile: Rect,
    pub device: DeviceId,
    /// Which partial of its block this point computes, of how many (`(0, 1)`: the whole block).
    pub partial: (usize, usize),
}

/// A block of a layer's parameter `param`, its owner and the other devices whose tiles use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamHome {
    pub param: usize,
    /// The block the owner keeps and updates.
    pub slice: Rect,
    /// The slice the tiles read, which `slice` is a block of.
    pub read_slice: Rect,
    pub owner: DeviceId,
    /// The other devices using the slice, ascending.
    pub replicas: Vec<DeviceId>,
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

    /// Every block of every parameter and buffer of `layer`, trainable or not.
    pub fn param_homes(&self, layer: LayerId) -> Vec<ParamHome> {
        let l = self.graph.layer(layer);
        let inputs = self.graph.input_shapes(layer);
        let op = l.op.spec();
        let points = self.points(layer);
        let mut homes: Vec<ParamHome> = Vec::new();
        for (param, spec) in op.params(&inputs).iter().enumerate() {
            // Slices in order of first use; devices ascending, as tiles are.
            let mut slices: Vec<(Rect, Vec<DeviceId>)> = Vec::new();
            for p in &points {
                let (r, red) = p.partial;
                let Some(slice) = partial_param_rect(op, param, spec, &p.tile, r, red) else {
                    continue;
                };
                match slices.iter_mut().find(|(s, _)| *s == slice) {
                    Some((_, devices)) if !devices.contains(&p.device) => devices.push(p.device),
                    Some(_) => {}
                    None => slices.push((slice, vec![p.device])),
                }
            }
            for (read_slice, devices) in slices {
                let blocks = if spec.trainable && devices.len() > 1 && !read_slice.is_empty() {
                    owned_blocks(&read_slice, &devices)
                } else {
                    vec![(read_slice, devices[0])]
                };
                for (slice, owner) in blocks {
                    homes.push(ParamHome {
                        param,
                        slice,
                        read_slice,
                        owner,
                        replicas: devices.iter().copied().filter(|&d| d != owner).collect(),
                    });
                }
            }
        }
        homes
    }
}
