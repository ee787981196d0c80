//! Batch normalisation: per-channel moments (each channel's sums split into parts, so that a layer
//! with few channels still fills the GPU, then finished in f64), the normalisation with its
//! optional ReLU, the running statistics, and the backward pass's sums and input gradient. The
//! kernels that touch activations run a block per part of a channel ([`ChannelParts`]).

use crate::backend::{Cuda, Launch};
use crate::launch::{Box4, ChannelParts, NULL, grid};
use crate::memory::{Buffer, Stream, same_type};
use cudarc::driver::{CudaSlice, PushKernelArg};
use legion_ops::backend::{In, Out};
use legion_ops::op::BatchNorm;
use legion_ops::shape::Rect;

/// The statistics operands of the batch-norm kernels: `[3, C]` sums over channels `[lo, lo + C)`.
fn sums_range(sums: &In<Buffer>) -> (i64, i64) {
    (sums.rect.lo[1] as i64, sums.rect.extent(1) as i64)
}

/// What `Backend::bn_moments` enqueues.
pub(crate) fn moments(
    cuda: &Cuda,
    s: &Stream,
    x: In<Buffer>,
    tile: &Rect,
    moments: Out<Buffer>,
) -> Launch {
    let tile_box = Box4::of(tile);
    let channels = tile_box.ext[1];
    assert_eq!(
        moments.mem.len(),
        3 * channels as usize,
        "moments must be [3, tile channels]"
    );
    if channels == 0 {
        return Ok(());
    }
    let x_layout = Box4::of(&x.rect);
    let cut = ChannelParts::of(&tile_box)?;
    let (count, parts) = (cut.per_channel, cut.parts);
    // SAFETY: the first kernel writes every partial sum before the second reads it.
    let mut partial = unsafe { s.stream.alloc::<f64>((2 * parts * channels) as usize) }?;
    let mut b = s
        .stream
        .launch_builder(cuda.kernels.bn_moments.of(x.mem.dtype()));
    x.mem.push(&mut b);
    b.arg(&x_layout)
        .arg(&tile_box)
        .arg(&parts)
        .arg(&mut partial);
    // SAFETY: the arguments match the kernel's signature; x contains the tile, and a
    // block of each part of each channel writes its two partial sums.
    unsafe { b.launch(cut.launch()) }?;
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_sums_finish);
    b.arg(&partial)
        .arg(&parts)
        .arg(&channels)
        .arg(&count)
        .arg(moments.mem.f64_mut());
    // SAFETY: as above; the moments are [3, channels].
    unsafe { b.launch(grid(channels)) }?;
    Ok(())
}

/// What `Backend::bn_normalize` enqueues.
#[allow(clippy::too_many_arguments)]
pub(crate) fn normalize(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    x: In<Buffer>,
    moments: In<Buffer>,
    gamma: In<Buffer>,
    beta: In<Buffer>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    if tile.volume() == 0 {
        return Ok(());
    }
    let (m_lo, m_channels) = sums_range(&moments);
    let (gamma_lo, beta_lo) = (gamma.rect.lo[0] as i64, beta.rect.lo[0] as i64);
    let (c_lo, channels) = (tile.lo[1], tile.ext[1]);
    // SAFETY: bn_affine writes every coefficient before bn_normalize reads it.
    let mut coef = unsafe { s.stream.alloc::<f32>(3 * channels as usize) }?;
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_affine);
    b.arg(moments.mem.f64())
        .arg(&m_lo)
        .arg(&m_channels)
        .arg(gamma.mem.f32())
        .arg(&gamma_lo)
        .arg(beta.mem.f32())
        .arg(&beta_lo)
        .arg(&op.eps)
        .arg(&c_lo)
        .arg(&channels)
        .arg(&mut coef);
    // SAFETY: the arguments match the kernel's signature; the per-channel operands cover
    // the tile's channels.
    unsafe { b.launch(grid(channels)) }?;
    apply_affine(cuda, s, op, x, &coef, y)
}

/// What `Backend::bn_infer` enqueues: the normalisation of [`normalize`] with coefficients from
/// the running statistics.
#[allow(clippy::too_many_arguments)]
pub(crate) fn infer(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    x: In<Buffer>,
    gamma: In<Buffer>,
    beta: In<Buffer>,
    mean: In<Buffer>,
    var: In<Buffer>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    if tile.volume() == 0 {
        return Ok(());
    }
    let lo = |p: &In<Buffer>| p.rect.lo[0] as i64;
    let los = [lo(&mean), lo(&var), lo(&gamma), lo(&beta)];
    let (c_lo, channels) = (tile.lo[1], tile.ext[1]);
    // SAFETY: bn_affine_running writes every coefficient before bn_normalize reads it.
    let mut coef = unsafe { s.stream.alloc::<f32>(3 * channels as usize) }?;
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_affine_running);
    b.arg(mean.mem.f32())
        .arg(&los[0])
        .arg(var.mem.f32())
        .arg(&los[1])
        .arg(gamma.mem.f32())
        .arg(&los[2])
        .arg(beta.mem.f32())
        .arg(&los[3])
        .arg(&op.eps)
        .arg(&c_lo)
        .arg(&channels)
        .arg(&mut coef);
    // SAFETY: the arguments match the kernel's signature; the per-channel operands cover
    // the tile's channels.
    unsafe { b.launch(grid(channels)) }?;
    apply_affine(cuda, s, op, x, &coef, y)
}

