//! Concatenation along channels: each input's slice of an output tile copied into place, and the
//! gradients copied back out; region moves with the input's channels shifted by its offset.

use crate::backend::{Cuda, Launch};
use crate::launch::Box4;
use crate::memory::{Buffer, Stream};
use legion_ops::backend::{In, Out};
use legion_ops::op::{Concat, OpSpec};
use legion_ops::shape::Shape;

/// What `Backend::concat_forward` enqueues.
pub(crate) fn forward(
    cuda: &Cuda,
    s: &Stream,
    input_shapes: &[Shape],
    xs: &[Option<In<Buffer>>],
    y: Out<Buffer>,
) -> Launch {
    if y.rect.is_empty() {
        return Ok(());
    }
    let slices = Concat::default().project(input_shapes, &y.rect);
    let offsets = Concat::offsets(input_shapes);
    let y_layout = Box4::of(&y.rect);
    let dst = y.mem;
    for ((x, slice), &offset) in xs.iter().zip(&slices).zip(&offsets) {
        if slice.is_empty() {
            continue;
        }
        let x = x.expect("concat input the tile reads was not given");
        let offset = offset as i64;
        let src_layout = Box4::of(&x.rect).shifted(1, offset);
        let region = Box4::of(slice).shifted(1, offset);
        cuda.move_region(s, false, x.mem, src_layout, dst, y_layout, region)?;
    }
    Ok(())
}

/// What `Backend::concat_backward` enqueues.
pub(crate) fn backward(
    cuda: &Cuda,
    s: &Stream,
    input_shapes: &[Shape],
    dy: In<Buffer>,
    dxs: Vec<Option<Out<Buffer>>>,
) -> Launch {
    let offsets = Concat::offsets(input_shapes);
    for (dx, &offset) in dxs.into_iter().zip(&offsets) {
        let Some(dx) = dx else { continue };
        // the gradient's own rect, moved to where its input sits in the output
        let layout = Box4::of(&dx.rect).shifted(1, offset as i64);
        cuda.move_region(s, false, dy.mem, Box4::of(&dy.rect), dx.mem, layout, layout)?;
    }
    Ok(())
}
