//! Model parallelism: every layer's parameters divided over all devices.

use super::data::{largest_power_of_two, sample_split};
use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use legion_ops::{Dim, Graph, Layer};

/// Layers with trainable parameters, and parameter-free layers that may split channels, are
/// `c`-split over as many devices as their channels allow (a power of two); the others (flatten,
/// the loss) are sample-split.
pub fn model_parallel(graph: &Graph, machine: &MachineModel) -> Vec<ParallelConfig> {
    graph
        .layers()
        .iter()
        .map(|l| {
            channel_split(l, machine.num_devices())
                .unwrap_or_else(|| sample_split(&l.shape, machine.num_devices()))
        })
        .collect()
}

/// The largest power-of-two `c` split of a layer, if its op allows splitting channels.
pub(crate) fn channel_split(layer: &Layer, devices: usize) -> Option<ParallelConfig> {
    let dims = layer.op.spec().parallel_dims(&layer.shape);
    if !dims.contains(&Dim::C) || layer.shape.ndim() < 2 {
        return None;
    }
    let degree = largest_power_of_two(devices.min(layer.shape.dim(Dim::C.axis())));
    Some(ParallelConfig::split(Dim::C, degree, 0))
}
