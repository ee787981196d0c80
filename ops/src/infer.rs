//! The model's inference forward on the CPU: the logits a deployment runtime (onnxruntime) computes
//! from the same weights. It differs from a training step's forward in two layers only: batch norm
//! normalises with its running statistics instead of the batch's, and dropout passes its input
//! through. Every other layer runs its own forward kernel, whole-tensor, as the trainer does.

use crate::backend::cpu::{Buffer, Cpu, CpuStream};
use crate::backend::{
    Access, BatchView, KernelCall, KernelError, Operand, Phase, Role, StepContext,
};
use crate::graph::Graph;
use crate::kernels::batch_norm::{BatchStats, normalize};
use crate::kernels::{View, ViewMut};
use crate::op::Op;
use crate::train::{ParamStore, Sgd};

/// The logits (the output of the layer before the loss, `[N, classes]` row-major) of `graph` in
/// inference mode for the batch `images` (laid out like the input layer's output).
///
/// # Panics
/// If `images` does not match the input layer's shape or the graph has no loss layer.
pub fn logits(graph: &Graph, params: &ParamStore, images: &[f32]) -> Result<Vec<f32>, KernelError> {
    let input = graph.input();
    assert_eq!(
        images.len(),
        graph.layer(input).shape.numel(),
        "images do not match the input shape"
    );
    let logits = graph
        .logits()
        .expect("inference needs a loss layer to find the logits");
    let ctx = StepContext {
        seed: 0,
        step: 0,
        sgd: Sgd::default(),
        batch: BatchView::whole(images, &[], graph.batch()),
    };
    let (backend, mut stream) = (Cpu::default(), CpuStream);
    let mut acts: Vec<Buffer> = Vec::with_capacity(graph.layers().len());
    for id in graph.ids() {
        let layer = graph.layer(id);
        let tile = layer.shape.full_rect();
        let x = |k: usize| &acts[layer.inputs[k].0];
        let y = match &layer.op {
            Op::Input(_) => Buffer::F32(images.to_vec()),
            Op::SoftmaxCrossEntropy(_) => break,
            Op::Dropout(_) => Buffer::F32(x(0).f32().to_vec()),
            Op::BatchNorm(bn) => {
                let channels = layer.shape.dim(1);
                let channel = crate::shape::Shape::new(&[channels]).full_rect();
                let param = |k| View::new(channel, params.get(id, k));
                let stats = BatchStats::from_running(0..channels, param(2), param(3), bn.eps);
                let mut out = vec![0.0; layer.shape.numel()];
                normalize(
                    View::new(tile, x(0).f32()),
                    &stats,
                    param(0),
                    param(1),
                    bn.relu,
                    ViewMut::new(tile, &mut out),
                );
                Buffer::F32(out)
            }
            _ => {
                let mut out = Buffer::F32(vec![0.0; layer.shape.numel()]);
                let mut operands: Vec<Operand<'_, Buffer>> = layer
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(k, &src)| Operand {
                        role: Role::Input(k as u8),
                        rect: graph.layer(src).shape.full_rect(),
                        access: Access::Read(&acts[src.0]),
                    })
                    .collect();
                let weights: Vec<Buffer> = (0..graph.layer_params(id).len())
                    .map(|k| Buffer::F32(params.get(id, k).to_vec()))
                    .collect();
                operands.extend(weights.iter().zip(graph.layer_params(id)).enumerate().map(
                    |(k, (w, spec))| Operand {
                        role: Role::Param(k as u8),
                        rect: spec.shape.full_rect(),
                        access: Access::Read(w),
                    },
                ));
                operands.push(Operand {
                    role: Role::Output,
                    rect: tile,
                    access: Access::Write(&mut out),
                });
                KernelCall::new(&backend, &mut stream, graph, id, tile, &ctx, operands)
                    .run(Phase::Forward)?;
                out
            }
        };
        acts.push(y);
    }
    Ok(acts.swap_remove(logits.0).into_f32())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{BatchNorm, Conv2d, Dense, Pool2d};
    use crate::{GraphBuilder, Shape};

    /// A conv, batch norm, pool and dense net; `dropout` adds a dropout before the dense layer.
    fn net(dropout: bool) -> Graph {
        let mut m = GraphBuilder::new("net");
        let x = m.input("data", Shape::nchw(2, 2, 6, 6)).unwrap();
        let x = m.conv2d("conv", x, Conv2d::new(3, 3).padding(1)).unwrap();
        let x = m.batch_norm("bn", x, BatchNorm::default().relu()).unwrap();
        let x = m.pool2d("pool", x, Pool2d::max(2)).unwrap();
        let mut x = m.flatten("flat", x).unwrap();
        if dropout {
            x = m.dropout("drop", x, 0.5).unwrap();
        }
        let x = m.dense("fc", x, Dense::new(4)).unwrap();
        m.softmax_cross_entropy("loss", x).unwrap();
        m.finish()
    }

    fn images(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect()
    }

    #[test]
    fn batch_norm_uses_running_statistics_and_dropout_passes_through() {
        let g = net(true);
        let mut params = ParamStore::init(&g, 3);
        let bn = g.find("bn").unwrap();
        // running mean 0.5 and variance 4 per channel: y = γ·(x − 0.5)/√(4 + eps) + β
        let (mean, var) = (params.slot(bn, 2), params.slot(bn, 3));
        params.values[mean].fill(0.5);
        params.values[var].fill(4.0);
        let x = images(2 * 2 * 6 * 6);
        let with_dropout = logits(&g, &params, &x).unwrap();
        let without = net(false);
        let same = ParamStore::from_values(&without, params.values.clone());
        assert_eq!(with_dropout, logits(&without, &same, &x).unwrap());

        // the same logits by hand from the layers' definitions
        let conv = g.find("conv").unwrap();
        let (w, b) = (params.get(conv, 0), params.get(conv, 1));
        let mut expected = Vec::new();
        for n in 0..2 {
            let mut pooled = [f32::MIN; 3 * 3 * 3];
            for (o, bias) in b.iter().enumerate() {
                for h in 0..6 {
                    for wi in 0..6 {
                        let mut acc = *bias;
                        for c in 0..2 {
                            for kh in 0..3 {
                                for kw in 0..3 {
                                    let (ih, iw) = (h + kh, wi + kw);
                                    if ih < 1 || iw < 1 || ih > 6 || iw > 6 {
                                        continue;
                                    }
                                    let xv = x[((n * 2 + c) * 6 + ih - 1) * 6 + iw - 1];
                                    acc += w[((o * 2 + c) * 3 + kh) * 3 + kw] * xv;
                                }
                            }
                        }
                        let z = ((acc - 0.5) / (4.0f32 + 1e-5).sqrt()).max(0.0);
                        let p = &mut pooled[(o * 3 + h / 2) * 3 + wi / 2];
                        *p = p.max(z);
                    }
                }
            }
            let fc = g.find("fc").unwrap();
            let (fw, fb) = (params.get(fc, 0), params.get(fc, 1));
            for j in 0..4 {
                let dot: f32 = (0..27).map(|i| fw[j * 27 + i] * pooled[i]).sum();
                expected.push(dot + fb[j]);
            }
        }
        for (a, e) in with_dropout.iter().zip(&expected) {
            assert!((a - e).abs() < 1e-5, "{a} vs {e}");
        }
    }
}
