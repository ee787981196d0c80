//! Element-wise sum of two tensors over one tile.
//!
//! The gradient passes through unchanged to both inputs (da = db = dy), so a runtime that can alias
//! buffers may hand `dy` itself to both producers and skip [`add_backward`]; the function exists for
//! runtimes (and tests) that need the two gradients materialised.

use super::relu::{par_runs, run_of};
use super::{View, ViewMut};

/// y = a + b over the tile `y.rect`.
pub fn add_forward(a: View<'_>, b: View<'_>, mut y: ViewMut<'_>) {
    par_runs(&mut y, &[a.rect, b.rect], 0, |start, out| {
        let xs = run_of(&a, &start, out.len());
        let zs = run_of(&b, &start, out.len());
        for ((o, &u), &v) in out.iter_mut().zip(xs).zip(zs) {
            *o = u + v;
        }
    });
}

/// da = dy and db = dy over their tiles (normally both the output tile).
pub fn add_backward(dy: View<'_>, da: ViewMut<'_>, db: ViewMut<'_>) {
    pass_through(dy, da);
    pass_through(dy, db);
}

fn pass_through(dy: View<'_>, mut grad: ViewMut<'_>) {
    par_runs(&mut grad, &[dy.rect], 0, |start, out| {
        out.copy_from_slice(run_of(&dy, &start, out.len()));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, random};
    use crate::shape::{Rect, Shape, copy_rect};

    #[test]
    fn gradient_matches_finite_differences() {
        let rect = Shape::nchw(2, 3, 4, 5).full_rect();
        let a = random(rect.volume(), 1);
        let b = random(rect.volume(), 2);
        let weights = random(rect.volume(), 3);
        let mut da = vec![0.0; a.len()];
        let mut db = vec![0.0; a.len()];
        add_backward(
            View::new(rect, &weights),
            ViewMut::new(rect, &mut da),
            ViewMut::new(rect, &mut db),
        );
        let weighted_sum = |a: &[f32], b: &[f32]| -> f64 {
            let mut y = vec![0.0; a.len()];
            add_forward(
                View::new(rect, a),
                View::new(rect, b),
                ViewMut::new(rect, &mut y),
            );
            y.iter().zip(&weights).map(|(&y, &w)| (y * w) as f64).sum()
        };
        assert_grad("add da", &a, &da, 60, |a| weighted_sum(a, &b));
        assert_grad("add db", &b, &db, 60, |b| weighted_sum(&a, b));
    }

    #[test]
    fn tiles_read_from_larger_views_match_whole_tensor() {
        let full = Shape::nc(6, 10).full_rect();
        let a = random(full.volume(), 4);
        let b = random(full.volume(), 5);
        let mut whole = vec![0.0; a.len()];
        add_forward(
            View::new(full, &a),
            View::new(full, &b),
            ViewMut::new(full, &mut whole),
        );

        let mut tiled = vec![0.0; a.len()];
        for (n0, n1) in [(0, 4), (4, 6)] {
            for (c0, c1) in [(0, 3), (3, 10)] {
                let tile = Rect::new(&[n0, c0], &[n1, c1]);
                // `b` arrives as exactly the tile, `a` as the whole tensor.
                let mut b_tile = vec![0.0; tile.volume()];
                copy_rect(&b, &full, &mut b_tile, &tile, &tile);
                let mut y = vec![0.0; tile.volume()];
                add_forward(
                    View::new(full, &a),
                    View::new(tile, &b_tile),
                    ViewMut::new(tile, &mut y),
                );
                copy_rect(&y, &tile, &mut tiled, &full, &tile);
            }
        }
        assert_eq!(tiled, whole);
    }
}
