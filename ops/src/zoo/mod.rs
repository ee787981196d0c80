//! The model zoo. Architectures follow torchvision's (AlexNet without LRN, Inception-v3 without the
//! auxiliary head, ResNet v1.5 with the stride on the 3×3 conv), so at 1000 classes and the default
//! image size the parameter counts equal torchvision's exactly. Layers carry torchvision's module
//! names, so that its `state_dict` loads by name, but for AlexNet and VGG-16, whose layers keep
//! the papers' names (`conv1` … `fc8`, `conv1_1` …) that strategy files use. Every model takes a
//! batch size, image size and class count; small images work as long as every window still fits.

mod alexnet;
mod densenet121;
mod efficientnet_b0;
mod inception_v3;
mod lenet5;
mod mobilenet_v2;
mod resnet;
mod squeezenet1_0;
mod vgg16;

use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{BatchNorm, Conv2d, Unary};

/// How to instantiate a zoo model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZooConfig {
    pub batch: usize,
    pub image_size: usize,
    pub channels: usize,
    pub classes: usize,
}

/// A model of the zoo and its defaults.
pub struct ZooModel {
    pub name: &'static str,
    pub default_image_size: usize,
    pub default_channels: usize,
    pub default_classes: usize,
    build: fn(&ZooConfig) -> Result<Graph, ModelError>,
}

impl ZooModel {
    /// The model's defaults at batch size `batch`.
    pub fn default_config(&self, batch: usize) -> ZooConfig {
        ZooConfig {
            batch,
            image_size: self.default_image_size,
            channels: self.default_channels,
            classes: self.default_classes,
        }
    }

    pub fn build(&self, cfg: &ZooConfig) -> Result<Graph, ModelError> {
        (self.build)(cfg)
    }
}

pub const MODELS: &[ZooModel] = &[
    ZooModel {
        name: "lenet5",
        default_image_size: 28,
        default_channels: 1,
        default_classes: 10,
        build: lenet5::build,
    },
    ZooModel {
        name: "alexnet",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: alexnet::build,
    },
    ZooModel {
        name: "vgg16",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: vgg16::build,
    },
    ZooModel {
        name: "inception_v3",
        default_image_size: 299,
        default_channels: 3,
        default_classes: 1000,
        build: inception_v3::build,
    },
    ZooModel {
        name: "inception_v3_reduced",
        default_image_size: 32,
        default_channels: 3,
        default_classes: 10,
        build: inception_v3::build_reduced,
    },
    ZooModel {
        name: "resnet18",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: resnet::resnet18,
    },
    ZooModel {
        name: "resnet50",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: resnet::resnet50,
    },
    ZooModel {
        name: "resnext50_32x4d",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: resnet::resnext50_32x4d,
    },
    ZooModel {
        name: "mobilenet_v2",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: mobilenet_v2::build,
    },
    ZooModel {
        name: "efficientnet_b0",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: efficientnet_b0::build,
    },
    ZooModel {
        name: "densenet121",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: densenet121::build,
    },
    ZooModel {
        name: "squeezenet1_0",
        default_image_size: 224,
        default_channels: 3,
        default_classes: 1000,
        build: squeezenet1_0::build,
    },
];

pub fn find(name: &str) -> Option<&'static ZooModel> {
    MODELS.iter().find(|m| m.name == name)
}

/// Names of the zoo's models, for error messages and listings.
pub fn names() -> Vec<&'static str> {
    MODELS.iter().map(|m| m.name).collect()
}

/// torchvision's `Conv2dNormActivation` under its module names: the convolution (no bias)
/// `{name}.0`, batch norm `{name}.1`, and the activation, where there is one, `{name}.2`.
pub(crate) fn conv_norm(
    m: &mut GraphBuilder,
    name: &str,
    x: LayerId,
    conv: Conv2d,
    activation: Option<Unary>,
) -> Result<LayerId, ModelError> {
    let c = m.conv2d(&format!("{name}.0"), x, conv.no_bias())?;
    let y = m.batch_norm(&format!("{name}.1"), c, BatchNorm::default())?;
    match activation {
        Some(op) => m.unary(&format!("{name}.2"), y, op),
        None => Ok(y),
    }
}

