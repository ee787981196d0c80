//! Strategy searches: OptCNN's Algorithm 1, the exhaustive baseline, the three fixed strategies
//! the paper compares with, a refinement of their strategies under the simulated step time
//! ([`refine`](mod@refine)), and four planners of other papers (SOYBEAN, Tofu, HyPar, Spartan), called the
//! **seed planners** throughout (they seed the comparison with other systems' answers, priced
//! by our cost model), each searching its own space under its own byte count
//! ([`native_bytes`]) and mapped into ours, with what the mapping loses in [`Found::lossy`]. Each
//! is a [`SeedPlanner`] in its own file, which [`SearchKind::seed`] alone names. Each search
//! returns per-layer configs; [`run`] prices them with Eq. 1.

mod data;
mod exhaustive;
pub mod hypar;
mod min_plus;
mod model;
mod optcnn;
mod owt;
pub mod refine;
mod relaxation;
mod residual;
mod seed;
pub mod soybean;
pub mod spartan;
pub mod tiling;
pub mod tofu;

pub use data::data_parallel;
pub use exhaustive::{
    DEFAULT_BUDGET, ExhaustiveResult, SIDE_BY_SIDE_BUDGET, exhaustive, exhaustive_where,
};
pub use hypar::{HyparPlan, hypar};
pub use model::model_parallel;
pub use optcnn::{OptCnnResult, Optimality, RESIDUAL_BUDGET, optcnn, optcnn_within};
pub use owt::one_weird_trick;
pub use refine::{
    DEFAULT_REFINE_BUDGET, DEFAULT_REFINE_SEED, REFINE_STARTS, RefineOptions, RefineReport,
    Refined, refine,
};
pub use seed::{SeedPlan, SeedPlanner};
pub use soybean::{SoybeanPlan, soybean};
pub use spartan::{SpartanPlan, spartan};
pub use tofu::{TofuPlan, tofu};

use crate::config::ParallelConfig;
use crate::cost::CostBreakdown;
use crate::machine::MachineModel;
use crate::memory::{DoesNotFit, check_fits};
use crate::progress::Phase;
use crate::simulate::simulated_step_time;
use crate::tables::{CostTables, SearchSpace};
use std::fmt;

/// Every search [`find`] runs; `legion-rs plan --search` offers [`SearchKind::every`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SearchKind {
    OptCnn,
    Refine,
    Exhaustive,
    Data,
    Model,
    Owt,
    Soybean,
    Tofu,
    Hypar,
    Spartan,
}

impl SearchKind {
    /// The searches of our own space. `legion-rs plan --search all` runs these, then
    /// [`SearchKind::SEEDS`] with their native bytes and lossy notes; `find`, `run` and `parse`
    /// take them all. Only `OptCnn` and `Exhaustive` are optimal under Eq. 1; `Refine` optimises
    /// the simulated step time instead.
    pub const ALL: [SearchKind; 6] = [
        SearchKind::OptCnn,
        SearchKind::Refine,
        SearchKind::Exhaustive,
        SearchKind::Data,
        SearchKind::Model,
        SearchKind::Owt,
    ];

