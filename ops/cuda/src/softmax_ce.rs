//! Softmax cross-entropy: each row's loss and whether its prediction was right, their sums kept on
//! the device until read ([`PendingLoss`]), and the gradient of the logits. A tile's labels are
//! checked as the CPU checks them, then taken from the staged batch where the step took one (or
//! from the stream's copy of it in a recorded step, `crate::capture`), or uploaded.

use crate::backend::{Cuda, Failure};
use crate::launch::{one_reduction_block, softmax_rows};
use crate::memory::{Buffer, Stream, same_type};
use crate::staging::{Direction, pinned};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice, PushKernelArg};
use legion_ops::backend::{In, KernelError, LabelOutOfRange, LossSums, Out};
use legion_ops::shape::Rect;
use std::sync::{Arc, Mutex};

/// A loss kernel's report: `[loss sum, correct count]` in device memory until read, or, once
/// sent home (`Pipeline::send_loss_home`), copied into page-locked memory of its stream's.
pub struct PendingLoss {
    pub(crate) totals: Option<CudaSlice<f64>>,
    pub(crate) home: Option<LossHome>,
}

impl PendingLoss {
    pub(crate) fn on_device(totals: Option<CudaSlice<f64>>) -> PendingLoss {
        PendingLoss { totals, home: None }
    }
}

/// Page-locked memory for one report's two sums, and an event of its own recorded behind each
/// copy into it (cudarc records a pinned slice's event only while it tracks buffer uses, which
/// the one-device trainer turns off): reading waits for that event, and dropping it too, before
/// the memory is freed under a copy still running.
struct HomeSlot {
    copied: CudaEvent,
    memory: PinnedHostSlice<f64>,
}

impl Drop for HomeSlot {
    fn drop(&mut self) {
        let waited = self.copied.synchronize();
        self.copied.context().record_err(waited);
    }
}

/// A report's home, lent by its stream's [`LossHomes`] and handed back when the report is
/// dropped, read or not.
pub(crate) struct LossHome {
    slot: Option<HomeSlot>,
    homes: LossHomes,
}

impl LossHome {
    /// The sums, once the copy into them has run (waits for that copy alone).
    fn read(&self) -> Result<LossSums, cudarc::driver::DriverError> {
        let slot = self.slot.as_ref().expect("lent until dropped");
        slot.copied.synchronize()?;
        let [loss_sum, correct] = slot.memory.as_slice()?[..] else {
            unreachable!("a loss home holds two values")
        };
        Ok(LossSums {
            loss_sum,
            correct: correct as usize,
        })
    }
}

impl Drop for LossHome {
    fn drop(&mut self) {
        if let (Some(slot), Ok(mut kept)) = (self.slot.take(), self.homes.0.lock()) {
            // A later copy into it is enqueued on the same stream, so runs after this one.
            if kept.len() < LossHomes::KEPT {
                kept.push(slot);
            }
        }
    }
}

/// A stream's page-locked homes for loss reports: lent to the reports sent home and handed
/// back, so that a steady run allocates none (a step or two are read late at most).
#[derive(Clone, Default)]
pub(crate) struct LossHomes(Arc<Mutex<Vec<HomeSlot>>>);

impl LossHomes {
    /// Homes kept for reuse; more in use at once are allocated and let go.
    const KEPT: usize = 4;

    fn lend(&self, cuda: &Cuda) -> Result<LossHome, Failure> {
        let kept = self.0.lock().ok().and_then(|mut kept| kept.pop());
        let slot = match kept {
            Some(slot) => slot,
            None => HomeSlot {
                copied: cuda
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
                // Written whole by the copy before anything reads it.
                memory: pinned::<f64>(cuda, 2, Direction::ToHost)?,
            },
        };
        Ok(LossHome {
            slot: Some(slot),
            homes: self.clone(),
        })
    }
}

impl std::fmt::Debug for LossHomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossHomes").finish_non_exhaustive()
    }
}

