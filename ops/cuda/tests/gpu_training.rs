//! A small model (conv, batch norm, ReLU, pooling, dropout, dense, softmax cross-entropy) trains
//! three steps on the GPU as it does on the CPU.
//!
//! The driver below is the reference trainer's (`legion_ops::train`), written once over any
//! backend: every layer one whole-tensor `KernelCall`, forward in order, backward in reverse with
//! gradients summed over consumers, then SGD. On the CPU it must reproduce `Trainer` exactly (this
//! runs everywhere and checks the driver); on the GPU it must match within float rounding.

use legion_cuda::{Cuda, Stream};
use legion_ops::backend::cpu::{self, Cpu, CpuStream};
use legion_ops::backend::{Access, Backend, DType, KernelCall, Operand, Phase, Role, StepContext};
use legion_ops::op::{BatchNorm, Conv2d, Dense, Pool2d};
use legion_ops::rng::Rng;
use legion_ops::shape::{Rect, Shape};
use legion_ops::train::{ParamStore, Sgd, Trainer};
use legion_ops::{Graph, GraphBuilder, LayerId, Op};
use std::collections::BTreeMap;

trait Device: Backend {
    fn put(&self, s: &mut Self::Stream, host: &cpu::Buffer) -> Self::Buffer;
    fn get(&self, s: &mut Self::Stream, buffer: &Self::Buffer) -> cpu::Buffer;
    fn zeros(&self, s: &mut Self::Stream, dtype: DType, len: usize) -> Self::Buffer;
    /// `acc += term`, both laid out over `rect`.
    fn accumulate(
        &self,
        s: &mut Self::Stream,
        acc: &mut Self::Buffer,
        term: &Self::Buffer,
        rect: Rect,
    );
}

impl Device for Cpu {
    fn put(&self, _: &mut CpuStream, host: &cpu::Buffer) -> cpu::Buffer {
        host.clone()
    }
    fn get(&self, _: &mut CpuStream, buffer: &cpu::Buffer) -> cpu::Buffer {
        buffer.clone()
    }
    fn zeros(&self, _: &mut CpuStream, dtype: DType, len: usize) -> cpu::Buffer {
        cpu::Buffer::zeros(dtype, len)
    }
    fn accumulate(&self, _: &mut CpuStream, acc: &mut cpu::Buffer, term: &cpu::Buffer, _: Rect) {
        // as the trainer sums: element by element, in consumer order
        for (a, b) in acc.f32_mut().iter_mut().zip(term.f32()) {
            *a += *b;
        }
    }
}

impl Device for Cuda {
    fn put(&self, s: &mut Stream, host: &cpu::Buffer) -> legion_cuda::Buffer {
        self.upload(s, host).unwrap_or_else(|e| panic!("{e}"))
    }
    fn get(&self, s: &mut Stream, buffer: &legion_cuda::Buffer) -> cpu::Buffer {
        self.synchronize(s).unwrap_or_else(|e| panic!("{e}"));
        self.download(s, buffer).unwrap_or_else(|e| panic!("{e}"))
    }
    fn zeros(&self, s: &mut Stream, dtype: DType, len: usize) -> legion_cuda::Buffer {
        self.alloc_zeros(s, dtype, len)
            .unwrap_or_else(|e| panic!("{e}"))
    }
    fn accumulate(
        &self,
        s: &mut Stream,
        acc: &mut legion_cuda::Buffer,
        term: &legion_cuda::Buffer,
        rect: Rect,
    ) {
        self.add_rect(s, term, &rect, acc, &rect, &rect);
    }
}

fn read<M>(role: Role, rect: Rect, mem: &M) -> Operand<'_, M> {
    Operand {
        role,
        rect,
        access: Access::Read(mem),
    }
}

fn write<M>(role: Role, rect: Rect, mem: &mut M) -> Operand<'_, M> {
    Operand {
        role,
        rect,
        access: Access::Write(mem),
    }
}

/// Write operands `role(k)` for the present buffers, each laid out over `rects[k]`.
fn writes<'b, M>(
    role: fn(u8) -> Role,
    rects: &[Rect],
    buffers: &'b mut [Option<M>],
) -> Vec<Operand<'b, M>> {
    buffers
        .iter_mut()
        .zip(rects)
        .enumerate()
        .filter_map(|(k, (b, &rect))| b.as_mut().map(|b| write(role(k as u8), rect, b)))
        .collect()
}

fn sums_rect(channels: usize) -> Rect {
    Shape::new(&[3, channels]).full_rect()
}

/// What a run leaves: the per-step loss and correct count, then the parameters and velocities.
struct Trained {
    losses: Vec<(f64, usize)>,
    params: Vec<cpu::Buffer>,
    velocity: Vec<cpu::Buffer>,
}

