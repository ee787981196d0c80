//! A simulated training iteration: the task graph the runtime would execute for a strategy,
//! list-scheduled on the machine.
//!
//! Tasks (durations from the cost provider and the links):
//! - forward compute of every tile, on its device;
//! - a copy per (producer tile → consumer tile) overlap on different devices, on the link between
//!   them (same-device overlaps are plain dependencies);
//! - backward compute of every tile, after its forward and after the gradients of everything it
//!   fed arrived (gradient copies run on the reverse links; none go to the input layer);
//! - parameter synchronisation per replica group exactly as [`crate::sync`] describes: gradient
//!   messages replica → owner, the owner's sum and SGD update, updated slices owner → replica. The
//!   update is priced as memory traffic at the owner's memory bandwidth (it streams the gradients,
//!   weights and momentum once): negligible on a GPU, a real share of a CPU step.
//!
//! Scheduling: each device runs one compute task at a time and each directed link carries one
//! message at a time (on a machine with shared node links, every message from one node to another
//! queues on the same link); a task is ready when its dependencies have finished, and every resource serves
//! its tasks in the order they became ready (ties by task number, which follows the program order).
//! On a machine whose devices share a pool of cores ([`MachineModel::compute_slots`], the embedded
//! cluster), a compute task also needs one of the pool's slots, so N devices on fewer cores do not
//! compute N tiles at once. The makespan is the simulated step time. Eq. 1 sums every term as if nothing overlapped, so the
//! simulated time is usually at most the Eq. 1 time; on one device they are equal.

use crate::config::{ParallelConfig, tile_rect};
use crate::cost::CostModel;
use crate::machine::{DeviceId, MachineModel};
use crate::sync::SyncPlan;
use crate::transfer::edge_overlaps;
use legion_ops::LayerId;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// What a task does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskKind {
    Forward,
    Backward,
    /// Forward activations between devices.
    Copy,
    /// Backward gradients between devices.
    GradientCopy,
    /// Parameter synchronisation: gradient to the owner, update, new values back.
    Sync,
}

impl TaskKind {
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Forward => "forward",
            TaskKind::Backward => "backward",
            TaskKind::Copy => "copy",
            TaskKind::GradientCopy => "gradient",
            TaskKind::Sync => "sync",
        }
    }
}

/// Where a task runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Device(DeviceId),
    /// The directed link `from → to`.
    Link(DeviceId, DeviceId),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Task {
    pub name: String,
    pub kind: TaskKind,
    pub resource: Resource,
    /// Seconds.
    pub duration: f64,
    /// Bytes moved (transfers only).
    pub bytes: u64,
    /// Tasks that must finish first.
    pub deps: Vec<usize>,
}

/// A scheduled iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    pub tasks: Vec<Task>,
    /// Start and finish of each task, seconds.
    pub start: Vec<f64>,
    pub finish: Vec<f64>,
    /// The simulated step time.
    pub makespan: f64,
}

/// Builds and schedules one iteration of `configs` (by layer id).
pub fn simulate(model: &CostModel, configs: &[ParallelConfig]) -> Simulation {
    let tasks = task_graph(model, configs);
    let (start, finish) = list_schedule_shared(&tasks, model.machine().compute_slots());
    let makespan = finish.iter().copied().fold(0.0, f64::max);
    Simulation {
        tasks,
        start,
        finish,
        makespan,
    }
}

