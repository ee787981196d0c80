//! Multi-process clusters on loopback: `legion-rs up` starts real worker processes, `train
//! --cluster` runs a job on them over QUIC with mutual TLS, `down` stops them. Training on the
//! cluster saves the weights single-device training saves; a killed worker is named within 5 s,
//! and `--resume` then finishes where an uninterrupted run ends.

mod common;

use common::{
    ALEXNET_64, assert_same_tensors, free_udp_port, init_checkpoint, kill_worker_mid_run,
    largest_difference, legion, ok, signal_workers_mid_run, train_from,
};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A cluster of loopback workers in a temporary directory; stopped (and checked stopped) when
/// dropped, so a failing test leaves no process behind.
struct Cluster {
    dir: tempfile::TempDir,
    hosts: PathBuf,
    state: PathBuf,
}

impl Cluster {
    fn new(devices: &[usize]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for (i, d) in devices.iter().enumerate() {
            text += &format!(
                "[[host]]\nname = \"w{i}\"\naddress = \"127.0.0.1\"\nport = {}\ndevices = {d}\n\n",
                free_udp_port()
            );
        }
        let hosts = dir.path().join("hosts.toml");
        std::fs::write(&hosts, text).unwrap();
        let state = dir.path().join("state");
        Cluster { dir, hosts, state }
    }

    fn args<'a>(&'a self, command: &'a str) -> Vec<&'a str> {
        vec![
            command,
            self.hosts.to_str().unwrap(),
            "--state",
            self.state.to_str().unwrap(),
        ]
    }

    /// `up`, returning the worker pids from its table. The workers keep their measured op
    /// costs in a cache of this cluster's own.
    fn up(&self) -> Vec<u32> {
        let out = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
            .args(self.args("up"))
            .env("LEGION_RS_COST_CACHE", self.path("worker-costs"))
            .output()
            .expect("legion-rs runs");
        let out = ok(out);
        let table = String::from_utf8_lossy(&out.stdout).to_string();
        let pids: Vec<u32> = table
            .lines()
            .filter(|l| l.starts_with('w'))
            .map(|l| l.split_whitespace().nth(4).unwrap().parse().unwrap())
            .collect();
        assert!(!pids.is_empty(), "no workers in\n{table}");
        pids
    }

    fn train_args<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "train",
            "--cluster",
            self.hosts.to_str().unwrap(),
            "--state",
            self.state.to_str().unwrap(),
        ];
        args.extend(extra);
        args
    }

    /// The train flags that run on this cluster.
    fn engine(&self) -> [&str; 4] {
        [
            "--cluster",
            self.hosts.to_str().unwrap(),
            "--state",
            self.state.to_str().unwrap(),
        ]
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = legion(&self.args("down"));
    }
}

fn alive(pid: u32) -> bool {
    legion_cluster::launch::process_exists(pid)
}

