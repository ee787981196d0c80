//! A simulated training iteration: the task graph the runtime would execute for a strategy,
//! list-scheduled on the machine.
//!
//! Tasks (durations from the cost provider, the links and the machine's [`RuntimeCosts`]), one per
//! compute op the runtime's device programs run:
//! - forward compute of every tile, on its device (the input layer's is loading the batch);
//! - a copy per (producer tile → consumer tile) overlap on different devices, on the link between
//!   them (same-device overlaps are plain dependencies). The runtime keeps a producer's output as
//!   one instance of its tile and a consumer's input as one instance of the rect it reads: an
//!   overlap that is only part of the first is gathered out of it on the sender's actor, one that
//!   is only part of the second is stored into it on the receiver's actor (a same-device overlap
//!   that is part of either is one local copy, straight from instance to instance); these are
//!   [`TaskKind::Move`] tasks on the device;
//! - per tile of every layer whose output gradient is read (every layer but the input and the
//!   last), a fold: the sum of the gradient terms its consumers' tiles contributed (local ones and
//!   the gradient copies from other devices, each gathered out of the consumer's input gradient
//!   when it is a part of it), which its backward reads; one fold per fragment of the tile, the
//!   pieces the runtime's dependence analysis cuts the gradient into along every rect written
//!   into it (each fragment is folded apart, and each fold pays a dispatch), streaming
//!   [`fold_bytes`] of its terms over its rect;
//! - on a machine that measured its transport's CPU ([`MachineModel::network_cpu`]), per message
//!   between nodes, that work at each end: a [`TaskKind::Network`] task on the sending and on the
//!   receiving node's network threads ([`Resource::Network`], one task at a time per node), ready
//!   with the message and running while it is on the wire; the message has arrived when the
//!   transfer and both have finished;
//! - backward compute of every tile but the input layer's, after its forward and its fold
//!   (gradient copies run on the reverse links; none go to the input layer);
//! - parameter synchronisation per replica group exactly as [`crate::sync`] describes: gradient
//!   messages replica → owner, the owner's fold of the k replicas' gradients and its SGD update,
//!   updated slices owner → replica (a block that is part of the replicas' whole slice is gathered
//!   out of it before its gradient is sent, and the new block is copied into the owner's slice and
//!   stored into each replica's). A slice only one tile uses is folded (its one term) and
//!   updated on that tile's device. Folds and updates stream [`fold_bytes`] and [`update_bytes`] at
//!   the measured throughputs, or at the device's memory bandwidth where the machine was not
//!   profiled: negligible on a GPU, a real share of a CPU step.
//!
//! Scheduling: each device runs one compute task at a time and each directed link carries one
//! message at a time (on a machine with shared node links, every message from one node to another
//! queues on the same link) for `bytes / bandwidth`; the link's latency then delays the message's
//! arrival without holding the link, so messages in a row pay it once, not once each, as on the
//! wire. A task is ready when its dependencies have finished (and arrived), and every resource serves
//! its tasks in the order they became ready (ties by task number, which follows the program order).
//! A compute task starts [`RuntimeCosts::dispatch_s`] after its device could start it (its device
//! actor handling the previous op's completion, handing the kernel to the pool); where the profile
//! measured how those delays spread ([`RuntimeCosts::dispatch_bins_s`]), each task's delay is
//! drawn from the spread and the step time is the mean over [`DISPATCH_DRAWS`] seeded schedules.
//! Moves run on the device's actor, beside the device's kernel: they hold the actor (the device's
//! next kernel is dispatched only after them and after its previous kernel) and one of the
//! [`RuntimeCosts::actor_threads`] the actors share, and pay no dispatch; a compute task also
//! needs a free actor thread before its dispatch starts ([`Pools`]).
//! On a machine whose devices share a pool of cores ([`MachineModel::compute_slots`], the embedded
//! cluster, or hosts on one machine), a compute task or a node's network work also needs one of
//! the cores, so N devices on fewer cores do not compute N tiles at once. An actor's copy takes a
//! free core; with every core busy it runs at once all the same, on a core the OS shares with a
//! kernel, and the work that core runs next starts that much later. The dispatch's last
//! [`RuntimeCosts::runtime_cpu_s`] (the runtime's own CPU per op: message handling, waking and
//! parking threads) is work on the core the kernel then uses. The rest of the measured dispatch
//! is mostly waking a thread onto an idle core; a compute task that becomes startable with every
//! core busy does not pay it: its threads queue behind running ones, and its kernel starts
//! `runtime_cpu_s` after a core frees. Durations
//! are the tasks' own seconds (the profiler takes out the share of the cores a task lost to
//! others), so running fewer of them at full speed is the OS's fair sharing seen from each task's
//! end. A task held back by its device takes, of the cores free by then, the one freed last, so a
//! core idle since earlier stays free for a task that can use it. The makespan is the simulated
//! step time. Eq. 1 sums every term as if nothing overlapped but leaves out dispatch, folds and
//! updates, so the simulated time is usually at most the Eq. 1 time plus those; on one device it
//! is exactly that sum.

use crate::config::{ParallelConfig, tile_rect};
use crate::cost::CostModel;
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, MachineModel, RuntimeCosts, fold_bytes, update_bytes};
use crate::sync::{SyncPlan, param_slices};
use crate::transfer::edge_overlaps;
use legion_ops::rng::Rng;
use legion_ops::{Graph, LayerId, Rect};
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
    /// Parameter synchronisation messages: gradient to the owner, new values back.
    Sync,
    /// A sum of gradient terms (activation or parameter gradients) on a device.
    Fold,
    /// The SGD update of a parameter slice (block) on its owner.
    Update,
    /// Data copied on a device's actor: a piece gathered out of an instance to send, a received
    /// piece stored into a larger instance, a local copy between instances.
    Move,
    /// The transport's CPU work for a message between nodes, on one end's network threads.
    Network,
}

impl TaskKind {
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Forward => "forward",
            TaskKind::Backward => "backward",
            TaskKind::Copy => "copy",
            TaskKind::GradientCopy => "gradient",
            TaskKind::Sync => "sync",
            TaskKind::Fold => "fold",
            TaskKind::Update => "update",
            TaskKind::Move => "move",
            TaskKind::Network => "network",
        }
    }
}

/// Where a task runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Device(DeviceId),
    /// The directed link `from → to`.
    Link(DeviceId, DeviceId),
    /// A node's network threads (by node index): the transport's CPU work for the messages it
    /// sends and receives ([`MachineModel::network_cpu`]).
    Network(usize),
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
    /// Seconds between the task's end and its result reaching the tasks that depend on it, holding
    /// no resource: a message's latency over its link, which carries the next message meanwhile
    /// (a link is a pipe; only `bytes / bandwidth` occupies it).
    pub latency: f64,
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
    /// The simulated step time. With a measured spread of dispatch delays
    /// ([`RuntimeCosts::dispatch_bins_s`]) it is the mean over [`DISPATCH_DRAWS`] schedules, each
    /// op's delay drawn from the spread, and `start` and `finish` are the draw closest to it.
    pub makespan: f64,
}

