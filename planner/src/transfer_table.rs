//! t_x of one edge for every pair of configs: the table node elimination consumes. The numbers are
//! exactly [`crate::transfer::transfer_time`]'s (tested); this file only computes them fast.
//!
//! Geometry depends on the degree vectors ("layouts"), not on the device blocks, so it is computed
//! once per pair of layouts and then spread over the block pairs. With aligned contiguous blocks each
//! (producer tile, consumer tile) pair is a distinct device pair, so t_x of a block pair is, per
//! direction, a max over messages: for each link class only the largest message matters.
//!
//! Two ways to get those maxima:
//!
//! - **Factorized** (regular machines — equal power-of-two nodes, no per-pair overrides — and
//!   projections that are separable per axis, which every op of the catalogue has): the message sizes
//!   of a layout pair form a Kronecker product of per-axis overlap matrices
//!   `V[tp][tc] = Π_a O_a[i_a][j_a]`, because tiles are products of 1-D blocks and tile numbers are
//!   row-major over the axes. Largest messages within a node, across nodes and excluding a tile's own
//!   device then follow from per-axis maxima over aligned index ranges (a node's share of an aligned
//!   device block is an aligned range of tile numbers, i.e. a box of block indices), without visiting
//!   tile pairs. Usually the largest inter-node message alone decides t_x; it needs no exclusion of
//!   a tile's own device and comes from per-axis range maxima per node group, without visiting
//!   tiles either ([`Regular::nested_by_inter_node`]).
//! - **Per message** (anything else): tile overlaps are enumerated box by box and evaluated for every
//!   class of block pairs with identical links.

use crate::config::{ConfigSpace, ParallelConfig, block_of, block_range, tile_rects};
use crate::fast_hash::FastHashMap;
use crate::machine::{Lane, Link, MachineModel};
use crate::transfer::Edge;
use legion_ops::op::project_partial;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{Graph, Rect, Shape};
use std::cell::RefCell;
use std::sync::OnceLock;

/// A lower bound of one edge's t_x per (producer layout, consumer layout) under every relation of
/// their blocks, from per-axis numbers alone. Each consumer tile shares its device with at most one
/// producer tile (one tile per device in a block), so it receives at least its second-largest
/// overlap, and each producer tile likewise sends at least its second-largest; at best over the
/// faster link. Over tiles, the largest second-largest of a product of independent per-axis
/// factors is `max_a second_a · Π_{b≠a} max_b` (either side's `second_a`: the products are alike).
pub(crate) struct LeastTimes {
    /// By [`Regular::slot`].
    bounds: Vec<AxisBound>,
    levels: usize,
    /// Per producer layout, the log2 degree of each axis; likewise per consumer layout.
    src: Vec<[usize; MAX_DIMS]>,
    dst: Vec<[usize; MAX_DIMS]>,
    intra: Link,
    inter: Link,
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
        let axis: [&AxisBound; MAX_DIMS] =
            std::array::from_fn(|a| &self.bounds[(a * self.levels + g[a]) * self.levels + h[a]]);
        // the product of every axis's largest overlap but axis `a`'s
        let mut others = [1u64; MAX_DIMS];
        let mut before = 1;
        for a in 0..MAX_DIMS {
            others[a] = before;
            before *= axis[a].max;
        }
        let mut after = 1;
        for a in (0..MAX_DIMS).rev() {
            others[a] *= after;
            after *= axis[a].max;
        }
        let elems = (0..MAX_DIMS)
            .map(|a| axis[a].second * others[a])
            .max()
            .unwrap_or(0);
        if elems == 0 {
            return 0.0;
        }
        let bytes = (4 * elems) as f64;
        let one = self
            .intra
            .message_time(bytes)
            .min(self.inter.message_time(bytes));
        if self.gradient { one + one } else { one }
    }
}

/// What an edge's t_x depends on besides the machine, worked out once: what each consumer tile
/// reads, and on regular machines its per-axis form.
pub(crate) struct EdgeGeometry {
    producer: Shape,
    gradient: bool,
    /// Per consumer layout, the rect each of its tiles reads (empty when `axes` is `Some`).
    needs: Vec<Vec<Rect>>,
    /// `Some` on regular machines when the needs are separable per axis.
    axes: Option<AxisNeeds>,
}

/// Builds t_x tables for one machine.
pub(crate) struct TransferTables {
    /// Built on first use: on regular machines the zoo's edges never need it, and grouping every
    /// block pair's links is a measurable share of a small model's t_c + t_s (~10% of AlexNet's).
    per_message: OnceLock<DevicePairs>,
    regular: Option<Regular>,
    /// Whether [`Regular`]'s per-axis maxima are t_x itself: not where messages share lanes (NICs,
    /// switch ports), whose loads add up. Its lower bounds ([`LeastTimes`]) hold either way.
    factorized_exact: bool,
}

impl TransferTables {
    pub(crate) fn new(machine: &MachineModel) -> TransferTables {
        TransferTables {
            per_message: OnceLock::new(),
            regular: Regular::detect(machine),
            factorized_exact: !machine.has_shared_lanes(),
        }
    }

