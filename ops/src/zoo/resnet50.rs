use super::{ZooConfig, conv_bn};
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// ResNet-50 v1.5 (torchvision): bottleneck blocks [3, 4, 6, 3], stride on the 3×3 conv.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("resnet50");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let x = conv_bn(
        &mut m,
        "stem",
        x,
        Conv2d::new(64, 7).stride(2).padding(3),
        BatchNorm::default().relu(),
    )?;
    let mut x = m.pool2d("stem.pool", x, Pool2d::max(3).stride(2).padding(1))?;
    let mut in_channels = 64;
    for (stage, (&blocks, width)) in [3, 4, 6, 3].iter().zip([64, 128, 256, 512]).enumerate() {
        for block in 0..blocks {
            let stride = if block == 0 && stage > 0 { 2 } else { 1 };
            let name = format!("layer{}.{block}", stage + 1);
            x = bottleneck(&mut m, &name, x, in_channels, width, stride)?;
            in_channels = width * 4;
        }
    }
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn bottleneck(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    in_channels: usize,
    width: usize,
    stride: usize,
) -> Result<LayerId, ModelError> {
    let bn = BatchNorm::default;
    let out_channels = width * 4;
    let y = conv_bn(m, &format!("{name}.1"), x, Conv2d::new(width, 1), bn().relu())?;
    let y = conv_bn(
        m,
        &format!("{name}.2"),
        y,
        Conv2d::new(width, 3).stride(stride).padding(1),
        bn().relu(),
    )?;
    let y = conv_bn(m, &format!("{name}.3"), y, Conv2d::new(out_channels, 1), bn())?;
    let shortcut = if stride != 1 || in_channels != out_channels {
        conv_bn(
            m,
            &format!("{name}.downsample"),
            x,
            Conv2d::new(out_channels, 1).stride(stride),
            bn(),
        )?
    } else {
        x
    };
    let sum = m.add(&format!("{name}.add"), y, shortcut)?;
    m.relu(&format!("{name}.relu"), sum)
}
