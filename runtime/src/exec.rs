//! Runs one task's kernel on its instances. The only per-op code of the executing runtime: it maps
//! a task's roles to the arguments of the kernels in `legion_ops::kernels`.

use crate::buffer::Buffer;
use crate::task::{Role, TaskKind, TaskSpec};
use legion_ops::kernels::batch_norm::{self, BatchStats, GradSums, MomentSums};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::kernels::softmax_ce::{self, LabelOutOfRange};
use legion_ops::kernels::{self, View, ViewMut};
use legion_ops::op::Op;
use legion_ops::shape::copy_rect;
use legion_ops::train::Sgd;
use legion_ops::{Graph, Rect};
use std::ops::Range;

/// The data of one step, shared by a process's devices: the whole batch on the embedded cluster,
/// on a cluster worker only the samples its devices read (see `StepPlan::samples_read`).
#[derive(Debug)]
pub struct StepInput {
    pub step: u64,
    /// The images of samples `image_samples` of the batch, laid out like the input layer's output.
    pub images: Vec<f32>,
    pub image_samples: Range<usize>,
    /// The labels of samples `label_samples`.
    pub labels: Vec<u32>,
    pub label_samples: Range<usize>,
}

impl StepInput {
    /// The whole batch of `batch` samples.
    pub fn whole(step: u64, images: Vec<f32>, labels: Vec<u32>, batch: usize) -> StepInput {
        StepInput {
            step,
            images,
            image_samples: 0..batch,
            labels,
            label_samples: 0..batch,
        }
    }

    pub fn view(&self) -> BatchView<'_> {
        BatchView {
            images: &self.images,
            image_samples: self.image_samples.clone(),
            labels: &self.labels,
            label_samples: self.label_samples.clone(),
        }
    }

    /// The labels of samples `samples`, which must lie within `label_samples`.
    fn labels_of(&self, samples: Range<usize>) -> &[u32] {
        let first = self.label_samples.start;
        &self.labels[samples.start - first..samples.end - first]
    }
}

/// Borrowed samples of a batch, as [`StepInput`] holds them.
#[derive(Clone, Debug)]
pub struct BatchView<'a> {
    pub images: &'a [f32],
    pub image_samples: Range<usize>,
    pub labels: &'a [u32],
    pub label_samples: Range<usize>,
}

impl<'a> BatchView<'a> {
    /// A whole batch of `batch` samples.
    pub fn whole(images: &'a [f32], labels: &'a [u32], batch: usize) -> BatchView<'a> {
        BatchView {
            images,
            image_samples: 0..batch,
            labels,
            label_samples: 0..batch,
        }
    }
}

/// What the tasks of a run share.
pub struct ExecContext<'a> {
    pub graph: &'a Graph,
    pub seed: u64,
    pub sgd: Sgd,
    pub input: &'a StepInput,
}

/// What a task reports besides its writes: the loss layer's share of the loss.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TaskOutcome {
    pub loss_sum: f64,
    pub correct: usize,
}

