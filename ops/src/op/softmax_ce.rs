use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, expect_rank};
use crate::backend::{Backend, KernelCall, KernelError, Role};
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

impl OpKernels for SoftmaxCrossEntropy {
    /// The loss is the end of the graph: its gradient comes from the labels, not from a consumer.
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads {
            inputs: true,
            output: false,
            output_grad: false,
        }
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let labels = c.step.batch.labels_of(&c.tile);
        let (logits, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.loss = Some(c.backend.softmax_ce_forward(c.stream, logits, labels, y)?);
        Ok(())
    }

    /// The gradient of the batch's mean loss: each sample's share is 1/batch.
    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let labels = c.step.batch.labels_of(&c.tile);
            let scale = 1.0 / c.graph.batch() as f32;
            let logits = c.read(Role::Input(0));
            c.backend
                .softmax_ce_backward(c.stream, logits, labels, scale, dx)?;
        }
        Ok(())
    }
}
