//! The invariant at the centre of the suite: any strategy trains the same network. Every strategy
//! (data, model, OWT, the optimised one, the SOYBEAN, Tofu, HyPar and Spartan planners' and random
//! valid ones) on 4 embedded devices, run through the device actors, gives the same weights after
//! 3 steps as the single-device reference trainer, with inference on the same devices (held-out
//! scoring) run between two steps: its logits are the CPU inference's from the devices' weights,
//! and the steps after it train on as if it had not run.
//!
//! Tolerance: each saved tensor within relative error 1e-4 (max |difference| over max |value|).
//! LeNet-5 and AlexNet meet it outright. Inception's batch-norm stacks at batch 8 amplify rounding:
//! perturbing the reference's own initial weights by 1e-7 (f32 rounding) moves some of its tensors
//! by percents after 3 steps (gradients of biases that feed 1×1 conv + batch norm are sums of
//! cancelling terms). No other summation order can beat that, so a tensor may also differ by
//! `ROUNDING_FACTOR` times what rounding alone does to it. Measured (reduced Inception at 32×32):
//! every strategy stays within 1.7× of that; a wrong gradient moves every tensor far more.

mod support;

use legion_ops::Graph;
use legion_ops::train::{ParamStore, Sgd};
use legion_planner::search::SearchKind;
use legion_planner::{ParallelConfig, SearchSpace};
use legion_runtime::EmbeddedCluster;
use support::*;

fn assert_same_training(graph: &Graph, strategies: &[(&str, Vec<ParallelConfig>)]) {
    let init = ParamStore::init(graph, 7);
    let sgd = Sgd::default();
    let (reference, losses) = reference_run(graph, &init);
    // A tensor may differ by 1e-4, or by a small multiple of what rounding alone does to it where
    // the network amplifies rounding (batch-norm biases whose gradients are sums of cancelling
    // terms). A real error moves every tensor by far more.
    let sensitivity = rounding_sensitivity(graph, &init, &reference, &losses);
    let tolerance: Vec<f32> = sensitivity
        .tensors
        .iter()
        .map(|s| TOLERANCE.max(ROUNDING_FACTOR * s))
        .collect();
    for (name, configs) in strategies {
        let mut cluster = EmbeddedCluster::launch(graph, configs, DEVICES, &init)
            .sgd(sgd)
            .seed(11)
            .inference(true)
            .start()
            .unwrap();
        for step in 0..STEPS {
            let (images, labels) = batch(graph, step);
            let stats = cluster.step(images, labels, false).unwrap().stats;
            let want = losses[step as usize];
            let tolerance = TOLERANCE.max(ROUNDING_FACTOR * sensitivity.losses[step as usize]);
            assert!(
                (stats.loss - want).abs() <= tolerance * want.abs(),
                "{}/{name} step {step}: loss {} vs {want} (relative tolerance {tolerance:e})",
                graph.name,
                stats.loss
            );
            if step == 0 {
                assert_inference_matches_the_cpu(graph, name, &mut cluster);
            }
        }
        let trained = cluster.params().unwrap();
        for (slot, p) in reference.params.iter().enumerate() {
            let err = relative_error(&trained.values[slot], &reference.values[slot]);
            assert!(
                err <= tolerance[slot],
                "{}/{name}: {} differs by {err:e} (tolerance {:e}; rounding alone moves it {:e})",
                graph.name,
                p.name,
                tolerance[slot],
                sensitivity.tensors[slot]
            );
        }
    }
}

/// Inference on the cluster's devices, twice (its runs numbered apart from the steps), gives the
/// logits the CPU's inference computes from the weights the devices hold.
fn assert_inference_matches_the_cpu(graph: &Graph, name: &str, cluster: &mut EmbeddedCluster) {
    let params = cluster.params().unwrap();
    for held_out in [100, 101] {
        let (images, _) = batch(graph, held_out);
        let want = legion_ops::infer::logits(graph, &params, &images).unwrap();
        let got = cluster.logits(images).unwrap();
        let err = relative_error(&got, &want);
        assert!(
            err <= TOLERANCE,
            "{}/{name}: inference's logits differ from the CPU's by {err:e}",
            graph.name
        );
    }
}

