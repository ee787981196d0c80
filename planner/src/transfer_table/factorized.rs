//! The factorized tables: t_x from per-axis numbers, on regular machines (equal power-of-two nodes,
//! links that depend only on whether two devices share a node) for edges whose projections are
//! separable per axis.
//!
//! A layout pair's message sizes are a Kronecker product of per-axis overlap matrices, so the
//! largest messages within a node, across nodes and excluding a tile's own device come from
//! per-axis maxima over aligned ranges of block indices ([`AxisPair`]'s pyramids) without visiting
//! tile pairs. Block pairs of a layout pair fall into a few classes by how their blocks relate
//! ([`Relation`]): t_x is worked out once per class ([`Factorized::layout_pair`]) and read by every
//! block pair of it. The same per-axis numbers give [`LeastTimes`], a lower bound per layout pair
//! under every relation, which holds where messages share lanes too (where the maxima alone are
//! not t_x).

mod lanes;

pub(super) use lanes::LaneTopology;
use lanes::{AxisSums, LaneScratch};

use super::{ConfigSubset, EdgeGeometry};
use crate::config::{ConfigSpace, ParallelConfig, block_range};
use crate::machine::{Link, MachineModel};
use legion_ops::partition::reduction_range;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{Rect, Shape};

/// The factors of a layout pair's message sizes: one per tensor axis, and [`PARTIAL`].
const FACTORS: usize = MAX_DIMS + 1;
/// The factor of reduction splits. Its producer digit is the producer's partial: only a block's
/// first partial holds the block's output. Its consumer digit is the consumer's partial, or where
/// the partials read blocks of the channels, the consumer's channel block (whose need is then the
/// same for every block), the partial taking the [`CHANNELS`] factor instead.
const PARTIAL: usize = MAX_DIMS;
/// The axis a reduction split's partials cut into blocks: the input's channels.
const CHANNELS: usize = 1;
/// The producer's digits: its axes' block indices and then its partial, in factor order.
const PRODUCER_POSITIONS: [usize; FACTORS] = {
    let mut positions = [0; FACTORS];
    let mut f = 0;
    while f < FACTORS {
        positions[f] = f;
        f += 1;
    }
    positions
};

/// The factorized tables of a regular machine: one whose links depend only on whether two devices
/// share a node, with equal nodes of a power-of-two size.
pub(super) struct Factorized {
    devices: usize,
    node_size: usize,
    intra: Link,
    inter: Link,
    /// Bytes of an element that moves ([`MachineModel::activation_bytes`]).
    element_bytes: u64,
    /// Per (log2 producer total, log2 consumer total): the class of every block pair, its
    /// [`Relation::class`], `[src block * dst blocks + dst block]` (see [`Factorized::class_of`]).
    class_of: Vec<Vec<u16>>,
    levels: usize,
}

impl Factorized {
    /// The tables of `machine`; `None` where it is not regular.
    pub(super) fn for_machine(machine: &MachineModel) -> Option<Factorized> {
        let devices = machine.num_devices();
        let (node_size, ..) = machine.uniform_nodes()?;
        let levels = devices.ilog2() as usize + 1;
        let mut factorized = Factorized {
            devices,
            node_size,
            intra: machine.intra_node_link(),
            inter: machine.inter_node_link(),
            element_bytes: machine.activation_bytes(),
            class_of: Vec::new(),
            levels,
        };
        for src_level in 0..levels {
            for dst_level in 0..levels {
                let (src_total, dst_total) = (1 << src_level, 1 << dst_level);
                let small = src_total.min(dst_total);
                let mut classes = Vec::new();
                for src in (0..=devices - src_total).step_by(src_total) {
                    for dst in (0..=devices - dst_total).step_by(dst_total) {
                        let relation = factorized.relation(src, src_total, dst, dst_total);
                        classes.push(relation.class(small));
                    }
                }
                factorized.class_of.push(classes);
            }
        }
        Some(factorized)
    }

    /// The class of every block pair of producer blocks of `src_total` devices and consumer blocks
    /// of `dst_total`: `[src block * dst blocks + dst block]`.
    fn class_of(&self, src_total: usize, dst_total: usize) -> &[u16] {
        let level = |t: usize| t.trailing_zeros() as usize;
        &self.class_of[level(src_total) * self.levels + level(dst_total)]
    }

    fn relation(&self, src: usize, src_total: usize, dst: usize, dst_total: usize) -> Relation {
        let (big, big_total, small) = if src_total >= dst_total {
            (src, src_total, dst)
        } else {
            (dst, dst_total, src)
        };
        if (big..big + big_total).contains(&small) {
            return Relation::Nested {
                offset: small - big,
            };
        }
        let within_nodes = src_total <= self.node_size && dst_total <= self.node_size;
        if within_nodes && src / self.node_size == dst / self.node_size {
            Relation::DisjointIntra
        } else {
            Relation::DisjointInter
        }
    }

    /// The largest intra-node and inter-node messages (elements; 0: none), forward and, with
    /// `gradient`, backward.
    fn time(&self, intra: u64, inter: u64, gradient: bool) -> f64 {
        let one = |link: Link, elems: u64| {
            if elems == 0 {
                0.0
            } else {
                link.message_time((self.element_bytes * elems) as f64)
            }
        };
        // a regular machine's links are symmetric, so the backward pass takes as long
        let forward = one(self.intra, intra).max(one(self.inter, inter));
        if gradient { forward + forward } else { forward }
    }

    /// Index of an axis pair by axis and log2 degrees (degrees are powers of two up to the
    /// device count).
    fn slot(&self, axis: usize, g: usize, h: usize) -> usize {
        (axis * self.levels + g.trailing_zeros() as usize) * self.levels
            + h.trailing_zeros() as usize
    }

