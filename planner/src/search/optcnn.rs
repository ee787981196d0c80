//! OptCNN's Algorithm 1: node and edge eliminations until neither applies, the residual graph
//! enumerated (or, too dense for that, solved within a lower bound by [`residual`]), then the
//! eliminations undone in reverse to recover every eliminated layer's config.
//!
//! - Node elimination (Eq. 2): a layer `j` with one in-edge `(i, j)` and one out-edge `(j, k)` is
//!   replaced by an edge `(i, k)` with
//!   `t(c_i, c_k) = min_{c_j} [ t_c(j, c_j) + t_s(j, c_j) + t(i,j)(c_i, c_j) + t(j,k)(c_j, c_k) ]`,
//!   remembering the minimising `c_j`: a min-plus matrix product.
//! - Edge elimination (Eq. 3): two edges with the same ends become one whose table is their sum.
//!
//! Fork-joins (Inception's branches into a concat, ResNet's shortcut into an add) collapse into
//! single edges this way, so the zoo's models end with two layers: the input and the loss.
//! Any eliminable layer may go first (the result is optimal either way); the cheapest product
//! (`|C_i|·|C_j|·|C_k|`) goes first, which keeps the large config spaces out of most products.
//!
//! The search leaves out what no optimal strategy can use (branch and bound). The cost of a known
//! strategy (data parallelism, OWT or the relaxation's own, whichever is cheapest) bounds the
//! optimum from above; where that is far above the relaxation's lower bound (AlexNet at hundreds
//! of devices: 3×), the search first tries rising bounds from just above the lower bound, and
//! the first that a strategy comes in under is the optimum's ([`Relaxation::trial_bounds`]). A
//! layout-level relaxation ([`tree_marginals`]) bounds from below the cost of every strategy that
//! gives a layer a layout, or an edge a layout pair; a config whose bound (its layout's, plus its
//! own cost above its layout's cheapest config) reaches the known cost is dropped from its layer
//! before the eliminations start, and a layout pair whose bound does is never computed in its
//! edge's t_x table. At 16 devices that leaves 1.1% of Inception-v3's configs and 0.04% of its
//! layout pairs (AlexNet: 8% and 0.5%). Node
//! eliminations then run over the remaining configs only, and still skip the entries that cannot
//! beat the known cost less lower bounds of the rest of the graph (see [`min_plus`]). A config or
//! entry some optimal strategy uses is never cut, so it and every entry it was built from are
//! exact, with the same minimising `j` (among equal minima the first scanned, all of which are
//! optimal too), and the eliminations go in the same order as without a bound: the optimum and the
//! strategy are bit for bit the ones the unpruned search finds.

use super::SearchError;
use super::data::data_parallel;
use super::exhaustive::{InEdge, enumerate};
use super::min_plus::{Limit, column_groups, min, min_plus};
use super::owt::one_weird_trick;
use super::relaxation::{LayoutGraph, Marginals, tree_marginals};
use super::residual::{self, Residual};
use super::tiling::argmin;
use crate::progress::Phase;
use crate::tables::CostTables;
use crate::transfer_table::{ConfigSubset, EdgeGeometry, PairBuffers};
use legion_ops::LayerId;
use std::collections::HashMap;
use std::rc::Rc;

/// What Algorithm 1 found.
#[derive(Clone, Debug, PartialEq)]
pub struct OptCnnResult {
    /// Per layer (by id), the index of its config in [`CostTables::space`].
    pub indices: Vec<usize>,
    /// Eq. 1 of the result as the residual enumeration summed it from the tables.
    pub cost: f64,
    /// Layers left after the eliminations.
    pub residual_nodes: usize,
    pub node_eliminations: usize,
    pub edge_eliminations: usize,
    /// Whether `cost` is Eq. 1's optimum, or how far from it it may be.
    pub optimality: Optimality,
}

/// How far a search's strategy may be from Eq. 1's optimum.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimality {
    /// It is the optimum.
    Exact,
    /// The residual graph (over two layers) was not enumerated within the search's budget
    /// ([`RESIDUAL_BUDGET`] by default): the strategy is the best the local search (iterated
    /// conditional modes) and the enumeration found, and the optimum lies between `lower_bound`
    /// and its cost.
    Bounded {
        lower_bound: f64,
        /// The layers of the residual graph, whose configs were not proven optimal (the
        /// eliminated ones are optimal given theirs).
        layers: Vec<LayerId>,
    },
}