/// A task less its name and dependencies.
#[derive(Clone, Copy, Debug, PartialEq)]
struct TaskSpec {
    kind: TaskKind,
    resource: Resource,
    duration: f64,
    bytes: u64,
    latency: f64,
}

impl TaskSpec {
    /// A task on `device` that moves nothing over a link.
    fn on_device(kind: TaskKind, device: DeviceId, duration: f64) -> TaskSpec {
        TaskSpec {
            kind,
            resource: Resource::Device(device),
            duration,
            bytes: 0,
            latency: 0.0,
        }
    }
}

/// Where [`build_tasks`] puts the iteration's tasks: named [`Task`]s, or [`CompactTasks`], which
/// never calls the names.
trait TaskSink {
    /// Adds a task that runs after `deps` and returns its number; `name` is called only by a sink
    /// that keeps names.
    fn push(&mut self, task: TaskSpec, name: impl FnOnce() -> String, deps: &[usize]) -> usize;
    /// Makes `task` wait for `dep` as well.
    fn depend(&mut self, task: usize, dep: usize);
}

impl TaskSink for Vec<Task> {
    fn push(&mut self, task: TaskSpec, name: impl FnOnce() -> String, deps: &[usize]) -> usize {
        self.push(Task {
            name: name(),
            kind: task.kind,
            resource: task.resource,
            duration: task.duration,
            bytes: task.bytes,
            latency: task.latency,
            deps: deps.to_vec(),
        });
        self.len() - 1
    }

    fn depend(&mut self, task: usize, dep: usize) {
        self[task].deps.push(dep);
    }
}

/// A task graph as the scheduler reads it, in flat arrays: no names, no bytes, no vector per task.
/// An iteration on a thousand devices has tens of millions of tasks; as [`Task`]s (a name and a
/// dependency vector each) they took over 10 GiB.
#[derive(Clone, Debug, Default)]
pub struct CompactTasks {
    /// Each task's index in `works`.
    work: Vec<u32>,
    /// The distinct (kind, seconds) pairs tasks have: most are messages of a few sizes.
    works: Vec<(TaskKind, f64)>,
    work_index: FastHashMap<(TaskKind, u64), u32>,
    /// Each task's index in `places`.
    place: Vec<u32>,
    /// (task, dependency), in the order they were added.
    deps: Vec<(u32, u32)>,
    /// The distinct (resource index, latency) pairs tasks have: a message's latency is its link's.
    places: Vec<(u32, f64)>,
    place_index: FastHashMap<(Resource, u64), u32>,
    /// The distinct resources, by index.
    resources: Vec<Resource>,
    resource_index: FastHashMap<Resource, u32>,
    /// Devices numbered below this have their resources' places in `dense_places`.
    dense_devices: usize,
    /// By [`CompactTasks::dense_slot`]: the first place of each resource ([`NO_PLACE`] if none
    /// yet). A link's messages look their place up here: through `place_index`, a table of a
    /// million links, each was a cache miss, a third of building the tasks of a thousand devices.
    dense_places: Vec<u32>,
}

/// [`CompactTasks::dense_places`] of a resource with no task yet.
const NO_PLACE: u32 = u32::MAX;

/// The most devices whose links [`CompactTasks::for_devices`] indexes densely (64 MiB).
const MOST_DENSE_DEVICES: usize = 4096;

impl CompactTasks {
    /// An empty graph for a machine of `devices`, indexing their links densely if not too many.
    pub fn for_devices(devices: usize) -> CompactTasks {
        if devices > MOST_DENSE_DEVICES {
            return CompactTasks::default();
        }
        CompactTasks {
            dense_devices: devices,
            dense_places: vec![NO_PLACE; devices + devices * devices + devices],
            ..CompactTasks::default()
        }
    }

    /// Where `resource` is in `dense_places`, if there: devices, then links by (from, to), then
    /// nodes (no more nodes than devices).
    fn dense_slot(&self, resource: Resource) -> Option<usize> {
        let n = self.dense_devices;
        match resource {
            Resource::Device(d) if d < n => Some(d),
            Resource::Link(a, b) if a < n && b < n => Some(n + a * n + b),
            Resource::Network(node) if node < n => Some(n + n * n + node),
            _ => None,
        }
    }

    /// The index in `places` of (`resource`, `latency`), added if new.
    fn place_of(&mut self, resource: Resource, latency: f64) -> u32 {
        let slot = self.dense_slot(resource);
        if let Some(slot) = slot {
            let p = self.dense_places[slot];
            if p != NO_PLACE && self.places[p as usize].1.to_bits() == latency.to_bits() {
                return p;
            }
        }
        let key = (resource, latency.to_bits());
        if let Some(&p) = self.place_index.get(&key) {
            return p;
        }
        let next = task_number(self.resources.len());
        let index = *self.resource_index.entry(resource).or_insert(next);
        if index == next {
            self.resources.push(resource);
        }
        self.places.push((index, latency));
        let p = task_number(self.places.len() - 1);
        self.place_index.insert(key, p);
        if let Some(slot) = slot
            && self.dense_places[slot] == NO_PLACE
        {
            self.dense_places[slot] = p;
        }
        p
    }

    /// `tasks` as the scheduler reads them.
    pub fn from_tasks(tasks: &[Task]) -> CompactTasks {
        let mut compact = CompactTasks::default();
        for t in tasks {
            let spec = TaskSpec {
                kind: t.kind,
                resource: t.resource,
                duration: t.duration,
                bytes: t.bytes,
                latency: t.latency,
            };
            TaskSink::push(&mut compact, spec, String::new, &t.deps);
        }
        compact
    }

    pub fn len(&self) -> usize {
        self.work.len()
    }

    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }

    fn resource_of(&self, task: usize) -> u32 {
        self.places[self.place[task] as usize].0
    }

    fn latency_of(&self, task: usize) -> f64 {
        self.places[self.place[task] as usize].1
    }

    fn kind_of(&self, task: usize) -> TaskKind {
        self.works[self.work[task] as usize].0
    }

    fn duration_of(&self, task: usize) -> f64 {
        self.works[self.work[task] as usize].1
    }
}

/// A task number as the compact graph stores it.
fn task_number(task: usize) -> u32 {
    u32::try_from(task).expect("fewer than 2^32 tasks")
}

impl TaskSink for CompactTasks {
    fn push(&mut self, task: TaskSpec, _name: impl FnOnce() -> String, deps: &[usize]) -> usize {
        let id = self.work.len();
        let place = self.place_of(task.resource, task.latency);
        let next = task_number(self.works.len());
        let work = *self
            .work_index
            .entry((task.kind, task.duration.to_bits()))
            .or_insert(next);
        if work == next {
            self.works.push((task.kind, task.duration));
        }
        self.work.push(work);
        self.place.push(place);
        for &d in deps {
            self.deps.push((task_number(id), task_number(d)));
        }
        id
    }