    /// [`super::TransferTables::least_times`] of an edge that factorizes.
    /// `inbound_bytes_per_s`: what every lane and link into one device carries together
    /// (`None`: no such bound).
    pub(super) fn least_times(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        inbound_bytes_per_s: Option<f64>,
    ) -> LeastTimes {
        let levels = self.levels;
        let src: Vec<[usize; FACTORS]> = (0..src_space.layouts().len())
            .map(|gi| axes.producer_factors(src_space, gi))
            .collect();
        let dst: Vec<[usize; FACTORS]> = (0..dst_space.layouts().len())
            .map(|hi| axes.consumer_factors(dst_space, hi))
            .collect();
        // per factor, the log2 degrees either side has, as bit sets
        let level_set = |layouts: &[[usize; FACTORS]], a: usize| {
            layouts
                .iter()
                .fold(0u64, |set, l| set | 1 << l[a].trailing_zeros())
        };
        let mut bounds = vec![AxisBound::default(); FACTORS * levels * levels];
        let mut overlap = Vec::new();
        for a in 0..FACTORS {
            let (src_levels, dst_levels) = (level_set(&src, a), level_set(&dst, a));
            for gl in (0..levels).filter(|l| src_levels >> l & 1 == 1) {
                for hl in (0..levels).filter(|l| dst_levels >> l & 1 == 1) {
                    let (g, h) = (1 << gl, 1 << hl);
                    bounds[self.slot(a, g, h)] = axes.axis_bound(a, g, h, &mut overlap);
                }
            }
        }
        let level = |l: &[usize; FACTORS]| std::array::from_fn(|a| l[a].trailing_zeros() as usize);
        LeastTimes {
            bounds,
            levels,
            src: src.iter().map(level).collect(),
            dst: dst.iter().map(level).collect(),
            intra: self.intra,
            inter: self.inter,
            inbound_seconds_per_byte: inbound_bytes_per_s.map(|b| 1.0 / b),
            element_bytes: self.element_bytes,
            gradient: geometry.gradient,
        }
    }

    /// [`super::TransferTables::config_pair_time`] of an edge that factorizes.
    pub(super) fn config_pair_time(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src: &ParallelConfig,
        dst: &ParallelConfig,
        buffers: &mut PairBuffers,
        lanes: Option<&LaneTopology>,
    ) -> f64 {
        let src_side = Side::new(
            axes.producer_factors_of(&src.degrees(), src.reduction()),
            PRODUCER_POSITIONS,
            self.node_size,
        );
        let dst_side = Side::new(
            axes.consumer_factors_of(&dst.degrees(), dst.reduction()),
            axes.consumer_positions(),
            self.node_size,
        );
        let (g, h) = (&src_side.degrees, &dst_side.degrees);
        let PairBuffers {
            pairs,
            sums,
            overlap,
            column,
            scratch,
            lane_scratch,
        } = buffers;
        for (a, pair) in pairs.iter_mut().enumerate() {
            axes.fill_axis_pair(a, g[a], h[a], pair, overlap, column);
            if lanes.is_some() {
                // from the same overlaps, left in `overlap`
                sums[a].fill(overlap, g[a], h[a]);
            }
        }
        let axis: [&AxisPair; FACTORS] = std::array::from_fn(|a| &pairs[a]);
        let (src_total, dst_total) = (src_side.total, dst_side.total);
        let relation = self.relation(src.first_device(), src_total, dst.first_device(), dst_total);
        let class = relation.class(src_total.min(dst_total)) as usize;
        let needed = Classes::One(class);
        self.layout_pair(
            &src_side,
            &dst_side,
            &axis,
            geometry.gradient,
            needed,
            scratch,
        );
        let singles = scratch.values[class];
        let Some(lanes) = lanes else {
            return singles;
        };
        let sums: [&AxisSums; FACTORS] = std::array::from_fn(|a| &sums[a]);
        let gradient = geometry.gradient;
        lanes.layout_pair(&src_side, &dst_side, &sums, gradient, needed, lane_scratch);
        singles.max(lane_scratch.values[class])
    }

