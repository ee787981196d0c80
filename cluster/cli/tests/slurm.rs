//! `legion-rs up --slurm` against a real Slurm: the test starts a one-host Slurm of its own
//! (munged, slurmctld and slurmd from Debian's packages, with its own slurm.conf, ports, munge
//! key and spool and state folders in a temporary folder, as root), takes an allocation with
//! `salloc`, and inside it runs `up --slurm`, `train` on its one device, `status`, a worker
//! killed and named, `up` again and `down`, checking that nothing of the cluster is left running;
//! then the `sbatch` example. Skipped with the reason where Slurm is not installed or does not
//! start (a failure under `LEGION_REQUIRE=slurm`, which `.ci/run` sets where it installed it).
//!
//! The Slurm runs no cgroup plugins (`proctrack/linuxproc`, `task/none`), so that it starts in a
//! container without a writable cgroup hierarchy.

mod common;

use common::{
    assert_same_tensors, free_tcp_port, free_udp_port, init_checkpoint, kill_worker_mid_run,
    train_from,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const MUNGED: &str = "/usr/sbin/munged";
const SLURMCTLD: &str = "/usr/sbin/slurmctld";
const SLURMD: &str = "/usr/sbin/slurmd";
const CLIENTS: [&str; 6] = ["salloc", "sbatch", "srun", "scontrol", "squeue", "scancel"];

/// A one-host Slurm whose daemons this test started; dropping it cancels its jobs and stops them.
struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
    /// munged, slurmctld, slurmd: stopped in the reverse order.
    daemons: Vec<(&'static str, Child)>,
}

impl Slurm {
    /// A Slurm client command of this cluster.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// The last lines of each daemon's log, for a failure message.
    fn logs(&self) -> String {
        ["munged.log", "slurmctld.log", "slurmd.log"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- {name}:\n{}",
                    lines[lines.len().saturating_sub(8)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Jobs first, so that slurmd's step daemons (processes of their own) end with them.
        let _ = self
            .command("scancel")
            .arg("--full")
            .arg("--user=root")
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let jobs = self.command("squeue").args(["--noheader"]).output();
            match jobs {
                Ok(out) if out.status.success() && !out.stdout.is_empty() => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                _ => break,
            }
        }
        for (_, child) in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Starts munged, slurmctld and slurmd for a one-node cluster of this host under `dir`, and
/// waits for the node to be idle; the error says what is missing or what failed.
fn start_slurm(dir: &Path) -> Result<Slurm, String> {
    for daemon in [MUNGED, SLURMCTLD, SLURMD] {
        if !Path::new(daemon).exists() {
            return Err(format!(
                "{daemon} is not installed (Debian: slurmctld slurmd slurm-client munge)"
            ));
        }
    }
    if let Some(missing) = CLIENTS.iter().find(|c| !on_path(c)) {
        return Err(format!("{missing} is not on PATH (Debian: slurm-client)"));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root (slurmd runs jobs as their user, and this test's as root)".into());
    }
    // slurmd knows itself by the short host name, which slurm.conf must name.
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_err(|e| format!("reading the host name: {e}"))?;
    let node = hostname
        .trim()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());

    let munge = dir.join("munge");
    std::fs::create_dir_all(&munge).unwrap();
    let mut key = vec![0u8; 1024];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?,
        &mut key,
    )
    .map_err(|e| format!("/dev/urandom: {e}"))?;
    std::fs::write(munge.join("munge.key"), key).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    // munged refuses a key others can read.
    std::fs::set_permissions(
        munge.join("munge.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = munge.join("munge.socket");
    for sub in ["ctld", "spool"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let conf = dir.join("slurm.conf");
    let path = |p: &str| dir.join(p).display().to_string();
    std::fs::write(
        &conf,
        format!(
            "ClusterName=legiontest\n\
             SlurmctldHost={node}(127.0.0.1)\n\
             SlurmctldPort={ctld_port}\n\
             SlurmdPort={d_port}\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={socket}\n\
             CredType=cred/munge\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             StateSaveLocation={ctld}\n\
             SlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={ctld_pid}\n\
             SlurmdPidFile={d_pid}\n\
             SlurmctldLogFile={ctld_log}\n\
             SlurmdLogFile={d_log}\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\n\
             MpiDefault=none\n\
             MailProg=/bin/true\n\
             ReturnToService=2\n\
             NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n\
             PartitionName=test Nodes={node} Default=YES MaxTime=10 State=UP\n",
            ctld_port = free_tcp_port(),
            d_port = free_tcp_port(),
            socket = socket.display(),
            ctld = path("ctld"),
            spool = path("spool"),
            ctld_pid = path("slurmctld.pid"),
            d_pid = path("slurmd.pid"),
            ctld_log = path("slurmctld.log"),
            d_log = path("slurmd.log"),
        ),
    )
    .unwrap();
    let mut slurm = Slurm {
        dir: dir.to_path_buf(),
        conf: conf.clone(),
        daemons: Vec::new(),
    };
    let spawn = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .env("SLURM_CONF", &conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{program}: {e}"))
    };
    let (key_arg, socket_arg) = (
        format!("--key-file={}", munge.join("munge.key").display()),
        format!("--socket={}", socket.display()),
    );
    let munge_files: Vec<String> = ["log-file", "pid-file", "seed-file"]
        .iter()
        .map(|f| format!("--{f}={}", path(&format!("munged.{f}"))))
        .collect();
    // --force: munged otherwise refuses its files under /tmp, a folder others may write to.
    let mut munged_args = vec!["--foreground", "--force", &key_arg, &socket_arg];
    munged_args.extend(munge_files.iter().map(String::as_str));
    slurm.daemons.push(("munged", spawn(MUNGED, &munged_args)?));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        if Instant::now() > deadline {
            return Err(format!(
                "munged did not create its socket\n{}",
                slurm.logs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let conf_arg = conf.display().to_string();
    // -i: no state of an earlier cluster to recover.
    slurm.daemons.push((
        "slurmctld",
        spawn(SLURMCTLD, &["-D", "-i", "-f", &conf_arg])?,
    ));
    slurm.daemons.push((
        "slurmd",
        spawn(SLURMD, &["-D", "-f", &conf_arg, "-N", &node])?,
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let exited = slurm
            .daemons
            .iter_mut()
            .find_map(|(name, child)| Some((*name, child.try_wait().ok()??)));
        if let Some((name, status)) = exited {
            return Err(format!("{name} exited ({status})\n{}", slurm.logs()));
        }
        let state = slurm
            .command("sinfo")
            .args(["--noheader", "--format=%T"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        if state == "idle" {
            return Ok(slurm);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the node is not idle 20 s after start (sinfo: {state:?})\n{}",
                slurm.logs()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// An allocation held by `salloc`, whose environment the test's commands run in, as they would
/// in the shell `salloc` gives a user. Released (the job ends) when dropped.
struct Allocation {
    salloc: Child,
    release: PathBuf,
    env: HashMap<String, String>,
}

impl Allocation {
    fn take(slurm: &Slurm, dir: &Path, salloc_args: &[&str]) -> Allocation {
        let env_file = dir.join("allocation.env");
        let release = dir.join("release");
        let script = format!(
            "env -0 > {env}.part && mv {env}.part {env}; while [ ! -e {release} ]; do sleep 0.1; done",
            env = env_file.display(),
            release = release.display()
        );
        let salloc = slurm
            .command("salloc")
            .args(salloc_args)
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("salloc runs");
        let mut allocation = Allocation {
            salloc,
            release,
            env: HashMap::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !env_file.exists() {
            assert!(
                allocation.salloc.try_wait().unwrap().is_none(),
                "salloc exited before the allocation's shell ran\n{}",
                slurm.logs()
            );
            assert!(
                Instant::now() < deadline,
                "no allocation within 20 s\n{}",
                slurm.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read(&env_file).unwrap();
        allocation.env = text
            .split(|&b| b == 0)
            .filter_map(|entry| {
                let entry = String::from_utf8_lossy(entry);
                let (k, v) = entry.split_once('=')?;
                Some((k.to_string(), v.to_string()))
            })
            .collect();
        allocation
    }

    /// `legion-rs ARGS` in the allocation's shell, in `folder`.
    fn legion(&self, folder: &Path) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_legion-rs"));
        c.env_clear().envs(&self.env).current_dir(folder);
        c
    }

    fn job_id(&self) -> &str {
        &self.env["SLURM_JOB_ID"]
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.release, "");
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.salloc.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.salloc.kill();
        let _ = self.salloc.wait();
    }
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The pid column of the cluster table's row of `host`.
fn worker_pid(table: &str, host: &str) -> u32 {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(host))
        .and_then(|l| l.split_whitespace().nth(4)?.parse().ok())
        .unwrap_or_else(|| panic!("no running worker {host} in\n{table}"))
}

/// Live processes (not zombies) whose command line mentions `needle`: the cluster's workers and
/// its `srun` name its state directory.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) && legion_cluster::launch::process_exists(pid) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

/// The worker steps Slurm lists for `job`.
fn worker_steps(slurm: &Slurm, job: &str) -> Vec<String> {
    let out = slurm
        .command("squeue")
        .args(["--steps", "--noheader", "--format=%i %j", "--jobs", job])
        .output()
        .unwrap();
    legion_cluster::slurm::worker_steps(&String::from_utf8_lossy(&out.stdout))
}

const LENET: [&str; 6] = ["--model", "lenet5", "--batch", "8", "--strategy", "data"];

#[test]
fn up_slurm_trains_in_an_allocation_names_a_killed_worker_and_down_leaves_nothing() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let slurm = match start_slurm(&dir.path().join("slurm")) {
        Ok(s) => s,
        Err(e) => {
            return legion_ops::require::skip(
                legion_ops::require::Need::Slurm,
                format!("cannot run a Slurm here ({e})"),
            );
        }
    };
    eprintln!("slurm started in {:?}", started.elapsed());
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();

    // Outside an allocation: one line saying so.
    let out = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(["up", "--slurm"])
        .env_remove("SLURM_JOB_ID")
        .current_dir(&work)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: not inside a Slurm allocation (SLURM_JOB_ID is not set)"),
        "{stderr}"
    );

    let alloc = Allocation::take(
        &slurm,
        dir.path(),
        &["--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--time=5"],
    );
    let job = alloc.job_id().to_string();
    let node = alloc.env["SLURM_JOB_NODELIST"].clone();
    let state = work.join(format!("legion-rs-slurm-{job}"));
    let state_text = state.display().to_string();
    let port = free_udp_port().to_string();

    let table = ok(
        alloc
            .legion(&work)
            .args(["up", "--slurm", "--port", &port])
            .output()
            .unwrap(),
        "up --slurm",
    );
    eprintln!("{table}");
    assert!(table.contains(&format!("state in {state_text}")), "{table}");
    let pid = worker_pid(&table, &node);
    assert_eq!(
        worker_steps(&slurm, &job).len(),
        1,
        "up runs the workers in one step"
    );
    // The job's one CPU is the node's one device.
    let hosts = legion_cluster::hosts::Hosts::load(state.join("hosts.toml")).unwrap();
    assert_eq!(hosts.hosts.len(), 1);
    assert_eq!(
        (hosts.hosts[0].devices, hosts.hosts[0].name.as_str()),
        (1, node.as_str())
    );

    // The same cluster through a hosts file's [slurm] table.
    let slurm_toml = work.join("slurm.toml");
    std::fs::write(&slurm_toml, format!("[slurm]\nport = {port}\n")).unwrap();
    let status = ok(
        alloc
            .legion(&work)
            .args(["status", slurm_toml.to_str().unwrap()])
            .output()
            .unwrap(),
        "status slurm.toml",
    );
    assert_eq!(worker_pid(&status, &node), pid, "{status}");

    // A short run on the cluster's one device equals one device's.
    let init = work.join("init.safetensors");
    init_checkpoint(&init, &LENET);
    let on_slurm = work.join("slurm.safetensors");
    let mut train = alloc.legion(&work);
    train
        .args(["train", "--slurm", "--device", "cpu"])
        .args(LENET)
        .args([
            "--steps",
            "3",
            "--init",
            init.to_str().unwrap(),
            "--save",
            on_slurm.to_str().unwrap(),
        ]);
    let trained = ok(train.output().unwrap(), "train --slurm");
    assert!(
        trained.contains("1 worker(s) of the Slurm job's nodes"),
        "{trained}"
    );
    let single = work.join("single.safetensors");
    train_from(&[], &LENET, "3", &init, &single);
    assert_same_tensors(&on_slurm, &single);

    // A worker killed inside the allocation is named within 5 s.
    let checkpoint = work.join("ckpt.safetensors");
    let mut run = alloc
        .legion(&work)
        .args(["train", "--slurm", "--device", "cpu"])
        .args(LENET)
        .args(["--steps", "100000", "--checkpoint-every", "5", "--save"])
        .arg(&checkpoint)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (status, noticed, stderr) =
        kill_worker_mid_run(&mut run, &checkpoint, Duration::from_secs(60), pid as u32);
    assert!(!status.success(), "training survived a killed worker");
    assert!(
        stderr.contains(&format!("worker {node}")),
        "the error does not name {node}: {stderr}"
    );
    // With no other worker to re-plan on, the run stops and says how to go on.
    assert!(
        stderr.contains("no other worker is left")
            && stderr.contains("`legion-rs up --slurm`")
            && stderr.contains(&format!("--resume {}", checkpoint.display())),
        "{stderr}"
    );
    assert!(
        noticed < Duration::from_secs(5),
        "noticed after {noticed:?}: {stderr}"
    );
    let out = alloc
        .legion(&work)
        .args(["status", "--slurm"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "status after the kill succeeded");
    assert!(String::from_utf8_lossy(&out.stdout).contains("DOWN"));

    // `up` again starts the missing worker, in a new step; `down` stops it and ends the step.
    let table = ok(
        alloc
            .legion(&work)
            .args(["up", slurm_toml.to_str().unwrap()])
            .output()
            .unwrap(),
        "up again",
    );
    let pid = worker_pid(&table, &node);
    let down = ok(
        alloc
            .legion(&work)
            .args(["down", "--slurm"])
            .output()
            .unwrap(),
        "down --slurm",
    );
    assert!(down.contains(&format!("stopped {node}")), "{down}");
    assert!(
        !legion_cluster::launch::process_exists(pid),
        "worker {pid} runs after down"
    );
    assert_eq!(worker_steps(&slurm, &job), Vec::<String>::new());
    assert_eq!(processes_mentioning(&state_text), Vec::<String>::new());

    // A binary the nodes do not have: `up` fails at once, saying what the node said.
    let bad = work.join("bad.toml");
    std::fs::write(
        &bad,
        format!("[slurm]\nport = {port}\nbinary = \"/nonexistent/legion-rs\"\n"),
    )
    .unwrap();
    let out = alloc
        .legion(&work)
        .args(["up", bad.to_str().unwrap(), "--state", "bad-state"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("up with a binary the node lacks: {}", stderr.trim());
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("before worker {node}"))
            && stderr.contains("/nonexistent/legion-rs"),
        "{stderr}"
    );
    assert_eq!(worker_steps(&slurm, &job), Vec::<String>::new());
    drop(alloc);

    // The sbatch example, small: AlexNet on the one node, for 2 steps.
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/slurm/alexnet.sbatch");
    let output = work.join("alexnet.out");
    let exports = format!(
        "ALL,LEGION_RS={},STEPS=2,BATCH=8,IMAGE_SIZE=64,PORT={}",
        env!("CARGO_BIN_EXE_legion-rs"),
        free_udp_port()
    );
    let out = slurm
        .command("sbatch")
        .args(["--wait", "--nodes=1", "--cpus-per-task=1", "--time=5"])
        .arg(format!("--output={}", output.display()))
        .arg(format!("--export={exports}"))
        .arg(&example)
        .current_dir(&work)
        .output()
        .unwrap();
    let said = std::fs::read_to_string(&output).unwrap_or_default();
    assert!(
        out.status.success(),
        "sbatch {}: {}\n{said}",
        example.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("trained alexnet for 2 step(s)"), "{said}");
    assert!(said.contains("stopped "), "{said}");
    assert_eq!(
        processes_mentioning(&work.display().to_string()),
        Vec::<String>::new()
    );
    eprintln!("the Slurm test took {:?}", started.elapsed());
}
