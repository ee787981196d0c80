//! Images in a folder per class (`root/<class>/[…/]<image>.{png,jpg,jpeg}`), the layout of
//! ImageNet-style training sets. Class ids follow the sorted folder names; every file's header is
//! read when the folder is opened, and images are decoded on demand.

use super::transform::{Normalization, Planes, resample_into};
use super::{
    DataError, Dataset, ImageShape, OpenProgress, Transforms, check_photo_shape, check_sample_args,
};
use image::ImageReader;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];
/// ImageNet channel statistics, the usual choice for photographs.
const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];
const GREY_MEAN: f32 = 0.449;
const GREY_STD: f32 = 0.226;

#[derive(Clone)]
pub struct ImageFolder {
    root: PathBuf,
    class_names: Vec<String>,
    /// Sorted by class, then file name; those whose header could not be read are left out.
    samples: Vec<(PathBuf, u32)>,
    image: ImageShape,
    transforms: Transforms,
    /// Seed of the random transforms.
    seed: u64,
    /// The folder's own statistics (ImageNet's), and what the transforms make of them.
    own_normalization: Normalization,
    normalization: Normalization,
    census: Census,
}

/// What opening a folder found: images per class, files left aside and why.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Census {
    /// Class folder names, by label.
    pub class_names: Vec<String>,
    /// Images by label.
    pub per_class: Vec<usize>,
    /// Files of other extensions, counted by lower-case extension (`""`: none).
    pub ignored: BTreeMap<String, usize>,
    /// Images whose header could not be read, with why; not sampled.
    pub unreadable: Vec<(PathBuf, String)>,
}

impl ImageFolder {
    /// Scans `root` for class folders (hidden ones skipped) and their JPEG/PNG files (by extension, any
    /// case), reading every file's header in parallel: those that cannot be read are left out and
    /// listed in the [`Census`]. Images are resized whole to `image`'s height × width (1 or 3
    /// channels) until [`with`](Self::with) gives other transforms.
    pub fn open(root: &Path, image: ImageShape) -> Result<ImageFolder, DataError> {
        ImageFolder::open_reporting(root, image, &())
    }

    /// [`ImageFolder::open`], telling `progress` how many of the image files found have had
    /// their headers read (a large folder takes seconds).
    pub fn open_reporting(
        root: &Path,
        image: ImageShape,
        progress: &dyn OpenProgress,
    ) -> Result<ImageFolder, DataError> {
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
        let mut candidates = Vec::new();
        let mut census = Census::default();
        for (label, (_, dir)) in class_dirs.iter().enumerate() {
            let before = candidates.len();
            for path in files_under(dir)? {
                if has_image_extension(&path) {
                    candidates.push((path, label as u32));
                } else {
                    let extension = path
                        .extension()
                        .map_or(String::new(), |e| e.to_string_lossy().to_lowercase());
                    *census.ignored.entry(extension).or_default() += 1;
                }
            }
            if candidates.len() == before {
                return Err(DataError::EmptyClass { dir: dir.clone() });
            }
        }
        let (total, checked) = (candidates.len(), AtomicUsize::new(0));
        progress.checked(0, total);
        let headers: Vec<Option<String>> = candidates
            .par_iter()
            .map(|(path, _)| {
                let problem = read_header(path).err();
                let done = checked.fetch_add(1, Ordering::Relaxed) + 1;
                if done % 256 == 0 || done == total {
                    progress.checked(done, total);
                }
                problem
            })
            .collect();
        census.per_class = vec![0; class_dirs.len()];
        let mut samples = Vec::with_capacity(candidates.len());
        for ((path, label), problem) in candidates.into_iter().zip(headers) {
            match problem {
                Some(why) => census.unreadable.push((path, why)),
                None => {
                    census.per_class[label as usize] += 1;
                    samples.push((path, label));
                }
            }
        }
        if let Some(label) = census.per_class.iter().position(|&n| n == 0) {
            return Err(DataError::EmptyClass {
                dir: class_dirs[label].1.clone(),
            });
        }
        let own_normalization = photo_normalization(image[0]);
        census.class_names = class_dirs.into_iter().map(|(name, _)| name).collect();
        Ok(ImageFolder {
            root: root.to_path_buf(),
            class_names: census.class_names.clone(),
            samples,
            image,
            transforms: Transforms::PLAIN,
            seed: 0,
            own_normalization,
            normalization: own_normalization,
            census,
        })
    }

