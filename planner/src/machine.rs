//! The machine the planner maps a model onto: devices grouped into nodes, each with a compute speed,
//! and directed links between devices with a bandwidth and a latency.
//!
//! Every message between two devices has a [`Route`]: the link whose bandwidth and latency it
//! pays, and what it holds while on the wire. By default that is the link of its ordered device
//! pair alone (OptCNN's device graph): transfers between different pairs proceed in parallel and
//! the two directions of a pair are independent (full duplex). Real machines share more:
//! - between nodes, each node has a few network interfaces ([`MachineModel::with_nics`]; device
//!   `i` of a node uses NIC `i mod nics`) whose send and receive directions all of its devices'
//!   traffic to other nodes shares: a message holds its sender's NIC's out lane and its receiver's
//!   NIC's in lane;
//! - inside a node, [`IntraTopology`]: a link per pair (NVLink all-to-all), one port per device
//!   behind a switch (PCIe or NVSwitch: the sender's out lane and the receiver's in lane), or one
//!   path every message of the node shares (PCIe through the host bridge).
//!
//! Eq. 1's t_x and t_s, and the simulator, price a message on its route: loads add up on every
//! lane they share.

use serde::{Deserialize, Serialize};
use std::fmt;

pub use legion_ops::partition::DeviceId;

/// Speed of one device, for the roofline cost model and the profile lookup.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// Name of the device type (`p100`, `cpu`): the key measured profiles are stored under.
    pub kind: String,
    /// Peak f32 throughput, GFLOP/s.
    pub peak_gflops: f64,
    /// Memory bandwidth, GB/s (10^9 bytes per second).
    pub memory_gb_per_s: f64,
    /// Fixed cost of launching one task (kernel launch, actor message), microseconds.
    pub task_overhead_us: f64,
    /// Memory of one device, GiB; `None` where the devices share the host's memory (CPU devices),
    /// whose size is not the planner's to know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<f64>,
}

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

    pub fn peak_flops_per_s(&self) -> f64 {
        self.peak_gflops * 1e9
    }

    pub fn memory_bytes_per_s(&self) -> f64 {
        self.memory_gb_per_s * 1e9
    }

    pub fn task_overhead_s(&self) -> f64 {
        self.task_overhead_us * 1e-6
    }

    /// The device's own memory in bytes, if it has its own.
    pub fn memory_bytes(&self) -> Option<u64> {
        self.memory_gib
            .map(|gib| (gib * (1u64 << 30) as f64) as u64)
    }

    fn check(&self) -> Result<(), String> {
        if self.kind.is_empty() {
            return Err("device kind must not be empty".into());
        }
        for (field, v) in [
            ("peak_gflops", self.peak_gflops),
            ("memory_gb_per_s", self.memory_gb_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{field} must be a positive number, got {v}"));
            }
        }
        if let Some(gib) = self.memory_gib
            && !(gib.is_finite() && gib > 0.0)
        {
            return Err(format!("memory_gib must be a positive number, got {gib}"));
        }
        if !(self.task_overhead_us.is_finite() && self.task_overhead_us >= 0.0) {
            return Err(format!(
                "task_overhead_us must be zero or positive, got {}",
                self.task_overhead_us
            ));
        }
        Ok(())
    }
}

/// How the devices of one node reach each other (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntraTopology {
    /// A private link per device pair (NVLink all-to-all; the embedded cluster's copies).
    Pairs,
    /// One port per device behind a switch (PCIe switch, NVSwitch): a message holds the sender's
    /// out lane and the receiver's in lane, so a device sending to several peers shares its port.
    Switch,
    /// One path that every message between two devices of the node shares (PCIe through the host
    /// bridge).
    Bridge,
}

impl IntraTopology {
    /// The names machine files use.
    pub const NAMES: [(&'static str, IntraTopology); 3] = [
        ("pairs", IntraTopology::Pairs),
        ("switch", IntraTopology::Switch),
        ("bridge", IntraTopology::Bridge),
    ];
}

/// A shared send or receive direction of a NIC, switch port or host bridge (numbered by
/// [`MachineModel::num_lanes`]).
pub type Lane = usize;

/// How a message from one device to another travels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Route {
    /// Its bandwidth and latency.
    pub link: Link,
    /// The (out, in) lanes it holds while on the wire (equal on a host bridge); `None`: the
    /// ordered device pair's own link, which nothing else uses.
    pub lanes: Option<(Lane, Lane)>,
}