    /// The planners of other papers, which search their own spaces under their own byte counts.
    pub const SEEDS: [SearchKind; 4] = [
        SearchKind::Soybean,
        SearchKind::Tofu,
        SearchKind::Hypar,
        SearchKind::Spartan,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SearchKind::OptCnn => "optcnn",
            SearchKind::Refine => "refine",
            SearchKind::Exhaustive => "exhaustive",
            SearchKind::Data => "data",
            SearchKind::Model => "model",
            SearchKind::Owt => "owt",
            seed => seed.planner().name(),
        }
    }

    /// The planner a seed kind runs; `None` for the searches of our own space. The one place
    /// that ties a seed kind to its planner: every search, price and note of a seed kind goes
    /// through here.
    pub fn seed(self) -> Option<&'static dyn SeedPlanner> {
        match self {
            SearchKind::Soybean => Some(&soybean::Soybean),
            SearchKind::Tofu => Some(&tofu::Tofu),
            SearchKind::Hypar => Some(&hypar::Hypar),
            SearchKind::Spartan => Some(&spartan::Spartan),
            SearchKind::OptCnn
            | SearchKind::Refine
            | SearchKind::Exhaustive
            | SearchKind::Data
            | SearchKind::Model
            | SearchKind::Owt => None,
        }
    }

    /// [`SearchKind::seed`] where `self` is known to be a seed kind: in a match's last arm, after
    /// the arms of every search of our own space.
    fn planner(self) -> &'static dyn SeedPlanner {
        self.seed()
            .unwrap_or_else(|| panic!("{self:?} is a search of our own space, not a seed planner"))
    }

    /// What mapping this search's plans into our configuration space loses (in OptCNN's space,
    /// the seed planners' reduction splits above all), for the CLI to print beside its results;
    /// `None` for the searches of our own space.
    pub fn lossy(self) -> Option<&'static str> {
        self.seed().map(|planner| planner.lossy())
    }

    pub fn parse(name: &str) -> Option<SearchKind> {
        SearchKind::every().find(|k| k.name() == name)
    }

    /// Every search: [`SearchKind::ALL`], then [`SearchKind::SEEDS`]. Command lines, help and
    /// errors list the searches from here.
    pub fn every() -> impl Iterator<Item = SearchKind> {
        SearchKind::ALL.into_iter().chain(SearchKind::SEEDS)
    }

    /// What the search does, in a line of help.
    pub fn summary(self) -> &'static str {
        match self {
            SearchKind::OptCnn => "OptCNN's Algorithm 1: optimal under Eq. 1",
            SearchKind::Refine => {
                "OptCNN's and the baselines' strategies refined under the simulated step time, \
                 which overlaps what Eq. 1 adds up"
            }
            SearchKind::Exhaustive => "every strategy priced, within a budget",
            SearchKind::Data => "data parallelism: every layer split over the batch",
            SearchKind::Model => "model parallelism: every layer split over its channels",
            SearchKind::Owt => {
                "one weird trick: data-parallel convolutions, model-parallel dense layers"
            }
            SearchKind::Soybean => "SOYBEAN's k-cut tiling, mapped into our configurations",
            SearchKind::Tofu => {
                "Tofu's recursive partition-n-reduce, mapped into our configurations"
            }
            SearchKind::Hypar => {
                "HyPar's hierarchical data/model choice, mapped into our configurations"
            }
            SearchKind::Spartan => "Spartan's greedy tiling, mapped into our configurations",
        }
    }
}

impl fmt::Display for SearchKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SearchError {
    #[error(
        "the search stopped: it exceeded its budget of {budget} partial strategies (the graph has too many strategies to enumerate)"
    )]
    BudgetExceeded { budget: u64 },
    /// The strategy (a fixed one), or every strategy the search found, needs more memory than a
    /// device has: the closest one's most overcommitted device.
    #[error("{what}: {closest}")]
    DoesNotFit {
        /// What did not fit: `the data strategy does not fit the devices' memory`, `optcnn found no
        /// strategy that fits the devices' memory; the closest`, ...
        what: String,
        closest: DoesNotFit,
    },
}

/// What a search chose.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// By layer id.
    pub configs: Vec<ParallelConfig>,
    /// Layers left after Algorithm 1's eliminations (OptCNN only).
    pub residual_nodes: Option<usize>,
    /// Whether Algorithm 1's residual graph was solved exactly, or within a lower bound (OptCNN
    /// only).
    pub optimality: Option<Optimality>,
    /// Partial strategies tried (exhaustive only).
    pub tried: Option<u64>,
    /// What the mapping into our configuration space lost (the seed planners only).
    pub lossy: Option<&'static str>,
    /// Bytes of the plan as the seed planner found it, under its own paper's accounting, before
    /// the mapping into our space (the seed planners only; [`native_bytes`] prices any strategy).
    pub native_bytes: Option<f64>,
    /// Where the refinement started, how far it got and what it spent (refine only).
    pub refined: Option<RefineReport>,
}

/// The bounds of the searches that take one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SearchOptions {
    /// Partial strategies the exhaustive search may try.
    pub exhaustive_budget: u64,
    /// Simulations and seed of the refinement.
    pub refine: RefineOptions,
    /// The configurations searched ([`plan`](crate::plan::plan) builds its tables over them).
    pub space: SearchSpace,
}

impl SearchOptions {
    /// `exhaustive_budget` for the exhaustive search, the default refinement.
    pub fn with_budget(exhaustive_budget: u64) -> SearchOptions {
        SearchOptions {
            exhaustive_budget,
            refine: RefineOptions::default(),
            space: SearchSpace::Paper,
        }
    }
}