    /// These image files, in this order, as a dataset of one unnamed class (label 0): images to
    /// classify. A file whose header cannot be read is an error naming it.
    pub fn from_files(files: &[PathBuf], image: ImageShape) -> Result<ImageFolder, DataError> {
        check_photo_shape("image files", image)?;
        if files.is_empty() {
            return Err(DataError::Config("no image files given".into()));
        }
        for path in files {
            if let Err(why) = read_header(path) {
                return Err(DataError::Config(format!("{}: {why}", path.display())));
            }
        }
        let own_normalization = photo_normalization(image[0]);
        Ok(ImageFolder {
            root: PathBuf::new(),
            class_names: vec![String::new()],
            samples: files.iter().map(|p| (p.clone(), 0)).collect(),
            image,
            transforms: Transforms::PLAIN,
            seed: 0,
            own_normalization,
            normalization: own_normalization,
            census: Census::default(),
        })
    }

    /// The folder seen through `transforms`, their random draws seeded by `seed`.
    pub fn with(mut self, transforms: Transforms, seed: u64) -> ImageFolder {
        self.transforms = transforms;
        self.seed = seed;
        self.normalization = Normalization::resolve(transforms.normalize, self.own_normalization);
        self
    }

    /// What opening the folder found.
    pub fn census(&self) -> &Census {
        &self.census
    }

    /// Folder names, indexed by label.
    pub fn class_names(&self) -> &[String] {
        &self.class_names
    }

    /// The file behind sample `index`.
    pub fn path(&self, index: usize) -> Option<&Path> {
        self.samples.get(index).map(|(p, _)| p.as_path())
    }

    /// Decodes, converts to the requested channel count, crops and resizes as the transforms say
    /// for (index, epoch), then writes normalised CHW values.
    fn decode_into(
        &self,
        path: &Path,
        index: usize,
        epoch: u64,
        mut out: Planes<'_>,
    ) -> Result<(), DataError> {
        let io_err = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bytes = fs::read(path).map_err(io_err)?;
        let [channels, height, width] = self.image;
        let draw = |size| {
            self.transforms
                .crop(self.seed, epoch, index, size, [height, width])
        };
        let decode_error = |source| DataError::Decode {
            path: path.to_path_buf(),
            source,
        };
        let done = DECODED.with_borrow_mut(|pixels| {
            let Some(size) = decode_jpeg(&bytes, channels, pixels).map_err(decode_error)? else {
                return Ok(false);
            };
            resample_into(pixels, size, &draw(size), self.image, out.reborrow())?;
            Ok::<_, DataError>(true)
        })?;
        if done {
            return Ok(());
        }
        // PNG, and JPEG in colour spaces the direct path leaves to the image crate (CMYK).
        let decoded = ImageReader::new(std::io::Cursor::new(&bytes))
            .with_guessed_format()
            .map_err(io_err)?
            .decode()
            .map_err(decode_error)?;
        let size = [decoded.width(), decoded.height()];
        let pixels = match channels {
            3 => decoded.into_rgb8().into_raw(),
            _ => decoded.into_luma8().into_raw(),
        };
        resample_into(&pixels, size, &draw(size), self.image, out)
    }
}

