//! The step loop of a started [`Job`]: batches in, events and checkpoints out.

use super::Restart;
use super::Source;
use super::{Evaluation, Job, JobEvent, PlannedRun, StepDone, TrainSummary, verify};
use anyhow::{Context, bail};
use legion_cluster::engine::{self, Engine, JobStart, NextBatch, SamplesToRead, StepBatch};
use legion_cluster::hosts::Hosts;
use legion_cluster::{UnreadableSamples, WorkerLost};
use legion_ops::capture::CaptureStatus;
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::infer;
use legion_ops::partition::ParallelConfig;
use legion_ops::train::{StepStats, TrainingState};
use legion_ops::{Graph, Precision};
use legion_planner::ProfileDb;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
            images_as_bytes,
            workers_read,
            precision,
            init_note,
            data_note,
            cost_warning,
            cost_cache,
            candidates,
            mut restart,
            inference,
            snapshot,
        } = self;
        let mut plan = plan;
        let mut devices = devices;
        // The latest state the run can go back to on the devices left if it loses a worker.
        let mut snapshot = snapshot.map(|state| (first_step, state));
        let mut recoveries: Vec<super::Recovered> = Vec::new();
        // Workers lost and recovered from, over every recovery.
        let mut lost_workers = 0u32;
        let mut rejoins: Vec<super::Rejoined> = Vec::new();
        // Snapshots taken, and the seconds their gathering took.
        let mut snapshots = (0usize, 0.0f64);
        let mut next_snapshot = first_step.saturating_add(
            opts.recovery
                .snapshot_every
                .unwrap_or(super::FIRST_SNAPSHOT),
        );
        // Seconds of the steps since the last snapshot, and how many.
        let mut stepping = (0.0f64, 0u64);
        // Bytes the steps' samples took to the workers, and over how many steps.
        let mut input_sent = (0u64, 0u64);
        let mut rejoin = Rejoin::new(&opts);
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
            // the workers read the samples themselves, or make a folder's image bytes values:
            // a quarter of the bytes to send
            labels_only: workers_read.is_some(),
            bytes: images_as_bytes,
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
        let save = |state: &TrainingState, plan: Option<&PlannedRun>| -> anyhow::Result<()> {
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
                state.save(path, meta)?;
            }
            Ok(())
        };
        // A lost worker the run does not recover from: the latest snapshot is saved where --save
        // says, and the error says how to go on.
        let stop = |error: anyhow::Error,
                    why: &str,
                    snapshot: &Option<(u64, TrainingState)>,
                    plan: Option<&PlannedRun>|
         -> anyhow::Error {
            let Some(lost) = WorkerLost::in_error(&error) else {
                return error;
            };
            let up = match (&opts.cluster, &opts.cluster_state) {
                (Some(hosts), Some(state)) => {
                    format!(
                        "legion-rs up {} --state {}",
                        hosts.display(),
                        state.display()
                    )
                }
                (Some(hosts), None) => format!("legion-rs up {}", hosts.display()),
                (None, _) => "legion-rs up --slurm".to_string(),
            };
            let worker = lost.who.clone();
            let saved = match (snapshot, &opts.save) {
                (Some((step, state)), Some(path)) => match save(state, plan) {
                    Ok(()) => format!(
                        "; the snapshot of step {step} is saved to {}, so that rerunning the \
                         same command with --resume {} goes on from there",
                        path.display(),
                        path.display()
                    ),
                    Err(e) => format!("; saving the snapshot of step {step} failed: {e:#}"),
                },
                (None, Some(path)) => format!(
                    "; rerun the same command with --resume {} to go on from its last checkpoint",
                    path.display()
                ),
                (_, None) => "; this run saves no checkpoint to resume from (--save PATH \
                              --checkpoint-every K)"
                    .to_string(),
            };
            let why = match why {
                "" => String::new(),
                why => format!("the run cannot go on without it: {why}; "),
            };
            error.context(format!("{why}restart {worker} with `{up}`{saved}"))
        };
        let mut last_step = opts.steps;
        let next_batch = |batches: &mut data::Batches| -> anyhow::Result<data::Batch> {
            batches
                .next()
                .context("the data loader stopped early")?
                .context("loading a batch")
        };
        let mut upcoming = (first_step < opts.steps)
            .then(|| next_batch(&mut batches))
            .transpose()?;
        let mut traced_reports = None;
        // Seconds spent scoring and saving between steps, which are not training's.
        let mut paused = 0.0;
        let mut step = first_step;
        // A lost worker, noticed at a step or at a snapshot, is recovered from here: the loop
        // goes on from the snapshot on the workers left. Anything else ends the run.
        macro_rules! recover {
            ($error:expr, $steps_done:expr) => {{
                let error: anyhow::Error = $error;
                let steps_done: u64 = $steps_done;
                let noticed = Instant::now();
                let on = match &restart {
                    Some(Restart::Cluster { hosts, .. }) => Some(hosts),
                    _ => None,
                };
                let why_not = match WorkerLost::in_error(&error) {
                    None => return Err(error),
                    Some(_) => why_not_recovered(on, &loader, &opts, lost_workers),
                };
                if let Some(why) = why_not {
                    return Err(stop(error, &why, &snapshot, plan.as_ref()));
                }
                let lost = WorkerLost::in_error(&error).expect("a lost worker");
                let (lost_worker, mut lost_text) = (lost.worker, lost.to_string());
                let Some(Restart::Cluster {
                    hosts,
                    state_dir,
                    gpu,
                }) = restart.take()
                else {
                    unreachable!("recovered only on a cluster")
                };
                let (from_step, state) = snapshot.as_ref().expect("a cluster run keeps a snapshot");
                let mut left = hosts.without(lost_worker);
                lost_workers += 1;
                // The workers left end the broken job before they take the new one.
                drop(engine);
                let job = ClusterJob {
                    graph: &graph,
                    opts: &opts,
                    state_dir: &state_dir,
                    gpu,
                    precision,
                    inference,
                    data: workers_read.as_ref(),
                };
                let (configs, costs, [search_s, restore_s]) = loop {
                    match job.start_on(&left, state.clone()) {
                        Ok(started) => {
                            engine = started.engine;
                            let times = [started.search_s, started.restore_s];
                            break (started.configs, started.costs, times);
                        }
                        // One more worker lost while the job restarts: recovered from too.
                        Err(e) => {
                            if WorkerLost::in_error(&e).is_none() {
                                // No strategy fits the devices left, or a worker left refused
                                // the job: the snapshot is saved all the same.
                                let why = format!(
                                    "starting on the {} device(s) left failed: {e:#}",
                                    left.num_devices()
                                );
                                return Err(stop(error, &why, &snapshot, plan.as_ref()));
                            }
                            let why_not =
                                why_not_recovered(Some(&left), &loader, &opts, lost_workers);
                            if let Some(why) = why_not {
                                let e = e.context(format!("after {lost_text}"));
                                return Err(stop(e, &why, &snapshot, plan.as_ref()));
                            }
                            let also = WorkerLost::in_error(&e).expect("a lost worker");
                            lost_text += &format!("; then {also}");
                            left = left.without(also.worker);
                            lost_workers += 1;
                        }
                    }
                };
                devices = left.num_devices();
                replanned(&mut plan, &graph, engine.as_ref(), &configs, &left);
                let recovered = super::Recovered {
                    lost: lost_text,
                    from_step: *from_step,
                    steps_lost: steps_done - from_step,
                    devices,
                    strategy: opts.strategy.to_string(),
                    costs,
                    seconds: noticed.elapsed().as_secs_f64(),
                    search_s,
                    restore_s,
                    count: lost_workers,
                    max: opts.recovery.max_recoveries,
                };
                on_event(JobEvent::Recovered(&recovered));
                recoveries.push(recovered);
                // The steps after the snapshot are trained again, on the same batches.
                step = *from_step;
                rejoin.forget();
                next_snapshot = step
                    + opts
                        .recovery
                        .snapshot_every
                        .unwrap_or(super::FIRST_SNAPSHOT);
                stepping = (0.0, 0);
                let loader = loader.as_ref().expect("recoverable with a loader");
                batches = loader.steps_until(step, opts.steps);
                upcoming = (step < opts.steps)
                    .then(|| next_batch(&mut batches))
                    .transpose()?;
                reported.rewind(step - first_step);
                // Trials and measuring were of the devices before.
                trials = None;
                measuring = None;
                restart = Some(Restart::Cluster {
                    hosts: left,
                    state_dir,
                    gpu,
                });
                paused += noticed.elapsed().as_secs_f64();
                continue;
            }};
        }
        while step < opts.steps {
            step += 1;
            if opts.stop.is_raised() {
                last_step = step - 1;
                break;
            }
            let mut batch_data = upcoming.take().expect("a batch for every step");
            upcoming = (step < opts.steps)
                .then(|| next_batch(&mut batches))
                .transpose()?;
            let measured = measuring.is_some() && is_measured(step - first_step);
            let last_traced = opts.trace.is_some() && step == opts.steps;
            let traced = measured || last_traced;
            let cpu = measured.then(legion_runtime::CpuMeter::start);
            if !opts.lr_schedule.is_constant() {
                engine.set_lr(opts.lr_schedule.lr(opts.sgd.lr, step - 1, opts.steps));
            }
            let step_started = Instant::now();
            let sent_before = engine.input_bytes_sent();
            let to_read = |b: &data::Batch| {
                b.unread.then(|| SamplesToRead {
                    epoch: b.epoch,
                    indices: b.indices.clone(),
                })
            };
            let stepped = loop {
                let next_to_read = upcoming.as_ref().and_then(to_read);
                let stepped = engine.step(StepBatch {
                    images: std::mem::take(&mut batch_data.images),
                    bytes: batch_data.bytes.take(),
                    labels: std::mem::take(&mut batch_data.labels),
                    synthetic: batch_data.synthetic.take(),
                    to_read: to_read(&batch_data),
                    next: upcoming.as_ref().map(|b| {
                        match (&next_to_read, &b.synthetic, &b.bytes) {
                            (Some(read), ..) => NextBatch::ToRead(read, &b.labels),
                            (None, Some(described), _) => NextBatch::Synthetic(described),
                            (None, None, Some(bytes)) => NextBatch::Bytes(bytes, &b.labels),
                            (None, None, None) => NextBatch::Images(&b.images, &b.labels),
                        }
                    }),
                    trace: traced,
                });
                // Samples the workers could not read are replaced as the loader replaces those
                // it cannot, and the step runs on its batch then (or fails, with --strict-data).
                let (Err(error), Some(loader)) = (&stepped, &loader) else {
                    break stepped;
                };
                // Only samples of this batch are replaced: anything else ends the run.
                let Some(unreadable) = UnreadableSamples::in_error(error).filter(|u| {
                    u.samples
                        .iter()
                        .all(|(i, _)| batch_data.indices.contains(i))
                }) else {
                    break stepped;
                };
                for (index, why) in &unreadable.samples {
                    loader.mark_unreadable(*index, why);
                }
                // Batches built before are replaced when their step meets the sample again.
                batch_data = loader
                    .batch(batch_data.epoch, batch_data.batch)
                    .with_context(|| format!("step {step}"))?;
            };
            let (stats, reports) = match stepped {
                Ok(done) => done,
                Err(error) => recover!(error, step - 1),
            };
            if let (Some(before), Some(after)) = (sent_before, engine.input_bytes_sent()) {
                input_sent.0 += after.saturating_sub(before);
                input_sent.1 += 1;
            }
            stepping.0 += step_started.elapsed().as_secs_f64();
            stepping.1 += 1;
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
                        restart.place(workers_read.as_ref()),
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
            let snapshotted = snapshot.is_some() && step >= next_snapshot;
            if (checkpoint || scored || snapshotted) && step < opts.steps && !stopping {
                // The step's loss is checked before its weights are saved or scored.
                match engine.finish() {
                    Ok(Some(stats)) => reported.read(stats, &mut on_event)?,
                    Ok(None) => {}
                    Err(error) => recover!(error, step),
                }
                let pause = Instant::now();
                if scored {
                    evaluate(engine.as_mut(), step, &mut on_event)?;
                }
                if checkpoint || snapshotted {
                    let gathering = Instant::now();
                    let state = match engine.state() {
                        Ok(state) => state,
                        Err(error) => recover!(error, step),
                    };
                    if snapshotted {
                        let gather_s = gathering.elapsed().as_secs_f64();
                        snapshots.0 += 1;
                        snapshots.1 += gather_s;
                        let step_s = stepping.0 / stepping.1.max(1) as f64;
                        next_snapshot =
                            step.saturating_add(opts.recovery.interval_after(gather_s, step_s));
                        stepping = (0.0, 0);
                    }
                    if checkpoint {
                        save(&state, plan.as_ref())?;
                    }
                    if snapshot.is_some() {
                        snapshot = Some((step, state));
                    }
                }
                // Workers back (or added to the hosts file) join at a snapshot: the state is the
                // step's, so nothing is trained again.
                if let (
                    true,
                    Some(Restart::Cluster {
                        hosts,
                        state_dir,
                        gpu,
                    }),
                    Some((_, state)),
                ) = (snapshotted, &restart, &snapshot)
                    && let Some(all) = rejoin.poll(hosts, state_dir)
                {
                    let joining = Instant::now();
                    let workers: Vec<String> = (all.hosts.iter())
                        .filter(|h| !hosts.hosts.iter().any(|c| c.name == h.name))
                        .map(|h| format!("worker {} ({})", h.name, h.endpoint()))
                        .collect();
                    drop(engine);
                    let job = ClusterJob {
                        graph: &graph,
                        opts: &opts,
                        state_dir,
                        gpu: *gpu,
                        precision,
                        inference,
                        data: workers_read.as_ref(),
                    };
                    match job.start_on(&all, state.clone()) {
                        Ok(started) => {
                            engine = started.engine;
                            let configs = started.configs;
                            devices = all.num_devices();
                            replanned(&mut plan, &graph, engine.as_ref(), &configs, &all);
                            let rejoined = super::Rejoined {
                                workers,
                                step,
                                devices,
                                strategy: opts.strategy.to_string(),
                                costs: started.costs,
                                seconds: joining.elapsed().as_secs_f64(),
                            };
                            on_event(JobEvent::Rejoined(&rejoined));
                            rejoins.push(rejoined);
                            trials = None;
                            measuring = None;
                            restart = Some(Restart::Cluster {
                                hosts: all,
                                state_dir: state_dir.clone(),
                                gpu: *gpu,
                            });
                        }
                        Err(e) => {
                            // Gone again, or busy with another job: trained on without them.
                            let why = format!("taking back {}: {e:#}", workers.join(", "));
                            on_event(JobEvent::Warning(&why));
                            rejoin.forget();
                            engine = job
                                .start_on(hosts, state.clone())
                                .with_context(|| {
                                    format!("after failing to take back {}", workers.join(", "))
                                })?
                                .engine;
                        }
                    }
                }
                // Neither is the next step's time.
                reported.last_returned = Instant::now();
                paused += pause.elapsed().as_secs_f64();
            }
        }
        let finished = engine
            .finish()
            .map_err(|e| stop(e, "", &snapshot, plan.as_ref()))?;
        if let Some(stats) = finished {
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
        let state = match (opts.save.is_some(), keep_state) {
            (false, false) => None,
            _ => Some(
                engine
                    .state()
                    .map_err(|e| stop(e, "", &snapshot, plan.as_ref()))?,
            ),
        };
        if let Some(state) = &state {
            save(state, plan.as_ref())?;
        }
        let state = state.filter(|_| keep_state);
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
            recoveries,
            rejoins,
            snapshots,
            input_bytes_per_step: (input_sent.1 > 0)
                .then(|| input_sent.0 as f64 / input_sent.1 as f64),
        };
        on_event(JobEvent::Finished(&summary));
        Ok((summary, state))
    }
}

