use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, expect_rank, window_in, window_out};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};
use std::ops::Range;

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
    /// Rounds the output size up, as PyTorch's `ceil_mode=True`: a last, partial window is kept
    /// where it starts inside the input or its left padding.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ceil_mode: bool,
}

impl Pool2d {
    /// A square max pool whose stride equals its kernel.
    pub fn max(kernel: usize) -> Pool2d {
        Pool2d {
            kind: PoolKind::Max,
            kernel: [kernel, kernel],
            stride: [kernel, kernel],
            padding: [0, 0],
            ceil_mode: false,
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

    /// Rounds the output size up (PyTorch's `ceil_mode=True`).
    pub fn ceil_mode(mut self) -> Self {
        self.ceil_mode = true;
        self
    }

    /// Output rows (`axis` 0) or columns (1) over an input `size` wide.
    pub fn out_extent(&self, axis: usize, size: usize) -> Option<usize> {
        window_out(
            size,
            self.kernel[axis],
            self.stride[axis],
            self.padding[axis],
            self.ceil_mode,
        )
    }

    /// How many positions of the padded input output `o`'s window covers along `axis`: what an
    /// average divides by (PyTorch's `count_include_pad=True`). It is the kernel, except for a
    /// `ceil_mode` window that runs past the padding.
    pub fn padded_window_len(&self, axis: usize, o: usize, size: usize) -> usize {
        let start = o * self.stride[axis];
        let end = (start + self.kernel[axis]).min(size + 2 * self.padding[axis]);
        end.saturating_sub(start)
    }
}

/// The windows a pooling layer reduces, for its kernels: a sliding window, or adaptive average
/// pooling's windows that tile the input into `output` cells.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolWindows<'a> {
    Sliding(&'a Pool2d),
    /// PyTorch's `adaptive_avg_pool2d`: output `o` of `out` along an axis of `size` averages
    /// `[floor(o·size/out), ceil((o+1)·size/out))`.
    Adaptive {
        output: [usize; 2],
    },
}

impl<'a> From<&'a Pool2d> for PoolWindows<'a> {
    fn from(op: &'a Pool2d) -> Self {
        PoolWindows::Sliding(op)
    }
}

impl PoolWindows<'_> {
    pub fn kind(&self) -> PoolKind {
        match self {
            PoolWindows::Sliding(op) => op.kind,
            PoolWindows::Adaptive { .. } => PoolKind::Avg,
        }
    }

    /// Output `o`'s window along `axis` (0 rows, 1 columns) of an input `size` wide: the input
    /// positions it covers, and how many positions of the padded input it spans (what an average
    /// divides by).
    pub fn window(&self, axis: usize, o: usize, size: usize) -> (Range<usize>, usize) {
        match self {
            PoolWindows::Sliding(op) => {
                let (k, s, pad) = (op.kernel[axis], op.stride[axis], op.padding[axis]);
                let start = o * s;
                let lo = start.saturating_sub(pad).min(size);
                let hi = (start + k).saturating_sub(pad).min(size).max(lo);
                (lo..hi, op.padded_window_len(axis, o, size))
            }
            PoolWindows::Adaptive { output } => {
                let out = output[axis];
                let (lo, hi) = (o * size / out, ((o + 1) * size).div_ceil(out));
                (lo..hi, hi - lo)
            }
        }
    }

    /// The input rows (`axis` 0) or columns (1) that outputs `[o0, o1)` read.
    pub fn reads(&self, axis: usize, o0: usize, o1: usize, size: usize) -> (usize, usize) {
        match self {
            PoolWindows::Sliding(op) => window_in(
                o0,
                o1,
                op.kernel[axis],
                op.stride[axis],
                op.padding[axis],
                size,
            ),
            PoolWindows::Adaptive { .. } if o1 <= o0 => (0, 0),
            PoolWindows::Adaptive { .. } => (
                self.window(axis, o0, size).0.start,
                self.window(axis, o1 - 1, size).0.end,
            ),
        }
    }

    /// The input rect an output tile reads.
    pub fn project(&self, input: Shape, out: &Rect) -> Rect {
        let (h0, h1) = self.reads(0, out.lo[2], out.hi[2], input.dim(2));
        let (w0, w1) = self.reads(1, out.lo[3], out.hi[3], input.dim(3));
        Rect::new(
            &[out.lo[0], out.lo[1], h0, w0],
            &[out.hi[0], out.hi[1], h1, w1],
        )
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
        match (self.out_extent(0, x.dim(2)), self.out_extent(1, x.dim(3))) {
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
        rects.push(PoolWindows::from(self).project(inputs[0], out));
    }
}

impl OpKernels for Pool2d {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend
            .pool2d_forward(c.stream, self.into(), c.input_shape(0), x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let (x, dy) = (c.read(Role::Input(0)), c.read(Role::OutputGrad));
            c.backend
                .pool2d_backward(c.stream, self.into(), c.input_shape(0), x, dy, dx);
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

    #[test]
    fn ceil_mode_keeps_a_last_partial_window() {
        // SqueezeNet's first pool: nn.MaxPool2d(3, 2, ceil_mode=True) over 109x109 gives 54x54
        let p = Pool2d::max(3).stride(2).ceil_mode();
        let input = Shape::nchw(1, 96, 109, 109);
        assert_eq!(p.infer_shape(&[input]).unwrap(), Shape::nchw(1, 96, 54, 54));
        let floor = Pool2d::max(3).stride(2);
        assert_eq!(
            floor.infer_shape(&[input]).unwrap(),
            Shape::nchw(1, 96, 54, 54)
        );
        let even = Shape::nchw(1, 1, 6, 6);
        assert_eq!(p.infer_shape(&[even]).unwrap(), Shape::nchw(1, 1, 3, 3));
        assert_eq!(floor.infer_shape(&[even]).unwrap(), Shape::nchw(1, 1, 2, 2));
        // the last window reads the input's last row only, and an average divides by what
        // lies inside the padded input
        let r = p.project(&[even], &Rect::new(&[0, 0, 2, 0], &[1, 1, 3, 3]));
        assert_eq!(r[0], Rect::new(&[0, 0, 4, 0], &[1, 1, 6, 6]));
        assert_eq!(p.padded_window_len(0, 2, 6), 2);
        assert_eq!(p.padded_window_len(0, 1, 6), 3);
        // a window that would start in the right padding is dropped (PyTorch's rule)
        assert_eq!(window_out(4, 2, 2, 1, true), Some(3));
        assert_eq!(window_out(5, 2, 2, 1, true), Some(3));
        assert_eq!(window_out(2, 3, 1, 0, false), None);
    }

    #[test]
    fn ceil_mode_is_written_only_when_set() {
        let floor = serde_json::to_string(&Pool2d::max(2)).unwrap();
        assert!(!floor.contains("ceil_mode"), "{floor}");
        let ceil: Pool2d =
            serde_json::from_str(&serde_json::to_string(&Pool2d::max(2).ceil_mode()).unwrap())
                .unwrap();
        assert!(ceil.ceil_mode);
    }
}
