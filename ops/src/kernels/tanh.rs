//! The hyperbolic tangent over one tile.

use super::relu::{par_runs, run_of};
use super::{View, ViewMut};

/// y = tanh(x) over the tile `y.rect`.
pub fn tanh_forward(x: View<'_>, mut y: ViewMut<'_>) {
    par_runs(&mut y, &[x.rect], 0, |start, out| {
        let xs = run_of(&x, &start, out.len());
        for (o, &v) in out.iter_mut().zip(xs) {
            *o = v.tanh();
        }
    });
}

/// dx = dy · (1 − y²) over the tile `dx.rect`, from the forward output `y`.
pub fn tanh_backward(y: View<'_>, dy: View<'_>, mut dx: ViewMut<'_>) {
    par_runs(&mut dx, &[y.rect, dy.rect], 0, |start, out| {
        let ys = run_of(&y, &start, out.len());
        let dys = run_of(&dy, &start, out.len());
        for ((o, &yv), &g) in out.iter_mut().zip(ys).zip(dys) {
            *o = g * (1.0 - yv * yv);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, random};
    use crate::shape::Shape;

    #[test]
    fn forward_matches_the_definition() {
        let rect = Shape::nc(1, 4).full_rect();
        let mut y = [9.0; 4];
        tanh_forward(
            View::new(rect, &[0.0, 0.5, -0.5, 40.0]),
            ViewMut::new(rect, &mut y),
        );
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 0.462_117_16).abs() < 1e-6, "{}", y[1]);
        assert_eq!(y[2], -y[1]);
        assert_eq!(y[3], 1.0);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let rect = Shape::nchw(2, 3, 4, 5).full_rect();
        let x = random(rect.volume(), 1);
        let weights = random(rect.volume(), 2);
        let loss = |x: &[f32]| {
            let mut y = vec![0.0; x.len()];
            tanh_forward(View::new(rect, x), ViewMut::new(rect, &mut y));
            y.iter().zip(&weights).map(|(&a, &b)| (a * b) as f64).sum()
        };
        let mut y = vec![0.0; x.len()];
        tanh_forward(View::new(rect, &x), ViewMut::new(rect, &mut y));
        let mut dx = vec![0.0; x.len()];
        tanh_backward(
            View::new(rect, &y),
            View::new(rect, &weights),
            ViewMut::new(rect, &mut dx),
        );
        assert_grad("tanh x", &x, &dx, 24, loss);
    }
}
