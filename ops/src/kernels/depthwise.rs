//! Depthwise convolution (each group one input channel: MobileNet's and EfficientNet's 3×3 and
//! 5×5 convolutions), forward and backward over one output tile, computed directly.
//!
//! im2col + GEMM is the wrong shape here: a group's GEMM is one output row by `kh·kw` taps, so
//! the column matrix is `kh·kw` copies of the input for a product of as many multiply-adds. The
//! direct loops read each input row once per tap row and are memory-bound, as the op is.
//!
//! Each output sums its taps in row-major `(ki, kj)` order, whatever the tile; a plane `(n, c)` is
//! independent of the others, so planes spread over the rayon pool. The weight and bias gradients
//! of a channel sum over the tile's samples in order, one channel per task.

use super::conv2d::Phases;
use super::gemm::with_scratch;
use super::{View, ViewMut};
use crate::op::{Activation, Conv2d};
use crate::shape::{Rect, Shape};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Whether `conv2d_forward`/`conv2d_backward` take the depthwise path: one input channel a group.
pub fn is_depthwise(op: &Conv2d, in_shape: Shape) -> bool {
    op.groups > 1 && op.groups == in_shape.dim(1)
}

/// Where a tile's planes and windows sit in the input view.
struct Planes {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    in_size: [usize; 2],
    /// Output channels per input channel (the depth multiplier).
    multiplier: usize,
    out: Rect,
    x: Rect,
    /// For a horizontal stride over 1, the input rows split by column residue, so that a tap's
    /// reads are contiguous.
    phases: Option<Phases>,
    /// Per kernel column: the tile-local output columns it reads for, and the view column of the
    /// first of them (the next ones a stride apart).
    column_taps: Vec<(Range<usize>, usize)>,
}

impl Planes {
    fn new(op: &Conv2d, in_shape: Shape, x: &Rect, out: &Rect) -> Planes {
        let mut planes = Planes {
            kernel: op.kernel,
            stride: op.stride,
            padding: op.padding,
            in_size: [in_shape.dim(2), in_shape.dim(3)],
            multiplier: op.out_channels / in_shape.dim(1),
            out: *out,
            x: *x,
            phases: (op.stride[1] > 1).then(|| Phases::new(op.stride[1], x.extent(3))),
            column_taps: Vec::new(),
        };
        planes.column_taps = (0..op.kernel[1]).map(|kj| planes.tap(1, kj)).collect();
        planes
    }

    /// Where view column `col` sits in a row split into phases.
    fn column(&self, col: usize) -> usize {
        self.phases.as_ref().map_or(col, |p| p.position(col))
    }

    /// The input plane to read taps from: itself, or split into phases in `scratch`.
    fn phased<'a>(&self, plane: &'a [f32], scratch: &'a mut [f32]) -> &'a [f32] {
        match &self.phases {
            None => plane,
            Some(phases) => {
                phases.split(plane, scratch);
                scratch
            }
        }
    }

    /// Scratch for one phased plane (none at stride 1).
    fn phased_len(&self) -> usize {
        match self.phases {
            None => 0,
            Some(_) => self.x_plane_len(),
        }
    }

    fn out_plane_len(&self) -> usize {
        self.out.extent(2) * self.out.extent(3)
    }

    fn x_plane_len(&self) -> usize {
        self.x.extent(2) * self.x.extent(3)
    }

    fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }

    /// The global sample and output channel of the tile's plane `plane`.
    fn plane(&self, plane: usize) -> (usize, usize) {
        let channels = self.out.extent(1);
        (
            self.out.lo[0] + plane / channels,
            self.out.lo[1] + plane % channels,
        )
    }

    /// The input-view plane that output plane (`n`, `c`) reads.
    fn x_plane(&self, n: usize, c: usize) -> usize {
        let ci = c / self.multiplier;
        (n - self.x.lo[0]) * self.x.extent(1) + (ci - self.x.lo[1])
    }

    /// For tap `k` along `axis` (0 rows, 1 columns): the tile's outputs whose input position
    /// `o·s + k − p` lies inside the input, and the input-view position of the first of them.
    fn tap(&self, axis: usize, k: usize) -> (Range<usize>, usize) {
        let (s, p, size) = (self.stride[axis], self.padding[axis], self.in_size[axis]);
        let (o0, o1) = (self.out.lo[2 + axis], self.out.hi[2 + axis]);
        let first = p.saturating_sub(k).div_ceil(s).max(o0);
        let end = (size + p).saturating_sub(k).div_ceil(s).min(o1).max(first);
        let start = (first * s + k)
            .saturating_sub(p)
            .saturating_sub(self.x.lo[2 + axis]);
        (first - o0..end - o0, start)
    }

    /// Calls `f(oh, out_cols, x_row, x_col, tap)` for each tap that reads inside the input: the
    /// tile-local output row, the tile-local output columns that tap reads for, the input view's
    /// row and the column of the first of them (the next ones `stride` apart), and the tap's
    /// index `ki·kw + kj`; row-major `(ki, kj)` order for each output row.
    fn for_each_tap(&self, mut f: impl FnMut(usize, Range<usize>, usize, usize, usize)) {
        let (kh, kw) = (self.kernel[0], self.kernel[1]);
        for oh in 0..self.out.extent(2) {
            let global = self.out.lo[2] + oh;
            for ki in 0..kh {
                let Some(ih) = (global * self.stride[0] + ki).checked_sub(self.padding[0]) else {
                    continue;
                };
                if ih >= self.in_size[0] {
                    continue;
                }
                let x_row = ih - self.x.lo[2];
                for (kj, (out_cols, x_col)) in self.column_taps.iter().enumerate() {
                    f(oh, out_cols.clone(), x_row, *x_col, ki * kw + kj);
                }
            }
        }
    }
}

/// The output tile `y` of a depthwise convolution; arguments as `conv2d::conv2d_forward`'s.
pub fn depthwise_forward(
    op: &Conv2d,
    in_shape: Shape,
    x: View,
    w: View,
    b: Option<View>,
    y: ViewMut,
) {
    let planes = Planes::new(op, in_shape, &x.rect, &y.rect);
    let (out_len, x_len, taps) = (planes.out_plane_len(), planes.x_plane_len(), planes.taps());
    if out_len == 0 {
        return;
    }
    let (out_w, x_w) = (planes.out.extent(3), planes.x.extent(3));
    y.data
        .par_chunks_mut(out_len)
        .enumerate()
        .for_each(|(plane, y_plane)| {
            let (n, c) = planes.plane(plane);
            let xp = planes.x_plane(n, c);
            let local = c - w.rect.lo[0];
            let weights = &w.data[local * taps..(local + 1) * taps];
            y_plane.fill(0.0);
            with_scratch([planes.phased_len()], |[scratch]| {
                let x_plane = planes.phased(&x.data[xp * x_len..(xp + 1) * x_len], scratch);
                planes.for_each_tap(|oh, cols, x_row, x_col, tap| {
                    let wt = weights[tap];
                    let row = &mut y_plane[oh * out_w..(oh + 1) * out_w][cols];
                    let start = x_row * x_w + planes.column(x_col);
                    for (y, &v) in row.iter_mut().zip(&x_plane[start..]) {
                        *y += wt * v;
                    }
                });
            });
            let bias = b.as_ref().map_or(0.0, |b| b.data[c - b.rect.lo[0]]);
            for y in y_plane.iter_mut() {
                let v = *y + bias;
                *y = match op.activation {
                    Activation::None => v,
                    Activation::Relu => v.max(0.0),
                };
            }
        });
}

