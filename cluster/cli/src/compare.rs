//! `--compare`: every strategy on the same (embedded or multi-process) cluster, one after another, measured side by side
//! and set against the planner's simulation of each (priced by a profile of that strategy's tiles,
//! taken right before it runs).

use anyhow::Context;
use legion::costs::{self, CostCache, Costs};
use legion::job::{Strategy, choose_strategy_ranked};
use legion::machine::{cluster_machine, embedded_machine};
use legion_cluster::engine::{self, JobStart, NextBatch, Place, SamplesToRead, StepBatch};
use legion_cluster::hosts::Hosts;
use legion_ops::Graph;
use legion_ops::data::{Data, DataSource, Transforms};
use legion_ops::train::{LossReadback, ParamStore, Sgd, TrainingState};
use legion_planner::profile::ProfileDb;
use legion_planner::search::SearchKind;
use legion_planner::simulate::simulate;
use legion_planner::{CostModel, MachineModel, ProfiledCost};
use legion_profile::{self as profile, ProfileSettings};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The searches `--compare` runs unless told otherwise, baseline first.
pub const STRATEGIES: [&str; 4] = ["data", "model", "owt", "optcnn"];

/// Every search `--compare --strategies all` runs: [`STRATEGIES`], then the other searches
/// (ours, then the other papers' planners) but the exhaustive one, which finishes only on
/// small graphs.
pub fn all_strategies() -> Vec<&'static str> {
    let rest = SearchKind::every()
        .filter(|&k| k != SearchKind::Exhaustive)
        .map(SearchKind::name)
        .filter(|name| !STRATEGIES.contains(name));
    STRATEGIES.into_iter().chain(rest).collect()
}

/// The strategies a `--strategies` list names: `all`, or names separated by commas (searches or
/// strategy files), data parallelism first whether named or not (the speedups are over it).
pub fn strategies_from(list: &str) -> Vec<String> {
    let named: Vec<String> = match list.trim() {
        "all" => all_strategies().into_iter().map(str::to_string).collect(),
        list => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    };
    std::iter::once("data".to_string())
        .chain(named.into_iter().filter(|s| s != "data"))
        .collect()
}

/// One strategy's measurements.
#[derive(Clone, Debug, Serialize)]
pub struct CompareRow {
    pub strategy: String,
    pub measured_ms: f64,
    pub images_per_sec: f64,
    pub comm_bytes_per_step: u64,
    pub simulated_ms: f64,
    /// (simulated − measured) / measured.
    pub simulation_error: f64,
    /// Measured throughput over data parallelism's.
    pub speedup_over_data: f64,
    /// After the same steps on the same batches, the largest difference of any weight or momentum
    /// from the single-device trainer's, relative to that tensor's largest magnitude: every
    /// strategy trains the same network.
    pub max_rel_diff_from_one_device: f64,
    /// The same difference between one device and one device started from weights perturbed at
    /// f32 rounding (one unit in the last place, up or down at random): how far the model's own
    /// sensitivity to rounding carries over these steps. A strategy's difference at this floor is
    /// that sensitivity; one well above it is not.
    pub floor_rel_diff: f64,
}

/// How long to measure, and where.
#[derive(Clone, Debug)]
pub struct CompareSettings {
    /// Devices of the embedded cluster (ignored with `cluster`).
    pub devices: usize,
    pub warmup: usize,
    pub steps: usize,
    pub seed: u64,
    /// Run on the worker processes of this cluster instead of the embedded one.
    pub cluster: Option<ClusterTarget>,
    /// What to run, data parallelism first ([`strategies_from`]; [`STRATEGIES`] by default).
    pub strategies: Vec<String>,
    /// Write each strategy's measured and simulated timelines here, as Chrome/Perfetto traces
    /// `<strategy>.measured.json` and `<strategy>.simulated.json` (one more step, traced, after the
    /// timed ones: tracing costs time).
    pub traces: Option<PathBuf>,
    /// What the searches price tiles with, as a training run's do (on a cluster: what its
    /// workers measure).
    pub costs: Costs,
    pub cost_cache: Option<CostCache>,
}

/// A running cluster (`legion-rs up`).
#[derive(Clone, Debug)]
pub struct ClusterTarget {
    pub hosts: Hosts,
    pub state: PathBuf,
}

