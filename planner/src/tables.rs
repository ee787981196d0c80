//! Eq. 1 as tables for the searches: t_c + t_s per (layer, config) and t_x per (edge, config pair),
//! each computed once. The numbers are the same as [`CostModel`]'s (tested), computed faster:
//!
//! - Geometry depends only on the degree vectors ("layouts"), not on the device block, so overlaps are
//!   computed once per pair of layouts. The overlap of a producer tile with a consumer tile's needed
//!   rect is a product of 1-D interval overlaps; the producer tiles that meet a needed rect are a box
//!   of block indices found by division ([`block_of`]), so no non-overlapping pair is visited.
//! - With aligned contiguous blocks, each (producer tile, consumer tile) pair is its own device pair,
//!   so t_x of a block pair is a max over messages. Block pairs whose device pairs have the same
//!   links ("pair classes", e.g. "two different nodes") share one evaluation; when every device pair
//!   of a class uses the same link, only the largest message matters.
//! - Layers and edges with identical op, shapes and parallel dims share their tables.

use crate::config::{ConfigSpace, ParallelConfig, block_of, block_range, tile_rect};
use crate::cost::CostModel;
use crate::machine::{Link, MachineModel};
use crate::sync::{LinkLoad, SyncPlan, sync_time_shifted};
use crate::transfer::Edge;
use legion_ops::shape::MAX_DIMS;
use legion_ops::{LayerId, Rect};
use std::collections::HashMap;

/// Per-config and per-config-pair costs of a model on a machine.
pub struct CostTables<'m> {
    model: &'m CostModel<'m>,
    spaces: Vec<ConfigSpace>,
    compute: Vec<Vec<f64>>,
    sync: Vec<Vec<f64>>,
    node: Vec<Vec<f64>>,
    pairs: DevicePairs,
    edge_class: Vec<usize>,
}

