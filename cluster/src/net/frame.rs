//! The wire format of one frame (a region slice or a control message), and its validation.
//!
//! A frame is a fixed [`HEADER_LEN`]-byte rkyv-archived [`WireHeader`] followed by the payload: for a
//! slice, the elements as raw little-endian bytes; for a control message, opaque bytes. Since
//! `HEADER_LEN` is a multiple of 16, a payload read right after the header into an aligned buffer
//! stays aligned.
//!
//! Everything here is pure and handles untrusted bytes: every function returns a [`FrameError`]
//! rather than panicking, and no allocation is sized by the peer beyond [`Limits`].

use bytemuck::{cast_slice, cast_slice_mut};
use bytes::Bytes;
use legion_runtime::Buffer;
use legion_runtime::SliceMessage;
use legion_runtime::region::DType;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use std::borrow::Cow;
use std::sync::Arc;

/// "LGRS", little-endian: rejects a peer speaking something else before any length is trusted.
pub const MAGIC: u32 = u32::from_le_bytes(*b"LGRS");
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 48;

const KIND_SLICE: u8 = 1;
const KIND_CONTROL: u8 = 2;
const DTYPE_NONE: u8 = 0;
const DTYPE_F32: u8 = 1;
const DTYPE_F64: u8 = 2;
/// bf16 bits (little-endian u16): a bf16 run's activations and their gradients.
const DTYPE_BF16: u8 = 3;

/// The header as it is archived. Only fixed-size fields, so the archive has a fixed length and the
/// receiver can read exactly `HEADER_LEN` bytes before trusting anything.
#[derive(rkyv::Archive, rkyv::Serialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireHeader {
    pub magic: u32,
    pub version: u16,
    pub kind: u8,
    pub dtype: u8,
    pub copy: u32,
    /// Zero in version 1; non-zero is rejected so that a later version can give it a meaning.
    pub reserved: u32,
    pub step: u64,
    pub to: u64,
    pub elements: u64,
    /// Redundant with `elements × dtype size`: a cheap consistency check on a corrupted header.
    pub payload_bytes: u64,
}

const _: () = assert!(size_of::<ArchivedWireHeader>() == HEADER_LEN);
const _: () = assert!(HEADER_LEN.is_multiple_of(16));

/// What a validated header announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameHeader {
    Slice {
        step: u64,
        copy: u32,
        to: usize,
        dtype: DType,
        elements: usize,
    },
    Control {
        bytes: usize,
    },
}

impl FrameHeader {
    pub fn slice(msg: &SliceMessage) -> FrameHeader {
        FrameHeader::Slice {
            step: msg.step,
            copy: msg.copy,
            to: msg.to,
            dtype: msg.data.dtype(),
            elements: msg.data.len(),
        }
    }

    /// Bytes that follow the header.
    pub fn payload_len(&self) -> usize {
        match *self {
            FrameHeader::Slice {
                dtype, elements, ..
            } => elements * dtype.size(),
            FrameHeader::Control { bytes } => bytes,
        }
    }
}

/// A decoded frame.
#[derive(Debug)]
pub enum Frame {
    Slice(SliceMessage),
    Control(Vec<u8>),
}

/// Bounds on what a peer may make this process allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_slice_bytes: u64,
    pub max_control_bytes: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            // The largest region slice of the model zoo at batch 256 is well below this.
            max_slice_bytes: 1 << 30,
            // Control messages carry a step's input batch and the initial weights of a device.
            // Only peers with a cluster-signed certificate get this far, so the bound guards
            // against bugs more than against strangers.
            max_control_bytes: 1 << 30,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame header is not a valid archive: {0}")]
    Archive(String),
    #[error("bad magic {0:#010x} (not a legion-rs peer)")]
    BadMagic(u32),
    #[error("unsupported frame version {0} (this build speaks {VERSION})")]
    Version(u16),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("unknown element type {0}")]
    DType(u8),
    #[error("reserved header field is {0}, expected 0")]
    Reserved(u32),
    #[error("control frame with slice fields set")]
    ControlFields,
    #[error("destination device {0} does not fit this platform")]
    Device(u64),
    #[error("header announces {elements} elements but {payload_bytes} payload bytes")]
    LengthMismatch { elements: u64, payload_bytes: u64 },
    #[error("payload of {bytes} bytes exceeds the limit of {max}")]
    TooLarge { bytes: u64, max: u64 },
    #[error("frame truncated: expected {expected} bytes, got {got}")]
    Truncated { expected: usize, got: usize },
    #[error("{0} unexpected bytes after the frame")]
    Trailing(usize),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The archived header of a frame.
