//! The op catalogue: one file per op with its attributes, shape inference, parameters, FLOPs,
//! parallelizable dims and projection. Kernels live in `crate::kernels`.
//!
//! The projection (output tile → input rects) is the single source of truth for both the planner's
//! transfer costs and the runtime's copies, so it is defined here, next to the op, and nowhere else.

mod adaptive_pool;
mod add;
mod batch_norm;
mod concat;
mod conv2d;
mod dense;
mod dropout;
mod flatten;
mod input;
mod mul;
mod pool2d;
mod relu;
mod softmax_ce;
mod unary;

pub use adaptive_pool::AdaptiveAvgPool2d;
pub use add::Add;
pub use batch_norm::{
    BatchNorm, sums_rect as batch_norm_sums_rect, tile_sums_rect as batch_norm_tile_sums_rect,
};
pub use concat::Concat;
pub use conv2d::Conv2d;
pub use dense::Dense;
pub use dropout::Dropout;
pub use flatten::Flatten;
pub use input::Input;
pub use mul::Mul;
pub use pool2d::{Pool2d, PoolKind, PoolWindows};
pub use relu::Relu;
pub use softmax_ce::SoftmaxCrossEntropy;
pub use unary::{GradFrom, Unary, UnaryOp};

use crate::backend::{Backend, In, KernelCall, KernelError, Out, Phase, Role};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// Activation fused into a conv or dense layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    #[default]
    None,
    Relu,
}

/// How a parameter is initialised from the seeded generator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in ±1/sqrt(fan_in): PyTorch's default for `Conv2d` and `Linear` weights and biases.
    /// He-uniform (±sqrt(6/fan_in)) started AlexNet at a loss of ~30–50 instead of ln(classes).
    FanInUniform {
        fan_in: usize,
    },
    Zeros,
    Ones,
}

/// A parameter (trainable) or buffer (state such as batch-norm running statistics) of a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Suffix of the tensor name: `weight`, `bias`, `running_mean` ... (full name is `layer.suffix`).
    pub suffix: &'static str,
    pub shape: Shape,
    pub init: Init,
    pub trainable: bool,
}

impl ParamSpec {
    pub fn trainable(suffix: &'static str, shape: Shape, init: Init) -> ParamSpec {
        ParamSpec {
            suffix,
            shape,
            init,
            trainable: true,
        }
    }

    pub fn buffer(suffix: &'static str, shape: Shape, init: Init) -> ParamSpec {
        ParamSpec {
            suffix,
            shape,
            init,
            trainable: false,
        }
    }
}

/// Floating-point operations of one layer over the whole batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flops {
    pub forward: u64,
    pub backward: u64,
}

impl Flops {
    /// `forward` and `backward` FLOPs for each of `count` elements; `None` if that overflows.
    pub(crate) fn per_element(count: usize, forward: u64, backward: u64) -> Option<Flops> {
        let count = count as u64;
        Some(Flops {
            forward: count.checked_mul(forward)?,
            backward: count.checked_mul(backward)?,
        })
    }

    /// A layer that is one GEMM of `macs` multiply-adds forward and two backward (input and weight
    /// gradients), plus `outputs` element-wise operations (bias, activation) each way.
    pub(crate) fn gemm(macs: Option<u64>, outputs: usize) -> Option<Flops> {
        let macs = macs?;
        let outputs = outputs as u64;
        Some(Flops {
            forward: macs.checked_mul(2)?.checked_add(outputs)?,
            backward: macs.checked_mul(4)?.checked_add(outputs.checked_mul(2)?)?,
        })
    }

    /// The sum, or `None` if it overflows.
    pub fn checked_add(self, other: Flops) -> Option<Flops> {
        Some(Flops {
            forward: self.forward.checked_add(other.forward)?,
            backward: self.backward.checked_add(other.backward)?,
        })
    }

    /// Forward plus backward, or `None` if that overflows.
    pub fn checked_total(self) -> Option<u64> {
        self.forward.checked_add(self.backward)
    }
}

