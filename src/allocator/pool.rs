//! A block pool: the free blocks of one size class, ordered by `(stream, size, address)` as
//! PyTorch's `BlockComparatorSize` orders them, so best fit is one ordered-set lookup.
//! May use: `block`.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use super::block::{Block, BlockId};
use crate::backend::StreamId;

/// Ordering key of a free block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FreeKey {
    pub(crate) stream: StreamId,
    pub(crate) size: usize,
    pub(crate) ptr: u64,
    pub(crate) id: BlockId,
}

impl FreeKey {
    pub(crate) fn of(id: BlockId, b: &Block) -> Self {
        FreeKey {
            stream: b.stream,
            size: b.size,
            ptr: b.ptr,
            id,
        }
    }

    /// The smallest key for `stream` with at least `size` bytes.
    pub(crate) fn search(stream: StreamId, size: usize) -> Self {
        FreeKey {
            stream,
            size,
            ptr: 0,
            id: BlockId(0),
        }
    }
}

/// The free blocks of one pool (small or large).
#[derive(Debug, Default)]
pub(crate) struct BlockPool {
    /// Free, mapped, event-free blocks.
    pub(crate) blocks: BTreeSet<FreeKey>,
    /// Unmapped tails of expandable segments, by `(stream, address)`.
    pub(crate) unmapped: BTreeSet<(StreamId, u64, BlockId)>,
    /// Number of best-fit searches so far (ages for garbage collection).
    pub(crate) get_free_blocks_call_count: u64,
}

impl BlockPool {
    /// Inserts a free block, stamping its GC age base.
    pub(crate) fn insert(&mut self, id: BlockId, b: &mut Block) -> bool {
        b.gc_count_base = self.get_free_blocks_call_count;
        self.blocks.insert(FreeKey::of(id, b))
    }

    pub(crate) fn remove(&mut self, id: BlockId, b: &Block) -> bool {
        self.blocks.remove(&FreeKey::of(id, b))
    }
}
