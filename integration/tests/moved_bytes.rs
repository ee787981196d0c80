//! Eq. 1 and the simulator count the bytes the runtime moves: for every strategy tried here, the
//! cost model's communication (edge transfers, parameter synchronisation, and a reduction split's
//! partial sums and output gradients) and the simulated iteration's messages each equal, byte for
//! byte, what the runtime's step plan sends between devices in one step. Strategies: data, model, OWT, random ones, and random ones with
//! reduction splits (`red` 2 or 4 on conv and dense layers), on LeNet-5 and AlexNet at 64×64, 4
//! devices. Models without batch norm: its per-channel statistics, exchanged between the tiles of
//! a layer split over samples or space, are not part of Eq. 1.

mod support;

use legion_ops::Graph;
use legion_planner::simulate::simulate;
use legion_planner::{CostModel, MachineModel, ParallelConfig, RooflineCost};
use legion_runtime::plan::StepPlan;
use legion_runtime::program::LocalOpKind;
use support::*;

/// Bytes every device sends in one step of `configs`.
fn sent_by_runtime(graph: &Graph, configs: &[ParallelConfig]) -> u64 {
    let plan = StepPlan::build(graph, configs, DEVICES).unwrap();
    let mut bytes = 0;
    for program in &plan.programs {
        for op in &program.ops {
            if let LocalOpKind::Send { src, rect, .. } = &op.kind {
                bytes += (rect.volume() * program.instances[*src as usize].dtype.size()) as u64;
            }
        }
    }
    bytes
}

#[test]
fn eq1_and_the_simulator_move_what_the_runtime_sends_reduction_splits_included() {
    let machine = MachineModel::preset(&format!("paper:{DEVICES}")).unwrap();
    let provider = RooflineCost::new(&machine);
    let mut failures = Vec::new();
    let mut with_reductions = 0;
    for (name, image) in [("lenet5", 28), ("alexnet", 64)] {
        let graph = model(name, image);
        let cost = CostModel::new(&graph, &machine, &provider);
        let strategies = strategy_families(&graph, 3, 6);
        with_reductions += strategies
            .iter()
            .filter(|(_, configs)| configs.iter().any(|c| c.reduction() > 1))
            .count();
        for (strategy, configs) in &strategies {
            let priced = cost.evaluate(configs).comm_bytes;
            let sent = sent_by_runtime(&graph, configs);
            if priced != sent {
                failures.push(format!(
                    "{name} {strategy}: Eq. 1 {priced} bytes, runtime {sent}"
                ));
            }
            let simulated = simulated_bytes(&simulate(&cost, configs));
            if simulated != sent {
                failures.push(format!(
                    "{name} {strategy}: simulated {simulated} bytes, runtime {sent}"
                ));
            }
        }
    }
    assert!(
        with_reductions >= 10,
        "too few strategies split a reduction"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
