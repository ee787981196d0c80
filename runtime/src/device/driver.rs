//! The device driver: what differs between a device on host cores and one on a GPU. The actor
//! (`super`) decides *when* an op may run (with its [`Schedule`](super::schedule::Schedule)); a
//! driver owns the instances and decides *how* an op runs on them. The actor never learns which
//! kind it drives.
//!
//! Two implementations: [`host`](super::host) (instances in host memory, kernels on this process's
//! cores) and [`cuda`](super::cuda) (instances in GPU memory, every op enqueued on a stream by a
//! submitter thread). [`start`] is the one place that picks between them.

use super::{DeviceActor, DeviceSetup, OpEvent};
use crate::buffer::Buffer;
use crate::exec::{StepInput, TaskOutcome};
use crate::transport::SliceData;
use kameo::actor::ActorRef;
use legion_ops::Rect;
use legion_ops::backend::KernelError;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Where a process's devices run.
#[derive(Clone, Default)]
pub enum Placement {
    /// On this process's cores, in host memory.
    #[default]
    Cpu,
    /// On these GPUs: device `d` of `n` on GPU `d·g/n` of the `g` given (consecutive devices
    /// share a GPU), each device with a stream of its own.
    Gpus(Vec<Arc<legion_cuda::Cuda>>),
}

impl Placement {
    /// The GPU (index into `Gpus`) of local device `d` of `n`, if on GPUs.
    pub fn gpu_of(&self, d: usize, n: usize) -> Option<usize> {
        match self {
            Placement::Cpu => None,
            Placement::Gpus(gpus) => Some(legion_ops::partition::gpu_of(d, n, gpus.len())),
        }
    }

