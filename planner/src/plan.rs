//! What `legion-rs plan` computes: searches run on shared cost tables, each strategy priced with
//! Eq. 1 and simulated. Wall-clock times of the searches are measured here; everything else is pure.

use crate::config::ParallelConfig;
use crate::cost::{CostBreakdown, CostModel};
use crate::search::{self, RefineReport, SearchError, SearchKind, SearchOptions};
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
    /// The device that keeps the most during a step ([`crate::memory::per_device`]) and how much.
    pub peak_device: (usize, u64),
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
    /// Whether OptCNN's strategy is proven optimal, or how far from optimal it may be.
    pub optimality: Option<search::Optimality>,
    /// The seed planners' own byte counts (their papers' objectives), to show beside Eq. 1.
    pub native: Option<NativeBytes>,
    /// What mapping a seed planner's plan into our configuration space lost.
    pub lossy: Option<&'static str>,
    /// Where the refinement started, how far it got and what it spent (refine only).
    pub refined: Option<RefineReport>,
}

/// Bytes a seed planner's plan moves under its own paper's accounting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NativeBytes {
    /// The plan as the planner found it (reduction splits included).
    pub found: f64,
    /// The strategy it returns, mapped into our space.
    pub mapped: f64,
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
    /// The cheapest successful search under Eq. 1 (the earliest of equals). Without a memory
    /// limit a refinement is never cheaper under Eq. 1 than optcnn (optimal there), so beside it
    /// this is optcnn's strategy, not the fastest in simulation; under a limit optcnn's search is
    /// a heuristic and another search may be cheaper.
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

/// Runs `kinds` on `model` within `options`, reported in that order. A refinement runs after the
/// others and starts from their strategies too (its time then leaves theirs out).
pub fn plan(model: &CostModel, kinds: &[SearchKind], options: &SearchOptions) -> PlanRun {
    let t0 = Instant::now();
    let tables = CostTables::build_in(model, options.space);
    let tables_seconds = t0.elapsed().as_secs_f64();
    let mut order: Vec<usize> = (0..kinds.len()).collect();
    order.sort_by_key(|&i| kinds[i] == SearchKind::Refine);
    let mut searches: Vec<SearchRun> = Vec::with_capacity(kinds.len());
    for &kind in order.iter().map(|&i| &kinds[i]) {
        let earlier: Vec<(SearchKind, &[ParallelConfig])> = searches
            .iter()
            .filter_map(|s| Some((s.kind, s.result.as_ref().ok()?.configs.as_slice())))
            .collect();
        let t = Instant::now();
        let found = search::find_with(kind, &tables, options, &earlier);
        let seconds = t.elapsed().as_secs_f64();
        let residual_nodes = found.as_ref().ok().and_then(|f| f.residual_nodes);
        let optimality = found.as_ref().ok().and_then(|f| f.optimality.clone());
        let refined = found.as_ref().ok().and_then(|f| f.refined);
        let native = found.as_ref().ok().and_then(|f| {
            let mapped = search::native_bytes(kind, model.graph(), model.machine(), &f.configs)?;
            Some(NativeBytes {
                found: f.native_bytes?,
                mapped,
            })
        });
        searches.push(SearchRun {
            kind,
            result: found.map(|f| evaluate(model, f.configs)),
            seconds,
            residual_nodes,
            optimality,
            native,
            lossy: kind.lossy(),
            refined,
        });
    }
    // back to the order asked for
    let mut asked: Vec<(usize, SearchRun)> = order.into_iter().zip(searches).collect();
    asked.sort_by_key(|(i, _)| *i);
    let searches = asked.into_iter().map(|(_, run)| run).collect();
    PlanRun {
        model: model.graph().name.clone(),
        devices: model.machine().num_devices(),
        tables_seconds,
        searches,
    }
}

/// Prices and simulates a given strategy.
pub fn evaluate(model: &CostModel, configs: Vec<ParallelConfig>) -> Evaluated {
    let machine = model.machine();
    let peak = crate::memory::per_device_at(
        model.graph(),
        &configs,
        machine.nodes(),
        machine.precision(),
    )
    .into_iter()
    .max_by_key(|d| (d.bytes, std::cmp::Reverse(d.device)))
    .map_or((0, 0), |d| (d.device, d.bytes));
    Evaluated {
        cost: model.evaluate(&configs),
        simulated_s: simulated_step_time(model, &configs),
        peak_device: peak,
        configs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::machine::MachineModel;
    use crate::provider::RooflineCost;

    /// Beside optcnn, refine is never slower in simulation, reports where it started, and the
    /// plan's best stays the Eq. 1 optimum.
    #[test]
    fn refine_beside_optcnn_is_never_slower_and_the_best_stays_the_eq1_optimum() {
        let z = legion_ops::zoo::find("alexnet").unwrap();
        let g = z.build(&z.default_config(64)).unwrap();
        let machine = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let options = SearchOptions {
            exhaustive_budget: 0,
            refine: search::RefineOptions {
                budget: 40,
                seed: 3,
                work: None,
            },
            space: Default::default(),
        };
        let run = plan(&model, &[SearchKind::OptCnn, SearchKind::Refine], &options);
        let result = |i: usize| run.searches[i].result.as_ref().unwrap();
        assert!(result(1).simulated_s <= result(0).simulated_s);
        assert!(result(1).cost.total >= result(0).cost.total * (1.0 - 1e-12));
        let refined = run.searches[1].refined.expect("refine reports");
        assert_eq!(refined.refined_s, result(1).simulated_s);
        assert_eq!((refined.budget, refined.seed), (40, 3));
        assert!(run.searches[0].refined.is_none());
        assert_eq!(run.best_index(), Some(0));
    }

    #[test]
    fn seed_planners_report_their_own_bytes_and_what_the_mapping_lost() {
        let z = legion_ops::zoo::find("lenet5").unwrap();
        let g = z.build(&z.default_config(64)).unwrap();
        let machine = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let kinds = [SearchKind::Data, SearchKind::Tofu, SearchKind::Spartan];
        let run = plan(&model, &kinds, &SearchOptions::with_budget(0));
        assert!(run.searches[0].native.is_none() && run.searches[0].lossy.is_none());
        for s in &run.searches[1..] {
            let native = s.native.expect("a seed planner counts its bytes");
            assert!(native.found >= 0.0 && native.mapped >= 0.0, "{}", s.kind);
            assert!(
                s.lossy.is_some_and(|l| l.contains("reduction")),
                "{}",
                s.kind
            );
        }
    }
}
