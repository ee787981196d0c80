//! Single-device training: the reference every strategy is checked against (on the CPU), and the
//! one-device run on a GPU.
//!
//! The reference is deliberately independent of the distributed runtime: whole-tensor forward
//! and backward through a backend (each layer one tile), then SGD with momentum and weight decay,
//! sharing only the kernels and the initialisation. `state.rs` holds what a run trains and saves
//! (`Sgd`, `ParamStore`, `TrainingState`); `pass.rs` the forward and backward passes, the
//! reference computation itself; this file the `Trainer`; `pipeline.rs` what a device adds around
//! a step (the next batch staged while a step computes, the loss read one step late, the step
//! recorded once and replayed).

mod pass;
mod pipeline;
mod schedule;
mod state;

pub use schedule::{Decay, LrSchedule};
pub use state::{MOMENTUM_PREFIX, ParamStore, Sgd, TrainingState};

use pass::{MarkedSpan, Pass};
use pipeline::{Ahead, BatchIdentity, InFlight, probe_of};

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

/// What one pass over a batch gives, on the CPU in f32: the mean softmax cross-entropy and each
/// trainable parameter's gradient of it, by the parameter's name.
#[derive(Clone, Debug, PartialEq)]
pub struct LossGradients {
    pub loss: f64,
    pub gradients: Vec<checkpoint::NamedTensor>,
}