    fn depend(&mut self, task: usize, dep: usize) {
        self.deps.push((task_number(task), task_number(dep)));
    }
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

/// The step time of `tasks` on `machine` and, if `record`, the start and finish of each task (of
/// the draw closest to the mean where dispatch delays are drawn; see [`Simulation::makespan`]).
fn schedule_iteration(machine: &MachineModel, tasks: CompactTasks, record: bool) -> Scheduled {
    let pools = Pools::of(machine);
    let tasks = Schedulable::new(tasks);
    let Some(bins) = machine.runtime_costs().and_then(|c| c.dispatch_bins_s) else {
        return schedule(&tasks, &pools, |_| pools.dispatch_s, record);
    };
    // Seeded, so a strategy simulates to the same time every run.
    let mut rng = Rng::new(DISPATCH_SEED);
    let draws: Vec<Scheduled> = (0..DISPATCH_DRAWS)
        .map(|_| {
            let delays: Vec<f64> = (0..tasks.tasks.len())
                .map(|_| bins[rng.below(bins.len())])
                .collect();
            schedule(&tasks, &pools, |t| delays[t], record)
        })
        .collect();
    let spans: Vec<f64> = draws.iter().map(|d| d.makespan).collect();
    let makespan = spans.iter().sum::<f64>() / spans.len() as f64;
    let closest = (0..spans.len())
        .min_by(|&a, &b| {
            (spans[a] - makespan)
                .abs()
                .total_cmp(&(spans[b] - makespan).abs())
        })
        .expect("at least one draw");
    let times = draws.into_iter().nth(closest).expect("a draw").times;
    Scheduled { makespan, times }
}

/// Schedules [`simulate`] averages over when dispatch delays vary: enough that the mean's own
/// spread (a few tenths of a percent on LeNet-5 and AlexNet) is well below the model's error.
pub const DISPATCH_DRAWS: usize = 32;
const DISPATCH_SEED: u64 = 0x6469_7370_6174_6368;

/// The task graph of one iteration, in program order.
pub fn task_graph(model: &CostModel, configs: &[ParallelConfig]) -> Vec<Task> {
    let mut tasks = Vec::new();
    build_tasks(model, configs, &mut tasks);
    tasks
}

/// Builds the task graph of one iteration into `tasks`, in program order (see [`TaskSink`]).
fn build_tasks(model: &CostModel, configs: &[ParallelConfig], tasks: &mut impl TaskSink) {
    let graph = model.graph();
    let machine = model.machine();
    let provider = model.provider();
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
            let task = TaskSpec::on_device(TaskKind::Forward, device, times.forward);
            f.push(tasks.push(task, || format!("{} fwd {t}", layer.name), &[]));
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
        let (src_tiles, needed) = edge_rects(graph, e, &configs[e.src.0], &configs[e.dst.0]);
        for o in overlaps {
            let mut from = forward[e.src.0][o.src_tile];
            let to = forward[e.dst.0][o.dst_tile];
            // The producer's instance is its tile, the consumer's its whole input rect: a piece of
            // either is copied out of or into it on the device's actor.
            let gathered = o.rect != src_tiles[o.src_tile];
            let stored = o.rect != needed[o.dst_tile];
            let names = || {
                format!(
                    "{} {} → {} {}",
                    graph.layer(e.src).name,
                    o.src_tile,
                    graph.layer(e.dst).name,
                    o.dst_tile
                )
            };
            if o.is_local() {
                // On one device the runtime copies a piece straight from instance to instance.
                let dep = if gathered || stored {
                    let bytes = o.bytes();
                    move_task(tasks, machine, names, o.src_device, bytes, &[from])
                } else {
                    from
                };
                tasks.depend(to, dep);
                continue;
            }
            if gathered {
                from = move_task(
                    tasks,
                    machine,
                    || format!("gather {}", names()),
                    o.src_device,
                    o.bytes(),
                    &[from],
                );
            }
            let mut arrived = message(
                tasks,
                machine,
                names,
                TaskKind::Copy,
                (o.src_device, o.dst_device),
                o.bytes(),
                from,
            );
            if stored {
                arrived = Arrived::one(move_task(
                    tasks,
                    machine,
                    || format!("store {}", names()),
                    o.dst_device,
                    o.bytes(),
                    arrived.tasks(),
                ));
            }
            for &a in arrived.tasks() {
                tasks.depend(to, a);
            }
        }
    }
    // Backward in reverse layer order (the order the runtime launches them); the input layer has
    // none.
    let mut backward: Vec<Vec<usize>> = vec![Vec::new(); graph.layers().len()];
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        if id == graph.input() {
            continue;
        }
        let layer = graph.layer(id);
        let config = &configs[id.0];
        for t in 0..config.total() {
            let device = config.device_of_tile(t);
            let task = TaskSpec::on_device(TaskKind::Backward, device, backward_time[id.0][t]);
            let name = || format!("{} bwd {t}", layer.name);
            backward[id.0].push(tasks.push(task, name, &[forward[id.0][t]]));
        }
    }
    // The gradient terms of each tile's output: (task producing the term, bytes of the term, its
    // rect in the tensor).
    let mut terms: Vec<Vec<Vec<(usize, u64, Rect)>>> = configs
        .iter()
        .map(|c| vec![Vec::new(); c.total()])
        .collect();
    // The rects written into each layer's output gradient, in the runtime's launch order.
    let mut written: Vec<Vec<Rect>> = vec![Vec::new(); configs.len()];
    for (e, overlaps) in edges.iter().rev() {
        if !e.carries_gradient(graph) {
            continue;
        }
        let (_, needed) = edge_rects(graph, e, &configs[e.src.0], &configs[e.dst.0]);
        written[e.src.0].extend(needed.iter().filter(|r| !r.is_empty()));
        for o in overlaps {
            let mut from = backward[e.dst.0][o.dst_tile];
            if o.is_local() {
                terms[e.src.0][o.src_tile].push((from, o.bytes(), o.rect));
                continue;
            }
            // The consumer's gradient instance is its whole input rect; the producer receives the
            // term whole (a staging instance the fold reads).
            let names = || {
                format!(
                    "{} {} ← {} {}",
                    graph.layer(e.src).name,
                    o.src_tile,
                    graph.layer(e.dst).name,
                    o.dst_tile
                )
            };
            if o.rect != needed[o.dst_tile] {
                from = move_task(
                    tasks,
                    machine,
                    || format!("gather {}", names()),
                    o.dst_device,
                    o.bytes(),
                    &[from],
                );
            }
            let arrived = message(
                tasks,
                machine,
                names,
                TaskKind::GradientCopy,
                (o.dst_device, o.src_device),
                o.bytes(),
                from,
            );
            // the term's bytes once, with the copy (the rest is the transport's CPU work)
            let bytes = std::iter::once(o.bytes()).chain(std::iter::repeat(0));
            terms[e.src.0][o.src_tile].extend(
                arrived
                    .tasks()
                    .iter()
                    .zip(bytes)
                    .map(|(&t, b)| (t, b, o.rect)),
            );
        }
    }
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        let layer = graph.layer(id);
        let config = &configs[id.0];
        let mut fragments = vec![layer.shape.full_rect()];
        for w in &written[id.0] {
            split_fragments(&mut fragments, w);
        }
        for (t, tile_terms) in terms[id.0].iter().enumerate() {
            if tile_terms.is_empty() || backward[id.0].is_empty() {
                continue;
            }
            let device = config.device_of_tile(t);
            let tile = tile_rect(&layer.shape, config, t);
            let cells = split_fragments(&mut fragments, &tile);
            for (k, cell) in cells.iter().enumerate() {
                let covering: Vec<_> = tile_terms
                    .iter()
                    .filter(|(_, _, r)| r.contains(cell))
                    .collect();
                // each term once: a message's transport tasks carry no bytes of their own
                let count = covering.iter().filter(|&&&(_, b, _)| b > 0).count();
                let bytes = fold_bytes(count, 4 * cell.volume() as u64);
                let name = || match cells.len() {
                    1 => format!("{} grad sum {t}", layer.name),
                    _ => format!("{} grad sum {t} part {k}", layer.name),
                };
                let deps: Vec<usize> = covering.iter().map(|&&(d, _, _)| d).collect();
                let duration = fold_time(machine, device, bytes);
                let fold = tasks.push(
                    TaskSpec::on_device(TaskKind::Fold, device, duration),
                    name,
                    &deps,
                );
                tasks.depend(backward[id.0][t], fold);
            }
        }
    }
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        let config = &configs[id.0];
        let plan = SyncPlan::for_layer(graph, id, config);
        // what each group's fold waits for (one vector, reused)
        let mut gathers = Vec::new();
        let name = &graph.layer(id).name;
        // tile of each device of the layer
        let tile_on = |d: DeviceId| backward[id.0][d - config.first_device()];
        let layer = graph.layer(id);
        let params = layer.op.spec().params(&graph.input_shapes(id));
        for g in &plan.groups {
            // Every replica holds the whole slice; the owner updates its block in an instance of
            // its own. A block that is not the whole slice is gathered out of it on each replica
            // and stored back into it on each replica and on the owner.
            let owner_tile = tile_rect(&layer.shape, config, g.owner - config.first_device());
            let partial = layer.op.spec().param_rect(&params[g.param], &owner_tile) != g.slice;
            gathers.clear();
            for &r in &g.replicas {
                let bytes = g.bytes();
                let mut dep = tile_on(r);
                let names = || format!("{name} param {} grad {r} → {}", g.param, g.owner);
                if partial {
                    let gather = || format!("gather {}", names());
                    dep = move_task(tasks, machine, gather, r, bytes, &[dep]);
                }
                let (kind, ends) = (TaskKind::Sync, (r, g.owner));
                let arrived = message(tasks, machine, names, kind, ends, bytes, dep);
                gathers.extend_from_slice(arrived.tasks());
            }
            gathers.push(tile_on(g.owner));
            let update = fold_and_update(
                tasks,
                machine,
                || format!("{name} param {}", g.param),
                g.owner,
                g.replicas.len() + 1,
                g.bytes(),
                &gathers,
            );
            if partial {
                move_task(
                    tasks,
                    machine,
                    || format!("copy {name} param {} on {}", g.param, g.owner),
                    g.owner,
                    g.bytes(),
                    &[update],
                );
            }
            for &r in &g.replicas {
                let bytes = g.bytes();
                let names = || format!("{name} param {} value {} → {r}", g.param, g.owner);
                let (kind, ends) = (TaskKind::Sync, (g.owner, r));
                let arrived = message(tasks, machine, names, kind, ends, bytes, update);
                if partial {
                    let store = || format!("store {}", names());
                    move_task(tasks, machine, store, r, bytes, arrived.tasks());
                }
            }
        }
        for (param, device, bytes) in unshared_slices(graph, id, config) {
            fold_and_update(
                tasks,
                machine,
                || format!("{name} param {param}"),
                device,
                1,
                bytes,
                &[tile_on(device)],
            );
        }
    }
}