/// Runs one search. `budget` caps the exhaustive search; a refinement runs with
/// [`RefineOptions::default`].
pub fn find(kind: SearchKind, tables: &CostTables, budget: u64) -> Result<Found, SearchError> {
    find_with(kind, tables, &SearchOptions::with_budget(budget), &[])
}

/// Runs one search within `options`. `earlier` holds strategies other searches found on the same
/// tables, which a refinement starts from instead of searching them again (the others ignore it).
pub fn find_with(
    kind: SearchKind,
    tables: &CostTables,
    options: &SearchOptions,
    earlier: &[(SearchKind, &[ParallelConfig])],
) -> Result<Found, SearchError> {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let budget = options.exhaustive_budget;
    let mut found = Found {
        configs: Vec::new(),
        residual_nodes: None,
        optimality: None,
        tried: None,
        lossy: kind.lossy(),
        native_bytes: None,
        refined: None,
    };
    found.configs = match kind {
        SearchKind::OptCnn => {
            let (r, configs, penalised) = optcnn_within_memory(tables)?;
            found.residual_nodes = Some(r.residual_nodes);
            // a memory-penalised search's bound is of the penalised objective, not of Eq. 1
            found.optimality = (!penalised).then_some(r.optimality);
            configs
        }
        SearchKind::Refine => {
            // Every start counts, whether it fits the devices' memory or not: a move is judged
            // by the simulated step where it fits and, where none does yet, by how far it is
            // over ([`over_memory`]), so the search also walks from strategies that do not fit
            // to ones that do.
            let mut starts: Vec<(SearchKind, Vec<ParallelConfig>)> = Vec::new();
            for start in REFINE_STARTS {
                let configs = match earlier.iter().find(|(k, _)| *k == start) {
                    Some((_, configs)) => configs.to_vec(),
                    None => unconstrained(start, tables)?,
                };
                starts.push((start, configs));
            }
            // and whatever else ran before it (the exhaustive search's optimum, which may differ
            // from optcnn's among equals under Eq. 1)
            for (kind, configs) in earlier {
                if !starts.iter().any(|(k, _)| k == kind) && *kind != SearchKind::Refine {
                    starts.push((*kind, configs.to_vec()));
                }
            }
            let starts: Vec<(SearchKind, &[ParallelConfig])> =
                starts.iter().map(|(k, c)| (*k, c.as_slice())).collect();
            // the default budget is also held to a number of simulated tasks, counted at the start
            // with the most (data parallelism's sync messages, mostly)
            let most_tasks = starts
                .iter()
                .map(|(_, configs)| crate::simulate::task_count(model, configs))
                .max()
                .unwrap_or(0);
            let refine_options = RefineOptions {
                budget: options.refine.budget_for(most_tasks),
                ..options.refine
            };
            let simulated = std::cell::Cell::new(0u64);
            let refined = refine::refine_by(tables, &starts, &refine_options, |configs| {
                simulated.set(simulated.get() + 1);
                // every start is simulated, also past the budget
                let budget = refine_options.budget;
                model.progress(Phase::Refine, simulated.get().min(budget), budget);
                let over = over_memory(graph, machine, configs);
                if over > 0.0 {
                    UNFIT_SECONDS * (1.0 + over)
                } else {
                    simulated_step_time(model, configs)
                }
            });
            if let Err(closest) = check_fits(graph, machine, &refined.configs) {
                return Err(SearchError::DoesNotFit {
                    what: "refine found no strategy that fits the devices' memory; the closest"
                        .into(),
                    closest,
                });
            }
            found.refined = Some(refined.report);
            refined.configs
        }
        SearchKind::Exhaustive => {
            let r = if machine.has_own_memory() {
                let fits = |indices: &[usize]| {
                    check_fits(graph, machine, &tables.configs(indices)).is_ok()
                };
                // optcnn's strategy within memory, where it finds one, bounds the search from
                // the start: then only cheaper strategies have their memory checked
                let incumbent = optcnn_within_memory(tables).ok().map(|(r, ..)| r.indices);
                exhaustive_where(tables, budget, &fits, incumbent.as_deref())?
            } else {
                exhaustive(tables, budget)?
            };
            found.tried = Some(r.tried);
            if r.cost.is_infinite() {
                // the closest to report: Eq. 1's optimum, or data parallelism where even the
                // unconstrained search runs out of budget
                let closest = match exhaustive(tables, budget) {
                    Ok(unconstrained) => tables.configs(&unconstrained.indices),
                    Err(_) => data_parallel(graph, machine),
                };
                return Err(does_not_fit(
                    "the exhaustive search found no strategy that fits the devices' memory; \
                     the closest"
                        .into(),
                    graph,
                    machine,
                    &closest,
                ));
            }
            tables.configs(&r.indices)
        }
        SearchKind::Data => data_parallel(graph, machine),
        SearchKind::Model => model_parallel(graph, machine),
        SearchKind::Owt => one_weird_trick(graph, machine),
        // the seed planners' plans in the tables' space: their reduction splits map exactly
        // where it has ours
        seed => {
            let plan = seed.planner().plan(graph, machine, tables.search_space());
            found.native_bytes = Some(plan.native_bytes);
            plan.configs
        }
    };
    // searches of their own (optcnn, exhaustive, refine) only return strategies that fit; a fixed
    // strategy either fits or is an error
    if let Err(closest) = check_fits(graph, machine, &found.configs) {
        return Err(SearchError::DoesNotFit {
            what: format!("the {kind} strategy does not fit the devices' memory"),
            closest,
        });
    }
    Ok(found)
}

