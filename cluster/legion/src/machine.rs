//! The planner's view of where a job runs: the embedded cluster's devices, or a hosts file's
//! workers with the links `legion-rs up` measured between them. The engine itself needs only the
//! hosts' addresses and device counts; pricing and searching need a `MachineModel`, which is the
//! tool's to build.

use legion_cluster::hosts::{
    DEFAULT_INTER_HOST_GBPS, DEFAULT_INTER_HOST_LATENCY_US, DEVICE_KINDS, GPU_KIND, HostLink, Hosts,
};
use legion_cluster::launch::{MeasuredNic, load_links, load_nics};
use legion_cuda::CudaDevice;
use legion_ops::Precision;
use legion_planner::machine::{DeviceSpec, Link, MachineError, MachineModel, NetworkCpu, NodeSpec};
use std::path::Path;

/// A host whose interface carried less than this many times its fastest peer's bandwidth with
/// every peer at once is one shared NIC (see [`cluster_machine`]).
pub const NIC_SHARED_BELOW: f64 = 1.5;

/// The machine the embedded cluster's devices make, as the planner sees it.
pub fn embedded_machine(devices: usize) -> anyhow::Result<MachineModel> {
    Ok(MachineModel::preset(&format!("local-cpu:{devices}"))?)
}

/// The machine the embedded cluster's `devices` devices make on `gpus` (as the runtime places
/// them, `Placement::gpu_of`), as the planner sees it (`MachineModel::on_gpus`): devices of the
/// first GPU's kind, from its name (`DeviceSpec::for_gpu`: an H200 is `h200`, and a profile
/// measured on it, `profile --device cuda`, is stored and looked up under that kind), computing
/// in `precision` (`MachineModel::with_precision`: `h100-tf32`, `h100-bf16`), each with its share
/// of its GPU's memory.
pub fn gpus_machine(
    devices: usize,
    gpus: &[CudaDevice],
    precision: Precision,
) -> anyhow::Result<MachineModel> {
    // A GPU listed twice (`--gpus 0,0`) lends each logical GPU its share of its memory.
    let memory: Vec<f64> = gpus
        .iter()
        .map(|g| {
            let sharing = gpus.iter().filter(|o| o.ordinal == g.ordinal).count();
            g.total_memory_bytes as f64 / (1u64 << 30) as f64 / sharing as f64
        })
        .collect();
    let first = gpus.first().map_or("", |g| g.name.as_str());
    let device = DeviceSpec::for_gpu(first, memory.first().copied().unwrap_or_default());
    let g = memory.len().min(devices.max(1));
    let name = format!("gpus:{devices}on{g}");
    // Logical GPUs on one device share its kernels' time: one kernel at a time per physical GPU.
    let physical = crate::device::physical_gpus(&gpus[..g]);
    Ok(MachineModel::on_gpus(&name, devices, &memory, device)?
        .with_compute_slots(physical)?
        .with_precision(precision))
}

/// The planner's view of the cluster: one node per host; devices of one host exchange data by
/// in-process copies (the `local-cpu` preset's link), hosts over a `DEFAULT_INTER_HOST_GBPS`
/// network unless a `[[link]]` overrides the pair (then every device pair across the two hosts
/// gets that link). Each host reaches the others through one network interface, which all of its
/// devices' messages to other hosts share in each direction (one NIC per node).
pub fn hosts_machine(hosts: &Hosts) -> Result<MachineModel, MachineError> {
    hosts_machine_staged(hosts, None)
}

/// Whether `hosts` are worker processes sharing this machine's GPU: every host started here as
/// a child process ([`Host::is_local`](legion_cluster::hosts::Host::is_local)) with
/// `device = "cuda"`. Each such worker puts its devices on the first GPUs it finds, so with one
/// device each they all share GPU 0; the model assumes one GPU for them whatever their counts
/// (the GPU machines at hand have one).
pub fn shares_one_gpu(hosts: &Hosts) -> bool {
    !hosts.hosts.is_empty()
        && hosts
            .hosts
            .iter()
            .all(|h| h.is_local() && h.device_kind == GPU_KIND)
}