/// What every op declares. `inputs` are the shapes of the layer's inputs, in order.
pub trait OpSpec {
    /// Output shape, or what is wrong with the inputs (the caller adds the layer's name).
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String>;

    /// Parameters and buffers, in a stable order.
    fn params(&self, _inputs: &[Shape]) -> Vec<ParamSpec> {
        Vec::new()
    }

    /// FLOPs over the whole batch, or `None` if the count overflows a `u64`. The graph builder
    /// refuses such a layer, so a built graph's layers always have a count.
    fn flops(&self, inputs: &[Shape], output: &Shape) -> Option<Flops>;

    /// Dims of the output this op may be partitioned along (OptCNN Table 1).
    fn parallel_dims(&self, output: &Shape) -> &'static [Dim];

    /// The rect of each input that the output tile `out` reads, clipped to the input's bounds.
    fn project(&self, inputs: &[Shape], out: &Rect) -> Vec<Rect> {
        let mut rects = Vec::with_capacity(inputs.len());
        self.project_into(inputs, out, &mut rects);
        rects
    }

    /// [`OpSpec::project`], appended to `rects`: the planner projects every tile of every layout
    /// it prices and reuses one buffer rather than allocating a `Vec` per tile.
    fn project_into(&self, inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>);

    /// The slice of parameter `param` (one of `params`) that computing tile `out` needs. Takes
    /// the parameter rather than its index so that callers looping over tiles list the
    /// parameters once, not once per tile.
    fn param_rect(&self, param: &ParamSpec, out: &Rect) -> Rect {
        param.shape.full_rect().with_channels_of(out)
    }

    /// The input channels the op sums over, where a tile may be computed as partial sums over
    /// blocks of them (a reduction split): axis 1 of input 0 and of parameter 0 (the weight), the
    /// other parameters (the bias) added once. `None` for every op but conv2d without groups and
    /// dense.
    fn reduction_channels(&self, _inputs: &[Shape]) -> Option<usize> {
        None
    }
}

/// What a reduction split's phases compute on top of a conv2d or dense kernel: the partial
/// phases call the op's own kernel on the channel block as if it were all the input channels
/// (views rebased to channel 0, an op without activation and, past the first partial, without
/// bias), so every backend computes partials with the kernels it has.
pub(crate) trait ReductionKernels: OpKernels + Clone {
    /// This op over `channels` input channels, without activation, with a bias iff `bias`.
    fn partial_op(&self, bias: bool) -> Self;
    fn activation(&self) -> Activation;