impl Optimality {
    /// How far above the lower bound `cost` may be, as a fraction of the bound (0 when exact).
    pub fn gap(&self, cost: f64) -> f64 {
        match self {
            Optimality::Exact => 0.0,
            Optimality::Bounded { lower_bound, .. } if *lower_bound > 0.0 => {
                ((cost - lower_bound) / lower_bound).max(0.0)
            }
            Optimality::Bounded { .. } => f64::INFINITY,
        }
    }
}

/// Partial strategies a residual graph of over two layers is enumerated within before its
/// strategy is taken from local search within a lower bound (a residual of two layers, the zoo's
/// but DenseNet's, is always enumerated whole: at most `|C_0|·(1 + |C_1|)` of them).
pub const RESIDUAL_BUDGET: u64 = 200_000;

/// Runs Algorithm 1 on the tables' model.
pub fn optcnn(tables: &CostTables) -> Result<OptCnnResult, SearchError> {
    optcnn_within(tables, RESIDUAL_BUDGET)
}

/// [`optcnn`] with a residual graph of over two layers enumerated within `budget` partial
/// strategies.
pub fn optcnn_within(tables: &CostTables, budget: u64) -> Result<OptCnnResult, SearchError> {
    let geometries = edge_geometries(tables);
    let known = known_strategy(tables, &geometries);
    let mut starts: Vec<Vec<usize>> = known.indices.iter().cloned().collect();
    if known.cost.is_finite() {
        let relaxation = Relaxation::new(tables, &geometries);
        let relaxed = relaxation.strategy(tables);
        let relaxed_cost = StrategyPricer::new(tables, &geometries).cost(&relaxed);
        if !starts.contains(&relaxed) {
            starts.push(relaxed.clone());
        }
        let known = known.or_cheaper(relaxed_cost, relaxed);
        let at_known = relaxation.prune(tables, known.cost);
        let kept = |pruned: &Option<Pruned>| pruned.as_ref().map_or(0, Pruned::layout_pairs);
        for (k, bound) in relaxation.trial_bounds(known.cost).into_iter().enumerate() {
            let pruned = relaxation.prune(tables, bound);
            if k == 0 && kept(&pruned) as f64 > TRIAL_SHARE * kept(&at_known) as f64 {
                break;
            }
            if pruned.is_none() {
                continue;
            }
            // below a trial bound, a strategy under it is the optimum
            match optcnn_below(tables, &geometries, pruned, starts.clone(), budget) {
                Ok(result) if result.cost + result.cost * BOUND_MARGIN < bound => {
                    return Ok(result);
                }
                _ => continue,
            }
        }
        if at_known.is_some() {
            match optcnn_below(tables, &geometries, at_known, starts.clone(), budget) {
                Ok(result) if result.cost <= known.cost => return Ok(result),
                // The bound cannot cut the optimum (see the module's notes); if rounding ever
                // did, the exact search is the answer.
                _ => {}
            }
        }
    }
    // unbounded, but the known strategies still start a residual's local search
    optcnn_below(tables, &geometries, None, starts, budget)
}

/// Per model edge class (its first edge's index), the edge's geometry.
fn edge_geometries(tables: &CostTables) -> HashMap<usize, EdgeGeometry> {
    let mut geometries = HashMap::new();
    for i in 0..tables.edges().len() {
        geometries
            .entry(tables.edge_class(i))
            .or_insert_with(|| tables.edge_geometry(i));
    }
    geometries
}

/// How much a known strategy's cost is raised before it bounds the search: far more than the
/// rounding of any sum of the tables' entries (relative error ~1e-16 per term), far less than the
/// gaps between strategies.
const BOUND_MARGIN: f64 = 1e-9;

/// A strategy known before the search: its cost bounds the search, and it starts the local
/// search of a residual graph too large to enumerate.
#[derive(Clone)]
struct Known {
    /// Raised by [`BOUND_MARGIN`]; infinite for none.
    cost: f64,
    /// Per layer, the index of its config in its space.
    indices: Option<Vec<usize>>,
}

impl Known {
    fn none() -> Known {
        Known {
            cost: f64::INFINITY,
            indices: None,
        }
    }

    /// This one, or the strategy of config `indices` costing `cost` (raised by [`BOUND_MARGIN`]
    /// here) where that is cheaper.
    fn or_cheaper(self, cost: f64, indices: Vec<usize>) -> Known {
        let cost = cost + cost * BOUND_MARGIN;
        if cost < self.cost {
            Known {
                cost,
                indices: Some(indices),
            }
        } else {
            self
        }
    }
}