/// What starts a cluster run's job again on another set of workers.
struct ClusterJob<'a> {
    graph: &'a Graph,
    opts: &'a super::TrainOptions,
    state_dir: &'a Path,
    gpu: legion_cuda::Settings,
    precision: Precision,
    inference: bool,
    /// What the workers read the training samples from, where they do.
    data: Option<&'a data::DataSource>,
}

impl ClusterJob<'_> {
    /// The job started on `hosts` from `state`, under the strategy the run's search (or scheme)
    /// finds for their devices; and the seconds the search and the start (the state loaded onto
    /// the devices) took.
    fn start_on(&self, hosts: &Hosts, state: TrainingState) -> anyhow::Result<Restarted> {
        let devices = hosts.num_devices();
        let searching = Instant::now();
        let (configs, costs) =
            super::replan_cluster(self.graph, self.opts, hosts, self.state_dir, self.precision)
                .with_context(|| format!("re-planning for {devices} device(s)"))?;
        let search_s = searching.elapsed().as_secs_f64();
        let restoring = Instant::now();
        let engine = engine::start(
            legion_cluster::Place::Cluster {
                hosts,
                state_dir: self.state_dir,
                gpu: self.gpu,
                data: self.data,
            },
            JobStart {
                graph: self.graph,
                configs: &configs,
                state,
                sgd: self.opts.sgd,
                seed: self.opts.seed,
                precision: self.precision,
                inference: self.inference,
            },
        )
        .with_context(|| format!("restarting on {} worker(s)", hosts.hosts.len()))?;
        Ok(Restarted {
            engine,
            configs,
            costs,
            search_s,
            restore_s: restoring.elapsed().as_secs_f64(),
        })
    }
}

