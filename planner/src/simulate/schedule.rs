//! The list scheduler: device and link timelines.
//!
//! Scheduling: each device runs one compute task at a time and each directed link carries one
//! message at a time for `bytes / bandwidth`; a message on a shared route holds both its lanes
//! (its sender's NIC's out lane and its receiver's NIC's in lane, say) and starts when both are
//! free, so every message through one NIC queues on it; the link's latency then delays the message's
//! arrival without holding the link, so messages in a row pay it once, not once each, as on the
//! wire. A task is ready when its dependencies have finished (and arrived), and every resource serves
//! its tasks in the order they became ready (ties by task number, which follows the program order).
//! A compute task waits for its device's previous compute task; a [`TaskKind::Move`] runs on the
//! device's actor, beside the device's kernel: it holds the actor (the device's next kernel
//! waits for both) and pays no dispatch. Everything the embedded CPU runtime adds (shared cores,
//! actor threads, dispatch delays) is a `Host` the scheduler asks; `DedicatedHost` adds
//! nothing, and `cpu_host::CpuHost` models the embedded runtime.

use super::tasks::{CollectiveTransfer, CompactTasks, Resource, Task, TaskKind, task_number};
use crate::fast_hash::FastHashMap;
use crate::machine::{DeviceId, MachineModel};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// Start and finish times: every resource serves its tasks in the order they become ready (ties by
/// task number), each as soon as the resource is free.
pub fn list_schedule(tasks: &[Task]) -> (Vec<f64>, Vec<f64>) {
    let graph = Schedulable::new(CompactTasks::from_tasks(tasks));
    let done = schedule(&graph, &mut DedicatedHost, true, None);
    done.times.expect("recorded")
}

/// A compact task graph as [`schedule`] reads it, built once for every dispatch draw: each task's
/// successors in one array (`successors[first[t]..first[t + 1]]`; their order does not matter, the
/// ready queue orders by time and task number) and its number of dependencies, the (task,
/// dependency) pairs dropped.
pub(super) struct Schedulable {
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
    /// The number of tasks.
    pub(super) fn len(&self) -> usize {
        self.tasks.len()
    }

    pub(super) fn new(mut tasks: CompactTasks) -> Schedulable {
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
pub(super) struct Scheduled {
    pub(super) makespan: f64,
    pub(super) times: Option<(Vec<f64>, Vec<f64>)>,
}

/// What a task asks of the host besides its device or link ([`Host::start`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HostWork {
    /// A compute task on a device: dispatched, then run on a core.
    Kernel,
    /// A [`TaskKind::Move`]: a copy on a device's actor.
    Copy,
    /// A node's transport work ([`Resource::Network`]).
    Network,
}

/// The threads and cores of the host the devices run on, as far as they delay a task beyond its
/// device or link being free. Links never ask.
pub(super) trait Host {
    /// What [`Host::start`] holds until [`Host::finish`].
    type Booking;
    /// When task `task`, doing `work` for `duration` seconds, starts if its device (or its node's
    /// network threads) lets it start at `begin`; what it holds until it ends.
    fn start(
        &mut self,
        task: usize,
        work: HostWork,
        begin: f64,
        duration: f64,
    ) -> (f64, Self::Booking);
    /// Task booked by `booking` ends at `end`.
    fn finish(&mut self, booking: Self::Booking, end: f64);
}

/// A host that delays nothing: every device has cores and threads of its own and dispatch is
/// free (a GPU machine, or any machine without measured runtime costs or shared cores).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DedicatedHost;

impl Host for DedicatedHost {
    type Booking = ();

    fn start(&mut self, _task: usize, _work: HostWork, begin: f64, _duration: f64) -> (f64, ()) {
        (begin, ())
    }

