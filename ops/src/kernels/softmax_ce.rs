//! Softmax cross-entropy over a tile of samples.
//!
//! The tile is rows `n0..n1` of the `(N, K)` logits with all `K` classes (the op only splits along
//! N). `labels` holds the labels of exactly those rows: `labels[i]` belongs to row `n0 + i` (a
//! whole-batch caller passes the full label vector, a tile caller `&labels[n0..n1]`). Every row is
//! computed independently, so any split along N gives bit-identical results.
//!
//! The training loss is the mean over the GLOBAL batch: forward writes per-sample losses, and
//! backward differentiates `scale · Σ loss` with `scale = 1 / N_global`, whichever tile it runs on.

use super::{View, ViewMut};
use crate::shape::Rect;
use rayon::prelude::*;
use thiserror::Error;

/// Rows per parallel task: enough work to amortise scheduling even for few classes.
const MIN_ROWS_PER_TASK: usize = 64;

/// A label that names no class. Reported before anything is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("label {label} of sample {sample} is out of range for {classes} classes")]
pub struct LabelOutOfRange {
    /// Global row of the sample.
    pub sample: usize,
    pub label: u32,
    pub classes: usize,
}

/// Per-sample loss `logsumexp(z) − z[label]` into the `(n0..n1, 0..1)` tile `loss`, computed stably
/// (shifted by the row maximum). Returns the sum of the tile's losses, for logging.
pub fn softmax_ce_forward(
    logits: View<'_>,
    labels: &[u32],
    loss: ViewMut<'_>,
) -> Result<f64, LabelOutOfRange> {
    let rows = loss.rect;
    let classes = check_tile(&logits, labels, &rows, 1)?;
    loss.data
        .par_iter_mut()
        .zip(labels)
        .zip(rows.lo[0]..rows.hi[0])
        .with_min_len(MIN_ROWS_PER_TASK)
        .for_each(|((out, &label), n)| {
            let z = row(&logits, n, classes);
            let (max, sum_exp) = shifted_exp_sum(z);
            *out = ((max as f64 + sum_exp.ln()) - z[label as usize] as f64) as f32;
        });
    Ok(loss.data.iter().map(|&l| l as f64).sum())
}

/// dlogits = (softmax(z) − onehot(label)) · scale over the `(n0..n1, 0..K)` tile `dlogits`, with
/// `scale = 1 / N_global` so that the global mean loss is what is differentiated.
pub fn softmax_ce_backward(
    logits: View<'_>,
    labels: &[u32],
    scale: f32,
    dlogits: ViewMut<'_>,
) -> Result<(), LabelOutOfRange> {
    let tile = dlogits.rect;
    let classes = check_tile(&logits, labels, &tile, tile.extent(1))?;
    dlogits
        .data
        .par_chunks_mut(classes)
        .zip(labels)
        .zip(tile.lo[0]..tile.hi[0])
        .with_min_len(MIN_ROWS_PER_TASK)
        .for_each(|((out, &label), n)| {
            let z = row(&logits, n, classes);
            let (max, sum_exp) = shifted_exp_sum(z);
            let norm = (scale as f64 / sum_exp) as f32;
            for (o, &v) in out.iter_mut().zip(z) {
                *o = (v - max).exp() * norm;
            }
            out[label as usize] -= scale;
        });
    Ok(())
}

/// Samples of rows `rows` (the loss tile's) whose largest logit is at the label; the first maximum
/// wins ties. `labels` are the tile's, as for the other functions here; the logits view may hold
/// more rows than the tile.
pub fn count_correct(logits: View<'_>, labels: &[u32], rows: &Rect) -> usize {
    let classes = logits.rect.extent(1);
    (rows.lo[0]..rows.hi[0])
        .zip(labels)
        .filter(|&(n, &label)| {
            let best = row(&logits, n, classes).iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
            best.0 == label as usize
        })
        .count()
}

