use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise product of a tensor and a second factor of its shape, or of an `[N, C, H, W]`
/// tensor and an `[N, C, 1, 1]` one broadcast over H and W (squeeze-and-excitation's channel
/// scale). The output has the first input's shape.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mul {}

impl Mul {
    /// Whether the second factor is broadcast over H and W (the inputs' shapes differ).
    pub fn broadcasts(inputs: &[Shape]) -> bool {
        inputs[0] != inputs[1]
    }
}

impl OpSpec for Mul {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let (x, s) = (inputs[0], inputs[1]);
        let scale = x.ndim() == 4 && s == Shape::nchw(x.dim(0), x.dim(1), 1, 1);
        if x != s && !scale {
            return Err(format!(
                "inputs have shapes {x} and {s}; the second factor must have the first's shape, \
                 or be [N, C, 1, 1] over an [N, C, H, W] first (a channel scale)"
            ));
        }
        Ok(x)
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        // forward a product; backward a product for each factor's gradient
        Flops::per_element(output.numel(), 1, 2)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
        rects.push(if Mul::broadcasts(inputs) {
            out.with_axis(2, 0, 1).with_axis(3, 0, 1)
        } else {
            *out
        });
    }
}

impl OpKernels for Mul {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, s) = (c.read(Role::Input(0)), c.read(Role::Input(1)));
        let y = c.write(Role::Output);
        c.backend.mul_forward(c.stream, x, s, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, s) = (c.read(Role::Input(0)), c.read(Role::Input(1)));
        let dy = c.read(Role::OutputGrad);
        let dx = c.try_write(Role::InputGrad(0));
        let ds = c.try_write(Role::InputGrad(1));
        c.backend.mul_backward(c.stream, &c.tile, x, s, dy, dx, ds);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_channel_scale_is_read_at_the_tiles_samples_and_channels() {
        let inputs = [Shape::nchw(2, 8, 6, 6), Shape::nchw(2, 8, 1, 1)];
        assert_eq!(Mul {}.infer_shape(&inputs).unwrap(), inputs[0]);
        let tile = Rect::new(&[1, 2, 3, 0], &[2, 6, 6, 6]);
        let rects = Mul {}.project(&inputs, &tile);
        assert_eq!(rects[0], tile);
        assert_eq!(rects[1], Rect::new(&[1, 2, 0, 0], &[2, 6, 1, 1]));
        let wrong = [Shape::nchw(2, 8, 6, 6), Shape::nchw(2, 4, 1, 1)];
        let err = Mul {}.infer_shape(&wrong).unwrap_err();
        assert!(err.contains("[N, C, 1, 1]"), "{err}");
    }
}
