//! The nodes of a Slurm allocation as a cluster: `legion-rs up --slurm` (or a hosts file with a
//! `[slurm]` table) run inside `salloc` or an `sbatch` script.
//!
//! Inside an allocation, `up` reads the job's nodes (`scontrol show hostnames
//! "$SLURM_JOB_NODELIST"`) and their addresses (`scontrol show node`), decides each node's
//! devices (the GPUs Slurm gives its step where the job has GPUs, else the node's CPUs in the job,
//! `SLURM_JOB_CPUS_PER_NODE`), writes them as an ordinary hosts file, `<state>/hosts.toml`, and
//! starts one worker per node with one `srun` step ([`srun_args`]). Each task finds its own entry
//! in that file by `SLURMD_NODENAME` (`legion-rs worker --slurm`), so nothing depends on how Slurm
//! orders tasks over nodes. The state directory (certificates, logs, links, the hosts file) is
//! `legion-rs-slurm-<job id>` in the folder `up` runs in, the job's working folder, which every
//! node of a cluster reads (a shared file system, as Slurm jobs assume). From then on `status`,
//! `train --cluster` and `down` use that hosts file like any other; `down` also ends the step
//! ([`end_steps`]), so nothing of the cluster outlives it.
//!
//! Parsing Slurm's variables and outputs is pure ([`Allocation::read`] takes the environment and
//! the `scontrol` runner as arguments) and unit-tested on strings; `cluster/cli/tests/slurm.rs`
//! runs the whole against a real one-host Slurm.

use crate::hosts::{DEFAULT_PORT, GPU_KIND, Host, Hosts, MAX_DEVICES, SlurmNodes};
use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The name of the step that runs the workers, to find it again (`squeue`) and end it.
pub const STEP_NAME: &str = "legion-rs-workers";

/// The variable that says this process is inside an allocation, and which.
const JOB_ID: &str = "SLURM_JOB_ID";

/// The job this process runs in: its id, or the one-line error saying it is not in one.
pub fn job_id(env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<String> {
    match env(JOB_ID).filter(|v| !v.trim().is_empty()) {
        Some(id) if id.bytes().all(|b| b.is_ascii_digit()) => Ok(id),
        Some(id) => bail!("{JOB_ID}={id:?}: expected a job number"),
        None => bail!(
            "not inside a Slurm allocation ({JOB_ID} is not set): a Slurm job's cluster is \
             started and used in an `salloc` shell or an `sbatch` script"
        ),
    }
}

/// The state directory of job `job` with `up` run in `folder`: `folder/legion-rs-slurm-<job>`.
pub fn state_dir(folder: &Path, job: &str) -> PathBuf {
    folder.join(format!("legion-rs-slurm-{job}"))
}

/// What `up` found in the allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    pub job_id: String,
    /// In the order of the job's node list.
    pub nodes: Vec<Node>,
    /// Where the job holds GPUs: how that was seen (a variable or the job's TRES), for the
    /// messages; `None`: it holds none.
    pub gpus: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Slurm's node name (`SLURMD_NODENAME` on the node): the host's name.
    pub name: String,
    /// The node's `NodeAddr`: where its worker listens and is reached.
    pub address: String,
    /// The job's CPUs on this node.
    pub cpus: usize,
}

impl Allocation {
    /// Reads the allocation from the environment and `scontrol` (`scontrol(args)` returns its
    /// standard output or the error naming the failed command).
    pub fn read(
        env: &dyn Fn(&str) -> Option<String>,
        scontrol: &mut dyn FnMut(&[&str]) -> anyhow::Result<String>,
    ) -> anyhow::Result<Allocation> {
        let job_id = job_id(env)?;
        let nodelist = env("SLURM_JOB_NODELIST")
            .filter(|v| !v.trim().is_empty())
            .context("SLURM_JOB_NODELIST is not set inside the allocation")?;
        let names = hostnames(&scontrol(&["show", "hostnames", &nodelist])?)
            .map_err(|e| anyhow::anyhow!("scontrol show hostnames {nodelist}: {e}"))?;
        let addresses = node_addresses(&scontrol(&["show", "node", "--oneliner", &nodelist])?);
        let cpus = cpus_per_node(env, names.len())?;
        let gpus = match gpus_in_environment(env).map_err(anyhow::Error::msg)? {
            Some(seen) => Some(seen),
            None => gpus_in_tres(&scontrol(&["show", "job", "--oneliner", &job_id])?)?,
        };
        let nodes = names
            .into_iter()
            .zip(cpus)
            .map(|(name, cpus)| Node {
                address: addresses
                    .get(&name)
                    .cloned()
                    .unwrap_or_else(|| name.clone()),
                name,
                cpus,
            })
            .collect();
        Ok(Allocation {
            job_id,
            nodes,
            gpus,
        })
    }

