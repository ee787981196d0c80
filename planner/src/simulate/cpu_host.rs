//! The embedded CPU runtime's host: how its device actors share threads and cores, and what
//! dispatching a kernel costs ([`RuntimeCosts`], [`MachineModel::compute_slots`]). A machine
//! with none of these (a GPU machine, a machine given by flags) schedules on the plain device and
//! link timelines of [`super::schedule`].
//!
//! A compute task starts [`RuntimeCosts::dispatch_s`] after its device could start it (its device
//! actor handling the previous op's completion, handing the kernel to the pool); where the profile
//! measured how those delays spread ([`RuntimeCosts::dispatch_bins_s`]), each task's delay is
//! drawn from the spread and the step time is the mean over [`DISPATCH_DRAWS`] seeded schedules.
//! A move (a copy on a device's actor, which [`super::schedule`] runs beside the device's kernel)
//! holds one of the [`RuntimeCosts::actor_threads`] the actors share, and pays no dispatch; a
//! compute task also needs a free actor thread before its dispatch starts ([`Pools`]).
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
//! core idle since earlier stays free for a task that can use it.

use super::schedule::{DedicatedHost, Host, HostWork, Schedulable, Scheduled, schedule};
use super::tasks::{CompactTasks, Task};
use crate::machine::MachineModel;
#[cfg(doc)]
use crate::runtime_costs::RuntimeCosts;
use legion_ops::rng::Rng;

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