    /// Runs `phase`: the op's forward and backward, or a reduction split's, whose partials
    /// `partial_forward` and `partial_backward` compute with the op's kernels (given the rebased
    /// op, input shape, input and weight, and the bias and output or the gradients).
    fn run_with_reductions<B: Backend>(
        &self,
        phase: Phase,
        c: &mut KernelCall<B>,
        partial_forward: impl FnOnce(
            &mut KernelCall<B>,
            &Self,
            Shape,
            In<B::Buffer>,
            In<B::Buffer>,
            Option<In<B::Buffer>>,
            Out<B::Buffer>,
        ),
        partial_backward: impl FnOnce(
            &mut KernelCall<B>,
            &Self,
            Shape,
            In<B::Buffer>,
            In<B::Buffer>,
            PartialGrads<B::Buffer>,
        ),
    ) -> Result<(), KernelError> {
        match phase {
            Phase::PartialForward => {
                let (x, w) = (c.read(Role::Input(0)), c.read(Role::Param(0)));
                let op = self.partial_op(c.has(Role::Param(1)));
                let (in_shape, x, w) = rebase(c.input_shape(0), x, w);
                let (b, y) = (c.try_read(Role::Param(1)), c.write(Role::Output));
                partial_forward(c, &op, in_shape, x, w, b, y);
            }
            Phase::PartialBackward => {
                let (x, w) = (c.read(Role::Input(0)), c.read(Role::Param(0)));
                let op = self.partial_op(c.has(Role::ParamGrad(1)));
                let c0 = w.rect.lo[1];
                let (in_shape, x, w) = rebase(c.input_shape(0), x, w);
                let grads = PartialGrads {
                    dp: c.read(Role::OutputGrad),
                    dw: rebase_out(c.write(Role::ParamGrad(0)), c0),
                    db: c.try_write(Role::ParamGrad(1)),
                    dx: c.try_write(Role::InputGrad(0)).map(|dx| rebase_out(dx, c0)),
                };
                partial_backward(c, &op, in_shape, x, w, grads);
            }
            Phase::Finish => {
                let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
                match self.activation() {
                    Activation::None => c.backend.copy(c.stream, x, y),
                    Activation::Relu => c.backend.relu_forward(c.stream, x, y),
                }
            }
            Phase::FinishBackward => {
                let (y, dy) = (c.read(Role::Output), c.read(Role::OutputGrad));
                let dp = c.write(Role::InputGrad(0));
                match self.activation() {
                    Activation::None => c.backend.copy(c.stream, dy, dp),
                    Activation::Relu => c.backend.relu_backward(c.stream, y, dy, dp),
                }
            }
            Phase::Forward | Phase::Infer => return self.forward(c),
            Phase::Backward => return self.backward(c),
            other => panic!("a {} has no {other} phase", std::any::type_name::<Self>()),
        }
        Ok(())
    }
}

/// A partial's input (channels `[c0, c0 + k)` of axis 1) and weight (the same channels of its
/// axis 1), rebased to channels `[0, k)`: the same memory, seen as all the input channels of an
/// op over `k` of them (`in_shape` cut to `k`).
fn rebase<'a, M>(in_shape: Shape, x: In<'a, M>, w: In<'a, M>) -> (Shape, In<'a, M>, In<'a, M>) {
    let c0 = w.rect.lo[1];
    let k = w.rect.extent(1);
    let mut dims = in_shape.dims().to_vec();
    dims[1] = k;
    let shift = |rect: Rect| rect.with_axis(1, rect.lo[1] - c0, rect.hi[1] - c0);
    (
        Shape::new(&dims),
        In {
            rect: shift(x.rect),
            mem: x.mem,
        },
        In {
            rect: w.rect.with_axis(1, 0, k),
            mem: w.mem,
        },
    )
}

/// A partial's backward operands: the gradient before the activation, and its weight (rebased),
/// bias (first partial only) and input (rebased, where needed) gradients.
pub(crate) struct PartialGrads<'a, M> {
    pub dp: In<'a, M>,
    pub dw: Out<'a, M>,
    pub db: Option<Out<'a, M>>,
    pub dx: Option<Out<'a, M>>,
}

