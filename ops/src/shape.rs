//! N-d extents and half-open boxes. Images are NCHW, dense activations NC.
//!
//! Both types are `Copy` and stack-allocated (at most [`MAX_DIMS`] dims) because the planner evaluates
//! millions of tile overlaps during a search.

use serde::{Deserialize, Serialize};
use std::fmt;

pub const MAX_DIMS: usize = 4;

/// The most elements one tensor of a model may have: 2^40, 4 TiB of f32, far past any device's
/// memory. The graph builder refuses larger tensors, so every element count and byte count derived
/// from a built graph (tiles, sums over layers, bytes at 8 per element) stays far inside `u64`.
pub const MAX_ELEMENTS: usize = 1 << 40;

/// The product of `dims` if it is at most [`MAX_ELEMENTS`]; otherwise what is wrong, for an error
/// message about a tensor of these extents.
pub fn bounded_elements(dims: &[usize]) -> Result<usize, String> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| format!("{dims:?} has more than 2^40 elements (the most a tensor may have)"))
}

/// Named dimensions a layer can be split along (OptCNN Table 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dim {
    /// Sample (batch) dimension.
    N,
    /// Channel dimension (output channels for conv, output features for dense).
    C,
    /// Height.
    H,
    /// Width.
    W,
}

impl Dim {
    pub const ALL: [Dim; 4] = [Dim::N, Dim::C, Dim::H, Dim::W];

    /// Axis of this dim in an NCHW (or NC) tensor.
    pub fn axis(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Dim::N => "n",
            Dim::C => "c",
            Dim::H => "h",
            Dim::W => "w",
        }
    }

    pub fn parse(s: &str) -> Option<Dim> {
        match s {
            "n" => Some(Dim::N),
            "c" => Some(Dim::C),
            "h" => Some(Dim::H),
            "w" => Some(Dim::W),
            _ => None,
        }
    }
}

/// Extents of a tensor: `ndim` used entries of `dims`, the rest are 1.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [usize; MAX_DIMS],
    ndim: usize,
}

impl Shape {
    pub fn new(dims: &[usize]) -> Shape {
        assert!(
            dims.len() <= MAX_DIMS,
            "shape {dims:?} has more than {MAX_DIMS} dims"
        );
        let mut d = [1; MAX_DIMS];
        d[..dims.len()].copy_from_slice(dims);
        Shape {
            dims: d,
            ndim: dims.len(),
        }
    }

    pub fn nchw(n: usize, c: usize, h: usize, w: usize) -> Shape {
        Shape::new(&[n, c, h, w])
    }

    pub fn nc(n: usize, c: usize) -> Shape {
        Shape::new(&[n, c])
    }

    pub fn ndim(&self) -> usize {
        self.ndim
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.ndim]
    }

    pub fn dim(&self, axis: usize) -> usize {
        self.dims[axis]
    }

    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }

    /// Row-major strides.
    pub fn strides(&self) -> [usize; MAX_DIMS] {
        let mut s = [0; MAX_DIMS];
        let mut acc = 1;
        for i in (0..self.ndim).rev() {
            s[i] = acc;
            acc *= self.dims[i];
        }
        s
    }

    /// The whole tensor as a rect.
    pub fn full_rect(&self) -> Rect {
        // unused axes are [0, 1) in both types, so the dims are the upper bounds as they are
        Rect {
            lo: [0; MAX_DIMS],
            hi: self.dims,
            ndim: self.ndim,
        }
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(")?;
        for (i, d) in self.dims().iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, ")")
    }
}

impl Serialize for Shape {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.dims().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        let v = Vec::<usize>::deserialize(d)?;
        if v.is_empty() || v.len() > MAX_DIMS {
            return Err(serde::de::Error::custom(format!(
                "a shape has 1 to {MAX_DIMS} dims, got {}",
                v.len()
            )));
        }
        if v.contains(&0) {
            return Err(serde::de::Error::custom(format!(
                "shape {v:?} has a zero extent"
            )));
        }
        Ok(Shape::new(&v))
    }
}

/// A half-open box `[lo, hi)` per axis.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rect {
    pub lo: [usize; MAX_DIMS],
    pub hi: [usize; MAX_DIMS],
    ndim: usize,
}

