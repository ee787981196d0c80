//! dense kernels (being written).