/// The cheaper of data parallelism and OWT, summed from the tables' node costs and t_x (from the
/// edges' geometries where they give it, else Eq. 1's: the same numbers as the tables', tested),
/// its cost raised by [`BOUND_MARGIN`]; none when neither is in the config spaces.
fn known_strategy(tables: &CostTables, geometries: &HashMap<usize, EdgeGeometry>) -> Known {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let mut pricer = StrategyPricer::new(tables, geometries);
    let candidates = [
        data_parallel(graph, machine),
        one_weird_trick(graph, machine),
    ];
    let mut best = Known::none();
    for configs in &candidates {
        let Some(indices) = configs
            .iter()
            .enumerate()
            .map(|(l, c)| tables.space(LayerId(l)).index_of(c))
            .collect::<Option<Vec<usize>>>()
        else {
            continue;
        };
        best = best.or_cheaper(pricer.cost(&indices), indices);
    }
    best
}

/// Eq. 1 of whole strategies from the tables' node costs and t_x (from the edges' geometries
/// where they give it, else Eq. 1's: the same numbers as the tables', tested).
struct StrategyPricer<'a, 't, 'm> {
    tables: &'a CostTables<'m>,
    geometries: &'t HashMap<usize, EdgeGeometry>,
    /// Identical edges (one class) under the same configs move the same data.
    transfers: HashMap<(usize, usize, usize), f64>,
    buffers: PairBuffers,
}

impl<'a, 't, 'm> StrategyPricer<'a, 't, 'm> {
    fn new(tables: &'a CostTables<'m>, geometries: &'t HashMap<usize, EdgeGeometry>) -> Self {
        StrategyPricer {
            tables,
            geometries,
            transfers: HashMap::new(),
            buffers: PairBuffers::default(),
        }
    }

    /// The cost of the strategy of per-layer config `indices` (into the spaces).
    fn cost(&mut self, indices: &[usize]) -> f64 {
        let tables = self.tables;
        let model = tables.model();
        let config = |l: usize| tables.space(LayerId(l)).config(indices[l]);
        let mut total = 0.0;
        for (l, &c) in indices.iter().enumerate() {
            total += tables.node_cost(LayerId(l))[c];
        }
        for (e, edge) in tables.edges().iter().enumerate() {
            let (src, dst) = (edge.src.0, edge.dst.0);
            let class = tables.edge_class(e);
            let (geometries, buffers) = (self.geometries, &mut self.buffers);
            total += *self
                .transfers
                .entry((class, indices[src], indices[dst]))
                .or_insert_with(|| {
                    let (from, to) = (config(src), config(dst));
                    geometries
                        .get(&class)
                        .and_then(|g| tables.config_pair_time(g, &from, &to, buffers))
                        .unwrap_or_else(|| model.transfer_time(edge, &from, &to))
                });
        }
        total
    }
}

/// Algorithm 1 over what `pruned` leaves (everything where `None`), the residual's local search
/// started from `starts` (strategies known before, per layer indices into its space) where
/// their configs are live; `geometries` are [`edge_geometries`].
fn optcnn_below(
    tables: &CostTables,
    geometries: &HashMap<usize, EdgeGeometry>,
    pruned: Option<Pruned>,
    starts: Vec<Vec<usize>>,
    budget: u64,
) -> Result<OptCnnResult, SearchError> {
    let mut g = Reduction::new(tables, geometries, pruned, starts);
    g.reduce();
    let (mut indices, cost, optimality) = g.solve_residual(budget)?;
    let residual_nodes = g.alive.iter().filter(|&&a| a).count();
    for step in g.undo.iter().rev() {
        indices[step.node] =
            step.argmin[indices[step.src] * step.dst_configs + indices[step.dst]] as usize;
    }
    for (l, index) in indices.iter_mut().enumerate() {
        *index = g.live[l][*index];
    }
    Ok(OptCnnResult {
        indices,
        cost,
        residual_nodes,
        node_eliminations: g.undo.len(),
        edge_eliminations: g.edge_eliminations,
        optimality,
    })
}

struct WorkEdge {
    src: usize,
    dst: usize,
    table: Table,
    /// A lower bound of the table's entries (0 for a table not computed yet).
    min: f64,
}

enum Table {
    /// An edge of the model whose table is not computed yet.
    Pending(usize),
    Ready(Rc<Vec<f64>>),
}

/// The t_x table of a class of identical model edges over the configs live at their ends.
struct ClassTable {
    /// Producer and consumer configs (ascending indices into the spaces).
    rows: Vec<usize>,
    columns: Vec<usize>,
    /// `[row][column]`.
    table: Vec<f64>,
}

