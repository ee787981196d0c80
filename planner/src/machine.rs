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
//!
//! This file holds the model and its topology. The named machines (`paper`, `dgx-h100`, …) and
//! the devices they are made of are in [`crate::machine_presets`]; what the runtime's own work
//! costs, which a profiled machine carries for the simulator, is in [`crate::runtime_costs`].

use crate::runtime_costs::RuntimeCosts;
use legion_ops::Precision;
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
    /// The arithmetic the devices train in ([`MachineModel::with_precision`]): the element size
    /// of the activations and gradients that t_x moves and the roofline streams.
    precision: Precision,
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
            precision: Precision::Fp32,
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

    /// The same machine whose devices are of kind `kind` (the key profiles are looked up under).
    pub fn with_device_kind(mut self, kind: &str) -> MachineModel {
        for spec in &mut self.specs {
            spec.kind = kind.to_string();
        }
        self
    }

    /// The same machine training in `precision` (`plan --precision`, `train --precision`): every
    /// device's kind gains the precision's suffix (`h100` → `h100-bf16`: the key its profiles
    /// are stored under) and its peak the precision's tensor-core speed-up
    /// ([`DeviceSpec::precision_speedup`]); activations and their gradients take
    /// [`Precision::activation_bytes`] per element in t_x, the roofline and the memory check,
    /// while parameter synchronisation moves fp32 gradients and weights in every precision.
    /// Meant for a machine described in fp32 (a preset, or a file whose kinds name no
    /// precision); fp32 changes nothing.
    pub fn with_precision(mut self, precision: Precision) -> MachineModel {
        for spec in &mut self.specs {
            spec.peak_gflops *= DeviceSpec::precision_speedup(&spec.kind, precision);
            spec.kind = precision.device_kind(&spec.kind);
        }
        self.precision = precision;
        self
    }

    /// The arithmetic the devices train in ([`MachineModel::with_precision`]; fp32 by default).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Bytes of one activation or activation-gradient element as it moves between devices.
    pub fn activation_bytes(&self) -> u64 {
        self.precision.activation_bytes()
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

    /// The devices by node, as parameter sync routes through them ([`legion_ops::partition::relays`]).
    pub fn nodes(&self) -> legion_ops::partition::Nodes {
        legion_ops::partition::Nodes::of_sizes(self.node_of.chunk_by(|a, b| a == b).map(<[_]>::len))
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
    /// Where every link depends only on whether its two devices share a node: nodes of one
    /// power-of-two size, numbered in order, and no per-pair overrides. Then the node size and the
    /// intra- and inter-node links (both directions alike); `None` otherwise.
    pub(crate) fn uniform_nodes(&self) -> Option<(usize, Link, Link)> {
        let devices = self.num_devices();
        let nodes = self.num_nodes();
        if !self.link_overrides().is_empty() || nodes == 0 || !devices.is_multiple_of(nodes) {
            return None;
        }
        let node_size = devices / nodes;
        let equal_nodes = (0..devices).all(|d| self.node_of(d) == d / node_size);
        (node_size.is_power_of_two() && equal_nodes).then_some((
            node_size,
            self.intra_node_link(),
            self.inter_node_link(),
        ))
    }

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
        if self.precision != Precision::Fp32 {
            write!(f, ", computing in {}", self.precision)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_precision_renames_the_devices_and_scales_only_tensor_core_peaks() {
        let h100 = MachineModel::preset("dgx-h100").unwrap();
        let bf16 = h100.clone().with_precision(Precision::Bf16);
        assert_eq!(bf16.precision(), Precision::Bf16);
        assert_eq!(bf16.activation_bytes(), 2);
        assert_eq!(bf16.device(0).kind, "h100-bf16");
        let ratio = bf16.device(0).peak_gflops / h100.device(0).peak_gflops;
        assert!((ratio - 989.4 / 67.0).abs() < 1e-12, "{ratio}");
        let tf32 = h100.clone().with_precision(Precision::Tf32);
        assert_eq!(tf32.device(0).kind, "h100-tf32");
        assert_eq!(tf32.activation_bytes(), 4);
        assert!(tf32.to_string().ends_with(", computing in tf32"), "{tf32}");
        // fp32 changes nothing, its description included
        let fp32 = h100.clone().with_precision(Precision::Fp32);
        assert_eq!(fp32, h100);
        assert_eq!(fp32.to_string(), h100.to_string());
        // a P100 and a CPU have no bf16 tensor cores: renamed, their peak kept
        for name in ["paper:4", "local-cpu:2"] {
            let m = MachineModel::preset(name).unwrap();
            let b = m.clone().with_precision(Precision::Bf16);
            assert_eq!(b.device(0).peak_gflops, m.device(0).peak_gflops, "{name}");
            assert_eq!(b.device(0).kind, format!("{}-bf16", m.device(0).kind));
        }
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
    fn message_time_is_bytes_over_bandwidth_plus_latency() {
        let m = MachineModel::preset("paper:8").unwrap();
        let t = m.message_time(0, 4, 12.5e6);
        assert!((t - (1e-3 + 10e-6)).abs() < 1e-12, "{t}");
        assert_eq!(m.message_time(2, 2, 1e9), 0.0);
    }
}
