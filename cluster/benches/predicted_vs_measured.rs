//! Predicted vs measured step time on the embedded cluster.
//!
//! For each model and strategy: profile the strategy on 4 embedded devices
//! (`legion_runtime::profile`), then compare the mean wall-clock time of real steps, taken right
//! after, with the planner's simulated step time, priced by `ProfiledCost` over that profile, the
//! measured link and the measured runtime costs. The machine is shared and its load drifts, so each
//! strategy is profiled just before it is measured, and the whole is repeated in rounds; the table
//! gives each strategy's median over the rounds of the measured and of the simulated time, and
//! every round's error. Run with
//! `cargo bench -p legion-cluster --bench predicted_vs_measured`; the table is in BENCHMARKS.md.
//!
//! Environment: `LEGION_PVM_MODELS=alexnet,lenet5` picks the models (both by default);
//! `LEGION_PVM_ROUNDS=N` the rounds (3 by default); `LEGION_PVM_TRACES=DIR` also writes, per model
//! and strategy, a Chrome trace of one real step (`MODEL-STRATEGY-real.json`, after the measured
//! ones of the last round) and of the simulated step (`MODEL-STRATEGY-sim.json`), to compare task
//! by task.

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
const SEED: u64 = 1;
/// Each round profiles about `PROFILE_S` and measures about `MEASURE_S` seconds of steps, but at
/// least `MIN_REPEATS` traced and `MIN_STEPS` measured steps. A fixed count of 10 steps measured
/// LeNet-5 for 35 ms; single steps of ~3.5 ms vary by tens of percent on this shared machine, and
/// its rounds' errors scattered by ±20%.
const MEASURE_S: f64 = 1.0;
const PROFILE_S: f64 = 0.5;
const MIN_STEPS: usize = 10;
const MIN_REPEATS: usize = 5;
const MAX_STEPS: usize = 2000;

/// Steps of `step_s` seconds that fill `seconds`, at least `least`.
fn steps_for(seconds: f64, step_s: f64, least: usize) -> usize {
    ((seconds / step_s).ceil() as usize).clamp(least, MAX_STEPS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> anyhow::Result<()> {
    // The compute pool is sized to the cores (rayon's default).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rounds: usize = std::env::var("LEGION_PVM_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(3);
    println!(
        "{DEVICES} embedded devices on {cores} core(s); measured = mean of the steps in ~{MEASURE_S} \
         s (at least {MIN_STEPS}) after {WARMUP} warm-up steps, profiled over ~{PROFILE_S} s (at \
         least {MIN_REPEATS} traced steps); medians over {rounds} round(s) of profile + measure"
    );
    println!(
        "{:<16} {:<8} {:>12} {:>13} {:>8}  errors by round",
        "model", "strategy", "measured ms", "simulated ms", "error"
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
        let params = ParamStore::init(&graph, SEED);
        let start = |configs: &[legion_planner::ParallelConfig]| {
            EmbeddedCluster::start(&graph, configs, DEVICES, &params, Sgd::default(), SEED, 0)
        };
        // How many steps to measure and to profile, from a short first measurement of each.
        let counts = strategies
            .iter()
            .map(|(_, configs)| {
                let mut cluster = start(configs)?;
                let step_s = profile::mean_step_time(&mut cluster, &graph, WARMUP, 3, SEED)?;
                Ok((
                    steps_for(MEASURE_S, step_s, MIN_STEPS),
                    steps_for(PROFILE_S, step_s, MIN_REPEATS),
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // (measured, simulated) seconds per strategy per round
        let mut results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); strategies.len()];
        let mut notes = Vec::new();
        for round in 0..rounds {
            let mut note = format!("round {}:", round + 1);
            for (i, (strategy, configs)) in strategies.iter().enumerate() {
                let one = std::slice::from_ref(&strategies[i]);
                let (steps, repeats) = counts[i];
                let settings = ProfileSettings {
                    repeats,
                    ..settings.clone()
                };
                let measured = profile::profile(&graph, DEVICES, one, &settings)?;
                let machine = measured.db.apply_to(machine.clone());
                let cost = ProfiledCost::new(&measured.db, &machine);
                let model = CostModel::new(&graph, &machine, &cost);
                let sim = simulate(&model, configs);
                let mut cluster = start(configs)?;
                let real = profile::mean_step_time(&mut cluster, &graph, WARMUP, steps, SEED)?;
                results[i].push((real, sim.makespan));
                if let Some(dir) = traces.as_ref().filter(|_| round + 1 == rounds) {
                    std::fs::create_dir_all(dir)?;
                    let (images, labels) = profile::synthetic_batch(&graph, SEED)?;
                    let result = cluster.step(images, labels, true)?;
                    let real = legion_runtime::trace::chrome_trace(
                        cluster.plan(),
                        &graph,
                        &result.reports,
                    );
                    let simulated = legion_planner::trace::chrome_trace(&sim, &machine);
                    for (kind, trace) in [("real", real), ("sim", simulated)] {
                        let path = dir.join(format!("{name}-{strategy}-{kind}.json"));
                        std::fs::write(path, serde_json::to_string(&trace)?)?;
                    }
                }
                note += &format!(" {strategy} ({steps} steps, {repeats} traced):");
                if let Some(l) = &measured.db.links {
                    note += &format!(
                        " link {:.2} GB/s {:.0} µs,",
                        l.bytes_per_s / 1e9,
                        l.latency_s * 1e6
                    );
                }
                if let Some(r) = &measured.db.runtime {
                    note += &format!(
                        " dispatch {:.0} µs, folds {:.1} GB/s, updates {:.1} GB/s, copies {:.1} \
                         GB/s ({} actor threads),",
                        r.dispatch_s * 1e6,
                        r.fold_bytes_per_s / 1e9,
                        r.update_bytes_per_s / 1e9,
                        r.copy_bytes_per_s / 1e9,
                        r.actor_threads
                    );
                }
                note += &format!(
                    " {}/{} tiles measured;",
                    cost.hits(),
                    cost.hits() + cost.misses()
                );
            }
            notes.push(note);
        }
        for ((strategy, _), runs) in strategies.iter().zip(&results) {
            let real = median(runs.iter().map(|r| r.0).collect());
            let simulated = median(runs.iter().map(|r| r.1).collect());
            let errors: Vec<String> = runs
                .iter()
                .map(|(m, s)| format!("{:+.1}%", 100.0 * (s - m) / m))
                .collect();
            println!(
                "{label:<16} {strategy:<8} {:>12.2} {:>13.2} {:>7.1}%  {}",
                real * 1e3,
                simulated * 1e3,
                100.0 * (simulated - real) / real,
                errors.join(" ")
            );
        }
        for note in notes {
            println!("{label:<16} {note}");
        }
    }
    Ok(())
}
