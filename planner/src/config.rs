//! The search space of one layer (OptCNN §4): every valid [`ParallelConfig`] of its output,
//! grouped by degree vector. The configs themselves and the tile split are the partition vocabulary
//! the runtime shares, in `legion_ops::partition`; they are re-exported here.

pub use legion_ops::partition::{
    ConfigError, ParallelConfig, TileRects, block_of, block_range, tile_rect, tile_rects,
};

use legion_ops::shape::MAX_DIMS;
use legion_ops::{Dim, Shape};
use std::ops::Range;

/// All valid configs of one layer, grouped by degree vector ("layout"): the configs of layout `l`
/// are `configs()[layout_configs(l)]`, one per aligned device block, by ascending first device.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigSpace {
    layouts: Vec<[usize; MAX_DIMS]>,
    configs: Vec<ParallelConfig>,
    starts: Vec<usize>,
}

impl ConfigSpace {
    /// Enumerates the configs of a layer with output `shape` splittable along `dims`, on
    /// `num_devices` devices. Layouts come by ascending total degree, then lexicographically.
    pub fn enumerate(shape: &Shape, dims: &[Dim], num_devices: usize) -> ConfigSpace {
        let mut layouts = Vec::new();
        let usable: Vec<Dim> = dims
            .iter()
            .copied()
            .filter(|d| d.axis() < shape.ndim())
            .collect();
        push_layouts(shape, &usable, num_devices, [1; MAX_DIMS], 0, &mut layouts);
        layouts.sort_by_key(|l| (l.iter().product::<usize>(), *l));
        let mut configs = Vec::new();
        let mut starts = vec![0];
        for l in &layouts {
            let total: usize = l.iter().product();
            let mut first = 0;
            while first + total <= num_devices {
                configs.push(ParallelConfig::new(*l, first));
                first += total;
            }
            starts.push(configs.len());
        }
        ConfigSpace {
            layouts,
            configs,
            starts,
        }
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

    /// The distinct degree vectors.
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
        let layout = self
            .layouts
            .binary_search_by_key(&(config.total(), config.degrees()), |l| {
                (l.iter().product::<usize>(), *l)
            })
            .ok()?;
        let range = self.layout_configs(layout);
        let offset = config.first_device() / config.total();
        (config.first_device().is_multiple_of(config.total()) && offset < range.len())
            .then_some(range.start + offset)
    }
}

/// How many configs each layer of `graph` has on `num_devices` devices, by layer id.
pub fn config_counts(graph: &legion_ops::Graph, num_devices: usize) -> Vec<usize> {
    graph
        .layers()
        .iter()
        .map(|l| {
            ConfigSpace::enumerate(&l.shape, l.op.spec().parallel_dims(&l.shape), num_devices).len()
        })
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
}
