//! HyPar (Song, Mao, Li, Chen: "HyPar: towards hybrid parallelism for deep learning accelerator
//! array", HPCA '19): data or model parallelism per weighted layer per binary level.
//!
//! - Space: at each of H levels (2^H accelerators) every weighted layer takes dp (split the batch,
//!   replicate the kernel: our `n`) or mp (split the kernel on its input channels; the output is
//!   summed from the two partial outputs, so both halves hold all of it). Pooling, activations and
//!   the other layers without weights are folded in: they keep their producer's layout, or take the
//!   whole tensor after an mp layer (where it already is whole), so conversions fall on them.
//! - Cost (§3): elements one group pulls from the other, both groups counted (§3.4's totals):
//!   intra-layer dp pulls the other half's dW (|W|), mp the other half's partial output
//!   (A(F_(l+1))); between layers dp→dp moves nothing, dp→mp .25·A(F) + .25·A(E), mp→mp and mp→dp
//!   .5·A(E), with A the group's share of the tensor between them. At level h a layer's tensors
//!   are its group's share after the levels above: dp halves the batch, mp the input channels and
//!   the kernel (its output stays whole).
//! - Search: Algorithm 1, the two-choice DP along the layers (here OptCNN's eliminations, which
//!   are that DP on a chain and exact on fork-joins), and Algorithm 2, level by level from the
//!   top, com(H) = com_top + 2·com(H - 1).
//!
//! Lossy ([`LOSSY`]): mp's input-channel split maps to our reduction split (in OptCNN's space to
//! our output-channel split, or replication where channels run out); layers without weights that
//! follow an mp layer, whole in HyPar, take a channel split too where they can, to stay aligned
//! with it; topology is ignored, as in the paper.

use super::seed::{SeedPlan, SeedPlanner};
use super::tiling::{
    Cut, CutPlan, LayerKind, Split, StepCosts, configs_of_splits, cut_steps, cuts_of_configs,
    elements, price_cuts, recursive_cuts, weight_elements,
};
use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use crate::tables::SearchSpace;
use crate::transfer::Edge;
use legion_ops::{Graph, LayerId, Op};

/// What our configuration space loses of HyPar's plans.
pub const LOSSY: &str = "HyPar's model parallelism (kernel split on input channels, output \
     summed) maps to our reduction split (with --paper-space, OptCNN's space, to an \
     output-channel split, or replication where channels run out); layers without weights after it split channels instead of \
     holding the whole tensor";

/// HyPar's plan for `graph` on `machine`.
#[derive(Clone, Debug, PartialEq)]
pub struct HyparPlan {
    /// By layer id, in our space.
    pub configs: Vec<ParallelConfig>,
    /// Per layer and level, dp ([`Cut::N`]) or mp ([`Cut::Red`]); layers without weights
    /// [`Cut::N`] or whole ([`Cut::Replicate`]); each level's com per group.
    pub levels: CutPlan,
    /// Bytes under HyPar's accounting.
    pub native_bytes: f64,
}

/// Algorithm 2 with H = log2 of the machine's devices (rounded down to a power of two).
pub fn hypar(graph: &Graph, machine: &MachineModel) -> HyparPlan {
    let levels = recursive_cuts(graph, cut_steps(machine), &HyparCosts { graph });
    HyparPlan {
        configs: hypar_configs(graph, &levels),
        native_bytes: 4.0 * levels.total(),
        levels,
    }
}

/// HyPar as a seed planner: [`hypar`], mapped into the space asked for.
pub struct Hypar;

impl SeedPlanner for Hypar {
    fn name(&self) -> &'static str {
        "hypar"
    }

    fn lossy(&self) -> &'static str {
        LOSSY
    }

    fn plan(&self, graph: &Graph, machine: &MachineModel, space: SearchSpace) -> SeedPlan {
        let plan = hypar(graph, machine);
        SeedPlan {
            configs: plan.configs_in(graph, space),
            native_bytes: plan.native_bytes,
        }
    }

    /// A weighted layer's channel cuts read as mp, its other cuts as dp; a layer without weights
    /// split by channels reads as whole.
    fn native_bytes(
        &self,
        graph: &Graph,
        machine: &MachineModel,
        configs: &[ParallelConfig],
    ) -> f64 {
        let cuts: Vec<Vec<Cut>> = cuts_of_configs(configs, cut_steps(machine))
            .into_iter()
            .zip(graph.layers())
            .map(|(cuts, layer)| {
                let weighted = LayerKind::of(layer).is_weighted();
                cuts.into_iter()
                    .map(|c| match (c, weighted) {
                        (Cut::C, true) => Cut::Red,
                        (Cut::C, false) => Cut::Replicate,
                        (Cut::H | Cut::W, _) => Cut::N,
                        (other, _) => other,
                    })
                    .collect()
            })
            .collect();
        4.0 * price_cuts(graph, &cuts, &HyparCosts { graph }).total()
    }
}

