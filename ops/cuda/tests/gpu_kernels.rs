//! Every primitive of the `Backend` trait on the GPU against the CPU backend, over whole tensors
//! and tiles: halos of padded strided convolutions and poolings, channel splits (through conv
//! groups too), sample splits, input views larger than the tile, batch norm with and without the
//! fused ReLU, concat with an untouched input.
//!
//! Each case is written once, generic over the backend, and run on both; outputs start as the same
//! sentinel, so positions a kernel must not write are compared too. A case passes when
//! `max |gpu − cpu| / max |cpu| ≤ 1e-5` for every output. All failing cases are reported at the
//! end, not only the first. Without a usable GPU the test prints `skipped: <reason>` and passes
//! (fails where `LEGION_REQUIRE` lists `gpu`).

use legion_cuda::{Cuda, Math, Stream};
use legion_ops::backend::cpu::{self, Cpu, CpuStream};
use legion_ops::backend::{Backend, In, KernelError, Out};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::op::{
    AdaptiveAvgPool2d, BatchNorm, Conv2d, Dense, OpSpec, Pool2d, PoolWindows, UnaryOp,
};
use legion_ops::rng::Rng;
use legion_ops::shape::{Rect, Shape};
use legion_ops::train::Sgd;
use std::panic::{AssertUnwindSafe, catch_unwind};

const TOLERANCE: f64 = 1e-5;

/// With TF32 products: each input rounded to 10 mantissa bits (relative 2^-11 ≈ 4.9e-4), sums of
/// hundreds of such products in FP32; relative to the largest output, a few times that.
const TF32_TOLERANCE: f64 = 5e-3;
/// What output buffers hold before a kernel runs, on both backends.
const SENTINEL: f32 = -7.25;

/// Moving host data on and off a backend.
trait Device: Backend {
    fn put(&self, s: &mut Self::Stream, host: &cpu::Buffer) -> Self::Buffer;
    /// Waits for the stream, then copies `buffer` to the host.
    fn get(&self, s: &mut Self::Stream, buffer: &Self::Buffer) -> cpu::Buffer;
}

impl Device for Cpu {
    fn put(&self, _: &mut CpuStream, host: &cpu::Buffer) -> cpu::Buffer {
        host.clone()
    }
    fn get(&self, _: &mut CpuStream, buffer: &cpu::Buffer) -> cpu::Buffer {
        buffer.clone()
    }
}

