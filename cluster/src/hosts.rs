//! The cluster description users write: which hosts run a worker, how many devices each has, how
//! they are reached, and (optionally) what the network between them is like. Parsing is pure
//! ([`Hosts::parse`]); [`Hosts::load`] only adds the file read.
//!
//! Two formats are accepted. The native one is TOML (`hosts.toml`):
//!
//! ```toml
//! [defaults]             # optional, cluster-wide
//! port = 7400            # worker QUIC port (default 7400)
//! devices = 1            # devices per host (default 1; on a "cuda" host, its GPU count, which
//!                        # `up` learns from the worker and records in the state directory)
//! device = "cpu"         # "cuda": the worker runs its devices on the host's GPUs (spread over
//!                        # them, a stream each; `up` fails naming what is missing where there
//!                        # is no usable GPU), priced as H100s; "cpu" (default): on its cores;
//!                        # "p100": on its cores, priced as P100s (to plan for the paper's GPUs)
//! binary = "/opt/legion-rs/bin/legion-rs"   # the legion-rs binary on the hosts (default: the
//!                        # path of the one running `up`)
//! precision = "fp32"     # what a job on these hosts computes in: "fp32" (default), "tf32" or
//!                        # "bf16", as `train --precision` (which must agree)
//!
//! [[host]]
//! name = "node0"         # optional; default: the address ("address:port" if hosts share it)
//! address = "127.0.0.1"  # IP or DNS name the worker listens on and is reached at
//! devices = 2            # optional, overrides the default (and so can port and device)
//! port = 7401
//! ssh = "user@node0"     # optional ssh target; without it a loopback host is spawned locally
//! binary = "/usr/local/bin/legion-rs"   # optional, overrides the default
//! run_with = ["ip", "netns", "exec", "ns0"]   # optional, instead of ssh: start the worker on
//!                        # this machine under this command prefix (a network namespace, a
//!                        # container: `docker exec NAME`)
//!
//! [[host]]
//! address = "10.0.0.2"
//! ssh = "ubuntu@10.0.0.2"
//!
//! [[link]]               # optional override of the network between two hosts, both directions
//! from = "node0"         # host names
//! to = "10.0.0.2"
//! gbps = 10.0            # Gbit/s
//! latency_us = 20.0      # optional, default 50
//! ```
//!
//! A TOML file may instead describe the nodes of a Slurm allocation, found inside it when
//! `legion-rs up` runs there (see `crate::slurm`); it has a `[slurm]` table, with the keys of
//! `[defaults]` for every node, and no `[defaults]`, `[[host]]` or `[[link]]`:
//!
//! ```toml
//! [slurm]                # the allocation's nodes, one worker each, started by `srun`
//! port = 7400            # optional, as in [defaults]
//! devices = 2            # optional; default: each node's GPUs where the job has GPUs, else
//!                        # its CPUs in the job
//! device = "cuda"        # optional; default: "cuda" where the job has GPUs, else "cpu"
//! binary = "/shared/bin/legion-rs"   # optional: the binary every node runs
//! ```
//!
//! The other is the MPI / DeepSpeed hostfile, one `hostname slots=N` line per host (`slots` is the
//! device count, default 1), `#` comments and blank lines. It is chosen for a file not named
//! `*.toml` whose first line of content does not look like TOML (a `[table]` or `key = value`).
//! A hostfile host listens on the default port and, unless it is loopback, is reached by
//! `ssh hostname`, as MPI launchers do.
//!
//! Every error names the file, the line and column, and the field, and says what was expected:
//! `hosts.toml:7:11: host[1].devices: expected an integer in 1..=4096, got 0`.

use legion_ops::Precision;
use legion_ops::located::{Number, key_at, line_column};
use serde::Deserialize;
use std::collections::HashMap;
use std::net::IpAddr;
use std::ops::Range;
use std::path::Path;
use toml::Spanned;

/// The worker port of a host that does not name one.
pub const DEFAULT_PORT: u16 = 7400;
/// The network between hosts unless a `[[link]]` says otherwise: commodity Ethernet.
pub const DEFAULT_INTER_HOST_GBPS: f64 = 10.0;
/// The latency of that network, and of a `[[link]]` without `latency_us`.
pub const DEFAULT_INTER_HOST_LATENCY_US: f64 = 50.0;
/// The most devices a cluster may have: the planner's bound on a machine
/// (`legion_planner::machine::MAX_DEVICES`), so that every valid hosts file can be planned for.
pub const MAX_DEVICES: usize = 4096;
/// Device kinds a host may declare: those the planner has a device spec for (`legion::machine` maps
/// them). Only [`GPU_KIND`] runs on GPUs; the others run on the host's cores.
pub const DEVICE_KINDS: &[&str] = &["cpu", "cuda", "p100"];

/// The device kind whose worker runs its devices on the host's GPUs.
pub const GPU_KIND: &str = "cuda";

/// A hosts file: hosts listed in it, or the nodes of the Slurm allocation it is used in.
#[derive(Clone, Debug, PartialEq)]
pub enum ClusterFile {
    Hosts(Hosts),
    /// A `[slurm]` table: the nodes come from the allocation (`crate::slurm`).
    Slurm(SlurmNodes),
}

/// How every node of a Slurm allocation runs its worker: a `[slurm]` table, or `up --slurm`
/// (all defaults). `None`: found in the allocation (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlurmNodes {
    /// The workers' QUIC port; `None`: [`DEFAULT_PORT`].
    pub port: Option<u16>,
    pub devices: Option<usize>,
    /// One of [`DEVICE_KINDS`].
    pub device: Option<String>,
    pub binary: Option<String>,
    /// What a job on the allocation computes in, if the table says.
    pub precision: Option<Precision>,
}

impl ClusterFile {
    /// Reads and parses a hosts file in either format, `[slurm]` included.
    pub fn load(path: impl AsRef<Path>) -> Result<ClusterFile, HostsError> {
        let path = path.as_ref();
        let text = read(path)?;
        ClusterFile::parse(&text, &path.display().to_string())
    }

