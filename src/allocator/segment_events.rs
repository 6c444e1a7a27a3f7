//! Segment events: a callback told whenever the cache takes device memory from the driver or
//! gives it back, as PyTorch's allocator tells its trace trackers (`attachAllocatorTraceTracker`:
//! `SEGMENT_ALLOC`, `SEGMENT_FREE`, `SEGMENT_MAP`, `SEGMENT_UNMAP`), and when a block whose free
//! waited for other streams' work comes back to the cache (`FREE_COMPLETED`).
//!
//! Libraries that keep their own record of device memory need these: NCCL's user-buffer
//! registration (PyTorch's `TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK`) registers a segment
//! when it is allocated and must deregister it before its memory goes back. May use: `backend`
//! values, `state::MemPoolId`.
#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use super::state::MemPoolId;
use crate::backend::{DeviceAddr, StreamId};

/// What happened to a range of device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SegmentAction {
    /// A whole segment was allocated from the driver (reported after the allocation).
    Alloc,
    /// A whole segment is about to go back to the driver (reported before the free; if the
    /// driver then refuses the free, the segment stays cached and an `Alloc` of the same range
    /// follows at once).
    Free,
    /// Pages were mapped into an expandable segment's reserved range (reported after mapping).
    /// Lent pages (Note [Lent pages] in `state/lending.rs`) are mapped here while still mapped
    /// at their old range, whose `Unmap` comes once the old range's last use is done.
    Map,
    /// Pages of an expandable segment were unmapped (reported after unmapping, as PyTorch does).
    Unmap,
    /// A block whose free had to wait for other streams' work (uses declared with
    /// `record_stream`) is back in the cache: PyTorch's `free_completed` trace entry for such a
    /// block. `addr` is the freed allocation's address and `size` its requested size. Only
    /// frees that returned while the block was still waiting are told (those for which
    /// `CachingAllocator::free_with_outcome` answered
    /// [`AwaitingStreams`](crate::FreeOutcome::AwaitingStreams)); a free that put its block back
    /// at once is complete when it returns. Told when the allocator next looks at its events (an allocation that
    /// reaches the core, `empty_cache`, the out-of-memory path), as PyTorch's are.
    FreeCompleted,
}

impl SegmentAction {
    /// PyTorch's name of the action in trace entries (`segment_alloc`, ...).
    pub fn pytorch_name(self) -> &'static str {
        match self {
            SegmentAction::Alloc => "segment_alloc",
            SegmentAction::Free => "segment_free",
            SegmentAction::Map => "segment_map",
            SegmentAction::Unmap => "segment_unmap",
            SegmentAction::FreeCompleted => "free_completed",
        }
    }
}

/// One segment event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentEvent {
    /// What happened.
    pub action: SegmentAction,
    /// The device's ordinal.
    pub device: usize,
    /// The first byte of the range.
    pub addr: DeviceAddr,
    /// The range's length in bytes.
    pub size: usize,
    /// The stream the segment belongs to now (a segment handed over to another stream, with
    /// `cca_cross_stream_reuse`, is freed under its new stream).
    pub stream: StreamId,
    /// The pool the segment belongs to ([`MemPoolId::DEFAULT`] outside private pools).
    pub pool: MemPoolId,
}

/// A segment observer: called with every [`SegmentEvent`], in order, while the allocator's lock
/// is held (so no other thread can hand out the memory before the observer has seen the event).
///
/// It must not call back into the same allocator (the lock is not re-entrant: that deadlocks),
/// should be quick, and should not panic: a panic is caught, logged and the observer removed from
/// that allocator (an `interop::AllocatorRegistry` still gives it to allocators it creates
/// later). Events are also told while the allocator is dropped (its cache going back to the
/// driver), except while the thread is unwinding from a panic. Nothing is replayed when an
/// observer is set: one set after segments exist is told of their `Free` / `Unmap` without having
/// seen their `Alloc` / `Map`.
pub type SegmentObserver = Arc<dyn Fn(&SegmentEvent) + Send + Sync>;

/// The observer slot the allocator's state holds (`Debug` without printing the closure).
#[derive(Clone, Default)]
pub(crate) struct ObserverSlot(pub(crate) Option<SegmentObserver>);

impl fmt::Debug for ObserverSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(<observer>)"
        } else {
            "None"
        })
    }
}
