//! A device on a GPU: its instances live in device memory, and its ops run on one CUDA stream.
//!
//! The actor (`super`) keeps deciding what is ready, as for a CPU device, but never touches the
//! GPU: this driver hands each ready op to the device's **submitter**, a thread that owns the
//! stream and the instances and only enqueues. A stream runs its work in the order enqueued, so an op is
//! handed over as soon as its local dependences have been *handed over* (not finished): the
//! actor counts it done at once, and the GPU runs a whole step's ops back to back with no host
//! round trip between kernels.
//!
//! A slice for a device on the same GPU stays in its memory: the submitter gathers it into a
//! buffer of its own and hands that to the receiver through the transport
//! (`send_in_device_memory`); the
//! receiver's stream waits for the gather before copying out of it (cudarc orders the uses of a
//! buffer across the streams of one context, and frees it only after its last use). Other slices
//! leave and enter through page-locked staging buffers (`legion_cuda::Staging`), one per `Send`
//! and `Recv` op, kept across steps:
//! - a `Send` enqueues the copy into its staging buffer and passes the buffer to this device's
//!   **sender** thread, which waits for the copy, hands the slice to the transport and returns
//!   the buffer; the submitter meanwhile goes on enqueuing, so transfers overlap compute;
//! - a `Recv`'s data is written into its staging buffer and the copy to the device enqueued.
//!
//! Between GPUs of one process, a slice to a device whose GPU has peer access to this one's
//! (`Compute::Gpu::peers`) goes as a device buffer too: the receiver's stream copies it GPU to GPU
//! into a buffer of its own (`Cuda::copy_from_peer`, after waiting for the sender's stream) and
//! from there into its instance. Without peer access (and between logical GPUs of one device,
//! `--gpus 0,0`) slices are staged through the host.
//!
//! The step ends with `Finish`: the submitter waits for the stream (on its own thread), reads the
//! losses and the trace's timing events, and tells the actor ([`DriverEvent::StepDone`]).
//!
//! A failure fails its step, never the device: an op's error or panic is kept for the step's
//! report, instances are lent to ops in place (a panic cannot lose one), a send that failed still
//! hands its receiver zeros of the right size (so no device waits forever), and the next step
//! starts with the stream's kept failure cleared. Errors cudarc records on the context the
//! devices of a GPU share (from drops and event records) are reported by whichever of them
//! synchronizes next.

use super::driver::{Driver, DriverEvent, Handed, StepEnd, StepStart};
use super::{DeviceActor, DeviceSetup, OpEvent, caught};
use crate::exec::{self, ExecContext, StepInput, TaskOutcome};
use crate::moves;
use crate::program::{DeviceProgram, LocalOpKind};
use crate::recycle::BufferPool;
use crate::transport::{DeviceSlice, DeviceSliceMessage, SliceData, SliceMessage, Transport};
use crossbeam_channel::{Receiver, Sender};
use kameo::actor::ActorRef;
use legion_cuda::{Buffer, Cuda, Direction, Marker, PendingLoss, Staging, Stream};
use legion_ops::backend::{Access, Backend, In, KernelError, Out, cpu};
use legion_ops::partition::DeviceId;
use legion_ops::train::Sgd;
use legion_ops::{Graph, Rect};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// What the actor asks of its submitter.
pub(crate) enum Command {
    Start {
        step: u64,
        input: Arc<StepInput>,
        epoch: Instant,
        trace: bool,
        actor: ActorRef<DeviceActor>,
    },
    /// Enqueue op `i` (a task, a fold, a local copy or a send).
    Run(u32),
    /// Enqueue `Recv` op `op` with the data that arrived for it.
    Store { op: u32, data: SliceData },
    /// Every op of the step has been handed over: report once the stream has run them.
    Finish,
    /// Writes `(instance, rect, data laid out over rect)` into instances (initial values).
    Load(
        Vec<(u32, Rect, cpu::Buffer)>,
        oneshot::Sender<Result<(), String>>,
    ),
    /// Reads `rect` of an instance back to the host.
    Read {
        instance: u32,
        rect: Rect,
        reply: oneshot::Sender<Result<cpu::Buffer, String>>,
    },
}