impl Cuda {
    /// `Pipeline::send_loss_home`: the report's sums copied into page-locked memory on `s`, behind
    /// the work that computes them; the device totals are freed in stream order after the copy.
    pub(crate) fn send_loss_home_on(
        &self,
        s: &mut Stream,
        mut loss: PendingLoss,
    ) -> Result<PendingLoss, KernelError> {
        // An empty report (a recording's), or one already sent, has nothing to move.
        let Some(totals) = loss.totals.take() else {
            return Ok(loss);
        };
        let mut sent = None;
        self.enqueue(s, "sending a loss report home", |s| {
            let mut home = s.loss_homes.lend(self)?;
            let slot = home.slot.as_mut().expect("just lent");
            s.stream.memcpy_dtoh(&totals, &mut slot.memory)?;
            slot.copied.record(&s.stream)?;
            sent = Some(home);
            Ok(())
        });
        match (&s.failure, sent) {
            (Some(failure), _) => Err(KernelError::Device(failure.clone())),
            (None, home) => {
                loss.home = home;
                Ok(loss)
            }
        }
    }

    /// `Backend::read_loss`.
    pub(crate) fn read_loss_of(&self, loss: PendingLoss) -> LossSums {
        if let Some(home) = &loss.home {
            return home
                .read()
                .unwrap_or_else(|e| panic!("reading a loss sent home failed: {e}"));
        }
        let Some(totals) = loss.totals else {
            return LossSums::default();
        };
        let host = totals
            .stream()
            .clone_dtoh(&totals)
            .unwrap_or_else(|e| panic!("reading a loss after synchronize failed: {e}"));
        LossSums {
            loss_sum: host[0],
            correct: host[1] as usize,
        }
    }
}

impl Cuda {
    /// A tile's labels on the device, after checking them against the class count as the CPU
    /// does: those of the staged batch the step took where they are the same, else uploaded.
    fn labels<'s>(
        &self,
        s: &'s Stream,
        labels: &[u32],
        first_row: usize,
        classes: usize,
    ) -> Result<Result<TileLabels<'s>, Failure>, LabelOutOfRange> {
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes) {
            return Err(LabelOutOfRange {
                sample: first_row + i,
                label: labels[i],
                classes,
            });
        }
        if s.fixed.active
            && let Some(fixed) = s.fixed.labels(labels, first_row)
        {
            return Ok(Ok(TileLabels::Staged(fixed)));
        }
        if let Some(staged) = &s.labels
            && let Some(rows) = staged.rows(labels, first_row)
        {
            return Ok(Ok(TileLabels::Staged(staged.device.slice(rows))));
        }
        Ok(s.stream
            .clone_htod(labels)
            .map(TileLabels::Uploaded)
            .map_err(Failure::from))
    }

    fn check_loss_tile(logits: &Rect, labels: &[u32], out: &Rect, out_columns: usize) {
        assert_eq!(logits.ndim(), 2, "logits must be (N, classes)");
        assert_eq!(
            logits.lo[1], 0,
            "logits view {logits} must hold all classes"
        );
        assert!(
            out.lo[1] == 0 && out.hi[1] == out_columns,
            "output tile {out} has the wrong columns"
        );
        assert!(
            out.lo[0] >= logits.lo[0] && out.hi[0] <= logits.hi[0],
            "logits view {logits} does not contain the rows of {out}"
        );
        assert_eq!(labels.len(), out.extent(0), "one label per row of {out}");
    }
}

/// A loss tile's labels on the device.
enum TileLabels<'s> {
    /// Rows of the staged batch's labels.
    Staged(cudarc::driver::CudaView<'s, u32>),
    Uploaded(CudaSlice<u32>),
}

impl TileLabels<'_> {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        match self {
            TileLabels::Staged(view) => b.arg(view),
            TileLabels::Uploaded(slice) => b.arg(slice),
        };
    }
}

