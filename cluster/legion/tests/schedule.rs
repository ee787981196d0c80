//! Learning-rate schedules and Nesterov momentum: every device of a step updates at the step's
//! rate (any strategy trains what one device trains under a schedule), and a run resumed from a
//! checkpoint continues the same rates, ending bit-identical to the run never stopped.

use legion::job::{JobEvent, Training};
use legion::ops::checkpoint::{self, Checkpoint};
use legion::ops::train::LrSchedule;
use legion::{DeviceKind, SearchKind, Sgd, load_model};
use std::path::Path;

const STEPS: u64 = 6;

fn training(schedule: &str) -> Training {
    let graph = load_model("lenet5", 8, None, None).unwrap();
    Training::new(graph)
        .device(DeviceKind::Cpu)
        .sgd(Sgd {
            lr: 0.05,
            nesterov: true,
            ..Sgd::default()
        })
        .lr_schedule(schedule.parse::<LrSchedule>().unwrap())
        .steps(STEPS)
}

fn weights(path: &Path) -> Checkpoint {
    let mut ckpt = checkpoint::load(path).unwrap();
    ckpt.metadata.clear();
    ckpt
}

#[test]
fn every_strategy_follows_the_schedule_one_device_follows() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one.safetensors");
    training("cosine+warmup:2").save(&one).run(|_| {}).unwrap();
    let one = weights(&one);
    let constant = dir.path().join("constant.safetensors");
    training("constant").save(&constant).run(|_| {}).unwrap();
    assert_ne!(weights(&constant), one, "the schedule changes the rates");
    for kind in [SearchKind::Data, SearchKind::Owt, SearchKind::OptCnn] {
        let path = dir.path().join(format!("{}.safetensors", kind.name()));
        training("cosine+warmup:2")
            .devices(4)
            .strategy(kind)
            .save(&path)
            .run(|_| {})
            .unwrap();
        for (got, want) in weights(&path).tensors.iter().zip(&one.tensors) {
            let scale = want.data.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
            let err = got
                .data
                .iter()
                .zip(&want.data)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            assert!(
                err <= 1e-4,
                "{}: {} differs by {err:e}",
                kind.name(),
                want.name
            );
        }
    }
}

#[test]
fn a_resumed_scheduled_run_ends_bit_identical_and_a_changed_schedule_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.safetensors");
    training("step:2:0.5+warmup:1")
        .save(&whole)
        .run(|_| {})
        .unwrap();

    // The run again, its step-3 checkpoint kept as a crash would have left it.
    let (saved, at_three) = (
        dir.path().join("run.safetensors"),
        dir.path().join("3.safetensors"),
    );
    training("step:2:0.5+warmup:1")
        .save(&saved)
        .checkpoint_every(3)
        .run(|event| {
            // Step 4 is reported after the checkpoint of step 3 is written.
            if let JobEvent::Step(s) = event
                && s.step == 4
            {
                std::fs::copy(&saved, &at_three).unwrap();
            }
        })
        .unwrap();
    assert_eq!(checkpoint::load(&at_three).unwrap().metadata["step"], "3");
    let resumed = dir.path().join("resumed.safetensors");
    let summary = training("step:2:0.5+warmup:1")
        .resume(&at_three)
        .save(&resumed)
        .run(|_| {})
        .unwrap();
    assert_eq!((summary.first_step, summary.losses.len()), (3, 3));
    assert_eq!(weights(&resumed), weights(&whole));

    let e = training("cosine").resume(&at_three).start().err().unwrap();
    let e = format!("{e:#}");
    assert!(
        e.contains("--lr-schedule step:2:0.5+warmup:1") && e.contains("--init"),
        "{e}"
    );
}

#[test]
fn epochs_count_whole_passes_over_the_data() {
    let graph = load_model("lenet5", 8, None, None).unwrap();
    let mut epochs = Vec::new();
    let summary = Training::new(graph)
        .device(DeviceKind::Cpu)
        .data(legion::Data::Synthetic { samples: 20 })
        .epochs(3)
        .run(|event| {
            if let JobEvent::Step(s) = event {
                epochs.push((s.epoch, s.epochs));
            }
        })
        .unwrap();
    // 20 samples in whole batches of 8: two steps a pass.
    assert_eq!(summary.steps, 6);
    let passes: Vec<u64> = epochs.iter().map(|&(e, _)| e).collect();
    assert_eq!(passes, [1, 1, 2, 2, 3, 3]);
    assert!(epochs.iter().all(|&(_, of)| of == Some(3)));
}
