//! conv2d kernels (being written).
