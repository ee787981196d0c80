//! The device actor: owns one device's physical instances and runs its program each step.
//!
//! An op runs once its local dependences are done (a `Recv` also waits for its data). Compute ops
//! (kernels and folds) run one at a time per device on its compute pool (`compute`), like a GPU
//! stream; data movement (local copies, sends, receives) runs on the actor as soon as it is ready,
//! so transfers overlap compute. A task that touches no data (the overhead probe's empty tasks)
//! runs on the actor too: the pool's round trip would cost more than it. Instances are `Arc`s:
//! readers share them, and a writer takes the only reference (the analysis guarantees nobody else
//! holds it at that point).
//!
//! A device on a GPU (`cuda`) keeps this scheduling, but its instances live in device memory and
//! every op that touches them is enqueued on the device's CUDA stream by a thread of its own: the
//! actor never waits for the GPU.

mod cuda;

use crate::analysis::OpId;
use crate::buffer::{self, Buffer};
use crate::compute::ComputePool;
use crate::exec::{self, Access, ExecContext, StepInput, TaskOutcome};
use crate::program::{DeviceProgram, LocalOpKind};
use crate::recycle::BufferPool;
use crate::task::Privilege;
use crate::transport::{GpuSliceMessage, SliceMessage, Transport};
use cuda::{Command, GpuQueue};
use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use legion_cuda::Cuda;
use legion_ops::backend::KernelError;
use legion_ops::partition::DeviceId;
use legion_ops::train::Sgd;
use legion_ops::{Graph, Rect};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// One op's execution, for traces.
#[derive(Clone, Debug, PartialEq)]
pub struct OpEvent {
    /// Index of the op in the device's program.
    pub op: u32,
    /// Seconds since the step's epoch.
    pub start: f64,
    pub end: f64,
}

/// What a device reports at the end of a step.
#[derive(Debug)]
pub struct StepReport {
    pub device: DeviceId,
    pub outcome: TaskOutcome,
    /// The first task failure (the step's results are then meaningless).
    pub error: Option<String>,
    /// Every op's execution when the step was traced.
    pub events: Vec<OpEvent>,
}

/// Everything a device needs to run steps.
pub struct DeviceSetup {
    pub program: Arc<DeviceProgram>,
    pub graph: Arc<Graph>,
    pub seed: u64,
    pub sgd: Sgd,
    pub transport: Arc<dyn Transport>,
    /// Where this device's kernels run.
    pub compute: Compute,
    /// Buffers of gathered and received slices, reused across steps (shared by this process's
    /// devices).
    pub buffers: Arc<BufferPool>,
}

/// Where a device's instances live and its kernels run.
#[derive(Clone)]
pub enum Compute {
    /// Host memory, kernels on this process's cores (see `compute`).
    Cores(ComputePool),
    /// Device memory of this GPU, kernels on a stream of the device's own. `neighbours`: the
    /// devices of this process on the same GPU (this one included), whose slices stay in its memory.
    Gpu {
        cuda: Arc<Cuda>,
        neighbours: Arc<[DeviceId]>,
    },
}

#[derive(Actor)]
pub struct DeviceActor {
    setup: DeviceSetup,
    /// The submitter of a device on a GPU; `instances` is then empty.
    gpu: Option<GpuQueue>,
    instances: Vec<Option<Arc<Buffer>>>,
    /// The `Recv` op of each incoming copy.
    recv_of: HashMap<u32, u32>,
    step: Option<StepState>,
    /// Slices that arrived before their step started here.
    early: Vec<Incoming>,
    /// Ops ready to run, a stack that `run_ready` drains; kept across calls so that completing an
    /// op allocates nothing.
    ready: Vec<u32>,
}

struct StepState {
    step: u64,
    input: Arc<StepInput>,
    epoch: Instant,
    remaining: Vec<u32>,
    arrived: HashMap<u32, Arrived>,
    compute_queue: BinaryHeap<Reverse<u32>>,
    busy: bool,
    done: usize,
    outcome: TaskOutcome,
    error: Option<String>,
    events: Option<Vec<OpEvent>>,
    reply: Option<oneshot::Sender<StepReport>>,
    /// On a GPU: whether the submitter has been told that every op is enqueued.
    finishing: bool,
}

