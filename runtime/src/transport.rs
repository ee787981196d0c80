//! Moving region slices between devices. The runtime only ever sends data (never events, see
//! `analysis`), so a transport is one operation: deliver a slice to the device that owns the
//! receiving instance. This module has the in-process transport of the embedded cluster; the QUIC
//! one lives in `legion-cluster`.

use crate::analysis::OpId;
use crate::buffer::Buffer;
use crate::device::{Deliver, DeviceActor};
use kameo::actor::ActorRef;
use legion_planner::DeviceId;
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
#[derive(Default)]
pub struct InProcessTransport {
    devices: OnceLock<Vec<ActorRef<DeviceActor>>>,
}

impl InProcessTransport {
    pub fn new() -> InProcessTransport {
        InProcessTransport::default()
    }

    /// Sets the devices, once they are spawned (they hold this transport, so it comes first).
    pub fn connect(&self, devices: Vec<ActorRef<DeviceActor>>) {
        if self.devices.set(devices).is_err() {
            panic!("transport connected twice");
        }
    }
}

impl Transport for InProcessTransport {
    fn send(&self, msg: SliceMessage) {
        let devices = self.devices.get().expect("transport used before connect");
        let to = msg.to;
        if let Err(e) = devices[to].tell(Deliver(msg)).try_send() {
            tracing::error!(device = to, "slice not delivered: {e}");
        }
    }
}
