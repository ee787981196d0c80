//! legion-planner: machine model, parallel configurations, the OptCNN cost model, strategy searches
//! and a simulator. Everything here is deterministic and free of I/O except the clearly named
//! `load`/`save` functions.
//!
//! - [`machine`], [`machine_presets`], [`machine_file`]: devices, nodes and links; the named
//!   machines and the flags' machine; TOML files.
//! - [`runtime_costs`]: what the runtime's own work costs (dispatch, folds, updates, copies), as
//!   profiled, for the simulator.
//! - [`config`]: [`ParallelConfig`], the tile split [`tile_rect`] (shared with the runtime) and the
//!   enumeration of a layer's configs.
//! - [`provider`], [`profile`]: compute times (t_c) — roofline or measured.
//! - [`transfer`], [`sync`]: the t_x and t_s models (the runtime implements the same schemes).
//! - [`cost`]: Eq. 1 for any strategy; [`tables`]: the same as per-config tables for the searches.
//! - [`search`]: OptCNN (Algorithm 1), exhaustive, data / model / OWT baselines, and the planners
//!   of SOYBEAN, Tofu, HyPar and Spartan, each under its own paper's byte count.
//! - [`simulate`], [`trace`]: a list-scheduled task graph of one iteration and its Chrome trace.
//! - [`memory`]: what each device holds during a step against what the machine's devices hold.
//! - [`strategy`]: strategy files; [`plan`]: what `legion-rs plan` runs (its tables and JSON are
//!   the CLI's); [`progress`]: what a long plan reports while it runs.

pub mod config;
pub mod cost;
// where the planner's own lookup tables take their hasher from
use legion_ops::fast_hash;
pub mod machine;
pub mod machine_file;
pub mod machine_presets;
pub mod memory;
pub mod plan;
pub mod profile;
pub mod progress;
pub mod provider;
pub mod runtime_costs;
pub mod search;
pub mod simulate;
/// Strategy files, the planner's output, live beside the partition vocabulary in `legion_ops`.
pub use legion_ops::strategy;
pub mod sync;
pub mod tables;
pub mod trace;
pub mod transfer;
mod transfer_table;

pub use config::{ConfigSpace, ParallelConfig, block_range, tile_rect};
pub use cost::{CostBreakdown, CostModel};
pub use machine::{DeviceId, DeviceSpec, Link, MachineModel, NetworkCpu};
pub use profile::{LinkProfile, ProfileDb, ProfiledCost};
pub use provider::{CostProvider, PhaseTimes, RooflineCost};
pub use search::SearchKind;
pub use strategy::Strategy;
pub use tables::{CostTables, SearchSpace};