#[test]
fn up_train_down_on_three_workers_equals_one_device() {
    let cluster = Cluster::new(&[1, 2, 1]);
    let pids = cluster.up();
    assert_eq!(pids.len(), 3);
    // Harmless when it is already up: same workers.
    assert_eq!(cluster.up(), pids);
    ok(legion(&cluster.args("status")));
    let links = std::fs::read_to_string(cluster.state.join("links.json")).unwrap();
    assert!(links.contains("\"from\": \"w2\""), "{links}");
    // every worker's interface, with both of its peers at once
    let nics: Vec<legion_cluster::launch::MeasuredNic> =
        serde_json::from_str(&std::fs::read_to_string(cluster.state.join("nics.json")).unwrap())
            .unwrap();
    assert_eq!(nics.len(), 3, "{nics:?}");
    assert!(
        nics.iter().all(|n| n.peers == 2 && n.bytes_per_s > 0.0),
        "{nics:?}"
    );

    let init = cluster.path("init.safetensors");
    init_checkpoint(&init, &ALEXNET_64);
    let on_cluster = cluster.path("cluster.safetensors");
    let engine = [cluster.engine().as_slice(), &["--strategy", "optcnn"]].concat();
    let out = train_from(&engine, &ALEXNET_64, "3", &init, &on_cluster);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("4 device(s) (3 worker(s)"), "{stdout}");
    // Before its search each worker timed the tiles of its own devices, kept in its cache; the
    // workers share this machine, so they measure in turn, and w2, with w0's one device on the
    // same cores, finds every tile w0 kept.
    let costs = stdout.lines().find(|l| l.contains("costs: ")).unwrap_or("");
    assert!(
        costs.contains("costs: measured on 3 worker(s) (w0: ")
            && costs.matches("new tile(s) timed in").count() == 2
            && costs.contains("; w2: every tile from ")
            && costs.contains("each tile the median of theirs"),
        "{stdout}"
    );
    // A second run of the same model measures nothing new on any worker.
    let again = cluster.path("again.safetensors");
    let json = [engine.as_slice(), &["--json"]].concat();
    let out = train_from(&json, &ALEXNET_64, "1", &init, &again);
    let costs = summary_of(&String::from_utf8_lossy(&out.stdout))["plan"]["costs"].clone();
    let workers = costs["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3, "{costs}");
    assert!(workers.iter().all(|w| w["new_tiles"] == 0), "{costs}");
    assert!(costs["priced"]["measured"].as_u64() > Some(0), "{costs}");
    assert!(
        workers[1]["cache"]
            .as_str()
            .unwrap()
            .starts_with(cluster.path("worker-costs").to_str().unwrap()),
        "{costs}"
    );

    let single = cluster.path("single.safetensors");
    train_from(&[], &ALEXNET_64, "3", &init, &single);
    assert_same_tensors(&on_cluster, &single);

    // Verified on the workers: the search's strategy and data parallelism train 3 steps each,
    // the job re-sharded from one to the other over the workers, and the run trains on with the
    // faster; what it trains is what one device trains.
    let lenet = ["--model", "lenet5", "--batch", "8"];
    let lenet_init = cluster.path("lenet-init.safetensors");
    init_checkpoint(&lenet_init, &lenet);
    let verified = cluster.path("verified.safetensors");
    let engine = [cluster.engine().as_slice(), &["--verify", "1"]].concat();
    let out = train_from(&engine, &lenet, "9", &lenet_init, &verified);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("verified on the devices"), "{stdout}");
    assert_eq!(stdout.matches("  kept").count(), 1, "{stdout}");
    let lenet_single = cluster.path("lenet-single.safetensors");
    train_from(&[], &lenet, "9", &lenet_init, &lenet_single);
    assert_same_tensors(&verified, &lenet_single);

    // A folder of photographs under torchvision's training recipe (random resized crops and
    // flips), one of them cut short: each worker reads its devices' samples from the folder
    // itself, and the driver sends indices and labels, so the workers train what one device
    // trains on the same files, the unreadable sample replaced alike; what a step's samples took
    // to the workers is measured. With --data-on-driver the driver reads them and sends 8-bit
    // images, which the workers make values: their bytes, not their values' four times that.
    let images = cluster.path("images");
    for class in 0..2u32 {
        let folder = images.join(format!("class{class}"));
        std::fs::create_dir_all(&folder).unwrap();
        for i in 0..8u32 {
            let (w, h) = (30 + 3 * i, 26 + 2 * (i % 3));
            image::RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([
                    (x * 8) as u8,
                    (y * 9 + 40 * class) as u8,
                    ((x ^ y) * 5) as u8,
                ])
            })
            .save(folder.join(format!("{i}.png")))
            .unwrap();
        }
    }
    let cut_short = images.join("class1/3.png");
    let whole = std::fs::read(&cut_short).unwrap();
    std::fs::write(&cut_short, &whole[..whole.len() / 2]).unwrap();
    let data = format!("folder:{}", images.display());
    let photos = [
        "--model",
        "lenet5",
        "--batch",
        "8",
        "--classes",
        "2",
        "--data",
        &data,
    ];
    let photos_init = cluster.path("photos-init.safetensors");
    init_checkpoint(&photos_init, &photos);
    let photos_single = cluster.path("photos-single.safetensors");
    let out = train_from(&["--json"], &photos, "4", &photos_init, &photos_single);
    let skipped = summary_of(&String::from_utf8_lossy(&out.stdout))["skipped_samples"].clone();
    assert!(skipped.as_u64().unwrap() > 0, "{skipped}");
    let pixels = (8 * 28 * 28) as f64;
    for (strategy, read_by) in [
        ("data", "workers"),
        ("optcnn", "workers"),
        ("data", "driver"),
    ] {
        let photos_workers = cluster.path(&format!("photos-{strategy}-{read_by}.safetensors"));
        let mut flags = vec!["--strategy", strategy, "--json"];
        if read_by == "driver" {
            flags.push("--data-on-driver");
        }
        let engine = [cluster.engine().as_slice(), &flags].concat();
        let out = train_from(&engine, &photos, "4", &photos_init, &photos_workers);
        let summary = summary_of(&String::from_utf8_lossy(&out.stdout));
        assert_same_tensors(&photos_workers, &photos_single);
        assert_eq!(
            summary["skipped_samples"], skipped,
            "{strategy}, read by the {read_by}"
        );
        let sent = summary["input_bytes_per_step"].as_f64().unwrap();
        match read_by {
            // indices, labels and control: under 1 KB a sample, and a fraction of even 8-bit
            // pixels of these small images
            "workers" => assert!(
                sent <= 1024.0 * 8.0 && sent < pixels / 4.0,
                "{strategy}: a step's samples took {sent} bytes to the workers that read them"
            ),
            _ => assert!(
                sent >= pixels && sent < 1.25 * pixels,
                "a step's samples took {sent} bytes to the workers, its images are {pixels} bytes"
            ),
        }
    }

    // bf16 on the workers: the job carries its precision, so they plan and compute in bf16 (bf16
    // slices over QUIC) and train what 4 embedded devices train in bf16 under the same strategy,
    // and not what fp32 trains. Not bit for bit: w1 and w2 share a host, whose relay sums their
    // gradients before the owner adds them, in another order than one host's devices.
    let run = |engine: &[&str], precision: &str, name: &str| {
        let out = cluster.path(name);
        let engine = [engine, &["--strategy", "owt", "--precision", precision]].concat();
        train_from(&engine, &ALEXNET_64, "2", &init, &out);
        legion_ops::checkpoint::load(&out).unwrap().tensors
    };
    let bf16_workers = run(&cluster.engine(), "bf16", "bf16-cluster.safetensors");
    let bf16_embedded = run(&["--devices", "4"], "bf16", "bf16-embedded.safetensors");
    let fp32_embedded = run(&["--devices", "4"], "fp32", "fp32-embedded.safetensors");
    let close = largest_difference(&bf16_workers, &bf16_embedded);
    let apart = largest_difference(&bf16_workers, &fp32_embedded);
    assert!(
        close <= 1e-4,
        "bf16 on the workers against embedded: {close:e}"
    );
    assert!(
        apart > 10.0 * close,
        "the workers trained in fp32: {apart:e} against {close:e}"
    );

    // A schedule on the workers: each step's rate travels with it (4 steps: two of warm-up at
    // half and the whole rate, two of the cosine), so they train what 4 embedded devices train
    // under it; and not what the warm-up and a constant rate train.
    let scheduled = |engine: &[&str], schedule: &str, name: &str| {
        let out = cluster.path(name);
        let sgd = [
            "--lr-schedule",
            schedule,
            "--warmup-steps",
            "2",
            "--nesterov",
        ];
        let engine = [engine, &["--strategy", "owt"], &sgd].concat();
        train_from(&engine, &ALEXNET_64, "4", &init, &out);
        legion_ops::checkpoint::load(&out).unwrap().tensors
    };
    let workers = scheduled(&cluster.engine(), "cosine", "cosine-cluster.safetensors");
    let embedded = scheduled(&["--devices", "4"], "cosine", "cosine-embedded.safetensors");
    let close = largest_difference(&workers, &embedded);
    assert!(close <= 1e-4, "a schedule on the workers: {close:e}");
    let warmup_only = scheduled(&cluster.engine(), "constant", "warmup-cluster.safetensors");
    let apart = largest_difference(&workers, &warmup_only);
    assert!(
        apart > 10.0 * close,
        "the workers ignored the cosine: {apart:e} against {close:e}"
    );

    // Held-out data scored on the workers' devices every 2 steps: inference through their
    // forward gives the scores one device gives, and the steps after it train on as if it had
    // not run.
    let scored = |engine: &[&str], name: &str| {
        let out = cluster.path(name);
        let held_out = ["--val-data", "synthetic:12", "--eval-every", "2", "--json"];
        let engine = [engine, &["--strategy", "owt"], &held_out].concat();
        let run = train_from(&engine, &ALEXNET_64, "4", &init, &out);
        let scores: Vec<serde_json::Value> = String::from_utf8_lossy(&run.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["eval"] == true)
            .collect();
        (scores, out)
    };
    let (on_workers, workers_out) = scored(&cluster.engine(), "scored-cluster.safetensors");
    let (on_one, one_out) = scored(&[], "scored-one.safetensors");
    assert_eq!(on_workers.len(), 2, "{on_workers:?}");
    for (w, o) in on_workers.iter().zip(&on_one) {
        assert_eq!((&w["step"], &w["samples"]), (&o["step"], &o["samples"]));
        let (lw, lo) = (w["loss"].as_f64().unwrap(), o["loss"].as_f64().unwrap());
        assert!((lw - lo).abs() <= 1e-4 * lo.abs(), "{w} against {o}");
        assert_eq!(w["top5"], o["top5"], "{w} against {o}");
    }
    assert_same_tensors(&workers_out, &one_out);

    // --compare on the cluster: every strategy runs as a job on the same workers.
    let lenet = legion_ops::zoo::find("lenet5").unwrap();
    let graph = lenet.build(&lenet.default_config(8)).unwrap();
    let traces = cluster.path("traces");
    std::fs::create_dir_all(&traces).unwrap();
    let settings = legion_cli::compare::CompareSettings {
        devices: 1,
        warmup: 0,
        steps: 1,
        seed: 1,
        cluster: Some(legion_cli::compare::ClusterTarget {
            hosts: legion_cluster::hosts::Hosts::load(&cluster.hosts).unwrap(),
            state: cluster.state.clone(),
        }),
        strategies: legion_cli::compare::strategies_from("all"),
        traces: Some(traces.clone()),
        costs: legion::costs::Costs::Measured,
        cost_cache: None,
    };
    let rows = legion_cli::compare::compare(&graph, &settings).unwrap();
    assert_eq!(rows.len(), legion_cli::compare::all_strategies().len());
    for r in &rows {
        assert!(r.measured_ms > 0.0 && r.simulated_ms > 0.0, "{r:?}");
        // every strategy, the other papers' planners' included, trains the same network
        assert!(r.max_rel_diff_from_one_device <= 1e-4, "{r:?}");
    }
    assert!(
        rows[0].comm_bytes_per_step > 0,
        "data parallelism syncs over the network"
    );
    // each strategy's measured and simulated timelines, side by side
    for strategy in legion_cli::compare::STRATEGIES {
        for what in ["measured", "simulated"] {
            let path = traces.join(format!("{strategy}.{what}.json"));
            let trace: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let events = trace["traceEvents"].as_array().unwrap();
            let tasks = events.iter().filter(|e| e["ph"] == "X").count();
            assert!(tasks > 10, "{}: {tasks} tasks", path.display());
        }
    }

    ok(legion(&cluster.args("down")));
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in pids {
        assert!(!alive(p), "worker {p} still runs after down");
    }
    let out = legion(&cluster.args("status"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("DOWN"));
}