impl Device for Cuda {
    fn put(&self, s: &mut Stream, host: &cpu::Buffer) -> legion_cuda::Buffer {
        self.upload(s, host).unwrap_or_else(|e| panic!("{e}"))
    }
    fn get(&self, s: &mut Stream, buffer: &legion_cuda::Buffer) -> cpu::Buffer {
        self.synchronize(s).unwrap_or_else(|e| panic!("{e}"));
        self.download(s, buffer).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Named outputs of one run of a case.
type Outputs = Vec<(&'static str, cpu::Buffer)>;

fn random(rect: &Rect, seed: u64) -> cpu::Buffer {
    let mut rng = Rng::new(seed);
    cpu::Buffer::F32((0..rect.volume()).map(|_| rng.uniform(-1.0, 1.0)).collect())
}

fn positive(rect: &Rect, seed: u64) -> cpu::Buffer {
    let mut rng = Rng::new(seed);
    cpu::Buffer::F32((0..rect.volume()).map(|_| rng.uniform(0.5, 1.5)).collect())
}

fn sentinel(rect: &Rect) -> cpu::Buffer {
    cpu::Buffer::F32(vec![SENTINEL; rect.volume()])
}

fn sentinel_f64(len: usize) -> cpu::Buffer {
    cpu::Buffer::F64(vec![SENTINEL as f64; len])
}

fn r(lo: &[usize], hi: &[usize]) -> Rect {
    Rect::new(lo, hi)
}

/// 1-d rect over channels `[lo, hi)`.
fn channels(lo: usize, hi: usize) -> Rect {
    Rect::new(&[lo], &[hi])
}

/// `[3, C]` sums over channels `[lo, hi)`.
fn sums_rect(lo: usize, hi: usize) -> Rect {
    Rect::new(&[0, lo], &[3, hi])
}

/// A host operand: data laid out over a rect.
#[derive(Clone)]
struct Host {
    rect: Rect,
    data: cpu::Buffer,
}

impl Host {
    fn random(rect: Rect, seed: u64) -> Host {
        Host {
            data: random(&rect, seed),
            rect,
        }
    }
    fn positive(rect: Rect, seed: u64) -> Host {
        Host {
            data: positive(&rect, seed),
            rect,
        }
    }
}

/// An operand on a device.
struct Dev<B> {
    rect: Rect,
    mem: B,
}

impl<B> Dev<B> {
    fn read(&self) -> In<'_, B> {
        In {
            rect: self.rect,
            mem: &self.mem,
        }
    }
    fn write(&mut self) -> Out<'_, B> {
        Out {
            rect: self.rect,
            mem: &mut self.mem,
        }
    }
}

fn put<D: Device>(d: &D, s: &mut D::Stream, host: &Host) -> Dev<D::Buffer> {
    Dev {
        rect: host.rect,
        mem: d.put(s, &host.data),
    }
}

/// An output operand over `rect`, holding the sentinel.
fn out<D: Device>(d: &D, s: &mut D::Stream, rect: Rect) -> Dev<D::Buffer> {
    Dev {
        rect,
        mem: d.put(s, &sentinel(&rect)),
    }
}

fn out_sums<D: Device>(d: &D, s: &mut D::Stream, rect: Rect) -> Dev<D::Buffer> {
    Dev {
        rect,
        mem: d.put(s, &sentinel_f64(rect.volume())),
    }
}

/// `max |a − b| / max |b|` (absolute when b is all zeros); infinite when the lengths or the
/// positions of NaNs differ.
fn relative_error(gpu: &cpu::Buffer, cpu: &cpu::Buffer) -> f64 {
    let widen = |b: &cpu::Buffer| -> Vec<f64> {
        match b {
            cpu::Buffer::F32(v) => v.iter().map(|&x| x as f64).collect(),
            cpu::Buffer::F64(v) => v.clone(),
            bf16 => bf16.to_f32().into_iter().map(f64::from).collect(),
        }
    };
    let (g, c) = (widen(gpu), widen(cpu));
    if g.len() != c.len() || gpu.dtype() != cpu.dtype() {
        return f64::INFINITY;
    }
    let mut max_diff = 0.0f64;
    let mut max_value = 0.0f64;
    for (a, b) in g.iter().zip(&c) {
        if a.is_nan() || b.is_nan() {
            if a.is_nan() != b.is_nan() {
                return f64::INFINITY;
            }
            continue;
        }
        max_diff = max_diff.max((a - b).abs());
        max_value = max_value.max(b.abs());
    }
    if max_value > 0.0 {
        max_diff / max_value
    } else {
        max_diff
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".to_string())
}

struct Harness {
    cuda: Cuda,
    stream: Stream,
    /// The largest relative error a case may show.
    tolerance: f64,
    failures: Vec<String>,
    passed: usize,
}

impl Harness {
    fn start() -> Option<Harness> {
        Harness::start_with(Math::StrictFp32, TOLERANCE)
    }

    fn start_with(math: Math, tolerance: f64) -> Option<Harness> {
        let cuda = match Cuda::with_math(0, math) {
            Ok(cuda) => cuda,
            Err(reason) => {
                legion_ops::require::skip(legion_ops::require::Need::Gpu, reason);
                return None;
            }
        };
        let stream = cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
        Some(Harness {
            cuda,
            stream,
            tolerance,
            failures: Vec::new(),
            passed: 0,
        })
    }

    /// Compares a case's outputs on the two backends; a panic on either side fails the case.
    fn compare(
        &mut self,
        name: &str,
        cpu_run: impl FnOnce() -> Outputs,
        gpu_run: impl FnOnce(&Cuda, &mut Stream) -> Outputs,
    ) {
        let cpu = match catch_unwind(AssertUnwindSafe(cpu_run)) {
            Ok(outputs) => outputs,
            Err(p) => {
                self.failures.push(format!(
                    "{name}: CPU reference panicked: {}",
                    panic_message(p)
                ));
                return;
            }
        };
        let (cuda, stream) = (&self.cuda, &mut self.stream);
        let gpu = match catch_unwind(AssertUnwindSafe(|| gpu_run(cuda, stream))) {
            Ok(outputs) => outputs,
            Err(p) => {
                self.failures
                    .push(format!("{name}: GPU run failed: {}", panic_message(p)));
                // A failed stream stays failed: start the next case on a fresh one.
                self.stream = self.cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
                return;
            }
        };
        let mut ok = true;
        for ((what, g), (_, c)) in gpu.iter().zip(&cpu) {
            let error = relative_error(g, c);
            if error.is_nan() || error > self.tolerance {
                ok = false;
                self.failures.push(format!(
                    "{name}: {what}: relative error {error:.3e} > {:e}",
                    self.tolerance
                ));
            }
        }
        if ok {
            self.passed += 1;
        }
    }

    /// What cuBLAS reports for a stream of a strict-FP32 backend on the same GPU.
    fn cuda_strict_stream_math(&self) -> Math {
        let cuda = Cuda::new(0).unwrap_or_else(|e| panic!("{e}"));
        let stream = cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
        stream.cublas_math().unwrap_or_else(|e| panic!("{e}"))
    }

    fn finish(self) {
        println!(
            "{} cases passed, {} failures",
            self.passed,
            self.failures.len()
        );
        assert!(
            self.failures.is_empty(),
            "{} failing checks:\n{}",
            self.failures.len(),
            self.failures.join("\n")
        );
    }
}

/// Runs the same generic case on the CPU and on the GPU.
macro_rules! both {
    ($h:expr, $name:expr, |$d:ident, $s:ident| $body:expr) => {{
        let name: String = $name.to_string();
        $h.compare(
            &name,
            || {
                let $d = &Cpu::default();
                let $s = &mut CpuStream;
                $body
            },
            |$d, $s| $body,
        );
    }};
}

// ---------------------------------------------------------------------------------------------
// Generic cases.

/// ReLU (the op convolutions fuse) or an op of the unary family.
#[derive(Clone, Copy, Debug)]
enum Unary {
    Relu,
    Op(UnaryOp),
}

impl Unary {
    /// ReLU, then every op of the unary family, and LeakyReLU with another slope than its default.
    fn all() -> impl Iterator<Item = Unary> {
        let family = legion_ops::op::Unary::ALL
            .iter()
            .map(|&u| Unary::Op(u.into()));
        let slope = UnaryOp::with_alpha(legion_ops::op::Unary::LeakyRelu, 0.3);
        std::iter::once(Unary::Relu)
            .chain(family)
            .chain([Unary::Op(slope)])
    }
}

fn unary_forward<D: Device>(
    d: &D,
    s: &mut D::Stream,
    kind: Unary,
    x: &Host,
    tile: Rect,
) -> Outputs {
    let x = put(d, s, x);
    let mut y = out(d, s, tile);
    match kind {
        Unary::Relu => d.relu_forward(s, x.read(), y.write()),
        Unary::Op(op) => d.unary_forward(s, op, x.read(), y.write()),
    }
    vec![("y", d.get(s, &y.mem))]
}

fn unary_backward<D: Device>(
    d: &D,
    s: &mut D::Stream,
    kind: Unary,
    y: &Host,
    dy: &Host,
    tile: Rect,
) -> Outputs {
    let (y, dy) = (put(d, s, y), put(d, s, dy));
    let mut dx = out(d, s, tile);
    match kind {
        Unary::Relu => d.relu_backward(s, y.read(), dy.read(), dx.write()),
        Unary::Op(op) => d.unary_backward(s, op, y.read(), dy.read(), dx.write()),
    }
    vec![("dx", d.get(s, &dx.mem))]
}

fn add_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    a: &Host,
    b: &Host,
    dy: &Host,
    tile: Rect,
    grads: (bool, bool),
) -> Outputs {
    let (a, b, dy) = (put(d, s, a), put(d, s, b), put(d, s, dy));
    let mut y = out(d, s, tile);
    d.add_forward(s, a.read(), b.read(), y.write());
    let (mut da, mut db) = (out(d, s, tile), out(d, s, tile));
    d.add_backward(
        s,
        dy.read(),
        grads.0.then(|| da.write()),
        grads.1.then(|| db.write()),
    );
    vec![
        ("y", d.get(s, &y.mem)),
        ("da", d.get(s, &da.mem)),
        ("db", d.get(s, &db.mem)),
    ]
}

/// `Mul` over `tile`: y = x · s, and both gradients (a channel scale's summed over the tile's
/// rows and columns, with every operand laid out over more than the tile).
fn mul_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    x: &Host,
    scale: &Host,
    dy: &Host,
    tile: Rect,
) -> Outputs {
    let (x, scale, dy) = (put(d, s, x), put(d, s, scale), put(d, s, dy));
    let ds_rect = if legion_ops::kernels::mul::is_channel_scale(&scale.rect) {
        tile.with_axis(2, 0, 1).with_axis(3, 0, 1)
    } else {
        tile
    };
    let (mut y, mut dx, mut ds) = (out(d, s, tile), out(d, s, tile), out(d, s, ds_rect));
    d.mul_forward(s, x.read(), scale.read(), y.write());
    d.mul_backward(
        s,
        &tile,
        x.read(),
        scale.read(),
        dy.read(),
        Some(dx.write()),
        Some(ds.write()),
    );
    vec![
        ("y", d.get(s, &y.mem)),
        ("dx", d.get(s, &dx.mem)),
        ("ds", d.get(s, &ds.mem)),
    ]
}

