use super::{Flops, OpSpec, elementwise_dims};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// The model's input batch (images NCHW or features NC). Labels come with the data, not the graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    pub shape: Shape,
}

impl OpSpec for Input {
    fn infer_shape(&self, _inputs: &[Shape]) -> Result<Shape, String> {
        Ok(self.shape)
    }

    fn flops(&self, _inputs: &[Shape], _output: &Shape) -> Option<Flops> {
        Some(Flops::default())
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], _out: &Rect, _rects: &mut Vec<Rect>) {}
}
