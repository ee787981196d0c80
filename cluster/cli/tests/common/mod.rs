//! Helpers shared by the integration tests that run the `legion-rs` binary.
#![allow(dead_code)]

use legion_ops::checkpoint::NamedTensor;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// A finished process's standard error, as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A UDP port on loopback that nothing is bound to now (a worker's QUIC port).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A TCP port on loopback that nothing listens on now (an sshd's or a Slurm daemon's).
pub fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Once `run` (a training run that saves `checkpoint` every few steps) has written its first
/// checkpoint, kills process `worker` with SIGKILL: how the run ended, how long after the kill,
/// and its stderr. Fails if the run ends first or writes nothing within `patience`.
pub fn kill_worker_mid_run(
    run: &mut Child,
    checkpoint: &Path,
    patience: Duration,
    worker: u32,
) -> (ExitStatus, Duration, String) {
    signal_workers_mid_run(run, checkpoint, patience, &[(worker, libc::SIGKILL)])
}

/// [`kill_worker_mid_run`] with each of `faults` (a pid and the signal it gets: `SIGKILL`, or
/// `SIGSTOP` for a worker that hangs) at once.
pub fn signal_workers_mid_run(
    run: &mut Child,
    checkpoint: &Path,
    patience: Duration,
    faults: &[(u32, libc::c_int)],
) -> (ExitStatus, Duration, String) {
    let deadline = Instant::now() + patience;
    while !checkpoint.exists() {
        assert!(Instant::now() < deadline, "no checkpoint written");
        assert!(
            run.try_wait().unwrap().is_none(),
            "training ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for &(worker, signal) in faults {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(worker as i32, signal) };
    }
    let killed = Instant::now();
    let status = run.wait().unwrap();
    let noticed = killed.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut stderr).unwrap();
    eprintln!(
        "the driver stopped {noticed:?} after the kill: {}",
        stderr.trim()
    );
    (status, noticed, stderr)
}

/// AlexNet at 64×64, 10 classes, batch 8: the model of the distributed-equality tests.
pub const ALEXNET_64: [&str; 8] = [
    "--model",
    "alexnet",
    "--image-size",
    "64",
    "--classes",
    "10",
    "--batch",
    "8",
];

pub fn legion(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .output()
        .expect("legion-rs runs")
}

/// The command failed cleanly: exit 1, an `error:` line containing every one of `needles`, and no
/// panic.
pub fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(err.contains("error:"), "no error line: {err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks '{needle}': {err}");
    }
}

pub fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "legion-rs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every tensor of checkpoint `a` equals `b`'s within relative error 1e-4 (of the tensor's largest
/// magnitude).
pub fn assert_same_tensors(a: &Path, b: &Path) {
    let a = legion_ops::checkpoint::load(a).unwrap();
    let b = legion_ops::checkpoint::load(b).unwrap();
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        let d = difference(x, y);
        assert!(d <= 1e-4, "{} differs by {d:e}", x.name);
    }
}

/// The largest difference between two tensors of one name, relative to the largest magnitude of
/// `y`'s.
pub fn difference(x: &NamedTensor, y: &NamedTensor) -> f32 {
    assert_eq!(x.name, y.name);
    let scale = y.data.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    let diff = x
        .data
        .iter()
        .zip(&y.data)
        .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    diff / scale
}

/// The largest [`difference`] between two checkpoints' tensors (weights and momentum).
pub fn largest_difference(a: &[NamedTensor], b: &[NamedTensor]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| difference(x, y))
        .fold(0.0, f32::max)
}

/// `legion-rs train MODEL --steps 0 --save PATH`: the seeded initial weights as a checkpoint.
pub fn init_checkpoint(path: &Path, model: &[&str]) {
    let mut args = vec!["train"];
    args.extend(model);
    args.extend(["--steps", "0", "--save", path.to_str().unwrap()]);
    ok(legion(&args));
}

/// Trains `model` for `steps` from the weights in `init` and saves them to `out`; `engine` are the
/// flags that say where (`--devices 2`, `--cluster HOSTS --state DIR`, none: one device).
/// The run is on the CPU (`--device cpu`) so that a one-device reference stays the CPU reference
/// on a machine with a GPU too.
pub fn train_from(engine: &[&str], model: &[&str], steps: &str, init: &Path, out: &Path) -> Output {
    let mut args = vec!["train", "--device", "cpu"];
    args.extend(engine);
    args.extend(model);
    args.extend([
        "--steps",
        steps,
        "--init",
        init.to_str().unwrap(),
        "--save",
        out.to_str().unwrap(),
    ]);
    ok(legion(&args))
}
