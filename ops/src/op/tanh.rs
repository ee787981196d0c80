use super::{BackwardReads, Flops, OpKernels, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise hyperbolic tangent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tanh {}

impl OpSpec for Tanh {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        Ok(inputs[0])
    }

    /// Forward: two exponentials, two additions and a division (as for sigmoid); backward: a
    /// square, a subtraction and a product.
    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 5, 3)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for Tanh {
    /// The gradient needs only the output: tanh' = 1 − tanh².
    const BACKWARD_READS: BackwardReads = BackwardReads::OUTPUT;

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.tanh_forward(c.stream, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
            c.backend.tanh_backward(c.stream, y, dy, dx);
        }
        Ok(())
    }
}
