//! The arithmetic a training run computes in: `fp32`, `tf32` or `bf16` (`--precision`, the hosts
//! file's `precision` key), and what each stores per element.
//!
//! - **fp32**: everything in IEEE single precision, products and convolutions included (strict
//!   FP32: no tensor cores). The CPU backend computes only this.
//! - **tf32**: as fp32, but a GPU's products and convolutions may run on TF32 tensor cores (inputs
//!   rounded to a 10-bit mantissa, fp32 accumulation). Every tensor is still stored in fp32.
//! - **bf16** (mixed precision, as PyTorch's autocast runs it):
//!   - convolutions and matrix products (conv2d, dense) take bf16 inputs and weights on the
//!     tensor cores and accumulate in fp32;
//!   - activations and their gradients are stored in bf16 (2 bytes), so the slices of them that
//!     move between devices are half the fp32 size;
//!   - the master weights, their momentum, the weight gradients that are summed across replicas,
//!     the update, batch norm's statistics (and its scale and shift) and the loss stay fp32; each
//!     conv2d or dense parameter slice a kernel reads has a bf16 working copy cast from its fp32
//!     master;
//!   - a GPU keeps the working copies of the weights the products read (conv2d's and dense's
//!     `Param(0)`, [`Precision::working_copy`]); their biases are added in fp32 from the master by
//!     the product's epilogue, so they need none;
//!   - checkpoints hold the fp32 master weights, as in the other precisions, so a bf16 run resumes
//!     from an fp32 one and back.
//!
//! [`Precision::activation_bytes`] and [`Precision::weight_bytes`] are the element sizes the
//! planner prices transfers, synchronisation and memory with.

use crate::op::Op;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The arithmetic of a training run (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE single precision throughout (strict FP32).
    #[default]
    Fp32,
    /// fp32 storage; a GPU's products and convolutions on TF32 tensor cores.
    Tf32,
    /// bf16 activations and products with fp32 accumulation, fp32 master weights and update.
    Bf16,
}

impl Precision {
    /// Every precision, in the order the flag's help lists them.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Tf32, Precision::Bf16];

    /// The name the flag, hosts files and profiles use (`fp32`, `tf32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }

    /// Bytes of one element of an activation or of an activation's gradient (and of a reduction
    /// split's partial sums): 2 in bf16, 4 otherwise.
    pub fn activation_bytes(self) -> u64 {
        match self {
            Precision::Fp32 | Precision::Tf32 => 4,
            Precision::Bf16 => 2,
        }
    }

    /// Bytes of one element of a master weight, its gradient as replicas sum it, and its
    /// momentum: 4 in every precision.
    pub fn weight_bytes(self) -> u64 {
        4
    }

    /// Bytes of the working copy a GPU casts each conv2d or dense parameter slice into before its
    /// products read it: `Some(2)` in bf16; `None` where the kernels read the fp32 master itself.
    pub fn weight_copy_bytes(self) -> Option<u64> {
        match self {
            Precision::Fp32 | Precision::Tf32 => None,
            Precision::Bf16 => Some(2),
        }
    }

    /// Whether parameter `index` of `op` is read by the products through a working copy in this
    /// precision: in bf16, the weights of conv2d and dense (their `Param(0)`), which the tensor
    /// cores read in bf16; nothing in fp32 and tf32, whose kernels read the masters.
    pub fn working_copy(self, op: &Op, index: usize) -> bool {
        self.weight_copy_bytes().is_some()
            && index == 0
            && matches!(op, Op::Conv2d(_) | Op::Dense(_))
    }

    /// The suffix of the device kind a profile measured in this precision is stored under
    /// (`h100-bf16`, `h100-tf32`); none for fp32, whose kind is the device's own (`h100`).
    pub fn kind_suffix(self) -> Option<&'static str> {
        match self {
            Precision::Fp32 => None,
            Precision::Tf32 => Some("-tf32"),
            Precision::Bf16 => Some("-bf16"),
        }
    }

    /// The device kind `kind` computing in this precision (`h100` → `h100-bf16`).
    pub fn device_kind(self, kind: &str) -> String {
        match self.kind_suffix() {
            Some(suffix) => format!("{kind}{suffix}"),
            None => kind.to_string(),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A precision name that is none of `fp32`, `tf32`, `bf16`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision '{given}': expected one of fp32, tf32, bf16")]
pub struct UnknownPrecision {
    pub given: String,
}

impl FromStr for Precision {
    type Err = UnknownPrecision;

    /// `fp32`, `tf32` or `bf16`, in any case; anything else (`fp16`, `float32`) is refused naming
    /// the three.
    fn from_str(s: &str) -> Result<Precision, UnknownPrecision> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownPrecision {
                given: s.to_string(),
            })
    }
}

