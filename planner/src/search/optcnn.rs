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

use super::SearchError;
use super::exhaustive::{InEdge, enumerate};
use super::min_plus::{column_groups, min_plus};
use crate::tables::CostTables;
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
    let mut g = Reduction::new(tables);
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

struct WorkEdge {
    src: usize,
    dst: usize,
    table: Table,
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
}

impl<'t, 'm> Reduction<'t, 'm> {
    fn new(tables: &'t CostTables<'m>) -> Self {
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
        };
        for (i, e) in tables.edges().iter().enumerate() {
            *r.waiting.entry(tables.edge_class(i)).or_default() += 1;
            r.add_edge(e.src.0, e.dst.0, Table::Pending(i));
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
                    None => Rc::new(self.tables.edge_table(edge)),
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

    /// Adds an edge, merging it with an existing edge between the same layers (Eq. 3).
    fn add_edge(&mut self, src: usize, dst: usize, table: Table) {
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
                });
                self.edge_eliminations += 1;
            }
            None => {
                let id = self.edges.len();
                self.edges.push(Some(WorkEdge { src, dst, table }));
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
        let (table, argmin) = min_plus(&a, mid, &b, ci, cj, ck, &groups);
        self.alive[j] = false;
        self.undo.push(Eliminated {
            node: j,
            src: i,
            dst: k,
            dst_configs: ck,
            argmin,
        });
        self.add_edge(i, k, Table::Ready(Rc::new(table)));
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
