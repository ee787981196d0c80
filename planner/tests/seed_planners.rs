//! The seed planners (SOYBEAN, Tofu, HyPar, Spartan) on the zoo under the paper's machine, beside
//! OptCNN and the baselines: Eq. 1 and each planner's own byte count, and how long each search
//! takes. `cargo test --release -p legion-planner --test seed_planners -- --ignored --nocapture`
//! prints the table.

mod support;
use support::zoo;

use legion_planner::search::{self, SearchKind};
use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost};
use std::time::Instant;

#[test]
#[ignore = "prints a table; run in release"]
fn seed_planners_beside_optcnn_on_16_gpus() {
    let machine = MachineModel::preset("paper").unwrap();
    let provider = RooflineCost::new(&machine);
    let kinds = [
        SearchKind::Data,
        SearchKind::Model,
        SearchKind::Owt,
        SearchKind::OptCnn,
        SearchKind::Soybean,
        SearchKind::Tofu,
        SearchKind::Hypar,
        SearchKind::Spartan,
    ];
    // native MB: the planner's own count of the plan it found (its reductions included), then
    // of that plan mapped into our space
    println!(
        "| model | search | Eq. 1 ms | comm MB (Eq. 1) | native MB found / mapped | search s |"
    );
    println!("|---|---|---|---|---|---|");
    for name in ["alexnet", "vgg16", "inception_v3"] {
        let g = zoo(name, 32 * 16);
        let model = CostModel::new(&g, &machine, &provider);
        let tables = CostTables::build(&model);
        for kind in kinds {
            let t = Instant::now();
            let found = search::find(kind, &tables, 0).unwrap();
            let seconds = t.elapsed().as_secs_f64();
            let cost = model.evaluate(&found.configs);
            let native = match (
                found.native_bytes,
                search::native_bytes(kind, &g, &machine, &found.configs),
            ) {
                (Some(own), Some(mapped)) => format!("{:.1} / {:.1}", own / 1e6, mapped / 1e6),
                _ => "-".to_string(),
            };
            println!(
                "| {name} | {kind} | {:.2} | {:.1} | {native} | {seconds:.3} |",
                cost.total * 1e3,
                cost.comm_bytes as f64 / 1e6,
            );
            if SearchKind::SEEDS.contains(&kind) {
                assert!(seconds < 2.0, "{kind} on {name} took {seconds} s");
            }
        }
    }
}
