//! [`Cuda`]: `legion_ops::backend::Backend` on one GPU.
//!
//! Primitives only enqueue work on the caller's [`Stream`]. The trait gives most primitives no
//! error channel, so a failure to enqueue (out of memory, a failed launch, a cuDNN status) is kept
//! on the stream, later work on that stream is skipped, and [`Backend::synchronize`] reports the
//! first failure. Host syncs that cudarc or the driver force are named where they happen: uploads
//! from pageable host memory (`load_images`, the labels of the loss kernels) return once the driver
//! has staged the data, which waits for the stream; downloads wait for the copy.

use crate::algos::{Chosen, ConvAlgos};
use crate::kernels::{CompileError, Kernels, REDUCE_THREADS, WARP_ROWS_PER_BLOCK};
use crate::probe::{Library, ProbeError, require};
use cudarc::cublas::{CudaBlas, sys as cublas_sys};
use cudarc::cudnn::Cudnn;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg,
};
use legion_ops::backend::cpu;
use legion_ops::backend::{Backend, DType, In, KernelError, LabelOutOfRange, LossSums, Out};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::op::{BatchNorm, Concat, Conv2d, Dense, OpSpec, Pool2d, PoolKind};
use legion_ops::rng;
use legion_ops::shape::{Rect, Shape, copy_rect};
use legion_ops::train::Sgd;
use std::sync::Arc;

/// Device memory of one operand: f32 data, or f64 for batch-norm sums.
#[derive(Debug)]
pub enum Buffer {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
}

impl Buffer {
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(s) => s.len(),
            Buffer::F64(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn f32(&self) -> &CudaSlice<f32> {
        match self {
            Buffer::F32(s) => s,
            Buffer::F64(_) => panic!("f64 buffer used as f32"),
        }
    }

    pub fn f32_mut(&mut self) -> &mut CudaSlice<f32> {
        match self {
            Buffer::F32(s) => s,
            Buffer::F64(_) => panic!("f64 buffer used as f32"),
        }
    }

    pub fn f64(&self) -> &CudaSlice<f64> {
        match self {
            Buffer::F64(s) => s,
            Buffer::F32(_) => panic!("f32 buffer used as f64"),
        }
    }

    pub fn f64_mut(&mut self) -> &mut CudaSlice<f64> {
        match self {
            Buffer::F64(s) => s,
            Buffer::F32(_) => panic!("f32 buffer used as f64"),
        }
    }
}

/// An in-order queue on the GPU, with the cuBLAS and cuDNN handles bound to it.
pub struct Stream {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) cudnn: Arc<Cudnn>,
    /// The arithmetic cuBLAS and cuDNN may use on this stream.
    pub(crate) math: Math,
    /// How convolution algorithms are picked, and those picked so far (see [`crate::algos`]).
    pub(crate) algorithms: ConvAlgos,
    pub(crate) chosen: Chosen,
    /// Page-locked host memory the batch's images are staged through (`load_images`), kept
    /// from step to step while the batch size stays.
    input_staging: Option<(
        cudarc::driver::PinnedHostSlice<f32>,
        Option<cudarc::driver::CudaEvent>,
    )>,
    /// The cuDNN descriptors of each convolution problem met on this stream.
    pub(crate) descriptors:
        std::collections::HashMap<crate::algos::Problem, std::rc::Rc<crate::conv::Descriptors>>,
    /// cuDNN's workspace, kept and grown to the largest a chosen algorithm asked for.
    pub(crate) workspace: std::cell::RefCell<Option<CudaSlice<u8>>>,
    /// The copy stream and buffers of batches staged ahead (`stage_batch`), once one is.
    pub(crate) batches: Option<crate::batches::BatchCopies>,
    /// The labels of the batch the step being enqueued took (`take_staged`).
    pub(crate) labels: Option<crate::batches::DeviceLabels>,
    /// The first failure to enqueue, reported by `synchronize`; later work is skipped.
    pub(crate) failure: Option<String>,
}

// SAFETY: cudarc leaves `Cudnn` !Send to keep a handle from being used by two threads at once;
// cuDNN allows a handle on any thread as long as calls do not overlap, and its context is made
// current on the calling thread before every primitive (`Cuda::enqueue`). A `Stream` owns its
// handle (the descriptors holding clones, kept per problem behind `Rc`s that never leave it, are
// used only by its own primitives) and is only used through `&mut`, so moving it to another
// thread (a device actor's) cannot overlap calls.
unsafe impl Send for Stream {}

impl Stream {
    /// The arithmetic cuBLAS runs this stream's products in, read back from its handle (what
    /// `--tf32` set, as the library sees it).
    pub fn cublas_math(&self) -> Result<Math, KernelError> {
        let mut mode = std::mem::MaybeUninit::<cublas_sys::cublasMath_t>::uninit();
        // SAFETY: a live handle; cuBLAS writes the mode on success, read only then.
        let mode = unsafe {
            cublas_sys::cublasGetMathMode(*self.blas.handle(), mode.as_mut_ptr())
                .result()
                .map_err(|e| KernelError::Device(format!("cublasGetMathMode: {e}")))?;
            mode.assume_init()
        };
        Ok(match mode {
            cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH => Math::Tf32,
            _ => Math::StrictFp32,
        })
    }
}

impl Stream {
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The first failure to enqueue since the last [`Stream::clear_failure`], if any: work
    /// enqueued after it was skipped.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Forgets the kept failure, so that later work runs again (a new step after a failed one).
    /// An error that broke the context itself comes back at the next enqueue or synchronize.
    pub fn clear_failure(&mut self) -> Option<String> {
        self.failure.take()
    }
}

/// A loss kernel's report: `[loss sum, correct count]` in device memory until read.
pub struct PendingLoss {
    totals: Option<CudaSlice<f64>>,
}

/// Why the backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error(transparent)]
    Kernels(#[from] CompileError),
    #[error("CUDA device {ordinal}: {error}")]
    Device { ordinal: usize, error: String },
}

/// A failure inside a primitive, kept on its stream.
#[derive(Debug)]
pub(crate) struct Failure(pub(crate) String);

impl From<DriverError> for Failure {
    fn from(e: DriverError) -> Self {
        Failure(format!("CUDA driver: {e}"))
    }
}
impl From<cudarc::cublas::result::CublasError> for Failure {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        Failure(format!("cuBLAS: {e}"))
    }
}
impl From<cudarc::cudnn::CudnnError> for Failure {
    fn from(e: cudarc::cudnn::CudnnError) -> Self {
        Failure(format!("cuDNN: {e}"))
    }
}

pub(crate) type Launch = Result<(), Failure>;

/// A rect as the kernels see it (`Box4` in kernels.cu): four axes, lower corner and extents.
/// `Rect` keeps axes past its rank as `[0, 1)`, which is the padding the kernels expect.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Box4 {
    pub lo: [i64; 4],
    pub ext: [i64; 4],
}

