//! Single-device reference training: whole-tensor forward and backward through the CPU backend
//! (`crate::backend`, each layer one tile), then SGD with momentum and weight decay.
//!
//! This is deliberately independent of the distributed runtime: it is the reference every strategy is
//! checked against (same weights after N steps), so it shares only the kernels and the initialisation.

use crate::backend::cpu::{Buffer, Cpu, CpuStream};
use crate::backend::{
    Access, Backend, BatchView, DType, In, KernelCall, KernelError, Operand, Out, Phase, Pipeline,
    Role, StepContext, fill_host_batch,
};
use crate::capture::{CaptureSetting, CaptureStatus, Recorded, StepCapture, StepRun};
use crate::checkpoint::{self, TensorRef};
use crate::data::SyntheticBatch;
use crate::graph::{Graph, GraphParam, LayerId};
use crate::kernels::softmax_ce::LabelOutOfRange;
use crate::op::{Init, Op};
use crate::rng::{self, Rng};
use crate::shape::{Rect, Shape};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// Stochastic gradient descent with PyTorch's momentum and (coupled) weight decay:
/// `d = g + wd·w; v = μ·v + d; w -= lr·v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            lr: 0.03,
            momentum: 0.9,
            weight_decay: 5e-4,
        }
    }
}

impl Sgd {
    /// Applies one update to `w` given its gradient and momentum buffer.
    pub fn update(&self, w: &mut [f32], grad: &[f32], velocity: &mut [f32]) {
        for ((w, &g), v) in w.iter_mut().zip(grad).zip(velocity.iter_mut()) {
            let d = g + self.weight_decay * *w;
            *v = self.momentum * *v + d;
            *w -= self.lr * *v;
        }
    }
}

/// The values of every parameter and buffer of a graph, in `Graph::params` order.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamStore {
    pub params: Vec<GraphParam>,
    pub values: Vec<Vec<f32>>,
    /// Index of each layer's first parameter in `params`.
    first: Vec<usize>,
}

impl ParamStore {
    /// Seeded initialisation: parameter `i` draws from its own stream, a pure function of
    /// (seed, i), so a model's initial weights never depend on how it will be partitioned.
    pub fn init(graph: &Graph, seed: u64) -> ParamStore {
        let params = graph.params();
        let values = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.spec.shape.numel();
                let mut r = Rng::new(rng::hash(&[seed, i as u64]));
                match p.spec.init {
                    Init::FanInUniform { fan_in } => {
                        let b = 1.0 / (fan_in as f32).sqrt();
                        (0..n).map(|_| r.uniform(-b, b)).collect()
                    }
                    Init::Zeros => vec![0.0; n],
                    Init::Ones => vec![1.0; n],
                }
            })
            .collect();
        ParamStore::from_parts(graph, params, values)
    }

    /// Values in `Graph::params` order (e.g. gathered from the devices of a distributed run).
    pub fn from_values(graph: &Graph, values: Vec<Vec<f32>>) -> ParamStore {
        let params = graph.params();
        assert_eq!(params.len(), values.len(), "one value vector per parameter");
        ParamStore::from_parts(graph, params, values)
    }

    fn from_parts(graph: &Graph, params: Vec<GraphParam>, values: Vec<Vec<f32>>) -> ParamStore {
        // `Graph::params` lists parameters in layer order, so a layer's first slot is the number of
        // parameters of the layers before it.
        let first = (0..graph.layers().len())
            .map(|l| params.partition_point(|p| p.layer.0 < l))
            .collect();
        ParamStore {
            params,
            values,
            first,
        }
    }

    /// Values from a checkpoint, which must hold exactly the graph's parameters and buffers.
    pub fn from_checkpoint(
        graph: &Graph,
        ckpt: checkpoint::Checkpoint,
    ) -> Result<ParamStore, checkpoint::CheckpointError> {
        let params = graph.params();
        let expected: Vec<(String, Shape)> = params
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape))
            .collect();
        ckpt.check_against(&expected)?;
        let mut by_name: BTreeMap<String, Vec<f32>> =
            ckpt.tensors.into_iter().map(|t| (t.name, t.data)).collect();
        let values = params
            .iter()
            .map(|p| by_name.remove(&p.name).expect("checked above"))
            .collect();
        Ok(ParamStore::from_parts(graph, params, values))
    }

    pub fn slot(&self, layer: LayerId, index: usize) -> usize {
        self.first[layer.0] + index
    }

    pub fn get(&self, layer: LayerId, index: usize) -> &[f32] {
        &self.values[self.slot(layer, index)]
    }

    /// Borrowed views of every parameter and buffer, for `checkpoint::save`.
    pub fn tensors(&self) -> Vec<TensorRef<'_>> {
        self.params
            .iter()
            .zip(&self.values)
            .map(|(p, v)| TensorRef {
                name: &p.name,
                shape: p.spec.shape,
                data: v,
            })
            .collect()
    }
}

/// Everything a run needs to continue exactly: parameters and buffers, SGD momentum (by parameter
/// slot; zeros for buffers) and the steps taken.
///
/// As a checkpoint: a safetensors file with the parameters and buffers under their own names (so it
/// also serves as plain weights, e.g. for `--init`), the momentum of each trainable parameter as
/// `momentum/<name>`, and the step in the metadata (`step`).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingState {
    pub params: ParamStore,
    pub momentum: Vec<Vec<f32>>,
    pub step: u64,
}

/// Name prefix of momentum tensors in a checkpoint.
pub const MOMENTUM_PREFIX: &str = "momentum/";

impl TrainingState {
    /// Step 0: the given weights, no momentum yet.
    pub fn start(params: ParamStore) -> TrainingState {
        let momentum = params.values.iter().map(|v| vec![0.0; v.len()]).collect();
        TrainingState {
            params,
            momentum,
            step: 0,
        }
    }

    /// Writes the state atomically, with `metadata` added (e.g. the model name).
    pub fn save(
        &self,
        path: &std::path::Path,
        mut metadata: BTreeMap<String, String>,
    ) -> Result<(), checkpoint::CheckpointError> {
        let momentum_names: Vec<String> = self
            .params
            .params
            .iter()
            .map(|p| format!("{MOMENTUM_PREFIX}{}", p.name))
            .collect();
        let mut tensors = self.params.tensors();
        for ((p, v), name) in self
            .params
            .params
            .iter()
            .zip(&self.momentum)
            .zip(&momentum_names)
        {
            if p.spec.trainable {
                tensors.push(TensorRef {
                    name,
                    shape: p.spec.shape,
                    data: v,
                });
            }
        }
        metadata.insert("step".into(), self.step.to_string());
        checkpoint::save(path, &tensors, &metadata)
    }

    /// Reads a state saved by [`save`](Self::save); a plain weights file (no momentum, no step)
    /// starts at step 0 with zero momentum.
    pub fn from_checkpoint(
        graph: &Graph,
        mut ckpt: checkpoint::Checkpoint,
    ) -> Result<TrainingState, checkpoint::CheckpointError> {
        let step = match ckpt.metadata.get("step") {
            Some(s) => s
                .parse()
                .map_err(|_| checkpoint::CheckpointError::BadMetadata {
                    key: "step".into(),
                    value: s.clone(),
                })?,
            None => 0,
        };
        let (momentum, weights): (Vec<_>, Vec<_>) = std::mem::take(&mut ckpt.tensors)
            .into_iter()
            .partition(|t| t.name.starts_with(MOMENTUM_PREFIX));
        ckpt.tensors = weights;
        let params = ParamStore::from_checkpoint(graph, ckpt)?;
        let mut by_name: BTreeMap<String, checkpoint::NamedTensor> = momentum
            .into_iter()
            .map(|t| (t.name[MOMENTUM_PREFIX.len()..].to_string(), t))
            .collect();
        let mut state = TrainingState::start(params);
        state.step = step;
        for (p, v) in state.params.params.iter().zip(&mut state.momentum) {
            if let Some(t) = by_name.remove(&p.name) {
                if t.shape != p.spec.shape {
                    return Err(checkpoint::CheckpointError::WrongShape {
                        name: t.name,
                        expected: p.spec.shape,
                        found: t.shape,
                    });
                }
                *v = t.data;
            }
        }
        if let Some((_, t)) = by_name.into_iter().next() {
            return Err(checkpoint::CheckpointError::UnexpectedTensor {
                name: t.name,
                found: t.shape,
            });
        }
        Ok(state)
    }
}

/// What one training step measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean softmax cross-entropy over the batch.
    pub loss: f32,
    /// Samples whose arg-max logit is the label.
    pub correct: usize,
    /// Where the one-device trainer's thread spent the step (`None` elsewhere).
    pub host: Option<HostTiming>,
}