struct Driver<'a, D: Device> {
    d: &'a D,
    graph: &'a Graph,
    store: &'a ParamStore,
}

impl<'a, D: Device> Driver<'a, D> {
    fn full(&self, layer: LayerId) -> Rect {
        self.graph.layer(layer).shape.full_rect()
    }

    fn param_reads<'b>(
        &self,
        layer: LayerId,
        params: &'b [D::Buffer],
    ) -> Vec<Operand<'b, D::Buffer>> {
        let count = self
            .graph
            .layer(layer)
            .op
            .spec()
            .params(&self.graph.input_shapes(layer))
            .len();
        (0..count)
            .map(|k| {
                let slot = self.store.slot(layer, k);
                let rect = self.store.params[slot].spec.shape.full_rect();
                read(Role::Param(k as u8), rect, &params[slot])
            })
            .collect()
    }

    fn run(
        &self,
        s: &mut D::Stream,
        ctx: &StepContext,
        layer: LayerId,
        tile: Rect,
        phase: Phase,
        operands: Vec<Operand<'_, D::Buffer>>,
    ) -> Option<(f64, usize)> {
        let mut call = KernelCall::new(self.d, s, self.graph, layer, tile, ctx, operands);
        call.run(phase).unwrap_or_else(|e| panic!("{phase}: {e}"));
        let loss = call.loss.take();
        self.d
            .synchronize(s)
            .unwrap_or_else(|e| panic!("{phase}: {e}"));
        loss.map(|l| {
            let sums = self.d.read_loss(l);
            (sums.loss_sum, sums.correct)
        })
    }

    fn train(
        &self,
        s: &mut D::Stream,
        sgd: Sgd,
        seed: u64,
        batches: &[(Vec<f32>, Vec<u32>)],
    ) -> Trained {
        let g = self.graph;
        let d = self.d;
        let mut params: Vec<D::Buffer> = self
            .store
            .values
            .iter()
            .map(|v| d.put(s, &cpu::Buffer::F32(v.clone())))
            .collect();
        let mut velocity: Vec<D::Buffer> = self
            .store
            .values
            .iter()
            .map(|v| d.zeros(s, DType::F32, v.len()))
            .collect();
        let mut losses = Vec::new();
        for (step, (images, labels)) in batches.iter().enumerate() {
            let batch = g.batch();
            let ctx = StepContext {
                seed,
                step: step as u64,
                sgd,
                images,
                image_samples: 0..batch,
                labels,
                label_samples: 0..batch,
            };
            // forward
            let mut acts: Vec<D::Buffer> = Vec::new();
            let mut moments_of: BTreeMap<usize, D::Buffer> = BTreeMap::new();
            let mut step_loss = (0.0, 0);
            for id in g.ids() {
                let layer = g.layer(id);
                let tile = self.full(id);
                let mut y = d.zeros(s, DType::F32, layer.shape.numel());
                let mut operands: Vec<Operand<'_, D::Buffer>> = layer
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(k, &src)| read(Role::Input(k as u8), self.full(src), &acts[src.0]))
                    .collect();
                if let Op::BatchNorm(_) = layer.op {
                    let channels = layer.shape.dim(1);
                    let mut moments = d.zeros(s, DType::F64, 3 * channels);
                    let x = read(Role::Input(0), tile, &acts[layer.inputs[0].0]);
                    let sums = write(Role::Moments, sums_rect(channels), &mut moments);
                    self.run(s, &ctx, id, tile, Phase::BnMoments, vec![x, sums]);
                    operands.push(read(Role::Moments, sums_rect(channels), &moments));
                    operands.extend(self.param_reads(id, &params));
                    operands.push(write(Role::Output, tile, &mut y));
                    self.run(s, &ctx, id, tile, Phase::BnNormalize, operands);
                    let slice = Shape::new(&[channels]).full_rect();
                    let (mean_slot, var_slot) = (self.store.slot(id, 2), self.store.slot(id, 3));
                    let (head, tail) = params.split_at_mut(var_slot);
                    let running = vec![
                        read(Role::Moments, sums_rect(channels), &moments),
                        write(Role::Param(2), slice, &mut head[mean_slot]),
                        write(Role::Param(3), slice, &mut tail[0]),
                    ];
                    self.run(s, &ctx, id, slice, Phase::BnRunning, running);
                    moments_of.insert(id.0, moments);
                } else {
                    operands.extend(self.param_reads(id, &params));
                    operands.push(write(Role::Output, tile, &mut y));
                    if let Some(loss) = self.run(s, &ctx, id, tile, Phase::Forward, operands) {
                        step_loss = loss;
                    }
                }
                acts.push(y);
            }
            losses.push(step_loss);
            // backward
            let mut dout: Vec<Option<D::Buffer>> = (0..g.layers().len()).map(|_| None).collect();
            let mut param_grads: Vec<Option<D::Buffer>> = (0..params.len()).map(|_| None).collect();
            for id in g.ids().rev() {
                let layer = g.layer(id);
                let tile = self.full(id);
                let reads = layer.op.backward_reads();
                let dy = dout[id.0].take();
                if dy.is_none() && reads.output_grad {
                    continue;
                }
                let needs_dx = |k: usize| !matches!(g.layer(layer.inputs[k]).op, Op::Input(_));
                let mut dxs: Vec<Option<D::Buffer>> = (0..layer.inputs.len())
                    .map(|k| {
                        needs_dx(k)
                            .then(|| d.zeros(s, DType::F32, g.layer(layer.inputs[k]).shape.numel()))
                    })
                    .collect();
                let specs = layer.op.spec().params(&g.input_shapes(id));
                let mut grads: Vec<Option<D::Buffer>> = specs
                    .iter()
                    .map(|p| p.trainable.then(|| d.zeros(s, DType::F32, p.shape.numel())))
                    .collect();
                let param_rects: Vec<Rect> = specs.iter().map(|p| p.shape.full_rect()).collect();
                let input_rects: Vec<Rect> =
                    layer.inputs.iter().map(|&src| self.full(src)).collect();
                let common = || {
                    let mut operands: Vec<Operand<'_, D::Buffer>> = layer
                        .inputs
                        .iter()
                        .enumerate()
                        .map(|(k, src)| read(Role::Input(k as u8), self.full(*src), &acts[src.0]))
                        .collect();
                    operands.push(read(Role::Output, tile, &acts[id.0]));
                    if let Some(dy) = &dy {
                        operands.push(read(Role::OutputGrad, tile, dy));
                    }
                    operands.extend(self.param_reads(id, &params));
                    operands
                };
                if let Op::BatchNorm(_) = layer.op {
                    let channels = layer.shape.dim(1);
                    let moments = &moments_of[&id.0];
                    let mut sums = d.zeros(s, DType::F64, 3 * channels);
                    let mut first = common();
                    first.push(read(Role::Moments, sums_rect(channels), moments));
                    first.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                    first.push(write(Role::GradSums, sums_rect(channels), &mut sums));
                    self.run(s, &ctx, id, tile, Phase::BnGradSums, first);
                    if dxs[0].is_some() {
                        let mut second = common();
                        second.push(read(Role::Moments, sums_rect(channels), moments));
                        second.push(read(Role::GradSums, sums_rect(channels), &sums));
                        second.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                        self.run(s, &ctx, id, tile, Phase::BnInputGrad, second);
                    }
                } else {
                    let mut operands = common();
                    operands.extend(writes(Role::ParamGrad, &param_rects, &mut grads));
                    operands.extend(writes(Role::InputGrad, &input_rects, &mut dxs));
                    self.run(s, &ctx, id, tile, Phase::Backward, operands);
                }
                for (k, grad) in grads.into_iter().enumerate() {
                    if grad.is_some() {
                        param_grads[self.store.slot(id, k)] = grad;
                    }
                }
                for (k, dx) in dxs.into_iter().enumerate() {
                    let Some(dx) = dx else { continue };
                    let src = layer.inputs[k];
                    match &mut dout[src.0] {
                        Some(acc) => d.accumulate(s, acc, &dx, self.full(src)),
                        slot => *slot = Some(dx),
                    }
                }
            }
            // update
            for (slot, grad) in param_grads.into_iter().enumerate() {
                let Some(grad) = grad else { continue };
                let p = &self.store.params[slot];
                let rect = p.spec.shape.full_rect();
                let param = (slot - self.store.slot(p.layer, 0)) as u8;
                let operands = vec![
                    read(Role::ParamGrad(param), rect, &grad),
                    write(Role::Param(param), rect, &mut params[slot]),
                    write(Role::Velocity(param), rect, &mut velocity[slot]),
                ];
                self.run(s, &ctx, p.layer, rect, Phase::Update { param }, operands);
            }
        }
        Trained {
            losses,
            params: params.iter().map(|p| d.get(s, p)).collect(),
            velocity: velocity.iter().map(|v| d.get(s, v)).collect(),
        }
    }
}

