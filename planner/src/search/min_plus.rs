//! The min-plus product of node elimination (Eq. 2), the search's inner loop.
//!
//! `out[i][k] = min_j a[i][j] + mid[j] + b[j][k]` over `|C_i|·|C_j|·|C_k|` terms. It stays exact while
//! skipping most of them: columns `k` are grouped (configs of one layout cost alike), and a `j` is
//! skipped for a group when even its cheapest entry in that group, `a[i][j] + mid[j] + min_k b[j][k]`,
//! cannot beat the group's current worst minimum. Rows scan `j` from the most parallel configs down,
//! which finds good minima early. (On Inception-v3 at 16 devices this relaxes ~6% of the terms.)
//! With a [`Limit`], entries start at their limit instead of +∞, so the same tests also skip every
//! `j` that cannot bring an entry below it, and rows that no `j` can are skipped whole.

use std::ops::Range;

/// Columns per group at least: smaller groups bound better but cost a test each (measured on
/// Inception-v3 at 16 devices: 8 is the sweet spot between 1 and 32).
const MIN_GROUP: usize = 8;

/// Contiguous ranges of columns: whole layouts (whose configs differ only in their device block and
/// cost alike), merged until a group has [`MIN_GROUP`] columns. `layouts` gives each column's
/// layout; a layout's columns are contiguous.
pub(crate) fn column_groups(layouts: &[usize]) -> Vec<Range<usize>> {
    let mut groups: Vec<Range<usize>> = Vec::new();
    let mut start = 0;
    for end in 1..=layouts.len() {
        if end < layouts.len() && layouts[end] == layouts[start] {
            continue;
        }
        match groups.last_mut() {
            Some(g) if g.len() < MIN_GROUP => g.end = end,
            _ => groups.push(start..end),
        }
        start = end;
    }
    groups
}

/// Which entries of a product are worth computing: `(c_i, c_k)` only if its value is below
/// `total - rows[c_i] - cols[c_k]`.
///
/// The search passes the cost of a known strategy less lower bounds of everything else in the
/// graph (see `optcnn`): an entry at or above that limit belongs to no optimal strategy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limit<'a> {
    /// Infinite: no limit (every entry exact).
    pub total: f64,
    /// Subtracted per `c_i` (finite, so that an infinite `total` leaves every limit infinite).
    pub rows: &'a [f64],
    /// Subtracted per `c_k` (finite likewise).
    pub cols: &'a [f64],
}

