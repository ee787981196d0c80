//! Whole-step capture on a GPU: a training step recorded as a CUDA graph, then replayed with one
//! launch (`legion_ops::capture` decides which steps).
//!
//! A replay runs the recorded kernels on the addresses the recording saw, so what changes from
//! step to step is put at addresses that stay, before the step is recorded or replayed
//! (`Pipeline::fix_step`):
//! - the batch: its images are copied into the caller's fixed buffer, its labels into the
//!   stream's ([`Fixed`]);
//! - the step number dropout draws its mask from: the stream's step word, written by a
//!   one-thread kernel before the recording or replay, never inside it (a write inside would
//!   replay the recorded step's number forever, so a dropout that finds another number there
//!   while recording fails the recording);
//! - the loss totals: each loss kernel's are copied, inside the recording, into a slot of the
//!   stream's totals, which a replay copies out for `read_loss`.
//!
//! Everything else the step allocates (activations, gradients, cuDNN's per-call scratch) is
//! allocated and freed inside the recording: graph memory, at the same addresses on every replay.
//! cuDNN's kept workspace would outlive the recording, so it must not grow while recording: the
//! first step, run as enqueued, grows it, and times the convolution algorithms, which cannot be
//! done while recording either. Either one while recording fails the recording, saying which.
//! A failed recording is abandoned and its step runs as enqueued; the trainer says why.

use crate::backend::{Cuda, Failure, Launch};
use crate::memory::{Buffer, Stream};
use crate::softmax_ce::PendingLoss;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use legion_ops::backend::{In, KernelError, Out};
use std::ops::Range;

/// The most loss kernels a recorded step may enqueue: their totals' slots are allocated before
/// recording.
const LOSS_SLOTS: usize = 8;

/// What a recorded or replayed step reads at fixed addresses, kept on its stream.
#[derive(Default)]
pub(crate) struct Fixed {
    /// From `fix_step` to the end of the recording or the replay: loss kernels report into the
    /// totals' slots and find the labels here.
    pub(crate) active: bool,
    /// From `begin_capture` to `end_capture` or `abandon_capture`.
    pub(crate) recording: bool,
    /// The batch's labels on the device, and their values.
    labels: Option<(CudaSlice<u32>, Vec<u32>)>,
    /// `[loss sum, correct count]` per loss kernel, in the order enqueued.
    totals: Option<CudaSlice<f64>>,
    /// Loss kernels enqueued since `fix_step`.
    losses: usize,
}

impl Fixed {
    /// Where `labels`, of rows `first_row..` of the batch, are held, if they are.
    pub(crate) fn labels(&self, labels: &[u32], first_row: usize) -> Option<CudaView<'_, u32>> {
        let (device, host) = self.labels.as_ref()?;
        crate::batches::rows_holding(host, labels, first_row).map(|rows| device.slice(rows))
    }

    /// The next loss kernel's slot in the totals.
    fn next_loss_slot(&mut self) -> Result<Range<usize>, Failure> {
        let k = self.losses;
        if k >= LOSS_SLOTS {
            return Err(Failure(format!(
                "a recorded step has at most {LOSS_SLOTS} loss layers"
            )));
        }
        self.losses += 1;
        Ok(2 * k..2 * k + 2)
    }
}

/// A recorded step: `Backend::Graph` of the CUDA backend.
pub struct StepGraph {
    graph: CudaGraph,
    /// Its loss kernels, whose totals a replay copies out.
    losses: usize,
}

// SAFETY: a CUDA graph may be launched from any thread as long as calls on it do not overlap; a
// `StepGraph` is launched only through its owner (a trainer, by `&mut`), with the stream it was
// recorded on, which moves between threads the same way.
unsafe impl Send for StepGraph {}

fn device(what: &str) -> impl Fn(Failure) -> KernelError + '_ {
    move |Failure(e)| KernelError::Device(format!("{what}: {e}"))
}

impl Cuda {
    /// Writes `step` where dropout kernels read it, unless it is there already.
    pub(crate) fn write_step(&self, s: &mut Stream, step: u64) -> Launch {
        if s.step.as_ref().is_some_and(|(_, at)| *at == step) {
            return Ok(());
        }
        if s.fixed.recording {
            return Err(Failure(format!(
                "dropout drew from step {step} while recording a step fixed at {:?}",
                s.step.as_ref().map(|(_, at)| *at)
            )));
        }
        if s.step.is_none() {
            s.step = Some((s.stream.alloc_zeros::<u64>(1)?, 0));
        }
        let (word, at) = s.step.as_mut().expect("allocated above");
        let mut b = s.stream.launch_builder(&self.kernels.store_step);
        b.arg(&mut *word).arg(&step);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; `word` holds one u64.
        unsafe { b.launch(one) }?;
        *at = step;
        Ok(())
    }