/// The GPU memory, GiB, the model gives worker processes sharing one GPU: an H100's, as
/// `device = "cuda"` prices it.
const SHARED_GPU_GIB: f64 = 80.0;

/// A slice between worker processes on GPUs: copied to page-locked host memory, sent, copied
/// into the receiver's device memory, one after the other: the network's time plus `staged`'s.
pub fn through_staging(network: Link, staged: Link) -> Link {
    Link {
        bytes_per_s: 1.0 / (network.seconds_per_byte() + staged.seconds_per_byte()),
        latency_s: network.latency_s + staged.latency_s,
    }
}

/// The staging copies' link when no profile measured them (`staged` of `profile --device
/// cuda`): what `one-gpu:N` assumes between GPUs, page-locked copies over PCIe at 25 GB/s each
/// way, one after the other, 30 µs (`MachineModel::on_gpus`).
pub fn assumed_staging() -> Result<Link, MachineError> {
    Ok(
        MachineModel::on_gpus("staged", 2, &[SHARED_GPU_GIB; 2], DeviceSpec::h100())?
            .inter_node_link(),
    )
}

/// [`hosts_machine`], with `staged` (or [`assumed_staging`]) for the staging copies of hosts
/// that share this machine's GPU ([`shares_one_gpu`]): their devices are GPU devices on one GPU,
/// each with its share of its memory, one kernel at a time among them all; devices of one host
/// exchange slices in the GPU's memory (`one-gpu:N`'s link), devices of two hosts through
/// staging and the network between the processes.
pub fn hosts_machine_staged(
    hosts: &Hosts,
    staged: Option<Link>,
) -> Result<MachineModel, MachineError> {
    let shared_gpu = shares_one_gpu(hosts);
    let staging = match (shared_gpu, staged) {
        (false, _) => None,
        (true, Some(link)) => Some(link),
        (true, None) => Some(assumed_staging()?),
    };
    let network = Link::from_gbit_per_s(DEFAULT_INTER_HOST_GBPS, DEFAULT_INTER_HOST_LATENCY_US);
    let (in_process, network) = match staging {
        None => (
            MachineModel::preset("local-cpu")?.intra_node_link(),
            network,
        ),
        Some(staged) => (
            MachineModel::on_gpus("same-gpu", 2, &[SHARED_GPU_GIB], DeviceSpec::h100())?
                .intra_node_link(),
            through_staging(network, staged),
        ),
    };
    let share = SHARED_GPU_GIB / hosts.num_devices().max(1) as f64;
    let nodes = hosts
        .hosts
        .iter()
        .map(|h| {
            let device = device_spec(&h.device_kind).ok_or_else(|| {
                MachineError::Invalid(format!(
                    "host {}: unknown device kind '{}' (known: {})",
                    h.name,
                    h.device_kind,
                    DEVICE_KINDS.join(", ")
                ))
            })?;
            Ok(NodeSpec {
                devices: h.devices,
                device: match shared_gpu {
                    true => DeviceSpec {
                        memory_gib: Some(share),
                        ..device
                    },
                    false => device,
                },
            })
        })
        .collect::<Result<Vec<_>, MachineError>>()?;
    let name = match shared_gpu {
        true => format!("hosts:{}on1gpu", hosts.hosts.len()),
        false => format!("hosts:{}", hosts.hosts.len()),
    };
    let mut machine = MachineModel::new(&name, &nodes, in_process, network)?.with_nics(1)?;
    if shared_gpu {
        machine = machine.with_compute_slots(1)?;
    }
    let ranges = hosts.device_ranges();
    for l in &hosts.links {
        let (Some(from), Some(to)) = (ranges.get(l.from), ranges.get(l.to)) else {
            return Err(MachineError::Invalid(format!(
                "link {}-{}: there are hosts 0..{}",
                l.from,
                l.to,
                ranges.len()
            )));
        };
        let link = match staging {
            Some(staged) => through_staging(host_link(l), staged),
            None => host_link(l),
        };
        for a in from.clone() {
            for b in to.clone() {
                machine = machine.with_link(a, b, link)?;
            }
        }
    }
    Ok(machine)
}