// SAFETY: plain old data with the C layout of `Box4` in kernels.cu.
unsafe impl DeviceRepr for Box4 {}

impl Box4 {
    pub fn of(rect: &Rect) -> Box4 {
        let mut b = Box4 {
            lo: [0; 4],
            ext: [1; 4],
        };
        for axis in 0..4 {
            b.lo[axis] = rect.lo[axis] as i64;
            b.ext[axis] = rect.hi[axis].saturating_sub(rect.lo[axis]) as i64;
        }
        b
    }

    pub fn volume(&self) -> i64 {
        self.ext.iter().product()
    }

    pub fn hi(&self, axis: usize) -> i64 {
        self.lo[axis] + self.ext[axis]
    }

    pub fn intersect(&self, other: &Box4) -> Box4 {
        let mut b = *self;
        for axis in 0..4 {
            let lo = self.lo[axis].max(other.lo[axis]);
            let hi = self.hi(axis).min(other.hi(axis)).max(lo);
            b.lo[axis] = lo;
            b.ext[axis] = hi - lo;
        }
        b
    }

    /// This box moved by `delta` along `axis`.
    pub fn shifted(mut self, axis: usize, delta: i64) -> Box4 {
        self.lo[axis] += delta;
        self
    }

    /// This box with `axis` set to `[lo, lo + ext)`.
    pub fn with_axis(mut self, axis: usize, lo: i64, ext: i64) -> Box4 {
        self.lo[axis] = lo;
        self.ext[axis] = ext;
        self
    }
}

/// The pooling parameters as `Pool` in kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PoolParams {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    in_size: [i64; 2],
    is_max: i32,
    inv_area: f32,
}

// SAFETY: plain old data with the C layout of `Pool` in kernels.cu.
unsafe impl DeviceRepr for PoolParams {}

impl PoolParams {
    fn new(op: &Pool2d, in_shape: Shape) -> PoolParams {
        PoolParams {
            kernel: op.kernel.map(|k| k as i64),
            stride: op.stride.map(|s| s as i64),
            padding: op.padding.map(|p| p as i64),
            in_size: [in_shape.dim(2) as i64, in_shape.dim(3) as i64],
            is_max: matches!(op.kind, PoolKind::Max) as i32,
            // as kernels::pool2d: the reciprocal rounded to f32 once
            inv_area: 1.0 / (op.kernel[0] * op.kernel[1]) as f32,
        }
    }
}

const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
pub(crate) fn grid(n: i64) -> LaunchConfig {
    let blocks = (n.max(1) as u64).div_ceil(THREADS as u64).min(1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One reduction block per channel.
pub(crate) fn per_channel(channels: i64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (channels as u32, 1, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Buffers are allocated and freed in stream order (`cuMemAllocAsync`) from the device's default
/// pool, which by default hands freed memory back to the driver at every synchronisation, so
/// each step would map its activations afresh. Keeping it pooled (release threshold: never) makes
/// a step's allocations reuse the last step's memory, as a caching allocator does.
fn keep_freed_memory_pooled(context: &Arc<CudaContext>) -> Result<(), DriverError> {
    use cudarc::driver::{result, sys};
    context.bind_to_thread()?;
    let mut threshold = u64::MAX;
    // SAFETY: the context's own device; the attribute takes a u64, passed by pointer.
    unsafe {
        let Ok(pool) = result::device::get_default_mem_pool(context.cu_device()) else {
            // No stream-ordered allocation on this device: cudarc allocates synchronously.
            return Ok(());
        };
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut threshold).cast(),
        )
    }
}

/// A null device pointer, for the kernels' optional operands.
const NULL: u64 = 0;

/// `legion_ops::backend::Backend` on one GPU.
pub struct Cuda {
    pub(crate) context: Arc<CudaContext>,
    pub(crate) kernels: Kernels,
    settings: Settings,
}

/// The arithmetic of matrix products and convolutions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Math {
    /// FP32 FMA kernels only: results agree with the CPU's to rounding (the default).
    #[default]
    StrictFp32,
    /// TF32 tensor cores where cuBLAS and cuDNN choose them (inputs rounded to 10 mantissa bits,
    /// FP32 accumulation): several times the FP32 throughput on Ampere and later, at ~1e-3
    /// relative error per product. Opt-in (`--tf32`).
    Tf32,
}

/// Whether buffers move between the streams of this backend's context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharing {
    /// Devices sharing a GPU hand buffers to each other's streams: cudarc records an event at
    /// every use of every buffer and makes another stream wait for it (the default).
    #[default]
    AcrossStreams,
    /// Every buffer is used on the stream that allocated it, and the backend orders its copy
    /// streams with events of its own (`crate::batches`): cudarc's two event calls per operand
    /// of every launch and two event creations per allocation are saved. The one-device
    /// trainer's setting; device actors that exchange buffers must not use it.
    WithinStreams,
}

/// How a [`Cuda`] backend computes and orders its work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub math: Math,
    pub conv_algos: ConvAlgos,
    pub sharing: Sharing,
}

impl Cuda {
    /// The backend on GPU `ordinal` with the default [`Settings`]: checks the libraries first
    /// (see [`crate::probe`]), then creates the context and loads the kernels (compiled once per
    /// process).
    pub fn new(ordinal: usize) -> Result<Cuda, StartError> {
        Cuda::with_settings(ordinal, Settings::default())
    }

    /// [`Cuda::new`] whose streams compute with `math`.
    pub fn with_math(ordinal: usize, math: Math) -> Result<Cuda, StartError> {
        Cuda::with_settings(
            ordinal,
            Settings {
                math,
                ..Settings::default()
            },
        )
    }

    /// [`Cuda::new`] with `settings`.
    pub fn with_settings(ordinal: usize, settings: Settings) -> Result<Cuda, StartError> {
        let devices = crate::probe::probe()?;
        if ordinal >= devices.len() {
            return Err(StartError::Device {
                ordinal,
                error: format!("only {} GPU(s) present", devices.len()),
            });
        }
        let device_error = |e: DriverError| StartError::Device {
            ordinal,
            error: e.to_string(),
        };
        let context = CudaContext::new(ordinal).map_err(device_error)?;
        if settings.sharing == Sharing::WithinStreams {
            // SAFETY: before any buffer of this context exists; every buffer is then used on the
            // stream that allocated it, and copy streams wait for explicit events (`Sharing`).
            unsafe { context.disable_event_tracking() };
        }
        // Only speed depends on it: a driver that refuses leaves the default behaviour.
        let _ = keep_freed_memory_pooled(&context);
        let kernels = Kernels::load(&context)?;
        Ok(Cuda {
            context,
            kernels,
            settings,
        })
    }

    /// How this backend's streams pick convolution algorithms.
    pub fn conv_algos(&self) -> ConvAlgos {
        self.settings.conv_algos
    }

