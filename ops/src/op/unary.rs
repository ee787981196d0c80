//! The element-wise unary ops, one family: each is a line of [`unary_ops!`] giving its name (in
//! model JSON and error messages), its ONNX op where one ONNX node is it, what its gradient reads
//! (the input x or the output y), its scalar attribute `alpha` where it has one (LeakyReLU's
//! slope), its forward as a function of x and alpha, its gradient as a function of that read
//! value r, the output gradient g and alpha, and its FLOPs per element each way. The CPU kernels
//! run these closures (`crate::kernels::unary`); the CUDA kernels are the same formulas, in
//! `kernels.cu`'s `UNARY_OPS` list.

use super::{BackwardReads, Flops, OpKernels, OpSpec, elementwise_dims};
use crate::backend::{Backend, KernelCall, KernelError, Role};
use crate::kernels::{View, ViewMut, unary};
use crate::shape::{Dim, Rect, Shape};
use serde::{Deserialize, Serialize};

/// What an element-wise op's gradient is computed from, beside the output gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradFrom {
    /// The op's input x.
    Input,
    /// The op's output y (cheaper where the derivative is a function of y).
    Output,
}

macro_rules! unary_ops {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal, onnx $onnx:expr, grad from $from:ident,
        alpha $alpha:expr,
        forward |$x:ident, $xa:pat_param| $forward:expr,
        backward |$r:ident, $g:ident, $ga:pat_param| $backward:expr,
        flops ($flops_forward:literal, $flops_backward:literal);
    )*) => {
        /// An element-wise unary op.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum Unary {
            $($(#[$doc])* #[serde(rename = $name)] $variant,)*
        }

        impl Unary {
            /// Every one, in the order of the list.
            pub const ALL: &[Unary] = &[$(Unary::$variant),*];

            /// Its position in [`Unary::ALL`], which lists the ops in the order they are declared.
            pub fn index(self) -> usize {
                self as usize
            }

            /// The name in model JSON files, error messages and kernel names.
            pub fn name(self) -> &'static str {
                match self {
                    $(Unary::$variant => $name,)*
                }
            }

            /// The ONNX operator that is this op node for node, if one is: the others are a
            /// pattern of nodes (SiLU is `Sigmoid` then `Mul`, ReLU6 a `Clip` to [0, 6]), which
            /// the importer and exporter know.
            pub fn onnx_op(self) -> Option<&'static str> {
                match self {
                    $(Unary::$variant => $onnx,)*
                }
            }

            pub fn grad_from(self) -> GradFrom {
                match self {
                    $(Unary::$variant => GradFrom::$from,)*
                }
            }

            /// The default of its scalar attribute `alpha`, if it takes one.
            pub fn default_alpha(self) -> Option<f32> {
                match self {
                    $(Unary::$variant => $alpha,)*
                }
            }

            /// The names of its forward and backward kernels (`{name}_forward`, `{name}_backward`).
            pub fn kernel_names(self) -> (&'static str, &'static str) {
                match self {
                    $(Unary::$variant => (concat!($name, "_forward"), concat!($name, "_backward")),)*
                }
            }

            /// FLOPs per element, forward and backward.
            pub fn flops_per_element(self) -> (u64, u64) {
                match self {
                    $(Unary::$variant => ($flops_forward, $flops_backward),)*
                }
            }

            /// y = f(x) over the tile `y.rect`, on the CPU, with attribute `alpha` (0 for an op
            /// without one).
            fn forward_tile(self, alpha: f32, x: View<'_>, y: ViewMut<'_>) {
                match self {
                    $(Unary::$variant => {
                        let $xa = alpha;
                        unary::forward(x, y, |$x: f32| $forward)
                    })*
                }
            }

            /// dx = g · f′ over the tile `dx.rect`, on the CPU, from `read` (x or y, as
            /// [`grad_from`](Self::grad_from) says) and the output gradient `dy`.
            fn backward_tile(self, alpha: f32, read: View<'_>, dy: View<'_>, dx: ViewMut<'_>) {
                match self {
                    $(Unary::$variant => {
                        let $ga = alpha;
                        unary::backward(read, dy, dx, |$r: f32, $g: f32| $backward)
                    })*
                }
            }
        }
    };
}

