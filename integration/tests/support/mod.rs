//! What the equivalence tests share (each test binary uses its part of it): the models, batches
//! and strategies they train, and the single-device reference they are held to.
#![allow(dead_code)]

pub mod bf16;

use legion_ops::backend::cpu::{Cpu, CpuStream};
use legion_ops::train::{ParamStore, Sgd, Trainer, TrainingState};
use legion_ops::{Graph, Precision, zoo};
use legion_planner::search::{self, SearchKind};
use legion_planner::{
    ConfigSpace, CostModel, CostTables, MachineModel, ParallelConfig, RooflineCost, SearchSpace,
};

pub const DEVICES: usize = 4;
pub const STEPS: u64 = 3;
pub const TOLERANCE: f32 = 1e-4;
pub const ROUNDING_FACTOR: f32 = 10.0;

pub fn model(name: &str, image_size: usize) -> Graph {
    let z = zoo::find(name).unwrap();
    let cfg = zoo::ZooConfig {
        image_size,
        classes: 10,
        ..z.default_config(8)
    };
    z.build(&cfg).unwrap()
}

/// A small net of the element-wise unary ops (`op::Unary`, every one of the family: sigmoid and
/// tanh where the recipe for adding an op first placed them, the others after the first dense
/// layer) between the zoo's own: conv, pooling, dense, the loss.
pub fn recipe_net() -> Graph {
    use legion_ops::GraphBuilder;
    use legion_ops::op::{Conv2d, Dense, Pool2d, Unary};
    let mut m = GraphBuilder::new("recipe_net");
    let x = m
        .input("data", legion_ops::Shape::nchw(8, 3, 12, 12))
        .unwrap();
    let c = m.conv2d("conv", x, Conv2d::new(8, 3).padding(1)).unwrap();
    let s = m.unary("gate", c, Unary::Sigmoid).unwrap();
    let p = m.pool2d("pool", s, Pool2d::avg(2).stride(2)).unwrap();
    let t = m.unary("pool.tanh", p, Unary::Tanh).unwrap();
    let f = m.flatten("flatten", t).unwrap();
    let h = m.dense("fc1", f, Dense::new(16)).unwrap();
    let mut h = m.unary("fc1.sigmoid", h, Unary::Sigmoid).unwrap();
    for &op in Unary::ALL {
        if !matches!(op, Unary::Sigmoid | Unary::Tanh) {
            h = m.unary(&format!("fc1.{op}"), h, op).unwrap();
        }
    }
    let y = m.dense("fc2", h, Dense::new(10)).unwrap();
    m.softmax_cross_entropy("loss", y).unwrap();
    m.finish()
}

/// The blocks of MobileNetV2 and EfficientNet, small: a depthwise convolution, ReLU6 and SiLU
/// after batch norm, squeeze-and-excitation (a global average, 1×1 convolutions, LeakyReLU of
/// slope 0.2, a hard sigmoid, and the channel scale multiplying the feature map, whose gradient
/// is summed over H and W), a 1×1 projection and a residual sum; then SqueezeNet's ceil_mode max
/// pool (12 rows into 6 windows, the last one partial) and an adaptive average pool whose windows
/// overlap (6 into 4).
pub fn mobile_block_net() -> Graph {
    use legion_ops::GraphBuilder;
    use legion_ops::op::{BatchNorm, Conv2d, Dense, Pool2d, Unary, UnaryOp};
    let mut m = GraphBuilder::new("mobile_block");
    let x = m
        .input("data", legion_ops::Shape::nchw(8, 3, 12, 12))
        .unwrap();
    let c = m.conv2d("stem", x, Conv2d::new(8, 3).padding(1)).unwrap();
    let c = m.batch_norm("stem.bn", c, BatchNorm::default()).unwrap();
    let c = m.unary("stem.relu6", c, Unary::Relu6).unwrap();
    let depthwise = Conv2d::new(8, 3).padding(1).groups(8).no_bias();
    let d = m.conv2d("dw", c, depthwise).unwrap();
    let d = m.batch_norm("dw.bn", d, BatchNorm::default()).unwrap();
    let d = m.unary("dw.silu", d, Unary::Silu).unwrap();
    let s = m.global_avg_pool("se.pool", d).unwrap();
    let s = m.conv2d("se.fc1", s, Conv2d::new(4, 1)).unwrap();
    let leaky = UnaryOp::with_alpha(Unary::LeakyRelu, 0.2);
    let s = m.unary("se.leaky", s, leaky).unwrap();
    let s = m.conv2d("se.fc2", s, Conv2d::new(8, 1)).unwrap();
    let s = m.unary("se.gate", s, Unary::Hardsigmoid).unwrap();
    let scaled = m.mul("se.scale", d, s).unwrap();
    let p = m.conv2d("project", scaled, Conv2d::new(8, 1)).unwrap();
    let sum = m.add("residual", p, c).unwrap();
    let pooled = m
        .pool2d("pool", sum, Pool2d::max(3).stride(2).ceil_mode())
        .unwrap();
    let pooled = m.adaptive_avg_pool2d("adaptive", pooled, [4, 4]).unwrap();
    let f = m.flatten("flatten", pooled).unwrap();
    let y = m.dense("fc", f, Dense::new(10)).unwrap();
    m.softmax_cross_entropy("loss", y).unwrap();
    m.finish()
}