/// A cluster job started again: its engine and strategy, and the seconds the search and the start
/// took.
struct Restarted {
    engine: Box<dyn Engine>,
    configs: Vec<ParallelConfig>,
    costs: Option<crate::costs::CostReport>,
    search_s: f64,
    restore_s: f64,
}

/// The run's plan, now `configs` on `hosts`.
fn replanned(
    plan: &mut Option<PlannedRun>,
    graph: &Graph,
    engine: &dyn Engine,
    configs: &[ParallelConfig],
    hosts: &Hosts,
) {
    if let Some(plan) = plan.as_mut() {
        plan.devices = hosts.num_devices();
        plan.place = format!("{} worker(s)", hosts.hosts.len());
        plan.remote_bytes = engine.plan().map_or(0, |p| p.remote_bytes());
        plan.idle_devices = super::idle_devices(configs, plan.devices);
        plan.strategy = legion_planner::Strategy::from_configs(graph, configs);
    }
}

/// Looks, beside the step loop, for workers of the hosts file that a cluster run does not train
/// on (lost ones restarted by `legion-rs up`, hosts added to the file) and that answer, free of
/// any job: the run takes them back at its next snapshot.
struct Rejoin {
    cluster: Option<PathBuf>,
    cluster_state: Option<PathBuf>,
    probe: Option<std::thread::JoinHandle<Option<Hosts>>>,
    /// When the last probe started: snapshots of a small model may come every step, probes not.
    started: Option<Instant>,
}

