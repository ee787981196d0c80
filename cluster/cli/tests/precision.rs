//! `--precision fp32|tf32|bf16` through the binary: refusals before any work (bf16 on the CPU,
//! names that are no precision, `--tf32` beside `--precision`), and `plan --precision bf16`
//! pricing half the activation bytes of fp32 with the same parameter-sync bytes.

mod common;

use common::{assert_clean_failure, legion, ok};
use serde_json::Value;
use std::process::Output;

const LENET: [&str; 6] = ["--model", "lenet5", "--batch", "8", "--steps", "1"];

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A clap usage error: exit 2, no panic, and every needle in stderr.
fn assert_usage_error(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks '{needle}': {err}");
    }
}

#[test]
fn bf16_on_the_cpu_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("w.safetensors");
    let mut args = vec!["train"];
    args.extend(LENET);
    args.extend(["--device", "cpu", "--precision", "bf16", "--save"]);
    args.push(save.to_str().unwrap());
    let out = legion(&args);
    assert_clean_failure(
        &out,
        &[
            "--precision bf16 needs a GPU device",
            "the CPU backend computes in fp32",
        ],
    );
    // refused before any work: no step ran, nothing was saved
    assert!(!String::from_utf8_lossy(&out.stdout).contains("step"));
    assert!(!save.exists());
    // on several embedded devices too
    let mut args = vec!["train"];
    args.extend(LENET);
    args.extend(["--devices", "2", "--device", "cpu", "--precision", "bf16"]);
    assert_clean_failure(&legion(&args), &["--precision bf16 needs a GPU device"]);
    // `auto` on two devices picks the CPU here, or GPUs, on which bf16 trains one device only so
    // far: refused either way (one GPU in bf16 is `gpu_training.rs`'s and gpu-check's to run)
    let mut args = vec!["train"];
    args.extend(LENET);
    args.extend(["--devices", "2", "--precision", "bf16"]);
    assert_clean_failure(&legion(&args), &["--precision bf16"]);
    // and profile
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
    assert_clean_failure(&out, &["--precision bf16 needs a GPU device"]);
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
