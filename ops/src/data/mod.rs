//! Datasets and a prefetching batch loader.
//!
//! A [`Dataset`] produces one normalised CHW f32 image and its label at a time, at the image size the
//! model asks for. [`Loader`] turns a dataset into batches in a seeded per-epoch order, assembling each
//! batch in parallel on a background thread a few batches ahead of the training loop.
//!
//! Everything is deterministic: sample `i` of a dataset is a pure function of its source (and seed), and
//! batch `b` of epoch `e` is a pure function of `(seed, e, b)`, however many threads decode it.

mod cifar10;
mod feed;
mod folder;
mod source;
mod synthetic;
mod transform;

pub use cifar10::Cifar10;
pub use feed::{BatchFeed, FedBatch, FeedShape, read_ahead};
pub use folder::{Census, ImageFolder, has_image_extension};
pub use source::{DataSource, ReadSamples, read_at};
pub use synthetic::{Synthetic, SyntheticBatch, factors_per_sample};
pub use transform::{Crop, Geometry, Normalization, Normalize, Transforms, render_crop};

use crate::rng::{Rng, hash};
use crate::shape::Shape;
use crossbeam_channel::{Receiver, Sender};
use rayon::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// `[channels, height, width]` of one image.
pub type ImageShape = [usize; 3];

/// Samples in a bare `synthetic` spec: a few hundred batches per epoch at typical batch sizes.
pub const DEFAULT_SYNTHETIC_SAMPLES: usize = 8192;

/// The CLI spec forms [`open`] accepts, for error messages and help text.
pub const SPEC_FORMS: &str = "synthetic, synthetic:N, cifar10:DIR_OR_FILE, folder:DIR";

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: {len} bytes is not a whole number of {record_len}-byte CIFAR-10 records \
         (1 label byte + 3072 pixel bytes); the last {trailing} bytes from offset {offset} are a partial record"
    )]
    CifarFileSize {
        path: PathBuf,
        len: u64,
        record_len: usize,
        trailing: u64,
        offset: u64,
    },
    #[error(
        "{path}: record {record} (byte offset {offset}) has label {label}; CIFAR-10 labels are 0..=9"
    )]
    CifarLabel {
        path: PathBuf,
        record: usize,
        offset: u64,
        label: u8,
    },
    #[error(
        "{dir}: no CIFAR-10 training files (data_batch_1.bin .. data_batch_5.bin); pass a .bin file to use another split"
    )]
    NoCifarFiles { dir: PathBuf },
    #[error("{path}: cannot decode image: {source}")]
    Decode {
        path: PathBuf,
        #[source]
        source: image::ImageError,
    },
    #[error("{root}: no class subfolders (expected one folder of JPEG/PNG images per class)")]
    NoClasses { root: PathBuf },
    #[error("{dir}: class folder has no JPEG or PNG images")]
    EmptyClass { dir: PathBuf },
    #[error("unknown dataset spec `{spec}`; valid forms: {SPEC_FORMS}")]
    UnknownSpec { spec: String },
    #[error("invalid dataset spec `{spec}`: {reason}")]
    InvalidSpec { spec: String, reason: String },
    #[error(
        "{dataset} has {dataset_classes} classes but the model has only {model_classes} outputs"
    )]
    TooManyClasses {
        dataset: String,
        dataset_classes: usize,
        model_classes: usize,
    },
    #[error("{dataset} provides 1 (grey) or 3 (RGB) channels, not {channels}")]
    UnsupportedChannels { dataset: String, channels: usize },
    #[error("{dataset} produces images of [C, H, W] {found:?}, but the model takes {expected:?}")]
    ImageShapeMismatch {
        dataset: String,
        found: ImageShape,
        expected: ImageShape,
    },
    #[error("invalid image shape {shape:?}: every extent must be positive")]
    InvalidImageShape { shape: ImageShape },
    #[error("sample index {index} is out of range for a dataset of {len} samples")]
    IndexOutOfRange { index: usize, len: usize },
    #[error("batch {batch} is out of range for an epoch of {batches} batches")]
    BatchOutOfRange { batch: usize, batches: usize },
    #[error("sample buffer holds {actual} values but one image is {expected}")]
    BufferSize { expected: usize, actual: usize },
    #[error("invalid data configuration: {0}")]
    Config(String),
    /// A sample another process could not read, with the error it gave.
    #[error("{why}")]
    ReadElsewhere { index: usize, why: String },
    #[error("{feed}: batch {batch}: {reason}")]
    FeedBatch {
        feed: String,
        batch: u64,
        reason: String,
    },
    #[error(
        "{feed} ended after {batches} batch(es), but the run trains {wanted} steps (give fewer steps, or more batches)"
    )]
    FeedEnded {
        feed: String,
        batches: u64,
        wanted: u64,
    },
    #[error("the data loader thread panicked")]
    LoaderPanicked,
}

/// A source of labelled images, all of one shape.
pub trait Dataset: Send + Sync {
    fn num_samples(&self) -> usize;

    /// `[C, H, W]` of every sample, as requested when the dataset was opened.
    fn image_shape(&self) -> ImageShape;

    /// Labels are in `0..num_classes()`.
    fn num_classes(&self) -> usize;

    /// Writes sample `index` as it is seen in `epoch` (a random crop or flip differs between
    /// epochs) as a CHW image (normalised to roughly zero mean, unit scale) into `out`, which must
    /// hold exactly `C·H·W` values, and returns its label.
    fn sample(&self, index: usize, epoch: u64, out: &mut [f32]) -> Result<u32, DataError>;

    /// Where each value of a sample is one of its bytes through a per-channel map (an image
    /// resampled in 8 bits, then normalised): that map. [`Dataset::sample_bytes`] then writes
    /// the bytes, a quarter of the values' size, for a consumer that sends samples on.
    fn byte_normalization(&self) -> Option<Normalization> {
        None
    }

    /// Writes sample `index` as [`Dataset::sample`] sees it in `epoch`, as its CHW bytes before
    /// [`Dataset::byte_normalization`] (which the dataset must have), into `out` of `C·H·W`
    /// bytes, and returns its label.
    fn sample_bytes(&self, index: usize, epoch: u64, out: &mut [u8]) -> Result<u32, DataError> {
        let _ = (index, epoch, out);
        Err(DataError::Config(format!(
            "{}: its samples are not 8-bit images",
            self.describe()
        )))
    }

    /// Sample `index`'s label, where it is known without reading the sample (a folder's
    /// class, a CIFAR-10 record's byte): what a driver sends workers that read the pixels.
    fn label(&self, index: usize) -> Option<u32> {
        let _ = index;
        None
    }

    /// A one-line description for logs, e.g. `cifar10 data/cifar (50000 samples)`.
    fn describe(&self) -> String;

