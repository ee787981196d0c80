//! t_s: parameter synchronisation, exactly as the runtime performs it.
//!
//! After a layer's backward pass, every tile holds the gradient of the parameter slices it used
//! ([`OpSpec::param_rect`] of its output tile). Tiles whose slice of a parameter is the same form a
//! *replica group* (a pure channel split has one tile per slice; a sample split replicates every
//! slice on every tile). For each group with more than one tile:
//!
//! 1. the owner is the group's lowest-numbered device;
//! 2. every other replica sends its gradient slice to the owner (one message per parameter tensor);
//! 3. the owner sums the gradients in ascending device order, starting with its own, and applies the
//!    update;
//! 4. the owner sends the updated slice back to every other replica (one message each).
//!
//! Only trainable parameters are synchronised (batch-norm running statistics are computed from
//! whole-batch statistics and are already equal on every tile). The owner's summing and update are
//! not timed: they are negligible next to the transfers (OptCNN §5.1).
//!
//! Timing: an owner first receives everything, then sends everything. Messages on one directed link
//! serialize (each paying the link's latency), different links proceed in parallel, and different
//! owners work in parallel:
//!
//! ```text
//! link(a→b)    = (Σ bytes of its messages) / bandwidth(a,b) + (number of messages) · latency(a,b)
//! gather(o)    = max over replicas r of link(r→o)
//! broadcast(o) = max over replicas r of link(o→r)
//! t_s          = max over owners o of gather(o) + broadcast(o)
//! ```
//!
//! [`OpSpec::param_rect`]: legion_ops::op::OpSpec::param_rect

use crate::config::{ParallelConfig, tile_rect};
use crate::machine::{DeviceId, MachineModel};
use legion_ops::{Graph, LayerId, Rect};
use std::collections::BTreeMap;

/// Tiles of one layer sharing a slice of one parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaGroup {
    /// Index of the parameter among the layer's `params()`.
    pub param: usize,
    /// The slice, in the parameter's coordinates.
    pub slice: Rect,
    /// The lowest-numbered device holding the slice: it sums and updates.
    pub owner: DeviceId,
    /// The other devices holding the slice, ascending.
    pub replicas: Vec<DeviceId>,
}

impl ReplicaGroup {
    /// f32 bytes of the slice (one message).
    pub fn bytes(&self) -> u64 {
        4 * self.slice.volume() as u64
    }
}

/// The replica groups of one layer under one config (only groups with other replicas).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncPlan {
    pub groups: Vec<ReplicaGroup>,
}

impl SyncPlan {
    /// Groups every tile of `layer` under `config` by parameter slice, for each trainable parameter.
    pub fn for_layer(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> SyncPlan {
        let l = graph.layer(layer);
        let inputs = graph.input_shapes(layer);
        let op = l.op.spec();
        let tiles: Vec<Rect> = (0..config.total())
            .map(|t| tile_rect(&l.shape, config, t))
            .collect();
        let mut groups = Vec::new();
        for (param, spec) in op.params(&inputs).iter().enumerate() {
            if !spec.trainable {
                continue;
            }
            // Tiles run on devices in ascending order, so the first device seen for a slice owns it.
            let mut by_slice: Vec<(Rect, Vec<DeviceId>)> = Vec::new();
            for (t, tile) in tiles.iter().enumerate() {
                let slice = op.param_rect(&inputs, param, tile);
                let device = config.device_of_tile(t);
                match by_slice.iter_mut().find(|(s, _)| *s == slice) {
                    Some((_, devices)) => devices.push(device),
                    None => by_slice.push((slice, vec![device])),
                }
            }
            for (slice, devices) in by_slice {
                if devices.len() > 1 && !slice.is_empty() {
                    groups.push(ReplicaGroup {
                        param,
                        slice,
                        owner: devices[0],
                        replicas: devices[1..].to_vec(),
                    });
                }
            }
        }
        SyncPlan { groups }
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// t_s, as documented above.
    pub fn time(&self, machine: &MachineModel) -> f64 {
        sync_time(&self.link_loads(), machine)
    }

    /// What crosses each (owner, replica) link: total bytes and messages, by owner then replica.
    pub fn link_loads(&self) -> Vec<LinkLoad> {
        let mut links: BTreeMap<(DeviceId, DeviceId), LinkLoad> = BTreeMap::new();
        for g in &self.groups {
            for &replica in &g.replicas {
                let l = links.entry((g.owner, replica)).or_insert(LinkLoad {
                    owner: g.owner,
                    replica,
                    bytes: 0,
                    messages: 0,
                });
                l.bytes += g.bytes();
                l.messages += 1;
            }
        }
        links.into_values().collect()
    }

    /// Bytes moved: each replica's gradient in and its updated slice out.
    pub fn bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| 2 * g.bytes() * g.replicas.len() as u64)
            .sum()
    }
}

