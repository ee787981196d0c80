//! Measured compute times: the profile database the runtime's profiler writes, and [`ProfiledCost`],
//! the cost provider that reads it. A tile it has not measured is scaled from the measured tile of
//! the same op nearest in size (the roofline gives the ratio between the two shapes, the
//! measurement the level), and priced by the roofline alone only where the op has no measured
//! tile at all: a search must not favour the configurations a partial profile left out because
//! the roofline, which ignores kernel efficiency, prices them optimistically.
//!
//! File format (JSON):
//!
//! ```json
//! {
//!   "version": 1,
//!   "entries": [
//!     {
//!       "op": "conv2d",
//!       "attrs": {"out_channels": 64, "kernel": [11, 11], "stride": [4, 4], "padding": [2, 2],
//!                 "groups": 1, "bias": true, "activation": "relu"},
//!       "inputs": [[32, 3, 227, 227]],
//!       "tile": [32, 64, 55, 55],
//!       "device_kind": "p100",
//!       "forward_s": 0.00121,
//!       "backward_s": 0.00254,
//!       "samples": 20
//!     }
//!   ],
//!   "links": {"bytes_per_s": 2.1e9, "latency_s": 4.0e-5, "samples": 412},
//!   "compute_threads": 2,
//!   "runtime": {"dispatch_s": 8.0e-5, "dispatch_bins_s": [1.1e-5, 1.4e-5, ..., 6.2e-4],
//!               "runtime_cpu_s": 1.5e-5, "fold_bytes_per_s": 3.1e9, "update_bytes_per_s": 2.4e9,
//!               "copy_bytes_per_s": 4.4e9, "actor_threads": 2}
//! }
//! ```
//!
//! An entry is keyed by `op` (the op kind), `attrs` (the op's attributes exactly as in model JSON,
//! without `op`), `inputs` (the shapes of the input rects the tile reads: [`OpSpec::project`] of the
//! tile), `tile` (the output tile's shape) and `device_kind` ([`crate::DeviceSpec::kind`]). Times are
//! seconds per run, averaged over `samples` runs. [`ProfileKey::for_tile`] builds the key from a
//! layer and a tile, so writer and reader agree.
//!
//! `staged` is optional (a GPU profile writes it): a slice's two staging copies on a GPU, out to
//! page-locked host memory and in to a device, as one `bytes_per_s`/`latency_s` link; the planner's
//! model of worker processes sharing a GPU adds it to their network.
//!
//! `links` is optional (files written before it existed load unchanged, and a profile of one device
//! has no transfers to measure): the transport's measured per-message cost, `latency_s +
//! bytes / bytes_per_s`, a least-squares fit over `samples` transfers. `compute_threads` is optional
//! too: how many kernels the profiled devices' cores ran at once at full speed (the embedded
//! cluster's devices are thread pools on this machine's cores). `legion-rs plan --profile` prices
//! every link of the machine with the measured one and lets its devices run only `compute_threads`
//! core-using tasks at once ([`ProfileDb::apply_to`]); the times are each task's own seconds, with
//! the share of the cores it lost to the others taken out.
//!
//! `runtime` is optional as well (files written before it load unchanged; the simulator then
//! treats dispatch as free and streams folds and updates at the device's memory bandwidth): what
//! the device actors cost besides kernels and transfers ([`RuntimeCosts`]). `dispatch_s` is the
//! mean delay between a compute op being able to start (dependences done, its device's previous
//! compute op finished, a pool thread free) and its kernel starting, and the optional
//! `dispatch_bins_s` (16 numbers) how they spread: the means of the sorted delays' sixteenths, from
//! which the simulator draws each op's delay (when a core is idle: with every core busy, the op
//! waits for one instead); `runtime_cpu_s` (optional, 0 when absent) the CPU the runtime itself
//! spends per compute op (message handling, waking and parking threads), which holds a core at the
//! end of the op's dispatch; `fold_bytes_per_s` and `update_bytes_per_s` are the
//! throughputs of gradient sums and SGD updates, in the bytes
//! [`fold_bytes`] and [`update_bytes`] count; `copy_bytes_per_s` that of the copies the device
//! actors make themselves (gathers for sends, stores of receives, local copies); `actor_threads`
//! the size of the thread pool the actors share. [`ProfileDb::apply_to`] puts them into the machine
//! model, where the simulator reads them.
//!
//! `measured_on` is optional: where and when the times were taken (`{"device": "...", "software":
//! "...", "date": "2026-11-26", "command": "..."}`), as the GPU profiler records it. Entries measured
//! on one GPU may be stored under another machine's device kind (`profile --device-kind p100`), so
//! that the paper's machine is priced with this GPU's kernels; `measured_on` says which GPU it was.
//!
//! [`fold_bytes`]: crate::runtime_costs::fold_bytes
//! [`update_bytes`]: crate::runtime_costs::update_bytes
//! [`OpSpec::project`]: legion_ops::op::OpSpec::project

