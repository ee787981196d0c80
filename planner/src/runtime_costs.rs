//! What the runtime's own work costs besides kernels and transfers ([`RuntimeCosts`]): the
//! profiler measures it on the embedded cluster (`legion_runtime::profile`), a machine carries it
//! ([`crate::machine::MachineModel::with_runtime_costs`]) and the simulator prices its dispatch,
//! fold and update tasks with it. [`fold_bytes`] and [`update_bytes`] are the byte counts both
//! sides measure throughput in, so they count alike.

use crate::machine::MAX_THREADS;
use serde::{Deserialize, Serialize};

/// What the runtime's device actors cost besides kernels and transfers, as the profiler measured
/// them on the embedded cluster (`legion_runtime::profile`). The simulator prices its dispatch,
/// fold and update tasks with these; without them (a machine nobody profiled) dispatch is free and
/// folds and updates stream at the device's memory bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeCosts {
    /// Seconds from a compute op being able to start on its device (its dependences done, the
    /// device's previous compute op finished, a core free of other kernels and copies, and an
    /// actor thread free) to its kernel starting, its actor's own copies left out: the actor's
    /// message handling, the hand-off to the device's pool and waking its thread (the profiler's
    /// mean). Paid once per compute op (kernel, fold, update); on a machine whose devices share
    /// their cores, only by one that becomes startable with a core idle.
    pub dispatch_s: f64,
    /// CPU seconds the runtime spends per compute op besides the kernels and copies it times: the
    /// actors' message handling, handing ops to the pools, waking and parking their threads (the
    /// profiler's CPU time of the actors' threads less their copies' own seconds, and of workers
    /// the devices share beyond their ops' own seconds, per compute op; see
    /// `legion_runtime::profile`). On a machine whose devices share their cores it is the end
    /// of the op's dispatch and holds a core: with the cores busy, each op's kernel waits for it
    /// after a core frees, and for nothing else. 0 in profiles from before it was measured.
    #[serde(default)]
    pub runtime_cpu_s: f64,
    /// How those delays spread: the mean of each sixteenth of them, in ascending order (their mean
    /// is `dispatch_s`). When present, the simulator draws each op's delay from them and reports
    /// the expected step time over many draws: a step of many small ops waits on the slowest of
    /// its parallel paths, so varying delays cost more than their mean paid by every op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_bins_s: Option<[f64; DISPATCH_BINS]>,
    /// Throughput of folds (sums of gradient terms), in bytes of [`fold_bytes`] per second.
    pub fold_bytes_per_s: f64,
    /// Throughput of SGD updates, in bytes of [`update_bytes`] per second.
    pub update_bytes_per_s: f64,
    /// Throughput of the copies a device's actor makes itself (gathering a piece of an instance to
    /// send, storing a received piece into a larger instance, local copies), bytes per second.
    /// The actor does nothing else meanwhile: its device's next kernel waits.
    pub copy_bytes_per_s: f64,
    /// Threads the device actors share (the embedded cluster runs its N actors on a small tokio
    /// pool): at most this many actors copy at once, and an actor needs one to dispatch.
    pub actor_threads: usize,
}

/// The bytes a fold of `terms` terms over a rect of `rect_bytes` streams: every term read once and
/// the result written once. The profiler measures fold throughput in these bytes and the simulator
/// prices folds with them, so both count alike.
pub fn fold_bytes(terms: usize, rect_bytes: u64) -> u64 {
    (terms as u64 + 1) * rect_bytes
}

/// The bytes an SGD update of a slice of `slice_bytes` streams: gradient, weights and momentum
/// read, weights and momentum written.
pub fn update_bytes(slice_bytes: u64) -> u64 {
    5 * slice_bytes
}

/// Equal-probability bins of [`RuntimeCosts::dispatch_bins_s`].
pub const DISPATCH_BINS: usize = 16;

