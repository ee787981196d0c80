//! The embedded cluster: N devices as actors in this process, joined by the in-process transport,
//! either sharing the machine's cores (see `compute`) or spread over its GPUs ([`Placement`]).
//! Runs training steps of a step plan.

use crate::buffer::Buffer;
use crate::compute::kernel_threads;
use crate::cpu_share::ACTOR_THREAD_NAME;
pub use crate::device::Placement;
use crate::device::{DeviceActor, DeviceSetup, Load, ReadInstance, RunStep, StepReport};
use crate::exec::{BatchView, StepInput};
use crate::in_process::InProcessTransport;
use crate::plan::{PlanError, SamplesRead, StepPlan};
use crate::program::{DeviceProgram, Part};
use crate::recycle::BufferPool;
use crate::region::RegionKind;
use crate::transport::Transport;
use kameo::actor::{ActorRef, Spawn};
use kameo::mailbox;
use legion_ops::Graph;
use legion_ops::Precision;
use legion_ops::kernels::softmax_ce::LabelOutOfRange;
use legion_ops::partition::ParallelConfig;
use legion_ops::train::{ParamStore, Sgd, StepStats, TrainingState};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Label(#[from] LabelOutOfRange),
    #[error("device {device}: {message}")]
    Device { device: usize, message: String },
    #[error("device {device} stopped responding")]
    DeviceLost { device: usize },
    #[error("internal: inference was not planned for these devices (plan it at launch)")]
    NoInference,
    #[error(
        "the step computes in {step} but its GPUs were opened to compute in {gpus}: open them \
         with the step's precision"
    )]
    PrecisionMismatch { step: Precision, gpus: Precision },
    #[error("the batch has {got} image values, the input layer takes {expected} for its samples")]
    BatchSize { got: usize, expected: usize },
    #[error("the batch has {got} labels for {expected} samples")]
    LabelCount { got: usize, expected: usize },
    #[error(
        "the step's {what} cover samples {have:?} of a batch of {batch}, but this process's \
         devices read samples {need:?}"
    )]
    SamplesMissing {
        what: &'static str,
        have: Range<usize>,
        need: Range<usize>,
        batch: usize,
    },
}

/// What one distributed step measured.
#[derive(Debug)]
pub struct StepResult {
    pub stats: StepStats,
    /// Per device, when traced.
    pub reports: Vec<StepReport>,
}

pub struct EmbeddedCluster {
    runtime: tokio::runtime::Runtime,
    devices: Vec<ActorRef<DeviceActor>>,
    plan: Arc<StepPlan>,
    graph: Arc<Graph>,
    next_step: u64,
    /// Inference's runs so far (numbered apart from the steps).
    inference_runs: u64,
    /// The rate the next steps update at, where a schedule set one.
    lr: Option<f32>,
}

/// How an [`EmbeddedCluster`] starts ([`EmbeddedCluster::launch`], [`EmbeddedCluster::launch_from`]):
/// SGD's defaults, seed 1, on this process's cores, in fp32, unless set otherwise.
#[must_use = "a Launch starts nothing until `start`"]
pub struct Launch<'a> {
    graph: &'a Graph,
    configs: &'a [ParallelConfig],
    devices: usize,
    params: &'a ParamStore,
    momentum: Option<&'a [Vec<f32>]>,
    first_step: u64,
    sgd: Sgd,
    seed: u64,
    placement: Option<&'a Placement>,
    precision: Precision,
    inference: bool,
}

impl<'a> Launch<'a> {
    /// Plans inference beside the step, for [`EmbeddedCluster::logits`].
    pub fn inference(mut self, on: bool) -> Self {
        self.inference = on;
        self
    }

    pub fn sgd(mut self, sgd: Sgd) -> Self {
        self.sgd = sgd;
        self
    }

    /// Seed of dropout's masks.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Where the devices run (GPUs must have been opened to compute in the precision).
    pub fn placement(mut self, placement: &'a Placement) -> Self {
        self.placement = Some(placement);
        self
    }

