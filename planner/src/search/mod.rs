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
pub use exhaustive::{DEFAULT_BUDGET, ExhaustiveResult, SIDE_BY_SIDE_BUDGET, exhaustive};
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
use crate::tables::CostTables;
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

    /// What mapping this search's plans into our configuration space loses (the seed planners'
    /// reduction splits above all), for the CLI to print beside its results; `None` for the
    /// searches of our own space.
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
}

impl SearchOptions {
    /// `exhaustive_budget` for the exhaustive search, the default refinement.
    pub fn with_budget(exhaustive_budget: u64) -> SearchOptions {
        SearchOptions {
            exhaustive_budget,
            refine: RefineOptions::default(),
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
            let r = optcnn(tables)?;
            found.residual_nodes = Some(r.residual_nodes);
            tables.configs(&r.indices)
        }
        SearchKind::Refine => {
            let mut starts: Vec<(SearchKind, Vec<ParallelConfig>)> = Vec::new();
            for start in REFINE_STARTS {
                let configs = match earlier.iter().find(|(k, _)| *k == start) {
                    Some((_, configs)) => configs.to_vec(),
                    None => find_with(start, tables, options, &[])?.configs,
                };
                starts.push((start, configs));
            }
            let starts: Vec<(SearchKind, &[ParallelConfig])> =
                starts.iter().map(|(k, c)| (*k, c.as_slice())).collect();
            let refined = refine(tables, &starts, &options.refine);
            found.refined = Some(refined.report);
            refined.configs
        }
        SearchKind::Exhaustive => {
            let r = exhaustive(tables, budget)?;
            found.tried = Some(r.tried);
            tables.configs(&r.indices)
        }
        SearchKind::Data => data_parallel(graph, machine),
        SearchKind::Model => model_parallel(graph, machine),
        SearchKind::Owt => one_weird_trick(graph, machine),
        SearchKind::Soybean => {
            let plan = soybean(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs
        }
        SearchKind::Tofu => {
            let plan = tofu(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs
        }
        SearchKind::Hypar => {
            let plan = hypar(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs
        }
        SearchKind::Spartan => {
            let plan = spartan(graph, machine);
            found.native_bytes = Some(plan.native_bytes);
            plan.configs
        }
    };
    Ok(found)
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
    use crate::provider::RooflineCost;
    use legion_ops::LayerId;
    use proptest::prelude::*;

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
            refine: RefineOptions { budget: 0, seed: 1 },
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

    #[test]
    fn seed_names_parse() {
        for kind in SearchKind::SEEDS {
            assert_eq!(SearchKind::parse(kind.name()), Some(kind));
        }
        assert_eq!(SearchKind::parse("tofu"), Some(SearchKind::Tofu));
        assert_eq!(SearchKind::parse("refine"), Some(SearchKind::Refine));
    }
}
