use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// Channels each dense layer adds (torchvision's `growth_rate`).
const GROWTH: usize = 32;
/// A dense layer's 1×1 bottleneck is this many times `GROWTH` wide (torchvision's `bn_size`).
const BOTTLENECK_FACTOR: usize = 4;

/// DenseNet-121 (torchvision's `densenet121`, 7,978,856 parameters): four dense blocks of
/// [6, 12, 24, 16] layers, each layer reading the concatenation of the block's input and every
/// earlier layer's 32 new channels (batch norm, ReLU, 1×1 convolution, batch norm, ReLU, 3×3
/// convolution), with transitions (batch norm, ReLU, 1×1 convolution halving the channels, 2×2
/// average pool) between the blocks. Layers carry torchvision's module names
/// (`features.denseblock1.denselayer1.conv1`, `features.transition1.conv`), so its `state_dict`
/// loads as is.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("densenet121");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let stem = Conv2d::new(64, 7).stride(2).padding(3).no_bias();
    let x = m.conv2d("features.conv0", x, stem)?;
    let x = m.batch_norm("features.norm0", x, BatchNorm::default().relu())?;
    let mut x = m.pool2d("features.pool0", x, Pool2d::max(3).stride(2).padding(1))?;
    let mut channels = 64;
    let blocks = [6, 12, 24, 16];
    for (index, layers) in blocks.into_iter().enumerate() {
        let block = index + 1;
        x = dense_block(&mut m, &format!("features.denseblock{block}"), x, layers)?;
        channels += layers * GROWTH;
        if block < blocks.len() {
            channels /= 2;
            x = transition(&mut m, &format!("features.transition{block}"), x, channels)?;
        }
    }
    // torchvision's forward applies a functional ReLU after `norm5`
    let x = m.batch_norm("features.norm5", x, BatchNorm::default().relu())?;
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dense("classifier", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

/// `layers` dense layers `{name}.denselayer{k}`; the block's output concatenates its input and
/// every layer's output.
fn dense_block(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    layers: usize,
) -> Result<LayerId, ModelError> {
    let mut features = vec![x];
    for k in 1..=layers {
        let layer = format!("{name}.denselayer{k}");
        let input = concat(m, &format!("{layer}.concat"), &features)?;
        features.push(dense_layer(m, &layer, input)?);
    }
    concat(m, &format!("{name}.concat"), &features)
}

/// The concatenation of `xs`, or the one of them there is (a block's first layer reads its input).
fn concat(m: &mut GraphBuilder, name: &str, xs: &[LayerId]) -> Result<LayerId, ModelError> {
    match xs {
        [x] => Ok(*x),
        _ => m.concat(name, xs),
    }
}

/// torchvision's `_DenseLayer` (without dropout: DenseNet-121's rate is 0).
fn dense_layer(m: &mut GraphBuilder, name: &str, x: LayerId) -> Result<LayerId, ModelError> {
    let bn_relu = BatchNorm::default().relu();
    let y = m.batch_norm(&format!("{name}.norm1"), x, bn_relu.clone())?;
    let bottleneck = Conv2d::new(BOTTLENECK_FACTOR * GROWTH, 1).no_bias();
    let y = m.conv2d(&format!("{name}.conv1"), y, bottleneck)?;
    let y = m.batch_norm(&format!("{name}.norm2"), y, bn_relu)?;
    let grow = Conv2d::new(GROWTH, 3).padding(1).no_bias();
    m.conv2d(&format!("{name}.conv2"), y, grow)
}

/// torchvision's `_Transition` to `channels` channels at half the size.
fn transition(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    channels: usize,
) -> Result<LayerId, ModelError> {
    let y = m.batch_norm(&format!("{name}.norm"), x, BatchNorm::default().relu())?;
    let halve = Conv2d::new(channels, 1).no_bias();
    let y = m.conv2d(&format!("{name}.conv"), y, halve)?;
    m.pool2d(&format!("{name}.pool"), y, Pool2d::avg(2))
}
