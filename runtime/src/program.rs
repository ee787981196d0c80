//! A step's analysed graph, cut into one program per device. Built once, replayed every step.
//!
//! A copy between two devices becomes a `Send` on the source and a `Recv` on the destination;
//! every other op runs on one device. The analysis guarantees that each dependence is then local
//! (see `analysis`), so a device needs from others nothing but the data of its `Recv`s.

use crate::analysis::{InstanceId, OpId, OpKind, StepGraph};
use crate::region::{DType, Regions};
use crate::task::TaskSpec;
use legion_ops::partition::DeviceId;
use legion_ops::{Precision, Rect};

/// A physical instance as a device stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalInstance {
    /// Its id in the step graph.
    pub global: InstanceId,
    pub rect: Rect,
    pub dtype: DType,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LocalOpKind {
    /// `instances[i]` serves requirement `i` (indices into the program's instances).
    Task { task: TaskSpec, instances: Vec<u32> },
    /// `rect` of one local instance into another: shared when it is all of both, else copied
    /// once, straight across.
    Copy { src: u32, dst: u32, rect: Rect },
    /// Ships `rect` of `src` to device `to`, tagged with the copy's op id.
    Send {
        copy: OpId,
        src: u32,
        rect: Rect,
        to: DeviceId,
    },
    /// Receives the data of copy `copy` into `rect` of `dst`.
    Recv { copy: OpId, dst: u32, rect: Rect },
    Fold {
        srcs: Vec<u32>,
        dst: u32,
        rect: Rect,
        accumulate: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct LocalOp {
    pub kind: LocalOpKind,
    /// The op of the step graph this is (a half of).
    pub global: OpId,
    /// Local ops that must finish first.
    pub deps: Vec<u32>,
}

impl LocalOp {
    /// Whether this op computes (a kernel or a sum) rather than moves data; a device runs its
    /// compute ops one at a time, like a GPU stream.
    pub fn is_compute(&self) -> bool {
        matches!(
            self.kind,
            LocalOpKind::Task { .. } | LocalOpKind::Fold { .. }
        )
    }

    /// What the op is, for errors: `index` is its place in its program.
    pub fn describe(&self, index: u32, graph: &legion_ops::Graph) -> String {
        match &self.kind {
            LocalOpKind::Task { task, .. } => task.label(graph),
            LocalOpKind::Copy { .. } => format!("copy (op {index})"),
            LocalOpKind::Fold { .. } => format!("fold (op {index})"),
            LocalOpKind::Send { copy, to, .. } => format!("send of copy {copy} to device {to}"),
            LocalOpKind::Recv { copy, .. } => format!("receive of copy {copy}"),
        }
    }

    /// Whether the op is a task without requirements (only the overhead probe's empty tasks are).
    /// It can neither conflict with the kernel a device is running nor need its instances, so the
    /// actor runs it inline rather than paying two thread hand-offs to the pool and back.
    pub fn touches_no_data(&self) -> bool {
        matches!(&self.kind, LocalOpKind::Task { task, .. } if task.requirements.is_empty())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct DeviceProgram {
    pub device: DeviceId,
    /// What its tasks compute in (the regions' `Regions::precision`).
    pub precision: Precision,
    pub instances: Vec<LocalInstance>,
    pub ops: Vec<LocalOp>,
    /// For each op, the local ops that depend on it.
    pub dependents: Vec<Vec<u32>>,
    /// The first op of inference (`ops.len()` where none was planned): the ops before it are
    /// the training step's. Inference's ops may depend on the step's, which a run of inference
    /// alone counts as done (the step before it ran whole); the step's never depend on
    /// inference's.
    pub inference_from: u32,
}

/// What a run of a device's program executes: a training step, or inference on a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    Step,
    Inference,
}

impl DeviceProgram {
    /// The ops a run of `part` executes.
    pub fn part(&self, part: Part) -> std::ops::Range<u32> {
        match part {
            Part::Step => 0..self.inference_from,
            Part::Inference => self.inference_from..self.ops.len() as u32,
        }
    }

    /// The part op `op` belongs to.
    pub fn part_of(&self, op: u32) -> Part {
        match op < self.inference_from {
            true => Part::Step,
            false => Part::Inference,
        }
    }

    /// Local index of a step-graph instance, if this device holds it.
    pub fn local_instance(&self, global: InstanceId) -> Option<u32> {
        self.instances
            .binary_search_by_key(&global, |i| i.global)
            .ok()
            .map(|i| i as u32)
    }
}

/// Cuts `graph` into one program per device `0..num_devices`.
pub fn split_programs(
    graph: &StepGraph,
    regions: &Regions,
    num_devices: usize,
) -> Vec<DeviceProgram> {
    let mut programs: Vec<DeviceProgram> = (0..num_devices)
        .map(|device| DeviceProgram {
            device,
            precision: regions.precision(),
            instances: Vec::new(),
            ops: Vec::new(),
            dependents: Vec::new(),
            inference_from: 0,
        })
        .collect();
    // Instances in global order, so each program's list is sorted by global id.
    let mut local_of = vec![0u32; graph.instances.len()];
    for (g, inst) in graph.instances.iter().enumerate() {
        let p = &mut programs[inst.device];
        local_of[g] = p.instances.len() as u32;
        p.instances.push(LocalInstance {
            global: g as InstanceId,
            rect: inst.rect,
            dtype: regions.info(inst.region).dtype,
        });
    }
    let device_of = |i: InstanceId| graph.instances[i as usize].device;
    let local = |i: InstanceId| local_of[i as usize];
    // For each global op, its local index on each device it has a half on: (device, index).
    let mut halves: Vec<[(DeviceId, u32); 2]> = Vec::with_capacity(graph.ops.len());
    let none = (usize::MAX, u32::MAX);
    for (g, op) in graph.ops.iter().enumerate() {
        let g = g as OpId;
        let mut push = |device: DeviceId, kind: LocalOpKind| {
            let p = &mut programs[device];
            if (g as usize) < graph.step_ops {
                p.inference_from += 1;
            }
            p.ops.push(LocalOp {
                kind,
                global: g,
                deps: Vec::new(),
            });
            (device, (p.ops.len() - 1) as u32)
        };
        let h = match &op.kind {
            OpKind::Task { task, instances } => [
                push(
                    task.device,
                    LocalOpKind::Task {
                        task: task.clone(),
                        instances: instances.iter().map(|&i| local(i)).collect(),
                    },
                ),
                none,
            ],
            OpKind::Fold {
                srcs,
                dst,
                rect,
                accumulate,
            } => [
                push(
                    device_of(*dst),
                    LocalOpKind::Fold {
                        srcs: srcs.iter().map(|&i| local(i)).collect(),
                        dst: local(*dst),
                        rect: *rect,
                        accumulate: *accumulate,
                    },
                ),
                none,
            ],
            OpKind::Copy { src, dst, rect, .. } if device_of(*src) == device_of(*dst) => [
                push(
                    device_of(*dst),
                    LocalOpKind::Copy {
                        src: local(*src),
                        dst: local(*dst),
                        rect: *rect,
                    },
                ),
                none,
            ],
            OpKind::Copy { src, dst, rect, .. } => [
                push(
                    device_of(*src),
                    LocalOpKind::Send {
                        copy: g,
                        src: local(*src),
                        rect: *rect,
                        to: device_of(*dst),
                    },
                ),
                push(
                    device_of(*dst),
                    LocalOpKind::Recv {
                        copy: g,
                        dst: local(*dst),
                        rect: *rect,
                    },
                ),
            ],
        };
        halves.push(h);
    }
    let on = |dep: OpId, device: DeviceId, of: OpId| -> u32 {
        halves[dep as usize]
            .iter()
            .find(|(d, _)| *d == device)
            .map(|&(_, i)| i)
            .unwrap_or_else(|| {
                panic!("op {of} on device {device} depends on op {dep}, which has no part there")
            })
    };
    for (g, op) in graph.ops.iter().enumerate() {
        let g = g as OpId;
        let [first, second] = halves[g as usize];
        let (dev, idx) = first;
        let deps: Vec<u32> = op.deps.iter().map(|&d| on(d, dev, g)).collect();
        programs[dev].ops[idx as usize].deps.extend(deps);
        if let OpKind::Copy { dst_deps, .. } = &op.kind {
            // A local copy's destination side is the same op; a remote one's is the `Recv`.
            let (dev, idx) = if second.0 == usize::MAX {
                first
            } else {
                second
            };
            let deps: Vec<u32> = dst_deps.iter().map(|&d| on(d, dev, g)).collect();
            programs[dev].ops[idx as usize].deps.extend(deps);
        }
    }
    for p in &mut programs {
        p.dependents = vec![Vec::new(); p.ops.len()];
        for (i, op) in p.ops.iter_mut().enumerate() {
            op.deps.sort_unstable();
            op.deps.dedup();
            for &d in &op.deps {
                p.dependents[d as usize].push(i as u32);
            }
        }
    }
    programs
}

/// How the tasks of an [`empty_program`] depend on each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmptyShape {
    /// No dependences: every task is ready when the step starts.
    Independent,
    /// Task `i` depends on task `i - 1`: each completion makes the next task ready.
    Chain,
}

/// Which path the tasks of an [`empty_program`] take through the device actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmptyDispatch {
    /// The tasks have no requirements, so the actor runs them inline (see
    /// [`LocalOp::touches_no_data`]): the cost of the actor's own bookkeeping per task.
    Inline,
    /// Each task reads one single-element instance, so it goes to the compute pool and back like
    /// any kernel: what a real task pays beyond its kernel.
    Pool,
}

/// A program of `count` [`TaskKind::Empty`](crate::task::TaskKind::Empty) tasks on `device`: what a
/// device actor costs per task when the kernels cost nothing. The tasks name `layer`, which must
/// exist in the graph the actor is given (only error messages look at it).
pub fn empty_program(
    device: DeviceId,
    count: u32,
    shape: EmptyShape,
    dispatch: EmptyDispatch,
    layer: legion_ops::LayerId,
) -> DeviceProgram {
    use crate::region::RegionId;
    use crate::task::{Privilege, Role, TaskKind};
    let one = Rect::new(&[0], &[1]);
    let (instances, reads) = match dispatch {
        EmptyDispatch::Inline => (Vec::new(), Vec::new()),
        EmptyDispatch::Pool => (
            vec![LocalInstance {
                global: 0,
                rect: one,
                dtype: DType::F32,
            }],
            vec![0],
        ),
    };
    let ops = (0..count)
        .map(|i| {
            let mut task = TaskSpec::new(TaskKind::Empty, layer, one, device);
            if !reads.is_empty() {
                task.require(RegionId(0), one, Privilege::ReadOnly, Role::Input(0));
            }
            LocalOp {
                kind: LocalOpKind::Task {
                    task,
                    instances: reads.clone(),
                },
                global: i,
                deps: match shape {
                    EmptyShape::Chain if i > 0 => vec![i - 1],
                    _ => Vec::new(),
                },
            }
        })
        .collect::<Vec<_>>();
    let mut dependents = vec![Vec::new(); ops.len()];
    for (i, op) in ops.iter().enumerate() {
        for &d in &op.deps {
            dependents[d as usize].push(i as u32);
        }
    }
    DeviceProgram {
        device,
        precision: Precision::Fp32,
        instances,
        inference_from: ops.len() as u32,
        ops,
        dependents,
    }
}
