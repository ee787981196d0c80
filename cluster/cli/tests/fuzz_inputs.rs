//! Generated and mutated user files through the code paths that read them, in process: model JSON
//! and strategy JSON through `plan`, `plan --evaluate` and `train --steps 0`; hosts files through
//! their parser and the planner's machine; profile files through `plan --profile`.
//!
//! Every case must end in `Ok` or an error message: a panic anywhere (this thread or another) fails
//! the case, an allocation past [`ALLOCATION_LIMIT`] aborts the binary (the allocator refuses it),
//! and so does an abort. Sizes are drawn small, or enormous (2^31 … u64::MAX) where a wrap-around or
//! an unchecked allocation would show; nothing in between, so that a valid model stays small.

use clap::Parser;
use legion_cli::Cli;
use legion_cluster::hosts::Hosts;
use legion_ops::zoo;
use legion_planner::ParallelConfig;
use legion_planner::ProfileDb;
use legion_planner::config::tile_rects;
use legion_planner::profile::LinkProfile;
use legion_planner::provider::PhaseTimes;
use legion_planner::runtime_costs::RuntimeCosts;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The most this test binary may hold allocated at once. A hostile input that makes the code ask
/// for more is refused by the allocator, which aborts the process with the size it asked for.
const ALLOCATION_LIMIT: usize = 2 << 30;

struct Bounded;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the same layout; the counter only decides whether to.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !reserve(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if moved.is_null() {
            if new_size > layout.size() {
                ALLOCATED.fetch_sub(new_size - layout.size(), Ordering::Relaxed);
            }
        } else if new_size < layout.size() {
            ALLOCATED.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        moved
    }
}

/// Set while a refused allocation is reported: the report's own allocations pass.
static REPORTING: AtomicBool = AtomicBool::new(false);

/// Counts `bytes` as allocated unless that passes the limit; a refusal prints where it was asked
/// for, since the abort that follows says only how much.
fn reserve(bytes: usize) -> bool {
    let before = ALLOCATED.fetch_add(bytes, Ordering::Relaxed);
    if before.saturating_add(bytes) > ALLOCATION_LIMIT && !REPORTING.load(Ordering::Relaxed) {
        ALLOCATED.fetch_sub(bytes, Ordering::Relaxed);
        if !REPORTING.swap(true, Ordering::SeqCst) {
            let trace = std::backtrace::Backtrace::force_capture();
            let _ = writeln!(
                std::io::stderr().lock(),
                "refused an allocation of {bytes} bytes past the limit, at:\n{trace}"
            );
        }
        return false;
    }
    true
}

#[global_allocator]
static GLOBAL: Bounded = Bounded;

/// Set by the panic hook: a panic on any thread (an actor, a pool worker) fails the case.
static PANICKED: AtomicBool = AtomicBool::new(false);
/// Where the last panic was and what it said, for the failure message.
static PANIC_AT: Mutex<String> = Mutex::new(String::new());

/// Held by each test for its whole run: the panic flag and the allocation count are the process's,
/// so the tests take turns rather than blame each other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, Ordering::SeqCst);
        if let Ok(mut at) = PANIC_AT.lock() {
            *at = info.to_string();
        }
        default(info);
    }));
}

fn last_panic() -> String {
    PANIC_AT.lock().map(|at| at.clone()).unwrap_or_default()
}

/// Runs the `legion-rs` command line in process: whether the command succeeded, or `Err` if
/// anything panicked.
fn run_cli(args: &[&str]) -> Result<bool, String> {
    let cli = match Cli::try_parse_from(std::iter::once("legion-rs").chain(args.iter().copied())) {
        Ok(cli) => cli,
        // clap refusing a value is an error message too
        Err(_) => return Ok(false),
    };
    PANICKED.store(false, Ordering::SeqCst);
    let outcome = std::panic::catch_unwind(|| legion_cli::run(cli));
    if outcome.is_err() || PANICKED.load(Ordering::SeqCst) {
        return Err(format!(
            "legion-rs {} panicked: {}",
            args.join(" "),
            last_panic()
        ));
    }
    Ok(outcome.is_ok_and(|r| r.is_ok()))
}

