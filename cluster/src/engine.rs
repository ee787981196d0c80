//! Where a training job's steps run, behind one trait: the single-device trainer (on the CPU or a
//! GPU), the embedded cluster of this process, or the worker processes of a cluster. A job and
//! `--compare` start one with [`start`], the one way in, and drive it through [`Engine`] without
//! knowing which it is.

use crate::hosts::Hosts;
use crate::remote::{Images, RemoteCluster};
use legion_ops::backend::Pipeline;
use legion_ops::backend::cpu::{Cpu, CpuStream};
use legion_ops::capture::{CaptureSetting, CaptureStatus};
use legion_ops::data::{ByteImages, DataSource, SyntheticBatch};
use legion_ops::partition::ParallelConfig;
use legion_ops::train::{BatchInput, LossReadback, Sgd, StepStats, Trainer, TrainingState};
use legion_ops::{Graph, Precision};
use legion_runtime::StepReport;
use legion_runtime::plan::StepPlan;
use legion_runtime::{EmbeddedCluster, Placement};
use std::path::Path;

/// Where the steps run.
pub enum Place<'a> {
    /// The single-device reference trainer on the CPU (the configs are ignored), reading each
    /// step's loss back as it says.
    OneDevice(LossReadback),
    /// The single-device trainer on a GPU the caller started (the configs are ignored).
    OneGpu(Box<OneGpu>),
    /// `devices` device actors in this process, placed on its cores or GPUs.
    Embedded {
        devices: usize,
        placement: Placement,
    },
    /// The workers `legion-rs up` started for `hosts`, whose certificates are in `state_dir`;
    /// those on GPUs compute as `gpu` says (its math and convolution algorithms).
    /// With `data`, the workers read the training samples their devices consume themselves.
    Cluster {
        hosts: &'a Hosts,
        state_dir: &'a Path,
        gpu: legion_cuda::Settings,
        data: Option<&'a DataSource>,
    },
}

/// A GPU for the single-device trainer.
pub struct OneGpu {
    pub cuda: legion_cuda::Cuda,
    /// The stream that proved the GPU's libraries load.
    pub stream: legion_cuda::Stream,
    /// Whether the next batch is staged while a step computes.
    pub prefetch: bool,
    /// Whether steps after the first are recorded as a CUDA graph and replayed.
    pub capture: CaptureSetting,
    /// Whether a step's loss is read after the next step is enqueued, or at its own end.
    pub readback: LossReadback,
}

/// What every engine starts from.
pub struct JobStart<'a> {
    pub graph: &'a Graph,
    /// By layer id.
    pub configs: &'a [ParallelConfig],
    /// Weights, momentum and the step to continue from: owned, so that the single-device trainer
    /// takes them over rather than keeping a second copy beside the job's.
    pub state: TrainingState,
    pub sgd: Sgd,
    pub seed: u64,
    /// What the job computes in. A GPU's devices must have been opened in it; a cluster's
    /// workers are told it by `Place::Cluster`'s settings (`JobSpec::gpu_math`).
    pub precision: Precision,
    /// Whether [`Engine::logits`] will be asked for: the devices then plan inference beside
    /// the step.
    pub inference: bool,
}

/// One step's batch.
pub struct StepBatch<'a> {
    /// Empty where the batch is `synthetic` or `bytes`.
    pub images: Vec<f32>,
    /// The images as their bytes, for a cluster's workers to make values (other engines make
    /// them values here).
    pub bytes: Option<ByteImages>,
    pub labels: Vec<u32>,
    /// The batch described for the device to draw, instead of `images` (only the one-device
    /// trainer on a GPU is given such batches).
    pub synthetic: Option<SyntheticBatch>,
    /// The samples by dataset index, instead of `images`: a cluster's workers read them from
    /// the job's data (`Place::Cluster`'s).
    pub to_read: Option<SamplesToRead>,
    /// The following step's batch, if there is one: a cluster job delivers it to the workers
    /// while this step runs, the one-device trainer stages it on its device.
    pub next: Option<NextBatch<'a>>,
    /// Whether to report each device's timeline of this step.
    pub trace: bool,
}