/// The owner's fold of a slice's `terms` gradients (its own and the replicas'), after `deps`, then
/// the SGD update of the slice; returns the update. `name` names the slice.
fn fold_and_update(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    name: impl Fn() -> String,
    owner: DeviceId,
    terms: usize,
    slice_bytes: u64,
    deps: &[usize],
) -> usize {
    let duration = fold_time(machine, owner, fold_bytes(terms, slice_bytes));
    let fold = tasks.push(
        TaskSpec::on_device(TaskKind::Fold, owner, duration),
        || format!("{} grad sum on {owner}", name()),
        deps,
    );
    let duration = update_time(machine, owner, slice_bytes);
    tasks.push(
        TaskSpec::on_device(TaskKind::Update, owner, duration),
        || format!("{} update on {owner}", name()),
        &[fold],
    )
}

/// Copying `bytes` on `device`'s actor (a gather out of, or a store into, a larger instance), after
/// `deps`; returns the task.
fn move_task(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    name: impl FnOnce() -> String,
    device: DeviceId,
    bytes: u64,
    deps: &[usize],
) -> usize {
    let rate = machine
        .runtime_costs()
        .map_or(machine.device(device).memory_bytes_per_s(), |c| {
            c.copy_bytes_per_s
        });
    let duration = bytes as f64 / rate;
    tasks.push(
        TaskSpec::on_device(TaskKind::Move, device, duration),
        name,
        deps,
    )
}

/// The producer's tiles and each consumer tile's input rect of `edge` (the instances the runtime
/// keeps on each side).
fn edge_rects(
    graph: &Graph,
    edge: &crate::transfer::Edge,
    src_config: &ParallelConfig,
    dst_config: &ParallelConfig,
) -> (Vec<Rect>, Vec<Rect>) {
    let producer = graph.layer(edge.src);
    let consumer = graph.layer(edge.dst);
    let inputs = graph.input_shapes(edge.dst);
    let src = (0..src_config.total())
        .map(|t| tile_rect(&producer.shape, src_config, t))
        .collect();
    let needed = (0..dst_config.total())
        .map(|t| {
            let out = tile_rect(&consumer.shape, dst_config, t);
            consumer.op.spec().project(&inputs, &out)[edge.input]
        })
        .collect();
    (src, needed)
}

/// Trainable parameter slices of `layer` that only one tile uses (no replica group): (parameter
/// index, the tile's device, f32 bytes of the slice).
fn unshared_slices(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
) -> Vec<(usize, DeviceId, u64)> {
    let mut out = Vec::new();
    for (param, slices) in param_slices(graph, layer, config) {
        for (slice, devices) in slices {
            if let [device] = devices[..]
                && !slice.is_empty()
            {
                out.push((param, device, 4 * slice.volume() as u64));
            }
        }
    }
    out
}

/// Cuts a region's `fragments` along `rect` as the runtime's dependence analysis does
/// (`Analysis::split` in legion-runtime, which folds each fragment of a gradient apart); returns
/// the fragments inside `rect`.
fn split_fragments(fragments: &mut Vec<Rect>, rect: &Rect) -> Vec<Rect> {
    let mut inside = Vec::new();
    for i in 0..fragments.len() {
        let f = fragments[i];
        if rect.contains(&f) {
            inside.push(f);
        } else if f.overlaps(rect) {
            fragments[i] = f.intersect(rect);
            inside.push(fragments[i]);
            fragments.extend(f.subtract(rect));
        }
    }
    inside
}

