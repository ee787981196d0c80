//! On two nodes of two devices, the planner prices the relayed synchronisation the runtime runs:
//! for data, OWT and random strategies of LeNet-5 and AlexNet at 64×64, Eq. 1's bytes between
//! nodes and in all, the simulated messages' bytes and each device's folds equal the runtime's
//! step plan's on the same nodes, and data parallelism sends half the bytes between the nodes
//! that the owner scheme (every replica to the owner) sends.

mod support;

use legion_ops::Graph;
use legion_ops::partition::Nodes;
use legion_planner::search::{data_parallel, one_weird_trick};
use legion_planner::simulate::{Resource, TaskKind, simulate};
use legion_planner::{CostModel, MachineModel, ParallelConfig, RooflineCost};
use legion_runtime::plan::StepPlan;
use legion_runtime::program::LocalOpKind;
use legion_runtime::region::RegionKind;
use support::*;

/// Bytes sent in one step (all, and between `nodes`) and folds per device, as the runtime plans
/// them on `planned_on`.
fn runtime(
    graph: &Graph,
    configs: &[ParallelConfig],
    planned_on: &Nodes,
    nodes: &Nodes,
) -> (u64, u64, Vec<usize>) {
    let plan = StepPlan::build(graph, configs, planned_on.clone()).unwrap();
    let (mut all, mut between) = (0, 0);
    let mut folds = vec![0; nodes.devices()];
    for (device, program) in plan.programs.iter().enumerate() {
        for op in &program.ops {
            match &op.kind {
                LocalOpKind::Send { src, rect, to, .. } => {
                    let bytes =
                        (rect.volume() * program.instances[*src as usize].dtype.size()) as u64;
                    all += bytes;
                    if nodes.node_of(*to) != nodes.node_of(device) {
                        between += bytes;
                    }
                }
                LocalOpKind::Fold { dst, .. } => {
                    let global = program.instances[*dst as usize].global;
                    let region = plan.step.instances[global as usize].region;
                    if !matches!(
                        plan.regions.info(region).kind,
                        RegionKind::BnMoments | RegionKind::BnGradSums
                    ) {
                        folds[device] += 1;
                    }
                }
                _ => {}
            }
        }
    }
    (all, between, folds)
}

#[test]
fn relayed_sync_is_priced_and_simulated_as_the_runtime_runs_it() {
    let machine = MachineModel::from_flags(2, 2, None, None).unwrap();
    let nodes = machine.nodes();
    assert_eq!(nodes, Nodes::of_sizes([2, 2]));
    let provider = RooflineCost::new(&machine);
    let mut failures = Vec::new();
    for (name, image) in [("lenet5", 28), ("alexnet", 64)] {
        let graph = model(name, image);
        let cost = CostModel::new(&graph, &machine, &provider);
        let mut strategies = vec![
            ("data".to_string(), data_parallel(&graph, &machine)),
            ("owt".to_string(), one_weird_trick(&graph, &machine)),
        ];
        strategies.extend((1..=3).map(|seed| (format!("random-{seed}"), random(&graph, seed))));
        for (strategy, configs) in &strategies {
            let (sent, between, folds) = runtime(&graph, configs, &nodes, &nodes);
            let priced = cost.evaluate(configs);
            if (priced.comm_bytes, priced.inter_node_bytes) != (sent, between) {
                failures.push(format!(
                    "{name} {strategy}: Eq. 1 {} bytes, {} between nodes; runtime {sent}, {between}",
                    priced.comm_bytes, priced.inter_node_bytes
                ));
            }
            let sim = simulate(&cost, configs);
            let moved = simulated_bytes(&sim);
            let mut simulated = vec![0; nodes.devices()];
            for t in sim.tasks.iter().filter(|t| t.kind == TaskKind::Fold) {
                if let Resource::Device(d) = t.resource {
                    simulated[d] += 1;
                }
            }
            if (moved, &simulated) != (sent, &folds) {
                failures.push(format!(
                    "{name} {strategy}: simulated {moved} bytes, folds {simulated:?}; \
                     runtime {sent}, {folds:?}"
                ));
            }
        }
        // the owner scheme on the same devices: every replica to the owner, across the nodes
        let data = data_parallel(&graph, &machine);
        let (_, relayed, _) = runtime(&graph, &data, &nodes, &nodes);
        let (_, flat, _) = runtime(&graph, &data, &Nodes::one(4), &nodes);
        assert_eq!(2 * relayed, flat, "{name}: bytes between nodes");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
