//! Starting workers: a child process for a loopback host, `ssh DEST sh -s` for a remote one
//! (the script writes its certificates and starts the worker), one `srun` step in a Slurm
//! allocation.

use super::*;

/// Starts `srun` for the workers of `nodes` of Slurm job `job`, running `binary` there (see
/// [`slurm::srun_args`]), and records the job for `down`. `srun` stays in the background after
/// `up` exits: the step lives as long as it does.
pub(super) fn start_slurm_step(
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
pub(super) fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The command line of a worker for `host`.
pub(super) fn worker_args(host: &Host, state: &Path) -> Vec<String> {
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
pub(super) fn start_worker(
    host: &Host,
    state: &Path,
) -> anyhow::Result<Option<std::process::Child>> {
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
pub(super) fn remote_script(host: &Host, state: &Path, exe: &Path) -> anyhow::Result<String> {
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
pub(super) fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}
