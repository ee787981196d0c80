//! Predicted vs measured step time on the embedded cluster.
//!
//! For each model: profile the strategies on 4 embedded devices (`legion_runtime::profile`), then for
//! each strategy compare the mean wall-clock time of real steps with the planner's simulated step
//! time, priced by `ProfiledCost` over that profile and the measured links. Run with
//! `cargo bench -p legion-cluster --bench predicted_vs_measured`; the table is in BENCHMARKS.md.

use legion_cluster::cli::load_model;
use legion_cluster::job::{choose_strategy, embedded_machine};
use legion_ops::train::{ParamStore, Sgd};
use legion_planner::simulate::simulate;
use legion_planner::{CostModel, ProfiledCost};
use legion_runtime::embedded::EmbeddedCluster;
use legion_runtime::profile::{self, ProfileSettings};

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
        "{:<22} {:<8} {:>12} {:>13} {:>8}",
        "model", "strategy", "measured ms", "simulated ms", "error"
    );
    for (name, batch, image_size) in [("alexnet", 32, Some(64)), ("lenet5", 64, None)] {
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
            let simulated = simulate(&model, configs).makespan;
            let mut cluster =
                EmbeddedCluster::start(&graph, configs, DEVICES, &params, Sgd::default(), SEED, 0)?;
            let real = profile::mean_step_time(&mut cluster, &graph, WARMUP, STEPS, SEED)?;
            println!(
                "{label:<22} {strategy:<8} {:>12.2} {:>13.2} {:>7.1}%",
                real * 1e3,
                simulated * 1e3,
                100.0 * (simulated - real) / real
            );
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
    }
    Ok(())
}
