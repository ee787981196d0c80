//! Krizhevsky's "one weird trick": data parallelism for convolutional, pooling and the other
//! non-dense layers, model (channel) parallelism for the dense layers.

use super::data::sample_split;
use super::model::channel_split;
use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use legion_ops::{Graph, Op};

pub fn one_weird_trick(graph: &Graph, machine: &MachineModel) -> Vec<ParallelConfig> {
    let devices = machine.num_devices();
    graph
        .layers()
        .iter()
        .map(|l| match l.op {
            Op::Dense(_) => {
                channel_split(l, devices).unwrap_or_else(|| sample_split(&l.shape, devices))
            }
            _ => sample_split(&l.shape, devices),
        })
        .collect()
}
