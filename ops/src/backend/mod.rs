//! The kernel seam: how an op's forward, backward and optimizer update run on a device's memory.
//!
//! Three layers, each knowing one thing:
//! - **The op** (`crate::op::*`, one file per op) knows which operands each of its phases reads and
//!   writes, and which [`Backend`] primitive computes it (`Op::run`).
//! - **A backend** (one folder per device kind: [`cpu`], later CUDA) implements the primitives on
//!   its own memory ([`Backend::Buffer`]) and enqueues them on an in-order [`Backend::Stream`].
//! - **A driver** (the single-device reference trainer in `crate::train`, the runtime's executor)
//!   decides which tile and which buffers a call gets, as a [`KernelCall`], and synchronizes the
//!   stream before it reads results back.
//!
//! A GPU backend returns from a primitive once the work is enqueued: nothing a primitive returns may
//! be read before [`Backend::synchronize`]. The loss is therefore a [`Backend::Loss`], redeemed
//! with [`Backend::read_loss`] after the stream has synchronized, or, sent home first
//! ([`Pipeline::send_loss_home`]), once the stream has passed a marker behind it
//! ([`Backend::wait_for`]) while later work still runs. The CPU backend runs each primitive when
//! it is called, so its stream is a marker and synchronizing is free.

pub mod cpu;
mod pipeline;

use crate::graph::{Graph, LayerId};
use crate::kernels::dropout::DropoutMask;
use crate::op::{BatchNorm, Conv2d, Dense, PoolWindows};
use crate::precision::Precision;
use crate::shape::{Rect, Shape};
use crate::train::Sgd;
use std::fmt;
use std::ops::Range;

pub use crate::kernels::softmax_ce::LabelOutOfRange;
pub use pipeline::Pipeline;

/// What an operand is to a kernel: the argument slots of an op's phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The layer's `k`-th input activation.
    Input(u8),
    /// The layer's output activation.
    Output,
    /// The gradient w.r.t. the layer's output.
    OutputGrad,
    /// The gradient w.r.t. the layer's `k`-th input.
    InputGrad(u8),
    /// The layer's `k`-th parameter (or buffer).
    Param(u8),
    ParamGrad(u8),
    Velocity(u8),
    /// Batch-norm forward sums of the tile's channels.
    Moments,
    /// Batch-norm backward sums of the tile's channels.
    GradSums,
}

/// Which of a layer's kernels runs. Batch norm is split in phases so that its statistics can be
/// reduced over the whole batch between them (see `crate::kernels::batch_norm`); every other op has
/// one forward and one backward phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Forward,
    Backward,
    /// The forward of inference: batch norm normalises with its running statistics (`Param(2)`,
    /// `Param(3)`) and updates nothing, dropout passes its input through; every other op runs
    /// its forward.
    Infer,
    /// Batch norm forward 1: per-channel sums of the tile (`Moments`, `[3, C]` f64).
    BnMoments,
    /// Batch norm forward 2: normalise with the whole-batch statistics.
    BnNormalize,
    /// Batch norm: update the running statistics of a channel slice.
    BnRunning,
    /// Batch norm backward 1: the tile's γ/β gradients and per-channel sums (`GradSums`).
    BnGradSums,
    /// Batch norm backward 2: the input gradient from the whole-batch sums.
    BnInputGrad,
    /// SGD with momentum on one parameter's slice.
    Update {
        param: u8,
    },
    /// A reduction split's partial (conv2d, dense): the tile's output block summed over one block
    /// of the input channels (`Input(0)` and `Param(0)` cut to it), without the activation; the
    /// bias (`Param(1)`) added by the first partial only. Written as `Output`, a partial sum.
    PartialForward,
    /// The activation of a block whose partials were summed (`Input(0)`) into `Output`.
    Finish,
    /// The gradient before the activation (`InputGrad(0)`), from `Output` and `OutputGrad`.
    FinishBackward,
    /// A partial's gradients from the block's gradient before the activation (`OutputGrad`): the
    /// weight's (`ParamGrad(0)`, its channel block), the bias's (`ParamGrad(1)`, first partial
    /// only) and the input's (`InputGrad(0)`, its channel block).
    PartialBackward,
}

