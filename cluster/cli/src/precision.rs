//! `--precision fp32|tf32|bf16` (and `--tf32`, its old spelling of `tf32`) as `train`, `profile`
//! and the examples take it, and what a run on a device does with it: fp32 and tf32 are
//! `legion_cuda::Math::{StrictFp32, Tf32}` on a GPU (tf32 is a note on the CPU, whose products
//! are fp32 anyway); bf16 (the rules in `legion_ops::precision`) is `Math::Bf16` for the
//! one-device trainer on one GPU, and refused with the reason everywhere else, never run as fp32:
//! on the CPU, which computes in fp32; on several devices and on a cluster's workers, which
//! exchange activations through the runtime, whose bf16 region moves are not built yet; and in
//! `profile`, which times the runtime's f32 tasks.

use crate::device::{Chosen, DeviceChoice};
use legion_ops::Precision;

/// `--precision` and `--tf32`.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct PrecisionArgs {
    /// The arithmetic: `fp32` (strict FP32), `tf32` (on a GPU, products and convolutions on TF32
    /// tensor cores: several times faster, ~1e-3 relative error per product), or `bf16` (mixed
    /// precision: products and convolutions in bf16 with fp32 accumulation, activations and
    /// their gradients stored in bf16, master weights, momentum, the update, batch-norm
    /// statistics and the loss in fp32; a GPU only) [default: fp32, or a cluster's hosts-file
    /// `precision`]
    #[arg(long, value_name = "fp32|tf32|bf16")]
    pub precision: Option<Precision>,
    /// The old spelling of `--precision tf32`.
    #[arg(long, conflicts_with = "precision")]
    pub tf32: bool,
}

impl PrecisionArgs {
    /// The precision the flags ask for, if any.
    pub fn given(&self) -> Option<Precision> {
        match self.tf32 {
            true => Some(Precision::Tf32),
            false => self.precision,
        }
    }
}

/// What `--precision bf16` says on several devices (or a cluster's workers).
pub const BF16_ONE_GPU: &str = "--precision bf16 trains on one GPU so far: several devices exchange \
     activations through the runtime, whose bf16 region moves are not built yet (issue 42); \
     use --devices 1 on a GPU, or --precision fp32 or tf32";

/// What `profile --precision bf16` says.
pub const BF16_NO_PROFILE: &str = "--precision bf16: profile times the runtime's tasks, which \
     compute in fp32 so far (issue 42); profile with --precision fp32 or tf32";

/// What `--precision bf16` says where the devices are CPU cores.
pub const BF16_NEEDS_GPU: &str =
    "--precision bf16 needs a GPU device; the CPU backend computes in fp32";

/// The math a GPU computes `precision` in (where [`check_device`] let it run).
pub fn gpu_math(precision: Precision) -> legion_cuda::Math {
    match precision {
        Precision::Fp32 => legion_cuda::Math::StrictFp32,
        Precision::Tf32 => legion_cuda::Math::Tf32,
        Precision::Bf16 => legion_cuda::Math::Bf16,
    }
}

/// Refuses `precision` on `devices` devices of the kind `choice` names where it cannot run as
/// asked: bf16 on the CPU (saying why the CPU was chosen), or on more than one device. Checked
/// before a GPU starts or anything is allocated.
pub fn check_device(
    precision: Precision,
    choice: &DeviceChoice,
    devices: usize,
) -> anyhow::Result<()> {
    if precision != Precision::Bf16 {
        return Ok(());
    }
    match &choice.chosen {
        Chosen::Cpu => anyhow::bail!("{BF16_NEEDS_GPU} ({})", choice.line),
        Chosen::Cuda(_) if devices > 1 => anyhow::bail!("{BF16_ONE_GPU} ({devices} devices)"),
        Chosen::Cuda(_) => Ok(()),
    }
}

/// The precision of a run on a cluster's workers: the flag's, else the hosts file's, else fp32;
/// the flag and the file disagreeing is an error naming both.
pub fn resolve(
    flag: Option<Precision>,
    file: Option<Precision>,
    file_label: &str,
) -> anyhow::Result<Precision> {
    match (flag, file) {
        (Some(f), Some(h)) if f != h => anyhow::bail!(
            "--precision {f} but the hosts file {file_label} says precision = \"{h}\"; give one \
             or make them agree"
        ),
        (f, h) => Ok(f.or(h).unwrap_or_default()),
    }
}

