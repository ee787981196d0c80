//! Inverted dropout over one tile.
//!
//! Whether an element is kept is a pure function of (seed, step, layer salt, the element's flat
//! row-major index in the FULL tensor), drawn with [`rng::hash`] and [`rng::unit_f32`]. Any partition
//! of the layer therefore drops exactly the elements the whole-tensor run drops, and backward
//! recomputes the mask instead of storing it.

use super::relu::{par_runs, run_of};
use super::{View, ViewMut};
use crate::rng::{self, mix64};
use crate::shape::Shape;

/// The dropout mask of one layer at one training step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    /// Probability of dropping an element, in [0, 1).
    pub rate: f32,
    /// The run's seed.
    pub seed: u64,
    /// Training step: a fresh mask every step.
    pub step: u64,
    /// Distinguishes the layers (e.g. the layer's index in the graph).
    pub layer_salt: u64,
    /// Shape of the full tensor, which defines the element indices the mask is drawn over.
    pub shape: Shape,
}

impl DropoutMask {
    /// Whether the element at flat `index` of the full tensor is kept:
    /// `unit_f32(hash([seed, step, layer_salt, index])) >= rate`, so it is kept with probability
    /// `1 - rate`.
    pub fn keeps(&self, index: u64) -> bool {
        self.keeps_with(self.key(), index)
    }

    /// Factor applied to kept elements so the expected output equals the input.
    pub fn keep_scale(&self) -> f32 {
        1.0 / (1.0 - self.rate)
    }

    /// `hash` folds its words left to right, so hashing the three per-step words once and mixing in
    /// each index gives exactly `hash(&[seed, step, layer_salt, index])` at a quarter of the cost.
    fn key(&self) -> u64 {
        rng::hash(&[self.seed, self.step, self.layer_salt])
    }

    fn keeps_with(&self, key: u64, index: u64) -> bool {
        rng::unit_f32(mix64(key ^ index)) >= self.rate
    }
}

/// y = x · mask / (1 − rate) over the tile `y.rect`.
pub fn dropout_forward(mask: &DropoutMask, x: View<'_>, y: ViewMut<'_>) {
    apply_mask(mask, x, y);
}

/// dx = dy · mask / (1 − rate) over the tile `dx.rect`, recomputing the forward's mask.
pub fn dropout_backward(mask: &DropoutMask, dy: View<'_>, dx: ViewMut<'_>) {
    apply_mask(mask, dy, dx);
}

