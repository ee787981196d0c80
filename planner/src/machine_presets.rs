//! The catalogue of machines: the named presets `--machine` accepts ([`PRESETS`],
//! [`MachineModel::preset`]), the machine the `--nodes`/`--devices-per-node` flags describe
//! ([`MachineModel::from_flags`]), the embedded cluster's devices on GPUs
//! ([`MachineModel::on_gpus`]), and the devices they are made of ([`DeviceSpec::p100`],
//! [`DeviceSpec::h100`], [`DeviceSpec::local_cpu`]). Each is built from [`crate::machine`]'s
//! public constructors, with its hardware's figures as constants here.

use crate::machine::{
    DeviceSpec, IntraTopology, Link, MAX_DEVICES, MachineError, MachineModel, NodeSpec,
};
use legion_ops::Precision;

/// Names accepted by [`MachineModel::preset`].
pub const PRESETS: &[&str] = &[
    "paper",
    "paper:1",
    "paper:2",
    "paper:4",
    "paper:8",
    "paper:16",
    "paper-pairs:N",
    "dgx-h100",
    "dgx-h100:N",
    "local-cpu",
    "local-cpu:N",
    "one-gpu:N",
];

/// NVLink between P100s of one node, per direction (the paper's DGX-style nodes).
const PAPER_NVLINK_GBIT: f64 = 160.0;
const PAPER_NVLINK_LATENCY_US: f64 = 5.0;
/// 100 Gb/s EDR InfiniBand between nodes.
const PAPER_IB_GBIT: f64 = 100.0;
const PAPER_IB_LATENCY_US: f64 = 10.0;
const PAPER_GPUS_PER_NODE: usize = 4;
/// NVLink 4 through NVSwitch: 900 GB/s per H100, both directions together.
const H100_NVLINK_GBIT: f64 = 3600.0;
const H100_NVLINK_LATENCY_US: f64 = 2.0;
/// One 400 Gb/s NDR InfiniBand NIC per GPU.
const H100_NIC_GBIT: f64 = 400.0;
const H100_NIC_LATENCY_US: f64 = 5.0;
const H100_GPUS_PER_NODE: usize = 8;
/// A device gathering a slice and the receiver copying it in, both within one GPU's memory: two
/// reads and two writes of the slice at the GPU's memory bandwidth, at best.
const SAME_GPU_COPIES: f64 = 4.0;
const SAME_GPU_LATENCY_US: f64 = 10.0;
/// Page-locked copies between host and GPU over PCIe Gen5 x16, each direction, GB/s (of ~64 in
/// theory, what a staged copy sees); a staged slice goes device → host → device, two of them.
const STAGED_GB_PER_S: f64 = 25.0;
const STAGED_HOPS: f64 = 2.0;
const STAGED_LATENCY_US: f64 = 30.0;
/// Dense tensor-core peaks of an H100 SXM5 over its FP32 peak (67 TFLOP/s): TF32 494.7 and BF16
/// 989.4 TFLOP/s. An H200 has the same compute.
pub const TF32_OVER_FP32: f64 = 494.7 / 67.0;
pub const BF16_OVER_FP32: f64 = 989.4 / 67.0;

impl DeviceSpec {
    /// An NVIDIA Tesla P100 (SXM2) as in the OptCNN paper's cluster.
    pub fn p100() -> DeviceSpec {
        DeviceSpec {
            kind: "p100".into(),
            peak_gflops: 9300.0,
            memory_gb_per_s: 732.0,
            task_overhead_us: 10.0,
            memory_gib: Some(16.0),
        }
    }

    /// An NVIDIA H100 SXM5 at strict FP32 (no tensor cores: TF32 is opt-in), as in a current
    /// DGX/HGX node.
    pub fn h100() -> DeviceSpec {
        DeviceSpec {
            kind: "h100".into(),
            peak_gflops: 67000.0,
            memory_gb_per_s: 3350.0,
            task_overhead_us: 5.0,
            memory_gib: Some(80.0),
        }
    }

