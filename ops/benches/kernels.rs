//! Throughput of the compute-heavy CPU kernels at AlexNet sizes (batch 32, 224×224 images), and
//! of the memory-bound ones of MobileNetV2 (batch 8) in bytes of their tensors.
//!
//! Throughput is reported as elements/s where one element is one floating-point operation, so
//! `Gelem/s` reads as GFLOP/s. FLOPs come from each op's `OpSpec::flops`. Run single-threaded with
//! `RAYON_NUM_THREADS=1` to compare against one core's FMA peak.
//!
//! `cargo bench -p legion-ops --bench kernels`

use criterion::measurement::WallTime;
use criterion::{
    BenchmarkGroup, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use legion_ops::kernels::batch_norm::{batch_norm_backward, batch_norm_forward};
use legion_ops::kernels::conv2d::{conv2d_backward, conv2d_forward};
use legion_ops::kernels::dense::{dense_backward, dense_forward};
use legion_ops::kernels::gemm::{Mat, MatMut, Threads, matmul};
use legion_ops::kernels::pool2d::{pool2d_backward, pool2d_forward};
use legion_ops::kernels::{View, ViewMut};
use legion_ops::op::{BatchNorm, Conv2d, Dense, OpSpec, Pool2d};
use legion_ops::rng::Rng;
use legion_ops::shape::{Rect, Shape, add_rect, copy_rect};
use std::hint::black_box;
use std::time::Duration;

const BATCH: usize = 32;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    // Each iteration takes tens to hundreds of milliseconds: a few flat samples are enough.
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g
}

fn bench_gemm(c: &mut Criterion) {
    let mut g = group(c, "gemm");
    // (m, n, k): a square product and conv2's forward over the whole batch (Cout × N·OH·OW × Cin·k²).
    for (name, m, n, k) in [
        ("1024^3", 1024, 1024, 1024),
        ("192x23328x1600", 192, BATCH * 27 * 27, 1600),
    ] {
        let a = random(m * k, 1);
        let b = random(k * n, 2);
        let mut dst = vec![0.0; m * n];
        g.throughput(Throughput::Elements(2 * (m * n * k) as u64));
        g.bench_function(name, |bench| {
            bench.iter(|| {
                matmul(
                    MatMut::packed(&mut dst, m, n),
                    Mat::packed(&a, m, k),
                    Mat::packed(&b, k, n),
                    false,
                    Threads::Pool,
                );
                black_box(&dst);
            })
        });
    }
    g.finish();
}

fn bench_conv(c: &mut Criterion) {
    let mut g = group(c, "conv2d");
    let layers = [
        (
            "conv1",
            Conv2d::new(64, 11).stride(4).padding(2).relu(),
            Shape::nchw(BATCH, 3, 224, 224),
        ),
        (
            "conv2",
            Conv2d::new(192, 5).padding(2).relu(),
            Shape::nchw(BATCH, 64, 27, 27),
        ),
        (
            "conv3",
            Conv2d::new(384, 3).padding(1).relu(),
            Shape::nchw(BATCH, 192, 13, 13),
        ),
    ];
    for (name, op, input) in layers {
        let output = op.infer_shape(&[input]).unwrap();
        let flops = op.flops(&[input], &output).expect("small shapes");
        // `flops.backward` counts both the input and the weight gradient, so both are computed.
        let throughput = [flops.forward, flops.backward].map(Throughput::Elements);
        bench_conv_layer(&mut g, name, &op, input, throughput);
    }
    g.finish();
}

/// `{name}/forward` and `{name}/backward` of `op` over the whole of `input` (the backward computes
/// every gradient), at `throughput` each.
fn bench_conv_layer(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    op: &Conv2d,
    input: Shape,
    [forward, backward]: [Throughput; 2],
) {
    let output = op.infer_shape(&[input]).unwrap();
    let (x_rect, y_rect) = (input.full_rect(), output.full_rect());
    let w_rect = op.params(&[input])[0].shape.full_rect();
    let b_rect = Rect::new(&[0], &[op.out_channels]);
    let x = random(input.numel(), 3);
    let w = random(w_rect.volume(), 4);
    let b = random(op.out_channels, 5);
    let dy = random(output.numel(), 6);
    let mut y = vec![0.0; output.numel()];
    g.throughput(forward);
    g.bench_function(format!("{name}/forward"), |bench| {
        bench.iter(|| {
            conv2d_forward(
                op,
                input,
                View::new(x_rect, &x),
                View::new(w_rect, &w),
                op.bias.then(|| View::new(b_rect, &b)),
                ViewMut::new(y_rect, &mut y),
            );
            black_box(&y);
        })
    });
    let mut dx = vec![0.0; input.numel()];
    let mut dw = vec![0.0; w.len()];
    let mut db = vec![0.0; b.len()];
    g.throughput(backward);
    g.bench_function(format!("{name}/backward"), |bench| {
        bench.iter(|| {
            conv2d_backward(
                op,
                input,
                View::new(x_rect, &x),
                View::new(w_rect, &w),
                View::new(y_rect, &y),
                View::new(y_rect, &dy),
                Some(ViewMut::new(x_rect, &mut dx)),
                ViewMut::new(w_rect, &mut dw),
                op.bias.then(|| ViewMut::new(b_rect, &mut db)),
            );
            black_box((&dx, &dw, &db));
        })
    });
}

