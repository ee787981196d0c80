//! Dense (fully connected) forward and backward over one output tile: `y = x · Wᵀ + b`.
//!
//! A tile covers samples `[n0, n1)` and output features `[c0, c1)`; it reads those samples' full input
//! rows and weight rows `[c0, c1)`.
//!
//! Batches are small next to the feature counts (32 × 9216 → 4096 in AlexNet), so every product is
//! arranged so that the GEMM streams the weight matrix along its contiguous rows, and is split into
//! blocks of features that run in parallel on the rayon pool with one GEMM thread each.

use super::gemm::{Mat, MatMut, Threads, matmul, with_scratch};
use super::{View, ViewMut};
use crate::op::{Activation, Dense};
use rayon::prelude::*;

/// Output features per parallel block of the forward pass and the weight gradient.
const FEATURE_BLOCK: usize = 512;

/// Input features per parallel block of the input gradient.
const INPUT_BLOCK: usize = 512;

/// Width of the weight panels the input gradient copies: the GEMM micro-kernel's height (64 f32 rows
/// with AVX-512), so that each panel is read strictly sequentially.
const PANEL: usize = 64;

/// Weight rows copied at a time for the input gradient (`ROW_CHUNK × INPUT_BLOCK` floats stay in L2).
const ROW_CHUNK: usize = 256;

/// Computes the output tile `y`.
///
/// - `x`: input view whose rect contains the tile's samples (all input features).
/// - `w`: weight rows of the tile's output features (`OpSpec::param_rect` of parameter 0).
/// - `b`: bias of the same features, when the layer has one.
pub fn dense_forward(op: &Dense, x: View, w: View, b: Option<View>, y: ViewMut) {
    let tile = Tile::new(&x, &w, &y.as_view());
    if let Some(b) = &b {
        debug_assert!(op.bias, "bias given to a dense layer without bias");
        debug_assert_eq!(b.rect.lo[0], y.rect.lo[1]);
        debug_assert_eq!(b.data.len(), tile.features);
    }
    if tile.samples == 0 || tile.features == 0 {
        return;
    }
    // `yᵀ = W · xᵀ`, by blocks of output features: with the weight as the left operand the GEMM
    // streams it along its contiguous rows, which is 2× faster than `x · Wᵀ` for small batches.
    let mut yt = vec![0.0; tile.features * tile.samples];
    let inputs = tile.inputs(x.data);
    yt.par_chunks_mut(FEATURE_BLOCK * tile.samples)
        .enumerate()
        .for_each(|(block, yt_block)| {
            let rows = yt_block.len() / tile.samples;
            let first = block * FEATURE_BLOCK * tile.inputs;
            let weights = Mat::packed(&w.data[first..], rows, tile.inputs);
            let dst = MatMut::packed(yt_block, rows, tile.samples);
            matmul(dst, weights, inputs.t(), false, Threads::One);
        });
    let bias = b.as_ref().map(|b| b.data);
    for (i, y_row) in y.data.chunks_exact_mut(tile.features).enumerate() {
        for (c, y) in y_row.iter_mut().enumerate() {
            let z = yt[c * tile.samples + i] + bias.map_or(0.0, |b| b[c]);
            *y = match op.activation {
                Activation::None => z,
                Activation::Relu if z < 0.0 => 0.0,
                Activation::Relu => z,
            };
        }
    }
}