/// The task graph of one iteration, in program order.
pub fn task_graph(model: &CostModel, configs: &[ParallelConfig]) -> Vec<Task> {
    let graph = model.graph();
    let machine = model.machine();
    let provider = model.provider();
    let mut tasks: Vec<Task> = Vec::new();
    // forward[l][t], backward[l][t]
    let mut forward: Vec<Vec<usize>> = Vec::new();
    let mut backward_time: Vec<Vec<f64>> = Vec::new();
    for id in graph.ids() {
        let layer = graph.layer(id);
        let config = &configs[id.0];
        let mut f = Vec::new();
        let mut b = Vec::new();
        for t in 0..config.total() {
            let rect = tile_rect(&layer.shape, config, t);
            let device = config.device_of_tile(t);
            let times = provider.phase_times(layer, model.input_shapes(id), &rect, device);
            let task = Task {
                name: format!("{} fwd {t}", layer.name),
                kind: TaskKind::Forward,
                resource: Resource::Device(device),
                duration: times.forward,
                bytes: 0,
                deps: Vec::new(),
            };
            f.push(push(&mut tasks, task));
            b.push(times.backward);
        }
        forward.push(f);
        backward_time.push(b);
    }
    let edges: Vec<_> = model
        .edges()
        .iter()
        .map(|e| {
            (
                *e,
                edge_overlaps(graph, e, &configs[e.src.0], &configs[e.dst.0]),
            )
        })
        .collect();
    for (e, overlaps) in &edges {
        for o in overlaps {
            let from = forward[e.src.0][o.src_tile];
            let to = forward[e.dst.0][o.dst_tile];
            if o.is_local() {
                tasks[to].deps.push(from);
                continue;
            }
            let copy = push(
                &mut tasks,
                Task {
                    name: format!(
                        "{} {} → {} {}",
                        graph.layer(e.src).name,
                        o.src_tile,
                        graph.layer(e.dst).name,
                        o.dst_tile
                    ),
                    kind: TaskKind::Copy,
                    resource: link(machine, o.src_device, o.dst_device),
                    duration: machine.message_time(o.src_device, o.dst_device, o.bytes() as f64),
                    bytes: o.bytes(),
                    deps: vec![from],
                },
            );
            tasks[to].deps.push(copy);
        }
    }
    // Backward in reverse layer order (the order the runtime launches them).
    let mut backward: Vec<Vec<usize>> = vec![Vec::new(); graph.layers().len()];
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        let layer = graph.layer(id);
        let config = &configs[id.0];
        for t in 0..config.total() {
            let task = Task {
                name: format!("{} bwd {t}", layer.name),
                kind: TaskKind::Backward,
                resource: Resource::Device(config.device_of_tile(t)),
                duration: backward_time[id.0][t],
                bytes: 0,
                deps: vec![forward[id.0][t]],
            };
            backward[id.0].push(push(&mut tasks, task));
        }
    }
    for (e, overlaps) in edges.iter().rev() {
        if !e.carries_gradient(graph) {
            continue;
        }
        for o in overlaps {
            let from = backward[e.dst.0][o.dst_tile];
            let to = backward[e.src.0][o.src_tile];
            if o.is_local() {
                tasks[to].deps.push(from);
                continue;
            }
            let copy = push(
                &mut tasks,
                Task {
                    name: format!(
                        "{} {} ← {} {}",
                        graph.layer(e.src).name,
                        o.src_tile,
                        graph.layer(e.dst).name,
                        o.dst_tile
                    ),
                    kind: TaskKind::GradientCopy,
                    resource: link(machine, o.dst_device, o.src_device),
                    duration: machine.message_time(o.dst_device, o.src_device, o.bytes() as f64),
                    bytes: o.bytes(),
                    deps: vec![from],
                },
            );
            tasks[to].deps.push(copy);
        }
    }
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        let config = &configs[id.0];
        let plan = SyncPlan::for_layer(graph, id, config);
        let name = &graph.layer(id).name;
        // tile of each device of the layer
        let tile_on = |d: DeviceId| backward[id.0][d - config.first_device()];
        let mut owners: BTreeMap<DeviceId, Vec<usize>> = BTreeMap::new();
        for g in &plan.groups {
            for &r in &g.replicas {
                let bytes = g.bytes();
                let gather = push(
                    &mut tasks,
                    Task {
                        name: format!("{name} param {} grad {r} → {}", g.param, g.owner),
                        kind: TaskKind::Sync,
                        resource: link(machine, r, g.owner),
                        duration: machine.message_time(r, g.owner, bytes as f64),
                        bytes,
                        deps: vec![tile_on(r)],
                    },
                );
                owners.entry(g.owner).or_default().push(gather);
            }
        }
        for (&owner, gathers) in &owners {
            let mut deps = gathers.clone();
            deps.push(tile_on(owner));
            let owned = plan.groups.iter().filter(|g| g.owner == owner);
            let update = push(
                &mut tasks,
                Task {
                    name: format!("{name} update on {owner}"),
                    kind: TaskKind::Sync,
                    resource: Resource::Device(owner),
                    duration: update_time(machine, owner, owned),
                    bytes: 0,
                    deps,
                },
            );
            for g in plan.groups.iter().filter(|g| g.owner == owner) {
                for &r in &g.replicas {
                    let bytes = g.bytes();
                    push(
                        &mut tasks,
                        Task {
                            name: format!("{name} param {} value {owner} → {r}", g.param),
                            kind: TaskKind::Sync,
                            resource: link(machine, owner, r),
                            duration: machine.message_time(owner, r, bytes as f64),
                            bytes,
                            deps: vec![update],
                        },
                    );
                }
            }
        }
    }
    tasks
}

