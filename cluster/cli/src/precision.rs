//! `--precision fp32|tf32|bf16` (and `--tf32`, its old spelling of `tf32`) as `train`, `profile`
//! and the examples take it; what a run does with it is `legion::precision`'s.

use legion::Precision;

/// `--precision` and `--tf32`.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct PrecisionArgs {
    /// The arithmetic: `fp32` (strict FP32), `tf32` (on a GPU, products and convolutions on TF32
    /// tensor cores: several times faster, ~1e-3 relative error per product), or `bf16` (mixed
    /// precision: products and convolutions in bf16 with fp32 accumulation, activations and
    /// their gradients stored in bf16, master weights, momentum, the update, batch-norm
    /// statistics and the loss in fp32; on GPUs, or on the CPU as a slower check of bf16's
    /// arithmetic) [default: fp32, or a cluster's hosts-file `precision`]
    #[arg(long, value_name = "fp32|tf32|bf16")]
    pub precision: Option<Precision>,
    /// The old spelling of `--precision tf32`.
    #[arg(long, conflicts_with = "precision")]
    pub tf32: bool,
}

impl PrecisionArgs {
    /// The precision the flags ask for, if any.
    pub fn given(&self) -> Option<Precision> {
        match self.tf32 {
            true => Some(Precision::Tf32),
            false => self.precision,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cmd {
        #[command(flatten)]
        p: PrecisionArgs,
    }

    fn parse(args: &[&str]) -> Result<Option<Precision>, String> {
        Cmd::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map(|c| c.p.given())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_flag_parses_and_tf32_is_its_old_spelling() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(parse(&["--precision", "bf16"]), Ok(Some(Precision::Bf16)));
        assert_eq!(parse(&["--precision=fp32"]), Ok(Some(Precision::Fp32)));
        assert_eq!(parse(&["--tf32"]), Ok(Some(Precision::Tf32)));
        let e = parse(&["--precision", "fp16"]).unwrap_err();
        assert!(
            e.contains("'fp16'") && e.contains("fp32, tf32, bf16"),
            "{e}"
        );
        let e = parse(&["--tf32", "--precision", "bf16"]).unwrap_err();
        assert!(e.contains("--tf32") && e.contains("--precision"), "{e}");
    }
}