/// Checks the shapes of a call and its labels; returns the number of classes.
fn check_tile(
    logits: &View<'_>,
    labels: &[u32],
    out: &Rect,
    out_columns: usize,
) -> Result<usize, LabelOutOfRange> {
    assert_eq!(logits.rect.ndim(), 2, "logits must be (N, classes)");
    assert_eq!(out.ndim(), 2, "output tile {out} must be 2-d");
    assert_eq!(
        logits.rect.lo[1], 0,
        "logits view {} must hold all classes",
        logits.rect
    );
    let classes = logits.rect.hi[1];
    assert!(
        out.lo[1] == 0 && out.hi[1] == out_columns,
        "output tile {out} has the wrong columns"
    );
    assert!(
        out.lo[0] >= logits.rect.lo[0] && out.hi[0] <= logits.rect.hi[0],
        "logits view {} does not contain the rows of {out}",
        logits.rect
    );
    assert_eq!(
        labels.len(),
        out.extent(0),
        "one label per row of the tile {out} expected"
    );
    if out_columns != 1 {
        assert_eq!(
            out_columns, classes,
            "gradient tile {out} must span all classes"
        );
    }
    match labels.iter().position(|&l| l as usize >= classes) {
        Some(i) => Err(LabelOutOfRange {
            sample: out.lo[0] + i,
            label: labels[i],
            classes,
        }),
        None => Ok(classes),
    }
}

fn row<'a>(logits: &View<'a>, n: usize, classes: usize) -> &'a [f32] {
    let start = (n - logits.rect.lo[0]) * classes;
    &logits.data[start..start + classes]
}