pub fn encode_header(header: &FrameHeader) -> [u8; HEADER_LEN] {
    let wire = match *header {
        FrameHeader::Slice {
            step,
            copy,
            to,
            dtype,
            elements,
        } => WireHeader {
            magic: MAGIC,
            version: VERSION,
            kind: KIND_SLICE,
            dtype: match dtype {
                DType::F32 => DTYPE_F32,
                DType::F64 => DTYPE_F64,
                DType::Bf16 => DTYPE_BF16,
            },
            copy,
            reserved: 0,
            step,
            to: to as u64,
            elements: elements as u64,
            payload_bytes: header.payload_len() as u64,
        },
        FrameHeader::Control { bytes } => WireHeader {
            magic: MAGIC,
            version: VERSION,
            kind: KIND_CONTROL,
            dtype: DTYPE_NONE,
            copy: 0,
            reserved: 0,
            step: 0,
            to: 0,
            elements: bytes as u64,
            payload_bytes: bytes as u64,
        },
    };
    let bytes = rkyv::to_bytes::<rancor::Error>(&wire).expect("a plain struct always serialises");
    let mut out = [0u8; HEADER_LEN];
    out.copy_from_slice(&bytes);
    out
}

/// Validates an archived header (first the archive itself, then every field) against `limits`.
pub fn decode_header(bytes: &[u8], limits: &Limits) -> Result<FrameHeader, FrameError> {
    if bytes.len() != HEADER_LEN {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN,
            got: bytes.len(),
        });
    }
    // The bytes come from a socket buffer with no alignment guarantee; rkyv needs 16.
    let mut aligned = AlignedVec::<16>::with_capacity(HEADER_LEN);
    aligned.extend_from_slice(bytes);
    let h = rkyv::access::<ArchivedWireHeader, rancor::Error>(&aligned)
        .map_err(|e| FrameError::Archive(e.to_string()))?;
    let magic = h.magic.to_native();
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = h.version.to_native();
    if version != VERSION {
        return Err(FrameError::Version(version));
    }
    let reserved = h.reserved.to_native();
    if reserved != 0 {
        return Err(FrameError::Reserved(reserved));
    }
    let elements = h.elements.to_native();
    let payload_bytes = h.payload_bytes.to_native();
    let mismatch = || FrameError::LengthMismatch {
        elements,
        payload_bytes,
    };
    match h.kind {
        KIND_SLICE => {
            let dtype = match h.dtype {
                DTYPE_F32 => DType::F32,
                DTYPE_F64 => DType::F64,
                DTYPE_BF16 => DType::Bf16,
                other => return Err(FrameError::DType(other)),
            };
            if elements.checked_mul(dtype.size() as u64) != Some(payload_bytes) {
                return Err(mismatch());
            }
            check_size(payload_bytes, limits.max_slice_bytes)?;
            let to = h.to.to_native();
            Ok(FrameHeader::Slice {
                step: h.step.to_native(),
                copy: h.copy.to_native(),
                to: usize::try_from(to).map_err(|_| FrameError::Device(to))?,
                dtype,
                elements: to_usize(elements)?,
            })
        }
        KIND_CONTROL => {
            if h.dtype != DTYPE_NONE {
                return Err(FrameError::DType(h.dtype));
            }
            if elements != payload_bytes {
                return Err(mismatch());
            }
            // Zero, so that every accepted header has exactly one encoding.
            if h.step.to_native() != 0 || h.copy.to_native() != 0 || h.to.to_native() != 0 {
                return Err(FrameError::ControlFields);
            }
            check_size(payload_bytes, limits.max_control_bytes)?;
            Ok(FrameHeader::Control {
                bytes: to_usize(payload_bytes)?,
            })
        }
        other => Err(FrameError::Kind(other)),
    }
}

