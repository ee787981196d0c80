//! The model's inference forward on the CPU from a checkpoint's weights: the logits a deployment
//! runtime (onnxruntime) computes. Every layer runs its [`Phase::Infer`] kernel, whole-tensor:
//! batch norm normalises with its running statistics instead of the batch's, dropout passes its
//! input through, every other layer runs its forward.
//! [`evaluate`] scores a dataset with it (top-1, top-5, loss); [`top_k`] ranks one sample's classes.

use crate::backend::cpu::{Buffer, Cpu, CpuStream};
use crate::backend::{
    Access, BatchView, KernelCall, KernelError, Operand, Phase, Role, StepContext,
};
use crate::data::{BadSamples, DataError, Dataset, Loader, LoaderConfig};
use crate::graph::Graph;
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
        let y = match &layer.op {
            Op::Input(_) => Buffer::F32(images.to_vec()),
            Op::SoftmaxCrossEntropy(_) => break,
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
                    .run(Phase::Infer)?;
                out
            }
        };
        acts.push(y);
    }
    Ok(acts.swap_remove(logits.0).into_f32())
}

/// What a model scores on a dataset.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Accuracy {
    pub samples: usize,
    /// Fractions of the samples whose label is the top logit, and among the top five.
    pub top1: f64,
    pub top5: f64,
    /// Mean softmax cross-entropy.
    pub loss: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// The accuracy of `graph` with `params`, in inference mode ([`logits`]), on every sample of
/// `dataset` in its order: batches of the graph's batch size, the last one padded (its padding
/// not counted). A sample that cannot be read is left out unless `strict`.
pub fn evaluate(
    graph: &Graph,
    params: &ParamStore,
    dataset: std::sync::Arc<dyn Dataset>,
    strict: bool,
) -> Result<Accuracy, EvalError> {
    score(graph.batch(), dataset, strict, |images| {
        Ok(logits(graph, params, &images)?)
    })
}

/// The accuracy of the logits `logits_of` gives for each batch of `batch` samples of `dataset`,
/// in its order, the last batch padded with zeros (its padding not counted): [`evaluate`]'s
/// scoring for any engine that computes logits (a cluster's devices, a GPU). A sample that
/// cannot be read is left out unless `strict`.
pub fn score<E: From<DataError>>(
    batch: usize,
    dataset: std::sync::Arc<dyn Dataset>,
    strict: bool,
    mut logits_of: impl FnMut(Vec<f32>) -> Result<Vec<f32>, E>,
) -> Result<Accuracy, E> {
    let loader = Loader::new(
        dataset,
        LoaderConfig {
            shuffle: false,
            drop_last: false,
            bad_samples: match strict {
                true => BadSamples::Fail,
                false => BadSamples::Drop,
            },
            ..LoaderConfig::new(batch)
        },
    )?;
    let sample_len = loader.dataset().sample_len();
    let (mut samples, mut top1, mut top5, mut loss) = (0usize, 0usize, 0usize, 0f64);
    for b in loader.epoch(0) {
        let mut b = b?;
        let (len, labels) = (b.len(), std::mem::take(&mut b.labels));
        let mut images = b.images;
        images.resize(batch * sample_len, 0.0);
        let out = logits_of(images)?;
        let classes = out.len() / batch;
        for (row, &label) in out.chunks_exact(classes).zip(&labels) {
            let score = row[label as usize];
            // Ties count against the label (a lower class ranks first), and a score that is not
            // a number ranks last.
            let above = match score.is_nan() {
                true => classes,
                false => row
                    .iter()
                    .enumerate()
                    .filter(|&(j, &v)| v > score || (v == score && j < label as usize))
                    .count(),
            };
            top1 += (above == 0) as usize;
            top5 += (above < 5) as usize;
            loss += log_sum_exp(row) - f64::from(score);
        }
        samples += len;
    }
    let n = samples.max(1) as f64;
    Ok(Accuracy {
        samples,
        top1: top1 as f64 / n,
        top5: top5 as f64 / n,
        loss: loss / n,
    })
}

fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    max + row
        .iter()
        .map(|&v| (f64::from(v) - max).exp())
        .sum::<f64>()
        .ln()
}

/// The `k` most probable classes of one row of logits, most probable first, with their softmax
/// probabilities.
pub fn top_k(row: &[f32], k: usize) -> Vec<(usize, f64)> {
    let lse = log_sum_exp(row);
    let mut ranked: Vec<(usize, f64)> = row
        .iter()
        .enumerate()
        .map(|(class, &v)| (class, (f64::from(v) - lse).exp()))
        .collect();
    // A logit that is not a number makes every probability not a number: they keep the class order.
    let key = |p: f64| if p.is_nan() { f64::NEG_INFINITY } else { p };
    ranked.sort_by(|a, b| key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(&b.0)));
    ranked.truncate(k);
    ranked
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

    /// The trainer's inference on its own device, after steps that moved the running statistics,
    /// is the checkpoint's inference, and leaves the training as it was.
    #[test]
    fn a_trainers_inference_is_its_checkpoints_and_changes_nothing() {
        let g = net(true);
        let init = ParamStore::init(&g, 3);
        let train = |score: bool| {
            let mut t = crate::train::Trainer::new(g.clone(), init.clone(), Sgd::default(), 5);
            let x = images(2 * 2 * 6 * 6);
            t.step(&x, &[1, 3]).unwrap();
            if score {
                let want = logits(&g, &t.params().unwrap(), &x).unwrap();
                assert_eq!(t.logits(x.clone()).unwrap(), want);
            }
            t.step(&x, &[0, 2]).unwrap();
            t.params().unwrap().values
        };
        assert_eq!(train(true), train(false));
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

    /// Sample `i`: the ramp of `images`, shifted by `i`; label `i % 4`.
    struct Shifted;

    impl Dataset for Shifted {
        fn num_samples(&self) -> usize {
            5
        }
        fn image_shape(&self) -> crate::data::ImageShape {
            [2, 6, 6]
        }
        fn num_classes(&self) -> usize {
            4
        }
        fn sample(&self, index: usize, _: u64, out: &mut [f32]) -> Result<u32, DataError> {
            for (o, v) in out
                .iter_mut()
                .zip(images(72 + index).into_iter().skip(index))
            {
                *o = v;
            }
            Ok((index % 4) as u32)
        }
        fn describe(&self) -> String {
            "shifted".into()
        }
    }

    #[test]
    fn evaluation_scores_every_sample_once_from_the_logits_padding_the_last_batch() {
        let g = net(false);
        let params = ParamStore::init(&g, 5);
        let acc = evaluate(&g, &params, std::sync::Arc::new(Shifted), true).unwrap();
        assert_eq!(acc.samples, 5);
        // The same figures sample by sample, each alone in a batch padded with zeros.
        let (mut top1, mut top5, mut loss) = (0, 0, 0.0);
        for i in 0..5 {
            let mut x = vec![0.0; 2 * 72];
            Shifted.sample(i, 0, &mut x[..72]).unwrap();
            let out = logits(&g, &params, &x).unwrap();
            let row = &out[..4];
            let best = top_k(row, 4);
            top1 += (best[0].0 == i % 4) as usize;
            top5 += 1;
            loss -= best.iter().find(|&&(c, _)| c == i % 4).unwrap().1.ln();
        }
        assert_eq!(acc.top1, top1 as f64 / 5.0);
        assert_eq!(acc.top5, top5 as f64 / 5.0);
        assert!(
            (acc.loss - loss / 5.0).abs() < 1e-5,
            "{} {}",
            acc.loss,
            loss / 5.0
        );
    }

    #[test]
    fn top_k_ranks_by_probability() {
        let ranked = top_k(&[0.0, 2.0, 1.0], 2);
        assert_eq!((ranked[0].0, ranked[1].0), (1, 2));
        let total: f64 = top_k(&[0.0, 2.0, 1.0], 3).iter().map(|p| p.1).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!((ranked[0].1 - 2f64.exp() / (1.0 + 1f64.exp() + 2f64.exp())).abs() < 1e-12);
    }
}
