//! `legion_rs._legion`: the library front door (`legion`) for the Python package.
//!
//! Two functions, [`plan`] and [`train`], take what `legion-rs plan` and `legion-rs train` take
//! (a model as a zoo name or a file, its batch, the machine or devices, the search or strategy,
//! the data) and return what those print: a plan's table and JSON document; a run's weights and
//! summary. The Python half (`python/legion_rs/__init__.py`) turns torch modules, iterables and
//! state_dicts into these arguments and back.
//!
//! A run trains on a thread of its own while the calling thread, detached from the interpreter,
//! waits for its events: it hands each to the Python callback and checks for Ctrl-C between them,
//! which raises the run's stop signal (the run then ends after its current step, saves where it
//! was asked to, and releases its devices and workers before `KeyboardInterrupt` reaches Python).

mod feed;

use anyhow::Context;
use feed::PyFeed;
use legion::job::{HeldOut, JobEvent, Validation};
use legion::planning::{Planning, Searches};
use legion::{Data, DeviceKind, Precision, Sgd, StopSignal, Strategy, Training};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::time::Duration;

pyo3::create_exception!(
    _legion,
    LegionError,
    PyRuntimeError,
    "What legion-rs refused or what went wrong, located as the command line says it: the file, \
     layer, field or flag at fault, what was expected, and what to do."
);

/// An anyhow error as a Python exception, with its whole chain of context.
fn error(e: anyhow::Error) -> PyErr {
    LegionError::new_err(format!("{e:#}"))
}

/// The batch a plan uses when none is given: 32 per device, the paper's per-GPU batch.
const PLAN_BATCH_PER_DEVICE: usize = 32;

/// Plans `model` on a machine: a preset or machine file (`machine`), the embedded cluster's
/// devices (`devices`), or a cluster's workers (`cluster`, a hosts file). Returns the report as
/// `legion-rs plan` prints it and its `--json` document.
#[pyfunction]
#[pyo3(signature = (model, *, batch=None, image_size=None, classes=None, machine=None, devices=None, cluster=None, cluster_state=None, search="optcnn", costs="roofline", memory_gib=None, precision=None, budget=None))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    model: &str,
    batch: Option<usize>,
    image_size: Option<usize>,
    classes: Option<usize>,
    machine: Option<&str>,
    devices: Option<usize>,
    cluster: Option<PathBuf>,
    cluster_state: Option<PathBuf>,
    search: &str,
    costs: &str,
    memory_gib: Option<f64>,
    precision: Option<&str>,
    budget: Option<u64>,
) -> PyResult<(String, String)> {
    let costs = costs
        .parse::<legion::costs::Costs>()
        .map_err(|e| LegionError::new_err(format!("costs={costs:?}: {e}")))?;
    let searches: Searches = search
        .parse()
        .map_err(|e: String| LegionError::new_err(format!("search={search:?}: {e}")))?;
    let precision = parse_precision(precision)?;
    let model = model.to_string();
    py.detach(move || -> anyhow::Result<(String, String)> {
        let machine = match (machine, devices, &cluster) {
            (Some(spec), None, None) => legion::planner::machine_file::resolve_machine(spec)?,
            (None, Some(devices), None) => legion::machine::embedded_machine(devices)?,
            (None, None, Some(hosts)) => {
                let located =
                    legion::cluster::launch::locate(Some(hosts), cluster_state.as_deref())?;
                legion::machine::cluster_machine(&located.load_hosts()?, &located.state)?
            }
            _ => anyhow::bail!(
                "plan: give one of machine= (a preset such as 'paper:4', or a machine file), \
                 devices= (the embedded cluster's) or cluster= (a hosts file)"
            ),
        };
        let machine = match memory_gib {
            Some(gib) => machine.with_device_memory_gib(gib)?,
            None => machine,
        };
        let machine = machine.with_precision(precision.unwrap_or_default());
        let batch = batch.unwrap_or(PLAN_BATCH_PER_DEVICE * machine.num_devices());
        let graph = legion::resolve_model(&model, batch, image_size, classes)?.graph;
        // Measured costs are those of this machine's embedded devices.
        let embedded = devices.or_else(|| {
            machine
                .name()
                .strip_prefix("local-cpu:")
                .and_then(|n| n.parse().ok())
        });
        let priced = legion::costs::for_plan(
            &costs,
            embedded.filter(|_| cluster.is_none()),
            precision.unwrap_or_default(),
            legion::costs::CostCache::default_location().as_ref(),
        )
        .with_context(|| format!("costs={costs}"))?;
        let mut planning = Planning::new(graph, machine).search(searches);
        if let Some((db, source)) = priced {
            planning = planning.profile(db, source);
        }
        if let Some(budget) = budget {
            planning = planning.budget(budget);
        }
        let report = planning.run()?;
        Ok((report.to_string(), report.json().to_json()))
    })
    .map_err(error)
}