/// What refine scores a strategy that does not fit the devices' memory: more than any step a
/// strategy that fits can take, and more the further it is over ([`over_memory`]).
const UNFIT_SECONDS: f64 = 1e3;

/// How far `configs` are over the memory of `machine`'s devices: the bytes over capacity summed
/// over the devices, as a fraction of one device's capacity (0 where they fit).
fn over_memory(
    graph: &legion_ops::Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
) -> f64 {
    if !machine.has_own_memory() {
        return 0.0;
    }
    let need = crate::memory::per_device_at(graph, configs, machine.nodes(), machine.precision());
    crate::memory::over_capacity(machine, &need)
        .iter()
        .map(|(d, capacity)| (d.bytes - capacity) as f64 / *capacity as f64)
        .sum()
}

/// `kind`'s strategy with the devices' memory left out: Eq. 1's optimum, or a fixed strategy.
fn unconstrained(
    kind: SearchKind,
    tables: &CostTables,
) -> Result<Vec<ParallelConfig>, SearchError> {
    let (graph, machine) = (tables.model().graph(), tables.model().machine());
    Ok(match kind {
        SearchKind::OptCnn => tables.configs(&optcnn(tables)?.indices),
        SearchKind::Data => data_parallel(graph, machine),
        SearchKind::Model => model_parallel(graph, machine),
        SearchKind::Owt => one_weird_trick(graph, machine),
        SearchKind::Refine | SearchKind::Exhaustive => {
            unreachable!("{kind} is no refine start")
        }
        // the seed planners' plans in the tables' space, as `find_with` maps them
        seed => {
            seed.planner()
                .plan(graph, machine, tables.search_space())
                .configs
        }
    })
}

/// [`SearchError::DoesNotFit`] for `configs`, which must not fit.
fn does_not_fit(
    what: String,
    graph: &legion_ops::Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
) -> SearchError {
    let closest = check_fits(graph, machine, configs).expect_err("a strategy that does not fit");
    SearchError::DoesNotFit { what, closest }
}

/// How many times [`optcnn_within_memory`] raises the memory penalty, ×4 each time, and then
/// halves the gap (in log scale) between the last weight that did not fit and the first that did.
const PENALTY_ROUNDS: usize = 10;
const PENALTY_BISECTIONS: usize = 6;

