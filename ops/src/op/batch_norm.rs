use super::{BackwardReads, OpKernels};
use super::{Flops, Init, OpSpec, ParamSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Phase, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// The `[3, C]` rect of a batch norm's per-channel sums (count, Σ, Σ of squares) for channels
/// `channels`: what a tile of those channels contributes to and reads.
pub fn sums_rect(channels: std::ops::Range<usize>) -> Rect {
    Rect::new(&[0, channels.start], &[3, channels.end])
}

/// [`sums_rect`] of the channels of `tile`, an `[N, C, …]` block of a batch norm's output.
pub fn tile_sums_rect(tile: &Rect) -> Rect {
    sums_rect(tile.lo[1]..tile.hi[1])
}

/// Batch normalisation over N (and H, W for images) per channel, using the statistics of the whole
/// batch in training whatever the partition: tiles reduce partial sums before normalising.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchNorm {
    #[serde(default = "default_eps")]
    pub eps: f32,
    /// Weight of the new batch statistics in the running averages.
    #[serde(default = "default_momentum")]
    pub momentum: f32,
    /// Fused ReLU after the affine transform.
    #[serde(default)]
    pub relu: bool,
}

fn default_eps() -> f32 {
    1e-5
}
fn default_momentum() -> f32 {
    0.1
}

impl Default for BatchNorm {
    fn default() -> Self {
        BatchNorm {
            eps: default_eps(),
            momentum: default_momentum(),
            relu: false,
        }
    }
}

impl BatchNorm {
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    pub fn relu(mut self) -> Self {
        self.relu = true;
        self
    }
}

impl OpSpec for BatchNorm {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = inputs[0];
        if x.ndim() != 4 && x.ndim() != 2 {
            return Err(format!(
                "input has {} dims, expected 4 (N,C,H,W) or 2 (N,C)",
                x.ndim()
            ));
        }
        Ok(x)
    }

    fn params(&self, inputs: &[Shape]) -> Vec<ParamSpec> {
        let c = Shape::new(&[inputs[0].dim(1)]);
        vec![
            ParamSpec::trainable("weight", c, Init::Ones),
            ParamSpec::trainable("bias", c, Init::Zeros),
            ParamSpec::buffer("running_mean", c, Init::Zeros),
            ParamSpec::buffer("running_var", c, Init::Ones),
        ]
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 6, 8)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for BatchNorm {
    /// What its backward phases read (the output only with the ReLU fused); the lowering builds
    /// batch norm's phases itself and does not consult this.
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::INPUTS_AND_OUTPUT
    }

    /// Batch norm runs in phases (`run`), never as one forward.
    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        self.run(Phase::BnNormalize, c)
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        self.run(Phase::BnInputGrad, c)
    }

    fn run<B: Backend>(&self, phase: Phase, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if phase == Phase::BnRunning {
            let moments = c.read(Role::Moments);
            let (mean, var) = (c.write(Role::Param(2)), c.write(Role::Param(3)));
            c.backend.bn_running(c.stream, self, moments, mean, var);
            return Ok(());
        }
        let x = c.read(Role::Input(0));
        match phase {
            Phase::BnMoments => {
                let moments = c.write(Role::Moments);
                c.backend.bn_moments(c.stream, x, &c.tile, moments);
            }
            Phase::Infer => {
                let (gamma, beta) = (c.read(Role::Param(0)), c.read(Role::Param(1)));
                let (mean, var) = (c.read(Role::Param(2)), c.read(Role::Param(3)));
                let y = c.write(Role::Output);
                c.backend
                    .bn_infer(c.stream, self, x, gamma, beta, mean, var, y);
            }
            Phase::BnNormalize => {
                let moments = c.read(Role::Moments);
                let (gamma, beta) = (c.read(Role::Param(0)), c.read(Role::Param(1)));
                let y = c.write(Role::Output);
                c.backend
                    .bn_normalize(c.stream, self, x, moments, gamma, beta, y);
            }
            Phase::BnGradSums => {
                let moments = c.read(Role::Moments);
                let y = self.relu.then(|| c.read(Role::Output));
                let dy = c.read(Role::OutputGrad);
                let (dgamma, dbeta) = (c.write(Role::ParamGrad(0)), c.write(Role::ParamGrad(1)));
                let sums = c.write(Role::GradSums);
                c.backend.bn_grad_sums(
                    c.stream, self, x, y, dy, moments, &c.tile, dgamma, dbeta, sums,
                );
            }
            Phase::BnInputGrad => {
                let moments = c.read(Role::Moments);
                let y = self.relu.then(|| c.read(Role::Output));
                let (dy, gamma) = (c.read(Role::OutputGrad), c.read(Role::Param(0)));
                let sums = c.read(Role::GradSums);
                let dx = c.write(Role::InputGrad(0));
                c.backend
                    .bn_input_grad(c.stream, self, x, y, dy, moments, gamma, sums, dx);
            }
            other => panic!("batch norm has no {other} phase"),
        }
        Ok(())
    }
}
