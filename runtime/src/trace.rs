//! Chrome / Perfetto trace JSON of a real step, in the simulator's format (`legion_planner::trace`):
//! one complete event per op, a process per device (pid = device id) and per directed link (pids
//! after the devices). Kernels and folds go on their device, and so do the copies its actor makes
//! (local copies, the gathers of sends, the stores of receives: category `move`, as the
//! simulator's); a copy between devices goes on its link, from the moment the sender had gathered
//! it to the moment the receiver's actor took it.

use crate::device::StepReport;
use crate::plan::StepPlan;
use crate::program::LocalOpKind;
use legion_ops::Graph;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};

pub fn chrome_trace(plan: &StepPlan, graph: &Graph, reports: &[StepReport]) -> Value {
    let devices = plan.num_devices();
    let mut events = Vec::new();
    for d in 0..devices {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": d, "tid": 0,
            "args": {"name": format!("device {d}")},
        }));
    }
    let mut links: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let sent = send_ends(plan, reports);
    for r in reports {
        let program = &plan.programs[r.device];
        for e in &r.events {
            let op = &program.ops[e.op as usize];
            let mut end = e.end;
            let (name, cat, pid, start, bytes) = match &op.kind {
                LocalOpKind::Task { task, .. } => {
                    (task.label(graph), "compute", r.device, e.start, 0)
                }
                LocalOpKind::Fold { dst, .. } => {
                    let region = plan.step.instances
                        [program.instances[*dst as usize].global as usize]
                        .region;
                    (
                        format!("sum {}", plan.regions.info(region).name),
                        "fold",
                        r.device,
                        e.start,
                        0,
                    )
                }
                LocalOpKind::Copy { dst, rect, .. } => {
                    let inst = &program.instances[*dst as usize];
                    let region = plan.step.instances[inst.global as usize].region;
                    (
                        format!("copy {}", plan.regions.info(region).name),
                        "move",
                        r.device,
                        e.start,
                        rect.volume() * inst.dtype.size(),
                    )
                }
                LocalOpKind::Send { src, rect, .. } => {
                    let inst = &program.instances[*src as usize];
                    let region = plan.step.instances[inst.global as usize].region;
                    (
                        format!("gather {}", plan.regions.info(region).name),
                        "move",
                        r.device,
                        e.start,
                        rect.volume() * inst.dtype.size(),
                    )
                }
                LocalOpKind::Recv { copy, dst, rect } => {
                    let inst = &program.instances[*dst as usize];
                    let region = plan.step.instances[inst.global as usize].region;
                    let (from, start) = sent.get(copy).copied().unwrap_or((r.device, e.start));
                    let next = devices + links.len();
                    let pid = *links.entry((from, r.device)).or_insert(next);
                    // The store into the receiver's instance is its actor's, after the transfer.
                    events.push(json!({
                        "name": format!("store {}", plan.regions.info(region).name),
                        "cat": "move", "ph": "X",
                        "ts": e.start * 1e6, "dur": (e.end - e.start).max(0.0) * 1e6,
                        "pid": r.device, "tid": 0,
                    }));
                    end = e.start;
                    (
                        plan.regions.info(region).name.clone(),
                        "transfer",
                        pid,
                        start,
                        rect.volume() * inst.dtype.size(),
                    )
                }
            };
            let mut event = json!({
                "name": name, "cat": cat, "ph": "X",
                "ts": start * 1e6, "dur": (end - start).max(0.0) * 1e6,
                "pid": pid, "tid": 0,
            });
            if bytes > 0 {
                event["args"] = json!({"bytes": bytes});
            }
            events.push(event);
        }
    }
    for (&(a, b), &pid) in &links {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": format!("link {a} → {b}")},
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// For each copy between devices that was sent in `reports`: the sending device and when its `Send`
/// ended (the piece gathered and handed to the transport), to pair with the receive.
pub fn send_ends(plan: &StepPlan, reports: &[StepReport]) -> HashMap<u32, (usize, f64)> {
    let mut sent = HashMap::new();
    for r in reports {
        let program = &plan.programs[r.device];
        for e in &r.events {
            if let LocalOpKind::Send { copy, .. } = program.ops[e.op as usize].kind {
                sent.insert(copy, (r.device, e.end));
            }
        }
    }
    sent
}
