//! The transforms of a recipe: where in a source image the model's image comes from (a crop box,
//! mirrored or not), then resampling and per-channel normalisation.
//!
//! A sample's crop is a pure function of (seed, epoch, sample index, source size), so every
//! strategy, device count and host that reads a sample gets the same pixels. The geometries are
//! torchvision's: `RandomResizedCrop` (training), `Resize` of the shorter side then `CenterCrop`
//! (evaluation), and a plain resize of the whole image.

use super::{DataError, ImageShape};
use crate::rng::{Rng, hash};
use fast_image_resize as fr;
use std::cell::RefCell;

/// Separates the crop's random stream from the others drawn from a run's seed.
const CROP_STREAM: u64 = 0x6372_6f70_5f62_6f78;

/// How a sample's crop box is chosen.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Geometry {
    /// The whole image, resized to the model's height × width whatever its aspect.
    Stretch,
    /// Resized with its aspect kept so that the model's image is `fraction` of it along the
    /// tighter side, then the centre cut out (torchvision's `Resize(256)` + `CenterCrop(224)`
    /// is a fraction of 0.875).
    CenterCrop { fraction: f64 },
    /// A box of `scale` of the image's area and an aspect ratio (width / height) log-uniform in
    /// `ratio`, placed uniformly; after ten boxes that do not fit, the centred box of the
    /// nearest ratio (torchvision's `RandomResizedCrop`).
    RandomResizedCrop { scale: [f64; 2], ratio: [f64; 2] },
}

impl Geometry {
    /// torchvision's ImageNet training crop.
    pub const RANDOM_RESIZED_CROP: Geometry = Geometry::RandomResizedCrop {
        scale: [0.08, 1.0],
        ratio: [3.0 / 4.0, 4.0 / 3.0],
    };
    /// torchvision's ImageNet evaluation crop: 224 of 256.
    pub const CENTER_CROP: Geometry = Geometry::CenterCrop { fraction: 0.875 };

    fn check(&self) -> Result<(), DataError> {
        let bad = |what: String| Err(DataError::Config(what));
        match *self {
            Geometry::Stretch => Ok(()),
            Geometry::CenterCrop { fraction } if !(fraction > 0.0 && fraction <= 1.0) => bad(
                format!("a centre crop's fraction is in (0, 1], not {fraction}"),
            ),
            Geometry::RandomResizedCrop {
                scale: [lo, hi], ..
            } if !(lo > 0.0 && lo <= hi && hi <= 1.0) => bad(format!(
                "a random resized crop's scale is 0 < min <= max <= 1, not {lo}..{hi}"
            )),
            Geometry::RandomResizedCrop {
                ratio: [lo, hi], ..
            } if !(lo > 0.0 && lo <= hi && hi.is_finite()) => bad(format!(
                "a random resized crop's ratio is 0 < min <= max, not {lo}..{hi}"
            )),
            _ => Ok(()),
        }
    }
}

/// Per-channel normalisation of pixel values in [0, 1]: `(v - mean) / std`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Normalize {
    /// The dataset's own statistics: ImageNet's for a folder of photographs, CIFAR-10's for it.
    Dataset,
    Given {
        mean: [f32; 3],
        std: [f32; 3],
    },
    /// Values stay in [0, 1].
    Off,
}

impl std::fmt::Display for Normalize {
    /// As `--normalize` takes it: `dataset`, `none` or `M,M,M/S,S,S`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Normalize::Dataset => f.write_str("dataset"),
            Normalize::Off => f.write_str("none"),
            Normalize::Given { mean, std } => write!(
                f,
                "{},{},{}/{},{},{}",
                mean[0], mean[1], mean[2], std[0], std[1], std[2]
            ),
        }
    }
}

impl std::str::FromStr for Normalize {
    type Err = String;