impl RuntimeCosts {
    /// The bin means of `delays` ([`RuntimeCosts::dispatch_bins_s`]); `None` with fewer delays than
    /// bins. Each bin holds an equal share of the sorted delays, to within one.
    pub fn dispatch_bins(delays: &[f64]) -> Option<[f64; DISPATCH_BINS]> {
        if delays.len() < DISPATCH_BINS {
            return None;
        }
        let mut sorted = delays.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(std::array::from_fn(|b| {
            let bin =
                &sorted[b * sorted.len() / DISPATCH_BINS..(b + 1) * sorted.len() / DISPATCH_BINS];
            bin.iter().sum::<f64>() / bin.len() as f64
        }))
    }

    /// Every time zero or positive, every throughput positive (all finite).
    pub fn validate(&self) -> Result<(), String> {
        for (field, v) in [
            ("dispatch_s", self.dispatch_s),
            ("runtime_cpu_s", self.runtime_cpu_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field} must be zero or positive, got {v}"));
            }
        }
        if let Some(bins) = &self.dispatch_bins_s
            && let Some(bad) = bins.iter().find(|b| !(b.is_finite() && **b >= 0.0))
        {
            return Err(format!(
                "dispatch_bins_s must be zero or positive, got {bad}"
            ));
        }
        for (field, v) in [
            ("fold_bytes_per_s", self.fold_bytes_per_s),
            ("update_bytes_per_s", self.update_bytes_per_s),
            ("copy_bytes_per_s", self.copy_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{field} must be a positive number, got {v}"));
            }
        }
        if !(1..=MAX_THREADS).contains(&self.actor_threads) {
            return Err(format!(
                "actor_threads must be in 1..={MAX_THREADS}, got {}",
                self.actor_threads
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::MachineModel;

    #[test]
    fn runtime_costs_are_validated() {
        let m = MachineModel::preset("local-cpu:4").unwrap();
        assert_eq!(m.runtime_costs(), None);
        let costs = RuntimeCosts {
            dispatch_s: 50e-6,
            runtime_cpu_s: 0.0,
            fold_bytes_per_s: 4e9,
            update_bytes_per_s: 2e9,
            copy_bytes_per_s: 5e9,
            dispatch_bins_s: None,
            actor_threads: 2,
        };
        let m = m.with_runtime_costs(costs).unwrap();
        assert_eq!(m.runtime_costs(), Some(&costs));
        assert!(m.to_string().contains("dispatch 50.0 us"), "{m}");
        let e = m
            .clone()
            .with_runtime_costs(RuntimeCosts {
                fold_bytes_per_s: 0.0,
                ..costs
            })
            .unwrap_err();
        assert!(e.to_string().contains("fold_bytes_per_s must be"), "{e}");
        assert!(
            m.clone()
                .with_runtime_costs(RuntimeCosts {
                    dispatch_s: -1.0,
                    ..costs
                })
                .is_err()
        );
        let e = m
            .with_runtime_costs(RuntimeCosts {
                dispatch_bins_s: Some([f64::NAN; DISPATCH_BINS]),
                ..costs
            })
            .unwrap_err();
        assert!(e.to_string().contains("dispatch_bins_s must be"), "{e}");
        assert_eq!(fold_bytes(3, 100), 400);
        assert_eq!(update_bytes(100), 500);
    }

    #[test]
    fn dispatch_bins_are_means_of_equal_shares_of_the_sorted_delays() {
        assert_eq!(RuntimeCosts::dispatch_bins(&[1.0; DISPATCH_BINS - 1]), None);
        // 0..32 shuffled: each bin holds two neighbours
        let delays: Vec<f64> = (0..32).map(|i| ((i * 7) % 32) as f64).collect();
        let bins = RuntimeCosts::dispatch_bins(&delays).unwrap();
        assert_eq!(bins, std::array::from_fn(|b| 2.0 * b as f64 + 0.5));
        // uneven shares: bins of two or three, in order
        let delays: Vec<f64> = (0..37).map(|i| (i * i) as f64).collect();
        let bins = RuntimeCosts::dispatch_bins(&delays).unwrap();
        assert!(bins.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(
            bins[DISPATCH_BINS - 1],
            (34.0 * 34.0 + 35.0 * 35.0 + 36.0 * 36.0) / 3.0
        );
    }
}
