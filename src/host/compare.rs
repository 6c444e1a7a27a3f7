//! A mixed-size pinned workload and a model of PyTorch's `CachingHostAllocator` policy (round
//! to a power of two, never split, reuse a cached block of the same rounded size), so the
//! cache's pinned bytes can be compared with PyTorch's on the same requests (tests, and
//! `examples/pinned_bench.rs` on a GPU). Deterministic: a fixed-seed generator, no clocks.
//! May use: nothing.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// One step of a pinned workload: allocate `size` bytes as slot `slot` (freeing what the slot
/// held), or free a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostOp {
    /// Allocate `size` bytes into `slot`.
    Alloc {
        /// Which live slot receives the block.
        slot: usize,
        /// Bytes asked for.
        size: usize,
    },
    /// Free the block in `slot`.
    Free {
        /// The slot to free.
        slot: usize,
    },
}

/// A deterministic mixed-size workload of `steps` operations over `slots` live slots: sizes
/// log-uniform between 4 KiB and `max_size`, not powers of two (staging buffers of tensors
/// of arbitrary shapes). Every slot is freed at the end.
pub fn mixed_workload(seed: u64, steps: usize, slots: usize, max_size: usize) -> Vec<HostOp> {
    let mut x = seed | 1;
    let mut next = move || {
        // xorshift64*: fixed, portable, good enough for sizes.
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let slots = slots.max(1);
    let lo = 12u32;
    let hi = max_size.max(8192).ilog2().max(lo + 1);
    let mut live = vec![false; slots];
    let mut ops = Vec::with_capacity(steps + slots);
    for _ in 0..steps {
        let r = next();
        let slot = (r % slots as u64) as usize;
        if live.get(slot).copied().unwrap_or(false) && r & (1 << 40) != 0 {
            ops.push(HostOp::Free { slot });
            if let Some(l) = live.get_mut(slot) {
                *l = false;
            }
            continue;
        }
        let bits = lo + (next() % u64::from(hi - lo)) as u32;
        let base = 1usize << bits;
        let size = (base + (next() as usize % base)).min(max_size.max(4096));
        ops.push(HostOp::Alloc { slot, size });
        if let Some(l) = live.get_mut(slot) {
            *l = true;
        }
    }
    for (slot, l) in live.into_iter().enumerate() {
        if l {
            ops.push(HostOp::Free { slot });
        }
    }
    ops
}

/// A model of PyTorch's `CachingHostAllocator` policy: each request rounds up to a power of
/// two and gets a cached free block of exactly that size, or a new one; blocks are never split
/// and never released. Tracks pinned bytes.
#[derive(Clone, Debug, Default)]
pub struct PowerOfTwoModel {
    free: BTreeMap<usize, usize>,
    /// Bytes pinned (every block ever created).
    pub pinned: usize,
    /// Blocks pinned (each a `cuMemHostAlloc` in PyTorch).
    pub pins: usize,
}

impl PowerOfTwoModel {
    /// Allocates `size` bytes; returns the rounded size (the caller passes it to `free`).
    pub fn alloc(&mut self, size: usize) -> usize {
        let rounded = size
            .max(1)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX);
        match self.free.get_mut(&rounded) {
            Some(n) if *n > 0 => *n -= 1,
            _ => {
                self.pinned = self.pinned.saturating_add(rounded);
                self.pins += 1;
            }
        }
        rounded
    }

    /// Returns a block of rounded size `rounded` to the cache.
    pub fn free(&mut self, rounded: usize) {
        *self.free.entry(rounded).or_insert(0) += 1;
    }
}
