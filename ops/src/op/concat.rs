use super::{BackwardReads, OpKernels};
use super::{Flops, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Concatenation along the channel axis (Inception's branch join).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Concat {}

impl Concat {
    /// Channel offset of each input in the output.
    pub fn offsets(inputs: &[Shape]) -> Vec<usize> {
        let mut acc = 0;
        inputs
            .iter()
            .map(|s| {
                let o = acc;
                acc += s.dim(1);
                o
            })
            .collect()
    }
}

impl OpSpec for Concat {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        let first = inputs[0];
        if first.ndim() < 2 {
            return Err(format!(
                "input has {} dims, expected at least 2",
                first.ndim()
            ));
        }
        let mut channels = 0;
        for (i, s) in inputs.iter().enumerate() {
            let same_rest = s.ndim() == first.ndim()
                && (0..s.ndim()).all(|a| a == 1 || s.dim(a) == first.dim(a));
            if !same_rest {
                return Err(format!(
                    "input {i} has shape {s}, which differs from input 0 {first} outside the channel axis"
                ));
            }
            channels = s
                .dim(1)
                .checked_add(channels)
                .ok_or("the inputs' channel counts overflow when added")?;
        }
        let mut dims = first.dims().to_vec();
        dims[1] = channels;
        Ok(Shape::new(&dims))
    }

    fn flops(&self, _inputs: &[Shape], _output: &Shape) -> Option<Flops> {
        Some(Flops::default())
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    /// The slice of each input that falls in the tile's channel range (empty for inputs outside it),
    /// in the input's own coordinates.
    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.extend(Concat::offsets(inputs).iter().zip(inputs).map(|(&off, s)| {
            let lo = out.lo[1].clamp(off, off + s.dim(1)) - off;
            let hi = out.hi[1].clamp(off, off + s.dim(1)) - off;
            out.with_axis(1, lo, hi)
        }));
    }
}

impl OpKernels for Concat {
    fn backward_reads(&self) -> BackwardReads {
        BackwardReads::OUTPUT_GRAD_ONLY
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let shapes = c.input_shapes();
        let xs: Vec<_> = (0..shapes.len())
            .map(|k| c.try_read(Role::Input(k as u8)))
            .collect();
        let y = c.write(Role::Output);
        c.backend.concat_forward(c.stream, &shapes, &xs, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let shapes = c.input_shapes();
        let dy = c.read(Role::OutputGrad);
        let dxs = (0..shapes.len())
            .map(|k| c.try_write(Role::InputGrad(k as u8)))
            .collect();
        c.backend.concat_backward(c.stream, &shapes, dy, dxs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_slices() {
        let ins = [Shape::nchw(2, 3, 4, 4), Shape::nchw(2, 5, 4, 4)];
        let c = Concat {};
        assert_eq!(c.infer_shape(&ins).unwrap(), Shape::nchw(2, 8, 4, 4));
        let r = c.project(&ins, &Rect::new(&[0, 2, 0, 0], &[2, 6, 4, 4]));
        assert_eq!(r[0], Rect::new(&[0, 2, 0, 0], &[2, 3, 4, 4]));
        assert_eq!(r[1], Rect::new(&[0, 0, 0, 0], &[2, 3, 4, 4]));
        let r = c.project(&ins, &Rect::new(&[0, 4, 0, 0], &[2, 8, 4, 4]));
        assert!(r[0].is_empty());
    }
}
