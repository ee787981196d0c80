//! Where a device's kernels run: the cores of this process, handed out to its devices.
//!
//! With at least one core per device, each device gets its own rayon pool of its share of the
//! cores, and a kernel splits its work across that pool's threads. With more devices than cores
//! (the embedded cluster on a small machine), one single-threaded worker per core serves every
//! device: a worker takes the kernel that became ready first and runs it to its end. The OS then
//! never time-slices one device's kernel against another's, which keeps each kernel's time its own
//! and makes the cores behave as the planner's simulator schedules them (`simulate::schedule`:
//! first ready, first served, each kernel to its end).
//!
//! Each shared worker is kept on a CPU of its own. Left free, two workers were often queued on one
//! CPU, taking turns, while the other CPU idled: the OS is slow to move a thread that ran a moment
//! ago (`git log -p BENCHMARKS.md`, "Runtime: predicted vs measured", fifteenth session).

use crate::cpu_share::POOL_THREAD_PREFIX;
use std::sync::Arc;

type Job = Box<dyn FnOnce() + Send>;

/// A device's handle on the cores it runs kernels on.
#[derive(Clone)]
pub enum ComputePool {
    /// The device's own pool; its kernels split across the pool's threads.
    Own(Arc<rayon::ThreadPool>),
    /// Workers shared by every device of the process, one kernel each at a time.
    Shared(crossbeam_channel::Sender<Job>),
}

impl ComputePool {
    /// The pools of `devices` devices sharing `cores` cores.
    pub fn for_devices(devices: usize, cores: usize) -> Vec<ComputePool> {
        let cores = cores.max(1);
        if shares_workers(devices, cores) {
            let queue = shared_workers(cores);
            return (0..devices)
                .map(|_| ComputePool::Shared(queue.clone()))
                .collect();
        }
        let threads = kernel_threads(devices, cores);
        (0..devices)
            .map(|d| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("{POOL_THREAD_PREFIX}{d}-{i}"))
                    .build()
                    .expect("a device's compute pool");
                ComputePool::Own(Arc::new(pool))
            })
            .collect()
    }

    /// Runs `job` on these cores, eventually.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        match self {
            ComputePool::Own(pool) => pool.spawn(job),
            ComputePool::Shared(queue) => queue
                .send(Box::new(job))
                .expect("the shared workers live as long as a device holds their queue"),
        }
    }
}

/// Whether `devices` devices on `cores` cores run their kernels on workers they share, one kernel
/// per worker at a time, rather than each on a pool of its own.
pub fn shares_workers(devices: usize, cores: usize) -> bool {
    devices > cores.max(1)
}

/// Threads a kernel splits its work across when `devices` devices share `cores` cores.
pub fn kernel_threads(devices: usize, cores: usize) -> usize {
    (cores / devices.max(1)).max(1)
}

/// Starts `cores` workers, each on its own CPU, that run jobs from one queue in the order sent;
/// they stop when the last sender is dropped.
fn shared_workers(cores: usize) -> crossbeam_channel::Sender<Job> {
    let (sender, receiver) = crossbeam_channel::unbounded::<Job>();
    // Pinned only where the process may use a CPU for each worker: fewer would crowd them.
    let cpus = allowed_cpus().filter(|cpus| cpus.len() >= cores);
    for core in 0..cores {
        let receiver = receiver.clone();
        let cpu = cpus.as_ref().map(|cpus| cpus[core]);
        std::thread::Builder::new()
            .name(format!("{POOL_THREAD_PREFIX}{core}"))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    pin_to(cpu);
                }
                // A one-thread rayon pool made of this very thread: the kernels' parallel
                // iterators run serially here instead of reaching the global pool.
                let serial = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .use_current_thread()
                    .build()
                    .expect("a worker's serial pool");
                while let Ok(job) = receiver.recv() {
                    job();
                }
                drop(serial);
            })
            .expect("a shared compute worker");
    }
    sender
}

/// The CPUs this process may run on, in increasing order; `None` where the OS does not say.
fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set, and the call writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let read =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    (read == 0).then(|| {
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
            .collect()
    })
}

