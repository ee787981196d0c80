//! Tasks and their region requirements.
//!
//! A task names a kernel (`TaskKind` of a layer over one tile) and the regions it touches: for each,
//! the rect, the privilege and the role the kernel gives it. The analysis sees only regions, rects
//! and privileges; only the executor looks at kinds and roles.

use crate::region::RegionId;
use legion_ops::partition::DeviceId;
use legion_ops::{Graph, LayerId, Rect};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Privilege {
    /// Reads the rect; needs its current value on the task's device.
    ReadOnly,
    /// Overwrites the whole rect without reading it.
    WriteDiscard,
    /// Reads then overwrites the rect.
    ReadWrite,
    /// Contributes a term to a sum over the rect. Reductions into one region do not order each
    /// other; the sum is formed (in ascending device order) when someone reads it.
    Reduce,
}

impl Privilege {
    pub fn reads(self) -> bool {
        matches!(self, Privilege::ReadOnly | Privilege::ReadWrite)
    }

    pub fn writes(self) -> bool {
        !matches!(self, Privilege::ReadOnly)
    }
}

/// What a requirement is to the kernel: the operand slots of `legion_ops::backend`.
pub use legion_ops::backend::Role;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Requirement {
    pub region: RegionId,
    pub rect: Rect,
    pub privilege: Privilege,
    pub role: Role,
}

/// The kernels a training step is made of. Batch norm is split in phases so that its statistics
/// are reduced over the whole batch between them (see `legion_ops::kernels::batch_norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskKind {
    /// Copies the tile of the step's images into the input layer's output.
    LoadInput,
    Forward,
    Backward,
    /// Inference's forward of a tile (`legion_ops::backend::Phase::Infer`).
    Infer,
    /// Batch norm forward phase 1: per-channel sums of the tile.
    BnMoments,
    /// Batch norm forward phase 2: normalise with the whole-batch statistics.
    BnNormalize,
    /// Batch norm: update the running statistics, once per channel group.
    BnRunning,
    /// Batch norm backward phase 1: per-channel gradient sums (and dγ, dβ contributions).
    BnGradSums,
    /// Batch norm backward phase 2: the input gradient.
    BnInputGrad,
    /// A reduction split's partial sum of a block (see `legion_ops::backend::Phase`).
    PartialForward,
    /// The activation of a block's summed partials.
    Finish,
    /// The gradient before that activation.
    FinishBackward,
    /// A partial's gradients.
    PartialBackward,
    /// SGD step of one slice of parameter `param` (index among the layer's parameters).
    Update {
        param: u8,
    },
    /// Does nothing: no requirements, and the kernel returns at once. Never lowered from a graph;
    /// it exists to measure the runtime's own cost per task (dependence tracking, dispatch to the
    /// compute pool and the completion message), like Legion's empty-task benchmarks. See
    /// [`crate::program::empty_program`].
    Empty,
}

impl TaskKind {
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::LoadInput => "load",
            TaskKind::Forward => "fwd",
            TaskKind::Infer => "infer",
            TaskKind::Backward => "bwd",
            TaskKind::BnMoments => "moments",
            TaskKind::BnNormalize => "normalize",
            TaskKind::BnRunning => "running",
            TaskKind::BnGradSums => "grad_sums",
            TaskKind::BnInputGrad => "input_grad",
            TaskKind::PartialForward => "partial",
            TaskKind::Finish => "finish",
            TaskKind::FinishBackward => "finish_bwd",
            TaskKind::PartialBackward => "partial_bwd",
            TaskKind::Update { .. } => "update",
            TaskKind::Empty => "empty",
        }
    }
}

/// One point task: a kernel over one tile on one device.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSpec {
    pub kind: TaskKind,
    pub layer: LayerId,
    /// The output tile (for an update, the parameter slice).
    pub tile: Rect,
    pub device: DeviceId,
    pub requirements: Vec<Requirement>,
}

impl TaskSpec {
    pub fn new(kind: TaskKind, layer: LayerId, tile: Rect, device: DeviceId) -> TaskSpec {
        TaskSpec {
            kind,
            layer,
            tile,
            device,
            requirements: Vec::new(),
        }
    }

    /// Adds a requirement; empty rects (an input a tile does not touch) are left out.
    pub fn require(&mut self, region: RegionId, rect: Rect, privilege: Privilege, role: Role) {
        if !rect.is_empty() {
            self.requirements.push(Requirement {
                region,
                rect,
                privilege,
                role,
            });
        }
    }

    pub fn find(&self, role: Role) -> Option<usize> {
        self.requirements.iter().position(|r| r.role == role)
    }

    /// `conv1.fwd`, `fc6.update`: the name a trace shows.
    pub fn label(&self, graph: &Graph) -> String {
        format!("{}.{}", graph.layer(self.layer).name, self.kind.name())
    }
}

impl fmt::Display for TaskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of layer {} tile {} on device {}",
            self.kind.name(),
            self.layer.0,
            self.tile,
            self.device
        )
    }
}
