//! What the four seed planners (SOYBEAN, Tofu, HyPar, Spartan: planners of other papers, each
//! searching its own space under its own byte count) share:
//!
//! - [`Cut`] and [`Split`]: a layer's partition as its papers describe it, with the reduction
//!   (input-channel) split, and [`Split::to_config_in`], the mapping back into our configuration
//!   space: exact for reduction splits where the space has them ([`SearchSpace::WithReductions`]),
//!   folded into channel splits in OptCNN's;
//! - [`Tiling`] and [`conversion`]: the bytes a pair of worker groups moves to turn one tiling of a
//!   tensor into another (SOYBEAN's c(t1 → t2), Tofu's Lemma 1);
//! - [`recursive_cuts`] and [`price_cuts`]: the recursion SOYBEAN (Algorithm 1), Tofu (§5.2) and
//!   HyPar (Algorithm 2) share: one binary cut of every layer per step, each step's cuts chosen
//!   to minimise that step's cost, the step costs weighted by the number of groups that pay them;
//! - [`solve_min_sum`]: the exact per-step search, OptCNN's node and edge eliminations over tables
//!   of a handful of choices per layer.
//!
//! Costs are in tensor elements; the planners' public functions turn them into bytes (f32).

use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use crate::tables::SearchSpace;
use crate::transfer::{Edge, graph_edges};
use legion_ops::{Dim, Graph, Layer, LayerId, Op, Shape};
use std::collections::BTreeMap;

/// One binary cut of a layer: which of its dimensions a pair of worker groups halves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cut {
    /// The sample dimension (data parallelism; SOYBEAN's form A, HyPar's dp).
    N,
    /// Output channels (SOYBEAN's form B).
    C,
    H,
    W,
    /// Input channels of a conv or dense layer: both halves compute full-size partial sums that
    /// must be added (SOYBEAN's form C and `red`, Tofu's partition-n-reduce, HyPar's mp).
    Red,
    /// Neither half splits anything: both compute the whole layer. Only where no split fits
    /// (a dimension too small to halve again), or Spartan's duplication.
    Replicate,
}

/// A layer's degrees after some cuts: n, c, h, w as in [`ParallelConfig`], plus the reduction
/// split `red`. Every degree is a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Split {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub red: usize,
}

impl Default for Split {
    fn default() -> Split {
        Split::WHOLE
    }
}

impl Split {
    pub const WHOLE: Split = Split {
        n: 1,
        c: 1,
        h: 1,
        w: 1,
        red: 1,
    };

    /// The split after one more `cut`.
    pub fn after(self, cut: Cut) -> Split {
        let mut s = self;
        match cut {
            Cut::N => s.n *= 2,
            Cut::C => s.c *= 2,
            Cut::H => s.h *= 2,
            Cut::W => s.w *= 2,
            Cut::Red => s.red *= 2,
            Cut::Replicate => {}
        }
        s
    }

    /// Output blocks (partial sums of a `red` split count once: they cover the same block).
    pub fn output_parts(&self) -> usize {
        self.n * self.c * self.h * self.w
    }

    /// Whether `layer` can take one more `cut`: its op splits that dim and the dim has room for
    /// twice as many blocks. Replication always fits.
    pub fn admits(&self, layer: &Layer, inputs: &[Shape], cut: Cut) -> bool {
        let dims = layer.op.spec().parallel_dims(&layer.shape);
        let room = |dim: Dim, degree: usize| {
            dims.contains(&dim)
                && dim.axis() < layer.shape.ndim()
                && 2 * degree <= layer.shape.dim(dim.axis())
        };
        match cut {
            Cut::N => room(Dim::N, self.n),
            Cut::C => room(Dim::C, self.c),
            Cut::H => room(Dim::H, self.h),
            Cut::W => room(Dim::W, self.w),
            Cut::Red => {
                LayerKind::of(layer).is_weighted()
                    && inputs
                        .first()
                        .is_some_and(|x| x.ndim() >= 2 && 2 * self.red <= x.dim(1))
            }
            Cut::Replicate => true,
        }
    }

    /// Our config for this split in `space`, starting at device 0: where the space has reduction
    /// splits and the layer takes this one (a conv2d or dense layer with at least `red` input
    /// channels), the `red` degree maps to ours exactly; otherwise as [`Split::to_config`].
    pub fn to_config_in(&self, graph: &Graph, id: LayerId, space: SearchSpace) -> ParallelConfig {
        let layer = graph.layer(id);
        if self.red > 1 {
            let channels = space.reduction_channels(graph, id);
            if channels.is_some_and(|c| self.red <= c) {
                let blocks = Split { red: 1, ..*self }.to_config(layer);
                return blocks.with_reduction(self.red);
            }
        }
        self.to_config(layer)
    }

