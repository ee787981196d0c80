//! add kernels (being written).