/// `rect` (an input gradient or weight gradient of a partial) rebased like [`rebase`] rebases the
/// views of channels starting at `c0`.
fn rebase_out<M>(out: Out<'_, M>, c0: usize) -> Out<'_, M> {
    let rect = out
        .rect
        .with_axis(1, out.rect.lo[1] - c0, out.rect.hi[1] - c0);
    Out { rect, mem: out.mem }
}

/// The input rects partial `r` of `red` of tile `out` reads: the projection, input 0's channels
/// cut to block `r` (see [`OpSpec::reduction_channels`]).
pub fn project_partial(
    spec: &dyn OpSpec,
    inputs: &[Shape],
    out: &Rect,
    r: usize,
    red: usize,
) -> Vec<Rect> {
    let mut rects = spec.project(inputs, out);
    if red > 1 {
        let (lo, hi) = crate::partition::reduction_range(inputs[0].dim(1), red, r);
        rects[0] = rects[0].with_axis(1, lo, hi);
    }
    rects
}

/// The input shapes partial `r` of `red` computes over: its block of the first input's channels
/// (the shapes a reduction split's partial is priced and profiled with).
pub fn partial_input_shapes(inputs: &[Shape], r: usize, red: usize) -> Vec<Shape> {
    let mut out = inputs.to_vec();
    if red > 1 {
        let (lo, hi) = crate::partition::reduction_range(inputs[0].dim(1), red, r);
        let mut dims = inputs[0].dims().to_vec();
        dims[1] = hi - lo;
        out[0] = Shape::new(&dims);
    }
    out
}

/// The slice of parameter `index` partial `r` of `red` of tile `out` reads: the weight's input
/// channels cut to block `r`; the other parameters (the bias, added once) by partial 0 only.
pub fn partial_param_rect(
    spec: &dyn OpSpec,
    index: usize,
    param: &ParamSpec,
    out: &Rect,
    r: usize,
    red: usize,
) -> Option<Rect> {
    let rect = spec.param_rect(param, out);
    match (red, index, r) {
        (1, _, _) => Some(rect),
        (_, 0, _) => {
            let (lo, hi) = crate::partition::reduction_range(param.shape.dim(1), red, r);
            Some(rect.with_axis(1, lo, hi))
        }
        (_, _, 0) => Some(rect),
        _ => None,
    }
}

/// Which operands an op's backward phase reads besides its parameters. The runtime lends a
/// backward task exactly these, so that it fetches no region the kernel does not touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardReads {
    /// The input activations (the op's projection of the tile).
    pub inputs: bool,
    /// The layer's own output (post-activation).
    pub output: bool,
    /// The gradient w.r.t. the output.
    pub output_grad: bool,
}

impl BackwardReads {
    pub const OUTPUT_GRAD_ONLY: BackwardReads = BackwardReads {
        inputs: false,
        output: false,
        output_grad: true,
    };
    pub const INPUTS: BackwardReads = BackwardReads {
        inputs: true,
        ..BackwardReads::OUTPUT_GRAD_ONLY
    };
    pub const OUTPUT: BackwardReads = BackwardReads {
        output: true,
        ..BackwardReads::OUTPUT_GRAD_ONLY
    };
    pub const INPUTS_AND_OUTPUT: BackwardReads = BackwardReads {
        inputs: true,
        output: true,
        output_grad: true,
    };
}

/// How an op's phases run on any [`Backend`]: the operands each phase takes from its
/// [`KernelCall`] by role, and the backend primitive it hands them to. Drivers (the reference
/// trainer, the runtime's executor) reach this through [`Op::run`] and never match on ops.
pub trait OpKernels {
    /// What [`backward`](Self::backward) reads (the output gradient is read if present).
    fn backward_reads(&self) -> BackwardReads;

    fn forward<B: Backend>(&self, call: &mut KernelCall<B>) -> Result<(), KernelError>;

    /// Writes the parameter gradients and the gradient of each input the call lends
    /// (`Role::InputGrad(k)`); an input without one needs none.
    fn backward<B: Backend>(&self, call: &mut KernelCall<B>) -> Result<(), KernelError>;

    /// Runs `phase`; ops with phases beyond forward and backward (batch norm) override this.
    fn run<B: Backend>(&self, phase: Phase, call: &mut KernelCall<B>) -> Result<(), KernelError> {
        match phase {
            Phase::Forward | Phase::Infer => self.forward(call),
            Phase::Backward => self.backward(call),
            other => panic!("this op has no {other} phase"),
        }
    }
}

/// The parallelizable dims of an element-wise op over a tensor of this rank.
pub(crate) fn elementwise_dims(shape: &Shape) -> &'static [Dim] {
    match shape.ndim() {
        4 => &[Dim::N, Dim::C, Dim::H, Dim::W],
        2 => &[Dim::N, Dim::C],
        _ => &[Dim::N],
    }
}

impl Rect {
    /// A per-output-channel parameter's slice for an output tile: rows `out.c` along axis 0.
    pub(crate) fn with_channels_of(&self, out: &Rect) -> Rect {
        self.with_axis(0, out.lo[1], out.hi[1])
    }
}

