//! `legion-rs profile`: run real steps of the embedded cluster under several strategies, time every
//! tile's kernels and the transfers between devices, and write the profile database that
//! `legion-rs plan --profile` prices strategies with. The measuring is `legion_profile`; on a GPU
//! (`--device cuda`, or `auto` where one is usable) `legion_profile::gpu` times each tile alone
//! with CUDA events and runs each strategy's steps on GPU device actors.

use crate::device::{self, DeviceKind};
use crate::job::choose_strategy_for;
use crate::machine::embedded_machine;
use anyhow::{Context, bail};
use clap::Args;
use legion_profile::{self as profile, ProfileSettings};
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// A zoo model name (see `legion-rs models`) or a JSON model file.
    #[arg(long)]
    model: String,
    /// Global batch size.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Input height and width for zoo models (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    /// Embedded devices to profile on (tiles are timed while this many devices share the cores).
    #[arg(long)]
    devices: usize,
    /// Strategies to run, comma-separated: searches (data, model, owt, optcnn) or strategy files.
    /// Each contributes the tiles its configs use.
    #[arg(long, value_delimiter = ',', default_value = "data,model,owt,optcnn")]
    strategies: Vec<String>,
    /// Untimed steps per strategy before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured steps per strategy.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Seed of the initial weights and the synthetic batch.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write the profile database (JSON); replaced atomically.
    #[arg(long)]
    out: PathBuf,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Where to profile: `auto` uses a GPU when one is usable, else the CPU, saying which.
    #[arg(long, default_value_t = DeviceKind::Auto)]
    device: DeviceKind,
    /// On a GPU: profile TF32 tensor-core products and convolutions instead of strict FP32.
    #[arg(long)]
    tf32: bool,
    /// The machine model's device kind the entries are stored under (default: `cpu` on the CPU,
    /// `h100` on a GPU); `plan --profile` prices a machine's devices with the entries of their
    /// kind (`p100` for the paper's machine).
    #[arg(long)]
    device_kind: Option<String>,
}

pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    if a.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if a.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if a.strategies.iter().any(|s| s.is_empty()) {
        bail!("--strategies: empty name in '{}'", a.strategies.join(","));
    }
    let graph = super::load_model(&a.model, a.batch, a.image_size, a.classes)?;
    let machine = embedded_machine(a.devices)?;
    let strategies = a
        .strategies
        .iter()
        .map(|s| {
            Ok((
                s.clone(),
                choose_strategy_for("--strategies", &graph, &machine, s)?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut choice = device::choose(a.device, a.devices, false, legion_cuda::probe)?;
    let math = match a.tf32 {
        true => legion_cuda::Math::Tf32,
        false => legion_cuda::Math::StrictFp32,
    };
    let gpus = device::start_gpus(&mut choice, a.device, a.devices, math)?;
    if !a.json {
        println!("{}", choice.line);
    }
    if let Some(gpus) = gpus {
        return profile_on_gpu(&a, &graph, &strategies, gpus);
    }
    // each strategy's cluster, one at a time, before any of them allocates
    for (_, configs) in &strategies {
        legion_cluster::memory::check_this_host(&graph, Some((configs, a.devices)))?;
    }
    let settings = ProfileSettings {
        warmup: a.warmup,
        repeats: a.repeats,
        device_kind: a
            .device_kind
            .clone()
            .unwrap_or_else(|| machine.device(0).kind.clone()),
        seed: a.seed,
    };
    let measured = profile::profile(&graph, a.devices, &strategies, &settings)
        .with_context(|| format!("profiling {} on {} device(s)", graph.name, a.devices))?;
    measured.db.save(&a.out)?;

    let db = &measured.db;
    let mean_ms = |s: &[f64]| 1e3 * s.iter().sum::<f64>() / s.len().max(1) as f64;
    if a.json {
        let runs: Vec<_> = measured
            .runs
            .iter()
            .map(|r| json!({"strategy": r.name, "mean_step_ms": mean_ms(&r.step_s), "tasks": r.tasks}))
            .collect();
        println!(
            "{}",
            json!({"model": graph.name, "devices": a.devices, "batch": a.batch,
                   "entries": db.entries.len(), "links": db.links, "strategies": runs,
                   "out": a.out.display().to_string()})
        );
        return Ok(());
    }
    println!(
        "profiled {} at batch {} on {} embedded device(s), {} warm-up + {} measured step(s) each",
        graph.name, a.batch, a.devices, a.warmup, a.repeats
    );
    println!(
        "{:<12} {:>14} {:>12}",
        "strategy", "mean step ms", "tasks timed"
    );
    for r in &measured.runs {
        println!(
            "{:<12} {:>14.2} {:>12}",
            r.name,
            mean_ms(&r.step_s),
            r.tasks
        );
    }
    println!("{} tile entries measured", db.entries.len());
    match &db.links {
        Some(l) => println!(
            "link: {:.2} GB/s, {:.1} µs latency (fit over {} transfers)",
            l.bytes_per_s / 1e9,
            l.latency_s * 1e6,
            l.samples
        ),
        None => println!("link: not measured (no transfers between devices)"),
    }
    println!("wrote {}", a.out.display());
    Ok(())
}

/// `profile` on a GPU: the devices share its first GPU, as `train --devices N` runs them.
fn profile_on_gpu(
    a: &ProfileArgs,
    graph: &legion_ops::Graph,
    strategies: &[(String, Vec<legion_planner::ParallelConfig>)],
    gpus: device::StartedGpus,
) -> anyhow::Result<()> {
    let gpu = gpus.info[0].clone();
    for (_, configs) in strategies {
        device::check_gpus_fit(graph, configs, a.devices, std::slice::from_ref(&gpu))?;
    }
    let legion_runtime::Placement::Gpus(cudas) = gpus.into_placement() else {
        unreachable!("started GPUs place devices on GPUs")
    };
    let settings = ProfileSettings {
        warmup: a.warmup,
        repeats: a.repeats,
        device_kind: a.device_kind.clone().unwrap_or_else(|| "h100".into()),
        seed: a.seed,
    };
    let measured = profile::gpu::profile_on_gpu(graph, a.devices, strategies, &cudas[0], &settings)
        .with_context(|| format!("profiling {} on {gpu}", graph.name))?;
    measured.db.save(&a.out)?;
    let mean_ms = |s: &[f64]| 1e3 * s.iter().sum::<f64>() / s.len().max(1) as f64;
    if a.json {
        let runs: Vec<_> = measured
            .runs
            .iter()
            .map(|r| json!({"strategy": r.name, "mean_step_ms": mean_ms(&r.step_s), "tiles": r.tasks}))
            .collect();
        println!(
            "{}",
            json!({"model": graph.name, "devices": a.devices, "batch": a.batch,
                   "gpu": gpu.to_string(), "tf32": a.tf32, "device_kind": settings.device_kind,
                   "entries": measured.db.entries.len(), "copies": measured.copies,
                   "strategies": runs, "out": a.out.display().to_string()})
        );
        return Ok(());
    }
    println!(
        "profiled {} at batch {} on {gpu}: each tile alone ({} warm-up + {} timed runs), then \
         each strategy's steps on {} device(s) sharing the GPU",
        graph.name, a.batch, a.warmup, a.repeats, a.devices
    );
    println!(
        "{:<12} {:>14} {:>12}",
        "strategy", "mean step ms", "new tiles"
    );
    for r in &measured.runs {
        println!(
            "{:<12} {:>14.2} {:>12}",
            r.name,
            mean_ms(&r.step_s),
            r.tasks
        );
    }
    let c = measured.copies;
    println!(
        "{} tile entries under device kind '{}'; copies: {:.0} GB/s within the GPU, {:.1} GB/s \
         to the host, {:.1} GB/s from it",
        measured.db.entries.len(),
        settings.device_kind,
        c.device_bytes_per_s / 1e9,
        c.to_host_bytes_per_s / 1e9,
        c.from_host_bytes_per_s / 1e9
    );
    println!("wrote {}", a.out.display());
    Ok(())
}
