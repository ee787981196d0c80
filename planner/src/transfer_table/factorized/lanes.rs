//! t_x where messages share lanes (NICs, switch ports, a host bridge), from per-axis sums: the
//! factorized tables on regular machines with shared lanes.
//!
//! A lane's load is the sum of its messages' bytes and count ([`crate::transfer::Loads`] prices
//! those sums once). The messages a lane carries are those between two sets of tiles, and each set
//! is a box of digits: a node's tiles are an aligned range of tile numbers, a device's one tile.
//! Message sizes are a Kronecker product of per-axis overlap matrices, so the sum over a box of
//! tile pairs is a product of per-axis rectangle sums ([`AxisSums`], 2-D prefix sums), and so is
//! the number of messages (a message exists where every axis overlaps). A lane's load is then a
//! difference of such products (everything the tiles send, less what stays within the node, less
//! what stays on the device), in integers, so the tables give the same bits as the per-message
//! sums whatever the order.
//!
//! Per layout pair, lanes of nodes that hold tiles of one block only carry everything those tiles
//! exchange with the other block: worked out once per tile or node and kept as per-node maxima.
//! Only the nodes that hold tiles of both blocks (nested blocks) are worked out per relation.
//!
//! t_x is the busiest lane or private link. The largest single message ([`Factorized::layout_pair`])
//! bounds every lane that carries it and is the load of a private link, so t_x is the larger of the
//! two maxima. Links are symmetric on a regular machine and the backward pass loads the mirror
//! lanes with the same sums, so it takes as long as the forward one.

use super::{AxisNeeds, Classes, FACTORS, Side};
use crate::machine::{IntraTopology, Link, MachineModel};
use crate::transfer::lane_seconds;

/// How a regular machine's messages share lanes.
pub(in crate::transfer_table) struct LaneTopology {
    node_size: usize,
    nics: Nics,
    intra_topology: IntraTopology,
    intra: Link,
    inter: Link,
    element_bytes: u64,
}

/// The NICs messages between nodes pass through.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Nics {
    /// A private link per device pair across nodes (or a single node).
    None,
    /// One NIC per node, which every device of it shares.
    PerNode,
    /// A NIC per device.
    PerDevice,
}

impl LaneTopology {
    /// The lanes of `machine`, where it is regular and its NICs are one per node or one per
    /// device; `None` elsewhere (the per-message tables price it).
    pub(in crate::transfer_table) fn for_machine(machine: &MachineModel) -> Option<LaneTopology> {
        let (node_size, intra, inter) = machine.uniform_nodes()?;
        let nics = match machine.nics_per_node() {
            _ if machine.num_nodes() == 1 => Nics::None,
            None => Nics::None,
            Some(1) => Nics::PerNode,
            Some(k) if k >= node_size => Nics::PerDevice,
            // devices of a node alternating between NICs: not a box of tiles
            Some(_) => return None,
        };
        Some(LaneTopology {
            node_size,
            nics,
            intra_topology: machine.intra_topology(),
            intra,
            inter,
            element_bytes: machine.activation_bytes(),
        })
    }

    fn seconds(&self, link: Link, load: Load) -> f64 {
        lane_seconds(
            load.elements.saturating_mul(self.element_bytes),
            load.messages,
            link.seconds_per_byte(),
            link.latency_s,
        )
    }

    /// Whether some lane is a device's own (a NIC or switch port per device), so that loads are
    /// needed tile by tile.
    fn per_device(&self) -> bool {
        self.nics == Nics::PerDevice || self.intra_topology == IntraTopology::Switch
    }

