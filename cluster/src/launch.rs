//! `legion-rs up / status / down`: the cluster's state directory, starting one worker per host
//! (a child process for a loopback host, the system `ssh` client otherwise), waiting for them to
//! register, measuring the links between them, and stopping them.
//!
//! State directory (see also `net::tls`), by default `$XDG_STATE_HOME/legion-rs/<stem>-<hash>`
//! (`~/.local/state/...` without XDG_STATE_HOME), where `<stem>` is the hosts file's name and
//! `<hash>` a hash of its absolute path, so that two clusters never share state; `--state DIR`
//! overrides it. Remote workers use the same absolute path on their host.
//!
//! ```text
//! <state>/ca/, <state>/nodes/<name>/   certificates (net::tls); `launcher` is the client identity
//! <state>/logs/<name>.log              each worker's stdout and stderr
//! <state>/links.json                   link bandwidth and latency measured by `up`
//! <state>/gpu_counts.json              devices of each `device = "cuda"` host without `devices`:
//!                                      its GPU count, as its worker found it
//! ```
//!
//! Slurm: the nodes of the allocation `up` runs in (see [`crate::slurm`]): `up` writes them as
//! `<state>/hosts.toml` and starts their workers in one `srun` step, recorded in
//! `<state>/slurm.json`; `down` also ends that step.
//!
//! Remote hosts: `up` runs `ssh DEST sh -s` (the command in `LEGION_RS_SSH`, default `ssh -o
//! BatchMode=yes`; a destination may be `ssh://user@host:port`), feeding it a script that writes
//! the host's certificate files and starts the worker in the background. The `legion-rs` binary
//! there is the host's `binary` (hosts.toml), by default the same path as here (as with MPI
//! launchers); the script checks that it exists before starting it.