/// A batch's samples as the dataset numbers them, in the epoch that decides their transforms.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplesToRead {
    pub epoch: u64,
    pub indices: Vec<usize>,
}

/// The following step's batch, as [`StepBatch`] holds it.
#[derive(Clone, Copy, Debug)]
pub enum NextBatch<'a> {
    Images(&'a [f32], &'a [u32]),
    Bytes(&'a ByteImages, &'a [u32]),
    Synthetic(&'a SyntheticBatch),
    ToRead(&'a SamplesToRead, &'a [u32]),
}

impl<'a> NextBatch<'a> {
    /// The images (or what the workers read) and labels, where they are in host memory.
    fn images(self) -> Option<(Images<'a>, &'a [u32])> {
        match self {
            NextBatch::Images(images, labels) => Some((Images::Values(images), labels)),
            NextBatch::Bytes(bytes, labels) => Some((Images::Bytes(bytes), labels)),
            NextBatch::ToRead(read, labels) => Some((
                Images::Read {
                    epoch: read.epoch,
                    indices: &read.indices,
                },
                labels,
            )),
            NextBatch::Synthetic(_) => None,
        }
    }
}

impl StepBatch<'_> {
    /// Its images as values, where they came as bytes.
    fn with_values(mut self) -> Self {
        if let Some(bytes) = self.bytes.take() {
            self.images = bytes.values();
        }
        self
    }
}

/// Refuses a described batch: only the one-device trainer draws batches on its device.
fn host_images(batch: &StepBatch<'_>) -> anyhow::Result<()> {
    anyhow::ensure!(
        batch.synthetic.is_none(),
        "this engine takes batches as images: only one GPU draws synthetic batches itself"
    );
    Ok(())
}

/// Refuses samples to read: only a cluster's workers read them.
fn read_images(batch: &StepBatch<'_>) -> anyhow::Result<()> {
    let next_to_read = matches!(batch.next, Some(NextBatch::ToRead(..)));
    anyhow::ensure!(
        batch.to_read.is_none() && !next_to_read,
        "this engine takes batches as images: only a cluster's workers read samples themselves"
    );
    Ok(())
}

/// A running engine.
pub trait Engine {
    /// Runs one step, and returns the loss and accuracy read back meanwhile, and per device its
    /// timeline when traced. Steps report in order, each once: this step's stats, unless the
    /// engine reads a step's loss one step late (the one-device trainer, by default), which
    /// returns the previous step's, or `None` where no step was left to read (its first step).
    fn step(
        &mut self,
        batch: StepBatch<'_>,
    ) -> anyhow::Result<(Option<StepStats>, Vec<StepReport>)>;

    /// Waits for the step still in flight, if any, and returns its stats: after the last step,
    /// and before anything that needs every step's loss read.
    fn finish(&mut self) -> anyhow::Result<Option<StepStats>> {
        Ok(None)
    }

    /// Whether steps return before their loss is read ([`Engine::step`]).
    fn reads_loss_late(&self) -> bool {
        false
    }

    /// Weights, momentum and step as they are now (what a checkpoint saves).
    fn state(&mut self) -> anyhow::Result<TrainingState>;

    /// The logits (`[N, classes]` row-major) of inference on a batch of the graph's batch size,
    /// on the devices that train and with their weights as they are now: batch norm on its
    /// running statistics, dropout passing everything. Every step must have been read back
    /// ([`Engine::finish`]); the engine must have been started with `JobStart::inference`.
    fn logits(&mut self, images: Vec<f32>) -> anyhow::Result<Vec<f32>>;

    /// The learning rate of the steps from the next on: a schedule's.
    fn set_lr(&mut self, lr: f32);

    /// The step plan the devices replay, where there are devices.
    fn plan(&self) -> Option<&StepPlan>;

    /// The last traced step as a Chrome/Perfetto trace, where the engine times its steps itself
    /// (the one-device trainer; the others report per-device timelines from [`Engine::step`]).
    fn own_trace(&mut self) -> Option<serde_json::Value> {
        None
    }

    /// Whether steps are recorded and replayed, where the engine records them itself (the
    /// one-device trainer).
    fn capture_status(&self) -> Option<CaptureStatus> {
        None
    }

