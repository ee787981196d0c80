//! The invariant on a GPU: every strategy, run by GPU device actors (4 devices sharing one GPU, a
//! stream each), trains the same network as the single-device reference trainer on the CPU.
//! LeNet-5 at 28×28, AlexNet at 64×64 and Inception-v3 at 75×75, batch 8; data, model, OWT, the
//! optimised strategy, two random valid ones and one with reduction splits; 3 steps from one
//! initialisation. Skips, saying
//! why, where no GPU is usable (CI); `integration/gpu-check.sh` runs it on the lent GPU.
//!
//! Tolerance, as in `equivalence.rs`: each tensor within relative 1e-4, or within
//! `ROUNDING_FACTOR` times what f32 rounding of the initial weights alone moves it by, where the
//! network amplifies rounding (Inception's batch-norm stacks). cuDNN and cuBLAS sum in other
//! orders than the CPU kernels, which is rounding of exactly that kind.

mod support;

use legion_cuda::{ConvAlgos, Cuda, Math, Settings};
use legion_ops::train::{ParamStore, Sgd};
use legion_ops::{Graph, Precision};
use legion_planner::search::SearchKind;
use legion_runtime::{EmbeddedCluster, Placement};
use std::sync::Arc;
use support::bf16::Bf16Reference;
use support::*;

/// The GPU the devices share, or why there is none. Its convolutions use the `precise`
/// algorithms, whose results differ from the CPU's by the order of the sums alone: the
/// `fastest` ones are bounded against these in `ops/cuda/tests/gpu_training.rs`.
fn gpu() -> Result<Arc<Cuda>, String> {
    gpu_in(Math::StrictFp32)
}

/// [`gpu`] computing in `math`.
fn gpu_in(math: Math) -> Result<Arc<Cuda>, String> {
    legion_cuda::probe().map_err(|e| e.to_string())?;
    let settings = Settings {
        conv_algos: ConvAlgos::Precise,
        math,
        ..Settings::default()
    };
    Cuda::with_settings(0, settings)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// Every failure of every strategy, so that one run on a lent GPU reports them all.
/// Held-out scoring between two steps: the GPU devices' inference gives the CPU's logits from
/// the weights they hold.
fn check_inference(
    graph: &Graph,
    name: &str,
    cluster: &mut EmbeddedCluster,
    failures: &mut Vec<String>,
) {
    let (images, _) = batch(graph, 100);
    let scored = cluster
        .params()
        .map_err(|e| e.to_string())
        .and_then(|params| {
            let want =
                legion_ops::infer::logits(graph, &params, &images).map_err(|e| e.to_string())?;
            let got = cluster.logits(images.clone()).map_err(|e| e.to_string())?;
            Ok(relative_error(&got, &want))
        });
    match scored {
        Ok(err) if err <= TOLERANCE => {}
        Ok(err) => failures.push(format!(
            "{}/{name}: inference's logits differ from the CPU's by {err:e}",
            graph.name
        )),
        Err(e) => failures.push(format!("{}/{name}: inference: {e}", graph.name)),
    }
}

fn check(graph: &Graph, placement: &Placement, failures: &mut Vec<String>) {
    let strategies = [
        ("data", searched(graph, SearchKind::Data)),
        ("model", searched(graph, SearchKind::Model)),
        ("owt", searched(graph, SearchKind::Owt)),
        ("optcnn", searched(graph, SearchKind::OptCnn)),
        ("random-1", random(graph, 1)),
        ("random-2", random(graph, 2)),
        ("red-1", random_with_reductions(graph, 11)),
    ];
    let init = ParamStore::init(graph, 7);
    let (reference, losses) = reference_run(graph, &init);
    let Sensitivity {
        tensors: sensitivity,
        losses: loss_sensitivity,
    } = rounding_sensitivity(graph, &init, &reference, &losses);
    for (name, configs) in &strategies {
        let started = std::time::Instant::now();
        let state = legion_ops::train::TrainingState::start(init.clone());
        let cluster = EmbeddedCluster::launch_from(graph, configs, DEVICES, &state)
            .seed(11)
            .placement(placement)
            .inference(true)
            .start();
        let mut cluster = match cluster {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{}/{name}: start: {e}", graph.name));
                continue;
            }
        };
        let mut worst = 0f32;
        let mut ran = true;
        for step in 0..STEPS {
            let (images, labels) = batch(graph, step);
            match cluster.step(images, labels, false) {
                Ok(r) => {
                    if step == 0 {
                        check_inference(graph, name, &mut cluster, failures);
                    }
                    let want = losses[step as usize];
                    let err = (r.stats.loss - want).abs() / want.abs();
                    let tolerance =
                        TOLERANCE.max(ROUNDING_FACTOR * loss_sensitivity[step as usize]);
                    if err > tolerance {
                        failures.push(format!(
                            "{}/{name} step {step}: loss {} vs {want} on the CPU (relative \
                             tolerance {tolerance:e})",
                            graph.name, r.stats.loss
                        ));
                    }
                }
                Err(e) => {
                    failures.push(format!("{}/{name} step {step}: {e}", graph.name));
                    ran = false;
                    break;
                }
            }
        }
        if !ran {
            continue;
        }
        let trained = match cluster.params() {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("{}/{name}: reading the weights: {e}", graph.name));
                continue;
            }
        };
        for (slot, p) in reference.params.iter().enumerate() {
            let err = relative_error(&trained.values[slot], &reference.values[slot]);
            let tolerance = TOLERANCE.max(ROUNDING_FACTOR * sensitivity[slot]);
            worst = worst.max(err / tolerance);
            if err > tolerance {
                failures.push(format!(
                    "{}/{name}: {} differs by {err:e} (tolerance {tolerance:e}; rounding alone \
                     moves it {:e})",
                    graph.name, p.name, sensitivity[slot]
                ));
            }
        }
        println!(
            "{}/{name}: {STEPS} steps on {DEVICES} GPU devices in {:.1} s; worst tensor at \
             {worst:.3} of its tolerance",
            graph.name,
            started.elapsed().as_secs_f64()
        );
    }
}

