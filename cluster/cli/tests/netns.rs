//! Two hosts in their own network namespaces, joined through a bridge by veth pairs shaped with
//! `tc tbf`: `up` starts a worker in each (`run_with = ["ip", "netns", "exec", NS]`), measures the
//! shaped link, and a job trains across it. Needs root and iproute2; skipped with a printed reason
//! where namespaces cannot be made.

mod common;

use common::{ALEXNET_64, assert_same_tensors, init_checkpoint, legion, ok, train_from};
use std::process::Command;

/// Shaped rate of every veth, both directions.
const RATE_MBIT: f64 = 200.0;

/// Namespaces, veth pairs and a bridge, removed on drop (deleting a namespace deletes its veth
/// end, and with it the pair).
struct ShapedNet {
    namespaces: Vec<String>,
    bridge: String,
    /// What names its interfaces and picks its subnet: the process's and this net's number in
    /// it, as the tests of this file build theirs at once.
    id: u32,
    subnet: u32,
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl ShapedNet {
    /// `hosts` namespaces at 10.78.S.2, .3, ... with the bridge (this namespace) at 10.78.S.1.
    fn new(hosts: usize) -> Result<ShapedNet, String> {
        static NETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let nth = NETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = (std::process::id() % 10_000) * 10 + nth % 10;
        let subnet = (std::process::id() + 97 * nth) % 250;
        let mut net = ShapedNet {
            namespaces: Vec::new(),
            bridge: format!("lgb{id}"),
            id,
            subnet,
        };
        let rate = format!("{RATE_MBIT}mbit");
        let tbf = ["tbf", "rate", &rate, "burst", "256kb", "latency", "50ms"];
        sh(&["ip", "link", "add", &net.bridge, "type", "bridge"])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("10.78.{subnet}.1/24"),
            "dev",
            &net.bridge,
        ])?;
        sh(&["ip", "link", "set", &net.bridge, "up"])?;
        for i in 0..hosts {
            let ns = format!("lgn{id}-{i}");
            sh(&["ip", "netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let (outer, inner) = (format!("lga{id}-{i}"), format!("lgc{id}-{i}"));
            sh(&[
                "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])?;
            sh(&["ip", "link", "set", &outer, "master", &net.bridge, "up"])?;
            sh(&["ip", "link", "set", &inner, "netns", &ns])?;
            let in_ns = |args: &[&str]| {
                let mut all = vec!["ip", "netns", "exec", &ns];
                all.extend(args);
                sh(&all)
            };
            in_ns(&[
                "ip",
                "addr",
                "add",
                &format!("10.78.{subnet}.{}/24", i + 2),
                "dev",
                &inner,
            ])?;
            in_ns(&["ip", "link", "set", &inner, "up"])?;
            in_ns(&["ip", "link", "set", "lo", "up"])?;
            let mut shape = vec!["tc", "qdisc", "add", "dev", &inner, "root"];
            shape.extend(tbf);
            in_ns(&shape)?;
            let mut shape = vec!["tc", "qdisc", "add", "dev", &outer, "root"];
            shape.extend(tbf);
            sh(&shape)?;
        }
        Ok(net)
    }

    /// [`ShapedNet::new`], or `None` where namespaces cannot be made here, the test skipped
    /// with the reason (failed under `LEGION_REQUIRE=netns`).
    fn or_skip(hosts: usize) -> Option<ShapedNet> {
        match ShapedNet::new(hosts) {
            Ok(net) => Some(net),
            Err(e) => {
                legion_ops::require::skip(
                    legion_ops::require::Need::Netns,
                    format!("cannot build network namespaces here ({e})"),
                );
                None
            }
        }
    }

    fn address(&self, i: usize) -> String {
        format!("10.78.{}.{}", self.subnet, i + 2)
    }

    /// Host `i`'s veth on the bridge's side, set down or up: its network gone or back.
    fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let outer = format!("lga{}-{i}", self.id);
        sh(&["ip", "link", "set", &outer, if up { "up" } else { "down" }])
    }

    /// A hosts file of these namespaces, `devices` each.
    fn hosts_file(&self, path: &std::path::Path, devices: usize) {
        let mut text = String::new();
        for (i, ns) in self.namespaces.iter().enumerate() {
            text += &format!(
                "[[host]]\nname = \"h{i}\"\naddress = \"{}\"\ndevices = {devices}\nrun_with = [\"ip\", \"netns\", \"exec\", \"{ns}\"]\n\n",
                self.address(i)
            );
        }
        std::fs::write(path, text).unwrap();
    }
}

impl Drop for ShapedNet {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        let _ = sh(&["ip", "link", "del", &self.bridge]);
    }
}

#[test]
fn two_hosts_over_a_shaped_link_train_alexnet() {
    let Some(net) = ShapedNet::or_skip(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts.toml");
    net.hosts_file(&hosts, 2);
    let state = dir.path().join("state");
    let (hosts, state) = (hosts.to_str().unwrap(), state.to_str().unwrap());
    struct Down<'a>(&'a str, &'a str);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            let _ = legion(&["down", self.0, "--state", self.1]);
        }
    }
    let _down = Down(hosts, state);
    let up = ok(legion(&["up", hosts, "--state", state]));
    println!("{}", String::from_utf8_lossy(&up.stdout));

