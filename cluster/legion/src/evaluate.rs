//! A trained model put to use: its accuracy on a dataset and the classes it sees in images, from a
//! checkpoint a run saved (with the class names of the data it trained on, where it had them).
//!
//! Both run the inference forward on this host's CPU (`legion_ops::infer`): batch norm on its
//! running statistics, dropout passing through, images through the evaluation recipe.

use anyhow::Context;
use legion_ops::Graph;
use legion_ops::checkpoint;
use legion_ops::data::{Data, Dataset, ImageFolder, Normalize, Transforms, has_image_extension};
use legion_ops::infer::{self, Accuracy};
use legion_ops::train::{ParamStore, TrainingState};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a checkpoint keeps the class names of its training data: a JSON list, by label.
pub const CLASS_NAMES_KEY: &str = "class_names";
/// Where a checkpoint keeps the mean and std its training images were normalised with
/// (`M,M,M/S,S,S`), which scoring uses again.
pub const NORMALIZE_KEY: &str = "normalize";

/// A model and the weights of a checkpoint.
pub struct Trained {
    graph: Graph,
    params: ParamStore,
    class_names: Option<Vec<String>>,
    /// As the model was trained: the image datasets' own statistics where the checkpoint does
    /// not say.
    normalize: Normalize,
    shape: [usize; 3],
}

/// One image's most probable classes.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub file: PathBuf,
    /// Most probable first: (label, its class name where the checkpoint has them, probability).
    pub classes: Vec<(usize, Option<String>, f64)>,
}

impl Trained {
    /// `graph` with the weights of the checkpoint at `path` (a `--save` file or plain weights).
    pub fn load(graph: Graph, path: &Path) -> anyhow::Result<Trained> {
        let ckpt =
            checkpoint::load(path).with_context(|| format!("--checkpoint {}", path.display()))?;
        let class_names = match ckpt.metadata.get(CLASS_NAMES_KEY) {
            Some(json) => Some(serde_json::from_str::<Vec<String>>(json).with_context(|| {
                format!(
                    "--checkpoint {}: metadata `{CLASS_NAMES_KEY}` is not a JSON list of names",
                    path.display()
                )
            })?),
            None => None,
        };
        let normalize = match ckpt.metadata.get(NORMALIZE_KEY) {
            Some(text) => text.parse::<Normalize>().map_err(|e| {
                anyhow::anyhow!(
                    "--checkpoint {}: metadata `{NORMALIZE_KEY}`: {e}",
                    path.display()
                )
            })?,
            None => Normalize::Dataset,
        };
        anyhow::ensure!(
            graph.logits().is_some(),
            "model '{}' has no softmax_cross_entropy layer: nothing marks its logits to score",
            graph.name
        );
        let params = TrainingState::from_checkpoint(&graph, ckpt)
            .with_context(|| {
                format!(
                    "--checkpoint {}: the weights of model '{}' do not fit it",
                    path.display(),
                    graph.name
                )
            })?
            .params;
        let input = graph.layer(graph.input()).shape;
        let shape = [input.dim(1), input.dim(2), input.dim(3)];
        Ok(Trained {
            graph,
            params,
            class_names,
            normalize,
            shape,
        })
    }

    /// The class names the checkpoint carries, by label.
    pub fn class_names(&self) -> Option<&[String]> {
        self.class_names.as_deref()
    }

    /// Top-1, top-5 and loss on every sample of `data` seen through `transforms`' geometry,
    /// normalised as the model was trained; a sample that cannot be read is skipped unless
    /// `strict`.
    pub fn evaluate(
        &self,
        data: &Data,
        transforms: Transforms,
        strict: bool,
    ) -> anyhow::Result<Accuracy> {
        let classes = self.classes();
        let transforms = Transforms {
            normalize: self.normalize,
            ..transforms
        };
        let dataset = data
            .open(self.shape, classes, 0, transforms)
            .with_context(|| format!("--data {data}"))?;
        if strict && let Some((path, why)) = dataset.census().and_then(|c| c.unreadable.first()) {
            anyhow::bail!(
                "--data {data}: {}: {why} (--strict-data: every image must be readable)",
                path.display()
            );
        }
        if let (Some(names), Some(census)) = (&self.class_names, dataset.census())
            && names != &census.class_names
        {
            anyhow::bail!(
                "--data {data}: its classes {:?} are not the checkpoint's {names:?} (labels follow the sorted folder names)",
                census.class_names
            );
        }
        Ok(infer::evaluate(&self.graph, &self.params, dataset, strict)?)
    }