    /// An NVIDIA H200 SXM at strict FP32: an H100's compute with HBM3e (4.8 TB/s, 141 GB).
    pub fn h200() -> DeviceSpec {
        DeviceSpec {
            kind: "h200".into(),
            memory_gb_per_s: 4800.0,
            memory_gib: Some(141.0),
            ..DeviceSpec::h100()
        }
    }

    /// The device a GPU of this name is (as the driver names it, `NVIDIA H200`), with
    /// `memory_gib` of memory: an H200 or an H100 by their figures, any other GPU under a kind of
    /// its own made from its name, so that a profile measured on it is looked up as its own, with
    /// an H100's figures standing in for the roofline until a profile measures it.
    pub fn for_gpu(name: &str, memory_gib: f64) -> DeviceSpec {
        let words: Vec<String> = name
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty() && !w.eq_ignore_ascii_case("nvidia"))
            .map(|w| w.to_ascii_lowercase())
            .collect();
        let mut device = match words.first().map(String::as_str) {
            Some("h200") => DeviceSpec::h200(),
            Some("h100") | None => DeviceSpec::h100(),
            Some(_) => DeviceSpec {
                kind: words.join("-"),
                ..DeviceSpec::h100()
            },
        };
        device.memory_gib = Some(memory_gib);
        device
    }

    /// A device of `kind`'s peak in `precision` over its strict-FP32 peak: the H100's
    /// tensor-core ratios ([`TF32_OVER_FP32`], [`BF16_OVER_FP32`]) for a GPU (`h100`, `h200`
    /// and any other kind [`DeviceSpec::for_gpu`] makes, which stand on H100 figures), 1 for a
    /// CPU (`cpu`: the CPU backend computes in fp32) and for the paper's P100 (no TF32 or BF16
    /// tensor cores), which keep their FP32 peak and gain only bf16's halved memory traffic.
    pub fn precision_speedup(kind: &str, precision: Precision) -> f64 {
        match (kind, precision) {
            (_, Precision::Fp32) | ("cpu" | "p100", _) => 1.0,
            (_, Precision::Tf32) => TF32_OVER_FP32,
            (_, Precision::Bf16) => BF16_OVER_FP32,
        }
    }

    /// One CPU "device" of this development machine (a thread running the gemm kernels).
    pub fn local_cpu() -> DeviceSpec {
        DeviceSpec {
            kind: "cpu".into(),
            peak_gflops: 100.0,
            memory_gb_per_s: 10.0,
            task_overhead_us: 5.0,
            memory_gib: None,
        }
    }
}

impl MachineModel {
    /// The machine described by command-line flags: P100-class devices (the paper's), NVLink-class
    /// links inside a node and InfiniBand-class links across nodes unless the bandwidths (Gbit/s) are
    /// given.
    pub fn from_flags(
        nodes: usize,
        devices_per_node: usize,
        intra_gbit_per_s: Option<f64>,
        inter_gbit_per_s: Option<f64>,
    ) -> Result<MachineModel, MachineError> {
        let intra = intra_gbit_per_s.unwrap_or(PAPER_NVLINK_GBIT);
        let inter = inter_gbit_per_s.unwrap_or(PAPER_IB_GBIT);
        MachineModel::uniform(
            &format!("{nodes}x{devices_per_node}"),
            nodes,
            devices_per_node,
            DeviceSpec::p100(),
            Link::from_gbit_per_s(intra, PAPER_NVLINK_LATENCY_US),
            Link::from_gbit_per_s(inter, PAPER_IB_LATENCY_US),
        )
    }

