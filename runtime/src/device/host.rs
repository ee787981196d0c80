//! A device on host cores: its instances live in host memory, its compute ops (kernels and folds)
//! run one at a time on its compute pool (`compute`), like a GPU stream, and its data movement
//! (local copies, sends, receives) runs on the actor as soon as it is ready, so that transfers
//! overlap compute.
//!
//! Instances are `Arc`s: readers share them, and a writer takes the only reference (the analysis
//! guarantees nobody else holds it at that point). A copy that covers a whole instance shares or
//! adopts its buffer instead of copying it; whoever writes to a shared buffer next copies it
//! first.

use super::driver::{Driver, DriverEvent, Handed, Lent, StepEnd, StepStart, answered};
use super::{DeviceActor, DeviceSetup, caught};
use crate::buffer::Buffer;
use crate::compute::ComputePool;
use crate::exec::{self, ExecContext, HostAccess, StepInput, TaskOutcome};
use crate::moves;
use crate::program::{DeviceProgram, LocalOpKind};
use crate::recycle::BufferPool;
use crate::task::Privilege;
use crate::transport::{SliceData, SliceMessage, Transport};
use kameo::actor::ActorRef;
use legion_ops::backend::cpu::{Cpu, CpuStream};
use legion_ops::backend::{Backend, In, Out};
use legion_ops::train::Sgd;
use legion_ops::{Graph, Rect};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

pub(crate) struct HostDriver {
    program: Arc<DeviceProgram>,
    graph: Arc<Graph>,
    seed: u64,
    sgd: Sgd,
    transport: Arc<dyn Transport>,
    pool: ComputePool,
    /// Buffers of gathered and received slices, reused across steps.
    buffers: Arc<BufferPool>,
    /// `None` while a compute op writes it.
    instances: Vec<Option<Arc<Buffer>>>,
    /// Per op, the working copy (bf16) of the weight it reads, kept across steps: a bf16 step
    /// allocates none once each op has run (see `exec::enqueue`).
    working: Vec<Option<Buffer>>,
    /// Compute ops ready to run, lowest first: program order, which puts the forward pass
    /// before the updates that do not block it.
    queue: BinaryHeap<Reverse<u32>>,
    /// Whether a compute op is on the pool.
    busy: bool,
    step: Option<Running>,
}

struct Running {
    step: u64,
    input: Arc<StepInput>,
    actor: ActorRef<DeviceActor>,
}

impl HostDriver {
    pub(crate) fn new(setup: &DeviceSetup, pool: ComputePool) -> HostDriver {
        let program = Arc::clone(&setup.program);
        let instances = program
            .instances
            .iter()
            .map(|i| Some(Arc::new(Buffer::zeros(i.dtype, i.rect.volume()))))
            .collect();
        let working = (0..program.ops.len()).map(|_| None).collect();
        HostDriver {
            program,
            graph: Arc::clone(&setup.graph),
            seed: setup.seed,
            sgd: setup.sgd,
            transport: Arc::clone(&setup.transport),
            pool,
            buffers: Arc::clone(&setup.buffers),
            working,
            instances,
            queue: BinaryHeap::new(),
            busy: false,
            step: None,
        }
    }

    fn rect(&self, i: u32) -> Rect {
        self.program.instances[i as usize].rect
    }

    fn instance(&self, i: u32) -> &Buffer {
        self.instances[i as usize]
            .as_deref()
            .unwrap_or_else(|| panic!("instance {i} is being written"))
    }

    /// The instance to write part of. An instance may share its buffer with another device's after
    /// a zero-copy transfer; it then gets its own copy first.
    fn instance_mut(&mut self, i: u32) -> &mut Buffer {
        let arc = self.instances[i as usize]
            .as_mut()
            .unwrap_or_else(|| panic!("instance {i} is being written"));
        Arc::make_mut(arc)
    }

    fn take(&mut self, i: u32) -> Arc<Buffer> {
        self.instances[i as usize]
            .take()
            .unwrap_or_else(|| panic!("instance {i} taken twice"))
    }

    fn share(&self, i: u32) -> Arc<Buffer> {
        Arc::clone(
            self.instances[i as usize]
                .as_ref()
                .unwrap_or_else(|| panic!("instance {i} is being written")),
        )
    }

    /// Makes instance `dst` hold `data` (laid out over `rect`): adopts the buffer when it covers
    /// the whole instance, else copies it in.
    fn store(&mut self, dst: u32, rect: &Rect, data: Arc<Buffer>) {
        let layout = self.rect(dst);
        if layout == *rect {
            if let Some(replaced) = self.instances[dst as usize].replace(data) {
                self.buffers.give(replaced);
            }
        } else {
            let to = Out {
                rect: layout,
                mem: self.instance_mut(dst),
            };
            Cpu::default().copy_rect(
                &mut CpuStream,
                In {
                    rect: *rect,
                    mem: &data,
                },
                to,
                rect,
            );
            self.buffers.give(data);
        }
    }

