//! Eq. 1 as tables for the searches: t_c + t_s (+ t_r under a reduction split) per (layer,
//! config) and t_x per (edge, config pair), each computed once, over the paper's space or the one
//! with reduction splits ([`SearchSpace`]). The numbers are the same as [`CostModel`]'s (tested),
//! computed faster:
//!
//! - t_c is priced once per (tile, device spec) and t_s once per layout, then spread over the device
//!   blocks.
//! - t_x tables come from the `transfer_table` module (factorized over axes on regular machines,
//!   message by message where a layout splits a reduction).
//! - Layers and edges with identical op, shapes and parallel dims share their tables.

use crate::config::{ConfigSpace, ParallelConfig, tile_rects};
use crate::cost::CostModel;
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, Lane, Link, MachineModel};
use crate::progress::Phase;
use crate::sync::{LinkLoadBuffers, SharingPattern, sync_time_shifted};
use crate::transfer::Edge;
use crate::transfer_table::{ConfigSubset, EdgeGeometry, LeastTimes, PairBuffers, TransferTables};
use legion_ops::op::partial_input_shapes;
use legion_ops::{Dim, Graph, LayerId, Rect, Shape};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Per-config and per-config-pair costs of a model on a machine.
pub struct CostTables<'m> {
    model: &'m CostModel<'m>,
    search_space: SearchSpace,
    spaces: Vec<ConfigSpace>,
    compute: Vec<Vec<f64>>,
    sync: Vec<Vec<f64>>,
    node: Vec<Vec<f64>>,
    /// Shared with tables that differ only in node costs ([`CostTables::with_node_penalty`]): the
    /// per-message tables of a large machine take hundreds of megabytes to build.
    transfers: Arc<TransferTables>,
    edge_class: Vec<usize>,
}

/// What an edge's t_x table depends on: the producer's output shape, dims and reduction
/// channels (its space), the consumer's layer class, the input it reads, and whether gradients
/// flow back.
type EdgeKey<'g> = (Shape, &'g [Dim], Option<usize>, usize, usize, bool);

/// Which configurations the searches choose from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SearchSpace {
    /// OptCNN's: degrees over samples, channels, height and width (the paper's numbers).
    #[default]
    Paper,
    /// Those and, for conv2d and dense layers, each split into partial sums over blocks of its
    /// input channels ([`ConfigSpace::enumerate_with_reductions`]).
    WithReductions,
}

impl SearchSpace {
    /// The input channels the reduction splits of layer `id` cut in this space (`None`: it has
    /// none here).
    pub fn reduction_channels(self, graph: &Graph, id: LayerId) -> Option<usize> {
        match self {
            SearchSpace::Paper => None,
            SearchSpace::WithReductions => graph
                .layer(id)
                .op
                .spec()
                .reduction_channels(&graph.input_shapes(id)),
        }
    }
}

