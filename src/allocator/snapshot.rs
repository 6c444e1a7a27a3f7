//! Segment snapshots: the cache's segments and their blocks in address order, in the shape of
//! PyTorch's `memory_snapshot()` (used by summaries, exports and tests). May use: `state`, `block`.
#![forbid(unsafe_code)]

use super::block::{Block, BlockId};
use super::state::{MemPoolId, State};
use crate::backend::{DeviceAddr, StreamId};
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
    /// Reserved address space without physical pages (expandable segments only). Snapshots
    /// leave such ranges out, as PyTorch does, so [`CachingAllocator::snapshot`] never reports
    /// this state.
    ///
    /// [`CachingAllocator::snapshot`]: crate::CachingAllocator::snapshot
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
    pub address: DeviceAddr,
    /// Size in bytes.
    pub size: usize,
    /// The requested size while allocated (0 otherwise).
    pub requested_size: usize,
    /// Allocated, pending or free.
    pub state: BlockState,
}

/// One device segment, or one contiguous mapped range of an expandable segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Base address.
    pub address: DeviceAddr,
    /// Size in bytes.
    pub total_size: usize,
    /// The stream it serves.
    pub stream: StreamId,
    /// Small or large pool.
    pub pool: PoolKind,
    /// Whether it is an expandable (virtual-memory) segment.
    pub is_expandable: bool,
    /// The private pool it belongs to ([`MemPoolId::DEFAULT`] for the default pools), also
    /// when none of its blocks is allocated.
    pub private_pool: MemPoolId,
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

/// Whether `b` is the first block of a segment as the snapshot reports segments: mapped, and
/// not after a mapped block (an expandable segment is one segment per contiguous mapped range).
fn starts_segment(st: &State, b: &Block) -> bool {
    b.mapped
        && b.prev
            .is_none_or(|p| st.arena.get(p).is_some_and(|pb| !pb.mapped))
}

/// The blocks of the segment starting at `head`, in address order (up to the first unmapped
/// block of an expandable segment).
fn segment_blocks(st: &State, head: BlockId) -> impl Iterator<Item = &Block> {
    std::iter::successors(st.arena.get(head), |b| b.next.and_then(|n| st.arena.get(n)))
        .take_while(|b| b.mapped)
}

/// The base address and size of the segment holding the live allocation at `ptr`, as PyTorch's
/// `getBaseAllocation` and this snapshot see segments: a fixed segment whole, an expandable
/// segment's mapped run around the allocation. `None` when no live allocation starts at `ptr`.
pub(crate) fn base_of_allocation(st: &State, ptr: u64) -> Option<(u64, usize)> {
    let mut head = *st.active.get(&ptr)?;
    loop {
        let b = st.arena.get(head)?;
        if starts_segment(st, b) {
            break;
        }
        head = b.prev?;
    }
    let base = st.arena.get(head)?.ptr;
    Some((base, segment_blocks(st, head).map(|b| b.size).sum()))
}

/// Walks every segment from its head block. An expandable segment is reported as PyTorch
/// reports it: one segment per contiguous mapped range, holding only mapped blocks.
pub(crate) fn take(st: &State) -> Vec<SegmentSnapshot> {
    let mut heads: Vec<(u64, BlockId)> = st
        .arena
        .iter()
        .filter(|(_, b)| starts_segment(st, b))
        .map(|(id, b)| (b.ptr, id))
        .collect();
    heads.sort_unstable();
    let mut out = Vec::with_capacity(heads.len());
    for (base, head) in heads {
        let mut blocks = Vec::new();
        let (mut stream, mut pool, mut expandable) = (StreamId::DEFAULT, PoolKind::Small, false);
        for b in segment_blocks(st, head) {
            stream = b.stream;
            pool = b.pool;
            expandable |= b.expandable;
            let state = if b.allocated {
                BlockState::ActiveAllocated
            } else if b.event_count > 0 || !b.stream_uses.is_empty() {
                BlockState::ActivePendingFree
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
                address: DeviceAddr(b.ptr),
                size: b.size,
                requested_size,
                state,
            });
        }
        let total_size = blocks.iter().map(|b| b.size).sum();
        let owner = st.arena.get(head).map_or(0, |b| b.owner);
        out.push(SegmentSnapshot {
            address: DeviceAddr(base),
            total_size,
            stream,
            pool,
            is_expandable: expandable,
            private_pool: st.graph.id_of(owner),
            blocks,
        });
    }
    out
}

/// The allocator's segments as a PyTorch snapshot lists them, for the snapshot exporter
/// (`SnapshotExportOptions::with_allocator_segments`). Like PyTorch, an expandable segment is
/// reported as one segment per contiguous mapped range; unmapped blocks are left out.
#[cfg(feature = "trace-io")]
mod trace_export {
    use super::{BlockState, SegmentSnapshot};
    use crate::size_class::PoolKind;
    use crate::trace::{
        SegmentPool, SnapshotBlock, SnapshotBlockState, SnapshotSegment, ToSnapshotSegments,
    };

    fn block(b: &super::BlockSnapshot) -> Option<SnapshotBlock> {
        let state = match b.state {
            BlockState::ActiveAllocated => SnapshotBlockState::ActiveAllocated,
            BlockState::ActivePendingFree => SnapshotBlockState::ActivePendingFree,
            BlockState::Inactive => SnapshotBlockState::Inactive,
            BlockState::Unmapped => return None,
        };
        Some(SnapshotBlock {
            address: b.address.0,
            size: b.size as u64,
            requested_size: b.requested_size as u64,
            state,
        })
    }

    impl ToSnapshotSegments for [SegmentSnapshot] {
        fn to_snapshot_segments(&self, device: usize) -> Vec<SnapshotSegment> {
            let mut out = Vec::with_capacity(self.len());
            for seg in self {
                let pool = match seg.pool {
                    PoolKind::Small => SegmentPool::Small,
                    PoolKind::Large => SegmentPool::Large,
                };
                // Maximal runs of mapped blocks; a segment without unmapped blocks is one run.
                let mut runs: Vec<Vec<SnapshotBlock>> = Vec::new();
                let mut run = Vec::new();
                for b in &seg.blocks {
                    match block(b) {
                        Some(b) => run.push(b),
                        None => runs.push(std::mem::take(&mut run)),
                    }
                }
                runs.push(run);
                for blocks in runs.into_iter().filter(|run| !run.is_empty()) {
                    let address = blocks[0].address;
                    let total_size = blocks.iter().map(|b| b.size).sum();
                    out.push(SnapshotSegment {
                        device,
                        address,
                        total_size,
                        stream: seg.stream.0,
                        pool,
                        // PyTorch's `segment_pool_id`: the private pool's id, (0, 0) outside
                        // them (it was (0, 0) for every segment: an adversarial review).
                        pool_id: (seg.private_pool.0, seg.private_pool.1),
                        is_expandable: seg.is_expandable,
                        blocks,
                    });
                }
            }
            out
        }
    }

    impl ToSnapshotSegments for Vec<SegmentSnapshot> {
        fn to_snapshot_segments(&self, device: usize) -> Vec<SnapshotSegment> {
            self.as_slice().to_snapshot_segments(device)
        }
    }
}
