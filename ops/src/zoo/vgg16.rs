use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, ModelError};
use crate::op::{Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// VGG-16 (configuration D, no batch norm). Convs are named `conv{block}_{index}` as in the paper.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    const BLOCKS: [(usize, usize); 5] = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)];
    let mut m = GraphBuilder::new("vgg16");
    let mut x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    for (block, &(channels, convs)) in BLOCKS.iter().enumerate() {
        for i in 1..=convs {
            let name = format!("conv{}_{i}", block + 1);
            x = m.conv2d(&name, x, Conv2d::new(channels, 3).padding(1).relu())?;
        }
        x = m.pool2d(&format!("pool{}", block + 1), x, Pool2d::max(2))?;
    }
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc6", x, Dense::new(4096).relu())?;
    let x = m.dropout("drop6", x, 0.5)?;
    let x = m.dense("fc7", x, Dense::new(4096).relu())?;
    let x = m.dropout("drop7", x, 0.5)?;
    let x = m.dense("fc8", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}
