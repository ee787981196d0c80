//! What a running job reports, and what a finished one returns.

use legion_ops::Precision;
use legion_ops::capture::CaptureStatus;
use legion_ops::data::SkippedSamples;
use legion_ops::infer::Accuracy;
use legion_planner::Strategy as StrategyFile;
use std::path::PathBuf;

use super::Strategy;

/// What a running job reports, in order: its plan (distributed runs only), each step, the end.
#[derive(Clone, Copy, Debug)]
pub enum JobEvent<'a> {
    /// Which device trains, and why (one line), before anything else.
    Device(&'a str),
    /// Something the user should know about the run's inputs (one line), after the device: the
    /// tensors of an `--init` file that were not loaded.
    Note(&'a str),
    /// Something that went wrong without stopping the run (one line): a sample that could not
    /// be read, skipped.
    Warning(&'a str),
    /// The strategy the devices run, before the first step.
    Planned(&'a PlannedRun),
    /// A step finished.
    Step(&'a StepDone),
    /// The held-out data was scored after a step.
    Evaluated(&'a Evaluation),
    /// A worker was lost and the run goes on, re-planned on the devices left, from its snapshot.
    Recovered(&'a Recovered),
    /// Workers came back (or were added to the hosts file): the run re-planned over them too.
    Rejoined(&'a Rejoined),
    /// The run finished and its final checkpoint (if any) is saved.
    Finished(&'a TrainSummary),
}

/// A distributed run's plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRun {
    /// What was asked for: a search or a strategy file.
    pub choice: Strategy,
    pub devices: usize,
    /// Where the devices are: `embedded device(s)`, `3 worker(s) of hosts.toml`.
    pub place: String,
    /// Bytes moved between devices per step.
    pub remote_bytes: u64,
    /// The configs the devices run.
    pub strategy: StrategyFile,
    /// The devices no layer of the strategy uses: they stay idle.
    pub idle_devices: Vec<usize>,
    /// What the search priced tiles with, where a search chose the strategy.
    pub costs: Option<crate::costs::CostReport>,
    /// The candidates the run trained a few steps each, and the one it kept (then `strategy`
    /// and `remote_bytes` are the kept one's).
    pub verification: Option<super::Verification>,
}

/// A lost worker the run recovered from: re-planned on the devices left and restarted from its
/// latest snapshot, whose later steps it trains again.
#[derive(Clone, Debug, PartialEq)]
pub struct Recovered {
    /// What happened: `worker w1 (127.0.0.1:7612) stopped responding: ...`.
    pub lost: String,
    /// The step the snapshot holds: training goes on from the step after it.
    pub from_step: u64,
    /// Steps done after the snapshot, trained again.
    pub steps_lost: u64,
    /// The devices left, and the strategy planned for them.
    pub devices: usize,
    pub strategy: String,
    /// What the re-plan's search priced tiles with (none for a scheme asked for by name).
    pub costs: Option<crate::costs::CostReport>,
    /// Seconds from the loss being noticed to the devices left holding the state on the new
    /// plan; of them, the search's and the restart's (the job started and the state loaded on
    /// the workers left); the rest ended the broken job.
    pub seconds: f64,
    pub search_s: f64,
    pub restore_s: f64,
    /// The lost workers the run has recovered from, this recovery's included, and the most it
    /// allows.
    pub count: u32,
    pub max: u32,
}

impl std::fmt::Display for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "recovered from a lost worker ({} of at most {}): {}; re-planned {} on the {} \
             device(s) left and restarted from the snapshot of step {} in {:.2} s (search \
             {:.2} s, restoring the state {:.2} s)",
            self.count,
            self.max,
            self.lost,
            self.strategy,
            self.devices,
            self.from_step,
            self.seconds,
            self.search_s,
            self.restore_s
        )?;
        if self.steps_lost > 0 {
            write!(f, " ({} step(s) trained again)", self.steps_lost)?;
        }
        match &self.costs {
            Some(costs) => write!(f, "; {costs}"),
            None => Ok(()),
        }
    }
}

/// Workers a cluster run took back at a snapshot, re-planning over every device it now has.
#[derive(Clone, Debug, PartialEq)]
pub struct Rejoined {
    /// `worker w1 (127.0.0.1:7612)`, each.
    pub workers: Vec<String>,
    /// The step after which they joined (nothing is trained again).
    pub step: u64,
    pub devices: usize,
    pub strategy: String,
    /// What the re-plan's search priced tiles with (none for a scheme asked for by name).
    pub costs: Option<crate::costs::CostReport>,
    /// Seconds from the snapshot to the devices holding the state on the new plan.
    pub seconds: f64,
}

impl std::fmt::Display for Rejoined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} back after step {}: re-planned {} on {} device(s) in {:.2} s",
            self.workers.join(", "),
            self.step,
            self.strategy,
            self.devices,
            self.seconds
        )?;
        match &self.costs {
            Some(costs) => write!(f, "; {costs}"),
            None => Ok(()),
        }
    }
}

