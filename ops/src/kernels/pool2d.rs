//! pool2d kernels (being written).
