//! The in-process transport of the embedded cluster and of a worker's local devices: a slice is
//! moved (not copied) into the receiving device actor's mailbox.

use crate::device::{Deliver, DeviceActor};
use crate::recycle::BufferPool;
use crate::transport::{DeviceSliceMessage, SliceData, SliceMessage, Transport};
use kameo::actor::ActorRef;
use legion_ops::partition::DeviceId;
use std::sync::{Arc, OnceLock};

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
                let deliver = Deliver {
                    step: msg.step,
                    copy: msg.copy,
                    data: SliceData::Host(msg.data),
                };
                if let Err(e) = actor.tell(deliver).try_send() {
                    tracing::error!(device = to, "slice not delivered: {e}");
                }
            }
            (None, Some(remote)) => remote.send(msg),
            (None, None) => tracing::error!(device = to, "no such device; slice dropped"),
        }
    }

    fn send_in_device_memory(&self, msg: DeviceSliceMessage) -> Result<(), DeviceSliceMessage> {
        let Some(actor) = self.local(msg.to) else {
            return Err(msg);
        };
        let deliver = Deliver {
            step: msg.step,
            copy: msg.copy,
            data: SliceData::Device(msg.data),
        };
        if let Err(e) = actor.tell(deliver).try_send() {
            tracing::error!("slice not delivered: {e}");
        }
        Ok(())
    }
}
