//! The device actor: owns one device's step and runs its program each step.
//!
//! An op runs once its local dependences are done (a `Recv` also waits for its data): the actor's
//! [`Schedule`](schedule::Schedule) decides what is ready, pure logic without threads or I/O. How
//! an op runs is the device's [`Driver`](driver::Driver): on host cores (`host`) compute ops run
//! one at a time on the device's compute pool, like a GPU stream, and data movement runs on the
//! actor as soon as it is ready, so transfers overlap compute; on a GPU (`cuda`) every op is
//! enqueued on the device's stream by a thread of its own, so the actor never waits for the GPU.
//! A task that touches no data (the overhead probe's empty tasks) runs on the actor whatever the
//! device: the round trip to a pool or a stream would cost more than it.

mod cuda;
mod driver;
mod host;
mod schedule;

pub use driver::{Compute, Placement};

use crate::buffer::Buffer;
use crate::exec::{self, ExecContext, StepInput, TaskOutcome};
use crate::program::{DeviceProgram, LocalOpKind, Part};
use crate::recycle::BufferPool;
use crate::transport::{SliceData, Transport};
use driver::{Driver, DriverEvent, Handed, StepEnd, StepStart};
use kameo::Actor;
use kameo::message::{Context, Message};
use legion_ops::Graph;
use legion_ops::Rect;
use legion_ops::backend::KernelError;
use legion_ops::partition::DeviceId;
use legion_ops::train::Sgd;
use schedule::{Arrival, Schedule, Slice};
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

#[derive(Actor)]
pub struct DeviceActor {
    program: Arc<DeviceProgram>,
    graph: Arc<Graph>,
    seed: u64,
    sgd: Sgd,
    schedule: Schedule,
    driver: Box<dyn Driver>,
    step: Option<StepState>,
}

/// The report of the running step, as it fills.
struct StepState {
    input: Arc<StepInput>,
    epoch: Instant,
    outcome: TaskOutcome,
    error: Option<String>,
    events: Option<Vec<OpEvent>>,
    reply: Option<oneshot::Sender<StepReport>>,
    /// Whether the driver has been told that every op is done or queued.
    ending: bool,
}

impl DeviceActor {
    /// The device of `setup.program`, its instances zeroed. Fails where a GPU cannot hold them or
    /// give the device a stream.
    pub fn new(setup: DeviceSetup) -> Result<DeviceActor, KernelError> {
        let driver = driver::start(&setup)?;
        Ok(DeviceActor {
            schedule: Schedule::new(Arc::clone(&setup.program)),
            program: setup.program,
            graph: setup.graph,
            seed: setup.seed,
            sgd: setup.sgd,
            driver,
            step: None,
        })
    }

    fn start_step(&mut self, msg: RunStep, actor: &kameo::actor::ActorRef<DeviceActor>) {
        self.step = Some(StepState {
            input: Arc::clone(&msg.input),
            epoch: msg.epoch,
            outcome: TaskOutcome::default(),
            error: None,
            events: msg.trace.then(Vec::new),
            reply: Some(msg.reply),
            ending: false,
        });
        self.driver.start_step(&StepStart {
            step: msg.step,
            input: msg.input,
            epoch: msg.epoch,
            trace: msg.trace,
            actor: actor.clone(),
        });
        for arrival in self.schedule.start(msg.step, msg.part) {
            self.note(arrival, msg.step);
        }
        self.run_ready();
    }

    fn deliver(&mut self, slice: Slice) {
        let step = slice.step;
        let arrival = self.schedule.arrive(slice);
        self.note(arrival, step);
        if self.schedule.step() == Some(step) {
            self.run_ready();
        }
    }

    /// Logs what was refused of an arriving slice; a misshapen one fails its step.
    fn note(&mut self, arrival: Arrival, step: u64) {
        let device = self.program.device;
        match arrival {
            Arrival::Accepted | Arrival::Early => {}
            Arrival::Stale => tracing::error!(device, step, "slice for a finished step dropped"),
            Arrival::Duplicate => tracing::error!(device, step, "duplicate slice ignored"),
            Arrival::Unexpected => tracing::error!(device, step, "slice for no receive dropped"),
            Arrival::Misshapen { error } => {
                if let Some(state) = self.step.as_mut()
                    && self.schedule.step() == Some(step)
                {
                    state.error.get_or_insert(error);
                }
            }
        }
    }

    /// Hands every ready op to the driver (and what their completion makes ready), then lets it
    /// start what it queued; ends the step once every op is done or queued.
    fn run_ready(&mut self) {
        while let Some(op) = self.schedule.pop_ready() {
            if self.program.ops[op as usize].touches_no_data() {
                self.run_inline(op);
                continue;
            }
            let slice = self.schedule.take_slice(op);
            match self.driver.run(op, slice) {
                Handed::Ran { result, start, end } => self.finished(op, result, start, end),
                Handed::Queued => self.schedule.complete(op),
                Handed::Pending => {}
            }
        }
        self.driver.pump();
        let Some(state) = self.step.as_mut() else {
            return;
        };
        if self.schedule.all_done() && !state.ending {
            state.ending = true;
            if let Some(end) = self.driver.end_step() {
                self.end_step(end);
            }
        }
    }

