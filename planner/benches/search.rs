//! OptCNN search time per zoo model and machine size (release, one thread):
//!
//! ```text
//! cargo bench -p legion-planner --bench search                 # all models at 4, 16, 64 devices
//! cargo bench -p legion-planner --bench search -- alexnet 16   # filters: model names, device counts
//! ```
//!
//! Machines are the paper's (4 P100 per node, NVLink inside, 100 Gb/s InfiniBand across) with
//! `devices / 4` nodes, at the paper's per-GPU batch of 32. Columns: pricing t_c and t_s for every
//! config of every layer (`CostTables::build`), Algorithm 1 including the t_x tables it builds, and
//! their sum; medians over repeated runs (fewer runs for the slow cases).

use legion_planner::search::optcnn;
use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost};
use std::time::{Duration, Instant};

const MODELS: [&str; 4] = ["alexnet", "vgg16", "inception_v3", "resnet50"];
const DEVICES: [usize; 3] = [4, 16, 64];

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| f == name);
    let any_device_filter = filters.iter().any(|f| f.parse::<usize>().is_ok());
    let any_model_filter = filters.iter().any(|f| MODELS.contains(&f.as_str()));
    println!(
        "{:<13} {:>7} {:>8} {:>14} {:>12} {:>10}  residual",
        "model", "devices", "configs", "t_c+t_s ms", "optcnn ms", "total ms"
    );
    for devices in DEVICES {
        if any_device_filter && !wanted(&devices.to_string()) {
            continue;
        }
        let machine =
            MachineModel::from_flags(devices.div_ceil(4), devices.min(4), None, None).unwrap();
        let provider = RooflineCost::new(&machine);
        for name in MODELS {
            if any_model_filter && !wanted(name) {
                continue;
            }
            let z = legion_ops::zoo::find(name).unwrap();
            let graph = z.build(&z.default_config(32 * devices)).unwrap();
            let model = CostModel::new(&graph, &machine, &provider);
            let mut node = Vec::new();
            let mut search = Vec::new();
            let mut residual = 0;
            let mut configs = 0;
            let started = Instant::now();
            // at least 3 runs, at most 15, and no more once 20 s are spent
            while node.len() < 3 || (node.len() < 15 && started.elapsed() < Duration::from_secs(20))
            {
                let t0 = Instant::now();
                let tables = CostTables::build(&model);
                let t1 = Instant::now();
                let r = optcnn(&tables).unwrap();
                let t2 = Instant::now();
                node.push((t1 - t0).as_secs_f64() * 1e3);
                search.push((t2 - t1).as_secs_f64() * 1e3);
                residual = r.residual_nodes;
                configs = graph
                    .ids()
                    .map(|l| tables.space(l).len())
                    .max()
                    .unwrap_or(0);
                if started.elapsed() > Duration::from_secs(60) {
                    break;
                }
            }
            let (n, s) = (median(&mut node), median(&mut search));
            println!(
                "{name:<13} {devices:>7} {configs:>8} {n:>14.2} {s:>12.2} {:>10.2}  {residual} ({} runs)",
                n + s,
                node.len()
            );
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
