//! `legion-rs profile` end to end: it writes a database the planner loads and uses, and a bad
//! database is a clean error.

mod common;
use common::stderr;

use legion_planner::ProfileDb;
use std::process::{Command, Output};

fn legion(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .output()
        .expect("legion-rs runs")
}

#[test]
fn profile_feeds_plan() {
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join("lenet5.json");
    let db_file = db_path.to_str().unwrap();
    let out = legion(&[
        "profile",
        "--model",
        "lenet5",
        "--devices",
        "2",
        "--batch",
        "16",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--out",
        db_file,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("tile entries measured"), "{stdout}");

    let db = ProfileDb::load(&db_path).unwrap();
    // Every layer of lenet5 (conv, pool, dense, loss, ...) has at least one measured tile.
    let ops: std::collections::BTreeSet<&str> = db.entries.iter().map(|e| e.op.as_str()).collect();
    for op in [
        "input",
        "conv2d",
        "pool2d",
        "dense",
        "softmax_cross_entropy",
    ] {
        assert!(ops.contains(op), "no {op} entry in {ops:?}");
    }
    assert!(db.entries.iter().all(|e| e.device_kind == "cpu"));
    assert!(
        db.entries
            .iter()
            .any(|e| e.forward_s > 0.0 && e.backward_s > 0.0),
        "kernels take time"
    );
    let runtime = db.runtime.expect("the runtime's costs were measured");
    // The runtime's CPU per op: what the process spent besides the kernels and copies it timed,
    // a few to tens of µs per op, never negative.
    assert!((0.0..1e-3).contains(&runtime.runtime_cpu_s), "{runtime:?}");
    let links = db.links.expect("two devices exchange tensors");
    assert!(links.bytes_per_s > 0.0 && links.samples > 0, "{links:?}");
    assert!(
        !dir.path().join("lenet5.json.tmp").exists(),
        "the temporary file was renamed"
    );

    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--batch",
        "16",
        "--machine",
        "local-cpu:2",
        "--profile",
        db_file,
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let measured: u64 = err
        .lines()
        .find_map(|l| {
            l.strip_prefix("profile: ")?
                .split(" tile(s) measured")
                .next()
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no tile count in: {err}"));
    assert!(measured > 0, "{err}");
    assert!(err.contains("every link priced as measured"), "{err}");
}

#[test]
fn corrupt_profile_is_a_located_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.json");
    std::fs::write(&path, "{\"version\": 1, \"entries\": [{\"op\": ").unwrap();
    let file = path.to_str().unwrap();
    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--batch",
        "16",
        "--machine",
        "local-cpu:2",
        "--profile",
        file,
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error:") && err.contains(file), "{err}");
}

#[test]
fn bad_profile_arguments_name_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("p.json");
    let out_file = out_file.to_str().unwrap();
    for (args, needle) in [
        (vec!["--devices", "0"], "--devices"),
        (
            vec!["--devices", "2", "--strategies", "nope"],
            "--strategies",
        ),
        (vec!["--devices", "2", "--repeats", "0"], "--repeats"),
    ] {
        let mut all = vec![
            "profile", "--model", "lenet5", "--batch", "8", "--out", out_file,
        ];
        all.extend(args);
        let out = legion(&all);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{all:?}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{err}");
    }
    let out = legion(&[
        "profile",
        "--model",
        "lenet5",
        "--devices",
        "2",
        "--out",
        "/nonexistent-dir/p.json",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--strategies",
        "data",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent-dir/p.json"), "{err}");
}

/// `space` covers every configuration the searches may give each layer on `--machine`, so that a
/// plan there is priced from the profile alone; `--merge` keeps several models in one file.
#[test]
fn a_profile_of_the_space_prices_every_strategy_and_merges_models() {
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join("space.json");
    let db_file = db_path.to_str().unwrap();
    let profile = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "profile",
            "--model",
            model,
            "--machine",
            "local-cpu:2",
            "--batch",
            "8",
            "--strategies",
            "space",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--out",
            db_file,
        ];
        args.extend(extra);
        legion(&args)
    };
    let out = profile("lenet5", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lenet = ProfileDb::load(&db_path).unwrap().entries.len();
    // Every strategy the planner finds for that machine is priced from measured tiles only,
    // reduction splits' partials included.
    for search in ["optcnn", "data", "model", "owt"] {
        let out = legion(&[
            "plan",
            "--model",
            "lenet5",
            "--batch",
            "8",
            "--machine",
            "local-cpu:2",
            "--search",
            search,
            "--profile",
            db_file,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(
                " 0 scaled from a measured tile of their op, 0 priced by the roofline model"
            ),
            "{search}: {}",
            stderr(&out)
        );
    }
    let out = profile("alexnet", &["--image-size", "64", "--merge"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = ProfileDb::load(&db_path).unwrap();
    // AlexNet's conv1 (11×11) beside LeNet-5's tiles.
    let conv1 = merged
        .entries
        .iter()
        .any(|e| e.op == "conv2d" && e.attrs["kernel"] == serde_json::json!([11, 11]));
    assert!(
        conv1 && merged.entries.len() > lenet,
        "{} entries",
        merged.entries.len()
    );

    let out = profile("lenet5", &["--devices", "3"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--devices 3 but --machine local-cpu:2 has 2 devices"));
    let out = profile("lenet5", &["--tiles-only"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--tiles-only: on the CPU"),
        "{}",
        stderr(&out)
    );
}