    /// Runs a task that touches no data on the actor (see [`LocalOp::touches_no_data`]).
    ///
    /// [`LocalOp::touches_no_data`]: crate::program::LocalOp::touches_no_data
    fn run_inline(&mut self, op: u32) {
        let LocalOpKind::Task { task, .. } = &self.program.ops[op as usize].kind else {
            unreachable!("only tasks touch no data")
        };
        let state = self.step.as_ref().expect("ops run inside a step");
        let ctx = ExecContext {
            graph: &self.graph,
            precision: self.program.precision,
            seed: self.seed,
            sgd: self.sgd.at(state.input.lr),
            input: &state.input,
        };
        let start = Instant::now();
        // No data, so no weight to read through a working copy.
        let result =
            caught(|| exec::execute(&ctx, task, Vec::new(), &mut None).map_err(|e| e.to_string()));
        self.finished(op, result, start, Instant::now());
    }

    /// Accounts for a finished op: its outcome or error, its trace event, its dependents.
    fn finished(
        &mut self,
        op: u32,
        result: Result<TaskOutcome, String>,
        start: Instant,
        end: Instant,
    ) {
        let state = self.step.as_mut().expect("an op finished outside a step");
        match result {
            Ok(o) => {
                state.outcome.loss_sum += o.loss_sum;
                state.outcome.correct += o.correct;
            }
            Err(e) => {
                if state.error.is_none() {
                    let what = self.program.ops[op as usize].describe(op, &self.graph);
                    state.error = Some(format!("{what}: {e}"));
                }
            }
        }
        if let Some(events) = &mut state.events {
            events.push(OpEvent {
                op,
                start: start.duration_since(state.epoch).as_secs_f64(),
                end: end.duration_since(state.epoch).as_secs_f64(),
            });
        }
        self.schedule.complete(op);
    }

    /// Replies with the step's report, the driver's share added.
    fn end_step(&mut self, end: StepEnd) {
        let Some(mut state) = self.step.take() else {
            return;
        };
        self.schedule.end();
        state.outcome.loss_sum += end.outcome.loss_sum;
        state.outcome.correct += end.outcome.correct;
        let error = state.error.take().or(end.error);
        let mut events = state.events.take().unwrap_or_default();
        if !end.events.is_empty() {
            events.extend(end.events);
            events.sort_by(|a, b| a.start.total_cmp(&b.start));
        }
        let report = StepReport {
            device: self.program.device,
            outcome: state.outcome,
            error,
            events,
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

/// Starts a run: every op of the program's `part` once (a training step, or inference on a
/// batch), then reply. Each part numbers its runs on its own.
pub struct RunStep {
    pub part: Part,
    pub step: u64,
    pub input: Arc<StepInput>,
    /// Where step time starts, shared by all devices (for traces).
    pub epoch: Instant,
    pub trace: bool,
    pub reply: oneshot::Sender<StepReport>,
}

/// A slice from another device.
pub(crate) struct Deliver {
    pub step: u64,
    pub copy: crate::analysis::OpId,
    pub data: SliceData,
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

    async fn handle(&mut self, msg: Deliver, _ctx: &mut Context<Self, Self::Reply>) {
        let Deliver { step, copy, data } = msg;
        self.deliver(Slice { step, copy, data });
    }
}

impl Message<DriverEvent> for DeviceActor {
    type Reply = ();

    async fn handle(&mut self, msg: DriverEvent, _ctx: &mut Context<Self, Self::Reply>) {
        match msg {
            DriverEvent::OpDone {
                op,
                result,
                start,
                end,
                lent,
            } => {
                self.driver.reclaim(op, lent);
                self.finished(op, result, start, end);
                self.run_ready();
            }
            DriverEvent::StepDone { step, end } => {
                if self.step.is_none() || self.schedule.step() != Some(step) {
                    tracing::error!(step, "a step ended that is not running");
                    return;
                }
                self.end_step(end);
            }
        }
    }
}

impl Message<Load> for DeviceActor {
    type Reply = Result<(), String>;

    async fn handle(&mut self, msg: Load, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let loaded = self.driver.load(msg.0);
        loaded
            .await
            .unwrap_or_else(|_| Err("the device's driver is gone".into()))
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
        let read = self.driver.read(msg.instance, msg.rect);
        read.await
            .unwrap_or_else(|_| Err("the device's driver is gone".into()))
            .map(Piece)
    }
}
