//! The element-wise unary ops, one family: each is a line of [`unary_ops!`] giving its name (in
//! model JSON and error messages), its ONNX op, what its gradient reads (the input x or the
//! output y), its forward as a function of x, its gradient as a function of that read value r and
//! the output gradient g, and its FLOPs per element each way. The CPU kernels run these closures
//! (`crate::kernels::unary`); the CUDA kernels are the same formulas, in `kernels.cu`'s
//! `UNARY_OPS` list.

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
        $variant:ident = $name:literal, onnx $onnx:literal, grad from $from:ident,
        forward |$x:ident| $forward:expr,
        backward |$r:ident, $g:ident| $backward:expr,
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

            /// The ONNX operator it imports from and exports to.
            pub fn onnx_op(self) -> &'static str {
                match self {
                    $(Unary::$variant => $onnx,)*
                }
            }

            pub fn grad_from(self) -> GradFrom {
                match self {
                    $(Unary::$variant => GradFrom::$from,)*
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

            /// y = f(x) over the tile `y.rect`, on the CPU.
            pub fn forward_tile(self, x: View<'_>, y: ViewMut<'_>) {
                match self {
                    $(Unary::$variant => unary::forward(x, y, |$x: f32| $forward),)*
                }
            }

            /// dx = g · f′ over the tile `dx.rect`, on the CPU, from `read` (x or y, as
            /// [`grad_from`](Self::grad_from) says) and the output gradient `dy`.
            pub fn backward_tile(self, read: View<'_>, dy: View<'_>, dx: ViewMut<'_>) {
                match self {
                    $(Unary::$variant => unary::backward(read, dy, dx, |$r: f32, $g: f32| $backward),)*
                }
            }
        }
    };
}

unary_ops! {
    /// The logistic sigmoid, 1 / (1 + e^−x); f′ = y(1 − y). Forward: a negation, an exponential,
    /// an addition and a division; backward: three products.
    Sigmoid = "sigmoid", onnx "Sigmoid", grad from Output,
        forward |x| 1.0 / (1.0 + (-x).exp()),
        backward |y, g| g * y * (1.0 - y),
        flops (4, 3);
    /// The hyperbolic tangent; f′ = 1 − y². Forward: two exponentials, two additions and a
    /// division (as for sigmoid); backward: a square, a subtraction and a product.
    Tanh = "tanh", onnx "Tanh", grad from Output,
        forward |x| x.tanh(),
        backward |y, g| g * (1.0 - y * y),
        flops (5, 3);
    /// The hard swish of MobileNetV3, x · relu6(x + 3) / 6; f′ is 0 below −3, x/3 + 1/2 up to
    /// 3, 1 above (PyTorch's `hardswish`). Forward: an addition, a clamp, a product and a
    /// division; backward: two comparisons, a division, an addition and a product.
    Hardswish = "hardswish", onnx "HardSwish", grad from Input,
        forward |x| x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
        backward |x, g| if x < -3.0 { 0.0 } else if x <= 3.0 { g * (x / 3.0 + 0.5) } else { g },
        flops (5, 5);
}

impl Unary {
    /// The op of this name (model JSON's `"op"`), if it is one of the family.
    pub fn parse(name: &str) -> Option<Unary> {
        Unary::ALL.iter().copied().find(|u| u.name() == name)
    }

    /// The op of this ONNX operator, if it is one of the family.
    pub fn from_onnx(op_type: &str) -> Option<Unary> {
        Unary::ALL.iter().copied().find(|u| u.onnx_op() == op_type)
    }
}

impl std::fmt::Display for Unary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An element-wise unary op as a layer: `{"op": "tanh"}` in model JSON, no attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnaryOp {
    pub op: Unary,
}

impl OpSpec for UnaryOp {
    fn infer_shape(&self, inputs: &[Shape]) -> Result<Shape, String> {
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
        c.backend.unary_forward(c.stream, self.op, x, y);
        Ok(())
    }

    fn backward<B: Backend>(&self, c: &mut KernelCall<B>) -> Result<(), KernelError> {
        if let Some(dx) = c.try_write(Role::InputGrad(0)) {
            let read = match self.op.grad_from() {
                GradFrom::Input => c.read(Role::Input(0)),
                GradFrom::Output => c.read(Role::Output),
            };
            let dy = c.read(Role::OutputGrad);
            c.backend.unary_backward(c.stream, self.op, read, dy, dx);
        }
        Ok(())
    }
}