fn apply_mask(mask: &DropoutMask, input: View<'_>, mut out: ViewMut<'_>) {
    assert!(
        (0.0..1.0).contains(&mask.rate),
        "dropout rate {} must be in [0, 1)",
        mask.rate
    );
    let full = mask.shape.full_rect();
    assert!(
        full.contains(&out.rect),
        "tile {} lies outside the tensor {}",
        out.rect,
        mask.shape
    );
    let key = mask.key();
    let scale = mask.keep_scale();
    // Runs must be contiguous in the full tensor too, so that global indices are consecutive.
    par_runs(&mut out, &[input.rect, full], 0, |start, piece| {
        let src = run_of(&input, &start, piece.len());
        let first = full.offset_of(&start) as u64;
        for ((o, &v), index) in piece.iter_mut().zip(src).zip(first..) {
            *o = if mask.keeps_with(key, index) {
                v * scale
            } else {
                0.0
            };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, random};
    use crate::shape::{Rect, copy_rect};

    fn mask(shape: Shape) -> DropoutMask {
        DropoutMask {
            rate: 0.3,
            seed: 42,
            step: 7,
            layer_salt: 3,
            shape,
        }
    }

    /// The kept/dropped pattern of `rect` as 1/0, from running forward on ones.
    fn pattern(mask: &DropoutMask, rect: Rect) -> Vec<f32> {
        let ones = vec![1.0; rect.volume()];
        let mut y = vec![0.0; rect.volume()];
        dropout_forward(mask, View::new(rect, &ones), ViewMut::new(rect, &mut y));
        y.iter().map(|&v| if v > 0.0 { 1.0 } else { 0.0 }).collect()
    }

    #[test]
    fn keeps_is_the_documented_hash() {
        let m = mask(Shape::nc(4, 4));
        for index in 0..1000 {
            let u = rng::unit_f32(rng::hash(&[m.seed, m.step, m.layer_salt, index]));
            assert_eq!(m.keeps(index), u >= m.rate);
        }
    }

    #[test]
    fn forward_scales_kept_elements_and_zeroes_the_rest() {
        let shape = Shape::nc(5, 7);
        let m = mask(shape);
        let rect = shape.full_rect();
        let x = random(rect.volume(), 1);
        let mut y = vec![0.0; x.len()];
        dropout_forward(&m, View::new(rect, &x), ViewMut::new(rect, &mut y));
        for (i, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
            let expected = if m.keeps(i as u64) { xv / 0.7 } else { 0.0 };
            assert!(
                (yv - expected).abs() <= 1e-6,
                "element {i}: {yv} vs {expected}"
            );
        }
    }

    #[test]
    fn kept_fraction_is_one_minus_rate() {
        let shape = Shape::nchw(4, 8, 50, 64);
        let m = mask(shape);
        let kept: f32 = pattern(&m, shape.full_rect()).iter().sum();
        let fraction = kept / shape.numel() as f32;
        assert!((fraction - 0.7).abs() < 0.01, "kept fraction {fraction}");
    }

    #[test]
    fn tile_masks_are_slices_of_the_whole_mask() {
        let shape = Shape::nchw(3, 4, 9, 10);
        let m = mask(shape);
        let full = shape.full_rect();
        let whole = pattern(&m, full);
        let tiles = [
            Rect::new(&[0, 0, 0, 0], &[2, 4, 5, 10]),
            Rect::new(&[2, 1, 3, 4], &[3, 3, 9, 7]),
            Rect::new(&[1, 2, 0, 0], &[3, 4, 9, 10]),
        ];
        for tile in tiles {
            let mut expected = vec![0.0; tile.volume()];
            copy_rect(&whole, &full, &mut expected, &tile, &tile);
            assert_eq!(pattern(&m, tile), expected, "tile {tile}");
        }
        // A tile read from a larger input view draws the same mask too.
        let tile = tiles[1];
        let ones = vec![1.0; full.volume()];
        let mut y = vec![0.0; tile.volume()];
        dropout_forward(&m, View::new(full, &ones), ViewMut::new(tile, &mut y));
        let mut expected = vec![0.0; tile.volume()];
        copy_rect(&whole, &full, &mut expected, &tile, &tile);
        let kept: Vec<f32> = y.iter().map(|&v| (v > 0.0) as u8 as f32).collect();
        assert_eq!(kept, expected);
    }

    #[test]
    fn masks_differ_across_steps_salts_and_seeds() {
        let shape = Shape::nc(16, 64);
        let base = mask(shape);
        let whole = pattern(&base, shape.full_rect());
        let variants = [
            DropoutMask { step: 8, ..base },
            DropoutMask {
                layer_salt: 4,
                ..base
            },
            DropoutMask { seed: 43, ..base },
        ];
        for other in variants {
            let differing = pattern(&other, shape.full_rect())
                .iter()
                .zip(&whole)
                .filter(|(a, b)| a != b)
                .count();
            // Independent masks disagree on 2·0.3·0.7 = 42% of elements.
            assert!(differing > shape.numel() / 4, "{other:?}: {differing}");
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let shape = Shape::nchw(2, 3, 4, 5);
        let m = mask(shape);
        let rect = shape.full_rect();
        let x = random(rect.volume(), 2);
        let weights = random(rect.volume(), 3);
        let mut dx = vec![0.0; x.len()];
        dropout_backward(&m, View::new(rect, &weights), ViewMut::new(rect, &mut dx));
        assert_grad("dropout dx", &x, &dx, 120, |x| {
            let mut y = vec![0.0; x.len()];
            dropout_forward(&m, View::new(rect, x), ViewMut::new(rect, &mut y));
            y.iter().zip(&weights).map(|(&y, &w)| (y * w) as f64).sum()
        });
    }

    #[test]
    fn rate_zero_is_the_identity() {
        let shape = Shape::nc(3, 5);
        let m = DropoutMask {
            rate: 0.0,
            ..mask(shape)
        };
        let rect = shape.full_rect();
        let x = random(rect.volume(), 4);
        let mut y = vec![0.0; x.len()];
        dropout_forward(&m, View::new(rect, &x), ViewMut::new(rect, &mut y));
        assert_eq!(y, x);
    }
}
