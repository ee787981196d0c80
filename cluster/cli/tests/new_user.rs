//! What a new user meets following the README and `--help`: every mistake caught before any work
//! starts with an error naming the flag or file to change, every number a run prints right at any
//! step count, a failed `up` cleaned up, and the help and errors agreeing with what the binary
//! accepts.

mod common;
use common::stderr;

use common::{ALEXNET_64, assert_clean_failure, free_udp_port, legion, ok};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json_lines(out: &Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect()
}

fn summary_of(out: &Output) -> Value {
    json_lines(out)
        .into_iter()
        .find(|l| l["summary"] == true)
        .unwrap_or_else(|| panic!("no summary in {}", stdout(out)))
}

/// `legion-rs plan ... --search data --out PATH` for `model` (zoo flags) on `devices` CPU devices.
fn data_strategy_file(dir: &Path, model: &[&str], devices: usize) -> PathBuf {
    let path = dir.join(format!("data{devices}.json"));
    let machine = format!("local-cpu:{devices}");
    let mut args = vec!["plan", "--machine", &machine, "--search", "data"];
    args.extend(model);
    args.extend(["--out", s(&path)]);
    ok(legion(&args));
    path
}

const LENET_8: [&str; 4] = ["--model", "lenet5", "--batch", "8"];

/// A strategy file is checked on one device too, where no strategy runs: a wrong one is an
/// error, never silently ignored.
#[test]
fn a_strategy_file_is_checked_on_one_device_too() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nonexist.json");
    let out = legion(
        &[
            &["train"][..],
            &LENET_8,
            &["--strategy", s(&missing), "--steps", "2"],
        ]
        .concat(),
    );
    assert_clean_failure(&out, &["--strategy", "nonexist.json", "optcnn", "spartan"]);
    assert!(stdout(&out).is_empty(), "nothing trained: {}", stdout(&out));

    // A 2-device strategy on one device: the device count to give is named.
    let two = data_strategy_file(dir.path(), &LENET_8, 2);
    let out = legion(
        &[
            &["train"][..],
            &LENET_8,
            &["--strategy", s(&two), "--steps", "2"],
        ]
        .concat(),
    );
    assert_clean_failure(
        &out,
        &["data2.json", "places layers on 2 devices", "--devices 2"],
    );
}

/// With every search failing, `plan --search all` says why each one did, not only that none
/// succeeded.
#[test]
fn plan_says_why_every_search_failed() {
    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--batch",
        "8",
        "--machine",
        "paper:2",
        "--memory-gib",
        "0.00001",
        "--search",
        "all",
    ]);
    assert_clean_failure(&out, &["no search succeeded"]);
    let err = stderr(&out);
    for search in [
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
    ] {
        assert!(
            err.lines()
                .any(|l| l.trim_start().starts_with(&format!("{search}: "))),
            "no reason for {search}: {err}"
        );
    }
    assert!(err.contains("does not fit the devices' memory"), "{err}");
}