    /// [`super::TransferTables::table`] of an edge that factorizes: from its maxima, and where
    /// messages share `lanes`, from its lanes' loads too.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn edge_table(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        keep_pairs: Option<&[bool]>,
        only: Option<ConfigSubset>,
        lanes: Option<&LaneTopology>,
    ) -> Vec<f64> {
        let gradient = geometry.gradient;
        // built when a layout pair needs them: with `keep_pairs` most are never needed
        let mut pairs: Vec<Option<AxisPair>> = Vec::new();
        pairs.resize_with(FACTORS * self.levels * self.levels, || None);
        let mut sums: Vec<Option<AxisSums>> = Vec::new();
        if lanes.is_some() {
            sums.resize_with(FACTORS * self.levels * self.levels, || None);
        }
        let mut lane_scratch = LaneScratch::default();
        let all_rows: Vec<usize>;
        let all_columns: Vec<usize>;
        let only = match only {
            Some(subset) => subset,
            None => {
                all_rows = (0..src_space.len()).collect();
                all_columns = (0..dst_space.len()).collect();
                ConfigSubset {
                    rows: &all_rows,
                    columns: &all_columns,
                }
            }
        };
        let columns = only.columns.len();
        // every entry a layout pair computes is written below; the rest stay left out
        let mut table = vec![f64::INFINITY; only.rows.len() * columns];
        let mut scratch = Scratch::default();
        let mut needed: Vec<bool> = Vec::new();
        let (src_layouts, dst_layouts) = (src_space.layouts(), dst_space.layouts());
        let mut src_sides: Vec<Option<Side>> = src_layouts.iter().map(|_| None).collect();
        let mut dst_sides: Vec<Option<Side>> = dst_layouts.iter().map(|_| None).collect();
        for gi in 0..src_layouts.len() {
            let src_configs = src_space.layout_configs(gi);
            let rows = ConfigSubset::positions(only.rows, src_configs.clone());
            if rows.is_empty() {
                continue;
            }
            for hi in 0..dst_layouts.len() {
                let dst_configs = dst_space.layout_configs(hi);
                if keep_pairs.is_some_and(|keep| !keep[gi * dst_layouts.len() + hi]) {
                    continue;
                }
                let cols = ConfigSubset::positions(only.columns, dst_configs.clone());
                if cols.is_empty() {
                    continue;
                }
                let src = &*src_sides[gi].get_or_insert_with(|| {
                    let g = axes.producer_factors(src_space, gi);
                    Side::new(g, PRODUCER_POSITIONS, self.node_size)
                });
                let dst = &*dst_sides[hi].get_or_insert_with(|| {
                    let h = axes.consumer_factors(dst_space, hi);
                    Side::new(h, axes.consumer_positions(), self.node_size)
                });
                let (g, h) = (&src.degrees, &dst.degrees);
                for a in 0..FACTORS {
                    let slot = self.slot(a, g[a], h[a]);
                    if pairs[slot].is_none() {
                        pairs[slot] = Some(axes.axis_pair(a, g[a], h[a]));
                    }
                }
                let axis: [&AxisPair; FACTORS] = std::array::from_fn(|a| {
                    pairs[self.slot(a, g[a], h[a])]
                        .as_ref()
                        .expect("built just above")
                });
                // the relations of the block pairs the subset holds: at hundreds of devices a
                // bounded search keeps one or two of a layout pair's hundreds of block pairs
                let (src_total, dst_total) = (src.total, dst.total);
                let class_of = self.class_of(src_total, dst_total);
                let dst_blocks = self.devices / dst_total;
                let live_columns = &only.columns[cols.clone()];
                needed.clear();
                needed.resize(
                    2 + src_total.max(dst_total) / src_total.min(dst_total),
                    false,
                );
                for row in rows.clone() {
                    let src_block = only.rows[row] - src_configs.start;
                    let class_row = &class_of[src_block * dst_blocks..][..dst_blocks];
                    for &c in live_columns {
                        needed[class_row[c - dst_configs.start] as usize] = true;
                    }
                }
                let classes = Classes::Some(&needed);
                self.layout_pair(src, dst, &axis, gradient, classes, &mut scratch);
                if let Some(lanes) = lanes {
                    for a in 0..FACTORS {
                        let slot = self.slot(a, g[a], h[a]);
                        if sums[slot].is_none() {
                            sums[slot] = Some(AxisSums::new(axes, a, g[a], h[a]));
                        }
                    }
                    let axis: [&AxisSums; FACTORS] = std::array::from_fn(|a| {
                        sums[self.slot(a, g[a], h[a])]
                            .as_ref()
                            .expect("built just above")
                    });
                    lanes.layout_pair(src, dst, &axis, gradient, classes, &mut lane_scratch);
                    for (v, &lane) in scratch.values.iter_mut().zip(&lane_scratch.values) {
                        *v = v.max(lane);
                    }
                }
                for row in rows.clone() {
                    let src_block = only.rows[row] - src_configs.start;
                    let out = &mut table[row * columns + cols.start..][..cols.len()];
                    let class_row = &class_of[src_block * dst_blocks..][..dst_blocks];
                    for (o, &c) in out.iter_mut().zip(live_columns) {
                        *o = scratch.values[class_row[c - dst_configs.start] as usize];
                    }
                }
            }
        }
        table
    }

    /// The nested relations' t_x of a layout pair, appended to `out.values`, when the largest
    /// inter-node message decides every one of them; `false` (and `out.values` partly filled) when
    /// some relation may be decided by its largest intra-node message instead.
    ///
    /// That is the common case (about 9 in 10 layout pairs of the zoo's edges at 16 devices), and a
    /// cheap one: the largest inter-node message needs no exclusion of a tile's own device. Node groups of
    /// both blocks are boxes of aligned block ranges, so the largest overlap between a group of
    /// the larger block and a group of the smaller is a product of per-axis range maxima, and for
    /// each group of the smaller block, the largest message from outside its node is the largest
    /// of these products over the other groups of the larger block (the top two suffice). The
    /// product for the group it sits in bounds its largest intra-node message: when that bound's
    /// time is no more than the inter-node message's, the latter decides t_x exactly (message
    /// times grow with size); when both are 0, nothing moves.
    fn nested_by_inter_node(
        &self,
        src: &Side,
        dst: &Side,
        axis: &[&AxisPair; FACTORS],
        gradient: bool,
        needed: Classes,
        out: &mut Scratch,
    ) -> bool {
        let producer_big = src.total >= dst.total;
        let (big, small) = if producer_big { (src, dst) } else { (dst, src) };
        if big.total <= self.node_size {
            // one node: no inter-node messages at all
            return false;
        }
        let range_max = |a: usize, big_range: usize, small_range: usize| {
            if producer_big {
                axis[a].range_max(big_range, small_range)
            } else {
                axis[a].range_max(small_range, big_range)
            }
        };
        // axes on which both blocks' groups cover every block contribute a constant factor
        let mut constant = 1u64;
        let mut varying = [0usize; FACTORS];
        let mut n_varying = 0;
        for (a, pair) in axis.iter().enumerate() {
            if big.free[a] && small.free[a] {
                constant *= pair.max;
            } else {
                varying[n_varying] = a;
                n_varying += 1;
            }
        }
        let varying = &varying[..n_varying];
        let (big_groups, small_groups) = (big.ranges.len(), small.ranges.len());
        // `[small group][big group]`: the largest overlap between the two groups' tiles
        out.group_max.clear();
        out.group_top.clear();
        for small_range in &small.ranges {
            let (mut first, mut first_group, mut second) = (0u64, 0usize, 0u64);
            for (group, big_range) in big.ranges.iter().enumerate() {
                let v = varying.iter().fold(constant, |v, &a| {
                    v * range_max(a, big_range[a], small_range[a])
                });
                if v > first {
                    second = first;
                    (first, first_group) = (v, group);
                } else if v > second {
                    second = v;
                }
                out.group_max.push(v);
            }
            out.group_top.push((first, first_group, second));
        }
        let small_group_size = small.total / small_groups;
        // The offsets only matter through the big block's groups the small one's groups sit in:
        // a small block within one node (one group) sits in the same big group at `repeat`
        // consecutive offsets, which therefore share their value.
        let big_group_size = 1 << big.group_bits;
        let repeat = (big_group_size / small.total).max(1);
        let mut last = (u64::MAX, u64::MAX, 0.0);
        for offset in (0..big.total).step_by(small.total * repeat) {
            let first = Relation::Nested { offset }.class(small.total) as usize;
            if !(first..first + repeat).any(|class| needed.has(class)) {
                out.values.extend(std::iter::repeat_n(f64::NAN, repeat));
                continue;
            }
            let (mut inter, mut intra_bound) = (0u64, 0u64);
            for (s, &(first, first_group, second)) in out.group_top.iter().enumerate() {
                let own = (offset + s * small_group_size) >> big.group_bits;
                inter = inter.max(if own == first_group { second } else { first });
                intra_bound = intra_bound.max(out.group_max[s * big_groups + own]);
            }
            if (intra_bound, inter) != (last.0, last.1) {
                // (with no message at all, both 0, t_x is `time(0, 0)` too)
                if self.time(intra_bound, 0, false) > self.time(0, inter, false) {
                    return false;
                }
                last = (intra_bound, inter, self.time(0, inter, gradient));
            }
            for _ in 0..repeat {
                out.values.push(last.2);
            }
        }
        true
    }

    /// t_x of one layout pair for every relation of two blocks, into `out.values` (by
    /// [`Relation::class`]); NaN for the nested relations not `needed`.
    fn layout_pair(
        &self,
        src: &Side,
        dst: &Side,
        axis: &[&AxisPair; FACTORS],
        gradient: bool,
        needed: Classes,
        out: &mut Scratch,
    ) {
        let all = axis.iter().map(|p| p.max).product::<u64>();
        out.values.clear();
        out.values.push(self.time(all, 0, gradient));
        out.values.push(self.time(0, all, gradient));
        if self.nested_by_inter_node(src, dst, axis, gradient, needed, out) {
            return;
        }
        out.values.truncate(2);

        // The larger block's tiles are grouped by node; the smaller block's tiles are visited.
        let producer_big = src.total >= dst.total;
        let (big, small) = if producer_big { (src, dst) } else { (dst, src) };
        let pyramids: [&[Stats]; FACTORS] = std::array::from_fn(|a| {
            if producer_big {
                axis[a].by_consumer.as_slice()
            } else {
                axis[a].by_producer.as_slice()
            }
        });
        // The group axes' stats depend on a small tile only through its digits on those axes: per
        // such digit combination and group, their stats, and per combination the two groups with
        // the largest message. A combination numbers the digits row-major in the small tile's
        // digit order (as the expansion below builds it).
        let combos: usize = big.group_axes().iter().map(|&a| small.degrees[a]).product();
        out.group_stats.clear();
        out.group_top.clear();
        for combo in 0..combos {
            let mut rest = combo;
            let mut row = [0; FACTORS];
            for &a in small.order.iter().rev().filter(|&&a| !big.free[a]) {
                row[a] = (rest & (small.degrees[a] - 1)) * big.pyramid_len[a];
                rest >>= small.degrees[a].trailing_zeros();
            }
            let (mut first, mut first_group, mut second) = (0u64, 0usize, 0u64);
            for (group, r) in big.ranges.iter().enumerate() {
                let mut s = Stats::ONE;
                for &a in big.group_axes() {
                    s = s.times(&pyramids[a][row[a] + r[a]], big.shift[a]);
                }
                if s.best > first {
                    second = first;
                    (first, first_group) = (s.best, group);
                } else if s.best > second {
                    second = s.best;
                }
                out.group_stats.push(s);
            }
            out.group_top.push((first, first_group, second));
        }
        // Per small tile (in tile order): the free axes' stats and its digit combination on the
        // group axes, expanded digit by digit (tile numbers are row-major over the digits).
        out.free.clear();
        out.free.push((Stats::ONE, 0));
        for &a in &small.order {
            let pyramid = pyramids[a];
            let n = small.degrees[a];
            let free = big.free[a];
            if n == 1 && !free {
                continue;
            }
            out.expand.clear();
            for &(st, combo) in &out.free {
                for d in 0..n {
                    out.expand.push(if free {
                        let row = d * big.pyramid_len[a] + big.whole[a];
                        (st.times(&pyramid[row], big.shift[a]), combo)
                    } else {
                        (st, combo * n + d)
                    });
                }
            }
            std::mem::swap(&mut out.free, &mut out.expand);
        }
        let groups = big.ranges.len();
        let mut last = (u64::MAX, u64::MAX, 0.0);
        for offset in (0..big.total).step_by(small.total) {
            if !needed.has(Relation::Nested { offset }.class(small.total) as usize) {
                out.values.push(f64::NAN);
                continue;
            }
            let (mut intra, mut inter) = (0u64, 0u64);
            for (x, (free, combo)) in out.free.iter().enumerate() {
                let own_tile = offset + x;
                let own_group = own_tile >> big.group_bits;
                let s = free.times(&out.group_stats[combo * groups + own_group], 0);
                intra = intra.max(if s.arg == own_tile { s.second } else { s.best });
                let (first, first_group, second) = out.group_top[*combo];
                let other = if first_group == own_group {
                    second
                } else {
                    first
                };
                inter = inter.max(free.best * other);
            }
            if (intra, inter) != (last.0, last.1) {
                last = (intra, inter, self.time(intra, inter, gradient));
            }
            out.values.push(last.2);
        }
    }
}

