use super::ZooConfig;
use crate::graph::{Graph, GraphBuilder, LayerId, ModelError};
use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};
use crate::shape::Shape;

/// Inception-v3 as in torchvision, without the auxiliary classifier. Module and layer names follow
/// torchvision (`Mixed_5b.branch5x5_2.conv` ...). The smallest image it accepts is 75×75.
pub fn build(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("inception_v3");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let mut b = Blocks { m: &mut m };
    let x = b.basic("Conv2d_1a_3x3", x, Conv2d::new(32, 3).stride(2))?;
    let x = b.basic("Conv2d_2a_3x3", x, Conv2d::new(32, 3))?;
    let x = b.basic("Conv2d_2b_3x3", x, Conv2d::new(64, 3).padding(1))?;
    let x = b.m.pool2d("maxpool1", x, Pool2d::max(3).stride(2))?;
    let x = b.basic("Conv2d_3b_1x1", x, Conv2d::new(80, 1))?;
    let x = b.basic("Conv2d_4a_3x3", x, Conv2d::new(192, 3))?;
    let x = b.m.pool2d("maxpool2", x, Pool2d::max(3).stride(2))?;
    let x = b.inception_a("Mixed_5b", x, 32)?;
    let x = b.inception_a("Mixed_5c", x, 64)?;
    let x = b.inception_a("Mixed_5d", x, 64)?;
    let x = b.inception_b("Mixed_6a", x)?;
    let x = b.inception_c("Mixed_6b", x, 128)?;
    let x = b.inception_c("Mixed_6c", x, 160)?;
    let x = b.inception_c("Mixed_6d", x, 160)?;
    let x = b.inception_c("Mixed_6e", x, 192)?;
    let x = b.inception_d("Mixed_7a", x)?;
    let x = b.inception_e("Mixed_7b", x)?;
    let x = b.inception_e("Mixed_7c", x)?;
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dropout("dropout", x, 0.5)?;
    let x = m.dense("fc", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

/// A reduced Inception-v3 for small images (32×32 and up): a stride-1 stem, then one block of
/// each of torchvision's five kinds (A, the B reduction, C with its 1×7/7×1 factorisation, the D
/// reduction, E with its 1×3/3×1 forks and nested concats), the same head. It keeps every branch,
/// concat and batch-norm pattern of the full model at a size where batch statistics are taken over
/// enough elements to be well conditioned (the full model at 75×75 reaches 1×1 maps, where batch
/// norm over 8 samples turns rounding differences into different training runs).
pub fn build_reduced(cfg: &ZooConfig) -> Result<Graph, ModelError> {
    let mut m = GraphBuilder::new("inception_v3_reduced");
    let x = m.input(
        "data",
        Shape::nchw(cfg.batch, cfg.channels, cfg.image_size, cfg.image_size),
    )?;
    let mut b = Blocks { m: &mut m };
    let x = b.basic("Conv2d_1a_3x3", x, Conv2d::new(32, 3).padding(1))?;
    let x = b.m.pool2d("maxpool1", x, Pool2d::max(3).stride(2))?;
    let x = b.basic("Conv2d_3b_1x1", x, Conv2d::new(64, 1))?;
    let x = b.inception_a("Mixed_5b", x, 32)?;
    let x = b.inception_b("Mixed_6a", x)?;
    let x = b.inception_c("Mixed_6b", x, 64)?;
    let x = b.inception_d("Mixed_7a", x)?;
    let x = b.inception_e("Mixed_7b", x)?;
    let x = m.global_avg_pool("avgpool", x)?;
    let x = m.flatten("flatten", x)?;
    let x = m.dropout("dropout", x, 0.5)?;
    let x = m.dense("fc", x, Dense::new(cfg.classes))?;
    m.softmax_cross_entropy("loss", x)?;
    Ok(m.finish())
}

struct Blocks<'a> {
    m: &'a mut GraphBuilder,
}

impl Blocks<'_> {
    /// torchvision's `BasicConv2d` under its module names: a convolution without bias
    /// `{name}.conv`, then batch norm (eps 0.001) with the ReLU `{name}.bn`.
    fn basic(&mut self, name: &str, x: LayerId, conv: Conv2d) -> Result<LayerId, ModelError> {
        let c = self.m.conv2d(&format!("{name}.conv"), x, conv.no_bias())?;
        let bn = BatchNorm::default().eps(1e-3).relu();
        self.m.batch_norm(&format!("{name}.bn"), c, bn)
    }

    fn branch(
        &mut self,
        block: &str,
        x: LayerId,
        convs: &[(&str, Conv2d)],
    ) -> Result<LayerId, ModelError> {
        convs.iter().try_fold(x, |x, (name, conv)| {
            self.basic(&format!("{block}.{name}"), x, conv.clone())
        })
    }

    /// 3×3 average pool (stride 1, padding 1) then a 1×1 BasicConv2d.
    fn pool_branch(
        &mut self,
        block: &str,
        x: LayerId,
        channels: usize,
    ) -> Result<LayerId, ModelError> {
        let p = self.m.pool2d(
            &format!("{block}.branch_pool.avg"),
            x,
            Pool2d::avg(3).stride(1).padding(1),
        )?;
        self.basic(&format!("{block}.branch_pool"), p, Conv2d::new(channels, 1))
    }

    fn concat(&mut self, block: &str, xs: &[LayerId]) -> Result<LayerId, ModelError> {
        self.m.concat(&format!("{block}.concat"), xs)
    }

    fn inception_a(
        &mut self,
        n: &str,
        x: LayerId,
        pool_features: usize,
    ) -> Result<LayerId, ModelError> {
        let b1 = self.branch(n, x, &[("branch1x1", Conv2d::new(64, 1))])?;
        let b5 = self.branch(
            n,
            x,
            &[
                ("branch5x5_1", Conv2d::new(48, 1)),
                ("branch5x5_2", Conv2d::new(64, 5).padding(2)),
            ],
        )?;
        let b3 = self.branch(
            n,
            x,
            &[
                ("branch3x3dbl_1", Conv2d::new(64, 1)),
                ("branch3x3dbl_2", Conv2d::new(96, 3).padding(1)),
                ("branch3x3dbl_3", Conv2d::new(96, 3).padding(1)),
            ],
        )?;
        let bp = self.pool_branch(n, x, pool_features)?;
        self.concat(n, &[b1, b5, b3, bp])
    }

    fn inception_b(&mut self, n: &str, x: LayerId) -> Result<LayerId, ModelError> {
        let b3 = self.branch(n, x, &[("branch3x3", Conv2d::new(384, 3).stride(2))])?;
        let bd = self.branch(
            n,
            x,
            &[
                ("branch3x3dbl_1", Conv2d::new(64, 1)),
                ("branch3x3dbl_2", Conv2d::new(96, 3).padding(1)),
                ("branch3x3dbl_3", Conv2d::new(96, 3).stride(2)),
            ],
        )?;
        let bp = self
            .m
            .pool2d(&format!("{n}.branch_pool"), x, Pool2d::max(3).stride(2))?;
        self.concat(n, &[b3, bd, bp])
    }

    fn inception_c(&mut self, n: &str, x: LayerId, c7: usize) -> Result<LayerId, ModelError> {
        let row = |c| Conv2d::rect(c, 1, 7).padding_hw(0, 3);
        let col = |c| Conv2d::rect(c, 7, 1).padding_hw(3, 0);
        let b1 = self.branch(n, x, &[("branch1x1", Conv2d::new(192, 1))])?;
        let b7 = self.branch(
            n,
            x,
            &[
                ("branch7x7_1", Conv2d::new(c7, 1)),
                ("branch7x7_2", row(c7)),
                ("branch7x7_3", col(192)),
            ],
        )?;
        let bd = self.branch(
            n,
            x,
            &[
                ("branch7x7dbl_1", Conv2d::new(c7, 1)),
                ("branch7x7dbl_2", col(c7)),
                ("branch7x7dbl_3", row(c7)),
                ("branch7x7dbl_4", col(c7)),
                ("branch7x7dbl_5", row(192)),
            ],
        )?;
        let bp = self.pool_branch(n, x, 192)?;
        self.concat(n, &[b1, b7, bd, bp])
    }

    fn inception_d(&mut self, n: &str, x: LayerId) -> Result<LayerId, ModelError> {
        let b3 = self.branch(
            n,
            x,
            &[
                ("branch3x3_1", Conv2d::new(192, 1)),
                ("branch3x3_2", Conv2d::new(320, 3).stride(2)),
            ],
        )?;
        let b7 = self.branch(
            n,
            x,
            &[
                ("branch7x7x3_1", Conv2d::new(192, 1)),
                ("branch7x7x3_2", Conv2d::rect(192, 1, 7).padding_hw(0, 3)),
                ("branch7x7x3_3", Conv2d::rect(192, 7, 1).padding_hw(3, 0)),
                ("branch7x7x3_4", Conv2d::new(192, 3).stride(2)),
            ],
        )?;
        let bp = self
            .m
            .pool2d(&format!("{n}.branch_pool"), x, Pool2d::max(3).stride(2))?;
        self.concat(n, &[b3, b7, bp])
    }

    fn inception_e(&mut self, n: &str, x: LayerId) -> Result<LayerId, ModelError> {
        let b1 = self.branch(n, x, &[("branch1x1", Conv2d::new(320, 1))])?;
        let s = self.branch(n, x, &[("branch3x3_1", Conv2d::new(384, 1))])?;
        let b3 = self.split_1x3_3x1(n, "branch3x3_2", s)?;
        let d = self.branch(
            n,
            x,
            &[
                ("branch3x3dbl_1", Conv2d::new(448, 1)),
                ("branch3x3dbl_2", Conv2d::new(384, 3).padding(1)),
            ],
        )?;
        let bd = self.split_1x3_3x1(n, "branch3x3dbl_3", d)?;
        let bp = self.pool_branch(n, x, 192)?;
        self.concat(n, &[b1, b3, bd, bp])
    }

    /// Inception-E's fork: parallel 1×3 and 3×1 convs of `x`, concatenated.
    fn split_1x3_3x1(&mut self, n: &str, stem: &str, x: LayerId) -> Result<LayerId, ModelError> {
        let a = self.basic(
            &format!("{n}.{stem}a"),
            x,
            Conv2d::rect(384, 1, 3).padding_hw(0, 1),
        )?;
        let b = self.basic(
            &format!("{n}.{stem}b"),
            x,
            Conv2d::rect(384, 3, 1).padding_hw(1, 0),
        )?;
        self.m.concat(&format!("{n}.{stem}.concat"), &[a, b])
    }
}
