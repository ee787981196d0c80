//! A seeded, learnable synthetic image classification task.
//!
//! Each (class, channel) has a fixed smooth template: a sum of a few plane waves with random low spatial
//! frequencies, phases and amplitudes. A sample is its class's template, shifted by a random fraction of
//! the image and scaled by a random contrast, plus pixel noise. Low frequencies make the task easy for a
//! small CNN (the loss drops within tens of SGD steps) while the shift, contrast and noise keep it from
//! being a lookup table. Templates are defined in image-relative coordinates, so the task looks the same
//! at any requested resolution.

use super::{DataError, Dataset, ImageShape, check_image_shape, check_sample_args};
use crate::rng::{Rng, hash};
use rayon::prelude::*;
use std::f32::consts::TAU;

const WAVES_PER_CHANNEL: usize = 3;
/// Highest spatial frequency of a template wave, in cycles per image.
const MAX_CYCLES: f32 = 2.0;
/// Largest shift of a sample's template, as a fraction of the image extent.
const MAX_SHIFT: f32 = 0.2;
const CONTRAST_RANGE: (f32, f32) = (0.75, 1.25);
/// Pixel noise relative to the template's unit standard deviation.
const NOISE_STD: f32 = 1.0;

/// Keys that separate the random streams drawn from one seed.
const TEMPLATE_STREAM: u64 = 0x7465_6d70_6c61_7465;
const SAMPLE_STREAM: u64 = 0x7361_6d70_6c65_7321;

/// `amplitude · cos(2π (cycles_x · u + cycles_y · v) + phase)` over image coordinates `u, v ∈ [0, 1)`.
#[derive(Clone, Copy, Debug)]
struct Wave {
    omega_x: f32,
    omega_y: f32,
    phase: f32,
    amplitude: f32,
}

/// See the module documentation. Sample `i` is a pure function of `(seed, i)` (and the image shape).
#[derive(Clone, Debug)]
pub struct Synthetic {
    seed: u64,
    num_samples: usize,
    classes: usize,
    image: ImageShape,
    /// `WAVES_PER_CHANNEL` waves per channel per class, class-major.
    waves: Vec<Wave>,
}

impl Synthetic {
    pub fn new(
        seed: u64,
        num_samples: usize,
        classes: usize,
        image: ImageShape,
    ) -> Result<Synthetic, DataError> {
        check_image_shape(image)?;
        if num_samples == 0 || classes == 0 {
            return Err(DataError::Config(format!(
                "synthetic data needs at least one sample and one class, got {num_samples} samples \
                 and {classes} classes"
            )));
        }
        let channels = image[0];
        let mut waves = Vec::with_capacity(classes * channels * WAVES_PER_CHANNEL);
        for class in 0..classes {
            for channel in 0..channels {
                // Keyed per (class, channel) so a template does not change with the number of classes.
                let mut rng =
                    Rng::new(hash(&[seed, TEMPLATE_STREAM, class as u64, channel as u64]));
                let first = waves.len();
                for _ in 0..WAVES_PER_CHANNEL {
                    waves.push(Wave {
                        omega_x: TAU * rng.uniform(-MAX_CYCLES, MAX_CYCLES),
                        omega_y: TAU * rng.uniform(-MAX_CYCLES, MAX_CYCLES),
                        phase: rng.uniform(0.0, TAU),
                        amplitude: rng.uniform(0.5, 1.0),
                    });
                }
                // A wave of amplitude a has variance a²/2: scale the sum to unit variance.
                let variance: f32 = waves[first..]
                    .iter()
                    .map(|w| w.amplitude * w.amplitude / 2.0)
                    .sum();
                let scale = variance.sqrt().recip();
                for w in &mut waves[first..] {
                    w.amplitude *= scale;
                }
            }
        }
        Ok(Synthetic {
            seed,
            num_samples,
            classes,
            image,
            waves,
        })
    }

