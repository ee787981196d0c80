//! Predicted vs measured step time on the embedded cluster.
//!
//! For each model and strategy, on 4 embedded devices: alternate untraced steps, timed, with
//! traced steps that feed a `Profiler`, then compare the untraced steps' mean wall-clock time with
//! the planner's simulated step time, priced by `ProfiledCost` over that profile, the measured
//! link and the measured runtime costs. The machine is shared and its load drifts within seconds,
//! so the profile and the measurement interleave step by step, and the whole is repeated in
//! rounds; the table gives each strategy's median over the rounds of the measured and of the
//! simulated time, every round's error, and the traced steps' mean (how much tracing costs, and
//! the error against the very steps the profile came from), and the CPU an untraced step used
//! against the simulated step's (its tasks' seconds on the devices' cores and the runtime's CPU
//! per compute task): where those agree and the times do not, the error is in where and when the
//! work ran, not in how much of it there was. Run with
//! `cargo bench -p legion-cli --bench predicted_vs_measured`; the table is in BENCHMARKS.md.
//!
//! Environment: `LEGION_PVM_MODELS=alexnet,lenet5` picks the models (both by default);
//! `LEGION_PVM_ROUNDS=N` the rounds (3 by default); `LEGION_PVM_TRACES=DIR` also writes, per model
//! and strategy, a Chrome trace of one real step (`MODEL-STRATEGY-real.json`, after the measured
//! ones of the last round) and of the simulated step (`MODEL-STRATEGY-sim.json`), to compare task
//! by task.

use legion::job::choose_strategy;
use legion::load_model;
use legion::machine::embedded_machine;
use legion_ops::train::ParamStore;
use legion_planner::simulate::{Resource, Simulation, TaskKind, simulate};
use legion_planner::{CostModel, ProfiledCost};
use legion_profile::{self as profile, ProfileSettings, Profiler};
use legion_runtime::EmbeddedCluster;
use legion_runtime::{CpuMeter, process_cpu_s};
use std::path::PathBuf;
use std::time::Instant;

const DEVICES: usize = 4;

const STRATEGIES: [&str; 3] = ["data", "owt", "optcnn"];
const WARMUP: usize = 3;
const SEED: u64 = 1;
/// Each round measures about `MEASURE_S` seconds of untraced steps, at least `MIN_STEPS`, and
/// profiles as many traced steps between them (AlexNet's steps of 0.2–0.4 s vary by ±10% on this
/// machine: 16 of each keep the two means within a few percent). A fixed count of 10 steps measured
/// LeNet-5 for 35 ms; single steps of ~3.5 ms vary by tens of percent on this shared machine, and
/// its rounds' errors scattered by ±20%.
const MEASURE_S: f64 = 1.0;
const MIN_STEPS: usize = 16;
const MAX_STEPS: usize = 2000;

/// One round of one strategy, seconds per step.
#[derive(Clone, Copy)]
struct Round {
    measured_s: f64,
    simulated_s: f64,
    profiled_s: f64,
    /// The process's CPU per untraced step.
    measured_cpu_s: f64,
    simulated_cpu_s: f64,
}

/// Steps of `step_s` seconds that fill `seconds`, at least `least`.
fn steps_for(seconds: f64, step_s: f64, least: usize) -> usize {
    ((seconds / step_s).ceil() as usize).clamp(least, MAX_STEPS)
}

