//! The step loop of a started [`Job`]: batches in, events and checkpoints out.

use super::Source;
use super::{Evaluation, Job, JobEvent, PlannedRun, StepDone, TrainSummary, verify};
use anyhow::{Context, bail};
use legion_cluster::engine::{self, Engine, JobStart, NextBatch, StepBatch};
use legion_ops::capture::CaptureStatus;
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::infer;
use legion_ops::train::{StepStats, TrainingState};
use legion_planner::ProfileDb;
use std::collections::BTreeMap;
use std::time::Instant;

/// Whether the `k`-th step of a run (from 1) times its tiles for the cost cache: the 3rd, 6th,
/// 12th, ... (the first two warm the caches and pools), so that a long run keeps refreshing the
/// costs at a cost that shrinks with its length.
fn is_measured(k: u64) -> bool {
    k >= 3 && k.is_multiple_of(3) && (k / 3).is_power_of_two()
}

impl Job {
    /// Runs the steps left, saving checkpoints and the trace as the options say, and reports each
    /// to `on_event`.
    pub fn run(self, on_event: impl FnMut(JobEvent<'_>)) -> anyhow::Result<TrainSummary> {
        Ok(self.run_inner(on_event, false)?.0)
    }

    /// [`Job::run`], also returning the trained state (weights, buffers, momentum), gathered
    /// from the devices.
    pub fn run_keeping_state(
        self,
        on_event: impl FnMut(JobEvent<'_>),
    ) -> anyhow::Result<(TrainSummary, TrainingState)> {
        let (summary, state) = self.run_inner(on_event, true)?;
        Ok((summary, state.expect("kept when asked")))
    }

    fn run_inner(
        self,
        mut on_event: impl FnMut(JobEvent<'_>),
        keep_state: bool,
    ) -> anyhow::Result<(TrainSummary, Option<TrainingState>)> {
        let Job {
            graph,
            opts,
            mut engine,
            source,
            validation,
            plan,
            devices,
            first_step,
            device,
            actors_on_gpus,
            describe_synthetic,
            precision,
            init_note,
            data_note,
            cost_warning,
            cost_cache,
            candidates,
            restart,
            inference,
        } = self;
        let mut plan = plan;
        on_event(JobEvent::Device(&device));
        for note in [&init_note, &data_note].into_iter().flatten() {
            on_event(JobEvent::Note(note));
        }
        if let Some(warning) = &cost_warning {
            on_event(JobEvent::Warning(warning));
        }
        // The steps' own tile times refresh the cache the search priced with.
        let mut measuring = cost_cache.map(|(cache, key)| {
            let settings = legion_profile::ProfileSettings {
                device_kind: key.device_kind.clone(),
                ..Default::default()
            };
            (
                legion_profile::Profiler::new(devices, &settings),
                cache,
                key,
            )
        });
        if let Some(plan) = &plan {
            on_event(JobEvent::Planned(plan));
        }
        // A run too short for the trials trains the search's strategy (`--verify`'s help).
        let mut trials = match restart {
            Some(_) if verify::fits(candidates.len(), opts.steps - first_step) => {
                Some(verify::Trials::new(candidates))
            }
            _ => None,
        };
        let batch = graph.batch();
        let config = LoaderConfig {
            seed: opts.seed,
            describe_synthetic,
            bad_samples: match opts.strict_data {
                true => data::BadSamples::Fail,
                false => data::BadSamples::Replace,
            },
            ..LoaderConfig::new(batch)
        };
        let (loader, mut batches, per_epoch) = match source {
            Source::Samples(dataset) => {
                let loader = Loader::new(dataset, config)?;
                let batches = loader.steps_until(first_step, opts.steps);
                let per_epoch = loader.batches_per_epoch() as u64;
                (Some(loader), batches, per_epoch)
            }
            Source::Feed(feed, shape) => {
                if first_step > 0 {
                    bail!(
                        "--resume: {} hands over its batches from its start; a resumed run \
                         would train on them again (resume with a dataset)",
                        feed.describe()
                    );
                }
                let per_epoch = feed.batches().unwrap_or(opts.steps).max(1);
                let batches = data::read_ahead(feed, shape, opts.steps, config.prefetch);
                (None, batches, per_epoch)
            }
        };
        let mut skipped = SkipReport::default();
        let mut evaluations = Vec::new();
        let every = opts.validation.as_ref().and_then(|v| v.every);
        let mut evaluate = |engine: &mut dyn Engine,
                            step: u64,
                            on_event: &mut dyn FnMut(JobEvent<'_>)|
         -> anyhow::Result<()> {
            let Some(held_out) = &validation else {
                return Ok(());
            };
            let started = Instant::now();
            let accuracy = infer::score(batch, held_out.clone(), opts.strict_data, |images| {
                engine.logits(images)
            })
            .context("scoring the held-out data")?;
            let evaluation = Evaluation {
                step,
                accuracy,
                seconds: started.elapsed().as_secs_f64(),
            };
            on_event(JobEvent::Evaluated(&evaluation));
            evaluations.push(evaluation);
            Ok(())
        };
        let started = Instant::now();
        let mut reported = Reported {
            awaiting: std::collections::VecDeque::with_capacity(2),
            per_epoch,
            epochs: opts.epochs,
            last_returned: started,
            losses: Vec::with_capacity(opts.steps as usize),
            batch,
            total_steps: opts.steps,
        };
        let save = |engine: &mut dyn Engine, plan: Option<&PlannedRun>| -> anyhow::Result<()> {
            if let Some(path) = &opts.save {
                let mut meta = BTreeMap::from([("model".to_string(), graph.name.clone())]);
                meta.extend(super::checks::schedule_metadata(&opts));
                if let Some(plan) = &plan {
                    meta.insert(super::STRATEGY_KEY.to_string(), plan.strategy.to_json());
                    meta.insert(super::DEVICES_KEY.to_string(), plan.devices.to_string());
                }
                let dataset = loader.as_ref().map(|l| l.dataset());
                if let Some(normalize) = dataset.and_then(|d| d.normalization()) {
                    meta.insert(
                        crate::evaluate::NORMALIZE_KEY.to_string(),
                        normalize.to_string(),
                    );
                }
                if let Some(census) = dataset.and_then(|d| d.census()) {
                    meta.insert(
                        crate::evaluate::CLASS_NAMES_KEY.to_string(),
                        serde_json::to_string(&census.class_names)?,
                    );
                }
                engine.state()?.save(path, meta)?;
            }
            Ok(())
        };
        let mut last_step = opts.steps;
        let mut next_batch = || -> anyhow::Result<data::Batch> {
            batches
                .next()
                .context("the data loader stopped early")?
                .context("loading a batch")
        };
        let mut upcoming = (first_step < opts.steps)
            .then(&mut next_batch)
            .transpose()?;
        let mut traced_reports = None;
        // Seconds spent scoring and saving between steps, which are not training's.
        let mut paused = 0.0;
        for step in first_step + 1..=opts.steps {
            if opts.stop.is_raised() {
                last_step = step - 1;
                break;
            }
            let batch_data = upcoming.take().expect("a batch for every step");
            upcoming = (step < opts.steps).then(&mut next_batch).transpose()?;
            let measured = measuring.is_some() && is_measured(step - first_step);
            let last_traced = opts.trace.is_some() && step == opts.steps;
            let traced = measured || last_traced;
            let cpu = measured.then(legion_runtime::CpuMeter::start);
            if !opts.lr_schedule.is_constant() {
                engine.set_lr(opts.lr_schedule.lr(opts.sgd.lr, step - 1, opts.steps));
            }
            let step_started = Instant::now();
            let (stats, reports) = engine.step(StepBatch {
                images: batch_data.images,
                labels: batch_data.labels,
                synthetic: batch_data.synthetic,
                next: upcoming.as_ref().map(|b| match &b.synthetic {
                    Some(described) => NextBatch::Synthetic(described),
                    None => NextBatch::Images(&b.images, &b.labels),
                }),
                trace: traced,
            })?;
            reported.returned(step);
            let stopping = step < opts.steps && opts.stop.is_raised();
            if let (Some(cpu), Some((profiler, ..)), Some(step_plan)) =
                (cpu, measuring.as_mut(), engine.plan())
            {
                profiler.add_step(&graph, step_plan, &reports, cpu.stop());
            }
            if last_traced {
                traced_reports = Some(reports);
            }
            if let Some(stats) = stats {
                reported.read(stats, &mut on_event)?;
            }
            if let (Some(t), Some(restart)) = (trials.as_mut(), &restart) {
                let next = t.stepped(step_started.elapsed().as_secs_f64());
                if let verify::Next::SwitchTo(i) = next {
                    let switching = Instant::now();
                    // Every step's loss is read before the state leaves the devices.
                    if let Some(stats) = engine.finish()? {
                        reported.read(stats, &mut on_event)?;
                    }
                    let state = engine.state()?;
                    drop(engine);
                    engine = engine::start(
                        restart.place(),
                        JobStart {
                            graph: &graph,
                            configs: &t.candidate(i).configs,
                            state,
                            sgd: opts.sgd,
                            seed: opts.seed,
                            precision,
                            inference,
                        },
                    )
                    .with_context(|| {
                        format!(
                            "re-sharding the run onto the {} strategy",
                            t.candidate(i).label
                        )
                    })?;
                    reported.last_returned = Instant::now();
                    paused += switching.elapsed().as_secs_f64();
                }
                if !t.running()
                    && let (Some(plan), Some(v)) = (plan.as_mut(), t.verification())
                    && plan.verification.is_none()
                {
                    let kept = &t.candidate(v.kept).configs;
                    plan.strategy = legion_planner::Strategy::from_configs(&graph, kept);
                    plan.remote_bytes = engine.plan().map_or(0, |p| p.remote_bytes());
                    plan.idle_devices = super::idle_devices(kept, devices);
                    plan.verification = Some(v);
                    if let Some(path) = &opts.save_strategy {
                        plan.strategy.save(path).with_context(|| {
                            format!("--save-strategy {}: the kept strategy", path.display())
                        })?;
                    }
                }
            }
            if let Some(loader) = &loader {
                skipped.report(loader, &mut on_event);
            }
            let checkpoint = opts.checkpoint_every.is_some_and(|k| step % k == 0);
            let scored = every.is_some_and(|k| step % k == 0);
            if (checkpoint || scored) && step < opts.steps && !stopping {
                // The step's loss is checked before its weights are saved or scored.
                if let Some(stats) = engine.finish()? {
                    reported.read(stats, &mut on_event)?;
                }
                let pause = Instant::now();
                if scored {
                    evaluate(engine.as_mut(), step, &mut on_event)?;
                }
                if checkpoint {
                    save(engine.as_mut(), plan.as_ref())?;
                }
                // Neither is the next step's time.
                reported.last_returned = Instant::now();
                paused += pause.elapsed().as_secs_f64();
            }
        }
        if let Some(stats) = engine.finish()? {
            reported.read(stats, &mut on_event)?;
        }
        if let Some(&(step, _)) = reported.awaiting.front() {
            bail!("step {step}: its loss was never read back");
        }
        let wall_secs = started.elapsed().as_secs_f64();
        if last_step > first_step {
            evaluate(engine.as_mut(), last_step, &mut on_event)?;
        }
        if let (Some(path), Some(reports)) = (&opts.trace, traced_reports) {
            let trace = match engine.plan() {
                Some(step_plan) => Some(legion_runtime::chrome_trace(step_plan, &graph, &reports)),
                None => engine.own_trace(),
            };
            if let Some(trace) = trace {
                legion_ops::atomic_file::write(path, serde_json::to_string(&trace)?.as_bytes())
                    .with_context(|| format!("writing the trace {}", path.display()))?;
            }
        }
        save(engine.as_mut(), plan.as_ref())?;
        let state = keep_state.then(|| engine.state()).transpose()?;
        let costs_added = match measuring {
            Some((profiler, cache, key)) => {
                // Tile entries only: the transport and runtime fits stay those of the runs
                // that measured every strategy's steps.
                let entries = profiler.finish(&graph).entries;
                let added = ProfileDb {
                    entries,
                    ..ProfileDb::default()
                };
                match added.entries.len() {
                    0 => None,
                    n => Some((n, cache.add(&key, &added)?.0)),
                }
            }
            None => None,
        };

        let skipped = loader.map(|l| l.skipped()).unwrap_or_default();
        let losses = reported.losses;
        let images = (losses.len() * batch) as f64;
        let summary = TrainSummary {
            model: graph.name.clone(),
            devices,
            plan,
            steps: last_step,
            stopped: last_step < opts.steps,
            first_step,
            batch,
            images_per_sec: (!losses.is_empty()).then(|| images / (wall_secs - paused)),
            losses,
            wall_secs,
            saved: opts.save.clone(),
            capture: match actors_on_gpus {
                true => Some(CaptureStatus::NotApplied(
                    "several devices exchange slices in mid-step: their actors enqueue op by op"
                        .into(),
                )),
                false => engine.capture_status(),
            },
            synthetic_on_device: describe_synthetic,
            loss_read_late: engine.reads_loss_late(),
            precision,
            skipped,
            validation: evaluations,
            costs_added,
        };
        on_event(JobEvent::Finished(&summary));
        Ok((summary, state))
    }
}

/// Warns of each sample the loader skipped, once, as the run meets it.
#[derive(Default)]
struct SkipReport {
    warned: usize,
}

impl SkipReport {
    fn report(&mut self, loader: &Loader, on_event: &mut impl FnMut(JobEvent<'_>)) {
        let skipped = loader.skipped();
        for (_, why) in &skipped.first[self.warned.min(skipped.first.len())..] {
            on_event(JobEvent::Warning(&format!(
                "skipped a sample: {why} (another sample of the epoch took its place; \
                 --strict-data to stop instead)"
            )));
        }
        self.warned = skipped.first.len();
    }
}

/// The steps a job gave its engine whose stats are still to come back, matched to the stats as
/// the engine reads them back (in order: this step's, or one step late the previous step's),
/// and reported.
///
/// A step's time is the pace of the engine's step calls: from the return of the one before to
/// its own. Where the stats come one step late, the time between two reads would be the next
/// step's (a CPU computes while it is called) and the last read's nearly nothing.
struct Reported {
    /// Oldest first, each with its step's seconds.
    awaiting: std::collections::VecDeque<(u64, f64)>,
    /// When the engine's last step call returned (the run's start before the first).
    last_returned: Instant,
    losses: Vec<f32>,
    batch: usize,
    total_steps: u64,
    /// Steps a pass over the data takes, and the passes asked for (`--epochs`).
    per_epoch: u64,
    epochs: Option<u64>,
}

impl Reported {
    /// Notes that the engine's call for `step` returned.
    fn returned(&mut self, step: u64) {
        let now = Instant::now();
        let seconds = (now - self.last_returned).as_secs_f64();
        self.last_returned = now;
        self.awaiting.push_back((step, seconds));
    }

    /// Reports `stats` as the oldest awaited step's, refusing a loss that is not finite.
    fn read(
        &mut self,
        stats: StepStats,
        on_event: &mut impl FnMut(JobEvent<'_>),
    ) -> anyhow::Result<()> {
        let (step, seconds) = self
            .awaiting
            .pop_front()
            .context("the engine read back more steps than it was given")?;
        if !stats.loss.is_finite() {
            bail!(
                "step {step}: the loss is {} (try a smaller --lr)",
                stats.loss
            );
        }
        self.losses.push(stats.loss);
        on_event(JobEvent::Step(&StepDone {
            step,
            total_steps: self.total_steps,
            epoch: (step - 1) / self.per_epoch + 1,
            epochs: self.epochs,
            steps_per_epoch: self.per_epoch,
            loss: stats.loss,
            accuracy: stats.correct as f64 / self.batch as f64,
            seconds,
            images_per_sec: self.batch as f64 / seconds,
            host: stats.host,
        }));
        Ok(())
    }
}
