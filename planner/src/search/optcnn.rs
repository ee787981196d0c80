//! OptCNN's Algorithm 1: node and edge eliminations until neither applies, enumeration of the residual
//! graph, then the eliminations undone in reverse to recover every eliminated layer's config.
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
//! Node eliminations compute only the entries an optimal strategy can use (branch and bound). The
//! cost of a known strategy (data parallelism or OWT, whichever is cheaper) bounds the optimum from
//! above; every strategy through `(c_i, c_k)` costs at least the new entry, plus `i`'s and `k`'s
//! costs under those configs, plus the cheapest cost of every other live layer and a lower bound of
//! every other edge. Where that sum exceeds the known cost, the entry is left infinite (and
//! [`min_plus`] skips the work). On the zoo's models the optimum is within a few percent of that
//! bound, so most entries go. The model edges' t_x tables are pruned the same way before they are
//! built, from cheap lower bounds of t_x per layout pair (see [`Reduction::prepare_cutoffs`]): on
//! AlexNet at 16 devices ~97% of the layout pairs are never computed. An entry some optimal
//! strategy uses is never cut, so it and every entry it was built from are exact, with the same
//! minimising `j` (among equal minima the first scanned, all of which are optimal too): the optimum
//! and the strategy are the ones the unpruned search finds.

use super::SearchError;
use super::data::data_parallel;
use super::exhaustive::{InEdge, enumerate};
use super::min_plus::{Limit, column_groups, min, min_plus};
use super::owt::one_weird_trick;
use crate::config::ParallelConfig;
use crate::tables::CostTables;
use crate::transfer_table::{Cutoff, EdgeGeometry, LeastTimes};
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
}

/// Strategies of the residual graph tried at most (the zoo's residual graphs have 2 nodes).
pub const RESIDUAL_BUDGET: u64 = 100_000_000;