/// A node elimination, to undo: `node`'s config is `argmin[c_src][c_dst]` (indices among the
/// layers' live configs).
struct Eliminated {
    node: usize,
    src: usize,
    dst: usize,
    dst_configs: usize,
    argmin: Vec<u32>,
}

/// Which configs and layout pairs a search below a bound needs.
struct Pruned {
    /// No strategy costing this or more is kept.
    bound: f64,
    /// Per layer, the configs some strategy below the bound may use (indices into its space,
    /// ascending).
    live: Vec<Vec<usize>>,
    /// Per model edge class, the layout pairs some edge of the class may use below the bound.
    keep: HashMap<usize, Vec<bool>>,
}

impl Pruned {
    /// How many layout pairs it keeps.
    fn layout_pairs(&self) -> usize {
        (self.keep.values())
            .map(|mask| mask.iter().filter(|&&k| k).count())
            .sum()
    }
}

/// The layout-level relaxation ([`tree_marginals`]): each layer priced at its layout's cheapest
/// config, each edge at the least t_x of its layout pair under any blocks.
struct Relaxation {
    /// Per layer and layout, its cheapest config's cost.
    unary: Vec<Vec<f64>>,
    /// Per model edge class, the least t_x of each layout pair (0 where no cheap bound exists).
    least: HashMap<usize, Vec<f64>>,
    marginals: Marginals,
    /// No strategy costs less.
    lower_bound: f64,
}

impl Relaxation {
    /// `geometries` holds every model edge class's.
    fn new(tables: &CostTables, geometries: &HashMap<usize, EdgeGeometry>) -> Relaxation {
        let layers = tables.num_layers();
        let unary: Vec<Vec<f64>> = (0..layers)
            .map(|l| {
                let space = tables.space(LayerId(l));
                let costs = tables.node_cost(LayerId(l));
                (0..space.layouts().len())
                    .map(|layout| min(&costs[space.layout_configs(layout)]))
                    .collect()
            })
            .collect();
        let mut least: HashMap<usize, Vec<f64>> = HashMap::new();
        for (i, e) in tables.edges().iter().enumerate() {
            let class = tables.edge_class(i);
            least.entry(class).or_insert_with(|| {
                match tables.least_transfer_times(&geometries[&class], i) {
                    Some(times) => times.table(),
                    None => vec![0.0; unary[e.src.0].len() * unary[e.dst.0].len()],
                }
            });
        }
        let graph = LayoutGraph {
            unary,
            edges: (tables.edges().iter().enumerate())
                .map(|(i, e)| (e.src.0, e.dst.0, least[&tables.edge_class(i)].as_slice()))
                .collect(),
        };
        let marginals = tree_marginals(&graph);
        let unary = graph.unary;
        let lower_bound = (marginals.node.iter())
            .map(|layer| min(layer))
            .fold(0.0, f64::max);
        Relaxation {
            unary,
            least,
            marginals,
            lower_bound,
        }
    }

    /// The relaxation's optimum, each layer on its layout's cheapest block: a strategy like any
    /// other (per layer, the index of its config).
    fn strategy(&self, tables: &CostTables) -> Vec<usize> {
        (0..tables.num_layers())
            .map(|l| {
                let layout = argmin(&self.marginals.node[l]);
                let configs = tables.space(LayerId(l)).layout_configs(layout);
                configs.start + argmin(&tables.node_cost(LayerId(l))[configs])
            })
            .collect()
    }

    /// The bounds the search tries in turn below `known` (the cost of a strategy) before that one,
    /// rising from just above the relaxation's lower bound. A search below a bound that
    /// finds a strategy below it has found the optimum, and the tighter the bound the fewer
    /// configs and layout pairs it prices: at hundreds of devices the optimum lies within tens
    /// of percent of the lower bound while data parallelism and OWT cost several times it.
    fn trial_bounds(&self, known: f64) -> Vec<f64> {
        (0..MAX_TRIALS)
            .map(|k| self.lower_bound * (1.0 + FIRST_TRIAL * TRIAL_GROWTH.powi(k)))
            .take_while(|&b| b < known && self.lower_bound > 0.0)
            .collect()
    }