impl<'m> CostTables<'m> {
    /// Enumerates every layer's configs in the paper's space and computes t_c and t_s for each.
    /// Edge tables are computed on request ([`CostTables::edge_table`]): they are large, and a
    /// search needs each only briefly.
    pub fn build(model: &'m CostModel<'m>) -> CostTables<'m> {
        CostTables::build_in(model, SearchSpace::Paper)
    }

    /// [`CostTables::build`] over `space`: with reduction splits, a layer's node cost adds t_r.
    pub fn build_in(model: &'m CostModel<'m>, search_space: SearchSpace) -> CostTables<'m> {
        let graph = model.graph();
        let machine = model.machine();
        let devices = machine.num_devices();
        let mut spaces: Vec<ConfigSpace> = Vec::new();
        let mut compute: Vec<Vec<f64>> = Vec::new();
        let mut sync: Vec<Vec<f64>> = Vec::new();
        // t_r per config (0 without a reduction split)
        let mut reduce: Vec<Vec<f64>> = Vec::new();
        // per layer, the input channels its reduction splits cut (`None`: it has none)
        let mut reduction_channels: Vec<Option<usize>> = Vec::new();
        // Layers with equal op, input shapes and dims share their tables: the first such layer's
        // id is the class of each layer.
        let mut layer_classes: HashMap<(String, &[Shape], &[Dim]), usize> = HashMap::new();
        let mut layer_class: Vec<usize> = Vec::with_capacity(graph.layers().len());
        // layers with equal output shapes, dims and reduction channels have equal config spaces:
        // the first one's id
        let mut same_space: HashMap<(Shape, &[Dim], Option<usize>), usize> = HashMap::new();
        let blocks = BlockClasses::new(machine);
        let mut scratch = NodeScratch::default();
        let layers = graph.layers().len() as u64;
        for id in graph.ids() {
            // the layers priced so far
            model.progress(Phase::NodeCosts, id.0 as u64, layers);
            let layer = graph.layer(id);
            let dims = layer.op.spec().parallel_dims(&layer.shape);
            let op = serde_json::to_string(&layer.op).unwrap_or_default();
            let class = *layer_classes
                .entry((op, model.input_shapes(id), dims))
                .or_insert(id.0);
            layer_class.push(class);
            reduction_channels.push(search_space.reduction_channels(graph, id));
            if class != id.0 {
                spaces.push(spaces[class].clone());
                compute.push(compute[class].clone());
                sync.push(sync[class].clone());
                reduce.push(reduce[class].clone());
                continue;
            }
            let channels = reduction_channels[id.0];
            let space = match same_space.get(&(layer.shape, dims, channels)) {
                Some(&other) => spaces[other].clone(),
                None => {
                    same_space.insert((layer.shape, dims, channels), id.0);
                    ConfigSpace::enumerate_with_reductions(&layer.shape, dims, devices, channels)
                }
            };
            let (c, s) = node_costs(model, id, &space, &blocks, &mut scratch);
            let r = space
                .configs()
                .iter()
                .map(|config| match config.reduction() {
                    1 => 0.0,
                    _ => model.reduce_time(id, config),
                })
                .collect();
            spaces.push(space);
            compute.push(c);
            sync.push(s);
            reduce.push(r);
        }
        let node = compute
            .iter()
            .zip(&sync)
            .zip(&reduce)
            .map(|((c, s), r)| {
                c.iter()
                    .zip(s)
                    .zip(r)
                    .map(|((c, s), r)| c + s + r)
                    .collect()
            })
            .collect();
        let mut edge_memo: HashMap<EdgeKey, usize> = HashMap::new();
        let edge_class = model
            .edges()
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let src = graph.layer(e.src);
                // everything the table depends on: the producer's tiling, the consumer's
                // projection and tiling (its layer class: its op and input shapes), and whether
                // gradients flow back
                let key = (
                    src.shape,
                    src.op.spec().parallel_dims(&src.shape),
                    // the producer's space: its reduction splits too
                    reduction_channels[e.src.0],
                    layer_class[e.dst.0],
                    e.input,
                    e.carries_gradient(graph),
                );
                *edge_memo.entry(key).or_insert(i)
            })
            .collect();
        CostTables {
            model,
            search_space,
            spaces,
            compute,
            sync,
            node,
            transfers: Arc::new(TransferTables::new(machine)),
            edge_class,
        }
    }

    pub fn model(&self) -> &'m CostModel<'m> {
        self.model
    }

    /// The space the tables' configs were enumerated in.
    pub fn search_space(&self) -> SearchSpace {
        self.search_space
    }

    /// Per layer and config, the bytes the config's largest tile keeps on its device
    /// ([`crate::memory::largest_tile_bytes_at`], in the machine's precision).
    pub fn largest_tile_bytes(&self) -> Vec<Vec<f64>> {
        let graph = self.model.graph();
        let precision = self.model.machine().precision();
        self.spaces
            .iter()
            .enumerate()
            .map(|(l, space)| {
                space
                    .configs()
                    .iter()
                    .map(|c| {
                        crate::memory::largest_tile_bytes_at(graph, LayerId(l), c, precision) as f64
                    })
                    .collect()
            })
            .collect()
    }

    /// The same tables with `weight` · `bytes[layer][config]` added to every node cost: what a
    /// search under a memory limit minimises (a Lagrangian penalty on [`Self::largest_tile_bytes`]).
    /// t_c, t_s and the edge tables are unchanged.
    pub fn with_node_penalty(&self, weight: f64, bytes: &[Vec<f64>]) -> CostTables<'m> {
        let node = self
            .node
            .iter()
            .zip(bytes)
            .map(|(n, b)| n.iter().zip(b).map(|(n, b)| n + weight * b).collect())
            .collect();
        CostTables {
            model: self.model,
            search_space: self.search_space,
            spaces: self.spaces.clone(),
            compute: self.compute.clone(),
            sync: self.sync.clone(),
            node,
            transfers: Arc::clone(&self.transfers),
            edge_class: self.edge_class.clone(),
        }
    }

    pub fn num_layers(&self) -> usize {
        self.spaces.len()
    }

    pub fn edges(&self) -> &[Edge] {
        self.model.edges()
    }

    /// The configs of a layer, in table order.
    pub fn space(&self, layer: LayerId) -> &ConfigSpace {
        &self.spaces[layer.0]
    }

    /// t_c per config of a layer.
    pub fn compute(&self, layer: LayerId) -> &[f64] {
        &self.compute[layer.0]
    }

    /// t_s per config of a layer.
    pub fn sync(&self, layer: LayerId) -> &[f64] {
        &self.sync[layer.0]
    }

    /// t_c + t_s per config of a layer.
    pub fn node_cost(&self, layer: LayerId) -> &[f64] {
        &self.node[layer.0]
    }

    /// Edges with equal numbers share a class: their tables are identical.
    pub fn edge_class(&self, edge: usize) -> usize {
        self.edge_class[edge]
    }

    /// Configs (by layer id) from per-layer indices into the spaces.
    pub fn configs(&self, indices: &[usize]) -> Vec<ParallelConfig> {
        indices
            .iter()
            .zip(&self.spaces)
            .map(|(&i, s)| s.config(i))
            .collect()
    }

    /// t_x of edge `edge` for every config pair: row-major, `[src config][dst config]`.
    pub fn edge_table(&self, edge: usize) -> Vec<f64> {
        self.edge_table_within(&self.edge_geometry(edge), edge, None, None)
    }

    /// What t_x of `edge` depends on, for [`CostTables::least_transfer_times`] and
    /// [`CostTables::edge_table_within`].
    pub(crate) fn edge_geometry(&self, edge: usize) -> EdgeGeometry {
        let e = self.model.edges()[edge];
        self.transfers.geometry(
            self.model.graph(),
            self.model.input_shapes(e.dst),
            &e,
            &self.spaces[e.dst.0],
        )
    }

    /// A lower bound of `edge`'s t_x per (producer layout, consumer layout), where one is cheap.
    pub(crate) fn least_transfer_times(
        &self,
        geometry: &EdgeGeometry,
        edge: usize,
    ) -> Option<LeastTimes> {
        let e = self.model.edges()[edge];
        self.transfers
            .least_times(geometry, &self.spaces[e.src.0], &self.spaces[e.dst.0])
    }

    /// t_x of one config pair of an edge from its geometry, where that is cheap (else `None`).
    /// `buffers` are kept between calls (see [`PairBuffers`]).
    pub(crate) fn config_pair_time(
        &self,
        geometry: &EdgeGeometry,
        src: &ParallelConfig,
        dst: &ParallelConfig,
        buffers: &mut PairBuffers,
    ) -> Option<f64> {
        self.transfers.config_pair_time(geometry, src, dst, buffers)
    }

    /// [`CostTables::edge_table`] from the edge's geometry, with the entries of the layout pairs
    /// outside `keep_pairs` left +∞, and with `only`, over those configs alone (see
    /// [`TransferTables::table`]).
    pub(crate) fn edge_table_within(
        &self,
        geometry: &EdgeGeometry,
        edge: usize,
        keep_pairs: Option<&[bool]>,
        only: Option<ConfigSubset>,
    ) -> Vec<f64> {
        let e = self.model.edges()[edge];
        self.transfers.table(
            self.model.machine(),
            geometry,
            &self.spaces[e.src.0],
            &self.spaces[e.dst.0],
            keep_pairs,
            only,
        )
    }
}