    /// A named preset:
    /// - `paper`: the OptCNN paper's testbed, 4 nodes × 4 P100, NVLink between each two GPUs of a
    ///   node, one 100 Gb/s EDR InfiniBand NIC per node that its four GPUs share; `paper:N` its
    ///   first N GPUs (N = 1, 2, 4, 8, 16);
    /// - `paper-pairs:N`: the same GPUs with a private 100 Gb/s link per GPU pair across nodes (the
    ///   paper's own device graph, which gives a node one link per remote GPU);
    /// - `dgx-h100`: 2 nodes × 8 H100 SXM, NVLink 4 through NVSwitch (one port per GPU), one
    ///   400 Gb/s NDR NIC per GPU; `dgx-h100:N` N GPUs in nodes of 8 (N = 1, 2, 4, 8 or a
    ///   multiple of 8);
    /// - `local-cpu` (this machine: one node with 2 CPU devices exchanging tensors by in-process
    ///   copies) and `local-cpu:N` (the embedded cluster's N CPU devices, sharing this machine's
    ///   cores).
    pub fn preset(name: &str) -> Result<MachineModel, MachineError> {
        let unknown = || MachineError::UnknownPreset {
            name: name.to_string(),
            known: PRESETS.join(", "),
        };
        let count =
            |prefix: &str| -> Option<usize> { name.strip_prefix(prefix)?.parse::<usize>().ok() };
        let paper_count = |n: usize| matches!(n, 1 | 2 | 4 | 8 | 16);
        match name {
            "local-cpu" => MachineModel::uniform(
                name,
                1,
                2,
                DeviceSpec::local_cpu(),
                // ~5 GB/s memcpy between threads' buffers
                Link::from_gbit_per_s(40.0, 2.0),
                Link::from_gbit_per_s(40.0, 2.0),
            ),
            "paper" => MachineModel::paper(name, 16, true),
            "dgx-h100" => MachineModel::dgx_h100(name, 16),
            _ => {
                if let Some(n) = count("local-cpu:").filter(|&n| n >= 1) {
                    MachineModel::uniform(
                        name,
                        1,
                        n,
                        DeviceSpec::local_cpu(),
                        Link::from_gbit_per_s(40.0, 2.0),
                        Link::from_gbit_per_s(40.0, 2.0),
                    )
                } else if let Some(n) =
                    count("one-gpu:").filter(|&n| (1..=MAX_DEVICES).contains(&n))
                {
                    MachineModel::on_gpus(name, n, &[80.0], DeviceSpec::h100())
                } else if let Some(n) = count("paper:").filter(|&n| paper_count(n)) {
                    MachineModel::paper(name, n, true)
                } else if let Some(n) = count("paper-pairs:").filter(|&n| paper_count(n)) {
                    MachineModel::paper(name, n, false)
                } else if let Some(n) = count("dgx-h100:")
                    .filter(|&n| (1..=MAX_DEVICES).contains(&n))
                    .filter(|&n| {
                        n < H100_GPUS_PER_NODE && n.is_power_of_two()
                            || n.is_multiple_of(H100_GPUS_PER_NODE)
                    })
                {
                    MachineModel::dgx_h100(name, n)
                } else {
                    Err(unknown())
                }
            }
        }
    }