    /// The busiest lane's t_x of one layout pair for every relation of two blocks, by
    /// `Relation::class` as [`Factorized::layout_pair`] numbers them, into `out.values` (NaN
    /// for the nested relations not `needed`).
    pub(super) fn layout_pair(
        &self,
        src: &Side,
        dst: &Side,
        axes: &[&AxisSums; FACTORS],
        gradient: bool,
        needed: Classes,
        out: &mut LaneScratch,
    ) {
        let pair = BoxSums { src, dst, axes };
        let (src_all, dst_all) = (src.tiles(0, src.total), dst.tiles(0, dst.total));
        // everything each tile exchanges with the other block
        if self.per_device() {
            pair.per_src_tile(&src_all, &dst_all, &mut out.src_sends, &mut out.expand);
            pair.per_dst_tile(&src_all, &dst_all, &mut out.dst_receives, &mut out.expand);
        }
        let producer_big = src.total >= dst.total;
        let (big, small) = if producer_big { (src, dst) } else { (dst, src) };
        let group_size = big.total.min(self.node_size);
        let groups = big.total / group_size;
        // Per node of a block, its busiest NIC when the other block has no tile on it: the
        // larger block's nodes but the smaller one's when nested, every node when disjoint across
        // nodes.
        let side_groups = |producer: bool, into: &mut Vec<f64>| {
            let (side, tiles) = if producer {
                (src, &out.src_sends)
            } else {
                (dst, &out.dst_receives)
            };
            let size = side.total.min(self.node_size);
            into.clear();
            into.extend((0..side.total / size).map(|g| {
                match self.nics {
                    Nics::None => 0.0,
                    Nics::PerDevice => tiles[g * size..(g + 1) * size]
                        .iter()
                        .fold(0.0f64, |m, &l| m.max(self.seconds(self.inter, l))),
                    Nics::PerNode => {
                        let load = if producer {
                            pair.sum(&src.tiles(g * size, size), &dst_all)
                        } else {
                            pair.sum(&src_all, &dst.tiles(g * size, size))
                        };
                        self.seconds(self.inter, load)
                    }
                }
            }));
        };
        // kept in the scratch between calls (taken out while `out`'s loads are read)
        let mut big_groups = std::mem::take(&mut out.big_groups);
        let mut small_groups = std::mem::take(&mut out.small_groups);
        side_groups(producer_big, &mut big_groups);
        side_groups(!producer_big, &mut small_groups);
        // maxima of the larger block's groups before and from each group
        out.before.clear();
        out.before.push(0.0);
        for (g, &v) in big_groups.iter().enumerate() {
            let last = out.before[g];
            out.before.push(last.max(v));
        }
        out.from.clear();
        out.from.resize(groups + 1, 0.0);
        for g in (0..groups).rev() {
            out.from[g] = out.from[g + 1].max(big_groups[g]);
        }

        let double = |t: f64| if gradient { t + t } else { t };
        let mut values = std::mem::take(&mut out.values);
        values.clear();
        // disjoint within one node: nothing leaves the node
        let disjoint_intra = match self.intra_topology {
            IntraTopology::Pairs => 0.0,
            IntraTopology::Switch => out
                .src_sends
                .iter()
                .chain(&out.dst_receives)
                .fold(0.0f64, |m, &l| m.max(self.seconds(self.intra, l))),
            IntraTopology::Bridge => self.seconds(self.intra, pair.sum(&src_all, &dst_all)),
        };
        values.push(double(disjoint_intra));
        // disjoint across nodes: every node holds one block's tiles only
        let disjoint_inter = big_groups
            .iter()
            .chain(&small_groups)
            .fold(0.0f64, |m, &v| m.max(v));
        values.push(double(disjoint_inter));
        // nested: the nodes of the smaller block hold tiles of both
        for (class, offset) in (2..).zip((0..big.total).step_by(small.total)) {
            if !needed.has(class) {
                values.push(f64::NAN);
                continue;
            }
            let first = offset / group_size;
            let last = (offset + small.total - 1) / group_size;
            let mut busiest = out.before[first].max(out.from[last + 1]);
            for g in first..=last {
                let node = g * group_size..(g + 1) * group_size;
                let small_tiles =
                    node.start.max(offset) - offset..node.end.min(offset + small.total) - offset;
                let (src_tiles, dst_tiles) = if producer_big {
                    (node, small_tiles)
                } else {
                    (small_tiles, node)
                };
                let shared = SharedNode {
                    src_tiles,
                    dst_tiles,
                    // where the producer is the larger block, its tile t is on the device t, and
                    // a consumer tile c on offset + c; else the other way round
                    src_minus_dst: if producer_big {
                        offset as isize
                    } else {
                        -(offset as isize)
                    },
                };
                busiest = busiest.max(self.shared_node(&pair, &shared, out));
            }
            values.push(double(busiest));
        }
        out.values = values;
        out.big_groups = big_groups;
        out.small_groups = small_groups;
    }

