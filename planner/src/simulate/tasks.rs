//! The task graph of one iteration: what the runtime would execute for a strategy, built from
//! the graph, the configs and the machine.
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
//! - under a reduction split, as the runtime lowers one: each tile's forward is its partial (the
//!   op over its block of the input channels); each partial past a block's first sends its
//!   partial sum to the first's device, which folds the block's partials and applies the
//!   activation (a forward task, `finish`), and consumers read the finished block there; in
//!   backward the block's output gradient is folded there and taken through the activation
//!   (`finish bwd`), sent to the block's other partials, and then every partial runs its
//!   backward;
//! - parameter synchronisation per replica group exactly as [`crate::sync`] describes: gradient
//!   messages replica → owner, the owner's fold of the k replicas' gradients and its SGD update,
//!   updated slices owner → replica (a block that is part of the replicas' whole slice is gathered
//!   out of it before its gradient is sent, and the new block is copied into the owner's slice and
//!   stored into each replica's). A slice only one tile uses is folded (its one term) and
//!   updated on that tile's device. Folds and updates stream [`fold_bytes`] and [`update_bytes`] at
//!   the measured throughputs, or at the device's memory bandwidth where the machine was not
//!   profiled: negligible on a GPU, a real share of a CPU step.
//!
//! Folds, updates and moves stream bytes at [`RuntimeCosts`]' measured throughputs where the
//! machine was profiled ([`MachineModel::runtime_costs`]); that is all this module reads of the
//! embedded CPU runtime's costs. How tasks share threads and cores is [`super::cpu_host`]'s.

use super::SyncSimulation;
use super::collective::{CollectiveScratch, join, sync_relayed_slice, sync_slice};
use crate::config::{ParallelConfig, tile_rect};
use crate::cost::CostModel;
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, Lane, MachineModel};
use crate::runtime_costs::{RuntimeCosts, fold_bytes, update_bytes};
use crate::sync::{SyncPlan, owned_blocks, param_slices, relays};
use crate::transfer::{Edge, TileOverlap, edge_overlaps};
use legion_ops::op::{partial_input_shapes, partial_param_rect, project_partial};
use legion_ops::partition::Relay;
use legion_ops::{Graph, Layer, LayerId, Rect};
use std::sync::Arc;

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
    /// The (out, in) lanes a message on a shared route holds together (a NIC's send direction
    /// and another's receive direction, switch ports, or a host bridge twice: see
    /// [`crate::machine::Route`]).
    Lanes(Lane, Lane),
    /// A node's network threads (by node index): the transport's CPU work for the messages it
    /// sends and receives ([`MachineModel::network_cpu`]).
    Network(usize),
    /// A device's private links as a collective's messages arrive over them, side by side
    /// ([`super::collective`]).
    Inbox(DeviceId),
    /// Nothing: a zero-length task that waits for several others ([`super::collective`]).
    Join,
    /// A [`CollectiveTransfer`]'s messages, each holding its own lanes.
    Collective,
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
    /// A collective transfer's messages ([`Resource::Collective`]), `None` for any other task.
    pub collective: Option<CollectiveTransfer>,
}

/// Messages of a parameter's synchronisation on shared lanes, one task for many
/// ([`super::collective`]); the scheduler puts each message on its two lanes as it would put a
/// message task of its own, in the order per-message tasks would take, so that lanes queue alike.
/// Messages between devices with a private link are not in it.
#[derive(Clone, Debug, PartialEq)]
pub enum CollectiveTransfer {
    /// `from`'s message of `bytes` to each of `to` (`from` itself skipped), all ready when the
    /// task is: an owner's updated block back to the replicas.
    Scatter {
        from: DeviceId,
        to: Arc<[DeviceId]>,
        bytes: u64,
    },
    /// One sender's gradient of every block it does not own to the block's owner (`owners[j]`,
    /// `bytes[j]`), ready when the task is, plus the time the sender takes to gather the blocks
    /// before it out of its whole slice where `gathered`. `gather` numbers the slice's gather:
    /// senders ready at one time are served together, their messages interleaved as per-message
    /// tasks' would be; `sender_index` orders them.
    GatherFrom {
        gather: u32,
        sender: DeviceId,
        sender_index: u32,
        owners: Arc<[DeviceId]>,
        bytes: Arc<[u64]>,
        gathered: bool,
    },
    /// After every [`CollectiveTransfer::GatherFrom`] of `gather`: its successors numbered right
    /// after it, one per owner, wait for their owner's messages only; any other for all of them.
    GatherDone { gather: u32 },
}

