use super::{Activation, Flops, Init, OpSpec, ParamSpec, expect_rank};
use super::{BackwardReads, OpKernels};
use crate::backend::{Backend, KernelCall, KernelError, Phase, Role};
use crate::shape::{Dim, Rect, Shape, bounded_elements};
use serde::{Deserialize, Serialize};

/// Fully connected layer over `(N, in_features)`. Weight is `(out_features, in_features)` as in PyTorch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dense {
    pub out_features: usize,
    #[serde(default = "yes")]
    pub bias: bool,
    #[serde(default)]
    pub activation: Activation,
}

fn yes() -> bool {
    true
}

impl Dense {
    pub fn new(out_features: usize) -> Dense {
        Dense {
            out_features,
            bias: true,
            activation: Activation::None,
        }
    }

    pub fn relu(mut self) -> Self {
        self.activation = Activation::Relu;
        self
    }

    pub fn no_bias(mut self) -> Self {
        self.bias = false;
        self
    }
}

impl OpSpec for Dense {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = expect_rank(inputs, 2, "N,C; add a flatten before a dense layer")?;
        if self.out_features == 0 {
            return Err("out_features must be positive".into());
        }
        bounded_elements(&[self.out_features, x.dim(1)]).map_err(|e| format!("weight {e}"))?;
        Ok(Shape::nc(x.dim(0), self.out_features))
    }

    fn params(&self, inputs: &[Shape]) -> Vec<ParamSpec> {
        let fan_in = inputs[0].dim(1);
        let mut p = vec![ParamSpec::trainable(
            "weight",
            Shape::nc(self.out_features, fan_in),
            Init::FanInUniform { fan_in },
        )];
        if self.bias {
            p.push(ParamSpec::trainable(
                "bias",
                Shape::new(&[self.out_features]),
                Init::FanInUniform { fan_in },
            ));
        }
        p
    }

    fn flops(&self, inputs: &[Shape], output: &Shape) -> Option<Flops> {
        let macs = (output.numel() as u64).checked_mul(inputs[0].dim(1) as u64);
        Flops::gemm(macs, output.numel())
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N, Dim::C]
    }

    fn reduction_channels(&self, inputs: &[Shape]) -> Option<usize> {
        Some(inputs[0].dim(1))
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(Rect::new(&[out.lo[0], 0], &[out.hi[0], inputs[0].dim(1)]));
    }
}

impl super::ReductionKernels for Dense {
    fn partial_op(&self, bias: bool) -> Self {
        Dense {
            bias,
            activation: Activation::None,
            ..self.clone()
        }
    }

    fn activation(&self) -> Activation {
        self.activation
    }
}

impl OpKernels for Dense {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS_AND_OUTPUT
    }

    fn run<B: Backend>(&self, phase: Phase, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        use super::ReductionKernels;
        self.run_with_reductions(
            phase,
            c,
            |c, op, _, x, w, b, y| c.backend.dense_forward(c.stream, op, x, w, b, y),
            |c, op, _, x, w, g| {
                // Without an activation the kernel does not read the output: dp stands in.
                let (dp, dx, dw, db) = (g.dp, g.dx, g.dw, g.db);
                c.backend
                    .dense_backward(c.stream, op, x, w, dp, dp, dx, dw, db);
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
        c.backend.dense_forward(c.stream, self, x, w, b, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, w) = (c.read(Role::Input(0)), c.read(Role::Param(0)));
        let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
        let dw = c.write(Role::ParamGrad(0));
        let db = c.try_write(Role::ParamGrad(1));
        let dx = c.try_write(Role::InputGrad(0));
        c.backend
            .dense_backward(c.stream, self, x, w, y, dy, dx, dw, db);
        Ok(())
    }
}