impl HyparPlan {
    /// Our configs for the plan in `space`: mp maps to a reduction split where the space has
    /// them, else to an output-channel split ([`Split::to_config_in`]).
    pub fn configs_in(&self, graph: &Graph, space: SearchSpace) -> Vec<ParallelConfig> {
        configs_of_splits(graph, &hypar_splits(graph, &self.levels), space)
    }
}

/// Our configs in OptCNN's space: weighted layers through [`Split::to_config`] (mp → channels).
fn hypar_configs(graph: &Graph, levels: &CutPlan) -> Vec<ParallelConfig> {
    configs_of_splits(graph, &hypar_splits(graph, levels), SearchSpace::Paper)
}

/// Each layer's split: its levels' cuts, where a layer without weights turns its whole levels
/// into channel splits where they fit.
fn hypar_splits(graph: &Graph, levels: &CutPlan) -> Vec<Split> {
    graph
        .ids()
        .map(|id| {
            let layer = graph.layer(id);
            let inputs = graph.input_shapes(id);
            let weighted = LayerKind::of(layer).is_weighted();
            levels.cuts[id.0].iter().fold(Split::WHOLE, |s, &c| {
                if c == Cut::Replicate && !weighted && s.admits(layer, &inputs, Cut::C) {
                    s.after(Cut::C)
                } else {
                    s.after(c)
                }
            })
        })
        .collect()
}

pub(crate) struct HyparCosts<'g> {
    pub(crate) graph: &'g Graph,
}

/// A layout at one level: split by samples, or whole on both halves (after mp).
fn is_whole(cut: Cut) -> bool {
    matches!(cut, Cut::Red | Cut::Replicate)
}