fn dropout_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    mask: &DropoutMask,
    x: &Host,
    dy: &Host,
    tile: Rect,
) -> Outputs {
    let (x, dy) = (put(d, s, x), put(d, s, dy));
    let (mut y, mut dx) = (out(d, s, tile), out(d, s, tile));
    d.dropout_forward(s, mask, x.read(), y.write());
    d.dropout_backward(s, mask, dy.read(), dx.write());
    vec![("y", d.get(s, &y.mem)), ("dx", d.get(s, &dx.mem))]
}

fn copy_case<D: Device>(d: &D, s: &mut D::Stream, x: &Host, y_rect: Rect) -> Outputs {
    let x = put(d, s, x);
    let mut y = out(d, s, y_rect);
    d.copy(s, x.read(), y.write());
    vec![("y", d.get(s, &y.mem))]
}

fn load_images_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    images: &[f32],
    held: Rect,
    tile: Rect,
    y_rect: Rect,
) -> Outputs {
    let mut y = out(d, s, y_rect);
    d.load_images(s, images, &held, &tile, y.write());
    vec![("y", d.get(s, &y.mem))]
}

/// A conv tile: forward, then backward from the CPU forward's output (so both backends mask
/// the same positions through the fused ReLU).
struct ConvCase {
    op: Conv2d,
    in_shape: Shape,
    tile: Rect,
    x: Host,
    w: Host,
    b: Option<Host>,
    y: Host,
    dy: Host,
    with_dx: bool,
}

impl ConvCase {
    /// `x_rect`: the input view (`None`: the op's projection of the tile).
    fn new(op: Conv2d, in_shape: Shape, tile: Rect, x_rect: Option<Rect>, seed: u64) -> ConvCase {
        let x_rect = x_rect.unwrap_or_else(|| op.project(&[in_shape], &tile)[0]);
        let params = op.params(&[in_shape]);
        let w_rect = params[0]
            .shape
            .full_rect()
            .with_axis(0, tile.lo[1], tile.hi[1]);
        let x = Host::random(x_rect, seed);
        let w = Host::random(w_rect, seed + 1);
        let b = op
            .bias
            .then(|| Host::random(channels(tile.lo[1], tile.hi[1]), seed + 2));
        let mut y = cpu::Buffer::F32(vec![0.0; tile.volume()]);
        Cpu::default().conv2d_forward(
            &mut CpuStream,
            &op,
            in_shape,
            In {
                rect: x.rect,
                mem: &x.data,
            },
            In {
                rect: w.rect,
                mem: &w.data,
            },
            b.as_ref().map(|b| In {
                rect: b.rect,
                mem: &b.data,
            }),
            Out {
                rect: tile,
                mem: &mut y,
            },
        );
        ConvCase {
            dy: Host::random(tile, seed + 3),
            y: Host {
                rect: tile,
                data: y,
            },
            op,
            in_shape,
            tile,
            x,
            w,
            b,
            with_dx: true,
        }
    }

    fn run<D: Device>(&self, d: &D, s: &mut D::Stream) -> Outputs {
        let (x, w) = (put(d, s, &self.x), put(d, s, &self.w));
        let b = self.b.as_ref().map(|b| put(d, s, b));
        let mut y = out(d, s, self.tile);
        d.conv2d_forward(
            s,
            &self.op,
            self.in_shape,
            x.read(),
            w.read(),
            b.as_ref().map(|b| b.read()),
            y.write(),
        );
        let (y_ref, dy) = (put(d, s, &self.y), put(d, s, &self.dy));
        let mut dx = out(d, s, self.x.rect);
        let mut dw = out(d, s, self.w.rect);
        let mut db = self.b.as_ref().map(|b| out(d, s, b.rect));
        d.conv2d_backward(
            s,
            &self.op,
            self.in_shape,
            x.read(),
            w.read(),
            y_ref.read(),
            dy.read(),
            self.with_dx.then(|| dx.write()),
            dw.write(),
            db.as_mut().map(|db| db.write()),
        );
        let mut outputs = vec![
            ("y", d.get(s, &y.mem)),
            ("dx", d.get(s, &dx.mem)),
            ("dw", d.get(s, &dw.mem)),
        ];
        if let Some(db) = &db {
            outputs.push(("db", d.get(s, &db.mem)));
        }
        outputs
    }
}

struct DenseCase {
    op: Dense,
    tile: Rect,
    x: Host,
    w: Host,
    b: Option<Host>,
    y: Host,
    dy: Host,
}

impl DenseCase {
    fn new(op: Dense, inputs: usize, tile: Rect, x_rows: (usize, usize), seed: u64) -> DenseCase {
        let x = Host::random(r(&[x_rows.0, 0], &[x_rows.1, inputs]), seed);
        let w = Host::random(r(&[tile.lo[1], 0], &[tile.hi[1], inputs]), seed + 1);
        let b = op
            .bias
            .then(|| Host::random(channels(tile.lo[1], tile.hi[1]), seed + 2));
        let mut y = cpu::Buffer::F32(vec![0.0; tile.volume()]);
        Cpu::default().dense_forward(
            &mut CpuStream,
            &op,
            In {
                rect: x.rect,
                mem: &x.data,
            },
            In {
                rect: w.rect,
                mem: &w.data,
            },
            b.as_ref().map(|b| In {
                rect: b.rect,
                mem: &b.data,
            }),
            Out {
                rect: tile,
                mem: &mut y,
            },
        );
        DenseCase {
            dy: Host::random(tile, seed + 3),
            y: Host {
                rect: tile,
                data: y,
            },
            op,
            tile,
            x,
            w,
            b,
        }
    }

    fn run<D: Device>(&self, d: &D, s: &mut D::Stream) -> Outputs {
        let (x, w) = (put(d, s, &self.x), put(d, s, &self.w));
        let b = self.b.as_ref().map(|b| put(d, s, b));
        let mut y = out(d, s, self.tile);
        d.dense_forward(
            s,
            &self.op,
            x.read(),
            w.read(),
            b.as_ref().map(|b| b.read()),
            y.write(),
        );
        let (y_ref, dy) = (put(d, s, &self.y), put(d, s, &self.dy));
        let mut dx = out(d, s, self.x.rect);
        let mut dw = out(d, s, self.w.rect);
        let mut db = self.b.as_ref().map(|b| out(d, s, b.rect));
        d.dense_backward(
            s,
            &self.op,
            x.read(),
            w.read(),
            y_ref.read(),
            dy.read(),
            Some(dx.write()),
            dw.write(),
            db.as_mut().map(|db| db.write()),
        );
        let mut outputs = vec![
            ("y", d.get(s, &y.mem)),
            ("dx", d.get(s, &dx.mem)),
            ("dw", d.get(s, &dw.mem)),
        ];
        if let Some(db) = &db {
            outputs.push(("db", d.get(s, &db.mem)));
        }
        outputs
    }
}