    /// Bytes of the messages that carried the steps' samples to other processes so far, where
    /// the engine sends them there (a cluster's workers).
    fn input_bytes_sent(&self) -> Option<u64> {
        None
    }
}

/// Starts the engine of `place` on `job`.
pub fn start(place: Place<'_>, job: JobStart<'_>) -> anyhow::Result<Box<dyn Engine>> {
    Ok(match place {
        Place::OneDevice(readback) => {
            let mut trainer = match job.precision {
                Precision::Bf16 => {
                    let cpu = Cpu::new(Precision::Bf16);
                    let (graph, state) = (job.graph.clone(), job.state);
                    let mut t =
                        Trainer::resume_on(cpu, CpuStream, graph, state, job.sgd, job.seed)?;
                    // The CPU runs each kernel when it is called: nothing to record.
                    t.set_capture(CaptureSetting::Off);
                    t
                }
                // tf32 is fp32 on the CPU, which has no TF32 units.
                Precision::Fp32 | Precision::Tf32 => {
                    Trainer::resume(job.graph.clone(), job.state, job.sgd, job.seed)
                }
            };
            trainer.set_loss_readback(readback);
            Box::new(trainer)
        }
        Place::OneGpu(gpu) => {
            let OneGpu {
                cuda,
                stream,
                prefetch,
                capture,
                readback,
            } = *gpu;
            let mut trainer = Trainer::resume_on(
                cuda,
                stream,
                job.graph.clone(),
                job.state,
                job.sgd,
                job.seed,
            )?;
            trainer.set_prefetch(prefetch);
            trainer.set_capture(capture);
            trainer.set_loss_readback(readback);
            Box::new(trainer)
        }
        Place::Embedded { devices, placement } => Box::new(
            EmbeddedCluster::launch_from(job.graph, job.configs, devices, &job.state)
                .sgd(job.sgd)
                .seed(job.seed)
                .placement(&placement)
                .precision(job.precision)
                .inference(job.inference)
                .start()?,
        ),
        Place::Cluster {
            hosts,
            state_dir,
            gpu,
            data,
        } => Box::new(RemoteCluster::start(
            hosts,
            state_dir,
            job.graph,
            job.configs,
            &job.state,
            job.sgd,
            job.seed,
            gpu,
            job.inference,
            data,
        )?),
    })
}

/// Frees a finished step's images on a thread of its own: handing tens of MB back to the system
/// (an unmap) takes milliseconds that the next step, whose GPU work waits for this thread, should
/// not wait for.
fn retire(images: Vec<f32>) {
    use std::sync::OnceLock;
    use std::sync::mpsc::{Sender, channel};
    static RETIRED: OnceLock<Option<Sender<Vec<f32>>>> = OnceLock::new();
    let retired = RETIRED.get_or_init(|| {
        let (sender, receiver) = channel::<Vec<f32>>();
        std::thread::Builder::new()
            .name("legion-batch-free".into())
            .spawn(move || receiver.into_iter().for_each(drop))
            .ok()
            .map(|_| sender)
    });
    // Without the thread, or with it gone, the images are freed here.
    if let Some(sender) = retired {
        let _ = sender.send(images);
    }
}

/// The one-device trainer on any backend.
impl<B: Pipeline> Engine for Trainer<B> {
    fn step(
        &mut self,
        batch: StepBatch<'_>,
    ) -> anyhow::Result<(Option<StepStats>, Vec<StepReport>)> {
        read_images(&batch)?;
        if batch.trace {
            self.trace_next_step();
        }
        let batch = batch.with_values();
        let next_values = match batch.next {
            Some(NextBatch::Bytes(bytes, _)) => bytes.values(),
            _ => Vec::new(),
        };
        // The next batch is staged on the device while this step computes.
        let next = batch.next.map(|next| match next {
            NextBatch::Images(images, labels) => BatchInput::Images { images, labels },
            NextBatch::Bytes(_, labels) => BatchInput::Images {
                images: &next_values,
                labels,
            },
            NextBatch::Synthetic(described) => BatchInput::Synthetic(described),
            NextBatch::ToRead(..) => unreachable!("refused above"),
        });
        let this = match &batch.synthetic {
            Some(described) => BatchInput::Synthetic(described),
            None => BatchInput::Images {
                images: &batch.images,
                labels: &batch.labels,
            },
        };
        let read = self.step_batch(this, next)?;
        retire(batch.images);
        Ok((read.map(|r| r.stats), Vec::new()))
    }

