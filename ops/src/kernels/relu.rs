//! ReLU over one tile, and the element-wise tile traversal the other element-wise kernels
//! (add, dropout, batch_norm) share.
//!
//! Input views may be larger than the output tile (the conventions only ask that they contain it), so
//! element-wise kernels cannot simply zip buffers. `par_runs` hands out pieces of the output that
//! are contiguous in the output *and* in every input view, merging trailing axes whenever the views
//! agree with the tile along them: in the usual case (every view is exactly the tile) the whole tile
//! is one run, cut into fixed-size pieces for the rayon pool.

use super::{View, ViewMut};
use crate::shape::{MAX_DIMS, Rect};
use rayon::prelude::*;

/// Elements per parallel piece: large enough to amortise scheduling, small enough to balance.
pub(crate) const PIECE: usize = 1 << 14;

/// y = max(x, 0) over the tile `y.rect`. NaN inputs stay NaN so divergence is not hidden.
pub fn relu_forward(x: View<'_>, mut y: ViewMut<'_>) {
    par_runs(&mut y, &[x.rect], 0, |start, out| {
        let xs = run_of(&x, &start, out.len());
        for (o, &v) in out.iter_mut().zip(xs) {
            *o = if v < 0.0 { 0.0 } else { v };
        }
    });
}

/// dx = dy · `[y > 0]` over the tile `dx.rect`, from the forward output `y` (which, unlike `x`, the
/// fused-activation convention guarantees is kept).
pub fn relu_backward(y: View<'_>, dy: View<'_>, mut dx: ViewMut<'_>) {
    par_runs(&mut dx, &[y.rect, dy.rect], 0, |start, out| {
        let ys = run_of(&y, &start, out.len());
        let dys = run_of(&dy, &start, out.len());
        for ((o, &yv), &g) in out.iter_mut().zip(ys).zip(dys) {
            *o = if yv > 0.0 { g } else { 0.0 };
        }
    });
}

/// Calls `f(start, piece)`, in parallel, on disjoint contiguous pieces of `out` that together cover
/// it; `start` is the global point of the piece's first element.
///
/// Every rect in `views` must contain `out.rect`; a piece is then also contiguous in each of those
/// rects, so [`run_of`] finds the matching input slice. Pieces never span axes before `min_axis`:
/// a kernel that needs, say, one channel per piece of an NCHW tile passes 2.
pub(crate) fn par_runs(
    out: &mut ViewMut<'_>,
    views: &[Rect],
    min_axis: usize,
    f: impl Fn([usize; MAX_DIMS], &mut [f32]) + Sync,
) {
    let tile = out.rect;
    for rect in views {
        assert_eq!(
            rect.ndim(),
            tile.ndim(),
            "view {rect} and tile {tile} differ in rank"
        );
        assert!(
            rect.contains(&tile),
            "view {rect} does not contain the tile {tile}"
        );
    }
    if tile.is_empty() {
        return;
    }
    let first_axis = first_run_axis(&tile, views, min_axis);
    let run_len: usize = (first_axis..tile.ndim()).map(|a| tile.extent(a)).product();
    let piece_at = |offset: usize| point_at(&tile, offset);

    if tile.volume() <= PIECE {
        for (r, run) in out.data.chunks_mut(run_len).enumerate() {
            f(piece_at(r * run_len), run);
        }
    } else if run_len >= PIECE {
        out.data
            .par_chunks_mut(run_len)
            .enumerate()
            .for_each(|(r, run)| {
                run.par_chunks_mut(PIECE)
                    .enumerate()
                    .for_each(|(p, piece)| f(piece_at(r * run_len + p * PIECE), piece));
            });
    } else {
        out.data
            .par_chunks_mut(run_len)
            .enumerate()
            .with_min_len(PIECE / run_len)
            .for_each(|(r, run)| f(piece_at(r * run_len), run));
    }
}

/// Calls `f(start, len)` sequentially for contiguous runs covering `region`, each contiguous in every
/// rect of `views` (which must contain `region`), in row-major order.
pub(crate) fn for_each_run(
    region: &Rect,
    views: &[Rect],
    min_axis: usize,
    mut f: impl FnMut([usize; MAX_DIMS], usize),
) {
    debug_assert!(views.iter().all(|v| v.contains(region)));
    if region.is_empty() {
        return;
    }
    let first_axis = first_run_axis(region, views, min_axis);
    let run_len: usize = (first_axis..region.ndim())
        .map(|a| region.extent(a))
        .product();
    for r in 0..region.volume() / run_len {
        f(point_at(region, r * run_len), run_len);
    }
}

/// The slice of `view` holding `len` elements from global point `start` (contiguous by construction
/// of the runs of [`par_runs`] / [`for_each_run`]).
pub(crate) fn run_of<'a>(view: &View<'a>, start: &[usize; MAX_DIMS], len: usize) -> &'a [f32] {
    let at = view.rect.offset_of(start);
    &view.data[at..at + len]
}

/// First axis of the runs over `tile`: trailing axes merge into one run while every view spans
/// exactly the tile along them, since only then do consecutive rows stay adjacent in the view.
fn first_run_axis(tile: &Rect, views: &[Rect], min_axis: usize) -> usize {
    let mut axis = tile.ndim() - 1;
    while axis > min_axis && views.iter().all(|v| v.extent(axis) == tile.extent(axis)) {
        axis -= 1;
    }
    axis
}