/// The driver of a device on a GPU: the actor's handle on its submitter. Dropping it stops the
/// submitter and the sender.
pub(crate) struct GpuDriver {
    commands: Sender<Command>,
}

impl GpuDriver {
    /// Starts the submitter of `setup`'s device on `cuda` (its own stream, its instances
    /// allocated and zeroed), and its sender. Fails if the stream or the instances cannot be had.
    pub(crate) fn start(
        setup: &DeviceSetup,
        cuda: Arc<Cuda>,
        neighbours: Arc<[DeviceId]>,
        peers: Arc<[DeviceId]>,
    ) -> Result<GpuDriver, KernelError> {
        let program = Arc::clone(&setup.program);
        let graph = Arc::clone(&setup.graph);
        let (seed, sgd) = (setup.seed, setup.sgd);
        let transport = Arc::clone(&setup.transport);
        let buffers = Arc::clone(&setup.buffers);
        let device = program.device;
        let (commands, inbox) = crossbeam_channel::unbounded();
        let (outgoing, to_send) = crossbeam_channel::unbounded::<Outgoing>();
        let (give_back, returned) = crossbeam_channel::unbounded();
        let (started, start_result) = std::sync::mpsc::channel();
        let on_gpu = Arc::clone(&transport);
        std::thread::Builder::new()
            .name(format!("legion-gpu-submit-{device}"))
            .spawn(move || {
                let links = Links {
                    neighbours,
                    peers,
                    transport: on_gpu,
                    outgoing,
                    returned,
                };
                let submitter = Submitter::new(cuda, program, graph, seed, sgd, links, buffers);
                match submitter {
                    Ok(submitter) => {
                        let _ = started.send(Ok(()));
                        submitter.serve(inbox);
                    }
                    Err(e) => {
                        let _ = started.send(Err(e));
                    }
                }
            })
            .map_err(|e| KernelError::Device(format!("device {device}'s submitter: {e}")))?;
        std::thread::Builder::new()
            .name(format!("legion-gpu-send-{device}"))
            .spawn(move || send_staged(to_send, give_back, transport))
            .map_err(|e| KernelError::Device(format!("device {device}'s sender: {e}")))?;
        start_result
            .recv()
            .map_err(|_| KernelError::Device(format!("device {device}'s submitter died")))??;
        Ok(GpuDriver { commands })
    }

    fn submit(&self, command: Command) {
        if self.commands.send(command).is_err() {
            tracing::error!("a GPU device's submitter is gone");
        }
    }
}

impl Driver for GpuDriver {
    fn start_step(&mut self, start: &StepStart) {
        self.submit(Command::Start {
            step: start.step,
            input: Arc::clone(&start.input),
            epoch: start.epoch,
            trace: start.trace,
            actor: start.actor.clone(),
        });
    }

    /// Handed over in an order that respects every local dependence, and the stream runs them in
    /// that order: what depends on this op may be handed over now.
    fn run(&mut self, op: u32, slice: Option<SliceData>) -> Handed {
        self.submit(match slice {
            Some(data) => Command::Store { op, data },
            None => Command::Run(op),
        });
        Handed::Queued
    }

    /// Every op is enqueued, not necessarily run: the submitter says when
    /// ([`DriverEvent::StepDone`]).
    fn end_step(&mut self) -> Option<StepEnd> {
        self.submit(Command::Finish);
        None
    }

    fn load(
        &mut self,
        pieces: Vec<(u32, Rect, cpu::Buffer)>,
    ) -> oneshot::Receiver<Result<(), String>> {
        let (reply, loaded) = oneshot::channel();
        self.submit(Command::Load(pieces, reply));
        loaded
    }

