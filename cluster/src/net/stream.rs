//! Frames over a byte stream (a QUIC uni-stream, or TCP in the benchmark): the only code between
//! the pure [`frame`](super::frame) functions and a socket.

use super::frame::Frame;
use super::frame::{
    FrameError, FrameHeader, HEADER_LEN, Limits, Payload, decode_header, encode_header,
    payload_bytes, payload_bytes_shared,
};
use bytes::Bytes;
use legion_runtime::transport::SliceMessage;
use std::io::ErrorKind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

/// Reads the next frame, or `None` at a clean end of stream (before any header byte). The payload
/// is read straight into its final vector.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
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
    let mut payload = Payload::for_header(&header);
    let want = header.payload_len();
    let got = read_full(r, payload.bytes_mut()).await?;
    if got < want {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN + want,
            got: HEADER_LEN + got,
        });
    }
    Ok(Some(payload.into_frame()))
}

/// Reads exactly one frame and requires the stream to end right after it (one frame per stream).
pub async fn read_single_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Frame, FrameError> {
    let frame = read_frame(r, limits).await?.ok_or(FrameError::Truncated {
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
