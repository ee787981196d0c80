//! The CPU backend: host memory, and the kernels of `crate::kernels` run on the calling thread
//! (parallelised on the current rayon pool). Its stream is a marker: a primitive has finished when
//! it returns.

pub mod buffer;

pub use buffer::Buffer;

use super::{Backend, DType, In, KernelError, LossSums, Out};
use crate::kernels::batch_norm::{self, BatchStats, GradSums, MomentSums};
use crate::kernels::dropout::DropoutMask;
use crate::kernels::{self, View, ViewMut};
use crate::op::{BatchNorm, Concat, Conv2d, Dense, OpSpec, Pool2d};
use crate::shape::{Rect, Shape, copy_rect};
use crate::train::Sgd;

/// Host memory and the CPU kernels.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// The CPU's queue: work runs when it is enqueued.
#[derive(Debug, Default)]
pub struct CpuStream;

fn view<'a>(x: In<'a, Buffer>) -> View<'a> {
    View::new(x.rect, x.mem.f32())
}

fn view_mut<'a>(y: Out<'a, Buffer>) -> ViewMut<'a> {
    ViewMut::new(y.rect, y.mem.f32_mut())
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

/// A zeroed scratch gradient for an operand the driver did not lend.
fn scratch(rect: Rect) -> Vec<f32> {
    vec![0.0; rect.volume()]
}

impl Backend for Cpu {
    type Buffer = Buffer;
    type Stream = CpuStream;
    type Loss = LossSums;
    /// Host memory is the device's: staging is the copy `load_images` would make.
    type Staged = Buffer;
    /// Work has run when its primitive returns: the host's clock times it.
    type Marker = std::time::Instant;

