//! What a training run shows the user: the [`JobEvent`]s of a [`Job`](crate::job::Job) as text
//! lines, as a progress bar on a terminal, or as one JSON object per line.

use crate::job::{JobEvent, PlannedRun, StepDone, TrainSummary};
use indicatif::{ProgressBar, ProgressStyle};
use legion_cluster::memory::human_bytes;
use serde_json::json;
use std::io::IsTerminal;

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
            // JSON output is one object per step and a summary: the device line is for people.
            JobEvent::Device(line) if !self.json => println!("{line}"),
            JobEvent::Device(_) => {}
            JobEvent::Planned(plan) => self.planned(plan),
            JobEvent::Step(step) => self.step(step),
            JobEvent::Finished(summary) => self.finished(summary),
        }
    }

    fn planned(&self, plan: &PlannedRun) {
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
        }
    }

    fn step(&mut self, s: &StepDone) {
        if self.json {
            let mut line = json!({"step": s.step, "loss": s.loss, "accuracy": s.accuracy,
                                  "step_ms": s.seconds * 1e3, "images_per_sec": s.images_per_sec});
            if let Some(host) = s.host {
                line["enqueue_ms"] = json!(host.enqueue * 1e3);
                line["stage_ms"] = json!(host.stage * 1e3);
                line["wait_ms"] = json!(host.wait * 1e3);
            }
            println!("{line}");
            return;
        }
        if self.progress.is_none() && std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(s.total_steps);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
                    .expect("valid progress template"),
            );
            self.progress = Some(bar);
        }
        match &self.progress {
            Some(bar) => {
                bar.set_position(s.step);
                bar.set_message(format!("loss {:.4}  {:.1} img/s", s.loss, s.images_per_sec));
            }
            None => println!(
                "step {:>5}  loss {:.4}  acc {:.3}  {:.1} img/s",
                s.step, s.loss, s.accuracy, s.images_per_sec
            ),
        }
    }

    fn finished(&mut self, summary: &TrainSummary) {
        if let Some(bar) = self.progress.take() {
            bar.finish();
        }
        let (first, last, window) = summary.loss_trend();
        let TrainSummary {
            model,
            steps,
            batch,
            images_per_sec,
            wall_secs,
            ..
        } = summary;
        if self.json {
            let plan = match &summary.plan {
                Some(p) => json!({
                    "strategy": p.choice,
                    "layers": p.strategy.layers,
                    "comm_bytes_per_step": p.remote_bytes,
                }),
                None => serde_json::Value::Null,
            };
            println!(
                "{}",
                json!({"summary": true, "model": model, "devices": summary.devices,
                       "plan": plan,
                       "steps": steps, "batch": batch, "first10_loss": first,
                       "last10_loss": last, "final_loss": summary.losses.last(),
                       "images_per_sec": images_per_sec, "wall_s": wall_secs,
                       "saved": summary.saved.as_ref().map(|p| p.display().to_string())})
            );
        } else {
            println!(
                "trained {model} for {steps} steps at batch {batch}: loss {first:.4} -> {last:.4} \
                 (means of the first and last {window}), {images_per_sec:.1} img/s, {wall_secs:.1} s"
            );
            if let Some(path) = &summary.saved {
                println!("saved {}", path.display());
            }
        }
    }
}