/// One direction of a connection between two devices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bytes_per_s: f64,
    /// Paid once per message.
    pub latency_s: f64,
}

impl Link {
    /// A link of `gbit_per_s` gigabits per second (10^9 bits) and `latency_us` microseconds.
    pub fn from_gbit_per_s(gbit_per_s: f64, latency_us: f64) -> Link {
        Link {
            bytes_per_s: gbit_per_s * 1e9 / 8.0,
            latency_s: latency_us * 1e-6,
        }
    }

    /// Time to move one message of `bytes` over this link: `bytes · seconds_per_byte + latency`.
    /// Every cost in the planner goes through this formula (or [`Link::seconds_per_byte`]), so
    /// tables and direct evaluation agree to the last bit.
    pub fn message_time(&self, bytes: f64) -> f64 {
        bytes * self.seconds_per_byte() + self.latency_s
    }

    pub fn seconds_per_byte(&self) -> f64 {
        1.0 / self.bytes_per_s
    }

    fn check(&self) -> Result<(), String> {
        if !(self.bytes_per_s.is_finite() && self.bytes_per_s > 0.0) {
            return Err(format!(
                "bandwidth must be a positive number, got {} bytes/s",
                self.bytes_per_s
            ));
        }
        if !(self.latency_s.is_finite() && self.latency_s >= 0.0) {
            return Err(format!(
                "latency must be zero or positive, got {} s",
                self.latency_s
            ));
        }
        Ok(())
    }
}

/// What the runtime's device actors cost besides kernels and transfers, as the profiler measured
/// them on the embedded cluster (`legion_runtime::profile`). The simulator prices its dispatch,
/// fold and update tasks with these; without them (a machine nobody profiled) dispatch is free and
/// folds and updates stream at the device's memory bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeCosts {
    /// Seconds from a compute op being able to start on its device (its dependences done, the
    /// device's previous compute op finished, a core free of other kernels and copies, and an
    /// actor thread free) to its kernel starting, its actor's own copies left out: the actor's
    /// message handling, the hand-off to the device's pool and waking its thread (the profiler's
    /// mean). Paid once per compute op (kernel, fold, update); on a machine whose devices share
    /// their cores, only by one that becomes startable with a core idle.
    pub dispatch_s: f64,
    /// CPU seconds the runtime spends per compute op besides the kernels and copies it times: the
    /// actors' message handling, handing ops to the pools, waking and parking their threads (the
    /// profiler's CPU time of the actors' threads less their copies' own seconds, and of workers
    /// the devices share beyond their ops' own seconds, per compute op; see
    /// `legion_runtime::profile`). On a machine whose devices share their cores it is the end
    /// of the op's dispatch and holds a core: with the cores busy, each op's kernel waits for it
    /// after a core frees, and for nothing else. 0 in profiles from before it was measured.
    #[serde(default)]
    pub runtime_cpu_s: f64,
    /// How those delays spread: the mean of each sixteenth of them, in ascending order (their mean
    /// is `dispatch_s`). When present, the simulator draws each op's delay from them and reports
    /// the expected step time over many draws: a step of many small ops waits on the slowest of
    /// its parallel paths, so varying delays cost more than their mean paid by every op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_bins_s: Option<[f64; DISPATCH_BINS]>,
    /// Throughput of folds (sums of gradient terms), in bytes of [`fold_bytes`] per second.
    pub fold_bytes_per_s: f64,
    /// Throughput of SGD updates, in bytes of [`update_bytes`] per second.
    pub update_bytes_per_s: f64,
    /// Throughput of the copies a device's actor makes itself (gathering a piece of an instance to
    /// send, storing a received piece into a larger instance, local copies), bytes per second.
    /// The actor does nothing else meanwhile: its device's next kernel waits.
    pub copy_bytes_per_s: f64,
    /// Threads the device actors share (the embedded cluster runs its N actors on a small tokio
    /// pool): at most this many actors copy at once, and an actor needs one to dispatch.
    pub actor_threads: usize,
}

