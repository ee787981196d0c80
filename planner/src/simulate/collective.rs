//! Parameter synchronisation simulated per collective rather than per message.
//!
//! The runtime syncs a replicated slice as [`crate::sync`] describes: every replica sends its
//! gradient of each block to the block's owner, the owner folds and updates, and sends the block
//! back to every replica. Per message that is k·(k−1) tasks per slice each way: tens of millions
//! on a thousand devices, each with its dependencies, in the scheduler's queue. Here the same
//! messages, over the same routes, are a few tasks per device:
//!
//! - on shared lanes (NICs, switch ports, a host bridge), one [`CollectiveTransfer`] per block and
//!   direction: the block's gradients from every replica into its owner, after every replica's
//!   gradient is ready; its updated value from the owner to every replica, after the update. The
//!   scheduler puts each of its messages on its two lanes exactly as it would put a message task
//!   of its own ready at that time, in the same order (per block, replicas ascending), so lanes
//!   queue as in the per-message schedule;
//! - on private links (a link per device pair, which nothing else shares), one task per receiving
//!   device and direction ([`Resource::Inbox`]) for the slowest of its links' messages: those links
//!   run side by side;
//! - the owner's fold and update as per message; a replica's gathers out of its whole slice, and
//!   its stores back into it, one move each for all its blocks.
//!
//! Where it differs from the per-message schedule, and why little: a block's gradients leave once
//! every replica's is ready, not each as its own is (replicas of a slice are tiles of one layer,
//! done at about the same time); a replica gathers all its blocks before the first leaves and
//! stores them once all have arrived (a device copies far faster than links carry); activation
//! copies on a private link do not queue behind the synchronisation arriving at that device over
//! other private links. `planner/tests/sync_simulation.rs` holds the two within 3% on the zoo.
//! Machines that charge their transport's CPU per message ([`MachineModel::network_cpu`]) are
//! always simulated per message ([`super::SyncSimulation::resolve`]).

use super::tasks::{
    CollectiveTransfer, Resource, TaskKind, TaskSink, TaskSpec, fold_and_update, move_task,
};
use crate::machine::{DeviceId, MachineModel};
use legion_ops::Rect;
use std::sync::Arc;

/// What one direction of one slice's synchronisation puts on private links: per receiving
/// device, the slowest of its links' messages. The pure part, from the messages (sender,
/// receiver, bytes) and the machine's routes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrivateLoads {
    /// Per device, the slowest of its private links' messages (seconds) and their largest latency.
    pub inbox_s: Vec<f64>,
    pub inbox_latency: Vec<f64>,
    /// Devices that receive over private links, in the order first seen.
    pub receivers: Vec<DeviceId>,
}

impl PrivateLoads {
    pub fn new(machine: &MachineModel) -> PrivateLoads {
        let devices = machine.num_devices();
        PrivateLoads {
            inbox_s: vec![0.0; devices],
            inbox_latency: vec![0.0; devices],
            receivers: Vec::new(),
        }
    }

    /// Forgets every message (keeping the allocations).
    pub fn clear(&mut self) {
        for &d in &self.receivers {
            self.inbox_s[d] = 0.0;
            self.inbox_latency[d] = 0.0;
        }
        self.receivers.clear();
    }

    /// Adds a message of `bytes` from `from` to `to` if it goes over their private link (one on
    /// shared lanes is a [`CollectiveTransfer`]'s).
    pub fn add(&mut self, machine: &MachineModel, from: DeviceId, to: DeviceId, bytes: u64) {
        let Some(route) = machine.route(from, to) else {
            return;
        };
        if route.lanes.is_some() {
            return;
        }
        if self.inbox_s[to] == 0.0 && !self.receivers.contains(&to) {
            self.receivers.push(to);
        }
        let seconds = bytes as f64 * route.link.seconds_per_byte();
        self.inbox_s[to] = self.inbox_s[to].max(seconds);
        self.inbox_latency[to] = self.inbox_latency[to].max(route.link.latency_s);
    }

