//! The fast path: per-thread front caches in front of the core, so that a cache hit (an
//! allocation of a size and stream this thread recently freed) and a free of a block this thread
//! manages take no lock at all.
//!
//! # Design
//!
//! * **Ownership.** When the core allocates a block for a thread whose fast path is on, and its
//!   size has missed before (a size is admitted on its second miss), the block becomes *managed*
//!   by that thread's cache: a descriptor in the cache's shared half (`shared.rs`) and an entry
//!   in the owner's address index (`local.rs`, thread-local). For the core the block stays
//!   allocated until it comes back, so the core's own invariants hold unchanged.
//! * **Hit / cached free.** The owner frees a managed block into its bin of
//!   `(stream, rounded size)` and allocates it from there again: a thread-local lookup and one
//!   compare-and-swap on the block's descriptor (`LIVE ⇄ CACHED`), no lock.
//! * **Everything else** takes the allocator's one lock, which guards the core's state and the
//!   front's bookkeeping ([`FrontLocked`]), then per-cache queue locks and shard locks, in that
//!   order (the fast path takes none). A free from another thread finds the owner in the
//!   sharded owner map (`shards.rs`, kept from the moment a second thread is involved), takes
//!   the block from it (`LIVE → GONE`) and frees it in the core.
//! * **Memory is never lost to front caches.** Any thread holding the lock can take every
//!   thread's cached blocks back (`CACHED → GONE`), and does: before the core would grow (before
//!   garbage collection, any device allocation, and the OOM path's release-and-retry chain), on
//!   `empty_cache`, when the history recorder starts, when the allocator is dropped, and (at the
//!   next locked operation) when the owner thread has exited. Caches are bounded ([`Bounds`]).
//! * **It pays or it pauses.** A cache that got fewer hits than twice its misses over a window
//!   (random sizes, or sizes that recur too rarely to pay for the blocks it holds back from
//!   page reuse) stops admitting blocks for a while, longer each time a trial window again
//!   does not pay, so that its misses cost little more than the core's
//!   (`local::Local::note_miss`, Note [Misses of a quiet cache]). While every cache is paused
//!   and manages nothing, the allocator skips the front altogether (Note [Dormant front]).
//! * **Statistics** stay exact (`delta.rs`): a block in a front cache counts as *freed* for
//!   `allocation`, `active`, `allocated_bytes`, `active_bytes` and `requested_bytes` (PyTorch's
//!   meaning: allocated bytes drop on free). It stays unmerged until it is flushed, so it does
//!   not count in `inactive_split` / `inactive_split_bytes`, and a snapshot shows it `inactive`.
//!
//! Note [Candidates go back before a miss]: a block in a front cache is invisible to the core's
//! best fit and does not merge with its free neighbours, so without care the core would cut other
//! blocks and the segments would fragment differently from PyTorch's (on the shipped traces, up
//! to 6% more peak reserved bytes). So before the core searches for a block, the thread gives
//! back its cached blocks that best fit could have chosen: same stream and pool, at least the
//! requested size (giving back only those smaller than the core's own choice is not enough: the
//! larger ones merge with their neighbours, which changes later choices). With that, the replays
//! of the shipped traces stay within 0.2% of PyTorch's peak reserved bytes (see
//! `benches/README.md`); cached blocks smaller than the request stay, unless they touch free
//! memory (next note).
//!
//! Note [Cached blocks next to free memory]: a cached block smaller than the request still
//! changes what best fit sees when it touches a free block of the core: without the fast path
//! the two would have merged into one larger free block, and a candidate given back next to it
//! cannot merge across it either. On the recorded `generate` client (weights converted one
//! tensor at a time) such blocks scattered the converted weights over the holes of the old
//! ones, which left 4 MiB more of pages partly in use at the peak (1.0275 × live instead of the
//! 1.0209 without the fast path). So before a large-pool miss the thread also gives back, until
//! none is left, its cached large-pool blocks of the request's stream that touch a free block
//! in the core (one look-up in the core per cached block of that stream and pool; each return
//! can expose the next block of a run). Blocks whose neighbours are all allocated stay cached
//! (the core keeps them apart too), and so do small-pool blocks: giving those back as well costs
//! the hits the fast path is for (with both pools, the host instructions of the `generate`
//! replay doubled, for 1.0078 × live instead of 1.0176 with Note [Fewest-pages growth]; with the
//! large pool alone they grew by 1.6%).
//!
//! Only blocks that, merged with the free memory they touch, would make a free block of at least
//! the request's rounded size go back: a smaller merged block cannot serve this miss, and the
//! misses that could use it look again. Giving back every touching block fed on itself on a
//! ring of a transformer step's sixteen sizes, eight live at a time (`gpu/fifo_ring_trace.py`,
//! the pattern of `gpu/host_pair.py`): after page reuse had moved pages, each miss gave back
//! blocks that then missed in turn, the cache stayed paused (Note [Misses of a quiet cache];
//! 193,682 of 200,064 allocations on the core's path) and the replay's median operation took
//! 130 ns instead of 20–30. With the bound the ring hits again (median 20 ns) and every
//! decision that matters elsewhere holds: the recorded DDP, FSDP2, checkpointed and side-stream
//! traces and the three shipped ones replay with the same peak and the same device calls, the
//! recorded `generate` one peaks lower (1.0144 × live instead of 1.0176; 379 maps and 70 unmaps
//! instead of 422 and 112), and the synthetic workloads make fewer page moves at the same peak.
//!
//! Note [Flush before a new peak]: a growth that would raise the allocated bytes past their peak
//! and the reserved bytes past the page-reuse slack (`State::growth_sets_reserved_peak`) first
//! takes back every stream's cached blocks, not only its own stream's (Note [Stream-sparing
//! flush]). Such a growth sets the reserved peak, and what sits in other streams' caches then
//! is free memory that page reuse could have moved instead of creating pages. Replayed from our
//! FSDP2 recording with late event answers (query lag 1 and 4), the growth for the peak step's
//! logits buffer (1.53 GB, compute stream) mapped 896 MB of new pages where it mapped 710 at lag
//! 0, and the default peaked at 1.0284 × live against 1.0099 without the fast path;
//! with this rule it is 1.0099 at every lag, the page moves those of the core path, and every
//! other recorded, shipped and synthetic trace replays identically. New peaks are rare after
//! warm-up, so the flushes that starve other threads' caches stay rare too.
//!
//! Only large-pool growths flush that way. A small-pool growth maps one 2 MiB page at most,
//! which the page-reuse slack covers on any real workload, and with many threads each on its
//! own stream at the memory floor the flush fed on itself: 16 threads doing 1 MiB (small-pool)
//! pairs each raised the reserved peak by a page, flushed the other 15 caches, and page reuse
//! then moved the flushed blocks' pages to the growing stream, so the next thread missed and
//! grew in turn, round after round (on two H200s, 180 driver calls and 7.6 ms under the lock in
//! the first round of `examples/thread_settling.rs`; `gpu_bench` 3.1 × one thread's pairs at 16
//! threads). Limited to the large pool, every recorded, shipped and synthetic trace replays as
//! before at query lags 0, 1 and 4, and the threads' rounds make no device call once warm.
//!
//! Note [Misses of a quiet cache]: a cache that is paused ("it pays or it pauses") or has
//! nothing cached and no hit to fold in is *quiet*: its thread's misses and frees do the core's
//! work plus what the user view needs, and no more. The locked allocation looks the cache up
//! once (to count the miss and see that it is quiet), calls the core, and raises the user-view
//! peaks to the core's values plus the caches' published deltas; it neither rounds the size, nor
//! scans the bins for blocks to give back (there are none), nor synchronises. The fast free
//! remembers an address it did not find in the owner's index (`Local::take_not_mine`; only the
//! owner adds blocks to its index, and a registration forgets the answer), so the locked free
//! does not look again, and it skips the synchronisation after the core's free when that would
//! do nothing. On the recorded training traces, where 1 allocation in 24 to 27 hits the
//! front cache, this and pauses that double while trials do not pay took the host
//! instructions of the replay from 1.27 × (`ckpt`) and 1.24 × (`sidestream`) those without the
//! fast path to 1.18 × and 1.15 × (see `benches/README.md`), with every decision unchanged. What
//! is left is mostly the peak raise of each locked allocation and the fast-path attempts of the
//! operations that then miss.
//!
//! Note [Dormant front]: a quiet cache still cost its thread about 240 host instructions per
//! operation on the recorded training traces, where the caches serve 1.1–1.5 % of the
//! allocations: the fast-path attempts (each a look-up of the thread's cache), the locked
//! paths' look-ups and their frames (`benches/README.md`, "The paused fast path on the
//! training traces"). So a paused cache that caches nothing hands its live blocks back to the
//! core once per pause (`Local::hand_back_live`: a block live in a cache counts the same in the
//! user view as in the core's, unless a hit served it for another requested size, and those
//! stay). Without that, blocks admitted during a trial and kept for good (weights, optimizer
//! state) would keep the cache managing blocks, and every free looking it up, for ever. A
//! cache that is then paused with nothing at all (`Local::publish_ready`) says so in its shared
//! half; when every registered cache has said so at its last locked allocation, the front is
//! *dormant*: `allocate` and `free` skip the fast-path attempts, a free goes straight to the
//! core, and a locked allocation only counts its thread's miss and raises the user-view
//! peaks. The flags can only go stale in the safe direction: a cache leaves that state only at
//! its own locked allocation (the end of its pause, or a block admitted, which needs an active
//! cache), and that allocation ends the dormant period first; a thread's new cache ends it too.
//! While dormant no cache manages a block, so a free has nothing to find there (the invariant
//! checker checks both). On the recorded FSDP2, DDP, checkpointed and side-stream traces the
//! front's extra instructions fell by almost half (16.7 M to 9.2 M on FSDP2's 70,965 events);
//! every replay's peak, statistics and device calls are unchanged, `generate` (87 % hits)
//! within 1 %. A thread without a cache that allocates while the front is dormant ends the
//! dormant period (it gets its cache), and every locked allocation publishes its cache's
//! answer, so a cache active again is never counted as ready.
//!
//! Note [One synchronisation per miss]: a locked allocation of a thread with an active cache
//! used to synchronise twice: before the core changed (when it had hits or cached frees to fold
//! in) and after. The first only needs the fold of the peak candidate, which must see the user
//! view before the core moves; publishing the delta into `known` and starting the new interval
//! (`base`, `hi`) are left to the synchronisation that ends every such allocation (`retired` set
//! says the delta is still to be published). Nothing between the two reads what the first would
//! have written: under the lock only flushes run in between, and they change `known` by
//! additions that commute with the publication; `base` and `hi` matter only for hits, and the
//! closing synchronisation sets them whenever a hit may follow. The peaks and every statistic
//! come out as before (identical replay reports); the miss is ~200 instructions shorter.
//!
//! Note [Peaks with several threads]: `current`, `allocated` and `freed` are exact sums of the
//! core's values and each cache's delta, each delta read whole at one instant of the read (Note
//! [Consistent counter reads] in `shared.rs`); with other threads hitting their caches meanwhile,
//! the caches' instants differ by at most the read's duration. So a `current` read while others
//! run is a sum of per-cache values that each held at some instant: never negative, the counts
//! and bytes never above the core's (a cached block only lowers them), and at most the largest
//! value each cache reached during the read, summed. The peaks of
//! the five statistics above are exact when one thread at a time uses the allocator. A thread's
//! hits are folded into the peaks when that thread next takes the lock (any operation that is
//! not a hit or a cached free, or a statistics read), relative to the other caches' contents as
//! of their own last locked operation; so with several threads hitting their caches at once, a
//! reported peak can differ from the peak of any one global order of the operations by what the
//! other threads' caches took in or handed out meanwhile, and a thread's hits after a peak reset
//! from another thread count from its next locked operation on.
//!
//! Note [Hits do not poll events]: a hit takes no lock and makes no device call, so it does not
//! run the core's `process_events`; a block freed with `record_stream` uses (its free always goes
//! through the core: `free_through_core` marks it) stays pending until the next allocation that
//! reaches the core, even when its events completed meanwhile. That is what the plain core would
//! show had the device answered those queries late, and nothing decides on it: a hit serves only
//! a block of its own cache, never a pending one (the core holds those), and every miss, growth,
//! OOM path and `empty_cache` processes or waits for the events first. So with events that
//! complete by device state the misses take the plain core's decisions (addresses, reserved
//! bytes, retries, OOMs), while between two misses `active*`, `requested_bytes`, the snapshot's
//! `active_pending_free` and a segment observer's `FreeCompleted` lag behind, and the peaks of
//! those three counters can stay higher (`tests/all/fast_path_events.rs`). Polling on a hit
//! would cost a lock and a query per hit whenever any event is pending, which side-stream
//! programs have almost always. `SimDevice::set_event_query_lag` counts queries, so under it a
//! miss can see late what the plain core, having polled at every allocation, saw complete: a
//! model artifact, bounded by the OOM path's synchronization (no OOM the plain core would not
//! have: `under_a_query_lag_hits_delay_what_a_miss_sees`).
//!
//! May use: `state` (its `pub(crate)` API), `snapshot`, `invariants`, `backend`, `config`,
//! `size_class`, `stats`.
#![forbid(unsafe_code)]

