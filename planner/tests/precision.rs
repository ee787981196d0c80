//! What the planner prices in bf16 against fp32, on the same strategies: the activations and
//! gradients moved between devices (t_x, and a reduction split's partial sums, t_r) are exactly
//! half the bytes, the parameter synchronisation (t_s: fp32 gradients and weights) the same, and
//! the simulator moves what Eq. 1 counts in either precision.

mod support;

use legion_ops::{Dim, Graph, Op, Precision};
use legion_planner::search::{data_parallel, model_parallel, one_weird_trick};
use legion_planner::simulate::{TaskKind, simulate};
use legion_planner::{CostModel, MachineModel, ParallelConfig, RooflineCost};

/// Data, model and OWT parallelism, and samples over half the devices with every conv2d and dense
/// layer split into 2 partial sums (so that t_r moves something).
fn strategies(g: &Graph, machine: &MachineModel) -> Vec<(&'static str, Vec<ParallelConfig>)> {
    let n = machine.num_devices();
    let reductions = g
        .layers()
        .iter()
        .map(|l| match l.op {
            Op::Conv2d(_) | Op::Dense(_) => {
                ParallelConfig::split(Dim::N, n / 2, 0).with_reduction(2)
            }
            _ => ParallelConfig::split(Dim::N, n, 0),
        })
        .collect();
    vec![
        ("data", data_parallel(g, machine)),
        ("model", model_parallel(g, machine)),
        ("owt", one_weird_trick(g, machine)),
        ("reductions", reductions),
    ]
}

#[test]
fn bf16_moves_half_the_activation_bytes_and_the_same_sync_bytes() {
    let models = [
        ("lenet5", None),
        ("alexnet", Some(67)),
        ("vgg16", Some(32)),
        ("inception_v3", Some(75)),
        ("resnet50", Some(32)),
    ];
    for machine_name in ["paper:4", "paper-pairs:8", "dgx-h100:16", "local-cpu:4"] {
        let fp32 = MachineModel::preset(machine_name).unwrap();
        let bf16 = fp32.clone().with_precision(Precision::Bf16);
        let (fp32_cost, bf16_cost) = (RooflineCost::new(&fp32), RooflineCost::new(&bf16));
        for (name, image) in models {
            let g = support::zoo_at(name, 4 * fp32.num_devices(), image);
            let full = CostModel::new(&g, &fp32, &fp32_cost);
            let half = CostModel::new(&g, &bf16, &bf16_cost);
            for (strategy, configs) in strategies(&g, &fp32) {
                let at = format!("{name} {strategy} on {machine_name}");
                let (a, b) = (full.evaluate(&configs), half.evaluate(&configs));
                for (e, (x, y)) in a.edges.iter().zip(&b.edges).enumerate() {
                    assert_eq!(x.bytes, 2 * y.bytes, "{at}: edge {e}");
                    assert!(y.time <= x.time, "{at}: edge {e}");
                    assert_eq!(x.bytes > 0, y.time < x.time, "{at}: edge {e}");
                }
                for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
                    assert_eq!(x.sync_bytes, y.sync_bytes, "{at}: layer {l}");
                    assert_eq!(x.sync, y.sync, "{at}: layer {l}");
                    assert_eq!(x.reduce_bytes, 2 * y.reduce_bytes, "{at}: layer {l}");
                }
                assert_eq!(a.activation_bytes, 2 * b.activation_bytes, "{at}");
                assert_eq!(a.sync_bytes, b.sync_bytes, "{at}");
                assert_eq!(b.comm_bytes, b.activation_bytes + b.sync_bytes, "{at}");
                // every strategy but data parallelism moves activations; data parallelism
                // syncs every parameter
                assert_eq!(strategy != "data", a.activation_bytes > 0, "{at}");
                assert!(strategy != "data" || a.sync_bytes > 0, "{at}");
            }
        }
    }
}

/// The simulated step's copies carry what Eq. 1 counts in bf16 too: activations at 2 bytes,
/// parameter sync at 4.
#[test]
fn the_simulator_moves_what_eq1_counts_in_bf16() {
    let machine = MachineModel::preset("paper:4")
        .unwrap()
        .with_precision(Precision::Bf16);
    let provider = RooflineCost::new(&machine);
    for (name, image) in [("lenet5", None), ("alexnet", Some(67))] {
        let g = support::zoo_at(name, 16, image);
        let model = CostModel::new(&g, &machine, &provider);
        for (strategy, configs) in strategies(&g, &machine) {
            let cost = model.evaluate(&configs);
            let sim = simulate(&model, &configs);
            let moved: u64 = sim.tasks.iter().map(|t| t.bytes).sum();
            let synced: u64 = sim
                .tasks
                .iter()
                .filter(|t| t.kind == TaskKind::Sync)
                .map(|t| t.bytes)
                .sum();
            assert_eq!(moved, cost.comm_bytes, "{name} {strategy}");
            assert_eq!(synced, cost.sync_bytes, "{name} {strategy}");
        }
    }
}

/// fp32 and tf32 store the same elements: every byte count is equal; tf32 only computes faster on
/// a GPU.
#[test]
fn tf32_moves_what_fp32_moves() {
    let fp32 = MachineModel::preset("dgx-h100:16").unwrap();
    let tf32 = fp32.clone().with_precision(Precision::Tf32);
    let (p, q) = (RooflineCost::new(&fp32), RooflineCost::new(&tf32));
    let g = support::zoo_at("alexnet", 64, Some(67));
    for (strategy, configs) in strategies(&g, &fp32) {
        let a = CostModel::new(&g, &fp32, &p).evaluate(&configs);
        let b = CostModel::new(&g, &tf32, &q).evaluate(&configs);
        assert_eq!(a.edges, b.edges, "{strategy}");
        assert_eq!(a.comm_bytes, b.comm_bytes, "{strategy}");
        assert!(b.total < a.total, "{strategy}");
    }
}