/// Where a one-device step's time went on the submitting thread, seconds: enqueuing the step's
/// work, staging the next batch (filling page-locked memory, enqueuing its copies), and waiting
/// for the device to finish the step. Read every step ([`LossReadback::EveryStep`]), the wait
/// follows the step's own enqueue; read one step late, it follows the next step's enqueue and
/// staging, so the device had that much more work queued. Either way a wait near zero means the
/// host is the bottleneck: the device ran out of work before the host asked for the step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostTiming {
    pub enqueue: f64,
    pub stage: f64,
    pub wait: f64,
}

/// When the one-device trainer reads a step's loss back, and so how much the host waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReadback {
    /// Each step waits for its own work and returns its own stats: the device idles while the
    /// host reads them and enqueues the next step.
    EveryStep,
    /// A step returns once enqueued; its stats are read after the next step is enqueued, waiting
    /// only for its own work (a marker behind it), or by [`Trainer::finish`]. At most one step is
    /// in flight, so the batch staged ahead and a replayed step's fixed buffers are reused in
    /// stream order as before.
    OneStepLate,
}

/// A step's stats once read back, and which step they are of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Readout {
    /// Counted from 1: the steps taken once this one ran.
    pub step: u64,
    pub stats: StepStats,
}

/// Trains a graph on one device of any backend: the single-device reference every strategy is
/// checked against (on the CPU), and the one-device run on a GPU.
pub struct Trainer<B: Pipeline = Cpu> {
    graph: Graph,
    /// The graph's parameters and buffers, in `Graph::params` order.
    params: Vec<GraphParam>,
    /// Index of each layer's first parameter in `params`.
    first: Vec<usize>,
    /// The next step's batch, staged while this one computed (see [`Trainer::step_ahead`]).
    /// Declared before the stream, so dropped first: its copies may still be running.
    ahead: Option<Ahead<B::Staged>>,
    /// The step enqueued whose stats are not read yet ([`LossReadback::OneStepLate`]); dropped
    /// before the stream too.
    in_flight: Option<InFlight<B>>,
    backend: B,
    stream: B::Stream,
    /// Values of `params` on the device, and SGD momentum (zeros for buffers).
    weights: Vec<B::Buffer>,
    velocity: Vec<B::Buffer>,
    /// By slot, the working copy the products read instead of the master where the backend's
    /// precision keeps one ([`crate::precision::Precision::working_copy`]: conv2d and dense weights in bf16), cast
    /// from the master after each update.
    working: Vec<Option<B::Buffer>>,
    sgd: Sgd,
    seed: u64,
    step: u64,
    /// Whether the next step is traced, and the last traced step's timeline.
    trace_next: bool,
    trace: Option<Vec<TracedCall>>,
    /// Whether [`Trainer::step_ahead`] stages the next batch during the step (the default).
    prefetch: bool,
    /// Whether steps are recorded and replayed, and the recording.
    capture: StepCapture<B::Graph, B::Buffer>,
    /// When a step's loss is read back.
    readback: LossReadback,
}

/// A step enqueued whose stats are not read yet: its loss report (sent home), a marker behind
/// its work, and what the host measured of it so far.
struct InFlight<B: Pipeline> {
    /// Counted from 1.
    step: u64,
    loss: Option<(B::Loss, usize)>,
    end: B::Marker,
    enqueue: f64,
    stage: f64,
    /// A traced step's markers, timed once it has run.
    spans: Option<Vec<MarkedSpan<B::Marker>>>,
}

/// One kernel call of a traced step: `start` seconds after the step's first marker, lasting
/// `seconds` on the device's stream.
#[derive(Clone, Debug, PartialEq)]
pub struct TracedCall {
    /// Layer and phase, e.g. `conv1.fwd`, `conv1.bwd`, `fc6.update.0`, `sum pool1.grad`.
    pub name: String,
    /// `compute`, `fold` (a gradient summed over consumers), `update` or `copy`.
    pub category: &'static str,
    pub start: f64,
    pub seconds: f64,
}

/// The spans of a traced step, timed once its stream has run them.
fn timeline<B: Backend>(
    backend: &B,
    spans: Vec<MarkedSpan<B::Marker>>,
) -> Result<Vec<TracedCall>, KernelError> {
    let Some((_, _, origin, _)) = spans.first() else {
        return Ok(Vec::new());
    };
    spans
        .iter()
        .map(|(name, category, before, after)| {
            Ok(TracedCall {
                name: name.clone(),
                category,
                start: backend.seconds_between(origin, before)?,
                seconds: backend.seconds_between(before, after)?,
            })
        })
        .collect()
}

/// A batch staged for a later step, with what identifies it: its labels, its length and a
/// sample of its values. Comparing all of a step's images (77 MB for AlexNet at 224) would cost
/// the step milliseconds, so the check is a sample: it tells a job's next batch from another
/// batch, and a caller that stages a batch with `next` must not change it before its step.
struct Ahead<S> {
    staged: S,
    labels: Vec<u32>,
    identity: BatchIdentity,
}

/// What tells a staged batch from another with the same labels.
// One or two per step, never moved in bulk: the size of the images' probe is no concern.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq)]
enum BatchIdentity {
    /// Host images: their length and a sample of their values.
    Images { len: usize, probe: [u32; PROBES] },
    /// Synthetic samples: each one's noise state, a hash of the dataset's seed and the sample.
    Synthetic { noise_states: Vec<u64> },
}

/// Image values sampled from a staged batch, evenly spread over it.
const PROBES: usize = 64;

/// The bits of [`PROBES`] image values spread evenly over a batch (the first and the last
/// included).
fn probe_of(images: &[f32]) -> [u32; PROBES] {
    let n = images.len();
    std::array::from_fn(|k| match n {
        0 => 0,
        _ => images[k * (n - 1) / (PROBES - 1)].to_bits(),
    })
}

/// A step's batch as its caller holds it.
#[derive(Clone, Copy, Debug)]
pub enum BatchInput<'a> {
    /// Images in host memory, laid out as the input layer's output, and their labels.
    Images {
        images: &'a [f32],
        labels: &'a [u32],
    },
    /// Synthetic samples described for the device to draw ([`Pipeline::stage_synthetic`]).
    Synthetic(&'a SyntheticBatch),
}

impl<'a> BatchInput<'a> {
    pub fn labels(&self) -> &'a [u32] {
        match self {
            BatchInput::Images { labels, .. } => labels,
            BatchInput::Synthetic(batch) => &batch.labels,
        }
    }

    /// Values of the batch's images.
    fn images_len(&self) -> usize {
        match self {
            BatchInput::Images { images, .. } => images.len(),
            BatchInput::Synthetic(batch) => batch.len() * batch.sample_len(),
        }
    }

    /// The host images, where the caller holds them.
    fn host_images(&self) -> &'a [f32] {
        match self {
            BatchInput::Images { images, .. } => images,
            BatchInput::Synthetic(_) => &[],
        }
    }

    fn identity(&self) -> BatchIdentity {
        match self {
            BatchInput::Images { images, .. } => BatchIdentity::Images {
                len: images.len(),
                probe: probe_of(images),
            },
            BatchInput::Synthetic(batch) => BatchIdentity::Synthetic {
                noise_states: batch.noise_states.clone(),
            },
        }
    }
}

impl<S> Ahead<S> {
    fn is_of(&self, batch: &BatchInput<'_>) -> bool {
        self.labels == batch.labels() && self.identity == batch.identity()
    }
}

impl Trainer<Cpu> {
    pub fn new(graph: Graph, params: ParamStore, sgd: Sgd, seed: u64) -> Trainer<Cpu> {
        let state = TrainingState::start(params);
        Trainer::resume(graph, state, sgd, seed)
    }

    /// Continues from a saved state: same weights, momentum and step count (dropout masks and
    /// data order depend on the step), so the run goes on as if it had never stopped.
    pub fn resume(graph: Graph, state: TrainingState, sgd: Sgd, seed: u64) -> Trainer<Cpu> {
        // Host memory is the CPU's device memory: the values move in, uncopied.
        let TrainingState {
            params,
            momentum,
            step,
        } = state;
        Trainer {
            first: params.first,
            params: params.params,
            working: (0..params.values.len()).map(|_| None).collect(),
            weights: params.values.into_iter().map(Buffer::F32).collect(),
            velocity: momentum.into_iter().map(Buffer::F32).collect(),
            graph,
            backend: Cpu::default(),
            stream: CpuStream,
            sgd,
            seed,
            step,
            ahead: None,
            prefetch: true,
            // The CPU runs each kernel when it is called: nothing to record.
            capture: StepCapture::new(CaptureSetting::Off),
            trace_next: false,
            trace: None,
            // The same ordering as on a device, so that the CPU's tests cover it.
            readback: LossReadback::OneStepLate,
            in_flight: None,
        }
    }
}

