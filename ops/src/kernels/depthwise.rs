//! Depthwise convolution (each group one input channel: MobileNet's and EfficientNet's 3×3 and
//! 5×5 convolutions), forward and backward over one output tile, computed directly.
//!
//! im2col + GEMM is the wrong shape here: a group's GEMM is one output row by `kh·kw` taps, so
//! the column matrix is `kh·kw` copies of the input for a product of as many multiply-adds. The
//! direct loops are memory-bound, as the op is.
//!
//! A plane's input window (the rows and columns its output tile reads, zero where they fall in
//! the padding) is copied once into `sh·sw` phases by row and column residue of the stride, each
//! `Wq` wide. In that layout every tap reads one contiguous run: output `(oh, ow)` at position
//! `oh·Wq + ow` reads its tap `(ki, kj)` at the same position plus a fixed offset. So each tap is
//! one multiply-add over the whole plane, which vectorises however narrow the rows are (EfficientNet's
//! 7×7 planes), instead of one short loop per output row; the `Wq − OW` columns between rows are
//! computed and dropped.
//!
//! Each output sums its taps in row-major `(ki, kj)` order, whatever the tile; a plane `(n, c)` is
//! independent of the others, so planes spread over the rayon pool. The weight and bias gradients
//! of a channel sum over the tile's samples in order, one channel per task.

use super::conv2d::{bias_and_activation, relu_mask};
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

/// Where a tile's planes and windows sit in the input view, and the phased window layout.
struct Planes {
    kernel: [usize; 2],
    stride: [usize; 2],
    /// Output channels per input channel (the depth multiplier).
    multiplier: usize,
    out: Rect,
    x: Rect,
    /// Per axis, the window's phase positions `i` (phase `a` holds window position `i·s + a`)
    /// whose input lies inside the input, as view positions: `(a, positions, first view
    /// position)`; consecutive positions are a stride apart in the view.
    inside: [Vec<(Range<usize>, usize)>; 2],
    /// Rows and columns of one phase.
    phase: [usize; 2],
}