/// CPU seconds the simulated step spends on the devices' cores: every task on a device (kernels,
/// folds, updates, the actors' copies) and the runtime's CPU per compute task.
fn simulated_cpu_s(sim: &Simulation, runtime_cpu_s: f64) -> f64 {
    sim.tasks
        .iter()
        .filter(|t| matches!(t.resource, Resource::Device(_)))
        .map(|t| {
            let handling = if t.kind == TaskKind::Move {
                0.0
            } else {
                runtime_cpu_s
            };
            t.duration + handling
        })
        .sum()
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
        "{DEVICES} embedded devices on {cores} core(s); measured = mean of the untraced steps in \
         ~{MEASURE_S} s (at least {MIN_STEPS}) after {WARMUP} warm-up steps, profiled = as many \
         traced steps, alternating with them; medians over {rounds} round(s)"
    );
    println!(
        "{:<16} {:<8} {:>12} {:>13} {:>8}  {:<22} {:>11} {:>8} {:>16}",
        "model",
        "strategy",
        "measured ms",
        "simulated ms",
        "error",
        "errors by round",
        "profiled ms",
        "vs sim",
        "CPU ms real/sim"
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
            .map(|s| {
                Ok((
                    s.to_string(),
                    choose_strategy(&graph, &machine, &(*s).into())?,
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let settings = ProfileSettings {
            device_kind: machine.device(0).kind.clone(),
            seed: SEED,
            ..ProfileSettings::default()
        };
        let params = ParamStore::init(&graph, SEED);
        let start = |configs: &[legion_planner::ParallelConfig]| {
            EmbeddedCluster::launch(&graph, configs, DEVICES, &params)
                .seed(SEED)
                .start()
        };
        // How many steps to measure, from a short first measurement of each strategy.
        let counts = strategies
            .iter()
            .map(|(_, configs)| {
                let mut cluster = start(configs)?;
                let step_s = profile::mean_step_time(&mut cluster, &graph, WARMUP, 3, SEED)?;
                Ok(steps_for(MEASURE_S, step_s, MIN_STEPS))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (images, labels) = profile::synthetic_batch(&graph, SEED)?;
        let mut results: Vec<Vec<Round>> = vec![Vec::new(); strategies.len()];
        let mut notes = Vec::new();
        for round in 0..rounds {
            let mut note = format!("round {}:", round + 1);
            for (i, (strategy, configs)) in strategies.iter().enumerate() {
                let steps = counts[i];
                let mut cluster = start(configs)?;
                for _ in 0..WARMUP {
                    cluster.step(images.clone(), labels.clone(), false)?;
                }
                // Untraced (measured) and traced (profiled) steps alternate, so both see the
                // same load: on a shared machine it drifts by tens of percent within seconds.
                // The traced steps are analysed after the last one, so that the steps run back to
                // back, as in training.
                let (mut untraced_s, mut traced_s, mut untraced_cpu_s) = (0.0, 0.0, 0.0);
                let mut traced = Vec::with_capacity(steps);
                for _ in 0..steps {
                    let cpu = process_cpu_s();
                    let t = Instant::now();
                    cluster.step(images.clone(), labels.clone(), false)?;
                    untraced_s += t.elapsed().as_secs_f64();
                    untraced_cpu_s += process_cpu_s() - cpu;
                    let meter = CpuMeter::start();
                    let t = Instant::now();
                    let result = cluster.step(images.clone(), labels.clone(), true)?;
                    traced_s += t.elapsed().as_secs_f64();
                    traced.push((result.reports, meter.stop()));
                }
                let mut profiler = Profiler::new(DEVICES, &settings);
                for (reports, cpu) in &traced {
                    profiler.add_step(&graph, cluster.plan(), reports, *cpu);
                }
                let (real, profiled) = (untraced_s / steps as f64, traced_s / steps as f64);
                let db = profiler.finish(&graph);
                let machine = db.apply_to(machine.clone());
                let cost = ProfiledCost::new(&db, &machine);
                let model = CostModel::new(&graph, &machine, &cost);
                let sim = simulate(&model, configs);
                let runtime_cpu_s = db.runtime.as_ref().map_or(0.0, |r| r.runtime_cpu_s);
                results[i].push(Round {
                    measured_s: real,
                    simulated_s: sim.makespan,
                    profiled_s: profiled,
                    measured_cpu_s: untraced_cpu_s / steps as f64,
                    simulated_cpu_s: simulated_cpu_s(&sim, runtime_cpu_s),
                });
                if let Some(dir) = traces.as_ref().filter(|_| round + 1 == rounds) {
                    std::fs::create_dir_all(dir)?;
                    let result = cluster.step(images.clone(), labels.clone(), true)?;
                    let real =
                        legion_runtime::chrome_trace(cluster.plan(), &graph, &result.reports);
                    let simulated = legion_planner::trace::chrome_trace(&sim, &machine);
                    for (kind, trace) in [("real", real), ("sim", simulated)] {
                        let path = dir.join(format!("{name}-{strategy}-{kind}.json"));
                        std::fs::write(path, serde_json::to_string(&trace)?)?;
                    }
                }
                note += &format!(" {strategy} ({steps} + {steps} traced steps):");
                if let Some(l) = &db.links {
                    note += &format!(
                        " link {:.2} GB/s {:.0} µs,",
                        l.bytes_per_s / 1e9,
                        l.latency_s * 1e6
                    );
                }
                if let Some(r) = &db.runtime {
                    note += &format!(
                        " dispatch {:.0} µs, runtime CPU {:.1} µs, folds {:.1} GB/s, updates {:.1} \
                         GB/s, copies {:.1} GB/s ({} actor threads),",
                        r.dispatch_s * 1e6,
                        r.runtime_cpu_s * 1e6,
                        r.fold_bytes_per_s / 1e9,
                        r.update_bytes_per_s / 1e9,
                        r.copy_bytes_per_s / 1e9,
                        r.actor_threads
                    );
                }
                note += &format!(
                    " {}/{} tiles measured;",
                    cost.hits(),
                    cost.hits() + cost.scaled() + cost.misses()
                );
            }
            notes.push(note);
        }
        for ((strategy, _), runs) in strategies.iter().zip(&results) {
            let of = |f: fn(&Round) -> f64| median(runs.iter().map(f).collect());
            let real = of(|r| r.measured_s);
            let simulated = of(|r| r.simulated_s);
            let profiled = of(|r| r.profiled_s);
            let cpu = format!(
                "{:.1}/{:.1}",
                of(|r| r.measured_cpu_s) * 1e3,
                of(|r| r.simulated_cpu_s) * 1e3
            );
            let errors: Vec<String> = runs
                .iter()
                .map(|r| {
                    let (m, s) = (r.measured_s, r.simulated_s);
                    format!("{:+.1}%", 100.0 * (s - m) / m)
                })
                .collect();
            println!(
                "{label:<16} {strategy:<8} {:>12.2} {:>13.2} {:>7.1}%  {:<22} {:>11.2} {:>+7.1}% {cpu:>16}",
                real * 1e3,
                simulated * 1e3,
                100.0 * (simulated - real) / real,
                errors.join(" "),
                profiled * 1e3,
                100.0 * (simulated - profiled) / profiled,
            );
        }
        for note in notes {
            println!("{label:<16} {note}");
        }
    }
    Ok(())
}
