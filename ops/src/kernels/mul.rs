//! Element-wise product over one tile: of two tensors of one shape, or of a tensor and a
//! `[N, C, 1, 1]` channel scale broadcast over H and W (`crate::op::Mul`).
//!
//! The scale's gradient is a sum over the tile's rows and columns, in f64 like batch norm's
//! sums; where a layer is split along H or W, each tile writes its own partial sum and the caller
//! adds them, as for any overlapping input gradient.

use super::relu::{par_runs, run_of};
use super::{View, ViewMut};
use crate::shape::Rect;
use rayon::prelude::*;

/// Whether a factor (or its gradient) laid out over `rect` is a channel scale broadcast over H
/// and W: 4-D, over the one row and column at H = W = 0. A factor of the first's shape laid out
/// so reads alike either way. The CUDA backend tells a scale by this too.
pub fn is_channel_scale(rect: &Rect) -> bool {
    rect.ndim() == 4 && rect.hi[2] == 1 && rect.hi[3] == 1
}

/// `out = a · b` over `out.rect`, `b` broadcast over H and W where it is a channel scale.
fn product(a: View<'_>, b: View<'_>, mut out: ViewMut<'_>) {
    if is_channel_scale(&b.rect) {
        // a run never spans a channel (min axis 2), so it has one scale
        par_runs(&mut out, &[a.rect], 2, |start, run| {
            let mut at = start;
            (at[2], at[3]) = (0, 0);
            let s = b.data[b.rect.offset_of(&at)];
            let xs = run_of(&a, &start, run.len());
            for (o, &v) in run.iter_mut().zip(xs) {
                *o = v * s;
            }
        });
    } else {
        par_runs(&mut out, &[a.rect, b.rect], 0, |start, run| {
            let (us, vs) = (run_of(&a, &start, run.len()), run_of(&b, &start, run.len()));
            for ((o, &u), &v) in run.iter_mut().zip(us).zip(vs) {
                *o = u * v;
            }
        });
    }
}

/// y = x · s over the tile `y.rect`.
pub fn mul_forward(x: View<'_>, s: View<'_>, y: ViewMut<'_>) {
    product(x, s, y);
}

/// dx = dy · s over `dx.rect`; ds = dy · x over `ds.rect`, or for a channel scale
/// ds[n, c] = Σ over `tile`'s rows and columns of dy · x (`x` and `dy` contain the tile).
pub fn mul_backward(
    tile: &Rect,
    x: View<'_>,
    s: View<'_>,
    dy: View<'_>,
    dx: Option<ViewMut<'_>>,
    ds: Option<ViewMut<'_>>,
) {
    if let Some(dx) = dx {
        product(dy, s, dx);
    }
    let Some(ds) = ds else { return };
    if !is_channel_scale(&ds.rect) {
        product(dy, x, ds);
        return;
    }
    let rect = ds.rect;
    let channels = rect.extent(1);
    ds.data.par_iter_mut().enumerate().for_each(|(i, out)| {
        let (n, c) = (rect.lo[0] + i / channels, rect.lo[1] + i % channels);
        let mut sum = 0f64;
        for h in tile.lo[2]..tile.hi[2] {
            let start = [n, c, h, tile.lo[3]];
            let len = tile.extent(3);
            let (gs, xs) = (run_of(&dy, &start, len), run_of(&x, &start, len));
            sum += gs
                .iter()
                .zip(xs)
                .map(|(&g, &v)| (g * v) as f64)
                .sum::<f64>();
        }
        *out = sum as f32;
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, random};
    use crate::shape::Shape;

    fn check(x_shape: Shape, s_shape: Shape) {
        let (xr, sr) = (x_shape.full_rect(), s_shape.full_rect());
        let x = random(xr.volume(), 1);
        let s = random(sr.volume(), 2);
        let weights = random(xr.volume(), 3);
        let loss = |x: &[f32], s: &[f32]| -> f64 {
            let mut y = vec![0.0; x.len()];
            mul_forward(View::new(xr, x), View::new(sr, s), ViewMut::new(xr, &mut y));
            y.iter().zip(&weights).map(|(&y, &w)| (y * w) as f64).sum()
        };
        let (mut dx, mut ds) = (vec![0.0; x.len()], vec![0.0; s.len()]);
        mul_backward(
            &xr,
            View::new(xr, &x),
            View::new(sr, &s),
            View::new(xr, &weights),
            Some(ViewMut::new(xr, &mut dx)),
            Some(ViewMut::new(sr, &mut ds)),
        );
        assert_grad("mul x", &x, &dx, 20, |x| loss(x, &s));
        assert_grad("mul s", &s, &ds, 20, |s| loss(&x, s));
    }

    #[test]
    fn gradients_match_finite_differences() {
        check(Shape::nchw(2, 3, 4, 5), Shape::nchw(2, 3, 4, 5));
        check(Shape::nchw(2, 3, 4, 5), Shape::nchw(2, 3, 1, 1));
        check(Shape::nc(3, 7), Shape::nc(3, 7));
    }

    #[test]
    fn a_scale_split_over_rows_sums_back_to_the_whole() {
        let (xr, sr) = (
            Shape::nchw(2, 3, 4, 5).full_rect(),
            Shape::nchw(2, 3, 1, 1).full_rect(),
        );
        let x = random(xr.volume(), 4);
        let s = random(sr.volume(), 5);
        let dy = random(xr.volume(), 6);
        // the operands laid out over the whole tensor, as a device holding more than the tile
        // lends them
        let grad = |tile: Rect| {
            let scale = tile.with_axis(2, 0, 1).with_axis(3, 0, 1);
            let mut ds = vec![0.0; scale.volume()];
            mul_backward(
                &tile,
                View::new(xr, &x),
                View::new(sr, &s),
                View::new(xr, &dy),
                None,
                Some(ViewMut::new(scale, &mut ds)),
            );
            ds
        };
        let whole = grad(xr);
        let top = grad(Rect::new(&[0, 0, 0, 0], &[2, 3, 2, 5]));
        let bottom = grad(Rect::new(&[0, 0, 2, 0], &[2, 3, 4, 5]));
        for ((w, t), b) in whole.iter().zip(&top).zip(&bottom) {
            assert!(
                (w - (t + b)).abs() <= 1e-5 * w.abs().max(1.0),
                "{w} vs {t} + {b}"
            );
        }
    }
}
