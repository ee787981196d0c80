//! The exact baseline: a depth-first search over every strategy (layers in topological order), with
//! branch-and-bound pruning that keeps it exact, and a budget on the partial strategies it tries.
//! It exists to check [`super::optcnn`] on graphs small enough to enumerate.

use super::SearchError;
use crate::tables::CostTables;
use legion_ops::LayerId;
use std::collections::HashMap;
use std::rc::Rc;

/// What the exhaustive search found.
#[derive(Clone, Debug, PartialEq)]
pub struct ExhaustiveResult {
    /// Per layer (by id), the index of its config in [`CostTables::space`].
    pub indices: Vec<usize>,
    /// Eq. 1 of the result, summed from the tables.
    pub cost: f64,
    /// Partial strategies tried.
    pub tried: u64,
}

/// Which complete strategies (per layer, config indices) an exhaustive search may return.
pub type Accept<'f> = dyn Fn(&[usize]) -> bool + 'f;

/// An edge into a node: (source node, its table `[c_src][c_node]`).
pub(crate) type InEdge = (usize, Rc<Vec<f64>>);

/// Default cap on the partial strategies the exhaustive search tries.
pub const DEFAULT_BUDGET: u64 = 50_000_000;

/// Default cap when the exhaustive search runs beside the others (`plan --search all`): a side by
/// side table must come back in seconds, and [`DEFAULT_BUDGET`] takes minutes on Inception-v3.
pub const SIDE_BY_SIDE_BUDGET: u64 = 100_000;

/// Searches every strategy of the tables' model; fails when more than `budget` partial strategies
/// would be tried.
pub fn exhaustive(tables: &CostTables, budget: u64) -> Result<ExhaustiveResult, SearchError> {
    exhaustive_where(tables, budget, &|_| true, None)
}

/// [`exhaustive`] over the strategies `accept` takes (per layer, config indices): the exact
/// optimum among them, `cost` infinite when there is none.
///
/// `incumbent`, a strategy `accept` takes, starts the search as the best so far: only strategies
/// strictly cheaper are then visited to the end and offered to `accept`. Without one, while no
/// leaf is accepted nothing is pruned and every leaf reached is offered, which is slow where
/// `accept` is (a memory check of the whole strategy).
pub fn exhaustive_where(
    tables: &CostTables,
    budget: u64,
    accept: &Accept<'_>,
    incumbent: Option<&[usize]>,
) -> Result<ExhaustiveResult, SearchError> {
    let n = tables.num_layers();
    let mut by_class: HashMap<usize, Rc<Vec<f64>>> = HashMap::new();
    let mut incoming: Vec<Vec<InEdge>> = vec![Vec::new(); n];
    for (i, e) in tables.edges().iter().enumerate() {
        let table = by_class
            .entry(tables.edge_class(i))
            .or_insert_with(|| Rc::new(tables.edge_table(i)))
            .clone();
        incoming[e.dst.0].push((e.src.0, table));
    }
    let costs: Vec<&[f64]> = (0..n).map(|l| tables.node_cost(LayerId(l))).collect();
    let sizes: Vec<usize> = (0..n).map(|l| tables.space(LayerId(l)).len()).collect();
    let mut dfs = Dfs::new(&costs, &sizes, &incoming, budget);
    dfs.accept = Some(accept);
    if let Some(start) = incumbent {
        debug_assert!(accept(start), "the incumbent is a strategy `accept` takes");
        dfs.best = dfs.cost_of(start);
        dfs.best_choice = start.to_vec();
    }
    dfs.visit(0, 0.0)?;
    Ok(ExhaustiveResult {
        indices: dfs.best_choice,
        cost: dfs.best,
        tried: dfs.tried,
    })
}

/// Exact minimum over all assignments of a small DAG: node costs, and per node its in-edges as
/// (earlier node, table `[c_src][c_node]`). Depth-first, configs cheapest first, pruned by a lower
/// bound on the nodes still to assign; `budget` caps the partial assignments tried.
pub(crate) fn enumerate(
    costs: &[&[f64]],
    sizes: &[usize],
    incoming: &[Vec<InEdge>],
    budget: u64,
) -> Result<(Vec<usize>, f64), SearchError> {
    let mut search = Dfs::new(costs, sizes, incoming, budget);
    search.visit(0, 0.0)?;
    Ok((search.best_choice, search.best))
}

/// The cost of a complete assignment: per node in order, its cost plus its in-edges' entries
/// (the order the depth-first search adds them in, so that equal strategies cost equal bits).
pub(crate) fn strategy_cost(
    costs: &[&[f64]],
    sizes: &[usize],
    incoming: &[Vec<InEdge>],
    choice: &[usize],
) -> f64 {
    (0..costs.len()).fold(0.0, |so_far, p| {
        let size = sizes[p];
        let mut step = costs[p][choice[p]];
        for (src, table) in &incoming[p] {
            step += table[choice[*src] * size + choice[p]];
        }
        so_far + step
    })
}

