//! Which cuDNN algorithm runs each convolution.
//!
//! cuDNN's heuristic (its first answer to `cudnnGetConvolution*Algorithm_v7`) guesses from the
//! problem's shape. By default, each distinct problem (shapes, padding, stride, groups,
//! direction) is **timed** once on its stream: every candidate algorithm launched on the real
//! operands, once to warm and once between CUDA events, the fastest kept for every later call
//! (what PyTorch's `cudnn.benchmark` does). Timing blocks the submitting thread once per problem,
//! never per step. `LEGION_CUDNN_ALGOS=heuristic` keeps cuDNN's heuristic. On the lent H200, with
//! fewer candidates than now (no FFT or Winograd in strict FP32), the timed choice was slower than
//! the heuristic's on AlexNet (BENCHMARKS.md, GPU); the current candidates are not measured yet.
//!
//! Candidates keep the backend's promises:
//! - **deterministic**: no backward algorithm that sums with atomics (data algorithm 0, filter
//!   algorithms 0 and 3), so an algorithm gives the same bits every time it runs. Which candidate
//!   wins the timing can differ from one process to the next (as with PyTorch's
//!   `cudnn.benchmark`), and so can the last bits of the sums: runs that must repeat bit for bit
//!   (a run against its `--resume`) use `LEGION_CUDNN_ALGOS=heuristic`;
//! - **the stream's math**: the convolution descriptor's math type (FMA math for
//!   [`crate::Math::StrictFp32`]) holds for every candidate, so no TF32 unless asked for. FFT and
//!   Winograd algorithms compete in both modes: they compute in FP32, rounding differently from a
//!   direct sum, which is the kind of difference the equivalence tests allow (on the lent H200
//!   the heuristic's picks, these included, trained every strategy as the CPU does);
//! - a workspace of at most [`WORKSPACE_CAP`] bytes while timing (the heuristic's own choice is
//!   used whatever its workspace).

use crate::backend::{Failure, Stream};
use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t as DataAlgo, cudnnConvolutionBwdFilterAlgo_t as FilterAlgo,
    cudnnConvolutionFwdAlgo_t as ForwardAlgo,
};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUevent_flags;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;

/// How the backend picks convolution algorithms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AlgorithmChoice {
    /// Each problem's candidates timed once on the stream, the fastest kept (the default).
    #[default]
    Timed,
    /// cuDNN's heuristic, with atomic backward algorithms replaced by deterministic ones.
    Heuristic,
}

impl AlgorithmChoice {
    /// The environment variable that overrides the default.
    pub const VARIABLE: &'static str = "LEGION_CUDNN_ALGOS";

    /// From `LEGION_CUDNN_ALGOS` (`timed` or `heuristic`; unset: timed).
    pub fn from_env() -> Result<AlgorithmChoice, String> {
        match std::env::var(Self::VARIABLE) {
            Err(_) => Ok(AlgorithmChoice::default()),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for AlgorithmChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "timed" => Ok(AlgorithmChoice::Timed),
            "heuristic" => Ok(AlgorithmChoice::Heuristic),
            other => Err(format!(
                "{}={other:?}: expected \"timed\" or \"heuristic\"",
                AlgorithmChoice::VARIABLE
            )),
        }
    }
}

impl std::fmt::Display for AlgorithmChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AlgorithmChoice::Timed => "timed",
            AlgorithmChoice::Heuristic => "heuristic",
        })
    }
}

/// The most workspace a candidate may ask for while timing (1 GiB).
pub(crate) const WORKSPACE_CAP: usize = 1 << 30;

/// One convolution problem as cuDNN sees it (the stream's math is fixed, so not part of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Problem {
    pub x: [c_int; 4],
    pub w: [c_int; 4],
    pub y: [c_int; 4],
    pub pad: [i64; 2],
    pub stride: [i64; 2],
    pub groups: i64,
}

