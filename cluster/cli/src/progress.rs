//! What a training run shows the user: the [`JobEvent`]s of a [`Job`](legion::job::Job) as text
//! lines, as a progress bar on a terminal, or as one JSON object per line; and what a long plan
//! shows while it searches ([`PlanProgress`]).

use indicatif::{ProgressBar, ProgressStyle};
use legion::Training;
use legion::job::{Evaluation, JobEvent, PlannedRun, StepDone, TrainSummary};
use legion_cluster::memory::human_bytes;
use legion_ops::capture::CaptureStatus;
use legion_ops::data::OpenProgress;
use legion_planner::progress::{Phase, Progress};
use serde_json::json;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Runs `training`, printing its progress to stdout: JSON lines with `json`, text otherwise; a
/// long strategy search shows its own on stderr until the run's first event.
pub fn train(training: Training, json: bool) -> anyhow::Result<TrainSummary> {
    let search = Arc::new(PlanProgress::new());
    let mut printer = Printer::new(json);
    let mut searching = true;
    let training = training
        .search_progress(search.clone())
        .open_progress(search.clone());
    training.run(|event| {
        if std::mem::take(&mut searching) {
            search.finish();
        }
        printer.show(event)
    })
}

/// Prints a run's events to stdout (the progress bar draws on stderr).
pub struct Printer {
    json: bool,
    /// Drawn from the first step on, when stderr is a terminal and the output is text.
    progress: Option<ProgressBar>,
}

impl Printer {
    /// JSON lines with `json`, text otherwise.
    pub fn new(json: bool) -> Printer {
        Printer {
            json,
            progress: None,
        }
    }

    pub fn show(&mut self, event: JobEvent<'_>) {
        match event {
            // Always the first line: JSON output gives it as an object of its own.
            JobEvent::Device(line) if self.json => println!("{}", json!({ "device": line })),
            JobEvent::Device(line) => println!("{line}"),
            JobEvent::Note(line) => eprintln!("note: {line}"),
            JobEvent::Warning(line) => self.say(format!("warning: {line}")),
            JobEvent::Planned(plan) => self.planned(plan),
            JobEvent::Step(step) => self.step(step),
            JobEvent::Evaluated(e) => self.evaluated(e),
            JobEvent::Recovered(r) if self.json => {
                println!("{}", json!({ "recovered": recovered_json(r) }))
            }
            JobEvent::Rejoined(r) if self.json => {
                println!("{}", json!({ "rejoined": rejoined_json(r) }))
            }
            JobEvent::Recovered(r) => self.say(format!("warning: {r}")),
            JobEvent::Rejoined(r) => self.say(format!("note: {r}")),
            JobEvent::Finished(summary) => self.finished(summary),
        }
    }

