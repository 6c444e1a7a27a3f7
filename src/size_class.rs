//! Size classes: request rounding, pool choice and segment sizing, as pure functions of the
//! configuration (PyTorch's `round_size`, `get_pool`, `get_allocation_size`).
//! May use: `config`.
#![forbid(unsafe_code)]

use crate::config::{
    AllocatorConfig, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};

/// Which block pool a request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolKind {
    /// Rounded requests of at most 1 MiB, packed in 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// PyTorch's name for the pool in stats keys (`small_pool` / `large_pool`).
    pub fn stats_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }

    /// `small` / `large`, as snapshots name segment types.
    pub fn segment_type(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// `roundup_power2_next_division`: rounds `size` up to the next of `divisions` equal steps
/// between the powers of two around it (1200 with 4 divisions → 1280).
pub fn roundup_power2_next_division(size: usize, divisions: usize) -> usize {
    if size.is_power_of_two() {
        return size;
    }
    let floor2 = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let step = floor2 >> divisions.max(1).trailing_zeros();
    if step == 0 {
        // Above 2^(BITS-1) there is no next power of two: saturate (no request is that large).
        return floor2.saturating_mul(2);
    }
    let rounded_floor = size & !(step - 1);
    if rounded_floor == size {
        size
    } else {
        rounded_floor.saturating_add(step)
    }
}

/// `round_size`: the block size a request of `size` bytes gets.
///
/// ```
/// use cuda_caching_allocator::{round_size, AllocatorConfig};
/// let c = AllocatorConfig::pytorch();
/// assert_eq!(round_size(1, &c), 512);
/// assert_eq!(round_size(513, &c), 1024);
/// ```
#[inline]
pub fn round_size(size: usize, config: &AllocatorConfig) -> usize {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = config.divisions_for(size);
    // `512 * divisions` beyond the address space exceeds every size: no division rounding
    // (validation refuses such counts; checked here too, so a rounding never overflows).
    if divisions > 1
        && MIN_BLOCK_SIZE
            .checked_mul(divisions)
            .is_some_and(|limit| size > limit)
    {
        roundup_power2_next_division(size, divisions)
    } else {
        size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
    }
}

/// The pool for a *rounded* size.
pub fn pool_kind(rounded: usize) -> PoolKind {
    if rounded <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// `get_allocation_size`: the segment size a *rounded* request needs when nothing is cached.
pub fn segment_size(rounded: usize, config: &AllocatorConfig) -> usize {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        config.large_segment_size
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

/// The page size of `pool`'s expandable segments: 2 MiB for the small pool; for the large pool
/// `expandable_large_page_size` if set, else `large_segment_size` (PyTorch: 20 MiB).
pub fn expandable_page_size(pool: PoolKind, config: &AllocatorConfig) -> usize {
    match pool {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => config
            .expandable_large_page_size
            .unwrap_or(config.large_segment_size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MIB;

    fn c() -> AllocatorConfig {
        AllocatorConfig::pytorch()
    }

    #[test]
    fn rounding_edges() {
        let rows: &[(usize, usize)] = &[
            (1, 512),
            (511, 512),
            (512, 512),
            (513, 1024),
            (MIB - 1, MIB),
            (MIB, MIB),
            (MIB + 1, MIB + 512),
            (10 * MIB, 10 * MIB),
            (10 * MIB + 1, 10 * MIB + 512),
        ];
        for &(size, want) in rows {
            assert_eq!(round_size(size, &c()), want, "round_size({size})");
        }
    }

    #[test]
    fn pool_and_segment_edges() {
        let rows: &[(usize, PoolKind, usize)] = &[
            (512, PoolKind::Small, 2 * MIB),
            (MIB, PoolKind::Small, 2 * MIB),
            (MIB + 512, PoolKind::Large, 20 * MIB),
            (10 * MIB - 512, PoolKind::Large, 20 * MIB),
            (10 * MIB, PoolKind::Large, 10 * MIB),
            (11 * MIB, PoolKind::Large, 12 * MIB),
            (12 * MIB, PoolKind::Large, 12 * MIB),
            (12 * MIB + 512, PoolKind::Large, 14 * MIB),
        ];
        for &(rounded, pool, seg) in rows {
            assert_eq!(pool_kind(rounded), pool, "pool_kind({rounded})");
            assert_eq!(segment_size(rounded, &c()), seg, "segment_size({rounded})");
        }
        let big = AllocatorConfig {
            large_segment_size: 32 * MIB,
            ..c()
        };
        assert_eq!(segment_size(2 * MIB, &big), 32 * MIB);
    }

    #[test]
    fn power2_divisions() {
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(roundup_power2_next_division(1024, 4), 1024);
        assert_eq!(roundup_power2_next_division(1025, 4), 1280);
        assert_eq!(roundup_power2_next_division(3, 8), 4);
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        // 1200 <= 512*4: plain rounding.
        assert_eq!(round_size(1200, &cfg), 1536);
        // 3 MiB + 1 with 4 divisions: steps of 512 KiB between 2 and 4 MiB.
        assert_eq!(round_size(3 * MIB + 1, &cfg), 3 * MIB + MIB / 2);
        assert_eq!(round_size(2 * MIB, &cfg), 2 * MIB);
        // bucket 0 covers everything under 2 MiB.
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:[1:2,>:0]").unwrap();
        assert_eq!(round_size(MIB + 1, &cfg), MIB + MIB / 2);
        assert_eq!(round_size(3 * MIB + 1, &cfg), 3 * MIB + 512);
    }

    /// Regression (#14): with 2^55 divisions `512 * divisions` overflowed, so every rounding
    /// overflowed (debug) or rounded to the next power of two (release). Validation refuses
    /// such counts now; rounding with one set directly still never overflows.
    #[test]
    fn huge_division_counts_and_sizes_never_overflow() {
        let cfg = AllocatorConfig {
            roundup_power2_divisions: [1 << 55; 16],
            ..c()
        };
        assert_eq!(round_size(1200, &cfg), 1536);
        assert_eq!(round_size(3 * MIB + 1, &cfg), 3 * MIB + 512);
        assert!(cfg.validate().is_err());
        let four = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        for size in [usize::MAX, usize::MAX - 511, (1 << 63) + 1] {
            assert!(round_size(size, &four) >= size.min(usize::MAX - 511));
            assert!(round_size(size, &c()) >= size.min(usize::MAX - 511));
        }
        assert_eq!(roundup_power2_next_division(usize::MAX, 4), usize::MAX);
    }
}