/// The element type of a buffer. Batch-norm sums stay in f64 so that every partition computes the
/// same statistics as one device, to the last bits that matter. Bf16 (the upper half of an f32,
/// rounded to nearest even) holds activations and their gradients, and the working copies of
/// conv2d and dense weights, in a bf16 run (`crate::precision`); only a GPU stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    Bf16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::Bf16 => 2,
        }
    }

    /// The element type of activations and their gradients computed in `precision`: bf16 in a
    /// bf16 run, f32 otherwise (the size [`Precision::activation_bytes`] prices).
    pub fn activation(precision: Precision) -> DType {
        match precision {
            Precision::Fp32 | Precision::Tf32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
        }
    }

    /// The element type of `op`'s output (and of its gradient) computed in `precision`: the
    /// activations' ([`DType::activation`]), but f32 for the per-sample losses of softmax
    /// cross-entropy, which the loss is summed from (the loss is fp32 in every precision).
    pub fn output(op: &crate::op::Op, precision: Precision) -> DType {
        match op {
            crate::op::Op::SoftmaxCrossEntropy(_) => DType::F32,
            _ => DType::activation(precision),
        }
    }
}

/// A read operand: memory `mem` on the device, laid out row-major over `rect` (global coordinates
/// of the whole tensor, as in `crate::kernels`).
pub struct In<'a, M> {
    pub rect: Rect,
    pub mem: &'a M,
}

impl<M> Clone for In<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for In<'_, M> {}

/// A written operand: overwritten with this tile's contribution (kernels never accumulate; where
/// tiles overlap, the driver sums the contributions).
pub struct Out<'a, M> {
    pub rect: Rect,
    pub mem: &'a mut M,
}

/// How a driver lends a buffer to a kernel.
pub enum Access<'a, M> {
    Read(&'a M),
    Write(&'a mut M),
}

/// One operand of a call: its role, the rect its buffer is laid out over, and the buffer.
pub struct Operand<'a, M> {
    pub role: Role,
    pub rect: Rect,
    pub access: Access<'a, M>,
}

/// Borrowed samples of a step's batch (host memory): on a cluster worker only the samples its
/// devices read, elsewhere the whole batch.
#[derive(Clone, Debug)]
pub struct BatchView<'a> {
    /// The images of samples `image_samples`, laid out like the input layer's output.
    pub images: &'a [f32],
    pub image_samples: Range<usize>,
    /// The labels of samples `label_samples`.
    pub labels: &'a [u32],
    pub label_samples: Range<usize>,
}

impl<'a> BatchView<'a> {
    /// A whole batch of `batch` samples.
    pub fn whole(images: &'a [f32], labels: &'a [u32], batch: usize) -> BatchView<'a> {
        BatchView {
            images,
            image_samples: 0..batch,
            labels,
            label_samples: 0..batch,
        }
    }

    /// The labels of the samples a tile covers (axis 0 of the tile).
    pub fn labels_of(&self, tile: &Rect) -> &'a [u32] {
        let first = self.label_samples.start;
        &self.labels[tile.lo[0] - first..tile.hi[0] - first]
    }
}

/// The step-wide facts a kernel may need besides its operands.
#[derive(Clone, Debug)]
pub struct StepContext<'a> {
    pub seed: u64,
    pub step: u64,
    pub sgd: Sgd,
    pub batch: BatchView<'a>,
}

/// What the loss kernels of a step report, summed over their tiles.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSums {
    /// Sum of the per-sample softmax cross-entropy.
    pub loss_sum: f64,
    /// Samples whose arg-max logit is the label.
    pub correct: usize,
}

/// Why a kernel could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Label(#[from] LabelOutOfRange),
    /// The device refused the work (out of memory, a failed launch, a lost device).
    #[error("device error: {0}")]
    Device(String),
    /// A batch that does not describe what it claims to (a `SyntheticBatch` of the wrong sizes).
    #[error("invalid batch: {0}")]
    Batch(String),
}

