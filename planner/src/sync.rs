//! t_s: parameter synchronisation, exactly as the runtime performs it.
//!
//! After a layer's backward pass, every tile holds the gradient of the parameter slices it used
//! ([`OpSpec::param_rect`] of its output tile). Tiles whose slice of a parameter is the same share
//! it as *replicas* (a pure channel split has one tile per slice; a sample split replicates every
//! slice on every tile). A slice with k > 1 replicas (devices d_0 < … < d_{k-1}) is cut into k blocks
//! of rows along its first axis ([`owned_blocks`]; block j is `[e·j/k, e·(j+1)/k)` of its e rows, so
//! fewer blocks when e < k), and block j is *owned* by d_j — a reduce-scatter then all-gather, so no
//! device carries the whole layer's synchronisation. Per block (a [`ReplicaGroup`]):
//!
//! 1. every other replica sends its gradient of the block to the owner (one message);
//! 2. the owner sums the gradients in ascending device order, its own in its place, and applies
//!    the update (it keeps the block's momentum);
//! 3. the owner sends the updated block back to every other replica (one message each).
//!
//! Only trainable parameters are synchronised (batch-norm running statistics are computed from
//! whole-batch statistics and are already equal on every tile). The owner's summing and update are
//! not timed here: they are negligible next to the transfers (OptCNN §5.1); the simulator prices them.
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
//! On a machine with shared routes ([`crate::machine::Route`]: NICs, switch ports, a host
//! bridge), owners no longer work apart: every replica → owner message through one NIC queues on
//! it, whoever the owner. Then t_s is also at least the busiest lane's load of the gathers plus
//! that of the broadcasts, and the larger of the two bounds:
//!
//! ```text
//! lane_gather    = max over lanes of Σ_{replica → owner messages on it} (bytes / bandwidth + latency)
//! lane_broadcast = the same over the owner → replica messages
//! t_s            = max(max over owners o of gather(o) + broadcast(o), lane_gather + lane_broadcast)
//! ```
//!
//! On a machine of several nodes a block's replicas on another node than its owner's, two or
//! more there, go through one relay of theirs ([`legion_ops::partition::relays`]): the relay
//! sums their gradients with its own and sends the owner one message, and forwards the updated
//! block to them. Then t_s is that of the messages within nodes to the relays plus that of the
//! messages to the owners, each as above ([`relayed_sync_time`]): the relays' gathers come before
//! the owners', and their broadcasts after.
//!
//! [`OpSpec::param_rect`]: legion_ops::op::OpSpec::param_rect

pub use legion_ops::partition::{Nodes, SliceUsers, owned_blocks, relays};

use crate::config::{ParallelConfig, block_range, tile_rect};
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, Link, MachineModel};
use crate::transfer::Loads;
use legion_ops::op::{OpSpec, ParamSpec, partial_param_rect};
use legion_ops::{Graph, LayerId, Rect};
use std::collections::BTreeMap;

/// Tiles of one layer sharing a slice of one parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaGroup {
    /// Index of the parameter among the layer's `params()`.
    pub param: usize,
    /// The slice, in the parameter's coordinates.
    pub slice: Rect,
    /// The device owning this block of the slice: it sums and updates.
    pub owner: DeviceId,
    /// The other devices holding the slice, ascending.
    pub replicas: Vec<DeviceId>,
}

impl ReplicaGroup {
    /// f32 bytes of the slice (one message): weight gradients and weights are fp32 in every
    /// precision, bf16's included (`Precision::weight_bytes`).
    pub fn bytes(&self) -> u64 {
        4 * self.slice.volume() as u64
    }
}

/// For each trainable parameter of `layer` under `config` (by index), its distinct slices in order
/// of first use, each with the devices of the tiles that use it, ascending
/// ([`legion_ops::partition::param_slices`] less the buffers).
pub fn param_slices(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
) -> Vec<(usize, Vec<SliceUsers>)> {
    let specs = graph.layer_params(layer);
    legion_ops::partition::param_slices(graph, layer, config)
        .into_iter()
        .filter(|(param, _)| specs[*param].trainable)
        .collect()
}

/// The replica groups of one layer under one config (only groups with other replicas).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncPlan {
    pub groups: Vec<ReplicaGroup>,
}

