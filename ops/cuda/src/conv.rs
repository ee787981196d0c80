//! Convolutions through cuDNN (forward, backward data, backward filter), over one output tile.
//!
//! cuDNN convolves whole tensors with symmetric zero padding; a tile is a box of the output whose
//! input view may be a halo'd window, cut at the tensor's edges, and whose channels may cut through
//! a group. So a tile runs as one or more **segments** of output channels, each a run of whole
//! groups or a part of one group, which cuDNN convolves with its group count; and each segment's
//! input is either the view itself (when cuDNN's own padding reproduces the window: the whole
//! spatial extent, or a window that needs no padding) or the window gathered into a zeroed scratch
//! buffer and convolved with no padding. Outputs and weight gradients of a segment are contiguous
//! rows of the weights and, for a single segment, the whole output tile; otherwise they go through
//! scratch and a region copy.
//!
//! Math is cuDNN's FMA math (`CUDNN_FMA_MATH`): FP32 FMA kernels only, never TF32. Results differ
//! from the CPU's im2col GEMM by the order of the sums.

use crate::backend::{Box4, Buffer, Cuda, Failure, Launch, Stream};
use cudarc::cudnn::sys::{cudnnConvolutionMode_t, cudnnMathType_t, cudnnTensorFormat_t};
use cudarc::cudnn::{
    ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, FilterDescriptor,
    TensorDescriptor,
};
use cudarc::driver::{CudaSlice, CudaView};
use legion_ops::backend::{In, Out};
use legion_ops::op::{Activation, Conv2d};
use legion_ops::shape::Shape;
use std::ffi::c_int;

/// Where a tile sits and how its windows map onto the input.
struct Geometry {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    in_size: [i64; 2],
    out_size: [i64; 2],
    in_per_group: i64,
    out_per_group: i64,
    /// The output tile.
    tile: Box4,
}

/// Output channels `[out_lo, out_lo + out_count)` that cuDNN convolves in one call: `groups`
/// whole groups, or part of one group (`groups == 1`). They read input channels
/// `[in_lo, in_lo + groups·in_per_group)`.
#[derive(Clone, Copy, Debug)]
struct Segment {
    out_lo: i64,
    out_count: i64,
    groups: i64,
    in_lo: i64,
}

impl Geometry {
    fn new(op: &Conv2d, in_shape: Shape, tile: Box4) -> Geometry {
        let in_size = [in_shape.dim(2) as i64, in_shape.dim(3) as i64];
        let kernel = op.kernel.map(|k| k as i64);
        let stride = op.stride.map(|s| s as i64);
        let padding = op.padding.map(|p| p as i64);
        let out_size = [0, 1].map(|a| (in_size[a] + 2 * padding[a] - kernel[a]) / stride[a] + 1);
        let groups = op.groups as i64;
        Geometry {
            kernel,
            stride,
            padding,
            in_size,
            out_size,
            in_per_group: in_shape.dim(1) as i64 / groups,
            out_per_group: op.out_channels as i64 / groups,
            tile,
        }
    }

    fn segments(&self) -> Vec<Segment> {
        let (lo, hi) = (self.tile.lo[1], self.tile.hi(1));
        let per = self.out_per_group;
        let mut segments = Vec::new();
        let mut c = lo;
        while c < hi {
            let group = c / per;
            let group_end = (group + 1) * per;
            let segment = if c % per != 0 || hi < group_end {
                Segment {
                    out_lo: c,
                    out_count: group_end.min(hi) - c,
                    groups: 1,
                    in_lo: group * self.in_per_group,
                }
            } else {
                let groups = (hi - c) / per;
                Segment {
                    out_lo: c,
                    out_count: groups * per,
                    groups,
                    in_lo: group * self.in_per_group,
                }
            };
            c += segment.out_count;
            segments.push(segment);
        }
        segments
    }

    /// The input box a segment's windows span, padding included (it may reach below 0 and past
    /// the input).
    fn window(&self, segment: &Segment) -> Box4 {
        let mut window = self.tile;
        window.lo[1] = segment.in_lo;
        window.ext[1] = segment.groups * self.in_per_group;
        for a in 0..2 {
            let axis = a + 2;
            window.lo[axis] = self.tile.lo[axis] * self.stride[a] - self.padding[a];
            window.ext[axis] = (self.tile.ext[axis] - 1) * self.stride[a] + self.kernel[a];
        }
        window
    }