    /// What the steps compute in (bf16 stores activations and their gradients in bf16, as a GPU
    /// does; see `legion_ops::precision`).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Plans the step, starts the device actors and loads the state onto them.
    pub fn start(self) -> Result<EmbeddedCluster, RuntimeError> {
        EmbeddedCluster::start_with(self)
    }
}

impl EmbeddedCluster {
    /// Starts `graph` under `configs` on `devices` devices from `params`, momentum zero, at step
    /// 0; [`Launch`] says how else.
    pub fn launch<'a>(
        graph: &'a Graph,
        configs: &'a [ParallelConfig],
        devices: usize,
        params: &'a ParamStore,
    ) -> Launch<'a> {
        Launch {
            graph,
            configs,
            devices,
            params,
            momentum: None,
            first_step: 0,
            sgd: Sgd::default(),
            seed: 1,
            placement: None,
            precision: Precision::Fp32,
            inference: false,
        }
    }

    /// Continues a saved run on `devices` devices: its weights, momentum and step.
    pub fn launch_from<'a>(
        graph: &'a Graph,
        configs: &'a [ParallelConfig],
        devices: usize,
        state: &'a TrainingState,
    ) -> Launch<'a> {
        Launch {
            momentum: Some(&state.momentum),
            first_step: state.step,
            ..EmbeddedCluster::launch(graph, configs, devices, &state.params)
        }
    }

    fn start_with(launch: Launch<'_>) -> Result<EmbeddedCluster, RuntimeError> {
        let Launch {
            graph,
            configs,
            devices,
            params,
            momentum,
            first_step,
            sgd,
            seed,
            placement,
            precision,
            inference,
        } = launch;
        let cpu = Placement::Cpu;
        let placement = placement.unwrap_or(&cpu);
        if let Placement::Gpus(gpus) = placement {
            let tf32_as_fp32 = |p| match p {
                Precision::Tf32 => Precision::Fp32,
                p => p,
            };
            for gpu in gpus {
                let opened = legion_ops::backend::Backend::precision(&**gpu);
                if tf32_as_fp32(opened) != tf32_as_fp32(precision) {
                    return Err(RuntimeError::PrecisionMismatch {
                        step: precision,
                        gpus: opened,
                    });
                }
            }
        }
        let plan = Arc::new(match inference {
            true => StepPlan::build_with_inference(graph, configs, devices, precision)?,
            false => StepPlan::build_in(graph, configs, devices, precision)?,
        });
        let graph = Arc::new(graph.clone());
        let runtime = device_runtime();
        let programs: Vec<Arc<DeviceProgram>> =
            plan.programs.iter().cloned().map(Arc::new).collect();
        let actors = runtime.block_on(async {
            let transport = Arc::new(InProcessTransport::new());
            spawn_local_devices(&programs, &graph, seed, sgd, transport, placement)
        })?;
        let cluster = EmbeddedCluster {
            runtime,
            devices: actors,
            plan,
            graph,
            next_step: first_step,
            inference_runs: 0,
            lr: None,
        };
        cluster.load(params, momentum)?;
        Ok(cluster)
    }

    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    pub fn num_devices(&self) -> usize {
        self.devices.len()
    }

    fn load(&self, params: &ParamStore, momentum: Option<&[Vec<f32>]>) -> Result<(), RuntimeError> {
        let per_device = initial_instances(&self.plan, params, momentum);
        self.runtime.block_on(async {
            for (d, pieces) in per_device.into_iter().enumerate() {
                self.devices[d]
                    .ask(Load(pieces))
                    .await
                    .map_err(|e| device_error(d, e))?;
            }
            Ok(())
        })
    }

    /// The learning rate of the steps from the next on (a schedule's), instead of the launch's.
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = Some(lr);
    }

    /// One training step on a batch (images laid out like the input layer, one label per sample).
    pub fn step(
        &mut self,
        images: Vec<f32>,
        labels: Vec<u32>,
        trace: bool,
    ) -> Result<StepResult, RuntimeError> {
        let step = self.next_step;
        let batch = self.graph.batch();
        let input = StepInput {
            lr: self.lr,
            ..StepInput::whole(step, images, labels, batch)
        };
        let whole = SamplesRead {
            images: 0..batch,
            labels: 0..batch,
        };
        check_batch(&self.graph, &input.view(), &whole)?;
        let input = Arc::new(input);
        let reports =
            self.runtime
                .block_on(run_step(&self.devices, Part::Step, step, input, trace))?;
        self.next_step += 1;
        if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
            return Err(RuntimeError::Device {
                device: r.device,
                message: r.error.clone().unwrap(),
            });
        }
        let loss_sum: f64 = reports.iter().map(|r| r.outcome.loss_sum).sum();
        let correct = reports.iter().map(|r| r.outcome.correct).sum();
        Ok(StepResult {
            stats: StepStats {
                loss: (loss_sum / self.graph.batch() as f64) as f32,
                correct,
                host: None,
            },
            reports: if trace { reports } else { Vec::new() },
        })
    }

    /// The logits (`[N, classes]` row-major) of inference on a batch of images (laid out like the
    /// input layer's output) on the devices that train, with the weights where the last step
    /// left them: batch norm on its running statistics, dropout passing everything. Needs a
    /// plan with inference ([`Launch::inference`]).
    pub fn logits(&mut self, images: Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let inference = self
            .plan
            .inference
            .as_ref()
            .ok_or(RuntimeError::NoInference)?;
        let batch = self.graph.batch();
        let input = StepInput {
            label_samples: 0..0,
            ..StepInput::whole(self.next_step, images, Vec::new(), batch)
        };
        let images_only = SamplesRead {
            images: 0..batch,
            labels: 0..0,
        };
        check_batch(&self.graph, &input.view(), &images_only)?;
        let run = self.inference_runs;
        self.inference_runs += 1;
        let reports = self.runtime.block_on(run_step(
            &self.devices,
            Part::Inference,
            run,
            Arc::new(input),
            false,
        ))?;
        if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
            return Err(RuntimeError::Device {
                device: r.device,
                message: r.error.clone().unwrap(),
            });
        }
        let pieces = self.runtime.block_on(async {
            let mut pieces = Vec::with_capacity(inference.logits.len());
            for at in &inference.logits {
                let piece = self.devices[at.device]
                    .ask(ReadInstance {
                        instance: at.instance,
                        rect: at.rect,
                    })
                    .await
                    .map_err(|e| device_error(at.device, e))?;
                pieces.push((at.rect, piece.0));
            }
            Ok::<_, RuntimeError>(pieces)
        })?;
        Ok(inference.assemble(&self.graph, &pieces))
    }

    /// The current parameters and buffers, gathered from their owners.
    pub fn params(&self) -> Result<ParamStore, RuntimeError> {
        let values = (0..self.graph.params().len())
            .map(|slot| self.gather(self.plan.regions.param(slot)))
            .collect::<Result<_, _>>()?;
        Ok(ParamStore::from_values(&self.graph, values))
    }

    /// Everything needed to continue this run later: weights, momentum, the steps taken.
    pub fn state(&self) -> Result<TrainingState, RuntimeError> {
        let params = self.params()?;
        let momentum = params
            .values
            .iter()
            .enumerate()
            .map(|(slot, v)| match self.plan.regions.velocity(slot) {
                Some(region) => self.gather(region),
                None => Ok(vec![0.0; v.len()]),
            })
            .collect::<Result<_, _>>()?;
        Ok(TrainingState {
            params,
            momentum,
            step: self.next_step,
        })
    }

    /// A persistent f32 region's whole value, gathered from the devices holding its pieces.
    fn gather(&self, region: crate::region::RegionId) -> Result<Vec<f32>, RuntimeError> {
        let full = self.plan.regions.info(region).shape.full_rect();
        let mut out = Buffer::zeros(crate::region::DType::F32, full.volume());
        self.runtime.block_on(async {
            for at in self.plan.sources(region) {
                let piece = self.devices[at.device]
                    .ask(ReadInstance {
                        instance: at.instance,
                        rect: at.rect,
                    })
                    .await
                    .map_err(|e| device_error(at.device, e))?;
                out.copy_from(&full, &piece.0, &at.rect, &at.rect);
            }
            Ok::<_, RuntimeError>(())
        })?;
        // Persistent regions (masters, momentum) are f32 in every precision.
        Ok(out.into_f32())
    }
}