    /// Copies `rect` from instance `src` into instance `dst`: shares the buffer when the rect is
    /// all of both, and otherwise copies each element once, straight from one instance into the
    /// other.
    fn copy(&mut self, src: u32, dst: u32, rect: &Rect) {
        let (src_layout, dst_layout) = (self.rect(src), self.rect(dst));
        if src_layout == *rect || dst_layout == *rect {
            // One of the two is a plain share or adoption: at most one copy either way.
            let data = self.slice(src, rect);
            self.store(dst, rect, data);
        } else {
            let from = self.share(src);
            let to = Out {
                rect: dst_layout,
                mem: self.instance_mut(dst),
            };
            let from = In {
                rect: src_layout,
                mem: &*from,
            };
            Cpu::default().copy_rect(&mut CpuStream, from, to, rect);
        }
    }

    /// `rect` of instance `src` to hand to another instance: the buffer itself when it is all of it.
    fn slice(&self, src: u32, rect: &Rect) -> Arc<Buffer> {
        let layout = self.rect(src);
        if layout == *rect {
            self.share(src)
        } else {
            let dtype = self.program.instances[src as usize].dtype;
            let reuse = self.buffers.take(dtype, rect.volume());
            Arc::new(self.instance(src).gather_into(&layout, rect, reuse))
        }
    }

    /// Runs a data-movement op on the actor's thread.
    fn move_data(&mut self, op: u32, slice: Option<SliceData>) -> Result<TaskOutcome, String> {
        let program = Arc::clone(&self.program);
        match &program.ops[op as usize].kind {
            LocalOpKind::Copy { src, dst, rect } => self.copy(*src, *dst, rect),
            LocalOpKind::Send {
                copy,
                src,
                rect,
                to,
            } => {
                let data = self.slice(*src, rect);
                let step = self.step.as_ref().expect("ops run inside a step").step;
                self.transport.send(SliceMessage {
                    step,
                    copy: *copy,
                    to: *to,
                    data,
                });
            }
            LocalOpKind::Recv { dst, rect, .. } => match slice {
                Some(SliceData::Host(data)) => self.store(*dst, rect, data),
                Some(SliceData::Device(_)) => {
                    return Err("a slice in GPU memory reached a CPU device".into());
                }
                None => unreachable!("a receive runs with its slice"),
            },
            LocalOpKind::Task { .. } | LocalOpKind::Fold { .. } => {
                unreachable!("compute ops run on the pool")
            }
        }
        Ok(TaskOutcome::default())
    }
}

impl Driver for HostDriver {
    fn start_step(&mut self, start: &StepStart) {
        self.step = Some(Running {
            step: start.step,
            input: Arc::clone(&start.input),
            actor: start.actor.clone(),
        });
    }

    fn run(&mut self, op: u32, slice: Option<SliceData>) -> Handed {
        if self.program.ops[op as usize].is_compute() {
            self.queue.push(Reverse(op));
            return Handed::Pending;
        }
        let start = Instant::now();
        let result = self.move_data(op, slice);
        Handed::Ran {
            result,
            start,
            end: Instant::now(),
        }
    }

    /// Starts the next compute op if the pool is idle.
    fn pump(&mut self) {
        if self.busy {
            return;
        }
        let Some(Reverse(i)) = self.queue.pop() else {
            return;
        };
        self.busy = true;
        let program = Arc::clone(&self.program);
        let (reads, writes) = match &program.ops[i as usize].kind {
            LocalOpKind::Task { task, instances } => {
                let mut reads = Vec::new();
                let mut writes = Vec::new();
                for (req, &inst) in task.requirements.iter().zip(instances) {
                    if req.privilege.writes() {
                        // Kernels overwrite what they write and reduce into, all of it.
                        let overwrites = req.privilege != Privilege::ReadWrite;
                        writes.push((inst, self.take(inst), overwrites));
                    } else {
                        reads.push(self.share(inst));
                    }
                }
                (reads, writes)
            }
            LocalOpKind::Fold {
                srcs,
                dst,
                rect,
                accumulate,
            } => {
                let reads = srcs.iter().map(|&s| self.share(s)).collect();
                let overwrites = !accumulate && *rect == self.rect(*dst);
                (reads, vec![(*dst, self.take(*dst), overwrites)])
            }
            _ => unreachable!("only compute ops are queued"),
        };
        let running = self.step.as_ref().expect("compute runs inside a step");
        let input = Arc::clone(&running.input);
        let actor = running.actor.clone();
        let graph = Arc::clone(&self.graph);
        let (seed, sgd) = (self.seed, self.sgd.at(input.lr));
        let mut working = self.working[i as usize].take();
        self.pool.spawn(move || {
            let start = Instant::now();
            let mut writes = writes;
            let result = caught(|| {
                let run = Compute {
                    graph: &graph,
                    seed,
                    sgd,
                    input: &input,
                };
                run.op(&program, i, &reads, &mut writes, &mut working)
            });
            // Readers let go before the actor hears of it, so a writer after us finds them gone.
            drop(reads);
            let end = Instant::now();
            let done = DriverEvent::OpDone {
                op: i,
                result,
                start,
                end,
                lent: Lent {
                    instances: writes,
                    working,
                },
            };
            if let Err(e) = actor.tell(done).try_send() {
                tracing::error!("device actor gone: {e}");
            }
        });
    }

