//! What `legion-rs plan` computes: searches run on shared cost tables, each strategy priced with
//! Eq. 1 and simulated. Wall-clock times of the searches are measured here; everything else is pure.

use crate::config::ParallelConfig;
use crate::cost::{CostBreakdown, CostModel};
use crate::search::{self, SearchError, SearchKind};
use crate::simulate::simulated_step_time;
use crate::tables::CostTables;
use std::time::Instant;

/// A strategy with its Eq. 1 terms and its simulated step time.
#[derive(Clone, Debug)]
pub struct Evaluated {
    /// By layer id.
    pub configs: Vec<ParallelConfig>,
    pub cost: CostBreakdown,
    /// Seconds per iteration, as [`crate::simulate::simulate`] schedules it (whose named tasks a
    /// trace reads; the plan keeps only the time, which on a thousand devices is tens of millions
    /// of tasks less).
    pub simulated_s: f64,
}

/// One search's result.
#[derive(Clone, Debug)]
pub struct SearchRun {
    pub kind: SearchKind,
    pub result: Result<Evaluated, SearchError>,
    /// Wall-clock seconds of the search itself (edge tables included, node tables excluded).
    pub seconds: f64,
    /// Layers left after Algorithm 1's eliminations (OptCNN only).
    pub residual_nodes: Option<usize>,
}

/// Every requested search of one model on one machine.
#[derive(Clone, Debug)]
pub struct PlanRun {
    pub model: String,
    pub devices: usize,
    /// Wall-clock seconds to enumerate configs and price t_c and t_s for every layer.
    pub tables_seconds: f64,
    pub searches: Vec<SearchRun>,
}

impl PlanRun {
    /// The cheapest successful search under Eq. 1.
    pub fn best(&self) -> Option<&SearchRun> {
        self.best_index().map(|i| &self.searches[i])
    }

    /// The position of [`PlanRun::best`] in `searches`.
    pub fn best_index(&self) -> Option<usize> {
        (0..self.searches.len())
            .filter(|&i| self.searches[i].result.is_ok())
            .min_by(|&a, &b| eq1(&self.searches[a]).total_cmp(&eq1(&self.searches[b])))
    }
}

fn eq1(s: &SearchRun) -> f64 {
    s.result.as_ref().map_or(f64::INFINITY, |e| e.cost.total)
}

/// Runs `kinds` (in that order) on `model`; `budget` caps the exhaustive search.
pub fn plan(model: &CostModel, kinds: &[SearchKind], budget: u64) -> PlanRun {
    let t0 = Instant::now();
    let tables = CostTables::build(model);
    let tables_seconds = t0.elapsed().as_secs_f64();
    let searches = kinds
        .iter()
        .map(|&kind| {
            let t = Instant::now();
            let found = search::find(kind, &tables, budget);
            let seconds = t.elapsed().as_secs_f64();
            let residual_nodes = found.as_ref().ok().and_then(|f| f.residual_nodes);
            SearchRun {
                kind,
                result: found.map(|f| evaluate(model, f.configs)),
                seconds,
                residual_nodes,
            }
        })
        .collect();
    PlanRun {
        model: model.graph().name.clone(),
        devices: model.machine().num_devices(),
        tables_seconds,
        searches,
    }
}

/// Prices and simulates a given strategy.
pub fn evaluate(model: &CostModel, configs: Vec<ParallelConfig>) -> Evaluated {
    Evaluated {
        cost: model.evaluate(&configs),
        simulated_s: simulated_step_time(model, &configs),
        configs,
    }
}
