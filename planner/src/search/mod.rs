//! Strategy searches: OptCNN's Algorithm 1, the exhaustive baseline, the three fixed strategies
//! the paper compares with, a refinement of their strategies under the simulated step time
//! ([`refine`]), and four planners of other papers (SOYBEAN, Tofu, HyPar, Spartan),
//! each searching its own space under its own byte count ([`native_bytes`]) and mapped into ours,
//! with what the mapping loses in [`Found::lossy`]. Each returns per-layer configs; [`run`] prices
//! them with Eq. 1.

mod data;
mod exhaustive;
pub mod hypar;
mod min_plus;
mod model;
mod optcnn;
mod owt;
pub mod refine;
mod relaxation;
pub mod soybean;
pub mod spartan;
pub mod tiling;
pub mod tofu;

pub use data::data_parallel;
pub use exhaustive::{
    DEFAULT_BUDGET, ExhaustiveResult, SIDE_BY_SIDE_BUDGET, exhaustive, exhaustive_where,
};
pub use hypar::{HyparPlan, hypar, hypar_native_bytes};
pub use model::model_parallel;
pub use optcnn::{OptCnnResult, RESIDUAL_BUDGET, optcnn};
pub use owt::one_weird_trick;
pub use refine::{
    DEFAULT_REFINE_BUDGET, DEFAULT_REFINE_SEED, REFINE_STARTS, RefineOptions, RefineReport,
    Refined, refine,
};
pub use soybean::{SoybeanPlan, soybean, soybean_native_bytes};
pub use spartan::{SpartanPlan, spartan, spartan_native_bytes};
pub use tofu::{TofuPlan, tofu, tofu_native_bytes};

use crate::config::ParallelConfig;
use crate::cost::CostBreakdown;
use crate::machine::MachineModel;
use crate::memory::{DoesNotFit, check_fits};
use crate::simulate::simulated_step_time;
use crate::tables::{CostTables, SearchSpace};
use std::fmt;