/// Seconds for `device` to fold: `bytes` as [`fold_bytes`] counts them, at the measured fold
/// throughput (the device's memory bandwidth where not profiled).
fn fold_time(machine: &MachineModel, device: DeviceId, bytes: u64) -> f64 {
    let rate = machine
        .runtime_costs()
        .map_or(machine.device(device).memory_bytes_per_s(), |c| {
            c.fold_bytes_per_s
        });
    bytes as f64 / rate
}

/// Seconds for `owner` to apply SGD to a slice of `slice_bytes` ([`update_bytes`] at the measured
/// update throughput, or the device's memory bandwidth).
fn update_time(machine: &MachineModel, owner: DeviceId, slice_bytes: u64) -> f64 {
    let rate = machine.runtime_costs().map_or(
        machine.device(owner).memory_bytes_per_s(),
        |c: &RuntimeCosts| c.update_bytes_per_s,
    );
    update_bytes(slice_bytes) as f64 / rate
}

/// The tasks a reader of a message waits for: the transfer, then the transport's work at each end
/// where there is some (at most three; no allocation per message).
#[derive(Clone, Copy, Debug)]
struct Arrived {
    ids: [usize; 3],
    len: usize,
}

impl Arrived {
    fn one(task: usize) -> Arrived {
        Arrived {
            ids: [task, 0, 0],
            len: 1,
        }
    }

    fn tasks(&self) -> &[usize] {
        &self.ids[..self.len]
    }
}

/// A message of `bytes` from `ends.0` to `ends.1` once task `after` has finished: the transfer on
/// their link and, between nodes of a machine with [`MachineModel::network_cpu`], the transport's
/// work on the sender's and on the receiver's network threads, which runs while the message is on
/// the wire. Returns the tasks a reader of the message waits for: it has arrived when all have
/// finished. `name` names the message.
fn message(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    name: impl Fn() -> String,
    kind: TaskKind,
    (from, to): (DeviceId, DeviceId),
    bytes: u64,
    after: usize,
) -> Arrived {
    let mut arrived = Arrived {
        ids: [0; 3],
        len: 0,
    };
    if let Some(cpu) = machine.network_cpu()
        && machine.node_of(from) != machine.node_of(to)
    {
        for (end, s_per_byte, side) in [
            (from, cpu.send_s_per_byte, "send"),
            (to, cpu.recv_s_per_byte, "receive"),
        ] {
            let work = TaskSpec {
                kind: TaskKind::Network,
                resource: Resource::Network(machine.node_of(end)),
                duration: bytes as f64 * s_per_byte,
                bytes: 0,
                latency: 0.0,
            };
            arrived.ids[arrived.len] = tasks.push(work, || format!("{side} {}", name()), &[after]);
            arrived.len += 1;
        }
    }
    let l = machine.link(from, to);
    let transfer = TaskSpec {
        kind,
        resource: link(machine, from, to),
        duration: l.map_or(0.0, |l| bytes as f64 * l.seconds_per_byte()),
        bytes,
        latency: l.map_or(0.0, |l| l.latency_s),
    };
    // the transfer first (it carries the bytes), then the two ends' work
    arrived.ids.rotate_right(1);
    arrived.ids[0] = tasks.push(transfer, name, &[after]);
    arrived.len += 1;
    arrived
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
    list_schedule_dispatched(tasks, compute_slots, 0.0)
}

/// The thread pools a schedule shares between devices, and the dispatch cost (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pools {
    /// Compute tasks the whole machine runs at once ([`MachineModel::compute_slots`]).
    pub compute_slots: Option<usize>,
    /// Threads the device actors share ([`RuntimeCosts::actor_threads`]): an actor's copy needs
    /// one for its duration, and a compute task one free before it can be dispatched.
    pub actor_threads: Option<usize>,
    /// Seconds between a compute task being startable and its kernel starting.
    pub dispatch_s: f64,
    /// The runtime's CPU per compute task ([`RuntimeCosts::runtime_cpu_s`]): with compute slots,
    /// the end of its dispatch, holding a slot.
    pub runtime_cpu_s: f64,
}

impl Pools {
    /// The pools and dispatch of `machine`.
    pub fn of(machine: &MachineModel) -> Pools {
        let costs = machine.runtime_costs();
        Pools {
            compute_slots: machine.compute_slots(),
            actor_threads: costs.map(|c| c.actor_threads),
            dispatch_s: costs.map_or(0.0, |c| c.dispatch_s),
            runtime_cpu_s: costs.map_or(0.0, |c| c.runtime_cpu_s),
        }
    }
}

/// [`list_schedule_shared`] where every device task starts `dispatch` seconds after it is ready and
/// its device is free, or when a slot frees if that is later (the dispatch overlaps the wait).
pub fn list_schedule_dispatched(
    tasks: &[Task],
    compute_slots: Option<usize>,
    dispatch: f64,
) -> (Vec<f64>, Vec<f64>) {
    list_schedule_pools(
        tasks,
        &Pools {
            compute_slots,
            actor_threads: None,
            dispatch_s: dispatch,
            runtime_cpu_s: 0.0,
        },
    )
}

/// The list schedule of `tasks` under `pools`: a compute task (on a device, not a [`TaskKind::Move`])
/// waits for its device's previous compute task and its device's actor and, with actor threads,
/// for one of them to be free, then for the dispatch, and, if it takes time, for a compute slot
/// (the dispatch overlaps that wait), holding it for the runtime's CPU before its kernel
/// ([`Pools::runtime_cpu_s`]); when no slot is free as it becomes startable, it waits for the slot
/// and the runtime's CPU only. A move waits for its device's actor and an actor thread and holds
/// both; if it takes time, it holds a free compute slot too, or, with none free, pushes the slot
/// that frees first back by its duration.
pub fn list_schedule_pools(tasks: &[Task], pools: &Pools) -> (Vec<f64>, Vec<f64>) {
    let graph = Schedulable::new(CompactTasks::from_tasks(tasks));
    let done = schedule(&graph, pools, |_| pools.dispatch_s, true);
    done.times.expect("recorded")
}

/// A compact task graph as [`schedule`] reads it, built once for every dispatch draw: each task's
/// successors in one array (`successors[first[t]..first[t + 1]]`; their order does not matter, the
/// ready queue orders by time and task number) and its number of dependencies, the (task,
/// dependency) pairs dropped.
struct Schedulable {
    tasks: CompactTasks,
    first: Vec<u32>,
    successors: Vec<u32>,
    /// Each task's dependencies: 0, 1, or [`SEVERAL`] (then counted in `several_deps`).
    dep_count: Vec<u8>,
    several_deps: FastHashMap<u32, u32>,
}

/// [`Schedulable::dep_count`] of a task with more than one dependency.
const SEVERAL: u8 = 2;

