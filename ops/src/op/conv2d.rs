use super::{Activation, Flops, Init, OpSpec, ParamSpec, expect_rank, window_in, window_out};
use super::{BackwardReads, OpKernels};
use crate::backend::{Backend, KernelCall, KernelError, Phase, Role};
use crate::shape::{Dim, Rect, Shape, bounded_elements};
use serde::{Deserialize, Serialize};

/// 2-D convolution over NCHW with optional groups, bias and fused activation.
/// Weight shape is `(out_channels, in_channels / groups, kh, kw)` as in PyTorch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv2d {
    pub out_channels: usize,
    pub kernel: [usize; 2],
    #[serde(default = "one2")]
    pub stride: [usize; 2],
    #[serde(default)]
    pub padding: [usize; 2],
    #[serde(default = "one")]
    pub groups: usize,
    #[serde(default = "yes")]
    pub bias: bool,
    #[serde(default)]
    pub activation: Activation,
}

fn one() -> usize {
    1
}
fn one2() -> [usize; 2] {
    [1, 1]
}
fn yes() -> bool {
    true
}

impl Conv2d {
    /// A square `kernel`×`kernel` convolution with stride 1, no padding, bias, no activation.
    pub fn new(out_channels: usize, kernel: usize) -> Conv2d {
        Conv2d {
            out_channels,
            kernel: [kernel, kernel],
            stride: [1, 1],
            padding: [0, 0],
            groups: 1,
            bias: true,
            activation: Activation::None,
        }
    }

    /// A rectangular `kh`×`kw` kernel (Inception's 1×7 and 7×1).
    pub fn rect(out_channels: usize, kh: usize, kw: usize) -> Conv2d {
        Conv2d {
            kernel: [kh, kw],
            ..Conv2d::new(out_channels, kh)
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

    pub fn padding_hw(mut self, ph: usize, pw: usize) -> Self {
        self.padding = [ph, pw];
        self
    }

    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }

    pub fn no_bias(mut self) -> Self {
        self.bias = false;
        self
    }

    pub fn relu(mut self) -> Self {
        self.activation = Activation::Relu;
        self
    }

    fn in_per_group(&self, input: &Shape) -> usize {
        input.dim(1) / self.groups
    }

    /// Input channels `[lo, hi)` read by output channels `[c0, c1)`.
    pub fn input_channels(&self, in_channels: usize, c0: usize, c1: usize) -> (usize, usize) {
        if self.groups == 1 || c1 <= c0 {
            return (0, in_channels);
        }
        let out_pg = self.out_channels / self.groups;
        let in_pg = in_channels / self.groups;
        (c0 / out_pg * in_pg, (c1 - 1) / out_pg * in_pg + in_pg)
    }
}

impl OpSpec for Conv2d {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = expect_rank(inputs, 4, "N,C,H,W")?;
        let g = self.groups;
        if self.out_channels == 0 || g == 0 {
            return Err("out_channels and groups must be positive".into());
        }
        if !x.dim(1).is_multiple_of(g) || !self.out_channels.is_multiple_of(g) {
            return Err(format!(
                "groups={g} must divide input channels {} and out_channels {}",
                x.dim(1),
                self.out_channels
            ));
        }
        // checked here, before `params` multiplies it out
        bounded_elements(&[
            self.out_channels,
            self.in_per_group(&x),
            self.kernel[0],
            self.kernel[1],
        ])
        .map_err(|e| format!("weight {e}"))?;
        let oh = window_out(
            x.dim(2),
            self.kernel[0],
            self.stride[0],
            self.padding[0],
            false,
        );
        let ow = window_out(
            x.dim(3),
            self.kernel[1],
            self.stride[1],
            self.padding[1],
            false,
        );
        match (oh, ow) {
            (Some(oh), Some(ow)) => Ok(Shape::nchw(x.dim(0), self.out_channels, oh, ow)),
            _ => Err(format!(
                "kernel {:?} with stride {:?} and padding {:?} does not fit input {}x{}",
                self.kernel,
                self.stride,
                self.padding,
                x.dim(2),
                x.dim(3)
            )),
        }
    }

