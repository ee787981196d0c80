use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise sum of two tensors of the same shape (residual connections).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Add {}

impl OpSpec for Add {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        if inputs[0] != inputs[1] {
            return Err(format!(
                "inputs have different shapes {} and {}",
                inputs[0], inputs[1]
            ));
        }
        Ok(inputs[0])
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 1, 0)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.extend([*out, *out]);
    }
}

impl OpKernels for Add {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT_GRAD_ONLY
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (a, b) = (c.read(Role::Input(0)), c.read(Role::Input(1)));
        let y = c.write(Role::Output);
        c.backend.add_forward(c.stream, a, b, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let dy = c.read(Role::OutputGrad);
        let da = c.try_write(Role::InputGrad(0));
        let db = c.try_write(Role::InputGrad(1));
        c.backend.add_backward(c.stream, dy, da, db);
        Ok(())
    }
}
