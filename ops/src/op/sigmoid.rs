use super::{BackwardReads, Flops, OpKernels, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise logistic sigmoid, 1 / (1 + e^−x).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sigmoid {}

impl OpSpec for Sigmoid {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        Ok(inputs[0])
    }

    /// Forward: a negation, an exponential, an addition and a division; backward: three products.
    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 4, 3)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for Sigmoid {
    /// The gradient needs only the output: σ' = σ·(1 − σ).
    const BACKWARD_READS: BackwardReads = BackwardReads::OUTPUT;

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.sigmoid_forward(c.stream, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
            c.backend.sigmoid_backward(c.stream, y, dy, dx);
        }
        Ok(())
    }
}
