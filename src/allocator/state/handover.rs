//! Cross-stream reuse (crate key `cca_cross_stream_reuse`, off in every preset): an allocation
//! that finds no fitting free block of its own stream takes a wholly free cached segment of
//! another stream instead of growing (`docs/algorithm.md`, step 27). May use: `state`, `block`,
//! `pool`, `backend`.
//!
//! Note [Cross-stream handover]: PyTorch reuses a block only on the stream it was allocated for,
//! because the cache does not know when that stream's queued work on the block ends; a free
//! block of stream T may still be read or written by kernels queued on T. A handover makes that
//! explicit: record an event on T (it completes when everything queued on T so far, including
//! the last use of the segment, is done), make the new stream S wait on it
//! (`stream_wait_event`: S's later work starts after it; the host never blocks), and only then
//! give the segment to S. The event goes straight back to the pool: a wait captures the event's
//! record at the time it is issued.
//!
//! What may be handed over: a *wholly free* segment of the request's pool, so that after the
//! handover every block of a segment still belongs to the segment's one stream (the cache's
//! tiling invariant) and nothing else has to be ordered:
//!
//! * a fixed segment whose one block is free: in the free set, so not allocated, with no
//!   pending `record_stream` event and no recorded stream use (a block whose other-stream uses
//!   have not completed is pending, never free);
//! * an expandable segment whose every block is free or unmapped; its mapped pages move with it
//!   (reserved bytes do not change) and its unmapped range becomes room for S to grow.
//!
//! Among the segments with a block that best fit would accept for the request (the same
//! oversize rules), the one whose fitting block is smallest wins, then the lowest address. The
//! search walks each other stream's part of the free set from the request's size up and stops at
//! the first whole segment, so it costs one ordered-set lookup per stream plus the split blocks
//! it skips; it runs only where the cache would otherwise grow.
//!
//! If an event call fails, nothing has changed yet: the event goes back to the pool and the
//! allocation takes the normal growth path. A backend without events (`Unsupported`) is not
//! asked again.
#![forbid(unsafe_code)]

use super::State;
use crate::allocator::block::BlockId;
use crate::allocator::pool::FreeKey;
use crate::backend::{BackendError, DeviceAddr, DeviceBackend, StreamId};
use crate::size_class::PoolKind;

/// The segment to hand over: the key of the block that will serve the request (naming the
/// stream the segment belongs to now) and the segment's base.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    key: FreeKey,
    base: u64,
}