/// Batch norm (plain and fused with ReLU), a residual add and a branch/concat, in a network
/// shallow enough that f32 rounding is not amplified.
pub fn small_bn_net() -> Graph {
    use legion_ops::GraphBuilder;
    use legion_ops::op::{BatchNorm, Conv2d, Dense, Pool2d};
    let mut m = GraphBuilder::new("bn_branches");
    let x = m
        .input("data", legion_ops::Shape::nchw(8, 3, 16, 16))
        .unwrap();
    let c = m.conv2d("stem", x, Conv2d::new(16, 3).padding(1)).unwrap();
    let s = m
        .batch_norm("stem.bn", c, BatchNorm::default().relu())
        .unwrap();
    let a = m.conv2d("a", s, Conv2d::new(8, 1)).unwrap();
    let a = m.batch_norm("a.bn", a, BatchNorm::default()).unwrap();
    let b = m.conv2d("b", s, Conv2d::new(8, 3).padding(1)).unwrap();
    let b = m
        .batch_norm("b.bn", b, BatchNorm::default().relu())
        .unwrap();
    let cat = m.concat("cat", &[a, b]).unwrap();
    let sum = m.add("residual", cat, s).unwrap();
    let p = m.pool2d("pool", sum, Pool2d::max(2).stride(2)).unwrap();
    let f = m.flatten("flatten", p).unwrap();
    let y = m.dense("fc", f, Dense::new(10)).unwrap();
    m.softmax_cross_entropy("loss", y).unwrap();
    m.finish()
}

pub fn batch(graph: &Graph, step: u64) -> (Vec<f32>, Vec<u32>) {
    let n = graph.layer(graph.input()).shape.numel();
    let images = (0..n)
        .map(|i| ((i as f32) * 0.37 + step as f32).sin())
        .collect();
    let labels = (0..graph.batch() as u32)
        .map(|i| (i * 7 + step as u32) % 10)
        .collect();
    (images, labels)
}

pub fn searched(graph: &Graph, kind: SearchKind) -> Vec<ParallelConfig> {
    searched_in(graph, kind, SearchSpace::Paper)
}

/// The strategy `kind` finds for `graph` on 4 P100s, choosing from `space`.
pub fn searched_in(graph: &Graph, kind: SearchKind, space: SearchSpace) -> Vec<ParallelConfig> {
    let machine = MachineModel::preset(&format!("paper:{DEVICES}")).unwrap();
    let provider = RooflineCost::new(&machine);
    let cost = CostModel::new(graph, &machine, &provider);
    let tables = CostTables::build_in(&cost, space);
    search::find(kind, &tables, search::DEFAULT_BUDGET)
        .unwrap()
        .configs
}

/// Every strategy family the suite holds to one device: the searches', the seed planners' and
/// random valid ones.
pub fn all_strategies(graph: &Graph) -> Vec<(&'static str, Vec<ParallelConfig>)> {
    vec![
        ("data", searched(graph, SearchKind::Data)),
        ("model", searched(graph, SearchKind::Model)),
        ("owt", searched(graph, SearchKind::Owt)),
        ("optcnn", searched(graph, SearchKind::OptCnn)),
        ("soybean", searched(graph, SearchKind::Soybean)),
        ("tofu", searched(graph, SearchKind::Tofu)),
        ("hypar", searched(graph, SearchKind::Hypar)),
        ("spartan", searched(graph, SearchKind::Spartan)),
        ("random-1", random(graph, 1)),
        ("random-2", random(graph, 2)),
        ("random-3", random(graph, 3)),
    ]
}