/// Every search [`find`] runs; `legion-rs plan --search` offers [`SearchKind::ALL`].
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
            SearchKind::Soybean => "soybean",
            SearchKind::Tofu => "tofu",
            SearchKind::Hypar => "hypar",
            SearchKind::Spartan => "spartan",
        }
    }

    /// What mapping this search's plans into our configuration space loses (in OptCNN's space,
    /// the seed planners' reduction splits above all), for the CLI to print beside its results;
    /// `None` for the searches of our own space.
    pub fn lossy(self) -> Option<&'static str> {
        match self {
            SearchKind::Soybean => Some(soybean::LOSSY),
            SearchKind::Tofu => Some(tofu::LOSSY),
            SearchKind::Hypar => Some(hypar::LOSSY),
            SearchKind::Spartan => Some(spartan::LOSSY),
            _ => None,
        }
    }

    pub fn parse(name: &str) -> Option<SearchKind> {
        SearchKind::ALL
            .into_iter()
            .chain(SearchKind::SEEDS)
            .find(|k| k.name() == name)
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
        tried: None,
        lossy: kind.lossy(),
        native_bytes: None,
        refined: None,
    };
    found.configs = match kind {
        SearchKind::OptCnn => {
            let (r, configs) = optcnn_within_memory(tables)?;
            found.residual_nodes = Some(r.residual_nodes);
            configs
        }
        SearchKind::Refine => {
            let mut starts: Vec<(SearchKind, Vec<ParallelConfig>)> = Vec::new();
            let mut closest: Option<SearchError> = None;
            for start in REFINE_STARTS {
                let configs = match earlier.iter().find(|(k, _)| *k == start) {
                    Some((_, configs)) => {
                        debug_assert!(
                            check_fits(graph, machine, configs).is_ok(),
                            "earlier strategies come from searches that succeeded"
                        );
                        configs.to_vec()
                    }
                    // a start that does not fit the devices' memory is no start
                    None => match find_with(start, tables, options, &[]) {
                        Ok(f) => f.configs,
                        Err(e @ SearchError::DoesNotFit { .. }) => {
                            closest.get_or_insert(e);
                            continue;
                        }
                        Err(e) => return Err(e),
                    },
                };
                starts.push((start, configs));
            }
            if starts.is_empty() {
                let Some(SearchError::DoesNotFit { closest, .. }) = closest else {
                    unreachable!("every start failed to fit")
                };
                return Err(SearchError::DoesNotFit {
                    what: "refine has no start that fits the devices' memory; the closest".into(),
                    closest,
                });
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
            // every move is checked against the devices' memory: one that does not fit is never
            // faster
            let refined =
                refine::refine_by(
                    tables,
                    &starts,
                    &refine_options,
                    |configs| match check_fits(graph, machine, configs) {
                        Ok(()) => simulated_step_time(model, configs),
                        Err(_) => f64::INFINITY,
                    },
                );
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
                let incumbent = optcnn_within_memory(tables).ok().map(|(r, _)| r.indices);
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
        SearchKind::Soybean => {
            let plan = soybean(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs_in(graph, tables.search_space())
        }
        SearchKind::Tofu => {
            let plan = tofu(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs_in(graph, tables.search_space())
        }
        SearchKind::Hypar => {
            let plan = hypar(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs_in(graph, tables.search_space())
        }
        SearchKind::Spartan => {
            let plan = spartan(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs_in(graph, machine, tables.search_space())
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
/// error names the closest.
fn optcnn_within_memory(
    tables: &CostTables,
) -> Result<(OptCnnResult, Vec<ParallelConfig>), SearchError> {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let r = optcnn(tables)?;
    let configs = tables.configs(&r.indices);
    let Err(mut closest) = check_fits(graph, machine, &configs) else {
        return Ok((r, configs));
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
    Ok((r, configs))
}

/// Bytes `configs` move under the seed planner `kind`'s own accounting (its paper's objective),
/// to show beside Eq. 1; `None` for the searches of our own space, whose objective is Eq. 1.
pub fn native_bytes(
    kind: SearchKind,
    graph: &legion_ops::Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
) -> Option<f64> {
    match kind {
        SearchKind::Soybean => Some(soybean_native_bytes(graph, machine, configs)),
        SearchKind::Tofu => Some(tofu_native_bytes(graph, machine, configs)),
        SearchKind::Hypar => Some(hypar_native_bytes(graph, machine, configs)),
        SearchKind::Spartan => Some(spartan_native_bytes(graph, machine, configs)),
        _ => None,
    }
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
    /// weights with gradient terms and momentum on every device (~140 MiB each), Eq. 1's optimum
    /// splits their channels (~123 MiB: every device also receives the whole input of each).
    fn wide_mlp() -> legion_ops::Graph {
        let mut m = GraphBuilder::new("wide");
        let x = m.input("x", Shape::nc(2048, 2048)).unwrap();
        let x = m.dense("fc1", x, Dense::new(2048).relu()).unwrap();
        let x = m.dense("fc2", x, Dense::new(2048).relu()).unwrap();
        let x = m.dense("fc3", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
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
    /// fit, the exhaustive one the cheapest of them; at 1 MiB nothing fits and optcnn says so.
    #[test]
    fn under_a_memory_limit_searches_return_strategies_that_fit_or_say_none_does() {
        let g = wide_mlp();
        let free = MachineModel::preset("paper:4").unwrap();
        let provider = RooflineCost::new(&free);
        let model = CostModel::new(&g, &free, &provider);
        let tables = CostTables::build(&model);
        let data = find(SearchKind::Data, &tables, 0).unwrap();
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
        assert!(
            costs[1] <= costs[0],
            "the exhaustive search is exact: {costs:?}"
        );

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

        /// Every seed planner returns one config per layer, each in its layer's config space, the
        /// same every time, priced finitely by Eq. 1 and by its own count; on random small graphs
        /// and device counts, powers of two or not.
        #[test]
        fn seed_planners_return_valid_deterministic_strategies(
            seed in 0u64..1_000_000, devices in 1usize..=20,
        ) {
            let g = random_graph(seed);
            let machine = MachineModel::preset(&format!("local-cpu:{devices}")).unwrap();
            let provider = RooflineCost::new(&machine);
            let model = CostModel::new(&g, &machine, &provider);
            let tables = CostTables::build(&model);
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
    /// given data parallelism as optcnn's, the two starts are one strategy, simulated once.
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
        // a budget of 0 simulates the starts alone
        assert_eq!(refined(&[]).simulations, REFINE_STARTS.len() as u64);
        let data = data_parallel(&g, &machine);
        let reused = refined(&[(SearchKind::OptCnn, &data)]);
        assert_eq!(reused.simulations, REFINE_STARTS.len() as u64 - 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Under a memory limit from a tenth to all of what data parallelism keeps on a device,
        /// every search either returns a strategy that fits or says none does; the exhaustive
        /// search, exact, is never dearer under Eq. 1 than optcnn.
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
            for kind in SearchKind::ALL.into_iter().chain(SearchKind::SEEDS) {
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
            if let (Some(exact), Some(opt)) =
                (eq1.get(&SearchKind::Exhaustive), eq1.get(&SearchKind::OptCnn))
            {
                prop_assert!(*exact <= opt * (1.0 + 1e-12), "{} vs {}", exact, opt);
            }
        }
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
