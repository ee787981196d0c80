//! Measured verification: the search's strategy and its strongest alternatives each train a few
//! steps on the devices, and the run trains on with the one measured fastest. The trial steps
//! are training steps: between two candidates the state (weights, buffers, momentum, step) is
//! gathered from the devices and handed to the next strategy's ([`Job::run`]'s re-sharding), so
//! the run trains the network one device trains whichever it keeps.
//!
//! What to try and when to switch is decided here, with no engine in sight ([`Trials`]).

use legion_planner::search::{self, SearchKind};
use legion_planner::simulate::simulated_step_time;
use legion_planner::{CostTables, ParallelConfig};
use std::fmt;

/// Steps each candidate trains: the first warms its devices up (its allocations, the caches) and
/// is not timed; its time is the fastest of the others.
pub const TRIAL_STEPS: u64 = 3;

/// Alternatives tried beside the search's own strategy when a run does not say.
pub const DEFAULT_ALTERNATIVES: usize = 3;

/// A strategy a run may train with.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The search that found it.
    pub label: String,
    pub configs: Vec<ParallelConfig>,
    pub simulated_s: f64,
}

/// The search's strategy first, then up to `alternatives` others (none at all without any): data parallelism and OWT,
/// then the other searches' strategies in the order of their simulated steps, each distinct
/// from those before it.
pub fn candidates(
    tables: &CostTables,
    chosen: (SearchKind, &[ParallelConfig]),
    alternatives: usize,
) -> Vec<Candidate> {
    if alternatives == 0 {
        return Vec::new();
    }
    let model = tables.model();
    let candidate = |kind: SearchKind, configs: Vec<ParallelConfig>| Candidate {
        label: kind.name().to_string(),
        simulated_s: simulated_step_time(model, &configs),
        configs,
    };
    let mut out = vec![candidate(chosen.0, chosen.1.to_vec())];
    let found = |kind| {
        search::find(kind, tables, search::DEFAULT_BUDGET)
            .ok()
            .map(|f| candidate(kind, f.configs))
    };
    let fixed = [SearchKind::Data, SearchKind::Owt];
    let mut others: Vec<Candidate> = SearchKind::every()
        .filter(|&k| k != chosen.0 && !fixed.contains(&k))
        // the exhaustive search finishes only on small graphs, refine's simulations take long
        .filter(|&k| !matches!(k, SearchKind::Exhaustive | SearchKind::Refine))
        .filter_map(found)
        .collect();
    others.sort_by(|a, b| a.simulated_s.total_cmp(&b.simulated_s));
    for c in fixed.into_iter().filter_map(found).chain(others) {
        if out.len() > alternatives {
            break;
        }
        if out.iter().all(|o| o.configs != c.configs) {
            out.push(c);
        }
    }
    out
}

/// Whether a run of `steps` steps has room for `candidates` trials and as many steps again on
/// the strategy it keeps.
pub fn fits(candidates: usize, steps: u64) -> bool {
    candidates > 1 && steps >= (candidates as u64 + 1) * TRIAL_STEPS
}

/// The trials of a run: which candidate trains now, and the times each measured.
#[derive(Clone, Debug)]
pub struct Trials {
    candidates: Vec<Candidate>,
    current: usize,
    /// Steps the current candidate has trained.
    done: u64,
    /// The fastest timed step of each candidate so far.
    fastest: Vec<Option<f64>>,
}

/// What the run does after a step of a trial.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Go on with the same strategy.
    Stay,
    /// Re-shard onto candidate `i` and go on (a trial, or the one kept).
    SwitchTo(usize),
    /// Every candidate was tried and the fastest is the one training now.
    Done,
}

impl Trials {
    pub fn new(candidates: Vec<Candidate>) -> Trials {
        let n = candidates.len();
        Trials {
            candidates,
            current: 0,
            done: 0,
            fastest: vec![None; n],
        }
    }

    pub fn candidate(&self, i: usize) -> &Candidate {
        &self.candidates[i]
    }

    /// Whether trials are still running.
    pub fn running(&self) -> bool {
        self.current < self.candidates.len()
    }

