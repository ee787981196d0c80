use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, expect_rank, window_in, window_out};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    Max,
    /// Average over the window including padded positions (PyTorch's `count_include_pad=True`).
    Avg,
}

/// 2-D max or average pooling with padding; the kernel may differ from the stride (AlexNet's 3×3/2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool2d {
    pub kind: PoolKind,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    #[serde(default)]
    pub padding: [usize; 2],
}

impl Pool2d {
    /// A square max pool whose stride equals its kernel.
    pub fn max(kernel: usize) -> Pool2d {
        Pool2d {
            kind: PoolKind::Max,
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
        }
    }

    /// A square average pool whose stride equals its kernel.
    pub fn avg(kernel: usize) -> Pool2d {
        Pool2d {
            kind: PoolKind::Avg,
            ..Pool2d::max(kernel)
        }
    }

    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }

    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }
}

impl OpSpec for Pool2d {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = expect_rank(inputs, 4, "N,C,H,W")?;
        if self.padding[0] > self.kernel[0] / 2 || self.padding[1] > self.kernel[1] / 2 {
            return Err(format!(
                "padding {:?} must be at most half of kernel {:?}",
                self.padding, self.kernel
            ));
        }
        let oh = window_out(x.dim(2), self.kernel[0], self.stride[0], self.padding[0]);
        let ow = window_out(x.dim(3), self.kernel[1], self.stride[1], self.padding[1]);
        match (oh, ow) {
            (Some(oh), Some(ow)) => Ok(Shape::nchw(x.dim(0), x.dim(1), oh, ow)),
            _ => Err(format!(
                "window {:?} with stride {:?} and padding {:?} does not fit input {}x{}",
                self.kernel,
                self.stride,
                self.padding,
                x.dim(2),
                x.dim(3)
            )),
        }
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        let window = (self.kernel[0] as u64).checked_mul(self.kernel[1] as u64)?;
        Flops::per_element(output.numel(), window, window)
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N, Dim::C, Dim::H, Dim::W]
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        let x = inputs[0];
        let (h0, h1) = window_in(
            out.lo[2],
            out.hi[2],
            self.kernel[0],
            self.stride[0],
            self.padding[0],
            x.dim(2),
        );
        let (w0, w1) = window_in(
            out.lo[3],
            out.hi[3],
            self.kernel[1],
            self.stride[1],
            self.padding[1],
            x.dim(3),
        );
        rects.push(Rect::new(
            &[out.lo[0], out.lo[1], h0, w0],
            &[out.hi[0], out.hi[1], h1, w1],
        ));
    }
}

impl OpKernels for Pool2d {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend
            .pool2d_forward(c.stream, self, c.input_shape(0), x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (x, dy) = (c.read(Role::Input(0)), c.read(Role::OutputGrad));
            c.backend
                .pool2d_backward(c.stream, self, c.input_shape(0), x, dy, dx);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_pool_shape() {
        let p = Pool2d::max(3).stride(2);
        assert_eq!(
            p.infer_shape(&[Shape::nchw(1, 64, 55, 55)]).unwrap(),
            Shape::nchw(1, 64, 27, 27)
        );
        let r = p.project(
            &[Shape::nchw(1, 64, 55, 55)],
            &Rect::new(&[0, 0, 0, 0], &[1, 64, 14, 27]),
        );
        // output rows 0..14 read input rows 0..(13*2+3)=29
        assert_eq!(r[0], Rect::new(&[0, 0, 0, 0], &[1, 64, 29, 55]));
    }
}