/// A task less its name and dependencies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct TaskSpec {
    pub(super) kind: TaskKind,
    pub(super) resource: Resource,
    pub(super) duration: f64,
    pub(super) bytes: u64,
    pub(super) latency: f64,
}

impl TaskSpec {
    /// A task on `device` that moves nothing over a link.
    pub(super) fn on_device(kind: TaskKind, device: DeviceId, duration: f64) -> TaskSpec {
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
pub(super) trait TaskSink {
    /// Adds a task that runs after `deps` and returns its number; `name` is called only by a sink
    /// that keeps names.
    fn push(&mut self, task: TaskSpec, name: impl FnOnce() -> String, deps: &[usize]) -> usize;
    /// Makes `task` wait for `dep` as well.
    fn depend(&mut self, task: usize, dep: usize);
    /// Gives task `task`, pushed as a collective, its transfer.
    fn attach_collective(&mut self, task: usize, transfer: CollectiveTransfer);

    /// Adds a collective transfer that starts after `deps` and returns its number.
    fn push_collective(
        &mut self,
        transfer: CollectiveTransfer,
        name: impl FnOnce() -> String,
        deps: &[usize],
    ) -> usize {
        let spec = TaskSpec {
            kind: TaskKind::Sync,
            resource: Resource::Collective,
            duration: 0.0,
            bytes: 0,
            latency: 0.0,
        };
        let task = self.push(spec, name, deps);
        self.attach_collective(task, transfer);
        task
    }
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
            collective: None,
        });
        self.len() - 1
    }

    fn depend(&mut self, task: usize, dep: usize) {
        self[task].deps.push(dep);
    }

    fn attach_collective(&mut self, task: usize, transfer: CollectiveTransfer) {
        self[task].collective = Some(transfer);
    }
}

/// A task graph as the scheduler reads it, in flat arrays: no names, no bytes, no vector per task.
/// An iteration on a thousand devices has tens of millions of tasks; as [`Task`]s (a name and a
/// dependency vector each) they took over 10 GiB.
#[derive(Clone, Debug, Default)]
pub struct CompactTasks {
    /// Each task's index in `works`.
    pub(super) work: Vec<u32>,
    /// The distinct (kind, seconds) pairs tasks have: most are messages of a few sizes.
    works: Vec<(TaskKind, f64)>,
    work_index: FastHashMap<(TaskKind, u64), u32>,
    /// Each task's index in `places`.
    pub(super) place: Vec<u32>,
    /// (task, dependency), in the order they were added.
    pub(super) deps: Vec<(u32, u32)>,
    /// The distinct (resource index, latency) pairs tasks have: a message's latency is its link's.
    places: Vec<(u32, f64)>,
    place_index: FastHashMap<(Resource, u64), u32>,
    /// The distinct resources, by index.
    pub(super) resources: Vec<Resource>,
    resource_index: FastHashMap<Resource, u32>,
    /// Devices numbered below this have their resources' places in `dense_places`.
    dense_devices: usize,
    /// The collective transfers, by task number.
    pub(super) collectives: FastHashMap<u32, CollectiveTransfer>,
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
            match &t.collective {
                Some(c) => compact.push_collective(c.clone(), String::new, &t.deps),
                None => TaskSink::push(&mut compact, spec, String::new, &t.deps),
            };
        }
        compact
    }

    pub fn len(&self) -> usize {
        self.work.len()
    }

    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }

    pub(super) fn resource_of(&self, task: usize) -> u32 {
        self.places[self.place[task] as usize].0
    }

    pub(super) fn latency_of(&self, task: usize) -> f64 {
        self.places[self.place[task] as usize].1
    }

    pub(super) fn kind_of(&self, task: usize) -> TaskKind {
        self.works[self.work[task] as usize].0
    }

    pub(super) fn duration_of(&self, task: usize) -> f64 {
        self.works[self.work[task] as usize].1
    }
}

