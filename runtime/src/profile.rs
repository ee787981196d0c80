//! The profiler: measures the planner's t_c, and the transport's links, on real steps of the
//! embedded cluster.
//!
//! Kernels are timed where they really run: inside training steps of N devices that share this
//! machine's cores, so a measurement includes the contention a strategy puts on them (a tile run
//! alone on an idle machine would be faster than it ever is in training). For each strategy the
//! profiler starts a cluster, runs untimed warm-up steps, then traced steps on one synthetic batch,
//! and attributes each compute task to the tile of its layer on its device:
//!
//! - forward phase: `LoadInput`, `Forward`, `BnMoments`, `BnNormalize`, `BnRunning`;
//! - backward phase: `Backward`, `BnGradSums`, `BnInputGrad`;
//! - left out: `Update` (parameter synchronisation, which the planner prices as t_s, not t_c) and
//!   folds (sums of partial results: part of moving data between tiles, not of a tile's kernel).
//!
//! One (strategy, step, layer, device) gives one sample of a tile's forward and backward seconds;
//! samples with the same [`ProfileKey`] (the same op over the same shapes, whichever strategy or
//! device ran it) are averaged.
//!
//! Links: a transfer between devices takes from its `Send` starting (the gather on the sender) to
//! its `Recv` ending (the store on the receiver). A least-squares line `latency + bytes / bandwidth`
//! through those points is the measured link. Only transfers whose receive waited for nothing but
//! the data are used: a receive held back by a local dependence would count that wait as transport.

use crate::device::StepReport;
use crate::embedded::{EmbeddedCluster, RuntimeError};
use crate::plan::StepPlan;
use crate::program::LocalOpKind;
use crate::task::TaskKind;
use legion_ops::data::{DataError, Dataset, Synthetic};
use legion_ops::train::{ParamStore, Sgd};
use legion_ops::{Graph, LayerId, Rect};
use legion_planner::profile::{LinkProfile, ProfileKey};
use legion_planner::{DeviceId, ParallelConfig, PhaseTimes, ProfileDb, tile_rect};
use std::collections::HashMap;
use std::time::Instant;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ProfileRunError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("synthetic data: {0}")]
    Data(#[from] DataError),
    #[error("strategy {strategy}: {source}")]
    Strategy {
        strategy: String,
        source: RuntimeError,
    },
    #[error("--repeats must be at least 1")]
    NoRepeats,
}

/// How to profile.
#[derive(Clone, Debug)]
pub struct ProfileSettings {
    /// Untimed steps before measuring (first-touch allocation, caches, thread pools).
    pub warmup: usize,
    /// Traced steps per strategy.
    pub repeats: usize,
    /// The machine model's device kind the entries are stored under (`cpu`).
    pub device_kind: String,
    pub seed: u64,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        ProfileSettings {
            warmup: 2,
            repeats: 5,
            device_kind: "cpu".into(),
            seed: 1,
        }
    }
}

/// What profiling one strategy saw.
#[derive(Clone, Debug)]
pub struct StrategyRun {
    pub name: String,
    /// Wall-clock seconds of each traced step.
    pub step_s: Vec<f64>,
    /// Compute tasks timed (over all traced steps).
    pub tasks: usize,
}

/// The profiler's result.
#[derive(Clone, Debug)]
pub struct Profile {
    pub db: ProfileDb,
    pub runs: Vec<StrategyRun>,
}

/// Profiles `graph` on `devices` embedded devices under each named strategy (configs by layer).
pub fn profile(
    graph: &Graph,
    devices: usize,
    strategies: &[(String, Vec<ParallelConfig>)],
    settings: &ProfileSettings,
) -> Result<Profile, ProfileRunError> {
    if settings.repeats == 0 {
        return Err(ProfileRunError::NoRepeats);
    }
    let (images, labels) = synthetic_batch(graph, settings.seed)?;
    let params = ParamStore::init(graph, settings.seed);
    let mut tiles = TileTimes::default();
    let mut links = LinkFit::default();
    let mut runs = Vec::new();
    for (name, configs) in strategies {
        let in_strategy = |source| ProfileRunError::Strategy {
            strategy: name.clone(),
            source,
        };
        let mut cluster = EmbeddedCluster::start(
            graph,
            configs,
            devices,
            &params,
            Sgd::default(),
            settings.seed,
            0,
        )
        .map_err(in_strategy)?;
        for _ in 0..settings.warmup {
            cluster
                .step(images.clone(), labels.clone(), false)
                .map_err(in_strategy)?;
        }
        let mut run = StrategyRun {
            name: name.clone(),
            step_s: Vec::new(),
            tasks: 0,
        };
        for _ in 0..settings.repeats {
            let t = Instant::now();
            let result = cluster
                .step(images.clone(), labels.clone(), true)
                .map_err(in_strategy)?;
            run.step_s.push(t.elapsed().as_secs_f64());
            run.tasks += tiles.add_step(graph, cluster.plan(), &result.reports, settings);
            links.add_step(cluster.plan(), &result.reports);
        }
        runs.push(run);
    }
    let mut db = tiles.into_db(graph, &settings.device_kind);
    db.links = links.fit();
    // Every device's kernels ran on the one global pool: this many could run at once.
    db.compute_threads = Some(rayon::current_num_threads());
    Ok(Profile { db, runs })
}

