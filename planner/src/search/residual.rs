//! The residual graph OptCNN's eliminations leave: enumerated exactly where that finishes, and
//! otherwise solved within a stated distance of a lower bound.
//!
//! Node and edge eliminations reduce the zoo's models to two layers, but not a graph whose layers
//! read many earlier ones (DenseNet's dense blocks: every layer reads every earlier one), which
//! keeps a core of dozens of layers joined by hundreds of edges. For such a core:
//!
//! 1. **Upper bound.** Iterated conditional modes from each start (the known strategy, and the
//!    layer-wise minimisers of the relaxation below): each layer in turn takes its cheapest config
//!    given its neighbours', until a sweep changes nothing. The cheapest result is the incumbent.
//! 2. **Lower bound.** The spanning-tree relaxation of [`relaxation`](super::relaxation) over the
//!    core's exact tables (each entry capped at the incumbent's cost, which no entry of a cheaper
//!    strategy exceeds): its optimum is at most that of every strategy.
//! 3. **Exact search.** The depth-first enumeration, started with the incumbent as its best, so
//!    that only strictly cheaper strategies are visited; where it finishes within its budget the
//!    result is exact, and otherwise the incumbent stands with its gap to the lower bound.
//!
//! Every step is deterministic, so the same tables give the same strategy.

use super::exhaustive::{Enumerated, InEdge, enumerate_from, strategy_cost};
use super::min_plus::min;
use super::relaxation::{LayoutGraph, tree_marginals};

/// A residual graph: per node its costs and its in-edges from earlier nodes, as
/// [`enumerate_from`] takes them.
pub(crate) struct Residual<'a> {
    pub(crate) costs: &'a [&'a [f64]],
    pub(crate) sizes: &'a [usize],
    pub(crate) incoming: &'a [Vec<InEdge>],
}

/// How a residual graph was solved.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Solved {
    /// Per node, its config.
    pub(crate) choice: Vec<usize>,
    pub(crate) cost: f64,
    /// At most the optimum: equal to `cost` where the search was exact.
    pub(crate) lower_bound: f64,
    /// Whether `cost` is the optimum (the enumeration finished, or the bounds met).
    pub(crate) exact: bool,
}

/// Solves `residual`: exactly where the enumeration finishes within `budget` partial strategies,
/// else the best of local searches from `starts` (complete choices, any finite-cost ones) and the
/// relaxation's minimisers, with a lower bound.
/// `tick` hears how many partial strategies the enumeration has tried, now and then.
pub(crate) fn solve(
    residual: &Residual,
    starts: &[Vec<usize>],
    budget: u64,
    tick: &dyn Fn(u64),
) -> Solved {
    let neighbours = Neighbours::of(residual);
    let mut candidates: Vec<Vec<usize>> = starts.to_vec();
    // the relaxation without a cap yet, for its minimisers: every config of every node
    let unbounded = relaxed(residual, f64::INFINITY);
    candidates.push(unbounded.minimisers.clone());
    let mut best: Option<(f64, Vec<usize>)> = None;
    for start in candidates {
        let local = neighbours.descend(residual, start);
        let cost = residual_cost(residual, &local);
        if best.as_ref().is_none_or(|(b, _)| cost < *b) {
            best = Some((cost, local));
        }
    }
    let (incumbent_cost, incumbent) = best.expect("the relaxation's minimisers are a start");
    let lower_bound = if incumbent_cost.is_finite() {
        relaxed(residual, incumbent_cost).optimum
    } else {
        unbounded.optimum
    };
    // the relaxation adds the same entries in another order: equal up to rounding is equal
    if incumbent_cost <= lower_bound * (1.0 + ROUNDING) {
        return Solved {
            choice: incumbent,
            cost: incumbent_cost,
            lower_bound: incumbent_cost,
            exact: true,
        };
    }
    let Enumerated {
        choice,
        cost,
        complete,
    } = enumerate_from(
        residual.costs,
        residual.sizes,
        residual.incoming,
        budget,
        Some((&incumbent, incumbent_cost)),
        tick,
    );
    let exact = complete || cost <= lower_bound * (1.0 + ROUNDING);
    Solved {
        choice,
        cost,
        lower_bound: if exact { cost } else { lower_bound },
        exact,
    }
}

/// How far apart, relatively, two sums of the same entries in different orders may be.
const ROUNDING: f64 = 1e-12;

/// Σ node costs + Σ edge entries of a complete choice, in the enumeration's order.
pub(crate) fn residual_cost(residual: &Residual, choice: &[usize]) -> f64 {
    strategy_cost(residual.costs, residual.sizes, residual.incoming, choice)
}

/// The spanning-tree relaxation's optimum and, per node, its cheapest config under it.
struct Relaxed {
    optimum: f64,
    minimisers: Vec<usize>,
}