use crate::machine::{DeviceId, Link, MAX_THREADS, MachineModel};
use crate::provider::{CostProvider, PhaseTimes, RooflineCost};
use crate::runtime_costs::RuntimeCosts;
use legion_ops::{Layer, Precision, Rect, Shape};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

pub const PROFILE_VERSION: u32 = 1;

/// One measured tile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileEntry {
    pub op: String,
    pub attrs: Value,
    pub inputs: Vec<Vec<usize>>,
    pub tile: Vec<usize>,
    pub device_kind: String,
    pub forward_s: f64,
    pub backward_s: f64,
    #[serde(default = "one")]
    pub samples: u32,
}

fn one() -> u32 {
    1
}

impl ProfileEntry {
    /// The measured times of tile `tile_out` of `layer` on a device of kind `device_kind`.
    pub fn for_tile(
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device_kind: &str,
        times: PhaseTimes,
        samples: u32,
    ) -> ProfileEntry {
        let key = ProfileKey::for_tile(layer, inputs, tile_out, device_kind);
        ProfileEntry {
            op: key.op,
            attrs: op_attrs(layer),
            inputs: key.inputs,
            tile: key.tile,
            device_kind: key.device_kind,
            forward_s: times.forward,
            backward_s: times.backward,
            samples,
        }
    }
}

impl ProfileEntry {
    pub fn key(&self) -> ProfileKey {
        ProfileKey {
            op: self.op.clone(),
            attrs: canonical_json(&self.attrs),
            inputs: self.inputs.clone(),
            tile: self.tile.clone(),
            device_kind: self.device_kind.clone(),
        }
    }

    pub fn times(&self) -> PhaseTimes {
        PhaseTimes {
            forward: self.forward_s,
            backward: self.backward_s,
        }
    }
}

/// The measured cost of one message between devices: `latency_s + bytes / bytes_per_s`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkProfile {
    pub bytes_per_s: f64,
    pub latency_s: f64,
    /// Transfers the fit was made from.
    #[serde(default = "one")]
    pub samples: u32,
}

impl LinkProfile {
    pub fn link(&self) -> Link {
        Link {
            bytes_per_s: self.bytes_per_s,
            latency_s: self.latency_s,
        }
    }
}

/// What a measurement is looked up by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProfileKey {
    pub op: String,
    /// The attributes as canonical JSON (object keys sorted).
    pub attrs: String,
    pub inputs: Vec<Vec<usize>>,
    pub tile: Vec<usize>,
    pub device_kind: String,
}

impl ProfileKey {
    /// The key of tile `tile_out` of `layer` on a device of kind `device_kind`.
    pub fn for_tile(layer: &Layer, inputs: &[Shape], tile_out: &Rect, device_kind: &str) -> Self {
        ProfileKey {
            op: layer.op.kind().to_string(),
            attrs: canonical_json(&op_attrs(layer)),
            inputs: layer
                .op
                .spec()
                .project(inputs, tile_out)
                .iter()
                .map(|r| r.shape().dims().to_vec())
                .collect(),
            tile: tile_out.shape().dims().to_vec(),
            device_kind: device_kind.to_string(),
        }
    }
}

/// The op's attributes as they appear in model JSON, without the `op` tag.
pub fn op_attrs(layer: &Layer) -> Value {
    let mut v = serde_json::to_value(&layer.op).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut v {
        map.remove("op");
    }
    v
}

/// JSON text with object keys sorted at every level, so equal attributes give equal keys whatever
/// order a file lists them in.
fn canonical_json(v: &Value) -> String {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    write(&map[k], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

/// What is wrong with a profile file.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{file}: line {line} column {column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: entries[{index}].{field}: {message}")]
    Entry {
        file: String,
        index: usize,
        field: &'static str,
        message: String,
    },
    #[error("{file}: links.{field}: {message}")]
    Links {
        file: String,
        field: &'static str,
        message: String,
    },
    #[error("{file}: {field}: {message}")]
    Field {
        file: String,
        field: &'static str,
        message: String,
    },
    #[error("{file}: version {found} is not supported (expected {PROFILE_VERSION})")]
    Version { file: String, found: u32 },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// The measured tiles of a machine, in insertion order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileDb {
    pub version: u32,
    pub entries: Vec<ProfileEntry>,
    /// The measured transport, when the profile saw transfers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub links: Option<LinkProfile>,
    /// On a GPU: a slice's copies out of device memory into page-locked host memory and back
    /// into another device's, one after the other, as one link (what a slice between processes
    /// or GPUs pays besides the network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<LinkProfile>,
    /// Core-using tasks the profiled devices ran at once at full speed (cores over each device's
    /// pool threads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_threads: Option<usize>,
    /// The measured cost of the runtime's dispatch, folds and updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeCosts>,
    /// Where and when the entries were measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_on: Option<MeasuredOn>,
}

/// Where and when a profile was measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredOn {
    /// The device (`cuda:0 NVIDIA H100 80GB HBM3, 79.2 GiB, sm_90`).
    pub device: String,
    /// Driver and library versions.
    pub software: String,
    /// `YYYY-MM-DD`, UTC.
    pub date: String,
    /// The command that measured it, to regenerate it.
    pub command: String,
}