/// This tile's gradients of a depthwise convolution, overwritten; arguments as
/// `conv2d::conv2d_backward`'s.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_backward(
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
    let planes = Planes::new(op, in_shape, &x.rect, &y.rect);
    let (out_len, x_len, taps) = (planes.out_plane_len(), planes.x_plane_len(), planes.taps());
    let (out_w, x_w) = (planes.out.extent(3), planes.x.extent(3));
    let channels = planes.out.extent(1);
    // the output gradient through the fused activation
    let dz: Cow<[f32]> = match op.activation {
        Activation::None => Cow::Borrowed(dy.data),
        Activation::Relu => Cow::Owned(
            y.data
                .iter()
                .zip(dy.data)
                .map(|(&y, &g)| if y > 0.0 { g } else { 0.0 })
                .collect(),
        ),
    };
    if let Some(dx) = dx {
        dx.data.fill(0.0);
        if out_len > 0 && x_len > 0 {
            // an input plane gathers from the output planes of its channels (one, or the
            // multiplier's), in the tile's order
            dx.data
                .par_chunks_mut(x_len)
                .enumerate()
                .for_each(|(xp, dx_plane)| {
                    let (n, ci) = (
                        planes.x.lo[0] + xp / planes.x.extent(1),
                        planes.x.lo[1] + xp % planes.x.extent(1),
                    );
                    let in_tile = |axis: usize, v: usize| {
                        (planes.out.lo[axis]..planes.out.hi[axis]).contains(&v)
                    };
                    if !in_tile(0, n) {
                        return;
                    }
                    let first_c = ci * planes.multiplier;
                    with_scratch([planes.phased_len()], |[phased]| {
                        // gathered in phases where strided, then put back in column order
                        let gather: &mut [f32] = if phased.is_empty() {
                            dx_plane
                        } else {
                            phased.fill(0.0);
                            phased
                        };
                        for c in (first_c..first_c + planes.multiplier).filter(|&c| in_tile(1, c)) {
                            let plane = (n - planes.out.lo[0]) * channels + (c - planes.out.lo[1]);
                            let dz_plane = &dz[plane * out_len..(plane + 1) * out_len];
                            let local = c - w.rect.lo[0];
                            let weights = &w.data[local * taps..(local + 1) * taps];
                            planes.for_each_tap(|oh, cols, x_row, x_col, tap| {
                                let wt = weights[tap];
                                let g = &dz_plane[oh * out_w..(oh + 1) * out_w][cols];
                                let start = x_row * x_w + planes.column(x_col);
                                for (d, &g) in gather[start..].iter_mut().zip(g) {
                                    *d += wt * g;
                                }
                            });
                        }
                        if let Some(phases) = &planes.phases {
                            phases.merge(phased, dx_plane);
                        }
                    });
                });
        }
    }
    // weight and bias gradients: a channel at a time, over the tile's samples in order
    let samples = planes.out.extent(0);
    let db_chunks: Vec<Option<&mut f32>> = match db {
        Some(db) => db.data.iter_mut().map(Some).collect(),
        None => (0..channels).map(|_| None).collect(),
    };
    dw.data
        .par_chunks_mut(taps)
        .zip(db_chunks)
        .enumerate()
        .for_each(|(local, (dw_c, db_c))| {
            dw_c.fill(0.0);
            let c = planes.out.lo[1] + local;
            let mut bias = 0.0f32;
            for sample in 0..samples {
                let n = planes.out.lo[0] + sample;
                let plane = sample * channels + local;
                let dz_plane = &dz[plane * out_len..(plane + 1) * out_len];
                let xp = planes.x_plane(n, c);
                with_scratch([planes.phased_len()], |[scratch]| {
                    let x_plane = planes.phased(&x.data[xp * x_len..(xp + 1) * x_len], scratch);
                    planes.for_each_tap(|oh, cols, x_row, x_col, tap| {
                        let g = &dz_plane[oh * out_w..(oh + 1) * out_w][cols];
                        let start = x_row * x_w + planes.column(x_col);
                        dw_c[tap] += dot(g, &x_plane[start..start + g.len()]);
                    });
                });
                bias += dz_plane.iter().sum::<f32>();
            }
            if let Some(db_c) = db_c {
                *db_c = bias;
            }
        });
}

