//! The CUDA C++ kernels (`kernels.cu`), compiled to PTX by NVRTC once per process and loaded into
//! a context as [`Kernels`].

use crate::probe::{Library, ProbeError, require};
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use legion_ops::backend::DType;
use std::sync::{Arc, OnceLock};

/// The kernel source, compiled at run time.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C"` kernel of [`SOURCE`] but the bf16 twins of [`BF16_TWINS`].
pub const KERNEL_NAMES: &[&str] = &[
    "copy_region_f32",
    "copy_region_f64",
    "copy_region_bf16",
    "add_region_f32",
    "add_region_f64",
    "add_region_bf16",
    "zero_region_f32",
    "zero_region_f64",
    "zero_region_bf16",
    "add_runs_f32",
    "add_runs_f64",
    "add_runs_bf16",
    "cast_f32_bf16",
    "cast_bf16_f32",
    "relu_forward",
    "relu_backward",
    "sigmoid_forward",
    "sigmoid_backward",
    "tanh_forward",
    "tanh_backward",
    "add_forward",
    "bias_activation",
    "bias_activation_rows",
    "channel_sum",
    "channel_sum_finish",
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

/// The kernels that read or write activations, each with a twin `{name}_bf16` that stores them
/// in bf16 (the same template in `kernels.cu`, instantiated for both types).
pub const BF16_TWINS: &[&str] = &[
    "relu_forward",
    "relu_backward",
    "sigmoid_forward",
    "sigmoid_backward",
    "tanh_forward",
    "tanh_backward",
    "add_forward",
    "bias_activation",
    "bias_activation_rows",
    "channel_sum",
    "dropout_apply",
    "pool2d_forward",
    "pool2d_argmax",
    "pool2d_backward",
    "softmax_ce_rows",
    "softmax_ce_backward",
    "bn_moments",
    "bn_normalize",
    "bn_grad_sums",
    "bn_input_grad",
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

/// A kernel over activations in both element types: the f32 one and its bf16 twin.
#[derive(Debug)]
pub struct Twin {
    pub f32: CudaFunction,
    pub bf16: CudaFunction,
}

impl Twin {
    /// The kernel for activations of `dtype` (f32 or bf16; no kernel stores activations in f64).
    pub fn of(&self, dtype: DType) -> &CudaFunction {
        match dtype {
            DType::F32 => &self.f32,
            DType::Bf16 => &self.bf16,
            DType::F64 => panic!("no activation kernel stores f64"),
        }
    }
}

/// The kernels, loaded into one context.
#[derive(Debug)]
pub struct Kernels {
    pub copy_region_f32: CudaFunction,
    pub copy_region_f64: CudaFunction,
    pub copy_region_bf16: CudaFunction,
    pub add_region_f32: CudaFunction,
    pub add_region_f64: CudaFunction,
    pub add_region_bf16: CudaFunction,
    pub zero_region_f32: CudaFunction,
    pub zero_region_f64: CudaFunction,
    pub zero_region_bf16: CudaFunction,
    pub add_runs_f32: CudaFunction,
    pub add_runs_f64: CudaFunction,
    pub add_runs_bf16: CudaFunction,
    pub cast_f32_bf16: CudaFunction,
    pub cast_bf16_f32: CudaFunction,
    pub relu_forward: Twin,
    pub relu_backward: Twin,
    pub sigmoid_forward: Twin,
    pub sigmoid_backward: Twin,
    pub tanh_forward: Twin,
    pub tanh_backward: Twin,
    pub add_forward: Twin,
    pub bias_activation: Twin,
    pub bias_activation_rows: Twin,
    pub channel_sum: Twin,
    pub channel_sum_finish: CudaFunction,
    pub dropout_apply: Twin,
    pub store_step: CudaFunction,
    pub synthetic_draw: CudaFunction,
    pub pool2d_forward: Twin,
    pub pool2d_argmax: Twin,
    pub pool2d_backward: Twin,
    pub softmax_ce_rows: Twin,
    pub loss_totals: CudaFunction,
    pub softmax_ce_backward: Twin,
    pub bn_moments: Twin,
    pub bn_sums_finish: CudaFunction,
    pub bn_affine: CudaFunction,
    pub bn_normalize: Twin,
    pub bn_running: CudaFunction,
    pub bn_grad_sums: Twin,
    pub bn_grad_sums_finish: CudaFunction,
    pub bn_input_coef: CudaFunction,
    pub bn_input_grad: Twin,
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
        let twin = |name: &str| -> Result<Twin, CompileError> {
            Ok(Twin {
                f32: f(name)?,
                bf16: f(&format!("{name}_bf16"))?,
            })
        };
        Ok(Kernels {
            copy_region_f32: f("copy_region_f32")?,
            copy_region_f64: f("copy_region_f64")?,
            copy_region_bf16: f("copy_region_bf16")?,
            add_region_f32: f("add_region_f32")?,
            add_region_f64: f("add_region_f64")?,
            add_region_bf16: f("add_region_bf16")?,
            zero_region_f32: f("zero_region_f32")?,
            zero_region_f64: f("zero_region_f64")?,
            zero_region_bf16: f("zero_region_bf16")?,
            add_runs_f32: f("add_runs_f32")?,
            add_runs_f64: f("add_runs_f64")?,
            add_runs_bf16: f("add_runs_bf16")?,
            cast_f32_bf16: f("cast_f32_bf16")?,
            cast_bf16_f32: f("cast_bf16_f32")?,
            relu_forward: twin("relu_forward")?,
            relu_backward: twin("relu_backward")?,
            sigmoid_forward: twin("sigmoid_forward")?,
            sigmoid_backward: twin("sigmoid_backward")?,
            tanh_forward: twin("tanh_forward")?,
            tanh_backward: twin("tanh_backward")?,
            add_forward: twin("add_forward")?,
            bias_activation: twin("bias_activation")?,
            bias_activation_rows: twin("bias_activation_rows")?,
            channel_sum: twin("channel_sum")?,
            channel_sum_finish: f("channel_sum_finish")?,
            dropout_apply: twin("dropout_apply")?,
            store_step: f("store_step")?,
            synthetic_draw: f("synthetic_draw")?,
            pool2d_forward: twin("pool2d_forward")?,
            pool2d_argmax: twin("pool2d_argmax")?,
            pool2d_backward: twin("pool2d_backward")?,
            softmax_ce_rows: twin("softmax_ce_rows")?,
            loss_totals: f("loss_totals")?,
            softmax_ce_backward: twin("softmax_ce_backward")?,
            bn_moments: twin("bn_moments")?,
            bn_sums_finish: f("bn_sums_finish")?,
            bn_affine: f("bn_affine")?,
            bn_normalize: twin("bn_normalize")?,
            bn_running: f("bn_running")?,
            bn_grad_sums: twin("bn_grad_sums")?,
            bn_grad_sums_finish: f("bn_grad_sums_finish")?,
            bn_input_coef: f("bn_input_coef")?,
            bn_input_grad: twin("bn_input_grad")?,
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
        let twins = BF16_TWINS.iter().map(|name| format!("{name}_bf16"));
        let names: Vec<String> = KERNEL_NAMES
            .iter()
            .map(|n| n.to_string())
            .chain(twins)
            .collect();
        for name in &names {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the PTX"
            );
        }
        let entries = ptx.matches(".entry ").count();
        assert_eq!(
            entries,
            names.len(),
            "KERNEL_NAMES or BF16_TWINS is out of date"
        );
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
