//! Max and average 2-D pooling, forward and backward, over one output tile.
//!
//! Windows are clipped to the input: max pooling ignores padded positions, average pooling counts
//! them as zeros (divides by the window's extent in the padded input: `kh·kw`, less where a
//! `ceil_mode` window runs past the padding; PyTorch's `count_include_pad=True`). Max-pool backward routes
//! each output's gradient to the first maximal element in window scan order (row by row), which
//! depends only on the window's values and so is the same whatever the tiling.
//!
//! Planes `(n, c)` are independent and are spread over the rayon pool.

use super::{View, ViewMut};
use crate::op::{PoolKind, PoolWindows};
use crate::shape::{Rect, Shape};
use rayon::prelude::*;
use std::ops::Range;

/// Computes the output tile `y` from an input view `x` whose rect contains
/// `op.project(in_shape, &y.rect)`; `in_shape` is the full input's shape.
pub fn pool2d_forward(op: PoolWindows, in_shape: Shape, x: View, y: ViewMut) {
    let windows = Windows::new(op, in_shape, &x.rect, &y.rect);
    debug_assert_eq!(x.data.len(), x.rect.volume());
    debug_assert_eq!(y.data.len(), y.rect.volume());
    let out_plane = windows.out_plane_len();
    if out_plane == 0 {
        return;
    }
    y.data
        .par_chunks_mut(out_plane)
        .enumerate()
        .for_each(|(plane, y_plane)| {
            let x_plane = windows.x_plane(x.data, windows.out_plane_to_x_plane(plane));
            let outputs = y_plane.chunks_exact_mut(windows.col_windows.len());
            for (y_row, rows) in outputs.zip(&windows.row_windows) {
                for (y, cols) in y_row.iter_mut().zip(&windows.col_windows) {
                    *y = match windows.kind {
                        PoolKind::Max => windows.max(x_plane, &rows.range, &cols.range),
                        PoolKind::Avg => {
                            windows.sum(x_plane, &rows.range, &cols.range)
                                * inverse_area(rows, cols)
                        }
                    };
                }
            }
        });
}

/// Overwrites `dx` (over `x.rect`) with this tile's input gradient given `dy` over the output tile;
/// positions no window of the tile reads get 0. `x` is the forward input (max pooling needs it to find
/// each window's maximum).
pub fn pool2d_backward(op: PoolWindows, in_shape: Shape, x: View, dy: View, dx: ViewMut) {
    let windows = Windows::new(op, in_shape, &x.rect, &dy.rect);
    debug_assert_eq!(x.data.len(), x.rect.volume());
    debug_assert_eq!(dy.data.len(), dy.rect.volume());
    debug_assert_eq!(dx.rect, x.rect, "dx must cover the input view");
    debug_assert_eq!(dx.data.len(), x.data.len());
    dx.data.fill(0.0);
    let (x_plane_len, out_plane_len) = (windows.x_plane_len(), windows.out_plane_len());
    if x_plane_len == 0 || out_plane_len == 0 {
        return;
    }
    let x_channels = x.rect.extent(1);
    dx.data
        .par_chunks_mut(x_plane_len)
        .enumerate()
        .for_each(|(plane, dx_plane)| {
            let (n, c) = (
                x.rect.lo[0] + plane / x_channels,
                x.rect.lo[1] + plane % x_channels,
            );
            let Some(out_plane) = windows.out_plane_of(n, c) else {
                return;
            };
            let x_plane = windows.x_plane(x.data, plane);
            let dy_plane = &dy.data[out_plane * out_plane_len..(out_plane + 1) * out_plane_len];
            let grads = dy_plane.chunks_exact(windows.col_windows.len());
            for (dy_row, rows) in grads.zip(&windows.row_windows) {
                for (&g, cols) in dy_row.iter().zip(&windows.col_windows) {
                    match windows.kind {
                        PoolKind::Max => {
                            dx_plane[windows.argmax(x_plane, &rows.range, &cols.range)] += g
                        }
                        PoolKind::Avg => {
                            let share = g * inverse_area(rows, cols);
                            let cols = &cols.range;
                            for h in rows.range.clone() {
                                let start = h * windows.x_w;
                                for d in &mut dx_plane[start + cols.start..start + cols.end] {
                                    *d += share;
                                }
                            }
                        }
                    }
                }
            }
        });
}

/// One axis of an output's window.
struct Span {
    /// The view positions it covers (clipped to the input).
    range: Range<usize>,
    /// How many positions of the padded input it covers.
    padded_len: usize,
}

/// What an average pool multiplies a window's sum by: the reciprocal, rounded to f32 once, of the
/// window's extent in the padded input.
fn inverse_area(rows: &Span, cols: &Span) -> f32 {
    1.0 / (rows.padded_len * cols.padded_len) as f32
}