/// The loss and its gradients of the forward and backward pass a training step at `step` takes
/// over `images` and `labels` (batch norm on the batch's statistics, dropout drawn from `seed`),
/// without the update: what a gradient check compares with another framework's autograd.
pub fn loss_gradients(
    graph: &Graph,
    params: &ParamStore,
    images: &[f32],
    labels: &[u32],
    seed: u64,
    step: u64,
) -> Result<LossGradients, KernelError> {
    let pass: Pass<'_, std::time::Instant> = Pass::new(
        graph,
        &params.params,
        &params.first,
        Sgd::default(),
        images,
        labels,
        seed,
        step,
    );
    let (cpu, mut stream) = (Cpu::default(), CpuStream);
    let mut weights: Vec<Buffer> = params.values.iter().cloned().map(Buffer::F32).collect();
    let masters_only: Vec<Option<Buffer>> = weights.iter().map(|_| None).collect();
    let input = Buffer::F32(images.to_vec());
    let (acts, loss, saved) =
        pass.forward(&cpu, &mut stream, &mut weights, &masters_only, &input)?;
    let grads = pass.backward(&cpu, &mut stream, &weights, &masters_only, &acts, &saved)?;
    let loss = loss.map_or(0.0, |(sums, samples)| {
        cpu.read_loss(sums).loss_sum / samples as f64
    });
    let gradients = params
        .params
        .iter()
        .zip(grads)
        .filter(|(p, _)| p.spec.trainable)
        .filter_map(|(p, g)| {
            g.map(|g| checkpoint::NamedTensor::new(p.name.clone(), p.spec.shape, g.into_f32()))
        })
        .collect();
    Ok(LossGradients { loss, gradients })
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

    /// The logits (`[N, classes]` row-major, the output of the layer before the loss) of
    /// inference on a batch of `graph.batch()` samples, on this trainer's device with its
    /// weights: batch norm on its running statistics, dropout passing everything. Changes
    /// nothing; a step in flight is read first ([`Trainer::finish`]) by the caller.
    pub fn logits(&mut self, images: Vec<f32>) -> Result<Vec<f32>, KernelError> {
        assert!(
            self.in_flight.is_none(),
            "Trainer::logits with the stats of a step unread: call Trainer::finish"
        );
        let expected = self.graph.layer(self.graph.input()).shape.numel();
        if images.len() != expected {
            return Err(KernelError::Device(format!(
                "the batch has {} image values, the input layer takes {expected}",
                images.len()
            )));
        }
        let images = self
            .backend
            .upload(&mut self.stream, &Buffer::F32(images))?;
        let pass = Pass::new(
            &self.graph,
            &self.params,
            &self.first,
            self.sgd,
            &[],
            &[],
            self.seed,
            self.step,
        );
        let logits = pass.infer(
            &self.backend,
            &mut self.stream,
            &mut self.weights,
            &self.working,
            &images,
        )?;
        Ok(match self.backend.download(&mut self.stream, &logits)? {
            Buffer::Bf16(bits) => bits
                .iter()
                .map(|&b| crate::precision::bf16_value(b))
                .collect(),
            other => other.into_f32(),
        })
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

    /// Whether steps are recorded and replayed ([`crate::capture`]): on by default on a device
    /// (`resume_on`), off for the CPU reference (`new`, `resume`), which cannot record. Off,
    /// every step's kernels are enqueued one by one.
    pub fn set_capture(&mut self, setting: CaptureSetting) {
        self.capture.set(setting);
    }

    /// The rate the next steps update at (a schedule's). A recorded step replays the rate it
    /// was recorded with: a run whose rate changes records none.
    pub fn set_lr(&mut self, lr: f32) {
        self.sgd.lr = lr;
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

#[cfg(test)]
mod tests {
    use super::pipeline::{PROBES, settle};
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
    fn loss_gradients_are_what_a_plain_sgd_step_subtracts() {
        let graph = branchy(4);
        let params = ParamStore::init(&graph, 3);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 11);
        let labels = [0, 1, 2, 1];
        let got = loss_gradients(&graph, &params, &images, &labels, 5, 0).unwrap();
        let plain = Sgd {
            lr: 1.0,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let mut trainer = Trainer::new(graph.clone(), params.clone(), plain, 5);
        let stats = trainer.step(&images, &labels).unwrap();
        assert!(
            (got.loss - stats.loss as f64).abs() < 1e-5,
            "{} {}",
            got.loss,
            stats.loss
        );
        let after = trainer.params().unwrap();
        let trainable = params.params.iter().filter(|p| p.spec.trainable).count();
        assert_eq!(got.gradients.len(), trainable);
        for g in &got.gradients {
            let slot = params.params.iter().position(|p| p.name == g.name).unwrap();
            let stepped: Vec<f32> = params.values[slot]
                .iter()
                .zip(&after.values[slot])
                .map(|(w0, w1)| w0 - w1)
                .collect();
            // a bias before a batch norm has a zero gradient: compared absolutely
            let scale = stepped.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g
                .data
                .iter()
                .zip(&stepped)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff <= 1e-4 * scale + 1e-6, "{}: {diff} of {scale}", g.name);
        }
    }

    #[test]
    fn parameter_gradients_match_finite_differences() {
        let graph = branchy(4);
        let params = ParamStore::init(&graph, 3);
        let images = check::random(graph.layer(graph.input()).shape.numel(), 11);
        let labels = [0, 1, 2, 1];
        let analytic = loss_gradients(&graph, &params, &images, &labels, 5, 0).unwrap();
        let pass: Pass<'_, std::time::Instant> = Pass::new(
            &graph,
            &params.params,
            &params.first,
            Sgd::default(),
            &images,
            &labels,
            5,
            0,
        );
        // fp32: no working copies
        let masters_only: Vec<Option<Buffer>> = params.values.iter().map(|_| None).collect();
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
            let analytic = &analytic
                .gradients
                .iter()
                .find(|g| g.name == p.name)
                .expect("every parameter gets a gradient")
                .data;
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
            nesterov: false,
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

    /// `torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)`, two steps
    /// of gradient 0.5 from w = 1: buf = d, then buf = 0.9·buf + d; w -= lr·(d + 0.9·buf).
    #[test]
    fn nesterov_momentum_matches_pytorch() {
        let sgd = Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
        };
        let (mut w, mut v) = ([1.0f32], [0.0f32]);
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.51; v = 0.51; w = 1 − 0.1·(0.51 + 0.459) = 0.9031
        assert!(
            (w[0] - 0.9031).abs() < 1e-6 && (v[0] - 0.51).abs() < 1e-6,
            "{w:?}"
        );
        sgd.update(&mut w, &[0.5], &mut v);
        // d = 0.5 + 0.009031 = 0.509031; v = 0.459 + 0.509031 = 0.968031;
        // w = 0.9031 − 0.1·(0.509031 + 0.8712279) = 0.76507411
        assert!((v[0] - 0.968031).abs() < 1e-6, "{v:?}");
        assert!((w[0] - 0.765_074_1).abs() < 1e-6, "{w:?}");
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
