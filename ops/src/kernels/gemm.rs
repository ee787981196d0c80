//! A safe, bounds-checked front end to the `gemm` crate for f32 matrices held in slices.
//!
//! Every matrix product in the kernels goes through [`matmul`]; this is the only place in the crate
//! that calls the crate's `unsafe` entry point. Matrices are described by a slice starting at element
//! (0, 0) plus a row stride and a column stride, so sub-blocks and transposes are free views.
//!
//! `with_scratch` lends the kernels a per-thread workspace for the matrices they build.

use std::cell::Cell;

/// How many threads a product may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// Run on the calling thread only (the caller already parallelises over independent work).
    One,
    /// Split the product over the global rayon pool (the crate falls back to one thread when the
    /// product is too small to benefit).
    Pool,
}

impl Threads {
    fn parallelism(self) -> gemm::Parallelism {
        match self {
            Threads::One => gemm::Parallelism::None,
            // 0 = as many threads as the current rayon pool has.
            Threads::Pool => gemm::Parallelism::Rayon(0),
        }
    }
}

/// A read-only `rows`×`cols` matrix: element (i, j) is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    /// A row-major matrix whose rows start `row_stride` elements apart, beginning at `data[0]`.
    ///
    /// Panics if the matrix does not fit in `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize, row_stride: usize) -> Mat<'a> {
        let m = Mat {
            data,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        };
        assert!(
            span(rows, cols, row_stride, 1) <= data.len(),
            "{rows}x{cols} matrix with row stride {row_stride} does not fit in {} elements",
            data.len()
        );
        m
    }

    /// A densely packed row-major matrix.
    pub fn packed(data: &'a [f32], rows: usize, cols: usize) -> Mat<'a> {
        Mat::new(data, rows, cols, cols)
    }

    /// The transpose, as a view of the same data.
    pub fn t(self) -> Mat<'a> {
        Mat {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A writable row-major `rows`×`cols` matrix; rows start `row_stride ≥ cols` elements apart so that no
/// two elements share memory.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatMut<'a> {
    /// Panics if the matrix does not fit in `data` or its rows would overlap.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize, row_stride: usize) -> MatMut<'a> {
        assert!(
            rows <= 1 || row_stride >= cols,
            "rows of a {rows}x{cols} output matrix overlap with row stride {row_stride}"
        );
        assert!(
            span(rows, cols, row_stride, 1) <= data.len(),
            "{rows}x{cols} matrix with row stride {row_stride} does not fit in {} elements",
            data.len()
        );
        MatMut {
            data,
            rows,
            cols,
            row_stride,
        }
    }

    pub fn packed(data: &'a mut [f32], rows: usize, cols: usize) -> MatMut<'a> {
        MatMut::new(data, rows, cols, cols)
    }
}

/// Number of elements from (0, 0) to one past the last element, 0 for an empty matrix.
fn span(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * row_stride + (cols - 1) * col_stride + 1
    }
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`.
///
/// Panics if the dimensions disagree.
pub fn matmul(dst: MatMut<'_>, lhs: Mat<'_>, rhs: Mat<'_>, accumulate: bool, threads: Threads) {
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    assert!(
        lhs.rows == m && rhs.rows == k && rhs.cols == n,
        "matmul of {}x{} by {}x{} into {m}x{n}",
        lhs.rows,
        lhs.cols,
        rhs.rows,
        rhs.cols
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                let start = i * dst.row_stride;
                dst.data[start..start + n].fill(0.0);
            }
        }
        return;
    }
    // Strides of slices are below isize::MAX elements, so these conversions cannot fail for matrices
    // that passed the constructors' fit checks; keep them checked anyway.
    let stride = |s: usize| isize::try_from(s).expect("matrix stride exceeds isize::MAX");
    // SAFETY: the constructors checked that every element (i, j) with i < rows, j < cols of each
    // matrix lies inside its slice, and the dimension assert above checked that `gemm` indexes exactly
    // those ranges (m×k of lhs, k×n of rhs, m×n of dst). `dst` borrows its slice exclusively while
    // `lhs` and `rhs` are shared borrows, so the output cannot alias the inputs, and `MatMut::new`
    // guarantees distinct (i, j) map to distinct elements, so parallel writes never collide. With
    // `read_dst = false` the crate never reads `dst`, so its previous contents may be anything.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            1,
            stride(dst.row_stride),
            accumulate,
            lhs.data.as_ptr(),
            stride(lhs.col_stride),
            stride(lhs.row_stride),
            rhs.data.as_ptr(),
            stride(rhs.col_stride),
            stride(rhs.row_stride),
            1.0,
            1.0,
            false,
            false,
            false,
            threads.parallelism(),
        );
    }
}

thread_local! {
    /// Per-thread workspace for GEMM operands (column matrices, copied weight blocks, transposed
    /// results), reused across kernel calls so that repeated calls neither allocate nor fault in fresh
    /// pages; it keeps the largest size requested on its thread.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on this thread's scratch cut into pieces of the given lengths (contents unspecified).
pub(crate) fn with_scratch<const N: usize, R>(
    lens: [usize; N],
    f: impl FnOnce([&mut [f32]; N]) -> R,
) -> R {
    // Taking the buffer out (rather than borrowing it) keeps a nested call on the same thread (rayon
    // work stealing while a GEMM waits) safe: it simply finds the slot empty and uses its own.
    let mut buf = SCRATCH.take();
    let total = lens.iter().sum();
    if buf.len() < total {
        buf.resize(total, 0.0);
    }
    let mut rest = &mut buf[..total];
    let pieces = lens.map(|len| {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        piece
    });
    let result = f(pieces);
    let other = SCRATCH.take();
    SCRATCH.set(if other.len() > buf.len() { other } else { buf });
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{max_rel_diff, random};

    fn naive(lhs: &Mat, rhs: &Mat) -> Vec<f32> {
        let mut out = vec![0.0; lhs.rows * rhs.cols];
        for i in 0..lhs.rows {
            for j in 0..rhs.cols {
                let mut acc = 0f64;
                for p in 0..lhs.cols {
                    acc += lhs.data[i * lhs.row_stride + p * lhs.col_stride] as f64
                        * rhs.data[p * rhs.row_stride + j * rhs.col_stride] as f64;
                }
                out[i * rhs.cols + j] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn transposed_and_strided_operands_match_naive_product() {
        let (m, n, k) = (37, 29, 53);
        let a = random(k * (m + 3), 1);
        let b = random(n * (k + 5), 2);
        // lhs: transpose of a k×m block stored with row stride m+3; rhs: transpose of n×k, stride k+5.
        let lhs = Mat::new(&a, k, m, m + 3).t();
        let rhs = Mat::new(&b, n, k, k + 5).t();
        let want = naive(&lhs, &rhs);
        for threads in [Threads::One, Threads::Pool] {
            let mut dst = vec![f32::NAN; m * (n + 2)];
            matmul(MatMut::new(&mut dst, m, n, n + 2), lhs, rhs, false, threads);
            let got: Vec<f32> = dst.chunks(n + 2).flat_map(|r| r[..n].to_vec()).collect();
            assert!(max_rel_diff(&got, &want) < 1e-5);
            // The padding columns between rows are left alone.
            assert!(
                dst.chunks(n + 2)
                    .all(|r| r[n].is_nan() && r[n + 1].is_nan())
            );
        }
    }

    #[test]
    fn accumulate_adds_to_destination() {
        let (m, n, k) = (8, 70, 40);
        let a = random(m * k, 3);
        let b = random(k * n, 4);
        let lhs = Mat::packed(&a, m, k);
        let rhs = Mat::packed(&b, k, n);
        let mut dst = vec![1.0; m * n];
        matmul(MatMut::packed(&mut dst, m, n), lhs, rhs, true, Threads::One);
        let want: Vec<f32> = naive(&lhs, &rhs).iter().map(|v| v + 1.0).collect();
        assert!(max_rel_diff(&dst, &want) < 1e-5);
    }

    #[test]
    fn empty_inner_dimension_clears_or_keeps() {
        let mut dst = vec![5.0; 6];
        let none: [f32; 0] = [];
        matmul(
            MatMut::packed(&mut dst, 2, 3),
            Mat::packed(&none, 2, 0),
            Mat::packed(&none, 0, 3),
            true,
            Threads::One,
        );
        assert_eq!(dst, vec![5.0; 6]);
        matmul(
            MatMut::packed(&mut dst, 2, 3),
            Mat::packed(&none, 2, 0),
            Mat::packed(&none, 0, 3),
            false,
            Threads::Pool,
        );
        assert_eq!(dst, vec![0.0; 6]);
    }

    #[test]
    fn scratch_pieces_have_the_asked_lengths_even_when_nested() {
        with_scratch([3, 0, 5], |[a, b, c]| {
            assert_eq!((a.len(), b.len(), c.len()), (3, 0, 5));
            a.fill(1.0);
            // A nested request on the same thread gets its own buffer, not the one in use.
            with_scratch([4], |[d]| {
                d.fill(2.0);
                assert_eq!(d.len(), 4);
            });
            assert!(a.iter().all(|&v| v == 1.0));
        });
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn out_of_bounds_matrix_is_rejected() {
        let data = vec![0.0; 10];
        let _ = Mat::new(&data, 3, 4, 4);
    }
}