thread_local! {
    /// Each loader thread's decoded pixels, kept between samples: a photo's pixels are too large
    /// for the allocator to keep, and fresh pages fault in one by one.
    static DECODED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Decodes a baseline or progressive JPEG in YCbCr, grey or RGB into `pixels` (interleaved, with
/// `channels` of 1 or 3), returning its [width, height]; `None` for what is not such a JPEG.
fn decode_jpeg(
    bytes: &[u8],
    channels: usize,
    pixels: &mut Vec<u8>,
) -> Result<Option<[u32; 2]>, image::ImageError> {
    use zune_core::colorspace::ColorSpace;
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return Ok(None);
    }
    let error = |e: zune_jpeg::errors::DecodeErrors| {
        image::ImageError::Decoding(image::error::DecodingError::new(
            image::ImageFormat::Jpeg.into(),
            e,
        ))
    };
    let out = match channels {
        3 => ColorSpace::RGB,
        _ => ColorSpace::Luma,
    };
    let options = zune_core::options::DecoderOptions::default().jpeg_set_out_colorspace(out);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(
        zune_core::bytestream::ZCursor::new(bytes),
        options,
    );
    decoder.decode_headers().map_err(error)?;
    let known = matches!(
        decoder.input_colorspace(),
        Some(ColorSpace::YCbCr | ColorSpace::Luma | ColorSpace::RGB)
    );
    let (Some((width, height)), Some(len), true) =
        (decoder.dimensions(), decoder.output_buffer_size(), known)
    else {
        return Ok(None);
    };
    if len != width * height * channels {
        return Ok(None);
    }
    // Zeroed each time: a corrupt file the decoder accepts may leave rows unwritten, which must
    // not show the thread's previous image.
    pixels.clear();
    pixels.resize(len, 0);
    decoder.decode_into(pixels).map_err(error)?;
    Ok(Some([width as u32, height as u32]))
}

impl Census {
    /// One line: the images of each class and its label, then what was left aside.
    pub fn describe(&self) -> String {
        let classes: Vec<String> = self
            .class_names
            .iter()
            .zip(&self.per_class)
            .enumerate()
            .map(|(label, (name, n))| format!("{name} {n} (label {label})"))
            .collect();
        let mut line = format!(
            "{} images in {} classes: {}",
            self.per_class.iter().sum::<usize>(),
            classes.len(),
            classes.join(", ")
        );
        if !self.ignored.is_empty() {
            let ignored: Vec<String> = self
                .ignored
                .iter()
                .map(|(ext, n)| match ext.as_str() {
                    "" => format!("{n} without an extension"),
                    _ => format!("{n} .{ext}"),
                })
                .collect();
            line += &format!(
                "; ignored (not .png, .jpg or .jpeg): {}",
                ignored.join(", ")
            );
        }
        if let Some((path, why)) = self.unreadable.first() {
            line += &format!(
                "; {} unreadable, left out (the first: {}: {why})",
                self.unreadable.len(),
                path.display()
            );
        }
        line
    }
}

/// ImageNet's statistics, for RGB or grey images.
fn photo_normalization(channels: usize) -> Normalization {
    match channels {
        3 => Normalization::new(MEAN, STD),
        _ => Normalization::new([GREY_MEAN; 3], [GREY_STD; 3]),
    }
}

/// Reads what an image's header says (its format and size), or says why it cannot.
fn read_header(path: &Path) -> Result<(), String> {
    let reader = ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| e.to_string())?;
    if reader.format().is_none() {
        return Err("not a JPEG or PNG file".into());
    }
    match reader.into_dimensions() {
        Ok((0, _) | (_, 0)) => Err("an image of no pixels".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
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

/// The files in `dir` and, as torchvision's `ImageFolder` finds them, in its subfolders at any
/// depth (hidden ones left out, and links to folders, which could loop), each folder's entries
/// in name order.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut files = Vec::new();
    for (name, path) in read_dir_sorted(dir)? {
        if path.is_dir() {
            let linked = fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
            if !name.starts_with('.') && !linked {
                files.extend(files_under(&path)?);
            }
        } else if path.is_file() {
            files.push(path);
        }
    }
    Ok(files)
}

/// Whether `path` names a PNG or JPEG file by its extension (any case), as a folder's images do.
pub fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.iter().any(|known| e.eq_ignore_ascii_case(known)))
}

impl Dataset for ImageFolder {
    fn num_samples(&self) -> usize {
        self.samples.len()
    }

