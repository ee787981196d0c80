//! Where `legion-rs plan --search optcnn` spends its time, phase by phase (release, one thread, one
//! run per case): pricing t_c and t_s for every config (`CostTables::build`), Algorithm 1 with the
//! t_x tables it builds, Eq. 1 of the strategy found, and the simulated step
//! (`simulated_step_time`: building the task graph and list-scheduling it).
//!
//! ```text
//! cargo bench -p legion-planner --bench plan_breakdown                    # every model and machine
//! cargo bench -p legion-planner --bench plan_breakdown -- vgg16 64x16     # filters: models, machines
//! cargo bench -p legion-planner --bench plan_breakdown -- paper-space     # OptCNN's space instead
//! cargo bench -p legion-planner --bench plan_breakdown -- alexnet dgx-h100:256  # any sized preset
//! ```
//!
//! Each phase's column is the process's CPU seconds over it (user and system, from
//! `/proc/self/stat`, in clock ticks; wall seconds where that cannot be read): on a shared machine
//! CPU is steadier than wall. Then wall seconds of the whole, and the peak resident memory
//! (`VmHWM`) before the simulation and after it: later cases start from an earlier one's peak.
//!
//! Machines as `legion-rs plan` builds them: `paper` (the preset: 4 nodes of 4 sharing a NIC
//! each), `4x4`, `16x16` and `64x16` (`--nodes N --devices-per-node M`: a link per device pair);
//! 32 samples per device, and `plan`'s default space (with reduction splits) unless `paper-space`.

use legion_planner::search::{self, DEFAULT_BUDGET, SearchKind};
use legion_planner::simulate::simulated_step_time;
use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost, SearchSpace};
use std::time::Instant;

/// This process's CPU seconds so far (user and system), if `/proc/self/stat` says.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // the fields after the command name, which is in parentheses and may hold spaces
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on
    Some(ticks / 100.0)
}

/// This process's peak resident memory so far in MiB (`VmHWM`), if `/proc/self/status` says.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// A point in time, by CPU and by wall clock.
#[derive(Clone, Copy)]
struct Mark {
    cpu: Option<f64>,
    wall: Instant,
}

impl Mark {
    fn now() -> Mark {
        Mark {
            cpu: cpu_seconds(),
            wall: Instant::now(),
        }
    }

    /// CPU seconds since `earlier`, or wall seconds where CPU time is unknown.
    fn since(&self, earlier: &Mark) -> f64 {
        match (self.cpu, earlier.cpu) {
            (Some(b), Some(a)) => b - a,
            _ => (self.wall - earlier.wall).as_secs_f64(),
        }
    }
}

const MODELS: [&str; 3] = ["alexnet", "vgg16", "inception_v3"];
/// Machines: a preset, or nodes × devices per node.
const MACHINES: [&str; 4] = ["paper", "4x4", "16x16", "64x16"];

fn machine(name: &str) -> MachineModel {
    let flags = name
        .split_once('x')
        .and_then(|(n, m)| Some((n.parse().ok()?, m.parse().ok()?)));
    match flags {
        Some((nodes, per_node)) => MachineModel::from_flags(nodes, per_node, None, None).unwrap(),
        None => MachineModel::preset(name).unwrap(),
    }
}

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str, known: &[String]| {
        let relevant: Vec<&String> = filters.iter().filter(|f| known.contains(f)).collect();
        relevant.is_empty() || relevant.iter().any(|f| *f == name)
    };
    let models: Vec<String> = MODELS.iter().map(|m| m.to_string()).collect();
    // a preset with a size (`dgx-h100:256`) in the filters is run as well
    let mut machines: Vec<String> = MACHINES.iter().map(|m| m.to_string()).collect();
    machines.extend(filters.iter().filter(|f| f.contains(':')).cloned());
    let space = if filters.iter().any(|f| f == "paper-space") {
        SearchSpace::Paper
    } else {
        SearchSpace::WithReductions
    };
    println!("space: {space:?}");
    println!(
        "{:<13} {:>7} {:>10} {:>10} {:>10} {:>12} {:>10} {:>18}",
        "model",
        "machine",
        "tables s",
        "search s",
        "eq1 s",
        "simulate s",
        "wall s",
        "peak MiB pre/post"
    );
    for m in machines.iter().map(String::as_str) {
        if !wanted(m, &machines) {
            continue;
        }
        let machine = machine(m);
        let d = machine.num_devices();
        let provider = RooflineCost::new(&machine);
        for name in MODELS {
            if !wanted(name, &models) {
                continue;
            }
            let z = legion_ops::zoo::find(name).unwrap();
            let graph = z.build(&z.default_config(32 * d)).unwrap();
            let model = CostModel::new(&graph, &machine, &provider);
            let t0 = Mark::now();
            let tables = CostTables::build_in(&model, space);
            let t1 = Mark::now();
            let found = search::find(SearchKind::OptCnn, &tables, DEFAULT_BUDGET).unwrap();
            let t2 = Mark::now();
            let eq1 = model.evaluate(&found.configs);
            let t3 = Mark::now();
            let peak_before = peak_rss_mib().unwrap_or(f64::NAN);
            let step = simulated_step_time(&model, &found.configs);
            let t4 = Mark::now();
            let peak_after = peak_rss_mib().unwrap_or(f64::NAN);
            let s = |a: Mark, b: Mark| b.since(&a);
            println!(
                "{name:<13} {m:>7} {:>10.3} {:>10.3} {:>10.3} {:>12.3} {:>10.3} {:>8.0} / {:>7.0}  (eq1 {:.3} ms, simulated {:.3} ms)",
                s(t0, t1),
                s(t1, t2),
                s(t2, t3),
                s(t3, t4),
                (t4.wall - t0.wall).as_secs_f64(),
                peak_before,
                peak_after,
                eq1.total * 1e3,
                step * 1e3,
            );
        }
    }
}
