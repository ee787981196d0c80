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
//! Math is cuDNN's FMA math (`CUDNN_FMA_MATH`) by default: FP32 FMA kernels only, never TF32.
//! Results differ from the CPU's im2col GEMM by the order of the sums. With [`Math::Tf32`]
//! (`--tf32`) it is tensor-op math, which computes FP32 convolutions in TF32. With [`Math::Bf16`]
//! the activations and the weights' working copies are bf16 (`CUDNN_DATA_BFLOAT16` tensors and
//! filters) convolved on the tensor cores with fp32 accumulation (a `CUDNN_DATA_FLOAT`
//! convolution descriptor, tensor-op math); cuDNN writes the weight gradient in the filter's type,
//! so it goes through bf16 scratch and is cast up into the fp32 gradient the update reads.
//! Tensors stay NCHW in every precision (cuDNN's bf16 kernels prefer NHWC: a measured follow-up).

use crate::algos::{
    ConvEpilogue, DATA_CANDIDATES, FILTER_CANDIDATES, FORWARD_CANDIDATES, Problem, WORKSPACE_CAP,
    launch_chosen,
};
use crate::backend::{Cuda, Failure, Launch, Math};
use crate::launch::Box4;
use crate::memory::{Bf16, Buffer, Stream, same_type};
use crate::regions::Element;
use cudarc::cudnn::sys::{
    self, cudnnActivationMode_t, cudnnConvolutionMode_t, cudnnMathType_t, cudnnNanPropagation_t,
    cudnnTensorFormat_t,
};
use cudarc::cudnn::{
    ActivationDescriptor, ConvBackwardData, ConvBackwardFilter, ConvBiasActivationForward,
    ConvDescriptor, ConvForward, CudnnDataType, CudnnError, FilterDescriptor, TensorDescriptor,
};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use legion_ops::backend::{DType, In, Out};
use legion_ops::op::{Activation, Conv2d};
use legion_ops::shape::Rect;
use legion_ops::shape::Shape;
use std::collections::HashMap;
use std::ffi::c_int;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// The cuDNN descriptors of one segment, made once per problem on a stream and kept (making and
/// destroying five descriptors a call cost host time the GPU waited for on ResNet-50's and
/// Inception-v3's many small convolutions). `T` is the data's type (f32, or bf16); the
/// convolution itself accumulates in f32 for both.
pub(crate) struct Descriptors<T> {
    x: TensorDescriptor<T>,
    w: FilterDescriptor<T>,
    y: TensorDescriptor<T>,
    conv: ConvDescriptor<f32>,
    /// The bias (`[1, K, 1, 1]`) and the ReLU of a fused problem.
    epilogue: Option<(TensorDescriptor<T>, ActivationDescriptor<f32>)>,
    /// The problem they describe: the key of the stream's chosen algorithms.
    problem: Problem,
}

/// The descriptors kept on a stream, per data type.
#[derive(Default)]
pub(crate) struct KeptDescriptors {
    f32: HashMap<Problem, Rc<Descriptors<f32>>>,
    bf16: HashMap<Problem, Rc<Descriptors<Bf16>>>,
}

/// An element type cuDNN convolves: its descriptors' map, the operands of that type, and the
/// math type its convolutions use.
pub(crate) trait ConvElement: Element + CudnnDataType {
    /// α = 1 and β = 0 of a launch (cuDNN reads them as f32 for both types).
    const ONE: Self;
    const ZERO: Self;
    fn kept(kept: &mut KeptDescriptors) -> &mut HashMap<Problem, Rc<Descriptors<Self>>>;
    fn of(buffer: &Buffer) -> &CudaSlice<Self>;
    fn of_mut(buffer: &mut Buffer) -> &mut CudaSlice<Self>;
    fn wrap(slice: CudaSlice<Self>) -> Buffer;
    fn math_type(math: Math) -> cudnnMathType_t;
}

impl ConvElement for f32 {
    const ONE: f32 = 1.0;
    const ZERO: f32 = 0.0;
    fn kept(kept: &mut KeptDescriptors) -> &mut HashMap<Problem, Rc<Descriptors<f32>>> {
        &mut kept.f32
    }
    fn of(buffer: &Buffer) -> &CudaSlice<f32> {
        buffer.f32()
    }
    fn of_mut(buffer: &mut Buffer) -> &mut CudaSlice<f32> {
        buffer.f32_mut()
    }
    fn wrap(slice: CudaSlice<f32>) -> Buffer {
        Buffer::F32(slice)
    }
    /// Strict FP32: FMA kernels only (CUDNN_DEFAULT_MATH would let cuDNN pick TF32 tensor
    /// cores). TF32 when asked for: tensor-op math, which cuDNN uses for FP32 data as TF32. (A
    /// bf16 stream convolves f32 data only if given it, in strict FP32.)
    fn math_type(math: Math) -> cudnnMathType_t {
        match math {
            Math::StrictFp32 | Math::Bf16 => cudnnMathType_t::CUDNN_FMA_MATH,
            Math::Tf32 => cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        }
    }
}