    /// Records a step of `seconds` by the current candidate, and says what comes next.
    pub fn stepped(&mut self, seconds: f64) -> Next {
        if !self.running() {
            return Next::Stay;
        }
        self.done += 1;
        if self.done > 1 {
            let best = &mut self.fastest[self.current];
            *best = Some(best.map_or(seconds, |b: f64| b.min(seconds)));
        }
        if self.done < TRIAL_STEPS {
            return Next::Stay;
        }
        self.done = 0;
        if self.current + 1 < self.candidates.len() {
            self.current += 1;
            return Next::SwitchTo(self.current);
        }
        let kept = self.kept().expect("every candidate timed");
        self.current = self.candidates.len();
        match kept == self.candidates.len() - 1 {
            true => Next::Done,
            false => Next::SwitchTo(kept),
        }
    }

    /// The candidate measured fastest, once each is timed.
    pub fn kept(&self) -> Option<usize> {
        let times: Option<Vec<f64>> = self.fastest.iter().copied().collect();
        let times = times?;
        (0..times.len()).min_by(|&a, &b| times[a].total_cmp(&times[b]))
    }

    /// What the trials found, once each candidate is timed.
    pub fn verification(&self) -> Option<Verification> {
        let kept = self.kept()?;
        Some(Verification {
            candidates: self
                .candidates
                .iter()
                .zip(&self.fastest)
                .map(|(c, t)| Tried {
                    label: c.label.clone(),
                    simulated_ms: c.simulated_s * 1e3,
                    measured_ms: t.unwrap_or(f64::NAN) * 1e3,
                })
                .collect(),
            kept,
        })
    }
}

/// Each candidate's simulated and measured step, and the one the run kept.
#[derive(Clone, Debug, PartialEq)]
pub struct Verification {
    pub candidates: Vec<Tried>,
    /// Its index in `candidates`.
    pub kept: usize,
}

/// One candidate's trial.
#[derive(Clone, Debug, PartialEq)]
pub struct Tried {
    pub label: String,
    pub simulated_ms: f64,
    /// Its fastest timed trial step.
    pub measured_ms: f64,
}

impl fmt::Display for Verification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "verified on the devices ({TRIAL_STEPS} training steps each, the first untimed):"
        )?;
        for (i, c) in self.candidates.iter().enumerate() {
            writeln!(
                f,
                "  {:<8} simulated {:>9.1} ms  measured {:>9.1} ms{}",
                c.label,
                c.simulated_ms,
                c.measured_ms,
                if i == self.kept { "  kept" } else { "" }
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Vec<Candidate> {
        ["optcnn", "data", "owt"]
            .iter()
            .enumerate()
            .map(|(i, l)| Candidate {
                label: l.to_string(),
                configs: vec![ParallelConfig::serial(i)],
                simulated_s: 0.1 * (i + 1) as f64,
            })
            .collect()
    }

    #[test]
    fn each_candidate_trains_its_trial_then_the_fastest_is_kept() {
        let mut trials = Trials::new(three());
        // optcnn: warm-up, 0.30, 0.25
        assert_eq!(trials.stepped(9.0), Next::Stay);
        assert_eq!(trials.stepped(0.30), Next::Stay);
        assert_eq!(trials.stepped(0.25), Next::SwitchTo(1));
        // data: its first step is not timed however slow
        assert_eq!(trials.stepped(5.0), Next::Stay);
        assert_eq!(trials.stepped(0.20), Next::Stay);
        assert_eq!(trials.stepped(0.22), Next::SwitchTo(2));
        // owt: slowest; data kept
        trials.stepped(0.1);
        trials.stepped(0.40);
        assert_eq!(trials.stepped(0.41), Next::SwitchTo(1));
        assert!(!trials.running());
        assert_eq!(trials.stepped(0.1), Next::Stay, "trials are over");
        let v = trials.verification().unwrap();
        assert_eq!(v.kept, 1);
        assert_eq!(v.candidates[1].measured_ms, 200.0);
        assert!((v.candidates[0].measured_ms - 250.0).abs() < 1e-9);
        let text = v.to_string();
        assert!(text.contains("data     simulated     200.0 ms  measured     200.0 ms  kept"));
    }

    #[test]
    fn the_last_candidate_kept_needs_no_switch() {
        let mut trials = Trials::new(three());
        for t in [1.0, 0.5, 0.5, 1.0, 0.4, 0.4, 1.0, 0.3] {
            assert!(matches!(trials.stepped(t), Next::Stay | Next::SwitchTo(_)));
        }
        assert_eq!(trials.stepped(0.3), Next::Done);
        assert_eq!(trials.kept(), Some(2));
    }

    #[test]
    fn a_run_too_short_for_its_trials_does_not_verify() {
        assert!(!fits(1, 1000), "one candidate has nothing to compare");
        assert!(!fits(4, 14));
        assert!(fits(4, 15));
    }
}