    /// What opening the dataset found in its files (an image folder's), where it read files.
    fn census(&self) -> Option<&Census> {
        None
    }

    /// The mean and std its images are normalised with, where it reads image files: what
    /// scoring a model trained on it must use again.
    fn normalization(&self) -> Option<Normalize> {
        None
    }

    /// The dataset as [`Synthetic`] data, whose batches a device can draw itself
    /// ([`Synthetic::describe_batch`]).
    fn as_synthetic(&self) -> Option<&Synthetic> {
        None
    }

    /// The same samples through other transforms, where the dataset applies transforms (its
    /// files read once: the held-out part of a split is scored through the evaluation recipe).
    fn seen_through(&self, _transforms: Transforms) -> Option<Arc<dyn Dataset>> {
        None
    }

    /// Values in one sample: `C·H·W`.
    fn sample_len(&self) -> usize {
        self.image_shape().iter().product()
    }
}

/// Where a run's samples come from: the spec forms of [`SPEC_FORMS`] (`FromStr`, and `Display`
/// back to the spec), or a dataset of the caller's own.
#[derive(Clone)]
pub enum Data {
    /// Seeded synthetic images ([`Synthetic`]) of this many samples.
    Synthetic { samples: usize },
    /// The CIFAR-10 binary release: its folder, or one `.bin` file of it.
    Cifar10(PathBuf),
    /// A folder of class subfolders of JPEG/PNG images.
    Folder(PathBuf),
    /// A dataset of the caller's own, which must produce the model's image shape.
    Dataset(Arc<dyn Dataset>),
    /// Whole batches of the caller's, taken in the order given ([`BatchFeed`]).
    Feed(Arc<dyn BatchFeed>),
}

impl Default for Data {
    fn default() -> Data {
        Data::Synthetic {
            samples: DEFAULT_SYNTHETIC_SAMPLES,
        }
    }
}

impl std::fmt::Debug for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Data({self})")
    }
}

impl std::fmt::Display for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Data::Synthetic { samples } if *samples == DEFAULT_SYNTHETIC_SAMPLES => {
                f.write_str("synthetic")
            }
            Data::Synthetic { samples } => write!(f, "synthetic:{samples}"),
            Data::Cifar10(path) => write!(f, "cifar10:{}", path.display()),
            Data::Folder(dir) => write!(f, "folder:{}", dir.display()),
            Data::Dataset(dataset) => f.write_str(&dataset.describe()),
            Data::Feed(feed) => f.write_str(&feed.describe()),
        }
    }
}

impl std::str::FromStr for Data {
    type Err = DataError;

    fn from_str(spec: &str) -> Result<Data, DataError> {
        let (kind, arg) = match spec.split_once(':') {
            Some((kind, arg)) => (kind, Some(arg)),
            None => (spec, None),
        };
        let invalid = |reason: &str| DataError::InvalidSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        Ok(match (kind, arg) {
            ("synthetic", None) => Data::default(),
            ("synthetic", Some(n)) => Data::Synthetic {
                samples: n
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| invalid("N must be a positive sample count"))?,
            },
            ("cifar10", Some(path)) if !path.is_empty() => Data::Cifar10(path.into()),
            ("folder", Some(dir)) if !dir.is_empty() => Data::Folder(dir.into()),
            ("cifar10" | "folder", _) => return Err(invalid("a path is required after the colon")),
            _ => {
                return Err(DataError::UnknownSpec {
                    spec: spec.to_string(),
                });
            }
        })
    }
}

impl Data {
    /// The transforms a run scores held-out samples through: torchvision's evaluation recipe for
    /// a folder of photographs (resize, centre crop), the whole image otherwise.
    pub fn eval_transforms(&self) -> Transforms {
        match self {
            Data::Folder(_) => Transforms::EVAL,
            _ => Transforms::PLAIN,
        }
    }

    /// The transforms a run applies unless told otherwise: torchvision's training recipe for a
    /// folder of photographs; a mirror for CIFAR-10, whose 32×32 images a random resized crop
    /// would cut to a few pixels; none for data of no source images.
    pub fn default_transforms(&self) -> Transforms {
        match self {
            Data::Folder(_) => Transforms::TRAIN,
            Data::Cifar10(_) => Transforms {
                flip: true,
                ..Transforms::PLAIN
            },
            Data::Synthetic { .. } | Data::Dataset(_) | Data::Feed(_) => Transforms::PLAIN,
        }
    }

    /// Opens the dataset, producing images of shape `image` for a model with `classes` outputs,
    /// through `transforms` (photographs only: synthetic data and the caller's own are as they
    /// are); `seed` drives the synthetic data and the random transforms. A dataset of more
    /// classes than the model has outputs, or (the caller's own) of another image shape, is
    /// refused.
    pub fn open(
        &self,
        image: ImageShape,
        classes: usize,
        seed: u64,
        transforms: Transforms,
    ) -> Result<Arc<dyn Dataset>, DataError> {
        self.open_reporting(image, classes, seed, transforms, &())
    }

    /// [`Data::open`], telling `progress` how far the check of a folder's files has come.
    pub fn open_reporting(
        &self,
        image: ImageShape,
        classes: usize,
        seed: u64,
        transforms: Transforms,
        progress: &dyn OpenProgress,
    ) -> Result<Arc<dyn Dataset>, DataError> {
        transforms.check()?;
        if transforms != Transforms::PLAIN
            && matches!(
                self,
                Data::Synthetic { .. } | Data::Dataset(_) | Data::Feed(_)
            )
        {
            return Err(DataError::Config(format!(
                "{self} is not read from image files: crops, flips and normalisation apply to \
                 folder: and cifar10: data"
            )));
        }
        let dataset: Arc<dyn Dataset> = match self {
            Data::Synthetic { samples } => {
                Arc::new(Synthetic::new(seed, *samples, classes, image)?)
            }
            Data::Cifar10(path) => Arc::new(Cifar10::open(path, image)?.with(transforms, seed)),
            Data::Folder(dir) => {
                Arc::new(ImageFolder::open_reporting(dir, image, progress)?.with(transforms, seed))
            }
            Data::Feed(feed) => {
                return Err(DataError::Config(format!(
                    "{} hands over whole batches: it is read batch by batch, not opened as \
                     samples (held-out data and splits need a dataset)",
                    feed.describe()
                )));
            }
            Data::Dataset(dataset) => {
                if dataset.image_shape() != image {
                    return Err(DataError::ImageShapeMismatch {
                        dataset: dataset.describe(),
                        found: dataset.image_shape(),
                        expected: image,
                    });
                }
                dataset.clone()
            }
        };
        if dataset.num_classes() > classes {
            return Err(DataError::TooManyClasses {
                dataset: dataset.describe(),
                dataset_classes: dataset.num_classes(),
                model_classes: classes,
            });
        }
        Ok(dataset)
    }
}

