//! Small random model graphs for the planner's property tests: chains, fork-joins, Inception-like
//! blocks (branches joined by concat) and residual blocks (add), with shapes small enough for an
//! exhaustive search.

#![allow(dead_code)]

use legion_ops::op::{BatchNorm, Conv2d, Dense, Pool2d};
use legion_ops::rng::Rng;
use legion_ops::{Graph, GraphBuilder, LayerId, Shape};

#[derive(Clone, Copy, Debug)]
pub enum Family {
    Chain,
    ForkJoin,
    Inception,
    Residual,
}

pub const FAMILIES: [Family; 4] = [
    Family::Chain,
    Family::ForkJoin,
    Family::Inception,
    Family::Residual,
];

/// A random graph of `family` drawn from `seed`. `layers` bounds the number of hidden layers.
pub fn random_graph(family: Family, seed: u64, layers: usize) -> Graph {
    let mut rng = Rng::new(seed);
    let mut m = GraphBuilder::new(&format!("{family:?}-{seed}"));
    let batch = 1 + rng.below(4);
    let channels = 1 + rng.below(3);
    let side = 2 + rng.below(4);
    let x = m
        .input("data", Shape::nchw(batch, channels, side, side))
        .unwrap();
    let mut names = 0usize;
    let mut name = |prefix: &str| {
        names += 1;
        format!("{prefix}{names}")
    };
    let x = match family {
        Family::Chain => {
            let mut x = x;
            for _ in 0..layers {
                x = random_layer(&mut m, &mut rng, x, &mut name);
            }
            x
        }
        Family::ForkJoin => {
            let a = random_layer(&mut m, &mut rng, x, &mut name);
            let mut left = a;
            let mut right = a;
            for i in 0..layers.saturating_sub(2).max(1) {
                if i % 2 == 0 {
                    left = conv(&mut m, &mut rng, left, 2, &mut name);
                } else {
                    right = conv(&mut m, &mut rng, right, 2, &mut name);
                }
            }
            m.concat(&name("cat"), &[left, right]).unwrap()
        }
        Family::Inception => {
            let stem = conv(&mut m, &mut rng, x, 2, &mut name);
            // 2 or 3 branches; the first may have two layers
            let branches = 2 + rng.below(2);
            let mut outs = Vec::new();
            for b in 0..branches {
                let mut y = stem;
                let depth = if b == 0 { 1 + rng.below(2) } else { 1 };
                for _ in 0..depth {
                    y = match rng.below(3) {
                        0 => {
                            let c = 1 + rng.below(2);
                            conv(&mut m, &mut rng, y, c, &mut name)
                        }
                        1 => m
                            .pool2d(&name("pool"), y, Pool2d::max(3).stride(1).padding(1))
                            .unwrap(),
                        _ => m.relu(&name("relu"), y).unwrap(),
                    };
                }
                outs.push(y);
            }
            m.concat(&name("cat"), &outs).unwrap()
        }
        Family::Residual => {
            let mut x = conv(&mut m, &mut rng, x, 2, &mut name);
            for _ in 0..layers.div_ceil(3).max(1) {
                let c = m.shape(x).dim(1);
                let y = m
                    .conv2d(&name("conv"), x, Conv2d::new(c, 3).padding(1))
                    .unwrap();
                let y = m.batch_norm(&name("bn"), y, BatchNorm::default()).unwrap();
                let s = m.add(&name("add"), y, x).unwrap();
                x = m.relu(&name("relu"), s).unwrap();
            }
            x
        }
    };
    let f = m.flatten("flatten", x).unwrap();
    let d = m.dense("fc", f, Dense::new(1 + rng.below(3))).unwrap();
    m.softmax_cross_entropy("loss", d).unwrap();
    m.finish()
}

fn conv(
    m: &mut GraphBuilder,
    rng: &mut Rng,
    x: LayerId,
    max_channels: usize,
    name: &mut impl FnMut(&str) -> String,
) -> LayerId {
    let k = [1, 3][rng.below(2)];
    let c = 1 + rng.below(max_channels);
    m.conv2d(&name("conv"), x, Conv2d::new(c, k).padding(k / 2))
        .unwrap()
}

fn random_layer(
    m: &mut GraphBuilder,
    rng: &mut Rng,
    x: LayerId,
    name: &mut impl FnMut(&str) -> String,
) -> LayerId {
    let s = m.shape(x);
    match rng.below(4) {
        0 => conv(m, rng, x, 3, name),
        1 if s.dim(2) >= 2 => m.pool2d(&name("pool"), x, Pool2d::max(2)).unwrap(),
        2 => m.batch_norm(&name("bn"), x, BatchNorm::default()).unwrap(),
        _ => m.relu(&name("relu"), x).unwrap(),
    }
}
