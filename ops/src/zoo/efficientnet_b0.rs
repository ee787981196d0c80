use super::{InvertedResidual, ZooConfig, conv_norm};
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{Conv2d, Dense, Unary};
use crate::shape::Shape;

/// EfficientNet-B0 (torchvision's `efficientnet_b0`): MBConv blocks of a 1×1 expansion, a
/// depthwise convolution, squeeze-and-excitation (a global average, two 1×1 convolutions, a
/// sigmoid scaling the channels) and a 1×1 projection, with SiLU activations. Layers carry
/// torchvision's module names (`features.2.0.block.2.fc1`), so its `state_dict` loads as is.
///
/// torchvision drops each residual branch at random in training (stochastic depth, rate 0.2 ×
/// the block's depth); this graph keeps every branch, as torchvision's model does in eval mode.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("efficientnet_b0");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let silu = Some(Unary::Silu);
    let stem = Conv2d::new(32, 3).stride(2).padding(1);
    let mut x = conv_norm(&mut m, "features.0", x, stem, silu)?;
    let mut in_channels = 32;
    // (expansion, kernel, first block's stride, output channels, blocks)
    let stages = [
        (1, 3, 1, 16, 1),
        (6, 3, 2, 24, 2),
        (6, 5, 2, 40, 2),
        (6, 3, 2, 80, 3),
        (6, 5, 1, 112, 3),
        (6, 5, 2, 192, 4),
        (6, 3, 1, 320, 1),
    ];
    for (stage, (t, k, s, c, n)) in stages.into_iter().enumerate() {
        for block in 0..n {
            let stride = if block == 0 { s } else { 1 };
            let name = format!("features.{}.{block}", stage + 1);
            let block = InvertedResidual {
                in_channels,
                out_channels: c,
                kernel: k,
                stride,
                expansion: t,
            };
            x = mb_conv(&mut m, &name, x, &block)?;
            in_channels = c;
        }
    }
    let x = conv_norm(&mut m, "features.8", x, Conv2d::new(1280, 1), silu)?;
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dropout("classifier.0", x, 0.2)?;
    let x = m.dense("classifier.1", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

fn mb_conv(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    block: &InvertedResidual,
) -> Result<LayerId, ModelError> {
    let modules = format!("{name}.block");
    let (y, hidden, k) = block.expand_depthwise(m, &modules, x, Unary::Silu)?;
    let se = format!("{modules}.{k}");
    let y = squeeze_excitation(m, &se, y, hidden, block.in_channels / 4)?;
    let project = Conv2d::new(block.out_channels, 1);
    let y = conv_norm(m, &format!("{modules}.{}", k + 1), y, project, None)?;
    if block.residual() {
        return m.add(&format!("{name}.add"), x, y);
    }
    Ok(y)
}

/// torchvision's `SqueezeExcitation`: x · σ(fc2(silu(fc1(mean over H, W of x)))).
fn squeeze_excitation(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    channels: usize,
    squeeze: usize,
) -> Result<LayerId, ModelError> {
    let s = m.global_avg_pool(&format!("{name}.avgpool"), x)?;
    let s = m.conv2d(&format!("{name}.fc1"), s, Conv2d::new(squeeze, 1))?;
    let s = m.unary(&format!("{name}.activation"), s, Unary::Silu)?;
    let s = m.conv2d(&format!("{name}.fc2"), s, Conv2d::new(channels, 1))?;
    let s = m.unary(&format!("{name}.scale_activation"), s, Unary::Sigmoid)?;
    m.mul(&format!("{name}.scale"), x, s)
}
