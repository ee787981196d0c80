//! Deterministic, counter-based random numbers.
//!
//! Everything random in legion-rs (initialisation, dropout masks, synthetic data, random strategies)
//! is a pure function of a seed and a position, so any partition of the work draws the same numbers.

/// SplitMix64's finaliser: a bijective 64-bit mix with good avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hash of several words, order-sensitive.
pub fn hash(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x6A09_E667_F3BC_C909, |h, &w| mix64(h ^ w))
}

/// Uniform in [0, 1) from the top 24 bits of `h` (exactly representable in f32).
pub fn unit_f32(h: u64) -> f32 {
    (h >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// A sequential generator for places where position-independence is not needed.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: mix64(seed) }
    }

    /// A generator that continues from `state`, another's [`Rng::state`]: its words are
    /// `mix64(state + k·γ)` for k = 1, 2, …, each computable on its own (a GPU draws a sample's
    /// pixel noise that way, one word per thread).
    pub fn at_state(state: u64) -> Rng {
        Rng { state }
    }

    /// Where this generator is: [`Rng::at_state`] continues from here.
    pub fn state(&self) -> u64 {
        self.state
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        unit_f32(self.next_u64())
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.unit() as f64).max(1e-12);
        let u2 = self.unit() as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 11) as u128 * n as u128) >> 53) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_in_range_and_spread() {
        let mut r = Rng::new(7);
        let xs: Vec<f32> = (0..10_000).map(|_| r.unit()).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        assert!((0..1000).all(|_| r.below(3) < 3));
    }

    #[test]
    fn hash_is_order_sensitive() {
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_eq!(hash(&[1, 2]), hash(&[1, 2]));
    }
}
