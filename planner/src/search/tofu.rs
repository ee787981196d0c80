//! Tofu (Wang, Huang, Li: "Supporting very large models using automatic dataflow graph
//! partitioning", EuroSys '19): recursive partition-n-reduce, every tensor always split.
//!
//! - Space: at each of log2 D steps every operator picks one basic partition-n-reduce strategy
//!   for two worker groups: halve one output dimension (samples, channels, or a spatial one) or one
//!   reduction dimension (a conv's or dense layer's input channels; the two halves' partial outputs
//!   are summed). Tensors are stored split, never replicated: weights too (1/D of them per worker,
//!   fetched when a strategy needs them whole).
//! - Cost: bytes only (§5: no compute term, no memory constraint). Lemma 1: a strategy fetches
//!   each input region it lacks and sends each output region (partial sums too) owned elsewhere:
//!   per pair of workers, S (whole tensor needed), S/2 (halved along another dimension), 0
//!   (aligned), with S the tensor's share. Every tensor halves at every step, so a step's total
//!   over its 2^(i-1) groups, 2^(i-1)·cost(p_i) (Eq. 3), does not depend on when it is taken:
//!   steps commute (Thm. 1) and their costs never decrease (Thm. 2), which makes the recursion
//!   optimal (Thm. 3).
//! - Search: (1) coarsening: our layers are already the forward op with its backward ops and a
//!   tensor with its gradient, so the graph is Tofu's coarsened graph; (2) per step, the DP of
//!   OptCNN over it (node and edge eliminations where branches break the chain); (3) recursion
//!   on one group's half, mirrored to the other.
//!
//! Lossy ([`LOSSY`]): reduction splits map to channel splits (replication where channels run
//! out); Tofu shards weights that our sample and spatial splits replicate; Tofu partitions a tensor
//! and its gradient, and the forward and backward ops, independently where one config of ours
//! fixes all; halo exchange (spatial splits) is priced as any halving, as Tofu's proof assumes.
//! Tofu's memory check (the largest batch that fits, §7.1) is not done here.

use super::seed::{SeedPlan, SeedPlanner};
use super::tiling::{
    Cut, LayerKind, RecursivePlan, Split, StepCosts, Tiling, conversion, cut_steps,
    cuts_of_configs, elements, input_tilings, output_gradient_tiling, output_tiling, price_cuts,
    recursive_plan, weight_elements,
};
use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use crate::tables::SearchSpace;
use crate::transfer::Edge;
use legion_ops::{Graph, LayerId, Op};

/// What our configuration space loses of Tofu's plans.
pub const LOSSY: &str = "Tofu's reduction partitions map to our reduction splits (with \
     --paper-space, OptCNN's space, to channel splits, or replication where channels run out); \
     weights Tofu shards are replicated \
     under our sample and spatial splits; one config per layer fixes what Tofu splits per tensor, \
     gradient and op";

/// Tofu's plan for `graph` on `machine`.
pub type TofuPlan = RecursivePlan;

/// The recursive search with log2 D steps (D rounded down to a power of two).
pub fn tofu(graph: &Graph, machine: &MachineModel) -> TofuPlan {
    tofu_with(graph, machine, true)
}

/// The search with or without reduction strategies (Tofu §7.3's "ICML18 without output
/// reduction" is the latter).
pub fn tofu_with(graph: &Graph, machine: &MachineModel, reductions: bool) -> TofuPlan {
    let costs = TofuCosts { graph, reductions };
    recursive_plan(graph, machine, &costs)
}

/// Tofu as a seed planner: [`tofu`], mapped into the space asked for.
pub struct Tofu;

impl SeedPlanner for Tofu {
    fn name(&self) -> &'static str {
        "tofu"
    }

    fn lossy(&self) -> &'static str {
        LOSSY
    }

    fn plan(&self, graph: &Graph, machine: &MachineModel, space: SearchSpace) -> SeedPlan {
        let plan = tofu(graph, machine);
        SeedPlan {
            configs: plan.configs_in(graph, space),
            native_bytes: plan.native_bytes,
        }
    }

    /// Each config read as its cuts in our device order.
    fn native_bytes(
        &self,
        graph: &Graph,
        machine: &MachineModel,
        configs: &[ParallelConfig],
    ) -> f64 {
        let cuts = cuts_of_configs(configs, cut_steps(machine));
        let costs = TofuCosts {
            graph,
            reductions: true,
        };
        4.0 * price_cuts(graph, &cuts, &costs).total()
    }
}