impl<B: Pipeline> Trainer<B> {
    /// Continues from `state` on `backend`'s device, its weights and momentum uploaded on `stream`.
    pub fn resume_on(
        backend: B,
        mut stream: B::Stream,
        graph: Graph,
        state: TrainingState,
        sgd: Sgd,
        seed: u64,
    ) -> Result<Trainer<B>, KernelError> {
        let upload = |values: Vec<Vec<f32>>, stream: &mut B::Stream| {
            values
                .into_iter()
                .map(|v| backend.upload(stream, &Buffer::F32(v)))
                .collect::<Result<Vec<_>, _>>()
        };
        let weights = upload(state.params.values, &mut stream)?;
        let velocity = upload(state.momentum, &mut stream)?;
        let precision = backend.precision();
        let first = &state.params.first;
        let working = state
            .params
            .params
            .iter()
            .enumerate()
            .map(|(slot, p)| {
                let op = &graph.layer(p.layer).op;
                if !precision.working_copy(op, slot - first[p.layer.0]) {
                    return Ok(None);
                }
                let rect = p.spec.shape.full_rect();
                let mut copy = backend.alloc(&mut stream, DType::Bf16, rect.volume())?;
                cast_over(&backend, &mut stream, rect, &weights[slot], &mut copy);
                Ok(Some(copy))
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        Ok(Trainer {
            working,
            graph,
            params: state.params.params,
            first: state.params.first,
            backend,
            stream,
            weights,
            velocity,
            sgd,
            seed,
            step: state.step,
            ahead: None,
            prefetch: true,
            capture: StepCapture::new(CaptureSetting::On),
            trace_next: false,
            trace: None,
            readback: LossReadback::OneStepLate,
            in_flight: None,
        })
    }

    /// Times every kernel call of the next step on the device (a pair of the backend's markers
    /// around each), for [`Trainer::take_trace`].
    pub fn trace_next_step(&mut self) {
        self.trace_next = true;
    }

    /// The timeline of the last traced step, in the order its calls were enqueued.
    pub fn take_trace(&mut self) -> Option<Vec<TracedCall>> {
        self.trace.take()
    }

    /// Whether [`Trainer::step_ahead`] stages the next batch while a step computes (on by
    /// default; off, each step moves its own batch first, as a measurement of what prefetching
    /// saves).
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
        if !on {
            self.ahead = None;
        }
    }

    /// When a step's stats are read back: one step late by default. Switch only with no step
    /// in flight ([`Trainer::finish`] first).
    pub fn set_loss_readback(&mut self, readback: LossReadback) {
        assert!(
            self.in_flight.is_none(),
            "the loss readback changed with a step in flight: call Trainer::finish first"
        );
        self.readback = readback;
    }

    pub fn loss_readback(&self) -> LossReadback {
        self.readback
    }

    /// The state to checkpoint (copied from the device), after every step enqueued; a step
    /// still in flight keeps its stats for [`Trainer::finish`] or the next step.
    pub fn state(&mut self) -> Result<TrainingState, KernelError> {
        let params = self.params()?;
        let momentum = download_all(&self.backend, &mut self.stream, &self.velocity)?;
        Ok(TrainingState {
            params,
            momentum,
            step: self.step,
        })
    }

    /// The parameters and buffers (copied from the device), after every step enqueued.
    pub fn params(&mut self) -> Result<ParamStore, KernelError> {
        // A failure kept on the stream (a step in flight that failed) is reported, not hidden
        // behind values the failed work left.
        self.backend.synchronize(&mut self.stream)?;
        let values = download_all(&self.backend, &mut self.stream, &self.weights)?;
        Ok(ParamStore {
            params: self.params.clone(),
            values,
            first: self.first.clone(),
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One forward, backward and update on a batch of `graph.batch()` samples (host memory),
    /// waiting for its stats. Labels are checked first, so a bad batch leaves the trainer as it
    /// was.
    pub fn step(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, KernelError> {
        self.step_ahead(images, labels, None)
    }

    /// [`Trainer::step`], staging `next` (the following step's batch) on the device while this
    /// step computes: on a GPU its copy then runs beside the kernels instead of before the next
    /// step's first one. A next step given another batch than the staged one (other labels, other
    /// length, or other values at the sampled positions) stages its own; the caller must not
    /// change a batch between passing it as `next` and passing it to its step. Waits for the
    /// step's stats, whatever the readback: a step of [`Trainer::step_batch`] whose stats are
    /// still in flight must be read ([`Trainer::finish`]) first.
    pub fn step_ahead(
        &mut self,
        images: &[f32],
        labels: &[u32],
        next: Option<(&[f32], &[u32])>,
    ) -> Result<StepStats, KernelError> {
        assert!(
            self.in_flight.is_none(),
            "Trainer::step_ahead with the stats of an earlier step unread: call Trainer::finish"
        );
        let next = next.map(|(images, labels)| BatchInput::Images { images, labels });
        let read = match self.step_batch(BatchInput::Images { images, labels }, next)? {
            Some(read) => read,
            None => self.finish()?.expect("the step just enqueued is in flight"),
        };
        Ok(read.stats)
    }

    /// Waits for the step in flight, if any, and returns its stats: after a run's last step, or
    /// wherever the caller needs them now.
    pub fn finish(&mut self) -> Result<Option<Readout>, KernelError> {
        match self.in_flight.take() {
            Some(step) => self.read_back(step).map(Some),
            None => Ok(None),
        }
    }

    /// Whether a step's stats are still to be read ([`Trainer::finish`]).
    pub fn has_step_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// [`Trainer::step_ahead`] for batches held either way (synthetic batches described for the
    /// device to draw, as well as host images), returning once the step is enqueued, with the
    /// stats read back meanwhile: read every step, this step's; read one step late (the
    /// default), the previous step's, or none after a [`Trainer::finish`] (or at the first
    /// step). Steps are read in order, each once; a step that fails to enqueue leaves the one in
    /// flight to read. A failure of the device's work is reported by the read that waits for it
    /// or a later one.
    pub fn step_batch(
        &mut self,
        batch: BatchInput<'_>,
        next: Option<BatchInput<'_>>,
    ) -> Result<Option<Readout>, KernelError> {
        let labels = batch.labels();
        check_labels(&self.graph, labels)?;
        let started = std::time::Instant::now();
        let expected = self.graph.layer(self.graph.input()).shape.numel();
        assert_eq!(
            batch.images_len(),
            expected,
            "batch images do not match the input shape"
        );
        let images = batch.host_images();
        let traced = std::mem::take(&mut self.trace_next);
        let run = self.capture.plan(traced);
        let (b, stream) = (&self.backend, &mut self.stream);
        let pass = Pass::new(
            &self.graph,
            &self.params,
            &self.first,
            self.sgd,
            images,
            labels,
            self.seed,
            self.step,
        )
        .traced(traced);
        let before = pass.mark(b, stream)?;
        let staged = match (self.ahead.take(), batch) {
            (Some(ahead), _) if ahead.is_of(&batch) => ahead.staged,
            (_, BatchInput::Images { images, labels }) => b.stage_batch(stream, images, labels)?,
            (_, BatchInput::Synthetic(synthetic)) => b.stage_synthetic(stream, synthetic)?,
        };
        let taken = b.take_staged(stream, staged)?;
        pass.record(b, stream, before, || "data.wait".into(), "copy")?;
        // A step recorded or replayed reads its images where the recording does: they move there
        // (a device copy), and the staged buffer goes back at once.
        let mut staged_images = None;
        let mut fresh_fixed = None;
        if run == StepRun::Enqueued {
            staged_images = Some(taken);
        } else {
            let rect = self.graph.layer(self.graph.input()).shape.full_rect();
            let fixed = match (run, self.capture.recording_mut()) {
                (StepRun::Replay, Some(recorded)) => &mut recorded.images,
                _ => fresh_fixed.insert(b.alloc(stream, DType::F32, expected)?),
            };
            let from = In { rect, mem: &taken };
            let moved = b.fix_step(stream, self.step, from, Out { rect, mem: fixed });
            b.recycle_staged(stream, taken);
            moved?;
        }
        // The next batch goes into the other host buffers on another thread while this one
        // enqueues the step; its copies are enqueued once both are done.
        let next = next.filter(|n| {
            self.prefetch
                && n.images_len() == expected
                && check_labels(&self.graph, n.labels()).is_ok()
        });
        // A synthetic batch is described, not filled: its device buffers are taken now, and it
        // is drawn (on a GPU, by the device) once the step is enqueued.
        let mut host_next = match next {
            Some(BatchInput::Images {
                images: i,
                labels: l,
            }) => Some((b.begin_stage(stream, i.len(), l.len())?, i, l)),
            _ => None,
        };
        let synthetic_next = match next {
            Some(BatchInput::Synthetic(synthetic)) => {
                Some((b.begin_synthetic(stream, synthetic)?, synthetic))
            }
            _ => None,
        };
        let (weights, velocity) = (&mut self.weights, &mut self.velocity);
        let working = &mut self.working;
        let (params, first) = (&self.params, &self.first);
        // Enqueues the step's kernels on the images: the loss, with the samples it averages over.
        // Every buffer the step allocates is dropped before this returns (freed in stream order
        // after its last reader; while recording, within the recording).
        let mut enqueue = |stream: &mut B::Stream, images: &B::Buffer| {
            let (acts, loss, saved) = pass.forward(b, stream, weights, working, images)?;
            let grads = pass.backward(b, stream, weights, working, &acts, &saved)?;
            for (slot, grad) in grads.into_iter().enumerate() {
                let Some(grad) = grad else { continue };
                let p = &params[slot];
                let rect = p.spec.shape.full_rect();
                let param = (slot - first[p.layer.0]) as u8;
                let operands = vec![
                    read(Role::ParamGrad(param), rect, &grad),
                    write(Role::Param(param), rect, &mut weights[slot]),
                    write(Role::Velocity(param), rect, &mut velocity[slot]),
                ];
                pass.run(b, stream, p.layer, rect, Phase::Update { param }, operands)?;
                if let Some(copy) = &mut working[slot] {
                    cast_over(b, stream, rect, &weights[slot], copy);
                }
            }
            Ok::<_, KernelError>(loss)
        };
        let recording = self.capture.recording();
        let (staged_ref, fixed_ref) = (staged_images.as_ref(), fresh_fixed.as_ref());
        let mut work = |stream: &mut B::Stream| -> (Result<_, KernelError>, CaptureEvent<_>) {
            match run {
                StepRun::Enqueued => {
                    let images = staged_ref.expect("an enqueued step reads its staged images");
                    (enqueue(stream, images), CaptureEvent::Unchanged)
                }
                StepRun::Replay => {
                    let recorded = recording.expect("a replay is planned with a recording");
                    match b.replay(stream, &recorded.graph) {
                        Ok(losses) => (
                            Ok(losses.into_iter().last().zip(recorded.loss_samples)),
                            CaptureEvent::Unchanged,
                        ),
                        Err(e) => {
                            let why = format!("replaying the recorded step failed: {e}");
                            (Err(e), CaptureEvent::GaveUp(why))
                        }
                    }
                }
                StepRun::Record => {
                    let images = fixed_ref.expect("a recorded step has its fixed images");
                    let recorded = b.begin_capture(stream).and_then(|()| {
                        // The loss kernels report into the stream's own totals while recording:
                        // replays read them (the report enqueued here is empty).
                        let samples = enqueue(stream, images).map(|loss| loss.map(|(_, n)| n));
                        samples.and_then(|loss_samples| {
                            let graph = b.end_capture(stream)?;
                            Ok((graph, loss_samples))
                        })
                    });
                    let (graph, loss_samples) = match recorded {
                        Ok(recorded) => recorded,
                        Err(e) => {
                            // The step runs as enqueued after all.
                            b.abandon_capture(stream);
                            let why = format!("recording the step failed: {e}");
                            return (enqueue(stream, images), CaptureEvent::GaveUp(why));
                        }
                    };
                    match b.replay(stream, &graph) {
                        Ok(losses) => (
                            Ok(losses.into_iter().last().zip(loss_samples)),
                            CaptureEvent::Recorded(graph, loss_samples),
                        ),
                        Err(e) => {
                            let why = format!("launching the recorded step failed: {e}");
                            (Err(e), CaptureEvent::GaveUp(why))
                        }
                    }
                }
            }
        };
        let (enqueued, filled) = std::thread::scope(|scope| {
            let filler = match &mut host_next {
                Some((host, i, l)) => {
                    let slices = B::host_slices(host)?;
                    Some(scope.spawn(move || fill_host_batch(slices, i, l)))
                }
                None => None,
            };
            let enqueued = work(stream);
            let filled = std::time::Instant::now();
            if let Some(filler) = filler
                && let Err(panic) = filler.join()
            {
                std::panic::resume_unwind(panic);
            }
            Ok::<_, KernelError>((enqueued, filled))
        })?;
        let (loss, event) = enqueued;
        let ran_enqueued = match event {
            CaptureEvent::Unchanged => run == StepRun::Enqueued,
            CaptureEvent::Recorded(graph, loss_samples) => {
                let images = fresh_fixed
                    .take()
                    .expect("a recorded step has its fixed images");
                self.capture.recorded(Recorded {
                    graph,
                    images,
                    loss_samples,
                });
                false
            }
            CaptureEvent::GaveUp(why) => {
                self.capture.give_up(why);
                run == StepRun::Record
            }
        };
        let (b, stream) = (&self.backend, &mut self.stream);
        if let Some(images) = staged_images {
            b.recycle_staged(stream, images);
        }
        // Dropped in stream order after the step's last reader.
        drop(fresh_fixed);
        let loss = loss?;
        let enqueued = filled;
        if let Some((host, i, l)) = host_next {
            self.ahead = Some(Ahead {
                staged: b.finish_stage(stream, host)?,
                labels: l.to_vec(),
                identity: BatchIdentity::Images {
                    len: i.len(),
                    probe: probe_of(i),
                },
            });
        } else if let Some((host, synthetic)) = synthetic_next {
            self.ahead = Some(Ahead {
                staged: b.finish_synthetic(stream, host, synthetic)?,
                labels: synthetic.labels.clone(),
                identity: BatchInput::Synthetic(synthetic).identity(),
            });
        }
        let staged = std::time::Instant::now();
        // The report moves to host memory behind the step's work, and a marker goes behind it:
        // reading the step then waits for this step alone, not for the one enqueued after it.
        let loss = match loss {
            Some((loss, samples)) => Some((b.send_loss_home(stream, loss)?, samples)),
            None => None,
        };
        let end = b.mark(stream)?;
        // Counted once enqueued: the next step's plan is made before this one is read back.
        if ran_enqueued {
            self.capture.ran_enqueued(traced);
        }
        self.step += 1;
        let this_step = InFlight {
            step: self.step,
            loss,
            end,
            enqueue: (enqueued - started).as_secs_f64(),
            stage: (staged - enqueued).as_secs_f64(),
            spans: pass.spans.map(RefCell::into_inner),
        };
        match settle(self.readback, &mut self.in_flight, this_step) {
            Some(step) => self.read_back(step).map(Some),
            None => Ok(None),
        }
    }

    /// Waits for a step's work (its marker), then reads its stats and its trace.
    fn read_back(&mut self, step: InFlight<B>) -> Result<Readout, KernelError> {
        let waiting = std::time::Instant::now();
        self.backend.wait_for(&mut self.stream, &step.end)?;
        let host = Some(HostTiming {
            enqueue: step.enqueue,
            stage: step.stage,
            wait: waiting.elapsed().as_secs_f64(),
        });
        if let Some(spans) = step.spans {
            self.trace = Some(timeline(&self.backend, spans)?);
        }
        let (loss, correct) = match step.loss {
            Some((loss, samples)) => {
                let sums = self.backend.read_loss(loss);
                ((sums.loss_sum / samples as f64) as f32, sums.correct)
            }
            // A graph without a loss layer trains nothing to report.
            None => (0.0, 0),
        };
        Ok(Readout {
            step: step.step,
            stats: StepStats {
                loss,
                correct,
                host,
            },
        })
    }

    /// Whether steps are recorded and replayed ([`crate::capture`]): on by default on a device
    /// (`resume_on`), off for the CPU reference (`new`, `resume`), which cannot record. Off,
    /// every step's kernels are enqueued one by one.
    pub fn set_capture(&mut self, setting: CaptureSetting) {
        self.capture.set(setting);
    }

    /// Where capture stands: off, warming up, replaying, or given up and why.
    pub fn capture_status(&self) -> CaptureStatus {
        self.capture.status()
    }
}

/// `to = from` over `rect`, rounded to `to`'s type: a parameter's bf16 working copy from its fp32
/// master, or the images as a bf16 run's first activation.
fn cast_over<B: Backend>(
    b: &B,
    stream: &mut B::Stream,
    rect: Rect,
    from: &B::Buffer,
    to: &mut B::Buffer,
) {
    b.cast(stream, In { rect, mem: from }, Out { rect, mem: to });
}

/// Which step is read once `enqueued` is: itself, read every step; read one step late, the
/// one in flight before it (none at the first step), `enqueued` taking its place.
fn settle<T>(readback: LossReadback, in_flight: &mut Option<T>, enqueued: T) -> Option<T> {
    match readback {
        LossReadback::EveryStep => {
            debug_assert!(in_flight.is_none(), "read every step: none left in flight");
            Some(enqueued)
        }
        LossReadback::OneStepLate => in_flight.replace(enqueued),
    }
}

/// What became of capture in a step.
enum CaptureEvent<G> {
    Unchanged,
    /// The step was recorded (the graph, and the samples its loss averages over).
    Recorded(G, Option<usize>),
    GaveUp(String),
}

/// Every label below the class count of every loss layer (its input's channels).
fn check_labels(graph: &Graph, labels: &[u32]) -> Result<(), LabelOutOfRange> {
    for layer in graph.layers() {
        if let Op::SoftmaxCrossEntropy(_) = layer.op {
            let classes = graph.layer(layer.inputs[0]).shape.dim(1);
            if let Some((sample, &label)) = labels
                .iter()
                .enumerate()
                .find(|(_, l)| **l as usize >= classes)
            {
                return Err(LabelOutOfRange {
                    sample,
                    label,
                    classes,
                });
            }
        }
    }
    Ok(())
}

/// Host copies of f32 device buffers.
fn download_all<B: Backend>(
    backend: &B,
    stream: &mut B::Stream,
    buffers: &[B::Buffer],
) -> Result<Vec<Vec<f32>>, KernelError> {
    buffers
        .iter()
        .map(|b| Ok(backend.download(stream, b)?.into_f32()))
        .collect()
}

fn read<M>(role: Role, rect: Rect, mem: &M) -> Operand<'_, M> {
    Operand {
        role,
        rect,
        access: Access::Read(mem),
    }
}

fn write<M>(role: Role, rect: Rect, mem: &mut M) -> Operand<'_, M> {
    Operand {
        role,
        rect,
        access: Access::Write(mem),
    }
}

/// Write operands `role(k)` for the present buffers, each laid out over `rects[k]`.
fn writes<'b, M>(
    role: fn(u8) -> Role,
    rects: &[Rect],
    buffers: &'b mut [Option<M>],
) -> Vec<Operand<'b, M>> {
    buffers
        .iter_mut()
        .zip(rects)
        .enumerate()
        .filter_map(|(k, (b, &rect))| b.as_mut().map(|b| write(role(k as u8), rect, b)))
        .collect()
}

/// Two distinct elements of a slice, both writable.
fn two_mut<T>(items: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert!(a < b, "two_mut wants a < b");
    let (head, tail) = items.split_at_mut(b);
    (&mut head[a], &mut tail[0])
}

/// The `[3, C]` f64 sums of a batch-norm layer with `channels` channels, whole.
fn sums_rect(channels: usize) -> Rect {
    Shape::new(&[3, channels]).full_rect()
}

/// Every layer's output in a pass: the input layer's is the batch's images, borrowed (or, where
/// activations are bf16, their cast, at `outputs[input]`).
struct Acts<'i, M> {
    images: &'i M,
    input: usize,
    /// By layer index; `None` at the input layer.
    outputs: Vec<Option<M>>,
}

