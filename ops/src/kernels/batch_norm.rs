//! Batch normalisation in training mode (NCHW or NC) over one tile, split into phases so that the
//! statistics are always those of the WHOLE batch, per channel over (N, H, W), however the layer is
//! partitioned.
//!
//! # Phase protocol
//!
//! The runtime runs the per-tile phases on every tile and reduces in between. A *channel group* is the
//! set of tiles sharing one channel range (they differ only in n, h, w); groups are independent.
//!
//! Forward:
//! 1. Per tile: [`partial_moments`]`(x, tile)` → [`MomentSums`] (Σx, Σx², element count per channel).
//! 2. Per channel group: sum the tiles' [`MomentSums`] ([`MomentSums::accumulate`]).
//! 3. [`BatchStats::from_sums`] → per-channel mean and biased variance. It is cheap: every tile may
//!    compute it from the reduced sums. Once per channel group (not per tile), update the running
//!    statistics with [`BatchStats::update_running`] (running_var takes the unbiased variance, as in
//!    PyTorch).
//! 4. Per tile: [`normalize`] → y = γ·x̂ + β (then ReLU when fused), x̂ = (x − mean)/√(var + eps).
//!
//! Backward (keep the forward's [`BatchStats`]; `relu_output` is `Some(y)` when the ReLU is fused):
//! 1. Per tile: [`partial_grad_sums`] → [`GradSums`] (Σdy, Σdy·x̂, count), with dy masked by y > 0
//!    first when the ReLU is fused.
//! 2. Per channel group: sum the tiles' [`GradSums`] ([`GradSums::accumulate`]).
//! 3. Per tile: [`input_grad`] → dx = γ/√(var + eps) · (dy − Σdy/M − x̂·Σ(dy·x̂)/M), M the global
//!    element count per channel.
//! 4. dγ = Σdy·x̂ and dβ = Σdy: [`GradSums::param_grads`] of the reduced sums, once per channel
//!    group. Equivalently, each tile may write the param_grads of its *partial* sums as its weight
//!    gradient contribution and let the runtime's usual sum over sample-split tiles add them.
//!
//! Reductions are plain sums of f64 vectors, so the order of the tiles only affects the last bits.
//! [`batch_norm_forward`] and [`batch_norm_backward`] chain the phases for a tile that spans the whole
//! batch (single-device training, or a layer split only along c).
//!
//! Parameter and running-statistic views are 1-d over channels and must cover the tile's channels.

use super::relu::{PIECE, for_each_run, par_runs, run_of};
use super::{View, ViewMut};
use crate::op::BatchNorm;
use crate::shape::Rect;
use rayon::prelude::*;
use std::ops::Range;

/// Per-channel Σx and Σx² of one tile, or of a channel group after reduction.
#[derive(Clone, Debug, PartialEq)]
pub struct MomentSums {
    /// Global channel range these sums cover.
    pub channels: Range<usize>,
    /// Elements summed per channel.
    pub count: u64,
    pub sum: Vec<f64>,
    pub sum_sq: Vec<f64>,
}

impl MomentSums {
    /// The identity of [`accumulate`](Self::accumulate), to reduce into.
    pub fn zeros(channels: Range<usize>) -> MomentSums {
        MomentSums {
            count: 0,
            sum: vec![0.0; channels.len()],
            sum_sq: vec![0.0; channels.len()],
            channels,
        }
    }

    /// Adds the sums of another tile of the same channel group.
    pub fn accumulate(&mut self, other: &MomentSums) {
        assert_eq!(
            self.channels, other.channels,
            "moment sums of different channel ranges"
        );
        self.count += other.count;
        add_into(&mut self.sum, &other.sum);
        add_into(&mut self.sum_sq, &other.sum_sq);
    }
}

/// Per-channel Σdy and Σdy·x̂ (dy masked by the fused ReLU) of one tile, or of a channel group after
/// reduction.
#[derive(Clone, Debug, PartialEq)]
pub struct GradSums {
    /// Global channel range these sums cover.
    pub channels: Range<usize>,
    /// Elements summed per channel.
    pub count: u64,
    pub sum_dy: Vec<f64>,
    pub sum_dy_xhat: Vec<f64>,
}

impl GradSums {
    /// The identity of [`accumulate`](Self::accumulate), to reduce into.
    pub fn zeros(channels: Range<usize>) -> GradSums {
        GradSums {
            count: 0,
            sum_dy: vec![0.0; channels.len()],
            sum_dy_xhat: vec![0.0; channels.len()],
            channels,
        }
    }

    /// Adds the sums of another tile of the same channel group.
    pub fn accumulate(&mut self, other: &GradSums) {
        assert_eq!(
            self.channels, other.channels,
            "gradient sums of different channel ranges"
        );
        self.count += other.count;
        add_into(&mut self.sum_dy, &other.sum_dy);
        add_into(&mut self.sum_dy_xhat, &other.sum_dy_xhat);
    }

    /// Writes dγ = Σdy·x̂ and dβ = Σdy for these channels (overwriting them in the views).
    pub fn param_grads(&self, mut dgamma: ViewMut<'_>, mut dbeta: ViewMut<'_>) {
        for (out, &s) in channel_slice_mut(&mut dgamma, &self.channels, "dgamma")
            .iter_mut()
            .zip(&self.sum_dy_xhat)
        {
            *out = s as f32;
        }
        for (out, &s) in channel_slice_mut(&mut dbeta, &self.channels, "dbeta")
            .iter_mut()
            .zip(&self.sum_dy)
        {
            *out = s as f32;
        }
    }
}

