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

/// A slice that stays in the memory of a device the sender shares with its receiver (two devices
/// of this process on one GPU). Opaque to transports: only the device drivers read it. The
/// receiver's stream waits for the sender's copy into it before reading it (cudarc orders every
/// use of a buffer across the streams of one context).
pub struct DeviceSlice(pub(crate) legion_cuda::Buffer);

impl DeviceSlice {
    pub(crate) fn shape(&self) -> (legion_ops::backend::DType, usize) {
        (self.0.dtype(), self.0.len())
    }
}

/// The data of one copy between two devices that share device memory.
pub struct DeviceSliceMessage {
    pub step: u64,
    pub copy: OpId,
    pub to: DeviceId,
    pub data: DeviceSlice,
}

pub trait Transport: Send + Sync + 'static {
    /// Hands a slice to the transport; it must reach device `msg.to` eventually. Never blocks.
    fn send(&self, msg: SliceMessage);

    /// Hands a slice in device memory to device `msg.to`, a device of this process that shares
    /// that memory; gives it back where this transport cannot reach such a device.
    fn send_in_device_memory(&self, msg: DeviceSliceMessage) -> Result<(), DeviceSliceMessage> {
        Err(msg)
    }
}

/// The data of a slice as it reaches a device: host memory, or (between devices sharing a GPU)
/// that GPU's memory.
pub enum SliceData {
    Host(Arc<Buffer>),
    Device(DeviceSlice),
}

impl SliceData {
    /// Element type and length.
    pub(crate) fn shape(&self) -> (legion_ops::backend::DType, usize) {
        match self {
            SliceData::Host(b) => (b.dtype(), b.len()),
            SliceData::Device(b) => b.shape(),
        }
    }
}