    fn finish(&mut self) -> anyhow::Result<Option<StepStats>> {
        Ok(Trainer::finish(self)?.map(|r| r.stats))
    }

    fn reads_loss_late(&self) -> bool {
        self.loss_readback() == LossReadback::OneStepLate
    }

    fn set_lr(&mut self, lr: f32) {
        Trainer::set_lr(self, lr);
    }

    fn state(&mut self) -> anyhow::Result<TrainingState> {
        Ok(Trainer::state(self)?)
    }

    fn logits(&mut self, images: Vec<f32>) -> anyhow::Result<Vec<f32>> {
        Ok(Trainer::logits(self, images)?)
    }

    fn plan(&self) -> Option<&StepPlan> {
        None
    }

    fn capture_status(&self) -> Option<CaptureStatus> {
        Some(Trainer::capture_status(self))
    }

    fn own_trace(&mut self) -> Option<serde_json::Value> {
        let calls = self.take_trace()?;
        let mut events = vec![serde_json::json!({
            "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "device 0 (one-device trainer)"},
        })];
        events.extend(calls.iter().map(|c| {
            serde_json::json!({
                "name": c.name, "cat": c.category, "ph": "X", "pid": 0, "tid": 0,
                "ts": c.start * 1e6, "dur": c.seconds * 1e6,
            })
        }));
        Some(serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }))
    }
}

impl Engine for EmbeddedCluster {
    fn step(
        &mut self,
        batch: StepBatch<'_>,
    ) -> anyhow::Result<(Option<StepStats>, Vec<StepReport>)> {
        host_images(&batch)?;
        read_images(&batch)?;
        // Every device is in this process: there is nothing to deliver ahead.
        let batch = batch.with_values();
        let r = EmbeddedCluster::step(self, batch.images, batch.labels, batch.trace)?;
        Ok((Some(r.stats), r.reports))
    }

    fn set_lr(&mut self, lr: f32) {
        EmbeddedCluster::set_lr(self, lr);
    }

    fn state(&mut self) -> anyhow::Result<TrainingState> {
        Ok(EmbeddedCluster::state(self)?)
    }

    fn logits(&mut self, images: Vec<f32>) -> anyhow::Result<Vec<f32>> {
        Ok(EmbeddedCluster::logits(self, images)?)
    }

    fn plan(&self) -> Option<&StepPlan> {
        Some(EmbeddedCluster::plan(self))
    }
}

impl Engine for RemoteCluster {
    fn step(
        &mut self,
        batch: StepBatch<'_>,
    ) -> anyhow::Result<(Option<StepStats>, Vec<StepReport>)> {
        host_images(&batch)?;
        let next = batch.next.and_then(NextBatch::images);
        let images = match (&batch.to_read, &batch.bytes) {
            (Some(read), _) => Images::Read {
                epoch: read.epoch,
                indices: &read.indices,
            },
            (None, Some(bytes)) => Images::Bytes(bytes),
            (None, None) => Images::Values(&batch.images),
        };
        let r = RemoteCluster::step(self, images, &batch.labels, next, batch.trace)?;
        Ok((Some(r.stats), r.reports))
    }

    fn set_lr(&mut self, lr: f32) {
        RemoteCluster::set_lr(self, lr);
    }

    fn state(&mut self) -> anyhow::Result<TrainingState> {
        RemoteCluster::state(self)
    }

    fn logits(&mut self, images: Vec<f32>) -> anyhow::Result<Vec<f32>> {
        RemoteCluster::logits(self, &images)
    }

    fn plan(&self) -> Option<&StepPlan> {
        Some(RemoteCluster::plan(self))
    }

    fn input_bytes_sent(&self) -> Option<u64> {
        Some(RemoteCluster::input_bytes_sent(self))
    }
}