/// A task number as the compact graph stores it.
pub(super) fn task_number(task: usize) -> u32 {
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

    fn attach_collective(&mut self, task: usize, transfer: CollectiveTransfer) {
        self.collectives.insert(task_number(task), transfer);
    }
}

/// The task graph of one iteration, in program order.
pub fn task_graph(model: &CostModel, configs: &[ParallelConfig]) -> Vec<Task> {
    let mut tasks = Vec::new();
    build_tasks(model, configs, &mut tasks);
    tasks
}

/// Builds the task graph of one iteration into `tasks`, in program order (see [`TaskSink`]): each
/// tile's forward, the activations' moves between tiles, each tile's backward, the gradients'
/// moves and folds, and the parameters' sync.
pub(super) fn build_tasks(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
) {
    let forward = forward_tasks(model, configs, tasks);
    let edges = edges_with_overlaps(model, configs);
    activation_moves(model, configs, tasks, &edges, &forward);
    let backward = backward_tasks(model, configs, tasks, &forward);
    let gradients = gradient_moves(model, configs, tasks, &edges, &backward);
    gradient_folds(model, configs, tasks, &gradients, &backward);
    parameter_sync(model, configs, tasks, &backward);
}

/// Each tile's forward task (`forward[l][t]` reads the tile's inputs; `output[l][t]` makes its
/// output: the same task but under a reduction split, where the block's first partial finishes
/// the summed block), and each tile's backward time.
struct ForwardTasks {
    forward: Vec<Vec<usize>>,
    output: Vec<Vec<usize>>,
    backward_time: Vec<Vec<f64>>,
}

/// Each tile's backward task, and under a reduction split, per tile, the first partial's finish
/// of the block's gradient (what the block's output-gradient fold feeds; none elsewhere).
struct BackwardTasks {
    backward: Vec<Vec<usize>>,
    finish_backward: Vec<Vec<usize>>,
}

/// The gradient terms of each tile's output (the task producing the term, the term's bytes, its
/// rect in the tensor), and the rects written into each layer's output gradient, in the
/// runtime's launch order.
struct GradientTerms {
    terms: Vec<Vec<Vec<(usize, u64, Rect)>>>,
    written: Vec<Vec<Rect>>,
}

/// Every edge of the graph with its tile overlaps under the configs.
type EdgeOverlaps = Vec<(Edge, Vec<TileOverlap>)>;

fn forward_tasks(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
) -> ForwardTasks {
    let graph = model.graph();
    let machine = model.machine();
    let provider = model.provider();
    let mut forward: Vec<Vec<usize>> = Vec::new();
    let mut output: Vec<Vec<usize>> = Vec::new();
    let mut backward_time: Vec<Vec<f64>> = Vec::new();
    for id in graph.ids() {
        let layer = graph.layer(id);
        let config = &configs[id.0];
        let red = config.reduction();
        let mut f = Vec::new();
        let mut b = Vec::new();
        for t in 0..config.total() {
            let rect = tile_rect(&layer.shape, config, t);
            let device = config.device_of_tile(t);
            let times = match red {
                1 => provider.phase_times(layer, model.input_shapes(id), &rect, device),
                _ => {
                    let inputs =
                        partial_input_shapes(model.input_shapes(id), config.reduction_of(t), red);
                    provider.phase_times(layer, &inputs, &rect, device)
                }
            };
            let task = TaskSpec::on_device(TaskKind::Forward, device, times.forward);
            f.push(tasks.push(task, || format!("{} fwd {t}", layer.name), &[]));
            b.push(times.backward);
        }
        let out = match red {
            1 => f.clone(),
            _ => finish_partial_sums(tasks, machine, layer, config, &f),
        };
        forward.push(f);
        output.push(out);
        backward_time.push(b);
    }
    ForwardTasks {
        forward,
        output,
        backward_time,
    }
}