    /// Parses hosts-file text, `[slurm]` included (see [`Hosts::parse`]).
    pub fn parse(text: &str, file: &str) -> Result<ClusterFile, HostsError> {
        if !(file.ends_with(".toml") || looks_like_toml(text)) {
            return Hosts::parse_hostfile(text, file).map(ClusterFile::Hosts);
        }
        let src = Source { text, file };
        let doc = src.toml_doc()?;
        let Some(slurm) = doc.slurm else {
            return Hosts::parse_toml(text, file).map(ClusterFile::Hosts);
        };
        // Hosts and links name hosts, which are not known before the allocation is; defaults
        // would be a second place for what `[slurm]` says.
        let beside = [
            (doc.defaults.map(|d| d.span().start), "defaults"),
            (doc.host.first().map(|h| h.span().start), "host"),
            (doc.link.first().map(|l| l.span().start), "link"),
        ];
        if let Some((Some(at), table)) = beside.into_iter().find(|(at, _)| at.is_some()) {
            return Err(src.at(
                at,
                table,
                "expected no [defaults], [[host]] or [[link]] beside [slurm] (the hosts are the                  allocation's nodes; [slurm] takes the keys of [defaults])",
            ));
        }
        let slurm = slurm.into_inner();
        Ok(ClusterFile::Slurm(SlurmNodes {
            port: match &slurm.port {
                Some(p) => Some(src.port(p, "slurm.port")?),
                None => None,
            },
            devices: match &slurm.devices {
                Some(d) => Some(src.count(d, "slurm.devices")?),
                None => None,
            },
            device: match &slurm.device {
                Some(k) => Some(src.device_kind(k, "slurm.device")?),
                None => None,
            },
            binary: match &slurm.binary {
                Some(b) => Some(src.binary(b, "slurm.binary")?),
                None => None,
            },
            precision: match &slurm.precision {
                Some(p) => Some(src.precision(p, "slurm.precision")?),
                None => None,
            },
        }))
    }
}

fn read(path: &Path) -> Result<String, HostsError> {
    std::fs::read_to_string(path).map_err(|e| HostsError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// One host: a worker process owning `devices` devices.
#[derive(Clone, Debug, PartialEq)]
pub struct Host {
    pub name: String,
    /// IP address or DNS name the worker listens on and the others reach it at.
    pub address: String,
    /// The worker's QUIC port.
    pub port: u16,
    pub devices: usize,
    /// Whether `devices` is the host's GPU count, which its worker finds (a [`GPU_KIND`] host
    /// whose file gives no count): `up` starts the worker with `--devices gpus` and records the
    /// count, and [`Hosts::with_gpu_counts`] fills it in; until then `devices` is 1.
    pub devices_from_gpus: bool,
    /// One of [`DEVICE_KINDS`].
    pub device_kind: String,
    /// `user@host` (or any `ssh` destination) the launcher starts the worker through.
    pub ssh: Option<String>,
    /// A command prefix the launcher starts the worker under, on this machine (empty: none).
    pub run_with: Vec<String>,
    /// The `legion-rs` binary to start there; `None`: the path of the running one.
    pub binary: Option<String>,
}

impl Host {
    /// Whether the launcher spawns this worker as a child process rather than over ssh: a loopback
    /// address (or `localhost`) or a `run_with` prefix, and no ssh target. A loopback host *with* an ssh target is still
    /// started over ssh (a container or another user on this machine).
    pub fn is_local(&self) -> bool {
        self.ssh.is_none() && (is_loopback(&self.address) || !self.run_with.is_empty())
    }

    /// `address:port`, bracketing IPv6 addresses, as a socket address or log line wants it.
    pub fn endpoint(&self) -> String {
        match self.address.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => format!("[{}]:{}", self.address, self.port),
            _ => format!("{}:{}", self.address, self.port),
        }
    }
}

/// A `[[link]]` override: the network between hosts `from` and `to` (indices into
/// [`Hosts::hosts`]), both directions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLink {
    pub from: usize,
    pub to: usize,
    pub gbps: f64,
    pub latency_us: f64,
}

/// A validated cluster description: at least one host, unique names and endpoints, links between
/// distinct existing hosts.
#[derive(Clone, Debug, PartialEq)]
pub struct Hosts {
    /// In file order, which is also the order of their global device ids.
    pub hosts: Vec<Host>,
    pub links: Vec<HostLink>,
    /// `[defaults] precision`: what a job on these hosts computes in, if the file says.
    pub precision: Option<Precision>,
}

/// What is wrong with a hosts file.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// A located error; `field` is empty when the error is not about one field.
    #[error("{file}:{line}:{column}: {}{message}", field_prefix(.field))]
    File {
        file: String,
        line: usize,
        column: usize,
        field: String,
        message: String,
    },
}

fn field_prefix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!("{field}: ")
    }
}

impl Hosts {
    /// Reads and parses a hosts file in either format (see the module docs).
    pub fn load(path: impl AsRef<Path>) -> Result<Hosts, HostsError> {
        let path = path.as_ref();
        let text = read(path)?;
        Hosts::parse(&text, &path.display().to_string())
    }

    /// Parses hosts-file text; `file` prefixes every error and, by its extension, can settle the
    /// format.
    pub fn parse(text: &str, file: &str) -> Result<Hosts, HostsError> {
        if file.ends_with(".toml") || looks_like_toml(text) {
            Hosts::parse_toml(text, file)
        } else {
            Hosts::parse_hostfile(text, file)
        }
    }

    /// Parses the TOML format. A `[slurm]` file is an error here: its hosts are known only
    /// inside the allocation ([`ClusterFile::parse`] reads it).
    pub fn parse_toml(text: &str, file: &str) -> Result<Hosts, HostsError> {
        let src = Source { text, file };
        let doc = src.toml_doc()?;
        if let Some(slurm) = &doc.slurm {
            return Err(src.at(
                slurm.span().start,
                "slurm",
                "this file describes the nodes of a Slurm allocation, known only inside it: \
                 give it to `legion-rs up`, `status`, `down` or `train --cluster` there",
            ));
        }
        let defaults =
            src.host_defaults(doc.defaults.map(Spanned::into_inner).unwrap_or_default())?;
        if doc.host.is_empty() {
            return Err(src.at(0, "host", "expected at least one [[host]] table (or [slurm] for the nodes of a Slurm allocation)",
            ));
        }
        let mut hosts = Vec::with_capacity(doc.host.len());
        let mut spans = Vec::with_capacity(doc.host.len());
        for (i, table) in doc.host.iter().enumerate() {
            let (host, at) = src.host(i, table, &defaults)?;
            hosts.push(host);
            spans.push(at);
        }
        src.check_unique_endpoints(&hosts, &spans)?;
        name_unnamed(&mut hosts);
        let names = src.unique_names(&hosts, &spans)?;
        let mut links: Vec<HostLink> = Vec::with_capacity(doc.link.len());
        for (i, table) in doc.link.iter().enumerate() {
            let link = src.link(i, table, &hosts, &names, &links)?;
            links.push(link);
        }
        src.within_device_limit(Hosts {
            hosts,
            links,
            precision: defaults.precision,
        })
    }