impl StepCosts for HyparCosts<'_> {
    fn choices(&self, layer: LayerId, split: &Split) -> Vec<Cut> {
        let l = self.graph.layer(layer);
        let inputs = self.graph.input_shapes(layer);
        let wanted: &[Cut] = match LayerKind::of(l) {
            LayerKind::Weighted => &[Cut::N, Cut::Red],
            // the data arrives split by samples
            LayerKind::Input => &[Cut::N],
            _ => &[Cut::N, Cut::Replicate],
        };
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
        let l = self.graph.layer(layer);
        if !LayerKind::of(l).is_weighted() {
            return 0.0;
        }
        // both groups pull the other's share: 2·A
        match cut {
            Cut::N => 2.0 * weight_elements(self.graph, layer) / split.red as f64,
            Cut::Red => 2.0 * elements(&l.shape) / split.n as f64,
            _ => 0.0,
        }
    }

    fn pair(&self, edge: &Edge, src: (&Split, Cut), dst: (&Split, Cut), _step: usize) -> f64 {
        // HyPar prices layers from the first weighted one on: the data needs no error back
        if matches!(self.graph.layer(edge.src).op, Op::Input(_)) {
            return 0.0;
        }
        let kind = LayerKind::of(self.graph.layer(edge.dst));
        let x = self.graph.input_shapes(edge.dst)[edge.input];
        let (split, cut) = dst;
        let parts = if kind.is_weighted() {
            split.n * split.red
        } else {
            split.n
        };
        let a = elements(&x) / parts as f64;
        let (from_whole, to_whole) = (is_whole(src.1), is_whole(cut));
        // per group: dp→mp .25·A(F) + .25·A(E); mp→mp, mp→dp .5·A(E); both groups: A. A layer
        // without weights passes a whole tensor on unchanged.
        let mismatch = match (from_whole, to_whole) {
            (false, false) => false,
            (true, true) => kind.is_weighted(),
            _ => true,
        };
        if mismatch { a } else { 0.0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::op::{Conv2d, Dense, Pool2d};
    use legion_ops::{GraphBuilder, Shape};

    fn single_dense(batch: usize, inputs: usize, outputs: usize) -> Graph {
        let mut b = GraphBuilder::new("fc");
        let x = b.input("x", Shape::nc(batch, inputs)).unwrap();
        let y = b.dense("fc", x, Dense::new(outputs).no_bias()).unwrap();
        b.softmax_cross_entropy("loss", y).unwrap();
        b.finish()
    }

    /// dp on every layer, or mp on the weighted ones with the rest whole (on device 0).
    fn uniform(g: &Graph, devices: usize, mp: bool) -> Vec<ParallelConfig> {
        g.layers()
            .iter()
            .map(|l| match (LayerKind::of(l), mp) {
                (_, false) | (LayerKind::Input, true) => ParallelConfig::new([devices, 1, 1, 1], 0),
                (LayerKind::Weighted, true) => ParallelConfig::new([1, devices, 1, 1], 0),
                (_, true) => ParallelConfig::serial(0),
            })
            .collect()
    }

    /// §3.4, two accelerators, batch 32: a 70 → 100 fully connected layer moves
    /// 2·70·100·4 B = 56 KB under dp (each pulls the other's partial dW) and 2·32·100·4 B =
    /// 25.6 KB under mp (each pulls the other's partial output): mp wins, and HyPar picks it.
    #[test]
    fn section_3_4_fully_connected() {
        let machine = MachineModel::preset("paper:2").unwrap();
        let g = single_dense(32, 70, 100);
        assert_eq!(
            Hypar.native_bytes(&g, &machine, &uniform(&g, 2, false)),
            56_000.0
        );
        assert_eq!(
            Hypar.native_bytes(&g, &machine, &uniform(&g, 2, true)),
            25_600.0
        );
        let found = hypar(&g, &machine);
        assert_eq!(found.levels.cuts[g.find("fc").unwrap().0], vec![Cut::Red]);
        assert_eq!(found.native_bytes, 25_600.0);
    }

    /// §3.4: a conv with F_l 12×12×20, W 5×5×20×50, F_(l+1) 8×8×50 at batch 32 moves
    /// 2·5·5·20·50·4 B = 200 KB under dp and 2·32·8·8·50·4 B = 819.2 KB under mp: dp wins.
    #[test]
    fn section_3_4_convolution() {
        let machine = MachineModel::preset("paper:2").unwrap();
        let mut b = GraphBuilder::new("conv");
        let x = b.input("x", Shape::nchw(32, 20, 12, 12)).unwrap();
        let y = b.conv2d("conv", x, Conv2d::new(50, 5).no_bias()).unwrap();
        let f = b.flatten("f", y).unwrap();
        b.softmax_cross_entropy("loss", f).unwrap();
        let g = b.finish();
        assert_eq!(
            Hypar.native_bytes(&g, &machine, &uniform(&g, 2, false)),
            200_000.0
        );
        assert_eq!(
            Hypar.native_bytes(&g, &machine, &uniform(&g, 2, true)),
            819_200.0
        );
        let found = hypar(&g, &machine);
        assert_eq!(found.levels.cuts[g.find("conv").unwrap().0], vec![Cut::N]);
        assert_eq!(found.native_bytes, 200_000.0);
    }

    /// Table 3's SCONV (20@5×5, 50@5×5 + 2×2 max pool, 50@5×5, 10@5×5 + 2×2 max pool) on MNIST at
    /// batch 256 over 16 accelerators: Fig. 5(b) has dp for every layer at every level, and §6.2
    /// "HyPar performs the same as Data Parallelism".
    #[test]
    fn sconv_is_data_parallel_at_every_level() {
        let machine = MachineModel::preset("paper").unwrap();
        let mut b = GraphBuilder::new("sconv");
        let x = b.input("x", Shape::nchw(256, 1, 28, 28)).unwrap();
        let c1 = b.conv2d("conv1", x, Conv2d::new(20, 5)).unwrap();
        let c2 = b.conv2d("conv2", c1, Conv2d::new(50, 5)).unwrap();
        let p2 = b.pool2d("pool2", c2, Pool2d::max(2)).unwrap();
        let c3 = b.conv2d("conv3", p2, Conv2d::new(50, 5)).unwrap();
        let c4 = b.conv2d("conv4", c3, Conv2d::new(10, 5)).unwrap();
        let p4 = b.pool2d("pool4", c4, Pool2d::max(2)).unwrap();
        let f = b.flatten("f", p4).unwrap();
        b.softmax_cross_entropy("loss", f).unwrap();
        let g = b.finish();
        let found = hypar(&g, &machine);
        for name in ["conv1", "conv2", "conv3", "conv4"] {
            assert_eq!(
                found.levels.cuts[g.find(name).unwrap().0],
                vec![Cut::N; 4],
                "{name}"
            );
        }
        let dp = Hypar.native_bytes(&g, &machine, &uniform(&g, 16, false));
        assert_eq!(found.native_bytes, dp);
    }

    /// Table 3's SFC (784-8192-8192-8192-10) at batch 256 over 16 accelerators: communication
    /// ranks HyPar below model parallelism below data parallelism (Fig. 8's SFC bars, §6.2), and
    /// HyPar is not pure mp (Fig. 5(a) has a dp level among the fully connected layers).
    #[test]
    fn sfc_ranks_hypar_below_mp_below_dp() {
        let machine = MachineModel::preset("paper").unwrap();
        let mut b = GraphBuilder::new("sfc");
        let mut x = b.input("x", Shape::nc(256, 784)).unwrap();
        for (i, width) in [8192, 8192, 8192, 10].into_iter().enumerate() {
            x = b
                .dense(&format!("fc{}", i + 1), x, Dense::new(width))
                .unwrap();
        }
        b.softmax_cross_entropy("loss", x).unwrap();
        let g = b.finish();
        let found = hypar(&g, &machine);
        let dp = Hypar.native_bytes(&g, &machine, &uniform(&g, 16, false));
        let mp = Hypar.native_bytes(&g, &machine, &uniform(&g, 16, true));
        assert!(
            found.native_bytes <= mp && mp < dp,
            "{} {mp} {dp}",
            found.native_bytes
        );
        let weighted: Vec<&Vec<Cut>> = g
            .ids()
            .filter(|&id| LayerKind::of(g.layer(id)).is_weighted())
            .map(|id| &found.levels.cuts[id.0])
            .collect();
        assert!(weighted.iter().any(|c| c.contains(&Cut::N)), "{weighted:?}");
    }

    /// §6.2 on Fig. 5: "for most networks, especially large-scale networks, such as AlexNet and
    /// VGGs, in the convolutional layers, the parallelisms are usually data parallelism, and in
    /// fully-connected layers ... model parallelism". AlexNet and VGG-16 (VGG-D) at batch 256 on
    /// 16 accelerators: every conv dp and every dense layer mp at all four levels.
    #[test]
    fn alexnet_and_vgg_convolutions_dp_dense_layers_mp() {
        let machine = MachineModel::preset("paper").unwrap();
        for name in ["alexnet", "vgg16"] {
            let z = legion_ops::zoo::find(name).unwrap();
            let g = z.build(&z.default_config(256)).unwrap();
            let found = hypar(&g, &machine);
            for (layer, cuts) in g.layers().iter().zip(&found.levels.cuts) {
                match layer.op {
                    Op::Conv2d(_) => assert_eq!(cuts, &vec![Cut::N; 4], "{name} {}", layer.name),
                    Op::Dense(_) => assert_eq!(cuts, &vec![Cut::Red; 4], "{name} {}", layer.name),
                    _ => {}
                }
            }
        }
    }

    /// §6.5.2, VGG-E's conv5 (512 → 512 channels, 3×3, 14×14 output) at batch 32:
    /// A(ΔW) = 512·512·3² = 2 359 296 and A(F_(l+1)) = 32·512·14·14 = 3 211 264. Its fc3
    /// (4096 → 1000) at batch 4096: A(ΔW) = A(F_(l+1)) = 4 096 000, a tie that the inter-layer
    /// cost breaks: after a dp layer, dp-dp moves nothing while dp-mp does, "so we should choose
    /// data parallelism for that layer" (the Trick chose mp).
    #[test]
    fn section_6_5_2_vgg_e_conv5_and_fc3() {
        let costs_of = |g: &Graph, name: &str| {
            let costs = HyparCosts { graph: g };
            let id = g.find(name).unwrap();
            // one group's pull: half of the two-way count
            (
                costs.unary(id, &Split::WHOLE, Cut::N, 0) / 2.0,
                costs.unary(id, &Split::WHOLE, Cut::Red, 0) / 2.0,
            )
        };
        let mut b = GraphBuilder::new("conv5");
        let x = b.input("x", Shape::nchw(32, 512, 14, 14)).unwrap();
        let c = b
            .conv2d("conv5", x, Conv2d::new(512, 3).padding(1).no_bias())
            .unwrap();
        let f = b.flatten("f", c).unwrap();
        b.softmax_cross_entropy("loss", f).unwrap();
        let conv5 = b.finish();
        assert_eq!(costs_of(&conv5, "conv5"), (2_359_296.0, 3_211_264.0));

        // a dp-bound producer (a small conv over a large batch) before fc3
        let mut b = GraphBuilder::new("fc3");
        let x = b.input("x", Shape::nchw(4096, 16, 16, 16)).unwrap();
        let c = b
            .conv2d("conv", x, Conv2d::new(16, 3).padding(1).no_bias())
            .unwrap();
        let f = b.flatten("f", c).unwrap();
        let y = b.dense("fc3", f, Dense::new(1000).no_bias()).unwrap();
        b.softmax_cross_entropy("loss", y).unwrap();
        let fc3 = b.finish();
        assert_eq!(costs_of(&fc3, "fc3"), (4_096_000.0, 4_096_000.0));
        let machine = MachineModel::preset("paper:2").unwrap();
        let found = hypar(&fc3, &machine);
        assert_eq!(found.levels.cuts[fc3.find("conv").unwrap().0], vec![Cut::N]);
        assert_eq!(found.levels.cuts[fc3.find("fc3").unwrap().0], vec![Cut::N]);
    }
}