/// The bytes a fold of `terms` terms over a rect of `rect_bytes` streams: every term read once and
/// the result written once. The profiler measures fold throughput in these bytes and the simulator
/// prices folds with them, so both count alike.
pub fn fold_bytes(terms: usize, rect_bytes: u64) -> u64 {
    (terms as u64 + 1) * rect_bytes
}

/// The bytes an SGD update of a slice of `slice_bytes` streams: gradient, weights and momentum
/// read, weights and momentum written.
pub fn update_bytes(slice_bytes: u64) -> u64 {
    5 * slice_bytes
}

/// Equal-probability bins of [`RuntimeCosts::dispatch_bins_s`].
pub const DISPATCH_BINS: usize = 16;

impl RuntimeCosts {
    /// The bin means of `delays` ([`RuntimeCosts::dispatch_bins_s`]); `None` with fewer delays than
    /// bins. Each bin holds an equal share of the sorted delays, to within one.
    pub fn dispatch_bins(delays: &[f64]) -> Option<[f64; DISPATCH_BINS]> {
        if delays.len() < DISPATCH_BINS {
            return None;
        }
        let mut sorted = delays.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(std::array::from_fn(|b| {
            let bin =
                &sorted[b * sorted.len() / DISPATCH_BINS..(b + 1) * sorted.len() / DISPATCH_BINS];
            bin.iter().sum::<f64>() / bin.len() as f64
        }))
    }

    /// Every time zero or positive, every throughput positive (all finite).
    pub fn validate(&self) -> Result<(), String> {
        for (field, v) in [
            ("dispatch_s", self.dispatch_s),
            ("runtime_cpu_s", self.runtime_cpu_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field} must be zero or positive, got {v}"));
            }
        }
        if let Some(bins) = &self.dispatch_bins_s
            && let Some(bad) = bins.iter().find(|b| !(b.is_finite() && **b >= 0.0))
        {
            return Err(format!(
                "dispatch_bins_s must be zero or positive, got {bad}"
            ));
        }
        for (field, v) in [
            ("fold_bytes_per_s", self.fold_bytes_per_s),
            ("update_bytes_per_s", self.update_bytes_per_s),
            ("copy_bytes_per_s", self.copy_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{field} must be a positive number, got {v}"));
            }
        }
        if !(1..=MAX_THREADS).contains(&self.actor_threads) {
            return Err(format!(
                "actor_threads must be in 1..={MAX_THREADS}, got {}",
                self.actor_threads
            ));
        }
        Ok(())
    }
}

/// A node: a number of identical devices sharing the intra-node interconnect.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSpec {
    pub devices: usize,
    pub device: DeviceSpec,
}

/// What is wrong with a machine description.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("unknown machine preset '{name}' (known: {known})")]
    UnknownPreset { name: String, known: String },
    #[error("invalid machine: {0}")]
    Invalid(String),
    /// A located error in a machine file.
    #[error("{file}:{line}:{column}: {field}{message}")]
    File {
        file: String,
        line: usize,
        column: usize,
        /// `"field: "` or empty when the error is not about one field.
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// Devices, nodes and links. Cheap queries (`link`, `bandwidth`, `latency`) read a dense table.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineModel {
    name: String,
    node_of: Vec<usize>,
    /// The first device of each node.
    node_first: Vec<DeviceId>,
    spec_of: Vec<usize>,
    specs: Vec<DeviceSpec>,
    intra_node: Link,
    inter_node: Link,
    /// Directed links, `links[a * n + b]`; the diagonal is never read.
    links: Vec<Link>,
    overrides: Vec<(DeviceId, DeviceId, Link)>,
    /// When the devices are threads sharing the machine's cores (the embedded cluster): how many
    /// tasks that use a core (kernels, folds, updates, the actors' copies) the whole machine runs
    /// at once at full speed. `None`: every device computes independently.
    compute_slots: Option<usize>,
    /// The measured cost of the runtime's own work (dispatch, folds, updates), when profiled.
    runtime_costs: Option<RuntimeCosts>,
    /// Network interfaces per node that its devices' messages to other nodes share (see the
    /// module doc); `None`: a private link per device pair.
    nics_per_node: Option<usize>,
    /// How a node's devices reach each other.
    intra_topology: IntraTopology,
    /// The transport's CPU work per byte of a message between nodes, when measured.
    network_cpu: Option<NetworkCpu>,
}

