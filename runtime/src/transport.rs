//! Moving region slices between devices. The runtime only ever sends data (never events, see
//! `analysis`), so a transport is one operation: deliver a slice to the device that owns the
//! receiving instance. This module has the in-process transport of the embedded cluster; the QUIC
//! one lives in `legion-cluster`.

use crate::analysis::OpId;
use crate::buffer::Buffer;
use crate::device::{Deliver, DeviceActor};
use crate::recycle::BufferPool;
use kameo::actor::ActorRef;
use legion_ops::partition::DeviceId;
use std::sync::{Arc, OnceLock};

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

pub trait Transport: Send + Sync + 'static {
    /// Hands a slice to the transport; it must reach device `msg.to` eventually. Never blocks.
    fn send(&self, msg: SliceMessage);
}

/// Devices in one process: a slice is moved (not copied) into the receiving actor's mailbox.
/// In a worker of a multi-process cluster the local devices are a range of the global ids, and
/// slices for the others go to `remote`.
pub struct InProcessTransport {
    first_device: DeviceId,
    devices: OnceLock<Vec<ActorRef<DeviceActor>>>,
    /// The devices' buffer pool: slices arriving from other processes are read into its buffers.
    buffers: OnceLock<Arc<BufferPool>>,
    remote: Option<Arc<dyn Transport>>,
}

impl Default for InProcessTransport {
    fn default() -> InProcessTransport {
        InProcessTransport::new()
    }
}

impl InProcessTransport {
    /// All devices of the step are in this process.
    pub fn new() -> InProcessTransport {
        InProcessTransport {
            first_device: 0,
            devices: OnceLock::new(),
            buffers: OnceLock::new(),
            remote: None,
        }
    }

    /// This process hosts the devices from `first_device` on; `remote` reaches the rest.
    pub fn with_remote(first_device: DeviceId, remote: Arc<dyn Transport>) -> InProcessTransport {
        InProcessTransport {
            first_device,
            devices: OnceLock::new(),
            buffers: OnceLock::new(),
            remote: Some(remote),
        }
    }

    /// Sets the devices, once they are spawned (they hold this transport, so it comes first), and
    /// the buffer pool they share.
    pub fn connect(&self, devices: Vec<ActorRef<DeviceActor>>, buffers: Arc<BufferPool>) {
        if self.devices.set(devices).is_err() || self.buffers.set(buffers).is_err() {
            panic!("transport connected twice");
        }
    }

    /// The buffer pool of the devices, once connected: a receiver of slices from other processes
    /// reads each into a buffer taken from it, which the device hands back after storing it.
    pub fn buffers(&self) -> Option<&Arc<BufferPool>> {
        self.buffers.get()
    }

    /// The actor of global device `device`, if it lives in this process.
    pub fn local(&self, device: DeviceId) -> Option<&ActorRef<DeviceActor>> {
        let devices = self.devices.get().expect("transport used before connect");
        device
            .checked_sub(self.first_device)
            .and_then(|i| devices.get(i))
    }
}

impl Transport for InProcessTransport {
    fn send(&self, msg: SliceMessage) {
        let to = msg.to;
        match (self.local(to), &self.remote) {
            (Some(actor), _) => {
                if let Err(e) = actor.tell(Deliver(msg)).try_send() {
                    tracing::error!(device = to, "slice not delivered: {e}");
                }
            }
            (None, Some(remote)) => remote.send(msg),
            (None, None) => tracing::error!(device = to, "no such device; slice dropped"),
        }
    }
}