fn device_spec(kind: &str) -> Option<DeviceSpec> {
    match kind {
        "cpu" => Some(DeviceSpec::local_cpu()),
        "p100" => Some(DeviceSpec::p100()),
        // The GPUs lent to this project are H100s and H200s; a measured profile refines it.
        "cuda" => Some(DeviceSpec::h100()),
        _ => None,
    }
}

/// A `[[link]]` override as the planner prices it.
fn host_link(l: &HostLink) -> Link {
    Link::from_gbit_per_s(l.gbps, l.latency_us)
}

/// The planner's view of the running cluster: the hosts file's model, with each pair of hosts the
/// file does not give a `[[link]]` for priced at what `up` measured between them, and the
/// transport's CPU per byte at the mean of what it measured on every link. Its one NIC per host
/// stays unless `up` measured some host sending to its peers at once clearly faster than to its
/// fastest peer alone ([`NIC_SHARED_BELOW`]): then an interface is not what limits the hosts, and
/// every host pair keeps a link of its own (the model shares NICs machine-wide or not at all).
pub fn cluster_machine(hosts: &Hosts, state: &Path) -> anyhow::Result<MachineModel> {
    cluster_machine_staged(hosts, state, None)
}

/// [`cluster_machine`], with `staged` for the staging copies of hosts sharing this machine's GPU
/// (see [`hosts_machine_staged`]): each measured link between two such hosts is the network part
/// of their slices, priced [`through_staging`].
pub fn cluster_machine_staged(
    hosts: &Hosts,
    state: &Path,
    staged: Option<Link>,
) -> anyhow::Result<MachineModel> {
    let staging = match (shares_one_gpu(hosts), staged) {
        (false, _) => None,
        (true, Some(link)) => Some(link),
        (true, None) => Some(assumed_staging()?),
    };
    let links = load_links(state)?;
    let nics = load_nics(state)?;
    let interface_limits = |nic: &MeasuredNic| {
        let fastest_peer = links
            .iter()
            .filter(|l| l.from == nic.host)
            .map(|l| l.bytes_per_s)
            .fold(0.0f64, f64::max);
        // one peer says nothing about sharing, nor does a host without measured links
        nic.peers < 2 || fastest_peer == 0.0 || nic.bytes_per_s < NIC_SHARED_BELOW * fastest_peer
    };
    let mut machine = if nics.iter().all(interface_limits) {
        hosts_machine_staged(hosts, staging)?
    } else {
        hosts_machine_staged(hosts, staging)?.without_nics()
    };
    let ranges = hosts.device_ranges();
    let index = |name: &str| hosts.hosts.iter().position(|h| h.name == name);
    let cpu: Vec<NetworkCpu> = links
        .iter()
        .map(|l| NetworkCpu {
            send_s_per_byte: l.send_cpu_s_per_byte,
            recv_s_per_byte: l.recv_cpu_s_per_byte,
        })
        .filter(|c| {
            let valid = |v: f64| v.is_finite() && v >= 0.0;
            valid(c.send_s_per_byte)
                && valid(c.recv_s_per_byte)
                && c.send_s_per_byte + c.recv_s_per_byte > 0.0
        })
        .collect();
    if !cpu.is_empty() {
        let mean = |f: fn(&NetworkCpu) -> f64| cpu.iter().map(f).sum::<f64>() / cpu.len() as f64;
        machine = machine.with_network_cpu(NetworkCpu {
            send_s_per_byte: mean(|c| c.send_s_per_byte),
            recv_s_per_byte: mean(|c| c.recv_s_per_byte),
        })?;
    }
    for l in links {
        let (Some(a), Some(b)) = (index(&l.from), index(&l.to)) else {
            continue;
        };
        let declared = hosts
            .links
            .iter()
            .any(|d| (d.from, d.to) == (a, b) || (d.from, d.to) == (b, a));
        let usable = l.bytes_per_s.is_finite()
            && l.bytes_per_s > 0.0
            && l.latency_s.is_finite()
            && l.latency_s >= 0.0;
        if declared || a == b || !usable {
            continue;
        }
        let link = Link {
            bytes_per_s: l.bytes_per_s,
            latency_s: l.latency_s,
        };
        let link = match staging {
            Some(staged) => through_staging(link, staged),
            None => link,
        };
        for x in ranges[a].clone() {
            for y in ranges[b].clone() {
                machine = machine.with_link(x, y, link)?;
            }
        }
    }
    Ok(machine)
}