/// The algorithms chosen so far on one stream, per direction.
#[derive(Debug, Default)]
pub(crate) struct Chosen {
    pub forward: HashMap<Problem, ForwardAlgo>,
    pub data: HashMap<Problem, DataAlgo>,
    pub filter: HashMap<Problem, FilterAlgo>,
}

/// Forward candidates (every forward algorithm is deterministic).
pub(crate) const FORWARD_CANDIDATES: [ForwardAlgo; 8] = {
    use ForwardAlgo::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// Data-gradient candidates (algorithm 0 sums with atomics: never).
pub(crate) const DATA_CANDIDATES: [DataAlgo; 5] = {
    use DataAlgo::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// Filter-gradient candidates (algorithms 0 and 3 sum with atomics: never).
pub(crate) const FILTER_CANDIDATES: [FilterAlgo; 4] = {
    use FilterAlgo::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// Runs a convolution through `launch` with the algorithm for `problem` on stream `s`: the one
/// chosen there before, else cuDNN's `heuristic` or, when timing, the fastest of `candidates` as
/// `launch` runs them (`timing` true; the heuristic's where none ran), kept in the stream's
/// `table` for every later call.
pub(crate) fn launch_chosen<A: Copy>(
    s: &mut Stream,
    table: fn(&mut Chosen) -> &mut HashMap<Problem, A>,
    problem: Problem,
    candidates: &[A],
    heuristic: impl FnOnce() -> Result<A, Failure>,
    mut launch: impl FnMut(&Stream, A, bool) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let algo = match table(&mut s.chosen).get(&problem) {
        Some(&algo) => algo,
        None => {
            let mut algo = heuristic()?;
            if s.algorithms == AlgorithmChoice::Timed {
                let on = &*s;
                algo = fastest(&on.stream, candidates, |a| launch(on, a, true)).unwrap_or(algo);
            }
            table(&mut s.chosen).insert(problem, algo);
            algo
        }
    };
    launch(s, algo, false)
}

/// The fastest of `candidates` that runs, or `None` when none did: each launched once to warm
/// (an unsupported one fails there, synchronously) and once between events on `stream`.
fn fastest<A: Copy>(
    stream: &Arc<CudaStream>,
    candidates: &[A],
    mut launch: impl FnMut(A) -> Result<(), Failure>,
) -> Option<A> {
    let mut best: Option<(f32, A)> = None;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for &algo in candidates {
        if launch(algo).is_err() {
            continue;
        }
        let Ok(start) = stream.record_event(flags) else {
            continue;
        };
        if launch(algo).is_err() {
            continue;
        }
        let Ok(end) = stream.record_event(flags) else {
            continue;
        };
        let Ok(ms) = end.synchronize().and_then(|()| start.elapsed_ms(&end)) else {
            continue;
        };
        if best.is_none_or(|(fastest, _)| ms < fastest) {
            best = Some((ms, algo));
        }
    }
    best.map(|(_, algo)| algo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_candidate_sums_with_atomics_and_every_other_algorithm_competes() {
        assert_eq!(
            FORWARD_CANDIDATES.len(),
            ForwardAlgo::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize
        );
        assert!(!DATA_CANDIDATES.contains(&DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0));
        assert_eq!(
            DATA_CANDIDATES.len(),
            DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize - 1
        );
        assert!(!FILTER_CANDIDATES.contains(&FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0));
        assert!(!FILTER_CANDIDATES.contains(&FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3));
        // 7 algorithms, one of which (WINOGRAD) cuDNN does not implement for filters
        assert!(FILTER_CANDIDATES.contains(&FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1));
    }

    #[test]
    fn the_choice_reads_timed_or_heuristic_and_names_the_variable_otherwise() {
        assert_eq!("timed".parse(), Ok(AlgorithmChoice::Timed));
        assert_eq!("heuristic".parse(), Ok(AlgorithmChoice::Heuristic));
        let e = "fast".parse::<AlgorithmChoice>().unwrap_err();
        assert!(
            e.contains("LEGION_CUDNN_ALGOS") && e.contains("heuristic"),
            "{e}"
        );
    }
}
