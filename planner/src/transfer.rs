//! t_x: moving a tensor from its producer's tiling to the rects its consumer's tiles read.
//!
//! For an edge (producer `l_i` under `c_i` → input `k` of consumer `l_j` under `c_j`):
//! every consumer tile needs `project(inputs of l_j, tile)[k]`; every producer tile that overlaps it
//! and lives on a *different* device sends the intersection (the machine's
//! [`MachineModel::activation_bytes`] per element: 4 in fp32 and tf32, 2 in bf16) over the link
//! producer device → consumer device in the forward pass, and the consumer sends the gradient of the
//! same region back over the reverse link in the backward pass — except when the producer is the
//! input layer, whose data needs no gradient. Overlaps on the same device are free.
//!
//! Timing: transfers on different directed links proceed in parallel, transfers sharing a link
//! serialize, and each message pays the link's latency once. A message on a shared route
//! ([`crate::machine::Route`]) loads both its lanes instead of its pair's link, so messages through
//! one NIC (or switch port, or host bridge) serialize on it:
//!
//! ```text
//! t_fwd = max over links (a→b) and lanes of Σ_{messages on it} (bytes / bandwidth + latency)
//! t_bwd = the same over the reversed messages (0 for edges from the input layer)
//! t_x   = t_fwd + t_bwd
//! ```
//!
//! With aligned contiguous device blocks every ordered device pair carries at most one message per
//! edge and direction, which the cost tables exploit.

use crate::config::{ParallelConfig, tile_rect};
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, Lane, MachineModel, Route};
use legion_ops::op::project_partial;
use legion_ops::{Graph, LayerId, Op, Rect};

/// The output of `src` read as input number `input` of `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Edge {
    pub src: LayerId,
    pub dst: LayerId,
    pub input: usize,
}

impl Edge {
    /// Whether the backward pass sends gradients back along this edge (not to the input layer).
    pub fn carries_gradient(&self, graph: &Graph) -> bool {
        !matches!(graph.layer(self.src).op, Op::Input(_))
    }
}

/// Every edge of the graph, by consumer and then input position. A layer that reads the same tensor
/// twice has two edges.
pub fn graph_edges(graph: &Graph) -> Vec<Edge> {
    graph
        .ids()
        .flat_map(|dst| {
            graph
                .layer(dst)
                .inputs
                .iter()
                .enumerate()
                .map(move |(input, &src)| Edge { src, dst, input })
        })
        .collect()
}

/// A producer tile's share of what a consumer tile reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileOverlap {
    pub src_tile: usize,
    pub dst_tile: usize,
    pub src_device: DeviceId,
    pub dst_device: DeviceId,
    /// The shared region, in the tensor's coordinates.
    pub rect: Rect,
}

impl TileOverlap {
    /// Both tiles on one device: nothing moves.
    pub fn is_local(&self) -> bool {
        self.src_device == self.dst_device
    }

    /// Bytes of the region at `element_bytes` per element (an activation's or its gradient's:
    /// [`MachineModel::activation_bytes`]).
    pub fn bytes(&self, element_bytes: u64) -> u64 {
        element_bytes * self.rect.volume() as u64
    }
}