/// A device's refusal (its message), or its loss.
fn device_error<M>(device: usize, e: kameo::error::SendError<M, String>) -> RuntimeError {
    match e {
        kameo::error::SendError::HandlerError(message) => RuntimeError::Device { device, message },
        _ => RuntimeError::DeviceLost { device },
    }
}

/// Checks a step's input against `graph` before any device sees it: image values of the input
/// layer for the samples it claims to hold, one label per sample, each a class of the loss layer,
/// and at least the samples `needed` by the devices that will read it (network input on a worker).
pub fn check_batch(
    graph: &Graph,
    input: &BatchView,
    needed: &SamplesRead,
) -> Result<(), RuntimeError> {
    let batch = graph.batch();
    for (what, have, need) in [
        ("images", &input.image_samples, &needed.images),
        ("labels", &input.label_samples, &needed.labels),
    ] {
        let inside = |r: &Range<usize>, of: &Range<usize>| {
            r.is_empty() || (of.start <= r.start && r.end <= of.end)
        };
        if have.start > have.end || !inside(have, &(0..batch)) || !inside(need, have) {
            return Err(RuntimeError::SamplesMissing {
                what,
                have: have.clone(),
                need: need.clone(),
                batch,
            });
        }
    }
    let expected = input.image_samples.len() * graph.input_sample_len();
    if input.images.len() != expected {
        return Err(RuntimeError::BatchSize {
            got: input.images.len(),
            expected,
        });
    }
    if input.labels.len() != input.label_samples.len() {
        return Err(RuntimeError::LabelCount {
            got: input.labels.len(),
            expected: input.label_samples.len(),
        });
    }
    if let Some(logits) = graph.logits() {
        let classes = graph.layer(logits).shape.dim(1);
        if let Some((i, &label)) = input
            .labels
            .iter()
            .enumerate()
            .find(|(_, l)| **l as usize >= classes)
        {
            return Err(LabelOutOfRange {
                sample: input.label_samples.start + i,
                label,
                classes,
            }
            .into());
        }
    }
    Ok(())
}

