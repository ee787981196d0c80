//! Parallel configurations of one layer (OptCNN §4): a degree per parallelizable dim of the layer's
//! output and the block of devices holding the tiles.
//!
//! The search space is the paper's: every degree a power of two no larger than its dim's extent,
//! the total degree (the number of tiles) at most the number of devices, and the tiles on an aligned
//! contiguous block of devices — tile `t` on device `first_device + t` with `first_device` a multiple
//! of the total degree. Tiles are numbered row-major over the dims n, c, h, w (w fastest).
//!
//! Extents need not be divisible by their degree: block `i` of `d` over an extent `e` is
//! `[e·i/d, e·(i+1)/d)` (integer division), so blocks differ in size by at most one and none is empty
//! (a degree never exceeds its extent). [`block_range`] and [`tile_rect`] define this split; the runtime
//! partitions tensors with the same functions.

use crate::machine::DeviceId;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{Dim, Rect, Shape};
use std::fmt;
use std::ops::Range;

/// Degrees per dim (indexed by [`Dim::axis`]: n, c, h, w) and the first device of the tile block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParallelConfig {
    degrees: [u32; MAX_DIMS],
    first_device: u32,
}

impl ParallelConfig {
    /// A config from its degrees (n, c, h, w) and first device; see [`ParallelConfig::validate`].
    ///
    /// # Panics
    /// If a degree or the first device does not fit a `u32`: callers pass degrees and devices of a
    /// machine, which has at most [`crate::machine::MAX_DEVICES`] devices (strategy files are
    /// checked against it first).
    pub fn new(degrees: [usize; MAX_DIMS], first_device: DeviceId) -> ParallelConfig {
        let narrow = |v: usize| u32::try_from(v).expect("degrees and devices fit a u32");
        ParallelConfig {
            degrees: degrees.map(narrow),
            first_device: narrow(first_device),
        }
    }

    /// The whole layer on one device.
    pub fn serial(device: DeviceId) -> ParallelConfig {
        ParallelConfig::new([1; MAX_DIMS], device)
    }

    /// `degree` tiles along `dim` on devices `first_device..first_device + degree`.
    pub fn split(dim: Dim, degree: usize, first_device: DeviceId) -> ParallelConfig {
        let mut degrees = [1; MAX_DIMS];
        degrees[dim.axis()] = degree;
        ParallelConfig::new(degrees, first_device)
    }

    pub fn degree(&self, dim: Dim) -> usize {
        self.degrees[dim.axis()] as usize
    }

    /// Degrees of n, c, h, w.
    pub fn degrees(&self) -> [usize; MAX_DIMS] {
        self.degrees.map(|d| d as usize)
    }

    /// Number of tiles (the product of the degrees).
    pub fn total(&self) -> usize {
        self.degrees.iter().map(|&d| d as usize).product()
    }

    pub fn first_device(&self) -> DeviceId {
        self.first_device as usize
    }

    /// The devices holding the tiles, tile `t` on `devices().start + t`.
    pub fn devices(&self) -> Range<DeviceId> {
        self.first_device()..self.first_device() + self.total()
    }

    pub fn device_of_tile(&self, tile: usize) -> DeviceId {
        self.first_device() + tile
    }

    /// Block index along each axis of tile `tile` (row-major over n, c, h, w).
    pub fn tile_coords(&self, mut tile: usize) -> [usize; MAX_DIMS] {
        let mut coords = [0; MAX_DIMS];
        for axis in (0..MAX_DIMS).rev() {
            let d = self.degrees[axis] as usize;
            coords[axis] = tile % d;
            tile /= d;
        }
        coords
    }

    /// The tile at block indices `coords`.
    pub fn tile_index(&self, coords: [usize; MAX_DIMS]) -> usize {
        (0..MAX_DIMS).fold(0, |t, axis| t * self.degrees[axis] as usize + coords[axis])
    }

    /// The same degrees on another device block.
    pub fn with_first_device(&self, first_device: DeviceId) -> ParallelConfig {
        ParallelConfig {
            first_device: u32::try_from(first_device).expect("device ids fit a u32"),
            ..*self
        }
    }