    /// The segment's output box.
    fn output(&self, segment: &Segment) -> Box4 {
        self.tile.with_axis(1, segment.out_lo, segment.out_count)
    }

    /// How cuDNN reads a segment's input from a view laid out over `x`.
    fn source(&self, segment: &Segment, x: &Box4) -> Source {
        let window = self.window(segment);
        let same_samples_and_channels = x.lo[0] == window.lo[0]
            && x.ext[0] == window.ext[0]
            && x.lo[1] == window.lo[1]
            && x.ext[1] == window.ext[1];
        let pad = |a: usize| -> Option<i64> {
            let axis = a + 2;
            let whole_input = x.lo[axis] == 0 && x.ext[axis] == self.in_size[a];
            let whole_output = self.tile.lo[axis] == 0 && self.tile.ext[axis] == self.out_size[a];
            let window_inside = window.lo[axis] >= 0 && window.hi(axis) <= self.in_size[a];
            if whole_input && whole_output {
                Some(self.padding[a])
            } else if window_inside
                && x.lo[axis] == window.lo[axis]
                && x.ext[axis] == window.ext[axis]
            {
                Some(0)
            } else {
                None
            }
        };
        match (same_samples_and_channels, pad(0), pad(1)) {
            (true, Some(ph), Some(pw)) => Source::View { pad: [ph, pw] },
            _ => Source::Gathered { window },
        }
    }
}

/// A segment's input as cuDNN sees it.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// The view itself, with cuDNN's padding.
    View { pad: [i64; 2] },
    /// The window gathered into zeroed scratch laid out over `window`, no padding.
    Gathered { window: Box4 },
}

impl Source {
    fn dims(&self, x: &Box4) -> Box4 {
        match self {
            Source::View { .. } => *x,
            Source::Gathered { window } => *window,
        }
    }

    fn pad(&self) -> [i64; 2] {
        match self {
            Source::View { pad } => *pad,
            Source::Gathered { .. } => [0, 0],
        }
    }
}

fn dims(b: &Box4) -> [c_int; 4] {
    b.ext.map(|e| e as c_int)
}

/// The cuDNN descriptors of one segment.
struct Descriptors {
    x: TensorDescriptor<f32>,
    w: FilterDescriptor<f32>,
    y: TensorDescriptor<f32>,
    conv: ConvDescriptor<f32>,
}

