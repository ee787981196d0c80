//! Predicted vs measured step time on the embedded cluster.
//!
//! For each model: profile the strategies on 4 embedded devices (`legion_runtime::profile`), then for
//! each strategy compare the mean wall-clock time of real steps with the planner's simulated step
//! time, priced by `ProfiledCost` over that profile and the measured links. Run with
//! `cargo bench -p legion-cluster --bench predicted_vs_measured`; the table is in BENCHMARKS.md.
//!
//! Environment: `LEGION_PVM_MODELS=alexnet,lenet5` picks the models (both by default);
//! `LEGION_PVM_TRACES=DIR` also writes, per model and strategy, a Chrome trace of one real step
//! (`MODEL-STRATEGY-real.json`, after the measured ones) and of the simulated step
//! (`MODEL-STRATEGY-sim.json`), to compare task by task.

use legion_cluster::cli::load_model;
use legion_cluster::job::{choose_strategy, embedded_machine};
use legion_ops::train::{ParamStore, Sgd};
use legion_planner::simulate::simulate;
use legion_planner::{CostModel, ProfiledCost};
use legion_runtime::embedded::EmbeddedCluster;
use legion_runtime::profile::{self, ProfileSettings};
use std::path::PathBuf;

const DEVICES: usize = 4;
const STRATEGIES: [&str; 3] = ["data", "owt", "optcnn"];
const WARMUP: usize = 3;
const STEPS: usize = 10;
const SEED: u64 = 1;

fn main() -> anyhow::Result<()> {
    // The compute pool is sized to the cores (rayon's default).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{DEVICES} embedded devices on {cores} core(s); measured = mean of {STEPS} steps after \
         {WARMUP} warm-up steps"
    );
    println!(
        "{:<22} {:<8} {:>12} {:>13} {:>8} {:>10} {:>8}",
        "model", "strategy", "measured ms", "simulated ms", "error", "traced ms", "error"
    );
    let models = std::env::var("LEGION_PVM_MODELS").unwrap_or_else(|_| "alexnet,lenet5".into());
    let traces = std::env::var_os("LEGION_PVM_TRACES").map(PathBuf::from);
    for (name, batch, image_size) in [("alexnet", 32, Some(64)), ("lenet5", 64, None)] {
        if !models.split(',').any(|m| m == name) {
            continue;
        }
        let graph = load_model(name, batch, image_size, None)?;
        let label = match image_size {
            Some(s) => format!("{name}@{s} b{batch}"),
            None => format!("{name} b{batch}"),
        };
        let machine = embedded_machine(DEVICES)?;
        let strategies = STRATEGIES
            .iter()
            .map(|s| Ok((s.to_string(), choose_strategy(&graph, &machine, s)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let settings = ProfileSettings {
            device_kind: machine.device(0).kind.clone(),
            seed: SEED,
            ..ProfileSettings::default()
        };
        let measured = profile::profile(&graph, DEVICES, &strategies, &settings)?;
        let machine = measured.db.apply_to(machine);
        let cost = ProfiledCost::new(&measured.db, &machine);
        let model = CostModel::new(&graph, &machine, &cost);
        let params = ParamStore::init(&graph, SEED);
        for (strategy, configs) in &strategies {
            let sim = simulate(&model, configs);
            let simulated = sim.makespan;
            let mut cluster =
                EmbeddedCluster::start(&graph, configs, DEVICES, &params, Sgd::default(), SEED, 0)?;
            let real = profile::mean_step_time(&mut cluster, &graph, WARMUP, STEPS, SEED)?;
            // The profiler's own traced steps of this strategy: measured at the same time as the
            // kernels the simulation is priced with, so less exposed to the machine's load drifting.
            let traced = measured
                .runs
                .iter()
                .find(|r| r.name == *strategy)
                .map_or(f64::NAN, |r| {
                    r.step_s.iter().sum::<f64>() / r.step_s.len() as f64
                });
            println!(
                "{label:<22} {strategy:<8} {:>12.2} {:>13.2} {:>7.1}% {:>10.2} {:>7.1}%",
                real * 1e3,
                simulated * 1e3,
                100.0 * (simulated - real) / real,
                traced * 1e3,
                100.0 * (simulated - traced) / traced
            );
            if let Some(dir) = &traces {
                std::fs::create_dir_all(dir)?;
                let (images, labels) = profile::synthetic_batch(&graph, SEED)?;
                let result = cluster.step(images, labels, true)?;
                let real =
                    legion_runtime::trace::chrome_trace(cluster.plan(), &graph, &result.reports);
                let simulated = legion_planner::trace::chrome_trace(&sim, &machine);
                for (kind, trace) in [("real", real), ("sim", simulated)] {
                    let path = dir.join(format!("{name}-{strategy}-{kind}.json"));
                    std::fs::write(path, serde_json::to_string(&trace)?)?;
                }
            }
        }
        if let Some(l) = &measured.db.links {
            println!(
                "{label:<22} link {:.2} GB/s, {:.1} µs; {} of {} tile lookups measured",
                l.bytes_per_s / 1e9,
                l.latency_s * 1e6,
                cost.hits(),
                cost.hits() + cost.misses()
            );
        }
        if let Some(r) = &measured.db.runtime {
            println!(
                "{label:<22} dispatch {:.1} µs per compute op; folds {:.2} GB/s, updates {:.2} GB/s, \
                 actor copies {:.2} GB/s on {} thread(s)",
                r.dispatch_s * 1e6,
                r.fold_bytes_per_s / 1e9,
                r.update_bytes_per_s / 1e9,
                r.copy_bytes_per_s / 1e9,
                r.actor_threads
            );
        }
    }
    Ok(())
}
