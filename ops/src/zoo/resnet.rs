//! torchvision's ResNet family on one builder: ResNet-18 (basic blocks), ResNet-50 and
//! ResNeXt-50 32×4d (bottleneck blocks, ResNeXt's with grouped 3×3 convolutions). Layers carry
//! torchvision's module names (`conv1`, `bn1`, `layer1.0.conv1`, `layer1.0.downsample.0`, `fc`),
//! so its `state_dict` loads as is.

use super::{ZooConfig, conv_norm};
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// ResNet-18 (torchvision's `resnet18`, 11,689,512 parameters): basic blocks [2, 2, 2, 2].
pub fn resnet18(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    build("resnet18", Block::Basic, [2, 2, 2, 2], cfg)
}

/// ResNet-50 v1.5 (torchvision's `resnet50`, 25,557,032 parameters): bottleneck blocks
/// [3, 4, 6, 3], the stride on the 3×3 convolution.
pub fn resnet50(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let block = Block::Bottleneck {
        groups: 1,
        width_per_group: 64,
    };
    build("resnet50", block, [3, 4, 6, 3], cfg)
}

/// ResNeXt-50 32×4d (torchvision's `resnext50_32x4d`, 25,028,904 parameters): ResNet-50's
/// layout with bottlenecks twice as wide, whose 3×3 convolutions have 32 groups (of 4 channels
/// in the first stage).
pub fn resnext50_32x4d(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let block = Block::Bottleneck {
        groups: 32,
        width_per_group: 4,
    };
    build("resnext50_32x4d", block, [3, 4, 6, 3], cfg)
}

/// A residual block's kind, as torchvision's `BasicBlock` and `Bottleneck`.
#[derive(Clone, Copy)]
enum Block {
    /// Two 3×3 convolutions; the output has the stage's channels.
    Basic,
    /// 1×1 down to the block's width, 3×3 (strided, grouped), 1×1 up to four times the stage's
    /// channels. The width is the stage's channels × `width_per_group` / 64 × `groups`.
    Bottleneck {
        groups: usize,
        width_per_group: usize,
    },
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck { .. } => 4,
        }
    }
}

fn build(
    name: &str,
    block: Block,
    blocks_per_stage: [usize; 4],
    cfg: &ZooConfig,
) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new(name);
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let stem = Conv2d::new(64, 7).stride(2).padding(3);
    let x = conv_bn(&mut m, "", 1, x, stem, BatchNorm::default().relu())?;
    let mut x = m.pool2d("maxpool", x, Pool2d::max(3).stride(2).padding(1))?;
    let mut in_channels = 64;
    let stages = blocks_per_stage.into_iter().zip([64, 128, 256, 512]);
    for (stage, (blocks, channels)) in stages.enumerate() {
        for index in 0..blocks {
            let stride = if index == 0 && stage > 0 { 2 } else { 1 };
            let name = format!("layer{}.{index}", stage + 1);
            let shape = BlockShape {
                in_channels,
                channels,
                stride,
            };
            x = residual_block(&mut m, &name, x, block, &shape)?;
            in_channels = channels * block.expansion();
        }
    }
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dense("fc", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

/// One block's channels, what comes in and the stage's (`planes` in torchvision), and its
/// stride, that of its first 3×3 convolution and of its shortcut.
struct BlockShape {
    in_channels: usize,
    channels: usize,
    stride: usize,
}

/// A block under `name`: its convolutions `{name}.conv{k}` and batch norms `{name}.bn{k}`, the
/// shortcut through `{name}.downsample` (a strided 1×1 convolution and batch norm) where the
/// block changes the size or the channels, then the sum and a ReLU.
fn residual_block(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    block: Block,
    shape: &BlockShape,
) -> Result<LayerId, ModelError> {
    let prefix = format!("{name}.");
    let bn = BatchNorm::default;
    let out_channels = shape.channels * block.expansion();
    let y = match block {
        Block::Basic => {
            let conv = |stride| Conv2d::new(shape.channels, 3).stride(stride).padding(1);
            let y = conv_bn(m, &prefix, 1, x, conv(shape.stride), bn().relu())?;
            conv_bn(m, &prefix, 2, y, conv(1), bn())?
        }
        Block::Bottleneck {
            groups,
            width_per_group,
        } => {
            let width = shape.channels * width_per_group / 64 * groups;
            let reduce = Conv2d::new(width, 1);
            let y = conv_bn(m, &prefix, 1, x, reduce, bn().relu())?;
            let spatial = Conv2d::new(width, 3)
                .stride(shape.stride)
                .padding(1)
                .groups(groups);
            let y = conv_bn(m, &prefix, 2, y, spatial, bn().relu())?;
            conv_bn(m, &prefix, 3, y, Conv2d::new(out_channels, 1), bn())?
        }
    };
    let shortcut = if shape.stride != 1 || shape.in_channels != out_channels {
        let project = Conv2d::new(out_channels, 1).stride(shape.stride);
        conv_norm(m, &format!("{name}.downsample"), x, project, None)?
    } else {
        x
    };
    let sum = m.add(&format!("{name}.add"), y, shortcut)?;
    m.relu(&format!("{name}.relu"), sum)
}

/// A convolution without bias `{prefix}conv{k}`, then batch norm `{prefix}bn{k}`: torchvision's
/// names in ResNet's stem (no prefix) and blocks.
fn conv_bn(
    m: &mut GraphBuilder,
    prefix: &str,
    k: usize,
    x: LayerId,
    conv: Conv2d,
    bn: BatchNorm,
) -> Result<LayerId, ModelError> {
    let c = m.conv2d(&format!("{prefix}conv{k}"), x, conv.no_bias())?;
    m.batch_norm(&format!("{prefix}bn{k}"), c, bn)
}
