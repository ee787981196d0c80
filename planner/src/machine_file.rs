//! Machine files (TOML). Parsing is pure ([`parse_machine`]); [`load_machine`] only adds the file read.
//!
//! ```toml
//! name = "two-boxes"          # optional, defaults to the file name
//!
//! # Either a uniform machine ...
//! nodes = 2
//! devices_per_node = 4
//! # ... or one [[node]] table per node (not both):
//! # [[node]]
//! # devices = 4
//! # device = { kind = "v100", peak_gflops = 15700, memory_gb_per_s = 900 }   # optional
//!
//! [device]                    # spec of every device (of every node without its own `device`)
//! kind = "p100"               # the key measured profiles are stored under
//! peak_gflops = 9300          # f32 peak, GFLOP/s
//! memory_gb_per_s = 732       # GB/s
//! task_overhead_us = 10       # optional, default 10
//! memory_gib = 16             # optional: each device's own memory (none: they share the host's)
//!
//! [intra_node]                # link between two devices of one node, per direction
//! gbit_per_s = 160            # Gbit/s (10^9 bits per second)
//! latency_us = 5              # optional, default 0
//! topology = "pairs"          # optional: "pairs" (a link per device pair, NVLink all-to-all;
//!                             # the default), "switch" (one port per device that its messages
//!                             # share: PCIe switch, NVSwitch), "bridge" (one path every message
//!                             # of the node shares: PCIe through the host bridge)
//!
//! [inter_node]                # link between devices of different nodes (needed with 2+ nodes)
//! gbit_per_s = 100            # with `nics`: each NIC's bandwidth
//! latency_us = 10
//! nics = 1                    # optional: NICs per node that its devices' traffic to other nodes
//!                             # shares (device i of a node uses NIC i mod nics); omitted, a
//!                             # private link per device pair
//!
//! [[link]]                    # optional override for one device pair, both directions
//! between = [0, 5]
//! gbit_per_s = 25
//! latency_us = 2
//! ```
//!
//! Every error names the file, the line and column, and the field.

// Shared with the other files users write (hosts files): in `legion_ops::located`.
pub use legion_ops::located::{Number, key_at, line_column};

use crate::machine::{
    DeviceSpec, IntraTopology, Link, MAX_DEVICES, MachineError, MachineModel, NodeSpec,
};
use crate::machine_presets::PRESETS;
use serde::Deserialize;
use std::ops::Range;
use std::path::Path;
use toml::Spanned;

/// A machine from a `--machine` argument: a preset name ([`crate::machine_presets::PRESETS`]) or the path of
/// a machine file.
pub fn resolve_machine(spec: &str) -> Result<MachineModel, MachineError> {
    let path = Path::new(spec);
    let counted_preset = [
        "paper:",
        "paper-pairs:",
        "dgx-h100:",
        "local-cpu:",
        "one-gpu:",
    ]
    .iter()
    .any(|prefix| spec.starts_with(prefix));
    if PRESETS.contains(&spec) || counted_preset || !path.exists() {
        return MachineModel::preset(spec).map_err(|e| match e {
            MachineError::UnknownPreset { name, known } => MachineError::UnknownPreset {
                name,
                known: format!("{known}; nor is it an existing machine file"),
            },
            other => other,
        });
    }
    load_machine(path)
}