/// Profiles, measures and simulates every strategy of `settings.strategies` on `graph`, one
/// strategy at a time, and checks that each ends with the single-device trainer's weights.
///
/// Tile compute times always come from profiling the embedded cluster in this process (the same
/// kind of device). On a cluster, the links between hosts are those `up` measured, and a cluster
/// whose workers all run on this machine shares its cores, as the embedded one does.
pub fn compare(graph: &Graph, settings: &CompareSettings) -> anyhow::Result<Vec<CompareRow>> {
    let (machine, devices) = match &settings.cluster {
        Some(c) => (cluster_machine(&c.hosts, &c.state)?, c.hosts.num_devices()),
        None => (embedded_machine(settings.devices)?, settings.devices),
    };
    // The searches price as a training run's would: with what these devices measured.
    let measure_on = match &settings.cluster {
        None => costs::Devices::EmbeddedCpu { devices },
        Some(c) => costs::Devices::Workers {
            hosts: &c.hosts,
            state: &c.state,
        },
    };
    let pricing = costs::prepare(
        &settings.costs,
        graph,
        measure_on,
        legion_ops::Precision::Fp32,
        settings.cost_cache.as_ref(),
        None,
    )?;
    let search_machine = match (&pricing.db, &settings.cluster) {
        (Some(db), None) => db.apply_to(machine.clone()),
        _ => machine.clone(),
    };
    let strategies = settings
        .strategies
        .iter()
        .map(|s| {
            let configs = choose_strategy_ranked(
                "--strategies",
                graph,
                &search_machine,
                &Strategy::from(s.as_str()),
                pricing.db.as_ref(),
                None,
                0,
            )?
            .configs;
            Ok((s.to_string(), configs))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if settings.cluster.is_none() {
        for (_, configs) in &strategies {
            legion_cluster::memory::check_this_host(graph, Some((configs, devices)))?;
        }
    }
    let profile_settings = ProfileSettings {
        device_kind: machine.device(0).kind.clone(),
        seed: settings.seed,
        ..ProfileSettings::default()
    };
    let params = ParamStore::init(graph, settings.seed);
    let state = TrainingState::start(params);
    let (images, labels) = profile::synthetic_batch(graph, settings.seed)?;
    // On a cluster the workers draw the batch themselves, as a data-parallel peer's ranks do.
    let drawn = match &settings.cluster {
        Some(_) => Some(drawn_on_workers(graph, settings.seed)?),
        None => None,
    };
    // Every step trains on the same batch, which is also the next step's: a cluster job
    // delivers it (or has it read) while the step before runs, as training does.
    let batch = |trace, on_workers: bool| {
        let to_read = drawn.as_ref().map(|(_, read)| read).filter(|_| on_workers);
        StepBatch {
            images: match to_read {
                Some(_) => Vec::new(),
                None => images.clone(),
            },
            bytes: None,
            labels: labels.clone(),
            synthetic: None,
            to_read: to_read.cloned(),
            next: Some(match to_read {
                Some(read) => NextBatch::ToRead(read, &labels),
                None => NextBatch::Images(&images, &labels),
            }),
            trace,
        }
    };
    // What every strategy must end with: the single-device trainer after as many steps.
    let steps_taken = settings.warmup + settings.steps + usize::from(settings.traces.is_some());
    let one_device = |state: TrainingState| -> anyhow::Result<TrainingState> {
        let job = JobStart {
            graph,
            configs: &strategies[0].1,
            state,
            sgd: Sgd::default(),
            seed: settings.seed,
            precision: legion_ops::Precision::Fp32,
            inference: false,
        };
        let mut one = engine::start(Place::OneDevice(LossReadback::OneStepLate), job)?;
        for _ in 0..steps_taken {
            one.step(batch(false, false))?;
        }
        one.state()
    };
    let reference = one_device(state.clone())?;
    let floor = max_relative_difference(&one_device(perturbed(&state, settings.seed))?, &reference);
    let mut rows: Vec<CompareRow> = Vec::new();
    for entry in &strategies {
        let (strategy, configs) = entry;
        // The simulation is priced by what this strategy's tiles measure on this machine, so that
        // predicted and measured differ only by what the model leaves out; profiled right before
        // the strategy runs, as the speed of a shared machine drifts over minutes (two runs of
        // the shaped AlexNet comparison priced every kernel a uniform 13% apart, while the
        // model-parallel steps they measured were within 1% of each other).
        let measured = profile::profile(
            graph,
            devices,
            std::slice::from_ref(entry),
            &profile_settings,
        )
        .with_context(|| format!("profiling the {strategy} strategy"))?;
        let machine = match &settings.cluster {
            None => measured.db.apply_to(machine.clone()),
            Some(c) => profiled_cluster(machine.clone(), &c.hosts, &measured.db)?,
        };
        let cost = ProfiledCost::new(&measured.db, &machine);
        let model = CostModel::new(graph, &machine, &cost);
        let place = match &settings.cluster {
            // On the cores: the profile that prices the simulation is of CPU tiles.
            None => Place::Embedded {
                devices,
                placement: legion_runtime::Placement::Cpu,
            },
            Some(c) => Place::Cluster {
                hosts: &c.hosts,
                state_dir: &c.state,
                gpu: legion_cuda::Settings::default(),
                data: drawn.as_ref().map(|(source, _)| source),
            },
        };
        let job = JobStart {
            graph,
            configs,
            // a copy per strategy, dropped once its devices hold the weights
            state: state.clone(),
            sgd: Sgd::default(),
            seed: settings.seed,
            precision: legion_ops::Precision::Fp32,
            inference: false,
        };
        let mut engine = engine::start(place, job)?;
        for _ in 0..settings.warmup {
            engine.step(batch(false, true))?;
        }
        let t = Instant::now();
        for _ in 0..settings.steps {
            engine.step(batch(false, true))?;
        }
        let step_s = t.elapsed().as_secs_f64() / settings.steps.max(1) as f64;
        let simulation = simulate(&model, configs);
        if let Some(dir) = &settings.traces {
            let (_, reports) = engine.step(batch(true, true))?;
            let plan = engine.plan().context("a cluster engine has a step plan")?;
            let traces = [
                (
                    "measured",
                    legion_runtime::chrome_trace(plan, graph, &reports),
                ),
                (
                    "simulated",
                    legion_planner::trace::chrome_trace(&simulation, &machine),
                ),
            ];
            for (what, trace) in traces {
                let path = dir.join(format!("{strategy}.{what}.json"));
                legion_ops::atomic_file::write(&path, serde_json::to_string(&trace)?.as_bytes())
                    .with_context(|| format!("writing the trace {}", path.display()))?;
            }
        }
        let simulated_s = simulation.makespan;
        let trained = engine.state()?;
        rows.push(CompareRow {
            max_rel_diff_from_one_device: max_relative_difference(&trained, &reference),
            strategy: strategy.clone(),
            measured_ms: step_s * 1e3,
            images_per_sec: graph.batch() as f64 / step_s,
            comm_bytes_per_step: engine.plan().map_or(0, |p| p.remote_bytes()),
            simulated_ms: simulated_s * 1e3,
            simulation_error: (simulated_s - step_s) / step_s,
            speedup_over_data: 0.0,
            floor_rel_diff: floor,
        });
    }
    let data = rows[0].images_per_sec;
    for r in &mut rows {
        r.speedup_over_data = r.images_per_sec / data;
    }
    Ok(rows)
}

/// The cluster's machine with the profile's in-process link between devices of one host, the
/// runtime's own costs (dispatch, folds, updates, actor copies: workers run the same device actors
/// as the embedded cluster the profile measured), and its compute pool shared by every device when
/// all workers run on this machine.
fn profiled_cluster(
    mut machine: MachineModel,
    hosts: &Hosts,
    db: &ProfileDb,
) -> anyhow::Result<MachineModel> {
    if let Some(l) = &db.links {
        for range in hosts.device_ranges() {
            for a in range.clone() {
                for b in range.clone().filter(|&b| b != a) {
                    machine = machine.with_link(a, b, l.link())?;
                }
            }
        }
    }
    if let Some(costs) = db.runtime {
        machine = machine.with_runtime_costs(costs)?;
    }
    if let Some(threads) = db.compute_threads
        && hosts.hosts.iter().all(|h| h.is_local())
    {
        machine = machine.with_compute_slots(threads)?;
    }
    Ok(machine)
}

/// `state` with every weight moved by one unit in its last place, up or down as a seeded hash
/// of its position says: a start as close to `state`'s as f32 allows.
fn perturbed(state: &TrainingState, seed: u64) -> TrainingState {
    let mut moved = state.clone();
    for (i, values) in moved.params.values.iter_mut().enumerate() {
        for (j, v) in values.iter_mut().enumerate() {
            let up = legion_ops::rng::hash(&[seed, i as u64, j as u64]) & 1 == 1;
            *v = match (*v == 0.0, up) {
                // zero has no rounding to move by: biases and batch norm's shifts start there
                (true, _) => *v,
                (false, true) => v.next_up(),
                (false, false) => v.next_down(),
            };
        }
    }
    moved
}

/// The largest difference of any weight or momentum value of `a` from `b`'s, relative to the
/// largest magnitude of that tensor in `b`.
fn max_relative_difference(a: &TrainingState, b: &TrainingState) -> f64 {
    let tensors = a
        .params
        .values
        .iter()
        .zip(&b.params.values)
        .chain(a.momentum.iter().zip(&b.momentum));
    // a value that is not finite on either side (weights that diverged) is infinitely far: a
    // fold with `max` would pass over a NaN
    let difference = |x: &[f32], y: &[f32]| -> f64 {
        if !x.iter().chain(y).all(|v| v.is_finite()) {
            return f64::INFINITY;
        }
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        x.iter()
            .zip(y)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs() / scale))
            .into()
    };
    tensors.map(|(x, y)| difference(x, y)).fold(0f64, f64::max)
}

