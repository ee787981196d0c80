//! The CUDA backend of legion-rs.
//!
//! - [`probe`](mod@probe): what CUDA this process can use, found at run time without ever panicking.
//! - [`Cuda`]: `legion_ops::backend::Backend` on one GPU: convolutions through cuDNN, dense layers
//!   through cuBLAS SGEMM, everything else through the CUDA C++ kernels of `kernels.cu`, compiled
//!   once per process by NVRTC ([`kernels`]).
//! - [`ConvAlgos`]: the convolution-algorithm policy (`--conv-algos`): the fastest algorithm
//!   timed once per problem (the default; FFT, Winograd and atomic sums included), the fastest
//!   deterministic one that sums directly (precise), or cuDNN's heuristic.
//! - [`ConvEpilogue`]: a convolution's bias and ReLU inside cuDNN's fused convolution (the
//!   default) or in a kernel of their own (`--no-fused-epilogue`).
//! - [`StagedBatch`], [`HostBatch`]: batches staged on the device ahead of their step.
//! - [`StepGraph`]: a training step recorded as a CUDA graph and replayed (`capture`).
//! - [`Settings`]: math, those two choices, and whether buffers move between streams ([`Sharing`]).
//! - [`Staging`], [`Marker`]: page-locked host buffers and timing events, for the runtime's GPU
//!   device actors (copies to and from the host that never hold the submitting thread).
//!
//! Every library is opened at run time (cudarc's `dynamic-loading`), so this crate builds and its
//! tests pass on machines without CUDA; the tests that need a GPU print why they skipped.
//!
//! Arithmetic is strict FP32 by default, as on the CPU backend: no fast math, no TF32 (cuBLAS
//! default math, cuDNN FMA math), no FMA contraction in the kernels (`--fmad=false`), so that the
//! element-wise kernels reproduce the CPU's results bit for bit and GEMMs differ only by the
//! order of their sums; so do convolutions under `--conv-algos precise` (the default `fastest`
//! may pick FFT, Winograd or atomic-sum algorithms, which round differently). [`Math::Tf32`] (`--tf32`) lets cuBLAS and cuDNN use TF32
//! tensor cores for products and convolutions; the element-wise kernels stay strict.

mod algos;
mod backend;
mod batch_norm;
mod batches;
mod capture;
mod concat;
mod conv;
mod dense;
mod elementwise;
pub mod kernels;
mod launch;
mod memory;
mod peer;
mod pool2d;
pub mod probe;
mod regions;
mod sgd;
mod softmax_ce;
mod staging;

pub use algos::{ConvAlgos, ConvEpilogue};
pub use backend::{Cuda, Math, Settings, Sharing, StartError};
pub use batches::{HostBatch, StagedBatch};
pub use capture::StepGraph;
pub use conv::fused_epilogue_counts;
pub use memory::{Buffer, Stream};
pub use probe::{CudaDevice, ProbeError, probe};
pub use softmax_ce::PendingLoss;
pub use staging::{Direction, Marker, Staging};