/// y = (x − mean)·scale + shift per channel with `coef` (`[3][tile channels]`: mean, γ·invstd,
/// β), then the ReLU where fused.
fn apply_affine(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    x: In<Buffer>,
    coef: &CudaSlice<f32>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    let x_layout = Box4::of(&x.rect);
    let relu = op.relu as i32;
    let dtype = same_type(&[x.mem.dtype(), y.mem.dtype()]);
    // batch norm after a dense layer: row-major (`Box4::is_rows`)
    if tile.is_rows() {
        let (n, packed) = (tile.volume(), (x_layout == tile) as i32);
        let mut b = s
            .stream
            .launch_builder(cuda.kernels.bn_normalize_rows.of(dtype));
        x.mem.push(&mut b);
        b.arg(&x_layout);
        y.mem.push_mut(&mut b);
        b.arg(&tile).arg(coef).arg(&relu).arg(&n).arg(&packed);
        // SAFETY: as above; the coefficients cover the tile's channels.
        unsafe { b.launch(grid(n)) }?;
        return Ok(());
    }
    let cut = ChannelParts::of(&tile)?;
    let mut b = s.stream.launch_builder(cuda.kernels.bn_normalize.of(dtype));
    x.mem.push(&mut b);
    b.arg(&x_layout);
    y.mem.push_mut(&mut b);
    b.arg(&tile).arg(coef).arg(&relu).arg(&cut.parts);
    // SAFETY: as above; the coefficients cover the tile's channels.
    unsafe { b.launch(cut.launch()) }?;
    Ok(())
}

/// What `Backend::bn_running` enqueues.
pub(crate) fn running(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    moments: In<Buffer>,
    running_mean: Out<Buffer>,
    running_var: Out<Buffer>,
) -> Launch {
    let (m_lo, m_channels) = sums_range(&moments);
    if m_channels == 0 {
        return Ok(());
    }
    let (mean_lo, var_lo) = (
        running_mean.rect.lo[0] as i64,
        running_var.rect.lo[0] as i64,
    );
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_running);
    b.arg(moments.mem.f64())
        .arg(&m_lo)
        .arg(&m_channels)
        .arg(running_mean.mem.f32_mut())
        .arg(&mean_lo)
        .arg(running_var.mem.f32_mut())
        .arg(&var_lo)
        .arg(&op.momentum);
    // SAFETY: the arguments match the kernel's signature; the running statistics cover
    // the moments' channels.
    unsafe { b.launch(grid(m_channels)) }?;
    Ok(())
}

/// What `Backend::bn_grad_sums` enqueues.
#[allow(clippy::too_many_arguments)]
pub(crate) fn grad_sums(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    x: In<Buffer>,
    y: Option<In<Buffer>>,
    dy: In<Buffer>,
    moments: In<Buffer>,
    tile: &Rect,
    dgamma: Out<Buffer>,
    dbeta: Out<Buffer>,
    grad_sums: Out<Buffer>,
) -> Launch {
    let tile_box = Box4::of(tile);
    let channels = tile_box.ext[1];
    assert_eq!(
        grad_sums.mem.len(),
        3 * channels as usize,
        "grad sums must be [3, tile channels]"
    );
    if channels == 0 {
        return Ok(());
    }
    let (x_layout, dy_layout) = (Box4::of(&x.rect), Box4::of(&dy.rect));
    let y_layout = y.map_or(x_layout, |y| Box4::of(&y.rect));
    let (m_lo, m_channels) = sums_range(&moments);
    let (dgamma_lo, dbeta_lo) = (dgamma.rect.lo[0] as i64, dbeta.rect.lo[0] as i64);
    let cut = ChannelParts::of(&tile_box)?;
    let (count, parts) = (cut.per_channel, cut.parts);
    // SAFETY: the first kernel writes every partial sum before the second reads it.
    let mut partial = unsafe { s.stream.alloc::<f64>((2 * parts * channels) as usize) }?;
    let mut types = vec![x.mem.dtype(), dy.mem.dtype()];
    types.extend(y.map(|y| y.mem.dtype()));
    let dtype = same_type(&types);
    let mut b = s.stream.launch_builder(cuda.kernels.bn_grad_sums.of(dtype));
    x.mem.push(&mut b);
    b.arg(&x_layout);
    match &y {
        Some(y) => y.mem.push(&mut b),
        None => {
            b.arg(&NULL);
        }
    };
    b.arg(&y_layout);
    dy.mem.push(&mut b);
    b.arg(&dy_layout)
        .arg(&tile_box)
        .arg(moments.mem.f64())
        .arg(&m_lo)
        .arg(&m_channels)
        .arg(&op.eps)
        .arg(&parts)
        .arg(&mut partial);
    // SAFETY: the arguments match the kernel's signature; the views contain the tile,
    // and a block of each part of each channel writes its two partial sums.
    unsafe { b.launch(cut.launch()) }?;
    let c_lo = tile_box.lo[1];
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_grad_sums_finish);
    b.arg(&partial)
        .arg(&parts)
        .arg(&channels)
        .arg(&count)
        .arg(&c_lo)
        .arg(moments.mem.f64())
        .arg(&m_lo)
        .arg(&m_channels)
        .arg(&op.eps)
        .arg(dgamma.mem.f32_mut())
        .arg(&dgamma_lo)
        .arg(dbeta.mem.f32_mut())
        .arg(&dbeta_lo)
        .arg(grad_sums.mem.f64_mut());
    // SAFETY: as above; the sums are [3, channels], the gradients cover the channels.
    unsafe { b.launch(grid(channels)) }?;
    Ok(())
}

