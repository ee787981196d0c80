//! What a run does with its precision: fp32 and tf32 are `legion_cuda::Math::{StrictFp32, Tf32}`
//! on a GPU (tf32 is fp32 on the CPU, which has no TF32 units); bf16 (the rules in
//! `legion_ops::precision`) is `Math::Bf16` on GPUs and the CPU backend's bf16 storage on cores, on
//! one device, several of this process or a cluster's workers (the job carries it,
//! `JobSpec::gpu_math`). It is refused with the reason where it cannot run as asked, never run as
//! fp32: in `profile` and `--compare`, which time fp32 tiles.

use legion_ops::Precision;

/// What `profile --precision bf16` (and `--compare`, which profiles) says.
pub const BF16_NO_PROFILE: &str = "--precision bf16: profile times the runtime's tasks in fp32 \
     only; profile with --precision fp32 or tf32";

/// The math a GPU computes `precision` in.
pub fn gpu_math(precision: Precision) -> legion_cuda::Math {
    match precision {
        Precision::Fp32 => legion_cuda::Math::StrictFp32,
        Precision::Tf32 => legion_cuda::Math::Tf32,
        Precision::Bf16 => legion_cuda::Math::Bf16,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_precision_has_its_gpu_math() {
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
    }
}
