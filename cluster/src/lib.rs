//! legion-cluster: the `legion-rs` command-line tool (and, with the cluster issue, the launcher and
//! QUIC transport). Commands live in [`cli`], one file per subcommand.

pub mod cli;
pub mod job;
pub mod net;
