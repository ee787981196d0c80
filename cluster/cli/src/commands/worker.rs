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
    #[arg(long, required_unless_present = "slurm")]
    name: Option<String>,
    /// Address and port to listen on (UDP, QUIC).
    #[arg(long, required_unless_present = "slurm")]
    listen: Option<String>,
    /// A task of the step `up --slurm` started: name, address, port and devices are this node's
    /// (`SLURMD_NODENAME`) in the hosts file `up` wrote in the state directory.
    #[arg(long, conflicts_with_all = ["name", "listen", "devices", "device"])]
    slurm: bool,
    /// Devices this worker runs: a count, or `gpus` (with `--device cuda`): one per GPU it finds.
    #[arg(long, default_value = "1", value_parser = parse_devices)]
    devices: WorkerDevices,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevices {
    Count(usize),
    /// One device per GPU found.
    Gpus,
}

fn parse_devices(s: &str) -> Result<WorkerDevices, String> {
    match s {
        "gpus" => Ok(WorkerDevices::Gpus),
        n => match n.parse::<usize>() {
            Ok(n) if (1..=legion_cluster::hosts::MAX_DEVICES).contains(&n) => {
                Ok(WorkerDevices::Count(n))
            }
            _ => Err(format!(
                "expected a count in 1..={} or `gpus`, got '{s}'",
                legion_cluster::hosts::MAX_DEVICES
            )),
        },
    }
}

pub fn run(a: WorkerArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let (name, listen, device, devices) = match a.slurm {
        true => {
            let host =
                legion_cluster::slurm::this_node(&a.state, std::env::var("SLURMD_NODENAME").ok())?;
            let devices = match host.devices_from_gpus {
                true => WorkerDevices::Gpus,
                false => WorkerDevices::Count(host.devices),
            };
            let device = match host.device_kind == legion_cluster::hosts::GPU_KIND {
                true => WorkerDevice::Cuda,
                false => WorkerDevice::Cpu,
            };
            (host.name.clone(), host.endpoint(), device, devices)
        }
        false => (
            a.name.expect("clap requires --name without --slurm"),
            a.listen.expect("clap requires --listen without --slurm"),
            a.device,
            a.devices,
        ),
    };
    let listen: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&listen)
        .with_context(|| format!("--listen {listen}: expected ADDRESS:PORT"))?
        .next()
        .with_context(|| format!("--listen {listen}: resolves to no address"))?;
    let (devices, placement) = placement(device, devices)?;
    run_worker(WorkerConfig {
        name,
        listen,
        state: a.state,
        devices,
        placement,
        measure_costs: std::sync::Arc::new(legion::costs::measure_on_this_host),
    })
}

/// The worker's devices' placement: for `cuda`, every GPU it can use (as many as it has
/// devices at most), started before the worker takes requests, so that a host without a usable
/// GPU fails at `up`, naming what is missing.
fn placement(
    device: WorkerDevice,
    devices: WorkerDevices,
) -> anyhow::Result<(usize, legion_runtime::Placement)> {
    use legion::device::{DeviceKind, choose, start_gpus};
    let devices = match (device, devices) {
        (WorkerDevice::Cpu, WorkerDevices::Count(n)) => {
            return Ok((n, legion_runtime::Placement::Cpu));
        }
        (WorkerDevice::Cpu, WorkerDevices::Gpus) => {
            anyhow::bail!("--devices gpus: one device per GPU needs --device cuda")
        }
        (WorkerDevice::Cuda, WorkerDevices::Count(n)) => n,
        (WorkerDevice::Cuda, WorkerDevices::Gpus) => legion_cuda::probe()
            .map_err(|missing| anyhow::anyhow!("--device cuda: {missing}"))?
            .len(),
    };
    let mut choice = choose(DeviceKind::Cuda, devices, false, legion_cuda::probe)?;
    // A worker's devices exchange slices through the GPUs' streams: cudarc orders the uses.
    let started = start_gpus(
        &mut choice,
        DeviceKind::Cuda,
        devices,
        legion_cuda::Settings::default(),
    )?
    .expect("--device cuda starts GPUs or fails");
    eprintln!("{}", choice.line);
    Ok((devices, started.into_placement()))
}