/// The shape of an inverted residual block (MobileNetV2's, EfficientNet's MBConv).
pub(crate) struct InvertedResidual {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub expansion: usize,
}

impl InvertedResidual {
    fn hidden(&self) -> usize {
        self.in_channels * self.expansion
    }

    /// Whether the block adds its input to its output (it keeps its size).
    pub fn residual(&self) -> bool {
        self.stride == 1 && self.in_channels == self.out_channels
    }

    /// The block's first modules under `{name}.0`, `{name}.1`: the 1×1 expansion where the
    /// expansion is not 1, then the depthwise convolution, each a [`conv_norm`] with
    /// `activation`. Returns their output, its channels and the index of the block's next module.
    pub fn expand_depthwise(
        &self,
        m: &mut GraphBuilder,
        name: &str,
        x: LayerId,
        activation: Unary,
    ) -> Result<(LayerId, usize, usize), ModelError> {
        let hidden = self.hidden();
        let (mut y, mut k) = (x, 0);
        if self.expansion != 1 {
            let expand = Conv2d::new(hidden, 1);
            y = conv_norm(m, &format!("{name}.0"), y, expand, Some(activation))?;
            k = 1;
        }
        let depthwise = Conv2d::new(hidden, self.kernel)
            .stride(self.stride)
            .padding(self.kernel / 2)
            .groups(hidden);
        y = conv_norm(m, &format!("{name}.{k}"), y, depthwise, Some(activation))?;
        Ok((y, hidden, k + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(name: &str) -> u64 {
        let m = find(name).unwrap();
        m.build(&m.default_config(1)).unwrap().param_count()
    }

    #[test]
    fn parameter_counts_match_torchvision() {
        assert_eq!(count("alexnet"), 61_100_840);
        assert_eq!(count("vgg16"), 138_357_544);
        assert_eq!(count("resnet50"), 25_557_032);
        assert_eq!(count("inception_v3"), 23_834_568);
        assert_eq!(count("lenet5"), 61_706);
        assert_eq!(count("mobilenet_v2"), 3_504_872);
        assert_eq!(count("efficientnet_b0"), 5_288_548);
        assert_eq!(count("resnet18"), 11_689_512);
        assert_eq!(count("resnext50_32x4d"), 25_028_904);
        assert_eq!(count("densenet121"), 7_978_856);
        assert_eq!(count("squeezenet1_0"), 1_248_424);
    }

    #[test]
    fn small_sizes_build() {
        for (name, size) in [
            ("alexnet", 64),
            ("inception_v3", 75),
            ("vgg16", 32),
            ("resnet50", 32),
            ("lenet5", 28),
            ("mobilenet_v2", 32),
            ("efficientnet_b0", 32),
            ("resnet18", 32),
            ("resnext50_32x4d", 32),
            ("densenet121", 32),
            ("squeezenet1_0", 32),
        ] {
            let m = find(name).unwrap();
            let cfg = ZooConfig {
                batch: 8,
                image_size: size,
                ..m.default_config(8)
            };
            let g = m
                .build(&cfg)
                .unwrap_or_else(|e| panic!("{name} at {size}: {e}"));
            assert_eq!(g.batch(), 8);
            let logits = g.logits().unwrap();
            assert_eq!(g.layer(logits).shape.dims(), &[8, m.default_classes]);
        }
    }

    #[test]
    fn too_small_images_fail_with_the_layer_named() {
        let m = find("alexnet").unwrap();
        let cfg = ZooConfig {
            image_size: 16,
            ..m.default_config(1)
        };
        let e = m.build(&cfg).unwrap_err().to_string();
        assert!(e.starts_with("pool2d 'pool"), "{e}");
    }

    #[test]
    fn zoo_models_round_trip_through_json() {
        for m in MODELS {
            let g = m.build(&m.default_config(2)).unwrap();
            let back = Graph::from_json(&g.to_json(), m.name).unwrap();
            assert_eq!(g, back, "{}", m.name);
        }
    }
}
