//! `--device`: on a machine without a usable GPU, `cuda` fails naming what is missing and `auto`
//! trains on the CPU, saying so. (On a GPU machine these runs would use the GPU; the checks skip
//! there with the probe's answer.)

mod common;

use common::{assert_clean_failure, legion};

/// The probe's verdict on this machine, `Err` when no GPU is usable.
fn gpu_here() -> Result<String, String> {
    match legion_cuda::probe() {
        Ok(gpus) => Ok(gpus[0].to_string()),
        Err(missing) => Err(missing.to_string()),
    }
}

#[test]
fn device_cuda_without_a_usable_gpu_exits_1_naming_what_is_missing() {
    let missing = match gpu_here() {
        Ok(gpu) => {
            println!("skipped: a GPU is usable here ({gpu})");
            return;
        }
        Err(missing) => missing,
    };
    let out = legion(&[
        "train", "--model", "lenet5", "--device", "cuda", "--steps", "1",
    ]);
    assert_clean_failure(&out, &["--device cuda: ", &missing]);
}

#[test]
fn device_auto_without_a_usable_gpu_trains_on_the_cpu_and_says_why() {
    if let Ok(gpu) = gpu_here() {
        println!("skipped: a GPU is usable here ({gpu})");
        return;
    }
    let out = legion(&["train", "--model", "lenet5", "--steps", "2"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("device: cpu (1 device(s)); no GPU: "),
        "{stdout}"
    );
    assert!(stdout.contains("step     2"), "{stdout}");
}
