//! What a seed planner (another paper's planner, searching its own space under its own byte
//! count) gives the searches, so that [`SearchKind::seed`](super::SearchKind::seed) is the one
//! place that knows which planner a seed kind runs.

use crate::config::ParallelConfig;
use crate::machine::MachineModel;
use crate::tables::SearchSpace;
use legion_ops::Graph;

/// A seed planner's plan mapped into one of our search spaces.
#[derive(Clone, Debug, PartialEq)]
pub struct SeedPlan {
    /// By layer id, in the space asked for.
    pub configs: Vec<ParallelConfig>,
    /// Bytes (f32) of the plan under the planner's own accounting, before the mapping.
    pub native_bytes: f64,
}

/// Another paper's planner, run beside ours and priced by our cost model. `Sync` so that the
/// `&'static dyn SeedPlanner` a kind maps to can be shared across threads.
pub trait SeedPlanner: Sync {
    /// Its name on command lines and in reports (`SearchKind::name` reads it).
    fn name(&self) -> &'static str;

    /// What mapping its plans into our configuration space loses, for the CLI to print beside
    /// its results.
    fn lossy(&self) -> &'static str;

    /// Its plan for `graph` on `machine`, mapped into `space`.
    fn plan(&self, graph: &Graph, machine: &MachineModel, space: SearchSpace) -> SeedPlan;

    /// Bytes `configs` move under its own accounting (its paper's objective), to show beside
    /// Eq. 1: any strategy of ours, read in its terms.
    fn native_bytes(
        &self,
        graph: &Graph,
        machine: &MachineModel,
        configs: &[ParallelConfig],
    ) -> f64;
}
