//! Frames over a byte stream (a QUIC uni-stream, or TCP in the benchmark): the only code between
//! the pure [`frame`](super::frame) functions and a socket.

use super::frame::Frame;
use super::frame::{
    FrameError, FrameHeader, HEADER_LEN, Limits, Payload, decode_header, encode_header,
    payload_bytes, payload_bytes_shared,
};
use bytemuck::Pod;
use bytes::Bytes;
use legion_runtime::Buffer;
use legion_runtime::SliceMessage;
use legion_runtime::region::DType;
use std::future::poll_fn;
use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// Writes one slice frame (does not finish or flush the stream).
pub async fn write_slice<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &SliceMessage,
) -> std::io::Result<()> {
    w.write_all(&encode_header(&FrameHeader::slice(msg)))
        .await?;
    w.write_all(&payload_bytes(&msg.data)).await
}

/// Writes one slice frame to a QUIC stream, handing quinn the payload by reference (no copy into
/// its send queue, unlike [`write_slice`]). Does not finish the stream.
pub async fn write_slice_chunks(
    send: &mut quinn::SendStream,
    msg: &SliceMessage,
) -> Result<(), quinn::WriteError> {
    let header = Bytes::copy_from_slice(&encode_header(&FrameHeader::slice(msg)));
    let mut chunks = [header, payload_bytes_shared(&msg.data)];
    send.write_all_chunks(&mut chunks).await
}

pub async fn write_control<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(&encode_header(&FrameHeader::Control { bytes: bytes.len() }))
        .await?;
    w.write_all(bytes).await
}

/// Buffers to read received slices into: given a slice's element type and count, an empty buffer
/// of that type with room for them, if one is at hand (the receiving job's pool of buffers its
/// devices handed back); else the slice gets a new one. A buffer fresh from the allocator costs the
/// receiver a page fault and a zeroed page for every 4 KiB of a multi-megabyte slice.
pub type BufferSource = Arc<dyn Fn(DType, usize) -> Option<Buffer> + Send + Sync>;

/// Reads the next frame, or `None` at a clean end of stream (before any header byte). The payload
/// is read straight into its final vector.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Option<Frame>, FrameError> {
    read_frame_into(r, limits, None).await
}

/// [`read_frame`], a slice's payload read into a buffer from `buffers` where it has one.
pub async fn read_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
    buffers: Option<&BufferSource>,
) -> Result<Option<Frame>, FrameError> {
    let mut head = [0u8; HEADER_LEN];
    let got = read_full(r, &mut head).await?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN,
            got,
        });
    }
    let header = decode_header(&head, limits)?;
    let want = header.payload_len();
    let (payload, got) = read_payload(r, &header, buffers).await?;
    if got < want {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN + want,
            got: HEADER_LEN + got,
        });
    }
    Ok(Some(payload.into_frame()))
}

/// Reads exactly one frame and requires the stream to end right after it (one frame per stream);
/// a slice's payload goes into a buffer from `buffers` where it has one.
pub async fn read_single_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
    buffers: Option<&BufferSource>,
) -> Result<Frame, FrameError> {
    let frame = read_frame_into(r, limits, buffers)
        .await?
        .ok_or(FrameError::Truncated {
            expected: HEADER_LEN,
            got: 0,
        })?;
    let mut extra = [0u8; 64];
    let n = r.read(&mut extra).await?;
    if n > 0 {
        return Err(FrameError::Trailing(n));
    }
    Ok(frame)
}