impl<M> Acts<'_, M> {
    /// A layer's output: the input layer's is the images, or their cast where activations are
    /// not f32.
    fn of(&self, layer: LayerId) -> &M {
        match (&self.outputs[layer.0], layer.0 == self.input) {
            (Some(output), _) => output,
            (None, true) => self.images,
            (None, false) => panic!("a layer's output is computed before it is read"),
        }
    }
}

/// Per-layer state the backward pass needs from the forward pass: the batch statistics (`[3, C]`
/// sums) of each batch-norm layer, by layer index.
struct Saved<M> {
    moments: BTreeMap<usize, M>,
}

/// One forward/backward pass over the whole batch: every layer is one tile, the whole tensor.
/// Traced, it keeps a pair of the backend's markers `K` around each kernel call.
struct Pass<'a, K> {
    graph: &'a Graph,
    params: &'a [GraphParam],
    first: &'a [usize],
    ctx: StepContext<'a>,
    spans: Option<RefCell<Vec<MarkedSpan<K>>>>,
}

/// A traced call: its name, category and the markers before and after it.
type MarkedSpan<M> = (String, &'static str, M, M);

impl<'a, K> Pass<'a, K> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        graph: &'a Graph,
        params: &'a [GraphParam],
        first: &'a [usize],
        sgd: Sgd,
        images: &'a [f32],
        labels: &'a [u32],
        seed: u64,
        step: u64,
    ) -> Pass<'a, K> {
        let batch = graph.batch();
        Pass {
            graph,
            params,
            first,
            ctx: StepContext {
                seed,
                step,
                sgd,
                batch: BatchView::whole(images, labels, batch),
            },
            spans: None,
        }
    }

    fn traced(mut self, on: bool) -> Self {
        self.spans = on.then(|| RefCell::new(Vec::new()));
        self
    }

    fn full(&self, layer: LayerId) -> Rect {
        self.graph.layer(layer).shape.full_rect()
    }

    fn slot(&self, layer: LayerId, index: usize) -> usize {
        self.first[layer.0] + index
    }

    /// Read operands for every parameter (and buffer) of `layer`: its working copy where it has
    /// one, else the master.
    fn param_operands<'b, M>(
        &self,
        layer: LayerId,
        weights: &'b [M],
        working: &'b [Option<M>],
    ) -> Vec<Operand<'b, M>> {
        let end = self
            .first
            .get(layer.0 + 1)
            .copied()
            .unwrap_or(self.params.len());
        (self.first[layer.0]..end)
            .map(|slot| {
                let k = slot - self.first[layer.0];
                let rect = self.params[slot].spec.shape.full_rect();
                let value = working[slot].as_ref().unwrap_or(&weights[slot]);
                read(Role::Param(k as u8), rect, value)
            })
            .collect()
    }

    fn run<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
        layer: LayerId,
        tile: Rect,
        phase: Phase,
        operands: Vec<Operand<'_, B::Buffer>>,
    ) -> Result<Option<B::Loss>, KernelError> {
        let before = self.mark(backend, stream)?;
        let mut call = KernelCall::new(
            backend, stream, self.graph, layer, tile, &self.ctx, operands,
        );
        call.run(phase)?;
        let loss = call.loss.take();
        let category = match phase {
            Phase::Update { .. } => "update",
            _ => "compute",
        };
        let name = || {
            let what = match phase {
                Phase::Forward => "fwd".to_string(),
                Phase::Backward => "bwd".to_string(),
                Phase::Update { param } => format!("update.{param}"),
                other => format!("{other:?}"),
            };
            format!("{}.{what}", self.graph.layer(layer).name)
        };
        self.record(backend, stream, before, name, category)?;
        Ok(loss)
    }

    /// A marker on the stream when this pass is traced.
    fn mark<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
    ) -> Result<Option<K>, KernelError> {
        match &self.spans {
            Some(_) => backend.mark(stream).map(Some),
            None => Ok(None),
        }
    }

    /// Keeps the span from `before` to now under `name()`, when traced (the name is made only
    /// then: an untraced step formats nothing).
    fn record<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
        before: Option<K>,
        name: impl FnOnce() -> String,
        category: &'static str,
    ) -> Result<(), KernelError> {
        if let (Some(spans), Some(before)) = (&self.spans, before) {
            let after = backend.mark(stream)?;
            spans.borrow_mut().push((name(), category, before, after));
        }
        Ok(())
    }

    /// Every layer's output, the pending loss with the number of samples it sums over, and what
    /// backward needs. `images` holds the batch (a taken [`Pipeline::stage_batch`], or the
    /// buffer a recorded step reads): the input layer's output, borrowed and never copied.
    #[allow(clippy::type_complexity)]
    fn forward<'i, B: Backend<Marker = K>>(
        &self,
        b: &B,
        stream: &mut B::Stream,
        weights: &mut [B::Buffer],
        working: &[Option<B::Buffer>],
        images: &'i B::Buffer,
    ) -> Result<
        (
            Acts<'i, B::Buffer>,
            Option<(B::Loss, usize)>,
            Saved<B::Buffer>,
        ),
        KernelError,
    > {
        let g = self.graph;
        let input_layer = g.input();
        let mut acts = Acts {
            images,
            input: input_layer.0,
            outputs: Vec::with_capacity(g.layers().len()),
        };
        let mut saved = Saved {
            moments: BTreeMap::new(),
        };
        let mut loss = None;
        let precision = b.precision();
        for id in g.ids() {
            let layer = g.layer(id);
            let tile = self.full(id);
            if id == input_layer {
                // The images as the first activation: cast once where activations are not f32.
                let cast = match DType::activation(precision) {
                    DType::F32 => None,
                    dtype => {
                        let mut cast = b.alloc(stream, dtype, layer.shape.numel())?;
                        cast_over(b, stream, tile, images, &mut cast);
                        Some(cast)
                    }
                };
                acts.outputs.push(cast);
                continue;
            }
            let dtype = DType::output(&layer.op, precision);
            let mut y = b.alloc(stream, dtype, layer.shape.numel())?;
            let mut operands: Vec<Operand<'_, B::Buffer>> = layer
                .inputs
                .iter()
                .enumerate()
                .map(|(k, &src)| read(Role::Input(k as u8), self.full(src), acts.of(src)))
                .collect();
            if let Op::BatchNorm(_) = layer.op {
                let channels = layer.shape.dim(1);
                let sums = sums_rect(channels);
                let mut moments = b.alloc(stream, DType::F64, 3 * channels)?;
                let x = read(Role::Input(0), tile, acts.of(layer.inputs[0]));
                let first = vec![x, write(Role::Moments, sums, &mut moments)];
                self.run(b, stream, id, tile, Phase::BnMoments, first)?;
                operands.push(read(Role::Moments, sums, &moments));
                operands.extend(self.param_operands(id, weights, working));
                operands.push(write(Role::Output, tile, &mut y));
                self.run(b, stream, id, tile, Phase::BnNormalize, operands)?;
                let slice = Shape::new(&[channels]).full_rect();
                let (mean, var) = two_mut(weights, self.slot(id, 2), self.slot(id, 3));
                let running = vec![
                    read(Role::Moments, sums, &moments),
                    write(Role::Param(2), slice, mean),
                    write(Role::Param(3), slice, var),
                ];
                self.run(b, stream, id, slice, Phase::BnRunning, running)?;
                saved.moments.insert(id.0, moments);
            } else {
                operands.extend(self.param_operands(id, weights, working));
                operands.push(write(Role::Output, tile, &mut y));
                if let Some(pending) = self.run(b, stream, id, tile, Phase::Forward, operands)? {
                    loss = Some((pending, layer.shape.numel()));
                }
            }
            acts.outputs.push(Some(y));
        }
        Ok((acts, loss, saved))
    }

    /// The gradient of every trainable parameter, by slot.
    fn backward<B: Backend<Marker = K>>(
        &self,
        b: &B,
        stream: &mut B::Stream,
        weights: &[B::Buffer],
        working: &[Option<B::Buffer>],
        acts: &Acts<'_, B::Buffer>,
        saved: &Saved<B::Buffer>,
    ) -> Result<Vec<Option<B::Buffer>>, KernelError> {
        let g = self.graph;
        // Gradient w.r.t. each layer's output, summed over its consumers.
        let mut dout: Vec<Option<B::Buffer>> = (0..g.layers().len()).map(|_| None).collect();
        let mut param_grads: Vec<Option<B::Buffer>> =
            (0..self.params.len()).map(|_| None).collect();
        for id in g.ids().rev() {
            let layer = g.layer(id);
            let tile = self.full(id);
            let reads = layer.op.backward_reads();
            let dy = dout[id.0].take();
            if dy.is_none() && reads.output_grad {
                // Nothing downstream depends on this layer (or it is the input).
                continue;
            }
            // The first input of a layer fed by the data needs no gradient.
            let needs_dx = |k: usize| !matches!(g.layer(layer.inputs[k]).op, Op::Input(_));
            let mut dxs: Vec<Option<B::Buffer>> = Vec::with_capacity(layer.inputs.len());
            for (k, src) in layer.inputs.iter().enumerate() {
                let source = g.layer(*src);
                let len = source.shape.numel();
                // A gradient is stored as its activation is.
                let dtype = DType::output(&source.op, b.precision());
                dxs.push(if needs_dx(k) {
                    Some(b.alloc(stream, dtype, len)?)
                } else {
                    None
                });
            }
            let param_specs = layer.op.spec().params(&g.input_shapes(id));
            let mut grads: Vec<Option<B::Buffer>> = Vec::with_capacity(param_specs.len());
            for p in &param_specs {
                let len = p.shape.numel();
                grads.push(if p.trainable {
                    Some(b.alloc(stream, DType::F32, len)?)
                } else {
                    None
                });
            }
            // What every backward phase may read: inputs, output, its gradient, parameters.
            let common = || {
                let mut operands: Vec<Operand<'_, B::Buffer>> = Vec::new();
                for (k, src) in layer.inputs.iter().enumerate() {
                    operands.push(read(Role::Input(k as u8), self.full(*src), acts.of(*src)));
                }
                operands.push(read(Role::Output, tile, acts.of(id)));
                if let Some(dy) = &dy {
                    operands.push(read(Role::OutputGrad, tile, dy));
                }
                operands.extend(self.param_operands(id, weights, working));
                operands
            };
            let param_rects: Vec<Rect> = param_specs.iter().map(|p| p.shape.full_rect()).collect();
            let input_rects: Vec<Rect> = layer.inputs.iter().map(|&src| self.full(src)).collect();
            if let Op::BatchNorm(_) = layer.op {
                let channels = layer.shape.dim(1);
                let moments = || read(Role::Moments, sums_rect(channels), &saved.moments[&id.0]);
                let mut sums = b.alloc(stream, DType::F64, 3 * channels)?;
                let mut first = common();
                first.push(moments());
                first.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                first.push(write(Role::GradSums, sums_rect(channels), &mut sums));
                self.run(b, stream, id, tile, Phase::BnGradSums, first)?;
                if dxs[0].is_some() {
                    let mut second = common();
                    second.push(moments());
                    second.push(read(Role::GradSums, sums_rect(channels), &sums));
                    second.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                    self.run(b, stream, id, tile, Phase::BnInputGrad, second)?;
                }
            } else {
                let mut operands = common();
                operands.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                operands.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                self.run(b, stream, id, tile, Phase::Backward, operands)?;
            }
            for (k, grad) in grads.into_iter().enumerate() {
                if grad.is_some() {
                    param_grads[self.slot(id, k)] = grad;
                }
            }
            for (k, dx) in dxs.into_iter().enumerate() {
                let Some(dx) = dx else { continue };
                let rect = input_rects[k];
                match &mut dout[layer.inputs[k].0] {
                    Some(acc) => {
                        let before = self.mark(b, stream)?;
                        b.accumulate(stream, Out { rect, mem: acc }, In { rect, mem: &dx });
                        let name = || format!("sum {}.grad", g.layer(layer.inputs[k]).name);
                        self.record(b, stream, before, name, "fold")?;
                    }
                    slot => *slot = Some(dx),
                }
            }
        }
        Ok(param_grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GraphBuilder;
    use crate::kernels::check;
    use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};

    /// Branches, a concat, a residual add, batch norm and pooling: every way gradients meet.
    fn branchy(batch: usize) -> Graph {
        let mut m = GraphBuilder::new("branchy");
        let x = m.input("data", Shape::nchw(batch, 2, 8, 8)).unwrap();
        let a = m.conv2d("a", x, Conv2d::new(4, 3).padding(1)).unwrap();
        let a = m.batch_norm("a_bn", a, BatchNorm::default()).unwrap();
        let b = m.conv2d("b", x, Conv2d::new(2, 1).no_bias()).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(2, 3).padding(1)).unwrap();
        let bc = m.concat("bc", &[b, c]).unwrap();
        let s = m.add("sum", a, bc).unwrap();
        let p = m.pool2d("pool", s, Pool2d::avg(2)).unwrap();
        let f = m.flatten("flat", p).unwrap();
        let d = m.dense("fc", f, Dense::new(3)).unwrap();
        m.softmax_cross_entropy("loss", d).unwrap();
        m.finish()
    }

    #[test]
    fn a_backend_that_cannot_record_gives_up_capture_saying_why_and_trains_the_same() {
        let mut m = GraphBuilder::new("dropped");
        let x = m.input("data", Shape::nchw(4, 2, 6, 6)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(3, 3).padding(1)).unwrap();
        let d = m.dropout("drop", c, 0.5).unwrap();
        let f = m.flatten("flat", d).unwrap();
        let y = m.dense("fc", f, Dense::new(3)).unwrap();
        m.softmax_cross_entropy("loss", y).unwrap();
        let graph = m.finish();
        let pixels = graph.layer(graph.input()).shape.numel();
        let batches: Vec<(Vec<f32>, Vec<u32>)> = (0..4)
            .map(|k| (check::random(pixels, 30 + k), vec![0, 1, 2, k as u32 % 3]))
            .collect();
        let run = |setting: CaptureSetting| {
            let mut t = Trainer::new(
                graph.clone(),
                ParamStore::init(&graph, 2),
                Sgd::default(),
                7,
            );
            t.set_capture(setting);
            let mut statuses = vec![t.capture_status()];
            let losses: Vec<f32> = (0..batches.len())
                .map(|k| {
                    let next = batches.get(k + 1).map(|(i, l)| (&i[..], &l[..]));
                    let loss = t
                        .step_ahead(&batches[k].0, &batches[k].1, next)
                        .unwrap()
                        .loss;
                    statuses.push(t.capture_status());
                    loss
                })
                .collect();
            (losses, t.state().unwrap(), statuses)
        };
        let (off_losses, off_state, off_statuses) = run(CaptureSetting::Off);
        assert!(off_statuses.iter().all(|s| *s == CaptureStatus::Off));
        let (losses, state, statuses) = run(CaptureSetting::On);
        // The first step warms up; the second would be recorded: the CPU refuses, the step runs
        // as enqueued on the images moved for the recording, and so does every later step.
        assert_eq!(
            statuses[..2],
            [CaptureStatus::Warming, CaptureStatus::Warming]
        );
        for status in &statuses[2..] {
            let CaptureStatus::GaveUp(why) = status else {
                panic!("capture not given up: {status:?}")
            };
            assert!(why.contains("CPU runs each kernel"), "{why}");
        }
        assert_eq!(losses, off_losses);
        assert_eq!(state, off_state, "same weights, momentum and step");
    }

    #[test]
    fn training_state_round_trips_and_rejects_a_bad_step() {
        let g = branchy(2);
        let mut t = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let images = check::random(g.layer(g.input()).shape.numel(), 9);
        t.step(&images, &[0, 2]).unwrap();
        let state = t.state().unwrap();
        assert!(state.momentum.iter().flatten().any(|&v| v != 0.0));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        state.save(&path, BTreeMap::new()).unwrap();
        let back = TrainingState::from_checkpoint(&g, checkpoint::load(&path).unwrap()).unwrap();
        assert_eq!(back, state);

        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), "soon".to_string());
        checkpoint::save(&path, &state.params.tensors(), &meta).unwrap();
        let err = TrainingState::from_checkpoint(&g, checkpoint::load(&path).unwrap()).unwrap_err();
        assert!(err.to_string().contains("'step' is 'soon'"), "{err}");
    }

    #[test]
    fn parameter_gradients_match_finite_differences() {
        let graph = branchy(4);
        let params = ParamStore::init(&graph, 3);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 11);
        let labels = [0, 1, 2, 1];
        let sgd = Sgd::default();
        let pass = Pass::new(
            &graph,
            &params.params,
            &params.first,
            sgd,
            &images,
            &labels,
            5,
            0,
        );
        let mut stream = CpuStream;
        let mut buffers: Vec<Buffer> = params.values.iter().cloned().map(Buffer::F32).collect();
        let input = Buffer::F32(images.clone());
        // fp32: no working copies
        let masters_only: Vec<Option<Buffer>> = buffers.iter().map(|_| None).collect();
        let (acts, _, saved) = pass
            .forward(
                &Cpu::default(),
                &mut stream,
                &mut buffers,
                &masters_only,
                &input,
            )
            .unwrap();
        let grads = pass
            .backward(
                &Cpu::default(),
                &mut stream,
                &buffers,
                &masters_only,
                &acts,
                &saved,
            )
            .unwrap();
        // The loss of the step at weights `w` for parameter `slot`.
        let loss_at = |slot: usize, w: &[f32]| {
            let mut probe: Vec<Buffer> = params.values.iter().cloned().map(Buffer::F32).collect();
            probe[slot] = Buffer::F32(w.to_vec());
            let input = Buffer::F32(images.clone());
            let (_, loss, _) = pass
                .forward(
                    &Cpu::default(),
                    &mut CpuStream,
                    &mut probe,
                    &masters_only,
                    &input,
                )
                .unwrap();
            let (sums, samples) = loss.expect("the graph has a loss");
            sums.loss_sum / samples as f64
        };
        for (slot, p) in params.params.iter().enumerate() {
            if !p.spec.trainable {
                continue;
            }
            let analytic = grads[slot]
                .as_ref()
                .expect("every parameter gets a gradient")
                .f32();
            check::assert_grad(&p.name, &params.values[slot], analytic, 12, |w| {
                loss_at(slot, w)
            });
        }
    }

    #[test]
    fn a_label_out_of_range_is_refused_before_anything_changes() {
        let g = branchy(2);
        let mut t = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let before = t.state().unwrap();
        let images = check::random(g.layer(g.input()).shape.numel(), 9);
        let err = t.step(&images, &[0, 3]).unwrap_err();
        assert!(err.to_string().contains("label 3"), "{err}");
        assert_eq!(
            t.state().unwrap(),
            before,
            "running statistics and step unchanged"
        );
    }

    #[test]
    fn init_is_seeded_and_checkpoints_restore_it() {
        let graph = branchy(2);
        let a = ParamStore::init(&graph, 9);
        assert_eq!(a, ParamStore::init(&graph, 9));
        assert_ne!(a.values, ParamStore::init(&graph, 10).values);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        checkpoint::save(&path, &a.tensors(), &BTreeMap::new()).unwrap();
        let back = ParamStore::from_checkpoint(&graph, checkpoint::load(&path).unwrap()).unwrap();
        assert_eq!(a, back);
    }

    #[test]
    fn sgd_matches_pytorch_momentum_and_weight_decay() {
        let sgd = Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let mut w = [1.0f32];
        let mut v = [0.0f32];
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.5 + 0.01·1 = 0.51; v = 0.51; w = 1 − 0.051
        assert!((w[0] - 0.949).abs() < 1e-6 && (v[0] - 0.51).abs() < 1e-6);
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.5 + 0.00949 = 0.50949; v = 0.9·0.51 + 0.50949 = 0.96849; w = 0.949 − 0.096849
        assert!((w[0] - 0.852151).abs() < 1e-5, "{}", w[0]);
    }

    #[test]
    fn training_reduces_the_loss_and_updates_running_stats() {
        let graph = branchy(8);
        let params = ParamStore::init(&graph, 1);
        let before = params.clone();
        let mut t = Trainer::new(graph.clone(), params, Sgd::default(), 1);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 2);
        let labels = [0, 1, 2, 0, 1, 2, 0, 1];
        let first = t.step(&images, &labels).unwrap().loss;
        let mut last = first;
        for _ in 0..30 {
            last = t.step(&images, &labels).unwrap().loss;
        }
        assert!(last < 0.5 * first, "{first} -> {last}");
        let after = t.params().unwrap();
        let rm = after.slot(graph.find("a_bn").unwrap(), 2);
        assert_ne!(after.values[rm], before.values[rm]);
        assert_eq!(t.steps(), 31);
    }

    #[test]
    fn a_staged_next_batch_trains_as_the_batch_itself_and_a_wrong_one_is_not_trained_on() {
        let graph = branchy(8);
        let pixels = graph.layer(graph.input()).shape.numel();
        let data: Vec<(Vec<f32>, Vec<u32>)> = (0..3)
            .map(|k| {
                let labels = (0..8).map(|i| ((i + k) % 3) as u32).collect();
                (check::random(pixels, 10 + k as u64), labels)
            })
            .collect();
        let run = |next_of: &dyn Fn(usize) -> Option<usize>, prefetch: bool| {
            let mut t = Trainer::new(
                graph.clone(),
                ParamStore::init(&graph, 1),
                Sgd::default(),
                1,
            );
            t.set_prefetch(prefetch);
            let losses: Vec<f32> = (0..data.len())
                .map(|step| {
                    let next = next_of(step).map(|n| (&data[n].0[..], &data[n].1[..]));
                    t.step_ahead(&data[step].0, &data[step].1, next)
                        .unwrap()
                        .loss
                })
                .collect();
            (losses, t.params().unwrap().values)
        };
        let plain = run(&|_| None, true);
        // each step given the following batch, as a job gives it
        assert_eq!(run(&|s| Some(s + 1).filter(|&n| n < 3), true), plain);
        // step 0 given the last batch: step 1 drops it and stages its own
        assert_eq!(
            run(
                &|s| Some(if s == 0 { 2 } else { s + 1 }).filter(|&n| n < 3),
                true
            ),
            plain
        );
        // a batch differing only in a sampled image value (same labels) is told apart too
        let mut lookalike = data[1].0.clone();
        lookalike[21 * (pixels - 1) / (PROBES - 1)] += 1.0;
        let mut t = Trainer::new(
            graph.clone(),
            ParamStore::init(&graph, 1),
            Sgd::default(),
            1,
        );
        t.step_ahead(&data[0].0, &data[0].1, Some((&lookalike, &data[1].1)))
            .unwrap();
        for (images, labels) in &data[1..] {
            t.step(images, labels).unwrap();
        }
        assert_eq!(t.params().unwrap().values, plain.1);
        assert_eq!(run(&|s| Some(s + 1).filter(|&n| n < 3), false), plain);
    }

    /// Synthetic batches handed over described (`BatchInput::Synthetic`, which a GPU draws
    /// itself) train exactly as their images do, staged ahead or not; a described next batch
    /// that is not the next step's is not trained on.
    #[test]
    fn described_synthetic_batches_train_as_their_images() {
        use crate::data::{Dataset, Synthetic};
        let graph = branchy(8);
        let data = Synthetic::new(5, 64, 3, [2, 8, 8]).unwrap();
        let described: Vec<SyntheticBatch> = (0..3)
            .map(|k| {
                let indices: Vec<usize> = (0..8).map(|i| (7 * k + 3 * i) % 64).collect();
                data.describe_batch(&indices).unwrap()
            })
            .collect();
        let images: Vec<Vec<f32>> = described
            .iter()
            .map(|d| {
                let mut images = vec![0.0; d.len() * data.sample_len()];
                d.render(&mut images);
                images
            })
            .collect();
        let trainer = || {
            Trainer::new(
                graph.clone(),
                ParamStore::init(&graph, 1),
                Sgd::default(),
                1,
            )
        };
        let mut t = trainer();
        let mut drawn = Vec::new();
        for (images, d) in images.iter().zip(&described) {
            drawn.push(t.step(images, &d.labels).unwrap().loss);
        }
        let drawn = (drawn, t.params().unwrap().values);
        for next_of in [
            &(|s: usize| Some(s + 1).filter(|&n| n < 3)) as &dyn Fn(usize) -> Option<usize>,
            &|_| None,
            &|s| Some(2 - s.min(2)),
        ] {
            let mut t = trainer();
            let mut losses: Vec<f32> = Vec::new();
            for step in 0..3 {
                let next = next_of(step).map(|n| BatchInput::Synthetic(&described[n]));
                let this = BatchInput::Synthetic(&described[step]);
                let read = t.step_batch(this, next).unwrap();
                losses.extend(read.map(|r| r.stats.loss));
            }
            losses.extend(t.finish().unwrap().map(|r| r.stats.loss));
            assert_eq!((losses, t.params().unwrap().values), drawn);
        }
    }

    /// Which step is read once another is enqueued: the pure ordering both readbacks follow.
    #[test]
    fn read_every_step_a_step_is_read_at_once_and_one_step_late_after_the_next() {
        let mut in_flight = None;
        assert_eq!(settle(LossReadback::EveryStep, &mut in_flight, 1), Some(1));
        assert_eq!(in_flight, None);
        assert_eq!(settle(LossReadback::OneStepLate, &mut in_flight, 1), None);
        assert_eq!(
            settle(LossReadback::OneStepLate, &mut in_flight, 2),
            Some(1)
        );
        assert_eq!(
            settle(LossReadback::OneStepLate, &mut in_flight, 3),
            Some(2)
        );
        assert_eq!(
            in_flight,
            Some(3),
            "the last step waits for Trainer::finish"
        );
    }

    /// Stats read one step late are those read at each step's end, each step's once and in
    /// order, the last one's from `finish`; the weights are the same bit for bit, at a state
    /// read between steps (a checkpoint, with a step in flight) and at the end. With capture
    /// asked for, which the CPU gives up at the recording, and batches staged ahead.
    #[test]
    fn losses_read_one_step_late_are_those_read_at_each_steps_end() {
        let graph = branchy(8);
        let pixels = graph.layer(graph.input()).shape.numel();
        let data: Vec<(Vec<f32>, Vec<u32>)> = (0..5)
            .map(|k| {
                let labels = (0..8).map(|i| ((i * 7 + k) % 3) as u32).collect();
                (check::random(pixels, 40 + k as u64), labels)
            })
            .collect();
        let run = |readback: LossReadback| {
            let mut t = Trainer::new(
                graph.clone(),
                ParamStore::init(&graph, 4),
                Sgd::default(),
                3,
            );
            t.set_capture(CaptureSetting::On);
            t.set_loss_readback(readback);
            let (mut read, mut states, mut returned) = (Vec::new(), Vec::new(), Vec::new());
            for (k, (images, labels)) in data.iter().enumerate() {
                let next = data.get(k + 1).map(|(i, l)| BatchInput::Images {
                    images: i,
                    labels: l,
                });
                let this = BatchInput::Images { images, labels };
                let back = t.step_batch(this, next).unwrap();
                returned.push(back.map(|r| r.step));
                read.extend(back);
                if k == 2 {
                    states.push(t.state().unwrap());
                }
            }
            let last = t.finish().unwrap();
            read.extend(last);
            assert_eq!(t.finish().unwrap(), None, "nothing left in flight");
            assert!(!t.has_step_in_flight());
            states.push(t.state().unwrap());
            (read, states, returned)
        };
        let (at_end, at_end_states, at_end_returned) = run(LossReadback::EveryStep);
        let (late, late_states, late_returned) = run(LossReadback::OneStepLate);
        assert_eq!(at_end_returned, [1, 2, 3, 4, 5].map(Some));
        assert_eq!(late_returned, [None, Some(1), Some(2), Some(3), Some(4)]);
        let steps = |read: &[Readout]| read.iter().map(|r| r.step).collect::<Vec<_>>();
        assert_eq!(steps(&late), [1, 2, 3, 4, 5]);
        assert_eq!(steps(&at_end), steps(&late));
        let stats = |read: &[Readout]| {
            read.iter()
                .map(|r| (r.stats.loss, r.stats.correct))
                .collect::<Vec<_>>()
        };
        assert_eq!(stats(&late), stats(&at_end));
        assert!(late.iter().all(|r| r.stats.host.is_some()));
        assert_eq!(late_states, at_end_states, "weights, momentum and step");
        assert_eq!(
            late_states[0].step, 3,
            "the state holds every step enqueued"
        );
        // And they are what the synchronous `step` reports.
        let mut t = Trainer::new(
            graph.clone(),
            ParamStore::init(&graph, 4),
            Sgd::default(),
            3,
        );
        let plain: Vec<(f32, usize)> = data
            .iter()
            .map(|(i, l)| t.step(i, l).map(|s| (s.loss, s.correct)).unwrap())
            .collect();
        assert_eq!(stats(&late), plain);
    }

    /// A step refused before it is enqueued (a label out of range) leaves the step in flight
    /// to read, with its own stats, and the trainer where that step left it.
    #[test]
    fn a_step_refused_with_one_in_flight_leaves_that_one_to_read() {
        let g = branchy(2);
        let images = check::random(g.layer(g.input()).shape.numel(), 9);
        let mut reference = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let first = reference.step(&images, &[0, 2]).unwrap();
        let mut t = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let batch = BatchInput::Images {
            images: &images,
            labels: &[0, 2],
        };
        assert_eq!(t.step_batch(batch, None).unwrap(), None);
        let bad = BatchInput::Images {
            images: &images,
            labels: &[0, 3],
        };
        let err = t.step_batch(bad, None).unwrap_err();
        assert!(err.to_string().contains("label 3"), "{err}");
        let read = t
            .finish()
            .unwrap()
            .expect("the first step is still to read");
        assert_eq!(read.step, 1);
        assert_eq!(
            (read.stats.loss, read.stats.correct),
            (first.loss, first.correct)
        );
        assert_eq!(t.state().unwrap(), reference.state().unwrap());
    }

    #[test]
    #[should_panic(expected = "call Trainer::finish")]
    fn a_synchronous_step_refuses_to_pass_over_unread_stats() {
        let g = branchy(2);
        let images = check::random(g.layer(g.input()).shape.numel(), 9);
        let mut t = Trainer::new(g.clone(), ParamStore::init(&g, 3), Sgd::default(), 5);
        let batch = BatchInput::Images {
            images: &images,
            labels: &[0, 2],
        };
        t.step_batch(batch, None).unwrap();
        let _ = t.step(&images, &[1, 2]);
    }
}