fn tiny_model(batch: usize) -> Graph {
    let mut m = GraphBuilder::new("tiny");
    let x = m.input("data", Shape::nchw(batch, 3, 12, 12)).unwrap();
    let c1 = m.conv2d("conv1", x, Conv2d::new(8, 3).padding(1)).unwrap();
    let b1 = m
        .batch_norm("bn1", c1, BatchNorm::default().relu())
        .unwrap();
    let p1 = m.pool2d("pool1", b1, Pool2d::max(2)).unwrap();
    let c2 = m
        .conv2d("conv2", p1, Conv2d::new(6, 3).stride(2).padding(1).relu())
        .unwrap();
    let b2 = m.batch_norm("bn2", c2, BatchNorm::default()).unwrap();
    let r2 = m.relu("relu2", b2).unwrap();
    let p2 = m
        .pool2d("pool2", r2, Pool2d::avg(3).stride(1).padding(1))
        .unwrap();
    let f = m.flatten("flat", p2).unwrap();
    let h = m.dense("fc1", f, Dense::new(16).relu()).unwrap();
    let h = m.dropout("drop", h, 0.25).unwrap();
    let o = m.dense("fc2", h, Dense::new(5)).unwrap();
    m.softmax_cross_entropy("loss", o).unwrap();
    m.finish()
}

