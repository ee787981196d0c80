//! Moving a device's slices to and from host memory without stalling its stream, and timing its
//! work: what the runtime's GPU device actors need besides the [`Backend`] primitives.
//!
//! A copy from pageable host memory waits for everything enqueued before it on the stream, and a
//! copy into pageable memory waits for its own end: either would hold a device's submitting thread
//! while the GPU drains. A [`Staging`] buffer is page-locked, so both directions are truly
//! asynchronous: the copy is enqueued, an event is recorded behind it, and whoever reads the host
//! side ([`Staging::read`]) or writes it again ([`Staging::write`]) first waits for that event, on
//! its own thread.
//!
//! [`Backend`]: legion_ops::backend::Backend

use crate::backend::Cuda;
use crate::memory::{Bf16, Buffer, Stream};
use cudarc::driver::sys::{CU_MEMHOSTALLOC_WRITECOMBINED, CUevent_flags};
use cudarc::driver::{CudaEvent, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};
use legion_ops::backend::{DType, KernelError, cpu};

/// Which way a staging buffer's data goes; it decides how the host memory is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host to device: write-combined memory, fast for the CPU to fill and the GPU to read, very
    /// slow for the CPU to read.
    ToDevice,
    /// Device to host: ordinary cached page-locked memory, for the CPU to read.
    ToHost,
}

/// Page-locked host memory for one slice, of any element type.
#[derive(Debug)]
pub enum Staging {
    F32(PinnedHostSlice<f32>),
    F64(PinnedHostSlice<f64>),
    Bf16(PinnedHostSlice<Bf16>),
}

fn device_error(what: &str) -> impl Fn(DriverError) -> KernelError + '_ {
    move |e| KernelError::Device(format!("{what}: {e}"))
}

/// Page-locked host memory of `len` elements for copies in `direction` (write-combined toward the
/// device). Uninitialised: the caller writes it before a copy reads it.
pub(crate) fn pinned<T: DeviceRepr>(
    cuda: &Cuda,
    len: usize,
    direction: Direction,
) -> Result<PinnedHostSlice<T>, DriverError> {
    let flags = match direction {
        Direction::ToDevice => CU_MEMHOSTALLOC_WRITECOMBINED,
        Direction::ToHost => 0,
    };
    // SAFETY: the memory is uninitialised until written: `Cuda::staging` zeroes all of it before
    // anything else can see it.
    unsafe { cuda.context().alloc_pinned_with_flags::<T>(len, flags) }
}