    /// The samples at `indices`, described for a device to draw ([`SyntheticBatch`]): what the
    /// host computes per sample is its label, its noise stream's state and the factors of its
    /// waves, about 1/40 of the values of its image at 224 × 224.
    pub fn describe_batch(&self, indices: &[usize]) -> Result<SyntheticBatch, DataError> {
        let per_sample = factors_per_sample(self.image);
        let values = indices
            .len()
            .checked_mul(per_sample)
            .ok_or_else(|| DataError::Config("a synthetic batch too large to describe".into()))?;
        let mut factors = vec![0.0f32; values];
        let mut labels = vec![0u32; indices.len()];
        let mut noise_states = vec![0u64; indices.len()];
        for &index in indices {
            if index >= self.num_samples {
                return Err(DataError::IndexOutOfRange {
                    index,
                    len: self.num_samples,
                });
            }
        }
        factors
            .par_chunks_mut(per_sample)
            .zip(labels.par_iter_mut())
            .zip(noise_states.par_iter_mut())
            .zip(indices.par_iter())
            .for_each(|(((factors, label), state), &index)| {
                (*label, *state) = self.draw_factors(index, factors);
            });
        Ok(SyntheticBatch {
            image: self.image,
            labels,
            noise_states,
            factors,
        })
    }

    /// Sample `index`'s label, and into `factors` its waves' factors (see [`SyntheticBatch`]);
    /// returns the label and the state of the generator its pixel noise is drawn from.
    fn draw_factors(&self, index: usize, factors: &mut [f32]) -> (u32, u64) {
        let [channels, height, width] = self.image;
        let mut rng = self.sample_rng(index);
        let label = rng.below(self.classes);
        let shift_x = rng.uniform(-MAX_SHIFT, MAX_SHIFT);
        let shift_y = rng.uniform(-MAX_SHIFT, MAX_SHIFT);
        let contrast = rng.uniform(CONTRAST_RANGE.0, CONTRAST_RANGE.1);
        // cos(a + b) = cos a · cos b − sin a · sin b separates each wave into a per-column and a
        // per-row factor, so trigonometry is evaluated per row and column instead of per pixel.
        let per_wave = 2 * (width + height);
        let mut waves = factors.chunks_exact_mut(per_wave);
        for channel in 0..channels {
            for wave in self.class_channel_waves(label, channel) {
                let wave_factors = waves.next().expect("factors sized for every wave");
                let (columns, rows) = wave_factors.split_at_mut(2 * width);
                let (column_cos, column_sin) = columns.split_at_mut(width);
                for (x, (c, s)) in column_cos.iter_mut().zip(column_sin).enumerate() {
                    let u = (x as f32 + 0.5) / width as f32 + shift_x;
                    (*s, *c) = (wave.omega_x * u).sin_cos();
                }
                let amplitude = wave.amplitude * contrast * gain();
                let (row_a, row_b) = rows.split_at_mut(height);
                for (y, (a, b)) in row_a.iter_mut().zip(row_b).enumerate() {
                    let v = (y as f32 + 0.5) / height as f32 + shift_y;
                    let (row_sin, row_cos) = (wave.omega_y * v + wave.phase).sin_cos();
                    (*a, *b) = (amplitude * row_cos, amplitude * row_sin);
                }
            }
        }
        (label as u32, rng.state())
    }

    /// The generator sample `index` is drawn from, its label first.
    fn sample_rng(&self, index: usize) -> Rng {
        Rng::new(hash(&[self.seed, SAMPLE_STREAM, index as u64]))
    }

    fn label_of(&self, index: usize) -> u32 {
        self.sample_rng(index).below(self.classes) as u32
    }

    fn class_channel_waves(&self, class: usize, channel: usize) -> &[Wave] {
        let start = (class * self.image[0] + channel) * WAVES_PER_CHANNEL;
        &self.waves[start..start + WAVES_PER_CHANNEL]
    }
}

impl Dataset for Synthetic {
    fn num_samples(&self) -> usize {
        self.num_samples
    }

    fn image_shape(&self) -> ImageShape {
        self.image
    }

    fn num_classes(&self) -> usize {
        self.classes
    }

    fn sample(&self, index: usize, _epoch: u64, out: &mut [f32]) -> Result<u32, DataError> {
        check_sample_args(self, index, out.len())?;
        let mut factors = vec![0.0f32; factors_per_sample(self.image)];
        let (label, noise_state) = self.draw_factors(index, &mut factors);
        render_sample(self.image, &factors, noise_state, out);
        Ok(label)
    }

    fn as_synthetic(&self) -> Option<&Synthetic> {
        Some(self)
    }

    fn label(&self, index: usize) -> Option<u32> {
        (index < self.num_samples).then(|| self.label_of(index))
    }

    fn describe(&self) -> String {
        format!(
            "synthetic seed {} ({} samples, {} classes)",
            self.seed, self.num_samples, self.classes
        )
    }
}

/// Scales template plus noise back to roughly unit variance.
fn gain() -> f32 {
    (1.0 + NOISE_STD * NOISE_STD).sqrt().recip()
}