    fn finish(&mut self, _booking: (), _end: f64) {}
}

/// The list schedule of `graph` on its devices and links, with `host`'s threads and cores; keeps
/// each task's start and finish only if `record`.
///
/// `machine` routes the messages of collective transfers (a graph with some needs one).
pub(super) fn schedule(
    graph: &Schedulable,
    host: &mut impl Host,
    record: bool,
    machine: Option<&MachineModel>,
) -> Scheduled {
    let tasks = &graph.tasks;
    let n = tasks.len();
    // when each resource is free, by index
    let mut resources: Vec<f64> = vec![0.0; tasks.resources.len()];
    // what the host is asked for each resource's tasks (links: nothing)
    let host_work: Vec<Option<HostWork>> = tasks
        .resources
        .iter()
        .map(|r| match *r {
            Resource::Device(_) => Some(HostWork::Kernel),
            Resource::Network(_) => Some(HostWork::Network),
            Resource::Link(..)
            | Resource::Lanes(..)
            | Resource::Inbox(_)
            | Resource::Join
            | Resource::Collective => None,
        })
        .collect();
    // A join holds nothing, and a collective transfer only its messages' lanes: each starts as
    // soon as it is ready.
    let holds_nothing: Vec<bool> = tasks
        .resources
        .iter()
        .map(|r| matches!(r, Resource::Join | Resource::Collective))
        .collect();
    // When each shared lane is free, and each resource's lanes (see `Resource::Lanes`).
    let resource_lanes: Vec<Option<(usize, usize)>> = tasks
        .resources
        .iter()
        .map(|r| match *r {
            Resource::Lanes(out, into) => Some((out, into)),
            _ => None,
        })
        .collect();
    let mut lanes: Vec<f64> = vec![
        0.0;
        resource_lanes
            .iter()
            .flatten()
            .map(|&(out, into)| out.max(into) + 1)
            .max()
            .unwrap_or(0)
            // a collective transfer's messages may use any lane
            .max(machine.map_or(0, MachineModel::num_lanes))
    ];
    // (dependencies left, when the last so far arrives) of the tasks with several that some but
    // not all of have finished: few at a time, where a vector per task took 12 bytes of each.
    let mut partly_ready: FastHashMap<u32, (u32, f64)> = FastHashMap::default();
    let (mut start, mut finish) = match record {
        true => (vec![0.0; n], vec![0.0; n]),
        false => (Vec::new(), Vec::new()),
    };
    let mut makespan = 0.0f64;
    // Per gather whose senders have started, when each owner's messages have arrived so far.
    let mut gather_arrivals: FastHashMap<u32, Vec<f64>> = FastHashMap::default();
    let mut ready = ReadyQueue::default();
    for t in (0..n).filter(|&t| graph.dep_count[t] == 0) {
        ready.push(0.0, task_number(t));
    }
    // When each device's actor is free (by the device's resource index): its moves hold it, not
    // the device's kernel stream (the actor copies while the device's kernel runs), and its next
    // kernel waits for both.
    let mut device_actors: Vec<f64> = vec![0.0; tasks.resources.len()];
    while let Some((at, t)) = ready.pop() {
        let t = t as usize;
        let resource = tasks.resource_of(t) as usize;
        let duration = tasks.duration_of(t);
        let work = match host_work[resource] {
            Some(HostWork::Kernel) if tasks.kind_of(t) == TaskKind::Move => Some(HostWork::Copy),
            work => work,
        };
        let device_actor = device_actors[resource];
        let free = match work {
            Some(HostWork::Copy) => &mut device_actors[resource],
            _ => &mut resources[resource],
        };
        let mut begin = match holds_nothing[resource] {
            true => at,
            false => at.max(*free),
        };
        if work == Some(HostWork::Kernel) {
            begin = begin.max(device_actor);
        }
        if let Some(transfer) = tasks.collectives.get(&task_number(t)) {
            let machine = machine.expect("collective transfers are routed on their machine");
            match transfer {
                CollectiveTransfer::Scatter { from, to, bytes } => {
                    let messages = scatter_messages(machine, (*from, to, *bytes), at);
                    let (last_end, arrival) = put_on_lanes(&messages, at, &mut lanes, None);
                    if record {
                        start[t] = at;
                        finish[t] = last_end;
                    }
                    makespan = makespan.max(arrival);
                    release(graph, t, arrival, &mut ready, &mut partly_ready);
                }
                CollectiveTransfer::GatherFrom { gather, owners, .. } => {
                    // The gather's other senders ready before this one's last block leaves are
                    // served with it, their messages interleaved by ready time as the
                    // per-message tasks' would be.
                    let until = at + gathering_time(machine, transfer);
                    let mut batch = vec![(at, t)];
                    batch.extend(
                        ready
                            .take_until(until, |n| {
                                matches!(tasks.collectives.get(&n),
                                Some(CollectiveTransfer::GatherFrom { gather: g, .. }) if g == gather)
                            })
                            .into_iter()
                            .map(|(time, n)| (time, n as usize)),
                    );
                    let senders: Vec<(f64, &CollectiveTransfer)> = batch
                        .iter()
                        .map(|&(time, b)| (time, &tasks.collectives[&task_number(b)]))
                        .collect();
                    let messages = gather_messages(machine, &senders, at);
                    let arrivals = gather_arrivals
                        .entry(*gather)
                        .or_insert_with(|| vec![0.0; owners.len()]);
                    let (last_end, arrival) =
                        put_on_lanes(&messages, at, &mut lanes, Some(arrivals));
                    makespan = makespan.max(arrival);
                    for &(time, b) in &batch {
                        if record {
                            start[b] = time;
                            finish[b] = last_end.max(time);
                        }
                        // its gather's end learns the owners' arrivals now
                        release(graph, b, time, &mut ready, &mut partly_ready);
                    }
                }
                CollectiveTransfer::GatherDone { gather } => {
                    let arrivals = gather_arrivals.remove(gather).unwrap_or_default();
                    if record {
                        start[t] = at;
                        finish[t] = at;
                    }
                    let last = arrivals.iter().copied().fold(at, f64::max);
                    for &s in
                        &graph.successors[graph.first[t] as usize..graph.first[t + 1] as usize]
                    {
                        // one successor per owner right after it, each waiting for its own
                        let arrived = match (s as usize).checked_sub(t + 1) {
                            Some(j) if j < arrivals.len() => arrivals[j].max(at),
                            _ => last,
                        };
                        release_one(graph, s, arrived, &mut ready, &mut partly_ready);
                    }
                }
            }
            continue;
        }
        let held_lanes = resource_lanes[resource];
        if let Some((out, into)) = held_lanes {
            begin = begin.max(lanes[out]).max(lanes[into]);
        }
        let end = match work {
            Some(work) => {
                let (at, booking) = host.start(t, work, begin, duration);
                begin = at;
                let end = begin + duration;
                host.finish(booking, end);
                end
            }
            None => begin + duration,
        };
        if !holds_nothing[resource] {
            *free = end;
        }
        if let Some((out, into)) = held_lanes {
            lanes[out] = end;
            lanes[into] = end;
        }
        if record {
            start[t] = begin;
            finish[t] = end;
        }
        // the step ends when the last task's result has arrived
        let arrival = end + tasks.latency_of(t);
        makespan = makespan.max(arrival);
        release(graph, t, arrival, &mut ready, &mut partly_ready);
    }
    Scheduled {
        makespan,
        times: record.then_some((start, finish)),
    }
}

/// Task `t`'s result has arrived at `arrival`: its successors with nothing else to wait for are
/// ready.
fn release(
    graph: &Schedulable,
    t: usize,
    arrival: f64,
    ready: &mut ReadyQueue,
    partly_ready: &mut FastHashMap<u32, (u32, f64)>,
) {
    for &s in &graph.successors[graph.first[t] as usize..graph.first[t + 1] as usize] {
        release_one(graph, s, arrival, ready, partly_ready);
    }
}

/// One of successor `s`'s dependencies has arrived at `arrival`.
fn release_one(
    graph: &Schedulable,
    s: u32,
    arrival: f64,
    ready: &mut ReadyQueue,
    partly_ready: &mut FastHashMap<u32, (u32, f64)>,
) {
    if graph.dep_count[s as usize] == 1 {
        ready.push(arrival, s);
        return;
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

/// One message of a collective transfer, before it is put on its lanes.
#[derive(Clone, Copy, Debug, PartialEq)]
struct LaneMessage {
    ready: f64,
    /// The owner's index (a gather's order: block-major, then senders).
    block: u32,
    sender: u32,
    out: usize,
    into: usize,
    seconds: f64,
    latency: f64,
}

/// The message from `from` to `to` of `bytes` ready at `ready`, if it goes on shared lanes.
fn lane_message(
    machine: &MachineModel,
    (from, to): (DeviceId, DeviceId),
    bytes: u64,
    ready: f64,
    (block, sender): (u32, u32),
) -> Option<LaneMessage> {
    let route = machine.route(from, to)?;
    let (out, into) = route.lanes?;
    Some(LaneMessage {
        ready,
        block,
        sender,
        out,
        into,
        seconds: bytes as f64 * route.link.seconds_per_byte(),
        latency: route.link.latency_s,
    })
}

/// The messages of a scatter popped at `at`.
fn scatter_messages(
    machine: &MachineModel,
    (from, to, bytes): (DeviceId, &[DeviceId], u64),
    at: f64,
) -> Vec<LaneMessage> {
    to.iter()
        .filter(|&&peer| peer != from)
        .filter_map(|&peer| lane_message(machine, (from, peer), bytes, at, (0, 0)))
        .collect()
}

/// The messages of gathers' senders popped together at `at`, in the order the per-message tasks
/// would be served: by ready time (a sender's blocks leave one by one as its actor gathers them
/// out of its slice, where `gathered`), then block, then sender.
fn gather_messages(
    machine: &MachineModel,
    senders: &[(f64, &CollectiveTransfer)],
    at: f64,
) -> Vec<LaneMessage> {
    let mut messages = Vec::new();
    for &(sender_ready, transfer) in senders {
        let CollectiveTransfer::GatherFrom {
            sender,
            sender_index,
            owners,
            bytes,
            gathered,
            ..
        } = transfer
        else {
            unreachable!("only a gather's senders are batched")
        };
        let rate = copy_rate(machine, *sender);
        let mut ready = sender_ready;
        for (j, (&owner, &b)) in owners.iter().zip(bytes.iter()).enumerate() {
            if owner == *sender {
                continue;
            }
            if *gathered {
                ready += b as f64 / rate;
            }
            let ends = (*sender, owner);
            messages.extend(lane_message(
                machine,
                ends,
                b,
                ready,
                (j as u32, *sender_index),
            ));
        }
    }
    if senders.len() > 1 || messages.iter().any(|m| m.ready != at) {
        // per message: served by ready time, then task number (block-major)
        messages.sort_by(|a, b| {
            a.ready
                .total_cmp(&b.ready)
                .then(a.block.cmp(&b.block))
                .then(a.sender.cmp(&b.sender))
        });
    }
    messages
}

/// Bytes per second `device`'s actor copies at (as `tasks::move_task` prices it).
fn copy_rate(machine: &MachineModel, device: DeviceId) -> f64 {
    machine
        .runtime_costs()
        .map_or(machine.device(device).memory_bytes_per_s(), |c| {
            c.copy_bytes_per_s
        })
}

/// Seconds a gather's sender takes to gather all its blocks (0 where it sends them whole).
fn gathering_time(machine: &MachineModel, transfer: &CollectiveTransfer) -> f64 {
    match transfer {
        CollectiveTransfer::GatherFrom {
            sender,
            owners,
            bytes,
            gathered: true,
            ..
        } => {
            let out: u64 = owners
                .iter()
                .zip(bytes.iter())
                .filter(|&(o, _)| o != sender)
                .map(|(_, &b)| b)
                .sum();
            out as f64 / copy_rate(machine, *sender)
        }
        _ => 0.0,
    }
}

/// Puts `messages` on their lanes in order, each when both its lanes are free (and it is ready),
/// holding them for its bytes, as message tasks of their own would be. Returns when the last
/// leaves its lanes and when the last has arrived (`at` where none), and adds each message's
/// arrival to its block's in `block_arrivals` where given.
fn put_on_lanes(
    messages: &[LaneMessage],
    at: f64,
    lanes: &mut [f64],
    mut block_arrivals: Option<&mut Vec<f64>>,
) -> (f64, f64) {
    let (mut last_end, mut arrival) = (at, at);
    for m in messages {
        let begin = m.ready.max(lanes[m.out]).max(lanes[m.into]);
        let end = begin + m.seconds;
        lanes[m.out] = end;
        lanes[m.into] = end;
        last_end = last_end.max(end);
        arrival = arrival.max(end + m.latency);
        if let Some(arrivals) = block_arrivals.as_deref_mut() {
            let a = &mut arrivals[m.block as usize];
            *a = a.max(end + m.latency);
        }
    }
    (last_end, arrival)
}

/// The tasks whose dependencies have finished, served earliest ready time first, ties by task
/// number. On a thousand devices millions of messages wait at once, mostly at a few thousand
/// distinct times (every replica sends alike), so tasks are kept by distinct time, unordered, and
/// a time's tasks are sorted once, when it becomes the earliest: one sort of a time's thousands of
/// task numbers is a fraction of a heap's pops, whose cache misses were a quarter of a thousand
/// devices' whole `plan` (and one heap of (time, task) pairs over all of them twice that).
#[derive(Debug, Default)]
struct ReadyQueue {
    /// Tasks ready at each time after the current one, unordered.
    later: BTreeMap<u64, Vec<u32>>,
    /// The current (earliest) time, whose tasks are `now` and `now_pushed`.
    now_time: u64,
    /// The current time's tasks as they were when it became the earliest, sorted descending (the
    /// lowest pops off the end).
    now: Vec<u32>,
    /// Tasks pushed at the current time after it became the earliest (a result that took no time
    /// and arrived at once): few, so a heap beside `now` rather than inserts into it.
    now_pushed: BinaryHeap<Reverse<u32>>,
    /// Emptied vectors, kept for their allocations.
    spare: Vec<Vec<u32>>,
}

impl ReadyQueue {
    /// Adds `task`, ready at `at` seconds (not negative).
    fn push(&mut self, at: f64, task: u32) {
        debug_assert!(at >= 0.0);
        // Times are non-negative, so their bit patterns order like the numbers.
        let key = at.to_bits();
        let current = !self.now.is_empty() || !self.now_pushed.is_empty();
        if current && key == self.now_time {
            self.now_pushed.push(Reverse(task));
            return;
        }
        if current && key < self.now_time {
            // Earlier than the current time (the scheduler never does this: a task is ready no
            // earlier than what it waited for): the current time's tasks go back among the later.
            let mut tasks = std::mem::take(&mut self.now);
            tasks.extend(self.now_pushed.drain().map(|Reverse(t)| t));
            self.later.insert(self.now_time, tasks);
        }
        let spare = &mut self.spare;
        self.later
            .entry(key)
            .or_insert_with(|| spare.pop().unwrap_or_default())
            .push(task);
    }

    /// Takes the task ready first (the lowest number among those ready then).
    fn pop(&mut self) -> Option<(f64, u32)> {
        if self.now.is_empty() && self.now_pushed.is_empty() {
            let (time, mut tasks) = self.later.pop_first()?;
            tasks.sort_unstable_by(|a, b| b.cmp(a));
            let emptied = std::mem::replace(&mut self.now, tasks);
            self.spare.push(emptied);
            self.now_time = time;
        }
        let task = match (self.now.last(), self.now_pushed.peek()) {
            (Some(&sorted), Some(&Reverse(pushed))) if pushed < sorted => {
                self.now_pushed.pop();
                pushed
            }
            (Some(_), _) => self.now.pop().expect("not empty"),
            (None, _) => self.now_pushed.pop().expect("not empty").0,
        };
        Some((f64::from_bits(self.now_time), task))
    }

    /// Takes out the tasks `wanted` says ready from the time of the last popped up to `until`
    /// (seconds), with their times: a gather's senders whose messages the per-message tasks
    /// would interleave.
    fn take_until(&mut self, until: f64, wanted: impl Fn(u32) -> bool) -> Vec<(f64, u32)> {
        let mut taken = Vec::new();
        let now = f64::from_bits(self.now_time);
        self.now.retain(|&t| match wanted(t) {
            true => {
                taken.push((now, t));
                false
            }
            false => true,
        });
        let pushed: Vec<Reverse<u32>> = self.now_pushed.drain().collect();
        for Reverse(t) in pushed {
            match wanted(t) {
                true => taken.push((now, t)),
                false => self.now_pushed.push(Reverse(t)),
            }
        }
        let mut emptied = Vec::new();
        for (&key, tasks) in self.later.range_mut(..=until.to_bits()) {
            tasks.retain(|&t| match wanted(t) {
                true => {
                    taken.push((f64::from_bits(key), t));
                    false
                }
                false => true,
            });
            if tasks.is_empty() {
                emptied.push(key);
            }
        }
        for key in emptied {
            if let Some(v) = self.later.remove(&key) {
                self.spare.push(v);
            }
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::rng::Rng;

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
    fn a_devices_actor_copies_while_its_kernel_runs_and_its_next_kernel_waits_for_both() {
        let task = |kind, duration, deps| Task {
            name: String::new(),
            kind,
            resource: Resource::Device(0),
            duration,
            bytes: 0,
            latency: 0.0,
            deps,
            collective: None,
        };
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
}