impl DeviceActor {
    /// The device of `setup.program`, its instances zeroed. Fails where a GPU cannot hold them or
    /// give the device a stream.
    pub fn new(setup: DeviceSetup) -> Result<DeviceActor, KernelError> {
        let (instances, gpu) = match &setup.compute {
            Compute::Cores(_) => {
                let instances = setup
                    .program
                    .instances
                    .iter()
                    .map(|i| Some(Arc::new(Buffer::zeros(i.dtype, i.rect.volume()))))
                    .collect();
                (instances, None)
            }
            Compute::Gpu { cuda, neighbours } => {
                let queue = GpuQueue::start(
                    Arc::clone(cuda),
                    Arc::clone(neighbours),
                    Arc::clone(&setup.program),
                    Arc::clone(&setup.graph),
                    setup.seed,
                    setup.sgd,
                    Arc::clone(&setup.transport),
                    Arc::clone(&setup.buffers),
                )?;
                (Vec::new(), Some(queue))
            }
        };
        let recv_of = setup
            .program
            .ops
            .iter()
            .enumerate()
            .filter_map(|(i, op)| match op.kind {
                LocalOpKind::Recv { copy, .. } => Some((copy, i as u32)),
                _ => None,
            })
            .collect();
        Ok(DeviceActor {
            setup,
            gpu,
            instances,
            recv_of,
            step: None,
            early: Vec::new(),
            ready: Vec::new(),
        })
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

    /// Makes instance `dst` hold `data` (laid out over `rect`): adopts the buffer when it covers
    /// the whole instance, else copies it in.
    fn store(&mut self, dst: u32, rect: &Rect, data: Arc<Buffer>) {
        let layout = self.rect(dst);
        if layout == *rect {
            if let Some(replaced) = self.instances[dst as usize].replace(data) {
                self.setup.buffers.give(replaced);
            }
        } else {
            self.instance_mut(dst).copy_from(&layout, &data, rect, rect);
            self.setup.buffers.give(data);
        }
    }

    /// Copies `rect` from instance `src` into instance `dst`, on this device: shares the buffer
    /// when the rect is all of both, and otherwise copies each element once, straight from one
    /// instance into the other.
    fn copy(&mut self, src: u32, dst: u32, rect: &Rect) {
        let (src_layout, dst_layout) = (self.rect(src), self.rect(dst));
        if src_layout == *rect || dst_layout == *rect {
            // One of the two is a plain share or adoption: at most one copy either way.
            let data = self.slice(src, rect);
            self.store(dst, rect, data);
        } else {
            let from = self.share(src);
            self.instance_mut(dst)
                .copy_from(&dst_layout, &from, &src_layout, rect);
        }
    }

    /// `rect` of instance `src` to hand to another instance: the buffer itself when it is all of it.
    fn slice(&self, src: u32, rect: &Rect) -> Arc<Buffer> {
        let layout = self.rect(src);
        if layout == *rect {
            self.share(src)
        } else {
            let dtype = self.setup.program.instances[src as usize].dtype;
            let reuse = self.setup.buffers.take(dtype, rect.volume());
            Arc::new(self.instance(src).gather_into(&layout, rect, reuse))
        }
    }

    fn rect(&self, i: u32) -> Rect {
        self.setup.program.instances[i as usize].rect
    }

    fn start_step(&mut self, msg: RunStep, actor: &ActorRef<DeviceActor>) {
        let program = &self.setup.program;
        let mut remaining: Vec<u32> = program.ops.iter().map(|o| o.deps.len() as u32).collect();
        for &r in self.recv_of.values() {
            remaining[r as usize] += 1;
        }
        self.step = Some(StepState {
            step: msg.step,
            input: msg.input,
            epoch: msg.epoch,
            remaining,
            arrived: HashMap::new(),
            compute_queue: BinaryHeap::new(),
            busy: false,
            done: 0,
            outcome: TaskOutcome::default(),
            error: None,
            events: msg.trace.then(Vec::new),
            reply: Some(msg.reply),
            finishing: false,
        });
        if let Some(gpu) = &self.gpu {
            gpu.submit(Command::Start {
                step: msg.step,
                input: Arc::clone(&self.step.as_ref().unwrap().input),
                epoch: msg.epoch,
                trace: msg.trace,
                actor: actor.clone(),
            });
        }
        // Before delivering early slices: a delivery runs what it makes ready at once.
        let state = self.step.as_ref().unwrap();
        self.ready
            .extend((0..program.ops.len() as u32).filter(|&i| state.remaining[i as usize] == 0));
        let early: Vec<Incoming> = std::mem::take(&mut self.early);
        let mut later = Vec::new();
        for m in early {
            if m.step == msg.step {
                self.deliver(m, actor);
            } else {
                later.push(m);
            }
        }
        self.early = later;
        self.run_ready(actor);
        self.finish_if_done();
    }

    fn deliver(&mut self, msg: Incoming, actor: &ActorRef<DeviceActor>) {
        let current = self.step.as_ref().map(|s| s.step);
        if current != Some(msg.step) {
            self.early.push(msg);
            return;
        }
        let Some(&recv) = self.recv_of.get(&msg.copy) else {
            tracing::error!(
                device = self.setup.program.device,
                copy = msg.copy,
                "slice for no receive"
            );
            return;
        };
        let LocalOpKind::Recv { dst, rect, .. } = &self.setup.program.ops[recv as usize].kind
        else {
            unreachable!("recv_of indexes Recv ops")
        };
        let expected = (
            self.setup.program.instances[*dst as usize].dtype,
            rect.volume(),
        );
        let state = self.step.as_mut().unwrap();
        if state.arrived.contains_key(&msg.copy) {
            // A sender delivers each copy once per step: a second one is a broken or hostile peer,
            // and counting it would complete the receive early.
            tracing::error!(copy = msg.copy, step = msg.step, "duplicate slice ignored");
            return;
        }
        let data = if (msg.data.dtype(), msg.data.len()) == expected {
            msg.data
        } else {
            // The step cannot produce correct results now; finish it with an error rather than
            // hang waiting for a slice that will not come, or write past an instance's bounds.
            state.error.get_or_insert_with(|| {
                format!(
                    "copy {}: received {} {:?} values, expected {} {:?}",
                    msg.copy,
                    msg.data.len(),
                    msg.data.dtype(),
                    expected.1,
                    expected.0
                )
            });
            Arrived::Host(Arc::new(Buffer::zeros(expected.0, expected.1)))
        };
        state.arrived.insert(msg.copy, data);
        state.remaining[recv as usize] -= 1;
        if state.remaining[recv as usize] == 0 {
            self.ready.push(recv);
            self.run_ready(actor);
            self.finish_if_done();
        }
    }

    /// Runs the ready data-movement ops at once (and what they make ready), queues compute ops.
    fn run_ready(&mut self, actor: &ActorRef<DeviceActor>) {
        let program = Arc::clone(&self.setup.program);
        while let Some(i) = self.ready.pop() {
            let op = &program.ops[i as usize];
            if op.touches_no_data() {
                self.run_inline(i);
                continue;
            }
            if let Some(gpu) = &self.gpu {
                // Handed over in an order that respects every local dependence, and the stream
                // runs them in that order: what depends on this op may be handed over now.
                let command = match &op.kind {
                    LocalOpKind::Recv { copy, .. } => Command::Store {
                        op: i,
                        data: self
                            .step
                            .as_mut()
                            .unwrap()
                            .arrived
                            .remove(copy)
                            .expect("a receive runs after its data arrived"),
                    },
                    _ => Command::Run(i),
                };
                gpu.submit(command);
                self.complete(i);
                continue;
            }
            if op.is_compute() {
                self.step.as_mut().unwrap().compute_queue.push(Reverse(i));
                continue;
            }
            let start = Instant::now();
            match &op.kind {
                LocalOpKind::Copy { src, dst, rect } => self.copy(*src, *dst, rect),
                LocalOpKind::Send {
                    copy,
                    src,
                    rect,
                    to,
                } => {
                    let data = self.slice(*src, rect);
                    let step = self.step.as_ref().unwrap().step;
                    self.setup.transport.send(SliceMessage {
                        step,
                        copy: *copy,
                        to: *to,
                        data,
                    });
                }
                LocalOpKind::Recv { copy, dst, rect } => {
                    let state = self.step.as_mut().unwrap();
                    match state.arrived.remove(copy) {
                        Some(Arrived::Host(data)) => self.store(*dst, rect, data),
                        Some(Arrived::Gpu(_)) => {
                            state.error.get_or_insert_with(|| {
                                format!("copy {copy}: a slice in GPU memory reached a CPU device")
                            });
                        }
                        None => unreachable!("a receive runs after its data arrived"),
                    }
                }
                LocalOpKind::Task { .. } | LocalOpKind::Fold { .. } => unreachable!(),
            }
            self.record(i, start, Instant::now());
            self.complete(i);
        }
        if let Some(gpu) = &self.gpu {
            let state = self.step.as_mut().unwrap();
            if state.done == self.setup.program.ops.len() && !state.finishing {
                state.finishing = true;
                gpu.submit(Command::Finish);
            }
            return;
        }
        self.pump_compute(actor);
    }

    /// Runs a task that touches no data on the actor (see [`LocalOp::touches_no_data`]): with no
    /// instances to take it cannot race the kernel on the pool, and the pool's round trip would
    /// cost more than the task.
    ///
    /// [`LocalOp::touches_no_data`]: crate::program::LocalOp::touches_no_data
    fn run_inline(&mut self, i: u32) {
        let state = self.step.as_ref().unwrap();
        let start = Instant::now();
        let result = caught(|| {
            run_compute(
                &self.setup.program,
                i,
                &self.setup.graph,
                self.setup.seed,
                self.setup.sgd,
                &state.input,
                &[],
                &mut [],
            )
        });
        self.finish_compute(i, result, start, Instant::now());
    }

    /// Accounts for a finished compute op: its outcome or error, its trace event, its dependents.
    fn finish_compute(
        &mut self,
        op: u32,
        result: Result<TaskOutcome, String>,
        start: Instant,
        end: Instant,
    ) {
        let state = self.step.as_mut().expect("compute finished outside a step");
        match result {
            Ok(o) => {
                state.outcome.loss_sum += o.loss_sum;
                state.outcome.correct += o.correct;
            }
            Err(e) => {
                if state.error.is_none() {
                    let label = match &self.setup.program.ops[op as usize].kind {
                        LocalOpKind::Task { task, .. } => task.label(&self.setup.graph),
                        _ => "fold".to_string(),
                    };
                    state.error = Some(format!("{label}: {e}"));
                }
            }
        }
        self.record(op, start, end);
        self.complete(op);
    }

    /// Marks op `i` done and pushes the ops that became ready onto `self.ready`.
    fn complete(&mut self, i: u32) {
        let state = self.step.as_mut().unwrap();
        state.done += 1;
        for &d in &self.setup.program.dependents[i as usize] {
            state.remaining[d as usize] -= 1;
            if state.remaining[d as usize] == 0 {
                self.ready.push(d);
            }
        }
    }

    fn record(&mut self, op: u32, start: Instant, end: Instant) {
        let state = self.step.as_mut().unwrap();
        if let Some(events) = &mut state.events {
            events.push(OpEvent {
                op,
                start: start.duration_since(state.epoch).as_secs_f64(),
                end: end.duration_since(state.epoch).as_secs_f64(),
            });
        }
    }

    /// Starts the next compute op if the device is idle.
    fn pump_compute(&mut self, actor: &ActorRef<DeviceActor>) {
        let state = self.step.as_mut().unwrap();
        if state.busy {
            return;
        }
        let Some(Reverse(i)) = state.compute_queue.pop() else {
            return;
        };
        state.busy = true;
        let input = Arc::clone(&state.input);
        let program = Arc::clone(&self.setup.program);
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
        let graph = Arc::clone(&self.setup.graph);
        let (seed, sgd) = (self.setup.seed, self.setup.sgd);
        let actor = actor.clone();
        let Compute::Cores(pool) = &self.setup.compute else {
            unreachable!("a GPU device enqueues its compute ops on its stream")
        };
        pool.spawn(move || {
            let start = Instant::now();
            let mut writes = writes;
            let result =
                caught(|| run_compute(&program, i, &graph, seed, sgd, &input, &reads, &mut writes));
            // Readers let go before the actor hears of it, so a writer after us finds them gone.
            drop(reads);
            let end = Instant::now();
            let done = ComputeDone {
                op: i,
                writes,
                result,
                start,
                end,
            };
            if let Err(e) = actor.tell(done).try_send() {
                tracing::error!("device actor gone: {e}");
            }
        });
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

    fn finish_if_done(&mut self) {
        let Some(state) = &self.step else {
            return;
        };
        if self.gpu.is_some() {
            // Every op is enqueued, not necessarily run: the submitter says when (`GpuStepDone`).
            return;
        }
        if state.done < self.setup.program.ops.len() {
            return;
        }
        let mut state = self.step.take().unwrap();
        let report = StepReport {
            device: self.setup.program.device,
            outcome: state.outcome,
            error: state.error.take(),
            events: state.events.take().unwrap_or_default(),
        };
        if let Some(reply) = state.reply.take() {
            let _ = reply.send(report);
        }
    }
}

/// Runs a kernel, turning a panic into the task's error (the step then fails, the actor lives on).
fn caught<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("panicked: {what}"))
    })
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

