//! One single-device training step (forward, backward, SGD) of AlexNet at batch 32, 224×224, on the
//! seeded synthetic data. Reports images/s and the achieved GFLOP/s of the whole step.
//!
//! `cargo bench -p legion-ops --bench train_step`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use legion_ops::data::{self, Loader, LoaderConfig};
use legion_ops::train::{ParamStore, Sgd, Trainer};
use legion_ops::zoo;
use std::time::Duration;

fn alexnet_step(c: &mut Criterion) {
    let model = zoo::find("alexnet").expect("alexnet is in the zoo");
    let cfg = model.default_config(32);
    let graph = model.build(&cfg).expect("alexnet builds");
    let flops = graph.flops();
    let dataset = data::open(
        "synthetic",
        [3, 224, 224],
        cfg.classes,
        1,
        data::Transforms::PLAIN,
    )
    .expect("synthetic data");
    let batch = Loader::new(dataset, LoaderConfig::new(cfg.batch))
        .expect("a loader")
        .batch(0, 0)
        .expect("synthetic data loads");
    let params = ParamStore::init(&graph, 1);
    let mut trainer = Trainer::new(graph, params, Sgd::default(), 1);

    let mut group = c.benchmark_group("train_step");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));
    group.throughput(Throughput::Elements(flops.forward + flops.backward));
    group.bench_function("alexnet_b32_224 (elements = FLOPs)", |b| {
        b.iter(|| trainer.step(&batch.images, &batch.labels))
    });
    group.finish();
}

criterion_group!(benches, alexnet_step);
criterion_main!(benches);
