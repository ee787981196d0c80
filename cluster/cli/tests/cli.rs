//! End-to-end tests of the `legion-rs` binary: real processes, real files.

mod common;

use common::{ALEXNET_64, assert_clean_failure, legion, ok};
use serde_json::Value;
use std::path::Path;
use std::process::Output;

fn stdout_json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect()
}

#[test]
fn models_json_lists_exact_parameter_counts() {
    let out = legion(&["models", "--json"]);
    assert!(out.status.success());
    let counts: Vec<(String, u64)> = stdout_json_lines(&out)
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["params"].as_u64().unwrap(),
            )
        })
        .collect();
    for (name, params) in [
        ("alexnet", 61_100_840),
        ("vgg16", 138_357_544),
        ("resnet50", 25_557_032),
        ("inception_v3", 23_834_568),
    ] {
        assert!(
            counts.contains(&(name.to_string(), params)),
            "{name} should have {params} params: {counts:?}"
        );
    }
}

#[test]
fn lenet5_learns_the_synthetic_task() {
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--devices",
        "1",
        "--steps",
        "60",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = stdout_json_lines(&out);
    let losses: Vec<f64> = lines
        .iter()
        .filter(|l| l.get("step").is_some())
        .map(|l| l["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 60);
    let first: f64 = losses[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = losses[50..].iter().sum::<f64>() / 10.0;
    assert!(last < 0.7 * first, "loss {first} -> {last}: not learning");
    assert_eq!(lines.last().unwrap()["summary"], true);
    // The one-device trainer reports how its thread spent each step.
    let first_step = lines.iter().find(|l| l.get("step").is_some()).unwrap();
    for key in ["enqueue_ms", "stage_ms", "wait_ms"] {
        assert!(
            first_step[key].as_f64().is_some_and(|ms| ms >= 0.0),
            "{key} in {first_step}"
        );
    }
}

/// `--synthetic-on-host` parses, and the summary says where the batches were drawn.
#[test]
fn the_summary_says_where_synthetic_batches_were_drawn() {
    // Only one GPU draws them itself: on the CPU they are drawn on the host, flag or not, and
    // the run is the same.
    let summaries = cpu_summaries_without_and_with("--synthetic-on-host", 2);
    for summary in &summaries {
        assert_eq!(summary["synthetic_on_device"], false, "{summary}");
    }
    assert_eq!(summaries[0]["final_loss"], summaries[1]["final_loss"]);
}

/// The summaries of LeNet-5 trained `steps` steps on the CPU without and then with `flag` (each
/// run must succeed).
fn cpu_summaries_without_and_with(flag: &str, steps: usize) -> Vec<Value> {
    let steps = steps.to_string();
    [&[][..], &[flag][..]]
        .into_iter()
        .map(|flags| {
            let mut args = vec![
                "train", "--model", "lenet5", "--device", "cpu", "--steps", &steps, "--json",
            ];
            args.extend_from_slice(flags);
            stdout_json_lines(&ok(legion(&args))).pop().unwrap()
        })
        .collect()
}

/// A switch given a value (`--flag=yes`) is refused, and the error names it.
fn refuses_a_value(flag: &str) {
    let out = legion(&["train", &format!("{flag}=yes")]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(flag),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--sync-every-step` reads each step's loss at its end instead of one step late: the same
/// steps are reported, in order, with the same losses, and the same weights are saved (a
/// checkpoint mid-run included, which reads the step in flight first); the summary says which.
#[test]
fn losses_read_one_step_late_are_reported_as_those_read_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for (flags, late) in [(&[][..], true), (&["--sync-every-step"][..], false)] {
        let saved = dir.path().join(format!("late-{late}.safetensors"));
        let saved_arg = saved.to_str().unwrap().to_string();
        let mut args = vec![
            "train",
            "--model",
            "lenet5",
            "--device",
            "cpu",
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--save",
            &saved_arg,
            "--json",
        ];
        args.extend_from_slice(flags);
        let mut lines = stdout_json_lines(&ok(legion(&args)));
        let summary = lines.pop().unwrap();
        assert_eq!(summary["loss_read_late"], late, "{flags:?}: {summary}");
        let steps: Vec<(u64, f64)> = lines
            .iter()
            .filter(|l| l.get("step").is_some())
            .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
            .collect();
        assert_eq!(
            steps.iter().map(|s| s.0).collect::<Vec<_>>(),
            [1, 2, 3, 4],
            "{flags:?}"
        );
        assert_eq!(summary["final_loss"].as_f64(), Some(steps[3].1));
        runs.push((steps, std::fs::read(&saved).unwrap()));
    }
    assert_eq!(runs[0].0, runs[1].0, "the same losses");
    assert!(runs[0].1 == runs[1].1, "the same weights saved");
    refuses_a_value("--sync-every-step");
}

/// `--no-capture` parses, and the summary says where capture stands: off on the CPU, which
/// runs each kernel as it is called (on a GPU the replayed steps are checked bit for bit against
/// enqueued ones by legion-cuda's `gpu_training`).
#[test]
fn the_summary_says_whether_steps_were_captured() {
    for summary in cpu_summaries_without_and_with("--no-capture", 3) {
        assert_eq!(summary["capture"], "off", "{summary}");
    }
    refuses_a_value("--no-capture");
}

/// `--no-fused-epilogue` parses and, on the CPU (whose convolutions always add their bias and
/// ReLU after the product), trains the same steps; a value after it is refused, naming it. (On a
/// GPU, legion-cuda's `gpu_training` holds the fused convolution to the separate kernel.)
#[test]
fn the_separate_epilogue_flag_parses_and_trains_the_same_network() {
    let summaries = cpu_summaries_without_and_with("--no-fused-epilogue", 2);
    assert_eq!(summaries[0]["final_loss"], summaries[1]["final_loss"]);
    refuses_a_value("--no-fused-epilogue");
}

/// `--save-strategy` writes the strategy a search found, and `--strategy FILE` trains it again:
/// the layers the run printed, and the same loss at every step as the search's run.
#[test]
fn a_saved_strategy_trains_as_the_search_that_found_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    let run = |strategy: &str, save: bool| -> (Vec<Value>, Value) {
        let mut args = vec![
            "train",
            "--model",
            "lenet5",
            "--devices",
            "2",
            "--steps",
            "3",
            "--batch",
            "8",
            "--device",
            "cpu",
            "--json",
            "--strategy",
            strategy,
        ];
        if save {
            args.extend(["--save-strategy", path.to_str().unwrap()]);
        }
        let out = ok(legion(&args));
        let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let losses = lines
            .iter()
            .filter(|l| l.get("step").is_some())
            .map(|l| l["loss"].clone());
        let summary = lines.last().unwrap().clone();
        (losses.collect(), summary["plan"]["layers"].clone())
    };
    let (searched, layers) = run("optcnn", true);
    assert_eq!(searched.len(), 3);
    let saved: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(saved["model"], "lenet5", "{saved}");
    assert_eq!(saved["layers"], layers);
    assert_eq!(run(path.to_str().unwrap(), false).0, searched);
}

/// `--trace` on one device times the trainer's own step: every layer's forward and backward (and
/// the staged batch) on the device's timeline, in the order they were enqueued, without planning
/// a strategy for the runtime.
#[test]
fn a_traced_one_device_step_times_every_layer_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.trace.json");
    let out = ok(legion(&[
        "train",
        "--model",
        "lenet5",
        "--devices",
        "1",
        "--steps",
        "2",
        "--json",
        "--trace",
        path.to_str().unwrap(),
    ]));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"plan\":{"),
        "one device plans no strategy"
    );
    let trace: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let spans: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    let names: Vec<&str> = spans.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names[0], "data.wait");
    let at = |name: &str| {
        names
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("{name} in {names:?}"))
    };
    assert!(at("conv1.fwd") < at("fc3.fwd") && at("fc3.fwd") < at("loss.fwd"));
    assert!(at("loss.bwd") < at("fc3.bwd") && at("fc3.bwd") < at("conv1.bwd"));
    assert!(at("conv1.bwd") < at("conv1.update.0"));
    let starts: Vec<f64> = spans.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
    assert!(spans.iter().all(|e| e["dur"].as_f64().unwrap() >= 0.0));
}

#[test]
fn checkpoint_round_trip_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.safetensors");
    let b = dir.path().join("b.safetensors");
    let common = ["train", "--model", "lenet5", "--batch", "8", "--json"];
    let out = legion(
        &[
            &common[..],
            &["--steps", "3", "--save", a.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = legion(
        &[
            &common[..],
            &[
                "--steps",
                "0",
                "--init",
                a.to_str().unwrap(),
                "--save",
                b.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ta = legion_ops::checkpoint::load(&a).unwrap();
    let tb = legion_ops::checkpoint::load(&b).unwrap();
    assert_eq!(ta.tensors.len(), tb.tensors.len());
    for (x, y) in ta.tensors.iter().zip(&tb.tensors) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.shape, y.shape);
        if x.name.starts_with(legion_ops::train::MOMENTUM_PREFIX) {
            // --init takes the weights only: a fresh run, momentum from zero.
            assert!(y.data.iter().all(|&v| v == 0.0), "{} is not reset", y.name);
            continue;
        }
        let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.data), bits(&y.data), "{} differs", x.name);
    }
}

#[test]
fn corrupt_inputs_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let s = |p: &Path| p.to_str().unwrap().to_string();

    // A valid checkpoint, then truncated and garbled copies of it.
    let good = path("good.safetensors");
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--batch",
        "4",
        "--steps",
        "0",
        "--save",
        &s(&good),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&good).unwrap();
    let truncated = path("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--steps",
        "0",
        "--init",
        &s(&truncated),
    ]);
    assert_clean_failure(&out, &["truncated.safetensors"]);
    let garbage = path("garbage.safetensors");
    std::fs::write(&garbage, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header").unwrap();
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--steps",
        "0",
        "--init",
        &s(&garbage),
    ]);
    assert_clean_failure(&out, &["garbage.safetensors"]);
    // A checkpoint of another model.
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--classes",
        "7",
        "--steps",
        "0",
        "--init",
        &s(&good),
    ]);
    assert_clean_failure(&out, &["fc5.weight"]);

    // A CIFAR-10 file whose length is not a whole number of records.
    let cifar = path("data_batch_1.bin");
    std::fs::write(&cifar, vec![1u8; 3073 * 2 + 100]).unwrap();
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--image-size",
        "32",
        "--steps",
        "1",
        "--data",
        &format!("cifar10:{}", s(&cifar)),
    ]);
    assert_clean_failure(&out, &["data_batch_1.bin"]);

    // Model JSON: broken syntax, unknown op, bad shape, dangling input.
    let cases = [
        ("syntax.json", "{\"name\": \"m\", \"layers\": [", "line 1"),
        (
            "unknown_op.json",
            r#"{"name":"m","layers":[{"name":"data","op":"input","shape":[2,3,8,8]},
               {"name":"x","op":"conv3d","inputs":["data"]}]}"#,
            "layers[1] ('x')",
        ),
        (
            "bad_shape.json",
            r#"{"name":"m","layers":[{"name":"data","op":"input","shape":[2,3,8,8]},
               {"name":"fc","op":"dense","inputs":["data"],"out_features":4}]}"#,
            "dense 'fc': input has 4 dims, expected 2",
        ),
        (
            "dangling.json",
            r#"{"name":"m","layers":[{"name":"data","op":"input","shape":[2,3,8,8]},
               {"name":"r","op":"relu","inputs":["missing"]}]}"#,
            "input 'missing'",
        ),
    ];
    for (name, text, needle) in cases {
        let p = path(name);
        std::fs::write(&p, text).unwrap();
        let out = legion(&["train", "--model", &s(&p), "--steps", "1"]);
        assert_clean_failure(&out, &[needle, name]);
    }
}

/// `--memory-gib`: AlexNet 64×64 on 4 embedded devices, counting every buffer the device actors
/// allocate. Data parallelism keeps most on device 1, which owns a block of the weights (272.91
/// MiB when this was written); optcnn's strategy fits in 0.1 GiB. At 0.1 GiB each, `--strategy
/// data` is refused and optcnn trains; at 0.01 GiB nothing fits. A refusal names the device, what
/// it needs and the layer, and comes before anything is allocated or trained.
#[test]
fn a_memory_limit_refuses_strategies_that_do_not_fit_before_allocating() {
    let run = |memory: &str, strategy: &str| {
        let flags = [
            "--devices",
            "4",
            "--steps",
            "1",
            "--strategy",
            strategy,
            "--memory-gib",
            memory,
            "--json",
        ];
        legion(&[&["train"][..], &ALEXNET_64, &flags].concat())
    };
    let refused = run("0.1", "data");
    assert_clean_failure(
        &refused,
        &[
            "the data strategy does not fit the devices' memory: device 1 needs",
            "of its 102.40 MiB (layer 'fc7' alone",
        ],
    );
    assert!(refused.stdout.is_empty(), "nothing trained");

    let trained = run("0.1", "optcnn");
    assert!(
        trained.status.success(),
        "{}",
        String::from_utf8_lossy(&trained.stderr)
    );
    assert!(!stdout_json_lines(&trained).is_empty());

    let none = run("0.01", "optcnn");
    assert_clean_failure(
        &none,
        &["optcnn found no strategy that fits the devices' memory; the closest: device"],
    );
    assert!(none.stdout.is_empty(), "nothing trained");
}
