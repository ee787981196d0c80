//! Which cuDNN algorithm runs each convolution: the user's [`ConvAlgos`] policy.
//!
//! - **fastest** (the default): each distinct problem (shapes, padding, stride, groups,
//!   direction) is **timed** once on its stream: every algorithm cuDNN has launched on the real
//!   operands, once to warm and once between CUDA events, the fastest kept for every later call
//!   (what PyTorch's `cudnn.benchmark` does, without its deterministic mode). Two kinds of
//!   candidate round differently from a direct sum in fixed order: FFT and Winograd algorithms
//!   (by more than reordering a sum does: on the lent H200 a LeNet-5 weight gradient moved 1.1e-4
//!   relative where reordering alone moves it 1.4e-7), and the backward algorithms that sum with
//!   atomics (data algorithm 0, filter algorithms 0 and 3: the order of their sums, and so their
//!   last bits, changes from run to run; PyTorch's fastest backward kernels on AlexNet and
//!   ResNet-50 are these).
//! - **precise**: timed the same way among the deterministic direct algorithms only (implicit
//!   GEMM, GEMM, direct; data and filter algorithm 1), so results differ from the CPU's only by
//!   the order of the sums, the same order every run. The GPU equivalence tests run this policy
//!   at their tight tolerance, and a test bounds fastest against it.
//! - **heuristic**: cuDNN's first answer to `cudnnGetConvolution*Algorithm_v7`, untimed, with
//!   atomic backward algorithms replaced: the same choice and the same bits in every process, so
//!   runs that must repeat bit for bit (a run against its `--resume`) use it.
//!
//! Timing blocks the submitting thread once per problem, never per step. Every policy keeps the
//! stream's math: the convolution descriptor's math type (FMA math for
//! [`crate::Math::StrictFp32`]) holds for every candidate, so no TF32 unless asked for; and a
//! candidate's workspace is at most [`WORKSPACE_CAP`] bytes while timing (the heuristic's own
//! choice is used whatever its workspace).

use crate::backend::Failure;
use crate::memory::Stream;
use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t as DataAlgo, cudnnConvolutionBwdFilterAlgo_t as FilterAlgo,
    cudnnConvolutionFwdAlgo_t as ForwardAlgo,
};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUevent_flags;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;

/// How the backend picks convolution algorithms (`--conv-algos`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvAlgos {
    /// Each problem's algorithms timed once on the stream, the fastest kept.
    #[default]
    Fastest,
    /// As `Fastest`, among the deterministic algorithms that sum directly (no FFT, no Winograd,
    /// no atomics).
    Precise,
    /// cuDNN's heuristic, with atomic backward algorithms replaced by deterministic ones.
    Heuristic,
}

impl ConvAlgos {
    pub const NAMES: [&'static str; 3] = ["fastest", "precise", "heuristic"];

    /// Whether the policy times candidates (rather than taking cuDNN's heuristic).
    fn timed(self) -> bool {
        self != ConvAlgos::Heuristic
    }

    /// Whether `algo` may run under this policy.
    fn admits(self, algo: impl Transform) -> bool {
        match self {
            ConvAlgos::Fastest => true,
            ConvAlgos::Precise => !algo.is_transform() && !algo.sums_with_atomics(),
            ConvAlgos::Heuristic => !algo.sums_with_atomics(),
        }
    }
}

impl std::str::FromStr for ConvAlgos {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fastest" => Ok(ConvAlgos::Fastest),
            "precise" => Ok(ConvAlgos::Precise),
            "heuristic" => Ok(ConvAlgos::Heuristic),
            other => Err(format!(
                "convolution algorithms {other:?}: expected one of {}",
                ConvAlgos::NAMES.join(", ")
            )),
        }
    }
}

impl std::fmt::Display for ConvAlgos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConvAlgos::Fastest => "fastest",
            ConvAlgos::Precise => "precise",
            ConvAlgos::Heuristic => "heuristic",
        })
    }
}