#[allow(clippy::too_many_arguments)]
fn run_compute(
    program: &DeviceProgram,
    op: u32,
    graph: &Graph,
    seed: u64,
    sgd: Sgd,
    input: &StepInput,
    reads: &[Arc<Buffer>],
    writes: &mut [(u32, Arc<Buffer>, bool)],
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
                        Access::Write(writes.next().unwrap())
                    } else {
                        Access::Read(reads.next().unwrap())
                    }
                })
                .collect();
            let ctx = ExecContext {
                graph,
                seed,
                sgd,
                input,
            };
            exec::execute(&ctx, task, access).map_err(|e| e.to_string())
        }
        LocalOpKind::Fold {
            srcs,
            dst,
            rect,
            accumulate,
        } => {
            let terms: Vec<(&Buffer, Rect)> = reads
                .iter()
                .zip(srcs)
                .map(|(b, &s)| (&**b, program.instances[s as usize].rect))
                .collect();
            let layout = program.instances[*dst as usize].rect;
            buffer::fold(
                exclusive(&mut writes[0]),
                &layout,
                &terms,
                rect,
                *accumulate,
            );
            Ok(TaskOutcome::default())
        }
        _ => unreachable!("only compute ops run on the pool"),
    }
}

/// Starts a step: run every op of the program once, then reply.
pub struct RunStep {
    pub step: u64,
    pub input: Arc<StepInput>,
    /// Where step time starts, shared by all devices (for traces).
    pub epoch: Instant,
    pub trace: bool,
    pub reply: oneshot::Sender<StepReport>,
}