fn check_size(bytes: u64, max: u64) -> Result<(), FrameError> {
    if bytes > max {
        Err(FrameError::TooLarge { bytes, max })
    } else {
        Ok(())
    }
}

fn to_usize(n: u64) -> Result<usize, FrameError> {
    usize::try_from(n).map_err(|_| FrameError::TooLarge {
        bytes: n,
        max: usize::MAX as u64,
    })
}

/// Where a frame's payload is received: already the final typed vector, so the bytes land in place
/// (no copy, and f32/f64 alignment comes from the vector itself).
#[derive(Debug)]
pub enum Payload {
    Slice {
        step: u64,
        copy: u32,
        to: usize,
        data: Buffer,
    },
    Control(Vec<u8>),
}

impl Payload {
    /// A zeroed payload of the size `header` announces (bounded by the `Limits` it was decoded with).
    pub fn for_header(header: &FrameHeader) -> Payload {
        match *header {
            FrameHeader::Slice {
                step,
                copy,
                to,
                dtype,
                elements,
            } => Payload::Slice {
                step,
                copy,
                to,
                data: Buffer::zeros(dtype, elements),
            },
            FrameHeader::Control { bytes } => Payload::Control(vec![0; bytes]),
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Payload::Slice {
                data: Buffer::F32(v),
                ..
            } => cast_slice_mut(v),
            Payload::Slice {
                data: Buffer::F64(v),
                ..
            } => cast_slice_mut(v),
            Payload::Slice {
                data: Buffer::Bf16(v),
                ..
            } => cast_slice_mut(v),
            Payload::Control(v) => v,
        }
    }

    /// The frame, once the payload bytes are filled in.
    pub fn into_frame(self) -> Frame {
        match self {
            Payload::Slice {
                step,
                copy,
                to,
                mut data,
            } => {
                from_le_in_place(&mut data);
                Frame::Slice(SliceMessage {
                    step,
                    copy,
                    to,
                    data: std::sync::Arc::new(data),
                })
            }
            Payload::Control(bytes) => Frame::Control(bytes),
        }
    }
}

#[cfg(target_endian = "little")]
fn from_le_in_place(_: &mut Buffer) {}

#[cfg(target_endian = "big")]
fn from_le_in_place(data: &mut Buffer) {
    match data {
        Buffer::F32(v) => v
            .iter_mut()
            .for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits()))),
        Buffer::F64(v) => v
            .iter_mut()
            .for_each(|x| *x = f64::from_bits(u64::from_le(x.to_bits()))),
        Buffer::Bf16(v) => v.iter_mut().for_each(|x| *x = u16::from_le(*x)),
    }
}

/// A slice's elements as little-endian bytes (borrowed on little-endian hosts).
pub fn payload_bytes(data: &Buffer) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        match data {
            Buffer::F32(v) => Cow::Borrowed(cast_slice(v)),
            Buffer::F64(v) => Cow::Borrowed(cast_slice(v)),
            Buffer::Bf16(v) => Cow::Borrowed(cast_slice(v)),
        }
    } else {
        match data {
            Buffer::F32(v) => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Buffer::F64(v) => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Buffer::Bf16(v) => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }
}

/// A slice's elements as little-endian bytes that keep the buffer alive instead of copying it (on
/// little-endian hosts), for a transport that queues the payload past the caller's borrow.
pub fn payload_bytes_shared(data: &Arc<Buffer>) -> Bytes {
    /// The byte view of a shared buffer, so `Bytes` can own it.
    struct SharedPayload(Arc<Buffer>);
    impl AsRef<[u8]> for SharedPayload {
        fn as_ref(&self) -> &[u8] {
            match &*self.0 {
                Buffer::F32(v) => cast_slice(v),
                Buffer::F64(v) => cast_slice(v),
                Buffer::Bf16(v) => cast_slice(v),
            }
        }
    }
    if cfg!(target_endian = "little") {
        Bytes::from_owner(SharedPayload(data.clone()))
    } else {
        Bytes::from(payload_bytes(data).into_owned())
    }
}