const LENET: [&str; 6] = ["--model", "lenet5", "--batch", "8", "--strategy", "data"];

/// A random valid strategy of `graph` over `devices`: a config drawn per layer.
fn random_strategy(graph: &legion_ops::Graph, devices: usize, seed: u64) -> String {
    let mut rng = legion_ops::rng::Rng::new(seed);
    let configs: Vec<_> = graph
        .layers()
        .iter()
        .map(|l| {
            let dims = l.op.spec().parallel_dims(&l.shape);
            let space = legion_planner::ConfigSpace::enumerate(&l.shape, dims, devices);
            space.config(rng.below(space.len()))
        })
        .collect();
    legion_ops::strategy::Strategy::from_configs(graph, &configs).to_json()
}

/// Data parallelism and random strategies of LeNet-5 on 4 devices of real workers: on 2 hosts of
/// 2 devices, the replicas a host holds are summed by its relay before they cross to the block's
/// owner; on 4 hosts of 1, every replica goes to its owner. Both train what one device trains.
#[test]
fn relayed_and_owner_sync_train_what_one_device_trains_under_random_strategies() {
    let relayed = Cluster::new(&[2, 2]);
    let owners = Cluster::new(&[1, 1, 1, 1]);
    relayed.up();
    owners.up();
    let lenet = ["--model", "lenet5", "--batch", "8"];
    let init = relayed.path("init.safetensors");
    init_checkpoint(&init, &lenet);
    let single = relayed.path("single.safetensors");
    train_from(&[], &lenet, "4", &init, &single);
    let zoo = legion_ops::zoo::find("lenet5").unwrap();
    let graph = zoo.build(&zoo.default_config(8)).unwrap();
    for seed in [0, 1, 2, 3] {
        let strategy = match seed {
            0 => "data".to_string(),
            _ => {
                let file = relayed.path(&format!("random-{seed}.json"));
                std::fs::write(&file, random_strategy(&graph, 4, seed)).unwrap();
                file.display().to_string()
            }
        };
        for (cluster, sync) in [(&relayed, "relayed"), (&owners, "owner")] {
            let out = cluster.path(&format!("{sync}-{seed}.safetensors"));
            let engine = [cluster.engine().as_slice(), &["--strategy", &strategy]].concat();
            train_from(&engine, &lenet, "4", &init, &out);
            let (a, b) = (
                legion_ops::checkpoint::load(&out).unwrap(),
                legion_ops::checkpoint::load(&single).unwrap(),
            );
            let d = largest_difference(&a.tensors, &b.tensors);
            assert!(d <= 1e-4, "{strategy}, {sync} sync: {d:e} from one device");
        }
    }
}