/// Every non-empty (producer tile, consumer tile) overlap of `edge` under the two configs, local ones
/// included, by consumer tile and then producer tile.
///
/// Under a reduction split ([`ParallelConfig::reduction`]) a producer's block is finished, and so
/// held, by its first partial's tile alone, and a consumer's partial reads only its block of the
/// input channels ([`project_partial`]), as the runtime lowers them.
pub fn edge_overlaps(
    graph: &Graph,
    edge: &Edge,
    src_config: &ParallelConfig,
    dst_config: &ParallelConfig,
) -> Vec<TileOverlap> {
    let producer = graph.layer(edge.src);
    let consumer = graph.layer(edge.dst);
    let inputs = graph.input_shapes(edge.dst);
    let src_tiles: Vec<(usize, Rect)> = (0..src_config.total())
        .filter(|&t| src_config.reduction_of(t) == 0)
        .map(|t| (t, tile_rect(&producer.shape, src_config, t)))
        .collect();
    let red = dst_config.reduction();
    let mut out = Vec::new();
    for dst_tile in 0..dst_config.total() {
        let out_rect = tile_rect(&consumer.shape, dst_config, dst_tile);
        let partial = dst_config.reduction_of(dst_tile);
        let needed =
            project_partial(consumer.op.spec(), &inputs, &out_rect, partial, red)[edge.input];
        if needed.is_empty() {
            continue;
        }
        for &(src_tile, ref r) in &src_tiles {
            let rect = r.intersect(&needed);
            if !rect.is_empty() {
                out.push(TileOverlap {
                    src_tile,
                    dst_tile,
                    src_device: src_config.device_of_tile(src_tile),
                    dst_device: dst_config.device_of_tile(dst_tile),
                    rect,
                });
            }
        }
    }
    out
}

/// A reduction split's own messages, as overlaps from each partial past the first to its block's
/// first partial: forward, the partial sum it folds there; backward (the reverse), the block's
/// output gradient that every partial needs. Empty without a reduction split.
pub fn partial_sum_messages(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
) -> Vec<TileOverlap> {
    let shape = &graph.layer(layer).shape;
    (0..config.total())
        .filter(|&t| config.reduction_of(t) > 0)
        .map(|t| {
            let first = t - config.reduction_of(t);
            TileOverlap {
                src_tile: t,
                dst_tile: first,
                src_device: config.device_of_tile(t),
                dst_device: config.device_of_tile(first),
                rect: tile_rect(shape, config, t),
            }
        })
        .collect()
}

/// t_x of a set of overlaps (forward activations plus, with `gradient`, backward gradients), as
/// documented above.
pub fn transfer_time(overlaps: &[TileOverlap], machine: &MachineModel, gradient: bool) -> f64 {
    let element = machine.activation_bytes();
    let busiest = |reverse: bool| {
        let mut load = Loads::default();
        for o in overlaps.iter().filter(|o| !o.is_local()) {
            let (from, to) = if reverse {
                (o.dst_device, o.src_device)
            } else {
                (o.src_device, o.dst_device)
            };
            load.add(machine, from, to, o.bytes(element), 1);
        }
        load.busiest()
    };
    let forward = busiest(false);
    if gradient {
        forward + busiest(true)
    } else {
        forward
    }
}

/// Seconds of messages per directed link and per shared lane: [`transfer_time`]'s and
/// [`crate::sync::sync_time`]'s sums.
///
/// Each link or lane sums its messages' bytes and count exactly (integers) and prices the sums
/// once, `bytes · seconds_per_byte + messages · latency` per link that loads it, so a load does not
/// depend on the order its messages were added in: the per-axis tables
/// (`crate::transfer_table`), which sum over boxes of tile pairs in another order, give the same
/// bits.
#[derive(Debug, Default)]
pub(crate) struct Loads {
    /// By [`Loads::link_key`] or [`Loads::lane_key`].
    sums: FastHashMap<u64, LaneSum>,
}

/// One link's or lane's messages, per link that carries them (one, unless per-pair overrides
/// give a shared lane's routes different links).
#[derive(Debug)]
struct LaneSum {
    first: LinkSum,
    others: Vec<LinkSum>,
}

/// Bytes and messages of one link (its seconds per byte and latency, as bits).
#[derive(Clone, Copy, Debug)]
struct LinkSum {
    link: (u64, u64),
    bytes: u64,
    messages: u64,
}

impl LinkSum {
    fn seconds(&self) -> f64 {
        lane_seconds(
            self.bytes,
            self.messages,
            f64::from_bits(self.link.0),
            f64::from_bits(self.link.1),
        )
    }
}

impl Loads {
    /// `messages` messages of `bytes` in total from `from` to `to` (nothing on one device).
    pub(crate) fn add(
        &mut self,
        machine: &MachineModel,
        from: DeviceId,
        to: DeviceId,
        bytes: u64,
        messages: u32,
    ) {
        self.add_route(machine.route(from, to), from, to, bytes, messages);
    }