/// `--steps 0`, a resumed run that is already finished and a resumed run that goes on each get a
/// summary that is true: no loss trend or throughput of steps not taken, and a resumed run's
/// throughput over its own steps only.
#[test]
fn summaries_are_right_for_zero_finished_and_resumed_runs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run.safetensors");
    let train = |steps: &str, extra: &[&str]| {
        legion(&[&["train"][..], &LENET_8, &["--steps", steps], extra].concat())
    };

    let zero = ok(train("0", &[]));
    let text = stdout(&zero);
    assert!(text.contains("no steps to train (--steps 0)"), "{text}");
    assert!(
        !text.contains("img/s") && !text.contains("-0.0000"),
        "{text}"
    );

    ok(train("4", &["--save", s(&run)]));
    let finished = ok(train("4", &["--resume", s(&run), "--save", s(&run)]));
    let text = stdout(&finished);
    assert!(
        text.contains("nothing to train: the run is already at step 4 of --steps 4"),
        "{text}"
    );
    assert!(
        !text.contains("img/s") && !text.contains("-0.0000"),
        "{text}"
    );
    let finished = summary_of(&ok(train(
        "4",
        &["--resume", s(&run), "--save", s(&run), "--json"],
    )));
    assert_eq!(finished["steps_taken"], 0, "{finished}");
    assert_eq!(finished["images_per_sec"], Value::Null, "{finished}");
    assert_eq!(finished["first_losses_mean"], Value::Null, "{finished}");

    let resumed = ok(train("8", &["--resume", s(&run), "--json"]));
    let summary = summary_of(&resumed);
    assert_eq!(summary["first_step"], 4, "{summary}");
    assert_eq!(summary["steps_taken"], 4, "{summary}");
    // images over the steps this run took, in its own wall time
    let images_per_sec = summary["images_per_sec"].as_f64().unwrap();
    let wall = summary["wall_s"].as_f64().unwrap();
    let images = images_per_sec * wall;
    assert!(
        (images - 4.0 * 8.0).abs() < 1e-6 * images.max(1.0),
        "{images} images counted, 32 trained: {summary}"
    );

    let text = stdout(&ok(train("10", &["--resume", s(&run)])));
    assert!(
        text.contains("trained lenet5 for 6 step(s), 5 to 10 (resumed at step 4)"),
        "{text}"
    );
}

/// Outputs are checked before any work: a run is never lost to a path it cannot write.
#[test]
fn outputs_that_cannot_be_written_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let nowhere = dir.path().join("nonexistent/dir/x.safetensors");
    let folder = dir.path().to_path_buf();
    for (flag, path, needle) in [
        ("--save", &nowhere, "does not exist"),
        ("--trace", &nowhere, "does not exist"),
        ("--save", &folder, "is a folder"),
    ] {
        let out = legion(&[&["train"][..], &LENET_8, &["--steps", "3", flag, s(path)]].concat());
        assert_clean_failure(&out, &[flag, s(path), needle]);
        assert!(stdout(&out).is_empty(), "steps ran: {}", stdout(&out));
    }
    let out = legion(&[
        "plan",
        "--model",
        "lenet5",
        "--machine",
        "local-cpu:2",
        "--out",
        s(&nowhere),
    ]);
    assert_clean_failure(&out, &["--out", "does not exist"]);
    assert!(stdout(&out).is_empty(), "planned: {}", stdout(&out));
    let out = legion(
        &[
            &["profile"][..],
            &LENET_8,
            &["--devices", "2", "--device", "cpu", "--out", s(&nowhere)],
        ]
        .concat(),
    );
    assert_clean_failure(&out, &["--out", "does not exist"]);
    assert!(stdout(&out).is_empty(), "profiled: {}", stdout(&out));
}

/// A strategy file for another model names the file and both models; a strategy that leaves
/// devices idle says which.
#[test]
fn strategy_files_name_their_model_and_idle_devices_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let for_alexnet = data_strategy_file(dir.path(), &ALEXNET_64, 4);
    let out = legion(
        &[
            &["train"][..],
            &LENET_8,
            &[
                "--devices",
                "4",
                "--strategy",
                s(&for_alexnet),
                "--steps",
                "1",
            ],
        ]
        .concat(),
    );
    assert_clean_failure(
        &out,
        &[
            "data4.json",
            "made for model 'alexnet'",
            "--model is 'lenet5'",
        ],
    );

    let for_lenet = data_strategy_file(dir.path(), &LENET_8, 4);
    let out = ok(legion(
        &[
            &["train", "--device", "cpu"][..],
            &LENET_8,
            &[
                "--devices",
                "8",
                "--strategy",
                s(&for_lenet),
                "--steps",
                "1",
            ],
        ]
        .concat(),
    ));
    assert!(
        stderr(&out).contains("uses 4 of the 8 devices; device(s) 4-7 stay idle"),
        "{}",
        stderr(&out)
    );
    // The searches' degrees are powers of two: on 3 devices, optcnn uses 2.
    let out = ok(legion(
        &[
            &["train", "--device", "cpu"][..],
            &LENET_8,
            &[
                "--devices",
                "3",
                "--strategy",
                "optcnn",
                "--steps",
                "1",
                "--json",
            ],
        ]
        .concat(),
    ));
    assert!(
        stderr(&out).contains("the optcnn strategy uses 2 of the 3 devices; device(s) 2 stay idle"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        summary_of(&out)["plan"]["idle_devices"],
        serde_json::json!([2])
    );
}