/// CPU seconds per byte the transport spends on a message between nodes (encryption, packets,
/// copies), at the sending and at the receiving node, as `legion-rs up` measures it. Where a
/// node's devices share its cores with its network threads (CPU devices), this work competes with
/// the kernels: the simulator runs it on each node's network threads, on the shared cores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NetworkCpu {
    pub send_s_per_byte: f64,
    pub recv_s_per_byte: f64,
}

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

/// The most threads a machine's runtime may run at once (compute slots, actor threads): more than
/// any host has cores. The simulator keeps a clock per thread.
pub const MAX_THREADS: usize = 4096;

/// The most devices a machine may have. The model keeps a link per ordered device pair (16 bytes
/// each: 256 MiB at this size), and degrees and device ids are stored in `u32`.
pub const MAX_DEVICES: usize = 4096;

fn check_device_count(devices: Option<usize>) -> Result<usize, MachineError> {
    devices.filter(|&n| n <= MAX_DEVICES).ok_or_else(|| {
        MachineError::Invalid(format!(
            "a machine has at most {MAX_DEVICES} devices (the planner keeps a link per device pair)"
        ))
    })
}

impl MachineModel {
    /// A machine from its nodes and the two link classes. Devices are numbered node by node.
    pub fn new(
        name: &str,
        nodes: &[NodeSpec],
        intra_node: Link,
        inter_node: Link,
    ) -> Result<MachineModel, MachineError> {
        let invalid = MachineError::Invalid;
        if nodes.is_empty() {
            return Err(invalid("a machine needs at least one node".into()));
        }
        // before anything is allocated per device
        check_device_count(
            nodes
                .iter()
                .try_fold(0usize, |acc, node| acc.checked_add(node.devices)),
        )?;
        intra_node
            .check()
            .map_err(|e| invalid(format!("intra-node link: {e}")))?;
        inter_node
            .check()
            .map_err(|e| invalid(format!("inter-node link: {e}")))?;
        let mut node_of = Vec::new();
        let mut node_first = Vec::new();
        let mut spec_of = Vec::new();
        let mut specs: Vec<DeviceSpec> = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            if node.devices == 0 {
                return Err(invalid(format!("node {i} has no devices")));
            }
            node.device
                .check()
                .map_err(|e| invalid(format!("node {i}: {e}")))?;
            let spec = match specs.iter().position(|s| *s == node.device) {
                Some(s) => s,
                None => {
                    specs.push(node.device.clone());
                    specs.len() - 1
                }
            };
            node_first.push(node_of.len());
            node_of.extend(std::iter::repeat_n(i, node.devices));
            spec_of.extend(std::iter::repeat_n(spec, node.devices));
        }
        let n = node_of.len();
        let mut links = Vec::with_capacity(n * n);
        for a in 0..n {
            for b in 0..n {
                links.push(if node_of[a] == node_of[b] {
                    intra_node
                } else {
                    inter_node
                });
            }
        }
        Ok(MachineModel {
            name: name.to_string(),
            node_of,
            node_first,
            spec_of,
            specs,
            intra_node,
            inter_node,
            links,
            overrides: Vec::new(),
            compute_slots: None,
            runtime_costs: None,
            nics_per_node: None,
            intra_topology: IntraTopology::Pairs,
            network_cpu: None,
        })
    }

    /// `nodes` nodes of `devices_per_node` identical devices.
    pub fn uniform(
        name: &str,
        nodes: usize,
        devices_per_node: usize,
        device: DeviceSpec,
        intra_node: Link,
        inter_node: Link,
    ) -> Result<MachineModel, MachineError> {
        check_device_count(nodes.checked_mul(devices_per_node))?;
        let node = NodeSpec {
            devices: devices_per_node,
            device,
        };
        MachineModel::new(name, &vec![node; nodes], intra_node, inter_node)
    }

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

    /// The same devices with every link, inside and across nodes, replaced by `link` (a measured
    /// transport, which does not know the machine's topology).
    pub fn with_all_links(mut self, link: Link) -> Result<MachineModel, MachineError> {
        link.check()
            .map_err(|e| MachineError::Invalid(format!("link: {e}")))?;
        self.intra_node = link;
        self.inter_node = link;
        self.links.fill(link);
        self.overrides.clear();
        Ok(self)
    }

    /// The same machine whose devices share a pool that runs at most `slots` compute tasks at once
    /// (N embedded CPU devices on fewer cores: a ready task waits for a free core, not just for its
    /// device). The simulator honours it; Eq. 1 does not (it prices layers, not schedules).
    pub fn with_compute_slots(mut self, slots: usize) -> Result<MachineModel, MachineError> {
        if !(1..=MAX_THREADS).contains(&slots) {
            return Err(MachineError::Invalid(format!(
                "compute slots must be in 1..={MAX_THREADS}, got {slots}"
            )));
        }
        self.compute_slots = Some(slots);
        Ok(self)
    }

    /// The same machine whose runtime costs `costs` (see [`RuntimeCosts`]); the simulator honours
    /// it, Eq. 1 does not.
    pub fn with_runtime_costs(mut self, costs: RuntimeCosts) -> Result<MachineModel, MachineError> {
        costs
            .validate()
            .map_err(|e| MachineError::Invalid(format!("runtime costs: {e}")))?;
        self.runtime_costs = Some(costs);
        Ok(self)
    }

    /// See [`MachineModel::with_runtime_costs`].
    pub fn runtime_costs(&self) -> Option<&RuntimeCosts> {
        self.runtime_costs.as_ref()
    }

    /// See [`MachineModel::with_compute_slots`].
    pub fn compute_slots(&self) -> Option<usize> {
        self.compute_slots
    }

    /// The same machine whose messages between nodes cost `cpu` at each end (see [`NetworkCpu`]);
    /// the simulator honours it, Eq. 1 does not.
    pub fn with_network_cpu(mut self, cpu: NetworkCpu) -> Result<MachineModel, MachineError> {
        let valid = |v: f64| v.is_finite() && v >= 0.0;
        if !(valid(cpu.send_s_per_byte) && valid(cpu.recv_s_per_byte)) {
            return Err(MachineError::Invalid(format!(
                "network CPU seconds per byte must be finite and non-negative, got {cpu:?}"
            )));
        }
        self.network_cpu = Some(cpu);
        Ok(self)
    }

    /// See [`MachineModel::with_network_cpu`].
    pub fn network_cpu(&self) -> Option<NetworkCpu> {
        self.network_cpu
    }

    /// The same machine whose nodes each have `nics` network interfaces that their devices'
    /// messages to other nodes share, in each direction (device `i` of a node uses NIC
    /// `i mod nics`), each at the inter-node link's bandwidth and latency.
    pub fn with_nics(mut self, nics: usize) -> Result<MachineModel, MachineError> {
        if !(1..=MAX_DEVICES).contains(&nics) {
            return Err(MachineError::Invalid(format!(
                "NICs per node must be in 1..={MAX_DEVICES}, got {nics}"
            )));
        }
        self.nics_per_node = Some(nics);
        Ok(self)
    }

    /// The same machine whose every device has `gib` GiB of memory of its own (`--memory-gib`):
    /// searches return only strategies that fit it.
    pub fn with_device_memory_gib(mut self, gib: f64) -> Result<MachineModel, MachineError> {
        if !(gib.is_finite() && gib > 0.0) {
            return Err(MachineError::Invalid(format!(
                "device memory must be a positive number of GiB, got {gib}"
            )));
        }
        for spec in &mut self.specs {
            spec.memory_gib = Some(gib);
        }
        Ok(self)
    }

    /// The same machine with a private link per device pair across nodes (no shared NICs).
    pub fn without_nics(self) -> MachineModel {
        MachineModel {
            nics_per_node: None,
            ..self
        }
    }

    /// The same machine whose devices reach each other inside a node through `topology`, at the
    /// intra-node link's bandwidth and latency.
    pub fn with_intra_topology(mut self, topology: IntraTopology) -> MachineModel {
        self.intra_topology = topology;
        self
    }

    /// See [`MachineModel::with_nics`].
    pub fn nics_per_node(&self) -> Option<usize> {
        self.nics_per_node
    }

    /// See [`MachineModel::with_intra_topology`].
    pub fn intra_topology(&self) -> IntraTopology {
        self.intra_topology
    }

    /// Whether some messages share lanes (NICs, switch ports, a host bridge) rather than each
    /// device pair having a link of its own.
    pub fn has_shared_lanes(&self) -> bool {
        (self.nics_per_node.is_some() && self.num_nodes() > 1)
            || self.intra_topology != IntraTopology::Pairs
    }

    /// Lanes are numbered: NICs' (out, in) by node and NIC, then switch ports' (out, in) by device,
    /// then host bridges by node. The number of lanes.
    pub fn num_lanes(&self) -> usize {
        let nodes = self.num_nodes();
        2 * nodes * self.nics_per_node.unwrap_or(0) + 2 * self.num_devices() + nodes
    }

    /// The route of a message from `from` to `to`; `None` for a device and itself.
    pub fn route(&self, from: DeviceId, to: DeviceId) -> Option<Route> {
        let link = self.link(from, to)?;
        let (a, b) = (self.node_of[from], self.node_of[to]);
        let nodes = self.num_nodes();
        let lanes = if a != b {
            self.nics_per_node.map(|nics| {
                let nic = |device: DeviceId| {
                    let node = self.node_of[device];
                    node * nics + (device - self.node_first[node]) % nics
                };
                (2 * nic(from), 2 * nic(to) + 1)
            })
        } else {
            let switch = 2 * nodes * self.nics_per_node.unwrap_or(0);
            match self.intra_topology {
                IntraTopology::Pairs => None,
                IntraTopology::Switch => Some((switch + 2 * from, switch + 2 * to + 1)),
                IntraTopology::Bridge => {
                    let bridge = switch + 2 * self.num_devices() + a;
                    Some((bridge, bridge))
                }
            }
        };
        Some(Route { link, lanes })
    }

    /// Replaces the link between `a` and `b`, in both directions.
    pub fn with_link(
        mut self,
        a: DeviceId,
        b: DeviceId,
        link: Link,
    ) -> Result<MachineModel, MachineError> {
        let n = self.num_devices();
        if a >= n || b >= n {
            return Err(MachineError::Invalid(format!(
                "link override {a}-{b}: the machine has devices 0..{n}"
            )));
        }
        if a == b {
            return Err(MachineError::Invalid(format!(
                "link override {a}-{b}: a device needs no link to itself"
            )));
        }
        link.check()
            .map_err(|e| MachineError::Invalid(format!("link override {a}-{b}: {e}")))?;
        self.links[a * n + b] = link;
        self.links[b * n + a] = link;
        self.overrides.push((a, b, link));
        Ok(self)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn num_devices(&self) -> usize {
        self.node_of.len()
    }

    pub fn num_nodes(&self) -> usize {
        self.node_of.last().map_or(0, |&n| n + 1)
    }

    pub fn node_of(&self, device: DeviceId) -> usize {
        self.node_of[device]
    }

    pub fn device(&self, device: DeviceId) -> &DeviceSpec {
        &self.specs[self.spec_of[device]]
    }

    /// Index of the device's spec in [`MachineModel::specs`]: devices with equal specs share it.
    pub fn spec_index(&self, device: DeviceId) -> usize {
        self.spec_of[device]
    }

    /// The distinct device specs.
    pub fn specs(&self) -> &[DeviceSpec] {
        &self.specs
    }

    /// Whether some device has memory of its own (CPU devices share the host's, which the planner
    /// does not know): only then can a strategy not fit.
    pub fn has_own_memory(&self) -> bool {
        self.specs.iter().any(|s| s.memory_bytes().is_some())
    }

    pub fn intra_node_link(&self) -> Link {
        self.intra_node
    }

    pub fn inter_node_link(&self) -> Link {
        self.inter_node
    }

    /// Per-pair overrides, as given.
    pub fn link_overrides(&self) -> &[(DeviceId, DeviceId, Link)] {
        &self.overrides
    }

    /// The link `from → to`; `None` for a device and itself (no transfer needed).
    pub fn link(&self, from: DeviceId, to: DeviceId) -> Option<Link> {
        (from != to).then(|| self.links[from * self.num_devices() + to])
    }

    /// Bytes per second from `from` to `to`; infinite for the same device.
    pub fn bandwidth(&self, from: DeviceId, to: DeviceId) -> f64 {
        self.link(from, to).map_or(f64::INFINITY, |l| l.bytes_per_s)
    }

    /// Seconds per message from `from` to `to`; zero for the same device.
    pub fn latency(&self, from: DeviceId, to: DeviceId) -> f64 {
        self.link(from, to).map_or(0.0, |l| l.latency_s)
    }

    /// Time to move one message of `bytes` from `from` to `to` (zero on the same device).
    pub fn message_time(&self, from: DeviceId, to: DeviceId, bytes: f64) -> f64 {
        self.link(from, to).map_or(0.0, |l| l.message_time(bytes))
    }
}