/// A device kind: its memory, its queue, and the primitives every op is made of.
///
/// Conventions are those of `crate::kernels`: operands carry global rects; inputs contain the op's
/// projection of the output tile; outputs are overwritten, never accumulated into.
#[allow(clippy::too_many_arguments)]
pub trait Backend {
    /// Memory of one operand on this device (f32 data, or f64 for batch-norm sums).
    type Buffer;
    /// An in-order queue: primitives enqueued on one stream run in the order they were enqueued.
    type Stream;
    /// A loss kernel's report, readable with [`Backend::read_loss`] once its stream synchronized.
    type Loss;
    /// A point in a stream's work, for timing the work between two points.
    type Marker;

    /// The arithmetic this backend computes in (`crate::precision`): which element types a
    /// driver gives activations ([`DType::activation`]) and whether conv2d and dense weights get
    /// working copies ([`Precision::working_copy`]). fp32 unless the backend says otherwise.
    fn precision(&self) -> Precision {
        Precision::Fp32
    }

    /// `len` zeros of `dtype` in device memory (enqueued on `s`).
    fn alloc_zeros(
        &self,
        s: &mut Self::Stream,
        dtype: DType,
        len: usize,
    ) -> Result<Self::Buffer, KernelError>;
    /// `len` elements of `dtype` whose values are unspecified, for an operand that its kernel
    /// overwrites whole (every output of a whole-tensor call): no fill to wait for. (A GPU
    /// backend built with debug assertions fills it with NaN, so that an element a kernel leaves
    /// unwritten shows in the tests.)
    fn alloc(
        &self,
        s: &mut Self::Stream,
        dtype: DType,
        len: usize,
    ) -> Result<Self::Buffer, KernelError>;
    /// A device copy of host data (enqueued on `s`).
    fn upload(&self, s: &mut Self::Stream, host: &cpu::Buffer)
    -> Result<Self::Buffer, KernelError>;
    /// A host copy of device data: waits for `s` to reach it.
    fn download(
        &self,
        s: &mut Self::Stream,
        buffer: &Self::Buffer,
    ) -> Result<cpu::Buffer, KernelError>;
    /// `to = from` elementwise, converted to `to`'s element type (f32 to bf16 rounds to nearest
    /// even), both laid out over the same rect: a weight's working copy from its master, a
    /// batch's images as a bf16 run's first activation. A backend without `to`'s element type
    /// fails the stream.
    fn cast(&self, s: &mut Self::Stream, from: In<Self::Buffer>, to: Out<Self::Buffer>);

    /// `acc += term` elementwise, both laid out over the same rect (gradients summed over a
    /// layer's consumers).
    fn accumulate(&self, s: &mut Self::Stream, acc: Out<Self::Buffer>, term: In<Self::Buffer>);

    /// `to[rect] = from[rect]`, each operand laid out over its own rect (`rect` lies in both):
    /// a runtime's local copies, gathers and scatters.
    fn copy_rect(
        &self,
        s: &mut Self::Stream,
        from: In<Self::Buffer>,
        to: Out<Self::Buffer>,
        rect: &Rect,
    );
    /// `to[rect] += from[rect]`, laid out as for [`Backend::copy_rect`]: a runtime's sums of
    /// partial results.
    fn add_rect(
        &self,
        s: &mut Self::Stream,
        from: In<Self::Buffer>,
        to: Out<Self::Buffer>,
        rect: &Rect,
    );
    /// `to[rect] = 0` (`rect` lies in `to.rect`).
    fn zero_rect(&self, s: &mut Self::Stream, to: Out<Self::Buffer>, rect: &Rect);

    /// A marker at the current end of `s`'s work.
    fn mark(&self, s: &mut Self::Stream) -> Result<Self::Marker, KernelError>;
    /// Seconds of device time from `earlier` to `later`, once their stream has synchronized past
    /// both.
    fn seconds_between(
        &self,
        earlier: &Self::Marker,
        later: &Self::Marker,
    ) -> Result<f64, KernelError>;

