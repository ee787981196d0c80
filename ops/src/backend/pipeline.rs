//! What the one-device trainer needs of a backend beyond the primitives: a batch staged on the
//! device while the previous step computes, synthetic batches drawn where they are used, a loss
//! report moved home to be read late, and a step recorded once and replayed. The defaults are
//! those of a backend that runs each kernel when it is called (the CPU's): nothing to record, a
//! loss already home.

use super::{Backend, In, KernelError, Out, fill_host_batch};
use crate::data::SyntheticBatch;

/// The one-device trainer's pipeline over a [`Backend`].
pub trait Pipeline: Backend {
    /// A step's whole batch on its way to the device (see [`Pipeline::stage_batch`]).
    type Staged;
    /// Host memory taken for one batch to be staged from (page-locked on a GPU).
    type HostBatch;
    /// A training step's work recorded once and then replayed whole, as one launch (a CUDA
    /// graph): see [`crate::capture`].
    type Graph;

    /// Enqueues on `stream` the move of a loss report to where the host reads it (page-locked
    /// memory the stream keeps, on a GPU), so that [`Backend::read_loss`] may read it once the
    /// stream has passed a marker recorded after this, without waiting for later work.
    fn send_loss_home(
        &self,
        stream: &mut Self::Stream,
        loss: Self::Loss,
    ) -> Result<Self::Loss, KernelError> {
        let _ = stream;
        Ok(loss)
    }
    /// Starts moving a step's whole batch to the device: `images` laid out as the input layer's
    /// output, and the labels with them. Work on `s` is not ordered after it, so a batch staged
    /// while the previous step computes is on the device when its step begins (on a GPU the
    /// copies run on a copy stream of their own, from page-locked memory). The host data may be
    /// dropped once this returns.
    fn stage_batch(
        &self,
        s: &mut Self::Stream,
        images: &[f32],
        labels: &[u32],
    ) -> Result<Self::Staged, KernelError> {
        let mut host = self.begin_stage(s, images.len(), labels.len())?;
        fill_host_batch(Self::host_slices(&mut host)?, images, labels);
        self.finish_stage(s, host)
    }

    /// [`Pipeline::stage_batch`] in three parts, so that another thread can fill the host memory
    /// while this one enqueues a step: host memory for a batch of `images` and `labels` values
    /// (once no earlier copy reads it)...
    fn begin_stage(
        &self,
        s: &mut Self::Stream,
        images: usize,
        labels: usize,
    ) -> Result<Self::HostBatch, KernelError>;
    /// ...where the batch is written (images, labels), from any thread...
    fn host_slices(batch: &mut Self::HostBatch) -> Result<(&mut [f32], &mut [u32]), KernelError>;
    /// ...and the copies of the filled batch, enqueued.
    fn finish_stage(
        &self,
        s: &mut Self::Stream,
        batch: Self::HostBatch,
    ) -> Result<Self::Staged, KernelError>;

    /// Takes a staged batch for the step about to be enqueued on `s`: work enqueued on `s` from
    /// now on waits for its copies, its images come back as the input layer's output, and the
    /// loss kernels of the step find its labels on the device.
    fn take_staged(
        &self,
        s: &mut Self::Stream,
        staged: Self::Staged,
    ) -> Result<Self::Buffer, KernelError>;

    /// [`Pipeline::stage_batch`] for a batch of synthetic data described instead of drawn: a
    /// GPU draws the images itself (bit-identical to the host's, [`SyntheticBatch::render`]), so
    /// neither the host's threads nor the bus carry them. By default they are drawn on the host
    /// and staged.
    fn stage_synthetic(
        &self,
        s: &mut Self::Stream,
        batch: &SyntheticBatch,
    ) -> Result<Self::Staged, KernelError> {
        let host = self.begin_synthetic(s, batch)?;
        self.finish_synthetic(s, host, batch)
    }

    /// [`Pipeline::stage_synthetic`] in two parts, as [`Pipeline::begin_stage`] and
    /// [`Pipeline::finish_stage`]: the batch's device buffers, taken before the step that the
    /// drawing runs beside is enqueued (so the drawing does not wait for that step)...
    fn begin_synthetic(
        &self,
        s: &mut Self::Stream,
        batch: &SyntheticBatch,
    ) -> Result<Self::HostBatch, KernelError> {
        batch
            .check()
            .map_err(|e| KernelError::Batch(e.to_string()))?;
        self.begin_stage(s, batch.len() * batch.sample_len(), batch.len())
    }

    /// ...and the drawing, enqueued after it.
    fn finish_synthetic(
        &self,
        s: &mut Self::Stream,
        mut host: Self::HostBatch,
        batch: &SyntheticBatch,
    ) -> Result<Self::Staged, KernelError> {
        let (images, labels) = Self::host_slices(&mut host)?;
        batch.render(images);
        labels.copy_from_slice(&batch.labels);
        self.finish_stage(s, host)
    }

    /// Hands back the images of a taken batch once its step is enqueued: a later
    /// [`Pipeline::stage_batch`] may refill them after `s` has run what is enqueued now.
    fn recycle_staged(&self, s: &mut Self::Stream, images: Self::Buffer) {
        let _ = (s, images);
    }

    /// Readies `s` for a step that is captured or replayed ([`Pipeline::begin_capture`],
    /// [`Pipeline::replay`]): what differs from step to step goes where such a step reads it, at
    /// addresses that stay. `step` (which dropout masks draw from) into the stream's own memory,
    /// the labels of the batch the step took ([`Pipeline::take_staged`]) into the stream's own
    /// buffer, and its `images` into `fixed`, a buffer the caller keeps from step to step. Until
    /// the capture ends, loss kernels report into the stream's own totals.
    fn fix_step(
        &self,
        s: &mut Self::Stream,
        step: u64,
        images: In<Self::Buffer>,
        fixed: Out<Self::Buffer>,
    ) -> Result<(), KernelError> {
        let _ = step;
        self.copy(s, images, fixed);
        Ok(())
    }
    /// Starts recording the work enqueued on `s` instead of running it (after
    /// [`Pipeline::fix_step`]). A backend that runs each kernel as it is called says why it cannot.
    fn begin_capture(&self, s: &mut Self::Stream) -> Result<(), KernelError> {
        let _ = s;
        Err(KernelError::Device(
            "this backend runs each kernel when it is called: there is no queue to record".into(),
        ))
    }
    /// Ends the recording: the step's work, ready to [`Pipeline::replay`]. Every buffer allocated
    /// while recording must have been dropped (it is freed within the recording).
    fn end_capture(&self, s: &mut Self::Stream) -> Result<Self::Graph, KernelError> {
        let _ = s;
        Err(KernelError::Device("no capture was begun".into()))
    }
    /// Drops a recording that failed (or whose step failed to enqueue): `s` runs work as it is
    /// enqueued again, with no failure kept.
    fn abandon_capture(&self, s: &mut Self::Stream) {
        let _ = s;
    }
    /// Enqueues a captured step's work on `s` (after [`Pipeline::fix_step`] for this step), and
    /// the reports of its loss kernels, in the order they were captured.
    fn replay(
        &self,
        s: &mut Self::Stream,
        graph: &Self::Graph,
    ) -> Result<Vec<Self::Loss>, KernelError> {
        let _ = (s, graph);
        Err(KernelError::Device(
            "this backend records no steps to replay".into(),
        ))
    }
}
