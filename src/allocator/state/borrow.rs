//! Borrowed blocks (crate key `cca_borrow_blocks`, opt-in, off in every preset): an allocation
//! that finds no free block of its own stream uses another stream's idle free block where it
//! lies, instead of growing (`docs/algorithm.md`, step 27b). May use: `state`, `block`, `pool`,
//! `page_fence`, `backend`.
//!
//! Note [Borrowed blocks]: with page reuse, a stream that lacks memory while another stream's
//! free blocks sit idle takes their *pages*: it unmaps them there and maps them where it grows
//! (an unmap, a map and an access per 2 MiB page, about 75 µs on an H100). A workload whose
//! streams take turns with the same bytes (FSDP2's all-gather and reduce-scatter buffers against
//! the compute stream's activations) moves the same pages back and forth every step. A borrowed
//! block moves nothing:
//!
//! 1. Only a free large-pool block of another stream whose page fence has completed is taken
//!    (`known_idle`: every use of it on its own stream is done). When the best fit is not yet
//!    known idle, fences are recorded on those streams and polled once more; a block still
//!    pending is left where it is. So the borrower never waits, on the host or on the device,
//!    and takes on no dependency on the other stream's later work.
//! 2. The block is split and allocated as any best fit would be; the remainder stays a free
//!    block of its own stream. The allocated block keeps its stream (every block of a segment
//!    belongs to the segment's stream) and lists the borrower in its `stream_uses`, as
//!    `record_stream` would: its free records an event on the borrowing stream, and only once
//!    that event has completed does the block return to its own stream's free set (and to page
//!    reuse, whose fences then cover it afresh).
//! 3. The allocation reports the borrowing stream, and the fast path does not cache the block
//!    (its bins are keyed by the stream a block belongs to).
//!
//! What is given up: a borrowed block returns a little later than a block of the stream's own
//! would (after an event query shows the borrower's work done), and each free of one records an
//! event. Nothing is borrowed while a graph capture is underway, for private pools, from the
//! small pool (its 2 MiB pages are cheap to grow once and hold many blocks), or without event
//! fences.
//!
//! Why it is opt-in: on `SimDevice` the FSDP2 recording moves 553 pages instead of 1,777 at the
//! same peak, but on two H200s the FSDP2 client made as many page moves per step after warm-up
//! with it as without, and was no faster (`benches/README.md`, "Borrowed blocks"). Likely
//! reasons, not isolated: with the GPU behind the host, the buffers a stream frees are rarely
//! known idle when another stream misses, and where page reuse gathers pages from several free
//! blocks no single idle block fits.
#![forbid(unsafe_code)]

use super::State;
use crate::allocator::block::BlockId;
use crate::allocator::pool::FreeKey;
use crate::backend::{DeviceBackend, StreamId};
use crate::size_class::PoolKind;

impl State {
    /// Step 27b of `docs/algorithm.md` (Note [Borrowed blocks]): another stream's idle free
    /// large-pool block for a request of `size` bytes on `stream`, removed from the free set, or
    /// `None` (nothing changed but fences recorded or polled).
    pub(super) fn borrow_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
    ) -> Option<BlockId> {
        if !self.config.borrow_blocks || kind != PoolKind::Large || !self.fenced_reuse() {
            return None;
        }
        let (idle, waiting) = self.borrow_candidates(stream, size);
        let key = match idle {
            Some(k) => k,
            None if !waiting.is_empty() => {
                self.poll_fences(dev);
                self.record_fences(dev, &waiting);
                self.poll_fences(dev);
                self.borrow_candidates(stream, size).0?
            }
            None => return None,
        };
        if !self.large.blocks.remove(&key) {
            return None;
        }
        self.blocks_borrowed += 1;
        Some(key.id)
    }

    /// The best-fitting idle free block of another stream (smallest, then lowest address), and
    /// the streams (with their highest free stamp) of better or only fits that no completed
    /// fence covers yet.
    fn borrow_candidates(
        &self,
        stream: StreamId,
        size: usize,
    ) -> (Option<FreeKey>, Vec<(StreamId, u64)>) {
        let pool = &self.large.blocks;
        let mut best: Option<FreeKey> = None;
        let mut waiting: Vec<(StreamId, u64)> = Vec::new();
        for t in pool.streams().filter(|&t| t != stream) {
            for k in pool.fits(t, size) {
                if !self.best_fit_accepts(size, k.size)
                    || best.is_some_and(|b| (b.size, b.ptr) <= (k.size, k.ptr))
                {
                    break;
                }
                if self.known_idle(k.id) {
                    best = Some(*k);
                    break;
                }
                let stamp = self.block(k.id).free_stamp;
                match waiting.iter_mut().find(|(s, _)| *s == t) {
                    Some(w) => w.1 = w.1.max(stamp),
                    None => waiting.push((t, stamp)),
                }
            }
        }
        (best, waiting)
    }
}