    /// The same files, opened once, through other transforms.
    fn seen_through(&self, transforms: Transforms) -> Option<Arc<dyn Dataset>> {
        Some(Arc::new(self.clone().with(transforms, self.seed)))
    }

    fn image_shape(&self) -> ImageShape {
        self.image
    }

    fn num_classes(&self) -> usize {
        self.class_names.len()
    }

    fn sample(&self, index: usize, epoch: u64, out: &mut [f32]) -> Result<u32, DataError> {
        check_sample_args(self, index, out.len())?;
        let (path, label) = &self.samples[index];
        let out = Planes::Values(out, &self.normalization);
        self.decode_into(path, index, epoch, out)?;
        Ok(*label)
    }

    fn byte_normalization(&self) -> Option<Normalization> {
        Some(self.normalization)
    }

    fn label(&self, index: usize) -> Option<u32> {
        self.samples.get(index).map(|&(_, label)| label)
    }

    fn sample_bytes(&self, index: usize, epoch: u64, out: &mut [u8]) -> Result<u32, DataError> {
        check_sample_args(self, index, out.len())?;
        let (path, label) = &self.samples[index];
        self.decode_into(path, index, epoch, Planes::Bytes(out))?;
        Ok(*label)
    }

    fn census(&self) -> Option<&Census> {
        Some(&self.census)
    }

    fn normalization(&self) -> Option<super::Normalize> {
        Some(self.normalization.given())
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
        fs::create_dir(root.join("dog/puppies")).unwrap();
        GrayImage::from_pixel(4, 4, Luma([128]))
            .save(root.join("dog/puppies/grey.png"))
            .unwrap();
        RgbImage::from_pixel(2, 2, Rgb([1, 2, 3]))
            .save(root.join(".cache/hidden.png"))
            .unwrap();
        dir
    }

    #[test]
    fn opening_reports_the_files_checked_up_to_all_of_them() {
        struct Seen(std::sync::Mutex<Vec<(usize, usize)>>);
        impl OpenProgress for Seen {
            fn checked(&self, done: usize, total: usize) {
                self.0.lock().unwrap().push((done, total));
            }
        }
        let dir = make_folder();
        let seen = Seen(std::sync::Mutex::new(Vec::new()));
        ImageFolder::open_reporting(dir.path(), [3, 4, 4], &seen).unwrap();
        // the three images of the visible classes: none at first, all three at the end
        assert_eq!(seen.0.into_inner().unwrap(), [(0, 3), (3, 3)]);
    }

    #[test]
    fn a_folder_seen_through_other_transforms_keeps_its_files_and_applies_them() {
        let dir = make_folder();
        let plain = ImageFolder::open(dir.path(), [3, 4, 4]).unwrap();
        let raw = Transforms {
            normalize: crate::data::Normalize::Off,
            ..Transforms::PLAIN
        };
        let seen = plain.seen_through(raw).unwrap();
        assert_eq!(seen.num_samples(), plain.num_samples());
        assert_eq!(seen.census(), Some(plain.census()));
        let (mut a, mut b) = (vec![0.0; 48], vec![0.0; 48]);
        for i in 0..plain.num_samples() {
            let label = plain.sample(i, 0, &mut a).unwrap();
            assert_eq!(seen.sample(i, 0, &mut b).unwrap(), label);
            assert_ne!(a, b, "sample {i} normalised as before");
        }
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
        assert_eq!(ds.sample(0, 0, &mut image).unwrap(), 0);
        for (channel, raw) in [255.0, 0.0, 0.0].into_iter().enumerate() {
            let expected = normalised(raw, channel);
            assert!(
                image[channel * plane..][..plane]
                    .iter()
                    .all(|&v| (v - expected).abs() < 1e-5)
            );
        }
        // JPEG is lossy: compare the mean of each plane loosely.
        assert_eq!(ds.sample(1, 0, &mut image).unwrap(), 0);
        for (channel, raw) in [0.0, 200.0, 0.0].into_iter().enumerate() {
            let mean = image[channel * plane..][..plane].iter().sum::<f32>() / plane as f32;
            assert!(
                (mean - normalised(raw, channel)).abs() < 0.2,
                "{channel}: {mean}"
            );
        }
        // A grey source becomes three equal raw channels.
        assert_eq!(ds.sample(2, 0, &mut image).unwrap(), 1);
        assert!((image[0] - normalised(128.0, 0)).abs() < 1e-5);
        assert!((image[2 * plane] - normalised(128.0, 2)).abs() < 1e-5);
    }