/// Eq. 2 for all (c_i, c_k) with the minimising `j` (among equal minima, the first scanned), except
/// that entries not below their [`Limit`] are infinite (their `j` then 0), and the smallest entry.
/// `a` is `ci × cj`, `b` is `cj × ck`, both row-major and non-negative; `groups` partition
/// `0..ck`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn min_plus(
    a: &[f64],
    mid: &[f64],
    b: &[f64],
    ci: usize,
    cj: usize,
    ck: usize,
    groups: &[Range<usize>],
    limit: Limit,
) -> (Vec<f64>, Vec<u32>, f64) {
    debug_assert_eq!(groups.iter().map(|g| g.len()).sum::<usize>(), ck);
    debug_assert_eq!((limit.rows.len(), limit.cols.len()), (ci, ck));
    debug_assert!(
        limit.rows.iter().chain(limit.cols).all(|x| x.is_finite()),
        "an infinite total must leave every limit infinite"
    );
    let ng = groups.len();
    // a `j` whose column of `a` is infinite throughout (pruned tables have many) is never used:
    // its row of `b` needs no minima
    let mut used = vec![false; cj];
    for a_row in a.chunks(cj) {
        for (u, x) in used.iter_mut().zip(a_row) {
            *u |= *x < f64::INFINITY;
        }
    }
    let mut b_min = vec![f64::INFINITY; cj * ng];
    for j in (0..cj).filter(|&j| used[j]) {
        for (g, r) in groups.iter().enumerate() {
            b_min[j * ng + g] = min(&b[j * ck + r.start..j * ck + r.end]);
        }
    }
    // the cheapest entry of each row of `b`: a `j` whose cheapest term cannot beat every group's
    // worst minimum is skipped without testing its groups one by one
    let row_min: Vec<f64> = b_min.chunks(ng).map(min).collect();
    // what a `j` adds to a row's entries at least, and the largest limit of a row but for its
    // `limit.rows` term: a row where no `j` gets below that is infinite throughout (most rows, once
    // the limits are tight), found in one pass over the row of `a`
    let via: Vec<f64> = mid.iter().zip(&row_min).map(|(m, r)| m + r).collect();
    let cols_min = min(limit.cols);
    let mut out = vec![f64::INFINITY; ci * ck];
    let mut arg = vec![0; ci * ck];
    let mut worst = vec![f64::INFINITY; ng];
    let mut smallest = f64::INFINITY;
    for i in 0..ci {
        let a_row = &a[i * cj..(i + 1) * cj];
        let row_limit = limit.total - limit.rows[i];
        let floor = a_row
            .iter()
            .zip(&via)
            .fold(f64::INFINITY, |m, (x, v)| if x + v < m { x + v } else { m });
        if floor >= row_limit - cols_min {
            continue;
        }
        let out_row = &mut out[i * ck..(i + 1) * ck];
        let arg_row = &mut arg[i * ck..(i + 1) * ck];
        arg_row.fill(UNSET);
        // the limits start as the minima to beat: a `j` is relaxed only if it can go below them
        for (o, &c) in out_row.iter_mut().zip(limit.cols) {
            *o = row_limit - c;
        }
        for (w, r) in worst.iter_mut().zip(groups) {
            *w = out_row[r.clone()]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        }
        let mut worst_any = worst.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for j in (0..cj).rev() {
            let base = a_row[j] + mid[j];
            if base + row_min[j] >= worst_any {
                continue;
            }
            let b_row = &b[j * ck..(j + 1) * ck];
            let mins = &b_min[j * ng..(j + 1) * ng];
            let mut changed = false;
            // test 64 groups at a time without branches, then relax the few that pass (relaxing
            // a group moves only that group's bound)
            for (chunk, mins) in mins.chunks(64).enumerate() {
                let mut pass = 0u64;
                for (g, (&m, &w)) in mins.iter().zip(&worst[chunk * 64..]).enumerate() {
                    pass |= u64::from(base + m < w) << g;
                }
                while pass != 0 {
                    let g = chunk * 64 + pass.trailing_zeros() as usize;
                    pass &= pass - 1;
                    let r = groups[g].clone();
                    if let Some(w) = relax(
                        &mut out_row[r.clone()],
                        &mut arg_row[r.clone()],
                        &b_row[r],
                        base,
                        j as u32,
                    ) {
                        worst[g] = w;
                        changed = true;
                    }
                }
            }
            if !changed {
                continue;
            }
            worst_any = worst.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        }
        for (o, g) in out_row.iter_mut().zip(arg_row.iter_mut()) {
            if *g == UNSET {
                (*o, *g) = (f64::INFINITY, 0);
            } else if *o < smallest {
                smallest = *o;
            }
        }
    }
    (out, arg, smallest)
}

/// The smallest of `values` (infinite if none), in a form that vectorizes (`f64::min` does not).
pub(crate) fn min(values: &[f64]) -> f64 {
    values
        .iter()
        .fold(f64::INFINITY, |m, &x| if x < m { x } else { m })
}

/// The `j` of an entry that no `j` brought below its limit.
const UNSET: u32 = u32::MAX;