    /// The arithmetic of this backend's streams.
    pub fn math(&self) -> Math {
        self.settings.math
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// A new buffer of `len` elements: `pattern` repeated (device-to-device copies, enqueued on
    /// `s`). Fills many buffers from one uploaded pattern without host work per element.
    pub fn repeated(
        &self,
        s: &mut Stream,
        pattern: &Buffer,
        len: usize,
    ) -> Result<Buffer, KernelError> {
        fn fill<T: cudarc::driver::DeviceRepr>(
            stream: &Arc<CudaStream>,
            pattern: &CudaSlice<T>,
            len: usize,
        ) -> Result<CudaSlice<T>, DriverError> {
            assert!(!pattern.is_empty(), "an empty pattern fills nothing");
            // SAFETY: every element is written below before the buffer is handed out.
            let mut out = unsafe { stream.alloc::<T>(len) }?;
            let mut at = 0;
            while at < len {
                let n = pattern.len().min(len - at);
                stream.memcpy_dtod(&pattern.slice(..n), &mut out.slice_mut(at..at + n))?;
                at += n;
            }
            Ok(out)
        }
        let out = match pattern {
            Buffer::F32(p) => fill(&s.stream, p, len).map(Buffer::F32),
            Buffer::F64(p) => fill(&s.stream, p, len).map(Buffer::F64),
        };
        out.map_err(|e| KernelError::Device(format!("repeated pattern of {len}: {e}")))
    }

    /// A new stream with its own cuBLAS and cuDNN handles, both set to the backend's [`Math`].
    pub fn new_stream(&self) -> Result<Stream, KernelError> {
        let device = |e: String| KernelError::Device(e);
        require(Library::Cublas).map_err(|e| device(e.to_string()))?;
        require(Library::Cudnn).map_err(|e| device(e.to_string()))?;
        let stream = self
            .context
            .new_stream()
            .map_err(|e| device(format!("new stream: {e}")))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| device(format!("cuBLAS: {e}")))?;
        // Default math is plain FP32 SGEMM; TF32 tensor cores need CUBLAS_TF32_TENSOR_OP_MATH,
        // set only when asked for. Stated explicitly so that an inherited default cannot change it.
        let mode = match self.settings.math {
            Math::StrictFp32 => cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            Math::Tf32 => cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        };
        // SAFETY: a live handle and a valid enum value.
        unsafe { cublas_sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .map_err(|e| device(format!("cublasSetMathMode: {e}")))?;
        let cudnn = Cudnn::new(stream.clone()).map_err(|e| device(format!("cuDNN: {e}")))?;
        Ok(Stream {
            stream,
            blas,
            cudnn,
            math: self.settings.math,
            algorithms: self.settings.conv_algos,
            chosen: Chosen::default(),
            input_staging: None,
            descriptors: Default::default(),
            workspace: Default::default(),
            batches: None,
            labels: None,
            failure: None,
        })
    }

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

    /// Runs `work` unless the stream already failed; keeps its failure otherwise.
    pub(crate) fn enqueue(
        &self,
        s: &mut Stream,
        what: &str,
        work: impl FnOnce(&mut Stream) -> Launch,
    ) {
        if s.failure.is_some() {
            return;
        }
        // cuDNN and cuBLAS calls need the context current on this thread; kernel launches and
        // copies bind it themselves.
        let bound = self.context.bind_to_thread().map_err(Failure::from);
        if let Err(Failure(error)) = bound.and_then(|()| work(s)) {
            s.failure = Some(format!("{what}: {error}"));
        }
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

    /// `y = f(x)` over `y.rect` with one of the unary element-wise kernels.
    fn unary(&self, s: &Stream, f: &CudaFunction, x: In<Buffer>, y: Out<Buffer>) -> Launch {
        let tile = Box4::of(&y.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let x_layout = Box4::of(&x.rect);
        let packed = (x_layout == tile) as i32;
        let mut b = s.stream.launch_builder(f);
        b.arg(x.mem.f32())
            .arg(&x_layout)
            .arg(y.mem.f32_mut())
            .arg(&tile)
            .arg(&n)
            .arg(&packed);
        // SAFETY: the arguments match the kernel's signature; x's rect contains the tile.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `out = f(a, b)` over `out.rect` with one of the binary element-wise kernels.
    fn binary(
        &self,
        s: &Stream,
        f: &CudaFunction,
        a: In<Buffer>,
        b: In<Buffer>,
        out: Out<Buffer>,
    ) -> Launch {
        let tile = Box4::of(&out.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let (a_layout, b_layout) = (Box4::of(&a.rect), Box4::of(&b.rect));
        let packed = (a_layout == tile && b_layout == tile) as i32;
        let mut l = s.stream.launch_builder(f);
        l.arg(a.mem.f32())
            .arg(&a_layout)
            .arg(b.mem.f32())
            .arg(&b_layout)
            .arg(out.mem.f32_mut())
            .arg(&tile)
            .arg(&n)
            .arg(&packed);
        // SAFETY: the arguments match the kernel's signature; both inputs contain the tile.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `y += bias[c]`, then ReLU when asked, over `y` laid out over `tile`.
    pub(crate) fn bias_activation(
        &self,
        s: &Stream,
        y: &mut CudaSlice<f32>,
        tile: Box4,
        bias: Option<In<Buffer>>,
        relu: bool,
    ) -> Launch {
        let n = tile.volume();
        if n == 0 || (bias.is_none() && !relu) {
            return Ok(());
        }
        let relu = relu as i32;
        let mut b = s.stream.launch_builder(&self.kernels.bias_activation);
        b.arg(y).arg(&tile);
        let bias_lo = bias.map_or(0, |b| b.rect.lo[0] as i64);
        match bias {
            Some(bias) => b.arg(bias.mem.f32()),
            None => b.arg(&NULL),
        };
        b.arg(&bias_lo).arg(&relu).arg(&n);
        // SAFETY: the arguments match the kernel's signature; the bias covers the tile's channels.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `dz = dy·[y > 0]` over `tile`, into a new buffer laid out over the tile.
    pub(crate) fn relu_mask(
        &self,
        s: &Stream,
        y: In<Buffer>,
        dy: In<Buffer>,
        tile: &Rect,
    ) -> Result<CudaSlice<f32>, Failure> {
        // SAFETY: the kernel writes every element of the tile.
        let mut dz = Buffer::F32(unsafe { s.stream.alloc::<f32>(tile.volume()) }?);
        self.binary(
            s,
            &self.kernels.relu_backward,
            y,
            dy,
            Out {
                rect: *tile,
                mem: &mut dz,
            },
        )?;
        match dz {
            Buffer::F32(dz) => Ok(dz),
            Buffer::F64(_) => unreachable!(),
        }
    }

    /// `out[c − out_lo] = Σ dz[·, c, ·, ·]` per channel of `tile` (dz laid out over the tile).
    pub(crate) fn channel_sum(
        &self,
        s: &Stream,
        dz: &CudaSlice<f32>,
        tile: Box4,
        out: Out<Buffer>,
    ) -> Launch {
        let channels = tile.ext[1];
        if channels == 0 {
            return Ok(());
        }
        let out_lo = out.rect.lo[0] as i64;
        let mut b = s.stream.launch_builder(&self.kernels.channel_sum);
        b.arg(dz).arg(&tile).arg(out.mem.f32_mut()).arg(&out_lo);
        // SAFETY: the arguments match the kernel's signature; `out` covers the tile's channels.
        unsafe { b.launch(per_channel(channels)) }?;
        Ok(())
    }

    /// A tile's labels on the device, after checking them against the class count as the CPU
    /// does: those of the staged batch the step took where they are the same, else uploaded.
    fn labels<'s>(
        &self,
        s: &'s Stream,
        labels: &[u32],
        first_row: usize,
        classes: usize,
    ) -> Result<Result<TileLabels<'s>, Failure>, LabelOutOfRange> {
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes) {
            return Err(LabelOutOfRange {
                sample: first_row + i,
                label: labels[i],
                classes,
            });
        }
        if let Some(staged) = &s.labels
            && let Some(rows) = staged.rows(labels, first_row)
        {
            return Ok(Ok(TileLabels::Staged(staged.device.slice(rows))));
        }
        Ok(s.stream
            .clone_htod(labels)
            .map(TileLabels::Uploaded)
            .map_err(Failure::from))
    }

    fn check_loss_tile(logits: &Rect, labels: &[u32], out: &Rect, out_columns: usize) {
        assert_eq!(logits.ndim(), 2, "logits must be (N, classes)");
        assert_eq!(
            logits.lo[1], 0,
            "logits view {logits} must hold all classes"
        );
        assert!(
            out.lo[1] == 0 && out.hi[1] == out_columns,
            "output tile {out} has the wrong columns"
        );
        assert!(
            out.lo[0] >= logits.lo[0] && out.hi[0] <= logits.hi[0],
            "logits view {logits} does not contain the rows of {out}"
        );
        assert_eq!(labels.len(), out.extent(0), "one label per row of {out}");
    }
}

/// A loss tile's labels on the device.
enum TileLabels<'s> {
    /// Rows of the staged batch's labels.
    Staged(cudarc::driver::CudaView<'s, u32>),
    Uploaded(CudaSlice<u32>),
}

impl TileLabels<'_> {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        match self {
            TileLabels::Staged(view) => b.arg(view),
            TileLabels::Uploaded(slice) => b.arg(slice),
        };
    }
}

/// How many elements each channel of a batch-norm tile has, and into how many parts its sums
/// are split: one block per ~8k elements (at most 256 parts), so that a layer with few channels
/// of many elements each still fills the GPU.
fn channel_parts(tile: &Box4) -> Result<(i64, i64), Failure> {
    /// Elements a block sums: enough that a part's block is busy, few enough for many blocks.
    const PER_PART: i64 = 8192;
    let per_channel = tile.ext[0] * tile.ext[2] * tile.ext[3];
    if per_channel > u32::MAX as i64 {
        return Err(Failure(format!(
            "batch-norm tile {tile:?}: {per_channel} elements a channel, more than the kernels' 2^32"
        )));
    }
    Ok((
        per_channel,
        ((per_channel + PER_PART - 1) / PER_PART).clamp(1, 256),
    ))
}

/// The statistics operands of the batch-norm kernels: `[3, C]` sums over channels `[lo, lo + C)`.
fn sums_range(sums: &In<Buffer>) -> (i64, i64) {
    (sums.rect.lo[1] as i64, sums.rect.extent(1) as i64)
}

impl Backend for Cuda {
    type Buffer = Buffer;
    type Stream = Stream;
    type Loss = PendingLoss;
    type Staged = crate::batches::StagedBatch;
    type Marker = crate::staging::Marker;

