//! CIFAR-10 in its binary distribution format.
//!
//! Each file (`data_batch_1.bin` .. `data_batch_5.bin`, `test_batch.bin`) is a sequence of 3073-byte
//! records: one label byte, then the 32×32 red, green and blue planes, row-major. The files are read into
//! memory once (the whole training split is 150 MB) and validated up front, so sampling cannot fail.

use super::transform::Normalization;
use super::{
    DataError, Dataset, Geometry, ImageShape, LUMA_WEIGHTS, Tap, Transforms, bilinear_taps,
    check_photo_shape, check_sample_args, crop_taps, resample_plane,
};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

const SIDE: usize = 32;
const PLANE: usize = SIDE * SIDE;
/// One label byte and three colour planes.
const RECORD_LEN: usize = 1 + 3 * PLANE;
const CLASSES: usize = 10;
const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];
/// The folder the official archive unpacks into, looked into when given its parent.
const ARCHIVE_DIR: &str = "cifar-10-batches-bin";

/// Per-channel statistics of the CIFAR-10 training set (population standard deviation).
const MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
const STD: [f32; 3] = [0.2470, 0.2435, 0.2616];
/// Luma-weighted mean of the channel means, and an approximate standard deviation of the luma image.
const GREY_MEAN: f32 = 0.4809;
const GREY_STD: f32 = 0.239;

pub struct Cifar10 {
    source: PathBuf,
    /// Concatenated records of all files.
    records: Vec<u8>,
    image: ImageShape,
    /// The whole image's taps, for samples neither cropped nor mirrored.
    row_taps: Vec<Tap>,
    column_taps: Vec<Tap>,
    transforms: Transforms,
    /// Seed of the random transforms.
    seed: u64,
    own_normalization: Normalization,
    normalization: Normalization,
}

impl Cifar10 {
    /// Opens a single record file, or a directory's training split (those of `data_batch_1.bin` ..
    /// `data_batch_5.bin` that exist, directly or in a `cifar-10-batches-bin` subfolder), producing
    /// images of shape `image` (1 or 3 channels, any size).
    pub fn open(path: &Path, image: ImageShape) -> Result<Cifar10, DataError> {
        check_photo_shape("cifar10", image)?;
        let files = if path.is_dir() {
            training_files(path)?
        } else {
            vec![path.to_path_buf()]
        };
        Cifar10::from_files(path, &files, image)
    }

    fn from_files(
        source: &Path,
        files: &[PathBuf],
        image: ImageShape,
    ) -> Result<Cifar10, DataError> {
        let mut records = Vec::new();
        for file in files {
            let start = records.len();
            File::open(file)
                .and_then(|mut f| f.read_to_end(&mut records))
                .map_err(|source| DataError::Io {
                    path: file.clone(),
                    source,
                })?;
            validate_records(file, &records[start..])?;
        }
        if records.is_empty() {
            return Err(DataError::Config(format!(
                "{}: no CIFAR-10 records",
                source.display()
            )));
        }
        let own_normalization = if image[0] == 3 {
            Normalization::new(MEAN, STD)
        } else {
            Normalization::new([GREY_MEAN; 3], [GREY_STD; 3])
        };
        let [_, height, width] = image;
        Ok(Cifar10 {
            source: source.to_path_buf(),
            records,
            image,
            row_taps: bilinear_taps(SIDE, height),
            column_taps: bilinear_taps(SIDE, width),
            transforms: Transforms::PLAIN,
            seed: 0,
            own_normalization,
            normalization: own_normalization,
        })
    }

    /// The records seen through `transforms` (resampled bilinearly: a 32×32 source has nothing
    /// to average away), their random draws seeded by `seed`.
    pub fn with(mut self, transforms: Transforms, seed: u64) -> Cifar10 {
        self.transforms = transforms;
        self.seed = seed;
        self.normalization = Normalization::resolve(transforms.normalize, self.own_normalization);
        self
    }

    fn record(&self, index: usize) -> &[u8] {
        &self.records[index * RECORD_LEN..][..RECORD_LEN]
    }
}

fn training_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    for candidate in [dir.to_path_buf(), dir.join(ARCHIVE_DIR)] {
        let files: Vec<PathBuf> = TRAIN_FILES
            .iter()
            .map(|name| candidate.join(name))
            .filter(|p| p.is_file())
            .collect();
        if !files.is_empty() {
            return Ok(files);
        }
    }
    Err(DataError::NoCifarFiles {
        dir: dir.to_path_buf(),
    })
}