/// [`Op`] and its dispatch, from one list: each entry is the variant (named as its type) and its
/// name in JSON and error messages, which serde's snake_case spelling of the variant matches
/// (`every_op_serializes_under_its_kind` holds them equal). The element-wise unary family is one
/// variant, last: its JSON names are the family's (`{"op": "tanh"}`).
macro_rules! ops {
    ($($variant:ident = $kind:literal,)*) => {
        /// Every op, as stored in a graph and in model JSON files (`"op": "conv2d"` plus its
        /// attributes).
        #[derive(Clone, Debug, PartialEq)]
        pub enum Op {
            $($variant($variant),)*
            /// An element-wise unary op of the [`Unary`] family.
            Unary(UnaryOp),
        }

        /// The JSON of every op but the unary family's, read.
        #[derive(Deserialize)]
        #[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
        enum Tagged {
            $($variant($variant),)*
        }

        /// The JSON of every op but the unary family's, written.
        #[derive(Serialize)]
        #[serde(tag = "op", rename_all = "snake_case")]
        enum TaggedRef<'a> {
            $($variant(&'a $variant),)*
        }

        impl Serialize for Op {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                match self {
                    $(Op::$variant(o) => TaggedRef::$variant(o).serialize(serializer),)*
                    Op::Unary(o) => o.serialize(serializer),
                }
            }
        }

        /// By the `"op"` name: the unary family's as a [`UnaryOp`], the others as their own
        /// attributes, each error naming the field serde found wrong; an unknown name is refused
        /// with every op's, the unary family's included.
        impl<'de> Deserialize<'de> for Op {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Op, D::Error> {
                use serde::de::Error;
                let value = serde_json::Value::deserialize(deserializer)?;
                if let Some(kind) = value.get("op").and_then(|kind| kind.as_str()) {
                    if Unary::parse(kind).is_some() {
                        return UnaryOp::deserialize(value)
                            .map(Op::Unary)
                            .map_err(D::Error::custom);
                    }
                    if !Op::kinds().any(|k| k == kind) {
                        let kinds: Vec<String> = Op::kinds().map(|k| format!("`{k}`")).collect();
                        return Err(D::Error::custom(format!(
                            "unknown op `{kind}`, expected one of {}",
                            kinds.join(", ")
                        )));
                    }
                }
                Ok(match Tagged::deserialize(value).map_err(D::Error::custom)? {
                    $(Tagged::$variant(o) => Op::$variant(o),)*
                })
            }
        }

        impl Op {
            /// The name of every op in JSON, the unary family's included, in the list's order.
            pub fn kinds() -> impl Iterator<Item = &'static str> {
                [$($kind),*].into_iter().chain(Unary::ALL.iter().map(|u| u.name()))
            }

            /// The op's name as written in JSON and error messages.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Op::$variant(_) => $kind,)*
                    Op::Unary(u) => u.op.name(),
                }
            }

            pub fn spec(&self) -> &dyn OpSpec {
                match self {
                    $(Op::$variant(o) => o,)*
                    Op::Unary(o) => o,
                }
            }

            /// Runs one phase of this op (see [`crate::backend`]). The optimizer update is the
            /// same for every op's parameters and runs here.
            pub fn run<B: Backend>(
                &self,
                phase: Phase,
                call: &mut KernelCall<B>,
            ) -> Result<(), KernelError> {
                if let Phase::Update { param } = phase {
                    let grad = call.read(Role::ParamGrad(param));
                    let velocity = call.write(Role::Velocity(param));
                    let w = call.write(Role::Param(param));
                    call.backend
                        .sgd_update(call.stream, &call.step.sgd, grad, w, velocity);
                    return Ok(());
                }
                match self {
                    $(Op::$variant(o) => o.run(phase, call),)*
                    Op::Unary(o) => o.run(phase, call),
                }
            }

            /// What this op's backward phase reads besides its parameters.
            pub fn backward_reads(&self) -> BackwardReads {
                match self {
                    $(Op::$variant(o) => o.backward_reads(),)*
                    Op::Unary(o) => o.backward_reads(),
                }
            }
        }
    };
}

