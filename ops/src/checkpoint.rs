//! Checkpoints: named f32 tensors plus string metadata in a `.safetensors` file.
//!
//! Saving streams the tensors straight from the caller's buffers (no copy of the whole model) into a
//! temporary file next to the target, fsyncs it and renames it over the target, so a crash leaves either
//! the old checkpoint or the new one, never a torn file. The header is written with a fixed key order
//! (metadata first, then tensors by name), so saving the same tensors twice gives identical bytes.
//!
//! Loading parses and validates the header with the `safetensors` crate, checks that the file length
//! matches it, and only then allocates and reads the tensors. Corrupt input gives an error, never a panic.

use crate::atomic_file::AtomicFile;
use crate::shape::{MAX_DIMS, Shape};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError};
use serde::ser::{SerializeMap, Serializer};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Bytes of the little-endian header length that starts every safetensors file.
const HEADER_LEN_BYTES: usize = 8;
/// The same cap the `safetensors` crate applies; a larger claimed header is corrupt, and the cap keeps a
/// corrupt length field from making us allocate gigabytes.
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// The header key safetensors reserves for string metadata.
const METADATA_KEY: &str = "__metadata__";
/// Floats converted per write/read call: large enough for throughput, small enough to stay in cache.
const IO_CHUNK_FLOATS: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a regular file")]
    NotAFile { path: PathBuf },
    #[error("{path}: truncated: {detail}")]
    Truncated { path: PathBuf, detail: String },
    #[error("{path}: corrupt safetensors header: {source}")]
    CorruptHeader {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
    #[error("{path}: file is {actual} bytes but its header describes {expected} bytes")]
    LengthMismatch {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: tensor `{name}` has dtype {dtype:?}; only F32 checkpoints are supported")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: Dtype,
    },
    #[error("{path}: tensor `{name}` has {rank} dims; at most {MAX_DIMS} are supported")]
    UnsupportedRank {
        path: PathBuf,
        name: String,
        rank: usize,
    },
    #[error(
        "cannot save tensor `{name}`: shape {shape} needs {expected} values but {actual} were given"
    )]
    DataLength {
        name: String,
        shape: Shape,
        expected: usize,
        actual: usize,
    },
    #[error("cannot save tensor `{name}`: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("checkpoint is missing tensor `{name}` (expected shape {expected})")]
    MissingTensor { name: String, expected: Shape },
    #[error("checkpoint has unexpected tensor `{name}` with shape {found}")]
    UnexpectedTensor { name: String, found: Shape },
    #[error("checkpoint tensor `{name}` has shape {found}, expected {expected}")]
    WrongShape {
        name: String,
        expected: Shape,
        found: Shape,
    },
    #[error("metadata '{key}' is '{value}', not a number")]
    BadMetadata { key: String, value: String },
}

/// A tensor owned by a loaded checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Shape,
    pub data: Vec<f32>,
}

impl NamedTensor {
    pub fn new(name: impl Into<String>, shape: Shape, data: Vec<f32>) -> NamedTensor {
        NamedTensor {
            name: name.into(),
            shape,
            data,
        }
    }

    /// A borrowed view, for saving without copying the data.
    pub fn view(&self) -> TensorRef<'_> {
        TensorRef {
            name: &self.name,
            shape: self.shape,
            data: &self.data,
        }
    }
}

/// A tensor borrowed from its owner (e.g. a layer's weight buffer), as [`save`] takes them.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub shape: Shape,
    pub data: &'a [f32],
}

/// The contents of a checkpoint file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Checkpoint {
    /// In file order, which for files written by [`save`] is sorted by name.
    pub tensors: Vec<NamedTensor>,
    pub metadata: BTreeMap<String, String>,
    /// Tensors of the file that were not read: the buffers of a PyTorch `state_dict` that no
    /// legion-rs model keeps (see [`is_unused_pytorch_buffer`]).
    pub skipped: Vec<String>,
}

