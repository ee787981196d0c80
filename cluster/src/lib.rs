//! legion-cluster: the `legion-rs` command-line tool.

pub mod cli;
