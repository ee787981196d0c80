//! legion-onnx: ONNX files to and from legion-rs models.
//!
//! [`import`] maps the CNN subset of ONNX (the table of [`supported_ops`]) onto a
//! [`legion_ops::Graph`], the same graph a JSON model file gives, with the softmax cross-entropy
//! loss appended, and the file's initializers as initial weights under the names the file gave
//! them. [`export`] writes a graph's inference form (every layer but the loss) with its weights.
//! The protobuf side is the ONNX schema compiled by prost ([`proto`]); this crate is only the
//! mapping.

mod export;
mod import;
#[allow(clippy::all, missing_docs)]
#[rustfmt::skip]
pub mod proto;

pub use export::{export, save};
pub use import::{ImportSummary, Imported, import, load, supported_ops};

/// What went wrong reading or writing an ONNX model: the file, where in it, and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{source_name}: {location}: {message}")]
pub struct OnnxError {
    pub source_name: String,
    /// The node (`node 3 'conv1' (Conv)`), graph input, initializer or protobuf field at fault.
    pub location: String,
    pub message: String,
}
