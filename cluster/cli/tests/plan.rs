//! End-to-end tests of `legion-rs plan`: real processes, real files.

mod common;

use common::{legion, ok};
use serde_json::Value;
use std::process::Output;

/// What `--search all` runs, in order: our space's searches, then the other papers' planners.
const ALL_SEARCHES: [&str; 10] = [
    "optcnn",
    "refine",
    "exhaustive",
    "data",
    "model",
    "owt",
    "soybean",
    "tofu",
    "hypar",
    "spartan",
];

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON document")
}

/// The command failed cleanly: exit code 1, an `error:` line containing `needle`, no panic.
fn assert_clean_failure(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(
        err.contains("error:") && err.contains(needle),
        "stderr lacks '{needle}': {err}"
    );
}

#[test]
fn all_searches_side_by_side() {
    let doc = json(&legion(&[
        "plan",
        "--model",
        "alexnet",
        "--machine",
        "paper:4",
        "--search",
        "all",
        "--refine-budget",
        "100",
        "--json",
    ]));
    assert_eq!(doc["model"], "alexnet");
    assert_eq!(doc["devices"], 4);
    // no profile: compute is priced by the roofline model, and the output says so
    assert_eq!(doc["t_c"], "roofline");
    let text = legion(&["plan", "--model", "lenet5", "--machine", "paper:2"]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("t_c: the roofline model"), "{text}");
    let searches = doc["searches"].as_array().unwrap();
    let names: Vec<&str> = searches
        .iter()
        .map(|s| s["search"].as_str().unwrap())
        .collect();
    assert_eq!(names, ALL_SEARCHES);
    let eq1 = |i: usize| searches[i]["eq1_ms"].as_f64().unwrap();
    // optcnn is optimal under Eq. 1 in our space: no other search beats it, refine included.
    for i in 1..searches.len() {
        assert!(
            eq1(0) <= eq1(i) * (1.0 + 1e-12),
            "optcnn {} vs {}",
            eq1(0),
            eq1(i)
        );
    }
    for s in searches {
        assert_eq!(
            s["strategy"].as_array().unwrap().len(),
            16,
            "{}",
            s["search"]
        );
        assert!(s["simulated_ms"].as_f64().unwrap() > 0.0);
        assert!(s["comm_bytes"].as_u64().is_some());
    }
    // refine is never slower in simulation than optcnn or a baseline, and says where it started
    let simulated = |i: usize| searches[i]["simulated_ms"].as_f64().unwrap();
    for name in ["optcnn", "data", "model", "owt"] {
        let i = names.iter().position(|n| *n == name).unwrap();
        assert!(simulated(1) <= simulated(i), "refine vs {name}");
    }
    let refine = &searches[1]["refine"];
    assert_eq!(refine["budget"], 100);
    assert_eq!(refine["simulated_ms"].as_f64().unwrap(), simulated(1));
    assert!(searches[0].get("refine").is_none());
}

/// `--search refine` prints where it started, its simulations, budget and seed under the summary
/// and in the JSON document; a seed gives the same strategy every time.
#[test]
fn refine_reports_its_start_budget_and_seed() {
    let args = [
        "plan",
        "--model",
        "alexnet",
        "--image-size",
        "64",
        "--nodes",
        "2",
        "--devices-per-node",
        "2",
        "--inter-gbps",
        "25",
        "--search",
        "refine",
        "--refine-budget",
        "60",
        "--refine-seed",
        "7",
    ];
    let doc = json(&legion(&[&args[..], &["--json"]].concat()));
    let search = &doc["searches"][0];
    assert_eq!(search["search"], "refine");
    let refine = &search["refine"];
    assert_eq!(
        (&refine["budget"], &refine["seed"]),
        (&60.into(), &7.into())
    );
    let simulations = refine["simulations"].as_u64().unwrap();
    assert!((4..=60).contains(&simulations), "{refine}");
    assert!(["optcnn", "data", "model", "owt"].contains(&refine["start"].as_str().unwrap()));
    let simulated = search["simulated_ms"].as_f64().unwrap();
    assert_eq!(refine["simulated_ms"].as_f64().unwrap(), simulated);
    assert!(simulated <= refine["start_simulated_ms"].as_f64().unwrap());
    let again = json(&legion(&[&args[..], &["--json"]].concat()));
    assert_eq!(again["searches"][0]["strategy"], search["strategy"]);

    let out = legion(&args);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("refine: from ")
            && text.contains(" of 60 simulations")
            && text.contains("seed 7"),
        "{text}"
    );
}