impl Rect {
    pub fn new(lo: &[usize], hi: &[usize]) -> Rect {
        assert_eq!(lo.len(), hi.len(), "rect bounds of different rank");
        assert!(lo.len() <= MAX_DIMS);
        let mut l = [0; MAX_DIMS];
        let mut h = [1; MAX_DIMS];
        l[..lo.len()].copy_from_slice(lo);
        h[..hi.len()].copy_from_slice(hi);
        Rect {
            lo: l,
            hi: h,
            ndim: lo.len(),
        }
    }

    pub fn ndim(&self) -> usize {
        self.ndim
    }

    #[inline]
    pub fn extent(&self, axis: usize) -> usize {
        self.hi[axis].saturating_sub(self.lo[axis])
    }

    /// Extents as a shape (empty axes give 0 volume).
    pub fn shape(&self) -> Shape {
        let mut d = [1; MAX_DIMS];
        for (i, e) in d.iter_mut().enumerate().take(self.ndim) {
            *e = self.extent(i);
        }
        Shape {
            dims: d,
            ndim: self.ndim,
        }
    }

    #[inline]
    pub fn volume(&self) -> usize {
        (0..self.ndim).map(|i| self.extent(i)).product()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.volume() == 0
    }

    pub fn intersect(&self, other: &Rect) -> Rect {
        debug_assert_eq!(self.ndim, other.ndim);
        let mut r = *self;
        for i in 0..self.ndim {
            r.lo[i] = self.lo[i].max(other.lo[i]);
            r.hi[i] = self.hi[i].min(other.hi[i]).max(r.lo[i]);
        }
        r
    }

    pub fn overlaps(&self, other: &Rect) -> bool {
        !self.intersect(other).is_empty()
    }

    pub fn contains(&self, other: &Rect) -> bool {
        other.is_empty()
            || (0..self.ndim).all(|i| self.lo[i] <= other.lo[i] && other.hi[i] <= self.hi[i])
    }

    /// Where this rect's elements lie in a row-major buffer laid out over `outer`, when they are
    /// one contiguous run (every axis but the first spans `outer`'s whole extent, e.g. a range
    /// of samples); `None` otherwise or when `outer` does not contain it.
    pub fn contiguous_in(&self, outer: &Rect) -> Option<std::ops::Range<usize>> {
        if self.ndim != outer.ndim || !outer.contains(self) || self.is_empty() {
            return None;
        }
        if (1..self.ndim).any(|a| self.lo[a] != outer.lo[a] || self.hi[a] != outer.hi[a]) {
            return None;
        }
        let start = outer.offset_of(&self.lo);
        Some(start..start + self.volume())
    }

    /// This rect with axis `axis` replaced by `[lo, hi)`.
    pub fn with_axis(&self, axis: usize, lo: usize, hi: usize) -> Rect {
        let mut r = *self;
        r.lo[axis] = lo;
        r.hi[axis] = hi;
        r
    }

    /// This rect minus `other`, as disjoint rects: slabs cut off axis by axis, at most two per
    /// axis.
    pub fn subtract(&self, other: &Rect) -> Vec<Rect> {
        if !self.overlaps(other) {
            return vec![*self];
        }
        let mut rest = *self;
        let mut out = Vec::new();
        for axis in 0..self.ndim {
            if rest.lo[axis] < other.lo[axis] {
                out.push(rest.with_axis(axis, rest.lo[axis], other.lo[axis]));
                rest.lo[axis] = other.lo[axis];
            }
            if rest.hi[axis] > other.hi[axis] {
                out.push(rest.with_axis(axis, other.hi[axis], rest.hi[axis]));
                rest.hi[axis] = other.hi[axis];
            }
        }
        out
    }

    /// Row-major offset of global point `p` inside a buffer laid out over this rect.
    pub fn offset_of(&self, p: &[usize; MAX_DIMS]) -> usize {
        (0..self.ndim).fold(0, |off, i| off * self.extent(i) + (p[i] - self.lo[i]))
    }
}

impl fmt::Debug for Rect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Rect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for i in 0..self.ndim {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}..{}", self.lo[i], self.hi[i])?;
        }
        write!(f, "]")
    }
}

/// Copies the part of `src` (laid out over `src_rect`) that lies in `region` into `dst` (laid out over
/// `dst_rect`). `region` must be inside both rects. Contiguous runs are copied as slices.
pub fn copy_rect<T: Copy>(
    src: &[T],
    src_rect: &Rect,
    dst: &mut [T],
    dst_rect: &Rect,
    region: &Rect,
) {
    for_each_run(region, src_rect, dst_rect, |s, d, len| {
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    });
}

