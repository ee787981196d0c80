//! Human tables and JSON of a plan (`legion-rs plan`, `legion_rs.plan`): presentation, kept out
//! of the planner.

use legion_ops::{Graph, Precision};
use legion_planner::ParallelConfig;
use legion_planner::cost::CostBreakdown;
use legion_planner::memory::human_bytes;
use legion_planner::plan::{Evaluated, PlanRun};
use legion_planner::search::{Optimality, RefineReport};
use legion_planner::strategy::{LayerStrategy, Strategy, describe_devices};
use serde::Serialize;
use std::fmt::Write;

/// Per layer: name, op, how many configs it has (`counts`), the chosen config and devices, t_c and t_s
/// in milliseconds.
pub fn layer_table(
    graph: &Graph,
    counts: &[usize],
    configs: &[ParallelConfig],
    cost: &CostBreakdown,
) -> String {
    let width = graph
        .layers()
        .iter()
        .map(|l| l.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:<22}  {:>7}  {:<16}  {:<8}  {:>10}  {:>10}",
        "layer", "op", "configs", "config", "devices", "t_c ms", "t_s ms"
    );
    for (((l, c), lc), count) in graph
        .layers()
        .iter()
        .zip(configs)
        .zip(&cost.layers)
        .zip(counts)
    {
        let devices: Vec<usize> = c.devices().collect();
        let _ = writeln!(
            out,
            "{:<width$}  {:<22}  {:>7}  {:<16}  {:<8}  {:>10.3}  {:>10.3}",
            l.name,
            l.op.kind(),
            count,
            c.to_string(),
            describe_devices(&devices),
            lc.compute * 1e3,
            lc.sync * 1e3
        );
    }
    let t_x: f64 = cost.edges.iter().map(|e| e.time).sum();
    let t_r: f64 = cost.layers.iter().map(|l| l.reduce).sum();
    let _ = write!(
        out,
        "Σ t_c {:.3} ms, Σ t_s {:.3} ms, Σ t_x {:.3} ms",
        cost.layers.iter().map(|l| l.compute).sum::<f64>() * 1e3,
        cost.layers.iter().map(|l| l.sync).sum::<f64>() * 1e3,
        t_x * 1e3
    );
    if configs.iter().any(|c| c.reduction() > 1) {
        // the partial sums and output gradients of the layers split over their input channels
        let _ = write!(out, ", Σ t_r {:.3} ms", t_r * 1e3);
    }
    out.push('\n');
    out
}

/// One line per search: Eq. 1, simulated step, bytes moved and search time; for the planners of
/// other papers also their own byte count (of the plan as they found it, and as mapped into our
/// configurations), and below the table what each mapping loses and where the refinement started.
pub fn comparison_table(run: &PlanRun) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<11}  {:>12}  {:>14}  {:>14}  {:>15}  {:>11}  {:>22}",
        "search",
        "Eq.1 ms",
        "simulated ms",
        "comm MB",
        "peak MB/device",
        "search ms",
        "native MB found/mapped"
    );
    for s in &run.searches {
        match &s.result {
            Ok(e) => {
                let native = match s.native {
                    Some(n) => format!("{:.1} / {:.1}", n.found / 1e6, n.mapped / 1e6),
                    None => "-".to_string(),
                };
                let _ = writeln!(
                    out,
                    "{:<11}  {:>12.3}  {:>14.3}  {:>14.1}  {:>15.1}  {:>11.2}  {:>22}",
                    s.kind.name(),
                    e.cost.total * 1e3,
                    e.simulated_s * 1e3,
                    e.cost.comm_bytes as f64 / 1e6,
                    e.peak_device.1 as f64 / 1e6,
                    s.seconds * 1e3,
                    native
                );
            }
            Err(err) => {
                let _ = writeln!(out, "{:<11}  failed: {err}", s.kind.name());
            }
        }
    }
    for s in &run.searches {
        if let Some(lossy) = s.lossy {
            let _ = writeln!(out, "{}: {lossy}", s.kind.name());
        }
        if let Some(refined) = &s.refined {
            let _ = writeln!(out, "{}", refine_line(refined));
        }
    }
    out
}

/// Where a refinement started, what it spent and how much faster in simulation it ended.
pub fn refine_line(r: &RefineReport) -> String {
    format!(
        "refine: from {} (simulated {:.3} ms) to simulated {:.3} ms ({:.2}% faster), {} of {} \
         simulations, {} moves accepted, seed {}",
        r.start,
        r.start_s * 1e3,
        r.refined_s * 1e3,
        (1.0 - r.refined_s / r.start_s) * 100.0,
        r.simulations,
        r.budget,
        r.accepted,
        r.seed
    )
}

