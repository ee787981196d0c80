use super::{Flops, OpSpec, expect_rank};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Softmax over classes followed by cross-entropy against the batch's labels, averaged over the
/// global batch. Output is the per-sample loss `(N, 1)`; its mean is the training loss.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoftmaxCrossEntropy {}

impl OpSpec for SoftmaxCrossEntropy {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let x = expect_rank(inputs, 2, "N,classes")?;
        Ok(Shape::nc(x.dim(0), 1))
    }

    fn flops(&self, inputs: &[Shape], _output: &Shape) -> Option<Flops> {
        Flops::per_element(inputs[0].numel(), 4, 2)
    }

    fn parallel_dims(&self, _output: &Shape) -> &'static [Dim] {
        &[Dim::N]
    }

    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(Rect::new(&[out.lo[0], 0], &[out.hi[0], inputs[0].dim(1)]));
    }
}
