#![no_main]

use legion_cluster::net::frame::{HEADER_LEN, Limits, decode_frame, decode_header, encode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Small limits: the fuzzer should find logic errors, not spend its time allocating.
    let limits = Limits {
        max_slice_bytes: 1 << 16,
        max_control_bytes: 1 << 16,
    };
    if data.len() >= HEADER_LEN {
        let _ = decode_header(&data[..HEADER_LEN], &limits);
    }
    // Whatever decodes must encode back to the same bytes: no field is silently ignored.
    if let Ok(frame) = decode_frame(data, &limits) {
        let again = encode_frame(&frame);
        assert_eq!(again, data, "{frame:?}");
    }
});