/// Which relations' t_x a layout pair's pricing works out (by [`Relation::class`]); the two
/// disjoint ones always, as they cost next to nothing.
#[derive(Clone, Copy)]
pub(super) enum Classes<'a> {
    One(usize),
    /// Those marked.
    Some(&'a [bool]),
}

impl Classes<'_> {
    pub(super) fn has(self, class: usize) -> bool {
        match self {
            Classes::One(c) => c == class,
            Classes::Some(marked) => marked.get(class).copied().unwrap_or(false),
        }
    }
}

/// How two aligned blocks of one layout pair relate, which fixes their t_x.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Relation {
    /// No shared device, every device pair within one node.
    DisjointIntra,
    /// No shared device, every device pair across nodes.
    DisjointInter,
    /// The smaller block lies `offset` tiles into the larger one.
    Nested { offset: usize },
}

impl Relation {
    /// The block pair's class, an index into a layout pair's values: the two disjoint cases, then
    /// one per nesting offset (in units of the smaller block).
    fn class(self, small_total: usize) -> u16 {
        match self {
            Relation::DisjointIntra => 0,
            Relation::DisjointInter => 1,
            Relation::Nested { offset } => (2 + offset / small_total) as u16,
        }
    }
}

/// What [`Factorized::layout_pair`] needs of one layout, computed once per edge.
///
/// Its tile numbers are row-major over its digits, and each factor takes one of them: in factor
/// order on the producer's side ([`PRODUCER_POSITIONS`]), and in another order on a consumer's
/// side whose partials pair with the producer's channel blocks ([`AxisNeeds::consumer_positions`]).
struct Side {
    /// Per factor, its degree.
    degrees: [usize; FACTORS],
    total: usize,
    /// The factors by their digit's place in a tile number, most significant first.
    order: [usize; FACTORS],
    /// Bit position of each factor's block index in a tile number.
    shift: [u32; FACTORS],
    /// Length of the pyramid over this side's blocks of each factor.
    pyramid_len: [usize; FACTORS],
    /// When this side is the larger block: its tiles form node groups of `2^group_bits` tiles.
    /// Along each factor a group covers an aligned range of block indices: the least significant
    /// digits' factors entirely (`free`, alike for every group), then one in part, the more
    /// significant ones at one index.
    group_bits: u32,
    free: [bool; FACTORS],
    /// The factors that are not free.
    group_axes: [usize; FACTORS],
    n_group_axes: usize,
    /// Per group, per factor: its range's position in the pyramids.
    ranges: Vec<[usize; FACTORS]>,
    /// Per factor: the pyramid position of a free factor's whole range.
    whole: [usize; FACTORS],
}