    /// [`Loads::add`] of a message on `route` (`None`: on one device).
    pub(crate) fn add_route(
        &mut self,
        route: Option<Route>,
        from: DeviceId,
        to: DeviceId,
        bytes: u64,
        messages: u32,
    ) {
        let Some(route) = route else {
            return;
        };
        let sum = LinkSum {
            link: (
                route.link.seconds_per_byte().to_bits(),
                route.link.latency_s.to_bits(),
            ),
            bytes,
            messages: u64::from(messages),
        };
        let mut load = |key: u64| {
            let lane = self.sums.entry(key).or_insert(LaneSum {
                first: LinkSum {
                    bytes: 0,
                    messages: 0,
                    ..sum
                },
                others: Vec::new(),
            });
            let into = if lane.first.link == sum.link {
                &mut lane.first
            } else if let Some(other) = lane.others.iter_mut().find(|o| o.link == sum.link) {
                other
            } else {
                lane.others.push(LinkSum {
                    bytes: 0,
                    messages: 0,
                    ..sum
                });
                lane.others.last_mut().expect("just pushed")
            };
            into.bytes += sum.bytes;
            into.messages += sum.messages;
        };
        match route.lanes {
            None => load(Self::link_key(from, to)),
            Some((out, into)) => {
                load(Self::lane_key(out));
                if into != out {
                    load(Self::lane_key(into));
                }
            }
        }
    }

    fn link_key(from: DeviceId, to: DeviceId) -> u64 {
        ((from as u64) << 32) | to as u64
    }

    fn lane_key(lane: Lane) -> u64 {
        (1 << 63) | lane as u64
    }

    /// The busiest link's or lane's seconds. A lane that messages of several links load (only on
    /// a machine with per-pair overrides) adds its links' seconds in the order of their bits.
    pub(crate) fn busiest(&self) -> f64 {
        let mut busiest = 0.0f64;
        let mut links = Vec::new();
        for lane in self.sums.values() {
            let seconds = if lane.others.is_empty() {
                lane.first.seconds()
            } else {
                links.clear();
                links.push(lane.first);
                links.extend_from_slice(&lane.others);
                links.sort_unstable_by_key(|l| l.link);
                links.iter().map(LinkSum::seconds).sum()
            };
            busiest = busiest.max(seconds);
        }
        busiest
    }
}

/// Seconds of `messages` messages of `bytes` in total on one link or lane: every table and sum of
/// t_x and t_s prices a load with this one formula.
pub(crate) fn lane_seconds(
    bytes: u64,
    messages: u64,
    seconds_per_byte: f64,
    latency_s: f64,
) -> f64 {
    bytes as f64 * seconds_per_byte + messages as f64 * latency_s
}

