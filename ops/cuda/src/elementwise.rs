//! Element-wise kernels: the unary and binary launches of ReLU, sigmoid and add, dropout, and the
//! epilogues that convolutions and dense layers share (bias and ReLU, the gradient's ReLU mask,
//! per-channel bias gradients).

use crate::backend::{Cuda, Failure, Launch};
use crate::launch::{Box4, NULL, grid, per_channel};
use crate::memory::{Buffer, Stream};
use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};
use legion_ops::backend::{In, Out};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::shape::Rect;

impl Cuda {
    /// `y = f(x)` over `y.rect` with one of the unary element-wise kernels.
    pub(crate) fn unary(
        &self,
        s: &Stream,
        f: &CudaFunction,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) -> Launch {
        let tile = Box4::of(&y.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let x_layout = Box4::of(&x.rect);
        let packed = (x_layout == tile) as i32;
        let mut b = s.stream.launch_builder(f);
        b.arg(x.mem.f32())
            .arg(&x_layout)
            .arg(y.mem.f32_mut())
            .arg(&tile)
            .arg(&n)
            .arg(&packed);
        // SAFETY: the arguments match the kernel's signature; x's rect contains the tile.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `out = f(a, b)` over `out.rect` with one of the binary element-wise kernels.
    pub(crate) fn binary(
        &self,
        s: &Stream,
        f: &CudaFunction,
        a: In<Buffer>,
        b: In<Buffer>,
        out: Out<Buffer>,
    ) -> Launch {
        let tile = Box4::of(&out.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let (a_layout, b_layout) = (Box4::of(&a.rect), Box4::of(&b.rect));
        let packed = (a_layout == tile && b_layout == tile) as i32;
        let mut l = s.stream.launch_builder(f);
        l.arg(a.mem.f32())
            .arg(&a_layout)
            .arg(b.mem.f32())
            .arg(&b_layout)
            .arg(out.mem.f32_mut())
            .arg(&tile)
            .arg(&n)
            .arg(&packed);
        // SAFETY: the arguments match the kernel's signature; both inputs contain the tile.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `y += bias[c]`, then ReLU when asked, over `y` laid out over `tile`.
    pub(crate) fn bias_activation(
        &self,
        s: &Stream,
        y: &mut CudaSlice<f32>,
        tile: Box4,
        bias: Option<In<Buffer>>,
        relu: bool,
    ) -> Launch {
        let n = tile.volume();
        if n == 0 || (bias.is_none() && !relu) {
            return Ok(());
        }
        let relu = relu as i32;
        let mut b = s.stream.launch_builder(&self.kernels.bias_activation);
        b.arg(y).arg(&tile);
        let bias_lo = bias.map_or(0, |b| b.rect.lo[0] as i64);
        match bias {
            Some(bias) => b.arg(bias.mem.f32()),
            None => b.arg(&NULL),
        };
        b.arg(&bias_lo).arg(&relu).arg(&n);
        // SAFETY: the arguments match the kernel's signature; the bias covers the tile's channels.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `dz = dy·[y > 0]` over `tile`, into a new buffer laid out over the tile.
    pub(crate) fn relu_mask(
        &self,
        s: &Stream,
        y: In<Buffer>,
        dy: In<Buffer>,
        tile: &Rect,
    ) -> Result<CudaSlice<f32>, Failure> {
        // SAFETY: the kernel writes every element of the tile.
        let mut dz = Buffer::F32(unsafe { s.stream.alloc::<f32>(tile.volume()) }?);
        self.binary(
            s,
            &self.kernels.relu_backward,
            y,
            dy,
            Out {
                rect: *tile,
                mem: &mut dz,
            },
        )?;
        match dz {
            Buffer::F32(dz) => Ok(dz),
            Buffer::F64(_) => unreachable!(),
        }
    }

    /// `out[c − out_lo] = Σ dz[·, c, ·, ·]` per channel of `tile` (dz laid out over the tile).
    pub(crate) fn channel_sum(
        &self,
        s: &Stream,
        dz: &CudaSlice<f32>,
        tile: Box4,
        out: Out<Buffer>,
    ) -> Launch {
        let channels = tile.ext[1];
        if channels == 0 {
            return Ok(());
        }
        let out_lo = out.rect.lo[0] as i64;
        let mut b = s.stream.launch_builder(&self.kernels.channel_sum);
        b.arg(dz).arg(&tile).arg(out.mem.f32_mut()).arg(&out_lo);
        // SAFETY: the arguments match the kernel's signature; `out` covers the tile's channels.
        unsafe { b.launch(per_channel(channels)) }?;
        Ok(())
    }

    /// `y = x·mask/(1 − rate)` over `y.rect`, the mask drawn as kernels::dropout draws it.
    pub(crate) fn dropout(
        &self,
        s: &mut Stream,
        mask: &DropoutMask,
        x: In<Buffer>,
        y: Out<Buffer>,
    ) -> Launch {
        assert!(
            (0.0..1.0).contains(&mask.rate),
            "dropout rate {} must be in [0, 1)",
            mask.rate
        );
        let full_rect = mask.shape.full_rect();
        assert!(
            full_rect.contains(&y.rect),
            "tile {} lies outside the tensor {}",
            y.rect,
            mask.shape
        );
        let tile = Box4::of(&y.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        self.write_step(s, mask.step)?;
        let (step, _) = s.step.as_ref().expect("written above");
        let (x_layout, full) = (Box4::of(&x.rect), Box4::of(&full_rect));
        let scale = mask.keep_scale();
        let mut b = s.stream.launch_builder(&self.kernels.dropout_apply);
        b.arg(x.mem.f32())
            .arg(&x_layout)
            .arg(y.mem.f32_mut())
            .arg(&tile)
            .arg(&full)
            .arg(&mask.seed)
            .arg(step)
            .arg(&mask.layer_salt)
            .arg(&mask.rate)
            .arg(&scale)
            .arg(&n);
        // SAFETY: the arguments match the kernel's signature; x contains the tile.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }
}
