//! The runtime's overhead (what its actors, messages and copies add to the kernels), measured side
//! by side in one run because the machine is shared and noisy: compare the ratios, not the
//! absolute figures.
//!
//! ```text
//! cargo bench -p legion-integration --bench overhead                # all three sections
//! cargo bench -p legion-integration --bench overhead -- empty       # filters: empty, alexnet, plan
//! ```
//!
//! - `empty`: empty tasks per second per device actor. Each device runs a program of `TASKS`
//!   [`TaskKind::Empty`](legion_runtime::task::TaskKind::Empty) tasks (independent, or a
//!   dependent chain) on real device actors joined by the in-process transport, for 1, 2 and 4
//!   devices. The tasks take the path of any kernel (dependence counting, the compute queue, the
//!   rayon pool, the completion message), so this is what a task costs beyond its kernel.
//! - `alexnet`: a training step of AlexNet (batch 32, 64×64 and 224×224) with the single-device
//!   `Trainer` and with the runtime on one embedded device, every layer `ParallelConfig::serial(0)`:
//!   the same kernels, so the difference is the runtime. Steps alternate between the two so that
//!   noise hits both alike; overhead = (runtime − trainer) / runtime on the medians.
//! - `plan`: the one-time `StepPlan::build` for AlexNet, VGG-16 and Inception-v3 on 4 devices
//!   (batch 32 per device) under data parallelism and the OptCNN strategy.

use legion_ops::train::{ParamStore, Sgd, Trainer};
use legion_ops::{Graph, LayerId, zoo};
use legion_planner::search::{self, SearchKind};
use legion_planner::{CostModel, CostTables, MachineModel, ParallelConfig, RooflineCost};
use legion_runtime::EmbeddedCluster;
use legion_runtime::StepInput;
use legion_runtime::plan::StepPlan;
use legion_runtime::program::{EmptyDispatch, EmptyShape, Part, empty_program};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Empty tasks per device per step: enough that a step's fixed cost (messages to start it and
/// report) is noise.
const TASKS: u32 = 20_000;
const EMPTY_STEPS: u64 = 10;

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| f == name);
    if wanted("empty") {
        empty_tasks();
    }
    if wanted("alexnet") {
        alexnet_overhead();
    }
    if wanted("plan") {
        plan_build();
    }
}

fn empty_tasks() {
    println!("## empty tasks ({TASKS} per device per step, median of {EMPTY_STEPS} steps)");
    println!(
        "{:<8} {:<12} {:>7} {:>10} {:>18} {:>12}",
        "dispatch", "shape", "devices", "step ms", "tasks/s per actor", "tasks/s all"
    );
    // Any graph will do: empty tasks only name a layer, for error messages.
    let z = zoo::find("lenet5").expect("lenet5 is in the zoo");
    let graph = Arc::new(z.build(&z.default_config(1)).expect("lenet5 builds"));
    let runtime = legion_runtime::device_runtime();
    for dispatch in [EmptyDispatch::Pool, EmptyDispatch::Inline] {
        for shape in [EmptyShape::Independent, EmptyShape::Chain] {
            for devices in [1, 2, 4] {
                let step = empty_step_seconds(&runtime, &graph, dispatch, shape, devices);
                let per_actor = TASKS as f64 / step;
                println!(
                    "{:<8} {:<12} {devices:>7} {:>10.2} {per_actor:>18.0} {:>12.0}",
                    format!("{dispatch:?}").to_lowercase(),
                    format!("{shape:?}").to_lowercase(),
                    step * 1e3,
                    per_actor * devices as f64
                );
            }
        }
    }
    println!();
}

/// Median seconds of a step in which each of `devices` actors runs `TASKS` empty tasks.
fn empty_step_seconds(
    runtime: &tokio::runtime::Runtime,
    graph: &Arc<Graph>,
    dispatch: EmptyDispatch,
    shape: EmptyShape,
    devices: usize,
) -> f64 {
    let programs: Vec<_> = (0..devices)
        .map(|d| Arc::new(empty_program(d, TASKS, shape, dispatch, LayerId(0))))
        .collect();
    let actors = runtime
        .block_on(async { legion_runtime::spawn_devices(&programs, graph, 0, Sgd::default()) });
    let mut times = Vec::new();
    // Two warm-up steps: the first grows the actors' queues and wakes the pool's threads.
    for step in 0..EMPTY_STEPS + 2 {
        let input = Arc::new(StepInput::whole(step, Vec::new(), Vec::new(), 0));
        let t = Instant::now();
        let reports = runtime
            .block_on(legion_runtime::run_step(
                &actors,
                Part::Step,
                step,
                input,
                false,
            ))
            .expect("devices run");
        let elapsed = t.elapsed();
        assert!(reports.iter().all(|r| r.error.is_none()));
        if step >= 2 {
            times.push(elapsed.as_secs_f64());
        }
    }
    for a in &actors {
        a.kill();
    }
    median(&mut times)
}

fn synthetic_batch(graph: &Graph, step: u64) -> (Vec<f32>, Vec<u32>) {
    let n = graph.layer(graph.input()).shape.numel();
    let classes = graph
        .logits()
        .map(|l| graph.layer(l).shape.dim(1))
        .expect("a classifier");
    let images = (0..n)
        .map(|i| ((i as f32) * 0.37 + step as f32).sin())
        .collect();
    let labels = (0..graph.batch() as u64)
        .map(|i| ((i * 7 + step) % classes as u64) as u32)
        .collect();
    (images, labels)
}

