//! `legion-rs profile`: run real steps of the embedded cluster under several strategies, time every
//! tile's kernels and the transfers between devices, and write the profile database that
//! `--costs FILE` prices strategies with, or add it to the cost cache `--costs measured` reads. The measuring is `legion_profile`; on a GPU
//! (`--device cuda`, or `auto` where one is usable) `legion_profile::gpu` times each tile alone
//! with CUDA events and runs each strategy's steps on GPU device actors.

use anyhow::{Context, bail};
use clap::{ArgGroup, Args};
use legion::device::{self, DeviceKind};
use legion::job::{check_output_path, choose_strategy_for};
use legion::machine::{embedded_machine, gpus_machine};
use legion_ops::Precision;
use legion_profile::{self as profile, ProfileSettings};
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("devices_source").required(true).multiple(true).args(["devices", "machine"])))]
pub struct ProfileArgs {
    /// A zoo model name (see `legion-rs models`), a JSON model file or an ONNX file.
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
    /// Embedded devices to profile on (tiles are timed while this many devices share the cores);
    /// with --machine, that machine's device count.
    #[arg(long)]
    devices: Option<usize>,
    /// The machine whose strategies' tiles to profile (a preset or machine file, as `plan
    /// --machine`): searches plan for it, and `space` covers its configurations. Default: the
    /// embedded cluster of --devices devices.
    #[arg(long)]
    machine: Option<String>,
    /// Strategies to run, comma-separated: searches (see `train --help`'s --strategy) or strategy
    /// files. Each contributes the tiles its configs use. `space` stands for every degree vector the
    /// searches may give each layer (strategy k gives every layer its k-th), so that a profile
    /// prices any strategy the planner finds.
    #[arg(long, value_delimiter = ',', default_value = "data,model,owt,optcnn")]
    strategies: Vec<String>,
    /// On a GPU: time the tiles only, not the strategies' steps (always so for `space`, whose
    /// strategies are not meant to run).
    #[arg(long)]
    tiles_only: bool,
    /// Keep the entries of an existing --out file (a measured tile replaces its entry there), so
    /// that one file can hold the profiles of several models.
    #[arg(long)]
    merge: bool,
    /// On a GPU: stop timing new tiles after this many seconds and save what was measured
    /// (`plan --profile` scales the tiles it lacks from measured ones of their op, and counts
    /// them).
    #[arg(long, value_name = "SECONDS")]
    time_limit: Option<f64>,
    /// Untimed steps per strategy before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured steps per strategy.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Seed of the initial weights and the synthetic batch.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write the profile database (JSON); replaced atomically. Without it, the
    /// embedded CPU devices' costs go to the cost cache that `train --costs measured` prices
    /// with (added to what it holds).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Where to profile (auto, cpu, cuda): `auto` uses a GPU when one is usable, else the CPU,
    /// saying which.
    #[arg(long, value_parser = DeviceKind::parse_flag, default_value_t = DeviceKind::Auto)]
    device: DeviceKind,
    /// What the kernels compute in (as `train --precision`): a GPU's entries are stored under
    /// its kind with the precision's suffix (`h100-tf32`, `h100-bf16`), which `plan --precision`
    /// looks up; bf16 needs a GPU.
    #[command(flatten)]
    precision: crate::precision::PrecisionArgs,
    /// On a GPU, how convolution algorithms are picked (as `train --conv-algos`).
    #[arg(long, default_value_t = legion_cuda::ConvAlgos::default())]
    conv_algos: legion_cuda::ConvAlgos,
    /// The machine model's device kind the entries are stored under (default: --machine's, else
    /// `cpu` on the CPU and `h100` on a GPU, `h100-tf32` with --precision tf32, `h100-bf16` with
    /// bf16); `plan --profile` prices a
    /// machine's devices with the entries of their kind (`p100` for the paper's machine).
    #[arg(long)]
    device_kind: Option<String>,
}

pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    if a.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    match &a.out {
        Some(out) => check_output_path("--out", out)?,
        // Before anything is measured.
        None if a.machine.is_some() || a.device_kind.is_some() => bail!(
            "--machine and --device-kind profile for another machine's devices: give --out FILE \
             (the cost cache holds this machine's own)"
        ),
        None => {}
    }
    if a.strategies.iter().any(|s| s.is_empty()) {
        bail!("--strategies: empty name in '{}'", a.strategies.join(","));
    }
    let devices = match (&a.machine, a.devices) {
        (Some(spec), _) => legion_planner::machine_file::resolve_machine(spec)?.num_devices(),
        (None, Some(0)) => bail!("--devices must be at least 1"),
        (None, Some(devices)) => devices,
        (None, None) => unreachable!("clap requires --devices or --machine"),
    };
    // The profile's devices share one GPU: the first.
    let first_gpu = || legion_cuda::probe().map(|gpus| gpus.into_iter().take(1).collect());
    let mut choice = device::choose(a.device, devices, false, first_gpu)?;
    let precision = a.precision.given().unwrap_or_default();
    if precision == legion_ops::Precision::Bf16 {
        bail!("{}", legion::precision::BF16_NO_PROFILE);
    }
    let math = legion::precision::gpu_math(precision);
    let settings = legion_cuda::Settings {
        math,
        conv_algos: a.conv_algos,
        // Tiles are timed as training runs them.
        conv_epilogue: legion_cuda::ConvEpilogue::default(),
        sharing: legion_cuda::Sharing::AcrossStreams,
    };
    let gpus = device::start_gpus(&mut choice, a.device, devices, settings)?;
    if !a.json {
        println!("{}", choice.line);
    }
    let machine = match (&a.machine, a.devices) {
        (Some(spec), devices) => {
            let machine = legion_planner::machine_file::resolve_machine(spec)?;
            if let Some(d) = devices.filter(|&d| d != machine.num_devices()) {
                bail!(
                    "--devices {d} but --machine {spec} has {} devices; leave --devices out",
                    machine.num_devices()
                );
            }
            machine
        }
        // Planned for the devices sharing the GPU, as `train` plans them.
        (None, _) => match &gpus {
            Some(started) => gpus_machine(devices, &started.info, precision)?,
            None => embedded_machine(devices)?,
        },
    };
    let graph = super::resolve_model(&a.model, a.batch, a.image_size, a.classes)?.graph;
    let mut strategies = Vec::new();
    for s in &a.strategies {
        if s == "space" {
            strategies.extend(profile::space_strategies(&graph, machine.num_devices()));
        } else {
            strategies.push((
                s.clone(),
                choose_strategy_for("--strategies", &graph, &machine, &s.as_str().into())?,
            ));
        }
    }
    if let Some(gpus) = gpus {
        return profile_on_gpu(&a, &graph, &machine, &strategies, gpus);
    }
    if a.tiles_only {
        bail!(
            "--tiles-only: on the CPU tiles are timed inside the strategies' steps (a GPU times them alone)"
        );
    }
    // each strategy's cluster, one at a time, before any of them allocates
    for (_, configs) in &strategies {
        legion_cluster::memory::check_this_host(&graph, Some((configs, devices)))?;
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
    let measured = profile::profile(&graph, devices, &strategies, &settings)
        .with_context(|| format!("profiling {} on {} device(s)", graph.name, devices))?;
    let out = match &a.out {
        Some(_) => {
            save(&a, &measured.db)?;
            a.out.clone().expect("given")
        }
        None => {
            let cache = legion::costs::CostCache::default_location()
                .context("no cost cache folder (set LEGION_RS_COST_CACHE or HOME), give --out")?;
            cache
                .add(
                    &legion::costs::CacheKey::cpu_devices(devices, precision),
                    &measured.db,
                )?
                .0
        }
    };

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
            json!({"model": graph.name, "devices": devices, "batch": a.batch,
                   "entries": db.entries.len(), "links": db.links, "strategies": runs,
                   "out": out.display().to_string()})
        );
        return Ok(());
    }
    println!(
        "profiled {} at batch {} on {} embedded device(s), {} warm-up + {} measured step(s) each",
        graph.name, a.batch, devices, a.warmup, a.repeats
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
    println!("wrote {}", out.display());
    Ok(())
}

/// Writes `db` to --out, atomically; with --merge, over the entries already there.
fn save(a: &ProfileArgs, db: &legion_planner::ProfileDb) -> anyhow::Result<()> {
    let out = a
        .out
        .as_ref()
        .context("--out FILE: where to write the profile")?;
    if !(a.merge && out.exists()) {
        return Ok(db.save(out)?);
    }
    let mut kept = legion_planner::ProfileDb::load(out)?;
    kept.insert_all(db.entries.iter().cloned());
    kept.links = db.links.or(kept.links);
    kept.staged = db.staged.or(kept.staged);
    kept.compute_threads = db.compute_threads.or(kept.compute_threads);
    kept.runtime = db.runtime.or(kept.runtime);
    kept.measured_on = db.measured_on.clone().or(kept.measured_on);
    Ok(kept.save(out)?)
}

/// Today, `YYYY-MM-DD` in UTC.
fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    date_of(secs)
}

