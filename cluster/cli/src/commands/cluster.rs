//! `legion-rs up`, `status` and `down`.

use clap::Args;
use legion_cluster::hosts::Hosts;
use legion_cluster::launch::{self, UpOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// The cluster: a hosts.toml or an MPI-style hostfile.
    hosts: PathBuf,
    /// The cluster's state directory (certificates, logs, measured links); default:
    /// `$XDG_STATE_HOME/legion-rs/<hosts file name>-<hash of its path>`.
    #[arg(long)]
    state: Option<PathBuf>,
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
}

pub fn up(a: UpArgs) -> anyhow::Result<()> {
    let hosts = Hosts::load(&a.cluster.hosts)?;
    let state = launch::state_dir(&a.cluster.hosts, a.cluster.state.as_deref())?;
    if !(a.timeout > 0.0 && a.timeout.is_finite()) {
        anyhow::bail!("--timeout must be a positive number of seconds");
    }
    let table = launch::up(
        &a.cluster.hosts,
        &hosts,
        &state,
        &UpOptions {
            timeout: Duration::from_secs_f64(a.timeout),
            measure: a.measure,
        },
    )?;
    println!(
        "cluster {} (state in {})",
        a.cluster.hosts.display(),
        state.display()
    );
    print!(
        "{}",
        launch::format_table(
            &table,
            &launch::load_links(&state)?,
            &launch::load_nics(&state)?,
        )
    );
    Ok(())
}

pub fn status(a: ClusterArgs) -> anyhow::Result<()> {
    let hosts = Hosts::load(&a.hosts)?;
    let state = launch::state_dir(&a.hosts, a.state.as_deref())?;
    let table = launch::status(&hosts, &state)?;
    print!(
        "{}",
        launch::format_table(
            &table,
            &launch::load_links(&state)?,
            &launch::load_nics(&state)?,
        )
    );
    let down = table.iter().filter(|r| r.welcome.is_none()).count();
    if down > 0 {
        anyhow::bail!("{down} of {} worker(s) are down", table.len());
    }
    Ok(())
}

pub fn down(a: ClusterArgs) -> anyhow::Result<()> {
    let hosts = Hosts::load(&a.hosts)?;
    let state = launch::state_dir(&a.hosts, a.state.as_deref())?;
    let stopped = launch::down(&hosts, &state, Duration::from_secs(5))?;
    if stopped.is_empty() {
        println!("no worker of {} was running", a.hosts.display());
    } else {
        println!("stopped {}", stopped.join(", "));
    }
    Ok(())
}
