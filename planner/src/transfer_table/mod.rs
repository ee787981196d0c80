//! t_x of one edge for every pair of configs: the table node elimination consumes. The numbers are
//! exactly [`crate::transfer::transfer_time`]'s (tested); this module only computes them fast.
//!
//! Geometry depends on the degree vectors ("layouts"), not on the device blocks, so it is computed
//! once per pair of layouts and then spread over the block pairs. With aligned contiguous blocks each
//! (producer tile, consumer tile) pair is a distinct device pair, so t_x of a block pair is, per
//! direction, a max over messages: for each link class only the largest message matters. Block
//! pairs alike (same links, or same relation on a regular machine) form a class with one t_x, so
//! each layout pair is priced once per class and every block pair reads its class's value.
//!
//! Two ways to get those maxima, one file each:
//!
//! - [`factorized`] (regular machines — equal power-of-two nodes, no per-pair overrides — and
//!   projections that are separable per axis, which every op of the catalogue has): the message sizes
//!   of a layout pair form a Kronecker product of per-axis overlap matrices
//!   `V[tp][tc] = Π_a O_a[i_a][j_a]`, because tiles are products of 1-D blocks and tile numbers are
//!   row-major over the axes. Largest messages within a node, across nodes and excluding a tile's own
//!   device then follow from per-axis maxima over aligned index ranges (a node's share of an aligned
//!   device block is an aligned range of tile numbers, i.e. a box of block indices), without visiting
//!   tile pairs. Usually the largest inter-node message alone decides t_x; it needs no exclusion of
//!   a tile's own device and comes from per-axis range maxima per node group, without visiting
//!   tiles either ([`Factorized::nested_by_inter_node`]). The same per-axis numbers give
//!   [`LeastTimes`], lower bounds of t_x per layout pair that hold with shared lanes too. Where
//!   messages share lanes (NICs one per node or per device, a switch's ports, a host bridge), a
//!   lane's load is the traffic between two boxes of tiles, a product of per-axis prefix sums
//!   (`factorized/lanes.rs`), and t_x is the larger of the largest message and the busiest lane.
//! - [`per_message`] (anything else: irregular machines or projections, NICs shared by some of a
//!   node's devices): tile overlaps are enumerated box by box and evaluated for every class of
//!   block pairs with identical links (or, with shared lanes, message by message on each lane).
//!
//! This file holds what both share and what the searches call: [`EdgeGeometry`] (an edge's needs,
//! worked out once), [`TransferTables`] (which of the two each table takes) and [`ConfigSubset`]
//! (the rows and columns of a table a bounded search reads).

mod factorized;
mod per_message;

use factorized::{AxisNeeds, Factorized, LaneTopology};
pub(crate) use factorized::{LeastTimes, PairBuffers};
use per_message::PerMessage;

use crate::config::{ConfigSpace, ParallelConfig, tile_rects};
use crate::machine::MachineModel;
use crate::transfer::Edge;
use legion_ops::op::project_partial;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{Graph, Rect, Shape};
use std::cell::RefCell;
use std::sync::OnceLock;

/// What an edge's t_x depends on besides the machine, worked out once: what each consumer tile
/// reads, and on regular machines its per-axis form.
pub(crate) struct EdgeGeometry {
    producer: Shape,
    gradient: bool,
    /// Per consumer layout, the rect each of its tiles reads (left empty where the factorized tables
    /// are exact for this edge, which never read it).
    needs: Vec<Vec<Rect>>,
    /// `Some` on regular machines when the needs are separable per axis.
    axes: Option<AxisNeeds>,
}