/// The loss trend compares windows that never share a step, at any step count, and says how
/// many steps each holds.
#[test]
fn the_loss_summary_compares_windows_that_do_not_overlap() {
    let train = |steps: &str, json: bool| {
        let mut args = vec![
            "train", "--model", "lenet5", "--batch", "8", "--steps", steps,
        ];
        if json {
            args.push("--json");
        }
        ok(legion(&args))
    };
    for (steps, window) in [(10usize, 5usize), (25, 10), (3, 1)] {
        let out = train(&steps.to_string(), true);
        let losses: Vec<f64> = json_lines(&out)
            .iter()
            .filter(|l| l.get("step").is_some())
            .map(|l| l["loss"].as_f64().unwrap())
            .collect();
        assert_eq!(losses.len(), steps);
        let summary = summary_of(&out);
        assert_eq!(summary["loss_window"], window, "{summary}");
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        let first = summary["first_losses_mean"].as_f64().unwrap();
        let last = summary["last_losses_mean"].as_f64().unwrap();
        assert!((first - mean(&losses[..window])).abs() < 1e-5, "{summary}");
        assert!(
            (last - mean(&losses[steps - window..])).abs() < 1e-5,
            "{summary}"
        );
    }
    let text = stdout(&train("10", false));
    assert!(
        text.contains("(means of the first and last 5 step(s))"),
        "{text}"
    );
    // One step has no trend to show: its loss alone.
    let text = stdout(&train("1", false));
    assert!(
        text.contains("trained lenet5 for 1 step(s) at batch 8: loss ") && !text.contains("->"),
        "{text}"
    );
}

/// `up` failing part-way (one host's port taken) stops the worker it started for the other
/// host, and says so: nothing of it is left running.
#[test]
fn a_failed_up_stops_the_workers_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let hosts = dir.path().join("hosts.toml");
    std::fs::write(
        &hosts,
        format!(
            "[[host]]\nname = \"w0\"\naddress = \"127.0.0.1\"\nport = {}\n\n\
             [[host]]\nname = \"w1\"\naddress = \"127.0.0.1\"\nport = {taken_port}\n",
            free_udp_port()
        ),
    )
    .unwrap();
    let state = dir.path().join("state");
    let cluster = |command: &str| legion(&[command, s(&hosts), "--state", s(&state)]);
    let out = cluster("up");
    let stopped_all = legion(&["down", s(&hosts), "--state", s(&state)]);
    assert_clean_failure(
        &out,
        &[
            "worker w1",
            "Address already in use",
            "up stopped the worker(s) it had started: w0",
        ],
    );
    // `down` found nothing to stop: `up` had stopped it.
    assert!(
        stdout(&stopped_all).contains("no worker of"),
        "{}",
        stdout(&stopped_all)
    );
    let status = cluster("status");
    assert_clean_failure(&status, &["2 of 2 worker(s) are down"]);
    drop(taken);
}

/// A square image file of `size`×`size` pixels of one colour.
fn write_png(path: &Path, size: u32, colour: [u8; 3]) {
    image::RgbImage::from_pixel(size, size, image::Rgb(colour))
        .save(path)
        .unwrap();
}