/// What each device's persistent instances start as: its pieces of the parameters and of the
/// momentum (zero without `momentum`), and zeroed batch-norm statistics. Indexed by device, each
/// piece `(instance, rect, data)` as the [`Load`] message takes it.
pub fn initial_instances(
    plan: &StepPlan,
    params: &ParamStore,
    momentum: Option<&[Vec<f32>]>,
) -> Vec<Vec<(u32, legion_ops::Rect, Buffer)>> {
    let mut per_device: Vec<Vec<(u32, legion_ops::Rect, Buffer)>> =
        vec![Vec::new(); plan.programs.len()];
    for (region, at) in plan.initial_data() {
        let info = plan.regions.info(region);
        let piece_of = |whole: &[f32]| {
            let mut piece = vec![0.0; at.rect.volume()];
            legion_ops::shape::copy_rect(
                whole,
                &info.shape.full_rect(),
                &mut piece,
                &at.rect,
                &at.rect,
            );
            Buffer::F32(piece)
        };
        let data = match info.kind {
            RegionKind::Param => {
                piece_of(&params.values[plan.slot_of(region).expect("parameter region")])
            }
            RegionKind::Velocity => match momentum {
                Some(m) => piece_of(&m[plan.momentum_slot_of(region).expect("momentum region")]),
                None => Buffer::zeros(info.dtype, at.rect.volume()),
            },
            _ => Buffer::zeros(info.dtype, at.rect.volume()),
        };
        per_device[at.device].push((at.instance, at.rect, data));
    }
    per_device
}

