//! legion-ops: the model API of legion-rs.
//!
//! - [`shape`]: `Shape`, `Rect` and rect copies — the coordinates every other crate speaks.
//! - [`op`]: the op catalogue (attributes, shape inference, params, FLOPs, parallel dims, projections).
//! - [`graph`]: the layer graph and its builder API; JSON model files.
//! - [`kernels`]: CPU kernels for one tile of every op (forward and backward).
//! - [`zoo`]: lenet5, alexnet, vgg16, inception_v3, resnet50.
//! - [`data`], [`checkpoint`], [`train`]: datasets, safetensors checkpoints, single-device training.
//! - [`partition`], [`strategy`], [`memory`]: what the planner and the runtime share: parallel
//!   configs and their tiles, strategy files, and what a strategy keeps in each device's memory.
//! - [`located`]: `file:line:col` positions for the text files users write.

pub mod atomic_file;
pub mod backend;
pub mod checkpoint;
pub mod data;
pub mod graph;
pub mod kernels;
pub mod located;
pub mod memory;
pub mod op;
pub mod partition;
pub mod rng;
pub mod shape;
pub mod strategy;
pub mod train;
pub mod zoo;

pub use graph::{Graph, GraphBuilder, Layer, LayerId, ModelError};
pub use op::Op;
pub use shape::{Dim, Rect, Shape};
