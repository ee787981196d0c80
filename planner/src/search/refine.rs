//! A local search over per-layer configs under the simulator's step time
//! ([`simulated_step_time`]) instead of Eq. 1.
//!
//! Eq. 1 adds t_c, t_x and t_s as if nothing overlapped, but a real step (and the simulator, which
//! schedules the step's tasks on device and link timelines) runs a layer's gradient
//! synchronisation beside the backward kernels of the layers before it, transfers beside unrelated
//! kernels, and layers on disjoint devices at the same time. So the Eq. 1 optimum
//! ([`super::optcnn`], which stays exactly the paper's Algorithm 1) can be slower in simulation
//! than a baseline, and a strategy Eq. 1 ranks worse can be faster. This search starts from the
//! Eq. 1 optimum, from each baseline and from each other paper's planner ([`REFINE_STARTS`]), and
//! from any other strategy the same `plan` found before it; it keeps the fastest in simulation as
//! the incumbent, and improves it by moves that each cost one simulation:
//!
//! - a **layer move** sets one layer to another config of its space;
//! - a **run move** sets a layer's run (the layers connected to it that share its config) to that
//!   config together, so a chain can change layout without paying transfers at every layer
//!   boundary on the way, as a lone layer unlike its neighbours does on both sides.
//!
//! The candidate configs of a layer are its producers' and consumers' configs (moving a boundary
//! between two runs), then the few cheapest by the layer's local Eq. 1 terms given its neighbours'
//! configs (t_c + t_s + t_x of its edges), and the few cheapest with t_s left out (as if its
//! synchronisation were hidden under other work, as the simulator may find it). Eq. 1 only ranks
//! the candidates; the simulated time decides, and a move is accepted only when it is faster by
//! at least a part per million. Layers are visited in a seeded shuffled order, pass after pass,
//! until a pass improves nothing; then, while budget remains, the best strategy is kicked (a few
//! layers set to random configs) and descended from again (an iterated local search).
//!
//! The budget is a number of simulations, not seconds, so a seed gives the same strategy on any
//! machine; a strategy met again is looked up, not simulated. The starts are always simulated,
//! whatever the budget, and the result is the fastest strategy simulated: by construction never
//! slower in simulation than the Eq. 1 optimum, any baseline or any other paper's planner.

use super::SearchKind;
use crate::config::ParallelConfig;
use crate::simulate::simulated_step_time;
use crate::tables::CostTables;
use crate::transfer_table::{EdgeGeometry, PairBuffers};
use legion_ops::LayerId;
use legion_ops::rng::Rng;
use std::cell::RefCell;
use std::collections::HashMap;

/// Simulations a refinement may run by default: Inception-v3 on the `paper` preset (16 devices,
/// 25 ms a simulation) refines in about 40 s on one core, AlexNet and VGG-16 in a few seconds
/// (release builds). A simulation's cost grows with the tasks of a step: on hundreds of devices
/// it takes seconds, so by default the budget is also held to [`REFINE_WORK`].
pub const DEFAULT_REFINE_BUDGET: u64 = 1_500;

/// Simulated tasks a refinement may schedule in all by default (its budget becomes this over the
/// tasks of its largest start's step, where fewer than its simulations). A number of tasks, not
/// seconds, so that a seed gives the same strategy on any machine: VGG-16 data-parallel on 256
/// devices is 7.1 M tasks a step, 0.54 s a simulation, so 70 simulations; Inception-v3's 0.3 M on
/// 16 devices leave the 1,500 of the default budget.
pub const REFINE_WORK: u64 = 500_000_000;

/// The seed of the visiting order and the kicks when none is given.
pub const DEFAULT_REFINE_SEED: u64 = 1;

