//! Element-wise kernels: the unary and binary launches of ReLU, sigmoid and add, dropout, and the
//! epilogues that convolutions and dense layers share (bias and ReLU, the gradient's ReLU mask,
//! per-channel bias gradients). Each launches the kernel of its activations' element type
//! ([`Twin::of`]): f32, or bf16 in a bf16 run.

use crate::backend::{Cuda, Failure, Launch};
use crate::kernels::Twin;
use crate::launch::{Box4, ChannelParts, NULL, grid};
use crate::memory::{Buffer, Stream, same_type};
use cudarc::driver::PushKernelArg;
use legion_ops::backend::{DType, In, Out};
use legion_ops::kernels::dropout::DropoutMask;
use legion_ops::shape::Rect;

impl Cuda {
    /// `y = f(x)` over `y.rect` with one of the unary element-wise kernels.
    pub(crate) fn unary(&self, s: &Stream, f: &Twin, x: In<Buffer>, y: Out<Buffer>) -> Launch {
        self.unary_with(s, f, x, y, None)
    }

    /// [`unary`](Self::unary), passing the kernel `attribute` last where it takes one (the
    /// unary family's kernels take the op's alpha).
    pub(crate) fn unary_with(
        &self,
        s: &Stream,
        f: &Twin,
        x: In<Buffer>,
        y: Out<Buffer>,
        attribute: Option<f32>,
    ) -> Launch {
        let tile = Box4::of(&y.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let x_layout = Box4::of(&x.rect);
        let packed = (x_layout == tile) as i32;
        let dtype = same_type(&[x.mem.dtype(), y.mem.dtype()]);
        let mut b = s.stream.launch_builder(f.of(dtype));
        x.mem.push(&mut b);
        b.arg(&x_layout);
        y.mem.push_mut(&mut b);
        b.arg(&tile).arg(&n).arg(&packed);
        if let Some(a) = &attribute {
            b.arg(a);
        }
        // SAFETY: the arguments match the kernel's signature; x's rect contains the tile.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `out = f(a, b)` over `out.rect` with one of the binary element-wise kernels.
    pub(crate) fn binary(
        &self,
        s: &Stream,
        f: &Twin,
        a: In<Buffer>,
        b: In<Buffer>,
        out: Out<Buffer>,
    ) -> Launch {
        self.binary_with(s, f, a, b, out, None)
    }

    /// [`binary`](Self::binary), passing the kernel `attribute` last where it takes one.
    pub(crate) fn binary_with(
        &self,
        s: &Stream,
        f: &Twin,
        a: In<Buffer>,
        b: In<Buffer>,
        out: Out<Buffer>,
        attribute: Option<f32>,
    ) -> Launch {
        let tile = Box4::of(&out.rect);
        let n = tile.volume();
        if n == 0 {
            return Ok(());
        }
        let (a_layout, b_layout) = (Box4::of(&a.rect), Box4::of(&b.rect));
        let packed = (a_layout == tile && b_layout == tile) as i32;
        let dtype = same_type(&[a.mem.dtype(), b.mem.dtype(), out.mem.dtype()]);
        let mut l = s.stream.launch_builder(f.of(dtype));
        a.mem.push(&mut l);
        l.arg(&a_layout);
        b.mem.push(&mut l);
        l.arg(&b_layout);
        out.mem.push_mut(&mut l);
        l.arg(&tile).arg(&n).arg(&packed);
        if let Some(a) = &attribute {
            l.arg(a);
        }
        // SAFETY: the arguments match the kernel's signature; both inputs contain the tile.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `ds[n, c] = Σ dy · x` over `tile`'s rows and columns (a channel scale's gradient): a block
    /// per element of `ds`.
    pub(crate) fn mul_scale_grad(
        &self,
        s: &Stream,
        tile: &Rect,
        x: In<Buffer>,
        dy: In<Buffer>,
        ds: Out<Buffer>,
    ) -> Launch {
        let (region, tile) = (Box4::of(&ds.rect), Box4::of(tile));
        let blocks = region.volume();
        if blocks == 0 {
            return Ok(());
        }
        // a grid's x dimension takes at most 2^31 - 1 blocks
        let blocks = i32::try_from(blocks).map(|b| b as u32).map_err(|_| {
            Failure(format!(
                "a channel scale's gradient of {blocks} elements exceeds one launch's grid"
            ))
        })?;
        let dtype = same_type(&[x.mem.dtype(), dy.mem.dtype(), ds.mem.dtype()]);
        let (x_layout, dy_layout) = (Box4::of(&x.rect), Box4::of(&dy.rect));
        let mut b = s
            .stream
            .launch_builder(self.kernels.mul_scale_grad.of(dtype));
        x.mem.push(&mut b);
        b.arg(&x_layout);
        dy.mem.push(&mut b);
        b.arg(&dy_layout);
        ds.mem.push_mut(&mut b);
        b.arg(&region).arg(&tile);
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (crate::kernels::REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; x and dy contain the tile, and the
        // kernel's block reduction takes exactly REDUCE_THREADS threads.
        unsafe { b.launch(config) }?;
        Ok(())
    }

    /// `y += bias[c]`, then ReLU when asked, over `y` laid out over `tile` (the bias is the fp32
    /// master in every precision).
    pub(crate) fn bias_activation(
        &self,
        s: &Stream,
        y: &mut Buffer,
        tile: Box4,
        bias: Option<In<Buffer>>,
        relu: bool,
    ) -> Launch {
        if tile.volume() == 0 || (bias.is_none() && !relu) {
            return Ok(());
        }
        let relu = relu as i32;
        let bias_lo = bias.map_or(0, |b| b.rect.lo[0] as i64);
        if tile.is_rows() {
            // element i is channel lo + i % C
            let n = tile.volume();
            let mut b = s
                .stream
                .launch_builder(self.kernels.bias_activation_rows.of(y.dtype()));
            y.push_mut(&mut b);
            b.arg(&tile.lo[1]).arg(&tile.ext[1]);
            match bias {
                Some(bias) => b.arg(bias.mem.f32()),
                None => b.arg(&NULL),
            };
            b.arg(&bias_lo).arg(&relu).arg(&n);
            // SAFETY: the arguments match the kernel's signature; the bias covers the tile's
            // channels.
            unsafe { b.launch(grid(n)) }?;
            return Ok(());
        }
        let cut = ChannelParts::of(&tile)?;
        let mut b = s
            .stream
            .launch_builder(self.kernels.bias_activation.of(y.dtype()));
        y.push_mut(&mut b);
        b.arg(&tile);
        match bias {
            Some(bias) => b.arg(bias.mem.f32()),
            None => b.arg(&NULL),
        };
        b.arg(&bias_lo).arg(&relu).arg(&cut.parts);
        // SAFETY: the arguments match the kernel's signature; the bias covers the tile's channels.
        unsafe { b.launch(cut.launch()) }?;
        Ok(())
    }

    /// `dz = dy·[y > 0]` over `tile`, into a new buffer of dy's element type laid out over the
    /// tile.
    pub(crate) fn relu_mask(
        &self,
        s: &Stream,
        y: In<Buffer>,
        dy: In<Buffer>,
        tile: &Rect,
    ) -> Result<Buffer, Failure> {
        // SAFETY: the kernel writes every element of the tile.
        let mut dz = match dy.mem.dtype() {
            DType::Bf16 => Buffer::Bf16(unsafe { s.stream.alloc(tile.volume()) }?),
            _ => Buffer::F32(unsafe { s.stream.alloc(tile.volume()) }?),
        };
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
        Ok(dz)
    }

    /// `out[c − out_lo] = Σ dz[·, c, ·, ·]` per channel of `tile` (dz laid out over the tile; the
    /// sum, a bias gradient, is f32 in every precision): each part of each channel summed by a
    /// block, then the parts added in order.
    pub(crate) fn channel_sum(
        &self,
        s: &Stream,
        dz: &Buffer,
        tile: Box4,
        out: Out<Buffer>,
    ) -> Launch {
        let channels = tile.ext[1];
        if channels == 0 {
            return Ok(());
        }
        let cut = ChannelParts::of(&tile)?;
        // SAFETY: the first kernel writes every part's sum before the second reads it.
        let mut partial = unsafe { s.stream.alloc::<f64>((cut.parts * channels) as usize) }?;
        let mut b = s
            .stream
            .launch_builder(self.kernels.channel_sum.of(dz.dtype()));
        dz.push(&mut b);
        b.arg(&tile).arg(&cut.parts).arg(&mut partial);
        // SAFETY: the arguments match the kernel's signature; a block of each part of each
        // channel writes its sum.
        unsafe { b.launch(cut.launch()) }?;
        let (c_lo, out_lo) = (tile.lo[1], out.rect.lo[0] as i64);
        let mut b = s.stream.launch_builder(&self.kernels.channel_sum_finish);
        b.arg(&partial)
            .arg(&cut.parts)
            .arg(&channels)
            .arg(&c_lo)
            .arg(out.mem.f32_mut())
            .arg(&out_lo);
        // SAFETY: as above; `out` covers the tile's channels.
        unsafe { b.launch(grid(channels)) }?;
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
        let dtype = same_type(&[x.mem.dtype(), y.mem.dtype()]);
        let mut b = s
            .stream
            .launch_builder(self.kernels.dropout_apply.of(dtype));
        x.mem.push(&mut b);
        b.arg(&x_layout);
        y.mem.push_mut(&mut b);
        b.arg(&tile)
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
