//! What a step keeps in each device's memory ([`per_device`], in `legion_ops::memory`, with the
//! rest of what graph and configs alone determine), against what a machine's devices hold.

pub use legion_ops::memory::{
    DeviceMemory, human_bytes, job_state_bytes, largest_tile_bytes, largest_tile_bytes_at,
    per_device, per_device_at, tile_bytes, tile_bytes_at,
};

use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use legion_ops::Graph;

/// A device whose own memory a strategy does not fit: the most overcommitted one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoesNotFit {
    pub device: usize,
    pub needs: u64,
    pub capacity: u64,
    /// The layer that takes most of the device's memory, and how much.
    pub layer: String,
    pub layer_bytes: u64,
}

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device {} needs {} of its {} (layer '{}' alone {})",
            self.device,
            human_bytes(self.needs),
            human_bytes(self.capacity),
            self.layer,
            human_bytes(self.layer_bytes)
        )
    }
}

/// Whether `configs` fit every device of `machine` that has memory of its own, each buffer at its
/// element size in the machine's precision ([`per_device_at`]); if not, the device that needs the
/// most beyond its capacity.
pub fn check_fits(
    graph: &Graph,
    machine: &MachineModel,
    configs: &[ParallelConfig],
) -> Result<(), DoesNotFit> {
    if !machine.has_own_memory() {
        return Ok(());
    }
    let need = per_device_at(graph, configs, machine.nodes(), machine.precision());
    let over = over_capacity(machine, &need);
    // the most overcommitted; of equals, the first
    match over
        .iter()
        .max_by_key(|(d, capacity)| (d.bytes - capacity, std::cmp::Reverse(d.device)))
    {
        None => Ok(()),
        Some(&(d, capacity)) => {
            let (layer, layer_bytes) = d.largest_layer.map_or((String::new(), 0), |(l, b)| {
                (graph.layer(l).name.clone(), b)
            });
            Err(DoesNotFit {
                device: d.device,
                needs: d.bytes,
                capacity,
                layer,
                layer_bytes,
            })
        }
    }
}

/// The devices of `machine` with memory of their own that `memory` (from [`per_device`]) does not
/// fit, each with its capacity in bytes.
pub fn over_capacity<'a>(
    machine: &MachineModel,
    memory: &'a [DeviceMemory],
) -> Vec<(&'a DeviceMemory, u64)> {
    memory
        .iter()
        .filter_map(|d| {
            let capacity = machine.device(d.device).memory_bytes()?;
            (d.bytes > capacity).then_some((d, capacity))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::op::{Conv2d, Dense};
    use legion_ops::partition::ParallelConfig;
    use legion_ops::{Graph, GraphBuilder, Shape};

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
    fn devices_over_their_own_memory_are_listed() {
        let g = small();
        let serial = vec![ParallelConfig::serial(0); g.layers().len()];
        let paper = MachineModel::preset("paper:2").unwrap();
        let mem = per_device(&g, &serial, 2);
        assert!(over_capacity(&paper, &mem).is_empty());
        let huge = vec![DeviceMemory {
            device: 1,
            bytes: 17 << 30,
            largest_layer: None,
        }];
        let over = over_capacity(&paper, &huge);
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].1, 16 << 30);
        // CPU devices share the host's memory: nothing the planner can compare with
        let cpu = MachineModel::preset("local-cpu:2").unwrap();
        assert!(over_capacity(&cpu, &huge).is_empty());
    }
}