/// What [`enumerate_from`] found.
pub(crate) struct Enumerated {
    pub(crate) choice: Vec<usize>,
    pub(crate) cost: f64,
    /// Whether every strategy was visited or pruned (`choice` is then optimal), rather than the
    /// budget running out first (`choice` is then the best seen).
    pub(crate) complete: bool,
}

/// [`enumerate`] started from `incumbent` (a complete assignment and its cost), visiting only
/// strictly cheaper ones to the end; where the budget runs out, the best assignment seen. `tick`
/// hears the count of partial strategies tried every [`TICK`] of them.
pub(crate) fn enumerate_from<'a>(
    costs: &'a [&'a [f64]],
    sizes: &'a [usize],
    incoming: &'a [Vec<InEdge>],
    budget: u64,
    incumbent: Option<(&[usize], f64)>,
    tick: &'a dyn Fn(u64),
) -> Enumerated {
    let mut search = Dfs::new(costs, sizes, incoming, budget);
    search.tick = Some(tick);
    if let Some((choice, cost)) = incumbent {
        search.best = cost;
        search.best_choice = choice.to_vec();
    }
    let complete = search.visit(0, 0.0).is_ok();
    Enumerated {
        choice: search.best_choice,
        cost: search.best,
        complete,
    }
}

struct Dfs<'a> {
    costs: &'a [&'a [f64]],
    sizes: &'a [usize],
    incoming: &'a [Vec<InEdge>],
    rest: Vec<f64>,
    choice: Vec<usize>,
    best_choice: Vec<usize>,
    best: f64,
    tried: u64,
    budget: u64,
    /// Which complete strategies count (all where `None`).
    accept: Option<&'a Accept<'a>>,
    /// Told the count tried every [`TICK`] partial strategies.
    tick: Option<&'a dyn Fn(u64)>,
}

/// How many partial strategies [`enumerate_from`]'s `tick` hears about at a time.
const TICK: u64 = 1 << 16;

impl<'a> Dfs<'a> {
    fn new(
        costs: &'a [&'a [f64]],
        sizes: &'a [usize],
        incoming: &'a [Vec<InEdge>],
        budget: u64,
    ) -> Dfs<'a> {
        let n = costs.len();
        // A node costs at least, over its configs, its own cost plus each in-edge's cheapest entry
        // into that config; the nodes still to assign cost at least the sum of those.
        let mut rest = vec![0.0; n + 1];
        for p in (0..n).rev() {
            let size = sizes[p];
            let cheapest = (0..size)
                .map(|c| {
                    let into: f64 = incoming[p]
                        .iter()
                        .map(|(src, table)| {
                            (0..sizes[*src])
                                .map(|s| table[s * size + c])
                                .fold(f64::INFINITY, f64::min)
                        })
                        .sum();
                    costs[p][c] + into
                })
                .fold(f64::INFINITY, f64::min);
            rest[p] = rest[p + 1] + cheapest;
        }
        Dfs {
            costs,
            sizes,
            incoming,
            rest,
            choice: vec![0; n],
            best_choice: vec![0; n],
            best: f64::INFINITY,
            tried: 0,
            budget,
            accept: None,
            tick: None,
        }
    }

    /// The cost of a complete strategy, summed as [`Self::visit`] sums it.
    fn cost_of(&self, choice: &[usize]) -> f64 {
        strategy_cost(self.costs, self.sizes, self.incoming, choice)
    }

    fn visit(&mut self, p: usize, so_far: f64) -> Result<(), SearchError> {
        if p == self.costs.len() {
            if so_far < self.best && self.accept.is_none_or(|accept| accept(&self.choice)) {
                self.best = so_far;
                self.best_choice.clone_from(&self.choice);
            }
            return Ok(());
        }
        let size = self.sizes[p];
        let mut steps: Vec<(f64, usize)> = (0..size)
            .map(|c| {
                let mut t = self.costs[p][c];
                for (src, table) in &self.incoming[p] {
                    t += table[self.choice[*src] * size + c];
                }
                (t, c)
            })
            .collect();
        steps.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (step, c) in steps {
            let total = so_far + step;
            if total + self.rest[p + 1] >= self.best {
                break;
            }
            self.tried += 1;
            if let Some(tick) = self.tick
                && self.tried.is_multiple_of(TICK)
            {
                tick(self.tried);
            }
            if self.tried > self.budget {
                return Err(SearchError::BudgetExceeded {
                    budget: self.budget,
                });
            }
            self.choice[p] = c;
            self.visit(p + 1, total)?;
        }
        Ok(())
    }
}