    /// Parses the MPI / DeepSpeed hostfile format.
    pub fn parse_hostfile(text: &str, file: &str) -> Result<Hosts, HostsError> {
        let src = Source { text, file };
        let mut hosts: Vec<Host> = Vec::new();
        let mut first_line: HashMap<String, usize> = HashMap::new();
        let mut line_start = 0;
        for (index, raw) in text.split_inclusive('\n').enumerate() {
            let start = line_start;
            line_start += raw.len();
            let content = raw.split('#').next().unwrap_or_default();
            let mut tokens = tokens(content).map(|(at, token)| (start + at, token));
            let Some((host_at, hostname)) = tokens.next() else {
                continue;
            };
            if let Err(m) = check_address(hostname) {
                return Err(src.at(host_at, "host", &m));
            }
            let mut slots = None;
            for (at, token) in tokens {
                match token.split_once('=') {
                    Some(("slots", _)) if slots.is_some() => {
                        return Err(src.at(at, "slots", "expected `slots` once per line"));
                    }
                    Some(("slots", value)) => {
                        let value_at = at + "slots=".len();
                        slots = Some(match value.parse::<usize>() {
                            Ok(n) if (1..=MAX_DEVICES).contains(&n) => n,
                            _ => {
                                return Err(src.at(
                                    value_at,
                                    "slots",
                                    &format!(
                                        "expected an integer in 1..={MAX_DEVICES}, got {value}"
                                    ),
                                ));
                            }
                        });
                    }
                    _ => {
                        return Err(src.at(
                            at,
                            "",
                            &format!("expected `slots=N` after the host name, got `{token}`"),
                        ));
                    }
                }
            }
            // A hostfile cannot give ports, so a host listed twice would be two workers on one
            // endpoint (MPI would add the slots; an explicit error is less surprising).
            if let Some(line) = first_line.insert(hostname.to_string(), index + 1) {
                return Err(src.at(
                    host_at,
                    "host",
                    &format!("expected each host once, but {hostname} is already on line {line}"),
                ));
            }
            hosts.push(Host {
                name: hostname.to_string(),
                address: hostname.to_string(),
                port: DEFAULT_PORT,
                devices: slots.unwrap_or(1),
                devices_from_gpus: false,
                device_kind: "cpu".to_string(),
                ssh: (!is_loopback(hostname)).then(|| hostname.to_string()),
                run_with: Vec::new(),
                binary: None,
            });
        }
        if hosts.is_empty() {
            return Err(src.at(0, "", "expected at least one `hostname slots=N` line"));
        }
        src.within_device_limit(Hosts {
            hosts,
            links: Vec::new(),
            precision: None,
        })
    }

    /// The hosts whose device count is their GPU count (see [`Host::devices_from_gpus`]) with the
    /// counts `up` recorded, by host name. Names a host `up` has no count for.
    pub fn with_gpu_counts(mut self, counts: &HashMap<String, usize>) -> Result<Hosts, String> {
        for h in &mut self.hosts {
            if !h.devices_from_gpus {
                continue;
            }
            match counts.get(&h.name) {
                Some(&n) if (1..=MAX_DEVICES).contains(&n) => h.devices = n,
                _ => {
                    return Err(format!(
                        "host {}: device = \"{GPU_KIND}\" without `devices` runs one device per \
                         GPU, and `legion-rs up` has not recorded how many GPUs it has; run \
                         `up` first, or give `devices`",
                        h.name
                    ));
                }
            }
        }
        self.check_device_total()?;
        Ok(self)
    }

    /// The hosts' devices together are within what the planner takes: each host's count is,
    /// but many hosts could add up past it (or past `usize`).
    fn check_device_total(&self) -> Result<(), String> {
        let total = self
            .hosts
            .iter()
            .try_fold(0usize, |acc, h| acc.checked_add(h.devices));
        match total {
            Some(n) if n <= MAX_DEVICES => Ok(()),
            _ => Err(format!(
                "expected at most {MAX_DEVICES} devices in all, but the {} hosts have more",
                self.hosts.len()
            )),
        }
    }

    /// These hosts without host `lost` (its links gone, the others' renumbered): the cluster a
    /// job re-plans on when that worker is lost.
    pub fn without(&self, lost: usize) -> Hosts {
        let renumber = |h: usize| if h > lost { h - 1 } else { h };
        Hosts {
            hosts: (self.hosts.iter().enumerate())
                .filter(|&(i, _)| i != lost)
                .map(|(_, h)| h.clone())
                .collect(),
            links: (self.links.iter())
                .filter(|l| l.from != lost && l.to != lost)
                .map(|l| HostLink {
                    from: renumber(l.from),
                    to: renumber(l.to),
                    ..*l
                })
                .collect(),
            precision: self.precision,
        }
    }

    pub fn num_devices(&self) -> usize {
        self.hosts.iter().map(|h| h.devices).sum()
    }

    /// The hosts as nodes of their devices, in file order.
    pub fn nodes(&self) -> legion_ops::partition::Nodes {
        legion_ops::partition::Nodes::of_sizes(self.hosts.iter().map(|h| h.devices))
    }

    /// Global device ids of each host, in file order: host 0 has `0..d0`, host 1 `d0..d0+d1`, ...
    /// (the planner numbers devices node by node, and each host is one node).
    pub fn device_ranges(&self) -> Vec<Range<usize>> {
        let mut next = 0;
        self.hosts
            .iter()
            .map(|h| {
                next += h.devices;
                next - h.devices..next
            })
            .collect()
    }
}