    /// The hosts file of the allocation's nodes, one worker each, as `settings` says (see
    /// [`SlurmNodes`]): a `cuda` node without `devices` runs one device per GPU its step sees,
    /// which its worker counts; a CPU node, one per CPU of the job there.
    pub fn hosts_toml(&self, settings: &SlurmNodes, binary: &Path) -> anyhow::Result<String> {
        let device = match (&settings.device, &self.gpus) {
            (Some(kind), _) => kind.clone(),
            (None, Some(_)) => GPU_KIND.to_string(),
            (None, None) => "cpu".to_string(),
        };
        let binary = match &settings.binary {
            Some(b) => b.clone(),
            None => binary.display().to_string(),
        };
        let mut text = format!(
            "# The nodes of Slurm job {}, as `legion-rs up` found them{}; their workers run in \
             its step {STEP_NAME}.\n",
            self.job_id,
            match &self.gpus {
                Some(seen) => format!(" (GPUs: {seen})"),
                None => " (no GPUs)".to_string(),
            }
        );
        if let Some(p) = settings.precision {
            text += &format!("\n[defaults]\nprecision = {}\n", toml_string(p.name()));
        }
        for node in &self.nodes {
            text += &format!(
                "\n[[host]]\nname = {}\naddress = {}\nport = {}\ndevice = {}\nbinary = {}\n",
                toml_string(&node.name),
                toml_string(&node.address),
                settings.port.unwrap_or(DEFAULT_PORT),
                toml_string(&device),
                toml_string(&binary)
            );
            match (settings.devices, device == GPU_KIND) {
                (Some(n), _) => text += &format!("devices = {n}\n"),
                // Left out: the worker runs one device per GPU it finds.
                (None, true) => {}
                (None, false) => text += &format!("devices = {}\n", node.cpus.min(MAX_DEVICES)),
            }
        }
        Ok(text)
    }
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The host names `scontrol show hostnames` printed, one a line.
pub fn hostnames(output: &str) -> Result<Vec<String>, String> {
    let names: Vec<String> = output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if names.is_empty() {
        return Err("printed no host name".into());
    }
    if let Some(bad) = names.iter().find(|n| n.contains(char::is_whitespace)) {
        return Err(format!("expected one host name a line, got {bad:?}"));
    }
    Ok(names)
}

/// `NodeName` → `NodeAddr` of each node in `scontrol show node --oneliner` output (one node a
/// line of `Key=Value` words). Nodes it lacks are reached by their name.
pub fn node_addresses(output: &str) -> HashMap<String, String> {
    output
        .lines()
        .filter_map(|line| {
            let field = |key: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
                    .filter(|v| !v.is_empty() && *v != "(null)")
            };
            Some((
                field("NodeName")?.to_string(),
                field("NodeAddr")?.to_string(),
            ))
        })
        .collect()
}

