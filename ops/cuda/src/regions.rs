//! Region moves: `dst[region] = src[region]` and `dst[region] += src[region]` between buffers laid
//! out over different rects, in either element type. The runtime's gathers, halos, scatters and
//! folds call them ([`Cuda::copy_rect`], [`Cuda::add_rect`]); so do the primitives that move parts
//! of a tensor (concat, add's gradients, convolution scratch, a batch tile loaded from the host).

use crate::backend::{Cuda, Launch};
use crate::launch::{Box4, grid};
use crate::memory::{Buffer, Stream};
use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, PushKernelArg, ValidAsZeroBits};
use legion_ops::shape::Rect;

impl Cuda {
    /// Enqueues `dst[region] = src[region]` between buffers laid out over different rects (the
    /// runtime's gathers, halos and scatters). `region` must lie inside both rects.
    pub fn copy_rect(
        &self,
        s: &mut Stream,
        src: &Buffer,
        src_layout: &Rect,
        dst: &mut Buffer,
        dst_layout: &Rect,
        region: &Rect,
    ) {
        self.enqueue(s, "copy_rect", |s| {
            self.move_region(
                s,
                false,
                src,
                Box4::of(src_layout),
                dst,
                Box4::of(dst_layout),
                Box4::of(region),
            )
        });
    }

    /// Enqueues `dst[region] += src[region]` (the runtime's folds of partial gradients).
    pub fn add_rect(
        &self,
        s: &mut Stream,
        src: &Buffer,
        src_layout: &Rect,
        dst: &mut Buffer,
        dst_layout: &Rect,
        region: &Rect,
    ) {
        self.enqueue(s, "add_rect", |s| {
            self.move_region(
                s,
                true,
                src,
                Box4::of(src_layout),
                dst,
                Box4::of(dst_layout),
                Box4::of(region),
            )
        });
    }

    /// Enqueues `dst[region] = 0` (`region` inside `dst_layout`): the runtime's folds with no
    /// terms over part of an instance.
    pub fn zero_rect(&self, s: &mut Stream, dst: &mut Buffer, dst_layout: &Rect, region: &Rect) {
        self.enqueue(s, "zero_rect", |s| {
            let (layout, region) = (Box4::of(dst_layout), Box4::of(region));
            let n = region.volume();
            if n == 0 {
                return Ok(());
            }
            let k = &self.kernels;
            match dst {
                Buffer::F32(d) => zero_typed(s, &k.zero_region_f32, d, layout, region),
                Buffer::F64(d) => zero_typed(s, &k.zero_region_f64, d, layout, region),
            }
        });
    }

    /// `dst[region] (+)= src[region]`, either element type.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn move_region(
        &self,
        s: &Stream,
        add: bool,
        src: &Buffer,
        src_layout: Box4,
        dst: &mut Buffer,
        dst_layout: Box4,
        region: Box4,
    ) -> Launch {
        let k = &self.kernels;
        match (src, dst) {
            (Buffer::F32(src), Buffer::F32(dst)) => {
                let (by_point, add_runs) = match add {
                    true => (&k.add_region_f32, Some(&k.add_runs_f32)),
                    false => (&k.copy_region_f32, None),
                };
                move_typed(
                    s, by_point, add_runs, src, src_layout, dst, dst_layout, region,
                )
            }
            (Buffer::F64(src), Buffer::F64(dst)) => {
                let (by_point, add_runs) = match add {
                    true => (&k.add_region_f64, Some(&k.add_runs_f64)),
                    false => (&k.copy_region_f64, None),
                };
                move_typed(
                    s, by_point, add_runs, src, src_layout, dst, dst_layout, region,
                )
            }
            _ => panic!("copy between buffers of different element types"),
        }
    }

    /// `dst[region] = src[region]` between f32 slices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_f32(
        &self,
        s: &Stream,
        src: &CudaSlice<f32>,
        src_layout: Box4,
        dst: &mut CudaSlice<f32>,
        dst_layout: Box4,
        region: Box4,
    ) -> Launch {
        let by_point = &self.kernels.copy_region_f32;
        move_typed(s, by_point, None, src, src_layout, dst, dst_layout, region)
    }
}

/// `dst[region] = src[region]` with the copy kernel `by_point`, or `+=` with the sum kernels
/// `by_point` and `add_runs`. Where the region is one run of consecutive elements in both
/// layouts (whole tensors, blocks of whole samples), a device-to-device copy or the flat `add_runs`
/// kernel moves it; only a region cut across inner axes pays the kernel that finds each element's
/// place in both layouts (four 64-bit divisions an element: on an H200 a 51 M-element copy took
/// 1 ms that way, several times the memory system's time).
#[allow(clippy::too_many_arguments)]
fn move_typed<T: DeviceRepr>(
    s: &Stream,
    by_point: &CudaFunction,
    add_runs: Option<&CudaFunction>,
    src: &CudaSlice<T>,
    src_layout: Box4,
    dst: &mut CudaSlice<T>,
    dst_layout: Box4,
    region: Box4,
) -> Launch {
    let n = region.volume();
    if n == 0 {
        return Ok(());
    }
    debug_assert!(src.len() as i64 >= src_layout.volume());
    debug_assert!(dst.len() as i64 >= dst_layout.volume());
    if let (Some(from), Some(to)) = (region.run_in(&src_layout), region.run_in(&dst_layout)) {
        let (from, to, len) = (from as usize, to as usize, n as usize);
        let src = src.slice(from..from + len);
        let mut dst = dst.slice_mut(to..to + len);
        let Some(add_runs) = add_runs else {
            s.stream.memcpy_dtod(&src, &mut dst)?;
            return Ok(());
        };
        let mut b = s.stream.launch_builder(add_runs);
        b.arg(&src).arg(&mut dst).arg(&n);
        // SAFETY: the arguments match the kernel's signature; both views hold n elements.
        unsafe { b.launch(grid(n)) }?;
        return Ok(());
    }
    let mut b = s.stream.launch_builder(by_point);
    b.arg(src)
        .arg(&src_layout)
        .arg(dst)
        .arg(&dst_layout)
        .arg(&region)
        .arg(&n);
    // SAFETY: the arguments match the kernel's signature; region lies in both layouts.
    unsafe { b.launch(grid(n)) }?;
    Ok(())
}

/// `dst[region] = 0`: a memset where the region is one run of the layout.
fn zero_typed<T: DeviceRepr + ValidAsZeroBits>(
    s: &Stream,
    by_point: &CudaFunction,
    dst: &mut CudaSlice<T>,
    layout: Box4,
    region: Box4,
) -> Launch {
    let n = region.volume();
    if let Some(at) = region.run_in(&layout) {
        let (at, len) = (at as usize, n as usize);
        s.stream.memset_zeros(&mut dst.slice_mut(at..at + len))?;
        return Ok(());
    }
    let mut b = s.stream.launch_builder(by_point);
    b.arg(dst).arg(&layout).arg(&region).arg(&n);
    // SAFETY: the arguments match the kernel's signature; region lies in the layout.
    unsafe { b.launch(grid(n)) }?;
    Ok(())
}
