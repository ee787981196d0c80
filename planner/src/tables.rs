//! Eq. 1 as tables for the searches: t_c + t_s per (layer, config) and t_x per (edge, config pair),
//! each computed once. The numbers are the same as [`CostModel`]'s (tested), computed faster:
//!
//! - t_c is priced once per (tile, device spec) and t_s once per layout, then spread over the device
//!   blocks.
//! - t_x tables come from the `transfer_table` module (factorized over axes on regular machines).
//! - Layers and edges with identical op, shapes and parallel dims share their tables.

use crate::config::{ConfigSpace, ParallelConfig, tile_rect};
use crate::cost::CostModel;
use crate::sync::{LinkLoad, layer_link_loads, sync_time_shifted};
use crate::transfer::Edge;
use crate::transfer_table::TransferTables;
use legion_ops::{LayerId, Rect};
use std::collections::HashMap;

/// Per-config and per-config-pair costs of a model on a machine.
pub struct CostTables<'m> {
    model: &'m CostModel<'m>,
    spaces: Vec<ConfigSpace>,
    compute: Vec<Vec<f64>>,
    sync: Vec<Vec<f64>>,
    node: Vec<Vec<f64>>,
    transfers: TransferTables,
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
                // everything the table depends on: the producer's tiling, the consumer's
                // projection and tiling, and whether gradients flow back
                let key = format!(
                    "{:?}|{:?}|{}|{:?}|{}|{}",
                    src.shape,
                    src.op.spec().parallel_dims(&src.shape),
                    serde_json::to_string(&dst.op).unwrap_or_default(),
                    model.input_shapes(e.dst),
                    e.input,
                    e.carries_gradient(graph)
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
            transfers: TransferTables::new(machine),
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
        let e = self.model.edges()[edge];
        self.transfers.edge_table(
            self.model.graph(),
            self.model.input_shapes(e.dst),
            &e,
            &self.spaces[e.src.0],
            &self.spaces[e.dst.0],
        )
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
        let loads: Vec<LinkLoad> = layer_link_loads(graph, id, &base);
        for ci in range {
            let config = space.config(ci);
            let mut worst = 0.0f64;
            for (t, rect) in rects.iter().enumerate() {
                let device = config.device_of_tile(t);
                let slot = &mut priced[t * specs + machine.spec_index(device)];
                let time =
                    *slot.get_or_insert_with(|| provider.compute_time(layer, inputs, rect, device));
                worst = worst.max(time);
            }
            compute[ci] = worst;
            sync[ci] = sync_time_shifted(&loads, machine, config.first_device());
        }
    }
    (compute, sync)
}
