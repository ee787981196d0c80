//! The SGD step (momentum and weight decay) over a parameter slice, one kernel.

use crate::backend::{Cuda, Launch};
use crate::launch::grid;
use crate::memory::{Buffer, Stream};
use cudarc::driver::PushKernelArg;
use legion_ops::backend::{In, Out};
use legion_ops::train::Sgd;

/// What `Backend::sgd_update` enqueues.
pub(crate) fn update(
    cuda: &Cuda,
    s: &Stream,
    sgd: &Sgd,
    grad: In<Buffer>,
    w: Out<Buffer>,
    velocity: Out<Buffer>,
) -> Launch {
    let n = w.mem.len() as i64;
    assert_eq!(
        grad.mem.len() as i64,
        n,
        "gradient and weights differ in length"
    );
    assert_eq!(
        velocity.mem.len() as i64,
        n,
        "velocity and weights differ in length"
    );
    if n == 0 {
        return Ok(());
    }
    let mut b = s.stream.launch_builder(&cuda.kernels.sgd_update);
    b.arg(grad.mem.f32())
        .arg(w.mem.f32_mut())
        .arg(velocity.mem.f32_mut())
        .arg(&n)
        .arg(&sgd.lr)
        .arg(&sgd.momentum)
        .arg(&sgd.weight_decay);
    // SAFETY: the arguments match the kernel's signature; the three buffers have n elements.
    unsafe { b.launch(grid(n)) }?;
    Ok(())
}
