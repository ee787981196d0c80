//! Batches staged ahead of their step: the GPU's side of `Pipeline::stage_batch`.
//!
//! A step's batch (AlexNet 224 b128: 77 MB of images) takes milliseconds to cross the bus, and
//! longer to be written into page-locked memory first. Done at the start of a step, both hold
//! the GPU idle; done while the previous step computes, neither does. So a stream has a **copy
//! stream** beside it and two of everything a batch needs:
//! - page-locked host buffers (images, labels), filled by several threads (the trainer's, while
//!   it enqueues the step) and copied from in turn: filling one waits only for the copy out of it
//!   two batches ago (its `copied_out` event; a slot let go waits for it too);
//! - device image buffers: a taken batch's buffer is handed back once its step is enqueued
//!   (`recycle_staged`). The next batch's buffers are taken, and a `fillable` event recorded on
//!   the compute stream, when the batch is begun (`begin_stage`): before the step its copies run
//!   beside is enqueued, after the last reader of the buffer they refill. The copy stream waits for
//!   that event, so a copy never overtakes the step that reads its buffer, and never waits for
//!   the step that runs beside it.
//!
//! The compute stream waits for the batch's copies (an event recorded behind them) when the step
//! takes it; the labels it holds from then on serve that step's loss kernels without an upload.
//! Every buffer is allocated on the compute stream, which frees it, so the ordering holds whether
//! or not cudarc tracks buffer uses across streams.

use crate::backend::{Cuda, Failure};
use crate::launch::grid;
use crate::memory::Stream;
use crate::staging::{Direction, pinned};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice, PushKernelArg};
use legion_ops::backend::KernelError;
use legion_ops::data::SyntheticBatch;
use std::ops::Range;
use std::sync::Arc;

/// A batch on its way to the device: `Backend::Staged` of the CUDA backend.
#[derive(Debug)]
pub struct StagedBatch {
    /// Both taken by `take_staged`.
    images: Option<CudaSlice<f32>>,
    labels: Option<CudaSlice<u32>>,
    host_labels: Vec<u32>,
    /// Recorded on the copy stream behind both copies.
    copied: CudaEvent,
    /// The stream that allocated the buffers and frees them.
    compute: Arc<CudaStream>,
}

impl Drop for StagedBatch {
    /// A batch dropped untaken (its step was given another) must not be freed while its copy
    /// may still write it: the compute stream, which frees it, waits for the copy first.
    fn drop(&mut self) {
        if self.images.is_some() || self.labels.is_some() {
            let waited = self.compute.wait(&self.copied);
            self.compute.context().record_err(waited);
        }
    }
}

/// The labels of the step being enqueued, on the device, and the host values they hold.
#[derive(Debug)]
pub(crate) struct DeviceLabels {
    pub(crate) host: Vec<u32>,
    pub(crate) device: CudaSlice<u32>,
}

impl DeviceLabels {
    /// Where `labels`, the labels of rows `first_row..` of the batch, already are on the device.
    pub(crate) fn rows(&self, labels: &[u32], first_row: usize) -> Option<Range<usize>> {
        rows_holding(&self.host, labels, first_row)
    }
}

/// The rows of `held` that hold `labels` at `first_row`, if they do.
pub(crate) fn rows_holding(held: &[u32], labels: &[u32], first_row: usize) -> Option<Range<usize>> {
    let rows = first_row..first_row.checked_add(labels.len())?;
    (held.get(rows.clone())? == labels).then_some(rows)
}

/// The event recorded behind the last copies out of a slot's page-locked memory (cudarc records
/// its own only while it tracks buffer uses, `Sharing::AcrossStreams`). The memory must outlive
/// those copies: dropping this waits for them, so a slot declares it before its buffers (fields
/// drop in order).
#[derive(Default)]
struct CopiedOut(Option<CudaEvent>);

impl CopiedOut {
    /// Waits for the copies out of the slot, before its memory is written again.
    fn wait(&self) -> Result<(), cudarc::driver::DriverError> {
        match &self.0 {
            Some(event) => event.synchronize(),
            None => Ok(()),
        }
    }
}

impl Drop for CopiedOut {
    fn drop(&mut self) {
        if let Some(event) = &self.0 {
            let waited = event.synchronize();
            event.context().record_err(waited);
        }
    }
}

/// One of the two host-side sets a batch is copied from.
struct HostSlot {
    /// First: dropped, and so waited for, before the memory it guards.
    copied_out: CopiedOut,
    images: PinnedHostSlice<f32>,
    labels: PinnedHostSlice<u32>,
}