impl Planes {
    fn new(op: &Conv2d, in_shape: Shape, x: &Rect, out: &Rect) -> Planes {
        let in_size = [in_shape.dim(2), in_shape.dim(3)];
        let mut phase = [0; 2];
        let inside = [0, 1].map(|axis| {
            let (s, k, p) = (op.stride[axis], op.kernel[axis], op.padding[axis]);
            let outs = out.extent(2 + axis);
            // the window: input positions origin .. origin + len, origin = lo·s − p
            let len = match outs {
                0 => 0,
                n => (n - 1) * s + k,
            };
            phase[axis] = len.div_ceil(s);
            let origin = (out.lo[2 + axis] * s) as isize - p as isize;
            let size = in_size[axis] as isize;
            (0..s)
                .map(|a| {
                    // window positions i·s + a < len whose input origin + i·s + a is in [0, size);
                    // a phase past the kernel (a stride over it) is never read
                    let count = match a < k {
                        true => len.saturating_sub(a).div_ceil(s) as isize,
                        false => 0,
                    };
                    let at = |i: isize| origin + i * s as isize + a as isize;
                    let first = (0..count).find(|&i| at(i) >= 0).unwrap_or(count);
                    let end = (first..count).find(|&i| at(i) >= size).unwrap_or(count);
                    let view_first = if first < end {
                        let global = at(first) as usize;
                        assert!(
                            x.lo[2 + axis] <= global && (at(end - 1) as usize) < x.hi[2 + axis],
                            "the input view {x} does not hold the window of the tile {out}"
                        );
                        global - x.lo[2 + axis]
                    } else {
                        0
                    };
                    (first as usize..end as usize, view_first)
                })
                .collect()
        });
        Planes {
            kernel: op.kernel,
            stride: op.stride,
            multiplier: op.out_channels / in_shape.dim(1),
            out: *out,
            x: *x,
            inside,
            phase,
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

    /// Floats of the phased window.
    fn window_len(&self) -> usize {
        self.stride[0] * self.stride[1] * self.phase[0] * self.phase[1]
    }

    /// Floats of an output plane laid out `phase[1]` wide.
    fn wide_len(&self) -> usize {
        self.out.extent(2) * self.phase[1]
    }

    /// The positions a tap's multiply-add runs over: the last output's plus one.
    fn span(&self) -> usize {
        match self.out.extent(2) {
            0 => 0,
            rows => (rows - 1) * self.phase[1] + self.out.extent(3),
        }
    }

    /// Where tap `(ki, kj)` reads in the phased window, relative to its output's position.
    fn tap_offsets(&self) -> Vec<usize> {
        let ([sh, sw], [ph, pw]) = (self.stride, self.phase);
        let (kh, kw) = (self.kernel[0], self.kernel[1]);
        (0..kh * kw)
            .map(|t| {
                let (ki, kj) = (t / kw, t % kw);
                ((ki % sh) * sw + kj % sw) * ph * pw + (ki / sh) * pw + kj / sw
            })
            .collect()
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

    /// Calls `f(window position, view position, run length)` for each run of window positions
    /// inside the input: consecutive in the window, `stride[1]` apart in the view plane.
    fn for_each_inside(&self, mut f: impl FnMut(usize, usize, usize)) {
        let ([sh, sw], [ph, pw]) = (self.stride, self.phase);
        let x_w = self.x.extent(3);
        for (a, (rows, row0)) in self.inside[0].iter().enumerate() {
            for (b, (cols, col0)) in self.inside[1].iter().enumerate() {
                let base = (a * sw + b) * ph * pw;
                for (r, i) in rows.clone().enumerate() {
                    let view = (row0 + r * sh) * x_w + col0;
                    f(base + i * pw + cols.start, view, cols.len());
                }
            }
        }
    }

    /// The phased window of `x_plane` (a view plane), zero in the padding.
    fn fill_window(&self, x_plane: &[f32], window: &mut [f32]) {
        window.fill(0.0);
        let sw = self.stride[1];
        self.for_each_inside(|at, view, len| {
            let dst = &mut window[at..at + len];
            if sw == 1 {
                dst.copy_from_slice(&x_plane[view..view + len]);
            } else {
                for (d, &v) in dst.iter_mut().zip(x_plane[view..].iter().step_by(sw)) {
                    *d = v;
                }
            }
        });
    }

    /// Writes a phased window's values inside the input back into `x_plane` (a view plane), the
    /// rest of which it leaves.
    fn write_window(&self, window: &[f32], x_plane: &mut [f32]) {
        let sw = self.stride[1];
        self.for_each_inside(|at, view, len| {
            let src = &window[at..at + len];
            if sw == 1 {
                x_plane[view..view + len].copy_from_slice(src);
            } else {
                for (d, &v) in x_plane[view..].iter_mut().step_by(sw).zip(src) {
                    *d = v;
                }
            }
        });
    }

    /// An output plane laid out `phase[1]` wide, zero between the rows.
    fn widen(&self, plane: &[f32], wide: &mut [f32]) {
        let (ow, pw) = (self.out.extent(3), self.phase[1]);
        for (dst, src) in wide.chunks_mut(pw).zip(plane.chunks(ow)) {
            dst[..ow].copy_from_slice(src);
            dst[ow..].fill(0.0);
        }
    }

    /// The output plane of a plane laid out `phase[1]` wide.
    fn narrow(&self, wide: &[f32], plane: &mut [f32]) {
        let (ow, pw) = (self.out.extent(3), self.phase[1]);
        for (dst, src) in plane.chunks_mut(ow).zip(wide.chunks(pw)) {
            dst.copy_from_slice(&src[..ow]);
        }
    }
}

/// `acc[i] += w · x[i]`.
fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
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
    let (offsets, span) = (planes.tap_offsets(), planes.span());
    y.data
        .par_chunks_mut(out_len)
        .enumerate()
        .for_each(|(plane, y_plane)| {
            let (n, c) = planes.plane(plane);
            let xp = planes.x_plane(n, c);
            let local = c - w.rect.lo[0];
            let weights = &w.data[local * taps..(local + 1) * taps];
            with_scratch(
                [planes.window_len(), planes.wide_len()],
                |[window, wide]| {
                    planes.fill_window(&x.data[xp * x_len..(xp + 1) * x_len], window);
                    wide.fill(0.0);
                    for (&wt, &at) in weights.iter().zip(&offsets) {
                        axpy(&mut wide[..span], wt, &window[at..at + span]);
                    }
                    planes.narrow(wide, y_plane);
                },
            );
            let bias = b.as_ref().map(|b| {
                let at = c - b.rect.lo[0];
                &b.data[at..at + 1]
            });
            bias_and_activation(y_plane, out_len, bias, op.activation);
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
    let channels = planes.out.extent(1);
    let (offsets, span) = (planes.tap_offsets(), planes.span());
    // the output gradient through the fused activation
    let dz: Cow<[f32]> = match op.activation {
        Activation::None => Cow::Borrowed(dy.data),
        Activation::Relu => {
            let mut dz = vec![0.0; dy.data.len()];
            relu_mask(y.data, dy.data, &mut dz);
            Cow::Owned(dz)
        }
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
                    with_scratch(
                        [planes.window_len(), planes.wide_len()],
                        |[window, wide]| {
                            window.fill(0.0);
                            for c in
                                (first_c..first_c + planes.multiplier).filter(|&c| in_tile(1, c))
                            {
                                let plane =
                                    (n - planes.out.lo[0]) * channels + (c - planes.out.lo[1]);
                                planes.widen(&dz[plane * out_len..(plane + 1) * out_len], wide);
                                let local = c - w.rect.lo[0];
                                let weights = &w.data[local * taps..(local + 1) * taps];
                                for (&wt, &at) in weights.iter().zip(&offsets) {
                                    axpy(&mut window[at..at + span], wt, &wide[..span]);
                                }
                            }
                            planes.write_window(window, dx_plane);
                        },
                    );
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
                with_scratch(
                    [planes.window_len(), planes.wide_len()],
                    |[window, wide]| {
                        planes.fill_window(&x.data[xp * x_len..(xp + 1) * x_len], window);
                        planes.widen(dz_plane, wide);
                        for (d, &at) in dw_c.iter_mut().zip(&offsets) {
                            *d += dot(&wide[..span], &window[at..at + span]);
                        }
                    },
                );
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
            // a stride over the kernel: columns no tap reads
            (
                Conv2d::new(4, 1).stride(2).groups(4),
                Shape::nchw(2, 4, 7, 6),
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
