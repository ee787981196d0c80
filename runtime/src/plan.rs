//! The step plan: the analysed, replayable task graph of one training step of a graph under a
//! strategy, cut into device programs. Built once per run.
//!
//! Replay needs the step to leave persistent data (parameters, momentum) exactly where it found
//! it. The plan is analysed twice: first from parameters on their owners only, which yields the
//! steady state (owners plus the replicas the broadcast fills); then from that state, and the
//! second analysis must end in the state it started from.

use crate::analysis::{self, Analysis, AnalysisError, OpKind, StepGraph};
use crate::lower;
use crate::mapper::Mapper;
use crate::program::{DeviceProgram, split_programs};
use crate::region::{RegionId, RegionKind, Regions};
use crate::task::TaskKind;
use legion_ops::op::Op;
use legion_ops::partition::{DeviceId, Nodes, ParallelConfig};
use legion_ops::{Graph, Precision, Rect};
use std::collections::HashMap;
use std::ops::Range;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PlanError {
    #[error(transparent)]
    Analysis(#[from] AnalysisError),
    #[error("the strategy uses device {device}, but the cluster has {devices} device(s)")]
    NoSuchDevice { device: DeviceId, devices: usize },
    #[error("internal: the step does not leave parameters where the next step expects them")]
    NotReplayable,
    #[error("inference needs a loss layer, whose input is the logits; the graph has none")]
    NoLogits,
}

/// Inference on the training step's tiles, planned beside the step
/// ([`StepPlan::build_with_inference`]): each device's program runs it from
/// `DeviceProgram::inference_from` on.
#[derive(Clone, Debug)]
pub struct InferencePlan {
    /// The layer before the loss, whose output is the logits.
    pub layer: legion_ops::LayerId,
    /// Where the logits are once inference ran: each piece of the layer's output on one device.
    pub logits: Vec<Located>,
}

/// Samples of a step's batch: images and labels (empty ranges when none are read).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplesRead {
    pub images: Range<usize>,
    pub labels: Range<usize>,
}

/// The smallest range holding both (an empty range holds nothing).
fn hull(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.clone(),
        (_, true) => a.clone(),
        _ => a.start.min(b.start)..a.end.max(b.end),
    }
}

/// Where a piece of persistent data lives: `rect` of the region in a device's local instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Located {
    pub rect: Rect,
    pub device: DeviceId,
    pub instance: u32,
}

pub struct StepPlan {
    /// Its regions, whose element types say what the step computes in (`Regions::precision`).
    pub regions: Regions,
    pub configs: Vec<ParallelConfig>,
    pub step: StepGraph,
    pub programs: Vec<DeviceProgram>,
    /// Where one was planned.
    pub inference: Option<InferencePlan>,
    /// Parameter slot of each parameter region.
    param_slot: HashMap<RegionId, usize>,
}

impl InferencePlan {
    /// The logits (`[N, classes]` row-major, f32) from the pieces read at [`InferencePlan::logits`]
    /// (each `(rect, values over rect)`, in any element type).
    pub fn assemble(&self, graph: &Graph, pieces: &[(Rect, crate::buffer::Buffer)]) -> Vec<f32> {
        let full = graph.layer(self.layer).shape.full_rect();
        let mut out = vec![0.0; full.volume()];
        for (rect, piece) in pieces {
            legion_ops::shape::copy_rect(&piece.to_f32(), rect, &mut out, &full, rect);
        }
        out
    }
}

impl StepPlan {
    /// The plan of a step computed in fp32 (or tf32, which stores the same) on `devices`: a
    /// device count (one node) or [`Nodes`], whose parameter sync goes through a relay a node.
    pub fn build(
        graph: &Graph,
        configs: &[ParallelConfig],
        devices: impl Into<Nodes>,
    ) -> Result<StepPlan, PlanError> {
        StepPlan::build_in(graph, configs, devices, Precision::Fp32)
    }

