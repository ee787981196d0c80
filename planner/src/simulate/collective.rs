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
    CollectiveTransfer, Resource, TaskKind, TaskSink, TaskSpec, fold_and_update, fold_time,
    move_task,
};
use crate::machine::{DeviceId, MachineModel};
use crate::runtime_costs::fold_bytes;
use legion_ops::Rect;
use legion_ops::partition::Relay;
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
pub(super) fn join(
    tasks: &mut impl TaskSink,
    name: impl FnOnce() -> String,
    deps: &[usize],
) -> usize {
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
    let owner_arrived = match shared_lanes {
        true => {
            let owners: Arc<[DeviceId]> = blocks.iter().map(|&(_, o)| o).collect();
            let hops = vec![owners; devices.len()];
            gather_on_lanes(
                tasks,
                gathers,
                name,
                devices,
                &hops,
                &block_bytes,
                partial,
                ready,
            )
        }
        false => vec![None; blocks.len()],
    };
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
        let received = Received {
            inboxes: &[&inboxes],
            sent: &outward,
            otherwise: all_updated,
        };
        store_received(tasks, machine, name, devices, total, &owned, received);
    }
}

/// [`sync_slice`] where some blocks go through relays on other nodes (`routes[j]`: the relays of
/// block `j`): a gather of every device's gradient of each block to its relay (or to the owner,
/// from the owner's node or alone on its node), the relays' sums, a gather of those sums to the
/// owners, the owners' updates, then the new values back the same way, owner to relays and
/// relays to their members. Each gather and scatter is one set of collectives as in
/// [`sync_slice`].
#[allow(clippy::too_many_arguments)]
pub(super) fn sync_relayed_slice(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    scratch: &mut CollectiveScratch,
    name: &dyn Fn() -> String,
    slice: &Rect,
    devices: &[DeviceId],
    blocks: &[(Rect, DeviceId)],
    routes: &[Vec<Relay>],
    ready: &dyn Fn(DeviceId) -> usize,
) {
    let n = machine.num_devices();
    let block_bytes: Vec<u64> = blocks.iter().map(|(b, _)| 4 * b.volume() as u64).collect();
    let total: u64 = block_bytes.iter().sum();
    let partial = blocks.iter().any(|(b, _)| b != slice);
    let shared_lanes = machine.has_shared_lanes();
    let mut owned = vec![0u64; n];
    for ((_, owner), &bytes) in blocks.iter().zip(&block_bytes) {
        owned[*owner] = bytes;
    }
    // `hop[j][i]`: where `devices[i]` sends its gradient of block `j` first, itself (nothing to
    // send) where it owns or relays the block; a table rather than a search of the relays, which
    // is quadratic per block at a thousand devices
    let position = |d: DeviceId| devices.binary_search(&d).expect("a device of the slice");
    let hop: Vec<Vec<DeviceId>> = blocks
        .iter()
        .zip(routes)
        .map(|(&(_, owner), relays)| {
            let mut to = vec![owner; devices.len()];
            for relay in relays {
                to[position(relay.device)] = relay.device;
                for &m in &relay.members {
                    to[position(m)] = relay.device;
                }
            }
            to
        })
        .collect();
    let CollectiveScratch {
        gradients,
        values,
        gathers,
    } = scratch;

    // 1. gradients to the relays and, from the owner's node or alone on theirs, to the owners
    gradients.clear();
    let mut senders = Vec::with_capacity(devices.len());
    let mut hops: Vec<Arc<[DeviceId]>> = Vec::with_capacity(devices.len());
    for (i, &r) in devices.iter().enumerate() {
        let to: Arc<[DeviceId]> = hop.iter().map(|to| to[i]).collect();
        let out = add_per_link(gradients, machine, r, &to, &block_bytes);
        let mut task = ready(r);
        if partial && out > 0 {
            let gather = || format!("gather {} grad on {r}", name());
            task = move_task(tasks, machine, gather, r, out, &[task]);
        }
        senders.push(task);
        hops.push(to);
    }
    let all_sent = join(tasks, || format!("{} grads ready", name()), &senders);
    let first_inboxes = gradients.tasks(tasks, all_sent, &|| format!("{} grads", name()));
    let first_arrived = match shared_lanes {
        true => gather_on_lanes(
            tasks,
            gathers,
            name,
            devices,
            &hops,
            &block_bytes,
            partial,
            ready,
        ),
        false => vec![None; blocks.len()],
    };

    // 2. each relay's sums of its members' gradients and its own, one task for all its blocks
    // (`relayed[d]`: the blocks device `d` relays, each with its members)
    let mut relayed: Vec<Vec<(usize, &[DeviceId])>> = vec![Vec::new(); n];
    for (j, relays) in routes.iter().enumerate() {
        for relay in relays {
            relayed[relay.device].push((j, relay.members.as_slice()));
        }
    }
    let relay_devices: Vec<DeviceId> = (0..n).filter(|&d| !relayed[d].is_empty()).collect();
    let mut relay_sums = vec![usize::MAX; n];
    for &at in &relay_devices {
        let mut deps = vec![ready(at)];
        deps.extend(first_inboxes[at]);
        let mut bytes = 0;
        for &(j, members) in &relayed[at] {
            deps.extend(first_arrived[j]);
            bytes += fold_bytes(members.len() + 1, block_bytes[j]);
        }
        let duration = fold_time(machine, at, bytes);
        let names = || format!("{} grad sums on relay {at}", name());
        relay_sums[at] = tasks.push(
            TaskSpec::on_device(TaskKind::Fold, at, duration),
            names,
            &deps,
        );
    }

    // 3. the relays' sums to the owners
    gradients.clear();
    let mut senders = Vec::with_capacity(relay_devices.len());
    let mut hops = Vec::with_capacity(relay_devices.len());
    for &s in &relay_devices {
        let i = position(s);
        let to: Arc<[DeviceId]> = (0..blocks.len())
            .map(|j| match hop[j][i] == s && blocks[j].1 != s {
                true => blocks[j].1,
                false => s,
            })
            .collect();
        let out = add_per_link(gradients, machine, s, &to, &block_bytes);
        let mut task = relay_sums[s];
        if partial {
            let gather = || format!("gather {} sums on {s}", name());
            task = move_task(tasks, machine, gather, s, out, &[task]);
        }
        senders.push(task);
        hops.push(to);
    }
    let all_sent = join(tasks, || format!("{} sums ready", name()), &senders);
    let second_inboxes = gradients.tasks(tasks, all_sent, &|| format!("{} sums", name()));
    let second_arrived = match shared_lanes {
        true => {
            let sent = |d: DeviceId| senders[relay_devices.binary_search(&d).expect("a relay")];
            let (senders, hops) = (&relay_devices, &hops);
            gather_on_lanes(
                tasks,
                gathers,
                name,
                senders,
                hops,
                &block_bytes,
                false,
                &sent,
            )
        }
        false => vec![None; blocks.len()],
    };

    // 4. the owners' updates, and the new values to the relays and the owners' direct peers
    values.clear();
    let mut updates = Vec::with_capacity(blocks.len());
    let mut outward = vec![None; blocks.len()];
    for (j, ((_, owner), &bytes)) in blocks.iter().zip(&block_bytes).enumerate() {
        let o = *owner;
        // the owner's node peers, those alone on theirs and the relays
        let direct: Arc<[DeviceId]> = devices
            .iter()
            .zip(&hop[j])
            .filter(|&(&r, &to)| r != o && (to == o || to == r))
            .map(|(&r, _)| r)
            .collect();
        let mut deps = vec![ready(o)];
        deps.extend(first_inboxes[o]);
        deps.extend(second_inboxes[o]);
        deps.extend(first_arrived[j]);
        deps.extend(second_arrived[j]);
        let update = fold_and_update(
            tasks,
            machine,
            || format!("{} block on {o}", name()),
            o,
            direct.len() + 1,
            bytes,
            &deps,
        );
        if partial {
            let copy = || format!("copy {} on {o}", name());
            move_task(tasks, machine, copy, o, bytes, &[update]);
        }
        for &r in direct.iter() {
            values.add(machine, o, r, bytes);
        }
        if shared_lanes {
            let transfer = CollectiveTransfer::Scatter {
                from: o,
                to: direct,
                bytes,
            };
            let names = || format!("{} values {o} →", name());
            outward[j] = Some(tasks.push_collective(transfer, names, &[update]));
        }
        updates.push(update);
    }
    let all_updated = join(tasks, || format!("{} updated", name()), &updates);
    let first_values = values.tasks(tasks, all_updated, &|| format!("{} values", name()));

    // 5. each relay's new values on to its members, one message each for all its blocks (a
    // relay's members are its node's other devices of the slice, for every block it relays)
    values.clear();
    let mut forwards = Vec::new();
    let mut onward = Vec::new();
    for &at in &relay_devices {
        let deps: Vec<usize> = first_values[at]
            .into_iter()
            .chain(relayed[at].iter().filter_map(|&(j, _)| outward[j]))
            .collect();
        let received = match deps.is_empty() {
            true => all_updated,
            false => join(tasks, || format!("{} values at relay {at}", name()), &deps),
        };
        let bytes: u64 = relayed[at].iter().map(|&(j, _)| block_bytes[j]).sum();
        let members = relayed[at][0].1;
        for &m in members {
            values.add(machine, at, m, bytes);
        }
        if shared_lanes {
            let transfer = CollectiveTransfer::Scatter {
                from: at,
                to: members.into(),
                bytes,
            };
            let names = || format!("{} values relay {at} →", name());
            onward.push(tasks.push_collective(transfer, names, &[received]));
        }
        forwards.push(received);
    }
    let all_forwarded = join(tasks, || format!("{} at the relays", name()), &forwards);
    let second_values = values.tasks(tasks, all_forwarded, &|| format!("{} relayed", name()));
    if partial {
        let sent: Vec<usize> = outward.iter().flatten().copied().chain(onward).collect();
        let received = Received {
            inboxes: &[&first_values, &second_values],
            sent: &sent,
            otherwise: all_forwarded,
        };
        store_received(tasks, machine, name, devices, total, &owned, received);
    }
}

