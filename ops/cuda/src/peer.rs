//! Slices between GPUs of one process without host memory: where two distinct GPUs have CUDA
//! peer access (NVLink, or PCIe peer-to-peer), the receiver's stream copies the sender's buffer
//! straight into its own memory (`cuMemcpyPeerAsync`, through cudarc's cross-context copy, which
//! first makes the receiving stream wait for the sender's). Logical GPUs on one device (`--gpus
//! 0,0`) and GPUs without peer access keep staging through page-locked host memory.

use crate::backend::{Cuda, Failure};
use crate::memory::{Buffer, Stream};
use cudarc::driver::sys;

impl Cuda {
    /// The CUDA ordinal of this backend's GPU.
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// Whether this GPU can copy out of `sender`'s memory directly: distinct devices whose
    /// driver reports peer access, enabled here for this context (once; enabling again is
    /// harmless). False for the same device and wherever the driver says no or fails, so the
    /// caller stages instead.
    pub fn peer_with(&self, sender: &Cuda) -> bool {
        if self.ordinal() == sender.ordinal() {
            return false;
        }
        let mut can: std::ffi::c_int = 0;
        // SAFETY: two device handles of this process's contexts; the flag is written by the call.
        let asked = unsafe {
            sys::cuDeviceCanAccessPeer(
                &raw mut can,
                self.context.cu_device(),
                sender.context.cu_device(),
            )
        };
        if asked != sys::CUresult::CUDA_SUCCESS
            || can == 0
            || self.context.bind_to_thread().is_err()
        {
            return false;
        }
        // SAFETY: this context is current on the thread (bound above); the peer is a live context.
        let enabled = unsafe { sys::cuCtxEnablePeerAccess(sender.context.cu_ctx(), 0) };
        matches!(
            enabled,
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        )
    }

    /// Whether `buffer` lives in this backend's context (a slice from another GPU does not).
    pub fn holds(&self, buffer: &Buffer) -> bool {
        let context = match buffer {
            Buffer::F32(b) => b.stream().context().cu_ctx(),
            Buffer::F64(b) => b.stream().context().cu_ctx(),
            Buffer::Bf16(b) => b.stream().context().cu_ctx(),
        };
        context == self.context.cu_ctx()
    }

    /// Enqueues on `s` a copy of the whole of `src`, a buffer of another GPU (see
    /// [`Cuda::peer_with`]), into `dst` of this one, which must be as long and of its type.
    pub fn copy_from_peer(&self, s: &mut Stream, src: &Buffer, dst: &mut Buffer) {
        self.enqueue(s, "copy_from_peer", |s| {
            match (src, dst) {
                (Buffer::F32(a), Buffer::F32(b)) if a.len() == b.len() => {
                    s.stream.memcpy_dtod(a, b)?
                }
                (Buffer::F64(a), Buffer::F64(b)) if a.len() == b.len() => {
                    s.stream.memcpy_dtod(a, b)?
                }
                (Buffer::Bf16(a), Buffer::Bf16(b)) if a.len() == b.len() => {
                    s.stream.memcpy_dtod(a, b)?
                }
                (a, b) => {
                    return Err(Failure(format!(
                        "{} {:?} values into {} {:?}",
                        a.len(),
                        a.dtype(),
                        b.len(),
                        b.dtype()
                    )));
                }
            }
            Ok(())
        });
    }
}
