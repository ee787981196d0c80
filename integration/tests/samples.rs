//! Which samples of a batch each process needs: a cluster worker receives only the images and
//! labels its devices' tasks read, and refuses a step that lacks any of them.

use legion_ops::{Graph, zoo};
use legion_planner::search::data_parallel;
use legion_planner::{MachineModel, ParallelConfig};
use legion_runtime::StepInput;
use legion_runtime::plan::{SamplesRead, StepPlan};
use legion_runtime::{RuntimeError, check_batch};

fn lenet(batch: usize) -> Graph {
    let z = zoo::find("lenet5").unwrap();
    z.build(&z.default_config(batch)).unwrap()
}

#[test]
fn data_parallel_devices_read_their_share_of_the_batch() {
    let graph = lenet(8);
    let machine = MachineModel::preset("local-cpu:4").unwrap();
    let plan = StepPlan::build(&graph, &data_parallel(&graph, &machine), 4).unwrap();
    for device in 0..4 {
        let read = plan.samples_read(&graph, device..device + 1);
        assert_eq!(read.images, 2 * device..2 * device + 2, "device {device}");
        assert_eq!(read.labels, 2 * device..2 * device + 2, "device {device}");
    }
    let first_host = plan.samples_read(&graph, 0..2);
    assert_eq!(first_host.images, 0..4);
    assert_eq!(first_host.labels, 0..4);
}

#[test]
fn a_host_without_input_or_loss_layer_reads_no_samples() {
    let graph = lenet(8);
    let on_device_1 = vec![ParallelConfig::serial(1); graph.layers().len()];
    let plan = StepPlan::build(&graph, &on_device_1, 2).unwrap();
    let idle = plan.samples_read(&graph, 0..1);
    assert!(idle.images.is_empty() && idle.labels.is_empty(), "{idle:?}");
    assert_eq!(
        plan.samples_read(&graph, 1..2),
        SamplesRead {
            images: 0..8,
            labels: 0..8
        }
    );
}

#[test]
fn a_step_missing_needed_samples_is_refused() {
    let graph = lenet(8);
    let values = graph.input_sample_len();
    let needs = SamplesRead {
        images: 2..6,
        labels: 4..6,
    };
    let input = |images: std::ops::Range<usize>, labels: std::ops::Range<usize>| StepInput {
        step: 0,
        images: vec![0.0; images.len() * values],
        image_samples: images,
        labels: vec![1; labels.len()],
        label_samples: labels,
        lr: None,
    };
    check_batch(&graph, &input(2..6, 4..6).view(), &needs).unwrap();
    check_batch(&graph, &input(0..8, 0..8).view(), &needs).unwrap();
    for (images, labels, what) in [(3..6, 4..6, "images"), (2..6, 4..5, "labels")] {
        match check_batch(&graph, &input(images, labels).view(), &needs) {
            Err(e @ RuntimeError::SamplesMissing { .. }) => {
                let message = e.to_string();
                assert!(message.contains(what), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Beyond the batch, or a range that runs backwards.
    assert!(matches!(
        check_batch(&graph, &input(4..10, 4..6).view(), &needs),
        Err(RuntimeError::SamplesMissing { .. })
    ));
    // Decoded from the network, so nothing stops a range from running backwards.
    let mut backwards = input(2..6, 4..6);
    backwards.label_samples = std::ops::Range { start: 6, end: 4 };
    assert!(check_batch(&graph, &backwards.view(), &needs).is_err());
    // Values that do not match the samples claimed.
    let mut short = input(2..6, 4..6);
    short.images.pop();
    assert!(matches!(
        check_batch(&graph, &short.view(), &needs),
        Err(RuntimeError::BatchSize { .. })
    ));
}
