//! AlexNet training, written the way a user writes a model against the `legion-ops` builder API.
//!
//! `cargo run --release -p legion-examples --bin alexnet -- --help`

use clap::Parser;
use legion_cluster::job::{self, TrainOptions};
use legion_ops::op::{Conv2d, Dense, Pool2d};
use legion_ops::train::Sgd;
use legion_ops::{Graph, GraphBuilder, ModelError, Shape};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(about = "Train AlexNet (torchvision layout) with legion-rs")]
struct Args {
    #[arg(long, default_value_t = 30)]
    steps: u64,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Input height and width (224 is the paper's size; 64 keeps a CPU run short).
    #[arg(long, default_value_t = 64)]
    image_size: usize,
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Devices of the embedded cluster (CPU device actors in this process); 1 trains with the
    /// single-device reference trainer.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// `optcnn`, `data`, `model`, `owt` or a strategy JSON file.
    #[arg(long, default_value = "optcnn")]
    strategy: String,
    /// Write a Chrome/Perfetto trace of the last step.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// `synthetic`, `synthetic:N`, `cifar10:DIR`, `folder:DIR`.
    #[arg(long, default_value = "synthetic")]
    data: String,
    #[arg(long)]
    init: Option<PathBuf>,
    #[arg(long)]
    save: Option<PathBuf>,
    #[arg(long, default_value_t = Sgd::default().lr)]
    lr: f32,
    #[arg(long)]
    json: bool,
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
    let a = Args::parse();
    let graph = alexnet(a.batch, a.image_size, a.classes)?;
    if !a.json {
        println!(
            "AlexNet {}x{} batch {}, {} classes, {} parameters",
            a.image_size,
            a.image_size,
            a.batch,
            a.classes,
            graph.param_count()
        );
    }
    let opts = TrainOptions {
        devices: a.devices,
        steps: a.steps,
        data: a.data,
        init: a.init,
        save: a.save,
        sgd: Sgd {
            lr: a.lr,
            ..Sgd::default()
        },
        json: a.json,
        strategy: a.strategy,
        trace: a.trace,
        ..TrainOptions::default()
    };
    job::train(graph, &opts)?;
    Ok(())
}