impl ConvElement for Bf16 {
    const ONE: Bf16 = Bf16(0x3f80);
    const ZERO: Bf16 = Bf16(0);
    fn kept(kept: &mut KeptDescriptors) -> &mut HashMap<Problem, Rc<Descriptors<Bf16>>> {
        &mut kept.bf16
    }
    fn of(buffer: &Buffer) -> &CudaSlice<Bf16> {
        buffer.bf16()
    }
    fn of_mut(buffer: &mut Buffer) -> &mut CudaSlice<Bf16> {
        buffer.bf16_mut()
    }
    fn wrap(slice: CudaSlice<Bf16>) -> Buffer {
        Buffer::Bf16(slice)
    }
    /// bf16 data on the tensor cores, whatever the stream's math.
    fn math_type(_: Math) -> cudnnMathType_t {
        cudnnMathType_t::CUDNN_TENSOR_OP_MATH
    }
}

fn descriptors<T: ConvElement>(
    s: &mut Stream,
    geo: &Geometry,
    segment: &Segment,
    source: &Source,
    x: &Box4,
    fused: bool,
) -> Result<Rc<Descriptors<T>>, Failure> {
    let nchw = cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
    let problem = Problem {
        x: dims(&source.dims(x)),
        w: [
            segment.out_count as c_int,
            geo.in_per_group as c_int,
            geo.kernel[0] as c_int,
            geo.kernel[1] as c_int,
        ],
        y: dims(&geo.output(segment)),
        pad: source.pad(),
        stride: geo.stride,
        groups: segment.groups,
        dtype: T::DTYPE,
        fused,
    };
    if let Some(kept) = T::kept(&mut s.descriptors).get(&problem) {
        return Ok(Rc::clone(kept));
    }
    let cudnn = &s.cudnn;
    let x_desc = cudnn.create_4d_tensor::<T>(nchw, problem.x)?;
    let w_desc = cudnn.create_4d_filter::<T>(nchw, problem.w)?;
    let y_desc = cudnn.create_4d_tensor::<T>(nchw, problem.y)?;
    let pad = problem.pad;
    let mut conv = cudnn.create_conv2d::<f32>(
        [pad[0] as c_int, pad[1] as c_int],
        [geo.stride[0] as c_int, geo.stride[1] as c_int],
        [1, 1],
        cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    conv.set_math_type(T::math_type(s.math))?;
    conv.set_group_count(segment.groups as c_int)?;
    let epilogue = match fused {
        false => None,
        true => Some((
            cudnn.create_4d_tensor::<T>(nchw, [1, problem.y[1], 1, 1])?,
            // The fused call takes a ReLU that does not propagate NaN (see ConvEpilogue).
            cudnn.create_activation::<f32>(
                cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                f64::MAX,
            )?,
        )),
    };
    let made = Rc::new(Descriptors {
        x: x_desc,
        w: w_desc,
        y: y_desc,
        conv,
        epilogue,
        problem,
    });
    T::kept(&mut s.descriptors).insert(problem, Rc::clone(&made));
    Ok(made)
}

/// cuDNN's heuristic (cudarc's `pick_algorithm`, its first answer) may pick a backward algorithm
/// that sums with atomics, whose order varies from run to run. Those are replaced by algorithm 1,
/// deterministic and valid for every convolution, so that with the heuristic
/// (`--conv-algos heuristic`) two runs of a strategy, or a run and its `--resume`, give the
/// same bits. Forward algorithms are all deterministic. (Timed choices: [`crate::algos`].)
fn deterministic_filter_algo(
    picked: sys::cudnnConvolutionBwdFilterAlgo_t,
) -> sys::cudnnConvolutionBwdFilterAlgo_t {
    use sys::cudnnConvolutionBwdFilterAlgo_t::{
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
    };
    match picked {
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 | CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3 => {
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1
        }
        other => other,
    }
}

/// As [`deterministic_filter_algo`], for the data gradient (algorithm 0 uses atomics).
fn deterministic_data_algo(
    picked: sys::cudnnConvolutionBwdDataAlgo_t,
) -> sys::cudnnConvolutionBwdDataAlgo_t {
    use sys::cudnnConvolutionBwdDataAlgo_t::{
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
    };
    match picked {
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        other => other,
    }
}

/// cuDNN's scratch for one call (cuDNN writes before it reads, so it is not zeroed). While
/// `timing` candidates, a fresh one, refused past [`WORKSPACE_CAP`] (the algorithm then is not a
/// candidate); for the chosen algorithm, the stream's kept workspace, grown to the largest asked
/// for (calls on one stream run in order, so they can share it).
fn workspace(s: &Stream, bytes: usize, timing: bool) -> Result<Workspace<'_>, Failure> {
    // SAFETY (both allocations): u8 has no invalid bit patterns, and cuDNN only reads what it
    // wrote.
    if s.fixed.recording {
        // Timing runs and waits for candidates; a kept workspace grown now would be freed with
        // the recording. The step run as enqueued before a recording does both.
        if timing {
            return Err(Failure(
                "a convolution met for the first time while recording: its algorithms are timed \
                 as enqueued"
                    .into(),
            ));
        }
        if bytes > s.workspace.borrow().as_ref().map_or(0, |w| w.len()) {
            return Err(Failure(format!(
                "cuDNN asked for a larger workspace ({bytes} bytes) while recording"
            )));
        }
    }
    if timing {
        if bytes > WORKSPACE_CAP {
            return Err(Failure(format!("{bytes} bytes of workspace")));
        }
        let fresh = (bytes > 0).then(|| unsafe { s.stream.alloc::<u8>(bytes) });
        return Ok(Workspace::Fresh(fresh.transpose()?));
    }
    let mut kept = s.workspace.borrow_mut();
    if bytes > kept.as_ref().map_or(0, |w| w.len()) {
        *kept = None;
        *kept = Some(unsafe { s.stream.alloc::<u8>(bytes) }?);
    }
    Ok(Workspace::Kept(kept))
}