impl<'m> CostTables<'m> {
    /// Enumerates every layer's configs and computes t_c and t_s for each. Edge tables are computed
    /// on request ([`CostTables::edge_table`]): they are large, and a search needs each only briefly.
    pub fn build(model: &'m CostModel<'m>) -> CostTables<'m> {
        let graph = model.graph();
        let machine = model.machine();
        let devices = machine.num_devices();
        let mut spaces: Vec<ConfigSpace> = Vec::new();
        let mut compute: Vec<Vec<f64>> = Vec::new();
        let mut sync: Vec<Vec<f64>> = Vec::new();
        let mut memo: HashMap<String, usize> = HashMap::new();
        for id in graph.ids() {
            let layer = graph.layer(id);
            let dims = layer.op.spec().parallel_dims(&layer.shape);
            let key = format!(
                "{}|{:?}|{:?}",
                serde_json::to_string(&layer.op).unwrap_or_default(),
                model.input_shapes(id),
                dims
            );
            if let Some(&same) = memo.get(&key) {
                spaces.push(spaces[same].clone());
                compute.push(compute[same].clone());
                sync.push(sync[same].clone());
                continue;
            }
            memo.insert(key, id.0);
            let space = ConfigSpace::enumerate(&layer.shape, dims, devices);
            let (c, s) = node_costs(model, id, &space);
            spaces.push(space);
            compute.push(c);
            sync.push(s);
        }
        let node = compute
            .iter()
            .zip(&sync)
            .map(|(c, s)| c.iter().zip(s).map(|(c, s)| c + s).collect())
            .collect();
        let mut edge_memo: HashMap<String, usize> = HashMap::new();
        let edge_class = model
            .edges()
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let src = graph.layer(e.src);
                let dst = graph.layer(e.dst);
                let key = format!(
                    "{:?}|{:?}|{}|{:?}|{}",
                    src.shape,
                    src.op.spec().parallel_dims(&src.shape),
                    serde_json::to_string(&dst.op).unwrap_or_default(),
                    model.input_shapes(e.dst),
                    e.input
                );
                *edge_memo.entry(key).or_insert(i)
            })
            .collect();
        CostTables {
            model,
            spaces,
            compute,
            sync,
            node,
            pairs: DevicePairs::new(machine),
            edge_class,
        }
    }

    pub fn model(&self) -> &'m CostModel<'m> {
        self.model
    }

    pub fn num_layers(&self) -> usize {
        self.spaces.len()
    }

    pub fn edges(&self) -> &[Edge] {
        self.model.edges()
    }

    /// The configs of a layer, in table order.
    pub fn space(&self, layer: LayerId) -> &ConfigSpace {
        &self.spaces[layer.0]
    }

    /// t_c per config of a layer.
    pub fn compute(&self, layer: LayerId) -> &[f64] {
        &self.compute[layer.0]
    }

    /// t_s per config of a layer.
    pub fn sync(&self, layer: LayerId) -> &[f64] {
        &self.sync[layer.0]
    }

    /// t_c + t_s per config of a layer.
    pub fn node_cost(&self, layer: LayerId) -> &[f64] {
        &self.node[layer.0]
    }

    /// Edges with equal numbers share a class: their tables are identical.
    pub fn edge_class(&self, edge: usize) -> usize {
        self.edge_class[edge]
    }

    /// Configs (by layer id) from per-layer indices into the spaces.
    pub fn configs(&self, indices: &[usize]) -> Vec<ParallelConfig> {
        indices
            .iter()
            .zip(&self.spaces)
            .map(|(&i, s)| s.config(i))
            .collect()
    }

    /// t_x of edge `edge` for every config pair: row-major, `[src config][dst config]`.
    pub fn edge_table(&self, edge: usize) -> Vec<f64> {
        let graph = self.model.graph();
        let e = self.model.edges()[edge];
        let src_space = &self.spaces[e.src.0];
        let dst_space = &self.spaces[e.dst.0];
        let producer = graph.layer(e.src).shape;
        let consumer = graph.layer(e.dst);
        let inputs = self.model.input_shapes(e.dst);
        let nd = producer.ndim();
        let extents: Vec<usize> = producer.dims().to_vec();
        let columns = dst_space.len();
        let mut table = vec![0.0; src_space.len() * columns];

        // What each consumer tile reads, per consumer layout (independent of the device block).
        let needs: Vec<Vec<Rect>> = dst_space
            .layouts()
            .iter()
            .map(|h| {
                let cfg = ParallelConfig::new(*h, 0);
                (0..cfg.total())
                    .map(|t| {
                        let out = tile_rect(&consumer.shape, &cfg, t);
                        consumer.op.spec().project(inputs, &out)[e.input]
                    })
                    .collect()
            })
            .collect();

        let mut messages: Vec<Message> = Vec::new();
        let mut values: Vec<f64> = Vec::new();
        for (gi, g) in src_space.layouts().iter().enumerate() {
            let src_total: usize = g.iter().product();
            for (hi, h) in dst_space.layouts().iter().enumerate() {
                let dst_total: usize = h.iter().product();
                messages.clear();
                let mut largest = 0.0f64;
                for (dst_tile, need) in needs[hi].iter().enumerate() {
                    if need.is_empty() {
                        continue;
                    }
                    let mut first = [0; MAX_DIMS];
                    let mut last = [0; MAX_DIMS];
                    for a in 0..nd {
                        first[a] = block_of(extents[a], g[a], need.lo[a]);
                        last[a] = block_of(extents[a], g[a], need.hi[a] - 1);
                    }
                    let mut idx = first;
                    loop {
                        let mut volume = 1;
                        let mut src_tile = 0;
                        for a in 0..nd {
                            let (lo, hi) = block_range(extents[a], g[a], idx[a]);
                            volume *= hi.min(need.hi[a]) - lo.max(need.lo[a]);
                            src_tile = src_tile * g[a] + idx[a];
                        }
                        let bytes = (4 * volume) as f64;
                        largest = largest.max(bytes);
                        messages.push(Message {
                            src_tile,
                            dst_tile,
                            bytes,
                        });
                        // advance the odometer over the box first..=last
                        let mut a = nd;
                        loop {
                            if a == 0 {
                                break;
                            }
                            a -= 1;
                            if idx[a] < last[a] {
                                idx[a] += 1;
                                break;
                            }
                            idx[a] = first[a];
                        }
                        if idx == first {
                            break;
                        }
                    }
                }
                let classes = self.pairs.classes(src_total, dst_total);
                values.clear();
                values.extend(
                    classes
                        .classes
                        .iter()
                        .map(|c| self.pairs.class_time(c, &messages, largest)),
                );
                let src_configs = src_space.layout_configs(gi);
                let dst_configs = dst_space.layout_configs(hi);
                let per_row = dst_configs.len();
                for (si, row) in src_configs.enumerate() {
                    let out = &mut table[row * columns + dst_configs.start..][..per_row];
                    let class_row = &classes.class_of[si * classes.dst_blocks..][..per_row];
                    for (o, &c) in out.iter_mut().zip(class_row) {
                        *o = values[c as usize];
                    }
                }
            }
        }
        table
    }
}

