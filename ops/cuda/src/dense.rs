//! Dense layers through cuBLAS: SGEMM on f32 operands; in a bf16 run `cublasGemmEx` on bf16
//! operands (the activations and the weight's working copy) with fp32 accumulation
//! (`CUBLAS_COMPUTE_32F`, tensor cores), writing bf16 activations and the fp32 weight gradient.
//!
//! cuBLAS is column-major: a row-major `R × C` matrix is its column-major transpose `C × R`, with
//! leading dimension `C`. Each product below is written for the transposes, which keeps every
//! operand where it lies (no copies).

use crate::backend::{Cuda, Launch};
use crate::launch::Box4;
use crate::memory::{Bf16, Buffer, Stream, same_type};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::sys::{self as cublas_sys, cudaDataType_t};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use legion_ops::backend::{DType, In, Out};
use legion_ops::op::{Activation, Dense};
use std::ffi::c_int;

/// Sizes of a tile and where its rows sit in the input and weight views.
struct Tile {
    samples: usize,
    features: usize,
    inputs: usize,
    /// Row of the tile's first sample within the input view.
    first_row: usize,
    /// Row of the tile's first feature within the weight view.
    first_feature: usize,
}

impl Tile {
    fn new(x: &In<Buffer>, w: &In<Buffer>, tile: &legion_ops::Rect) -> Tile {
        assert_eq!(x.rect.ndim(), 2, "dense input is NC");
        assert_eq!(x.rect.lo[1], 0, "the input view holds whole input rows");
        assert!(
            x.rect.lo[0] <= tile.lo[0] && tile.hi[0] <= x.rect.hi[0],
            "input view {} does not contain the samples of output tile {tile}",
            x.rect
        );
        assert!(
            w.rect.lo[0] <= tile.lo[1] && tile.hi[1] <= w.rect.hi[0],
            "weight view {} does not cover the features of output tile {tile}",
            w.rect
        );
        Tile {
            samples: tile.extent(0),
            features: tile.extent(1),
            inputs: x.rect.extent(1),
            first_row: tile.lo[0] - x.rect.lo[0],
            first_feature: tile.lo[1] - w.rect.lo[0],
        }
    }

    fn is_empty(&self) -> bool {
        self.samples == 0 || self.features == 0 || self.inputs == 0
    }

    fn x_rows(&self) -> std::ops::Range<usize> {
        self.first_row * self.inputs..(self.first_row + self.samples) * self.inputs
    }

    fn w_rows(&self) -> std::ops::Range<usize> {
        self.first_feature * self.inputs..(self.first_feature + self.features) * self.inputs
    }
}

fn gemm(
    transa: cudarc::cublas::sys::cublasOperation_t,
    transb: cudarc::cublas::sys::cublasOperation_t,
    (m, n, k): (usize, usize, usize),
    (lda, ldb, ldc): (usize, usize, usize),
) -> GemmConfig<f32> {
    GemmConfig {
        transa,
        transb,
        m: m as c_int,
        n: n as c_int,
        k: k as c_int,
        alpha: 1.0,
        lda: lda as c_int,
        ldb: ldb as c_int,
        beta: 0.0,
        ldc: ldc as c_int,
    }
}