/// [`super::list_schedule`] where, with `compute_slots`, a device task that takes time also waits for the
/// earliest free of that many slots of a pool all devices share.
pub fn list_schedule_shared(tasks: &[Task], compute_slots: Option<usize>) -> (Vec<f64>, Vec<f64>) {
    list_schedule_dispatched(tasks, compute_slots, 0.0)
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

/// The list schedule of `tasks` under `pools`: a compute task (on a device, not a move)
/// waits for its device's previous compute task and its device's actor and, with actor threads,
/// for one of them to be free, then for the dispatch, and, if it takes time, for a compute slot
/// (the dispatch overlaps that wait), holding it for the runtime's CPU before its kernel
/// ([`Pools::runtime_cpu_s`]); when no slot is free as it becomes startable, it waits for the slot
/// and the runtime's CPU only. A move waits for its device's actor and an actor thread and holds
/// both; if it takes time, it holds a free compute slot too, or, with none free, pushes the slot
/// that frees first back by its duration.
pub fn list_schedule_pools(tasks: &[Task], pools: &Pools) -> (Vec<f64>, Vec<f64>) {
    let graph = Schedulable::new(CompactTasks::from_tasks(tasks));
    let done = schedule(&graph, &mut CpuHost::new(pools, None), true, None);
    done.times.expect("recorded")
}

/// The step time of `tasks` on `machine` and, if `record`, the start and finish of each task (of
/// the draw closest to the mean where dispatch delays are drawn; see
/// [`super::Simulation::makespan`]).
pub(super) fn schedule_iteration(
    machine: &MachineModel,
    tasks: CompactTasks,
    record: bool,
) -> Scheduled {
    let pools = Pools::of(machine);
    let tasks = Schedulable::new(tasks);
    let Some(bins) = machine.runtime_costs().and_then(|c| c.dispatch_bins_s) else {
        if pools == Pools::default() {
            // nothing of the embedded runtime to model: plain device and link timelines
            return schedule(&tasks, &mut DedicatedHost, record, Some(machine));
        }
        return schedule(
            &tasks,
            &mut CpuHost::new(&pools, None),
            record,
            Some(machine),
        );
    };
    // Seeded, so a strategy simulates to the same time every run.
    let mut rng = Rng::new(DISPATCH_SEED);
    let draws: Vec<Scheduled> = (0..DISPATCH_DRAWS)
        .map(|_| {
            let delays: Vec<f64> = (0..tasks.len())
                .map(|_| bins[rng.below(bins.len())])
                .collect();
            schedule(
                &tasks,
                &mut CpuHost::new(&pools, Some(&delays)),
                record,
                Some(machine),
            )
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

/// Schedules [`super::simulate`] averages over when dispatch delays vary: enough that the mean's
/// own spread (a few tenths of a percent on LeNet-5 and AlexNet) is well below the model's error.
pub const DISPATCH_DRAWS: usize = 32;
const DISPATCH_SEED: u64 = 0x6469_7370_6174_6368;

/// The embedded runtime's host (see the module docs): the free times of its shared cores and of
/// its actor threads, and each compute task's dispatch delay.
#[derive(Debug)]
pub(super) struct CpuHost<'a> {
    pools: Pools,
    /// Task t's dispatch delay, drawn; `pools.dispatch_s` for every task where `None`.
    delays: Option<&'a [f64]>,
    /// When each shared core is free (none: the devices do not share cores).
    slots: Vec<f64>,
    /// When each actor thread is free (none: actors do not wait for threads).
    actors: Vec<f64>,
}

/// The core and actor thread a task holds, by index.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CpuBooking {
    slot: Option<usize>,
    actor: Option<usize>,
}

impl<'a> CpuHost<'a> {
    pub(super) fn new(pools: &Pools, delays: Option<&'a [f64]>) -> CpuHost<'a> {
        CpuHost {
            pools: *pools,
            delays,
            slots: vec![0.0; pools.compute_slots.unwrap_or(0)],
            actors: vec![0.0; pools.actor_threads.unwrap_or(0)],
        }
    }

    fn dispatch(&self, task: usize) -> f64 {
        self.delays.map_or(self.pools.dispatch_s, |d| d[task])
    }
}

/// The thread of `pool` for a task that can start at `at`: of those already free then, the one
/// that freed last, so that threads free earlier stay free for tasks that can start earlier (a task
/// held back by its device must not take a thread idle since long before: nothing placed later
/// could use that gap); if none is free yet, the one that frees first. Ties: the lowest.
fn fitting(pool: &[f64], at: f64) -> usize {
    let free = (0..pool.len())
        .filter(|&k| pool[k] <= at)
        .max_by(|&a, &b| pool[a].total_cmp(&pool[b]).then(b.cmp(&a)));
    free.or_else(|| (0..pool.len()).min_by(|&a, &b| pool[a].total_cmp(&pool[b])))
        .expect("a non-empty pool")
}

impl Host for CpuHost<'_> {
    type Booking = CpuBooking;

    fn start(
        &mut self,
        task: usize,
        work: HostWork,
        mut begin: f64,
        duration: f64,
    ) -> (f64, CpuBooking) {
        let compute = work == HostWork::Kernel;
        let is_move = work == HostWork::Copy;
        let on_device = work != HostWork::Network;
        let mut booking = CpuBooking::default();
        if on_device && !self.actors.is_empty() {
            let k = fitting(&self.actors, begin);
            begin = begin.max(self.actors[k]);
            if !compute {
                booking.actor = Some(k);
            }
        }
        let pooled = !self.slots.is_empty() && duration > 0.0;
        // The dispatch wakes the device's threads, and waking one onto an idle core is most of its
        // delay. With every core busy, they queue behind running threads and the kernel starts
        // as a core frees, after only the runtime's CPU (below).
        if compute && (!pooled || self.slots.iter().any(|&free| free <= begin)) {
            begin += self.dispatch(task);
        }
        // The runtime's work on a compute task ends its dispatch, on the core its kernel then uses.
        let handling = if compute {
            self.pools.runtime_cpu_s
        } else {
            0.0
        };
        booking.slot = pooled.then(|| fitting(&self.slots, begin - handling));
        if let Some(k) = booking.slot {
            if is_move && self.slots[k] > begin {
                // No core is free: the actor copies at once all the same, on a core the OS shares
                // with a kernel, so the copy's CPU comes out of that core's later work.
                self.slots[k] += duration;
                booking.slot = None;
            } else {
                begin = begin.max(self.slots[k] + handling);
            }
        }
        (begin, booking)
    }

    fn finish(&mut self, booking: CpuBooking, end: f64) {
        if let Some(k) = booking.slot {
            self.slots[k] = end;
        }
        if let Some(k) = booking.actor {
            self.actors[k] = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::DeviceId;
    use crate::simulate::{
        Resource, Task, TaskKind, list_schedule_dispatched, list_schedule_pools,
        list_schedule_shared,
    };

    #[test]
    fn a_host_without_pools_or_dispatch_schedules_as_the_dedicated_one() {
        // random graphs of kernels, moves, messages (with latency) and network work, some of zero
        // duration: the machine without runtime costs skips the CPU host; that changes nothing
        let mut rng = legion_ops::rng::Rng::new(11);
        for _ in 0..200 {
            let n = 1 + rng.below(40);
            let tasks: Vec<Task> = (0..n)
                .map(|t| {
                    let (kind, resource) = match rng.below(4) {
                        0 => (TaskKind::Forward, Resource::Device(rng.below(3))),
                        1 => (TaskKind::Move, Resource::Device(rng.below(3))),
                        2 => (TaskKind::Copy, Resource::Link(rng.below(3), rng.below(3))),
                        _ => (TaskKind::Network, Resource::Network(rng.below(2))),
                    };
                    let deps = (0..t).filter(|_| rng.below(5) == 0).collect();
                    Task {
                        name: String::new(),
                        kind,
                        resource,
                        duration: rng.below(4) as f64 * 0.5,
                        bytes: 0,
                        latency: rng.below(2) as f64 * 0.25,
                        deps,
                        collective: None,
                    }
                })
                .collect();
            let graph = Schedulable::new(CompactTasks::from_tasks(&tasks));
            let dedicated = schedule(&graph, &mut DedicatedHost, true, None);
            let pooled = schedule(
                &graph,
                &mut CpuHost::new(&Pools::default(), None),
                true,
                None,
            );
            assert_eq!(dedicated.makespan.to_bits(), pooled.makespan.to_bits());
            assert_eq!(dedicated.times, pooled.times, "{tasks:?}");
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
            collective: None,
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
            collective: None,
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
            collective: None,
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
            collective: None,
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
            collective: None,
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
}
