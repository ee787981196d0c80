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
    /// Where its devices run: `cuda` spreads them over this host's GPUs (an error without one),
    /// `cpu` on its cores.
    #[arg(long, default_value = "cpu")]
    device: WorkerDevice,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerDevice {
    Cpu,
    Cuda,
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
        placement: placement(a.device, a.devices as usize)?,
    })
}

/// The worker's devices' placement: for `cuda`, every GPU it can use (as many as it has
/// devices at most), started before the worker takes requests, so that a host without a usable
/// GPU fails at `up`, naming what is missing.
fn placement(device: WorkerDevice, devices: usize) -> anyhow::Result<legion_runtime::Placement> {
    use crate::device::{DeviceKind, choose, start_gpus};
    if device == WorkerDevice::Cpu {
        return Ok(legion_runtime::Placement::Cpu);
    }
    let mut choice = choose(DeviceKind::Cuda, devices, false, legion_cuda::probe)?;
    let started = start_gpus(
        &mut choice,
        DeviceKind::Cuda,
        devices,
        legion_cuda::Math::StrictFp32,
    )?
    .expect("--device cuda starts GPUs or fails");
    eprintln!("{}", choice.line);
    Ok(started.into_placement())
}
