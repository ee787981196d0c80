//! concat kernels (being written).