impl Side {
    /// A side of `degrees` per factor whose factor `f` takes digit `positions[f]` of a tile number
    /// (0 the most significant; `positions` is a permutation).
    fn new(degrees: [usize; FACTORS], positions: [usize; FACTORS], node_size: usize) -> Side {
        let total: usize = degrees.iter().product();
        let groups = if total > node_size {
            total / node_size
        } else {
            1
        };
        let group_size = total / groups;
        let group_bits = group_size.trailing_zeros();
        let mut order = [0; FACTORS];
        for (f, &p) in positions.iter().enumerate() {
            order[p] = f;
        }
        let mut shift = [0; FACTORS];
        let mut bits = 0;
        for &f in order.iter().rev() {
            shift[f] = bits;
            bits += degrees[f].trailing_zeros();
        }
        // a group's digits: the least significant ones first
        let mut levels = [0; FACTORS];
        let mut free_bits = group_bits as usize;
        for &f in order.iter().rev() {
            levels[f] = (degrees[f].trailing_zeros() as usize).min(free_bits);
            free_bits -= levels[f];
        }
        let free: [bool; FACTORS] =
            std::array::from_fn(|a| levels[a] == degrees[a].trailing_zeros() as usize);
        let mut group_axes = [0; FACTORS];
        let mut n_group_axes = 0;
        for a in (0..FACTORS).filter(|&a| !free[a]) {
            group_axes[n_group_axes] = a;
            n_group_axes += 1;
        }
        let ranges = (0..groups)
            .map(|group| {
                let start = group * group_size;
                std::array::from_fn(|a| {
                    let digit = (start >> shift[a]) & (degrees[a] - 1);
                    pyramid_index(degrees[a], levels[a], digit >> levels[a])
                })
            })
            .collect();
        Side {
            degrees,
            total,
            order,
            shift,
            pyramid_len: std::array::from_fn(|a| 2 * degrees[a] - 1),
            group_bits,
            free,
            group_axes,
            n_group_axes,
            ranges,
            whole: std::array::from_fn(|a| pyramid_index(degrees[a], levels[a], 0)),
        }
    }

    fn group_axes(&self) -> &[usize] {
        &self.group_axes[..self.n_group_axes]
    }
}

/// What [`super::TransferTables::config_pair_time`] works in, kept between calls.
#[derive(Default)]
pub(crate) struct PairBuffers {
    /// One per factor.
    pairs: [AxisPair; FACTORS],
    /// One per factor, where messages share lanes.
    sums: [AxisSums; FACTORS],
    overlap: Vec<u64>,
    column: Vec<u64>,
    scratch: Scratch,
    lane_scratch: LaneScratch,
}

/// Reused buffers and results of [`Factorized::layout_pair`].
#[derive(Default)]
struct Scratch {
    /// t_x by [`Relation::class`].
    values: Vec<f64>,
    /// Per small tile: stats over the axes every group covers whole, and its digit combination on
    /// the other axes.
    free: Vec<(Stats, usize)>,
    expand: Vec<(Stats, usize)>,
    /// `[combination][group]`: stats over the group axes.
    group_stats: Vec<Stats>,
    /// Per combination: (largest over groups, its group, largest over the other groups).
    group_top: Vec<(u64, usize, u64)>,
    /// `[small block's group][large block's group]`: the largest message between them.
    group_max: Vec<u64>,
}

/// Per-axis overlap statistics over aligned ranges of block indices.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Stats {
    best: u64,
    /// Index (in the whole axis) of the first maximum.
    arg: usize,
    /// The largest value once that one maximum is removed (equal to `best` if it occurs twice).
    second: u64,
}

/// For one axis and one (producer degree g, consumer degree h): the overlap lengths' maxima over
/// every aligned range of blocks, in both orientations.
#[derive(Default)]
struct AxisPair {
    max: u64,
    /// Pyramid over producer blocks for each consumer block: `[j * (2g - 1) + pyramid_index]`.
    by_consumer: Vec<Stats>,
    /// Pyramid over consumer blocks for each producer block: `[i * (2h - 1) + pyramid_index]`.
    by_producer: Vec<Stats>,
    /// The largest overlap over every (aligned range of producer blocks, aligned range of consumer
    /// blocks): `[producer pyramid_index * (2h - 1) + consumer pyramid_index]`.
    range_max: Vec<u64>,
    /// `2h - 1`: the number of aligned ranges of consumer blocks.
    consumer_ranges: usize,
}

impl AxisPair {
    /// The largest overlap between any producer block of one aligned range (a pyramid index) and
    /// any consumer block of another.
    #[inline]
    fn range_max(&self, producer_range: usize, consumer_range: usize) -> u64 {
        self.range_max[producer_range * self.consumer_ranges + consumer_range]
    }
}

