//! Conv2d forward and backward over one output tile, via im2col + GEMM (a depthwise one by
//! `depthwise`'s direct loops).
//!
//! Per sample and group the tile's output is `Y_g = W_g · col_g`, where `col_g` holds the input
//! windows of the tile's output positions (one column per position, one row per `(ci, ki, kj)` tap).
//! The backward pass reuses the same matrices: `dW_g += dZ_g · col_gᵀ`, and `dX` is the col2im of
//! `W_gᵀ · dZ_g`, where `dZ` is the output gradient masked by the fused activation.
//!
//! Work is split over the rayon pool by samples when there are enough of them (each worker owns its
//! scratch and weight-gradient accumulator, summed in a fixed order at the end); otherwise the GEMMs
//! themselves run on the pool. Large tiles are processed in blocks of output rows so that the column
//! matrix stays bounded. With a horizontal stride `s > 1` every input row is first permuted into `s`
//! phases (columns `≡ r mod s` together), which turns the strided reads of im2col and the strided
//! writes of col2im into contiguous copies.

use super::depthwise::{depthwise_backward, depthwise_forward, is_depthwise};
use super::gemm::{Mat, MatMut, Threads, matmul, with_scratch};
use super::{View, ViewMut};
use crate::op::{Activation, Conv2d, OpSpec};
use crate::shape::{Rect, Shape};
use rayon::prelude::*;
use std::ops::Range;

/// Upper bound, in elements, on one worker's column matrix (4 MiB): large enough for long GEMM
/// dimensions, small enough to stay near the cache and to bound memory for big images.
const COL_BUDGET: usize = 1 << 20;

/// Computes the output tile `y` (its rect is any sub-box of the output).
///
/// - `in_shape`: the full input's shape (padding is decided against it).
/// - `x`: input view whose rect contains `op.project(&[in_shape], &y.rect)[0]`.
/// - `w`: the weight rows of the tile's output channels (`OpSpec::param_rect` of parameter 0).
/// - `b`: the bias of the same channels, when the layer has one.
///
/// A depthwise convolution takes `depthwise`'s direct loops instead of im2col + GEMM.
pub fn conv2d_forward(op: &Conv2d, in_shape: Shape, x: View, w: View, b: Option<View>, y: ViewMut) {
    if is_depthwise(op, in_shape) {
        return depthwise_forward(op, in_shape, x, w, b, y);
    }
    gemm_forward(op, in_shape, x, w, b, y);
}

/// [`conv2d_forward`] by im2col + GEMM, whatever the groups.
pub(crate) fn gemm_forward(
    op: &Conv2d,
    in_shape: Shape,
    x: View,
    w: View,
    b: Option<View>,
    y: ViewMut,
) {
    let geo = Geometry::new(op, in_shape, &x.rect, &y.rect);
    geo.debug_check_params(op, in_shape, &w, b.as_ref());
    forward(&geo, op.activation, x, w, b, y);
}

/// This tile's gradients: `dx` over `x.rect` (zero where the tile's windows do not read), `dw` and
/// `db` over the weight/bias rows of the tile's output channels. All three are overwritten.
///
/// `y` is the tile's forward output (after the fused activation) and `dy` the gradient w.r.t. it.
/// Pass `dx: None` when the input gradient is not needed (first layer); pass `db: None` for a layer
/// without bias.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    op: &Conv2d,
    in_shape: Shape,
    x: View,
    w: View,
    y: View,
    dy: View,
    dx: Option<ViewMut>,
    dw: ViewMut,
    db: Option<ViewMut>,
) {
    if is_depthwise(op, in_shape) {
        return depthwise_backward(op, in_shape, x, w, y, dy, dx, dw, db);
    }
    gemm_backward(op, in_shape, x, w, y, dy, dx, dw, db);
}

/// [`conv2d_backward`] by im2col + GEMM, whatever the groups.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_backward(
    op: &Conv2d,
    in_shape: Shape,
    x: View,
    w: View,
    y: View,
    dy: View,
    dx: Option<ViewMut>,
    dw: ViewMut,
    db: Option<ViewMut>,
) {
    let geo = Geometry::new(op, in_shape, &x.rect, &y.rect);
    geo.debug_check_params(op, in_shape, &w, db.as_ref().map(|d| d.as_view()).as_ref());
    debug_assert_eq!(dw.rect, w.rect, "dw must cover the weight view");
    backward(&geo, op.activation, x, w, y, dy, dx, dw, db);
}

/// Where a tile sits and how its windows map onto the input view.
#[derive(Clone, Debug)]
struct Geometry {
    in_h: usize,
    in_w: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    out_per_group: usize,
    in_per_group: usize,
    /// The output tile.
    out: Rect,
    /// The input view's rect.
    x: Rect,
    /// Output rows per im2col block.
    block_rows: usize,
    /// The row permutation applied to input (and input-gradient) samples when the horizontal stride
    /// exceeds 1.
    phases: Option<Phases>,
    /// Per kernel column, where it reads.
    column_taps: Vec<ColumnTap>,
}

/// The output channels of one group inside the tile.
struct GroupSlice {
    /// Tile-local output channel rows.
    out: Range<usize>,
    /// First (global) input channel of the group.
    in_lo: usize,
}

/// Where one kernel column reads within an output row.
#[derive(Clone, Debug)]
struct ColumnTap {
    /// Tile-local output columns whose input position lies inside the input (others read padding).
    valid: Range<usize>,
    /// Position, in a (phase-permuted) input row, of the element read by the first valid column;
    /// the following valid columns read the following elements.
    src: usize,
}

impl ColumnTap {
    /// Fills one output row's segment of a tap row from input row `row`.
    fn gather(&self, seg: &mut [f32], row: &[f32]) {
        seg[..self.valid.start].fill(0.0);
        seg[self.valid.end..].fill(0.0);
        let seg = &mut seg[self.valid.clone()];
        seg.copy_from_slice(&row[self.src..self.src + seg.len()]);
    }

    /// Adds one output row's segment of a tap-row gradient into input-gradient row `row`.
    fn scatter_add(&self, seg: &[f32], row: &mut [f32]) {
        let seg = &seg[self.valid.clone()];
        for (d, s) in row[self.src..self.src + seg.len()].iter_mut().zip(seg) {
            *d += *s;
        }
    }
}