fn pool_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    op: PoolWindows<'_>,
    in_shape: Shape,
    x: &Host,
    dy: &Host,
) -> Outputs {
    let tile = dy.rect;
    let (x, dy) = (put(d, s, x), put(d, s, dy));
    let mut y = out(d, s, tile);
    d.pool2d_forward(s, op, in_shape, x.read(), y.write());
    let mut dx = out(d, s, x.rect);
    d.pool2d_backward(s, op, in_shape, x.read(), dy.read(), dx.write());
    vec![("y", d.get(s, &y.mem)), ("dx", d.get(s, &dx.mem))]
}

/// `xs[k]`: input k's view, or `None` where the tile reads nothing of it; `dxs[k]`: whether input
/// k's gradient is asked for (over its projection of the tile).
fn concat_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    shapes: &[Shape],
    xs: &[Option<Host>],
    dy: &Host,
    dx_rects: &[Option<Rect>],
) -> Outputs {
    let tile = dy.rect;
    let xs: Vec<Option<Dev<D::Buffer>>> = xs
        .iter()
        .map(|x| x.as_ref().map(|x| put(d, s, x)))
        .collect();
    let reads: Vec<Option<In<D::Buffer>>> =
        xs.iter().map(|x| x.as_ref().map(|x| x.read())).collect();
    let mut y = out(d, s, tile);
    d.concat_forward(s, shapes, &reads, y.write());
    let dy = put(d, s, dy);
    let mut dxs: Vec<Option<Dev<D::Buffer>>> =
        dx_rects.iter().map(|r| r.map(|r| out(d, s, r))).collect();
    let writes = dxs
        .iter_mut()
        .map(|dx| dx.as_mut().map(|dx| dx.write()))
        .collect();
    d.concat_backward(s, shapes, dy.read(), writes);
    let mut outputs = vec![("y", d.get(s, &y.mem))];
    for dx in dxs.iter().flatten() {
        outputs.push(("dx", d.get(s, &dx.mem)));
    }
    outputs
}

fn softmax_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    logits: &Host,
    labels: &[u32],
    rows: (usize, usize),
    scale: f32,
) -> Outputs {
    let classes = logits.rect.hi[1];
    let logits = put(d, s, logits);
    let mut loss = out(d, s, r(&[rows.0, 0], &[rows.1, 1]));
    let pending = d
        .softmax_ce_forward(s, logits.read(), labels, loss.write())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut dlogits = out(d, s, r(&[rows.0, 0], &[rows.1, classes]));
    d.softmax_ce_backward(s, logits.read(), labels, scale, dlogits.write())
        .unwrap_or_else(|e| panic!("{e}"));
    d.synchronize(s).unwrap_or_else(|e| panic!("{e}"));
    let sums = d.read_loss(pending);
    vec![
        ("loss", d.get(s, &loss.mem)),
        ("dlogits", d.get(s, &dlogits.mem)),
        ("loss_sum", cpu::Buffer::F64(vec![sums.loss_sum])),
        ("correct", cpu::Buffer::F64(vec![sums.correct as f64])),
    ]
}

/// The whole-batch `[3, C]` sums of `x` over channels `[c0, c1)`, from the CPU.
fn cpu_moments(x: &Host, c0: usize, c1: usize) -> Host {
    let full = x.rect.with_axis(1, c0, c1);
    let mut moments = sentinel_f64(3 * (c1 - c0));
    Cpu::default().bn_moments(
        &mut CpuStream,
        In {
            rect: x.rect,
            mem: &x.data,
        },
        &full,
        Out {
            rect: sums_rect(c0, c1),
            mem: &mut moments,
        },
    );
    Host {
        rect: sums_rect(c0, c1),
        data: moments,
    }
}

struct BnCase {
    op: BatchNorm,
    x: Host,
    /// The tile of the per-tile phases.
    tile: Rect,
    /// Whole-batch moments of the tile's channel group.
    moments: Host,
    gamma: Host,
    beta: Host,
    /// The forward output (CPU, whole batch), read by the fused ReLU's backward.
    y: Host,
    dy: Host,
    /// Whole-batch gradient sums of the channel group.
    grad_sums: Host,
    running_mean: Host,
    running_var: Host,
}

impl BnCase {
    fn new(op: BatchNorm, shape: Shape, tile: Rect, group: (usize, usize), seed: u64) -> BnCase {
        let full = shape.full_rect();
        let c = shape.dim(1);
        let x = Host::random(full, seed);
        let moments = cpu_moments(&x, group.0, group.1);
        let gamma = Host::positive(channels(0, c), seed + 1);
        let beta = Host::random(channels(0, c), seed + 2);
        let group_rect = full.with_axis(1, group.0, group.1);
        let mut y = sentinel(&group_rect);
        Cpu::default().bn_normalize(
            &mut CpuStream,
            &op,
            In {
                rect: x.rect,
                mem: &x.data,
            },
            In {
                rect: moments.rect,
                mem: &moments.data,
            },
            In {
                rect: gamma.rect,
                mem: &gamma.data,
            },
            In {
                rect: beta.rect,
                mem: &beta.data,
            },
            Out {
                rect: group_rect,
                mem: &mut y,
            },
        );
        let y = Host {
            rect: group_rect,
            data: y,
        };
        let dy = Host::random(full, seed + 3);
        let mut grad_sums = sentinel_f64(3 * (group.1 - group.0));
        let (mut dgamma, mut dbeta) = (sentinel(&channels(0, c)), sentinel(&channels(0, c)));
        Cpu::default().bn_grad_sums(
            &mut CpuStream,
            &op,
            In {
                rect: x.rect,
                mem: &x.data,
            },
            op.relu.then_some(In {
                rect: y.rect,
                mem: &y.data,
            }),
            In {
                rect: dy.rect,
                mem: &dy.data,
            },
            In {
                rect: moments.rect,
                mem: &moments.data,
            },
            &group_rect,
            Out {
                rect: channels(0, c),
                mem: &mut dgamma,
            },
            Out {
                rect: channels(0, c),
                mem: &mut dbeta,
            },
            Out {
                rect: sums_rect(group.0, group.1),
                mem: &mut grad_sums,
            },
        );
        BnCase {
            op,
            tile,
            grad_sums: Host {
                rect: sums_rect(group.0, group.1),
                data: grad_sums,
            },
            running_mean: Host::random(channels(0, c), seed + 4),
            running_var: Host::positive(channels(0, c), seed + 5),
            x,
            moments,
            gamma,
            beta,
            y,
            dy,
        }
    }

