//! [`Cuda`]: `legion_ops::backend::Backend` on one GPU.
//!
//! Primitives only enqueue work on the caller's [`Stream`]. The trait gives most primitives no
//! error channel, so a failure to enqueue (out of memory, a failed launch, a cuDNN status) is kept
//! on the stream, later work on that stream is skipped, and [`Backend::synchronize`] reports the
//! first failure. Host syncs that cudarc or the driver force are named where they happen: uploads
//! from pageable host memory (`load_images`, the labels of the loss kernels) return once the driver
//! has staged the data, which waits for the stream; downloads wait for the copy.
//!
//! This file holds the backend itself (its settings, its start and the failure a stream keeps) and
//! the whole `impl Backend for Cuda`, one place to read every primitive. The primitives enqueue
//! work written beside it by concern: [`crate::memory`] (buffers, streams, host copies),
//! [`crate::regions`] (region moves), [`crate::launch`] (launch shapes) and a file per kernel
//! family: `conv`, `dense`, `pool2d`, `concat`, `softmax_ce`, `batch_norm`, `elementwise`, `sgd`.

use crate::algos::{ConvAlgos, ConvEpilogue};
use crate::kernels::{CompileError, Kernels};
use crate::launch::Box4;
use crate::memory::{Bf16, Buffer, Stream, keep_freed_memory_pooled};
use crate::probe::ProbeError;
use crate::softmax_ce::PendingLoss;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use legion_ops::backend::cpu;
use legion_ops::backend::{Backend, DType, In, KernelError, LossSums, Out, Pipeline};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::kernels::mul::is_channel_scale;
use legion_ops::op::{BatchNorm, Conv2d, Dense, PoolWindows, UnaryOp};
use legion_ops::precision::Precision;
use legion_ops::shape::{Rect, Shape};
use legion_ops::train::Sgd;
use std::sync::Arc;

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
    /// Mixed precision (`--precision bf16`, the rules in `legion_ops::precision`): convolutions
    /// and dense products on bf16 operands on the tensor cores with fp32 accumulation,
    /// activations and their gradients stored in bf16, everything else fp32. The element-wise
    /// kernels compute in fp32 between a bf16 load and a bf16 store.
    Bf16,
}

impl Math {
    /// The precision a stream of this math computes in.
    pub fn precision(self) -> Precision {
        match self {
            Math::StrictFp32 => Precision::Fp32,
            Math::Tf32 => Precision::Tf32,
            Math::Bf16 => Precision::Bf16,
        }
    }
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
    pub conv_epilogue: ConvEpilogue,
    pub sharing: Sharing,
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
    /// bf16 convolutions and products (bf16 data with fp32 accumulation) need compute
    /// capability 8.0 (Ampere) or later.
    #[error(
        "CUDA device {ordinal} has compute capability {major}.{minor}: --precision bf16 needs 8.0 \
         or later (A100, H100, ...); use --precision fp32 or tf32"
    )]
    Bf16Unsupported {
        ordinal: usize,
        major: i32,
        minor: i32,
    },
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

impl Cuda {
    /// The backend on GPU `ordinal` with the default [`Settings`]: checks the libraries first
    /// (see [`crate::probe`](mod@crate::probe)), then creates the context and loads the kernels (compiled once per
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
        if settings.math == Math::Bf16 {
            let (major, minor) = context.compute_capability().map_err(device_error)?;
            if major < 8 {
                return Err(StartError::Bf16Unsupported {
                    ordinal,
                    major,
                    minor,
                });
            }
        }
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

    /// Where this backend's convolutions apply their bias and ReLU.
    pub fn conv_epilogue(&self) -> ConvEpilogue {
        self.settings.conv_epilogue
    }

    /// The arithmetic of this backend's streams.
    pub fn math(&self) -> Math {
        self.settings.math
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
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
}

impl Backend for Cuda {
    type Buffer = Buffer;
    type Stream = Stream;
    type Loss = PendingLoss;
    type Marker = crate::staging::Marker;

    fn precision(&self) -> Precision {
        self.settings.math.precision()
    }