pub(crate) struct TofuCosts<'g> {
    pub(crate) graph: &'g Graph,
    pub(crate) reductions: bool,
}

/// A tensor's share at step `step` (from 0): halved at every step before.
fn share(elements: f64, step: usize) -> f64 {
    elements / (1u64 << step) as f64
}

impl StepCosts for TofuCosts<'_> {
    fn choices(&self, layer: LayerId, split: &Split) -> Vec<Cut> {
        let l = self.graph.layer(layer);
        let wanted: &[Cut] = match (LayerKind::of(l), &l.op) {
            (LayerKind::Weighted, Op::Dense(_)) => &[Cut::N, Cut::C, Cut::Red],
            (LayerKind::Weighted, _) => &[Cut::N, Cut::C, Cut::H, Cut::W, Cut::Red],
            (LayerKind::Flatten | LayerKind::Loss, _) => &[Cut::N],
            _ => &[Cut::N, Cut::C, Cut::H, Cut::W],
        };
        let inputs = self.graph.input_shapes(layer);
        let fits: Vec<Cut> = wanted
            .iter()
            .copied()
            .filter(|&c| (self.reductions || c != Cut::Red) && split.admits(l, &inputs, c))
            .collect();
        if fits.is_empty() {
            vec![Cut::Replicate]
        } else {
            fits
        }
    }

    fn unary(&self, layer: LayerId, _split: &Split, cut: Cut, step: usize) -> f64 {
        if !LayerKind::of(self.graph.layer(layer)).is_weighted() {
            return 0.0;
        }
        let weight = share(weight_elements(self.graph, layer), step);
        match cut {
            // a split the weight does not index: both need it whole (they hold halves), and both
            // produce a full partial gradient to be reduced into the stored halves
            Cut::N | Cut::H | Cut::W => {
                conversion(Tiling::Axis(0), Tiling::Whole, weight)
                    + conversion(Tiling::Partial, Tiling::Axis(0), weight)
            }
            // both compute the whole layer: the weight whole on both, the gradient already whole
            Cut::Replicate => conversion(Tiling::Axis(0), Tiling::Whole, weight),
            // the weight is indexed by output and input channels: halves, stored where used
            Cut::C | Cut::Red => 0.0,
        }
    }

    fn pair(&self, edge: &Edge, src: (&Split, Cut), dst: (&Split, Cut), step: usize) -> f64 {
        let kind = LayerKind::of(self.graph.layer(edge.dst));
        let x = self.graph.input_shapes(edge.dst)[edge.input];
        let size = share(elements(&x), step);
        let (needed, gradient) = input_tilings(kind, dst.1, x.ndim());
        let forward = conversion(output_tiling(src.1), needed, size);
        let backward = if edge.carries_gradient(self.graph) {
            conversion(gradient, output_gradient_tiling(src.1), size)
        } else {
            0.0
        };
        forward + backward
    }
}

/// §5.2: the ways to split a `dims`-dimensional tensor evenly over `workers` (a power of two)
/// with power-of-two degrees: the ordered ways to write log2(workers) as `dims` non-negative
/// parts, C(k + d - 1, d - 1).
pub fn even_partitions(dims: usize, workers: usize) -> u64 {
    let k = workers.trailing_zeros() as u64;
    let d = dims as u64;
    // C(k + d - 1, d - 1), incrementally
    (1..d).fold(1u64, |acc, i| acc * (k + i) / i)
}