    #[test]
    fn grey_output_and_spec() {
        let dir = make_folder();
        let spec = format!("folder:{}", dir.path().display());
        let ds = super::super::open(&spec, [1, 5, 7], 1000, 0, Transforms::PLAIN).unwrap();
        assert_eq!(ds.image_shape(), [1, 5, 7]);
        let mut image = vec![0.0; 35];
        assert_eq!(ds.sample(2, 0, &mut image).unwrap(), 1);
        let expected = (128.0 / 255.0 - GREY_MEAN) / GREY_STD;
        assert!(image.iter().all(|&v| (v - expected).abs() < 1e-5));
        assert!(ds.describe().contains("3 samples"));
    }

    /// A PNG whose header is whole but whose pixel data stops half way.
    fn truncated_png(path: &Path) {
        let noisy = RgbImage::from_fn(64, 64, |x, y| {
            Rgb([(x * 7) as u8, (y * 13) as u8, (x ^ y) as u8])
        });
        noisy.save(path).unwrap();
        let bytes = fs::read(path).unwrap();
        fs::write(path, &bytes[..bytes.len() / 2]).unwrap();
    }

    #[test]
    fn unreadable_headers_are_left_out_and_undecodable_images_name_the_file() {
        let dir = make_folder();
        fs::write(dir.path().join("dog/zz_broken.png"), b"\x89PNG garbage").unwrap();
        truncated_png(&dir.path().join("dog/zz_truncated.png"));
        fs::write(dir.path().join("dog/photo.webp"), b"RIFF").unwrap();
        let ds = ImageFolder::open(dir.path(), [3, 4, 4]).unwrap();
        let census = ds.census();
        assert_eq!(census.per_class, [2, 2]);
        assert_eq!(census.unreadable.len(), 1);
        assert!(census.unreadable[0].0.ends_with("dog/zz_broken.png"));
        assert_eq!(
            census.ignored,
            BTreeMap::from([("txt".to_string(), 1), ("webp".to_string(), 1)])
        );
        let mut image = vec![0.0; ds.sample_len()];
        let err = ds.sample(3, 0, &mut image).unwrap_err();
        assert!(matches!(err, DataError::Decode { .. }), "{err}");
        assert!(err.to_string().contains("zz_truncated.png"), "{err}");
    }