    /// `devices` devices spread over GPUs of `gpu_memory_gib` each (as `partition::gpu_of` spreads
    /// them: consecutive devices share a GPU), each computing like `device`: one node per GPU; a
    /// slice within a GPU moves at its memory bandwidth, one between GPUs is staged through
    /// page-locked host memory; each GPU runs one kernel at a time at full speed (as many at once
    /// as there are GPUs); each device may use its share of its GPU's memory. What the embedded
    /// cluster's GPU devices make (`one-gpu:N`: N of them sharing one H100).
    pub fn on_gpus(
        name: &str,
        devices: usize,
        gpu_memory_gib: &[f64],
        device: DeviceSpec,
    ) -> Result<MachineModel, MachineError> {
        let g = gpu_memory_gib.len().min(devices);
        if g == 0 {
            return Err(MachineError::Invalid(format!(
                "no GPU to place {devices} device(s) on"
            )));
        }
        let nodes: Vec<NodeSpec> = (0..g)
            .map(|gpu| {
                let on_gpu = (0..devices)
                    .filter(|&d| legion_ops::partition::gpu_of(d, devices, g) == gpu)
                    .count();
                NodeSpec {
                    devices: on_gpu,
                    device: DeviceSpec {
                        memory_gib: Some(gpu_memory_gib[gpu] / on_gpu as f64),
                        ..device.clone()
                    },
                }
            })
            .collect();
        let same_gpu = Link {
            bytes_per_s: device.memory_bytes_per_s() / SAME_GPU_COPIES,
            latency_s: SAME_GPU_LATENCY_US * 1e-6,
        };
        let staged = Link {
            bytes_per_s: STAGED_GB_PER_S * 1e9 / STAGED_HOPS,
            latency_s: STAGED_LATENCY_US * 1e-6,
        };
        MachineModel::new(name, &nodes, same_gpu, staged)?.with_compute_slots(g)
    }

    /// The paper's testbed, its first `gpus` GPUs; with `shared_nic`, one NIC per node.
    fn paper(name: &str, gpus: usize, shared_nic: bool) -> Result<MachineModel, MachineError> {
        let per_node = gpus.min(PAPER_GPUS_PER_NODE);
        let machine = MachineModel::uniform(
            name,
            gpus / per_node,
            per_node,
            DeviceSpec::p100(),
            Link::from_gbit_per_s(PAPER_NVLINK_GBIT, PAPER_NVLINK_LATENCY_US),
            Link::from_gbit_per_s(PAPER_IB_GBIT, PAPER_IB_LATENCY_US),
        )?;
        match shared_nic {
            true => machine.with_nics(1),
            false => Ok(machine),
        }
    }