/// Whether a tensor of a PyTorch `state_dict` is a buffer no legion-rs model keeps: BatchNorm's
/// step counter `num_batches_tracked` (an integer; legion-rs's running statistics use a fixed
/// momentum, as PyTorch's do unless `momentum=None`).
fn is_unused_pytorch_buffer(name: &str, dtype: Dtype) -> bool {
    name.ends_with(".num_batches_tracked") && dtype != Dtype::F32
}

impl Checkpoint {
    pub fn get(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Checks that this checkpoint holds exactly the `expected` tensors with the expected shapes, so a
    /// checkpoint from a different model (or a different width of the same one) is rejected up front.
    pub fn check_against(&self, expected: &[(String, Shape)]) -> Result<(), CheckpointError> {
        let found: BTreeMap<&str, Shape> = self
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape))
            .collect();
        for (name, expected_shape) in expected {
            match found.get(name.as_str()) {
                None => {
                    return Err(CheckpointError::MissingTensor {
                        name: name.clone(),
                        expected: *expected_shape,
                    });
                }
                Some(found_shape) if found_shape != expected_shape => {
                    return Err(CheckpointError::WrongShape {
                        name: name.clone(),
                        expected: *expected_shape,
                        found: *found_shape,
                    });
                }
                Some(_) => {}
            }
        }
        let expected_names: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = self
            .tensors
            .iter()
            .find(|t| !expected_names.contains(t.name.as_str()))
        {
            return Err(CheckpointError::UnexpectedTensor {
                name: extra.name.clone(),
                found: extra.shape,
            });
        }
        Ok(())
    }

    /// Saves this checkpoint to `path` (see [`save`]).
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let views: Vec<TensorRef<'_>> = self.tensors.iter().map(NamedTensor::view).collect();
        save(path, &views, &self.metadata)
    }
}