/// Reads the payload `header` announces into a vector of its final type: a slice's from `buffers`
/// where it has one, else a new one. Returns it with the number of bytes that came; the payload is
/// complete only if that is the header's payload length.
async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &FrameHeader,
    buffers: Option<&BufferSource>,
) -> std::io::Result<(Payload, usize)> {
    Ok(match *header {
        FrameHeader::Slice {
            step,
            copy,
            to,
            dtype,
            elements,
        } => {
            let reused = buffers.and_then(|take| take(dtype, elements));
            let (data, got) = match dtype {
                DType::F32 => {
                    let into = match reused {
                        Some(Buffer::F32(v)) => v,
                        _ => Vec::new(),
                    };
                    let (v, got) = read_vec::<f32, R>(r, into, elements).await?;
                    (Buffer::F32(v), got)
                }
                DType::F64 => {
                    let into = match reused {
                        Some(Buffer::F64(v)) => v,
                        _ => Vec::new(),
                    };
                    let (v, got) = read_vec::<f64, R>(r, into, elements).await?;
                    (Buffer::F64(v), got)
                }
                DType::Bf16 => {
                    let into = match reused {
                        Some(Buffer::Bf16(v)) => v,
                        _ => Vec::new(),
                    };
                    let (v, got) = read_vec::<u16, R>(r, into, elements).await?;
                    (Buffer::Bf16(v), got)
                }
            };
            let payload = Payload::Slice {
                step,
                copy,
                to,
                data,
            };
            (payload, got)
        }
        FrameHeader::Control { bytes } => {
            let (v, got) = read_vec::<u8, R>(r, Vec::new(), bytes).await?;
            (Payload::Control(v), got)
        }
    })
}

/// Reads `len` elements' bytes into the capacity of `v` (emptied first, grown if short), which is
/// never zeroed first: the stream overwrites all of it, and zeroing a multi-megabyte slice on
/// arrival cost the receiving side ~5% of its CPU (perf, 16 MiB slices over QUIC). The vector
/// comes back with its `len` elements if all their bytes came, else empty, with the number of
/// bytes that did.
async fn read_vec<T: Pod, R: AsyncRead + Unpin>(
    r: &mut R,
    mut v: Vec<T>,
    len: usize,
) -> std::io::Result<(Vec<T>, usize)> {
    v.clear();
    v.reserve_exact(len);
    let spare = &mut v.spare_capacity_mut()[..len];
    let want = size_of_val(spare);
    // SAFETY: `spare` is `want` bytes of memory owned by `v`; `MaybeUninit<u8>` has alignment 1
    // and no validity requirement, so any such memory may be viewed as it.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<MaybeUninit<u8>>(), want)
    };
    // An address, not a pointer: the future must stay `Send`.
    let start = bytes.as_ptr() as usize;
    let mut buf = ReadBuf::uninit(bytes);
    while buf.remaining() > 0 {
        let before = buf.filled().len();
        match poll_fn(|cx| Pin::new(&mut *r).poll_read(cx, &mut buf)).await {
            Ok(()) if buf.filled().len() == before => break,
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // A reader may only fill the buffer it was given, not swap in another one: the filled
        // count below must describe `v`'s memory.
        if buf.filled().as_ptr() as usize != start {
            return Err(std::io::Error::other("reader replaced its read buffer"));
        }
    }
    let got = buf.filled().len();
    if got == want {
        // SAFETY: the `ReadBuf` over `v`'s first `want` bytes reports all of them filled, i.e.
        // initialized, and every bit pattern is a valid `T` (`Pod`).
        unsafe { v.set_len(len) };
    }
    Ok((v, got))
}