/// This tile's gradients, overwritten: `dx` over `x.rect` (rows of other samples are zero), `dw` and
/// `db` over the weight/bias rows of the tile's output features.
///
/// `y` is the tile's forward output (after the fused activation) and `dy` the gradient w.r.t. it.
/// Pass `dx: None` when the input gradient is not needed; `db: None` for a layer without bias.
#[allow(clippy::too_many_arguments)]
pub fn dense_backward(
    op: &Dense,
    x: View,
    w: View,
    y: View,
    dy: View,
    dx: Option<ViewMut>,
    dw: ViewMut,
    db: Option<ViewMut>,
) {
    let tile = Tile::new(&x, &w, &y);
    debug_assert_eq!(dy.rect, y.rect);
    debug_assert_eq!(dy.data.len(), y.data.len());
    debug_assert_eq!(dw.rect, w.rect);
    debug_assert_eq!(dw.data.len(), w.data.len());
    if let Some(dx) = &dx {
        debug_assert_eq!(dx.rect, x.rect, "dx must cover the input view");
        debug_assert_eq!(dx.data.len(), x.data.len());
    }
    if let Some(db) = &db {
        debug_assert_eq!(db.data.len(), tile.features);
    }
    if tile.samples == 0 || tile.features == 0 || tile.inputs == 0 {
        // Nothing flows: every gradient of this tile is zero.
        dw.data.fill(0.0);
        if let Some(dx) = dx {
            dx.data.fill(0.0);
        }
        if let Some(db) = db {
            db.data.fill(0.0);
        }
        return;
    }

    let masked;
    let dz = match op.activation {
        Activation::None => dy.data,
        Activation::Relu => {
            masked = y
                .data
                .iter()
                .zip(dy.data)
                .map(|(&y, &g)| if y > 0.0 { g } else { 0.0 })
                .collect::<Vec<f32>>();
            &masked[..]
        }
    };
    if let Some(db) = db {
        db.data.fill(0.0);
        for row in dz.chunks_exact(tile.features) {
            for (d, g) in db.data.iter_mut().zip(row) {
                *d += *g;
            }
        }
    }

    // dW = dzᵀ · x, by blocks of output features.
    let inputs = tile.inputs(x.data);
    dw.data
        .par_chunks_mut(FEATURE_BLOCK * tile.inputs)
        .enumerate()
        .for_each(|(block, dw_block)| {
            let rows = dw_block.len() / tile.inputs;
            let first = block * FEATURE_BLOCK;
            let dzt_block = Mat::new(&dz[first..], tile.samples, rows, tile.features).t();
            let dst = MatMut::packed(dw_block, rows, tile.inputs);
            matmul(dst, dzt_block, inputs, false, Threads::One);
        });

    let Some(dx) = dx else {
        return;
    };
    let (first, end) = tile.input_range();
    dx.data[..first].fill(0.0);
    dx.data[end..].fill(0.0);
    // dx = dz · W, by blocks of input features. The GEMM does not pack W for so few samples and
    // would stride across all of it, so each block is copied, a chunk of rows at a time, into
    // cache-resident panels one micro-kernel wide that the GEMM then streams.
    let mut dx_blocks = vec![0.0; tile.samples * tile.inputs];
    dx_blocks
        .par_chunks_mut(INPUT_BLOCK * tile.samples)
        .enumerate()
        .for_each(|(block, dx_block)| {
            let cols = dx_block.len() / tile.samples;
            let first_col = block * INPUT_BLOCK;
            with_scratch([ROW_CHUNK * cols], |[panels]| {
                for k0 in (0..tile.features).step_by(ROW_CHUNK) {
                    let rows = ROW_CHUNK.min(tile.features - k0);
                    let w_rows = w.data[k0 * tile.inputs..].chunks_exact(tile.inputs);
                    for (r, w_row) in w_rows.take(rows).enumerate() {
                        let segments = w_row[first_col..first_col + cols].chunks(PANEL);
                        for (p, seg) in segments.enumerate() {
                            let at = p * PANEL * rows + r * seg.len();
                            panels[at..at + seg.len()].copy_from_slice(seg);
                        }
                    }
                    let dz_rows = Mat::new(&dz[k0..], tile.samples, rows, tile.features);
                    for p in 0..cols.div_ceil(PANEL) {
                        let width = PANEL.min(cols - p * PANEL);
                        let panel = &panels[p * PANEL * rows..][..rows * width];
                        let dst =
                            MatMut::new(&mut dx_block[p * PANEL..], tile.samples, width, cols);
                        let weights = Mat::packed(panel, rows, width);
                        matmul(dst, dz_rows, weights, k0 > 0, Threads::One);
                    }
                }
            });
        });
    let dx_rows = &mut dx.data[first..end];
    for (block, dx_block) in dx_blocks.chunks(INPUT_BLOCK * tile.samples).enumerate() {
        let cols = dx_block.len() / tile.samples;
        let first_col = block * INPUT_BLOCK;
        for (dst, src) in dx_rows
            .chunks_exact_mut(tile.inputs)
            .zip(dx_block.chunks_exact(cols))
        {
            dst[first_col..first_col + cols].copy_from_slice(src);
        }
    }
}

