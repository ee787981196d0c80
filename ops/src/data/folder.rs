//! Images in a folder per class (`root/<class>/<image>.{png,jpg,jpeg}`), the layout of ImageNet-style
//! training sets. Class ids follow the sorted folder names; images are decoded on demand.

use super::{DataError, Dataset, ImageShape, Normalization, check_photo_shape, check_sample_args};
use image::imageops::{self, FilterType};
use image::{ImageBuffer, ImageReader, Pixel};
use std::fs;
use std::path::{Path, PathBuf};

const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];
/// ImageNet channel statistics, the usual choice for photographs.
const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];
const GREY_MEAN: f32 = 0.449;
const GREY_STD: f32 = 0.226;

pub struct ImageFolder {
    root: PathBuf,
    class_names: Vec<String>,
    /// Sorted by class, then file name.
    samples: Vec<(PathBuf, u32)>,
    image: ImageShape,
    normalization: Normalization,
}

impl ImageFolder {
    /// Scans `root` for class folders (hidden ones skipped) and their JPEG/PNG files (by extension, any
    /// case). Images are resized to `image`'s height × width (1 or 3 channels).
    pub fn open(root: &Path, image: ImageShape) -> Result<ImageFolder, DataError> {
        check_photo_shape("an image folder", image)?;
        let class_dirs: Vec<(String, PathBuf)> = read_dir_sorted(root)?
            .into_iter()
            .filter(|(name, path)| !name.starts_with('.') && path.is_dir())
            .collect();
        if class_dirs.is_empty() {
            return Err(DataError::NoClasses {
                root: root.to_path_buf(),
            });
        }
        let mut samples = Vec::new();
        for (label, (_, dir)) in class_dirs.iter().enumerate() {
            let before = samples.len();
            for (_, path) in read_dir_sorted(dir)? {
                if has_image_extension(&path) && path.is_file() {
                    samples.push((path, label as u32));
                }
            }
            if samples.len() == before {
                return Err(DataError::EmptyClass { dir: dir.clone() });
            }
        }
        let normalization = if image[0] == 3 {
            Normalization::new(MEAN, STD)
        } else {
            Normalization::new([GREY_MEAN; 3], [GREY_STD; 3])
        };
        Ok(ImageFolder {
            root: root.to_path_buf(),
            class_names: class_dirs.into_iter().map(|(name, _)| name).collect(),
            samples,
            image,
            normalization,
        })
    }

    /// Folder names, indexed by label.
    pub fn class_names(&self) -> &[String] {
        &self.class_names
    }

    /// The file behind sample `index`.
    pub fn path(&self, index: usize) -> Option<&Path> {
        self.samples.get(index).map(|(p, _)| p.as_path())
    }

    /// Decodes, converts to the requested channel count and resizes (triangle filter, which averages
    /// properly when shrinking large photos), then writes normalised CHW values.
    fn decode_into(&self, path: &Path, out: &mut [f32]) -> Result<(), DataError> {
        let io_err = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let decoded = ImageReader::open(path)
            .map_err(io_err)?
            .with_guessed_format()
            .map_err(io_err)?
            .decode()
            .map_err(|source| DataError::Decode {
                path: path.to_path_buf(),
                source,
            })?;
        let [channels, height, width] = self.image;
        if channels == 3 {
            let rgb = fit(decoded.into_rgb8(), width, height);
            self.write_chw(&rgb, out);
        } else {
            let grey = fit(decoded.into_luma8(), width, height);
            self.write_chw(&grey, out);
        }
        Ok(())
    }

    /// Scatters interleaved (HWC) bytes into normalised planes (CHW).
    fn write_chw(&self, interleaved: &[u8], out: &mut [f32]) {
        let channels = self.image[0];
        let plane = self.image[1] * self.image[2];
        for (channel, dst) in out.chunks_exact_mut(plane).enumerate() {
            for (o, pixel) in dst.iter_mut().zip(interleaved.chunks_exact(channels)) {
                *o = self.normalization.apply(channel, f32::from(pixel[channel]));
            }
        }
    }
}

fn fit<P>(image: ImageBuffer<P, Vec<u8>>, width: usize, height: usize) -> ImageBuffer<P, Vec<u8>>
where
    P: Pixel<Subpixel = u8> + 'static,
{
    let (width, height) = (width as u32, height as u32);
    if image.dimensions() == (width, height) {
        image
    } else {
        imageops::resize(&image, width, height, FilterType::Triangle)
    }
}

/// Entries of `dir` as (file name, path), sorted by name so class ids and sample order do not depend on
/// the filesystem's listing order.
fn read_dir_sorted(dir: &Path) -> Result<Vec<(String, PathBuf)>, DataError> {
    let io_err = |source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut entries = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err)? {
        let entry = entry.map_err(io_err)?;
        entries.push((
            entry.file_name().to_string_lossy().into_owned(),
            entry.path(),
        ));
    }
    entries.sort();
    Ok(entries)
}

fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.iter().any(|known| e.eq_ignore_ascii_case(known)))
}

impl Dataset for ImageFolder {
    fn num_samples(&self) -> usize {
        self.samples.len()
    }

    fn image_shape(&self) -> ImageShape {
        self.image
    }

    fn num_classes(&self) -> usize {
        self.class_names.len()
    }

    fn sample(&self, index: usize, out: &mut [f32]) -> Result<u32, DataError> {
        check_sample_args(self, index, out)?;
        let (path, label) = &self.samples[index];
        self.decode_into(path, out)?;
        Ok(*label)
    }