    /// What a search below `bound` leaves out: a config whose layout's bound plus its own excess
    /// over the layout's cheapest config reaches `bound`, and a layout pair whose bound does.
    /// `None` when some layer would keep no config.
    fn prune(&self, tables: &CostTables, bound: f64) -> Option<Pruned> {
        let marginals = &self.marginals;
        let mut live = Vec::with_capacity(tables.num_layers());
        for l in 0..tables.num_layers() {
            let space = tables.space(LayerId(l));
            let costs = tables.node_cost(LayerId(l));
            let mut configs = Vec::new();
            for layout in 0..space.layouts().len() {
                let (floor, cheapest) = (marginals.node[l][layout], self.unary[l][layout]);
                configs.extend(
                    space
                        .layout_configs(layout)
                        .filter(|&c| floor + (costs[c] - cheapest) < bound),
                );
            }
            if configs.is_empty() {
                return None;
            }
            live.push(configs);
        }
        let mut keep: HashMap<usize, Vec<bool>> = HashMap::new();
        for (i, e) in tables.edges().iter().enumerate() {
            let (s, d, table) = (e.src.0, e.dst.0, &self.least[&tables.edge_class(i)]);
            let (rows, columns) = (self.unary[s].len(), self.unary[d].len());
            let mask = keep
                .entry(tables.edge_class(i))
                .or_insert_with(|| vec![false; rows * columns]);
            for g in (0..rows).filter(|&g| marginals.edge_row(i, s, g) < bound) {
                for h in 0..columns {
                    let k = &mut mask[g * columns + h];
                    *k = *k || marginals.edge(i, table, s, g, d, h) < bound;
                }
            }
        }
        Some(Pruned { bound, live, keep })
    }
}

/// The first trial bound's excess over the relaxation's lower bound; each next one's is
/// `TRIAL_GROWTH` times larger, up to `MAX_TRIALS` trials (the last one's excess 4.3: a
/// bound 5.3 times the lower bound). A failed trial costs less than the next one, and the finer
/// the steps the closer the successful bound comes to the optimum, which is what decides the
/// search's time.
const FIRST_TRIAL: f64 = 0.05;
const TRIAL_GROWTH: f64 = 1.5;
const MAX_TRIALS: i32 = 12;
/// Trials are tried only where the first keeps at most this share of the layout pairs the known
/// strategy's bound keeps: where the relaxation prunes little even near the lower bound
/// (Inception-v3's branches, whose off-tree edges it folds), a failed trial costs about as much
/// as the search below the known cost.
const TRIAL_SHARE: f64 = 0.25;

struct Reduction<'t, 'm> {
    tables: &'t CostTables<'m>,
    /// Per layer, the configs the search considers (indices into its space, ascending): all of
    /// them without a bound. Tables and config indices below are among these.
    live: Vec<Vec<usize>>,
    /// Per layer, t_c + t_s of each live config.
    costs: Vec<Vec<f64>>,
    alive: Vec<bool>,
    edges: Vec<Option<WorkEdge>>,
    ins: Vec<Vec<usize>>,
    outs: Vec<Vec<usize>>,
    undo: Vec<Eliminated>,
    edge_eliminations: usize,
    /// Model edges still waiting for their table, per table class, and the tables (over the
    /// configs live at the class's edges' ends) computed so far.
    waiting: HashMap<usize, usize>,
    computed: HashMap<usize, Rc<ClassTable>>,
    /// The cheapest live config's cost of each layer.
    node_min: Vec<f64>,
    /// The cost of a known strategy, which no entry of an optimal strategy exceeds (infinite: no
    /// pruning).
    bound: f64,
    /// Every model edge class's geometry.
    geometries: &'t HashMap<usize, EdgeGeometry>,
    /// Per table class not computed yet, with a finite bound: the layout pairs it needs.
    keep: HashMap<usize, Vec<bool>>,
    /// Strategies known before the search (per layer, indices into its space), which start the
    /// local search of a residual graph too large to enumerate.
    starts: Vec<Vec<usize>>,
}

impl<'t, 'm> Reduction<'t, 'm> {
    /// Over what `pruned` leaves (everything where `None`); `starts` start a residual's local
    /// search.
    fn new(
        tables: &'t CostTables<'m>,
        geometries: &'t HashMap<usize, EdgeGeometry>,
        pruned: Option<Pruned>,
        starts: Vec<Vec<usize>>,
    ) -> Self {
        let n = tables.num_layers();
        let (live, keep, bound) = match pruned {
            Some(pruned) => (pruned.live, pruned.keep, pruned.bound),
            None => {
                let all = (0..n).map(|l| (0..tables.space(LayerId(l)).len()).collect());
                (all.collect(), HashMap::new(), f64::INFINITY)
            }
        };
        let costs: Vec<Vec<f64>> = live
            .iter()
            .enumerate()
            .map(|(l, configs)| {
                let all = tables.node_cost(LayerId(l));
                configs.iter().map(|&c| all[c]).collect()
            })
            .collect();
        let mut r = Reduction {
            tables,
            node_min: costs.iter().map(|c| min(c)).collect(),
            live,
            costs,
            alive: vec![true; n],
            edges: Vec::new(),
            ins: vec![Vec::new(); n],
            outs: vec![Vec::new(); n],
            undo: Vec::new(),
            edge_eliminations: 0,
            waiting: HashMap::new(),
            computed: HashMap::new(),
            bound,
            geometries,
            keep,
            starts,
        };
        // Every edge is counted before any is added: adding merges parallel edges (a layer reading
        // one tensor twice), which takes their tables, and a class whose count ran out then would
        // drop its table while later edges of the class still need it.
        for i in 0..tables.edges().len() {
            *r.waiting.entry(tables.edge_class(i)).or_default() += 1;
        }
        for (i, e) in tables.edges().iter().enumerate() {
            // t_x is never negative
            r.add_edge(e.src.0, e.dst.0, Table::Pending(i), 0.0);
        }
        r
    }