/// The pooling windows of an output tile, in the coordinates of an input view.
struct Windows {
    kind: PoolKind,
    out: Rect,
    x: Rect,
    /// Width of the input view.
    x_w: usize,
    /// Per tile output row, its windows' rows.
    row_windows: Vec<Span>,
    /// Per tile output column, its windows' columns.
    col_windows: Vec<Span>,
}

impl Windows {
    fn new(op: PoolWindows, in_shape: Shape, x: &Rect, out: &Rect) -> Windows {
        debug_assert_eq!(in_shape.ndim(), 4, "pool2d input is NCHW");
        debug_assert!(
            x.contains(&op.project(in_shape, out)),
            "input view {x} does not contain the projection of output tile {out}"
        );
        let view_windows = |axis: usize| -> Vec<Span> {
            let (i, size) = (axis - 2, in_shape.dim(axis));
            (out.lo[axis]..out.hi[axis])
                .map(|o| {
                    let (global, padded_len) = op.window(i, o, size);
                    Span {
                        range: global.start - x.lo[axis]..global.end - x.lo[axis],
                        padded_len,
                    }
                })
                .collect()
        };
        Windows {
            kind: op.kind(),
            out: *out,
            x: *x,
            x_w: x.extent(3),
            row_windows: view_windows(2),
            col_windows: view_windows(3),
        }
    }

    fn out_plane_len(&self) -> usize {
        self.out.extent(2) * self.out.extent(3)
    }

    fn x_plane_len(&self) -> usize {
        self.x.extent(2) * self.x.extent(3)
    }

    /// The input-view plane index of output-tile plane `plane`.
    fn out_plane_to_x_plane(&self, plane: usize) -> usize {
        let (n, c) = (
            self.out.lo[0] + plane / self.out.extent(1),
            self.out.lo[1] + plane % self.out.extent(1),
        );
        (n - self.x.lo[0]) * self.x.extent(1) + (c - self.x.lo[1])
    }

    /// The output-tile plane index of global sample `n`, channel `c`, if the tile has it.
    fn out_plane_of(&self, n: usize, c: usize) -> Option<usize> {
        let inside = |axis: usize, v: usize| (self.out.lo[axis]..self.out.hi[axis]).contains(&v);
        (inside(0, n) && inside(1, c))
            .then(|| (n - self.out.lo[0]) * self.out.extent(1) + (c - self.out.lo[1]))
    }