/// Buffers [`node_costs`] reuses from layout to layout and layer to layer.
#[derive(Default)]
struct NodeScratch {
    /// The output tiles of one layout, tile `t` on the block's `t`-th device.
    tiles: Vec<Rect>,
    /// t_c of each tile on each device spec, `priced[t * specs + spec]`, once computed.
    priced: Vec<Option<f64>>,
    loads: LinkLoadBuffers,
    /// t_s on each device block of every sharing pattern met so far, in any layer: layouts with
    /// equal patterns have equal link loads, hence equal t_s (as many blocks too: a pattern has
    /// one entry per tile).
    sync_of_pattern: FastHashMap<SharingPattern, Vec<f64>>,
}

/// t_c and t_s of every config of a layer.
fn node_costs(
    model: &CostModel,
    id: LayerId,
    space: &ConfigSpace,
    blocks: &BlockClasses,
    scratch: &mut NodeScratch,
) -> (Vec<f64>, Vec<f64>) {
    let graph = model.graph();
    let machine = model.machine();
    let layer = graph.layer(id);
    let op = layer.op.spec();
    let inputs = model.input_shapes(id);
    let params = op.params(inputs);
    let mut price = model.provider().tile_pricer(layer, inputs);
    let mut compute = vec![0.0; space.len()];
    let mut sync = vec![0.0; space.len()];
    let specs = machine.specs().len();
    // where t_s needs no list of links (see `LinkLoadBuffers::uniform_sync_time`)
    let uniform_nodes = machine
        .uniform_nodes()
        .filter(|_| !machine.has_shared_lanes());
    let nodes = machine.nodes();
    let NodeScratch {
        tiles,
        priced,
        loads,
        sync_of_pattern,
    } = scratch;
    for li in 0..space.layouts().len() {
        let base = space.layout_config(li);
        let (total, red) = (base.total(), base.reduction());
        tiles.clear();
        // a reduction split's partials are consecutive tiles of one block each
        tiles.extend(tile_rects(&layer.shape, &base).flat_map(|r| std::iter::repeat_n(r, red)));
        // The configs of a layout are its aligned blocks, by ascending first device. A block
        // prices as the first block of its class.
        let range = space.layout_configs(li);
        let class_of = |block| blocks.class_of(total, block);
        let pattern = loads.share(op, &params, tiles, base.reduction());
        match sync_of_pattern.get(pattern) {
            Some(known) => sync[range.clone()].copy_from_slice(known),
            None => {
                let pattern = pattern.clone();
                // blocks that go through relays on another node first
                let mut relayed = vec![None; range.len()];
                for (block, slot) in relayed.iter_mut().enumerate() {
                    if class_of(block) == block {
                        *slot = loads.relayed_sync_time(block * total, machine, &nodes);
                    }
                }
                match uniform_nodes {
                    // the same numbers without listing every link (a million of them for a
                    // slice replicated on a thousand devices)
                    Some(nodes) => {
                        for (block, ci) in range.clone().enumerate() {
                            sync[ci] = match class_of(block) {
                                class if class == block => relayed[block].unwrap_or_else(|| {
                                    loads.uniform_sync_time(block * total, nodes)
                                }),
                                class => sync[range.start + class],
                            };
                        }
                    }
                    None => {
                        // by positions in the block; `sync_time_shifted` moves them onto each
                        // block's devices
                        let block_loads = loads.link_loads(0);
                        for (block, ci) in range.clone().enumerate() {
                            sync[ci] = match class_of(block) {
                                class if class == block => relayed[block].unwrap_or_else(|| {
                                    sync_time_shifted(block_loads, machine, block * total)
                                }),
                                class => sync[range.start + class],
                            };
                        }
                    }
                }
                sync_of_pattern.insert(pattern, sync[range.clone()].to_vec());
            }
        }
        // A provider answers by device spec (see `CostProvider`), so each tile is priced once per
        // spec in use.
        priced.clear();
        priced.resize(total * specs, None);
        for (block, ci) in range.clone().enumerate() {
            let class = class_of(block);
            if class != block {
                compute[ci] = compute[range.start + class];
                continue;
            }
            let mut worst = 0.0f64;
            for (t, rect) in tiles.iter().enumerate() {
                let device = block * total + t;
                let slot = &mut priced[t * specs + machine.spec_index(device)];
                let time = *slot.get_or_insert_with(|| match red {
                    1 => price(rect, device),
                    // a partial: the op over its block of the input channels
                    _ => {
                        let partial = partial_input_shapes(inputs, t % red, red);
                        model.provider().compute_time(layer, &partial, rect, device)
                    }
                });
                worst = worst.max(time);
            }
            compute[ci] = worst;
        }
    }
    (compute, sync)
}