/// The searches whose strategies refinement starts from, in order: among equally fast starts the
/// earlier one is the incumbent. The other papers' planners are cheap beside a refinement (a
/// tenth of a second for Inception-v3 on `paper`) and can be faster in simulation than every
/// strategy of our own: a refinement that did not start from them could lose to them, so it
/// starts from every one of [`SearchKind::SEEDS`].
pub const REFINE_STARTS: [SearchKind; OWN_STARTS.len() + SearchKind::SEEDS.len()] = {
    let mut starts = [SearchKind::OptCnn; OWN_STARTS.len() + SearchKind::SEEDS.len()];
    let mut i = 0;
    while i < starts.len() {
        starts[i] = match i.checked_sub(OWN_STARTS.len()) {
            None => OWN_STARTS[i],
            Some(seed) => SearchKind::SEEDS[seed],
        };
        i += 1;
    }
    starts
};

/// The starts of our own space, before the seed planners'.
const OWN_STARTS: [SearchKind; 4] = [
    SearchKind::OptCnn,
    SearchKind::Data,
    SearchKind::Model,
    SearchKind::Owt,
];

/// How many configs of a layer each local Eq. 1 ranking proposes.
const RANKED_CANDIDATES: usize = 3;

/// The least relative gain a move must bring to be accepted: the simulator is deterministic, but
/// a layout change for a part per million of a step is below what any of its prices means, and
/// accepting such moves would churn layouts without speeding anything up.
const MIN_GAIN: f64 = 1e-6;

/// Layers set to random configs by one kick of the iterated local search.
const KICKED_LAYERS: usize = 2;

/// Kicks in a row that may find nothing new to simulate (every strategy they reach was met before)
/// before the search ends with budget left: on small graphs the reachable strategies run out.
const STALE_KICKS: usize = 64;

/// The bounds of a refinement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefineOptions {
    /// Simulations at most, the starts' included (those are simulated even beyond it).
    pub budget: u64,
    /// Seeds the order layers are visited in and the kicks.
    pub seed: u64,
    /// Simulated tasks at most, in all ([`REFINE_WORK`] by default): the budget shrinks to this
    /// over the tasks of one step where that is fewer simulations. `None`: the budget alone.
    pub work: Option<u64>,
}

impl RefineOptions {
    /// The simulations a refinement may run on a step of `tasks` tasks: the budget, held to
    /// [`RefineOptions::work`], and never below one more than the starts.
    pub fn budget_for(&self, tasks: usize) -> u64 {
        match self.work {
            Some(work) => self
                .budget
                .min((work / tasks.max(1) as u64).max(REFINE_STARTS.len() as u64 + 1)),
            None => self.budget,
        }
    }
}

impl Default for RefineOptions {
    fn default() -> Self {
        RefineOptions {
            budget: DEFAULT_REFINE_BUDGET,
            seed: DEFAULT_REFINE_SEED,
            work: Some(REFINE_WORK),
        }
    }
}

/// What a refinement did, for `plan` to print beside its strategy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefineReport {
    /// Simulations run (a strategy met again is not simulated again).
    pub simulations: u64,
    pub budget: u64,
    pub seed: u64,
    /// The start that was fastest in simulation (the earliest of equals).
    pub start: SearchKind,
    /// Simulated seconds per step of that start.
    pub start_s: f64,
    /// Simulated seconds per step of the result: at most `start_s`.
    pub refined_s: f64,
    /// Moves accepted (each faster by at least a part per million than the strategy it changed).
    pub accepted: u64,
}

/// A refined strategy and how it was found.
#[derive(Clone, Debug, PartialEq)]
pub struct Refined {
    /// By layer id.
    pub configs: Vec<ParallelConfig>,
    pub report: RefineReport,
}

/// Refines `starts` (each a search and its strategy, by layer id) under the simulated step time of
/// the tables' model.
///
/// # Panics
/// If `starts` is empty, or a start has not one config per layer.
pub fn refine(
    tables: &CostTables,
    starts: &[(SearchKind, &[ParallelConfig])],
    options: &RefineOptions,
) -> Refined {
    let model = tables.model();
    refine_by(tables, starts, options, |configs| {
        simulated_step_time(model, configs)
    })
}