/// What `Backend::bn_input_grad` enqueues.
#[allow(clippy::too_many_arguments)]
pub(crate) fn input_grad(
    cuda: &Cuda,
    s: &Stream,
    op: &BatchNorm,
    x: In<Buffer>,
    y: Option<In<Buffer>>,
    dy: In<Buffer>,
    moments: In<Buffer>,
    gamma: In<Buffer>,
    grad_sums: In<Buffer>,
    dx: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&dx.rect);
    if tile.volume() == 0 {
        return Ok(());
    }
    // batch norm after a dense layer runs row-major (`Box4::is_rows`), else by channel parts
    let cut = match tile.is_rows() {
        true => None,
        false => Some(ChannelParts::of(&tile)?),
    };
    let (x_layout, dy_layout) = (Box4::of(&x.rect), Box4::of(&dy.rect));
    let y_layout = y.map_or(tile, |y| Box4::of(&y.rect));
    let (m_lo, m_channels) = sums_range(&moments);
    let (s_lo, s_channels) = sums_range(&grad_sums);
    let gamma_lo = gamma.rect.lo[0] as i64;
    let (c_lo, channels) = (tile.lo[1], tile.ext[1]);
    // SAFETY: bn_input_coef writes every coefficient before bn_input_grad reads it.
    let mut coef = unsafe { s.stream.alloc::<f32>(5 * channels as usize) }?;
    let mut b = s.stream.launch_builder(&cuda.kernels.bn_input_coef);
    b.arg(moments.mem.f64())
        .arg(&m_lo)
        .arg(&m_channels)
        .arg(gamma.mem.f32())
        .arg(&gamma_lo)
        .arg(grad_sums.mem.f64())
        .arg(&s_lo)
        .arg(&s_channels)
        .arg(&op.eps)
        .arg(&c_lo)
        .arg(&channels)
        .arg(&mut coef);
    // SAFETY: the arguments match the kernel's signature; the per-channel operands cover
    // the tile's channels.
    unsafe { b.launch(grid(channels)) }?;
    let mut types = vec![x.mem.dtype(), dy.mem.dtype(), dx.mem.dtype()];
    types.extend(y.map(|y| y.mem.dtype()));
    let dtype = same_type(&types);
    let kernel = match cut {
        None => &cuda.kernels.bn_input_grad_rows,
        Some(_) => &cuda.kernels.bn_input_grad,
    };
    let mut b = s.stream.launch_builder(kernel.of(dtype));
    x.mem.push(&mut b);
    b.arg(&x_layout);
    match &y {
        Some(y) => y.mem.push(&mut b),
        None => {
            b.arg(&NULL);
        }
    };
    b.arg(&y_layout);
    dy.mem.push(&mut b);
    b.arg(&dy_layout);
    dx.mem.push_mut(&mut b);
    b.arg(&tile).arg(&coef);
    let (n, packed) = (
        tile.volume(),
        (x_layout == tile && dy_layout == tile && y_layout == tile) as i32,
    );
    let config = match &cut {
        None => {
            b.arg(&n).arg(&packed);
            grid(n)
        }
        Some(cut) => {
            b.arg(&cut.parts);
            cut.launch()
        }
    };
    // SAFETY: the arguments match the kernel's signature; the views contain the tile.
    unsafe { b.launch(config) }?;
    Ok(())
}