    /// The plan of a step computed in `precision`: in bf16 its activations, their gradients and
    /// the partial sums are bf16 regions, so every slice of them moves half the bytes.
    pub fn build_in(
        graph: &Graph,
        configs: &[ParallelConfig],
        devices: impl Into<Nodes>,
        precision: Precision,
    ) -> Result<StepPlan, PlanError> {
        StepPlan::plan(graph, configs, devices.into(), precision, false)
    }

    /// [`StepPlan::build_in`] with inference on the same tiles beside the step: held-out data
    /// scored on the devices that train, from the weights where the step leaves them.
    pub fn build_with_inference(
        graph: &Graph,
        configs: &[ParallelConfig],
        devices: impl Into<Nodes>,
        precision: Precision,
    ) -> Result<StepPlan, PlanError> {
        StepPlan::plan(graph, configs, devices.into(), precision, true)
    }

    fn plan(
        graph: &Graph,
        configs: &[ParallelConfig],
        nodes: Nodes,
        precision: Precision,
        with_inference: bool,
    ) -> Result<StepPlan, PlanError> {
        let num_devices = nodes.devices();
        let mapper = Mapper::on_nodes(graph, configs, nodes);
        if mapper.num_devices() > num_devices {
            return Err(PlanError::NoSuchDevice {
                device: mapper.num_devices() - 1,
                devices: num_devices,
            });
        }
        let regions = Regions::for_graph(graph, precision);

        let mut first = Analysis::new(&regions);
        lower::place_on_owners(&mut first, &regions, &mapper);
        lower::lower_step(&mut first, &regions, &mapper)?;
        let first = first.finish();

        let mut a = Analysis::new(&regions);
        for p in &first.persistent {
            let holders: Vec<(DeviceId, Rect)> = p
                .instances
                .iter()
                .map(|&i| {
                    (
                        first.instances[i as usize].device,
                        first.instances[i as usize].rect,
                    )
                })
                .collect();
            a.place_in(p.region, p.rect, &holders);
        }
        lower::lower_step(&mut a, &regions, &mapper)?;
        // The step must leave the persistent data where it found it; inference, analysed from
        // there, reads it and writes none of it.
        let after_step = a.persistent_now();
        let step_ops = a.num_ops();
        let logits = match with_inference {
            true => {
                let layer = graph.logits().ok_or(PlanError::NoLogits)?;
                a.forget_transient();
                lower::lower_inference(&mut a, &regions, &mapper, layer)?;
                Some((layer, a.valid(regions.activation(layer))))
            }
            false => None,
        };
        let mut step = a.finish();
        step.step_ops = step_ops;
        if !analysis::same_placements(&step.initial, &step.instances, &after_step, &step.instances)
        {
            return Err(PlanError::NotReplayable);
        }
        step.persistent = after_step;
        let programs = split_programs(&step, &regions, num_devices);
        let param_slot = (0..graph.params().len())
            .map(|slot| (regions.param(slot), slot))
            .collect();
        let mut plan = StepPlan {
            regions,
            configs: configs.to_vec(),
            step,
            programs,
            inference: None,
            param_slot,
        };
        plan.inference = logits.map(|(layer, pieces)| InferencePlan {
            layer,
            logits: pieces
                .iter()
                .map(|p| plan.locate(p.instances[0], p.rect))
                .collect(),
        });
        Ok(plan)
    }

    pub fn num_devices(&self) -> usize {
        self.programs.len()
    }

    /// Bytes of every instance each device's actor allocates when the job starts (and keeps for
    /// the job): what a device holds during a step, by device. Received slices in flight and
    /// kernels' scratch come on top. `legion_ops::memory::per_device` computes the same figure
    /// from shapes alone (`integration/tests/device_memory.rs` holds the two equal).
    pub fn device_bytes(&self) -> Vec<u64> {
        self.programs
            .iter()
            .map(|p| {
                p.instances
                    .iter()
                    .map(|i| (i.dtype.size() * i.rect.volume()) as u64)
                    .fold(0, u64::saturating_add)
            })
            .collect()
    }

    /// Persistent data the devices must hold before the first step: (region, rect, where).
    pub fn initial_data(&self) -> Vec<(RegionId, Located)> {
        self.step
            .initial
            .iter()
            .flat_map(|p| {
                p.instances
                    .iter()
                    .map(move |&i| (p.region, self.locate(i, p.rect)))
            })
            .collect()
    }