/// [`refine`] under any objective (seconds, lower is better): the simulator in `refine`, cheaper
/// stand-ins in tests.
pub(crate) fn refine_by(
    tables: &CostTables,
    starts: &[(SearchKind, &[ParallelConfig])],
    options: &RefineOptions,
    objective: impl FnMut(&[ParallelConfig]) -> f64,
) -> Refined {
    assert!(!starts.is_empty(), "refinement needs a start");
    let layers = tables.num_layers();
    let mut objective = Memo::new(objective, options.budget);
    let mut start = 0;
    let mut start_s = f64::INFINITY;
    for (i, (_, configs)) in starts.iter().enumerate() {
        assert_eq!(configs.len(), layers, "one config per layer");
        // strictly: the result is never slower than any start, not even by a rounding
        let t = objective.forced(configs);
        if t < start_s {
            (start, start_s) = (i, t);
        }
    }
    let incumbent = Strategy {
        configs: starts[start].1.to_vec(),
        time: start_s,
    };
    let mut search = Search {
        tables,
        neighbours: Neighbours::of(tables),
        transfers: PairTimes::default(),
        rng: Rng::new(options.seed),
        objective,
        best: incumbent.clone(),
        accepted: 0,
    };
    search.run(incumbent);
    let best = search.best;
    Refined {
        report: RefineReport {
            simulations: search.objective.simulations,
            budget: options.budget,
            seed: options.seed,
            start: starts[start].0,
            start_s,
            refined_s: best.time,
            accepted: search.accepted,
        },
        configs: best.configs,
    }
}

/// A strategy (by layer id) and its objective.
#[derive(Clone, Debug)]
struct Strategy {
    configs: Vec<ParallelConfig>,
    time: f64,
}

/// Whether `time` is faster than `than` by at least [`MIN_GAIN`] of it.
fn faster(time: f64, than: f64) -> bool {
    time < than && than - time >= than.abs() * MIN_GAIN
}

/// The objective behind a memo and a budget.
struct Memo<F> {
    objective: F,
    seen: HashMap<Vec<ParallelConfig>, f64>,
    simulations: u64,
    budget: u64,
}

impl<F: FnMut(&[ParallelConfig]) -> f64> Memo<F> {
    fn new(objective: F, budget: u64) -> Self {
        Memo {
            objective,
            seen: HashMap::new(),
            simulations: 0,
            budget,
        }
    }

    fn spent(&self) -> bool {
        self.simulations >= self.budget
    }

    /// The objective of `configs`, evaluated whatever the budget.
    fn forced(&mut self, configs: &[ParallelConfig]) -> f64 {
        if let Some(&t) = self.seen.get(configs) {
            return t;
        }
        let t = (self.objective)(configs);
        self.simulations += 1;
        self.seen.insert(configs.to_vec(), t);
        t
    }

    /// The objective of `configs`, or `None` when it was never evaluated and the budget is spent.
    fn time(&mut self, configs: &[ParallelConfig]) -> Option<f64> {
        if !self.seen.contains_key(configs) && self.spent() {
            return None;
        }
        Some(self.forced(configs))
    }
}

/// t_x of config pairs of the model's edges, each edge class's geometry worked out once.
#[derive(Default)]
struct PairTimes {
    geometries: RefCell<HashMap<usize, EdgeGeometry>>,
    buffers: RefCell<PairBuffers>,
}

impl PairTimes {
    /// t_x of edge `edge` (an index into the model's edges) from `src` to `dst`: the tables'
    /// number (bit for bit the direct evaluation's, tested), directly where no cheap path exists.
    fn time(
        &self,
        tables: &CostTables,
        edge: usize,
        src: &ParallelConfig,
        dst: &ParallelConfig,
    ) -> f64 {
        let class = tables.edge_class(edge);
        let mut geometries = self.geometries.borrow_mut();
        let geometry = geometries
            .entry(class)
            .or_insert_with(|| tables.edge_geometry(edge));
        tables
            .config_pair_time(geometry, src, dst, &mut self.buffers.borrow_mut())
            .unwrap_or_else(|| {
                let model = tables.model();
                model.transfer_time(&model.edges()[edge], src, dst)
            })
    }
}

/// Each layer's producers and consumers, with the edges (indices into the model's edges) that join
/// them.
struct Neighbours {
    /// Per layer, its in-edges.
    inputs: Vec<Vec<usize>>,
    /// Per layer, its out-edges.
    outputs: Vec<Vec<usize>>,
    /// Per layer, the layers it shares an edge with, either way.
    adjacent: Vec<Vec<usize>>,
}

