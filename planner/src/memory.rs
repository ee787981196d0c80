//! What a step keeps in each device's memory ([`per_device`], in `legion_ops::memory`, with the
//! rest of what graph and configs alone determine), against what a machine's devices hold.

pub use legion_ops::memory::{DeviceMemory, job_state_bytes, per_device};

use crate::machine::MachineModel;

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
