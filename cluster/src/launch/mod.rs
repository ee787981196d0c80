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
//!
//! `state.rs`: the state directory and what `up` records in it; `start.rs`: starting a worker
//! (a child, over ssh, or one srun step); `probe.rs`: the link measurements; `stop.rs`: `status`,
//! `down` and what a failed `up` stops; this file: `up` itself, and the table it prints.

mod probe;
mod start;
mod state;
mod stop;

pub use state::{
    Located, MeasuredLink, MeasuredNic, gpu_counts_path, links_path, load_hosts, load_links,
    load_nics, locate, nics_path, state_dir,
};
pub use stop::{Stopped, down, process_exists, status};

use probe::measure;
use start::{start_slurm_step, start_worker, this_host};
use state::ensure_identities;
use stop::stop_started;

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
    if cluster.slurm.is_none() {
        state::record_state_dir(&cluster.hosts_file, state);
    }
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
    use super::start::{quote, worker_args};
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