/// The relaxation of `residual` with every entry capped at `cap` (the tree passes need finite
/// entries; an infinite `cap` caps at twice the largest finite entry plus one). Capping only
/// lowers entries, so the optimum stays a lower bound; its minimisers are a start for the local
/// search, not a claim.
fn relaxed(residual: &Residual, cap: f64) -> Relaxed {
    let cap = if cap.is_finite() {
        cap
    } else {
        let finite_max = residual
            .costs
            .iter()
            .flat_map(|c| c.iter())
            .chain(
                residual
                    .incoming
                    .iter()
                    .flatten()
                    .flat_map(|(_, t)| t.iter()),
            )
            .copied()
            .filter(|x| x.is_finite())
            .fold(0.0f64, f64::max);
        2.0 * finite_max + 1.0
    };
    let clamp = |v: &[f64]| -> Vec<f64> { v.iter().map(|&x| x.min(cap)).collect() };
    let unary: Vec<Vec<f64>> = residual.costs.iter().map(|c| clamp(c)).collect();
    let tables: Vec<(usize, usize, Vec<f64>)> = residual
        .incoming
        .iter()
        .enumerate()
        .flat_map(|(dst, ins)| ins.iter().map(move |(src, t)| (*src, dst, t)))
        .map(|(src, dst, t)| (src, dst, clamp(t)))
        .collect();
    let graph = LayoutGraph {
        unary,
        edges: tables
            .iter()
            .map(|(s, d, t)| (*s, *d, t.as_slice()))
            .collect(),
    };
    let marginals = tree_marginals(&graph);
    let minimisers = marginals
        .node
        .iter()
        .map(|m| {
            (0..m.len())
                .min_by(|&a, &b| m[a].total_cmp(&m[b]).then(a.cmp(&b)))
                .unwrap_or(0)
        })
        .collect();
    // one node's least marginal per connected component is that component's relaxed optimum
    let n = residual.costs.len();
    let mut component: Vec<usize> = (0..n).collect();
    let find = |component: &mut Vec<usize>, mut x: usize| {
        while component[x] != x {
            component[x] = component[component[x]];
            x = component[x];
        }
        x
    };
    for (s, d, _) in &graph.edges {
        let (a, b) = (find(&mut component, *s), find(&mut component, *d));
        component[a] = b;
    }
    let optimum = (0..n)
        .filter(|&u| find(&mut component, u) == u)
        .map(|u| min(&marginals.node[u]))
        .sum();
    Relaxed {
        optimum,
        minimisers,
    }
}

/// Per node, the edges at it: (the other node, its table, whether this node is the table's row).
struct Neighbours<'a> {
    at: Vec<Vec<(usize, &'a [f64], bool)>>,
}

/// Sweeps of a local search at most: each strictly lowers the cost, so this is a safety net.
const MAX_SWEEPS: usize = 1000;