/// `Σ a·b` in eight interleaved partial sums (vectorised; the same order for the same lengths).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in a8.zip(b8) {
        for k in 0..8 {
            lanes[k] += a[k] * b[k];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{max_rel_diff, random};
    use crate::kernels::conv2d::{gemm_backward, gemm_forward};
    use crate::op::OpSpec;

    /// The GEMM path's output of the same depthwise layer over the whole input, for comparison.
    fn gemm_output(op: &Conv2d, input: Shape, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
        let out = op.infer_shape(&[input]).unwrap().full_rect();
        let (wr, br) = (
            op.params(&[input])[0].shape.full_rect(),
            Shape::new(&[op.out_channels]).full_rect(),
        );
        let mut y = vec![0.0; out.volume()];
        gemm_forward(
            op,
            input,
            View::new(input.full_rect(), x),
            View::new(wr, w),
            op.bias.then(|| View::new(br, b)),
            ViewMut::new(out, &mut y),
        );
        y
    }

    #[test]
    fn depthwise_equals_the_gemm_path_whole_and_tiled() {
        let cases = [
            (
                Conv2d::new(6, 3).padding(1).groups(6),
                Shape::nchw(2, 6, 9, 8),
            ),
            (
                Conv2d::new(4, 3).stride(2).padding(1).groups(4).relu(),
                Shape::nchw(2, 4, 9, 10),
            ),
            (
                Conv2d::new(3, 5).stride(2).padding(2).groups(3).no_bias(),
                Shape::nchw(1, 3, 11, 7),
            ),
            // a depth multiplier of 2
            (
                Conv2d::rect(6, 3, 1).padding_hw(1, 0).groups(3),
                Shape::nchw(2, 3, 6, 5),
            ),
        ];
        for (i, (op, input)) in cases.into_iter().enumerate() {
            assert!(is_depthwise(&op, input));
            let out = op.infer_shape(&[input]).unwrap();
            let seed = 10 * i as u64;
            let x = random(input.numel(), seed);
            let w = random(op.params(&[input])[0].shape.numel(), seed + 1);
            let b = random(op.out_channels, seed + 2);
            let dy = random(out.numel(), seed + 3);
            let gy = gemm_output(&op, input, &x, &w, &b);
            // the whole tensor, then a tile of some samples, channels, rows and columns
            let whole = out.full_rect();
            let inner = Rect::new(
                &[0, 1, 1, 1],
                &[out.dim(0), out.dim(1), out.dim(2) - 1, out.dim(3)],
            );
            for tile in [whole, inner] {
                let what = format!("{op:?} on {input}, tile {tile}");
                let x_rect = op.project(&[input], &tile)[0];
                let x_tile = crate::kernels::check::cut(&x, &input.full_rect(), &x_rect);
                let w_full = op.params(&[input])[0].shape.full_rect();
                let wr = w_full.with_axis(0, tile.lo[1], tile.hi[1]);
                let w_tile = crate::kernels::check::cut(&w, &w_full, &wr);
                let br = Shape::new(&[op.out_channels])
                    .full_rect()
                    .with_axis(0, tile.lo[1], tile.hi[1]);
                let b_tile = &b[tile.lo[1]..tile.hi[1]];
                let mut y = vec![f32::NAN; tile.volume()];
                depthwise_forward(
                    &op,
                    input,
                    View::new(x_rect, &x_tile),
                    View::new(wr, &w_tile),
                    op.bias.then(|| View::new(br, b_tile)),
                    ViewMut::new(tile, &mut y),
                );
                let want = crate::kernels::check::cut(&gy, &whole, &tile);
                assert!(max_rel_diff(&y, &want) < 1e-5, "y of {what}");
                // the tile's gradients, as the GEMM path gives them for the same tile
                let (mut dx, mut dw, mut db) = (
                    vec![f32::NAN; x_rect.volume()],
                    vec![f32::NAN; wr.volume()],
                    vec![f32::NAN; br.volume()],
                );
                let dy_tile = crate::kernels::check::cut(&dy, &whole, &tile);
                let (mut gdx, mut gdw, mut gdb) = (dx.clone(), dw.clone(), db.clone());
                for (gemm, dx, dw, db) in [
                    (false, &mut dx, &mut dw, &mut db),
                    (true, &mut gdx, &mut gdw, &mut gdb),
                ] {
                    let backward = if gemm {
                        gemm_backward
                    } else {
                        depthwise_backward
                    };
                    backward(
                        &op,
                        input,
                        View::new(x_rect, &x_tile),
                        View::new(wr, &w_tile),
                        View::new(tile, &y),
                        View::new(tile, &dy_tile),
                        Some(ViewMut::new(x_rect, dx)),
                        ViewMut::new(wr, dw),
                        op.bias.then(|| ViewMut::new(br, db)),
                    );
                }
                assert!(max_rel_diff(&dx, &gdx) < 1e-5, "dx of {what}");
                assert!(max_rel_diff(&dw, &gdw) < 1e-5, "dw of {what}");
                if op.bias {
                    assert!(max_rel_diff(&db, &gdb) < 1e-5, "db of {what}");
                }
            }
        }
    }
}