#[test]
fn a_killed_worker_is_named_within_5s_and_resume_finishes_the_run() {
    let cluster = Cluster::new(&[1, 1]);
    let pids = cluster.up();
    let init = cluster.path("init.safetensors");
    init_checkpoint(&init, &LENET);
    let steps = "400";
    let checkpoint = cluster.path("ckpt.safetensors");
    let mut args = cluster.train_args(&LENET);
    args.extend([
        "--steps",
        steps,
        "--init",
        init.to_str().unwrap(),
        "--save",
        checkpoint.to_str().unwrap(),
        "--checkpoint-every",
        "5",
        "--no-recover",
    ]);
    let mut run = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (status, noticed, stderr) =
        kill_worker_mid_run(&mut run, &checkpoint, Duration::from_secs(120), pids[1]);
    assert!(!status.success(), "training survived a killed worker");
    assert!(
        stderr.contains("worker w1"),
        "the error does not name w1: {stderr}"
    );
    assert!(
        noticed < Duration::from_secs(5),
        "noticed after {noticed:?}: {stderr}"
    );
    // What to do next: restart the worker, resume from the snapshot saved.
    assert!(
        stderr.contains("recovery is off (--no-recover)")
            && stderr.contains("`legion-rs up ")
            && stderr.contains(&format!("--resume {}", checkpoint.display())),
        "{stderr}"
    );

    // Restart the dead worker, then continue from the last checkpoint.
    cluster.up();
    let mut args = cluster.train_args(&LENET);
    args.extend([
        "--steps",
        steps,
        "--resume",
        checkpoint.to_str().unwrap(),
        "--save",
        checkpoint.to_str().unwrap(),
    ]);
    ok(legion(&args));

    // The uninterrupted run is the same job on the same workers: a kernel splits its samples by its
    // device's pool threads (see `legion_runtime::threads_per_device`), so an embedded
    // run, whose two devices share the cores, rounds differently, and 400 steps amplify that.
    let uninterrupted = cluster.path("uninterrupted.safetensors");
    train_from(&cluster.engine(), &LENET, steps, &init, &uninterrupted);
    assert_same_tensors(&checkpoint, &uninterrupted);
}

