//! Channel-axis concatenation over one tile. A tile may cut across input boundaries: it then copies
//! from (and its backward writes to) the slice of each input that [`Concat::project`] assigns it, in
//! that input's own coordinates.

use super::{View, ViewMut};
use crate::op::{Concat, OpSpec};
use crate::shape::{Rect, Shape, copy_rect};
use rayon::prelude::*;

/// Copies each input's slice of the tile `y.rect` into it. `input_shapes` are the full shapes of all
/// inputs (they fix the channel offsets); `inputs[i]` must contain input `i`'s projection of the tile
/// and may have an empty rect when that projection is empty.
pub fn concat_forward(input_shapes: &[Shape], inputs: &[View<'_>], y: ViewMut<'_>) {
    assert_eq!(
        input_shapes.len(),
        inputs.len(),
        "one view per input expected"
    );
    let tile = y.rect;
    if tile.is_empty() {
        return;
    }
    let slices = Concat::default().project(input_shapes, &tile);
    let offsets = Concat::offsets(input_shapes);
    for (i, (input, slice)) in inputs.iter().zip(&slices).enumerate() {
        assert!(
            input.rect.contains(slice),
            "input {i}: view {} does not contain its slice {slice} of the tile {tile}",
            input.rect
        );
    }
    let covered: usize = slices.iter().map(|s| s.extent(1)).sum();
    assert_eq!(
        covered,
        tile.extent(1),
        "tile {tile} reaches past the inputs' channels"
    );
    let sample_len = tile.volume() / tile.extent(0);
    y.data
        .par_chunks_mut(sample_len)
        .zip(tile.lo[0]..tile.hi[0])
        .for_each(|(out, n)| {
            let out_rect = tile.with_axis(0, n, n + 1);
            for ((input, slice), &offset) in inputs.iter().zip(&slices).zip(&offsets) {
                if slice.is_empty() {
                    continue;
                }
                let region = to_output(&slice.with_axis(0, n, n + 1), offset);
                copy_rect(
                    input.data,
                    &to_output(&input.rect, offset),
                    out,
                    &out_rect,
                    &region,
                );
            }
        });
}

/// Copies the output gradient back into each input's gradient view. `dinputs[i]` covers exactly the
/// slice of input `i` to write (its projection of the tile, in the input's own coordinates; empty when
/// the tile misses that input) and `dy` must contain those slices moved to output coordinates.
pub fn concat_backward(input_shapes: &[Shape], dy: View<'_>, dinputs: &mut [ViewMut<'_>]) {
    assert_eq!(
        input_shapes.len(),
        dinputs.len(),
        "one gradient view per input expected"
    );
    let offsets = Concat::offsets(input_shapes);
    for (i, (dinput, &offset)) in dinputs.iter_mut().zip(&offsets).enumerate() {
        let slice = dinput.rect;
        if slice.is_empty() {
            continue;
        }
        assert!(
            slice.hi[1] <= input_shapes[i].dim(1),
            "input {i}: gradient view {slice} exceeds its {} channels",
            input_shapes[i].dim(1)
        );
        let region = to_output(&slice, offset);
        assert!(
            dy.rect.contains(&region),
            "input {i}: output gradient {} does not contain the slice {region}",
            dy.rect
        );
        let sample_len = slice.volume() / slice.extent(0);
        dinput
            .data
            .par_chunks_mut(sample_len)
            .zip(slice.lo[0]..slice.hi[0])
            .for_each(|(out, n)| {
                let sample = region.with_axis(0, n, n + 1);
                copy_rect(dy.data, &dy.rect, out, &sample, &sample);
            });
    }
}