/// The job's CPUs on each of its `nodes` nodes: `SLURM_JOB_CPUS_PER_NODE` (in the nodes' order),
/// or, on a one-node job, `SLURM_CPUS_ON_NODE`.
pub fn cpus_per_node(
    env: &dyn Fn(&str) -> Option<String>,
    nodes: usize,
) -> anyhow::Result<Vec<usize>> {
    let var = "SLURM_JOB_CPUS_PER_NODE";
    if let Some(value) = env(var) {
        return counts_per_node(var, &value, nodes).map_err(anyhow::Error::msg);
    }
    let var = "SLURM_CPUS_ON_NODE";
    match env(var) {
        Some(value) if nodes == 1 => counts_per_node(var, &value, 1).map_err(anyhow::Error::msg),
        _ => bail!(
            "SLURM_JOB_CPUS_PER_NODE is not set: cannot tell the job's CPUs on each of its \
             {nodes} node(s); give `devices` in a hosts file's [slurm] table"
        ),
    }
}

/// Slurm's compressed list of per-node counts, `"2(x3),1"` (three nodes of 2, then one of 1), as
/// one count per node; `var` names the variable in errors, `nodes` is how many it must cover.
pub fn counts_per_node(var: &str, value: &str, nodes: usize) -> Result<Vec<usize>, String> {
    let bad = |why: String| format!("{var}={value:?}: {why}");
    let mut counts = Vec::new();
    for item in value.trim().split(',') {
        let (count, repeat) = match item.split_once('(') {
            None => (item, "1"),
            Some((count, rest)) => {
                let repeat = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| bad(format!("expected COUNT or COUNT(xNODES), got {item:?}")))?;
                (count, repeat)
            }
        };
        let count: usize = count
            .trim()
            .parse()
            .ok()
            .filter(|&c| c >= 1)
            .ok_or_else(|| bad(format!("expected a count ≥ 1, got {:?}", count.trim())))?;
        let repeat: usize = repeat
            .parse()
            .ok()
            .filter(|&r| r >= 1)
            .ok_or_else(|| bad(format!("expected a repeat ≥ 1 in {item:?}")))?;
        // Checked before growing, so a huge repeat is an error, not an allocation.
        if counts.len() + repeat > nodes {
            return Err(bad(format!("covers more than the job's {nodes} node(s)")));
        }
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    if counts.len() != nodes {
        return Err(bad(format!(
            "covers {} node(s), but the job has {nodes}",
            counts.len()
        )));
    }
    Ok(counts)
}

