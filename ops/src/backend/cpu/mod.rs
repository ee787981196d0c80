//! The CPU backend: host memory, and the kernels of `crate::kernels` run on the calling thread
//! (parallelised on the current rayon pool). Its stream is a marker: a primitive has finished when
//! it returns.

pub mod buffer;

pub use buffer::Buffer;

use super::{Backend, DType, In, KernelError, LossSums, Out};
use crate::kernels::batch_norm::{self, BatchStats, GradSums, MomentSums};
use crate::kernels::dropout::DropoutMask;
use crate::kernels::{self, View, ViewMut};
use crate::op::{Activation, BatchNorm, Concat, Conv2d, Dense, OpSpec, PoolWindows, UnaryOp};
use crate::precision::{Precision, bf16_bits, bf16_value, round_bf16};
use crate::shape::{Rect, Shape, copy_rect};
use crate::train::Sgd;
use std::borrow::Cow;

/// Host memory and the CPU kernels, computing in `precision`. The kernels compute in f32 whatever
/// the precision; in bf16 the operands a GPU stores in bf16 (activations, their gradients, the
/// weights' working copies) are stored in bf16 here too, each value rounded once as the GPU's
/// bf16 kernels round it. So a bf16 run on the CPU is bf16's arithmetic, slower than fp32 (every
/// bf16 operand is widened for the kernels), for checking bf16 strategies and runs without a GPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    precision: Precision,
}

impl Cpu {
    /// The CPU backend computing in `precision` (tf32 computes as fp32: the CPU has no TF32).
    pub fn new(precision: Precision) -> Cpu {
        Cpu { precision }
    }
}

/// The CPU's queue: work runs when it is enqueued.
#[derive(Debug, Default)]
pub struct CpuStream;

/// A read operand as the f32 kernels see it: borrowed where it is f32, widened (exactly) from
/// bf16 into a copy where it is bf16.
struct Wide<'a> {
    rect: Rect,
    data: Cow<'a, [f32]>,
}

impl Wide<'_> {
    fn view(&self) -> View<'_> {
        View::new(self.rect, &self.data)
    }
}

fn wide(x: In<'_, Buffer>) -> Wide<'_> {
    let data = match x.mem {
        Buffer::Bf16(bits) => Cow::Owned(bits.iter().map(|&b| bf16_value(b)).collect()),
        other => Cow::Borrowed(other.f32()),
    };
    Wide { rect: x.rect, data }
}

/// A written operand as the f32 kernels see it: the buffer itself where it is f32; where it is
/// bf16, an f32 copy of it that is rounded (to nearest even) back into the buffer when this is
/// dropped, so a bf16 output is stored once, rounded, as a GPU's bf16 kernels store it.
struct Narrow<'a> {
    rect: Rect,
    target: Target<'a>,
}

enum Target<'a> {
    F32(&'a mut [f32]),
    /// A zeroed gradient for an operand the driver did not lend, dropped unread.
    Scratch(Vec<f32>),
    Bf16 {
        bits: &'a mut [u16],
        wide: Vec<f32>,
    },
}

impl Narrow<'_> {
    fn data(&mut self) -> &mut [f32] {
        match &mut self.target {
            Target::F32(data) => data,
            Target::Scratch(data) => data,
            Target::Bf16 { wide, .. } => wide,
        }
    }

    fn view_mut(&mut self) -> ViewMut<'_> {
        let rect = self.rect;
        ViewMut::new(rect, self.data())
    }
}

impl Drop for Narrow<'_> {
    fn drop(&mut self) {
        if let Target::Bf16 { bits, wide } = &mut self.target {
            for (b, &x) in bits.iter_mut().zip(wide.iter()) {
                *b = bf16_bits(x);
            }
        }
    }
}

