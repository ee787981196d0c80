//! legion-cluster: training on worker processes. A hosts file ([`hosts`]) names the workers (or,
//! inside a Slurm allocation, [`slurm`] finds them), [`launch`] starts, greets and stops them,
//! each runs its devices' share of every step, and the driver reaches them as a
//! [`RemoteCluster`]. Region slices travel over mutually authenticated
//! QUIC ([`net`]). [`engine`] puts the workers, the embedded cluster and the single-device trainer
//! behind one [`Engine`] trait; [`memory`] refuses a job a host cannot hold; [`measure`] has the
//! workers time a model's op costs for a search.
//!
//! Planning is not done here: a job arrives with its strategy, and the cluster needs of the
//! machine only its hosts' addresses and device counts (`legion::machine` builds the planner's
//! model of it).

mod control;
pub mod engine;
pub mod hosts;
pub mod launch;
pub mod measure;
pub mod memory;
pub mod net;
mod remote;
pub mod slurm;
mod worker;

pub use control::MeasuredCosts;
pub use engine::{Engine, JobStart, Place, StepBatch};
pub use remote::{RemoteCluster, UnreadableSamples, WorkerLost};
pub use worker::{MeasureCosts, WorkerConfig, run as run_worker};

/// What the fuzz targets (`cluster/fuzz`, built by cargo-fuzz with `--cfg fuzzing`) decode: the
/// control protocol is the workers' own, and not otherwise public.
#[cfg(fuzzing)]
pub mod fuzzing {
    pub use crate::control::{decode, encode};
}
