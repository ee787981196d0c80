use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, PoolWindows, expect_rank};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Average pooling to a fixed output size, PyTorch's `nn.AdaptiveAvgPool2d(output)`: output `o`
/// of `out` along an axis of `size` averages the input's `[floor(o·size/out),
/// ceil((o+1)·size/out))`, so any input size (smaller than the output too) gives the same output
/// size: torchvision's AlexNet and VGG-16 reach their classifier's `[6, 6]` and `[7, 7]` at any
/// image size this way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveAvgPool2d {
    pub output: [usize; 2],
}

impl AdaptiveAvgPool2d {
    pub fn windows(&self) -> PoolWindows<'static> {
        PoolWindows::Adaptive {
            output: self.output,
        }
    }
}

impl OpSpec for AdaptiveAvgPool2d {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = expect_rank(inputs, 4, "N,C,H,W")?;
        let [oh, ow] = self.output;
        if oh == 0 || ow == 0 || x.dim(2) == 0 || x.dim(3) == 0 {
            return Err(format!(
                "output {:?} over input {}x{}: both sizes must be at least 1",
                self.output,
                x.dim(2),
                x.dim(3)
            ));
        }
        Ok(Shape::nchw(x.dim(0), x.dim(1), oh, ow))
    }

    fn flops(&self, inputs: &[Shape], output: &Shape) -> Option<Flops> {
        // the largest window: ceil(size/out) + 1 positions a side where windows overlap
        let side = |a: usize| (inputs[0].dim(2 + a).div_ceil(self.output[a]) + 1) as u64;
        let window = side(0).checked_mul(side(1))?;
        Flops::per_element(output.numel(), window, window)
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N, Dim::C, Dim::H, Dim::W]
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(self.windows().project(inputs[0], out));
    }
}

impl OpKernels for AdaptiveAvgPool2d {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend
            .pool2d_forward(c.stream, self.windows(), c.input_shape(0), x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (x, dy) = (c.read(Role::Input(0)), c.read(Role::OutputGrad));
            c.backend
                .pool2d_backward(c.stream, self.windows(), c.input_shape(0), x, dy, dx);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_tile_the_input_as_pytorchs() {
        // 7 rows into 3: [0, 3), [2, 5), [4, 7), overlapping where 7/3 is not whole
        let p = AdaptiveAvgPool2d { output: [3, 2] };
        let w = p.windows();
        let rows: Vec<_> = (0..3).map(|o| w.window(0, o, 7)).collect();
        assert_eq!(rows, [(0..3, 3), (2..5, 3), (4..7, 3)]);
        // 2 columns into 5 (upsampling): each input read by two or three outputs
        let up = AdaptiveAvgPool2d { output: [5, 5] }.windows();
        let cols: Vec<_> = (0..5).map(|o| up.window(1, o, 2).0).collect();
        assert_eq!(cols, [0..1, 0..1, 0..2, 1..2, 1..2]);
        let input = Shape::nchw(2, 4, 7, 6);
        assert_eq!(p.infer_shape(&[input]).unwrap(), Shape::nchw(2, 4, 3, 2));
        let r = p.project(&[input], &Rect::new(&[0, 1, 1, 1], &[2, 3, 3, 2]));
        assert_eq!(r[0], Rect::new(&[0, 1, 2, 3], &[2, 3, 7, 6]));
        let e = AdaptiveAvgPool2d { output: [0, 1] }
            .infer_shape(&[input])
            .unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
    }
}