/// A permutation of every row of a sample that groups its columns by residue modulo the stride:
/// column `v` moves to `start[v % stride] + v / stride`, so a strided walk becomes contiguous.
#[derive(Clone, Debug)]
pub(super) struct Phases {
    stride: usize,
    row_len: usize,
    /// Where each residue class starts within a permuted row.
    start: Vec<usize>,
}

impl Phases {
    pub(super) fn new(stride: usize, row_len: usize) -> Phases {
        let start = (0..stride)
            .scan(0, |next, r| {
                let at = *next;
                *next += row_len.saturating_sub(r).div_ceil(stride);
                Some(at)
            })
            .collect();
        Phases {
            stride,
            row_len,
            start,
        }
    }

    /// The positions of residue class `r` within a permuted row.
    fn phase(&self, r: usize) -> Range<usize> {
        let end = self.start.get(r + 1).copied().unwrap_or(self.row_len);
        self.start[r]..end
    }

    pub(super) fn position(&self, v: usize) -> usize {
        self.start[v % self.stride] + v / self.stride
    }

    /// Permutes every row of `src` into `dst`.
    pub(super) fn split(&self, src: &[f32], dst: &mut [f32]) {
        if self.row_len == 0 {
            return;
        }
        for (s, d) in src
            .chunks_exact(self.row_len)
            .zip(dst.chunks_exact_mut(self.row_len))
        {
            for r in 0..self.stride.min(self.row_len) {
                for (i, d) in d[self.phase(r)].iter_mut().enumerate() {
                    *d = s[r + i * self.stride];
                }
            }
        }
    }

    /// Undoes [`Phases::split`]: writes the rows of `src` back in natural order into `dst`.
    pub(super) fn merge(&self, src: &[f32], dst: &mut [f32]) {
        if self.row_len == 0 {
            return;
        }
        for (s, d) in src
            .chunks_exact(self.row_len)
            .zip(dst.chunks_exact_mut(self.row_len))
        {
            for r in 0..self.stride.min(self.row_len) {
                for (i, s) in s[self.phase(r)].iter().enumerate() {
                    d[r + i * self.stride] = *s;
                }
            }
        }
    }
}

impl Geometry {
    fn new(op: &Conv2d, in_shape: Shape, x: &Rect, out: &Rect) -> Geometry {
        debug_assert_eq!(in_shape.ndim(), 4, "conv2d input is NCHW");
        debug_assert!(
            x.contains(&op.project(&[in_shape], out)[0]),
            "input view {x} does not contain the projection of output tile {out}"
        );
        let groups = op.groups.max(1);
        let mut geo = Geometry {
            in_h: in_shape.dim(2),
            in_w: in_shape.dim(3),
            kernel: op.kernel,
            stride: op.stride,
            padding: op.padding,
            out_per_group: op.out_channels / groups,
            in_per_group: in_shape.dim(1) / groups,
            out: *out,
            x: *x,
            block_rows: 1,
            phases: (op.stride[1] > 1).then(|| Phases::new(op.stride[1], x.extent(3))),
            column_taps: Vec::new(),
        };
        geo.block_rows = geo.rows_per_block(COL_BUDGET);
        geo.column_taps = (0..op.kernel[1]).map(|kj| geo.column_tap(kj)).collect();
        geo
    }

    /// Splits the tile's output rows into balanced blocks whose column matrix fits `budget` elements.
    fn rows_per_block(&self, budget: usize) -> usize {
        let rows = self.out.extent(2).max(1);
        let per_row = (self.taps() * self.out.extent(3)).max(1);
        let max_rows = (budget / per_row).clamp(1, rows);
        rows.div_ceil(rows.div_ceil(max_rows))
    }

    #[cfg(test)]
    fn with_col_budget(mut self, budget: usize) -> Geometry {
        self.block_rows = self.rows_per_block(budget);
        self
    }

    fn column_tap(&self, kj: usize) -> ColumnTap {
        let (s, p) = (self.stride[1], self.padding[1]);
        let (o0, o1) = (self.out.lo[3], self.out.hi[3]);
        // ow*s + kj - p must lie in [0, in_w).
        let first = p.saturating_sub(kj).div_ceil(s).max(o0);
        let end = (self.in_w + p).saturating_sub(kj).div_ceil(s).min(o1);
        if first >= end {
            return ColumnTap {
                valid: 0..0,
                src: 0,
            };
        }
        let view_col = first * s + kj - p - self.x.lo[3];
        ColumnTap {
            valid: first - o0..end - o0,
            src: self
                .phases
                .as_ref()
                .map_or(view_col, |ph| ph.position(view_col)),
        }
    }

    fn debug_check_params(&self, op: &Conv2d, in_shape: Shape, w: &View, b: Option<&View>) {
        if !cfg!(debug_assertions) {
            return;
        }
        let params = op.params(&[in_shape]);
        debug_assert_eq!(
            w.rect,
            op.param_rect(&params[0], &self.out),
            "weight view must cover the tile's output channels"
        );
        debug_assert_eq!(w.data.len(), w.rect.volume());
        if let Some(b) = b {
            debug_assert!(op.bias, "bias given to a conv2d without bias");
            debug_assert_eq!(b.rect, op.param_rect(&params[1], &self.out));
            debug_assert_eq!(b.data.len(), b.rect.volume());
        }
    }

    fn samples(&self) -> usize {
        self.out.extent(0)
    }

    fn channels(&self) -> usize {
        self.out.extent(1)
    }

    /// Output positions per channel of one sample.
    fn positions(&self) -> usize {
        self.out.extent(2) * self.out.extent(3)
    }

    fn y_sample_len(&self) -> usize {
        self.channels() * self.positions()
    }

    fn x_plane_len(&self) -> usize {
        self.x.extent(2) * self.x.extent(3)
    }

    fn x_sample_len(&self) -> usize {
        self.x.extent(1) * self.x_plane_len()
    }

    /// Rows of the column matrix (and columns of a group's weight matrix).
    fn taps(&self) -> usize {
        self.in_per_group * self.kernel[0] * self.kernel[1]
    }