/// The least time between the starts of two probes.
const PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

impl Rejoin {
    fn new(opts: &super::TrainOptions) -> Rejoin {
        Rejoin {
            cluster: opts.cluster.clone(),
            cluster_state: opts.cluster_state.clone(),
            probe: None,
            started: None,
        }
    }

    /// Drops a probe under way: it looks for hosts beside workers the run no longer has.
    fn forget(&mut self) {
        self.probe = None;
        self.started = None;
    }

    /// The hosts file's hosts that a run on `current` can train on now, where a probe found more
    /// than `current` (in the file's order); starts the next probe where the last has ended.
    fn poll(&mut self, current: &Hosts, state_dir: &Path) -> Option<Hosts> {
        let found = match self.probe.take() {
            Some(probe) if probe.is_finished() => probe.join().ok().flatten(),
            Some(probe) => {
                self.probe = Some(probe);
                return None;
            }
            None => None,
        };
        if found.is_none() && self.started.is_none_or(|t| t.elapsed() >= PROBE_EVERY) {
            self.started = Some(Instant::now());
            let (cluster, state) = (self.cluster.clone(), self.cluster_state.clone());
            let (current, state_dir) = (current.clone(), state_dir.to_path_buf());
            self.probe = Some(std::thread::spawn(move || {
                answering(cluster.as_deref(), state.as_deref(), &current, &state_dir)
            }));
        }
        found
    }
}