/// The comparison as a text table, with a note under it on what its last column measures.
pub fn table(rows: &[CompareRow]) -> String {
    let mut out = format!(
        "{:<8} {:>11} {:>9} {:>12} {:>12} {:>9} {:>9} {:>17} {:>9}\n",
        "strategy",
        "measured ms",
        "images/s",
        "moved/step",
        "simulated ms",
        "sim error",
        "vs data",
        "max rel diff vs 1",
        "floor"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<8} {:>11.1} {:>9.1} {:>12} {:>12.1} {:>8.1}% {:>8.2}x {:>17.1e} {:>9.1e}{}\n",
            r.strategy,
            r.measured_ms,
            r.images_per_sec,
            legion_cluster::memory::human_bytes(r.comm_bytes_per_step),
            r.simulated_ms,
            100.0 * r.simulation_error,
            r.speedup_over_data,
            r.max_rel_diff_from_one_device,
            r.floor_rel_diff,
            match above_floor(r) {
                true => "  above the floor",
                false => "",
            }
        ));
    }
    out.push_str(DIFF_NOTE);
    out
}

/// How many times the floor a strategy's difference may be and still read as the model's own
/// sensitivity: rounding differences of the same size grow alike, but not identically.
pub const FLOOR_MARGIN: f64 = 10.0;