    /// A 1×1, stride-1, unpadded conv whose input rows are exactly the tile's: the input view itself
    /// is the column matrix, so im2col and col2im are skipped.
    fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1]
            && self.stride == [1, 1]
            && self.padding == [0, 0]
            && self.x.lo[3] == self.out.lo[3]
            && self.x.hi[3] == self.out.hi[3]
    }

    fn col_len(&self) -> usize {
        if self.is_pointwise() {
            0
        } else {
            self.taps() * self.block_rows * self.out.extent(3)
        }
    }

    /// Length of one phase-permuted input sample (0 without a horizontal stride).
    fn phased_len(&self) -> usize {
        if self.phases.is_some() {
            self.x_sample_len()
        } else {
            0
        }
    }

    fn groups(&self) -> impl Iterator<Item = GroupSlice> + '_ {
        let (c0, c1) = (self.out.lo[1], self.out.hi[1]);
        let opg = self.out_per_group;
        (c0 / opg..c1.div_ceil(opg)).map(move |g| GroupSlice {
            out: (g * opg).max(c0) - c0..((g + 1) * opg).min(c1) - c0,
            in_lo: g * self.in_per_group,
        })
    }

    /// Blocks of (global) output rows.
    fn row_blocks(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let (lo, hi) = (self.out.lo[2], self.out.hi[2]);
        (lo..hi)
            .step_by(self.block_rows)
            .map(move |r| r..(r + self.block_rows).min(hi))
    }

    /// Offset of the first column of output row `row` within one channel of a sample's output.
    fn position_of_row(&self, row: usize) -> usize {
        (row - self.out.lo[2]) * self.out.extent(3)
    }

    /// Offset of input channel `c`, row `h` within one sample of the input view.
    fn x_row_offset(&self, c: usize, h: usize) -> usize {
        ((c - self.x.lo[1]) * self.x.extent(2) + (h - self.x.lo[2])) * self.x.extent(3)
    }

    /// The global input row read by output row `row` at kernel tap `ki`, if inside the input.
    fn input_row(&self, row: usize, ki: usize) -> Option<usize> {
        (row * self.stride[0] + ki)
            .checked_sub(self.padding[0])
            .filter(|&h| h < self.in_h)
    }

    /// The sample as im2col reads it: itself, or its phase permutation written into `phased`.
    fn im2col_source<'a>(&self, x_sample: &'a [f32], phased: &'a mut [f32]) -> &'a [f32] {
        match &self.phases {
            None => x_sample,
            Some(phases) => {
                phases.split(x_sample, phased);
                phased
            }
        }
    }

    /// Writes the column matrix of output rows `rows` of one sample into `col`
    /// (`taps` × `rows.len()·out_w`, tap rows ordered `(c, ki, kj)`), reading input channels from
    /// `in_lo` of `src` (see [`Geometry::im2col_source`]).
    fn im2col(&self, src: &[f32], in_lo: usize, rows: Range<usize>, col: &mut [f32]) {
        let [kh, kw] = self.kernel;
        let (out_w, x_w) = (self.out.extent(3), self.x.extent(3));
        let ncols = rows.len() * out_w;
        // All kernel columns of one (c, ki) are filled from the same input row, read once.
        let mut tap_groups = col[..self.taps() * ncols].chunks_exact_mut(kw * ncols);
        for c in in_lo..in_lo + self.in_per_group {
            for ki in 0..kh {
                let taps = tap_groups
                    .next()
                    .expect("one group of tap rows per (c, ki)");
                for (block_row, row) in rows.clone().enumerate() {
                    let at = block_row * out_w;
                    let segments = taps
                        .chunks_exact_mut(ncols)
                        .map(|tap| &mut tap[at..at + out_w]);
                    let Some(h) = self.input_row(row, ki) else {
                        segments.for_each(|seg| seg.fill(0.0));
                        continue;
                    };
                    let src_row = &src[self.x_row_offset(c, h)..][..x_w];
                    for (seg, tap) in segments.zip(&self.column_taps) {
                        tap.gather(seg, src_row);
                    }
                }
            }
        }
    }

    /// Adds the column-matrix gradient `dcol` (laid out as in [`Geometry::im2col`]) into one sample
    /// of the input gradient, laid out like the im2col source (phase-permuted with a stride).
    fn col2im(&self, dcol: &[f32], in_lo: usize, rows: Range<usize>, dst: &mut [f32]) {
        let [kh, kw] = self.kernel;
        let (out_w, x_w) = (self.out.extent(3), self.x.extent(3));
        let ncols = rows.len() * out_w;
        let mut tap_groups = dcol[..self.taps() * ncols].chunks_exact(kw * ncols);
        for c in in_lo..in_lo + self.in_per_group {
            for ki in 0..kh {
                let taps = tap_groups
                    .next()
                    .expect("one group of tap rows per (c, ki)");
                for (block_row, row) in rows.clone().enumerate() {
                    let Some(h) = self.input_row(row, ki) else {
                        continue;
                    };
                    let at = block_row * out_w;
                    let dst_row = &mut dst[self.x_row_offset(c, h)..][..x_w];
                    for (tap_row, tap) in taps.chunks_exact(ncols).zip(&self.column_taps) {
                        tap.scatter_add(&tap_row[at..at + out_w], dst_row);
                    }
                }
            }
        }
    }

    /// The column matrix of a row block: a view of the input itself for pointwise convs, otherwise
    /// im2col'ed from `src` into `col`.
    fn columns<'a>(
        &self,
        src: &'a [f32],
        in_lo: usize,
        rows: Range<usize>,
        col: &'a mut [f32],
    ) -> Mat<'a> {
        let ncols = rows.len() * self.out.extent(3);
        if self.is_pointwise() {
            let start = self.x_row_offset(in_lo, rows.start);
            Mat::new(&src[start..], self.in_per_group, ncols, self.x_plane_len())
        } else {
            self.im2col(src, in_lo, rows, col);
            Mat::packed(col, self.taps(), ncols)
        }
    }

    /// A group's weight matrix (`out` rows × `taps`).
    fn group_weights<'a>(&self, w: &'a [f32], group: &GroupSlice) -> Mat<'a> {
        let taps = self.taps();
        Mat::new(&w[group.out.start * taps..], group.out.len(), taps, taps)
    }

    /// `y_sample = W · col` for every group and row block; `src` as from `im2col_source`.
    fn forward_sample(
        &self,
        src: &[f32],
        w: &[f32],
        y_sample: &mut [f32],
        col: &mut [f32],
        threads: Threads,
    ) {
        let positions = self.positions();
        for group in self.groups() {
            let weights = self.group_weights(w, &group);
            for rows in self.row_blocks() {
                let first = group.out.start * positions + self.position_of_row(rows.start);
                let ncols = rows.len() * self.out.extent(3);
                let cols = self.columns(src, group.in_lo, rows, col);
                let dst = MatMut::new(&mut y_sample[first..], group.out.len(), ncols, positions);
                matmul(dst, weights, cols, false, threads);
            }
        }
    }

    /// Accumulates one sample's `dw`, `db` and (into `dsrc`, laid out like `src`) input gradient.
    #[allow(clippy::too_many_arguments)]
    fn backward_sample(
        &self,
        src: &[f32],
        w: &[f32],
        dz_sample: &[f32],
        mut dsrc: Option<&mut [f32]>,
        grads: &mut ParamGrads,
        col: &mut [f32],
        dcol: &mut [f32],
        threads: Threads,
    ) {
        let positions = self.positions();
        let taps = self.taps();
        for (db, dz_row) in grads.db.iter_mut().zip(dz_sample.chunks_exact(positions)) {
            *db += dz_row.iter().sum::<f32>();
        }
        for group in self.groups() {
            let weights = self.group_weights(w, &group);
            for rows in self.row_blocks() {
                let first = group.out.start * positions + self.position_of_row(rows.start);
                let ncols = rows.len() * self.out.extent(3);
                let dz = Mat::new(&dz_sample[first..], group.out.len(), ncols, positions);
                let cols = self.columns(src, group.in_lo, rows.clone(), col);
                let dw = MatMut::new(
                    &mut grads.dw[group.out.start * taps..],
                    group.out.len(),
                    taps,
                    taps,
                );
                matmul(dw, dz, cols.t(), true, threads);
                let Some(dsrc) = dsrc.as_deref_mut() else {
                    continue;
                };
                if self.is_pointwise() {
                    let start = self.x_row_offset(group.in_lo, rows.start);
                    let dx = MatMut::new(
                        &mut dsrc[start..],
                        self.in_per_group,
                        ncols,
                        self.x_plane_len(),
                    );
                    matmul(dx, weights.t(), dz, true, threads);
                } else {
                    let dcol_mat = MatMut::packed(dcol, taps, ncols);
                    matmul(dcol_mat, weights.t(), dz, false, threads);
                    self.col2im(dcol, group.in_lo, rows, dsrc);
                }
            }
        }
    }
}