/// Told how far opening a dataset has come: `done` of the `total` image files found have had
/// their headers read. Called from the threads that read them.
pub trait OpenProgress: Send + Sync {
    fn checked(&self, done: usize, total: usize);
}

/// Nothing to tell.
impl OpenProgress for () {
    fn checked(&self, _: usize, _: usize) {}
}

/// Opens a dataset from a CLI spec (see [`SPEC_FORMS`] and [`Data::open`]).
pub fn open(
    spec: &str,
    image: ImageShape,
    classes: usize,
    seed: u64,
    transforms: Transforms,
) -> Result<Arc<dyn Dataset>, DataError> {
    spec.parse::<Data>()?.open(image, classes, seed, transforms)
}

/// Some samples of a dataset, in the order given: a held-out split or its complement.
pub struct Subset {
    inner: Arc<dyn Dataset>,
    indices: Vec<usize>,
    name: String,
}

impl Subset {
    /// The samples `indices` of `inner` (each below its count), described as `name`.
    pub fn new(
        inner: Arc<dyn Dataset>,
        indices: Vec<usize>,
        name: &str,
    ) -> Result<Subset, DataError> {
        let len = inner.num_samples();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(DataError::IndexOutOfRange { index, len });
        }
        Ok(Subset {
            name: format!("{name}, {} samples of {}", indices.len(), inner.describe()),
            inner,
            indices,
        })
    }
}

impl Subset {
    /// The index in the whole dataset of this subset's sample `index`.
    fn inner_index(&self, index: usize) -> Result<usize, DataError> {
        let len = self.indices.len();
        self.indices
            .get(index)
            .copied()
            .ok_or(DataError::IndexOutOfRange { index, len })
    }
}

impl Dataset for Subset {
    fn num_samples(&self) -> usize {
        self.indices.len()
    }

    fn image_shape(&self) -> ImageShape {
        self.inner.image_shape()
    }

    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }

    fn sample(&self, index: usize, epoch: u64, out: &mut [f32]) -> Result<u32, DataError> {
        self.inner.sample(self.inner_index(index)?, epoch, out)
    }

    fn byte_normalization(&self) -> Option<Normalization> {
        self.inner.byte_normalization()
    }

    fn sample_bytes(&self, index: usize, epoch: u64, out: &mut [u8]) -> Result<u32, DataError> {
        self.inner
            .sample_bytes(self.inner_index(index)?, epoch, out)
    }

    fn label(&self, index: usize) -> Option<u32> {
        self.inner.label(self.inner_index(index).ok()?)
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn census(&self) -> Option<&Census> {
        self.inner.census()
    }

    fn normalization(&self) -> Option<Normalize> {
        self.inner.normalization()
    }
}

/// A seeded split of `n` samples: `fraction` of them (rounded, at least one, never all) held
/// out, the rest for training, each list sorted.
pub fn split(n: usize, fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>), DataError> {
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(DataError::Config(format!(
            "a held-out fraction is between 0 and 1, not {fraction}"
        )));
    }
    let held = ((n as f64 * fraction).round() as usize).max(1);
    if held >= n {
        return Err(DataError::Config(format!(
            "holding out {fraction} of {n} samples leaves none to train on"
        )));
    }
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Rng::new(hash(&[seed, SPLIT_STREAM]));
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let (mut held_out, mut train) = (order[..held].to_vec(), order[held..].to_vec());
    held_out.sort_unstable();
    train.sort_unstable();
    Ok((train, held_out))
}

/// Separates the split's random stream from the epochs' orders.
const SPLIT_STREAM: u64 = 0x7370_6c69_745f_7661;

/// A batch of consecutive samples in an epoch's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `N·C·H·W` values, sample-major (NCHW); empty where the batch is `synthetic`, `bytes` or
    /// `unread`.
    pub images: Vec<f32>,
    /// The images as their bytes instead of `images` ([`LoaderConfig::bytes`]).
    pub bytes: Option<ByteImages>,
    /// The samples were not read: `indices` and `labels` only ([`LoaderConfig::labels_only`]).
    pub unread: bool,
    /// The batch described for a device to draw, instead of `images`
    /// ([`LoaderConfig::describe_synthetic`]).
    pub synthetic: Option<SyntheticBatch>,
    pub labels: Vec<u32>,
    /// The dataset index of each sample.
    pub indices: Vec<usize>,
    pub epoch: u64,
    /// Position of this batch within its epoch.
    pub batch: usize,
    pub image: ImageShape,
}

/// A batch's images as their bytes and the map that makes them values ([`LoaderConfig::bytes`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ByteImages {
    /// `N·C·H·W` bytes, sample-major.
    pub bytes: Vec<u8>,
    /// `[C, H, W]` of each image.
    pub image: ImageShape,
    pub normalization: Normalization,
}

impl ByteImages {
    /// The values the bytes stand for.
    pub fn values(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.bytes.len()];
        self.normalization
            .values_of(self.image, &self.bytes, &mut out);
        out
    }
}

impl Batch {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// NCHW shape of [`Batch::images`].
    pub fn shape(&self) -> Shape {
        let [c, h, w] = self.image;
        Shape::nchw(self.len(), c, h, w)
    }
}

#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub batch_size: usize,
    /// Seeded reshuffle every epoch; otherwise dataset order.
    pub shuffle: bool,
    /// Drop the final partial batch, so every batch has `batch_size` samples (what a fixed parallel
    /// strategy needs); otherwise it is yielded shorter.
    pub drop_last: bool,
    pub seed: u64,
    /// Batches assembled ahead of the consumer.
    pub prefetch: usize,
    /// Batches of [`Synthetic`] data come described ([`Batch::synthetic`]) instead of drawn,
    /// for a device that draws them itself; other datasets' batches come as images.
    pub describe_synthetic: bool,
    /// Batches of a dataset of 8-bit images ([`Dataset::byte_normalization`]) come as their bytes
    /// ([`Batch::bytes`]), for a consumer that sends them on; other datasets' come as images.
    pub bytes: bool,
    /// Batches of a dataset that knows its labels ([`Dataset::label`]) come with their indices
    /// and labels only ([`Batch::unread`]), for workers that read the samples themselves
    /// ([`DataSource`]) and report those they cannot ([`Loader::mark_unreadable`]).
    pub labels_only: bool,
    /// What becomes of a sample that cannot be read or decoded.
    pub bad_samples: BadSamples,
}

/// What a loader does with a sample that cannot be read or decoded (noted in
/// [`Loader::skipped`] unless it fails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadSamples {
    /// Its batch fails with its error.
    Fail,
    /// The next sample of the epoch's order after the batch that can be read takes its place:
    /// every batch stays whole, as a fixed parallel strategy needs.
    Replace,
    /// Its batch comes without it: each readable sample once, as an evaluation counts them.
    Drop,
}