fn narrow(y: Out<'_, Buffer>) -> Narrow<'_> {
    let target = match y.mem {
        // Widened first: a kernel that leaves part of its output alone leaves it as it was.
        Buffer::Bf16(bits) => Target::Bf16 {
            wide: bits.iter().map(|&b| bf16_value(b)).collect(),
            bits,
        },
        other => Target::F32(other.f32_mut()),
    };
    Narrow {
        rect: y.rect,
        target,
    }
}

/// `[3, C]` sums: a row of counts, then two rows of per-channel sums.
fn write_sums(out: Out<Buffer>, count: u64, a: &[f64], b: &[f64]) {
    let out = out.mem.f64_mut();
    let c = a.len();
    out[..c].fill(count as f64);
    out[c..2 * c].copy_from_slice(a);
    out[2 * c..].copy_from_slice(b);
}

/// The channel range of `[3, C]` sums laid out over `rect`, and their three rows.
fn read_sums(sums: In<Buffer>) -> (std::ops::Range<usize>, u64, Vec<f64>, Vec<f64>) {
    let v = sums.mem.f64();
    let c = v.len() / 3;
    let channels = sums.rect.lo[1]..sums.rect.hi[1];
    (
        channels,
        v[0] as u64,
        v[c..2 * c].to_vec(),
        v[2 * c..].to_vec(),
    )
}

fn batch_stats(moments: In<Buffer>, eps: f32) -> BatchStats {
    let (channels, count, sum, sum_sq) = read_sums(moments);
    BatchStats::from_sums(
        &MomentSums {
            channels,
            count,
            sum,
            sum_sq,
        },
        eps,
    )
}

/// A bf16 product's output as a GPU's libraries store it: `product` (no bias, no activation)
/// rounded to bf16 into `y`, then the bias and activation added in f32 and rounded again.
fn product_then_bias(
    y: Out<Buffer>,
    b: Option<In<Buffer>>,
    relu: bool,
    product: impl FnOnce(ViewMut),
) {
    let rect = y.rect;
    // rounded when the guard drops, at the end of this statement
    product(
        narrow(Out {
            rect,
            mem: &mut *y.mem,
        })
        .view_mut(),
    );
    bias_activation(y, b, relu);
}

/// `y = act(y + b[channel])` over a bf16 output, rounded once more: what a GPU's
/// `bias_activation` does after a bf16 product (the channel is axis 1 of `y`'s rect; `b` is laid
/// out over a rect of channels).
fn bias_activation(y: Out<Buffer>, b: Option<In<Buffer>>, relu: bool) {
    if b.is_none() && !relu {
        return;
    }
    let rect = y.rect;
    let channels = rect.hi[1] - rect.lo[1];
    let inner: usize = (2..rect.ndim()).map(|a| rect.hi[a] - rect.lo[a]).product();
    let bias = b.map(|b| (b.rect.lo[0], b.mem.f32()));
    for (i, v) in y.mem.bf16_mut().iter_mut().enumerate() {
        let mut z = bf16_value(*v);
        if let Some((lo, bias)) = bias {
            z += bias[rect.lo[1] + (i / inner) % channels - lo];
        }
        *v = bf16_bits(if relu && z < 0.0 { 0.0 } else { z });
    }
}

/// `to = from` element for element, converted to `to`'s element type (to bf16 rounded to nearest
/// even; from bf16 exact).
fn convert(from: &Buffer, to: &mut Buffer) {
    assert_eq!(
        from.len(),
        to.len(),
        "conversion between buffers of different lengths"
    );
    match (from, to) {
        (Buffer::F32(a), Buffer::F32(b)) => b.copy_from_slice(a),
        (Buffer::F64(a), Buffer::F64(b)) => b.copy_from_slice(a),
        (Buffer::Bf16(a), Buffer::Bf16(b)) => b.copy_from_slice(a),
        (Buffer::F32(a), Buffer::F64(b)) => zip_map(a, b, f64::from),
        (Buffer::F32(a), Buffer::Bf16(b)) => zip_map(a, b, bf16_bits),
        (Buffer::F64(a), Buffer::F32(b)) => zip_map(a, b, |a| a as f32),
        (Buffer::F64(a), Buffer::Bf16(b)) => zip_map(a, b, |a| bf16_bits(a as f32)),
        (Buffer::Bf16(a), Buffer::F32(b)) => zip_map(a, b, bf16_value),
        (Buffer::Bf16(a), Buffer::F64(b)) => zip_map(a, b, |a| f64::from(bf16_value(a))),
    }
}

fn zip_map<A: Copy, B>(from: &[A], to: &mut [B], f: impl Fn(A) -> B) {
    to.iter_mut().zip(from).for_each(|(b, &a)| *b = f(a));
}

/// `out` as [`narrow`] lends it, or a zeroed scratch gradient where the driver lent none.
fn narrow_or_scratch(out: Option<Out<'_, Buffer>>, rect: Rect) -> Narrow<'_> {
    match out {
        Some(out) => narrow(out),
        None => Narrow {
            rect,
            target: Target::Scratch(vec![0.0; rect.volume()]),
        },
    }
}

impl Backend for Cpu {
    type Buffer = Buffer;
    type Stream = CpuStream;
    type Loss = LossSums;
    /// Host memory is the device's: staging is the copy `load_images` would make.
    /// Work has run when its primitive returns: the host's clock times it.
    type Marker = std::time::Instant;

    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc_zeros(
        &self,
        _: &mut CpuStream,
        dtype: DType,
        len: usize,
    ) -> Result<Buffer, KernelError> {
        Ok(Buffer::zeros(dtype, len))
    }

    /// Zeros: host memory comes zeroed from the allocator at no cost worth saving.
    fn alloc(&self, s: &mut CpuStream, dtype: DType, len: usize) -> Result<Buffer, KernelError> {
        self.alloc_zeros(s, dtype, len)
    }

    fn upload(&self, _: &mut CpuStream, host: &Buffer) -> Result<Buffer, KernelError> {
        Ok(host.clone())
    }

    fn download(&self, _: &mut CpuStream, buffer: &Buffer) -> Result<Buffer, KernelError> {
        Ok(buffer.clone())
    }

    /// Between any two element types; to bf16 rounds to nearest even, from bf16 is exact.
    fn cast(&self, _: &mut CpuStream, from: In<Buffer>, to: Out<Buffer>) {
        debug_assert_eq!(from.rect, to.rect, "cast converts buffers over one rect");
        convert(from.mem, to.mem);
    }

    fn accumulate(&self, _: &mut CpuStream, acc: Out<Buffer>, term: In<Buffer>) {
        debug_assert_eq!(acc.rect, term.rect, "accumulate sums buffers over one rect");
        // Element by element, in the order the consumers are visited (bf16 rounded once).
        acc.mem.add_from(&acc.rect, term.mem, &term.rect, &acc.rect);
    }

    fn copy_rect(&self, _: &mut CpuStream, from: In<Buffer>, to: Out<Buffer>, rect: &Rect) {
        to.mem.copy_from(&to.rect, from.mem, &from.rect, rect);
    }

    fn add_rect(&self, _: &mut CpuStream, from: In<Buffer>, to: Out<Buffer>, rect: &Rect) {
        to.mem.add_from(&to.rect, from.mem, &from.rect, rect);
    }

    fn zero_rect(&self, _: &mut CpuStream, to: Out<Buffer>, rect: &Rect) {
        to.mem.zero(&to.rect, rect);
    }

    fn mark(&self, _: &mut CpuStream) -> Result<std::time::Instant, KernelError> {
        Ok(std::time::Instant::now())
    }

    fn seconds_between(
        &self,
        earlier: &std::time::Instant,
        later: &std::time::Instant,
    ) -> Result<f64, KernelError> {
        Ok(later.saturating_duration_since(*earlier).as_secs_f64())
    }

    fn synchronize(&self, _: &mut CpuStream) -> Result<(), KernelError> {
        Ok(())
    }

    fn wait_for(&self, _: &mut CpuStream, _: &std::time::Instant) -> Result<(), KernelError> {
        Ok(())
    }

    /// The sums are host memory already.
    fn read_loss(&self, loss: LossSums) -> LossSums {
        loss
    }

    fn load_images(
        &self,
        _: &mut CpuStream,
        images: &[f32],
        held: &Rect,
        tile: &Rect,
        y: Out<Buffer>,
    ) {
        let rect = y.rect;
        copy_rect(images, held, narrow(y).data(), &rect, tile);
    }

    /// A reshape's copy: element for element, whatever the two rects.
    fn copy(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        convert(x.mem, y.mem);
    }

    fn conv2d_forward(
        &self,
        _: &mut CpuStream,
        op: &Conv2d,
        in_shape: Shape,
        x: In<Buffer>,
        w: In<Buffer>,
        b: Option<In<Buffer>>,
        y: Out<Buffer>,
    ) {
        if y.mem.dtype() == DType::Bf16 {
            // cuDNN's bf16 product, then `bias_activation`
            let plain = Conv2d {
                activation: Activation::None,
                ..op.clone()
            };
            let (x, w) = (wide(x), wide(w));
            let relu = op.activation == Activation::Relu;
            return product_then_bias(y, b, relu, |y| {
                kernels::conv2d::conv2d_forward(&plain, in_shape, x.view(), w.view(), None, y)
            });
        }
        kernels::conv2d::conv2d_forward(
            op,
            in_shape,
            wide(x).view(),
            wide(w).view(),
            b.map(wide).as_ref().map(Wide::view),
            narrow(y).view_mut(),
        );
    }

    fn conv2d_backward(
        &self,
        _: &mut CpuStream,
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
        // cuDNN writes a bf16 run's weight gradient in bf16, cast up into the f32 one: rounded
        // once here too.
        let dw_through_bf16 = x.mem.dtype() == DType::Bf16;
        let rect = dw.rect;
        kernels::conv2d::conv2d_backward(
            op,
            in_shape,
            wide(x).view(),
            wide(w).view(),
            wide(y).view(),
            wide(dy).view(),
            dx.map(narrow).as_mut().map(Narrow::view_mut),
            narrow(Out {
                rect,
                mem: &mut *dw.mem,
            })
            .view_mut(),
            db.map(narrow).as_mut().map(Narrow::view_mut),
        );
        if dw_through_bf16 {
            for g in dw.mem.f32_mut() {
                *g = round_bf16(*g);
            }
        }
    }

    fn dense_forward(
        &self,
        _: &mut CpuStream,
        op: &Dense,
        x: In<Buffer>,
        w: In<Buffer>,
        b: Option<In<Buffer>>,
        y: Out<Buffer>,
    ) {
        if y.mem.dtype() == DType::Bf16 {
            // cuBLAS's bf16 product, then `bias_activation`
            let plain = Dense {
                activation: Activation::None,
                ..op.clone()
            };
            let (x, w) = (wide(x), wide(w));
            let relu = op.activation == Activation::Relu;
            return product_then_bias(y, b, relu, |y| {
                kernels::dense::dense_forward(&plain, x.view(), w.view(), None, y)
            });
        }
        kernels::dense::dense_forward(
            op,
            wide(x).view(),
            wide(w).view(),
            b.map(wide).as_ref().map(Wide::view),
            narrow(y).view_mut(),
        );
    }

    fn dense_backward(
        &self,
        _: &mut CpuStream,
        op: &Dense,
        x: In<Buffer>,
        w: In<Buffer>,
        y: In<Buffer>,
        dy: In<Buffer>,
        dx: Option<Out<Buffer>>,
        dw: Out<Buffer>,
        db: Option<Out<Buffer>>,
    ) {
        kernels::dense::dense_backward(
            op,
            wide(x).view(),
            wide(w).view(),
            wide(y).view(),
            wide(dy).view(),
            dx.map(narrow).as_mut().map(Narrow::view_mut),
            narrow(dw).view_mut(),
            db.map(narrow).as_mut().map(Narrow::view_mut),
        );
    }

    fn pool2d_forward(
        &self,
        _: &mut CpuStream,
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        kernels::pool2d::pool2d_forward(op, in_shape, wide(x).view(), narrow(y).view_mut());
    }

    fn pool2d_backward(
        &self,
        _: &mut CpuStream,
        op: PoolWindows<'_>,
        in_shape: Shape,
        x: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        kernels::pool2d::pool2d_backward(
            op,
            in_shape,
            wide(x).view(),
            wide(dy).view(),
            narrow(dx).view_mut(),
        );
    }

    fn relu_forward(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        kernels::relu::relu_forward(wide(x).view(), narrow(y).view_mut());
    }

    fn relu_backward(&self, _: &mut CpuStream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        kernels::relu::relu_backward(wide(y).view(), wide(dy).view(), narrow(dx).view_mut());
    }

    fn unary_forward(&self, _: &mut CpuStream, op: UnaryOp, x: In<Buffer>, y: Out<Buffer>) {
        op.forward_tile(wide(x).view(), narrow(y).view_mut());
    }

    fn unary_backward(
        &self,
        _: &mut CpuStream,
        op: UnaryOp,
        read: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        op.backward_tile(wide(read).view(), wide(dy).view(), narrow(dx).view_mut());
    }

    fn add_forward(&self, _: &mut CpuStream, a: In<Buffer>, b: In<Buffer>, y: Out<Buffer>) {
        kernels::add::add_forward(wide(a).view(), wide(b).view(), narrow(y).view_mut());
    }

    fn add_backward(
        &self,
        _: &mut CpuStream,
        dy: In<Buffer>,
        da: Option<Out<Buffer>>,
        db: Option<Out<Buffer>>,
    ) {
        let (mut da, mut db) = (
            narrow_or_scratch(da, dy.rect),
            narrow_or_scratch(db, dy.rect),
        );
        kernels::add::add_backward(wide(dy).view(), da.view_mut(), db.view_mut());
    }

    fn mul_forward(&self, _: &mut CpuStream, x: In<Buffer>, s: In<Buffer>, y: Out<Buffer>) {
        kernels::mul::mul_forward(wide(x).view(), wide(s).view(), narrow(y).view_mut());
    }

    fn mul_backward(
        &self,
        _: &mut CpuStream,
        tile: &Rect,
        x: In<Buffer>,
        s: In<Buffer>,
        dy: In<Buffer>,
        dx: Option<Out<Buffer>>,
        ds: Option<Out<Buffer>>,
    ) {
        let mut dx = dx.map(narrow);
        let mut ds = ds.map(narrow);
        kernels::mul::mul_backward(
            tile,
            wide(x).view(),
            wide(s).view(),
            wide(dy).view(),
            dx.as_mut().map(|d| d.view_mut()),
            ds.as_mut().map(|d| d.view_mut()),
        );
    }

    fn concat_forward(
        &self,
        _: &mut CpuStream,
        input_shapes: &[Shape],
        xs: &[Option<In<Buffer>>],
        y: Out<Buffer>,
    ) {
        let wides: Vec<Option<Wide>> = xs.iter().map(|x| x.map(wide)).collect();
        let views: Vec<View> = wides
            .iter()
            .zip(input_shapes)
            .map(|(x, shape)| match x {
                Some(x) => x.view(),
                None => {
                    let zero = vec![0; shape.ndim()];
                    View::new(Rect::new(&zero, &zero), &[])
                }
            })
            .collect();
        kernels::concat::concat_forward(input_shapes, &views, narrow(y).view_mut());
    }

    fn concat_backward(
        &self,
        _: &mut CpuStream,
        input_shapes: &[Shape],
        dy: In<Buffer>,
        dxs: Vec<Option<Out<Buffer>>>,
    ) {
        let rects = Concat {}.project(input_shapes, &dy.rect);
        let mut outs: Vec<Narrow> = dxs
            .into_iter()
            .zip(&rects)
            .map(|(d, r)| narrow_or_scratch(d, *r))
            .collect();
        let mut views: Vec<ViewMut> = outs.iter_mut().map(Narrow::view_mut).collect();
        kernels::concat::concat_backward(input_shapes, wide(dy).view(), &mut views);
    }

    fn dropout_forward(
        &self,
        _: &mut CpuStream,
        mask: &DropoutMask,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        kernels::dropout::dropout_forward(mask, wide(x).view(), narrow(y).view_mut());
    }

    fn dropout_backward(
        &self,
        _: &mut CpuStream,
        mask: &DropoutMask,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        kernels::dropout::dropout_backward(mask, wide(dy).view(), narrow(dx).view_mut());
    }

    fn softmax_ce_forward(
        &self,
        _: &mut CpuStream,
        logits: In<Buffer>,
        labels: &[u32],
        y: Out<Buffer>,
    ) -> Result<LossSums, KernelError> {
        let logits = wide(logits);
        let logits = logits.view();
        let rows = y.rect;
        let loss_sum =
            kernels::softmax_ce::softmax_ce_forward(logits, labels, narrow(y).view_mut())?;
        let correct = kernels::softmax_ce::count_correct(logits, labels, &rows);
        Ok(LossSums { loss_sum, correct })
    }

    fn softmax_ce_backward(
        &self,
        _: &mut CpuStream,
        logits: In<Buffer>,
        labels: &[u32],
        scale: f32,
        dlogits: Out<Buffer>,
    ) -> Result<(), KernelError> {
        kernels::softmax_ce::softmax_ce_backward(
            wide(logits).view(),
            labels,
            scale,
            narrow(dlogits).view_mut(),
        )?;
        Ok(())
    }

    fn bn_moments(&self, _: &mut CpuStream, x: In<Buffer>, tile: &Rect, moments: Out<Buffer>) {
        let sums = batch_norm::partial_moments(wide(x).view(), tile);
        write_sums(moments, sums.count, &sums.sum, &sums.sum_sq);
    }

    fn bn_normalize(
        &self,
        _: &mut CpuStream,
        op: &BatchNorm,
        x: In<Buffer>,
        moments: In<Buffer>,
        gamma: In<Buffer>,
        beta: In<Buffer>,
        y: Out<Buffer>,
    ) {
        let stats = batch_stats(moments, op.eps);
        batch_norm::normalize(
            wide(x).view(),
            &stats,
            wide(gamma).view(),
            wide(beta).view(),
            op.relu,
            narrow(y).view_mut(),
        );
    }

    fn bn_infer(
        &self,
        _: &mut CpuStream,
        op: &BatchNorm,
        x: In<Buffer>,
        gamma: In<Buffer>,
        beta: In<Buffer>,
        running_mean: In<Buffer>,
        running_var: In<Buffer>,
        y: Out<Buffer>,
    ) {
        let channels = y.rect.lo[1]..y.rect.hi[1];
        let (mean, var) = (wide(running_mean), wide(running_var));
        let stats = BatchStats::from_running(channels, mean.view(), var.view(), op.eps);
        batch_norm::normalize(
            wide(x).view(),
            &stats,
            wide(gamma).view(),
            wide(beta).view(),
            op.relu,
            narrow(y).view_mut(),
        );
    }

    fn bn_running(
        &self,
        _: &mut CpuStream,
        op: &BatchNorm,
        moments: In<Buffer>,
        running_mean: Out<Buffer>,
        running_var: Out<Buffer>,
    ) {
        let stats = batch_stats(moments, op.eps);
        stats.update_running(
            op.momentum,
            narrow(running_mean).view_mut(),
            narrow(running_var).view_mut(),
        );
    }

    fn bn_grad_sums(
        &self,
        _: &mut CpuStream,
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
        let stats = batch_stats(moments, op.eps);
        let sums = batch_norm::partial_grad_sums(
            wide(x).view(),
            y.map(wide).as_ref().map(Wide::view),
            wide(dy).view(),
            &stats,
            tile,
        );
        sums.param_grads(narrow(dgamma).view_mut(), narrow(dbeta).view_mut());
        write_sums(grad_sums, sums.count, &sums.sum_dy, &sums.sum_dy_xhat);
    }

    fn bn_input_grad(
        &self,
        _: &mut CpuStream,
        op: &BatchNorm,
        x: In<Buffer>,
        y: Option<In<Buffer>>,
        dy: In<Buffer>,
        moments: In<Buffer>,
        gamma: In<Buffer>,
        grad_sums: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        let stats = batch_stats(moments, op.eps);
        let (channels, count, sum_dy, sum_dy_xhat) = read_sums(grad_sums);
        let sums = GradSums {
            channels,
            count,
            sum_dy,
            sum_dy_xhat,
        };
        batch_norm::input_grad(
            wide(x).view(),
            y.map(wide).as_ref().map(Wide::view),
            wide(dy).view(),
            &stats,
            wide(gamma).view(),
            &sums,
            narrow(dx).view_mut(),
        );
    }

    fn sgd_update(
        &self,
        _: &mut CpuStream,
        sgd: &Sgd,
        grad: In<Buffer>,
        w: Out<Buffer>,
        velocity: Out<Buffer>,
    ) {
        sgd.update(w.mem.f32_mut(), grad.mem.f32(), velocity.mem.f32_mut());
    }
}

impl super::Pipeline for Cpu {
    type Staged = Buffer;
    type HostBatch = (Vec<f32>, Vec<u32>);

    fn begin_stage(
        &self,
        _: &mut CpuStream,
        images: usize,
        labels: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), KernelError> {
        Ok((vec![0.0; images], vec![0; labels]))
    }

    fn host_slices(
        batch: &mut (Vec<f32>, Vec<u32>),
    ) -> Result<(&mut [f32], &mut [u32]), KernelError> {
        Ok((&mut batch.0, &mut batch.1))
    }

    fn finish_stage(
        &self,
        _: &mut CpuStream,
        (images, _labels): (Vec<f32>, Vec<u32>),
    ) -> Result<Buffer, KernelError> {
        Ok(Buffer::F32(images))
    }

    fn take_staged(&self, _: &mut CpuStream, staged: Buffer) -> Result<Buffer, KernelError> {
        Ok(staged)
    }

    type Graph = std::convert::Infallible;

    fn begin_capture(&self, _: &mut CpuStream) -> Result<(), KernelError> {
        Err(KernelError::Device(
            "the CPU runs each kernel when it is called: there is no queue to record".into(),
        ))
    }

    fn replay(&self, _: &mut CpuStream, graph: &Self::Graph) -> Result<Vec<LossSums>, KernelError> {
        match *graph {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
    }

    fn bits(v: &[f32]) -> Buffer {
        Buffer::Bf16(v.iter().map(|&x| bf16_bits(x)).collect())
    }

    /// A kernel on bf16 operands computes on their exact f32 values and stores its bf16 output
    /// rounded once; a product's bias is added after that rounding and rounded again, as a GPU's
    /// `bias_activation` does.
    #[test]
    fn bf16_operands_compute_in_f32_and_round_once() {
        let op = Dense::new(5);
        let (x_rect, w_rect, y_rect) = (
            Rect::new(&[0, 0], &[3, 7]),
            Rect::new(&[0, 0], &[5, 7]),
            Rect::new(&[0, 0], &[3, 5]),
        );
        let (x, w, b) = (random(21, 1), random(35, 2), random(5, 3));
        let (x16, w16) = (bits(&x), bits(&w));
        let (xw, ww) = (x16.to_f32(), w16.to_f32());
        let bias = Buffer::F32(b);
        let cpu = Cpu::new(Precision::Bf16);
        let mut product = Buffer::F32(vec![0.0; 15]);
        let f32_in = |rect, mem| In { rect, mem };
        let (xw, ww) = (Buffer::F32(xw), Buffer::F32(ww));
        let bias_rect = Rect::new(&[0], &[5]);
        cpu.dense_forward(
            &mut CpuStream,
            &op,
            f32_in(x_rect, &xw),
            f32_in(w_rect, &ww),
            None,
            Out {
                rect: y_rect,
                mem: &mut product,
            },
        );
        // As a GPU stores it: the product rounded, then the bias added and rounded again.
        let want: Vec<f32> = (product.f32().iter().enumerate())
            .map(|(i, &p)| round_bf16(round_bf16(p) + bias.f32()[i % 5]))
            .collect();
        let want = Buffer::F32(want);
        let mut got = Buffer::zeros(DType::Bf16, 15);
        cpu.dense_forward(
            &mut CpuStream,
            &op,
            f32_in(x_rect, &x16),
            f32_in(w_rect, &w16),
            Some(f32_in(bias_rect, &bias)),
            Out {
                rect: y_rect,
                mem: &mut got,
            },
        );
        assert_eq!(got, bits(want.f32()));

        // A gradient the driver lends in bf16 is rounded once too; the weight's stays f32.
        let dy = bits(&random(15, 4));
        let (mut dx, mut dw, mut db) = (
            Buffer::zeros(DType::Bf16, 21),
            Buffer::zeros(DType::F32, 35),
            Buffer::zeros(DType::F32, 5),
        );
        let (mut dx32, mut dw32, mut db32) = (
            Buffer::zeros(DType::F32, 21),
            Buffer::zeros(DType::F32, 35),
            Buffer::zeros(DType::F32, 5),
        );
        let dyw = Buffer::F32(dy.to_f32());
        let y = bits(want.f32());
        let yw = Buffer::F32(y.to_f32());
        cpu.dense_backward(
            &mut CpuStream,
            &op,
            f32_in(x_rect, &x16),
            f32_in(w_rect, &w16),
            f32_in(y_rect, &y),
            f32_in(y_rect, &dy),
            Some(Out {
                rect: x_rect,
                mem: &mut dx,
            }),
            Out {
                rect: w_rect,
                mem: &mut dw,
            },
            Some(Out {
                rect: bias_rect,
                mem: &mut db,
            }),
        );
        cpu.dense_backward(
            &mut CpuStream,
            &op,
            f32_in(x_rect, &xw),
            f32_in(w_rect, &ww),
            f32_in(y_rect, &yw),
            f32_in(y_rect, &dyw),
            Some(Out {
                rect: x_rect,
                mem: &mut dx32,
            }),
            Out {
                rect: w_rect,
                mem: &mut dw32,
            },
            Some(Out {
                rect: bias_rect,
                mem: &mut db32,
            }),
        );
        assert_eq!(dx, bits(dx32.f32()));
        assert_eq!((dw, db), (dw32, db32));
    }

    #[test]
    fn casts_and_copies_convert_between_every_element_type() {
        let cpu = Cpu::default();
        let rect = Rect::new(&[0], &[4]);
        let v = vec![1.0f32, -2.5, 1.0 + 1.0 / 256.0, f32::MAX];
        let mut b = Buffer::zeros(DType::Bf16, 4);
        cpu.cast(
            &mut CpuStream,
            In {
                rect,
                mem: &Buffer::F32(v.clone()),
            },
            Out { rect, mem: &mut b },
        );
        // ties to even; past the largest bf16, infinity
        assert_eq!(b.to_f32(), vec![1.0, -2.5, 1.0, f32::INFINITY]);
        let mut d = Buffer::zeros(DType::F64, 4);
        cpu.cast(
            &mut CpuStream,
            In { rect, mem: &b },
            Out { rect, mem: &mut d },
        );
        assert_eq!(d.f64()[1], -2.5);
        // a reshape's copy keeps the values whatever the rects
        let (flat, square) = (Rect::new(&[0, 0], &[1, 4]), Rect::new(&[0, 0], &[2, 2]));
        let mut y = Buffer::zeros(DType::Bf16, 4);
        cpu.copy(
            &mut CpuStream,
            In {
                rect: flat,
                mem: &b,
            },
            Out {
                rect: square,
                mem: &mut y,
            },
        );
        assert_eq!(y, b);
        // a bf16 sum adds in f32 and rounds once
        let mut acc = bits(&[256.0, 0.0, 0.0, 0.0]);
        cpu.accumulate(
            &mut CpuStream,
            Out {
                rect,
                mem: &mut acc,
            },
            In {
                rect,
                mem: &bits(&[3.0, 1.0, 0.0, 0.0]),
            },
        );
        assert_eq!(acc.to_f32(), vec![260.0, 1.0, 0.0, 0.0]);
    }
}