/// Which aligned device blocks of each size price alike, so that t_c and t_s are computed once per
/// class of blocks rather than once per block.
///
/// Blocks of one size are alike when the devices at each position in them have the same spec (all
/// that t_c reads of the machine) and the link between the devices at each two positions is the
/// same, bit for bit (all that t_s reads: the owners and replicas of a layer's synchronisation are
/// devices of its block, and [`sync_time_shifted`] reads nothing but [`MachineModel::link`]). This is
/// exact for any machine: on a regular one every block of a size falls in one class; irregular ones
/// (per-pair overrides, several device kinds, uneven nodes) get more classes.
pub(crate) struct BlockClasses {
    /// `by_size[k][b]`: the class of block `b` of `2^k` devices (devices `b·2^k..(b+1)·2^k`),
    /// named by its first block.
    by_size: Vec<Vec<usize>>,
}

impl BlockClasses {
    /// The classes of every power-of-two block size up to the machine's device count (the only
    /// sizes configs take: their degrees are powers of two).
    pub(crate) fn new(machine: &MachineModel) -> BlockClasses {
        let devices = machine.num_devices();
        let mut by_size = Vec::new();
        let mut size = 1;
        while size <= devices {
            let mut classes: Vec<usize> = Vec::with_capacity(devices / size);
            let mut firsts: Vec<usize> = Vec::new();
            for block in 0..devices / size {
                let class = firsts
                    .iter()
                    .copied()
                    .find(|&other| blocks_alike(machine, size, other * size, block * size))
                    .unwrap_or_else(|| {
                        firsts.push(block);
                        block
                    });
                classes.push(class);
            }
            by_size.push(classes);
            size *= 2;
        }
        BlockClasses { by_size }
    }

