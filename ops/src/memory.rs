//! What a training step keeps in each device's memory under a strategy, computed from shapes alone
//! so that a run can be refused (and a plan warned about) before anything is allocated.
//!
//! Per layer and device, the tile the device computes holds its output and that output's gradient,
//! and the slice of every parameter the tile reads with, for a trainable one, its gradient and SGD
//! momentum (all f32). The runtime allocates at least this: it also keeps the input slices it
//! receives from other devices and transient kernel buffers, which depend on placement and are left
//! out, so the figure is a lower bound that never refuses a run that would fit.
//!
//! A pure function of the graph and the configs: the planner compares it with a machine's device
//! memory, a training job and each cluster worker with their host's.

use crate::op::partial_param_rect;
use crate::partition::{DeviceId, ParallelConfig, tile_rect};
use crate::{Graph, LayerId};

/// `b` bytes in the largest binary unit that keeps it at least 1 (`1.50 GiB`).
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 40 => format!("{:.2} TiB", b as f64 / (1u64 << 40) as f64),
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Bytes of one f32 element, the type of every activation and parameter.
const F32_BYTES: u64 = 4;

/// What one device holds during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: DeviceId,
    pub bytes: u64,
    /// The layer that takes most of it, and how much.
    pub largest_layer: Option<(LayerId, u64)>,
}

/// The memory of every device `0..num_devices` when `graph` runs with `configs` (one per layer).
/// Element counts are bounded by the graph builder, so the byte counts cannot overflow; the sums
/// saturate all the same.
pub fn per_device(
    graph: &Graph,
    configs: &[ParallelConfig],
    num_devices: usize,
) -> Vec<DeviceMemory> {
    let mut devices: Vec<DeviceMemory> = (0..num_devices)
        .map(|device| DeviceMemory {
            device,
            bytes: 0,
            largest_layer: None,
        })
        .collect();
    let mut layer_bytes = vec![0u64; num_devices];
    for (id, config) in graph.ids().zip(configs) {
        for tile in 0..config.total() {
            let device = config.device_of_tile(tile);
            if device >= num_devices {
                continue;
            }
            let bytes = tile_bytes(graph, id, config, tile);
            layer_bytes[device] = layer_bytes[device].saturating_add(bytes);
        }
        for (device, bytes) in devices.iter_mut().zip(&mut layer_bytes) {
            let taken = std::mem::take(bytes);
            device.bytes = device.bytes.saturating_add(taken);
            if taken > 0 && device.largest_layer.is_none_or(|(_, most)| taken > most) {
                device.largest_layer = Some((id, taken));
            }
        }
    }
    devices
}

/// What tile `tile` of `layer` under `config` keeps on its device: its output and that output's
/// gradient, and the slice of every parameter it reads with, for a trainable one, its gradient
/// and momentum.
pub fn tile_bytes(graph: &Graph, layer: LayerId, config: &ParallelConfig, tile: usize) -> u64 {
    let l = graph.layer(layer);
    let out = tile_rect(&l.shape, config, tile);
    // A reduction split's partial holds its block's partial sum and that sum's gradient (the
    // first partial also the block's output and output gradient), and its channels' weights.
    let (r, red) = (config.reduction_of(tile), config.reduction());
    let blocks = if red > 1 && r == 0 { 4 } else { 2 };
    let mut bytes = blocks * out.volume() as u64 * F32_BYTES;
    for (i, p) in graph.layer_params(layer).iter().enumerate() {
        let copies = if p.trainable { 3 } else { 1 };
        let Some(slice) = partial_param_rect(l.op.spec(), i, p, &out, r, red) else {
            continue;
        };
        bytes = bytes.saturating_add(copies * slice.volume() as u64 * F32_BYTES);
    }
    bytes
}

/// The most any one device keeps for `layer` under `config`: its largest tile's
/// [`tile_bytes`] (a config puts each tile on a device of its own).
pub fn largest_tile_bytes(graph: &Graph, layer: LayerId, config: &ParallelConfig) -> u64 {
    (0..config.total())
        .map(|tile| tile_bytes(graph, layer, config, tile))
        .max()
        .unwrap_or(0)
}

/// The bytes of every trainable parameter and its momentum, as a training job's own state (the
/// weights it starts from and saves) holds them beside the devices.
pub fn job_state_bytes(graph: &Graph) -> u64 {
    graph
        .params()
        .iter()
        .map(|p| {
            let copies = if p.spec.trainable { 2 } else { 1 };
            copies * p.spec.shape.numel() as u64 * F32_BYTES
        })
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dim;
    use crate::op::{Conv2d, Dense};
    use crate::{GraphBuilder, Shape};

    fn small() -> Graph {
        let mut m = GraphBuilder::new("small");
        let x = m.input("data", Shape::nchw(4, 3, 8, 8)).unwrap();
        let x = m.conv2d("conv", x, Conv2d::new(16, 3).padding(1)).unwrap();
        let x = m.flatten("flat", x).unwrap();
        let x = m.dense("fc", x, Dense::new(10)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    #[test]
    fn one_device_holds_every_tensor_once_and_three_copies_of_each_weight() {
        let g = small();
        let serial = vec![ParallelConfig::serial(0); g.layers().len()];
        let mem = per_device(&g, &serial, 1);
        let activations: u64 = g.layers().iter().map(|l| l.shape.numel() as u64).sum();
        let weights: u64 = g.param_count();
        assert_eq!(mem[0].bytes, 4 * (2 * activations + 3 * weights));
        // fc's weight, 10 × 1024, is the largest
        let fc = g.find("fc").unwrap();
        assert_eq!(mem[0].largest_layer.map(|(l, _)| l), Some(fc));
        assert_eq!(job_state_bytes(&g), 4 * 2 * weights);
    }

    #[test]
    fn data_parallel_splits_activations_and_replicates_weights() {
        let g = small();
        let serial = per_device(&g, &[ParallelConfig::serial(0); 5], 1)[0].bytes;
        let data = vec![ParallelConfig::split(Dim::N, 2, 0); g.layers().len()];
        let mem = per_device(&g, &data, 2);
        let weights = 4 * 3 * g.param_count();
        assert_eq!(mem[0].bytes, mem[1].bytes);
        assert_eq!(mem[0].bytes, (serial - weights) / 2 + weights);
    }

    #[test]
    fn channel_split_divides_the_weights() {
        let g = small();
        let fc = g.find("fc").unwrap();
        let mut configs = vec![ParallelConfig::serial(0); g.layers().len()];
        configs[fc.0] = ParallelConfig::split(Dim::C, 2, 0);
        let mem = per_device(&g, &configs, 2);
        let fc_weight = 4 * 3 * (10 * 1024 + 10);
        let fc_out = 4 * 2 * (4 * 10);
        assert_eq!(mem[1].bytes, (fc_weight + fc_out) / 2);
        assert_eq!(mem[1].largest_layer, Some((fc, (fc_weight + fc_out) / 2)));
    }
}
