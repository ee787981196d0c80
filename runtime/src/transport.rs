//! Moving region slices between devices: the interface. The runtime only ever sends data (never
//! events, see `analysis`), so a transport is one operation: deliver a slice to the device that
//! owns the receiving instance. The devices hold a transport; the in-process one (`in_process`)
//! holds the devices, and the QUIC one lives in `legion-cluster`.

use crate::analysis::OpId;
use crate::buffer::Buffer;
use legion_ops::partition::DeviceId;
use std::sync::Arc;

/// The data of one copy between devices, for one step.
#[derive(Debug)]
pub struct SliceMessage {
    pub step: u64,
    /// The copy's op in the step graph; the receiver looks up its `Recv` by it.
    pub copy: OpId,
    pub to: DeviceId,
    /// The copied rect, laid out row-major. Shared, not copied, when the copy covers the sender's
    /// whole instance: in-process delivery then moves no bytes at all (the receiver adopts the
    /// buffer, and whoever writes to it next copies it first, see `device`).
    pub data: Arc<Buffer>,
}

/// The data of one copy between two devices that share a GPU: it stays in that GPU's memory. The
/// receiver's stream waits for the sender's copy into it before reading it (cudarc orders every
/// use of a buffer across the streams of one context).
pub struct GpuSliceMessage {
    pub step: u64,
    pub copy: OpId,
    pub to: DeviceId,
    pub data: legion_cuda::Buffer,
}

pub trait Transport: Send + Sync + 'static {
    /// Hands a slice to the transport; it must reach device `msg.to` eventually. Never blocks.
    fn send(&self, msg: SliceMessage);

    /// Hands a slice in GPU memory to device `msg.to`, a device of this process on the same GPU;
    /// gives it back where this transport cannot (the sender then stages it through the host).
    fn send_on_gpu(&self, msg: GpuSliceMessage) -> Result<(), GpuSliceMessage> {
        Err(msg)
    }
}