impl Schedulable {
    fn new(mut tasks: CompactTasks) -> Schedulable {
        let mut deps = std::mem::take(&mut tasks.deps);
        // The vectors grew by doubling; give back what they did not fill before the arrays below
        // are allocated beside them (this is the simulation's peak memory).
        deps.shrink_to_fit();
        tasks.work.shrink_to_fit();
        tasks.place.shrink_to_fit();
        let n = tasks.len();
        let mut first: Vec<u32> = vec![0; n + 1];
        let mut dep_count: Vec<u8> = vec![0; n];
        for &(task, dep) in &deps {
            first[dep as usize + 1] += 1;
            let count = &mut dep_count[task as usize];
            *count = (*count + 1).min(SEVERAL);
        }
        for t in 0..n {
            first[t + 1] += first[t];
        }
        let mut successors: Vec<u32> = vec![0; first[n] as usize];
        let mut several_deps: FastHashMap<u32, u32> = FastHashMap::default();
        // `first[d]` serves as dependency d's cursor, ending at the next one's start; shifted back
        // after (no second array of cursors at the peak).
        for &(task, dep) in &deps {
            successors[first[dep as usize] as usize] = task;
            first[dep as usize] += 1;
            if dep_count[task as usize] == SEVERAL {
                *several_deps.entry(task).or_insert(0) += 1;
            }
        }
        drop(deps);
        first.copy_within(0..n, 1);
        first[0] = 0;
        Schedulable {
            tasks,
            first,
            successors,
            dep_count,
            several_deps,
        }
    }
}

/// A schedule's step time (when the last task's result has arrived) and, where asked for, the
/// start and finish of every task.
struct Scheduled {
    makespan: f64,
    times: Option<(Vec<f64>, Vec<f64>)>,
}

/// [`list_schedule_pools`] of `tasks` with task `t`'s dispatch taking `dispatch(t)` seconds; keeps
/// each task's start and finish only if `record`.
fn schedule(
    graph: &Schedulable,
    pools: &Pools,
    dispatch: impl Fn(usize) -> f64,
    record: bool,
) -> Scheduled {
    let tasks = &graph.tasks;
    let n = tasks.len();
    // when each resource is free, by index
    let mut resources: Vec<f64> = vec![0.0; tasks.resources.len()];
    let device_of: Vec<Option<DeviceId>> = tasks
        .resources
        .iter()
        .map(|r| match *r {
            Resource::Device(d) => Some(d),
            _ => None,
        })
        .collect();
    let uses_core_at: Vec<bool> = tasks
        .resources
        .iter()
        .map(|r| matches!(r, Resource::Device(_) | Resource::Network(_)))
        .collect();
    // (dependencies left, when the last so far arrives) of the tasks with several that some but
    // not all of have finished: few at a time, where a vector per task took 12 bytes of each.
    let mut partly_ready: FastHashMap<u32, (u32, f64)> = FastHashMap::default();
    let (mut start, mut finish) = match record {
        true => (vec![0.0; n], vec![0.0; n]),
        false => (Vec::new(), Vec::new()),
    };
    let mut makespan = 0.0f64;
    let mut ready = ReadyQueue::default();
    for t in (0..n).filter(|&t| graph.dep_count[t] == 0) {
        ready.push(0.0, task_number(t));
    }
    let mut slots: Vec<f64> = vec![0.0; pools.compute_slots.unwrap_or(0)];
    let mut actors: Vec<f64> = vec![0.0; pools.actor_threads.unwrap_or(0)];
    // The thread for a task that can start at `at`: of those already free then, the one that
    // freed last, so that threads free earlier stay free for tasks that can start earlier (a task
    // held back by its device must not take a thread idle since long before: nothing placed
    // later could use that gap); if none is free yet, the one that frees first. Ties: the lowest.
    let fitting = |pool: &[f64], at: f64| {
        let free = (0..pool.len())
            .filter(|&k| pool[k] <= at)
            .max_by(|&a, &b| pool[a].total_cmp(&pool[b]).then(b.cmp(&a)));
        free.or_else(|| (0..pool.len()).min_by(|&a, &b| pool[a].total_cmp(&pool[b])))
            .expect("a non-empty pool")
    };
    // When each device's actor is free (by the device's resource index): its moves hold it, not
    // the device's kernel stream (the actor copies while the device's kernel runs), and its next
    // kernel waits for both.
    let mut device_actors: Vec<f64> = vec![0.0; tasks.resources.len()];
    while let Some((at, t)) = ready.pop() {
        let t = t as usize;
        let resource = tasks.resource_of(t) as usize;
        let duration = tasks.duration_of(t);
        let on_device = device_of[resource].is_some();
        let is_move = on_device && tasks.kind_of(t) == TaskKind::Move;
        let compute = on_device && !is_move;
        let device_actor = device_actors[resource];
        let free = match is_move {
            true => &mut device_actors[resource],
            false => &mut resources[resource],
        };
        let mut begin = at.max(*free);
        if compute {
            begin = begin.max(device_actor);
        }
        let mut actor = None;
        if on_device && !actors.is_empty() {
            let k = fitting(&actors, begin);
            begin = begin.max(actors[k]);
            if !compute {
                actor = Some(k);
            }
        }
        let pooled = !slots.is_empty() && duration > 0.0 && uses_core_at[resource];
        // The dispatch wakes the device's threads, and waking one onto an idle core is most of its
        // delay. With every core busy, they queue behind running threads and the kernel starts
        // as a core frees, after only the runtime's CPU (below).
        if compute && (!pooled || slots.iter().any(|&free| free <= begin)) {
            begin += dispatch(t);
        }
        // The runtime's work on a compute task ends its dispatch, on the core its kernel then uses.
        let handling = if compute { pools.runtime_cpu_s } else { 0.0 };
        let mut slot = pooled.then(|| fitting(&slots, begin - handling));
        if let Some(k) = slot {
            if is_move && slots[k] > begin {
                // No core is free: the actor copies at once all the same, on a core the OS shares
                // with a kernel, so the copy's CPU comes out of that core's later work.
                slots[k] += duration;
                slot = None;
            } else {
                begin = begin.max(slots[k] + handling);
            }
        }
        let end = begin + duration;
        *free = end;
        if let Some(k) = slot {
            slots[k] = end;
        }
        if let Some(k) = actor {
            actors[k] = end;
        }
        if record {
            start[t] = begin;
            finish[t] = end;
        }
        // the step ends when the last task's result has arrived
        let arrival = end + tasks.latency_of(t);
        makespan = makespan.max(arrival);
        for &s in &graph.successors[graph.first[t] as usize..graph.first[t + 1] as usize] {
            if graph.dep_count[s as usize] == 1 {
                ready.push(arrival, s);
                continue;
            }
            let (left, ready_at) = partly_ready
                .entry(s)
                .or_insert((graph.several_deps[&s], 0.0));
            *ready_at = ready_at.max(arrival);
            *left -= 1;
            if *left == 0 {
                let at = *ready_at;
                partly_ready.remove(&s);
                ready.push(at, s);
            }
        }
    }
    Scheduled {
        makespan,
        times: record.then_some((start, finish)),
    }
}

/// The tasks whose dependencies have finished, served earliest ready time first, ties by task
/// number: by distinct time, each with a heap of task numbers. On a thousand devices millions of
/// messages wait at once, mostly at a few thousand distinct times (every replica sends alike); one
/// heap of (time, task) pairs over all of them was half the schedule's time in cache misses.
#[derive(Debug, Default)]
struct ReadyQueue {
    by_time: BTreeMap<u64, BinaryHeap<Reverse<u32>>>,
    /// Emptied heaps, kept for their allocations.
    spare: Vec<BinaryHeap<Reverse<u32>>>,
}