    /// The `k` most probable classes of each image file, through the evaluation recipe.
    pub fn predict(&self, files: &[PathBuf], k: usize) -> anyhow::Result<Vec<Prediction>> {
        let images: Arc<dyn Dataset> =
            Arc::new(ImageFolder::from_files(files, self.shape)?.with(self.transforms(), 0));
        let batch = self.graph.batch();
        let sample_len = images.sample_len();
        let classes = self.classes();
        let mut predictions = Vec::with_capacity(files.len());
        for chunk in files.chunks(batch) {
            let first = predictions.len();
            let mut x = vec![0.0f32; batch * sample_len];
            for (i, out) in x.chunks_exact_mut(sample_len).take(chunk.len()).enumerate() {
                images.sample(first + i, 0, out)?;
            }
            let logits = infer::logits(&self.graph, &self.params, &x)?;
            for (file, row) in chunk.iter().zip(logits.chunks_exact(classes)) {
                predictions.push(Prediction {
                    file: file.clone(),
                    classes: infer::top_k(row, k)
                        .into_iter()
                        .map(|(label, p)| (label, self.name(label), p))
                        .collect(),
                });
            }
        }
        Ok(predictions)
    }

    /// The evaluation recipe, normalised as the model was trained.
    fn transforms(&self) -> Transforms {
        Transforms {
            normalize: self.normalize,
            ..Transforms::EVAL
        }
    }

    fn classes(&self) -> usize {
        self.graph
            .logits()
            .map_or(0, |id| self.graph.layer(id).shape.dim(1))
    }

    fn name(&self, label: usize) -> Option<String> {
        self.class_names.as_ref()?.get(label).cloned()
    }
}

/// The image files of `paths`: files as given, folders searched for `.png`, `.jpg` and `.jpeg`
/// files (not recursively), sorted.
pub fn image_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| path.display().to_string())?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && has_image_extension(p))
                .collect();
            anyhow::ensure!(
                !found.is_empty(),
                "{}: no .png, .jpg or .jpeg files",
                path.display()
            );
            found.sort();
            files.extend(found);
        } else {
            anyhow::ensure!(path.is_file(), "{}: no such file or folder", path.display());
            files.push(path.clone());
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Training;
    use crate::{DeviceKind, load_model};

    /// Two classes of small PNGs: bright images and dark ones.
    fn folder(root: &Path) {
        for (class, level) in [("bright", 220u8), ("dark", 30u8)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..5u32 {
                let image = image::GrayImage::from_fn(20 + i, 24, |x, y| {
                    image::Luma([level.wrapping_add(((x + y + i) % 16) as u8)])
                });
                image
                    .save(root.join(class).join(format!("{i}.png")))
                    .unwrap();
            }
        }
    }

    #[test]
    fn predictions_agree_with_the_evaluation_and_carry_the_trained_class_names() {
        let dir = tempfile::tempdir().unwrap();
        let (images, saved) = (dir.path().join("images"), dir.path().join("w.safetensors"));
        folder(&images);
        let graph = load_model("lenet5", 4, Some(28), Some(2)).unwrap();
        Training::new(graph.clone())
            .data(Data::Folder(images.clone()))
            .device(DeviceKind::Cpu)
            .steps(8)
            .save(&saved)
            .run(|_| {})
            .unwrap();
        // The grey images' statistics the run normalised with, for scoring to use again.
        let saved_as = checkpoint::load(&saved).unwrap().metadata[NORMALIZE_KEY].clone();
        match saved_as.parse::<Normalize>().unwrap() {
            Normalize::Given { mean, std } => {
                assert!((mean[0] - 0.449).abs() < 1e-6 && (std[0] - 0.226).abs() < 1e-6)
            }
            other => panic!("{other:?}"),
        }
        let trained = Trained::load(graph, &saved).unwrap();
        assert_eq!(
            trained.class_names().unwrap(),
            ["bright".to_string(), "dark".to_string()]
        );
        let accuracy = trained
            .evaluate(&Data::Folder(images.clone()), Transforms::EVAL, true)
            .unwrap();
        assert_eq!(accuracy.samples, 10);
        // Ten files in batches of four: the last batch padded, as in the evaluation.
        let files = image_files(&[images.join("bright"), images.join("dark")]).unwrap();
        let predictions = trained.predict(&files, 2).unwrap();
        assert_eq!(predictions.len(), 10);
        let right = predictions
            .iter()
            .filter(|p| {
                let folder = p.file.parent().unwrap().file_name().unwrap();
                p.classes[0].1.as_deref() == folder.to_str()
            })
            .count();
        assert_eq!(accuracy.top1, right as f64 / 10.0);
        for p in &predictions {
            let total: f64 = p.classes.iter().map(|c| c.2).sum();
            assert!((total - 1.0).abs() < 1e-9, "{p:?}");
        }
        std::fs::write(images.join("dark/broken.png"), b"\x89PNG garbage").unwrap();
        let strict = trained.evaluate(&Data::Folder(images.clone()), Transforms::EVAL, true);
        assert!(format!("{:#}", strict.err().unwrap()).contains("broken.png"));
        let lenient = trained.evaluate(&Data::Folder(images.clone()), Transforms::EVAL, false);
        assert_eq!(lenient.unwrap(), accuracy);
        let renamed = dir.path().join("renamed");
        folder(&renamed);
        std::fs::rename(renamed.join("dark"), renamed.join("night")).unwrap();
        let e = trained
            .evaluate(&Data::Folder(renamed), Transforms::EVAL, true)
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("not the checkpoint's"), "{e:#}");
    }
}
