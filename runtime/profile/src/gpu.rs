//! Profiling on a GPU: every tile the strategies give each layer, timed alone on one stream with
//! CUDA events, and each strategy's step on GPU device actors.
//!
//! On the CPU the profiler times tiles inside real steps and takes the cores' sharing back out
//! (see the crate docs). A GPU times its own work: a marker (a CUDA event) before a tile's forward
//! tasks, one between them and its backward tasks and one after, recorded on a stream of its own,
//! give each phase's time on the GPU's clock, with no other device's work in it. What the host
//! does between the markers counts where it holds the stream, as it does in a step: the input
//! layer's images and the loss's labels are copied from pageable memory (the driver waits for the
//! stream first), and a tile of kernels shorter than their launches waits on the host. The tasks
//! are the runtime's own (`StepPlan`'s programs, run through the same kernel seam), over instances
//! filled with a fixed pattern: kernel times do not depend on the values.
//!
//! A tile is timed once per profile key (the same op over the same shapes is the same kernel,
//! whichever strategy or device asked for it), after `warmup` untimed runs (cuDNN's algorithm
//! choice and workspace, lazy module loading), as the median of `repeats` runs.
//!
//! The copies a GPU device makes are measured too ([`CopyRates`]). The database holds the tile
//! times, and where the profile is of devices sharing the GPU (not of another machine's tiles,
//! `profile --machine`) also their link ([`CopyRates::same_gpu_link`]) and one kernel at a time,
//! so that `plan --machine one-gpu:N --profile` predicts what `train --devices N` measures.

use crate::{ProfileRunError, StrategyRun, synthetic_batch};
use legion_cuda::{Cuda, Direction, Marker, Stream};
use legion_ops::backend::{Access, Backend, DType, KernelError, cpu};
use legion_ops::op::partial_input_shapes;
use legion_ops::train::{ParamStore, Sgd};
use legion_ops::{Graph, LayerId, Rect};
use legion_planner::profile::{LinkProfile, ProfileEntry, ProfileKey};
use legion_planner::{ParallelConfig, PhaseTimes, ProfileDb, tile_rect};
use legion_runtime::plan::StepPlan;
use legion_runtime::program::{DeviceProgram, LocalOpKind};
use legion_runtime::{EmbeddedCluster, ExecContext, Placement, StepInput};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// How fast a GPU device moves data, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CopyRates {
    /// Within the GPU's memory (a slice between two devices on one GPU: one gather, one copy).
    pub device_bytes_per_s: f64,
    /// To page-locked host memory (a slice leaving for another process or GPU).
    pub to_host_bytes_per_s: f64,
    /// From page-locked host memory.
    pub from_host_bytes_per_s: f64,
    /// Seconds of a copy of one value within the GPU: the fixed cost of every copy.
    pub copy_latency_s: f64,
}

impl CopyRates {
    /// A slice between two devices on this GPU, as the runtime moves it (gathered into a buffer of
    /// its own, then copied into the receiver's instance): the link `plan --profile` prices the
    /// devices of `one-gpu:N` with.
    pub fn same_gpu_link(&self) -> LinkProfile {
        LinkProfile {
            bytes_per_s: self.device_bytes_per_s / 2.0,
            latency_s: 2.0 * self.copy_latency_s,
            samples: COPY_RUNS as u32,
        }
    }

    /// A slice leaving one device's memory for another process or GPU, as the runtime moves it
    /// besides the network: copied into page-locked host memory, then (after the network) from
    /// page-locked memory into the receiver's device memory, one after the other. The planner's
    /// model of worker processes sharing a GPU prices it on top of their network link.
    pub fn staged_link(&self) -> LinkProfile {
        LinkProfile {
            bytes_per_s: 1.0 / (1.0 / self.to_host_bytes_per_s + 1.0 / self.from_host_bytes_per_s),
            latency_s: 2.0 * self.copy_latency_s,
            samples: COPY_RUNS as u32,
        }
    }
}

/// What profiling on a GPU measured.
#[derive(Clone, Debug)]
pub struct GpuProfile {
    pub db: ProfileDb,
    /// Per strategy: its steps on `devices` GPU device actors sharing the GPU, and the tiles it
    /// added to the database (`tasks`).
    pub runs: Vec<StrategyRun>,
    pub copies: CopyRates,
    /// Whether the deadline stopped it before every strategy's tiles were timed (`runs` then
    /// holds the strategies reached).
    pub stopped_early: bool,
}