fn validate_records(file: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let trailing = bytes.len() % RECORD_LEN;
    if trailing != 0 {
        return Err(DataError::CifarFileSize {
            path: file.to_path_buf(),
            len: bytes.len() as u64,
            record_len: RECORD_LEN,
            trailing: trailing as u64,
            offset: (bytes.len() - trailing) as u64,
        });
    }
    for (record, chunk) in bytes.chunks_exact(RECORD_LEN).enumerate() {
        let label = chunk[0];
        if usize::from(label) >= CLASSES {
            return Err(DataError::CifarLabel {
                path: file.to_path_buf(),
                record,
                offset: (record * RECORD_LEN) as u64,
                label,
            });
        }
    }
    Ok(())
}

impl Dataset for Cifar10 {
    fn num_samples(&self) -> usize {
        self.records.len() / RECORD_LEN
    }

    fn image_shape(&self) -> ImageShape {
        self.image
    }

    fn num_classes(&self) -> usize {
        CLASSES
    }

    fn label(&self, index: usize) -> Option<u32> {
        (index < self.num_samples()).then(|| u32::from(self.record(index)[0]))
    }

    fn sample(&self, index: usize, epoch: u64, out: &mut [f32]) -> Result<u32, DataError> {
        check_sample_args(self, index, out.len())?;
        let record = self.record(index);
        let (label, planes) = (record[0], &record[1..]);
        let [_, height, width] = self.image;
        let plane_out = height * width;
        let crop = self
            .transforms
            .crop(self.seed, epoch, index, [SIDE as u32; 2], [height, width]);
        let (rows, cols);
        let (row_taps, column_taps) = if crop.flip || self.transforms.geometry != Geometry::Stretch
        {
            rows = crop_taps(SIDE, crop.top, crop.height, height, false);
            cols = crop_taps(SIDE, crop.left, crop.width, width, crop.flip);
            (&rows[..], &cols[..])
        } else {
            (&self.row_taps[..], &self.column_taps[..])
        };
        if self.image[0] == 3 {
            for (channel, (src, dst)) in planes
                .chunks_exact(PLANE)
                .zip(out.chunks_exact_mut(plane_out))
                .enumerate()
            {
                resample_plane(src, SIDE, row_taps, column_taps, dst, |v| {
                    self.normalization.apply(channel, v)
                });
            }
        } else {
            let mut luma = [0.0f32; PLANE];
            for (weight, src) in LUMA_WEIGHTS.iter().zip(planes.chunks_exact(PLANE)) {
                for (l, &p) in luma.iter_mut().zip(src) {
                    *l += weight * f32::from(p);
                }
            }
            resample_plane(&luma, SIDE, row_taps, column_taps, out, |v| {
                self.normalization.apply(0, v)
            });
        }
        Ok(u32::from(label))
    }

    fn normalization(&self) -> Option<super::Normalize> {
        Some(self.normalization.given())
    }

