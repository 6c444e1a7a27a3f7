//! Blocks and their arena.
//!
//! A *segment* is one device allocation; it is tiled by *blocks* in address order, doubly linked
//! through [`BlockId`]s (indices into [`Arena`], never pointers). A block is either allocated to a
//! user, free (in its pool's free set), or freed-but-pending (waiting for stream events).
//! May use: `backend` value types, `size_class`.
#![forbid(unsafe_code)]

use crate::backend::StreamId;
use crate::size_class::PoolKind;

/// Index of a block in the [`Arena`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(pub(crate) u32);

/// One block: a contiguous piece of a segment.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// Start address.
    pub(crate) ptr: u64,
    /// Size in bytes (a rounded size).
    pub(crate) size: usize,
    /// The user's unrounded request while allocated.
    pub(crate) requested_size: usize,
    /// The stream the segment was allocated for.
    pub(crate) stream: StreamId,
    /// The pool the segment belongs to.
    pub(crate) pool: PoolKind,
    /// Handed out to a user.
    pub(crate) allocated: bool,
    /// Whether the bytes are backed by physical memory (always, except expandable tails).
    pub(crate) mapped: bool,
    /// Part of an expandable segment.
    pub(crate) expandable: bool,
    /// The block before this one in its segment.
    pub(crate) prev: Option<BlockId>,
    /// The block after this one in its segment.
    pub(crate) next: Option<BlockId>,
    /// Outstanding stream events that must complete before the block is free.
    pub(crate) event_count: u32,
    /// Other streams that used the block (`record_stream`); empty on the fast path.
    pub(crate) stream_uses: Vec<StreamId>,
    /// The pool's free-block search count when this block was last cached (for GC ages).
    pub(crate) gc_count_base: u64,
    /// The private pool owning the block's segment (its slot), 0 for the default pools.
    pub(crate) owner: u32,
    /// The page-fence clock when this block, or a block merged into it, last became free (or
    /// moved to another stream); 0 for memory no work has used. Page reuse unmaps the block's
    /// pages only once an event recorded on its stream at this clock or later has completed
    /// (Note [Page fences]).
    pub(crate) free_stamp: u64,
    /// Unmapped, but its old mapping is still in place: the physical pages were lent to a
    /// growth while queued work may still use them at this address. Neither free nor in the
    /// pool's `unmapped` set, never merged; it becomes an ordinary unmapped block once a fence
    /// shows that work complete and the old mapping is gone (Note [Lent pages]).
    pub(crate) lent: bool,
    /// Allocated, and its pages were exported for another process (`export_pages`): freeing it
    /// lets go of the pages' exports that no other such allocation needs.
    pub(crate) exported: bool,
    /// Freed while other streams' work still used it: its free returned before the block came
    /// back to the cache, and coming back is told to the segment observer
    /// (`SegmentAction::FreeCompleted`).
    pub(crate) awaited: bool,
}

impl Block {
    pub(crate) fn new(ptr: u64, size: usize, stream: StreamId, pool: PoolKind) -> Self {
        Block {
            ptr,
            size,
            requested_size: 0,
            stream,
            pool,
            allocated: false,
            mapped: true,
            expandable: false,
            prev: None,
            next: None,
            event_count: 0,
            stream_uses: Vec::new(),
            gc_count_base: 0,
            owner: 0,
            free_stamp: 0,
            lent: false,
            exported: false,
            awaited: false,
        }
    }

    /// Part of a segment that holds more than this block.
    pub(crate) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// End address (exclusive).
    pub(crate) fn end(&self) -> u64 {
        self.ptr + self.size as u64
    }
}

/// Slab of blocks with a free list of slots.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    slots: Vec<Option<Block>>,
    vacant: Vec<u32>,
    live: usize,
}

impl Arena {
    pub(crate) fn insert(&mut self, block: Block) -> BlockId {
        self.live += 1;
        if let Some(i) = self.vacant.pop() {
            self.slots[i as usize] = Some(block);
            BlockId(i)
        } else {
            self.slots.push(Some(block));
            BlockId((self.slots.len() - 1) as u32)
        }
    }

    pub(crate) fn remove(&mut self, id: BlockId) -> Option<Block> {
        let b = self.slots.get_mut(id.0 as usize)?.take()?;
        self.vacant.push(id.0);
        self.live -= 1;
        Some(b)
    }

    pub(crate) fn get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id.0 as usize)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: BlockId) -> Option<&mut Block> {
        self.slots.get_mut(id.0 as usize)?.as_mut()
    }

    /// Live blocks, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (BlockId(i as u32), b)))
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }
}
