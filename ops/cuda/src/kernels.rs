//! The CUDA C++ kernels (`kernels.cu`), compiled to PTX by NVRTC once per process and loaded into
//! a context as [`Kernels`].

use crate::probe::{Library, ProbeError, require};
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use std::sync::{Arc, OnceLock};

/// The kernel source, compiled at run time.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C"` kernel of [`SOURCE`].
pub const KERNEL_NAMES: &[&str] = &[
    "copy_region_f32",
    "copy_region_f64",
    "add_region_f32",
    "add_region_f64",
    "zero_region_f32",
    "zero_region_f64",
    "add_runs_f32",
    "add_runs_f64",
    "relu_forward",
    "relu_backward",
    "sigmoid_forward",
    "sigmoid_backward",
    "tanh_forward",
    "tanh_backward",
    "add_forward",
    "bias_activation",
    "channel_sum",
    "dropout_apply",
    "store_step",
    "synthetic_draw",
    "pool2d_forward",
    "pool2d_argmax",
    "pool2d_backward",
    "softmax_ce_rows",
    "loss_totals",
    "softmax_ce_backward",
    "bn_moments",
    "bn_sums_finish",
    "bn_affine",
    "bn_normalize",
    "bn_running",
    "bn_grad_sums",
    "bn_grad_sums_finish",
    "bn_input_coef",
    "bn_input_grad",
    "sgd_update",
];

/// Threads of the reduction kernels' blocks (`REDUCE_THREADS` in the source).
pub const REDUCE_THREADS: u32 = 256;
/// Sample rows per block of the softmax kernels: one warp each (`WARP_ROWS_PER_BLOCK`).
pub const WARP_ROWS_PER_BLOCK: u32 = 8;

/// Strict IEEE FP32, as the CPU computes: no fast math, no flush of denormals, correctly rounded
/// division and square root, and no contraction of a multiply and an add into an FMA (Rust never
/// contracts, so element-wise kernels reproduce the CPU's results bit for bit).
fn options() -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        use_fast_math: Some(false),
        name: Some("legion_kernels.cu".to_string()),
        ..Default::default()
    }
}

/// Why the kernels could not be made ready.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Missing(#[from] ProbeError),
    #[error("NVRTC rejected the CUDA kernels: {0}")]
    Nvrtc(String),
    #[error("the CUDA driver could not load the kernels: {0}")]
    Load(String),
}

/// The PTX of [`SOURCE`], compiled on first use and kept for the process (compiling takes about a
/// second; every context loads the same PTX).
pub fn ptx() -> Result<&'static str, CompileError> {
    static PTX: OnceLock<Result<String, CompileError>> = OnceLock::new();
    PTX.get_or_init(|| {
        require(Library::Nvrtc)?;
        let ptx = compile_ptx_with_opts(SOURCE, options())
            .map_err(|e| CompileError::Nvrtc(describe_compile_error(&e)))?;
        Ok(ptx.to_src())
    })
    .as_ref()
    .map(String::as_str)
    .map_err(Clone::clone)
}

/// The compiler's log, which is what says where the source is wrong.
fn describe_compile_error(error: &cudarc::nvrtc::CompileError) -> String {
    match error {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => other.to_string(),
    }
}

/// The kernels, loaded into one context.
#[derive(Debug)]
pub struct Kernels {
    pub copy_region_f32: CudaFunction,
    pub copy_region_f64: CudaFunction,
    pub add_region_f32: CudaFunction,
    pub add_region_f64: CudaFunction,
    pub zero_region_f32: CudaFunction,
    pub zero_region_f64: CudaFunction,
    pub add_runs_f32: CudaFunction,
    pub add_runs_f64: CudaFunction,
    pub relu_forward: CudaFunction,
    pub relu_backward: CudaFunction,
    pub sigmoid_forward: CudaFunction,
    pub sigmoid_backward: CudaFunction,
    pub tanh_forward: CudaFunction,
    pub tanh_backward: CudaFunction,
    pub add_forward: CudaFunction,
    pub bias_activation: CudaFunction,
    pub channel_sum: CudaFunction,
    pub dropout_apply: CudaFunction,
    pub store_step: CudaFunction,
    pub synthetic_draw: CudaFunction,
    pub pool2d_forward: CudaFunction,
    pub pool2d_argmax: CudaFunction,
    pub pool2d_backward: CudaFunction,
    pub softmax_ce_rows: CudaFunction,
    pub loss_totals: CudaFunction,
    pub softmax_ce_backward: CudaFunction,
    pub bn_moments: CudaFunction,
    pub bn_sums_finish: CudaFunction,
    pub bn_affine: CudaFunction,
    pub bn_normalize: CudaFunction,
    pub bn_running: CudaFunction,
    pub bn_grad_sums: CudaFunction,
    pub bn_grad_sums_finish: CudaFunction,
    pub bn_input_coef: CudaFunction,
    pub bn_input_grad: CudaFunction,
    pub sgd_update: CudaFunction,
}

