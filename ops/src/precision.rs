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
//!   - checkpoints hold the fp32 master weights, as in the other precisions, so a bf16 run resumes
//!     from an fp32 one and back.
//!
//! [`Precision::activation_bytes`] and [`Precision::weight_bytes`] are the element sizes the
//! planner prices transfers, synchronisation and memory with.

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
    fn device_kinds_carry_the_precision() {
        assert_eq!(Precision::Fp32.device_kind("h100"), "h100");
        assert_eq!(Precision::Tf32.device_kind("h100"), "h100-tf32");
        assert_eq!(Precision::Bf16.device_kind("h200"), "h200-bf16");
    }
}
