//! Region-data buffers kept across steps for reuse.
//!
//! A step moves the same slices every time. Gathering a 16 MB gradient block into a new vector
//! each step made the kernel fault in and zero 4,096 fresh pages on the actor's thread, and
//! that cost three times the copy itself. Perf of an AlexNet data-parallel profile on 4 embedded
//! devices: `clear_page_erms` took 19% of the process's samples, the memcpy 9%. Some of those
//! copies stalled for 45–60 ms.
//!
//! So a receiver hands back the buffer it has copied out of, or the instance buffer an adopted
//! one replaces, and a sender gathers into a handed-back buffer of the length it needs. Buffers
//! are matched by exact length, which suffices because a replayed step asks for the same lengths
//! every time.
//!
//! The pool is shared by the devices of one process. Its lock is taken once per buffer of at
//! least [`BufferPool::MIN_BYTES`], a few dozen times per step, never per element or per task.
//! It keeps at most its budget: the bytes one step gathers on these devices. That is what the
//! step allocates anyway, so an idle process holds no more than a running step does. Slices
//! received from other processes are read into buffers taken from the pool where one of their
//! length was handed back (the QUIC receiver asks the job's transport, `InProcessTransport::buffers`),
//! else into new ones; either way they are handed back like the rest while the budget allows,
//! and the budget is what bounds them.

use crate::buffer::Buffer;
use crate::program::{DeviceProgram, LocalOpKind};
use crate::region::DType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub struct BufferPool {
    budget: usize,
    state: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    bytes: usize,
    free: HashMap<(DType, usize), Vec<Buffer>>,
}

impl BufferPool {
    /// Smaller buffers are left to the allocator, which reuses freed chunks of that size itself.
    /// The faults came from multi-megabyte buffers, which glibc maps fresh and hands back to the
    /// OS when they are freed.
    pub const MIN_BYTES: usize = 2 << 20;

    pub fn new(budget: usize) -> BufferPool {
        BufferPool {
            budget,
            state: Mutex::new(Kept::default()),
        }
    }

    /// A pool whose budget is the bytes that `programs` gather per step into buffers of their own
    /// (sends and local copies of part of an instance), counting those of at least `MIN_BYTES`.
    pub fn for_programs(programs: &[Arc<DeviceProgram>]) -> BufferPool {
        let gathered = programs
            .iter()
            .flat_map(|p| {
                p.ops.iter().filter_map(|op| match &op.kind {
                    LocalOpKind::Send { src, rect, .. } | LocalOpKind::Copy { src, rect, .. } => {
                        let instance = &p.instances[*src as usize];
                        let bytes = rect.volume() * instance.dtype.size();
                        (instance.rect != *rect && bytes >= Self::MIN_BYTES).then_some(bytes)
                    }
                    _ => None,
                })
            })
            .sum();
        BufferPool::new(gathered)
    }

    /// An empty buffer with room for `len` elements, if one of that length was handed back.
    pub fn take(&self, dtype: DType, len: usize) -> Option<Buffer> {
        if len * dtype.size() < Self::MIN_BYTES {
            return None;
        }
        let mut kept = self.state.lock().expect("buffer pool lock");
        let mut buffer = kept.free.get_mut(&(dtype, len))?.pop()?;
        kept.bytes -= len * dtype.size();
        drop(kept);
        buffer.clear();
        Some(buffer)
    }

    /// Keeps `buffer` for a later [`take`](Self::take) of its length, if no one else holds it, it
    /// is large enough, and the budget has room.
    pub fn give(&self, buffer: Arc<Buffer>) {
        let bytes = buffer.byte_len();
        if bytes < Self::MIN_BYTES {
            return;
        }
        let Ok(buffer) = Arc::try_unwrap(buffer) else {
            return;
        };
        let mut kept = self.state.lock().expect("buffer pool lock");
        if kept.bytes + bytes > self.budget {
            return;
        }
        kept.bytes += bytes;
        kept.free
            .entry((buffer.dtype(), buffer.len()))
            .or_default()
            .push(buffer);
    }

    #[cfg(test)]
    fn kept_bytes(&self) -> usize {
        self.state.lock().expect("buffer pool lock").bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEN: usize = BufferPool::MIN_BYTES / 4;

    #[test]
    fn a_buffer_handed_back_is_taken_again_by_length_and_type() {
        let pool = BufferPool::new(1 << 30);
        let buffer = Arc::new(Buffer::F32(vec![1.0; LEN]));
        let address = buffer.f32().as_ptr();
        pool.give(buffer);
        assert_eq!(pool.kept_bytes(), 4 * LEN);
        assert!(pool.take(DType::F64, LEN).is_none());
        assert!(pool.take(DType::F32, LEN + 1).is_none());
        let again = pool.take(DType::F32, LEN).expect("the buffer handed back");
        assert_eq!(again.len(), 0, "taken buffers come back empty");
        assert_eq!(again.f32().as_ptr(), address, "the same allocation");
        assert!(pool.take(DType::F32, LEN).is_none());
        assert_eq!(pool.kept_bytes(), 0);
    }

    #[test]
    fn shared_small_and_over_budget_buffers_are_not_kept() {
        let pool = BufferPool::new(6 * LEN);
        let shared = Arc::new(Buffer::F32(vec![0.0; LEN]));
        let _other = Arc::clone(&shared);
        pool.give(shared);
        pool.give(Arc::new(Buffer::F32(vec![0.0; LEN / 2 - 1])));
        assert_eq!(pool.kept_bytes(), 0);
        pool.give(Arc::new(Buffer::F32(vec![0.0; LEN])));
        pool.give(Arc::new(Buffer::F32(vec![0.0; LEN])));
        assert_eq!(
            pool.kept_bytes(),
            4 * LEN,
            "the second would exceed 6 * LEN bytes"
        );
        assert!(pool.take(DType::F32, LEN).is_some());
        assert!(pool.take(DType::F32, LEN).is_none());
    }
}
