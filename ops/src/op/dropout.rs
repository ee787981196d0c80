use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Phase, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Inverted dropout. The mask is a pure function of (seed, step, layer, global element index), so every
/// partition of the layer drops the same elements.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dropout {
    pub rate: f32,
}

impl OpSpec for Dropout {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        if !(0.0..1.0).contains(&self.rate) {
            return Err(format!("rate {} must be in [0, 1)", self.rate));
        }
        Ok(inputs[0])
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 2, 1)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for Dropout {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT_GRAD_ONLY
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let mask = c.dropout_mask(self.rate);
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.dropout_forward(c.stream, &mask, x, y);
        Ok(())
    }

    fn run<B: Backend>(&self, phase: Phase, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        match phase {
            Phase::Forward => self.forward(c),
            Phase::Backward => self.backward(c),
            // Inference keeps every unit.
            Phase::Infer => {
                let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
                c.backend.copy(c.stream, x, y);
                Ok(())
            }
            other => panic!("dropout has no {other} phase"),
        }
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let mask = c.dropout_mask(self.rate);
            let dy = c.read(Role::OutputGrad);
            c.backend.dropout_backward(c.stream, &mask, dy, dx);
        }
        Ok(())
    }
}