    /// The geometry of `edge` for producer configs from `src_space` and consumer configs from
    /// `dst_space`.
    pub(crate) fn geometry(
        &self,
        graph: &Graph,
        inputs: &[Shape],
        edge: &Edge,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
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
        // A reduction split's tiles are not products of per-axis blocks (a block's partials read
        // channel blocks of its input, and only a block's first partial holds its output): such
        // edges take the per-message tables.
        let reductions = src_space.has_reductions() || dst_space.has_reductions();
        // The per-axis form straight from the projections; the rects themselves are kept only
        // for the per-message tables (irregular machines or projections).
        let axes = self.regular.as_ref().filter(|_| !reductions).and_then(|_| {
            AxisNeeds::separable(
                &producer,
                dst_space,
                dst_space.layouts().iter().map(layout_needs),
            )
        });
        let needs: Vec<Vec<Rect>> = match axes {
            Some(_) if self.factorized_exact => Vec::new(),
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
        let (regular, axes) = self.factorized(geometry)?;
        Some(regular.least_times(geometry, axes, src_space, dst_space))
    }

    /// The machine and the edge's per-axis needs, where t_x factorizes per axis.
    fn factorized<'a>(
        &'a self,
        geometry: &'a EdgeGeometry,
    ) -> Option<(&'a Regular, &'a AxisNeeds)> {
        Some((self.regular.as_ref()?, geometry.axes.as_ref()?))
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
        if !self.factorized_exact {
            return None;
        }
        let (regular, axes) = self.factorized(geometry)?;
        Some(regular.config_pair_time(geometry, axes, src, dst, buffers))
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
        if self.factorized_exact
            && let Some((regular, axes)) = self.factorized(geometry)
        {
            return regular.edge_table(geometry, axes, src_space, dst_space, keep_pairs, only);
        }
        let whole = self
            .per_message
            .get_or_init(|| DevicePairs::new(machine))
            .edge_table(geometry, src_space, dst_space, keep_pairs, only.as_ref());
        match only {
            None => whole,
            Some(subset) => subset.extract(&whole, dst_space.len()),
        }
    }
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

/// A machine whose links depend only on whether two devices share a node, with equal nodes of a
/// power-of-two size.
struct Regular {
    devices: usize,
    node_size: usize,
    intra: Link,
    inter: Link,
    /// Per (log2 producer total, log2 consumer total): the relation id of every block pair,
    /// `[src block * dst blocks + dst block]` (see [`Relation::id`]).
    relations: Vec<Vec<u16>>,
    levels: usize,
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
}

/// A half-open interval of one axis.
type Interval = (usize, usize);

/// The needed interval of every consumer block along each producer axis, by consumer degree.
struct AxisNeeds {
    extents: [usize; MAX_DIMS],
    /// `[axis][log2 consumer degree]` → interval per consumer block index (empty for degrees no
    /// layout has). Indexed rather than hashed: this is looked up once per tile and axis.
    needs: [Vec<Vec<Interval>>; MAX_DIMS],
}

impl AxisNeeds {
    /// The per-axis needs if every consumer tile's needed interval along each producer axis depends
    /// only on the tile's block index along the same axis (and every degree is a power of two, as
    /// on regular machines); `None` otherwise.
    /// `needs` yields per consumer layout (in the space's order) the rects its tiles read.
    fn separable<L: IntoIterator<Item = Rect>>(
        producer: &Shape,
        dst_space: &ConfigSpace,
        needs: impl IntoIterator<Item = L>,
    ) -> Option<Self> {
        let nd = producer.ndim();
        let mut extents = [1; MAX_DIMS];
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
                    let level = h[a].trailing_zeros() as usize;
                    let by_level = &mut per_axis[a];
                    if by_level.len() <= level {
                        by_level.resize(level + 1, Vec::new());
                    }
                    let slots = &mut by_level[level];
                    if slots.is_empty() {
                        slots.resize(h[a], None);
                    }
                    match slots[coords[a]] {
                        None => slots[coords[a]] = Some(interval),
                        Some(seen) if seen == interval => {}
                        Some(_) => return None,
                    }
                }
            }
        }
        let mut needs: [Vec<Vec<Interval>>; MAX_DIMS] = Default::default();
        for (axis, by_level) in needs.iter_mut().zip(per_axis) {
            for slots in by_level {
                axis.push(slots.into_iter().collect::<Option<Vec<_>>>()?);
            }
        }
        Some(AxisNeeds { extents, needs })
    }

    /// Overlap lengths along `axis` of producer block `i` of `g` with what consumer block `j` of
    /// `h` reads, at `[i * h + j]`, into `out`.
    fn overlaps(&self, axis: usize, g: usize, h: usize, out: &mut Vec<u64>) {
        let extent = self.extents[axis];
        let needs = &self.needs[axis][h.trailing_zeros() as usize];
        out.clear();
        for i in 0..g {
            let (lo, hi) = block_range(extent, g, i);
            out.extend(
                needs
                    .iter()
                    .map(|&(nlo, nhi)| hi.min(nhi).saturating_sub(lo.max(nlo)) as u64),
            );
        }
    }

    /// What [`Regular::least_times`] needs of one axis and degree pair.
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
        AxisBound {
            max,
            second: consumer_second.max(producer_second),
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
    /// Index into a layout pair's values: the two disjoint cases, then one per nesting offset (in
    /// units of the smaller block).
    fn id(self, small_total: usize) -> u16 {
        match self {
            Relation::DisjointIntra => 0,
            Relation::DisjointInter => 1,
            Relation::Nested { offset } => (2 + offset / small_total) as u16,
        }
    }
}

