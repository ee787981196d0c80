//! legion-rs from Rust: build a model (or take one from the zoo, a JSON or an ONNX file), and
//! train it on one device, on the embedded cluster's devices, or on a cluster's workers, each
//! layer parallelised as a search or a strategy file says.
//!
//! ```no_run
//! use legion::{Data, SearchKind, Training, ZooConfig};
//!
//! let size = ZooConfig { batch: 16, image_size: 64, channels: 3, classes: 10 };
//! let model = legion::zoo("alexnet", size)?;
//! let summary = Training::new(model)
//!     .devices(4)
//!     .strategy(SearchKind::OptCnn)
//!     .data(Data::Folder("images".into()))
//!     .run(|_event| {})?;
//! # anyhow::Ok(())
//! ```
//!
//! - [`Training`] and [`job`]: the run, its options, its [`JobEvent`]s and [`TrainSummary`];
//! - [`device`]: where the steps run (`DeviceKind`), GPUs started and checked to fit;
//! - [`machine`]: the planner's model of the embedded devices or of a cluster's workers;
//! - [`model`]: models by zoo name or file; [`precision`]: what a precision means per device;
//! - [`planning`]: a strategy searched without training, and its report; [`costs`]: what the
//!   search prices tiles with, and the cache of what the devices measured.
//! - [`evaluate`]: a checkpoint's accuracy on a dataset and its top classes for images.
//!
//! The crates beneath are re-exported whole ([`ops`], [`planner`], [`runtime`], [`cluster`],
//! [`cuda`], [`onnx`]) for what this front door does not cover: writing models
//! (`ops::GraphBuilder`), the cost model and searches themselves, the engines.

pub mod costs;
pub mod device;
pub mod evaluate;
pub mod job;
pub mod machine;
pub mod model;
pub mod planning;
pub mod precision;

pub use legion_cluster as cluster;
pub use legion_cuda as cuda;
pub use legion_onnx as onnx;
pub use legion_ops as ops;
pub use legion_planner as planner;
pub use legion_runtime as runtime;

pub use device::DeviceKind;
pub use job::{
    GpuOptions, Job, JobEvent, PlannedRun, Recovered, Recovery, Rejoined, StepDone, StopSignal,
    Strategy, TrainOptions, TrainSummary, Training,
};
pub use legion_ops::data::{BatchFeed, Data, Dataset, FedBatch};
pub use legion_ops::train::Sgd;
pub use legion_ops::zoo::ZooConfig;
pub use legion_ops::{Graph, GraphBuilder, Precision, Shape};
pub use legion_planner::search::SearchKind;
pub use model::{ResolvedModel, load_model, resolve_model, zoo};

/// The README's Rust program, compiled and run as a doctest.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeProgram;
