//! gemm kernels (being written).
