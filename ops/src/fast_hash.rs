//! A fast hasher for lookup tables keyed by what the code computes itself (the planner's sharing
//! patterns and link-kind matrices, [`crate::memory`]'s buffers): the standard SipHash was a tenth
//! of building AlexNet's cost tables. The keys are not chosen by an adversary, so hash flooding is
//! no concern.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` hashed with [`FastHasher`].
pub type FastHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A `HashSet` hashed with [`FastHasher`].
pub type FastHashSet<K> = HashSet<K, BuildHasherDefault<FastHasher>>;

/// FxHash's mixing (rotate, xor, multiply) over 8-byte words.
#[derive(Default)]
pub struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.add(u64::from_le_bytes(word.try_into().expect("8 bytes")));
        }
        let mut rest = [0u8; 8];
        rest[..words.remainder().len()].copy_from_slice(words.remainder());
        self.add(u64::from_le_bytes(rest));
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // The multiply mixes into the high bits, but hashbrown picks the bucket from the low ones:
        // keys that differ only in a word's high bits (a link's two device numbers, say) probed
        // long chains of one bucket group. Rotating brings the mixed bits down.
        self.0.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_hash_alike_and_lookups_find_them() {
        let mut map: FastHashMap<Vec<u16>, usize> = FastHashMap::default();
        for i in 0..1000u16 {
            map.insert(vec![i, i / 7, 3], usize::from(i));
        }
        assert_eq!(map.len(), 1000);
        assert!((0..1000u16).all(|i| map[&vec![i, i / 7, 3]] == usize::from(i)));
        assert_eq!(map.get(&vec![1, 2, 3]), None);
    }

    #[test]
    fn keys_that_differ_in_high_bits_spread_over_buckets() {
        // (from, to) pairs of a thousand devices: the low bits that pick a bucket must vary
        let mut low: Vec<u64> = (0..64usize)
            .flat_map(|a| (0..64usize).map(move |b| (a << 10, b << 10)))
            .map(|key| {
                let mut h = FastHasher::default();
                std::hash::Hash::hash(&key, &mut h);
                h.finish() & 0xfff
            })
            .collect();
        low.sort_unstable();
        low.dedup();
        assert!(low.len() > 2000, "{} distinct of 4096", low.len());
    }
}
