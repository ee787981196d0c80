//! The control protocol between the launcher / job driver and the workers, and between workers:
//! what each message means and its encoding (rkyv, validated on decode). Pure: no sockets here;
//! `net::quic` carries the encoded bytes as control frames, `worker` and `remote` act on them.
//!
//! A conversation is request → reply on one connection, in order, except `Heartbeat`, which a
//! worker sends on its own to the driver of its job, and `Probe`/`ProbeAck` between workers.
//!
//! | request (driver → worker)  | reply (worker → driver)      |
//! |----------------------------|------------------------------|
//! | `Hello`                    | `Welcome`                    |
//! | `MeasureLinks`             | `Links`                      |
//! | `MeasureCosts`             | `Costs`                      |
//! | `StartJob`                 | `JobReady`                   |
//! | `Load`                     | `Loaded`                     |
//! | `Step`                     | `StepDone`                   |
//! | `Stage`                    | none (checked by its `Step`) |
//! | `Read`                     | `ReadDone`                   |
//! | `EndJob`                   | `JobEnded`                   |
//! | `Shutdown`                 | `Bye`, then the worker exits |
//!
//! Any request may be answered by `Failed` instead.

use legion_ops::Precision;
use legion_ops::Rect;
use legion_ops::data::{ImageShape, Normalization};
use legion_runtime::Buffer;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use std::ops::Range;

/// A worker's address as the other workers reach it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct PeerAddress {
    pub name: String,
    /// `address:port`.
    pub endpoint: String,
}

/// One worker of a job and the global device ids it hosts.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct JobHost {
    pub peer: PeerAddress,
    pub first_device: u32,
    pub devices: u32,
}

/// What a worker needs to run its part of a training job: the model, the strategy, who hosts
/// which device, and the training hyper-parameters. Every worker builds the same step plan from
/// it (planning is deterministic), so no task graph travels.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct JobSpec {
    /// `Graph::to_json`.
    pub graph_json: String,
    /// `Strategy::to_json`.
    pub strategy_json: String,
    pub hosts: Vec<JobHost>,
    /// The receiving worker's index in `hosts`.
    pub me: u32,
    pub seed: u64,
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    /// What the job computes in (`fp32`, `tf32`, `bf16`: the driver's `--precision`). On GPUs it
    /// is their math; on cores tf32 is fp32, and bf16 is the CPU backend's bf16 storage. A worker
    /// refuses a value it does not know, naming the field. (Named for its first use, the GPUs'
    /// math; kept so that the wire format stays one field.)
    pub gpu_math: String,
    /// How they pick convolution algorithms (`fastest`, `precise`, `heuristic`: `--conv-algos`).
    pub conv_algos: String,
    /// Where their convolutions apply bias and ReLU (`fused`, `separate`: `--no-fused-epilogue`).
    pub conv_epilogue: String,
    /// Whether the plan has inference beside the step, for [`Control::Infer`] (held-out data
    /// scored on the devices that train).
    pub inference: bool,
    /// Where the workers read the training samples themselves: the `DataSource` (JSON) they
    /// open, whose samples `SampleImages::Read` then names.
    pub data_json: Option<String>,
}

/// A worker's measured op costs ([`Control::Costs`]).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct MeasuredCosts {
    /// `ProfileDb::to_json` of everything its cache holds for its devices.
    pub profile_json: String,
    /// Tiles it timed now (0: the cache had every one).
    pub new_tiles: u64,
    /// Strategies whose steps it timed, of those its search space needs.
    pub strategies_run: u32,
    pub strategies_in_space: u32,
    pub seconds: f64,
    /// Its cache file, on its host.
    pub cache: String,
    /// Why its cache file was not used and was rewritten, where it was not.
    pub refused: Option<String>,
}

/// A job's GPU settings as [`JobSpec`] carries them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFields {
    pub gpu_math: String,
    pub conv_algos: String,
    pub conv_epilogue: String,
}

