//! Data parallelism: every layer split along the sample dim over as many devices as possible.

use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use legion_ops::{Dim, Graph};

/// Every layer `n`-split with degree `min(devices, batch)` (rounded down to a power of two), on the
/// first devices.
pub fn data_parallel(graph: &Graph, machine: &MachineModel) -> Vec<ParallelConfig> {
    graph
        .layers()
        .iter()
        .map(|l| sample_split(&l.shape, machine.num_devices()))
        .collect()
}

/// The largest power-of-two `n` split of a tensor of `shape` on `devices` devices.
pub(crate) fn sample_split(shape: &legion_ops::Shape, devices: usize) -> ParallelConfig {
    ParallelConfig::split(Dim::N, largest_power_of_two(devices.min(shape.dim(0))), 0)
}

/// The largest power of two not above `x` (1 for 0).
pub(crate) fn largest_power_of_two(x: usize) -> usize {
    if x == 0 { 1 } else { 1 << x.ilog2() }
}