/// Profiles the tiles of `graph` that `devices` devices compute under each named strategy, each
/// tile alone on GPU `cuda`; with `run_steps`, also each strategy's steps on `devices` GPU device
/// actors sharing that GPU (its `StrategyRun::step_s`; empty without). Past `deadline` no new
/// tile is timed: what was measured is returned, marked `stopped_early`.
pub fn profile_on_gpu(
    graph: &Graph,
    devices: usize,
    strategies: &[(String, Vec<ParallelConfig>)],
    cuda: &Arc<Cuda>,
    settings: &crate::ProfileSettings,
    run_steps: bool,
    deadline: Option<Instant>,
) -> Result<GpuProfile, ProfileRunError> {
    if settings.repeats == 0 {
        return Err(ProfileRunError::NoRepeats);
    }
    let device = |e: KernelError| ProfileRunError::Gpu(e.to_string());
    let (images, labels) = synthetic_batch(graph, settings.seed)?;
    let input = StepInput::whole(0, images.clone(), labels.clone(), graph.batch());
    let mut stream = cuda.new_stream().map_err(device)?;
    let mut entries: Vec<ProfileEntry> = Vec::new();
    let mut patterns = Patterns::default();
    let mut seen: HashSet<ProfileKey> = HashSet::new();
    let params = ParamStore::init(graph, settings.seed);
    let placement = Placement::Gpus(vec![Arc::clone(cuda)]);
    let mut runs = Vec::new();
    let past_deadline = || deadline.is_some_and(|d| Instant::now() >= d);
    let mut stopped_early = false;
    'strategies: for (name, configs) in strategies {
        let in_strategy = |source| ProfileRunError::Strategy {
            strategy: name.clone(),
            source,
        };
        let plan = StepPlan::build(graph, configs, devices)
            .map_err(|e| in_strategy(legion_runtime::RuntimeError::Plan(e)))?;
        let mut tiles = 0;
        for program in &plan.programs {
            for (layer, (forward, backward)) in tile_tasks(program) {
                let config = &plan.configs[layer.0];
                let Some(t) = program
                    .device
                    .checked_sub(config.first_device())
                    .filter(|&t| t < config.total())
                else {
                    continue;
                };
                let l = graph.layer(layer);
                let tile = tile_rect(&l.shape, config, t);
                // a reduction split's partial: over its block of the input channels (see
                // `TileTimes`)
                let inputs = partial_input_shapes(
                    &graph.input_shapes(layer),
                    config.reduction_of(t),
                    config.reduction(),
                );
                let key = ProfileKey::for_tile(l, &inputs, &tile, &settings.device_kind);
                if seen.contains(&key) {
                    continue;
                }
                if past_deadline() {
                    stopped_early = true;
                    break 'strategies;
                }
                seen.insert(key);
                let run = TileRun {
                    cuda,
                    graph,
                    program,
                    input: &input,
                    seed: settings.seed,
                };
                let times = run
                    .time(&mut stream, &mut patterns, &forward, &backward, settings)
                    .map_err(|e| ProfileRunError::Gpu(format!("{name}: {}: {e}", l.name)))?;
                entries.push(ProfileEntry::for_tile(
                    l,
                    &inputs,
                    &tile,
                    &settings.device_kind,
                    times,
                    settings.repeats as u32,
                ));
                tiles += 1;
            }
        }
        if !run_steps {
            runs.push(StrategyRun {
                name: name.clone(),
                step_s: Vec::new(),
                tasks: tiles,
            });
            continue;
        }
        // The strategy's whole step on GPU device actors, for comparison with the simulation.
        let state = legion_ops::train::TrainingState::start(params.clone());
        let mut cluster = EmbeddedCluster::launch_from(graph, configs, devices, &state)
            .seed(settings.seed)
            .placement(&placement)
            .precision(plan.regions.precision())
            .start()
            .map_err(in_strategy)?;
        for _ in 0..settings.warmup {
            cluster
                .step(images.clone(), labels.clone(), false)
                .map_err(in_strategy)?;
        }
        let mut step_s = Vec::with_capacity(settings.repeats);
        for _ in 0..settings.repeats {
            let t = Instant::now();
            cluster
                .step(images.clone(), labels.clone(), false)
                .map_err(in_strategy)?;
            step_s.push(t.elapsed().as_secs_f64());
        }
        runs.push(StrategyRun {
            name: name.clone(),
            step_s,
            tasks: tiles,
        });
    }
    let copies = copy_rates(cuda, &mut stream).map_err(device)?;
    let mut db = ProfileDb::default();
    db.insert_all(entries);
    Ok(GpuProfile {
        db,
        runs,
        copies,
        stopped_early,
    })
}