/// A summary of one evaluated strategy: Eq. 1, simulated step and bytes.
pub fn summary(name: &str, e: &Evaluated, search_seconds: Option<f64>) -> String {
    let mut out = format!(
        "{name}: Eq.1 {:.3} ms, simulated {:.3} ms, {:.1} MB moved ({:.1} MB of activations and \
         their gradients, {:.1} MB of parameter sync; {:.1} MB between nodes), peak {} on device {}",
        e.cost.total * 1e3,
        e.simulated_s * 1e3,
        e.cost.comm_bytes as f64 / 1e6,
        e.cost.activation_bytes as f64 / 1e6,
        e.cost.sync_bytes as f64 / 1e6,
        e.cost.inter_node_bytes as f64 / 1e6,
        human_bytes(e.peak_device.1),
        e.peak_device.0
    );
    if let Some(s) = search_seconds {
        let _ = write!(out, ", search {:.2} ms", s * 1e3);
    }
    out
}

/// The `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct PlanJson {
    pub model: String,
    pub devices: usize,
    /// What the devices compute in (`--precision`): the element size of the activations moved.
    pub precision: Precision,
    /// Where t_c came from: `roofline`, or `profile <path>` (measured kernel times).
    pub t_c: String,
    pub searches: Vec<SearchJson>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SearchJson {
    pub search: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eq1_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulated_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<u64>,
    /// The part of `comm_bytes` that is activations and their gradients (t_x, t_r): half in bf16.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_bytes: Option<u64>,
    /// The part of `comm_bytes` that is parameter sync (t_s): fp32 in every precision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_bytes: Option<u64>,
    /// The part of `comm_bytes` between nodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_node_bytes: Option<u64>,
    /// What the fullest device keeps during a step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    pub search_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Vec<LayerStrategy>>,
    /// Eq. 1's terms: summed, and per layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eq1_parts: Option<Eq1Parts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A seed planner's own byte count of its plan as found and as mapped into our space.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub native_bytes_found: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub native_bytes_mapped: Option<f64>,
    /// What mapping a seed planner's plan into our configurations loses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lossy: Option<&'static str>,
    /// Where the refinement started and what it spent (refine only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refine: Option<RefineJson>,
    /// Whether the strategy is proven Eq. 1's optimum, and otherwise how close (optcnn only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimality: Option<OptimalityJson>,
}

/// Eq. 1's terms in the `--json` document, milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Eq1Parts {
    pub t_c_ms: f64,
    pub t_s_ms: f64,
    pub t_x_ms: f64,
    /// The partial sums of layers split over their input channels.
    pub t_r_ms: f64,
    pub layers: Vec<LayerCostJson>,
}

/// One layer's compute and parameter-sync time, milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct LayerCostJson {
    pub layer: String,
    pub t_c_ms: f64,
    pub t_s_ms: f64,
}

impl Eq1Parts {
    pub fn of(graph: &Graph, cost: &CostBreakdown) -> Eq1Parts {
        let ms = |s: f64| s * 1e3;
        Eq1Parts {
            t_c_ms: ms(cost.layers.iter().map(|l| l.compute).sum()),
            t_s_ms: ms(cost.layers.iter().map(|l| l.sync).sum()),
            t_x_ms: ms(cost.edges.iter().map(|e| e.time).sum()),
            t_r_ms: ms(cost.layers.iter().map(|l| l.reduce).sum()),
            layers: graph
                .layers()
                .iter()
                .zip(&cost.layers)
                .map(|(l, c)| LayerCostJson {
                    layer: l.name.clone(),
                    t_c_ms: ms(c.compute),
                    t_s_ms: ms(c.sync),
                })
                .collect(),
        }
    }
}

/// An [`Optimality`] in the `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct OptimalityJson {
    pub exact: bool,
    /// Eq. 1's optimum is at least this.
    pub lower_bound_ms: f64,
    /// How far above the lower bound the strategy's Eq. 1 may be, as a fraction of the bound.
    pub gap: f64,
    /// The layers whose configs were not proven optimal.
    pub inexact_layers: Vec<String>,
}