    /// `Pipeline::fix_step`.
    pub(crate) fn fix_step_on(
        &self,
        s: &mut Stream,
        step: u64,
        images: In<Buffer>,
        fixed: Out<Buffer>,
    ) -> Result<(), KernelError> {
        let failed = device("fixing a step's inputs");
        self.context
            .bind_to_thread()
            .map_err(|e| failed(e.into()))?;
        if s.fixed.recording {
            return Err(failed(Failure("a recording is under way".into())));
        }
        let (from, to) = (images.mem.f32(), fixed.mem.f32_mut());
        if from.len() != to.len() {
            return Err(failed(Failure(format!(
                "{} image values into a buffer of {}",
                from.len(),
                to.len()
            ))));
        }
        let mut fix = || -> Launch {
            s.stream.memcpy_dtod(from, to)?;
            let taken = s
                .labels
                .as_ref()
                .ok_or_else(|| Failure("no staged batch was taken for the step".into()))?;
            let kept = s.fixed.labels.take();
            let mut labels = match kept {
                Some((device, _)) if device.len() == taken.device.len() => device,
                _ => s.stream.alloc_zeros::<u32>(taken.device.len())?,
            };
            s.stream.memcpy_dtod(&taken.device, &mut labels)?;
            s.fixed.labels = Some((labels, taken.host.clone()));
            if s.fixed.totals.is_none() {
                s.fixed.totals = Some(s.stream.alloc_zeros::<f64>(2 * LOSS_SLOTS)?);
            }
            Ok(())
        };
        fix().map_err(&failed)?;
        self.write_step(s, step).map_err(&failed)?;
        s.fixed.active = true;
        s.fixed.losses = 0;
        Ok(())
    }

    /// `Pipeline::begin_capture`.
    pub(crate) fn begin_capture_on(&self, s: &mut Stream) -> Result<(), KernelError> {
        let failed = device("beginning to record a step");
        if !s.fixed.active {
            return Err(failed(Failure("the step's inputs were not fixed".into())));
        }
        if let Some(failure) = &s.failure {
            return Err(failed(Failure(failure.clone())));
        }
        // Thread-local: only calls from this thread that are unsafe while recording (a
        // synchronous allocation, a synchronization) fail the recording; the threads filling
        // the next batch's host memory make no CUDA calls.
        s.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| failed(e.into()))?;
        s.fixed.recording = true;
        Ok(())
    }

    /// `Pipeline::end_capture`.
    pub(crate) fn end_capture_on(&self, s: &mut Stream) -> Result<StepGraph, KernelError> {
        let failed = device("recording the step");
        s.fixed.recording = false;
        let ended = s.stream.end_capture(CUgraphInstantiate_flags(0));
        // Work that failed to enqueue while recording is missing from the graph.
        if let Some(failure) = s.failure.take() {
            return Err(failed(Failure(failure)));
        }
        self.context
            .check_err()
            .map_err(|e| failed(Failure(format!("CUDA: {e}"))))?;
        let graph = ended
            .map_err(|e| failed(e.into()))?
            .ok_or_else(|| failed(Failure("nothing was recorded".into())))?;
        graph.upload().map_err(|e| failed(e.into()))?;
        // The recording allocates from a pool of its own: the memory the steps run as enqueued
        // kept pooled (`keep_freed_memory_pooled`) goes back, rather than be held twice. Only
        // memory no buffer holds is returned, so a refusal costs nothing but that.
        let _ = self.trim_default_pool();
        Ok(StepGraph {
            graph,
            losses: s.fixed.losses,
        })
    }

    /// `Pipeline::abandon_capture`.
    pub(crate) fn abandon_capture_on(&self, s: &mut Stream) {
        if s.fixed.recording {
            // An invalidated recording ends with an error; either way nothing is kept.
            let _ = s.stream.end_capture(CUgraphInstantiate_flags(0));
        }
        s.fixed.recording = false;
        s.fixed.active = false;
        s.failure = None;
        // Buffers freed into an invalidated recording leave its error on the context: it goes
        // with the recording. Any other error stays, for the next synchronize to report.
        if let Err(e) = self.context.check_err()
            && !is_recording_error(&e)
        {
            s.failure = Some(format!("CUDA: {e}"));
        }
    }

    /// `Pipeline::replay`.
    pub(crate) fn replay_on(
        &self,
        s: &mut Stream,
        graph: &StepGraph,
    ) -> Result<Vec<PendingLoss>, KernelError> {
        let failed = device("replaying the recorded step");
        if !s.fixed.active {
            return Err(failed(Failure("the step's inputs were not fixed".into())));
        }
        if let Some(failure) = &s.failure {
            return Err(failed(Failure(failure.clone())));
        }
        s.fixed.active = false;
        graph.graph.launch().map_err(|e| failed(e.into()))?;
        let totals = s.fixed.totals.as_ref().expect("allocated by fix_step");
        (0..graph.losses)
            .map(|k| {
                let mut report = s.stream.alloc_zeros::<f64>(2).map_err(Failure::from)?;
                s.stream
                    .memcpy_dtod(&totals.slice(2 * k..2 * k + 2), &mut report)
                    .map_err(Failure::from)?;
                Ok(PendingLoss::on_device(Some(report)))
            })
            .collect::<Result<Vec<_>, Failure>>()
            .map_err(failed)
    }

    /// While a step is fixed, copies a loss kernel's totals into the next slot of the stream's
    /// (inside the recording: a replay copies them out).
    pub(crate) fn keep_fixed_totals(&self, s: &mut Stream, totals: &CudaSlice<f64>) -> Launch {
        let slot = s.fixed.next_loss_slot()?;
        let kept = s.fixed.totals.as_mut().expect("allocated by fix_step");
        s.stream.memcpy_dtod(totals, &mut kept.slice_mut(slot))?;
        Ok(())
    }
}

impl Cuda {
    fn trim_default_pool(&self) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::result;
        // SAFETY: the context's own device's default pool; trimming frees only unused memory.
        unsafe {
            let pool = result::device::get_default_mem_pool(self.context.cu_device())?;
            result::mem_pool::trim_to(pool, 0)
        }
    }
}

/// Whether `e` says only that a recording was invalid or unfinished.
fn is_recording_error(e: &cudarc::driver::DriverError) -> bool {
    use cudarc::driver::sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUDA_ERROR_STREAM_CAPTURE_MERGE
            | CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
            | CUDA_ERROR_CAPTURED_EVENT
    )
}