    /// Where to read each parameter's current values after a step: one holder per piece.
    pub fn param_sources(&self, slot: usize) -> Vec<Located> {
        self.sources(self.regions.param(slot))
    }

    /// Where to read a persistent region's current values after a step: one holder per piece.
    pub fn sources(&self, region: RegionId) -> Vec<Located> {
        self.step
            .persistent
            .iter()
            .filter(|p| p.region == region)
            .map(|p| self.locate(p.instances[0], p.rect))
            .collect()
    }

    /// The parameter slot of a momentum region.
    pub fn momentum_slot_of(&self, region: RegionId) -> Option<usize> {
        (0..self.param_slot.len()).find(|&slot| self.regions.velocity(slot) == Some(region))
    }

    /// The parameter slot of a region, if it is a parameter.
    pub fn slot_of(&self, region: RegionId) -> Option<usize> {
        match self.regions.info(region).kind {
            RegionKind::Param => self.param_slot.get(&region).copied(),
            _ => None,
        }
    }

    /// The samples of the batch whose images and labels the tasks of `devices` read: what a
    /// process holding those devices needs of each step's batch.
    pub fn samples_read(&self, graph: &Graph, devices: Range<DeviceId>) -> SamplesRead {
        let mut read = SamplesRead::default();
        for op in &self.step.ops {
            let OpKind::Task { task, .. } = &op.kind else {
                continue;
            };
            if !devices.contains(&task.device) {
                continue;
            }
            let samples = task.tile.lo[0]..task.tile.hi[0];
            if task.kind == TaskKind::LoadInput {
                read.images = hull(&read.images, &samples);
            }
            if matches!(graph.layer(task.layer).op, Op::SoftmaxCrossEntropy(_)) {
                read.labels = hull(&read.labels, &samples);
            }
        }
        read
    }

    /// Bytes moved between devices per step.
    pub fn remote_bytes(&self) -> u64 {
        self.step.remote_bytes(&self.regions)
    }

