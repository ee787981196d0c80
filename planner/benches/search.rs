use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost};
use std::time::Instant;

fn main() {
    for devices in [4usize, 16] {
        let machine =
            MachineModel::from_flags(devices.div_ceil(4), devices.min(4), None, None).unwrap();
        let provider = RooflineCost::new(&machine);
        let only = std::env::var("MODELS").unwrap_or_default();
        for name in ["alexnet", "vgg16", "inception_v3", "resnet50"] {
            if !only.is_empty() && !only.split(",").any(|m| m == name) {
                continue;
            }
            let z = legion_ops::zoo::find(name).unwrap();
            let g = z.build(&z.default_config(32 * devices)).unwrap();
            let model = CostModel::new(&g, &machine, &provider);
            let t0 = Instant::now();
            let tables = CostTables::build(&model);
            let t1 = Instant::now();
            let r = legion_planner::search::optcnn(&tables).unwrap();
            let t2 = Instant::now();
            let mut seen = std::collections::HashSet::new();
            let mut sum = 0.0;
            for e in 0..tables.edges().len() {
                if seen.insert(tables.edge_class(e)) {
                    sum += tables.edge_table(e)[0];
                }
            }
            let t3 = Instant::now();

            println!(
                "{name} {devices}: tables {:.2} ms, optcnn {:.2} ms (edge tables alone {:.2} ms), residual {}, cost {:.4} {sum}",
                (t1 - t0).as_secs_f64() * 1e3,
                (t2 - t1).as_secs_f64() * 1e3,
                (t3 - t2).as_secs_f64() * 1e3,
                r.residual_nodes,
                r.cost
            );
        }
    }
}