    fn from_str(text: &str) -> Result<Normalize, String> {
        let three = |part: &str, what: &str| -> Result<[f32; 3], String> {
            let values: Vec<f32> = part
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("{what} `{part}`: {e}"))?;
            <[f32; 3]>::try_from(values)
                .map_err(|v| format!("{what} `{part}`: {} values, not 3", v.len()))
        };
        match text {
            "dataset" => Ok(Normalize::Dataset),
            "none" => Ok(Normalize::Off),
            _ => {
                let (mean, std) = text.split_once('/').ok_or_else(|| {
                    format!("`{text}`: expected dataset, none or MEAN,MEAN,MEAN/STD,STD,STD")
                })?;
                let (mean, std) = (three(mean, "mean")?, three(std, "std")?);
                if std.iter().any(|&s| !(s > 0.0 && s.is_finite())) {
                    return Err(format!("std `{text}`: every value must be positive"));
                }
                Ok(Normalize::Given { mean, std })
            }
        }
    }
}

/// A recipe's transforms, applied to every sample of a dataset.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Transforms {
    pub geometry: Geometry,
    /// Mirror left to right with probability one half.
    pub flip: bool,
    pub normalize: Normalize,
}

impl Transforms {
    /// torchvision's ImageNet training recipe: random resized crop and horizontal flip.
    pub const TRAIN: Transforms = Transforms {
        geometry: Geometry::RANDOM_RESIZED_CROP,
        flip: true,
        normalize: Normalize::Dataset,
    };
    /// torchvision's ImageNet evaluation recipe: resize and centre crop.
    pub const EVAL: Transforms = Transforms {
        geometry: Geometry::CENTER_CROP,
        flip: false,
        normalize: Normalize::Dataset,
    };
    /// The whole image at the model's size: no augmentation.
    pub const PLAIN: Transforms = Transforms {
        geometry: Geometry::Stretch,
        flip: false,
        normalize: Normalize::Dataset,
    };

    pub fn check(&self) -> Result<(), DataError> {
        self.geometry.check()?;
        if let Normalize::Given { std, .. } = self.normalize
            && std.iter().any(|&s| !(s > 0.0 && s.is_finite()))
        {
            return Err(DataError::Config(format!(
                "a normalisation's std is positive, not {std:?}"
            )));
        }
        Ok(())
    }

    /// Whether a sample's pixels depend on the epoch (a random crop or flip).
    pub fn is_random(&self) -> bool {
        self.flip || matches!(self.geometry, Geometry::RandomResizedCrop { .. })
    }

    /// The crop of sample `index` in `epoch` from a `source` of [width, height] pixels, for a
    /// model image of [height, width] `target`.
    pub fn crop(
        &self,
        seed: u64,
        epoch: u64,
        index: usize,
        source: [u32; 2],
        target: [usize; 2],
    ) -> Crop {
        let mut rng = Rng::new(hash(&[seed, CROP_STREAM, epoch, index as u64]));
        let [width, height] = source.map(f64::from);
        let [target_h, target_w] = target.map(|t| t as f64);
        let (left, top, w, h) = match self.geometry {
            Geometry::Stretch => (0.0, 0.0, width, height),
            Geometry::CenterCrop { fraction } => {
                // As torchvision: the side that binds is resized to a whole number of pixels
                // (the model's side / fraction), the other in proportion, truncated; the crop
                // starts a whole number of resized pixels in, rounded half to even.
                let (resized_h, resized_w) = if target_h / height >= target_w / width {
                    let h = (target_h / fraction).round();
                    (h, (h * width / height).floor())
                } else {
                    let w = (target_w / fraction).round();
                    ((w * height / width).floor(), w)
                };
                let (scale_y, scale_x) = (height / resized_h, width / resized_w);
                let top = ((resized_h - target_h) / 2.0).round_ties_even();
                let left = ((resized_w - target_w) / 2.0).round_ties_even();
                // Rounding may take a box of the whole side a hair past the image's edge.
                let (w, h) = (
                    (target_w * scale_x).min(width),
                    (target_h * scale_y).min(height),
                );
                (
                    (left * scale_x).min(width - w),
                    (top * scale_y).min(height - h),
                    w,
                    h,
                )
            }
            Geometry::RandomResizedCrop { scale, ratio } => {
                random_resized_box(&mut rng, source, scale, ratio)
            }
        };
        // Drawn after the box, from the same stream, so a flip never changes the box.
        let flip = self.flip && rng.next_u64() >> 63 == 1;
        Crop {
            left,
            top,
            width: w,
            height: h,
            flip,
            cut_first: !matches!(self.geometry, Geometry::CenterCrop { .. }),
        }
    }
}

