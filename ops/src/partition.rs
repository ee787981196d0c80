//! The partition vocabulary shared by the planner and the runtime: a layer's parallel
//! configuration (a degree per parallelizable dim of its output and the block of devices holding
//! the tiles) and the split of a tensor into tiles.
//!
//! The search space is the paper's (OptCNN §4): every degree a power of two no larger than its
//! dim's extent, the total degree (the number of tiles) at most the number of devices, and the
//! tiles on an aligned contiguous block of devices — tile `t` on device `first_device + t` with
//! `first_device` a multiple of the total degree. Tiles are numbered row-major over the dims n, c,
//! h, w (w fastest).
//!
//! A fifth degree, `red` (reduction splits, beyond the paper's space), splits a conv or dense
//! layer's input channels: each of a block's `red` tiles reads a block of the input channels and
//! the matching block of the weight, and computes a full-size partial sum of the block's output;
//! the partials are summed (the runtime's reductions) before the activation. Tile `t` is then the
//! `t % red`-th partial ([`ParallelConfig::reduction_of`]) of output block `t / red`, so a
//! block's partials sit on consecutive devices. [`reduction_range`] gives a partial's channels.
//!
//! Extents need not be divisible by their degree: block `i` of `d` over an extent `e` is
//! `[e·i/d, e·(i+1)/d)` (integer division), so blocks differ in size by at most one and none is empty
//! (a degree never exceeds its extent). [`block_range`] and [`tile_rect`] define this split; the
//! planner prices it and the runtime partitions tensors with the same functions.

use crate::op::partial_param_rect;
use crate::shape::MAX_DIMS;
use crate::{Dim, Graph, LayerId, Rect, Shape};
use std::fmt;
use std::ops::Range;

/// Index of a device, `0..num_devices`, numbered node by node.
pub type DeviceId = usize;

/// Degrees per dim (indexed by [`Dim::axis`]: n, c, h, w) and the first device of the tile block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParallelConfig {
    degrees: [u32; MAX_DIMS],
    /// Partial sums per output block over the input channels (1: none).
    red: u32,
    first_device: u32,
}

impl ParallelConfig {
    /// A config from its degrees (n, c, h, w) and first device; see [`ParallelConfig::validate`].
    ///
    /// # Panics
    /// If a degree or the first device does not fit a `u32`: callers pass degrees and devices of a
    /// machine, which the planner bounds far below that (strategy files are checked against it
    /// first).
    pub fn new(degrees: [usize; MAX_DIMS], first_device: DeviceId) -> ParallelConfig {
        let narrow = |v: usize| u32::try_from(v).expect("degrees and devices fit a u32");
        ParallelConfig {
            degrees: degrees.map(narrow),
            red: 1,
            first_device: narrow(first_device),
        }
    }

    /// The same blocks, each computed as `red` partial sums over blocks of the input channels.
    ///
    /// # Panics
    /// If `red` does not fit a `u32` (see [`ParallelConfig::new`]).
    pub fn with_reduction(&self, red: usize) -> ParallelConfig {
        ParallelConfig {
            red: u32::try_from(red).expect("degrees fit a u32"),
            ..*self
        }
    }

    /// Partial sums per output block (1: the block is computed whole).
    pub fn reduction(&self) -> usize {
        self.red as usize
    }

    /// Which partial of its block tile `tile` computes, `0..reduction()`.
    pub fn reduction_of(&self, tile: usize) -> usize {
        tile % self.reduction()
    }