/// Algorithm 1 under the devices' memory. Where Eq. 1's optimum fits, it is the result. Where it
/// does not, memory gets a price: each config's node cost gains `weight` seconds per byte of its
/// largest tile (a Lagrangian penalty on a per-layer proxy: what a tile keeps of its own, while
/// [`check_fits`] judges the whole count, received and staged buffers included), starting at one step's cost per device's worth of memory,
/// then ×4 up until an optimum of the penalised Eq. 1 fits (or ÷4 down while one still does);
/// the weight is then bisected between the last that did not fit and the lowest that did, and the
/// cheapest (under Eq. 1) strategy that fit is the result. It fits, but is not necessarily the cheapest that does (the
/// exhaustive search finds that one on small graphs). None fitting after [`PENALTY_ROUNDS`]: the
/// error names the closest. The flag says whether the result is a penalised search's.
fn optcnn_within_memory(
    tables: &CostTables,
) -> Result<(OptCnnResult, Vec<ParallelConfig>, bool), SearchError> {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let r = optcnn(tables)?;
    let configs = tables.configs(&r.indices);
    let Err(mut closest) = check_fits(graph, machine, &configs) else {
        return Ok((r, configs, false));
    };
    let bytes = tables.largest_tile_bytes();
    let mut best: Option<(f64, OptCnnResult, Vec<ParallelConfig>)> = None;
    // the optimum under `weight`, kept when it fits and is the cheapest so far; whether it fit
    let attempt = |weight: f64,
                   best: &mut Option<(f64, OptCnnResult, Vec<ParallelConfig>)>,
                   closest: &mut DoesNotFit|
     -> Result<bool, SearchError> {
        let r = optcnn(&tables.with_node_penalty(weight, &bytes))?;
        let configs = tables.configs(&r.indices);
        match check_fits(graph, machine, &configs) {
            Ok(()) => {
                let cost = model.total(&configs);
                if best.as_ref().is_none_or(|(b, _, _)| cost < *b) {
                    *best = Some((cost, r, configs));
                }
                Ok(true)
            }
            Err(e) => {
                if e.needs - e.capacity < closest.needs - closest.capacity {
                    *closest = e;
                }
                Ok(false)
            }
        }
    };
    // the first weight prices a device's worth of memory at one step; from there ×4 up until an
    // optimum fits, or ÷4 down while one still does, then bisect between the last weight that did
    // not fit and the lowest that did
    let first = r.cost / closest.capacity.max(1) as f64;
    let (mut too_low, mut high) = (0.0, first);
    if attempt(first, &mut best, &mut closest)? {
        for _ in 1..PENALTY_ROUNDS {
            let lower = high / 4.0;
            if !attempt(lower, &mut best, &mut closest)? {
                too_low = lower;
                break;
            }
            high = lower;
        }
    } else {
        let mut fitting = None;
        let mut weight = first;
        for _ in 1..PENALTY_ROUNDS {
            too_low = weight;
            weight *= 4.0;
            if attempt(weight, &mut best, &mut closest)? {
                fitting = Some(weight);
                break;
            }
        }
        let Some(weight) = fitting else {
            return Err(SearchError::DoesNotFit {
                what: "optcnn found no strategy that fits the devices' memory; the closest".into(),
                closest,
            });
        };
        high = weight;
    }
    if too_low > 0.0 {
        for _ in 0..PENALTY_BISECTIONS {
            let mid = (too_low * high).sqrt();
            if attempt(mid, &mut best, &mut closest)? {
                high = mid;
            } else {
                too_low = mid;
            }
        }
    }
    let (_, r, configs) = best.expect("a weight that fit");
    Ok((r, configs, true))
}

/// Bytes `configs` move under the seed planner `kind`'s own accounting (its paper's objective),
/// to show beside Eq. 1; `None` for the searches of our own space, whose objective is Eq. 1.
pub fn native_bytes(
    kind: SearchKind,
    graph: &legion_ops::Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
) -> Option<f64> {
    kind.seed()
        .map(|planner| planner.native_bytes(graph, machine, configs))
}

/// Runs one search and prices its strategy with Eq. 1, term by term (a refinement with
/// [`RefineOptions::default`]).
pub fn run(
    kind: SearchKind,
    tables: &CostTables,
    budget: u64,
) -> Result<(Found, CostBreakdown), SearchError> {
    let found = find(kind, tables, budget)?;
    let cost = tables.model().evaluate(&found.configs);
    Ok((found, cost))
}

#[cfg(test)]
mod tests {
    use super::tiling::tests::random_graph;
    use super::*;
    use crate::cost::CostModel;
    use crate::memory::per_device;
    use crate::provider::RooflineCost;
    use legion_ops::op::Dense;
    use legion_ops::{GraphBuilder, LayerId, Shape};
    use proptest::prelude::*;

