//! Which kind of device a run trains on: `--device auto|cpu|cuda` against what the CUDA probe
//! found and the shape of the run. The decision is a pure function ([`choose`]), tested without
//! a GPU; the job starts the engine it names.

use legion_cuda::{CudaDevice, ProbeError};
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
    fn cpu_does_not_probe() {
        let choice = choose(DeviceKind::Cpu, 2, true, || panic!("probed")).unwrap();
        assert_eq!(choice.chosen, Chosen::Cpu);
        assert_eq!(choice.line, "device: cpu (2 device(s))");
    }
}
