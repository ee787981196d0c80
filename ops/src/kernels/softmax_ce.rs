//! softmax_ce kernels (being written).