/// t_c and t_s of every config of a layer.
fn node_costs(model: &CostModel, id: LayerId, space: &ConfigSpace) -> (Vec<f64>, Vec<f64>) {
    let graph = model.graph();
    let machine = model.machine();
    let layer = graph.layer(id);
    let inputs = model.input_shapes(id);
    let provider = model.provider();
    let mut compute = vec![0.0; space.len()];
    let mut sync = vec![0.0; space.len()];
    let specs = machine.specs().len();
    for (li, layout) in space.layouts().iter().enumerate() {
        let base = ParallelConfig::new(*layout, 0);
        let range = space.layout_configs(li);
        // A provider answers by device spec (see `CostProvider`), so each tile is priced once per
        // spec in use.
        let mut priced: Vec<Option<f64>> = vec![None; base.total() * specs];
        let rects: Vec<Rect> = (0..base.total())
            .map(|t| tile_rect(&layer.shape, &base, t))
            .collect();
        let loads: Vec<LinkLoad> = SyncPlan::for_layer(graph, id, &base).link_loads();
        for ci in range {
            let config = space.config(ci);
            let mut worst = 0.0f64;
            for (t, rect) in rects.iter().enumerate() {
                let device = config.device_of_tile(t);
                let slot = &mut priced[t * specs + machine.spec_index(device)];
                let time = *slot
                    .get_or_insert_with(|| provider.compute_time(layer, inputs, rect, device));
                worst = worst.max(time);
            }
            compute[ci] = worst;
            sync[ci] = sync_time_shifted(&loads, machine, config.first_device());
        }
    }
    (compute, sync)
}

/// One producer-tile → consumer-tile message of a layout pair.
#[derive(Clone, Copy, Debug)]
struct Message {
    src_tile: usize,
    dst_tile: usize,
    bytes: f64,
}

/// Device pairs grouped by their links, for the t_x tables.
struct DevicePairs {
    devices: usize,
    /// Per ordered device pair, the index of its (forward, backward) links; 0 for a device and itself.
    kind: Vec<u16>,
    forward: Vec<Link>,
    backward: Vec<Link>,
    /// By `log2(src blocks' size) * levels + log2(dst blocks' size)`.
    classes: Vec<PairClasses>,
    levels: usize,
}

/// The block pairs of one (producer total, consumer total) that are alike.
struct PairClasses {
    dst_blocks: usize,
    /// Class of block pair (src block i, dst block j) at `i * dst_blocks + j`.
    class_of: Vec<u32>,
    classes: Vec<PairClass>,
}

enum PairClass {
    /// Every device pair uses link kind `k` (0: every tile pair shares a device).
    Uniform(u16),
    /// Mixed links: evaluated message by message at this representative block pair.
    Mixed { src_first: usize, dst_first: usize },
}