/// A call's workspace: the stream's kept one, or a fresh one while timing.
enum Workspace<'s> {
    Kept(std::cell::RefMut<'s, Option<CudaSlice<u8>>>),
    Fresh(Option<CudaSlice<u8>>),
}

impl Workspace<'_> {
    fn as_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        match self {
            Workspace::Kept(kept) => kept.as_mut(),
            Workspace::Fresh(fresh) => fresh.as_mut(),
        }
    }
}

/// The segment's input: `None` when cuDNN reads the view itself, else the gathered window.
fn gather_input<T: Element>(
    cuda: &Cuda,
    s: &Stream,
    x: &CudaSlice<T>,
    x_layout: Box4,
    source: &Source,
) -> Result<Option<CudaSlice<T>>, Failure> {
    let Source::Gathered { window } = source else {
        return Ok(None);
    };
    let mut scratch = s.stream.alloc_zeros::<T>(window.volume() as usize)?;
    let region = window.intersect(&x_layout);
    cuda.copy_slice(s, x, x_layout, &mut scratch, *window, region)?;
    Ok(Some(scratch))
}

fn view<'a, T>(owned: &'a Option<CudaSlice<T>>, otherwise: &'a CudaSlice<T>) -> CudaView<'a, T> {
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
    match same_type(&[x.mem.dtype(), w.mem.dtype(), y.mem.dtype()]) {
        DType::F32 => forward_typed::<f32>(cuda, s, op, in_shape, x, w, b, y),
        DType::Bf16 => forward_typed::<Bf16>(cuda, s, op, in_shape, x, w, b, y),
        DType::F64 => panic!("cuDNN convolutions here are f32 or bf16"),
    }
}

#[allow(clippy::too_many_arguments)]
fn forward_typed<T: ConvElement>(
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
    let (x_mem, w_mem) = (T::of(x.mem), T::of(w.mem));
    let relu = op.activation == Activation::Relu;
    // The bias and ReLU inside cuDNN's convolution where they can be (see ConvEpilogue).
    let fusable = s.epilogue == ConvEpilogue::Fused
        && T::DTYPE == DType::F32
        && segments.len() == 1
        && relu
        && b.is_some();
    let mut activated = false;
    for segment in &segments {
        let source = geo.source(segment, &x_layout);
        let gathered = gather_input(cuda, s, x_mem, x_layout, &source)?;
        let x_view = view(&gathered, x_mem);
        let w_view = w_mem.slice(weight_rows(&geo, segment, w.rect.lo[0] as i64));
        if fusable {
            let d = descriptors::<T>(s, &geo, segment, &source, &x_layout, true)?;
            if !s.unfusable.contains(&d.problem) {
                let b = b.expect("a fusable convolution has a bias");
                let first = (tile.lo[1] - b.rect.lo[0] as i64) as usize;
                let bias = T::of(b.mem).slice(first..first + tile.ext[1] as usize);
                match forward_fused(s, &d, &x_view, &w_view, &bias, T::of_mut(y.mem)) {
                    Ok(()) => {
                        FUSED_LAUNCHES.fetch_add(1, Ordering::Relaxed);
                        activated = true;
                        continue;
                    }
                    // cuDNN refused the problem: it runs as the separate kernel from now on.
                    Err(Fused::Refused(why)) => {
                        tracing::warn!(
                            "convolution {:?}: cuDNN refused the fused bias and ReLU ({why}); \
                             they run as a kernel of their own for this problem",
                            d.problem
                        );
                        FUSIONS_REFUSED.fetch_add(1, Ordering::Relaxed);
                        s.unfusable.insert(d.problem);
                    }
                    Err(Fused::Failed(failure)) => return Err(failure),
                }
            }
        }
        let d = descriptors::<T>(s, &geo, segment, &source, &x_layout, false)?;
        let conv = ConvForward {
            conv: &d.conv,
            x: &d.x,
            w: &d.w,
            y: &d.y,
        };
        let out = geo.output(segment);
        // One segment writes the output tile itself; several go through packed scratch.
        let mut scratch = match segments.len() {
            1 => None,
            _ => Some(s.stream.alloc_zeros::<T>(out.volume() as usize)?),
        };
        let y_mem = T::of_mut(y.mem);
        let target = scratch.as_mut().unwrap_or(&mut *y_mem);
        launch_chosen(
            s,
            |c| &mut c.forward,
            d.problem,
            &FORWARD_CANDIDATES,
            || Ok(conv.pick_algorithm()?),
            |s, algo, timing| {
                let mut ws = workspace(s, conv.get_workspace_size(algo)?, timing)?;
                // SAFETY: the descriptors describe exactly these buffers.
                unsafe {
                    conv.launch(
                        algo,
                        ws.as_mut(),
                        (T::ONE, T::ZERO),
                        &x_view,
                        &w_view,
                        target,
                    )
                }?;
                Ok(())
            },
        )?;
        if let Some(scratch) = &scratch {
            cuda.copy_slice(s, scratch, out, y_mem, tile, out)?;
        }
    }
    match activated {
        true => Ok(()),
        false => cuda.bias_activation(s, y.mem, tile, b, relu),
    }
}

