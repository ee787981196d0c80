//! Refusing a run that cannot fit in this host's memory before anything is allocated: a model too
//! large otherwise ends in an allocation failure that aborts the process.

use legion_ops::Graph;
use legion_ops::memory::{self, DeviceMemory};
use legion_ops::partition::ParallelConfig;

pub use legion_ops::memory::human_bytes;

/// Bytes this process can still allocate: the kernel's estimate of available memory
/// (`MemAvailable`), lowered to what the cgroup's limit leaves. `None` where neither can be read.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let host = meminfo.as_deref().and_then(mem_available);
    let cgroup_file = |name: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{name}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    // `memory.max` reads "max" when unlimited, which does not parse
    let cgroup = cgroup_file("memory.max")
        .map(|limit| limit.saturating_sub(cgroup_file("memory.current").unwrap_or(0)));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a run on this host before anything is allocated: `embedded` devices of this process
/// under their configs (none where the devices are a cluster's workers, which check their own
/// share), beside the job's own weights and momentum. Passes where the host's memory cannot be read.
pub fn check_this_host(
    graph: &Graph,
    embedded: Option<(&[ParallelConfig], usize)>,
) -> anyhow::Result<()> {
    let Some(available) = available() else {
        return Ok(());
    };
    let (devices, place) = match embedded {
        Some((configs, devices)) => (
            memory::per_device(graph, configs, devices),
            format!("{devices} device(s) in this process"),
        ),
        None => (
            Vec::new(),
            "no devices (they run on the workers)".to_string(),
        ),
    };
    let need = HostNeed {
        devices: &devices,
        job_state: memory::job_state_bytes(graph),
        place,
    };
    check_fits(graph, &need, available)
}

/// What a run keeps on this host: the devices placed here and the job's own copy of the state.
pub(crate) struct HostNeed<'a> {
    /// The devices running on this host, as `legion_ops::memory::per_device` gives them.
    pub devices: &'a [DeviceMemory],
    /// Bytes the process holds besides the devices (the job's weights and momentum).
    pub job_state: u64,
    /// What the devices are, for the message: "4 embedded devices", "worker w1's 2 devices".
    pub place: String,
}

impl HostNeed<'_> {
    pub fn bytes(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.bytes)
            .fold(self.job_state, u64::saturating_add)
    }
}

/// An error naming the largest layer, the bytes needed and the bytes available if `need` does not
/// fit in `available` bytes.
pub(crate) fn check_fits(graph: &Graph, need: &HostNeed, available: u64) -> anyhow::Result<()> {
    let total = need.bytes();
    if total <= available {
        return Ok(());
    }
    let mut parts = format!("{}: {}", need.place, human_bytes(total - need.job_state));
    if need.job_state > 0 {
        parts += &format!(
            "; the job's weights and momentum: {}",
            human_bytes(need.job_state)
        );
    }
    let mut message = format!(
        "model '{}' does not fit in memory: the run needs {} ({parts}), but this host has {} \
         available",
        graph.name,
        human_bytes(total),
        human_bytes(available)
    );
    let largest = need
        .devices
        .iter()
        .filter_map(|d| {
            d.largest_layer
                .map(|(layer, bytes)| (d.device, layer, bytes))
        })
        .max_by_key(|&(_, _, bytes)| bytes);
    if let Some((device, layer, bytes)) = largest {
        message += &format!(
            "; layer '{}' ({}) alone needs {} on device {device} for its output, parameters, \
             gradients and momentum",
            graph.layer(layer).name,
            graph.layer(layer).op.kind(),
            human_bytes(bytes)
        );
    }
    message += ". Use a smaller batch or image size, or more devices";
    anyhow::bail!(message)
}

/// Bytes each GPU must hold for `devices` (a worker's devices, in order) placed on GPUs
/// `ordinals` as the runtime places them (`gpu_of`): one entry per physical GPU, in first-use
/// order, so a GPU listed twice (logical GPUs of one device) holds both shares.
pub(crate) fn per_gpu(devices: &[DeviceMemory], ordinals: &[usize]) -> Vec<(usize, u64)> {
    let mut needs: Vec<(usize, u64)> = Vec::new();
    for (d, device) in devices.iter().enumerate() {
        let ordinal = ordinals[legion_ops::partition::gpu_of(d, devices.len(), ordinals.len())];
        match needs.iter_mut().find(|(o, _)| *o == ordinal) {
            Some((_, bytes)) => *bytes = bytes.saturating_add(device.bytes),
            None => needs.push((ordinal, device.bytes)),
        }
    }
    needs
}

