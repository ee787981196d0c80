//! legion-cli: the `legion-rs` tool. It is where the planner and the engines meet: it plans
//! (`legion-planner`), measures (`legion-profile`) and runs what it planned on an engine of
//! `legion-cluster`, so that the workers need neither the planner nor plotting.
//!
//! Training itself is the `legion` crate's; this one adds the command line and what a terminal
//! shows.
//!
//! - [`Cli`], [`run`]: the command line, one module per subcommand.
//! - [`flags`]: the flags of a training run, shared by `legion-rs train` and the examples.
//! - [`progress`]: a run's events as text, a progress bar or JSON lines ([`train`]).
//! - [`compare`]: `--compare`, strategies measured and simulated side by side, and their chart.

mod commands;
pub mod compare;
pub mod flags;
pub mod precision;
pub mod progress;

pub use commands::{Cli, Command, run};
pub use progress::{Printer, train};

/// Lets a closed stdout end the process quietly, as it does for C tools (`legion-rs train | head`):
/// Rust ignores SIGPIPE and then panics in `println!` on the broken pipe.
pub fn exit_quietly_on_broken_pipe() {
    // SAFETY: restoring a signal's default disposition at start-up, before any thread exists, has
    // no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
