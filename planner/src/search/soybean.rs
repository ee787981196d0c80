//! SOYBEAN (Wang, Huang, Li: "Unifying data, model and hybrid parallelism in deep learning via
//! tensor tiling"): k binary cuts of every tensor, each cut chosen to minimise the bytes it moves.
//!
//! - Space: per cut, a conv or dense layer takes one of the three aligned forms of its matrix
//!   multiplication (Fig. 6): rows (our `n`), columns (our `c`) or the reduction (`red`, full-size
//!   partial sums); pooling, flatten, the input and the loss split samples only (§4.5 judges spatial
//!   splits dominated); element-wise layers take samples or channels.
//! - Cost: the elements a device must fetch to turn the tiling it holds into the one its form needs
//!   (Eq. 2, [`conversion`]), forward and backward, plus the weight gradients' reduction under a
//!   sample split (dW is `red` → `r`). A tensor's share at a cut is what one group needs of it after
//!   the cuts before (a replicated input stays whole, so model parallelism pays every cut).
//! - Search: Algorithm 1, KCuts: the best single cut of the whole graph (Eq. 3), exactly, by
//!   OptCNN's eliminations over ≤ 3 choices per layer (the paper's BFS-level DP finds the same
//!   optimum), then recursively on one group's half, `c_k = δ_k + 2·c_(k-1)` (Thm. 1).
//!
//! Lossy ([`LOSSY`]): the reduction form becomes our reduction split (in OptCNN's space a channel
//! split, or replication where channels run out); SOYBEAN tiles each tensor separately (an activation and its gradient, the forward and
//! backward multiplications may differ) where one config of ours fixes all; and its first cut is
//! the most significant device bit whatever it splits, where our tiles number n, c, h, w row-major.

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
use legion_ops::{Graph, LayerId};

/// What our configuration space loses of SOYBEAN's plans.
pub const LOSSY: &str = "SOYBEAN's reduction form (partial sums) maps to our reduction split \
     (with --paper-space, OptCNN's space, to a channel split, or replication where channels run \
     out); one config per layer fixes the tilings SOYBEAN chooses per tensor and per multiplication; its cut order is \
     not our n,c,h,w device order";

/// SOYBEAN's plan for `graph` on `machine`.
pub type SoybeanPlan = RecursivePlan;

/// Algorithm 1 with k = log2 of the machine's devices (rounded down to a power of two).
pub fn soybean(graph: &Graph, machine: &MachineModel) -> SoybeanPlan {
    soybean_with(graph, machine, false)
}

/// Algorithm 1, with `spatial` also letting convolutions halve their height or width (§4.5
/// judges those splits dominated; halos are priced as any halving).
pub fn soybean_with(graph: &Graph, machine: &MachineModel, spatial: bool) -> SoybeanPlan {
    let costs = SoybeanCosts { graph, spatial };
    recursive_plan(graph, machine, &costs)
}

/// SOYBEAN as a seed planner: [`soybean`], mapped into the space asked for.
pub struct Soybean;

impl SeedPlanner for Soybean {
    fn name(&self) -> &'static str {
        "soybean"
    }

    fn lossy(&self) -> &'static str {
        LOSSY
    }

    fn plan(&self, graph: &Graph, machine: &MachineModel, space: SearchSpace) -> SeedPlan {
        let plan = soybean(graph, machine);
        SeedPlan {
            configs: plan.configs_in(graph, space),
            native_bytes: plan.native_bytes,
        }
    }

    /// Each config read as its cuts in our device order (n, c, h, w; spatial cuts priced like
    /// any other halving).
    fn native_bytes(
        &self,
        graph: &Graph,
        machine: &MachineModel,
        configs: &[ParallelConfig],
    ) -> f64 {
        let cuts = cuts_of_configs(configs, cut_steps(machine));
        let costs = SoybeanCosts {
            graph,
            spatial: true,
        };
        4.0 * price_cuts(graph, &cuts, &costs).total()
    }
}

pub(crate) struct SoybeanCosts<'g> {
    pub(crate) graph: &'g Graph,
    /// Whether convolutions may also take spatial cuts.
    pub(crate) spatial: bool,
}