/// Refuses bf16 on a cluster's workers: on a host that runs its devices on its cores (the CPU
/// backend computes in fp32), and on GPU hosts, whose devices exchange activations through the
/// runtime (no bf16 region moves yet).
pub fn check_hosts(
    precision: Precision,
    hosts: &legion_cluster::hosts::Hosts,
) -> anyhow::Result<()> {
    if precision != Precision::Bf16 {
        return Ok(());
    }
    if let Some(h) = hosts
        .hosts
        .iter()
        .find(|h| h.device_kind != legion_cluster::hosts::GPU_KIND)
    {
        anyhow::bail!(
            "{BF16_NEEDS_GPU} (host {} runs its devices on its cores: device = \"{}\")",
            h.name,
            h.device_kind
        );
    }
    anyhow::bail!("{BF16_ONE_GPU} (a cluster's workers)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cmd {
        #[command(flatten)]
        p: PrecisionArgs,
    }

    fn parse(args: &[&str]) -> Result<Option<Precision>, String> {
        Cmd::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map(|c| c.p.given())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_flag_parses_and_tf32_is_its_old_spelling() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(parse(&["--precision", "bf16"]), Ok(Some(Precision::Bf16)));
        assert_eq!(parse(&["--precision=fp32"]), Ok(Some(Precision::Fp32)));
        assert_eq!(parse(&["--tf32"]), Ok(Some(Precision::Tf32)));
        let e = parse(&["--precision", "fp16"]).unwrap_err();
        assert!(
            e.contains("'fp16'") && e.contains("fp32, tf32, bf16"),
            "{e}"
        );
        let e = parse(&["--tf32", "--precision", "bf16"]).unwrap_err();
        assert!(e.contains("--tf32") && e.contains("--precision"), "{e}");
    }

    #[test]
    fn bf16_runs_on_one_gpu_and_is_refused_on_the_cpu_and_on_several_devices() {
        let cpu = DeviceChoice {
            chosen: Chosen::Cpu,
            line: "device: cpu (1 device(s))".into(),
        };
        let e = check_device(Precision::Bf16, &cpu, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(BF16_NEEDS_GPU) && e.contains("device: cpu"),
            "{e}"
        );
        let gpu = DeviceChoice {
            chosen: Chosen::Cuda(Vec::new()),
            line: String::new(),
        };
        assert!(check_device(Precision::Bf16, &gpu, 1).is_ok());
        let e = check_device(Precision::Bf16, &gpu, 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(BF16_ONE_GPU) && e.contains("--precision") && e.contains("4 devices"),
            "{e}"
        );
        for p in [Precision::Fp32, Precision::Tf32] {
            for devices in [1, 4] {
                assert!(check_device(p, &cpu, devices).is_ok());
                assert!(check_device(p, &gpu, devices).is_ok());
            }
        }
        assert_eq!(gpu_math(Precision::Tf32), legion_cuda::Math::Tf32);
        assert_eq!(gpu_math(Precision::Fp32), legion_cuda::Math::StrictFp32);
        assert_eq!(gpu_math(Precision::Bf16), legion_cuda::Math::Bf16);
    }

    #[test]
    fn a_cluster_takes_the_flag_or_the_hosts_file_and_refuses_disagreement() {
        use Precision::*;
        assert_eq!(resolve(None, None, "h.toml").unwrap(), Fp32);
        assert_eq!(resolve(None, Some(Bf16), "h.toml").unwrap(), Bf16);
        assert_eq!(resolve(Some(Tf32), None, "h.toml").unwrap(), Tf32);
        assert_eq!(resolve(Some(Bf16), Some(Bf16), "h.toml").unwrap(), Bf16);
        let e = resolve(Some(Fp32), Some(Bf16), "h.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--precision fp32") && e.contains("h.toml"),
            "{e}"
        );
        let hosts = legion_cluster::hosts::Hosts::parse(
            "[[host]]\naddress = \"127.0.0.1\"\n[[host]]\naddress = \"127.0.0.2\"\ndevice = \"cuda\"\ndevices = 1\n",
            "h.toml",
        )
        .unwrap();
        let e = check_hosts(Bf16, &hosts).unwrap_err().to_string();
        assert!(
            e.starts_with(BF16_NEEDS_GPU) && e.contains("127.0.0.1"),
            "{e}"
        );
        assert!(check_hosts(Tf32, &hosts).is_ok());
        let gpus = legion_cluster::hosts::Hosts::parse(
            "[[host]]\naddress = \"127.0.0.2\"\ndevice = \"cuda\"\ndevices = 1\n",
            "h.toml",
        )
        .unwrap();
        let e = check_hosts(Bf16, &gpus).unwrap_err().to_string();
        assert!(e.starts_with(BF16_ONE_GPU) && e.contains("cluster"), "{e}");
    }
}