impl LoaderConfig {
    /// Shuffled, full batches only, seed 0, two batches of prefetch.
    pub fn new(batch_size: usize) -> LoaderConfig {
        LoaderConfig {
            batch_size,
            shuffle: true,
            drop_last: true,
            seed: 0,
            prefetch: 2,
            describe_synthetic: false,
            bytes: false,
            labels_only: false,
            bad_samples: BadSamples::Replace,
        }
    }
}

/// Cuts a dataset into batches; [`Loader::epoch`] and [`Loader::steps`] prefetch them on a background
/// thread, [`Loader::batch`] builds one synchronously (identical contents).
#[derive(Clone)]
pub struct Loader {
    dataset: Arc<dyn Dataset>,
    config: LoaderConfig,
    skipped: Arc<Skipped>,
    /// Samples others could not read, by index, with why: an unread batch replaces them as a
    /// read one replaces a sample that fails.
    unreadable: Arc<std::sync::Mutex<std::collections::HashMap<usize, String>>>,
}

/// Samples skipped because they could not be read: taken only when one fails, never on the
/// path of a sample that decodes.
#[derive(Debug, Default)]
struct Skipped(std::sync::Mutex<SkippedSamples>);

/// The samples a loader skipped so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SkippedSamples {
    /// Each time a sample was skipped (a file fails in every epoch that reads it).
    pub count: u64,
    /// Each distinct sample's first failure, by dataset index, in the order they failed.
    pub first: Vec<(usize, String)>,
}

impl Loader {
    pub fn new(dataset: Arc<dyn Dataset>, config: LoaderConfig) -> Result<Loader, DataError> {
        if config.batch_size == 0 {
            return Err(DataError::Config("batch size must be positive".into()));
        }
        if config.prefetch == 0 {
            return Err(DataError::Config("prefetch depth must be positive".into()));
        }
        if dataset.sample_len() == 0 {
            return Err(DataError::InvalidImageShape {
                shape: dataset.image_shape(),
            });
        }
        let loader = Loader {
            dataset,
            config,
            skipped: Arc::default(),
            unreadable: Arc::default(),
        };
        if loader.batches_per_epoch() == 0 {
            return Err(DataError::Config(format!(
                "{} is smaller than one batch of {}",
                loader.dataset.describe(),
                loader.config.batch_size
            )));
        }
        Ok(loader)
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Notes that sample `index` could not be read elsewhere (`why`): the batches built from now
    /// on replace it (or fail, or drop it) as [`BadSamples`] says, as if it had failed here.
    pub fn mark_unreadable(&self, index: usize, why: &str) {
        self.unreadable
            .lock()
            .expect("unreadable samples")
            .insert(index, why.to_string());
    }

    /// The samples skipped so far, by every batch this loader (and its clones) built.
    pub fn skipped(&self) -> SkippedSamples {
        self.skipped.0.lock().expect("skipped samples").clone()
    }

    pub fn batches_per_epoch(&self) -> usize {
        let n = self.dataset.num_samples();
        let full = n / self.config.batch_size;
        if self.config.drop_last || n.is_multiple_of(self.config.batch_size) {
            full
        } else {
            full + 1
        }
    }

    /// Batch `batch` of epoch `epoch`, built on the calling thread.
    pub fn batch(&self, epoch: u64, batch: usize) -> Result<Batch, DataError> {
        let batches = self.batches_per_epoch();
        if batch >= batches {
            return Err(DataError::BatchOutOfRange { batch, batches });
        }
        let order = self.epoch_order(epoch);
        assemble_batch(self, &order, epoch, batch, &AtomicBool::new(false))
    }

    /// The batches of one epoch, prefetched.
    pub fn epoch(&self, epoch: u64) -> Batches {
        let per_epoch = self.batches_per_epoch() as u64;
        let first = epoch * per_epoch;
        self.spawn(first, Some(first + per_epoch))
    }

    /// An endless stream of batches starting at global step `first_step` (step `s` is batch
    /// `s % batches_per_epoch()` of epoch `s / batches_per_epoch()`), prefetched. Resuming a run at
    /// step `s` continues the exact sequence the interrupted run would have seen.
    pub fn steps(&self, first_step: u64) -> Batches {
        self.spawn(first_step, None)
    }

    /// The batches of global steps `first_step..end_step`, as [`Loader::steps`] numbers them:
    /// nothing past the end is built, so [`Loader::skipped`] counts only these.
    pub fn steps_until(&self, first_step: u64, end_step: u64) -> Batches {
        self.spawn(first_step, Some(end_step))
    }

    /// The order of dataset indices in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let n = self.dataset.num_samples();
        let mut order: Vec<usize> = (0..n).collect();
        if self.config.shuffle {
            // Fisher–Yates from a generator keyed by (seed, epoch) only, so any epoch can be rebuilt
            // without replaying the earlier ones.
            let mut rng = Rng::new(hash(&[self.config.seed, epoch]));
            for i in (1..n).rev() {
                order.swap(i, rng.below(i + 1));
            }
        }
        order
    }

    fn spawn(&self, first_step: u64, end_step: Option<u64>) -> Batches {
        let (sender, receiver) = crossbeam_channel::bounded(self.config.prefetch);
        let cancel = Arc::new(AtomicBool::new(false));
        let producer = Producer {
            loader: self.clone(),
            sender,
            cancel: Arc::clone(&cancel),
        };
        let handle = std::thread::Builder::new()
            .name("legion-data-loader".into())
            .spawn(move || producer.run(first_step, end_step))
            .expect("failed to spawn the data loader thread");
        Batches {
            receiver: Some(receiver),
            handle: Some(handle),
            cancel,
        }
    }
}

/// The background half of [`Batches`].
struct Producer {
    loader: Loader,
    sender: Sender<Result<Batch, DataError>>,
    cancel: Arc<AtomicBool>,
}

impl Producer {
    fn run(self, first_step: u64, end_step: Option<u64>) {
        let per_epoch = self.loader.batches_per_epoch() as u64;
        let mut order = Vec::new();
        let mut order_epoch = None;
        let mut step = first_step;
        while end_step.is_none_or(|end| step < end) {
            let epoch = step / per_epoch;
            if order_epoch != Some(epoch) {
                order = self.loader.epoch_order(epoch);
                order_epoch = Some(epoch);
            }
            let result = assemble_batch(
                &self.loader,
                &order,
                epoch,
                (step % per_epoch) as usize,
                &self.cancel,
            );
            if self.cancel.load(Ordering::Relaxed) {
                return;
            }
            let failed = result.is_err();
            // A send error means the consumer is gone: stop quietly.
            if self.sender.send(result).is_err() || failed {
                return;
            }
            step += 1;
        }
    }
}

