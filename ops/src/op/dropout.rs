use super::{Flops, OpSpec, elementwise_dims};
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