/// The row maximum and `Σ exp(z − max)` (accumulated in f64; at least 1, so its log is safe).
fn shifted_exp_sum(z: &[f32]) -> (f32, f64) {
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum = z.iter().map(|&v| (v - max).exp() as f64).sum();
    (max, sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, max_rel_diff, random};
    use crate::shape::Shape;

    fn labels(n: usize, classes: u32) -> Vec<u32> {
        (0..n as u32).map(|i| (i * 7 + 3) % classes).collect()
    }

    fn mean_loss(logits: &[f32], rect: Rect, labels: &[u32]) -> f64 {
        let mut loss = vec![0.0; rect.extent(0)];
        let loss_rect = Rect::new(&[0, 0], &[rect.extent(0), 1]);
        let sum = softmax_ce_forward(
            View::new(rect, logits),
            labels,
            ViewMut::new(loss_rect, &mut loss),
        )
        .unwrap();
        sum / rect.extent(0) as f64
    }

    #[test]
    fn forward_matches_the_definition() {
        let rect = Shape::nc(3, 4).full_rect();
        let z = random(12, 1);
        let y = labels(3, 4);
        let mut loss = vec![0.0; 3];
        let loss_rect = Rect::new(&[0, 0], &[3, 1]);
        softmax_ce_forward(View::new(rect, &z), &y, ViewMut::new(loss_rect, &mut loss)).unwrap();
        for n in 0..3 {
            let row = &z[n * 4..n * 4 + 4];
            let total: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
            let expected = -((row[y[n] as usize] as f64).exp() / total).ln();
            assert!((loss[n] as f64 - expected).abs() < 1e-6, "{n}");
        }
    }

    #[test]
    fn large_logits_stay_finite() {
        let rect = Shape::nc(2, 3).full_rect();
        let z = [1000.0, -1000.0, 999.0, -5000.0, 4000.0, 3999.0];
        let y = [1, 2];
        let mut loss = vec![0.0; 2];
        let loss_rect = Rect::new(&[0, 0], &[2, 1]);
        softmax_ce_forward(View::new(rect, &z), &y, ViewMut::new(loss_rect, &mut loss)).unwrap();
        // In both rows logsumexp = max + ln(1 + e⁻¹): the third term underflows to nothing.
        let tail = (1.0 + (-1.0f32).exp()).ln();
        assert!((loss[0] - 2000.0 - tail).abs() < 1e-2, "{}", loss[0]);
        assert!((loss[1] - 1.0 - tail).abs() < 1e-5, "{}", loss[1]);
        let mut d = vec![0.0; 6];
        softmax_ce_backward(View::new(rect, &z), &y, 0.5, ViewMut::new(rect, &mut d)).unwrap();
        assert!(d.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (n, k) = (5, 7);
        let rect = Shape::nc(n, k).full_rect();
        let z: Vec<f32> = random(n * k, 2).iter().map(|v| 3.0 * v).collect();
        let y = labels(n, k as u32);
        let mut d = vec![0.0; n * k];
        let scale = 1.0 / n as f32;
        softmax_ce_backward(View::new(rect, &z), &y, scale, ViewMut::new(rect, &mut d)).unwrap();
        // Each row's gradient sums to zero: softmax sums to one, minus the one-hot.
        for r in d.chunks(k) {
            assert!(r.iter().sum::<f32>().abs() < 1e-6);
        }
        assert_grad("softmax_ce dlogits", &z, &d, n * k, |z| {
            mean_loss(z, rect, &y)
        });
    }

    #[test]
    fn correct_counts_pair_labels_with_the_tiles_rows_in_a_larger_view() {
        let (n, k) = (6, 4);
        let full = Shape::nc(n, k).full_rect();
        // Row r's largest logit is class r % k.
        let z: Vec<f32> = (0..n * k)
            .map(|i| if i % k == (i / k) % k { 1.0 } else { 0.0 })
            .collect();
        let tile = full.with_axis(0, 2, 5);
        let right: Vec<u32> = (2..5).map(|r| (r % k) as u32).collect();
        assert_eq!(count_correct(View::new(full, &z), &right, &tile), 3);
        let wrong: Vec<u32> = (0..3).map(|r| (r % k) as u32).collect();
        assert_eq!(count_correct(View::new(full, &z), &wrong, &tile), 0);
    }

    #[test]
    fn row_tiles_match_whole_batch() {
        let (n, k) = (200, 10);
        let full = Shape::nc(n, k).full_rect();
        let z = random(n * k, 3);
        let y = labels(n, k as u32);
        let scale = 1.0 / n as f32;
        let mut loss_whole = vec![0.0; n];
        let whole_sum = softmax_ce_forward(
            View::new(full, &z),
            &y,
            ViewMut::new(Rect::new(&[0, 0], &[n, 1]), &mut loss_whole),
        )
        .unwrap();
        let mut d_whole = vec![0.0; n * k];
        softmax_ce_backward(
            View::new(full, &z),
            &y,
            scale,
            ViewMut::new(full, &mut d_whole),
        )
        .unwrap();

        let mut tiled_sum = 0.0;
        for (n0, n1) in [(0, 70), (70, 130), (130, 200)] {
            let loss_rect = Rect::new(&[n0, 0], &[n1, 1]);
            let mut loss = vec![0.0; n1 - n0];
            // The forward reads the whole logits view, the backward exactly its rows.
            tiled_sum += softmax_ce_forward(
                View::new(full, &z),
                &y[n0..n1],
                ViewMut::new(loss_rect, &mut loss),
            )
            .unwrap();
            assert_eq!(loss, loss_whole[n0..n1]);
            let tile = Rect::new(&[n0, 0], &[n1, k]);
            let mut d = vec![0.0; tile.volume()];
            softmax_ce_backward(
                View::new(tile, &z[n0 * k..n1 * k]),
                &y[n0..n1],
                scale,
                ViewMut::new(tile, &mut d),
            )
            .unwrap();
            assert_eq!(d, d_whole[n0 * k..n1 * k]);
        }
        assert!(max_rel_diff(&[tiled_sum as f32], &[whole_sum as f32]) < 1e-6);
    }

    #[test]
    fn out_of_range_label_is_an_error() {
        let rect = Shape::nc(3, 4).full_rect();
        let z = random(12, 4);
        let mut loss = vec![7.0; 2];
        let loss_rect = Rect::new(&[1, 0], &[3, 1]);
        let err = softmax_ce_forward(
            View::new(rect, &z),
            &[0, 4],
            ViewMut::new(loss_rect, &mut loss),
        )
        .unwrap_err();
        assert_eq!(
            err,
            LabelOutOfRange {
                sample: 2,
                label: 4,
                classes: 4
            }
        );
        assert_eq!(loss, [7.0, 7.0], "nothing is written on error");
        assert!(err.to_string().contains("label 4 of sample 2"));
    }
}