    fn read(
        &mut self,
        instance: u32,
        rect: Rect,
    ) -> oneshot::Receiver<Result<cpu::Buffer, String>> {
        let (reply, read) = oneshot::channel();
        self.submit(Command::Read {
            instance,
            rect,
            reply,
        });
        read
    }
}

/// A slice on its way out: the staging buffer its copy was enqueued into.
struct Outgoing {
    op: u32,
    step: u64,
    copy: crate::analysis::OpId,
    to: DeviceId,
    staging: Staging,
}

/// The sender: waits for each outgoing copy, in the order enqueued, hands its data to the
/// transport and the staging buffer back to the submitter. Whatever goes wrong, the receiver gets
/// a slice of the right size (zeros, with the submitter's step failing), never nothing.
fn send_staged(
    to_send: Receiver<Outgoing>,
    give_back: Sender<(u32, Staging)>,
    transport: Arc<dyn Transport>,
) {
    while let Ok(out) = to_send.recv() {
        let (dtype, len) = (out.staging.dtype(), out.staging.len());
        let data = caught(|| out.staging.read().map_err(|e| e.to_string())).unwrap_or_else(|e| {
            tracing::error!(copy = out.copy, "staged slice unreadable: {e}");
            cpu::Buffer::zeros(dtype, len)
        });
        transport.send(SliceMessage {
            step: out.step,
            copy: out.copy,
            to: out.to,
            data: Arc::new(data),
        });
        if give_back.send((out.op, out.staging)).is_err() {
            return;
        }
    }
}

/// The step the submitter is enqueuing.
struct Step {
    step: u64,
    input: Arc<StepInput>,
    actor: ActorRef<DeviceActor>,
    losses: Vec<PendingLoss>,
    error: Option<String>,
    trace: Option<Trace>,
    /// Slices other devices on this GPU handed over, kept until the stream has run the step: a
    /// slice dropped earlier would make its sender's stream wait for this one (cudarc frees a
    /// buffer on its own stream once its last reader is done).
    received: Vec<Buffer>,
}

/// Timing events around each op of a traced step.
struct Trace {
    start: Marker,
    /// Seconds from the step's epoch to `start`, on the host clock.
    start_at: f64,
    ops: Vec<(u32, Marker, Marker)>,
}

/// How a submitter's slices leave it.
struct Links {
    /// The devices on this GPU: slices to them stay in its memory.
    neighbours: Arc<[DeviceId]>,
    /// The devices on GPUs that copy out of this one's memory directly (peer access).
    peers: Arc<[DeviceId]>,
    /// Hands those over, and the zeros a failed send leaves its receiver.
    transport: Arc<dyn Transport>,
    /// The rest go to the sender, staged.
    outgoing: Sender<Outgoing>,
    /// The sender returns their staging buffers here.
    returned: Receiver<(u32, Staging)>,
}

struct Submitter {
    cuda: Arc<Cuda>,
    stream: Stream,
    program: Arc<DeviceProgram>,
    graph: Arc<Graph>,
    seed: u64,
    sgd: Sgd,
    /// Lent to ops in place (never taken out), so that a failing op cannot lose one.
    instances: Vec<Buffer>,
    /// Per op: the device buffer it gathers into or stages through, kept across steps.
    scratch: Vec<Option<Buffer>>,
    /// Per `Recv` op: its inbound staging buffer.
    inbound: Vec<Option<Staging>>,
    /// Per `Send` op: its outbound staging buffer, while not lent to the sender.
    outbound: Vec<Option<Staging>>,
    /// Per `Send` op: whether the sender holds its staging buffer.
    lent: Vec<bool>,
    links: Links,
    /// The host buffers of received slices go back here once staged.
    buffers: Arc<BufferPool>,
    step: Option<Step>,
}