/// Errors that name the flag to change: the image size of a zoo model, the batch a strategy's
/// sample split needs, the machine `profile` needs, the classes a data folder has.
#[test]
fn errors_name_the_flag_to_change() {
    let out = legion(&[
        "train",
        "--model",
        "alexnet",
        "--image-size",
        "16",
        "--steps",
        "1",
    ]);
    assert_clean_failure(&out, &["--image-size 16", "pool2"]);

    let dir = tempfile::tempdir().unwrap();
    let four_way = data_strategy_file(dir.path(), &LENET_8, 4);
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--batch",
        "2",
        "--devices",
        "4",
        "--strategy",
        s(&four_way),
        "--steps",
        "1",
    ]);
    assert_clean_failure(&out, &["data4.json", "--batch 2", "--batch 4 or more"]);

    // `profile` needs --devices or --machine, and its help says so.
    let out = legion(&["profile", "--model", "lenet5", "--out", "x.json"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--devices <DEVICES>|--machine <MACHINE>"),
        "{err}"
    );
    let help = stdout(&ok(legion(&["profile", "--help"])));
    assert!(
        help.contains("<--devices <DEVICES>|--machine <MACHINE>>"),
        "{help}"
    );

    // A 2-class image folder for a 10-class head.
    let images = dir.path().join("images");
    for (class, colour) in [("cat", [200, 30, 30]), ("dog", [30, 30, 200])] {
        std::fs::create_dir_all(images.join(class)).unwrap();
        write_png(&images.join(class).join("a.png"), 8, colour);
    }
    let data = format!("folder:{}", s(&images));
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--image-size",
        "32",
        "--batch",
        "2",
        "--steps",
        "1",
        "--data",
        &data,
    ]);
    assert_clean_failure(
        &out,
        &["--data", "has 2 classes", "10 outputs", "--classes 2"],
    );
    assert!(stdout(&out).is_empty(), "trained: {}", stdout(&out));
    // and for a head with fewer outputs than the folder has classes
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--image-size",
        "32",
        "--classes",
        "1",
        "--steps",
        "1",
        "--data",
        &data,
    ]);
    assert_clean_failure(&out, &["has 2 classes", "1 outputs", "--classes 2"]);
    ok(legion(&[
        "train",
        "--model",
        "lenet5",
        "--image-size",
        "32",
        "--classes",
        "2",
        "--batch",
        "2",
        "--steps",
        "1",
        "--data",
        &data,
    ]));
}

/// The strategy names in `train --help`, in its error for an unknown name, and those it accepts
/// are one list.
#[test]
fn help_errors_and_parsing_share_one_list_of_strategy_names() {
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--strategy",
        "nosuch",
        "--steps",
        "1",
    ]);
    assert_clean_failure(&out, &["--strategy 'nosuch' is neither a search ("]);
    let err = stderr(&out);
    let listed: Vec<&str> = err
        .split_once("a search (")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(names, _)| names.split(", ").collect())
        .unwrap();
    assert!(listed.contains(&"soybean"), "{listed:?}");
    let help = stdout(&ok(legion(&["train", "--help"])));
    let in_help = help
        .split_once("a search (")
        .and_then(|(_, rest)| rest.split_once(';'))
        .map(|(names, _)| names.split(", ").collect::<Vec<_>>())
        .unwrap_or_else(|| panic!("no strategy list in {help}"));
    assert_eq!(
        in_help, listed,
        "train --help and the error list different names"
    );
    // Every one parses: on 2 devices, zero steps (planned, nothing trained).
    for name in &listed {
        ok(legion(
            &[
                &["train", "--device", "cpu", "--devices", "2"][..],
                &LENET_8,
                &["--strategy", name, "--steps", "0"],
            ]
            .concat(),
        ));
    }
}