impl Neighbours {
    fn of(tables: &CostTables) -> Neighbours {
        let n = tables.num_layers();
        let mut inputs = vec![Vec::new(); n];
        let mut outputs = vec![Vec::new(); n];
        let mut adjacent = vec![Vec::new(); n];
        for (i, e) in tables.edges().iter().enumerate() {
            inputs[e.dst.0].push(i);
            outputs[e.src.0].push(i);
            adjacent[e.dst.0].push(e.src.0);
            adjacent[e.src.0].push(e.dst.0);
        }
        Neighbours {
            inputs,
            outputs,
            adjacent,
        }
    }
}

/// The state of one refinement.
struct Search<'t, 'm, F> {
    tables: &'t CostTables<'m>,
    neighbours: Neighbours,
    /// t_x of one config pair of an edge, through its class's geometry where that is cheap (the
    /// per-axis path: a direct evaluation visits every pair of tiles, which on hundreds of devices
    /// made ranking candidates cost more than simulating them).
    transfers: PairTimes,
    rng: Rng,
    objective: Memo<F>,
    /// The fastest strategy of the walk so far.
    best: Strategy,
    accepted: u64,
}

impl<F: FnMut(&[ParallelConfig]) -> f64> Search<'_, '_, F> {
    /// Descends from `start`, then kicks the best strategy and descends again until the budget is
    /// spent or the kicks find nothing new.
    fn run(&mut self, start: Strategy) {
        self.descend(start);
        let mut stale = 0;
        while !self.objective.spent() && stale < STALE_KICKS {
            let before = self.objective.simulations;
            if let Some(kicked) = self.kick(self.best.clone()) {
                self.keep_if_best(&kicked);
                self.descend(kicked);
            }
            stale = if self.objective.simulations == before {
                stale + 1
            } else {
                0
            };
        }
    }

    /// Passes over every layer in a fresh shuffled order, each layer taking its first [`faster`]
    /// move, until a pass improves nothing or the budget is spent.
    fn descend(&mut self, mut current: Strategy) {
        loop {
            let mut improved = false;
            for layer in shuffled(self.tables.num_layers(), &mut self.rng) {
                match self.improve(&current, layer) {
                    Step::Moved(next) => {
                        current = next;
                        self.keep_if_best(&current);
                        improved = true;
                    }
                    Step::Stayed => {}
                    Step::Spent => return,
                }
            }
            if !improved {
                return;
            }
        }
    }

    /// Makes `strategy` the best if it is [`faster`] than the best so far.
    fn keep_if_best(&mut self, strategy: &Strategy) {
        if faster(strategy.time, self.best.time) {
            self.best = strategy.clone();
        }
    }

    /// The first of `layer`'s moves (candidates in order, each as a layer move then a run move)
    /// that is [`faster`] than `current`.
    fn improve(&mut self, current: &Strategy, layer: usize) -> Step {
        let mut trial = current.configs.clone();
        for config in self.candidates(&current.configs, layer) {
            let run = self.run_of(&current.configs, layer, &config);
            let moves: &[&[usize]] = if run.len() > 1 {
                &[&[layer], &run]
            } else {
                &[&[layer]]
            };
            for &changed in moves {
                trial.copy_from_slice(&current.configs);
                for &l in changed {
                    trial[l] = config;
                }
                let Some(time) = self.objective.time(&trial) else {
                    return Step::Spent;
                };
                if faster(time, current.time) {
                    self.accepted += 1;
                    return Step::Moved(Strategy {
                        configs: trial,
                        time,
                    });
                }
            }
        }
        Step::Stayed
    }

    /// `best` with [`KICKED_LAYERS`] random layers set to random configs of their spaces, and its
    /// objective; `None` once the budget is spent.
    fn kick(&mut self, mut best: Strategy) -> Option<Strategy> {
        let layers = self.tables.num_layers();
        for _ in 0..KICKED_LAYERS {
            let layer = self.rng.below(layers);
            let space = self.tables.space(LayerId(layer));
            best.configs[layer] = space.config(self.rng.below(space.len()));
        }
        best.time = self.objective.time(&best.configs)?;
        Some(best)
    }