/// Reads and parses a machine file.
pub fn load_machine(path: &Path) -> Result<MachineModel, MachineError> {
    let text = std::fs::read_to_string(path).map_err(|e| MachineError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let default_name = path.file_stem().map_or_else(
        || "machine".to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    parse_machine(&text, &path.display().to_string(), &default_name)
}

/// Parses machine-file text. `file` prefixes every error; `default_name` names an unnamed machine.
pub fn parse_machine(
    text: &str,
    file: &str,
    default_name: &str,
) -> Result<MachineModel, MachineError> {
    let located = |span: Option<Range<usize>>, field: &str, message: String| {
        let (line, column) = span.map_or((1, 1), |s| line_column(text, s.start));
        MachineError::File {
            file: file.to_string(),
            line,
            column,
            field: if field.is_empty() {
                String::new()
            } else {
                format!("{field}: ")
            },
            message,
        }
    };
    let doc: MachineDoc = toml::from_str(text).map_err(|e| {
        let field = e.span().map(|s| key_at(text, s.start)).unwrap_or_default();
        located(e.span(), &field, e.message().trim().to_string())
    })?;
    let at =
        |v: &dyn HasSpan, field: &str, message: String| located(Some(v.span()), field, message);

    let default_device = doc
        .device
        .as_ref()
        .map(|d| d.get_ref().to_spec("device"))
        .transpose()
        .map_err(|(span, field, m)| located(Some(span), &field, m))?;

    let mut nodes = Vec::new();
    match (&doc.node, &doc.nodes, &doc.devices_per_node) {
        (Some(list), None, None) => {
            if list.is_empty() {
                return Err(located(
                    None,
                    "node",
                    "at least one [[node]] is needed".into(),
                ));
            }
            for (i, node) in list.iter().enumerate() {
                let n = node.get_ref();
                let field = format!("node[{i}].devices");
                if *n.devices.get_ref() == 0 {
                    return Err(at(
                        &n.devices,
                        &field,
                        "a node needs at least 1 device".into(),
                    ));
                }
                let device = match (&n.device, &default_device) {
                    (Some(d), _) => d
                        .get_ref()
                        .to_spec(&format!("node[{i}].device"))
                        .map_err(|(span, field, m)| located(Some(span), &field, m))?,
                    (None, Some(d)) => d.clone(),
                    (None, None) => {
                        return Err(at(
                            node,
                            &format!("node[{i}].device"),
                            "no device spec: add [device] or a `device` to this node".into(),
                        ));
                    }
                };
                nodes.push(NodeSpec {
                    devices: *n.devices.get_ref(),
                    device,
                });
            }
        }
        (None, Some(count), Some(per_node)) => {
            if *count.get_ref() == 0 {
                return Err(at(count, "nodes", "must be at least 1".into()));
            }
            if *per_node.get_ref() == 0 {
                return Err(at(
                    per_node,
                    "devices_per_node",
                    "must be at least 1".into(),
                ));
            }
            let device = default_device.ok_or_else(|| {
                located(
                    None,
                    "device",
                    "missing [device] table (the devices' spec)".into(),
                )
            })?;
            // before a node is made for each
            let devices = count.get_ref().checked_mul(*per_node.get_ref());
            if devices.is_none_or(|d| d > MAX_DEVICES) {
                return Err(at(
                    count,
                    "nodes",
                    format!(
                        "{} nodes of {} devices is more than the {MAX_DEVICES} devices a machine \
                         may have",
                        count.get_ref(),
                        per_node.get_ref()
                    ),
                ));
            }
            for _ in 0..*count.get_ref() {
                nodes.push(NodeSpec {
                    devices: *per_node.get_ref(),
                    device: device.clone(),
                });
            }
        }
        (Some(list), _, _) => {
            let span = list.first().map(|n| n.span());
            return Err(located(
                span,
                "node",
                "give either [[node]] tables or `nodes` and `devices_per_node`, not both".into(),
            ));
        }
        (None, count, per_node) => {
            let (present, missing) = if count.is_some() {
                ("nodes", "devices_per_node")
            } else if per_node.is_some() {
                ("devices_per_node", "nodes")
            } else {
                ("", "nodes")
            };
            let message = if present.is_empty() {
                "describe the nodes: `nodes` and `devices_per_node`, or [[node]] tables".to_string()
            } else {
                format!("`{present}` needs `{missing}`")
            };
            return Err(located(None, missing, message));
        }
    }

    let intra = doc
        .intra_node
        .get_ref()
        .to_link("intra_node")
        .map_err(|(span, field, m)| located(Some(span), &field, m))?;
    let inter = match &doc.inter_node {
        Some(l) => l
            .get_ref()
            .to_link("inter_node")
            .map_err(|(span, field, m)| located(Some(span), &field, m))?,
        None if nodes.len() > 1 => {
            return Err(located(
                None,
                "inter_node",
                format!(
                    "missing [inter_node] table: the machine has {} nodes",
                    nodes.len()
                ),
            ));
        }
        None => intra,
    };
    let intra_doc = doc.intra_node.get_ref();
    if let Some(nics) = &intra_doc.nics {
        return Err(at(
            nics,
            "intra_node.nics",
            "NICs carry traffic between nodes: give `nics` in [inter_node]".into(),
        ));
    }
    let topology = match &intra_doc.topology {
        None => IntraTopology::Pairs,
        Some(name) => IntraTopology::NAMES
            .iter()
            .find(|(n, _)| n == name.get_ref())
            .map(|&(_, t)| t)
            .ok_or_else(|| {
                let known: Vec<&str> = IntraTopology::NAMES.iter().map(|(n, _)| *n).collect();
                at(
                    name,
                    "intra_node.topology",
                    format!(
                        "unknown topology '{}', expected one of {}",
                        name.get_ref(),
                        known.join(", ")
                    ),
                )
            })?,
    };
    let mut nics = None;
    if let Some(inter_doc) = &doc.inter_node {
        let inter_doc = inter_doc.get_ref();
        if let Some(t) = &inter_doc.topology {
            return Err(at(
                t,
                "inter_node.topology",
                "a topology describes one node: give it in [intra_node]; between nodes, `nics`"
                    .into(),
            ));
        }
        if let Some(n) = &inter_doc.nics {
            if !(1..=MAX_DEVICES).contains(n.get_ref()) {
                return Err(at(
                    n,
                    "inter_node.nics",
                    format!("must be in 1..={MAX_DEVICES}, got {}", n.get_ref()),
                ));
            }
            nics = Some(*n.get_ref());
        }
    }
    let name = doc.name.as_deref().unwrap_or(default_name);
    let mut machine = MachineModel::new(name, &nodes, intra, inter)
        .map_err(|e| located(None, "", e.to_string()))?
        .with_intra_topology(topology);
    if let Some(n) = nics {
        machine = machine
            .with_nics(n)
            .map_err(|e| located(None, "inter_node.nics", e.to_string()))?;
    }
    let devices = machine.num_devices();
    for (i, l) in doc.link.iter().enumerate() {
        let o = l.get_ref();
        let [a, b] = *o.between.get_ref();
        let field = format!("link[{i}].between");
        if a >= devices || b >= devices {
            return Err(at(
                &o.between,
                &field,
                format!("device out of range: the machine has devices 0..{devices}"),
            ));
        }
        if a == b {
            return Err(at(
                &o.between,
                &field,
                "a device needs no link to itself".into(),
            ));
        }
        let link = LinkDoc {
            gbit_per_s: o.gbit_per_s.clone(),
            latency_us: o.latency_us.clone(),
            topology: None,
            nics: None,
        }
        .to_link(&format!("link[{i}]"))
        .map_err(|(span, field, m)| located(Some(span), &field, m))?;
        machine = machine
            .with_link(a, b, link)
            .map_err(|e| at(l, &format!("link[{i}]"), e.to_string()))?;
    }
    Ok(machine)
}

trait HasSpan {
    fn span(&self) -> Range<usize>;
}

impl<T> HasSpan for Spanned<T> {
    fn span(&self) -> Range<usize> {
        Spanned::span(self)
    }
}

type FieldError = (Range<usize>, String, String);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineDoc {
    name: Option<String>,
    nodes: Option<Spanned<usize>>,
    devices_per_node: Option<Spanned<usize>>,
    device: Option<Spanned<DeviceDoc>>,
    node: Option<Vec<Spanned<NodeDoc>>>,
    intra_node: Spanned<LinkDoc>,
    inter_node: Option<Spanned<LinkDoc>>,
    #[serde(default)]
    link: Vec<Spanned<LinkOverrideDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceDoc {
    kind: Spanned<String>,
    peak_gflops: Spanned<Number>,
    memory_gb_per_s: Spanned<Number>,
    task_overhead_us: Option<Spanned<Number>>,
    memory_gib: Option<Spanned<Number>>,
}

impl DeviceDoc {
    fn to_spec(&self, path: &str) -> Result<DeviceSpec, FieldError> {
        if self.kind.get_ref().is_empty() {
            return Err((
                self.kind.span(),
                format!("{path}.kind"),
                "must not be empty".into(),
            ));
        }
        let positive = |v: &Spanned<Number>, field: &str| {
            let x = v.get_ref().0;
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err((
                    v.span(),
                    format!("{path}.{field}"),
                    format!("must be a positive number, got {x}"),
                ))
            }
        };
        let overhead = match &self.task_overhead_us {
            Some(v) if !(v.get_ref().0.is_finite() && v.get_ref().0 >= 0.0) => {
                return Err((
                    v.span(),
                    format!("{path}.task_overhead_us"),
                    format!("must be zero or positive, got {}", v.get_ref().0),
                ));
            }
            Some(v) => v.get_ref().0,
            None => DeviceSpec::p100().task_overhead_us,
        };
        Ok(DeviceSpec {
            kind: self.kind.get_ref().clone(),
            peak_gflops: positive(&self.peak_gflops, "peak_gflops")?,
            memory_gb_per_s: positive(&self.memory_gb_per_s, "memory_gb_per_s")?,
            task_overhead_us: overhead,
            memory_gib: self
                .memory_gib
                .as_ref()
                .map(|m| positive(m, "memory_gib"))
                .transpose()?,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeDoc {
    devices: Spanned<usize>,
    device: Option<Spanned<DeviceDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkDoc {
    gbit_per_s: Spanned<Number>,
    latency_us: Option<Spanned<Number>>,
    /// `[intra_node]` only.
    topology: Option<Spanned<String>>,
    /// `[inter_node]` only.
    nics: Option<Spanned<usize>>,
}

impl LinkDoc {
    fn to_link(&self, path: &str) -> Result<Link, FieldError> {
        let gbit = self.gbit_per_s.get_ref().0;
        if !(gbit.is_finite() && gbit > 0.0) {
            return Err((
                self.gbit_per_s.span(),
                format!("{path}.gbit_per_s"),
                format!("must be a positive number, got {gbit}"),
            ));
        }
        let latency = match &self.latency_us {
            Some(v) if !(v.get_ref().0.is_finite() && v.get_ref().0 >= 0.0) => {
                return Err((
                    v.span(),
                    format!("{path}.latency_us"),
                    format!("must be zero or positive, got {}", v.get_ref().0),
                ));
            }
            Some(v) => v.get_ref().0,
            None => 0.0,
        };
        Ok(Link::from_gbit_per_s(gbit, latency))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkOverrideDoc {
    between: Spanned<[usize; 2]>,
    gbit_per_s: Spanned<Number>,
    latency_us: Option<Spanned<Number>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_BOXES: &str = r#"
name = "two-boxes"
nodes = 2
devices_per_node = 4

[device]
kind = "p100"
peak_gflops = 9300
memory_gb_per_s = 732.0

[intra_node]
gbit_per_s = 160
latency_us = 5

[inter_node]
gbit_per_s = 100
latency_us = 10

[[link]]
between = [0, 5]
gbit_per_s = 25
latency_us = 2
"#;

    fn err(text: &str) -> String {
        parse_machine(text, "m.toml", "m").unwrap_err().to_string()
    }

    #[test]
    fn parses_the_documented_example() {
        let m = parse_machine(TWO_BOXES, "m.toml", "m").unwrap();
        assert_eq!(m.name(), "two-boxes");
        assert_eq!((m.num_devices(), m.num_nodes()), (8, 2));
        assert_eq!(m.bandwidth(1, 2), 20e9);
        assert_eq!(m.bandwidth(1, 6), 12.5e9);
        assert_eq!(m.bandwidth(5, 0), 25e9 / 8.0);
        assert_eq!(m.latency(0, 5), 2e-6);
        assert_eq!(m.device(7).peak_gflops, 9300.0);
        assert_eq!(m.device(7).task_overhead_us, 10.0);
    }

    #[test]
    fn node_tables_with_their_own_devices() {
        let text = r#"
[device]
kind = "p100"
peak_gflops = 9300
memory_gb_per_s = 732
[[node]]
devices = 2
[[node]]
devices = 1
device = { kind = "v100", peak_gflops = 15700, memory_gb_per_s = 900 }
[intra_node]
gbit_per_s = 160
[inter_node]
gbit_per_s = 100
"#;
        let m = parse_machine(text, "m.toml", "fallback").unwrap();
        assert_eq!(m.name(), "fallback");
        assert_eq!(m.num_devices(), 3);
        assert_eq!(m.device(2).kind, "v100");
        assert_eq!(m.device(1).kind, "p100");
        assert_ne!(m.spec_index(1), m.spec_index(2));
    }

    #[test]
    fn syntax_and_type_errors_are_located() {
        let e = err("nodes = 2\ndevices_per_node = \"four\"\n");
        assert!(e.starts_with("m.toml:2:20: devices_per_node: "), "{e}");
        let e = err(&TWO_BOXES.replace("peak_gflops = 9300", "peak_glops = 9300"));
        assert!(
            e.starts_with("m.toml:8:1: peak_glops: ") && e.contains("unknown field"),
            "{e}"
        );
        let e = err("nodes = [\n");
        assert!(e.starts_with("m.toml:"), "{e}");
    }

    #[test]
    fn semantic_errors_name_the_field() {
        let e = err(&TWO_BOXES.replace("between = [0, 5]", "between = [0, 8]"));
        assert!(
            e.starts_with("m.toml:20:11: link[0].between: device out of range"),
            "{e}"
        );
        let e = err(&TWO_BOXES.replace("gbit_per_s = 100", "gbit_per_s = 0"));
        assert!(
            e.starts_with("m.toml:16:14: inter_node.gbit_per_s: must be a positive"),
            "{e}"
        );
        let e = err(&TWO_BOXES.replace("memory_gb_per_s = 732.0", "memory_gb_per_s = -1"));
        assert!(
            e.contains(":9:19: device.memory_gb_per_s: must be a positive"),
            "{e}"
        );
        let e = err(&TWO_BOXES.replace("devices_per_node = 4", "devices_per_node = 0"));
        assert!(
            e.starts_with("m.toml:4:20: devices_per_node: must be at least 1"),
            "{e}"
        );
        let e = err(&TWO_BOXES.replace("[inter_node]", "[unused]"));
        assert!(e.contains("unknown field `unused`"), "{e}");
        let e = err("nodes = 2\n[intra_node]\ngbit_per_s = 1\n");
        assert!(
            e.contains("devices_per_node: `nodes` needs `devices_per_node`"),
            "{e}"
        );
    }

    #[test]
    fn shared_nics_and_intra_topologies() {
        let text = TWO_BOXES.replace("latency_us = 10\n", "latency_us = 10\nnics = 2\n");
        let text = text.replacen(
            "latency_us = 5\n",
            "latency_us = 5\ntopology = \"switch\"\n",
            1,
        );
        let m = parse_machine(&text, "m.toml", "m").unwrap();
        assert_eq!(m.nics_per_node(), Some(2));
        assert_eq!(m.intra_topology(), IntraTopology::Switch);
        // device 1 of node 0 uses its NIC 1; device 4 is the first of node 1 (NIC 2 overall)
        assert_eq!(m.route(1, 4).unwrap().lanes, Some((2, 5)));
        let bad = text.replace("\"switch\"", "\"ring\"");
        let e = err(&bad);
        assert!(
            e.contains("intra_node.topology: unknown topology 'ring', expected one of pairs, switch, bridge"),
            "{e}"
        );
        assert!(e.starts_with("m.toml:"), "{e}");
        let e = err(&text.replace("nics = 2", "nics = 0"));
        assert!(e.contains("inter_node.nics: must be in 1..="), "{e}");
        let e = err(&text.replace("nics = 2\n", "topology = \"bridge\"\n"));
        assert!(
            e.contains("inter_node.topology: a topology describes one node"),
            "{e}"
        );
        let e = err(&text.replacen("topology = \"switch\"", "nics = 1", 1));
        assert!(
            e.contains("intra_node.nics: NICs carry traffic between nodes"),
            "{e}"
        );
    }

    /// The example machine file describes the `dgx-h100` preset's network with TF32 compute.
    #[test]
    fn the_tf32_example_is_the_h100_preset_with_faster_devices() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/machines/dgx-h100-tf32.toml");
        let file = load_machine(&path).unwrap();
        let preset = MachineModel::preset("dgx-h100").unwrap();
        assert_eq!(file.num_devices(), preset.num_devices());
        for (a, b) in [(0, 1), (3, 11), (9, 2)] {
            assert_eq!(file.route(a, b), preset.route(a, b), "{a} -> {b}");
        }
        assert!(file.device(0).peak_gflops > 7.0 * preset.device(0).peak_gflops);
    }

    #[test]
    fn presets_and_files_resolve() {
        assert_eq!(resolve_machine("paper:8").unwrap().num_devices(), 8);
        let e = resolve_machine("papr").unwrap_err().to_string();
        assert!(
            e.contains("unknown machine preset 'papr'") && e.contains("machine file"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(&path, TWO_BOXES).unwrap();
        assert_eq!(
            resolve_machine(path.to_str().unwrap())
                .unwrap()
                .num_devices(),
            8
        );
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        std::fs::write(&path, TWO_BOXES.replace("name = \"two-boxes\"\n", "")).unwrap();
        let m = load_machine(&path).unwrap();
        assert_eq!(m.name(), "cluster");
        let e = load_machine(&dir.path().join("missing.toml")).unwrap_err();
        assert!(e.to_string().contains("missing.toml"), "{e}");
    }
}
