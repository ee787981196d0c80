//! Which kind of device a run trains on: `--device auto|cpu|cuda` against what the CUDA probe
//! found and the shape of the run. The decision is a pure function ([`choose`]), tested without
//! a GPU; the job starts the engine it names.

use legion_cluster::memory::human_bytes;
use legion_cuda::{Cuda, CudaDevice, Math, ProbeError, Stream};
use legion_ops::Graph;
use legion_ops::memory;
use legion_ops::partition::ParallelConfig;
use std::fmt;

/// The `--device` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
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
    Cuda(CudaDevice),
}

/// The choice, and the one line that tells the user which device trains and why.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceChoice {
    pub chosen: Chosen,
    pub line: String,
}

/// Why a multi-device run stays on the CPU even with a GPU present.
const MULTI_DEVICE_ON_CPU: &str = "the multi-device runtime runs CPU device actors only so far; \
     a one-device run (--devices 1, no --cluster or --trace) trains on the GPU";

/// Decides where a run of `devices` devices trains (`distributed`: it goes through the runtime's
/// device actors rather than the one-device trainer). `probe` runs only when a GPU could be
/// used.
pub fn choose(
    kind: DeviceKind,
    devices: usize,
    distributed: bool,
    probe: impl FnOnce() -> Result<Vec<CudaDevice>, ProbeError>,
) -> anyhow::Result<DeviceChoice> {
    let cpu = |why: &str| DeviceChoice {
        chosen: Chosen::Cpu,
        line: format!("device: cpu ({devices} device(s)){why}"),
    };
    match kind {
        DeviceKind::Cpu => Ok(cpu("")),
        DeviceKind::Auto => match probe() {
            Ok(gpus) if !distributed => Ok(on_gpu(&gpus)),
            Ok(gpus) => Ok(cpu(&format!(
                "; {} GPU(s) found, but {MULTI_DEVICE_ON_CPU}",
                gpus.len()
            ))),
            Err(missing) => Ok(cpu(&format!(
                "; no GPU: {} (--device cuda says more)",
                missing.summary()
            ))),
        },
        DeviceKind::Cuda => {
            let gpus = probe().map_err(|missing| anyhow::anyhow!("--device cuda: {missing}"))?;
            if distributed {
                anyhow::bail!("--device cuda with {devices} device(s): {MULTI_DEVICE_ON_CPU}");
            }
            Ok(on_gpu(&gpus))
        }
    }
}

/// A chosen GPU that started: its description, its context and the stream the run uses.
pub struct StartedGpu {
    pub info: CudaDevice,
    pub cuda: Cuda,
    pub stream: Stream,
}

/// Starts the GPU `choice` names, if any. Where it cannot start (a driver older than the kernels'
/// compiler, a GPU held by another process), `auto` leaves the run on the CPU, rewriting the
/// choice's line to say why, and `cuda` is an error.
pub fn start_gpu(
    choice: &mut DeviceChoice,
    kind: DeviceKind,
    devices: usize,
    math: Math,
) -> anyhow::Result<Option<StartedGpu>> {
    let Chosen::Cuda(info) = &choice.chosen else {
        if math == Math::Tf32 {
            choice.line += "; --tf32 applies to GPUs only";
        }
        return Ok(None);
    };
    let started = Cuda::with_math(info.ordinal, math)
        .map_err(anyhow::Error::from)
        .and_then(|cuda| Ok((cuda.new_stream()?, cuda)));
    match started {
        Ok((stream, cuda)) => {
            if math == Math::Tf32 {
                choice.line += ", TF32 tensor cores for products and convolutions (--tf32)";
            }
            Ok(Some(StartedGpu {
                info: info.clone(),
                cuda,
                stream,
            }))
        }
        Err(e) if kind == DeviceKind::Auto => {
            let mut line =
                format!("device: cpu ({devices} device(s)); the GPU did not start: {e:#}");
            if math == Math::Tf32 {
                line += "; --tf32 applies to GPUs only";
            }
            *choice = DeviceChoice {
                chosen: Chosen::Cpu,
                line,
            };
            Ok(None)
        }
        Err(e) => Err(e.context(format!("--device cuda: {info}"))),
    }
}