impl SyncPlan {
    /// Groups every tile of `layer` under `config` by parameter slice, for each trainable parameter.
    pub fn for_layer(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> SyncPlan {
        let mut groups = Vec::new();
        for (param, slices) in param_slices(graph, layer, config) {
            for (slice, devices) in slices {
                if devices.len() > 1 && !slice.is_empty() {
                    for (block, owner) in owned_blocks(&slice, &devices) {
                        groups.push(ReplicaGroup {
                            param,
                            slice: block,
                            owner,
                            replicas: devices.iter().copied().filter(|&d| d != owner).collect(),
                        });
                    }
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
        let blocks = self
            .groups
            .iter()
            .map(|g| (g.owner, g.replicas.as_slice(), g.bytes()));
        relayed_sync_time(blocks, machine, &machine.nodes())
            .map_or_else(|| sync_time(&self.link_loads(), machine), |(time, _)| time)
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

/// [`SyncPlan::link_loads`] of [`SyncPlan::for_layer`], without building the groups: the search
/// prices t_s for every layout of every layer, where the groups' allocations dominated.
pub fn layer_link_loads(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> Vec<LinkLoad> {
    let l = graph.layer(layer);
    let op = l.op.spec();
    let params = op.params(&graph.input_shapes(layer));
    let tiles: Vec<Rect> = (0..config.total())
        .map(|t| tile_rect(&l.shape, config, t))
        .collect();
    let mut buffers = LinkLoadBuffers::default();
    buffers.share(op, &params, &tiles, config.reduction());
    buffers.link_loads(config.first_device()).to_vec()
}

/// How the tiles of one layout share a layer's trainable parameters: for each parameter, its
/// distinct slices and which tiles use each. A layout's link loads depend on nothing else, so
/// layouts with equal patterns have equal t_s on every device block, and the cost tables compute it
/// once per pattern. Many layouts share one: a conv's slices follow its channel split alone, so
/// for instance every layout that does not split channels replicates every parameter on every tile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct SharingPattern {
    tiles: usize,
    /// Per trainable parameter, how many of `slices` are its.
    slices_per_param: Vec<usize>,
    /// (rows, elements) of each distinct slice, in order of first use, parameter by parameter: all
    /// that its blocks and messages depend on.
    slices: Vec<(usize, usize)>,
    /// Per parameter, then per tile: the index of the tile's slice among its parameter's slices
    /// ([`NO_SLICE`] where the tile holds none of it).
    /// A layout has at most as many tiles as the machine has devices, which `MachineModel` keeps
    /// within `u16`; the narrow type makes the pattern quicker to hash.
    slice_of_tile: Vec<u16>,
}

/// A tile's slice index where it holds none of the parameter.
const NO_SLICE: u16 = u16::MAX;

/// Working memory of [`layer_link_loads`]: the sharing pattern of the last layout given to
/// [`LinkLoadBuffers::share`], and buffers kept between layouts so that pricing many of them
/// allocates only while the buffers grow.
#[derive(Debug, Default)]
pub(crate) struct LinkLoadBuffers {
    pattern: SharingPattern,
    /// The distinct slices of one parameter, in order of first use.
    distinct: Vec<Rect>,
    /// (bytes, messages) per (owner, replica), indexed by their positions in the device block:
    /// `[owner * tiles + replica]`. All zero between calls (only the rows `owners` marks are
    /// written, and they are zeroed again after use), so a layout whose slices few tiles share
    /// does not clear and scan a square of its whole block: at a thousand devices that is 16 MB.
    matrix: Vec<(u64, u32)>,
    /// Per owner position, whether its row of `matrix` holds anything.
    owners: Vec<bool>,
    /// The tiles sharing one slice, ascending.
    positions: Vec<usize>,
    loads: Vec<LinkLoad>,
}

impl LinkLoadBuffers {
    /// The sharing pattern of a layout of a layer whose op is `op`, with parameters `params`
    /// (buffers are skipped) and output tiles `tiles`, in partial sums over `red` blocks of the
    /// input channels (1: none; tile `t` is then partial `t % red` of its block).
    pub(crate) fn share(
        &mut self,
        op: &dyn OpSpec,
        params: &[ParamSpec],
        tiles: &[Rect],
        red: usize,
    ) -> &SharingPattern {
        let pattern = &mut self.pattern;
        pattern.tiles = tiles.len();
        pattern.slices_per_param.clear();
        pattern.slices.clear();
        pattern.slice_of_tile.clear();
        for (param, spec) in params.iter().enumerate().filter(|(_, p)| p.trainable) {
            self.distinct.clear();
            for (t, tile) in tiles.iter().enumerate() {
                let Some(slice) = partial_param_rect(op, param, spec, tile, t % red, red) else {
                    // a partial past the first holds no bias
                    pattern.slice_of_tile.push(NO_SLICE);
                    continue;
                };
                let index = match self.distinct.iter().position(|s| *s == slice) {
                    Some(i) => i,
                    None => {
                        self.distinct.push(slice);
                        self.distinct.len() - 1
                    }
                };
                pattern
                    .slice_of_tile
                    .push(u16::try_from(index).expect("at most u16::MAX tiles"));
            }
            pattern.slices_per_param.push(self.distinct.len());
            pattern
                .slices
                .extend(self.distinct.iter().map(|s| (s.extent(0), s.volume())));
        }
        &self.pattern
    }

    /// The link loads of the pattern [`LinkLoadBuffers::share`] computed last, tile `t` on device
    /// `first + t`.
    pub(crate) fn link_loads(&mut self, first: DeviceId) -> &[LinkLoad] {
        let LinkLoadBuffers {
            pattern,
            matrix,
            owners,
            positions,
            loads,
            ..
        } = self;
        let total = pattern.tiles;
        let cells = total.checked_mul(total).expect("tiles within u16");
        if matrix.len() < cells {
            matrix.resize(cells, (0, 0));
        }
        owners.clear();
        owners.resize(total, false);
        let mut slices = pattern.slices.iter();
        for (param, &count) in pattern.slices_per_param.iter().enumerate() {
            let slice_of_tile = &pattern.slice_of_tile[param * total..(param + 1) * total];
            for (index, &(rows, volume)) in slices.by_ref().take(count).enumerate() {
                positions.clear();
                positions.extend((0..total).filter(|&t| usize::from(slice_of_tile[t]) == index));
                if positions.len() < 2 || volume == 0 {
                    continue;
                }
                let blocks = positions.len().min(rows);
                let row_bytes = 4 * (volume / rows) as u64;
                for j in 0..blocks {
                    let (a, b) = block_range(rows, blocks, j);
                    let owner = positions[j];
                    owners[owner] = true;
                    for &replica in positions.iter().filter(|&&p| p != owner) {
                        let cell = &mut matrix[owner * total + replica];
                        cell.0 += row_bytes * (b - a) as u64;
                        cell.1 += 1;
                    }
                }
            }
        }
        loads.clear();
        // row by row rather than dividing each cell's index: the divisions dominated this loop
        for owner in (0..total).filter(|&o| owners[o]) {
            let row = &mut matrix[owner * total..(owner + 1) * total];
            for (replica, cell) in row.iter_mut().enumerate() {
                let (bytes, messages) = std::mem::take(cell);
                if messages > 0 {
                    loads.push(LinkLoad {
                        owner: first + owner,
                        replica: first + replica,
                        bytes,
                        messages,
                    });
                }
            }
        }
        loads
    }
}

impl LinkLoadBuffers {
    /// [`relayed_sync_time`] of the pattern [`LinkLoadBuffers::share`] computed last, tile `t` on
    /// device `first + t`: `None` where no block goes through a relay (all its tiles on one node,
    /// or at most one of a slice's tiles on each other node).
    pub(crate) fn relayed_sync_time(
        &mut self,
        first: DeviceId,
        machine: &MachineModel,
        nodes: &Nodes,
    ) -> Option<f64> {
        let total = self.pattern.tiles;
        if total < 3 || nodes.node_of(first) == nodes.node_of(first + total - 1) {
            return None;
        }
        let mut blocks: Vec<(DeviceId, Vec<DeviceId>, u64)> = Vec::new();
        let mut slices = self.pattern.slices.iter();
        for (param, &count) in self.pattern.slices_per_param.iter().enumerate() {
            let slice_of_tile = &self.pattern.slice_of_tile[param * total..(param + 1) * total];
            for (index, &(rows, volume)) in slices.by_ref().take(count).enumerate() {
                let devices: Vec<DeviceId> = (0..total)
                    .filter(|&t| usize::from(slice_of_tile[t]) == index)
                    .map(|t| first + t)
                    .collect();
                if devices.len() < 2 || volume == 0 {
                    continue;
                }
                let row_bytes = 4 * (volume / rows) as u64;
                let count = devices.len().min(rows);
                for j in 0..count {
                    let (a, b) = block_range(rows, count, j);
                    let replicas = devices.iter().copied().filter(|&d| d != devices[j]);
                    blocks.push((devices[j], replicas.collect(), row_bytes * (b - a) as u64));
                }
            }
        }
        let blocks = blocks.iter().map(|(o, r, b)| (*o, r.as_slice(), *b));
        relayed_sync_time(blocks, machine, nodes).map(|(time, _)| time)
    }
}

/// How one owner's row of link loads is made (see [`LinkLoadBuffers::uniform_sync_time`]).
#[derive(Clone, Copy, Debug)]
struct OwnedShare {
    owner: usize,
    /// Index of the tiles sharing the slice, in [`LinkLoadBuffers`]' `sharer_sets`.
    sharers: u32,
    bytes: u64,
    messages: u32,
}

impl LinkLoadBuffers {
    /// [`sync_time_shifted`] of [`LinkLoadBuffers::link_loads`]`(0)` at offset `first`, the same
    /// number bit for bit, on a machine without shared lanes whose links depend only on whether
    /// two devices share a node (`nodes`: [`MachineModel::uniform_nodes`]), without listing every
    /// (owner, replica) link: a slice replicated on a thousand tiles has a million of them.
    ///
    /// An owner's row of loads is the sum, over the blocks it owns, of the block's bytes and one
    /// message on each other tile sharing the block's slice. Where one set of sharers makes the
    /// whole row (the usual case: a layer's parameters split alike), every link of the row
    /// carries the same load, so its largest time is that load over the slower link kind the set
    /// reaches (another tile in the owner's node, a tile in another node). Other rows are summed
    /// out one by one.
    pub(crate) fn uniform_sync_time(
        &mut self,
        first: DeviceId,
        (node_size, intra, inter): (usize, Link, Link),
    ) -> f64 {
        let total = self.pattern.tiles;
        let mut shares: Vec<OwnedShare> = Vec::new();
        let mut sharer_sets: Vec<Vec<usize>> = Vec::new();
        let mut set_of: FastHashMap<Vec<usize>, u32> = FastHashMap::default();
        let mut slices = self.pattern.slices.iter();
        for (param, &count) in self.pattern.slices_per_param.iter().enumerate() {
            let slice_of_tile = &self.pattern.slice_of_tile[param * total..(param + 1) * total];
            for (index, &(rows, volume)) in slices.by_ref().take(count).enumerate() {
                let positions = &mut self.positions;
                positions.clear();
                positions.extend((0..total).filter(|&t| usize::from(slice_of_tile[t]) == index));
                if positions.len() < 2 || volume == 0 {
                    continue;
                }
                let sharers = match set_of.get(positions.as_slice()) {
                    Some(&id) => id,
                    None => {
                        let id = u32::try_from(sharer_sets.len()).expect("at most u16 tiles");
                        set_of.insert(positions.clone(), id);
                        sharer_sets.push(positions.clone());
                        id
                    }
                };
                let blocks = positions.len().min(rows);
                let row_bytes = 4 * (volume / rows) as u64;
                for (j, &owner) in positions.iter().enumerate().take(blocks) {
                    let (a, b) = block_range(rows, blocks, j);
                    shares.push(OwnedShare {
                        owner,
                        sharers,
                        bytes: row_bytes * (b - a) as u64,
                        messages: 1,
                    });
                }
            }
        }
        // by owner, one entry per (owner, set of sharers)
        shares.sort_by_key(|s| (s.owner, s.sharers));
        shares.dedup_by(|later, earlier| {
            let same = (later.owner, later.sharers) == (earlier.owner, earlier.sharers);
            if same {
                earlier.bytes += later.bytes;
                earlier.messages += later.messages;
            }
            same
        });
        // as `sync_time_shifted` prices a link's load
        let time = |link: Link, bytes: u64, messages: u32| {
            bytes as f64 * link.seconds_per_byte() + f64::from(messages) * link.latency_s
        };
        let node = |position: usize| (first + position) / node_size;
        let matrix = &mut self.matrix;
        if matrix.len() < total {
            matrix.resize(total, (0, 0));
        }
        let mut worst = 0.0f64;
        for row in shares.chunk_by(|a, b| a.owner == b.owner) {
            let owner = row[0].owner;
            let own_node = node(owner);
            let mut busiest = 0.0f64;
            if let [one] = row {
                let sharers = &sharer_sets[one.sharers as usize];
                // the sharers are ascending: those on the owner's node are a run of them
                let in_node = sharers.partition_point(|&p| node(p) < own_node)
                    ..sharers.partition_point(|&p| node(p) <= own_node);
                // the owner is a sharer itself
                if in_node.len() > 1 {
                    busiest = busiest.max(time(intra, one.bytes, one.messages));
                }
                if in_node.len() < sharers.len() {
                    busiest = busiest.max(time(inter, one.bytes, one.messages));
                }
            } else {
                // `matrix`'s first `total` cells as this row, zero again afterwards
                for share in row {
                    for &replica in sharer_sets[share.sharers as usize].iter() {
                        if replica != owner {
                            let cell = &mut matrix[replica];
                            cell.0 += share.bytes;
                            cell.1 += share.messages;
                        }
                    }
                }
                for (replica, cell) in matrix[..total].iter_mut().enumerate() {
                    let (bytes, messages) = std::mem::take(cell);
                    if messages > 0 {
                        let link = if node(replica) == own_node {
                            intra
                        } else {
                            inter
                        };
                        busiest = busiest.max(time(link, bytes, messages));
                    }
                }
            }
            // gathering and broadcasting take the same links both ways
            worst = worst.max(busiest + busiest);
        }
        worst
    }
}

/// t_s of blocks `(owner, other devices ascending, bytes)` where some go through relays on
/// `nodes`: the messages to the relays within nodes, then those to the owners, each priced as
/// [`sync_time`] prices them (the relays in the owners' place in the first); and the bytes that
/// cross between nodes, both ways. `None` where no block has a relay: then the blocks sync as
/// [`sync_time`] of their link loads says.
pub fn relayed_sync_time<'a>(
    blocks: impl IntoIterator<Item = (DeviceId, &'a [DeviceId], u64)>,
    machine: &MachineModel,
    nodes: &Nodes,
) -> Option<(f64, u64)> {
    if nodes.count() < 2 {
        return None;
    }
    let mut within: BTreeMap<(DeviceId, DeviceId), LinkLoad> = BTreeMap::new();
    let mut to_owners: BTreeMap<(DeviceId, DeviceId), LinkLoad> = BTreeMap::new();
    let add = |map: &mut BTreeMap<(DeviceId, DeviceId), LinkLoad>, owner, replica, bytes| {
        let l = map.entry((owner, replica)).or_insert(LinkLoad {
            owner,
            replica,
            bytes: 0,
            messages: 0,
        });
        l.bytes += bytes;
        l.messages += 1;
    };
    let (mut relayed, mut between) = (false, 0);
    for (owner, replicas, bytes) in blocks {
        let relays = relays(owner, replicas, nodes);
        relayed |= !relays.is_empty();
        for relay in &relays {
            for &member in &relay.members {
                add(&mut within, relay.device, member, bytes);
            }
        }
        // the relays' members, ascending (relays come node by node): a replica is one of them
        // where the walk along them meets it
        let mut members = relays.iter().flat_map(|relay| &relay.members).peekable();
        for &r in replicas {
            while members.next_if(|&&m| m < r).is_some() {}
            if members.next_if_eq(&&r).is_none() {
                add(&mut to_owners, owner, r, bytes);
                if nodes.node_of(r) != nodes.node_of(owner) {
                    between += 2 * bytes;
                }
            }
        }
    }
    relayed.then(|| {
        let within: Vec<LinkLoad> = within.into_values().collect();
        let to_owners: Vec<LinkLoad> = to_owners.into_values().collect();
        let time = sync_time(&within, machine) + sync_time(&to_owners, machine);
        (time, between)
    })
}

/// One layer's synchronisation under one config, priced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSync {
    /// t_s, seconds.
    pub time: f64,
    /// Bytes moved: each replica's gradient in and its updated block out (to its owner or its
    /// relay).
    pub bytes: u64,
    /// The part of `bytes` that crosses between nodes, relays included.
    pub between_nodes: u64,
}

/// [`LayerSync`] of `layer` under `config` on `machine`.
pub fn layer_sync(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
    machine: &MachineModel,
) -> LayerSync {
    if machine.num_nodes() > 1 {
        let plan = SyncPlan::for_layer(graph, layer, config);
        let blocks = plan
            .groups
            .iter()
            .map(|g| (g.owner, g.replicas.as_slice(), g.bytes()));
        if let Some((time, between_nodes)) = relayed_sync_time(blocks, machine, &machine.nodes()) {
            return LayerSync {
                time,
                bytes: plan.bytes(),
                between_nodes,
            };
        }
    }
    // by link rather than by replica group: at a thousand devices a sample-split layer has
    // millions of (group, replica) messages but its loads are one pass over them
    let loads = layer_link_loads(graph, layer, config);
    let crosses = |l: &LinkLoad| machine.node_of(l.owner) != machine.node_of(l.replica);
    LayerSync {
        time: sync_time(&loads, machine),
        bytes: loads.iter().map(|l| 2 * l.bytes).sum(),
        between_nodes: loads
            .iter()
            .filter(|l| crosses(l))
            .map(|l| 2 * l.bytes)
            .sum(),
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
    if machine.has_shared_lanes() {
        let (mut gather, mut broadcast) = (Loads::default(), Loads::default());
        for l in loads {
            let (o, r) = (l.owner + offset, l.replica + offset);
            gather.add(machine, r, o, l.bytes, l.messages);
            broadcast.add(machine, o, r, l.bytes, l.messages);
        }
        worst = worst.max(gather.busiest() + broadcast.busiest());
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tile_rects;
    use legion_ops::op::{Conv2d, Dense};
    use legion_ops::{Dim, GraphBuilder, Shape};

    fn dense() -> (Graph, LayerId) {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(32, 100)).unwrap();
        let fc = m.dense("fc", x, Dense::new(64)).unwrap();
        (m.finish(), fc)
    }

    /// An owner on node 1 gathers a block from four replicas on node 0 and sends it back to them.
    /// With a link per device pair each phase takes one message's time; through the nodes' one
    /// NIC each, the four messages of each phase queue: four times as long.
    #[test]
    fn four_replicas_behind_one_nic_take_four_times_one() {
        let loads: Vec<LinkLoad> = (0..4)
            .map(|replica| LinkLoad {
                owner: 4,
                replica,
                bytes: 1 << 20,
                messages: 1,
            })
            .collect();
        let one = (1 << 20) as f64 / 12.5e9 + 10e-6;
        let pairs = MachineModel::preset("paper-pairs:8").unwrap();
        let shared = MachineModel::preset("paper:8").unwrap();
        assert!((sync_time(&loads, &pairs) - 2.0 * one).abs() < 1e-15);
        let t = sync_time(&loads, &shared);
        assert!((t - 8.0 * one).abs() < 1e-15, "{t} vs {}", 8.0 * one);
        // owners on different nodes no longer sync apart: two owners on node 1, each with one
        // replica on node 0, share node 0's out lane and node 1's in lane
        let two_owners = [
            LinkLoad {
                owner: 4,
                replica: 0,
                bytes: 1 << 20,
                messages: 1,
            },
            LinkLoad {
                owner: 5,
                replica: 1,
                bytes: 1 << 20,
                messages: 1,
            },
        ];
        assert!((sync_time(&two_owners, &pairs) - 2.0 * one).abs() < 1e-15);
        assert!((sync_time(&two_owners, &shared) - 4.0 * one).abs() < 1e-15);
    }

    #[test]
    fn sample_split_shares_every_parameter_out_in_blocks() {
        let (g, fc) = dense();
        let plan = SyncPlan::for_layer(&g, fc, &ParallelConfig::split(Dim::N, 4, 4));
        // weight [64, 100] and bias [64]: 4 blocks of 16 rows each, block j owned by device 4 + j
        assert_eq!(plan.groups.len(), 8);
        for (i, gr) in plan.groups.iter().enumerate() {
            let j = i % 4;
            assert_eq!(gr.owner, 4 + j);
            assert_eq!((gr.slice.lo[0], gr.slice.hi[0]), (16 * j, 16 * (j + 1)));
            let others: Vec<usize> = (4..8).filter(|&d| d != 4 + j).collect();
            assert_eq!(gr.replicas, others);
        }
        // every replica's gradient in, the updated values out: the same bytes as a single owner
        let bytes = (64 * 100 + 64) * 4;
        assert_eq!(plan.bytes(), 2 * 3 * bytes);
        // devices 4..8 are one node of paper:8: each link carries one weight block and one bias
        // block per direction, all owners in parallel
        let machine = MachineModel::preset("paper:8").unwrap();
        let block = (16 * 100 + 16) * 4;
        let one_way = block as f64 / 20e9 + 2.0 * 5e-6;
        assert!((plan.time(&machine) - 2.0 * one_way).abs() < 1e-15);
    }

    #[test]
    fn direct_link_loads_equal_the_groups_loads() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 16, 16)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(6, 3).padding(1)).unwrap();
        let g = m.finish();
        for config in [
            ParallelConfig::new([2, 2, 1, 1], 0),
            ParallelConfig::new([4, 1, 2, 1], 8),
            ParallelConfig::split(Dim::N, 8, 8),
            ParallelConfig::split(Dim::C, 4, 4),
            ParallelConfig::new([2, 1, 2, 2], 0),
        ] {
            assert_eq!(
                layer_link_loads(&g, c, &config),
                SyncPlan::for_layer(&g, c, &config).link_loads(),
                "{config}"
            );
        }
    }

    #[test]
    fn layouts_that_replicate_alike_share_one_pattern() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 16, 16)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(6, 3).padding(1)).unwrap();
        let g = m.finish();
        let l = g.layer(c);
        let op = l.op.spec();
        let params = op.params(&g.input_shapes(c));
        let pattern = |degrees| {
            let config = ParallelConfig::new(degrees, 0);
            let tiles: Vec<Rect> = tile_rects(&l.shape, &config).collect();
            let mut buffers = LinkLoadBuffers::default();
            buffers.share(op, &params, &tiles, 1).clone()
        };
        // a conv's slices follow the channel split alone: every 4-tile layout without one
        // replicates both parameters on all four tiles
        let replicated = pattern([4, 1, 1, 1]);
        assert_eq!(pattern([1, 1, 2, 2]), replicated);
        assert_eq!(pattern([2, 1, 1, 2]), replicated);
        assert_ne!(pattern([2, 2, 1, 1]), replicated);
        assert_ne!(
            pattern([2, 2, 1, 1]),
            pattern([1, 2, 2, 1]),
            "tile order differs"
        );
        assert_eq!(pattern([1, 2, 2, 1]), pattern([1, 2, 1, 2]));
    }