/// Whether a strategy's difference from one device stands out above the run's floor.
pub fn above_floor(r: &CompareRow) -> bool {
    let floor = r.floor_rel_diff.max(1e-6);
    // a difference that is not a number (weights that diverged) stands out too
    r.max_rel_diff_from_one_device.is_nan() || r.max_rel_diff_from_one_device > FLOOR_MARGIN * floor
}

/// What the table's last two columns are, and why the first is not 0 although every strategy
/// trains the same network.
pub const DIFF_NOTE: &str = "max rel diff vs 1: after the same steps, the largest difference of \
any weight or momentum from the one-device trainer's, relative to that tensor's largest magnitude \
(a fraction: 1e-2 is 1%). Every strategy computes the same network, but splitting a layer changes \
the order of its sums, and the rounding differences this makes grow with the steps trained. floor: \
the same difference for one device started from weights one unit in the last place away, how far \
this model carries a rounding difference over these steps; a strategy at the floor differs by \
rounding alone, one more than 10x above it is marked.\n";

/// A bar chart of measured and simulated throughput per strategy, as SVG.
pub fn chart(rows: &[CompareRow], title: &str, path: &Path) -> anyhow::Result<()> {
    let svg = {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (720, 420)).into_drawing_area();
            root.fill(&WHITE)?;
            let simulated: Vec<f64> = rows
                .iter()
                .map(|r| r.images_per_sec * r.measured_ms / r.simulated_ms)
                .collect();
            let top = rows
                .iter()
                .map(|r| r.images_per_sec)
                .chain(simulated.iter().copied())
                .fold(0.0, f64::max)
                * 1.15;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(60)
                .build_cartesian_2d(0.0..rows.len() as f64, 0.0..top.max(1.0))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(0)
                .y_labels(8)
                .y_desc("images/s")
                .draw()?;
            // Strategy names centred under their pair of bars.
            for (i, r) in rows.iter().enumerate() {
                let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
                root.draw(&Text::new(
                    r.strategy.clone(),
                    (x, y + 8),
                    TextStyle::from(("sans-serif", 14).into_font())
                        .pos(Pos::new(HPos::Center, VPos::Top)),
                ))?;
            }
            let bar = |i: usize, offset: f64, value: f64, color: RGBColor| {
                let x = i as f64 + offset;
                Rectangle::new([(x, 0.0), (x + 0.35, value)], color.filled())
            };
            chart
                .draw_series(
                    rows.iter()
                        .enumerate()
                        .map(|(i, r)| bar(i, 0.12, r.images_per_sec, BLUE)),
                )?
                .label("measured")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], BLUE.filled()));
            chart
                .draw_series(
                    simulated
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| bar(i, 0.5, v, RED)),
                )?
                .label("simulated")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], RED.filled()));
            chart
                .configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.8))
                .draw()?;
            root.present()?;
        }
        svg
    };
    legion_ops::atomic_file::write(path, svg.as_bytes())
        .with_context(|| format!("writing the chart {}", path.display()))
}