/// A slice from another device.
pub struct Deliver(pub SliceMessage);

/// A slice from another device on the same GPU, in its memory.
pub struct DeliverOnGpu(pub GpuSliceMessage);

/// A slice as it reaches a device.
pub(crate) struct Incoming {
    step: u64,
    copy: OpId,
    data: Arrived,
}

/// The data of a slice: host memory, or (between devices sharing a GPU) that GPU's memory.
pub(crate) enum Arrived {
    Host(Arc<Buffer>),
    Gpu(legion_cuda::Buffer),
}

impl Arrived {
    fn dtype(&self) -> crate::region::DType {
        match self {
            Arrived::Host(b) => b.dtype(),
            Arrived::Gpu(b) => b.dtype(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Arrived::Host(b) => b.len(),
            Arrived::Gpu(b) => b.len(),
        }
    }
}

struct ComputeDone {
    op: u32,
    writes: Vec<(u32, Arc<Buffer>, bool)>,
    result: Result<TaskOutcome, String>,
    start: Instant,
    end: Instant,
}

/// Writes data into instances (initial parameters): `(instance, rect, data laid out over rect)`.
pub struct Load(pub Vec<(u32, Rect, Buffer)>);

/// Reads `rect` of an instance.
pub struct ReadInstance {
    pub instance: u32,
    pub rect: Rect,
}

impl Message<RunStep> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: RunStep, ctx: &mut Context<Self, Self::Reply>) {
        assert!(self.step.is_none(), "a step is already running");
        let actor = ctx.actor_ref().clone();
        self.start_step(msg, &actor);
    }
}