impl OptimalityJson {
    pub fn of(graph: &Graph, optimality: &Optimality, cost: f64) -> OptimalityJson {
        match optimality {
            Optimality::Exact => OptimalityJson {
                exact: true,
                lower_bound_ms: cost * 1e3,
                gap: 0.0,
                inexact_layers: Vec::new(),
            },
            Optimality::Bounded {
                lower_bound,
                layers,
            } => OptimalityJson {
                exact: false,
                lower_bound_ms: lower_bound * 1e3,
                gap: optimality.gap(cost),
                inexact_layers: layers
                    .iter()
                    .map(|&l| graph.layer(l).name.clone())
                    .collect(),
            },
        }
    }
}

/// What the text report says of a strategy not proven optimal: how close it is and which layers
/// were not solved exactly; `None` for an exact one.
pub fn optimality_line(graph: &Graph, optimality: &Optimality, cost: f64) -> Option<String> {
    let Optimality::Bounded {
        lower_bound,
        layers,
    } = optimality
    else {
        return None;
    };
    const NAMED: usize = 6;
    let mut names: Vec<&str> = layers
        .iter()
        .take(NAMED)
        .map(|&l| graph.layer(l).name.as_str())
        .collect();
    if layers.len() > NAMED {
        names.push("...");
    }
    Some(format!(
        "optcnn: within {:.2}% of Eq. 1's optimum (at least {:.3} ms): the eliminations left {} \
         layers ({}) joined too densely to enumerate, so their configs come from local search \
         and the others are optimal given them",
        optimality.gap(cost) * 100.0,
        lower_bound * 1e3,
        layers.len(),
        names.join(", ")
    ))
}

/// A [`RefineReport`] in the `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct RefineJson {
    /// The start fastest in simulation: optcnn, data, model or owt.
    pub start: String,
    pub start_simulated_ms: f64,
    pub simulated_ms: f64,
    pub simulations: u64,
    pub budget: u64,
    pub seed: u64,
    pub accepted_moves: u64,
}

impl RefineJson {
    pub fn of(r: &RefineReport) -> RefineJson {
        RefineJson {
            start: r.start.name().to_string(),
            start_simulated_ms: r.start_s * 1e3,
            simulated_ms: r.refined_s * 1e3,
            simulations: r.simulations,
            budget: r.budget,
            seed: r.seed,
            accepted_moves: r.accepted,
        }
    }
}

impl SearchJson {
    pub fn of(graph: &Graph, name: &str, result: Result<&Evaluated, String>, seconds: f64) -> Self {
        match result {
            Ok(e) => SearchJson {
                search: name.to_string(),
                eq1_ms: Some(e.cost.total * 1e3),
                simulated_ms: Some(e.simulated_s * 1e3),
                comm_bytes: Some(e.cost.comm_bytes),
                activation_bytes: Some(e.cost.activation_bytes),
                sync_bytes: Some(e.cost.sync_bytes),
                inter_node_bytes: Some(e.cost.inter_node_bytes),
                peak_device_bytes: Some(e.peak_device.1),
                search_ms: seconds * 1e3,
                strategy: Some(Strategy::from_configs(graph, &e.configs).layers),
                eq1_parts: Some(Eq1Parts::of(graph, &e.cost)),
                error: None,
                native_bytes_found: None,
                native_bytes_mapped: None,
                lossy: None,
                refine: None,
                optimality: None,
            },
            Err(error) => SearchJson {
                search: name.to_string(),
                eq1_ms: None,
                simulated_ms: None,
                comm_bytes: None,
                activation_bytes: None,
                sync_bytes: None,
                inter_node_bytes: None,
                peak_device_bytes: None,
                search_ms: seconds * 1e3,
                strategy: None,
                eq1_parts: None,
                error: Some(error),
                native_bytes_found: None,
                native_bytes_mapped: None,
                lossy: None,
                refine: None,
                optimality: None,
            },
        }
    }
}

impl PlanJson {
    pub fn of(graph: &Graph, run: &PlanRun, t_c: String, precision: Precision) -> PlanJson {
        PlanJson {
            model: run.model.clone(),
            precision,
            t_c,
            devices: run.devices,
            searches: run
                .searches
                .iter()
                .map(|s| {
                    let result = s.result.as_ref().map_err(|e| e.to_string());
                    SearchJson {
                        native_bytes_found: s.native.map(|n| n.found),
                        native_bytes_mapped: s.native.map(|n| n.mapped),
                        lossy: s.lossy,
                        refine: s.refined.as_ref().map(RefineJson::of),
                        optimality: s
                            .optimality
                            .as_ref()
                            .zip(s.result.as_ref().ok())
                            .map(|(o, e)| OptimalityJson::of(graph, o, e.cost.total)),
                        ..SearchJson::of(graph, s.kind.name(), result, s.seconds)
                    }
                })
                .collect(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plan reports serialize")
    }
}
