//! Worker processes on GPUs, and several GPUs in one process, as far as one machine shows them.
//!
//! On any machine: `--gpus` refuses what it cannot place, naming the flag; `plan --cluster` models
//! local `device = "cuda"` hosts as processes sharing one GPU. On a machine with a GPU (skipped
//! elsewhere, saying why; failed under `LEGION_REQUIRE=gpu`): `up` of two local workers with
//! `device = "cuda"`, `train --cluster` under data, owt and optcnn for 3 steps (slices staged out
//! of and into device memory, QUIC between the processes) equal to the CPU's one device within the
//! suite's tolerance, each step traced on both devices; `down` leaves no worker process and none
//! of them holding GPU memory; and `--gpus 0,0` (two logical GPUs on one device, slices between
//! them staged) equal to the CPU's one device too. The same CPU cluster code is covered with
//! `device = "cpu"` by `cluster.rs`.

mod common;
use common::stderr;

use common::{ALEXNET_64, assert_clean_failure, free_udp_port, init_checkpoint, legion, ok};
use common::{assert_same_tensors, train_from};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[test]
fn gpus_flag_errors_name_the_flag() {
    // Parsing: clap's usage error (exit 2) with the parser's reason.
    for (value, reason) in [
        ("", "comma-separated list of GPU ordinals"),
        ("0,x", "entry 2 'x' is not a GPU ordinal"),
        ("0,,1", "entry 2 is empty"),
    ] {
        let out = legion(&[
            "train", "--model", "lenet5", "--gpus", value, "--steps", "1",
        ]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--gpus") && err.contains(reason), "{err}");
    }
    // Placing: refused before anything starts, naming the flag, with or without a GPU here.
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--device",
        "cpu",
        "--devices",
        "2",
        "--gpus",
        "0,0",
        "--steps",
        "1",
    ]);
    assert_clean_failure(&out, &["--gpus places devices on GPUs", "--device cpu"]);
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--devices",
        "1",
        "--gpus",
        "0,0",
        "--steps",
        "1",
    ]);
    assert_clean_failure(
        &out,
        &["--gpus lists 2 GPUs for 1 device(s)", "--devices 2"],
    );
    let dir = tempfile::tempdir().unwrap();
    let hosts = local_hosts(dir.path(), "cpu", 2);
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--cluster",
        hosts.to_str().unwrap(),
        "--gpus",
        "0",
        "--steps",
        "1",
    ]);
    assert_clean_failure(&out, &["--gpus with --cluster"]);
}

/// A hosts file of `n` loopback hosts with one device each on `device`.
fn local_hosts(dir: &Path, device: &str, n: usize) -> PathBuf {
    let mut text = format!("[defaults]\ndevice = \"{device}\"\ndevices = 1\n\n");
    for i in 0..n {
        text += &format!(
            "[[host]]\nname = \"g{i}\"\naddress = \"127.0.0.1\"\nport = {}\n\n",
            free_udp_port()
        );
    }
    let path = dir.join("hosts.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `plan --cluster` prices local cuda hosts as processes sharing one GPU (no workers needed: the
/// links `up` would measure are then the default network), and `--profile` gives them its
/// staging and GPU kind.
#[test]
fn plan_models_local_cuda_hosts_as_processes_sharing_one_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = local_hosts(dir.path(), "cuda", 2);
    let state = dir.path().join("state");
    let args = |hosts: &Path, extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "plan",
            "--model",
            "alexnet",
            "--image-size",
            "64",
            "--batch",
            "8",
            "--cluster",
            hosts.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
            "--search",
            "data",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let run = |args: Vec<String>| ok(legion(&args.iter().map(String::as_str).collect::<Vec<_>>()));
    let plan = |extra: &[&str]| {
        let out = run(args(&hosts, &[extra, &["--json"]].concat()));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let text = String::from_utf8_lossy(&run(args(&hosts, &[])).stdout).to_string();
    assert!(
        text.contains("on hosts:2on1gpu: 2 device(s) on 2 node(s)"),
        "{text}"
    );
    let assumed = plan(&[]);
    let assumed_ms = assumed["searches"][0]["simulated_ms"].as_f64().unwrap();
    // A profile that measured staging 1000 times slower than assumed slows the synced step.
    let profile = dir.path().join("profile.json");
    std::fs::write(
        &profile,
        r#"{"version":1,"entries":[],"staged":{"bytes_per_s":1.25e7,"latency_s":3e-5}}"#,
    )
    .unwrap();
    let slow = plan(&["--profile", profile.to_str().unwrap()]);
    let slow_ms = slow["searches"][0]["simulated_ms"].as_f64().unwrap();
    assert!(slow_ms > 2.0 * assumed_ms, "{slow_ms} vs {assumed_ms}");
    // On cores, the same hosts are not a GPU.
    let cpu_dir = tempfile::tempdir().unwrap();
    let cpu = local_hosts(cpu_dir.path(), "cpu", 2);
    let text = String::from_utf8_lossy(&run(args(&cpu, &[])).stdout).to_string();
    assert!(text.contains("on hosts:2: 2 device(s)"), "{text}");
}

/// Whether the GPU is usable here; if not, the test is skipped (or failed under
/// `LEGION_REQUIRE=gpu`) with the probe's reason.
fn gpu_here() -> bool {
    match legion_cuda::probe() {
        Ok(_) => true,
        Err(reason) => {
            legion_ops::require::skip(legion_ops::require::Need::Gpu, reason);
            false
        }
    }
}

/// The processes `nvidia-smi` lists as holding GPU memory, or `None` without nvidia-smi.
fn gpu_processes() -> Option<Vec<u32>> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid", "--format=csv,noheader"])
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    })
}