impl JobSpec {
    /// The GPU settings a job asks for, as [`JobSpec::gpu_math`], [`JobSpec::conv_algos`] and
    /// [`JobSpec::conv_epilogue`] carry them.
    pub fn gpu_fields(settings: legion_cuda::Settings) -> GpuFields {
        GpuFields {
            gpu_math: settings.math.precision().name().to_string(),
            conv_algos: settings.conv_algos.to_string(),
            conv_epilogue: settings.conv_epilogue.to_string(),
        }
    }

    /// What the job computes in ([`JobSpec::gpu_math`]); an error names the field.
    pub fn precision(&self) -> Result<Precision, String> {
        self.gpu_math
            .parse()
            .map_err(|e| format!("job: gpu_math {:?}: {e}", self.gpu_math))
    }

    /// The settings of the job's GPU devices (their buffers move between the streams of a GPU);
    /// an error names the field it cannot read (the bytes came from the network).
    pub fn gpu_settings(&self) -> Result<legion_cuda::Settings, String> {
        let math = match self.precision()? {
            Precision::Fp32 => legion_cuda::Math::StrictFp32,
            Precision::Tf32 => legion_cuda::Math::Tf32,
            Precision::Bf16 => legion_cuda::Math::Bf16,
        };
        let conv_algos = self
            .conv_algos
            .parse()
            .map_err(|e| format!("job: conv_algos: {e}"))?;
        let conv_epilogue = self
            .conv_epilogue
            .parse()
            .map_err(|e| format!("job: conv_epilogue: {e}"))?;
        Ok(legion_cuda::Settings {
            math,
            conv_algos,
            conv_epilogue,
            sharing: legion_cuda::Sharing::AcrossStreams,
        })
    }
}

/// Part of a physical instance: `rect` (as `lo`/`hi` corners) of instance `instance` on `device`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct PieceRef {
    pub device: u32,
    pub instance: u32,
    pub lo: Vec<u64>,
    pub hi: Vec<u64>,
}

impl PieceRef {
    pub fn new(device: usize, instance: u32, rect: &Rect) -> PieceRef {
        let corner = |c: &[usize]| c[..rect.ndim()].iter().map(|&x| x as u64).collect();
        PieceRef {
            device: device as u32,
            instance,
            lo: corner(&rect.lo),
            hi: corner(&rect.hi),
        }
    }

    /// The rect, if the corners make one of `ndim` dims (they may come from the network).
    pub fn rect(&self, ndim: usize) -> Option<Rect> {
        let well_formed = self.lo.len() == ndim
            && self.hi.len() == ndim
            && self.lo.iter().zip(&self.hi).all(|(l, h)| l <= h);
        if !well_formed {
            return None;
        }
        let corner = |c: &[u64]| -> Option<Vec<usize>> {
            c.iter().map(|&x| usize::try_from(x).ok()).collect()
        };
        Some(Rect::new(&corner(&self.lo)?, &corner(&self.hi)?))
    }
}

/// A piece's data, f32, f64 (batch-norm statistics) or bf16 bits, by the instance's type.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum PieceData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<u16>),
}

impl From<Buffer> for PieceData {
    fn from(b: Buffer) -> PieceData {
        match b {
            Buffer::F32(v) => PieceData::F32(v),
            Buffer::F64(v) => PieceData::F64(v),
            Buffer::Bf16(v) => PieceData::Bf16(v),
        }
    }
}

impl From<PieceData> for Buffer {
    fn from(d: PieceData) -> Buffer {
        match d {
            PieceData::F32(v) => Buffer::F32(v),
            PieceData::F64(v) => Buffer::F64(v),
            PieceData::Bf16(v) => Buffer::Bf16(v),
        }
    }
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct Piece {
    pub at: PieceRef,
    pub data: PieceData,
}

/// One device's end of a step.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct DeviceReport {
    pub device: u32,
    pub loss_sum: f64,
    pub correct: u64,
    pub error: Option<String>,
    /// `(op, start, end)` per executed op when traced, seconds since the step started on the
    /// worker.
    pub events: Vec<(u32, f64, f64)>,
}

