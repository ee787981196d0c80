//! Test helpers for kernels: finite-difference gradient checks and random tensors.

use crate::rng::Rng;
use crate::shape::{Rect, copy_rect};

pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.uniform(-1.0, 1.0)).collect()
}

/// Checks `analytic` (∂loss/∂x) against central differences of `loss` at up to `samples` positions of
/// `x` spread over the buffer. `loss` must be a smooth function of `x` near the point (keep inputs away
/// from ReLU kinks and max-pool ties). Panics with the worst position on failure.
pub fn assert_grad(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    samples: usize,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{what}: gradient length");
    let eps = 1e-2f32;
    let mut probe = x.to_vec();
    let step = (x.len() / samples.max(1)).max(1);
    let scale = analytic.iter().fold(0f32, |m, g| m.max(g.abs())).max(1e-3);
    for i in (0..x.len()).step_by(step) {
        let orig = probe[i];
        probe[i] = orig + eps;
        let up = loss(&probe);
        probe[i] = orig - eps;
        let down = loss(&probe);
        probe[i] = orig;
        let numeric = ((up - down) / (2.0 * eps as f64)) as f32;
        let err = (numeric - analytic[i]).abs();
        assert!(
            err <= 2e-2 * scale + 1e-3 * numeric.abs().max(analytic[i].abs()),
            "{what}: gradient at {i}: analytic {} vs numeric {numeric} (scale {scale})",
            analytic[i]
        );
    }
}

/// Largest relative difference between two buffers, relative to the larger magnitude of `b`.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// Splits `[lo, hi)` of `axis` in two (the second half empty for extent 1).
pub fn halves(rect: &Rect, axis: usize) -> [Rect; 2] {
    let mid = rect.lo[axis] + rect.extent(axis) / 2;
    [
        rect.with_axis(axis, rect.lo[axis], mid),
        rect.with_axis(axis, mid, rect.hi[axis]),
    ]
}

/// The part of `data` (laid out over `from`) inside `region`, as its own buffer.
pub fn cut(data: &[f32], from: &Rect, region: &Rect) -> Vec<f32> {
    let mut out = vec![0.0; region.volume()];
    copy_rect(data, from, &mut out, region, region);
    out
}