    fn params(&self, inputs: &[Shape]) -> Vec<ParamSpec> {
        let cin = self.in_per_group(&inputs[0]);
        let fan_in = cin * self.kernel[0] * self.kernel[1];
        let mut p = vec![ParamSpec::trainable(
            "weight",
            Shape::nchw(self.out_channels, cin, self.kernel[0], self.kernel[1]),
            Init::FanInUniform { fan_in },
        )];
        if self.bias {
            p.push(ParamSpec::trainable(
                "bias",
                Shape::new(&[self.out_channels]),
                Init::FanInUniform { fan_in },
            ));
        }
        p
    }

    fn flops(&self, inputs: &[Shape], output: &Shape) -> Option<Flops> {
        // per output element, one multiply-add per weight of its filter
        let filter = (self.in_per_group(&inputs[0]) as u64)
            .checked_mul(self.kernel[0] as u64)?
            .checked_mul(self.kernel[1] as u64)?;
        Flops::gemm((output.numel() as u64).checked_mul(filter), output.numel())
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N, Dim::C, Dim::H, Dim::W]
    }

    fn reduction_channels(&self, inputs: &[Shape]) -> Option<usize> {
        (self.groups == 1).then(|| inputs[0].dim(1))
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        let x = inputs[0];
        let (c0, c1) = self.input_channels(x.dim(1), out.lo[1], out.hi[1]);
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
            &[out.lo[0], c0, h0, w0],
            &[out.hi[0], c1, h1, w1],
        ));
    }
}

impl super::ReductionKernels for Conv2d {
    fn partial_op(&self, bias: bool) -> Self {
        Conv2d {
            bias,
            activation: Activation::None,
            ..self.clone()
        }
    }

    fn activation(&self) -> Activation {
        self.activation
    }
}

impl OpKernels for Conv2d {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS_AND_OUTPUT
    }

    fn run<B: Backend>(&self, phase: Phase, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        use super::ReductionKernels;
        self.run_with_reductions(
            phase,
            c,
            |c, op, in_shape, x, w, b, y| {
                c.backend.conv2d_forward(c.stream, op, in_shape, x, w, b, y)
            },
            |c, op, in_shape, x, w, g| {
                // Without an activation the kernel does not read the output: dp stands in.
                let (dp, dx, dw, db) = (g.dp, g.dx, g.dw, g.db);
                c.backend
                    .conv2d_backward(c.stream, op, in_shape, x, w, dp, dp, dx, dw, db);
            },
        )
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let b = self.bias.then(|| c.read(Role::Param(1)));
        let (x, w, y) = (
            c.read(Role::Input(0)),
            c.read(Role::Param(0)),
            c.write(Role::Output),
        );
        c.backend
            .conv2d_forward(c.stream, self, c.input_shape(0), x, w, b, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, w) = (c.read(Role::Input(0)), c.read(Role::Param(0)));
        let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
        let dw = c.write(Role::ParamGrad(0));
        let db = c.try_write(Role::ParamGrad(1));
        let dx = c.try_write(Role::InputGrad(0));
        c.backend
            .conv2d_backward(c.stream, self, c.input_shape(0), x, w, y, dy, dx, dw, db);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alexnet_conv1_shape_and_halo() {
        let c = Conv2d::new(64, 11).stride(4).padding(2).relu();
        let x = Shape::nchw(8, 3, 224, 224);
        let y = c.infer_shape(&[x]).unwrap();
        assert_eq!(y, Shape::nchw(8, 64, 55, 55));
        // Bottom half of the output rows: rows 28..55 read input rows 28*4-2=110 .. 54*4+11-2=225 → 224.
        let tile = Rect::new(&[0, 0, 28, 0], &[8, 64, 55, 55]);
        let r = c.project(&[x], &tile);
        assert_eq!(r[0], Rect::new(&[0, 0, 110, 0], &[8, 3, 224, 224]));
    }

    #[test]
    fn grouped_channel_projection() {
        let c = Conv2d::new(8, 3).padding(1).groups(4);
        let x = Shape::nchw(2, 16, 5, 5);
        // output channels 2..4 are group 1, which reads input channels 4..8
        let r = c.project(&[x], &Rect::new(&[0, 2, 0, 0], &[2, 4, 5, 5]));
        assert_eq!(r[0], Rect::new(&[0, 4, 0, 0], &[2, 8, 5, 5]));
    }

    #[test]
    fn bad_rank_is_reported() {
        let e = Conv2d::new(4, 3)
            .infer_shape(&[Shape::nc(2, 3)])
            .unwrap_err();
        assert!(e.contains("input has 2 dims, expected 4"), "{e}");
    }
}
