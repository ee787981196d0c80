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
use legion_ops::partition::{DeviceId, ParallelConfig};
use legion_ops::{Graph, Rect};
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
    pub regions: Regions,
    pub configs: Vec<ParallelConfig>,
    pub step: StepGraph,
    pub programs: Vec<DeviceProgram>,
    /// Parameter slot of each parameter region.
    param_slot: HashMap<RegionId, usize>,
}

impl StepPlan {
    pub fn build(
        graph: &Graph,
        configs: &[ParallelConfig],
        num_devices: usize,
    ) -> Result<StepPlan, PlanError> {
        let mapper = Mapper::new(graph, configs);
        if mapper.num_devices() > num_devices {
            return Err(PlanError::NoSuchDevice {
                device: mapper.num_devices() - 1,
                devices: num_devices,
            });
        }
        let regions = Regions::for_graph(graph);

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
        let step = a.finish();
        if !analysis::same_placements(
            &step.initial,
            &step.instances,
            &step.persistent,
            &step.instances,
        ) {
            return Err(PlanError::NotReplayable);
        }
        let programs = split_programs(&step, &regions, num_devices);
        let param_slot = (0..graph.params().len())
            .map(|slot| (regions.param(slot), slot))
            .collect();
        Ok(StepPlan {
            regions,
            configs: configs.to_vec(),
            step,
            programs,
            param_slot,
        })
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