/// Runs Algorithm 1 on the tables' model.
pub fn optcnn(tables: &CostTables) -> Result<OptCnnResult, SearchError> {
    let geometries = edge_geometries(tables);
    let known = known_strategy_cost(tables, &geometries);
    let result = optcnn_below(tables, known, geometries)?;
    // The bound cannot cut the optimum (see the module's notes); if rounding ever did, the exact
    // search is the answer.
    let within = result.cost <= known;
    if known.is_finite() && !within {
        return optcnn_below(tables, f64::INFINITY, HashMap::new());
    }
    Ok(result)
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

/// The cheaper of data parallelism and OWT, summed from the tables' node costs and t_x (from the
/// edges' geometries where they give it, else Eq. 1's: the same numbers as the tables', tested),
/// raised by [`BOUND_MARGIN`]; infinite when neither is in the config spaces.
fn known_strategy_cost(tables: &CostTables, geometries: &HashMap<usize, EdgeGeometry>) -> f64 {
    let model = tables.model();
    let (graph, machine) = (model.graph(), model.machine());
    let mut transfers: HashMap<(usize, usize, usize), f64> = HashMap::new();
    let mut cost_of = |configs: &[ParallelConfig]| -> Option<f64> {
        let indices = configs
            .iter()
            .enumerate()
            .map(|(l, c)| tables.space(LayerId(l)).index_of(c))
            .collect::<Option<Vec<usize>>>()?;
        let mut total = 0.0;
        for (l, &c) in indices.iter().enumerate() {
            total += tables.node_cost(LayerId(l))[c];
        }
        for (e, edge) in tables.edges().iter().enumerate() {
            let (src, dst) = (edge.src.0, edge.dst.0);
            // identical edges (one class) under the same configs move the same data
            let class = tables.edge_class(e);
            total += *transfers
                .entry((class, indices[src], indices[dst]))
                .or_insert_with(|| {
                    let (from, to) = (&configs[src], &configs[dst]);
                    geometries
                        .get(&class)
                        .and_then(|g| tables.config_pair_time(g, from, to))
                        .unwrap_or_else(|| model.transfer_time(edge, from, to))
                });
        }
        Some(total)
    };
    let candidates = [
        data_parallel(graph, machine),
        one_weird_trick(graph, machine),
    ];
    let best = candidates
        .iter()
        .filter_map(|c| cost_of(c))
        .fold(f64::INFINITY, f64::min);
    best + best * BOUND_MARGIN
}

/// Algorithm 1, leaving out table entries that cannot be part of a strategy cheaper than `bound`;
/// `geometries` ([`edge_geometries`], or none) saves working them out again.
fn optcnn_below(
    tables: &CostTables,
    bound: f64,
    geometries: HashMap<usize, EdgeGeometry>,
) -> Result<OptCnnResult, SearchError> {
    let mut g = Reduction::new(tables, bound, geometries);
    g.reduce();
    let (mut indices, cost) = g.solve_residual()?;
    let residual_nodes = g.alive.iter().filter(|&&a| a).count();
    for step in g.undo.iter().rev() {
        indices[step.node] =
            step.argmin[indices[step.src] * step.dst_configs + indices[step.dst]] as usize;
    }
    Ok(OptCnnResult {
        indices,
        cost,
        residual_nodes,
        node_eliminations: g.undo.len(),
        edge_eliminations: g.edge_eliminations,
    })
}

/// `min_{g,h} x[g] + y[h] + least(g, h)`, then the same without `x`, without `y`, and without
/// either. Bounds are non-negative, so layouts are visited by ascending share and a scan stops
/// once the shares alone reach the minimum: most layouts' shares (small blocks, serial configs)
/// are far above it.
fn cheapest_terms(least: &LeastTimes, x: &[f64], y: &[f64]) -> [f64; 4] {
    let ascending = |v: &[f64]| {
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
        order
    };
    let zeros = vec![0.0; x.len().max(y.len())];
    let (xo, yo) = (ascending(x), ascending(y));
    let scan = |x: &[f64], y: &[f64]| {
        let mut best = f64::INFINITY;
        for &g in &xo {
            if x[g] + y[yo[0]] >= best {
                break;
            }
            for &h in &yo {
                let shares = x[g] + y[h];
                if shares >= best {
                    break;
                }
                best = best.min(shares + least.get(g, h));
            }
        }
        best
    };
    // (with a share left out, the order of the other still holds; zeros keep any order)
    [
        scan(x, y),
        scan(&zeros[..x.len()], y),
        scan(x, &zeros[..y.len()]),
        scan(&zeros[..x.len()], &zeros[..y.len()]),
    ]
}

/// Which of [`cheapest_terms`]' four terms of an edge `src → dst` leaves out the shares of the
/// layers in `priced`.
fn term_without(src: usize, dst: usize, priced: &[usize]) -> usize {
    usize::from(priced.contains(&src)) + 2 * usize::from(priced.contains(&dst))
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

/// A node elimination, to undo: `node`'s config is `argmin[c_src][c_dst]`.
struct Eliminated {
    node: usize,
    src: usize,
    dst: usize,
    dst_configs: usize,
    argmin: Vec<u32>,
}

struct Reduction<'t, 'm> {
    tables: &'t CostTables<'m>,
    sizes: Vec<usize>,
    alive: Vec<bool>,
    edges: Vec<Option<WorkEdge>>,
    ins: Vec<Vec<usize>>,
    outs: Vec<Vec<usize>>,
    undo: Vec<Eliminated>,
    edge_eliminations: usize,
    /// Model edges still waiting for their table, per table class, and the tables computed so far.
    waiting: HashMap<usize, usize>,
    computed: HashMap<usize, Rc<Vec<f64>>>,
    /// The cheapest config's cost of each layer.
    node_min: Vec<f64>,
    /// The cost of a known strategy, which no entry of an optimal strategy exceeds (infinite: no
    /// pruning).
    bound: f64,
    /// Per table class not computed yet, with a finite bound: what its table needs to leave out
    /// the layout pairs no strategy below the bound uses.
    prepared: HashMap<usize, Prepared>,
    /// Per model edge, with a finite bound: [`cheapest_terms`] of its least t_x and its
    /// endpoints' shares of their layers' excess (see [`Reduction::prepare_cutoffs`]).
    edge_terms: Vec<[f64; 4]>,
}

/// A model edge class's geometry and [`Cutoff`], worked out before the eliminations.
struct Prepared {
    geometry: EdgeGeometry,
    /// `None` where no cheap bound of t_x exists: the table is then computed whole.
    least: Option<LeastTimes>,
    src_excess: Vec<f64>,
    dst_excess: Vec<f64>,
    slack: f64,
}

impl<'t, 'm> Reduction<'t, 'm> {
    fn new(
        tables: &'t CostTables<'m>,
        bound: f64,
        geometries: HashMap<usize, EdgeGeometry>,
    ) -> Self {
        let n = tables.num_layers();
        let mut r = Reduction {
            tables,
            sizes: (0..n).map(|l| tables.space(LayerId(l)).len()).collect(),
            alive: vec![true; n],
            edges: Vec::new(),
            ins: vec![Vec::new(); n],
            outs: vec![Vec::new(); n],
            undo: Vec::new(),
            edge_eliminations: 0,
            waiting: HashMap::new(),
            computed: HashMap::new(),
            node_min: (0..n)
                .map(|l| {
                    let costs = tables.node_cost(LayerId(l));
                    costs.iter().copied().fold(f64::INFINITY, f64::min)
                })
                .collect(),
            bound,
            prepared: HashMap::new(),
            edge_terms: Vec::new(),
        };
        if bound.is_finite() {
            (r.prepared, r.edge_terms) = r.prepare_cutoffs(geometries);
        }
        for (i, e) in tables.edges().iter().enumerate() {
            *r.waiting.entry(tables.edge_class(i)).or_default() += 1;
            // t_x is never negative
            r.add_edge(e.src.0, e.dst.0, Table::Pending(i), 0.0);
        }
        r
    }

    /// The table of an edge, computing (and sharing between identical edges) a model edge's table.
    fn take_table(&mut self, table: Table) -> Rc<Vec<f64>> {
        match table {
            Table::Ready(t) => t,
            Table::Pending(edge) => {
                let class = self.tables.edge_class(edge);
                let t = match self.computed.get(&class) {
                    Some(t) => t.clone(),
                    None => Rc::new(match self.prepared.remove(&class) {
                        Some(p) => {
                            let cutoff = p.least.as_ref().map(|least| Cutoff {
                                least,
                                src_excess: &p.src_excess,
                                dst_excess: &p.dst_excess,
                                slack: p.slack,
                            });
                            self.tables
                                .edge_table_within(&p.geometry, edge, cutoff.as_ref())
                        }
                        None => self.tables.edge_table(edge),
                    }),
                };
                let left = self
                    .waiting
                    .get_mut(&class)
                    .expect("every model edge is counted");
                *left -= 1;
                if *left == 0 {
                    self.computed.remove(&class);
                } else {
                    self.computed.insert(class, t.clone());
                }
                t
            }
        }
    }

    /// Every model edge class's geometry and, from lower bounds of t_x, which of its layout pairs
    /// no strategy below the bound uses.
    ///
    /// A strategy costs at least every layer's cheapest config plus, per layer, its layout's
    /// excess over that (`excess`), plus every edge's least t_x under the two layouts. Through a
    /// layout pair `(g, h)` of edge `e = (i, j)`, give `e` the whole excess of `i` and `j` and
    /// every other layer's excess in equal shares to its edges: each other edge then adds at
    /// least its cheapest such term (without the shares of `i` and `j` where it touches them).
    /// The pair is left out when `excess_i(g) + excess_j(h) + least_e(g, h)` exceeds the bound
    /// less the cheapest configs and those terms. On the zoo's models the terms of the other
    /// edges cover about two thirds of the gap between the cheapest configs and the optimum.
    fn prepare_cutoffs(
        &self,
        mut geometries: HashMap<usize, EdgeGeometry>,
    ) -> (HashMap<usize, Prepared>, Vec<[f64; 4]>) {
        let tables = self.tables;
        let edges = tables.edges();
        let layers = self.alive.len();
        let excess: Vec<Vec<f64>> = (0..layers)
            .map(|l| {
                let space = tables.space(LayerId(l));
                let costs = tables.node_cost(LayerId(l));
                (0..space.layouts().len())
                    .map(|layout| min(&costs[space.layout_configs(layout)]) - self.node_min[l])
                    .collect()
            })
            .collect();
        let mut degree = vec![0usize; layers];
        for e in edges {
            degree[e.src.0] += 1;
            degree[e.dst.0] += 1;
        }
        let mut geometry: HashMap<usize, (EdgeGeometry, Option<LeastTimes>)> = HashMap::new();
        for i in 0..edges.len() {
            let class = tables.edge_class(i);
            if let std::collections::hash_map::Entry::Vacant(slot) = geometry.entry(class) {
                let g = geometries
                    .remove(&class)
                    .unwrap_or_else(|| tables.edge_geometry(i));
                let least = tables.least_transfer_times(&g, i);
                slot.insert((g, least));
            }
        }
        // per edge, its cheapest term with both endpoints' shares, without the producer's,
        // without the consumer's, and without either
        let terms: Vec<[f64; 4]> = edges
            .iter()
            .enumerate()
            .map(|(i, e)| match &geometry[&tables.edge_class(i)].1 {
                Some(least) => {
                    let share = |l: usize| -> Vec<f64> {
                        excess[l].iter().map(|x| x / degree[l] as f64).collect()
                    };
                    cheapest_terms(least, &share(e.src.0), &share(e.dst.0))
                }
                None => [0.0; 4],
            })
            .collect();
        let cheapest: f64 = self.node_min.iter().sum();
        let all_terms: f64 = terms.iter().map(|t| t[0]).sum();
        let mut incident = vec![Vec::new(); layers];
        for (f, e) in edges.iter().enumerate() {
            incident[e.src.0].push(f);
            incident[e.dst.0].push(f);
        }
        let mut prepared: HashMap<usize, Prepared> = HashMap::new();
        for (i, e) in edges.iter().enumerate() {
            let (a, b) = (e.src.0, e.dst.0);
            let touches_a = |f: usize| edges[f].src.0 == a || edges[f].dst.0 == a;
            // every other edge's term, less the shares of `a` and `b` where it touches them (the
            // rounding of the differences is far below the bound's margin); an edge at both ends
            // is met once, among `a`'s
            let mut others = all_terms - terms[i][0];
            let neighbours = incident[a]
                .iter()
                .chain(incident[b].iter().filter(|&&f| !touches_a(f)));
            for &f in neighbours.filter(|&&f| f != i) {
                let (fs, fd) = (edges[f].src.0, edges[f].dst.0);
                others -= terms[f][0] - terms[f][term_without(fs, fd, &[a, b])];
            }
            let slack = self.bound - cheapest - others;
            let class = tables.edge_class(i);
            // one table serves the whole class: leave out only what every edge of it would
            match prepared.get_mut(&class) {
                Some(p) => {
                    p.slack = p.slack.max(slack);
                    for (x, y) in p.src_excess.iter_mut().zip(&excess[a]) {
                        *x = x.min(*y);
                    }
                }
                None => {
                    let (g, least) = geometry.remove(&class).expect("one per class");
                    prepared.insert(
                        class,
                        Prepared {
                            geometry: g,
                            least,
                            src_excess: excess[a].clone(),
                            dst_excess: excess[b].clone(),
                            slack,
                        },
                    );
                }
            }
        }
        (prepared, terms)
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
            let candidate = (0..self.alive.len())
                .filter(|&j| self.alive[j] && self.ins[j].len() == 1 && self.outs[j].len() == 1)
                .map(|j| {
                    let i = self.edges[self.ins[j][0]].as_ref().map_or(0, |w| w.src);
                    let k = self.edges[self.outs[j][0]].as_ref().map_or(0, |w| w.dst);
                    (self.sizes[i] * self.sizes[j] * self.sizes[k], j)
                })
                .min();
            let Some((_, j)) = candidate else {
                return;
            };
            self.eliminate_node(j);
        }
    }

    fn eliminate_node(&mut self, j: usize) {
        let first = self.remove_edge(self.ins[j][0]);
        let second = self.remove_edge(self.outs[j][0]);
        let (i, k) = (first.src, second.dst);
        let a = self.take_table(first.table);
        let b = self.take_table(second.table);
        let (ci, cj, ck) = (self.sizes[i], self.sizes[j], self.sizes[k]);
        let mid = self.tables.node_cost(LayerId(j));
        let groups = column_groups(self.tables.space(LayerId(k)));
        // Unbounded (`bound` infinite), every limit is infinite too: node costs are finite.
        let limit = Limit {
            total: self.bound - self.others_at_least(&[i, j, k]),
            rows: self.tables.node_cost(LayerId(i)),
            cols: self.tables.node_cost(LayerId(k)),
        };
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
    ///
    /// A model edge whose table is not built yet adds its cheapest term with the shares of its
    /// endpoints' excess ([`Reduction::prepare_cutoffs`]), less those of `except` (priced exactly
    /// by the caller): each live layer's excess is counted at most once over its edges.
    fn others_at_least(&self, except: &[usize]) -> f64 {
        let nodes: f64 = (0..self.alive.len())
            .filter(|&n| self.alive[n] && !except.contains(&n))
            .map(|n| self.node_min[n])
            .sum();
        let edges: f64 = self
            .edges
            .iter()
            .flatten()
            .map(|e| match (&e.table, self.edge_terms.is_empty()) {
                (Table::Pending(m), false) => {
                    self.edge_terms[*m][term_without(e.src, e.dst, except)]
                }
                _ => e.min,
            })
            .sum();
        nodes + edges
    }

    /// Enumerates the residual graph's strategies (depth-first, in layer order, pruned by a lower
    /// bound); returns per-layer config indices (eliminated layers still 0) and the optimum.
    fn solve_residual(&mut self) -> Result<(Vec<usize>, f64), SearchError> {
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
        let costs: Vec<&[f64]> = nodes
            .iter()
            .map(|&j| self.tables.node_cost(LayerId(j)))
            .collect();
        let sizes: Vec<usize> = nodes.iter().map(|&j| self.sizes[j]).collect();
        let (choice, best) = enumerate(&costs, &sizes, &incoming, RESIDUAL_BUDGET)?;
        let mut indices = vec![0; self.alive.len()];
        for (p, &j) in nodes.iter().enumerate() {
            indices[j] = choice[p];
        }
        Ok((indices, best))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::machine::{DeviceSpec, Link, MachineModel};
    use crate::provider::RooflineCost;

    /// The early exits of `cheapest_terms` find the minima a full scan finds.
    #[test]
    fn cheapest_terms_equal_a_full_scan() {
        let machine = MachineModel::preset("paper:8").unwrap();
        let provider = RooflineCost::new(&machine);
        for name in ["alexnet", "inception_v3_reduced"] {
            let z = legion_ops::zoo::find(name).unwrap();
            let graph = z.build(&z.default_config(64)).unwrap();
            let model = CostModel::new(&graph, &machine, &provider);
            let tables = CostTables::build(&model);
            for (i, e) in tables.edges().iter().enumerate() {
                let geometry = tables.edge_geometry(i);
                let least = tables.least_transfer_times(&geometry, i).unwrap();
                // uneven shares, as layers' excesses are
                let share = |l: LayerId, salt: f64| -> Vec<f64> {
                    let layouts = tables.space(l).layouts().len();
                    (0..layouts)
                        .map(|k| (k as f64 * salt).sin().abs() * 1e-3)
                        .collect()
                };
                let (x, y) = (share(e.src, 1.7), share(e.dst, 2.3));
                let mut full = [f64::INFINITY; 4];
                for (g, xg) in x.iter().enumerate() {
                    for (h, yh) in y.iter().enumerate() {
                        let l = least.get(g, h);
                        full[0] = full[0].min(xg + yh + l);
                        full[1] = full[1].min(yh + l);
                        full[2] = full[2].min(xg + l);
                        full[3] = full[3].min(l);
                    }
                }
                assert_eq!(cheapest_terms(&least, &x, &y), full, "{name} edge {i}");
            }
        }
    }

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
                let known = known_strategy_cost(&tables, &geometries);
                assert!(known.is_finite(), "{name} on {machine}");
                let bounded = optcnn_below(&tables, known, geometries).unwrap();
                let exact = optcnn_below(&tables, f64::INFINITY, HashMap::new()).unwrap();
                assert_eq!(
                    bounded.indices, exact.indices,
                    "{name} ×{batch} on {machine}"
                );
                assert_eq!(
                    bounded.cost.to_bits(),
                    exact.cost.to_bits(),
                    "{name} ×{batch} on {machine}"
                );
                assert!(exact.cost <= known, "{name} ×{batch} on {machine}");
            }
        }
    }
}
