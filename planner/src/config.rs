//! The search space of one layer (OptCNN §4): every valid [`ParallelConfig`] of its output,
//! grouped by degree vector. The configs themselves and the tile split are the partition vocabulary
//! the runtime shares, in `legion_ops::partition`; they are re-exported here.

pub use legion_ops::partition::{
    ConfigError, ParallelConfig, TileRects, block_of, block_range, tile_rect, tile_rects,
};

use crate::tables::SearchSpace;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{Dim, Shape};
use std::ops::Range;

/// All valid configs of one layer, grouped by degree vector and reduction split ("layout"): the
/// configs of layout `l` are `configs()[layout_configs(l)]`, one per aligned device block, by
/// ascending first device.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigSpace {
    layouts: Vec<[usize; MAX_DIMS]>,
    /// Per layout, its reduction split (1: none).
    reductions: Vec<usize>,
    configs: Vec<ParallelConfig>,
    starts: Vec<usize>,
}

impl ConfigSpace {
    /// Enumerates the configs of a layer with output `shape` splittable along `dims`, on
    /// `num_devices` devices: the paper's space, without reduction splits. Layouts come by
    /// ascending total degree, then lexicographically.
    pub fn enumerate(shape: &Shape, dims: &[Dim], num_devices: usize) -> ConfigSpace {
        ConfigSpace::enumerate_with_reductions(shape, dims, num_devices, None)
    }

    /// Layer `id`'s configs on `num_devices` devices in `space`.
    pub fn of_layer(
        graph: &legion_ops::Graph,
        id: legion_ops::LayerId,
        num_devices: usize,
        space: SearchSpace,
    ) -> ConfigSpace {
        let l = graph.layer(id);
        ConfigSpace::enumerate_with_reductions(
            &l.shape,
            l.op.spec().parallel_dims(&l.shape),
            num_devices,
            space.reduction_channels(graph, id),
        )
    }

    /// [`ConfigSpace::enumerate`] and, for a layer that sums over `reduction_channels` input
    /// channels (`OpSpec::reduction_channels`), every layout again split into 2, 4, … partial
    /// sums over blocks of them, as far as the devices and the channels go. Layouts come by
    /// ascending device count, then degrees, then reduction split.
    pub fn enumerate_with_reductions(
        shape: &Shape,
        dims: &[Dim],
        num_devices: usize,
        reduction_channels: Option<usize>,
    ) -> ConfigSpace {
        let mut degrees = Vec::new();
        let usable: Vec<Dim> = dims
            .iter()
            .copied()
            .filter(|d| d.axis() < shape.ndim())
            .collect();
        push_layouts(shape, &usable, num_devices, [1; MAX_DIMS], 0, &mut degrees);
        let mut layouts: Vec<([usize; MAX_DIMS], usize)> = Vec::new();
        for d in degrees {
            let blocks: usize = d.iter().product();
            let mut red = 1;
            while blocks * red <= num_devices && reduction_channels.is_some_and(|c| red <= c)
                || red == 1
            {
                layouts.push((d, red));
                red *= 2;
            }
        }
        layouts.sort_by_key(|&(l, red)| (l.iter().product::<usize>() * red, l, red));
        let mut configs = Vec::new();
        let mut starts = vec![0];
        for &(l, red) in &layouts {
            let total = l.iter().product::<usize>() * red;
            let mut first = 0;
            while first + total <= num_devices {
                configs.push(ParallelConfig::new(l, first).with_reduction(red));
                first += total;
            }
            starts.push(configs.len());
        }
        ConfigSpace {
            layouts: layouts.iter().map(|&(l, _)| l).collect(),
            reductions: layouts.iter().map(|&(_, red)| red).collect(),
            configs,
            starts,
        }
    }

    /// Layout `layout`'s reduction split (1: none).
    pub fn layout_reduction(&self, layout: usize) -> usize {
        self.reductions[layout]
    }

    /// Layout `layout` on the first devices (its first config).
    pub fn layout_config(&self, layout: usize) -> ParallelConfig {
        ParallelConfig::new(self.layouts[layout], 0).with_reduction(self.reductions[layout])
    }

    /// Whether any layout splits a reduction.
    pub fn has_reductions(&self) -> bool {
        self.reductions.iter().any(|&r| r > 1)
    }

    pub fn len(&self) -> usize {
        self.configs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.configs.is_empty()
    }

    pub fn configs(&self) -> &[ParallelConfig] {
        &self.configs
    }

    pub fn config(&self, index: usize) -> ParallelConfig {
        self.configs[index]
    }

    /// Each layout's degree vector (a degree vector appears once per reduction split of it; see
    /// [`ConfigSpace::layout_reduction`]).
    pub fn layouts(&self) -> &[[usize; MAX_DIMS]] {
        &self.layouts
    }

    /// Indices (into [`ConfigSpace::configs`]) of the configs of layout `layout`.
    pub fn layout_configs(&self, layout: usize) -> Range<usize> {
        self.starts[layout]..self.starts[layout + 1]
    }

    /// The layout of the config at `index` in [`ConfigSpace::configs`].
    pub fn layout_of(&self, index: usize) -> usize {
        self.starts.partition_point(|&s| s <= index) - 1
    }