impl ReadyQueue {
    /// Adds `task`, ready at `at` seconds (not negative).
    fn push(&mut self, at: f64, task: u32) {
        debug_assert!(at >= 0.0);
        // Times are non-negative, so their bit patterns order like the numbers.
        let spare = &mut self.spare;
        self.by_time
            .entry(at.to_bits())
            .or_insert_with(|| spare.pop().unwrap_or_default())
            .push(Reverse(task));
    }

    /// Takes the task ready first (the lowest number among those ready then).
    fn pop(&mut self) -> Option<(f64, u32)> {
        let mut earliest = self.by_time.first_entry()?;
        let Reverse(task) = earliest.get_mut().pop().expect("no empty entries");
        let at = f64::from_bits(*earliest.key());
        if earliest.get().is_empty() {
            self.spare.push(earliest.remove());
        }
        Some((at, task))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{MachineModel, NetworkCpu};
    use crate::provider::RooflineCost;
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
    fn places_are_shared_by_resource_and_latency_dense_or_not() {
        let mut dense = CompactTasks::for_devices(4);
        let mut hashed = CompactTasks::default();
        let resources = [
            (Resource::Link(1, 2), 1e-6),
            (Resource::Device(3), 0.0),
            (Resource::Link(1, 2), 1e-6),
            // the same link at another latency is another place
            (Resource::Link(1, 2), 2e-6),
            (Resource::Link(2, 1), 1e-6),
            (Resource::Network(1), 0.0),
            // beyond the dense devices
            (Resource::Link(9, 2), 1e-6),
            (Resource::Link(1, 2), 2e-6),
        ];
        for tasks in [&mut dense, &mut hashed] {
            let places: Vec<u32> = resources
                .iter()
                .map(|&(r, latency)| tasks.place_of(r, latency))
                .collect();
            assert_eq!(places, [0, 1, 0, 2, 3, 4, 5, 2]);
            assert_eq!(tasks.places[2], (0, 2e-6), "one resource, two latencies");
            assert_eq!(tasks.resources.len(), 5);
        }
    }

    #[test]
    fn the_ready_queue_serves_earliest_time_first_then_lowest_task() {
        // against one heap of (time, task) pairs, on pushes between pops at times before, at and
        // after the last popped
        let mut rng = Rng::new(7);
        let mut queue = ReadyQueue::default();
        let mut reference: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        let mut next_task = 0u32;
        for round in 0..2000 {
            for _ in 0..rng.below(4) {
                let at = rng.below(50) as f64 * 0.25;
                // task numbers unique, not in order of time
                let task = (next_task * 7919) % 100_003;
                next_task += 1;
                queue.push(at, task);
                reference.push(Reverse((at.to_bits(), task)));
            }
            if round % 3 != 0 {
                let want = reference
                    .pop()
                    .map(|Reverse((t, k))| (f64::from_bits(t), k));
                assert_eq!(queue.pop(), want);
            }
        }
        while let Some(Reverse((t, k))) = reference.pop() {
            assert_eq!(queue.pop(), Some((f64::from_bits(t), k)));
        }
        assert_eq!(queue.pop(), None);
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
        };
        let read = |deps: Vec<usize>| Task {
            name: "read".into(),
            kind: TaskKind::Forward,
            resource: Resource::Device(1),
            duration: 2.0,
            bytes: 0,
            latency: 0.0,
            deps,
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
        let machine = MachineModel::preset("paper:8").unwrap();
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
        dispatch_bins_s: Option<[f64; crate::machine::DISPATCH_BINS]>,
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

    /// A forward compute task on `device`.
    fn kernel(name: &str, device: DeviceId, duration: f64, deps: Vec<usize>) -> Task {
        Task {
            name: name.into(),
            ..device_task(TaskKind::Forward, device, duration, deps)
        }
    }

    fn device_task(kind: TaskKind, device: DeviceId, duration: f64, deps: Vec<usize>) -> Task {
        Task {
            name: String::new(),
            kind,
            resource: Resource::Device(device),
            duration,
            bytes: 0,
            latency: 0.0,
            deps,
        }
    }

    #[test]
    fn dispatch_delays_each_compute_task_and_overlaps_the_wait_for_a_slot() {
        let task = kernel;
        let message = Task {
            name: "m".into(),
            kind: TaskKind::Copy,
            resource: Resource::Link(0, 1),
            duration: 1.0,
            bytes: 4,
            latency: 0.0,
            deps: vec![0],
        };
        let tasks = vec![
            task("a", 0, 1.0, vec![]),
            task("b", 1, 1.0, vec![]),
            task("c", 0, 2.0, vec![0]),
            message,
        ];
        // No pool: a and b start after one dispatch; c after a and one more dispatch; messages
        // pay none.
        let (start, finish) = list_schedule_dispatched(&tasks, None, 0.5);
        assert_eq!(start, vec![0.5, 0.5, 2.0, 1.5]);
        assert_eq!(finish, vec![1.5, 1.5, 4.0, 2.5]);
        // One slot: b is dispatched at 0.5 but waits for a's slot until 1.5 (the wait hides its
        // dispatch); c could start at 1.5 + 0.5 but the slot is b's until 2.5.
        let (start, finish) = list_schedule_dispatched(&tasks, Some(1), 0.5);
        assert_eq!(start, vec![0.5, 1.5, 2.5, 1.5]);
        assert_eq!(finish, vec![1.5, 2.5, 4.5, 2.5]);
        // Without dispatch it is the plain schedule.
        assert_eq!(
            list_schedule_dispatched(&tasks, Some(1), 0.0),
            list_schedule_shared(&tasks, Some(1))
        );
    }

    #[test]
    fn a_kernel_ready_while_every_core_is_busy_skips_the_wake_up_latency() {
        let message = |name: &str, from: DeviceId, to: DeviceId, duration: f64| Task {
            name: name.into(),
            kind: TaskKind::Copy,
            resource: Resource::Link(from, to),
            duration,
            bytes: 4,
            latency: 0.0,
            deps: vec![],
        };
        // a and b hold both cores from 0.5 to 1.5; c's input arrives at 1.3, d's at 1.7.
        let tasks = vec![
            kernel("a", 0, 1.0, vec![]),
            kernel("b", 1, 1.0, vec![]),
            message("to c", 0, 2, 1.3),
            kernel("c", 2, 0.5, vec![2]),
            message("to d", 1, 3, 1.7),
            kernel("d", 3, 0.5, vec![4]),
        ];
        let pools = Pools {
            compute_slots: Some(2),
            actor_threads: None,
            dispatch_s: 0.5,
            runtime_cpu_s: 0.1,
        };
        let (start, _) = list_schedule_pools(&tasks, &pools);
        // c is ready with no core idle: it starts as a's core frees, after the runtime's 0.1, not
        // at 1.3 + 0.5. d is ready with b's core idle since 1.5: it pays the whole dispatch.
        assert_eq!([start[3], start[5]], [1.6, 2.2]);
        // Without shared cores, both pay it.
        let (start, _) = list_schedule_pools(
            &tasks,
            &Pools {
                compute_slots: None,
                ..pools
            },
        );
        assert_eq!([start[3], start[5]], [1.8, 2.2]);
    }

    #[test]
    fn runtime_cpu_holds_a_core_before_each_kernel_when_the_cores_are_busy() {
        let tasks = vec![
            kernel("a", 0, 1.0, vec![]),
            kernel("b", 1, 1.0, vec![]),
            kernel("c", 2, 1.0, vec![]),
        ];
        let pools = |runtime_cpu_s| Pools {
            compute_slots: Some(2),
            actor_threads: None,
            dispatch_s: 0.5,
            runtime_cpu_s,
        };
        // a and b find free cores: the runtime's work is inside their dispatch. c waits for a
        // core until 1.5, then for the runtime's 0.25 on it before its kernel.
        let (start, finish) = list_schedule_pools(&tasks, &pools(0.25));
        assert_eq!(start, vec![0.5, 0.5, 1.75]);
        assert_eq!(finish, vec![1.5, 1.5, 2.75]);
        // Without it, c's kernel starts as the core frees.
        let (start, _) = list_schedule_pools(&tasks, &pools(0.0));
        assert_eq!(start, vec![0.5, 0.5, 1.5]);
        // Without shared cores it costs nothing beyond the dispatch.
        let (start, _) = list_schedule_pools(
            &tasks,
            &Pools {
                compute_slots: None,
                ..pools(0.25)
            },
        );
        assert_eq!(start, vec![0.5, 0.5, 0.5]);
    }

    #[test]
    fn actor_threads_serialise_copies_and_hold_back_dispatch() {
        let task = |name: &str, kind, device, duration, deps: Vec<usize>| Task {
            name: name.into(),
            kind,
            resource: Resource::Device(device),
            duration,
            bytes: 0,
            latency: 0.0,
            deps,
        };
        let tasks = vec![
            task("move 0", TaskKind::Move, 0, 2.0, vec![]),
            task("move 1", TaskKind::Move, 1, 2.0, vec![]),
            task("kernel 2", TaskKind::Forward, 2, 1.0, vec![]),
            task("kernel 0", TaskKind::Backward, 0, 1.0, vec![0]),
        ];
        let pools = |actor_threads| Pools {
            compute_slots: Some(2),
            actor_threads,
            dispatch_s: 0.5,
            runtime_cpu_s: 0.0,
        };
        // Two actor threads: both copies at once; kernel 2 finds no free thread until 2, then
        // pays its dispatch; kernel 0 follows its copy, the same way.
        let (start, finish) = list_schedule_pools(&tasks, &pools(Some(2)));
        assert_eq!(start, vec![0.0, 0.0, 2.5, 2.5]);
        assert_eq!(finish, vec![2.0, 2.0, 3.5, 3.5]);
        // One: the copies take turns (move 1 from 2 to 4), and the kernels wait for it.
        let (start, finish) = list_schedule_pools(&tasks, &pools(Some(1)));
        assert_eq!(start, vec![0.0, 2.0, 4.5, 4.5]);
        assert_eq!(finish, vec![2.0, 4.0, 5.5, 5.5]);
        // Without actor threads: copies hold their device and a core, so kernel 2 waits for a
        // core until 2 (its dispatch hidden in the wait).
        let (start, _) = list_schedule_pools(&tasks, &pools(None));
        assert_eq!(start, vec![0.0, 0.0, 2.0, 2.5]);
    }

    #[test]
    fn a_devices_actor_copies_while_its_kernel_runs_and_its_next_kernel_waits_for_both() {
        let task = |kind, duration, deps| device_task(kind, 0, duration, deps);
        let tasks = vec![
            task(TaskKind::Forward, 1.0, vec![]),
            task(TaskKind::Move, 0.5, vec![]),
            task(TaskKind::Move, 1.0, vec![1]),
            task(TaskKind::Forward, 1.0, vec![0]),
        ];
        let (start, finish) = list_schedule(&tasks);
        // The copies run beside the first kernel, one after the other on the actor; the second
        // kernel waits for the stream (free at 1) and for the actor (free at 1.5).
        assert_eq!(start, vec![0.0, 0.0, 0.5, 1.5]);
        assert_eq!(finish, vec![1.0, 0.5, 1.5, 2.5]);
    }

    #[test]
    fn a_copy_with_every_core_busy_starts_at_once_and_delays_that_cores_next_work() {
        let task = device_task;
        let tasks = vec![
            task(TaskKind::Forward, 0, 1.0, vec![]),
            task(TaskKind::Forward, 1, 0.25, vec![]),
            task(TaskKind::Move, 1, 0.5, vec![1]),
            task(TaskKind::Forward, 2, 1.0, vec![]),
        ];
        let pools = Pools {
            compute_slots: Some(1),
            ..Pools::default()
        };
        let (start, finish) = list_schedule_pools(&tasks, &pools);
        // One core: kernel 1 waits for kernel 0. Its copy then finds the core taken by kernel 2
        // (1.25 to 2.25) and runs at once, the OS sharing the core: kernel 2's successors on that
        // core start half a second later, and kernel 2 itself keeps its times.
        assert_eq!(start[..3], [0.0, 1.0, 1.25]);
        assert_eq!(finish[..3], [1.0, 1.25, 1.75]);
        assert_eq!((start[3], finish[3]), (1.25, 2.25));
        let after = vec![
            task(TaskKind::Forward, 0, 1.0, vec![]),
            task(TaskKind::Forward, 1, 0.25, vec![]),
            task(TaskKind::Move, 1, 0.5, vec![1]),
            task(TaskKind::Forward, 2, 1.0, vec![]),
            task(TaskKind::Forward, 3, 1.0, vec![2]),
        ];
        let (start, _) = list_schedule_pools(&after, &pools);
        assert_eq!(start[4], 2.75);
    }

    #[test]
    fn a_task_held_back_by_its_device_leaves_the_longer_idle_core_free() {
        let task = |device, duration, deps: Vec<usize>| Task {
            name: String::new(),
            kind: TaskKind::Forward,
            resource: Resource::Device(device),
            duration,
            bytes: 0,
            latency: 0.0,
            deps,
        };
        // long on device 0, short on device 1; `held` is ready at once but its device is busy
        // until 10; `next` becomes ready at 1, after `held` was placed
        let tasks = vec![
            task(0, 10.0, vec![]),
            task(1, 1.0, vec![]),
            task(0, 1.0, vec![]),
            task(2, 5.0, vec![1]),
        ];
        let (start, finish) = list_schedule_shared(&tasks, Some(2));
        // `held` takes the core the long task frees at 10, not the one idle since 1, which
        // `next` uses at once
        assert_eq!(start, vec![0.0, 0.0, 10.0, 1.0]);
        assert_eq!(finish, vec![10.0, 1.0, 11.0, 6.0]);
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
        let mut spread = [0.0; crate::machine::DISPATCH_BINS];
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
        let flat = run(&split, Some([1e-3; crate::machine::DISPATCH_BINS]));
        assert!((flat.makespan - mean.makespan).abs() < 1e-12);
        assert_eq!((flat.start, flat.finish), (mean.start, mean.finish));
    }
}
