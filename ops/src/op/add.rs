use super::{Flops, OpSpec, elementwise_dims};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Element-wise sum of two tensors of the same shape (residual connections).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Add {}

impl OpSpec for Add {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        if inputs[0] != inputs[1] {
            return Err(format!(
                "inputs have different shapes {} and {}",
                inputs[0], inputs[1]
            ));
        }
        Ok(inputs[0])
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        Flops::per_element(output.numel(), 1, 0)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.extend([*out, *out]);
    }
}