impl Default for ProfileDb {
    fn default() -> Self {
        ProfileDb {
            version: PROFILE_VERSION,
            entries: Vec::new(),
            links: None,
            staged: None,
            compute_threads: None,
            runtime: None,
            measured_on: None,
        }
    }
}

/// Whether a device kind is one measured in `precision`: it ends with the precision's suffix
/// (`-tf32`, `-bf16`), or for fp32 with neither.
fn of_precision(kind: &str, precision: Precision) -> bool {
    match precision.kind_suffix() {
        Some(suffix) => kind.ends_with(suffix),
        None => Precision::ALL
            .iter()
            .filter_map(|p| p.kind_suffix())
            .all(|suffix| !kind.ends_with(suffix)),
    }
}

impl ProfileDb {
    /// Adds measurements, each replacing an earlier one with the same key: one pass over the
    /// entries however many are added ([`ProfileDb::insert`] looks each one up).
    pub fn insert_all(&mut self, entries: impl IntoIterator<Item = ProfileEntry>) {
        let mut at: HashMap<ProfileKey, usize> = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.key(), i))
            .collect();
        for entry in entries {
            let key = entry.key();
            match at.get(&key) {
                Some(&i) => self.entries[i] = entry,
                None => {
                    at.insert(key, self.entries.len());
                    self.entries.push(entry);
                }
            }
        }
    }

    /// The tiles of several devices' profiles (a cluster's workers), each the median of the
    /// profiles that measured it, phase by phase, over their samples together: devices of one kind
    /// price alike, and one slow host does not move an entry. Tiles in the first-seen order; the
    /// links, threads and runtime costs of one device's steps are not a cluster's, and are left out.
    pub fn median_of(profiles: &[ProfileDb]) -> ProfileDb {
        let mut at: HashMap<ProfileKey, usize> = HashMap::new();
        let mut groups: Vec<Vec<&ProfileEntry>> = Vec::new();
        for entry in profiles.iter().flat_map(|p| &p.entries) {
            let i = *at.entry(entry.key()).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[i].push(entry);
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            match n % 2 {
                1 => v[n / 2],
                _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            }
        };
        let entries = groups
            .into_iter()
            .map(|group| ProfileEntry {
                forward_s: median(group.iter().map(|e| e.forward_s).collect()),
                backward_s: median(group.iter().map(|e| e.backward_s).collect()),
                samples: group.iter().map(|e| e.samples).fold(0, u32::saturating_add),
                ..group[0].clone()
            })
            .collect();
        ProfileDb {
            entries,
            ..ProfileDb::default()
        }
    }

    /// Adds a measurement, replacing an earlier one with the same key.
    pub fn insert(&mut self, entry: ProfileEntry) {
        let key = entry.key();
        match self.entries.iter_mut().find(|e| e.key() == key) {
            Some(e) => *e = entry,
            None => self.entries.push(entry),
        }
    }

    /// Records the measured times of tile `tile_out` of `layer` on a device of kind `device_kind`.
    pub fn record(
        &mut self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device_kind: &str,
        times: PhaseTimes,
        samples: u32,
    ) {
        self.insert(ProfileEntry::for_tile(
            layer,
            inputs,
            tile_out,
            device_kind,
            times,
            samples,
        ));
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("profile entries serialize")
    }

    /// Parses and validates profile JSON; `file` prefixes every error.
    pub fn from_json(text: &str, file: &str) -> Result<ProfileDb, ProfileError> {
        let db: ProfileDb = serde_json::from_str(text).map_err(|e| ProfileError::Parse {
            file: file.to_string(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })?;
        if db.version != PROFILE_VERSION {
            return Err(ProfileError::Version {
                file: file.to_string(),
                found: db.version,
            });
        }
        for (index, e) in db.entries.iter().enumerate() {
            let bad = |field: &'static str, message: String| ProfileError::Entry {
                file: file.to_string(),
                index,
                field,
                message,
            };
            if e.op.is_empty() {
                return Err(bad("op", "must not be empty".into()));
            }
            if !e.attrs.is_object() {
                return Err(bad("attrs", "must be an object".into()));
            }
            if e.device_kind.is_empty() {
                return Err(bad("device_kind", "must not be empty".into()));
            }
            let bad_shape = |s: &Vec<usize>| s.is_empty() || s.len() > 4 || s.contains(&0);
            if bad_shape(&e.tile) {
                return Err(bad(
                    "tile",
                    format!("{:?} is not a shape of 1 to 4 positive extents", e.tile),
                ));
            }
            if let Some(s) = e.inputs.iter().find(|s| s.len() > 4) {
                return Err(bad("inputs", format!("{s:?} has more than 4 dims")));
            }
            for (field, v) in [("forward_s", e.forward_s), ("backward_s", e.backward_s)] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(bad(field, format!("must be a time in seconds, got {v}")));
                }
            }
        }
        if let Some(l) = &db.links {
            let bad = |field: &'static str, message: String| ProfileError::Links {
                file: file.to_string(),
                field,
                message,
            };
            if !(l.bytes_per_s.is_finite() && l.bytes_per_s > 0.0) {
                return Err(bad(
                    "bytes_per_s",
                    format!("must be a positive bandwidth, got {}", l.bytes_per_s),
                ));
            }
            if !(l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return Err(bad(
                    "latency_s",
                    format!("must be a time in seconds, got {}", l.latency_s),
                ));
            }
        }
        if let Some(l) = &db.staged {
            let bad = |field: &'static str, message: String| ProfileError::Field {
                file: file.to_string(),
                field,
                message,
            };
            if !(l.bytes_per_s.is_finite() && l.bytes_per_s > 0.0) {
                return Err(bad(
                    "staged.bytes_per_s",
                    format!("must be a positive bandwidth, got {}", l.bytes_per_s),
                ));
            }
            if !(l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return Err(bad(
                    "staged.latency_s",
                    format!("must be a time in seconds, got {}", l.latency_s),
                ));
            }
        }
        if let Some(threads) = db.compute_threads
            && !(1..=MAX_THREADS).contains(&threads)
        {
            return Err(ProfileError::Field {
                file: file.to_string(),
                field: "compute_threads",
                message: format!("must be in 1..={MAX_THREADS}, got {threads}"),
            });
        }
        if let Some(r) = &db.runtime {
            r.validate().map_err(|message| ProfileError::Field {
                file: file.to_string(),
                field: "runtime",
                message,
            })?;
        }
        Ok(db)
    }

    /// `machine` as this profile measured it: every link priced by the measured transport and the
    /// devices sharing the measured compute pool, where the profile has them. A `one-gpu:N`
    /// machine (N devices sharing one GPU, whichever GPU that is) takes the kind of the GPU the
    /// profile measured, so that an H200's profile prices `one-gpu:N` as the H200 it ran on,
    /// if it measured the machine's precision (`h200-bf16` for a machine `with_precision` bf16;
    /// a kind without a precision suffix for fp32): a profile of another precision retags
    /// nothing, and its tiles are not looked up.
    pub fn apply_to(&self, mut machine: MachineModel) -> MachineModel {
        if machine.name().starts_with("one-gpu:")
            && let Some(kind) = self.only_device_kind()
            && of_precision(kind, machine.precision())
        {
            machine = machine.with_device_kind(kind);
        }
        // Both were validated on load (or come from the profiler), so neither can be refused.
        if let Some(l) = &self.links {
            machine = machine
                .with_all_links(l.link())
                .expect("a validated link profile");
        }
        if let Some(threads) = self.compute_threads {
            machine = machine
                .with_compute_slots(threads)
                .expect("a validated thread count");
        }
        if let Some(r) = self.runtime {
            machine = machine
                .with_runtime_costs(r)
                .expect("validated runtime costs");
        }
        machine
    }

    /// The one device kind every entry was measured on, if there is exactly one.
    pub fn only_device_kind(&self) -> Option<&str> {
        let first = self.entries.first()?.device_kind.as_str();
        self.entries
            .iter()
            .all(|e| e.device_kind == first)
            .then_some(first)
    }

    pub fn load(path: &Path) -> Result<ProfileDb, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|e| ProfileError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        ProfileDb::from_json(&text, &path.display().to_string())
    }

    /// Writes the database atomically (a temporary file renamed over `path`).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let io = |e: std::io::Error| ProfileError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        legion_ops::atomic_file::write(path, self.to_json().as_bytes()).map_err(io)
    }
}