/// Sizes of a tile and where its samples sit in the input view.
struct Tile {
    samples: usize,
    features: usize,
    inputs: usize,
    /// Row of the tile's first sample within the input view.
    first_row: usize,
}

impl Tile {
    fn new(x: &View, w: &View, y: &View) -> Tile {
        debug_assert_eq!(x.rect.ndim(), 2, "dense input is NC");
        debug_assert_eq!(x.data.len(), x.rect.volume());
        debug_assert_eq!(y.data.len(), y.rect.volume());
        debug_assert_eq!(w.data.len(), w.rect.volume());
        debug_assert!(
            y.rect.is_empty() || (x.rect.lo[0] <= y.rect.lo[0] && y.rect.hi[0] <= x.rect.hi[0]),
            "input view {} does not contain the samples of output tile {}",
            x.rect,
            y.rect
        );
        debug_assert_eq!(x.rect.lo[1], 0, "the input view holds whole input rows");
        debug_assert_eq!(x.rect.extent(1), w.rect.extent(1));
        debug_assert_eq!(
            (w.rect.lo[0], w.rect.hi[0]),
            (y.rect.lo[1], y.rect.hi[1]),
            "weight view must cover the tile's output features"
        );
        Tile {
            samples: y.rect.extent(0),
            features: y.rect.extent(1),
            inputs: x.rect.extent(1),
            first_row: y.rect.lo[0].saturating_sub(x.rect.lo[0]),
        }
    }

    /// Element range of the tile's samples within the input view.
    fn input_range(&self) -> (usize, usize) {
        let first = self.first_row * self.inputs;
        (first, first + self.samples * self.inputs)
    }