/// Builds t_x tables for one machine.
pub(crate) struct TransferTables {
    /// Built on first use: on regular machines the zoo's edges never need it, and grouping every
    /// block pair's links is a measurable share of a small model's t_c + t_s (~10% of AlexNet's).
    per_message: OnceLock<PerMessage>,
    /// `None` where the machine is not regular.
    factorized: Option<Factorized>,
    /// Whether [`Factorized`]'s per-axis maxima are t_x itself: not where messages share lanes (NICs,
    /// switch ports), whose loads add up. Its lower bounds ([`LeastTimes`]) hold either way.
    factorized_exact: bool,
    /// Where messages share lanes on a regular machine, how: its tables add the lanes' loads to
    /// the maxima, from per-axis sums.
    lanes: Option<LaneTopology>,
    /// What every lane and link into one device carries together, where the machine is regular:
    /// the lane-load part of [`LeastTimes`].
    inbound_bytes_per_s: Option<f64>,
}

impl TransferTables {
    pub(crate) fn new(machine: &MachineModel) -> TransferTables {
        TransferTables {
            per_message: OnceLock::new(),
            factorized: Factorized::for_machine(machine),
            factorized_exact: !machine.has_shared_lanes(),
            lanes: machine
                .has_shared_lanes()
                .then(|| LaneTopology::for_machine(machine))
                .flatten(),
            inbound_bytes_per_s: inbound_bytes_per_s(machine),
        }
    }

    /// The geometry of `edge` for consumer configs from `dst_space` (the producer's configs do not
    /// change what the consumer reads).
    pub(crate) fn geometry(
        &self,
        graph: &Graph,
        inputs: &[Shape],
        edge: &Edge,
        dst_space: &ConfigSpace,
    ) -> EdgeGeometry {
        self.geometry_with(graph, inputs, edge, dst_space, false)
    }

    /// [`TransferTables::geometry`], with the per-message needs also where the factorized tables
    /// never read them when `keep_rects` (to test one table against the other).
    fn geometry_with(
        &self,
        graph: &Graph,
        inputs: &[Shape],
        edge: &Edge,
        dst_space: &ConfigSpace,
        keep_rects: bool,
    ) -> EdgeGeometry {
        let producer = graph.layer(edge.src).shape;
        let consumer = graph.layer(edge.dst);
        // What each consumer tile reads, per consumer layout (independent of the device block).
        let spec = consumer.op.spec();
        // one projection buffer for every tile rather than a `Vec` per tile
        let projected: RefCell<Vec<Rect>> = RefCell::new(Vec::with_capacity(inputs.len()));
        let layout_needs = |h: &[usize; MAX_DIMS]| {
            tile_rects(&consumer.shape, &ParallelConfig::new(*h, 0)).map(|out| {
                let mut projected = projected.borrow_mut();
                projected.clear();
                spec.project_into(inputs, &out, &mut projected);
                projected[edge.input]
            })
        };
        // A reduction split's partials of one block read blocks of the input channels (through
        // its first input) and only a block's first partial holds its output: still products of
        // per-axis factors, with the partials as one more (see `factorized::PARTIAL`).
        let partials_read_channel_blocks = dst_space.has_reductions() && edge.input == 0;
        // The per-axis form straight from the projections; the rects themselves are kept only
        // for the per-message tables (irregular machines or projections, lanes `LaneTopology`
        // does not cover).
        let axes = self.factorized.as_ref().and_then(|_| {
            AxisNeeds::separable(
                &producer,
                dst_space,
                dst_space.layouts().iter().map(layout_needs),
                partials_read_channel_blocks,
            )
        });
        let needs: Vec<Vec<Rect>> = match axes {
            Some(_) if (self.factorized_exact || self.lanes.is_some()) && !keep_rects => Vec::new(),
            _ => (0..dst_space.layouts().len())
                .map(|hi| match dst_space.layout_reduction(hi) {
                    1 => layout_needs(&dst_space.layouts()[hi]).collect(),
                    // a block's partials, each reading its channel block
                    red => tile_rects(&consumer.shape, &dst_space.layout_config(hi))
                        .flat_map(|out| (0..red).map(move |r| (out, r)))
                        .map(|(out, r)| project_partial(spec, inputs, &out, r, red)[edge.input])
                        .collect(),
                })
                .collect(),
        };
        EdgeGeometry {
            producer,
            gradient: edge.carries_gradient(graph),
            needs,
            axes,
        }
    }