/// Where a convolution's bias and ReLU are applied (`--no-fused-epilogue` picks `Separate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvEpilogue {
    /// In cuDNN's fused convolution (`cudnnConvolutionBiasActivationForward`): an fp32
    /// convolution with a bias and a ReLU writes its output once, activated. Its algorithms are
    /// timed with the epilogue, so `fastest` keeps the fastest fused one. Where it cannot apply
    /// (bf16 data, whose bias cuDNN would read in bf16 rather than the fp32 master; no bias or no
    /// ReLU; a tile convolved as several segments) and where cuDNN refuses the problem, the
    /// epilogue runs as `Separate` does. The fused ReLU is given `CUDNN_NOT_PROPAGATE_NAN` (the
    /// mode PyTorch's cuDNN descriptors use, which cuDNN has documented as the one this call
    /// supports): a NaN sum comes out as 0, where the separate kernel keeps it, so `Separate`
    /// keeps a diverging run's NaNs in the activations.
    #[default]
    Fused,
    /// In a kernel of its own after the convolution, which reads and writes the output again.
    Separate,
}

impl ConvEpilogue {
    pub const NAMES: [&'static str; 2] = ["fused", "separate"];
}

impl std::str::FromStr for ConvEpilogue {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fused" => Ok(ConvEpilogue::Fused),
            "separate" => Ok(ConvEpilogue::Separate),
            other => Err(format!(
                "convolution epilogue {other:?}: expected one of {}",
                ConvEpilogue::NAMES.join(", ")
            )),
        }
    }
}

impl std::fmt::Display for ConvEpilogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConvEpilogue::Fused => "fused",
            ConvEpilogue::Separate => "separate",
        })
    }
}

/// How an algorithm sums: through a transform of its operands (FFT, Winograd) rather than
/// products directly, and with atomics (in an order that changes from run to run).
pub(crate) trait Transform: Copy {
    fn is_transform(self) -> bool;
    fn sums_with_atomics(self) -> bool {
        false
    }
}

impl Transform for ForwardAlgo {
    fn is_transform(self) -> bool {
        use ForwardAlgo::*;
        matches!(
            self,
            CUDNN_CONVOLUTION_FWD_ALGO_FFT
                | CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING
                | CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD
                | CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED
        )
    }
}

impl Transform for DataAlgo {
    fn sums_with_atomics(self) -> bool {
        self == DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0
    }

    fn is_transform(self) -> bool {
        use DataAlgo::*;
        matches!(
            self,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT
                | CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING
                | CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD
                | CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED
        )
    }
}

impl Transform for FilterAlgo {
    fn sums_with_atomics(self) -> bool {
        matches!(
            self,
            FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0
                | FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3
        )
    }

    fn is_transform(self) -> bool {
        use FilterAlgo::*;
        matches!(
            self,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT
                | CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING
                | CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD
                | CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED
        )
    }
}

/// The most workspace a candidate may ask for while timing (1 GiB).
pub(crate) const WORKSPACE_CAP: usize = 1 << 30;

/// One convolution problem as cuDNN sees it (the stream's math is fixed, so not part of it; the
/// data's element type is, since a bf16 problem has other algorithms than an f32 one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Problem {
    pub x: [c_int; 4],
    pub w: [c_int; 4],
    pub y: [c_int; 4],
    pub pad: [i64; 2],
    pub stride: [i64; 2],
    pub groups: i64,
    pub dtype: legion_ops::backend::DType,
    /// Whether the bias and ReLU run inside the convolution ([`ConvEpilogue::Fused`]): its
    /// algorithms are timed with them.
    pub fused: bool,
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