/// The hosts file's hosts, less those neither in `current` nor answering free of a job; `None`
/// when that is `current` (or the file cannot be read).
fn answering(
    cluster: Option<&Path>,
    state: Option<&Path>,
    current: &Hosts,
    state_dir: &Path,
) -> Option<Hosts> {
    let file = legion_cluster::launch::locate(cluster, state)
        .and_then(|located| located.load_hosts())
        .ok()?;
    let runs = |name: &str| current.hosts.iter().any(|h| h.name == name);
    let missing = Hosts {
        hosts: file
            .hosts
            .iter()
            .filter(|h| !runs(&h.name))
            .cloned()
            .collect(),
        links: Vec::new(),
        precision: file.precision,
    };
    if missing.hosts.is_empty() {
        return None;
    }
    let table = legion_cluster::launch::status(&missing, state_dir).ok()?;
    // Back with the devices the file (or `up`) says, and free.
    let listed = |name: &str| {
        file.hosts
            .iter()
            .find(|h| h.name == name)
            .map(|h| h.devices)
    };
    let back: Vec<&str> = (table.iter())
        .filter(|row| {
            row.welcome.as_ref().is_some_and(|w| {
                w.job_of.is_none() && listed(&row.host.name) == Some(w.devices as usize)
            })
        })
        .map(|row| row.host.name.as_str())
        .collect();
    if back.is_empty() {
        return None;
    }
    let mut all = file;
    while let Some(i) =
        (all.hosts.iter()).position(|h| !runs(&h.name) && !back.contains(&h.name.as_str()))
    {
        all = all.without(i);
    }
    Some(all)
}