ops! {
    Input = "input",
    Conv2d = "conv2d",
    Pool2d = "pool2d",
    AdaptiveAvgPool2d = "adaptive_avg_pool2d",
    Dense = "dense",
    Relu = "relu",
    Flatten = "flatten",
    Concat = "concat",
    Add = "add",
    Mul = "mul",
    BatchNorm = "batch_norm",
    Dropout = "dropout",
    SoftmaxCrossEntropy = "softmax_cross_entropy",
}

impl Op {
    /// An element-wise unary op.
    pub fn unary(op: Unary) -> Op {
        Op::Unary(op.into())
    }

    /// How many inputs the op takes (`None`: two or more).
    pub fn arity(&self) -> Option<usize> {
        match self {
            Op::Input(_) => Some(0),
            Op::Concat(_) => None,
            Op::Add(_) | Op::Mul(_) => Some(2),
            _ => Some(1),
        }
    }
}

/// The output extent of a sliding window (convolution or pooling) over `size` positions padded by
/// `pad` each side, rounded down or, with `ceil`, up; `None` where no window fits.
pub(crate) fn window_out(
    size: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil: bool,
) -> Option<usize> {
    if kernel == 0 || stride == 0 {
        return None;
    }
    let span = size.checked_add(pad.checked_mul(2)?)?.checked_sub(kernel)?;
    if !ceil {
        return Some(span / stride + 1);
    }
    let steps = span.div_ceil(stride);
    // a last window starting in the right padding is dropped, as PyTorch does
    let steps = if steps * stride >= size + pad {
        steps - 1
    } else {
        steps
    };
    Some(steps + 1)
}

/// Input rows `[lo, hi)` read by output rows `[o0, o1)` of a sliding window, clipped to `[0, size)`.
pub(crate) fn window_in(
    o0: usize,
    o1: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    size: usize,
) -> (usize, usize) {
    if o1 <= o0 {
        return (0, 0);
    }
    let lo = (o0 * stride).saturating_sub(pad);
    let hi = ((o1 - 1) * stride + kernel).saturating_sub(pad).min(size);
    (lo.min(hi), hi)
}

pub(crate) fn expect_rank(inputs: &[Shape], rank: usize, what: &str) -> Result<Shape, String> {
    let s = inputs[0];
    if s.ndim() != rank {
        return Err(format!(
            "input has {} dims, expected {rank} ({what})",
            s.ndim()
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_serializes_under_its_kind_and_reads_back() {
        let mut ops: Vec<Op> = [
            "alexnet",
            "inception_v3",
            "resnet50",
            "lenet5",
            "efficientnet_b0",
        ]
        .into_iter()
        .flat_map(|name| {
            let z = crate::zoo::find(name).unwrap();
            let g = z.build(&z.default_config(2)).unwrap();
            g.layers().iter().map(|l| l.op.clone()).collect::<Vec<_>>()
        })
        .collect();
        ops.extend(Unary::ALL.iter().map(|&u| Op::unary(u)));
        ops.push(Op::AdaptiveAvgPool2d(AdaptiveAvgPool2d { output: [6, 6] }));
        let mut kinds = std::collections::BTreeSet::new();
        for op in &ops {
            let json = serde_json::to_value(op).unwrap();
            assert_eq!(json["op"], op.kind(), "{json}");
            assert_eq!(&serde_json::from_value::<Op>(json).unwrap(), op);
            kinds.insert(op.kind());
        }
        let every: std::collections::BTreeSet<_> = Op::kinds().collect();
        assert_eq!(
            kinds, every,
            "the zoo, the unary family and the list hold every op"
        );
    }
}