/// Compute times from a profile database; tiles it lacks are scaled from a measured tile of the
/// same op (see the module docs), or priced by the roofline where the op has none.
#[derive(Debug)]
pub struct ProfiledCost {
    kinds: Vec<String>,
    measured: HashMap<ProfileKey, PhaseTimes>,
    /// The measured tiles by op, attributes and device kind: what a missing tile is scaled from.
    by_op: HashMap<OpKey, Vec<MeasuredTile>>,
    fallback: RooflineCost,
    hits: AtomicU64,
    scaled: AtomicU64,
    misses: AtomicU64,
}

/// Op kind, canonical attributes, device kind.
type OpKey = (String, String, String);

#[derive(Debug)]
struct MeasuredTile {
    tile: Vec<usize>,
    /// The channel extent (axis 1, else axis 0) of each input the tile reads: a convolution's or
    /// dense layer's tile is scaled only from tiles with the same input channels.
    channels: Vec<usize>,
    times: PhaseTimes,
}

fn channels_of(inputs: &[Vec<usize>]) -> Vec<usize> {
    inputs
        .iter()
        .map(|dims| dims.get(1).or(dims.first()).copied().unwrap_or(0))
        .collect()
}

impl ProfiledCost {
    pub fn new(db: &ProfileDb, machine: &MachineModel) -> ProfiledCost {
        let mut by_op: HashMap<OpKey, Vec<MeasuredTile>> = HashMap::new();
        for e in &db.entries {
            let key = e.key();
            by_op
                .entry((key.op, key.attrs, key.device_kind))
                .or_default()
                .push(MeasuredTile {
                    channels: channels_of(&key.inputs),
                    tile: key.tile,
                    times: e.times(),
                });
        }
        ProfiledCost {
            kinds: (0..machine.num_devices())
                .map(|d| machine.device(d).kind.clone())
                .collect(),
            measured: db.entries.iter().map(|e| (e.key(), e.times())).collect(),
            by_op,
            fallback: RooflineCost::new(machine),
            hits: AtomicU64::new(0),
            scaled: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Lookups answered from the database.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Lookups scaled from a measured tile of the same op.
    pub fn scaled(&self) -> u64 {
        self.scaled.load(Ordering::Relaxed)
    }

    /// Lookups priced by the roofline alone (no tile of their op measured).
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// `tile_out`'s times scaled from the measured tile of its op nearest in roofline time, if
    /// any fits `layer` (within its output shape; with the same input channels where it sums
    /// over them).
    fn scaled_from_nearest(
        &self,
        key: ProfileKey,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device: DeviceId,
    ) -> Option<PhaseTimes> {
        let candidates = self.by_op.get(&(key.op, key.attrs, key.device_kind))?;
        // An op that sums over its input's channels costs per output element in proportion to
        // them, which a tile's shape does not show: scale only between equal channel counts.
        let reduces = layer.op.spec().reduction_channels(inputs).is_some();
        let channels = channels_of(&key.inputs);
        let shape = layer.shape.dims();
        let target = self.fallback.phase_times(layer, inputs, tile_out, device);
        let (ratio, base, nearest) = candidates
            .iter()
            .filter(|c| {
                (!reduces || c.channels == channels)
                    && c.tile.len() == shape.len()
                    && c.tile.iter().zip(shape).all(|(t, s)| t <= s)
            })
            .filter_map(|c| {
                let base = self.fallback.phase_times(
                    layer,
                    inputs,
                    &Rect::new(&vec![0; c.tile.len()], &c.tile),
                    device,
                );
                let ratio = target.total() / base.total();
                ratio.is_finite().then_some((ratio, base, c))
            })
            .min_by(|a, b| a.0.ln().abs().total_cmp(&b.0.ln().abs()))?;
        // Per phase where the roofline prices both; else the whole tile's ratio.
        let scale = |measured: f64, target: f64, base: f64| {
            if base > 0.0 {
                measured * target / base
            } else {
                measured * ratio
            }
        };
        Some(PhaseTimes {
            forward: scale(nearest.times.forward, target.forward, base.forward),
            backward: scale(nearest.times.backward, target.backward, base.backward),
        })
    }
}

impl CostProvider for ProfiledCost {
    fn phase_times(
        &self,
        layer: &Layer,
        inputs: &[Shape],
        tile_out: &Rect,
        device: DeviceId,
    ) -> PhaseTimes {
        let key = ProfileKey::for_tile(layer, inputs, tile_out, &self.kinds[device]);
        if let Some(t) = self.measured.get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return *t;
        }
        if let Some(t) = self.scaled_from_nearest(key, layer, inputs, tile_out, device) {
            self.scaled.fetch_add(1, Ordering::Relaxed);
            return t;
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.fallback.phase_times(layer, inputs, tile_out, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::GraphBuilder;
    use legion_ops::op::Conv2d;

    fn conv_graph() -> legion_ops::Graph {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 32, 32)).unwrap();
        m.conv2d("c", x, Conv2d::new(16, 3).padding(1).relu())
            .unwrap();
        m.finish()
    }

    #[test]
    fn round_trip_and_lookup() {
        let g = conv_graph();
        let c = g.find("c").unwrap();
        let layer = g.layer(c);
        let inputs = g.input_shapes(c);
        let tile = Rect::new(&[0, 0, 0, 0], &[4, 16, 16, 32]);
        let mut db = ProfileDb::default();
        let times = PhaseTimes {
            forward: 1e-3,
            backward: 2e-3,
        };
        db.record(layer, &inputs, &tile, "p100", times, 5);
        db.record(layer, &inputs, &tile, "p100", times, 7);
        assert_eq!(db.entries.len(), 1, "same key replaces");
        assert_eq!(db.entries[0].inputs, vec![vec![4, 3, 17, 32]]);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        db.save(&path).unwrap();
        let back = ProfileDb::load(&path).unwrap();
        assert_eq!(back, db);

        let machine = MachineModel::preset("paper:2").unwrap();
        let cost = ProfiledCost::new(&back, &machine);
        assert_eq!(cost.compute_time(layer, &inputs, &tile, 1), 3e-3);
        assert_eq!((cost.hits(), cost.misses()), (1, 0));
        // the other samples' tile has the same shapes: the same measurement applies
        let samples = Rect::new(&[4, 0, 0, 0], &[8, 16, 16, 32]);
        assert_eq!(cost.compute_time(layer, &inputs, &samples, 0), 3e-3);
        // a quarter of the rows reads 9 input rows: not measured, so scaled from the measured
        // tile by the roofline's ratio between the two, phase by phase
        let other = Rect::new(&[0, 0, 0, 0], &[4, 16, 8, 32]);
        let t = cost.phase_times(layer, &inputs, &other, 1);
        let roofline = RooflineCost::new(&machine);
        let (want, base) = (
            roofline.phase_times(layer, &inputs, &other, 1),
            roofline.phase_times(layer, &inputs, &tile, 1),
        );
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
        assert!(
            close(t.forward, 1e-3 * want.forward / base.forward),
            "{t:?}"
        );
        assert!(
            close(t.backward, 2e-3 * want.backward / base.backward),
            "{t:?}"
        );
        assert!(t.total() < 3e-3 && t.total() > 0.0);
        assert_eq!((cost.hits(), cost.scaled(), cost.misses()), (2, 1, 0));
    }

    #[test]
    fn only_an_op_with_no_measured_tile_falls_back_to_the_roofline() {
        let mut m = GraphBuilder::new("t");
        let x = m.input("x", Shape::nchw(8, 3, 32, 32)).unwrap();
        let c = m.conv2d("c", x, Conv2d::new(16, 3).padding(1)).unwrap();
        let d = m.conv2d("d", c, Conv2d::new(16, 3).padding(1)).unwrap();
        let g = m.finish();
        let (c_inputs, d_inputs) = (g.input_shapes(c), g.input_shapes(d));
        let (c, d) = (g.layer(c), g.layer(d));
        let tile = Rect::new(&[0, 0, 0, 0], &[8, 16, 32, 32]);
        let mut db = ProfileDb::default();
        let times = PhaseTimes {
            forward: 1e-3,
            backward: 2e-3,
        };
        // c's tile measured; d has the same attributes but 16 input channels, not 3
        db.record(c, &c_inputs, &tile, "p100", times, 5);
        let machine = MachineModel::preset("paper:2").unwrap();
        let cost = ProfiledCost::new(&db, &machine);
        let t = cost.compute_time(d, &d_inputs, &tile, 0);
        assert_eq!(
            t,
            RooflineCost::new(&machine).compute_time(d, &d_inputs, &tile, 0)
        );
        assert_eq!((cost.hits(), cost.scaled(), cost.misses()), (0, 0, 1));
        // half of c's samples: scaled from the measured tile
        let half = Rect::new(&[0, 0, 0, 0], &[4, 16, 32, 32]);
        let t = cost.compute_time(c, &c_inputs, &half, 0);
        assert!(t > 0.0 && t < 3e-3, "{t}");
        assert_eq!((cost.hits(), cost.scaled(), cost.misses()), (0, 1, 1));
    }

    #[test]
    fn inserting_many_at_once_equals_inserting_each() {
        let g = conv_graph();
        let c = g.find("c").unwrap();
        let (layer, inputs) = (g.layer(c), g.input_shapes(c));
        let entry = |rows: usize, forward: f64| {
            let tile = Rect::new(&[0, 0, 0, 0], &[8, 16, rows, 32]);
            let times = PhaseTimes {
                forward,
                backward: 2.0 * forward,
            };
            ProfileEntry::for_tile(layer, &inputs, &tile, "h100", times, 3)
        };
        let batch = [entry(8, 1.0), entry(16, 2.0), entry(8, 3.0), entry(32, 4.0)];
        let mut each = ProfileDb::default();
        each.insert(entry(16, 9.0));
        let mut all = each.clone();
        for e in batch.clone() {
            each.insert(e);
        }
        all.insert_all(batch);
        assert_eq!(all, each);
        // the later of two equal keys wins, in the first one's place
        assert_eq!(all.entries.len(), 3);
        assert_eq!(all.entries[1].forward_s, 3.0);
        assert_eq!(all.entries[0].forward_s, 2.0);
    }

    #[test]
    fn several_profiles_keep_each_tiles_median() {
        let g = conv_graph();
        let c = g.find("c").unwrap();
        let (layer, inputs) = (g.layer(c), g.input_shapes(c));
        let entry = |rows: usize, forward: f64, backward: f64| {
            let tile = Rect::new(&[0, 0, 0, 0], &[8, 16, rows, 32]);
            let times = PhaseTimes { forward, backward };
            ProfileEntry::for_tile(layer, &inputs, &tile, "cpu", times, 2)
        };
        let profile = |entries: Vec<ProfileEntry>| ProfileDb {
            entries,
            compute_threads: Some(2),
            ..ProfileDb::default()
        };
        let merged = ProfileDb::median_of(&[
            profile(vec![entry(8, 1.0, 9.0), entry(16, 5.0, 5.0)]),
            profile(vec![entry(8, 3.0, 1.0)]),
            profile(vec![entry(8, 2.0, 4.0), entry(32, 7.0, 7.0)]),
            profile(vec![entry(16, 6.0, 8.0)]),
        ]);
        let times: Vec<(Vec<usize>, f64, f64, u32)> = merged
            .entries
            .iter()
            .map(|e| (e.tile.clone(), e.forward_s, e.backward_s, e.samples))
            .collect();
        assert_eq!(
            times,
            vec![
                // odd: the middle one, per phase
                (vec![8, 16, 8, 32], 2.0, 4.0, 6),
                // even: halfway between the middle two
                (vec![8, 16, 16, 32], 5.5, 6.5, 4),
                // one host's alone
                (vec![8, 16, 32, 32], 7.0, 7.0, 2),
            ]
        );
        assert_eq!(merged.compute_threads, None);
        assert_eq!(ProfileDb::median_of(&[]), ProfileDb::default());
    }

    #[test]
    fn attribute_order_does_not_matter() {
        let g = conv_graph();
        let c = g.find("c").unwrap();
        let tile = g.layer(c).shape.full_rect();
        let key = ProfileKey::for_tile(g.layer(c), &g.input_shapes(c), &tile, "cpu");
        let text = r#"{"version":1,"entries":[{"op":"conv2d",
            "attrs":{"stride":[1,1],"padding":[1,1],"out_channels":16,"kernel":[3,3],
                     "groups":1,"bias":true,"activation":"relu"},
            "inputs":[[8,3,32,32]],"tile":[8,16,32,32],"device_kind":"cpu",
            "forward_s":0.5,"backward_s":1.0}]}"#;
        let db = ProfileDb::from_json(text, "p.json").unwrap();
        assert_eq!(db.entries[0].key(), key);
        assert_eq!(db.entries[0].samples, 1);
    }

    #[test]
    fn bad_files_are_located() {
        let e = ProfileDb::from_json("{\"version\":1,\"entries\":[{]}", "p.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("p.json: line 1 column"), "{e}");
        let entry = r#"{"op":"relu","attrs":{},"inputs":[[2,2]],"tile":[2,2],"device_kind":"cpu","forward_s":-1,"backward_s":0}"#;
        let e = ProfileDb::from_json(
            &format!("{{\"version\":1,\"entries\":[{entry}]}}"),
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "p.json: entries[0].forward_s: must be a time in seconds, got -1"
        );
        let e = ProfileDb::from_json("{\"version\":2,\"entries\":[]}", "p.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("version 2 is not supported"), "{e}");
        let e = ProfileDb::from_json(
            &format!(
                "{{\"version\":1,\"entries\":[{}]}}",
                entry
                    .replace("[2,2]}", "[2,0]}")
                    .replace("\"tile\":[2,2]", "\"tile\":[2,0]")
            ),
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("entries[0].tile"), "{e}");
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"links":{"bytes_per_s":0,"latency_s":0}}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("p.json: links.bytes_per_s:"), "{e}");
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"staged":{"bytes_per_s":1e9,"latency_s":-1}}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("p.json: staged.latency_s:"), "{e}");
        let staged = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"staged":{"bytes_per_s":1e10,"latency_s":2e-5}}"#,
            "p.json",
        )
        .unwrap();
        assert_eq!(staged.staged.map(|l| l.link().bytes_per_s), Some(1e10));
        assert!(staged.to_json().contains("\"staged\""));
    }

    #[test]
    fn links_and_threads_are_optional_and_shape_the_machine() {
        let old = ProfileDb::from_json(r#"{"version":1,"entries":[]}"#, "p.json").unwrap();
        assert_eq!(old.links, None);
        assert!(!old.to_json().contains("links"), "no links, no field");
        let machine = MachineModel::preset("local-cpu:3").unwrap();
        assert_eq!(old.apply_to(machine.clone()), machine);

        let db = ProfileDb {
            links: Some(LinkProfile {
                bytes_per_s: 1e9,
                latency_s: 1e-4,
                samples: 10,
            }),
            compute_threads: Some(2),
            ..ProfileDb::default()
        };
        let back = ProfileDb::from_json(&db.to_json(), "p.json").unwrap();
        assert_eq!(back, db);
        let measured = back.apply_to(machine);
        for (a, b) in [(0, 1), (2, 0), (1, 2)] {
            assert_eq!(measured.message_time(a, b, 1e6), 1e-3 + 1e-4);
        }
        assert_eq!(measured.compute_slots(), Some(2));
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"compute_threads":0}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "p.json: compute_threads: must be in 1..=4096, got 0");
    }

    #[test]
    fn one_gpu_takes_the_kind_of_the_gpu_its_profile_measured() {
        let entry = |kind: &str| ProfileEntry {
            op: "relu".into(),
            attrs: Value::Null,
            inputs: vec![vec![2, 2]],
            tile: vec![2, 2],
            device_kind: kind.into(),
            forward_s: 1e-6,
            backward_s: 1e-6,
            samples: 1,
        };
        let h200 = ProfileDb {
            entries: vec![entry("h200"), entry("h200")],
            ..ProfileDb::default()
        };
        assert_eq!(h200.only_device_kind(), Some("h200"));
        let one_gpu = h200.apply_to(MachineModel::preset("one-gpu:2").unwrap());
        assert_eq!(one_gpu.device(1).kind, "h200");
        // Other machines keep their devices; a profile of several kinds retags nothing.
        let paper = h200.apply_to(MachineModel::preset("paper:2").unwrap());
        assert_eq!(paper.device(0).kind, "p100");
        let mixed = ProfileDb {
            entries: vec![entry("h200"), entry("h100")],
            ..ProfileDb::default()
        };
        assert_eq!(mixed.only_device_kind(), None);
        let kept = mixed.apply_to(MachineModel::preset("one-gpu:2").unwrap());
        assert_eq!(kept.device(0).kind, "h100");
        // A machine in bf16 takes the kind of a bf16 profile only: an fp32 profile's tiles are
        // not bf16's.
        let bf16 = |db: &ProfileDb| {
            let m = MachineModel::preset("one-gpu:2").unwrap();
            db.apply_to(m.with_precision(Precision::Bf16))
                .device(0)
                .kind
                .clone()
        };
        assert_eq!(bf16(&h200), "h100-bf16");
        let h200_bf16 = ProfileDb {
            entries: vec![entry("h200-bf16")],
            ..ProfileDb::default()
        };
        assert_eq!(bf16(&h200_bf16), "h200-bf16");
        let fp32 = h200_bf16.apply_to(MachineModel::preset("one-gpu:2").unwrap());
        assert_eq!(fp32.device(0).kind, "h100");
    }

    #[test]
    fn runtime_costs_are_optional_validated_and_shape_the_machine() {
        let old = ProfileDb::from_json(r#"{"version":1,"entries":[]}"#, "p.json").unwrap();
        assert_eq!(old.runtime, None);
        assert!(!old.to_json().contains("runtime"));
        let costs = RuntimeCosts {
            dispatch_s: 1e-4,
            runtime_cpu_s: 2e-5,
            fold_bytes_per_s: 3e9,
            update_bytes_per_s: 2e9,
            copy_bytes_per_s: 4e9,
            dispatch_bins_s: None,
            actor_threads: 2,
        };
        let db = ProfileDb {
            runtime: Some(costs),
            ..ProfileDb::default()
        };
        let back = ProfileDb::from_json(&db.to_json(), "p.json").unwrap();
        assert_eq!(back, db);
        assert!(!db.to_json().contains("dispatch_bins_s"));
        let machine = back.apply_to(MachineModel::preset("local-cpu:2").unwrap());
        assert_eq!(machine.runtime_costs(), Some(&costs));
        let spread = ProfileDb {
            runtime: Some(RuntimeCosts {
                dispatch_bins_s: Some(std::array::from_fn(|b| b as f64 / 65536.0)),
                ..costs
            }),
            ..ProfileDb::default()
        };
        assert_eq!(
            ProfileDb::from_json(&spread.to_json(), "p.json").unwrap(),
            spread
        );
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"runtime":{"dispatch_s":-1,"fold_bytes_per_s":1,"update_bytes_per_s":1,"copy_bytes_per_s":1,"actor_threads":1}}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("p.json: runtime: ") && e.contains("dispatch_s"),
            "{e}"
        );
        // A runtime block from before `runtime_cpu_s` loads with none; a negative one is refused.
        let before = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"runtime":{"dispatch_s":0.001,"fold_bytes_per_s":1,"update_bytes_per_s":1,"copy_bytes_per_s":1,"actor_threads":1}}"#,
            "p.json",
        )
        .unwrap();
        assert_eq!(before.runtime.unwrap().runtime_cpu_s, 0.0);
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"runtime":{"dispatch_s":0,"runtime_cpu_s":-1e-6,"fold_bytes_per_s":1,"update_bytes_per_s":1,"copy_bytes_per_s":1,"actor_threads":1}}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("runtime_cpu_s"), "{e}");
        let e = ProfileDb::from_json(
            r#"{"version":1,"entries":[],"runtime":{"dispatch_s":0}}"#,
            "p.json",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("fold_bytes_per_s"), "{e}");
    }
}