/// Seconds for `owner` to sum its groups' gradients (its own and one per replica) and apply SGD
/// (read gradient, weight and momentum; write weight and momentum): memory-bound streaming.
fn update_time<'g>(
    machine: &MachineModel,
    owner: DeviceId,
    groups: impl Iterator<Item = &'g crate::sync::ReplicaGroup>,
) -> f64 {
    let bytes: u64 = groups
        .map(|g| {
            let terms = g.replicas.len() as u64 + 1;
            (terms + 1 + 5) * g.bytes()
        })
        .sum();
    bytes as f64 / machine.device(owner).memory_bytes_per_s()
}

fn push(tasks: &mut Vec<Task>, task: Task) -> usize {
    tasks.push(task);
    tasks.len() - 1
}

/// The link resource a message from `from` to `to` occupies (see [`MachineModel::link_channel`]).
fn link(machine: &MachineModel, from: DeviceId, to: DeviceId) -> Resource {
    let (a, b) = machine.link_channel(from, to);
    Resource::Link(a, b)
}

/// Start and finish times: every resource serves its tasks in the order they become ready (ties by
/// task number), each as soon as the resource is free.
pub fn list_schedule(tasks: &[Task]) -> (Vec<f64>, Vec<f64>) {
    list_schedule_shared(tasks, None)
}