    /// Our config for this split in OptCNN's space (no reduction splits), starting at device 0:
    /// the `red` degree folds into more channel split where the layer's channels allow it (the
    /// kernel stays divided over the group, as the reduction split divides it, but the input is
    /// replicated and the output split instead of the reverse), else replication (the layer runs
    /// on fewer devices). Each planner's `LOSSY` note says so.
    pub fn to_config(&self, layer: &Layer) -> ParallelConfig {
        let dims = layer.op.spec().parallel_dims(&layer.shape);
        let shape = &layer.shape;
        let fit = |dim: Dim, degree: usize| {
            if dims.contains(&dim) && dim.axis() < shape.ndim() {
                largest_power_of_two_at_most(degree.min(shape.dim(dim.axis())))
            } else {
                1
            }
        };
        ParallelConfig::new(
            [
                fit(Dim::N, self.n),
                fit(Dim::C, self.c * self.red),
                fit(Dim::H, self.h),
                fit(Dim::W, self.w),
            ],
            0,
        )
    }

    /// The cuts of our `config` in a canonical order (n, then c, h, w: the order of our tile
    /// numbering, most significant device bit first, then a reduction split's), padded with
    /// replication to `steps`.
    pub fn cuts_of(config: &ParallelConfig, steps: usize) -> Vec<Cut> {
        let mut cuts = Vec::with_capacity(steps);
        for (dim, cut) in [
            (Dim::N, Cut::N),
            (Dim::C, Cut::C),
            (Dim::H, Cut::H),
            (Dim::W, Cut::W),
        ] {
            for _ in 0..config.degree(dim).trailing_zeros() {
                cuts.push(cut);
            }
        }
        for _ in 0..config.reduction().trailing_zeros() {
            cuts.push(Cut::Red);
        }
        cuts.resize(steps.max(cuts.len()), Cut::Replicate);
        cuts
    }
}

/// The largest power of two not above `x` (1 for 0).
pub fn largest_power_of_two_at_most(x: usize) -> usize {
    if x == 0 { 1 } else { 1 << x.ilog2() }
}

/// The binary cuts a machine allows when every layer spreads over all its devices: the largest
/// power of two of devices, as its exponent.
pub fn cut_steps(machine: &MachineModel) -> usize {
    largest_power_of_two_at_most(machine.num_devices()).trailing_zeros() as usize
}

/// What the seed planners need to know of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    Input,
    /// Conv or dense: a matrix multiplication with a weight.
    Weighted,
    Pool,
    /// relu, the unary family, dropout, batch norm, add, mul, concat: one tiling for all operands
    /// (a channel scale's along N and C).
    Elementwise,
    Flatten,
    Loss,
}

impl LayerKind {
    pub fn of(layer: &Layer) -> LayerKind {
        match layer.op {
            Op::Input(_) => LayerKind::Input,
            Op::Conv2d(_) | Op::Dense(_) => LayerKind::Weighted,
            Op::Pool2d(_) | Op::AdaptiveAvgPool2d(_) => LayerKind::Pool,
            Op::Flatten(_) => LayerKind::Flatten,
            Op::SoftmaxCrossEntropy(_) => LayerKind::Loss,
            Op::Relu(_)
            | Op::Unary(_)
            | Op::Dropout(_)
            | Op::BatchNorm(_)
            | Op::Add(_)
            | Op::Mul(_)
            | Op::Concat(_) => LayerKind::Elementwise,
        }
    }

    pub fn is_weighted(self) -> bool {
        self == LayerKind::Weighted
    }
}

/// How a pair of worker groups holds (or needs) a tensor at one cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiling {
    /// Halved along one of the tensor's own axes (0 = samples, 1 = channels, 2, 3 spatial).
    Axis(usize),
    /// Whole on both (SOYBEAN's `r`).
    Whole,
    /// Full-size partial sums on both, to be added (SOYBEAN's `red`).
    Partial,
}