/// Per-axis numbers of one (producer degree, consumer degree) for a lower bound of t_x.
#[derive(Clone, Copy, Debug, Default)]
struct AxisBound {
    /// The largest overlap of a producer block with what a consumer block reads.
    max: u64,
    /// The largest second-largest overlap of a consumer block with the producer blocks, or of a
    /// producer block with the consumer blocks (a second-largest equals the largest if that
    /// occurs twice).
    second: u64,
    /// Two consumer digits' overlaps with every producer block: what a tile with those digits
    /// receives in all, less what its own device may hold ([`Traffic`]).
    receives: [Traffic; 2],
    /// Likewise two producer digits' overlaps with every consumer block.
    sends: [Traffic; 2],
}

/// One digit's overlaps along one axis with every block of the other side: their sum, and the
/// largest (the most that one device's tile of the other side can hold of it).
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    sum: u64,
    max: u64,
}

impl Traffic {
    /// The digits whose traffic bounds best: the largest sum (the least maximum among those),
    /// and the largest sum less maximum.
    fn candidates(digits: impl Iterator<Item = Traffic> + Clone) -> [Traffic; 2] {
        let most = digits
            .clone()
            .max_by_key(|t| (t.sum, std::cmp::Reverse(t.max)));
        let most_sent = digits.max_by_key(|t| t.sum - t.max);
        [most.unwrap_or_default(), most_sent.unwrap_or_default()]
    }
}

/// A half-open interval of one axis.
type Interval = (usize, usize);

/// The needed interval of every consumer block along each producer axis, by consumer degree, and
/// how the factors pair the two sides' digits.
pub(super) struct AxisNeeds {
    /// The producer's extents (1 past its dims; the [`PARTIAL`] factor has none).
    extents: [usize; FACTORS],
    producer_dims: usize,
    /// `[factor][log2 consumer degree]` → interval per consumer digit (empty for degrees no
    /// layout has, and for [`PARTIAL`], whose overlaps are fixed). Indexed rather than hashed:
    /// this is looked up once per tile and axis.
    needs: [Vec<Vec<Interval>>; FACTORS],
    /// Per factor, the consumer digit it takes ([`AxisNeeds::consumer_positions`]).
    consumer_digit: [usize; FACTORS],
}

impl AxisNeeds {
    /// The per-axis needs if every consumer tile's needed interval along each producer axis depends
    /// only on one digit of the tile (and every degree is a power of two, as on regular
    /// machines); `None` otherwise.
    ///
    /// A digit is the tile's block index along an axis, or its partial under a reduction split.
    /// Without `partials_read_channel_blocks`, the interval along axis `a` must depend on the block
    /// index along the same axis alone. With it (a reduction-split consumer reading the producer
    /// through its first input: each partial reads its block of the input channels,
    /// [`legion_ops::op::project_partial`]), the interval along the channel axis must be the same
    /// for every block, and the partial picks its block of it: the [`CHANNELS`] factor pairs the
    /// producer's channel block with the consumer's partial.
    /// `needs` yields per consumer layout (in the space's order) the rects its blocks read.
    pub(super) fn separable<L: IntoIterator<Item = Rect>>(
        producer: &Shape,
        dst_space: &ConfigSpace,
        needs: impl IntoIterator<Item = L>,
        partials_read_channel_blocks: bool,
    ) -> Option<Self> {
        let nd = producer.ndim();
        let crossed = partials_read_channel_blocks && nd > CHANNELS;
        if partials_read_channel_blocks && !crossed {
            return None;
        }
        let mut extents = [1; FACTORS];
        extents[..nd].copy_from_slice(producer.dims());
        let mut per_axis: [Vec<Vec<Option<Interval>>>; MAX_DIMS] = Default::default();
        for (h, rects) in dst_space.layouts().iter().zip(needs) {
            if !h.iter().all(|d| d.is_power_of_two()) {
                return None;
            }
            let cfg = ParallelConfig::new(*h, 0);
            for (t, r) in rects.into_iter().enumerate() {
                let coords = cfg.tile_coords(t);
                for a in 0..MAX_DIMS {
                    let interval = if a < nd {
                        (r.lo[a], r.hi[a].max(r.lo[a]))
                    } else {
                        (0, 1)
                    };
                    // crossed, the channel interval is one for every block: kept as degree 1's
                    let (degree, digit) = if crossed && a == CHANNELS {
                        (1, 0)
                    } else {
                        (h[a], coords[a])
                    };
                    let level = degree.trailing_zeros() as usize;
                    let by_level = &mut per_axis[a];
                    if by_level.len() <= level {
                        by_level.resize(level + 1, Vec::new());
                    }
                    let slots = &mut by_level[level];
                    if slots.is_empty() {
                        slots.resize(degree, None);
                    }
                    match slots[digit] {
                        None => slots[digit] = Some(interval),
                        Some(seen) if seen == interval => {}
                        Some(_) => return None,
                    }
                }
            }
        }
        let mut needs: [Vec<Vec<Interval>>; FACTORS] = Default::default();
        for (axis, by_level) in needs.iter_mut().zip(per_axis) {
            for slots in by_level {
                axis.push(slots.into_iter().collect::<Option<Vec<_>>>()?);
            }
        }
        let mut consumer_digit: [usize; FACTORS] = std::array::from_fn(|f| f);
        if crossed {
            // the channel need, cut to each partial's block of the channels, by reduction degree
            let whole = *needs[CHANNELS].first()?.first()?;
            let channels = extents[CHANNELS];
            let mut by_level: Vec<Vec<Interval>> = Vec::new();
            for hi in 0..dst_space.layouts().len() {
                let red = dst_space.layout_reduction(hi);
                let level = red.trailing_zeros() as usize;
                if !red.is_power_of_two() || red > channels {
                    return None;
                }
                if by_level.len() <= level {
                    by_level.resize(level + 1, Vec::new());
                }
                if by_level[level].is_empty() {
                    by_level[level] = (0..red)
                        .map(|p| {
                            let (lo, hi) = reduction_range(channels, red, p);
                            let lo = lo.max(whole.0);
                            (lo, hi.min(whole.1).max(lo))
                        })
                        .collect();
                }
            }
            needs[CHANNELS] = by_level;
            consumer_digit.swap(CHANNELS, PARTIAL);
        }
        Some(AxisNeeds {
            extents,
            producer_dims: nd,
            needs,
            consumer_digit,
        })
    }