    let links: Vec<legion_cluster::launch::MeasuredLink> = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("state/links.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(links.len(), 2);
    // each host's one shaped veth is its NIC: with its one peer, about the shaper's rate
    let nics: Vec<legion_cluster::launch::MeasuredNic> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("state/nics.json")).unwrap())
            .unwrap();
    assert_eq!(nics.len(), 2, "{nics:?}");
    for n in &nics {
        let mbit = n.bytes_per_s * 8.0 / 1e6;
        assert!(
            n.peers == 1 && (0.3 * RATE_MBIT..1.2 * RATE_MBIT).contains(&mbit),
            "{}: {mbit:.0} Mbit/s through a {RATE_MBIT} Mbit/s shaper",
            n.host
        );
    }
    for l in &links {
        let mbit = l.bytes_per_s * 8.0 / 1e6;
        assert!(
            (0.3 * RATE_MBIT..1.2 * RATE_MBIT).contains(&mbit),
            "{} -> {} measured {mbit:.0} Mbit/s through a {RATE_MBIT} Mbit/s shaper",
            l.from,
            l.to
        );
        // The transport's own work, at both ends: encryption, packets, copies. Either end alone
        // may read 0 when other processes keep the cores busy (the kernel then does part of the
        // receive work in their time, and the difference of two probes drowns in noise).
        let (send, recv) = (l.send_cpu_s_per_byte, l.recv_cpu_s_per_byte);
        assert!(
            (0.0..1e-6).contains(&send) && (0.0..1e-6).contains(&recv) && send + recv > 0.0,
            "{} -> {}: {send} / {recv} CPU seconds per byte sent / received",
            l.from,
            l.to
        );
    }

    let model = ALEXNET_64;
    let init = dir.path().join("init.safetensors");
    init_checkpoint(&init, &model);
    let trained = dir.path().join("cluster.safetensors");
    let engine = ["--cluster", hosts, "--state", state, "--strategy", "optcnn"];
    let out = train_from(&engine, &model, "3", &init, &trained);
    println!("{}", String::from_utf8_lossy(&out.stdout));
    let single = dir.path().join("single.safetensors");
    train_from(&[], &model, "3", &init, &single);
    assert_same_tensors(&trained, &single);
}

#[test]
fn a_worker_whose_network_goes_away_mid_run_is_recovered_from() {
    let Some(net) = ShapedNet::or_skip(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts.toml");
    net.hosts_file(&hosts, 1);
    let state = dir.path().join("state");
    let (hosts, state) = (hosts.to_str().unwrap(), state.to_str().unwrap());
    let up = ok(legion(&["up", hosts, "--state", state]));
    let table = String::from_utf8_lossy(&up.stdout).to_string();
    let pid = |name: &str| -> u32 {
        let row = table.lines().find(|l| l.starts_with(name)).unwrap();
        row.split_whitespace().nth(4).unwrap().parse().unwrap()
    };
    let isolated = pid("h1 ");
    // Stops every worker whatever the test does, the isolated one by its pid.
    struct Down<'a>(&'a str, &'a str, u32);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(self.2 as i32, libc::SIGKILL) };
            let _ = legion(&["down", self.0, "--state", self.1]);
        }
    }
    let _down = Down(hosts, state, isolated);

    let model = ["--model", "lenet5", "--batch", "12", "--strategy", "data"];
    let init = dir.path().join("init.safetensors");
    init_checkpoint(&init, &model);
    let saved = dir.path().join("recovered.safetensors");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args([
            "train",
            "--device",
            "cpu",
            "--cluster",
            hosts,
            "--state",
            state,
        ])
        .args(model)
        .args(["--steps", "60", "--init", init.to_str().unwrap()])
        .args(["--save", saved.to_str().unwrap(), "--checkpoint-every", "2"])
        .args(["--snapshot-every", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !saved.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint written"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    net.set_link(1, false).unwrap();
    let out = run.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("recovered from a lost worker (1 of at most 3): worker h1"),
        "{stderr}"
    );
    net.set_link(1, true).unwrap();
    let single = dir.path().join("single.safetensors");
    train_from(&[], &model, "60", &init, &single);
    assert_same_tensors(&saved, &single);
}