fn bench_dense(c: &mut Criterion) {
    let mut g = group(c, "dense");
    let op = Dense::new(4096).relu();
    let input = Shape::nc(BATCH, 9216);
    let output = op.infer_shape(&[input]).unwrap();
    let flops = op.flops(&[input], &output).expect("small shapes");
    let (x_rect, y_rect) = (input.full_rect(), output.full_rect());
    let w_rect = Shape::nc(4096, 9216).full_rect();
    let b_rect = Rect::new(&[0], &[4096]);
    let x = random(input.numel(), 7);
    let w = random(w_rect.volume(), 8);
    let b = random(4096, 9);
    let dy = random(output.numel(), 10);
    let mut y = vec![0.0; output.numel()];

    g.throughput(Throughput::Elements(flops.forward));
    g.bench_function("9216x4096/forward", |bench| {
        bench.iter(|| {
            dense_forward(
                &op,
                View::new(x_rect, &x),
                View::new(w_rect, &w),
                Some(View::new(b_rect, &b)),
                ViewMut::new(y_rect, &mut y),
            );
            black_box(&y);
        })
    });
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; w.len()];
    let mut db = vec![0.0; b.len()];
    g.throughput(Throughput::Elements(flops.backward));
    g.bench_function("9216x4096/backward", |bench| {
        bench.iter(|| {
            dense_backward(
                &op,
                View::new(x_rect, &x),
                View::new(w_rect, &w),
                View::new(y_rect, &y),
                View::new(y_rect, &dy),
                Some(ViewMut::new(x_rect, &mut dx)),
                ViewMut::new(w_rect, &mut dw),
                Some(ViewMut::new(b_rect, &mut db)),
            );
            black_box((&dx, &dw, &db));
        })
    });
    g.finish();
}

fn bench_pool(c: &mut Criterion) {
    let mut g = group(c, "pool2d");
    let op = Pool2d::max(3).stride(2);
    let input = Shape::nchw(BATCH, 64, 55, 55);
    let output = op.infer_shape(&[input]).unwrap();
    let flops = op.flops(&[input], &output).expect("small shapes");
    let (x_rect, y_rect) = (input.full_rect(), output.full_rect());
    let x = random(input.numel(), 11);
    let dy = random(output.numel(), 12);
    let mut y = vec![0.0; output.numel()];
    let mut dx = vec![0.0; x.len()];

    g.throughput(Throughput::Elements(flops.forward));
    g.bench_function("max3s2/forward", |bench| {
        bench.iter(|| {
            pool2d_forward(
                (&op).into(),
                input,
                View::new(x_rect, &x),
                ViewMut::new(y_rect, &mut y),
            );
            black_box(&y);
        })
    });
    g.throughput(Throughput::Elements(flops.backward));
    g.bench_function("max3s2/backward", |bench| {
        bench.iter(|| {
            pool2d_backward(
                (&op).into(),
                input,
                View::new(x_rect, &x),
                View::new(y_rect, &dy),
                ViewMut::new(x_rect, &mut dx),
            );
            black_box(&dx);
        })
    });
    g.finish();
}