    /// A zeroed buffer of `len` elements.
    fn alloc_zeros(&self, s: &mut Stream, dtype: DType, len: usize) -> Result<Buffer, KernelError> {
        let out = match dtype {
            DType::F32 => s.stream.alloc_zeros::<f32>(len).map(Buffer::F32),
            DType::F64 => s.stream.alloc_zeros::<f64>(len).map(Buffer::F64),
        };
        out.map_err(|e| KernelError::Device(format!("alloc {len} × {dtype:?}: {e}")))
    }

    /// Stream-ordered memory from the device's pool, not filled (NaN with debug assertions).
    fn alloc(&self, s: &mut Stream, dtype: DType, len: usize) -> Result<Buffer, KernelError> {
        fn fresh<T: cudarc::driver::DeviceRepr>(
            stream: &Arc<CudaStream>,
            len: usize,
        ) -> Result<CudaSlice<T>, DriverError> {
            // SAFETY: the caller's kernel writes every element before anything reads it (the
            // contract of `Backend::alloc`); any bit pattern is a valid f32 or f64 meanwhile.
            let mut out = unsafe { stream.alloc::<T>(len) }?;
            if cfg!(debug_assertions) && len > 0 {
                use cudarc::driver::DevicePtrMut;
                let bytes = out.num_bytes();
                let (ptr, _record) = out.device_ptr_mut(stream);
                // SAFETY: `bytes` bytes at `ptr` belong to `out`; all-ones bytes are NaN in both
                // element types.
                unsafe {
                    cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream())
                }?;
            }
            Ok(out)
        }
        let out = match dtype {
            DType::F32 => fresh::<f32>(&s.stream, len).map(Buffer::F32),
            DType::F64 => fresh::<f64>(&s.stream, len).map(Buffer::F64),
        };
        out.map_err(|e| KernelError::Device(format!("alloc {len} × {dtype:?}: {e}")))
    }

    /// A device copy of a host buffer. Returns once the driver has staged the host data (a
    /// pageable copy waits for the stream).
    fn upload(&self, s: &mut Stream, host: &cpu::Buffer) -> Result<Buffer, KernelError> {
        let out = match host {
            cpu::Buffer::F32(v) => s.stream.clone_htod(v).map(Buffer::F32),
            cpu::Buffer::F64(v) => s.stream.clone_htod(v).map(Buffer::F64),
        };
        out.map_err(|e| KernelError::Device(format!("upload: {e}")))
    }

    /// The buffer's contents on the host, once everything enqueued before on `s` has run.
    fn download(&self, s: &mut Stream, buffer: &Buffer) -> Result<cpu::Buffer, KernelError> {
        let out = match buffer {
            Buffer::F32(d) => s.stream.clone_dtoh(d).map(cpu::Buffer::F32),
            Buffer::F64(d) => s.stream.clone_dtoh(d).map(cpu::Buffer::F64),
        };
        out.map_err(|e| KernelError::Device(format!("download: {e}")))
    }

    fn accumulate(&self, s: &mut Stream, acc: Out<Buffer>, term: In<Buffer>) {
        let rect = acc.rect;
        self.add_rect(s, term.mem, &term.rect, acc.mem, &rect, &rect);
    }