#[test]
fn every_strategy_on_gpu_devices_trains_the_same_network_as_one_cpu_device() {
    let gpu = match gpu() {
        Ok(gpu) => gpu,
        Err(why) => {
            return legion_ops::require::skip(
                legion_ops::require::Need::Gpu,
                format!("no usable GPU: {why}"),
            );
        }
    };
    let placement = Placement::Gpus(vec![gpu]);
    let mut failures = Vec::new();
    for (name, image) in [("lenet5", 28), ("alexnet", 64), ("inception_v3", 75)] {
        check(&model(name, image), &placement, &mut failures);
    }
    // The ops added by ARCHITECTURE.md's recipe, and the blocks of MobileNetV2 and EfficientNet
    // (depthwise convolution, a channel-scale `mul`), through the CUDA backend too.
    check(&recipe_net(), &placement, &mut failures);
    check(&mobile_block_net(), &placement, &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The invariant in bf16 on a GPU: every strategy on 4 GPU devices sharing the GPU, computing in
/// bf16 (cuDNN and cuBLAS on bf16 operands, bf16 slices between the devices), against the
/// one-device trainer in bf16 on the CPU, within the tolerance `bf16_equivalence.rs` derives from
/// bf16 rounding (what perturbing the initial weights by half a bf16 ulp moves each update by,
/// times `ROUNDING_FACTOR`). Skips without a GPU, and on a GPU before compute capability 8.0
/// (no bf16 tensor cores: refused at start).
#[test]
fn every_strategy_on_gpu_devices_in_bf16_trains_the_same_network_as_one_device_in_bf16() {
    let gpu = match gpu_in(Math::Bf16) {
        Ok(gpu) => gpu,
        Err(why) => {
            return legion_ops::require::skip(
                legion_ops::require::Need::Gpu,
                format!("no GPU usable in bf16: {why}"),
            );
        }
    };
    let placement = Placement::Gpus(vec![gpu]);
    let mut failures = Vec::new();
    for graph in [model("lenet5", 28), model("alexnet", 64), recipe_net()] {
        let reference = Bf16Reference::train(&graph);
        let mut strategies = vec![
            ("data", searched(&graph, SearchKind::Data)),
            ("model", searched(&graph, SearchKind::Model)),
            ("owt", searched(&graph, SearchKind::Owt)),
            ("optcnn", searched(&graph, SearchKind::OptCnn)),
            ("random-1", random(&graph, 1)),
        ];
        strategies.extend(reduction_strategies(&graph).into_iter().take(2));
        for (name, configs) in &strategies {
            let state = legion_ops::train::TrainingState::start(reference.init.clone());
            let sgd = Sgd::default();
            let started = EmbeddedCluster::launch_from(&graph, configs, DEVICES, &state)
                .sgd(sgd)
                .seed(11)
                .placement(&placement)
                .precision(Precision::Bf16)
                .start();
            let mut cluster = match started {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{}/{name} in bf16: start: {e}", graph.name));
                    continue;
                }
            };
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let (images, labels) = batch(&graph, step);
                match cluster.step(images, labels, false) {
                    Ok(r) => losses.push(r.stats.loss),
                    Err(e) => {
                        failures.push(format!("{}/{name} in bf16 step {step}: {e}", graph.name));
                        break;
                    }
                }
            }
            if losses.len() < STEPS as usize {
                continue;
            }
            match cluster.params() {
                Ok(trained) => failures.extend(reference.check(name, &trained, &losses)),
                Err(e) => failures.push(format!("{}/{name} in bf16: weights: {e}", graph.name)),
            }
            println!(
                "{}/{name}: {STEPS} bf16 steps on {DEVICES} GPU devices",
                graph.name
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