/// Measured from one worker to another.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct LinkMeasurement {
    pub to: String,
    pub bytes_per_s: f64,
    pub latency_s: f64,
    /// The transport's CPU seconds per byte sent, on the measuring worker.
    pub send_cpu_s_per_byte: f64,
    /// ... and per byte received, on the peer.
    pub recv_cpu_s_per_byte: f64,
}

/// What a worker's network interface carries with every peer probed at once.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct NicMeasurement {
    pub peers: u32,
    /// Bytes per second sent, over all peers together.
    pub bytes_per_s: f64,
}

/// The samples of a step's batch that one worker's devices read (`StepPlan::samples_read`): the
/// images of `image_samples`, the labels of `label_samples`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct StepSamples {
    pub images: SampleImages,
    pub image_samples: Range<u64>,
    pub labels: Vec<u32>,
    pub label_samples: Range<u64>,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum Control {
    Hello {
        version: String,
    },
    Welcome {
        name: String,
        version: String,
        devices: u32,
        pid: u32,
        uptime_s: f64,
        /// The endpoint of the driver whose job runs, if one does.
        job_of: Option<String>,
    },
    /// Measure the link to each peer with `probe_bytes` probes.
    MeasureLinks {
        peers: Vec<PeerAddress>,
        probe_bytes: u64,
    },
    Links {
        links: Vec<LinkMeasurement>,
        /// The measuring worker's network interface, with every peer at once (none without
        /// peers).
        nic: Option<NicMeasurement>,
    },
    /// Between workers: echo `ProbeAck` with the same id.
    Probe {
        id: u64,
        payload: Vec<u8>,
    },
    ProbeAck {
        id: u64,
        /// The acknowledging worker's process CPU seconds so far: the prober takes the
        /// difference between two acks as the cost of receiving the probe between them.
        cpu_s: f64,
        /// Seconds the acknowledging worker spent decoding the probe (which a slice does not pay).
        decode_s: f64,
    },
    /// Time the tiles of `graph_json` (`Graph::to_json`) that the search space of this worker's
    /// devices has and its cost cache lacks, on those devices, in `precision`; answered by
    /// `Costs` once they are in the cache. Refused while a job runs.
    MeasureCosts {
        graph_json: String,
        precision: String,
    },
    /// What `MeasureCosts` left in the worker's cost cache for the model.
    Costs(MeasuredCosts),
    StartJob(JobSpec),
    JobReady,
    /// Initial contents of instances on this worker's devices.
    Load {
        pieces: Vec<Piece>,
    },
    Loaded,
    /// Run step `step` on `samples`, or (`None`) on those a `Stage` sent ahead.
    Step {
        step: u64,
        samples: Option<StepSamples>,
        trace: bool,
        /// The step's learning rate where a schedule sets one (checked: finite, not negative).
        lr: Option<f32>,
    },
    /// The samples of a later step, sent while the worker still runs the current one so that
    /// delivering a batch overlaps computing the one before. No reply where they come as images:
    /// they are checked when their `Step` comes. Samples to read (`SampleImages::Read`) are read
    /// at once, answered by `Staged`.
    Stage {
        step: u64,
        samples: StepSamples,
    },
    /// A `Stage`'s samples read, but for those listed (dataset index, why) that could not be:
    /// then none are staged.
    Staged {
        step: u64,
        unreadable: Vec<(u64, String)>,
    },
    /// Run inference `run` (runs numbered apart from the steps) on `samples`, images only;
    /// answered by `StepDone` with `step: run`, the logits left on the devices for `Read`.
    Infer {
        run: u64,
        samples: StepSamples,
    },
    StepDone {
        step: u64,
        reports: Vec<DeviceReport>,
    },
    Read {
        pieces: Vec<PieceRef>,
    },
    ReadDone {
        pieces: Vec<PieceData>,
    },
    EndJob,
    JobEnded,
    /// Sent by a worker to its job's driver every [`HEARTBEAT_INTERVAL`](crate::worker::HEARTBEAT_INTERVAL).
    Heartbeat {
        seq: u64,
    },
    Shutdown,
    Bye,
    Failed {
        message: String,
    },
}