/// A whole frame in one buffer (tests, the fuzzer and small control messages).
pub fn encode_frame(frame: &Frame) -> Vec<u8> {
    let (header, payload) = match frame {
        Frame::Slice(msg) => (FrameHeader::slice(msg), payload_bytes(&msg.data)),
        Frame::Control(bytes) => (
            FrameHeader::Control { bytes: bytes.len() },
            Cow::Borrowed(&bytes[..]),
        ),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&encode_header(&header));
    out.extend_from_slice(&payload);
    out
}

/// Decodes exactly one frame from `bytes`; anything short, long or inconsistent is an error.
pub fn decode_frame(bytes: &[u8], limits: &Limits) -> Result<Frame, FrameError> {
    let Some((head, rest)) = bytes.split_at_checked(HEADER_LEN) else {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN,
            got: bytes.len(),
        });
    };
    let header = decode_header(head, limits)?;
    let expected = header.payload_len();
    if rest.len() < expected {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN + expected,
            got: bytes.len(),
        });
    }
    if rest.len() > expected {
        return Err(FrameError::Trailing(rest.len() - expected));
    }
    let mut payload = Payload::for_header(&header);
    payload.bytes_mut().copy_from_slice(rest);
    Ok(payload.into_frame())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn slice(step: u64, copy: u32, to: usize, data: Buffer) -> Frame {
        Frame::Slice(SliceMessage {
            step,
            copy,
            to,
            data: data.into(),
        })
    }

    fn sample() -> Vec<u8> {
        encode_frame(&slice(3, 17, 2, Buffer::F32(vec![1.0, -2.5, 3.25])))
    }

    /// Rewrites one header field of a valid frame, keeping the archive well-formed.
    fn with_header(edit: impl FnOnce(&mut WireHeader)) -> Vec<u8> {
        let mut bytes = sample();
        let mut aligned = AlignedVec::<16>::new();
        aligned.extend_from_slice(&bytes[..HEADER_LEN]);
        let h = rkyv::access::<ArchivedWireHeader, rancor::Error>(&aligned).unwrap();
        let mut wire = WireHeader {
            magic: h.magic.to_native(),
            version: h.version.to_native(),
            kind: h.kind,
            dtype: h.dtype,
            copy: h.copy.to_native(),
            reserved: h.reserved.to_native(),
            step: h.step.to_native(),
            to: h.to.to_native(),
            elements: h.elements.to_native(),
            payload_bytes: h.payload_bytes.to_native(),
        };
        edit(&mut wire);
        let head = rkyv::to_bytes::<rancor::Error>(&wire).unwrap();
        bytes[..HEADER_LEN].copy_from_slice(&head);
        bytes
    }

    #[test]
    fn round_trips_both_dtypes_and_control() {
        let limits = Limits::default();
        for frame in [
            slice(0, 0, 0, Buffer::F32(vec![])),
            slice(
                u64::MAX,
                u32::MAX,
                5,
                Buffer::F32(vec![f32::NAN, -0.0, 1e30]),
            ),
            slice(
                9,
                4,
                1,
                Buffer::F64((0..1000).map(|i| i as f64 / 7.0).collect()),
            ),
            Frame::Control(b"hello".to_vec()),
            Frame::Control(vec![]),
        ] {
            let bytes = encode_frame(&frame);
            let back = decode_frame(&bytes, &limits).unwrap();
            // NaN != NaN: compare the bits.
            assert_eq!(format!("{back:?}"), format!("{frame:?}"));
        }
    }

    #[test]
    fn header_fields_are_validated() {
        let limits = Limits::default();
        let err = |bytes: Vec<u8>| decode_frame(&bytes, &limits).unwrap_err();
        assert!(matches!(
            err(with_header(|h| h.magic = 1)),
            FrameError::BadMagic(1)
        ));
        assert!(matches!(
            err(with_header(|h| h.version = 2)),
            FrameError::Version(2)
        ));
        assert!(matches!(
            err(with_header(|h| h.kind = 9)),
            FrameError::Kind(9)
        ));
        assert!(matches!(
            err(with_header(|h| h.dtype = 4)),
            FrameError::DType(4)
        ));
        assert!(matches!(
            err(with_header(|h| h.reserved = 1)),
            FrameError::Reserved(1)
        ));
        assert!(matches!(
            err(with_header(|h| h.payload_bytes = 8)),
            FrameError::LengthMismatch { .. }
        ));
        assert!(matches!(
            err(with_header(|h| {
                h.elements = u64::MAX / 2;
                h.payload_bytes = h.elements.wrapping_mul(4);
            })),
            FrameError::LengthMismatch { .. }
        ));
        // A huge but consistent announcement is refused before anything is allocated.
        assert!(matches!(
            err(with_header(|h| {
                h.elements = 1 << 40;
                h.payload_bytes = 4 << 40;
            })),
            FrameError::TooLarge { .. }
        ));
        // f64 payload announced where the bytes hold 3 f32: the lengths no longer add up.
        assert!(matches!(
            err(with_header(|h| {
                h.dtype = DTYPE_F64;
                h.payload_bytes = 24;
            })),
            FrameError::Truncated { .. }
        ));
        let control = |h: &mut WireHeader| {
            h.kind = KIND_CONTROL;
            h.dtype = DTYPE_NONE;
            h.elements = 12;
        };
        assert!(matches!(
            err(with_header(control)),
            FrameError::ControlFields
        ));
        let bytes = with_header(|h| {
            control(h);
            (h.step, h.copy, h.to) = (0, 0, 0);
        });
        assert!(matches!(decode_frame(&bytes, &limits), Ok(Frame::Control(b)) if b.len() == 12));
        let mut long = sample();
        long.push(0);
        assert!(matches!(err(long), FrameError::Trailing(1)));
        let small = Limits {
            max_slice_bytes: 8,
            ..Limits::default()
        };
        assert!(matches!(
            decode_frame(&sample(), &small),
            Err(FrameError::TooLarge { bytes: 12, max: 8 })
        ));
    }

    proptest! {
        #[test]
        fn any_slice_round_trips(
            step in any::<u64>(),
            copy in any::<u32>(),
            to in 0usize..1 << 20,
            f32s in proptest::collection::vec(any::<f32>(), 0..300),
            f64s in proptest::collection::vec(any::<f64>(), 0..300),
        ) {
            for frame in [
                slice(step, copy, to, Buffer::F32(f32s.clone())),
                slice(step, copy, to, Buffer::F64(f64s.clone())),
            ] {
                let back = decode_frame(&encode_frame(&frame), &Limits::default()).unwrap();
                prop_assert_eq!(format!("{back:?}"), format!("{frame:?}"));
            }
        }

        #[test]
        fn random_bytes_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            // Whatever decodes encodes back to the same bytes: no field is silently ignored.
            if let Ok(frame) = decode_frame(&bytes, &Limits::default()) {
                prop_assert_eq!(&encode_frame(&frame), &bytes);
            }
            if bytes.len() >= HEADER_LEN {
                let _ = decode_header(&bytes[..HEADER_LEN], &Limits::default());
            }
        }

        #[test]
        fn truncated_frames_are_errors(cut in 0usize..60) {
            let bytes = sample();
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(decode_frame(&bytes[..cut], &Limits::default()).is_err());
        }

        #[test]
        fn garbled_frames_never_panic(
            flips in proptest::collection::vec((0usize..60, any::<u8>()), 1..8),
        ) {
            let mut bytes = sample();
            for (at, x) in flips {
                let at = at % bytes.len();
                bytes[at] ^= x;
            }
            if let Ok(frame) = decode_frame(&bytes, &Limits::default()) {
                prop_assert_eq!(&encode_frame(&frame), &bytes);
            }
        }
    }
}