#[test]
fn two_cuda_workers_train_like_one_device_and_down_leaves_nothing() {
    if !gpu_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hosts = local_hosts(dir.path(), "cuda", 2);
    let state = dir.path().join("state");
    let cluster_args = |command: &'static str| {
        vec![
            command.to_string(),
            hosts.to_str().unwrap().to_string(),
            "--state".into(),
            state.to_str().unwrap().to_string(),
        ]
    };
    let run = |args: Vec<String>| legion(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let table = String::from_utf8_lossy(&ok(run(cluster_args("up"))).stdout).to_string();
    let pids: Vec<u32> = table
        .lines()
        .filter(|l| l.starts_with('g'))
        .map(|l| l.split_whitespace().nth(4).unwrap().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{table}");

    let init = dir.path().join("init.safetensors");
    init_checkpoint(&init, &ALEXNET_64);
    let single = dir.path().join("single.safetensors");
    // The CPU's one device, the reference of the equivalence suite.
    train_from(&[], &ALEXNET_64, "3", &init, &single);
    let mut failures = Vec::new();
    for strategy in ["data", "owt", "optcnn"] {
        let saved = dir.path().join(format!("{strategy}.safetensors"));
        let trace = dir.path().join(format!("{strategy}.json"));
        let engine = [
            "--cluster",
            hosts.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
            "--strategy",
            strategy,
            // deterministic convolutions that sum directly, as `gpu_equivalence.rs` runs them
            "--conv-algos",
            "precise",
            "--trace",
            trace.to_str().unwrap(),
        ];
        let out = train_from(&engine, &ALEXNET_64, "3", &init, &saved);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("2 worker(s)"),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        if let Err(e) = std::panic::catch_unwind(|| assert_same_tensors(&saved, &single)) {
            failures.push(format!("{strategy}: {e:?}"));
        }
        // Both devices' timelines, with their transfers.
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let pids: std::collections::BTreeSet<i64> = events
            .iter()
            .filter(|e| e["ph"] == "X")
            .filter_map(|e| e["pid"].as_i64())
            .collect();
        assert!(pids.len() >= 2, "{strategy}: one timeline in its trace");
    }

    ok(run(cluster_args("down")));
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids
        .iter()
        .any(|&p| legion_cluster::launch::process_exists(p))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    for &p in &pids {
        assert!(
            !legion_cluster::launch::process_exists(p),
            "worker {p} runs after down"
        );
    }
    match gpu_processes() {
        Some(holding) => {
            let left: Vec<u32> = pids
                .iter()
                .copied()
                .filter(|p| holding.contains(p))
                .collect();
            assert!(left.is_empty(), "workers {left:?} still hold GPU memory");
        }
        None => println!("nvidia-smi not found: GPU memory after down not checked"),
    }
    assert!(failures.is_empty(), "{failures:#?}");

    // Two logical GPUs on this one: the multi-GPU path (slices between them staged).
    let logical = dir.path().join("logical.safetensors");
    let mut args = vec![
        "train",
        "--device",
        "cuda",
        "--devices",
        "2",
        "--gpus",
        "0,0",
    ];
    args.extend(["--strategy", "owt", "--conv-algos", "precise"]);
    args.extend(ALEXNET_64);
    args.extend(["--steps", "3", "--init", init.to_str().unwrap()]);
    args.extend(["--save", logical.to_str().unwrap()]);
    let out = ok(legion(&args));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("2 logical GPUs on 1 physical"), "{stdout}");
    assert_same_tensors(&logical, &single);
}