/// Data-gradient candidates (algorithm 0 sums with atomics: `fastest` only).
pub(crate) const DATA_CANDIDATES: [DataAlgo; 6] = {
    use DataAlgo::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// Filter-gradient candidates (algorithms 0 and 3 sum with atomics: `fastest` only).
pub(crate) const FILTER_CANDIDATES: [FilterAlgo; 6] = {
    use FilterAlgo::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// Runs a convolution through `launch` with the algorithm for `problem` on stream `s`: the one
/// chosen there before, else cuDNN's `heuristic` or, when timing, the fastest of `candidates` as
/// `launch` runs them (`timing` true; the heuristic's where none ran), kept in the stream's
/// `table` for every later call.
pub(crate) fn launch_chosen<A: Transform>(
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
            let policy = s.algorithms;
            if policy.timed() {
                let on = &*s;
                let admitted: Vec<A> = candidates
                    .iter()
                    .copied()
                    .filter(|&a| policy.admits(a))
                    .collect();
                algo = fastest(&on.stream, &admitted, |a| launch(on, a, true))
                    .or_else(|| {
                        // None ran (out of memory for a fresh workspace, say): the heuristic's
                        // pick where the policy admits it, else the first candidate that it does.
                        (!policy.admits(algo))
                            .then(|| admitted.first().copied())
                            .flatten()
                    })
                    .unwrap_or(algo);
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
    fn every_algorithm_is_a_candidate_and_only_fastest_admits_atomics() {
        assert_eq!(
            FORWARD_CANDIDATES.len(),
            ForwardAlgo::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize
        );
        assert_eq!(
            DATA_CANDIDATES.len(),
            DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize
        );
        // 7 algorithms, one of which (WINOGRAD) cuDNN does not implement for filters
        assert_eq!(
            FILTER_CANDIDATES.len(),
            FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as usize - 1
        );
        let atomic_data = DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
        let atomic_filters = [
            FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
            FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        ];
        assert!(ConvAlgos::Fastest.admits(atomic_data));
        assert!(!ConvAlgos::Precise.admits(atomic_data));
        assert!(!ConvAlgos::Heuristic.admits(atomic_data));
        for f in atomic_filters {
            assert!(ConvAlgos::Fastest.admits(f) && !ConvAlgos::Precise.admits(f));
        }
    }

    #[test]
    fn the_epilogue_reads_its_two_names_and_lists_them_otherwise() {
        for name in ConvEpilogue::NAMES {
            let epilogue: ConvEpilogue = name.parse().unwrap();
            assert_eq!(epilogue.to_string(), name);
        }
        assert_eq!(ConvEpilogue::default(), ConvEpilogue::Fused);
        let e = "inline".parse::<ConvEpilogue>().unwrap_err();
        assert!(e.contains("fused, separate"), "{e}");
    }

    #[test]
    fn the_policy_reads_its_three_names_and_lists_them_otherwise() {
        for name in ConvAlgos::NAMES {
            let policy: ConvAlgos = name.parse().unwrap();
            assert_eq!(policy.to_string(), name);
        }
        assert_eq!(ConvAlgos::default(), ConvAlgos::Fastest);
        let e = "timed".parse::<ConvAlgos>().unwrap_err();
        assert!(e.contains("fastest, precise, heuristic"), "{e}");
    }

    #[test]
    fn precise_admits_the_direct_algorithms_only_and_fastest_every_candidate() {
        let direct = |c: &[ForwardAlgo]| c.iter().filter(|a| !a.is_transform()).count();
        assert_eq!(
            direct(&FORWARD_CANDIDATES),
            4,
            "implicit GEMM x2, GEMM, direct"
        );
        for a in FORWARD_CANDIDATES {
            assert!(ConvAlgos::Fastest.admits(a));
            assert_eq!(ConvAlgos::Precise.admits(a), !a.is_transform());
        }
        let data: Vec<_> = DATA_CANDIDATES
            .into_iter()
            .filter(|&a| ConvAlgos::Precise.admits(a))
            .collect();
        assert_eq!(data, [DataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1]);
        let filter: Vec<_> = FILTER_CANDIDATES
            .into_iter()
            .filter(|&a| ConvAlgos::Precise.admits(a))
            .collect();
        assert_eq!(filter, [FilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1]);
        assert!(!ConvAlgos::Heuristic.timed() && ConvAlgos::Precise.timed());
    }
}