    /// The busiest lane of a node that holds tiles of both blocks.
    fn shared_node(&self, pair: &BoxSums, node: &SharedNode, out: &mut LaneScratch) -> f64 {
        let (src_tiles, dst_tiles) = (&node.src_tiles, &node.dst_tiles);
        let src_box = pair.src.tiles(src_tiles.start, src_tiles.len());
        let dst_box = pair.dst.tiles(dst_tiles.start, dst_tiles.len());
        // the message between the tiles of one device stays on it
        let local_of_src = |p: usize| {
            let c = (p as isize - node.src_minus_dst) as usize;
            dst_tiles.contains(&c).then(|| pair.one(p, c))
        };
        let local_of_dst = |c: usize| {
            let p = (c as isize + node.src_minus_dst) as usize;
            src_tiles.contains(&p).then(|| pair.one(p, c))
        };
        let mut busiest = 0.0f64;
        let mut lane = |link: Link, load: Load| busiest = busiest.max(self.seconds(link, load));
        let within = pair.sum(&src_box, &dst_box);
        if self.per_device() {
            let switch = self.intra_topology == IntraTopology::Switch;
            let nic = self.nics == Nics::PerDevice;
            pair.per_src_tile(&src_box, &dst_box, &mut out.node_tiles, &mut out.expand);
            for (p, &to_node) in src_tiles.clone().zip(&out.node_tiles) {
                if nic {
                    lane(self.inter, out.src_sends[p].minus(to_node));
                }
                if switch {
                    lane(
                        self.intra,
                        to_node.minus(local_of_src(p).unwrap_or_default()),
                    );
                }
            }
            pair.per_dst_tile(&src_box, &dst_box, &mut out.node_tiles, &mut out.expand);
            for (c, &from_node) in dst_tiles.clone().zip(&out.node_tiles) {
                if nic {
                    lane(self.inter, out.dst_receives[c].minus(from_node));
                }
                if switch {
                    lane(
                        self.intra,
                        from_node.minus(local_of_dst(c).unwrap_or_default()),
                    );
                }
            }
        }
        if self.nics == Nics::PerNode {
            let dst_all = pair.dst.tiles(0, pair.dst.total);
            let src_all = pair.src.tiles(0, pair.src.total);
            lane(self.inter, pair.sum(&src_box, &dst_all).minus(within));
            lane(self.inter, pair.sum(&src_all, &dst_box).minus(within));
        }
        if self.intra_topology == IntraTopology::Bridge {
            let local = src_tiles
                .clone()
                .filter_map(local_of_src)
                .fold(Load::default(), Load::plus);
            lane(self.intra, within.minus(local));
        }
        busiest
    }
}

/// A node holding tiles of both blocks of a nested relation: the producer's and the consumer's
/// tiles on it, and how they pair up on devices (the producer tile `c + src_minus_dst` is on
/// consumer tile `c`'s device).
struct SharedNode {
    src_tiles: std::ops::Range<usize>,
    dst_tiles: std::ops::Range<usize>,
    src_minus_dst: isize,
}

/// Bytes (as elements) and messages on a lane. Products saturate rather than wrap, though no
/// layout pair moves 2^64 elements.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Load {
    elements: u64,
    messages: u64,
}