impl Submitter {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cuda: Arc<Cuda>,
        program: Arc<DeviceProgram>,
        graph: Arc<Graph>,
        seed: u64,
        sgd: Sgd,
        links: Links,
        buffers: Arc<BufferPool>,
    ) -> Result<Submitter, KernelError> {
        let mut stream = cuda.new_stream()?;
        let instances = program
            .instances
            .iter()
            .map(|i| cuda.alloc_zeros(&mut stream, i.dtype, i.rect.volume()))
            .collect::<Result<Vec<_>, _>>()?;
        cuda.synchronize(&mut stream)?;
        let ops = program.ops.len();
        Ok(Submitter {
            cuda,
            stream,
            program,
            graph,
            seed,
            sgd,
            instances,
            scratch: (0..ops).map(|_| None).collect(),
            inbound: (0..ops).map(|_| None).collect(),
            outbound: (0..ops).map(|_| None).collect(),
            lent: vec![false; ops],
            links,
            buffers,
            step: None,
        })
    }

    fn serve(mut self, inbox: Receiver<Command>) {
        while let Ok(command) = inbox.recv() {
            self.handle(command);
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Start {
                step,
                input,
                epoch,
                trace,
                actor,
            } => {
                // A failure fails its step; the next one starts afresh (an error that broke the
                // context comes back at once).
                self.stream.clear_failure();
                let trace = trace.then(|| {
                    let start_at = epoch.elapsed().as_secs_f64();
                    self.cuda.mark(&self.stream).map(|start| Trace {
                        start,
                        start_at,
                        ops: Vec::new(),
                    })
                });
                let (trace, error) = match trace.transpose() {
                    Ok(trace) => (trace, None),
                    Err(e) => (None, Some(e.to_string())),
                };
                self.step = Some(Step {
                    step,
                    input,
                    actor,
                    losses: Vec::new(),
                    error,
                    trace,
                    received: Vec::new(),
                });
            }
            Command::Run(op) => self.timed(op, |s| s.run(op)),
            Command::Store { op, data } => self.timed(op, |s| s.store(op, data)),
            Command::Finish => self.finish(),
            Command::Load(pieces, reply) => {
                let loaded = caught(|| self.load(pieces).map_err(|e| e.to_string()));
                let _ = reply.send(loaded);
            }
            Command::Read {
                instance,
                rect,
                reply,
            } => {
                let read = caught(|| self.read(instance, &rect).map_err(|e| e.to_string()));
                let _ = reply.send(read);
            }
        }
    }

    /// Enqueues op `op` with `enqueue`, between timing markers when the step is traced. A failure
    /// (an error or a panic) fails the step, and a send that failed still delivers zeros, so
    /// that its receiver ends the step too rather than wait for it.
    fn timed(&mut self, op: u32, enqueue: impl FnOnce(&mut Self) -> Result<(), String>) {
        let traced = self.step.as_ref().is_some_and(|s| s.trace.is_some());
        let before = traced.then(|| self.cuda.mark(&self.stream));
        if let Err(e) = caught(|| enqueue(self)) {
            let what = self.program.ops[op as usize].describe(op, &self.graph);
            self.fail(format!("{what}: {e}"));
            self.send_zeros(op);
        }
        if let Some(before) = before {
            match (before, self.cuda.mark(&self.stream)) {
                (Ok(before), Ok(after)) => {
                    let step = self.step.as_mut().expect("traced ops run inside a step");
                    step.trace.as_mut().unwrap().ops.push((op, before, after));
                }
                (Err(e), _) | (_, Err(e)) => self.fail(e.to_string()),
            }
        }
    }

    /// If op `op` is a send, hands its receiver zeros of the slice's size.
    fn send_zeros(&self, op: u32) {
        let LocalOpKind::Send {
            copy,
            src,
            rect,
            to,
            ..
        } = &self.program.ops[op as usize].kind
        else {
            return;
        };
        let Some(step) = &self.step else {
            return;
        };
        let dtype = self.program.instances[*src as usize].dtype;
        self.links.transport.send(SliceMessage {
            step: step.step,
            copy: *copy,
            to: *to,
            data: Arc::new(cpu::Buffer::zeros(dtype, rect.volume())),
        });
    }

    fn fail(&mut self, error: String) {
        match &mut self.step {
            Some(step) => {
                step.error.get_or_insert(error);
            }
            None => tracing::error!("GPU device outside a step: {error}"),
        }
    }

    fn rect(&self, instance: u32) -> Rect {
        self.program.instances[instance as usize].rect
    }

    /// Op `op`'s scratch buffer, `len` values of `dtype` (allocated on first use).
    fn scratch(
        &mut self,
        op: u32,
        dtype: legion_ops::backend::DType,
        len: usize,
    ) -> Result<Buffer, String> {
        match self.scratch[op as usize].take() {
            Some(b) => Ok(b),
            None => self
                .cuda
                .alloc_zeros(&mut self.stream, dtype, len)
                .map_err(|e| e.to_string()),
        }
    }

    fn run(&mut self, op: u32) -> Result<(), String> {
        let program = Arc::clone(&self.program);
        match &program.ops[op as usize].kind {
            LocalOpKind::Task { task, instances } => {
                let wanted: Vec<(u32, bool)> = task
                    .requirements
                    .iter()
                    .zip(instances)
                    .map(|(req, &i)| (i, req.privilege.writes()))
                    .collect();
                let mut lent = lend(&mut self.instances, &wanted);
                let access = wanted
                    .iter()
                    .map(|&(i, _)| lent.access(i))
                    .collect::<Vec<_>>();
                let step = self.step.as_mut().expect("ops run inside a step");
                let ctx = ExecContext {
                    graph: &self.graph,
                    precision: program.precision,
                    seed: self.seed,
                    sgd: self.sgd.at(step.input.lr),
                    input: &step.input,
                };
                // A task's scratch slot holds its weight's working copy (bf16), if it reads one.
                let working = &mut self.scratch[op as usize];
                let loss =
                    exec::enqueue(&*self.cuda, &mut self.stream, &ctx, task, access, working)
                        .map_err(|e| e.to_string())?;
                step.losses.extend(loss);
            }
            LocalOpKind::Copy { src, dst, rect } => {
                let (src_layout, dst_layout) = (self.rect(*src), self.rect(*dst));
                let mut lent = lend(&mut self.instances, &[(*src, false), (*dst, true)]);
                let from = In {
                    rect: src_layout,
                    mem: lent.read(*src),
                };
                let to = Out {
                    rect: dst_layout,
                    mem: lent.write(*dst),
                };
                Backend::copy_rect(&*self.cuda, &mut self.stream, from, to, rect);
            }
            LocalOpKind::Fold {
                srcs,
                dst,
                rect,
                accumulate,
            } => {
                let mut wanted: Vec<(u32, bool)> = srcs.iter().map(|&s| (s, false)).collect();
                wanted.push((*dst, true));
                let mut lent = lend(&mut self.instances, &wanted);
                let terms: Vec<In<Buffer>> = srcs
                    .iter()
                    .map(|&s| In {
                        rect: program.instances[s as usize].rect,
                        mem: lent.read(s),
                    })
                    .collect();
                let to = Out {
                    rect: program.instances[*dst as usize].rect,
                    mem: lent.write(*dst),
                };
                moves::fold(&*self.cuda, &mut self.stream, to, &terms, rect, *accumulate);
            }
            LocalOpKind::Send {
                copy,
                src,
                rect,
                to,
            } => {
                let dtype = self.program.instances[*src as usize].dtype;
                let layout = self.rect(*src);
                let step = self.step.as_ref().expect("ops run inside a step").step;
                if self.links.neighbours.contains(to) || self.links.peers.contains(to) {
                    // A buffer of its own each step: the receiver holds it until its stream has
                    // run the copy out of it (cudarc frees it only then).
                    let mut slice = self
                        .cuda
                        .alloc_zeros(&mut self.stream, dtype, rect.volume())
                        .map_err(|e| e.to_string())?;
                    let from = &self.instances[*src as usize];
                    self.cuda
                        .copy_rect(&mut self.stream, from, &layout, &mut slice, rect, rect);
                    let msg = DeviceSliceMessage {
                        step,
                        copy: *copy,
                        to: *to,
                        data: DeviceSlice(slice),
                    };
                    if self.links.transport.send_in_device_memory(msg).is_err() {
                        return Err(format!(
                            "device {to} is on this process's GPUs but not in this process"
                        ));
                    }
                    return Ok(());
                }
                let mut staging = self.outbound(op, dtype, rect.volume())?;
                let gathered = match *rect == layout {
                    true => None,
                    false => Some(self.scratch(op, dtype, rect.volume())?),
                };
                let from = &self.instances[*src as usize];
                match gathered {
                    None => self.cuda.stage_out(&mut self.stream, from, &mut staging),
                    Some(mut gathered) => {
                        self.cuda.copy_rect(
                            &mut self.stream,
                            from,
                            &layout,
                            &mut gathered,
                            rect,
                            rect,
                        );
                        self.cuda
                            .stage_out(&mut self.stream, &gathered, &mut staging);
                        self.scratch[op as usize] = Some(gathered);
                    }
                }
                // A copy the failed stream skipped would ship the buffer's old contents.
                if let Some(failure) = self.stream.failure() {
                    self.outbound[op as usize] = Some(staging);
                    return Err(format!("the stream failed before it: {failure}"));
                }
                self.lent[op as usize] = true;
                let out = Outgoing {
                    op,
                    step,
                    copy: *copy,
                    to: *to,
                    staging,
                };
                if self.links.outgoing.send(out).is_err() {
                    self.lent[op as usize] = false;
                    return Err("the device's sender is gone".into());
                }
            }
            LocalOpKind::Recv { .. } => unreachable!("a receive comes with its data (Store)"),
        }
        Ok(())
    }

    /// Op `op`'s outbound staging buffer: waits for the sender to return it if it still holds it
    /// (from the step before, which the sender may not have finished handing on).
    fn outbound(
        &mut self,
        op: u32,
        dtype: legion_ops::backend::DType,
        len: usize,
    ) -> Result<Staging, String> {
        while let Ok((o, staging)) = self.links.returned.try_recv() {
            self.put_back(o, staging);
        }
        while self.lent[op as usize] {
            let (o, staging) = self
                .links
                .returned
                .recv()
                .map_err(|_| "the device's sender is gone".to_string())?;
            self.put_back(o, staging);
        }
        match self.outbound[op as usize].take() {
            Some(staging) => Ok(staging),
            None => self
                .cuda
                .staging(dtype, len, Direction::ToHost)
                .map_err(|e| e.to_string()),
        }
    }

    fn put_back(&mut self, op: u32, staging: Staging) {
        self.lent[op as usize] = false;
        self.outbound[op as usize] = Some(staging);
    }

    fn store(&mut self, op: u32, data: SliceData) -> Result<(), String> {
        let program = Arc::clone(&self.program);
        let LocalOpKind::Recv { dst, rect, .. } = &program.ops[op as usize].kind else {
            unreachable!("stores serve receives")
        };
        let layout = self.rect(*dst);
        let data = match data {
            SliceData::Device(DeviceSlice(slice)) => {
                if self.cuda.holds(&slice) {
                    let to = &mut self.instances[*dst as usize];
                    self.cuda
                        .copy_rect(&mut self.stream, &slice, rect, to, &layout, rect);
                } else {
                    // From a peer GPU: copied into this one's memory first (a kernel of this
                    // context cannot take the other context's buffer), then into the instance.
                    let dtype = self.program.instances[*dst as usize].dtype;
                    let mut local = self.scratch(op, dtype, rect.volume())?;
                    self.cuda
                        .copy_from_peer(&mut self.stream, &slice, &mut local);
                    let to = &mut self.instances[*dst as usize];
                    self.cuda
                        .copy_rect(&mut self.stream, &local, rect, to, &layout, rect);
                    self.scratch[op as usize] = Some(local);
                }
                let step = self.step.as_mut().expect("ops run inside a step");
                step.received.push(slice);
                return Ok(());
            }
            SliceData::Host(data) => data,
        };
        let dtype = self.program.instances[*dst as usize].dtype;
        let mut staging = match self.inbound[op as usize].take() {
            Some(s) => s,
            None => self
                .cuda
                .staging(dtype, rect.volume(), Direction::ToDevice)
                .map_err(|e| e.to_string())?,
        };
        let landed = match *rect == layout {
            true => None,
            false => Some(self.scratch(op, dtype, rect.volume())),
        };
        let written = staging.write(&data).map_err(|e| e.to_string());
        self.buffers.give(data);
        let stored = written.and_then(|()| {
            let to = &mut self.instances[*dst as usize];
            match landed.transpose()? {
                None => self.cuda.stage_in(&mut self.stream, &staging, to),
                Some(mut landed) => {
                    self.cuda.stage_in(&mut self.stream, &staging, &mut landed);
                    self.cuda
                        .copy_rect(&mut self.stream, &landed, rect, to, &layout, rect);
                    self.scratch[op as usize] = Some(landed);
                }
            }
            Ok(())
        });
        self.inbound[op as usize] = Some(staging);
        stored
    }

    fn finish(&mut self) {
        let Some(mut step) = self.step.take() else {
            tracing::error!("a GPU device was told to finish outside a step");
            return;
        };
        // Whatever happens here, the actor hears of the step's end.
        let read = caught(|| {
            self.cuda
                .synchronize(&mut self.stream)
                .map_err(|e| e.to_string())?;
            let mut outcome = TaskOutcome::default();
            for loss in step.losses.drain(..) {
                let sums = self.cuda.read_loss(loss);
                outcome.loss_sum += sums.loss_sum;
                outcome.correct += sums.correct;
            }
            let mut events = Vec::new();
            if let Some(trace) = &step.trace {
                for (op, before, after) in &trace.ops {
                    let at = |m: &Marker| m.seconds_since(&trace.start).map_err(|e| e.to_string());
                    events.push(OpEvent {
                        op: *op,
                        start: trace.start_at + at(before)?,
                        end: trace.start_at + at(after)?,
                    });
                }
            }
            Ok((outcome, events))
        });
        step.received.clear();
        let (outcome, events) = match read {
            Ok(read) => read,
            Err(e) => {
                step.error.get_or_insert(e);
                Default::default()
            }
        };
        let done = DriverEvent::StepDone {
            step: step.step,
            end: StepEnd {
                outcome,
                error: step.error,
                events,
            },
        };
        if let Err(e) = step.actor.tell(done).try_send() {
            tracing::error!("device actor gone: {e}");
        }
    }

    fn load(&mut self, pieces: Vec<(u32, Rect, cpu::Buffer)>) -> Result<(), KernelError> {
        self.stream.clear_failure();
        // Every piece's upload stays alive until the one wait at the end: its copy must have run.
        let mut uploaded = Vec::with_capacity(pieces.len());
        for (instance, rect, data) in pieces {
            let layout = self.rect(instance);
            let piece = self.cuda.upload(&mut self.stream, &data)?;
            let to = &mut self.instances[instance as usize];
            self.cuda
                .copy_rect(&mut self.stream, &piece, &rect, to, &layout, &rect);
            uploaded.push(piece);
        }
        self.cuda.synchronize(&mut self.stream)
    }

    fn read(&mut self, instance: u32, rect: &Rect) -> Result<cpu::Buffer, KernelError> {
        self.stream.clear_failure();
        let layout = self.rect(instance);
        let dtype = self.program.instances[instance as usize].dtype;
        let mut piece = self
            .cuda
            .alloc_zeros(&mut self.stream, dtype, rect.volume())?;
        let from = &self.instances[instance as usize];
        self.cuda
            .copy_rect(&mut self.stream, from, &layout, &mut piece, rect, rect);
        self.cuda.synchronize(&mut self.stream)?;
        self.cuda.download(&mut self.stream, &piece)
    }
}

