//! `--device`: on a machine without a usable GPU, `cuda` fails naming what is missing and `auto`
//! trains on the CPU, saying so. (On a GPU machine these runs would use the GPU; the checks skip
//! there with the probe's answer.)

mod common;

use common::{assert_clean_failure, legion};

/// What is missing for a GPU here, the probe's message; `None` (saying the test skips) where a
/// GPU is usable.
fn no_gpu_here() -> Option<String> {
    match legion_cuda::probe() {
        Ok(gpus) => {
            println!("skipped: a GPU is usable here ({})", gpus[0]);
            None
        }
        Err(missing) => Some(missing.to_string()),
    }
}

#[test]
fn device_cuda_without_a_usable_gpu_exits_1_naming_what_is_missing() {
    let Some(missing) = no_gpu_here() else {
        return;
    };
    let out = legion(&[
        "train", "--model", "lenet5", "--device", "cuda", "--steps", "1",
    ]);
    assert_clean_failure(&out, &["--device cuda: ", &missing]);
    // Several devices (the GPU device actors) and a traced run on one device too.
    for devices in ["4", "1"] {
        let out = legion(&[
            "train",
            "--model",
            "lenet5",
            "--device",
            "cuda",
            "--devices",
            devices,
            "--steps",
            "1",
            "--trace",
            "/dev/null",
        ]);
        assert_clean_failure(&out, &["--device cuda: ", &missing]);
    }
}

#[test]
fn profile_on_cuda_without_a_usable_gpu_exits_1_naming_what_is_missing() {
    let Some(missing) = no_gpu_here() else {
        return;
    };
    let out = legion(&[
        "profile",
        "--model",
        "lenet5",
        "--devices",
        "2",
        "--device",
        "cuda",
        "--out",
        "/dev/null",
    ]);
    assert_clean_failure(&out, &["--device cuda: ", &missing]);
}

#[test]
fn device_auto_with_several_devices_and_no_gpu_runs_them_on_the_cpu() {
    if no_gpu_here().is_none() {
        return;
    }
    let out = legion(&[
        "train",
        "--model",
        "lenet5",
        "--devices",
        "2",
        "--steps",
        "1",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("device: cpu (2 device(s)); no GPU: "),
        "{stdout}"
    );
}

#[test]
fn device_auto_without_a_usable_gpu_trains_on_the_cpu_and_says_why() {
    if no_gpu_here().is_none() {
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

#[test]
fn a_cuda_host_without_a_usable_gpu_fails_up_at_once_naming_what_is_missing() {
    let Some(missing) = no_gpu_here() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // With a device count, and without one (one device per GPU, counted by the worker).
    for devices in ["devices = 2\n", ""] {
        let hosts = dir.path().join("hosts.toml");
        std::fs::write(
            &hosts,
            format!(
                "[[host]]\nname = \"gpu0\"\naddress = \"127.0.0.1\"\nport = {}\n\
                 device = \"cuda\"\n{devices}",
                common::free_udp_port()
            ),
        )
        .unwrap();
        let started = std::time::Instant::now();
        let up = [
            "up",
            hosts.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
        ];
        let out = legion(&up);
        // The worker's own error, not the registration timeout.
        assert_clean_failure(
            &out,
            &["worker gpu0", "exited", "--device cuda: ", &missing],
        );
        assert!(started.elapsed().as_secs() < 15, "{:?}", started.elapsed());
        if devices.is_empty() {
            // Nothing recorded its GPU count: a job on it says to run `up` (or give a count).
            let out = legion(&[
                "train",
                "--model",
                "lenet5",
                "--steps",
                "1",
                "--cluster",
                hosts.to_str().unwrap(),
                "--state",
                state.to_str().unwrap(),
            ]);
            assert_clean_failure(&out, &["host gpu0: device = \"cuda\" without `devices`"]);
        }
    }
}