/// One of the two sets a described synthetic batch (`Pipeline::stage_synthetic`) is drawn
/// from: its description in page-locked memory and on the device. The device buffers belong to
/// the copy stream, which alone uses them, so a reuse is ordered after the draw that read them.
struct DescribedSlot {
    /// First: dropped, and so waited for, before the memory it guards.
    copied_out: CopiedOut,
    factors: PinnedHostSlice<f32>,
    states: PinnedHostSlice<u64>,
    labels: PinnedHostSlice<u32>,
    device_factors: CudaSlice<f32>,
    device_states: CudaSlice<u64>,
}

/// A stream's copy stream and the buffers batches move through.
pub(crate) struct BatchCopies {
    copy: Arc<CudaStream>,
    slots: [Option<HostSlot>; 2],
    next_slot: usize,
    described: [Option<DescribedSlot>; 2],
    next_described: usize,
    /// Device image buffers of enqueued steps, handed back after their last reader was
    /// enqueued on the compute stream (a later `fillable` event orders a refill after it).
    free: Vec<CudaSlice<f32>>,
}

impl std::fmt::Debug for BatchCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchCopies")
            .field("free", &self.free.len())
            .finish_non_exhaustive()
    }
}

/// Runs `enqueue`, which enqueues a batch's copies on `copy`; where it fails part way, waits for
/// what it did enqueue: nothing of the batch may be freed while a copy that was enqueued runs.
fn drained_on_failure<T>(
    copy: &CudaStream,
    enqueue: impl FnOnce() -> Result<T, Failure>,
) -> Result<T, Failure> {
    enqueue().inspect_err(|_| {
        let _ = copy.synchronize();
    })
}

fn record(stream: &CudaStream) -> Result<CudaEvent, Failure> {
    Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?)
}

/// Page-locked host memory taken for one batch (`Backend::HostBatch` of the CUDA backend),
/// filled on any thread, and the device buffers its copies will fill: taken by
/// `Cuda::begin_stage_on` before the step that runs beside the copies is enqueued, so that
/// nothing the copies wait for on the compute stream comes after that step.
pub struct HostBatch {
    /// `None` for a described synthetic batch, which is drawn on the device.
    slot: Option<HostSlot>,
    index: usize,
    images: CudaSlice<f32>,
    labels: CudaSlice<u32>,
    /// Recorded on the compute stream once the device buffers are free to fill.
    fillable: CudaEvent,
}

impl std::fmt::Debug for HostBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("images", &self.slot.as_ref().map(|s| s.images.len()))
            .field("labels", &self.slot.as_ref().map(|s| s.labels.len()))
            .finish()
    }
}

fn failed(Failure(e): Failure) -> KernelError {
    KernelError::Device(format!("staging a batch: {e}"))
}

impl Cuda {
    /// The next page-locked slot, sized for `images` and `labels` values, once the copies out of
    /// it two batches ago have run; and the device buffers for the batch.
    pub(crate) fn begin_stage_on(
        &self,
        s: &mut Stream,
        images: usize,
        labels: usize,
    ) -> Result<HostBatch, KernelError> {
        self.context
            .bind_to_thread()
            .map_err(|e| failed(e.into()))?;
        self.begin(s, images, labels).map_err(failed)
    }

    fn begin(&self, s: &mut Stream, images: usize, labels: usize) -> Result<HostBatch, Failure> {
        let copies = self.copies(s)?;
        let index = copies.next_slot;
        copies.next_slot = (index + 1) % 2;
        let slot = match copies.slots[index].take() {
            Some(slot) if slot.images.len() == images && slot.labels.len() == labels => {
                slot.copied_out.wait()?;
                slot
            }
            stale => {
                drop(stale);
                HostSlot {
                    images: pinned(self, images, Direction::ToDevice)?,
                    labels: pinned(self, labels, Direction::ToDevice)?,
                    copied_out: CopiedOut::default(),
                }
            }
        };
        let (images, labels, fillable) = self.device_buffers(s, images, labels)?;
        Ok(HostBatch {
            slot: Some(slot),
            index,
            images,
            labels,
            fillable,
        })
    }

