use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise max(x, 0).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Relu {}

impl OpSpec for Relu {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        Ok(inputs[0])
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 1, 1)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for Relu {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.relu_forward(c.stream, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
            c.backend.relu_backward(c.stream, y, dy, dx);
        }
        Ok(())
    }
}