/// Refuses, before anything is allocated on it, a one-device run the GPU's memory cannot hold.
pub fn check_gpu_fits(
    graph: &Graph,
    configs: &[ParallelConfig],
    gpu: &CudaDevice,
) -> anyhow::Result<()> {
    let need = &memory::per_device(graph, configs, 1)[0];
    let capacity = gpu.total_memory_bytes as u64;
    if need.bytes <= capacity {
        return Ok(());
    }
    let largest = match need.largest_layer {
        Some((layer, bytes)) => format!(
            "; layer '{}' alone needs {}",
            graph.layer(layer).name,
            human_bytes(bytes)
        ),
        None => String::new(),
    };
    anyhow::bail!(
        "model '{}' does not fit on {gpu}: the run needs {} of its {}{largest}",
        graph.name,
        human_bytes(need.bytes),
        human_bytes(capacity)
    )
}

fn on_gpu(gpus: &[CudaDevice]) -> DeviceChoice {
    let first = gpus
        .first()
        .expect("the probe reports at least one GPU")
        .clone();
    DeviceChoice {
        line: format!("device: {first}"),
        chosen: Chosen::Cuda(first),
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
    fn auto_uses_a_gpu_for_one_device_and_says_why_it_does_not_otherwise() {
        let one = choose(DeviceKind::Auto, 1, false, || Ok(vec![h100()])).unwrap();
        assert_eq!(one.chosen, Chosen::Cuda(h100()));
        assert!(one.line.contains("cuda:0 NVIDIA H100"), "{}", one.line);

        let four = choose(DeviceKind::Auto, 4, true, || Ok(vec![h100()])).unwrap();
        assert_eq!(four.chosen, Chosen::Cpu);
        assert!(four.line.contains("1 GPU(s) found, but"), "{}", four.line);

        let none = choose(DeviceKind::Auto, 1, false, || Err(missing_driver())).unwrap();
        assert_eq!(none.chosen, Chosen::Cpu);
        assert!(none.line.contains("no GPU: "), "{}", none.line);
        assert!(!none.line.contains('\n'));
    }

    #[test]
    fn cuda_never_falls_back_to_the_cpu() {
        let err = choose(DeviceKind::Cuda, 1, false, || Err(missing_driver())).unwrap_err();
        assert!(err.to_string().starts_with("--device cuda: "), "{err}");
        let err = choose(DeviceKind::Cuda, 4, true, || Ok(vec![h100()])).unwrap_err();
        assert!(err.to_string().contains("with 4 device(s)"), "{err}");
        let ok = choose(DeviceKind::Cuda, 1, false, || Ok(vec![h100()])).unwrap();
        assert_eq!(ok.chosen, Chosen::Cuda(h100()));
    }

    #[test]
    fn a_model_larger_than_the_gpu_is_refused_naming_its_largest_layer() {
        let alexnet = legion_ops::zoo::find("alexnet").unwrap();
        let graph = alexnet
            .build(&legion_ops::zoo::ZooConfig {
                image_size: 64,
                ..alexnet.default_config(8)
            })
            .unwrap();
        let configs = vec![ParallelConfig::serial(0); graph.layers().len()];
        let small = CudaDevice {
            total_memory_bytes: 1 << 20,
            ..h100()
        };
        let err = check_gpu_fits(&graph, &configs, &small).unwrap_err();
        assert!(err.to_string().contains("does not fit on cuda:0"), "{err}");
        assert!(err.to_string().contains("alone needs"), "{err}");
        check_gpu_fits(&graph, &configs, &h100()).unwrap();
    }

    #[test]
    fn cpu_does_not_probe() {
        let choice = choose(DeviceKind::Cpu, 2, true, || panic!("probed")).unwrap();
        assert_eq!(choice.chosen, Chosen::Cpu);
        assert_eq!(choice.line, "device: cpu (2 device(s))");
    }
}