/// The civil date (proleptic Gregorian, UTC) of `secs` seconds after 1970-01-01, by counting
/// 400-year eras from 0000-03-01 (so that leap days end a year).
fn date_of(secs: u64) -> String {
    let days = (secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// `profile` on a GPU: each tile alone, then (unless --tiles-only, or for `space`) each
/// strategy's steps on its devices sharing the first GPU, as `train --devices N` runs them.
fn profile_on_gpu(
    a: &ProfileArgs,
    graph: &legion_ops::Graph,
    machine: &legion_planner::MachineModel,
    strategies: &[(String, Vec<legion_planner::ParallelConfig>)],
    gpus: device::StartedGpus,
) -> anyhow::Result<()> {
    let out = a.out.as_ref().context(
        "--out FILE: a GPU's profile is written to a file (`train --costs FILE` prices with it)",
    )?;
    let devices = machine.num_devices();
    let gpu = gpus.info[0].clone();
    let run_steps = !a.tiles_only && !a.strategies.iter().any(|s| s == "space");
    if run_steps {
        for (_, configs) in strategies {
            device::check_gpus_fit(graph, configs, devices, std::slice::from_ref(&gpu))?;
        }
    }
    let legion_runtime::Placement::Gpus(cudas) = gpus.into_placement() else {
        unreachable!("started GPUs place devices on GPUs")
    };
    // Entries price the devices of the machine they are for: --machine's, else the GPU's own
    // (`h100`, `h100-tf32` with --precision tf32, as `dgx-h100` and its TF32 machine file name
    // them; `h100-bf16` in bf16).
    let device_kind = a
        .device_kind
        .clone()
        .unwrap_or_else(|| machine.device(0).kind.clone());
    let settings = ProfileSettings {
        warmup: a.warmup,
        repeats: a.repeats,
        device_kind,
        seed: a.seed,
    };
    let deadline = a
        .time_limit
        .map(|s| std::time::Instant::now() + std::time::Duration::from_secs_f64(s.max(0.0)));
    let mut measured = profile::gpu::profile_on_gpu(
        graph, devices, strategies, &cudas[0], &settings, run_steps, deadline,
    )
    .with_context(|| format!("profiling {} on {gpu}", graph.name))?;
    // What a slice between processes or GPUs pays besides the network (`plan --cluster`).
    measured.db.staged = Some(measured.copies.staged_link());
    if a.machine.is_none() {
        // The devices share the GPU (`one-gpu:N`): their link and one kernel at a time.
        measured.db.links = Some(measured.copies.same_gpu_link());
        measured.db.compute_threads = Some(1);
    }
    let software = legion_cuda::probe::software_versions().unwrap_or_else(|e| e.to_string());
    let precision = a.precision.given().unwrap_or_default();
    let math = match precision {
        Precision::Fp32 => "strict FP32",
        Precision::Tf32 => "TF32",
        Precision::Bf16 => "bf16 with fp32 accumulation",
    };
    measured.db.measured_on = Some(legion_planner::profile::MeasuredOn {
        device: format!("{gpu}, {math}, cuDNN algorithms {}", cudas[0].conv_algos()),
        software,
        date: utc_date(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    });
    save(a, &measured.db)?;
    let mean_ms = |s: &[f64]| 1e3 * s.iter().sum::<f64>() / s.len().max(1) as f64;
    if a.json {
        let runs: Vec<_> = measured
            .runs
            .iter()
            .map(|r| json!({"strategy": r.name, "mean_step_ms": (!r.step_s.is_empty()).then(|| mean_ms(&r.step_s)), "tiles": r.tasks}))
            .collect();
        println!(
            "{}",
            json!({"model": graph.name, "devices": devices, "batch": a.batch,
                   "gpu": gpu.to_string(), "tf32": precision == Precision::Tf32,
                   "precision": precision, "device_kind": settings.device_kind,
                   "entries": measured.db.entries.len(), "copies": measured.copies,
                   "strategies": runs, "stopped_early": measured.stopped_early,
                   "out": out.display().to_string()})
        );
        return Ok(());
    }
    println!(
        "profiled {} at batch {} on {gpu}: each tile of {} device(s) alone ({} warm-up + {} timed \
         runs){}",
        graph.name,
        a.batch,
        devices,
        a.warmup,
        a.repeats,
        if run_steps {
            ", then each strategy's steps on the devices sharing the GPU"
        } else {
            ""
        }
    );
    println!(
        "{:<12} {:>14} {:>12}",
        "strategy", "mean step ms", "new tiles"
    );
    for r in &measured.runs {
        let step = match r.step_s.is_empty() {
            true => "-".to_string(),
            false => format!("{:.2}", mean_ms(&r.step_s)),
        };
        println!("{:<12} {:>14} {:>12}", r.name, step, r.tasks);
    }
    if measured.stopped_early {
        println!(
            "stopped at --time-limit: the tiles of {} of {} strategies timed (the rest are not in \
             the profile)",
            measured.runs.len(),
            strategies.len()
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
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc_dates_leap_days_included() {
        assert_eq!(date_of(0), "1970-01-01");
        assert_eq!(date_of(951_782_400), "2000-02-29");
        assert_eq!(date_of(1_795_651_200 + 86_399), "2026-11-26");
        assert_eq!(date_of(4_107_542_400), "2100-03-01");
    }
}