    fn dgx_h100(name: &str, gpus: usize) -> Result<MachineModel, MachineError> {
        let per_node = gpus.min(H100_GPUS_PER_NODE);
        Ok(MachineModel::uniform(
            name,
            gpus / per_node,
            per_node,
            DeviceSpec::h100(),
            Link::from_gbit_per_s(H100_NVLINK_GBIT, H100_NVLINK_LATENCY_US),
            Link::from_gbit_per_s(H100_NIC_GBIT, H100_NIC_LATENCY_US),
        )?
        .with_nics(H100_GPUS_PER_NODE)?
        .with_intra_topology(IntraTopology::Switch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_sharing_gpus_are_nodes_of_them_one_kernel_each_at_a_time() {
        let one = MachineModel::preset("one-gpu:4").unwrap();
        assert_eq!((one.num_devices(), one.num_nodes()), (4, 1));
        assert_eq!(
            one.compute_slots(),
            Some(1),
            "one kernel at a time on one GPU"
        );
        assert_eq!(
            one.device(3).memory_gib,
            Some(20.0),
            "a quarter of its memory each"
        );
        assert_eq!(one.device(0).kind, "h100");
        assert!(one.link(0, 3).unwrap().bytes_per_s > 500e9);
        // As the runtime places them: 3 devices on 2 GPUs are 2 + 1, staged between them.
        let two = MachineModel::on_gpus("t", 3, &[80.0, 40.0], DeviceSpec::h100()).unwrap();
        let nodes: Vec<usize> = (0..3).map(|d| two.node_of(d)).collect();
        assert_eq!(nodes, [0, 0, 1]);
        assert!((0..3).all(|d| nodes[d] == legion_ops::partition::gpu_of(d, 3, 2)));
        assert_eq!(two.device(2).memory_gib, Some(40.0));
        assert!(two.link(0, 2).unwrap().bytes_per_s < 20e9);
        assert_eq!(two.compute_slots(), Some(2));
        // More GPUs than devices: a GPU each, the rest unused.
        let spare = MachineModel::on_gpus("t", 2, &[80.0; 4], DeviceSpec::h100()).unwrap();
        assert_eq!(spare.num_nodes(), 2);
        assert!(MachineModel::on_gpus("t", 2, &[], DeviceSpec::h100()).is_err());
    }

    #[test]
    fn current_hardware_preset() {
        for (name, devices, nodes) in [
            ("dgx-h100", 16, 2),
            ("dgx-h100:1", 1, 1),
            ("dgx-h100:4", 4, 1),
            ("dgx-h100:8", 8, 1),
            ("dgx-h100:64", 64, 8),
        ] {
            let m = MachineModel::preset(name).unwrap();
            assert_eq!((m.num_devices(), m.num_nodes()), (devices, nodes), "{name}");
            assert_eq!(m.device(0).kind, "h100");
            assert_eq!(m.intra_topology(), IntraTopology::Switch);
        }
        for bad in ["dgx-h100:3", "dgx-h100:12", "dgx-h100:0", "paper-pairs:3"] {
            assert!(MachineModel::preset(bad).is_err(), "{bad}");
        }
        let h = MachineModel::preset("dgx-h100").unwrap();
        assert_eq!(h.bandwidth(0, 1), 450e9);
        assert_eq!(h.bandwidth(0, 8), 50e9);
    }

    #[test]
    fn paper_preset_has_nvlink_inside_and_infiniband_across_nodes() {
        let m = MachineModel::preset("paper").unwrap();
        assert_eq!(m.num_devices(), 16);
        assert_eq!(m.num_nodes(), 4);
        assert_eq!(m.node_of(5), 1);
        assert_eq!(m.bandwidth(0, 3), 20e9);
        assert_eq!(m.bandwidth(3, 4), 12.5e9);
        assert_eq!(m.bandwidth(7, 7), f64::INFINITY);
        assert_eq!(m.latency(7, 7), 0.0);
        assert_eq!(m.device(9).kind, "p100");
    }

    #[test]
    fn paper_subsets_take_the_first_gpus() {
        for (name, devices, nodes) in [
            ("paper:1", 1, 1),
            ("paper:2", 2, 1),
            ("paper:4", 4, 1),
            ("paper:8", 8, 2),
            ("paper:16", 16, 4),
        ] {
            let m = MachineModel::preset(name).unwrap();
            assert_eq!((m.num_devices(), m.num_nodes()), (devices, nodes), "{name}");
        }
        let e = MachineModel::preset("paper:3").unwrap_err().to_string();
        assert!(e.contains("unknown machine preset 'paper:3'") && e.contains("local-cpu"));
    }

    #[test]
    fn local_cpu_is_one_node_of_two_devices() {
        let m = MachineModel::preset("local-cpu").unwrap();
        assert_eq!((m.num_devices(), m.num_nodes()), (2, 1));
        assert_eq!(m.bandwidth(0, 1), 5e9);
        assert_eq!(m.device(1).peak_gflops, 100.0);
    }

    #[test]
    fn a_gpu_is_the_device_its_name_says() {
        let h200 = DeviceSpec::for_gpu("NVIDIA H200", 139.8);
        assert_eq!((h200.kind.as_str(), h200.memory_gib), ("h200", Some(139.8)));
        assert!(h200.memory_gb_per_s > DeviceSpec::h100().memory_gb_per_s);
        assert_eq!(
            DeviceSpec::for_gpu("NVIDIA H100 80GB HBM3", 79.2).kind,
            "h100"
        );
        let other = DeviceSpec::for_gpu("NVIDIA A100-SXM4-80GB", 79.3);
        assert_eq!(other.kind, "a100-sxm4-80gb");
        assert_eq!(other.peak_gflops, DeviceSpec::h100().peak_gflops);
        assert_eq!(DeviceSpec::for_gpu("", 1.0).kind, "h100");
    }
}