impl StepCosts for SoybeanCosts<'_> {
    fn choices(&self, layer: LayerId, split: &Split) -> Vec<Cut> {
        let l = self.graph.layer(layer);
        let wanted: &[Cut] = match LayerKind::of(l) {
            LayerKind::Weighted if self.spatial => &[Cut::N, Cut::C, Cut::Red, Cut::H, Cut::W],
            LayerKind::Weighted => &[Cut::N, Cut::C, Cut::Red],
            LayerKind::Elementwise => &[Cut::N, Cut::C],
            _ => &[Cut::N],
        };
        let inputs = self.graph.input_shapes(layer);
        let fits: Vec<Cut> = wanted
            .iter()
            .copied()
            .filter(|&c| split.admits(l, &inputs, c))
            .collect();
        if fits.is_empty() {
            vec![Cut::Replicate]
        } else {
            fits
        }
    }

    fn unary(&self, layer: LayerId, split: &Split, cut: Cut, _step: usize) -> f64 {
        // a split that leaves the weight whole on both halves leaves each a partial dW: reduce and
        // give both the sum (red → r, 2S) on the weight's share after the cuts before
        let weighted = LayerKind::of(self.graph.layer(layer)).is_weighted();
        match cut {
            Cut::N | Cut::H | Cut::W if weighted => {
                let share = weight_elements(self.graph, layer) / (split.c * split.red) as f64;
                conversion(Tiling::Partial, Tiling::Whole, share)
            }
            _ => 0.0,
        }
    }

    fn pair(&self, edge: &Edge, src: (&Split, Cut), dst: (&Split, Cut), _step: usize) -> f64 {
        let consumer = self.graph.layer(edge.dst);
        let kind = LayerKind::of(consumer);
        let x = self.graph.input_shapes(edge.dst)[edge.input];
        let (split, cut) = dst;
        // the share of its input one group of the consumer needs after the cuts before
        let parts = match kind {
            LayerKind::Weighted => split.n * split.h * split.w * split.red,
            _ => split.output_parts(),
        };
        let share = elements(&x) / parts as f64;
        let (needed, gradient) = input_tilings(kind, cut, x.ndim());
        let forward = conversion(output_tiling(src.1), needed, share);
        let backward = if edge.carries_gradient(self.graph) {
            conversion(gradient, output_gradient_tiling(src.1), share)
        } else {
            0.0
        };
        forward + backward
    }
}

/// Eq. 2: the elements one cut of `X · W = Z` moves, given the tilings of X, W and Z (held, and
/// wanted for Z), as the cheapest of the three aligned forms (Fig. 6): R × r = R, r × C = C, and
/// C × R = red (then reduced into Z's tiling). R is [`Tiling::Axis`] 0, C `Axis(1)`, r
/// [`Tiling::Whole`]; `sizes` are the elements of X, W and Z.
pub fn matmul_cost(x: Tiling, w: Tiling, z: Tiling, sizes: (f64, f64, f64)) -> f64 {
    let (sx, sw, sz) = sizes;
    let (rows, cols) = (Tiling::Axis(0), Tiling::Axis(1));
    [
        conversion(x, rows, sx) + conversion(w, Tiling::Whole, sw) + conversion(rows, z, sz),
        conversion(x, Tiling::Whole, sx) + conversion(w, cols, sw) + conversion(cols, z, sz),
        conversion(x, cols, sx) + conversion(w, rows, sw) + conversion(Tiling::Partial, z, sz),
    ]
    .into_iter()
    .fold(f64::INFINITY, f64::min)
}