/// Side by side on a model too large to enumerate, the exhaustive search stops at its small
/// default budget and says so, and the other searches still report (model parallelism that it
/// does not fit the devices).
#[test]
fn all_searches_stop_the_exhaustive_one_early_and_say_so() {
    let args = [
        "plan",
        "--model",
        "inception_v3",
        "--machine",
        "paper",
        "--search",
        "all",
        "--refine-budget",
        "10",
    ];
    let doc = json(&legion(&[&args[..], &["--json"]].concat()));
    let searches = doc["searches"].as_array().unwrap();
    let names: Vec<&str> = searches
        .iter()
        .map(|s| s["search"].as_str().unwrap())
        .collect();
    assert_eq!(names, ALL_SEARCHES);
    let error = searches[2]["error"].as_str().unwrap();
    assert!(
        error.contains("stopped") && error.contains("budget of 100000"),
        "{error}"
    );
    for (i, search) in searches.iter().enumerate().filter(|&(i, _)| i != 2) {
        if names[i] == "model" {
            // every device receives each layer's whole input: more than a P100's 16 GiB
            let error = search["error"].as_str().unwrap();
            assert!(
                error.contains("does not fit the devices' memory"),
                "{error}"
            );
        } else {
            assert!(search["eq1_ms"].as_f64().unwrap() > 0.0, "{search}");
        }
    }

    let out = legion(&args);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("exhaustive stopped at 100000 partial strategies"),
        "{text}"
    );
}

#[test]
fn saved_strategy_evaluates_to_the_same_cost_and_traces() {
    let dir = tempfile::tempdir().unwrap();
    let strategy = dir.path().join("vgg.json");
    let trace = dir.path().join("trace.json");
    let s = strategy.to_str().unwrap();
    let t = trace.to_str().unwrap();
    let searched = json(&legion(&[
        "plan",
        "--model",
        "vgg16",
        "--image-size",
        "64",
        "--nodes",
        "2",
        "--devices-per-node",
        "2",
        "--inter-gbps",
        "25",
        "--json",
        "--out",
        s,
        "--trace",
        t,
    ]));
    let evaluated = json(&legion(&[
        "plan",
        "--model",
        "vgg16",
        "--image-size",
        "64",
        "--nodes",
        "2",
        "--devices-per-node",
        "2",
        "--inter-gbps",
        "25",
        "--json",
        "--strategy",
        s,
        "--evaluate",
    ]));
    let cost = |d: &Value| d["searches"][0]["eq1_ms"].as_f64().unwrap();
    assert!((cost(&searched) - cost(&evaluated)).abs() <= 1e-9 * cost(&searched));
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "X" && e["cat"] == "forward")
    );

    let human = legion(&[
        "plan",
        "--model",
        "vgg16",
        "--image-size",
        "64",
        "--machine",
        "paper:4",
        "--strategy",
        s,
        "--evaluate",
    ]);
    assert!(human.status.success());
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("conv1_1") && text.contains("t_c ms"),
        "{text}"
    );
}

#[test]
fn bad_inputs_fail_with_located_errors() {
    let dir = tempfile::tempdir().unwrap();
    let machine = dir.path().join("m.toml");
    std::fs::write(&machine, "nodes = 2\ndevices_per_node = 0\n[device]\nkind = \"x\"\npeak_gflops = 1\nmemory_gb_per_s = 1\n[intra_node]\ngbit_per_s = 1\n").unwrap();
    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--machine",
        machine.to_str().unwrap(),
    ]);
    assert_clean_failure(&out, "m.toml:2:20: devices_per_node: must be at least 1");

    let strategy = dir.path().join("s.json");
    std::fs::write(
        &strategy,
        r#"{"layers":[{"layer":"conv1","op":"conv2d","degrees":{"n":3},"devices":[0,1,2]}]}"#,
    )
    .unwrap();
    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--machine",
        "paper:4",
        "--strategy",
        strategy.to_str().unwrap(),
        "--evaluate",
    ]);
    assert_clean_failure(
        &out,
        "layer 'conv1': degrees.n: degree 3 of dim n is not a power of two",
    );

    let out = legion(&["plan", "--model", "nonet", "--machine", "paper:2"]);
    assert_clean_failure(&out, "neither a zoo model");

    let out = legion(&[
        "plan",
        "--model",
        "alexnet",
        "--machine",
        "paper",
        "--search",
        "exhaustive",
        "--budget",
        "10",
    ]);
    assert_clean_failure(&out, "exceeded its budget of 10");
}