/// Fused convolutions launched, and fused problems cuDNN refused, in this process
/// ([`fused_epilogue_counts`]).
static FUSED_LAUNCHES: AtomicUsize = AtomicUsize::new(0);
static FUSIONS_REFUSED: AtomicUsize = AtomicUsize::new(0);

/// How many convolutions ran with cuDNN's fused bias and ReLU in this process, and how many
/// distinct problems cuDNN refused them for (each then runs the separate kernel, with a warning):
/// what the GPU tests and the check read to tell that fusion ran rather than fell back.
pub fn fused_epilogue_counts() -> (usize, usize) {
    (
        FUSED_LAUNCHES.load(Ordering::Relaxed),
        FUSIONS_REFUSED.load(Ordering::Relaxed),
    )
}

/// Why a fused convolution did not run: cuDNN refused the problem (a status saying it does not
/// support it, on the launch of the algorithm chosen for it), or anything else, which fails the
/// call as an unfused convolution's failure would (out of memory, a recording that cannot time
/// algorithms or grow the workspace, an execution error).
enum Fused {
    Refused(String),
    Failed(Failure),
}

/// `y = ReLU(conv(x, w) + bias)` in one cuDNN call, with the algorithm chosen for the fused
/// problem (timed with its epilogue).
fn forward_fused<T: ConvElement>(
    s: &mut Stream,
    d: &Descriptors<T>,
    x: &CudaView<T>,
    w: &CudaView<T>,
    bias: &CudaView<T>,
    y: &mut CudaSlice<T>,
) -> Result<(), Fused> {
    let (bias_desc, relu) = d.epilogue.as_ref().expect("a fused problem's descriptors");
    let fused = ConvBiasActivationForward {
        conv: &d.conv,
        act: relu,
        x: &d.x,
        w: &d.w,
        z: &d.y,
        bias: bias_desc,
        y: &d.y,
    };
    // Whether cuDNN refused the launch of the chosen algorithm (a refused candidate while timing
    // only drops out of the timing).
    let mut refused = false;
    let result = launch_chosen(
        s,
        |c| &mut c.forward,
        d.problem,
        &FORWARD_CANDIDATES,
        || Ok(fused.pick_algorithm()?),
        |s, algo, timing| {
            let mut ws = workspace(s, fused.get_workspace_size(algo)?, timing)?;
            let stream = &s.stream;
            // Each operand's pointer taken as cudarc lends it (the stream waits for its last
            // write; its use is recorded when the record drops, after the launch).
            let (x_ptr, _x_use) = x.device_ptr(stream);
            let (bias_ptr, _bias_use) = bias.device_ptr(stream);
            let y_len = y.len();
            let (y_ptr, _y_use) = y.device_ptr_mut(stream);
            // cuDNN sizes operands by the descriptors; the lengths only satisfy the trait.
            let raw = |ptr, len| Lent::<T> {
                ptr,
                len,
                stream,
                element: PhantomData,
            };
            // z is y itself (cuDNN allows it; with α₂ = 0 it adds nothing), which Rust cannot
            // lend twice: the operands go to cuDNN as the pointers taken above.
            let mut y_lent = raw(y_ptr, y_len);
            // SAFETY: the descriptors describe exactly these buffers, which stay alive (and
            // their uses unrecorded) until the launch is enqueued.
            let launched = unsafe {
                fused.launch(
                    algo,
                    ws.as_mut(),
                    (T::ONE, T::ZERO),
                    &raw(x_ptr, x.len()),
                    w,
                    &raw(y_ptr, y_len),
                    &raw(bias_ptr, bias.len()),
                    &mut y_lent,
                )
            };
            refused = !timing
                && matches!(
                    launched,
                    Err(CudnnError(
                        sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED
                            | sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM
                    ))
                );
            launched?;
            Ok(())
        },
    );
    match result {
        Ok(()) => Ok(()),
        Err(failure) if refused => Err(Fused::Refused(failure.0)),
        Err(failure) => Err(Fused::Failed(failure)),
    }
}