/// Writes a line to the test's real stderr (not captured by the harness), so that CI's log shows
/// how many cases ran.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A runner of `cases` cases from a fixed seed, so that CI runs the same cases every time.
/// `FUZZ_CASES=N` and `FUZZ_SEED=N` run more, or others, by hand.
fn runner(cases: u32) -> TestRunner {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let config = Config {
        cases: env("FUZZ_CASES").map_or(cases, |n| n as u32),
        failure_persistence: None,
        // each try runs the planner; a shorter shrink still names the culprit
        max_shrink_iters: 64,
        ..Config::default()
    };
    let rng = match env("FUZZ_SEED") {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
        }
        None => TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    };
    TestRunner::new_with_rng(config, rng)
}

/// One image layer to append, as its op and attributes and whether it reads a second tensor too
/// (`add`, `concat`). Sizes are small and mostly valid; the hostile values come from mutations.
fn image_layer() -> impl Strategy<Value = (Value, bool)> {
    prop_oneof![
        (
            1u64..=8,
            1u64..=3,
            1u64..=2,
            0u64..=1,
            1u64..=2,
            any::<bool>()
        )
            .prop_map(|(out, k, stride, pad, groups, relu)| (
                json!({"op": "conv2d", "out_channels": out * groups, "kernel": [k, k],
                       "stride": [stride, stride], "padding": [pad, pad], "groups": groups,
                       "activation": if relu { "relu" } else { "none" }}),
                false
            )),
        (any::<bool>(), 1u64..=2, 1u64..=2).prop_map(|(max, k, stride)| (
            json!({"op": "pool2d", "kind": if max { "max" } else { "avg" },
                   "kernel": [k, k], "stride": [stride, stride]}),
            false
        )),
        Just((json!({"op": "relu"}), false)),
        Just((json!({"op": "batch_norm"}), false)),
        (0.0f64..0.9).prop_map(|r| (json!({"op": "dropout", "rate": r}), false)),
        Just((json!({"op": "add"}), true)),
        Just((json!({"op": "concat"}), true)),
    ]
}

/// One layer over features (N, C) after the flatten.
fn feature_layer() -> impl Strategy<Value = Value> {
    prop_oneof![
        (1u64..=16, any::<bool>()).prop_map(|(f, relu)| json!({"op": "dense", "out_features": f,
            "activation": if relu { "relu" } else { "none" }})),
        Just(json!({"op": "relu"})),
        Just(json!({"op": "batch_norm"})),
        (0.0f64..0.9).prop_map(|r| json!({"op": "dropout", "rate": r})),
    ]
}

