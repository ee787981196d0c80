//! AlexNet, written the way a user writes a model against the `legion-ops` builder API, trained on
//! the embedded cluster with the OptCNN strategy by default.
//!
//! `cargo run --release -p legion-examples --bin alexnet -- --help`

use clap::Parser;
use legion_examples::{Defaults, ExampleArgs};
use legion_ops::op::{Conv2d, Dense, Pool2d};
use legion_ops::{Graph, GraphBuilder, ModelError, Shape};

/// Train AlexNet (torchvision layout) with legion-rs.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: ExampleArgs,
}

fn alexnet(batch: usize, image_size: usize, classes: usize) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("alexnet");
    let x = m.input("data", Shape::nchw(batch, 3, image_size, image_size))?;
    let x = m.conv2d("conv1", x, Conv2d::new(64, 11).stride(4).padding(2).relu())?;
    let x = m.pool2d("pool1", x, Pool2d::max(3).stride(2))?;
    let x = m.conv2d("conv2", x, Conv2d::new(192, 5).padding(2).relu())?;
    let x = m.pool2d("pool2", x, Pool2d::max(3).stride(2))?;
    let x = m.conv2d("conv3", x, Conv2d::new(384, 3).padding(1).relu())?;
    let x = m.conv2d("conv4", x, Conv2d::new(256, 3).padding(1).relu())?;
    let x = m.conv2d("conv5", x, Conv2d::new(256, 3).padding(1).relu())?;
    let x = m.pool2d("pool5", x, Pool2d::max(3).stride(2))?;
    let x = m.flatten("flatten", x)?;
    let x = m.dropout("drop6", x, 0.5)?;
    let x = m.dense("fc6", x, Dense::new(4096).relu())?;
    let x = m.dropout("drop7", x, 0.5)?;
    let x = m.dense("fc7", x, Dense::new(4096).relu())?;
    let x = m.dense("fc8", x, Dense::new(classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn main() -> anyhow::Result<()> {
    legion_cluster::exit_quietly_on_broken_pipe();
    let args = Args::parse();
    // 224×224 is the paper's size; 64×64 keeps a CPU run to a minute or so.
    let defaults = Defaults {
        steps: 30,
        batch: 16,
        image_size: 64,
    };
    legion_examples::run(&args.common, defaults, |b, s, c| Ok(alexnet(b, s, c)?))
}
