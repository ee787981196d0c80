//! The README and `docs/`, run: "the documents" are `README.md`, `docs/tour.md` and
//! `docs/formats.md`, read in that order as one text. Every `legion-rs` command of their shell
//! blocks runs here, in order, at small sizes, on the files the examples of `docs/formats.md`
//! describe, so that the documents cannot drift from the binary. A command of the documents this
//! test does not know fails it, as does one it knows that the documents lost: a changed command is
//! looked at again. A command may appear twice (the README's "Ten commands" are commands of the
//! tour): it runs once, and counts where it last appears, so that the tour keeps every one of
//! them in the order this test runs them.
//!
//! Each command runs with the documents' own arguments, a few flags set smaller (added where the
//! documents have none); the data and hosts files it names are made in a temporary directory that
//! is its working directory.

mod common;

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The documents, in the order they are read, relative to the repository's root.
const DOCUMENTS: &[&str] = &["README.md", "docs/tour.md", "docs/formats.md"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The documents, one after another, as one text.
fn documents() -> String {
    DOCUMENTS
        .iter()
        .map(|name| {
            let path = root().join(name);
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The commands of the documents' `sh` blocks: continuation lines joined, comments and blank
/// lines dropped.
fn readme_commands(text: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = match line.find(" #") {
            Some(at) => &line[..at],
            None if line.trim_start().starts_with('#') => "",
            None => line,
        };
        match code.trim_end().strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head.trim());
                pending.push(' ');
            }
            None => {
                pending.push_str(code.trim());
                let command = std::mem::take(&mut pending);
                if !command.is_empty() {
                    commands.push(command);
                }
            }
        }
    }
    commands
}

/// The documents' example files: each fenced block right after a `<!-- file: NAME -->` line.
fn readme_files(text: &str) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .strip_prefix("<!-- file: ")
            .and_then(|rest| rest.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(fence.starts_with("```"), "no block after {line}");
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        files.push((name.to_string(), body.join("\n") + "\n"));
    }
    files
}