    fn inputs<'a>(&self, x: &'a [f32]) -> Mat<'a> {
        let (first, end) = self.input_range();
        Mat::packed(&x[first..end], self.samples, self.inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::{assert_grad, cut, halves, max_rel_diff, random};
    use crate::op::OpSpec;
    use crate::shape::{Rect, Shape, add_rect};

    struct Case {
        op: Dense,
        input: Shape,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Option<Vec<f32>>,
        dy: Vec<f32>,
    }

    impl Case {
        fn new(op: Dense, input: Shape, seed: u64) -> Case {
            let outputs = input.dim(0) * op.out_features;
            Case {
                x: random(input.numel(), seed),
                w: random(op.out_features * input.dim(1), seed + 1),
                b: op.bias.then(|| random(op.out_features, seed + 2)),
                dy: random(outputs, seed + 3),
                op,
                input,
            }
        }

        fn output(&self) -> Rect {
            Shape::nc(self.input.dim(0), self.op.out_features).full_rect()
        }

        fn w_rect(&self) -> Rect {
            Shape::nc(self.op.out_features, self.input.dim(1)).full_rect()
        }

        fn b_rect(&self) -> Rect {
            Shape::new(&[self.op.out_features]).full_rect()
        }

        fn forward(&self, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
            self.forward_as(&self.op, x, w, b)
        }

        /// The forward pass of `op` (this case's layer with other attributes) on these shapes.
        fn forward_as(&self, op: &Dense, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
            let out = self.output();
            let mut y = vec![f32::NAN; out.volume()];
            dense_forward(
                op,
                View::new(self.input.full_rect(), x),
                View::new(self.w_rect(), w),
                b.map(|b| View::new(self.b_rect(), b)),
                ViewMut::new(out, &mut y),
            );
            y
        }

        fn backward(&self, y: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let out = self.output();
            let mut dx = vec![f32::NAN; self.x.len()];
            let mut dw = vec![f32::NAN; self.w.len()];
            let mut db = vec![f32::NAN; self.op.out_features];
            dense_backward(
                &self.op,
                View::new(self.input.full_rect(), &self.x),
                View::new(self.w_rect(), &self.w),
                View::new(out, y),
                View::new(out, &self.dy),
                Some(ViewMut::new(self.input.full_rect(), &mut dx)),
                ViewMut::new(self.w_rect(), &mut dw),
                self.b
                    .is_some()
                    .then(|| ViewMut::new(self.b_rect(), &mut db)),
            );
            (dx, dw, db)
        }

        fn loss(&self, y: &[f32]) -> f64 {
            y.iter()
                .zip(&self.dy)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum()
        }
    }

    fn cases() -> Vec<Case> {
        vec![
            Case::new(Dense::new(7), Shape::nc(5, 13), 1),
            Case::new(Dense::new(9).relu(), Shape::nc(4, 11), 2),
            Case::new(Dense::new(6).no_bias().relu(), Shape::nc(3, 70), 3),
            // More features than one parallel block, row chunk and panel in every direction.
            Case::new(Dense::new(530).relu(), Shape::nc(3, 600), 4),
        ]
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        let d = max_rel_diff(got, want);
        assert!(d <= 1e-5, "{what}: relative difference {d}");
    }

    #[test]
    fn matches_straight_loops() {
        for case in cases() {
            let (n, k, m) = (case.input.dim(0), case.input.dim(1), case.op.out_features);
            let mut want = vec![0f32; n * m];
            for i in 0..n {
                for j in 0..m {
                    let dot: f64 = (0..k)
                        .map(|p| case.x[i * k + p] as f64 * case.w[j * k + p] as f64)
                        .sum();
                    let v = (dot + case.b.as_ref().map_or(0.0, |b| b[j] as f64)) as f32;
                    want[i * m + j] = match case.op.activation {
                        Activation::None => v,
                        Activation::Relu => v.max(0.0),
                    };
                }
            }
            let y = case.forward(&case.x, &case.w, case.b.as_deref());
            assert_close(&format!("{:?}", case.op), &y, &want);
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for mut case in cases() {
            if case.op.activation == Activation::Relu {
                // Drop outputs within a probe's reach (1e-2 × values ≤ 1) of the ReLU kink.
                let linear = Dense {
                    activation: Activation::None,
                    ..case.op.clone()
                };
                let z = case.forward_as(&linear, &case.x, &case.w, case.b.as_deref());
                for (r, z) in case.dy.iter_mut().zip(z) {
                    if z.abs() < 0.02 {
                        *r = 0.0;
                    }
                }
            }
            let what = format!("{:?}", case.op);
            let y = case.forward(&case.x, &case.w, case.b.as_deref());
            let (dx, dw, db) = case.backward(&y);
            assert_grad(&format!("dx of {what}"), &case.x, &dx, 50, |x| {
                case.loss(&case.forward(x, &case.w, case.b.as_deref()))
            });
            assert_grad(&format!("dw of {what}"), &case.w, &dw, 50, |w| {
                case.loss(&case.forward(&case.x, w, case.b.as_deref()))
            });
            if let Some(b) = &case.b {
                assert_grad(&format!("db of {what}"), b, &db, 50, |b| {
                    case.loss(&case.forward(&case.x, &case.w, Some(b)))
                });
            }
        }
    }

    #[test]
    fn empty_tile_writes_zero_gradients() {
        let case = &cases()[0];
        let tile = case.output().with_axis(0, 2, 2);
        let x_rect = case.op.project(&[case.input], &tile)[0];
        let (mut dw, mut db) = (vec![f32::NAN; case.w.len()], vec![f32::NAN; 7]);
        dense_forward(
            &case.op,
            View::new(x_rect, &[]),
            View::new(case.w_rect(), &case.w),
            Some(View::new(case.b_rect(), case.b.as_ref().unwrap())),
            ViewMut::new(tile, &mut []),
        );
        dense_backward(
            &case.op,
            View::new(x_rect, &[]),
            View::new(case.w_rect(), &case.w),
            View::new(tile, &[]),
            View::new(tile, &[]),
            Some(ViewMut::new(x_rect, &mut [])),
            ViewMut::new(case.w_rect(), &mut dw),
            Some(ViewMut::new(case.b_rect(), &mut db)),
        );
        assert!(dw.iter().chain(&db).all(|&v| v == 0.0));
    }

    #[test]
    fn tiles_reproduce_the_whole_tensor() {
        for case in cases() {
            for whole_input in [false, true] {
                let what = format!("{:?} (whole input: {whole_input})", case.op);
                let y = case.forward(&case.x, &case.w, case.b.as_deref());
                let (dx, dw, db) = case.backward(&y);
                let (x_full, w_full, b_full) =
                    (case.input.full_rect(), case.w_rect(), case.b_rect());
                let mut dx_sum = vec![0.0; dx.len()];
                let mut dw_sum = vec![0.0; dw.len()];
                let mut db_sum = vec![0.0; db.len()];
                for half in halves(&case.output(), 0) {
                    for tile in halves(&half, 1) {
                        let x_rect = if whole_input {
                            x_full
                        } else {
                            case.op.project(&[case.input], &tile)[0]
                        };
                        let w_rect = case.op.param_rect(&case.op.params(&[case.input])[0], &tile);
                        let b_rect = case
                            .op
                            .bias
                            .then(|| case.op.param_rect(&case.op.params(&[case.input])[1], &tile));
                        let x_tile = cut(&case.x, &x_full, &x_rect);
                        let w_tile = cut(&case.w, &w_full, &w_rect);
                        let b_tile = b_rect.map(|r| cut(case.b.as_ref().unwrap(), &b_full, &r));
                        let mut y_tile = vec![f32::NAN; tile.volume()];
                        dense_forward(
                            &case.op,
                            View::new(x_rect, &x_tile),
                            View::new(w_rect, &w_tile),
                            b_rect.map(|r| View::new(r, b_tile.as_ref().unwrap())),
                            ViewMut::new(tile, &mut y_tile),
                        );
                        let want = cut(&y, &case.output(), &tile);
                        assert_close(&format!("y tile {tile} of {what}"), &y_tile, &want);

                        let dy_tile = cut(&case.dy, &case.output(), &tile);
                        let mut dx_tile = vec![f32::NAN; x_rect.volume()];
                        let mut dw_tile = vec![f32::NAN; w_rect.volume()];
                        let mut db_tile = vec![f32::NAN; tile.extent(1)];
                        dense_backward(
                            &case.op,
                            View::new(x_rect, &x_tile),
                            View::new(w_rect, &w_tile),
                            View::new(tile, &want),
                            View::new(tile, &dy_tile),
                            Some(ViewMut::new(x_rect, &mut dx_tile)),
                            ViewMut::new(w_rect, &mut dw_tile),
                            b_rect.map(|r| ViewMut::new(r, &mut db_tile)),
                        );
                        add_rect(&dx_tile, &x_rect, &mut dx_sum, &x_full, &x_rect);
                        add_rect(&dw_tile, &w_rect, &mut dw_sum, &w_full, &w_rect);
                        if let Some(r) = b_rect {
                            add_rect(&db_tile, &r, &mut db_sum, &b_full, &r);
                        }
                    }
                }
                assert_close(&format!("summed dx of {what}"), &dx_sum, &dx);
                assert_close(&format!("summed dw of {what}"), &dw_sum, &dw);
                if case.op.bias {
                    assert_close(&format!("summed db of {what}"), &db_sum, &db);
                }
            }
        }
    }
}
