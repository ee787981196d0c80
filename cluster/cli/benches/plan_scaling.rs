//! `legion-rs plan --search optcnn` end to end (the real binary: model, tables, search, Eq. 1,
//! simulation, report) per model and machine size: wall time, CPU time and peak memory of the
//! process.
//!
//! ```text
//! cargo bench -p legion-cli --bench plan_scaling                     # every case
//! cargo bench -p legion-cli --bench plan_scaling -- vgg16 16 1024    # filters: models, devices
//! cargo bench -p legion-cli --bench plan_scaling -- --runs 3 --limit-s 120 --limit-gib 8
//! ```
//!
//! 16 devices is the `paper` preset (4 nodes of 4); larger machines are nodes of 16 devices given
//! by flags. Each case runs in a process of its own, stopped past `--limit-s` seconds or
//! `--limit-gib` GiB of address space (reported as such), so that one runaway case neither takes
//! the machine's memory nor hides the others. The row gives the run with the median wall time.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MODELS: [&str; 2] = ["vgg16", "inception_v3"];
const DEVICES: [usize; 3] = [16, 256, 1024];

struct Measured {
    wall_s: f64,
    cpu_s: f64,
    max_rss_mib: f64,
    /// Why the run did not finish, if it did not.
    failure: Option<String>,
}

fn main() {
    let mut filters = Vec::new();
    let (mut runs, mut limit_s, mut limit_gib) = (1usize, 300u64, 8u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match a.as_str() {
            "--runs" => runs = value("--runs").max(1) as usize,
            "--limit-s" => limit_s = value("--limit-s"),
            "--limit-gib" => limit_gib = value("--limit-gib"),
            "--bench" => {}
            _ => filters.push(a),
        }
    }
    let wanted = |name: &str, known: &[String]| {
        let relevant: Vec<&String> = filters.iter().filter(|f| known.contains(f)).collect();
        relevant.is_empty() || relevant.iter().any(|f| *f == name)
    };
    let models: Vec<String> = MODELS.iter().map(|m| m.to_string()).collect();
    let devices: Vec<String> = DEVICES.iter().map(|d| d.to_string()).collect();
    println!(
        "{:<13} {:>7} {:>10} {:>10} {:>12}",
        "model", "devices", "wall s", "cpu s", "max RSS MiB"
    );
    for d in DEVICES {
        if !wanted(&d.to_string(), &devices) {
            continue;
        }
        for m in MODELS {
            if !wanted(m, &models) {
                continue;
            }
            let mut results: Vec<Measured> = (0..runs)
                .map(|_| plan(m, d, Duration::from_secs(limit_s), limit_gib))
                .collect();
            results.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
            let r = &results[results.len() / 2];
            match &r.failure {
                None => println!(
                    "{m:<13} {d:>7} {:>10.3} {:>10.3} {:>12.1}",
                    r.wall_s, r.cpu_s, r.max_rss_mib
                ),
                Some(why) => println!(
                    "{m:<13} {d:>7} {:>10.3} {:>10.3} {:>12.1}  {why}",
                    r.wall_s, r.cpu_s, r.max_rss_mib
                ),
            }
        }
    }
}

/// One `plan` process for `model` on `devices` devices.
fn plan(model: &str, devices: usize, limit: Duration, limit_gib: u64) -> Measured {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_legion-rs"));
    cmd.args(["plan", "--model", model, "--search", "optcnn"]);
    if devices == 16 {
        cmd.args(["--machine", "paper"]);
    } else {
        let nodes = (devices / 16).to_string();
        cmd.args(["--nodes", &nodes, "--devices-per-node", "16"]);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let bytes = limit_gib << 30;
    // SAFETY: setrlimit is async-signal-safe and touches nothing of the parent's.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            let cap = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            libc::setrlimit(libc::RLIMIT_AS, &cap);
            Ok(())
        });
    }
    let started = Instant::now();
    // reaped by `wait4` below, which also gives its CPU time and peak memory
    #[allow(clippy::zombie_processes)]
    let child = cmd.spawn().expect("legion-rs starts");
    let pid = child.id() as libc::pid_t;
    // the watchdog stops the run at the time limit
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished.recv_timeout(limit).is_err() {
            // SAFETY: the child is not reaped until `wait4` below returns, so the pid is its own.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return true;
        }
        false
    });
    let mut status = 0;
    // SAFETY: plain FFI out-parameters.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::wait4(pid, &mut status, 0, &mut usage);
        usage
    };
    let wall_s = started.elapsed().as_secs_f64();
    let _ = done.send(());
    let timed_out = watchdog.join().unwrap_or(false);
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    let failure = if timed_out {
        Some(format!("stopped at the {} s limit", limit.as_secs()))
    } else if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr {
            let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
        }
        // the first line says why (an allocation refused at the limit, an error); a backtrace
        // note may follow
        let first = stderr.lines().next().unwrap_or("").to_string();
        Some(format!(
            "failed (limit {limit_gib} GiB of address space): {first}"
        ))
    } else {
        None
    };
    Measured {
        wall_s,
        cpu_s: seconds(usage.ru_utime) + seconds(usage.ru_stime),
        max_rss_mib: usage.ru_maxrss as f64 / 1024.0,
        failure,
    }
}
