#![no_main]

use legion_cluster::fuzzing::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Control messages arrive from peers as rkyv archives: validation must refuse anything that
    // is not one, and whatever it accepts must survive a round trip unchanged. Compared as
    // encodings, since a float field may hold NaN, which is not equal to itself.
    if let Ok(message) = decode(data) {
        let bytes = encode(&message);
        let again = decode(&bytes).expect("an encoded message decodes");
        assert_eq!(encode(&again), bytes, "{message:?}");
    }
});
