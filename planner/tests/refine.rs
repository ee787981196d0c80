//! The refine search on the zoo under the paper's machine (16 GPUs, 32 samples per GPU), beside
//! optcnn and the baselines in simulation, with its default budget and seed: what it gains and
//! how long it takes. `cargo test --release -p legion-planner --test refine -- --ignored
//! --nocapture` prints the table (Inception-v3 takes most of a minute).

mod support;
use support::zoo;

use legion_planner::search::{self, REFINE_STARTS, SearchKind, SearchOptions};
use legion_planner::simulate::simulated_step_time;
use legion_planner::{CostModel, CostTables, MachineModel, RooflineCost};
use std::time::Instant;

#[test]
#[ignore = "prints a table; run in release"]
fn refine_beside_optcnn_and_the_baselines_on_16_gpus() {
    let machine = MachineModel::preset("paper").unwrap();
    let provider = RooflineCost::new(&machine);
    let options = SearchOptions::with_budget(0);
    println!(
        "| model | optcnn | data | model | owt | refine (simulated ms) | refine / optcnn | \
         refine / best baseline | start | simulations | accepted | search s | simulations/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for name in ["alexnet", "vgg16", "inception_v3"] {
        let g = zoo(name, 32 * machine.num_devices());
        let model = CostModel::new(&g, &machine, &provider);
        let tables = CostTables::build(&model);
        let starts: Vec<(SearchKind, f64)> = REFINE_STARTS
            .iter()
            .map(|&k| {
                let configs = search::find(k, &tables, 0).unwrap().configs;
                (k, simulated_step_time(&model, &configs))
            })
            .collect();
        let t = Instant::now();
        let found = search::find_with(SearchKind::Refine, &tables, &options, &[]).unwrap();
        let seconds = t.elapsed().as_secs_f64();
        let r = found.refined.unwrap();
        let optcnn = starts[0].1;
        let best_baseline = starts[1..]
            .iter()
            .map(|s| s.1)
            .fold(f64::INFINITY, f64::min);
        for (kind, s) in &starts {
            assert!(
                r.refined_s <= *s,
                "{name}: refine {} > {kind} {s}",
                r.refined_s
            );
        }
        let ms: Vec<String> = starts.iter().map(|s| format!("{:.3}", s.1 * 1e3)).collect();
        println!(
            "| {name} | {} | {:.3} | {:.4} | {:.4} | {} | {} | {} | {:.1} | {:.0} |",
            ms.join(" | "),
            r.refined_s * 1e3,
            r.refined_s / optcnn,
            r.refined_s / best_baseline,
            r.start,
            r.simulations,
            r.accepted,
            seconds,
            r.simulations as f64 / seconds
        );
    }
}

/// On the zoo and the machines users plan for, refine (beside every other search, as `plan
/// --search all` runs it) is never slower in simulation than any of them: it starts from all of
/// their strategies. A small budget, since the guarantee holds by construction at any budget.
#[test]
fn refine_is_never_slower_in_simulation_than_any_other_search() {
    // refine asked for first: `plan` runs it after the others and reports it where it was asked
    let kinds: Vec<SearchKind> = std::iter::once(SearchKind::Refine)
        .chain(REFINE_STARTS)
        .collect();
    let options = SearchOptions {
        exhaustive_budget: 0,
        refine: search::RefineOptions {
            budget: 12,
            seed: 1,
            work: None,
        },
        space: Default::default(),
    };
    for machine_name in ["paper", "local-cpu:4", "dgx-h100"] {
        let machine = MachineModel::preset(machine_name).unwrap();
        let provider = RooflineCost::new(&machine);
        for name in ["alexnet", "vgg16", "inception_v3", "resnet50"] {
            let g = zoo(name, 8 * machine.num_devices());
            let model = CostModel::new(&g, &machine, &provider);
            let run = legion_planner::plan::plan(&model, &kinds, &options);
            let ran: Vec<(SearchKind, f64)> = run
                .searches
                .iter()
                .filter_map(|s| Some((s.kind, s.result.as_ref().ok()?.simulated_s)))
                .collect();
            let refined = ran
                .iter()
                .find(|(k, _)| *k == SearchKind::Refine)
                .unwrap_or_else(|| panic!("{name} on {machine_name}: refine failed"))
                .1;
            assert_eq!(
                run.searches.iter().map(|s| s.kind).collect::<Vec<_>>(),
                kinds,
                "reported in the order asked for"
            );
            for (kind, simulated) in &ran {
                assert!(
                    refined <= *simulated,
                    "{name} on {machine_name}: refine {refined} > {kind} {simulated}"
                );
            }
        }
    }
}
