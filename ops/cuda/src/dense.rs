//! Dense layers through cuBLAS SGEMM.
//!
//! cuBLAS is column-major: a row-major `R × C` matrix is its column-major transpose `C × R`, with
//! leading dimension `C`. Each product below is written for the transposes, which keeps every
//! operand where it lies (no copies).

use crate::backend::{Cuda, Launch};
use crate::launch::Box4;
use crate::memory::{Buffer, Stream};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use legion_ops::backend::{In, Out};
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
    let y_mem = y.mem.f32_mut();
    if tile.samples == 0 || tile.features == 0 {
        return Ok(());
    }
    if tile.inputs == 0 {
        s.stream.memset_zeros(y_mem)?;
    } else {
        let x_rows = x.mem.f32().slice(tile.x_rows());
        let w_rows = w.mem.f32().slice(tile.w_rows());
        let cfg = gemm(
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            (tile.features, tile.samples, tile.inputs),
            (tile.inputs, tile.inputs, tile.features),
        );
        // SAFETY: the sizes and leading dimensions describe exactly the three buffers.
        unsafe { s.blas.gemm(cfg, &w_rows, &x_rows, y_mem) }?;
    }
    let relu = op.activation == Activation::Relu;
    cuda.bias_activation(s, y_mem, tile_box, b, relu)
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
    if let Some(dx) = &mut dx {
        assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        s.stream.memset_zeros(dx.mem.f32_mut())?;
    }
    if tile.is_empty() {
        // Nothing flows: every gradient of this tile is zero.
        s.stream.memset_zeros(dw.mem.f32_mut())?;
        if let Some(db) = db {
            s.stream.memset_zeros(db.mem.f32_mut())?;
        }
        return Ok(());
    }
    let masked: Option<CudaSlice<f32>> = match op.activation {
        Activation::Relu => Some(cuda.relu_mask(s, y, dy, &y.rect)?),
        Activation::None => None,
    };
    let dz = masked.as_ref().unwrap_or(dy.mem.f32());
    if let Some(db) = db {
        cuda.channel_sum(s, dz, Box4::of(&y.rect), db)?;
    }
    let x_rows = x.mem.f32().slice(tile.x_rows());
    // dWᵀ (I × F) = xᵀ (I × S) · dz (S × F), dz being the transpose of its column-major view.
    let cfg = gemm(
        CUBLAS_OP_N,
        CUBLAS_OP_T,
        (tile.inputs, tile.features, tile.samples),
        (tile.inputs, tile.features, tile.inputs),
    );
    let w_range = tile.w_rows();
    {
        let mut dw_rows = dw.mem.f32_mut().slice_mut(w_range.clone());
        // SAFETY: the sizes and leading dimensions describe exactly the three buffers.
        unsafe { s.blas.gemm(cfg, &x_rows, dz, &mut dw_rows) }?;
    }
    if let Some(dx) = dx.as_mut() {
        // dxᵀ (I × S) = Wᵀ (I × F) · dzᵀ (F × S).
        let w_rows = w.mem.f32().slice(w_range);
        let cfg = gemm(
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            (tile.inputs, tile.samples, tile.features),
            (tile.inputs, tile.features, tile.inputs),
        );
        let mut dx_rows = dx.mem.f32_mut().slice_mut(tile.x_rows());
        // SAFETY: as above.
        unsafe { s.blas.gemm(cfg, &w_rows, dz, &mut dx_rows) }?;
    }
    Ok(())
}
