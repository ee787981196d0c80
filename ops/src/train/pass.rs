//! One forward and backward pass over the whole batch: every layer one tile, the reference
//! computation every strategy is checked against.

use super::*;

/// Every layer's output in a pass: the input layer's is the batch's images, borrowed (or, where
/// activations are bf16, their cast, at `outputs[input]`).
pub(super) struct Acts<'i, M> {
    pub(super) images: &'i M,
    pub(super) input: usize,
    /// By layer index; `None` at the input layer.
    pub(super) outputs: Vec<Option<M>>,
}

impl<M> Acts<'_, M> {
    /// A layer's output: the input layer's is the images, or their cast where activations are
    /// not f32.
    pub(super) fn of(&self, layer: LayerId) -> &M {
        match (&self.outputs[layer.0], layer.0 == self.input) {
            (Some(output), _) => output,
            (None, true) => self.images,
            (None, false) => panic!("a layer's output is computed before it is read"),
        }
    }
}

/// Per-layer state the backward pass needs from the forward pass: the batch statistics (`[3, C]`
/// sums) of each batch-norm layer, by layer index.
pub(super) struct Saved<M> {
    pub(super) moments: BTreeMap<usize, M>,
}

/// One forward/backward pass over the whole batch: every layer is one tile, the whole tensor.
/// Traced, it keeps a pair of the backend's markers `K` around each kernel call.
pub(super) struct Pass<'a, K> {
    pub(super) graph: &'a Graph,
    pub(super) params: &'a [GraphParam],
    pub(super) first: &'a [usize],
    pub(super) ctx: StepContext<'a>,
    pub(super) spans: Option<RefCell<Vec<MarkedSpan<K>>>>,
}