/// A task's access to the buffer of one requirement.
pub enum Access<'a> {
    Read(&'a Buffer),
    Write(&'a mut Buffer),
}

/// Runs `task` with `access[i]` for requirement `i`.
pub fn execute(
    ctx: &ExecContext,
    task: &TaskSpec,
    access: Vec<Access<'_>>,
) -> Result<TaskOutcome, LabelOutOfRange> {
    // The overhead probe: nothing to compute, and its layer may be any layer of the graph.
    if task.kind == TaskKind::Empty {
        return Ok(TaskOutcome::default());
    }
    let mut args = Args {
        task,
        access: access.into_iter().map(Some).collect(),
    };
    let layer = ctx.graph.layer(task.layer);
    let in_shape = |k: usize| ctx.graph.layer(layer.inputs[k]).shape;
    let tile = task.tile;
    let mut outcome = TaskOutcome::default();
    let dropout_mask = |rate: f32| DropoutMask {
        rate,
        seed: ctx.seed,
        step: ctx.input.step,
        layer_salt: task.layer.0 as u64,
        shape: layer.shape,
    };
    let tile_labels = || ctx.input.labels_of(tile.lo[0]..tile.hi[0]);
    match (task.kind, &layer.op) {
        (TaskKind::LoadInput, _) => {
            let y = args.write(Role::Output);
            let mut held = layer.shape.full_rect();
            held.lo[0] = ctx.input.image_samples.start;
            held.hi[0] = ctx.input.image_samples.end;
            copy_rect(&ctx.input.images, &held, y.data, &y.rect, &tile);
        }
        (TaskKind::Forward, op) => {
            let y = args.write(Role::Output);
            match op {
                Op::Conv2d(c) => {
                    let b = c.bias.then(|| args.read(Role::Param(1)));
                    kernels::conv2d::conv2d_forward(
                        c,
                        in_shape(0),
                        args.read(Role::Input(0)),
                        args.read(Role::Param(0)),
                        b,
                        y,
                    );
                }
                Op::Pool2d(p) => {
                    kernels::pool2d::pool2d_forward(p, in_shape(0), args.read(Role::Input(0)), y)
                }
                Op::Dense(d) => {
                    let b = d.bias.then(|| args.read(Role::Param(1)));
                    kernels::dense::dense_forward(
                        d,
                        args.read(Role::Input(0)),
                        args.read(Role::Param(0)),
                        b,
                        y,
                    );
                }
                Op::Relu(_) => kernels::relu::relu_forward(args.read(Role::Input(0)), y),
                Op::Flatten(_) => y.data.copy_from_slice(args.read(Role::Input(0)).data),
                Op::Concat(_) => {
                    let shapes = ctx.graph.input_shapes(task.layer);
                    let xs: Vec<View> = (0..shapes.len())
                        .map(|k| args.read_or_empty(Role::Input(k as u8), &shapes[k]))
                        .collect();
                    kernels::concat::concat_forward(&shapes, &xs, y);
                }
                Op::Add(_) => kernels::add::add_forward(
                    args.read(Role::Input(0)),
                    args.read(Role::Input(1)),
                    y,
                ),
                Op::Dropout(d) => kernels::dropout::dropout_forward(
                    &dropout_mask(d.rate),
                    args.read(Role::Input(0)),
                    y,
                ),
                Op::SoftmaxCrossEntropy(_) => {
                    let logits = args.read(Role::Input(0));
                    outcome.loss_sum = softmax_ce::softmax_ce_forward(logits, tile_labels(), y)?;
                    outcome.correct = softmax_ce::count_correct(logits, tile_labels());
                }
                Op::Input(_) | Op::BatchNorm(_) => unreachable!("lowered to their own task kinds"),
            }
        }
        (TaskKind::Backward, op) => backward(ctx, task, op, &mut args, dropout_mask)?,
        (TaskKind::BnMoments, _) => {
            let sums = batch_norm::partial_moments(args.read(Role::Input(0)), &tile);
            write_sums(
                args.write_buffer(Role::Moments),
                sums.count,
                &sums.sum,
                &sums.sum_sq,
            );
        }
        (TaskKind::BnNormalize, Op::BatchNorm(bn)) => {
            let stats = args.batch_stats(bn.eps);
            let y = args.write(Role::Output);
            batch_norm::normalize(
                args.read(Role::Input(0)),
                &stats,
                args.read(Role::Param(0)),
                args.read(Role::Param(1)),
                bn.relu,
                y,
            );
        }
        (TaskKind::BnRunning, Op::BatchNorm(bn)) => {
            let stats = args.batch_stats(bn.eps);
            let mean = args.write(Role::Param(2));
            let var = args.write(Role::Param(3));
            stats.update_running(bn.momentum, mean, var);
        }
        (TaskKind::BnGradSums, Op::BatchNorm(bn)) => {
            let stats = args.batch_stats(bn.eps);
            let y = bn.relu.then(|| args.read(Role::Output));
            let sums = batch_norm::partial_grad_sums(
                args.read(Role::Input(0)),
                y,
                args.read(Role::OutputGrad),
                &stats,
                &tile,
            );
            sums.param_grads(
                args.write(Role::ParamGrad(0)),
                args.write(Role::ParamGrad(1)),
            );
            write_sums(
                args.write_buffer(Role::GradSums),
                sums.count,
                &sums.sum_dy,
                &sums.sum_dy_xhat,
            );
        }
        (TaskKind::BnInputGrad, Op::BatchNorm(bn)) => {
            let stats = args.batch_stats(bn.eps);
            let (count, sum_dy, sum_dy_xhat) = read_sums(args.read_buffer(Role::GradSums));
            let sums = GradSums {
                channels: tile.lo[1]..tile.hi[1],
                count,
                sum_dy,
                sum_dy_xhat,
            };
            let y = bn.relu.then(|| args.read(Role::Output));
            let dx = args.write(Role::InputGrad(0));
            batch_norm::input_grad(
                args.read(Role::Input(0)),
                y,
                args.read(Role::OutputGrad),
                &stats,
                args.read(Role::Param(0)),
                &sums,
                dx,
            );
        }
        (TaskKind::Update { param }, _) => {
            let grad = args.read(Role::ParamGrad(param));
            let velocity = args.write(Role::Velocity(param));
            let w = args.write(Role::Param(param));
            ctx.sgd.update(w.data, grad.data, velocity.data);
        }
        (kind, op) => unreachable!("no {} task for a {} layer", kind.name(), op.kind()),
    }
    Ok(outcome)
}

fn backward(
    ctx: &ExecContext,
    task: &TaskSpec,
    op: &Op,
    args: &mut Args,
    dropout_mask: impl Fn(f32) -> DropoutMask,
) -> Result<(), LabelOutOfRange> {
    let layer = ctx.graph.layer(task.layer);
    let in_shape = |k: usize| ctx.graph.layer(layer.inputs[k]).shape;
    let tile = task.tile;
    match op {
        Op::Conv2d(c) => {
            let dw = args.write(Role::ParamGrad(0));
            let db = args.try_write(Role::ParamGrad(1));
            let dx = args.try_write(Role::InputGrad(0));
            kernels::conv2d::conv2d_backward(
                c,
                in_shape(0),
                args.read(Role::Input(0)),
                args.read(Role::Param(0)),
                args.read(Role::Output),
                args.read(Role::OutputGrad),
                dx,
                dw,
                db,
            );
        }
        Op::Dense(d) => {
            let dw = args.write(Role::ParamGrad(0));
            let db = args.try_write(Role::ParamGrad(1));
            let dx = args.try_write(Role::InputGrad(0));
            kernels::dense::dense_backward(
                d,
                args.read(Role::Input(0)),
                args.read(Role::Param(0)),
                args.read(Role::Output),
                args.read(Role::OutputGrad),
                dx,
                dw,
                db,
            );
        }
        Op::Pool2d(p) => {
            if let Some(dx) = args.try_write(Role::InputGrad(0)) {
                kernels::pool2d::pool2d_backward(
                    p,
                    in_shape(0),
                    args.read(Role::Input(0)),
                    args.read(Role::OutputGrad),
                    dx,
                );
            }
        }
        Op::Relu(_) => {
            if let Some(dx) = args.try_write(Role::InputGrad(0)) {
                kernels::relu::relu_backward(
                    args.read(Role::Output),
                    args.read(Role::OutputGrad),
                    dx,
                );
            }
        }
        Op::Flatten(_) => {
            if let Some(dx) = args.try_write(Role::InputGrad(0)) {
                dx.data.copy_from_slice(args.read(Role::OutputGrad).data);
            }
        }
        Op::Dropout(d) => {
            if let Some(dx) = args.try_write(Role::InputGrad(0)) {
                kernels::dropout::dropout_backward(
                    &dropout_mask(d.rate),
                    args.read(Role::OutputGrad),
                    dx,
                );
            }
        }
        Op::Add(_) => {
            let dy = args.read(Role::OutputGrad);
            let mut scratch = Vec::new();
            let da = args.write_or_scratch(Role::InputGrad(0), tile, &mut scratch);
            let mut scratch = Vec::new();
            let db = args.write_or_scratch(Role::InputGrad(1), tile, &mut scratch);
            kernels::add::add_backward(dy, da, db);
        }
        Op::Concat(_) => {
            let shapes = ctx.graph.input_shapes(task.layer);
            let slices = layer.op.spec().project(&shapes, &tile);
            let mut scratch: Vec<Vec<f32>> = vec![Vec::new(); shapes.len()];
            let mut dxs: Vec<ViewMut> = Vec::with_capacity(shapes.len());
            for (k, s) in scratch.iter_mut().enumerate() {
                dxs.push(args.write_or_scratch(Role::InputGrad(k as u8), slices[k], s));
            }
            kernels::concat::concat_backward(&shapes, args.read(Role::OutputGrad), &mut dxs);
        }
        Op::SoftmaxCrossEntropy(_) => {
            let labels = ctx.input.labels_of(tile.lo[0]..tile.hi[0]);
            if let Some(dx) = args.try_write(Role::InputGrad(0)) {
                let scale = 1.0 / ctx.graph.batch() as f32;
                softmax_ce::softmax_ce_backward(args.read(Role::Input(0)), labels, scale, dx)?;
            }
        }
        Op::Input(_) | Op::BatchNorm(_) => unreachable!("lowered to their own task kinds"),
    }
    Ok(())
}

/// `[3, C]` sums: a row of counts, then two rows of per-channel sums.
fn write_sums(buffer: &mut Buffer, count: u64, a: &[f64], b: &[f64]) {
    let out = buffer.f64_mut();
    let c = a.len();
    out[..c].fill(count as f64);
    out[c..2 * c].copy_from_slice(a);
    out[2 * c..].copy_from_slice(b);
}

fn read_sums(buffer: &Buffer) -> (u64, Vec<f64>, Vec<f64>) {
    let v = buffer.f64();
    let c = v.len() / 3;
    (v[0] as u64, v[c..2 * c].to_vec(), v[2 * c..].to_vec())
}

struct Args<'t, 'a> {
    task: &'t TaskSpec,
    access: Vec<Option<Access<'a>>>,
}

impl<'a> Args<'_, 'a> {
    fn index(&self, role: Role) -> Option<usize> {
        self.task.find(role)
    }

    fn read_buffer(&self, role: Role) -> &'a Buffer {
        let i = self
            .index(role)
            .unwrap_or_else(|| panic!("{}: no {role:?} requirement", self.task));
        match &self.access[i] {
            Some(Access::Read(b)) => b,
            _ => panic!("{}: {role:?} is not readable", self.task),
        }
    }

    fn read(&self, role: Role) -> View<'a> {
        let i = self
            .index(role)
            .unwrap_or_else(|| panic!("{}: no {role:?} requirement", self.task));
        View::new(self.task.requirements[i].rect, self.read_buffer(role).f32())
    }

    /// An input the tile does not touch reads as an empty view.
    fn read_or_empty(&self, role: Role, shape: &legion_ops::Shape) -> View<'a> {
        match self.index(role) {
            Some(_) => self.read(role),
            None => {
                let zero = vec![0; shape.ndim()];
                View::new(Rect::new(&zero, &zero), &[])
            }
        }
    }

    fn write_buffer(&mut self, role: Role) -> &'a mut Buffer {
        let i = self
            .index(role)
            .unwrap_or_else(|| panic!("{}: no {role:?} requirement", self.task));
        match self.access[i].take() {
            Some(Access::Write(b)) => b,
            _ => panic!("{}: {role:?} is not writable (or taken twice)", self.task),
        }
    }

    fn try_write(&mut self, role: Role) -> Option<ViewMut<'a>> {
        self.index(role)?;
        Some(self.write(role))
    }

    fn write(&mut self, role: Role) -> ViewMut<'a> {
        let i = self
            .index(role)
            .unwrap_or_else(|| panic!("{}: no {role:?} requirement", self.task));
        let rect = self.task.requirements[i].rect;
        ViewMut::new(rect, self.write_buffer(role).f32_mut())
    }

    /// The gradient of an input that needs none (fed by the data, or not touched by the tile) goes
    /// to a scratch buffer.
    fn write_or_scratch<'s>(
        &mut self,
        role: Role,
        rect: Rect,
        scratch: &'s mut Vec<f32>,
    ) -> ViewMut<'s>
    where
        'a: 's,
    {
        match self.index(role) {
            Some(_) => self.write(role),
            None => {
                scratch.resize(rect.volume(), 0.0);
                ViewMut::new(rect, scratch)
            }
        }
    }

    fn batch_stats(&self, eps: f32) -> BatchStats {
        let (count, sum, sum_sq) = read_sums(self.read_buffer(Role::Moments));
        let c = &self.task.tile;
        // The running-statistics task's tile is the 1-d channel slice.
        let channels = if c.ndim() == 1 {
            c.lo[0]..c.hi[0]
        } else {
            c.lo[1]..c.hi[1]
        };
        BatchStats::from_sums(
            &MomentSums {
                channels,
                count,
                sum,
                sum_sq,
            },
            eps,
        )
    }
}