impl Load {
    const ONE: Load = Load {
        elements: 1,
        messages: 1,
    };

    fn times(self, factor: (u64, u64)) -> Load {
        Load {
            elements: self.elements.saturating_mul(factor.0),
            messages: self.messages.saturating_mul(factor.1),
        }
    }

    fn minus(self, part: Load) -> Load {
        Load {
            elements: self.elements - part.elements,
            messages: self.messages - part.messages,
        }
    }

    fn plus(self, other: Load) -> Load {
        Load {
            elements: self.elements + other.elements,
            messages: self.messages + other.messages,
        }
    }
}

/// Per factor, a half-open range of digits: a box of tiles.
type DigitBox = [(usize, usize); FACTORS];

impl Side {
    /// The digits of the aligned range of `len` tiles from `start` (`len` a power of two dividing
    /// `start`): the low digits whole, one digit in part, the high ones fixed.
    fn tiles(&self, start: usize, len: usize) -> DigitBox {
        let bits = len.trailing_zeros();
        std::array::from_fn(|f| {
            let degree = self.degrees[f];
            let digit = (start >> self.shift[f]) & (degree - 1);
            let free = bits
                .saturating_sub(self.shift[f])
                .min(degree.trailing_zeros());
            (digit, digit + (1 << free))
        })
    }

    fn digit(&self, tile: usize, f: usize) -> usize {
        (tile >> self.shift[f]) & (self.degrees[f] - 1)
    }
}

/// A layout pair's sums over boxes of tile pairs.
struct BoxSums<'a> {
    src: &'a Side,
    dst: &'a Side,
    axes: &'a [&'a AxisSums; FACTORS],
}

impl BoxSums<'_> {
    fn sum(&self, src: &DigitBox, dst: &DigitBox) -> Load {
        let mut load = Load::ONE;
        for (f, axis) in self.axes.iter().enumerate() {
            load = load.times(axis.rect(src[f], dst[f]));
            if load.messages == 0 {
                return Load::default();
            }
        }
        load
    }

    /// The message from producer tile `p` to consumer tile `c`.
    fn one(&self, p: usize, c: usize) -> Load {
        let mut elements = 1u64;
        for (f, axis) in self.axes.iter().enumerate() {
            elements = elements.saturating_mul(axis.at(self.src.digit(p, f), self.dst.digit(c, f)));
        }
        Load {
            elements,
            messages: u64::from(elements > 0),
        }
    }

    /// Per producer tile of `src_tiles` (in tile order), what it sends to the consumer tiles
    /// `dst`, into `out`: a Kronecker product of per-factor sums, built digit by digit.
    fn per_src_tile(
        &self,
        src_tiles: &DigitBox,
        dst: &DigitBox,
        out: &mut Vec<Load>,
        scratch: &mut ExpandScratch,
    ) {
        expand(
            self.src,
            src_tiles,
            |f, i| self.axes[f].rect((i, i + 1), dst[f]),
            out,
            scratch,
        );
    }

    /// Per consumer tile of `dst_tiles` (in tile order), what it receives from the producer tiles
    /// `src`, into `out`.
    fn per_dst_tile(
        &self,
        src: &DigitBox,
        dst_tiles: &DigitBox,
        out: &mut Vec<Load>,
        scratch: &mut ExpandScratch,
    ) {
        expand(
            self.dst,
            dst_tiles,
            |f, j| self.axes[f].rect(src[f], (j, j + 1)),
            out,
            scratch,
        );
    }
}