impl Control {
    /// The variant's name, for errors about unexpected messages.
    pub fn name(&self) -> &'static str {
        match self {
            Control::Hello { .. } => "Hello",
            Control::Welcome { .. } => "Welcome",
            Control::MeasureLinks { .. } => "MeasureLinks",
            Control::Links { .. } => "Links",
            Control::Probe { .. } => "Probe",
            Control::ProbeAck { .. } => "ProbeAck",
            Control::MeasureCosts { .. } => "MeasureCosts",
            Control::Costs(_) => "Costs",
            Control::StartJob(_) => "StartJob",
            Control::JobReady => "JobReady",
            Control::Load { .. } => "Load",
            Control::Loaded => "Loaded",
            Control::Step { .. } => "Step",
            Control::Stage { .. } => "Stage",
            Control::Staged { .. } => "Staged",
            Control::Infer { .. } => "Infer",
            Control::StepDone { .. } => "StepDone",
            Control::Read { .. } => "Read",
            Control::ReadDone { .. } => "ReadDone",
            Control::EndJob => "EndJob",
            Control::JobEnded => "JobEnded",
            Control::Heartbeat { .. } => "Heartbeat",
            Control::Shutdown => "Shutdown",
            Control::Bye => "Bye",
            Control::Failed { .. } => "Failed",
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("malformed control message: {0}")]
pub struct ControlError(String);

pub fn encode(msg: &Control) -> Vec<u8> {
    rkyv::to_bytes::<rancor::Error>(msg)
        .expect("control messages serialize")
        .into_vec()
}

/// Decodes and validates a control message; any byte string is either a message or an error.
pub fn decode(bytes: &[u8]) -> Result<Control, ControlError> {
    // Frame payloads have no alignment guarantee; rkyv's validation needs 16.
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<Control, rancor::Error>(&aligned).map_err(|e| ControlError(e.to_string()))
}

/// The images of [`StepSamples`]: the values the devices read, or the bytes of 8-bit images and
/// the per-channel map that makes them those values (a quarter of the size on the network).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum SampleImages {
    Values(Vec<f32>),
    Bytes {
        bytes: Vec<u8>,
        /// `[C, H, W]` of each image.
        image: [u32; 3],
        scale: [f32; 3],
        offset: [f32; 3],
    },
    /// The samples of these dataset indices in `epoch`, which the worker reads itself from the
    /// job's data (`JobSpec::data_json`).
    Read {
        epoch: u64,
        indices: Vec<u64>,
    },
}

impl SampleImages {
    /// No images (a worker whose devices read none).
    pub fn none() -> SampleImages {
        SampleImages::Values(Vec::new())
    }

    /// Bytes of images: `bytes` of images of shape `image`, made values by `normalization`.
    pub fn bytes(bytes: Vec<u8>, image: ImageShape, normalization: &Normalization) -> SampleImages {
        let (scale, offset) = normalization.affine();
        SampleImages::Bytes {
            bytes,
            image: image.map(|d| u32::try_from(d).unwrap_or(u32::MAX)),
            scale,
            offset,
        }
    }