    fn copy_rect(&self, s: &mut Stream, from: In<Buffer>, to: Out<Buffer>, rect: &Rect) {
        Cuda::copy_rect(self, s, from.mem, &from.rect, to.mem, &to.rect, rect);
    }

    fn add_rect(&self, s: &mut Stream, from: In<Buffer>, to: Out<Buffer>, rect: &Rect) {
        Cuda::add_rect(self, s, from.mem, &from.rect, to.mem, &to.rect, rect);
    }

    fn zero_rect(&self, s: &mut Stream, to: Out<Buffer>, rect: &Rect) {
        if *rect == to.rect {
            return self.zero(s, to.mem);
        }
        let (layout, region) = (Box4::of(&to.rect), Box4::of(rect));
        let n = region.volume();
        if n == 0 {
            return;
        }
        self.enqueue(s, "zero_rect", |s| {
            let k = &self.kernels;
            let mut b = match to.mem {
                Buffer::F32(d) => {
                    let mut b = s.stream.launch_builder(&k.zero_region_f32);
                    b.arg(d);
                    b
                }
                Buffer::F64(d) => {
                    let mut b = s.stream.launch_builder(&k.zero_region_f64);
                    b.arg(d);
                    b
                }
            };
            b.arg(&layout).arg(&region).arg(&n);
            // SAFETY: the arguments match the kernel's signature; region lies in the layout.
            unsafe { b.launch(grid(n)) }?;
            Ok(())
        });
    }

    fn mark(&self, s: &mut Stream) -> Result<crate::staging::Marker, KernelError> {
        Cuda::mark(self, s)
    }

    fn seconds_between(
        &self,
        earlier: &crate::staging::Marker,
        later: &crate::staging::Marker,
    ) -> Result<f64, KernelError> {
        later.seconds_since(earlier)
    }

    fn synchronize(&self, s: &mut Stream) -> Result<(), KernelError> {
        let waited = s.stream.synchronize();
        if let Some(failure) = &s.failure {
            return Err(KernelError::Device(failure.clone()));
        }
        waited.map_err(|e| KernelError::Device(format!("synchronize: {e}")))?;
        self.context
            .check_err()
            .map_err(|e| KernelError::Device(format!("CUDA: {e}")))
    }

    fn read_loss(&self, loss: PendingLoss) -> LossSums {
        let Some(totals) = loss.totals else {
            return LossSums::default();
        };
        let host = totals
            .stream()
            .clone_dtoh(&totals)
            .unwrap_or_else(|e| panic!("reading a loss after synchronize failed: {e}"));
        LossSums {
            loss_sum: host[0],
            correct: host[1] as usize,
        }
    }

    type HostBatch = crate::batches::HostBatch;

    fn begin_stage(
        &self,
        s: &mut Stream,
        images: usize,
        labels: usize,
    ) -> Result<crate::batches::HostBatch, KernelError> {
        self.begin_stage_on(s, images, labels)
    }

    fn host_slices(
        batch: &mut crate::batches::HostBatch,
    ) -> Result<(&mut [f32], &mut [u32]), KernelError> {
        Cuda::host_slices_of(batch)
    }

    fn finish_stage(
        &self,
        s: &mut Stream,
        batch: crate::batches::HostBatch,
    ) -> Result<crate::batches::StagedBatch, KernelError> {
        self.finish_stage_on(s, batch)
    }

    fn take_staged(
        &self,
        s: &mut Stream,
        staged: crate::batches::StagedBatch,
    ) -> Result<Buffer, KernelError> {
        self.take_staged_on(s, staged).map(Buffer::F32)
    }

    fn recycle_staged(&self, s: &mut Stream, images: Buffer) {
        match images {
            Buffer::F32(images) => self.recycle_staged_on(s, images),
            Buffer::F64(_) => panic!("a batch's images are f32"),
        }
    }