    /// The inbox task of each receiving device (indexed by device), after `after`.
    fn tasks(
        &self,
        tasks: &mut impl TaskSink,
        after: usize,
        name: &dyn Fn() -> String,
    ) -> Vec<Option<usize>> {
        let mut arrived = vec![None; self.inbox_s.len()];
        for &d in &self.receivers {
            let spec = TaskSpec {
                kind: TaskKind::Sync,
                resource: Resource::Inbox(d),
                duration: self.inbox_s[d],
                bytes: 0,
                latency: self.inbox_latency[d],
            };
            arrived[d] = Some(tasks.push(spec, || format!("{} into {d}", name()), &[after]));
        }
        arrived
    }
}

/// A zero-length task after all of `deps` (itself if only one): what waits for them waits for
/// it, one dependency instead of many.
fn join(tasks: &mut impl TaskSink, name: impl FnOnce() -> String, deps: &[usize]) -> usize {
    if let [one] = deps {
        return *one;
    }
    tasks.push(JOIN, name, deps)
}

/// A zero-length task that only orders others.
const JOIN: TaskSpec = TaskSpec {
    kind: TaskKind::Sync,
    resource: Resource::Join,
    duration: 0.0,
    bytes: 0,
    latency: 0.0,
};

/// Scratch loads for both directions, reused across slices.
pub(super) struct CollectiveScratch {
    gradients: PrivateLoads,
    values: PrivateLoads,
    /// Gathers numbered so far ([`CollectiveTransfer::GatherFrom::gather`]).
    gathers: u32,
}

impl CollectiveScratch {
    pub(super) fn new(machine: &MachineModel) -> CollectiveScratch {
        CollectiveScratch {
            gradients: PrivateLoads::new(machine),
            values: PrivateLoads::new(machine),
            gathers: 0,
        }
    }
}

