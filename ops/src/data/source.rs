//! A run's training samples opened again by another process: a cluster's workers read the
//! samples their devices consume from the same files, through the same seeded transforms, so the
//! driver carries indices and labels rather than pixels.

use super::{Data, DataError, Dataset, ImageShape, Subset, Transforms, split};
use rayon::prelude::*;
use std::sync::Arc;

/// How a run opened its training samples: what another process that reads the same files (or
/// draws the same synthetic data) needs to open the same dataset, sample for sample.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataSource {
    /// `--data`'s spec, its path made absolute.
    pub spec: String,
    pub image: ImageShape,
    pub classes: usize,
    /// The seed of the synthetic data, the random transforms and the held-out split.
    pub seed: u64,
    pub transforms: Transforms,
    /// Where the run holds out this fraction ([`split`]), its training part.
    pub held_out: Option<f64>,
    /// Samples the run found: a reader that finds others reads other files.
    pub samples: usize,
    pub dataset_classes: usize,
}

impl DataSource {
    /// The source of `dataset`, opened from `data` as [`Data::open`] does (then cut to the
    /// training part of `held_out`), where another process can open it too: a folder, CIFAR-10
    /// or synthetic data, not the caller's own dataset or batches.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        data: &Data,
        dataset: &dyn Dataset,
        image: ImageShape,
        classes: usize,
        seed: u64,
        transforms: Transforms,
        held_out: Option<f64>,
    ) -> Option<DataSource> {
        let absolute = |path: &std::path::Path| std::path::absolute(path).ok();
        let spec = match data {
            Data::Synthetic { .. } => data.to_string(),
            Data::Folder(dir) => Data::Folder(absolute(dir)?).to_string(),
            Data::Cifar10(path) => Data::Cifar10(absolute(path)?).to_string(),
            Data::Dataset(_) | Data::Feed(_) => return None,
        };
        // Labels known without reading the pixels: what the driver sends instead of them.
        dataset.label(0)?;
        Some(DataSource {
            spec,
            image,
            classes,
            seed,
            transforms,
            held_out,
            samples: dataset.num_samples(),
            dataset_classes: dataset.num_classes(),
        })
    }

    /// Opens the dataset again, refused where it is not the run's (other files, or files the
    /// run's host reads differently).
    pub fn open(&self) -> Result<Arc<dyn Dataset>, DataError> {
        let data: Data = self.spec.parse()?;
        let whole = data.open(self.image, self.classes, self.seed, self.transforms)?;
        let dataset: Arc<dyn Dataset> = match self.held_out {
            None => whole,
            Some(fraction) => {
                let (train, _) = split(whole.num_samples(), fraction, self.seed)?;
                Arc::new(Subset::new(whole, train, "the training part")?)
            }
        };
        let (samples, classes) = (dataset.num_samples(), dataset.num_classes());
        if (samples, classes) != (self.samples, self.dataset_classes) {
            return Err(DataError::Config(format!(
                "--data {}: {samples} samples of {classes} classes here, where the run found {} \
                 of {}: every host must read the same files",
                self.spec, self.samples, self.dataset_classes
            )));
        }
        Ok(dataset)
    }
}

/// The samples `indices` of `dataset` as seen in `epoch`, read in parallel: their values,
/// sample-major, and labels. Each sample that cannot be read is listed with its error instead
/// (its values left zero); an error that is not a sample's own fails the whole read.
pub fn read_at(
    dataset: &dyn Dataset,
    epoch: u64,
    indices: &[usize],
) -> Result<ReadSamples, DataError> {
    let sample_len = dataset.sample_len();
    let len = indices
        .len()
        .checked_mul(sample_len)
        .ok_or_else(|| DataError::Config(format!("{} samples overflow", indices.len())))?;
    let mut values = vec![0.0f32; len];
    let mut labels = vec![0u32; indices.len()];
    let failed: Vec<(usize, DataError)> = values
        .par_chunks_mut(sample_len.max(1))
        .zip(labels.par_iter_mut())
        .zip(indices.par_iter())
        .filter_map(
            |((out, label), &index)| match dataset.sample(index, epoch, out) {
                Ok(l) => {
                    *label = l;
                    None
                }
                Err(e) => Some((index, e)),
            },
        )
        .collect();
    let mut unreadable = Vec::new();
    for (index, error) in failed {
        if !super::is_bad_sample(&error) {
            return Err(error);
        }
        unreadable.push((index, error.to_string()));
    }
    Ok(ReadSamples {
        values,
        labels,
        unreadable,
    })
}

/// What [`read_at`] read.
#[derive(Debug)]
pub struct ReadSamples {
    pub values: Vec<f32>,
    pub labels: Vec<u32>,
    /// The samples that could not be read, by dataset index, with why.
    pub unreadable: Vec<(usize, String)>,
}