mod delta;
mod local;
mod shards;
mod shared;
mod sync;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::Allocation;
use super::invariants::InvariantViolation;
use super::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};
use super::state::State;
use crate::backend::{DeviceAddr, DeviceBackend, StreamId};
use crate::config::{AllocatorConfig, MIB, MIN_BLOCK_SIZE};
use crate::error::{AllocError, Result};
use crate::size_class::{PoolKind, pool_kind, round_size};
use crate::stats::{MemoryStats, StatArray, StatType};
use delta::{Delta, Five};
use local::{Bounds, Evicted, Give, Local};
use shards::Shards;
use shared::{CACHED, DescView, GONE, LIVE, Shared, Taken};

/// Largest block a thread cache manages (larger requests always take the core path).
pub(crate) const MAX_FRONT_BLOCK: usize = 256 * MIB;
/// Most bytes one thread cache keeps in its bins.
pub(crate) const MAX_FRONT_BYTES: usize = 1024 * MIB;

/// Allocator ids, so that a thread's table tells allocators apart.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One thread cache as the front's locked bookkeeping sees it.
#[derive(Debug)]
struct Reg {
    cell: Arc<Shared>,
    /// Contributions of blocks other threads took from this cache, not yet cleaned up by its
    /// owner (or never, if the owner exited).
    foreign: Delta,
    /// The `current` values of the cache's delta when its owner last synchronised.
    published: Five,
    /// The cache's `allocated` / `freed` counters at the last accumulated-stats reset.
    acc_offset: Delta,
}