/// Whether the environment says the job holds GPUs, and which variable says so. Set where a step
/// or batch script runs on a node with GPUs (`SLURM_GPUS_ON_NODE`, `SLURM_JOB_GPUS`: GPU
/// indices), or where the job asked for them (`SLURM_GPUS_PER_NODE`, `SLURM_GPUS`:
/// `[type:]count`). `None`: none says so (`salloc --gres=gpu:N` sets none of them; the job's
/// TRES does, [`gpus_in_tres`]).
pub fn gpus_in_environment(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<String>, String> {
    for var in ["SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS"] {
        let Some(value) = env(var).filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        let count = match var {
            "SLURM_GPUS_ON_NODE" => value.trim().parse::<usize>().map_err(|_| {
                format!("{var}={value:?}: expected the number of GPUs on this node")
            })?,
            _ => {
                let indices: Vec<&str> = value.split(',').map(str::trim).collect();
                if indices.iter().any(|i| i.parse::<u32>().is_err()) {
                    return Err(format!(
                        "{var}={value:?}: expected GPU indices separated by commas"
                    ));
                }
                indices.len()
            }
        };
        if count > 0 {
            return Ok(Some(format!("{var}={value}")));
        }
    }
    for var in ["SLURM_GPUS_PER_NODE", "SLURM_GPUS"] {
        let Some(value) = env(var).filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        if gpu_request_count(&value).map_err(|e| format!("{var}={value:?}: {e}"))? > 0 {
            return Ok(Some(format!("{var}={value}")));
        }
    }
    Ok(None)
}

/// The GPUs of a request such as `4`, `a100:4` or `a100:2,v100:1`.
fn gpu_request_count(value: &str) -> Result<usize, String> {
    value.split(',').try_fold(0usize, |sum, part| {
        let count = part.rsplit(':').next().unwrap_or(part).trim();
        count
            .parse::<usize>()
            .ok()
            .and_then(|c| sum.checked_add(c))
            .ok_or_else(|| format!("expected [TYPE:]COUNT, got {part:?}"))
    })
}

/// Whether the job's TRES in `scontrol show job --oneliner` output holds GPUs (`gres/gpu=N` or
/// `gres/gpu:TYPE=N`), and the entry that says so.
pub fn gpus_in_tres(output: &str) -> anyhow::Result<Option<String>> {
    let tres = output
        .split_whitespace()
        .find_map(|w| w.strip_prefix("TRES="))
        .context("scontrol show job: no TRES= in its output")?;
    for entry in tres.split(',') {
        let Some((key, value)) = entry.split_once('=') else {
            continue;
        };
        if key == "gres/gpu" || key.starts_with("gres/gpu:") {
            let count: u64 = value
                .parse()
                .with_context(|| format!("scontrol show job: TRES {entry:?}: expected a count"))?;
            if count > 0 {
                return Ok(Some(format!("the job's TRES {entry}")));
            }
        }
    }
    Ok(None)
}

/// The `srun` arguments that start the workers of `nodes` (names, in the job's node order) in
/// one step of job `job`: a task per node, over all of the job's CPUs and GPUs there (`--whole`),
/// sharing them with the job's other steps (`--overlap`: `train` and later steps must still run),
/// each task's output in `<state>/logs/<node>.log`.
pub fn srun_args(job: &str, nodes: &[String], state: &Path, binary: &Path) -> Vec<String> {
    vec![
        format!("--jobid={job}"),
        format!("--job-name={STEP_NAME}"),
        format!("--nodes={}", nodes.len()),
        format!("--ntasks={}", nodes.len()),
        "--ntasks-per-node=1".into(),
        format!("--nodelist={}", nodes.join(",")),
        "--overlap".into(),
        "--whole".into(),
        // A worker that fails must not take the others down with it: `up` names it.
        "--kill-on-bad-exit=0".into(),
        "--input=none".into(),
        format!("--output={}", state.join("logs").join("%N.log").display()),
        binary.display().to_string(),
        "worker".into(),
        "--state".into(),
        state.display().to_string(),
        "--slurm".into(),
    ]
}

/// The host of the node this task of the step runs on (`SLURMD_NODENAME`, given as
/// `node_name`) in the hosts file `up` wrote, `<state>/hosts.toml`: what `worker --slurm` runs.
pub fn this_node(state: &Path, node_name: Option<String>) -> anyhow::Result<Host> {
    let name = node_name.context(
        "SLURMD_NODENAME is not set: `worker --slurm` runs as a task of the step `legion-rs up \
         --slurm` starts",
    )?;
    let path = state.join("hosts.toml");
    let hosts = Hosts::load(&path)?;
    hosts
        .hosts
        .into_iter()
        .find(|h| h.name == name)
        .with_context(|| format!("node {name} is not a host of {}", path.display()))
}

/// What `up` records of the job whose step runs the workers (`<state>/slurm.json`), for `down`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RecordedJob {
    pub job_id: String,
    /// The `srun` process `up` started, on the host `up` ran on.
    pub srun_pid: u32,
    pub srun_host: String,
}

pub fn recorded_job_path(state: &Path) -> PathBuf {
    state.join("slurm.json")
}