    /// Checks the config against a layer whose output has `shape` and may be split along `dims`.
    pub fn validate(
        &self,
        shape: &Shape,
        dims: &[Dim],
        num_devices: usize,
    ) -> Result<(), ConfigError> {
        for dim in Dim::ALL {
            let degree = self.degree(dim);
            if degree == 0 || !degree.is_power_of_two() {
                return Err(ConfigError::NotPowerOfTwo { dim, degree });
            }
            if degree == 1 {
                continue;
            }
            if !dims.contains(&dim) || dim.axis() >= shape.ndim() {
                return Err(ConfigError::NotParallelizable {
                    dim,
                    dims: dims.to_vec(),
                });
            }
            let extent = shape.dim(dim.axis());
            if degree > extent {
                return Err(ConfigError::DegreeTooLarge {
                    dim,
                    degree,
                    extent,
                });
            }
        }
        let total = self.total();
        if total > num_devices {
            return Err(ConfigError::TooManyTiles { total, num_devices });
        }
        let first = self.first_device();
        if !first.is_multiple_of(total) || first + total > num_devices {
            return Err(ConfigError::BadDeviceBlock {
                first,
                total,
                num_devices,
            });
        }
        Ok(())
    }

    /// `n=2,c=2`-style text listing the degrees above 1, or `1` for a serial layer.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut any = false;
        for dim in Dim::ALL {
            let d = self.degree(dim);
            if d > 1 {
                if any {
                    write!(f, ",")?;
                }
                write!(f, "{}={d}", dim.name())?;
                any = true;
            }
        }
        if !any {
            write!(f, "1")?;
        }
        Ok(())
    }
}

/// Why a config is not valid for a layer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("degree {degree} of dim {} is not a power of two", dim.name())]
    NotPowerOfTwo { dim: Dim, degree: usize },
    #[error("dim {} is not parallelizable for this layer (it may split {})", dim.name(), dim_list(dims))]
    NotParallelizable { dim: Dim, dims: Vec<Dim> },
    #[error("degree {degree} of dim {} exceeds its extent {extent}", dim.name())]
    DegreeTooLarge {
        dim: Dim,
        degree: usize,
        extent: usize,
    },
    #[error("{total} tiles need more than the machine's {num_devices} devices")]
    TooManyTiles { total: usize, num_devices: usize },
    #[error(
        "devices {first}..{} are not an aligned block of {total} (the first device must be a multiple of {total} and the block inside 0..{num_devices})",
        first + total
    )]
    BadDeviceBlock {
        first: usize,
        total: usize,
        num_devices: usize,
    },
}

fn dim_list(dims: &[Dim]) -> String {
    let names: Vec<&str> = dims.iter().map(|d| d.name()).collect();
    format!("{{{}}}", names.join(", "))
}

/// Block `index` of `degree` equal-as-possible blocks of `0..extent`: `[e·i/d, e·(i+1)/d)`.
pub fn block_range(extent: usize, degree: usize, index: usize) -> (usize, usize) {
    (extent * index / degree, extent * (index + 1) / degree)
}

/// The block holding coordinate `x` of `0..extent` split in `degree` blocks (inverse of
/// [`block_range`]): the largest `i` with `e·i/d <= x`.
pub fn block_of(extent: usize, degree: usize, x: usize) -> usize {
    ((x + 1) * degree).div_ceil(extent) - 1
}

/// The rect of tile `tile` of a tensor of `shape` under `config`.
pub fn tile_rect(shape: &Shape, config: &ParallelConfig, tile: usize) -> Rect {
    let coords = config.tile_coords(tile);
    let degrees = config.degrees();
    let nd = shape.ndim();
    let mut lo = [0; MAX_DIMS];
    let mut hi = [1; MAX_DIMS];
    for axis in 0..nd {
        (lo[axis], hi[axis]) = block_range(shape.dim(axis), degrees[axis], coords[axis]);
    }
    Rect::new(&lo[..nd], &hi[..nd])
}

/// The rects of all tiles of a tensor of `shape` under `config`, in tile order: [`tile_rect`] of
/// each tile. Row-major order changes the last axis's block from one tile to the next and the others
/// more rarely, so each rect is the previous one with the changed axes recomputed, not all of them.
pub fn tile_rects(shape: &Shape, config: &ParallelConfig) -> TileRects {
    let (degrees, nd) = (config.degrees(), shape.ndim());
    // tile 0: block 0 on every axis (none when a degree is 0)
    let first = (config.total() > 0).then(|| {
        let hi: [usize; MAX_DIMS] =
            std::array::from_fn(|axis| block_range(shape.dim(axis), degrees[axis], 0).1);
        Rect::new(&[0; MAX_DIMS][..nd], &hi[..nd])
    });
    TileRects {
        extents: std::array::from_fn(|axis| shape.dim(axis)),
        ndim: nd,
        degrees,
        coords: [0; MAX_DIMS],
        next: first,
    }
}