/// §5.2: configurations the DP enumerates for one operator group of `tensors` tensors of `dims`
/// dimensions over `workers`: all even partitions of each at once without recursion; with it, one
/// dimension per tensor per step, log2(workers) steps.
pub fn group_configurations(tensors: u32, dims: usize, workers: usize, recursive: bool) -> u64 {
    if recursive {
        workers.trailing_zeros() as u64 * (dims as u64).pow(tensors)
    } else {
        even_partitions(dims, workers).pow(tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::tiling::tests::small_cnn;
    use legion_ops::op::Dense;
    use legion_ops::{GraphBuilder, Shape};

    /// §5.2: "For each 4D tensor used in 2D-convolution, there are in total 20 different ways to
    /// partition it evenly across 8 workers" (C(3 + 3, 3) = 20), "the number of possible
    /// configurations of 2D-convolution's operator group is 20^6 = 6.4×10^7" (two inputs and an
    /// output, each with its gradient: 6 tensors); with recursion "only 4^6 = 4096" per step and
    /// "3 * 4096" in all over 3 steps.
    #[test]
    fn section_5_2_counts() {
        assert_eq!(even_partitions(4, 8), 20);
        assert_eq!(group_configurations(6, 4, 8, false), 64_000_000);
        assert_eq!(4u64.pow(6), 4096);
        assert_eq!(group_configurations(6, 4, 8, true), 3 * 4096);
    }

    fn mlp(layers: usize, width: usize, batch: usize) -> Graph {
        let mut b = GraphBuilder::new("mlp");
        let mut x = b.input("x", Shape::nc(batch, width)).unwrap();
        for i in 0..layers {
            x = b
                .dense(&format!("fc{i}"), x, Dense::new(width).no_bias())
                .unwrap();
        }
        b.softmax_cross_entropy("loss", x).unwrap();
        b.finish()
    }

    /// Thm. 1: swapping two steps of a plan leaves its cost unchanged (every tensor halves at every
    /// step, so a step's total over its groups is the same whenever it is taken). Thm. 2: the
    /// steps of the plan the recursion finds cost no less as they go.
    #[test]
    fn steps_commute_and_never_get_cheaper() {
        let machine = MachineModel::preset("paper:8").unwrap();
        let g = small_cnn(16, 8, 8);
        let found = tofu(&g, &machine);
        let costs = TofuCosts {
            graph: &g,
            reductions: true,
        };
        let swapped: Vec<Vec<Cut>> = found
            .cuts
            .cuts
            .iter()
            .map(|c| vec![c[1], c[0], c[2]])
            .collect();
        let a = price_cuts(&g, &found.cuts.cuts, &costs).total();
        let b = price_cuts(&g, &swapped, &costs).total();
        assert_eq!(a, b);
        let totals: Vec<f64> = found
            .cuts
            .per_group
            .iter()
            .enumerate()
            .map(|(i, d)| (1u64 << i) as f64 * d)
            .collect();
        assert!(totals.windows(2).all(|w| w[0] <= w[1]), "{totals:?}");
    }

    /// Thm. 3: the recursion is optimal among all sequences of basic plans; checked by brute force
    /// over every pair of steps of a 2-layer MLP on 4 workers (the input: 2 choices, each dense
    /// layer 3, the loss 1: 18² sequences).
    #[test]
    fn the_recursion_is_optimal_over_all_sequences() {
        let machine = MachineModel::preset("paper:4").unwrap();
        let g = mlp(2, 64, 32);
        let costs = TofuCosts {
            graph: &g,
            reductions: true,
        };
        let found = tofu(&g, &machine);
        let options: Vec<Vec<Cut>> = g.ids().map(|id| costs.choices(id, &Split::WHOLE)).collect();
        let assignments = |options: &[Vec<Cut>]| -> Vec<Vec<Cut>> {
            options.iter().fold(vec![vec![]], |acc, opts| {
                acc.iter()
                    .flat_map(|a| {
                        opts.iter().map(move |&o| {
                            let mut v = a.clone();
                            v.push(o);
                            v
                        })
                    })
                    .collect()
            })
        };
        let steps = assignments(&options);
        let mut best = f64::INFINITY;
        for first in &steps {
            for second in &steps {
                let cuts: Vec<Vec<Cut>> = (0..first.len())
                    .map(|l| vec![first[l], second[l]])
                    .collect();
                best = best.min(price_cuts(&g, &cuts, &costs).total());
            }
        }
        assert_eq!(found.cuts.total(), best);
    }

    /// §7.3: with reductions the search finds Tofu's plan; without ("ICML18 without output
    /// reduction") it can do no better, and sample splits alone ("AllRow") no better than either.
    /// RNN-4-8K's shape (batch 512, 8K hidden units, 8 workers) as dense layers.
    #[test]
    fn reductions_never_hurt_and_all_row_is_worst() {
        let machine = MachineModel::preset("paper:8").unwrap();
        let g = mlp(4, 8192, 512);
        let with = tofu_with(&g, &machine, true).native_bytes;
        let without = tofu_with(&g, &machine, false).native_bytes;
        let all_row = Tofu.native_bytes(&g, &machine, &crate::search::data_parallel(&g, &machine));
        assert!(
            with <= without && without <= all_row,
            "{with} {without} {all_row}"
        );
        // 8K×8K weights against 512×8K activations: sample splits move the weights, 8× larger
        assert!(without < all_row / 4.0);
    }
}
