//! Event fences for page reuse (crate key `cca_page_reuse_fence`, on in the crate's default, off
//! in the PyTorch presets): how a growing expandable segment knows that the free pages it wants
//! to unmap are no longer used by queued work, without synchronizing anything
//! (`docs/algorithm.md`, step 23). May use: `state`, `block`, `backend`.
//!
//! Note [Page fences]: `cuMemUnmap` is not stream-ordered. Once it returns, work still queued
//! on the page's old stream that touches the old virtual addresses would fault, whatever the new
//! owner waits on. So the old uses must be *complete* before the unmap, not merely ordered
//! before the new owner's work: an event wait (as a handover does) is not enough. PyTorch
//! synchronizes the stream first; this module observes completion instead:
//!
//! * Every time a block becomes free (or its segment moves to another stream) it is stamped
//!   with the next value of a clock (`Block::free_stamp`; merged blocks keep the larger stamp,
//!   blocks split off keep their parent's, freshly mapped memory has stamp 0). Every use of a
//!   free block's bytes was queued on its stream before that stamp, or ordered into it (a
//!   `record_stream` use is complete before the block is free at all; a use on another stream
//!   joined back by an event wait is ordered before the free).
//! * A *fence* is a pooled event recorded on stream S at clock value c. Once it is seen complete
//!   (`query_event`, which never blocks), every block of S stamped at or before c is idle: S
//!   has completed all work queued on it before the record. Per stream, fences complete in
//!   record order, so the fences are polled front to back and each stream keeps only the
//!   highest clock value known complete (`done`).
//! * Page reuse takes pages only from blocks whose stamp is at or below their stream's `done`;
//!   no stream wait is needed then, since the memory is idle. When a growth wanted pages it
//!   could not take because their fence had not completed, it records one fence on each such
//!   stream (unless one covering them is already pending), polls once more (an idle stream's
//!   fence completes at once), and creates new memory for whatever is still short. Those pages
//!   are reused by a later growth, once their fence has completed, or released by `empty_cache`.
//!
//! A backend without events (`Unsupported`) falls back to synchronizing the stream, as with the
//! key off. Other event errors cost memory only: the pages stay where they are for now.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};

use super::State;
use crate::allocator::block::BlockId;
use crate::allocator::device_calls;
use crate::backend::{BackendError, DeviceBackend, EventHandle, StreamId};

/// The fences of one stream.
#[derive(Debug, Default)]
struct StreamFences {
    /// The highest clock value whose fence on this stream has been seen complete.
    done: u64,
    /// Fences recorded and not yet seen complete, oldest first: (event, clock value).
    pending: VecDeque<(EventHandle, u64)>,
}

/// The page-fence clock and every stream's fences.
#[derive(Debug, Default)]
pub(crate) struct PageFences {
    /// The last stamp given out.
    clock: u64,
    streams: BTreeMap<StreamId, StreamFences>,
    /// The backend answered `Unsupported` to an event call: synchronize instead.
    unsupported: bool,
    /// Fence events recorded so far.
    pub(crate) recorded: u64,
}

impl PageFences {
    /// The next clock value.
    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Whether a block of `stream` stamped `stamp` is known idle.
    pub(super) fn idle(&self, stream: StreamId, stamp: u64) -> bool {
        stamp == 0 || self.streams.get(&stream).is_some_and(|f| stamp <= f.done)
    }

    /// The highest clock value a fence on `stream` covers, complete or not.
    fn covered(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |f| {
            f.pending.back().map_or(f.done, |&(_, c)| c.max(f.done))
        })
    }

    /// Events of every pending fence (for teardown).
    pub(crate) fn drain_events(&mut self) -> Vec<EventHandle> {
        let mut out = Vec::new();
        for f in self.streams.values_mut() {
            out.extend(f.pending.drain(..).map(|(ev, _)| ev));
        }
        out
    }
}

