//! The link measurements of `up`: every worker probes every other one, then all at once.

use super::*;

/// Every worker probes every other one, then all of them at once.
pub(super) fn measure(
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