/// Threads of [`device_runtime`]: one for every two cores, at least one. The actors only track
/// dependences and move data; kernels run on the devices' compute pools (`compute`), which want
/// the cores. On 2 cores one actor thread beat two: LeNet-5's steps on 4 devices ran 12–25% faster
/// (`git log -p BENCHMARKS.md`, "predicted vs measured", fourteenth session).
pub fn actor_threads() -> usize {
    (rayon::current_num_threads() / 2).max(1)
}

/// The tokio runtime device actors run on ([`actor_threads`] threads).
pub fn device_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(actor_threads())
        .thread_name(ACTOR_THREAD_NAME)
        .build()
        .expect("tokio runtime")
}

/// Spawns one CPU device actor per program, joined by an in-process transport. Call inside a
/// tokio runtime (see [`device_runtime`]). Instances start zeroed.
pub fn spawn_devices(
    programs: &[Arc<DeviceProgram>],
    graph: &Arc<Graph>,
    seed: u64,
    sgd: Sgd,
) -> Vec<ActorRef<DeviceActor>> {
    spawn_local_devices(
        programs,
        graph,
        seed,
        sgd,
        Arc::new(InProcessTransport::new()),
        &Placement::Cpu,
    )
    .expect("CPU devices start")
}

/// Threads a kernel splits its work across when `devices` devices share this process's cores
/// (the global rayon pool's size): an equal share, at least one.
pub fn threads_per_device(devices: usize) -> usize {
    kernel_threads(devices, rayon::current_num_threads())
}

/// Spawns one actor per program of `programs` (this process's devices, in global order) on
/// `transport`, which must have been made for them (see [`InProcessTransport::with_remote`]),
/// placed by `placement`. Fails where a GPU cannot give a device its stream or its instances.
pub fn spawn_local_devices(
    programs: &[Arc<DeviceProgram>],
    graph: &Arc<Graph>,
    seed: u64,
    sgd: Sgd,
    transport: Arc<InProcessTransport>,
    placement: &Placement,
) -> Result<Vec<ActorRef<DeviceActor>>, RuntimeError> {
    let n = programs.len();
    let computes = placement.computes(programs);
    let buffers = Arc::new(BufferPool::for_programs(programs));
    let mut actors: Vec<ActorRef<DeviceActor>> = Vec::with_capacity(n);
    for (program, compute) in programs.iter().zip(computes) {
        let setup = DeviceSetup {
            program: Arc::clone(program),
            graph: Arc::clone(graph),
            seed,
            sgd,
            transport: Arc::clone(&transport) as Arc<dyn Transport>,
            compute,
            buffers: Arc::clone(&buffers),
        };
        let device = DeviceActor::new(setup).map_err(|e| RuntimeError::Device {
            device: program.device,
            message: e.to_string(),
        });
        match device {
            Ok(device) => actors.push(DeviceActor::spawn_with_mailbox(
                device,
                mailbox::unbounded(),
            )),
            Err(e) => {
                for a in &actors {
                    a.kill();
                }
                return Err(e);
            }
        }
    }
    transport.connect(actors.clone(), buffers);
    Ok(actors)
}

/// Runs run `step` of `part` on every device and waits for all their reports (in device order).
pub async fn run_step(
    devices: &[ActorRef<DeviceActor>],
    part: Part,
    step: u64,
    input: Arc<StepInput>,
    trace: bool,
) -> Result<Vec<StepReport>, RuntimeError> {
    let epoch = Instant::now();
    let mut waits = Vec::new();
    for (d, device) in devices.iter().enumerate() {
        let (reply, wait) = tokio::sync::oneshot::channel();
        device
            .tell(RunStep {
                part,
                step,
                input: Arc::clone(&input),
                epoch,
                trace,
                reply,
            })
            .await
            .map_err(|_| RuntimeError::DeviceLost { device: d })?;
        waits.push(wait);
    }
    let mut reports = Vec::new();
    for (d, wait) in waits.into_iter().enumerate() {
        reports.push(
            wait.await
                .map_err(|_| RuntimeError::DeviceLost { device: d })?,
        );
    }
    Ok(reports)
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        for d in &self.devices {
            d.kill();
        }
    }
}
