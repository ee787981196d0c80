//! The CUDA kernels compiled for the host by its C++ compiler, with the CUDA built-ins emulated
//! one thread at a time, against the CPU kernels: every kernel's indexing, window arithmetic,
//! statistics and rounding checked on any machine with a C++ compiler, no GPU needed. Most checks
//! are exact, since the kernels round as the CPU does.
//!
//! What this cannot check is the parallel part: reductions run with one thread per block and
//! warps of one lane, so the strided loops and the shuffle trees run only on a GPU
//! (`gpu_kernels.rs`). Without a C++ compiler the test prints `skipped: <reason>` and passes
//! (fails where `LEGION_REQUIRE` lists `cxx`).

#![allow(clippy::too_many_arguments)]
use legion_ops::backend::cpu::{Buffer, Cpu, CpuStream};
use legion_ops::backend::{Backend, In, Out};
use legion_ops::data::{Synthetic, SyntheticBatch};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::op::{
    AdaptiveAvgPool2d, BatchNorm, OpSpec, Pool2d, PoolKind, PoolWindows, Unary, UnaryOp,
};
use legion_ops::rng::Rng;
use legion_ops::shape::{Rect, Shape, copy_rect};
use legion_ops::train::Sgd;
use libloading::{Library, Symbol};
use std::path::{Path, PathBuf};
use std::process::Command;

#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
struct Box4 {
    lo: [i64; 4],
    ext: [i64; 4],
}

/// Calls `f` with the offset in `layout` of every point of `region`.
fn for_each_point(region: &Rect, layout: &Rect, mut f: impl FnMut(usize)) {
    let (r, l) = (box4(region), box4(layout));
    for i in 0..r.ext.iter().product::<i64>() {
        let (mut rest, mut at) = (i, 0);
        let mut p = [0i64; 4];
        for axis in (0..4).rev() {
            p[axis] = r.lo[axis] + rest % r.ext[axis];
            rest /= r.ext[axis];
        }
        for ((&p, &lo), &ext) in p.iter().zip(&l.lo).zip(&l.ext) {
            at = at * ext + (p - lo);
        }
        f(at as usize);
    }
}

fn box4(r: &Rect) -> Box4 {
    let mut b = Box4 {
        lo: [0; 4],
        ext: [1; 4],
    };
    for a in 0..4 {
        b.lo[a] = r.lo[a] as i64;
        b.ext[a] = r.hi[a].saturating_sub(r.lo[a]) as i64;
    }
    b
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Pool {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    in_size: [i64; 2],
    out_size: [i64; 2],
    is_max: i32,
    adaptive: i32,
}

/// The kernels compiled for the host, and their launch: every (block, thread) in turn.
struct Emu {
    lib: Library,
}
type SetFn = unsafe extern "C" fn(u32, u32, u32, u32);

impl Emu {
    fn sym<T>(&self, name: &str) -> Symbol<'_, T> {
        unsafe { self.lib.get(name.as_bytes()).unwrap() }
    }
    fn launch(&self, grid: u32, block: u32, mut f: impl FnMut()) {
        let set: Symbol<SetFn> = self.sym("emu_set");
        for b in 0..grid {
            for t in 0..block {
                unsafe { set(b, block, grid, t) };
                f();
            }
        }
    }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// Checks so far: how many passed, and a line per failure.
struct Report {
    failures: Vec<String>,
    passed: usize,
}
impl Report {
    fn check(&mut self, name: &str, a: &[f32], b: &[f32], tol: f32) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| {
                if x.is_nan() && y.is_nan() {
                    0.0
                } else {
                    (x - y).abs()
                }
            })
            .fold(0f32, |m, v| {
                if v.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(v)
                }
            });
        if a.len() != b.len() || (diff / scale).is_nan() || diff / scale > tol {
            self.failures.push(format!(
                "{name}: rel {} (len {} vs {})",
                diff / scale,
                a.len(),
                b.len()
            ));
        } else {
            self.passed += 1;
        }
    }
    fn check_f64(&mut self, name: &str, a: &[f64], b: &[f64], tol: f64) {
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f64, f64::max);
        if a.len() != b.len() || (diff / scale).is_nan() || diff / scale > tol {
            self.failures
                .push(format!("{name}: rel {} a={a:?} b={b:?}", diff / scale));
        } else {
            self.passed += 1;
        }
    }
}

const NULL: *const f32 = std::ptr::null();