/// Elements a pair of groups moves, both directions together, to turn a tensor share of
/// `size` elements held as `held` into `needed` (SOYBEAN's two-way totals, Tofu's Lemma 1 counted
/// over both workers): the same tiling or from a whole copy, nothing; between two different
/// halvings, a quarter each way (S/2); a halving made whole, half each way (S); partial sums
/// reduced into halves, S; made whole, 2S. Nothing ever needs partial sums.
pub fn conversion(held: Tiling, needed: Tiling, size: f64) -> f64 {
    match (held, needed) {
        (_, Tiling::Partial) => unreachable!("no consumer reads partial sums"),
        (Tiling::Whole, _) => 0.0,
        (Tiling::Axis(a), Tiling::Axis(b)) if a == b => 0.0,
        (Tiling::Axis(_), Tiling::Axis(_)) => size / 2.0,
        (Tiling::Axis(_), Tiling::Whole) => size,
        (Tiling::Partial, Tiling::Axis(_)) => size,
        (Tiling::Partial, Tiling::Whole) => 2.0 * size,
    }
}

/// The tiling of a layer's output that a cut produces (a reduction's partial sums), and of the
/// gradient of its output that its backward pass needs.
pub fn output_tiling(cut: Cut) -> Tiling {
    match cut {
        Cut::N => Tiling::Axis(0),
        Cut::C => Tiling::Axis(1),
        Cut::H => Tiling::Axis(2),
        Cut::W => Tiling::Axis(3),
        Cut::Red => Tiling::Partial,
        Cut::Replicate => Tiling::Whole,
    }
}

/// The tiling in which a layer's backward pass needs its output gradient: its own output tiling,
/// except that a reduction split needs the whole gradient on both halves (dX = dY·Wᵀ with Wᵀ split
/// by its columns).
pub fn output_gradient_tiling(cut: Cut) -> Tiling {
    match cut {
        Cut::Red => Tiling::Whole,
        other => output_tiling(other),
    }
}

/// The tiling in which a consumer of `kind` under `cut` reads an input of `rank` dims, and the
/// tiling in which its backward pass produces that input's gradient. A conv or dense layer split
/// by output channels reads its whole input and produces partial input gradients; split by input
/// channels it reads and produces channel halves. The others read what they write.
pub fn input_tilings(kind: LayerKind, cut: Cut, rank: usize) -> (Tiling, Tiling) {
    let axis = |a: usize| {
        if a < rank {
            Tiling::Axis(a)
        } else {
            Tiling::Whole
        }
    };
    match (kind, cut) {
        (_, Cut::Replicate) => (Tiling::Whole, Tiling::Whole),
        (_, Cut::N) => (Tiling::Axis(0), Tiling::Axis(0)),
        (LayerKind::Weighted, Cut::C) => (Tiling::Whole, Tiling::Partial),
        (LayerKind::Weighted, Cut::Red) => (axis(1), axis(1)),
        // flatten's output channels interleave the input's channels and pixels
        (LayerKind::Flatten, _) => (Tiling::Whole, Tiling::Whole),
        (_, Cut::C) => (axis(1), axis(1)),
        (_, Cut::H) => (axis(2), axis(2)),
        (_, Cut::W) => (axis(3), axis(3)),
        (_, Cut::Red) => unreachable!("only conv and dense layers take reduction splits"),
    }
}

/// Elements of `shape`.
pub fn elements(shape: &Shape) -> f64 {
    shape.numel() as f64
}

/// Elements of a layer's trainable parameters.
pub fn weight_elements(graph: &Graph, id: LayerId) -> f64 {
    graph
        .layer_params(id)
        .iter()
        .filter(|p| p.trainable)
        .map(|p| elements(&p.shape))
        .sum()
}

/// The cost terms of one binary cut, for one pair of groups (one group's half graph). A planner
/// implements its paper's objective with these.
pub trait StepCosts {
    /// The cuts `layer` may take next, given its split so far (never empty).
    fn choices(&self, layer: LayerId, split: &Split) -> Vec<Cut>;
    /// Elements moved inside one pair of groups by `layer`'s own cut (its weights, its reductions).
    fn unary(&self, layer: LayerId, split: &Split, cut: Cut, step: usize) -> f64;
    /// Elements moved inside one pair of groups along `edge` under the two ends' cuts.
    fn pair(&self, edge: &Edge, src: (&Split, Cut), dst: (&Split, Cut), step: usize) -> f64;
}

/// A recursive plan: per layer its cuts, step by step, and what each step cost.
#[derive(Clone, Debug, PartialEq)]
pub struct CutPlan {
    /// By layer id, one cut per step.
    pub cuts: Vec<Vec<Cut>>,
    /// By step: elements moved within one pair of groups (the papers' δ_i, Tofu's cost(p_i)).
    pub per_group: Vec<f64>,
}

impl CutPlan {
    /// Σ_i 2^(i-1)·δ_i (steps from 1): every one of the 2^(i-1) groups cut at step i pays δ_i
    /// (SOYBEAN Thm. 1, Tofu Eq. 3, HyPar's com(H) = com_top + 2·com(H-1)).
    pub fn total(&self) -> f64 {
        self.per_group
            .iter()
            .enumerate()
            .map(|(i, d)| (1u64 << i) as f64 * d)
            .sum()
    }