pub fn random(graph: &Graph, seed: u64) -> Vec<ParallelConfig> {
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

/// A random valid strategy in the larger space: a random config per layer and, on a conv2d or
/// dense layer whose blocks leave devices to spare, a random reduction split (its partials on
/// the blocks' devices times the split, from device 0).
pub fn random_with_reductions(graph: &Graph, seed: u64) -> Vec<ParallelConfig> {
    let mut rng = legion_ops::rng::Rng::new(seed);
    graph
        .ids()
        .map(|id| {
            let l = graph.layer(id);
            let space =
                ConfigSpace::enumerate(&l.shape, l.op.spec().parallel_dims(&l.shape), DEVICES);
            let config = space.config((rng.next_u64() % space.len() as u64) as usize);
            let channels = l.op.spec().reduction_channels(&graph.input_shapes(id));
            let spare = DEVICES / config.total();
            let choices: Vec<usize> = [1, 2, 4]
                .into_iter()
                .filter(|&r| r == 1 || (r <= spare && channels.is_some_and(|c| r <= c)))
                .collect();
            let red = choices[(rng.next_u64() % choices.len() as u64) as usize];
            match red {
                1 => config,
                red => config.with_reduction(red).with_first_device(0),
            }
        })
        .collect()
}

/// The strategy families the cross-checks try on `graph` (4 P100s): data, model and OWT as the
/// searches give them, `random` random strategies (seeds 1, 2, …) and `reductions` random ones
/// with reduction splits.
pub fn strategy_families(
    graph: &Graph,
    random: u64,
    reductions: u64,
) -> Vec<(String, Vec<ParallelConfig>)> {
    let machine = MachineModel::preset(&format!("paper:{DEVICES}")).unwrap();
    let provider = RooflineCost::new(&machine);
    let cost = CostModel::new(graph, &machine, &provider);
    let tables = CostTables::build(&cost);
    let mut out: Vec<(String, Vec<ParallelConfig>)> =
        [SearchKind::Data, SearchKind::Model, SearchKind::Owt]
            .into_iter()
            .map(|kind| {
                let found = search::find(kind, &tables, search::DEFAULT_BUDGET).unwrap();
                (format!("{kind:?}"), found.configs)
            })
            .collect();
    for seed in 1..=random {
        out.push((format!("random-{seed}"), self::random(graph, seed)));
    }
    for seed in 1..=reductions {
        out.push((format!("red-{seed}"), random_with_reductions(graph, seed)));
    }
    out
}

pub fn reduction_strategies(graph: &Graph) -> Vec<(&'static str, Vec<ParallelConfig>)> {
    let names = ["red-1", "red-2", "red-3", "red-4"];
    let strategies: Vec<_> = names
        .iter()
        .zip(11..)
        .map(|(&name, seed)| (name, random_with_reductions(graph, seed)))
        .collect();
    let split = strategies
        .iter()
        .flat_map(|(_, c)| c)
        .filter(|c| c.reduction() > 1)
        .count();
    assert!(split > 0, "{}: no layer drew a reduction split", graph.name);
    strategies
}

/// Bytes a simulated step moves between devices: its copies, gradient copies and sync messages.
pub fn simulated_bytes(sim: &legion_planner::simulate::Simulation) -> u64 {
    use legion_planner::simulate::TaskKind;
    sim.tasks
        .iter()
        .filter(|t| {
            matches!(
                t.kind,
                TaskKind::Copy | TaskKind::GradientCopy | TaskKind::Sync
            )
        })
        .map(|t| t.bytes)
        .sum()
}

/// Largest |a − b| over the largest |b|, per tensor.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The reference trained from `init`: its parameters and per-step losses.
pub fn reference_run(graph: &Graph, init: &ParamStore) -> (ParamStore, Vec<f32>) {
    reference_run_in(graph, init, Precision::Fp32, STEPS)
}

/// [`reference_run`] computing in `precision`, for `steps` steps.
pub fn reference_run_in(
    graph: &Graph,
    init: &ParamStore,
    precision: Precision,
    steps: u64,
) -> (ParamStore, Vec<f32>) {
    let mut reference = trainer_in(graph, init, precision);
    let losses = (0..steps)
        .map(|step| {
            let (images, labels) = batch(graph, step);
            reference.step(&images, &labels).unwrap().loss
        })
        .collect();
    (reference.params().unwrap(), losses)
}

/// The one-device trainer on the CPU from `init`, computing in `precision` (in bf16 the CPU
/// backend stores bf16 where a GPU does).
pub fn trainer_in(graph: &Graph, init: &ParamStore, precision: Precision) -> Trainer<Cpu> {
    if precision != Precision::Bf16 {
        return Trainer::new(graph.clone(), init.clone(), Sgd::default(), 11);
    }
    let (cpu, state) = (Cpu::new(precision), TrainingState::start(init.clone()));
    let mut trainer =
        Trainer::resume_on(cpu, CpuStream, graph.clone(), state, Sgd::default(), 11).unwrap();
    trainer.set_capture(legion_ops::capture::CaptureSetting::Off);
    trainer
}

/// How far each tensor of the reference moves when its initial weights are perturbed at the level
/// of f32 rounding (relative 1e-7): the closest any other summation order can be expected to get.
pub struct Sensitivity {
    /// Per tensor, relative.
    pub tensors: Vec<f32>,
    /// Per step, relative.
    pub losses: Vec<f32>,
}

pub fn rounding_sensitivity(
    graph: &Graph,
    init: &ParamStore,
    trained: &ParamStore,
    losses: &[f32],
) -> Sensitivity {
    let mut perturbed = init.clone();
    let mut rng = legion_ops::rng::Rng::new(3);
    for v in &mut perturbed.values {
        for x in v.iter_mut() {
            *x *= 1.0 + 1e-7 * ((rng.next_u64() % 2001) as f32 / 1000.0 - 1.0);
        }
    }
    let (moved, moved_losses) = reference_run(graph, &perturbed);
    Sensitivity {
        tensors: moved
            .values
            .iter()
            .zip(&trained.values)
            .map(|(a, b)| relative_error(a, b))
            .collect(),
        losses: moved_losses
            .iter()
            .zip(losses)
            .map(|(a, b)| (a - b).abs() / b.abs())
            .collect(),
    }
}