impl Message<Deliver> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: Deliver, ctx: &mut Context<Self, Self::Reply>) {
        let Deliver(SliceMessage {
            step, copy, data, ..
        }) = msg;
        let data = Arrived::Host(data);
        self.deliver(Incoming { step, copy, data }, ctx.actor_ref());
    }
}

impl Message<DeliverOnGpu> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: DeliverOnGpu, ctx: &mut Context<Self, Self::Reply>) {
        let DeliverOnGpu(GpuSliceMessage {
            step, copy, data, ..
        }) = msg;
        let data = Arrived::Gpu(data);
        self.deliver(Incoming { step, copy, data }, ctx.actor_ref());
    }
}

impl Message<ComputeDone> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: ComputeDone, ctx: &mut Context<Self, Self::Reply>) {
        for (i, b, _) in msg.writes {
            self.instances[i as usize] = Some(b);
        }
        self.step
            .as_mut()
            .expect("compute finished outside a step")
            .busy = false;
        self.finish_compute(msg.op, msg.result, msg.start, msg.end);
        let actor = ctx.actor_ref().clone();
        self.run_ready(&actor);
        self.finish_if_done();
    }
}

impl Message<Load> for DeviceActor {
    type Reply = Result<(), String>;

    async fn handle(&mut self, msg: Load, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if let Some(gpu) = &self.gpu {
            let (reply, loaded) = oneshot::channel();
            gpu.submit(Command::Load(msg.0, reply));
            return loaded
                .await
                .unwrap_or_else(|_| Err("the GPU device's submitter is gone".into()));
        }
        for (i, rect, data) in msg.0 {
            let layout = self.rect(i);
            self.instance_mut(i).copy_from(&layout, &data, &rect, &rect);
        }
        Ok(())
    }
}

