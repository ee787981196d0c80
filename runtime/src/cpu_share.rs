//! How long a task would have taken with the machine to itself, from when it ran beside others;
//! and how much CPU the runtime's own threads used.
//!
//! The embedded cluster's devices run kernels on pool threads that share the cores (see
//! `compute`), and the device actors copy on threads of their own: when more threads have work
//! than there are cores, the OS shares the cores out and every task's wall time stretches. The
//! profiler wants each task's own cost. Over each stretch of time where the same tasks run, the
//! cores are divided among them the way a fair scheduler does it: an equal share each, but no task
//! more than the threads it can use, what one leaves going to the others (water-filling). A task's
//! own time is the sum, over its span, of the share it got divided by the share it would have got
//! alone.

/// One task's span of wall-clock time and how many threads it can keep busy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuSpan {
    pub start: f64,
    pub end: f64,
    pub threads: usize,
}

/// For each span, the seconds its task would have needed with `cores` cores and nothing else
/// running: at most its wall time, and exactly that when the cores were never over-subscribed.
pub fn alone_seconds(spans: &[CpuSpan], cores: usize) -> Vec<f64> {
    let cores = cores.max(1) as f64;
    // +1 where a span starts, −1 where it ends; ends first at equal times.
    let mut edges: Vec<(f64, bool, usize)> = Vec::with_capacity(2 * spans.len());
    for (i, s) in spans.iter().enumerate() {
        if s.end > s.start {
            edges.push((s.start, true, i));
            edges.push((s.end, false, i));
        }
    }
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut alone = vec![0.0; spans.len()];
    // Running spans, kept sorted by threads so the water-filling takes the smallest first.
    let mut running: Vec<usize> = Vec::new();
    let mut last = f64::NEG_INFINITY;
    for (t, starts, i) in edges {
        let dt = t - last;
        if dt > 0.0 && !running.is_empty() {
            let mut left = cores;
            for (k, &r) in running.iter().enumerate() {
                let want = spans[r].threads.max(1) as f64;
                let got = want.min(left / (running.len() - k) as f64);
                left -= got;
                alone[r] += dt * got / want.min(cores);
            }
        }
        last = t;
        if starts {
            let at = running.partition_point(|&r| spans[r].threads <= spans[i].threads);
            running.insert(at, i);
        } else if let Some(at) = running.iter().position(|&r| r == i) {
            running.remove(at);
        }
    }
    alone
}

/// The CPU a traced step used: the whole process's, and, where the OS tells it by thread, the
/// device actors' threads' and the compute pools' threads' apart (see `profile`, "runtime CPU").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCpu {
    pub process_s: f64,
    pub threads: Option<RuntimeThreadsCpu>,
}

/// CPU seconds of the runtime's threads, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RuntimeThreadsCpu {
    /// The device actors' runtime (`ACTOR_THREAD_NAME`).
    pub actors_s: f64,
    /// The devices' compute pools (`POOL_THREAD_PREFIX`).
    pub pools_s: f64,
}

/// The name of the threads the device actors run on (`embedded::device_runtime`).
pub const ACTOR_THREAD_NAME: &str = "legion-device";
/// The start of the names of the devices' compute-pool threads (`compute::ComputePool`).
pub const POOL_THREAD_PREFIX: &str = "legion-pool";

/// This process's actor and pool threads (of every cluster in it): (thread id, kind, seconds on a
/// CPU so far), from each thread's scheduler statistics (`/proc/self/task/*/schedstat`), in
/// thread-id order; `None` where the OS does not keep them. A thread that exits while they are
/// read is left out.
fn runtime_threads() -> Option<Vec<(u64, RuntimeThread, f64)>> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let Ok(name) = std::fs::read_to_string(task.path().join("comm")) else {
            continue;
        };
        let Some(kind) = RuntimeThread::named(name.trim_end()) else {
            continue;
        };
        match on_cpu_s(&task.path()) {
            Some(seconds) => threads.push((tid, kind, seconds)),
            None if !task.path().exists() => continue,
            None => return None,
        }
    }
    threads.sort_by_key(|&(tid, _, _)| tid);
    Some(threads)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RuntimeThread {
    Actor,
    Pool,
}

impl RuntimeThread {
    fn named(name: &str) -> Option<RuntimeThread> {
        if name == ACTOR_THREAD_NAME {
            Some(RuntimeThread::Actor)
        } else if name.starts_with(POOL_THREAD_PREFIX) {
            Some(RuntimeThread::Pool)
        } else {
            None
        }
    }
}

/// Seconds the thread at `/proc/.../task/TID` (or `/proc/thread-self`) has been on a CPU: the
/// first field of its `schedstat`, in nanoseconds.
fn on_cpu_s(task: &std::path::Path) -> Option<f64> {
    let stat = std::fs::read_to_string(task.join("schedstat")).ok()?;
    let nanos: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(nanos as f64 * 1e-9)
}

/// Measures [`StepCpu`] from [`CpuMeter::start`] to [`CpuMeter::stop`]. Only threads alive at both
/// ends count, so another cluster's threads exiting meanwhile take nothing off. Each end reads two
/// files per thread: start it before and stop it after the timed region.
pub struct CpuMeter {
    process_s: f64,
    threads: Option<Vec<(u64, RuntimeThread, f64)>>,
}

impl CpuMeter {
    pub fn start() -> CpuMeter {
        CpuMeter {
            threads: runtime_threads(),
            process_s: process_cpu_s(),
        }
    }