    /// The configs `layer` may move to from `configs`, in the order they are tried: its
    /// neighbours' configs, then the cheapest by its local Eq. 1 terms, then the cheapest with
    /// its t_s left out; each once, none its current config.
    fn candidates(&self, configs: &[ParallelConfig], layer: usize) -> Vec<ParallelConfig> {
        let space = self.tables.space(LayerId(layer));
        let current = configs[layer];
        let mut out: Vec<ParallelConfig> = Vec::new();
        let mut push = |c: ParallelConfig| {
            if c != current && !out.contains(&c) && space.index_of(&c).is_some() {
                out.push(c);
            }
        };
        for &other in &self.neighbours.adjacent[layer] {
            push(configs[other]);
        }
        let eq1 = self.local_eq1(configs, layer);
        let sync = self.tables.sync(LayerId(layer));
        let hidden: Vec<f64> = eq1.iter().zip(sync).map(|(t, s)| t - s).collect();
        for costs in [&eq1, &hidden] {
            for i in cheapest(costs, RANKED_CANDIDATES, space.index_of(&current)) {
                push(space.config(i));
            }
        }
        out
    }

    /// Per config of `layer`'s space, t_c + t_s of the layer and t_x of its edges with its
    /// neighbours' configs as in `configs`.
    fn local_eq1(&self, configs: &[ParallelConfig], layer: usize) -> Vec<f64> {
        let model = self.tables.model();
        let edges = model.edges();
        let space = self.tables.space(LayerId(layer));
        let node = self.tables.node_cost(LayerId(layer));
        space
            .configs()
            .iter()
            .zip(node)
            .map(|(c, node)| {
                let inputs = self.neighbours.inputs[layer].iter().map(|&e| {
                    let edge = &edges[e];
                    self.transfers.time(self.tables, e, &configs[edge.src.0], c)
                });
                let outputs = self.neighbours.outputs[layer].iter().map(|&e| {
                    let edge = &edges[e];
                    self.transfers.time(self.tables, e, c, &configs[edge.dst.0])
                });
                node + inputs.chain(outputs).sum::<f64>()
            })
            .collect()
    }

    /// `layer`'s run for a move to `target`: see [`run_of`].
    fn run_of(
        &self,
        configs: &[ParallelConfig],
        layer: usize,
        target: &ParallelConfig,
    ) -> Vec<usize> {
        run_of(&self.neighbours.adjacent, configs, layer, |l| {
            self.tables.space(LayerId(l)).index_of(target).is_some()
        })
    }
}

/// What one layer's moves did.
enum Step {
    Moved(Strategy),
    Stayed,
    Spent,
}

/// The layers reachable from `layer` through `adjacent` over layers with `layer`'s config that
/// `can_take` (the move's target config is in their space), `layer` first, in the order reached.
fn run_of(
    adjacent: &[Vec<usize>],
    configs: &[ParallelConfig],
    layer: usize,
    can_take: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut reached = vec![false; configs.len()];
    reached[layer] = true;
    let mut run = vec![layer];
    let mut next = 0;
    while let Some(&l) = run.get(next) {
        next += 1;
        for &m in &adjacent[l] {
            if !reached[m] && configs[m] == configs[layer] && can_take(m) {
                reached[m] = true;
                run.push(m);
            }
        }
    }
    run
}

