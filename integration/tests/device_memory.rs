//! The per-device memory model counts what the runtime allocates: for every strategy tried here,
//! `legion_ops::memory::per_device` (shapes alone, what the planner and `train` check against a
//! device's memory) equals, byte for byte and device by device, the instances the runtime's step
//! plan gives each device actor (`StepPlan::device_bytes`): outputs and gradients, received input
//! slices, parameter slices, owners' blocks with momentum, gradient terms, staging buffers and
//! partial sums. Strategies: data, model, OWT, random ones and random ones with reduction splits,
//! on LeNet-5, AlexNet at 64×64 and the reduced Inception-v3 (batch norm, concatenations), 4
//! devices on one node, on two nodes of two and on nodes of one and three (where the sync's
//! relays stage their members' gradients).

mod support;

use legion_ops::memory::per_device;
use legion_ops::partition::Nodes;
use legion_planner::ParallelConfig;
use legion_runtime::plan::StepPlan;
use support::*;

#[test]
fn the_memory_model_counts_every_buffer_the_runtime_allocates() {
    let mut failures = Vec::new();
    let mut tried = 0;
    for (name, image) in [
        ("lenet5", 28),
        ("alexnet", 64),
        ("inception_v3_reduced", 32),
    ] {
        let graph = model(name, image);
        let mut strategies = strategy_families(&graph, 3, 3);
        strategies.push((
            "serial".into(),
            vec![ParallelConfig::serial(0); graph.layers().len()],
        ));
        for (strategy, configs) in &strategies {
            for nodes in [
                Nodes::one(DEVICES),
                Nodes::of_sizes([2, 2]),
                Nodes::of_sizes([1, 3]),
            ] {
                tried += 1;
                let allocated = StepPlan::build(&graph, configs, nodes.clone())
                    .unwrap()
                    .device_bytes();
                let modelled: Vec<u64> = per_device(&graph, configs, nodes.clone())
                    .iter()
                    .map(|d| d.bytes)
                    .collect();
                if modelled != allocated {
                    failures.push(format!(
                        "{name} {strategy} on {} node(s): modelled {modelled:?}, allocated \
                         {allocated:?}",
                        nodes.count()
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {tried} strategies:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
