//! `status` and `down`, and what a failed `up` stops.

use super::*;

/// After a failed `up`: stops the workers this `up` started, and says what it stopped and what is
/// left. A local worker is killed through its process; a remote one is asked to shut down if it
/// registered, and otherwise (it may still be starting) named with the command that stops it.
/// A Slurm step it started is ended as a whole.
pub(super) fn stop_started(
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
    /// The hosts whose workers did not answer (`NAME (ADDRESS)`): already gone, or unreachable.
    pub not_reached: Vec<String>,
}

/// `legion-rs down`: asks every worker to exit and waits until local ones are gone (killing
/// those that do not exit within `timeout`); on a Slurm job's cluster, ends its workers' steps
/// and waits for the `srun` that `up` started here.
pub fn down(hosts: &Hosts, state: &Path, timeout: Duration) -> anyhow::Result<Stopped> {
    let mut client = WorkerClient::new(hosts, state)?;
    let mut stopped = Vec::new();
    let mut not_reached = Vec::new();
    let mut local_pids = Vec::new();
    // Each worker is asked on its own: one that is gone, or that has just stopped, does not keep
    // the others running.
    for (i, host) in hosts.hosts.iter().enumerate() {
        // Generous: a worker busy with a job on a loaded machine may answer late, and one
        // taken for down here would be left running.
        let Some(w) = greet(&mut client, i, Duration::from_secs(3)) else {
            not_reached.push(format!("{} ({})", host.name, host.endpoint()));
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
        not_reached,
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
