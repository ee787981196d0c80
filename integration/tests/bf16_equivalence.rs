//! The invariant in bf16: every strategy on 4 embedded devices, computing in bf16 (activations,
//! their gradients, partial sums and the weights' working copies stored in bf16; masters,
//! momentum, weight gradients and the update in fp32), trains the same network as the one-device
//! trainer in bf16, on the CPU backend (which stores bf16 where a GPU does). 3 steps of LeNet-5,
//! AlexNet at 64×64, the recipe net and the batch-norm net, batch 8; every strategy family plus
//! random reduction splits.
//!
//! Tolerance, derived from bf16 rounding: a strategy stores some values in bf16 where one device
//! keeps them in f32 or rounds them at another point (a model-parallel layer's input gradient is
//! a sum of per-device contributions, each rounded; a reduction split rounds each partial sum;
//! each device's conv weight gradient is rounded to bf16 before the f32 sum, as cuDNN writes it),
//! which perturbs the network at the level of one bf16 rounding, half an ulp (2^-9, relative).
//! So each tensor's *update* (trained − initial) may differ from the reference's by
//! `ROUNDING_FACTOR` times what perturbing every initial weight by up to 2^-9 moves it by, and
//! each step's loss by that factor times the most the perturbation moves any step's loss.
//! Updates, not weights: a weight is mostly its initial value, which every run shares, so a
//! weight-relative bound would hide a wrong update. Measured (2026-11-28): every strategy stays
//! within 0.44 of the update tolerance and 0.16 of the loss tolerance; the perturbation itself
//! moves the updates by up to 23% (LeNet-5), 38% (AlexNet), 0.6% (recipe net) and 224% (the
//! batch-norm net at batch 8, whose bf16 gradients are little more than rounding). The test also
//! checks that the bound is not vacuous: training on rotated labels (a wrong gradient) must break
//! it on some tensor of every model.

mod support;

use legion_ops::train::Sgd;
use legion_ops::{Graph, Precision};
use legion_planner::ParallelConfig;
use legion_runtime::EmbeddedCluster;
use support::bf16::Bf16Reference;
use support::*;

fn assert_same_training_in_bf16(graph: &Graph, strategies: &[(&str, Vec<ParallelConfig>)]) {
    let reference = Bf16Reference::train(graph);
    for (name, configs) in strategies {
        let (sgd, init) = (Sgd::default(), &reference.init);
        let mut cluster = EmbeddedCluster::launch(graph, configs, DEVICES, init)
            .sgd(sgd)
            .seed(11)
            .precision(Precision::Bf16)
            .start()
            .unwrap();
        let losses: Vec<f32> = (0..STEPS)
            .map(|step| {
                let (images, labels) = batch(graph, step);
                cluster.step(images, labels, false).unwrap().stats.loss
            })
            .collect();
        let failures = reference.check(name, &cluster.params().unwrap(), &losses);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

fn every_strategy(graph: &Graph) -> Vec<(&'static str, Vec<ParallelConfig>)> {
    let mut out = all_strategies(graph);
    out.extend(reduction_strategies(graph));
    out
}

#[test]
fn bf16_every_strategy_matches_one_device_lenet5_and_alexnet() {
    for g in [model("lenet5", 28), model("alexnet", 64)] {
        assert_same_training_in_bf16(&g, &every_strategy(&g));
    }
}

#[test]
fn bf16_every_strategy_matches_one_device_recipe_and_batch_norm_nets() {
    for g in [recipe_net(), small_bn_net()] {
        assert_same_training_in_bf16(&g, &every_strategy(&g));
    }
}
