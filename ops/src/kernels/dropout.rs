//! dropout kernels (being written).
