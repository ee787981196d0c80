//! legion-ops: the model API of legion-rs and the vocabulary every other crate speaks: shapes and
//! rects, the op catalogue, graphs and their JSON files, the partition vocabulary and strategy
//! files, the kernel seam (`backend`) with its CPU backend, and the single-device reference trainer.
//! See ARCHITECTURE.md for the code map, the invariants and how to add an op.

pub mod atomic_file;
pub mod backend;
pub mod capture;
pub mod checkpoint;
pub mod data;
pub mod fast_hash;
pub mod graph;
pub mod infer;
pub mod kernels;
pub mod located;
pub mod memory;
pub mod op;
pub mod partition;
pub mod precision;
pub mod require;
pub mod rng;
pub mod shape;
pub mod strategy;
pub mod train;
pub mod zoo;

pub use graph::{Graph, GraphBuilder, Layer, LayerId, ModelError};
pub use op::Op;
pub use precision::Precision;
pub use shape::{Dim, Rect, Shape};