#[cfg(test)]
mod tests {
    use super::*;

    use legion_cluster::launch::{MeasuredLink, links_path};

    fn gpu(ordinal: usize) -> CudaDevice {
        CudaDevice {
            ordinal,
            name: "NVIDIA H100".into(),
            total_memory_bytes: 80 << 30,
            compute_capability: (9, 0),
        }
    }

    #[test]
    fn the_embedded_gpu_machine_takes_each_gpus_memory_and_the_math() {
        let one = gpus_machine(4, &[gpu(0)], Precision::Fp32).unwrap();
        assert_eq!((one.num_devices(), one.num_nodes()), (4, 1));
        assert_eq!(
            one.device(0).memory_gib,
            Some(20.0),
            "a quarter of the GPU each"
        );
        assert_eq!(one.compute_slots(), Some(1));
        let four: Vec<CudaDevice> = (0..4).map(gpu).collect();
        assert_eq!(
            gpus_machine(2, &four, Precision::Fp32).unwrap().num_nodes(),
            2
        );
        let tf32 = gpus_machine(1, &[gpu(0)], Precision::Tf32).unwrap();
        assert!(tf32.device(0).peak_gflops > 7.0 * DeviceSpec::h100().peak_gflops);
        assert_eq!(tf32.device(0).kind, "h100-tf32");
        let bf16 = gpus_machine(1, &[gpu(0)], Precision::Bf16).unwrap();
        assert!(bf16.device(0).peak_gflops > 14.0 * DeviceSpec::h100().peak_gflops);
        assert_eq!(bf16.device(0).kind, "h100-bf16");
        assert_eq!(bf16.activation_bytes(), 2);
        // The kind is the GPU's, from its name: an H200's profile is its own.
        let h200 = CudaDevice {
            name: "NVIDIA H200".into(),
            total_memory_bytes: 140 << 30,
            ..gpu(0)
        };
        let on_h200 = gpus_machine(2, &[h200], Precision::Fp32).unwrap();
        assert_eq!(on_h200.device(0).kind, "h200");
        assert_eq!(on_h200.device(0).memory_gib, Some(70.0));
    }

    /// The hosts module's example: node0 (2 devices, port 7401) and 10.0.0.2, with a link.
    const DOC: &str = r#"[defaults]
port = 7400
devices = 1
device = "cpu"
[[host]]
name = "node0"
address = "127.0.0.1"
devices = 2
port = 7401
ssh = "user@node0"
[[host]]
address = "10.0.0.2"
ssh = "ubuntu@10.0.0.2"
[[link]]
from = "node0"
to = "10.0.0.2"
gbps = 10.0
latency_us = 20.0
"#;

    #[test]
    fn every_valid_hosts_file_can_be_planned_for() {
        assert_eq!(
            legion_cluster::hosts::MAX_DEVICES,
            legion_planner::machine::MAX_DEVICES
        );
        for kind in DEVICE_KINDS {
            assert!(device_spec(kind).is_some(), "{kind}");
        }
    }