    /// Producer layout `layout`'s degree per factor: its degrees on the producer's axes (1 past
    /// them), then its reduction split.
    fn producer_factors(&self, space: &ConfigSpace, layout: usize) -> [usize; FACTORS] {
        self.producer_factors_of(&space.layouts()[layout], space.layout_reduction(layout))
    }

    fn producer_factors_of(
        &self,
        degrees: &[usize; MAX_DIMS],
        reduction: usize,
    ) -> [usize; FACTORS] {
        std::array::from_fn(|f| match f {
            PARTIAL => reduction,
            a if a < self.producer_dims => degrees[a],
            _ => 1,
        })
    }

    /// Consumer layout `layout`'s degree per factor: the degree of the digit each factor takes.
    fn consumer_factors(&self, space: &ConfigSpace, layout: usize) -> [usize; FACTORS] {
        self.consumer_factors_of(&space.layouts()[layout], space.layout_reduction(layout))
    }

    fn consumer_factors_of(
        &self,
        degrees: &[usize; MAX_DIMS],
        reduction: usize,
    ) -> [usize; FACTORS] {
        std::array::from_fn(|f| match self.consumer_digit[f] {
            PARTIAL => reduction,
            a => degrees[a],
        })
    }

    /// Per factor, the place of its digit in a consumer tile number (0 the most significant):
    /// tile numbers are row-major over the axes' block indices and then the partial
    /// ([`ParallelConfig::reduction_of`]), and each factor takes the digit it pairs with.
    fn consumer_positions(&self) -> [usize; FACTORS] {
        self.consumer_digit
    }

    /// Overlap lengths along factor `axis` of producer digit `i` of `g` with what consumer digit
    /// `j` of `h` reads, at `[i * h + j]`, into `out`. Along [`PARTIAL`], 1 for the producer's
    /// first partial (which holds its block's output) and 0 for the others, whatever the consumer
    /// digit.
    fn overlaps(&self, axis: usize, g: usize, h: usize, out: &mut Vec<u64>) {
        out.clear();
        if axis == PARTIAL {
            for i in 0..g {
                out.extend(std::iter::repeat_n(u64::from(i == 0), h));
            }
            return;
        }
        let extent = self.extents[axis];
        let needs = &self.needs[axis][h.trailing_zeros() as usize];
        for i in 0..g {
            let (lo, hi) = block_range(extent, g, i);
            out.extend(
                needs
                    .iter()
                    .map(|&(nlo, nhi)| hi.min(nhi).saturating_sub(lo.max(nlo)) as u64),
            );
        }
    }

    /// What [`Factorized::least_times`] needs of one axis and degree pair.
    fn axis_bound(&self, axis: usize, g: usize, h: usize, overlap: &mut Vec<u64>) -> AxisBound {
        self.overlaps(axis, g, h, overlap);
        let max = overlap.iter().copied().max().unwrap_or(0);
        // (largest, second largest) of a sequence
        let top_two = |(first, second): (u64, u64), v: u64| {
            if v > first {
                (v, first)
            } else {
                (first, second.max(v))
            }
        };
        let consumer_second = (0..h)
            .map(|j| (0..g).map(|i| overlap[i * h + j]).fold((0, 0), top_two).1)
            .max()
            .unwrap_or(0);
        let producer_second = overlap
            .chunks(h)
            .map(|row| row.iter().copied().fold((0, 0), top_two).1)
            .max()
            .unwrap_or(0);
        let traffic = |values: &mut dyn Iterator<Item = u64>| {
            values.fold(Traffic::default(), |t, v| Traffic {
                sum: t.sum + v,
                max: t.max.max(v),
            })
        };
        let columns = (0..h).map(|j| traffic(&mut (0..g).map(|i| overlap[i * h + j])));
        let rows = overlap
            .chunks(h)
            .map(|row| traffic(&mut row.iter().copied()));
        AxisBound {
            max,
            second: consumer_second.max(producer_second),
            receives: Traffic::candidates(columns),
            sends: Traffic::candidates(rows),
        }
    }

    fn axis_pair(&self, axis: usize, g: usize, h: usize) -> AxisPair {
        let mut pair = AxisPair::default();
        self.fill_axis_pair(axis, g, h, &mut pair, &mut Vec::new(), &mut Vec::new());
        pair
    }

    /// [`AxisNeeds::axis_pair`] into `pair`, reusing its vectors and the working ones `overlap`
    /// and `column`.
    #[inline(never)]
    fn fill_axis_pair(
        &self,
        axis: usize,
        g: usize,
        h: usize,
        pair: &mut AxisPair,
        overlap: &mut Vec<u64>,
        column: &mut Vec<u64>,
    ) {
        self.overlaps(axis, g, h, overlap);
        pair.max = overlap.iter().copied().max().unwrap_or(0);
        let by_consumer = &mut pair.by_consumer;
        by_consumer.clear();
        by_consumer.reserve(h * (2 * g - 1));
        for j in 0..h {
            column.clear();
            column.extend((0..g).map(|i| overlap[i * h + j]));
            push_pyramid(column, by_consumer);
        }
        let by_producer = &mut pair.by_producer;
        by_producer.clear();
        by_producer.reserve(g * (2 * h - 1));
        for row in overlap.chunks(h) {
            push_pyramid(row, by_producer);
        }
        // rows by producer range, built like a pyramid: single blocks' rows are `by_producer`'s
        // maxima, and each wider range's row is the elementwise max of its two halves' rows
        let (producer_ranges, consumer_ranges) = (2 * g - 1, 2 * h - 1);
        let range_max = &mut pair.range_max;
        range_max.clear();
        range_max.reserve(producer_ranges * consumer_ranges);
        range_max.extend(by_producer.iter().map(|s| s.best));
        let (mut level_start, mut len) = (0, g);
        while len > 1 {
            for r in 0..len / 2 {
                let first = (level_start + 2 * r) * consumer_ranges;
                for c in 0..consumer_ranges {
                    let merged = range_max[first + c].max(range_max[first + consumer_ranges + c]);
                    range_max.push(merged);
                }
            }
            level_start += len;
            len /= 2;
        }
        pair.consumer_ranges = consumer_ranges;
    }
}