/// An input's rect moved along the channel axis to where that input sits in the output.
fn to_output(rect: &Rect, channel_offset: usize) -> Rect {
    rect.with_axis(1, rect.lo[1] + channel_offset, rect.hi[1] + channel_offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::check::random;

    struct Case {
        shapes: Vec<Shape>,
        inputs: Vec<Vec<f32>>,
        output: Shape,
    }

    fn case(shapes: Vec<Shape>) -> Case {
        let inputs = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| random(s.numel(), 10 + i as u64))
            .collect();
        let output = Concat::default().infer_shape(&shapes).unwrap();
        Case {
            shapes,
            inputs,
            output,
        }
    }

    fn whole_forward(case: &Case) -> Vec<f32> {
        let views: Vec<View> = case
            .shapes
            .iter()
            .zip(&case.inputs)
            .map(|(s, d)| View::new(s.full_rect(), d))
            .collect();
        let full = case.output.full_rect();
        let mut y = vec![0.0; full.volume()];
        concat_forward(&case.shapes, &views, ViewMut::new(full, &mut y));
        y
    }

    #[test]
    fn whole_forward_stacks_channels() {
        let c = case(vec![Shape::nc(2, 2), Shape::nc(2, 3)]);
        let y = whole_forward(&c);
        let (a, b) = (&c.inputs[0], &c.inputs[1]);
        assert_eq!(
            y,
            [a[0], a[1], b[0], b[1], b[2], a[2], a[3], b[3], b[4], b[5]]
        );
    }

    /// Tiles over (n, c) for NC or (n, c, h) for NCHW whose channel cuts fall inside inputs.
    fn tiles(output: Shape, channel_cuts: &[usize]) -> Vec<Rect> {
        let full = output.full_rect();
        let mut bounds = vec![0];
        bounds.extend_from_slice(channel_cuts);
        bounds.push(output.dim(1));
        let n = output.dim(0);
        let mut out = Vec::new();
        for (n0, n1) in [(0, n / 2), (n / 2, n)] {
            for c in bounds.windows(2) {
                let mut t = full.with_axis(0, n0, n1).with_axis(1, c[0], c[1]);
                if output.ndim() == 4 {
                    // Cut h too, so tiles are not whole samples.
                    let h = output.dim(2);
                    out.push(t.with_axis(2, 0, h / 2));
                    t = t.with_axis(2, h / 2, h);
                }
                out.push(t);
            }
        }
        out
    }

    fn check_tiles_match_whole(c: &Case, channel_cuts: &[usize]) {
        let full = c.output.full_rect();
        let whole = whole_forward(c);
        let mut tiled = vec![f32::NAN; full.volume()];
        // Gradients scattered back into every input; NaN marks elements no tile wrote.
        let mut dinputs: Vec<Vec<f32>> =
            c.shapes.iter().map(|s| vec![f32::NAN; s.numel()]).collect();
        let dy = random(full.volume(), 99);

        for tile in tiles(c.output, channel_cuts) {
            let slices = Concat::default().project(&c.shapes, &tile);
            // Inputs arrive as exactly their slices, as a runtime copy would deliver them.
            let slice_data: Vec<Vec<f32>> = slices
                .iter()
                .zip(&c.shapes)
                .zip(&c.inputs)
                .map(|((slice, shape), data)| {
                    let mut d = vec![0.0; slice.volume()];
                    copy_rect(data, &shape.full_rect(), &mut d, slice, slice);
                    d
                })
                .collect();
            let views: Vec<View> = slices
                .iter()
                .zip(&slice_data)
                .map(|(r, d)| View::new(*r, d))
                .collect();
            let mut y = vec![0.0; tile.volume()];
            concat_forward(&c.shapes, &views, ViewMut::new(tile, &mut y));
            copy_rect(&y, &tile, &mut tiled, &full, &tile);

            let mut dy_tile = vec![0.0; tile.volume()];
            copy_rect(&dy, &full, &mut dy_tile, &tile, &tile);
            let mut grads: Vec<Vec<f32>> = slices.iter().map(|r| vec![0.0; r.volume()]).collect();
            let mut grad_views: Vec<ViewMut> = slices
                .iter()
                .zip(grads.iter_mut())
                .map(|(r, d)| ViewMut::new(*r, d))
                .collect();
            concat_backward(&c.shapes, View::new(tile, &dy_tile), &mut grad_views);
            for ((slice, grad), (shape, dinput)) in slices
                .iter()
                .zip(&grads)
                .zip(c.shapes.iter().zip(&mut dinputs))
            {
                copy_rect(grad, slice, dinput, &shape.full_rect(), slice);
            }
        }
        assert_eq!(tiled, whole);

        // The whole-tensor backward, and the definition: input i's gradient is dy's channel slice.
        let offsets = Concat::offsets(&c.shapes);
        let mut whole_grads: Vec<Vec<f32>> =
            c.shapes.iter().map(|s| vec![0.0; s.numel()]).collect();
        let mut views: Vec<ViewMut> = c
            .shapes
            .iter()
            .zip(whole_grads.iter_mut())
            .map(|(s, d)| ViewMut::new(s.full_rect(), d))
            .collect();
        concat_backward(&c.shapes, View::new(full, &dy), &mut views);
        for (i, shape) in c.shapes.iter().enumerate() {
            let mut expected = vec![0.0; shape.numel()];
            let region = to_output(&shape.full_rect(), offsets[i]);
            copy_rect(&dy, &full, &mut expected, &region, &region);
            assert_eq!(whole_grads[i], expected, "input {i}, whole tensor");
            assert_eq!(dinputs[i], expected, "input {i}, tiled");
        }
    }

    #[test]
    fn nchw_tiles_cutting_across_inputs_match_whole() {
        let c = case(vec![
            Shape::nchw(4, 3, 6, 5),
            Shape::nchw(4, 5, 6, 5),
            Shape::nchw(4, 2, 6, 5),
        ]);
        // Channels 0..3 | 3..8 | 8..10; cuts at 2 and 9 fall inside the first and last inputs,
        // so the middle tile spans all three.
        check_tiles_match_whole(&c, &[2, 9]);
        check_tiles_match_whole(&c, &[4, 6]);
    }

    #[test]
    fn nc_tiles_cutting_across_inputs_match_whole() {
        let c = case(vec![Shape::nc(6, 4), Shape::nc(6, 1), Shape::nc(6, 7)]);
        check_tiles_match_whole(&c, &[3, 5, 8]);
    }

    #[test]
    fn forward_reads_slices_from_larger_views() {
        let c = case(vec![Shape::nchw(2, 3, 4, 4), Shape::nchw(2, 5, 4, 4)]);
        let full = c.output.full_rect();
        let whole = whole_forward(&c);
        let tile = Rect::new(&[1, 2, 1, 0], &[2, 6, 3, 4]);
        let views: Vec<View> = c
            .shapes
            .iter()
            .zip(&c.inputs)
            .map(|(s, d)| View::new(s.full_rect(), d))
            .collect();
        let mut y = vec![0.0; tile.volume()];
        concat_forward(&c.shapes, &views, ViewMut::new(tile, &mut y));
        let mut expected = vec![0.0; tile.volume()];
        copy_rect(&whole, &full, &mut expected, &tile, &tile);
        assert_eq!(y, expected);
    }
}
