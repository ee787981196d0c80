//! relu kernels (being written).