/// LeNet-5 at batch 12 under data parallelism: 60 steps stay within 1e-4 of one device.
const LENET_12: [&str; 6] = ["--model", "lenet5", "--batch", "12", "--strategy", "data"];

/// The summary object of a `train --json` run's output.
fn summary_of(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .find(|v: &serde_json::Value| v["summary"] == true)
        .unwrap_or_else(|| panic!("no summary in {stdout}"))
}

/// Trains LeNet-5 on a cluster of `workers` one-device workers, sends each of `faults` (a worker's
/// index, a signal) once the run has checkpointed twice, and checks that the run recovered: it
/// ends on the workers left, having trained what one device trains. Returns the summary.
fn recovers_from(workers: usize, faults: &[(usize, libc::c_int)]) -> serde_json::Value {
    let cluster = Cluster::new(&vec![1; workers]);
    let pids = cluster.up();
    let init = cluster.path("init.safetensors");
    init_checkpoint(&init, &LENET_12);
    let steps = "60";
    let saved = cluster.path("recovered.safetensors");
    let mut args = cluster.train_args(&LENET_12);
    args.extend([
        "--device",
        "cpu",
        "--steps",
        steps,
        "--init",
        init.to_str().unwrap(),
        "--save",
        saved.to_str().unwrap(),
        "--checkpoint-every",
        "2",
        "--snapshot-every",
        "2",
        "--json",
    ]);
    let mut run = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = run.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    let signals: Vec<(u32, libc::c_int)> = faults.iter().map(|&(w, s)| (pids[w], s)).collect();
    let (status, took, stderr) =
        signal_workers_mid_run(&mut run, &saved, Duration::from_secs(120), &signals);
    let stdout = reader.join().unwrap();
    // Hung workers go on, to be stopped.
    for &(pid, _) in &signals {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    assert!(status.success(), "the run did not survive: {stderr}");
    assert!(
        stdout.contains("{\"recovered\":"),
        "no recovery event: {stdout}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}: {stderr}");
    let summary = summary_of(&stdout);
    let left = workers - faults.len();
    assert_eq!(summary["devices"], left, "{summary}");
    // One recovery per loss noticed (a loss noticed while restarting joins the one under way).
    let recoveries = summary["recoveries"].as_array().unwrap();
    let last = recoveries.last().unwrap();
    assert_eq!(last["devices"], left, "{summary}");
    assert_eq!(last["count"], faults.len(), "{summary}");
    // Its search priced the tiles by what the workers left measured: what their caches kept
    // from the run's first search, nothing timed again.
    let costs = &last["costs"];
    let workers = costs["workers"].as_array().unwrap();
    assert_eq!(workers.len(), left, "{summary}");
    assert!(workers.iter().all(|w| w["new_tiles"] == 0), "{summary}");
    assert!(costs["priced"]["measured"].as_u64() > Some(0), "{summary}");
    let mut lost = 0;
    for recovery in recoveries {
        // Back to training within seconds (a restart that meets a hung worker waits 5 s for it).
        assert!(recovery["seconds"].as_f64().unwrap() < 15.0, "{summary}");
        lost += recovery["steps_lost"].as_u64().unwrap() as usize;
    }
    // Every step is reported once it is trained for good: the steps after the snapshot again.
    let steps_reported = stdout.lines().filter(|l| l.contains("\"step\"")).count();
    assert!(
        steps_reported >= 60 + lost,
        "{steps_reported} step lines, {lost} lost"
    );
    assert_eq!(summary["steps_taken"], 60, "{summary}");

    let single = cluster.path("single.safetensors");
    train_from(&[], &LENET_12, steps, &init, &single);
    assert_same_tensors(&saved, &single);
    summary
}

#[test]
fn a_run_that_loses_a_middle_worker_re_plans_on_the_others_and_trains_what_one_device_trains() {
    let summary = recovers_from(3, &[(1, libc::SIGKILL)]);
    let lost = summary["recoveries"][0]["lost"].as_str().unwrap();
    assert!(lost.starts_with("worker w1 (127.0.0.1:"), "{summary}");
    assert!(lost.contains("stopped responding"), "{summary}");
}

#[test]
fn a_run_whose_worker_hangs_recovers_on_the_others() {
    let summary = recovers_from(3, &[(1, libc::SIGSTOP)]);
    let lost = summary["recoveries"][0]["lost"].as_str().unwrap();
    assert!(lost.starts_with("worker w1 (127.0.0.1:"), "{summary}");
}

#[test]
fn a_worker_lost_while_the_run_recovers_is_recovered_from_too() {
    // w1 dies and w2 hangs at once: the recovery from w1 finds w2 silent while it restarts.
    let summary = recovers_from(4, &[(1, libc::SIGKILL), (2, libc::SIGSTOP)]);
    let lost: Vec<&str> = (summary["recoveries"].as_array().unwrap().iter())
        .map(|r| r["lost"].as_str().unwrap())
        .collect();
    let lost = lost.join("; ");
    assert!(
        lost.contains("worker w1") && lost.contains("worker w2"),
        "{summary}"
    );
}

#[test]
fn a_hung_worker_that_comes_back_is_taken_back_at_a_snapshot() {
    let cluster = Cluster::new(&[1, 1, 1]);
    let pids = cluster.up();
    let saved = cluster.path("rejoined.safetensors");
    let mut args = cluster.train_args(&LENET_12);
    args.extend(["--device", "cpu", "--steps", "600", "--snapshot-every", "5"]);
    args.extend(["--checkpoint-every", "2", "--save", saved.to_str().unwrap()]);
    args.push("--json");
    let mut run = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !saved.exists() {
        assert!(Instant::now() < deadline, "no checkpoint written");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pids[1] as i32, libc::SIGSTOP) };
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(run.stdout.take().unwrap()));
    let mut stdout = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        stdout += &line;
        stdout.push('\n');
        if line.starts_with("{\"recovered\":") {
            break;
        }
    }
    // Back: its old job's driver is gone, so it is free for the run's next probe.
    // SAFETY: as above.
    unsafe { libc::kill(pids[1] as i32, libc::SIGCONT) };
    for line in lines {
        stdout += &line.unwrap();
        stdout.push('\n');
    }
    let status = run.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    let summary = summary_of(&stdout);
    assert_eq!(summary["recoveries"][0]["devices"], 2, "{summary}");
    let rejoined = &summary["rejoins"][0];
    assert_eq!(rejoined["devices"], 3, "{summary}");
    assert!(
        rejoined["workers"][0]
            .as_str()
            .unwrap()
            .starts_with("worker w1 ("),
        "{summary}"
    );
    assert_eq!(summary["devices"], 3, "{summary}");
    assert_eq!(summary["steps_taken"], 600, "{summary}");
}