    fn locate(&self, instance: u32, rect: Rect) -> Located {
        let device = self.step.instances[instance as usize].device;
        Located {
            rect,
            device,
            instance: self.programs[device]
                .local_instance(instance)
                .expect("every instance belongs to its device's program"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{DType, RegionKind};
    use legion_ops::Dim;
    use legion_ops::zoo;

    /// Bytes that cross between devices per step, split into those of activations, their
    /// gradients and partial sums, and the rest (weights, their gradients, batch-norm sums).
    fn remote_bytes_by_kind(plan: &StepPlan) -> (u64, u64) {
        let (mut activations, mut rest) = (0, 0);
        for (_, src, _, rect) in plan.step.remote_copies() {
            let info = plan.regions.info(src.region);
            let bytes = (rect.volume() * info.dtype.size()) as u64;
            match info.kind {
                RegionKind::Activation
                | RegionKind::Gradient
                | RegionKind::Partial
                | RegionKind::PartialGrad => activations += bytes,
                _ => rest += bytes,
            }
        }
        (activations, rest)
    }

    /// Data parallelism on two nodes of two devices: each parameter block's gradients cross
    /// between the nodes once, summed on the other node's relay, and its new values once, so the
    /// weights' bytes between nodes halve; what each device ends the step holding is the same.
    #[test]
    fn relays_halve_the_weights_bytes_between_two_nodes_of_two() {
        let z = zoo::find("lenet5").unwrap();
        let g = z.build(&z.default_config(8)).unwrap();
        let configs = vec![ParallelConfig::split(Dim::N, 4, 0); g.layers().len()];
        let nodes = Nodes::of_sizes([2, 2]);
        let between = |plan: &StepPlan| -> (u64, usize) {
            let weights = plan.step.remote_copies().filter(|(_, s, d, _)| {
                nodes.node_of(s.device) != nodes.node_of(d.device)
                    && matches!(
                        plan.regions.info(s.region).kind,
                        RegionKind::Param | RegionKind::ParamGrad
                    )
            });
            weights.fold((0, 0), |(bytes, n), (_, _, _, r)| {
                (bytes + 4 * r.volume() as u64, n + 1)
            })
        };
        let flat = StepPlan::build(&g, &configs, 4).unwrap();
        let relayed = StepPlan::build(&g, &configs, nodes.clone()).unwrap();
        let ((flat_bytes, flat_msgs), (relayed_bytes, relayed_msgs)) =
            (between(&flat), between(&relayed));
        assert!(flat_bytes > 0);
        assert_eq!(relayed_bytes * 2, flat_bytes);
        assert_eq!(relayed_msgs * 2, flat_msgs);
        let holders = |plan: &StepPlan| -> Vec<(RegionId, Rect, Vec<DeviceId>)> {
            let mut held: Vec<_> = plan
                .step
                .persistent
                .iter()
                .map(|p| {
                    let mut devices: Vec<DeviceId> = p
                        .instances
                        .iter()
                        .map(|&i| plan.step.instances[i as usize].device)
                        .collect();
                    devices.sort_unstable();
                    (p.region, p.rect, devices)
                })
                .collect();
            held.sort_by_key(|(r, rect, _)| (r.index(), rect.lo, rect.hi));
            held
        };
        assert_eq!(holders(&flat), holders(&relayed));
    }

    /// bf16 plans the same copies as fp32, and the activations' half of them moves exactly half
    /// the bytes; the masters' (weights, their gradients) stay f32. The per-sample losses are the
    /// one activation that stays f32.
    #[test]
    fn bf16_halves_the_bytes_of_activations_and_keeps_the_weights() {
        let z = zoo::find("lenet5").unwrap();
        let g = z.build(&z.default_config(8)).unwrap();
        for dim in [Dim::N, Dim::C, Dim::H] {
            let configs: Vec<ParallelConfig> = g
                .layers()
                .iter()
                .map(|l| {
                    match l.op.spec().parallel_dims(&l.shape).contains(&dim)
                        && l.shape.dim(dim.axis()) >= 4
                    {
                        true => ParallelConfig::split(dim, 4, 0),
                        false => ParallelConfig::serial(0),
                    }
                })
                .collect();
            let fp32 = StepPlan::build(&g, &configs, 4).unwrap();
            let bf16 = StepPlan::build_in(&g, &configs, 4, Precision::Bf16).unwrap();
            assert_eq!(
                fp32.step.remote_copies().count(),
                bf16.step.remote_copies().count()
            );
            let ((a32, w32), (a16, w16)) =
                (remote_bytes_by_kind(&fp32), remote_bytes_by_kind(&bf16));
            let losses = bf16
                .step
                .remote_copies()
                .filter(|(_, s, _, _)| bf16.regions.info(s.region).dtype == DType::F32)
                .filter(|(_, s, _, _)| {
                    matches!(
                        bf16.regions.info(s.region).kind,
                        RegionKind::Activation | RegionKind::Gradient
                    )
                })
                .map(|(_, _, _, r)| r.volume() as u64 * 4)
                .sum::<u64>();
            // (data parallelism moves only weight gradients and batch-norm sums)
            assert!(
                dim == Dim::N || a32 > 0,
                "{dim:?}: the strategy moves activations"
            );
            assert_eq!(a16, (a32 - losses) / 2 + losses, "{dim:?}");
            assert_eq!(w16, w32, "{dim:?}");
            assert_eq!(bf16.remote_bytes(), a16 + w16);
            // Every region keeps its fp32 type but activations, gradients and partial sums.
            for id in bf16.regions.ids() {
                let (info, f) = (bf16.regions.info(id), fp32.regions.info(id));
                match (info.kind, f.dtype) {
                    (RegionKind::BnMoments | RegionKind::BnGradSums, d) => {
                        assert_eq!(d, DType::F64)
                    }
                    (RegionKind::Param | RegionKind::ParamGrad | RegionKind::Velocity, _) => {
                        assert_eq!(info.dtype, DType::F32)
                    }
                    _ => assert!(info.dtype == DType::Bf16 || info.name.starts_with("loss")),
                }
            }
        }
    }
}