    /// Three wide dense layers over a batch of 2048: on 4 P100s data parallelism replicates their
    /// weights with gradient terms and momentum on every device; Eq. 1's optimum splits their
    /// channels and keeps less, though every device also receives the whole input of each.
    fn wide_mlp() -> legion_ops::Graph {
        let mut m = GraphBuilder::new("wide");
        let x = m.input("x", Shape::nc(2048, 2048)).unwrap();
        let x = m.dense("fc1", x, Dense::new(2048).relu()).unwrap();
        let x = m.dense("fc2", x, Dense::new(2048).relu()).unwrap();
        let x = m.dense("fc3", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    /// Eq. 1 of the cheapest strategy that fits, by an exhaustive search with no incumbent
    /// (infinite when none fits).
    fn exhaustive_from_scratch(tables: &CostTables, budget: u64) -> Result<f64, SearchError> {
        let model = tables.model();
        let fits = |indices: &[usize]| {
            check_fits(model.graph(), model.machine(), &tables.configs(indices)).is_ok()
        };
        let r = exhaustive_where(tables, budget, &fits, None)?;
        Ok(match r.cost.is_finite() {
            true => model.total(&tables.configs(&r.indices)),
            false => f64::INFINITY,
        })
    }

    fn peak(g: &legion_ops::Graph, configs: &[ParallelConfig], devices: usize) -> u64 {
        per_device(g, configs, devices)
            .iter()
            .map(|d| d.bytes)
            .max()
            .unwrap()
    }

    /// 4 P100s limited to 0.9 of what data parallelism keeps on a device: it is refused, naming
    /// the device and the layer; optcnn, refine and the exhaustive search return strategies that
    /// fit, the exhaustive one the cheapest of them. Limited to 0.9 of what Eq. 1's optimum keeps,
    /// where that optimum does not fit: refine walks from the starts that do not fit to a
    /// strategy that does, and the exhaustive search finds the cheapest (optcnn's penalty sees
    /// per-layer tiles only, not where layers share devices: it finds one or says it found
    /// none). At 1 MiB nothing fits and optcnn says so.
    #[test]
    fn under_a_memory_limit_searches_return_strategies_that_fit_or_say_none_does() {
        let g = wide_mlp();
        let free = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&free);
        let free_model = CostModel::new(&g, &free, &provider);
        let data = find(SearchKind::Data, &CostTables::build(&free_model), 0).unwrap();
        let data_peak = peak(&g, &data.configs, 4);

        let gib = 0.9 * data_peak as f64 / (1u64 << 30) as f64;
        let limited = free.clone().with_device_memory_gib(gib).unwrap();
        let capacity = limited.device(0).memory_bytes().unwrap();
        let provider = RooflineCost::new(&limited);
        let model = CostModel::new(&g, &limited, &provider);
        let tables = CostTables::build(&model);
        let e = find(SearchKind::Data, &tables, 0).unwrap_err();
        let SearchError::DoesNotFit { closest, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!((closest.needs, closest.capacity), (data_peak, capacity));
        let message = e.to_string();
        assert!(
            message.starts_with("the data strategy does not fit the devices' memory: device ")
                && message.contains("layer 'fc"),
            "{message}"
        );
        let mut costs = Vec::new();
        for kind in [
            SearchKind::OptCnn,
            SearchKind::Exhaustive,
            SearchKind::Refine,
        ] {
            let found = find(kind, &tables, DEFAULT_BUDGET).unwrap();
            assert!(peak(&g, &found.configs, 4) <= capacity, "{kind}");
            costs.push(model.total(&found.configs));
        }
        // started from optcnn's strategy, the exhaustive search cannot be dearer than it: hold
        // it to the search from scratch
        let exact = exhaustive_from_scratch(&tables, DEFAULT_BUDGET).unwrap();
        assert!(
            (costs[1] - exact).abs() <= 1e-12 * exact && exact <= costs[0] * (1.0 + 1e-12),
            "the exhaustive search is exact: {costs:?}, from scratch {exact}"
        );

        let optimum = find(SearchKind::OptCnn, &CostTables::build(&free_model), 0).unwrap();
        let gib = 0.9 * peak(&g, &optimum.configs, 4) as f64 / (1u64 << 30) as f64;
        let tight = free.clone().with_device_memory_gib(gib).unwrap();
        let capacity = tight.device(0).memory_bytes().unwrap();
        let provider = RooflineCost::new(&tight);
        let model = CostModel::new(&g, &tight, &provider);
        let tables = CostTables::build(&model);
        assert!(check_fits(&g, &tight, &optimum.configs).is_err());
        let refined = find(SearchKind::Refine, &tables, DEFAULT_BUDGET).unwrap();
        let exhaustive = find(SearchKind::Exhaustive, &tables, DEFAULT_BUDGET).unwrap();
        for found in [&refined, &exhaustive] {
            assert!(peak(&g, &found.configs, 4) <= capacity);
        }
        let exact = exhaustive_from_scratch(&tables, DEFAULT_BUDGET).unwrap();
        let (refine_eq1, exhaustive_eq1) = (
            model.total(&refined.configs),
            model.total(&exhaustive.configs),
        );
        assert!((exhaustive_eq1 - exact).abs() <= 1e-12 * exact);
        assert!(
            exact <= refine_eq1 * (1.0 + 1e-12),
            "{exact} vs {refine_eq1}"
        );
        match find(SearchKind::OptCnn, &tables, DEFAULT_BUDGET) {
            Ok(found) => assert!(peak(&g, &found.configs, 4) <= capacity),
            Err(e) => assert!(matches!(e, SearchError::DoesNotFit { .. }), "{e}"),
        }

        let tiny = free.with_device_memory_gib(1.0 / 1024.0).unwrap();
        let provider = RooflineCost::new(&tiny);
        let model = CostModel::new(&g, &tiny, &provider);
        let tables = CostTables::build(&model);
        let e = find(SearchKind::OptCnn, &tables, DEFAULT_BUDGET).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "optcnn found no strategy that fits the devices' memory; the closest: device "
            ),
            "{e}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Every seed planner returns one config per layer, each in its layer's config space (in
        /// OptCNN's space and in the one with reduction splits), the same every time, priced
        /// finitely by Eq. 1 and by its own count; on random small graphs and device counts,
        /// powers of two or not.
        #[test]
        fn seed_planners_return_valid_deterministic_strategies(
            seed in 0u64..1_000_000, devices in 1usize..=20, reductions: bool,
        ) {
            let g = random_graph(seed);
            let machine = MachineModel::preset(&format!("local-cpu:{devices}")).unwrap();
            let provider = RooflineCost::new(&machine);
            let model = CostModel::new(&g, &machine, &provider);
            let space = match reductions {
                true => SearchSpace::WithReductions,
                false => SearchSpace::Paper,
            };
            let tables = CostTables::build_in(&model, space);
            for kind in SearchKind::SEEDS {
                let found = find(kind, &tables, 0).unwrap();
                prop_assert_eq!(found.configs.len(), g.layers().len());
                for (i, config) in found.configs.iter().enumerate() {
                    prop_assert!(
                        tables.space(LayerId(i)).index_of(config).is_some(),
                        "{} gave layer {} ({:?}) {}", kind, g.layers()[i].name,
                        g.layers()[i].shape, config.describe()
                    );
                }
                prop_assert_eq!(&find(kind, &tables, 0).unwrap(), &found);
                prop_assert!(found.lossy.is_some());
                let native = native_bytes(kind, &g, &machine, &found.configs).unwrap();
                prop_assert!(native.is_finite() && native >= 0.0);
                prop_assert!(found.native_bytes.is_some_and(|b| b.is_finite() && b >= 0.0));
                prop_assert!(model.evaluate(&found.configs).total.is_finite());
            }
        }
    }

    /// Refine starts from a strategy another search found before it instead of searching again:
    /// given data parallelism as optcnn's, the two starts are one strategy, simulated once; and
    /// from what other searches found (the exhaustive one's).
    #[test]
    fn refine_starts_from_strategies_found_earlier() {
        let g = super::tiling::tests::small_cnn(8, 4, 8);
        let machine = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&machine);
        let model = CostModel::new(&g, &machine, &provider);
        let tables = CostTables::build(&model);
        let options = SearchOptions {
            exhaustive_budget: 0,
            refine: RefineOptions {
                budget: 0,
                seed: 1,
                work: None,
            },
            space: Default::default(),
        };
        let refined = |earlier: &[(SearchKind, &[ParallelConfig])]| {
            find_with(SearchKind::Refine, &tables, &options, earlier)
                .unwrap()
                .refined
                .unwrap()
        };
        // The distinct strategies among the starts, optcnn's replaced by `optcnn` where given: a
        // budget of 0 simulates each once, and nothing else.
        let distinct = |optcnn: Option<&[ParallelConfig]>| {
            let mut seen: Vec<Vec<ParallelConfig>> = Vec::new();
            for kind in REFINE_STARTS {
                let configs = match (kind, optcnn) {
                    (SearchKind::OptCnn, Some(given)) => given.to_vec(),
                    _ => find(kind, &tables, 0).unwrap().configs,
                };
                if !seen.contains(&configs) {
                    seen.push(configs);
                }
            }
            seen.len() as u64
        };
        assert_eq!(refined(&[]).simulations, distinct(None));
        let data = data_parallel(&g, &machine);
        let reused = refined(&[(SearchKind::OptCnn, &data)]);
        assert_eq!(reused.simulations, distinct(Some(&data)));
        assert_ne!(distinct(Some(&data)), distinct(None), "the test must tell");
        // a strategy another search found (here: data parallelism but the last layer on one
        // device, which no start is) is a start too
        let mut other = data.clone();
        *other.last_mut().unwrap() = ParallelConfig::serial(0);
        assert!(
            REFINE_STARTS
                .iter()
                .all(|&k| find(k, &tables, 0).unwrap().configs != other)
        );
        let with_it = refined(&[(SearchKind::Exhaustive, &other)]);
        assert_eq!(with_it.simulations, distinct(None) + 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Under a memory limit from a tenth to all of what data parallelism keeps on a device,
        /// every search either returns a strategy that fits or says none does; the exhaustive
        /// search equals the same search from scratch (no incumbent), which is never dearer under
        /// Eq. 1 than optcnn.
        #[test]
        fn every_search_under_a_memory_limit_fits_or_says_so(
            seed in 0u64..1_000_000, fraction in 0.1f64..1.0,
        ) {
            let g = random_graph(seed);
            let free = MachineModel::preset("paper:4").unwrap();
            let data_peak = peak(&g, &data_parallel(&g, &free), 4);
            let gib = fraction * data_peak as f64 / (1u64 << 30) as f64;
            let machine = free.with_device_memory_gib(gib).unwrap();
            let capacity = machine.device(0).memory_bytes().unwrap();
            let provider = RooflineCost::new(&machine);
            let model = CostModel::new(&g, &machine, &provider);
            let tables = CostTables::build(&model);
            let mut eq1 = std::collections::HashMap::new();
            for kind in SearchKind::every() {
                let options = SearchOptions {
                    exhaustive_budget: 300_000,
                    refine: RefineOptions { budget: 10, ..RefineOptions::default() },
                    space: Default::default(),
                };
                match find_with(kind, &tables, &options, &[]) {
                    Ok(found) => {
                        prop_assert!(peak(&g, &found.configs, 4) <= capacity, "{}", kind);
                        eq1.insert(kind, model.total(&found.configs));
                    }
                    Err(SearchError::DoesNotFit { closest, .. }) => {
                        prop_assert!(closest.needs > closest.capacity, "{}", kind);
                    }
                    Err(SearchError::BudgetExceeded { .. }) => {}
                }
            }
            if let (Some(seeded), Ok(exact)) = (
                eq1.get(&SearchKind::Exhaustive),
                exhaustive_from_scratch(&tables, 300_000),
            ) {
                prop_assert!((seeded - exact).abs() <= 1e-12 * exact, "{} vs {}", seeded, exact);
                if let Some(opt) = eq1.get(&SearchKind::OptCnn) {
                    prop_assert!(exact <= opt * (1.0 + 1e-12), "{} vs {}", exact, opt);
                }
            }
        }
    }

    /// The seed kinds are those with a planner, in the order of [`SearchKind::SEEDS`], and each
    /// planner's name parses back to its kind.
    #[test]
    fn every_seed_kind_and_only_they_have_a_planner() {
        let planned: Vec<SearchKind> = SearchKind::every().filter(|k| k.seed().is_some()).collect();
        assert_eq!(planned, SearchKind::SEEDS);
        for kind in SearchKind::SEEDS {
            let planner = kind.seed().unwrap();
            assert_eq!(SearchKind::parse(planner.name()), Some(kind));
            assert_eq!(kind.lossy(), Some(planner.lossy()));
        }
        assert!(REFINE_STARTS.ends_with(&SearchKind::SEEDS));
    }

    #[test]
    fn seed_names_parse() {
        for kind in SearchKind::SEEDS {
            assert_eq!(SearchKind::parse(kind.name()), Some(kind));
        }
        assert_eq!(SearchKind::parse("tofu"), Some(SearchKind::Tofu));
        assert_eq!(SearchKind::parse("refine"), Some(SearchKind::Refine));
    }
}