    /// Each layer's split after every step.
    pub fn splits(&self) -> Vec<Split> {
        self.cuts
            .iter()
            .map(|cuts| cuts.iter().fold(Split::WHOLE, |s, &c| s.after(c)))
            .collect()
    }

    /// Our configs for the plan in OptCNN's space ([`Split::to_config`]).
    pub fn configs(&self, graph: &Graph) -> Vec<ParallelConfig> {
        self.configs_in(graph, SearchSpace::Paper)
    }

    /// Our configs for the plan in `space` ([`Split::to_config_in`]).
    pub fn configs_in(&self, graph: &Graph, space: SearchSpace) -> Vec<ParallelConfig> {
        configs_of_splits(graph, &self.splits(), space)
    }
}

/// A recursive-cut planner's answer: the strategy in our space, the cuts as the planner chose
/// them, and their bytes under its own accounting.
#[derive(Clone, Debug, PartialEq)]
pub struct RecursivePlan {
    /// By layer id, in our space.
    pub configs: Vec<ParallelConfig>,
    /// The cuts as the planner chose them (reductions included) and what each step cost.
    pub cuts: CutPlan,
    /// The plan's bytes (f32) under the planner's own accounting, before mapping into our space.
    pub native_bytes: f64,
}

impl RecursivePlan {
    /// Our configs for the plan in `space` ([`Split::to_config_in`]); `configs` holds them in
    /// OptCNN's.
    pub fn configs_in(&self, graph: &Graph, space: SearchSpace) -> Vec<ParallelConfig> {
        self.cuts.configs_in(graph, space)
    }
}

/// Per layer, our config for its split in `space` ([`Split::to_config_in`]).
pub fn configs_of_splits(
    graph: &Graph,
    splits: &[Split],
    space: SearchSpace,
) -> Vec<ParallelConfig> {
    graph
        .ids()
        .zip(splits)
        .map(|(id, s)| s.to_config_in(graph, id, space))
        .collect()
}

/// Runs [`recursive_cuts`] with one step per halving of the machine's devices and maps the cuts
/// into our space.
pub fn recursive_plan(
    graph: &Graph,
    machine: &MachineModel,
    costs: &impl StepCosts,
) -> RecursivePlan {
    let cuts = recursive_cuts(graph, cut_steps(machine), costs);
    RecursivePlan {
        configs: cuts.configs(graph),
        native_bytes: 4.0 * cuts.total(),
        cuts,
    }
}

/// The recursion: `steps` times, choose every layer's next cut to minimise that step's cost
/// ([`solve_min_sum`]), given the cuts so far.
pub fn recursive_cuts(graph: &Graph, steps: usize, costs: &impl StepCosts) -> CutPlan {
    let edges = graph_edges(graph);
    let layers = graph.layers().len();
    let mut splits = vec![Split::WHOLE; layers];
    let mut cuts = vec![Vec::with_capacity(steps); layers];
    let mut per_group = Vec::with_capacity(steps);
    for step in 0..steps {
        let choices: Vec<Vec<Cut>> = graph
            .ids()
            .map(|id| costs.choices(id, &splits[id.0]))
            .collect();
        let unary: Vec<Vec<f64>> = graph
            .ids()
            .map(|id| {
                choices[id.0]
                    .iter()
                    .map(|&c| costs.unary(id, &splits[id.0], c, step))
                    .collect()
            })
            .collect();
        let tables: Vec<PairTable> = edges
            .iter()
            .map(|e| {
                let (a, b) = (&choices[e.src.0], &choices[e.dst.0]);
                let mut t = Vec::with_capacity(a.len() * b.len());
                for &ca in a {
                    for &cb in b {
                        t.push(costs.pair(e, (&splits[e.src.0], ca), (&splits[e.dst.0], cb), step));
                    }
                }
                PairTable {
                    src: e.src.0,
                    dst: e.dst.0,
                    costs: t,
                }
            })
            .collect();
        let chosen = solve_min_sum(&unary, &tables);
        per_group.push(min_sum_value(&unary, &tables, &chosen));
        for id in graph.ids() {
            let cut = choices[id.0][chosen[id.0]];
            cuts[id.0].push(cut);
            splits[id.0] = splits[id.0].after(cut);
        }
    }
    CutPlan { cuts, per_group }
}