    /// Position of `config` in [`ConfigSpace::configs`].
    pub fn index_of(&self, config: &ParallelConfig) -> Option<usize> {
        let key = (config.total(), config.degrees(), config.reduction());
        let key_of = |i: usize| {
            let (l, red) = (self.layouts[i], self.reductions[i]);
            (l.iter().product::<usize>() * red, l, red)
        };
        // layouts are sorted by this key: the first not below it
        let (mut lo, mut hi) = (0, self.layouts.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if key_of(mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let layout = Some(lo).filter(|&i| i < self.layouts.len() && key_of(i) == key)?;
        let range = self.layout_configs(layout);
        let offset = config.first_device() / config.total();
        (config.first_device().is_multiple_of(config.total()) && offset < range.len())
            .then_some(range.start + offset)
    }
}

/// How many configs each layer of `graph` has on `num_devices` devices in `space`, by layer id.
pub fn config_counts(
    graph: &legion_ops::Graph,
    num_devices: usize,
    space: SearchSpace,
) -> Vec<usize> {
    graph
        .ids()
        .map(|id| ConfigSpace::of_layer(graph, id, num_devices, space).len())
        .collect()
}

fn push_layouts(
    shape: &Shape,
    dims: &[Dim],
    num_devices: usize,
    current: [usize; MAX_DIMS],
    next: usize,
    out: &mut Vec<[usize; MAX_DIMS]>,
) {
    let Some(&dim) = dims.get(next) else {
        out.push(current);
        return;
    };
    let total: usize = current.iter().product();
    let mut degree = 1;
    while total * degree <= num_devices && degree <= shape.dim(dim.axis()) {
        let mut l = current;
        l[dim.axis()] = degree;
        push_layouts(shape, dims, num_devices, l, next + 1, out);
        degree *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::Rect;

    #[test]
    fn tile_rects_are_each_tiles_rect_in_order() {
        let shapes = [
            Shape::nchw(8, 6, 10, 10),
            Shape::nchw(5, 3, 7, 9),
            Shape::nc(3, 10),
            Shape::new(&[7]),
        ];
        for shape in shapes {
            let dims: Vec<Dim> = Dim::ALL
                .into_iter()
                .filter(|d| d.axis() < shape.ndim())
                .collect();
            for config in ConfigSpace::enumerate(&shape, &dims, 16).configs() {
                let fast: Vec<Rect> = tile_rects(&shape, config).collect();
                let direct: Vec<Rect> = (0..config.total())
                    .map(|t| tile_rect(&shape, config, t))
                    .collect();
                assert_eq!(fast, direct, "{shape:?} {config}");
            }
        }
    }

    #[test]
    fn enumeration_counts() {
        // n, c on 4 devices: totals 1 (4 blocks), 2 (2 layouts × 2), 4 (3 layouts × 1)
        let s = ConfigSpace::enumerate(&Shape::nc(64, 64), &[Dim::N, Dim::C], 4);
        assert_eq!(s.len(), 4 + 2 * 2 + 3);
        // all four dims on 16 devices: Σ_k C(k+3,3)·16/2^k = 16 + 32 + 40 + 40 + 35
        let s = ConfigSpace::enumerate(&Shape::nchw(64, 64, 32, 32), &Dim::ALL, 16);
        assert_eq!(s.len(), 163);
        // a degree never exceeds its extent
        let s = ConfigSpace::enumerate(&Shape::nchw(2, 3, 1, 1), &Dim::ALL, 8);
        assert!(
            s.configs()
                .iter()
                .all(|c| c.degree(Dim::N) <= 2 && c.degree(Dim::C) <= 2 && c.degree(Dim::H) == 1)
        );
        for (i, c) in s.configs().iter().enumerate() {
            assert_eq!(s.index_of(c), Some(i));
            c.validate(&Shape::nchw(2, 3, 1, 1), &Dim::ALL, 8).unwrap();
        }
        // a machine that is not a power of two
        let s = ConfigSpace::enumerate(&Shape::nc(8, 8), &[Dim::N], 6);
        assert_eq!(s.len(), 6 + 3 + 1);
        assert_eq!(s.index_of(&ParallelConfig::split(Dim::N, 4, 4)), None);
    }

    #[test]
    fn reduction_splits_are_layouts_of_their_own_within_devices_and_channels() {
        let shape = Shape::nc(64, 64);
        let paper = ConfigSpace::enumerate(&shape, &[Dim::N, Dim::C], 4);
        assert!(!paper.has_reductions());
        let s = ConfigSpace::enumerate_with_reductions(&shape, &[Dim::N, Dim::C], 4, Some(3));
        assert!(s.has_reductions());
        // the paper's 11 configs; red=2 on the blocks of 1 (2 configs) and of 2 devices (2
        // layouts, 1 config each); red 4 would need 4 input channels
        assert_eq!(s.len(), 11 + 2 + 2);
        for (i, c) in s.configs().iter().enumerate() {
            assert_eq!(s.index_of(c), Some(i), "{c}");
            assert!(c.total() <= 4 && c.reduction() <= 2);
            let layout = s.layout_of(i);
            assert_eq!(s.layout_reduction(layout), c.reduction());
            assert_eq!(
                s.layout_config(layout).with_first_device(c.first_device()),
                *c
            );
        }
        assert_eq!(
            s.index_of(&ParallelConfig::serial(0).with_reduction(4)),
            None
        );
        let wide = ConfigSpace::enumerate_with_reductions(&shape, &[Dim::N, Dim::C], 4, Some(64));
        assert!(wide.configs().iter().any(|c| c.reduction() == 4));
        // every paper config keeps its place in the order of device counts
        let paper_in_wide: Vec<_> = wide
            .configs()
            .iter()
            .filter(|c| c.reduction() == 1)
            .collect();
        assert_eq!(paper_in_wide.len(), paper.len());
    }
}