impl<'a> Neighbours<'a> {
    fn of(residual: &'a Residual) -> Neighbours<'a> {
        let mut at: Vec<Vec<(usize, &[f64], bool)>> = vec![Vec::new(); residual.costs.len()];
        for (dst, ins) in residual.incoming.iter().enumerate() {
            for (src, table) in ins {
                at[*src].push((dst, table.as_slice(), true));
                at[dst].push((*src, table.as_slice(), false));
            }
        }
        Neighbours { at }
    }

    /// What node `p` at config `c` adds, given its neighbours' configs in `choice`.
    fn local(&self, residual: &Residual, choice: &[usize], p: usize, c: usize) -> f64 {
        let mut total = residual.costs[p][c];
        for &(q, table, row) in &self.at[p] {
            total += if row {
                table[c * residual.sizes[q] + choice[q]]
            } else {
                table[choice[q] * residual.sizes[p] + c]
            };
        }
        total
    }

    /// Iterated conditional modes from `choice`: nodes in order take their cheapest config given
    /// the others (the lowest index among equals), until a sweep changes nothing.
    fn descend(&self, residual: &Residual, mut choice: Vec<usize>) -> Vec<usize> {
        for _ in 0..MAX_SWEEPS {
            let mut changed = false;
            for p in 0..choice.len() {
                let current = self.local(residual, &choice, p, choice[p]);
                let (best, cost) = (0..residual.sizes[p])
                    .map(|c| (c, self.local(residual, &choice, p, c)))
                    .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
                    .expect("every node has a config");
                if cost < current {
                    choice[p] = best;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        choice
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::rng::Rng;
    use std::rc::Rc;

    /// A random dense residual graph: every node reads every earlier one, tables with zeros on
    /// the diagonal (equal configs move nothing) and positive entries elsewhere.
    fn dense(nodes: usize, configs: usize, seed: u64) -> (Vec<Vec<f64>>, Vec<Vec<InEdge>>) {
        let mut rng = Rng::new(seed);
        let costs = (0..nodes)
            .map(|_| {
                (0..configs)
                    .map(|_| rng.uniform(0.0, 10.0) as f64)
                    .collect()
            })
            .collect();
        let incoming = (0..nodes)
            .map(|d| {
                (0..d)
                    .map(|s| {
                        let table: Vec<f64> = (0..configs * configs)
                            .map(|i| match i / configs == i % configs {
                                true => 0.0,
                                false => rng.uniform(0.0, 3.0) as f64,
                            })
                            .collect();
                        (s, Rc::new(table))
                    })
                    .collect()
            })
            .collect();
        (costs, incoming)
    }

    /// Entries the bounded eliminations left out are infinite: the bounds still bracket the
    /// optimum, without NaN, and a core whose every strategy is infinite comes back as such.
    #[test]
    fn infinite_entries_keep_the_bracket() {
        for seed in 0..20 {
            let (nodes, configs) = (4 + seed as usize % 3, 3);
            let (costs, mut incoming) = dense(nodes, configs, 100 + seed);
            let mut rng = Rng::new(seed);
            for ins in incoming.iter_mut() {
                for (_, table) in ins.iter_mut() {
                    let mut t = (**table).clone();
                    for x in t.iter_mut().filter(|x| **x > 0.0) {
                        if rng.unit() < 0.5 {
                            *x = f64::INFINITY;
                        }
                    }
                    *table = Rc::new(t);
                }
            }
            let costs: Vec<&[f64]> = costs.iter().map(|c| c.as_slice()).collect();
            let sizes = vec![configs; nodes];
            let residual = Residual {
                costs: &costs,
                sizes: &sizes,
                incoming: &incoming,
            };
            let optimum = super::super::exhaustive::enumerate(&costs, &sizes, &incoming, u64::MAX)
                .unwrap()
                .1;
            let bounded = solve(&residual, &[vec![1; nodes]], 0, &|_| {});
            assert!(
                !bounded.lower_bound.is_nan() && !bounded.cost.is_nan(),
                "seed {seed}"
            );
            assert!(
                bounded.lower_bound <= optimum * (1.0 + 1e-12) && optimum <= bounded.cost,
                "seed {seed}: {} ≤ {optimum} ≤ {}",
                bounded.lower_bound,
                bounded.cost
            );
        }
        // every edge infinite: no finite strategy, from any start
        let (costs, incoming) = dense(3, 2, 7);
        let incoming: Vec<Vec<InEdge>> = incoming
            .into_iter()
            .map(|ins| {
                ins.into_iter()
                    .map(|(s, t)| (s, Rc::new(vec![f64::INFINITY; t.len()])))
                    .collect()
            })
            .collect();
        let costs: Vec<&[f64]> = costs.iter().map(|c| c.as_slice()).collect();
        let residual = Residual {
            costs: &costs,
            sizes: &[2, 2, 2],
            incoming: &incoming,
        };
        let solved = solve(&residual, &[], 0, &|_| {});
        assert!(solved.cost.is_infinite() && !solved.lower_bound.is_nan());
    }

    /// Exact where the enumeration finishes; with no budget, the local search's strategy and a
    /// lower bound that bracket the optimum.
    #[test]
    fn brackets_the_optimum() {
        for seed in 0..40 {
            let (nodes, configs) = (3 + seed as usize % 5, 2 + seed as usize % 3);
            let (costs, incoming) = dense(nodes, configs, seed);
            let costs: Vec<&[f64]> = costs.iter().map(|c| c.as_slice()).collect();
            let sizes = vec![configs; nodes];
            let residual = Residual {
                costs: &costs,
                sizes: &sizes,
                incoming: &incoming,
            };
            let exact = solve(&residual, &[], u64::MAX, &|_| {});
            assert!(exact.exact);
            assert_eq!(exact.cost, exact.lower_bound);
            let optimum = super::super::exhaustive::enumerate(&costs, &sizes, &incoming, u64::MAX)
                .unwrap()
                .1;
            assert!(
                (exact.cost - optimum).abs() <= 1e-12 * optimum,
                "seed {seed}"
            );
            let bounded = solve(&residual, &[vec![0; nodes]], 0, &|_| {});
            assert!(
                bounded.lower_bound <= optimum * (1.0 + 1e-12) && optimum <= bounded.cost,
                "seed {seed}: {} ≤ {optimum} ≤ {}",
                bounded.lower_bound,
                bounded.cost
            );
            assert_eq!(bounded.cost, residual_cost(&residual, &bounded.choice));
            assert_eq!(
                bounded.exact,
                bounded.cost <= bounded.lower_bound * (1.0 + ROUNDING)
            );
        }
    }
}