/// Help text for every training flag, `--device gpu` pointing to `cuda`, the device line in JSON
/// output too, an aligned `models` table and a `--compare` column that says what it measures.
#[test]
fn help_and_output_say_what_they_mean() {
    let help = stdout(&ok(legion(&["train", "--help"])));
    for flag in [
        "--lr <LR>",
        "--momentum <MOMENTUM>",
        "--weight-decay <WEIGHT_DECAY>",
    ] {
        let described = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(flag))
            .nth(1)
            .unwrap_or_else(|| panic!("{flag} not in {help}"));
        assert!(
            !described.trim().is_empty() && !described.trim_start().starts_with("[default"),
            "{flag} has no help text: {help}"
        );
    }

    let out = legion(&[
        "train", "--model", "lenet5", "--device", "gpu", "--steps", "1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("the GPU is `cuda` (--device cuda)"),
        "{}",
        stderr(&out)
    );

    let out = ok(legion(&[
        "train", "--model", "lenet5", "--batch", "8", "--steps", "1", "--device", "cpu", "--json",
    ]));
    let first = &json_lines(&out)[0];
    assert_eq!(first["device"], "device: cpu (1 device(s))", "{first}");

    let table = stdout(&ok(legion(&["models"])));
    let rows: Vec<&str> = table.lines().filter(|l| !l.starts_with('(')).collect();
    // The columns after the name are right-aligned: aligned rows end where the header ends, and
    // each input size ends where the header's `input` does.
    let input_end = |line: &str| {
        let word = line.split_whitespace().nth(1).unwrap();
        line.find(word).unwrap() + word.len()
    };
    for row in &rows[1..] {
        assert_eq!(
            (row.len(), input_end(row)),
            (rows[0].len(), input_end(rows[0])),
            "misaligned:\n{}\n{row}",
            rows[0]
        );
    }
    assert!(table.contains("inception_v3_reduced"), "{table}");

    let row = legion_cli::compare::CompareRow {
        strategy: "owt".into(),
        measured_ms: 10.0,
        images_per_sec: 100.0,
        comm_bytes_per_step: 1 << 20,
        simulated_ms: 9.0,
        simulation_error: -0.1,
        speedup_over_data: 1.5,
        max_rel_diff_from_one_device: 9.6e-2,
        floor_rel_diff: 8.1e-2,
    };
    let above = legion_cli::compare::CompareRow {
        strategy: "data".into(),
        max_rel_diff_from_one_device: 9.6e-1,
        ..row.clone()
    };
    let table = legion_cli::compare::table(&[row, above]);
    assert!(table.contains("max rel diff vs 1"), "{table}");
    let marked: Vec<&str> = table
        .lines()
        .filter(|l| l.ends_with("above the floor"))
        .collect();
    assert_eq!(marked.len(), 1, "{table}");
    assert!(marked[0].starts_with("data "), "{table}");
    assert!(
        table.contains("(a fraction: 1e-2 is 1%)") && table.contains("grow with the steps"),
        "{table}"
    );
}

/// A standard CNN trains under the default strategy (optcnn) on several devices, however densely
/// its layers connect: DenseNet-121, whose residual graph the search cannot enumerate. The
/// search's progress (shown at once here) goes to stderr; stdout stays JSON lines.
#[test]
fn densenet_trains_on_two_devices_under_the_default_strategy() {
    let args = [
        "train",
        "--model",
        "densenet121",
        "--image-size",
        "32",
        "--classes",
        "10",
        "--batch",
        "4",
        "--devices",
        "2",
        "--steps",
        "1",
        "--json",
    ];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .env("LEGION_RS_PROGRESS_AFTER_MS", "0")
        .output()
        .expect("legion-rs runs");
    let summary = summary_of(&out);
    assert_eq!(summary["plan"]["strategy"], "optcnn", "{}", stderr(&out));
    assert!(
        stderr(&out).contains("optcnn: eliminating layers"),
        "no search progress on stderr: {}",
        stderr(&out)
    );
    assert_eq!(summary["steps_taken"], 1);
    assert!(summary["final_loss"].as_f64().is_some_and(f64::is_finite));
}

