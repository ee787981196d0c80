use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{Conv2d, Pool2d};
use crate::shape::Shape;

/// SqueezeNet 1.0 (torchvision's `squeezenet1_0`, 1,248,424 parameters): eight Fire modules (a
/// 1×1 squeeze, then 1×1 and 3×3 expansions concatenated) between ceil-mode max pools, and a
/// convolutional classifier (dropout, a 1×1 convolution to the classes, ReLU, global average).
/// Layers carry torchvision's module names (`features.3.expand3x3`, `classifier.1`), so its
/// `state_dict` loads as is.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("squeezenet1_0");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let mut x = m.conv2d("features.0", x, Conv2d::new(96, 7).stride(2).relu())?;
    let pool = Pool2d::max(3).stride(2).ceil_mode();
    // torchvision's `features` after the first convolution and its ReLU (`features.1`): a max
    // pool, or a Fire module's squeeze and expansions' channels
    let features = [
        None,
        Some((16, 64)),
        Some((16, 64)),
        Some((32, 128)),
        None,
        Some((32, 128)),
        Some((48, 192)),
        Some((48, 192)),
        Some((64, 256)),
        None,
        Some((64, 256)),
    ];
    for (index, module) in (2..).zip(features) {
        let name = format!("features.{index}");
        x = match module {
            None => m.pool2d(&name, x, pool.clone())?,
            Some((squeeze, expand)) => fire(&mut m, &name, x, squeeze, expand)?,
        };
    }
    let x = m.dropout("classifier.0", x, 0.5)?;
    let x = m.conv2d("classifier.1", x, Conv2d::new(cfg.classes, 1).relu())?;
    let x = m.global_avg_pool("classifier.3", x)?;
    let x = m.flatten("flatten", x)?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

/// torchvision's `Fire`: a 1×1 squeeze to `squeeze` channels, then 1×1 and 3×3 expansions of
/// `expand` channels each, concatenated; ReLU after every convolution.
fn fire(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    squeeze: usize,
    expand: usize,
) -> Result<LayerId, ModelError> {
    let s = Conv2d::new(squeeze, 1).relu();
    let s = m.conv2d(&format!("{name}.squeeze"), x, s)?;
    let e1 = Conv2d::new(expand, 1).relu();
    let e1 = m.conv2d(&format!("{name}.expand1x1"), s, e1)?;
    let e3 = Conv2d::new(expand, 3).padding(1).relu();
    let e3 = m.conv2d(&format!("{name}.expand3x3"), s, e3)?;
    m.concat(&format!("{name}.concat"), &[e1, e3])
}