    /// The stream's copy stream and batch buffers, made on first use.
    fn copies<'s>(&self, s: &'s mut Stream) -> Result<&'s mut BatchCopies, Failure> {
        if s.batches.is_none() {
            s.batches = Some(BatchCopies {
                copy: self.context.new_stream()?,
                slots: [None, None],
                next_slot: 0,
                described: [None, None],
                next_described: 0,
                free: Vec::new(),
            });
        }
        Ok(s.batches.as_mut().expect("made above"))
    }

    /// A batch's device buffers, and the event behind which its copies may fill them.
    fn device_buffers(
        &self,
        s: &mut Stream,
        images: usize,
        labels: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u32>, CudaEvent), Failure> {
        let compute = s.stream.clone();
        let copies = self.copies(s)?;
        // A device buffer that no step enqueued after its release reads, or a new one. Both the
        // images and the labels come from the compute stream, which frees them, and now: before
        // the step that the copies run beside is enqueued, so `fillable` does not wait for it.
        let reusable = copies.free.iter().position(|b| b.len() == images);
        let device_images = match reusable {
            Some(i) => copies.free.swap_remove(i),
            // SAFETY: the copy (or the draw) writes every element before any kernel reads it.
            None => unsafe { compute.alloc::<f32>(images) }?,
        };
        // SAFETY: as above, the labels' copy writes every element.
        let device_labels = unsafe { compute.alloc::<u32>(labels) }?;
        // Behind the last reader of a reused buffer on the compute stream, and the allocations.
        let fillable = record(&compute)?;
        Ok((device_images, device_labels, fillable))
    }

    /// Where a batch is written: its images and its labels.
    pub(crate) fn host_slices_of(
        batch: &mut HostBatch,
    ) -> Result<(&mut [f32], &mut [u32]), KernelError> {
        let Some(HostSlot { images, labels, .. }) = &mut batch.slot else {
            return Err(KernelError::Batch(
                "a synthetic batch is drawn on the device, not written by the host".into(),
            ));
        };
        let images = images.as_mut_slice().map_err(|e| failed(e.into()))?;
        let labels = labels.as_mut_slice().map_err(|e| failed(e.into()))?;
        Ok((images, labels))
    }

    /// Enqueues the copies of a filled batch on the copy stream.
    pub(crate) fn finish_stage_on(
        &self,
        s: &mut Stream,
        batch: HostBatch,
    ) -> Result<StagedBatch, KernelError> {
        self.context
            .bind_to_thread()
            .map_err(|e| failed(e.into()))?;
        self.finish(s, batch).map_err(failed)
    }

    fn finish(&self, s: &mut Stream, batch: HostBatch) -> Result<StagedBatch, Failure> {
        let compute = s.stream.clone();
        let HostBatch {
            slot,
            index,
            mut images,
            mut labels,
            fillable,
        } = batch;
        let mut slot = slot.expect("a batch begun by begin_stage has host buffers");
        let copies = s
            .batches
            .as_mut()
            .expect("a batch is finished on the stream that began it");
        // Read before the copies, which a read would wait for (write-combined memory is slow to
        // read, but a batch has few labels).
        let host_labels = slot.labels.as_slice()?.to_vec();
        let copy = &copies.copy;
        let (copied, copied_out) = drained_on_failure(copy, || {
            copy.wait(&fillable)?;
            copy.memcpy_htod(&slot.images, &mut images)?;
            copy.memcpy_htod(&slot.labels, &mut labels)?;
            Ok((record(copy)?, record(copy)?))
        })?;
        slot.copied_out = CopiedOut(Some(copied_out));
        copies.slots[index] = Some(slot);
        Ok(StagedBatch {
            images: Some(images),
            labels: Some(labels),
            host_labels,
            copied,
            compute,
        })
    }

    /// The device buffers of a described synthetic batch, taken as [`Cuda::begin_stage_on`]
    /// takes them: before the step its drawing runs beside is enqueued.
    pub(crate) fn begin_synthetic_on(
        &self,
        s: &mut Stream,
        batch: &SyntheticBatch,
    ) -> Result<HostBatch, KernelError> {
        batch
            .check()
            .map_err(|e| KernelError::Batch(e.to_string()))?;
        self.context
            .bind_to_thread()
            .map_err(|e| failed(e.into()))?;
        let images = batch.len() * batch.sample_len();
        let (images, labels, fillable) = self
            .device_buffers(s, images, batch.len())
            .map_err(failed)?;
        Ok(HostBatch {
            slot: None,
            index: 0,
            images,
            labels,
            fillable,
        })
    }

    /// Stages a described synthetic batch into the buffers [`Cuda::begin_synthetic_on`] took:
    /// its description (about 1/19 of its images at 224 × 224) crosses the bus on the copy
    /// stream, and the `synthetic_draw` kernel draws the images there.
    pub(crate) fn finish_synthetic_on(
        &self,
        s: &mut Stream,
        host: HostBatch,
        batch: &SyntheticBatch,
    ) -> Result<StagedBatch, KernelError> {
        batch
            .check()
            .map_err(|e| KernelError::Batch(e.to_string()))?;
        if host.slot.is_some()
            || host.labels.len() != batch.len()
            || host.images.len() != batch.len() * batch.sample_len()
        {
            return Err(KernelError::Batch(
                "finish_synthetic takes the buffers begin_synthetic took for the same batch".into(),
            ));
        }
        self.context
            .bind_to_thread()
            .map_err(|e| failed(e.into()))?;
        self.stage_described(s, host, batch).map_err(failed)
    }

    fn stage_described(
        &self,
        s: &mut Stream,
        host: HostBatch,
        batch: &SyntheticBatch,
    ) -> Result<StagedBatch, Failure> {
        let HostBatch {
            images: mut device_images,
            labels: mut device_labels,
            fillable,
            ..
        } = host;
        let images = device_images.len();
        let compute = s.stream.clone();
        let copies = self.copies(s)?;
        let index = copies.next_described;
        copies.next_described = (index + 1) % 2;
        let copy = copies.copy.clone();
        let mut slot = match copies.described[index].take() {
            Some(slot)
                if slot.factors.len() == batch.factors.len()
                    && slot.labels.len() == batch.len() =>
            {
                slot.copied_out.wait()?;
                slot
            }
            stale => {
                drop(stale);
                DescribedSlot {
                    factors: pinned(self, batch.factors.len(), Direction::ToDevice)?,
                    states: pinned(self, batch.len(), Direction::ToDevice)?,
                    labels: pinned(self, batch.len(), Direction::ToDevice)?,
                    // SAFETY: each draw's copies write every element before the kernel reads.
                    device_factors: unsafe { copy.alloc::<f32>(batch.factors.len()) }?,
                    device_states: unsafe { copy.alloc::<u64>(batch.len()) }?,
                    copied_out: CopiedOut::default(),
                }
            }
        };
        slot.factors.as_mut_slice()?.copy_from_slice(&batch.factors);
        slot.states
            .as_mut_slice()?
            .copy_from_slice(&batch.noise_states);
        slot.labels.as_mut_slice()?.copy_from_slice(&batch.labels);
        let [_, height, width] = batch.image.map(|e| e as i64);
        let (samples, channels) = (batch.len() as i64, batch.image[0] as i64);
        let noise_scale = SyntheticBatch::noise_scale();
        let (copied, copied_out) = drained_on_failure(&copy, || {
            copy.wait(&fillable)?;
            copy.memcpy_htod(&slot.factors, &mut slot.device_factors)?;
            copy.memcpy_htod(&slot.states, &mut slot.device_states)?;
            copy.memcpy_htod(&slot.labels, &mut device_labels)?;
            let copied_out = record(&copy)?;
            let mut b = copy.launch_builder(&self.kernels.synthetic_draw);
            b.arg(&mut device_images)
                .arg(&slot.device_factors)
                .arg(&slot.device_states)
                .arg(&noise_scale)
                .arg(&samples)
                .arg(&channels)
                .arg(&height)
                .arg(&width);
            // SAFETY: the arguments match the kernel's signature; the buffers hold the batch's
            // images and description (sizes checked by the caller).
            unsafe { b.launch(grid(images as i64)) }?;
            Ok((record(&copy)?, copied_out))
        })?;
        slot.copied_out = CopiedOut(Some(copied_out));
        copies.described[index] = Some(slot);
        Ok(StagedBatch {
            images: Some(device_images),
            labels: Some(device_labels),
            host_labels: batch.labels.clone(),
            copied,
            compute,
        })
    }

    pub(crate) fn take_staged_on(
        &self,
        s: &mut Stream,
        mut staged: StagedBatch,
    ) -> Result<CudaSlice<f32>, KernelError> {
        s.stream
            .wait(&staged.copied)
            .map_err(|e| KernelError::Device(format!("waiting for a staged batch: {e}")))?;
        let (Some(images), Some(labels)) = (staged.images.take(), staged.labels.take()) else {
            unreachable!("a staged batch is taken once: take_staged consumes it")
        };
        s.labels = Some(DeviceLabels {
            host: std::mem::take(&mut staged.host_labels),
            device: labels,
        });
        Ok(images)
    }

    pub(crate) fn recycle_staged_on(&self, s: &mut Stream, images: CudaSlice<f32>) {
        // Two buffers alternate; a third (a batch staged and then not used) is let go.
        if let Some(copies) = s.batches.as_mut()
            && copies.free.len() < 2
        {
            copies.free.push(images);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_labels_serve_the_rows_they_hold_and_no_others() {
        let held = [3u32, 1, 4, 1, 5];
        assert_eq!(rows_holding(&held, &[3, 1, 4, 1, 5], 0), Some(0..5));
        assert_eq!(rows_holding(&held, &[4, 1], 2), Some(2..4));
        assert_eq!(rows_holding(&held, &[4, 2], 2), None, "other values");
        assert_eq!(rows_holding(&held, &[5, 9], 4), None, "past the batch");
        assert_eq!(rows_holding(&held, &[1], usize::MAX), None, "no overflow");
        assert_eq!(rows_holding(&held, &[], 5), Some(5..5), "an empty tile");
    }
}