/// Per tile of the box `tiles` of `side`, in tile order, the product over factors of
/// `factor(f, digit)`, into `out`.
fn expand(
    side: &Side,
    tiles: &DigitBox,
    factor: impl Fn(usize, usize) -> (u64, u64),
    out: &mut Vec<Load>,
    scratch: &mut ExpandScratch,
) {
    let ExpandScratch { spare, factors } = scratch;
    out.clear();
    out.push(Load::ONE);
    for &f in &side.order {
        let (lo, hi) = tiles[f];
        // each digit's factor once, not once per tile
        factors.clear();
        factors.extend((lo..hi).map(|d| factor(f, d)));
        if let [v] = factors[..] {
            for l in out.iter_mut() {
                *l = l.times(v);
            }
            continue;
        }
        spare.clear();
        for &l in out.iter() {
            spare.extend(factors.iter().map(|&v| l.times(v)));
        }
        std::mem::swap(out, spare);
    }
}

/// Working memory of [`expand`], kept between calls.
#[derive(Default)]
pub(super) struct ExpandScratch {
    spare: Vec<Load>,
    factors: Vec<(u64, u64)>,
}

/// One factor's overlap matrix of a (producer degree, consumer degree), with 2-D prefix sums of
/// its overlaps and of its non-zero entries.
#[derive(Default)]
pub(super) struct AxisSums {
    h: usize,
    overlap: Vec<u64>,
    /// `[(i) * (h + 1) + j]`: the sum over producer digits `< i` and consumer digits `< j`.
    sums: Vec<u64>,
    counts: Vec<u64>,
}

impl AxisSums {
    pub(super) fn new(axes: &AxisNeeds, axis: usize, g: usize, h: usize) -> AxisSums {
        let mut overlap = Vec::new();
        axes.overlaps(axis, g, h, &mut overlap);
        let mut s = AxisSums::default();
        s.fill(&overlap, g, h);
        s
    }

    /// The sums of `overlap` (the `g × h` overlaps of one axis, as `AxisNeeds::overlaps` gives
    /// them), in this value's buffers, which it keeps between calls.
    pub(super) fn fill(&mut self, overlap: &[u64], g: usize, h: usize) {
        self.h = h;
        self.overlap.clear();
        self.overlap.extend_from_slice(overlap);
        let w = h + 1;
        for v in [&mut self.sums, &mut self.counts] {
            v.clear();
            v.resize((g + 1) * w, 0);
        }
        for i in 0..g {
            let (mut row_sum, mut row_count) = (0u64, 0u64);
            for j in 0..h {
                let v = self.overlap[i * h + j];
                row_sum += v;
                row_count += u64::from(v > 0);
                self.sums[(i + 1) * w + j + 1] = self.sums[i * w + j + 1] + row_sum;
                self.counts[(i + 1) * w + j + 1] = self.counts[i * w + j + 1] + row_count;
            }
        }
    }

    /// (sum of overlaps, number of non-zero ones) over producer digits `rows` and consumer digits
    /// `columns`.
    fn rect(&self, rows: (usize, usize), columns: (usize, usize)) -> (u64, u64) {
        let w = self.h + 1;
        let at = |v: &[u64], i: usize, j: usize| v[i * w + j];
        let of = |v: &[u64]| {
            (at(v, rows.1, columns.1) - at(v, rows.0, columns.1))
                - (at(v, rows.1, columns.0) - at(v, rows.0, columns.0))
        };
        (of(&self.sums), of(&self.counts))
    }

    fn at(&self, i: usize, j: usize) -> u64 {
        self.overlap[i * self.h + j]
    }
}

/// Reused buffers and results of [`LaneTopology::layout_pair`].
#[derive(Default)]
pub(super) struct LaneScratch {
    /// t_x by `Relation::class`.
    pub(super) values: Vec<f64>,
    /// Per producer tile, everything it sends to the consumer block (where lanes are per device).
    src_sends: Vec<Load>,
    /// Per consumer tile, everything it receives from the producer block.
    dst_receives: Vec<Load>,
    /// Per tile of a shared node, what it exchanges within the node.
    node_tiles: Vec<Load>,
    expand: ExpandScratch,
    /// Per node of the larger and of the smaller block, its busiest NIC (`side_groups`).
    big_groups: Vec<f64>,
    small_groups: Vec<f64>,
    before: Vec<f64>,
    from: Vec<f64>,
}