/// How the tour runs one command of the documents.
enum How {
    /// Runs with these flags set; it must succeed.
    Run(&'static [(&'static str, &'static str)]),
    /// Runs with these flags set; it must succeed where a GPU is usable, else exit 1 with an error
    /// naming what `--device cuda` lacks (as the tour says it does).
    Cuda(&'static [(&'static str, &'static str)]),
    /// Needs the file a `Cuda` command writes on a GPU: runs, as `Run`, only where it exists.
    AfterCuda(&'static str, &'static [(&'static str, &'static str)]),
    /// Not a `legion-rs` command: run elsewhere, as this says.
    Elsewhere(&'static str),
    /// A command for inside a Slurm allocation: `cluster/cli/tests/slurm.rs` runs it in one of a
    /// Slurm it starts; here, outside any, it must exit 1 saying so in one line.
    InSlurm,
}

const SMALL_ALEXNET: &[(&str, &str)] = &[("--batch", "4"), ("--steps", "1")];
const EXAMPLES: How =
    How::Elsewhere("the example programs run in examples/tests/examples.rs (cargo test)");

/// Every command of the documents, once, in their order (a repeated one where it last appears),
/// and how the tour runs it.
const TOUR: &[(&str, How)] = &[
    (
        "cargo run --release -p legion-examples --bin alexnet",
        How::Elsewhere("the main job: examples/tests/examples.rs runs it at a reduced size"),
    ),
    (
        "cargo test --workspace",
        How::Elsewhere("what CI runs (.ci/run); this test is part of it"),
    ),
    (
        "cargo build --release",
        How::Elsewhere("the binary under test is cargo's build of it"),
    ),
    (
        "alias legion-rs=\"$PWD/target/release/legion-rs\"",
        How::Elsewhere("the tour runs the binary cargo built for this test"),
    ),
    ("legion-rs models", How::Run(&[])),
    ("legion-rs models --json", How::Run(&[])),
    (
        "legion-rs train --model lenet5 --devices 1 --steps 60 --json",
        How::Run(&[("--steps", "10")]),
    ),
    (
        "legion-rs train --model alexnet --image-size 64 --batch 16 --steps 5 --save alex.safetensors",
        How::Run(SMALL_ALEXNET),
    ),
    (
        "legion-rs train --model alexnet --image-size 64 --batch 16 --steps 5 --init alex.safetensors",
        How::Run(SMALL_ALEXNET),
    ),
    (
        "legion-rs train --model lenet5 --steps 200 --checkpoint-every 50 --save run.safetensors",
        How::Run(&[
            ("--batch", "8"),
            ("--steps", "4"),
            ("--checkpoint-every", "2"),
        ]),
    ),
    (
        "legion-rs train --model lenet5 --steps 200 --resume run.safetensors --save run.safetensors",
        How::Run(&[("--batch", "8"), ("--steps", "6")]),
    ),
    (
        "legion-rs train --model lenet5 --image-size 32 --data cifar10:path/to/cifar-10-batches-bin",
        How::Run(&[("--batch", "4"), ("--steps", "2")]),
    ),
    (
        "legion-rs train --model resnet50 --image-size 64 --classes 10 --data folder:path/to/images",
        How::Run(&[("--image-size", "32"), ("--batch", "2"), ("--steps", "1")]),
    ),
    (
        "legion-rs train --model resnet50 --image-size 64 --classes 10 --data folder:path/to/images --val-split 0.2 --eval-every 50 --epochs 30 --lr-schedule cosine --warmup-steps 20 --save pets.safetensors",
        How::Run(&[
            ("--image-size", "32"),
            ("--batch", "2"),
            ("--epochs", "1"),
            ("--eval-every", "2"),
            ("--warmup-steps", "1"),
        ]),
    ),
    (
        "legion-rs eval --model resnet50 --image-size 64 --classes 10 --checkpoint pets.safetensors --data folder:path/to/images",
        How::Run(&[("--image-size", "32"), ("--batch", "2")]),
    ),
    (
        "legion-rs predict --model resnet50 --image-size 64 --classes 10 --checkpoint pets.safetensors path/to/images/class3",
        How::Run(&[("--image-size", "32"), ("--batch", "2")]),
    ),
    (
        "legion-rs train --model alexnet --image-size 64 --classes 10 --batch 16 --devices 4 --strategy optcnn --steps 10",
        How::Run(&[("--batch", "8"), ("--steps", "1")]),
    ),
    (
        "legion-rs train --model lenet5 --devices 4 --strategy data --steps 20 --trace lenet.trace.json",
        How::Run(&[("--batch", "8"), ("--steps", "2")]),
    ),
    (
        "cargo run --release -p legion-examples --bin lenet5 -- --compare --chart lenet.svg",
        EXAMPLES,
    ),
    (
        "cargo run --release -p legion-examples --bin lenet5 -- --compare --strategies all --devices 4",
        EXAMPLES,
    ),
    (
        "cargo run --release -p legion-examples --bin vgg16 -- --devices 4 --strategy owt --steps 5",
        EXAMPLES,
    ),
    (
        "legion-rs train --model alexnet --image-size 64 --classes 10 --batch 32 --devices 4 --steps 20",
        How::Run(&[("--batch", "8"), ("--steps", "15")]),
    ),
    (
        "legion-rs plan --model alexnet --image-size 64 --classes 10 --batch 32 --machine local-cpu:4 --costs measured",
        How::Run(&[("--batch", "8")]),
    ),
    (
        "legion-rs profile --model alexnet --image-size 64 --classes 10 --batch 32 --devices 4 --out alex.profile.json",
        How::Run(&[("--batch", "8"), ("--warmup", "1"), ("--repeats", "1")]),
    ),
    (
        "legion-rs plan --model alexnet --image-size 64 --classes 10 --batch 32 --machine local-cpu:4 --costs alex.profile.json",
        How::Run(&[]),
    ),
    (
        "legion-rs plan --model vgg16 --batch 512 --machine paper --search all",
        How::Run(&[("--model", "alexnet"), ("--refine-budget", "50")]),
    ),
    (
        "legion-rs plan --model alexnet --batch 512 --machine paper --paper-space",
        How::Run(&[]),
    ),
    (
        "legion-rs plan --model vgg16 --batch 512 --machine paper --memory-gib 6 --search all",
        How::Run(&[
            ("--model", "alexnet"),
            ("--memory-gib", "1"),
            ("--refine-budget", "50"),
        ]),
    ),
    (
        "legion-rs plan --model alexnet --machine paper --search refine --refine-budget 1500 --refine-seed 1",
        How::Run(&[("--refine-budget", "50")]),
    ),
    (
        "legion-rs plan --model alexnet --batch 128 --nodes 2 --devices-per-node 2 --out alex.json --trace alex.trace.json",
        How::Run(&[]),
    ),
    (
        "legion-rs plan --model densenet121 --batch 8 --machine paper:4",
        How::Run(&[("--image-size", "32")]),
    ),
    (
        "legion-rs train --model lenet5 --devices 1 --steps 20 --device cuda",
        How::Cuda(&[("--steps", "2")]),
    ),
    (
        "legion-rs train --model alexnet --image-size 224 --batch 128 --devices 4 --strategy owt --device cuda",
        How::Cuda(&[("--image-size", "64"), ("--batch", "8"), ("--steps", "1")]),
    ),
    (
        "legion-rs profile --device cuda --model alexnet --image-size 224 --batch 128 --devices 4 --out h100.json",
        How::Cuda(&[
            ("--image-size", "64"),
            ("--batch", "8"),
            ("--warmup", "1"),
            ("--repeats", "1"),
        ]),
    ),
    (
        "legion-rs profile --device cuda --machine paper --strategies space --model vgg16 --batch 512 --merge --out paper-on-h100.json",
        How::Cuda(&[
            ("--model", "lenet5"),
            ("--batch", "32"),
            ("--time-limit", "20"),
        ]),
    ),
    (
        "legion-rs plan --model vgg16 --machine paper --profile paper-on-h100.json",
        How::AfterCuda("paper-on-h100.json", &[("--model", "lenet5")]),
    ),
    (
        "legion-rs plan --model alexnet --image-size 224 --batch 128 --machine one-gpu:4 --profile h100.json",
        How::AfterCuda("h100.json", &[("--image-size", "64"), ("--batch", "8")]),
    ),
    (
        "legion-rs train --model alexnet --image-size 224 --batch 128 --classes 1000 --steps 20 --tf32",
        How::Run(&[("--image-size", "64"), ("--batch", "4"), ("--steps", "1")]),
    ),
    (
        "legion-rs plan --model alexnet --machine paper:4 --search owt --precision bf16",
        How::Run(&[]),
    ),
    (
        "legion-rs train --model resnet50 --image-size 224 --batch 64 --classes 1000 --steps 20 --conv-algos precise",
        How::Run(&[("--image-size", "32"), ("--batch", "2"), ("--steps", "1")]),
    ),
    (
        "legion-rs train --model vgg16 --image-size 224 --batch 64 --classes 1000 --steps 20 --no-fused-epilogue",
        How::Run(&[("--image-size", "32"), ("--batch", "2"), ("--steps", "1")]),
    ),
    (
        "legion-rs train --model alexnet --image-size 224 --batch 128 --classes 1000 --steps 10 --json --trace one.json",
        How::Run(&[("--image-size", "64"), ("--batch", "4"), ("--steps", "1")]),
    ),
    (
        "legion-rs train --model my_model.json --steps 20",
        How::Run(&[("--steps", "2")]),
    ),
    (
        "legion-rs plan --model integration/onnx/resnet50.onnx --batch 64 --machine paper:4",
        How::Run(&[]),
    ),
    (
        "legion-rs train --model integration/onnx/alexnet.onnx --batch 16 --steps 5 --save alex-onnx.safetensors",
        How::Run(&[("--batch", "2"), ("--steps", "1")]),
    ),
    (
        "legion-rs export --onnx alexnet-trained.onnx --model integration/onnx/alexnet.onnx --init alex-onnx.safetensors",
        How::Run(&[]),
    ),
    (
        "legion-rs train --model alexnet-trained.onnx --batch 16 --steps 5",
        How::Run(&[("--batch", "2"), ("--steps", "1")]),
    ),
    ("legion-rs up examples/hosts.toml", How::Run(&[])),
    ("legion-rs status examples/hosts.toml", How::Run(&[])),
    (
        "legion-rs train --model alexnet --image-size 64 --batch 16 --steps 10 --cluster examples/hosts.toml",
        How::Run(&[("--batch", "8"), ("--steps", "1")]),
    ),
    (
        "cargo run --release -p legion-examples --bin alexnet -- --cluster examples/hosts.toml --steps 10",
        EXAMPLES,
    ),
    ("legion-rs down examples/hosts.toml", How::Run(&[])),
    ("legion-rs up --slurm", How::InSlurm),
    ("legion-rs status --slurm", How::InSlurm),
    (
        "legion-rs train --model alexnet --image-size 64 --batch 16 --steps 10 --slurm",
        How::InSlurm,
    ),
    ("legion-rs down --slurm", How::InSlurm),
    (
        "sbatch --nodes=4 examples/slurm/alexnet.sbatch",
        How::Elsewhere("cluster/cli/tests/slurm.rs submits it to a Slurm it starts"),
    ),
    (
        "legion-rs train --model my_model.json --batch 8 --steps 20 --lr 0.01",
        How::Run(&[]),
    ),
    (
        "legion-rs plan --model my_model.json --batch 8 --machine local-cpu:2 --evaluate --strategy tiny.strategy.json",
        How::Run(&[]),
    ),
    (
        "legion-rs train --model my_model.json --batch 8 --devices 2 --strategy tiny.strategy.json --steps 20 --lr 0.01",
        How::Run(&[]),
    ),
    (
        "legion-rs plan --model alexnet --batch 256 --machine two-boxes.toml",
        How::Run(&[]),
    ),
];

/// `args` with each flag of `set` given its value: replaced where `args` has the flag, added
/// where it does not.
fn with_flags(args: &[String], set: &[(&str, &str)]) -> Vec<String> {
    let mut args = args.to_vec();
    for (flag, value) in set {
        match args.iter().position(|a| a == flag) {
            Some(at) => args[at + 1] = value.to_string(),
            None => args.extend([flag.to_string(), value.to_string()]),
        }
    }
    args
}

/// The working directory the tour runs in: the documents' example files, the data their
/// commands name, and `examples/hosts.toml` on ports free now.
fn prepare(dir: &Path, text: &str) {
    for (name, body) in readme_files(text) {
        std::fs::write(dir.join(name), body).unwrap();
    }
    // CIFAR-10's binary format: a label byte and a 3×32×32 image per record.
    let cifar = dir.join("path/to/cifar-10-batches-bin");
    std::fs::create_dir_all(&cifar).unwrap();
    let records: Vec<u8> = (0..20u8)
        .flat_map(|i| std::iter::once(i % 10).chain((0..3072).map(move |p| (p as u8) ^ i)))
        .collect();
    std::fs::write(cifar.join("data_batch_1.bin"), records).unwrap();
    // Ten classes of images, as the tour's `--classes 10` says.
    for class in 0..10u8 {
        let folder = dir.join(format!("path/to/images/class{class}"));
        std::fs::create_dir_all(&folder).unwrap();
        image::RgbImage::from_pixel(12, 12, image::Rgb([class * 20, 100, 255 - class * 20]))
            .save(folder.join("a.png"))
            .unwrap();
    }
    let hosts = std::fs::read_to_string(root().join("examples/hosts.toml")).unwrap();
    let hosts: String = hosts
        .lines()
        .map(|l| match l.starts_with("port = ") {
            true => format!("port = {}\n", common::free_udp_port()),
            false => format!("{l}\n"),
        })
        .collect();
    // The graph-only ONNX exports of torchvision's models the documents name.
    let onnx = dir.join("integration/onnx");
    std::fs::create_dir_all(&onnx).unwrap();
    for model in ["alexnet", "resnet50"] {
        let name = format!("{model}.onnx");
        let from = root().join("integration/onnx").join(&name);
        std::fs::copy(from, onnx.join(name)).unwrap();
    }
    std::fs::create_dir_all(dir.join("examples")).unwrap();
    std::fs::write(dir.join("examples/hosts.toml"), hosts).unwrap();
}

/// Stops the tour's cluster however the test ends.
struct ClusterGuard {
    dir: PathBuf,
}

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        let _ = legion_in(&self.dir, &cluster_args("down"));
    }
}

fn cluster_args(command: &str) -> Vec<String> {
    [command, "examples/hosts.toml", "--state", "cluster-state"]
        .map(String::from)
        .to_vec()
}

fn legion_in(dir: &Path, args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("legion-rs runs")
}

fn describe(args: &[String], out: &Output) -> String {
    format!(
        "legion-rs {}: {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What the tour promises of `--json` output: JSON lines, the device line first.
fn check_json(args: &[String], out: &Output) {
    if !args.iter().any(|a| a == "--json") || args[0] != "train" {
        return;
    }
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    assert!(lines[0]["device"].is_string(), "{}", describe(args, out));
    assert_eq!(lines.last().unwrap()["summary"], true);
}

/// `commands` with each repeated one kept where it last appears.
fn last_occurrences(commands: &[String]) -> Vec<String> {
    commands
        .iter()
        .enumerate()
        .filter(|(at, c)| !commands[at + 1..].contains(c))
        .map(|(_, c)| c.clone())
        .collect()
}

/// Every document is read: `docs/` holds no Markdown file `DOCUMENTS` leaves out.
#[test]
fn the_tour_reads_every_document() {
    let docs = root().join("docs");
    for entry in std::fs::read_dir(&docs).unwrap_or_else(|e| panic!("{}: {e}", docs.display())) {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            let path = format!("docs/{name}");
            assert!(
                DOCUMENTS.contains(&path.as_str()),
                "{path} is not among the documents this test reads ({DOCUMENTS:?})"
            );
        }
    }
}

#[test]
fn every_readme_command_runs_at_a_small_size() {
    let text = documents();
    let commands = readme_commands(&text);
    let known: Vec<&str> = TOUR.iter().map(|(c, _)| *c).collect();
    let unknown: Vec<&String> = commands
        .iter()
        .filter(|c| !known.contains(&c.as_str()))
        .collect();
    let lost: Vec<&&str> = known
        .iter()
        .filter(|c| !commands.iter().any(|r| r == **c))
        .collect();
    assert!(
        unknown.is_empty() && lost.is_empty(),
        "commands of the README and docs/ the tour does not know: {unknown:#?}\ntour commands no \
         longer in the README or docs/: {lost:#?}"
    );
    assert_eq!(
        last_occurrences(&commands),
        known,
        "the tour runs the commands of the README and docs/ in their order, a repeated one where it \
         last appears (each of the README's \"Ten commands\" must be in docs/tour.md too)"
    );

    let dir = tempfile::tempdir().unwrap();
    prepare(dir.path(), &text);
    let _cluster = ClusterGuard {
        dir: dir.path().to_path_buf(),
    };
    for (command, how) in TOUR {
        let Some(rest) = command.strip_prefix("legion-rs ") else {
            let How::Elsewhere(why) = how else {
                panic!("{command}: the tour runs only legion-rs commands");
            };
            eprintln!("{command}: not run here: {why}");
            continue;
        };
        let mut args: Vec<String> = rest.split_whitespace().map(String::from).collect();
        // The cluster's state lives with the tour, not in the user's state directory.
        if args.iter().any(|a| a == "examples/hosts.toml") {
            args.extend(["--state".into(), "cluster-state".into()]);
        }
        match how {
            How::Elsewhere(_) => panic!("{command} is a legion-rs command"),
            How::Run(set) => {
                let args = with_flags(&args, set);
                let out = legion_in(dir.path(), &args);
                assert!(out.status.success(), "{}", describe(&args, &out));
                check_json(&args, &out);
            }
            How::Cuda(set) => {
                let args = with_flags(&args, set);
                let out = legion_in(dir.path(), &args);
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    out.status.success()
                        || (out.status.code() == Some(1) && err.contains("--device cuda: ")),
                    "{}",
                    describe(&args, &out)
                );
            }
            How::InSlurm => {
                let out = Command::new(env!("CARGO_BIN_EXE_legion-rs"))
                    .args(&args)
                    .current_dir(dir.path())
                    .env_remove("SLURM_JOB_ID")
                    .output()
                    .unwrap();
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    out.status.code() == Some(1)
                        && err.lines().count() == 1
                        && err.starts_with("error: not inside a Slurm allocation"),
                    "{}",
                    describe(&args, &out)
                );
            }
            How::AfterCuda(file, set) => {
                if !dir.path().join(file).exists() {
                    eprintln!("{command}: not run, {file} is written only on a GPU");
                    continue;
                }
                let args = with_flags(&args, set);
                let out = legion_in(dir.path(), &args);
                assert!(out.status.success(), "{}", describe(&args, &out));
            }
        }
    }
    // What the tour's commands wrote, where the tour says they write it.
    for file in [
        "alex.safetensors",
        "run.safetensors",
        "lenet.trace.json",
        "alex.profile.json",
        "alex.json",
        "alex.trace.json",
        "one.json",
    ] {
        assert!(dir.path().join(file).is_file(), "{file} was not written");
    }
}

