//! legion-runtime: a Legion-style task runtime that executes any strategy given in the partition
//! vocabulary of `legion_ops::partition`. It does not depend on the planner. See ARCHITECTURE.md
//! for the map, the invariants and the API boundaries.

// The decision logic: pure and public, so that tests and the planner's simulator can check it.
pub mod analysis;
pub mod lower;
pub mod mapper;
pub mod plan;
pub mod program;
pub mod region;
pub mod task;

// The shell that drives it (actors, pools, transports): private, with its API re-exported here.
mod buffer;
mod compute;
mod cpu_share;
mod device;
mod embedded;
mod exec;
mod in_process;
mod moves;
mod recycle;
mod serial;
mod trace;
mod transport;

pub use buffer::Buffer;
pub use compute::shares_workers;
pub use cpu_share::{CpuMeter, CpuSpan, RuntimeThreadsCpu, StepCpu, alone_seconds, process_cpu_s};
pub use device::{DeviceActor, Load, OpEvent, Piece, ReadInstance, StepReport};
pub use embedded::{
    EmbeddedCluster, Launch, Placement, RuntimeError, StepResult, actor_threads, check_batch,
    device_runtime, initial_instances, run_step, spawn_devices, spawn_local_devices,
    threads_per_device,
};
pub use exec::{BatchView, ExecContext, StepInput, TaskOutcome, enqueue, execute};
pub use in_process::InProcessTransport;
pub use legion_ops::partition::gpu_of;
pub use serial::SerialMemory;
pub use trace::{chrome_trace, send_ends};
pub use transport::{DeviceSlice, DeviceSliceMessage, SliceMessage, Transport};