/// torchvision's `RandomResizedCrop.get_params`, in whole pixels.
fn random_resized_box(
    rng: &mut Rng,
    [width, height]: [u32; 2],
    [scale_lo, scale_hi]: [f64; 2],
    [ratio_lo, ratio_hi]: [f64; 2],
) -> (f64, f64, f64, f64) {
    let area = f64::from(width) * f64::from(height);
    let (log_lo, log_hi) = (ratio_lo.ln(), ratio_hi.ln());
    for _ in 0..10 {
        let target_area = area * (scale_lo + (scale_hi - scale_lo) * unit(rng));
        let aspect = (log_lo + (log_hi - log_lo) * unit(rng)).exp();
        let w = (target_area * aspect).sqrt().round();
        let h = (target_area / aspect).sqrt().round();
        if w > 0.0 && h > 0.0 && w <= f64::from(width) && h <= f64::from(height) {
            let top = rng.below((f64::from(height) - h) as usize + 1) as f64;
            let left = rng.below((f64::from(width) - w) as usize + 1) as f64;
            return (left, top, w, h);
        }
    }
    let in_ratio = f64::from(width) / f64::from(height);
    let (w, h) = if in_ratio < ratio_lo {
        (f64::from(width), (f64::from(width) / ratio_lo).round())
    } else if in_ratio > ratio_hi {
        ((f64::from(height) * ratio_hi).round(), f64::from(height))
    } else {
        (f64::from(width), f64::from(height))
    };
    (
        ((f64::from(width) - w) / 2.0).floor(),
        ((f64::from(height) - h) / 2.0).floor(),
        w,
        h,
    )
}

/// Uniform in [0, 1) with 53 bits.
fn unit(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Where in a source image a sample's pixels come from, in source pixels, and whether mirrored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Crop {
    pub left: f64,
    pub top: f64,
    pub width: f64,
    pub height: f64,
    pub flip: bool,
    /// Whether the box (of whole pixels) is cut out before it is resized, so the filter at its
    /// edges sees only the box (a random resized crop, torchvision's `resized_crop`), or read
    /// in the whole image's context (the centre of a resized image).
    pub cut_first: bool,
}

/// Per-channel affine map from raw 0..=255 pixel values to normalised ones: `(v / 255 - mean) / std`.
/// A sample's bytes ([`crate::data::Dataset::sample_bytes`]) become its values through it, bit for
/// bit as the dataset writes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    scale: [f32; 3],
    offset: [f32; 3],
}

impl Normalization {
    /// The map `v · scale[c] + offset[c]` of channel `c`, as [`Normalization::affine`] gives it
    /// (from the network: refused unless every number is finite and every scale non-zero).
    pub fn from_affine(scale: [f32; 3], offset: [f32; 3]) -> Result<Normalization, DataError> {
        let finite = scale.iter().chain(&offset).all(|v| v.is_finite());
        if !finite || scale.contains(&0.0) {
            return Err(DataError::Config(format!(
                "a pixel normalisation of scale {scale:?} and offset {offset:?}: every number \
                 must be finite and every scale non-zero"
            )));
        }
        Ok(Normalization { scale, offset })
    }

    /// Per channel, (scale, offset) of the map.
    pub fn affine(&self) -> ([f32; 3], [f32; 3]) {
        (self.scale, self.offset)
    }

    /// The value of byte `v` of channel `channel`.
    #[inline]
    pub fn value(&self, channel: usize, v: u8) -> f32 {
        self.apply(channel, f32::from(v))
    }