/// Per-channel batch mean and biased variance, as used to normalise.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchStats {
    /// Global channel range.
    pub channels: Range<usize>,
    /// Elements per channel the statistics were taken over (0 for running statistics).
    pub count: u64,
    pub mean: Vec<f64>,
    /// Biased (population) variance, as the normalisation uses.
    pub var: Vec<f64>,
    pub eps: f32,
}

impl BatchStats {
    /// Mean and biased variance from the sums of a whole channel group.
    pub fn from_sums(sums: &MomentSums, eps: f32) -> BatchStats {
        assert!(
            sums.count > 0,
            "batch statistics of channels {:?} over no elements",
            sums.channels
        );
        let count = sums.count as f64;
        let (mean, var) = sums
            .sum
            .iter()
            .zip(&sums.sum_sq)
            .map(|(&s, &q)| {
                let mean = s / count;
                // Rounding can push E[x²] − mean² slightly below zero for a constant channel.
                (mean, (q / count - mean * mean).max(0.0))
            })
            .unzip();
        BatchStats {
            channels: sums.channels.clone(),
            count: sums.count,
            mean,
            var,
            eps,
        }
    }

    /// The running statistics as the statistics to normalise with (evaluation mode).
    pub fn from_running(
        channels: Range<usize>,
        running_mean: View<'_>,
        running_var: View<'_>,
        eps: f32,
    ) -> BatchStats {
        let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect();
        BatchStats {
            mean: widen(channel_slice(&running_mean, &channels, "running_mean")),
            var: widen(channel_slice(&running_var, &channels, "running_var")),
            count: 0,
            channels,
            eps,
        }
    }

    /// running = (1 − momentum)·running + momentum·batch, with the unbiased variance for
    /// running_var (as PyTorch does). Run once per channel group and step.
    pub fn update_running(
        &self,
        momentum: f32,
        mut running_mean: ViewMut<'_>,
        mut running_var: ViewMut<'_>,
    ) {
        assert!(
            self.count > 0,
            "running statistics can only be updated from batch statistics"
        );
        let momentum = momentum as f64;
        let blend = |running: &mut f32, batch: f64| {
            *running = ((1.0 - momentum) * *running as f64 + momentum * batch) as f32;
        };
        // With one element per channel the unbiased variance is undefined; keep the biased one
        // rather than poison the running average with infinities.
        let bessel = if self.count > 1 {
            self.count as f64 / (self.count - 1) as f64
        } else {
            1.0
        };
        let means = channel_slice_mut(&mut running_mean, &self.channels, "running_mean");
        for (running, &mean) in means.iter_mut().zip(&self.mean) {
            blend(running, mean);
        }
        let vars = channel_slice_mut(&mut running_var, &self.channels, "running_var");
        for (running, &var) in vars.iter_mut().zip(&self.var) {
            blend(running, var * bessel);
        }
    }

    fn inv_std(&self, i: usize) -> f64 {
        1.0 / (self.var[i] + self.eps as f64).sqrt()
    }

    /// Where the tile's channels sit in the per-channel vectors (checking that they are covered).
    fn index_range(&self, tile: &Rect) -> Range<usize> {
        let (lo, hi) = (tile.lo[1], tile.hi[1]);
        assert!(
            self.channels.start <= lo && hi <= self.channels.end,
            "statistics of channels {:?} do not cover the tile {tile}",
            self.channels
        );
        lo - self.channels.start..hi - self.channels.start
    }
}

/// Phase 1 of the forward: Σx and Σx² per channel over `tile` (accumulated in f64). `x` must
/// contain the tile.
pub fn partial_moments(x: View<'_>, tile: &Rect) -> MomentSums {
    check_views(tile, &[x.rect]);
    let (sum, sum_sq) = channel_sums(tile, |plane| {
        let mut lanes = Lanes::default();
        for_each_run(plane, &[x.rect], 0, |start, len| {
            lanes.add_run(run_of(&x, &start, len), |v| {
                let v = v as f64;
                [v, v * v]
            });
        });
        lanes.total()
    });
    MomentSums {
        channels: tile.lo[1]..tile.hi[1],
        count: count_per_channel(tile),
        sum,
        sum_sq,
    }
}

/// Phase 4 of the forward: y = γ·(x − mean)/√(var + eps) + β over the tile `y.rect`, then max(·, 0)
/// when `relu`. `x` must contain the tile; `stats`, `gamma` and `beta` must cover its channels.
pub fn normalize(
    x: View<'_>,
    stats: &BatchStats,
    gamma: View<'_>,
    beta: View<'_>,
    relu: bool,
    mut y: ViewMut<'_>,
) {
    let tile = y.rect;
    check_views(&tile, &[x.rect]);
    let channels = tile.lo[1]..tile.hi[1];
    let gamma = channel_slice(&gamma, &channels, "gamma");
    let beta = channel_slice(&beta, &channels, "beta");
    let affine: Vec<Affine> = stats
        .index_range(&tile)
        .zip(gamma.iter().zip(beta))
        .map(|(i, (&g, &b))| Affine {
            mean: stats.mean[i] as f32,
            scale: (g as f64 * stats.inv_std(i)) as f32,
            shift: b,
        })
        .collect();
    par_runs(&mut y, &[x.rect], min_run_axis(&tile), |start, out| {
        let xs = run_of(&x, &start, out.len());
        map_run(
            &affine[start[1] - tile.lo[1]..],
            &tile,
            out,
            xs,
            |a, x, _| {
                let z = a.apply(x);
                if relu && z < 0.0 { 0.0 } else { z }
            },
        );
    });
}