#[test]
fn a_strategy_with_reduction_splits_is_priced_and_simulated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.json");
    let s = path.to_str().unwrap();
    ok(legion(&[
        "plan",
        "--model",
        "lenet5",
        "--machine",
        "paper:4",
        "--search",
        "model",
        "--out",
        s,
    ]));
    let mut strategy: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let fc4 = strategy["layers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|l| l["layer"] == "fc4")
        .unwrap();
    // fc4's output channels over 2 blocks, each summed from 2 partials over its input features
    fc4["degrees"] = serde_json::json!({"n": 1, "c": 2, "red": 2});
    std::fs::write(&path, strategy.to_string()).unwrap();
    let evaluate = |json: bool| {
        let mut args = vec!["plan", "--model", "lenet5", "--machine", "paper:4"];
        args.extend(["--strategy", s, "--evaluate"]);
        if json {
            args.push("--json");
        }
        legion(&args)
    };
    let human = ok(evaluate(false));
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("c=2,red=2") && text.contains("Σ t_r"),
        "{text}"
    );
    let doc = json(&evaluate(true));
    let search = &doc["searches"][0];
    assert!(search["simulated_ms"].as_f64().unwrap() > 0.0, "{doc}");
    assert!(search["eq1_ms"].as_f64().unwrap() > 0.0, "{doc}");
}

/// `--sync-sim` picks how the step simulates parameter synchronisation: Eq. 1 is the same either
/// way, the collective step is within 3% of the per-message one on `paper-pairs` (on `paper`'s
/// one NIC a node it is not: `RELAYED_NIC_TOLERANCE`, `planner/tests/sync_simulation.rs`),
/// `auto` is per message at 16 devices, and an unknown name is refused with the names it takes.
#[test]
fn sync_sim_picks_the_simulation_and_refuses_unknown_names() {
    let plan = |sim: &str| {
        let doc = json(&legion(&[
            "plan",
            "--model",
            "alexnet",
            "--machine",
            "paper-pairs:16",
            "--search",
            "data",
            "--json",
            "--sync-sim",
            sim,
        ]));
        let search = &doc["searches"][0];
        (
            search["eq1_ms"].as_f64().unwrap(),
            search["simulated_ms"].as_f64().unwrap(),
        )
    };
    let (eq1, per_message) = plan("per-message");
    let (collective_eq1, collective) = plan("collective");
    let (auto_eq1, auto) = plan("auto");
    assert_eq!(eq1.to_bits(), collective_eq1.to_bits());
    assert_eq!(eq1.to_bits(), auto_eq1.to_bits());
    assert_eq!(
        auto.to_bits(),
        per_message.to_bits(),
        "16 devices: per message"
    );
    assert!(
        (collective - per_message).abs() <= 0.03 * per_message,
        "{collective} vs {per_message}"
    );

    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--machine",
        "paper:2",
        "--sync-sim",
        "ring",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(
        err.contains(
            "unknown sync simulation `ring`; expected one of: per-message, collective, auto"
        ),
        "{err}"
    );
}

/// A search past the progress delay (set to nothing here) says what it is doing on stderr, never
/// on stdout: `--json` stays one document. A DenseNet's search reports how close to the optimum
/// its strategy is, and the text report says so and names the layers solved by local search.
#[test]
fn progress_goes_to_stderr_and_the_bound_to_the_report() {
    let plan = |json: bool| {
        let mut args = vec![
            "plan",
            "--model",
            "densenet121",
            "--image-size",
            "32",
            "--batch",
            "8",
            "--machine",
            "paper:4",
            "--search",
            "optcnn",
        ];
        if json {
            args.push("--json");
        }
        std::process::Command::new(env!("CARGO_BIN_EXE_legion-rs"))
            .args(&args)
            .env("LEGION_RS_PROGRESS_AFTER_MS", "0")
            .output()
            .expect("legion-rs runs")
    };
    let out = plan(true);
    let doc = json(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pricing every layer's configs") && err.contains("optcnn: eliminating"),
        "no progress on stderr: {err}"
    );
    let optimality = &doc["searches"][0]["optimality"];
    let (exact, gap) = (optimality["exact"].as_bool(), optimality["gap"].as_f64());
    assert!(
        exact.is_some() && gap.is_some_and(|g| g >= 0.0),
        "{optimality}"
    );
    let text = plan(false);
    assert!(text.status.success());
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.starts_with("densenet121 on paper:4"),
        "the model and machine line first: {stdout}"
    );
    assert!(
        !stdout.contains("eliminating"),
        "progress on stdout: {stdout}"
    );
    if exact == Some(false) {
        assert!(
            stdout.contains("of Eq. 1's optimum") && stdout.contains("features.denseblock"),
            "{stdout}"
        );
    }
}
