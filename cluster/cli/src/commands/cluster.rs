//! `legion-rs up`, `status` and `down`.

use clap::Args;
use legion_cluster::launch::{self, Located, UpOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// The cluster: a hosts.toml or an MPI-style hostfile (a hosts.toml with a [slurm] table: the
    /// nodes of the Slurm allocation this runs in, as --slurm).
    #[arg(required_unless_present = "slurm", conflicts_with = "slurm")]
    hosts: Option<PathBuf>,
    /// The nodes of the Slurm allocation this runs in (an `salloc` shell, an `sbatch` script):
    /// one worker per node, started by `srun` in a step of the job; its state in
    /// `./legion-rs-slurm-<job id>`, which every node must read (the job's working folder).
    #[arg(long)]
    slurm: bool,
    /// The cluster's state directory (certificates, logs, measured links); default:
    /// `$XDG_STATE_HOME/legion-rs/<hosts file name>-<hash of its path>`, or with --slurm
    /// `./legion-rs-slurm-<job id>`.
    #[arg(long)]
    state: Option<PathBuf>,
}

impl ClusterArgs {
    fn locate(&self) -> anyhow::Result<Located> {
        launch::locate(self.hosts.as_deref(), self.state.as_deref())
    }
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Seconds to wait for every worker to register.
    #[arg(long, default_value_t = launch::DEFAULT_REGISTER_TIMEOUT.as_secs_f64())]
    timeout: f64,
    /// Measure the links again even if no worker was started.
    #[arg(long)]
    measure: bool,
    /// With --slurm: the workers' QUIC port on every node (default 7400).
    #[arg(long, requires = "slurm", value_parser = clap::value_parser!(u16).range(1..))]
    port: Option<u16>,
}

pub fn up(a: UpArgs) -> anyhow::Result<()> {
    if !(a.timeout > 0.0 && a.timeout.is_finite()) {
        anyhow::bail!("--timeout must be a positive number of seconds");
    }
    let mut cluster = a.cluster.locate()?;
    if let Some(settings) = &mut cluster.slurm {
        settings.port = a.port.or(settings.port);
    }
    let (table, _) = launch::up_located(
        &cluster,
        &UpOptions {
            timeout: Duration::from_secs_f64(a.timeout),
            measure: a.measure,
        },
    )?;
    let name = match &cluster.slurm {
        Some(_) => format!("of {}", cluster.label()),
        None => cluster.label(),
    };
    println!("cluster {name} (state in {})", cluster.state.display());
    print!(
        "{}",
        launch::format_table(
            &table,
            &launch::load_links(&cluster.state)?,
            &launch::load_nics(&cluster.state)?,
        )
    );
    Ok(())
}

pub fn status(a: ClusterArgs) -> anyhow::Result<()> {
    let cluster = a.locate()?;
    let hosts = cluster.hosts()?;
    cluster.require_state()?;
    let table = launch::status(&hosts, &cluster.state)?;
    print!(
        "{}",
        launch::format_table(
            &table,
            &launch::load_links(&cluster.state)?,
            &launch::load_nics(&cluster.state)?,
        )
    );
    let down = table.iter().filter(|r| r.welcome.is_none()).count();
    if down > 0 {
        anyhow::bail!("{down} of {} worker(s) are down", table.len());
    }
    Ok(())
}

pub fn down(a: ClusterArgs) -> anyhow::Result<()> {
    let cluster = a.locate()?;
    let hosts = cluster.hosts()?;
    cluster.require_state()?;
    let stopped = launch::down(&hosts, &cluster.state, Duration::from_secs(5))?;
    if stopped.workers.is_empty() {
        println!("no worker of {} was running", cluster.label());
    } else {
        println!("stopped {}", stopped.workers.join(", "));
    }
    if !stopped.slurm_steps.is_empty() {
        println!("ended Slurm step(s) {}", stopped.slurm_steps.join(", "));
    }
    if !stopped.workers.is_empty() && !stopped.not_reached.is_empty() {
        println!(
            "not running (no answer): {}",
            stopped.not_reached.join(", ")
        );
    }
    Ok(())
}
