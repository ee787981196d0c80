//! Runs one task's kernel on its instances: the task's requirements become the operands of a
//! `legion_ops::backend::KernelCall`, and the op's own kernels do the rest. No per-op code here.

use crate::buffer::Buffer;
use crate::task::{TaskKind, TaskSpec};
use legion_ops::Graph;
use legion_ops::Precision;
pub use legion_ops::backend::BatchView;
use legion_ops::backend::cpu::{Cpu, CpuStream};
use legion_ops::backend::{
    Access, Backend, DType, In, KernelCall, KernelError, LossSums, Operand, Out, Phase, Role,
    StepContext,
};
use legion_ops::train::Sgd;
use std::ops::Range;

/// The data of one step, shared by a process's devices: the whole batch on the embedded cluster,
/// on a cluster worker only the samples its devices read (see `StepPlan::samples_read`).
#[derive(Debug)]
pub struct StepInput {
    pub step: u64,
    /// The images of samples `image_samples` of the batch, laid out like the input layer's output.
    pub images: Vec<f32>,
    pub image_samples: Range<usize>,
    /// The labels of samples `label_samples`.
    pub labels: Vec<u32>,
    pub label_samples: Range<usize>,
    /// The learning rate of this step where a schedule sets one; else the devices' own.
    pub lr: Option<f32>,
}

impl StepInput {
    /// The whole batch of `batch` samples.
    pub fn whole(step: u64, images: Vec<f32>, labels: Vec<u32>, batch: usize) -> StepInput {
        StepInput {
            step,
            images,
            image_samples: 0..batch,
            labels,
            label_samples: 0..batch,
            lr: None,
        }
    }

    pub fn view(&self) -> BatchView<'_> {
        BatchView {
            images: &self.images,
            image_samples: self.image_samples.clone(),
            labels: &self.labels,
            label_samples: self.label_samples.clone(),
        }
    }
}

/// What the tasks of a run share.
pub struct ExecContext<'a> {
    pub graph: &'a Graph,
    /// What the step computes in: in bf16, conv2d and dense read a bf16 working copy of their
    /// weight (see [`enqueue`]).
    pub precision: Precision,
    pub seed: u64,
    pub sgd: Sgd,
    pub input: &'a StepInput,
}

/// What a task reports besides its writes: the loss layer's share of the loss.
pub type TaskOutcome = LossSums;

/// A task's access to the buffer of one requirement.
pub type HostAccess<'a> = Access<'a, Buffer>;

/// The kernel phase a task runs; `None` for the overhead probe, which computes nothing.
fn phase(kind: TaskKind) -> Option<Phase> {
    Some(match kind {
        TaskKind::Empty => return None,
        TaskKind::LoadInput | TaskKind::Forward => Phase::Forward,
        TaskKind::Backward => Phase::Backward,
        TaskKind::Infer => Phase::Infer,
        TaskKind::BnMoments => Phase::BnMoments,
        TaskKind::BnNormalize => Phase::BnNormalize,
        TaskKind::BnRunning => Phase::BnRunning,
        TaskKind::BnGradSums => Phase::BnGradSums,
        TaskKind::BnInputGrad => Phase::BnInputGrad,
        TaskKind::PartialForward => Phase::PartialForward,
        TaskKind::Finish => Phase::Finish,
        TaskKind::FinishBackward => Phase::FinishBackward,
        TaskKind::PartialBackward => Phase::PartialBackward,
        TaskKind::Update { param } => Phase::Update { param },
    })
}

/// Runs `task` with `access[i]` for requirement `i`, through the CPU backend: the op's own
/// `OpKernels` pick the operands by role (see `legion_ops::backend`). `working` is the task's
/// working copy of its weight, as [`enqueue`] keeps it.
pub fn execute<'a>(
    ctx: &ExecContext,
    task: &TaskSpec,
    access: Vec<HostAccess<'a>>,
    working: &'a mut Option<Buffer>,
) -> Result<TaskOutcome, KernelError> {
    let (cpu, mut stream) = (Cpu::new(ctx.precision), CpuStream);
    let loss = enqueue(&cpu, &mut stream, ctx, task, access, working)?;
    cpu.synchronize(&mut stream)?;
    Ok(loss.map(|l| cpu.read_loss(l)).unwrap_or_default())
}

/// Enqueues `task`'s kernel on `stream` with `access[i]` for requirement `i`, on any backend.
/// Returns the loss layer's report, to read once the stream has synchronized.
///
/// Where the step's precision reads a parameter through a working copy (conv2d's and dense's
/// weight in bf16, `Precision::working_copy`), the kernel reads `working` instead, cast from the
/// fp32 master just before it. `working` is the task's own: allocated here on first use, and
/// kept by the caller across steps (the task's weight slice never changes size), so a device's
/// steady state allocates nothing. The update still writes the master.
pub fn enqueue<'a, B: Backend>(
    backend: &B,
    stream: &mut B::Stream,
    ctx: &ExecContext,
    task: &TaskSpec,
    mut access: Vec<Access<'a, B::Buffer>>,
    working: &'a mut Option<B::Buffer>,
) -> Result<Option<B::Loss>, KernelError> {
    let Some(phase) = phase(task.kind) else {
        return Ok(None);
    };
    let op = &ctx.graph.layer(task.layer).op;
    let through_copy = |role: Role| {
        !matches!(phase, Phase::Update { .. })
            && role == Role::Param(0)
            && ctx.precision.working_copy(op, 0)
    };
    if let Some(k) = task.requirements.iter().position(|r| through_copy(r.role)) {
        let rect = task.requirements[k].rect;
        let Access::Read(master) = access[k] else {
            return Err(KernelError::Device(format!(
                "{}: its weight is lent for writing where a working copy is read",
                task.label(ctx.graph)
            )));
        };
        if working.is_none() {
            *working = Some(backend.alloc(stream, DType::Bf16, rect.volume())?);
        }
        let copy = Option::as_mut(working).expect("allocated above");
        let to = Out {
            rect,
            mem: &mut *copy,
        };
        backend.cast(stream, In { rect, mem: master }, to);
        access[k] = Access::Read(copy);
    }
    let operands = task
        .requirements
        .iter()
        .zip(access)
        .map(|(req, access)| Operand {
            role: req.role,
            rect: req.rect,
            access,
        });
    let step = StepContext {
        seed: ctx.seed,
        step: ctx.input.step,
        sgd: ctx.sgd,
        batch: ctx.input.view(),
    };
    let mut call = KernelCall::new(
        backend, stream, ctx.graph, task.layer, task.tile, &step, operands,
    );
    call.run(phase)?;
    Ok(call.loss.take())
}