    #[test]
    fn the_example_hosts_toml_is_three_nodes() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hosts.toml");
        let machine = hosts_machine(&Hosts::load(path).unwrap()).unwrap();
        assert_eq!((machine.num_devices(), machine.num_nodes()), (6, 3));
    }

    #[test]
    fn hosts_machine_has_a_node_per_host_and_the_overrides() {
        let text = DOC.replacen(
            "[[link]]",
            "[[host]]\nname = \"node2\"\naddress = \"10.0.0.3\"\n[[link]]",
            1,
        );
        let hosts = Hosts::parse(&text.replacen("gbps = 10.0", "gbps = 25", 1), "h.toml").unwrap();
        let m = hosts_machine(&hosts).unwrap();
        assert_eq!((m.num_devices(), m.num_nodes()), (4, 3));
        assert_eq!((m.node_of(1), m.node_of(2), m.node_of(3)), (0, 1, 2));
        assert_eq!(m.device(0).kind, "cpu");
        let in_process = MachineModel::preset("local-cpu").unwrap().intra_node_link();
        assert_eq!(m.link(0, 1), Some(in_process));
        // node0 (devices 0, 1) <-> 10.0.0.2 (device 2): the override, both directions
        for (a, b) in [(0, 2), (2, 0), (1, 2), (2, 1)] {
            assert_eq!(m.link(a, b), Some(Link::from_gbit_per_s(25.0, 20.0)));
        }
        // everything else across hosts: the default network
        let network = Link::from_gbit_per_s(DEFAULT_INTER_HOST_GBPS, DEFAULT_INTER_HOST_LATENCY_US);
        for (a, b) in [(0, 3), (3, 1), (2, 3)] {
            assert_eq!(m.link(a, b), Some(network));
        }
    }

    #[test]
    fn measured_links_price_undeclared_host_pairs() {
        let hosts = Hosts::parse(
            "[[host]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = 1\ndevices = 2\n\
             [[host]]\nname = \"b\"\naddress = \"127.0.0.1\"\nport = 2\n",
            "hosts.toml",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let links = vec![
            MeasuredLink {
                from: "a".into(),
                to: "b".into(),
                bytes_per_s: 1e8,
                latency_s: 1e-4,
                send_cpu_s_per_byte: 1e-9,
                recv_cpu_s_per_byte: 3e-9,
            },
            MeasuredLink {
                from: "b".into(),
                to: "a".into(),
                bytes_per_s: 1e8,
                latency_s: 1e-4,
                send_cpu_s_per_byte: 3e-9,
                recv_cpu_s_per_byte: 5e-9,
            },
        ];
        legion_ops::atomic_file::write(
            &links_path(dir.path()),
            serde_json::to_string(&links).unwrap().as_bytes(),
        )
        .unwrap();
        let m = cluster_machine(&hosts, dir.path()).unwrap();
        assert_eq!(m.link(0, 2).unwrap().bytes_per_s, 1e8);
        assert_eq!(m.link(1, 2).unwrap().latency_s, 1e-4);
        // Within a host: unchanged.
        assert_eq!(m.link(0, 1), hosts_machine(&hosts).unwrap().link(0, 1));
        let cpu = m.network_cpu().unwrap();
        assert!((cpu.send_s_per_byte - 2e-9).abs() < 1e-24, "{cpu:?}");
        assert!((cpu.recv_s_per_byte - 4e-9).abs() < 1e-24, "{cpu:?}");
    }

    /// Two local hosts with `device = "cuda"`, one device each (the cluster check's), and a third
    /// host of two devices: worker processes sharing the machine's GPU.
    const LOCAL_CUDA: &str = "[defaults]\ndevice = \"cuda\"\ndevices = 1\n\
        [[host]]\nname = \"g0\"\naddress = \"127.0.0.1\"\nport = 1\n\
        [[host]]\nname = \"g1\"\naddress = \"127.0.0.1\"\nport = 2\n";

    #[test]
    fn local_cuda_hosts_are_processes_sharing_one_gpu() {
        let hosts = Hosts::parse(LOCAL_CUDA, "hosts.toml").unwrap();
        assert!(shares_one_gpu(&hosts));
        let m = hosts_machine(&hosts).unwrap();
        assert_eq!((m.num_devices(), m.num_nodes()), (2, 2));
        assert_eq!(m.name(), "hosts:2on1gpu");
        // GPU devices, each with half of the GPU, one kernel at a time between them
        assert_eq!(m.device(0).kind, "h100");
        assert_eq!(m.device(1).memory_gib, Some(40.0));
        assert_eq!(m.compute_slots(), Some(1));
        // across the processes: staged out, the network, staged in, one after the other
        let staged = assumed_staging().unwrap();
        let one_gpu = MachineModel::preset("one-gpu:2").unwrap();
        assert!(staged.bytes_per_s < one_gpu.intra_node_link().bytes_per_s);
        let network = Link::from_gbit_per_s(DEFAULT_INTER_HOST_GBPS, DEFAULT_INTER_HOST_LATENCY_US);
        let across = m.link(0, 1).unwrap();
        let expected = 1.0 / (1.0 / network.bytes_per_s + 1.0 / staged.bytes_per_s);
        assert!(
            (across.bytes_per_s - expected).abs() <= 1e-6 * expected,
            "{across:?}"
        );
        assert_eq!(across.latency_s, network.latency_s + staged.latency_s);
        assert_eq!(m.link(1, 0), Some(across));

        // a host of two devices: its own pair exchanges slices in the GPU's memory
        let three = Hosts::parse(
            &format!("{LOCAL_CUDA}[[host]]\nname = \"g2\"\naddress = \"127.0.0.1\"\nport = 3\ndevices = 2\n"),
            "hosts.toml",
        )
        .unwrap();
        let m = hosts_machine(&three).unwrap();
        assert_eq!((m.num_devices(), m.num_nodes()), (4, 3));
        assert_eq!(m.link(2, 3), Some(one_gpu.intra_node_link()));
        assert_eq!(m.link(0, 3), Some(across));
        assert_eq!(m.device(3).memory_gib, Some(20.0));

        // A measured staging link (a GPU profile's) replaces the assumed one.
        let measured = Link {
            bytes_per_s: 5e9,
            latency_s: 4e-5,
        };
        let m = hosts_machine_staged(&hosts, Some(measured)).unwrap();
        assert_eq!(m.link(0, 1), Some(through_staging(network, measured)));
    }

    #[test]
    fn measured_links_between_gpu_processes_are_priced_through_staging() {
        let hosts = Hosts::parse(LOCAL_CUDA, "hosts.toml").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let quic = |from: &str, to: &str| MeasuredLink {
            from: from.into(),
            to: to.into(),
            bytes_per_s: 2e9,
            latency_s: 5e-5,
            send_cpu_s_per_byte: 0.0,
            recv_cpu_s_per_byte: 0.0,
        };
        let links = vec![quic("g0", "g1"), quic("g1", "g0")];
        legion_ops::atomic_file::write(
            &links_path(dir.path()),
            serde_json::to_string(&links).unwrap().as_bytes(),
        )
        .unwrap();
        let staged = Link {
            bytes_per_s: 1e10,
            latency_s: 2e-5,
        };
        let m = cluster_machine_staged(&hosts, dir.path(), Some(staged)).unwrap();
        let network = Link {
            bytes_per_s: 2e9,
            latency_s: 5e-5,
        };
        assert_eq!(m.link(0, 1), Some(through_staging(network, staged)));
        assert_eq!(m.compute_slots(), Some(1));
        // without a profile: the assumed staging
        let m = cluster_machine(&hosts, dir.path()).unwrap();
        assert_eq!(
            m.link(1, 0),
            Some(through_staging(network, assumed_staging().unwrap()))
        );

        // Hosts on cores, or a GPU host elsewhere, are not one shared GPU.
        let cpu = Hosts::parse(&LOCAL_CUDA.replace("\"cuda\"", "\"cpu\""), "h.toml").unwrap();
        assert!(!shares_one_gpu(&cpu));
        assert_eq!(
            cluster_machine(&cpu, dir.path()).unwrap().link(0, 1),
            Some(network)
        );
        let remote = Hosts::parse(
            &LOCAL_CUDA.replace("127.0.0.1\"\nport = 2", "10.0.0.2\"\nport = 2"),
            "h.toml",
        )
        .unwrap();
        assert!(!shares_one_gpu(&remote));
        assert_eq!(hosts_machine(&remote).unwrap().compute_slots(), None);
    }

    #[test]
    fn logical_gpus_share_their_device_in_the_embedded_machine() {
        let logical = gpus_machine(4, &[gpu(0), gpu(0)], Precision::Fp32).unwrap();
        assert_eq!((logical.num_devices(), logical.num_nodes()), (4, 2));
        assert_eq!(logical.compute_slots(), Some(1), "one physical GPU");
        assert_eq!(logical.device(0).memory_gib, Some(20.0), "80 GiB over 4");
        // between the logical GPUs: staged, as between GPUs
        assert_eq!(logical.link(0, 2), Some(assumed_staging().unwrap()));
        let two = gpus_machine(4, &[gpu(0), gpu(1)], Precision::Fp32).unwrap();
        assert_eq!(two.compute_slots(), Some(2));
        assert_eq!(two.device(0).memory_gib, Some(40.0));
    }

    #[test]
    fn links_measured_before_the_transport_cpu_was_still_load() {
        let json = r#"[{"from": "a", "to": "b", "bytes_per_s": 1e8, "latency_s": 1e-4}]"#;
        let links: Vec<MeasuredLink> = serde_json::from_str(json).unwrap();
        assert_eq!(links[0].send_cpu_s_per_byte, 0.0);
        let hosts = Hosts::parse(
            "[[host]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = 1\n\
             [[host]]\nname = \"b\"\naddress = \"127.0.0.1\"\nport = 2\n",
            "hosts.toml",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        legion_ops::atomic_file::write(&links_path(dir.path()), json.as_bytes()).unwrap();
        let m = cluster_machine(&hosts, dir.path()).unwrap();
        assert_eq!(m.network_cpu(), None);
        assert_eq!(m.link(0, 1).unwrap().bytes_per_s, 1e8);
    }

    /// Three hosts, each measured alone to its peers at 1e8 B/s: one whose interface carried
    /// 1.1e8 B/s to both peers at once is a shared NIC; 2e8 B/s (each peer at its own speed) is
    /// not, and the cluster's model then gives each host pair a link of its own.
    #[test]
    fn measured_interfaces_decide_whether_a_host_shares_one_nic() {
        let hosts = Hosts::parse(
            "[[host]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = 1\n\
             [[host]]\nname = \"b\"\naddress = \"127.0.0.1\"\nport = 2\n\
             [[host]]\nname = \"c\"\naddress = \"127.0.0.1\"\nport = 3\n",
            "hosts.toml",
        )
        .unwrap();
        assert_eq!(hosts_machine(&hosts).unwrap().nics_per_node(), Some(1));
        let names = ["a", "b", "c"];
        let links: Vec<MeasuredLink> = names
            .iter()
            .flat_map(|from| names.iter().map(move |to| (from, to)))
            .filter(|(from, to)| from != to)
            .map(|(from, to)| MeasuredLink {
                from: from.to_string(),
                to: to.to_string(),
                bytes_per_s: 1e8,
                latency_s: 1e-4,
                send_cpu_s_per_byte: 0.0,
                recv_cpu_s_per_byte: 0.0,
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let write = |path: std::path::PathBuf, json: String| {
            legion_ops::atomic_file::write(&path, json.as_bytes()).unwrap()
        };
        write(
            links_path(dir.path()),
            serde_json::to_string(&links).unwrap(),
        );
        let nics_at = |bytes_per_s: f64| -> Vec<MeasuredNic> {
            names
                .iter()
                .map(|h| MeasuredNic {
                    host: h.to_string(),
                    peers: 2,
                    bytes_per_s,
                })
                .collect()
        };
        let nics_path = legion_cluster::launch::nics_path(dir.path());
        write(
            nics_path.clone(),
            serde_json::to_string(&nics_at(1.1e8)).unwrap(),
        );
        let shared = cluster_machine(&hosts, dir.path()).unwrap();
        assert_eq!(shared.nics_per_node(), Some(1));
        assert!(shared.route(0, 1).unwrap().lanes.is_some());
        write(nics_path, serde_json::to_string(&nics_at(2e8)).unwrap());
        let private = cluster_machine(&hosts, dir.path()).unwrap();
        assert_eq!(private.nics_per_node(), None);
        assert!(private.route(0, 1).unwrap().lanes.is_none());
    }
}