/// The front's bookkeeping, guarded by the allocator's one lock together with the core.
#[derive(Debug, Default)]
pub(crate) struct FrontLocked {
    /// Every thread cache of this allocator, in creation order (flushes go in this order).
    registry: Vec<Reg>,
    /// `Σ (published + foreign)` over the registry: what the locked path knows of the caches.
    known: Five,
    /// `allocated` / `freed` of caches already forgotten.
    retired: Delta,
    /// The user-view peaks of the five statistics the fast path changes.
    peaks: Five,
    /// Bumped by every peak reset; candidates of an older epoch are ignored.
    epoch: u64,
    /// The owner map is kept: from the first time a thread other than a block's owner may need
    /// it (a second cache, or a free by a thread without one) on. A single-threaded program
    /// never pays for it.
    shards_on: bool,
}

impl FrontLocked {
    fn position(&self, cell: &Arc<Shared>) -> Option<usize> {
        self.registry
            .iter()
            .position(|r| Arc::ptr_eq(&r.cell, cell))
    }

    /// Moves a contribution `c` into (`sign = 1`) or out of (`-1`) cache `k`'s foreign account.
    ///
    /// Note [Foreign accounts meet current deltas]: a foreign contribution offsets a change the
    /// cache's delta already holds (a block its owner freed into the cache, taken back by
    /// another thread), and that change may not be published yet: the owner publishes at its
    /// next locked operation. Added to `known` against the older published delta, it counted
    /// the block twice until then (with one thread at a time, the peaks rose by the block: an
    /// allocation of 1 MiB then one of 4 MiB reported 5 MiB at the peak). So the cache's delta
    /// is republished after its foreign account changes ([`republish`](Self::republish), once
    /// per cache and operation), read whole from its counters.
    fn foreign(&mut self, k: usize, kind: PoolKind, c: [i64; 3], sign: i64) {
        let Some(reg) = self.registry.get_mut(k) else {
            return;
        };
        let before = reg.foreign.five();
        reg.foreign.retire(kind, c, sign);
        self.known.add(&reg.foreign.five());
        self.known.sub(&before);
    }

    /// Sets cache `k`'s published delta (and `known` with it) to its delta now, read from its
    /// counters (any thread may, under the lock).
    fn republish(&mut self, k: usize) {
        let Some(reg) = self.registry.get_mut(k) else {
            return;
        };
        let now = reg.cell.counters.delta().five();
        self.known.sub(&reg.published);
        self.known.add(&now);
        reg.published = now;
    }
}

/// The fast path of one allocator.
#[derive(Debug)]
pub(crate) struct Front {
    id: u64,
    config: AllocatorConfig,
    bounds: Bounds,
    shards: Shards,
    /// Caches whose thread exited (or that emptied after it did) since the last reclaim.
    exits: Arc<AtomicUsize>,
    /// The history recorder is on: every operation takes the core path so it is recorded.
    history_on: AtomicBool,
    /// A routing to a private pool is active (graph capture): allocations take the core path,
    /// which decides the pool, and no new block becomes managed.
    routing_on: AtomicBool,
    /// No `roundup_power2_divisions` apply: `round_size` is a round-up to 512 bytes.
    plain_rounding: bool,
    /// Every cache is paused and manages no block: allocations and frees skip the front
    /// (Note [Dormant front]). Written under the core lock.
    dormant: AtomicBool,
}

/// What the fast free did.
#[derive(Debug)]
pub(crate) enum FastFree {
    /// Done (cached), or a definite error (a double free of a cached block).
    Done(Result<()>),
    /// Take the locked path.
    Slow,
}

impl Front {
    pub(crate) fn new(config: &AllocatorConfig) -> Self {
        Front {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config: config.clone(),
            bounds: Bounds {
                max_block: MAX_FRONT_BLOCK,
                max_bytes: MAX_FRONT_BYTES,
                max_split_size: config.max_split_size,
            },
            shards: Shards::default(),
            exits: Arc::new(AtomicUsize::new(0)),
            history_on: AtomicBool::new(false),
            routing_on: AtomicBool::new(false),
            plain_rounding: config.roundup_power2_divisions.iter().all(|&d| d <= 1),
            dormant: AtomicBool::new(false),
        }
    }

    // ---- fast path -------------------------------------------------------------------------

    /// A cache hit, or `None` (take the locked path).
    #[inline]
    pub(crate) fn try_alloc(&self, size: usize, stream: StreamId) -> Option<Allocation> {
        if size == 0
            || size > self.bounds.max_block
            || self.history_on.load(Ordering::Relaxed)
            || self.routing_on.load(Ordering::Relaxed)
        {
            return None;
        }
        let rounded = if self.plain_rounding {
            size.div_ceil(MIN_BLOCK_SIZE).max(1) * MIN_BLOCK_SIZE
        } else {
            round_size(size, &self.config)
        };
        let (ptr, block_size) = local::with_local(self.id, |l| l.take(stream, rounded, size))??;
        Some(Allocation {
            ptr: DeviceAddr(ptr),
            size,
            block_size,
            stream,
        })
    }

    /// Whether every cache is paused and manages no block (Note [Dormant front]): then
    /// `try_alloc` and `try_free` cannot succeed, and the caller skips them.
    #[inline]
    pub(crate) fn dormant(&self) -> bool {
        self.dormant.load(Ordering::Relaxed)
    }

    /// A free into this thread's cache, or [`FastFree::Slow`].
    #[inline]
    pub(crate) fn try_free(&self, ptr: DeviceAddr) -> FastFree {
        let may_cache = !self.history_on.load(Ordering::Relaxed);
        match local::with_local(self.id, |l| l.give(ptr.0, may_cache)) {
            Some(Give::Cached) => FastFree::Done(Ok(())),
            Some(Give::DoubleFree) => FastFree::Done(Err(AllocError::DoubleFree { ptr })),
            Some(Give::Slow | Give::NotMine) | None => FastFree::Slow,
        }
    }

