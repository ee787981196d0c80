//! legion-cluster: the `legion-rs` command-line tool, the cluster description ([`hosts`]) and
//! (with the cluster issue) the launcher and QUIC transport. Commands live in [`cli`], one file per
//! subcommand.

pub mod cli;
pub mod hosts;
pub mod job;
