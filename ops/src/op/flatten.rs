use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// `(N, C, H, W)` → `(N, C·H·W)`. Only the sample dim can be split: a feature range of the output is
/// not a box of the input.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flatten {}

impl OpSpec for Flatten {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = inputs[0];
        if x.ndim() < 2 {
            return Err(format!("input has {} dims, expected at least 2", x.ndim()));
        }
        Ok(Shape::nc(x.dim(0), x.numel() / x.dim(0)))
    }

    fn flops(&self, _inputs: &[Shape], _output: &Shape) -> Option<Flops> {
        Some(Flops::default())
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N]
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        let x = inputs[0];
        let full = x.full_rect();
        rects.push(full.with_axis(0, out.lo[0], out.hi[0]));
    }
}

impl OpKernels for Flatten {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT_GRAD_ONLY
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.copy(c.stream, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let dy = c.read(Role::OutputGrad);
            c.backend.copy(c.stream, dy, dx);
        }
        Ok(())
    }
}
