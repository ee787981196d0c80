use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, ModelError};
use crate::op::{Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// torchvision's AlexNet (the "one weird trick" variant: 64-192-384-256-256, no LRN). At 224×224 the
/// features end at 6×6, where torchvision's adaptive pool is the identity.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("alexnet");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
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
    let x = m.dense("fc8", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}