/// Refuses a GPU worker's devices that its GPUs cannot hold now: each GPU's free memory
/// (`free_bytes` of its ordinal, after what other processes sharing it hold) must take what the
/// devices placed on it need, or the run would end in an allocation failure mid-step.
pub(crate) fn check_gpus_free(
    graph: &Graph,
    devices: &[DeviceMemory],
    ordinals: &[usize],
    place: &str,
    free_bytes: impl Fn(usize) -> anyhow::Result<u64>,
) -> anyhow::Result<()> {
    for (ordinal, bytes) in per_gpu(devices, ordinals) {
        let free = free_bytes(ordinal)?;
        if bytes > free {
            anyhow::bail!(
                "model '{}' does not fit on GPU {ordinal}: {place} need {} of GPU memory, and it \
                 has {} free. Use a smaller batch or image size, or more devices",
                graph.name,
                human_bytes(bytes),
                human_bytes(free)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_worker_is_held_to_each_gpus_free_memory() {
        let mut m = GraphBuilder::new("wide");
        let x = m.input("data", Shape::nc(8, 4)).unwrap();
        m.dense("fc", x, Dense::new(16)).unwrap();
        let g = m.finish();
        let device = |device, gib: u64| DeviceMemory {
            device,
            bytes: gib << 30,
            largest_layer: None,
        };
        let devices = [device(4, 1), device(5, 2), device(6, 3), device(7, 4)];
        // two devices per GPU; GPU 0 listed twice holds all four
        assert_eq!(per_gpu(&devices, &[0, 1]), vec![(0, 3 << 30), (1, 7 << 30)]);
        assert_eq!(per_gpu(&devices, &[0, 0]), vec![(0, 10 << 30)]);
        let free = |gib: u64| move |_: usize| Ok::<u64, anyhow::Error>(gib << 30);
        assert!(check_gpus_free(&g, &devices, &[0, 0], "w1's 4 devices", free(10)).is_ok());
        let e = check_gpus_free(&g, &devices, &[0, 0], "w1's 4 devices", free(9))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "does not fit on GPU 0: w1's 4 devices need 10.00 GiB of GPU memory, and it has \
                 9.00 GiB free."
            ),
            "{e}"
        );
        let e = check_gpus_free(&g, &devices, &[0, 1], "w1's 4 devices", |o| {
            Ok(if o == 0 { 3 << 30 } else { 6 << 30 })
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("GPU 1"), "{e}");
    }
    use legion_ops::op::Dense;
    use legion_ops::{GraphBuilder, LayerId, Shape};

    #[test]
    fn mem_available_reads_kib() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20480000 kB\n";
        assert_eq!(mem_available(text), Some(20480000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn this_host_reports_some_memory() {
        assert!(available().is_some_and(|b| b > 0));
    }

    #[test]
    fn a_run_too_large_names_the_layer_and_both_sizes() {
        let mut m = GraphBuilder::new("wide");
        let x = m.input("data", Shape::nc(8, 4)).unwrap();
        m.dense("fc", x, Dense::new(16)).unwrap();
        let g = m.finish();
        let devices = [DeviceMemory {
            device: 0,
            bytes: 3 << 30,
            largest_layer: Some((LayerId(1), 2 << 30)),
        }];
        let need = HostNeed {
            devices: &devices,
            job_state: 1 << 30,
            place: "1 embedded device".into(),
        };
        assert!(check_fits(&g, &need, 4 << 30).is_ok());
        let e = check_fits(&g, &need, (4 << 30) - 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the run needs 4.00 GiB"), "{e}");
        assert!(e.contains("1 embedded device: 3.00 GiB"), "{e}");
        assert!(
            e.contains("layer 'fc' (dense) alone needs 2.00 GiB on device 0"),
            "{e}"
        );
        assert!(e.contains("but this host has 4.00 GiB available"), "{e}");
    }
}