impl fmt::Display for MachineModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} device(s) on {} node(s) [",
            self.name,
            self.num_devices(),
            self.num_nodes()
        )?;
        for (i, s) in self.specs.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(
                f,
                "{} {} GFLOP/s {} GB/s",
                s.kind, s.peak_gflops, s.memory_gb_per_s
            )?;
        }
        // Four significant digits: presets print as given, measured links without noise digits.
        let round = |x: f64| {
            if x == 0.0 || !x.is_finite() {
                return x;
            }
            let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
            (x * scale).round() / scale
        };
        let gb = |l: Link| round(l.bytes_per_s / 1e9);
        let us = |l: Link| round(l.latency_s * 1e6);
        write!(
            f,
            "], intra-node {} GB/s {} us",
            gb(self.intra_node),
            us(self.intra_node)
        )?;
        if self.num_nodes() > 1 {
            write!(
                f,
                ", inter-node {} GB/s {} us",
                gb(self.inter_node),
                us(self.inter_node)
            )?;
        }
        if !self.overrides.is_empty() {
            write!(f, ", {} link override(s)", self.overrides.len())?;
        }
        if let Some(slots) = self.compute_slots {
            write!(f, ", compute shared by {slots} core(s)")?;
        }
        if let Some(c) = &self.runtime_costs {
            write!(f, ", dispatch {:.1} us per compute op", c.dispatch_s * 1e6)?;
        }
        match self.intra_topology {
            IntraTopology::Pairs => {}
            IntraTopology::Switch => write!(f, ", one switch port per device")?,
            IntraTopology::Bridge => write!(f, ", one host bridge per node")?,
        }
        if let Some(nics) = self.nics_per_node {
            write!(f, ", {nics} shared NIC(s) per node")?;
        }
        Ok(())
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
    fn routes_share_a_nodes_nic_across_nodes_and_a_pair_link_inside() {
        let lanes = |m: &MachineModel, a, b| m.route(a, b).unwrap().lanes;
        // paper:8: two nodes of 4, NVLink pairs inside, one NIC per node
        let m = MachineModel::preset("paper:8").unwrap();
        assert_eq!(m.nics_per_node(), Some(1));
        assert!(m.route(3, 3).is_none());
        assert_eq!(lanes(&m, 1, 2), None, "inside a node: the pair's own link");
        // NIC 0 (node 0) out = 0, in = 1; NIC 1 (node 1) out = 2, in = 3
        for from in 0..4 {
            for to in 4..8 {
                assert_eq!(lanes(&m, from, to), Some((0, 3)));
                assert_eq!(lanes(&m, to, from), Some((2, 1)));
            }
        }
        assert_eq!(m.route(1, 6).unwrap().link, m.inter_node_link());
        let pairs = MachineModel::preset("paper-pairs:8").unwrap();
        assert_eq!(lanes(&pairs, 1, 6), None);
        assert!(!pairs.has_shared_lanes() && m.has_shared_lanes());
        assert!(!MachineModel::preset("paper:4").unwrap().has_shared_lanes());
        // dgx-h100:16: NIC i of a node serves its GPU i; GPUs of a node meet at switch ports
        let h = MachineModel::preset("dgx-h100:16").unwrap();
        assert_eq!((h.num_nodes(), h.nics_per_node()), (2, Some(8)));
        assert_eq!(lanes(&h, 3, 11), Some((2 * 3, 2 * (8 + 3) + 1)));
        assert_eq!(lanes(&h, 3, 12), Some((2 * 3, 2 * (8 + 4) + 1)));
        let switch = 2 * 2 * 8;
        assert_eq!(lanes(&h, 3, 5), Some((switch + 6, switch + 11)));
        assert_eq!(h.num_lanes(), switch + 2 * 16 + 2);
        // a host bridge: one lane for every message inside the node
        let bridge = MachineModel::preset("paper:8")
            .unwrap()
            .with_intra_topology(IntraTopology::Bridge);
        let node1_bridge = 2 * 2 + 2 * 8 + 1;
        assert_eq!(lanes(&bridge, 5, 6), Some((node1_bridge, node1_bridge)));
        assert!(bridge.to_string().contains("host bridge"), "{bridge}");
        assert!(m.to_string().contains("1 shared NIC(s) per node"), "{m}");
        assert!(
            MachineModel::preset("paper:8")
                .unwrap()
                .with_nics(0)
                .is_err()
        );
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
    fn flags_and_overrides() {
        let m = MachineModel::from_flags(2, 3, Some(80.0), Some(8.0))
            .unwrap()
            .with_link(0, 4, Link::from_gbit_per_s(16.0, 1.0))
            .unwrap();
        assert_eq!(m.num_devices(), 6);
        assert_eq!(m.bandwidth(1, 2), 10e9);
        assert_eq!(m.bandwidth(1, 4), 1e9);
        assert_eq!(m.bandwidth(4, 0), 2e9);
        assert_eq!(m.latency(0, 4), 1e-6);
        assert!(MachineModel::from_flags(0, 4, None, None).is_err());
        assert!(MachineModel::from_flags(1, 4, Some(0.0), None).is_err());
        let e = m
            .clone()
            .with_link(0, 6, Link::from_gbit_per_s(1.0, 0.0))
            .unwrap_err();
        assert!(e.to_string().contains("devices 0..6"), "{e}");
    }

    #[test]
    fn runtime_costs_are_validated() {
        let m = MachineModel::preset("local-cpu:4").unwrap();
        assert_eq!(m.runtime_costs(), None);
        let costs = RuntimeCosts {
            dispatch_s: 50e-6,
            runtime_cpu_s: 0.0,
            fold_bytes_per_s: 4e9,
            update_bytes_per_s: 2e9,
            copy_bytes_per_s: 5e9,
            dispatch_bins_s: None,
            actor_threads: 2,
        };
        let m = m.with_runtime_costs(costs).unwrap();
        assert_eq!(m.runtime_costs(), Some(&costs));
        assert!(m.to_string().contains("dispatch 50.0 us"), "{m}");
        let e = m
            .clone()
            .with_runtime_costs(RuntimeCosts {
                fold_bytes_per_s: 0.0,
                ..costs
            })
            .unwrap_err();
        assert!(e.to_string().contains("fold_bytes_per_s must be"), "{e}");
        assert!(
            m.clone()
                .with_runtime_costs(RuntimeCosts {
                    dispatch_s: -1.0,
                    ..costs
                })
                .is_err()
        );
        let e = m
            .with_runtime_costs(RuntimeCosts {
                dispatch_bins_s: Some([f64::NAN; DISPATCH_BINS]),
                ..costs
            })
            .unwrap_err();
        assert!(e.to_string().contains("dispatch_bins_s must be"), "{e}");
        assert_eq!(fold_bytes(3, 100), 400);
        assert_eq!(update_bytes(100), 500);
    }

    #[test]
    fn dispatch_bins_are_means_of_equal_shares_of_the_sorted_delays() {
        assert_eq!(RuntimeCosts::dispatch_bins(&[1.0; DISPATCH_BINS - 1]), None);
        // 0..32 shuffled: each bin holds two neighbours
        let delays: Vec<f64> = (0..32).map(|i| ((i * 7) % 32) as f64).collect();
        let bins = RuntimeCosts::dispatch_bins(&delays).unwrap();
        assert_eq!(bins, std::array::from_fn(|b| 2.0 * b as f64 + 0.5));
        // uneven shares: bins of two or three, in order
        let delays: Vec<f64> = (0..37).map(|i| (i * i) as f64).collect();
        let bins = RuntimeCosts::dispatch_bins(&delays).unwrap();
        assert!(bins.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(
            bins[DISPATCH_BINS - 1],
            (34.0 * 34.0 + 35.0 * 35.0 + 36.0 * 36.0) / 3.0
        );
    }

    #[test]
    fn message_time_is_bytes_over_bandwidth_plus_latency() {
        let m = MachineModel::preset("paper:8").unwrap();
        let t = m.message_time(0, 4, 12.5e6);
        assert!((t - (1e-3 + 10e-6)).abs() < 1e-12, "{t}");
        assert_eq!(m.message_time(2, 2, 1e9), 0.0);
    }
}
