//! Measuring a model's op costs on a cluster's workers before a search: each worker times, on its
//! own devices, the tiles its cost cache lacks ([`Control::MeasureCosts`]) and answers with what
//! the cache then holds. Workers on one machine share its cores, and one measuring beside another
//! would time both slower, so they measure in turn ([`measuring_rounds`]); workers on machines of
//! their own measure at once.

use crate::control::{Control, MeasuredCosts};
use crate::hosts::{Host, Hosts};
use crate::remote::{BUSY_WAIT, WorkerClient, greet};
use anyhow::bail;
use legion_ops::Precision;
use std::collections::HashMap;
use std::path::Path;

/// The machine a worker runs on, as far as sharing cores goes: this one for a worker the
/// launcher spawns here (loopback, or in a network namespace of this machine), else where it is
/// reached.
fn machine_of(host: &Host) -> String {
    match (&host.ssh, host.is_local()) {
        (_, true) => String::new(),
        (Some(dest), false) => dest.rsplit('@').next().unwrap_or(dest).to_string(),
        (None, false) => host.address.clone(),
    }
}

/// The workers that measure together, round after round: one worker of each machine a round, in
/// the hosts' order, so that no two measure on the same cores at once.
pub fn measuring_rounds(hosts: &[Host]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        let count = seen.entry(machine_of(host)).or_default();
        if rounds.len() <= *count {
            rounds.push(Vec::new());
        }
        rounds[*count].push(i);
        *count += 1;
    }
    rounds
}

/// Has every worker of the cluster whose state is in `state` measure `graph_json`'s op costs in
/// `precision`; `done(workers_done, workers)` after each answer. Returns each worker's name and
/// answer, in the hosts' order.
pub fn measure_costs(
    hosts: &Hosts,
    state: &Path,
    graph_json: &str,
    precision: Precision,
    done: &dyn Fn(usize, usize),
) -> anyhow::Result<Vec<(String, MeasuredCosts)>> {
    let mut client = WorkerClient::new(hosts, state)?;
    client.connect_all()?;
    let request = Control::MeasureCosts {
        graph_json: graph_json.to_string(),
        precision: precision.name().to_string(),
    };
    let total = hosts.hosts.len();
    let mut answers: Vec<Option<MeasuredCosts>> = vec![None; total];
    let mut finished = 0;
    done(0, total);
    // The same checks a job's start makes: the worker's version and devices, and a job of a
    // driver that has just died left to end.
    client.runtime.block_on(async {
        let busy_until = std::time::Instant::now() + BUSY_WAIT;
        for (i, host) in hosts.hosts.iter().enumerate() {
            greet(&client, i, host.devices, busy_until).await?;
        }
        anyhow::Ok(())
    })?;
    for round in measuring_rounds(&hosts.hosts) {
        client.runtime.block_on(async {
            for &i in &round {
                client.send(i, &request).await?;
            }
            // Each worker answers on its own channel: waiting in order loses no time.
            for &i in &round {
                match client.reply(i, None).await? {
                    Control::Costs(costs) => answers[i] = Some(costs),
                    other => bail!(
                        "worker {}: answered MeasureCosts with {}",
                        hosts.hosts[i].name,
                        other.name()
                    ),
                }
                finished += 1;
                done(finished, total);
            }
            anyhow::Ok(())
        })?;
    }
    Ok(hosts
        .hosts
        .iter()
        .zip(answers)
        .map(|(h, a)| (h.name.clone(), a.expect("every round answered")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, address: &str, ssh: Option<&str>, run_with: &[&str]) -> Host {
        Host {
            name: name.into(),
            address: address.into(),
            port: 7000,
            devices: 2,
            devices_from_gpus: false,
            device_kind: "cpu".into(),
            ssh: ssh.map(String::from),
            run_with: run_with.iter().map(|s| s.to_string()).collect(),
            binary: None,
        }
    }

    #[test]
    fn workers_sharing_a_machine_measure_in_turn_and_others_at_once() {
        // Loopback workers and workers in this machine's network namespaces share its cores.
        let local = [
            host("a", "127.0.0.1", None, &[]),
            host("b", "10.0.0.2", None, &["ip", "netns", "exec", "h2"]),
            host("c", "localhost", None, &[]),
        ];
        assert_eq!(measuring_rounds(&local), vec![vec![0], vec![1], vec![2]]);
        // Hosts of their own measure together; two workers of one host (reached by ssh under
        // two users, or at one address) take turns.
        let remote = [
            host("a", "10.0.0.1", None, &[]),
            host("b", "10.0.0.2", None, &[]),
            host("c", "10.0.0.1", None, &[]),
            host("d", "127.0.0.1", Some("alice@node7"), &[]),
            host("e", "127.0.0.1", Some("bob@node7"), &[]),
        ];
        assert_eq!(measuring_rounds(&remote), vec![vec![0, 1, 3], vec![2, 4]]);
        assert!(measuring_rounds(&[]).is_empty());
    }
}
