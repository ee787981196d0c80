//! legion-cli: the `legion-rs` tool. It is where the planner and the engines meet: it plans
//! (`legion-planner`), measures (`legion-profile`) and runs what it planned on an engine of
//! `legion-cluster`, so that the workers need neither the planner nor plotting.
//!
//! - [`Cli`], [`run`]: the command line, one module per subcommand; [`load_model`] resolves
//!   `--model` (`load_model_and_weights`: with an ONNX file's weights).
//! - [`job`]: a training run, shared by `legion-rs train` and the example programs: a loop that
//!   reports events, and the printer that shows them.
//! - [`compare`]: `--compare`, strategies measured and simulated side by side, and their chart.
//! - [`machine`]: the planner's model of the embedded devices or of a hosts file's workers.

mod commands;
pub mod compare;
pub mod device;
pub mod job;
pub mod machine;
pub mod precision;
mod progress;

pub use commands::{Cli, Command, load_model, load_model_and_weights, run};
/// The GPU convolution-algorithm policy of `TrainOptions::conv_algos`.
pub use legion_cuda::ConvAlgos;

/// Lets a closed stdout end the process quietly, as it does for C tools (`legion-rs train | head`):
/// Rust ignores SIGPIPE and then panics in `println!` on the broken pipe.
pub fn exit_quietly_on_broken_pipe() {
    // SAFETY: restoring a signal's default disposition at start-up, before any thread exists, has
    // no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
