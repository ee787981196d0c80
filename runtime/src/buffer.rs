//! The storage of a physical instance: host memory of the CPU backend, and the moves between
//! instances (copy, gather, sum) over rects in global coordinates.

pub use legion_ops::backend::cpu::buffer::Buffer;