fn edges_with_overlaps(model: &CostModel, configs: &[ParallelConfig]) -> EdgeOverlaps {
    let graph = model.graph();
    model
        .edges()
        .iter()
        .map(|e| {
            (
                *e,
                edge_overlaps(graph, e, &configs[e.src.0], &configs[e.dst.0]),
            )
        })
        .collect()
}

/// Each activation's moves from its producer's tiles to its consumers' (copies on one device,
/// messages between devices, gathered out of or stored into the instances that hold them).
fn activation_moves(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
    edges: &EdgeOverlaps,
    forward: &ForwardTasks,
) {
    let ForwardTasks {
        forward, output, ..
    } = forward;
    let graph = model.graph();
    let machine = model.machine();
    // activations and their gradients move at the machine's precision (2 bytes in bf16)
    let element = machine.activation_bytes();
    for (e, overlaps) in edges {
        let (src_tiles, needed) = edge_rects(graph, e, &configs[e.src.0], &configs[e.dst.0]);
        for o in overlaps {
            let mut from = output[e.src.0][o.src_tile];
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
                    let bytes = o.bytes(element);
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
                    o.bytes(element),
                    &[from],
                );
            }
            let mut arrived = message(
                tasks,
                machine,
                names,
                TaskKind::Copy,
                (o.src_device, o.dst_device),
                o.bytes(element),
                from,
            );
            if stored {
                arrived = Arrived::one(move_task(
                    tasks,
                    machine,
                    || format!("store {}", names()),
                    o.dst_device,
                    o.bytes(element),
                    arrived.tasks(),
                ));
            }
            for &a in arrived.tasks() {
                tasks.depend(to, a);
            }
        }
    }
}

/// Each tile's backward task, in reverse layer order (the order the runtime launches them); the
/// input layer has none.
fn backward_tasks(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
    forward: &ForwardTasks,
) -> BackwardTasks {
    let ForwardTasks {
        forward,
        output,
        backward_time,
    } = forward;
    let graph = model.graph();
    let machine = model.machine();
    let mut backward: Vec<Vec<usize>> = vec![Vec::new(); graph.layers().len()];
    // Under a reduction split, per tile: the first partial's finish of the block's gradient
    // (what the block's output-gradient fold feeds), `usize::MAX` elsewhere.
    let mut finish_backward: Vec<Vec<usize>> = vec![Vec::new(); graph.layers().len()];
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        if id == graph.input() {
            continue;
        }
        let layer = graph.layer(id);
        let config = &configs[id.0];
        if config.reduction() > 1 {
            let (finishes, partials) = partial_backward(
                tasks,
                machine,
                layer,
                config,
                (&forward[id.0], &output[id.0]),
                &backward_time[id.0],
            );
            // the block's output gradient is folded before its first partial's finish
            finish_backward[id.0] = finishes;
            backward[id.0] = partials;
            continue;
        }
        for t in 0..config.total() {
            let device = config.device_of_tile(t);
            let task = TaskSpec::on_device(TaskKind::Backward, device, backward_time[id.0][t]);
            let name = || format!("{} bwd {t}", layer.name);
            backward[id.0].push(tasks.push(task, name, &[forward[id.0][t]]));
        }
    }
    BackwardTasks {
        backward,
        finish_backward,
    }
}

/// Each gradient term's move from its consumer's tile to its producer's.
fn gradient_moves(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
    edges: &EdgeOverlaps,
    backward: &BackwardTasks,
) -> GradientTerms {
    let backward = &backward.backward;
    let graph = model.graph();
    let machine = model.machine();
    // activations and their gradients move at the machine's precision (2 bytes in bf16)
    let element = machine.activation_bytes();
    let mut terms: Vec<Vec<Vec<(usize, u64, Rect)>>> = configs
        .iter()
        .map(|c| vec![Vec::new(); c.total()])
        .collect();
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
                terms[e.src.0][o.src_tile].push((from, o.bytes(element), o.rect));
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
                    o.bytes(element),
                    &[from],
                );
            }
            let arrived = message(
                tasks,
                machine,
                names,
                TaskKind::GradientCopy,
                (o.dst_device, o.src_device),
                o.bytes(element),
                from,
            );
            // the term's bytes once, with the copy (the rest is the transport's CPU work)
            let bytes = std::iter::once(o.bytes(element)).chain(std::iter::repeat(0));
            terms[e.src.0][o.src_tile].extend(
                arrived
                    .tasks()
                    .iter()
                    .zip(bytes)
                    .map(|(&t, b)| (t, b, o.rect)),
            );
        }
    }
    GradientTerms { terms, written }
}