/// The step costs of given per-layer cut sequences (all of one length) under `costs`.
pub fn price_cuts(graph: &Graph, cuts: &[Vec<Cut>], costs: &impl StepCosts) -> CutPlan {
    let edges = graph_edges(graph);
    let steps = cuts.first().map_or(0, Vec::len);
    let mut splits = vec![Split::WHOLE; cuts.len()];
    let mut per_group = Vec::with_capacity(steps);
    for step in 0..steps {
        let mut total = 0.0;
        for id in graph.ids() {
            total += costs.unary(id, &splits[id.0], cuts[id.0][step], step);
        }
        for e in &edges {
            total += costs.pair(
                e,
                (&splits[e.src.0], cuts[e.src.0][step]),
                (&splits[e.dst.0], cuts[e.dst.0][step]),
                step,
            );
        }
        per_group.push(total);
        for (s, c) in splits.iter_mut().zip(cuts) {
            *s = s.after(c[step]);
        }
    }
    CutPlan {
        cuts: cuts.to_vec(),
        per_group,
    }
}

/// Our configs as cut sequences of `steps` cuts each ([`Split::cuts_of`]).
pub fn cuts_of_configs(configs: &[ParallelConfig], steps: usize) -> Vec<Vec<Cut>> {
    let longest = configs
        .iter()
        .map(|c| Split::cuts_of(c, 0).len())
        .max()
        .unwrap_or(0);
    configs
        .iter()
        .map(|c| Split::cuts_of(c, steps.max(longest)))
        .collect()
}

/// A pairwise cost table between the choices of two nodes: row-major `[src choice][dst choice]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PairTable {
    pub src: usize,
    pub dst: usize,
    pub costs: Vec<f64>,
}

/// Σ unary + Σ pair of one assignment.
pub fn min_sum_value(unary: &[Vec<f64>], tables: &[PairTable], chosen: &[usize]) -> f64 {
    let mut total: f64 = unary.iter().zip(chosen).map(|(u, &c)| u[c]).sum();
    for t in tables {
        let cols = unary[t.dst].len();
        total += t.costs[chosen[t.src] * cols + chosen[t.dst]];
    }
    total
}

/// How an eliminated node's choice is recovered once its neighbours are chosen.
enum Undo {
    /// Its choice did not depend on anything left.
    Fixed { node: usize, choice: usize },
    /// A leaf: its best choice per choice of its one neighbour.
    Leaf {
        node: usize,
        neighbour: usize,
        best: Vec<usize>,
    },
    /// A node between two others: its best choice per choice pair of (a, b).
    Series {
        node: usize,
        a: usize,
        b: usize,
        best: Vec<usize>,
    },
}