    /// A line on stderr, above the progress bar where there is one.
    fn say(&self, line: String) {
        match &self.progress {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn planned(&self, plan: &PlannedRun) {
        if !plan.idle_devices.is_empty() {
            let used = plan.devices - plan.idle_devices.len();
            eprintln!(
                "warning: the {} strategy uses {used} of the {} devices; device(s) {} stay idle",
                plan.choice,
                plan.devices,
                describe_list(&plan.idle_devices)
            );
        }
        // JSON output gives the plan once, in the summary.
        if !self.json {
            println!(
                "strategy {} on {} device(s) ({}), {} moved between devices per step:\n{}",
                plan.choice,
                plan.devices,
                plan.place,
                human_bytes(plan.remote_bytes),
                plan.strategy
            );
            if let Some(costs) = &plan.costs {
                println!("{costs}");
            }
        }
    }

    fn step(&mut self, s: &StepDone) {
        if self.json {
            let mut line = json!({"step": s.step, "epoch": s.epoch, "loss": s.loss, "accuracy": s.accuracy,
                                  "step_ms": s.seconds * 1e3, "images_per_sec": s.images_per_sec});
            if let Some(host) = s.host {
                line["enqueue_ms"] = json!(host.enqueue * 1e3);
                line["stage_ms"] = json!(host.stage * 1e3);
                line["wait_ms"] = json!(host.wait * 1e3);
            }
            println!("{line}");
            return;
        }
        // A run of epochs draws a bar per epoch, each left on screen as the next starts.
        let (first, len) = match s.epochs {
            Some(_) => {
                let first = (s.epoch - 1) * s.steps_per_epoch;
                (first, s.steps_per_epoch.min(s.total_steps - first))
            }
            None => (0, s.total_steps),
        };
        let new_epoch = s.epochs.is_some() && s.step == first + 1;
        if (self.progress.is_none() || new_epoch) && std::io::stderr().is_terminal() {
            if let Some(done) = self.progress.take() {
                done.finish();
            }
            let bar = ProgressBar::new(len);
            bar.set_style(
                ProgressStyle::with_template("{prefix}{bar:30} {pos}/{len} steps  {msg}")
                    .expect("valid progress template"),
            );
            if let Some(epochs) = s.epochs {
                bar.set_prefix(format!("epoch {}/{epochs} ", s.epoch));
            }
            self.progress = Some(bar);
        }
        match &self.progress {
            Some(bar) => {
                bar.set_position(s.step - first);
                bar.set_message(format!("loss {:.4}  {:.1} img/s", s.loss, s.images_per_sec));
            }
            None => println!(
                "step {:>5}  loss {:.4}  acc {:.3}  {:.1} img/s",
                s.step, s.loss, s.accuracy, s.images_per_sec
            ),
        }
    }

    fn evaluated(&self, e: &Evaluation) {
        let a = &e.accuracy;
        if self.json {
            println!(
                "{}",
                json!({"eval": true, "step": e.step, "samples": a.samples, "top1": a.top1,
                       "top5": a.top5, "loss": a.loss, "eval_ms": e.seconds * 1e3})
            );
            return;
        }
        let line = format!(
            "held out at step {}: top-1 {:.2}%  top-5 {:.2}%  loss {:.4}  ({} samples, {:.1} s)",
            e.step,
            100.0 * a.top1,
            100.0 * a.top5,
            a.loss,
            a.samples,
            e.seconds
        );
        match &self.progress {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    fn finished(&mut self, summary: &TrainSummary) {
        if let Some(bar) = self.progress.take() {
            bar.finish();
        }
        let trend = summary.loss_trend();
        let TrainSummary {
            model,
            steps,
            first_step,
            batch,
            images_per_sec,
            wall_secs,
            ..
        } = summary;
        if self.json {
            let plan = match &summary.plan {
                Some(p) => json!({
                    "strategy": p.choice.to_string(),
                    "layers": p.strategy.layers,
                    "comm_bytes_per_step": p.remote_bytes,
                    "idle_devices": p.idle_devices,
                    "costs": p.costs.as_ref().map(costs_json),
                    "verification": p.verification.as_ref().map(|v| json!({
                        "kept": v.candidates[v.kept].label,
                        "candidates": v.candidates.iter().map(|c| json!({
                            "strategy": c.label, "simulated_ms": c.simulated_ms,
                            "measured_ms": c.measured_ms})).collect::<Vec<_>>(),
                    })),
                }),
                None => serde_json::Value::Null,
            };
            println!(
                "{}",
                json!({"summary": true, "model": model, "devices": summary.devices,
                       "plan": plan,
                       "steps": steps, "first_step": first_step,
                       "steps_taken": summary.steps_taken(), "batch": batch,
                       "first_losses_mean": trend.map(|t| t.first),
                       "last_losses_mean": trend.map(|t| t.last),
                       "loss_window": trend.map(|t| t.window),
                       "final_loss": summary.losses.last(),
                       "images_per_sec": images_per_sec, "wall_s": wall_secs,
                       "saved": summary.saved.as_ref().map(|p| p.display().to_string()),
                       "capture": summary.capture.as_ref().map(|c| c.to_string()),
                       "synthetic_on_device": summary.synthetic_on_device,
                       "loss_read_late": summary.loss_read_late,
                       "precision": summary.precision.name(),
                       "skipped_samples": summary.skipped.count,
                       "costs_added": summary.costs_added.as_ref().map(|(n, _)| n),
                       "recoveries": summary.recoveries.iter().map(recovered_json).collect::<Vec<_>>(),
                       "rejoins": summary.rejoins.iter().map(rejoined_json).collect::<Vec<_>>(),
                       "snapshots": summary.snapshots.0, "snapshot_s": summary.snapshots.1,
                       "input_bytes_per_step": summary.input_bytes_per_step,
                       "validation": summary.validation.last().map(|e| json!({
                           "step": e.step, "top1": e.accuracy.top1, "top5": e.accuracy.top5,
                           "loss": e.accuracy.loss, "samples": e.accuracy.samples})),
                       "skipped_files": summary.skipped.first.iter().map(|(_, why)| why).collect::<Vec<_>>()})
            );
        } else {
            println!("{}", summary_line(summary));
            // Said where it is news: a GPU that replays its steps, or gave up doing so.
            match &summary.capture {
                Some(CaptureStatus::Off) | None => {}
                Some(status) => println!("step capture: {status}"),
            }
            if summary.skipped.count > 0 {
                println!(
                    "skipped {} sample(s) that could not be read ({} distinct)",
                    summary.skipped.count,
                    summary.skipped.first.len()
                );
            }
            if let Some(v) = summary.plan.as_ref().and_then(|p| p.verification.as_ref()) {
                print!("{v}");
            }
            for r in &summary.recoveries {
                println!("{r}");
            }
            for r in &summary.rejoins {
                println!("{r}");
            }
            if let (n @ 1.., seconds) = summary.snapshots {
                println!("{n} snapshot(s) of the state gathered for recovery in {seconds:.1} s");
            }
            if let Some((tiles, cache)) = &summary.costs_added {
                println!(
                    "the steps timed {tiles} tile(s), added to the cost cache {}",
                    cache.display()
                );
            }
            if let Some(path) = &summary.saved {
                println!("saved {}", path.display());
            }
        }
    }
}

/// The text summary of a run, right at any step count: no steps, one, a few, many, resumed.
pub fn summary_line(summary: &TrainSummary) -> String {
    let TrainSummary {
        model,
        steps,
        first_step,
        batch,
        wall_secs,
        ..
    } = summary;
    let taken = summary.steps_taken();
    if taken == 0 {
        return match first_step {
            0 => format!("{model}: no steps to train (--steps 0)"),
            _ => format!(
                "{model}: nothing to train: the run is already at step {first_step} of --steps \
                 {steps} (raise --steps to train on)"
            ),
        };
    }
    let which = match first_step {
        0 => format!("{taken} step(s)"),
        _ => format!(
            "{taken} step(s), {} to {steps} (resumed at step {first_step})",
            first_step + 1
        ),
    };
    let loss = match summary.loss_trend() {
        Some(t) => format!(
            "loss {:.4} -> {:.4} (means of the first and last {} step(s))",
            t.first, t.last, t.window
        ),
        // one step: nothing to compare its loss with
        None => format!("loss {:.4}", summary.losses[taken - 1]),
    };
    let throughput = summary
        .images_per_sec
        .map_or(String::new(), |ips| format!(", {ips:.1} img/s"));
    format!("trained {model} for {which} at batch {batch}: {loss}{throughput}, {wall_secs:.1} s")
}

/// `2`, `1, 3`, `4-7`: device lists as people write them.
fn describe_list(devices: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < devices.len() {
        let mut j = i;
        while j + 1 < devices.len() && devices[j + 1] == devices[j] + 1 {
            j += 1;
        }
        parts.push(match j - i {
            0 => devices[i].to_string(),
            _ => format!("{}-{}", devices[i], devices[j]),
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// Shows a plan's progress on stderr once it has run [`PlanProgress::new`]'s delay: a bar with
/// an estimate on a terminal, otherwise a line per phase and every [`LINE_EVERY`] within one.
/// stdout is never touched, so `--json` stays clean.
pub struct PlanProgress {
    start: Instant,
    after: Duration,
    terminal: bool,
    state: Mutex<Shown>,
}

#[derive(Default)]
struct Shown {
    /// The phase shown last (as it describes itself), and its bar on a terminal.
    phase: Option<&'static str>,
    bar: Option<ProgressBar>,
    /// When the last line was written (not on a terminal).
    line_at: Option<Instant>,
}

/// How often a phase's progress line repeats when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// How long a plan runs before its progress shows; `LEGION_RS_PROGRESS_AFTER_MS` sets it.
const PROGRESS_AFTER: Duration = Duration::from_secs(2);

impl PlanProgress {
    /// Progress that starts showing after [`PROGRESS_AFTER`] (or `LEGION_RS_PROGRESS_AFTER_MS`
    /// milliseconds).
    pub fn new() -> PlanProgress {
        let after = std::env::var("LEGION_RS_PROGRESS_AFTER_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map_or(PROGRESS_AFTER, Duration::from_millis);
        PlanProgress {
            start: Instant::now(),
            after,
            terminal: std::io::stderr().is_terminal(),
            state: Mutex::new(Shown::default()),
        }
    }

    /// Clears the bar, if one is drawn; a later update starts its phase afresh.
    pub fn finish(&self) {
        let mut shown = self.state.lock().expect("progress is never poisoned");
        if let Some(bar) = shown.bar.take() {
            bar.finish_and_clear();
        }
        shown.phase = None;
    }
}

/// However a command ends (an error, `--evaluate`), no bar stays behind it.
impl Drop for PlanProgress {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Default for PlanProgress {
    fn default() -> Self {
        PlanProgress::new()
    }
}

impl Progress for PlanProgress {
    fn update(&self, phase: Phase, done: u64, total: u64) {
        self.show(phase.describe(), phase.unit(), done, total);
    }
}

/// A folder's files checked as it opens, before the run's plan: shown as a phase of its own.
impl OpenProgress for PlanProgress {
    fn checked(&self, done: usize, total: usize) {
        self.show(
            "checking the image files",
            "files",
            done as u64,
            total as u64,
        );
    }
}

impl PlanProgress {
    /// `done` of `total` `unit` of the phase that `describe` says.
    fn show(&self, describe: &'static str, unit: &'static str, done: u64, total: u64) {
        if self.start.elapsed() < self.after {
            return;
        }
        let mut shown = self.state.lock().expect("progress is never poisoned");
        let new_phase = shown.phase != Some(describe);
        shown.phase = Some(describe);
        if self.terminal {
            if new_phase {
                if let Some(old) = shown.bar.take() {
                    old.finish_and_clear();
                }
                let bar = ProgressBar::new(total);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{msg} {bar:30} {pos}/{len} {prefix}, {elapsed} (about {eta} left)",
                    )
                    .expect("valid progress template"),
                );
                bar.set_message(describe);
                bar.set_prefix(unit);
                shown.bar = Some(bar);
            }
            if let Some(bar) = &shown.bar {
                bar.set_length(total);
                bar.set_position(done);
            }
        } else if new_phase || shown.line_at.is_none_or(|at| at.elapsed() >= LINE_EVERY) {
            shown.line_at = Some(Instant::now());
            eprintln!(
                "{describe}: {done}/{total} {unit}, {:.1} s in",
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}

/// What a search priced its tiles with, as a plan and a re-plan report it.
fn costs_json(c: &legion::costs::CostReport) -> serde_json::Value {
    json!({
        "choice": c.choice,
        "new_tiles": c.measuring.as_ref().map(|m| m.new_tiles),
        "measuring_s": c.measuring.as_ref().map(|m| m.seconds),
        "strategies_run": c.measuring.as_ref().map(|m| m.strategies_run),
        "cache": c.measuring.as_ref().map(|m| m.cache.display().to_string()),
        "workers": c.workers.iter().map(|(name, m)| json!({
            "name": name, "new_tiles": m.new_tiles, "measuring_s": m.seconds,
            "strategies_run": m.strategies_run,
            "cache": m.cache.display().to_string()})).collect::<Vec<_>>(),
        "priced": c.priced.map(|(measured, scaled, roofline)| json!({
            "measured": measured, "scaled": scaled, "roofline": roofline})),
        "roofline_because": c.roofline_because,
    })
}

fn recovered_json(r: &legion::Recovered) -> serde_json::Value {
    json!({"lost": r.lost, "from_step": r.from_step, "steps_lost": r.steps_lost,
           "devices": r.devices, "strategy": r.strategy,
           "costs": r.costs.as_ref().map(costs_json), "seconds": r.seconds,
           "search_s": r.search_s, "restore_s": r.restore_s,
           "count": r.count, "max": r.max})
}

fn rejoined_json(r: &legion::Rejoined) -> serde_json::Value {
    json!({"workers": r.workers, "step": r.step, "devices": r.devices,
           "strategy": r.strategy, "costs": r.costs.as_ref().map(costs_json),
           "seconds": r.seconds})
}
