//! `--compare`: every strategy on the same embedded cluster, one after another, measured side by side
//! and set against the planner's simulation of each (priced by a profile of these very runs).

use crate::job::{choose_strategy, embedded_machine};
use anyhow::Context;
use legion_ops::Graph;
use legion_ops::train::{ParamStore, Sgd};
use legion_planner::simulate::simulate;
use legion_planner::{CostModel, ProfiledCost};
use legion_runtime::embedded::EmbeddedCluster;
use legion_runtime::profile::{self, ProfileSettings};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;
use std::path::Path;

/// The searches `--compare` runs, baseline first.
pub const STRATEGIES: [&str; 4] = ["data", "model", "owt", "optcnn"];

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
}

/// How long to measure.
#[derive(Clone, Copy, Debug)]
pub struct CompareSettings {
    pub devices: usize,
    pub warmup: usize,
    pub steps: usize,
    pub seed: u64,
}

/// Profiles, measures and simulates every strategy of [`STRATEGIES`] on `graph`.
pub fn compare(graph: &Graph, settings: CompareSettings) -> anyhow::Result<Vec<CompareRow>> {
    let machine = embedded_machine(settings.devices)?;
    let strategies = STRATEGIES
        .iter()
        .map(|s| Ok((s.to_string(), choose_strategy(graph, &machine, s)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The simulation is priced by what these strategies' tiles measure on this machine, so that
    // predicted and measured differ only by what the model leaves out.
    let measured = profile::profile(
        graph,
        settings.devices,
        &strategies,
        &ProfileSettings {
            device_kind: machine.device(0).kind.clone(),
            seed: settings.seed,
            ..ProfileSettings::default()
        },
    )
    .context("profiling the strategies")?;
    let machine = measured.db.apply_to(machine);
    let cost = ProfiledCost::new(&measured.db, &machine);
    let model = CostModel::new(graph, &machine, &cost);
    let params = ParamStore::init(graph, settings.seed);
    let mut rows: Vec<CompareRow> = Vec::new();
    for (strategy, configs) in &strategies {
        let mut cluster = EmbeddedCluster::start(
            graph,
            configs,
            settings.devices,
            &params,
            Sgd::default(),
            settings.seed,
            0,
        )?;
        let step_s = profile::mean_step_time(
            &mut cluster,
            graph,
            settings.warmup,
            settings.steps,
            settings.seed,
        )?;
        let simulated_s = simulate(&model, configs).makespan;
        rows.push(CompareRow {
            strategy: strategy.clone(),
            measured_ms: step_s * 1e3,
            images_per_sec: graph.batch() as f64 / step_s,
            comm_bytes_per_step: cluster.plan().remote_bytes(),
            simulated_ms: simulated_s * 1e3,
            simulation_error: (simulated_s - step_s) / step_s,
            speedup_over_data: 0.0,
        });
    }
    let data = rows[0].images_per_sec;
    for r in &mut rows {
        r.speedup_over_data = r.images_per_sec / data;
    }
    Ok(rows)
}

/// The comparison as a text table.
pub fn table(rows: &[CompareRow]) -> String {
    let mut out = format!(
        "{:<8} {:>11} {:>9} {:>12} {:>12} {:>9} {:>9}\n",
        "strategy", "measured ms", "images/s", "moved/step", "simulated ms", "sim error", "vs data"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<8} {:>11.1} {:>9.1} {:>12} {:>12.1} {:>8.1}% {:>8.2}x\n",
            r.strategy,
            r.measured_ms,
            r.images_per_sec,
            crate::job::human_bytes(r.comm_bytes_per_step),
            r.simulated_ms,
            100.0 * r.simulation_error,
            r.speedup_over_data
        ));
    }
    out
}

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