    /// Lower bounds of t_x per (producer layout, consumer layout), valid for every pair of their
    /// device blocks; `None` where the machine or the projection is not regular (no cheap bound
    /// then).
    pub(crate) fn least_times(
        &self,
        geometry: &EdgeGeometry,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
    ) -> Option<LeastTimes> {
        let (factorized, axes) = self.factorized_edge(geometry)?;
        Some(factorized.least_times(
            geometry,
            axes,
            src_space,
            dst_space,
            self.inbound_bytes_per_s,
        ))
    }

    /// The machine and the edge's per-axis needs, where t_x factorizes per axis.
    fn factorized_edge<'a>(
        &'a self,
        geometry: &'a EdgeGeometry,
    ) -> Option<(&'a Factorized, &'a AxisNeeds)> {
        Some((self.factorized.as_ref()?, geometry.axes.as_ref()?))
    }

    /// t_x of the geometry's edge for one (producer config, consumer config), the same number as
    /// its table's entry, where the factorized path applies (where
    /// [`TransferTables::least_times`] is `Some`); `None` elsewhere.
    /// `buffers` are kept between calls: an axis of a thousand blocks on both sides takes a hundred
    /// megabytes, which fresh for every pair were most of the search's page faults.
    pub(crate) fn config_pair_time(
        &self,
        geometry: &EdgeGeometry,
        src: &ParallelConfig,
        dst: &ParallelConfig,
        buffers: &mut PairBuffers,
    ) -> Option<f64> {
        let lanes = self.lanes.as_ref();
        if !self.factorized_exact && lanes.is_none() {
            return None;
        }
        let (factorized, axes) = self.factorized_edge(geometry)?;
        Some(factorized.config_pair_time(geometry, axes, src, dst, buffers, lanes))
    }

    /// t_x of the geometry's edge for every (producer config, consumer config): row-major
    /// `[src][dst]`. `machine` is the one the tables were made for. With `keep_pairs` (row-major
    /// `[src layout][dst layout]`: the layout pairs a bounded search needs, see
    /// `search::relaxation`), the entries of the other pairs are +∞ and never computed (only where
    /// [`TransferTables::least_times`] is `Some`). With `only`, the table has the rows and columns
    /// of those configs alone (ascending indices into the spaces), `[row][column]`: a bounded
    /// search keeps a few percent of them, and at a thousand devices the table over whole spaces
    /// is hundreds of megabytes of which it reads almost nothing.
    pub(crate) fn table(
        &self,
        machine: &MachineModel,
        geometry: &EdgeGeometry,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        keep_pairs: Option<&[bool]>,
        only: Option<ConfigSubset>,
    ) -> Vec<f64> {
        if let Some((factorized, axes)) = self.factorized_edge(geometry) {
            let lanes = self.lanes.as_ref();
            if self.factorized_exact || lanes.is_some() {
                return factorized.edge_table(
                    geometry, axes, src_space, dst_space, keep_pairs, only, lanes,
                );
            }
        }
        let whole = self
            .per_message
            .get_or_init(|| PerMessage::new(machine))
            .edge_table(geometry, src_space, dst_space, keep_pairs, only.as_ref());
        match only {
            None => whole,
            Some(subset) => subset.extract(&whole, dst_space.len()),
        }
    }
}

/// What every lane and link into one device of a regular machine carries together: its switch
/// port or its node's bridge, or else a private link from each other device of its node; and its
/// NIC (a device's or its node's), or else a private link from each device of the other nodes.
/// `None` where the machine is not regular.
fn inbound_bytes_per_s(machine: &MachineModel) -> Option<f64> {
    use crate::machine::IntraTopology;
    let (node_size, intra, inter) = machine.uniform_nodes()?;
    let remote = machine.num_devices() - node_size;
    let intra = match machine.intra_topology() {
        IntraTopology::Pairs => (node_size - 1) as f64 * intra.bytes_per_s,
        IntraTopology::Switch | IntraTopology::Bridge if node_size > 1 => intra.bytes_per_s,
        _ => 0.0,
    };
    let inter = match machine.nics_per_node() {
        None => remote as f64 * inter.bytes_per_s,
        Some(_) if remote > 0 => inter.bytes_per_s,
        Some(_) => 0.0,
    };
    Some(intra + inter)
}

