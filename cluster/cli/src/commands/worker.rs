use clap::Args;
use legion_cluster::{WorkerConfig, run_worker};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The cluster's state directory (its certificates are read from `nodes/NAME/`).
    #[arg(long)]
    state: PathBuf,
    /// This host's name in the hosts file.
    #[arg(long)]
    name: String,
    /// Address and port to listen on (UDP, QUIC).
    #[arg(long)]
    listen: String,
    /// Devices this worker runs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    devices: u64,
}

pub fn run(a: WorkerArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let listen: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&a.listen)
        .with_context(|| format!("--listen {}: expected ADDRESS:PORT", a.listen))?
        .next()
        .with_context(|| format!("--listen {}: resolves to no address", a.listen))?;
    run_worker(WorkerConfig {
        name: a.name,
        listen,
        state: a.state,
        devices: a.devices as usize,
    })
}