/// The assignment of one choice per node minimising Σ unary + Σ pair. Exact by OptCNN's
/// eliminations: parallel tables add up (edge elimination), a leaf folds into its neighbour, a node
/// with two neighbours becomes a table between them (node elimination, a min-plus product). What
/// those leave (never, on the zoo's graphs) is fixed greedily, the node with most neighbours
/// first, each at its best choice against its neighbours' best responses, then eliminated again:
/// a heuristic only there.
pub fn solve_min_sum(unary: &[Vec<f64>], tables: &[PairTable]) -> Vec<usize> {
    let n = unary.len();
    let mut unary: Vec<Vec<f64>> = unary.to_vec();
    // edges keyed by (low, high) node, table oriented [low choice][high choice]
    let mut edges: BTreeMap<(usize, usize), Vec<f64>> = BTreeMap::new();
    let mut neighbours: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); n];
    let add_edge = |edges: &mut BTreeMap<(usize, usize), Vec<f64>>,
                    neighbours: &mut Vec<std::collections::BTreeSet<usize>>,
                    unary: &mut Vec<Vec<f64>>,
                    a: usize,
                    b: usize,
                    table: Vec<f64>| {
        if a == b {
            // a layer reading its own producer twice through one node: the diagonal
            let k = unary[a].len();
            for i in 0..k {
                unary[a][i] += table[i * k + i];
            }
            return;
        }
        let (lo, hi, t) = if a < b {
            (a, b, table)
        } else {
            (b, a, transpose(&table, unary[a].len(), unary[b].len()))
        };
        neighbours[lo].insert(hi);
        neighbours[hi].insert(lo);
        match edges.get_mut(&(lo, hi)) {
            Some(existing) => existing.iter_mut().zip(&t).for_each(|(x, y)| *x += y),
            None => {
                edges.insert((lo, hi), t);
            }
        }
    };
    for t in tables {
        add_edge(
            &mut edges,
            &mut neighbours,
            &mut unary,
            t.src,
            t.dst,
            t.costs.clone(),
        );
    }
    // the table of edge (a, b) oriented [a choice][b choice]
    let oriented = |edges: &BTreeMap<(usize, usize), Vec<f64>>,
                    unary: &[Vec<f64>],
                    a: usize,
                    b: usize|
     -> Vec<f64> {
        if a < b {
            edges[&(a, b)].clone()
        } else {
            transpose(&edges[&(b, a)], unary[b].len(), unary[a].len())
        }
    };
    let mut alive: Vec<bool> = vec![true; n];
    let mut undo: Vec<Undo> = Vec::with_capacity(n);
    let mut left = n;
    while left > 0 {
        // the lowest-numbered node of the fewest neighbours: deterministic
        let node = (0..n)
            .filter(|&i| alive[i])
            .min_by_key(|&i| (neighbours[i].len(), i))
            .expect("a node is left");
        let near: Vec<usize> = neighbours[node].iter().copied().collect();
        let k = unary[node].len();
        match near.len() {
            0 => {
                undo.push(Undo::Fixed {
                    node,
                    choice: argmin(&unary[node]),
                });
            }
            1 => {
                let nb = near[0];
                let t = oriented(&edges, &unary, node, nb);
                let m = unary[nb].len();
                let mut best = vec![0; m];
                for (y, slot) in best.iter_mut().enumerate() {
                    let scores: Vec<f64> = (0..k).map(|x| unary[node][x] + t[x * m + y]).collect();
                    *slot = argmin(&scores);
                    unary[nb][y] += scores[*slot];
                }
                remove_edge(&mut edges, &mut neighbours, node, nb);
                undo.push(Undo::Leaf {
                    node,
                    neighbour: nb,
                    best,
                });
            }
            2 => {
                let (a, b) = (near[0], near[1]);
                let ta = oriented(&edges, &unary, a, node);
                let tb = oriented(&edges, &unary, node, b);
                let (ka, kb) = (unary[a].len(), unary[b].len());
                let mut table = vec![0.0; ka * kb];
                let mut best = vec![0; ka * kb];
                for ya in 0..ka {
                    for yb in 0..kb {
                        let scores: Vec<f64> = (0..k)
                            .map(|x| unary[node][x] + ta[ya * k + x] + tb[x * kb + yb])
                            .collect();
                        let x = argmin(&scores);
                        best[ya * kb + yb] = x;
                        table[ya * kb + yb] = scores[x];
                    }
                }
                remove_edge(&mut edges, &mut neighbours, node, a);
                remove_edge(&mut edges, &mut neighbours, node, b);
                add_edge(&mut edges, &mut neighbours, &mut unary, a, b, table);
                undo.push(Undo::Series { node, a, b, best });
            }
            _ => {
                // no exact rule applies: fix the busiest node against its neighbours' best replies
                let node = (0..n)
                    .filter(|&i| alive[i])
                    .max_by_key(|&i| (neighbours[i].len(), std::cmp::Reverse(i)))
                    .expect("a node is left");
                let near: Vec<usize> = neighbours[node].iter().copied().collect();
                let k = unary[node].len();
                let scores: Vec<f64> = (0..k)
                    .map(|x| {
                        unary[node][x]
                            + near
                                .iter()
                                .map(|&nb| {
                                    let t = oriented(&edges, &unary, node, nb);
                                    let m = unary[nb].len();
                                    (0..m)
                                        .map(|y| t[x * m + y] + unary[nb][y])
                                        .fold(f64::INFINITY, f64::min)
                                })
                                .sum::<f64>()
                    })
                    .collect();
                let choice = argmin(&scores);
                for &nb in &near {
                    let t = oriented(&edges, &unary, node, nb);
                    let m = unary[nb].len();
                    for y in 0..m {
                        unary[nb][y] += t[choice * m + y];
                    }
                    remove_edge(&mut edges, &mut neighbours, node, nb);
                }
                undo.push(Undo::Fixed { node, choice });
                alive[node] = false;
                left -= 1;
                continue;
            }
        }
        alive[node] = false;
        left -= 1;
    }
    let mut chosen = vec![0; n];
    for u in undo.iter().rev() {
        match u {
            Undo::Fixed { node, choice } => chosen[*node] = *choice,
            Undo::Leaf {
                node,
                neighbour,
                best,
            } => chosen[*node] = best[chosen[*neighbour]],
            Undo::Series { node, a, b, best } => {
                let kb = best.len() / unary[*a].len();
                chosen[*node] = best[chosen[*a] * kb + chosen[*b]];
            }
        }
    }
    chosen
}