unary_ops! {
    /// The logistic sigmoid, 1 / (1 + e^−x); f′ = y(1 − y). Forward: a negation, an exponential,
    /// an addition and a division; backward: three products.
    Sigmoid = "sigmoid", onnx Some("Sigmoid"), grad from Output, alpha None,
        forward |x, _| 1.0 / (1.0 + (-x).exp()),
        backward |y, g, _| g * y * (1.0 - y),
        flops (4, 3);
    /// The hyperbolic tangent; f′ = 1 − y². Forward: two exponentials, two additions and a
    /// division (as for sigmoid); backward: a square, a subtraction and a product.
    Tanh = "tanh", onnx Some("Tanh"), grad from Output, alpha None,
        forward |x, _| x.tanh(),
        backward |y, g, _| g * (1.0 - y * y),
        flops (5, 3);
    /// The hard swish of MobileNetV3, x · relu6(x + 3) / 6; f′ is 0 below −3, x/3 + 1/2 up to
    /// 3, 1 above (PyTorch's `hardswish`). Forward: an addition, a clamp, a product and a
    /// division; backward: two comparisons, a division, an addition and a product.
    Hardswish = "hardswish", onnx Some("HardSwish"), grad from Input, alpha None,
        forward |x, _| x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
        backward |x, g, _| if x < -3.0 { 0.0 } else if x <= 3.0 { g * (x / 3.0 + 0.5) } else { g },
        flops (5, 5);
    /// The hard sigmoid, relu6(x + 3) / 6; f′ is 1/6 strictly inside (−3, 3), else 0
    /// (PyTorch's `hardsigmoid`; ONNX's `HardSigmoid` with alpha 1/6 and beta 1/2). Forward: an
    /// addition, a clamp and a division; backward: two comparisons and a division.
    Hardsigmoid = "hardsigmoid", onnx None, grad from Input, alpha None,
        forward |x, _| (x + 3.0).clamp(0.0, 6.0) / 6.0,
        backward |x, g, _| if x > -3.0 && x < 3.0 { g / 6.0 } else { 0.0 },
        flops (3, 3);
    /// ReLU6 of MobileNetV2, min(max(x, 0), 6); f′ is 1 strictly inside (0, 6), else 0, which
    /// the output tells as well as the input (PyTorch's `hardtanh` backward). ONNX writes it as
    /// a `Clip` to [0, 6]. Forward: a clamp; backward: two comparisons.
    Relu6 = "relu6", onnx None, grad from Output, alpha None,
        forward |x, _| x.clamp(0.0, 6.0),
        backward |y, g, _| if y > 0.0 && y < 6.0 { g } else { 0.0 },
        flops (1, 2);
    /// SiLU (swish) of EfficientNet, x · σ(x); f′ = σ(x)(1 + x(1 − σ(x))). ONNX writes it as a
    /// `Sigmoid` whose output a `Mul` multiplies by its input. Forward: a sigmoid and a product;
    /// backward: a sigmoid, two subtractions or additions and three products.
    Silu = "silu", onnx None, grad from Input, alpha None,
        forward |x, _| x / (1.0 + (-x).exp()),
        backward |x, g, _| {
            let s = 1.0 / (1.0 + (-x).exp());
            g * s * (1.0 + x * (1.0 - s))
        },
        flops (5, 9);
    /// LeakyReLU, x above 0 and alpha · x below (`alpha` is PyTorch's `negative_slope`, 0.01 by
    /// default, and ONNX's `alpha`); f′ is 1 above 0, alpha at and below. Forward and
    /// backward: a comparison and a product.
    LeakyRelu = "leaky_relu", onnx Some("LeakyRelu"), grad from Input, alpha Some(0.01),
        forward |x, alpha| if x > 0.0 { x } else { alpha * x },
        backward |x, g, alpha| if x > 0.0 { g } else { alpha * g },
        flops (2, 2);
}