    /// On machines whose links depend only on sharing a node, t_s without the list of links is
    /// `sync_time_shifted` of that list, bit for bit, for every layout of a conv and a dense layer
    /// (reduction splits included: a partial past the first holds no bias) on every device block.
    #[test]
    fn uniform_sync_time_equals_the_listed_links() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 5, 6, 6)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(12, 3).padding(1)).unwrap();
        let f = m.flatten("f", c).unwrap();
        let fc = m.dense("fc", f, Dense::new(3)).unwrap();
        let g = m.finish();
        let (mut compared, mut reduced) = (0, 0);
        for machine in [
            MachineModel::from_flags(4, 4, Some(30.0), Some(3.0)).unwrap(),
            MachineModel::from_flags(2, 8, None, None).unwrap(),
            MachineModel::from_flags(1, 16, None, None).unwrap(),
        ] {
            let nodes = machine.uniform_nodes().expect("uniform nodes");
            for id in [c, fc] {
                let l = g.layer(id);
                let op = l.op.spec();
                let inputs = g.input_shapes(id);
                let params = op.params(&inputs);
                let space = crate::config::ConfigSpace::enumerate_with_reductions(
                    &l.shape,
                    op.parallel_dims(&l.shape),
                    machine.num_devices(),
                    op.reduction_channels(&inputs),
                );
                for config in space.configs() {
                    let red = config.reduction();
                    let tiles: Vec<Rect> = tile_rects(&l.shape, config)
                        .flat_map(|r| std::iter::repeat_n(r, red))
                        .collect();
                    let mut buffers = LinkLoadBuffers::default();
                    buffers.share(op, &params, &tiles, red);
                    let listed =
                        sync_time_shifted(buffers.link_loads(0), &machine, config.first_device());
                    let direct = buffers.uniform_sync_time(config.first_device(), nodes);
                    assert_eq!(direct.to_bits(), listed.to_bits(), "{config} on {machine}");
                    compared += 1;
                    reduced += usize::from(red > 1 && listed > 0.0);
                }
            }
        }
        assert!(compared > 500 && reduced > 10, "{compared} {reduced}");
    }

    /// An owner whose row sums blocks of slices shared by different sets of tiles: summed out
    /// replica by replica, still the listed links' t_s.
    #[test]
    fn rows_of_several_sharer_sets_are_summed_out() {
        // two parameters over 8 tiles: the first in two halves, the second shared by tiles 0
        // and 1 (owners 0 and 1 of both) and by tiles 2 to 5
        let mut buffers = LinkLoadBuffers {
            pattern: SharingPattern {
                tiles: 8,
                slices_per_param: vec![2, 2],
                slices: vec![(4, 40), (4, 40), (2, 6), (3, 9)],
                slice_of_tile: vec![0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, NO_SLICE, NO_SLICE],
            },
            ..LinkLoadBuffers::default()
        };
        for machine in [
            MachineModel::from_flags(4, 2, Some(30.0), Some(3.0)).unwrap(),
            MachineModel::from_flags(2, 4, None, None).unwrap(),
            MachineModel::from_flags(2, 8, Some(10.0), Some(100.0)).unwrap(),
        ] {
            let nodes = machine.uniform_nodes().expect("uniform nodes");
            for first in (0..machine.num_devices()).step_by(8) {
                let listed = sync_time_shifted(buffers.link_loads(0), &machine, first);
                let direct = buffers.uniform_sync_time(first, nodes);
                assert!(listed > 0.0);
                assert_eq!(direct.to_bits(), listed.to_bits(), "@{first} on {machine}");
            }
        }
    }

    #[test]
    fn blocks_follow_rows_and_never_outnumber_them() {
        let slice = Rect::new(&[4, 0], &[7, 5]);
        let blocks = owned_blocks(&slice, &[2, 5, 6, 9]);
        let rows: Vec<(usize, usize, DeviceId)> =
            blocks.iter().map(|(r, d)| (r.lo[0], r.hi[0], *d)).collect();
        assert_eq!(rows, vec![(4, 5, 2), (5, 6, 5), (6, 7, 6)]);
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
    fn mixed_split_shares_each_channel_block_between_its_replicas() {
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
        // channel block c0 (rows 0..4) is shared by devices 0 and 2, c1 (rows 4..8) by 1 and 3;
        // each is cut in two blocks of rows, one per device
        assert_eq!(
            owners,
            vec![
                (0, 0, vec![2]),
                (0, 2, vec![0]),
                (0, 1, vec![3]),
                (0, 3, vec![1]),
                (1, 0, vec![2]),
                (1, 2, vec![0]),
                (1, 1, vec![3]),
                (1, 3, vec![1])
            ]
        );
        assert_eq!(
            plan.groups[1].slice,
            Rect::new(&[2, 0, 0, 0], &[4, 3, 3, 3])
        );
        // n=8 over two nodes: 8 one-row blocks, one per device. Each goes through a relay on the
        // other node: its three members to it within the node, then it and the owner's three
        // node peers to the owner, where the link between the nodes dominates.
        let machine = MachineModel::preset("paper-pairs:16").unwrap();
        let plan = SyncPlan::for_layer(&g, c, &ParallelConfig::split(Dim::N, 8, 0));
        let w = (3 * 3 * 3 * 4) as f64;
        let b = 4.0;
        let one_way = w / 12.5e9 + b / 12.5e9 + 2.0 * 10e-6;
        let within = w / 20e9 + b / 20e9 + 2.0 * 5e-6;
        let t = plan.time(&machine);
        assert!((t - 2.0 * (one_way + within)).abs() < 1e-15, "{t}");
    }
}