    fn load_images(
        &self,
        s: &mut Stream,
        images: &[f32],
        held: &Rect,
        tile: &Rect,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "load_images", |s| {
            // A range of samples (the usual tile) is one run of the host batch: copied from
            // there, with no host copy first.
            let gathered;
            let host = match tile.contiguous_in(held) {
                Some(run) => &images[run],
                None => {
                    let mut buffer = vec![0.0f32; tile.volume()];
                    copy_rect(images, held, &mut buffer, tile, tile);
                    gathered = buffer;
                    &gathered[..]
                }
            };
            let y_layout = Box4::of(&y.rect);
            let dst = y.mem.f32_mut();
            if host.is_empty() {
                return Ok(());
            }
            if y.rect == *tile {
                // Through page-locked memory, filled by several threads: a pageable copy runs
                // at a fraction of the bus's rate on one thread (AlexNet's 77 MB batch took 11
                // ms of a 40 ms step on the H200), and holds this thread until it has run.
                let Stream {
                    stream,
                    input_staging,
                    ..
                } = s;
                if input_staging
                    .as_ref()
                    .is_none_or(|(p, _)| p.len() != host.len())
                {
                    *input_staging = None;
                    // every element is written below before the copy reads it
                    let fresh = crate::staging::pinned::<f32>(
                        self,
                        host.len(),
                        crate::staging::Direction::ToDevice,
                    )?;
                    *input_staging = Some((fresh, None));
                }
                let (staging, copied_out) = input_staging.as_mut().expect("made above");
                // waits for the last copy out of it (an event of our own: cudarc records one
                // only while it tracks buffer uses)
                if let Some(event) = copied_out.take() {
                    event.synchronize()?;
                }
                legion_ops::backend::fill_host_batch((staging.as_mut_slice()?, &mut []), host, &[]);
                stream.memcpy_htod(staging, dst)?;
                *copied_out = Some(stream.record_event(None)?);
                return Ok(());
            }
            let staged = s.stream.clone_htod(host)?;
            let tile = Box4::of(tile);
            self.region_f32(
                s,
                &self.kernels.copy_region_f32,
                &staged,
                tile,
                dst,
                y_layout,
                tile,
            )
        });
    }

    fn copy(&self, s: &mut Stream, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "copy", |s| {
            let (src, dst) = (x.mem.f32(), y.mem.f32_mut());
            assert_eq!(
                src.len(),
                dst.len(),
                "copy between buffers of different sizes"
            );
            s.stream.memcpy_dtod(src, dst)?;
            Ok(())
        });
    }

    fn conv2d_forward(
        &self,
        s: &mut Stream,
        op: &Conv2d,
        in_shape: Shape,
        x: In<Buffer>,
        w: In<Buffer>,
        b: Option<In<Buffer>>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "conv2d_forward", |s| {
            crate::conv::forward(self, s, op, in_shape, x, w, b, y)
        });
    }

    fn conv2d_backward(
        &self,
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
    ) {
        self.enqueue(s, "conv2d_backward", |s| {
            crate::conv::backward(self, s, op, in_shape, x, w, y, dy, dx, dw, db)
        });
    }

    fn dense_forward(
        &self,
        s: &mut Stream,
        op: &Dense,
        x: In<Buffer>,
        w: In<Buffer>,
        b: Option<In<Buffer>>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "dense_forward", |s| {
            crate::dense::forward(self, s, op, x, w, b, y)
        });
    }

    fn dense_backward(
        &self,
        s: &mut Stream,
        op: &Dense,
        x: In<Buffer>,
        w: In<Buffer>,
        y: In<Buffer>,
        dy: In<Buffer>,
        dx: Option<Out<Buffer>>,
        dw: Out<Buffer>,
        db: Option<Out<Buffer>>,
    ) {
        self.enqueue(s, "dense_backward", |s| {
            crate::dense::backward(self, s, op, x, w, y, dy, dx, dw, db)
        });
    }

    fn pool2d_forward(
        &self,
        s: &mut Stream,
        op: &Pool2d,
        in_shape: Shape,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "pool2d_forward", |s| {
            let tile = Box4::of(&y.rect);
            let n = tile.volume();
            if n == 0 {
                return Ok(());
            }
            let x_layout = Box4::of(&x.rect);
            let pool = PoolParams::new(op, in_shape);
            let mut b = s.stream.launch_builder(&self.kernels.pool2d_forward);
            b.arg(x.mem.f32())
                .arg(&x_layout)
                .arg(y.mem.f32_mut())
                .arg(&tile)
                .arg(&pool)
                .arg(&n);
            // SAFETY: the arguments match the kernel's signature; x contains the tile's windows.
            unsafe { b.launch(grid(n)) }?;
            Ok(())
        });
    }

    fn pool2d_backward(
        &self,
        s: &mut Stream,
        op: &Pool2d,
        in_shape: Shape,
        x: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        self.enqueue(s, "pool2d_backward", |s| {
            assert_eq!(dx.rect, x.rect, "dx must cover the input view");
            let x_layout = Box4::of(&x.rect);
            let n = x_layout.volume();
            if n == 0 {
                return Ok(());
            }
            let tile = Box4::of(&dy.rect);
            let pool = PoolParams::new(op, in_shape);
            // Max pooling: each window's argmax first, once per output (average pooling reads
            // none; the kernel is given a one-element buffer it never reads).
            let outputs = match op.kind {
                PoolKind::Max => tile.volume().max(0),
                PoolKind::Avg => 0,
            };
            // SAFETY: the argmax kernel writes every element before the gather reads it.
            let mut argmax = unsafe { s.stream.alloc::<i64>(outputs.max(1) as usize) }?;
            if outputs > 0 {
                let mut b = s.stream.launch_builder(&self.kernels.pool2d_argmax);
                b.arg(x.mem.f32())
                    .arg(&x_layout)
                    .arg(&tile)
                    .arg(&mut argmax)
                    .arg(&pool)
                    .arg(&outputs);
                // SAFETY: the arguments match the kernel's signature; argmax covers the tile.
                unsafe { b.launch(grid(outputs)) }?;
            }
            let mut b = s.stream.launch_builder(&self.kernels.pool2d_backward);
            b.arg(&argmax)
                .arg(&x_layout)
                .arg(dy.mem.f32())
                .arg(&tile)
                .arg(dx.mem.f32_mut())
                .arg(&pool)
                .arg(&n);
            // SAFETY: the arguments match the kernel's signature; dx is laid out like x.
            unsafe { b.launch(grid(n)) }?;
            Ok(())
        });
    }

    fn relu_forward(&self, s: &mut Stream, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "relu_forward", |s| {
            self.unary(s, &self.kernels.relu_forward, x, y)
        });
    }

    fn relu_backward(&self, s: &mut Stream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        self.enqueue(s, "relu_backward", |s| {
            self.binary(s, &self.kernels.relu_backward, y, dy, dx)
        });
    }

    fn sigmoid_forward(&self, s: &mut Stream, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "sigmoid_forward", |s| {
            self.unary(s, &self.kernels.sigmoid_forward, x, y)
        });
    }

    fn sigmoid_backward(&self, s: &mut Stream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        self.enqueue(s, "sigmoid_backward", |s| {
            self.binary(s, &self.kernels.sigmoid_backward, y, dy, dx)
        });
    }

    fn tanh_forward(&self, s: &mut Stream, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "tanh_forward", |s| {
            self.unary(s, &self.kernels.tanh_forward, x, y)
        });
    }

    fn tanh_backward(&self, s: &mut Stream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        self.enqueue(s, "tanh_backward", |s| {
            self.binary(s, &self.kernels.tanh_backward, y, dy, dx)
        });
    }

    fn add_forward(&self, s: &mut Stream, a: In<Buffer>, b: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "add_forward", |s| {
            self.binary(s, &self.kernels.add_forward, a, b, y)
        });
    }

    fn add_backward(
        &self,
        s: &mut Stream,
        dy: In<Buffer>,
        da: Option<Out<Buffer>>,
        db: Option<Out<Buffer>>,
    ) {
        self.enqueue(s, "add_backward", |s| {
            for grad in [da, db].into_iter().flatten() {
                let layout = Box4::of(&grad.rect);
                let f = &self.kernels.copy_region_f32;
                self.region_f32(
                    s,
                    f,
                    dy.mem.f32(),
                    Box4::of(&dy.rect),
                    grad.mem.f32_mut(),
                    layout,
                    layout,
                )?;
            }
            Ok(())
        });
    }

    fn concat_forward(
        &self,
        s: &mut Stream,
        input_shapes: &[Shape],
        xs: &[Option<In<Buffer>>],
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "concat_forward", |s| {
            if y.rect.is_empty() {
                return Ok(());
            }
            let slices = Concat::default().project(input_shapes, &y.rect);
            let offsets = Concat::offsets(input_shapes);
            let y_layout = Box4::of(&y.rect);
            let dst = y.mem.f32_mut();
            for ((x, slice), &offset) in xs.iter().zip(&slices).zip(&offsets) {
                if slice.is_empty() {
                    continue;
                }
                let x = x.expect("concat input the tile reads was not given");
                let offset = offset as i64;
                let src_layout = Box4::of(&x.rect).shifted(1, offset);
                let region = Box4::of(slice).shifted(1, offset);
                let f = &self.kernels.copy_region_f32;
                self.region_f32(s, f, x.mem.f32(), src_layout, dst, y_layout, region)?;
            }
            Ok(())
        });
    }

    fn concat_backward(
        &self,
        s: &mut Stream,
        input_shapes: &[Shape],
        dy: In<Buffer>,
        dxs: Vec<Option<Out<Buffer>>>,
    ) {
        self.enqueue(s, "concat_backward", |s| {
            let offsets = Concat::offsets(input_shapes);
            for (dx, &offset) in dxs.into_iter().zip(&offsets) {
                let Some(dx) = dx else { continue };
                // the gradient's own rect, moved to where its input sits in the output
                let layout = Box4::of(&dx.rect).shifted(1, offset as i64);
                let f = &self.kernels.copy_region_f32;
                self.region_f32(
                    s,
                    f,
                    dy.mem.f32(),
                    Box4::of(&dy.rect),
                    dx.mem.f32_mut(),
                    layout,
                    layout,
                )?;
            }
            Ok(())
        });
    }

    fn dropout_forward(&self, s: &mut Stream, mask: &DropoutMask, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "dropout_forward", |s| self.dropout(s, mask, x, y));
    }

    fn dropout_backward(
        &self,
        s: &mut Stream,
        mask: &DropoutMask,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        self.enqueue(s, "dropout_backward", |s| self.dropout(s, mask, dy, dx));
    }

    fn softmax_ce_forward(
        &self,
        s: &mut Stream,
        logits: In<Buffer>,
        labels: &[u32],
        y: Out<Buffer>,
    ) -> Result<PendingLoss, KernelError> {
        Self::check_loss_tile(&logits.rect, labels, &y.rect, 1);
        let classes = logits.rect.hi[1];
        let first_row = y.rect.lo[0];
        let mut pending = PendingLoss { totals: None };
        let mut label_error = None;
        self.enqueue(s, "softmax_ce_forward", |s| {
            let rows = y.rect.extent(0) as i64;
            let labels = match self.labels(s, labels, first_row, classes) {
                Ok(uploaded) => uploaded?,
                Err(e) => {
                    label_error = Some(e);
                    return Ok(());
                }
            };
            let mut totals = s.stream.alloc_zeros::<f64>(2)?;
            if rows > 0 {
                let mut correct = s.stream.alloc_zeros::<u32>(rows as usize)?;
                let (logits_row0, classes, row0) =
                    (logits.rect.lo[0] as i64, classes as i64, first_row as i64);
                let loss = y.mem.f32_mut();
                let mut b = s.stream.launch_builder(&self.kernels.softmax_ce_rows);
                b.arg(logits.mem.f32()).arg(&logits_row0).arg(&classes);
                labels.push(&mut b);
                b.arg(&row0).arg(&rows).arg(&mut *loss).arg(&mut correct);
                // SAFETY: the arguments match the kernel's signature; rows lie in the logits.
                unsafe { b.launch(softmax_rows(rows)) }?;
                let mut b = s.stream.launch_builder(&self.kernels.loss_totals);
                b.arg(&*loss).arg(&correct).arg(&rows).arg(&mut totals);
                // SAFETY: as above; one block of REDUCE_THREADS threads.
                unsafe { b.launch(per_channel(1)) }?;
            }
            pending.totals = Some(totals);
            Ok(())
        });
        if let Some(e) = label_error {
            return Err(e.into());
        }
        match (&s.failure, pending.totals.is_some()) {
            (Some(failure), _) => Err(KernelError::Device(failure.clone())),
            (None, _) => Ok(pending),
        }
    }

    fn softmax_ce_backward(
        &self,
        s: &mut Stream,
        logits: In<Buffer>,
        labels: &[u32],
        scale: f32,
        dlogits: Out<Buffer>,
    ) -> Result<(), KernelError> {
        let classes = logits.rect.hi[1];
        Self::check_loss_tile(&logits.rect, labels, &dlogits.rect, classes);
        let first_row = dlogits.rect.lo[0];
        let mut label_error = None;
        self.enqueue(s, "softmax_ce_backward", |s| {
            let rows = dlogits.rect.extent(0) as i64;
            let labels = match self.labels(s, labels, first_row, classes) {
                Ok(uploaded) => uploaded?,
                Err(e) => {
                    label_error = Some(e);
                    return Ok(());
                }
            };
            if rows == 0 {
                return Ok(());
            }
            let (logits_row0, classes, row0) =
                (logits.rect.lo[0] as i64, classes as i64, first_row as i64);
            let mut b = s.stream.launch_builder(&self.kernels.softmax_ce_backward);
            b.arg(logits.mem.f32()).arg(&logits_row0).arg(&classes);
            labels.push(&mut b);
            b.arg(&row0)
                .arg(&rows)
                .arg(&scale)
                .arg(dlogits.mem.f32_mut());
            // SAFETY: the arguments match the kernel's signature; rows lie in the logits.
            unsafe { b.launch(softmax_rows(rows)) }?;
            Ok(())
        });
        if let Some(e) = label_error {
            return Err(e.into());
        }
        match &s.failure {
            Some(failure) => Err(KernelError::Device(failure.clone())),
            None => Ok(()),
        }
    }

    fn bn_moments(&self, s: &mut Stream, x: In<Buffer>, tile: &Rect, moments: Out<Buffer>) {
        self.enqueue(s, "bn_moments", |s| {
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
            let (count, parts) = channel_parts(&tile_box)?;
            // SAFETY: the first kernel writes every partial sum before the second reads it.
            let mut partial = unsafe { s.stream.alloc::<f64>((2 * parts * channels) as usize) }?;
            let mut b = s.stream.launch_builder(&self.kernels.bn_moments);
            b.arg(x.mem.f32())
                .arg(&x_layout)
                .arg(&tile_box)
                .arg(&parts)
                .arg(&mut partial);
            // SAFETY: the arguments match the kernel's signature; x contains the tile, and a
            // block of each part of each channel writes its two partial sums.
            unsafe { b.launch(per_channel(channels * parts)) }?;
            let mut b = s.stream.launch_builder(&self.kernels.bn_sums_finish);
            b.arg(&partial)
                .arg(&parts)
                .arg(&channels)
                .arg(&count)
                .arg(moments.mem.f64_mut());
            // SAFETY: as above; the moments are [3, channels].
            unsafe { b.launch(grid(channels)) }?;
            Ok(())
        });
    }

    fn bn_normalize(
        &self,
        s: &mut Stream,
        op: &BatchNorm,
        x: In<Buffer>,
        moments: In<Buffer>,
        gamma: In<Buffer>,
        beta: In<Buffer>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "bn_normalize", |s| {
            let tile = Box4::of(&y.rect);
            let n = tile.volume();
            if n == 0 {
                return Ok(());
            }
            let x_layout = Box4::of(&x.rect);
            let packed = (x_layout == tile) as i32;
            let (m_lo, m_channels) = sums_range(&moments);
            let (gamma_lo, beta_lo) = (gamma.rect.lo[0] as i64, beta.rect.lo[0] as i64);
            let relu = op.relu as i32;
            let (c_lo, channels) = (tile.lo[1], tile.ext[1]);
            // SAFETY: bn_affine writes every coefficient before bn_normalize reads it.
            let mut coef = unsafe { s.stream.alloc::<f32>(3 * channels as usize) }?;
            let mut b = s.stream.launch_builder(&self.kernels.bn_affine);
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
            let mut b = s.stream.launch_builder(&self.kernels.bn_normalize);
            b.arg(x.mem.f32())
                .arg(&x_layout)
                .arg(y.mem.f32_mut())
                .arg(&tile)
                .arg(&coef)
                .arg(&relu)
                .arg(&n)
                .arg(&packed);
            // SAFETY: as above; the coefficients cover the tile's channels.
            unsafe { b.launch(grid(n)) }?;
            Ok(())
        });
    }

    fn bn_running(
        &self,
        s: &mut Stream,
        op: &BatchNorm,
        moments: In<Buffer>,
        running_mean: Out<Buffer>,
        running_var: Out<Buffer>,
    ) {
        self.enqueue(s, "bn_running", |s| {
            let (m_lo, m_channels) = sums_range(&moments);
            if m_channels == 0 {
                return Ok(());
            }
            let (mean_lo, var_lo) = (
                running_mean.rect.lo[0] as i64,
                running_var.rect.lo[0] as i64,
            );
            let mut b = s.stream.launch_builder(&self.kernels.bn_running);
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
        });
    }

    fn bn_grad_sums(
        &self,
        s: &mut Stream,
        op: &BatchNorm,
        x: In<Buffer>,
        y: Option<In<Buffer>>,
        dy: In<Buffer>,
        moments: In<Buffer>,
        tile: &Rect,
        dgamma: Out<Buffer>,
        dbeta: Out<Buffer>,
        grad_sums: Out<Buffer>,
    ) {
        self.enqueue(s, "bn_grad_sums", |s| {
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
            let (count, parts) = channel_parts(&tile_box)?;
            // SAFETY: the first kernel writes every partial sum before the second reads it.
            let mut partial = unsafe { s.stream.alloc::<f64>((2 * parts * channels) as usize) }?;
            let mut b = s.stream.launch_builder(&self.kernels.bn_grad_sums);
            b.arg(x.mem.f32()).arg(&x_layout);
            match &y {
                Some(y) => b.arg(y.mem.f32()),
                None => b.arg(&NULL),
            };
            b.arg(&y_layout)
                .arg(dy.mem.f32())
                .arg(&dy_layout)
                .arg(&tile_box)
                .arg(moments.mem.f64())
                .arg(&m_lo)
                .arg(&m_channels)
                .arg(&op.eps)
                .arg(&parts)
                .arg(&mut partial);
            // SAFETY: the arguments match the kernel's signature; the views contain the tile,
            // and a block of each part of each channel writes its two partial sums.
            unsafe { b.launch(per_channel(channels * parts)) }?;
            let c_lo = tile_box.lo[1];
            let mut b = s.stream.launch_builder(&self.kernels.bn_grad_sums_finish);
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
        });
    }

    fn bn_input_grad(
        &self,
        s: &mut Stream,
        op: &BatchNorm,
        x: In<Buffer>,
        y: Option<In<Buffer>>,
        dy: In<Buffer>,
        moments: In<Buffer>,
        gamma: In<Buffer>,
        grad_sums: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        self.enqueue(s, "bn_input_grad", |s| {
            let tile = Box4::of(&dx.rect);
            let n = tile.volume();
            if n == 0 {
                return Ok(());
            }
            let (x_layout, dy_layout) = (Box4::of(&x.rect), Box4::of(&dy.rect));
            let y_layout = y.map_or(tile, |y| Box4::of(&y.rect));
            let packed = (x_layout == tile && dy_layout == tile && y_layout == tile) as i32;
            let (m_lo, m_channels) = sums_range(&moments);
            let (s_lo, s_channels) = sums_range(&grad_sums);
            let gamma_lo = gamma.rect.lo[0] as i64;
            let (c_lo, channels) = (tile.lo[1], tile.ext[1]);
            // SAFETY: bn_input_coef writes every coefficient before bn_input_grad reads it.
            let mut coef = unsafe { s.stream.alloc::<f32>(5 * channels as usize) }?;
            let mut b = s.stream.launch_builder(&self.kernels.bn_input_coef);
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
            let mut b = s.stream.launch_builder(&self.kernels.bn_input_grad);
            b.arg(x.mem.f32()).arg(&x_layout);
            match &y {
                Some(y) => b.arg(y.mem.f32()),
                None => b.arg(&NULL),
            };
            b.arg(&y_layout)
                .arg(dy.mem.f32())
                .arg(&dy_layout)
                .arg(dx.mem.f32_mut())
                .arg(&tile)
                .arg(&coef)
                .arg(&n)
                .arg(&packed);
            // SAFETY: the arguments match the kernel's signature; the views contain the tile.
            unsafe { b.launch(grid(n)) }?;
            Ok(())
        });
    }

    fn sgd_update(
        &self,
        s: &mut Stream,
        sgd: &Sgd,
        grad: In<Buffer>,
        w: Out<Buffer>,
        velocity: Out<Buffer>,
    ) {
        self.enqueue(s, "sgd_update", |s| {
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
            let mut b = s.stream.launch_builder(&self.kernels.sgd_update);
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
        });
    }
}