use crate::control::{Control, LinkMeasurement, PeerAddress};
use crate::hosts::{ClusterFile, Host, Hosts, SlurmNodes};
use crate::net::tls::{ClusterCa, NodeIdentity, node_name};
use crate::remote::{LAUNCHER_NAME, WorkerClient};
use crate::slurm;
use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long `up` waits for all workers by default.
pub const DEFAULT_REGISTER_TIMEOUT: Duration = Duration::from_secs(20);
/// Bytes of the larger bandwidth probe between two workers (the other is a quarter of it).
const PROBE_BYTES: u64 = 16 << 20;

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

    /// The command line flags that name this cluster to `legion-rs down` (in messages).
    fn down_command(&self) -> String {
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

/// A stable hash (unlike std's), so the default state directory survives a rebuild.
fn fnv1a(bytes: &[u8]) -> u64 {
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
fn load_measured<T: serde::de::DeserializeOwned>(
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
fn ensure_identities(hosts: &Hosts, state: &Path) -> anyhow::Result<()> {
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

/// One host's line in the cluster table.
pub struct HostStatus {
    pub host: Host,
    /// `None`: did not answer.
    pub welcome: Option<Welcome>,
    /// `up` started it in this run.
    pub started: bool,
}

pub struct Welcome {
    pub pid: u32,
    pub version: String,
    pub devices: u32,
    pub uptime_s: f64,
    pub job_of: Option<String>,
}

/// Asks worker `i` who it is; `None` if it does not answer within `timeout`.
fn greet(client: &mut WorkerClient, i: usize, timeout: Duration) -> Option<Welcome> {
    client.connect(i, timeout).ok()?;
    let hello = Control::Hello {
        version: env!("CARGO_PKG_VERSION").into(),
    };
    match client.request(i, &hello, Some(timeout)).ok()? {
        Control::Welcome {
            pid,
            version,
            devices,
            uptime_s,
            job_of,
            ..
        } => Some(Welcome {
            pid,
            version,
            devices,
            uptime_s,
            job_of,
        }),
        _ => None,
    }
}

pub struct UpOptions {
    pub timeout: Duration,
    /// Measure the links even if `links.json` exists and no worker was started.
    pub measure: bool,
}

/// `legion-rs up` for a cluster [`locate`] found: a hosts file's, or a Slurm job's, whose nodes
/// it reads from the allocation first and writes to `cluster.hosts_file`. Returns the table
/// and the hosts.
pub fn up_located(
    cluster: &Located,
    options: &UpOptions,
) -> anyhow::Result<(Vec<HostStatus>, Hosts)> {
    let Some(settings) = &cluster.slurm else {
        let hosts = Hosts::load(&cluster.hosts_file)?;
        return Ok((
            up(&cluster.hosts_file, &hosts, &cluster.state, options)?,
            hosts,
        ));
    };
    let allocation = slurm::Allocation::read(&|k| std::env::var(k).ok(), &mut |args| {
        slurm::run("scontrol", args)
    })?;
    std::fs::create_dir_all(cluster.state.join("logs"))
        .with_context(|| format!("creating the state directory {}", cluster.state.display()))?;
    let binary = std::env::current_exe().context("locating the legion-rs binary")?;
    let text = allocation.hosts_toml(settings, &binary)?;
    // Checked as any hosts file is, so that what the workers read is valid.
    let hosts = Hosts::parse(&text, &cluster.hosts_file.display().to_string())?;
    legion_ops::atomic_file::write(&cluster.hosts_file, text.as_bytes())
        .with_context(|| format!("writing {}", cluster.hosts_file.display()))?;
    let table = up_with(
        cluster,
        &hosts,
        options,
        Launcher::SlurmStep {
            job: &allocation.job_id,
        },
    )?;
    Ok((table, hosts))
}

/// `legion-rs up`: starts the workers that are not running, waits for all, measures links.
///
/// An `up` that fails part-way stops the workers it started (those already running are left as
/// they were), and its error says which it stopped and what, if anything, is left running.
pub fn up(
    hosts_file: &Path,
    hosts: &Hosts,
    state: &Path,
    options: &UpOptions,
) -> anyhow::Result<Vec<HostStatus>> {
    let cluster = Located {
        hosts_file: hosts_file.to_path_buf(),
        state: state.to_path_buf(),
        slurm: None,
    };
    up_with(&cluster, hosts, options, Launcher::PerHost)
}

/// How `up` starts the workers that are not running.
#[derive(Clone, Copy)]
enum Launcher<'a> {
    /// Each host's own way: a child process, or ssh.
    PerHost,
    /// One `srun` step of this job for all of them (Slurm nodes).
    SlurmStep { job: &'a str },
}

fn up_with(
    cluster: &Located,
    hosts: &Hosts,
    options: &UpOptions,
    launcher: Launcher,
) -> anyhow::Result<Vec<HostStatus>> {
    let state = cluster.state.as_path();
    std::fs::create_dir_all(state.join("logs"))
        .with_context(|| format!("creating the state directory {}", state.display()))?;
    ensure_identities(hosts, state)?;
    let mut client = WorkerClient::new(hosts, state)?;
    let mut table = Vec::new();
    // The processes of the workers started here on this machine, to notice one that exits, and
    // to stop if `up` fails.
    let mut children = Vec::new();
    // The `srun` of the step that runs them, on Slurm.
    let mut step = None;
    let started = start_and_register(
        cluster,
        hosts,
        options,
        launcher,
        &mut client,
        &mut table,
        &mut children,
        &mut step,
    );
    if let Err(e) = started {
        let cleanup = stop_started(cluster, &mut client, &table, &mut children, step, launcher);
        client.close();
        return Err(anyhow::anyhow!("{e:#}\n{cleanup}"));
    }
    client.close();
    Ok(table)
}

/// The work of [`up`] that may fail once workers run: starts each worker that does not answer
/// (recording it in `table` and `children` as soon as it is started), waits for all to register,
/// records GPU device counts and measures the links.
#[allow(clippy::too_many_arguments)]
fn start_and_register(
    cluster: &Located,
    hosts: &Hosts,
    options: &UpOptions,
    launcher: Launcher,
    client: &mut WorkerClient,
    table: &mut Vec<HostStatus>,
    children: &mut Vec<Option<std::process::Child>>,
    step: &mut Option<std::process::Child>,
) -> anyhow::Result<()> {
    let (hosts_file, state) = (cluster.hosts_file.as_path(), cluster.state.as_path());
    for (i, host) in hosts.hosts.iter().enumerate() {
        let welcome = greet(client, i, Duration::from_millis(500));
        // A host that runs one device per GPU has the count its worker found.
        if let Some(w) = &welcome
            && !host.devices_from_gpus
            && w.devices as usize != host.devices
        {
            bail!(
                "{}: worker {} runs with {} device(s) but {} says {}; stop it first (`{}`)",
                host.endpoint(),
                host.name,
                w.devices,
                hosts_file.display(),
                host.devices,
                cluster.down_command()
            );
        }
        let started = welcome.is_none();
        let child = match (started, launcher) {
            (true, Launcher::PerHost) => start_worker(host, state)?,
            // Started below, all in one step.
            (true, Launcher::SlurmStep { .. }) | (false, _) => None,
        };
        children.push(child);
        table.push(HostStatus {
            host: host.clone(),
            welcome,
            started,
        });
    }
    if let Launcher::SlurmStep { job } = launcher {
        let missing: Vec<&Host> = table
            .iter()
            .filter(|r| r.started)
            .map(|r| &r.host)
            .collect();
        if let Some(first) = missing.first() {
            // Every node's entry names the same binary (`[slurm]`'s, or this one's path).
            let binary = match &first.binary {
                Some(path) => PathBuf::from(path),
                None => std::env::current_exe().context("locating the legion-rs binary")?,
            };
            let names: Vec<String> = missing.iter().map(|h| h.name.clone()).collect();
            *step = Some(start_slurm_step(job, &names, state, &binary)?);
        }
    }
    let deadline = Instant::now() + options.timeout;
    for (i, row) in table.iter_mut().enumerate() {
        while row.welcome.is_none() {
            let log = state.join("logs").join(format!("{}.log", row.host.name));
            if let Some(srun) = step
                && let Ok(Some(status)) = srun.try_wait()
            {
                let srun_log = state.join("logs").join("srun.log");
                let said = [&log, &srun_log]
                    .iter()
                    .filter_map(|p| last_line(p))
                    .collect::<Vec<_>>()
                    .join("; ");
                bail!(
                    "the srun step of the workers exited ({status}) before worker {} ({}) \
                     registered: {}; see {} and {}",
                    row.host.name,
                    row.host.endpoint(),
                    if said.is_empty() {
                        "it wrote nothing"
                    } else {
                        &said
                    },
                    log.display(),
                    srun_log.display()
                );
            }
            if let Some(child) = &mut children[i]
                && let Ok(Some(status)) = child.try_wait()
            {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                let last = said
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(|l| l.trim().trim_start_matches("error: "));
                bail!(
                    "worker {} ({}) exited ({status}) before registering: {}; its log: {}",
                    row.host.name,
                    row.host.endpoint(),
                    last.unwrap_or("it wrote nothing"),
                    log.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "worker {} ({}) did not register within {:.0} s; see its log {}",
                    row.host.name,
                    row.host.endpoint(),
                    options.timeout.as_secs_f64(),
                    log.display()
                );
            }
            row.welcome = greet(client, i, Duration::from_millis(500));
            if row.welcome.is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    let mut gpu_counts: BTreeMap<String, usize> = BTreeMap::new();
    for row in table.iter_mut() {
        if let (true, Some(w)) = (row.host.devices_from_gpus, &row.welcome) {
            row.host.devices = w.devices as usize;
            gpu_counts.insert(row.host.name.clone(), row.host.devices);
        }
    }
    if !gpu_counts.is_empty() {
        let path = gpu_counts_path(state);
        let text = serde_json::to_string_pretty(&gpu_counts)? + "\n";
        legion_ops::atomic_file::write(&path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let any_started = table.iter().any(|r| r.started);
    if hosts.hosts.len() > 1 && (any_started || options.measure || !links_path(state).exists()) {
        let (links, nics) = measure(client, hosts)?;
        for (path, text) in [
            (
                links_path(state),
                serde_json::to_string_pretty(&links)? + "\n",
            ),
            (
                nics_path(state),
                serde_json::to_string_pretty(&nics)? + "\n",
            ),
        ] {
            legion_ops::atomic_file::write(&path, text.as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The last line with content of a log, without its `error: ` prefix.
fn last_line(path: &Path) -> Option<String> {
    let said = std::fs::read_to_string(path).ok()?;
    said.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().trim_start_matches("error: ").to_string())
}

/// Starts `srun` for the workers of `nodes` of Slurm job `job`, running `binary` there (see
/// [`slurm::srun_args`]), and records the job for `down`. `srun` stays in the background after
/// `up` exits: the step lives as long as it does.
fn start_slurm_step(
    job: &str,
    nodes: &[String],
    state: &Path,
    binary: &Path,
) -> anyhow::Result<std::process::Child> {
    let log_path = state.join("logs").join("srun.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let child = Command::new("srun")
        .args(slurm::srun_args(job, nodes, state, binary))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a Ctrl-C meant for the shell that ran `up` does not end the
        // step (srun ends it on SIGINT).
        .process_group(0)
        .spawn()
        .context("starting `srun` (are Slurm's client commands installed here?)")?;
    slurm::record_job(
        state,
        &slurm::RecordedJob {
            job_id: job.to_string(),
            srun_pid: child.id(),
            srun_host: this_host(),
        },
    )?;
    Ok(child)
}

/// This machine's host name, to tell whether a recorded process is on it.
fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// After a failed `up`: stops the workers this `up` started, and says what it stopped and what is
/// left. A local worker is killed through its process; a remote one is asked to shut down if it
/// registered, and otherwise (it may still be starting) named with the command that stops it.
/// A Slurm step it started is ended as a whole.
fn stop_started(
    cluster: &Located,
    client: &mut WorkerClient,
    table: &[HostStatus],
    children: &mut [Option<std::process::Child>],
    step: Option<std::process::Child>,
    launcher: Launcher,
) -> String {
    let mut stopped = Vec::new();
    let mut left = Vec::new();
    if let (Launcher::SlurmStep { job }, Some(mut srun)) = (launcher, step) {
        let started: Vec<String> = table
            .iter()
            .filter(|r| r.started)
            .map(|r| r.host.name.clone())
            .collect();
        // An srun that exited (the failure, often) has ended its step: nothing to stop.
        let running = matches!(srun.try_wait(), Ok(None));
        match slurm::end_steps(job, Duration::from_secs(10)) {
            Ok(_) => {
                let _ = srun.kill();
                let _ = srun.wait();
                if running {
                    stopped.extend(started);
                }
            }
            Err(e) => left.push(format!(
                "{} (in a step of job {job}: {e:#})",
                started.join(", ")
            )),
        }
    }
    for (i, row) in table.iter().enumerate() {
        let name = &row.host.name;
        if !row.started {
            left.push(format!("{name} (running before this `up`)"));
            continue;
        }
        if let Launcher::SlurmStep { .. } = launcher {
            continue;
        }
        if let Some(child) = children.get_mut(i).and_then(Option::as_mut) {
            // One that exited on its own (the failure, often) needs no stopping.
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
                stopped.push(name.clone());
            }
            continue;
        }
        let shut_down = row.welcome.is_some()
            && client
                .request(i, &Control::Shutdown, Some(Duration::from_secs(3)))
                .is_ok();
        match shut_down {
            true => stopped.push(name.clone()),
            false => left.push(format!(
                "{name} (on {}, started over ssh, did not answer)",
                row.host.address
            )),
        }
    }
    let mut note = match stopped.is_empty() {
        // Those it started had exited on their own, or it started none.
        true => "no worker this up started is left running".to_string(),
        false => format!(
            "up stopped the worker(s) it had started: {}",
            stopped.join(", ")
        ),
    };
    if !left.is_empty() {
        note += &format!(
            "; still running or starting: {}; stop them with `{}`",
            left.join(", "),
            cluster.down_command()
        );
    }
    note
}

/// Every worker probes every other one, then all of them at once.
fn measure(
    client: &WorkerClient,
    hosts: &Hosts,
) -> anyhow::Result<(Vec<MeasuredLink>, Vec<MeasuredNic>)> {
    let mut out = Vec::new();
    let mut nics = Vec::new();
    for (i, host) in hosts.hosts.iter().enumerate() {
        let peers: Vec<PeerAddress> = hosts
            .hosts
            .iter()
            .filter(|h| h.name != host.name)
            .map(|h| PeerAddress {
                name: h.name.clone(),
                endpoint: h.endpoint(),
            })
            .collect();
        let request = Control::MeasureLinks {
            peers,
            probe_bytes: PROBE_BYTES,
        };
        match client.request(i, &request, Some(Duration::from_secs(120)))? {
            Control::Links { links, nic } => {
                nics.extend(nic.map(|n| MeasuredNic {
                    host: host.name.clone(),
                    peers: n.peers,
                    bytes_per_s: n.bytes_per_s,
                }));
                out.extend(links.into_iter().map(|l: LinkMeasurement| MeasuredLink {
                    from: host.name.clone(),
                    to: l.to,
                    bytes_per_s: l.bytes_per_s,
                    latency_s: l.latency_s,
                    send_cpu_s_per_byte: l.send_cpu_s_per_byte,
                    recv_cpu_s_per_byte: l.recv_cpu_s_per_byte,
                }))
            }
            other => bail!(
                "worker {}: answered MeasureLinks with {}",
                host.name,
                other.name()
            ),
        }
    }
    Ok((out, nics))
}

/// The command line of a worker for `host`.
fn worker_args(host: &Host, state: &Path) -> Vec<String> {
    vec![
        "worker".into(),
        "--state".into(),
        state.display().to_string(),
        "--name".into(),
        host.name.clone(),
        "--listen".into(),
        host.endpoint(),
        "--devices".into(),
        match host.devices_from_gpus {
            true => "gpus".to_string(),
            false => host.devices.to_string(),
        },
        "--device".into(),
        if host.device_kind == crate::hosts::GPU_KIND {
            "cuda"
        } else {
            "cpu"
        }
        .into(),
    ]
}

/// Starts the worker of `host`; returns its process where it runs on this machine.
fn start_worker(host: &Host, state: &Path) -> anyhow::Result<Option<std::process::Child>> {
    let exe = match &host.binary {
        Some(path) => PathBuf::from(path),
        None => std::env::current_exe().context("locating the legion-rs binary")?,
    };
    let log_path = state.join("logs").join(format!("{}.log", host.name));
    if host.is_local() {
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let mut command = match host.run_with.split_first() {
            Some((program, prefix)) => {
                let mut c = Command::new(program);
                c.args(prefix).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let child = command
            .args(worker_args(host, state))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group: a Ctrl-C meant for `up` does not reach the workers.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting the worker of {} ({})", host.name, exe.display()))?;
        return Ok(Some(child));
    }
    let dest = host.ssh.clone().unwrap_or_else(|| host.address.clone());
    let script = remote_script(host, state, &exe)?;
    let ssh = std::env::var("LEGION_RS_SSH").unwrap_or_else(|_| "ssh -o BatchMode=yes".into());
    let mut words = ssh.split_whitespace();
    let program = words.next().context("LEGION_RS_SSH is empty")?;
    let mut child = Command::new(program)
        .args(words)
        .arg(&dest)
        .arg("sh -s")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running `{ssh}` for host {}", host.name))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .with_context(|| format!("ssh {dest}: sending the start script"))?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "host {}: `{ssh} {dest}` failed ({}): {}",
            host.name,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(None)
}

/// The shell script that installs a remote host's certificate and starts its worker.
fn remote_script(host: &Host, state: &Path, exe: &Path) -> anyhow::Result<String> {
    let identity = NodeIdentity::load(state, &node_name(&host.name))?;
    let node_dir = NodeIdentity::dir(state, &identity.name);
    let logs = state.join("logs");
    let mut s = String::from("set -e\numask 077\n");
    s += &format!(
        "mkdir -p {} {}\n",
        quote(&node_dir.display().to_string()),
        quote(&logs.display().to_string())
    );
    for (file, pem) in [
        ("cert.pem", &identity.cert_pem),
        ("key.pem", &identity.key_pem),
        ("ca.pem", &identity.ca_pem),
    ] {
        s += &format!(
            "cat > {} <<'LEGION_RS_PEM'\n{}\nLEGION_RS_PEM\n",
            quote(&node_dir.join(file).display().to_string()),
            pem.trim_end()
        );
    }
    let args: Vec<String> = worker_args(host, state).iter().map(|a| quote(a)).collect();
    let exe = quote(&exe.display().to_string());
    // Checked here, where ssh still reports to `up`: once in the background, a missing binary
    // would only show as a worker that never registers.
    s += &format!(
        "if ! test -x {exe}; then echo \"no legion-rs binary at \"{exe}\" on this host (set \
         \\`binary\\` in the hosts file)\" >&2; exit 127; fi\n"
    );
    s += &format!(
        "nohup {exe} {} > {} 2>&1 < /dev/null &\n",
        args.join(" "),
        quote(
            &logs
                .join(format!("{}.log", host.name))
                .display()
                .to_string()
        )
    );
    Ok(s)
}

/// Single-quotes a word for `sh`.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// `legion-rs status`: who answers.
pub fn status(hosts: &Hosts, state: &Path) -> anyhow::Result<Vec<HostStatus>> {
    let mut client = WorkerClient::new(hosts, state)?;
    let table = (0..hosts.hosts.len())
        .map(|i| {
            let welcome = greet(&mut client, i, Duration::from_secs(2));
            let mut host = hosts.hosts[i].clone();
            if let (true, Some(w)) = (host.devices_from_gpus, &welcome) {
                host.devices = w.devices as usize;
            }
            HostStatus {
                host,
                welcome,
                started: false,
            }
        })
        .collect();
    client.close();
    Ok(table)
}

/// What `down` stopped.
pub struct Stopped {
    /// The hosts whose workers were running.
    pub workers: Vec<String>,
    /// The Slurm steps it ended (`JOB.STEP`): those whose workers had not all exited.
    pub slurm_steps: Vec<String>,
}

/// `legion-rs down`: asks every worker to exit and waits until local ones are gone (killing
/// those that do not exit within `timeout`); on a Slurm job's cluster, ends its workers' steps
/// and waits for the `srun` that `up` started here.
pub fn down(hosts: &Hosts, state: &Path, timeout: Duration) -> anyhow::Result<Stopped> {
    let mut client = WorkerClient::new(hosts, state)?;
    let mut stopped = Vec::new();
    let mut local_pids = Vec::new();
    for (i, host) in hosts.hosts.iter().enumerate() {
        // Generous: a worker busy with a job on a loaded machine may answer late, and one
        // taken for down here would be left running.
        let Some(w) = greet(&mut client, i, Duration::from_secs(3)) else {
            continue;
        };
        match client.request(i, &Control::Shutdown, Some(timeout)) {
            Ok(_) => {}
            Err(e) => tracing::warn!("worker {}: {e:#}", host.name),
        }
        if host.is_local() {
            local_pids.push((host.name.clone(), w.pid));
        }
        stopped.push(host.name.clone());
    }
    client.close();
    let deadline = Instant::now() + timeout;
    for (name, pid) in local_pids {
        while process_exists(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if process_exists(pid) {
            tracing::warn!("worker {name} (pid {pid}) did not exit; killing it");
            // SAFETY: kill(2) with a pid and a signal number has no memory-safety preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
    let mut slurm_steps = Vec::new();
    if let Some(job) = slurm::recorded_job(state)? {
        // Workers that exited end their tasks, and srun its step, on their own; this ends
        // what did not (a worker that did not answer, one still starting).
        slurm_steps = slurm::end_steps(&job.job_id, timeout)?;
        if job.srun_host == this_host() {
            let deadline = Instant::now() + timeout;
            while process_exists(job.srun_pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Ok(Stopped {
        workers: stopped,
        slurm_steps,
    })
}

/// Whether a process with this pid exists (and is not a zombie we could reap: `up` does not wait
/// on its workers, so a worker that exits while `up` runs stays a zombie until `up` ends).
pub fn process_exists(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
    match stat {
        // The state is the field after the parenthesised command name.
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The cluster table `up` and `status` print.
pub fn format_table(table: &[HostStatus], links: &[MeasuredLink], nics: &[MeasuredNic]) -> String {
    let mut out = format!(
        "{:<12} {:<22} {:>7} {:<6} {:>8} {:<12} {}\n",
        "host", "endpoint", "devices", "kind", "pid", "state", "uptime"
    );
    for row in table {
        let (pid, state, uptime) = match &row.welcome {
            Some(w) => (
                w.pid.to_string(),
                match (&w.job_of, row.started) {
                    (Some(_), _) => "running job",
                    (None, true) => "started",
                    (None, false) => "up",
                }
                .to_string(),
                format!("{:.0} s", w.uptime_s),
            ),
            None => ("-".into(), "DOWN".into(), "-".into()),
        };
        out += &format!(
            "{:<12} {:<22} {:>7} {:<6} {:>8} {:<12} {}\n",
            row.host.name,
            row.host.endpoint(),
            row.host.devices,
            row.host.device_kind,
            pid,
            state,
            uptime
        );
    }
    if !links.is_empty() {
        out += "\nmeasured links:\n";
        for l in links {
            out += &format!(
                "  {} -> {}: {:.2} Gbit/s, {:.0} µs, transport CPU {:.1} ns/B sent, {:.1} ns/B received\n",
                l.from,
                l.to,
                l.bytes_per_s * 8.0 / 1e9,
                l.latency_s * 1e6,
                l.send_cpu_s_per_byte * 1e9,
                l.recv_cpu_s_per_byte * 1e9
            );
        }
    }
    if !nics.is_empty() {
        out += "\nmeasured network interfaces (every peer at once):\n";
        for n in nics {
            out += &format!(
                "  {}: {:.2} Gbit/s to {} peer(s)\n",
                n.host,
                n.bytes_per_s * 8.0 / 1e9,
                n.peers
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_reads_the_gpu_counts_up_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts.toml");
        std::fs::write(
            &file,
            "[[host]]\nname = \"g\"\naddress = \"127.0.0.1\"\ndevice = \"cuda\"\n\
             [[host]]\nname = \"c\"\naddress = \"127.0.0.2\"\ndevices = 2\n",
        )
        .unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        let e = load_hosts(&file, &state).unwrap_err().to_string();
        assert!(
            e.contains("host g: device = \"cuda\" without `devices`"),
            "{e}"
        );
        // As `up` writes it.
        let counts = BTreeMap::from([("g".to_string(), 4usize)]);
        std::fs::write(
            gpu_counts_path(&state),
            serde_json::to_string(&counts).unwrap(),
        )
        .unwrap();
        let hosts = load_hosts(&file, &state).unwrap();
        assert_eq!(hosts.device_ranges(), [0..4, 4..6]);
        std::fs::write(gpu_counts_path(&state), "{\"g\": \"four\"}").unwrap();
        let e = format!("{:#}", load_hosts(&file, &state).unwrap_err());
        assert!(
            e.contains("gpu_counts.json: expected {host: device count}"),
            "{e}"
        );
        let e = worker_args(&Hosts::load(&file).unwrap().hosts[0], &state).join(" ");
        assert!(e.contains("--devices gpus --device cuda"), "{e}");
    }

    #[test]
    fn default_state_dirs_differ_by_path_and_are_stable() {
        let a = state_dir(Path::new("/x/hosts.toml"), None).unwrap();
        let b = state_dir(Path::new("/y/hosts.toml"), None).unwrap();
        assert_ne!(a, b);
        assert_eq!(a, state_dir(Path::new("/x/hosts.toml"), None).unwrap());
        assert!(a.to_string_lossy().contains("legion-rs/hosts_toml-"));
        assert_eq!(
            state_dir(Path::new("/x/hosts.toml"), Some(Path::new("/s"))).unwrap(),
            PathBuf::from("/s")
        );
    }

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