    fn run<D: Device>(&self, d: &D, s: &mut D::Stream) -> Outputs {
        let c = self.gamma.rect.hi[0];
        let tile = self.tile;
        let x = put(d, s, &self.x);
        let mut tile_moments = out_sums(d, s, sums_rect(tile.lo[1], tile.hi[1]));
        d.bn_moments(s, x.read(), &tile, tile_moments.write());

        let (moments, gamma, beta) = (
            put(d, s, &self.moments),
            put(d, s, &self.gamma),
            put(d, s, &self.beta),
        );
        let mut y = out(d, s, tile);
        d.bn_normalize(
            s,
            &self.op,
            x.read(),
            moments.read(),
            gamma.read(),
            beta.read(),
            y.write(),
        );

        let mut running_mean = put(d, s, &self.running_mean);
        let mut running_var = put(d, s, &self.running_var);
        d.bn_running(
            s,
            &self.op,
            moments.read(),
            running_mean.write(),
            running_var.write(),
        );

        let (y_full, dy) = (put(d, s, &self.y), put(d, s, &self.dy));
        let y_read = self.op.relu.then(|| y_full.read());
        let mut dgamma = out(d, s, channels(0, c));
        let mut dbeta = out(d, s, channels(0, c));
        let mut tile_sums = out_sums(d, s, sums_rect(tile.lo[1], tile.hi[1]));
        d.bn_grad_sums(
            s,
            &self.op,
            x.read(),
            y_read,
            dy.read(),
            moments.read(),
            &tile,
            dgamma.write(),
            dbeta.write(),
            tile_sums.write(),
        );
        let grad_sums = put(d, s, &self.grad_sums);
        let mut dx = out(d, s, tile);
        d.bn_input_grad(
            s,
            &self.op,
            x.read(),
            y_read,
            dy.read(),
            moments.read(),
            gamma.read(),
            grad_sums.read(),
            dx.write(),
        );
        vec![
            ("moments", d.get(s, &tile_moments.mem)),
            ("y", d.get(s, &y.mem)),
            ("running_mean", d.get(s, &running_mean.mem)),
            ("running_var", d.get(s, &running_var.mem)),
            ("dgamma", d.get(s, &dgamma.mem)),
            ("dbeta", d.get(s, &dbeta.mem)),
            ("grad_sums", d.get(s, &tile_sums.mem)),
            ("dx", d.get(s, &dx.mem)),
        ]
    }
}

fn sgd_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    sgd: &Sgd,
    g: &Host,
    w: &Host,
    v: &Host,
) -> Outputs {
    let g = put(d, s, g);
    let (mut w, mut v) = (put(d, s, w), put(d, s, v));
    d.sgd_update(s, sgd, g.read(), w.write(), v.write());
    vec![("w", d.get(s, &w.mem)), ("velocity", d.get(s, &v.mem))]
}

// ---------------------------------------------------------------------------------------------
/// The runtime's region primitives from `src` (laid out over its rect) into a destination laid out
/// over `dst_layout` that starts as `dst`'s values: copy, add and zero of `region`, each into its
/// own destination.
fn region_case<D: Device>(
    d: &D,
    s: &mut D::Stream,
    src: &Host,
    dst: &cpu::Buffer,
    dst_layout: Rect,
    region: Rect,
) -> Outputs {
    let src = put(d, s, src);
    let start = Host {
        rect: dst_layout,
        data: dst.clone(),
    };
    let (mut copied, mut added, mut zeroed) =
        (put(d, s, &start), put(d, s, &start), put(d, s, &start));
    d.copy_rect(s, src.read(), copied.write(), &region);
    d.add_rect(s, src.read(), added.write(), &region);
    d.zero_rect(s, zeroed.write(), &region);
    vec![
        ("copied", d.get(s, &copied.mem)),
        ("added", d.get(s, &added.mem)),
        ("zeroed", d.get(s, &zeroed.mem)),
    ]
}

// The cases.

/// Whole tensors and whole samples are one run of elements in both layouts (the GPU moves them
/// with a device copy, a flat add or a memset); the rest are located element by element.
fn region_cases(h: &mut Harness) {
    let full = Shape::nchw(3, 4, 5, 6).full_rect();
    let samples = r(&[1, 0, 0, 0], &[3, 4, 5, 6]);
    let cut = r(&[0, 1, 1, 2], &[3, 3, 4, 6]);
    let one_sample_channels = r(&[2, 1, 0, 0], &[3, 3, 5, 6]);
    let wider = Shape::nchw(3, 4, 5, 8).full_rect();
    let cases = [
        ("whole", full, full, full),
        (
            "whole samples into their own layout",
            full,
            samples,
            samples,
        ),
        ("whole samples between larger layouts", full, full, samples),
        (
            "channels of one sample (a run)",
            full,
            one_sample_channels,
            one_sample_channels,
        ),
        ("cut in the inner axes", full, full, cut),
        (
            "a run in the source, not in the destination",
            samples,
            wider,
            samples,
        ),
    ];
    for (i, (what, src_layout, dst_layout, region)) in cases.into_iter().enumerate() {
        let seed = 900 + 10 * i as u64;
        let src = Host::random(src_layout, seed);
        let dst = random(&dst_layout, seed + 1);
        both!(h, format!("regions f32, {what}"), |d, s| region_case(
            d, s, &src, &dst, dst_layout, region
        ));
        let widen = |b: &cpu::Buffer| cpu::Buffer::F64(b.f32().iter().map(|&x| x as f64).collect());
        let src64 = Host {
            rect: src_layout,
            data: widen(&src.data),
        };
        let dst64 = widen(&dst);
        both!(h, format!("regions f64, {what}"), |d, s| region_case(
            d, s, &src64, &dst64, dst_layout, region
        ));
    }
}