/// Phase 1 of the backward: Σdy and Σdy·x̂ per channel over `tile`, with dy masked by
/// `relu_output > 0` when the ReLU is fused (pass the forward's y as `relu_output`). The views must
/// contain the tile; `stats` are the forward's.
pub fn partial_grad_sums(
    x: View<'_>,
    relu_output: Option<View<'_>>,
    dy: View<'_>,
    stats: &BatchStats,
    tile: &Rect,
) -> GradSums {
    let views = input_rects(&x, relu_output.as_ref(), &dy);
    check_views(tile, &views);
    let index = stats.index_range(tile);
    let mean_of = |plane: &Rect| stats.mean[plane.lo[1] - stats.channels.start];
    let (sum_dy, sum_dy_centered) = channel_sums(tile, |plane| {
        let mean = mean_of(plane);
        let terms = |g: f32, x: f32| {
            let g = g as f64;
            [g, g * (x as f64 - mean)]
        };
        let mut lanes = Lanes::default();
        for_each_run(plane, &views, 0, |start, len| {
            let xs = run_of(&x, &start, len);
            let dys = run_of(&dy, &start, len);
            match &relu_output {
                Some(y) => {
                    let ys = run_of(y, &start, len);
                    lanes.add_run3(dys, ys, xs, |g, yv, xv| terms(relu_mask(g, yv), xv));
                }
                None => lanes.add_run2(dys, xs, terms),
            }
        });
        lanes.total()
    });
    // Σdy·(x − mean) scaled once per channel rather than normalising every element.
    let sum_dy_xhat = sum_dy_centered
        .iter()
        .zip(index)
        .map(|(&s, i)| s * stats.inv_std(i))
        .collect();
    GradSums {
        channels: tile.lo[1]..tile.hi[1],
        count: count_per_channel(tile),
        sum_dy,
        sum_dy_xhat,
    }
}

/// Phase 3 of the backward: dx over the tile `dx.rect` from the channel group's reduced `sums`:
/// dx = γ/√(var + eps) · (dy − Σdy/M − x̂·Σ(dy·x̂)/M), dy masked by `relu_output > 0` when fused.
pub fn input_grad(
    x: View<'_>,
    relu_output: Option<View<'_>>,
    dy: View<'_>,
    stats: &BatchStats,
    gamma: View<'_>,
    sums: &GradSums,
    mut dx: ViewMut<'_>,
) {
    let tile = dx.rect;
    let views = input_rects(&x, relu_output.as_ref(), &dy);
    check_views(&tile, &views);
    assert_eq!(
        sums.count, stats.count,
        "gradient sums over {} elements per channel but statistics over {}: reduce every tile of \
         the channel group first",
        sums.count, stats.count
    );
    assert!(
        sums.channels.start <= tile.lo[1] && tile.hi[1] <= sums.channels.end,
        "gradient sums of channels {:?} do not cover the tile {tile}",
        sums.channels
    );
    let count = sums.count as f64;
    let channels = tile.lo[1]..tile.hi[1];
    let gamma = channel_slice(&gamma, &channels, "gamma");
    let coefficients: Vec<InputGrad> = stats
        .index_range(&tile)
        .zip(channels.clone())
        .zip(gamma)
        .map(|((i, c), &g)| {
            let j = c - sums.channels.start;
            let inv_std = stats.inv_std(i);
            InputGrad {
                mean: stats.mean[i] as f32,
                inv_std: inv_std as f32,
                scale: (g as f64 * inv_std) as f32,
                mean_dy: (sums.sum_dy[j] / count) as f32,
                mean_dy_xhat: (sums.sum_dy_xhat[j] / count) as f32,
            }
        })
        .collect();
    par_runs(&mut dx, &views, min_run_axis(&tile), |start, out| {
        let len = out.len();
        // First the (masked) upstream gradient, then the per-channel correction in place.
        let dys = run_of(&dy, &start, len);
        match &relu_output {
            Some(y) => {
                for ((o, &g), &yv) in out.iter_mut().zip(dys).zip(run_of(y, &start, len)) {
                    *o = relu_mask(g, yv);
                }
            }
            None => out.copy_from_slice(dys),
        }
        let xs = run_of(&x, &start, len);
        map_run(
            &coefficients[start[1] - tile.lo[1]..],
            &tile,
            out,
            xs,
            |k, x, g| k.apply(x, g),
        );
    });
}

/// Training-mode forward of a tile that spans the whole batch (all of N, H, W; any channels):
/// batch statistics, running-statistic update, normalisation. Returns the statistics the backward
/// needs.
pub fn batch_norm_forward(
    op: &BatchNorm,
    x: View<'_>,
    gamma: View<'_>,
    beta: View<'_>,
    running_mean: ViewMut<'_>,
    running_var: ViewMut<'_>,
    y: ViewMut<'_>,
) -> BatchStats {
    let stats = BatchStats::from_sums(&partial_moments(x, &y.rect), op.eps);
    stats.update_running(op.momentum, running_mean, running_var);
    normalize(x, &stats, gamma, beta, op.relu, y);
    stats
}

