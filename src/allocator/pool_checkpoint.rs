//! Checkpoints of a private pool's block layout and restoring one: PyTorch's
//! `getCheckpointState` / `setCheckpointPoolState`, with which CUDA graph trees
//! (`torch.compile(mode="reduce-overhead")`) record a new graph after replaying others of the same
//! pool (Note [Pool checkpoints] in `state/checkpoint.rs`). May use: `state`, `snapshot`.
#![forbid(unsafe_code)]

use super::snapshot::{self, BlockState, SegmentSnapshot};
use super::{CachingAllocator, MemPoolId};
use crate::backend::{DeviceAddr, DeviceBackend};
use crate::error::{AllocError, Result};

/// A private pool's layout at one moment: each of its segments with its blocks in address
/// order ([`SegmentSnapshot`]s whose `private_pool` is `pool`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCheckpoint {
    /// The pool.
    pub pool: MemPoolId,
    /// Its segments when the checkpoint was taken.
    pub segments: Vec<SegmentSnapshot>,
}

/// What [`CachingAllocator::restore_pool`] changed, in address order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolRestore {
    /// Allocations of the pool that were live and are now freed (their owners must not free
    /// them again).
    pub freed: Vec<DeviceAddr>,
    /// The checkpoint's allocations, allocated again at their addresses and sizes (free them as
    /// any allocation).
    pub allocated: Vec<DeviceAddr>,
}

impl<B: DeviceBackend> CachingAllocator<B> {
    /// The layout of private pool `pool` now, to restore later with
    /// [`restore_pool`](Self::restore_pool) (PyTorch's `getCheckpointState`).
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] when there is no such private pool.
    pub fn pool_checkpoint(&self, pool: MemPoolId) -> Result<PoolCheckpoint> {
        let guard = self.lock();
        if pool.is_default() || guard.st.graph.slot_of(pool).is_none() {
            return Err(AllocError::InvalidPool {
                pool,
                reason: "no such private pool to checkpoint",
            });
        }
        let segments = snapshot::take(&guard.st)
            .into_iter()
            .filter(|s| s.private_pool == pool)
            .collect();
        Ok(PoolCheckpoint { pool, segments })
    }

    /// Restores private pool `checkpoint.pool` to `checkpoint` (PyTorch's
    /// `setCheckpointPoolState`): frees every allocation of the pool that is live now, cuts each
    /// checkpointed segment into the checkpoint's blocks again, and allocates again those that
    /// were allocated then (Note [Pool checkpoints] in `state/checkpoint.rs`). Segments the pool
    /// gained since the checkpoint stay, free.
    ///
    /// The caller owns what this changes: the pointers in [`PoolRestore::freed`] must not be
    /// freed again, and those in [`PoolRestore::allocated`] are its allocations (of the
    /// checkpoint's block sizes).
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] naming what is wrong — no such pool, a released one, a block
    /// of it with recorded stream uses or pending events, or a checkpointed segment the pool no
    /// longer holds whole — with nothing changed; [`AllocError::Backend`] when the device failed
    /// while freeing.
    pub fn restore_pool(&self, checkpoint: &PoolCheckpoint) -> Result<PoolRestore> {
        let segments: Vec<Vec<(u64, usize, bool)>> = checkpoint
            .segments
            .iter()
            .map(|s| {
                s.blocks
                    .iter()
                    .map(|b| (b.address.0, b.size, b.state == BlockState::ActiveAllocated))
                    .collect()
            })
            .collect();
        let mut guard = self.lock();
        let r = guard
            .st
            .restore_pool(&self.backend, checkpoint.pool, &segments);
        let st = &mut guard.st;
        if let (Some(h), Ok((freed, allocated))) = (&mut st.history, &r) {
            // The history stays a consistent trace: the frees and allocations the restore made.
            for &p in freed {
                h.free(p);
            }
            for &p in allocated {
                if let Some(b) = st.active.get(&p.0).and_then(|&id| st.arena.get(id)) {
                    h.alloc(p, b.requested_size, b.stream);
                }
            }
        }
        self.after_op(&guard.st, "restore_pool");
        let (freed, allocated) = r?;
        Ok(PoolRestore { freed, allocated })
    }
}
