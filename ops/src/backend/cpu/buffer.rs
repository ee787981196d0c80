//! The storage of a physical instance, and the moves between instances (copy, gather, scatter,
//! sum) over rects in global coordinates.
//!
//! bf16 is kept as its bits (`u16`, the upper half of an f32). A sum of bf16 values adds in f32
//! and rounds once, to nearest even, as the GPU's region kernels do.

use crate::backend::DType;
use crate::precision::{bf16_bits, bf16_value};
use crate::shape::Rect;
use crate::shape::{add_rect, copy_rect, for_each_run};

/// Row-major data laid out over an instance's rect.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    /// bf16 bits: activations and their gradients in a bf16 run, and the weights' working copies.
    Bf16(Vec<u16>),
}

impl Buffer {
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F64 => Buffer::F64(vec![0.0; len]),
            DType::Bf16 => Buffer::Bf16(vec![0; len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::F64(v) => v.len(),
            Buffer::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
            Buffer::Bf16(_) => DType::Bf16,
        }
    }

    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }

    pub fn f32(&self) -> &[f32] {
        match self {
            Buffer::F32(v) => v,
            other => panic!("{:?} buffer used as f32", other.dtype()),
        }
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        match self {
            Buffer::F32(v) => v,
            other => panic!("{:?} buffer used as f32", other.dtype()),
        }
    }

    /// The f32 data, by value.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Buffer::F32(v) => v,
            other => panic!("{:?} buffer used as f32", other.dtype()),
        }
    }

    pub fn f64(&self) -> &[f64] {
        match self {
            Buffer::F64(v) => v,
            other => panic!("{:?} buffer used as f64", other.dtype()),
        }
    }

    pub fn f64_mut(&mut self) -> &mut [f64] {
        match self {
            Buffer::F64(v) => v,
            other => panic!("{:?} buffer used as f64", other.dtype()),
        }
    }

    pub fn bf16(&self) -> &[u16] {
        match self {
            Buffer::Bf16(v) => v,
            other => panic!("{:?} buffer used as bf16", other.dtype()),
        }
    }

    pub fn bf16_mut(&mut self) -> &mut [u16] {
        match self {
            Buffer::Bf16(v) => v,
            other => panic!("{:?} buffer used as bf16", other.dtype()),
        }
    }

    /// The values as f32, whatever the element type (f64 rounded, bf16 exact): what a test or
    /// a checkpoint reads of an activation of any precision.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Buffer::F32(v) => v.clone(),
            Buffer::F64(v) => v.iter().map(|&x| x as f32).collect(),
            Buffer::Bf16(v) => v.iter().map(|&b| bf16_value(b)).collect(),
        }
    }

    /// `rect` of this buffer (laid out over `layout`) as a buffer of its own.
    pub fn gather(&self, layout: &Rect, rect: &Rect) -> Buffer {
        self.gather_into(layout, rect, None)
    }

    /// [`gather`](Self::gather) into `reuse`'s allocation when it is given and of this buffer's
    /// element type (its contents are discarded).
    pub fn gather_into(&self, layout: &Rect, rect: &Rect, reuse: Option<Buffer>) -> Buffer {
        if layout == rect {
            return self.clone();
        }
        // The runs come in the order of the new buffer: appending them writes each byte once,
        // where zeroing it first would write it twice.
        fn runs<T: Copy>(src: &[T], layout: &Rect, rect: &Rect, mut out: Vec<T>) -> Vec<T> {
            out.clear();
            out.reserve_exact(rect.volume());
            for_each_run(rect, layout, rect, |s, _, len| {
                out.extend_from_slice(&src[s..s + len]);
            });
            out
        }
        match (self, reuse) {
            (Buffer::F32(v), Some(Buffer::F32(out))) => Buffer::F32(runs(v, layout, rect, out)),
            (Buffer::F32(v), _) => Buffer::F32(runs(v, layout, rect, Vec::new())),
            (Buffer::F64(v), Some(Buffer::F64(out))) => Buffer::F64(runs(v, layout, rect, out)),
            (Buffer::F64(v), _) => Buffer::F64(runs(v, layout, rect, Vec::new())),
            (Buffer::Bf16(v), Some(Buffer::Bf16(out))) => Buffer::Bf16(runs(v, layout, rect, out)),
            (Buffer::Bf16(v), _) => Buffer::Bf16(runs(v, layout, rect, Vec::new())),
        }
    }

    /// Drops every element, keeping the allocation.
    pub fn clear(&mut self) {
        match self {
            Buffer::F32(v) => v.clear(),
            Buffer::F64(v) => v.clear(),
            Buffer::Bf16(v) => v.clear(),
        }
    }

    /// Copies `rect` of `src` (laid out over `src_layout`) into this buffer (over `layout`).
    pub fn copy_from(&mut self, layout: &Rect, src: &Buffer, src_layout: &Rect, rect: &Rect) {
        match (self, src) {
            (Buffer::F32(d), Buffer::F32(s)) => copy_rect(s, src_layout, d, layout, rect),
            (Buffer::F64(d), Buffer::F64(s)) => copy_rect(s, src_layout, d, layout, rect),
            (Buffer::Bf16(d), Buffer::Bf16(s)) => copy_rect(s, src_layout, d, layout, rect),
            _ => panic!("copy between buffers of different element types"),
        }
    }

    /// Adds `rect` of `src` into this buffer.
    pub fn add_from(&mut self, layout: &Rect, src: &Buffer, src_layout: &Rect, rect: &Rect) {
        match (self, src) {
            (Buffer::F32(d), Buffer::F32(s)) => add_rect(s, src_layout, d, layout, rect),
            (Buffer::F64(d), Buffer::F64(s)) => add_rect(s, src_layout, d, layout, rect),
            (Buffer::Bf16(d), Buffer::Bf16(s)) => {
                for_each_run(rect, src_layout, layout, |s_at, d_at, len| {
                    for (o, &i) in d[d_at..d_at + len].iter_mut().zip(&s[s_at..s_at + len]) {
                        *o = bf16_bits(bf16_value(*o) + bf16_value(i));
                    }
                })
            }
            _ => panic!("sum of buffers of different element types"),
        }
    }

    /// Zeroes `rect` of this buffer.
    pub fn zero(&mut self, layout: &Rect, rect: &Rect) {
        fn runs<T: Copy + Default>(v: &mut [T], layout: &Rect, rect: &Rect) {
            for_each_run(rect, layout, layout, |at, _, len| {
                v[at..at + len].fill(T::default())
            });
        }
        match self {
            Buffer::F32(v) => runs(v, layout, rect),
            Buffer::F64(v) => runs(v, layout, rect),
            Buffer::Bf16(v) => runs(v, layout, rect),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_sub_rects() {
        let layout = Rect::new(&[0, 0], &[2, 3]);
        let a = Buffer::F32(vec![1., 2., 3., 4., 5., 6.]);
        let piece = Rect::new(&[0, 1], &[2, 3]);
        assert_eq!(a.gather(&layout, &piece), Buffer::F32(vec![2., 3., 5., 6.]));
        // a block of whole trailing axes (one run) and one cut in the middle axis (a run per row)
        let cube = Rect::new(&[0, 0, 0], &[3, 2, 2]);
        let c = Buffer::F64((0..12).map(f64::from).collect());
        let rows = Rect::new(&[1, 0, 0], &[3, 2, 2]);
        let mids = Rect::new(&[0, 1, 0], &[3, 2, 2]);
        assert_eq!(
            c.gather(&cube, &rows),
            Buffer::F64((4..12).map(f64::from).collect())
        );
        assert_eq!(
            c.gather(&cube, &mids),
            Buffer::F64(vec![2., 3., 6., 7., 10., 11.])
        );
    }

    #[test]
    fn bf16_moves_keep_bits_and_sums_round_once() {
        let layout = Rect::new(&[0, 0], &[2, 2]);
        let piece = Rect::new(&[0, 1], &[2, 2]);
        let bits = |v: &[f32]| Buffer::Bf16(v.iter().map(|&x| bf16_bits(x)).collect());
        let a = bits(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(a.gather(&layout, &piece), bits(&[2.0, 4.0]));
        assert_eq!(a.byte_len(), 8);
        // Near 256 bf16 steps by 2: 256 + 1 ties between 256 and 258 and goes to the even 256;
        // 256 + 3 ties between 258 and 260 and goes to the even 260.
        let mut acc = bits(&[256.0, 0.0, 0.0, 0.0]);
        acc.add_from(&layout, &bits(&[1.0, 0.0, 0.0, 0.0]), &layout, &layout);
        assert_eq!(acc.to_f32()[0], 256.0);
        acc.add_from(&layout, &bits(&[3.0, 0.0, 0.0, 0.0]), &layout, &layout);
        assert_eq!(acc.to_f32()[0], 260.0);
        let mut z = a.clone();
        z.zero(&layout, &piece);
        assert_eq!(z.to_f32(), vec![1.0, 0.0, 3.0, 0.0]);
    }
}
