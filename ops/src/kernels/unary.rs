//! The element-wise unary ops over one tile, each op's formula given as a closure by
//! `crate::op::Unary` (monomorphised per op, so the loops inline it).

use super::relu::{par_runs, run_of};
use super::{View, ViewMut};

/// y = f(x) over the tile `y.rect`.
#[inline]
pub fn forward(x: View<'_>, mut y: ViewMut<'_>, f: impl Fn(f32) -> f32 + Sync) {
    par_runs(&mut y, &[x.rect], 0, |start, out| {
        let xs = run_of(&x, &start, out.len());
        for (o, &v) in out.iter_mut().zip(xs) {
            *o = f(v);
        }
    });
}

/// dx = grad(r, g) over the tile `dx.rect`, from the value the gradient reads (`read`: x or y)
/// and the output gradient `dy`.
#[inline]
pub fn backward(
    read: View<'_>,
    dy: View<'_>,
    mut dx: ViewMut<'_>,
    grad: impl Fn(f32, f32) -> f32 + Sync,
) {
    par_runs(&mut dx, &[read.rect, dy.rect], 0, |start, out| {
        let rs = run_of(&read, &start, out.len());
        let gs = run_of(&dy, &start, out.len());
        for ((o, &r), &g) in out.iter_mut().zip(rs).zip(gs) {
            *o = grad(r, g);
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::kernels::check::{assert_grad, random};
    use crate::kernels::{View, ViewMut};
    use crate::op::{GradFrom, Unary};
    use crate::shape::Shape;

    fn forward_of(op: Unary, x: &[f32]) -> Vec<f32> {
        let rect = Shape::nc(1, x.len()).full_rect();
        let mut y = vec![9.0; x.len()];
        op.forward_tile(View::new(rect, x), ViewMut::new(rect, &mut y));
        y
    }

    #[test]
    fn forward_values_match_their_definitions() {
        let y = forward_of(Unary::Sigmoid, &[0.0, 2.0, -40.0]);
        assert_eq!(y[0], 0.5);
        assert!((y[1] - 0.880_797).abs() < 1e-6, "{}", y[1]);
        assert!(y[2] >= 0.0 && y[2] < 1e-17, "{}", y[2]);
        let y = forward_of(Unary::Tanh, &[0.0, 0.5, -0.5, 40.0]);
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 0.462_117_16).abs() < 1e-6, "{}", y[1]);
        assert_eq!(y[2], -y[1]);
        assert_eq!(y[3], 1.0);
        let y = forward_of(Unary::Hardswish, &[-4.0, 0.0, 1.0, 4.0]);
        assert_eq!(y, [0.0, 0.0, 4.0 / 6.0, 4.0]);
    }

    #[test]
    fn hardswish_gradient_has_pytorchs_pieces() {
        let rect = Shape::nc(1, 5).full_rect();
        let x = [-3.5, -3.0, 0.0, 3.0, 3.5];
        let mut dx = [9.0; 5];
        Unary::Hardswish.backward_tile(
            View::new(rect, &x),
            View::new(rect, &[2.0; 5]),
            ViewMut::new(rect, &mut dx),
        );
        assert_eq!(dx, [0.0, -1.0, 1.0, 3.0, 2.0]);
    }

    #[test]
    fn every_gradient_matches_finite_differences() {
        let rect = Shape::nchw(2, 3, 4, 5).full_rect();
        let x = random(rect.volume(), 1);
        let weights = random(rect.volume(), 2);
        for &op in Unary::ALL {
            let loss = |x: &[f32]| {
                let mut y = vec![0.0; x.len()];
                op.forward_tile(View::new(rect, x), ViewMut::new(rect, &mut y));
                y.iter().zip(&weights).map(|(&a, &b)| (a * b) as f64).sum()
            };
            let mut y = vec![0.0; x.len()];
            op.forward_tile(View::new(rect, &x), ViewMut::new(rect, &mut y));
            let read = match op.grad_from() {
                GradFrom::Input => &x,
                GradFrom::Output => &y,
            };
            let mut dx = vec![0.0; x.len()];
            op.backward_tile(
                View::new(rect, read),
                View::new(rect, &weights),
                ViewMut::new(rect, &mut dx),
            );
            assert_grad(&format!("{op} x"), &x, &dx, 24, loss);
        }
    }

    #[test]
    fn names_parse_back_and_onnx_names_are_distinct() {
        for &op in Unary::ALL {
            assert_eq!(Unary::ALL[op.index()], op);
            assert_eq!(Unary::parse(op.name()), Some(op));
            assert_eq!(Unary::from_onnx(op.onnx_op()), Some(op));
        }
    }
}
