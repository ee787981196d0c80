//! The example cluster descriptions shipped in `examples/` load and mean what their comments say.

use legion_cluster::hosts::{DEFAULT_PORT, Hosts};
use std::path::PathBuf;

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

#[test]
fn example_hosts_toml_is_three_local_workers() {
    let hosts = Hosts::load(example("hosts.toml")).unwrap();
    let names: Vec<_> = hosts.hosts.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["worker0", "worker1", "worker2"]);
    let ports: Vec<_> = hosts.hosts.iter().map(|h| h.port).collect();
    assert_eq!(ports, [7401, 7402, 7403]);
    assert!(hosts.hosts.iter().all(|h| h.is_local() && h.devices == 2));
    assert_eq!(hosts.device_ranges(), [0..2, 2..4, 4..6]);
    assert_eq!(hosts.num_devices(), 6);
}

#[test]
fn example_hostfile_is_mpi_style() {
    let hosts = Hosts::load(example("hostfile")).unwrap();
    let summary: Vec<_> = hosts
        .hosts
        .iter()
        .map(|h| (h.name.as_str(), h.devices, h.ssh.as_deref(), h.port))
        .collect();
    assert_eq!(
        summary,
        [
            ("localhost", 2, None, DEFAULT_PORT),
            ("node1", 4, Some("node1"), DEFAULT_PORT),
            ("10.0.0.3", 4, Some("10.0.0.3"), DEFAULT_PORT),
        ]
    );
    assert!(hosts.hosts[0].is_local() && !hosts.hosts[1].is_local());
    assert_eq!(hosts.device_ranges(), [0..2, 2..6, 6..10]);
}

#[test]
fn a_missing_file_is_named() {
    let e = Hosts::load(example("no-such-hosts.toml")).unwrap_err();
    assert!(e.to_string().contains("no-such-hosts.toml"), "{e}");
}