/// The CUDA built-ins the kernels use, for one host thread at a time. With a warp of one lane
/// every shuffle loop is empty and a block reduction is its one thread's sum.
const PRELUDE: &str = r#"
#pragma once
#include <math.h>
#include <string.h>
struct uint3 { unsigned x, y, z; };
extern "C" { extern uint3 threadIdx, blockIdx, blockDim, gridDim; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() do {} while (0)
#define WARP 1
template <class T> T __shfl_down_sync(unsigned, T v, int) { return v; }
template <class T> T __shfl_xor_sync(unsigned, T v, int) { return v; }
inline float __int_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
"#;

const LAUNCH: &str = r#"
extern "C" {
uint3 threadIdx, blockIdx, blockDim, gridDim;
void emu_set(unsigned block, unsigned block_dim, unsigned grid_dim, unsigned thread) {
    blockIdx.x = block; blockDim.x = block_dim; gridDim.x = grid_dim; threadIdx.x = thread;
}
}
"#;

/// Every op of the unary family with its default attribute, and LeakyReLU with another slope.
fn unary_ops() -> impl Iterator<Item = UnaryOp> + Clone {
    let defaults = Unary::ALL.iter().map(|&op| UnaryOp::from(op));
    defaults.chain([UnaryOp::with_alpha(Unary::LeakyRelu, 0.3)])
}

/// The forward kernels of ReLU (`None`) and of every op of the unary family.
fn forward_kernels() -> impl Iterator<Item = (&'static str, Option<UnaryOp>)> {
    std::iter::once(("relu_forward", None))
        .chain(unary_ops().map(|op| (op.op.kernel_names().0, Some(op))))
}

/// The backward kernels of ReLU (`None`) and of every op of the unary family.
fn backward_kernels() -> impl Iterator<Item = (&'static str, Option<UnaryOp>)> {
    std::iter::once(("relu_backward", None))
        .chain(unary_ops().map(|op| (op.op.kernel_names().1, Some(op))))
}

/// Compiles kernels.cu with the host's C++ compiler into a shared library, or says why not.
fn compile(dir: &Path) -> Result<PathBuf, String> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let prelude = dir.join("prelude.h");
    std::fs::write(&prelude, PRELUDE).map_err(|e| e.to_string())?;
    let launch = dir.join("launch.cpp");
    std::fs::write(&launch, LAUNCH).map_err(|e| e.to_string())?;
    let kernels = dir.join("kernels.cpp");
    std::fs::write(&kernels, legion_cuda::kernels::SOURCE).map_err(|e| e.to_string())?;
    let library = dir.join("libkernels.so");
    // -ffp-contract=off: no fused multiply-adds, as NVRTC's --fmad=false
    let output = Command::new(&compiler)
        .args(["-O1", "-shared", "-fPIC", "-ffp-contract=off", "-include"])
        .arg(&prelude)
        .arg(&launch)
        .arg(&kernels)
        .arg("-o")
        .arg(&library)
        .output()
        .map_err(|e| format!("no C++ compiler ({compiler}: {e})"))?;
    if !output.status.success() {
        return Err(format!(
            "{compiler} failed on the kernels:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(library)
}

#[test]
fn the_kernels_run_on_the_host_as_the_cpu_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let Some(emu) = emulator(dir.path()) else {
        return;
    };
    let mut report = Report {
        failures: vec![],
        passed: 0,
    };

    copy_region(&emu, &mut report);
    element_wise(&emu, &mut report);
    products(&emu, &mut report);
    pooling(&emu, &mut report);
    softmax(&emu, &mut report);
    batch_norm(&emu, &mut report);
    sgd(&emu, &mut report);
    synthetic_draw(&emu, &mut report);

    println!("{} checks passed", report.passed);
    assert!(
        report.failures.is_empty(),
        "{} failing checks:\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
}

/// The region copy, add and zero kernels against the CPU's.
fn copy_region(emu: &Emu, report: &mut Report) {
    type F = unsafe extern "C" fn(*const f32, Box4, *mut f32, Box4, Box4, i64);
    let f: Symbol<F> = emu.sym("copy_region_f32");
    let src_rect = Shape::nchw(2, 3, 5, 7).full_rect();
    let dst_rect = Rect::new(&[1, 0, 1, 2], &[2, 3, 5, 7]);
    let region = Rect::new(&[1, 1, 2, 2], &[2, 3, 4, 6]);
    let src = random(src_rect.volume(), 1);
    let mut want = vec![-1.0; dst_rect.volume()];
    copy_rect(&src, &src_rect, &mut want, &dst_rect, &region);
    let mut got = vec![-1.0; dst_rect.volume()];
    let n = region.volume() as i64;
    emu.launch(1, 1, || unsafe {
        f(
            src.as_ptr(),
            box4(&src_rect),
            got.as_mut_ptr(),
            box4(&dst_rect),
            box4(&region),
            n,
        )
    });
    report.check("copy_region", &got, &want, 0.0);

    // The same region zeroed, and summed in: what the runtime's folds do.
    type Z = unsafe extern "C" fn(*mut f32, Box4, Box4, i64);
    let zero: Symbol<Z> = emu.sym("zero_region_f32");
    let mut want = src.clone();
    for_each_point(&region, &src_rect, |at| want[at] = 0.0);
    let mut got = src.clone();
    emu.launch(1, 1, || unsafe {
        zero(got.as_mut_ptr(), box4(&src_rect), box4(&region), n)
    });
    report.check("zero_region", &got, &want, 0.0);
    type A = unsafe extern "C" fn(*const f32, *mut f32, i64);
    let add_runs: Symbol<A> = emu.sym("add_runs_f32");
    let term = random(src.len(), 2);
    let want: Vec<f32> = src.iter().zip(&term).map(|(a, b)| a + b).collect();
    let mut got = src.clone();
    let len = src.len() as i64;
    emu.launch(1, 1, || unsafe {
        add_runs(term.as_ptr(), got.as_mut_ptr(), len)
    });
    report.check("add_runs", &got, &want, 0.0);
}

/// The element-wise kernels against the CPU's.
fn element_wise(emu: &Emu, report: &mut Report) {
    let shape = Shape::nchw(2, 3, 5, 7);
    let full = shape.full_rect();
    let inner = Rect::new(&[0, 1, 1, 2], &[2, 3, 4, 6]);
    let nc = Shape::nc(4, 10).full_rect();
    let nc_tile = Rect::new(&[1, 3], &[3, 9]);
    for (what, view, tile) in [
        ("whole", full, full),
        ("inner", full, inner),
        ("nc", nc, nc_tile),
    ] {
        // over [-4, 4], through the kinks of the piecewise ops
        let x = Buffer::F32(random(view.volume(), 2).iter().map(|v| 4.0 * v).collect());
        let dy = Buffer::F32(random(view.volume(), 3));
        let n = tile.volume() as i64;
        let packed = (box4(&view) == box4(&tile)) as i32;
        type U = unsafe extern "C" fn(*const f32, Box4, *mut f32, Box4, i64, i32);
        type B = unsafe extern "C" fn(*const f32, Box4, *const f32, Box4, *mut f32, Box4, i64, i32);
        // the unary family's kernels take the op's attribute last
        type UA = unsafe extern "C" fn(*const f32, Box4, *mut f32, Box4, i64, i32, f32);
        type BA =
            unsafe extern "C" fn(*const f32, Box4, *const f32, Box4, *mut f32, Box4, i64, i32, f32);
        for (name, op) in forward_kernels() {
            let mut want = Buffer::F32(vec![0.0; tile.volume()]);
            let o = Out {
                rect: tile,
                mem: &mut want,
            };
            let i = In {
                rect: view,
                mem: &x,
            };
            match op {
                None => Cpu::default().relu_forward(&mut CpuStream, i, o),
                Some(op) => Cpu::default().unary_forward(&mut CpuStream, op, i, o),
            }
            let mut got = vec![0.0; tile.volume()];
            let (xp, yp) = (x.f32().as_ptr(), got.as_mut_ptr());
            let (xl, tl) = (box4(&view), box4(&tile));
            match op {
                None => {
                    let f: Symbol<U> = emu.sym(name);
                    emu.launch(1, 1, || unsafe { f(xp, xl, yp, tl, n, packed) });
                }
                Some(op) => {
                    let f: Symbol<UA> = emu.sym(name);
                    emu.launch(1, 1, || unsafe { f(xp, xl, yp, tl, n, packed, op.alpha()) });
                }
            }
            report.check(&format!("{name} {what}"), &got, want.f32(), 1e-6);
        }
        let backward = backward_kernels().map(|(name, op)| (name, Some(op)));
        for (name, op) in backward.chain([("add_forward", None)]) {
            let mut want = Buffer::F32(vec![0.0; tile.volume()]);
            let o = Out {
                rect: tile,
                mem: &mut want,
            };
            let (a, b) = (
                In {
                    rect: view,
                    mem: &x,
                },
                In {
                    rect: view,
                    mem: &dy,
                },
            );
            match op {
                Some(None) => Cpu::default().relu_backward(&mut CpuStream, a, b, o),
                Some(Some(op)) => Cpu::default().unary_backward(&mut CpuStream, op, a, b, o),
                None => Cpu::default().add_forward(&mut CpuStream, a, b, o),
            }
            let mut got = vec![0.0; tile.volume()];
            let (ap, bp, op_) = (x.f32().as_ptr(), dy.f32().as_ptr(), got.as_mut_ptr());
            let (vl, tl) = (box4(&view), box4(&tile));
            match op {
                Some(Some(op)) => {
                    let f: Symbol<BA> = emu.sym(name);
                    let a = op.alpha();
                    emu.launch(1, 1, || unsafe { f(ap, vl, bp, vl, op_, tl, n, packed, a) });
                }
                _ => {
                    let f: Symbol<B> = emu.sym(name);
                    emu.launch(1, 1, || unsafe { f(ap, vl, bp, vl, op_, tl, n, packed) });
                }
            }
            // SiLU's gradient recomputes an exponential, which the host's C library may round
            // differently from Rust's in the last bit
            let tol = if name.starts_with("silu") { 1e-6 } else { 0.0 };
            report.check(&format!("{name} {what}"), &got, want.f32(), tol);
        }
        // dropout
        {
            type D = unsafe extern "C" fn(
                *const f32,
                Box4,
                *mut f32,
                Box4,
                Box4,
                u64,
                *const u64,
                u64,
                f32,
                f32,
                i64,
            );
            let f: Symbol<D> = emu.sym("dropout_apply");
            let tshape = if view.ndim() == 4 {
                shape
            } else {
                Shape::nc(4, 10)
            };
            let mask = DropoutMask {
                rate: 0.3,
                seed: 42,
                step: 7,
                layer_salt: 3,
                shape: tshape,
            };
            let mut want = Buffer::F32(vec![0.0; tile.volume()]);
            Cpu::default().dropout_forward(
                &mut CpuStream,
                &mask,
                In {
                    rect: view,
                    mem: &x,
                },
                Out {
                    rect: tile,
                    mem: &mut want,
                },
            );
            // The step is read from device memory (a recorded step replays with the step
            // written before it), the key hashed in the kernel as rng::hash hashes it.
            let step = 7u64;
            let mut got = vec![0.0; tile.volume()];
            emu.launch(1, 1, || unsafe {
                f(
                    x.f32().as_ptr(),
                    box4(&view),
                    got.as_mut_ptr(),
                    box4(&tile),
                    box4(&tshape.full_rect()),
                    42,
                    &step,
                    3,
                    0.3,
                    mask.keep_scale(),
                    n,
                )
            });
            report.check(&format!("dropout {what}"), &got, want.f32(), 0.0);
        }
        // bias activation + channel sum: a block per part of a channel, walked with strides
        // that wrap rows and samples (1, 3, 7 and 64 threads; several threads of a block run one
        // after another here, which an element-wise kernel allows)
        {
            type BA = unsafe extern "C" fn(*mut f32, Box4, *const f32, i64, i32, i64);
            let f: Symbol<BA> = emu.sym("bias_activation");
            let c0 = tile.lo[1];
            let channels = tile.extent(1) as u32;
            let bias = random(10, 5);
            let y0 = random(tile.volume(), 6);
            let mut want = y0.clone();
            let plane: usize = (2..tile.ndim()).map(|a| tile.extent(a)).product();
            for (i, v) in want.iter_mut().enumerate() {
                let c = tile.lo[1] + (i / plane) % tile.extent(1);
                let z = *v + bias[c + 1 - c0];
                *v = if z < 0.0 { 0.0 } else { z };
            }
            for (parts, threads) in [(1i64, 1u32), (2, 3), (3, 7), (1, 64)] {
                let mut y = y0.clone();
                emu.launch(channels * parts as u32, threads, || unsafe {
                    f(
                        y.as_mut_ptr(),
                        box4(&tile),
                        bias.as_ptr(),
                        c0 as i64 - 1,
                        1,
                        parts,
                    )
                });
                report.check(
                    &format!("bias_activation {what} in {parts} part(s) of {threads} thread(s)"),
                    &y,
                    &want,
                    0.0,
                );
            }

            // a tile of one element per sample and channel (a dense layer's rows) runs the
            // row-major twin, channel i % C
            if plane == 1 {
                type BR = unsafe extern "C" fn(*mut f32, i64, i64, *const f32, i64, i32, i64);
                let f: Symbol<BR> = emu.sym("bias_activation_rows");
                let mut y = y0.clone();
                emu.launch(2, 5, || unsafe {
                    f(
                        y.as_mut_ptr(),
                        c0 as i64,
                        channels as i64,
                        bias.as_ptr(),
                        c0 as i64 - 1,
                        1,
                        n,
                    )
                });
                report.check(&format!("bias_activation_rows {what}"), &y, &want, 0.0);
            }

            type CS = unsafe extern "C" fn(*const f32, Box4, i64, *mut f64);
            type CF = unsafe extern "C" fn(*const f64, i64, i64, i64, *mut f32, i64);
            let f: Symbol<CS> = emu.sym("channel_sum");
            let finish: Symbol<CF> = emu.sym("channel_sum_finish");
            let dz = random(tile.volume(), 7);
            let mut want = vec![-3.0f32; 12];
            let mut sums = vec![0f64; tile.extent(1)];
            for (i, v) in dz.iter().enumerate() {
                sums[(i / plane) % tile.extent(1)] += *v as f64;
            }
            for (k, s) in sums.iter().enumerate() {
                want[tile.lo[1] + k - c0 + 2] = *s as f32;
            }
            for parts in [1i64, 3] {
                let mut partial = vec![f64::NAN; parts as usize * channels as usize];
                emu.launch(channels * parts as u32, 1, || unsafe {
                    f(dz.as_ptr(), box4(&tile), parts, partial.as_mut_ptr())
                });
                let mut got = vec![-3.0f32; 12];
                emu.launch(1, 1, || unsafe {
                    finish(
                        partial.as_ptr(),
                        parts,
                        channels as i64,
                        c0 as i64,
                        got.as_mut_ptr(),
                        c0 as i64 - 2,
                    )
                });
                report.check(
                    &format!("channel_sum {what} in {parts} part(s)"),
                    &got,
                    &want,
                    1e-6,
                );
            }
        }
    }
}

/// The products of `Mul` against the CPU's: of two tensors of one shape and by a channel scale,
/// whole and on an inner tile (whose scale gradient is a partial sum over its rows), each way.
fn products(emu: &Emu, report: &mut Report) {
    type B = unsafe extern "C" fn(*const f32, Box4, *const f32, Box4, *mut f32, Box4, i64, i32);
    type G = unsafe extern "C" fn(*const f32, Box4, *const f32, Box4, *mut f32, Box4, Box4);
    let forward: Symbol<B> = emu.sym("mul_forward");
    let scale_grad: Symbol<G> = emu.sym("mul_scale_grad");
    let shape = Shape::nchw(2, 3, 5, 7);
    let view = shape.full_rect();
    let x = Buffer::F32(random(view.volume(), 11));
    let dy = Buffer::F32(random(view.volume(), 12));
    let same = Buffer::F32(random(view.volume(), 13));
    let scale_rect = Shape::nchw(2, 3, 1, 1).full_rect();
    let scale = Buffer::F32(random(scale_rect.volume(), 14));
    let inner = Rect::new(&[0, 1, 1, 2], &[2, 3, 4, 6]);
    for (what, tile) in [("whole", view), ("inner", inner)] {
        for (factor, s_rect, s) in [("same", view, &same), ("scale", scale_rect, &scale)] {
            let name = format!("mul {factor} {what}");
            let at = |rect: Rect, mem| In { rect, mem };
            // forward, and dx = dy · s through the same kernel
            for (label, a) in [("forward", &x), ("input grad", &dy)] {
                let mut want = Buffer::F32(vec![0.0; tile.volume()]);
                let out = Out {
                    rect: tile,
                    mem: &mut want,
                };
                Cpu::default().mul_forward(&mut CpuStream, at(view, a), at(s_rect, s), out);
                let mut got = vec![0.0; tile.volume()];
                let packed = (box4(&view) == box4(&tile) && box4(&s_rect) == box4(&tile)) as i32;
                let n = tile.volume() as i64;
                let (ap, sp, yp) = (a.f32().as_ptr(), s.f32().as_ptr(), got.as_mut_ptr());
                let (al, sl, tl) = (box4(&view), box4(&s_rect), box4(&tile));
                emu.launch(1, 1, || unsafe {
                    forward(ap, al, sp, sl, yp, tl, n, packed)
                });
                report.check(&format!("{name} {label}"), &got, want.f32(), 0.0);
            }
            if factor == "same" {
                continue;
            }
            let ds_rect = tile.with_axis(2, 0, 1).with_axis(3, 0, 1);
            let mut want = Buffer::F32(vec![0.0; ds_rect.volume()]);
            let ds = Out {
                rect: ds_rect,
                mem: &mut want,
            };
            Cpu::default().mul_backward(
                &mut CpuStream,
                &tile,
                at(view, &x),
                at(s_rect, s),
                at(view, &dy),
                None,
                Some(ds),
            );
            let mut got = vec![0.0; ds_rect.volume()];
            let (xp, gp, dp) = (x.f32().as_ptr(), dy.f32().as_ptr(), got.as_mut_ptr());
            let (vl, rl, tl) = (box4(&view), box4(&ds_rect), box4(&tile));
            // one thread a block: a block reduction's threads cannot take turns on the host
            emu.launch(ds_rect.volume() as u32, 1, || unsafe {
                scale_grad(xp, vl, gp, vl, dp, rl, tl)
            });
            report.check(&format!("{name} scale grad"), &got, want.f32(), 1e-6);
        }
    }
}

/// The pooling kernels against the CPU's, ceil_mode windows among them.
fn pooling(emu: &Emu, report: &mut Report) {
    type PF = unsafe extern "C" fn(*const f32, Box4, *mut f32, Box4, Pool, i64);
    type PA = unsafe extern "C" fn(*const f32, Box4, Box4, *mut i64, Pool, i64);
    type PB = unsafe extern "C" fn(*const i64, Box4, *const f32, Box4, *mut f32, Pool, i64);
    let pf: Symbol<PF> = emu.sym("pool2d_forward");
    let pa: Symbol<PA> = emu.sym("pool2d_argmax");
    let pb: Symbol<PB> = emu.sym("pool2d_backward");
    let sliding = [
        Pool2d::max(3).stride(2).padding(1),
        Pool2d::avg(3).stride(2).padding(1),
        Pool2d::max(2),
        Pool2d::avg(2),
        Pool2d::max(3).stride(1).padding(1),
        Pool2d::avg(5).stride(3).padding(2),
        Pool2d::max(3).stride(2).ceil_mode(),
        Pool2d::avg(3).stride(2).padding(1).ceil_mode(),
        Pool2d::avg(2).stride(3).ceil_mode(),
    ];
    // overlapping windows (11 into 4, 9 into 2), upsampling (into 13 and 10), one window
    let adaptive = [[4, 2], [13, 10], [1, 1]].map(|output| AdaptiveAvgPool2d { output });
    let mut cases: Vec<(PoolWindows, Shape, Shape)> = Vec::new();
    for op in &sliding {
        // an even input, where ceil_mode keeps a last partial window, for the ceil_mode pools
        let in_shape = match op.ceil_mode {
            true => Shape::nchw(2, 3, 10, 8),
            false => Shape::nchw(2, 3, 11, 9),
        };
        let floor = Pool2d {
            ceil_mode: false,
            ..op.clone()
        };
        assert!(
            !op.ceil_mode || op.infer_shape(&[in_shape]) != floor.infer_shape(&[in_shape]),
            "{op:?} keeps no partial window over {in_shape}"
        );
        cases.push((op.into(), in_shape, op.infer_shape(&[in_shape]).unwrap()));
    }
    for op in &adaptive {
        let in_shape = Shape::nchw(2, 3, 11, 9);
        cases.push((op.windows(), in_shape, op.infer_shape(&[in_shape]).unwrap()));
    }
    for (i, &(op, in_shape, out)) in cases.iter().enumerate() {
        let oh = out.dim(2);
        let tiles = [
            (out.full_rect(), None),
            (out.full_rect().with_axis(2, 0, oh / 2), None),
            (out.full_rect().with_axis(2, oh / 2, oh), None),
            (
                out.full_rect()
                    .with_axis(1, 1, 3)
                    .with_axis(3, 1, out.dim(3)),
                None,
            ),
            (
                out.full_rect().with_axis(0, 1, 2),
                Some(in_shape.full_rect()),
            ),
        ];
        for (j, (tile, view)) in tiles.into_iter().enumerate() {
            let view = view.unwrap_or_else(|| op.project(in_shape, &tile));
            let x = Buffer::F32(random(view.volume(), 100 + 10 * i as u64 + j as u64));
            let dy = Buffer::F32(random(tile.volume(), 200 + 10 * i as u64 + j as u64));
            let mut y = Buffer::F32(vec![0.0; tile.volume()]);
            Cpu::default().pool2d_forward(
                &mut CpuStream,
                op,
                in_shape,
                In {
                    rect: view,
                    mem: &x,
                },
                Out {
                    rect: tile,
                    mem: &mut y,
                },
            );
            let mut dx = Buffer::F32(vec![0.0; view.volume()]);
            Cpu::default().pool2d_backward(
                &mut CpuStream,
                op,
                in_shape,
                In {
                    rect: view,
                    mem: &x,
                },
                In {
                    rect: tile,
                    mem: &dy,
                },
                Out {
                    rect: view,
                    mem: &mut dx,
                },
            );
            let in_size = [in_shape.dim(2) as i64, in_shape.dim(3) as i64];
            let is_max = matches!(op.kind(), PoolKind::Max) as i32;
            let pool = match op {
                PoolWindows::Sliding(p) => Pool {
                    kernel: p.kernel.map(|k| k as i64),
                    stride: p.stride.map(|k| k as i64),
                    padding: p.padding.map(|k| k as i64),
                    in_size,
                    out_size: [1, 1],
                    is_max,
                    adaptive: 0,
                },
                PoolWindows::Adaptive { output } => Pool {
                    kernel: [0, 0],
                    stride: [1, 1],
                    padding: [0, 0],
                    in_size,
                    out_size: output.map(|o| o as i64),
                    is_max,
                    adaptive: 1,
                },
            };
            let mut gy = vec![0.0; tile.volume()];
            let n = tile.volume() as i64;
            emu.launch(1, 1, || unsafe {
                pf(
                    x.f32().as_ptr(),
                    box4(&view),
                    gy.as_mut_ptr(),
                    box4(&tile),
                    pool,
                    n,
                )
            });
            report.check(&format!("pool fwd {i} tile {j}"), &gy, y.f32(), 0.0);
            // max pooling's argmax per output first (average pooling reads none)
            let mut argmax = vec![-1i64; tile.volume().max(1)];
            if matches!(op.kind(), PoolKind::Max) {
                let n = tile.volume() as i64;
                emu.launch(1, 1, || unsafe {
                    pa(
                        x.f32().as_ptr(),
                        box4(&view),
                        box4(&tile),
                        argmax.as_mut_ptr(),
                        pool,
                        n,
                    )
                });
            }
            let mut gdx = vec![-5.0; view.volume()];
            let n = view.volume() as i64;
            emu.launch(1, 1, || unsafe {
                pb(
                    argmax.as_ptr(),
                    box4(&view),
                    dy.f32().as_ptr(),
                    box4(&tile),
                    gdx.as_mut_ptr(),
                    pool,
                    n,
                )
            });
            report.check(&format!("pool bwd {i} tile {j}"), &gdx, dx.f32(), 0.0);
        }
    }
}

/// The softmax kernels against the CPU's.
fn softmax(emu: &Emu, report: &mut Report) {
    type R = unsafe extern "C" fn(*const f32, i64, i64, *const u32, i64, i64, *mut f32, *mut u32);
    type T = unsafe extern "C" fn(*const f32, *const u32, i64, *mut f64);
    type BW = unsafe extern "C" fn(*const f32, i64, i64, *const u32, i64, i64, f32, *mut f32);
    let rows_k: Symbol<R> = emu.sym("softmax_ce_rows");
    let totals_k: Symbol<T> = emu.sym("loss_totals");
    let bw_k: Symbol<BW> = emu.sym("softmax_ce_backward");
    for (n, classes, (r0, r1)) in [
        (6usize, 10usize, (0usize, 6usize)),
        (6, 37, (2, 5)),
        (33, 1000, (0, 33)),
        (5, 3, (4, 5)),
    ] {
        let logits_rect = Shape::nc(n, classes).full_rect().with_axis(0, r0, r1);
        let logits = Buffer::F32(
            random(logits_rect.volume(), 300 + classes as u64)
                .iter()
                .map(|v| v * 20.0)
                .collect(),
        );
        let labels: Vec<u32> = (r0..r1).map(|r| ((r * 7 + 3) % classes) as u32).collect();
        let rows = r1 - r0;
        let mut loss = Buffer::F32(vec![0.0; rows]);
        let sums = Cpu::default()
            .softmax_ce_forward(
                &mut CpuStream,
                In {
                    rect: logits_rect,
                    mem: &logits,
                },
                &labels,
                Out {
                    rect: Rect::new(&[r0, 0], &[r1, 1]),
                    mem: &mut loss,
                },
            )
            .unwrap();
        let scale = 1.0 / n as f32;
        let mut dl = Buffer::F32(vec![0.0; rows * classes]);
        Cpu::default()
            .softmax_ce_backward(
                &mut CpuStream,
                In {
                    rect: logits_rect,
                    mem: &logits,
                },
                &labels,
                scale,
                Out {
                    rect: Rect::new(&[r0, 0], &[r1, classes]),
                    mem: &mut dl,
                },
            )
            .unwrap();
        let mut gl = vec![0.0f32; rows];
        let mut correct = vec![0u32; rows];
        let blocks = rows.div_ceil(8) as u32;
        emu.launch(blocks, 8, || unsafe {
            rows_k(
                logits.f32().as_ptr(),
                r0 as i64,
                classes as i64,
                labels.as_ptr(),
                r0 as i64,
                rows as i64,
                gl.as_mut_ptr(),
                correct.as_mut_ptr(),
            )
        });
        let mut tot = vec![0f64; 2];
        emu.launch(1, 1, || unsafe {
            totals_k(gl.as_ptr(), correct.as_ptr(), rows as i64, tot.as_mut_ptr())
        });
        report.check(
            &format!("softmax loss {n}x{classes}"),
            &gl,
            loss.f32(),
            1e-6,
        );
        report.check_f64(
            &format!("softmax totals {n}x{classes}"),
            &tot,
            &[sums.loss_sum, sums.correct as f64],
            1e-6,
        );
        let mut gdl = vec![0.0f32; rows * classes];
        emu.launch(blocks, 8, || unsafe {
            bw_k(
                logits.f32().as_ptr(),
                r0 as i64,
                classes as i64,
                labels.as_ptr(),
                r0 as i64,
                rows as i64,
                scale,
                gdl.as_mut_ptr(),
            )
        });
        report.check(&format!("softmax bwd {n}x{classes}"), &gdl, dl.f32(), 1e-6);
    }
}

/// The batch norm kernels against the CPU's.
fn batch_norm(emu: &Emu, report: &mut Report) {
    type M = unsafe extern "C" fn(*const f32, Box4, Box4, i64, *mut f64);
    type MF = unsafe extern "C" fn(*const f64, i64, i64, i64, *mut f64);
    type AF = unsafe extern "C" fn(
        *const f64,
        i64,
        i64,
        *const f32,
        i64,
        *const f32,
        i64,
        f32,
        i64,
        i64,
        *mut f32,
    );
    type N = unsafe extern "C" fn(*const f32, Box4, *mut f32, Box4, *const f32, i32, i64);
    type IC = unsafe extern "C" fn(
        *const f64,
        i64,
        i64,
        *const f32,
        i64,
        *const f64,
        i64,
        i64,
        f32,
        i64,
        i64,
        *mut f32,
    );
    type RN = unsafe extern "C" fn(*const f64, i64, i64, *mut f32, i64, *mut f32, i64, f32);
    type GS = unsafe extern "C" fn(
        *const f32,
        Box4,
        *const f32,
        Box4,
        *const f32,
        Box4,
        Box4,
        *const f64,
        i64,
        i64,
        f32,
        i64,
        *mut f64,
    );
    type GF = unsafe extern "C" fn(
        *const f64,
        i64,
        i64,
        i64,
        i64,
        *const f64,
        i64,
        i64,
        f32,
        *mut f32,
        i64,
        *mut f32,
        i64,
        *mut f64,
    );
    type IG = unsafe extern "C" fn(
        *const f32,
        Box4,
        *const f32,
        Box4,
        *const f32,
        Box4,
        *mut f32,
        Box4,
        *const f32,
        i64,
    );
    let mk: Symbol<M> = emu.sym("bn_moments");
    let mf: Symbol<MF> = emu.sym("bn_sums_finish");
    let gf: Symbol<GF> = emu.sym("bn_grad_sums_finish");
    let af: Symbol<AF> = emu.sym("bn_affine");
    type AR = unsafe extern "C" fn(
        *const f32,
        i64,
        *const f32,
        i64,
        *const f32,
        i64,
        *const f32,
        i64,
        f32,
        i64,
        i64,
        *mut f32,
    );
    let ar: Symbol<AR> = emu.sym("bn_affine_running");
    let ic: Symbol<IC> = emu.sym("bn_input_coef");
    let nk: Symbol<N> = emu.sym("bn_normalize");
    let rk: Symbol<RN> = emu.sym("bn_running");
    let gk: Symbol<GS> = emu.sym("bn_grad_sums");
    let ik: Symbol<IG> = emu.sym("bn_input_grad");
    let shape = Shape::nchw(4, 3, 5, 6);
    let full = shape.full_rect();
    let nc = Shape::nc(8, 6);
    let cases = [
        (shape, full, (0usize, 3usize)),
        (shape, full.with_axis(0, 1, 3), (0, 3)),
        (shape, full.with_axis(1, 1, 3), (1, 3)),
        (shape, full.with_axis(1, 2, 3), (1, 3)),
        (shape, full.with_axis(2, 2, 5), (0, 3)),
        (shape, Rect::new(&[1, 1, 0, 3], &[4, 3, 5, 6]), (1, 3)),
        (nc, nc.full_rect(), (0, 6)),
        (nc, Rect::new(&[2, 1], &[7, 4]), (0, 6)),
    ];
    for (ci, (shape, tile, (g0, g1))) in cases.into_iter().enumerate() {
        for relu in [false, true] {
            let op = BatchNorm {
                relu,
                ..BatchNorm::default()
            };
            let fullr = shape.full_rect();
            let c = shape.dim(1);
            let x = Buffer::F32(random(fullr.volume(), 400 + ci as u64));
            let srect = |a: usize, b: usize| Rect::new(&[0, a], &[3, b]);
            let ch = |a: usize, b: usize| Rect::new(&[a], &[b]);
            // moments of the tile
            let tc = tile.extent(1);
            let mut want_m = Buffer::F64(vec![0.0; 3 * tc]);
            Cpu::default().bn_moments(
                &mut CpuStream,
                In {
                    rect: fullr,
                    mem: &x,
                },
                &tile,
                Out {
                    rect: srect(tile.lo[1], tile.hi[1]),
                    mem: &mut want_m,
                },
            );
            // a channel's sums in one part, and split into three (every split the GPU makes
            // adds its parts in the same way)
            let count = (tile.extent(0) * tile.extent(2) * tile.extent(3)) as i64;
            for parts in [1i64, 3] {
                let mut partial = vec![f64::NAN; 2 * parts as usize * tc];
                emu.launch(tc as u32 * parts as u32, 1, || unsafe {
                    mk(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        box4(&tile),
                        parts,
                        partial.as_mut_ptr(),
                    )
                });
                let mut got_m = vec![0f64; 3 * tc];
                emu.launch(1, 1, || unsafe {
                    mf(
                        partial.as_ptr(),
                        parts,
                        tc as i64,
                        count,
                        got_m.as_mut_ptr(),
                    )
                });
                report.check_f64(
                    &format!("bn moments {ci} in {parts} part(s)"),
                    &got_m,
                    want_m.f64(),
                    1e-12,
                );
            }
            // whole-group moments
            let group = fullr.with_axis(1, g0, g1);
            let mut m = Buffer::F64(vec![0.0; 3 * (g1 - g0)]);
            Cpu::default().bn_moments(
                &mut CpuStream,
                In {
                    rect: fullr,
                    mem: &x,
                },
                &group,
                Out {
                    rect: srect(g0, g1),
                    mem: &mut m,
                },
            );
            let gamma = Buffer::F32(random(c, 500).iter().map(|v| v + 1.5).collect());
            let beta = Buffer::F32(random(c, 501));
            let mut want_y = Buffer::F32(vec![0.0; tile.volume()]);
            let mi = In {
                rect: srect(g0, g1),
                mem: &m,
            };
            Cpu::default().bn_normalize(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                mi,
                In {
                    rect: ch(0, c),
                    mem: &gamma,
                },
                In {
                    rect: ch(0, c),
                    mem: &beta,
                },
                Out {
                    rect: tile,
                    mem: &mut want_y,
                },
            );
            let tc_tile = tile.extent(1);
            let mut coef = vec![f32::NAN; 3 * tc_tile];
            emu.launch(1, 1, || unsafe {
                af(
                    m.f64().as_ptr(),
                    g0 as i64,
                    (g1 - g0) as i64,
                    gamma.f32().as_ptr(),
                    0,
                    beta.f32().as_ptr(),
                    0,
                    op.eps,
                    tile.lo[1] as i64,
                    tc_tile as i64,
                    coef.as_mut_ptr(),
                )
            });
            let channels = tc_tile as u32;
            for (parts, threads) in [(1i64, 1u32), (2, 3), (3, 7), (1, 64)] {
                let mut gy = vec![f32::NAN; tile.volume()];
                emu.launch(channels * parts as u32, threads, || unsafe {
                    nk(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        gy.as_mut_ptr(),
                        box4(&tile),
                        coef.as_ptr(),
                        relu as i32,
                        parts,
                    )
                });
                report.check(
                    &format!(
                        "bn normalize {ci} relu {relu} in {parts} part(s) of {threads} thread(s)"
                    ),
                    &gy,
                    want_y.f32(),
                    0.0,
                );
            }
            // inference: the same normalisation with the running statistics' coefficients
            let running_mean = Buffer::F32(random(c, 502));
            let running_var = Buffer::F32(random(c, 503).iter().map(|v| v.abs() + 0.1).collect());
            let whole = |mem| In {
                rect: ch(0, c),
                mem,
            };
            let mut want_inferred = Buffer::F32(vec![0.0; tile.volume()]);
            Cpu::default().bn_infer(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                whole(&gamma),
                whole(&beta),
                whole(&running_mean),
                whole(&running_var),
                Out {
                    rect: tile,
                    mem: &mut want_inferred,
                },
            );
            let mut running_coef = vec![f32::NAN; 3 * tc_tile];
            emu.launch(1, 1, || unsafe {
                ar(
                    running_mean.f32().as_ptr(),
                    0,
                    running_var.f32().as_ptr(),
                    0,
                    gamma.f32().as_ptr(),
                    0,
                    beta.f32().as_ptr(),
                    0,
                    op.eps,
                    tile.lo[1] as i64,
                    tc_tile as i64,
                    running_coef.as_mut_ptr(),
                )
            });
            let mut gy = vec![f32::NAN; tile.volume()];
            emu.launch(channels * 2, 3, || unsafe {
                nk(
                    x.f32().as_ptr(),
                    box4(&fullr),
                    gy.as_mut_ptr(),
                    box4(&tile),
                    running_coef.as_ptr(),
                    relu as i32,
                    2,
                )
            });
            report.check(
                &format!("bn inference {ci} relu {relu}"),
                &gy,
                want_inferred.f32(),
                0.0,
            );
            // an [N, C] tile (batch norm after a dense layer) runs the row-major twin
            if tile.extent(2) * tile.extent(3) == 1 {
                type NR = unsafe extern "C" fn(
                    *const f32,
                    Box4,
                    *mut f32,
                    Box4,
                    *const f32,
                    i32,
                    i64,
                    i32,
                );
                let f: Symbol<NR> = emu.sym("bn_normalize_rows");
                let mut gy = vec![f32::NAN; tile.volume()];
                emu.launch(2, 5, || unsafe {
                    f(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        gy.as_mut_ptr(),
                        box4(&tile),
                        coef.as_ptr(),
                        relu as i32,
                        tile.volume() as i64,
                        0,
                    )
                });
                report.check(
                    &format!("bn normalize rows {ci} relu {relu}"),
                    &gy,
                    want_y.f32(),
                    0.0,
                );
            }
            // running
            let rm0 = random(c, 502);
            let rv0: Vec<f32> = random(c, 503).iter().map(|v| v + 1.5).collect();
            let (mut rm, mut rv) = (Buffer::F32(rm0.clone()), Buffer::F32(rv0.clone()));
            Cpu::default().bn_running(
                &mut CpuStream,
                &op,
                mi,
                Out {
                    rect: ch(0, c),
                    mem: &mut rm,
                },
                Out {
                    rect: ch(0, c),
                    mem: &mut rv,
                },
            );
            let (mut grm, mut grv) = (rm0.clone(), rv0.clone());
            emu.launch(1, 1, || unsafe {
                rk(
                    m.f64().as_ptr(),
                    g0 as i64,
                    (g1 - g0) as i64,
                    grm.as_mut_ptr(),
                    0,
                    grv.as_mut_ptr(),
                    0,
                    op.momentum,
                )
            });
            report.check(&format!("bn running mean {ci}"), &grm, rm.f32(), 0.0);
            report.check(&format!("bn running var {ci}"), &grv, rv.f32(), 0.0);
            // y over the group, for the relu mask
            let mut yg = Buffer::F32(vec![0.0; group.volume()]);
            Cpu::default().bn_normalize(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                mi,
                In {
                    rect: ch(0, c),
                    mem: &gamma,
                },
                In {
                    rect: ch(0, c),
                    mem: &beta,
                },
                Out {
                    rect: group,
                    mem: &mut yg,
                },
            );
            let dy = Buffer::F32(random(fullr.volume(), 504));
            let (mut dg, mut db) = (Buffer::F32(vec![-2.0; c]), Buffer::F32(vec![-2.0; c]));
            let mut sums = Buffer::F64(vec![0.0; 3 * tc]);
            let yin = relu.then_some(In {
                rect: group,
                mem: &yg,
            });
            Cpu::default().bn_grad_sums(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                yin,
                In {
                    rect: fullr,
                    mem: &dy,
                },
                mi,
                &tile,
                Out {
                    rect: ch(0, c),
                    mem: &mut dg,
                },
                Out {
                    rect: ch(0, c),
                    mem: &mut db,
                },
                Out {
                    rect: srect(tile.lo[1], tile.hi[1]),
                    mem: &mut sums,
                },
            );
            let yptr = if relu { yg.f32().as_ptr() } else { NULL };
            for parts in [1i64, 3] {
                let (mut gdg, mut gdb) = (vec![-2.0f32; c], vec![-2.0f32; c]);
                let mut gsums = vec![0f64; 3 * tc];
                let mut partial = vec![f64::NAN; 2 * parts as usize * tc];
                emu.launch(tc as u32 * parts as u32, 1, || unsafe {
                    gk(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        yptr,
                        box4(&group),
                        dy.f32().as_ptr(),
                        box4(&fullr),
                        box4(&tile),
                        m.f64().as_ptr(),
                        g0 as i64,
                        (g1 - g0) as i64,
                        op.eps,
                        parts,
                        partial.as_mut_ptr(),
                    )
                });
                emu.launch(1, 1, || unsafe {
                    gf(
                        partial.as_ptr(),
                        parts,
                        tc as i64,
                        count,
                        tile.lo[1] as i64,
                        m.f64().as_ptr(),
                        g0 as i64,
                        (g1 - g0) as i64,
                        op.eps,
                        gdg.as_mut_ptr(),
                        0,
                        gdb.as_mut_ptr(),
                        0,
                        gsums.as_mut_ptr(),
                    )
                });
                let what = format!("{ci} relu {relu} in {parts} part(s)");
                report.check(&format!("bn dgamma {what}"), &gdg, dg.f32(), 1e-6);
                report.check(&format!("bn dbeta {what}"), &gdb, db.f32(), 1e-6);
                report.check_f64(&format!("bn grad sums {what}"), &gsums, sums.f64(), 1e-10);
            }
            // input grad from whole-group sums
            let mut gsum_group = Buffer::F64(vec![0.0; 3 * (g1 - g0)]);
            let (mut t1, mut t2) = (Buffer::F32(vec![0.0; c]), Buffer::F32(vec![0.0; c]));
            Cpu::default().bn_grad_sums(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                yin,
                In {
                    rect: fullr,
                    mem: &dy,
                },
                mi,
                &group,
                Out {
                    rect: ch(0, c),
                    mem: &mut t1,
                },
                Out {
                    rect: ch(0, c),
                    mem: &mut t2,
                },
                Out {
                    rect: srect(g0, g1),
                    mem: &mut gsum_group,
                },
            );
            let mut dx = Buffer::F32(vec![0.0; tile.volume()]);
            Cpu::default().bn_input_grad(
                &mut CpuStream,
                &op,
                In {
                    rect: fullr,
                    mem: &x,
                },
                yin,
                In {
                    rect: fullr,
                    mem: &dy,
                },
                mi,
                In {
                    rect: ch(0, c),
                    mem: &gamma,
                },
                In {
                    rect: srect(g0, g1),
                    mem: &gsum_group,
                },
                Out {
                    rect: tile,
                    mem: &mut dx,
                },
            );
            let mut coef = vec![f32::NAN; 5 * tc];
            emu.launch(1, 1, || unsafe {
                ic(
                    m.f64().as_ptr(),
                    g0 as i64,
                    (g1 - g0) as i64,
                    gamma.f32().as_ptr(),
                    0,
                    gsum_group.f64().as_ptr(),
                    g0 as i64,
                    (g1 - g0) as i64,
                    op.eps,
                    tile.lo[1] as i64,
                    tc as i64,
                    coef.as_mut_ptr(),
                )
            });
            for (parts, threads) in [(1i64, 1u32), (2, 3), (3, 7), (1, 64)] {
                let mut gdx = vec![f32::NAN; tile.volume()];
                emu.launch(tc as u32 * parts as u32, threads, || unsafe {
                    ik(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        yptr,
                        box4(&group),
                        dy.f32().as_ptr(),
                        box4(&fullr),
                        gdx.as_mut_ptr(),
                        box4(&tile),
                        coef.as_ptr(),
                        parts,
                    )
                });
                report.check(
                    &format!(
                        "bn input grad {ci} relu {relu} in {parts} part(s) of {threads} thread(s)"
                    ),
                    &gdx,
                    dx.f32(),
                    0.0,
                );
            }
            if tile.extent(2) * tile.extent(3) == 1 {
                type IR = unsafe extern "C" fn(
                    *const f32,
                    Box4,
                    *const f32,
                    Box4,
                    *const f32,
                    Box4,
                    *mut f32,
                    Box4,
                    *const f32,
                    i64,
                    i32,
                );
                let f: Symbol<IR> = emu.sym("bn_input_grad_rows");
                let mut gdx = vec![f32::NAN; tile.volume()];
                emu.launch(2, 5, || unsafe {
                    f(
                        x.f32().as_ptr(),
                        box4(&fullr),
                        yptr,
                        box4(&group),
                        dy.f32().as_ptr(),
                        box4(&fullr),
                        gdx.as_mut_ptr(),
                        box4(&tile),
                        coef.as_ptr(),
                        tile.volume() as i64,
                        0,
                    )
                });
                report.check(
                    &format!("bn input grad rows {ci} relu {relu}"),
                    &gdx,
                    dx.f32(),
                    0.0,
                );
            }
        }
    }
}

/// The sgd kernels against the CPU's.
fn sgd(emu: &Emu, report: &mut Report) {
    type S = unsafe extern "C" fn(*const f32, *mut f32, *mut f32, i64, f32, f32, f32);
    let f: Symbol<S> = emu.sym("sgd_update");
    let g = random(1000, 600);
    let w0 = random(1000, 601);
    let v0 = random(1000, 602);
    let sgd = Sgd::default();
    let (mut w, mut v) = (w0.clone(), v0.clone());
    sgd.update(&mut w, &g, &mut v);
    let (mut gw, mut gv) = (w0.clone(), v0.clone());
    emu.launch(1, 1, || unsafe {
        f(
            g.as_ptr(),
            gw.as_mut_ptr(),
            gv.as_mut_ptr(),
            1000,
            sgd.lr,
            sgd.momentum,
            sgd.weight_decay,
        )
    });
    report.check("sgd w", &gw, &w, 0.0);
    report.check("sgd v", &gv, &v, 0.0);
}

/// Synthetic data drawn on the device, against the host's drawing: bit for bit.
fn synthetic_draw(emu: &Emu, report: &mut Report) {
    type F = unsafe extern "C" fn(*mut f32, *const f32, *const u64, f32, i64, i64, i64, i64);
    let f: Symbol<F> = emu.sym("synthetic_draw");
    for (image, classes) in [([3usize, 13, 9], 7usize), ([1, 5, 16], 2)] {
        let data = Synthetic::new(17, 40, classes, image).unwrap();
        let batch = data.describe_batch(&[3, 0, 39, 3, 21]).unwrap();
        let mut want = vec![f32::NAN; batch.len() * batch.sample_len()];
        batch.render(&mut want);
        let mut got = vec![f32::NAN; want.len()];
        let [c, h, w] = image.map(|e| e as i64);
        // A grid smaller than the batch, so the grid-stride loop runs more than once.
        emu.launch(3, 32, || unsafe {
            f(
                got.as_mut_ptr(),
                batch.factors.as_ptr(),
                batch.noise_states.as_ptr(),
                SyntheticBatch::noise_scale(),
                batch.len() as i64,
                c,
                h,
                w,
            )
        });
        let differing = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        if differing == 0 {
            report.passed += 1;
        } else {
            report.failures.push(format!(
                "synthetic_draw {image:?}: {differing} of {} values differ from the host's",
                want.len()
            ));
        }
    }
}

/// The kernels compiled for the host, or `None` after saying why not (no C++ compiler).
fn emulator(dir: &Path) -> Option<Emu> {
    let library = match compile(dir) {
        Ok(library) => library,
        Err(reason) if reason.starts_with("no C++ compiler") => {
            legion_ops::require::skip(legion_ops::require::Need::Cxx, reason);
            return None;
        }
        Err(reason) => panic!("{reason}"),
    };
    // SAFETY: a library built just now from our own source; loading runs no initialisers of note.
    Some(Emu {
        lib: unsafe { Library::new(&library).unwrap() },
    })
}

/// The floats whose bf16 rounding is easiest to get wrong: ties either way, values one bit off a
/// tie, carries into the next binade and into infinity, the largest finite bf16 and the largest
/// f32, zeros, f32 and bf16 subnormals, infinities and NaNs (quiet, signalling with a payload
/// only in the dropped half, negative), then a sweep of random bit patterns over every exponent.
fn rounding_cases() -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0x3f80_8000, // 1 + 2^-8: a tie, rounds down to the even 1
        0x3f81_8000, // 1 + 3·2^-8: a tie, rounds up to the even 1 + 2^-6
        0xbf80_8000, // a negative tie
        0x3f80_8001, // just above a tie: up
        0x3f80_7fff, // just below a tie: down
        0x3fff_ffff, // carries into the next binade
        0x7f7f_0000, // the largest finite bf16
        0x7f7f_7fff, // rounds to it
        0x7f7f_8000, // a tie at the top: rounds to infinity (even)
        0x7f7f_ffff, // f32::MAX: infinity
        0xff7f_ffff, // -f32::MAX: -infinity
        0x0000_0000,
        0x8000_0000,
        0x0000_0001, // the smallest f32 subnormal: rounds to +0
        0x0000_8000, // a subnormal tie: to the even 0
        0x0001_8000, // a subnormal tie: up to the even 2
        0x007f_ffff, // the largest f32 subnormal: carries into the smallest normal
        0x0040_0000, // a bf16 subnormal, exact
        0x8000_8001, // a negative subnormal just above a tie
        0x7f80_0000, // +infinity
        0xff80_0000, // -infinity
        0x7fc0_0000, // the quiet NaN
        0x7f80_0001, // a signalling NaN whose payload lies only in the dropped half
        0x7f81_0000, // a signalling NaN with an upper payload
        0xffc0_1234, // a negative NaN
    ];
    let mut rng = Rng::new(42);
    bits.extend((0..200_000).map(|_| (rng.next_u64() >> 32) as u32));
    bits.into_iter().map(f32::from_bits).collect()
}

#[test]
fn bf16_casts_round_to_nearest_even_as_the_reference_does() {
    let dir = tempfile::tempdir().unwrap();
    let Some(emu) = emulator(dir.path()) else {
        return;
    };
    type Down = unsafe extern "C" fn(*const f32, *mut u16, i64);
    type Up = unsafe extern "C" fn(*const u16, *mut f32, i64);
    let down: Symbol<Down> = emu.sym("cast_f32_bf16");
    let up: Symbol<Up> = emu.sym("cast_bf16_f32");

    // f32 → bf16: bit for bit what the `half` crate and the CPU's helper make of every case.
    let cases = rounding_cases();
    let mut got = vec![0u16; cases.len()];
    let n = cases.len() as i64;
    emu.launch(1, 1, || unsafe {
        down(cases.as_ptr(), got.as_mut_ptr(), n)
    });
    let mut wrong = Vec::new();
    for (x, &bits) in cases.iter().zip(&got) {
        let reference = half::bf16::from_f32(*x).to_bits();
        let helper = legion_ops::precision::bf16_bits(*x);
        if bits != reference || helper != reference {
            wrong.push(format!(
                "{:#010x}: kernel {bits:#06x}, helper {helper:#06x}, half {reference:#06x}",
                x.to_bits()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} casts differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong[..wrong.len().min(20)].join("\n")
    );

    // bf16 → f32 over all 65,536 patterns: exact (the upper half of the f32). `half` quiets a
    // signalling NaN on the way; the kernel keeps the bits, and a NaN stays a NaN either way.
    let every: Vec<u16> = (0..=u16::MAX).collect();
    let mut wide = vec![0f32; every.len()];
    let n = every.len() as i64;
    emu.launch(1, 1, || unsafe { up(every.as_ptr(), wide.as_mut_ptr(), n) });
    for (&b, w) in every.iter().zip(&wide) {
        let reference = half::bf16::from_bits(b).to_f32();
        if reference.is_nan() {
            assert!(w.is_nan() && w.to_bits() >> 16 == u32::from(b), "{b:#06x}");
        } else {
            assert_eq!(w.to_bits(), reference.to_bits(), "{b:#06x}");
        }
        // and back, unchanged (a NaN comes back quiet)
        if !w.is_nan() {
            assert_eq!(
                legion_ops::precision::bf16_bits(*w),
                b,
                "{b:#06x} round trip"
            );
        }
    }
    println!(
        "bf16 casts: {} f32 → bf16 cases and all 65,536 bf16 → f32 patterns match the reference",
        cases.len()
    );
}

#[test]
fn bf16_twins_compute_in_f32_between_a_bf16_load_and_store() {
    let dir = tempfile::tempdir().unwrap();
    let Some(emu) = emulator(dir.path()) else {
        return;
    };
    let bits = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&x| legion_ops::precision::bf16_bits(x))
            .collect()
    };
    let widen = |v: &[u16]| -> Vec<f32> {
        v.iter()
            .map(|&b| legion_ops::precision::bf16_value(b))
            .collect()
    };
    let shape = Shape::nchw(2, 3, 5, 7);
    let view = shape.full_rect();
    let tile = Rect::new(&[0, 1, 1, 2], &[2, 3, 4, 6]);
    let n = tile.volume() as i64;
    let x16 = bits(&random(view.volume(), 5));
    let x = widen(&x16);

    // unary twins: the CPU's f32 result on the bf16 inputs, rounded once
    type U = unsafe extern "C" fn(*const u16, Box4, *mut u16, Box4, i64, i32);
    type UA = unsafe extern "C" fn(*const u16, Box4, *mut u16, Box4, i64, i32, f32);
    for (name, op) in forward_kernels() {
        let symbol = format!("{name}_bf16");
        let mut want = Buffer::F32(vec![0.0; tile.volume()]);
        let (i, o) = (
            In {
                rect: view,
                mem: &Buffer::F32(x.clone()),
            },
            Out {
                rect: tile,
                mem: &mut want,
            },
        );
        match op {
            None => Cpu::default().relu_forward(&mut CpuStream, i, o),
            Some(op) => Cpu::default().unary_forward(&mut CpuStream, op, i, o),
        }
        let mut got = vec![0u16; tile.volume()];
        let (xp, yp, xl, tl) = (x16.as_ptr(), got.as_mut_ptr(), box4(&view), box4(&tile));
        match op {
            None => {
                let f: Symbol<U> = emu.sym(&symbol);
                emu.launch(1, 1, || unsafe { f(xp, xl, yp, tl, n, 0) });
            }
            Some(op) => {
                let f: Symbol<UA> = emu.sym(&symbol);
                emu.launch(1, 1, || unsafe { f(xp, xl, yp, tl, n, 0, op.alpha()) });
            }
        }
        let want: Vec<f32> = want
            .f32()
            .iter()
            .map(|&v| legion_ops::precision::round_bf16(v))
            .collect();
        // exp and tanh of the host's C library may differ from Rust's in the last f32 bit,
        // which can move a bf16 rounding by one ulp: 2^-7 relative.
        let tol = if name == "relu_forward" {
            0.0
        } else {
            1.0 / 128.0
        };
        let got = widen(&got);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= tol * w.abs(),
                "{name}_bf16: {g} against {w}"
            );
        }
    }

    // a bf16 fold adds in f32 and rounds once; a region copy moves the bits
    type A = unsafe extern "C" fn(*const u16, Box4, *mut u16, Box4, Box4, i64);
    let add: Symbol<A> = emu.sym("add_region_bf16");
    let copy: Symbol<A> = emu.sym("copy_region_bf16");
    let term16 = bits(&random(view.volume(), 6));
    let mut acc = x16.clone();
    emu.launch(1, 1, || unsafe {
        add(
            term16.as_ptr(),
            box4(&view),
            acc.as_mut_ptr(),
            box4(&view),
            box4(&tile),
            n,
        )
    });
    let mut want = x16.clone();
    for_each_point(&tile, &view, |at| {
        want[at] = legion_ops::precision::bf16_bits(widen(&[x16[at]])[0] + widen(&[term16[at]])[0])
    });
    assert_eq!(acc, want, "add_region_bf16");
    let mut copied = vec![0u16; view.volume()];
    emu.launch(1, 1, || unsafe {
        copy(
            x16.as_ptr(),
            box4(&view),
            copied.as_mut_ptr(),
            box4(&view),
            box4(&tile),
            n,
        )
    });
    let mut want = vec![0u16; view.volume()];
    for_each_point(&tile, &view, |at| want[at] = x16[at]);
    assert_eq!(copied, want, "copy_region_bf16");

    // the loss of bf16 logits is the f32 loss of their values
    type L = unsafe extern "C" fn(*const u16, i64, i64, *const u32, i64, i64, *mut f32, *mut u32);
    let rows: Symbol<L> = emu.sym("softmax_ce_rows_bf16");
    let (samples, classes) = (4usize, 10usize);
    let logits16 = bits(&random(samples * classes, 7));
    let labels: Vec<u32> = vec![3, 0, 9, 5];
    let mut loss = vec![0f32; samples];
    let mut correct = vec![0u32; samples];
    // one block of a warp (here one lane) per row; the rows past the last return
    emu.launch(1, 8, || unsafe {
        rows(
            logits16.as_ptr(),
            0,
            classes as i64,
            labels.as_ptr(),
            0,
            samples as i64,
            loss.as_mut_ptr(),
            correct.as_mut_ptr(),
        )
    });
    let logits = Buffer::F32(widen(&logits16));
    let mut want = Buffer::F32(vec![0.0; samples]);
    let nc = Shape::nc(samples, classes).full_rect();
    Cpu::default()
        .softmax_ce_forward(
            &mut CpuStream,
            In {
                rect: nc,
                mem: &logits,
            },
            &labels,
            Out {
                rect: Shape::nc(samples, 1).full_rect(),
                mem: &mut want,
            },
        )
        .unwrap();
    for (g, w) in loss.iter().zip(want.f32()) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "softmax_ce_rows_bf16: {g} against {w}"
        );
    }
}