/// The element type cuBLAS writes a bf16 product into.
trait ProductOut {
    const TYPE: cudaDataType_t;
}
impl ProductOut for f32 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}
impl ProductOut for Bf16 {
    const TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

/// `C = op(A)·op(B)` as `cfg` describes it, on bf16 operands with fp32 accumulation (tensor
/// cores), into a bf16 or f32 `C`.
///
/// # Safety
/// The sizes and leading dimensions of `cfg` must describe exactly the three buffers.
unsafe fn gemm_bf16<C: ProductOut>(
    s: &Stream,
    cfg: &GemmConfig<f32>,
    a: &impl DevicePtr<Bf16>,
    b: &impl DevicePtr<Bf16>,
    c: &mut impl DevicePtrMut<C>,
) -> Launch {
    let (a, _a_used) = a.device_ptr(&s.stream);
    let (b, _b_used) = b.device_ptr(&s.stream);
    let (c, _c_used) = c.device_ptr_mut(&s.stream);
    // SAFETY: live pointers of the sizes the caller vouches for; α and β are f32 as
    // CUBLAS_COMPUTE_32F reads them.
    unsafe {
        cublas_sys::cublasGemmEx(
            *s.blas.handle(),
            cfg.transa,
            cfg.transb,
            cfg.m,
            cfg.n,
            cfg.k,
            (&raw const cfg.alpha).cast(),
            a as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            cfg.lda,
            b as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            cfg.ldb,
            (&raw const cfg.beta).cast(),
            c as *mut std::ffi::c_void,
            C::TYPE,
            cfg.ldc,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .result()?;
    Ok(())
}

/// `y = x · Wᵀ + b`, then the fused activation: column-major `yᵀ (F × S) = W (F × I) · xᵀ`.
pub(crate) fn forward(
    cuda: &Cuda,
    s: &mut Stream,
    op: &Dense,
    x: In<Buffer>,
    w: In<Buffer>,
    b: Option<In<Buffer>>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Tile::new(&x, &w, &y.rect);
    let tile_box = Box4::of(&y.rect);
    let dtype = same_type(&[x.mem.dtype(), w.mem.dtype(), y.mem.dtype()]);
    if tile.samples == 0 || tile.features == 0 {
        return Ok(());
    }
    let cfg = gemm(
        CUBLAS_OP_T,
        CUBLAS_OP_N,
        (tile.features, tile.samples, tile.inputs),
        (tile.inputs, tile.inputs, tile.features),
    );
    match (tile.inputs, dtype) {
        (0, _) => y.mem.memset_zeros(&s.stream)?,
        (_, DType::Bf16) => {
            let x_rows = x.mem.bf16().slice(tile.x_rows());
            let w_rows = w.mem.bf16().slice(tile.w_rows());
            // SAFETY: the sizes and leading dimensions describe exactly the three buffers.
            unsafe { gemm_bf16(s, &cfg, &w_rows, &x_rows, y.mem.bf16_mut()) }?;
        }
        _ => {
            let x_rows = x.mem.f32().slice(tile.x_rows());
            let w_rows = w.mem.f32().slice(tile.w_rows());
            // SAFETY: as above.
            unsafe { s.blas.gemm(cfg, &w_rows, &x_rows, y.mem.f32_mut()) }?;
        }
    }
    let relu = op.activation == Activation::Relu;
    cuda.bias_activation(s, y.mem, tile_box, b, relu)
}

/// This tile's `dx` (over `x.rect`; other samples' rows zero), `dw` and `db`, overwritten.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    cuda: &Cuda,
    s: &mut Stream,
    op: &Dense,
    x: In<Buffer>,
    w: In<Buffer>,
    y: In<Buffer>,
    dy: In<Buffer>,
    mut dx: Option<Out<Buffer>>,
    dw: Out<Buffer>,
    db: Option<Out<Buffer>>,
) -> Launch {
    let tile = Tile::new(&x, &w, &y.rect);
    assert_eq!(dy.rect, y.rect, "dy must cover the output tile");
    assert_eq!(dw.rect, w.rect, "dw must cover the weight view");
    let mut types = vec![x.mem.dtype(), w.mem.dtype(), y.mem.dtype(), dy.mem.dtype()];
    types.extend(dx.as_ref().map(|dx| dx.mem.dtype()));
    let dtype = same_type(&types);
    if let Some(dx) = &mut dx {
        assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        dx.mem.memset_zeros(&s.stream)?;
    }
    if tile.is_empty() {
        // Nothing flows: every gradient of this tile is zero.
        s.stream.memset_zeros(dw.mem.f32_mut())?;
        if let Some(db) = db {
            s.stream.memset_zeros(db.mem.f32_mut())?;
        }
        return Ok(());
    }
    let masked = match op.activation {
        Activation::Relu => Some(cuda.relu_mask(s, y, dy, &y.rect)?),
        Activation::None => None,
    };
    let dz = masked.as_ref().unwrap_or(dy.mem);
    if let Some(db) = db {
        cuda.channel_sum(s, dz, Box4::of(&y.rect), db)?;
    }
    // dWᵀ (I × F) = xᵀ (I × S) · dz (S × F), dz being the transpose of its column-major view.
    let dw_cfg = gemm(
        CUBLAS_OP_N,
        CUBLAS_OP_T,
        (tile.inputs, tile.features, tile.samples),
        (tile.inputs, tile.features, tile.inputs),
    );
    // dxᵀ (I × S) = Wᵀ (I × F) · dzᵀ (F × S).
    let dx_cfg = gemm(
        CUBLAS_OP_N,
        CUBLAS_OP_N,
        (tile.inputs, tile.samples, tile.features),
        (tile.inputs, tile.features, tile.inputs),
    );
    let w_range = tile.w_rows();
    // The weight gradient is fp32 in every precision: in bf16, GemmEx writes it as f32.
    let mut dw_rows = dw.mem.f32_mut().slice_mut(w_range.clone());
    match dtype {
        DType::Bf16 => {
            let (x_rows, dz) = (x.mem.bf16().slice(tile.x_rows()), dz.bf16());
            // SAFETY: the sizes and leading dimensions describe exactly the three buffers.
            unsafe { gemm_bf16(s, &dw_cfg, &x_rows, dz, &mut dw_rows) }?;
            if let Some(dx) = dx.as_mut() {
                let w_rows = w.mem.bf16().slice(w_range);
                let mut dx_rows = dx.mem.bf16_mut().slice_mut(tile.x_rows());
                // SAFETY: as above.
                unsafe { gemm_bf16(s, &dx_cfg, &w_rows, dz, &mut dx_rows) }?;
            }
        }
        _ => {
            let (x_rows, dz) = (x.mem.f32().slice(tile.x_rows()), dz.f32());
            // SAFETY: the sizes and leading dimensions describe exactly the three buffers.
            unsafe { s.blas.gemm(dw_cfg, &x_rows, dz, &mut dw_rows) }?;
            if let Some(dx) = dx.as_mut() {
                let w_rows = w.mem.f32().slice(w_range);
                let mut dx_rows = dx.mem.f32_mut().slice_mut(tile.x_rows());
                // SAFETY: as above.
                unsafe { s.blas.gemm(dx_cfg, &w_rows, dz, &mut dx_rows) }?;
            }
        }
    }
    Ok(())
}