/// `out[k] = min(out[k], base + b[k])`, recording `j` where it improves; returns the new max of `out`,
/// or `None` when no column improves.
///
/// Most relaxations that pass the group test improve nothing (3 in 4 on Inception-v3 at 16
/// devices, 1.5 columns on average otherwise): a branch-free scan, which vectorizes, finds those
/// before the update loop.
#[inline]
fn relax(out: &mut [f64], arg: &mut [u32], b: &[f64], base: f64, j: u32) -> Option<f64> {
    let improves = out
        .iter()
        .zip(b)
        .fold(false, |any, (&o, &x)| any | (base + x < o));
    if !improves {
        return None;
    }
    let mut worst = 0.0f64;
    for ((o, g), &x) in out.iter_mut().zip(arg.iter_mut()).zip(b) {
        let v = base + x;
        let better = v < *o;
        *o = if better { v } else { *o };
        *g = if better { j } else { *g };
        worst = if *o > worst { *o } else { worst };
    }
    Some(worst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::rng::Rng;

    fn reference(a: &[f64], mid: &[f64], b: &[f64], ci: usize, cj: usize, ck: usize) -> Vec<f64> {
        let mut out = vec![f64::INFINITY; ci * ck];
        for i in 0..ci {
            for k in 0..ck {
                for j in 0..cj {
                    out[i * ck + k] = out[i * ck + k].min(a[i * cj + j] + mid[j] + b[j * ck + k]);
                }
            }
        }
        out
    }

    /// The product with no limit: every entry exact.
    fn unlimited(
        a: &[f64],
        mid: &[f64],
        b: &[f64],
        ci: usize,
        cj: usize,
        ck: usize,
        groups: &[Range<usize>],
    ) -> (Vec<f64>, Vec<u32>, f64) {
        let (rows, cols) = (vec![0.0; ci], vec![0.0; ck]);
        let none = Limit {
            total: f64::INFINITY,
            rows: &rows,
            cols: &cols,
        };
        min_plus(a, mid, b, ci, cj, ck, groups, none)
    }

    #[test]
    fn matches_the_definition_with_and_without_groups() {
        let mut rng = Rng::new(5);
        for _ in 0..50 {
            let (ci, cj, ck) = (1 + rng.below(9), 1 + rng.below(9), 1 + rng.below(9));
            // spread values over orders of magnitude, with ties, as real tables have
            let mut draw = |n: usize| -> Vec<f64> {
                (0..n)
                    .map(|_| (rng.below(4) as f64) * 10f64.powi(rng.below(4) as i32))
                    .collect()
            };
            let (a, mid, b) = (draw(ci * cj), draw(cj), draw(cj * ck));
            let expected = reference(&a, &mid, &b, ci, cj, ck);
            let split = (1 + rng.below(ck)).min(ck);
            let whole = std::iter::once(0..ck).collect::<Vec<_>>();
            let halves = [0..split, split..ck]
                .into_iter()
                .filter(|g| !g.is_empty())
                .collect();
            for groups in [whole, halves] {
                let (out, arg, smallest) = unlimited(&a, &mid, &b, ci, cj, ck, &groups);
                assert_eq!(out, expected);
                assert_eq!(smallest, min(&out));
                for i in 0..ci {
                    for k in 0..ck {
                        let j = arg[i * ck + k] as usize;
                        assert_eq!(a[i * cj + j] + mid[j] + b[j * ck + k], out[i * ck + k]);
                    }
                }
            }
        }
    }

    #[test]
    fn limits_leave_only_the_entries_below_them() {
        let mut rng = Rng::new(11);
        for _ in 0..200 {
            let (ci, cj, ck) = (1 + rng.below(9), 1 + rng.below(9), 1 + rng.below(9));
            let mut draw = |n: usize, scale: usize| -> Vec<f64> {
                (0..n)
                    .map(|_| (rng.below(scale) as f64) * 10f64.powi(rng.below(3) as i32))
                    .collect()
            };
            let (mut a, mid, b) = (draw(ci * cj, 4), draw(cj, 4), draw(cj * ck, 4));
            let (rows, cols) = (draw(ci, 3), draw(ck, 3));
            let total = draw(1, 600)[0];
            // pruned tables: entries, sometimes whole columns, left infinite
            let dead_column = rng.below(cj + 1);
            for (x, v) in a.iter_mut().enumerate() {
                if x % cj == dead_column || rng.below(5) == 0 {
                    *v = f64::INFINITY;
                }
            }
            let split = (1 + rng.below(ck)).min(ck);
            let groups: Vec<Range<usize>> = [0..split, split..ck]
                .into_iter()
                .filter(|g| !g.is_empty())
                .collect();
            let (exact, exact_arg, _) = unlimited(&a, &mid, &b, ci, cj, ck, &groups);
            let limit = Limit {
                total,
                rows: &rows,
                cols: &cols,
            };
            let (out, arg, smallest) = min_plus(&a, &mid, &b, ci, cj, ck, &groups, limit);
            assert_eq!(smallest, min(&out));
            for (i, row) in rows.iter().enumerate() {
                for (k, col) in cols.iter().enumerate() {
                    let at = i * ck + k;
                    if exact[at] < total - row - col {
                        assert_eq!((out[at], arg[at]), (exact[at], exact_arg[at]));
                    } else {
                        assert_eq!(out[at], f64::INFINITY);
                    }
                }
            }
        }
    }
}