impl Staging {
    pub fn dtype(&self) -> DType {
        match self {
            Staging::F32(_) => DType::F32,
            Staging::F64(_) => DType::F64,
            Staging::Bf16(_) => DType::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Staging::F32(p) => p.len(),
            Staging::F64(p) => p.len(),
            Staging::Bf16(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host data, once the last copy into it has run (waits on this thread).
    pub fn read(&self) -> Result<cpu::Buffer, KernelError> {
        let read = device_error("reading a staged slice");
        Ok(match self {
            Staging::F32(p) => cpu::Buffer::F32(p.as_slice().map_err(read)?.to_vec()),
            Staging::F64(p) => cpu::Buffer::F64(p.as_slice().map_err(read)?.to_vec()),
            Staging::Bf16(p) => {
                cpu::Buffer::Bf16(p.as_slice().map_err(read)?.iter().map(|b| b.0).collect())
            }
        })
    }

    /// Fills the host side with `host` (same type and length), once the last copy out of it has
    /// run (waits on this thread).
    pub fn write(&mut self, host: &cpu::Buffer) -> Result<(), KernelError> {
        if (host.dtype(), host.len()) != (self.dtype(), self.len()) {
            return Err(KernelError::Device(format!(
                "staging {} {:?} values into a buffer of {} {:?}",
                host.len(),
                host.dtype(),
                self.len(),
                self.dtype()
            )));
        }
        let write = device_error("filling a staging buffer");
        fn fill<T: Copy + ValidAsZeroBits>(
            pinned: &mut PinnedHostSlice<T>,
            from: &[T],
        ) -> Result<(), DriverError> {
            pinned.as_mut_slice()?.copy_from_slice(from);
            Ok(())
        }
        match (self, host) {
            (Staging::F32(p), cpu::Buffer::F32(v)) => fill(p, v),
            (Staging::F64(p), cpu::Buffer::F64(v)) => fill(p, v),
            (Staging::Bf16(p), cpu::Buffer::Bf16(v)) => p.as_mut_slice().map(|to| {
                to.iter_mut()
                    .zip(v)
                    .for_each(|(to, &bits)| *to = Bf16(bits));
            }),
            _ => unreachable!("types checked above"),
        }
        .map_err(write)
    }
}

/// A point in a stream's work, for measuring how long the work between two points took.
#[derive(Debug)]
pub struct Marker(CudaEvent);

impl Marker {
    /// Waits until its stream has run the work enqueued before this marker.
    pub fn wait(&self) -> Result<(), KernelError> {
        self.0
            .synchronize()
            .map_err(device_error("waiting for a marker"))
    }

    /// Seconds of GPU time from `earlier` to this marker; waits for both to be reached.
    pub fn seconds_since(&self, earlier: &Marker) -> Result<f64, KernelError> {
        let ms = earlier
            .0
            .elapsed_ms(&self.0)
            .map_err(device_error("reading a timing event"))?;
        Ok(f64::from(ms) / 1e3)
    }
}

impl Cuda {
    /// A page-locked buffer of `len` values of `dtype` for copies in `direction`.
    pub fn staging(
        &self,
        dtype: DType,
        len: usize,
        direction: Direction,
    ) -> Result<Staging, KernelError> {
        let alloc = device_error("page-locked host memory");
        let mut staging = match dtype {
            DType::F32 => Staging::F32(pinned(self, len, direction).map_err(&alloc)?),
            DType::F64 => Staging::F64(pinned(self, len, direction).map_err(&alloc)?),
            DType::Bf16 => Staging::Bf16(pinned(self, len, direction).map_err(&alloc)?),
        };
        // Zeroed, so that nothing ever reads it uninitialised (a copy into it that a failed
        // stream skipped leaves zeros, not stale or undefined values).
        match &mut staging {
            Staging::F32(p) => p.as_mut_slice().map_err(&alloc)?.fill(0.0),
            Staging::F64(p) => p.as_mut_slice().map_err(&alloc)?.fill(0.0),
            Staging::Bf16(p) => p.as_mut_slice().map_err(&alloc)?.fill(Bf16(0)),
        }
        Ok(staging)
    }

    /// Enqueues a copy of all of `src` into `staging` (same type and length); read it with
    /// [`Staging::read`], which waits for the copy.
    pub fn stage_out(&self, s: &mut Stream, src: &Buffer, staging: &mut Staging) {
        self.enqueue(s, "copy to host", |s| {
            let stream = s.cuda_stream();
            match (src, staging) {
                (Buffer::F32(d), Staging::F32(h)) if d.len() == h.len() => {
                    stream.memcpy_dtoh(d, h)?
                }
                (Buffer::F64(d), Staging::F64(h)) if d.len() == h.len() => {
                    stream.memcpy_dtoh(d, h)?
                }
                (Buffer::Bf16(d), Staging::Bf16(h)) if d.len() == h.len() => {
                    stream.memcpy_dtoh(d, h)?
                }
                (src, staging) => {
                    return Err(mismatch(src.dtype(), src.len(), staging));
                }
            }
            Ok(())
        });
    }

    /// Enqueues a copy of `staging` into all of `dst` (same type and length).
    pub fn stage_in(&self, s: &mut Stream, staging: &Staging, dst: &mut Buffer) {
        self.enqueue(s, "copy to device", |s| {
            let stream = s.cuda_stream();
            let (dtype, len) = (dst.dtype(), dst.len());
            match (staging, dst) {
                (Staging::F32(h), Buffer::F32(d)) if d.len() == h.len() => {
                    stream.memcpy_htod(h, d)?
                }
                (Staging::F64(h), Buffer::F64(d)) if d.len() == h.len() => {
                    stream.memcpy_htod(h, d)?
                }
                (Staging::Bf16(h), Buffer::Bf16(d)) if d.len() == h.len() => {
                    stream.memcpy_htod(h, d)?
                }
                (staging, _) => return Err(mismatch(dtype, len, staging)),
            }
            Ok(())
        });
    }

    /// Enqueues `dst[..] = 0` (all of it).
    pub fn zero(&self, s: &mut Stream, dst: &mut Buffer) {
        self.enqueue(s, "zero", |s| {
            dst.memset_zeros(s.cuda_stream())?;
            Ok(())
        });
    }

    /// A marker at the current end of `s`'s work.
    pub fn mark(&self, s: &Stream) -> Result<Marker, KernelError> {
        s.cuda_stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map(Marker)
            .map_err(device_error("recording a timing event"))
    }
}

fn mismatch(dtype: DType, len: usize, staging: &Staging) -> crate::backend::Failure {
    crate::backend::Failure(format!(
        "device buffer of {len} {dtype:?} values against a staging buffer of {} {:?}",
        staging.len(),
        staging.dtype()
    ))
}
