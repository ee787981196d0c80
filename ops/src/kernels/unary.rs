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
    use crate::op::{GradFrom, Unary, UnaryOp};
    use crate::shape::Shape;

    fn forward_of(op: impl Into<UnaryOp>, x: &[f32]) -> Vec<f32> {
        let rect = Shape::nc(1, x.len()).full_rect();
        let mut y = vec![9.0; x.len()];
        op.into()
            .forward_tile(View::new(rect, x), ViewMut::new(rect, &mut y));
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
        let y = forward_of(Unary::Hardsigmoid, &[-4.0, 0.0, 1.5, 4.0]);
        assert_eq!(y, [0.0, 0.5, 0.75, 1.0]);
        let y = forward_of(Unary::Relu6, &[-1.0, 2.5, 6.0, 7.0]);
        assert_eq!(y, [0.0, 2.5, 6.0, 6.0]);
        let y = forward_of(Unary::Silu, &[0.0, 2.0, -40.0]);
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 2.0 * 0.880_797).abs() < 1e-6, "{}", y[1]);
        assert!(y[2] <= 0.0 && y[2] > -1e-15, "{}", y[2]);
        assert_eq!(forward_of(Unary::LeakyRelu, &[-2.0, 3.0]), [-0.02, 3.0]);
        let slope = UnaryOp::with_alpha(Unary::LeakyRelu, 0.25);
        assert_eq!(forward_of(slope, &[-2.0, 3.0]), [-0.5, 3.0]);
    }

    /// dx for `x` with an output gradient of 2 everywhere.
    fn gradient_of(op: impl Into<UnaryOp>, x: &[f32]) -> Vec<f32> {
        let op = op.into();
        let rect = Shape::nc(1, x.len()).full_rect();
        let mut y = vec![0.0; x.len()];
        op.forward_tile(View::new(rect, x), ViewMut::new(rect, &mut y));
        let read = match op.op.grad_from() {
            GradFrom::Input => x,
            GradFrom::Output => &y,
        };
        let mut dx = vec![9.0; x.len()];
        op.backward_tile(
            View::new(rect, read),
            View::new(rect, &vec![2.0; x.len()]),
            ViewMut::new(rect, &mut dx),
        );
        dx
    }

    #[test]
    fn gradients_at_the_kinks_are_pytorchs() {
        let kinks = [-3.0, 0.0, 3.0, 6.0];
        assert_eq!(
            gradient_of(Unary::Hardsigmoid, &kinks),
            [0.0, 1.0 / 3.0, 0.0, 0.0]
        );
        assert_eq!(gradient_of(Unary::Relu6, &kinks), [0.0, 0.0, 2.0, 0.0]);
        assert_eq!(
            gradient_of(Unary::LeakyRelu, &kinks),
            [0.02, 0.02, 2.0, 2.0]
        );
        let slope = UnaryOp::with_alpha(Unary::LeakyRelu, -0.5);
        assert_eq!(gradient_of(slope, &kinks), [-1.0, -1.0, 2.0, 2.0]);
    }

    #[test]
    fn hardswish_gradient_has_pytorchs_pieces() {
        let x = [-3.5, -3.0, 0.0, 3.0, 3.5];
        assert_eq!(
            gradient_of(Unary::Hardswish, &x),
            [0.0, -1.0, 1.0, 3.0, 2.0]
        );
    }

    #[test]
    fn every_gradient_matches_finite_differences() {
        let rect = Shape::nchw(2, 3, 4, 5).full_rect();
        // over [-4, 4], to cross the kinks of the piecewise ops (at -3, 0, 3), none within the
        // finite differences' step of one
        let x: Vec<f32> = random(rect.volume(), 1)
            .iter()
            .map(|v| 4.0 * v)
            .map(
                |v| match [-3.0f32, 0.0, 3.0].iter().find(|k| (v - *k).abs() < 0.05) {
                    Some(k) => k + 0.05f32.copysign(v - k),
                    None => v,
                },
            )
            .collect();
        let weights = random(rect.volume(), 2);
        let ops = Unary::ALL.iter().map(|&u| UnaryOp::from(u));
        for op in ops.chain([UnaryOp::with_alpha(Unary::LeakyRelu, 0.3)]) {
            let loss = |x: &[f32]| {
                let mut y = vec![0.0; x.len()];
                op.forward_tile(View::new(rect, x), ViewMut::new(rect, &mut y));
                y.iter().zip(&weights).map(|(&a, &b)| (a * b) as f64).sum()
            };
            let mut y = vec![0.0; x.len()];
            op.forward_tile(View::new(rect, &x), ViewMut::new(rect, &mut y));
            let read = match op.op.grad_from() {
                GradFrom::Input => &x,
                GradFrom::Output => &y,
            };
            let mut dx = vec![0.0; x.len()];
            op.backward_tile(
                View::new(rect, read),
                View::new(rect, &weights),
                ViewMut::new(rect, &mut dx),
            );
            assert_grad(&format!("{} x", op.op), &x, &dx, 24, loss);
        }
    }

    #[test]
    fn names_parse_back_and_onnx_names_are_distinct() {
        for &op in Unary::ALL {
            assert_eq!(Unary::ALL[op.index()], op);
            assert_eq!(Unary::parse(op.name()), Some(op));
            if let Some(onnx) = op.onnx_op() {
                assert_eq!(Unary::from_onnx(onnx), Some(op));
            }
        }
    }
}