/// Values of [`SyntheticBatch::factors`] per sample of shape `image`: per channel and wave, a
/// `cos` and a `sin` per column and an `a` and a `b` per row.
pub fn factors_per_sample(image: ImageShape) -> usize {
    let [channels, height, width] = image;
    channels * WAVES_PER_CHANNEL * 2 * (width + height)
}

/// A batch of [`Synthetic`] samples described instead of drawn, so that a device can draw the
/// images itself (legion-cuda's `synthetic_draw` kernel) and the host neither computes nor copies
/// them: every value is bit-identical to [`Dataset::sample`]'s, whose arithmetic
/// [`SyntheticBatch::render`] is.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticBatch {
    pub image: ImageShape,
    pub labels: Vec<u32>,
    /// Per sample, the state of the generator (`Rng::at_state`) whose words, one per pixel in
    /// CHW order, are the pixels' noise.
    pub noise_states: Vec<u64>,
    /// Per sample, channel and wave ([`SyntheticBatch::WAVES_PER_CHANNEL`] per channel): the
    /// wave's `cos` then `sin` per column (`W` each), then its `a` and `b` per row (`H` each).
    /// Pixel (y, x) is the sum, in wave order from zero, of `a[y]·cos[x] − b[y]·sin[x]`, plus
    /// [`SyntheticBatch::noise_scale`] times its noise word's approximate normal value.
    pub factors: Vec<f32>,
}

impl SyntheticBatch {
    pub const WAVES_PER_CHANNEL: usize = WAVES_PER_CHANNEL;

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values of one sample's image: `C·H·W`.
    pub fn sample_len(&self) -> usize {
        self.image.iter().product()
    }

    /// Checks that the batch describes each of its samples: a noise state per label and the
    /// factors of each sample's shape.
    pub fn check(&self) -> Result<(), DataError> {
        check_image_shape(self.image)?;
        let per_sample = factors_per_sample(self.image);
        let factors = self.len().checked_mul(per_sample);
        let images = self.len().checked_mul(self.sample_len());
        if self.noise_states.len() != self.len()
            || factors != Some(self.factors.len())
            || images.is_none_or(|n| i64::try_from(n).is_err())
        {
            return Err(DataError::Config(format!(
                "a synthetic batch of {} samples of shape {:?} needs {} noise states and {} \
                 factors, got {} and {}",
                self.len(),
                self.image,
                self.len(),
                factors.map_or("too many".to_string(), |n| n.to_string()),
                self.noise_states.len(),
                self.factors.len()
            )));
        }
        Ok(())
    }

    /// The factor of each pixel's noise value.
    pub fn noise_scale() -> f32 {
        NOISE_STD * gain()
    }

    /// Draws the images on the host, NCHW, exactly as a device does: the reference of the
    /// device kernel, and the batch of a backend without one. `out` holds `len()·C·H·W` values.
    /// Panics on a batch that [`SyntheticBatch::check`] refuses.
    pub fn render(&self, out: &mut [f32]) {
        if let Err(e) = self.check() {
            panic!("{e}");
        }
        let sample_len = self.sample_len();
        assert_eq!(
            out.len(),
            self.len() * sample_len,
            "a synthetic batch renders into one image per sample"
        );
        let per_sample = factors_per_sample(self.image);
        out.par_chunks_mut(sample_len)
            .zip(self.factors.par_chunks(per_sample))
            .zip(self.noise_states.par_iter())
            .for_each(|((image, factors), &state)| {
                render_sample(self.image, factors, state, image)
            });
    }
}

/// Draws one sample's image from its factors and noise state (see [`SyntheticBatch`]).
fn render_sample(image: ImageShape, factors: &[f32], noise_state: u64, out: &mut [f32]) {
    let [_, height, width] = image;
    let per_wave = 2 * (width + height);
    let noise_scale = SyntheticBatch::noise_scale();
    let mut rng = Rng::at_state(noise_state);
    let planes = out.chunks_exact_mut(height * width);
    for (plane, channel) in planes.zip(factors.chunks_exact(WAVES_PER_CHANNEL * per_wave)) {
        plane.fill(0.0);
        for wave in channel.chunks_exact(per_wave) {
            let (column_cos, rest) = wave.split_at(width);
            let (column_sin, rows) = rest.split_at(width);
            let (row_a, row_b) = rows.split_at(height);
            for ((row, &a), &b) in plane.chunks_exact_mut(width).zip(row_a).zip(row_b) {
                for ((p, &c), &s) in row.iter_mut().zip(column_cos).zip(column_sin) {
                    *p += a * c - b * s;
                }
            }
        }
        for p in plane.iter_mut() {
            *p += noise_scale * approx_standard_normal(rng.next_u64());
        }
    }
}