fn alexnet_overhead() {
    println!("## AlexNet step, batch 32: single-device Trainer vs runtime on 1 device (serial)");
    println!(
        "{:<10} {:>6} {:>12} {:>12} {:>10} {:>16} {:>16}",
        "image",
        "steps",
        "trainer ms",
        "runtime ms",
        "overhead",
        "trainer faults",
        "runtime faults"
    );
    // (image size, measured steps per side): 224×224 steps take about a second each.
    for (image_size, steps) in [(64, 10), (224, 4)] {
        let z = zoo::find("alexnet").expect("alexnet is in the zoo");
        let cfg = zoo::ZooConfig {
            image_size,
            ..z.default_config(32)
        };
        let graph = z.build(&cfg).expect("alexnet builds");
        let params = ParamStore::init(&graph, 1);
        let sgd = Sgd::default();
        let mut trainer = Trainer::new(graph.clone(), params.clone(), sgd, 1);
        let serial = vec![ParallelConfig::serial(0); graph.layers().len()];
        let mut cluster = EmbeddedCluster::launch(&graph, &serial, 1, &params)
            .sgd(sgd)
            .start()
            .expect("plan");
        let (mut t_trainer, mut t_runtime) = (Vec::new(), Vec::new());
        let (mut f_trainer, mut f_runtime) = (Vec::new(), Vec::new());
        // One warm-up step each: the first steps allocate the kernels' scratch.
        for step in 0..steps + 1 {
            let (images, labels) = synthetic_batch(&graph, step);
            let mut run_trainer = || {
                let (t, faults) = (Instant::now(), minor_faults());
                trainer.step(&images, &labels).expect("trainer step");
                (t.elapsed().as_secs_f64(), minor_faults() - faults)
            };
            let mut run_runtime = || {
                let (t, faults) = (Instant::now(), minor_faults());
                cluster
                    .step(images.clone(), labels.clone(), false)
                    .expect("runtime step");
                (t.elapsed().as_secs_f64(), minor_faults() - faults)
            };
            // Alternate who goes first, so that neither always inherits the other's caches.
            let (trainer_s, runtime_s) = if step % 2 == 0 {
                (run_trainer(), run_runtime())
            } else {
                let r = run_runtime();
                (run_trainer(), r)
            };
            if step > 0 {
                t_trainer.push(trainer_s.0);
                t_runtime.push(runtime_s.0);
                f_trainer.push(trainer_s.1 as f64);
                f_runtime.push(runtime_s.1 as f64);
            }
        }
        let (a, b) = (median(&mut t_trainer), median(&mut t_runtime));
        println!(
            "{:<10} {steps:>6} {:>12.1} {:>12.1} {:>9.1}% {:>16.0} {:>16.0}",
            format!("{image_size}×{image_size}"),
            a * 1e3,
            b * 1e3,
            (b - a) / b * 100.0,
            median(&mut f_trainer),
            median(&mut f_runtime),
        );
    }
    println!();
}

fn plan_build() {
    const DEVICES: usize = 4;
    println!(
        "## StepPlan::build on {DEVICES} devices, batch {}",
        32 * DEVICES
    );
    println!(
        "{:<13} {:<7} {:>7} {:>10} {:>12}",
        "model", "strategy", "ops", "median ms", "runs"
    );
    let machine = MachineModel::preset(&format!("paper:{DEVICES}")).expect("paper preset");
    let provider = RooflineCost::new(&machine);
    for name in ["alexnet", "vgg16", "inception_v3"] {
        let z = zoo::find(name).expect("in the zoo");
        let graph = z.build(&z.default_config(32 * DEVICES)).expect("builds");
        let cost = CostModel::new(&graph, &machine, &provider);
        let tables = CostTables::build(&cost);
        for kind in [SearchKind::Data, SearchKind::OptCnn] {
            let configs = search::find(kind, &tables, search::DEFAULT_BUDGET)
                .expect("a strategy")
                .configs;
            let mut times = Vec::new();
            let mut ops = 0;
            let started = Instant::now();
            // At least 3 builds, at most 10, and no more once 10 s are spent.
            while times.len() < 3
                || (times.len() < 10 && started.elapsed() < Duration::from_secs(10))
            {
                let t = Instant::now();
                let plan = StepPlan::build(&graph, &configs, DEVICES).expect("plans");
                times.push(t.elapsed().as_secs_f64());
                ops = plan.programs.iter().map(|p| p.ops.len()).sum::<usize>();
            }
            println!(
                "{name:<13} {:<8} {ops:>7} {:>10.1} {:>12}",
                format!("{kind:?}").to_lowercase(),
                median(&mut times) * 1e3,
                times.len()
            );
        }
    }
    println!();
}

/// Minor page faults of this process so far (field 10 of `/proc/self/stat`; 0 where there is
/// none). A step that allocates its tensors afresh faults their pages in again every step.
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the parenthesised command name, which may contain spaces.
            let rest = s.rsplit_once(')')?.1;
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
