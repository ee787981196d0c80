//! `LEGION_REQUIRE`: which of a test's needs are required here, so that a missing one fails the
//! test instead of skipping it.
//!
//! Some tests need what a machine may lack: a GPU, an ssh server, network namespaces, NVRTC, a
//! C++ compiler, a Slurm the test can start, onnxruntime, a Python to build and test the wheel in,
//! torch. Where it is missing they skip with a
//! printed reason ([`skip`]), so that the suite passes on any machine. A machine that is meant to
//! have them says so, and there a skip fails: `LEGION_REQUIRE=gpu,nvrtc,cxx` on the lent GPU
//! machine (`integration/gpu-check.sh`), and in CI what `.ci/run` installed or found
//! (`ssh,netns,slurm` as root, `nvrtc`, `cxx`, `onnxruntime`, `python`, `torch`).

use std::fmt;

/// The name of the switch: a comma-separated list of [`Need`] names.
pub const VARIABLE: &str = "LEGION_REQUIRE";

/// What a test may need that a machine may lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A usable NVIDIA GPU with its driver and libraries.
    Gpu,
    /// An ssh server the test can start (`sshd`).
    Ssh,
    /// Network namespaces, veth pairs and `tc` (root and iproute2).
    Netns,
    /// NVRTC, the CUDA runtime compiler (no GPU needed).
    Nvrtc,
    /// A C++ compiler, for the host emulation of the CUDA kernels.
    Cxx,
    /// A one-host Slurm the test starts itself (slurmctld, slurmd, munge; root).
    Slurm,
    /// Python with onnxruntime, to run exported ONNX files (`LEGION_ONNXRUNTIME_PATH` may name
    /// the folder it was installed into).
    Onnxruntime,
    /// maturin and a Python with venv and pip, to build the `legion_rs` wheel and run its pytest
    /// tests in a fresh virtual environment (`LEGION_WHEELHOUSE` may hold the wheels they install).
    Python,
    /// torch (and torchvision) for the Python package's tests against PyTorch (`LEGION_TORCH_PATH`
    /// may name the folder it was installed into).
    Torch,
}

impl Need {
    pub const ALL: [Need; 9] = [
        Need::Gpu,
        Need::Ssh,
        Need::Netns,
        Need::Nvrtc,
        Need::Cxx,
        Need::Slurm,
        Need::Onnxruntime,
        Need::Python,
        Need::Torch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Need::Gpu => "gpu",
            Need::Ssh => "ssh",
            Need::Netns => "netns",
            Need::Nvrtc => "nvrtc",
            Need::Cxx => "cxx",
            Need::Slurm => "slurm",
            Need::Onnxruntime => "onnxruntime",
            Need::Python => "python",
            Need::Torch => "torch",
        }
    }
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The needs a value of [`VARIABLE`] lists (empty names, as in `"ssh,"`, are ignored). An unknown
/// name is an error: a misspelt requirement must not quietly turn a failure back into a skip.
pub fn parse(value: &str) -> Result<Vec<Need>, String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            Need::ALL
                .into_iter()
                .find(|need| need.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = Need::ALL.iter().map(|n| n.name()).collect();
                    format!(
                        "{VARIABLE}: unknown need {name:?}; expected some of {}",
                        known.join(", ")
                    )
                })
        })
        .collect()
}

/// Whether this process's [`VARIABLE`] requires `need`. Panics on a value [`parse`] refuses.
pub fn required(need: Need) -> bool {
    match std::env::var(VARIABLE) {
        Ok(value) => parse(&value)
            .unwrap_or_else(|e| panic!("{e}"))
            .contains(&need),
        Err(_) => false,
    }
}

/// Skips the calling test, printing `skipped: <reason>`; where [`VARIABLE`] requires `need`,
/// fails it instead. The caller returns after it.
pub fn skip(need: Need, reason: impl fmt::Display) {
    if required(need) {
        panic!("{VARIABLE} requires {need} here, but: {reason}");
    }
    println!("skipped: {reason}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_lists_needs_by_name_and_refuses_unknown_ones() {
        assert_eq!(parse(""), Ok(vec![]));
        assert_eq!(
            parse("ssh, netns,nvrtc,"),
            Ok(vec![Need::Ssh, Need::Netns, Need::Nvrtc])
        );
        assert_eq!(parse("gpu,cxx"), Ok(vec![Need::Gpu, Need::Cxx]));
        let e = parse("gpu,sshd").unwrap_err();
        assert!(
            e.contains("\"sshd\"")
                && e.contains("gpu, ssh, netns, nvrtc, cxx, slurm, onnxruntime, python, torch"),
            "{e}"
        );
        for need in Need::ALL {
            assert_eq!(parse(need.name()), Ok(vec![need]));
        }
    }
}