/// §2.2's per-device estimate (bytes): `groups` groups of `per_group` devices, data parallel
/// between groups and model parallel inside: every device exchanges the parameters twice (collect,
/// then synchronise) with each other group, and each group's share of the activations twice
/// (forward and backward) with each member.
pub fn section_2_2_volume(params: f64, activations: f64, groups: usize, per_group: usize) -> f64 {
    let data = if groups > 1 {
        params * groups as f64 * 2.0
    } else {
        0.0
    };
    let model = if per_group > 1 {
        groups as f64 * (activations / groups as f64) * per_group as f64 * 2.0
    } else {
        0.0
    };
    data + model
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::tiling::tests::small_cnn;
    use legion_ops::op::Dense;
    use legion_ops::{GraphBuilder, Shape};

    /// §2.2's MLP: `layers` fully connected layers of `width` neurons, batch `batch`, no biases.
    pub(crate) fn mlp(layers: usize, width: usize, batch: usize) -> Graph {
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

    fn uniform(layers: usize, n: usize, c: usize) -> Vec<ParallelConfig> {
        (0..layers)
            .map(|_| ParallelConfig::new([n, c, 1, 1], 0))
            .collect()
    }

    /// Every dense layer split `c`, the input and the loss split `n` (they take no other).
    fn model_parallel(g: &Graph, degree: usize) -> Vec<ParallelConfig> {
        g.layers()
            .iter()
            .map(|l| match LayerKind::of(l) {
                LayerKind::Weighted => ParallelConfig::new([1, degree, 1, 1], 0),
                _ => ParallelConfig::new([degree, 1, 1, 1], 0),
            })
            .collect()
    }

    fn hybrid(g: &Graph, groups: usize, per_group: usize) -> Vec<ParallelConfig> {
        g.layers()
            .iter()
            .map(|l| match LayerKind::of(l) {
                LayerKind::Weighted => ParallelConfig::new([groups, per_group, 1, 1], 0),
                _ => ParallelConfig::new([groups * per_group, 1, 1, 1], 0),
            })
            .collect()
    }

    /// Fig. 7: (a) R × r = R is aligned and moves nothing; (b) C × r = R converts X from columns
    /// to rows (the "ghost area": each device fetches the quarter of X it lacks, |X|/2 for the
    /// pair), cheaper than the other forms (r × C = C fetches all of X and converts Z, C × R = red
    /// reduces Z, |Z|); with square 4×4 matrices that is 16/2 = 8 elements.
    #[test]
    fn figure_7_aligned_and_unaligned_multiplications() {
        let (r_, c_, whole) = (Tiling::Axis(0), Tiling::Axis(1), Tiling::Whole);
        let sizes = (16.0, 16.0, 16.0);
        assert_eq!(matmul_cost(r_, whole, r_, sizes), 0.0);
        assert_eq!(matmul_cost(c_, whole, r_, sizes), 8.0);
        // the other aligned forms are free when the tilings are theirs
        assert_eq!(matmul_cost(whole, c_, c_, sizes), 0.0);
        assert_eq!(matmul_cost(c_, r_, whole, sizes), 2.0 * 16.0);
    }

    /// §2.2, in the paper's words: parameters 300·300·5·4 B = 1.8 MB, activations 400·300·5·4 B =
    /// 2.4 MB; on 16 GPUs data parallelism moves 1.8·16·2 = 57.6 MB, model parallelism
    /// 2.4·16·2 = 76.8 MB, and 4 groups of 4 move 1.8·4·2 + 4·(2.4/4)·4·2 = 14.4 + 19.2 = 33.6 MB:
    /// 41.7% and 56.2% less.
    #[test]
    fn section_2_2_counts() {
        let (params, acts) = (300.0 * 300.0 * 5.0 * 4.0, 400.0 * 300.0 * 5.0 * 4.0);
        assert_eq!(params, 1.8e6);
        assert_eq!(acts, 2.4e6);
        let dp = section_2_2_volume(params, acts, 16, 1);
        let mp = section_2_2_volume(params, acts, 1, 16);
        let hybrid = section_2_2_volume(params, acts, 4, 4);
        assert!((dp - 57.6e6).abs() < 1.0);
        assert!((mp - 76.8e6).abs() < 1.0);
        assert!((hybrid - 33.6e6).abs() < 1.0);
        assert!((100.0 * (1.0 - hybrid / dp) - 41.7).abs() < 0.05);
        assert!((100.0 * (1.0 - hybrid / mp) - 56.2).abs() < 0.1);
    }

    /// §2.2's orderings under SOYBEAN's exact k-cut accounting on 16 devices (k = 4):
    /// - data parallelism: every cut reduces every dW (red → r, 2·|W|), never shrunk by sample
    ///   cuts, paid by 1 + 2 + 4 + 8 = 15 groups: 30·Σ|W| = 30·5·90 000 = 13.5 M elements;
    /// - model parallelism: each dense layer needs its whole input at every cut (C → r, S = |X| =
    ///   120 000) and sends partial input gradients back (red → C, S): 2·|X|·15 per layer, so
    ///   4 layers · 3.6 M + the first layer's input (forward only, 1.8 M) + the loss reading a
    ///   channel-split output by samples (C ↔ R both ways, S/2 each at S = |X|/2^(i-1), summed over
    ///   groups: 4·|X| = 0.48 M): 16.68 M elements: worse than data parallelism, as §2.2 says;
    /// - 4 groups of 4 (two sample cuts, then two channel cuts): the sample cuts reduce every dW
    ///   at full size, 5·2·90 000 = 0.9 M per group, in 1 + 2 groups: 2.7 M; at the channel cuts
    ///   each dense input share is |X|/4 = 30 000 (the first layer's forward only: S; the other
    ///   four S forward + S backward: 240 000) and the loss converts channel halves to sample halves
    ///   and back (S/2 + S/2 at its share, 30 000 then 15 000): 4·300 000 + 8·285 000 = 3.48 M;
    ///   6.18 M in all, below both;
    /// - swapping batch and width (batch 300, width 400) makes model parallelism the better one.
    #[test]
    fn section_2_2_orderings_hold_under_the_k_cut_cost() {
        let machine = MachineModel::preset("paper").unwrap();
        let g = mlp(5, 300, 400);
        let layers = g.layers().len();
        let dp = Soybean.native_bytes(&g, &machine, &uniform(layers, 16, 1)) / 4.0;
        let mp = Soybean.native_bytes(&g, &machine, &model_parallel(&g, 16)) / 4.0;
        let hy = Soybean.native_bytes(&g, &machine, &hybrid(&g, 4, 4)) / 4.0;
        assert_eq!(dp, 13.5e6);
        assert_eq!(mp, 4.0 * 3.6e6 + 1.8e6 + 0.48e6);
        assert_eq!(hy, 6.18e6);
        assert!(hy < dp && dp < mp, "hybrid {hy}, data {dp}, model {mp}");
        let found = soybean(&g, &machine);
        assert!(found.native_bytes / 4.0 <= hy + 1e-6);

        let swapped = mlp(5, 400, 300);
        let dp = Soybean.native_bytes(&swapped, &machine, &uniform(layers, 16, 1));
        let mp = Soybean.native_bytes(&swapped, &machine, &model_parallel(&swapped, 16));
        assert!(
            mp < dp,
            "model {mp} should beat data {dp} at batch 300, width 400"
        );
    }

    /// Thm. 1 on data parallelism: δ_i is the same 2·Σ|W| = 900 000 elements at every cut, and
    /// c_4 = Σ 2^(4-i)·δ_i = 15·δ = 2·(D - 1)·Σ|W| with D = 16. Thm. 3's commutativity: two sample
    /// cuts then two channel cuts cost what two channel cuts then two sample cuts cost.
    #[test]
    fn theorem_1_weighting_and_commuting_cuts() {
        let machine = MachineModel::preset("paper").unwrap();
        let g = mlp(5, 300, 400);
        let dp: Vec<Vec<Cut>> = vec![vec![Cut::N; 4]; g.layers().len()];
        let plan = price_cuts(
            &g,
            &dp,
            &SoybeanCosts {
                graph: &g,
                spatial: false,
            },
        );
        assert_eq!(plan.per_group, vec![900_000.0; 4]);
        assert_eq!(plan.total(), 2.0 * 15.0 * 450_000.0);
        let order = |first: Cut, second: Cut| -> f64 {
            let cuts: Vec<Vec<Cut>> = g
                .layers()
                .iter()
                .map(|l| match LayerKind::of(l) {
                    LayerKind::Weighted => vec![first, first, second, second],
                    _ => vec![Cut::N; 4],
                })
                .collect();
            price_cuts(
                &g,
                &cuts,
                &SoybeanCosts {
                    graph: &g,
                    spatial: false,
                },
            )
            .total()
        };
        assert_eq!(order(Cut::N, Cut::C), order(Cut::C, Cut::N));
        let _ = machine;
    }

    #[test]
    fn the_plan_prices_as_searched_and_is_no_worse_than_the_baselines() {
        let machine = MachineModel::preset("paper:8").unwrap();
        let g = small_cnn(16, 8, 8);
        let found = soybean(&g, &machine);
        let repriced = price_cuts(
            &g,
            &found.cuts.cuts,
            &SoybeanCosts {
                graph: &g,
                spatial: false,
            },
        )
        .total();
        assert_eq!(4.0 * repriced, found.native_bytes);
        let data = crate::search::data_parallel(&g, &machine);
        assert!(found.native_bytes <= Soybean.native_bytes(&g, &machine, &data) + 1e-6);
    }
}