/// Global point of the element at row-major `offset` inside `rect`.
fn point_at(rect: &Rect, mut offset: usize) -> [usize; MAX_DIMS] {
    let mut point = rect.lo;
    for axis in (0..rect.ndim()).rev() {
        let extent = rect.extent(axis);
        point[axis] += offset % extent;
        offset /= extent;
    }
    point
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, random};
    use crate::shape::{Shape, copy_rect};

    /// Random values at least 0.1 away from the kink at 0, so finite differences stay on one side.
    fn away_from_zero(n: usize, seed: u64) -> Vec<f32> {
        random(n, seed)
            .into_iter()
            .map(|v| if v < 0.0 { v - 0.1 } else { v + 0.1 })
            .collect()
    }

    #[test]
    fn forward_and_backward_match_definition() {
        let rect = Shape::nc(2, 3).full_rect();
        let x = [-1.0, 0.0, 2.0, 3.0, -0.5, f32::NAN];
        let mut y = [9.0; 6];
        relu_forward(View::new(rect, &x), ViewMut::new(rect, &mut y));
        assert_eq!(&y[..5], &[0.0, 0.0, 2.0, 3.0, 0.0]);
        assert!(y[5].is_nan());
        let dy = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut dx = [9.0; 6];
        relu_backward(
            View::new(rect, &y),
            View::new(rect, &dy),
            ViewMut::new(rect, &mut dx),
        );
        assert_eq!(dx, [0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let rect = Shape::nchw(2, 3, 4, 5).full_rect();
        let x = away_from_zero(rect.volume(), 1);
        let weights = random(rect.volume(), 2);
        let loss = |x: &[f32]| {
            let mut y = vec![0.0; x.len()];
            relu_forward(View::new(rect, x), ViewMut::new(rect, &mut y));
            y.iter().zip(&weights).map(|(&a, &b)| (a * b) as f64).sum()
        };
        let mut y = vec![0.0; x.len()];
        relu_forward(View::new(rect, &x), ViewMut::new(rect, &mut y));
        let mut dx = vec![0.0; x.len()];
        relu_backward(
            View::new(rect, &y),
            View::new(rect, &weights),
            ViewMut::new(rect, &mut dx),
        );
        assert_grad("relu dx", &x, &dx, 120, loss);
    }

    #[test]
    fn tiles_read_from_larger_views_match_whole_tensor() {
        // Large enough to take the parallel paths; tiles cut through h and w.
        let shape = Shape::nchw(4, 8, 40, 36);
        let full = shape.full_rect();
        let x = random(full.volume(), 3);
        let dy = random(full.volume(), 4);
        let mut y_whole = vec![0.0; x.len()];
        relu_forward(View::new(full, &x), ViewMut::new(full, &mut y_whole));
        let mut dx_whole = vec![0.0; x.len()];
        relu_backward(
            View::new(full, &y_whole),
            View::new(full, &dy),
            ViewMut::new(full, &mut dx_whole),
        );

        let mut y_tiled = vec![0.0; x.len()];
        let mut dx_tiled = vec![0.0; x.len()];
        for (h0, h1) in [(0, 13), (13, 40)] {
            for (w0, w1) in [(0, 20), (20, 36)] {
                let tile = Rect::new(&[0, 0, h0, w0], &[4, 8, h1, w1]);
                let mut y = vec![0.0; tile.volume()];
                relu_forward(View::new(full, &x), ViewMut::new(tile, &mut y));
                copy_rect(&y, &tile, &mut y_tiled, &full, &tile);
                let mut dx = vec![0.0; tile.volume()];
                relu_backward(
                    View::new(tile, &y),
                    View::new(full, &dy),
                    ViewMut::new(tile, &mut dx),
                );
                copy_rect(&dx, &tile, &mut dx_tiled, &full, &tile);
            }
        }
        assert_eq!(y_tiled, y_whole);
        assert_eq!(dx_tiled, dx_whole);
    }

    #[test]
    fn runs_merge_only_where_views_agree() {
        let tile = Rect::new(&[1, 0, 2, 0], &[3, 4, 5, 6]);
        assert_eq!(first_run_axis(&tile, &[tile], 0), 0);
        assert_eq!(first_run_axis(&tile, &[tile], 2), 2);
        let wider = Rect::new(&[0, 0, 0, 0], &[3, 4, 5, 8]);
        assert_eq!(first_run_axis(&tile, &[tile, wider], 0), 3);
        assert_eq!(point_at(&tile, 0), [1, 0, 2, 0]);
        assert_eq!(point_at(&tile, 6 * 3 * 4 + 6 + 1), [2, 0, 3, 1]);
    }

    #[test]
    #[should_panic(expected = "does not contain the tile")]
    fn rejects_views_that_miss_the_tile() {
        let tile = Rect::new(&[0, 0], &[2, 4]);
        let small = Rect::new(&[0, 0], &[2, 3]);
        let x = [0.0; 6];
        let mut y = [0.0; 8];
        relu_forward(View::new(small, &x), ViewMut::new(tile, &mut y));
    }
}