#[test]
fn down_stops_every_worker_it_reaches_when_a_middle_one_is_gone() {
    let cluster = Cluster::new(&[1, 1, 1]);
    let pids = cluster.up();
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pids[1] as i32, libc::SIGKILL) };
    let out = ok(legion(&cluster.args("down")));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stopped w0, w2"), "{stdout}");
    assert!(
        stdout.contains("not running (no answer): w1 (127.0.0.1:"),
        "{stdout}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while (alive(pids[0]) || alive(pids[2])) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(pids[0]) && !alive(pids[2]),
        "a worker was left running"
    );
}

#[test]
fn commands_without_the_state_directory_up_used_name_it() {
    let cluster = Cluster::new(&[1]);
    cluster.up();
    let hosts = cluster.hosts.to_str().unwrap();
    let given = format!("--state {}", cluster.state.display());
    for command in [vec!["status", hosts], vec!["down", hosts]] {
        let out = legion(&command);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&given), "{stderr}");
    }
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--steps",
        "1",
        "--cluster",
        hosts,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(&given), "{stderr}");
}

#[test]
fn train_names_a_cluster_that_is_not_up() {
    let cluster = Cluster::new(&[1, 1]);
    // Certificates exist, workers do not.
    let out = legion(&cluster.args("up"));
    assert!(out.status.success());
    ok(legion(&cluster.args("down")));
    let mut args = cluster.train_args(&LENET);
    args.extend(["--steps", "1"]);
    let out = legion(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("worker w0") && stderr.contains("legion-rs up"),
        "{stderr}"
    );
}