    /// The values, whose count the caller checks; bytes from the network are refused where
    /// their shape or map is impossible, or is not the model's (`per_sample` values an image).
    pub fn into_values(self, per_sample: usize) -> anyhow::Result<Vec<f32>> {
        match self {
            SampleImages::Values(values) => Ok(values),
            SampleImages::Read { .. } => {
                anyhow::bail!("samples to read come in a Stage, which reads them first")
            }
            SampleImages::Bytes {
                bytes,
                image,
                scale,
                offset,
            } => {
                let image = image.map(|d| d as usize);
                let [channels, height, width] = image;
                let values = channels
                    .checked_mul(height)
                    .and_then(|v| v.checked_mul(width));
                anyhow::ensure!(
                    matches!(channels, 1 | 3) && values == Some(per_sample),
                    "images of {channels}x{height}x{width} bytes, where the model reads \
                     {per_sample} values a sample"
                );
                anyhow::ensure!(
                    bytes.len().is_multiple_of(per_sample.max(1)),
                    "{} image bytes are not whole images of {per_sample}",
                    bytes.len()
                );
                let normalization = Normalization::from_affine(scale, offset)?;
                let mut out = vec![0.0; bytes.len()];
                normalization.values_of(image, &bytes, &mut out);
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Control> {
        vec![
            Control::Hello {
                version: "0.1.0".into(),
            },
            Control::Step {
                step: 7,
                samples: Some(StepSamples {
                    images: SampleImages::Values(vec![1.0, -2.5, f32::MAX]),
                    image_samples: 2..5,
                    labels: vec![3, 0],
                    label_samples: 4..6,
                }),
                trace: true,
                lr: Some(0.025),
            },
            Control::Step {
                step: 8,
                samples: None,
                trace: false,
                lr: None,
            },
            Control::Stage {
                step: 8,
                samples: StepSamples {
                    images: SampleImages::Bytes {
                        bytes: vec![0, 255, 7],
                        image: [1, 1, 3],
                        scale: [0.5, 1.0, 1.0],
                        offset: [-1.0, 0.0, 0.0],
                    },
                    image_samples: 0..0,
                    labels: vec![1],
                    label_samples: 3..4,
                },
            },
            Control::Stage {
                step: 9,
                samples: StepSamples {
                    images: SampleImages::Read {
                        epoch: 2,
                        indices: vec![17, 3, u64::MAX],
                    },
                    image_samples: 0..3,
                    labels: vec![1, 0, 4],
                    label_samples: 0..3,
                },
            },
            Control::Staged {
                step: 9,
                unreadable: vec![(3, "b/1.jpg: gone".into())],
            },
            Control::Infer {
                run: 3,
                samples: StepSamples {
                    images: SampleImages::Values(vec![0.5; 6]),
                    image_samples: 0..2,
                    labels: Vec::new(),
                    label_samples: 0..0,
                },
            },
            Control::Load {
                pieces: vec![Piece {
                    at: PieceRef {
                        device: 2,
                        instance: 9,
                        lo: vec![0, 4],
                        hi: vec![3, 8],
                    },
                    data: PieceData::F64(vec![0.5; 12]),
                }],
            },
            Control::StepDone {
                step: 1,
                reports: vec![DeviceReport {
                    device: 1,
                    loss_sum: 2.0,
                    correct: 3,
                    error: Some("boom".into()),
                    events: vec![(1, 0.0, 0.5)],
                }],
            },
            Control::Failed {
                message: "no".into(),
            },
            Control::StartJob(job_spec()),
        ]
    }

    fn job_spec() -> JobSpec {
        let GpuFields {
            gpu_math,
            conv_algos,
            conv_epilogue,
        } = JobSpec::gpu_fields(legion_cuda::Settings {
            math: legion_cuda::Math::Tf32,
            conv_algos: legion_cuda::ConvAlgos::Precise,
            conv_epilogue: legion_cuda::ConvEpilogue::Separate,
            ..Default::default()
        });
        JobSpec {
            graph_json: "{}".into(),
            strategy_json: "{}".into(),
            hosts: vec![JobHost {
                peer: PeerAddress {
                    name: "w0".into(),
                    endpoint: "127.0.0.1:7400".into(),
                },
                first_device: 0,
                devices: 2,
            }],
            me: 0,
            seed: 1,
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
            gpu_math,
            conv_algos,
            conv_epilogue,
            inference: true,
            data_json: Some("{}".into()),
        }
    }

    #[test]
    fn a_jobs_gpu_settings_round_trip_and_unknown_ones_name_their_field() {
        let spec = job_spec();
        let settings = spec.gpu_settings().unwrap();
        assert_eq!(settings.math, legion_cuda::Math::Tf32);
        assert_eq!(settings.conv_algos, legion_cuda::ConvAlgos::Precise);
        assert_eq!(settings.conv_epilogue, legion_cuda::ConvEpilogue::Separate);
        // buffers move between the streams of a GPU's devices
        assert_eq!(settings.sharing, legion_cuda::Sharing::AcrossStreams);
        for (math, algos, epilogue) in [
            ("fp32", "fastest", "fused"),
            ("tf32", "heuristic", "separate"),
            ("bf16", "precise", "fused"),
        ] {
            let fields = GpuFields {
                gpu_math: math.into(),
                conv_algos: algos.into(),
                conv_epilogue: epilogue.into(),
            };
            let s = JobSpec {
                gpu_math: math.into(),
                conv_algos: algos.into(),
                conv_epilogue: epilogue.into(),
                ..job_spec()
            }
            .gpu_settings()
            .unwrap();
            assert_eq!(JobSpec::gpu_fields(s), fields);
        }
        let bad_math = JobSpec {
            gpu_math: "bf17".into(),
            ..job_spec()
        };
        let e = bad_math.gpu_settings().unwrap_err();
        assert!(e.contains("gpu_math \"bf17\"") && e.contains("tf32"), "{e}");
        let bad_algos = JobSpec {
            conv_algos: "".into(),
            ..job_spec()
        };
        let e = bad_algos.gpu_settings().unwrap_err();
        assert!(e.contains("conv_algos") && e.contains("precise"), "{e}");
        let bad_epilogue = JobSpec {
            conv_epilogue: "inline".into(),
            ..job_spec()
        };
        let e = bad_epilogue.gpu_settings().unwrap_err();
        assert!(e.contains("conv_epilogue") && e.contains("separate"), "{e}");
    }

    #[test]
    fn piece_rects_round_trip_and_malformed_corners_are_refused() {
        let rect = Rect::new(&[0, 2], &[3, 5]);
        let at = PieceRef::new(1, 4, &rect);
        assert_eq!(at.rect(2), Some(rect));
        assert_eq!(at.rect(3), None, "wrong number of dims");
        let inverted = PieceRef {
            lo: vec![4, 2],
            ..at
        };
        assert_eq!(inverted.rect(2), None);
    }

    #[test]
    fn image_bytes_become_their_values_and_impossible_ones_are_refused() {
        let normalization = Normalization::new([0.5, 0.4, 0.3], [0.2, 0.25, 0.5]);
        let bytes: Vec<u8> = (0..24).map(|v| (v * 11) as u8).collect();
        let mut expected = vec![0.0; 24];
        normalization.values_of([3, 2, 2], &bytes, &mut expected);
        let images = SampleImages::bytes(bytes.clone(), [3, 2, 2], &normalization);
        assert_eq!(images.clone().into_values(12).unwrap(), expected);
        // another model's image size, a partial image, a map no dataset makes
        let err = images.into_values(16).unwrap_err().to_string();
        assert!(err.contains("3x2x2") && err.contains("16"), "{err}");
        let partial = SampleImages::bytes(bytes[..20].to_vec(), [3, 2, 2], &normalization);
        let err = partial.into_values(12).unwrap_err().to_string();
        assert!(err.contains("20 image bytes"), "{err}");
        let nan = SampleImages::Bytes {
            bytes,
            image: [3, 2, 2],
            scale: [f32::NAN, 1.0, 1.0],
            offset: [0.0; 3],
        };
        let err = nan.into_values(12).unwrap_err().to_string();
        assert!(err.contains("finite"), "{err}");
        let huge = SampleImages::Bytes {
            bytes: Vec::new(),
            image: [3, u32::MAX, u32::MAX],
            scale: [1.0; 3],
            offset: [0.0; 3],
        };
        assert!(huge.into_values(12).is_err());
    }

    #[test]
    fn messages_round_trip() {
        for msg in samples() {
            assert_eq!(decode(&encode(&msg)).unwrap(), msg);
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn corrupted_messages_never_panic(which in 0usize..5, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut bytes = encode(&samples()[which]);
            for (at, x) in flips {
                let i = at % bytes.len();
                bytes[i] ^= x;
            }
            let _ = decode(&bytes);
        }

        #[test]
        fn truncated_messages_never_panic(which in 0usize..5, keep in 0usize..400) {
            let bytes = encode(&samples()[which]);
            let _ = decode(&bytes[..keep.min(bytes.len())]);
        }
    }
}