    /// A zeroed buffer of `len` elements.
    fn alloc_zeros(&self, s: &mut Stream, dtype: DType, len: usize) -> Result<Buffer, KernelError> {
        let out = match dtype {
            DType::F32 => s.stream.alloc_zeros::<f32>(len).map(Buffer::F32),
            DType::F64 => s.stream.alloc_zeros::<f64>(len).map(Buffer::F64),
            DType::Bf16 => s.stream.alloc_zeros::<Bf16>(len).map(Buffer::Bf16),
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
                // SAFETY: `bytes` bytes at `ptr` belong to `out`; all-ones bytes are NaN in every
                // element type.
                unsafe {
                    cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream())
                }?;
            }
            Ok(out)
        }
        let out = match dtype {
            DType::F32 => fresh::<f32>(&s.stream, len).map(Buffer::F32),
            DType::F64 => fresh::<f64>(&s.stream, len).map(Buffer::F64),
            DType::Bf16 => fresh::<Bf16>(&s.stream, len).map(Buffer::Bf16),
        };
        out.map_err(|e| KernelError::Device(format!("alloc {len} × {dtype:?}: {e}")))
    }

    /// A device copy of a host buffer. Returns once the driver has staged the host data (a
    /// pageable copy waits for the stream).
    fn upload(&self, s: &mut Stream, host: &cpu::Buffer) -> Result<Buffer, KernelError> {
        let out = match host {
            cpu::Buffer::F32(v) => s.stream.clone_htod(v).map(Buffer::F32),
            cpu::Buffer::F64(v) => s.stream.clone_htod(v).map(Buffer::F64),
            cpu::Buffer::Bf16(v) => {
                let bits: Vec<Bf16> = v.iter().map(|&b| Bf16(b)).collect();
                s.stream.clone_htod(&bits).map(Buffer::Bf16)
            }
        };
        out.map_err(|e| KernelError::Device(format!("upload: {e}")))
    }

    /// The buffer's contents on the host, once everything enqueued before on `s` has run (bf16
    /// as its bits: `cpu::Buffer::to_f32` reads their values).
    fn download(&self, s: &mut Stream, buffer: &Buffer) -> Result<cpu::Buffer, KernelError> {
        let out = match buffer {
            Buffer::F32(d) => s.stream.clone_dtoh(d).map(cpu::Buffer::F32),
            Buffer::F64(d) => s.stream.clone_dtoh(d).map(cpu::Buffer::F64),
            Buffer::Bf16(d) => s
                .stream
                .clone_dtoh(d)
                .map(|v| cpu::Buffer::Bf16(v.into_iter().map(|b| b.0).collect())),
        };
        out.map_err(|e| KernelError::Device(format!("download: {e}")))
    }

    fn cast(&self, s: &mut Stream, from: In<Buffer>, to: Out<Buffer>) {
        assert_eq!(from.rect, to.rect, "cast converts buffers over one rect");
        self.enqueue(s, "cast", |s| self.cast_slices(s, from.mem, to.mem));
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
        Cuda::zero_rect(self, s, to.mem, &to.rect, rect);
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

    /// Waits on the marker's event, not the stream: work enqueued after it runs on.
    fn wait_for(&self, s: &mut Stream, marker: &crate::staging::Marker) -> Result<(), KernelError> {
        let waited = marker.wait();
        if let Some(failure) = &s.failure {
            return Err(KernelError::Device(failure.clone()));
        }
        waited?;
        self.context
            .check_err()
            .map_err(|e| KernelError::Device(format!("CUDA: {e}")))
    }

    fn read_loss(&self, loss: PendingLoss) -> LossSums {
        self.read_loss_of(loss)
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
            crate::memory::load_images(self, s, images, held, tile, y)
        });
    }

    fn copy(&self, s: &mut Stream, x: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "copy", |s| {
            assert_eq!(
                x.mem.len(),
                y.mem.len(),
                "copy between buffers of different sizes"
            );
            match (x.mem, y.mem) {
                (Buffer::F32(src), Buffer::F32(dst)) => s.stream.memcpy_dtod(src, dst)?,
                (Buffer::Bf16(src), Buffer::Bf16(dst)) => s.stream.memcpy_dtod(src, dst)?,
                (src, dst) => panic!(
                    "copy from {:?} to {:?}: a reshape keeps the element type",
                    src.dtype(),
                    dst.dtype()
                ),
            }
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
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "pool2d_forward", |s| {
            crate::pool2d::forward(self, s, op, in_shape, x, y)
        });
    }

    fn pool2d_backward(
        &self,
        s: &mut Stream,
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        self.enqueue(s, "pool2d_backward", |s| {
            crate::pool2d::backward(self, s, op, in_shape, x, dy, dx)
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

    fn unary_forward(&self, s: &mut Stream, op: UnaryOp, x: In<Buffer>, y: Out<Buffer>) {
        let (name, _) = op.op.kernel_names();
        let kernel = &self.kernels.unary(op.op).forward;
        self.enqueue(s, name, |s| {
            self.unary_with(s, kernel, x, y, Some(op.alpha()))
        });
    }

    fn unary_backward(
        &self,
        s: &mut Stream,
        op: UnaryOp,
        read: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        let (_, name) = op.op.kernel_names();
        let kernel = &self.kernels.unary(op.op).backward;
        self.enqueue(s, name, |s| {
            self.binary_with(s, kernel, read, dy, dx, Some(op.alpha()))
        });
    }

    fn add_forward(&self, s: &mut Stream, a: In<Buffer>, b: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "add_forward", |s| {
            self.binary(s, &self.kernels.add_forward, a, b, y)
        });
    }

    fn mul_forward(&self, s: &mut Stream, x: In<Buffer>, scale: In<Buffer>, y: Out<Buffer>) {
        self.enqueue(s, "mul_forward", |s| {
            self.binary(s, &self.kernels.mul_forward, x, scale, y)
        });
    }

    fn mul_backward(
        &self,
        s: &mut Stream,
        tile: &Rect,
        x: In<Buffer>,
        scale: In<Buffer>,
        dy: In<Buffer>,
        dx: Option<Out<Buffer>>,
        dscale: Option<Out<Buffer>>,
    ) {
        self.enqueue(s, "mul_backward", |s| {
            if let Some(dx) = dx {
                self.binary(s, &self.kernels.mul_forward, dy, scale, dx)?;
            }
            match dscale {
                Some(ds) if is_channel_scale(&ds.rect) => self.mul_scale_grad(s, tile, x, dy, ds),
                Some(ds) => self.binary(s, &self.kernels.mul_forward, dy, x, ds),
                None => Ok(()),
            }
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
                self.move_region(
                    s,
                    false,
                    dy.mem,
                    Box4::of(&dy.rect),
                    grad.mem,
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
            crate::concat::forward(self, s, input_shapes, xs, y)
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
            crate::concat::backward(self, s, input_shapes, dy, dxs)
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
        crate::softmax_ce::forward(self, s, logits, labels, y)
    }

    fn softmax_ce_backward(
        &self,
        s: &mut Stream,
        logits: In<Buffer>,
        labels: &[u32],
        scale: f32,
        dlogits: Out<Buffer>,
    ) -> Result<(), KernelError> {
        crate::softmax_ce::backward(self, s, logits, labels, scale, dlogits)
    }

    fn bn_moments(&self, s: &mut Stream, x: In<Buffer>, tile: &Rect, moments: Out<Buffer>) {
        self.enqueue(s, "bn_moments", |s| {
            crate::batch_norm::moments(self, s, x, tile, moments)
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
            crate::batch_norm::normalize(self, s, op, x, moments, gamma, beta, y)
        });
    }

    fn bn_infer(
        &self,
        s: &mut Stream,
        op: &BatchNorm,
        x: In<Buffer>,
        gamma: In<Buffer>,
        beta: In<Buffer>,
        running_mean: In<Buffer>,
        running_var: In<Buffer>,
        y: Out<Buffer>,
    ) {
        self.enqueue(s, "bn_infer", |s| {
            crate::batch_norm::infer(self, s, op, x, gamma, beta, running_mean, running_var, y)
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
            crate::batch_norm::running(self, s, op, moments, running_mean, running_var)
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
            crate::batch_norm::grad_sums(
                self, s, op, x, y, dy, moments, tile, dgamma, dbeta, grad_sums,
            )
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
            crate::batch_norm::input_grad(self, s, op, x, y, dy, moments, gamma, grad_sums, dx)
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
            crate::sgd::update(self, s, sgd, grad, w, velocity)
        });
    }
}

impl Pipeline for Cuda {
    type Staged = crate::batches::StagedBatch;

    fn send_loss_home(
        &self,
        s: &mut Stream,
        loss: PendingLoss,
    ) -> Result<PendingLoss, KernelError> {
        self.send_loss_home_on(s, loss)
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

    fn begin_synthetic(
        &self,
        s: &mut Stream,
        batch: &legion_ops::data::SyntheticBatch,
    ) -> Result<crate::batches::HostBatch, KernelError> {
        self.begin_synthetic_on(s, batch)
    }

    fn finish_synthetic(
        &self,
        s: &mut Stream,
        host: crate::batches::HostBatch,
        batch: &legion_ops::data::SyntheticBatch,
    ) -> Result<crate::batches::StagedBatch, KernelError> {
        self.finish_synthetic_on(s, host, batch)
    }

    fn recycle_staged(&self, s: &mut Stream, images: Buffer) {
        match images {
            Buffer::F32(images) => self.recycle_staged_on(s, images),
            other => panic!("a batch's images are f32, not {:?}", other.dtype()),
        }
    }

    type Graph = crate::capture::StepGraph;

    fn fix_step(
        &self,
        s: &mut Stream,
        step: u64,
        images: In<Buffer>,
        fixed: Out<Buffer>,
    ) -> Result<(), KernelError> {
        self.fix_step_on(s, step, images, fixed)
    }

    fn begin_capture(&self, s: &mut Stream) -> Result<(), KernelError> {
        self.begin_capture_on(s)
    }

    fn end_capture(&self, s: &mut Stream) -> Result<crate::capture::StepGraph, KernelError> {
        self.end_capture_on(s)
    }

    fn abandon_capture(&self, s: &mut Stream) {
        self.abandon_capture_on(s);
    }

    fn replay(
        &self,
        s: &mut Stream,
        graph: &crate::capture::StepGraph,
    ) -> Result<Vec<PendingLoss>, KernelError> {
        self.replay_on(s, graph)
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
        owned::<crate::capture::StepGraph>();
    }
}