/// One replicated slice's synchronisation as collectives: `devices` (ascending) hold `slice`,
/// each block of `blocks` is owned by its device; `ready(d)` is the task after which device `d`'s
/// gradient of the slice is complete. `name` names the slice (`"{layer} param {p}"`).
#[allow(clippy::too_many_arguments)]
pub(super) fn sync_slice(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    scratch: &mut CollectiveScratch,
    name: &dyn Fn() -> String,
    slice: &Rect,
    devices: &[DeviceId],
    blocks: &[(Rect, DeviceId)],
    ready: &dyn Fn(DeviceId) -> usize,
) {
    let n = machine.num_devices();
    let block_bytes: Vec<u64> = blocks.iter().map(|(b, _)| 4 * b.volume() as u64).collect();
    let total: u64 = block_bytes.iter().sum();
    // A block that is not the whole slice is gathered out of each replica's slice before it is
    // sent, and stored back into it (and copied into the owner's) once updated.
    let partial = blocks.iter().any(|(b, _)| b != slice);
    let mut owned = vec![0u64; n];
    for ((_, owner), &bytes) in blocks.iter().zip(&block_bytes) {
        owned[*owner] = bytes;
    }
    let shared_lanes = machine.has_shared_lanes();
    let peers: Arc<[DeviceId]> = devices.into();
    let CollectiveScratch {
        gradients,
        values,
        gathers,
    } = scratch;
    gradients.clear();
    values.clear();
    for ((_, owner), &bytes) in blocks.iter().zip(&block_bytes) {
        for &r in devices {
            if r != *owner {
                gradients.add(machine, r, *owner, bytes);
                values.add(machine, *owner, r, bytes);
            }
        }
    }
    // replicas' gradients of the blocks they do not own, ready to leave
    let mut senders = Vec::with_capacity(devices.len());
    for &r in devices {
        let out = total - owned[r];
        let mut task = ready(r);
        if partial && out > 0 {
            let gather = || format!("gather {} grad on {r}", name());
            task = move_task(tasks, machine, gather, r, out, &[task]);
        }
        senders.push(task);
    }
    let all_sent = join(tasks, || format!("{} grads ready", name()), &senders);
    let inboxes = gradients.tasks(tasks, all_sent, &|| format!("{} grads", name()));
    // Every replica's gradient of every block, on shared lanes, in the order and at the times
    // its messages would leave; then, right after it (as the transfer's successors), the moment
    // each owner has its own.
    let mut owner_arrived = vec![None; blocks.len()];
    if shared_lanes {
        let gather = *gathers;
        *gathers += 1;
        let owners: Arc<[DeviceId]> = blocks.iter().map(|&(_, o)| o).collect();
        let bytes: Arc<[u64]> = block_bytes.iter().copied().collect();
        let mut senders = Vec::with_capacity(devices.len());
        for (i, &r) in devices.iter().enumerate() {
            let transfer = CollectiveTransfer::GatherFrom {
                gather,
                sender: r,
                sender_index: i as u32,
                owners: owners.clone(),
                bytes: bytes.clone(),
                gathered: partial,
            };
            let names = || format!("{} grads {r} →", name());
            senders.push(tasks.push_collective(transfer, names, &[ready(r)]));
        }
        let done = CollectiveTransfer::GatherDone { gather };
        let names = || format!("{} grads sent", name());
        let done = tasks.push_collective(done, names, &senders);
        for (j, (_, o)) in blocks.iter().enumerate() {
            let names = || format!("{} grads arrived at {o}", name());
            owner_arrived[j] = Some(tasks.push(JOIN, names, &[done]));
        }
    }
    let mut updates = Vec::with_capacity(blocks.len());
    let mut outward = Vec::new();
    for (j, ((_, owner), &bytes)) in blocks.iter().zip(&block_bytes).enumerate() {
        let o = *owner;
        let mut deps = vec![ready(o)];
        deps.extend(inboxes[o]);
        deps.extend(owner_arrived[j]);
        let update = fold_and_update(
            tasks,
            machine,
            || format!("{} block on {o}", name()),
            o,
            devices.len(),
            bytes,
            &deps,
        );
        if partial {
            let copy = || format!("copy {} on {o}", name());
            move_task(tasks, machine, copy, o, bytes, &[update]);
        }
        if shared_lanes {
            let transfer = CollectiveTransfer::Scatter {
                from: o,
                to: peers.clone(),
                bytes,
            };
            let names = || format!("{} values {o} →", name());
            outward.push(tasks.push_collective(transfer, names, &[update]));
        }
        updates.push(update);
    }
    let all_updated = join(tasks, || format!("{} updated", name()), &updates);
    let inboxes = values.tasks(tasks, all_updated, &|| format!("{} values", name()));
    if partial {
        let all_arrived = (!outward.is_empty())
            .then(|| join(tasks, || format!("{} values sent", name()), &outward));
        for &r in devices {
            let into = total - owned[r];
            if into > 0 {
                let deps: Vec<usize> = inboxes[r].into_iter().chain(all_arrived).collect();
                let deps = if deps.is_empty() {
                    vec![all_updated]
                } else {
                    deps
                };
                let store = || format!("store {} on {r}", name());
                move_task(tasks, machine, store, r, into, &deps);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_links_carry_the_slowest_and_shared_lanes_are_left_to_the_transfers() {
        // paper-pairs:8: two nodes of four, a link per pair everywhere
        let machine = MachineModel::preset("paper-pairs:8").unwrap();
        let mut loads = PrivateLoads::new(&machine);
        for from in 1..8 {
            loads.add(&machine, from, 0, 1000);
        }
        let inter = machine.link(4, 0).unwrap();
        // seven links side by side: the slowest one's message
        assert_eq!(loads.inbox_s[0], 1000.0 * inter.seconds_per_byte());
        assert_eq!(loads.inbox_latency[0], inter.latency_s);
        assert_eq!(loads.receivers, vec![0]);
        loads.clear();
        assert_eq!(loads, PrivateLoads::new(&machine));
        // paper:8: the same between nodes goes through the NICs, not here
        let shared = MachineModel::preset("paper:8").unwrap();
        let mut loads = PrivateLoads::new(&shared);
        loads.add(&shared, 4, 0, 1000);
        assert!(loads.receivers.is_empty());
        loads.add(&shared, 1, 0, 1000);
        let intra = shared.link(1, 0).unwrap();
        assert_eq!(loads.inbox_s[0], 1000.0 * intra.seconds_per_byte());
    }
}