/// The indices of the `k` lowest of `costs` (lowest first, the lower index among equals), leaving
/// out `skip`.
fn cheapest(costs: &[f64], k: usize, skip: Option<usize>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).filter(|&i| Some(i) != skip).collect();
    order.sort_by(|&a, &b| costs[a].total_cmp(&costs[b]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// `0..n` in an order drawn from `rng` (Fisher–Yates).
fn shuffled(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order
}

#[cfg(test)]
mod tests {
    use super::super::tiling::tests::{random_graph, small_cnn};
    use super::super::{SearchOptions, find, find_with};
    use super::*;
    use crate::cost::CostModel;
    use crate::machine::MachineModel;
    use crate::provider::RooflineCost;
    use proptest::prelude::*;

    #[test]
    fn cheapest_takes_the_lowest_leaving_out_the_current_and_ties_go_to_the_lower_index() {
        let costs = [3.0, 1.0, 2.0, 1.0, 0.5];
        assert_eq!(cheapest(&costs, 3, None), vec![4, 1, 3]);
        assert_eq!(cheapest(&costs, 3, Some(4)), vec![1, 3, 2]);
        assert_eq!(cheapest(&costs, 9, Some(0)), vec![4, 1, 3, 2]);
        assert!(cheapest(&[], 2, None).is_empty());
    }

    /// The default budget is held to the work cap over the tasks of a step, never below one more
    /// than the starts; without a cap, the budget is the budget.
    #[test]
    fn the_default_budget_is_held_to_a_number_of_simulated_tasks() {
        let default = RefineOptions::default();
        assert_eq!(default.budget_for(1_000), DEFAULT_REFINE_BUDGET);
        assert_eq!(default.budget_for(1_000_000), REFINE_WORK / 1_000_000);
        assert_eq!(
            default.budget_for(usize::MAX),
            REFINE_STARTS.len() as u64 + 1
        );
        let exact = RefineOptions {
            work: None,
            ..default
        };
        assert_eq!(exact.budget_for(usize::MAX), DEFAULT_REFINE_BUDGET);
    }

    #[test]
    fn shuffled_is_a_permutation_fixed_by_the_seed() {
        let draw = |seed| shuffled(20, &mut legion_ops::rng::Rng::new(seed));
        let mut sorted = draw(3);
        assert_eq!(draw(3), sorted);
        assert_ne!(draw(4), sorted);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        assert!(shuffled(0, &mut legion_ops::rng::Rng::new(1)).is_empty());
    }

    #[test]
    fn a_run_follows_edges_through_layers_with_the_same_config_that_can_take_the_target() {
        // 0 - 1 - 2 - 3 - 4, and 1 - 5
        let adjacent = vec![
            vec![1],
            vec![0, 2, 5],
            vec![1, 3],
            vec![2, 4],
            vec![3],
            vec![1],
        ];
        let a = ParallelConfig::serial(0);
        let b = ParallelConfig::serial(1);
        // layer 2 differs: it cuts 3 and 4 off the run of 1
        let configs = [a, a, b, a, a, a];
        assert_eq!(run_of(&adjacent, &configs, 1, |_| true), vec![1, 0, 5]);
        assert_eq!(run_of(&adjacent, &configs, 4, |_| true), vec![4, 3]);
        assert_eq!(run_of(&adjacent, &configs, 2, |_| true), vec![2]);
        // a layer that cannot take the target stops the run, but the moved layer is always in it
        assert_eq!(run_of(&adjacent, &configs, 1, |l| l != 0), vec![1, 5]);
        assert_eq!(run_of(&adjacent, &configs, 1, |_| false), vec![1]);
    }

    #[test]
    fn a_move_must_gain_a_part_per_million() {
        assert!(faster(0.999, 1.0));
        assert!(!faster(1.0, 1.0));
        assert!(!faster(1.0 - 1e-9, 1.0));
        assert!(faster(1.0 - 2e-6, 1.0));
        assert!(faster(1.0, f64::INFINITY));
    }

    #[test]
    fn a_strategy_met_again_costs_no_simulation_and_the_budget_stops_new_ones() {
        let (a, b) = (ParallelConfig::serial(0), ParallelConfig::serial(1));
        let mut calls = 0;
        let mut memo = Memo::new(
            |c: &[ParallelConfig]| {
                calls += 1;
                c[0].first_device() as f64
            },
            2,
        );
        assert_eq!(memo.time(&[a]), Some(0.0));
        assert_eq!(memo.time(&[a]), Some(0.0));
        assert_eq!(memo.time(&[b]), Some(1.0));
        assert!(memo.spent());
        let c = ParallelConfig::serial(2);
        assert_eq!(memo.time(&[c]), None);
        assert_eq!(memo.time(&[b]), Some(1.0));
        // a start is simulated beyond the budget
        assert_eq!(memo.forced(&[c]), 2.0);
        assert_eq!(memo.simulations, 3);
        drop(memo);
        assert_eq!(calls, 3);
    }

    /// Under Eq. 1 as its objective and from the baselines alone, the refinement moves toward the
    /// optimum Algorithm 1 finds: strictly cheaper than every baseline, never cheaper than the
    /// optimum, within its budget.
    #[test]
    fn under_eq1_from_the_baselines_it_improves_toward_the_optimum() {
        let g = small_cnn(8, 8, 8);
        let machine = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let tables = CostTables::build(&model);
        let kinds = [SearchKind::Data, SearchKind::Model, SearchKind::Owt];
        let baselines: Vec<Vec<ParallelConfig>> = kinds
            .iter()
            .map(|&k| find(k, &tables, 0).unwrap().configs)
            .collect();
        let starts: Vec<(SearchKind, &[ParallelConfig])> = kinds
            .iter()
            .zip(&baselines)
            .map(|(&k, c)| (k, c.as_slice()))
            .collect();
        let best_baseline = baselines
            .iter()
            .map(|c| model.total(c))
            .fold(f64::INFINITY, f64::min);
        let optimum = model.total(&find(SearchKind::OptCnn, &tables, 0).unwrap().configs);
        assert!(
            optimum < best_baseline * 0.99,
            "{optimum} vs {best_baseline}"
        );
        let options = RefineOptions {
            budget: 300,
            seed: 5,
            work: None,
        };
        let refined = refine_by(&tables, &starts, &options, |c| model.total(c));
        let r = refined.report;
        assert_eq!(r.refined_s, model.total(&refined.configs));
        assert!(
            r.refined_s < best_baseline,
            "{} vs {best_baseline}",
            r.refined_s
        );
        assert!(r.refined_s >= optimum * (1.0 - 1e-12));
        assert_eq!(r.start_s, best_baseline);
        assert!(r.accepted > 0 && r.simulations <= 300, "{r:?}");
        assert_eq!((r.budget, r.seed), (300, 5));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// On random small graphs and machines, refine's strategy is never slower in simulation
        /// than optcnn's or any baseline's, is the same for the same seed, keeps within its budget
        /// and gives each layer a config of its space.
        #[test]
        fn refine_is_never_slower_than_its_starts_and_is_deterministic(
            seed in 0u64..1_000_000,
            machine in prop::sample::select(vec![
                "local-cpu:2", "local-cpu:3", "local-cpu:4", "local-cpu:6", "paper:2", "paper:4",
                "paper:8",
            ]),
            refine_seed in 0u64..4,
        ) {
            let g = random_graph(seed);
            let machine = MachineModel::preset(machine).unwrap();
            let provider = RooflineCost::new(&machine);
            let model = CostModel::new(&g, &machine, &provider);
            let tables = CostTables::build(&model);
            let options = SearchOptions {
                exhaustive_budget: 0,
                refine: RefineOptions { budget: 60, seed: refine_seed, work: None },
                space: Default::default(),
            };
            let found = find_with(SearchKind::Refine, &tables, &options, &[]).unwrap();
            let report = found.refined.expect("a refinement reports");
            let refined = simulated_step_time(&model, &found.configs);
            prop_assert_eq!(refined, report.refined_s);
            for kind in REFINE_STARTS {
                let start = simulated_step_time(&model, &find(kind, &tables, 0).unwrap().configs);
                prop_assert!(refined <= start, "refine {} > {} {}", refined, kind, start);
                if kind == report.start {
                    prop_assert_eq!(start, report.start_s);
                }
            }
            prop_assert!(report.simulations <= 60, "{:?}", report);
            prop_assert_eq!(
                &find_with(SearchKind::Refine, &tables, &options, &[]).unwrap(),
                &found
            );
            prop_assert_eq!(found.configs.len(), g.layers().len());
            for (i, config) in found.configs.iter().enumerate() {
                prop_assert!(
                    tables.space(LayerId(i)).index_of(config).is_some(),
                    "layer {} ({:?}) {}", g.layers()[i].name, g.layers()[i].shape,
                    config.describe()
                );
            }
        }
    }
}