/// The reply to [`ReadInstance`].
#[derive(kameo::Reply)]
pub struct Piece(pub Buffer);

impl Message<ReadInstance> for DeviceActor {
    type Reply = Result<Piece, String>;

    async fn handle(
        &mut self,
        msg: ReadInstance,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        if let Some(gpu) = &self.gpu {
            let (reply, read) = oneshot::channel();
            gpu.submit(Command::Read {
                instance: msg.instance,
                rect: msg.rect,
                reply,
            });
            return read
                .await
                .unwrap_or_else(|_| Err("the GPU device's submitter is gone".into()))
                .map(Piece);
        }
        Ok(Piece(
            self.instance(msg.instance)
                .gather(&self.rect(msg.instance), &msg.rect),
        ))
    }
}

/// A GPU device's submitter has seen its stream run every op of step `step`.
pub(crate) struct GpuStepDone {
    pub step: u64,
    pub outcome: TaskOutcome,
    pub error: Option<String>,
    /// The ops' GPU times, on the step's clock.
    pub events: Vec<OpEvent>,
}

impl Message<GpuStepDone> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: GpuStepDone, _ctx: &mut Context<Self, Self::Reply>) {
        if self.step.as_ref().map(|s| s.step) != Some(msg.step) {
            tracing::error!(step = msg.step, "a GPU step ended that is not running");
            return;
        }
        let mut state = self.step.take().unwrap();
        state.outcome.loss_sum += msg.outcome.loss_sum;
        state.outcome.correct += msg.outcome.correct;
        let error = state.error.take().or(msg.error);
        let mut events = state.events.take().unwrap_or_default();
        events.extend(msg.events);
        events.sort_by(|a, b| a.start.total_cmp(&b.start));
        let report = StepReport {
            device: self.setup.program.device,
            outcome: state.outcome,
            error,
            events,
        };
        if let Some(reply) = state.reply.take() {
            let _ = reply.send(report);
        }
    }
}
