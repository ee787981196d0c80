//! legion-cluster: the `legion-rs` command-line tool, the cluster description ([`hosts`]) and
//! (with the cluster issue) the launcher and QUIC transport. Commands live in [`cli`], one file per
//! subcommand.

pub mod cli;
pub mod compare;
pub mod control;
pub mod engine;
pub mod hosts;
pub mod job;
pub mod launch;
pub mod memory;
pub mod net;
pub mod remote;
pub mod worker;

/// Lets a closed stdout end the process quietly, as it does for C tools (`legion-rs train | head`):
/// Rust ignores SIGPIPE and then panics in `println!` on the broken pipe.
pub fn exit_quietly_on_broken_pipe() {
    // SAFETY: restoring a signal's default disposition at start-up, before any thread exists, has
    // no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