    /// Output blocks (the product of the degrees; tiles over `reduction()`).
    pub fn blocks(&self) -> usize {
        self.degrees.iter().map(|&d| d as usize).product()
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

    /// Number of tiles (the product of the degrees, times the partials of each block).
    pub fn total(&self) -> usize {
        self.blocks() * self.reduction()
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

    /// Block index along each axis of tile `tile`'s output block (row-major over n, c, h, w).
    pub fn tile_coords(&self, tile: usize) -> [usize; MAX_DIMS] {
        let mut tile = tile / self.reduction();
        let mut coords = [0; MAX_DIMS];
        for axis in (0..MAX_DIMS).rev() {
            let d = self.degrees[axis] as usize;
            coords[axis] = tile % d;
            tile /= d;
        }
        coords
    }

    /// The tile at block indices `coords` (its first partial).
    pub fn tile_index(&self, coords: [usize; MAX_DIMS]) -> usize {
        let block = (0..MAX_DIMS).fold(0, |t, axis| t * self.degrees[axis] as usize + coords[axis]);
        block * self.reduction()
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
        let red = self.reduction();
        if red == 0 || !red.is_power_of_two() {
            return Err(ConfigError::ReductionNotPowerOfTwo { red });
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

    /// Checks the reduction degree against a layer whose op sums over `channels` input channels
    /// (`None`: an op that cannot be split that way, see `OpSpec::reduction_channels`).
    pub fn validate_reduction(&self, channels: Option<usize>) -> Result<(), ConfigError> {
        let red = self.reduction();
        if red == 0 || !red.is_power_of_two() {
            return Err(ConfigError::ReductionNotPowerOfTwo { red });
        }
        match channels {
            _ if red == 1 => Ok(()),
            None => Err(ConfigError::ReductionUnsupported { red }),
            Some(channels) if red > channels => {
                Err(ConfigError::ReductionTooLarge { red, channels })
            }
            Some(_) => Ok(()),
        }
    }

    /// `n=2,c=2`-style text listing the degrees above 1, or `1` for a serial layer.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut any = false;
        let named = Dim::ALL
            .iter()
            .map(|dim| (dim.name(), self.degree(*dim)))
            .chain([("red", self.reduction())]);
        for (name, d) in named {
            if d > 1 {
                if any {
                    write!(f, ",")?;
                }
                write!(f, "{name}={d}")?;
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
    #[error("reduction degree {red} is not a power of two")]
    ReductionNotPowerOfTwo { red: usize },
    #[error(
        "reduction degree {red}: only conv2d (without groups) and dense layers sum over input \
         channels that can be split"
    )]
    ReductionUnsupported { red: usize },
    #[error("reduction degree {red} exceeds the {channels} input channels")]
    ReductionTooLarge { red: usize, channels: usize },
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

/// The GPU of device `d` when `devices` devices are spread over `gpus` GPUs: `d·g/n`, so that
/// consecutive devices (which the planner numbers node by node) share a GPU, and every GPU gets a
/// device where there are at least as many devices as GPUs. The runtime places devices so and the
/// planner models them so.
pub fn gpu_of(d: DeviceId, devices: usize, gpus: usize) -> usize {
    d * gpus / devices.max(1)
}

/// The input channels partial `r` of `red` reads of `channels`: block `r` of them.
pub fn reduction_range(channels: usize, red: usize, r: usize) -> (usize, usize) {
    block_range(channels, red, r)
}

/// The rect of tile `tile` of a tensor of `shape` under `config`: its output block (a block's
/// partials share it).
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

/// The blocks of a replicated slice and their owners: block j of the slice's rows (first axis) is
/// owned by the j-th of its `devices` (ascending). One block per device, or per row when the slice
/// has fewer rows than devices. Each owner keeps the block's master copy and sums its replicas'
/// gradient terms (the planner's t_s prices exactly this).
pub fn owned_blocks(slice: &Rect, devices: &[DeviceId]) -> Vec<(Rect, DeviceId)> {
    let (lo, rows) = (slice.lo[0], slice.extent(0));
    let blocks = devices.len().min(rows).max(1);
    (0..blocks)
        .map(|j| {
            let (a, b) = block_range(rows, blocks, j);
            (slice.with_axis(0, lo + a, lo + b), devices[j])
        })
        .collect()
}

/// One point of a layer's launch domain: a tile and where it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    /// The output block (which a reduction split's partials share).
    pub tile: Rect,
    pub device: DeviceId,
    /// Which partial of its block this point computes, of how many (`(0, 1)`: the whole block).
    pub partial: (usize, usize),
}

/// The points of a layer of output `shape` under `config`, in tile order.
pub fn points(shape: &Shape, config: &ParallelConfig) -> Vec<Point> {
    (0..config.total())
        .map(|t| Point {
            tile: tile_rect(shape, config, t),
            device: config.device_of_tile(t),
            partial: (config.reduction_of(t), config.reduction()),
        })
        .collect()
}

/// A parameter slice and the devices of the tiles that use it, ascending.
pub type SliceUsers = (Rect, Vec<DeviceId>);

/// For each parameter and buffer of `layer` under `config` (by index), its distinct slices in
/// order of first use, each with the devices of the tiles that use it, ascending (tiles run on
/// devices in ascending order). A reduction split's partial uses its block of the input channels'
/// weights, and only the first partial the bias.
pub fn param_slices(
    graph: &Graph,
    layer: LayerId,
    config: &ParallelConfig,
) -> Vec<(usize, Vec<SliceUsers>)> {
    let l = graph.layer(layer);
    let op = l.op.spec();
    let points = points(&l.shape, config);
    let mut out = Vec::new();
    for (param, spec) in graph.layer_params(layer).iter().enumerate() {
        let mut slices: Vec<SliceUsers> = Vec::new();
        for &Point {
            tile,
            device,
            partial: (r, red),
        } in &points
        {
            let Some(slice) = partial_param_rect(op, param, spec, &tile, r, red) else {
                continue;
            };
            match slices.iter_mut().find(|(s, _)| *s == slice) {
                Some((_, devices)) if !devices.contains(&device) => devices.push(device),
                Some(_) => {}
                None => slices.push((slice, vec![device])),
            }
        }
        out.push((param, slices));
    }
    out
}

/// Devices grouped into nodes (hosts), each a run of consecutive devices: device numbering goes
/// node by node. Parameter synchronisation sends one message per node between nodes
/// ([`ParamHome::relays`]); within one node every replica talks to the owner.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Nodes {
    /// Per node, one past its last device, ascending.
    ends: Vec<DeviceId>,
}

impl Nodes {
    /// `devices` devices in one node (an embedded run, a one-host machine).
    pub fn one(devices: usize) -> Nodes {
        Nodes {
            ends: vec![devices],
        }
    }

    /// Nodes of `sizes` devices each, in order.
    pub fn of_sizes(sizes: impl IntoIterator<Item = usize>) -> Nodes {
        let mut end = 0;
        let ends = sizes
            .into_iter()
            .map(|size| {
                end += size;
                end
            })
            .collect();
        Nodes { ends }
    }

    /// Every device of every node.
    pub fn devices(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    pub fn count(&self) -> usize {
        self.ends.len()
    }

    /// The node of `device` (devices past the last node count as the last node's).
    pub fn node_of(&self, device: DeviceId) -> usize {
        self.ends
            .partition_point(|&end| end <= device)
            .min(self.ends.len().saturating_sub(1))
    }
}

impl From<usize> for Nodes {
    fn from(devices: usize) -> Nodes {
        Nodes::one(devices)
    }
}

/// A device that sums the gradients of one parameter block for the other `members` of its node
/// and sends the owner that one sum; it forwards the updated block to them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relay {
    pub device: DeviceId,
    /// The block's other devices on the relay's node, ascending.
    pub members: Vec<DeviceId>,
}

/// A block of a layer's parameter `param`, its owner and the other devices whose tiles use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamHome {
    pub param: usize,
    /// The block the owner keeps and updates.
    pub slice: Rect,
    /// The slice the tiles read, which `slice` is a block of.
    pub read_slice: Rect,
    pub owner: DeviceId,
    /// The other devices using the slice, ascending.
    pub replicas: Vec<DeviceId>,
}

impl ParamHome {
    /// Where this block's synchronisation goes through a relay on `nodes`: on each node other
    /// than the owner's that holds two or more of the block's devices, one of them sums the
    /// others' gradients and sends the owner that sum, and forwards the updated block to them, so
    /// one message a node crosses between nodes each way (the hierarchical reduce of an
    /// all-reduce). The block's devices `d_0 < … < d_{k-1}` own blocks `0..k` in turn
    /// ([`owned_blocks`]); block `j`'s relay on a node holding `m` of them is the `j mod m`-th, so
    /// that a node's devices relay blocks in turn. Replicas outside every relay's members (on the
    /// owner's node, alone on theirs, or relays themselves) exchange with the owner directly.
    pub fn relays(&self, nodes: &Nodes) -> Vec<Relay> {
        relays(self.owner, &self.replicas, nodes)
    }
}

/// [`ParamHome::relays`] of the block `owner` owns, whose other devices are `replicas`
/// (ascending).
pub fn relays(owner: DeviceId, replicas: &[DeviceId], nodes: &Nodes) -> Vec<Relay> {
    if nodes.count() < 2 || replicas.is_empty() {
        return Vec::new();
    }
    let j = replicas.partition_point(|&r| r < owner);
    let own = nodes.node_of(owner);
    let mut relays = Vec::new();
    let mut rest = replicas;
    while let Some(&first) = rest.first() {
        let node = nodes.node_of(first);
        let on_node = rest.partition_point(|&r| nodes.node_of(r) == node);
        let (here, after) = rest.split_at(on_node);
        rest = after;
        if node == own || here.len() < 2 {
            continue;
        }
        let device = here[j % here.len()];
        relays.push(Relay {
            device,
            members: here.iter().copied().filter(|&d| d != device).collect(),
        });
    }
    relays
}

/// Every block of every parameter and buffer of `layer` under `config`, trainable or not: a
/// trainable slice several devices use is cut into [`owned_blocks`]; any other slice is one block,
/// kept by the first device using it.
pub fn param_homes(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> Vec<ParamHome> {
    let specs = graph.layer_params(layer);
    let mut homes = Vec::new();
    for (param, slices) in param_slices(graph, layer, config) {
        for (read_slice, devices) in slices {
            let blocks = if specs[param].trainable && devices.len() > 1 && !read_slice.is_empty() {
                owned_blocks(&read_slice, &devices)
            } else {
                vec![(read_slice, devices[0])]
            };
            for (slice, owner) in blocks {
                homes.push(ParamHome {
                    param,
                    slice,
                    read_slice,
                    owner,
                    replicas: devices.iter().copied().filter(|&d| d != owner).collect(),
                });
            }
        }
    }
    homes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocks_partials_are_consecutive_tiles_sharing_its_rect() {
        let c = ParallelConfig::split(Dim::N, 2, 4).with_reduction(2);
        assert_eq!((c.blocks(), c.reduction(), c.total()), (2, 2, 4));
        assert_eq!(c.devices(), 4..8);
        let shape = Shape::nchw(6, 3, 2, 2);
        let rects: Vec<Rect> = (0..4).map(|t| tile_rect(&shape, &c, t)).collect();
        assert_eq!(rects[0], rects[1]);
        assert_eq!(rects[2], rects[3]);
        assert_eq!(rects[2].lo[0], 3);
        let partials: Vec<usize> = (0..4).map(|t| c.reduction_of(t)).collect();
        assert_eq!(partials, [0, 1, 0, 1]);
        assert_eq!(c.tile_index([1, 0, 0, 0]), 2, "a block's first partial");
        assert_eq!(c.to_string(), "n=2,red=2");
        assert_eq!(reduction_range(3, 2, 0), (0, 1));
        assert_eq!(reduction_range(3, 2, 1), (1, 3));
        assert!(c.validate_reduction(Some(3)).is_ok());
        assert_eq!(
            c.validate_reduction(Some(1)),
            Err(ConfigError::ReductionTooLarge {
                red: 2,
                channels: 1
            })
        );
        assert_eq!(
            c.validate_reduction(None),
            Err(ConfigError::ReductionUnsupported { red: 2 })
        );
        assert!(ParallelConfig::serial(0).validate_reduction(None).is_ok());
    }

    #[test]
    fn each_other_node_relays_a_block_through_its_devices_in_turn() {
        let nodes = Nodes::of_sizes([2, 2, 3]);
        assert_eq!((nodes.devices(), nodes.count()), (7, 3));
        assert_eq!(
            (0..7).map(|d| nodes.node_of(d)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2, 2]
        );
        let home = |owner: DeviceId| ParamHome {
            param: 0,
            slice: Rect::new(&[0], &[1]),
            read_slice: Rect::new(&[0], &[7]),
            owner,
            replicas: (0..7).filter(|&d| d != owner).collect(),
        };
        // block 0 (owner 0): node 1 through its first device, node 2 through its first
        assert_eq!(
            home(0).relays(&nodes),
            [
                Relay {
                    device: 2,
                    members: vec![3]
                },
                Relay {
                    device: 4,
                    members: vec![5, 6]
                }
            ]
        );
        // block 5 (owner 5): node 0 through device 5 mod 2 = 1, node 1 through device 3
        assert_eq!(
            home(5).relays(&nodes),
            [
                Relay {
                    device: 1,
                    members: vec![0]
                },
                Relay {
                    device: 3,
                    members: vec![2]
                }
            ]
        );
        // on one node, or with one device on the other node, every replica sends to the owner
        assert!(home(0).relays(&Nodes::one(7)).is_empty());
        let mut alone = home(0);
        alone.replicas = vec![1, 2];
        assert!(alone.relays(&nodes).is_empty());
    }

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