/// Why a run on `hosts` (none: not a cluster) that has recovered from `recovered` lost workers
/// cannot recover from one more, if it cannot.
fn why_not_recovered(
    hosts: Option<&Hosts>,
    loader: &Option<Loader>,
    opts: &super::TrainOptions,
    recovered: u32,
) -> Option<String> {
    let max = opts.recovery.max_recoveries;
    match hosts {
        _ if max == 0 => Some("recovery is off (--no-recover)".into()),
        None => Some("only a run on a cluster's workers recovers".into()),
        Some(hosts) if hosts.hosts.len() < 2 => Some("no other worker is left".into()),
        Some(_) if recovered >= max => Some(format!(
            "it recovered from {recovered} lost worker(s) already, the most --max-recoveries \
             allows"
        )),
        Some(_) if loader.is_none() => Some(
            "its batches come from the caller once, so the steps after the snapshot cannot be \
             trained again"
                .into(),
        ),
        Some(_) => None,
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

    /// Forgets what was reported after the run's first `kept` steps: they are trained again.
    fn rewind(&mut self, kept: u64) {
        self.awaiting.clear();
        self.losses.truncate(kept as usize);
        self.last_returned = Instant::now();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{Recovery, TrainOptions};

    fn hosts(n: usize) -> Hosts {
        let text: String = (0..n)
            .map(|i| {
                format!(
                    "[[host]]\nname = \"w{i}\"\naddress = \"127.0.0.1\"\nport = {}\n",
                    7000 + i
                )
            })
            .collect();
        Hosts::parse(&text, "hosts.toml").unwrap()
    }

    #[test]
    fn a_lost_worker_is_recovered_from_while_workers_recoveries_and_data_allow() {
        let opts = TrainOptions::default();
        let loader = Some(
            Loader::new(
                std::sync::Arc::new(legion_ops::data::Synthetic::new(1, 16, 2, [1, 8, 8]).unwrap()),
                LoaderConfig::new(4),
            )
            .unwrap(),
        );
        let three = hosts(3);
        assert_eq!(why_not_recovered(Some(&three), &loader, &opts, 0), None);
        assert_eq!(why_not_recovered(Some(&three), &loader, &opts, 2), None);
        let why = |h: Option<&Hosts>, loader: &Option<Loader>, opts: &TrainOptions, n| {
            why_not_recovered(h, loader, opts, n).expect("refused")
        };
        assert!(why(Some(&three), &loader, &opts, 3).contains("recovered from 3 lost worker(s)"));
        assert!(why(Some(&hosts(1)), &loader, &opts, 0).contains("no other worker is left"));
        assert!(why(None, &loader, &opts, 0).contains("only a run on a cluster"));
        assert!(why(Some(&three), &None, &opts, 0).contains("come from the caller once"));
        let off = TrainOptions {
            recovery: Recovery {
                max_recoveries: 0,
                ..Recovery::default()
            },
            ..TrainOptions::default()
        };
        assert!(why(Some(&three), &loader, &off, 0).contains("--no-recover"));
    }
}