    /// Values of images of shape `image` (sample-major, CHW) from their bytes: `out` holds as
    /// many values as `bytes` has bytes, a whole number of samples.
    pub fn values_of(&self, image: ImageShape, bytes: &[u8], out: &mut [f32]) {
        let [channels, height, width] = image;
        let plane = height * width;
        debug_assert_eq!(bytes.len(), out.len());
        for (sample, values) in bytes
            .chunks_exact(channels * plane)
            .zip(out.chunks_exact_mut(channels * plane))
        {
            for (c, (src, dst)) in sample
                .chunks_exact(plane)
                .zip(values.chunks_exact_mut(plane))
                .enumerate()
            {
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = self.value(c, v);
                }
            }
        }
    }

    pub fn new(mean: [f32; 3], std: [f32; 3]) -> Normalization {
        let mut scale = [0.0; 3];
        let mut offset = [0.0; 3];
        for c in 0..3 {
            scale[c] = 1.0 / (255.0 * std[c]);
            offset[c] = -mean[c] / std[c];
        }
        Normalization { scale, offset }
    }

    /// What `normalize` gives for a dataset whose own statistics are `own`.
    pub(super) fn resolve(normalize: Normalize, own: Normalization) -> Normalization {
        match normalize {
            Normalize::Dataset => own,
            Normalize::Given { mean, std } => Normalization::new(mean, std),
            Normalize::Off => Normalization::new([0.0; 3], [1.0; 3]),
        }
    }

    /// The mean and std this map normalises with, as given.
    pub(super) fn given(&self) -> Normalize {
        let std = self.scale.map(|s| 1.0 / (255.0 * s));
        let mut mean = [0.0; 3];
        for c in 0..3 {
            mean[c] = -self.offset[c] * std[c];
        }
        Normalize::Given { mean, std }
    }

    #[inline]
    pub(super) fn apply(&self, channel: usize, raw: f32) -> f32 {
        raw * self.scale[channel] + self.offset[channel]
    }
}

thread_local! {
    /// Each loader thread's resizer and the resampled bytes, kept between samples.
    static RESAMPLER: RefCell<(fr::Resizer, Vec<u8>)> = RefCell::new((fr::Resizer::new(), Vec::new()));
}

/// Where a resampled image goes: its normalised values, or its bytes before normalising.
pub(super) enum Planes<'a> {
    Values(&'a mut [f32], &'a Normalization),
    Bytes(&'a mut [u8]),
}

impl Planes<'_> {
    pub(super) fn reborrow(&mut self) -> Planes<'_> {
        match self {
            Planes::Values(values, n) => Planes::Values(values, n),
            Planes::Bytes(bytes) => Planes::Bytes(bytes),
        }
    }
}

/// Resamples `crop` of an interleaved 8-bit image (`image[0]` channels: 1 or 3) of `width` ×
/// `height` to the model's `image` with an antialiased bilinear filter (torchvision's, Pillow's),
/// mirrored where the crop says, and writes its CHW planes into `out`.
pub(super) fn resample_into(
    pixels: &[u8],
    [width, height]: [u32; 2],
    crop: &Crop,
    image: ImageShape,
    out: Planes<'_>,
) -> Result<(), DataError> {
    let [channels, out_h, out_w] = image;
    let pixel_type = match channels {
        1 => fr::PixelType::U8,
        3 => fr::PixelType::U8x3,
        _ => {
            return Err(DataError::UnsupportedChannels {
                dataset: "an image".into(),
                channels,
            });
        }
    };
    let source = fr::images::ImageRef::new(width, height, pixels, pixel_type)
        .map_err(|e| DataError::Config(format!("a decoded image of {width}×{height}: {e}")))?;
    RESAMPLER.with_borrow_mut(|(resizer, bytes)| {
        bytes.clear();
        bytes.resize(channels * out_h * out_w, 0);
        let mut target =
            fr::images::Image::from_slice_u8(out_w as u32, out_h as u32, bytes, pixel_type)
                .map_err(|e| DataError::Config(format!("a resampled image: {e}")))?;
        let bilinear = fr::ResizeOptions::new()
            .resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear));
        let failed = |e: fr::ResizeError| DataError::Config(format!("resampling {crop:?}: {e}"));
        if crop.cut_first {
            // A box of whole pixels is cut out first, as torchvision's `resized_crop` does: the
            // filter at its edges sees only the box.
            let [left, top, w, h] =
                [crop.left, crop.top, crop.width, crop.height].map(|v| v as u32);
            let cut = fr::images::CroppedImage::new(&source, left, top, w, h)
                .map_err(|e| DataError::Config(format!("cropping {crop:?}: {e}")))?;
            resizer
                .resize(&cut, &mut target, &bilinear)
                .map_err(failed)?;
        } else {
            // A box between pixels is the centre of a resized image: the filter at its edges
            // reads the pixels around it, as resizing the whole image would.
            let options = bilinear.crop(crop.left, crop.top, crop.width, crop.height);
            resizer
                .resize(&source, &mut target, &options)
                .map_err(failed)?;
        }
        match out {
            Planes::Values(out, n) => write_chw(bytes, image, crop.flip, |c, v| n.value(c, v), out),
            Planes::Bytes(out) => write_chw(bytes, image, crop.flip, |_, v| v, out),
        }
        Ok(())
    })
}