impl Regular {
    fn detect(machine: &MachineModel) -> Option<Regular> {
        let devices = machine.num_devices();
        let nodes = machine.num_nodes();
        if !machine.link_overrides().is_empty() || !devices.is_multiple_of(nodes) {
            return None;
        }
        let node_size = devices / nodes;
        let equal_nodes = (0..devices).all(|d| machine.node_of(d) == d / node_size);
        if !(node_size.is_power_of_two() && equal_nodes) {
            return None;
        }
        let levels = devices.ilog2() as usize + 1;
        let mut regular = Regular {
            devices,
            node_size,
            intra: machine.intra_node_link(),
            inter: machine.inter_node_link(),
            relations: Vec::new(),
            levels,
        };
        for src_level in 0..levels {
            for dst_level in 0..levels {
                let (src_total, dst_total) = (1 << src_level, 1 << dst_level);
                let small = src_total.min(dst_total);
                let mut ids = Vec::new();
                for src in (0..=devices - src_total).step_by(src_total) {
                    for dst in (0..=devices - dst_total).step_by(dst_total) {
                        ids.push(regular.relation(src, src_total, dst, dst_total).id(small));
                    }
                }
                regular.relations.push(ids);
            }
        }
        Some(regular)
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
                link.message_time((4 * elems) as f64)
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

    /// The producer layouts' degrees on every axis (1 past the producer's dims).
    fn producer_degrees(producer: &Shape, layout: &[usize; MAX_DIMS]) -> [usize; MAX_DIMS] {
        let nd = producer.ndim();
        std::array::from_fn(|a| if a < nd { layout[a] } else { 1 })
    }

    fn least_times(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
    ) -> LeastTimes {
        let levels = self.levels;
        let src: Vec<[usize; MAX_DIMS]> = src_space
            .layouts()
            .iter()
            .map(|g| Self::producer_degrees(&geometry.producer, g))
            .collect();
        // per axis, the log2 degrees either side has, as bit sets
        let level_set = |layouts: &[[usize; MAX_DIMS]], a: usize| {
            layouts
                .iter()
                .fold(0u64, |set, l| set | 1 << l[a].trailing_zeros())
        };
        let mut bounds = vec![AxisBound::default(); MAX_DIMS * levels * levels];
        let mut overlap = Vec::new();
        for a in 0..MAX_DIMS {
            let (src_levels, dst_levels) = (level_set(&src, a), level_set(dst_space.layouts(), a));
            for gl in (0..levels).filter(|l| src_levels >> l & 1 == 1) {
                for hl in (0..levels).filter(|l| dst_levels >> l & 1 == 1) {
                    let (g, h) = (1 << gl, 1 << hl);
                    bounds[self.slot(a, g, h)] = axes.axis_bound(a, g, h, &mut overlap);
                }
            }
        }
        let level = |l: &[usize; MAX_DIMS]| std::array::from_fn(|a| l[a].trailing_zeros() as usize);
        LeastTimes {
            bounds,
            levels,
            src: src.iter().map(level).collect(),
            dst: dst_space.layouts().iter().map(level).collect(),
            intra: self.intra,
            inter: self.inter,
            gradient: geometry.gradient,
        }
    }

    fn config_pair_time(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src: &ParallelConfig,
        dst: &ParallelConfig,
        buffers: &mut PairBuffers,
    ) -> f64 {
        let src_side = Side::new(
            Self::producer_degrees(&geometry.producer, &src.degrees()),
            self.node_size,
        );
        let dst_side = Side::new(dst.degrees(), self.node_size);
        let (g, h) = (&src_side.degrees, &dst_side.degrees);
        let PairBuffers {
            pairs,
            overlap,
            column,
            scratch,
        } = buffers;
        for (a, pair) in pairs.iter_mut().enumerate() {
            axes.fill_axis_pair(a, g[a], h[a], pair, overlap, column);
        }
        let axis: [&AxisPair; MAX_DIMS] = std::array::from_fn(|a| &pairs[a]);
        self.layout_pair(&src_side, &dst_side, &axis, geometry.gradient, scratch);
        let (src_total, dst_total) = (src_side.total, dst_side.total);
        let relation = self.relation(src.first_device(), src_total, dst.first_device(), dst_total);
        scratch.values[relation.id(src_total.min(dst_total)) as usize]
    }

    fn edge_table(
        &self,
        geometry: &EdgeGeometry,
        axes: &AxisNeeds,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        keep_pairs: Option<&[bool]>,
        only: Option<ConfigSubset>,
    ) -> Vec<f64> {
        let gradient = geometry.gradient;
        // built when a layout pair needs them: with `keep_pairs` most are never needed
        let mut pairs: Vec<Option<AxisPair>> = Vec::new();
        pairs.resize_with(MAX_DIMS * self.levels * self.levels, || None);
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
                    let g = Self::producer_degrees(&geometry.producer, &src_layouts[gi]);
                    Side::new(g, self.node_size)
                });
                let dst = &*dst_sides[hi]
                    .get_or_insert_with(|| Side::new(dst_layouts[hi], self.node_size));
                let (g, h) = (&src.degrees, &dst.degrees);
                for a in 0..MAX_DIMS {
                    let slot = self.slot(a, g[a], h[a]);
                    if pairs[slot].is_none() {
                        pairs[slot] = Some(axes.axis_pair(a, g[a], h[a]));
                    }
                }
                let axis: [&AxisPair; MAX_DIMS] = std::array::from_fn(|a| {
                    pairs[self.slot(a, g[a], h[a])]
                        .as_ref()
                        .expect("built just above")
                });
                self.layout_pair(src, dst, &axis, gradient, &mut scratch);
                let (src_total, dst_total) = (src.total, dst.total);
                let relations = &self.relations[src_total.trailing_zeros() as usize * self.levels
                    + dst_total.trailing_zeros() as usize];
                let dst_blocks = self.devices / dst_total;
                let live_columns = &only.columns[cols.clone()];
                for row in rows.clone() {
                    let src_block = only.rows[row] - src_configs.start;
                    let out = &mut table[row * columns + cols.start..][..cols.len()];
                    let ids = &relations[src_block * dst_blocks..][..dst_blocks];
                    for (o, &c) in out.iter_mut().zip(live_columns) {
                        *o = scratch.values[ids[c - dst_configs.start] as usize];
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
        axis: &[&AxisPair; MAX_DIMS],
        gradient: bool,
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
        let mut varying = [0usize; MAX_DIMS];
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
    /// [`Relation::id`]).
    fn layout_pair(
        &self,
        src: &Side,
        dst: &Side,
        axis: &[&AxisPair; MAX_DIMS],
        gradient: bool,
        out: &mut Scratch,
    ) {
        let all = axis.iter().map(|p| p.max).product::<u64>();
        out.values.clear();
        out.values.push(self.time(all, 0, gradient));
        out.values.push(self.time(0, all, gradient));
        if self.nested_by_inter_node(src, dst, axis, gradient, out) {
            return;
        }
        out.values.truncate(2);

        // The larger block's tiles are grouped by node; the smaller block's tiles are visited.
        let producer_big = src.total >= dst.total;
        let (big, small) = if producer_big { (src, dst) } else { (dst, src) };
        let pyramids: [&[Stats]; MAX_DIMS] = std::array::from_fn(|a| {
            if producer_big {
                axis[a].by_consumer.as_slice()
            } else {
                axis[a].by_producer.as_slice()
            }
        });
        // The group axes' stats depend on a small tile only through its digits on those axes: per
        // such digit combination and group, their stats, and per combination the two groups with
        // the largest message.
        let combos: usize = big.group_axes().iter().map(|&a| small.degrees[a]).product();
        out.group_stats.clear();
        out.group_top.clear();
        for combo in 0..combos {
            let mut rest = combo;
            let mut row = [0; MAX_DIMS];
            for &a in big.group_axes().iter().rev() {
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
        // group axes, expanded axis by axis (tile numbers are row-major over the axes).
        out.free.clear();
        out.free.push((Stats::ONE, 0));
        for (a, pyramid) in pyramids.iter().enumerate() {
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

/// What [`Regular::layout_pair`] needs of one layout, computed once per edge.
struct Side {
    degrees: [usize; MAX_DIMS],
    total: usize,
    /// Bit position of each axis's block index in a tile number.
    shift: [u32; MAX_DIMS],
    /// Length of the pyramid over this side's blocks of each axis.
    pyramid_len: [usize; MAX_DIMS],
    /// When this side is the larger block: its tiles form node groups of `2^group_bits` tiles.
    /// Along each axis a group covers an aligned range of block indices: the trailing axes entirely
    /// (`free`, alike for every group), then one axis in part, the leading axes at one index.
    group_bits: u32,
    free: [bool; MAX_DIMS],
    /// The axes that are not free, in order.
    group_axes: [usize; MAX_DIMS],
    n_group_axes: usize,
    /// Per group, per axis: its range's position in the pyramids.
    ranges: Vec<[usize; MAX_DIMS]>,
    /// Per axis: the pyramid position of a free axis's whole range.
    whole: [usize; MAX_DIMS],
}

impl Side {
    fn new(degrees: [usize; MAX_DIMS], node_size: usize) -> Side {
        let total: usize = degrees.iter().product();
        let groups = if total > node_size {
            total / node_size
        } else {
            1
        };
        let group_size = total / groups;
        let group_bits = group_size.trailing_zeros();
        let shift = digit_shifts(&degrees);
        let mut levels = [0; MAX_DIMS];
        let mut free_bits = group_bits as usize;
        for a in (0..MAX_DIMS).rev() {
            levels[a] = (degrees[a].trailing_zeros() as usize).min(free_bits);
            free_bits -= levels[a];
        }
        let free: [bool; MAX_DIMS] =
            std::array::from_fn(|a| levels[a] == degrees[a].trailing_zeros() as usize);
        let mut group_axes = [0; MAX_DIMS];
        let mut n_group_axes = 0;
        for a in (0..MAX_DIMS).filter(|&a| !free[a]) {
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

/// What [`TransferTables::config_pair_time`] works in, kept between calls.
#[derive(Default)]
pub(crate) struct PairBuffers {
    /// One per axis.
    pairs: [AxisPair; MAX_DIMS],
    overlap: Vec<u64>,
    column: Vec<u64>,
    scratch: Scratch,
}

/// Reused buffers and results of [`Regular::layout_pair`].
#[derive(Default)]
struct Scratch {
    /// t_x by [`Relation::id`].
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

/// Bit position of each axis's block index in a row-major tile number (degrees are powers of two).
fn digit_shifts(degrees: &[usize; MAX_DIMS]) -> [u32; MAX_DIMS] {
    let mut s = [0; MAX_DIMS];
    for a in (0..MAX_DIMS - 1).rev() {
        s[a] = s[a + 1] + degrees[a + 1].trailing_zeros();
    }
    s
}

/// One producer-tile → consumer-tile message of a layout pair.
#[derive(Clone, Copy, Debug)]
struct Message {
    src_tile: usize,
    dst_tile: usize,
    bytes: f64,
}

/// Every ordered device pair's route on a machine with shared lanes, with what its messages load
/// numbered densely ("slots": the lanes, then the private links routes use).
struct SharedRoutes {
    /// By `a * n + b`.
    pairs: Vec<PairRoute>,
    slots: usize,
}

/// A message's cost on one ordered pair: the seconds of `bytes` are `bytes · seconds_per_byte +
/// latency` (as `Link::message_time`), added to each slot it loads.
#[derive(Clone, Copy)]
struct PairRoute {
    seconds_per_byte: f64,
    latency_s: f64,
    /// [`NO_SLOT`] where fewer (a device and itself: none; a private link or a host bridge: one).
    slots: [u32; 2],
    lanes: Option<(Lane, Lane)>,
}

const NO_SLOT: u32 = u32::MAX;

impl SharedRoutes {
    fn new(machine: &MachineModel) -> SharedRoutes {
        let n = machine.num_devices();
        let lanes = machine.num_lanes();
        let mut private: FastHashMap<usize, u32> = FastHashMap::default();
        let pairs = (0..n * n)
            .map(|ab| {
                let Some(route) = machine.route(ab / n, ab % n) else {
                    return PairRoute {
                        seconds_per_byte: 0.0,
                        latency_s: 0.0,
                        slots: [NO_SLOT; 2],
                        lanes: None,
                    };
                };
                let slots = match route.lanes {
                    Some((out, into)) if out == into => [out as u32, NO_SLOT],
                    Some((out, into)) => [out as u32, into as u32],
                    None => {
                        let next = (lanes + private.len()) as u32;
                        [*private.entry(ab).or_insert(next), NO_SLOT]
                    }
                };
                PairRoute {
                    seconds_per_byte: route.link.seconds_per_byte(),
                    latency_s: route.link.latency_s,
                    slots,
                    lanes: route.lanes,
                }
            })
            .collect();
        SharedRoutes {
            pairs,
            slots: lanes + private.len(),
        }
    }
}

/// Seconds per slot of [`SharedRoutes`], the same sums as [`Loads`] in a dense array.
struct SlotLoads {
    seconds: Vec<f64>,
    touched: Vec<u32>,
}

impl SlotLoads {
    fn new(slots: usize) -> SlotLoads {
        SlotLoads {
            seconds: vec![0.0; slots],
            touched: Vec::new(),
        }
    }

    fn add(&mut self, route: &PairRoute, bytes: f64) {
        if route.slots[0] == NO_SLOT {
            return;
        }
        let seconds = bytes * route.seconds_per_byte + route.latency_s;
        for slot in route.slots.into_iter().filter(|&s| s != NO_SLOT) {
            let load = &mut self.seconds[slot as usize];
            if *load == 0.0 {
                self.touched.push(slot);
            }
            *load += seconds;
        }
    }

    /// The busiest slot's seconds; every slot back to zero.
    fn take_busiest(&mut self) -> f64 {
        let mut busiest = 0.0f64;
        for slot in self.touched.drain(..) {
            busiest = busiest.max(std::mem::take(&mut self.seconds[slot as usize]));
        }
        busiest
    }
}

/// Device pairs grouped by their links, for the per-message tables.
struct DevicePairs {
    devices: usize,
    /// On a machine with shared lanes, every ordered pair's route: block pairs are then priced
    /// message by message, each message loading its route's lanes.
    routes: Option<SharedRoutes>,
    /// Per ordered device pair, the index of its (forward, backward) links; 0 for a device and itself.
    kind: Vec<u16>,
    forward: Vec<Link>,
    backward: Vec<Link>,
    /// By `log2(src blocks' size) * levels + log2(dst blocks' size)`.
    classes: Vec<PairClasses>,
    levels: usize,
}

/// The block pairs of one (producer total, consumer total) that are alike.
struct PairClasses {
    dst_blocks: usize,
    /// Class of block pair (src block i, dst block j) at `i * dst_blocks + j`.
    class_of: Vec<u32>,
    classes: Vec<PairClass>,
}

enum PairClass {
    /// Every device pair uses link kind `k` (0: every tile pair shares a device).
    Uniform(u16),
    /// Mixed links: evaluated message by message at this representative block pair.
    Mixed { src_first: usize, dst_first: usize },
    /// Shared lanes: every message loads its route's link or lanes, at this representative block
    /// pair (whose routes share lanes as every block pair of the class does).
    Shared { src_first: usize, dst_first: usize },
}

impl DevicePairs {
    fn new(machine: &MachineModel) -> DevicePairs {
        let n = machine.num_devices();
        let mut kind = vec![0u16; n * n];
        let mut forward = vec![Link {
            bytes_per_s: f64::INFINITY,
            latency_s: 0.0,
        }];
        let mut backward = forward.clone();
        let mut ids: FastHashMap<[u64; 4], u16> = FastHashMap::default();
        for a in 0..n {
            for b in 0..n {
                let (Some(f), Some(r)) = (machine.link(a, b), machine.link(b, a)) else {
                    continue;
                };
                let key = [
                    f.bytes_per_s.to_bits(),
                    f.latency_s.to_bits(),
                    r.bytes_per_s.to_bits(),
                    r.latency_s.to_bits(),
                ];
                kind[a * n + b] = *ids.entry(key).or_insert_with(|| {
                    forward.push(f);
                    backward.push(r);
                    (forward.len() - 1) as u16
                });
            }
        }
        let sizes: Vec<usize> = (0..).map(|k| 1usize << k).take_while(|&s| s <= n).collect();
        let routes = machine
            .has_shared_lanes()
            .then(|| SharedRoutes::new(machine));
        let mut pairs = DevicePairs {
            devices: n,
            routes,
            kind,
            forward,
            backward,
            classes: Vec::new(),
            levels: sizes.len(),
        };
        for &src in &sizes {
            for &dst in &sizes {
                let c = pairs.group(src, dst);
                pairs.classes.push(c);
            }
        }
        pairs
    }

    fn group(&self, src_total: usize, dst_total: usize) -> PairClasses {
        let n = self.devices;
        let src_blocks = n / src_total;
        let dst_blocks = n / dst_total;
        let mut seen: FastHashMap<Vec<u32>, u32> = FastHashMap::default();
        let mut class_of = Vec::with_capacity(src_blocks * dst_blocks);
        let mut classes = Vec::new();
        let mut matrix: Vec<u32> = Vec::with_capacity(src_total * dst_total);
        // lanes renumbered by first use within the block pair: block pairs alike share lanes alike
        let mut lane_ids: FastHashMap<Lane, u32> = FastHashMap::default();
        for i in 0..src_blocks {
            for j in 0..dst_blocks {
                let (s, d) = (i * src_total, j * dst_total);
                matrix.clear();
                for a in s..s + src_total {
                    matrix.extend(
                        self.kind[a * n + d..a * n + d + dst_total]
                            .iter()
                            .map(|&k| u32::from(k)),
                    );
                }
                if let Some(routes) = &self.routes {
                    lane_ids.clear();
                    for a in s..s + src_total {
                        for b in d..d + dst_total {
                            for (x, y) in [(a, b), (b, a)] {
                                let lanes = routes.pairs[x * n + y].lanes;
                                for lane in lanes.map(|(o, i)| [o, i]).into_iter().flatten() {
                                    let next = lane_ids.len() as u32;
                                    matrix.push(*lane_ids.entry(lane).or_insert(next));
                                }
                                matrix.push(u32::MAX);
                            }
                        }
                    }
                }
                let next = classes.len() as u32;
                // look up before cloning: most block pairs repeat an earlier matrix
                let id = match seen.get(&matrix) {
                    Some(&id) => id,
                    None => {
                        seen.insert(matrix.clone(), next);
                        next
                    }
                };
                if id == next {
                    let first = matrix[0];
                    classes.push(if self.routes.is_some() {
                        PairClass::Shared {
                            src_first: s,
                            dst_first: d,
                        }
                    } else if matrix.iter().all(|&k| k == first) {
                        PairClass::Uniform(first as u16)
                    } else {
                        PairClass::Mixed {
                            src_first: s,
                            dst_first: d,
                        }
                    });
                }
                class_of.push(id);
            }
        }
        PairClasses {
            dst_blocks,
            class_of,
            classes,
        }
    }

    fn classes(&self, src_total: usize, dst_total: usize) -> &PairClasses {
        let level = |t: usize| t.trailing_zeros() as usize;
        &self.classes[level(src_total) * self.levels + level(dst_total)]
    }

    /// t_x (forward, and backward with `gradient`) of `messages` at a block pair of class `class`.
    fn class_time(
        &self,
        class: &PairClass,
        messages: &[Message],
        largest: f64,
        gradient: bool,
        loads: &mut [SlotLoads; 2],
    ) -> f64 {
        let both = |forward: f64, backward: f64| {
            if gradient {
                forward + backward
            } else {
                forward
            }
        };
        match *class {
            PairClass::Uniform(0) => 0.0,
            PairClass::Uniform(_) if messages.is_empty() => 0.0,
            PairClass::Uniform(k) => {
                let k = k as usize;
                both(
                    self.forward[k].message_time(largest),
                    self.backward[k].message_time(largest),
                )
            }
            PairClass::Mixed {
                src_first,
                dst_first,
            } => {
                let n = self.devices;
                let (mut forward, mut backward) = (0.0f64, 0.0f64);
                for m in messages {
                    let k =
                        self.kind[(src_first + m.src_tile) * n + dst_first + m.dst_tile] as usize;
                    if k != 0 {
                        forward = forward.max(self.forward[k].message_time(m.bytes));
                        backward = backward.max(self.backward[k].message_time(m.bytes));
                    }
                }
                both(forward, backward)
            }
            PairClass::Shared {
                src_first,
                dst_first,
            } => {
                let n = self.devices;
                let routes = self.routes.as_ref().expect("shared classes have routes");
                let [forward, backward] = loads;
                for m in messages {
                    let (a, b) = (src_first + m.src_tile, dst_first + m.dst_tile);
                    forward.add(&routes.pairs[a * n + b], m.bytes);
                    backward.add(&routes.pairs[b * n + a], m.bytes);
                }
                both(forward.take_busiest(), backward.take_busiest())
            }
        }
    }

    /// The per-message table: overlaps enumerated box by box for every layout pair.
    fn edge_table(
        &self,
        geometry: &EdgeGeometry,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        keep_pairs: Option<&[bool]>,
        only: Option<&ConfigSubset>,
    ) -> Vec<f64> {
        let (producer, needs, gradient) = (&geometry.producer, &geometry.needs, geometry.gradient);
        let nd = producer.ndim();
        let extents = producer.dims();
        let columns = dst_space.len();
        let layouts = dst_space.layouts().len();
        let mut table = vec![0.0; src_space.len() * columns];
        let mut messages: Vec<Message> = Vec::new();
        let mut values: Vec<f64> = Vec::new();
        let slots = self.routes.as_ref().map_or(0, |r| r.slots);
        let mut loads = [SlotLoads::new(slots), SlotLoads::new(slots)];
        for (gi, g) in src_space.layouts().iter().enumerate() {
            // under a reduction split a block's output is on its first partial's device
            let src_red = src_space.layout_reduction(gi);
            let src_total: usize = g.iter().product::<usize>() * src_red;
            for (hi, h) in dst_space.layouts().iter().enumerate() {
                let dst_total: usize = h.iter().product::<usize>() * dst_space.layout_reduction(hi);
                // a pair the bounded search ruled out, or whose configs are all outside `only`:
                // never read, as in the factorised path
                let unread = only.is_some_and(|o| {
                    ConfigSubset::positions(o.rows, src_space.layout_configs(gi)).is_empty()
                        || ConfigSubset::positions(o.columns, dst_space.layout_configs(hi))
                            .is_empty()
                });
                if unread || keep_pairs.is_some_and(|keep| !keep[gi * layouts + hi]) {
                    let dst_configs = dst_space.layout_configs(hi);
                    for row in src_space.layout_configs(gi) {
                        table[row * columns..][dst_configs.clone()].fill(f64::INFINITY);
                    }
                    continue;
                }
                messages.clear();
                let mut largest = 0.0f64;
                for (dst_tile, need) in needs[hi].iter().enumerate() {
                    if need.is_empty() {
                        continue;
                    }
                    let mut first = [0; MAX_DIMS];
                    let mut last = [0; MAX_DIMS];
                    for a in 0..nd {
                        first[a] = block_of(extents[a], g[a], need.lo[a]);
                        last[a] = block_of(extents[a], g[a], need.hi[a] - 1);
                    }
                    let mut idx = first;
                    loop {
                        let mut volume = 1;
                        let mut src_tile = 0;
                        for a in 0..nd {
                            let (lo, hi) = block_range(extents[a], g[a], idx[a]);
                            volume *= hi.min(need.hi[a]) - lo.max(need.lo[a]);
                            src_tile = src_tile * g[a] + idx[a];
                        }
                        let bytes = (4 * volume) as f64;
                        largest = largest.max(bytes);
                        messages.push(Message {
                            src_tile: src_tile * src_red,
                            dst_tile,
                            bytes,
                        });
                        // advance the odometer over the box first..=last
                        let mut a = nd;
                        while a > 0 {
                            a -= 1;
                            if idx[a] < last[a] {
                                idx[a] += 1;
                                break;
                            }
                            idx[a] = first[a];
                        }
                        if idx == first {
                            break;
                        }
                    }
                }
                let classes = self.classes(src_total, dst_total);
                values.clear();
                values.extend(
                    classes
                        .classes
                        .iter()
                        .map(|c| self.class_time(c, &messages, largest, gradient, &mut loads)),
                );
                let src_configs = src_space.layout_configs(gi);
                let dst_configs = dst_space.layout_configs(hi);
                let per_row = dst_configs.len();
                for (si, row) in src_configs.enumerate() {
                    let out = &mut table[row * columns + dst_configs.start..][..per_row];
                    let class_row = &classes.class_of[si * classes.dst_blocks..][..per_row];
                    for (o, &c) in out.iter_mut().zip(class_row) {
                        *o = values[c as usize];
                    }
                }
            }
        }
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tile_rect;
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

    /// Both ways of building a table agree entry for entry on regular machines, and the per-axis
    /// lower bound of each layout pair is at most every entry of its block pairs.
    #[test]
    fn factorized_equals_per_message() {
        let g = graph();
        for machine in [
            MachineModel::preset("paper-pairs:16").unwrap(),
            MachineModel::preset("paper-pairs:8").unwrap(),
            MachineModel::from_flags(4, 2, Some(30.0), Some(3.0)).unwrap(),
            MachineModel::from_flags(1, 8, None, None).unwrap(),
            // slow and fast inter-node links: the inter-node message decides t_x almost always,
            // or rarely (see `Regular::nested_by_inter_node`)
            MachineModel::from_flags(4, 4, Some(100.0), Some(1.0)).unwrap(),
            MachineModel::from_flags(2, 8, Some(10.0), Some(30.0)).unwrap(),
        ] {
            let regular = Regular::detect(&machine).expect("regular machine");
            let per_message = DevicePairs::new(&machine);
            let spaces: Vec<ConfigSpace> = g
                .layers()
                .iter()
                .map(|l| {
                    ConfigSpace::enumerate(
                        &l.shape,
                        l.op.spec().parallel_dims(&l.shape),
                        machine.num_devices(),
                    )
                })
                .collect();
            for e in graph_edges(&g) {
                let consumer = g.layer(e.dst);
                let inputs = g.input_shapes(e.dst);
                let dst_space = &spaces[e.dst.0];
                let needs: Vec<Vec<Rect>> = dst_space
                    .layouts()
                    .iter()
                    .map(|h| {
                        let cfg = ParallelConfig::new(*h, 0);
                        (0..cfg.total())
                            .map(|t| {
                                let out = tile_rect(&consumer.shape, &cfg, t);
                                consumer.op.spec().project(&inputs, &out)[e.input]
                            })
                            .collect()
                    })
                    .collect();
                let producer = g.layer(e.src).shape;
                let axes = AxisNeeds::separable(
                    &producer,
                    dst_space,
                    needs.iter().map(|v| v.iter().copied()),
                )
                .expect("the catalogue's projections are separable");
                let gradient = e.carries_gradient(&g);
                let (src_space, dst_space) = (&spaces[e.src.0], dst_space);
                let geometry = EdgeGeometry {
                    producer,
                    gradient,
                    needs: needs.clone(),
                    axes: None,
                };
                let fast = regular.edge_table(&geometry, &axes, src_space, dst_space, None, None);
                let slow = per_message.edge_table(&geometry, src_space, dst_space, None, None);
                let what = format!("{} → {} on {}", g.layer(e.src).name, consumer.name, machine);
                assert_eq!(fast, slow, "{what}");
                // one set of buffers for every pair, as the search keeps them
                let mut buffers = PairBuffers::default();
                for (x, entry) in fast.iter().enumerate().step_by(7) {
                    let (src, dst) = (
                        src_space.config(x / dst_space.len()),
                        dst_space.config(x % dst_space.len()),
                    );
                    let one = regular.config_pair_time(&geometry, &axes, &src, &dst, &mut buffers);
                    assert_eq!(one.to_bits(), entry.to_bits(), "{what}: {src:?} → {dst:?}");
                }
                let least = regular.least_times(&geometry, &axes, src_space, dst_space);
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
            }
        }
    }

    #[test]
    fn irregular_machines_are_detected() {
        assert!(Regular::detect(&MachineModel::from_flags(2, 3, None, None).unwrap()).is_none());
        let m = MachineModel::preset("paper:4")
            .unwrap()
            .with_link(0, 1, Link::from_gbit_per_s(1.0, 0.0))
            .unwrap();
        assert!(Regular::detect(&m).is_none());
        assert!(Regular::detect(&MachineModel::preset("paper-pairs:16").unwrap()).is_some());
        // shared NICs: loads add up per lane, which the per-axis maxima do not see: the
        // structure is regular (its bounds hold), its maxima are not t_x
        assert!(Regular::detect(&MachineModel::preset("paper:16").unwrap()).is_some());
        assert!(!TransferTables::new(&MachineModel::preset("paper:16").unwrap()).factorized_exact);
    }
}