/// Backward of [`batch_norm_forward`] over the same whole-batch tile: dx, dγ and dβ. `y` is the
/// forward's output (only read when the ReLU is fused).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    op: &BatchNorm,
    x: View<'_>,
    y: View<'_>,
    dy: View<'_>,
    stats: &BatchStats,
    gamma: View<'_>,
    dx: ViewMut<'_>,
    dgamma: ViewMut<'_>,
    dbeta: ViewMut<'_>,
) {
    let relu_output = op.relu.then_some(y);
    let sums = partial_grad_sums(x, relu_output, dy, stats, &dx.rect);
    input_grad(x, relu_output, dy, stats, gamma, &sums, dx);
    sums.param_grads(dgamma, dbeta);
}

/// y = (x − mean)·scale + shift for one channel (scale = γ·invstd); centring first keeps precision
/// when the mean is large against the spread.
struct Affine {
    mean: f32,
    scale: f32,
    shift: f32,
}

impl Affine {
    fn apply(&self, x: f32) -> f32 {
        (x - self.mean) * self.scale + self.shift
    }
}

/// The per-channel constants of the input gradient.
struct InputGrad {
    mean: f32,
    inv_std: f32,
    /// γ·invstd.
    scale: f32,
    /// Σdy / M.
    mean_dy: f32,
    /// Σ(dy·x̂) / M.
    mean_dy_xhat: f32,
}

impl InputGrad {
    fn apply(&self, x: f32, dy: f32) -> f32 {
        let xhat = (x - self.mean) * self.inv_std;
        self.scale * (dy - self.mean_dy - xhat * self.mean_dy_xhat)
    }
}

fn relu_mask(dy: f32, y: f32) -> f32 {
    if y > 0.0 { dy } else { 0.0 }
}

/// Sets `out[i] = f(channel of element i, xs[i], out[i])` over a run from [`par_runs`].
/// `per_channel` starts at the run's first channel: NC runs advance along the channels, NCHW runs
/// stay inside one channel.
fn map_run<T>(
    per_channel: &[T],
    tile: &Rect,
    out: &mut [f32],
    xs: &[f32],
    f: impl Fn(&T, f32, f32) -> f32,
) {
    if tile.ndim() == 2 {
        for ((o, &x), k) in out.iter_mut().zip(xs).zip(per_channel) {
            *o = f(k, x, *o);
        }
    } else {
        let k = &per_channel[0];
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = f(k, x, *o);
        }
    }
}

/// Runs of an NCHW tile must not leave their channel; NC runs are rows along the channels.
fn min_run_axis(tile: &Rect) -> usize {
    if tile.ndim() == 2 { 1 } else { 2 }
}

/// Two per-channel sums over `tile` in f64: `plane(region)` sums one (sample, channel) plane and
/// planes are added per channel in sample order, so the result does not depend on the thread count.
fn channel_sums(tile: &Rect, plane: impl Fn(&Rect) -> [f64; 2] + Sync) -> (Vec<f64>, Vec<f64>) {
    let (samples, channels) = (tile.extent(0), tile.extent(1));
    let mut planes = vec![[0.0; 2]; samples * channels];
    if !tile.is_empty() {
        let plane_len = tile.volume() / planes.len();
        planes
            .par_iter_mut()
            .enumerate()
            .with_min_len((PIECE / plane_len).max(1))
            .for_each(|(i, out)| {
                let (c, n) = (tile.lo[1] + i / samples, tile.lo[0] + i % samples);
                *out = plane(&tile.with_axis(0, n, n + 1).with_axis(1, c, c + 1));
            });
    }
    let mut first = vec![0.0; channels];
    let mut second = vec![0.0; channels];
    for ((per_sample, a), b) in planes
        .chunks(samples.max(1))
        .zip(&mut first)
        .zip(&mut second)
    {
        for [s, q] in per_sample {
            *a += s;
            *b += q;
        }
    }
    (first, second)
}

fn count_per_channel(tile: &Rect) -> u64 {
    match tile.extent(1) {
        0 => 0,
        channels => (tile.volume() / channels) as u64,
    }
}

fn input_rects(x: &View<'_>, relu_output: Option<&View<'_>>, dy: &View<'_>) -> Vec<Rect> {
    let mut rects = vec![x.rect, dy.rect];
    rects.extend(relu_output.map(|y| y.rect));
    rects
}

fn check_views(tile: &Rect, views: &[Rect]) {
    assert!(
        tile.ndim() == 4 || tile.ndim() == 2,
        "batch norm tile {tile} must be NCHW or NC"
    );
    for view in views {
        assert!(
            view.ndim() == tile.ndim() && view.contains(tile),
            "view {view} does not contain the tile {tile}"
        );
    }
}

/// The values of channels `channels` in a 1-d per-channel view.
fn channel_slice<'a>(view: &View<'a>, channels: &Range<usize>, what: &str) -> &'a [f32] {
    let at = channel_offsets(&view.rect, channels, what);
    &view.data[at]
}

fn channel_slice_mut<'a>(
    view: &'a mut ViewMut<'_>,
    channels: &Range<usize>,
    what: &str,
) -> &'a mut [f32] {
    let at = channel_offsets(&view.rect, channels, what);
    &mut view.data[at]
}

