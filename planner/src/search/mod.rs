//! Strategy searches: OptCNN's Algorithm 1, the exhaustive baseline and the three fixed strategies
//! the paper compares with. Each returns per-layer configs; [`run`] prices them with Eq. 1.

mod data;
mod exhaustive;
pub mod hypar;
mod min_plus;
mod model;
mod optcnn;
mod owt;
mod relaxation;
pub mod soybean;
pub mod tiling;
pub mod tofu;

pub use data::data_parallel;
pub use exhaustive::{DEFAULT_BUDGET, ExhaustiveResult, SIDE_BY_SIDE_BUDGET, exhaustive};
pub use model::model_parallel;
pub use optcnn::{OptCnnResult, RESIDUAL_BUDGET, optcnn};
pub use owt::one_weird_trick;

use crate::config::ParallelConfig;
use crate::cost::CostBreakdown;
use crate::tables::CostTables;
use std::fmt;

/// The searches `legion-rs plan --search` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SearchKind {
    OptCnn,
    Exhaustive,
    Data,
    Model,
    Owt,
}

impl SearchKind {
    pub const ALL: [SearchKind; 5] = [
        SearchKind::OptCnn,
        SearchKind::Exhaustive,
        SearchKind::Data,
        SearchKind::Model,
        SearchKind::Owt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SearchKind::OptCnn => "optcnn",
            SearchKind::Exhaustive => "exhaustive",
            SearchKind::Data => "data",
            SearchKind::Model => "model",
            SearchKind::Owt => "owt",
        }
    }

    pub fn parse(name: &str) -> Option<SearchKind> {
        SearchKind::ALL.into_iter().find(|k| k.name() == name)
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
}

/// Runs one search. `budget` caps the exhaustive search.
pub fn find(kind: SearchKind, tables: &CostTables, budget: u64) -> Result<Found, SearchError> {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let mut found = Found {
        configs: Vec::new(),
        residual_nodes: None,
        tried: None,
    };
    found.configs = match kind {
        SearchKind::OptCnn => {
            let r = optcnn(tables)?;
            found.residual_nodes = Some(r.residual_nodes);
            tables.configs(&r.indices)
        }
        SearchKind::Exhaustive => {
            let r = exhaustive(tables, budget)?;
            found.tried = Some(r.tried);
            tables.configs(&r.indices)
        }
        SearchKind::Data => data_parallel(graph, machine),
        SearchKind::Model => model_parallel(graph, machine),
        SearchKind::Owt => one_weird_trick(graph, machine),
    };
    Ok(found)
}

/// Runs one search and prices its strategy with Eq. 1, term by term.
pub fn run(
    kind: SearchKind,
    tables: &CostTables,
    budget: u64,
) -> Result<(Found, CostBreakdown), SearchError> {
    let found = find(kind, tables, budget)?;
    let cost = tables.model().evaluate(&found.configs);
    Ok((found, cost))
}