/// The mean wall-clock seconds of `steps` untraced steps of `cluster` on a synthetic batch, after
/// `warmup` untimed ones.
pub fn mean_step_time(
    cluster: &mut EmbeddedCluster,
    graph: &Graph,
    warmup: usize,
    steps: usize,
    seed: u64,
) -> Result<f64, ProfileRunError> {
    let (images, labels) = synthetic_batch(graph, seed)?;
    for _ in 0..warmup {
        cluster.step(images.clone(), labels.clone(), false)?;
    }
    let t = Instant::now();
    for _ in 0..steps {
        cluster.step(images.clone(), labels.clone(), false)?;
    }
    Ok(t.elapsed().as_secs_f64() / steps.max(1) as f64)
}

/// One batch of the seeded synthetic task, laid out like the graph's input. Timing does not depend
/// on the values, so every step reuses it.
pub fn synthetic_batch(graph: &Graph, seed: u64) -> Result<(Vec<f32>, Vec<u32>), DataError> {
    let input = graph.layer(graph.input()).shape;
    if input.ndim() != 4 {
        return Err(DataError::Config(format!(
            "the input layer must be images (N,C,H,W), got {input}"
        )));
    }
    let classes = graph
        .logits()
        .map_or(1, |logits| graph.layer(logits).shape.dim(1));
    let batch = input.dim(0);
    let data = Synthetic::new(
        seed,
        batch,
        classes,
        [input.dim(1), input.dim(2), input.dim(3)],
    )?;
    let len = data.sample_len();
    let mut images = vec![0.0; batch * len];
    let mut labels = Vec::with_capacity(batch);
    for (i, out) in images.chunks_exact_mut(len).enumerate() {
        labels.push(data.sample(i, out)?);
    }
    Ok((images, labels))
}