/// An approximately standard normal value from one random word: the centred sum of its four 16-bit
/// quarters (Irwin–Hall, n = 4), which is close enough for pixel noise and much cheaper than Box–Muller.
fn approx_standard_normal(bits: u64) -> f32 {
    const QUARTER: f32 = 1.0 / 65536.0;
    let sum: f32 = (0..4)
        .map(|k| ((bits >> (16 * k)) & 0xffff) as f32 * QUARTER)
        .sum();
    // Each quarter is uniform on [0, 1): mean 1/2, variance 1/12.
    (sum - 2.0) * 3.0f32.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(ds: &Synthetic, index: usize) -> (Vec<f32>, u32) {
        let mut image = vec![0.0; ds.sample_len()];
        let label = ds.sample(index, 0, &mut image).unwrap();
        (image, label)
    }

    #[test]
    fn samples_are_pure_functions_of_seed_and_index() {
        let a = Synthetic::new(3, 100, 10, [3, 12, 12]).unwrap();
        let b = Synthetic::new(3, 100, 10, [3, 12, 12]).unwrap();
        let other_seed = Synthetic::new(4, 100, 10, [3, 12, 12]).unwrap();
        for i in [0, 1, 57, 99] {
            assert_eq!(draw(&a, i), draw(&b, i));
            assert_ne!(draw(&a, i).0, draw(&other_seed, i).0);
        }
        assert_ne!(draw(&a, 0).0, draw(&a, 1).0);
        // The same sample regardless of how many samples the dataset has.
        let longer = Synthetic::new(3, 1000, 10, [3, 12, 12]).unwrap();
        assert_eq!(draw(&a, 42), draw(&longer, 42));
    }

    #[test]
    fn samples_are_normalised_and_labels_cover_all_classes() {
        let ds = Synthetic::new(9, 400, 10, [3, 16, 16]).unwrap();
        let (mut sum, mut sum_sq, mut count) = (0.0f64, 0.0f64, 0usize);
        let mut seen = [0usize; 10];
        for i in 0..400 {
            let (image, label) = draw(&ds, i);
            seen[label as usize] += 1;
            for &v in &image {
                assert!(v.is_finite());
                sum += v as f64;
                sum_sq += (v * v) as f64;
            }
            count += image.len();
        }
        let mean = sum / count as f64;
        let std = (sum_sq / count as f64 - mean * mean).sqrt();
        assert!(mean.abs() < 0.15, "mean {mean}");
        assert!((0.7..1.3).contains(&std), "std {std}");
        assert!(seen.iter().all(|&n| n >= 20), "label counts {seen:?}");
    }

    /// What a device draws from a described batch is the dataset's samples, bit for bit.
    #[test]
    fn a_described_batch_renders_the_samples_bit_for_bit() {
        let ds = Synthetic::new(11, 50, 7, [3, 13, 9]).unwrap();
        let len = ds.sample_len();
        let indices = [4, 0, 49, 17, 4];
        let described = ds.describe_batch(&indices).unwrap();
        assert_eq!(described.factors.len(), 5 * factors_per_sample([3, 13, 9]));
        let mut rendered = vec![f32::NAN; indices.len() * len];
        described.render(&mut rendered);
        for (k, &i) in indices.iter().enumerate() {
            let (image, label) = draw(&ds, i);
            assert_eq!(described.labels[k], label);
            let same = image
                .iter()
                .zip(&rendered[k * len..][..len])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "sample {i} renders other values than it draws");
        }
        assert!(matches!(
            ds.describe_batch(&[3, 50]),
            Err(DataError::IndexOutOfRange { index: 50, len: 50 })
        ));
        assert!(described.check().is_ok());
        let mut short = described.clone();
        short.factors.pop();
        let e = short.check().unwrap_err().to_string();
        assert!(
            e.contains("needs 5 noise states and 1980 factors, got 5 and 1979"),
            "{e}"
        );
        let mut unstated = described;
        unstated.noise_states.pop();
        assert!(unstated.check().is_err());
    }

    #[test]
    fn arguments_are_checked() {
        let ds = Synthetic::new(0, 5, 2, [1, 4, 4]).unwrap();
        let mut small = vec![0.0; 15];
        assert!(matches!(
            ds.sample(0, 0, &mut small),
            Err(DataError::BufferSize { .. })
        ));
        let mut ok = vec![0.0; 16];
        assert!(matches!(
            ds.sample(5, 0, &mut ok),
            Err(DataError::IndexOutOfRange { .. })
        ));
        assert!(Synthetic::new(0, 0, 2, [1, 4, 4]).is_err());
        assert!(Synthetic::new(0, 5, 0, [1, 4, 4]).is_err());
    }

    #[test]
    fn noise_is_roughly_standard_normal() {
        let mut rng = Rng::new(1);
        let xs: Vec<f32> = (0..20_000)
            .map(|_| approx_standard_normal(rng.next_u64()))
            .collect();
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / xs.len() as f32;
        assert!(mean.abs() < 0.03, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }

    /// Nearest class mean, estimated from one set of samples and scored on another: far above the 10%
    /// of chance, so the classes are separable by a simple function of the pixels.
    #[test]
    fn nearest_class_mean_classifies_well_above_chance() {
        let classes = 10;
        let ds = Synthetic::new(21, 1000, classes, [3, 16, 16]).unwrap();
        let len = ds.sample_len();
        let mut means = vec![0.0f32; classes * len];
        let mut counts = vec![0usize; classes];
        for i in 0..500 {
            let (image, label) = draw(&ds, i);
            counts[label as usize] += 1;
            for (m, v) in means[label as usize * len..][..len].iter_mut().zip(&image) {
                *m += v;
            }
        }
        for (mean, &n) in means.chunks_exact_mut(len).zip(&counts) {
            mean.iter_mut().for_each(|m| *m /= n.max(1) as f32);
        }
        let correct = (500..1000)
            .filter(|&i| {
                let (image, label) = draw(&ds, i);
                let distance = |mean: &[f32]| -> f32 {
                    mean.iter()
                        .zip(&image)
                        .map(|(m, v)| (m - v) * (m - v))
                        .sum()
                };
                let nearest = (0..classes)
                    .min_by(|&a, &b| {
                        distance(&means[a * len..][..len])
                            .total_cmp(&distance(&means[b * len..][..len]))
                    })
                    .unwrap();
                nearest == label as usize
            })
            .count();
        assert!(correct > 300, "nearest-mean accuracy {correct}/500");
    }

    /// Softmax regression trained by plain SGD for 60 steps of batch 16 (the scale the brief asks a
    /// small CNN to show progress at): the loss must fall well below its initial ln(10).
    #[test]
    fn loss_of_a_linear_classifier_drops_within_sixty_steps() {
        let classes = 10;
        let ds = Synthetic::new(5, 4096, classes, [3, 16, 16]).unwrap();
        let len = ds.sample_len();
        let mut weights = vec![0.0f32; classes * len];
        let mut bias = vec![0.0f32; classes];
        let (batch, steps, lr) = (16, 60, 0.02f32);
        let mut image = vec![0.0f32; len];
        let mut logits = vec![0.0f32; classes];
        let mut losses = Vec::with_capacity(steps);
        for step in 0..steps {
            let mut grad_w = vec![0.0f32; classes * len];
            let mut grad_b = vec![0.0f32; classes];
            let mut loss = 0.0f32;
            for k in 0..batch {
                let label = ds.sample(step * batch + k, 0, &mut image).unwrap() as usize;
                for (c, logit) in logits.iter_mut().enumerate() {
                    let w = &weights[c * len..][..len];
                    *logit = bias[c] + w.iter().zip(&image).map(|(a, b)| a * b).sum::<f32>();
                }
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = logits.iter().map(|l| (l - max).exp()).sum();
                loss += z.ln() + max - logits[label];
                for c in 0..classes {
                    let p = (logits[c] - max).exp() / z;
                    let d = p - f32::from(u8::from(c == label));
                    grad_b[c] += d;
                    for (g, x) in grad_w[c * len..][..len].iter_mut().zip(&image) {
                        *g += d * x;
                    }
                }
            }
            losses.push(loss / batch as f32);
            let scale = lr / batch as f32;
            weights
                .iter_mut()
                .zip(&grad_w)
                .for_each(|(w, g)| *w -= scale * g);
            bias.iter_mut()
                .zip(&grad_b)
                .for_each(|(b, g)| *b -= scale * g);
        }
        let first = losses[0];
        let last: f32 = losses[steps - 10..].iter().sum::<f32>() / 10.0;
        assert!((first - 10f32.ln()).abs() < 1e-3, "initial loss {first}");
        assert!(last < 0.5 * first, "loss {first} → {last}: {losses:?}");
    }
}