/// The loss of each row of the tile into `y`, and its sums (loss, correct count) on the device
/// until read.
pub(crate) fn forward(
    cuda: &Cuda,
    s: &mut Stream,
    logits: In<Buffer>,
    labels: &[u32],
    y: Out<Buffer>,
) -> Result<PendingLoss, KernelError> {
    Cuda::check_loss_tile(&logits.rect, labels, &y.rect, 1);
    let classes = logits.rect.hi[1];
    let first_row = y.rect.lo[0];
    let mut pending = PendingLoss::on_device(None);
    let mut label_error = None;
    cuda.enqueue(s, "softmax_ce_forward", |s| {
        let rows = y.rect.extent(0) as i64;
        let labels = match cuda.labels(s, labels, first_row, classes) {
            Ok(uploaded) => uploaded?,
            Err(e) => {
                label_error = Some(e);
                return Ok(());
            }
        };
        let mut totals = s.stream.alloc_zeros::<f64>(2)?;
        if rows > 0 {
            let mut correct = s.stream.alloc_zeros::<u32>(rows as usize)?;
            let (logits_row0, classes, row0) =
                (logits.rect.lo[0] as i64, classes as i64, first_row as i64);
            // The per-sample losses are f32 in every precision (bf16 logits are read to f32).
            let loss = y.mem.f32_mut();
            let rows_kernel = cuda.kernels.softmax_ce_rows.of(logits.mem.dtype());
            let mut b = s.stream.launch_builder(rows_kernel);
            logits.mem.push(&mut b);
            b.arg(&logits_row0).arg(&classes);
            labels.push(&mut b);
            b.arg(&row0).arg(&rows).arg(&mut *loss).arg(&mut correct);
            // SAFETY: the arguments match the kernel's signature; rows lie in the logits.
            unsafe { b.launch(softmax_rows(rows)) }?;
            let mut b = s.stream.launch_builder(&cuda.kernels.loss_totals);
            b.arg(&*loss).arg(&correct).arg(&rows).arg(&mut totals);
            // SAFETY: as above; one block of REDUCE_THREADS threads.
            unsafe { b.launch(one_reduction_block()) }?;
        }
        drop(labels);
        match s.fixed.active {
            // A recorded step's totals are read from the stream's slots after each replay.
            true => cuda.keep_fixed_totals(s, &totals)?,
            false => pending.totals = Some(totals),
        }
        Ok(())
    });
    if let Some(e) = label_error {
        return Err(e.into());
    }
    match (&s.failure, pending.totals.is_some()) {
        (Some(failure), _) => Err(KernelError::Device(failure.clone())),
        (None, _) => Ok(pending),
    }
}

/// The gradient of the logits over the tile's rows, times `scale`.
pub(crate) fn backward(
    cuda: &Cuda,
    s: &mut Stream,
    logits: In<Buffer>,
    labels: &[u32],
    scale: f32,
    dlogits: Out<Buffer>,
) -> Result<(), KernelError> {
    let classes = logits.rect.hi[1];
    Cuda::check_loss_tile(&logits.rect, labels, &dlogits.rect, classes);
    let first_row = dlogits.rect.lo[0];
    let mut label_error = None;
    cuda.enqueue(s, "softmax_ce_backward", |s| {
        let rows = dlogits.rect.extent(0) as i64;
        let labels = match cuda.labels(s, labels, first_row, classes) {
            Ok(uploaded) => uploaded?,
            Err(e) => {
                label_error = Some(e);
                return Ok(());
            }
        };
        if rows == 0 {
            return Ok(());
        }
        let (logits_row0, classes, row0) =
            (logits.rect.lo[0] as i64, classes as i64, first_row as i64);
        let dtype = same_type(&[logits.mem.dtype(), dlogits.mem.dtype()]);
        let mut b = s
            .stream
            .launch_builder(cuda.kernels.softmax_ce_backward.of(dtype));
        logits.mem.push(&mut b);
        b.arg(&logits_row0).arg(&classes);
        labels.push(&mut b);
        b.arg(&row0).arg(&rows).arg(&scale);
        dlogits.mem.push_mut(&mut b);
        // SAFETY: the arguments match the kernel's signature; rows lie in the logits.
        unsafe { b.launch(softmax_rows(rows)) }?;
        Ok(())
    });
    if let Some(e) = label_error {
        return Err(e.into());
    }
    match &s.failure {
        Some(failure) => Err(KernelError::Device(failure.clone())),
        None => Ok(()),
    }
}