/// Bytes moved between devices by a set of overlaps, forward and (with `gradient`) backward.
pub fn transfer_bytes(overlaps: &[TileOverlap], gradient: bool, element_bytes: u64) -> u64 {
    (if gradient { 2 } else { 1 })
        * overlaps
            .iter()
            .filter(|o| !o.is_local())
            .map(|o| o.bytes(element_bytes))
            .sum::<u64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::op::{Conv2d, Dense};
    use legion_ops::{Dim, GraphBuilder, Shape};

    fn edge(g: &Graph, dst: &str) -> Edge {
        let dst = g.find(dst).unwrap();
        Edge {
            src: g.layer(dst).inputs[0],
            dst,
            input: 0,
        }
    }

    /// fc1 (n-split on devices 0, 1) → fc2 (c-split on devices 0, 1): each fc2 tile reads all 64
    /// samples × 256 features; half of them (32 × 256) live on the other device.
    #[test]
    fn dense_sample_split_to_channel_split_by_hand() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(64, 128)).unwrap();
        let a = m.dense("fc1", x, Dense::new(256)).unwrap();
        m.dense("fc2", a, Dense::new(100)).unwrap();
        let g = m.finish();
        let e = edge(&g, "fc2");
        let n2 = ParallelConfig::split(Dim::N, 2, 0);
        let c2 = ParallelConfig::split(Dim::C, 2, 0);
        let overlaps = edge_overlaps(&g, &e, &n2, &c2);
        let moved: Vec<_> = overlaps.iter().filter(|o| !o.is_local()).collect();
        assert_eq!(moved.len(), 2);
        let per_message = 32 * 256 * 4;
        assert!(moved.iter().all(|o| o.bytes(4) == per_message));
        // forward 2 messages + backward 2 messages
        assert_eq!(transfer_bytes(&overlaps, true, 4), 4 * per_message);
        let machine = MachineModel::preset("paper:2").unwrap();
        let one = per_message as f64 / 20e9 + 5e-6;
        let t = transfer_time(&overlaps, &machine, true);
        assert!((t - 2.0 * one).abs() < 1e-15, "{t} vs {}", 2.0 * one);
    }

    /// conv (h-split on 2 devices) → 3×3 conv with padding 1 (h-split on the same 2 devices): each
    /// consumer half needs one halo row of every sample and channel from the other device.
    #[test]
    fn conv_height_split_moves_only_halo_rows() {
        let (n, c, h, w) = (4, 8, 16, 10);
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(n, 3, h, w)).unwrap();
        let a = m.conv2d("a", x, Conv2d::new(c, 3).padding(1)).unwrap();
        m.conv2d("b", a, Conv2d::new(6, 3).padding(1)).unwrap();
        let g = m.finish();
        let e = edge(&g, "b");
        let h2 = ParallelConfig::split(Dim::H, 2, 0);
        let overlaps = edge_overlaps(&g, &e, &h2, &h2);
        let halo_row = (n * c * w * 4) as u64;
        let moved: Vec<_> = overlaps.iter().filter(|o| !o.is_local()).collect();
        assert_eq!(moved.len(), 2);
        assert!(moved.iter().all(|o| o.bytes(4) == halo_row));
        assert_eq!(transfer_bytes(&overlaps, true, 4), 4 * halo_row);
        // rows 7 (to device 1) and 8 (to device 0)
        let rows: Vec<_> = moved.iter().map(|o| (o.rect.lo[2], o.rect.hi[2])).collect();
        assert_eq!(rows, vec![(8, 9), (7, 8)]);
    }

    #[test]
    fn same_config_chain_moves_nothing() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 12, 12)).unwrap();
        let a = m.conv2d("a", x, Conv2d::new(8, 1)).unwrap();
        m.relu("r", a).unwrap();
        let g = m.finish();
        let cfg = ParallelConfig::new([2, 2, 1, 1], 4);
        let overlaps = edge_overlaps(&g, &edge(&g, "r"), &cfg, &cfg);
        assert_eq!(overlaps.len(), 4);
        assert!(overlaps.iter().all(|o| o.is_local()));
        assert_eq!(transfer_bytes(&overlaps, true, 4), 0);
        let machine = MachineModel::preset("paper:8").unwrap();
        assert_eq!(transfer_time(&overlaps, &machine, true), 0.0);
    }

    #[test]
    fn messages_on_different_links_overlap_and_on_one_link_serialize() {
        // serial producer on device 0 → consumer split 2 ways on devices 2, 3: links 0→2 and 0→3
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(8, 4)).unwrap();
        m.relu("r", x).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:4").unwrap();
        let e = edge(&g, "r");
        let overlaps = edge_overlaps(
            &g,
            &e,
            &ParallelConfig::serial(0),
            &ParallelConfig::split(Dim::N, 2, 2),
        );
        let msg = 4.0 * 4.0 * 4.0 / 20e9 + 5e-6;
        // the producer is the input layer: no gradient goes back
        assert!(!e.carries_gradient(&g));
        assert!((transfer_time(&overlaps, &machine, false) - msg).abs() < 1e-15);
        assert!((transfer_time(&overlaps, &machine, true) - 2.0 * msg).abs() < 1e-15);
        // the same two messages forced onto one link take twice as long each way
        let same_link: Vec<_> = overlaps
            .iter()
            .map(|o| TileOverlap {
                dst_device: 2,
                ..*o
            })
            .collect();
        assert!((transfer_time(&same_link, &machine, true) - 4.0 * msg).abs() < 1e-15);
    }

    /// Four GPUs of node 0 each send a quarter of the batch to a GPU of node 1. With a link per
    /// device pair the four messages travel side by side; through the nodes' one NIC each they
    /// queue: four times one message's time, latency included (each message pays it).
    #[test]
    fn four_senders_through_one_nic_take_four_times_one() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(16, 1024)).unwrap();
        m.relu("r", x).unwrap();
        let g = m.finish();
        let e = edge(&g, "r");
        let overlaps = edge_overlaps(
            &g,
            &e,
            &ParallelConfig::split(Dim::N, 4, 0),
            &ParallelConfig::split(Dim::N, 4, 4),
        );
        assert_eq!(overlaps.iter().filter(|o| !o.is_local()).count(), 4);
        // 4 samples × 1024 features × 4 bytes over 100 Gb/s, plus 10 us
        let one = (4 * 1024 * 4) as f64 / 12.5e9 + 10e-6;
        let pairs = MachineModel::preset("paper-pairs:8").unwrap();
        let shared = MachineModel::preset("paper:8").unwrap();
        assert!((transfer_time(&overlaps, &pairs, false) - one).abs() < 1e-15);
        let t = transfer_time(&overlaps, &shared, false);
        assert!((t - 4.0 * one).abs() < 1e-15, "{t} vs {}", 4.0 * one);
        // inside one node the pairs' NVLinks stay private: nothing queues
        let inside = edge_overlaps(
            &g,
            &e,
            &ParallelConfig::split(Dim::N, 2, 0),
            &ParallelConfig::split(Dim::N, 2, 2),
        );
        assert_eq!(
            transfer_time(&inside, &shared, false),
            transfer_time(&inside, &pairs, false)
        );
    }

    /// fc1 (serial on device 0) → fc2 split in two partial sums over its 256 input features on
    /// devices 0 and 1: each partial reads its half of the features (the second half crosses to
    /// device 1, and its gradient back); the partial on device 1 folds its 64 × 100 partial sum
    /// into device 0's and receives the block's output gradient back.
    #[test]
    fn a_reduction_split_reads_its_channel_block_and_exchanges_its_partial_sums() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(64, 128)).unwrap();
        let a = m.dense("fc1", x, Dense::new(256)).unwrap();
        let b = m.dense("fc2", a, Dense::new(100)).unwrap();
        m.relu("r", b).unwrap();
        let g = m.finish();
        let red = ParallelConfig::serial(0).with_reduction(2);
        let overlaps = edge_overlaps(&g, &edge(&g, "fc2"), &ParallelConfig::serial(0), &red);
        let moved: Vec<_> = overlaps.iter().filter(|o| !o.is_local()).collect();
        assert_eq!(moved.len(), 1);
        assert_eq!((moved[0].src_device, moved[0].dst_device), (0, 1));
        assert_eq!((moved[0].rect.lo[1], moved[0].rect.hi[1]), (128, 256));
        assert_eq!(transfer_bytes(&overlaps, true, 4), 2 * 64 * 128 * 4);
        let sums = partial_sum_messages(&g, g.find("fc2").unwrap(), &red);
        assert_eq!(sums.len(), 1);
        assert_eq!((sums[0].src_device, sums[0].dst_device), (1, 0));
        assert_eq!(transfer_bytes(&sums, true, 4), 2 * 64 * 100 * 4);
        // a consumer of the split layer reads the finished block from its first partial only
        let after = edge_overlaps(&g, &edge(&g, "r"), &red, &ParallelConfig::serial(1));
        assert_eq!(after.len(), 1);
        assert_eq!((after[0].src_device, after[0].dst_device), (0, 1));
        assert!(
            partial_sum_messages(&g, g.find("fc1").unwrap(), &ParallelConfig::serial(0)).is_empty()
        );
    }
}
