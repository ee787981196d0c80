//! How the kernels of `kernels.cu` are launched: the rect they take ([`Box4`]) and the launch
//! shapes (a grid-stride grid over elements, a block per part of a channel, a warp per softmax
//! row), in one place so that every kernel family launches as the kernels assume.

use crate::backend::Failure;
use crate::kernels::{REDUCE_THREADS, WARP_ROWS_PER_BLOCK};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use legion_ops::shape::Rect;

/// A rect as the kernels see it (`Box4` in kernels.cu): four axes, lower corner and extents.
/// `Rect` keeps axes past its rank as `[0, 1)`, which is the padding the kernels expect.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Box4 {
    pub lo: [i64; 4],
    pub ext: [i64; 4],
}

// SAFETY: plain old data with the C layout of `Box4` in kernels.cu.
unsafe impl DeviceRepr for Box4 {}

impl Box4 {
    pub fn of(rect: &Rect) -> Box4 {
        let mut b = Box4 {
            lo: [0; 4],
            ext: [1; 4],
        };
        for axis in 0..4 {
            b.lo[axis] = rect.lo[axis] as i64;
            b.ext[axis] = rect.hi[axis].saturating_sub(rect.lo[axis]) as i64;
        }
        b
    }

    pub fn volume(&self) -> i64 {
        self.ext.iter().product()
    }

    pub fn hi(&self, axis: usize) -> i64 {
        self.lo[axis] + self.ext[axis]
    }

    pub fn intersect(&self, other: &Box4) -> Box4 {
        let mut b = *self;
        for axis in 0..4 {
            let lo = self.lo[axis].max(other.lo[axis]);
            let hi = self.hi(axis).min(other.hi(axis)).max(lo);
            b.lo[axis] = lo;
            b.ext[axis] = hi - lo;
        }
        b
    }

    /// This box moved by `delta` along `axis`.
    pub fn shifted(mut self, axis: usize, delta: i64) -> Box4 {
        self.lo[axis] += delta;
        self
    }

    /// Where this box (inside `layout`) starts in `layout`'s row-major order, if its elements are
    /// consecutive there: every axis after the first one it cuts is whole, and every axis before
    /// it has one element.
    pub fn run_in(&self, layout: &Box4) -> Option<i64> {
        let cut = (0..4).rev().find(|&a| self.ext[a] != layout.ext[a]);
        if let Some(cut) = cut
            && self.ext[..cut].iter().any(|&e| e != 1)
        {
            return None;
        }
        let mut offset = 0;
        for axis in 0..4 {
            offset = offset * layout.ext[axis] + (self.lo[axis] - layout.lo[axis]);
        }
        Some(offset)
    }

    /// Whether the box has one element per sample and channel (`[N, C]` rows, a dense layer's
    /// output): the per-channel kernels then run row-major twins, whose loads coalesce where a
    /// channel's walk would stride a whole row per element.
    pub fn is_rows(&self) -> bool {
        self.ext[2] * self.ext[3] == 1
    }

    /// This box with `axis` set to `[lo, lo + ext)`.
    pub fn with_axis(mut self, axis: usize, lo: i64, ext: i64) -> Box4 {
        self.lo[axis] = lo;
        self.ext[axis] = ext;
        self
    }
}