/// Appends the stats of every aligned power-of-two range of `values` (a power of two long), level
/// by level: ranges of length `2^level` start at [`pyramid_index`]`(n, level, 0)`. Each level
/// merges pairs of the previous one, so the whole pyramid costs O(n).
fn push_pyramid(values: &[u64], out: &mut Vec<Stats>) {
    let start = out.len();
    out.extend(values.iter().enumerate().map(|(i, &v)| Stats {
        best: v,
        arg: i,
        second: 0,
    }));
    let (mut level_start, mut len) = (start, values.len());
    while len > 1 {
        for r in 0..len / 2 {
            let merged = out[level_start + 2 * r].merge(&out[level_start + 2 * r + 1]);
            out.push(merged);
        }
        level_start += len;
        len /= 2;
    }
}

/// Position of range `range` of level `level` in the pyramid of `n` values.
fn pyramid_index(n: usize, level: usize, range: usize) -> usize {
    2 * n - 2 * (n >> level) + range
}

impl Stats {
    /// The stats of an empty product.
    const ONE: Stats = Stats {
        best: 1,
        arg: 0,
        second: 0,
    };

    /// Stats of two adjacent ranges, `self` the earlier one (so it keeps the first maximum on ties).
    #[inline]
    fn merge(&self, later: &Stats) -> Stats {
        if later.best > self.best {
            Stats {
                best: later.best,
                arg: later.arg,
                second: later.second.max(self.best),
            }
        } else {
            Stats {
                best: self.best,
                arg: self.arg,
                second: self.second.max(later.best),
            }
        }
    }

    /// Stats of the product of two independent factors (axes): the best is the product of the
    /// bests; anything but that maximum differs from it in at least one factor, where it takes that
    /// factor's second. `shift` places the factor's index in the tile number.
    #[inline]
    fn times(&self, axis: &Stats, shift: u32) -> Stats {
        Stats {
            best: self.best * axis.best,
            arg: self.arg | (axis.arg << shift),
            second: (self.second * axis.best).max(self.best * axis.second),
        }
    }
}

/// A lower bound of one edge's t_x per (producer layout, consumer layout) under every relation of
/// their blocks, from per-axis numbers alone. Each consumer tile shares its device with at most one
/// producer tile (one tile per device in a block), so it receives at least its second-largest
/// overlap, and each producer tile likewise sends at least its second-largest; at best over the
/// faster link. Over tiles, the largest second-largest of a product of independent per-axis
/// factors is `max_a second_a · Π_{b≠a} max_b` (either side's `second_a`: the products are alike).
///
/// Where lanes are shared the bound also counts lane loads: a consumer tile receives everything it
/// reads but what its own device holds (at most its largest overlap with one producer tile), through
/// the lanes and links into its device, which together carry no more than the device's inbound
/// bandwidth; likewise a producer tile sends. Evaluated at a few tiles (any tile's load bounds the
/// busiest lane), this is what keeps most layout pairs of an all-to-all between dense layers out of
/// the search at hundreds of devices, where a single message is a small share of a tile's traffic.
pub(crate) struct LeastTimes {
    /// By [`Factorized::slot`].
    bounds: Vec<AxisBound>,
    levels: usize,
    /// Per producer layout, the log2 degree of each axis; likewise per consumer layout.
    src: Vec<[usize; FACTORS]>,
    dst: Vec<[usize; FACTORS]>,
    intra: Link,
    inter: Link,
    /// The inverse of a device's inbound bandwidth over all its lanes and links (`None`: no lane
    /// bound).
    inbound_seconds_per_byte: Option<f64>,
    element_bytes: u64,
    gradient: bool,
}

impl LeastTimes {
    /// Every pair's bound: row-major `[src layout][dst layout]`.
    pub(crate) fn table(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.src.len() * self.dst.len());
        for g in 0..self.src.len() {
            out.extend((0..self.dst.len()).map(|h| self.get(g, h)));
        }
        out
    }

    /// The bound for producer layout `src` and consumer layout `dst` (indices into the spaces'
    /// layouts).
    pub(crate) fn get(&self, src: usize, dst: usize) -> f64 {
        let (g, h) = (&self.src[src], &self.dst[dst]);
        let axis: [&AxisBound; FACTORS] =
            std::array::from_fn(|a| &self.bounds[(a * self.levels + g[a]) * self.levels + h[a]]);
        // the product of every axis's largest overlap but axis `a`'s
        let mut others = [1u64; FACTORS];
        let mut before = 1;
        for a in 0..FACTORS {
            others[a] = before;
            before *= axis[a].max;
        }
        let mut after = 1;
        for a in (0..FACTORS).rev() {
            others[a] *= after;
            after *= axis[a].max;
        }
        let elems = (0..FACTORS)
            .map(|a| axis[a].second * others[a])
            .max()
            .unwrap_or(0);
        if elems == 0 {
            return 0.0;
        }
        let bytes = (self.element_bytes * elems) as f64;
        let one = self
            .intra
            .message_time(bytes)
            .min(self.inter.message_time(bytes));
        let one = match self.inbound_seconds_per_byte {
            None => one,
            Some(seconds_per_byte) => {
                let moved = |side: fn(&AxisBound) -> &[Traffic; 2]| {
                    (0..2)
                        .map(|k| {
                            let (all, own) = axis.iter().fold((1u64, 1u64), |(s, m), b| {
                                let t = side(b)[k];
                                (s.saturating_mul(t.sum), m.saturating_mul(t.max))
                            });
                            all - own
                        })
                        .max()
                        .unwrap_or(0)
                };
                let elems = moved(|b| &b.receives).max(moved(|b| &b.sends));
                one.max((self.element_bytes * elems) as f64 * seconds_per_byte)
            }
        };
        if self.gradient { one + one } else { one }
    }
}