/// Iterator of [`tile_rects`].
#[derive(Clone, Debug)]
pub struct TileRects {
    extents: [usize; MAX_DIMS],
    ndim: usize,
    degrees: [usize; MAX_DIMS],
    /// Block index along each axis of `next`.
    coords: [usize; MAX_DIMS],
    next: Option<Rect>,
}

impl Iterator for TileRects {
    type Item = Rect;

    fn next(&mut self) -> Option<Rect> {
        let current = self.next?;
        let mut rect = current;
        // the odometer of `ParallelConfig::tile_coords`: the last axis fastest
        let mut axis = MAX_DIMS;
        loop {
            if axis == 0 {
                self.next = None;
                break;
            }
            axis -= 1;
            self.coords[axis] += 1;
            let wrapped = self.coords[axis] == self.degrees[axis];
            if wrapped {
                self.coords[axis] = 0;
            }
            // axes past the shape's rank stay [0, 1), as in `tile_rect`
            if axis < self.ndim {
                // block i + 1 starts where block i ends, and block 0 at 0: one division, not two
                let (extent, degree) = (self.extents[axis], self.degrees[axis]);
                rect.lo[axis] = if wrapped { 0 } else { rect.hi[axis] };
                rect.hi[axis] = block_range(extent, degree, self.coords[axis]).1;
            }
            if !wrapped {
                self.next = Some(rect);
                break;
            }
        }
        Some(current)
    }
}

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

    #[test]
    fn uneven_blocks_cover_the_extent_once() {
        for extent in 1..40 {
            for degree in [1, 2, 4, 8, 16, 32] {
                if degree > extent {
                    continue;
                }
                let mut next = 0;
                for i in 0..degree {
                    let (lo, hi) = block_range(extent, degree, i);
                    assert_eq!(lo, next);
                    assert!(hi > lo, "empty block {i} of {degree} over {extent}");
                    for x in lo..hi {
                        assert_eq!(block_of(extent, degree, x), i);
                    }
                    next = hi;
                }
                assert_eq!(next, extent);
            }
        }
    }

    #[test]
    fn tiles_are_row_major_over_nchw() {
        let shape = Shape::nchw(8, 6, 10, 10);
        let cfg = ParallelConfig::new([2, 1, 2, 1], 4);
        assert_eq!(cfg.total(), 4);
        assert_eq!(cfg.devices(), 4..8);
        assert_eq!(
            tile_rect(&shape, &cfg, 1),
            Rect::new(&[0, 0, 5, 0], &[4, 6, 10, 10])
        );
        assert_eq!(
            tile_rect(&shape, &cfg, 2),
            Rect::new(&[4, 0, 0, 0], &[8, 6, 5, 10])
        );
        assert_eq!(cfg.tile_index(cfg.tile_coords(3)), 3);
        let dense = ParallelConfig::new([1, 4, 1, 1], 0);
        assert_eq!(
            tile_rect(&Shape::nc(3, 10), &dense, 3),
            Rect::new(&[0, 7], &[3, 10])
        );
        assert_eq!(cfg.to_string(), "n=2,h=2");
        assert_eq!(ParallelConfig::serial(3).to_string(), "1");
    }

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
    fn validation_names_the_problem() {
        let shape = Shape::nc(8, 3);
        let dims = [Dim::N, Dim::C];
        let e = |c: ParallelConfig| c.validate(&shape, &dims, 8).unwrap_err().to_string();
        assert_eq!(
            e(ParallelConfig::split(Dim::N, 3, 0)),
            "degree 3 of dim n is not a power of two"
        );
        assert_eq!(
            e(ParallelConfig::split(Dim::C, 4, 0)),
            "degree 4 of dim c exceeds its extent 3"
        );
        assert!(e(ParallelConfig::split(Dim::H, 2, 0)).contains("dim h is not parallelizable"));
        assert!(e(ParallelConfig::split(Dim::N, 2, 1)).contains("not an aligned block"));
        assert!(e(ParallelConfig::split(Dim::N, 2, 8)).contains("not an aligned block"));
        let wide = Shape::nc(64, 3);
        assert!(
            ParallelConfig::split(Dim::N, 16, 0)
                .validate(&wide, &dims, 8)
                .unwrap_err()
                .to_string()
                .contains("16 tiles need more than the machine's 8 devices")
        );
    }
}
