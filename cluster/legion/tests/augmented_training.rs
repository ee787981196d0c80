//! With torchvision's training recipe on (random resized crops and flips of real image files),
//! every strategy still trains the network one device trains: a sample's crop and flip are a
//! pure function of (seed, epoch, sample), so every device count and strategy reads the same
//! pixels. Each tensor within relative error 1e-4, or within `ROUNDING_FACTOR` times what f32
//! rounding of the initial weights alone moves it (batch norm's biases), as in the equivalence
//! suite (`integration/tests/equivalence.rs`).

use legion::job::{Strategy, Training};
use legion::ops::checkpoint::{self, Checkpoint};
use legion::ops::data::{Data, Transforms};
use legion::{DeviceKind, SearchKind, load_model};
use std::path::Path;

const TOLERANCE: f32 = 1e-4;
const ROUNDING_FACTOR: f32 = 10.0;
const STEPS: u64 = 5;

/// Three classes of photographs of odd sizes and aspects: a colour gradient and stripes whose
/// direction and hue depend on the class, so that a crop or a flip changes the pixels.
fn image_folder(root: &Path) {
    for class in 0..3u32 {
        let dir = root.join(format!("class_{class}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..6u32 {
            let (w, h) = (37 + 11 * i, 29 + 7 * ((i + class) % 4));
            let image = image::RgbImage::from_fn(w, h, |x, y| {
                let stripe = ((x * (class + 1) + y * (2 - class.min(2))) / 3 % 2) as u8;
                image::Rgb([
                    (x * 255 / w) as u8,
                    (y * 255 / h) as u8 ^ (40 * class as u8),
                    stripe * 200 + (i * 9) as u8,
                ])
            });
            image.save(dir.join(format!("img_{i}.png"))).unwrap();
        }
    }
}

/// A model's weights after `steps` steps from `init` (else its seeded initialisation).
struct Run<'a> {
    model: &'a str,
    image: usize,
    data: &'a Path,
    out: &'a Path,
}

impl Run<'_> {
    fn train(
        &self,
        devices: usize,
        strategy: Strategy,
        steps: u64,
        init: Option<&Checkpoint>,
    ) -> Checkpoint {
        let graph = load_model(self.model, 8, Some(self.image), Some(3)).unwrap();
        let mut training = Training::new(graph)
            .devices(devices)
            .strategy(strategy)
            .data(Data::Folder(self.data.to_path_buf()))
            .transforms(Transforms::TRAIN)
            .device(DeviceKind::Cpu)
            .steps(steps)
            .seed(3)
            .save(self.out);
        if let Some(init) = init {
            training = training.weights(init.clone());
        }
        training.run(|_| {}).unwrap();
        checkpoint::load(self.out).unwrap()
    }
}

/// `weights` moved by f32 rounding: each value times 1 + e, |e| ≤ 1e-7.
fn perturbed(weights: &Checkpoint) -> Checkpoint {
    let mut moved = weights.clone();
    let mut state = 1u64;
    for tensor in &mut moved.tensors {
        for v in &mut tensor.data {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *v *= 1.0 + 1e-7 * ((state >> 33) as f32 / (1u64 << 31) as f32 - 1.0);
        }
    }
    moved
}

fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn every_strategy_trains_what_one_device_trains(model: &str, image: usize) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("images");
    image_folder(&data);
    let out = dir.path().join("weights.safetensors");
    let run = Run {
        model,
        image,
        data: &data,
        out: &out,
    };
    // The seeded initialisation, without the momentum and step of a checkpoint.
    let mut init = run.train(1, SearchKind::Data.into(), 0, None);
    init.tensors.retain(|t| !t.name.starts_with("momentum/"));
    let reference = run.train(1, SearchKind::Data.into(), STEPS, Some(&init));
    let moved = run.train(1, SearchKind::Data.into(), STEPS, Some(&perturbed(&init)));
    for kind in [
        SearchKind::Data,
        SearchKind::Model,
        SearchKind::Owt,
        SearchKind::OptCnn,
        SearchKind::Soybean,
    ] {
        let weights = run.train(4, kind.into(), STEPS, Some(&init));
        for want in &reference.tensors {
            let got = weights.get(&want.name).unwrap();
            let rounding = relative_error(&moved.get(&want.name).unwrap().data, &want.data);
            let tolerance = TOLERANCE.max(ROUNDING_FACTOR * rounding);
            let err = relative_error(&got.data, &want.data);
            assert!(
                err <= tolerance,
                "{model}/{}: {} differs by {err:e} (tolerance {tolerance:e})",
                kind.name(),
                want.name
            );
        }
    }
}

#[test]
fn lenet5_on_augmented_images_trains_the_same_under_every_strategy() {
    every_strategy_trains_what_one_device_trains("lenet5", 28);
}

/// Batch norm's statistics over crops and flips of the batch, whichever device holds them.
#[test]
fn resnet18_with_batch_norm_on_augmented_images_trains_the_same_under_every_strategy() {
    every_strategy_trains_what_one_device_trains("resnet18", 32);
}