/// Fills `buf` as far as the stream goes; fewer bytes than asked means end of stream.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]).await {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    /// Hands out its bytes a few at a time, so reads end in the middle of an element.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        piece: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let end = (self.at + self.piece)
                .min(self.bytes.len())
                .min(self.at + buf.remaining());
            buf.put_slice(&self.bytes[self.at..end]);
            self.at = end;
            Poll::Ready(Ok(()))
        }
    }

    async fn encoded(data: Buffer) -> Vec<u8> {
        let msg = SliceMessage {
            step: 7,
            copy: 3,
            to: 1,
            data: Arc::new(data),
        };
        let mut out = Vec::new();
        write_slice(&mut out, &msg).await.unwrap();
        write_control(&mut out, b"ctl").await.unwrap();
        out
    }

    #[tokio::test]
    async fn frames_read_in_odd_pieces_arrive_whole() {
        let f32s: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5 - 3.0).collect();
        let f64s: Vec<f64> = (0..333).map(|i| i as f64 / 7.0).collect();
        for data in [Buffer::F32(f32s), Buffer::F64(f64s)] {
            let bytes = encoded(data.clone()).await;
            for piece in [1, 3, 5, 4096] {
                let mut r = Trickle {
                    bytes: bytes.clone(),
                    at: 0,
                    piece,
                };
                let limits = Limits::default();
                let Some(Frame::Slice(msg)) = read_frame(&mut r, &limits).await.unwrap() else {
                    panic!("expected a slice frame");
                };
                assert_eq!((msg.step, msg.copy, msg.to), (7, 3, 1));
                assert_eq!(*msg.data, data);
                let Some(Frame::Control(ctl)) = read_frame(&mut r, &limits).await.unwrap() else {
                    panic!("expected a control frame");
                };
                assert_eq!(ctl, b"ctl");
                assert!(read_frame(&mut r, &limits).await.unwrap().is_none());
            }
        }
    }

    #[tokio::test]
    async fn a_payload_cut_short_is_truncated() {
        let bytes = encoded(Buffer::F32(vec![1.0; 100])).await;
        let cut = HEADER_LEN + 4 * 37 + 2;
        let mut r = Trickle {
            bytes: bytes[..cut].to_vec(),
            at: 0,
            piece: 7,
        };
        match read_frame(&mut r, &Limits::default()).await {
            Err(FrameError::Truncated { expected, got }) => {
                assert_eq!((expected, got), (HEADER_LEN + 400, cut));
            }
            other => panic!("expected a truncated frame, got {other:?}"),
        }
    }

    /// Fills a buffer of its own instead of the one it was given.
    struct Swapper;

    impl AsyncRead for Swapper {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let own: &'static mut [u8] = Box::leak(vec![0u8; 64].into_boxed_slice());
            *buf = ReadBuf::new(own);
            buf.advance(64);
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_reader_that_swaps_its_buffer_is_an_error_not_uninitialized_data() {
        assert!(
            read_vec::<f32, _>(&mut Swapper, Vec::new(), 1000)
                .await
                .is_err()
        );
    }

    /// A source that hands out `buffer` once, whatever is asked for.
    fn source_of(buffer: Buffer) -> BufferSource {
        let kept = std::sync::Mutex::new(Some(buffer));
        Arc::new(move |_, _| kept.lock().unwrap().take())
    }

    /// The first frame of `bytes`, read in pieces of `piece` bytes with slices from `buffers`.
    async fn read_via(
        bytes: Vec<u8>,
        piece: usize,
        buffers: &BufferSource,
    ) -> Result<Option<Frame>, FrameError> {
        let mut r = Trickle {
            bytes,
            at: 0,
            piece,
        };
        read_frame_into(&mut r, &Limits::default(), Some(buffers)).await
    }

    #[tokio::test]
    async fn a_slice_is_read_into_a_buffer_from_the_source() {
        let data = Buffer::F32((0..1000).map(|i| i as f32 - 0.25).collect());
        let bytes = encoded(data.clone()).await;
        let mut reused = Vec::<f32>::with_capacity(1000);
        reused.push(9.0); // left over from the buffer's last use
        let at = reused.as_ptr() as usize;
        let frame = read_via(bytes, 333, &source_of(Buffer::F32(reused))).await;
        let Ok(Some(Frame::Slice(msg))) = frame else {
            panic!("expected a slice frame");
        };
        assert_eq!(*msg.data, data);
        assert_eq!(
            msg.data.f32().as_ptr() as usize,
            at,
            "read into the given buffer"
        );
    }

    #[tokio::test]
    async fn a_source_without_a_fitting_buffer_leaves_the_slice_a_new_one() {
        let data = Buffer::F64((0..500).map(|i| i as f64 / 3.0).collect());
        let bytes = encoded(data.clone()).await;
        // Wrong type, then too short.
        for offered in [
            Buffer::F32(Vec::with_capacity(500)),
            Buffer::F64(Vec::with_capacity(10)),
        ] {
            let frame = read_via(bytes.clone(), 4096, &source_of(offered)).await;
            let Ok(Some(Frame::Slice(msg))) = frame else {
                panic!("expected a slice frame");
            };
            assert_eq!(*msg.data, data);
        }
    }

    #[tokio::test]
    async fn a_payload_cut_short_into_a_reused_buffer_is_truncated() {
        let bytes = encoded(Buffer::F32(vec![1.0; 100])).await;
        let cut = HEADER_LEN + 4 * 37 + 2;
        let buffers = source_of(Buffer::F32(Vec::with_capacity(100)));
        let frame = read_via(bytes[..cut].to_vec(), 7, &buffers).await;
        assert!(
            matches!(frame, Err(FrameError::Truncated { .. })),
            "{frame:?}"
        );
    }
}
