//! CPU kernels: forward and backward of every op over one tile.
//!
//! Conventions shared by every kernel (the runtime relies on them):
//! - A tensor piece is a [`View`]/[`ViewMut`]: row-major f32 data laid out over a `Rect` given in the
//!   *global* coordinates of the full tensor. A whole-tensor run is the special case `rect = full`.
//! - An input view must contain the op's projection of the output tile (`OpSpec::project`). Positions
//!   outside the full tensor (padding) read as zero (max pooling ignores them).
//! - Parameter views cover the slice `OpSpec::param_rect` gives for the output tile.
//! - Gradient outputs (`dx`, `dw`, `db`, partial statistics) are *overwritten* with this tile's
//!   contribution. Where tiles overlap (halos, channel splits, weight gradients of sample splits) the
//!   caller sums the contributions; kernels never accumulate across calls.
//! - Fused activations: forward applies them; backward takes the post-activation output `y` and the
//!   gradient w.r.t. it, and masks internally.
//! - Kernels parallelise on the current rayon pool (the global one, sized to the cores, or an
//!   embedded device's own share of them) and never allocate per element.

#[cfg(test)]
pub(crate) mod check;

pub mod add;
pub mod batch_norm;
pub mod concat;
pub mod conv2d;
pub mod dense;
pub mod depthwise;
pub mod dropout;
pub mod gemm;
pub mod mul;
pub mod pool2d;
pub mod relu;
pub mod softmax_ce;
pub mod unary;

use crate::shape::Rect;

/// Read-only tile data laid out over `rect`.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub rect: Rect,
    pub data: &'a [f32],
}

/// Writable tile data laid out over `rect`.
#[derive(Debug)]
pub struct ViewMut<'a> {
    pub rect: Rect,
    pub data: &'a mut [f32],
}

impl<'a> View<'a> {
    pub fn new(rect: Rect, data: &'a [f32]) -> View<'a> {
        assert_eq!(
            rect.volume(),
            data.len(),
            "view data length does not match rect {rect}"
        );
        View { rect, data }
    }
}

impl<'a> ViewMut<'a> {
    pub fn new(rect: Rect, data: &'a mut [f32]) -> ViewMut<'a> {
        assert_eq!(
            rect.volume(),
            data.len(),
            "view data length does not match rect {rect}"
        );
        ViewMut { rect, data }
    }

    pub fn as_view(&self) -> View<'_> {
        View {
            rect: self.rect,
            data: self.data,
        }
    }
}