/// One warp per sample row.
fn softmax_rows(rows: i64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (rows as u64).div_ceil(WARP_ROWS_PER_BLOCK as u64) as u32,
            1,
            1,
        ),
        block_dim: (WARP_ROWS_PER_BLOCK * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Cuda {
    /// `y = x·mask/(1 − rate)` over `y.rect`, the mask drawn as kernels::dropout draws it.
    fn dropout(&self, s: &Stream, mask: &DropoutMask, x: In<Buffer>, y: Out<Buffer>) -> Launch {
        assert!(
            (0.0..1.0).contains(&mask.rate),
            "dropout rate {} must be in [0, 1)",
            mask.rate
        );
        let full_rect = mask.shape.full_rect();
        assert!(
            full_rect.contains(&y.rect),
            "tile {} lies outside the tensor {}",
            y.rect,
            mask.shape
        );
        let tile = Box4::of(&y.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        // hash folds its words left to right: the per-step prefix once, the index in the kernel
        let key = rng::hash(&[mask.seed, mask.step, mask.layer_salt]);
        let (x_layout, full) = (Box4::of(&x.rect), Box4::of(&full_rect));
        let scale = mask.keep_scale();
        let mut b = s.stream.launch_builder(&self.kernels.dropout_apply);
        b.arg(x.mem.f32())
            .arg(&x_layout)
            .arg(y.mem.f32_mut())
            .arg(&tile)
            .arg(&full)
            .arg(&key)
            .arg(&mask.rate)
            .arg(&scale)
            .arg(&n);
        // SAFETY: the arguments match the kernel's signature; x contains the tile.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device actor owns its streams and buffers and shares the backend: checked at compile time.
    #[test]
    fn backend_streams_and_buffers_can_move_between_threads() {
        fn shared<T: Send + Sync>() {}
        fn owned<T: Send>() {}
        shared::<Cuda>();
        owned::<Stream>();
        owned::<Buffer>();
        owned::<PendingLoss>();
    }
}