fn elementwise_cases(h: &mut Harness) {
    let shape = Shape::nchw(2, 3, 5, 7);
    let full = shape.full_rect();
    let inner = r(&[0, 1, 1, 2], &[2, 3, 4, 6]);
    let nc = Shape::nc(4, 10).full_rect();
    let nc_tile = r(&[1, 3], &[3, 9]);
    let tiles = [
        ("whole NCHW", full, full),
        ("NCHW tile in a larger view", full, inner),
        ("NCHW tile, view = tile", inner, inner),
        ("whole NC", nc, nc),
        ("NC tile in a larger view", nc, nc_tile),
    ];
    for (i, (what, view, tile)) in tiles.into_iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let x = Host::random(view, seed);
        let dy = Host::random(view, seed + 1);
        let b = Host::random(view, seed + 2);
        for kind in Unary::all() {
            both!(
                h,
                format!("{kind:?} forward, {what}"),
                |d, s| unary_forward(d, s, kind, &x, tile)
            );
            both!(h, format!("{kind:?} backward, {what}"), |d, s| {
                unary_backward(d, s, kind, &x, &dy, tile)
            });
        }
        for grads in [(true, true), (true, false), (false, true)] {
            both!(h, format!("add {grads:?}, {what}"), |d, s| add_case(
                d, s, &x, &b, &dy, tile, grads
            ));
        }
        both!(h, format!("mul, {what}"), |d, s| mul_case(
            d, s, &x, &b, &dy, tile
        ));
        if view.ndim() == 4 {
            let scale = Host::random(Shape::nchw(2, 3, 1, 1).full_rect(), seed + 3);
            both!(h, format!("mul by a channel scale, {what}"), |d, s| {
                mul_case(d, s, &x, &scale, &dy, tile)
            });
        }
        let tensor = if view.ndim() == 4 {
            shape
        } else {
            Shape::nc(4, 10)
        };
        let mask = DropoutMask {
            rate: 0.3,
            seed: 42,
            step: 7 + i as u64,
            layer_salt: 3,
            shape: tensor,
        };
        both!(h, format!("dropout, {what}"), |d, s| dropout_case(
            d, s, &mask, &x, &dy, tile
        ));
    }
    // copy: same volume, another rect (flatten)
    let x = Host::random(full, 7);
    both!(h, "copy (flatten)", |d, s| copy_case(
        d,
        s,
        &x,
        Shape::nc(2, 105).full_rect()
    ));
}

fn load_images_cases(h: &mut Harness) {
    let shape = Shape::nchw(8, 3, 6, 6);
    let held = shape.full_rect().with_axis(0, 2, 6);
    let mut rng = Rng::new(9);
    let images: Vec<f32> = (0..held.volume()).map(|_| rng.uniform(0.0, 1.0)).collect();
    let tile = shape.full_rect().with_axis(0, 3, 5);
    both!(h, "load_images into the tile", |d, s| load_images_case(
        d, s, &images, held, tile, tile
    ));
    let larger = shape.full_rect().with_axis(0, 3, 6);
    both!(h, "load_images into a larger instance", |d, s| {
        load_images_case(d, s, &images, held, tile, larger)
    });
    let corner = r(&[2, 1, 2, 1], &[4, 3, 5, 6]);
    both!(h, "load_images, a corner tile", |d, s| load_images_case(
        d, s, &images, held, corner, corner
    ));
}

fn conv_cases(h: &mut Harness) {
    let x_shape = Shape::nchw(2, 3, 11, 10);
    let mut cases: Vec<(String, ConvCase)> = Vec::new();
    let mut add =
        |name: &str, op: Conv2d, in_shape: Shape, tile: Option<Rect>, view: Option<Rect>| {
            let out_shape = op.infer_shape(&[in_shape]).expect("valid conv");
            let tile = tile.unwrap_or_else(|| out_shape.full_rect());
            let seed = 1000 + 10 * cases.len() as u64;
            cases.push((
                name.to_string(),
                ConvCase::new(op, in_shape, tile, view, seed),
            ));
        };
    let plain = Conv2d::new(4, 3).padding(1);
    let strided = Conv2d::new(5, 5).stride(2).padding(2).relu();
    add("whole, 3x3 pad 1", plain.clone(), x_shape, None, None);
    add(
        "whole, 5x5 stride 2 pad 2 relu",
        strided.clone(),
        x_shape,
        None,
        None,
    );
    add(
        "whole, 1x1 no bias",
        Conv2d::new(6, 1).no_bias(),
        x_shape,
        None,
        None,
    );
    add(
        "whole, 11x11 stride 4 pad 2 relu (AlexNet conv1 shape)",
        Conv2d::new(4, 11).stride(4).padding(2).relu(),
        Shape::nchw(2, 3, 35, 35),
        None,
        None,
    );
    add(
        "whole, 1x7 rect pad (0,3)",
        Conv2d::rect(4, 1, 7).padding_hw(0, 3),
        x_shape,
        None,
        None,
    );
    // height splits of a padded strided conv: halo rows, padding on one side only
    let out = strided.infer_shape(&[x_shape]).unwrap();
    let oh = out.dim(2);
    for (lo, hi) in [(0, oh / 2), (oh / 2, oh), (1, oh - 1)] {
        let tile = out.full_rect().with_axis(2, lo, hi);
        add(
            &format!("height split rows {lo}..{hi}, 5x5 s2 p2"),
            strided.clone(),
            x_shape,
            Some(tile),
            None,
        );
    }
    let out_plain = plain.infer_shape(&[x_shape]).unwrap();
    let ow = out_plain.dim(3);
    let left = out_plain.full_rect().with_axis(3, 0, ow / 2);
    add(
        "width split, 3x3 p1",
        plain.clone(),
        x_shape,
        Some(left),
        None,
    );
    add(
        "width split, view = whole input",
        plain.clone(),
        x_shape,
        Some(left),
        Some(x_shape.full_rect()),
    );
    let quadrant = out_plain
        .full_rect()
        .with_axis(2, 5, 11)
        .with_axis(3, 5, 10);
    add(
        "h and w split, 3x3 p1",
        plain.clone(),
        x_shape,
        Some(quadrant),
        None,
    );
    add(
        "channel split 1..3",
        plain.clone(),
        x_shape,
        Some(out_plain.full_rect().with_axis(1, 1, 3)),
        None,
    );
    add(
        "sample split 1..2",
        strided.clone(),
        x_shape,
        Some(out.full_rect().with_axis(0, 1, 2)),
        None,
    );
    add(
        "sample split in a whole-batch view",
        plain.clone(),
        x_shape,
        Some(out_plain.full_rect().with_axis(0, 1, 2)),
        Some(x_shape.full_rect()),
    );
    // grouped
    let g_shape = Shape::nchw(2, 6, 9, 9);
    let grouped = Conv2d::new(9, 3).padding(1).groups(3);
    let g_out = grouped.infer_shape(&[g_shape]).unwrap();
    add(
        "grouped 3 groups, whole",
        grouped.clone(),
        g_shape,
        None,
        None,
    );
    add(
        "grouped, whole groups 3..9",
        grouped.clone(),
        g_shape,
        Some(g_out.full_rect().with_axis(1, 3, 9)),
        None,
    );
    add(
        "grouped, channels 1..5 cut through two groups",
        grouped.clone(),
        g_shape,
        Some(g_out.full_rect().with_axis(1, 1, 5)),
        None,
    );
    add(
        "grouped, channels 2..8 (part, whole group, part), height split",
        grouped.clone(),
        g_shape,
        Some(g_out.full_rect().with_axis(1, 2, 8).with_axis(2, 4, 9)),
        None,
    );
    add(
        "depthwise 6 groups stride 2 relu",
        Conv2d::new(6, 3).stride(2).padding(1).groups(6).relu(),
        g_shape,
        None,
        None,
    );
    for (name, case) in &cases {
        both!(h, format!("conv2d {name}"), |d, s| case.run(d, s));
    }
    // without an input gradient (a first layer)
    let mut first = ConvCase::new(plain, x_shape, out_plain.full_rect(), None, 1999);
    first.with_dx = false;
    both!(h, "conv2d without dx", |d, s| first.run(d, s));
}

