//! A simulated training iteration: the task graph the runtime would execute for a strategy,
//! list-scheduled on the machine.
//!
//! - [`tasks`]: the task graph (kernels, folds, updates, the actors' copies, transfers holding
//!   links, network CPU) from graph, configs and machine;
//! - [`schedule`]: the list scheduler over device and link timelines;
//! - [`collective`]: parameter synchronisation aggregated per lane and phase rather than per
//!   message ([`SyncSimulation`] picks which);
//! - [`cpu_host`]: the embedded CPU runtime's threads and cores (actor threads, shared cores,
//!   dispatch delays, averaged over seeded draws where they spread), which only a machine with
//!   measured runtime costs or shared cores needs.
//!
//! The makespan of the schedule is the simulated step time. Eq. 1 sums every term as if nothing
//! overlapped but leaves out dispatch, folds and updates, so the simulated time is usually at most
//! the Eq. 1 time plus those; on one device it is exactly that sum.
//!
//! `tasks` builds one graph through a sink: named [`Task`]s for traces and tests ([`simulate`]),
//! or flat [`CompactTasks`] for what `plan` prints ([`simulated_step_time`]), bit for bit the same
//! step time.

pub mod collective;
pub mod cpu_host;
pub mod schedule;
pub mod tasks;

pub use cpu_host::{
    DISPATCH_DRAWS, Pools, list_schedule_dispatched, list_schedule_pools, list_schedule_shared,
};
pub use schedule::list_schedule;
pub use tasks::{CompactTasks, Resource, Task, TaskKind, task_graph};

use crate::config::ParallelConfig;
use crate::cost::CostModel;
use crate::machine::MachineModel;
use cpu_host::schedule_iteration;
use schedule::Scheduled;
use tasks::build_tasks;

/// How the simulator schedules parameter synchronisation (every other task is the same either
/// way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncSimulation {
    /// One task per message, as the runtime sends them: the reference.
    PerMessage,
    /// One task per lane and phase of each replicated slice ([`collective`]): a few tasks per
    /// device where per message there are as many as devices, within 3% of the reference on the
    /// zoo (`planner/tests/sync_simulation.rs`).
    Collective,
    /// Per message up to [`PER_MESSAGE_UP_TO_DEVICES`] devices, where it costs little and stays the
    /// reference, collective above.
    #[default]
    Auto,
}

/// The most devices [`SyncSimulation::Auto`] simulates message by message.
pub const PER_MESSAGE_UP_TO_DEVICES: usize = 64;

impl SyncSimulation {
    /// The names `plan --sync-sim` takes.
    pub const NAMES: [(&'static str, SyncSimulation); 3] = [
        ("per-message", SyncSimulation::PerMessage),
        ("collective", SyncSimulation::Collective),
        ("auto", SyncSimulation::Auto),
    ];

    /// The simulation named `name` (one of [`SyncSimulation::NAMES`]).
    pub fn parse(name: &str) -> Result<SyncSimulation, String> {
        SyncSimulation::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, s)| s)
            .ok_or_else(|| {
                let known: Vec<&str> = SyncSimulation::NAMES.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown sync simulation `{name}`; expected one of: {}",
                    known.join(", ")
                )
            })
    }

    /// [`SyncSimulation::PerMessage`] or [`SyncSimulation::Collective`]: what runs on `machine`.
    /// A machine that charges its transport's CPU per message ([`MachineModel::network_cpu`]: a
    /// measured cluster) is simulated per message whatever was asked.
    pub fn resolve(self, machine: &MachineModel) -> SyncSimulation {
        if machine.network_cpu().is_some() {
            return SyncSimulation::PerMessage;
        }
        match self {
            SyncSimulation::Auto if machine.num_devices() <= PER_MESSAGE_UP_TO_DEVICES => {
                SyncSimulation::PerMessage
            }
            SyncSimulation::Auto => SyncSimulation::Collective,
            chosen => chosen,
        }
    }
}

/// A scheduled iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    pub tasks: Vec<Task>,
    /// Start and finish of each task, seconds.
    pub start: Vec<f64>,
    pub finish: Vec<f64>,
    /// The simulated step time. With a measured spread of dispatch delays
    /// ([`crate::runtime_costs::RuntimeCosts::dispatch_bins_s`]) it is the mean over
    /// [`DISPATCH_DRAWS`] schedules, each op's delay drawn from the spread, and `start` and
    /// `finish` are the draw closest to it.
    pub makespan: f64,
}