fn remove_edge(
    edges: &mut BTreeMap<(usize, usize), Vec<f64>>,
    neighbours: &mut [std::collections::BTreeSet<usize>],
    a: usize,
    b: usize,
) {
    edges.remove(&(a.min(b), a.max(b)));
    neighbours[a].remove(&b);
    neighbours[b].remove(&a);
}

fn transpose(t: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0.0; t.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = t[r * cols + c];
        }
    }
    out
}

/// The first index of the smallest value (ties go to the earlier choice: deterministic).
pub fn argmin(values: &[f64]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v < values[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::ConfigSpace;
    use legion_ops::GraphBuilder;
    use legion_ops::op::{Conv2d, Dense, Pool2d};
    use proptest::prelude::*;

    /// Brute force over every assignment.
    fn brute(unary: &[Vec<f64>], tables: &[PairTable]) -> f64 {
        let mut best = f64::INFINITY;
        let mut chosen = vec![0; unary.len()];
        loop {
            best = best.min(min_sum_value(unary, tables, &chosen));
            let mut i = 0;
            loop {
                if i == chosen.len() {
                    return best;
                }
                chosen[i] += 1;
                if chosen[i] < unary[i].len() {
                    break;
                }
                chosen[i] = 0;
                i += 1;
            }
        }
    }

    proptest! {
        /// On chains with forks (series-parallel graphs) the eliminations are exact.
        #[test]
        fn eliminations_find_the_minimum_of_series_parallel_graphs(
            seed in 0u64..10_000, nodes in 2usize..7, choices in 1usize..4,
        ) {
            let mut rng = legion_ops::rng::Rng::new(seed);
            let unary: Vec<Vec<f64>> = (0..nodes)
                .map(|_| (0..choices).map(|_| (rng.next_u64() % 10) as f64).collect())
                .collect();
            let mut tables = Vec::new();
            for dst in 1..nodes {
                let table = |rng: &mut legion_ops::rng::Rng| -> Vec<f64> {
                    (0..choices * choices).map(|_| (rng.next_u64() % 10) as f64).collect()
                };
                tables.push(PairTable { src: dst - 1, dst, costs: table(&mut rng) });
                if dst >= 2 && rng.next_u64().is_multiple_of(2) {
                    // a skip edge over one node: a fork-join
                    tables.push(PairTable { src: dst - 2, dst, costs: table(&mut rng) });
                }
            }
            let chosen = solve_min_sum(&unary, &tables);
            prop_assert_eq!(min_sum_value(&unary, &tables, &chosen), brute(&unary, &tables));
        }
    }

    /// A small CNN with a fork-join, for the planners' tests: input, conv, two branches (a 1×1
    /// conv and a relu) into a concat, pool, flatten, dense, loss.
    pub(crate) fn small_cnn(batch: usize, channels: usize, image: usize) -> Graph {
        let mut b = GraphBuilder::new("small");
        let x = b.input("x", Shape::nchw(batch, 3, image, image)).unwrap();
        let c1 = b
            .conv2d("c1", x, Conv2d::new(channels, 3).padding(1))
            .unwrap();
        let a = b.conv2d("a", c1, Conv2d::new(channels, 1)).unwrap();
        let r = b.relu("r", c1).unwrap();
        let c = b.concat("cat", &[a, r]).unwrap();
        let p = b.pool2d("p", c, Pool2d::max(2)).unwrap();
        let f = b.flatten("f", p).unwrap();
        let d = b.dense("d", f, Dense::new(10)).unwrap();
        b.softmax_cross_entropy("loss", d).unwrap();
        b.finish()
    }

    /// A random small CNN for the planners' property tests: an input, one to three blocks (a
    /// conv, a relu, a pooling, or a fork-join of a 1×1 conv and a relu into a concat or add),
    /// then flatten, dense and the loss. Sizes are small powers of two and odd numbers, so that
    /// some splits do not fit.
    pub(crate) fn random_graph(seed: u64) -> Graph {
        let mut rng = legion_ops::rng::Rng::new(seed);
        let mut pick = |options: &[usize]| options[rng.below(options.len())];
        let batch = pick(&[2, 4, 8, 16, 3]);
        let mut channels = pick(&[1, 2, 4, 8, 3]);
        let mut image = pick(&[2, 4, 8, 6]);
        let blocks = pick(&[1, 2, 3]);
        let kinds: Vec<usize> = (0..blocks).map(|_| pick(&[0, 1, 2, 3, 4])).collect();
        let widths: Vec<usize> = (0..blocks).map(|_| pick(&[2, 4, 8, 5])).collect();
        let classes = pick(&[2, 4, 10]);
        let mut b = GraphBuilder::new("random");
        let mut x = b
            .input("x", Shape::nchw(batch, channels, image, image))
            .unwrap();
        for (i, (&kind, &width)) in kinds.iter().zip(&widths).enumerate() {
            x = match kind {
                0 => {
                    channels = width;
                    b.conv2d(&format!("conv{i}"), x, Conv2d::new(width, 3).padding(1))
                        .unwrap()
                }
                1 => b.relu(&format!("relu{i}"), x).unwrap(),
                2 if image >= 2 && image % 2 == 0 => {
                    image /= 2;
                    b.pool2d(&format!("pool{i}"), x, Pool2d::max(2)).unwrap()
                }
                3 => {
                    let a = b
                        .conv2d(&format!("branch{i}"), x, Conv2d::new(width, 1))
                        .unwrap();
                    let r = b.relu(&format!("side{i}"), x).unwrap();
                    channels += width;
                    b.concat(&format!("cat{i}"), &[a, r]).unwrap()
                }
                _ => {
                    let a = b
                        .conv2d(&format!("branch{i}"), x, Conv2d::new(channels, 1))
                        .unwrap();
                    b.add(&format!("add{i}"), a, x).unwrap()
                }
            };
        }
        let f = b.flatten("flat", x).unwrap();
        let d = b.dense("fc", f, Dense::new(classes)).unwrap();
        b.softmax_cross_entropy("loss", d).unwrap();
        b.finish()
    }

    /// Samples and output channels halved once each, input channels quartered.
    const N2_C2_RED4: Split = Split {
        n: 2,
        c: 2,
        h: 1,
        w: 1,
        red: 4,
    };

    #[test]
    fn configs_are_in_their_layers_spaces() {
        let g = small_cnn(8, 4, 8);
        let l = g.layer(g.find("d").unwrap());
        let split = N2_C2_RED4;
        // red 4 on c: c 2·4 = 8 ≤ 10 channels rounds to 8
        assert_eq!(split.to_config(l).degrees(), [2, 8, 1, 1]);
        assert_eq!(
            Split::cuts_of(&ParallelConfig::new([2, 4, 1, 1], 0), 4),
            vec![Cut::N, Cut::C, Cut::C, Cut::Replicate]
        );
    }

    /// Where the space has reduction splits, a dense layer's `red` maps onto ours exactly (d's 128
    /// input features take 4 partials), and back to the same cuts; in OptCNN's space it folds
    /// into the channel split as before.
    #[test]
    fn reduction_cuts_map_to_reduction_splits_where_the_space_has_them() {
        let g = small_cnn(8, 4, 8);
        let d = g.find("d").unwrap();
        let split = N2_C2_RED4;
        let paper = split.to_config_in(&g, d, SearchSpace::Paper);
        assert_eq!((paper.degrees(), paper.reduction()), ([2, 8, 1, 1], 1));
        let exact = split.to_config_in(&g, d, SearchSpace::WithReductions);
        assert_eq!((exact.degrees(), exact.reduction()), ([2, 2, 1, 1], 4));
        let l = g.layer(d);
        let space = ConfigSpace::enumerate_with_reductions(
            &l.shape,
            l.op.spec().parallel_dims(&l.shape),
            16,
            l.op.spec().reduction_channels(&g.input_shapes(d)),
        );
        assert!(space.configs().contains(&exact), "{exact}");
        assert_eq!(
            Split::cuts_of(&exact, 4),
            vec![Cut::N, Cut::C, Cut::Red, Cut::Red]
        );
        // a layer without reduction splits (the pooling) folds them whatever the space
        let p = g.find("p").unwrap();
        let folded = Split {
            red: 2,
            ..Split::WHOLE
        };
        assert_eq!(
            folded.to_config_in(&g, p, SearchSpace::WithReductions),
            folded.to_config(g.layer(p))
        );
    }

    #[test]
    fn conversions_follow_soybeans_two_way_totals() {
        let s = 8.0;
        assert_eq!(conversion(Tiling::Axis(0), Tiling::Axis(0), s), 0.0);
        assert_eq!(conversion(Tiling::Whole, Tiling::Axis(1), s), 0.0);
        assert_eq!(conversion(Tiling::Axis(0), Tiling::Axis(1), s), s / 2.0);
        assert_eq!(conversion(Tiling::Axis(1), Tiling::Whole, s), s);
        assert_eq!(conversion(Tiling::Partial, Tiling::Axis(0), s), s);
        assert_eq!(conversion(Tiling::Partial, Tiling::Whole, s), 2.0 * s);
    }
}