#[test]
fn up_names_a_worker_that_exits_before_registering_and_why() {
    let cluster = Cluster::new(&[1]);
    // Take the worker's port, so it cannot bind.
    let text = std::fs::read_to_string(&cluster.hosts).unwrap();
    let port: u16 = text
        .split("port = ")
        .nth(1)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let _taken = std::net::UdpSocket::bind(("127.0.0.1", port)).unwrap();
    let mut args = cluster.args("up");
    args.extend(["--timeout", "3"]);
    let out = legion(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    // At once, with the worker's own error rather than the registration timeout.
    assert!(
        stderr.contains("worker w0")
            && stderr.contains("exited")
            && stderr.contains("Address already in use"),
        "{stderr}"
    );
}

#[test]
fn a_worker_refuses_a_job_its_devices_cannot_hold_before_allocating() {
    let cluster = Cluster::new(&[1, 1]);
    cluster.up();
    // Activations of ~0.5 TiB per layer and almost no weights: the driver holds little, each
    // worker's share is far past any host's memory.
    let model = cluster.path("wide.json");
    std::fs::write(
        &model,
        r#"{"name": "wide", "layers": [
            {"name": "data", "op": "input", "shape": [64, 64, 4096, 4096]},
            {"name": "act", "op": "relu", "inputs": ["data"]},
            {"name": "pool", "op": "pool2d", "inputs": ["act"], "kind": "avg",
             "kernel": [4096, 4096], "stride": [4096, 4096]},
            {"name": "flat", "op": "flatten", "inputs": ["pool"]},
            {"name": "fc", "op": "dense", "inputs": ["flat"], "out_features": 10},
            {"name": "loss", "op": "softmax_cross_entropy", "inputs": ["fc"]}]}"#,
    )
    .unwrap();
    let mut args = cluster.train_args(&["--model", model.to_str().unwrap()]);
    args.extend(["--batch", "64", "--strategy", "data", "--steps", "1"]);
    let out = legion(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("model 'wide' does not fit in memory")
            && stderr.contains("worker w")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}