    /// The class of block `block` of `size` devices (devices `block·size..(block+1)·size`): the
    /// first block that prices alike, possibly itself.
    pub(crate) fn class_of(&self, size: usize, block: usize) -> usize {
        debug_assert!(size.is_power_of_two(), "block size {size}");
        self.by_size[size.trailing_zeros() as usize][block]
    }
}

/// Whether the blocks of `size` devices starting at `a` and `b` have equal device specs position by
/// position and equal links between each two positions (see [`BlockClasses`]), and on a machine
/// with shared lanes, routes that share lanes alike (lanes renumbered by first use in each block).
fn blocks_alike(machine: &MachineModel, size: usize, a: DeviceId, b: DeviceId) -> bool {
    let same_link = |x: Option<Link>, y: Option<Link>| {
        let bits = |l: Option<Link>| l.map(|l| (l.bytes_per_s.to_bits(), l.latency_s.to_bits()));
        bits(x) == bits(y)
    };
    let lanes_by_first_use = |first: DeviceId| {
        let mut ids: BTreeMap<Lane, usize> = BTreeMap::new();
        let mut out = Vec::new();
        for p in 0..size {
            for q in 0..size {
                let lanes = machine.route(first + p, first + q).and_then(|r| r.lanes);
                out.push(lanes.map(|(o, i)| {
                    let mut id = |lane| {
                        let next = ids.len();
                        *ids.entry(lane).or_insert(next)
                    };
                    (id(o), id(i))
                }));
            }
        }
        out
    };
    (0..size).all(|p| machine.spec_index(a + p) == machine.spec_index(b + p))
        && (0..size).all(|p| {
            (0..size).all(|q| same_link(machine.link(a + p, a + q), machine.link(b + p, b + q)))
        })
        && (!machine.has_shared_lanes() || lanes_by_first_use(a) == lanes_by_first_use(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{DeviceSpec, NodeSpec};
    use crate::provider::RooflineCost;

    /// 8 devices in two nodes of 4, one of P100s and one of CPUs.
    fn two_kinds() -> MachineModel {
        let node = |device| NodeSpec { devices: 4, device };
        MachineModel::new(
            "two-kinds",
            &[node(DeviceSpec::p100()), node(DeviceSpec::local_cpu())],
            Link::from_gbit_per_s(160.0, 5.0),
            Link::from_gbit_per_s(100.0, 10.0),
        )
        .unwrap()
    }

    /// paper:8 with the link between devices 4 and 5 replaced.
    fn with_override() -> MachineModel {
        MachineModel::preset("paper:8")
            .unwrap()
            .with_link(4, 5, Link::from_gbit_per_s(7.0, 3.0))
            .unwrap()
    }

    /// Classes by block size 1, 2, 4, ...
    fn classes(machine: &MachineModel) -> Vec<Vec<usize>> {
        BlockClasses::new(machine).by_size
    }

    #[test]
    fn every_block_of_a_regular_machine_is_alike() {
        let machine = MachineModel::from_flags(4, 4, None, None).unwrap();
        assert_eq!(
            classes(&machine),
            vec![vec![0; 16], vec![0; 8], vec![0; 4], vec![0; 2], vec![0]]
        );
    }

    #[test]
    fn a_link_override_sets_apart_the_blocks_holding_both_ends() {
        assert_eq!(
            classes(&with_override()),
            vec![vec![0; 8], vec![0, 0, 2, 0], vec![0, 1], vec![0]]
        );
        // across blocks of every size but the whole machine: no block holds both ends
        let across = MachineModel::preset("paper:8")
            .unwrap()
            .with_link(1, 6, Link::from_gbit_per_s(7.0, 3.0))
            .unwrap();
        assert_eq!(
            classes(&across),
            vec![vec![0; 8], vec![0; 4], vec![0; 2], vec![0]]
        );
    }

    #[test]
    fn blocks_of_other_device_kinds_or_links_differ() {
        assert_eq!(
            classes(&two_kinds()),
            vec![
                vec![0, 0, 0, 0, 4, 4, 4, 4],
                vec![0, 0, 2, 2],
                vec![0, 1],
                vec![0]
            ]
        );
        // nodes of 3: the pair 2-3 straddles the nodes, and only one block of 4 fits in 6 devices
        let uneven = MachineModel::from_flags(2, 3, None, None).unwrap();
        assert_eq!(classes(&uneven), vec![vec![0; 6], vec![0, 1, 0], vec![0]]);
    }

    #[test]
    fn pricing_a_class_once_equals_pricing_every_block() {
        let machines = [
            MachineModel::preset("paper:8").unwrap(),
            MachineModel::preset("paper-pairs:8").unwrap(),
            MachineModel::preset("dgx-h100:16").unwrap(),
            MachineModel::from_flags(2, 3, None, None)
                .unwrap()
                .with_intra_topology(crate::machine::IntraTopology::Switch)
                .with_nics(2)
                .unwrap(),
            with_override(),
            two_kinds(),
            MachineModel::from_flags(2, 3, None, None).unwrap(),
        ];
        for machine in &machines {
            let provider = RooflineCost::new(machine);
            let blocks = BlockClasses::new(machine);
            // one scratch for all layers and models, as in `CostTables::build`: t_s is shared by
            // sharing pattern across layers too
            let mut scratch = NodeScratch::default();
            for (name, batch) in [("lenet5", 6), ("alexnet", 8), ("inception_v3_reduced", 5)] {
                let z = legion_ops::zoo::find(name).unwrap();
                let graph = z.build(&z.default_config(batch)).unwrap();
                let model = CostModel::new(&graph, machine, &provider);
                for id in graph.ids() {
                    let layer = graph.layer(id);
                    let dims = layer.op.spec().parallel_dims(&layer.shape);
                    let space = ConfigSpace::enumerate(&layer.shape, dims, machine.num_devices());
                    let (compute, sync) = node_costs(&model, id, &space, &blocks, &mut scratch);
                    for (i, config) in space.configs().iter().enumerate() {
                        let at =
                            || format!("{name} {} {config} @{}", layer.name, config.first_device());
                        assert_eq!(compute[i], model.compute_time(id, config), "{}", at());
                        assert_eq!(sync[i], model.sync_time(id, config), "{}", at());
                    }
                }
            }
        }
    }
}