/// A folder of images as a user has one: an undecodable file among them, a file of another
/// format, classes of different sizes. The run says what it found, skips and counts the bad
/// file, scores the samples it held out, and `eval` and `predict` read its checkpoint back with
/// its class names; `--strict-data` stops at the bad file instead.
#[test]
fn a_folder_with_a_bad_image_trains_scores_held_out_data_and_predicts() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("photos");
    for (class, colour, count) in [("cat", [200, 30, 30], 5), ("dog", [30, 30, 200], 4)] {
        std::fs::create_dir_all(images.join(class)).unwrap();
        for i in 0..count {
            let shade = [colour[0] + 5 * i, colour[1], colour[2]];
            write_png(
                &images.join(class).join(format!("{i}.png")),
                12 + i as u32,
                shade,
            );
        }
    }
    // A whole header, then the pixel data cut off half way.
    let whole = images.join("dog/4.png");
    image::RgbImage::from_fn(64, 64, |x, y| image::Rgb([(x * 3) as u8, (y * 5) as u8, 7]))
        .save(&whole)
        .unwrap();
    let bytes = std::fs::read(&whole).unwrap();
    std::fs::write(&whole, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(images.join("cat/photo.webp"), b"RIFF....WEBP").unwrap();
    let data = format!("folder:{}", s(&images));
    let saved = dir.path().join("pets.safetensors");
    let model = [
        "--model",
        "lenet5",
        "--image-size",
        "28",
        "--classes",
        "2",
        "--batch",
        "4",
    ];
    let train = |extra: &[&str]| {
        let mut args = vec!["train"];
        args.extend(model);
        args.extend(["--steps", "6", "--data", &data, "--json", "--device", "cpu"]);
        args.extend(extra);
        legion(&args)
    };
    let out = ok(train(&[
        "--val-split",
        "0.3",
        "--eval-every",
        "3",
        "--save",
        s(&saved),
    ]));
    let err = stderr(&out);
    assert!(
        err.contains("cat 5 (label 0), dog 5 (label 1)") && err.contains("1 .webp"),
        "{err}"
    );
    let summary = summary_of(&out);
    // Seven training samples in batches of four: the truncated file is met at least once.
    assert!(
        summary["skipped_samples"].as_u64().unwrap() >= 1,
        "{summary}"
    );
    assert!(
        summary["skipped_files"][0]
            .as_str()
            .unwrap()
            .contains("4.png"),
        "{summary}"
    );
    assert!(err.contains("warning: skipped a sample"), "{err}");
    let scored: Vec<Value> = json_lines(&out)
        .into_iter()
        .filter(|l| l["eval"] == true)
        .collect();
    assert_eq!(scored.len(), 2, "{}", stdout(&out));
    assert_eq!(
        (scored[0]["step"].as_u64(), scored[1]["step"].as_u64()),
        (Some(3), Some(6))
    );
    assert_eq!(scored[1]["samples"], 3);
    assert_eq!(summary["validation"]["top1"], scored[1]["top1"]);

    let mut args = vec!["eval"];
    args.extend(model);
    args.extend(["--checkpoint", s(&saved), "--data", &data, "--json"]);
    let eval: Value = serde_json::from_str(stdout(&ok(legion(&args))).trim()).unwrap();
    // Every readable image, the truncated one skipped.
    assert_eq!(eval["samples"], 9, "{eval}");
    assert!(
        (0.0..=1.0).contains(&eval["top1"].as_f64().unwrap()),
        "{eval}"
    );

    let mut args = vec!["predict"];
    args.extend(model);
    let cats = images.join("cat");
    args.extend(["--checkpoint", s(&saved), "--top", "2", "--json", s(&cats)]);
    let predicted: Value = serde_json::from_str(stdout(&ok(legion(&args))).trim()).unwrap();
    let rows = predicted["predictions"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{predicted}");
    let names: Vec<&str> = rows[0]["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"cat") && names.contains(&"dog"),
        "{predicted}"
    );

    let out = train(&["--strict-data"]);
    assert_clean_failure(&out, &["4.png", "cannot decode image"]);
}
