//! Max and average pooling over a tile: forward, and backward as a gather (each input element sums
//! the gradients of the windows that took it; for max pooling, each window's argmax found once
//! first).

use crate::backend::{Cuda, Launch};
use crate::launch::{Box4, grid};
use crate::memory::{Buffer, Stream, same_type};
use cudarc::driver::{DeviceRepr, PushKernelArg};
use legion_ops::backend::{In, Out};
use legion_ops::op::{PoolKind, PoolWindows};
use legion_ops::shape::Shape;

/// The pooling parameters as `Pool` in kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PoolParams {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    in_size: [i64; 2],
    out_size: [i64; 2],
    is_max: i32,
    adaptive: i32,
}

// SAFETY: plain old data with the C layout of `Pool` in kernels.cu.
unsafe impl DeviceRepr for PoolParams {}

impl PoolParams {
    fn new(op: PoolWindows<'_>, in_shape: Shape) -> PoolParams {
        let in_size = [in_shape.dim(2) as i64, in_shape.dim(3) as i64];
        let is_max = matches!(op.kind(), PoolKind::Max) as i32;
        match op {
            PoolWindows::Sliding(p) => PoolParams {
                kernel: p.kernel.map(|k| k as i64),
                stride: p.stride.map(|s| s as i64),
                padding: p.padding.map(|p| p as i64),
                in_size,
                // read by adaptive windows only
                out_size: [1, 1],
                is_max,
                adaptive: 0,
            },
            PoolWindows::Adaptive { output } => PoolParams {
                kernel: [0, 0],
                stride: [1, 1],
                padding: [0, 0],
                in_size,
                out_size: output.map(|o| o as i64),
                is_max,
                adaptive: 1,
            },
        }
    }
}

/// What `Backend::pool2d_forward` enqueues.
pub(crate) fn forward(
    cuda: &Cuda,
    s: &Stream,
    op: PoolWindows<'_>,
    in_shape: Shape,
    x: In<Buffer>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    let n = tile.volume();
    if n == 0 {
        return Ok(());
    }
    let x_layout = Box4::of(&x.rect);
    let pool = PoolParams::new(op, in_shape);
    let dtype = same_type(&[x.mem.dtype(), y.mem.dtype()]);
    let mut b = s
        .stream
        .launch_builder(cuda.kernels.pool2d_forward.of(dtype));
    x.mem.push(&mut b);
    b.arg(&x_layout);
    y.mem.push_mut(&mut b);
    b.arg(&tile).arg(&pool).arg(&n);
    // SAFETY: the arguments match the kernel's signature; x contains the tile's windows.
    unsafe { b.launch(grid(n)) }?;
    Ok(())
}

/// What `Backend::pool2d_backward` enqueues.
pub(crate) fn backward(
    cuda: &Cuda,
    s: &Stream,
    op: PoolWindows<'_>,
    in_shape: Shape,
    x: In<Buffer>,
    dy: In<Buffer>,
    dx: Out<Buffer>,
) -> Launch {
    assert_eq!(dx.rect, x.rect, "dx must cover the input view");
    let x_layout = Box4::of(&x.rect);
    let n = x_layout.volume();
    if n == 0 {
        return Ok(());
    }
    let tile = Box4::of(&dy.rect);
    let pool = PoolParams::new(op, in_shape);
    let dtype = same_type(&[x.mem.dtype(), dy.mem.dtype(), dx.mem.dtype()]);
    // Max pooling: each window's argmax first, once per output (average pooling reads
    // none; the kernel is given a one-element buffer it never reads).
    let outputs = match op.kind() {
        PoolKind::Max => tile.volume().max(0),
        PoolKind::Avg => 0,
    };
    // SAFETY: the argmax kernel writes every element before the gather reads it.
    let mut argmax = unsafe { s.stream.alloc::<i64>(outputs.max(1) as usize) }?;
    if outputs > 0 {
        let mut b = s
            .stream
            .launch_builder(cuda.kernels.pool2d_argmax.of(dtype));
        x.mem.push(&mut b);
        b.arg(&x_layout)
            .arg(&tile)
            .arg(&mut argmax)
            .arg(&pool)
            .arg(&outputs);
        // SAFETY: the arguments match the kernel's signature; argmax covers the tile.
        unsafe { b.launch(grid(outputs)) }?;
    }
    let mut b = s
        .stream
        .launch_builder(cuda.kernels.pool2d_backward.of(dtype));
    b.arg(&argmax).arg(&x_layout);
    dy.mem.push(&mut b);
    b.arg(&tile);
    dx.mem.push_mut(&mut b);
    b.arg(&pool).arg(&n);
    // SAFETY: the arguments match the kernel's signature; dx is laid out like x.
    unsafe { b.launch(grid(n)) }?;
    Ok(())
}