/// Named float32 arrays as the weights a run starts from.
fn checkpoint_of(
    tensors: Vec<(String, Bound<'_, PyAny>)>,
) -> PyResult<legion::ops::checkpoint::Checkpoint> {
    let tensors = tensors
        .into_iter()
        .map(|(name, array)| {
            let array: PyReadonlyArrayDyn<'_, f32> = array.extract().map_err(|_| {
                LegionError::new_err(format!(
                    "weights: {name}: expected a float32 numpy array, got {}",
                    type_name(&array)
                ))
            })?;
            let dims = array.shape();
            if dims.len() > legion::ops::shape::MAX_DIMS {
                return Err(LegionError::new_err(format!(
                    "weights: {name}: {} dimensions, at most {} are supported",
                    dims.len(),
                    legion::ops::shape::MAX_DIMS
                )));
            }
            let values = array.as_slice().map_err(|_| {
                LegionError::new_err(format!("weights: {name}: the array is not contiguous"))
            })?;
            Ok(legion::ops::checkpoint::NamedTensor::new(
                name,
                legion::Shape::new(dims),
                values.to_vec(),
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(legion::ops::checkpoint::Checkpoint {
        tensors,
        ..Default::default()
    })
}

/// A Python value's type, for errors.
fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "an object".into())
}

fn parse_precision(precision: Option<&str>) -> PyResult<Option<Precision>> {
    precision
        .map(|p| {
            p.parse::<Precision>()
                .map_err(|e| LegionError::new_err(format!("precision={p:?}: {e}")))
        })
        .transpose()
}

/// What a run reports as it goes, owned, to cross from its thread to the caller's.
enum Event {
    /// `kind` is `device`, `note` or `warning`.
    Line {
        kind: &'static str,
        line: String,
    },
    Planned {
        choice: String,
        devices: usize,
        place: String,
        remote_bytes: u64,
        strategy_json: String,
        /// What the search priced tiles with, as the plan's `costs:` line says it.
        costs: Option<String>,
    },
    Step(legion::StepDone),
    Evaluated(legion::job::Evaluation),
    Search {
        phase: &'static str,
        done: u64,
        total: u64,
    },
}

impl Event {
    fn of(event: &JobEvent<'_>) -> Option<Event> {
        let line = |kind, line: &str| Event::Line {
            kind,
            line: line.to_string(),
        };
        Some(match event {
            JobEvent::Device(l) => line("device", l),
            JobEvent::Note(l) => line("note", l),
            JobEvent::Warning(l) => line("warning", l),
            JobEvent::Planned(p) => Event::Planned {
                choice: p.choice.to_string(),
                devices: p.devices,
                place: p.place.clone(),
                remote_bytes: p.remote_bytes,
                strategy_json: serde_json::to_string(&p.strategy).unwrap_or_default(),
                costs: p.costs.as_ref().map(|c| c.to_string()),
            },
            JobEvent::Step(s) => Event::Step(**s),
            JobEvent::Evaluated(e) => Event::Evaluated(**e),
            JobEvent::Recovered(r) => line("recovered", &r.to_string()),
            JobEvent::Rejoined(r) => line("rejoined", &r.to_string()),
            JobEvent::Finished(_) => return None,
        })
    }

    /// The event as the dict a Python callback receives: `{"event": kind, ...}`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self {
            Event::Line { kind, line } => {
                d.set_item("event", *kind)?;
                d.set_item("line", line)?;
            }
            Event::Planned {
                choice,
                devices,
                place,
                remote_bytes,
                strategy_json,
                costs,
            } => {
                d.set_item("event", "planned")?;
                d.set_item("costs", costs)?;
                d.set_item("choice", choice)?;
                d.set_item("devices", devices)?;
                d.set_item("place", place)?;
                d.set_item("remote_bytes", remote_bytes)?;
                d.set_item("strategy_json", strategy_json)?;
            }
            Event::Step(s) => {
                d.set_item("event", "step")?;
                d.set_item("step", s.step)?;
                d.set_item("total_steps", s.total_steps)?;
                d.set_item("epoch", s.epoch)?;
                d.set_item("steps_per_epoch", s.steps_per_epoch)?;
                d.set_item("loss", s.loss)?;
                d.set_item("accuracy", s.accuracy)?;
                d.set_item("seconds", s.seconds)?;
                d.set_item("images_per_sec", s.images_per_sec)?;
            }
            Event::Evaluated(e) => {
                d.set_item("event", "evaluated")?;
                d.set_item("step", e.step)?;
                d.set_item("top1", e.accuracy.top1)?;
                d.set_item("top5", e.accuracy.top5)?;
                d.set_item("loss", e.accuracy.loss)?;
                d.set_item("samples", e.accuracy.samples)?;
                d.set_item("seconds", e.seconds)?;
            }
            Event::Search { phase, done, total } => {
                d.set_item("event", "search")?;
                d.set_item("phase", *phase)?;
                d.set_item("done", done)?;
                d.set_item("total", total)?;
            }
        }
        Ok(d)
    }
}