fn descriptors(
    s: &Stream,
    geo: &Geometry,
    segment: &Segment,
    source: &Source,
    x: &Box4,
) -> Result<Descriptors, Failure> {
    let nchw = cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
    let cudnn = &s.cudnn;
    let x_desc = cudnn.create_4d_tensor::<f32>(nchw, dims(&source.dims(x)))?;
    let w_desc = cudnn.create_4d_filter::<f32>(
        nchw,
        [
            segment.out_count as c_int,
            geo.in_per_group as c_int,
            geo.kernel[0] as c_int,
            geo.kernel[1] as c_int,
        ],
    )?;
    let y_desc = cudnn.create_4d_tensor::<f32>(nchw, dims(&geo.output(segment)))?;
    let pad = source.pad();
    let mut conv = cudnn.create_conv2d::<f32>(
        [pad[0] as c_int, pad[1] as c_int],
        [geo.stride[0] as c_int, geo.stride[1] as c_int],
        [1, 1],
        cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    // FP32 FMA kernels only: CUDNN_DEFAULT_MATH would let cuDNN pick TF32 tensor cores.
    conv.set_math_type(cudnnMathType_t::CUDNN_FMA_MATH)?;
    conv.set_group_count(segment.groups as c_int)?;
    Ok(Descriptors {
        x: x_desc,
        w: w_desc,
        y: y_desc,
        conv,
    })
}

/// cuDNN's workspace for one call (stream-ordered, freed when dropped).
fn workspace(s: &Stream, bytes: usize) -> Result<Option<CudaSlice<u8>>, Failure> {
    if bytes == 0 {
        return Ok(None);
    }
    Ok(Some(s.stream.alloc_zeros::<u8>(bytes)?))
}

/// The segment's input: `None` when cuDNN reads the view itself, else the gathered window.
fn gather_input(
    cuda: &Cuda,
    s: &Stream,
    x: &CudaSlice<f32>,
    x_layout: Box4,
    source: &Source,
) -> Result<Option<CudaSlice<f32>>, Failure> {
    let Source::Gathered { window } = source else {
        return Ok(None);
    };
    let mut scratch = s.stream.alloc_zeros::<f32>(window.volume() as usize)?;
    let region = window.intersect(&x_layout);
    let copy = &cuda.kernels.copy_region_f32;
    cuda.region_f32(s, copy, x, x_layout, &mut scratch, *window, region)?;
    Ok(Some(scratch))
}

fn view<'a>(owned: &'a Option<CudaSlice<f32>>, otherwise: &'a CudaSlice<f32>) -> CudaView<'a, f32> {
    owned.as_ref().unwrap_or(otherwise).slice(..)
}

/// The weight rows of a segment's output channels, within a view whose rows start at `w_lo`.
fn weight_rows(geo: &Geometry, segment: &Segment, w_lo: i64) -> std::ops::Range<usize> {
    let per_row = (geo.in_per_group * geo.kernel[0] * geo.kernel[1]) as usize;
    let first = (segment.out_lo - w_lo) as usize;
    first * per_row..(first + segment.out_count as usize) * per_row
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    cuda: &Cuda,
    s: &mut Stream,
    op: &Conv2d,
    in_shape: Shape,
    x: In<Buffer>,
    w: In<Buffer>,
    b: Option<In<Buffer>>,
    y: Out<Buffer>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    if tile.volume() == 0 {
        return Ok(());
    }
    let geo = Geometry::new(op, in_shape, tile);
    let x_layout = Box4::of(&x.rect);
    let segments = geo.segments();
    let y_mem = y.mem.f32_mut();
    for segment in &segments {
        let source = geo.source(segment, &x_layout);
        let gathered = gather_input(cuda, s, x.mem.f32(), x_layout, &source)?;
        let x_view = view(&gathered, x.mem.f32());
        let w_view = w
            .mem
            .f32()
            .slice(weight_rows(&geo, segment, w.rect.lo[0] as i64));
        let d = descriptors(s, &geo, segment, &source, &x_layout)?;
        let conv = ConvForward {
            conv: &d.conv,
            x: &d.x,
            w: &d.w,
            y: &d.y,
        };
        let algo = conv.pick_algorithm()?;
        let mut ws = workspace(s, conv.get_workspace_size(algo)?)?;
        let out = geo.output(segment);
        if segments.len() == 1 {
            // SAFETY: the descriptors describe exactly these buffers.
            unsafe { conv.launch(algo, ws.as_mut(), (1.0, 0.0), &x_view, &w_view, y_mem) }?;
        } else {
            let mut scratch = s.stream.alloc_zeros::<f32>(out.volume() as usize)?;
            // SAFETY: as above, the segment's output into packed scratch.
            unsafe {
                conv.launch(
                    algo,
                    ws.as_mut(),
                    (1.0, 0.0),
                    &x_view,
                    &w_view,
                    &mut scratch,
                )
            }?;
            let copy = &cuda.kernels.copy_region_f32;
            cuda.region_f32(s, copy, &scratch, out, y_mem, tile, out)?;
        }
    }
    cuda.bias_activation(s, y_mem, tile, b, op.activation == Activation::Relu)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    cuda: &Cuda,
    s: &mut Stream,
    op: &Conv2d,
    in_shape: Shape,
    x: In<Buffer>,
    w: In<Buffer>,
    y: In<Buffer>,
    dy: In<Buffer>,
    mut dx: Option<Out<Buffer>>,
    dw: Out<Buffer>,
    db: Option<Out<Buffer>>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    let x_layout = Box4::of(&x.rect);
    let dw_mem = dw.mem.f32_mut();
    if let Some(dx) = &mut dx {
        assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        // positions no window of the tile reads keep this zero
        s.stream.memset_zeros(dx.mem.f32_mut())?;
    }
    if tile.volume() == 0 {
        s.stream.memset_zeros(dw_mem)?;
        if let Some(db) = db {
            s.stream.memset_zeros(db.mem.f32_mut())?;
        }
        return Ok(());
    }
    // dz: the output gradient through the fused activation, laid out over the tile.
    let dz_owned = if op.activation == Activation::Relu {
        Some(cuda.relu_mask(s, y, dy, &y.rect)?)
    } else if dy.rect != y.rect {
        let mut packed = s.stream.alloc_zeros::<f32>(tile.volume() as usize)?;
        let copy = &cuda.kernels.copy_region_f32;
        cuda.region_f32(
            s,
            copy,
            dy.mem.f32(),
            Box4::of(&dy.rect),
            &mut packed,
            tile,
            tile,
        )?;
        Some(packed)
    } else {
        None
    };
    let dz = dz_owned.as_ref().unwrap_or(dy.mem.f32());
    if let Some(db) = db {
        cuda.channel_sum(s, dz, tile, db)?;
    }
    let geo = Geometry::new(op, in_shape, tile);
    let segments = geo.segments();
    for segment in &segments {
        let out = geo.output(segment);
        let dz_segment = if segments.len() == 1 {
            None
        } else {
            let mut packed = s.stream.alloc_zeros::<f32>(out.volume() as usize)?;
            let copy = &cuda.kernels.copy_region_f32;
            cuda.region_f32(s, copy, dz, tile, &mut packed, out, out)?;
            Some(packed)
        };
        let dz_view = view(&dz_segment, dz);
        let source = geo.source(segment, &x_layout);
        let gathered = gather_input(cuda, s, x.mem.f32(), x_layout, &source)?;
        let x_view = view(&gathered, x.mem.f32());
        let d = descriptors(s, &geo, segment, &source, &x_layout)?;
        let rows = weight_rows(&geo, segment, dw.rect.lo[0] as i64);

        let filter = ConvBackwardFilter {
            conv: &d.conv,
            x: &d.x,
            dw: &d.w,
            dy: &d.y,
        };
        let algo = filter.pick_algorithm()?;
        let mut ws = workspace(s, filter.get_workspace_size(algo)?)?;
        let mut dw_rows = dw_mem.slice_mut(rows);
        // SAFETY: the descriptors describe exactly these buffers.
        unsafe {
            filter.launch(
                algo,
                ws.as_mut(),
                (1.0, 0.0),
                &x_view,
                &mut dw_rows,
                &dz_view,
            )
        }?;

        let Some(dx) = dx.as_mut() else { continue };
        let data = ConvBackwardData {
            conv: &d.conv,
            dx: &d.x,
            w: &d.w,
            dy: &d.y,
        };
        let algo = data.pick_algorithm()?;
        let mut ws = workspace(s, data.get_workspace_size(algo)?)?;
        let w_view = w
            .mem
            .f32()
            .slice(weight_rows(&geo, segment, w.rect.lo[0] as i64));
        let dx_mem = dx.mem.f32_mut();
        match source {
            Source::View { .. } => {
                // SAFETY: as above; dx is laid out like x.
                unsafe { data.launch(algo, ws.as_mut(), (1.0, 0.0), dx_mem, &w_view, &dz_view) }?;
            }
            Source::Gathered { window } => {
                let mut dwindow = s.stream.alloc_zeros::<f32>(window.volume() as usize)?;
                // SAFETY: as above, into scratch laid out over the window.
                unsafe {
                    data.launch(
                        algo,
                        ws.as_mut(),
                        (1.0, 0.0),
                        &mut dwindow,
                        &w_view,
                        &dz_view,
                    )
                }?;
                // The part of the window inside dx; padding positions are dropped. Segments read
                // disjoint input channels, so copying (not adding) is exact.
                let region = window.intersect(&x_layout);
                let copy = &cuda.kernels.copy_region_f32;
                cuda.region_f32(s, copy, &dwindow, window, dx_mem, x_layout, region)?;
            }
        }
    }
    Ok(())
}