/// What a slice's new values arrive by: per device, its inbox tasks over private links (one per
/// leg); the values' transfers on shared lanes; and the task after which they were all sent,
/// for a device that gets them over neither.
struct Received<'a> {
    inboxes: &'a [&'a [Option<usize>]],
    sent: &'a [usize],
    otherwise: usize,
}

/// Each device's store of the new values of the blocks it does not own (of `total` bytes; it
/// owns `owned[d]`) into its whole slice, once they have arrived.
fn store_received(
    tasks: &mut impl TaskSink,
    machine: &MachineModel,
    name: &dyn Fn() -> String,
    devices: &[DeviceId],
    total: u64,
    owned: &[u64],
    received: Received<'_>,
) {
    let all_sent = (!received.sent.is_empty())
        .then(|| join(tasks, || format!("{} values sent", name()), received.sent));
    for &r in devices {
        let into = total - owned[r];
        if into > 0 {
            let mut deps: Vec<usize> = received.inboxes.iter().filter_map(|i| i[r]).collect();
            deps.extend(all_sent);
            if deps.is_empty() {
                deps.push(received.otherwise);
            }
            let store = || format!("store {} on {r}", name());
            move_task(tasks, machine, store, r, into, &deps);
        }
    }
}

/// Adds to `loads` what `from` sends over private links: block `j` (`bytes[j]`) to `to[j]`
/// (nothing where that is `from`), the blocks to one device as one message. Returns the bytes
/// `from` sends in all.
fn add_per_link(
    loads: &mut PrivateLoads,
    machine: &MachineModel,
    from: DeviceId,
    to: &[DeviceId],
    bytes: &[u64],
) -> u64 {
    let mut per_link: Vec<(DeviceId, u64)> = Vec::new();
    for (&dest, &b) in to.iter().zip(bytes).filter(|&(&dest, _)| dest != from) {
        match per_link.iter_mut().find(|(d, _)| *d == dest) {
            Some((_, sum)) => *sum += b,
            None => per_link.push((dest, b)),
        }
    }
    for &(dest, b) in &per_link {
        loads.add(machine, from, dest, b);
    }
    per_link.iter().map(|&(_, b)| b).sum()
}