/// Rows and columns of an edge table: configs of the producer and of the consumer, as ascending
/// indices into their spaces.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConfigSubset<'a> {
    pub(crate) rows: &'a [usize],
    pub(crate) columns: &'a [usize],
}

impl ConfigSubset<'_> {
    /// The subset's entries of a row-major table with `width` columns.
    pub(crate) fn extract(&self, table: &[f64], width: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.rows.len() * self.columns.len());
        for &r in self.rows {
            let row = &table[r * width..(r + 1) * width];
            out.extend(self.columns.iter().map(|&c| row[c]));
        }
        out
    }

    /// The positions in `indices` (ascending) of the configs in `range`.
    fn positions(indices: &[usize], range: std::ops::Range<usize>) -> std::ops::Range<usize> {
        indices.partition_point(|&i| i < range.start)..indices.partition_point(|&i| i < range.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::Link;
    use crate::tables::SearchSpace;
    use crate::transfer::graph_edges;
    use legion_ops::GraphBuilder;
    use legion_ops::op::{Conv2d, Dense, Pool2d};

    fn graph() -> Graph {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 13, 11)).unwrap();
        let a = m.conv2d("a", x, Conv2d::new(6, 3).padding(1)).unwrap();
        let b = m
            .conv2d("b", a, Conv2d::new(4, 3).stride(2).padding(1))
            .unwrap();
        let p = m
            .pool2d("p", a, Pool2d::max(3).stride(2).padding(1))
            .unwrap();
        let b2 = m.conv2d("b2", p, Conv2d::new(5, 1)).unwrap();
        let c = m.concat("cat", &[b, b2]).unwrap();
        let g = m.conv2d("grouped", c, Conv2d::new(9, 1).groups(9)).unwrap();
        let f = m.flatten("f", g).unwrap();
        let d = m.dense("fc", f, Dense::new(7)).unwrap();
        m.softmax_cross_entropy("loss", d).unwrap();
        m.finish()
    }

    /// Calls `f` for every edge of `g` on `machine` in the paper's space and with reduction
    /// splits: the edge's name, its geometry (the per-message needs kept), its per-axis needs and
    /// the producer's and consumer's spaces.
    fn each_edge(
        g: &Graph,
        machine: &MachineModel,
        transfers: &TransferTables,
        mut f: impl FnMut(&str, &EdgeGeometry, &AxisNeeds, &ConfigSpace, &ConfigSpace),
    ) {
        for search_space in [SearchSpace::Paper, SearchSpace::WithReductions] {
            let spaces: Vec<ConfigSpace> = g
                .ids()
                .map(|id| ConfigSpace::of_layer(g, id, machine.num_devices(), search_space))
                .collect();
            for e in graph_edges(g) {
                let inputs = g.input_shapes(e.dst);
                let (src_space, dst_space) = (&spaces[e.src.0], &spaces[e.dst.0]);
                let geometry = transfers.geometry_with(g, &inputs, &e, dst_space, true);
                let axes = geometry
                    .axes
                    .as_ref()
                    .expect("the catalogue's projections are separable");
                let what = format!(
                    "{} → {} on {machine} ({search_space:?})",
                    g.layer(e.src).name,
                    g.layer(e.dst).name
                );
                f(&what, &geometry, axes, src_space, dst_space);
            }
        }
    }

    /// Both ways of building a table agree entry for entry on regular machines, in the paper's
    /// space and with reduction splits (producers' and consumers'), and the per-axis lower bound of
    /// each layout pair is at most every entry of its block pairs.
    #[test]
    fn factorized_equals_per_message() {
        let g = graph();
        let (mut reduced_consumers, mut reduced_producers) = (0, 0);
        for machine in [
            MachineModel::preset("paper-pairs:16").unwrap(),
            MachineModel::preset("paper-pairs:8").unwrap(),
            MachineModel::from_flags(4, 2, Some(30.0), Some(3.0)).unwrap(),
            MachineModel::from_flags(1, 8, None, None).unwrap(),
            // slow and fast inter-node links: the inter-node message decides t_x almost always,
            // or rarely (see `Factorized::nested_by_inter_node`)
            MachineModel::from_flags(4, 4, Some(100.0), Some(1.0)).unwrap(),
            MachineModel::from_flags(2, 8, Some(10.0), Some(30.0)).unwrap(),
        ] {
            let factorized = Factorized::for_machine(&machine).expect("regular machine");
            let per_message = PerMessage::new(&machine);
            let transfers = TransferTables::new(&machine);
            each_edge(
                &g,
                &machine,
                &transfers,
                |what, geometry, axes, src_space, dst_space| {
                    reduced_consumers += usize::from(dst_space.has_reductions());
                    reduced_producers += usize::from(src_space.has_reductions());
                    let fast = factorized
                        .edge_table(geometry, axes, src_space, dst_space, None, None, None);
                    let slow = per_message.edge_table(geometry, src_space, dst_space, None, None);
                    assert_eq!(fast, slow, "{what}");
                    // one set of buffers for every pair, as the search keeps them
                    let mut buffers = PairBuffers::default();
                    for (x, entry) in fast.iter().enumerate().step_by(7) {
                        let (src, dst) = (
                            src_space.config(x / dst_space.len()),
                            dst_space.config(x % dst_space.len()),
                        );
                        let one = factorized.config_pair_time(
                            geometry,
                            axes,
                            &src,
                            &dst,
                            &mut buffers,
                            None,
                        );
                        assert_eq!(one.to_bits(), entry.to_bits(), "{what}: {src:?} → {dst:?}");
                    }
                    let least = transfers
                        .least_times(geometry, src_space, dst_space)
                        .expect("regular machine");
                    let layouts = dst_space.layouts().len();
                    let mut tight = 0;
                    for gi in 0..src_space.layouts().len() {
                        for hi in 0..layouts {
                            let bound = least.get(gi, hi);
                            let entries = src_space.layout_configs(gi).flat_map(|row| {
                                fast[row * dst_space.len()..][dst_space.layout_configs(hi)].iter()
                            });
                            let lowest = entries.copied().fold(f64::INFINITY, f64::min);
                            assert!(bound <= lowest, "{what}: layouts {gi}, {hi}");
                            tight += usize::from(bound == lowest && bound > 0.0);
                        }
                    }
                    // somewhere the bound is exact (a pair whose every tile pair is remote)
                    assert!(tight > 0, "{what}");
                },
            );
        }
        assert!(reduced_consumers > 0 && reduced_producers > 0);
    }

    /// Where messages share lanes (one NIC per node or per device; private links, a switch or a
    /// host bridge within nodes), the tables from per-axis sums equal the per-message ones bit
    /// for bit, in the paper's space and with reduction splits; and the lower bounds with lane
    /// loads hold for every block pair.
    #[test]
    fn lane_loads_from_per_axis_sums_equal_per_message() {
        use crate::machine::IntraTopology;
        let g = graph();
        let (mut priced, mut tighter) = (0, 0);
        for machine in [
            MachineModel::preset("paper:16").unwrap(),
            MachineModel::preset("paper:8").unwrap(),
            MachineModel::preset("dgx-h100:16").unwrap(),
            MachineModel::preset("dgx-h100:4").unwrap(),
            MachineModel::from_flags(4, 2, Some(30.0), Some(3.0))
                .unwrap()
                .with_nics(2)
                .unwrap()
                .with_intra_topology(IntraTopology::Bridge),
            MachineModel::from_flags(2, 8, Some(10.0), Some(30.0))
                .unwrap()
                .with_nics(1)
                .unwrap()
                .with_intra_topology(IntraTopology::Switch),
            MachineModel::from_flags(1, 8, None, None)
                .unwrap()
                .with_intra_topology(IntraTopology::Bridge),
            MachineModel::from_flags(8, 2, Some(100.0), Some(1.0))
                .unwrap()
                .with_intra_topology(IntraTopology::Switch),
        ] {
            let transfers = TransferTables::new(&machine);
            let lanes = transfers.lanes.as_ref().expect("lanes priced per axis");
            let factorized = transfers.factorized.as_ref().expect("regular machine");
            let per_message = PerMessage::new(&machine);
            each_edge(
                &g,
                &machine,
                &transfers,
                |what, geometry, axes, src_space, dst_space| {
                    let fast = factorized.edge_table(
                        geometry,
                        axes,
                        src_space,
                        dst_space,
                        None,
                        None,
                        Some(lanes),
                    );
                    let slow = per_message.edge_table(geometry, src_space, dst_space, None, None);
                    let mut buffers = PairBuffers::default();
                    for (x, entry) in fast.iter().enumerate().step_by(5) {
                        let (src, dst) = (
                            src_space.config(x / dst_space.len()),
                            dst_space.config(x % dst_space.len()),
                        );
                        let one = transfers.config_pair_time(geometry, &src, &dst, &mut buffers);
                        let one = one.map(f64::to_bits);
                        assert_eq!(one, Some(entry.to_bits()), "{what}: {src:?} → {dst:?}");
                    }
                    for (x, (f, s)) in fast.iter().zip(&slow).enumerate() {
                        assert_eq!(
                            f.to_bits(),
                            s.to_bits(),
                            "{what}: {:?} → {:?}: {f} against {s}",
                            src_space.config(x / dst_space.len()),
                            dst_space.config(x % dst_space.len()),
                        );
                    }
                    priced += fast.len();
                    // the bound with lane loads holds for every block pair of a layout pair
                    let least = transfers
                        .least_times(geometry, src_space, dst_space)
                        .expect("regular machine");
                    let messages_only =
                        factorized.least_times(geometry, axes, src_space, dst_space, None);
                    for gi in 0..src_space.layouts().len() {
                        for hi in 0..dst_space.layouts().len() {
                            let (bound, single) = (least.get(gi, hi), messages_only.get(gi, hi));
                            let lowest = src_space
                                .layout_configs(gi)
                                .flat_map(|row| {
                                    fast[row * dst_space.len()..][dst_space.layout_configs(hi)]
                                        .iter()
                                })
                                .copied()
                                .fold(f64::INFINITY, f64::min);
                            assert!(bound <= lowest, "{what}: layouts {gi}, {hi}");
                            assert!(bound >= single, "{what}: layouts {gi}, {hi}");
                            tighter += usize::from(bound > single);
                        }
                    }
                },
            );
        }
        assert!(priced > 0);
        // lane loads raise the bound of a single message somewhere
        assert!(tighter > 0);
    }

    #[test]
    fn irregular_machines_are_detected() {
        assert!(
            Factorized::for_machine(&MachineModel::from_flags(2, 3, None, None).unwrap()).is_none()
        );
        let m = MachineModel::preset("paper:4")
            .unwrap()
            .with_link(0, 1, Link::from_gbit_per_s(1.0, 0.0))
            .unwrap();
        assert!(Factorized::for_machine(&m).is_none());
        assert!(
            Factorized::for_machine(&MachineModel::preset("paper-pairs:16").unwrap()).is_some()
        );
        // shared NICs: loads add up per lane, which the per-axis maxima do not see: the
        // structure is regular (its bounds hold), its maxima are not t_x
        assert!(Factorized::for_machine(&MachineModel::preset("paper:16").unwrap()).is_some());
        assert!(!TransferTables::new(&MachineModel::preset("paper:16").unwrap()).factorized_exact);
    }
}
