//! The state directory of a cluster and what `up` records in it: links, interfaces, GPU counts,
//! certificates.

use super::*;

/// The state directory of the cluster described by `hosts_file`: `state` if given, else the
/// default described in the module docs.
pub fn state_dir(hosts_file: &Path, state: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(s) = state {
        return Ok(s.to_path_buf());
    }
    let absolute = std::path::absolute(hosts_file)
        .with_context(|| format!("{}: resolving the path", hosts_file.display()))?;
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => {
            PathBuf::from(std::env::var_os("HOME").context("HOME is not set; pass --state DIR")?)
                .join(".local/state")
        }
    };
    let stem = hosts_file
        .file_name()
        .map(|s| {
            s.to_string_lossy()
                .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_")
        })
        .unwrap_or_else(|| "cluster".into());
    Ok(base.join("legion-rs").join(format!(
        "{stem}-{:016x}",
        fnv1a(absolute.as_os_str().as_encoded_bytes())
    )))
}

/// The cluster a command is pointed at, and where its state is.
#[derive(Clone, Debug)]
pub struct Located {
    /// The hosts file to read: the one given, or for a Slurm job's cluster the one `up` wrote in
    /// its state directory.
    pub hosts_file: PathBuf,
    pub state: PathBuf,
    /// For a Slurm job's cluster: how its nodes run their workers (`up` reads the allocation).
    pub slurm: Option<SlurmNodes>,
}

impl Located {
    /// How messages name the cluster.
    pub fn label(&self) -> String {
        match &self.slurm {
            Some(_) => "the Slurm job's nodes".to_string(),
            None => self.hosts_file.display().to_string(),
        }
    }

    /// Its hosts as listed (a host that runs one device per GPU without the count `up`
    /// recorded); for a Slurm job's cluster, the nodes `up` found, or an error saying to run
    /// `up` first.
    pub fn hosts(&self) -> anyhow::Result<Hosts> {
        if self.slurm.is_some() && !self.hosts_file.exists() {
            bail!(
                "no cluster was started in this Slurm job ({} does not exist): run `legion-rs up \
                 --slurm` first{}",
                self.hosts_file.display(),
                match std::env::current_dir() {
                    Ok(dir) => format!(" (in {}, or pass --state)", dir.display()),
                    Err(_) => String::new(),
                }
            );
        }
        Ok(Hosts::load(&self.hosts_file)?)
    }

    /// Its hosts with every device count known ([`load_hosts`]), as a job needs them.
    pub fn load_hosts(&self) -> anyhow::Result<Hosts> {
        self.hosts()?;
        load_hosts(&self.hosts_file, &self.state)
    }

    /// Fails where `up` never kept a cluster's state here, naming the state directories `up`
    /// used for this hosts file (its default one, and any given with `--state`).
    pub fn require_state(&self) -> anyhow::Result<()> {
        if self.slurm.is_some() || self.state.join(STATE_MARK).exists() {
            return Ok(());
        }
        let known: Vec<String> = known_state_dirs(&self.hosts_file)
            .into_iter()
            .filter(|d| *d != self.state && d.join(STATE_MARK).exists())
            .map(|d| format!("--state {}", d.display()))
            .collect();
        let hosts = self.hosts_file.display();
        match known.as_slice() {
            [] => bail!(
                "no cluster state in {} (start the cluster with `legion-rs up {hosts}` first)",
                self.state.display()
            ),
            _ => bail!(
                "no cluster state in {}; `legion-rs up {hosts}` kept it in another directory: \
                 pass {}",
                self.state.display(),
                known.join(", or ")
            ),
        }
    }

    /// The command line flags that name this cluster to `legion-rs down` (in messages).
    pub(super) fn down_command(&self) -> String {
        match &self.slurm {
            Some(_) => format!("legion-rs down --slurm --state {}", self.state.display()),
            None => format!(
                "legion-rs down {} --state {}",
                self.hosts_file.display(),
                self.state.display()
            ),
        }
    }
}

/// The cluster `hosts_file` describes, with its state directory (`state` where given): a hosts
/// file as it is, or, for `None` (`--slurm`) or a file with `[slurm]`, the Slurm job this
/// process runs in, whose state directory is `legion-rs-slurm-<job>` in the current folder (the
/// job's working folder, which its nodes share).
pub fn locate(hosts_file: Option<&Path>, state: Option<&Path>) -> anyhow::Result<Located> {
    let settings = match hosts_file {
        None => SlurmNodes::default(),
        Some(path) => match ClusterFile::load(path) {
            Ok(ClusterFile::Slurm(settings)) => settings,
            // An unreadable or invalid file is reported by whoever loads its hosts.
            Ok(ClusterFile::Hosts(_)) | Err(_) => {
                return Ok(Located {
                    hosts_file: path.to_path_buf(),
                    state: state_dir(path, state)?,
                    slurm: None,
                });
            }
        },
    };
    let state = match state {
        Some(s) => std::path::absolute(s)
            .with_context(|| format!("{}: resolving the path", s.display()))?,
        None => {
            let job = slurm::job_id(&|k| std::env::var(k).ok())?;
            let folder = std::env::current_dir().context("finding the current folder")?;
            slurm::state_dir(&folder, &job)
        }
    };
    Ok(Located {
        hosts_file: state.join("hosts.toml"),
        state,
        slurm: Some(settings),
    })
}