/// Which phase of its tile's t_c a task belongs to, if any.
fn phase(kind: TaskKind) -> Option<Phase> {
    match kind {
        TaskKind::LoadInput
        | TaskKind::Forward
        | TaskKind::BnMoments
        | TaskKind::BnNormalize
        | TaskKind::BnRunning => Some(Phase::Forward),
        TaskKind::Backward | TaskKind::BnGradSums | TaskKind::BnInputGrad => Some(Phase::Backward),
        TaskKind::Update { .. } | TaskKind::Empty => None,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Forward,
    Backward,
}

/// Running sums of tile times by key, in first-seen order (so the file is deterministic).
#[derive(Default)]
struct TileTimes {
    index: HashMap<ProfileKey, usize>,
    /// (layer, tile, summed times, samples)
    sums: Vec<(LayerId, Rect, PhaseTimes, u32)>,
}

impl TileTimes {
    /// Adds one sample per (layer, device) that computed in this step; returns the tasks timed.
    fn add_step(
        &mut self,
        graph: &Graph,
        plan: &StepPlan,
        reports: &[StepReport],
        settings: &ProfileSettings,
    ) -> usize {
        let mut step: HashMap<(LayerId, DeviceId), PhaseTimes> = HashMap::new();
        let mut tasks = 0;
        for r in reports {
            let program = &plan.programs[r.device];
            for e in &r.events {
                let LocalOpKind::Task { task, .. } = &program.ops[e.op as usize].kind else {
                    continue;
                };
                let Some(phase) = phase(task.kind) else {
                    continue;
                };
                tasks += 1;
                let times = step.entry((task.layer, r.device)).or_default();
                let seconds = e.end - e.start;
                match phase {
                    Phase::Forward => times.forward += seconds,
                    Phase::Backward => times.backward += seconds,
                }
            }
        }
        let mut samples: Vec<_> = step.into_iter().collect();
        // Deterministic first-seen order.
        samples.sort_by_key(|&((layer, device), _)| (layer.0, device));
        for ((layer, device), times) in samples {
            // A device holds at most one tile of a layer (tile t on device first + t), so the device
            // names the tile even for tasks whose own rect is not the tile (running statistics).
            let config = &plan.configs[layer.0];
            let Some(t) = device
                .checked_sub(config.first_device())
                .filter(|&t| t < config.total())
            else {
                continue;
            };
            let tile = tile_rect(&graph.layer(layer).shape, config, t);
            let key = ProfileKey::for_tile(
                graph.layer(layer),
                &graph.input_shapes(layer),
                &tile,
                &settings.device_kind,
            );
            let next = self.sums.len();
            let i = *self.index.entry(key).or_insert(next);
            if i == next {
                self.sums.push((layer, tile, PhaseTimes::default(), 0));
            }
            let (_, _, sum, n) = &mut self.sums[i];
            sum.forward += times.forward;
            sum.backward += times.backward;
            *n += 1;
        }
        tasks
    }

    fn into_db(self, graph: &Graph, device_kind: &str) -> ProfileDb {
        let mut db = ProfileDb::default();
        for (layer, tile, sum, n) in self.sums {
            let mean = PhaseTimes {
                forward: sum.forward / n as f64,
                backward: sum.backward / n as f64,
            };
            db.record(
                graph.layer(layer),
                &graph.input_shapes(layer),
                &tile,
                device_kind,
                mean,
                n,
            );
        }
        db
    }
}

/// (bytes, seconds) of transfers between devices, for the link fit.
#[derive(Default)]
struct LinkFit {
    points: Vec<(f64, f64)>,
}

impl LinkFit {
    fn add_step(&mut self, plan: &StepPlan, reports: &[StepReport]) {
        let sent = crate::trace::send_starts(plan, reports);
        for r in reports {
            let program = &plan.programs[r.device];
            let end_of: HashMap<u32, f64> = r.events.iter().map(|e| (e.op, e.end)).collect();
            for e in &r.events {
                let op = &program.ops[e.op as usize];
                let LocalOpKind::Recv { copy, dst, rect } = &op.kind else {
                    continue;
                };
                let Some(&(_, start)) = sent.get(copy) else {
                    continue;
                };
                let held = op
                    .deps
                    .iter()
                    .filter_map(|d| end_of.get(d))
                    .any(|&end| end > start);
                if held {
                    continue;
                }
                let bytes = rect.volume() * program.instances[*dst as usize].dtype.size();
                self.points.push((bytes as f64, (e.end - start).max(0.0)));
            }
        }
    }

    /// Least squares `seconds = latency + bytes · s_per_byte`. A negative intercept (noise on small
    /// messages) refits through the origin; without two distinct sizes there is no line to fit.
    fn fit(&self) -> Option<LinkProfile> {
        let n = self.points.len() as f64;
        if self.points.len() < 2 {
            return None;
        }
        let mean_x = self.points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = self.points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = self.points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        let sxy: f64 = self
            .points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum();
        if sxx <= 0.0 {
            return None;
        }
        let mut slope = sxy / sxx;
        let mut latency = mean_y - slope * mean_x;
        if latency < 0.0 {
            let sxx0: f64 = self.points.iter().map(|p| p.0 * p.0).sum();
            let sxy0: f64 = self.points.iter().map(|p| p.0 * p.1).sum();
            slope = sxy0 / sxx0;
            latency = 0.0;
        }
        (slope > 0.0 && slope.is_finite()).then(|| LinkProfile {
            bytes_per_s: 1.0 / slope,
            latency_s: latency,
            samples: self.points.len() as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_fit_recovers_a_line_and_needs_two_sizes() {
        let line = |b: f64| 50e-6 + b / 2e9;
        let fit = LinkFit {
            points: [1e3, 1e5, 1e6, 4e6].iter().map(|&b| (b, line(b))).collect(),
        }
        .fit()
        .unwrap();
        assert!((fit.bytes_per_s / 2e9 - 1.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.latency_s / 50e-6 - 1.0).abs() < 1e-6, "{fit:?}");
        assert_eq!(fit.samples, 4);
        let same_size = LinkFit {
            points: vec![(1e3, 1e-5), (1e3, 2e-5)],
        };
        assert_eq!(same_size.fit(), None);
        // noise below the origin: a line through it
        let fit = LinkFit {
            points: vec![(1e3, 0.0), (1e6, 1e-3), (2e6, 2.2e-3)],
        }
        .fit()
        .unwrap();
        assert_eq!(fit.latency_s, 0.0);
        assert!(fit.bytes_per_s > 0.0);
    }
}