    /// Where each of `programs` (this process's devices, in order) runs.
    pub(crate) fn computes(&self, programs: &[Arc<crate::program::DeviceProgram>]) -> Vec<Compute> {
        let n = programs.len();
        match self {
            Placement::Cpu => {
                crate::compute::ComputePool::for_devices(n, rayon::current_num_threads())
                    .into_iter()
                    .map(Compute::Cores)
                    .collect()
            }
            Placement::Gpus(gpus) => {
                let gpu_of = |d: usize| self.gpu_of(d, n).expect("placed on GPUs");
                // reaches[r][s]: GPU r copies out of GPU s's memory directly (peer access,
                // enabled here; never between logical GPUs of one device).
                let reaches: Vec<Vec<bool>> = gpus
                    .iter()
                    .map(|r| gpus.iter().map(|s| r.peer_with(s)).collect())
                    .collect();
                (0..n)
                    .map(|d| {
                        let neighbours: Arc<[usize]> = (0..n)
                            .filter(|&e| gpu_of(e) == gpu_of(d))
                            .map(|e| programs[e].device)
                            .collect();
                        let peers: Arc<[usize]> = (0..n)
                            .filter(|&e| reaches[gpu_of(e)][gpu_of(d)])
                            .map(|e| programs[e].device)
                            .collect();
                        Compute::Gpu {
                            cuda: Arc::clone(&gpus[gpu_of(d)]),
                            neighbours,
                            peers,
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Where a device's instances live and its kernels run.
#[derive(Clone)]
pub enum Compute {
    /// Host memory, kernels on this process's cores (see `compute`).
    Cores(crate::compute::ComputePool),
    /// Device memory of this GPU, kernels on a stream of the device's own. `neighbours`: the
    /// devices of this process on the same GPU (this one included), whose slices stay in its memory;
    /// `peers`: those on other GPUs that can copy out of this one's memory (CUDA peer access), to
    /// which slices go as device buffers too, copied GPU to GPU by the receiver.
    Gpu {
        cuda: Arc<legion_cuda::Cuda>,
        neighbours: Arc<[legion_ops::partition::DeviceId]>,
        peers: Arc<[legion_ops::partition::DeviceId]>,
    },
}

/// The driver of `setup`'s device, its instances allocated and zeroed. Fails where a GPU cannot
/// hold them or give the device a stream.
pub(crate) fn start(setup: &DeviceSetup) -> Result<Box<dyn Driver>, KernelError> {
    Ok(match &setup.compute {
        Compute::Cores(pool) => Box::new(super::host::HostDriver::new(setup, pool.clone())),
        Compute::Gpu {
            cuda,
            neighbours,
            peers,
        } => Box::new(super::cuda::GpuDriver::start(
            setup,
            Arc::clone(cuda),
            Arc::clone(neighbours),
            Arc::clone(peers),
        )?),
    })
}

/// A step as it starts on a device.
pub(crate) struct StepStart {
    pub step: u64,
    pub input: Arc<StepInput>,
    /// Where the step's clock starts (for traces).
    pub epoch: Instant,
    pub trace: bool,
    /// Where the work that ends later is reported.
    pub actor: ActorRef<DeviceActor>,
}

/// What became of an op handed to a driver.
pub(crate) enum Handed {
    /// It ran at once, on the actor's thread, between `start` and `end`.
    Ran {
        result: Result<TaskOutcome, String>,
        start: Instant,
        end: Instant,
    },
    /// It is queued on the device's in-order stream behind everything it depends on: it counts
    /// as done now, so that its dependents can be queued behind it; it is timed with the step's
    /// end ([`StepEnd`]).
    Queued,
    /// It runs later; [`DriverEvent::OpDone`] says when.
    Pending,
}

/// What a driver adds to a step's report at its end.
#[derive(Default)]
pub(crate) struct StepEnd {
    pub outcome: TaskOutcome,
    pub error: Option<String>,
    /// The queued ops' times, on the step's clock.
    pub events: Vec<OpEvent>,
}

/// What an op held while it ran elsewhere, handed back with its end. Only a driver that lends
/// its instances out (the host driver, to its compute pool) fills it.
#[derive(Default)]
pub(crate) struct Lent {
    /// `(instance, buffer, whether the op overwrote all of it)`.
    pub instances: Vec<(u32, Arc<Buffer>, bool)>,
    /// The op's working copy of its weight (bf16), kept for its next run.
    pub working: Option<Buffer>,
}

/// What a driver's threads tell the actor.
pub(crate) enum DriverEvent {
    /// Op `op`, handed over as [`Handed::Pending`], has run; `lent` goes back to the driver.
    OpDone {
        op: u32,
        result: Result<TaskOutcome, String>,
        start: Instant,
        end: Instant,
        lent: Lent,
    },
    /// Every op of step `step` has run (after [`Driver::end_step`] said it would end later).
    StepDone { step: u64, end: StepEnd },
}

/// A device kind, as the actor drives it. No method blocks: work that takes time is handed to
/// the driver's own threads, which report back with a [`DriverEvent`].
pub(crate) trait Driver: Send + 'static {
    /// A step begins.
    fn start_step(&mut self, start: &StepStart);

    /// Hands over a ready op (`slice`: a receive's data); tasks that touch no data never come
    /// here (the actor runs them itself).
    fn run(&mut self, op: u32, slice: Option<SliceData>) -> Handed;

    /// Every ready op has been handed over: start what is queued.
    fn pump(&mut self) {}

    /// Pending op `op` has run (its [`DriverEvent::OpDone`] reached the actor): take back what
    /// it held. The message carries it, so that the pool's thread and the actor share nothing
    /// but the actor's mailbox.
    fn reclaim(&mut self, _op: u32, _lent: Lent) {}

    /// Every op of the step is done or queued: its end now, or `None` when it comes later as
    /// [`DriverEvent::StepDone`].
    fn end_step(&mut self) -> Option<StepEnd>;

    /// Writes `(instance, rect, data laid out over rect)` into instances (initial values).
    fn load(&mut self, pieces: Vec<(u32, Rect, Buffer)>) -> oneshot::Receiver<Result<(), String>>;

    /// Reads `rect` of an instance back to host memory.
    fn read(&mut self, instance: u32, rect: Rect) -> oneshot::Receiver<Result<Buffer, String>>;
}

/// A reply that is ready now.
pub(crate) fn answered<T>(value: T) -> oneshot::Receiver<T> {
    let (reply, answer) = oneshot::channel();
    let _ = reply.send(value);
    answer
}
