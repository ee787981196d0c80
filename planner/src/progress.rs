//! What a long plan reports while it runs: the phase it is in and how far along it is. The
//! planner only calls a [`Progress`]; the CLI draws it (a bar on a terminal, lines otherwise).

use std::fmt;

/// A phase of planning, in the order a plan goes through them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// t_c and t_s of every layer's configs (counted in layers).
    NodeCosts,
    /// OptCNN's node and edge eliminations, edge tables built as they are needed (counted in
    /// layers eliminated, of the graph's).
    Eliminations,
    /// The enumeration of a residual graph too large to be instant (counted in partial
    /// strategies, of the budget).
    Residual,
    /// The refinement's simulations (counted in simulations, of its budget).
    Refine,
    /// Real steps of the devices that time the tiles a search may choose (counted in
    /// strategies run).
    Measuring,
}

impl Phase {
    /// What the phase does, as a progress line says it.
    pub fn describe(self) -> &'static str {
        match self {
            Phase::NodeCosts => "pricing every layer's configs",
            Phase::Eliminations => "optcnn: eliminating layers",
            Phase::Residual => "optcnn: enumerating the residual graph",
            Phase::Refine => "refine: simulating moves",
            Phase::Measuring => "measuring op costs on the devices",
        }
    }

    /// The unit `done` and `total` count.
    pub fn unit(self) -> &'static str {
        match self {
            Phase::NodeCosts | Phase::Eliminations => "layers",
            Phase::Residual => "partial strategies",
            Phase::Refine => "simulations",
            Phase::Measuring => "strategies",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// Receives a plan's progress. Calls come often (at most one per unit of work) and from the
/// planning thread only; an implementation decides what to show and when.
pub trait Progress: Send + Sync {
    /// `done` of `total` units of `phase` are done (`done` ≤ `total`; a phase may end early).
    fn update(&self, phase: Phase, done: u64, total: u64);
}