/// Keeps the calling thread on `cpu`. Should the OS refuse, the thread runs where it places it,
/// which is correct, only slower.
fn pin_to(cpu: usize) {
    // SAFETY: as in `allowed_cpus`; thread 0 is the calling thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::mpsc;

    #[test]
    fn more_devices_than_cores_share_one_worker_per_core_that_runs_kernels_serially() {
        let pools = ComputePool::for_devices(4, 2);
        assert!(pools.iter().all(|p| matches!(p, ComputePool::Shared(_))));
        let (done, finished) = mpsc::channel();
        let running = Arc::new(Mutex::new((0usize, 0usize)));
        for (d, pool) in pools.iter().enumerate() {
            for k in 0..8 {
                let (done, running) = (done.clone(), Arc::clone(&running));
                pool.spawn(move || {
                    {
                        let mut r = running.lock().unwrap();
                        r.0 += 1;
                        r.1 = r.1.max(r.0);
                    }
                    let threads = rayon::current_num_threads();
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    running.lock().unwrap().0 -= 1;
                    done.send((d, k, threads)).unwrap();
                });
            }
        }
        drop(done);
        let results: Vec<_> = finished.iter().collect();
        assert_eq!(results.len(), 32);
        assert!(results.iter().all(|&(_, _, threads)| threads == 1));
        let most_at_once = running.lock().unwrap().1;
        assert!(
            most_at_once <= 2,
            "{most_at_once} kernels ran at once on 2 cores"
        );
    }

    #[test]
    fn shared_workers_take_kernels_in_the_order_they_were_sent() {
        let pools = ComputePool::for_devices(3, 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (done, finished) = mpsc::channel();
        for i in 0..30 {
            let (order, done) = (Arc::clone(&order), done.clone());
            pools[i % 3].spawn(move || {
                order.lock().unwrap().push(i);
                done.send(()).unwrap();
            });
        }
        drop(done);
        assert_eq!(finished.iter().count(), 30);
        assert_eq!(*order.lock().unwrap(), (0..30).collect::<Vec<_>>());
    }

    #[test]
    fn shared_workers_exit_once_every_device_has_let_go_of_them() {
        let pools = ComputePool::for_devices(2, 1);
        let (done, worker) = mpsc::channel();
        pools[0].spawn(move || done.send(unsafe { libc::gettid() }).unwrap());
        let task = format!("/proc/self/task/{}", worker.recv().unwrap());
        assert!(std::path::Path::new(&task).exists());
        drop(pools);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::path::Path::new(&task).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the worker outlived its devices"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn shared_workers_are_kept_each_on_a_cpu_of_its_own() {
        let Some(allowed) = allowed_cpus().filter(|cpus| cpus.len() >= 2) else {
            return; // one CPU: nothing to spread the workers over
        };
        let pools = ComputePool::for_devices(3, 2);
        // Two jobs that wait for each other run on both workers at once.
        let both = Arc::new(std::sync::Barrier::new(2));
        let (done, cpus) = mpsc::channel();
        for pool in &pools[..2] {
            let (both, done) = (Arc::clone(&both), done.clone());
            pool.spawn(move || {
                both.wait();
                done.send(allowed_cpus().unwrap()).unwrap();
            });
        }
        drop(done);
        let mut cpus: Vec<Vec<usize>> = cpus.iter().collect();
        cpus.sort();
        assert_eq!(cpus, vec![vec![allowed[0]], vec![allowed[1]]]);
    }

    #[test]
    fn a_device_per_share_of_the_cores_gets_a_pool_of_that_many_threads() {
        let pools = ComputePool::for_devices(2, 4);
        for pool in &pools {
            let ComputePool::Own(pool) = pool else {
                panic!("two devices on four cores share nothing");
            };
            assert_eq!(pool.current_num_threads(), 2);
        }
        assert_eq!(kernel_threads(2, 4), 2);
        assert_eq!(kernel_threads(4, 2), 1);
    }
}