/// Whether a sample's error is its file's (skipped unless the loader fails on it), not the
/// program's.
fn is_bad_sample(error: &DataError) -> bool {
    matches!(
        error,
        DataError::Io { .. } | DataError::Decode { .. } | DataError::ReadElsewhere { .. }
    )
}

/// Builds one batch, decoding its samples in parallel. A sample that cannot be read fails the
/// batch, is replaced or is dropped, as [`BadSamples`] says: the batch depends only on the
/// files. On failure, reports the error of the earliest failing sample, so
/// the error does not depend on thread timing.
fn assemble_batch(
    loader: &Loader,
    order: &[usize],
    epoch: u64,
    batch: usize,
    cancel: &AtomicBool,
) -> Result<Batch, DataError> {
    let (dataset, config) = (loader.dataset.as_ref(), &loader.config);
    let start = batch * config.batch_size;
    let end = (start + config.batch_size).min(order.len());
    let mut indices = order[start..end].to_vec();
    if config.describe_synthetic
        && let Some(synthetic) = dataset.as_synthetic()
    {
        let described = synthetic.describe_batch(&indices)?;
        return Ok(Batch {
            images: Vec::new(),
            bytes: None,
            unread: false,
            labels: described.labels.clone(),
            synthetic: Some(described),
            indices,
            epoch,
            batch,
            image: dataset.image_shape(),
        });
    }
    let image = dataset.image_shape();
    let labels_only = config.labels_only && dataset.label(0).is_some();
    let normalization = dataset.byte_normalization().filter(|_| config.bytes);
    let (images, bytes, labels) = match (labels_only, normalization) {
        (true, _) => {
            let unreadable = (loader.unreadable.lock())
                .expect("unreadable samples")
                .clone();
            let label_of = |index, _: &mut [()]| match unreadable.get(&index) {
                Some(why) => Err(DataError::ReadElsewhere {
                    index,
                    why: why.clone(),
                }),
                None => dataset.label(index).ok_or(DataError::IndexOutOfRange {
                    index,
                    len: dataset.num_samples(),
                }),
            };
            let (_, labels) = read_samples(loader, order, end, &mut indices, cancel, label_of)?;
            (Vec::new(), None, labels)
        }
        (false, Some(normalization)) => {
            let read = |index, out: &mut [u8]| dataset.sample_bytes(index, epoch, out);
            let (bytes, labels) = read_samples(loader, order, end, &mut indices, cancel, read)?;
            let bytes = ByteImages {
                bytes,
                image,
                normalization,
            };
            (Vec::new(), Some(bytes), labels)
        }
        (false, None) => {
            let read = |index, out: &mut [f32]| dataset.sample(index, epoch, out);
            let (images, labels) = read_samples(loader, order, end, &mut indices, cancel, read)?;
            (images, None, labels)
        }
    };
    Ok(Batch {
        images,
        bytes,
        unread: labels_only,
        labels,
        synthetic: None,
        indices,
        epoch,
        batch,
        image,
    })
}

/// Reads the samples `indices` (batch positions up to `end` of the epoch's `order`) with `read`
/// in parallel: their values (or bytes) and labels. A sample that cannot be read fails the batch,
/// is replaced or is dropped as the loader's [`BadSamples`] says (`indices` then names what was
/// read in its place, or loses it).
fn read_samples<T: Copy + Default + Send + Sync>(
    loader: &Loader,
    order: &[usize],
    end: usize,
    indices: &mut Vec<usize>,
    cancel: &AtomicBool,
    read: impl Fn(usize, &mut [T]) -> Result<u32, DataError> + Sync,
) -> Result<(Vec<T>, Vec<u32>), DataError> {
    let (dataset, config) = (loader.dataset.as_ref(), &loader.config);
    let sample_len = dataset.sample_len();
    let mut images = vec![T::default(); indices.len() * sample_len];
    let mut labels = vec![0u32; indices.len()];
    let failed: Vec<(usize, DataError)> = images
        .par_chunks_mut(sample_len)
        .zip(labels.par_iter_mut())
        .zip(indices.par_iter())
        .enumerate()
        .filter_map(|(slot, ((image, label), &index))| {
            if cancel.load(Ordering::Relaxed) {
                return None;
            }
            match read(index, image) {
                Ok(l) => {
                    *label = l;
                    None
                }
                Err(e) => Some((slot, e)),
            }
        })
        .collect();
    let mut substitutes = order.iter().cycle().skip(end);
    let mut dropped = Vec::new();
    for (slot, error) in failed {
        if config.bad_samples == BadSamples::Fail || !is_bad_sample(&error) {
            return Err(error);
        }
        loader.skipped.note(indices[slot], &error);
        if config.bad_samples == BadSamples::Drop {
            dropped.push(slot);
            continue;
        }
        let image = &mut images[slot * sample_len..][..sample_len];
        // Every sample of the epoch is tried at most once before the batch gives up.
        let mut tries = 0;
        loop {
            let Some(&index) = substitutes.next().filter(|_| tries < order.len()) else {
                return Err(DataError::Config(format!(
                    "{}: no sample of the epoch can be read (the last: {error})",
                    dataset.describe()
                )));
            };
            tries += 1;
            match read(index, image) {
                Ok(label) => {
                    (indices[slot], labels[slot]) = (index, label);
                    break;
                }
                Err(e) if is_bad_sample(&e) => loader.skipped.note(index, &e),
                Err(e) => return Err(e),
            }
        }
    }
    // Last first, so each slot still names its sample when it goes.
    for &slot in dropped.iter().rev() {
        indices.remove(slot);
        labels.remove(slot);
        images.drain(slot * sample_len..(slot + 1) * sample_len);
    }
    Ok((images, labels))
}

impl Skipped {
    fn note(&self, index: usize, error: &DataError) {
        let mut skipped = self.0.lock().expect("skipped samples");
        skipped.count += 1;
        if !skipped.first.iter().any(|&(i, _)| i == index) {
            skipped.first.push((index, error.to_string()));
        }
    }
}

/// Prefetched batches. Dropping it stops and joins the background thread (waiting at most for the
/// samples already being decoded).
pub struct Batches {
    receiver: Option<Receiver<Result<Batch, DataError>>>,
    handle: Option<JoinHandle<()>>,
    cancel: Arc<AtomicBool>,
}

impl Iterator for Batches {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let receiver = self.receiver.as_ref()?;
        match receiver.recv() {
            Ok(item) => Some(item),
            // The producer finished (or died): surface a panic once as an error, then end.
            Err(_) => {
                self.receiver = None;
                let panicked = self.handle.take().is_some_and(|h| h.join().is_err());
                panicked.then_some(Err(DataError::LoaderPanicked))
            }
        }
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        // Dropping the receiver unblocks a producer waiting on a full channel.
        self.receiver = None;
        if let Some(handle) = self.handle.take() {
            // A panic in the producer was already reported through `next` or is irrelevant now;
            // re-raising it in a destructor would abort.
            let _ = handle.join();
        }
    }
}