/// `x` rounded to the nearest bf16 (ties to even) and back to f32: what storing an f32 in bf16
/// keeps. NaN stays a (quiet) NaN; values past the largest bf16 round to infinity. The host's
/// statement of the GPU's cast, for tolerances and references.
pub fn round_bf16(x: f32) -> f32 {
    bf16_value(bf16_bits(x))
}

/// The bf16 bits of `x`, rounded to nearest even: the upper half of the f32 after adding half an
/// ulp of bf16 (less one when the kept half is even, so that a tie rounds to the even one). A NaN
/// keeps its sign and upper payload with the quiet bit set, so that it cannot become infinity.
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// The f32 that bf16 bits `b` stand for (exact: every bf16 is an f32).
pub fn bf16_value(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// The largest relative error of one value stored in bf16 (8 significant bits, rounded to
/// nearest): half an ulp, 2^-8 of the value's magnitude (normal values).
pub const BF16_RELATIVE_ROUNDING: f32 = 1.0 / 256.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for p in Precision::ALL {
            assert_eq!(p.to_string().parse::<Precision>(), Ok(p));
        }
        assert_eq!("BF16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!(Precision::default(), Precision::Fp32);
    }

    #[test]
    fn unknown_names_are_refused_naming_the_allowed_ones() {
        for bad in ["fp16", "float32", "", "bf 16"] {
            let e = bad.parse::<Precision>().unwrap_err().to_string();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
            assert!(e.contains("fp32, tf32, bf16"), "{e}");
        }
    }

    #[test]
    fn serde_is_lowercase() {
        assert_eq!(serde_json::to_string(&Precision::Bf16).unwrap(), "\"bf16\"");
        let p: Precision = serde_json::from_str("\"tf32\"").unwrap();
        assert_eq!(p, Precision::Tf32);
        assert!(serde_json::from_str::<Precision>("\"fp16\"").is_err());
    }

    #[test]
    fn only_activations_shrink_in_bf16() {
        let sizes = |p: Precision| {
            (
                p.activation_bytes(),
                p.weight_bytes(),
                p.weight_copy_bytes(),
            )
        };
        assert_eq!(sizes(Precision::Fp32), (4, 4, None));
        assert_eq!(sizes(Precision::Tf32), (4, 4, None));
        assert_eq!(sizes(Precision::Bf16), (2, 4, Some(2)));
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan_and_infinity() {
        // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: even (1) wins; 1 + 3·2^-8 goes up.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1e-6), 1.0 + 2.0 / 256.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert!(round_bf16(f32::NAN).is_nan());
        // a signalling NaN whose payload lies in the dropped half stays NaN, quiet
        let signalling = f32::from_bits(0x7f80_0001);
        assert!(signalling.is_nan() && round_bf16(signalling).is_nan());
        assert_eq!(bf16_bits(signalling) & 0x0040, 0x0040);
        // the relative error is within half an ulp
        let mut x = 1.0e-30f32;
        while x < 1.0e30 {
            let r = round_bf16(x);
            assert!((r - x).abs() <= BF16_RELATIVE_ROUNDING * x, "{x}: {r}");
            x *= 1.37;
        }
    }

    #[test]
    fn only_the_products_weights_have_working_copies_and_only_in_bf16() {
        use crate::op::{Conv2d, Dense, Pool2d};
        let conv = Op::Conv2d(Conv2d::new(4, 3));
        let dense = Op::Dense(Dense::new(10));
        let pool = Op::Pool2d(Pool2d::max(2));
        assert!(Precision::Bf16.working_copy(&conv, 0));
        assert!(Precision::Bf16.working_copy(&dense, 0));
        assert!(!Precision::Bf16.working_copy(&conv, 1));
        assert!(!Precision::Bf16.working_copy(&pool, 0));
        for p in [Precision::Fp32, Precision::Tf32] {
            assert!(!p.working_copy(&conv, 0) && !p.working_copy(&dense, 0));
        }
    }

    #[test]
    fn device_kinds_carry_the_precision() {
        assert_eq!(Precision::Fp32.device_kind("h100"), "h100");
        assert_eq!(Precision::Tf32.device_kind("h100"), "h100-tf32");
        assert_eq!(Precision::Bf16.device_kind("h200"), "h200-bf16");
    }
}