/// One finished step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDone {
    /// Counted from 1.
    pub step: u64,
    /// Of `total_steps`, the run's last step.
    pub total_steps: u64,
    /// The pass over the data the step's batch is of, counted from 1; of `epochs` where the run
    /// was asked for a number of them.
    pub epoch: u64,
    pub epochs: Option<u64>,
    /// Steps a pass over the data takes.
    pub steps_per_epoch: u64,
    pub loss: f32,
    pub accuracy: f64,
    pub seconds: f64,
    pub images_per_sec: f64,
    /// The one-device trainer's split of the step on its thread.
    pub host: Option<legion_ops::train::HostTiming>,
}

/// The held-out data's score after a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub step: u64,
    pub accuracy: Accuracy,
    pub seconds: f64,
}

/// What a finished run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    pub model: String,
    pub devices: usize,
    /// Where there were several devices.
    pub plan: Option<PlannedRun>,
    /// The step the run ended at, counted from the start (a resumed run's earlier steps too).
    pub steps: u64,
    /// Whether the run stopped before its last step, as its stop signal asked.
    pub stopped: bool,
    /// The step this run started from: 0, or the step of the checkpoint it resumed.
    pub first_step: u64,
    pub batch: usize,
    /// One per step this run took.
    pub losses: Vec<f32>,
    /// Over the steps this run took (the time scoring and saving between them left out); `None`
    /// when it took none.
    pub images_per_sec: Option<f64>,
    pub wall_secs: f64,
    pub saved: Option<PathBuf>,
    /// Whether the one-device trainer recorded and replayed its steps (`None` elsewhere).
    pub capture: Option<CaptureStatus>,
    /// Whether the batches were synthetic data that the GPU drew itself from their description.
    pub synthetic_on_device: bool,
    /// Whether each step's loss was read one step late, while the next step ran (the one-device
    /// trainer unless `--sync-every-step`), rather than at the step's end.
    pub loss_read_late: bool,
    /// What the run computed in.
    pub precision: Precision,
    /// The samples skipped because they could not be read.
    pub skipped: SkippedSamples,
    /// Each scoring of the held-out data, in order (the last after the last step).
    pub validation: Vec<Evaluation>,
    /// The tiles whose costs the run's own steps timed, and the cost cache they were added to.
    pub costs_added: Option<(usize, PathBuf)>,
    /// The lost workers the run recovered from, in order.
    pub recoveries: Vec<Recovered>,
    /// The workers it took back, in order.
    pub rejoins: Vec<Rejoined>,
    /// The snapshots of the state it gathered for recovery, and the seconds that took in all.
    pub snapshots: (usize, f64),
    /// Bytes a step's samples took to the cluster's workers, on average (`None` where no
    /// samples went to other processes).
    pub input_bytes_per_step: Option<f64>,
}

/// How the loss moved over a run: the means of its first and its last `window` losses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossTrend {
    pub first: f64,
    pub last: f64,
    /// At most 10, and at most half the steps taken, so that the two windows never share a step.
    pub window: usize,
}

impl TrainSummary {
    /// The steps this run took (a resumed run's earlier steps not counted).
    pub fn steps_taken(&self) -> usize {
        self.losses.len()
    }

    /// The loss trend over the steps this run took; `None` with fewer than two, where there is
    /// nothing to compare.
    pub fn loss_trend(&self) -> Option<LossTrend> {
        let losses = &self.losses;
        let window = (losses.len() / 2).min(10);
        if window == 0 {
            return None;
        }
        let mean = |xs: &[f32]| xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
        Some(LossTrend {
            first: mean(&losses[..window]),
            last: mean(&losses[losses.len() - window..]),
            window,
        })
    }
}