/// Writes `tensors` and `metadata` to `path` atomically (temporary file in the same directory, fsync,
/// rename). Tensors are stored sorted by name whatever the order of the slice.
pub fn save(
    path: &Path,
    tensors: &[TensorRef<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let mut sorted: Vec<&TensorRef<'_>> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(b.name));
    validate_for_save(&sorted)?;
    let header = encode_header(&sorted, metadata);

    if path.file_name().is_none() {
        return Err(CheckpointError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let temp = AtomicFile::create_beside(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let io_err = |source| CheckpointError::Io {
        path: temp.path().to_path_buf(),
        source,
    };
    {
        let mut out = BufWriter::with_capacity(1 << 20, temp.file());
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io_err)?;
        out.write_all(&header).map_err(io_err)?;
        let mut bytes = Vec::with_capacity(IO_CHUNK_FLOATS * 4);
        for tensor in &sorted {
            for chunk in tensor.data.chunks(IO_CHUNK_FLOATS) {
                bytes.clear();
                bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
                out.write_all(&bytes).map_err(io_err)?;
            }
        }
        out.flush().map_err(io_err)?;
    }
    temp.commit(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The string metadata of a checkpoint, its header read and checked but none of its tensors.
pub fn load_metadata(path: &Path) -> Result<BTreeMap<String, String>, CheckpointError> {
    Ok(metadata_of(&read_header(path)?.1))
}

fn metadata_of(parsed: &Metadata) -> BTreeMap<String, String> {
    parsed
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

/// Opens a checkpoint and reads its header: the reader at the first tensor's bytes, the
/// header, and the file's length, checked to be what the header describes.
fn read_header(path: &Path) -> Result<(BufReader<File>, Metadata), CheckpointError> {
    let io_err = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_meta = fs::metadata(path).map_err(io_err)?;
    if !file_meta.is_file() {
        return Err(CheckpointError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let file_len = file_meta.len();
    let mut reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io_err)?);

    let truncated = |detail: String| CheckpointError::Truncated {
        path: path.to_path_buf(),
        detail,
    };
    if file_len < HEADER_LEN_BYTES as u64 {
        return Err(truncated(format!(
            "{file_len} bytes, shorter than the {HEADER_LEN_BYTES}-byte header length"
        )));
    }
    let mut len_bytes = [0u8; HEADER_LEN_BYTES];
    reader.read_exact(&mut len_bytes).map_err(io_err)?;
    let header_len = u64::from_le_bytes(len_bytes);
    let corrupt = |source| CheckpointError::CorruptHeader {
        path: path.to_path_buf(),
        source,
    };
    if header_len > MAX_HEADER_BYTES {
        return Err(corrupt(SafeTensorError::HeaderTooLarge));
    }
    let data_start = HEADER_LEN_BYTES as u64 + header_len;
    if data_start > file_len {
        return Err(truncated(format!(
            "header claims {header_len} bytes but the file has only {} after the length field",
            file_len - HEADER_LEN_BYTES as u64
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    reader.read_exact(&mut header).map_err(io_err)?;
    let header =
        std::str::from_utf8(&header).map_err(|e| corrupt(SafeTensorError::InvalidHeader(e)))?;
    let parsed: Metadata = serde_json::from_str(header)
        .map_err(|e| corrupt(SafeTensorError::InvalidHeaderDeserialization(e)))?;

    let expected_len = data_start + parsed.data_len() as u64;
    if expected_len != file_len {
        let err = if expected_len > file_len {
            truncated(format!(
                "header describes {expected_len} bytes but the file has {file_len}"
            ))
        } else {
            CheckpointError::LengthMismatch {
                path: path.to_path_buf(),
                expected: expected_len,
                actual: file_len,
            }
        };
        return Err(err);
    }
    Ok((reader, parsed))
}

/// Reads a checkpoint written by [`save`] (or any safetensors file of f32 tensors of rank ≤ 4).
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let io_err = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let truncated = |detail: String| CheckpointError::Truncated {
        path: path.to_path_buf(),
        detail,
    };
    let (mut reader, parsed) = read_header(path)?;

    // Check every tensor before reading any data, so a bad dtype late in the file fails fast.
    let names = parsed.offset_keys();
    let mut infos = Vec::with_capacity(names.len());
    let mut skipped = Vec::new();
    for name in names {
        let info = parsed
            .info(&name)
            .expect("offset_keys lists only tensors present in the header");
        if is_unused_pytorch_buffer(&name, info.dtype) {
            let (start, end) = info.data_offsets;
            infos.push((name.clone(), None, (start, end)));
            skipped.push(name);
            continue;
        }
        if info.dtype != Dtype::F32 {
            return Err(CheckpointError::UnsupportedDtype {
                path: path.to_path_buf(),
                name,
                dtype: info.dtype,
            });
        }
        if info.shape.len() > MAX_DIMS {
            return Err(CheckpointError::UnsupportedRank {
                path: path.to_path_buf(),
                name,
                rank: info.shape.len(),
            });
        }
        let shape = Shape::new(&info.shape);
        infos.push((name, Some(shape), info.data_offsets));
    }

    // The header validation guarantees offsets are contiguous from 0 in this order and that their byte
    // sizes match the shapes, and we checked the file is exactly that long, so sequential reads suffice.
    let mut tensors = Vec::with_capacity(infos.len());
    let mut bytes = vec![0u8; IO_CHUNK_FLOATS * 4];
    for (name, shape, (start, end)) in infos {
        let Some(shape) = shape else {
            // a skipped buffer: its bytes are passed over
            let len = (end - start) as u64;
            let passed = std::io::copy(&mut (&mut reader).take(len), &mut std::io::sink())
                .map_err(io_err)?;
            if passed != len {
                return Err(truncated(format!(
                    "tensor `{name}` ends past the file's end"
                )));
            }
            continue;
        };
        let numel = (end - start) / 4;
        let mut data = Vec::with_capacity(numel);
        let mut remaining = numel;
        while remaining > 0 {
            let n = remaining.min(IO_CHUNK_FLOATS);
            let chunk = &mut bytes[..n * 4];
            reader.read_exact(chunk).map_err(io_err)?;
            data.extend(
                chunk
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
            remaining -= n;
        }
        tensors.push(NamedTensor { name, shape, data });
    }

    let metadata = metadata_of(&parsed);
    Ok(Checkpoint {
        tensors,
        metadata,
        skipped,
    })
}

fn validate_for_save(sorted: &[&TensorRef<'_>]) -> Result<(), CheckpointError> {
    for (i, t) in sorted.iter().enumerate() {
        let invalid = |reason| CheckpointError::InvalidName {
            name: t.name.to_string(),
            reason,
        };
        if t.name.is_empty() {
            return Err(invalid("tensor names must not be empty"));
        }
        if t.name == METADATA_KEY {
            return Err(invalid("the name is reserved for safetensors metadata"));
        }
        if i > 0 && sorted[i - 1].name == t.name {
            return Err(invalid("the name appears more than once"));
        }
        if t.data.len() != t.shape.numel() {
            return Err(CheckpointError::DataLength {
                name: t.name.to_string(),
                shape: t.shape,
                expected: t.shape.numel(),
                actual: t.data.len(),
            });
        }
    }
    Ok(())
}

/// The JSON header, padded with spaces to a multiple of 8 bytes as the safetensors format recommends.
///
/// Written by hand rather than through `safetensors::tensor::Metadata`, whose metadata map is a
/// `HashMap`: its random iteration order would make two saves of the same checkpoint differ.
fn encode_header(sorted: &[&TensorRef<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut json = Vec::new();
    let mut ser = serde_json::Serializer::new(&mut json);
    let entries = sorted.len() + usize::from(!metadata.is_empty());
    let encode = |ser: &mut serde_json::Serializer<&mut Vec<u8>>| -> serde_json::Result<()> {
        let mut map = ser.serialize_map(Some(entries))?;
        if !metadata.is_empty() {
            map.serialize_entry(METADATA_KEY, metadata)?;
        }
        let mut offset = 0;
        for t in sorted {
            let bytes = t.data.len() * 4;
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape: t.shape.dims().to_vec(),
                data_offsets: (offset, offset + bytes),
            };
            map.serialize_entry(t.name, &info)?;
            offset += bytes;
        }
        map.end()
    };
    encode(&mut ser).expect("serialising strings and integers to a Vec cannot fail");
    let padded = json.len().next_multiple_of(HEADER_LEN_BYTES);
    json.resize(padded, b' ');
    json
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use safetensors::SafeTensors;

    fn sample_tensors() -> Vec<NamedTensor> {
        let ramp = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 - 7.5) * scale).collect()
        };
        let mut odd = ramp(10, 0.1);
        // Values whose bits must survive exactly, including the sign of zero and a NaN payload.
        odd[0] = -0.0;
        odd[1] = f32::from_bits(0x7fc0_1234);
        odd[2] = f32::MIN_POSITIVE / 3.0;
        odd[3] = f32::INFINITY;
        vec![
            NamedTensor::new("fc.weight", Shape::nc(2, 5), odd),
            NamedTensor::new("conv1.weight", Shape::nchw(4, 3, 3, 3), ramp(108, 0.01)),
            NamedTensor::new("conv1.bias", Shape::new(&[4]), ramp(4, 1.0)),
        ]
    }

    fn sample_metadata() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("model".to_string(), "lenet5".to_string()),
            ("step".to_string(), "1200".to_string()),
            ("strategy".to_string(), "data-parallel".to_string()),
        ])
    }

    fn save_sample(dir: &Path) -> PathBuf {
        let path = dir.join("model.safetensors");
        let tensors = sample_tensors();
        let views: Vec<_> = tensors.iter().map(NamedTensor::view).collect();
        save(&path, &views, &sample_metadata()).unwrap();
        path
    }

    fn bits(data: &[f32]) -> Vec<u32> {
        data.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn round_trip_keeps_names_shapes_bits_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = save_sample(dir.path());
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.metadata, sample_metadata());
        let names: Vec<_> = loaded.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["conv1.bias", "conv1.weight", "fc.weight"]);
        for original in sample_tensors() {
            let got = loaded.get(&original.name).unwrap();
            assert_eq!(got.shape, original.shape);
            assert_eq!(bits(&got.data), bits(&original.data), "{}", original.name);
        }
        // No temporary file is left behind.
        let entries: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(entries.len(), 1);
    }

    #[test]
    fn save_load_save_is_byte_identical() {
        let dir = tempfile::tempdir().unwrap();
        let first = save_sample(dir.path());
        let second = dir.path().join("again.safetensors");
        load(&first).unwrap().save(&second).unwrap();
        assert_eq!(fs::read(&first).unwrap(), fs::read(&second).unwrap());
    }

    #[test]
    fn files_are_valid_for_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = save_sample(dir.path());
        let bytes = fs::read(&path).unwrap();
        let parsed = SafeTensors::deserialize(&bytes).unwrap();
        let view = parsed.tensor("conv1.weight").unwrap();
        assert_eq!(view.dtype(), Dtype::F32);
        assert_eq!(view.shape(), &[4, 3, 3, 3]);
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata().as_ref().unwrap().get("model").unwrap(),
            "lenet5"
        );
    }

    #[test]
    fn overwriting_replaces_the_old_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = save_sample(dir.path());
        let small = NamedTensor::new("w", Shape::new(&[2]), vec![1.0, 2.0]);
        save(&path, &[small.view()], &BTreeMap::new()).unwrap();
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.tensors, vec![small]);
        assert!(loaded.metadata.is_empty());
    }

    #[test]
    fn invalid_saves_are_rejected_without_touching_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let short = NamedTensor::new("w", Shape::nc(2, 3), vec![0.0; 5]);
        let err = save(&path, &[short.view()], &BTreeMap::new()).unwrap_err();
        assert!(matches!(
            err,
            CheckpointError::DataLength {
                expected: 6,
                actual: 5,
                ..
            }
        ));
        let a = NamedTensor::new("w", Shape::new(&[1]), vec![0.0]);
        let err = save(&path, &[a.view(), a.view()], &BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("more than once"), "{err}");
        let reserved = NamedTensor::new(METADATA_KEY, Shape::new(&[1]), vec![0.0]);
        assert!(save(&path, &[reserved.view()], &BTreeMap::new()).is_err());
        assert!(!path.exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn directories_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            load(dir.path()),
            Err(CheckpointError::NotAFile { .. })
        ));
        let missing = dir.path().join("nope.safetensors");
        let err = load(&missing).unwrap_err();
        assert!(matches!(err, CheckpointError::Io { .. }));
        assert!(err.to_string().contains("nope.safetensors"), "{err}");
    }

    #[test]
    fn truncation_and_trailing_garbage_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = save_sample(dir.path());
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let err = load(&path).unwrap_err();
        assert!(matches!(err, CheckpointError::Truncated { .. }), "{err}");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
        let mut longer = bytes.clone();
        longer.push(0);
        fs::write(&path, &longer).unwrap();
        assert!(matches!(
            load(&path),
            Err(CheckpointError::LengthMismatch { .. })
        ));
        fs::write(&path, &bytes[..20]).unwrap();
        assert!(matches!(
            load(&path),
            Err(CheckpointError::Truncated { .. })
        ));
    }

    #[test]
    fn corrupt_header_wraps_the_crate_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let header = b"{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}";
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0; 4]);
        fs::write(&path, &bytes).unwrap();
        let err = load(&path).unwrap_err();
        assert!(
            matches!(err, CheckpointError::CorruptHeader { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("bad.safetensors"), "{err}");
    }

    #[test]
    fn pytorch_step_counters_are_skipped_by_name() {
        // a state_dict's BatchNorm: weight, running_mean and the I64 num_batches_tracked between
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bn.safetensors");
        let (w, count, mean) = (
            [1.5f32, -2.0].map(f32::to_le_bytes).concat(),
            7i64.to_le_bytes(),
            [0.25f32, 4.0].map(f32::to_le_bytes).concat(),
        );
        let view = |dtype, shape: Vec<usize>, data| {
            safetensors::tensor::TensorView::new(dtype, shape, data).unwrap()
        };
        let tensors = [
            ("bn1.weight", view(Dtype::F32, vec![2], &w[..])),
            (
                "bn1.num_batches_tracked",
                view(Dtype::I64, vec![], &count[..]),
            ),
            ("bn1.running_mean", view(Dtype::F32, vec![2], &mean[..])),
        ];
        fs::write(&path, safetensors::serialize(tensors, None).unwrap()).unwrap();
        let ckpt = load(&path).unwrap();
        assert_eq!(ckpt.skipped, ["bn1.num_batches_tracked"]);
        let values: Vec<(&str, &[f32])> = ckpt
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.data[..]))
            .collect();
        assert_eq!(
            values,
            [
                ("bn1.running_mean", &[0.25, 4.0][..]),
                ("bn1.weight", &[1.5, -2.0][..])
            ]
        );
    }

    #[test]
    fn other_dtypes_are_rejected_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ints.safetensors");
        let raw = [0u8; 16];
        let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![2, 2], &raw).unwrap();
        let bytes = safetensors::serialize([("counts", view)], None).unwrap();
        fs::write(&path, bytes).unwrap();
        let err = load(&path).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::UnsupportedDtype { name, dtype: Dtype::I32, .. } if name == "counts"),
            "{err}"
        );
    }

    #[test]
    fn check_against_names_the_offending_tensor() {
        let ckpt = Checkpoint {
            tensors: sample_tensors(),
            ..Checkpoint::default()
        };
        let mut expected: Vec<(String, Shape)> = sample_tensors()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        ckpt.check_against(&expected).unwrap();

        expected[0].1 = Shape::nc(5, 2);
        let err = ckpt.check_against(&expected).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CheckpointError::WrongShape { .. }));
        assert!(
            msg.contains("fc.weight") && msg.contains("(2, 5)") && msg.contains("(5, 2)"),
            "{msg}"
        );

        expected[0].1 = Shape::nc(2, 5);
        expected.push(("fc.bias".to_string(), Shape::new(&[5])));
        let err = ckpt.check_against(&expected).unwrap_err();
        assert!(matches!(&err, CheckpointError::MissingTensor { name, .. } if name == "fc.bias"));

        expected.pop();
        expected.retain(|(n, _)| n != "conv1.bias");
        let err = ckpt.check_against(&expected).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::UnexpectedTensor { name, .. } if name == "conv1.bias")
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("random.safetensors");
            fs::write(&path, &bytes).unwrap();
            prop_assert!(load(&path).is_err());
        }

        #[test]
        fn truncated_or_flipped_files_never_panic(cut in any::<prop::sample::Index>(),
                                                  flip_at in any::<prop::sample::Index>(),
                                                  flip in 1u8..=255) {
            let dir = tempfile::tempdir().unwrap();
            let path = save_sample(dir.path());
            let bytes = fs::read(&path).unwrap();

            let truncated = &bytes[..cut.index(bytes.len())];
            fs::write(&path, truncated).unwrap();
            prop_assert!(load(&path).is_err());

            // A flipped byte may land in tensor data (still a valid file) or in the header (an error);
            // either way, no panic.
            let mut flipped = bytes.clone();
            flipped[flip_at.index(bytes.len())] ^= flip;
            fs::write(&path, &flipped).unwrap();
            let _ = load(&path);

            fs::write(&path, &bytes).unwrap();
            prop_assert!(load(&path).is_ok());
        }
    }
}