    fn alloc_zeros(
        &self,
        _: &mut CpuStream,
        dtype: DType,
        len: usize,
    ) -> Result<Buffer, KernelError> {
        if dtype == DType::Bf16 {
            return Err(KernelError::Device(
                "the CPU backend stores no bf16: it computes in fp32 (--precision bf16 needs a GPU)"
                    .into(),
            ));
        }
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

    /// Between the CPU's two element types (it stores no bf16: `alloc` refuses it).
    fn cast(&self, _: &mut CpuStream, from: In<Buffer>, to: Out<Buffer>) {
        debug_assert_eq!(from.rect, to.rect, "cast converts buffers over one rect");
        match (from.mem, to.mem) {
            (Buffer::F32(a), Buffer::F32(b)) => b.copy_from_slice(a),
            (Buffer::F64(a), Buffer::F64(b)) => b.copy_from_slice(a),
            (Buffer::F32(a), Buffer::F64(b)) => {
                b.iter_mut().zip(a).for_each(|(b, a)| *b = f64::from(*a))
            }
            (Buffer::F64(a), Buffer::F32(b)) => {
                b.iter_mut().zip(a).for_each(|(b, a)| *b = *a as f32)
            }
        }
    }

    fn accumulate(&self, _: &mut CpuStream, acc: Out<Buffer>, term: In<Buffer>) {
        debug_assert_eq!(acc.rect, term.rect, "accumulate sums buffers over one rect");
        // Element by element, in the order the consumers are visited.
        for (a, b) in acc.mem.f32_mut().iter_mut().zip(term.mem.f32()) {
            *a += *b;
        }
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
    fn send_loss_home(&self, _: &mut CpuStream, loss: LossSums) -> Result<LossSums, KernelError> {
        Ok(loss)
    }

    fn read_loss(&self, loss: LossSums) -> LossSums {
        loss
    }

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

    fn recycle_staged(&self, _: &mut CpuStream, _images: Buffer) {}

    type Graph = std::convert::Infallible;

    fn fix_step(
        &self,
        s: &mut CpuStream,
        _step: u64,
        images: In<Buffer>,
        fixed: Out<Buffer>,
    ) -> Result<(), KernelError> {
        self.copy(s, images, fixed);
        Ok(())
    }

    fn begin_capture(&self, _: &mut CpuStream) -> Result<(), KernelError> {
        Err(KernelError::Device(
            "the CPU runs each kernel when it is called: there is no queue to record".into(),
        ))
    }

    fn end_capture(&self, _: &mut CpuStream) -> Result<Self::Graph, KernelError> {
        Err(KernelError::Device(
            "no capture was begun on the CPU".into(),
        ))
    }

    fn abandon_capture(&self, _: &mut CpuStream) {}

    fn replay(&self, _: &mut CpuStream, graph: &Self::Graph) -> Result<Vec<LossSums>, KernelError> {
        match *graph {}
    }

    fn load_images(
        &self,
        _: &mut CpuStream,
        images: &[f32],
        held: &Rect,
        tile: &Rect,
        y: Out<Buffer>,
    ) {
        copy_rect(images, held, y.mem.f32_mut(), &y.rect, tile);
    }

    fn copy(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        y.mem.f32_mut().copy_from_slice(x.mem.f32());
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
        kernels::conv2d::conv2d_forward(op, in_shape, view(x), view(w), b.map(view), view_mut(y));
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
        kernels::conv2d::conv2d_backward(
            op,
            in_shape,
            view(x),
            view(w),
            view(y),
            view(dy),
            dx.map(view_mut),
            view_mut(dw),
            db.map(view_mut),
        );
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
        kernels::dense::dense_forward(op, view(x), view(w), b.map(view), view_mut(y));
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
            view(x),
            view(w),
            view(y),
            view(dy),
            dx.map(view_mut),
            view_mut(dw),
            db.map(view_mut),
        );
    }

    fn pool2d_forward(
        &self,
        _: &mut CpuStream,
        op: &Pool2d,
        in_shape: Shape,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        kernels::pool2d::pool2d_forward(op, in_shape, view(x), view_mut(y));
    }

    fn pool2d_backward(
        &self,
        _: &mut CpuStream,
        op: &Pool2d,
        in_shape: Shape,
        x: In<Buffer>,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        kernels::pool2d::pool2d_backward(op, in_shape, view(x), view(dy), view_mut(dx));
    }

    fn relu_forward(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        kernels::relu::relu_forward(view(x), view_mut(y));
    }

    fn relu_backward(&self, _: &mut CpuStream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        kernels::relu::relu_backward(view(y), view(dy), view_mut(dx));
    }

    fn sigmoid_forward(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        kernels::sigmoid::sigmoid_forward(view(x), view_mut(y));
    }

    fn sigmoid_backward(&self, _: &mut CpuStream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        kernels::sigmoid::sigmoid_backward(view(y), view(dy), view_mut(dx));
    }

    fn tanh_forward(&self, _: &mut CpuStream, x: In<Buffer>, y: Out<Buffer>) {
        kernels::tanh::tanh_forward(view(x), view_mut(y));
    }

    fn tanh_backward(&self, _: &mut CpuStream, y: In<Buffer>, dy: In<Buffer>, dx: Out<Buffer>) {
        kernels::tanh::tanh_backward(view(y), view(dy), view_mut(dx));
    }

    fn add_forward(&self, _: &mut CpuStream, a: In<Buffer>, b: In<Buffer>, y: Out<Buffer>) {
        kernels::add::add_forward(view(a), view(b), view_mut(y));
    }

    fn add_backward(
        &self,
        _: &mut CpuStream,
        dy: In<Buffer>,
        da: Option<Out<Buffer>>,
        db: Option<Out<Buffer>>,
    ) {
        let (mut scratch_a, mut scratch_b);
        let da = match da {
            Some(d) => view_mut(d),
            None => {
                scratch_a = scratch(dy.rect);
                ViewMut::new(dy.rect, &mut scratch_a)
            }
        };
        let db = match db {
            Some(d) => view_mut(d),
            None => {
                scratch_b = scratch(dy.rect);
                ViewMut::new(dy.rect, &mut scratch_b)
            }
        };
        kernels::add::add_backward(view(dy), da, db);
    }

    fn concat_forward(
        &self,
        _: &mut CpuStream,
        input_shapes: &[Shape],
        xs: &[Option<In<Buffer>>],
        y: Out<Buffer>,
    ) {
        let views: Vec<View> = xs
            .iter()
            .zip(input_shapes)
            .map(|(x, shape)| match x {
                Some(x) => view(*x),
                None => {
                    let zero = vec![0; shape.ndim()];
                    View::new(Rect::new(&zero, &zero), &[])
                }
            })
            .collect();
        kernels::concat::concat_forward(input_shapes, &views, view_mut(y));
    }

    fn concat_backward(
        &self,
        _: &mut CpuStream,
        input_shapes: &[Shape],
        dy: In<Buffer>,
        dxs: Vec<Option<Out<Buffer>>>,
    ) {
        let rects = Concat {}.project(input_shapes, &dy.rect);
        let mut scratches: Vec<Vec<f32>> = dxs
            .iter()
            .zip(&rects)
            .map(|(d, r)| if d.is_some() { Vec::new() } else { scratch(*r) })
            .collect();
        let mut views: Vec<ViewMut> = dxs
            .into_iter()
            .zip(scratches.iter_mut())
            .zip(&rects)
            .map(|((d, s), r)| match d {
                Some(d) => view_mut(d),
                None => ViewMut::new(*r, s),
            })
            .collect();
        kernels::concat::concat_backward(input_shapes, view(dy), &mut views);
    }

    fn dropout_forward(
        &self,
        _: &mut CpuStream,
        mask: &DropoutMask,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) {
        kernels::dropout::dropout_forward(mask, view(x), view_mut(y));
    }

    fn dropout_backward(
        &self,
        _: &mut CpuStream,
        mask: &DropoutMask,
        dy: In<Buffer>,
        dx: Out<Buffer>,
    ) {
        kernels::dropout::dropout_backward(mask, view(dy), view_mut(dx));
    }

    fn softmax_ce_forward(
        &self,
        _: &mut CpuStream,
        logits: In<Buffer>,
        labels: &[u32],
        y: Out<Buffer>,
    ) -> Result<LossSums, KernelError> {
        let logits = view(logits);
        let rows = y.rect;
        let loss_sum = kernels::softmax_ce::softmax_ce_forward(logits, labels, view_mut(y))?;
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
        kernels::softmax_ce::softmax_ce_backward(view(logits), labels, scale, view_mut(dlogits))?;
        Ok(())
    }

    fn bn_moments(&self, _: &mut CpuStream, x: In<Buffer>, tile: &Rect, moments: Out<Buffer>) {
        let sums = batch_norm::partial_moments(view(x), tile);
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
            view(x),
            &stats,
            view(gamma),
            view(beta),
            op.relu,
            view_mut(y),
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
        stats.update_running(op.momentum, view_mut(running_mean), view_mut(running_var));
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
        let sums = batch_norm::partial_grad_sums(view(x), y.map(view), view(dy), &stats, tile);
        sums.param_grads(view_mut(dgamma), view_mut(dbeta));
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
            view(x),
            y.map(view),
            view(dy),
            &stats,
            view(gamma),
            &sums,
            view_mut(dx),
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