    /// The table of an edge over its layers' live configs, computing a model edge's table (shared
    /// between identical edges, over the configs live at either end of any of them) when first
    /// needed.
    fn take_table(&mut self, table: Table) -> Rc<Vec<f64>> {
        let edge = match table {
            Table::Pending(edge) => edge,
            Table::Ready(t) => return t,
        };
        let class = self.tables.edge_class(edge);
        let shared = match self.computed.get(&class) {
            Some(t) => t.clone(),
            None => {
                let geometry = &self.geometries[&class];
                let keep = self.keep.remove(&class);
                let (rows, columns) = self.class_configs(class);
                let only = ConfigSubset {
                    rows: &rows,
                    columns: &columns,
                };
                let table =
                    self.tables
                        .edge_table_within(geometry, edge, keep.as_deref(), Some(only));
                Rc::new(ClassTable {
                    rows,
                    columns,
                    table,
                })
            }
        };
        let left = self
            .waiting
            .get_mut(&class)
            .expect("every model edge is counted");
        *left -= 1;
        if *left == 0 {
            self.computed.remove(&class);
        } else {
            self.computed.insert(class, shared.clone());
        }
        let e = self.tables.edges()[edge];
        let (rows, columns) = (&self.live[e.src.0], &self.live[e.dst.0]);
        if *rows == shared.rows && *columns == shared.columns {
            return Rc::new(match Rc::try_unwrap(shared) {
                Ok(owned) => owned.table,
                Err(shared) => shared.table.clone(),
            });
        }
        // positions of this edge's live configs among the class's
        let position = |among: &[usize], c: usize| among.binary_search(&c).expect("in the union");
        let row_at: Vec<usize> = rows.iter().map(|&r| position(&shared.rows, r)).collect();
        let column_at: Vec<usize> = columns
            .iter()
            .map(|&c| position(&shared.columns, c))
            .collect();
        let width = shared.columns.len();
        let subset = ConfigSubset {
            rows: &row_at,
            columns: &column_at,
        };
        Rc::new(subset.extract(&shared.table, width))
    }

    /// The configs live at the producer and at the consumer of any edge of `class`, ascending.
    fn class_configs(&self, class: usize) -> (Vec<usize>, Vec<usize>) {
        let mut rows: Vec<usize> = Vec::new();
        let mut columns: Vec<usize> = Vec::new();
        for (i, e) in self.tables.edges().iter().enumerate() {
            if self.tables.edge_class(i) == class {
                rows.extend(&self.live[e.src.0]);
                columns.extend(&self.live[e.dst.0]);
            }
        }
        for v in [&mut rows, &mut columns] {
            v.sort_unstable();
            v.dedup();
        }
        (rows, columns)
    }

    /// Adds an edge whose entries are at least `min`, merging it with an existing edge between the
    /// same layers (Eq. 3).
    fn add_edge(&mut self, src: usize, dst: usize, table: Table, min: f64) {
        let existing = self.outs[src]
            .iter()
            .copied()
            .find(|&e| self.edges[e].as_ref().is_some_and(|w| w.dst == dst));
        match existing {
            Some(e) => {
                let old = self.edges[e].take().expect("listed edges are alive");
                let a = self.take_table(old.table);
                let b = self.take_table(table);
                // sum into `a` when no other edge shares it, saving a table-sized allocation
                let mut sum = Rc::try_unwrap(a).unwrap_or_else(|shared| (*shared).clone());
                for (x, y) in sum.iter_mut().zip(b.iter()) {
                    *x += *y;
                }
                self.edges[e] = Some(WorkEdge {
                    src,
                    dst,
                    table: Table::Ready(Rc::new(sum)),
                    min: old.min + min,
                });
                self.edge_eliminations += 1;
            }
            None => {
                let id = self.edges.len();
                self.edges.push(Some(WorkEdge {
                    src,
                    dst,
                    table,
                    min,
                }));
                self.outs[src].push(id);
                self.ins[dst].push(id);
            }
        }
    }

