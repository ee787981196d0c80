//! The invariant at the centre of the suite: any strategy trains the same network. Every strategy
//! (data, model, OWT, the optimised one and random valid ones) on 4 embedded devices, run through the
//! device actors, gives the same weights after 3 steps as the single-device reference trainer.

use legion_ops::train::{ParamStore, Sgd, Trainer};
use legion_ops::{Graph, zoo};
use legion_planner::search::{self, SearchKind};
use legion_planner::{
    ConfigSpace, CostModel, CostTables, MachineModel, ParallelConfig, RooflineCost,
};
use legion_runtime::embedded::EmbeddedCluster;

const DEVICES: usize = 4;
const STEPS: u64 = 3;
const TOLERANCE: f32 = 1e-4;

fn model(name: &str, image_size: usize) -> Graph {
    let z = zoo::find(name).unwrap();
    let cfg = zoo::ZooConfig {
        image_size,
        classes: 10,
        ..z.default_config(8)
    };
    z.build(&cfg).unwrap()
}

fn batch(graph: &Graph, step: u64) -> (Vec<f32>, Vec<u32>) {
    let n = graph.layer(graph.input()).shape.numel();
    let images = (0..n)
        .map(|i| ((i as f32) * 0.37 + step as f32).sin())
        .collect();
    let labels = (0..graph.batch() as u32)
        .map(|i| (i * 7 + step as u32) % 10)
        .collect();
    (images, labels)
}

fn searched(graph: &Graph, kind: SearchKind) -> Vec<ParallelConfig> {
    let machine = MachineModel::preset(&format!("paper:{DEVICES}")).unwrap();
    let provider = RooflineCost::new(&machine);
    let cost = CostModel::new(graph, &machine, &provider);
    let tables = CostTables::build(&cost);
    search::find(kind, &tables, search::DEFAULT_BUDGET)
        .unwrap()
        .configs
}

fn random(graph: &Graph, seed: u64) -> Vec<ParallelConfig> {
    let mut rng = legion_ops::rng::Rng::new(seed);
    graph
        .layers()
        .iter()
        .map(|l| {
            let space =
                ConfigSpace::enumerate(&l.shape, l.op.spec().parallel_dims(&l.shape), DEVICES);
            space.config((rng.next_u64() % space.len() as u64) as usize)
        })
        .collect()
}

/// Largest |a − b| over the largest |b|, per tensor.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn assert_same_training(graph: &Graph, strategies: &[(&str, Vec<ParallelConfig>)]) {
    let init = ParamStore::init(graph, 7);
    let sgd = Sgd::default();
    let mut reference = Trainer::new(graph.clone(), init.clone(), sgd, 11);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (images, labels) = batch(graph, step);
        losses.push(reference.step(&images, &labels).unwrap().loss);
    }
    for (name, configs) in strategies {
        let mut cluster =
            EmbeddedCluster::start(graph, configs, DEVICES, &init, sgd, 11, 0).unwrap();
        for step in 0..STEPS {
            let (images, labels) = batch(graph, step);
            let stats = cluster.step(images, labels, false).unwrap().stats;
            let want = losses[step as usize];
            assert!(
                (stats.loss - want).abs() <= TOLERANCE * want.abs(),
                "{}/{name} step {step}: loss {} vs {want}",
                graph.name,
                stats.loss
            );
        }
        let trained = cluster.params().unwrap();
        for (slot, p) in reference.params().params.iter().enumerate() {
            let err = relative_error(&trained.values[slot], &reference.params().values[slot]);
            assert!(
                err <= TOLERANCE,
                "{}/{name}: {} differs by {err:e}",
                graph.name,
                p.name
            );
        }
    }
}

fn all_strategies(graph: &Graph) -> Vec<(&'static str, Vec<ParallelConfig>)> {
    vec![
        ("data", searched(graph, SearchKind::Data)),
        ("model", searched(graph, SearchKind::Model)),
        ("owt", searched(graph, SearchKind::Owt)),
        ("optcnn", searched(graph, SearchKind::OptCnn)),
        ("random-1", random(graph, 1)),
        ("random-2", random(graph, 2)),
        ("random-3", random(graph, 3)),
    ]
}

#[test]
fn lenet5_every_strategy_matches_one_device() {
    let g = model("lenet5", 28);
    assert_same_training(&g, &all_strategies(&g));
}

#[test]
fn alexnet_every_strategy_matches_one_device() {
    let g = model("alexnet", 64);
    assert_same_training(&g, &all_strategies(&g));
}