fn check_image_shape(image: ImageShape) -> Result<(), DataError> {
    if image.contains(&0) {
        return Err(DataError::InvalidImageShape { shape: image });
    }
    Ok(())
}

/// Checks a requested image shape for a dataset of photographs, which can be read as grey or RGB.
fn check_photo_shape(dataset: &str, image: ImageShape) -> Result<(), DataError> {
    check_image_shape(image)?;
    if image[0] != 1 && image[0] != 3 {
        return Err(DataError::UnsupportedChannels {
            dataset: dataset.to_string(),
            channels: image[0],
        });
    }
    Ok(())
}

/// Checks a sample's index and the length of the buffer it is written into.
fn check_sample_args(dataset: &dyn Dataset, index: usize, out: usize) -> Result<(), DataError> {
    let len = dataset.num_samples();
    if index >= len {
        return Err(DataError::IndexOutOfRange { index, len });
    }
    let expected = dataset.sample_len();
    if out != expected {
        return Err(DataError::BufferSize {
            expected,
            actual: out,
        });
    }
    Ok(())
}

/// ITU-R BT.601 luma weights, for datasets asked for one channel from RGB sources.
const LUMA_WEIGHTS: [f32; 3] = [0.299, 0.587, 0.114];

/// One output coordinate of a bilinear resample: the two source coordinates it blends and the weight
/// of the second.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Tap {
    lo: usize,
    hi: usize,
    frac: f32,
}

/// Bilinear taps along one axis with half-pixel centres (output pixel centres map onto the source
/// image's extent), clamped at the borders. Equal sizes give the identity.
fn bilinear_taps(src: usize, dst: usize) -> Vec<Tap> {
    let scale = src as f32 / dst as f32;
    (0..dst)
        .map(|i| {
            let x = ((i as f32 + 0.5) * scale - 0.5).clamp(0.0, (src - 1) as f32);
            let lo = x.floor() as usize;
            Tap {
                lo,
                hi: (lo + 1).min(src - 1),
                frac: x - lo as f32,
            }
        })
        .collect()
}

/// Bilinear taps along one axis over `extent` source pixels from `start` (half-pixel centres,
/// clamped at the image's borders), right to left where `flip`.
fn crop_taps(src: usize, start: f64, extent: f64, dst: usize, flip: bool) -> Vec<Tap> {
    let scale = extent / dst as f64;
    let mut taps: Vec<Tap> = (0..dst)
        .map(|i| {
            let x = (start + (i as f64 + 0.5) * scale - 0.5).clamp(0.0, (src - 1) as f64);
            let lo = x.floor() as usize;
            Tap {
                lo,
                hi: (lo + 1).min(src - 1),
                frac: (x - lo as f64) as f32,
            }
        })
        .collect();
    if flip {
        taps.reverse();
    }
    taps
}

/// Resamples one `src_width`-wide plane through precomputed row and column taps into `out`
/// (`rows.len() × cols.len()`), passing each interpolated value through `map`.
fn resample_plane<T: Copy + Into<f32>>(
    src: &[T],
    src_width: usize,
    rows: &[Tap],
    cols: &[Tap],
    out: &mut [f32],
    map: impl Fn(f32) -> f32,
) {
    for (row_tap, out_row) in rows.iter().zip(out.chunks_exact_mut(cols.len())) {
        let upper = &src[row_tap.lo * src_width..][..src_width];
        let lower = &src[row_tap.hi * src_width..][..src_width];
        for (col_tap, o) in cols.iter().zip(out_row) {
            let top = lerp(
                upper[col_tap.lo].into(),
                upper[col_tap.hi].into(),
                col_tap.frac,
            );
            let bottom = lerp(
                lower[col_tap.lo].into(),
                lower[col_tap.hi].into(),
                col_tap.frac,
            );
            *o = map(lerp(top, bottom, row_tap.frac));
        }
    }
}

