//! LeNet-5, the quick example: seconds on the embedded cluster.
//!
//! `cargo run --release -p legion-examples --bin lenet5 -- --help`

use clap::Parser;
use legion_examples::{Defaults, ExampleArgs};
use legion_ops::op::{Conv2d, Dense, Pool2d};
use legion_ops::train::Sgd;
use legion_ops::{Graph, GraphBuilder, ModelError, Shape};

/// Train LeNet-5 with legion-rs.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: ExampleArgs,
}

fn lenet5(batch: usize, image_size: usize, classes: usize) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("lenet5");
    let x = m.input("data", Shape::nchw(batch, 1, image_size, image_size))?;
    let x = m.conv2d("conv1", x, Conv2d::new(6, 5).padding(2).relu())?;
    let x = m.pool2d("pool1", x, Pool2d::max(2).stride(2))?;
    let x = m.conv2d("conv2", x, Conv2d::new(16, 5).relu())?;
    let x = m.pool2d("pool2", x, Pool2d::max(2).stride(2))?;
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc3", x, Dense::new(120).relu())?;
    let x = m.dense("fc4", x, Dense::new(84).relu())?;
    let x = m.dense("fc5", x, Dense::new(classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn main() -> anyhow::Result<()> {
    legion_cli::exit_quietly_on_broken_pipe();
    let args = Args::parse();
    let defaults = Defaults {
        steps: 60,
        compare_steps: 60,
        batch: 64,
        image_size: 28,
        lr: Sgd::default().lr,
    };
    legion_examples::run(&args.common, defaults, |b, s, c| Ok(lenet5(b, s, c)?))
}