/// A program's compute tasks by layer, forward and backward (updates and folds are not a tile's
/// t_c: the planner prices them as t_s and transfers), each in program order.
fn tile_tasks(program: &DeviceProgram) -> BTreeMap<LayerId, (Vec<u32>, Vec<u32>)> {
    let mut by_layer: BTreeMap<LayerId, (Vec<u32>, Vec<u32>)> = BTreeMap::new();
    for (i, op) in program.ops.iter().enumerate() {
        let LocalOpKind::Task { task, .. } = &op.kind else {
            continue;
        };
        let entry = by_layer.entry(task.layer).or_default();
        match crate::phase(task.kind) {
            Some(crate::Phase::Forward) => entry.0.push(i as u32),
            Some(crate::Phase::Backward) => entry.1.push(i as u32),
            None => {}
        }
    }
    by_layer.retain(|_, (f, b)| !f.is_empty() || !b.is_empty());
    by_layer
}

/// One tile's tasks, run alone on a stream.
struct TileRun<'a> {
    cuda: &'a Cuda,
    graph: &'a Graph,
    program: &'a DeviceProgram,
    input: &'a StepInput,
    seed: u64,
}

impl TileRun<'_> {
    fn time(
        &self,
        stream: &mut Stream,
        patterns: &mut Patterns,
        forward: &[u32],
        backward: &[u32],
        settings: &crate::ProfileSettings,
    ) -> Result<PhaseTimes, KernelError> {
        let mut instances = self.instances(stream, patterns, forward.iter().chain(backward))?;
        for _ in 0..settings.warmup.max(1) {
            self.run(stream, &mut instances, forward)?;
            self.run(stream, &mut instances, backward)?;
        }
        self.cuda.synchronize(stream)?;
        let mut marks: Vec<[Marker; 3]> = Vec::with_capacity(settings.repeats);
        for _ in 0..settings.repeats {
            let start = self.cuda.mark(stream)?;
            self.run(stream, &mut instances, forward)?;
            let between = self.cuda.mark(stream)?;
            self.run(stream, &mut instances, backward)?;
            marks.push([start, between, self.cuda.mark(stream)?]);
        }
        self.cuda.synchronize(stream)?;
        let mut forward_s = Vec::with_capacity(marks.len());
        let mut backward_s = Vec::with_capacity(marks.len());
        for [start, between, end] in &marks {
            forward_s.push(between.seconds_since(start)?);
            backward_s.push(end.seconds_since(between)?);
        }
        Ok(PhaseTimes {
            forward: median(&mut forward_s),
            backward: median(&mut backward_s),
        })
    }

    /// Every instance the tasks use, in device memory, filled with a fixed pattern: copied on
    /// the device from `patterns`, so that thousands of tiles cost no host work per element.
    fn instances<'o>(
        &self,
        stream: &mut Stream,
        patterns: &mut Patterns,
        ops: impl Iterator<Item = &'o u32>,
    ) -> Result<HashMap<u32, legion_cuda::Buffer>, KernelError> {
        let mut out = HashMap::new();
        for &op in ops {
            let LocalOpKind::Task { instances, .. } = &self.program.ops[op as usize].kind else {
                unreachable!("tile tasks are tasks")
            };
            for &i in instances {
                if out.contains_key(&i) {
                    continue;
                }
                let local = &self.program.instances[i as usize];
                let buffer =
                    patterns.filled(self.cuda, stream, local.dtype, local.rect.volume())?;
                out.insert(i, buffer);
            }
        }
        Ok(out)
    }

    fn run(
        &self,
        stream: &mut Stream,
        buffers: &mut HashMap<u32, legion_cuda::Buffer>,
        ops: &[u32],
    ) -> Result<(), KernelError> {
        let ctx = ExecContext {
            graph: self.graph,
            precision: self.program.precision,
            seed: self.seed,
            sgd: Sgd::default(),
            input: self.input,
        };
        for &op in ops {
            let LocalOpKind::Task { task, instances } = &self.program.ops[op as usize].kind else {
                unreachable!("tile tasks are tasks")
            };
            let mut written: Vec<(u32, legion_cuda::Buffer)> = task
                .requirements
                .iter()
                .zip(instances)
                .filter(|(req, _)| req.privilege.writes())
                .map(|(_, &i)| (i, buffers.remove(&i).expect("every instance is allocated")))
                .collect();
            let mut writes = written.iter_mut();
            let access = task
                .requirements
                .iter()
                .zip(instances)
                .map(|(req, i)| {
                    if req.privilege.writes() {
                        Access::Write(&mut writes.next().unwrap().1)
                    } else {
                        Access::Read(&buffers[i])
                    }
                })
                .collect();
            // Profiles time fp32 and tf32 tiles (`profile` refuses bf16): no working copies.
            let result = legion_runtime::enqueue(self.cuda, stream, &ctx, task, access, &mut None);
            buffers.extend(written);
            result?;
        }
        Ok(())
    }
}