/// Adds the part of `src` that lies in `region` into `dst` (both laid out over their rects).
pub fn add_rect<T: Copy + std::ops::AddAssign>(
    src: &[T],
    src_rect: &Rect,
    dst: &mut [T],
    dst_rect: &Rect,
    region: &Rect,
) {
    for_each_run(region, src_rect, dst_rect, |s, d, len| {
        for (o, i) in dst[d..d + len].iter_mut().zip(&src[s..s + len]) {
            *o += *i;
        }
    });
}

/// Calls `f(a_offset, b_offset, len)` for every run of `region` that is contiguous in both layouts
/// `a` and `b` (row-major over their rects), in row-major order. `region` must lie inside both.
///
/// Trailing axes that `region`, `a` and `b` all span entirely merge into one run: a 1×1 conv
/// weight `[out, in, 1, 1]` is one run, not `out·in` runs of one element.
pub fn for_each_run(region: &Rect, a: &Rect, b: &Rect, mut f: impl FnMut(usize, usize, usize)) {
    debug_assert!(
        a.contains(region) && b.contains(region),
        "{region} outside {a} or {b}"
    );
    let nd = region.ndim();
    if nd == 0 || region.is_empty() {
        return;
    }
    let spans_whole = |axis: usize| {
        let (lo, hi) = (region.lo[axis], region.hi[axis]);
        a.lo[axis] == lo && a.hi[axis] == hi && b.lo[axis] == lo && b.hi[axis] == hi
    };
    // Axes `inner..nd` form one run; the odometer walks the axes before `inner`.
    let mut inner = nd - 1;
    let mut len = region.extent(inner);
    while inner > 0 && spans_whole(inner) {
        inner -= 1;
        len *= region.extent(inner);
    }
    let (mut a_stride, mut b_stride) = ([0; MAX_DIMS], [0; MAX_DIMS]);
    let (mut sa, mut sb) = (1, 1);
    for axis in (0..nd).rev() {
        a_stride[axis] = sa;
        b_stride[axis] = sb;
        sa *= a.extent(axis);
        sb *= b.extent(axis);
    }
    let mut p = region.lo;
    let (mut oa, mut ob) = (a.offset_of(&p), b.offset_of(&p));
    loop {
        f(oa, ob, len);
        let mut axis = inner;
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            p[axis] += 1;
            oa += a_stride[axis];
            ob += b_stride[axis];
            if p[axis] < region.hi[axis] {
                break;
            }
            let back = region.extent(axis);
            p[axis] = region.lo[axis];
            oa -= back * a_stride[axis];
            ob -= back * b_stride[axis];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_ranges_are_contiguous_runs_and_other_boxes_are_not() {
        let whole = Rect::new(&[0, 0, 0, 0], &[8, 3, 4, 4]);
        let samples = Rect::new(&[2, 0, 0, 0], &[5, 3, 4, 4]);
        assert_eq!(samples.contiguous_in(&whole), Some(96..240));
        assert_eq!(whole.contiguous_in(&whole), Some(0..384));
        let held = Rect::new(&[4, 0, 0, 0], &[8, 3, 4, 4]);
        assert_eq!(
            Rect::new(&[5, 0, 0, 0], &[6, 3, 4, 4]).contiguous_in(&held),
            Some(48..96)
        );
        // a channel block, a spatial block, a box outside, an empty one
        assert_eq!(
            Rect::new(&[0, 1, 0, 0], &[8, 2, 4, 4]).contiguous_in(&whole),
            None
        );
        assert_eq!(
            Rect::new(&[0, 0, 0, 0], &[8, 3, 2, 4]).contiguous_in(&whole),
            None
        );
        assert_eq!(samples.contiguous_in(&held), None);
        assert_eq!(
            Rect::new(&[2, 0, 0, 0], &[2, 3, 4, 4]).contiguous_in(&whole),
            None
        );
    }

    #[test]
    fn intersect_and_contains() {
        let a = Rect::new(&[0, 0], &[4, 4]);
        let b = Rect::new(&[2, 3], &[6, 8]);
        assert_eq!(a.intersect(&b), Rect::new(&[2, 3], &[4, 4]));
        assert!(a.overlaps(&b));
        let c = Rect::new(&[4, 0], &[5, 4]);
        assert!(!a.overlaps(&c));
        assert!(a.contains(&Rect::new(&[1, 1], &[3, 4])));
        assert!(!a.contains(&b));
    }

    #[test]
    fn copy_rect_moves_exactly_the_region() {
        let src_rect = Rect::new(&[0, 0], &[3, 4]);
        let src: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let dst_rect = Rect::new(&[1, 1], &[3, 3]);
        let mut dst = vec![0.0; 4];
        copy_rect(&src, &src_rect, &mut dst, &dst_rect, &dst_rect);
        assert_eq!(dst, vec![5.0, 6.0, 9.0, 10.0]);
        add_rect(
            &src,
            &src_rect,
            &mut dst,
            &dst_rect,
            &Rect::new(&[2, 2], &[3, 3]),
        );
        assert_eq!(dst, vec![5.0, 6.0, 9.0, 20.0]);
    }

    /// Every element of `region`, visited one at a time: what the runs must add up to.
    fn element_offsets(region: &Rect, a: &Rect, b: &Rect) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut p = region.lo;
        if region.is_empty() {
            return out;
        }
        loop {
            out.push((a.offset_of(&p), b.offset_of(&p)));
            let mut axis = region.ndim();
            loop {
                if axis == 0 {
                    return out;
                }
                axis -= 1;
                p[axis] += 1;
                if p[axis] < region.hi[axis] {
                    break;
                }
                p[axis] = region.lo[axis];
            }
        }
    }

    #[test]
    fn runs_cover_the_region_element_by_element_and_merge_whole_axes() {
        let mut rng = crate::rng::Rng::new(11);
        for _ in 0..500 {
            let nd = 1 + rng.below(4);
            let (mut alo, mut ahi, mut blo, mut bhi, mut rlo, mut rhi) =
                (vec![], vec![], vec![], vec![], vec![], vec![]);
            for _ in 0..nd {
                // small extents with frequent equal bounds, so whole-axis merges happen
                let (lo, hi) = (rng.below(2), 2 + rng.below(3));
                let (l, h) = (lo + rng.below(2), hi - rng.below(2));
                alo.push(lo.min(l));
                ahi.push(hi);
                blo.push(l.min(lo + rng.below(2)));
                bhi.push(h.max(hi - rng.below(2)));
                rlo.push(l);
                rhi.push(h);
            }
            let (a, b) = (Rect::new(&alo, &ahi), Rect::new(&blo, &bhi));
            let region = Rect::new(&rlo, &rhi).intersect(&a).intersect(&b);
            let mut visited = Vec::new();
            let mut runs = 0;
            for_each_run(&region, &a, &b, |oa, ob, len| {
                runs += 1;
                visited.extend((0..len).map(|i| (oa + i, ob + i)));
            });
            assert_eq!(
                visited,
                element_offsets(&region, &a, &b),
                "{region} in {a}, {b}"
            );
            if a == region && b == region {
                assert!(runs <= 1, "a whole rect is one run");
            }
        }
        // a 1×1 conv weight's block of output channels is one run
        let w = Rect::new(&[0, 0, 0, 0], &[448, 1280, 1, 1]);
        let block = Rect::new(&[112, 0, 0, 0], &[224, 1280, 1, 1]);
        let mut runs = Vec::new();
        for_each_run(&block, &w, &block, |oa, ob, len| runs.push((oa, ob, len)));
        assert_eq!(runs, vec![(112 * 1280, 0, 112 * 1280)]);
    }

    #[test]
    fn full_rect_spans_every_axis_of_every_rank() {
        for dims in [&[7][..], &[3, 5], &[2, 3, 4], &[8, 3, 32, 31]] {
            let shape = Shape::new(dims);
            let full = shape.full_rect();
            assert_eq!(full, Rect::new(&vec![0; dims.len()], dims));
            assert_eq!(full.shape(), shape);
            assert_eq!(full.volume(), shape.numel());
        }
    }

    #[test]
    fn shape_json_rejects_zero_and_rank() {
        assert!(serde_json::from_str::<Shape>("[1,0]").is_err());
        assert!(serde_json::from_str::<Shape>("[1,2,3,4,5]").is_err());
        let s: Shape = serde_json::from_str("[8,3,32,32]").unwrap();
        assert_eq!(s.numel(), 8 * 3 * 32 * 32);
    }
}
