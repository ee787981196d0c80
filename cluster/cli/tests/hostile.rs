//! Hostile and out-of-range inputs given to the `legion-rs` binary: each must exit with status 1 and
//! a message saying what is wrong, never panic, abort or wrap around silently.

mod common;

use common::{assert_clean_failure, legion};
use std::path::{Path, PathBuf};

/// A model file of a dense classifier over an input of `shape`, with `hidden` features in the
/// hidden layer.
fn dense_model(dir: &Path, shape: &str, hidden: u64) -> PathBuf {
    let text = format!(
        r#"{{"name": "hostile", "layers": [
            {{"name": "data", "op": "input", "shape": {shape}}},
            {{"name": "flat", "op": "flatten", "inputs": ["data"]}},
            {{"name": "wide", "op": "dense", "inputs": ["flat"], "out_features": {hidden}}},
            {{"name": "fc", "op": "dense", "inputs": ["wide"], "out_features": 10}},
            {{"name": "loss", "op": "softmax_cross_entropy", "inputs": ["fc"]}}
        ]}}"#
    );
    let path = dir.join("model.json");
    std::fs::write(&path, text).unwrap();
    path
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn a_zero_batch_is_refused_by_every_command_that_takes_one() {
    let plan = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--batch",
        "0",
        "--machine",
        "paper",
    ]);
    assert_clean_failure(&plan, &["--batch must be at least 1"]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("p.json");
    let profile = legion(&[
        "profile",
        "--model",
        "lenet5",
        "--batch",
        "0",
        "--devices",
        "2",
        "--out",
        s(&db),
    ]);
    assert_clean_failure(&profile, &["--batch must be at least 1"]);
    let train = legion(&["train", "--model", "lenet5", "--batch", "0"]);
    assert_clean_failure(&train, &["--batch must be at least 1"]);
}

#[test]
fn a_model_too_large_for_memory_is_refused_before_it_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    // 2·10^9 × 192 weights: 1.4 TiB with gradients and momentum, within the element bound
    let model = dense_model(dir.path(), "[8, 3, 8, 8]", 2_000_000_000);
    for devices in ["1", "2"] {
        let out = legion(&[
            "train",
            "--model",
            s(&model),
            "--devices",
            devices,
            "--steps",
            "1",
        ]);
        assert_clean_failure(
            &out,
            &[
                "model 'hostile' does not fit in memory",
                "layer 'wide' (dense) alone needs",
                "available",
            ],
        );
    }
    let db = dir.path().join("p.json");
    let profile = legion(&[
        "profile",
        "--model",
        s(&model),
        "--devices",
        "2",
        "--out",
        s(&db),
    ]);
    assert_clean_failure(&profile, &["model 'hostile' does not fit in memory"]);
    // The planner's searches return only strategies that fit a P100's 16 GiB, and none does.
    let plan = legion(&["plan", "--model", s(&model), "--machine", "paper:2"]);
    assert_clean_failure(
        &plan,
        &[
            "optcnn found no strategy that fits the devices' memory; the closest: device",
            "of its 16.00 GiB (layer 'wide' alone",
        ],
    );
}

#[test]
fn shapes_whose_element_counts_overflow_are_model_errors_naming_the_layer() {
    let dir = tempfile::tempdir().unwrap();
    // 8 · 2^32 · 2^32 · 2^32 wraps to 0 in 64 bits
    let huge = 1u64 << 32;
    let model = dense_model(dir.path(), &format!("[8, {huge}, {huge}, {huge}]"), 16);
    let plan = legion(&["plan", "--model", s(&model), "--machine", "paper"]);
    assert_clean_failure(&plan, &["input 'data'", "has more than 2^40 elements"]);

    let model = dense_model(dir.path(), "[8, 3, 1000000000, 1000000000]", 16);
    let train = legion(&["train", "--model", s(&model), "--steps", "0"]);
    assert_clean_failure(&train, &["input 'data'", "has more than 2^40 elements"]);

    let batch = (1u64 << 62).to_string();
    let plan = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--batch",
        &batch,
        "--machine",
        "paper",
    ]);
    assert_clean_failure(&plan, &["input 'data'", "has more than 2^40 elements"]);

    // H = W = 10^8: 8·3·10^16 elements, past the bound rather than priced
    let plan = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--batch",
        "8",
        "--image-size",
        "100000000",
        "--machine",
        "paper",
    ]);
    assert_clean_failure(&plan, &["has more than 2^40 elements"]);
}

#[test]
fn strategy_degrees_out_of_range_are_refused_with_the_value_given() {
    let dir = tempfile::tempdir().unwrap();
    let model = dense_model(dir.path(), "[8, 3, 8, 8]", 16);
    let strategy = |wide: &str, devices: &str| {
        let text = format!(
            r#"{{"layers": [
                {{"layer": "data", "op": "input", "degrees": {{}}, "devices": [0]}},
                {{"layer": "flat", "op": "flatten", "degrees": {{}}, "devices": [0]}},
                {{"layer": "wide", "op": "dense", "degrees": {wide}, "devices": {devices}}},
                {{"layer": "fc", "op": "dense", "degrees": {{}}, "devices": [0]}},
                {{"layer": "loss", "op": "softmax_cross_entropy", "degrees": {{}}, "devices": [0]}}
            ]}}"#
        );
        let path = dir.path().join("strategy.json");
        std::fs::write(&path, text).unwrap();
        path
    };
    let evaluate = |path: &Path| {
        legion(&[
            "plan",
            "--model",
            s(&model),
            "--machine",
            "paper:2",
            "--evaluate",
            "--strategy",
            s(path),
        ])
    };
    let train = |path: &Path| {
        legion(&[
            "train",
            "--model",
            s(&model),
            "--devices",
            "2",
            "--steps",
            "0",
            "--strategy",
            s(path),
        ])
    };

    let big = strategy(r#"{"n": 1099511627776}"#, "[0]");
    for out in [evaluate(&big), train(&big)] {
        assert_clean_failure(
            &out,
            &[
                "layer 'wide': degrees.n: degree 1099511627776 of dim n needs more than the \
                 machine's 2 devices",
            ],
        );
    }
    // 2^63 + 1 in both: their product wraps to 1 in 64 bits, and in 32 bits each is 1
    let odd = strategy(
        r#"{"n": 9223372036854775809, "c": 9223372036854775809}"#,
        "[0]",
    );
    for out in [evaluate(&odd), train(&odd)] {
        assert_clean_failure(
            &out,
            &["layer 'wide': degrees.c: degree 9223372036854775809 of dim c is not a power of two"],
        );
    }
    let far = strategy(r#"{"n": 2}"#, "[4294967296, 4294967297]");
    assert_clean_failure(
        &evaluate(&far),
        &["layer 'wide': devices: device 4294967296 does not exist"],
    );
}

#[test]
fn machines_past_the_device_limit_are_refused_before_allocating() {
    let out = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--nodes",
        "1099511627776",
        "--devices-per-node",
        "1099511627776",
    ]);
    assert_clean_failure(&out, &["a machine has at most 4096 devices"]);
    let out = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--machine",
        "local-cpu:1000000000000",
    ]);
    assert_clean_failure(&out, &["a machine has at most 4096 devices"]);
}
