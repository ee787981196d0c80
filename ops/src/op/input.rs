use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
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

impl OpKernels for Input {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT_GRAD_ONLY
    }

    /// Loads the tile of the step's images.
    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let mut held = c.shape().full_rect();
        held.lo[0] = c.step.batch.image_samples.start;
        held.hi[0] = c.step.batch.image_samples.end;
        let y = c.write(Role::Output);
        c.backend
            .load_images(c.stream, c.step.batch.images, &held, &c.tile, y);
        Ok(())
    }

    /// The data needs no gradient.
    fn backward<B: Backend>(&self, _: &mut KernelCall<B>) -> Result<(), KernelError> {
        Ok(())
    }
}