    fn x_plane<'a>(&self, x: &'a [f32], plane: usize) -> &'a [f32] {
        let len = self.x_plane_len();
        &x[plane * len..(plane + 1) * len]
    }

    /// The window's rows as slices of a plane.
    fn window_rows<'a>(
        &self,
        plane: &'a [f32],
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> impl Iterator<Item = &'a [f32]> + use<'a> {
        let (x_w, cols) = (self.x_w, cols.clone());
        rows.clone()
            .map(move |h| &plane[h * x_w + cols.start..h * x_w + cols.end])
    }

    fn max(&self, plane: &[f32], rows: &Range<usize>, cols: &Range<usize>) -> f32 {
        let mut max = f32::NEG_INFINITY;
        for row in self.window_rows(plane, rows, cols) {
            for &v in row {
                max = if v > max { v } else { max };
            }
        }
        max
    }

    /// Plane offset of the first maximum of a window, scanning row by row.
    fn argmax(&self, plane: &[f32], rows: &Range<usize>, cols: &Range<usize>) -> usize {
        let mut best = (rows.start * self.x_w + cols.start, f32::NEG_INFINITY);
        for h in rows.clone() {
            let start = h * self.x_w + cols.start;
            for (i, &v) in plane[start..h * self.x_w + cols.end].iter().enumerate() {
                if v > best.1 {
                    best = (start + i, v);
                }
            }
        }
        best.0
    }

    fn sum(&self, plane: &[f32], rows: &Range<usize>, cols: &Range<usize>) -> f32 {
        self.window_rows(plane, rows, cols)
            .map(|row| row.iter().sum::<f32>())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, cut, halves, max_rel_diff, random};
    use crate::op::{AdaptiveAvgPool2d, OpSpec, Pool2d};
    use crate::shape::add_rect;

    /// Distinct values at least 0.03 apart in shuffled order, so that no finite-difference probe
    /// (±1e-2) can change which element of a window is the maximum.
    fn tie_free(n: usize, seed: u64) -> Vec<f32> {
        let keys = random(n, seed);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
        let mut x = vec![0.0; n];
        for (rank, &i) in order.iter().enumerate() {
            x[i] = (rank as f32 - n as f32 / 2.0) * 0.03;
        }
        x
    }

    /// A pooling layer of either kind, as the kernels see it and as its op infers shapes.
    #[derive(Clone, Debug)]
    enum Case {
        Sliding(Pool2d),
        Adaptive(AdaptiveAvgPool2d),
    }

    impl Case {
        fn windows(&self) -> PoolWindows<'_> {
            match self {
                Case::Sliding(p) => p.into(),
                Case::Adaptive(a) => a.windows(),
            }
        }

        fn spec(&self) -> &dyn OpSpec {
            match self {
                Case::Sliding(p) => p,
                Case::Adaptive(a) => a,
            }
        }
    }

    fn forward_whole(op: &Pool2d, input: Shape, x: &[f32]) -> Vec<f32> {
        forward_case(&Case::Sliding(op.clone()), input, x)
    }

    fn backward_whole(op: &Pool2d, input: Shape, x: &[f32], dy: &[f32]) -> Vec<f32> {
        backward_case(&Case::Sliding(op.clone()), input, x, dy)
    }

    fn forward_case(op: &Case, input: Shape, x: &[f32]) -> Vec<f32> {
        let out = op.spec().infer_shape(&[input]).unwrap().full_rect();
        let mut y = vec![f32::NAN; out.volume()];
        pool2d_forward(
            op.windows(),
            input,
            View::new(input.full_rect(), x),
            ViewMut::new(out, &mut y),
        );
        y
    }

    fn backward_case(op: &Case, input: Shape, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let out = op.spec().infer_shape(&[input]).unwrap().full_rect();
        let mut dx = vec![f32::NAN; input.numel()];
        pool2d_backward(
            op.windows(),
            input,
            View::new(input.full_rect(), x),
            View::new(out, dy),
            ViewMut::new(input.full_rect(), &mut dx),
        );
        dx
    }

    fn cases() -> Vec<(Case, Shape)> {
        let sliding = [
            (Pool2d::max(3).stride(2).padding(1), Shape::nchw(2, 3, 9, 8)),
            (Pool2d::avg(3).stride(2).padding(1), Shape::nchw(2, 3, 9, 8)),
            (Pool2d::max(3).stride(2), Shape::nchw(2, 2, 11, 11)),
            (Pool2d::avg(2), Shape::nchw(1, 3, 6, 7)),
            (
                Pool2d {
                    kind: PoolKind::Max,
                    kernel: [2, 3],
                    stride: [1, 2],
                    padding: [1, 1],
                    ceil_mode: false,
                },
                Shape::nchw(2, 2, 5, 6),
            ),
            (
                Pool2d::max(3).stride(2).ceil_mode(),
                Shape::nchw(2, 2, 8, 7),
            ),
            (
                Pool2d::avg(3).stride(2).padding(1).ceil_mode(),
                Shape::nchw(1, 3, 8, 6),
            ),
        ];
        // overlapping windows (7 into 3), windows of 1 and 2 (upsampling 3 into 5), and whole
        let adaptive = [
            ([3, 2], Shape::nchw(2, 2, 7, 6)),
            ([5, 4], Shape::nchw(1, 3, 3, 4)),
            ([1, 1], Shape::nchw(2, 2, 5, 3)),
        ];
        let sliding = sliding.into_iter().map(|(p, s)| (Case::Sliding(p), s));
        let adaptive = adaptive
            .into_iter()
            .map(|(output, s)| (Case::Adaptive(AdaptiveAvgPool2d { output }), s));
        sliding.chain(adaptive).collect()
    }

    #[test]
    fn small_example_matches_pytorch() {
        // torch.nn.functional.{max,avg}_pool2d(torch.arange(1., 10.).view(1, 1, 3, 3), 3, 2, 1)
        let input = Shape::nchw(1, 1, 3, 3);
        let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let max = forward_whole(&Pool2d::max(3).stride(2).padding(1), input, &x);
        assert_eq!(max, vec![5.0, 6.0, 8.0, 9.0]);
        let avg = forward_whole(&Pool2d::avg(3).stride(2).padding(1), input, &x);
        let want = [12.0 / 9.0, 16.0 / 9.0, 24.0 / 9.0, 28.0 / 9.0];
        assert!(max_rel_diff(&avg, &want) < 1e-6, "{avg:?}");
    }

    #[test]
    fn ceil_mode_example_matches_pytorch() {
        // torch.nn.functional.{max,avg}_pool2d(torch.arange(1., 17.).view(1, 1, 4, 4), 3, 2, 1,
        // ceil_mode=True): the last window starts on the input's last column and row, inside the
        // padding's reach, and the average divides it by the 2 rows and columns the padded input
        // has left (PyTorch's divisor)
        let input = Shape::nchw(1, 1, 4, 4);
        let x: Vec<f32> = (1..=16).map(|v| v as f32).collect();
        let op = Pool2d::max(3).stride(2).padding(1).ceil_mode();
        assert_eq!(
            forward_whole(&op, input, &x),
            vec![6.0, 8.0, 8.0, 14.0, 16.0, 16.0, 14.0, 16.0, 16.0]
        );
        let avg = Pool2d {
            kind: PoolKind::Avg,
            ..op
        };
        let want = [
            14.0 / 9.0,
            30.0 / 9.0,
            12.0 / 6.0,
            57.0 / 9.0,
            99.0 / 9.0,
            36.0 / 6.0,
            27.0 / 6.0,
            45.0 / 6.0,
            16.0 / 4.0,
        ];
        let got = forward_whole(&avg, input, &x);
        assert!(max_rel_diff(&got, &want) < 1e-6, "{got:?}");
    }

    #[test]
    fn adaptive_example_matches_pytorch() {
        // torch.nn.functional.adaptive_avg_pool2d(torch.arange(1., 43.).view(1, 1, 7, 6), (3, 2))
        // and of torch.arange(1., 7.).view(1, 1, 2, 3) to (3, 4)
        let adaptive = |output| Case::Adaptive(AdaptiveAvgPool2d { output });
        let x: Vec<f32> = (1..=42).map(|v| v as f32).collect();
        let y = forward_case(&adaptive([3, 2]), Shape::nchw(1, 1, 7, 6), &x);
        assert_eq!(y, [8.0, 11.0, 20.0, 23.0, 32.0, 35.0]);
        let y = forward_case(&adaptive([3, 4]), Shape::nchw(1, 1, 2, 3), &x[..6]);
        let want = [1.0, 1.5, 2.5, 3.0, 2.5, 3.0, 4.0, 4.5, 4.0, 4.5, 5.5, 6.0];
        assert_eq!(y, want);
    }

    #[test]
    fn max_backward_picks_the_first_maximum() {
        // A window of equal values routes its gradient to the top-left element.
        let input = Shape::nchw(1, 1, 2, 2);
        let dx = backward_whole(&Pool2d::max(2), input, &[1.0; 4], &[3.0]);
        assert_eq!(dx, vec![3.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (op, input) in cases() {
            let x = tie_free(input.numel(), 11);
            let r = random(op.spec().infer_shape(&[input]).unwrap().numel(), 12);
            let loss = |x: &[f32]| -> f64 {
                forward_case(&op, input, x)
                    .iter()
                    .zip(&r)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum()
            };
            let dx = backward_case(&op, input, &x, &r);
            assert_grad(&format!("{op:?} on {input}"), &x, &dx, 80, loss);
        }
    }

    #[test]
    fn tiles_reproduce_the_whole_tensor() {
        for (op, input) in cases() {
            let x = random(input.numel(), 21);
            let out_full = op.spec().infer_shape(&[input]).unwrap().full_rect();
            let dy = random(out_full.volume(), 22);
            let y = forward_case(&op, input, &x);
            let dx = backward_case(&op, input, &x, &dy);
            let x_full = input.full_rect();
            for axes in [[2, 3], [0, 1]] {
                for whole_input in [false, true] {
                    let what = format!("{op:?} on {input} split {axes:?}, whole: {whole_input}");
                    let mut dx_sum = vec![0.0; dx.len()];
                    for half in halves(&out_full, axes[0]) {
                        for tile in halves(&half, axes[1]) {
                            if tile.is_empty() {
                                continue;
                            }
                            let x_rect = if whole_input {
                                x_full
                            } else {
                                op.spec().project(&[input], &tile)[0]
                            };
                            let x_tile = cut(&x, &x_full, &x_rect);
                            let mut y_tile = vec![f32::NAN; tile.volume()];
                            pool2d_forward(
                                op.windows(),
                                input,
                                View::new(x_rect, &x_tile),
                                ViewMut::new(tile, &mut y_tile),
                            );
                            assert_eq!(y_tile, cut(&y, &out_full, &tile), "y tile {tile}, {what}");
                            let dy_tile = cut(&dy, &out_full, &tile);
                            let mut dx_tile = vec![f32::NAN; x_rect.volume()];
                            pool2d_backward(
                                op.windows(),
                                input,
                                View::new(x_rect, &x_tile),
                                View::new(tile, &dy_tile),
                                ViewMut::new(x_rect, &mut dx_tile),
                            );
                            add_rect(&dx_tile, &x_rect, &mut dx_sum, &x_full, &x_rect);
                        }
                    }
                    let d = max_rel_diff(&dx_sum, &dx);
                    assert!(d <= 1e-5, "summed dx of {what}: relative difference {d}");
                }
            }
        }
    }
}
