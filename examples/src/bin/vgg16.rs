//! VGG-16 (configuration D, torchvision layout), built block by block.
//!
//! `cargo run --release -p legion-examples --bin vgg16 -- --help`

use clap::Parser;
use legion_examples::{Defaults, ExampleArgs};
use legion_ops::op::{Conv2d, Dense, Pool2d};
use legion_ops::train::Sgd;
use legion_ops::{Graph, GraphBuilder, ModelError, Shape};

/// Train VGG-16 with legion-rs.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: ExampleArgs,
}

fn vgg16(batch: usize, image_size: usize, classes: usize) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("vgg16");
    let mut x = m.input("data", Shape::nchw(batch, 3, image_size, image_size))?;
    // (convs in the block, channels); each block ends in a 2×2 max pool.
    let blocks = [(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)];
    for (b, &(convs, channels)) in blocks.iter().enumerate() {
        for c in 0..convs {
            let name = format!("conv{}_{}", b + 1, c + 1);
            x = m.conv2d(&name, x, Conv2d::new(channels, 3).padding(1).relu())?;
        }
        x = m.pool2d(&format!("pool{}", b + 1), x, Pool2d::max(2).stride(2))?;
    }
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc6", x, Dense::new(4096).relu())?;
    let x = m.dropout("drop6", x, 0.5)?;
    let x = m.dense("fc7", x, Dense::new(4096).relu())?;
    let x = m.dropout("drop7", x, 0.5)?;
    let x = m.dense("fc8", x, Dense::new(classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn main() -> anyhow::Result<()> {
    legion_cli::exit_quietly_on_broken_pipe();
    let args = Args::parse();
    // 224×224 is the paper's size; 32×32 (CIFAR-sized) keeps a CPU run short.
    let defaults = Defaults {
        steps: 20,
        compare_steps: 20,
        batch: 16,
        image_size: 32,
        lr: Sgd::default().lr,
    };
    legion_examples::run(&args.common, defaults, |b, s, c| Ok(vgg16(b, s, c)?))
}
