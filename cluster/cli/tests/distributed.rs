//! `legion-rs train --devices N` end to end: real processes and real checkpoint files. Distributed
//! training from a checkpoint saves the same weights as single-device training from it.

mod common;

use common::{ALEXNET_64, assert_same_tensors, legion, ok};
use std::path::Path;

fn train(dir: &Path, init: &Path, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let out = dir.join(format!("{name}.safetensors"));
    let mut args = vec!["train"];
    args.extend(ALEXNET_64);
    args.extend([
        "--steps",
        "3",
        "--init",
        init.to_str().unwrap(),
        "--save",
        out.to_str().unwrap(),
    ]);
    args.extend(extra);
    ok(legion(&args));
    out
}

#[test]
fn four_devices_save_the_weights_one_device_saves() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init.safetensors");
    let mut args = vec!["train"];
    args.extend(ALEXNET_64);
    args.extend(["--steps", "0", "--save", init.to_str().unwrap()]);
    ok(legion(&args));

    // The reference is the CPU trainer, also where a GPU would take a one-device run.
    let single = train(
        dir.path(),
        &init,
        "single",
        &["--devices", "1", "--device", "cpu"],
    );
    for strategy in ["optcnn", "model"] {
        let dist = train(
            dir.path(),
            &init,
            strategy,
            &["--devices", "4", "--strategy", strategy],
        );
        assert_same_tensors(&dist, &single);
    }

    // A strategy file written by the planner runs as given.
    let file = dir.path().join("owt.json");
    let mut args = vec!["plan"];
    args.extend(ALEXNET_64);
    args.extend([
        "--machine",
        "local-cpu:4",
        "--search",
        "owt",
        "--out",
        file.to_str().unwrap(),
    ]);
    ok(legion(&args));
    let trace = dir.path().join("trace.json");
    let dist = train(
        dir.path(),
        &init,
        "owt",
        &[
            "--devices",
            "4",
            "--strategy",
            file.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    assert_same_tensors(&dist, &single);
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for cat in ["compute", "transfer"] {
        assert!(
            events.iter().any(|e| e["cat"] == cat),
            "the trace has no {cat} events"
        );
    }
}

#[test]
fn bad_strategies_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, br#"{"layers": [{"layer": "conv1", "op": "conv2d", "degrees": {"q": 2}, "devices": [0, 1]}]}"#).unwrap();
    for (strategy, needle) in [
        ("nonsense", "neither a search"),
        (bad.to_str().unwrap(), "degrees.q"),
    ] {
        let mut args = vec!["train"];
        args.extend(ALEXNET_64);
        args.extend(["--steps", "1", "--devices", "2", "--strategy", strategy]);
        let out = legion(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "stderr: {err}");
        assert!(
            !err.contains("panicked") && err.contains(needle),
            "stderr lacks '{needle}': {err}"
        );
    }
}

/// Every tensor of two checkpoints, bit for bit (momentum included).
fn assert_identical(a: &Path, b: &Path) {
    let a = legion_ops::checkpoint::load(a).unwrap();
    let b = legion_ops::checkpoint::load(b).unwrap();
    assert_eq!(a.metadata.get("step"), b.metadata.get("step"));
    assert_eq!(a.tensors, b.tensors);
}

#[test]
fn a_resumed_run_ends_where_an_uninterrupted_one_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    for devices in ["1", "2"] {
        let run = |extra: &[&str]| {
            let mut args = vec![
                "train",
                "--model",
                "lenet5",
                "--batch",
                "16",
                "--devices",
                devices,
                "--strategy",
                "data",
            ];
            args.extend(extra);
            ok(legion(&args));
        };
        let straight = path(&format!("straight{devices}.safetensors"));
        run(&["--steps", "6", "--save", &straight]);
        // Stopped after step 3 (a checkpoint every 3 steps), then resumed to step 6.
        let resumed = path(&format!("resumed{devices}.safetensors"));
        run(&[
            "--steps",
            "4",
            "--checkpoint-every",
            "3",
            "--save",
            &resumed,
        ]);
        let at3 = legion_ops::checkpoint::load(Path::new(&resumed)).unwrap();
        assert_eq!(at3.metadata["step"], "4");
        run(&["--steps", "3", "--save", &resumed]);
        run(&["--steps", "6", "--resume", &resumed, "--save", &resumed]);
        assert_identical(Path::new(&straight), Path::new(&resumed));
    }
}