impl State {
    /// Step 27 of `docs/algorithm.md` (`cca_cross_stream_reuse`): a wholly free cached segment
    /// of another stream, handed over to `stream` after an event wait; its fitting block,
    /// removed from the free set. `None` when there is none or an event call failed (nothing
    /// changed then).
    pub(super) fn cross_stream_handover<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
    ) -> Option<BlockId> {
        if !self.config.cross_stream_reuse || self.handover_events_unsupported {
            return None;
        }
        let c = self.handover_candidate(stream, size, kind)?;
        let from = c.key.stream;
        if let Err(e) = self.order_after(dev, from, stream) {
            if matches!(e, BackendError::Unsupported(_)) {
                self.handover_events_unsupported = true;
            }
            tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, from = %from, to = %stream, "cross-stream handover skipped: event call failed");
            return None;
        }
        let seg_size = self.segments.get(&c.base).map_or(0, |r| r.size);
        let expandable = self.block(c.key.id).expandable;
        self.rekey_segment(c.base, c.key.id, stream);
        self.pool(kind).blocks.remove(&FreeKey { stream, ..c.key });
        self.cross_stream_handovers += 1;
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), segment = %DeviceAddr(c.base), size = seg_size, expandable, from = %from, to = %stream, pool = kind.segment_type(), "segment handed over across streams");
        Some(c.key.id)
    }

    /// Records a pooled event on `from` and makes `to` wait on it. On an error the event goes
    /// back to the pool.
    fn order_after<B: DeviceBackend>(
        &mut self,
        dev: &B,
        from: StreamId,
        to: StreamId,
    ) -> std::result::Result<(), BackendError> {
        let ev = self.get_event(dev)?;
        let r = dev
            .record_event(ev, from)
            .and_then(|()| dev.stream_wait_event(to, ev));
        // The wait (if issued) captured the record; the event can be recorded again.
        self.event_pool.push(ev);
        r
    }

    /// Best fit over the other streams' wholly free segments (see Note [Cross-stream handover]).
    fn handover_candidate(
        &self,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
    ) -> Option<Candidate> {
        let pool = self.pool_ref(kind);
        let mut best: Option<Candidate> = None;
        let mut whole: Vec<(u64, bool)> = Vec::new();
        for t in pool.blocks.streams().filter(|&t| t != stream) {
            for k in pool.blocks.fits(t, size) {
                if !self.best_fit_accepts(size, k.size)
                    || best.is_some_and(|b| (b.key.size, b.key.ptr) <= (k.size, k.ptr))
                {
                    break;
                }
                if let Some(base) = self.wholly_free_segment(k.id, &mut whole) {
                    best = Some(Candidate { key: *k, base });
                    break;
                }
            }
        }
        best
    }

    /// The base of block `id`'s segment when every block of it is free or unmapped (and not
    /// pending), else `None`. `memo` remembers expandable segments already walked.
    fn wholly_free_segment(&self, id: BlockId, memo: &mut Vec<(u64, bool)>) -> Option<u64> {
        let b = self.block(id);
        if !b.expandable {
            return (!b.is_split()).then_some(b.ptr);
        }
        let base = self.vm_segment_of(b.ptr)?;
        if let Some(&(_, free)) = memo.iter().find(|(s, _)| *s == base) {
            return free.then_some(base);
        }
        let free = self.segment_blocks(id).iter().all(|&id| {
            let b = self.block(id);
            // An idle move's old range counts as unmapped (Note [Unmaps off the allocating
            // thread]): its uses are complete, only the helper's unmap is left.
            !b.allocated
                && (!b.lent || self.unmapped_or_moving(id))
                && b.event_count == 0
                && b.stream_uses.is_empty()
        });
        memo.push((base, free));
        free.then_some(base)
    }

    /// Every block of block `id`'s segment, in address order.
    fn segment_blocks(&self, id: BlockId) -> Vec<BlockId> {
        let mut head = id;
        while let Some(p) = self.block(head).prev {
            head = p;
        }
        let mut out = Vec::new();
        let mut cur = Some(head);
        while let Some(id) = cur {
            out.push(id);
            cur = self.block(id).next;
        }
        out
    }

    /// Gives the wholly free segment at `base` holding block `id` to `stream`: its record, its
    /// page table, and every block, moved to `stream`'s part of the free and unmapped sets
    /// (keeping their garbage-collection ages).
    fn rekey_segment(&mut self, base: u64, id: BlockId, stream: StreamId) {
        let Some(rec) = self.segments.get_mut(&base) else {
            return;
        };
        rec.stream = stream;
        let kind = rec.pool;
        if let Some(vm) = self.vm_segments.get_mut(&base) {
            vm.stream = stream;
        }
        for id in self.segment_blocks(id) {
            let b = self.block(id);
            let (old, ptr, mapped) = (FreeKey::of(id, b), b.ptr, b.mapped);
            let pool = match kind {
                PoolKind::Small => &mut self.small,
                PoolKind::Large => &mut self.large,
            };
            if mapped {
                if pool.blocks.remove(&old) {
                    pool.blocks.insert(FreeKey { stream, ..old });
                }
            } else if pool.unmapped.remove(&(old.stream, ptr, id)) {
                pool.unmapped.insert((stream, ptr, id));
            }
            self.block_mut(id).stream = stream;
            // An idle move's old range (the only lent block a wholly free segment holds) goes
            // along: its uses were complete, so no fence of either stream is needed.
            for r in self.lent.iter_mut().filter(|r| r.block == id) {
                r.stream = stream;
                r.stamp = 0;
            }
            // Its old stream's work is ordered before the new stream's only from here on: a
            // page fence on the new stream must be recorded after this (Note [Page fences]).
            self.stamp_free(id);
        }
    }
}
