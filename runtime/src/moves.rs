//! A step's local data movement, written once for every backend: a program's `Copy` is one
//! [`Backend::copy_rect`], and its `Fold` is [`fold`], both over the backend's region primitives. A
//! device driver decides where the buffers live and when the call runs (the CPU driver on its
//! compute pool or its actor, the GPU driver on its stream); what the op computes is here.

use legion_ops::Rect;
use legion_ops::backend::{Backend, In, Out};

/// `to[rect] = (accumulate ? to[rect] : 0) + Σ terms[rect]`, summed in the order of `terms` (the
/// analysis fixes that order, so that every strategy adds partial sums alike).
pub fn fold<B: Backend>(
    backend: &B,
    stream: &mut B::Stream,
    to: Out<B::Buffer>,
    terms: &[In<B::Buffer>],
    rect: &Rect,
    accumulate: bool,
) {
    let layout = to.rect;
    let mut rest = terms;
    if !accumulate {
        let to = Out {
            rect: layout,
            mem: &mut *to.mem,
        };
        match terms.split_first() {
            Some((&first, tail)) => {
                backend.copy_rect(stream, first, to, rect);
                rest = tail;
            }
            None => backend.zero_rect(stream, to, rect),
        }
    }
    for &term in rest {
        let to = Out {
            rect: layout,
            mem: &mut *to.mem,
        };
        backend.add_rect(stream, term, to, rect);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::backend::cpu::{Buffer, Cpu, CpuStream};

    fn fold_cpu(dst: &mut Buffer, layout: Rect, terms: &[(&Buffer, Rect)], rect: Rect, acc: bool) {
        let terms: Vec<In<Buffer>> = terms.iter().map(|&(mem, rect)| In { rect, mem }).collect();
        let to = Out {
            rect: layout,
            mem: dst,
        };
        fold(&Cpu::default(), &mut CpuStream, to, &terms, &rect, acc);
    }

    #[test]
    fn a_fold_overwrites_or_accumulates_its_rect_and_nothing_else() {
        let layout = Rect::new(&[0, 0], &[2, 3]);
        let piece = Rect::new(&[0, 1], &[2, 3]);
        let a = Buffer::F32(vec![1., 2., 3., 4., 5., 6.]);
        let b = Buffer::F32(vec![10., 20., 30., 40.]);
        let mut dst = Buffer::F32(vec![-1.0; 6]);
        fold_cpu(&mut dst, layout, &[(&a, layout), (&b, piece)], piece, false);
        assert_eq!(dst, Buffer::F32(vec![-1., 12., 23., -1., 35., 46.]));
        // Accumulating adds every term to what is there.
        fold_cpu(&mut dst, layout, &[(&b, piece)], piece, true);
        assert_eq!(dst, Buffer::F32(vec![-1., 22., 43., -1., 65., 86.]));
        // No terms: the rect is zeroed, the rest kept.
        fold_cpu(&mut dst, layout, &[], Rect::new(&[1, 0], &[2, 1]), false);
        assert_eq!(dst, Buffer::F32(vec![-1., 22., 43., 0., 65., 86.]));
        // No terms, accumulating: nothing changes.
        fold_cpu(&mut dst, layout, &[], layout, true);
        assert_eq!(dst, Buffer::F32(vec![-1., 22., 43., 0., 65., 86.]));
    }
}