/// Values for timing: smooth, bounded, never all zero (f64 batch-norm sums count 1 sample).
fn pattern(dtype: DType, len: usize) -> cpu::Buffer {
    match dtype {
        DType::F32 => cpu::Buffer::F32((0..len).map(|i| 0.1 * (i as f32 * 0.37).sin()).collect()),
        DType::F64 => cpu::Buffer::F64(vec![1.0; len]),
        // `Patterns::filled` refuses bf16 before asking for a pattern.
        DType::Bf16 => unreachable!("no host pattern is bf16"),
    }
}

/// The timing pattern on the device, per dtype (uploaded once): each instance is the pattern
/// repeated, by device copies.
#[derive(Default)]
struct Patterns {
    f32: Option<legion_cuda::Buffer>,
    f64: Option<legion_cuda::Buffer>,
}

impl Patterns {
    /// Elements in the uploaded pattern (16 Mi: 64 MiB of f32).
    const LEN: usize = 1 << 24;

    fn filled(
        &mut self,
        cuda: &Cuda,
        stream: &mut Stream,
        dtype: DType,
        len: usize,
    ) -> Result<legion_cuda::Buffer, KernelError> {
        let source = match dtype {
            DType::F32 => &mut self.f32,
            DType::F64 => &mut self.f64,
            // The runtime's regions are f32 and f64 (`RegionKind::dtype`).
            DType::Bf16 => {
                return Err(KernelError::Device(
                    "the profiler times f32 and f64 regions, not bf16".into(),
                ));
            }
        };
        if len == 0 {
            return cuda.upload(stream, &pattern(dtype, 0));
        }
        if source.is_none() {
            *source = Some(cuda.upload(stream, &pattern(dtype, Self::LEN))?);
        }
        cuda.repeated(stream, source.as_ref().expect("just made"), len)
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Timed copies of each kind.
const COPY_RUNS: usize = 5;

/// Copy rates of 64 MiB slices and the time of a one-value copy, the median of five of each.
fn copy_rates(cuda: &Cuda, stream: &mut Stream) -> Result<CopyRates, KernelError> {
    const LEN: usize = 16 << 20; // f32 values: 64 MiB
    let bytes = (LEN * 4) as f64;
    let whole = Rect::new(&[0], &[LEN]);
    let src = cuda.alloc_zeros(stream, DType::F32, LEN)?;
    let mut dst = cuda.alloc_zeros(stream, DType::F32, LEN)?;
    let mut out = cuda.staging(DType::F32, LEN, Direction::ToHost)?;
    let into = cuda.staging(DType::F32, LEN, Direction::ToDevice)?;
    let one = Rect::new(&[0], &[1]);
    let mut rates = [Vec::new(), Vec::new(), Vec::new()];
    let mut small = Vec::new();
    for _ in 0..COPY_RUNS {
        let tiny = cuda.mark(stream)?;
        cuda.copy_rect(stream, &src, &whole, &mut dst, &whole, &one);
        let a = cuda.mark(stream)?;
        cuda.copy_rect(stream, &src, &whole, &mut dst, &whole, &whole);
        let b = cuda.mark(stream)?;
        cuda.stage_out(stream, &src, &mut out);
        let c = cuda.mark(stream)?;
        cuda.stage_in(stream, &into, &mut dst);
        let d = cuda.mark(stream)?;
        cuda.synchronize(stream)?;
        small.push(a.seconds_since(&tiny)?);
        rates[0].push(bytes / b.seconds_since(&a)?);
        rates[1].push(bytes / c.seconds_since(&b)?);
        rates[2].push(bytes / d.seconds_since(&c)?);
    }
    let [mut device, mut to_host, mut from_host] = rates;
    Ok(CopyRates {
        device_bytes_per_s: median(&mut device),
        to_host_bytes_per_s: median(&mut to_host),
        from_host_bytes_per_s: median(&mut from_host),
        copy_latency_s: median(&mut small),
    })
}