/// Builds and schedules one iteration of `configs` (by layer id), every task named: for traces
/// and for reading the schedule. [`simulated_step_time`] gives the same step time without them.
pub fn simulate(model: &CostModel, configs: &[ParallelConfig]) -> Simulation {
    let tasks = task_graph(model, configs);
    let compact = CompactTasks::from_tasks(&tasks);
    let Scheduled { makespan, times } = schedule_iteration(model.machine(), compact, true);
    let (start, finish) = times.expect("recorded");
    Simulation {
        tasks,
        start,
        finish,
        makespan,
    }
}

/// [`Simulation::makespan`] of [`simulate`], bit for bit, without naming or keeping the tasks and
/// their times: what `plan` prints, for machines where an iteration has tens of millions of
/// tasks (every message of a parameter's synchronisation is one).
pub fn simulated_step_time(model: &CostModel, configs: &[ParallelConfig]) -> f64 {
    let mut tasks = CompactTasks::for_devices(model.machine().num_devices());
    build_tasks(model, configs, &mut tasks);
    schedule_iteration(model.machine(), tasks, false).makespan
}

/// The tasks of one iteration of `configs`: what one simulation schedules.
pub fn task_count(model: &CostModel, configs: &[ParallelConfig]) -> usize {
    let mut tasks = CompactTasks::for_devices(model.machine().num_devices());
    build_tasks(model, configs, &mut tasks);
    tasks.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{MachineModel, NetworkCpu};
    use crate::provider::RooflineCost;
    use crate::runtime_costs::RuntimeCosts;
    use legion_ops::op::{Conv2d, Dense, Pool2d};
    use legion_ops::{Dim, Graph, GraphBuilder, Shape};
    use std::collections::BTreeMap;

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
        // Eq. 1 leaves out folds and updates; one device runs everything back to back.
        let runtime: f64 = sim
            .tasks
            .iter()
            .filter(|t| matches!(t.kind, TaskKind::Fold | TaskKind::Update))
            .map(|t| t.duration)
            .sum();
        assert!(runtime > 0.0);
        let eq1 = model.total(&configs) + runtime;
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
    fn messages_between_nodes_cost_cpu_at_both_ends_on_the_shared_cores() {
        let g = chain();
        // sample-parallel over 2 nodes of 1 device: every parameter syncs between the nodes
        let configs: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 2, 0))
            .collect();
        let base = MachineModel::from_flags(2, 1, None, None)
            .unwrap()
            .with_compute_slots(1)
            .unwrap();
        assert_ne!(base.node_of(0), base.node_of(1));
        // slow enough that the transport, not the wire, decides when a message has arrived
        let cpu = NetworkCpu {
            send_s_per_byte: 2e-9,
            recv_s_per_byte: 3e-9,
        };
        let charged = base.clone().with_network_cpu(cpu).unwrap();
        let run = |machine: &MachineModel| {
            let provider = RooflineCost::new(machine);
            simulate(&CostModel::new(&g, machine, &provider), &configs)
        };
        let (free, sim) = (run(&base), run(&charged));
        assert!(!free.tasks.iter().any(|t| t.kind == TaskKind::Network));
        let messages: Vec<usize> = (0..sim.tasks.len())
            .filter(|&t| sim.tasks[t].kind == TaskKind::Sync)
            .collect();
        assert!(!messages.is_empty());
        for &m in &messages {
            let task = &sim.tasks[m];
            let Resource::Link(from, to) = task.resource else {
                panic!("{task:?}")
            };
            // the send and the receive work, pushed just before the transfer
            let (send, recv) = (&sim.tasks[m - 2], &sim.tasks[m - 1]);
            assert_eq!(send.resource, Resource::Network(base.node_of(from)));
            assert_eq!(recv.resource, Resource::Network(base.node_of(to)));
            assert_eq!(send.duration, task.bytes as f64 * 2e-9);
            assert_eq!(recv.duration, task.bytes as f64 * 3e-9);
            assert_eq!((&send.deps, &recv.deps), (&task.deps, &task.deps));
            // whoever reads the message waits for all three
            for reader in sim.tasks.iter().filter(|r| r.deps.contains(&m)) {
                assert!(reader.deps.contains(&(m - 1)) && reader.deps.contains(&(m - 2)));
            }
        }
        // one core: the transport's work never runs beside a kernel or another's work (an
        // actor's copy may: see
        // `a_copy_with_every_core_busy_starts_at_once_and_delays_that_cores_next_work`)
        let mut busy: Vec<(f64, f64)> = (0..sim.tasks.len())
            .filter(|&t| sim.tasks[t].duration > 0.0)
            .filter(|&t| sim.tasks[t].kind != TaskKind::Move)
            .filter(|&t| !matches!(sim.tasks[t].resource, Resource::Link(..)))
            .map(|t| (sim.start[t], sim.finish[t]))
            .collect();
        busy.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in busy.windows(2) {
            assert!(w[1].0 >= w[0].1 - 1e-15, "{w:?}");
        }
        assert!(sim.makespan > free.makespan);
    }

    #[test]
    fn a_shared_nic_serialises_the_messages_between_two_nodes() {
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
        let per_pair = run(&MachineModel::preset("paper-pairs:8").unwrap());
        let shared = run(&MachineModel::preset("paper:8").unwrap());
        let cross_links = |sim: &Simulation| {
            let mut links: Vec<Resource> = sim
                .tasks
                .iter()
                .filter_map(|t| match t.resource {
                    Resource::Link(a, b) if a / 4 != b / 4 => Some(t.resource),
                    Resource::Lanes(..) => Some(t.resource),
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
        // fc's sync messages between the nodes, one a block each way through its relays, queue
        // on the NICs where a link per pair carries them side by side, so they end later on the
        // whole (the last waits for the slowest device either way, and the step hides them)
        let sync_ends = |sim: &Simulation| {
            (0..sim.tasks.len())
                .filter(|&t| sim.tasks[t].kind == TaskKind::Sync)
                .filter(|&t| sim.tasks[t].name.starts_with("fc "))
                .filter(|&t| match sim.tasks[t].resource {
                    Resource::Link(a, b) => a / 4 != b / 4,
                    Resource::Lanes(..) => true,
                    _ => false,
                })
                .map(|t| sim.finish[t])
                .sum::<f64>()
        };
        assert!(sync_ends(&shared) > sync_ends(&per_pair));
        assert!(shared.makespan >= per_pair.makespan);
    }

    /// Four GPUs of node 0 send their quarters of the batch to four GPUs of node 1: over a link per
    /// pair the four copies run at once; through the nodes' one NIC each they queue back to back.
    #[test]
    fn four_senders_through_one_nic_queue_in_the_simulator() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nc(16, 1024)).unwrap();
        let x = m.dense("a", x, Dense::new(256)).unwrap();
        let x = m.dense("b", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        let g = m.finish();
        let on = |first| ParallelConfig::split(Dim::N, 4, first);
        let configs = vec![on(0), on(0), on(4), on(4)];
        let copies = |machine: &str| {
            let machine = MachineModel::preset(machine).unwrap();
            let provider = RooflineCost::new(&machine);
            let sim = simulate(&CostModel::new(&g, &machine, &provider), &configs);
            let mut spans: Vec<(f64, f64)> = (0..sim.tasks.len())
                .filter(|&t| sim.tasks[t].kind == TaskKind::Copy)
                .map(|t| (sim.start[t], sim.finish[t]))
                .collect();
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            spans
        };
        // a's 4 × 256 outputs per tile, 4 KiB, at 12.5 GB/s
        let one = (4 * 256 * 4) as f64 / 12.5e9;
        let pairs = copies("paper-pairs:8");
        assert_eq!(pairs.len(), 4);
        assert!(
            pairs
                .iter()
                .all(|&(s, f)| s == pairs[0].0 && (f - s - one).abs() < 1e-15)
        );
        let shared = copies("paper:8");
        assert_eq!(shared.len(), 4);
        for (i, w) in shared.windows(2).enumerate() {
            assert_eq!(w[1].0, w[0].1, "copy {} starts as copy {i} ends", i + 1);
        }
        let span = shared[3].1 - shared[0].0;
        assert!((span - 4.0 * one).abs() < 1e-15, "{span} vs {}", 4.0 * one);
    }

    #[test]
    fn the_step_time_alone_is_the_named_simulations_bit_for_bit() {
        let g = chain();
        let mut mixed: Vec<_> = g
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(Dim::N, 4, 0))
            .collect();
        mixed[1] = ParallelConfig::split(Dim::H, 4, 0);
        mixed[5] = ParallelConfig::split(Dim::C, 2, 2);
        let spread = Some(std::array::from_fn(|i| (i + 1) as f64 * 1e-6));
        let machines = [
            MachineModel::preset("paper:4").unwrap(),
            measured_cpu(4, 2e-6),
            measured_cpu_spread(4, 2e-6, spread),
            MachineModel::from_flags(2, 2, None, None)
                .unwrap()
                .with_network_cpu(NetworkCpu {
                    send_s_per_byte: 2e-9,
                    recv_s_per_byte: 3e-9,
                })
                .unwrap(),
        ];
        for machine in &machines {
            let provider = RooflineCost::new(machine);
            let model = CostModel::new(&g, machine, &provider);
            let step = simulated_step_time(&model, &mixed);
            assert_eq!(step.to_bits(), simulate(&model, &mixed).makespan.to_bits());
        }
    }

    #[test]
    fn latency_delays_a_message_without_holding_its_link() {
        let message = |name: &str, deps: Vec<usize>| Task {
            name: name.into(),
            kind: TaskKind::Copy,
            resource: Resource::Link(0, 1),
            duration: 1.0,
            bytes: 4,
            latency: 10.0,
            deps,
            collective: None,
        };
        let read = |deps: Vec<usize>| Task {
            name: "read".into(),
            kind: TaskKind::Forward,
            resource: Resource::Device(1),
            duration: 2.0,
            bytes: 0,
            latency: 0.0,
            deps,
            collective: None,
        };
        // Two messages in a row: the second goes on the wire as soon as the first has left, and
        // each arrives one latency after it left; the reader waits for both.
        let tasks = vec![message("a", vec![]), message("b", vec![]), read(vec![0, 1])];
        let (start, finish) = list_schedule(&tasks);
        assert_eq!(start, vec![0.0, 1.0, 12.0]);
        assert_eq!(finish, vec![1.0, 2.0, 14.0]);
    }

    #[test]
    fn a_message_holds_its_link_for_its_bytes_and_arrives_a_latency_later() {
        let g = chain();
        let machine = MachineModel::preset("paper-pairs:8").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        // the first layers on device 0, the rest on device 4 (another node)
        let configs: Vec<_> = (0..g.layers().len())
            .map(|l| ParallelConfig::split(Dim::N, 1, if l < 2 { 0 } else { 4 }))
            .collect();
        let sim = simulate(&model, &configs);
        let link = machine.link(0, 4).unwrap();
        let mut crossings = 0;
        for (t, task) in sim.tasks.iter().enumerate() {
            if task.resource == Resource::Link(0, 4) || task.resource == Resource::Link(4, 0) {
                crossings += 1;
                assert_eq!(task.duration, task.bytes as f64 * link.seconds_per_byte());
                assert_eq!(task.latency, link.latency_s);
                // the step is not over before the message has arrived
                assert!(sim.makespan >= sim.finish[t] + link.latency_s);
                // whatever reads it starts no earlier than its arrival
                for (r, reader) in sim.tasks.iter().enumerate() {
                    if reader.deps.contains(&t) {
                        assert!(
                            sim.start[r] >= sim.finish[t] + link.latency_s,
                            "{}",
                            reader.name
                        );
                    }
                }
            }
        }
        assert!(crossings >= 2, "forward and backward cross the nodes");
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
        // dependencies are respected and resources never run two tasks at once (a device's
        // actor, which runs its moves, and its kernel stream apart)
        for (t, task) in sim.tasks.iter().enumerate() {
            for &d in &task.deps {
                assert!(sim.start[t] >= sim.finish[d]);
            }
        }
        let mut by_resource: BTreeMap<(Resource, bool), Vec<(f64, f64)>> = BTreeMap::new();
        for (t, task) in sim.tasks.iter().enumerate() {
            by_resource
                .entry((task.resource, task.kind == TaskKind::Move))
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
        // One core runs every compute task back to back (the actors' copies are not on the pool).
        let busy: f64 = one
            .tasks
            .iter()
            .filter(|t| matches!(t.resource, Resource::Device(_)) && t.kind != TaskKind::Move)
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
            if matches!(task.resource, Resource::Device(_))
                && task.kind != TaskKind::Move
                && task.duration > 0.0
            {
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

    fn tiny() -> Graph {
        let mut m = GraphBuilder::new("tiny");
        let x = m.input("data", Shape::nc(4, 8)).unwrap();
        let x = m.dense("fc", x, Dense::new(2)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    fn measured_cpu(devices: usize, dispatch_s: f64) -> MachineModel {
        measured_cpu_spread(devices, dispatch_s, None)
    }

    fn measured_cpu_spread(
        devices: usize,
        dispatch_s: f64,
        dispatch_bins_s: Option<[f64; crate::runtime_costs::DISPATCH_BINS]>,
    ) -> MachineModel {
        MachineModel::preset(&format!("local-cpu:{devices}"))
            .unwrap()
            .with_runtime_costs(RuntimeCosts {
                dispatch_s,
                runtime_cpu_s: 0.0,
                fold_bytes_per_s: 1e9,
                update_bytes_per_s: 2e9,
                copy_bytes_per_s: 4e9,
                dispatch_bins_s,
                actor_threads: 1,
            })
            .unwrap()
    }

    /// (name, seconds) of the fold and update tasks, sorted by name.
    fn folds_and_updates(sim: &Simulation) -> Vec<(String, f64)> {
        of_kinds(sim, &[TaskKind::Fold, TaskKind::Update])
    }

    /// (name, seconds) of the tasks of `kinds`, sorted by name.
    fn of_kinds(sim: &Simulation, kinds: &[TaskKind]) -> Vec<(String, f64)> {
        let mut out: Vec<_> = sim
            .tasks
            .iter()
            .filter(|t| kinds.contains(&t.kind))
            .map(|t| (t.name.clone(), t.duration))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn close(got: &[(String, f64)], want: &[(&str, f64)]) {
        assert_eq!(got.len(), want.len(), "{got:?}");
        for ((name, t), (want_name, want_t)) in got.iter().zip(want) {
            assert_eq!(name, want_name);
            assert!(
                (t - want_t).abs() <= 1e-9 * want_t,
                "{name}: {t} vs {want_t}"
            );
        }
    }

    #[test]
    fn folds_and_updates_of_replicated_slices_are_priced_by_the_measured_throughputs() {
        // fc: weight [2, 8], bias [2]; both halves of the batch hold all of it, so each device
        // owns one row: 8 floats (32 B) of weight and 1 float (4 B) of bias.
        let g = tiny();
        let machine = measured_cpu(2, 0.0);
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let configs = vec![ParallelConfig::split(Dim::N, 2, 0); 3];
        let sim = simulate(&model, &configs);
        // fc's output gradient per tile: [2, 2] = 16 B, one (local) term of 16 B from the loss:
        // 32 B at 1 GB/s. Weight block: 2 terms, (2 + 1) · 32 B = 96 B folded, 5 · 32 = 160 B
        // updated at 2 GB/s; bias block: 3 · 4 = 12 B and 5 · 4 = 20 B.
        close(
            &folds_and_updates(&sim),
            &[
                ("fc grad sum 0", 32e-9),
                ("fc grad sum 1", 32e-9),
                ("fc param 0 grad sum on 0", 96e-9),
                ("fc param 0 grad sum on 1", 96e-9),
                ("fc param 0 update on 0", 80e-9),
                ("fc param 0 update on 1", 80e-9),
                ("fc param 1 grad sum on 0", 12e-9),
                ("fc param 1 grad sum on 1", 12e-9),
                ("fc param 1 update on 0", 10e-9),
                ("fc param 1 update on 1", 10e-9),
            ],
        );
        // the update waits for its fold, which waits for the other replica's gradient
        let at = |name: &str| sim.tasks.iter().position(|t| t.name == name).unwrap();
        let fold = at("fc param 0 grad sum on 0");
        assert!(sim.start[at("fc param 0 update on 0")] >= sim.finish[fold]);
        assert!(sim.start[fold] >= sim.finish[at("fc param 0 grad 1 → 0")]);
        // no backward task for the input layer, whose gradient nobody reads
        assert!(!sim.tasks.iter().any(|t| t.name.starts_with("data bwd")));
        // Each row is a block of the replicas' whole slice: gathered out of it to send, copied
        // into the owner's and stored into the other replica's after the update, at 4 GB/s.
        // Activations need no copies: each tile reads exactly what the tile before wrote.
        close(
            &of_kinds(&sim, &[TaskKind::Move]),
            &[
                ("copy fc param 0 on 0", 8e-9),
                ("copy fc param 0 on 1", 8e-9),
                ("copy fc param 1 on 0", 1e-9),
                ("copy fc param 1 on 1", 1e-9),
                ("gather fc param 0 grad 0 → 1", 8e-9),
                ("gather fc param 0 grad 1 → 0", 8e-9),
                ("gather fc param 1 grad 0 → 1", 1e-9),
                ("gather fc param 1 grad 1 → 0", 1e-9),
                ("store fc param 0 value 0 → 1", 8e-9),
                ("store fc param 0 value 1 → 0", 8e-9),
                ("store fc param 1 value 0 → 1", 1e-9),
                ("store fc param 1 value 1 → 0", 1e-9),
            ],
        );
        let store = at("store fc param 0 value 1 → 0");
        assert_eq!(sim.tasks[store].resource, Resource::Device(0));
        assert!(sim.start[store] >= sim.finish[at("fc param 0 value 1 → 0")]);
    }

    #[test]
    fn unshared_slices_are_folded_and_updated_where_they_live() {
        // fc split by output feature: each device alone holds one row of weight and bias.
        let g = tiny();
        let machine = measured_cpu(2, 0.0);
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let configs = vec![
            ParallelConfig::serial(0),
            ParallelConfig::split(Dim::C, 2, 0),
            ParallelConfig::serial(0),
        ];
        let sim = simulate(&model, &configs);
        // fc tile t: [4, 1] = 16 B, one term from the loss on device 0 (a gradient copy for
        // tile 1): 32 B. Unshared weight row: one term, 2 · 32 B folded, 160 B updated.
        close(
            &folds_and_updates(&sim),
            &[
                ("fc grad sum 0", 32e-9),
                ("fc grad sum 1", 32e-9),
                ("fc param 0 grad sum on 0", 64e-9),
                ("fc param 0 grad sum on 1", 64e-9),
                ("fc param 0 update on 0", 80e-9),
                ("fc param 0 update on 1", 80e-9),
                ("fc param 1 grad sum on 0", 8e-9),
                ("fc param 1 grad sum on 1", 8e-9),
                ("fc param 1 update on 0", 10e-9),
                ("fc param 1 update on 1", 10e-9),
            ],
        );
        assert!(!sim.tasks.iter().any(|t| t.kind == TaskKind::Sync));
        let at = |name: &str| sim.tasks.iter().position(|t| t.name == name).unwrap();
        assert!(sim.start[at("fc grad sum 1")] >= sim.finish[at("fc 1 ← loss 0")]);
        assert!(sim.start[at("fc bwd 1")] >= sim.finish[at("fc grad sum 1")]);
        // The loss on device 0 reads fc's whole output: tile 0 is copied into that instance, tile
        // 1 stored into it on arrival; its gradient piece for tile 1 is gathered out of the loss's
        // whole input gradient. 16 B each at 4 GB/s; fc tile 1 reads the data instance whole.
        close(
            &of_kinds(&sim, &[TaskKind::Move]),
            &[
                ("fc 0 → loss 0", 4e-9),
                ("gather fc 1 ← loss 0", 4e-9),
                ("store fc 1 → loss 0", 4e-9),
            ],
        );
        let dispatched = list_schedule_dispatched(&sim.tasks, None, 1.0).0;
        let gather = at("gather fc 1 ← loss 0");
        assert_eq!(
            dispatched[gather],
            dispatched[at("loss bwd 0")] + sim.tasks[at("loss bwd 0")].duration,
            "a move pays no dispatch"
        );
    }

    #[test]
    fn a_piece_of_one_instance_into_a_piece_of_another_on_one_device_is_copied_once() {
        // conv1 split by rows, conv2 by columns: on each device the overlap of conv1's tile with
        // conv2's input (rows of one half, columns of the other plus the halo) is part of both
        // instances, and the runtime copies it straight across.
        let mut m = GraphBuilder::new("turn");
        let x = m.input("data", Shape::nchw(2, 3, 8, 8)).unwrap();
        let x = m.conv2d("conv1", x, Conv2d::new(4, 3).padding(1)).unwrap();
        let x = m.conv2d("conv2", x, Conv2d::new(4, 3).padding(1)).unwrap();
        let x = m.flatten("flat", x).unwrap();
        let x = m.dense("fc", x, Dense::new(2)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        let g = m.finish();
        let machine = measured_cpu(2, 0.0);
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let mut configs = vec![ParallelConfig::serial(0); g.layers().len()];
        configs[1] = ParallelConfig::split(Dim::H, 2, 0);
        configs[2] = ParallelConfig::split(Dim::W, 2, 0);
        let sim = simulate(&model, &configs);
        // 2 samples × 4 channels × 4 rows × 5 columns = 160 floats, 640 B once at 4 GB/s.
        let moves = of_kinds(&sim, &[TaskKind::Move]);
        for local in ["conv1 0 → conv2 0", "conv1 1 → conv2 1"] {
            let (_, seconds) = moves.iter().find(|(n, _)| n == local).unwrap();
            assert!((seconds - 160e-9).abs() <= 1e-18, "{local}: {seconds}");
        }
    }

    #[test]
    fn simulate_charges_the_measured_dispatch_per_compute_task() {
        let g = tiny();
        let configs = vec![ParallelConfig::serial(0); 3];
        let run = |dispatch| {
            let machine = measured_cpu(1, dispatch);
            let provider = RooflineCost::new(&machine);
            simulate(&CostModel::new(&g, &machine, &provider), &configs)
        };
        let (free, paid) = (run(0.0), run(1e-3));
        // one device, everything in a chain: forward ×3 (data, fc, loss), backward ×2 (fc,
        // loss), fc's gradient fold, fold + update of weight and bias: 10 dispatches
        let compute = paid
            .tasks
            .iter()
            .filter(|t| matches!(t.resource, Resource::Device(_)))
            .count();
        assert_eq!(compute, 10);
        assert!(
            (paid.makespan - free.makespan - 10e-3).abs() < 1e-12,
            "{} vs {}",
            paid.makespan,
            free.makespan
        );
    }

    #[test]
    fn spread_dispatch_delays_cost_parallel_paths_more_than_their_mean() {
        let g = tiny();
        let run = |configs: &[ParallelConfig], bins| {
            let machine = measured_cpu_spread(2, 1e-3, bins);
            let provider = RooflineCost::new(&machine);
            simulate(&CostModel::new(&g, &machine, &provider), configs)
        };
        let mut spread = [0.0; crate::runtime_costs::DISPATCH_BINS];
        spread[8..].fill(2e-3);
        // one chain on one device: drawn delays add up to about their mean times the ops
        let serial = vec![ParallelConfig::serial(0); 3];
        let (mean, drawn) = (run(&serial, None), run(&serial, Some(spread)));
        assert!((drawn.makespan - mean.makespan).abs() < 2e-3, "{drawn:?}");
        // two devices each on their own path: the step waits for the slower, so it costs more
        // than every op paying the mean
        let split = vec![ParallelConfig::split(Dim::N, 2, 0); 3];
        let (mean, drawn) = (run(&split, None), run(&split, Some(spread)));
        assert!(
            drawn.makespan > mean.makespan + 1e-3,
            "{} vs {}",
            drawn.makespan,
            mean.makespan
        );
        // seeded: the same every time, and the schedule returned is one of the draws
        assert_eq!(run(&split, Some(spread)), drawn);
        let last = drawn.finish.iter().copied().fold(0.0, f64::max);
        assert!((last - drawn.makespan).abs() < 2e-3);
        // no spread: the schedule with the mean delay (up to the rounding of averaging)
        let flat = run(&split, Some([1e-3; crate::runtime_costs::DISPATCH_BINS]));
        assert!((flat.makespan - mean.makespan).abs() < 1e-12);
        assert_eq!((flat.start, flat.finish), (mean.start, mean.finish));
    }
}
