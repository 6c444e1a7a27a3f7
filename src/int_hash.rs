//! A fast hasher for integer keys (device addresses, trace ids, pickle memo slots): one
//! multiply-shift instead of SipHash. Keys are not attacker-chosen in a way that matters here:
//! a trace file can at worst make its own import slower, which the import's size bounds cap.
//!
//! May use: nothing internal.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-shift hasher for integer keys (device addresses are 512-byte aligned, so their low
/// bits carry nothing: the shift folds the high bits in).
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(23);
    }
}

/// A `HashMap` keyed by `u64` with [`IntHasher`].
pub(crate) type IntMap<V> = HashMap<u64, V, BuildHasherDefault<IntHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_addresses_spread_over_the_low_bits() {
        let buckets: std::collections::HashSet<u64> = (0..64u64)
            .map(|i| {
                let mut h = IntHasher::default();
                h.write_u64(0x7f00_0000_0000 + i * 512);
                h.finish() & 63
            })
            .collect();
        assert!(buckets.len() > 32, "{} of 64 buckets", buckets.len());
    }
}