    // ---- locked path: operations -----------------------------------------------------------

    /// `allocate` under the lock: the core's `malloc`, with every front cache flushed before the
    /// core would grow; the new block becomes managed by this thread's cache once its size has
    /// been seen before.
    pub(crate) fn alloc_locked<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        size: usize,
        stream: StreamId,
    ) -> Result<Allocation> {
        self.reclaim_exited(st, fl, dev);
        // While a routing is active the block may be a private pool's: never managed here.
        let manage = size > 0
            && size <= self.bounds.max_block
            && !self.history_on.load(Ordering::Relaxed)
            && !st.capture_underway();
        // Note [Dormant front]: only this thread's pause is counted. When it ends, or when the
        // thread has no cache yet (it gets one below), the dormant period ends and the ordinary
        // path runs; `woke`: the miss is counted already.
        let mut dormant = self.dormant.load(Ordering::Relaxed);
        let mut woke = false;
        if dormant && manage && local::with_local(self.id, Local::note_miss) != Some(false) {
            self.dormant.store(false, Ordering::Relaxed);
            (dormant, woke) = (false, true);
        }
        // One look-up of this thread's cache counts the miss and tells whether the cache is
        // quiet (Note [Misses of a quiet cache]); a dormant front's caches are all quiet and
        // ready (paused, idle).
        let shards_on = fl.shards_on;
        let seen = if dormant {
            Some((false, true, true))
        } else {
            local::with_local(self.id, |l| {
                let active = manage && (woke || l.note_miss());
                if !active {
                    for p in l.hand_back_live() {
                        if shards_on {
                            self.shards.remove(p);
                        }
                    }
                }
                // Published at every locked allocation, so that a cache active again stops
                // saying it is ready before it can admit a block (ready implies idle).
                (active, !active && l.idle(), l.publish_ready())
            })
        };
        let spare = !st.config.cross_stream_reuse;
        // Note [Dormant front]: this thread's cache paused with nothing in it; when every
        // other cache said the same at its last locked allocation, the front goes dormant.
        if let (false, Some((_, _, true))) = (dormant, seen) {
            if fl
                .registry
                .iter()
                .all(|r| r.cell.ready.load(Ordering::Relaxed))
            {
                self.dormant.store(true, Ordering::Relaxed);
            }
        }
        if let Some((_, true, _)) = seen {
            let r = st.malloc_with(dev, size, stream, &mut |st, only| {
                self.flush_all(st, fl, dev, only.filter(|_| spare)) > 0
            });
            // Nothing managed here: the user view is the core's plus the others' deltas.
            let mut now = Five::of_core(&st.stats);
            now.add(&fl.known);
            fl.peaks.raise_to(&now);
            return r;
        }
        let rounded = if manage {
            round_size(size, &self.config)
        } else {
            0
        };
        let (has_own, active) = match seen {
            Some((active, _, _)) => (true, active),
            None if manage && self.ensure_own(st, fl) => (
                true,
                local::with_local(self.id, Local::note_miss) == Some(true),
            ),
            None => (false, false),
        };
        let mut claimed = false;
        let mut idle = false;
        if has_own {
            local::with_local(self.id, |l| {
                if !active && l.idle() {
                    // A paused, empty cache: the core's path, plus the peak candidate below.
                    idle = true;
                    return;
                }
                // Note [One synchronisation per miss].
                self.fold_own(l, fl);
                let shards_on = fl.shards_on;
                if active {
                    let mut evicted = Evicted::default();
                    claimed = l.claim(stream, rounded, &mut evicted);
                    for &i in &evicted.idx[..evicted.len] {
                        if let Some(v) = l.evict(i) {
                            self.return_to_core(st, dev, v.ptr, shards_on);
                        }
                    }
                }
                // Note [Candidates go back before a miss] (paused or not).
                if manage {
                    let mask = l.candidates(stream, rounded);
                    if mask.iter().any(|&m| m != 0) {
                        l.drain(mask, |v| self.return_to_core(st, dev, v.ptr, shards_on));
                    }
                    // Note [Cached blocks next to free memory]: large pool only, until none
                    // is left (each return can expose the next block of a run).
                    if pool_kind(rounded) == PoolKind::Large {
                        let mut next = [0u64; 16];
                        loop {
                            let n = l.take_where(
                                stream,
                                PoolKind::Large,
                                |p| st.touches_free_block(p, rounded),
                                &mut next,
                            );
                            for &p in &next[..n] {
                                self.return_to_core(st, dev, p, shards_on);
                            }
                            if n == 0 {
                                break;
                            }
                        }
                    }
                }
            });
        }
        let r = st.malloc_with(dev, size, stream, &mut |st, only| {
            self.flush_all(st, fl, dev, only.filter(|_| spare)) > 0
        });
        if idle {
            // Nothing managed here: the user view is the core's plus the others' deltas.
            let mut now = Five::of_core(&st.stats);
            now.add(&fl.known);
            fl.peaks.raise_to(&now);
        } else if has_own {
            local::with_local(self.id, |l| {
                self.process_taken_own(l, fl);
                if let Ok(a) = &r {
                    // Only exact blocks: one with an unsplit tail goes back to the core on free
                    // and merges, as without the fast path (so no slack is kept). A borrowed
                    // block belongs to another stream's segment: the core's (Note [Borrowed
                    // blocks]); so does a private pool's block taken on out of memory (Note
                    // [Pools used on out of memory]), which must go back to its pool.
                    if claimed
                        && !st.last_foreign_block
                        && a.block_size == rounded
                        && rounded < self.bounds.max_split_size
                    {
                        let v = DescView {
                            ptr: a.ptr.0,
                            block_size: a.block_size,
                            kind: pool_kind(rounded),
                            core_req: size,
                            user_req: size,
                        };
                        let i = l.register(&v, rounded, stream);
                        if fl.shards_on {
                            self.shards.insert(a.ptr.0, &l.shared, i);
                        }
                    }
                }
                self.sync_own(l, &st.stats, fl, true);
            });
        }
        r
    }

    /// `free` under the lock: a managed block leaves its cache (this thread's or another's) and
    /// goes back to the core; anything else is the core's. Not called while the front is dormant
    /// (the caller frees in the core then: no cache manages a block, Note [Dormant front]).
    pub(crate) fn free_locked<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        ptr: DeviceAddr,
    ) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.reclaim_exited(st, fl, dev);
        // `Err(quiet)`: not managed here; `quiet` when the cache's synchronisation after the
        // free would do nothing (see `sync_own`).
        let own = local::with_local(self.id, |l| {
            // The fast free just looked (Note [Misses of a quiet cache]).
            let found = if l.take_not_mine(ptr.0) {
                None
            } else {
                l.find(ptr.0)
            };
            if l.dirty || matches!(found, Some((_, LIVE))) {
                self.prologue(l, st, fl);
            }
            let r = match found {
                Some((_, CACHED)) => Some(Err(AllocError::DoubleFree { ptr })),
                Some((i, LIVE)) => match l.retire_live(i) {
                    Ok(_) => {
                        if fl.shards_on {
                            self.shards.remove(ptr.0);
                        }
                        Some(st.free(dev, ptr))
                    }
                    Err(CACHED) => Some(Err(AllocError::DoubleFree { ptr })),
                    Err(_) => None,
                },
                _ => None,
            };
            match r {
                Some(r) => {
                    self.sync_own(l, &st.stats, fl, false);
                    Ok(r)
                }
                None => Err(!l.dirty && !l.retired && !l.may_hit()),
            }
        });
        match own {
            Some(Ok(r)) => r,
            Some(Err(quiet)) => {
                let r = self.free_elsewhere(st, fl, dev, ptr, true);
                if !quiet {
                    local::with_local(self.id, |l| self.sync_own(l, &st.stats, fl, false));
                }
                r
            }
            None => self.free_elsewhere(st, fl, dev, ptr, false),
        }
    }

    /// A free of a block this thread does not manage (`has_own`: the thread has a cache):
    /// another thread's (taken from it), or the core's.
    fn free_elsewhere<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        ptr: DeviceAddr,
        has_own: bool,
    ) -> Result<()> {
        // Another thread's managed block?
        let other = if fl.registry.len() > 1 || !has_own {
            self.owner_of(fl, ptr.0)
        } else {
            None
        };
        if let Some((cell, i)) = other {
            if let Some((chunk, k)) = cell.desc(i) {
                let d = &chunk.0[k];
                if d.view().ptr == ptr.0 {
                    match d.transition(LIVE, GONE) {
                        Ok(()) => {
                            let v = d.view();
                            let c = v.contribution(LIVE);
                            if let Some(k) = fl.position(&cell) {
                                fl.foreign(k, v.kind, c, 1);
                                fl.republish(k);
                            }
                            self.shards.remove(ptr.0);
                            let r = st.free(dev, ptr);
                            self.after_taken(&cell, i, v, c);
                            return r;
                        }
                        Err(CACHED) => return Err(AllocError::DoubleFree { ptr }),
                        Err(_) => {}
                    }
                }
            }
        }
        st.free(dev, ptr)
    }

    /// `record_stream` under the lock: a managed block is marked so that its free goes through
    /// the core, which records the stream events.
    pub(crate) fn record_stream_locked(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        ptr: DeviceAddr,
        stream: StreamId,
    ) -> Result<()> {
        self.free_through_core(fl, ptr)?;
        st.record_stream(ptr, stream)
    }

    /// Marks the block at `ptr`, when a front cache manages it live, so that its free goes to
    /// the core (which records `record_stream`'s events and lets an export go) instead of its
    /// thread's cache. `DoubleFree` when a cache holds it freed; nothing when no cache manages
    /// it (a free goes to the core anyway).
    pub(crate) fn free_through_core(&self, fl: &mut FrontLocked, ptr: DeviceAddr) -> Result<()> {
        // The thread's own index may still hold an entry whose block another thread freed (GONE,
        // not cleaned up yet) while the address is already live again under another thread's
        // cache: only a LIVE or CACHED entry of its own is the block's; otherwise the owner map
        // says who manages it (as `free_elsewhere` does for a free).
        let own = local::with_local(self.id, |l| {
            l.find(ptr.0)
                .filter(|&(_, s)| s == LIVE || s == CACHED)
                .map(|(i, s)| (Arc::clone(&l.shared), i, s))
        })
        .flatten();
        let managed = own.or_else(|| {
            let (cell, i) = self.owner_of(fl, ptr.0)?;
            let s = cell.state(i);
            Some((cell, i, s))
        });
        match managed {
            Some((_, _, CACHED)) => Err(AllocError::DoubleFree { ptr }),
            Some((cell, i, LIVE)) => {
                cell.mark_needs_core(i);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Gives every cached block of every thread back to the core; returns how many.
    pub(crate) fn flush<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
    ) -> usize {
        self.reclaim_exited(st, fl, dev);
        local::with_local(self.id, |l| self.prologue(l, st, fl));
        let n = self.flush_all(st, fl, dev, None);
        local::with_local(self.id, |l| {
            self.process_taken_own(l, fl);
            self.sync_own(l, &st.stats, fl, false);
        });
        n
    }

    /// Switches the private-pool bypass (set under the allocator's lock when routings begin and
    /// end; a thread ordered after that sees it, so a routed allocation never hits a front cache).
    pub(crate) fn set_routing(&self, on: bool) {
        self.routing_on.store(on, Ordering::Relaxed);
    }

    /// Switches the history recorder's bypass: while recording, every operation takes the core
    /// path; starting flushes the caches so the recorder sees every block come and go.
    pub(crate) fn set_history<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        on: bool,
    ) {
        self.history_on.store(on, Ordering::Relaxed);
        if on {
            self.flush(st, fl, dev);
        }
    }

    /// The user-view statistics: the core's plus every cache's delta.
    pub(crate) fn stats(&self, st: &State, fl: &mut FrontLocked) -> MemoryStats {
        local::with_local(self.id, |l| {
            self.process_taken_own(l, fl);
            self.sync_own(l, &st.stats, fl, false);
        });
        let sum = self.exact_sum(fl);
        let mut now = Five::of_core(&st.stats);
        now.add(&sum.five());
        fl.peaks.raise_to(&now);
        let mut stats = st.stats;
        apply(&mut stats, &sum, &fl.peaks);
        stats
    }

    /// `reset_peak_memory_stats` of the user view.
    pub(crate) fn reset_peak(&self, st: &mut State, fl: &mut FrontLocked) {
        local::with_local(self.id, |l| self.process_taken_own(l, fl));
        st.reset_peak_stats();
        let sum = self.exact_sum(fl);
        let mut now = Five::of_core(&st.stats);
        now.add(&sum.five());
        fl.peaks = now;
        fl.epoch += 1;
        local::with_local(self.id, |l| {
            // The delta is published before the flag that says it changed is cleared: the next
            // synchronisation publishes only a changed delta, and `known` without this one
            // raised the next peaks by whatever this thread's cache held.
            if let Some(k) = fl.position(&l.shared) {
                fl.republish(k);
            }
            let mut base = now;
            base.sub(&Five::of_quantities(&l.cur()));
            l.base = base;
            l.hi = l.cur();
            l.epoch = fl.epoch;
            l.dirty = false;
        });
    }

    /// `reset_accumulated_memory_stats` of the user view.
    pub(crate) fn reset_accumulated(&self, st: &mut State, fl: &mut FrontLocked) {
        local::with_local(self.id, |l| self.process_taken_own(l, fl));
        st.stats.reset_accumulated();
        fl.retired.reset_accumulated();
        for reg in &mut fl.registry {
            reg.foreign.reset_accumulated();
            reg.acc_offset = accumulators(&reg.cell.counters.delta());
        }
    }

    /// Marks the blocks that sit in front caches as `inactive` in a snapshot.
    pub(crate) fn annotate(&self, fl: &FrontLocked, segments: &mut [SegmentSnapshot]) {
        let mut cached: Vec<u64> = Vec::new();
        for reg in &fl.registry {
            reg.cell.each_desc(|_, d| {
                if d.state.load(Ordering::Acquire) == CACHED {
                    cached.push(d.view().ptr);
                }
            });
        }
        cached.sort_unstable();
        for seg in segments.iter_mut() {
            for b in &mut seg.blocks {
                if b.state == BlockState::ActiveAllocated
                    && cached.binary_search(&b.address.0).is_ok()
                {
                    b.state = BlockState::Inactive;
                    b.requested_size = 0;
                }
            }
            // A cached block given back to the core merges with the free blocks beside it; the
            // view shows it so, as without the fast path (adjacent inactive blocks, which no
            // PyTorch snapshot lists, made the largest free block depend on the setting: an
            // adversarial review).
            let mut merged: Vec<BlockSnapshot> = Vec::with_capacity(seg.blocks.len());
            for b in seg.blocks.drain(..) {
                match merged.last_mut() {
                    Some(last)
                        if last.state == BlockState::Inactive
                            && b.state == BlockState::Inactive
                            && last.address.0 + last.size as u64 == b.address.0 =>
                    {
                        last.size += b.size;
                    }
                    _ => merged.push(b),
                }
            }
            seg.blocks = merged;
        }
    }

    /// Whether `ptr` is a block some thread's cache holds freed (the core still counts it
    /// allocated): not a live allocation to its user.
    pub(crate) fn is_cached(&self, fl: &FrontLocked, ptr: u64) -> bool {
        let mut found = false;
        for reg in &fl.registry {
            reg.cell.each_desc(|_, d| {
                found |= d.state.load(Ordering::Acquire) == CACHED && d.view().ptr == ptr;
            });
        }
        found
    }

    /// Everything cached back to the core and every cache forgotten (allocator drop).
    pub(crate) fn shutdown<B: DeviceBackend>(&self, st: &mut State, fl: &mut FrontLocked, dev: &B) {
        self.flush(st, fl, dev);
        fl.registry.clear();
        self.shards.clear();
        fl.shards_on = false;
    }

    // ---- locked path: internals ------------------------------------------------------------

    /// Makes sure this thread has a cache (creating and registering it); false when the
    /// thread-local table is unavailable (the thread is exiting).
    fn ensure_own(&self, st: &State, fl: &mut FrontLocked) -> bool {
        if local::with_local(self.id, |_| ()).is_some() {
            return true;
        }
        let cell = Arc::new(Shared::new(Arc::clone(&self.exits)));
        let mut now = Five::of_core(&st.stats);
        now.add(&fl.known);
        let epoch = fl.epoch;
        let made = local::with_local_or_make(
            self.id,
            || Some(Local::new(Arc::clone(&cell), self.bounds)),
            |l| {
                l.base = now;
                l.epoch = epoch;
            },
        );
        if made.is_none() {
            return false;
        }
        // A new cache starts active: alloc_locked ended any dormant period before it came
        // here (Note [Dormant front]).
        debug_assert!(!self.dormant.load(Ordering::Relaxed));
        if !fl.registry.is_empty() {
            self.enable_shards(fl);
        }
        fl.registry.push(Reg {
            cell,
            foreign: Delta::default(),
            published: Five::default(),
            acc_offset: Delta::default(),
        });
        true
    }

    /// The owner's first steps on the locked path: clean up what other threads took, and fold
    /// the peak candidate of its hits before the core changes.
    fn prologue(&self, l: &mut Local, st: &State, fl: &mut FrontLocked) {
        self.process_taken_own(l, fl);
        if l.dirty {
            self.sync_own(l, &st.stats, fl, false);
        }
    }

    /// `alloc_locked`'s first steps: those of [`prologue`](Self::prologue), but of the
    /// synchronisation only the fold of the peak candidate; publishing the delta and the new
    /// interval are left to the synchronisation that ends the allocation (Note [One
    /// synchronisation per miss]).
    fn fold_own(&self, l: &mut Local, fl: &mut FrontLocked) {
        self.process_taken_own(l, fl);
        if l.dirty {
            Self::fold_candidate(l, fl);
            // The delta changed since it was last published: the closing synchronisation
            // publishes it.
            l.retired = true;
        }
    }

    /// Folds the peak candidate of the owner's interval since its last synchronisation (when
    /// it belongs to the current epoch) and marks the interval folded.
    #[inline]
    fn fold_candidate(l: &mut Local, fl: &mut FrontLocked) {
        if l.epoch == fl.epoch {
            let mut candidate = l.base;
            candidate.add(&Five::of_quantities(&l.hi));
            fl.peaks.raise_to(&candidate);
        }
        l.dirty = false;
    }

    #[inline]
    fn process_taken_own(&self, l: &mut Local, fl: &mut FrontLocked) {
        // Pushers set the flag under the core lock, which the caller holds too.
        if !l.shared.taken_pending.load(Ordering::Relaxed) {
            return;
        }
        let Some(k) = fl.position(&l.shared) else {
            return;
        };
        l.process_taken(|t| fl.foreign(k, t.kind, t.contribution, -1));
        fl.republish(k);
    }

    /// Synchronises the owner's cache with the core (see `delta.rs`): folds the peak candidate
    /// of the interval since its last synchronisation, publishes its delta, takes the present as
    /// a peak candidate when the user view `grew` (an allocation; frees, flushes and reads never
    /// raise it), and starts a new interval.
    fn sync_own(&self, l: &mut Local, core: &MemoryStats, fl: &mut FrontLocked, grew: bool) {
        let changed = l.dirty || l.retired;
        if l.dirty {
            Self::fold_candidate(l, fl);
        }
        l.retired = false;
        let manages = l.may_hit();
        if !(changed || grew || manages) {
            return;
        }
        let d = Five::of_quantities(&l.cur());
        if changed {
            if let Some(k) = fl.position(&l.shared) {
                let reg = &mut fl.registry[k];
                fl.known.sub(&reg.published);
                fl.known.add(&d);
                reg.published = d;
            }
        }
        if !(grew || manages) {
            return;
        }
        let mut now = Five::of_core(core);
        now.add(&fl.known);
        if grew {
            fl.peaks.raise_to(&now);
        }
        // The base matters only for hits before the next synchronisation, which need a block.
        if manages {
            now.sub(&d);
            l.base = now;
            l.hi = l.cur();
            l.epoch = fl.epoch;
        }
    }

    /// The exact sum of every cache's delta (read now) and foreign account, with `allocated` /
    /// `freed` since the last reset.
    fn exact_sum(&self, fl: &FrontLocked) -> Delta {
        let mut sum = fl.retired;
        for reg in &fl.registry {
            sum.add(&reg.cell.counters.delta().minus(&reg.acc_offset));
            sum.add(&reg.foreign);
        }
        sum
    }

    /// The cache managing `ptr` and its descriptor, through the owner map (kept from now on).
    fn owner_of(&self, fl: &mut FrontLocked, ptr: u64) -> Option<shards::Owner> {
        self.enable_shards(fl);
        self.shards.get(ptr)
    }

    /// Starts keeping the owner map, filling it with every block managed so far.
    fn enable_shards(&self, fl: &mut FrontLocked) {
        if fl.shards_on {
            return;
        }
        fl.shards_on = true;
        for reg in &fl.registry {
            reg.cell.each_desc(|i, d| {
                if matches!(d.state.load(Ordering::Acquire), LIVE | CACHED) {
                    self.shards.insert(d.view().ptr, &reg.cell, i);
                }
            });
        }
    }

    /// Returns a block taken from a cache to the core.
    fn return_to_core<B: DeviceBackend>(&self, st: &mut State, dev: &B, ptr: u64, shards_on: bool) {
        if shards_on {
            self.shards.remove(ptr);
        }
        if let Err(err) = st.free(dev, DeviceAddr(ptr)) {
            // A managed block is allocated in the core by construction; a failure here is a bug
            // that the invariant checker reports.
            tracing::error!(target: "cuda_caching_allocator", error = %err, ptr = %DeviceAddr(ptr), "returning a front-cached block to the core failed");
        }
    }

    /// Tells the owner of descriptor `i` that its block was taken away (or, when the owner has
    /// exited, lets the next reclaim check whether its cache can be forgotten).
    fn after_taken(&self, cell: &Arc<Shared>, i: u32, v: DescView, c: [i64; 3]) {
        if cell.exited.load(Ordering::Acquire) {
            self.exits.fetch_add(1, Ordering::Release);
        } else {
            cell.taken.lock().push(Taken {
                desc: i,
                kind: v.kind,
                contribution: c,
            });
            cell.taken_pending.store(true, Ordering::Relaxed);
        }
    }

    /// Takes every cached block of cache `k` (of stream `only`, when given) back to the core;
    /// returns how many.
    ///
    /// Note [Stream-sparing flush]: a growth of stream S takes back only S's cached blocks: no
    /// other stream's block could serve S, and taking them would let page reuse move their
    /// pages to S, so that their threads miss and grow in turn (pages shuttled between streams
    /// on every growth). The out-of-memory path still takes everything, and so does a growth
    /// that would set the reserved peak (Note [Flush before a new peak]). The stream is read from
    /// the core's record of the block before the descriptor is claimed: under the core lock,
    /// which the caller holds, a cached descriptor keeps its block (descriptors are pointed at
    /// another block only by `Local::register`, under the lock), so the block checked is the
    /// block the claim takes.
    fn steal_cached<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        k: usize,
        only: Option<StreamId>,
    ) -> usize {
        let Some(reg) = fl.registry.get(k) else {
            return 0;
        };
        // `delta + foreign` counts minus one per cached block: skip caches with none.
        if reg.cell.counters.count_current() + reg.foreign.count[0].current == 0 {
            return 0;
        }
        let cell = Arc::clone(&reg.cell);
        let mut n = 0;
        cell.each_desc(|i, d| {
            if let Some(s) = only {
                if d.state.load(Ordering::Acquire) != CACHED {
                    return;
                }
                let ptr = d.view().ptr;
                let core = st.active.get(&ptr).and_then(|&id| st.arena.get(id));
                if core.is_none_or(|b| b.stream != s) {
                    return;
                }
            }
            if d.transition(CACHED, GONE).is_ok() {
                let v = d.view();
                let c = v.contribution(CACHED);
                fl.foreign(k, v.kind, c, 1);
                self.return_to_core(st, dev, v.ptr, fl.shards_on);
                self.after_taken(&cell, i, v, c);
                n += 1;
            }
        });
        if n > 0 {
            fl.republish(k);
        }
        n
    }

    /// Flushes every registered cache (only the blocks of stream `only`, when given: Note
    /// [Stream-sparing flush]); returns the number of blocks given back.
    fn flush_all<B: DeviceBackend>(
        &self,
        st: &mut State,
        fl: &mut FrontLocked,
        dev: &B,
        only: Option<StreamId>,
    ) -> usize {
        let mut n = 0;
        for k in 0..fl.registry.len() {
            n += self.steal_cached(st, fl, dev, k, only);
        }
        if n > 0 {
            tracing::debug!(target: "cuda_caching_allocator", blocks = n, "front caches flushed");
        }
        n
    }

    /// Takes back the cached blocks of exited threads, and forgets their caches once nothing
    /// they managed is left.
    #[inline]
    fn reclaim_exited<B: DeviceBackend>(&self, st: &mut State, fl: &mut FrontLocked, dev: &B) {
        if self.exits.load(Ordering::Acquire) != 0 {
            self.reclaim_exited_now(st, fl, dev);
        }
    }

    #[cold]
    #[inline(never)]
    fn reclaim_exited_now<B: DeviceBackend>(&self, st: &mut State, fl: &mut FrontLocked, dev: &B) {
        self.exits.store(0, Ordering::Release);
        let mut k = 0;
        while k < fl.registry.len() {
            if !fl.registry[k].cell.exited.load(Ordering::Acquire) {
                k += 1;
                continue;
            }
            self.steal_cached(st, fl, dev, k, None);
            let mut managed = false;
            fl.registry[k].cell.each_desc(|_, d| {
                managed |= matches!(d.state.load(Ordering::Acquire), LIVE | CACHED);
            });
            if managed {
                k += 1;
            } else {
                let reg = fl.registry.remove(k);
                fl.known.sub(&reg.published);
                fl.known.sub(&reg.foreign.five());
                let mut gone = accumulators(&reg.cell.counters.delta().minus(&reg.acc_offset));
                gone.add(&accumulators(&reg.foreign));
                fl.retired.add(&gone);
            }
        }
    }

    // ---- invariants ------------------------------------------------------------------------

    /// The front's invariants: every managed block is allocated in the core with the size, pool
    /// and requested size recorded and sits in the owner map under its cache; each cache's delta
    /// plus foreign account equals a recount of its blocks; this thread's bins and index match
    /// its descriptors; the user-view statistics are consistent. Exact when no other thread is
    /// allocating or freeing meanwhile.
    pub(crate) fn check(
        &self,
        st: &State,
        fl: &mut FrontLocked,
    ) -> std::result::Result<(), InvariantViolation> {
        let bad = |detail: String| InvariantViolation::ActiveMapMismatch {
            detail: format!("front cache: {detail}"),
        };
        let own = local::with_local(self.id, |l| {
            self.process_taken_own(l, fl);
            l.check()
        });
        if let Some(Err(e)) = own {
            return Err(bad(e));
        }
        let owners = self.shards.all();
        let fl_shards_on = fl.shards_on;
        let mut managed = 0usize;
        let mut problem: Option<String> = None;
        let mut known = Five::default();
        // Every managed block by address: (address, cache, descriptor, state).
        let mut seen: Vec<(u64, usize, u32, u32)> = Vec::new();
        for (k, reg) in fl.registry.iter().enumerate() {
            known.add(&reg.published);
            known.add(&reg.foreign.five());
            let mut recount = [0i64; 9];
            reg.cell.each_desc(|i, d| {
                let state = d.state.load(Ordering::Acquire);
                if !matches!(state, LIVE | CACHED) || problem.is_some() {
                    return;
                }
                managed += 1;
                let v = d.view();
                seen.push((v.ptr, k, i, state));
                let p = DeviceAddr(v.ptr);
                let core = st.active.get(&v.ptr).and_then(|&id| st.arena.get(id));
                match core {
                    Some(b) if b.owner != 0 => {
                        problem = Some(format!("managed block {p} belongs to a private pool"))
                    }
                    Some(b)
                        if (b.size, b.pool, b.requested_size)
                            == (v.block_size, v.kind, v.core_req) => {}
                    Some(_) => problem = Some(format!("managed block {p} disagrees with the core")),
                    None => {
                        problem = Some(format!("managed block {p} is not allocated in the core"))
                    }
                }
                if fl_shards_on
                    && !owners
                        .iter()
                        .any(|(q, (o, k))| *q == v.ptr && *k == i && Arc::ptr_eq(o, &reg.cell))
                {
                    problem = Some(format!("managed block {p} is missing from the owner map"));
                }
                count_into(&mut recount, &v, state);
            });
            if let Some(p) = problem {
                return Err(bad(p));
            }
            let mut have = reg.cell.counters.delta();
            have.add(&reg.foreign);
            let mut have = have.currents();
            // The owner thread may be between a descriptor change and its counter update (a hit
            // or a cached free takes no lock): a mismatch is retried until the owner's operation
            // in flight has finished; one that stays is a violation. (Exact when no other thread
            // runs; with others running, at most one operation per owner is ever in flight.)
            let mut retries = 0;
            while have != recount && retries < 1000 {
                retries += 1;
                std::thread::yield_now();
                recount = [0i64; 9];
                reg.cell.each_desc(|_, d| {
                    let state = d.state.load(Ordering::Acquire);
                    if !matches!(state, LIVE | CACHED) {
                        return;
                    }
                    count_into(&mut recount, &d.view(), state);
                });
                let mut again = reg.cell.counters.delta();
                again.add(&reg.foreign);
                have = again.currents();
            }
            for q in 0..3 {
                if have[3 * q..3 * q + 3] != recount[3 * q..3 * q + 3] {
                    return Err(InvariantViolation::StatsMismatch {
                        key: format!(
                            "front cache delta of {}.all.current",
                            ["allocation", "allocated_bytes", "requested_bytes"][q]
                        ),
                        recorded: have[3 * q],
                        recount: recount[3 * q],
                    });
                }
            }
        }
        // One block, one descriptor: a block both live and cached (in one cache or two), or live
        // twice, has two owners.
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0].0 == w[1].0) {
            let name = |s: u32| if s == LIVE { "live" } else { "cached" };
            return Err(bad(format!(
                "block {} is managed twice: {} in cache {} (descriptor {}) and {} in cache {} \
                 (descriptor {})",
                DeviceAddr(w[0].0),
                name(w[0].3),
                w[0].1,
                w[0].2,
                name(w[1].3),
                w[1].1,
                w[1].2
            )));
        }
        // Note [Dormant front]: frees then go straight to the core, so no cache may manage a
        // block, and every cache must have said it was ready.
        if self.dormant.load(Ordering::Relaxed) {
            if managed != 0 {
                return Err(bad(format!("dormant with {managed} managed blocks")));
            }
            if let Some(k) = fl
                .registry
                .iter()
                .position(|r| !r.cell.ready.load(Ordering::Relaxed))
            {
                return Err(bad(format!("dormant while cache {k} is not ready")));
            }
        }
        if owners.len() != if fl_shards_on { managed } else { 0 } {
            return Err(bad(format!(
                "{} owner-map entries for {managed} managed blocks",
                owners.len()
            )));
        }
        if known != fl.known {
            return Err(bad("the running sum of published deltas drifted".into()));
        }
        let user = self.stats(st, fl);
        for (name, arr) in [
            ("allocation", &user.allocation),
            ("active", &user.active),
            ("allocated_bytes", &user.allocated_bytes),
            ("active_bytes", &user.active_bytes),
            ("requested_bytes", &user.requested_bytes),
        ] {
            for t in StatType::ALL {
                let s = arr.get(t);
                if s.current < 0 || s.peak < s.current {
                    return Err(InvariantViolation::StatsMismatch {
                        key: format!("{name}.{}.peak (user view)", t.name()),
                        recorded: s.peak,
                        recount: s.current,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Writes the user view into `stats` (the core's statistics): adds `sum` (every thread cache's
/// delta) to `current`, `allocated` and `freed` of the five statistics and sets their peaks to
/// `peaks`.
pub(crate) fn apply(stats: &mut MemoryStats, sum: &Delta, peaks: &Five) {
    let arrays: [(&mut StatArray, &delta::Triple); 5] = [
        (&mut stats.allocation, &sum.count),
        (&mut stats.active, &sum.count),
        (&mut stats.allocated_bytes, &sum.bytes),
        (&mut stats.active_bytes, &sum.bytes),
        (&mut stats.requested_bytes, &sum.req),
    ];
    for (i, (arr, d)) in arrays.into_iter().enumerate() {
        for (p, t) in StatType::ALL.into_iter().enumerate() {
            let s = arr.get_mut(t);
            s.current += d[p].current;
            s.allocated += d[p].allocated;
            s.freed += d[p].freed;
            s.peak = peaks.0[3 * i + p];
        }
    }
}

/// `d` with its `current` values zeroed (its accumulators only).
fn accumulators(d: &Delta) -> Delta {
    let mut a = *d;
    for t in [&mut a.count, &mut a.bytes, &mut a.req] {
        for acc in t.iter_mut() {
            acc.current = 0;
        }
    }
    a
}

/// Adds a managed block's contribution (count, allocated and requested bytes, each to `all` and
/// to its pool) to a recount of a cache's currents.
fn count_into(recount: &mut [i64; 9], v: &DescView, state: u32) {
    let pool = match v.kind {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    };
    for (q, c) in v.contribution(state).into_iter().enumerate() {
        recount[3 * q] += c;
        recount[3 * q + pool] += c;
    }
}