    /// Waits until everything enqueued on `stream` has run, and reports a failure kept on it.
    fn synchronize(&self, stream: &mut Self::Stream) -> Result<(), KernelError>;
    /// Waits until `stream` has run the work enqueued before `marker`, not the work enqueued
    /// after it, and reports a failure kept on the stream as [`Backend::synchronize`] does (one
    /// of later work too: a failure is reported at the latest by the next wait).
    fn wait_for(&self, stream: &mut Self::Stream, marker: &Self::Marker)
    -> Result<(), KernelError>;
    /// A loss report, after its stream synchronized, or, sent home, after the stream passed a
    /// marker behind it.
    fn read_loss(&self, loss: Self::Loss) -> LossSums;

    /// Copies `tile` of the step's host images (laid out over `held`) into `y`.
    fn load_images(
        &self,
        s: &mut Self::Stream,
        images: &[f32],
        held: &Rect,
        tile: &Rect,
        y: Out<Self::Buffer>,
    );
    /// `y = x` over `y.rect` (the two operands have the same volume; flatten reshapes).
    fn copy(&self, s: &mut Self::Stream, x: In<Self::Buffer>, y: Out<Self::Buffer>);

    fn conv2d_forward(
        &self,
        s: &mut Self::Stream,
        op: &Conv2d,
        in_shape: Shape,
        x: In<Self::Buffer>,
        w: In<Self::Buffer>,
        b: Option<In<Self::Buffer>>,
        y: Out<Self::Buffer>,
    );
    fn conv2d_backward(
        &self,
        s: &mut Self::Stream,
        op: &Conv2d,
        in_shape: Shape,
        x: In<Self::Buffer>,
        w: In<Self::Buffer>,
        y: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Option<Out<Self::Buffer>>,
        dw: Out<Self::Buffer>,
        db: Option<Out<Self::Buffer>>,
    );
    fn dense_forward(
        &self,
        s: &mut Self::Stream,
        op: &Dense,
        x: In<Self::Buffer>,
        w: In<Self::Buffer>,
        b: Option<In<Self::Buffer>>,
        y: Out<Self::Buffer>,
    );
    fn dense_backward(
        &self,
        s: &mut Self::Stream,
        op: &Dense,
        x: In<Self::Buffer>,
        w: In<Self::Buffer>,
        y: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Option<Out<Self::Buffer>>,
        dw: Out<Self::Buffer>,
        db: Option<Out<Self::Buffer>>,
    );
    /// Max or average pooling (a `Pool2d`'s sliding windows or an `AdaptiveAvgPool2d`'s).
    fn pool2d_forward(
        &self,
        s: &mut Self::Stream,
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    fn pool2d_backward(
        &self,
        s: &mut Self::Stream,
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Out<Self::Buffer>,
    );
    fn relu_forward(&self, s: &mut Self::Stream, x: In<Self::Buffer>, y: Out<Self::Buffer>);
    /// From the output `y` (post-activation) and its gradient.
    fn relu_backward(
        &self,
        s: &mut Self::Stream,
        y: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Out<Self::Buffer>,
    );
    /// `y = f(x)` for an element-wise op of the [`Unary`](crate::op::Unary) family, with its
    /// attribute ([`UnaryOp::alpha`](crate::op::UnaryOp::alpha)).
    fn unary_forward(
        &self,
        s: &mut Self::Stream,
        op: crate::op::UnaryOp,
        x: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    /// `dx = dy·f′`, from what the op's gradient reads (its input or its output, as
    /// `Unary::grad_from` says) and the output gradient.
    fn unary_backward(
        &self,
        s: &mut Self::Stream,
        op: crate::op::UnaryOp,
        read: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Out<Self::Buffer>,
    );
    fn add_forward(
        &self,
        s: &mut Self::Stream,
        a: In<Self::Buffer>,
        b: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    /// Either input gradient may be absent (the input needs none, or the tile does not touch it).
    fn add_backward(
        &self,
        s: &mut Self::Stream,
        dy: In<Self::Buffer>,
        da: Option<Out<Self::Buffer>>,
        db: Option<Out<Self::Buffer>>,
    );
    /// `y = x · s`, `s` of `x`'s shape or a `[N, C, 1, 1]` channel scale broadcast over H and W
    /// (a 4-D view of H and W extent 1 at 0, where the tile has more).
    fn mul_forward(
        &self,
        s: &mut Self::Stream,
        x: In<Self::Buffer>,
        scale: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    /// `dx = dy · s` and `ds = dy · x`, for a channel scale summed over `tile`'s H and W (the
    /// operands may be laid out over more); either gradient may be absent.
    fn mul_backward(
        &self,
        s: &mut Self::Stream,
        tile: &Rect,
        x: In<Self::Buffer>,
        scale: In<Self::Buffer>,
        dy: In<Self::Buffer>,
        dx: Option<Out<Self::Buffer>>,
        dscale: Option<Out<Self::Buffer>>,
    );
    /// `xs[k]` is `None` where the tile reads nothing of input `k`.
    fn concat_forward(
        &self,
        s: &mut Self::Stream,
        input_shapes: &[Shape],
        xs: &[Option<In<Self::Buffer>>],
        y: Out<Self::Buffer>,
    );
    /// `dxs[k]` is `None` where input `k` needs no gradient or the tile does not touch it; the
    /// rects of the present ones are the op's projection of `dy.rect`.
    fn concat_backward(
        &self,
        s: &mut Self::Stream,
        input_shapes: &[Shape],
        dy: In<Self::Buffer>,
        dxs: Vec<Option<Out<Self::Buffer>>>,
    );
    fn dropout_forward(
        &self,
        s: &mut Self::Stream,
        mask: &DropoutMask,
        x: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    fn dropout_backward(
        &self,
        s: &mut Self::Stream,
        mask: &DropoutMask,
        dy: In<Self::Buffer>,
        dx: Out<Self::Buffer>,
    );
    /// Per-sample losses into `y`; the sum and the correct count into the returned report.
    /// Labels are host data, checked against the class count before anything is enqueued.
    fn softmax_ce_forward(
        &self,
        s: &mut Self::Stream,
        logits: In<Self::Buffer>,
        labels: &[u32],
        y: Out<Self::Buffer>,
    ) -> Result<Self::Loss, KernelError>;
    /// The gradient of `scale ×` the summed loss.
    fn softmax_ce_backward(
        &self,
        s: &mut Self::Stream,
        logits: In<Self::Buffer>,
        labels: &[u32],
        scale: f32,
        dlogits: Out<Self::Buffer>,
    ) -> Result<(), KernelError>;

    /// The `[3, C]` f64 sums (count, Σx, Σx²) of the tile's channels.
    fn bn_moments(
        &self,
        s: &mut Self::Stream,
        x: In<Self::Buffer>,
        tile: &Rect,
        moments: Out<Self::Buffer>,
    );
    fn bn_normalize(
        &self,
        s: &mut Self::Stream,
        op: &BatchNorm,
        x: In<Self::Buffer>,
        moments: In<Self::Buffer>,
        gamma: In<Self::Buffer>,
        beta: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    /// Inference's normalisation: with the running statistics of the tile's channels instead
    /// of the batch's.
    #[allow(clippy::too_many_arguments)]
    fn bn_infer(
        &self,
        s: &mut Self::Stream,
        op: &BatchNorm,
        x: In<Self::Buffer>,
        gamma: In<Self::Buffer>,
        beta: In<Self::Buffer>,
        running_mean: In<Self::Buffer>,
        running_var: In<Self::Buffer>,
        y: Out<Self::Buffer>,
    );
    fn bn_running(
        &self,
        s: &mut Self::Stream,
        op: &BatchNorm,
        moments: In<Self::Buffer>,
        running_mean: Out<Self::Buffer>,
        running_var: Out<Self::Buffer>,
    );
    /// The tile's γ and β gradients, and its `[3, C]` f64 sums (count, Σdy, Σdy·x̂).
    fn bn_grad_sums(
        &self,
        s: &mut Self::Stream,
        op: &BatchNorm,
        x: In<Self::Buffer>,
        y: Option<In<Self::Buffer>>,
        dy: In<Self::Buffer>,
        moments: In<Self::Buffer>,
        tile: &Rect,
        dgamma: Out<Self::Buffer>,
        dbeta: Out<Self::Buffer>,
        grad_sums: Out<Self::Buffer>,
    );
    fn bn_input_grad(
        &self,
        s: &mut Self::Stream,
        op: &BatchNorm,
        x: In<Self::Buffer>,
        y: Option<In<Self::Buffer>>,
        dy: In<Self::Buffer>,
        moments: In<Self::Buffer>,
        gamma: In<Self::Buffer>,
        grad_sums: In<Self::Buffer>,
        dx: Out<Self::Buffer>,
    );

    /// `d = g + wd·w; v = μ·v + d; w -= lr·v` elementwise.
    fn sgd_update(
        &self,
        s: &mut Self::Stream,
        sgd: &Sgd,
        grad: In<Self::Buffer>,
        w: Out<Self::Buffer>,
        velocity: Out<Self::Buffer>,
    );
}

/// Writes a batch into the host memory [`Pipeline::host_slices`] lends, on several threads of its
/// own: one thread copies a few GB/s, the memory system several times that. Not on the rayon
/// pool, where the data loader builds the batches after it (measured on the lent H200: AlexNet's
/// 77 MB took 12 ms there, beside the loader, against 4.5–8 ms on threads of its own).
pub fn fill_host_batch(
    (host_images, host_labels): (&mut [f32], &mut [u32]),
    images: &[f32],
    labels: &[u32],
) {
    /// Below this many elements (8 MiB) a thread is as quick as starting another.
    const PER_THREAD: usize = 1 << 21;
    host_labels.copy_from_slice(labels);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        .min(images.len().div_ceil(PER_THREAD));
    if threads <= 1 {
        host_images.copy_from_slice(images);
        return;
    }
    let chunk = images.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (to, from) in host_images.chunks_mut(chunk).zip(images.chunks(chunk)) {
            scope.spawn(move || to.copy_from_slice(from));
        }
    });
}

/// One phase of one layer over one tile, with the buffers its driver lends it. `Op::run` reads
/// the operands its phase needs by role and hands them to the backend's primitive.
pub struct KernelCall<'c, 'a, B: Backend> {
    pub backend: &'c B,
    pub stream: &'c mut B::Stream,
    pub graph: &'c Graph,
    pub layer: LayerId,
    /// The part of the layer's output (or, for `BnRunning` and `Update`, of the parameter) this
    /// call computes.
    pub tile: Rect,
    pub step: &'c StepContext<'c>,
    operands: Vec<Option<Operand<'a, B::Buffer>>>,
    /// What a loss phase reported, to read after the stream synchronized.
    pub loss: Option<B::Loss>,
}

impl<'c, 'a, B: Backend> KernelCall<'c, 'a, B> {
    pub fn new(
        backend: &'c B,
        stream: &'c mut B::Stream,
        graph: &'c Graph,
        layer: LayerId,
        tile: Rect,
        step: &'c StepContext<'c>,
        operands: impl IntoIterator<Item = Operand<'a, B::Buffer>>,
    ) -> Self {
        KernelCall {
            backend,
            stream,
            graph,
            layer,
            tile,
            step,
            operands: operands.into_iter().map(Some).collect(),
            loss: None,
        }
    }

    /// Runs `phase` of the call's layer.
    pub fn run(&mut self, phase: Phase) -> Result<(), KernelError> {
        let op = &self.graph.layer(self.layer).op;
        op.run(phase, self)
    }

    /// Shape of the layer's `k`-th input.
    pub fn input_shape(&self, k: usize) -> Shape {
        let layer = self.graph.layer(self.layer);
        self.graph.layer(layer.inputs[k]).shape
    }

    pub fn input_shapes(&self) -> Vec<Shape> {
        self.graph.input_shapes(self.layer)
    }

    /// The layer's output shape.
    pub fn shape(&self) -> Shape {
        self.graph.layer(self.layer).shape
    }

    fn index(&self, role: Role) -> Option<usize> {
        self.operands
            .iter()
            .position(|o| o.as_ref().is_some_and(|o| o.role == role))
    }

    /// Whether the driver lent an operand for `role`.
    pub fn has(&self, role: Role) -> bool {
        self.index(role).is_some()
    }

    /// The operand of `role`; the driver must have lent it readable.
    pub fn read(&self, role: Role) -> In<'a, B::Buffer> {
        self.try_read(role)
            .unwrap_or_else(|| panic!("{}: no readable {role:?} operand", self.describe()))
    }

    pub fn try_read(&self, role: Role) -> Option<In<'a, B::Buffer>> {
        let operand = self.operands[self.index(role)?].as_ref()?;
        match operand.access {
            Access::Read(mem) => Some(In {
                rect: operand.rect,
                mem,
            }),
            Access::Write(_) => None,
        }
    }

    /// The operand of `role`, taken for writing (once).
    pub fn write(&mut self, role: Role) -> Out<'a, B::Buffer> {
        match self.try_write(role) {
            Some(out) => out,
            None => panic!(
                "{}: no writable {role:?} operand (or taken twice)",
                self.describe()
            ),
        }
    }

    pub fn try_write(&mut self, role: Role) -> Option<Out<'a, B::Buffer>> {
        let i = self.index(role)?;
        match self.operands[i].take() {
            Some(Operand {
                rect,
                access: Access::Write(mem),
                ..
            }) => Some(Out { rect, mem }),
            other => {
                self.operands[i] = other;
                None
            }
        }
    }