fn is_loopback(address: &str) -> bool {
    address.eq_ignore_ascii_case("localhost")
        || address.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// An IP address or a DNS name (letters, digits and hyphens in dot-separated labels).
fn check_address(address: &str) -> Result<(), String> {
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    let name = address.strip_suffix('.').unwrap_or(address);
    if address.parse::<IpAddr>().is_ok() || (name.len() <= 253 && name.split('.').all(label_ok)) {
        Ok(())
    } else {
        let hint = if address.contains(':') && address.parse::<IpAddr>().is_err() {
            " (a port goes in `port`)"
        } else {
            ""
        };
        Err(format!(
            "expected an IP address or DNS name, got \"{address}\"{hint}"
        ))
    }
}

/// `ssh` is handed to the system ssh as one argument: it must be a destination, not a command line.
fn check_ssh(target: &str) -> Result<(), String> {
    if target.is_empty() || target.chars().any(char::is_whitespace) {
        Err(format!(
            "expected an ssh destination such as user@host, got \"{target}\""
        ))
    } else {
        Ok(())
    }
}

/// Whether the first line of content is a TOML `[table]` or `key = value` (a hostfile line is
/// `hostname` or `hostname slots=N`: never `=` right after the first word).
fn looks_like_toml(text: &str) -> bool {
    let Some(line) = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
    else {
        return false;
    };
    if line.starts_with('[') || line.starts_with('"') || line.starts_with('\'') {
        return true;
    }
    let key_end = line
        .find(|c: char| c.is_whitespace() || c == '=')
        .unwrap_or(line.len());
    line[key_end..].trim_start().starts_with('=')
}

/// Whitespace-separated tokens with their byte offsets.
fn tokens(line: &str) -> impl Iterator<Item = (usize, &str)> {
    line.split(|c: char| c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(move |t| (t.as_ptr() as usize - line.as_ptr() as usize, t))
}

/// The dotted path of the key at `offset`: its table header (`host[1]` for the second
/// `[[host]]`) and the key of its line. Only for error messages, so a header inside a multi-line
/// string may mislead it.
fn field_at(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let mut table = String::new();
    for line in text[..offset].lines().map(str::trim) {
        if let Some((name, _)) = line.strip_prefix("[[").and_then(|r| r.split_once("]]")) {
            let name = name.trim();
            let index = counts.entry(name).or_default();
            table = format!("{name}[{index}]");
            *index += 1;
        } else if let Some((name, _)) = line.strip_prefix('[').and_then(|r| r.split_once(']')) {
            table = name.trim().to_string();
        }
    }
    match (table.is_empty(), key_at(text, offset)) {
        (_, key) if key.is_empty() => table,
        (true, key) => key,
        (false, key) => format!("{table}.{key}"),
    }
}

/// The text being parsed, to turn byte offsets into located errors and check values.
struct Source<'a> {
    text: &'a str,
    file: &'a str,
}

impl Source<'_> {
    /// The TOML document, or the located error of its syntax or of an unknown key.
    fn toml_doc(&self) -> Result<HostsDoc, HostsError> {
        toml::from_str(self.text).map_err(|e| match e.span() {
            Some(span) => self.at(
                span.start,
                &field_at(self.text, span.start),
                e.message().trim(),
            ),
            None => self.at(0, "", e.message().trim()),
        })
    }

    fn at(&self, offset: usize, field: &str, message: &str) -> HostsError {
        let (line, column) = line_column(self.text, offset);
        HostsError::File {
            file: self.file.to_string(),
            line,
            column,
            field: field.to_string(),
            message: message.to_string(),
        }
    }

    fn count(&self, v: &Spanned<i64>, field: &str) -> Result<usize, HostsError> {
        match usize::try_from(*v.get_ref()) {
            Ok(n) if (1..=MAX_DEVICES).contains(&n) => Ok(n),
            _ => Err(self.at(
                v.span().start,
                field,
                &format!(
                    "expected an integer in 1..={MAX_DEVICES}, got {}",
                    v.get_ref()
                ),
            )),
        }
    }

    /// The hosts, if their devices together are within what the planner takes, the error
    /// located in the file otherwise.
    fn within_device_limit(&self, hosts: Hosts) -> Result<Hosts, HostsError> {
        match hosts.check_device_total() {
            Ok(()) => Ok(hosts),
            Err(message) => Err(self.at(0, "", &message)),
        }
    }

    fn port(&self, v: &Spanned<i64>, field: &str) -> Result<u16, HostsError> {
        match u16::try_from(*v.get_ref()) {
            Ok(p) if p >= 1 => Ok(p),
            _ => Err(self.at(
                v.span().start,
                field,
                &format!("expected a port number in 1..=65535, got {}", v.get_ref()),
            )),
        }
    }

    fn device_kind(&self, v: &Spanned<String>, field: &str) -> Result<String, HostsError> {
        let kind = v.get_ref();
        if DEVICE_KINDS.contains(&kind.as_str()) {
            Ok(kind.clone())
        } else {
            Err(self.at(
                v.span().start,
                field,
                &format!(
                    "expected a device kind ({}), got \"{kind}\"",
                    DEVICE_KINDS.join(", ")
                ),
            ))
        }
    }

    fn precision(&self, v: &Spanned<String>, field: &str) -> Result<Precision, HostsError> {
        v.get_ref()
            .parse()
            .map_err(|e: legion_ops::precision::UnknownPrecision| {
                self.at(v.span().start, field, &e.to_string())
            })
    }

    fn binary(&self, v: &Spanned<String>, field: &str) -> Result<String, HostsError> {
        let path = v.get_ref();
        if path.starts_with('/') && !path.contains(['\n', '\0']) {
            Ok(path.clone())
        } else {
            Err(self.at(
                v.span().start,
                field,
                &format!(
                    "expected the absolute path of the legion-rs binary on the host, got \"{}\"",
                    path.escape_debug()
                ),
            ))
        }
    }

    fn address(&self, v: &Spanned<String>, field: &str) -> Result<String, HostsError> {
        check_address(v.get_ref())
            .map(|()| v.get_ref().clone())
            .map_err(|m| self.at(v.span().start, field, &m))
    }
}

// Integers are read as i64 so that 0 and negative counts reach our own "expected ..." messages
// instead of serde's "invalid value: integer `-1`, expected usize". Required keys are `Option`s for
// the same reason: a missing one is reported at its table with the field's meaning.

/// What `[defaults]` gives every host that does not say otherwise.
struct HostDefaults {
    port: u16,
    devices: Option<usize>,
    kind: String,
    binary: Option<String>,
    precision: Option<Precision>,
}

/// Where a host's name and address were written, for the errors about all hosts.
struct HostSpans {
    name: Option<std::ops::Range<usize>>,
    address: std::ops::Range<usize>,
}

/// Names the hosts without `name` after their address, or, where several workers share an
/// address (loopback ones, typically), after "address:port": the bare address would name none
/// of them unambiguously.
fn name_unnamed(hosts: &mut [Host]) {
    let mut per_address: HashMap<String, usize> = HashMap::new();
    for h in hosts.iter() {
        *per_address.entry(h.address.clone()).or_default() += 1;
    }
    for h in hosts.iter_mut().filter(|h| h.name.is_empty()) {
        h.name = if per_address[&h.address] == 1 {
            h.address.clone()
        } else {
            h.endpoint()
        };
    }
}

