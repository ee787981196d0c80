//! The `legion-rs` command line: argument parsing and one module per subcommand.

mod cluster;
mod evaluate;
mod export;
mod models;
mod plan;
mod profile;
mod train;
mod worker;

use clap::{Parser, Subcommand};

/// `--model` resolved, with what an ONNX import found written to stderr (stdout stays for
/// `--json`): its summary, then its warnings.
fn resolve_model(
    model: &str,
    batch: usize,
    image_size: Option<usize>,
    classes: Option<usize>,
) -> anyhow::Result<legion::ResolvedModel> {
    let resolved = legion::resolve_model(model, batch, image_size, classes)?;
    if let Some(summary) = &resolved.import {
        eprintln!("{summary}");
    }
    Ok(resolved)
}

#[derive(Parser, Debug)]
#[command(
    name = "legion-rs",
    version,
    about = "Layer-wise parallel CNN training"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List the model zoo with parameter counts and FLOPs.
    Models(models::ModelsArgs),
    /// Plan a parallelization strategy: searches, cost model, simulation.
    Plan(plan::PlanArgs),
    /// Measure per-tile compute times and the transport on the embedded cluster, into the cost
    /// cache (`--costs measured`) or a profile file (`--costs FILE`).
    Profile(profile::ProfileArgs),
    /// Train a model.
    Train(Box<train::TrainArgs>),
    /// Score a checkpoint on a dataset: top-1 and top-5 accuracy and the loss.
    Eval(evaluate::EvalArgs),
    /// The most probable classes of images under a checkpoint, with their probabilities.
    Predict(evaluate::PredictArgs),
    /// Start a worker on every host of a hosts file (locally or over ssh) and wait for them.
    Up(cluster::UpArgs),
    /// Show which workers of a hosts file are running.
    Status(cluster::ClusterArgs),
    /// Stop the workers of a hosts file.
    Down(cluster::ClusterArgs),
    /// Run a worker (started by `up`; not usually run by hand).
    Worker(worker::WorkerArgs),
    /// Write a model's inference graph with its weights as an ONNX file.
    Export(export::ExportArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Models(a) => models::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Train(a) => train::run(*a),
        Command::Eval(a) => evaluate::eval(a),
        Command::Predict(a) => evaluate::predict(a),
        Command::Up(a) => cluster::up(a),
        Command::Status(a) => cluster::status(a),
        Command::Down(a) => cluster::down(a),
        Command::Worker(a) => worker::run(a),
        Command::Export(a) => export::run(a),
    }
}
