//! The runtime's mapper and the planner's t_s agree on every parameter slice: which replicas share
//! it, which block each owner keeps and sums. The planner prices the scheme the runtime runs.

use legion_ops::partition::{DeviceId, ParallelConfig};
use legion_ops::{Dim, Rect, zoo};
use legion_planner::sync::SyncPlan;
use legion_runtime::mapper::Mapper;

#[test]
fn owners_match_planner_sync() {
    let model = zoo::find("alexnet").unwrap();
    let cfg = zoo::ZooConfig {
        image_size: 64,
        classes: 10,
        ..model.default_config(8)
    };
    let graph = model.build(&cfg).unwrap();
    let configs: Vec<ParallelConfig> = graph
        .layers()
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let dims = l.op.spec().parallel_dims(&l.shape);
            let dim = dims[i % dims.len()];
            let degree = if dim == Dim::N || l.shape.dim(dim.axis()) >= 2 {
                2
            } else {
                1
            };
            ParallelConfig::split(dim, degree, 2 * (i % 2))
        })
        .collect();
    let mapper = Mapper::new(&graph, &configs);
    for id in graph.ids() {
        let trainable: Vec<bool> = graph
            .layer(id)
            .op
            .spec()
            .params(&graph.input_shapes(id))
            .iter()
            .map(|p| p.trainable)
            .collect();
        let ours: Vec<(usize, Rect, DeviceId, Vec<DeviceId>)> = mapper
            .param_homes(id)
            .into_iter()
            .filter(|h| trainable[h.param] && !h.replicas.is_empty())
            .map(|h| (h.param, h.slice, h.owner, h.replicas))
            .collect();
        let planner: Vec<(usize, Rect, DeviceId, Vec<DeviceId>)> =
            SyncPlan::for_layer(&graph, id, &configs[id.0])
                .groups
                .into_iter()
                .map(|g| (g.param, g.slice, g.owner, g.replicas))
                .collect();
        assert_eq!(ours, planner, "layer {}", graph.layer(id).name);
    }
}
