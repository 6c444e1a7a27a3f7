//! Restoring a private pool to a checkpoint of its block layout: PyTorch's
//! `setCheckpointPoolState`, which CUDA graph trees (`torch.compile(mode="reduce-overhead")`)
//! call before recording a new graph after replaying others. May use: `state`, `block`.
//!
//! Note [Pool checkpoints]: a replay allocates nothing, so after graphs of a pool were replayed
//! the cache's books no longer say which of the pool's blocks hold live tensors. A checkpoint
//! taken right after a recording is the pool's layout then: each segment's blocks, in address
//! order, with their sizes and whether they were allocated. Restoring it (PyTorch's order, step
//! for step):
//! 1. every block of the pool still allocated is freed (its address is reported freed: the
//!    caller drops the tensors that pointed there without freeing them again);
//! 2. each checkpointed segment, now one free block, is cut again into the checkpoint's blocks
//!    by allocating them in address order at their exact sizes (a split wherever the
//!    checkpoint's block is smaller than what is left);
//! 3. the blocks that were free at the checkpoint are freed again (merging), and the ones that
//!    were allocated stay allocated and are reported created: the caller hands them to the live
//!    tensors whose memory they are.
//!
//! Everything is checked before anything changes: the pool exists and is in use, no block of it
//! waits on stream events or has recorded stream uses, and each checkpointed segment is a segment
//! of the pool whose size is its blocks' sum. An error leaves the cache as it was.

use super::State;
use crate::backend::{DeviceAddr, DeviceBackend};
use crate::error::{AllocError, Result};

/// One block of a checkpointed segment: where it starts, its size, and whether it was allocated.
pub(crate) type CheckpointBlock = (u64, usize, bool);

impl State {
    /// Restores the private pool `slot` to `segments` (Note [Pool checkpoints]). Returns the
    /// addresses freed (step 1) and the addresses allocated again (step 3), in address order.
    pub(crate) fn restore_pool<B: DeviceBackend>(
        &mut self,
        dev: &B,
        pool: crate::MemPoolId,
        segments: &[Vec<CheckpointBlock>],
    ) -> Result<(Vec<DeviceAddr>, Vec<DeviceAddr>)> {
        let bad = |reason: &'static str| AllocError::InvalidPool { pool, reason };
        let slot = self
            .graph
            .slot_of(pool)
            .ok_or(bad("no such private pool to restore"))?;
        if self.graph.use_count(pool) == Some(0) {
            return Err(bad("a released pool cannot be restored to a checkpoint"));
        }
        let mut live: Vec<u64> = Vec::new();
        for (_, b) in self.arena.iter().filter(|(_, b)| b.owner == slot) {
            if b.event_count > 0 || !b.stream_uses.is_empty() {
                return Err(bad(
                    "a block of the pool has recorded stream uses or pending events (restore a \
                     checkpoint once the pool's work is done)",
                ));
            }
            if b.allocated {
                live.push(b.ptr);
            }
        }
        let mut bases: Vec<u64> = Vec::with_capacity(segments.len());
        for seg in segments {
            let Some(&(base, _, _)) = seg.first() else {
                return Err(bad("a checkpointed segment has no blocks"));
            };
            // Listed twice, a segment passed each check alone and failed only in step 2, after
            // step 1 had freed the pool's live blocks (an adversarial review's doctored
            // checkpoint).
            if bases.contains(&base) {
                return Err(bad("a checkpointed segment is listed twice"));
            }
            bases.push(base);
            let rec = self
                .segments
                .get(&base)
                .filter(|r| r.owner == slot && !r.expandable)
                .ok_or(bad(
                    "a checkpointed segment is not a segment of the pool any more",
                ))?;
            let mut at = base;
            for &(ptr, size, _) in seg {
                if ptr != at || size == 0 {
                    return Err(bad("a checkpointed segment's blocks are not contiguous"));
                }
                at = u64::try_from(size)
                    .ok()
                    .and_then(|s| at.checked_add(s))
                    .ok_or(bad(
                        "a checkpointed block's size runs past the address space",
                    ))?;
            }
            if at - base != rec.size as u64 {
                return Err(bad(
                    "a checkpointed segment's blocks do not cover the segment",
                ));
            }
        }
        live.sort_unstable();
        // Step 1.
        for &p in &live {
            self.free(dev, DeviceAddr(p))?;
        }
        // Steps 2 and 3.
        let mut created = Vec::new();
        for seg in segments {
            let mut cur = self.active_or_free_at(seg[0].0);
            let mut cut = Vec::with_capacity(seg.len());
            for &(ptr, size, _) in seg {
                let Some(id) = cur else {
                    return Err(bad("a checkpointed block is missing after the frees"));
                };
                let b = self.block(id);
                if b.allocated || b.ptr != ptr || b.size < size {
                    return Err(bad(
                        "a checkpointed segment did not merge into one free block",
                    ));
                }
                let split = b.size > size;
                self.uncache_free_block(id);
                let a = self.alloc_found_block(id, size, size, split);
                cut.push(a.ptr);
                cur = self.active.get(&a.ptr.0).and_then(|&i| self.block(i).next);
            }
            for (&p, &(_, _, allocated)) in cut.iter().zip(seg) {
                if allocated {
                    created.push(p);
                } else {
                    self.free(dev, p)?;
                }
            }
        }
        created.sort_unstable();
        Ok((live.into_iter().map(DeviceAddr).collect(), created))
    }

    /// The block starting at `ptr` among all blocks (allocated or free).
    fn active_or_free_at(&self, ptr: u64) -> Option<crate::allocator::block::BlockId> {
        if let Some(&id) = self.active.get(&ptr) {
            return Some(id);
        }
        self.arena
            .iter()
            .find(|(_, b)| b.ptr == ptr && b.mapped)
            .map(|(id, _)| id)
    }
}