fn channel_offsets(rect: &Rect, channels: &Range<usize>, what: &str) -> Range<usize> {
    assert!(
        rect.ndim() == 1 && rect.lo[0] <= channels.start && channels.end <= rect.hi[0],
        "{what} view {rect} does not cover channels {channels:?}"
    );
    channels.start - rect.lo[0]..channels.end - rect.lo[0]
}

/// Two f64 sums kept in [`LANES`] independent accumulators: a single running sum is one chain of
/// dependent additions, bound by the adder's latency rather than by memory. Element `i` of a run
/// always goes to lane `i % LANES` and the lanes are added in order, so the result depends only
/// on the runs, not on threads.
#[derive(Default)]
struct Lanes {
    first: [f64; LANES],
    second: [f64; LANES],
}

const LANES: usize = 8;

impl Lanes {
    fn add(&mut self, lane: usize, [a, b]: [f64; 2]) {
        self.first[lane] += a;
        self.second[lane] += b;
    }

    fn add_run(&mut self, xs: &[f32], terms: impl Fn(f32) -> [f64; 2]) {
        let mut chunks = xs.chunks_exact(LANES);
        for chunk in &mut chunks {
            for (lane, &x) in chunk.iter().enumerate() {
                self.add(lane, terms(x));
            }
        }
        for (lane, &x) in chunks.remainder().iter().enumerate() {
            self.add(lane, terms(x));
        }
    }

    fn add_run2(&mut self, a: &[f32], b: &[f32], terms: impl Fn(f32, f32) -> [f64; 2]) {
        let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (xa, xb) in (&mut ca).zip(&mut cb) {
            for lane in 0..LANES {
                self.add(lane, terms(xa[lane], xb[lane]));
            }
        }
        for (lane, (&x, &y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
            self.add(lane, terms(x, y));
        }
    }

    fn add_run3(
        &mut self,
        a: &[f32],
        b: &[f32],
        c: &[f32],
        terms: impl Fn(f32, f32, f32) -> [f64; 2],
    ) {
        let (mut ca, mut cb, mut cc) = (
            a.chunks_exact(LANES),
            b.chunks_exact(LANES),
            c.chunks_exact(LANES),
        );
        for ((xa, xb), xc) in (&mut ca).zip(&mut cb).zip(&mut cc) {
            for lane in 0..LANES {
                self.add(lane, terms(xa[lane], xb[lane], xc[lane]));
            }
        }
        let rest = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .zip(cc.remainder());
        for (lane, ((&x, &y), &z)) in rest.enumerate() {
            self.add(lane, terms(x, y, z));
        }
    }

    fn total(&self) -> [f64; 2] {
        [self.first.iter().sum(), self.second.iter().sum()]
    }
}

fn add_into(acc: &mut [f64], other: &[f64]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, max_rel_diff, random};
    use crate::rng::Rng;
    use crate::shape::{Shape, copy_rect};
    use std::collections::BTreeMap;

    fn op(relu: bool) -> BatchNorm {
        BatchNorm {
            relu,
            ..BatchNorm::default()
        }
    }

