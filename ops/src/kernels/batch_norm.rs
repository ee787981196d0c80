//! batch_norm kernels (being written).