/// How a tile's samples are spread over the rayon pool.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    samples_per_worker: usize,
    gemm_threads: Threads,
}

impl Schedule {
    /// One chunk of samples per pool thread when that balances (then each GEMM runs on its worker's
    /// thread); otherwise all samples in one chunk with the GEMMs spread over the pool, which keeps
    /// every thread busy for single-sample tiles at the cost of a serial im2col.
    fn new(samples: usize) -> Schedule {
        let threads = rayon::current_num_threads();
        if threads > 1 && (samples.is_multiple_of(threads) || samples >= 4 * threads) {
            Schedule {
                samples_per_worker: samples.div_ceil(threads),
                gemm_threads: Threads::One,
            }
        } else {
            Schedule {
                samples_per_worker: samples.max(1),
                gemm_threads: Threads::Pool,
            }
        }
    }
}

/// A worker's weight and bias gradient accumulators.
struct ParamGrads<'a> {
    dw: &'a mut [f32],
    db: Vec<f32>,
}

fn forward(geo: &Geometry, activation: Activation, x: View, w: View, b: Option<View>, y: ViewMut) {
    debug_assert_eq!(y.data.len(), y.rect.volume());
    debug_assert_eq!(x.data.len(), x.rect.volume());
    if y.rect.is_empty() {
        return;
    }
    let schedule = Schedule::new(geo.samples());
    let (y_len, x_len) = (geo.y_sample_len(), geo.x_sample_len());
    let first_x = (geo.out.lo[0] - geo.x.lo[0]) * x_len;
    let x_samples = &x.data[first_x..first_x + geo.samples() * x_len];
    let per_worker = schedule.samples_per_worker;
    y.data
        .par_chunks_mut(per_worker * y_len)
        .enumerate()
        .for_each(|(worker, y_chunk)| {
            with_scratch([geo.col_len(), geo.phased_len()], |[col, phased]| {
                for (local, y_sample) in y_chunk.chunks_exact_mut(y_len).enumerate() {
                    let sample = worker * per_worker + local;
                    let x_sample = &x_samples[sample * x_len..(sample + 1) * x_len];
                    let src = geo.im2col_source(x_sample, phased);
                    geo.forward_sample(src, w.data, y_sample, col, schedule.gemm_threads);
                    let bias = b.as_ref().map(|b| b.data);
                    bias_and_activation(y_sample, geo.positions(), bias, activation);
                }
            })
        });
}

