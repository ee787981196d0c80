//! legion-runtime: a Legion-style task runtime that executes any strategy of the planner. It reads
//! strategies in the partition vocabulary of `legion_ops::partition` and does not depend on the
//! planner; its profiler, which does, is the `legion-profile` crate (`runtime/profile`).
//!
//! Map (see ARCHITECTURE.md for the invariants):
//! - `region`: logical regions (every activation, gradient, parameter, momentum, batch-norm sum)
//!   and partitions.
//! - `task`: tasks, region requirements, privileges.
//! - `mapper`: where each tile runs and which device owns each parameter slice.
//! - `lower`: graph + strategy → the tasks of one training step, in program order.
//! - `analysis`: pure dependence analysis → ops (tasks, copies, folds) with dependences.
//! - `program`: the analysed step cut into per-device programs (copies become send/recv).
//! - `plan`: builds and checks the replayable step plan.
//! - `buffer`, `exec`: instance storage and the kernels a task runs.
//! - `compute`: the cores a device's kernels run on (a pool each, or workers shared by all).
//! - `recycle`: buffers of gathered and received slices, reused across steps.
//! - `device`: the kameo device actor that runs a device's program each step.
//! - `transport`: moving slices between devices, the interface (QUIC in `legion-cluster`);
//!   `in_process`: the one between devices of one process.
//! - `embedded`: N devices in this process; the API the CLI trains with.
//! - `cpu_share`: a task's own time from its wall time on over-subscribed cores (for `profile`).
//! - `trace`: Chrome/Perfetto timeline of a real step, in the simulator's format.

pub mod analysis;
pub mod buffer;
pub mod compute;
pub mod cpu_share;
pub mod device;
pub mod embedded;
pub mod exec;
pub mod in_process;
pub mod lower;
pub mod mapper;
pub mod plan;
pub mod program;
pub mod recycle;
pub mod region;
pub mod serial;
pub mod task;
pub mod trace;
pub mod transport;