    fn reclaim(&mut self, op: u32, lent: Lent) {
        for (i, b, _) in lent.instances {
            self.instances[i as usize] = Some(b);
        }
        self.working[op as usize] = lent.working;
        self.busy = false;
    }

    fn end_step(&mut self) -> Option<StepEnd> {
        self.step = None;
        Some(StepEnd::default())
    }

    fn load(&mut self, pieces: Vec<(u32, Rect, Buffer)>) -> oneshot::Receiver<Result<(), String>> {
        for (i, rect, data) in pieces {
            let layout = self.rect(i);
            let to = Out {
                rect: layout,
                mem: self.instance_mut(i),
            };
            Cpu::default().copy_rect(&mut CpuStream, In { rect, mem: &data }, to, &rect);
        }
        answered(Ok(()))
    }

    fn read(&mut self, instance: u32, rect: Rect) -> oneshot::Receiver<Result<Buffer, String>> {
        answered(Ok(self
            .instance(instance)
            .gather(&self.rect(instance), &rect)))
    }
}

/// The buffer a compute op writes. Nobody else runs on it (the analysis orders every access), but
/// it may still share its memory with another instance after a zero-copy transfer: an op that
/// overwrites all of it then starts from a fresh buffer, one that reads it first from a copy.
fn exclusive((_, b, overwrites): &mut (u32, Arc<Buffer>, bool)) -> &mut Buffer {
    if Arc::get_mut(b).is_none() && *overwrites {
        *b = Arc::new(Buffer::zeros(b.dtype(), b.len()));
    }
    Arc::make_mut(b)
}

/// What a compute op on the pool runs with, besides its operands.
struct Compute<'a> {
    graph: &'a Graph,
    seed: u64,
    sgd: Sgd,
    input: &'a StepInput,
}

impl Compute<'_> {
    /// Runs compute op `op` of `program` on `reads` and `writes` (a task with its weight's
    /// `working` copy, if it reads one).
    fn op(
        &self,
        program: &DeviceProgram,
        op: u32,
        reads: &[Arc<Buffer>],
        writes: &mut [(u32, Arc<Buffer>, bool)],
        working: &mut Option<Buffer>,
    ) -> Result<TaskOutcome, String> {
        match &program.ops[op as usize].kind {
            LocalOpKind::Task { task, .. } => {
                let mut reads = reads.iter();
                let mut writes = writes.iter_mut().map(exclusive);
                let access = task
                    .requirements
                    .iter()
                    .map(|req| {
                        if req.privilege.writes() {
                            HostAccess::Write(writes.next().unwrap())
                        } else {
                            HostAccess::Read(reads.next().unwrap())
                        }
                    })
                    .collect();
                let ctx = ExecContext {
                    graph: self.graph,
                    precision: program.precision,
                    seed: self.seed,
                    sgd: self.sgd.at(self.input.lr),
                    input: self.input,
                };
                exec::execute(&ctx, task, access, working).map_err(|e| e.to_string())
            }
            LocalOpKind::Fold {
                srcs,
                dst,
                rect,
                accumulate,
            } => {
                let terms: Vec<In<Buffer>> = reads
                    .iter()
                    .zip(srcs)
                    .map(|(b, &s)| In {
                        rect: program.instances[s as usize].rect,
                        mem: &**b,
                    })
                    .collect();
                let to = Out {
                    rect: program.instances[*dst as usize].rect,
                    mem: exclusive(&mut writes[0]),
                };
                moves::fold(
                    &Cpu::default(),
                    &mut CpuStream,
                    to,
                    &terms,
                    rect,
                    *accumulate,
                );
                Ok(TaskOutcome::default())
            }
            _ => unreachable!("only compute ops run on the pool"),
        }
    }
}