#[allow(clippy::too_many_arguments)]
fn backward(
    geo: &Geometry,
    activation: Activation,
    x: View,
    w: View,
    y: View,
    dy: View,
    mut dx: Option<ViewMut>,
    dw: ViewMut,
    mut db: Option<ViewMut>,
) {
    debug_assert_eq!(y.rect, geo.out);
    debug_assert_eq!(dy.rect, geo.out);
    debug_assert_eq!(dy.data.len(), dy.rect.volume());
    debug_assert_eq!(y.data.len(), y.rect.volume());
    if let Some(dx) = &dx {
        debug_assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        debug_assert_eq!(dx.data.len(), dx.rect.volume());
    }
    if let Some(dx) = &mut dx {
        dx.data.fill(0.0);
    }
    dw.data.fill(0.0);
    if let Some(db) = &mut db {
        db.data.fill(0.0);
    }
    if geo.out.is_empty() {
        return;
    }

    let schedule = Schedule::new(geo.samples());
    let per_worker = schedule.samples_per_worker;
    let workers = geo.samples().div_ceil(per_worker);
    let (y_len, x_len) = (geo.y_sample_len(), geo.x_sample_len());
    let first_x = (geo.out.lo[0] - geo.x.lo[0]) * x_len;
    let x_samples = &x.data[first_x..first_x + geo.samples() * x_len];

    let with_dx = dx.is_some();
    let dx_chunks: Vec<Option<&mut [f32]>> = match dx {
        Some(dx) => {
            let mut rest = &mut dx.data[first_x..first_x + geo.samples() * x_len];
            // Split by sample counts rather than `chunks_mut`, which cannot cut empty samples.
            (0..workers)
                .map(|_| {
                    let len = (per_worker * x_len).min(rest.len());
                    let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(len);
                    rest = tail;
                    Some(chunk)
                })
                .collect()
        }
        None => (0..workers).map(|_| None).collect(),
    };
    // The first worker accumulates straight into `dw`; the others into buffers summed afterwards.
    let mut extra_dw: Vec<Vec<f32>> = (1..workers).map(|_| vec![0.0; dw.data.len()]).collect();
    let dw_accumulators =
        std::iter::once(&mut *dw.data).chain(extra_dw.iter_mut().map(Vec::as_mut_slice));
    let work: Vec<_> = dx_chunks
        .into_iter()
        .zip(dw_accumulators)
        .enumerate()
        .collect();

    let scratch_lens = [
        geo.col_len(),
        if with_dx { geo.col_len() } else { 0 },
        // the output gradient masked by the activation, for one sample
        match activation {
            Activation::None => 0,
            Activation::Relu => y_len,
        },
        geo.phased_len(),
        if with_dx { geo.phased_len() } else { 0 },
    ];
    let db_partials: Vec<Vec<f32>> = work
        .into_par_iter()
        .map(|(worker, (mut dx_chunk, dw_acc))| {
            let samples = worker * per_worker..((worker + 1) * per_worker).min(geo.samples());
            let mut grads = ParamGrads {
                dw: dw_acc,
                db: vec![0.0; geo.channels()],
            };
            with_scratch(scratch_lens, |[col, dcol, masked, phased, phased_dx]| {
                for (local, sample) in samples.enumerate() {
                    let x_sample = &x_samples[sample * x_len..(sample + 1) * x_len];
                    let dy_sample = &dy.data[sample * y_len..(sample + 1) * y_len];
                    let dz_sample = match activation {
                        Activation::None => dy_sample,
                        Activation::Relu => {
                            let y_sample = &y.data[sample * y_len..(sample + 1) * y_len];
                            relu_mask(y_sample, dy_sample, masked);
                            &*masked
                        }
                    };
                    let dx_sample = dx_chunk
                        .as_deref_mut()
                        .map(|d| &mut d[local * x_len..(local + 1) * x_len]);
                    let src = geo.im2col_source(x_sample, phased);
                    // With phases the input gradient is gathered permuted, then put back in order.
                    let (dsrc, unpermute) = match (dx_sample, &geo.phases) {
                        (Some(dx_sample), Some(phases)) => {
                            phased_dx.fill(0.0);
                            (Some(&mut *phased_dx), Some((phases, dx_sample)))
                        }
                        (dx_sample, _) => (dx_sample, None),
                    };
                    geo.backward_sample(
                        src,
                        w.data,
                        dz_sample,
                        dsrc,
                        &mut grads,
                        col,
                        dcol,
                        schedule.gemm_threads,
                    );
                    if let Some((phases, dx_sample)) = unpermute {
                        phases.merge(phased_dx, dx_sample);
                    }
                }
            });
            grads.db
        })
        .collect();

    for partial in &extra_dw {
        for (d, p) in dw.data.iter_mut().zip(partial) {
            *d += *p;
        }
    }
    if let Some(db) = db {
        for partial in &db_partials {
            for (d, p) in db.data.iter_mut().zip(partial) {
                *d += *p;
            }
        }
    }
}

/// Adds each channel's bias to its row of `positions` outputs and applies the activation, in one pass.
pub(super) fn bias_and_activation(
    y_sample: &mut [f32],
    positions: usize,
    bias: Option<&[f32]>,
    activation: Activation,
) {
    for (c, row) in y_sample.chunks_exact_mut(positions).enumerate() {
        let b = bias.map_or(0.0, |b| b[c]);
        match activation {
            Activation::None if bias.is_none() => {}
            Activation::None => row.iter_mut().for_each(|v| *v += b),
            // A select rather than a conditional store vectorises, and keeps NaN like PyTorch.
            Activation::Relu => row.iter_mut().for_each(|v| {
                let z = *v + b;
                *v = if z < 0.0 { 0.0 } else { z };
            }),
        }
    }
}

