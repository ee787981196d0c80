use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, ModelError};
use crate::op::{Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// LeNet-5 with ReLU and max pooling (the classic's layout at 28×28 with padding on conv1).
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("lenet5");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let x = m.conv2d("conv1", x, Conv2d::new(6, 5).padding(2).relu())?;
    let x = m.pool2d("pool1", x, Pool2d::max(2))?;
    let x = m.conv2d("conv2", x, Conv2d::new(16, 5).relu())?;
    let x = m.pool2d("pool2", x, Pool2d::max(2))?;
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc3", x, Dense::new(120).relu())?;
    let x = m.dense("fc4", x, Dense::new(84).relu())?;
    let x = m.dense("fc5", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}