fn dense_cases(h: &mut Harness) {
    let op = Dense::new(5).relu();
    let inputs = 37;
    let whole = Shape::nc(4, 5).full_rect();
    let cases = [
        ("whole, relu", op.clone(), whole, (0, 4)),
        ("features 2..5", op.clone(), r(&[0, 2], &[4, 5]), (0, 4)),
        (
            "samples 1..3 in a whole-batch view",
            op.clone(),
            r(&[1, 0], &[3, 5]),
            (0, 4),
        ),
        (
            "samples 1..3, view = tile rows",
            op.clone(),
            r(&[1, 0], &[3, 5]),
            (1, 3),
        ),
        (
            "no bias, no activation",
            Dense::new(5).no_bias(),
            whole,
            (0, 4),
        ),
        (
            "wide: 300 features",
            Dense::new(300),
            Shape::nc(3, 300).full_rect(),
            (0, 3),
        ),
    ];
    for (i, (name, op, tile, rows)) in cases.into_iter().enumerate() {
        let case = DenseCase::new(op, inputs, tile, rows, 2000 + 10 * i as u64);
        both!(h, format!("dense {name}"), |d, s| case.run(d, s));
    }
}

fn pool_cases(h: &mut Harness) {
    let in_shape = Shape::nchw(2, 3, 11, 9);
    let sliding = [
        ("max 3x3 s2 p1", Pool2d::max(3).stride(2).padding(1)),
        ("avg 3x3 s2 p1", Pool2d::avg(3).stride(2).padding(1)),
        ("max 2x2", Pool2d::max(2)),
        ("avg 2x2", Pool2d::avg(2)),
        ("max 3x3 s1 p1", Pool2d::max(3).stride(1).padding(1)),
        ("avg 5x5 s3 p2", Pool2d::avg(5).stride(3).padding(2)),
        ("max 2x2 s2 ceil", Pool2d::max(2).ceil_mode()),
        (
            "avg 3x3 s2 p1 ceil",
            Pool2d::avg(3).stride(2).padding(1).ceil_mode(),
        ),
    ];
    let adaptive = [
        ("adaptive to 4x2", AdaptiveAvgPool2d { output: [4, 2] }),
        ("adaptive to 13x10", AdaptiveAvgPool2d { output: [13, 10] }),
    ];
    let ops = sliding
        .iter()
        .map(|(name, op)| (*name, PoolWindows::from(op), op.infer_shape(&[in_shape])))
        .chain(
            adaptive
                .iter()
                .map(|(name, op)| (*name, op.windows(), op.infer_shape(&[in_shape]))),
        )
        .collect::<Vec<_>>();
    for (i, (name, op, out)) in ops.into_iter().enumerate() {
        let out = out.unwrap();
        let oh = out.dim(2);
        let tiles = [
            ("whole", out.full_rect(), None),
            ("top rows", out.full_rect().with_axis(2, 0, oh / 2), None),
            (
                "bottom rows",
                out.full_rect().with_axis(2, oh / 2, oh),
                None,
            ),
            (
                "channels 1..3, right columns",
                out.full_rect()
                    .with_axis(1, 1, 3)
                    .with_axis(3, 1, out.dim(3)),
                None,
            ),
            (
                "sample 1 in a whole view",
                out.full_rect().with_axis(0, 1, 2),
                Some(in_shape.full_rect()),
            ),
        ];
        for (j, (what, tile, view)) in tiles.into_iter().enumerate() {
            let view = view.unwrap_or_else(|| op.project(in_shape, &tile));
            let seed = 3000 + 100 * i as u64 + 10 * j as u64;
            let x = Host::random(view, seed);
            let dy = Host::random(tile, seed + 1);
            both!(h, format!("pool2d {name}, {what}"), |d, s| pool_case(
                d, s, op, in_shape, &x, &dy
            ));
        }
    }
}

fn concat_cases(h: &mut Harness) {
    let shapes = [
        Shape::nchw(2, 3, 4, 4),
        Shape::nchw(2, 2, 4, 4),
        Shape::nchw(2, 5, 4, 4),
    ];
    let out = Shape::nchw(2, 10, 4, 4);
    let tiles = [
        ("whole", out.full_rect()),
        (
            "channels 4..8: input 0 untouched",
            out.full_rect().with_axis(1, 4, 8),
        ),
        (
            "channels 1..4, rows 1..3",
            out.full_rect().with_axis(1, 1, 4).with_axis(2, 1, 3),
        ),
        ("sample 1", out.full_rect().with_axis(0, 1, 2)),
    ];
    let concat = legion_ops::op::Concat::default();
    for (i, (what, tile)) in tiles.into_iter().enumerate() {
        let projection = concat.project(&shapes, &tile);
        let seed = 4000 + 10 * i as u64;
        let xs: Vec<Option<Host>> = projection
            .iter()
            .enumerate()
            .map(|(k, p)| (!p.is_empty()).then(|| Host::random(*p, seed + k as u64)))
            .collect();
        let dy = Host::random(tile, seed + 9);
        // every touched input's gradient, then all but the last touched one
        let all: Vec<Option<Rect>> = projection
            .iter()
            .map(|p| (!p.is_empty()).then_some(*p))
            .collect();
        let mut some = all.clone();
        if let Some(last) = some.iter_mut().rev().find(|p| p.is_some()) {
            *last = None;
        }
        both!(h, format!("concat {what}"), |d, s| concat_case(
            d, s, &shapes, &xs, &dy, &all
        ));
        both!(
            h,
            format!("concat {what}, one gradient not asked for"),
            |d, s| concat_case(d, s, &shapes, &xs, &dy, &some)
        );
    }
    // an input view larger than the slice the tile reads
    let tile = out.full_rect().with_axis(1, 4, 8);
    let xs = vec![
        None,
        Some(Host::random(shapes[1].full_rect(), 4100)),
        Some(Host::random(shapes[2].full_rect(), 4101)),
    ];
    let projection = concat.project(&shapes, &tile);
    let dx_rects: Vec<Option<Rect>> = projection
        .iter()
        .map(|p| (!p.is_empty()).then_some(*p))
        .collect();
    let dy = Host::random(tile, 4102);
    both!(h, "concat with whole-input views", |d, s| concat_case(
        d, s, &shapes, &xs, &dy, &dx_rects
    ));
}

