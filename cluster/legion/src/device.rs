//! Which kind of device a run trains on: `--device auto|cpu|cuda` against what the CUDA probe
//! found and the shape of the run. The decision is a pure function ([`choose`]), tested without
//! a GPU; the job starts the engine it names.

use legion_cluster::memory::human_bytes;
use legion_cuda::{Cuda, CudaDevice, Math, ProbeError, Settings, Stream};
use legion_ops::Graph;
use legion_ops::memory;
use legion_ops::partition::ParallelConfig;
use std::fmt;

/// The `--device` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    /// A GPU where the run can use one, otherwise the CPU, saying which and why.
    #[default]
    Auto,
    Cpu,
    /// A GPU or an error naming what is missing: never a silent CPU run.
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Auto => "auto",
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Where the run's steps go.
#[derive(Clone, Debug, PartialEq)]
pub enum Chosen {
    Cpu,
    /// These GPUs, in the order devices are spread over them (see `Placement::gpu_of`).
    Cuda(Vec<CudaDevice>),
}

/// The choice, and the one line that tells the user which device trains and why.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceChoice {
    pub chosen: Chosen,
    pub line: String,
}

impl DeviceKind {
    /// The parser of `--device`: `auto`, `cpu` or `cuda`, any other value refused with the three
    /// named and, for a GPU by another name (`gpu`, `nvidia`), `cuda` pointed to. (Clap's own
    /// suggestion goes by spelling, and `gpu` is closest to `cpu`.)
    pub fn parse_flag(value: &str) -> Result<DeviceKind, String> {
        match value.to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceKind::Auto),
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            "gpu" | "gpus" | "nvidia" => {
                Err("the GPU is `cuda` (--device cuda); expected auto, cpu or cuda".into())
            }
            _ => Err("expected auto, cpu or cuda (the GPU)".into()),
        }
    }
}

/// Why a run on a cluster's workers ignores `--device`: each host's `device` says where its
/// devices run.
const ON_WORKERS: &str = "each host of the hosts file runs its devices where its `device` says";

/// Decides where a run of `devices` devices trains: `on_cluster` runs go to workers, which
/// choose for themselves. `probe` runs only when a GPU could be used. `devices` devices share
/// the GPUs found, at most one GPU per device.
pub fn choose(
    kind: DeviceKind,
    devices: usize,
    on_cluster: bool,
    probe: impl FnOnce() -> Result<Vec<CudaDevice>, ProbeError>,
) -> anyhow::Result<DeviceChoice> {
    let cpu = |why: &str| DeviceChoice {
        chosen: Chosen::Cpu,
        line: format!("device: cpu ({devices} device(s)){why}"),
    };
    if on_cluster {
        if kind == DeviceKind::Cuda {
            anyhow::bail!("--device cuda with --cluster: {ON_WORKERS} (device = \"cuda\")");
        }
        return Ok(DeviceChoice {
            chosen: Chosen::Cpu,
            line: format!("device: {devices} device(s) on the cluster's workers; {ON_WORKERS}"),
        });
    }
    match kind {
        DeviceKind::Cpu => Ok(cpu("")),
        DeviceKind::Auto => match probe() {
            Ok(gpus) => Ok(on_gpus(&gpus, devices)),
            Err(missing) => Ok(cpu(&format!(
                "; no GPU: {} (--device cuda says more)",
                missing.summary()
            ))),
        },
        DeviceKind::Cuda => {
            let gpus = probe().map_err(|missing| anyhow::anyhow!("--device cuda: {missing}"))?;
            Ok(on_gpus(&gpus, devices))
        }
    }
}

/// Most entries `--gpus` takes: one logical GPU per device at most.
const MAX_LISTED_GPUS: usize = legion_cluster::hosts::MAX_DEVICES;

/// The parser of `--gpus`: the CUDA ordinal of each GPU the devices spread over, in order
/// (`0,1`: two GPUs; `0,0`: two logical GPUs on GPU 0, each a backend with its own streams, so
/// that one physical GPU runs the code path of several). Refuses an empty list, an entry that is
/// not an ordinal, and more entries than a run may have devices, saying which.
pub fn parse_gpus(value: &str) -> Result<Vec<usize>, String> {
    let example = "a comma-separated list of GPU ordinals, as 0,1 (two GPUs) or 0,0 (two \
                   logical GPUs on GPU 0)";
    if value.trim().is_empty() {
        return Err(format!("expected {example}"));
    }
    let listed = value
        .split(',')
        .enumerate()
        .map(|(i, entry)| {
            let entry = entry.trim();
            entry.parse::<usize>().map_err(|_| match entry.is_empty() {
                true => format!("entry {} is empty; expected {example}", i + 1),
                false => format!(
                    "entry {} '{entry}' is not a GPU ordinal; expected {example}",
                    i + 1
                ),
            })
        })
        .collect::<Result<Vec<usize>, String>>()?;
    if listed.len() > MAX_LISTED_GPUS {
        return Err(format!(
            "{} GPUs listed; at most {MAX_LISTED_GPUS} (one per device)",
            listed.len()
        ));
    }
    Ok(listed)
}