/// The messages between an owner and one replica, in each direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkLoad {
    pub owner: DeviceId,
    pub replica: DeviceId,
    pub bytes: u64,
    pub messages: u32,
}

/// t_s from per-link loads sorted by owner: `messages` serialized messages of `bytes` in total take
/// `bytes / bandwidth + messages · latency` on a link.
pub fn sync_time(loads: &[LinkLoad], machine: &MachineModel) -> f64 {
    sync_time_shifted(loads, machine, 0)
}

/// [`sync_time`] with every device moved up by `offset` (the same layout on another device block).
pub(crate) fn sync_time_shifted(loads: &[LinkLoad], machine: &MachineModel, offset: usize) -> f64 {
    let on_link = |from: DeviceId, to: DeviceId, l: &LinkLoad| {
        machine.link(from, to).map_or(0.0, |link| {
            l.bytes as f64 * link.seconds_per_byte() + f64::from(l.messages) * link.latency_s
        })
    };
    let mut worst = 0.0f64;
    let mut i = 0;
    while i < loads.len() {
        let owner = loads[i].owner;
        let (mut gather, mut broadcast) = (0.0f64, 0.0f64);
        while i < loads.len() && loads[i].owner == owner {
            let (o, r) = (owner + offset, loads[i].replica + offset);
            gather = gather.max(on_link(r, o, &loads[i]));
            broadcast = broadcast.max(on_link(o, r, &loads[i]));
            i += 1;
        }
        worst = worst.max(gather + broadcast);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::op::{Conv2d, Dense};
    use legion_ops::{Dim, GraphBuilder, Shape};

    fn dense() -> (Graph, LayerId) {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(32, 100)).unwrap();
        let fc = m.dense("fc", x, Dense::new(64)).unwrap();
        (m.finish(), fc)
    }

    #[test]
    fn sample_split_replicates_every_parameter() {
        let (g, fc) = dense();
        let plan = SyncPlan::for_layer(&g, fc, &ParallelConfig::split(Dim::N, 4, 4));
        assert_eq!(plan.groups.len(), 2, "weight and bias");
        assert!(
            plan.groups
                .iter()
                .all(|gr| gr.owner == 4 && gr.replicas == [5, 6, 7])
        );
        let bytes = (64 * 100 + 64) * 4;
        assert_eq!(plan.bytes(), 2 * 3 * bytes);
        // devices 4..8 are one node of paper:8: two messages (weight, bias) per link and direction
        let machine = MachineModel::preset("paper:8").unwrap();
        let one_way = bytes as f64 / 20e9 + 2.0 * 5e-6;
        assert!((plan.time(&machine) - 2.0 * one_way).abs() < 1e-15);
    }

    #[test]
    fn channel_split_needs_no_sync() {
        let (g, fc) = dense();
        let plan = SyncPlan::for_layer(&g, fc, &ParallelConfig::split(Dim::C, 4, 0));
        assert!(plan.is_empty());
        assert_eq!(plan.time(&MachineModel::preset("paper:4").unwrap()), 0.0);
        assert!(SyncPlan::for_layer(&g, fc, &ParallelConfig::serial(2)).is_empty());
    }

    #[test]
    fn mixed_split_has_one_group_per_channel_block() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 16, 16)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(8, 3).padding(1)).unwrap();
        let g = m.finish();
        // n=2, c=2 on devices 0..4: tiles (n0,c0)=0 (n0,c1)=1 (n1,c0)=2 (n1,c1)=3
        let plan = SyncPlan::for_layer(&g, c, &ParallelConfig::new([2, 2, 1, 1], 0));
        let owners: Vec<_> = plan
            .groups
            .iter()
            .map(|gr| (gr.param, gr.owner, gr.replicas.clone()))
            .collect();
        assert_eq!(
            owners,
            vec![
                (0, 0, vec![2]),
                (0, 1, vec![3]),
                (1, 0, vec![2]),
                (1, 1, vec![3])
            ]
        );
        assert_eq!(
            plan.groups[0].slice,
            Rect::new(&[0, 0, 0, 0], &[4, 3, 3, 3])
        );
        // across nodes the inter-node link dominates
        let machine = MachineModel::preset("paper:16").unwrap();
        let plan = SyncPlan::for_layer(&g, c, &ParallelConfig::split(Dim::N, 8, 0));
        let w = (8 * 3 * 3 * 3 * 4) as f64;
        let b = 8.0 * 4.0;
        let one_way = w / 12.5e9 + b / 12.5e9 + 2.0 * 10e-6;
        assert!((plan.time(&machine) - 2.0 * one_way).abs() < 1e-15);
    }
}
