//! Segment snapshots: the cache's segments and their blocks in address order, in the shape of
//! PyTorch's `memory_snapshot()` (used by summaries, exports and tests). May use: `state`, `block`.
#![forbid(unsafe_code)]

use super::block::BlockId;
use super::state::State;
use crate::backend::{DevicePtr, StreamId};
use crate::size_class::PoolKind;

/// The state of a block, with PyTorch's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out (`active_allocated`).
    ActiveAllocated,
    /// Freed, waiting for stream events (`active_pending_free`).
    ActivePendingFree,
    /// Free and cached (`inactive`).
    Inactive,
    /// Reserved address space without physical pages (expandable segments only).
    Unmapped,
}

impl BlockState {
    /// PyTorch's string for the state.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
            BlockState::Unmapped => "unmapped",
        }
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Start address.
    pub address: DevicePtr,
    /// Size in bytes.
    pub size: usize,
    /// The requested size while allocated (0 otherwise).
    pub requested_size: usize,
    /// Allocated, pending or free.
    pub state: BlockState,
}

/// One device segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Base address.
    pub address: DevicePtr,
    /// Size in bytes.
    pub total_size: usize,
    /// The stream it serves.
    pub stream: StreamId,
    /// Small or large pool.
    pub pool: PoolKind,
    /// Whether it is an expandable (virtual-memory) segment.
    pub is_expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    /// Bytes of allocated blocks.
    pub fn allocated_size(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum()
    }

    /// Bytes of allocated and pending blocks.
    pub fn active_size(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| {
                matches!(
                    b.state,
                    BlockState::ActiveAllocated | BlockState::ActivePendingFree
                )
            })
            .map(|b| b.size)
            .sum()
    }

    /// Requested bytes of active blocks.
    pub fn requested_size(&self) -> usize {
        self.blocks.iter().map(|b| b.requested_size).sum()
    }
}

/// Walks every segment from its head block.
pub(crate) fn take(st: &State) -> Vec<SegmentSnapshot> {
    let mut heads: Vec<(u64, BlockId)> = st
        .arena
        .iter()
        .filter(|(_, b)| b.prev.is_none())
        .map(|(id, b)| (b.ptr, id))
        .collect();
    heads.sort_unstable();
    let mut out = Vec::with_capacity(heads.len());
    for (base, head) in heads {
        let mut blocks = Vec::new();
        let mut cur = Some(head);
        let (mut stream, mut pool, mut expandable) = (StreamId::DEFAULT, PoolKind::Small, false);
        while let Some(id) = cur {
            let Some(b) = st.arena.get(id) else { break };
            stream = b.stream;
            pool = b.pool;
            expandable |= b.expandable;
            let state = if b.allocated {
                BlockState::ActiveAllocated
            } else if b.event_count > 0 {
                BlockState::ActivePendingFree
            } else if !b.mapped {
                BlockState::Unmapped
            } else {
                BlockState::Inactive
            };
            let requested_size =
                if state == BlockState::ActiveAllocated || state == BlockState::ActivePendingFree {
                    b.requested_size
                } else {
                    0
                };
            blocks.push(BlockSnapshot {
                address: DevicePtr(b.ptr),
                size: b.size,
                requested_size,
                state,
            });
            cur = b.next;
        }
        let total_size = blocks.iter().map(|b| b.size).sum();
        out.push(SegmentSnapshot {
            address: DevicePtr(base),
            total_size,
            stream,
            pool,
            is_expandable: expandable,
            blocks,
        });
    }
    out
}