/// One gather on shared lanes, in the order and at the times its messages would leave: sender
/// `senders[i]` sends block `j` (`bytes[j]`) to `hops[i][j]` (nothing where that is itself) once
/// `ready(sender)`. Returns, per block, the moment every message of it has arrived (the
/// transfer's successors, right after it).
#[allow(clippy::too_many_arguments)]
fn gather_on_lanes(
    tasks: &mut impl TaskSink,
    gathers: &mut u32,
    name: &dyn Fn() -> String,
    senders: &[DeviceId],
    hops: &[Arc<[DeviceId]>],
    bytes: &[u64],
    gathered: bool,
    ready: &dyn Fn(DeviceId) -> usize,
) -> Vec<Option<usize>> {
    let gather = *gathers;
    *gathers += 1;
    let bytes: Arc<[u64]> = bytes.iter().copied().collect();
    let mut sent = Vec::with_capacity(senders.len());
    for (i, (&r, to)) in senders.iter().zip(hops).enumerate() {
        let transfer = CollectiveTransfer::GatherFrom {
            gather,
            sender: r,
            sender_index: i as u32,
            owners: to.clone(),
            bytes: bytes.clone(),
            gathered,
        };
        let names = || format!("{} grads {r} →", name());
        sent.push(tasks.push_collective(transfer, names, &[ready(r)]));
    }
    let done = CollectiveTransfer::GatherDone { gather };
    let done = tasks.push_collective(done, || format!("{} grads sent", name()), &sent);
    (0..bytes.len())
        .map(|j| {
            Some(tasks.push(
                JOIN,
                || format!("{} grads of block {j} arrived", name()),
                &[done],
            ))
        })
        .collect()
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