    #[test]
    fn the_direct_jpeg_decode_gives_the_image_crates_pixels() {
        let rgb = RgbImage::from_fn(37, 23, |x, y| Rgb([(x * 7) as u8, (y * 11) as u8, 90]));
        let grey = GrayImage::from_fn(37, 23, |x, y| Luma([(x * 5 + y * 3) as u8]));
        let encode = |image: image::DynamicImage| {
            let mut bytes = Vec::new();
            image
                .write_to(
                    &mut std::io::Cursor::new(&mut bytes),
                    image::ImageFormat::Jpeg,
                )
                .unwrap();
            bytes
        };
        for bytes in [encode(rgb.into()), encode(grey.into())] {
            let decoded = image::load_from_memory(&bytes).unwrap();
            for channels in [1, 3] {
                let mut pixels = Vec::new();
                let size = decode_jpeg(&bytes, channels, &mut pixels).unwrap().unwrap();
                assert_eq!(size, [37, 23]);
                // Grey is the JPEG's own luma (BT.601, as torchvision's grey decode), which
                // the image crate's RGB gives back within rounding.
                let want: Vec<u8> = match channels {
                    3 => decoded.to_rgb8().into_raw(),
                    _ => decoded
                        .to_rgb8()
                        .pixels()
                        .map(|p| {
                            let [r, g, b] = p.0.map(f32::from);
                            (0.299 * r + 0.587 * g + 0.114 * b).round() as u8
                        })
                        .collect(),
                };
                let off = pixels.iter().zip(&want).map(|(&a, &b)| a.abs_diff(b)).max();
                assert!(off <= Some(2), "{channels} channel(s): {off:?}");
            }
        }
        assert_eq!(decode_jpeg(b"\x89PNG", 3, &mut Vec::new()).unwrap(), None);
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

    /// Two classes of gradients (a crop or a flip changes every pixel): RGB PNG and JPEG, grey PNG.
    fn gradient_folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (class, shift) in [("a", 0u32), ("b", 90)] {
            let sub = dir.path().join(class);
            fs::create_dir(&sub).unwrap();
            for i in 0..3u32 {
                let (w, h) = (23 + 5 * i, 17 + 3 * i);
                let rgb = RgbImage::from_fn(w, h, |x, y| {
                    Rgb([
                        (x * 255 / w) as u8,
                        (y * 255 / h) as u8,
                        ((x + y + shift) % 256) as u8,
                    ])
                });
                rgb.save(sub.join(format!("{i}.png"))).unwrap();
                rgb.save_with_format(sub.join(format!("{i}.jpg")), image::ImageFormat::Jpeg)
                    .unwrap();
                GrayImage::from_fn(w, h, |x, y| Luma([((3 * x + y + shift) % 256) as u8]))
                    .save(sub.join(format!("{i}_grey.png")))
                    .unwrap();
            }
        }
        dir
    }

