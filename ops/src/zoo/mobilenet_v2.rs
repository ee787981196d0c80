use super::{InvertedResidual, ZooConfig, conv_norm};
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{Conv2d, Dense, Unary};
use crate::shape::Shape;

/// MobileNetV2 (torchvision's `mobilenet_v2`, width 1.0): inverted residual blocks of a 1×1
/// expansion, a 3×3 depthwise convolution and a 1×1 projection, ReLU6 after the first two, and a
/// residual sum where a block keeps its size. Layers carry torchvision's module names
/// (`features.2.conv.1.0`), so its `state_dict` loads as is.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("mobilenet_v2");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let relu6 = Some(Unary::Relu6);
    let mut x = conv_norm(
        &mut m,
        "features.0",
        x,
        Conv2d::new(32, 3).stride(2).padding(1),
        relu6,
    )?;
    let mut in_channels = 32;
    let mut index = 1;
    // (expansion, output channels, blocks, first block's stride)
    for (t, c, n, s) in [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ] {
        for block in 0..n {
            let stride = if block == 0 { s } else { 1 };
            let name = format!("features.{index}");
            let block = InvertedResidual {
                in_channels,
                out_channels: c,
                kernel: 3,
                stride,
                expansion: t,
            };
            x = inverted_residual(&mut m, &name, x, &block)?;
            in_channels = c;
            index += 1;
        }
    }
    let x = conv_norm(
        &mut m,
        &format!("features.{index}"),
        x,
        Conv2d::new(1280, 1),
        relu6,
    )?;
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dropout("classifier.0", x, 0.2)?;
    let x = m.dense("classifier.1", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn inverted_residual(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    block: &InvertedResidual,
) -> Result<LayerId, ModelError> {
    let conv = format!("{name}.conv");
    let (y, _, k) = block.expand_depthwise(m, &conv, x, Unary::Relu6)?;
    let project = Conv2d::new(block.out_channels, 1).no_bias();
    let y = m.conv2d(&format!("{conv}.{k}"), y, project)?;
    let y = m.batch_norm(&format!("{conv}.{}", k + 1), y, Default::default())?;
    if block.residual() {
        return m.add(&format!("{name}.add"), x, y);
    }
    Ok(y)
}