/// The folds of each tile's gradient terms, by the cells the written rects cut it into, before
/// the tile's backward reads them.
fn gradient_folds(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
    gradients: &GradientTerms,
    backward: &BackwardTasks,
) {
    let GradientTerms { terms, written } = gradients;
    let BackwardTasks {
        backward,
        finish_backward,
    } = backward;
    let graph = model.graph();
    let machine = model.machine();
    // activations and their gradients move at the machine's precision (2 bytes in bf16)
    let element = machine.activation_bytes();
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
                let bytes = fold_bytes(count, element * cell.volume() as u64);
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
                let reader = match finish_backward[id.0].get(t) {
                    Some(&finish) => finish,
                    None => backward[id.0][t],
                };
                tasks.depend(reader, fold);
            }
        }
    }
}

/// The sync of every replicated parameter slice: per message (gradients to the owner of each
/// block and values back) or as collectives, as the model's sync simulation says.
fn parameter_sync(
    model: &CostModel,
    configs: &[ParallelConfig],
    tasks: &mut impl TaskSink,
    backward: &BackwardTasks,
) {
    let backward = &backward.backward;
    let graph = model.graph();
    let machine = model.machine();
    let detail = model.sync_simulation().resolve(machine);
    let mut scratch = match detail {
        SyncSimulation::Collective => Some(CollectiveScratch::new(machine)),
        _ => None,
    };
    let nodes = machine.nodes();
    for id in (0..graph.layers().len()).rev().map(LayerId) {
        let config = &configs[id.0];
        if let Some(scratch) = scratch.as_mut() {
            let name = &graph.layer(id).name;
            let tile_on = |d: DeviceId| backward[id.0][d - config.first_device()];
            for (param, slices) in param_slices(graph, id, config) {
                for (slice, devices) in slices {
                    if devices.len() > 1 && !slice.is_empty() {
                        let blocks = owned_blocks(&slice, &devices);
                        let names = || format!("{name} param {param}");
                        let routes: Vec<Vec<Relay>> = blocks
                            .iter()
                            .map(|&(_, owner)| {
                                let replicas: Vec<DeviceId> =
                                    devices.iter().copied().filter(|&d| d != owner).collect();
                                relays(owner, &replicas, &nodes)
                            })
                            .collect();
                        match routes.iter().all(Vec::is_empty) {
                            true => sync_slice(
                                tasks, machine, scratch, &names, &slice, &devices, &blocks,
                                &tile_on,
                            ),
                            false => sync_relayed_slice(
                                tasks, machine, scratch, &names, &slice, &devices, &blocks,
                                &routes, &tile_on,
                            ),
                        }
                    }
                }
            }
            sync_unshared_slices(tasks, machine, graph, id, config, &tile_on);
            continue;
        }
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
            let owner_at = g.owner - config.first_device();
            let owner_tile = tile_rect(&layer.shape, config, owner_at);
            let (r, red) = (config.reduction_of(owner_at), config.reduction());
            let owner_slice = partial_param_rect(
                layer.op.spec(),
                g.param,
                &params[g.param],
                &owner_tile,
                r,
                red,
            );
            let partial = owner_slice != Some(g.slice);
            let relays = relays(g.owner, &g.replicas, &nodes);
            gathers.clear();
            // each relay's members to it, its sum of them and its own term to the owner
            for relay in &relays {
                let (bytes, at) = (g.bytes(), relay.device);
                let mut terms = vec![tile_on(at)];
                for &m in &relay.members {
                    let mut dep = tile_on(m);
                    let names = || format!("{name} param {} grad {m} → relay {at}", g.param);
                    if partial {
                        let gather = || format!("gather {}", names());
                        dep = move_task(tasks, machine, gather, m, bytes, &[dep]);
                    }
                    let arrived =
                        message(tasks, machine, names, TaskKind::Sync, (m, at), bytes, dep);
                    terms.extend_from_slice(arrived.tasks());
                }
                let duration = fold_time(machine, at, fold_bytes(relay.members.len() + 1, bytes));
                let names = || format!("{name} param {} grad sum on relay {at}", g.param);
                let mut dep = tasks.push(
                    TaskSpec::on_device(TaskKind::Fold, at, duration),
                    names,
                    &terms,
                );
                let names = || format!("{name} param {} grad {at} → {}", g.param, g.owner);
                if partial {
                    let gather = || format!("gather {}", names());
                    dep = move_task(tasks, machine, gather, at, bytes, &[dep]);
                }
                let ends = (at, g.owner);
                let arrived = message(tasks, machine, names, TaskKind::Sync, ends, bytes, dep);
                gathers.extend_from_slice(arrived.tasks());
            }
            let relayed = |r: DeviceId| relays.iter().any(|relay| relay.members.contains(&r));
            let relay = |r: DeviceId| relays.iter().any(|relay| relay.device == r);
            for &r in g.replicas.iter().filter(|&&r| !relayed(r) && !relay(r)) {
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
            let terms = g.replicas.iter().filter(|&&r| !relayed(r)).count() + 1;
            let update = fold_and_update(
                tasks,
                machine,
                || format!("{name} param {}", g.param),
                g.owner,
                terms,
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
            for &r in g.replicas.iter().filter(|&&r| !relayed(r)) {
                let bytes = g.bytes();
                let names = || format!("{name} param {} value {} → {r}", g.param, g.owner);
                let (kind, ends) = (TaskKind::Sync, (g.owner, r));
                let arrived = message(tasks, machine, names, kind, ends, bytes, update);
                let mut held: Vec<usize> = arrived.tasks().to_vec();
                if partial {
                    let store = || format!("store {}", names());
                    held = vec![move_task(tasks, machine, store, r, bytes, arrived.tasks())];
                }
                // a relay passes the new values on to its members
                for relay in relays.iter().filter(|relay| relay.device == r) {
                    for &m in &relay.members {
                        let names = || format!("{name} param {} value relay {r} → {m}", g.param);
                        let mut dep = held.clone();
                        if partial {
                            let gather = || format!("gather {}", names());
                            dep = vec![move_task(tasks, machine, gather, r, bytes, &held)];
                        }
                        let after = join(tasks, || format!("{} ready", names()), &dep);
                        let ends = (r, m);
                        let arrived = message(tasks, machine, names, kind, ends, bytes, after);
                        if partial {
                            let store = || format!("store {}", names());
                            move_task(tasks, machine, store, m, bytes, arrived.tasks());
                        }
                    }
                }
            }
        }
        sync_unshared_slices(tasks, machine, graph, id, config, &tile_on);
    }
}

/// The fold (of its one term) and update of each parameter slice of layer `id` that only one
/// tile uses, on that tile's device after its backward (`tile_on`).
fn sync_unshared_slices(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    graph: &Graph,
    id: LayerId,
    config: &ParallelConfig,
    tile_on: &dyn Fn(DeviceId) -> usize,
) {
    let name = &graph.layer(id).name;
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

/// A reduction split's forward after its partials (`partials[t]`, tile by tile), as the runtime
/// lowers it: each partial past a block's first sends its partial sum to the first's device,
/// which folds the block's partials and applies the activation (`Finish`). Returns, per tile, the
/// task after which the tile's output is complete (the finish, on a block's first partial).
fn finish_partial_sums(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    layer: &Layer,
    config: &ParallelConfig,
    partials: &[usize],
) -> Vec<usize> {
    let red = config.reduction();
    let mut out = partials.to_vec();
    for first in (0..config.total()).step_by(red) {
        let block = tile_rect(&layer.shape, config, first);
        let bytes = machine.activation_bytes() * block.volume() as u64;
        let device = config.device_of_tile(first);
        let mut terms = vec![partials[first]];
        for (t, &partial) in partials
            .iter()
            .enumerate()
            .take(first + red)
            .skip(first + 1)
        {
            let names = || format!("{} partial sum {t} → {first}", layer.name);
            let from = (config.device_of_tile(t), device);
            let arrived = message(tasks, machine, names, TaskKind::Copy, from, bytes, partial);
            terms.extend_from_slice(arrived.tasks());
        }
        let duration = fold_time(machine, device, fold_bytes(red, bytes));
        let fold = tasks.push(
            TaskSpec::on_device(TaskKind::Fold, device, duration),
            || format!("{} partial sums {first}", layer.name),
            &terms,
        );
        let finish = TaskSpec::on_device(
            TaskKind::Forward,
            device,
            elementwise_time(machine, device, bytes),
        );
        out[first] = tasks.push(finish, || format!("{} finish {first}", layer.name), &[fold]);
    }
    out
}

/// A reduction split's backward: on each block's first partial the gradient through the
/// activation (`FinishBackward`, after the block's finish), sent to the block's other partials,
/// then every partial's backward. Returns (per tile the finish-backward, `usize::MAX` past a
/// block's first partial; per tile its partial backward).
fn partial_backward(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    layer: &Layer,
    config: &ParallelConfig,
    (partials, outputs): (&[usize], &[usize]),
    backward_time: &[f64],
) -> (Vec<usize>, Vec<usize>) {
    let red = config.reduction();
    let mut finishes = vec![usize::MAX; config.total()];
    let mut backward = Vec::with_capacity(config.total());
    for first in (0..config.total()).step_by(red) {
        let block = tile_rect(&layer.shape, config, first);
        let bytes = machine.activation_bytes() * block.volume() as u64;
        let device = config.device_of_tile(first);
        let duration = elementwise_time(machine, device, bytes);
        let finish = tasks.push(
            TaskSpec::on_device(TaskKind::Backward, device, duration),
            || format!("{} finish bwd {first}", layer.name),
            &[outputs[first]],
        );
        finishes[first] = finish;
        for t in first..first + red {
            let to = config.device_of_tile(t);
            let mut deps = vec![partials[t]];
            if t == first {
                deps.push(finish);
            } else {
                let names = || format!("{} block grad {first} → {t}", layer.name);
                let arrived = message(
                    tasks,
                    machine,
                    names,
                    TaskKind::GradientCopy,
                    (device, to),
                    bytes,
                    finish,
                );
                deps.extend_from_slice(arrived.tasks());
            }
            let task = TaskSpec::on_device(TaskKind::Backward, to, backward_time[t]);
            backward.push(tasks.push(task, || format!("{} bwd {t}", layer.name), &deps));
        }
    }
    (finishes, backward)
}

/// Seconds of an element-wise pass over `bytes` (read and written) on `device`: a reduction
/// split's activation and its gradient, at the rate the runtime folds at.
fn elementwise_time(machine: &MachineModel, device: DeviceId, bytes: u64) -> f64 {
    fold_time(machine, device, 2 * bytes)
}

/// The owner's fold of a slice's `terms` gradients (its own and the replicas'), after `deps`, then
/// the SGD update of the slice; returns the update. `name` names the slice.
pub(super) fn fold_and_update(
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
pub(super) fn move_task(
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
    let red = dst_config.reduction();
    let needed = (0..dst_config.total())
        .map(|t| {
            let out = tile_rect(&consumer.shape, dst_config, t);
            let r = dst_config.reduction_of(t);
            project_partial(consumer.op.spec(), &inputs, &out, r, red)[edge.input]
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
pub(super) fn fold_time(machine: &MachineModel, device: DeviceId, bytes: u64) -> f64 {
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
    let route = machine.route(from, to);
    let transfer = TaskSpec {
        kind,
        resource: match route.and_then(|r| r.lanes) {
            Some((out, into)) => Resource::Lanes(out, into),
            None => Resource::Link(from, to),
        },
        duration: route.map_or(0.0, |r| bytes as f64 * r.link.seconds_per_byte()),
        bytes,
        latency: route.map_or(0.0, |r| r.link.latency_s),
    };
    // the transfer first (it carries the bytes), then the two ends' work
    arrived.ids.rotate_right(1);
    arrived.ids[0] = tasks.push(transfer, name, &[after]);
    arrived.len += 1;
    arrived
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