    #[test]
    fn a_samples_bytes_through_its_normalisation_are_its_values_bit_for_bit() {
        let dir = gradient_folder();
        for image in [[3, 12, 10], [1, 9, 9]] {
            for transforms in [Transforms::TRAIN, Transforms::EVAL, Transforms::PLAIN] {
                let ds = ImageFolder::open(dir.path(), image)
                    .unwrap()
                    .with(transforms, 5);
                let normalization = ds.byte_normalization().unwrap();
                let n = ds.sample_len();
                let (mut values, mut bytes, mut from_bytes) =
                    (vec![0.0; n], vec![0; n], vec![0.0; n]);
                for epoch in 0..3 {
                    for i in 0..ds.num_samples() {
                        let label = ds.sample(i, epoch, &mut values).unwrap();
                        assert_eq!(ds.sample_bytes(i, epoch, &mut bytes).unwrap(), label);
                        normalization.values_of(image, &bytes, &mut from_bytes);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&from_bytes), bits(&values), "{image:?} {i} {epoch}");
                    }
                }
            }
        }
        let cifar_like = crate::data::Synthetic::new(2, 4, 1, [3, 4, 4]).unwrap();
        let err = cifar_like.sample_bytes(0, 0, &mut [0; 48]).unwrap_err();
        assert!(err.to_string().contains("not 8-bit images"), "{err}");
    }

    #[test]
    fn a_loader_of_bytes_gives_the_values_batches_a_replaced_sample_included() {
        use crate::data::{Batch, Loader, LoaderConfig};
        let dir = gradient_folder();
        let ds: std::sync::Arc<dyn Dataset> = std::sync::Arc::new(
            ImageFolder::open(dir.path(), [3, 8, 8])
                .unwrap()
                .with(Transforms::TRAIN, 3),
        );
        // a file gone after opening: its sample is replaced in both
        fs::remove_file(dir.path().join("b/1.jpg")).unwrap();
        let values = Loader::new(ds.clone(), LoaderConfig::new(4)).unwrap();
        let config = LoaderConfig {
            bytes: true,
            ..LoaderConfig::new(4)
        };
        let bytes = Loader::new(ds, config).unwrap();
        let a: Vec<Batch> = values.steps_until(0, 9).map(Result::unwrap).collect();
        let b: Vec<Batch> = bytes.steps_until(0, 9).map(Result::unwrap).collect();
        for (a, b) in a.iter().zip(&b) {
            let got = b.bytes.as_ref().expect("bytes");
            assert!(b.images.is_empty());
            assert_eq!((&a.indices, &a.labels), (&b.indices, &b.labels));
            assert_eq!(got.bytes.len(), a.images.len());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.values()), bits(&a.images));
        }
        assert!(values.skipped().count > 0);
        assert_eq!(values.skipped(), bytes.skipped());
    }

    #[test]
    fn workers_reading_unread_batches_get_the_read_batches_a_replaced_sample_included() {
        use crate::data::{BadSamples, Data, DataSource, Loader, LoaderConfig, read_at};
        let dir = gradient_folder();
        let data = Data::Folder(dir.path().to_path_buf());
        let ds = data.open([3, 8, 8], 2, 3, Transforms::TRAIN).unwrap();
        let source = DataSource::of(&data, ds.as_ref(), [3, 8, 8], 2, 3, Transforms::TRAIN, None);
        let source = source.expect("a folder can be opened elsewhere");
        // what a worker opens, from what the driver sends it
        let json = serde_json::to_string(&source).unwrap();
        let elsewhere: DataSource = serde_json::from_str(&json).unwrap();
        assert_eq!(elsewhere, source);
        let worker = elsewhere.open().unwrap();
        // a file gone after opening: the reader replaces its sample; the driver learns it
        // from the worker and replaces it the same way
        fs::remove_file(dir.path().join("b/1.jpg")).unwrap();
        let read = Loader::new(ds.clone(), LoaderConfig::new(4)).unwrap();
        let config = LoaderConfig {
            labels_only: true,
            ..LoaderConfig::new(4)
        };
        let unread = Loader::new(ds.clone(), config.clone()).unwrap();
        let mut reports = 0;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for step in 0..9 {
            let (epoch, b) = (step / 4, (step % 4) as usize);
            let want = read.batch(epoch, b).unwrap();
            let mut got = unread.batch(epoch, b).unwrap();
            assert!(got.unread && got.images.is_empty() && got.bytes.is_none());
            let samples = loop {
                let samples = read_at(worker.as_ref(), epoch, &got.indices).unwrap();
                if samples.unreadable.is_empty() {
                    break samples;
                }
                for (index, why) in &samples.unreadable {
                    assert!(why.contains("1.jpg"), "{why}");
                    unread.mark_unreadable(*index, why);
                }
                reports += 1;
                got = unread.batch(epoch, b).unwrap();
            };
            assert_eq!((&got.indices, &got.labels), (&want.indices, &want.labels));
            assert_eq!(samples.labels, want.labels);
            assert_eq!(bits(&samples.values), bits(&want.images), "step {step}");
        }
        assert_eq!(reports, 1, "a sample known unreadable is not read again");
        assert!(read.skipped().count > 1);
        assert_eq!(read.skipped(), unread.skipped());

        // strict data: the worker's error ends the batch; other files are refused
        let strict = LoaderConfig {
            bad_samples: BadSamples::Fail,
            ..config
        };
        let strict = Loader::new(ds, strict).unwrap();
        let bad = (0..worker.num_samples())
            .find(|&i| read_at(worker.as_ref(), 0, &[i]).unwrap().unreadable.len() == 1)
            .unwrap();
        strict.mark_unreadable(bad, "b/1.jpg: gone");
        let err = (0..4).find_map(|b| strict.batch(0, b).err()).unwrap();
        assert_eq!(err.to_string(), "b/1.jpg: gone");
        let other = DataSource {
            samples: source.samples + 1,
            ..source
        };
        let err = other.open().err().unwrap().to_string();
        assert!(err.contains("every host must read the same files"), "{err}");
    }

    #[test]
    fn too_many_classes_for_the_model() {
        let dir = make_folder();
        let spec = format!("folder:{}", dir.path().display());
        assert!(matches!(
            super::super::open(&spec, [3, 4, 4], 1, 0, Transforms::PLAIN),
            Err(DataError::TooManyClasses {
                dataset_classes: 2,
                model_classes: 1,
                ..
            })
        ));
    }
}