impl Kernels {
    pub fn load(context: &Arc<CudaContext>) -> Result<Kernels, CompileError> {
        let module = context
            .load_module(Ptx::from_src(ptx()?))
            .map_err(|e| CompileError::Load(e.to_string()))?;
        let f = |name: &str| -> Result<CudaFunction, CompileError> {
            module
                .load_function(name)
                .map_err(|e: DriverError| CompileError::Load(format!("{name}: {e}")))
        };
        Ok(Kernels {
            copy_region_f32: f("copy_region_f32")?,
            copy_region_f64: f("copy_region_f64")?,
            add_region_f32: f("add_region_f32")?,
            add_region_f64: f("add_region_f64")?,
            zero_region_f32: f("zero_region_f32")?,
            zero_region_f64: f("zero_region_f64")?,
            add_runs_f32: f("add_runs_f32")?,
            add_runs_f64: f("add_runs_f64")?,
            relu_forward: f("relu_forward")?,
            relu_backward: f("relu_backward")?,
            sigmoid_forward: f("sigmoid_forward")?,
            sigmoid_backward: f("sigmoid_backward")?,
            tanh_forward: f("tanh_forward")?,
            tanh_backward: f("tanh_backward")?,
            add_forward: f("add_forward")?,
            bias_activation: f("bias_activation")?,
            channel_sum: f("channel_sum")?,
            dropout_apply: f("dropout_apply")?,
            store_step: f("store_step")?,
            synthetic_draw: f("synthetic_draw")?,
            pool2d_forward: f("pool2d_forward")?,
            pool2d_argmax: f("pool2d_argmax")?,
            pool2d_backward: f("pool2d_backward")?,
            softmax_ce_rows: f("softmax_ce_rows")?,
            loss_totals: f("loss_totals")?,
            softmax_ce_backward: f("softmax_ce_backward")?,
            bn_moments: f("bn_moments")?,
            bn_sums_finish: f("bn_sums_finish")?,
            bn_affine: f("bn_affine")?,
            bn_normalize: f("bn_normalize")?,
            bn_running: f("bn_running")?,
            bn_grad_sums: f("bn_grad_sums")?,
            bn_grad_sums_finish: f("bn_grad_sums_finish")?,
            bn_input_coef: f("bn_input_coef")?,
            bn_input_grad: f("bn_input_grad")?,
            sgd_update: f("sgd_update")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::nvrtc_version;
    use legion_ops::require::{Need, skip};

    #[test]
    fn every_kernel_source_compiles_to_ptx() {
        if let Err(missing) = require(Library::Nvrtc) {
            return skip(Need::Nvrtc, missing);
        }
        let (major, minor) = nvrtc_version().expect("NVRTC version");
        let ptx = match ptx() {
            Ok(ptx) => ptx,
            Err(error) => panic!("{error}"),
        };
        for name in KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the PTX"
            );
        }
        let entries = ptx.matches(".entry ").count();
        assert_eq!(entries, KERNEL_NAMES.len(), "KERNEL_NAMES is out of date");
        let target = ptx
            .lines()
            .find(|line| line.starts_with(".target"))
            .unwrap_or("?");
        println!(
            "NVRTC {major}.{minor} compiled {entries} kernels ({} bytes of PTX, {target})",
            ptx.len()
        );
    }
}