    fn remove_edge(&mut self, e: usize) -> WorkEdge {
        let w = self.edges[e].take().expect("removing a live edge");
        self.outs[w.src].retain(|&x| x != e);
        self.ins[w.dst].retain(|&x| x != e);
        w
    }

    fn reduce(&mut self) {
        loop {
            // by the whole spaces' sizes, not the live ones: the same order with and without a
            // bound, so that both add the same numbers in the same order
            let space = |l: usize| self.tables.space(LayerId(l)).len();
            let candidate = (0..self.alive.len())
                .filter(|&j| self.alive[j] && self.ins[j].len() == 1 && self.outs[j].len() == 1)
                .map(|j| {
                    let i = self.edges[self.ins[j][0]].as_ref().map_or(0, |w| w.src);
                    let k = self.edges[self.outs[j][0]].as_ref().map_or(0, |w| w.dst);
                    (space(i) * space(j) * space(k), j)
                })
                .min();
            let Some((_, j)) = candidate else {
                return;
            };
            self.eliminate_node(j);
            let (done, layers) = (self.undo.len() as u64, self.alive.len() as u64);
            self.tables
                .model()
                .progress(Phase::Eliminations, done, layers);
        }
    }

    fn eliminate_node(&mut self, j: usize) {
        let first = self.remove_edge(self.ins[j][0]);
        let second = self.remove_edge(self.outs[j][0]);
        let (i, k) = (first.src, second.dst);
        let a = self.take_table(first.table);
        let b = self.take_table(second.table);
        let (ci, cj, ck) = (self.live[i].len(), self.live[j].len(), self.live[k].len());
        let space = self.tables.space(LayerId(k));
        let layouts: Vec<usize> = self.live[k].iter().map(|&c| space.layout_of(c)).collect();
        let groups = column_groups(&layouts);
        // Unbounded (`bound` infinite), every limit is infinite too: node costs are finite.
        let limit = Limit {
            total: self.bound - self.others_at_least(&[i, j, k]),
            rows: &self.costs[i],
            cols: &self.costs[k],
        };
        let mid = &self.costs[j];
        let (table, argmin, min) = min_plus(&a, mid, &b, ci, cj, ck, &groups, limit);
        self.alive[j] = false;
        self.undo.push(Eliminated {
            node: j,
            src: i,
            dst: k,
            dst_configs: ck,
            argmin,
        });
        self.add_edge(i, k, Table::Ready(Rc::new(table)), min);
    }

    /// A lower bound of what every live layer but `except` and every live edge add to a
    /// strategy's cost.
    fn others_at_least(&self, except: &[usize]) -> f64 {
        let nodes: f64 = (0..self.alive.len())
            .filter(|&n| self.alive[n] && !except.contains(&n))
            .map(|n| self.node_min[n])
            .sum();
        let edges: f64 = self.edges.iter().flatten().map(|e| e.min).sum();
        nodes + edges
    }