/// The search's phases, sent to the caller's thread.
struct SearchEvents(crossbeam_channel::Sender<Event>);

impl legion::planner::progress::Progress for SearchEvents {
    fn update(&self, phase: legion::planner::progress::Phase, done: u64, total: u64) {
        let _ = self.0.send(Event::Search {
            phase: phase.describe(),
            done,
            total,
        });
    }
}

/// Where a run's samples come from: a spec (`synthetic:N`, `folder:DIR`, `cifar10:PATH`) or an
/// iterator of `(images, labels)` numpy batches.
fn data_of(data: &Bound<'_, PyAny>, what: &str) -> PyResult<Data> {
    if let Ok(spec) = data.extract::<String>() {
        return spec
            .parse()
            .map_err(|e| LegionError::new_err(format!("{what}={spec:?}: {e}")));
    }
    Ok(Data::Feed(std::sync::Arc::new(PyFeed::new(data)?)))
}

/// Trains `model` and returns its trained weights and buffers, `[(name, array)]` in the model's
/// order (each array shaped as its tensor), and the run's summary as a dict. `on_event` receives
/// each event as a dict (see `Event::to_dict`).
#[pyfunction]
#[pyo3(signature = (model, *, batch, image_size=None, classes=None, data=None, devices=1, cluster=None, cluster_state=None, slurm=false, strategy="optcnn", costs="measured", replan=false, verify=3, max_recoveries=3, snapshot_every=None, data_on_driver=false, steps=None, epochs=None, lr=None, momentum=None, weight_decay=None, nesterov=false, seed=1, device="auto", weights=None, init=None, resume=None, save=None, checkpoint_every=None, save_strategy=None, precision=None, val_data=None, val_split=None, eval_every=None, memory_gib=None, label=None, on_event=None))]
#[allow(clippy::too_many_arguments)]
fn train<'py>(
    py: Python<'py>,
    model: &str,
    batch: usize,
    image_size: Option<usize>,
    classes: Option<usize>,
    data: Option<&Bound<'py, PyAny>>,
    devices: usize,
    cluster: Option<PathBuf>,
    cluster_state: Option<PathBuf>,
    slurm: bool,
    strategy: &str,
    costs: &str,
    replan: bool,
    verify: usize,
    max_recoveries: u32,
    snapshot_every: Option<u64>,
    data_on_driver: bool,
    steps: Option<u64>,
    epochs: Option<u64>,
    lr: Option<f32>,
    momentum: Option<f32>,
    weight_decay: Option<f32>,
    nesterov: bool,
    seed: u64,
    device: &str,
    weights: Option<Vec<(String, Bound<'py, PyAny>)>>,
    init: Option<PathBuf>,
    resume: Option<PathBuf>,
    save: Option<PathBuf>,
    checkpoint_every: Option<u64>,
    save_strategy: Option<PathBuf>,
    precision: Option<&str>,
    val_data: Option<&Bound<'py, PyAny>>,
    val_split: Option<f64>,
    eval_every: Option<u64>,
    memory_gib: Option<f64>,
    label: Option<String>,
    on_event: Option<Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyDict>)> {
    let device = DeviceKind::parse_flag(device)
        .map_err(|e| LegionError::new_err(format!("device={device:?}: {e}")))?;
    let precision = parse_precision(precision)?;
    let data = data.map(|d| data_of(d, "data")).transpose()?;
    let validation = match (val_data, val_split) {
        (Some(_), Some(_)) => {
            return Err(LegionError::new_err(
                "val_data= and val_split=: give one of them",
            ));
        }
        (Some(d), None) => Some(HeldOut::Data(data_of(d, "val_data")?)),
        (None, Some(fraction)) => Some(HeldOut::Split(fraction)),
        (None, None) => None,
    }
    .map(|data| Validation {
        data,
        every: eval_every,
    });
    let weights = weights.map(checkpoint_of).transpose()?;
    let stop = StopSignal::new();
    let (events, received) = crossbeam_channel::unbounded::<Event>();
    let model = model.to_string();
    let strategy = Strategy::from(strategy);
    let costs = costs
        .parse::<legion::costs::Costs>()
        .map_err(|e| LegionError::new_err(format!("costs={costs:?}: {e}")))?;
    let run_stop = stop.clone();
    let job = std::thread::Builder::new()
        .name("legion-train".into())
        .spawn(move || -> anyhow::Result<_> {
            let resolved = legion::resolve_model(&model, batch, image_size, classes)?;
            if let Some(summary) = &resolved.import {
                // A torch module's file is a graph exported for the run, its weights given apart.
                let mut summary = summary.clone();
                summary.has_weights |= weights.is_some();
                if let Some(label) = label {
                    summary.source_name = label;
                }
                let _ = events.send(Event::Line {
                    kind: "note",
                    line: summary.to_string(),
                });
            }
            let defaults = Sgd::default();
            let sgd = Sgd {
                lr: lr.unwrap_or(defaults.lr),
                momentum: momentum.unwrap_or(defaults.momentum),
                weight_decay: weight_decay.unwrap_or(defaults.weight_decay),
                nesterov,
            };
            let mut training = Training::new(resolved.graph)
                .devices(devices)
                .strategy(strategy)
                .costs(costs)
                .verify(verify)
                .recovery(max_recoveries, snapshot_every)
                .sgd(sgd)
                .seed(seed)
                .device(device)
                .stop_on(run_stop)
                .search_progress(std::sync::Arc::new(SearchEvents(events.clone())));
            if let Some(data) = data {
                training = training.data(data);
            }
            if data_on_driver {
                training = training.data_on_driver();
            }
            if let Some(weights) = weights.or(resolved.weights) {
                training = training.weights(weights);
            }
            if let Some(steps) = steps {
                training = training.steps(steps);
            }
            if let Some(epochs) = epochs {
                training = training.epochs(epochs);
            }
            if let Some(hosts) = cluster {
                training = training.cluster(hosts);
            }
            if slurm {
                training = training.slurm();
            }
            if let Some(state) = cluster_state {
                training = training.cluster_state(state);
            }
            if let Some(path) = init {
                training = training.init(path);
            }
            if let Some(path) = resume {
                training = training.resume(path);
            }
            if replan {
                training = training.replan();
            }
            if let Some(path) = save {
                training = training.save(path);
            }
            if let Some(k) = checkpoint_every {
                training = training.checkpoint_every(k);
            }
            if let Some(path) = save_strategy {
                training = training.save_strategy(path);
            }
            if let Some(p) = precision {
                training = training.precision(p);
            }
            if let Some(validation) = validation {
                training = training.validation(validation);
            }
            if let Some(gib) = memory_gib {
                training = training.memory_gib(gib);
            }
            training.start()?.run_keeping_state(|event| {
                if let Some(event) = Event::of(&event) {
                    let _ = events.send(event);
                }
            })
        })
        .map_err(|e| LegionError::new_err(format!("starting the training thread: {e}")))?;

    // Events until the run ends (its thread drops the sender); Ctrl-C or a failing callback
    // raises the stop signal and is raised itself once the run has stopped.
    let mut interrupted: Option<PyErr> = None;
    loop {
        let next = py.detach(|| received.recv_timeout(Duration::from_millis(50)));
        match next {
            Ok(event) => {
                if let (Some(callback), None) = (&on_event, &interrupted)
                    && let Err(e) = callback.call1((event.to_dict(py)?,))
                {
                    stop.raise();
                    interrupted = Some(e);
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
        if interrupted.is_none()
            && let Err(e) = py.check_signals()
        {
            stop.raise();
            interrupted = Some(e);
        }
    }
    let outcome = py
        .detach(|| job.join())
        .map_err(|_| LegionError::new_err("the training thread panicked"))?;
    if let Some(e) = interrupted {
        if e.is_instance_of::<PyKeyboardInterrupt>(py)
            && let Ok((summary, _)) = &outcome
        {
            let saved = match &summary.saved {
                Some(path) => format!("; saved to {}", path.display()),
                None => String::new(),
            };
            return Err(PyKeyboardInterrupt::new_err(format!(
                "stopped after step {} of the run{saved}",
                summary.steps
            )));
        }
        return Err(e);
    }
    let (summary, state) = outcome.map_err(error)?;
    let tensors = PyList::empty(py);
    let legion::ops::train::ParamStore { params, values, .. } = state.params;
    for (param, values) in params.into_iter().zip(values) {
        let array = PyArray1::from_vec(py, values).reshape(param.spec.shape.dims())?;
        tensors.append((param.name, array))?;
    }
    Ok((tensors, summary_dict(py, &summary)?))
}

fn summary_dict<'py>(py: Python<'py>, s: &legion::TrainSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("model", &s.model)?;
    d.set_item("devices", s.devices)?;
    d.set_item("steps", s.steps)?;
    d.set_item("first_step", s.first_step)?;
    d.set_item("stopped", s.stopped)?;
    d.set_item("batch", s.batch)?;
    d.set_item("losses", &s.losses)?;
    d.set_item("images_per_sec", s.images_per_sec)?;
    d.set_item("wall_secs", s.wall_secs)?;
    d.set_item("saved", s.saved.as_ref().map(|p| p.display().to_string()))?;
    d.set_item("precision", s.precision.to_string())?;
    d.set_item("skipped_samples", s.skipped.count)?;
    d.set_item("input_bytes_per_step", s.input_bytes_per_step)?;
    if let Some(plan) = &s.plan {
        let p = PyDict::new(py);
        p.set_item("choice", plan.choice.to_string())?;
        p.set_item("devices", plan.devices)?;
        p.set_item("place", &plan.place)?;
        p.set_item("remote_bytes", plan.remote_bytes)?;
        p.set_item("idle_devices", &plan.idle_devices)?;
        p.set_item(
            "strategy_json",
            serde_json::to_string(&plan.strategy).unwrap_or_default(),
        )?;
        p.set_item("costs", plan.costs.as_ref().map(|c| c.to_string()))?;
        match &plan.verification {
            Some(v) => {
                let tried = PyList::empty(py);
                for c in &v.candidates {
                    let t = PyDict::new(py);
                    t.set_item("strategy", &c.label)?;
                    t.set_item("simulated_ms", c.simulated_ms)?;
                    t.set_item("measured_ms", c.measured_ms)?;
                    tried.append(t)?;
                }
                let d = PyDict::new(py);
                d.set_item("kept", &v.candidates[v.kept].label)?;
                d.set_item("candidates", tried)?;
                p.set_item("verification", d)?;
            }
            None => p.set_item("verification", py.None())?,
        }
        d.set_item("plan", p)?;
    } else {
        d.set_item("plan", py.None())?;
    }
    let validation = PyList::empty(py);
    for e in &s.validation {
        validation.append(Event::Evaluated(*e).to_dict(py)?)?;
    }
    d.set_item("validation", validation)?;
    Ok(d)
}

/// The names of the zoo's models.
#[pyfunction]
fn zoo_names() -> Vec<&'static str> {
    legion::ops::zoo::names()
}

#[pymodule]
fn _legion(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LegionError", m.py().get_type::<LegionError>())?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(zoo_names, m)?)?;
    Ok(())
}