/// What every state directory `up` made holds: its certificate authority.
const STATE_MARK: &str = "ca";

/// Where the state directories `up` used for `hosts_file` are listed, one a line: beside its
/// default state directory.
fn state_dirs_list(hosts_file: &Path) -> Option<PathBuf> {
    let default = state_dir(hosts_file, None).ok()?;
    let mut name = default.file_name()?.to_os_string();
    name.push(".state-dirs");
    Some(default.with_file_name(name))
}

/// The state directories `up` used for `hosts_file`: its default one first.
pub fn known_state_dirs(hosts_file: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = state_dir(hosts_file, None).into_iter().collect();
    if let Some(text) = state_dirs_list(hosts_file).and_then(|l| std::fs::read_to_string(l).ok()) {
        dirs.extend(text.lines().filter(|l| !l.is_empty()).map(PathBuf::from));
    }
    dirs.dedup();
    dirs
}

/// Adds `state` to the state directories used for `hosts_file` (best effort: the list only
/// helps messages).
pub(super) fn record_state_dir(hosts_file: &Path, state: &Path) {
    let (Some(list), Ok(state)) = (state_dirs_list(hosts_file), std::path::absolute(state)) else {
        return;
    };
    let mut dirs = known_state_dirs(hosts_file);
    if dirs.contains(&state) || state_dir(hosts_file, None).ok().as_ref() == Some(&state) {
        return;
    }
    dirs.push(state);
    let text: String = dirs
        .iter()
        .skip(1)
        .map(|d| format!("{}\n", d.display()))
        .collect();
    if let Some(parent) = list.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    if let Err(e) = legion_ops::atomic_file::write(&list, text.as_bytes()) {
        tracing::debug!("recording the state directory in {}: {e}", list.display());
    }
}

/// A stable hash (unlike std's), so the default state directory survives a rebuild.
pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The links `up` measured, as saved in `<state>/links.json`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct MeasuredLink {
    pub from: String,
    pub to: String,
    pub bytes_per_s: f64,
    pub latency_s: f64,
    /// The transport's CPU seconds per byte at the sender and at the receiver (0: not measured,
    /// as in files from before they were).
    #[serde(default)]
    pub send_cpu_s_per_byte: f64,
    #[serde(default)]
    pub recv_cpu_s_per_byte: f64,
}

/// A host's network interface as `up` measured it (saved in `<state>/nics.json`): what it sent
/// to every peer at once. Where about one peer's link bandwidth, one interface carries all of the
/// host's traffic (see `legion-rs`'s machine model: a shared NIC per node).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct MeasuredNic {
    pub host: String,
    pub peers: u32,
    pub bytes_per_s: f64,
}

/// Where `up` saves the network interfaces it measured.
pub fn nics_path(state: &Path) -> PathBuf {
    state.join("nics.json")
}

/// The network interfaces `up` measured; none where it has not (one host, or an older state).
pub fn load_nics(state: &Path) -> anyhow::Result<Vec<MeasuredNic>> {
    load_measured(&nics_path(state), "measured network interfaces")
}

/// The list `up` saved at `path` (`what` names it in errors); empty where there is no file.
pub(super) fn load_measured<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
) -> anyhow::Result<Vec<T>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a list of {what}", path.display()))
}

/// Where `up` saves the links it measured.
pub fn links_path(state: &Path) -> PathBuf {
    state.join("links.json")
}

pub fn load_links(state: &Path) -> anyhow::Result<Vec<MeasuredLink>> {
    load_measured(&links_path(state), "measured links")
}

/// Where `up` records the device counts of hosts that run one device per GPU.
pub fn gpu_counts_path(state: &Path) -> PathBuf {
    state.join("gpu_counts.json")
}

/// The hosts file at `path` with every device count known: the counts of hosts that run one
/// device per GPU come from what `up` recorded in `state` (see [`Host::devices_from_gpus`]).
pub fn load_hosts(path: &Path, state: &Path) -> anyhow::Result<Hosts> {
    let hosts = Hosts::load(path)?;
    if !hosts.hosts.iter().any(|h| h.devices_from_gpus) {
        return Ok(hosts);
    }
    let counts_path = gpu_counts_path(state);
    let counts: HashMap<String, usize> = match std::fs::read_to_string(&counts_path) {
        Ok(text) => serde_json::from_str(&text).with_context(|| {
            format!("{}: expected {{host: device count}}", counts_path.display())
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", counts_path.display())),
    };
    hosts
        .with_gpu_counts(&counts)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Creates the CA and the certificates that are missing; existing ones are kept, so re-running
/// `up` changes nothing that running workers use.
pub(super) fn ensure_identities(hosts: &Hosts, state: &Path) -> anyhow::Result<()> {
    let ca = if state.join("ca/ca.pem").exists() {
        ClusterCa::load(state)?
    } else {
        let ca = ClusterCa::generate()?;
        ca.save(state)?;
        ca
    };
    let mut names: Vec<(String, Vec<String>)> = vec![(LAUNCHER_NAME.to_string(), Vec::new())];
    for h in &hosts.hosts {
        names.push((node_name(&h.name), vec![h.address.clone()]));
    }
    for (name, addresses) in names {
        if !NodeIdentity::dir(state, &name).join("cert.pem").exists() {
            ca.issue(&name, &addresses)?.save(state)?;
        }
    }
    Ok(())
}