/// A traced call: its name, category and the markers before and after it.
pub(super) type MarkedSpan<M> = (String, &'static str, M, M);

impl<'a, K> Pass<'a, K> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        graph: &'a Graph,
        params: &'a [GraphParam],
        first: &'a [usize],
        sgd: Sgd,
        images: &'a [f32],
        labels: &'a [u32],
        seed: u64,
        step: u64,
    ) -> Pass<'a, K> {
        let batch = graph.batch();
        Pass {
            graph,
            params,
            first,
            ctx: StepContext {
                seed,
                step,
                sgd,
                batch: BatchView::whole(images, labels, batch),
            },
            spans: None,
        }
    }

    pub(super) fn traced(mut self, on: bool) -> Self {
        self.spans = on.then(|| RefCell::new(Vec::new()));
        self
    }

    pub(super) fn full(&self, layer: LayerId) -> Rect {
        self.graph.layer(layer).shape.full_rect()
    }

    pub(super) fn slot(&self, layer: LayerId, index: usize) -> usize {
        self.first[layer.0] + index
    }

    /// Read operands for every parameter (and buffer) of `layer`: its working copy where it has
    /// one, else the master.
    pub(super) fn param_operands<'b, M>(
        &self,
        layer: LayerId,
        weights: &'b [M],
        working: &'b [Option<M>],
    ) -> Vec<Operand<'b, M>> {
        let end = self
            .first
            .get(layer.0 + 1)
            .copied()
            .unwrap_or(self.params.len());
        (self.first[layer.0]..end)
            .map(|slot| {
                let k = slot - self.first[layer.0];
                let rect = self.params[slot].spec.shape.full_rect();
                let value = working[slot].as_ref().unwrap_or(&weights[slot]);
                read(Role::Param(k as u8), rect, value)
            })
            .collect()
    }

    pub(super) fn run<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
        layer: LayerId,
        tile: Rect,
        phase: Phase,
        operands: Vec<Operand<'_, B::Buffer>>,
    ) -> Result<Option<B::Loss>, KernelError> {
        let before = self.mark(backend, stream)?;
        let mut call = KernelCall::new(
            backend, stream, self.graph, layer, tile, &self.ctx, operands,
        );
        call.run(phase)?;
        let loss = call.loss.take();
        let category = match phase {
            Phase::Update { .. } => "update",
            _ => "compute",
        };
        let name = || {
            let what = match phase {
                Phase::Forward => "fwd".to_string(),
                Phase::Backward => "bwd".to_string(),
                Phase::Update { param } => format!("update.{param}"),
                other => format!("{other:?}"),
            };
            format!("{}.{what}", self.graph.layer(layer).name)
        };
        self.record(backend, stream, before, name, category)?;
        Ok(loss)
    }

    /// A marker on the stream when this pass is traced.
    pub(super) fn mark<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
    ) -> Result<Option<K>, KernelError> {
        match &self.spans {
            Some(_) => backend.mark(stream).map(Some),
            None => Ok(None),
        }
    }

    /// Keeps the span from `before` to now under `name()`, when traced (the name is made only
    /// then: an untraced step formats nothing).
    pub(super) fn record<B: Backend<Marker = K>>(
        &self,
        backend: &B,
        stream: &mut B::Stream,
        before: Option<K>,
        name: impl FnOnce() -> String,
        category: &'static str,
    ) -> Result<(), KernelError> {
        if let (Some(spans), Some(before)) = (&self.spans, before) {
            let after = backend.mark(stream)?;
            spans.borrow_mut().push((name(), category, before, after));
        }
        Ok(())
    }

    /// Every layer's output, the pending loss with the number of samples it sums over, and what
    /// backward needs. `images` holds the batch (a taken [`Pipeline::stage_batch`], or the
    /// buffer a recorded step reads): the input layer's output, borrowed and never copied.
    #[allow(clippy::type_complexity)]
    pub(super) fn forward<'i, B: Backend<Marker = K>>(
        &self,
        b: &B,
        stream: &mut B::Stream,
        weights: &mut [B::Buffer],
        working: &[Option<B::Buffer>],
        images: &'i B::Buffer,
    ) -> Result<
        (
            Acts<'i, B::Buffer>,
            Option<(B::Loss, usize)>,
            Saved<B::Buffer>,
        ),
        KernelError,
    > {
        let g = self.graph;
        let input_layer = g.input();
        let mut acts = Acts {
            images,
            input: input_layer.0,
            outputs: Vec::with_capacity(g.layers().len()),
        };
        let mut saved = Saved {
            moments: BTreeMap::new(),
        };
        let mut loss = None;
        let precision = b.precision();
        for id in g.ids() {
            let layer = g.layer(id);
            let tile = self.full(id);
            if id == input_layer {
                // The images as the first activation: cast once where activations are not f32.
                let cast = match DType::activation(precision) {
                    DType::F32 => None,
                    dtype => {
                        let mut cast = b.alloc(stream, dtype, layer.shape.numel())?;
                        cast_over(b, stream, tile, images, &mut cast);
                        Some(cast)
                    }
                };
                acts.outputs.push(cast);
                continue;
            }
            let dtype = DType::output(&layer.op, precision);
            let mut y = b.alloc(stream, dtype, layer.shape.numel())?;
            let mut operands: Vec<Operand<'_, B::Buffer>> = layer
                .inputs
                .iter()
                .enumerate()
                .map(|(k, &src)| read(Role::Input(k as u8), self.full(src), acts.of(src)))
                .collect();
            if let Op::BatchNorm(_) = layer.op {
                let channels = layer.shape.dim(1);
                let sums = sums_rect(channels);
                let mut moments = b.alloc(stream, DType::F64, 3 * channels)?;
                let x = read(Role::Input(0), tile, acts.of(layer.inputs[0]));
                let first = vec![x, write(Role::Moments, sums, &mut moments)];
                self.run(b, stream, id, tile, Phase::BnMoments, first)?;
                operands.push(read(Role::Moments, sums, &moments));
                operands.extend(self.param_operands(id, weights, working));
                operands.push(write(Role::Output, tile, &mut y));
                self.run(b, stream, id, tile, Phase::BnNormalize, operands)?;
                let slice = Shape::new(&[channels]).full_rect();
                let (mean, var) = two_mut(weights, self.slot(id, 2), self.slot(id, 3));
                let running = vec![
                    read(Role::Moments, sums, &moments),
                    write(Role::Param(2), slice, mean),
                    write(Role::Param(3), slice, var),
                ];
                self.run(b, stream, id, slice, Phase::BnRunning, running)?;
                saved.moments.insert(id.0, moments);
            } else {
                operands.extend(self.param_operands(id, weights, working));
                operands.push(write(Role::Output, tile, &mut y));
                if let Some(pending) = self.run(b, stream, id, tile, Phase::Forward, operands)? {
                    loss = Some((pending, layer.shape.numel()));
                }
            }
            acts.outputs.push(Some(y));
        }
        Ok((acts, loss, saved))
    }

    /// The logits (the output of the layer before the loss) of inference on `images`: every
    /// layer's [`Phase::Infer`], which normalises batch norm with its running statistics, keeps
    /// every dropout unit and updates nothing.
    pub(super) fn infer<B: Backend<Marker = K>>(
        &self,
        b: &B,
        stream: &mut B::Stream,
        weights: &mut [B::Buffer],
        working: &[Option<B::Buffer>],
        images: &B::Buffer,
    ) -> Result<B::Buffer, KernelError> {
        let g = self.graph;
        let logits = g
            .logits()
            .ok_or_else(|| KernelError::Device("inference needs a loss layer".into()))?;
        let input_layer = g.input();
        let mut acts = Acts {
            images,
            input: input_layer.0,
            outputs: Vec::with_capacity(g.layers().len()),
        };
        let precision = b.precision();
        for id in g.ids().take(logits.0 + 1) {
            let layer = g.layer(id);
            let tile = self.full(id);
            if id == input_layer {
                let cast = match DType::activation(precision) {
                    DType::F32 => None,
                    dtype => {
                        let mut cast = b.alloc(stream, dtype, layer.shape.numel())?;
                        cast_over(b, stream, tile, images, &mut cast);
                        Some(cast)
                    }
                };
                acts.outputs.push(cast);
                continue;
            }
            let mut y = b.alloc(
                stream,
                DType::output(&layer.op, precision),
                layer.shape.numel(),
            )?;
            let mut operands: Vec<Operand<'_, B::Buffer>> = layer
                .inputs
                .iter()
                .enumerate()
                .map(|(k, &src)| read(Role::Input(k as u8), self.full(src), acts.of(src)))
                .collect();
            operands.extend(self.param_operands(id, weights, working));
            operands.push(write(Role::Output, tile, &mut y));
            self.run(b, stream, id, tile, Phase::Infer, operands)?;
            acts.outputs.push(Some(y));
        }
        acts.outputs
            .swap_remove(logits.0)
            .ok_or_else(|| KernelError::Device("the logits are the input layer's".into()))
    }

    /// The gradient of every trainable parameter, by slot.
    pub(super) fn backward<B: Backend<Marker = K>>(
        &self,
        b: &B,
        stream: &mut B::Stream,
        weights: &[B::Buffer],
        working: &[Option<B::Buffer>],
        acts: &Acts<'_, B::Buffer>,
        saved: &Saved<B::Buffer>,
    ) -> Result<Vec<Option<B::Buffer>>, KernelError> {
        let g = self.graph;
        // Gradient w.r.t. each layer's output, summed over its consumers.
        let mut dout: Vec<Option<B::Buffer>> = (0..g.layers().len()).map(|_| None).collect();
        let mut param_grads: Vec<Option<B::Buffer>> =
            (0..self.params.len()).map(|_| None).collect();
        for id in g.ids().rev() {
            let layer = g.layer(id);
            let tile = self.full(id);
            let reads = layer.op.backward_reads();
            let dy = dout[id.0].take();
            if dy.is_none() && reads.output_grad {
                // Nothing downstream depends on this layer (or it is the input).
                continue;
            }
            // The first input of a layer fed by the data needs no gradient.
            let needs_dx = |k: usize| !matches!(g.layer(layer.inputs[k]).op, Op::Input(_));
            let mut dxs: Vec<Option<B::Buffer>> = Vec::with_capacity(layer.inputs.len());
            for (k, src) in layer.inputs.iter().enumerate() {
                let source = g.layer(*src);
                let len = source.shape.numel();
                // A gradient is stored as its activation is.
                let dtype = DType::output(&source.op, b.precision());
                dxs.push(if needs_dx(k) {
                    Some(b.alloc(stream, dtype, len)?)
                } else {
                    None
                });
            }
            let param_specs = layer.op.spec().params(&g.input_shapes(id));
            let mut grads: Vec<Option<B::Buffer>> = Vec::with_capacity(param_specs.len());
            for p in &param_specs {
                let len = p.shape.numel();
                grads.push(if p.trainable {
                    Some(b.alloc(stream, DType::F32, len)?)
                } else {
                    None
                });
            }
            // What every backward phase may read: inputs, output, its gradient, parameters.
            let common = || {
                let mut operands: Vec<Operand<'_, B::Buffer>> = Vec::new();
                for (k, src) in layer.inputs.iter().enumerate() {
                    operands.push(read(Role::Input(k as u8), self.full(*src), acts.of(*src)));
                }
                operands.push(read(Role::Output, tile, acts.of(id)));
                if let Some(dy) = &dy {
                    operands.push(read(Role::OutputGrad, tile, dy));
                }
                operands.extend(self.param_operands(id, weights, working));
                operands
            };
            let param_rects: Vec<Rect> = param_specs.iter().map(|p| p.shape.full_rect()).collect();
            let input_rects: Vec<Rect> = layer.inputs.iter().map(|&src| self.full(src)).collect();
            if let Op::BatchNorm(_) = layer.op {
                let channels = layer.shape.dim(1);
                let moments = || read(Role::Moments, sums_rect(channels), &saved.moments[&id.0]);
                let mut sums = b.alloc(stream, DType::F64, 3 * channels)?;
                let mut first = common();
                first.push(moments());
                first.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                first.push(write(Role::GradSums, sums_rect(channels), &mut sums));
                self.run(b, stream, id, tile, Phase::BnGradSums, first)?;
                if dxs[0].is_some() {
                    let mut second = common();
                    second.push(moments());
                    second.push(read(Role::GradSums, sums_rect(channels), &sums));
                    second.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                    self.run(b, stream, id, tile, Phase::BnInputGrad, second)?;
                }
            } else {
                let mut operands = common();
                operands.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                operands.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                self.run(b, stream, id, tile, Phase::Backward, operands)?;
            }
            for (k, grad) in grads.into_iter().enumerate() {
                if grad.is_some() {
                    param_grads[self.slot(id, k)] = grad;
                }
            }
            for (k, dx) in dxs.into_iter().enumerate() {
                let Some(dx) = dx else { continue };
                let rect = input_rects[k];
                match &mut dout[layer.inputs[k].0] {
                    Some(acc) => {
                        let before = self.mark(b, stream)?;
                        b.accumulate(stream, Out { rect, mem: acc }, In { rect, mem: &dx });
                        let name = || format!("sum {}.grad", g.layer(layer.inputs[k]).name);
                        self.record(b, stream, before, name, "fold")?;
                    }
                    slot => *slot = Some(dx),
                }
            }
        }
        Ok(param_grads)
    }
}