/// `--gpus` as a flag's value (one value, however many GPUs it lists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList(pub Vec<usize>);

impl GpuList {
    /// See [`parse_gpus`].
    pub fn parse(value: &str) -> Result<GpuList, String> {
        parse_gpus(value).map(GpuList)
    }
}

/// [`choose`], with `--gpus` when given: the devices spread over exactly the GPUs listed, in
/// order (one listed twice is two logical GPUs on that device: the multi-GPU path, slices
/// between them staged through page-locked host memory, on one physical GPU). Refused with
/// `--cluster` (each worker places its own devices), with `--device cpu`, with more GPUs than
/// devices and with an ordinal this host does not have, each naming the flag.
pub fn choose_listed(
    kind: DeviceKind,
    devices: usize,
    on_cluster: bool,
    listed: Option<&[usize]>,
    probe: impl FnOnce() -> Result<Vec<CudaDevice>, ProbeError>,
) -> anyhow::Result<DeviceChoice> {
    let Some(listed) = listed else {
        return choose(kind, devices, on_cluster, probe);
    };
    if on_cluster {
        anyhow::bail!("--gpus with --cluster: {ON_WORKERS}");
    }
    if kind == DeviceKind::Cpu {
        anyhow::bail!("--gpus places devices on GPUs: drop --device cpu (or --gpus)");
    }
    if listed.len() > devices.max(1) {
        anyhow::bail!(
            "--gpus lists {} GPUs for {devices} device(s): at most one GPU per device (--devices {} \
             or more)",
            listed.len(),
            listed.len()
        );
    }
    let found = probe().map_err(|missing| anyhow::anyhow!("--gpus: {missing}"))?;
    let gpus = listed
        .iter()
        .map(|&ordinal| {
            found
                .iter()
                .find(|g| g.ordinal == ordinal)
                .cloned()
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "--gpus: no GPU {ordinal} on this host; it has {}",
                        found
                            .iter()
                            .map(|g| g.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut choice = on_gpus(&gpus, devices);
    let physical = physical_gpus(&gpus);
    if physical < gpus.len() {
        choice.line += &format!(
            "; {} logical GPUs on {physical} physical: each its own streams, slices between \
             them staged through host memory",
            gpus.len()
        );
    }
    Ok(choice)
}

/// How many distinct GPUs `gpus` names (a GPU listed twice by `--gpus` is one).
pub fn physical_gpus(gpus: &[CudaDevice]) -> usize {
    let mut ordinals: Vec<usize> = gpus.iter().map(|g| g.ordinal).collect();
    ordinals.sort_unstable();
    ordinals.dedup();
    ordinals.len()
}

/// The chosen GPUs, started: their descriptions and contexts.
pub struct StartedGpus {
    pub info: Vec<CudaDevice>,
    pub cuda: Vec<Cuda>,
    /// The stream that proved the first GPU's cuBLAS and cuDNN load.
    first_stream: Stream,
}

impl StartedGpus {
    /// The one-device trainer's backend and stream: the first GPU's.
    pub fn into_one(mut self) -> (Cuda, Stream) {
        (self.cuda.swap_remove(0), self.first_stream)
    }

    /// Where the embedded cluster's devices go.
    pub fn into_placement(self) -> legion_runtime::Placement {
        legion_runtime::Placement::Gpus(self.cuda.into_iter().map(std::sync::Arc::new).collect())
    }
}

/// Starts the GPUs `choice` names, if any. Where one cannot start (a driver older than the
/// kernels' compiler, a GPU held by another process), `auto` leaves the run on the CPU, rewriting
/// the choice's line to say why, and `cuda` is an error.
pub fn start_gpus(
    choice: &mut DeviceChoice,
    kind: DeviceKind,
    devices: usize,
    settings: Settings,
) -> anyhow::Result<Option<StartedGpus>> {
    let math = settings.math;
    let Chosen::Cuda(gpus) = &choice.chosen else {
        if math == Math::Tf32 {
            choice.line += "; --precision tf32 applies to GPUs only";
        }
        return Ok(None);
    };
    let started: anyhow::Result<Vec<(Cuda, Stream)>> = gpus
        .iter()
        .map(|gpu| {
            let cuda = Cuda::with_settings(gpu.ordinal, settings)
                .map_err(|e| anyhow::Error::from(e).context(gpu.to_string()))?;
            // A stream proves cuBLAS and cuDNN load (device actors make their own; the
            // one-device trainer keeps the first GPU's).
            let stream = cuda
                .new_stream()
                .map_err(|e| anyhow::Error::from(e).context(gpu.to_string()))?;
            Ok((cuda, stream))
        })
        .collect();
    match started {
        Ok(started) => {
            if math == Math::Tf32 {
                choice.line +=
                    ", TF32 tensor cores for products and convolutions (--precision tf32)";
            }
            let (cuda, mut streams): (Vec<Cuda>, Vec<Stream>) = started.into_iter().unzip();
            Ok(Some(StartedGpus {
                info: gpus.clone(),
                cuda,
                first_stream: streams.swap_remove(0),
            }))
        }
        Err(e) if kind == DeviceKind::Auto => {
            let mut line =
                format!("device: cpu ({devices} device(s)); the GPU did not start: {e:#}");
            if math == Math::Tf32 {
                line += "; --precision tf32 applies to GPUs only";
            }
            *choice = DeviceChoice {
                chosen: Chosen::Cpu,
                line,
            };
            Ok(None)
        }
        Err(e) => Err(e.context("--device cuda")),
    }
}

/// Refuses, before anything is allocated on them, a run whose devices the GPUs cannot hold: each
/// GPU must hold what its devices need together (`devices` devices spread over `gpus` as
/// `Placement::gpu_of` does).
pub fn check_gpus_fit(
    graph: &Graph,
    configs: &[ParallelConfig],
    devices: usize,
    gpus: &[CudaDevice],
) -> anyhow::Result<()> {
    let needs = memory::per_device(graph, configs, devices);
    for (g, gpu) in gpus.iter().enumerate() {
        // A GPU listed twice (`--gpus 0,0`) is checked once, with the devices of both entries.
        if gpus[..g]
            .iter()
            .any(|earlier| earlier.ordinal == gpu.ordinal)
        {
            continue;
        }
        let on_gpu: Vec<&memory::DeviceMemory> = needs
            .iter()
            .enumerate()
            .filter(|&(d, _)| {
                gpus[legion_runtime::gpu_of(d, devices, gpus.len())].ordinal == gpu.ordinal
            })
            .map(|(_, need)| need)
            .collect();
        let bytes: u64 = on_gpu.iter().map(|n| n.bytes).sum();
        let capacity = gpu.total_memory_bytes as u64;
        if bytes <= capacity {
            continue;
        }
        let largest = on_gpu
            .iter()
            .filter_map(|n| n.largest_layer)
            .max_by_key(|&(_, bytes)| bytes);
        let largest = match largest {
            Some((layer, bytes)) => format!(
                "; layer '{}' alone needs {}",
                graph.layer(layer).name,
                human_bytes(bytes)
            ),
            None => String::new(),
        };
        let whose = match on_gpu.len() {
            1 => "the run needs".to_string(),
            n => format!("its {n} devices need"),
        };
        anyhow::bail!(
            "model '{}' does not fit on {gpu}: {whose} {} of its {}{largest}",
            graph.name,
            human_bytes(bytes),
            human_bytes(capacity)
        )
    }
    Ok(())
}

/// `devices` devices on the GPUs found: as many GPUs as devices at most, so that every GPU used
/// gets a device.
fn on_gpus(gpus: &[CudaDevice], devices: usize) -> DeviceChoice {
    assert!(!gpus.is_empty(), "the probe reports at least one GPU");
    let used: Vec<CudaDevice> = gpus.iter().take(devices.max(1)).cloned().collect();
    let line = match (devices, used.len()) {
        (1, _) => format!("device: {}", used[0]),
        (n, 1) => format!("device: {n} devices on {}, a stream each", used[0]),
        (n, g) => format!(
            "device: {n} devices on {g} GPUs ({}), a stream each",
            used.iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    DeviceChoice {
        line,
        chosen: Chosen::Cuda(used),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_cuda::probe::Library;

    fn h100() -> CudaDevice {
        CudaDevice {
            ordinal: 0,
            name: "NVIDIA H100".into(),
            total_memory_bytes: 80 << 30,
            compute_capability: (9, 0),
        }
    }

    fn missing_driver() -> ProbeError {
        ProbeError::MissingLibrary {
            library: Library::Driver,
            search_path: "(unset)".into(),
            hint: "install the NVIDIA driver",
        }
    }

    #[test]
    fn auto_uses_the_gpus_found_and_says_why_it_does_not_otherwise() {
        let one = choose(DeviceKind::Auto, 1, false, || Ok(vec![h100()])).unwrap();
        assert_eq!(one.chosen, Chosen::Cuda(vec![h100()]));
        assert!(one.line.contains("cuda:0 NVIDIA H100"), "{}", one.line);

        let four = choose(DeviceKind::Auto, 4, false, || Ok(vec![h100()])).unwrap();
        assert_eq!(four.chosen, Chosen::Cuda(vec![h100()]));
        assert!(
            four.line
                .starts_with("device: 4 devices on cuda:0 NVIDIA H100"),
            "{}",
            four.line
        );

        let second = CudaDevice {
            ordinal: 1,
            ..h100()
        };
        let gpus = || {
            Ok(vec![
                h100(),
                second.clone(),
                CudaDevice {
                    ordinal: 2,
                    ..h100()
                },
            ])
        };
        let two = choose(DeviceKind::Auto, 2, false, gpus).unwrap();
        assert_eq!(two.chosen, Chosen::Cuda(vec![h100(), second.clone()]));
        assert!(two.line.contains("2 devices on 2 GPUs"), "{}", two.line);

        let none = choose(DeviceKind::Auto, 1, false, || Err(missing_driver())).unwrap();
        assert_eq!(none.chosen, Chosen::Cpu);
        assert!(none.line.contains("no GPU: "), "{}", none.line);
        assert!(!none.line.contains('\n'));
    }

    #[test]
    fn cuda_never_falls_back_to_the_cpu() {
        let err = choose(DeviceKind::Cuda, 1, false, || Err(missing_driver())).unwrap_err();
        assert!(err.to_string().starts_with("--device cuda: "), "{err}");
        let ok = choose(DeviceKind::Cuda, 4, false, || Ok(vec![h100()])).unwrap();
        assert_eq!(ok.chosen, Chosen::Cuda(vec![h100()]));
    }

    #[test]
    fn a_cluster_run_leaves_the_choice_to_its_workers() {
        let auto = choose(DeviceKind::Auto, 8, true, || panic!("probed")).unwrap();
        assert!(auto.line.contains("workers"), "{}", auto.line);
        let err = choose(DeviceKind::Cuda, 8, true, || panic!("probed")).unwrap_err();
        assert!(err.to_string().contains("device = \"cuda\""), "{err}");
    }

    /// AlexNet at 64×64, batch 8.
    fn alexnet_64() -> legion_ops::Graph {
        let alexnet = legion_ops::zoo::find("alexnet").unwrap();
        alexnet
            .build(&legion_ops::zoo::ZooConfig {
                image_size: 64,
                ..alexnet.default_config(8)
            })
            .unwrap()
    }

    #[test]
    fn a_model_larger_than_the_gpu_is_refused_naming_its_largest_layer() {
        let graph = alexnet_64();
        let configs = vec![ParallelConfig::serial(0); graph.layers().len()];
        let small = CudaDevice {
            total_memory_bytes: 1 << 20,
            ..h100()
        };
        let err = check_gpus_fit(&graph, &configs, 1, std::slice::from_ref(&small)).unwrap_err();
        assert!(err.to_string().contains("does not fit on cuda:0"), "{err}");
        assert!(err.to_string().contains("alone needs"), "{err}");
        check_gpus_fit(&graph, &configs, 1, &[h100()]).unwrap();
    }

    #[test]
    fn devices_sharing_a_gpu_must_fit_it_together() {
        let graph = alexnet_64();
        // Data parallelism: every device holds all the weights.
        let configs: Vec<ParallelConfig> = graph
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(legion_ops::shape::Dim::N, 4, 0))
            .collect();
        let one = memory::per_device(&graph, &configs, 4)[0].bytes as usize;
        let fits_one = CudaDevice {
            total_memory_bytes: one + one / 2,
            ..h100()
        };
        let err = check_gpus_fit(&graph, &configs, 4, std::slice::from_ref(&fits_one)).unwrap_err();
        assert!(err.to_string().contains("its 4 devices need"), "{err}");
        // Spread over four such GPUs, one device each, it fits.
        let four: Vec<CudaDevice> = (0..4)
            .map(|ordinal| CudaDevice {
                ordinal,
                ..fits_one.clone()
            })
            .collect();
        check_gpus_fit(&graph, &configs, 4, &four).unwrap();
    }

    #[test]
    fn gpus_parse_as_ordinals_and_bad_lists_say_what_is_wrong() {
        assert_eq!(parse_gpus("0,0"), Ok(vec![0, 0]));
        assert_eq!(parse_gpus("1, 0,3"), Ok(vec![1, 0, 3]));
        assert_eq!(parse_gpus("2"), Ok(vec![2]));
        let e = parse_gpus("").unwrap_err();
        assert!(e.contains("comma-separated list of GPU ordinals"), "{e}");
        let e = parse_gpus("0,,1").unwrap_err();
        assert!(e.starts_with("entry 2 is empty"), "{e}");
        let e = parse_gpus("0,gpu1").unwrap_err();
        assert!(e.starts_with("entry 2 'gpu1' is not a GPU ordinal"), "{e}");
        let e = parse_gpus("-1").unwrap_err();
        assert!(e.starts_with("entry 1 '-1'"), "{e}");
        let many = vec!["0"; MAX_LISTED_GPUS + 1].join(",");
        assert!(parse_gpus(&many).unwrap_err().contains("at most"));
    }

    #[test]
    fn listed_gpus_are_used_in_order_and_logical_ones_are_said() {
        let second = CudaDevice {
            ordinal: 1,
            ..h100()
        };
        let found = || Ok(vec![h100(), second.clone()]);
        let same = choose_listed(DeviceKind::Cuda, 2, false, Some(&[0, 0]), found).unwrap();
        assert_eq!(same.chosen, Chosen::Cuda(vec![h100(), h100()]));
        assert!(
            same.line.contains("2 logical GPUs on 1 physical"),
            "{}",
            same.line
        );
        let swapped = choose_listed(DeviceKind::Auto, 4, false, Some(&[1, 0]), found).unwrap();
        assert_eq!(swapped.chosen, Chosen::Cuda(vec![second.clone(), h100()]));
        assert!(!swapped.line.contains("logical"), "{}", swapped.line);
        // without the flag, the choice is `choose`'s
        let plain = choose_listed(DeviceKind::Cuda, 2, false, None, found).unwrap();
        assert_eq!(plain, choose(DeviceKind::Cuda, 2, false, found).unwrap());
    }

    #[test]
    fn listed_gpus_refuse_what_cannot_place_them() {
        let found = || Ok(vec![h100()]);
        let e = choose_listed(DeviceKind::Cuda, 2, false, Some(&[0, 1]), found).unwrap_err();
        assert!(e.to_string().contains("no GPU 1 on this host"), "{e}");
        let e = choose_listed(DeviceKind::Cuda, 1, false, Some(&[0, 0]), found).unwrap_err();
        assert!(e.to_string().contains("at most one GPU per device"), "{e}");
        let e = choose_listed(DeviceKind::Cpu, 2, false, Some(&[0, 0]), || {
            panic!("probed")
        })
        .unwrap_err();
        assert!(e.to_string().contains("--device cpu"), "{e}");
        let e = choose_listed(DeviceKind::Auto, 2, true, Some(&[0, 0]), || {
            panic!("probed")
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("--gpus with --cluster"), "{e}");
        let e = choose_listed(DeviceKind::Auto, 2, false, Some(&[0, 0]), || {
            Err(missing_driver())
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("--gpus: "), "{e}");
    }

    #[test]
    fn logical_gpus_on_one_device_must_fit_it_together() {
        let graph = alexnet_64();
        let configs: Vec<ParallelConfig> = graph
            .layers()
            .iter()
            .map(|_| ParallelConfig::split(legion_ops::shape::Dim::N, 4, 0))
            .collect();
        let one = memory::per_device(&graph, &configs, 4)[0].bytes as usize;
        let fits_two = CudaDevice {
            total_memory_bytes: 2 * one + one / 2,
            ..h100()
        };
        // Two distinct GPUs of that size hold two devices each; one listed twice holds four.
        let two = vec![
            fits_two.clone(),
            CudaDevice {
                ordinal: 1,
                ..fits_two.clone()
            },
        ];
        check_gpus_fit(&graph, &configs, 4, &two).unwrap();
        let logical = vec![fits_two.clone(), fits_two];
        let err = check_gpus_fit(&graph, &configs, 4, &logical).unwrap_err();
        assert!(err.to_string().contains("its 4 devices need"), "{err}");
        assert_eq!(physical_gpus(&logical), 1);
        assert_eq!(physical_gpus(&two), 2);
    }

    #[test]
    fn cpu_does_not_probe() {
        let choice = choose(DeviceKind::Cpu, 2, false, || panic!("probed")).unwrap();
        assert_eq!(choice.chosen, Chosen::Cpu);
        assert_eq!(choice.line, "device: cpu (2 device(s))");
    }
}