#[test]
fn lenet5_every_strategy_matches_one_device() {
    let g = model("lenet5", 28);
    assert_same_training(&g, &all_strategies(&g));
}

#[test]
fn alexnet_every_strategy_matches_one_device() {
    let g = model("alexnet", 64);
    assert_same_training(&g, &all_strategies(&g));
}

#[test]
fn inception_every_strategy_matches_one_device() {
    let g = model("inception_v3_reduced", 32);
    assert_same_training(&g, &all_strategies(&g));
}

#[test]
fn batch_norm_every_strategy_matches_one_device_at_1e4() {
    let g = small_bn_net();
    let init = ParamStore::init(&g, 7);
    let (reference, losses) = reference_run(&g, &init);
    let sensitivity = rounding_sensitivity(&g, &init, &reference, &losses);
    let worst = sensitivity.tensors.iter().fold(0f32, |m, &s| m.max(s));
    assert!(
        ROUNDING_FACTOR * worst < TOLERANCE,
        "this network should be well conditioned (rounding moves a tensor by {worst:e})"
    );
    assert_same_training(&g, &all_strategies(&g));
}

/// The recipe for adding an op (ARCHITECTURE.md, "How to add an op") as a test: every op of the
/// element-wise unary family (`recipe_net` takes them all from `Unary::ALL`), with no dispatcher
/// in the trainer, the lowering or the executor, trains the same network under every partition.
#[test]
fn an_op_added_by_the_recipe_trains_the_same_under_every_strategy() {
    let g = recipe_net();
    assert_same_training(&g, &all_strategies(&g));
}

/// Depthwise convolution, ReLU6, SiLU, LeakyReLU, the hard sigmoid, a squeeze-and-excitation
/// channel scale (whose gradient tiles split along H or W sum), a ceil_mode max pool and an
/// adaptive average pool of overlapping windows train the same network under every strategy.
#[test]
fn mobile_blocks_train_the_same_under_every_strategy() {
    let g = mobile_block_net();
    let mut strategies = all_strategies(&g);
    // every layer that can be split 2×2 over H and W is: the pools' windows cross tile edges,
    // the adaptive pool's overlapping where its tiles meet
    let spatial = g
        .layers()
        .iter()
        .map(|l| {
            let four_way = ParallelConfig::new([1, 1, 2, 2], 0);
            let space = legion_planner::ConfigSpace::enumerate(
                &l.shape,
                l.op.spec().parallel_dims(&l.shape),
                DEVICES,
            );
            if space.configs().contains(&four_way) {
                four_way
            } else {
                ParallelConfig::serial(0)
            }
        })
        .collect::<Vec<_>>();
    for pool in ["pool", "adaptive"] {
        let at = g.find(pool).unwrap().0;
        assert_eq!(spatial[at].degrees(), [1, 1, 2, 2], "{pool} is split 2×2");
    }
    strategies.push(("h x w", spatial));
    assert_same_training(&g, &strategies);
}

/// Reduction splits (partial sums over input channels, summed before the activation) on conv2d
/// and dense layers, with and without batch norm after them: the same network as one device.
/// Random ones, and the seed planners' where they map a reduction cut onto ours (the space with
/// reduction splits).
#[test]
fn reduction_splits_train_the_same_network() {
    let mut seeds_with_reductions = 0;
    for graph in [model("lenet5", 28), model("alexnet", 64), small_bn_net()] {
        let mut strategies = reduction_strategies(&graph);
        for (name, kind) in [
            ("soybean", SearchKind::Soybean),
            ("tofu", SearchKind::Tofu),
            ("hypar", SearchKind::Hypar),
            ("spartan", SearchKind::Spartan),
        ] {
            let configs = searched_in(&graph, kind, SearchSpace::WithReductions);
            if configs.iter().any(|c| c.reduction() > 1) {
                seeds_with_reductions += 1;
                strategies.push((name, configs));
            }
        }
        assert_same_training(&graph, &strategies);
    }
    assert!(
        seeds_with_reductions > 0,
        "no seed planner mapped a reduction cut onto a reduction split"
    );
}

#[test]
fn inception_with_reduction_splits_matches_one_device() {
    let g = model("inception_v3_reduced", 32);
    assert_same_training(&g, &reduction_strategies(&g));
}