/// [`list_schedule`] where, with `compute_slots`, a device task that takes time also waits for the
/// earliest free of that many slots of a pool all devices share.
pub fn list_schedule_shared(tasks: &[Task], compute_slots: Option<usize>) -> (Vec<f64>, Vec<f64>) {
    let n = tasks.len();
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut waiting: Vec<usize> = vec![0; n];
    for (t, task) in tasks.iter().enumerate() {
        waiting[t] = task.deps.len();
        for &d in &task.deps {
            successors[d].push(t);
        }
    }
    let mut resources: BTreeMap<Resource, f64> = BTreeMap::new();
    let mut ready_at = vec![0.0f64; n];
    let mut start = vec![0.0; n];
    let mut finish = vec![0.0; n];
    // Times are non-negative, so their bit patterns order like the numbers.
    let mut ready: BinaryHeap<Reverse<(u64, usize)>> = (0..n)
        .filter(|&t| waiting[t] == 0)
        .map(|t| Reverse((0f64.to_bits(), t)))
        .collect();
    let mut slots: Vec<f64> = vec![0.0; compute_slots.unwrap_or(0)];
    while let Some(Reverse((at, t))) = ready.pop() {
        let free = resources.entry(tasks[t].resource).or_insert(0.0);
        start[t] = f64::from_bits(at).max(*free);
        let pooled = !slots.is_empty()
            && tasks[t].duration > 0.0
            && matches!(tasks[t].resource, Resource::Device(_));
        // The slot that frees first (ties: the lowest), as a work queue hands tasks to threads.
        let slot = pooled.then(|| {
            (0..slots.len())
                .min_by(|&a, &b| slots[a].total_cmp(&slots[b]))
                .expect("at least one slot")
        });
        if let Some(k) = slot {
            start[t] = start[t].max(slots[k]);
        }
        finish[t] = start[t] + tasks[t].duration;
        *free = finish[t];
        if let Some(k) = slot {
            slots[k] = finish[t];
        }
        for &s in &successors[t] {
            ready_at[s] = ready_at[s].max(finish[t]);
            waiting[s] -= 1;
            if waiting[s] == 0 {
                ready.push(Reverse((ready_at[s].to_bits(), s)));
            }
        }
    }
    (start, finish)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::MachineModel;
    use crate::provider::RooflineCost;
    use legion_ops::op::{Conv2d, Dense, Pool2d};
    use legion_ops::{Dim, Graph, GraphBuilder, Shape};

    fn chain() -> Graph {
        let mut m = GraphBuilder::new("chain");
        let x = m.input("data", Shape::nchw(16, 3, 32, 32)).unwrap();
        let x = m
            .conv2d("conv1", x, Conv2d::new(16, 3).padding(1).relu())
            .unwrap();
        let x = m.pool2d("pool1", x, Pool2d::max(2)).unwrap();
        let x = m
            .conv2d("conv2", x, Conv2d::new(32, 3).padding(1).relu())
            .unwrap();
        let x = m.flatten("flat", x).unwrap();
        let x = m.dense("fc", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    #[test]
    fn one_device_equals_eq1() {
        let g = chain();
        let machine = MachineModel::preset("paper:1").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let configs = vec![ParallelConfig::serial(0); g.layers().len()];
        let sim = simulate(&model, &configs);
        let eq1 = model.total(&configs);
        assert!(
            (sim.makespan - eq1).abs() <= 1e-12 * eq1,
            "{} vs {eq1}",
            sim.makespan
        );
        assert!(
            sim.tasks
                .iter()
                .all(|t| matches!(t.resource, Resource::Device(0)))
        );
    }

    #[test]
    fn a_shared_node_link_serialises_the_messages_between_two_nodes() {
        let g = chain();
        let configs: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 8, 0))
            .collect();
        let run = |machine: &MachineModel| {
            let provider = RooflineCost::new(machine);
            simulate(&CostModel::new(&g, machine, &provider), &configs)
        };
        let machine = MachineModel::preset("paper:8").unwrap();
        let per_pair = run(&machine);
        let shared = run(&machine.clone().with_shared_node_links());
        let cross_links = |sim: &Simulation| {
            let mut links: Vec<Resource> = sim
                .tasks
                .iter()
                .filter_map(|t| match t.resource {
                    Resource::Link(a, b) if a / 4 != b / 4 => Some(t.resource),
                    _ => None,
                })
                .collect();
            links.sort();
            links.dedup();
            links.len()
        };
        assert!(cross_links(&per_pair) > 2);
        assert_eq!(
            cross_links(&shared),
            2,
            "one per direction between the two nodes"
        );
        assert!(shared.makespan > per_pair.makespan);
    }

    #[test]
    fn data_parallel_overlaps_and_stays_under_eq1() {
        let g = chain();
        let machine = MachineModel::preset("paper:8").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let configs: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 8, 0))
            .collect();
        let sim = simulate(&model, &configs);
        let eq1 = model.total(&configs);
        assert!(
            sim.makespan <= eq1 * (1.0 + 1e-12),
            "{} vs {eq1}",
            sim.makespan
        );
        // every device computes; the sync of conv1 crosses nodes
        let sync_bytes: u64 = sim
            .tasks
            .iter()
            .filter(|t| t.kind == TaskKind::Sync)
            .map(|t| t.bytes)
            .sum();
        assert_eq!(sync_bytes, model.evaluate(&configs).comm_bytes);
        // dependencies are respected and resources never run two tasks at once
        for (t, task) in sim.tasks.iter().enumerate() {
            for &d in &task.deps {
                assert!(sim.start[t] >= sim.finish[d]);
            }
        }
        let mut by_resource: BTreeMap<Resource, Vec<(f64, f64)>> = BTreeMap::new();
        for (t, task) in sim.tasks.iter().enumerate() {
            by_resource
                .entry(task.resource)
                .or_default()
                .push((sim.start[t], sim.finish[t]));
        }
        for spans in by_resource.values_mut() {
            spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            for w in spans.windows(2) {
                assert!(w[1].0 >= w[0].1 - 1e-15);
            }
        }
    }

    #[test]
    fn shared_cores_limit_concurrent_compute() {
        let g = chain();
        let configs: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 4, 0))
            .collect();
        let run = |machine: &MachineModel| {
            let provider = RooflineCost::new(machine);
            let model = CostModel::new(&g, machine, &provider);
            simulate(&model, &configs)
        };
        let machine = MachineModel::preset("local-cpu:4").unwrap();
        let free = run(&machine);
        let one = run(&machine.clone().with_compute_slots(1).unwrap());
        let two = run(&machine.with_compute_slots(2).unwrap());
        // One core runs every compute task back to back.
        let busy: f64 = one
            .tasks
            .iter()
            .filter(|t| matches!(t.resource, Resource::Device(_)))
            .map(|t| t.duration)
            .sum();
        assert!(
            one.makespan >= busy * (1.0 - 1e-12),
            "{} < {busy}",
            one.makespan
        );
        assert!(free.makespan < two.makespan && two.makespan < one.makespan);
        // never more than two compute tasks overlap
        let mut edges: Vec<(f64, i32)> = Vec::new();
        for (t, task) in two.tasks.iter().enumerate() {
            if matches!(task.resource, Resource::Device(_)) && task.duration > 0.0 {
                edges.push((two.start[t], 1));
                edges.push((two.finish[t], -1));
            }
        }
        edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut running = 0;
        for (_, d) in edges {
            running += d;
            assert!(running <= 2);
        }
    }

    #[test]
    fn copies_carry_what_eq1_counts() {
        let g = chain();
        let machine = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let mut configs: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 4, 0))
            .collect();
        configs[1] = ParallelConfig::split(Dim::H, 4, 0);
        configs[5] = ParallelConfig::split(Dim::C, 2, 2);
        let sim = simulate(&model, &configs);
        let moved: u64 = sim.tasks.iter().map(|t| t.bytes).sum();
        assert_eq!(moved, model.evaluate(&configs).comm_bytes);
    }
}