    fn describe(&self) -> String {
        format!(
            "image folder {} ({} samples, {} classes)",
            self.root.display(),
            self.samples.len(),
            self.class_names.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{GrayImage, Luma, Rgb, RgbImage};

    fn normalised(raw: f32, channel: usize) -> f32 {
        (raw / 255.0 - MEAN[channel]) / STD[channel]
    }

    /// `root/cat`: a red 8×6 PNG and a green 10×10 JPEG (upper-case extension) plus a text file;
    /// `root/dog`: a grey 4×4 PNG; `root/.cache`: ignored.
    fn make_folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for sub in ["cat", "dog", ".cache"] {
            fs::create_dir(root.join(sub)).unwrap();
        }
        RgbImage::from_pixel(8, 6, Rgb([255, 0, 0]))
            .save(root.join("cat/a_red.png"))
            .unwrap();
        let green = RgbImage::from_pixel(10, 10, Rgb([0, 200, 0]));
        green
            .save_with_format(root.join("cat/b_green.JPG"), image::ImageFormat::Jpeg)
            .unwrap();
        fs::write(root.join("cat/notes.txt"), "not an image").unwrap();
        GrayImage::from_pixel(4, 4, Luma([128]))
            .save(root.join("dog/grey.png"))
            .unwrap();
        RgbImage::from_pixel(2, 2, Rgb([1, 2, 3]))
            .save(root.join(".cache/hidden.png"))
            .unwrap();
        dir
    }

    #[test]
    fn classes_follow_sorted_folder_names() {
        let dir = make_folder();
        let ds = ImageFolder::open(dir.path(), [3, 4, 4]).unwrap();
        assert_eq!(ds.class_names(), ["cat", "dog"]);
        assert_eq!(ds.num_classes(), 2);
        assert_eq!(ds.num_samples(), 3);
        assert!(ds.path(1).unwrap().ends_with("cat/b_green.JPG"));

        let plane = 16;
        let mut image = vec![0.0; ds.sample_len()];
        assert_eq!(ds.sample(0, &mut image).unwrap(), 0);
        for (channel, raw) in [255.0, 0.0, 0.0].into_iter().enumerate() {
            let expected = normalised(raw, channel);
            assert!(
                image[channel * plane..][..plane]
                    .iter()
                    .all(|&v| (v - expected).abs() < 1e-5)
            );
        }
        // JPEG is lossy: compare the mean of each plane loosely.
        assert_eq!(ds.sample(1, &mut image).unwrap(), 0);
        for (channel, raw) in [0.0, 200.0, 0.0].into_iter().enumerate() {
            let mean = image[channel * plane..][..plane].iter().sum::<f32>() / plane as f32;
            assert!(
                (mean - normalised(raw, channel)).abs() < 0.2,
                "{channel}: {mean}"
            );
        }
        // A grey source becomes three equal raw channels.
        assert_eq!(ds.sample(2, &mut image).unwrap(), 1);
        assert!((image[0] - normalised(128.0, 0)).abs() < 1e-5);
        assert!((image[2 * plane] - normalised(128.0, 2)).abs() < 1e-5);
    }

    #[test]
    fn grey_output_and_spec() {
        let dir = make_folder();
        let spec = format!("folder:{}", dir.path().display());
        let ds = super::super::open(&spec, [1, 5, 7], 1000, 0).unwrap();
        assert_eq!(ds.image_shape(), [1, 5, 7]);
        let mut image = vec![0.0; 35];
        assert_eq!(ds.sample(2, &mut image).unwrap(), 1);
        let expected = (128.0 / 255.0 - GREY_MEAN) / GREY_STD;
        assert!(image.iter().all(|&v| (v - expected).abs() < 1e-5));
        assert!(ds.describe().contains("3 samples"));
    }

    #[test]
    fn undecodable_images_name_the_file() {
        let dir = make_folder();
        fs::write(dir.path().join("dog/zz_broken.png"), b"\x89PNG garbage").unwrap();
        let ds = ImageFolder::open(dir.path(), [3, 4, 4]).unwrap();
        let mut image = vec![0.0; ds.sample_len()];
        let err = ds.sample(3, &mut image).unwrap_err();
        assert!(matches!(err, DataError::Decode { .. }), "{err}");
        assert!(err.to_string().contains("zz_broken.png"), "{err}");
    }

    #[test]
    fn empty_roots_and_classes_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = ImageFolder::open(dir.path(), [3, 4, 4]).err().unwrap();
        assert!(matches!(err, DataError::NoClasses { .. }), "{err}");

        fs::create_dir(dir.path().join("empty_class")).unwrap();
        fs::write(dir.path().join("empty_class/readme.md"), "x").unwrap();
        let err = ImageFolder::open(dir.path(), [3, 4, 4]).err().unwrap();
        assert!(matches!(err, DataError::EmptyClass { .. }), "{err}");
        assert!(err.to_string().contains("empty_class"), "{err}");

        let missing = dir.path().join("missing");
        let err = ImageFolder::open(&missing, [3, 4, 4]).err().unwrap();
        assert!(matches!(err, DataError::Io { .. }), "{err}");
    }

    #[test]
    fn too_many_classes_for_the_model() {
        let dir = make_folder();
        let spec = format!("folder:{}", dir.path().display());
        assert!(matches!(
            super::super::open(&spec, [3, 4, 4], 1, 0),
            Err(DataError::TooManyClasses {
                dataset_classes: 2,
                model_classes: 1,
                ..
            })
        ));
    }
}