    fn describe(&self) -> String {
        let layer = self.graph.layer(self.layer);
        format!(
            "layer '{}' ({}) tile {}",
            layer.name,
            layer.op.kind(),
            self.tile
        )
    }

    /// The dropout mask of this layer at this step: salted with the layer's index, which every
    /// partition of the graph shares.
    pub fn dropout_mask(&self, rate: f32) -> DropoutMask {
        DropoutMask {
            rate,
            seed: self.step.seed,
            step: self.step.step,
            layer_salt: self.layer.0 as u64,
            shape: self.shape(),
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::{DType, fill_host_batch};
    use crate::op::{Conv2d, Op, SoftmaxCrossEntropy};
    use crate::precision::Precision;

    #[test]
    fn activations_are_bf16_in_bf16_except_the_per_sample_losses() {
        let conv = Op::Conv2d(Conv2d::new(4, 3));
        let loss = Op::SoftmaxCrossEntropy(SoftmaxCrossEntropy::default());
        assert_eq!(DType::output(&conv, Precision::Bf16), DType::Bf16);
        assert_eq!(DType::output(&loss, Precision::Bf16), DType::F32);
        for p in [Precision::Fp32, Precision::Tf32] {
            assert_eq!(DType::output(&conv, p), DType::F32);
            assert_eq!(DType::output(&loss, p), DType::F32);
        }
        for p in Precision::ALL {
            assert_eq!(DType::activation(p).size() as u64, p.activation_bytes());
        }
    }

    #[test]
    fn a_filled_batch_is_a_copy_of_any_length() {
        for len in [0, 5, (1 << 21) - 1, 3 * (1 << 21) + 5] {
            let images: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let labels = [3u32, 1, 4];
            let (mut host_images, mut host_labels) = (vec![-1.0; len], [0u32; 3]);
            fill_host_batch((&mut host_images, &mut host_labels), &images, &labels);
            assert!(host_images == images && host_labels == labels, "{len}");
        }
    }
}
