//! The owner map: which thread cache manages a block, by address, in [`SHARDS`] independently
//! locked shards (PyTorch shards its pointer map the same way, in 67 pieces).
//!
//! It is written only when a block starts or stops being managed and read only by operations that
//! miss their own thread's cache (all on the locked path), so the same-thread fast path never
//! touches it. May use: `shared`, `state::AddrMap`.
#![forbid(unsafe_code)]

use std::sync::Arc;

use parking_lot::Mutex;

use super::shared::Shared;
use crate::allocator::state::AddrMap;

/// A managing cache and the block's descriptor in it.
pub(crate) type Owner = (Arc<Shared>, u32);

/// Number of shards (a power of two).
pub(crate) const SHARDS: usize = 64;

/// One shard on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Shard(Mutex<AddrMap<Owner>>);

/// Address → owning thread cache.
#[derive(Debug)]
pub(crate) struct Shards(Box<[Shard]>);

impl Default for Shards {
    fn default() -> Self {
        Shards((0..SHARDS).map(|_| Shard::default()).collect())
    }
}

#[inline]
fn shard_of(ptr: u64) -> usize {
    let h = (ptr >> 9).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> (64 - SHARDS.trailing_zeros())) as usize
}

impl Shards {
    fn shard(&self, ptr: u64) -> &Mutex<AddrMap<Owner>> {
        // `shard_of` is below `SHARDS`, the length of the slice.
        &self.0[shard_of(ptr) % self.0.len()].0
    }

    /// The cache managing `ptr`, if any.
    pub(crate) fn get(&self, ptr: u64) -> Option<Owner> {
        self.shard(ptr).lock().get(&ptr).cloned()
    }

    /// Records that `owner` manages `ptr`.
    pub(crate) fn insert(&self, ptr: u64, owner: &Arc<Shared>, desc: u32) {
        self.shard(ptr)
            .lock()
            .insert(ptr, (Arc::clone(owner), desc));
    }

    /// Forgets `ptr`.
    pub(crate) fn remove(&self, ptr: u64) {
        self.shard(ptr).lock().remove(&ptr);
    }

    /// Every `(address, owner)` pair (for the invariant checker).
    pub(crate) fn all(&self) -> Vec<(u64, Owner)> {
        let mut v = Vec::new();
        for s in self.0.iter() {
            v.extend(
                s.0.lock()
                    .iter()
                    .map(|(&p, (c, d))| (p, (Arc::clone(c), *d))),
            );
        }
        v
    }

    /// Forgets everything (allocator drop).
    pub(crate) fn clear(&self) {
        for s in self.0.iter() {
            s.0.lock().clear();
        }
    }
}
