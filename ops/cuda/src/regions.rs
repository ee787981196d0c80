//! Region moves: `dst[region] = src[region]` and `dst[region] += src[region]` between buffers laid
//! out over different rects, in either element type. The runtime's gathers, halos, scatters and
//! folds call them ([`Cuda::copy_rect`], [`Cuda::add_rect`]); so do the primitives that move parts
//! of a tensor (concat, add's gradients, convolution scratch, a batch tile loaded from the host).

use crate::backend::{Cuda, Launch};
use crate::launch::{Box4, grid};
use crate::memory::{Buffer, Stream};
use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
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
        let n = region.volume();
        if n == 0 {
            return Ok(());
        }
        let k = &self.kernels;
        match (src, dst) {
            (Buffer::F32(src), Buffer::F32(dst)) => {
                let f = if add {
                    &k.add_region_f32
                } else {
                    &k.copy_region_f32
                };
                self.region_f32(s, f, src, src_layout, dst, dst_layout, region)
            }
            (Buffer::F64(src), Buffer::F64(dst)) => {
                let f = if add {
                    &k.add_region_f64
                } else {
                    &k.copy_region_f64
                };
                let mut b = s.stream.launch_builder(f);
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
            _ => panic!("copy between buffers of different element types"),
        }
    }

    /// `dst[region] = src[region]` (or `+=` with the add kernel) between f32 slices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn region_f32(
        &self,
        s: &Stream,
        f: &CudaFunction,
        src: &CudaSlice<f32>,
        src_layout: Box4,
        dst: &mut CudaSlice<f32>,
        dst_layout: Box4,
        region: Box4,
    ) -> Launch {
        let n = region.volume();
        if n == 0 {
            return Ok(());
        }
        debug_assert!(src.len() as i64 >= src_layout.volume());
        debug_assert!(dst.len() as i64 >= dst_layout.volume());
        let mut b = s.stream.launch_builder(f);
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
}