fn batches(graph: &Graph, steps: usize) -> Vec<(Vec<f32>, Vec<u32>)> {
    let mut rng = Rng::new(77);
    let pixels = graph.layer(graph.input()).shape.numel();
    (0..steps)
        .map(|_| {
            let images = (0..pixels).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let labels = (0..graph.batch()).map(|_| rng.below(5) as u32).collect();
            (images, labels)
        })
        .collect()
}

const SEED: u64 = 11;

fn cpu_run(graph: &Graph, data: &[(Vec<f32>, Vec<u32>)]) -> Trained {
    let store = ParamStore::init(graph, SEED);
    Driver {
        d: &Cpu,
        graph,
        store: &store,
    }
    .train(&mut CpuStream, Sgd::default(), SEED, data)
}

fn relative_error(a: &cpu::Buffer, b: &cpu::Buffer) -> f64 {
    let (a, b) = (a.f32(), b.f32());
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
    if scale > 0.0 { diff / scale } else { diff }
}

#[test]
fn the_generic_driver_on_the_cpu_is_the_reference_trainer() {
    let graph = tiny_model(4);
    let data = batches(&graph, 3);
    let ours = cpu_run(&graph, &data);
    let mut trainer = Trainer::new(
        graph.clone(),
        ParamStore::init(&graph, SEED),
        Sgd::default(),
        SEED,
    );
    for (step, (images, labels)) in data.iter().enumerate() {
        let stats = trainer.step(images, labels).unwrap();
        let (loss_sum, correct) = ours.losses[step];
        assert_eq!(
            stats.loss,
            (loss_sum / graph.batch() as f64) as f32,
            "step {step}"
        );
        assert_eq!(stats.correct, correct, "step {step}");
    }
    for (slot, values) in trainer.params().values.iter().enumerate() {
        assert_eq!(ours.params[slot].f32(), &values[..], "parameter {slot}");
    }
    assert_eq!(
        trainer.state().momentum,
        ours.velocity
            .iter()
            .map(|v| v.f32().to_vec())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_tiny_model_trains_three_steps_on_the_gpu_as_on_the_cpu() {
    let cuda = match Cuda::new(0) {
        Ok(cuda) => cuda,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let mut stream = cuda.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let graph = tiny_model(4);
    let data = batches(&graph, 3);
    let cpu = cpu_run(&graph, &data);
    let store = ParamStore::init(&graph, SEED);
    let gpu = Driver {
        d: &cuda,
        graph: &graph,
        store: &store,
    }
    .train(&mut stream, Sgd::default(), SEED, &data);
    // Convolutions and GEMMs sum in another order than the CPU; three steps of SGD keep the
    // difference at rounding level.
    const TOLERANCE: f64 = 1e-4;
    let mut failures = Vec::new();
    for (step, (&(g_loss, g_correct), &(c_loss, c_correct))) in
        gpu.losses.iter().zip(&cpu.losses).enumerate()
    {
        let error = (g_loss - c_loss).abs() / c_loss.abs().max(1e-12);
        if error > TOLERANCE || g_correct != c_correct {
            failures.push(format!(
                "step {step}: loss {g_loss} vs {c_loss}, correct {g_correct} vs {c_correct}"
            ));
        }
    }
    for (slot, (g, c)) in gpu.params.iter().zip(&cpu.params).enumerate() {
        let error = relative_error(g, c);
        if error > TOLERANCE {
            failures.push(format!(
                "parameter {} ({slot}): relative error {error:.3e}",
                store.params[slot].name
            ));
        }
    }
    for (slot, (g, c)) in gpu.velocity.iter().zip(&cpu.velocity).enumerate() {
        let error = relative_error(g, c);
        if error > TOLERANCE {
            failures.push(format!(
                "velocity of {} ({slot}): relative error {error:.3e}",
                store.params[slot].name
            ));
        }
    }
    println!("losses: GPU {:?}, CPU {:?}", gpu.losses, cpu.losses);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