/// The hosts-file examples of `docs/formats.md` parse, with the hosts and devices they show.
#[test]
fn the_readme_hosts_file_examples_parse() {
    let files = readme_files(&documents());
    let body = |name: &str| {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_str())
            .unwrap_or_else(|| panic!("no {name} example in the README or docs/"))
    };
    let toml =
        legion_cluster::hosts::Hosts::parse(body("hosts-example.toml"), "hosts-example.toml")
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(toml.hosts.len(), 3);
    assert_eq!(toml.num_devices(), 2 + 2 + 4);
    let hostfile =
        legion_cluster::hosts::Hosts::parse(body("hostfile-example"), "hostfile-example")
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(hostfile.hosts.len(), 3);
    assert_eq!(hostfile.num_devices(), 2 + 4 + 4);
    let slurm =
        legion_cluster::hosts::ClusterFile::parse(body("slurm-example.toml"), "slurm-example.toml")
            .unwrap_or_else(|e| panic!("{e}"));
    let legion_cluster::hosts::ClusterFile::Slurm(nodes) = slurm else {
        panic!("slurm-example.toml is not a [slurm] file: {slurm:?}");
    };
    assert_eq!((nodes.port, nodes.devices), (Some(7400), Some(2)));
}

/// The op table of `docs/formats.md` names every op a model file may use: those the parser lists
/// when it meets an op it does not know.
#[test]
fn the_readme_op_table_lists_every_op() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.json");
    std::fs::write(
        &model,
        r#"{"name":"m","layers":[{"name":"data","op":"input","shape":[2,3,8,8]},
           {"name":"x","op":"no_such_op","inputs":["data"]}]}"#,
    )
    .unwrap();
    let out = common::legion(&["train", "--model", model.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    let ops: BTreeSet<&str> = err
        .split_once("expected one of ")
        .map(|(_, list)| {
            list.split(", ")
                .filter_map(|op| op.split('`').nth(1))
                .collect()
        })
        .unwrap_or_else(|| panic!("no op list in {err}"));
    assert!(ops.len() >= 10, "{ops:?}");
    let text = documents();
    let table: String = text
        .lines()
        .skip_while(|l| !l.starts_with("| op |"))
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('|').nth(1).unwrap_or_default().to_string())
        .collect();
    for op in ops {
        assert!(
            table.contains(&format!("`{op}`")),
            "the op table of docs/formats.md lacks `{op}`"
        );
    }
}