/// [`Crop`] of an interleaved 8-bit image (1 or 3 channels as `image[0]` says) of [width,
/// height] `size`, resampled to `image` as the datasets do, in values of [0, 1] (CHW): what a
/// recipe's geometry makes of a decoded image, before normalisation.
pub fn render_crop(
    pixels: &[u8],
    size: [u32; 2],
    crop: &Crop,
    image: ImageShape,
    out: &mut [f32],
) -> Result<(), DataError> {
    let unit = Normalization::resolve(Normalize::Off, Normalization::new([0.0; 3], [1.0; 3]));
    resample_into(pixels, size, crop, image, Planes::Values(out, &unit))
}

/// Scatters interleaved (HWC) bytes into planes (CHW) of `value(channel, byte)`, mirrored if
/// `flip`.
pub(super) fn write_chw<T: Copy>(
    interleaved: &[u8],
    [channels, height, width]: ImageShape,
    flip: bool,
    value: impl Fn(usize, u8) -> T,
    out: &mut [T],
) {
    let plane = height * width;
    if channels == 1 {
        for (dst_row, src_row) in out
            .chunks_exact_mut(width)
            .zip(interleaved.chunks_exact(width))
        {
            for (x, &v) in src_row.iter().enumerate() {
                let o = if flip { width - 1 - x } else { x };
                dst_row[o] = value(0, v);
            }
        }
        return;
    }
    // One pass over the source, three planes written at once.
    let (red, rest) = out.split_at_mut(plane);
    let (green, blue) = rest.split_at_mut(plane);
    let rows = red
        .chunks_exact_mut(width)
        .zip(green.chunks_exact_mut(width))
        .zip(blue.chunks_exact_mut(width))
        .zip(interleaved.chunks_exact(width * 3));
    for (((r, g), b), src_row) in rows {
        for (x, p) in src_row.chunks_exact(3).enumerate() {
            let o = if flip { width - 1 - x } else { x };
            r[o] = value(0, p[0]);
            g[o] = value(1, p[1]);
            b[o] = value(2, p[2]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crop_is_a_pure_function_of_seed_epoch_and_sample() {
        let t = Transforms::TRAIN;
        let a = t.crop(7, 3, 11, [500, 375], [224, 224]);
        assert_eq!(a, t.crop(7, 3, 11, [500, 375], [224, 224]));
        let others = [
            t.crop(8, 3, 11, [500, 375], [224, 224]),
            t.crop(7, 4, 11, [500, 375], [224, 224]),
            t.crop(7, 3, 12, [500, 375], [224, 224]),
        ];
        assert!(others.iter().all(|o| *o != a), "{a:?} {others:?}");
    }

    #[test]
    fn random_resized_crops_keep_to_their_scale_ratio_and_image() {
        let t = Transforms::TRAIN;
        let (mut flips, n) = (0, 2000);
        for index in 0..n {
            let c = t.crop(1, 0, index, [500, 375], [224, 224]);
            assert!(c.left >= 0.0 && c.top >= 0.0, "{c:?}");
            assert!(
                c.left + c.width <= 500.0 && c.top + c.height <= 375.0,
                "{c:?}"
            );
            assert_eq!(
                (c.left.fract(), c.top.fract(), c.width.fract()),
                (0.0, 0.0, 0.0)
            );
            let area = c.width * c.height / (500.0 * 375.0);
            // Rounding the sides moves the area and ratio a little past their bounds.
            assert!((0.07..=1.0).contains(&area), "{c:?}");
            let ratio = c.width / c.height;
            assert!((0.74..=1.35).contains(&ratio), "{c:?}");
            flips += c.flip as usize;
        }
        assert!((850..1150).contains(&flips), "{flips} of {n}");
    }

    #[test]
    fn a_box_that_never_fits_falls_back_to_the_centre() {
        // A sliver far wider than 4:3: no box of the ratios fits; the centred 4:3 box does.
        let t = Transforms {
            geometry: Geometry::RandomResizedCrop {
                scale: [1.0, 1.0],
                ratio: [0.75, 4.0 / 3.0],
            },
            ..Transforms::TRAIN
        };
        let c = t.crop(1, 0, 0, [400, 30], [8, 8]);
        assert_eq!((c.left, c.top, c.width, c.height), (180.0, 0.0, 40.0, 30.0));
    }

    #[test]
    fn the_evaluation_crop_is_torchvisions_resize_and_centre_crop() {
        // Resize(256) of 500×375 is 341×256; CenterCrop(224) of it starts 58 and 16 resized
        // pixels in.
        let c = Transforms::EVAL.crop(1, 0, 0, [500, 375], [224, 224]);
        let (scale_x, scale_y) = (500.0 / 341.0, 375.0 / 256.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(
            close(c.left, 58.0 * scale_x) && close(c.top, 16.0 * scale_y),
            "{c:?}"
        );
        assert!(
            close(c.width, 224.0 * scale_x) && close(c.height, 224.0 * scale_y),
            "{c:?}"
        );
        assert!(!c.flip);
        // Never random: every epoch and sample of one size gets the same box.
        assert_eq!(c, Transforms::EVAL.crop(9, 5, 3, [500, 375], [224, 224]));
    }

    #[test]
    fn a_centre_crop_of_the_whole_side_stays_inside_the_image() {
        let whole = Transforms {
            geometry: Geometry::CenterCrop { fraction: 1.0 },
            ..Transforms::EVAL
        };
        for height in 20..400 {
            let c = whole.crop(0, 0, 0, [500, height], [224, 224]);
            assert!(
                c.top >= 0.0 && c.top + c.height <= f64::from(height),
                "{c:?}"
            );
            assert!(c.left >= 0.0 && c.left + c.width <= 500.0, "{c:?}");
        }
    }

    #[test]
    fn bad_recipes_are_refused() {
        let mut t = Transforms::TRAIN;
        t.geometry = Geometry::RandomResizedCrop {
            scale: [0.5, 0.2],
            ratio: [0.75, 1.33],
        };
        assert!(t.check().unwrap_err().to_string().contains("scale"));
        t.geometry = Geometry::CenterCrop { fraction: 1.5 };
        assert!(t.check().unwrap_err().to_string().contains("fraction"));
        t.geometry = Geometry::Stretch;
        t.normalize = Normalize::Given {
            mean: [0.5; 3],
            std: [0.2, 0.0, 0.2],
        };
        assert!(t.check().unwrap_err().to_string().contains("std"));
    }

    #[test]
    fn a_flip_mirrors_each_row() {
        let pixels: Vec<u8> = (0..2 * 3 * 3).map(|v| v as u8).collect();
        let norm = Normalization::new([0.0; 3], [1.0 / 255.0; 3]);
        let mut plain = vec![0.0; 18];
        let mut mirrored = vec![0.0; 18];
        write_chw(
            &pixels,
            [3, 2, 3],
            false,
            |c, v| norm.value(c, v),
            &mut plain,
        );
        write_chw(
            &pixels,
            [3, 2, 3],
            true,
            |c, v| norm.value(c, v),
            &mut mirrored,
        );
        // Channel 0, row 0: pixels 0, 3, 6 of the interleaved bytes.
        assert_eq!(&plain[..3], &[0.0, 3.0, 6.0]);
        assert_eq!(&mirrored[..3], &[6.0, 3.0, 0.0]);
        assert_eq!(&mirrored[3..6], &[15.0, 12.0, 9.0]);
    }
}
