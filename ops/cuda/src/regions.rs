//! Region moves: `dst[region] = src[region]` and `dst[region] += src[region]` between buffers laid
//! out over different rects, in any element type (bf16 sums add in f32 and round once); and the
//! casts between f32 and bf16 ([`Cuda::cast_slices`]). The runtime's gathers, halos, scatters and
//! folds call them ([`Cuda::copy_rect`], [`Cuda::add_rect`]); so do the primitives that move parts
//! of a tensor (concat, add's gradients, convolution scratch, a batch tile loaded from the host).

use crate::backend::{Cuda, Launch};
use crate::kernels::Kernels;
use crate::launch::{Box4, grid};
use crate::memory::{Bf16, Buffer, Stream};
use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, PushKernelArg, ValidAsZeroBits};
use legion_ops::backend::DType;
use legion_ops::shape::Rect;

/// An element type the region kernels move: its [`DType`] and its copy kernel.
pub(crate) trait Element: DeviceRepr + ValidAsZeroBits + Copy + Unpin + 'static {
    const DTYPE: DType;
    fn copy_kernel(kernels: &Kernels) -> &CudaFunction;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn copy_kernel(kernels: &Kernels) -> &CudaFunction {
        &kernels.copy_region_f32
    }
}

impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;
    fn copy_kernel(kernels: &Kernels) -> &CudaFunction {
        &kernels.copy_region_bf16
    }
}

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
                Buffer::Bf16(d) => zero_typed(s, &k.zero_region_bf16, d, layout, region),
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
            (Buffer::Bf16(src), Buffer::Bf16(dst)) => {
                let (by_point, add_runs) = match add {
                    true => (&k.add_region_bf16, Some(&k.add_runs_bf16)),
                    false => (&k.copy_region_bf16, None),
                };
                move_typed(
                    s, by_point, add_runs, src, src_layout, dst, dst_layout, region,
                )
            }
            (src, dst) => panic!(
                "region move from {:?} to {:?}: a move keeps the element type (cast converts)",
                src.dtype(),
                dst.dtype()
            ),
        }
    }

    /// `dst[region] = src[region]` between slices of one element type.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_slice<T: Element>(
        &self,
        s: &Stream,
        src: &CudaSlice<T>,
        src_layout: Box4,
        dst: &mut CudaSlice<T>,
        dst_layout: Box4,
        region: Box4,
    ) -> Launch {
        let by_point = T::copy_kernel(&self.kernels);
        move_typed(s, by_point, None, src, src_layout, dst, dst_layout, region)
    }

    /// `dst = src` converted to `dst`'s element type, element for element (f32 to bf16 rounds to
    /// nearest even; bf16 to f32 is exact; one type to itself is a copy).
    pub(crate) fn cast_slices(&self, s: &Stream, src: &Buffer, dst: &mut Buffer) -> Launch {
        let n = src.len() as i64;
        assert_eq!(
            src.len(),
            dst.len(),
            "cast between buffers of different lengths"
        );
        if n == 0 {
            return Ok(());
        }
        let kernel = match (src, &mut *dst) {
            (Buffer::F32(a), Buffer::F32(b)) => return Ok(s.stream.memcpy_dtod(a, b)?),
            (Buffer::Bf16(a), Buffer::Bf16(b)) => return Ok(s.stream.memcpy_dtod(a, b)?),
            (Buffer::F32(_), Buffer::Bf16(_)) => &self.kernels.cast_f32_bf16,
            (Buffer::Bf16(_), Buffer::F32(_)) => &self.kernels.cast_bf16_f32,
            (src, dst) => panic!("no cast from {:?} to {:?}", src.dtype(), dst.dtype()),
        };
        let mut b = s.stream.launch_builder(kernel);
        src.push(&mut b);
        dst.push_mut(&mut b);
        b.arg(&n);
        // SAFETY: the arguments match the kernel's signature; both buffers hold n elements.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
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