/// The batch `profile::synthetic_batch` draws (samples `0..N` of seeded synthetic data), as a
/// cluster's workers open and read it themselves.
fn drawn_on_workers(graph: &Graph, seed: u64) -> anyhow::Result<(DataSource, SamplesToRead)> {
    let input = graph.layer(graph.input()).shape;
    let batch = input.dim(0);
    let image = [input.dim(1), input.dim(2), input.dim(3)];
    let classes = graph
        .logits()
        .map_or(1, |logits| graph.layer(logits).shape.dim(1));
    let data = Data::Synthetic { samples: batch };
    let dataset = data.open(image, classes, seed, Transforms::PLAIN)?;
    let plain = Transforms::PLAIN;
    let source = DataSource::of(&data, dataset.as_ref(), image, classes, seed, plain, None)
        .context("synthetic data is drawn anywhere")?;
    let read = SamplesToRead {
        epoch: 0,
        indices: (0..batch).collect(),
    };
    Ok((source, read))
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_planner::runtime_costs::RuntimeCosts;

    /// Equal states are 0 apart; a changed weight by its share of the tensor's largest value; a
    /// weight that diverged to NaN is infinitely far, never passed over.
    #[test]
    fn weights_that_diverged_are_infinitely_far_from_one_device() {
        let z = legion_ops::zoo::find("lenet5").unwrap();
        let graph = z.build(&z.default_config(4)).unwrap();
        let reference = TrainingState::start(ParamStore::init(&graph, 1));
        assert_eq!(max_relative_difference(&reference, &reference), 0.0);
        let mut moved = reference.clone();
        let largest = moved.params.values[0]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        moved.params.values[0][3] += 0.5 * largest;
        let d = max_relative_difference(&moved, &reference);
        assert!((d - 0.5).abs() < 1e-6, "{d}");
        let mut diverged = reference.clone();
        diverged.momentum[1][0] = f32::NAN;
        assert_eq!(
            max_relative_difference(&diverged, &reference),
            f64::INFINITY
        );
    }

    #[test]
    fn a_cluster_is_simulated_with_the_profiled_runtime_costs_and_shared_cores() {
        let hosts = Hosts::parse_toml(
            "[[host]]\nname = \"a\"\naddress = \"127.0.0.1\"\ndevices = 2\n\n\
             [[host]]\nname = \"b\"\naddress = \"127.0.0.1\"\nport = 7401\ndevices = 2\n",
            "hosts.toml",
        )
        .unwrap();
        let costs = RuntimeCosts {
            dispatch_s: 2e-5,
            runtime_cpu_s: 0.0,
            dispatch_bins_s: None,
            fold_bytes_per_s: 3e9,
            update_bytes_per_s: 2e9,
            copy_bytes_per_s: 4e9,
            actor_threads: 2,
        };
        let db = ProfileDb {
            compute_threads: Some(2),
            runtime: Some(costs),
            ..ProfileDb::default()
        };
        let machine =
            profiled_cluster(legion::machine::hosts_machine(&hosts).unwrap(), &hosts, &db).unwrap();
        assert_eq!(machine.runtime_costs(), Some(&costs));
        assert_eq!(machine.compute_slots(), Some(2));
        let unprofiled = profiled_cluster(
            legion::machine::hosts_machine(&hosts).unwrap(),
            &hosts,
            &ProfileDb::default(),
        )
        .unwrap();
        assert_eq!(unprofiled.runtime_costs(), None);
    }
}