fn softmax_cases(h: &mut Harness) {
    for (i, (n, classes, rows)) in [
        (6, 10, (0, 6)),
        (6, 37, (2, 5)),
        (33, 1000, (0, 33)),
        (5, 3, (4, 5)),
    ]
    .into_iter()
    .enumerate()
    {
        // The logits view holds exactly the tile's rows, the op's projection.
        let view = Shape::nc(n, classes)
            .full_rect()
            .with_axis(0, rows.0, rows.1);
        let mut logits = Host::random(view, 5000 + i as u64);
        if let cpu::Buffer::F32(v) = &mut logits.data {
            // large logits exercise the shift by the row maximum
            for x in v.iter_mut() {
                *x *= 20.0;
            }
        }
        let labels: Vec<u32> = (rows.0..rows.1)
            .map(|r| ((r * 7 + 3) % classes) as u32)
            .collect();
        let scale = 1.0 / n as f32;
        both!(
            h,
            format!("softmax_ce {n}x{classes}, rows {rows:?}"),
            |d, s| softmax_case(d, s, &logits, &labels, rows, scale)
        );
    }
}

fn label_out_of_range_is_an_error(h: &mut Harness) {
    let logits = Host::random(Shape::nc(3, 4).full_rect(), 5100);
    let labels = [0, 4, 1];
    let run = |d: &Cuda, s: &mut Stream| -> (KernelError, KernelError) {
        let x = put(d, s, &logits);
        let mut loss = out(d, s, r(&[0, 0], &[3, 1]));
        let forward = match d.softmax_ce_forward(s, x.read(), &labels, loss.write()) {
            Err(e) => e,
            Ok(_) => panic!("an out-of-range label was accepted"),
        };
        let mut dlogits = out(d, s, r(&[0, 0], &[3, 4]));
        let backward = d
            .softmax_ce_backward(s, x.read(), &labels, 1.0, dlogits.write())
            .expect_err("an out-of-range label was accepted");
        (forward, backward)
    };
    let (cuda, stream) = (&h.cuda, &mut h.stream);
    match catch_unwind(AssertUnwindSafe(|| run(cuda, stream))) {
        Ok((forward, backward)) => {
            let expected = KernelError::Label(legion_ops::backend::LabelOutOfRange {
                sample: 1,
                label: 4,
                classes: 4,
            });
            if forward != expected || backward != expected {
                h.failures.push(format!(
                    "label out of range: got {forward:?} / {backward:?}, expected {expected:?}"
                ));
            } else {
                h.passed += 1;
            }
        }
        Err(p) => {
            h.failures
                .push(format!("label out of range: {}", panic_message(p)));
            h.stream = h.cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn batch_norm_cases(h: &mut Harness) {
    let shape = Shape::nchw(4, 3, 5, 6);
    let full = shape.full_rect();
    let nc = Shape::nc(8, 6);
    let cases = [
        ("whole", shape, full, (0, 3)),
        ("sample split 1..3", shape, full.with_axis(0, 1, 3), (0, 3)),
        ("channel split 1..3", shape, full.with_axis(1, 1, 3), (1, 3)),
        (
            "channel 2 of group 1..3",
            shape,
            full.with_axis(1, 2, 3),
            (1, 3),
        ),
        ("height split 2..5", shape, full.with_axis(2, 2, 5), (0, 3)),
        (
            "sample, channel and width split",
            shape,
            r(&[1, 1, 0, 3], &[4, 3, 5, 6]),
            (1, 3),
        ),
        ("NC whole", nc, nc.full_rect(), (0, 6)),
        (
            "NC samples 2..7, channels 1..4",
            nc,
            r(&[2, 1], &[7, 4]),
            (0, 6),
        ),
    ];
    for (i, (what, shape, tile, group)) in cases.into_iter().enumerate() {
        for relu in [false, true] {
            let op = BatchNorm {
                relu,
                ..BatchNorm::default()
            };
            let case = BnCase::new(op, shape, tile, group, 6000 + 20 * i as u64);
            both!(h, format!("batch norm {what}, relu {relu}"), |d, s| case
                .run(d, s));
        }
    }
}

fn sgd_cases(h: &mut Harness) {
    let rect = Shape::new(&[1000]).full_rect();
    let (g, w, v) = (
        Host::random(rect, 7000),
        Host::random(rect, 7001),
        Host::random(rect, 7002),
    );
    let sgd = Sgd::default();
    both!(h, "sgd update", |d, s| sgd_case(d, s, &sgd, &g, &w, &v));
    let plain = Sgd {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    both!(h, "sgd update without momentum or decay", |d, s| sgd_case(
        d, s, &plain, &g, &w, &v
    ));
}

#[test]
fn every_primitive_matches_the_cpu_backend() {
    let Some(mut h) = Harness::start() else {
        return;
    };
    region_cases(&mut h);
    elementwise_cases(&mut h);
    load_images_cases(&mut h);
    conv_cases(&mut h);
    dense_cases(&mut h);
    pool_cases(&mut h);
    concat_cases(&mut h);
    softmax_cases(&mut h);
    label_out_of_range_is_an_error(&mut h);
    batch_norm_cases(&mut h);
    sgd_cases(&mut h);
    h.finish();
}

/// `--tf32`: convolutions and dense layers on TF32 tensor cores (10-bit mantissa inputs, FP32
/// sums) stay within TF32's precision of the CPU's FP32 results; everything else is strict anyway.
#[test]
fn tf32_products_and_convolutions_agree_to_tf32_precision() {
    let Some(mut h) = Harness::start_with(Math::Tf32, TF32_TOLERANCE) else {
        return;
    };
    // the mode the products run in, as cuBLAS reports it: a looser tolerance alone would pass
    // with TF32 never switched on
    assert_eq!(h.stream.cublas_math().unwrap(), Math::Tf32);
    let strict = h.cuda_strict_stream_math();
    assert_eq!(strict, Math::StrictFp32);
    conv_cases(&mut h);
    dense_cases(&mut h);
    h.finish();
}

#[test]
fn a_gpu_past_the_last_is_refused_with_a_reason() {
    let Some(h) = Harness::start() else {
        return;
    };
    drop(h);
    match Cuda::new(4096) {
        Ok(_) => panic!("GPU 4096 opened"),
        Err(error) => {
            let message = error.to_string();
            assert!(message.contains("4096"), "{message}");
        }
    }
}