    fn channel_view(data: &[f32]) -> View<'_> {
        View::new(Rect::new(&[0], &[data.len()]), data)
    }

    fn channel_view_mut(data: &mut [f32]) -> ViewMut<'_> {
        ViewMut::new(Rect::new(&[0], &[data.len()]), data)
    }

    /// Every channel holds ± pairs of magnitudes in [0.3, 1.3], so its mean is 0 and every |x̂| is
    /// at least 0.3/1.3: with γ ≥ 0.5 and |β| ≤ 0.05 the pre-activations keep clear of the fused
    /// ReLU's kink by more than a finite-difference step moves them.
    fn symmetric_per_channel(shape: Shape, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let full = shape.full_rect();
        let mut x = vec![0.0; shape.numel()];
        for c in 0..shape.dim(1) {
            let channel = full.with_axis(1, c, c + 1);
            let m = channel.volume();
            assert!(m.is_multiple_of(2), "channels need an even element count");
            let values: Vec<f32> = (0..m / 2)
                .flat_map(|_| {
                    let v = rng.uniform(0.3, 1.3);
                    [v, -v]
                })
                .collect();
            copy_rect(&values, &channel, &mut x, &full, &channel);
        }
        x
    }

    struct Params {
        gamma: Vec<f32>,
        beta: Vec<f32>,
    }

    fn params(channels: usize, seed: u64) -> Params {
        let mut rng = Rng::new(seed);
        Params {
            gamma: (0..channels).map(|_| rng.uniform(0.5, 1.5)).collect(),
            beta: (0..channels).map(|_| rng.uniform(-0.05, 0.05)).collect(),
        }
    }

    /// Whole-tensor forward with throwaway running statistics.
    fn forward(op: &BatchNorm, shape: Shape, x: &[f32], p: &Params) -> (Vec<f32>, BatchStats) {
        let full = shape.full_rect();
        let channels = shape.dim(1);
        let (mut rm, mut rv) = (vec![0.0; channels], vec![1.0; channels]);
        let mut y = vec![0.0; x.len()];
        let stats = batch_norm_forward(
            op,
            View::new(full, x),
            channel_view(&p.gamma),
            channel_view(&p.beta),
            channel_view_mut(&mut rm),
            channel_view_mut(&mut rv),
            ViewMut::new(full, &mut y),
        );
        (y, stats)
    }

    struct Grads {
        dx: Vec<f32>,
        dgamma: Vec<f32>,
        dbeta: Vec<f32>,
    }

    fn backward(
        op: &BatchNorm,
        shape: Shape,
        x: &[f32],
        y: &[f32],
        dy: &[f32],
        stats: &BatchStats,
        p: &Params,
    ) -> Grads {
        let full = shape.full_rect();
        let channels = shape.dim(1);
        let mut g = Grads {
            dx: vec![0.0; x.len()],
            dgamma: vec![0.0; channels],
            dbeta: vec![0.0; channels],
        };
        batch_norm_backward(
            op,
            View::new(full, x),
            View::new(full, y),
            View::new(full, dy),
            stats,
            channel_view(&p.gamma),
            ViewMut::new(full, &mut g.dx),
            channel_view_mut(&mut g.dgamma),
            channel_view_mut(&mut g.dbeta),
        );
        g
    }

    fn check_gradients(shape: Shape, relu: bool) {
        let op = op(relu);
        let x = symmetric_per_channel(shape, 1);
        let p = params(shape.dim(1), 2);
        let weights = random(x.len(), 3);
        let (y, stats) = forward(&op, shape, &x, &p);
        let g = backward(&op, shape, &x, &y, &weights, &stats, &p);
        let weighted =
            |y: &[f32]| -> f64 { y.iter().zip(&weights).map(|(&y, &w)| (y * w) as f64).sum() };
        let what = format!("batch_norm {shape} relu={relu}");
        assert_grad(&format!("{what} dx"), &x, &g.dx, 150, |x| {
            weighted(&forward(&op, shape, x, &p).0)
        });
        assert_grad(
            &format!("{what} dgamma"),
            &p.gamma,
            &g.dgamma,
            10,
            |gamma| {
                let q = Params {
                    gamma: gamma.to_vec(),
                    beta: p.beta.clone(),
                };
                weighted(&forward(&op, shape, &x, &q).0)
            },
        );
        assert_grad(&format!("{what} dbeta"), &p.beta, &g.dbeta, 10, |beta| {
            let q = Params {
                gamma: p.gamma.clone(),
                beta: beta.to_vec(),
            };
            weighted(&forward(&op, shape, &x, &q).0)
        });
        if relu {
            assert!(y.contains(&0.0) && y.iter().any(|&v| v > 0.0));
        }
    }

    #[test]
    fn nchw_gradients_match_finite_differences() {
        check_gradients(Shape::nchw(2, 3, 3, 4), false);
    }

    #[test]
    fn nchw_fused_relu_gradients_match_finite_differences() {
        check_gradients(Shape::nchw(2, 3, 3, 4), true);
    }

    #[test]
    fn nc_gradients_match_finite_differences() {
        check_gradients(Shape::nc(8, 5), false);
    }

    #[test]
    fn nc_fused_relu_gradients_match_finite_differences() {
        check_gradients(Shape::nc(8, 5), true);
    }

    #[test]
    fn forward_normalises_and_updates_running_statistics_like_pytorch() {
        let shape = Shape::nchw(3, 2, 4, 5);
        let full = shape.full_rect();
        let x: Vec<f32> = random(shape.numel(), 4)
            .iter()
            .map(|v| 3.0 + 2.0 * v)
            .collect();
        let op = BatchNorm::default();
        let p = Params {
            gamma: vec![1.0, 2.0],
            beta: vec![0.0, -1.0],
        };
        let (mut rm, mut rv) = (vec![0.5, 0.0], vec![1.0, 2.0]);
        let mut y = vec![0.0; x.len()];
        batch_norm_forward(
            &op,
            View::new(full, &x),
            channel_view(&p.gamma),
            channel_view(&p.beta),
            channel_view_mut(&mut rm),
            channel_view_mut(&mut rv),
            ViewMut::new(full, &mut y),
        );
        for c in 0..2 {
            let channel = full.with_axis(1, c, c + 1);
            let gather = |data: &[f32]| {
                let mut out = vec![0.0; channel.volume()];
                copy_rect(data, &full, &mut out, &channel, &channel);
                out
            };
            let (xs, ys) = (gather(&x), gather(&y));
            let m = xs.len() as f64;
            let mean = xs.iter().map(|&v| v as f64).sum::<f64>() / m;
            let var = xs.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / m;
            for (&xv, &yv) in xs.iter().zip(&ys) {
                let expected =
                    p.gamma[c] as f64 * (xv as f64 - mean) / (var + 1e-5).sqrt() + p.beta[c] as f64;
                assert!((yv as f64 - expected).abs() < 1e-5, "{yv} vs {expected}");
            }
            let (rm0, rv0) = ([0.5, 0.0][c], [1.0, 2.0][c]);
            let expected_rm = 0.9 * rm0 + 0.1 * mean;
            let expected_rv = 0.9 * rv0 + 0.1 * var * m / (m - 1.0);
            assert!((rm[c] as f64 - expected_rm).abs() < 1e-6);
            assert!((rv[c] as f64 - expected_rv).abs() < 1e-6);
        }
    }

    #[test]
    fn running_statistics_normalise_in_evaluation_mode() {
        let shape = Shape::nc(2, 3);
        let full = shape.full_rect();
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (rm, rv) = ([1.0f32, 0.0, 3.0], [4.0f32, 1.0, 0.25]);
        let stats = BatchStats::from_running(0..3, channel_view(&rm), channel_view(&rv), 0.0);
        let p = params(3, 5);
        let mut y = vec![0.0; 6];
        normalize(
            View::new(full, &x),
            &stats,
            channel_view(&p.gamma),
            channel_view(&p.beta),
            false,
            ViewMut::new(full, &mut y),
        );
        for (i, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
            let c = i % 3;
            let expected = p.gamma[c] * (xv - rm[c]) / rv[c].sqrt() + p.beta[c];
            assert!((yv - expected).abs() < 1e-6);
        }
    }

    /// How a tiled run receives its input views.
    #[derive(Clone, Copy)]
    enum Views {
        /// Each tile gets buffers holding exactly its rect (what a runtime copy delivers).
        Exact,
        /// Each tile reads from the whole tensor's buffers.
        Whole,
    }

    /// An owned buffer for `tile`'s view of `data` (laid out over `full`).
    fn tile_input(data: &[f32], full: &Rect, tile: &Rect, views: Views) -> (Rect, Vec<f32>) {
        match views {
            Views::Whole => (*full, data.to_vec()),
            Views::Exact => {
                let mut out = vec![0.0; tile.volume()];
                copy_rect(data, full, &mut out, tile, tile);
                (*tile, out)
            }
        }
    }

    fn param_input(data: &[f32], tile: &Rect, views: Views) -> (Rect, Vec<f32>) {
        let full = Rect::new(&[0], &[data.len()]);
        let channels = Rect::new(&[tile.lo[1]], &[tile.hi[1]]);
        tile_input(data, &full, &channels, views)
    }

    /// Runs forward and backward on `tiles` with the phase protocol (partial sums reduced per channel
    /// group in between) and checks y, dx, dγ, dβ and the running statistics against the
    /// whole-tensor run.
    fn check_tiles_match_whole(shape: Shape, tiles: &[Rect], relu: bool, views: Views) {
        let op = op(relu);
        let full = shape.full_rect();
        let channels = shape.dim(1);
        // Off-centre data with unequal channel scales, as real activations are.
        let x: Vec<f32> = random(full.volume(), 6)
            .iter()
            .enumerate()
            .map(|(i, v)| 0.5 + (1 + i % 3) as f32 * v)
            .collect();
        let dy = random(full.volume(), 7);
        let p = params(channels, 8);

        let (mut rm_whole, mut rv_whole) = (vec![0.0; channels], vec![1.0; channels]);
        let mut y_whole = vec![0.0; x.len()];
        let stats_whole = batch_norm_forward(
            &op,
            View::new(full, &x),
            channel_view(&p.gamma),
            channel_view(&p.beta),
            channel_view_mut(&mut rm_whole),
            channel_view_mut(&mut rv_whole),
            ViewMut::new(full, &mut y_whole),
        );
        let whole = backward(&op, shape, &x, &y_whole, &dy, &stats_whole, &p);

        let group = |tile: &Rect| (tile.lo[1], tile.hi[1]);
        let inputs: Vec<(Rect, Vec<f32>)> = tiles
            .iter()
            .map(|t| tile_input(&x, &full, t, views))
            .collect();
        let x_view = |i: usize| View::new(inputs[i].0, &inputs[i].1);

        // Forward phase 1 and 2: partial moments, reduced per channel group.
        let mut moments: BTreeMap<(usize, usize), MomentSums> = BTreeMap::new();
        for (i, tile) in tiles.iter().enumerate() {
            let partial = partial_moments(x_view(i), tile);
            moments
                .entry(group(tile))
                .or_insert_with(|| MomentSums::zeros(tile.lo[1]..tile.hi[1]))
                .accumulate(&partial);
        }
        // Phase 3: statistics and the running update, once per group.
        let (mut rm, mut rv) = (vec![0.0; channels], vec![1.0; channels]);
        let stats: BTreeMap<_, _> = moments
            .iter()
            .map(|(&key, sums)| {
                let stats = BatchStats::from_sums(sums, op.eps);
                stats.update_running(
                    op.momentum,
                    channel_view_mut(&mut rm),
                    channel_view_mut(&mut rv),
                );
                (key, stats)
            })
            .collect();
        // Phase 4: normalise every tile.
        let mut y_tiled = vec![f32::NAN; x.len()];
        for (i, tile) in tiles.iter().enumerate() {
            let (gr, g) = param_input(&p.gamma, tile, views);
            let (br, b) = param_input(&p.beta, tile, views);
            let mut y = vec![0.0; tile.volume()];
            normalize(
                x_view(i),
                &stats[&group(tile)],
                View::new(gr, &g),
                View::new(br, &b),
                relu,
                ViewMut::new(*tile, &mut y),
            );
            copy_rect(&y, tile, &mut y_tiled, &full, tile);
        }

        // Backward phase 1 and 2.
        let ys: Vec<_> = tiles
            .iter()
            .map(|t| tile_input(&y_tiled, &full, t, views))
            .collect();
        let dys: Vec<_> = tiles
            .iter()
            .map(|t| tile_input(&dy, &full, t, views))
            .collect();
        let y_view = |i: usize| relu.then(|| View::new(ys[i].0, &ys[i].1));
        let dy_view = |i: usize| View::new(dys[i].0, &dys[i].1);
        let mut grad_sums: BTreeMap<(usize, usize), GradSums> = BTreeMap::new();
        // dγ, dβ as the sum of every tile's partial contribution, the alternative of phase 4.
        let (mut dgamma_summed, mut dbeta_summed) = (vec![0.0; channels], vec![0.0; channels]);
        for (i, tile) in tiles.iter().enumerate() {
            let partial =
                partial_grad_sums(x_view(i), y_view(i), dy_view(i), &stats[&group(tile)], tile);
            let (mut dg, mut db) = (vec![0.0; channels], vec![0.0; channels]);
            partial.param_grads(channel_view_mut(&mut dg), channel_view_mut(&mut db));
            add_into_f32(&mut dgamma_summed, &dg);
            add_into_f32(&mut dbeta_summed, &db);
            grad_sums
                .entry(group(tile))
                .or_insert_with(|| GradSums::zeros(tile.lo[1]..tile.hi[1]))
                .accumulate(&partial);
        }
        // Phase 3: input gradients.
        let mut dx_tiled = vec![f32::NAN; x.len()];
        for (i, tile) in tiles.iter().enumerate() {
            let (gr, g) = param_input(&p.gamma, tile, views);
            let mut dx = vec![0.0; tile.volume()];
            input_grad(
                x_view(i),
                y_view(i),
                dy_view(i),
                &stats[&group(tile)],
                View::new(gr, &g),
                &grad_sums[&group(tile)],
                ViewMut::new(*tile, &mut dx),
            );
            copy_rect(&dx, tile, &mut dx_tiled, &full, tile);
        }
        // Phase 4: dγ, dβ once per group, into their channel slices.
        let (mut dgamma, mut dbeta) = (vec![f32::NAN; channels], vec![f32::NAN; channels]);
        for sums in grad_sums.values() {
            sums.param_grads(channel_view_mut(&mut dgamma), channel_view_mut(&mut dbeta));
        }

        let close = |what: &str, tiled: &[f32], whole: &[f32]| {
            let diff = max_rel_diff(tiled, whole);
            assert!(
                diff <= 1e-5,
                "{what}: tiled differs from whole by {diff} (relative)"
            );
        };
        close("y", &y_tiled, &y_whole);
        close("dx", &dx_tiled, &whole.dx);
        close("dgamma", &dgamma, &whole.dgamma);
        close("dbeta", &dbeta, &whole.dbeta);
        close("dgamma (summed partials)", &dgamma_summed, &whole.dgamma);
        close("dbeta (summed partials)", &dbeta_summed, &whole.dbeta);
        close("running_mean", &rm, &rm_whole);
        close("running_var", &rv, &rv_whole);
        if relu {
            assert!(y_whole.contains(&0.0));
        }
    }

    fn add_into_f32(acc: &mut [f32], other: &[f32]) {
        for (a, b) in acc.iter_mut().zip(other) {
            *a += b;
        }
    }

    /// The 2×2 grid of `shape` cut at `at0` along `axis0` and at `at1` along `axis1`.
    fn grid(shape: Shape, (axis0, at0): (usize, usize), (axis1, at1): (usize, usize)) -> Vec<Rect> {
        let full = shape.full_rect();
        let mut tiles = Vec::new();
        for (lo0, hi0) in [(0, at0), (at0, shape.dim(axis0))] {
            for (lo1, hi1) in [(0, at1), (at1, shape.dim(axis1))] {
                tiles.push(full.with_axis(axis0, lo0, hi0).with_axis(axis1, lo1, hi1));
            }
        }
        tiles
    }

    #[test]
    fn n_by_h_tiles_match_whole_tensor() {
        let shape = Shape::nchw(4, 3, 6, 5);
        let tiles = grid(shape, (0, 1), (2, 4));
        check_tiles_match_whole(shape, &tiles, false, Views::Whole);
        check_tiles_match_whole(shape, &tiles, true, Views::Exact);
    }

    #[test]
    fn c_by_w_tiles_match_whole_tensor() {
        let shape = Shape::nchw(3, 5, 4, 6);
        let tiles = grid(shape, (1, 2), (3, 1));
        check_tiles_match_whole(shape, &tiles, false, Views::Exact);
        check_tiles_match_whole(shape, &tiles, true, Views::Whole);
    }

    #[test]
    fn nc_tiles_match_whole_tensor() {
        let shape = Shape::nc(10, 7);
        let tiles = grid(shape, (0, 3), (1, 4));
        check_tiles_match_whole(shape, &tiles, true, Views::Exact);
        check_tiles_match_whole(shape, &tiles, false, Views::Whole);
    }

    #[test]
    fn large_tiles_match_whole_tensor() {
        // Big enough for the parallel paths of every phase.
        let shape = Shape::nchw(8, 6, 40, 36);
        let tiles = grid(shape, (0, 3), (2, 17));
        check_tiles_match_whole(shape, &tiles, true, Views::Exact);
    }

    #[test]
    #[should_panic(expected = "reduce every tile of the channel group first")]
    fn unreduced_gradient_sums_are_rejected() {
        let shape = Shape::nc(4, 2);
        let full = shape.full_rect();
        let x = random(8, 9);
        let p = params(2, 10);
        let (_, stats) = forward(&op(false), shape, &x, &p);
        let half = Rect::new(&[0, 0], &[2, 2]);
        let sums = partial_grad_sums(
            View::new(full, &x),
            None,
            View::new(full, &x),
            &stats,
            &half,
        );
        let mut dx = vec![0.0; 4];
        input_grad(
            View::new(full, &x),
            None,
            View::new(full, &x),
            &stats,
            channel_view(&p.gamma),
            &sums,
            ViewMut::new(half, &mut dx),
        );
    }
}