impl Unary {
    /// The op of this name (model JSON's `"op"`), if it is one of the family.
    pub fn parse(name: &str) -> Option<Unary> {
        Unary::ALL.iter().copied().find(|u| u.name() == name)
    }

    /// The op that is this ONNX operator node for node, if one of the family is.
    pub fn from_onnx(op_type: &str) -> Option<Unary> {
        Unary::ALL
            .iter()
            .copied()
            .find(|u| u.onnx_op() == Some(op_type))
    }
}

impl std::fmt::Display for Unary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An element-wise unary op as a layer: `{"op": "tanh"}` in model JSON, and
/// `{"op": "leaky_relu", "alpha": 0.2}` for an op with an attribute (its default when absent).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnaryOp {
    pub op: Unary,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f32>,
}

impl From<Unary> for UnaryOp {
    fn from(op: Unary) -> UnaryOp {
        UnaryOp { op, alpha: None }
    }
}

impl UnaryOp {
    /// `op` with its attribute set to `alpha`.
    pub fn with_alpha(op: Unary, alpha: f32) -> UnaryOp {
        UnaryOp {
            op,
            alpha: Some(alpha),
        }
    }

    /// The attribute the kernels use: the one given, else the op's default, else 0 (an op
    /// without one ignores it).
    pub fn alpha(&self) -> f32 {
        self.alpha.or(self.op.default_alpha()).unwrap_or(0.0)
    }

    /// y = f(x) over the tile `y.rect`, on the CPU.
    pub fn forward_tile(&self, x: View<'_>, y: ViewMut<'_>) {
        self.op.forward_tile(self.alpha(), x, y)
    }

    /// dx = g · f′ over the tile `dx.rect`, on the CPU, from `read` (x or y, as
    /// [`Unary::grad_from`] says) and the output gradient `dy`.
    pub fn backward_tile(&self, read: View<'_>, dy: View<'_>, dx: ViewMut<'_>) {
        self.op.backward_tile(self.alpha(), read, dy, dx)
    }
}

impl OpSpec for UnaryOp {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
        match (self.alpha, self.op.default_alpha()) {
            (Some(_), None) => {
                return Err(format!(
                    "{} takes no alpha; remove the field (only leaky_relu has one)",
                    self.op
                ));
            }
            (Some(a), Some(_)) if !a.is_finite() => {
                return Err(format!("alpha {a} must be a finite number"));
            }
            _ => {}
        }
        Ok(inputs[0])
    }

    fn flops(&self, _inputs: &[Shape], output: &Shape) -> Option<Flops> {
        let (forward, backward) = self.op.flops_per_element();
        Flops::per_element(output.numel(), forward, backward)
    }

    fn parallel_dims(&self, output: &Shape) -> &'static [Dim] {
        elementwise_dims(output)
    }

    fn project_into(&self, _inputs: &[Shape], out: &Rect, rects: &mut Vec<Rect>) {
        rects.push(*out);
    }
}

impl OpKernels for UnaryOp {
    fn backward_reads(&self) -> BackwardReads {
        match self.op.grad_from() {
            GradFrom::Input => BackwardReads::INPUTS,
            GradFrom::Output => BackwardReads::OUTPUT,
        }
    }

    fn forward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        let (x, y) = (c.read(Role::Input(0)), c.write(Role::Output));
        c.backend.unary_forward(c.stream, *self, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let read = match self.op.grad_from() {
                GradFrom::Input => c.read(Role::Input(0)),
                GradFrom::Output => c.read(Role::Output),
            };
            let dy = c.read(Role::OutputGrad);
            c.backend.unary_backward(c.stream, *self, read, dy, dx);
        }
        Ok(())
    }
}
