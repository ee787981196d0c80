//! `--precision fp32|tf32|bf16` through the binary: bf16 training on the CPU and resuming across
//! precisions, refusals before any work (bf16 in `profile`, names that are no precision,
//! `--tf32` beside `--precision`), and `plan --precision bf16`
//! pricing half the activation bytes of fp32 with the same parameter-sync bytes.

mod common;
use common::stderr;

use common::{assert_clean_failure, legion, ok};
use serde_json::Value;
use std::process::Output;

const LENET: [&str; 6] = ["--model", "lenet5", "--batch", "8", "--steps", "1"];

/// A clap usage error: exit 2, no panic, and every needle in stderr.
fn assert_usage_error(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks '{needle}': {err}");
    }
}

/// The last line of a `--json` run: its summary.
fn summary(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().expect("a summary line")).unwrap()
}

/// bf16 on the CPU is the CPU backend's bf16 arithmetic, on one device and on several (the
/// runtime's bf16 slices), reported as such; its checkpoint holds the fp32 masters, so an fp32
/// run resumes from it, and a bf16 run from an fp32 one.
#[test]
fn bf16_trains_on_the_cpu_on_one_and_several_devices_and_resumes_across_precisions() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("w.safetensors");
    let save = save.to_str().unwrap();
    let train = |steps: &str, devices: &str, precision: &str, extra: &[&str]| {
        let mut args = vec![
            "train", "--model", "lenet5", "--batch", "8", "--steps", steps,
        ];
        args.extend([
            "--devices",
            devices,
            "--device",
            "cpu",
            "--precision",
            precision,
        ]);
        args.extend(["--json", "--save", save]);
        args.extend(extra);
        summary(&ok(legion(&args)))
    };
    for devices in ["1", "2"] {
        let s = train("2", devices, "bf16", &[]);
        assert_eq!(s["precision"], "bf16", "{s}");
        assert_eq!(s["steps"], 2, "{s}");
        assert!(s["final_loss"].as_f64().unwrap().is_finite(), "{s}");
        // fp32 goes on from the bf16 checkpoint, and bf16 from that fp32 one
        let s = train("3", devices, "fp32", &["--resume", save]);
        assert_eq!(
            (s["precision"].as_str(), s["first_step"].as_u64()),
            (Some("fp32"), Some(2))
        );
        let s = train("4", devices, "bf16", &["--resume", save]);
        assert_eq!(
            (s["precision"].as_str(), s["first_step"].as_u64()),
            (Some("bf16"), Some(3))
        );
    }
}

/// Where bf16 cannot run as asked it is refused before any work, naming the flag: `profile`
/// (and `--compare`) time fp32 tiles.
#[test]
fn bf16_profile_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = legion(&[
        "profile",
        "--model",
        "lenet5",
        "--batch",
        "8",
        "--devices",
        "1",
        "--device",
        "cpu",
        "--precision",
        "bf16",
        "--out",
        dir.path().join("p.json").to_str().unwrap(),
    ]);
    assert_clean_failure(
        &out,
        &["--precision bf16: profile times the runtime's tasks in fp32"],
    );
    assert!(!dir.path().join("p.json").exists());
}

#[test]
fn unknown_precisions_and_tf32_beside_precision_are_usage_errors() {
    for command in ["train", "profile", "plan"] {
        let mut args = vec![command, "--model", "lenet5", "--precision", "fp16"];
        args.extend(match command {
            "train" => &["--steps", "1"][..],
            "profile" => &["--devices", "1", "--out", "/tmp/never-written.json"][..],
            _ => &["--machine", "local-cpu:2"][..],
        });
        assert_usage_error(
            &legion(&args),
            &["'fp16'", "--precision", "expected one of fp32, tf32, bf16"],
        );
    }
    let mut args = vec!["train"];
    args.extend(LENET);
    args.extend(["--tf32", "--precision", "bf16"]);
    assert_usage_error(&legion(&args), &["--tf32", "--precision"]);
}

/// `--tf32` and `--precision tf32` are the same run on the CPU: fp32 products, said in the
/// device line.
#[test]
fn tf32_on_the_cpu_runs_and_says_it_applies_to_gpus() {
    for flags in [&["--tf32"][..], &["--precision", "tf32"][..]] {
        let mut args = vec!["train"];
        args.extend(LENET);
        args.extend(["--device", "cpu"]);
        args.extend(flags);
        let out = ok(legion(&args));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("--precision tf32 applies to GPUs only"),
            "{text}"
        );
    }
}

fn plan_json(model: &str, machine: &str, search: &str, precision: &str) -> Value {
    let out = ok(legion(&[
        "plan",
        "--model",
        model,
        "--machine",
        machine,
        "--search",
        search,
        "--precision",
        precision,
        "--json",
    ]));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `plan --precision bf16` moves half the activation bytes of fp32 under the same strategy and
/// the same parameter-sync bytes, and reports both parts.
#[test]
fn plan_in_bf16_moves_half_the_activation_bytes() {
    for (model, search) in [("alexnet", "owt"), ("lenet5", "model"), ("alexnet", "data")] {
        let fp32 = plan_json(model, "paper:4", search, "fp32");
        let bf16 = plan_json(model, "paper:4", search, "bf16");
        assert_eq!(fp32["precision"], "fp32");
        assert_eq!(bf16["precision"], "bf16");
        let (a, b) = (&fp32["searches"][0], &bf16["searches"][0]);
        assert_eq!(a["strategy"], b["strategy"], "{model} {search}");
        let bytes = |s: &Value, key: &str| s[key].as_u64().unwrap();
        assert_eq!(
            bytes(a, "activation_bytes"),
            2 * bytes(b, "activation_bytes"),
            "{model} {search}"
        );
        assert_eq!(
            bytes(a, "sync_bytes"),
            bytes(b, "sync_bytes"),
            "{model} {search}"
        );
        for s in [a, b] {
            assert_eq!(
                bytes(s, "comm_bytes"),
                bytes(s, "activation_bytes") + bytes(s, "sync_bytes")
            );
        }
        assert_eq!(search == "data", bytes(a, "activation_bytes") == 0);
        // smaller activations: less memory on the fullest device
        assert!(bytes(b, "peak_device_bytes") < bytes(a, "peak_device_bytes"));
    }
}