/// The job `up` recorded in `state`; `None` where the cluster is not a Slurm job's.
pub fn recorded_job(state: &Path) -> anyhow::Result<Option<RecordedJob>> {
    let path = recorded_job_path(state);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .with_context(|| format!("{}: expected the job `up --slurm` recorded", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

pub fn record_job(state: &Path, job: &RecordedJob) -> anyhow::Result<()> {
    let path = recorded_job_path(state);
    let text = serde_json::to_string_pretty(job)? + "\n";
    legion_ops::atomic_file::write(&path, text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// The ids (`JOB.STEP`) of the steps named [`STEP_NAME`] in `squeue --steps --noheader
/// --format="%i %j"` output.
pub fn worker_steps(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let id = words.next()?;
            (words.next() == Some(STEP_NAME)).then(|| id.to_string())
        })
        .collect()
}

/// The worker steps of `job` still known to Slurm.
fn running_steps(job: &str) -> anyhow::Result<Vec<String>> {
    let out = run(
        "squeue",
        &["--steps", "--noheader", "--format=%i %j", "--jobs", job],
    )?;
    Ok(worker_steps(&out))
}

/// Ends every worker step of `job` (`scancel JOB.STEP`) and waits up to `timeout` until Slurm
/// lists none; returns the steps it ended. A job that has ended has none.
pub fn end_steps(job: &str, timeout: Duration) -> anyhow::Result<Vec<String>> {
    let steps = match running_steps(job) {
        Ok(steps) => steps,
        // squeue refuses a job id it no longer knows: the job, and so its steps, are gone.
        Err(e) if format!("{e:#}").contains("Invalid job id") => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut refused = Vec::new();
    for step in &steps {
        // A step that ended between squeue and scancel is refused as an invalid id: what is
        // left is checked below.
        if let Err(e) = run("scancel", &[step]) {
            refused.push(format!("{e:#}"));
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        let left = running_steps(job).unwrap_or_default();
        if left.is_empty() {
            return Ok(steps);
        }
        if Instant::now() > deadline {
            bail!(
                "Slurm still lists step(s) {} of job {job} {:.0} s after scancel{}",
                left.join(", "),
                timeout.as_secs_f64(),
                match refused.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", refused.join("; ")),
                }
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs a Slurm command, returning its standard output or an error naming it and what it said.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program).args(args).output().with_context(|| {
        format!("running `{program}` (are Slurm's client commands installed here?)")
    })?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{program}` printed non-UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| vars.get(k).cloned()
    }

    #[test]
    fn compressed_counts_expand_per_node_and_errors_name_the_variable() {
        let v = "SLURM_JOB_CPUS_PER_NODE";
        assert_eq!(counts_per_node(v, "2(x3),1", 4), Ok(vec![2, 2, 2, 1]));
        assert_eq!(counts_per_node(v, "72", 1), Ok(vec![72]));
        assert_eq!(counts_per_node(v, "4,8(x2)", 3), Ok(vec![4, 8, 8]));
        let e = counts_per_node(v, "2(x3),1", 5).unwrap_err();
        assert_eq!(
            e,
            "SLURM_JOB_CPUS_PER_NODE=\"2(x3),1\": covers 4 node(s), but the job has 5"
        );
        let e = counts_per_node(v, "2(x3),1", 3).unwrap_err();
        assert!(e.contains("covers more than the job's 3 node(s)"), "{e}");
        for bad in [
            "", "two", "0", "-1", "2(3)", "2(x)", "2(x0)", "2(x3", "2,,1",
        ] {
            let e = counts_per_node("SLURM_CPUS_ON_NODE", bad, 1).unwrap_err();
            assert!(
                e.starts_with(&format!("SLURM_CPUS_ON_NODE={bad:?}: ")),
                "{e}"
            );
        }
        // A repeat far past the node count is refused before anything is allocated for it.
        let e = counts_per_node(v, "1(x18446744073709551615)", 2).unwrap_err();
        assert!(e.contains("covers more"), "{e}");
    }

    #[test]
    fn cpus_come_from_the_job_or_on_one_node_from_the_node() {
        let env = env_of(&[
            ("SLURM_JOB_CPUS_PER_NODE", "3(x2)"),
            ("SLURM_CPUS_ON_NODE", "9"),
        ]);
        assert_eq!(cpus_per_node(&env, 2).unwrap(), [3, 3]);
        let env = env_of(&[("SLURM_CPUS_ON_NODE", "9")]);
        assert_eq!(cpus_per_node(&env, 1).unwrap(), [9]);
        let e = cpus_per_node(&env, 2).unwrap_err().to_string();
        assert!(e.contains("SLURM_JOB_CPUS_PER_NODE is not set"), "{e}");
    }

    #[test]
    fn gpus_are_seen_in_the_environment_or_the_jobs_tres() {
        let none = env_of(&[("SLURM_CPUS_ON_NODE", "4")]);
        assert_eq!(gpus_in_environment(&none), Ok(None));
        let on_node = env_of(&[("SLURM_GPUS_ON_NODE", "4")]);
        assert_eq!(
            gpus_in_environment(&on_node),
            Ok(Some("SLURM_GPUS_ON_NODE=4".into()))
        );
        let zero = env_of(&[("SLURM_GPUS_ON_NODE", "0")]);
        assert_eq!(gpus_in_environment(&zero), Ok(None));
        let indices = env_of(&[("SLURM_JOB_GPUS", "0,1,3")]);
        assert!(gpus_in_environment(&indices).unwrap().is_some());
        let typed = env_of(&[("SLURM_GPUS_PER_NODE", "a100:2,v100:1")]);
        assert!(gpus_in_environment(&typed).unwrap().is_some());
        for (var, value) in [
            ("SLURM_GPUS_ON_NODE", "four"),
            ("SLURM_JOB_GPUS", "0,x"),
            ("SLURM_GPUS", "a100:"),
        ] {
            let e = gpus_in_environment(&env_of(&[(var, value)])).unwrap_err();
            assert!(e.starts_with(&format!("{var}={value:?}: ")), "{e}");
        }
        // As `scontrol show job --oneliner` prints them (22.05).
        let cpu_job = "JobId=7 JobName=x NumCPUs=1 TRES=cpu=1,node=1,billing=1 Socks/Node=*";
        assert_eq!(gpus_in_tres(cpu_job).unwrap(), None);
        let gpu_job = "JobId=8 TRES=cpu=8,mem=64G,node=2,billing=8,gres/gpu=8 Socks/Node=*";
        assert_eq!(
            gpus_in_tres(gpu_job).unwrap(),
            Some("the job's TRES gres/gpu=8".into())
        );
        let typed = "TRES=cpu=8,node=1,gres/gpu:h100=4";
        assert!(gpus_in_tres(typed).unwrap().is_some());
        assert!(gpus_in_tres("JobId=9").is_err());
        assert!(gpus_in_tres("TRES=gres/gpu=many").is_err());
    }

    #[test]
    fn outside_an_allocation_the_error_is_one_line_saying_so() {
        let e = job_id(&env_of(&[])).unwrap_err().to_string();
        assert!(
            e.starts_with("not inside a Slurm allocation (SLURM_JOB_ID is not set)"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        assert!(job_id(&env_of(&[("SLURM_JOB_ID", "12x")])).is_err());
        assert_eq!(job_id(&env_of(&[("SLURM_JOB_ID", "12")])).unwrap(), "12");
    }

    /// An allocation of three nodes, as `scontrol` (22.05) prints it, with `gpus` in the TRES.
    fn read(tres: &str, cpus: &str) -> anyhow::Result<Allocation> {
        let env = env_of(&[
            ("SLURM_JOB_ID", "42"),
            ("SLURM_JOB_NODELIST", "gpu[01-02],cpu7"),
            ("SLURM_JOB_CPUS_PER_NODE", cpus),
        ]);
        let tres = tres.to_string();
        let mut scontrol = move |args: &[&str]| -> anyhow::Result<String> {
            Ok(match args {
                ["show", "hostnames", "gpu[01-02],cpu7"] => "gpu01\ngpu02\ncpu7\n".into(),
                ["show", "node", "--oneliner", _] => {
                    "NodeName=gpu01 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=gpu01\n\
                     NodeName=gpu02 NodeAddr=10.0.0.2 NodeHostName=gpu02\n"
                        .into()
                }
                ["show", "job", "--oneliner", "42"] => format!("JobId=42 {tres} Socks/Node=*\n"),
                other => anyhow::bail!("unexpected scontrol {other:?}"),
            })
        };
        Allocation::read(&env, &mut scontrol)
    }

    #[test]
    fn an_allocation_becomes_a_hosts_file_of_its_nodes() {
        let alloc = read("TRES=cpu=12,node=3", "4(x2),2").unwrap();
        assert_eq!(alloc.job_id, "42");
        assert_eq!(alloc.gpus, None);
        assert_eq!(
            alloc.nodes,
            [
                Node {
                    name: "gpu01".into(),
                    address: "10.0.0.1".into(),
                    cpus: 4
                },
                Node {
                    name: "gpu02".into(),
                    address: "10.0.0.2".into(),
                    cpus: 4
                },
                // No NodeAddr printed: reached by its name.
                Node {
                    name: "cpu7".into(),
                    address: "cpu7".into(),
                    cpus: 2
                },
            ]
        );
        let binary = Path::new("/shared/legion-rs");
        let text = alloc.hosts_toml(&SlurmNodes::default(), binary).unwrap();
        let hosts = crate::hosts::Hosts::parse(&text, "hosts.toml").unwrap();
        assert_eq!(hosts.device_ranges(), [0..4, 4..8, 8..10]);
        assert!(hosts.hosts.iter().all(|h| h.device_kind == "cpu"
            && h.port == DEFAULT_PORT
            && h.binary.as_deref() == Some("/shared/legion-rs")));
        assert_eq!(hosts.hosts[1].endpoint(), "10.0.0.2:7400");

        // With GPUs, each node's worker counts those its step sees.
        let alloc = read("TRES=cpu=12,node=3,gres/gpu=8", "4(x2),2").unwrap();
        let text = alloc.hosts_toml(&SlurmNodes::default(), binary).unwrap();
        let hosts = crate::hosts::Hosts::parse(&text, "hosts.toml").unwrap();
        assert!(
            hosts
                .hosts
                .iter()
                .all(|h| h.device_kind == GPU_KIND && h.devices_from_gpus)
        );
        // The [slurm] table's settings win.
        let settings = SlurmNodes {
            port: Some(7500),
            devices: Some(2),
            device: Some("cpu".into()),
            binary: Some("/opt/legion-rs".into()),
            precision: Some(legion_ops::Precision::Tf32),
        };
        let text = alloc.hosts_toml(&settings, binary).unwrap();
        let hosts = crate::hosts::Hosts::parse(&text, "hosts.toml").unwrap();
        assert_eq!(hosts.device_ranges(), [0..2, 2..4, 4..6]);
        assert_eq!(hosts.hosts[0].endpoint(), "10.0.0.1:7500");
        assert_eq!(hosts.hosts[0].binary.as_deref(), Some("/opt/legion-rs"));
        assert_eq!(hosts.precision, Some(legion_ops::Precision::Tf32));

        let e = read("TRES=cpu=12", "4(x2)").unwrap_err().to_string();
        assert!(
            e.contains("SLURM_JOB_CPUS_PER_NODE=\"4(x2)\": covers 2 node(s), but the job has 3"),
            "{e}"
        );
    }

    #[test]
    fn scontrol_and_squeue_outputs_are_read_strictly() {
        assert!(hostnames("").is_err());
        assert!(hostnames("a b\n").is_err());
        assert_eq!(hostnames("a\n\nb\n").unwrap(), ["a", "b"]);
        let addresses = node_addresses("NodeName=n1 NodeAddr=(null)\nNodeName=n2 NodeAddr=n2-ib\n");
        assert_eq!(addresses.len(), 1);
        assert_eq!(addresses["n2"], "n2-ib");
        let squeue =
            "42.0 legion-rs-workers\n42.1 bash\n42.extern extern\n42.3 legion-rs-workers\n";
        assert_eq!(worker_steps(squeue), ["42.0", "42.3"]);
    }

    #[test]
    fn the_step_runs_one_worker_per_node_over_the_whole_node() {
        let args = srun_args(
            "42",
            &["gpu01".into(), "gpu02".into()],
            Path::new("/work/legion-rs-slurm-42"),
            Path::new("/shared/legion-rs"),
        );
        let line = args.join(" ");
        for expected in [
            "--jobid=42",
            "--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=gpu01,gpu02",
            "--overlap --whole",
            "--output=/work/legion-rs-slurm-42/logs/%N.log",
            "/shared/legion-rs worker --state /work/legion-rs-slurm-42 --slurm",
        ] {
            assert!(line.contains(expected), "{line}");
        }
    }
}
