//! Inception-v3. Its ~100 layers come from the model zoo (`legion_ops::zoo`), which builds them with
//! the same builder API a user would; this program only picks the sizes and trains.
//!
//! `cargo run --release -p legion-examples --bin inception_v3 -- --help`

use clap::Parser;
use legion_examples::{Defaults, ExampleArgs};
use legion_ops::train::Sgd;
use legion_ops::zoo;

/// Train Inception-v3 with legion-rs.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: ExampleArgs,
}

fn main() -> anyhow::Result<()> {
    legion_cli::exit_quietly_on_broken_pipe();
    let args = Args::parse();
    // 299×299 is the paper's size; 75×75 is the smallest the network takes.
    let defaults = Defaults {
        steps: 10,
        compare_steps: 10,
        batch: 8,
        image_size: 75,
        lr: Sgd::default().lr,
    };
    legion_examples::run(&args.common, defaults, |batch, image_size, classes| {
        let model = zoo::find("inception_v3").expect("inception_v3 is in the zoo");
        let cfg = zoo::ZooConfig {
            batch,
            image_size,
            classes,
            ..model.default_config(batch)
        };
        Ok(model.build(&cfg)?)
    })
}
