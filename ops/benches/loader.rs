//! The data loader on a folder of JPEGs, beside torchvision's best CPU pipeline in the same run:
//! decode, the training recipe (random resized crop, flip, normalisation) or the evaluation one
//! (resize, centre crop), batches of normalised f32, in images a second and per core.
//!
//! ```text
//! python3 integration/make_jpeg_folder.py --out /tmp/jpeg500
//! cargo bench -p legion-ops --bench loader -- --data /tmp/jpeg500 [--eval] [--epochs 4] \
//!     [--peer /tmp/torchenv/bin/python]
//! ```
//!
//! The first epoch of each is a warm-up (page cache, threads); the rate is over the later ones.
//! `--peer PYTHON` runs `integration/loader_peer.py --workers-sweep` with that interpreter and
//! prints the ratio of the two.

use legion_ops::data::{Data, Loader, LoaderConfig, Transforms};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

struct Args {
    data: PathBuf,
    eval: bool,
    epochs: u64,
    batch: usize,
    size: usize,
    peer: Option<String>,
}

fn args() -> Args {
    let mut args = Args {
        data: PathBuf::new(),
        eval: false,
        epochs: 4,
        batch: 64,
        size: 224,
        peer: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--data" => args.data = value().into(),
            "--eval" => args.eval = true,
            "--epochs" => args.epochs = value().parse().expect("--epochs N"),
            "--batch" => args.batch = value().parse().expect("--batch N"),
            "--size" => args.size = value().parse().expect("--size N"),
            "--peer" => args.peer = Some(value()),
            // cargo bench passes --bench
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        !args.data.as_os_str().is_empty(),
        "--data DIR is required (make one with integration/make_jpeg_folder.py)"
    );
    assert!(args.epochs >= 2, "--epochs: the first is a warm-up");
    args
}

fn main() {
    let args = args();
    let transforms = match args.eval {
        true => Transforms::EVAL,
        false => Transforms::TRAIN,
    };
    let dataset = Data::Folder(args.data.clone())
        .open([3, args.size, args.size], usize::MAX, 1, transforms)
        .expect("the image folder opens");
    let loader = Loader::new(dataset, LoaderConfig::new(args.batch)).expect("a loader");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut images = 0usize;
    let mut timed = 0.0f64;
    for epoch in 0..args.epochs {
        let started = Instant::now();
        let mut count = 0;
        for batch in loader.epoch(epoch) {
            count += batch.expect("a batch").len();
        }
        if epoch > 0 {
            images += count;
            timed += started.elapsed().as_secs_f64();
        }
    }
    let ours = images as f64 / timed;
    let pipeline = if args.eval { "eval" } else { "train" };
    println!(
        "legion-rs loader ({pipeline}, {}): {ours:.1} images/s, {:.1} per core ({cores} cores)",
        args.data.display(),
        ours / cores as f64
    );
    if let Some(python) = &args.peer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../integration/loader_peer.py");
        let mut peer = Command::new(python);
        peer.args([script, "--json", "--workers-sweep", "--data"])
            .arg(&args.data)
            .args(["--epochs", &args.epochs.to_string()])
            .args(["--batch", &args.batch.to_string()])
            .args(["--size", &args.size.to_string()]);
        if args.eval {
            peer.arg("--eval");
        }
        let output = peer.output().expect("the torchvision peer runs");
        assert!(
            output.status.success(),
            "the torchvision peer failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("the peer's JSON");
        let theirs = report["images_per_s"].as_f64().expect("images_per_s");
        println!(
            "torchvision {} ({} workers): {theirs:.1} images/s, {:.1} per core; legion-rs / torchvision = {:.2}",
            report["torchvision"].as_str().unwrap_or("?"),
            report["workers"],
            theirs / cores as f64,
            ours / theirs
        );
    }
}