/// `dz = dy` where the activation was active (`y > 0`), else 0.
pub(super) fn relu_mask(y: &[f32], dy: &[f32], dz: &mut [f32]) {
    for ((z, &y), &g) in dz.iter_mut().zip(y).zip(dy) {
        *z = if y > 0.0 { g } else { 0.0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, halves, max_rel_diff, random};
    use crate::shape::{add_rect, copy_rect};

    /// A conv layer, its input shape and random tensors for it.
    struct Case {
        op: Conv2d,
        input: Shape,
        output: Shape,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Option<Vec<f32>>,
        /// Output gradient, also the weights `r` of the test loss `Σ y·r`.
        dy: Vec<f32>,
    }

    impl Case {
        fn new(op: Conv2d, input: Shape, seed: u64) -> Case {
            let output = op.infer_shape(&[input]).unwrap();
            let w_len = op.params(&[input])[0].shape.numel();
            Case {
                x: random(input.numel(), seed),
                w: random(w_len, seed + 1),
                b: op.bias.then(|| {
                    random(op.out_channels, seed + 2)
                        .iter()
                        .map(|v| v * 0.5)
                        .collect()
                }),
                dy: random(output.numel(), seed + 3),
                op,
                input,
                output,
            }
        }

        fn w_rect(&self) -> Rect {
            self.op.params(&[self.input])[0].shape.full_rect()
        }

        fn b_rect(&self) -> Rect {
            Shape::new(&[self.op.out_channels]).full_rect()
        }
    }

    /// Kernels run with the default row blocking or a tiny column budget (many row blocks).
    #[derive(Clone, Copy, Debug)]
    enum Blocking {
        Default,
        Tiny,
    }

    fn geometry(case: &Case, x: &Rect, out: &Rect, blocking: Blocking) -> Geometry {
        let geo = Geometry::new(&case.op, case.input, x, out);
        match blocking {
            Blocking::Default => geo,
            Blocking::Tiny => geo.with_col_budget(40),
        }
    }

    /// Gradients of one run: dx (None when not requested), dw, db.
    type Grads = (Option<Vec<f32>>, Vec<f32>, Vec<f32>);

    fn run_forward(case: &Case, x: &[f32], blocking: Blocking) -> Vec<f32> {
        let full_x = case.input.full_rect();
        let out = case.output.full_rect();
        let mut y = vec![f32::NAN; case.output.numel()];
        forward(
            &geometry(case, &full_x, &out, blocking),
            case.op.activation,
            View::new(full_x, x),
            View::new(case.w_rect(), &case.w),
            case.b.as_deref().map(|b| View::new(case.b_rect(), b)),
            ViewMut::new(out, &mut y),
        );
        y
    }

    fn run_backward(case: &Case, y: &[f32], with_dx: bool, blocking: Blocking) -> Grads {
        let full_x = case.input.full_rect();
        let out = case.output.full_rect();
        let mut dx = vec![f32::NAN; case.input.numel()];
        let mut dw = vec![f32::NAN; case.w.len()];
        let mut db = vec![f32::NAN; case.op.out_channels];
        backward(
            &geometry(case, &full_x, &out, blocking),
            case.op.activation,
            View::new(full_x, &case.x),
            View::new(case.w_rect(), &case.w),
            View::new(out, y),
            View::new(out, &case.dy),
            with_dx.then(|| ViewMut::new(full_x, &mut dx)),
            ViewMut::new(case.w_rect(), &mut dw),
            case.b
                .is_some()
                .then(|| ViewMut::new(case.b_rect(), &mut db)),
        );
        (with_dx.then_some(dx), dw, db)
    }

    /// Direct convolution with straight loops, accumulating in f64; returns y and the gradients.
    fn naive(case: &Case) -> (Vec<f32>, Grads) {
        let op = &case.op;
        let [n, cin, h, w] = [0, 1, 2, 3].map(|a| case.input.dim(a));
        let [_, cout, oh, ow] = [0, 1, 2, 3].map(|a| case.output.dim(a));
        let [kh, kw] = op.kernel;
        let (ipg, opg) = (cin / op.groups, cout / op.groups);
        let x_at = |ni: usize, c: usize, i: usize, j: usize| ((ni * cin + c) * h + i) * w + j;
        // Calls `f(y index, x index, w index)` for every tap that reads inside the input.
        let for_each_tap = |f: &mut dyn FnMut(usize, usize, usize)| {
            for ni in 0..n {
                for co in 0..cout {
                    let g = co / opg;
                    for (oi, oj) in (0..oh).flat_map(|i| (0..ow).map(move |j| (i, j))) {
                        let yi = ((ni * cout + co) * oh + oi) * ow + oj;
                        for ci in 0..ipg {
                            for ki in 0..kh {
                                for kj in 0..kw {
                                    let ih =
                                        (oi * op.stride[0] + ki) as isize - op.padding[0] as isize;
                                    let iw =
                                        (oj * op.stride[1] + kj) as isize - op.padding[1] as isize;
                                    if ih < 0 || iw < 0 || ih >= h as isize || iw >= w as isize {
                                        continue;
                                    }
                                    let xi = x_at(ni, g * ipg + ci, ih as usize, iw as usize);
                                    let wi = ((co * ipg + ci) * kh + ki) * kw + kj;
                                    f(yi, xi, wi);
                                }
                            }
                        }
                    }
                }
            }
        };
        let mut z = vec![0f64; case.output.numel()];
        for_each_tap(&mut |yi, xi, wi| z[yi] += case.x[xi] as f64 * case.w[wi] as f64);
        let spatial = oh * ow;
        let mut y = vec![0f32; z.len()];
        for (i, v) in z.iter().enumerate() {
            let bias = case
                .b
                .as_ref()
                .map_or(0.0, |b| b[i / spatial % cout] as f64);
            let pre = (v + bias) as f32;
            y[i] = match op.activation {
                Activation::None => pre,
                Activation::Relu => pre.max(0.0),
            };
        }
        let dz: Vec<f64> = (0..y.len())
            .map(|i| match op.activation {
                Activation::Relu if y[i] <= 0.0 => 0.0,
                _ => case.dy[i] as f64,
            })
            .collect();
        let mut dx = vec![0f64; case.x.len()];
        let mut dw = vec![0f64; case.w.len()];
        for_each_tap(&mut |yi, xi, wi| {
            dx[xi] += case.w[wi] as f64 * dz[yi];
            dw[wi] += case.x[xi] as f64 * dz[yi];
        });
        let mut db = vec![0f64; cout];
        for (i, g) in dz.iter().enumerate() {
            db[i / spatial % cout] += g;
        }
        let f = |v: Vec<f64>| v.into_iter().map(|e| e as f32).collect::<Vec<f32>>();
        (y, (Some(f(dx)), f(dw), f(db)))
    }

    fn cases() -> Vec<Case> {
        vec![
            Case::new(Conv2d::new(4, 3).padding(1), Shape::nchw(2, 3, 7, 6), 10),
            Case::new(
                Conv2d::new(6, 3)
                    .stride(2)
                    .padding_hw(1, 0)
                    .groups(2)
                    .relu(),
                Shape::nchw(3, 4, 9, 8),
                20,
            ),
            Case::new(
                Conv2d::rect(4, 1, 3).padding_hw(0, 1).no_bias(),
                Shape::nchw(2, 2, 5, 7),
                30,
            ),
            Case::new(
                Conv2d {
                    stride: [2, 1],
                    ..Conv2d::rect(6, 3, 1).padding_hw(1, 0).groups(3).relu()
                },
                Shape::nchw(2, 3, 8, 5),
                40,
            ),
            Case::new(Conv2d::new(5, 1).relu(), Shape::nchw(2, 4, 5, 6), 50),
            Case::new(
                Conv2d::new(4, 5).padding(2).stride(3).no_bias().relu(),
                Shape::nchw(1, 2, 11, 10),
                60,
            ),
            Case::new(
                Conv2d::new(4, 3).padding(1).groups(4),
                Shape::nchw(2, 4, 6, 6),
                70,
            ),
        ]
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        let d = max_rel_diff(got, want);
        assert!(d <= tol, "{what}: relative difference {d}");
    }

    #[test]
    fn im2col_path_matches_direct_convolution() {
        for case in cases() {
            let (y, (dx, dw, db)) = naive(&case);
            for blocking in [Blocking::Default, Blocking::Tiny] {
                let what = format!("{:?} on {} ({blocking:?})", case.op, case.input);
                let got = run_forward(&case, &case.x, blocking);
                assert_close(&format!("y of {what}"), &got, &y, 1e-5);
                let (got_dx, got_dw, got_db) = run_backward(&case, &y, true, blocking);
                assert_close(
                    &format!("dx of {what}"),
                    &got_dx.unwrap(),
                    &dx.clone().unwrap(),
                    1e-5,
                );
                assert_close(&format!("dw of {what}"), &got_dw, &dw, 1e-5);
                if case.b.is_some() {
                    assert_close(&format!("db of {what}"), &got_db, &db, 1e-5);
                }
                let (no_dx, dw_again, _) = run_backward(&case, &y, false, blocking);
                assert!(no_dx.is_none());
                assert_eq!(dw_again, got_dw, "skipping dx must not change dw");
            }
        }
    }

    /// Zeroes the loss weights of outputs whose pre-activation lies within `margin` of the ReLU kink,
    /// so that finite differences with steps smaller than the margin never cross a kink that counts.
    fn ignore_near_kinks(case: &mut Case, margin: f32) {
        if case.op.activation != Activation::Relu {
            return;
        }
        let linear = Case {
            op: Conv2d {
                activation: Activation::None,
                ..case.op.clone()
            },
            ..clone_case(case)
        };
        let (pre, _) = naive(&linear);
        for (r, z) in case.dy.iter_mut().zip(pre) {
            if z.abs() < margin {
                *r = 0.0;
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for mut case in cases() {
            // A probe moves one value by 1e-2 and every other factor is at most 1 in magnitude.
            ignore_near_kinks(&mut case, 0.02);
            let what = format!("{:?} on {}", case.op, case.input);
            let loss = |y: &[f32]| -> f64 {
                y.iter()
                    .zip(&case.dy)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            };
            let y = run_forward(&case, &case.x, Blocking::Default);
            let (dx, dw, db) = run_backward(&case, &y, true, Blocking::Default);
            assert_grad(&format!("dx of {what}"), &case.x, &dx.unwrap(), 40, |x| {
                loss(&run_forward(&case, x, Blocking::Default))
            });
            assert_grad(&format!("dw of {what}"), &case.w, &dw, 40, |w| {
                let probe = Case {
                    w: w.to_vec(),
                    ..clone_case(&case)
                };
                loss(&run_forward(&probe, &probe.x, Blocking::Default))
            });
            if let Some(b) = &case.b {
                assert_grad(&format!("db of {what}"), b, &db, 40, |b| {
                    let probe = Case {
                        b: Some(b.to_vec()),
                        ..clone_case(&case)
                    };
                    loss(&run_forward(&probe, &probe.x, Blocking::Default))
                });
            }
        }
    }

    fn clone_case(c: &Case) -> Case {
        Case {
            op: c.op.clone(),
            input: c.input,
            output: c.output,
            x: c.x.clone(),
            w: c.w.clone(),
            b: c.b.clone(),
            dy: c.dy.clone(),
        }
    }

    /// Runs `case` tile by tile on a 2×2 grid over `axes` and checks the tiles against the
    /// whole-tensor run. With `whole_input` every tile gets the full input view instead of its
    /// projection.
    fn check_tiles(case: &Case, axes: [usize; 2], whole_input: bool, blocking: Blocking) {
        let out_full = case.output.full_rect();
        let tiles = halves(&out_full, axes[0])
            .iter()
            .flat_map(|half| halves(half, axes[1]))
            .filter(|t| !t.is_empty())
            .collect();
        check_tiling(case, tiles, whole_input, blocking);
    }

    /// Runs `case` on each of `tiles` (which must partition the output) and checks them against the
    /// whole-tensor run.
    fn check_tiling(case: &Case, tiles: Vec<Rect>, whole_input: bool, blocking: Blocking) {
        let what = format!(
            "{:?} on {} in {} tiles (whole input: {whole_input}, {blocking:?})",
            case.op,
            case.input,
            tiles.len()
        );
        let y = run_forward(case, &case.x, blocking);
        let (dx, dw, db) = run_backward(case, &y, true, blocking);
        let dx = dx.unwrap();
        let out_full = case.output.full_rect();
        let x_full = case.input.full_rect();
        let (w_full, b_full) = (case.w_rect(), case.b_rect());
        let mut dx_sum = vec![0.0; dx.len()];
        let mut dw_sum = vec![0.0; dw.len()];
        let mut db_sum = vec![0.0; db.len()];
        let cut = |data: &[f32], from: &Rect, region: &Rect| {
            let mut out = vec![0.0; region.volume()];
            copy_rect(data, from, &mut out, region, region);
            out
        };
        {
            for tile in tiles {
                let x_rect = if whole_input {
                    x_full
                } else {
                    case.op.project(&[case.input], &tile)[0]
                };
                let w_rect = case.op.param_rect(&case.op.params(&[case.input])[0], &tile);
                let x_tile = cut(&case.x, &x_full, &x_rect);
                let w_tile = cut(&case.w, &w_full, &w_rect);
                let b_rect = case
                    .op
                    .bias
                    .then(|| case.op.param_rect(&case.op.params(&[case.input])[1], &tile));
                let b_tile = b_rect.map(|r| cut(case.b.as_ref().unwrap(), &b_full, &r));
                let geo = geometry(case, &x_rect, &tile, blocking);

                let mut y_tile = vec![f32::NAN; tile.volume()];
                forward(
                    &geo,
                    case.op.activation,
                    View::new(x_rect, &x_tile),
                    View::new(w_rect, &w_tile),
                    b_rect.map(|r| View::new(r, b_tile.as_ref().unwrap())),
                    ViewMut::new(tile, &mut y_tile),
                );
                let want = cut(&y, &out_full, &tile);
                assert_close(&format!("y tile {tile} of {what}"), &y_tile, &want, 1e-5);

                let dy_tile = cut(&case.dy, &out_full, &tile);
                let mut dx_tile = vec![f32::NAN; x_rect.volume()];
                let mut dw_tile = vec![f32::NAN; w_rect.volume()];
                let mut db_tile = vec![f32::NAN; tile.extent(1)];
                backward(
                    &geo,
                    case.op.activation,
                    View::new(x_rect, &x_tile),
                    View::new(w_rect, &w_tile),
                    View::new(tile, &want),
                    View::new(tile, &dy_tile),
                    Some(ViewMut::new(x_rect, &mut dx_tile)),
                    ViewMut::new(w_rect, &mut dw_tile),
                    b_rect.map(|r| ViewMut::new(r, &mut db_tile)),
                );
                add_rect(&dx_tile, &x_rect, &mut dx_sum, &x_full, &x_rect);
                add_rect(&dw_tile, &w_rect, &mut dw_sum, &w_full, &w_rect);
                if let Some(r) = b_rect {
                    add_rect(&db_tile, &r, &mut db_sum, &b_full, &r);
                }
            }
        }
        assert_close(&format!("summed dx of {what}"), &dx_sum, &dx, 1e-5);
        assert_close(&format!("summed dw of {what}"), &dw_sum, &dw, 1e-5);
        if case.op.bias {
            assert_close(&format!("summed db of {what}"), &db_sum, &db, 1e-5);
        }
    }

    #[test]
    fn tiles_reproduce_the_whole_tensor() {
        for case in cases() {
            for axes in [[2, 3], [0, 1], [1, 3]] {
                check_tiles(&case, axes, false, Blocking::Default);
            }
            check_tiles(&case, [2, 3], true, Blocking::Default);
            check_tiles(&case, [2, 1], false, Blocking::Tiny);
        }
    }

    /// Every output position as its own tile, for layers where some windows read only padding (empty
    /// input views) or where the stride exceeds the view's width.
    #[test]
    fn single_position_tiles_reproduce_the_whole_tensor() {
        let cases = [
            Case::new(
                Conv2d::new(3, 1).padding(2).relu(),
                Shape::nchw(2, 2, 3, 3),
                80,
            ),
            Case::new(Conv2d::new(2, 1).stride(3), Shape::nchw(1, 2, 4, 7), 90),
            Case::new(
                Conv2d::rect(4, 2, 3).stride(2).padding_hw(1, 2).groups(2),
                Shape::nchw(1, 4, 5, 4),
                100,
            ),
        ];
        for case in &cases {
            let out = case.output.full_rect();
            let mut tiles = Vec::new();
            for h in 0..out.hi[2] {
                for w in 0..out.hi[3] {
                    tiles.push(out.with_axis(2, h, h + 1).with_axis(3, w, w + 1));
                }
            }
            check_tiling(case, tiles.clone(), false, Blocking::Default);
            check_tiling(case, tiles, true, Blocking::Default);
        }
    }

    #[test]
    fn phase_split_groups_columns_by_residue_and_merges_back() {
        let phases = Phases::new(3, 7);
        let rows: Vec<f32> = (0..14).map(|v| v as f32).collect();
        let mut split = vec![0.0; 14];
        phases.split(&rows, &mut split);
        let first_row = [0.0, 3.0, 6.0, 1.0, 4.0, 2.0, 5.0];
        assert_eq!(split[..7], first_row);
        assert_eq!(phases.position(4), 4);
        let mut merged = vec![0.0; 14];
        phases.merge(&split, &mut merged);
        assert_eq!(merged, rows);
        // Rows narrower than the stride.
        let narrow = Phases::new(4, 2);
        let mut out = vec![0.0; 2];
        narrow.split(&[7.0, 8.0], &mut out);
        assert_eq!(out, vec![7.0, 8.0]);
    }

    #[test]
    fn empty_tile_writes_zero_gradients() {
        let case = &cases()[1];
        let tile = case.output.full_rect().with_axis(2, 2, 2);
        let x_rect = case.op.project(&[case.input], &tile)[0];
        let w_rect = case.w_rect();
        let (mut dw, mut db) = (vec![f32::NAN; case.w.len()], vec![f32::NAN; 6]);
        conv2d_forward(
            &case.op,
            case.input,
            View::new(x_rect, &[]),
            View::new(w_rect, &case.w),
            Some(View::new(case.b_rect(), case.b.as_ref().unwrap())),
            ViewMut::new(tile, &mut []),
        );
        conv2d_backward(
            &case.op,
            case.input,
            View::new(x_rect, &[]),
            View::new(w_rect, &case.w),
            View::new(tile, &[]),
            View::new(tile, &[]),
            Some(ViewMut::new(x_rect, &mut [])),
            ViewMut::new(w_rect, &mut dw),
            Some(ViewMut::new(case.b_rect(), &mut db)),
        );
        assert!(dw.iter().chain(&db).all(|&v| v == 0.0));
    }

    #[test]
    fn thread_counts_and_schedules_agree() {
        // Batches of 1, 3 and 6 on pools of 1, 2 and 3 threads cover both sample-parallel and
        // GEMM-parallel schedules.
        for batch in [1, 3, 6] {
            let case = Case::new(
                Conv2d::new(8, 3).padding(1).groups(2).relu(),
                Shape::nchw(batch, 4, 10, 9),
                batch as u64,
            );
            let (y, (dx, dw, db)) = naive(&case);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (got_y, (got_dx, got_dw, got_db)) = pool.install(|| {
                    let got_y = run_forward(&case, &case.x, Blocking::Default);
                    (got_y, run_backward(&case, &y, true, Blocking::Default))
                });
                let what = format!("batch {batch} on {threads} threads");
                assert_close(&format!("y, {what}"), &got_y, &y, 1e-5);
                assert_close(
                    &format!("dx, {what}"),
                    &got_dx.unwrap(),
                    dx.as_ref().unwrap(),
                    1e-5,
                );
                assert_close(&format!("dw, {what}"), &got_dw, &dw, 1e-5);
                assert_close(&format!("db, {what}"), &got_db, &db, 1e-5);
            }
        }
    }

    #[test]
    fn public_entry_points_match_internal_runs() {
        let case = &cases()[1];
        let x_rect = case.input.full_rect();
        let out = case.output.full_rect();
        let mut y = vec![0.0; out.volume()];
        conv2d_forward(
            &case.op,
            case.input,
            View::new(x_rect, &case.x),
            View::new(case.w_rect(), &case.w),
            case.b.as_deref().map(|b| View::new(case.b_rect(), b)),
            ViewMut::new(out, &mut y),
        );
        assert_eq!(y, run_forward(case, &case.x, Blocking::Default));
        let mut dx = vec![0.0; x_rect.volume()];
        let mut dw = vec![0.0; case.w.len()];
        let mut db = vec![0.0; case.op.out_channels];
        conv2d_backward(
            &case.op,
            case.input,
            View::new(x_rect, &case.x),
            View::new(case.w_rect(), &case.w),
            View::new(out, &y),
            View::new(out, &case.dy),
            Some(ViewMut::new(x_rect, &mut dx)),
            ViewMut::new(case.w_rect(), &mut dw),
            Some(ViewMut::new(case.b_rect(), &mut db)),
        );
        let (want_dx, want_dw, want_db) = run_backward(case, &y, true, Blocking::Default);
        assert_eq!(dx, want_dx.unwrap());
        assert_eq!(dw, want_dw);
        assert_eq!(db, want_db);
    }
}
