//! Chrome / Perfetto trace JSON of a simulated iteration (the runtime writes the same format):
//! `{"traceEvents": [...]}` with one complete event (`"ph": "X"`, microseconds) per task, a process
//! per device (pid = device id) and per directed link or pair of shared lanes (pids after the
//! devices), each named by a
//! metadata event, and per node whose network threads the simulation charges
//! ([`crate::machine::NetworkCpu`]).

use crate::machine::MachineModel;
use crate::simulate::{Resource, Simulation};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// The trace of `sim` on `machine`. Zero-length tasks (the input layer, parameter updates) are left
/// out.
pub fn chrome_trace(sim: &Simulation, machine: &MachineModel) -> Value {
    let devices = machine.num_devices();
    let mut links: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut networks: BTreeMap<usize, usize> = BTreeMap::new();
    let mut lanes: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for t in &sim.tasks {
        let next = devices + links.len() + networks.len() + lanes.len();
        match t.resource {
            Resource::Link(a, b) => {
                links.entry((a, b)).or_insert(next);
            }
            Resource::Lanes(out, into) => {
                lanes.entry((out, into)).or_insert(next);
            }
            Resource::Network(node) => {
                networks.entry(node).or_insert(next);
            }
            Resource::Inbox(d) => {
                links.entry((usize::MAX, d)).or_insert(next);
            }
            Resource::Collective => {
                links.entry((usize::MAX - 1, 0)).or_insert(next);
            }
            Resource::Device(_) | Resource::Join => {}
        }
    }
    let mut events = Vec::new();
    for d in 0..devices {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": d, "tid": 0,
            "args": {"name": format!("device {d} ({}, node {})", machine.device(d).kind, machine.node_of(d))},
        }));
    }
    for (&(a, b), &pid) in &links {
        let name = match a {
            usize::MAX => format!("private links → {b}"),
            x if x == usize::MAX - 1 => "collective transfers on shared lanes".to_string(),
            _ => format!("link {a} → {b}"),
        };
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": name},
        }));
    }
    for (&(out, into), &pid) in &lanes {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": format!("shared lanes {out} → {into}")},
        }));
    }
    for (&node, &pid) in &networks {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": format!("node {node} network")},
        }));
    }
    for (i, t) in sim.tasks.iter().enumerate() {
        // a collective transfer takes from its start to its last message's end
        let duration = match t.collective {
            Some(_) => sim.finish[i] - sim.start[i],
            None => t.duration,
        };
        if duration <= 0.0 {
            continue;
        }
        let pid = match t.resource {
            Resource::Device(d) => d,
            Resource::Link(a, b) => links[&(a, b)],
            Resource::Lanes(out, into) => lanes[&(out, into)],
            Resource::Network(node) => networks[&node],
            Resource::Inbox(d) => links[&(usize::MAX, d)],
            // zero-length: left out above
            Resource::Join => continue,
            Resource::Collective => links[&(usize::MAX - 1, 0)],
        };
        let mut event = json!({
            "name": t.name,
            "cat": t.kind.name(),
            "ph": "X",
            "ts": sim.start[i] * 1e6,
            "dur": duration * 1e6,
            "pid": pid,
            "tid": 0,
        });
        if t.bytes > 0 {
            event["args"] = json!({"bytes": t.bytes});
        }
        events.push(event);
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ParallelConfig;
    use crate::cost::CostModel;
    use crate::provider::RooflineCost;
    use crate::simulate::simulate;
    use legion_ops::op::Dense;
    use legion_ops::{Dim, GraphBuilder, Shape};

    #[test]
    fn events_per_device_and_link() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(64, 256)).unwrap();
        let a = m.dense("fc1", x, Dense::new(256)).unwrap();
        m.dense("fc2", a, Dense::new(64)).unwrap();
        let g = m.finish();
        let machine = MachineModel::preset("paper:2").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let configs = vec![
            ParallelConfig::split(Dim::N, 2, 0),
            ParallelConfig::split(Dim::N, 2, 0),
            ParallelConfig::split(Dim::C, 2, 0),
        ];
        let trace = chrome_trace(&simulate(&model, &configs), &machine);
        let events = trace["traceEvents"].as_array().unwrap();
        let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert!(
            complete
                .iter()
                .any(|e| e["cat"] == "copy" && e["pid"].as_u64().unwrap() >= 2)
        );
        assert!(complete.iter().any(|e| e["cat"] == "sync"));
        assert!(complete.iter().all(|e| e["dur"].as_f64().unwrap() > 0.0));
        let names: Vec<_> = events
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert!(
            names.contains(&"device 1 (p100, node 0)".to_string()),
            "{names:?}"
        );
        assert!(names.contains(&"link 0 → 1".to_string()), "{names:?}");
    }
}