/// A device pointer already taken from its buffer (with cudarc's ordering done), lent to a call
/// as an operand.
struct Lent<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    element: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Lent<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Lent<'_, T> {
    fn device_ptr<'a>(&'a self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Lent<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
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
    dx: Option<Out<Buffer>>,
    dw: Out<Buffer>,
    db: Option<Out<Buffer>>,
) -> Launch {
    let mut types = vec![x.mem.dtype(), w.mem.dtype(), y.mem.dtype(), dy.mem.dtype()];
    types.extend(dx.as_ref().map(|dx| dx.mem.dtype()));
    match same_type(&types) {
        DType::F32 => {
            let dw_mem = dw.mem.f32_mut();
            backward_typed::<f32>(cuda, s, op, in_shape, x, w, y, dy, dx, dw_mem, dw.rect, db)
        }
        DType::Bf16 => {
            // cuDNN writes the filter gradient in the filter's type: bf16 scratch, cast up into
            // the fp32 gradient the update reads.
            // SAFETY: `backward_typed` writes all of it, as it writes an f32 gradient (the
            // segments' rows cover it, or it is zeroed for an empty tile), before the cast reads it.
            let mut dw16 = unsafe { s.stream.alloc::<Bf16>(dw.mem.len()) }?;
            backward_typed::<Bf16>(
                cuda, s, op, in_shape, x, w, y, dy, dx, &mut dw16, dw.rect, db,
            )?;
            cuda.cast_slices(s, &Buffer::Bf16(dw16), dw.mem)
        }
        DType::F64 => panic!("cuDNN convolutions here are f32 or bf16"),
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_typed<T: ConvElement>(
    cuda: &Cuda,
    s: &mut Stream,
    op: &Conv2d,
    in_shape: Shape,
    x: In<Buffer>,
    w: In<Buffer>,
    y: In<Buffer>,
    dy: In<Buffer>,
    mut dx: Option<Out<Buffer>>,
    dw_mem: &mut CudaSlice<T>,
    dw_rect: Rect,
    db: Option<Out<Buffer>>,
) -> Launch {
    let tile = Box4::of(&y.rect);
    let x_layout = Box4::of(&x.rect);
    let geo = Geometry::new(op, in_shape, tile);
    let segments = geo.segments();
    if let Some(dx) = &mut dx {
        assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        // One segment convolving the view itself writes all of dx (cuDNN's β = 0, zeros where
        // no window reads); otherwise positions no window of the tile reads keep this zero.
        let whole = tile.volume() > 0
            && segments.len() == 1
            && matches!(geo.source(&segments[0], &x_layout), Source::View { .. });
        if !whole {
            s.stream.memset_zeros(T::of_mut(dx.mem))?;
        }
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
        // SAFETY: the region copy below writes all of the tile.
        let mut packed = unsafe { s.stream.alloc::<T>(tile.volume() as usize) }?;
        cuda.copy_slice(
            s,
            T::of(dy.mem),
            Box4::of(&dy.rect),
            &mut packed,
            tile,
            tile,
        )?;
        Some(T::wrap(packed))
    } else {
        None
    };
    let dz_buffer = dz_owned.as_ref().unwrap_or(dy.mem);
    if let Some(db) = db {
        cuda.channel_sum(s, dz_buffer, tile, db)?;
    }
    let dz = T::of(dz_buffer);
    let x_mem = T::of(x.mem);
    for segment in &segments {
        let out = geo.output(segment);
        let dz_segment = if segments.len() == 1 {
            None
        } else {
            let mut packed = s.stream.alloc_zeros::<T>(out.volume() as usize)?;
            cuda.copy_slice(s, dz, tile, &mut packed, out, out)?;
            Some(packed)
        };
        let dz_view = view(&dz_segment, dz);
        let source = geo.source(segment, &x_layout);
        let gathered = gather_input(cuda, s, x_mem, x_layout, &source)?;
        let x_view = view(&gathered, x_mem);
        let d = descriptors::<T>(s, &geo, segment, &source, &x_layout, false)?;
        let rows = weight_rows(&geo, segment, dw_rect.lo[0] as i64);

        let filter = ConvBackwardFilter {
            conv: &d.conv,
            x: &d.x,
            dw: &d.w,
            dy: &d.y,
        };
        let mut dw_rows = dw_mem.slice_mut(rows);
        launch_chosen(
            s,
            |c| &mut c.filter,
            d.problem,
            &FILTER_CANDIDATES,
            || Ok(deterministic_filter_algo(filter.pick_algorithm()?)),
            |s, algo, timing| {
                let mut ws = workspace(s, filter.get_workspace_size(algo)?, timing)?;
                // SAFETY: the descriptors describe exactly these buffers.
                unsafe {
                    filter.launch(
                        algo,
                        ws.as_mut(),
                        (T::ONE, T::ZERO),
                        &x_view,
                        &mut dw_rows,
                        &dz_view,
                    )
                }?;
                Ok(())
            },
        )?;

        let Some(dx) = dx.as_mut() else { continue };
        let data = ConvBackwardData {
            conv: &d.conv,
            dx: &d.x,
            w: &d.w,
            dy: &d.y,
        };
        let w_view = T::of(w.mem).slice(weight_rows(&geo, segment, w.rect.lo[0] as i64));
        let dx_mem = T::of_mut(dx.mem);
        // A view's gradient is dx itself (laid out like x); a gathered window's goes through
        // scratch laid out over the window.
        let mut dwindow = match source {
            Source::View { .. } => None,
            Source::Gathered { window } => {
                Some(s.stream.alloc_zeros::<T>(window.volume() as usize)?)
            }
        };
        let target = dwindow.as_mut().unwrap_or(&mut *dx_mem);
        launch_chosen(
            s,
            |c| &mut c.data,
            d.problem,
            &DATA_CANDIDATES,
            || Ok(deterministic_data_algo(data.pick_algorithm()?)),
            |s, algo, timing| {
                let mut ws = workspace(s, data.get_workspace_size(algo)?, timing)?;
                // SAFETY: the descriptors describe exactly these buffers.
                unsafe {
                    data.launch(
                        algo,
                        ws.as_mut(),
                        (T::ONE, T::ZERO),
                        target,
                        &w_view,
                        &dz_view,
                    )
                }?;
                Ok(())
            },
        )?;
        if let (Some(dwindow), Source::Gathered { window }) = (&dwindow, source) {
            // The part of the window inside dx; padding positions are dropped. Segments read
            // disjoint input channels, so copying (not adding) is exact.
            let region = window.intersect(&x_layout);
            cuda.copy_slice(s, dwindow, window, dx_mem, x_layout, region)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The segment plan checked on the CPU: each segment's input (the view, or the gathered
    //! window) convolved by the CPU kernel with the segment's group count and padding, standing in
    //! for cuDNN, must give the CPU's results for the tile.
    use super::*;
    use legion_ops::kernels::conv2d::{conv2d_backward, conv2d_forward};
    use legion_ops::kernels::{View, ViewMut};
    use legion_ops::op::OpSpec;
    use legion_ops::rng::Rng;
    use legion_ops::shape::Rect;

    #[test]
    fn backward_algorithms_with_atomics_are_replaced_by_deterministic_ones() {
        use sys::cudnnConvolutionBwdDataAlgo_t as Data;
        use sys::cudnnConvolutionBwdFilterAlgo_t as Filter;
        for (picked, used) in [
            (
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            ),
            (
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            ),
            (
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            ),
            (
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
                Filter::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
            ),
        ] {
            assert_eq!(deterministic_filter_algo(picked), used);
        }
        assert_eq!(
            deterministic_data_algo(Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0),
            Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1
        );
        assert_eq!(
            deterministic_data_algo(Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT),
            Data::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT
        );
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
    }

    fn offset(layout: &Box4, p: [i64; 4]) -> usize {
        (0..4).fold(0, |off, a| off * layout.ext[a] + (p[a] - layout.lo[a])) as usize
    }

    /// `dst[region] = src[region]` on the host, as `copy_region_f32` does on the GPU.
    fn copy_region(
        src: &[f32],
        src_layout: &Box4,
        dst: &mut [f32],
        dst_layout: &Box4,
        region: &Box4,
    ) {
        for i in 0..region.volume() {
            let mut p = [0; 4];
            let mut rest = i;
            for a in (0..4).rev() {
                p[a] = region.lo[a] + rest % region.ext[a];
                rest /= region.ext[a];
            }
            dst[offset(dst_layout, p)] = src[offset(src_layout, p)];
        }
    }

    fn local(b: &Box4) -> Rect {
        Rect::new(&[0; 4], &b.ext.map(|e| e as usize))
    }

    /// The convolution cuDNN runs for a segment, as a `Conv2d` over the tensor it sees.
    fn segment_op(geo: &Geometry, segment: &Segment, source: &Source) -> Conv2d {
        let pad = source.pad();
        Conv2d {
            out_channels: segment.out_count as usize,
            kernel: geo.kernel.map(|k| k as usize),
            stride: geo.stride.map(|s| s as usize),
            padding: [pad[0] as usize, pad[1] as usize],
            groups: segment.groups as usize,
            bias: false,
            activation: Activation::None,
        }
    }

    fn segment_weights(
        geo: &Geometry,
        segment: &Segment,
        w: &[f32],
        w_lo: i64,
    ) -> (Rect, Vec<f32>) {
        let rows = weight_rows(geo, segment, w_lo);
        let rect = Rect::new(
            &[0; 4],
            &[
                segment.out_count as usize,
                geo.in_per_group as usize,
                geo.kernel[0] as usize,
                geo.kernel[1] as usize,
            ],
        );
        (rect, w[rows].to_vec())
    }

    /// The tensor a segment convolves: the view, or the window gathered into zeros.
    fn segment_input(x: &[f32], x_layout: &Box4, source: &Source) -> (Box4, Vec<f32>) {
        match source {
            Source::View { .. } => (*x_layout, x.to_vec()),
            Source::Gathered { window } => {
                let mut scratch = vec![0.0; window.volume() as usize];
                copy_region(
                    x,
                    x_layout,
                    &mut scratch,
                    window,
                    &window.intersect(x_layout),
                );
                (*window, scratch)
            }
        }
    }

    struct Case {
        op: Conv2d,
        in_shape: Shape,
        tile: Rect,
        x_rect: Rect,
    }

    fn check(case: &Case, seed: u64) -> Vec<&'static str> {
        let Case {
            op,
            in_shape,
            tile,
            x_rect,
        } = case;
        let (x_layout, tile_box) = (Box4::of(x_rect), Box4::of(tile));
        let w_rect = op.params(&[*in_shape])[0]
            .shape
            .full_rect()
            .with_axis(0, tile.lo[1], tile.hi[1]);
        let x = random(x_rect.volume(), seed);
        let w = random(w_rect.volume(), seed + 1);
        let dy = random(tile.volume(), seed + 2);
        let plain = Conv2d {
            bias: false,
            activation: Activation::None,
            ..op.clone()
        };

        // the CPU on the tile
        let mut y_cpu = vec![0.0; tile.volume()];
        conv2d_forward(
            &plain,
            *in_shape,
            View::new(*x_rect, &x),
            View::new(w_rect, &w),
            None,
            ViewMut::new(*tile, &mut y_cpu),
        );
        let (mut dx_cpu, mut dw_cpu) = (vec![0.0; x.len()], vec![0.0; w.len()]);
        conv2d_backward(
            &plain,
            *in_shape,
            View::new(*x_rect, &x),
            View::new(w_rect, &w),
            View::new(*tile, &y_cpu),
            View::new(*tile, &dy),
            Some(ViewMut::new(*x_rect, &mut dx_cpu)),
            ViewMut::new(w_rect, &mut dw_cpu),
            None,
        );

        // the segment plan, the CPU kernel standing in for cuDNN
        let geo = Geometry::new(op, *in_shape, tile_box);
        let (mut y, mut dx, mut dw) = (
            vec![f32::NAN; y_cpu.len()],
            vec![0.0; x.len()],
            vec![f32::NAN; w.len()],
        );
        let mut sources = Vec::new();
        for segment in geo.segments() {
            let source = geo.source(&segment, &x_layout);
            sources.push(matches!(source, Source::View { .. }));
            let sub_op = segment_op(&geo, &segment, &source);
            let (input_box, input) = segment_input(&x, &x_layout, &source);
            let input_shape = Shape::nchw(
                input_box.ext[0] as usize,
                input_box.ext[1] as usize,
                input_box.ext[2] as usize,
                input_box.ext[3] as usize,
            );
            let out_box = geo.output(&segment);
            let out_rect = sub_op
                .infer_shape(&[input_shape])
                .expect("segment conv")
                .full_rect();
            assert_eq!(
                out_rect,
                local(&out_box),
                "cuDNN's output would not be the segment's"
            );
            let (sub_w_rect, sub_w) = segment_weights(&geo, &segment, &w, w_rect.lo[0] as i64);
            let mut out = vec![0.0; out_rect.volume()];
            conv2d_forward(
                &sub_op,
                input_shape,
                View::new(local(&input_box), &input),
                View::new(sub_w_rect, &sub_w),
                None,
                ViewMut::new(out_rect, &mut out),
            );
            copy_region(&out, &out_box, &mut y, &tile_box, &out_box);

            let mut dz = vec![0.0; out.len()];
            copy_region(&dy, &tile_box, &mut dz, &out_box, &out_box);
            let (mut d_input, mut d_w) = (vec![0.0; input.len()], vec![0.0; sub_w.len()]);
            conv2d_backward(
                &sub_op,
                input_shape,
                View::new(local(&input_box), &input),
                View::new(sub_w_rect, &sub_w),
                View::new(out_rect, &out),
                View::new(out_rect, &dz),
                Some(ViewMut::new(local(&input_box), &mut d_input)),
                ViewMut::new(sub_w_rect, &mut d_w),
                None,
            );
            let rows = weight_rows(&geo, &segment, w_rect.lo[0] as i64);
            dw[rows].copy_from_slice(&d_w);
            let region = input_box.intersect(&x_layout);
            copy_region(&d_input, &input_box, &mut dx, &x_layout, &region);
        }
        let close = |a: &[f32], b: &[f32]| {
            let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
            a.iter().zip(b).all(|(p, q)| (p - q).abs() / scale <= 1e-6)
        };
        let mut wrong = Vec::new();
        if !close(&y, &y_cpu) {
            wrong.push("y");
        }
        if !close(&dx, &dx_cpu) {
            wrong.push("dx");
        }
        if !close(&dw, &dw_cpu) {
            wrong.push("dw");
        }
        wrong
    }

    #[test]
    fn segment_plans_reproduce_the_cpu_convolution() {
        let x_shape = Shape::nchw(2, 3, 11, 10);
        let strided = Conv2d::new(5, 5).stride(2).padding(2);
        let plain = Conv2d::new(4, 3).padding(1);
        let grouped = Conv2d::new(9, 3).padding(1).groups(3);
        let g_shape = Shape::nchw(2, 6, 9, 9);
        let mut cases = Vec::new();
        let mut add = |op: &Conv2d, in_shape: Shape, tile: Option<Rect>, x_rect: Option<Rect>| {
            let out = op.infer_shape(&[in_shape]).unwrap().full_rect();
            let tile = tile.map_or(out, |f| f);
            let x_rect = x_rect.unwrap_or_else(|| op.project(&[in_shape], &tile)[0]);
            cases.push(Case {
                op: op.clone(),
                in_shape,
                tile,
                x_rect,
            });
        };
        let out = strided.infer_shape(&[x_shape]).unwrap().full_rect();
        add(&strided, x_shape, None, None);
        add(&strided, x_shape, Some(out.with_axis(2, 0, 3)), None);
        add(&strided, x_shape, Some(out.with_axis(2, 3, 6)), None);
        add(
            &strided,
            x_shape,
            Some(out.with_axis(2, 1, 5).with_axis(3, 1, 4)),
            None,
        );
        add(
            &strided,
            x_shape,
            Some(out.with_axis(0, 1, 2)),
            Some(x_shape.full_rect()),
        );
        let p_out = plain.infer_shape(&[x_shape]).unwrap().full_rect();
        add(
            &plain,
            x_shape,
            Some(p_out.with_axis(3, 0, 5)),
            Some(x_shape.full_rect()),
        );
        add(&plain, x_shape, Some(p_out.with_axis(1, 1, 3)), None);
        add(
            &Conv2d::new(4, 3),
            x_shape,
            Some(
                Conv2d::new(4, 3)
                    .infer_shape(&[x_shape])
                    .unwrap()
                    .full_rect()
                    .with_axis(2, 2, 6),
            ),
            None,
        );
        let g_out = grouped.infer_shape(&[g_shape]).unwrap().full_rect();
        add(&grouped, g_shape, None, None);
        add(&grouped, g_shape, Some(g_out.with_axis(1, 3, 9)), None);
        add(&grouped, g_shape, Some(g_out.with_axis(1, 1, 5)), None);
        add(
            &grouped,
            g_shape,
            Some(g_out.with_axis(1, 2, 8).with_axis(2, 4, 9)),
            None,
        );
        add(
            &Conv2d::new(6, 3).stride(2).padding(1).groups(6),
            g_shape,
            None,
            None,
        );
        let mut failures = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            let wrong = check(case, 10 * i as u64);
            if !wrong.is_empty() {
                failures.push(format!(
                    "case {i} (tile {}, view {}): {wrong:?}",
                    case.tile, case.x_rect
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn whole_tensors_use_cudnn_padding_and_halos_are_gathered() {
        let op = Conv2d::new(4, 3).padding(1);
        let shape = Shape::nchw(2, 3, 8, 8);
        let whole = Box4::of(&shape.full_rect());
        let out = op.infer_shape(&[shape]).unwrap().full_rect();
        let geo = Geometry::new(&op, shape, Box4::of(&out));
        let segments = geo.segments();
        assert_eq!(segments.len(), 1);
        assert!(matches!(
            geo.source(&segments[0], &whole),
            Source::View { pad: [1, 1] }
        ));
        let half = out.with_axis(2, 0, 4);
        let geo = Geometry::new(&op, shape, Box4::of(&half));
        let view = Box4::of(&op.project(&[shape], &half)[0]);
        assert!(matches!(
            geo.source(&geo.segments()[0], &view),
            Source::Gathered { .. }
        ));
        // no padding needed and the view is exactly the window: read in place
        let valid = Conv2d::new(4, 3);
        let out = valid
            .infer_shape(&[shape])
            .unwrap()
            .full_rect()
            .with_axis(2, 2, 4);
        let geo = Geometry::new(&valid, shape, Box4::of(&out));
        let view = Box4::of(&valid.project(&[shape], &out)[0]);
        assert!(matches!(
            geo.source(&geo.segments()[0], &view),
            Source::View { pad: [0, 0] }
        ));
    }
}