fn lerp(a: f32, b: f32, t: f32) -> f32 {
    a + (b - a) * t
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    /// Sample `i` is the constant image `i` with label `i % 3`; optionally slow or failing.
    struct Counting {
        len: usize,
        delay: Duration,
        fail_at: Option<usize>,
        calls: AtomicUsize,
    }

    impl Counting {
        fn new(len: usize) -> Counting {
            Counting {
                len,
                delay: Duration::ZERO,
                fail_at: None,
                calls: AtomicUsize::new(0),
            }
        }
    }

    impl Dataset for Counting {
        fn num_samples(&self) -> usize {
            self.len
        }
        fn image_shape(&self) -> ImageShape {
            [1, 2, 2]
        }
        fn num_classes(&self) -> usize {
            3
        }
        fn sample(&self, index: usize, _: u64, out: &mut [f32]) -> Result<u32, DataError> {
            check_sample_args(self, index, out.len())?;
            self.calls.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            if self.fail_at == Some(index) {
                return Err(DataError::Io {
                    path: PathBuf::from(format!("sample-{index}")),
                    source: std::io::Error::other("unreadable"),
                });
            }
            out.fill(index as f32);
            Ok((index % 3) as u32)
        }
        fn describe(&self) -> String {
            format!("counting ({} samples)", self.len)
        }
    }

    fn loader(dataset: Counting, config: LoaderConfig) -> Loader {
        Loader::new(Arc::new(dataset), config).unwrap()
    }

    #[test]
    fn bilinear_taps_identity_and_half_pixel_centres() {
        for t in bilinear_taps(5, 5).iter().enumerate() {
            assert_eq!(
                *t.1,
                Tap {
                    lo: t.0,
                    hi: (t.0 + 1).min(4),
                    frac: 0.0
                }
            );
        }
        // 4 → 2: each output sits halfway between a pair of source pixels.
        let down = bilinear_taps(4, 2);
        assert_eq!(
            down[0],
            Tap {
                lo: 0,
                hi: 1,
                frac: 0.5
            }
        );
        assert_eq!(
            down[1],
            Tap {
                lo: 2,
                hi: 3,
                frac: 0.5
            }
        );
        // 2 → 4: borders clamp, the middle interpolates at quarter positions.
        let up = bilinear_taps(2, 4);
        assert_eq!(
            up[0],
            Tap {
                lo: 0,
                hi: 1,
                frac: 0.0
            }
        );
        assert_eq!(
            up[1],
            Tap {
                lo: 0,
                hi: 1,
                frac: 0.25
            }
        );
        assert_eq!(
            up[2],
            Tap {
                lo: 0,
                hi: 1,
                frac: 0.75
            }
        );
        assert_eq!(
            up[3],
            Tap {
                lo: 1,
                hi: 1,
                frac: 0.0
            }
        );
    }

    #[test]
    fn resample_plane_reproduces_constants_and_ramps() {
        let src: Vec<u8> = (0..4u8).flat_map(|_| [10, 20, 30, 40]).collect();
        let mut out = vec![0.0; 2 * 2];
        resample_plane(
            &src,
            4,
            &bilinear_taps(4, 2),
            &bilinear_taps(4, 2),
            &mut out,
            |v| v,
        );
        assert_eq!(out, [15.0, 35.0, 15.0, 35.0]);

        let constant = [7u8; 9];
        let mut big = vec![0.0; 8 * 5];
        resample_plane(
            &constant,
            3,
            &bilinear_taps(3, 8),
            &bilinear_taps(3, 5),
            &mut big,
            |v| v * 2.0,
        );
        assert!(big.iter().all(|&v| v == 14.0));

        let same: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let mut copy = vec![0.0; 6];
        resample_plane(
            &same,
            3,
            &bilinear_taps(2, 2),
            &bilinear_taps(3, 3),
            &mut copy,
            |v| v,
        );
        assert_eq!(copy, same);
    }

    #[test]
    fn epochs_are_seeded_permutations() {
        let mut config = LoaderConfig::new(4);
        config.seed = 11;
        let l = loader(Counting::new(10), config.clone());
        let e0 = l.epoch_order(0);
        let mut sorted = e0.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_ne!(e0, l.epoch_order(1));
        assert_eq!(e0, loader(Counting::new(10), config.clone()).epoch_order(0));
        config.seed = 12;
        assert_ne!(e0, loader(Counting::new(10), config).epoch_order(0));
    }

    #[test]
    fn prefetched_batches_match_synchronous_ones() {
        let mut config = LoaderConfig::new(3);
        config.seed = 5;
        let l = loader(Counting::new(10), config);
        assert_eq!(l.batches_per_epoch(), 3);
        let batches: Vec<Batch> = l.epoch(2).map(Result::unwrap).collect();
        assert_eq!(batches.len(), 3);
        for (b, batch) in batches.iter().enumerate() {
            assert_eq!(*batch, l.batch(2, b).unwrap());
            assert_eq!(batch.epoch, 2);
            assert_eq!(batch.shape(), Shape::nchw(3, 1, 2, 2));
            for (k, &index) in batch.indices.iter().enumerate() {
                assert_eq!(batch.labels[k], (index % 3) as u32);
                assert!(
                    batch.images[k * 4..][..4]
                        .iter()
                        .all(|&v| v == index as f32)
                );
            }
        }
        // A second loader with the same config yields the same stream.
        let again: Vec<Batch> = loader(Counting::new(10), l.config().clone())
            .epoch(2)
            .map(Result::unwrap)
            .collect();
        assert_eq!(again, batches);
    }

    /// A loader describing synthetic batches yields the batches a drawing one does, described:
    /// same samples, labels and (rendered) values; other datasets still come as images.
    #[test]
    fn described_synthetic_batches_render_to_the_drawn_ones() {
        let data: Arc<dyn Dataset> = Arc::new(Synthetic::new(3, 40, 5, [2, 7, 6]).unwrap());
        let drawing = Loader::new(data.clone(), LoaderConfig::new(4)).unwrap();
        let describing = Loader::new(
            data,
            LoaderConfig {
                describe_synthetic: true,
                ..LoaderConfig::new(4)
            },
        )
        .unwrap();
        let drawn: Vec<Batch> = drawing.steps(7).take(4).map(Result::unwrap).collect();
        let described: Vec<Batch> = describing.steps(7).take(4).map(Result::unwrap).collect();
        for (drawn, described) in drawn.iter().zip(&described) {
            assert!(described.images.is_empty());
            assert_eq!(described.indices, drawn.indices);
            assert_eq!(described.labels, drawn.labels);
            assert_eq!(described.shape(), drawn.shape());
            let batch = described.synthetic.as_ref().expect("described");
            assert_eq!(batch.labels, drawn.labels);
            let mut images = vec![f32::NAN; drawn.images.len()];
            batch.render(&mut images);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&images), bits(&drawn.images));
        }
        let counting = loader(
            Counting::new(10),
            LoaderConfig {
                describe_synthetic: true,
                ..LoaderConfig::new(3)
            },
        );
        let batch = counting.batch(0, 0).unwrap();
        assert!(batch.synthetic.is_none());
        assert_eq!(batch.images.len(), 12);
    }

    #[test]
    fn steps_cross_epoch_boundaries_and_resume_exactly() {
        let l = loader(Counting::new(8), LoaderConfig::new(3));
        assert_eq!(l.batches_per_epoch(), 2);
        let run: Vec<Batch> = l.steps(0).take(7).map(Result::unwrap).collect();
        let positions: Vec<(u64, usize)> = run.iter().map(|b| (b.epoch, b.batch)).collect();
        assert_eq!(
            positions,
            [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
        );
        let resumed: Vec<Batch> = l.steps(3).take(4).map(Result::unwrap).collect();
        assert_eq!(resumed, run[3..]);
    }

    #[test]
    fn sequential_order_keeps_the_short_last_batch_when_asked() {
        let mut config = LoaderConfig::new(4);
        config.shuffle = false;
        config.drop_last = false;
        let l = loader(Counting::new(10), config);
        let indices: Vec<Vec<usize>> = l.epoch(0).map(|b| b.unwrap().indices).collect();
        assert_eq!(indices, [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        assert!(matches!(
            l.batch(0, 3),
            Err(DataError::BatchOutOfRange {
                batch: 3,
                batches: 3
            })
        ));
    }

    #[test]
    fn a_split_is_seeded_disjoint_and_whole() {
        let (train, held) = split(10, 0.2, 4).unwrap();
        assert_eq!((train.len(), held.len()), (8, 2));
        let mut all: Vec<usize> = train.iter().chain(&held).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(split(10, 0.2, 4).unwrap(), (train, held.clone()));
        assert_ne!(split(10, 0.2, 5).unwrap().1, held);
        assert!(split(10, 0.0, 4).is_err() && split(1, 0.5, 4).is_err());

        let subset = Subset::new(Arc::new(Counting::new(10)), held.clone(), "held out").unwrap();
        let mut x = vec![0.0; 4];
        subset.sample(1, 0, &mut x).unwrap();
        assert_eq!(x[0], held[1] as f32);
        assert!(Subset::new(Arc::new(Counting::new(3)), vec![3], "x").is_err());
    }

    #[test]
    fn an_unreadable_sample_is_skipped_for_the_next_one_after_the_batch_and_counted() {
        let mut dataset = Counting::new(12);
        dataset.fail_at = Some(5);
        let mut config = LoaderConfig::new(4);
        config.shuffle = false;
        let l = loader(dataset, config);
        let batches: Vec<Batch> = l.epoch(0).map(Result::unwrap).collect();
        // Sample 5's place in batch 1 goes to sample 8, the first after the batch.
        assert_eq!(batches[1].indices, [4, 8, 6, 7]);
        assert_eq!(batches[1].images[4..8], [8.0; 4]);
        assert_eq!(batches[1].labels, [1, 2, 0, 1]);
        let skipped = l.skipped();
        assert_eq!(skipped.count, 1);
        assert_eq!(skipped.first.len(), 1);
        assert!(skipped.first[0].1.contains("sample-5"), "{skipped:?}");
        // Built again, the batch is the same and the sample counted once more.
        assert_eq!(l.batch(0, 1).unwrap(), batches[1]);
        assert_eq!((l.skipped().count, l.skipped().first.len()), (2, 1));
    }

    #[test]
    fn a_dropped_sample_leaves_its_batch_shorter() {
        let mut dataset = Counting::new(12);
        dataset.fail_at = Some(5);
        let mut config = LoaderConfig::new(4);
        config.shuffle = false;
        config.bad_samples = BadSamples::Drop;
        let l = loader(dataset, config);
        let b = l.batch(0, 1).unwrap();
        assert_eq!((b.indices, b.labels), (vec![4, 6, 7], vec![1, 0, 1]));
        assert_eq!(b.images, [[4.0; 4], [6.0; 4], [7.0; 4]].concat());
        assert_eq!(l.skipped().count, 1);
    }

    #[test]
    fn dataset_errors_surface_from_the_iterator_when_strict() {
        let mut dataset = Counting::new(12);
        dataset.fail_at = Some(5);
        let mut config = LoaderConfig::new(4);
        config.shuffle = false;
        config.bad_samples = BadSamples::Fail;
        let mut batches = loader(dataset, config).epoch(0);
        assert!(batches.next().unwrap().is_ok());
        let err = batches.next().unwrap().unwrap_err();
        assert!(err.to_string().contains("sample-5"), "{err}");
        assert!(batches.next().is_none());
    }

    #[test]
    fn dropping_stops_the_producer_promptly() {
        let mut dataset = Counting::new(1000);
        dataset.delay = Duration::from_millis(2);
        let dataset = Arc::new(dataset);
        let l = Loader::new(dataset.clone(), LoaderConfig::new(8)).unwrap();
        let mut stream = l.steps(0);
        stream.next().unwrap().unwrap();
        // Let the producer fill the channel and block on it.
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        drop(stream);
        assert!(started.elapsed() < Duration::from_secs(5));
        let calls = dataset.calls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            dataset.calls.load(Ordering::SeqCst),
            calls,
            "producer still running"
        );
        assert!(calls < 1000);
    }

    #[test]
    fn a_panicking_dataset_becomes_an_error() {
        struct Panics;
        impl Dataset for Panics {
            fn num_samples(&self) -> usize {
                4
            }
            fn image_shape(&self) -> ImageShape {
                [1, 1, 1]
            }
            fn num_classes(&self) -> usize {
                1
            }
            fn sample(&self, _: usize, _: u64, _: &mut [f32]) -> Result<u32, DataError> {
                panic!("decoder bug");
            }
            fn describe(&self) -> String {
                "panics".into()
            }
        }
        let l = Loader::new(Arc::new(Panics), LoaderConfig::new(2)).unwrap();
        let results: Vec<_> = l.epoch(0).collect();
        assert_eq!(results.len(), 1);
        assert!(matches!(results[0], Err(DataError::LoaderPanicked)));
    }

    #[test]
    fn loader_rejects_degenerate_configs() {
        let ds: Arc<dyn Dataset> = Arc::new(Counting::new(3));
        assert!(Loader::new(ds.clone(), LoaderConfig::new(0)).is_err());
        assert!(Loader::new(ds.clone(), LoaderConfig::new(4)).is_err());
        let mut config = LoaderConfig::new(4);
        config.drop_last = false;
        assert_eq!(Loader::new(ds, config).unwrap().batches_per_epoch(), 1);
    }

    #[test]
    fn data_specs_display_as_parsed_and_own_datasets_are_checked() {
        for spec in [
            "synthetic",
            "synthetic:64",
            "cifar10:some/dir",
            "folder:imgs",
        ] {
            assert_eq!(spec.parse::<Data>().unwrap().to_string(), spec);
        }
        let own: Arc<dyn Dataset> = Arc::new(Synthetic::new(3, 16, 4, [3, 8, 8]).unwrap());
        let data = Data::Dataset(own);
        assert_eq!(
            data.open([3, 8, 8], 4, 1, Transforms::PLAIN)
                .unwrap()
                .num_samples(),
            16
        );
        let e = data
            .open([3, 16, 16], 4, 1, Transforms::PLAIN)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("[3, 8, 8]") && e.contains("[3, 16, 16]"), "{e}");
        let e = data.open([3, 8, 8], 2, 1, Transforms::PLAIN).err().unwrap();
        assert!(matches!(e, DataError::TooManyClasses { .. }), "{e}");
    }

    #[test]
    fn open_parses_specs() {
        let ds = open("synthetic", [3, 8, 8], 10, 1, Transforms::PLAIN).unwrap();
        assert_eq!(ds.num_samples(), DEFAULT_SYNTHETIC_SAMPLES);
        assert_eq!(ds.image_shape(), [3, 8, 8]);
        assert_eq!(ds.num_classes(), 10);
        assert_eq!(
            open("synthetic:64", [1, 4, 4], 3, 1, Transforms::PLAIN)
                .unwrap()
                .num_samples(),
            64
        );

        let err = open("imagenet:/data", [3, 8, 8], 10, 1, Transforms::PLAIN)
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains("imagenet:/data") && msg.contains(SPEC_FORMS),
            "{msg}"
        );
        for bad in [
            "synthetic:0",
            "synthetic:x",
            "synthetic:-3",
            "cifar10",
            "folder:",
        ] {
            assert!(
                matches!(
                    open(bad, [3, 8, 8], 10, 1, Transforms::PLAIN),
                    Err(DataError::InvalidSpec { .. })
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            open("cifar10:/nonexistent", [2, 8, 8], 10, 1, Transforms::PLAIN),
            Err(DataError::UnsupportedChannels { .. })
        ));
        assert_eq!(
            open("synthetic", [2, 8, 8], 10, 1, Transforms::PLAIN)
                .unwrap()
                .image_shape(),
            [2, 8, 8]
        );
        assert!(matches!(
            open("synthetic", [3, 0, 8], 10, 1, Transforms::PLAIN),
            Err(DataError::InvalidImageShape { .. })
        ));
    }
}