impl DevicePairs {
    fn new(machine: &MachineModel) -> DevicePairs {
        let n = machine.num_devices();
        let mut kind = vec![0u16; n * n];
        let mut forward = vec![Link {
            bytes_per_s: f64::INFINITY,
            latency_s: 0.0,
        }];
        let mut backward = forward.clone();
        let mut ids: HashMap<[u64; 4], u16> = HashMap::new();
        for a in 0..n {
            for b in 0..n {
                let (Some(f), Some(r)) = (machine.link(a, b), machine.link(b, a)) else {
                    continue;
                };
                let key = [
                    f.bytes_per_s.to_bits(),
                    f.latency_s.to_bits(),
                    r.bytes_per_s.to_bits(),
                    r.latency_s.to_bits(),
                ];
                kind[a * n + b] = *ids.entry(key).or_insert_with(|| {
                    forward.push(f);
                    backward.push(r);
                    (forward.len() - 1) as u16
                });
            }
        }
        let sizes: Vec<usize> = (0..)
            .map(|k| 1usize << k)
            .take_while(|&s| s <= n)
            .collect();
        let mut pairs = DevicePairs {
            devices: n,
            kind,
            forward,
            backward,
            classes: Vec::new(),
            levels: sizes.len(),
        };
        for &src in &sizes {
            for &dst in &sizes {
                let c = pairs.group(src, dst);
                pairs.classes.push(c);
            }
        }
        pairs
    }

    fn group(&self, src_total: usize, dst_total: usize) -> PairClasses {
        let n = self.devices;
        let src_blocks = n / src_total;
        let dst_blocks = n / dst_total;
        let mut seen: HashMap<Vec<u16>, u32> = HashMap::new();
        let mut class_of = Vec::with_capacity(src_blocks * dst_blocks);
        let mut classes = Vec::new();
        let mut matrix = Vec::with_capacity(src_total * dst_total);
        for i in 0..src_blocks {
            for j in 0..dst_blocks {
                let (s, d) = (i * src_total, j * dst_total);
                matrix.clear();
                for a in s..s + src_total {
                    matrix.extend_from_slice(&self.kind[a * n + d..a * n + d + dst_total]);
                }
                let next = classes.len() as u32;
                let id = *seen.entry(matrix.clone()).or_insert(next);
                if id == next {
                    let first = matrix[0];
                    classes.push(if matrix.iter().all(|&k| k == first) {
                        PairClass::Uniform(first)
                    } else {
                        PairClass::Mixed {
                            src_first: s,
                            dst_first: d,
                        }
                    });
                }
                class_of.push(id);
            }
        }
        PairClasses {
            dst_blocks,
            class_of,
            classes,
        }
    }

    fn classes(&self, src_total: usize, dst_total: usize) -> &PairClasses {
        let level = |t: usize| t.trailing_zeros() as usize;
        &self.classes[level(src_total) * self.levels + level(dst_total)]
    }

    /// t_x (forward + backward) of `messages` at a block pair of class `class`.
    fn class_time(&self, class: &PairClass, messages: &[Message], largest: f64) -> f64 {
        match *class {
            PairClass::Uniform(0) => 0.0,
            PairClass::Uniform(_) if messages.is_empty() => 0.0,
            PairClass::Uniform(k) => {
                let k = k as usize;
                self.forward[k].message_time(largest) + self.backward[k].message_time(largest)
            }
            PairClass::Mixed {
                src_first,
                dst_first,
            } => {
                let n = self.devices;
                let (mut forward, mut backward) = (0.0f64, 0.0f64);
                for m in messages {
                    let k = self.kind[(src_first + m.src_tile) * n + dst_first + m.dst_tile] as usize;
                    if k != 0 {
                        forward = forward.max(self.forward[k].message_time(m.bytes));
                        backward = backward.max(self.backward[k].message_time(m.bytes));
                    }
                }
                forward + backward
            }
        }
    }
}