const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
pub(crate) fn grid(n: i64) -> LaunchConfig {
    let blocks = (n.max(1) as u64).div_ceil(THREADS as u64).min(1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// How the per-channel kernels (`ChannelPart` in kernels.cu: bias and activation, bias
/// gradients, batch norm) cut a tile: each channel's elements into `parts` ranges of about
/// [`PER_PART`] elements (at most [`MAX_PARTS`]), a block of [`REDUCE_THREADS`] threads per part,
/// so that a layer with few channels of many elements each still fills the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChannelParts {
    /// Elements of one channel of the tile (samples × rows × columns).
    pub per_channel: i64,
    pub parts: i64,
    channels: i64,
}

/// Elements a block of a per-channel kernel takes: enough that the block is busy, few enough for
/// many blocks.
const PER_PART: i64 = 8192;
/// The most parts a channel is cut into (a reduction's finishing kernel adds them in order).
const MAX_PARTS: i64 = 256;

impl ChannelParts {
    /// The cut of `tile`, or why its kernels cannot index it: a thread walks its channel with
    /// 32-bit counters, so a channel (and a block's threads past its end) must stay below 2^32.
    pub fn of(tile: &Box4) -> Result<ChannelParts, Failure> {
        let per_channel = tile.ext[0] * tile.ext[2] * tile.ext[3];
        if per_channel > (u32::MAX - REDUCE_THREADS) as i64 {
            return Err(Failure(format!(
                "tile {tile:?}: {per_channel} elements a channel, more than the per-channel \
                 kernels' 2^32 - {} (their threads count a channel's elements in 32 bits)",
                REDUCE_THREADS + 1
            )));
        }
        let parts = ((per_channel + PER_PART - 1) / PER_PART).clamp(1, MAX_PARTS);
        if tile.ext[1] > i32::MAX as i64 / parts {
            return Err(Failure(format!(
                "tile {tile:?}: {} channels in {parts} parts each are more blocks than a launch \
                 has (2^31 - 1)",
                tile.ext[1]
            )));
        }
        Ok(ChannelParts {
            per_channel,
            parts,
            channels: tile.ext[1],
        })
    }

    /// A block per part of every channel.
    pub fn launch(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((self.channels * self.parts) as u32, 1, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// One reduction block of [`REDUCE_THREADS`] threads.
pub(crate) fn one_reduction_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per sample row.
pub(crate) fn softmax_rows(rows: i64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (rows as u64).div_ceil(WARP_ROWS_PER_BLOCK as u64) as u32,
            1,
            1,
        ),
        block_dim: (WARP_ROWS_PER_BLOCK * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A null device pointer, for the kernels' optional operands.
pub(crate) const NULL: u64 = 0;

#[cfg(test)]
mod tests {
    use super::{Box4, ChannelParts, MAX_PARTS, PER_PART};
    use crate::kernels::REDUCE_THREADS;

    fn b(lo: [i64; 4], ext: [i64; 4]) -> Box4 {
        Box4 { lo, ext }
    }

    /// The offsets a box's elements have in a layout, in the box's row-major order.
    fn offsets(region: &Box4, layout: &Box4) -> Vec<i64> {
        let mut out = Vec::new();
        for i in 0..region.volume() {
            let (mut rest, mut p) = (i, [0i64; 4]);
            for axis in (0..4).rev() {
                p[axis] = region.lo[axis] + rest % region.ext[axis];
                rest /= region.ext[axis];
            }
            let mut at = 0;
            for ((&p, &lo), &ext) in p.iter().zip(&layout.lo).zip(&layout.ext) {
                at = at * ext + (p - lo);
            }
            out.push(at);
        }
        out
    }

    #[test]
    fn a_channel_is_cut_into_parts_of_about_per_part_elements_and_too_large_tiles_are_refused() {
        let of = |ext: [i64; 4]| ChannelParts::of(&b([0; 4], ext));
        // samples × rows × columns of a channel; at least one part, at most MAX_PARTS
        let small = of([2, 3, 5, 7]).unwrap();
        assert_eq!((small.per_channel, small.parts), (70, 1));
        assert_eq!(small.launch().grid_dim, (3, 1, 1));
        assert_eq!(small.launch().block_dim, (REDUCE_THREADS, 1, 1));
        // AlexNet's conv1 output at batch 128: 387,200 elements a channel
        let conv1 = of([128, 64, 55, 55]).unwrap();
        assert_eq!(conv1.parts, (387_200 + PER_PART - 1) / PER_PART);
        assert_eq!(conv1.launch().grid_dim.0 as i64, 64 * conv1.parts);
        let huge = of([1 << 16, 2, 64, 64]).unwrap();
        assert_eq!(huge.parts, MAX_PARTS);
        // an empty tile still launches a block per channel, whose sums are zero
        assert_eq!(of([0, 4, 5, 5]).unwrap().parts, 1);
        // a channel's elements are counted in 32 bits, with room for a block's threads
        let limit = (u32::MAX - REDUCE_THREADS) as i64;
        assert!(of([limit, 1, 1, 1]).is_ok());
        let e = of([limit + 1, 1, 1, 1]).unwrap_err();
        assert!(e.0.contains("elements a channel"), "{}", e.0);
        // and the blocks of a launch fit its grid
        let e = of([1 << 24, 1 << 24, 1, 1]).unwrap_err();
        assert!(e.0.contains("blocks"), "{}", e.0);
    }

    #[test]
    fn a_run_is_found_exactly_where_the_elements_are_consecutive() {
        let layout = b([2, 0, 1, 0], [3, 4, 2, 5]);
        let mut runs = 0;
        // Every sub-box of the layout: the answer agrees with the offsets, element by element.
        for lo0 in 2..5 {
            for e0 in 1..=(5 - lo0) {
                for lo1 in 0..4 {
                    for e1 in 1..=(4 - lo1) {
                        for (lo2, e2) in [(1, 1), (2, 1), (1, 2)] {
                            for (lo3, e3) in [(0, 5), (1, 3), (4, 1)] {
                                let region = b([lo0, lo1, lo2, lo3], [e0, e1, e2, e3]);
                                let at = offsets(&region, &layout);
                                let consecutive = at.windows(2).all(|w| w[1] == w[0] + 1);
                                let found = region.run_in(&layout);
                                assert_eq!(found.is_some(), consecutive, "{region:?}");
                                if let Some(start) = found {
                                    assert_eq!(start, at[0], "{region:?}");
                                    runs += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(runs > 10, "{runs}");
        // The whole layout, and whole samples of a batch, are runs.
        assert_eq!(layout.run_in(&layout), Some(0));
        assert_eq!(b([3, 0, 1, 0], [2, 4, 2, 5]).run_in(&layout), Some(40));
    }
}