/// The phases of [`Hosts::parse_toml`], each error located in the file.
impl Source<'_> {
    fn host_defaults(&self, defaults: DefaultsDoc) -> Result<HostDefaults, HostsError> {
        let port = match &defaults.port {
            Some(p) => self.port(p, "defaults.port")?,
            None => DEFAULT_PORT,
        };
        let devices = match &defaults.devices {
            Some(d) => Some(self.count(d, "defaults.devices")?),
            None => None,
        };
        let kind = match &defaults.device {
            Some(k) => self.device_kind(k, "defaults.device")?,
            None => "cpu".to_string(),
        };
        let binary = match &defaults.binary {
            Some(b) => Some(self.binary(b, "defaults.binary")?),
            None => None,
        };
        let precision = match &defaults.precision {
            Some(p) => Some(self.precision(p, "defaults.precision")?),
            None => None,
        };
        Ok(HostDefaults {
            port,
            devices,
            kind,
            binary,
            precision,
        })
    }

    /// Host `i` of the file (its name is filled in later where it has none).
    fn host(
        &self,
        i: usize,
        table: &Spanned<HostDoc>,
        defaults: &HostDefaults,
    ) -> Result<(Host, HostSpans), HostsError> {
        let h = table.get_ref();
        let field = |f: &str| format!("host[{i}].{f}");
        let address = h.address.as_ref().ok_or_else(|| {
            self.at(
                table.span().start,
                &field("address"),
                "missing; expected the IP address or DNS name of the host",
            )
        })?;
        if let Some(name) = &h.name
            && name.get_ref().trim().is_empty()
        {
            return Err(self.at(
                name.span().start,
                &field("name"),
                "expected a non-empty name (or no `name`: it defaults to the address)",
            ));
        }
        if let Some(ssh) = &h.ssh {
            check_ssh(ssh.get_ref()).map_err(|m| self.at(ssh.span().start, &field("ssh"), &m))?;
        }
        if let Some(run_with) = &h.run_with {
            let at = |m: &str| self.at(run_with.span().start, &field("run_with"), m);
            if h.ssh.is_some() {
                return Err(at("expected either `ssh` or `run_with`, not both"));
            }
            if run_with.get_ref().is_empty() || run_with.get_ref().iter().any(|w| w.is_empty()) {
                return Err(at(
                    "expected a command prefix of non-empty words, e.g. [\"ip\", \"netns\", \"exec\", \"ns0\"]",
                ));
            }
        }
        let device_kind = match &h.device {
            Some(k) => self.device_kind(k, &field("device"))?,
            None => defaults.kind.clone(),
        };
        let host = Host {
            name: h
                .name
                .as_ref()
                .map(|n| n.get_ref().clone())
                .unwrap_or_default(),
            address: self.address(address, &field("address"))?,
            port: match &h.port {
                Some(p) => self.port(p, &field("port"))?,
                None => defaults.port,
            },
            devices: match &h.devices {
                Some(d) => self.count(d, &field("devices"))?,
                None => defaults.devices.unwrap_or(1),
            },
            devices_from_gpus: h.devices.is_none()
                && defaults.devices.is_none()
                && device_kind == GPU_KIND,
            device_kind,
            ssh: h.ssh.as_ref().map(|s| s.get_ref().clone()),
            run_with: h
                .run_with
                .as_ref()
                .map(|r| r.get_ref().clone())
                .unwrap_or_default(),
            binary: match &h.binary {
                Some(b) => Some(self.binary(b, &field("binary"))?),
                None => defaults.binary.clone(),
            },
        };
        let spans = HostSpans {
            name: h.name.as_ref().map(|n| n.span()),
            address: address.span(),
        };
        Ok((host, spans))
    }

    fn check_unique_endpoints(
        &self,
        hosts: &[Host],
        spans: &[HostSpans],
    ) -> Result<(), HostsError> {
        let mut endpoints: HashMap<(&str, u16), usize> = HashMap::new();
        for (i, h) in hosts.iter().enumerate() {
            if let Some(j) = endpoints.insert((&h.address, h.port), i) {
                return Err(self.at(
                    spans[i].address.start,
                    &format!("host[{i}].address"),
                    &format!(
                        "expected a unique address and port, but {} is already host[{j}]'s",
                        h.endpoint()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Each host's index by its name, refusing a name given twice.
    fn unique_names<'h>(
        &self,
        hosts: &'h [Host],
        spans: &[HostSpans],
    ) -> Result<HashMap<&'h str, usize>, HostsError> {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, h) in hosts.iter().enumerate() {
            if let Some(j) = names.insert(&h.name, i) {
                let (span, note) = match &spans[i].name {
                    Some(span) => (span, ""),
                    None => (
                        &spans[i].address,
                        " (a host without `name` is named after its address)",
                    ),
                };
                return Err(self.at(
                    span.start,
                    &format!("host[{i}].name"),
                    &format!(
                        "expected a unique name, but \"{}\" is already host[{j}]'s{note}",
                        h.name
                    ),
                ));
            }
        }

        Ok(names)
    }

    /// Link `i` of the file, between hosts named in `names`, refusing one that `links` (those
    /// before it) already has.
    fn link(
        &self,
        i: usize,
        table: &Spanned<LinkDoc>,
        hosts: &[Host],
        names: &HashMap<&str, usize>,
        links: &[HostLink],
    ) -> Result<HostLink, HostsError> {
        let l = table.get_ref();
        let field = |f: &str| format!("link[{i}].{f}");
        let missing = |f: &str, what: &str| {
            self.at(
                table.span().start,
                &field(f),
                &format!("missing; expected {what}"),
            )
        };
        // A host index and where its name was written.
        let endpoint = |v: &Option<Spanned<String>>, f: &str| {
            let v = v.as_ref().ok_or_else(|| missing(f, "the name of a host"))?;
            match names.get(v.get_ref().as_str()) {
                Some(&index) => Ok((index, v.span().start)),
                None => {
                    let known: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
                    Err(self.at(
                        v.span().start,
                        &field(f),
                        &format!(
                            "expected the name of a host ({}), got \"{}\"",
                            known.join(", "),
                            v.get_ref()
                        ),
                    ))
                }
            }
        };
        let (from, _) = endpoint(&l.from, "from")?;
        let (to, to_at) = endpoint(&l.to, "to")?;
        if from == to {
            return Err(self.at(
                to_at,
                &field("to"),
                &format!(
                    "expected a host other than `from`, got \"{}\" again \
                     (devices of one host share its in-process link)",
                    hosts[to].name
                ),
            ));
        }
        if let Some(j) = links
            .iter()
            .position(|o| (o.from, o.to) == (from, to) || (o.from, o.to) == (to, from))
        {
            return Err(self.at(
                table.span().start,
                &format!("link[{i}]"),
                &format!(
                    "expected one [[link]] per pair of hosts, \
                     but {} and {} already have link[{j}]",
                    hosts[from].name, hosts[to].name
                ),
            ));
        }
        let gbps = l
            .gbps
            .as_ref()
            .ok_or_else(|| missing("gbps", "the bandwidth in Gbit/s"))?;
        let gbps_value = gbps.get_ref().0;
        if !(gbps_value.is_finite() && gbps_value > 0.0) {
            return Err(self.at(
                gbps.span().start,
                &field("gbps"),
                &format!("expected a bandwidth > 0 (Gbit/s), got {gbps_value}"),
            ));
        }
        let latency_us = match &l.latency_us {
            Some(v) if !(v.get_ref().0.is_finite() && v.get_ref().0 >= 0.0) => {
                return Err(self.at(
                    v.span().start,
                    &field("latency_us"),
                    &format!("expected a latency ≥ 0 (µs), got {}", v.get_ref().0),
                ));
            }
            Some(v) => v.get_ref().0,
            None => DEFAULT_INTER_HOST_LATENCY_US,
        };
        Ok(HostLink {
            from,
            to,
            gbps: gbps_value,
            latency_us,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostsDoc {
    defaults: Option<Spanned<DefaultsDoc>>,
    /// The same keys as `[defaults]`, for every node of the allocation.
    slurm: Option<Spanned<DefaultsDoc>>,
    #[serde(default)]
    host: Vec<Spanned<HostDoc>>,
    #[serde(default)]
    link: Vec<Spanned<LinkDoc>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultsDoc {
    port: Option<Spanned<i64>>,
    devices: Option<Spanned<i64>>,
    device: Option<Spanned<String>>,
    binary: Option<Spanned<String>>,
    precision: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostDoc {
    name: Option<Spanned<String>>,
    address: Option<Spanned<String>>,
    devices: Option<Spanned<i64>>,
    port: Option<Spanned<i64>>,
    device: Option<Spanned<String>>,
    ssh: Option<Spanned<String>>,
    run_with: Option<Spanned<Vec<String>>>,
    binary: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkDoc {
    from: Option<Spanned<String>>,
    to: Option<Spanned<String>>,
    gbps: Option<Spanned<Number>>,
    latency_us: Option<Spanned<Number>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module docs' example, without comments (line numbers below refer to it).
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

    fn parse(text: &str) -> Hosts {
        Hosts::parse(text, "h.toml").unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(text: &str) -> String {
        Hosts::parse(text, "h.toml").unwrap_err().to_string()
    }

    /// The error of `DOC` with `from` replaced by `to`.
    fn err_with(from: &str, to: &str) -> String {
        assert!(DOC.contains(from), "{from}");
        err(&DOC.replacen(from, to, 1))
    }

    #[test]
    fn a_cluster_without_a_host_renumbers_the_others_and_keeps_their_links() {
        let text = "[[host]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = 7001\n\
                    [[host]]\nname = \"b\"\naddress = \"127.0.0.1\"\nport = 7002\ndevices = 2\n\
                    [[host]]\nname = \"c\"\naddress = \"127.0.0.1\"\nport = 7003\ndevices = 3\n\
                    [[link]]\nfrom = \"a\"\nto = \"b\"\ngbps = 1.0\nlatency_us = 5.0\n\
                    [[link]]\nfrom = \"a\"\nto = \"c\"\ngbps = 2.0\nlatency_us = 5.0\n";
        let hosts = parse(text);
        let left = hosts.without(1);
        let names: Vec<&str> = left.hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(left.num_devices(), 4);
        assert_eq!(left.device_ranges(), [0..1, 1..4]);
        // a's link to b is gone; a's link to c now names c by its new index
        assert_eq!(left.links.len(), 1);
        assert_eq!((left.links[0].from, left.links[0].to), (0, 1));
        assert_eq!(left.links[0].gbps, 2.0);
        assert_eq!(hosts.without(0).without(0).hosts[0].name, "c");
    }

    #[test]
    fn a_cuda_host_without_a_count_has_one_device_per_gpu_once_up_recorded_them() {
        let text = "[[host]]\nname = \"g\"\naddress = \"127.0.0.1\"\ndevice = \"cuda\"\n\
                    [[host]]\nname = \"g2\"\naddress = \"127.0.0.2\"\ndevice = \"cuda\"\ndevices = 3\n\
                    [[host]]\nname = \"c\"\naddress = \"127.0.0.3\"\n";
        let hosts = parse(text);
        let from_gpus: Vec<bool> = hosts.hosts.iter().map(|h| h.devices_from_gpus).collect();
        assert_eq!(from_gpus, [true, false, false]);
        let err = hosts.clone().with_gpu_counts(&HashMap::new()).unwrap_err();
        assert!(
            err.starts_with("host g: device = \"cuda\" without `devices`"),
            "{err}"
        );
        let counts = HashMap::from([("g".to_string(), 8), ("g2".to_string(), 5)]);
        let resolved = hosts.with_gpu_counts(&counts).unwrap();
        let devices: Vec<usize> = resolved.hosts.iter().map(|h| h.devices).collect();
        // A count the file gives stands; only the host without one takes up's.
        assert_eq!(devices, [8, 3, 1]);
        assert_eq!(resolved.device_ranges(), [0..8, 8..11, 11..12]);
        // A default count applies to cuda hosts too.
        let with_default = parse(&format!("[defaults]\ndevices = 2\n{text}"));
        assert!(with_default.hosts.iter().all(|h| !h.devices_from_gpus));
    }

    #[test]
    fn parses_the_documented_example() {
        let hosts = parse(DOC);
        assert_eq!(
            hosts.hosts,
            [
                Host {
                    name: "node0".into(),
                    address: "127.0.0.1".into(),
                    port: 7401,
                    devices: 2,
                    devices_from_gpus: false,
                    device_kind: "cpu".into(),
                    ssh: Some("user@node0".into()),
                    run_with: Vec::new(),
                    binary: None,
                },
                Host {
                    name: "10.0.0.2".into(),
                    address: "10.0.0.2".into(),
                    port: 7400,
                    devices: 1,
                    devices_from_gpus: false,
                    device_kind: "cpu".into(),
                    ssh: Some("ubuntu@10.0.0.2".into()),
                    run_with: Vec::new(),
                    binary: None,
                },
            ]
        );
        assert_eq!(
            hosts.links,
            [HostLink {
                from: 0,
                to: 1,
                gbps: 10.0,
                latency_us: 20.0
            }]
        );
        assert_eq!(hosts.device_ranges(), [0..2, 2..3]);
        assert_eq!(hosts.num_devices(), 3);
    }

    #[test]
    fn defaults_names_and_locality() {
        let hosts = parse(
            r#"
[[host]]
address = "127.0.0.1"
port = 7401
[[host]]
address = "127.0.0.1"
port = 7402
device = "p100"
[[host]]
address = "::1"
[[host]]
address = "localhost"
ssh = "me@localhost"
"#,
        );
        let names: Vec<_> = hosts.hosts.iter().map(|h| h.name.as_str()).collect();
        // a shared address names its hosts by endpoint
        assert_eq!(
            names,
            ["127.0.0.1:7401", "127.0.0.1:7402", "::1", "localhost"]
        );
        assert_eq!(hosts.hosts[2].endpoint(), "[::1]:7400");
        assert_eq!(hosts.hosts[1].device_kind, "p100");
        let local: Vec<_> = hosts.hosts.iter().map(Host::is_local).collect();
        assert_eq!(local, [true, true, true, false]);
        assert!(hosts.links.is_empty());
    }

    #[test]
    fn numeric_errors_are_located() {
        assert_eq!(
            err_with("devices = 2", "devices = 0"),
            "h.toml:8:11: host[0].devices: expected an integer in 1..=4096, got 0"
        );
        assert_eq!(
            err_with("devices = 1", "devices = -3"),
            "h.toml:3:11: defaults.devices: expected an integer in 1..=4096, got -3"
        );
        assert_eq!(
            err_with("port = 7401", "port = 70000"),
            "h.toml:9:8: host[0].port: expected a port number in 1..=65535, got 70000"
        );
        assert_eq!(
            err_with("port = 7400", "port = 0"),
            "h.toml:2:8: defaults.port: expected a port number in 1..=65535, got 0"
        );
        assert_eq!(
            err_with("gbps = 10.0", "gbps = 0"),
            "h.toml:17:8: link[0].gbps: expected a bandwidth > 0 (Gbit/s), got 0"
        );
        assert_eq!(
            err_with("latency_us = 20.0", "latency_us = -1"),
            "h.toml:18:14: link[0].latency_us: expected a latency ≥ 0 (µs), got -1"
        );
    }

    /// `[defaults] precision` sets a job's precision; a name that is none is refused at its value,
    /// naming the three; a host cannot set its own (a job computes in one).
    #[test]
    fn precision_is_read_and_its_errors_are_located() {
        assert_eq!(parse(DOC).precision, None);
        let bf16 = parse(&DOC.replacen(
            "device = \"cpu\"",
            "device = \"cpu\"\nprecision = \"bf16\"",
            1,
        ));
        assert_eq!(bf16.precision, Some(Precision::Bf16));
        assert_eq!(
            err_with("device = \"cpu\"", "device = \"cpu\"\nprecision = \"fp16\""),
            "h.toml:5:13: defaults.precision: unknown precision 'fp16': expected one of fp32, \
             tf32, bf16"
        );
        let e = err_with("port = 7401", "port = 7401\nprecision = \"bf16\"");
        assert!(
            e.starts_with("h.toml:10:1: host[0].precision:") && e.contains("unknown field"),
            "{e}"
        );
    }

    #[test]
    fn string_errors_are_located() {
        assert_eq!(
            err_with("ssh = \"user@node0\"", "ssh = \"\""),
            "h.toml:10:7: host[0].ssh: expected an ssh destination such as user@host, got \"\""
        );
        assert_eq!(
            err_with("ssh = \"ubuntu@10.0.0.2\"", "ssh = \"ssh -p 22 x\""),
            "h.toml:13:7: host[1].ssh: expected an ssh destination such as user@host, \
             got \"ssh -p 22 x\""
        );
        assert_eq!(
            err_with("\"10.0.0.2\"\nssh", "\"10.0.0.2:7400\"\nssh"),
            "h.toml:12:11: host[1].address: expected an IP address or DNS name, \
             got \"10.0.0.2:7400\" (a port goes in `port`)"
        );
        assert_eq!(
            err_with("device = \"cpu\"", "device = \"tpu\""),
            "h.toml:4:10: defaults.device: expected a device kind (cpu, cuda, p100), got \"tpu\""
        );
        assert_eq!(
            err_with("name = \"node0\"", "name = \" \""),
            "h.toml:6:8: host[0].name: expected a non-empty name \
             (or no `name`: it defaults to the address)"
        );
        assert_eq!(
            err_with("ssh = \"user@node0\"", "binary = \"bin/legion-rs\""),
            "h.toml:10:10: host[0].binary: expected the absolute path of the legion-rs binary \
             on the host, got \"bin/legion-rs\""
        );
    }

    #[test]
    fn the_binary_defaults_to_the_running_one_or_the_defaults_table() {
        assert!(parse(DOC).hosts.iter().all(|h| h.binary.is_none()));
        let hosts = parse(
            &DOC.replace(
                "device = \"cpu\"",
                "device = \"cpu\"\nbinary = \"/opt/l/legion-rs\"",
            )
            .replace("ssh = \"user@node0\"", "binary = \"/usr/bin/legion-rs\""),
        );
        assert_eq!(hosts.hosts[0].binary.as_deref(), Some("/usr/bin/legion-rs"));
        assert_eq!(hosts.hosts[1].binary.as_deref(), Some("/opt/l/legion-rs"));
    }

    #[test]
    fn uniqueness_errors_are_located() {
        assert_eq!(
            err_with(
                "address = \"10.0.0.2\"",
                "name = \"node0\"\naddress = \"10.0.0.2\""
            ),
            "h.toml:12:8: host[1].name: expected a unique name, but \"node0\" is already host[0]'s"
        );
        assert_eq!(
            err_with("address = \"10.0.0.2\"", "address = \"node0\""),
            "h.toml:12:11: host[1].name: expected a unique name, but \"node0\" is already \
             host[0]'s (a host without `name` is named after its address)"
        );
        assert_eq!(
            err_with(
                "address = \"10.0.0.2\"",
                "address = \"127.0.0.1\"\nport = 7401"
            ),
            "h.toml:12:11: host[1].address: expected a unique address and port, \
             but 127.0.0.1:7401 is already host[0]'s"
        );
    }

    #[test]
    fn a_slurm_table_stands_for_the_allocations_nodes() {
        let file = |text: &str| ClusterFile::parse(text, "s.toml");
        assert_eq!(
            file("[slurm]\n").unwrap(),
            ClusterFile::Slurm(SlurmNodes::default())
        );
        assert_eq!(
            file(
                "[slurm]\nport = 7500\ndevices = 2\ndevice = \"cuda\"\nbinary = \"/b/legion-rs\"\n"
            )
            .unwrap(),
            ClusterFile::Slurm(SlurmNodes {
                port: Some(7500),
                devices: Some(2),
                device: Some("cuda".into()),
                binary: Some("/b/legion-rs".into()),
                precision: None,
            })
        );
        assert!(matches!(file(DOC).unwrap(), ClusterFile::Hosts(_)));
        assert_eq!(
            file("[slurm]\nprecision = \"bf16\"\n").unwrap(),
            ClusterFile::Slurm(SlurmNodes {
                precision: Some(Precision::Bf16),
                ..SlurmNodes::default()
            })
        );
        assert_eq!(
            file("[slurm]\ndevices = 0\n").unwrap_err().to_string(),
            "s.toml:2:11: slurm.devices: expected an integer in 1..=4096, got 0"
        );
        let e = file("[slurm]\nhosts = 2\n").unwrap_err().to_string();
        assert!(
            e.starts_with("s.toml:2:1: slurm.hosts: unknown field `hosts`"),
            "{e}"
        );
        let e = file("[slurm]\n[[host]]\naddress = \"10.0.0.1\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "s.toml:2:1: host: expected no [defaults], [[host]] or [[link]] beside [slurm]"
            ),
            "{e}"
        );
        // Its hosts are known only inside the allocation.
        let e = Hosts::parse("[slurm]\n", "s.toml").unwrap_err().to_string();
        assert!(
            e.starts_with("s.toml:1:1: slurm: this file describes the nodes of a Slurm allocation"),
            "{e}"
        );
    }

    #[test]
    fn structural_errors_are_located() {
        assert_eq!(
            err("[defaults]\nport = 7400\n"),
            "h.toml:1:1: host: expected at least one [[host]] table (or [slurm] for the nodes of a Slurm allocation)"
        );
        assert_eq!(
            err_with("address = \"10.0.0.2\"\n", ""),
            "h.toml:11:1: host[1].address: missing; expected the IP address or DNS name of the host"
        );
        let e = err_with("ssh = \"ubuntu", "sssh = \"ubuntu");
        assert!(
            e.starts_with("h.toml:13:1: host[1].sssh: unknown field `sssh`"),
            "{e}"
        );
        let e = err_with("devices = 2", "devices = \"two\"");
        assert!(
            e.starts_with("h.toml:8:11: host[0].devices: invalid type: string"),
            "{e}"
        );
        let e = err_with("[defaults]", "[default]");
        assert!(
            e.starts_with("h.toml:1:") && e.contains("unknown field `default`"),
            "{e}"
        );
        let e = err("[[host]\n");
        assert!(e.starts_with("h.toml:1:"), "{e}");
    }

    #[test]
    fn link_errors_are_located() {
        assert_eq!(
            err_with("to = \"10.0.0.2\"", "to = \"node9\""),
            "h.toml:16:6: link[0].to: expected the name of a host (node0, 10.0.0.2), got \"node9\""
        );
        assert_eq!(
            err_with("from = \"node0\"", "from = \"10.0.0.2\""),
            "h.toml:16:6: link[0].to: expected a host other than `from`, got \"10.0.0.2\" again \
             (devices of one host share its in-process link)"
        );
        assert_eq!(
            err_with("gbps = 10.0\n", ""),
            "h.toml:14:1: link[0].gbps: missing; expected the bandwidth in Gbit/s"
        );
        let twice = format!("{DOC}[[link]]\nfrom = \"10.0.0.2\"\nto = \"node0\"\ngbps = 1\n");
        assert_eq!(
            err(&twice),
            "h.toml:19:1: link[1]: expected one [[link]] per pair of hosts, \
             but 10.0.0.2 and node0 already have link[0]"
        );
    }

    #[test]
    fn hostfile_parses() {
        let text = "# cluster\n\nlocalhost slots=2\n  node1   slots=4 # remote\nnode2\n";
        let hosts = Hosts::parse(text, "hostfile").unwrap();
        let summary: Vec<_> = hosts
            .hosts
            .iter()
            .map(|h| (h.name.as_str(), h.devices, h.ssh.as_deref(), h.is_local()))
            .collect();
        assert_eq!(
            summary,
            [
                ("localhost", 2, None, true),
                ("node1", 4, Some("node1"), false),
                ("node2", 1, Some("node2"), false),
            ]
        );
        assert_eq!(hosts.device_ranges(), [0..2, 2..6, 6..7]);
    }

    #[test]
    fn hostfile_errors_are_located() {
        let err = |text: &str| Hosts::parse(text, "hostfile").unwrap_err().to_string();
        assert_eq!(
            err("# x\nnode0 slots=x\n"),
            "hostfile:2:13: slots: expected an integer in 1..=4096, got x"
        );
        assert_eq!(
            err("node0 slots=0"),
            "hostfile:1:13: slots: expected an integer in 1..=4096, got 0"
        );
        assert_eq!(
            err("node0 slots=18446744073709551615"),
            "hostfile:1:13: slots: expected an integer in 1..=4096, got 18446744073709551615"
        );
        assert!(
            err("node0 slots=4096
node1 slots=1
")
            .ends_with("expected at most 4096 devices in all, but the 2 hosts have more"),
        );
        assert_eq!(
            err("node0 slots=2 max_slots=4\n"),
            "hostfile:1:15: expected `slots=N` after the host name, got `max_slots=4`"
        );
        assert_eq!(
            err("node0 slots=1 slots=2\n"),
            "hostfile:1:15: slots: expected `slots` once per line"
        );
        assert_eq!(
            err("node0\n\n  node0 slots=2\n"),
            "hostfile:3:3: host: expected each host once, but node0 is already on line 1"
        );
        assert_eq!(
            err("bad_host! slots=1\n"),
            "hostfile:1:1: host: expected an IP address or DNS name, got \"bad_host!\""
        );
        assert_eq!(
            err("# nothing\n\n"),
            "hostfile:1:1: expected at least one `hostname slots=N` line"
        );
    }

    #[test]
    fn the_format_is_detected() {
        for toml in ["[[host]]", "# c\n\nport = 1", "\"a b\" = 1", "x=1"] {
            assert!(looks_like_toml(toml), "{toml}");
        }
        for hostfile in ["node0 slots=2", "# c\nnode0", "", "10.0.0.1\tslots=1"] {
            assert!(!looks_like_toml(hostfile), "{hostfile}");
        }
        // the extension wins over the content
        let e = Hosts::parse("node0 slots=2\n", "cluster.toml").unwrap_err();
        assert!(e.to_string().starts_with("cluster.toml:1:"), "{e}");
    }
}