    pub fn stop(self) -> StepCpu {
        let process_s = process_cpu_s() - self.process_s;
        let threads = self.threads.zip(runtime_threads()).map(|(before, after)| {
            let mut cpu = RuntimeThreadsCpu::default();
            for (tid, kind, seconds) in after {
                let Ok(i) = before.binary_search_by_key(&tid, |&(t, _, _)| t) else {
                    continue;
                };
                let used = seconds - before[i].2;
                if used < 0.0 {
                    continue; // the id of a thread that exited, reused by a new one
                }
                match kind {
                    RuntimeThread::Actor => cpu.actors_s += used,
                    RuntimeThread::Pool => cpu.pools_s += used,
                }
            }
            cpu
        });
        StepCpu { process_s, threads }
    }
}

/// CPU seconds this process's threads have used so far (user and system), to the nanosecond.
pub fn process_cpu_s() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; CLOCK_PROCESS_CPUTIME_ID exists on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start: f64, end: f64, threads: usize) -> CpuSpan {
        CpuSpan {
            start,
            end,
            threads,
        }
    }

    /// Spins until `clock` (CPU seconds) has grown by `seconds`; fails after 30 s of wall time.
    fn spin_until(clock: impl Fn() -> f64, seconds: f64) {
        let before = clock();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while clock() - before < seconds {
            x = std::hint::black_box(x.wrapping_add(1));
            assert!(
                t.elapsed().as_secs() < 30,
                "{seconds} s of CPU not seen in 30 s of spinning"
            );
        }
    }

    #[test]
    fn process_cpu_time_grows_with_work() {
        // Other tests' threads share the process, so only growth under our own work is certain.
        spin_until(process_cpu_s, 0.01);
    }

    #[test]
    fn runtime_threads_are_told_apart_by_name() {
        assert_eq!(
            RuntimeThread::named("legion-device"),
            Some(RuntimeThread::Actor)
        );
        assert_eq!(
            RuntimeThread::named("legion-pool0-0"),
            Some(RuntimeThread::Pool)
        );
        assert_eq!(
            RuntimeThread::named("legion-pool12-1"),
            Some(RuntimeThread::Pool)
        );
        assert_eq!(RuntimeThread::named("legion-net"), None);
        assert_eq!(RuntimeThread::named("main"), None);
    }

    #[test]
    fn a_threads_cpu_time_grows_with_its_work() {
        let me = std::path::Path::new("/proc/thread-self");
        if on_cpu_s(me).is_none() {
            return; // this OS keeps no per-thread scheduler statistics
        }
        spin_until(|| on_cpu_s(me).unwrap(), 0.01);
        assert!(runtime_threads().is_some());
    }

    #[test]
    fn the_meter_counts_a_pool_threads_cpu_between_start_and_stop() {
        if runtime_threads().is_none() {
            return; // this OS keeps no per-thread scheduler statistics
        }
        let (started, spin) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        let (spun, exit) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name(format!("{POOL_THREAD_PREFIX}-test"))
                .spawn_scoped(scope, || {
                    started.wait();
                    spin.wait();
                    let me = std::path::Path::new("/proc/thread-self");
                    spin_until(|| on_cpu_s(me).unwrap(), 0.02);
                    spun.wait();
                    exit.wait();
                })
                .unwrap();
            started.wait();
            let meter = CpuMeter::start();
            spin.wait();
            spun.wait();
            let cpu = meter.stop();
            exit.wait();
            // Other tests' runtime threads can only add to it.
            let threads = cpu.threads.expect("per-thread statistics");
            assert!(threads.pools_s >= 0.02, "{cpu:?}");
            assert!(cpu.process_s >= 0.02, "{cpu:?}");
        });
    }

    #[test]
    fn a_task_alone_or_within_the_cores_keeps_its_wall_time() {
        assert_eq!(alone_seconds(&[span(1.0, 3.0, 1)], 2), vec![2.0]);
        assert_eq!(
            alone_seconds(&[span(0.0, 2.0, 1), span(1.0, 4.0, 1)], 2),
            vec![2.0, 3.0]
        );
        // a task that can use more threads than there are cores gets them all
        assert_eq!(alone_seconds(&[span(0.0, 1.0, 8)], 2), vec![1.0]);
    }

    #[test]
    fn over_subscribed_cores_are_shared_equally() {
        // four single-threaded tasks on two cores for 2 s: each had half a core
        let spans = [span(0.0, 2.0, 1); 4];
        assert_eq!(alone_seconds(&spans, 2), vec![1.0; 4]);
        // three on two cores: 2/3 of a core each while all three run, then the last alone
        let a = alone_seconds(
            &[span(0.0, 3.0, 1), span(0.0, 3.0, 1), span(0.0, 4.0, 1)],
            2,
        );
        let expected = [2.0, 2.0, 3.0];
        for (a, e) in a.iter().zip(expected) {
            assert!((a - e).abs() < 1e-12, "{a} vs {e}");
        }
    }

    #[test]
    fn narrow_tasks_leave_their_unused_share_to_wide_ones() {
        // on 4 cores, a 1-thread copy beside a 4-thread kernel: the copy takes 1 core (its fair
        // share would be 2), the kernel the other 3 of the 4 it would have had alone
        let a = alone_seconds(&[span(0.0, 4.0, 1), span(0.0, 4.0, 4)], 4);
        assert_eq!(a, vec![4.0, 3.0]);
        // two 2-thread kernels on 2 cores: each ran at half its speed alone
        let a = alone_seconds(&[span(0.0, 2.0, 2), span(0.0, 2.0, 2)], 2);
        assert_eq!(a, vec![1.0, 1.0]);
    }

    #[test]
    fn empty_and_zero_length_spans_cost_nothing() {
        assert!(alone_seconds(&[], 2).is_empty());
        assert_eq!(
            alone_seconds(&[span(1.0, 1.0, 1), span(0.0, 1.0, 1)], 1),
            vec![0.0, 1.0]
        );
    }
}