    /// Solves the residual graph: a residual of two layers (the zoo's) by enumeration, a larger
    /// one by [`residual::solve`] within `budget` partial strategies, started from the known
    /// strategies whose configs are live. Returns per-layer config indices (eliminated layers
    /// still 0), the cost and how far from the optimum it may be.
    fn solve_residual(
        &mut self,
        budget: u64,
    ) -> Result<(Vec<usize>, f64, Optimality), SearchError> {
        let nodes: Vec<usize> = (0..self.alive.len()).filter(|&j| self.alive[j]).collect();
        let mut position = vec![usize::MAX; self.alive.len()];
        for (p, &j) in nodes.iter().enumerate() {
            position[j] = p;
        }
        // in-edges of each residual node from earlier residual nodes (all of them: ids are
        // topological and eliminations keep edges pointing forward)
        let mut incoming: Vec<Vec<InEdge>> = vec![Vec::new(); nodes.len()];
        let live: Vec<usize> = (0..self.edges.len())
            .filter(|&e| self.edges[e].is_some())
            .collect();
        for e in live {
            let w = self.edges[e].take().expect("live");
            let t = self.take_table(w.table);
            incoming[position[w.dst]].push((position[w.src], t));
        }
        let costs: Vec<&[f64]> = nodes.iter().map(|&j| self.costs[j].as_slice()).collect();
        let sizes: Vec<usize> = nodes.iter().map(|&j| self.live[j].len()).collect();
        let (choice, best, optimality) = if nodes.len() <= 2 {
            // at most |C_0|·(1 + |C_1|) partial strategies
            let (choice, best) = enumerate(&costs, &sizes, &incoming, u64::MAX)?;
            (choice, best, Optimality::Exact)
        } else {
            let starts: Vec<Vec<usize>> = self
                .starts
                .iter()
                .filter_map(|known| {
                    nodes
                        .iter()
                        .map(|&j| self.live[j].binary_search(&known[j]).ok())
                        .collect()
                })
                .collect();
            let core = Residual {
                costs: &costs,
                sizes: &sizes,
                incoming: &incoming,
            };
            let model = self.tables.model();
            let tick = |tried: u64| model.progress(Phase::Residual, tried.min(budget), budget);
            let solved = residual::solve(&core, &starts, budget, &tick);
            let optimality = match solved.exact {
                true => Optimality::Exact,
                false => Optimality::Bounded {
                    lower_bound: solved.lower_bound,
                    layers: nodes.iter().map(|&j| LayerId(j)).collect(),
                },
            };
            (solved.choice, solved.cost, optimality)
        };
        let mut indices = vec![0; self.alive.len()];
        for (p, &j) in nodes.iter().enumerate() {
            indices[j] = choice[p];
        }
        Ok((indices, best, optimality))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::machine::{DeviceSpec, Link, MachineModel};
    use crate::provider::RooflineCost;

    /// Bounded by the known strategies, the search finds the same optimum, bit for bit, and the
    /// same strategy as without a bound: on the zoo's small models, at several batch sizes, on
    /// regular machines and ones with uneven nodes or a device of another kind.
    #[test]
    fn the_bound_changes_nothing() {
        let two_kinds = MachineModel::new(
            "two-kinds",
            &[
                crate::machine::NodeSpec {
                    devices: 4,
                    device: DeviceSpec::p100(),
                },
                crate::machine::NodeSpec {
                    devices: 4,
                    device: DeviceSpec::local_cpu(),
                },
            ],
            Link::from_gbit_per_s(160.0, 5.0),
            Link::from_gbit_per_s(100.0, 10.0),
        )
        .unwrap();
        let machines = [
            MachineModel::preset("paper:4").unwrap(),
            MachineModel::preset("paper:8").unwrap(),
            MachineModel::from_flags(2, 3, None, None).unwrap(),
            MachineModel::from_flags(4, 2, Some(3.0), Some(30.0)).unwrap(),
            two_kinds,
        ];
        for machine in &machines {
            let provider = RooflineCost::new(machine);
            for (name, batch) in [
                ("lenet5", 4),
                ("lenet5", 64),
                ("alexnet", 8),
                ("alexnet", 256),
                ("inception_v3_reduced", 5),
                ("inception_v3_reduced", 64),
            ] {
                let z = legion_ops::zoo::find(name).unwrap();
                let graph = z.build(&z.default_config(batch)).unwrap();
                let model = CostModel::new(&graph, machine, &provider);
                let tables = CostTables::build(&model);
                let geometries = edge_geometries(&tables);
                let known = known_strategy(&tables, &geometries);
                assert!(known.cost.is_finite(), "{name} on {machine}");
                let relaxation = Relaxation::new(&tables, &geometries);
                let search = |pruned: Option<Pruned>| {
                    optcnn_below(&tables, &geometries, pruned, Vec::new(), RESIDUAL_BUDGET).unwrap()
                };
                let exact = search(None);
                let what = format!("{name} ×{batch} on {machine}");
                // below the known cost, just above the optimum (a trial that succeeds), and
                // with the trials as the search runs them
                let by_known = search(relaxation.prune(&tables, known.cost));
                let tight = search(relaxation.prune(&tables, exact.cost * (1.0 + 1e-6)));
                let searched = optcnn(&tables).unwrap();
                for bounded in [&by_known, &tight, &searched] {
                    assert_eq!(bounded.indices, exact.indices, "{what}");
                    assert_eq!(bounded.cost.to_bits(), exact.cost.to_bits(), "{what}");
                }
                assert!(exact.cost <= known.cost, "{what}");
                assert!(
                    relaxation.lower_bound <= exact.cost * (1.0 + 1e-12),
                    "{what}: {} above {}",
                    relaxation.lower_bound,
                    exact.cost
                );
            }
        }
    }
}
