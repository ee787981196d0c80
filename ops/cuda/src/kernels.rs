//! The CUDA C++ kernels (`kernels.cu`), compiled to PTX by NVRTC once per process and loaded into
//! a context as [`Kernels`].

use crate::probe::{Library, ProbeError, require};
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use legion_ops::backend::DType;
use legion_ops::op::Unary;
use std::sync::{Arc, OnceLock};

/// The kernel source, compiled at run time.
pub const SOURCE: &str = include_str!("kernels.cu");

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

/// The forward and backward kernels of an element-wise unary op (`kernels.cu`'s `UNARY_OPS`).
#[derive(Debug)]
pub struct UnaryKernels {
    pub forward: Twin,
    pub backward: Twin,
}

impl Kernels {
    /// The kernels of `op`.
    pub fn unary(&self, op: Unary) -> &UnaryKernels {
        &self.unary[op.index()]
    }
}

/// [`Kernels`] (a field per kernel of [`SOURCE`]: a [`Twin`] for those with a bf16 twin), their
/// loading, [`KERNEL_NAMES`] and [`BF16_TWINS`], all from the one list below.
macro_rules! kernels {
    ($($name:ident: $kind:ident,)*) => {
        /// The kernels, loaded into one context ([`Kernels::load`]).
        #[derive(Debug)]
        pub struct Kernels {
            $(pub $name: kernels!(@type $kind),)*
            /// The element-wise unary ops' kernels, in the order of `Unary::ALL`
            /// ([`Kernels::unary`]).
            unary: Vec<UnaryKernels>,
        }

        /// Every `extern "C"` kernel of [`SOURCE`] but the bf16 twins (`{name}_bf16` of
        /// [`BF16_TWINS`]) and the unary ops' ([`UnaryKernels`]), in source order.
        pub const KERNEL_NAMES: &[&str] = &[$(stringify!($name)),*];

        /// The kernels that read or write activations, each with a twin `{name}_bf16` that
        /// stores them in bf16 (the same template in `kernels.cu`, instantiated for both types).
        pub const BF16_TWINS: &[&str] = &kernels!(@twins [] $($name: $kind,)*);

        impl Kernels {
            pub fn load(context: &Arc<CudaContext>) -> Result<Kernels, CompileError> {
                let module = context
                    .load_module(Ptx::from_src(ptx()?))
                    .map_err(|e| CompileError::Load(e.to_string()))?;
                let one = |name: &str| -> Result<CudaFunction, CompileError> {
                    module
                        .load_function(name)
                        .map_err(|e: DriverError| CompileError::Load(format!("{name}: {e}")))
                };
                let twin = |name: &str| -> Result<Twin, CompileError> {
                    Ok(Twin {
                        f32: one(name)?,
                        bf16: one(&format!("{name}_bf16"))?,
                    })
                };
                let unary = Unary::ALL
                    .iter()
                    .map(|op| {
                        let (forward, backward) = op.kernel_names();
                        Ok(UnaryKernels {
                            forward: twin(forward)?,
                            backward: twin(backward)?,
                        })
                    })
                    .collect::<Result<_, CompileError>>()?;
                Ok(Kernels {
                    $($name: kernels!(@load $kind, one, twin, stringify!($name))?,)*
                    unary,
                })
            }
        }
    };
    (@type one) => { CudaFunction };
    (@type twin) => { Twin };
    (@load one, $one:ident, $twin:ident, $name:expr) => { $one($name) };
    (@load twin, $one:ident, $twin:ident, $name:expr) => { $twin($name) };
    (@twins [$($t:expr),*]) => { [$($t),*] };
    (@twins [$($t:expr),*] $name:ident: twin, $($rest:tt)*) => {
        kernels!(@twins [$($t,)* stringify!($name)] $($rest)*)
    };
    (@twins [$($t:expr),*] $name:ident: one, $($rest:tt)*) => {
        kernels!(@twins [$($t),*] $($rest)*)
    };
}

kernels! {
    copy_region_f32: one,
    copy_region_f64: one,
    copy_region_bf16: one,
    add_region_f32: one,
    add_region_f64: one,
    add_region_bf16: one,
    zero_region_f32: one,
    zero_region_f64: one,
    zero_region_bf16: one,
    add_runs_f32: one,
    add_runs_f64: one,
    add_runs_bf16: one,
    cast_f32_bf16: one,
    cast_bf16_f32: one,
    relu_forward: twin,
    relu_backward: twin,
    add_forward: twin,
    mul_forward: twin,
    mul_scale_grad: twin,
    bias_activation: twin,
    bias_activation_rows: twin,
    channel_sum: twin,
    channel_sum_finish: one,
    dropout_apply: twin,
    store_step: one,
    synthetic_draw: one,
    pool2d_forward: twin,
    pool2d_argmax: twin,
    pool2d_backward: twin,
    softmax_ce_rows: twin,
    loss_totals: one,
    softmax_ce_backward: twin,
    bn_moments: twin,
    bn_sums_finish: one,
    bn_affine: one,
    bn_affine_running: one,
    bn_normalize: twin,
    bn_running: one,
    bn_grad_sums: twin,
    bn_grad_sums_finish: one,
    bn_input_coef: one,
    bn_input_grad: twin,
    bn_normalize_rows: twin,
    bn_input_grad_rows: twin,
    sgd_update: one,
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
        let unary = Unary::ALL.iter().flat_map(|op| {
            let (forward, backward) = op.kernel_names();
            [forward, backward]
        });
        let twins = BF16_TWINS
            .iter()
            .copied()
            .chain(unary.clone())
            .map(|name| format!("{name}_bf16"));
        let names: Vec<String> = KERNEL_NAMES
            .iter()
            .copied()
            .chain(unary)
            .map(str::to_string)
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