/// MobileNetV2's memory-bound layers at batch 8: the second block's expansion (96 channels at
/// 112×112) through BatchNorm + ReLU and its 3×3 stride-2 depthwise convolution, and a 144-channel
/// stride-1 depthwise convolution at 56×56. Throughput is the bytes of the tensors each pass reads
/// and writes once.
fn bench_mobilenet(c: &mut Criterion) {
    let mut g = group(c, "mobilenet_v2");
    let input = Shape::nchw(8, 96, 112, 112);
    let rect = input.full_rect();
    let channels = Rect::new(&[0], &[96]);
    let op = BatchNorm {
        relu: true,
        ..BatchNorm::default()
    };
    let x = random(input.numel(), 13);
    let dy = random(input.numel(), 14);
    let (gamma, beta) = (random(96, 15), random(96, 16));
    let (mut mean, mut var) = (vec![0.0; 96], vec![1.0; 96]);
    let mut y = vec![0.0; input.numel()];
    let bytes = (input.numel() * 4) as u64;
    g.throughput(Throughput::Bytes(2 * bytes));
    g.bench_function("batch_norm_relu/forward", |bench| {
        bench.iter(|| {
            black_box(batch_norm_forward(
                &op,
                View::new(rect, &x),
                View::new(channels, &gamma),
                View::new(channels, &beta),
                ViewMut::new(channels, &mut mean),
                ViewMut::new(channels, &mut var),
                ViewMut::new(rect, &mut y),
            ))
        })
    });
    let stats = batch_norm_forward(
        &op,
        View::new(rect, &x),
        View::new(channels, &gamma),
        View::new(channels, &beta),
        ViewMut::new(channels, &mut mean),
        ViewMut::new(channels, &mut var),
        ViewMut::new(rect, &mut y),
    );
    let mut dx = vec![0.0; input.numel()];
    let (mut dgamma, mut dbeta) = (vec![0.0; 96], vec![0.0; 96]);
    g.throughput(Throughput::Bytes(4 * bytes));
    g.bench_function("batch_norm_relu/backward", |bench| {
        bench.iter(|| {
            batch_norm_backward(
                &op,
                View::new(rect, &x),
                View::new(rect, &y),
                View::new(rect, &dy),
                &stats,
                View::new(channels, &gamma),
                ViewMut::new(rect, &mut dx),
                ViewMut::new(channels, &mut dgamma),
                ViewMut::new(channels, &mut dbeta),
            );
            black_box(&dx);
        })
    });

    let layers = [
        (
            "depthwise3x3s2",
            Conv2d::new(96, 3).stride(2).padding(1).groups(96).no_bias(),
            input,
        ),
        (
            "depthwise3x3s1",
            Conv2d::new(144, 3).padding(1).groups(144).no_bias(),
            Shape::nchw(8, 144, 56, 56),
        ),
    ];
    for (name, op, input) in layers {
        let output = op.infer_shape(&[input]).unwrap();
        let bytes = ((input.numel() + output.numel()) * 4) as u64;
        bench_conv_layer(
            &mut g,
            name,
            &op,
            input,
            [bytes, 2 * bytes].map(Throughput::Bytes),
        );
    }
    g.finish();
}

/// The runtime's region moves (a device packing a slice, receiving one, summing gradient
/// replicas): `copy_rect` and `add_rect` of a block of Inception-v3's `Mixed_7b` weights (one
/// device's quarter of the output channels, as parameter sync folds it) and of a conv input's
/// halo rows (an h-split neighbour's).
fn bench_rect_moves(c: &mut Criterion) {
    let mut g = c.benchmark_group("rect_moves");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let cases = [
        (
            "weight_1x1_quarter",
            Rect::new(&[0, 0, 0, 0], &[448, 1280, 1, 1]),
            Rect::new(&[112, 0, 0, 0], &[224, 1280, 1, 1]),
        ),
        (
            "weight_3x3_quarter",
            Rect::new(&[0, 0, 0, 0], &[384, 448, 3, 3]),
            Rect::new(&[96, 0, 0, 0], &[192, 448, 3, 3]),
        ),
        (
            "halo_rows_56x56",
            Rect::new(&[0, 0, 0, 0], &[BATCH, 64, 56, 56]),
            Rect::new(&[0, 0, 28, 0], &[BATCH, 64, 30, 56]),
        ),
    ];
    for (name, whole, block) in cases {
        let src = random(whole.volume(), 7);
        let mut dst = vec![0.0f32; block.volume()];
        g.throughput(Throughput::Bytes((block.volume() * 4) as u64));
        g.bench_function(format!("copy/{name}"), |bench| {
            bench.iter(|| copy_rect(black_box(&src), &whole, &mut dst, &block, &block))
        });
        g.bench_function(format!("add/{name}"), |bench| {
            bench.iter(|| add_rect(black_box(&src), &whole, &mut dst, &block, &block))
        });
    }
    // A piece of one instance into a piece of another on the same device (a row-split tile into
    // a column-split layer's input, halo included): through a gathered buffer, as the runtime did,
    // and straight across, as it does.
    let src_layout = Rect::new(&[0, 0, 0, 0], &[BATCH, 64, 14, 28]);
    let dst_layout = Rect::new(&[0, 0, 0, 0], &[BATCH, 64, 28, 15]);
    let piece = Rect::new(&[0, 0, 0, 0], &[BATCH, 64, 14, 15]);
    let src = random(src_layout.volume(), 9);
    let mut dst = vec![0.0f32; dst_layout.volume()];
    let mut gathered = vec![0.0f32; piece.volume()];
    g.throughput(Throughput::Bytes((piece.volume() * 4) as u64));
    g.bench_function("piece_to_piece/via_buffer", |bench| {
        bench.iter(|| {
            copy_rect(black_box(&src), &src_layout, &mut gathered, &piece, &piece);
            copy_rect(&gathered, &piece, &mut dst, &dst_layout, &piece);
        })
    });
    g.bench_function("piece_to_piece/direct", |bench| {
        bench.iter(|| copy_rect(black_box(&src), &src_layout, &mut dst, &dst_layout, &piece))
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_gemm,
    bench_conv,
    bench_dense,
    bench_pool,
    bench_mobilenet,
    bench_rect_moves
);
criterion_main!(benches);