    fn describe(&self) -> String {
        format!(
            "cifar10 {} ({} samples)",
            self.source.display(),
            self.num_samples()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// Record `i`: label `i % 10`, red plane = i, green = 100 + i, blue = pixel column × 8.
    fn record(i: u8) -> Vec<u8> {
        let mut r = vec![i % 10];
        r.extend(std::iter::repeat_n(i, PLANE));
        r.extend(std::iter::repeat_n(100 + i, PLANE));
        r.extend((0..PLANE).map(|p| ((p % SIDE) * 8) as u8));
        r
    }

    fn write_records(path: &Path, range: std::ops::Range<u8>) {
        let bytes: Vec<u8> = range.flat_map(record).collect();
        fs::write(path, bytes).unwrap();
    }

    fn normalised(raw: f32, channel: usize) -> f32 {
        (raw / 255.0 - MEAN[channel]) / STD[channel]
    }

    #[test]
    fn reads_training_files_in_order_and_normalises() {
        let dir = tempfile::tempdir().unwrap();
        write_records(&dir.path().join("data_batch_1.bin"), 0..3);
        write_records(&dir.path().join("data_batch_2.bin"), 3..5);
        write_records(&dir.path().join("test_batch.bin"), 50..52);
        let ds = Cifar10::open(dir.path(), [3, 32, 32]).unwrap();
        assert_eq!(ds.num_samples(), 5);
        assert_eq!(ds.num_classes(), 10);
        let mut image = vec![0.0; ds.sample_len()];
        for i in 0..5u8 {
            let label = ds.sample(usize::from(i), 0, &mut image).unwrap();
            assert_eq!(label, u32::from(i % 10));
            assert!((image[0] - normalised(f32::from(i), 0)).abs() < 1e-5);
            assert!((image[PLANE + 17] - normalised(f32::from(100 + i), 1)).abs() < 1e-5);
            // Blue pixel (row 2, column 5) = 40.
            assert!((image[2 * PLANE + 2 * SIDE + 5] - normalised(40.0, 2)).abs() < 1e-5);
        }
        assert!(ds.describe().contains("5 samples"));

        let test = Cifar10::open(&dir.path().join("test_batch.bin"), [3, 32, 32]).unwrap();
        assert_eq!(test.num_samples(), 2);
        assert_eq!(test.sample(1, 0, &mut image).unwrap(), 1);
    }

    #[test]
    fn finds_the_archive_subfolder() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join(ARCHIVE_DIR);
        fs::create_dir(&inner).unwrap();
        write_records(&inner.join("data_batch_3.bin"), 0..2);
        assert_eq!(
            Cifar10::open(dir.path(), [3, 32, 32])
                .unwrap()
                .num_samples(),
            2
        );
    }

    #[test]
    fn resizes_and_converts_to_grey() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data_batch_1.bin");
        write_records(&file, 7..8);
        let big = Cifar10::open(&file, [3, 64, 48]).unwrap();
        let mut image = vec![0.0; big.sample_len()];
        assert_eq!(big.sample(0, 0, &mut image).unwrap(), 7);
        // Constant planes stay constant; the blue column ramp stays monotone.
        let plane = 64 * 48;
        assert!(
            image[..plane]
                .iter()
                .all(|&v| (v - normalised(7.0, 0)).abs() < 1e-5)
        );
        let blue_row = &image[2 * plane..][..48];
        assert!(blue_row.windows(2).all(|w| w[0] <= w[1]));

        let grey = Cifar10::open(&file, [1, 16, 16]).unwrap();
        let mut image = vec![0.0; grey.sample_len()];
        grey.sample(0, 0, &mut image).unwrap();
        assert!(image.iter().all(|v| v.is_finite() && v.abs() < 4.0));
    }

    #[test]
    fn partial_records_are_reported_with_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data_batch_1.bin");
        let mut bytes: Vec<u8> = (0..2).flat_map(record).collect();
        bytes.extend_from_slice(&[1, 2, 3]);
        fs::write(&file, &bytes).unwrap();
        let err = Cifar10::open(dir.path(), [3, 32, 32]).err().unwrap();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                DataError::CifarFileSize {
                    trailing: 3,
                    offset: 6146,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("data_batch_1.bin") && msg.contains("6146"),
            "{msg}"
        );
    }

    #[test]
    fn bad_labels_are_reported_with_record_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("test_batch.bin");
        let mut bytes: Vec<u8> = (0..3).flat_map(record).collect();
        bytes[2 * RECORD_LEN] = 10;
        fs::write(&file, &bytes).unwrap();
        let err = Cifar10::open(&file, [3, 32, 32]).err().unwrap();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                DataError::CifarLabel {
                    record: 2,
                    label: 10,
                    offset: 6146,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("test_batch.bin"), "{msg}");
    }

    #[test]
    fn missing_and_empty_inputs_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Cifar10::open(dir.path(), [3, 32, 32]),
            Err(DataError::NoCifarFiles { .. })
        ));
        let missing = dir.path().join("nope.bin");
        let err = Cifar10::open(&missing, [3, 32, 32]).err().unwrap();
        assert!(err.to_string().contains("nope.bin"), "{err}");
        let empty = dir.path().join("empty.bin");
        fs::write(&empty, []).unwrap();
        assert!(Cifar10::open(&empty, [3, 32, 32]).is_err());
    }

    #[test]
    fn opens_through_a_spec() {
        let dir = tempfile::tempdir().unwrap();
        write_records(&dir.path().join("data_batch_1.bin"), 0..4);
        let spec = format!("cifar10:{}", dir.path().display());
        let ds = super::super::open(&spec, [3, 32, 32], 10, 0, Transforms::PLAIN).unwrap();
        assert_eq!(ds.num_samples(), 4);
        assert!(matches!(
            super::super::open(&spec, [3, 32, 32], 5, 0, Transforms::PLAIN),
            Err(DataError::TooManyClasses { .. })
        ));
    }
}
