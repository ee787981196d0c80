use super::{Flops, Init, OpSpec, ParamSpec, elementwise_dims};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

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