/// A JSON edit made after generation, to reach what a generator of valid-looking models does not.
#[derive(Clone, Debug)]
enum Mutation {
    /// Replace the `index`-th number in the document (modulo the count) with `value`.
    Number { index: usize, value: Value },
    /// Remove the `index`-th object key.
    DropKey { index: usize },
    /// Cut the text after `fraction` of its bytes.
    Truncate { fraction: f64 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let hostile_number = prop::sample::select(vec![
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!((1u64 << 63) + 1),
        json!(u64::MAX),
        json!(1e300),
        json!("7"),
        json!(null),
    ]);
    prop_oneof![
        4 => (any::<usize>(), hostile_number)
            .prop_map(|(index, value)| Mutation::Number { index, value }),
        1 => any::<usize>().prop_map(|index| Mutation::DropKey { index }),
        1 => (0.0f64..1.0).prop_map(|fraction| Mutation::Truncate { fraction }),
    ]
}

/// No edit in half the cases (the generated document reaches the code past the parser), else one
/// or two.
fn edits() -> impl Strategy<Value = Vec<Mutation>> {
    prop_oneof![
        2 => Just(Vec::new()),
        1 => prop::collection::vec(mutation(), 1),
        1 => prop::collection::vec(mutation(), 2),
    ]
}

/// The numbers of a JSON document, depth first.
fn numbers(v: &mut Value) -> Vec<&mut Value> {
    match v {
        Value::Number(_) => vec![v],
        Value::Array(items) => items.iter_mut().flat_map(numbers).collect(),
        Value::Object(map) => map.values_mut().flat_map(numbers).collect(),
        _ => Vec::new(),
    }
}

/// Removes a key of the `*nth` object of a JSON document (objects counted in preorder; `*nth` is
/// counted down as they are passed). True once one was removed.
fn drop_key(v: &mut Value, nth: &mut usize, key: usize) -> bool {
    match v {
        Value::Array(items) => items.iter_mut().any(|item| drop_key(item, nth, key)),
        Value::Object(map) => {
            if *nth == 0 {
                if let Some(name) = map.keys().nth(key % map.len().max(1)).cloned() {
                    map.remove(&name);
                }
                return true;
            }
            *nth -= 1;
            map.values_mut().any(|item| drop_key(item, nth, key))
        }
        _ => false,
    }
}

/// The document as text after the mutations.
fn mutated(mut doc: Value, mutations: &[Mutation]) -> String {
    let mut cut = None;
    for m in mutations {
        match m {
            Mutation::Number { index, value } => {
                let mut found = numbers(&mut doc);
                if !found.is_empty() {
                    let n = found.len();
                    *found[index % n] = value.clone();
                }
            }
            Mutation::DropKey { index } => {
                // the object is index mod 64 in preorder (past the last, none), the key index / 64
                let mut nth = index % 64;
                drop_key(&mut doc, &mut nth, index / 64);
            }
            Mutation::Truncate { fraction } => cut = Some(*fraction),
        }
    }
    let text = serde_json::to_string_pretty(&doc).unwrap();
    match cut {
        Some(f) => {
            let mut at = (text.len() as f64 * f) as usize;
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            text[..at].to_string()
        }
        None => text,
    }
}

/// A model: an image input, up to 5 image layers (each reading the last, and `add` and `concat`
/// also the last or an earlier one), a flatten, up to 2 feature layers, a classifier and the loss.
fn model() -> impl Strategy<Value = Value> {
    (
        (1u64..=4, 1u64..=3, 4u64..=12),
        prop::collection::vec((image_layer(), any::<prop::sample::Index>()), 0..=5),
        prop::collection::vec(feature_layer(), 0..=2),
        1u64..=10,
    )
        .prop_map(|((n, c, hw), image, features, classes)| {
            let mut layers = vec![json!({"name": "data", "op": "input", "shape": [n, c, hw, hw]})];
            let mut push = |mut attrs: Value, inputs: Vec<String>| {
                let name = format!("l{}", layers.len());
                let obj = attrs.as_object_mut().unwrap();
                obj.insert("name".into(), json!(name));
                obj.insert("inputs".into(), json!(inputs));
                layers.push(attrs);
                name
            };
            let mut names = vec!["data".to_string()];
            for ((attrs, two), other) in image {
                let last = names.last().unwrap().clone();
                // half the time the last tensor twice, which always fits; else an earlier one
                let second = if other.index(2) == 0 {
                    last.clone()
                } else {
                    other.get(&names).clone()
                };
                let inputs = if two { vec![last, second] } else { vec![last] };
                names.push(push(attrs, inputs));
            }
            let flat = json!({"op": "flatten"});
            names.push(push(flat, vec![names.last().unwrap().clone()]));
            for attrs in features {
                names.push(push(attrs, vec![names.last().unwrap().clone()]));
            }
            let fc = json!({"op": "dense", "out_features": classes});
            let fc = push(fc, vec![names.last().unwrap().clone()]);
            push(json!({"op": "softmax_cross_entropy"}), vec![fc]);
            json!({"name": "fuzzed", "layers": layers})
        })
}

/// A strategy file for 2 devices over the model's layers as the document names them: every layer
/// serial or every layer split over the sample dim, and a few layers (or their device lists) given
/// other or hostile values.
fn strategy_for(model: &Value) -> impl Strategy<Value = Value> + use<> {
    let layers: Vec<(String, String)> = model["layers"]
        .as_array()
        .map(|ls| {
            ls.iter()
                .filter_map(|l| Some((l["name"].as_str()?.into(), l["op"].as_str()?.into())))
                .collect()
        })
        .unwrap_or_default();
    let odd_degree = prop::sample::select(vec![0u64, 2, 3, 4, 1 << 32, 1 << 40, (1 << 63) + 1]);
    let odd_layer = (
        prop::sample::select(vec!["n", "c", "h", "w"]),
        odd_degree,
        prop::sample::select(vec![
            vec![0u64, 1],
            vec![1, 0],
            vec![0],
            vec![1u64 << 32, (1 << 32) + 1],
        ]),
    );
    let per_layer = prop_oneof![30 => Just(None), 1 => odd_layer.prop_map(Some)];
    (
        any::<bool>(),
        prop::collection::vec(per_layer, layers.len()),
    )
        .prop_map(move |(data_parallel, odd)| {
            let entries: Vec<Value> = layers
                .iter()
                .zip(odd)
                .map(|((name, op), odd)| match odd {
                    Some((dim, degree, devices)) => json!({"layer": name, "op": op,
                        "degrees": {dim: degree}, "devices": devices}),
                    None if data_parallel => json!({"layer": name, "op": op,
                        "degrees": {"n": 2}, "devices": [0, 1]}),
                    None => json!({"layer": name, "op": op, "degrees": {}, "devices": [0]}),
                })
                .collect();
            json!({"layers": entries})
        })
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn generated_and_mutated_models_and_strategies_never_panic_or_overallocate() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    install_panic_hook();
    let dir = tempfile::tempdir().unwrap();
    // batches of 1 leave nothing to split; the enormous ones must be refused
    let batches = prop::sample::select(vec![
        "2",
        "4",
        "4",
        "4",
        "4294967296",
        "4611686018427387904",
    ]);
    let cases = model()
        .prop_flat_map(move |m| {
            let strategy = strategy_for(&m);
            (Just(m), strategy, edits(), edits(), batches.clone())
        })
        .boxed();
    let ran = AtomicUsize::new(0);
    // how many runs of each command succeeded: the generator must reach past the parser
    let succeeded = [
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ];
    runner(1000)
        .run(
            &cases,
            |(model, strategy, model_edits, strategy_edits, batch)| {
                ran.fetch_add(1, Ordering::Relaxed);
                let model = write(dir.path(), "m.json", &mutated(model, &model_edits));
                let strategy = write(dir.path(), "s.json", &mutated(strategy, &strategy_edits));
                let (devices, machine) = ("2", "paper:2");
                let runs: [&[&str]; 3] = [
                    &[
                        "plan",
                        "--model",
                        &model,
                        "--batch",
                        batch,
                        "--machine",
                        machine,
                    ],
                    &[
                        "plan",
                        "--model",
                        &model,
                        "--batch",
                        batch,
                        "--machine",
                        machine,
                        "--evaluate",
                        "--strategy",
                        &strategy,
                    ],
                    &[
                        "train",
                        "--model",
                        &model,
                        "--batch",
                        batch,
                        "--steps",
                        "0",
                        "--devices",
                        devices,
                        "--strategy",
                        &strategy,
                    ],
                ];
                for (args, count) in runs.into_iter().zip(&succeeded) {
                    let ok = run_cli(args).map_err(|e| {
                        let read = |path: &str| {
                            let text = std::fs::read_to_string(path).unwrap_or_default();
                            serde_json::from_str::<Value>(&text).map_or(text, |v| v.to_string())
                        };
                        TestCaseError::fail(format!(
                            "{e}\nmodel: {}\nstrategy: {}",
                            read(&model),
                            read(&strategy)
                        ))
                    })?;
                    count.fetch_add(usize::from(ok), Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    let ok = |i: usize| succeeded[i].load(Ordering::Relaxed);
    report(&format!(
        "fuzz_inputs: {} generated models and strategies: plan succeeded on {}, plan --evaluate \
         on {}, train --steps 0 on {}; the rest were refused with an error",
        ran.load(Ordering::Relaxed),
        ok(0),
        ok(1),
        ok(2)
    ));
}

/// A text edit of a hosts or profile file.
fn text_edit() -> impl Strategy<Value = (usize, String)> {
    (
        any::<usize>(),
        prop::sample::select(vec![
            "0".to_string(),
            "4294967296".into(),
            "18446744073709551615".into(),
            "99999999999999999999999".into(),
            "-1".into(),
            "1e999".into(),
            "NaN".into(),
            "\"\"".into(),
            "[".into(),
            "\n".into(),
            String::new(),
        ]),
    )
}

/// `text` with the `index`-th run of digits (modulo the count) replaced by `with`, or, where the
/// text has no digits, `with` inserted at a position chosen by `index`.
fn replace_number(text: &str, index: usize, with: &str) -> String {
    let mut runs = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
                i += 1;
            }
            runs.push(start..i);
        } else {
            i += 1;
        }
    }
    if runs.is_empty() {
        let mut at = index % (text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        return format!("{}{with}{}", &text[..at], &text[at..]);
    }
    let run = runs[index % runs.len()].clone();
    format!("{}{with}{}", &text[..run.start], &text[run.end..])
}

/// Two machine files, uniform and per node, each with a link override.
const MACHINE_FILES: [&str; 2] = [
    r#"
name = "two-boxes"
nodes = 2
devices_per_node = 4
[device]
kind = "p100"
peak_gflops = 9300
memory_gb_per_s = 732.0
memory_gib = 16
[intra_node]
gbit_per_s = 160
latency_us = 5
[inter_node]
gbit_per_s = 100
latency_us = 10
[[link]]
between = [0, 5]
gbit_per_s = 25
latency_us = 2
"#,
    r#"
[device]
kind = "p100"
peak_gflops = 9300
memory_gb_per_s = 732
task_overhead_us = 10
[[node]]
devices = 2
[[node]]
devices = 3
device = { kind = "v100", peak_gflops = 15700, memory_gb_per_s = 900 }
[intra_node]
gbit_per_s = 160
[inter_node]
gbit_per_s = 100
[[link]]
between = [1, 4]
gbit_per_s = 25
"#,
];

/// Runs `cases` edits of the `(text, file name)` seeds through `read`, which must not panic; returns
/// how many cases ran.
fn fuzz_text_file(
    cases: u32,
    seeds: Vec<(String, &'static str)>,
    read: impl Fn(&str, &str),
) -> usize {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    install_panic_hook();
    let cases_of = (
        prop::sample::select(seeds),
        prop::collection::vec(text_edit(), 1..=3),
    );
    let ran = AtomicUsize::new(0);
    runner(cases)
        .run(&cases_of, |((seed, name), edits)| {
            ran.fetch_add(1, Ordering::Relaxed);
            let text = edits.iter().fold(seed, |text, (index, with)| {
                replace_number(&text, *index, with)
            });
            PANICKED.store(false, Ordering::SeqCst);
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| read(&text, name)));
            prop_assert!(
                outcome.is_ok() && !PANICKED.load(Ordering::SeqCst),
                "{}, on:\n{text}",
                last_panic()
            );
            Ok(())
        })
        .unwrap();
    ran.into_inner()
}

#[test]
fn mutated_machine_files_are_parsed_or_refused_without_panicking() {
    let seeds = MACHINE_FILES
        .iter()
        .map(|t| (t.to_string(), "m.toml"))
        .collect();
    let ran = fuzz_text_file(300, seeds, |text, name| {
        let _ = legion_planner::machine_file::parse_machine(text, name, "m");
    });
    report(&format!(
        "fuzz_inputs: {ran} mutated machine files through the parser"
    ));
}

#[test]
fn mutated_hosts_files_are_parsed_or_refused_without_panicking() {
    let toml = include_str!("../../../examples/hosts.toml");
    let hostfile = include_str!("../../../examples/hostfile");
    let extra =
        "\n[[link]]\nfrom = \"worker0\"\nto = \"worker1\"\ngbps = 10.0\nlatency_us = 20.0\n";
    let toml_with_link = format!("{toml}{extra}");
    let seeds = vec![
        (toml.to_string(), "hosts.toml"),
        (toml_with_link, "hosts.toml"),
        (hostfile.to_string(), "hostfile"),
    ];
    let ran = fuzz_text_file(400, seeds, |text, name| {
        if let Ok(hosts) = Hosts::parse(text, name) {
            let _ = hosts.num_devices();
            let _ = hosts.device_ranges();
            let _ = legion::machine::hosts_machine(&hosts);
        }
    });
    report(&format!(
        "fuzz_inputs: {ran} mutated hosts files through the parser and the planner's machine"
    ));
}

/// A profile of LeNet-5 at batch 4 on 2 CPU devices: every layer's serial tile and its halves along
/// the sample dim, the links, the compute threads and the runtime's costs.
fn lenet_profile() -> String {
    let graph = zoo::find("lenet5")
        .unwrap()
        .build(&zoo::find("lenet5").unwrap().default_config(4))
        .unwrap();
    let mut db = ProfileDb::default();
    for id in graph.ids() {
        let layer = graph.layer(id);
        let inputs = graph.input_shapes(id);
        for config in [
            ParallelConfig::serial(0),
            ParallelConfig::split(legion_ops::Dim::N, 2, 0),
        ] {
            for tile in tile_rects(&layer.shape, &config) {
                let times = PhaseTimes {
                    forward: 1e-4,
                    backward: 2e-4,
                };
                db.record(layer, &inputs, &tile, "cpu", times, 3);
            }
        }
    }
    db.links = Some(LinkProfile {
        bytes_per_s: 2e9,
        latency_s: 5e-5,
        samples: 4,
    });
    db.compute_threads = Some(2);
    db.runtime = Some(RuntimeCosts {
        dispatch_s: 5e-5,
        runtime_cpu_s: 1e-5,
        dispatch_bins_s: None,
        fold_bytes_per_s: 4e9,
        update_bytes_per_s: 4e9,
        copy_bytes_per_s: 8e9,
        actor_threads: 1,
    });
    db.to_json()
}

#[test]
fn mutated_profiles_are_planned_with_or_refused_without_panicking() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    install_panic_hook();
    let dir = tempfile::tempdir().unwrap();
    let seed = lenet_profile();
    let cases = prop::collection::vec(text_edit(), 1..=3);
    let ran = AtomicUsize::new(0);
    runner(200)
        .run(&cases, |edits| {
            ran.fetch_add(1, Ordering::Relaxed);
            let mut text = seed.clone();
            for (index, with) in &edits {
                text = replace_number(&text, *index, with);
            }
            let path = write(dir.path(), "profile.json", &text);
            let args = [
                "plan",
                "--model",
                "lenet5",
                "--batch",
                "4",
                "--machine",
                "local-cpu:2",
                "--profile",
                &path,
            ];
            // the edits, not the whole profile: it is long
            run_cli(&args)
                .map(|_| ())
                .map_err(|e| TestCaseError::fail(format!("{e}\nedits: {edits:?}")))
        })
        .unwrap();
    report(&format!(
        "fuzz_inputs: {} mutated profiles through plan --profile",
        ran.load(Ordering::Relaxed)
    ));
}