/// Instances lent to one op, in place.
struct Lent<'a, T> {
    shared: Vec<(u32, &'a T)>,
    exclusive: Vec<(u32, Option<&'a mut T>)>,
}

impl<'a, T> Lent<'a, T> {
    fn read(&self, i: u32) -> &'a T {
        let found = self.shared.iter().find(|(j, _)| *j == i);
        found
            .unwrap_or_else(|| panic!("instance {i} was not lent to read"))
            .1
    }

    fn write(&mut self, i: u32) -> &'a mut T {
        let found = self.exclusive.iter_mut().find(|(j, _)| *j == i);
        let slot = found.unwrap_or_else(|| panic!("instance {i} was not lent to write"));
        slot.1
            .take()
            .unwrap_or_else(|| panic!("instance {i} written twice"))
    }

    fn access(&mut self, i: u32) -> Access<'a, T> {
        match self.shared.iter().any(|(j, _)| *j == i) {
            true => Access::Read(self.read(i)),
            false => Access::Write(self.write(i)),
        }
    }
}

/// Lends the instances `wanted` names, `(index, writes)`, all at once and in place: a panic in the
/// op that uses them leaves every instance in the table. An op never reads and writes one
/// instance (the analysis orders every access; checked here).
fn lend<'a, T>(instances: &'a mut [T], wanted: &[(u32, bool)]) -> Lent<'a, T> {
    let mut order: Vec<(u32, bool)> = wanted.to_vec();
    order.sort_unstable();
    order.dedup();
    let mut lent = Lent {
        shared: Vec::with_capacity(order.len()),
        exclusive: Vec::with_capacity(order.len()),
    };
    let mut rest: &'a mut [T] = instances;
    let mut next = 0u32;
    for (k, &(i, writes)) in order.iter().enumerate() {
        assert!(
            order.get(k + 1).is_none_or(|&(j, _)| j != i),
            "instance {i} both read and written by one op"
        );
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((i - next) as usize);
        let (one, tail) = tail
            .split_first_mut()
            .unwrap_or_else(|| panic!("no instance {i}"));
        rest = tail;
        next = i + 1;
        match writes {
            true => lent.exclusive.push((i, Some(one))),
            false => lent.shared.push((i, &*one)),
        }
    }
    lent
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_reads_and_writes_several_instances_at_once_in_place() {
        let mut table: Vec<String> = (0..6).map(|i| format!("i{i}")).collect();
        {
            let mut lent = lend(&mut table, &[(4, true), (1, false), (1, false), (3, true)]);
            // A read lent twice is one shared borrow; writes are exclusive, once each.
            assert_eq!(lent.read(1), "i1");
            lent.write(4).push_str(" written");
            lent.write(3).push_str(" too");
            assert!(matches!(lent.access(1), Access::Read(s) if s == "i1"));
        }
        assert_eq!(table, ["i0", "i1", "i2", "i3 too", "i4 written", "i5"]);
    }

    #[test]
    #[should_panic(expected = "instance 2 both read and written by one op")]
    fn an_instance_read_and_written_by_one_op_is_refused() {
        let mut table = vec![0u8; 4];
        lend(&mut table, &[(2, false), (2, true)]);
    }

    #[test]
    #[should_panic(expected = "instance 3 written twice")]
    fn an_instance_is_written_once_per_op() {
        let mut table = vec![0u8; 4];
        let mut lent = lend(&mut table, &[(3, true)]);
        lent.write(3);
        lent.write(3);
    }
}