impl State {
    /// Whether page reuse fences by events now (configured, and the backend has events).
    pub(super) fn fenced_reuse(&self) -> bool {
        self.config.page_reuse_fence && !self.fences.unsupported
    }

    /// Whether a completed fence shows that no queued work uses free block `id`.
    pub(super) fn known_idle(&self, id: BlockId) -> bool {
        let b = self.block(id);
        self.fences.idle(b.stream, b.free_stamp)
    }

    /// Whether page reuse may plan to unmap the pages of free block `id` now: always when reuse
    /// synchronizes instead; with fences, once a fence covering it has completed.
    pub(super) fn fence_allows(&self, id: BlockId) -> bool {
        !self.fenced_reuse() || self.known_idle(id)
    }

    /// Stamps block `id` as freed now (see Note [Page fences]).
    pub(super) fn stamp_free(&mut self, id: BlockId) {
        let t = self.fences.tick();
        self.block_mut(id).free_stamp = t;
    }

    /// Queries pending fences, per stream front to back, stopping at the first incomplete one;
    /// a completed fence's event goes back to the pool. A query error leaves the fence pending.
    pub(super) fn poll_fences<B: DeviceBackend>(&mut self, dev: &B) {
        for f in self.fences.streams.values_mut() {
            while let Some(&(ev, c)) = f.pending.front() {
                match dev.query_event(ev) {
                    Ok(true) => {
                        f.pending.pop_front();
                        f.done = f.done.max(c);
                        self.event_pool.push(ev);
                    }
                    Ok(false) => break,
                    Err(e) => {
                        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, "page fence query failed");
                        break;
                    }
                }
            }
        }
    }

    /// Records a fence on each of `streams` whose free blocks up to `stamp` no fence covers yet.
    /// Returns whether any was recorded. `Unsupported` switches reuse to synchronizing.
    pub(super) fn record_fences<B: DeviceBackend>(
        &mut self,
        dev: &B,
        streams: &[(StreamId, u64)],
    ) -> bool {
        let mut any = false;
        let now = self.fences.clock;
        for &(s, stamp) in streams {
            if stamp <= self.fences.covered(s) {
                continue;
            }
            let r = self
                .get_event(dev)
                .and_then(|ev| match dev.record_event(ev, s) {
                    Ok(()) => Ok(ev),
                    Err(e) => {
                        self.event_pool.push(ev);
                        Err(e)
                    }
                });
            match r {
                Ok(ev) => {
                    self.fences
                        .streams
                        .entry(s)
                        .or_default()
                        .pending
                        .push_back((ev, now));
                    self.fences.recorded += 1;
                    any = true;
                }
                Err(e) => {
                    if matches!(e, BackendError::Unsupported(_)) {
                        self.fences.unsupported = true;
                    }
                    tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, stream = %s, "page fence not recorded");
                }
            }
        }
        any
    }

    /// The event of a fence on `stream` that covers free stamp `stamp`: the oldest pending one
    /// recorded at or after it, else one recorded now (Note [Lent pages]). `None` when the
    /// stream is idle up to `stamp` already (nothing to wait for) or no event could be
    /// recorded.
    pub(super) fn covering_fence<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        stamp: u64,
    ) -> Option<EventHandle> {
        if self.fences.idle(stream, stamp) {
            return None;
        }
        let find = |f: &PageFences| {
            f.streams.get(&stream).and_then(|sf| {
                sf.pending
                    .iter()
                    .find(|&&(_, c)| c >= stamp)
                    .map(|&(ev, _)| ev)
            })
        };
        if let Some(ev) = find(&self.fences) {
            return Some(ev);
        }
        self.record_fences(dev, &[(stream, stamp)]);
        find(&self.fences)
    }

    /// Destroys the events of pending fences (allocator drop).
    pub(super) fn destroy_fence_events<B: DeviceBackend>(&mut self, dev: &B) {
        for ev in self.fences.drain_events() {
            let _ = device_calls::destroy_event(dev, ev);
        }
    }
}
