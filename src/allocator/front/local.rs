//! The owner's half of a thread cache, in a `thread_local!` table keyed by allocator id: the
//! address index of the blocks it manages, their bins by `(stream, rounded size)`, and its
//! bookkeeping. Only its thread touches it, so a hit or a cached free costs one
//! compare-and-swap on the block's descriptor and no lock.
//!
//! The bin table is direct-mapped with two probes per key; a slot holds up to [`SLOT_CAP`]
//! blocks of one key. A key that misses where other keys hold both probe slots strikes the
//! weaker one; after [`EVICT_STRIKES`] strikes that slot's blocks go back to the core and the key
//! takes it. Nothing here allocates on a hit or a cached free: the descriptor chunks, the index
//! and the bin table reach their working size and stay there.
//!
//! When the thread exits, its table is dropped and each cache is marked exited; the allocator
//! takes the cached blocks back at its next locked operation. May use: `shared`, `backend`
//! values, `size_class`, `state::AddrMap`.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::sync::Arc;

use super::delta::Five;
use super::shared::{
    CACHED, CHUNK, Chunk, Desc, DescView, GONE, LIVE, Shared, Taken, VACANT, pool_index,
};
use crate::allocator::state::AddrMap;
use crate::backend::StreamId;
use crate::size_class::{PoolKind, pool_kind};

/// Entries of the direct-mapped `address → descriptor` cache in front of the index (a power of
/// two). An empty entry is `None`: no address, however odd (0, `u64::MAX`), matches it.
pub(crate) const RECENT: usize = 64;

#[inline(always)]
fn recent_slot(ptr: u64) -> usize {
    (ptr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - RECENT.trailing_zeros())) as usize
}

/// Slots in a thread's bin table (a power of two).
pub(crate) const SLOTS: usize = 256;
/// Blocks one slot holds.
pub(crate) const SLOT_CAP: usize = 8;
/// Strikes after which a slot's key gives way to a key that keeps missing.
pub(crate) const EVICT_STRIKES: u8 = 2;
/// Misses per admission window: after each, a cache that got fewer than [`HITS_PER_MISS`] hits
/// per miss pauses for [`PAUSE_WINDOWS`] windows.
pub(crate) const WINDOW: u32 = 256;
/// Hits per miss below which the cache does not pay. In host work alone, 0.5 would break even
/// (a hit saves a locked allocation and a locked free, a miss with the cache active costs
/// about half of one in bookkeeping, measured with callgrind on the shipped traces); but an
/// active cache also holds blocks out of best fit's and page reuse's reach, which costs page
/// moves. On FSDP2 (two H200s, A/B against native) caches that hit about once per miss made
/// the step 1.024–1.062 × native (5.4 ms of allocator time per step, 3.0 ms of it in driver
/// calls); at 2 they pause there, and the step is 1.015 × (3.0 ms, 0.7 ms) with the peaks of
/// every recorded and shipped trace unchanged (`benches/README.md`, "Where FSDP2's extra time
/// goes").
pub(crate) const HITS_PER_MISS: f64 = 2.0;
/// Windows a paused cache admits nothing (and costs almost nothing) before it tries again.
pub(crate) const PAUSE_WINDOWS: u32 = 8;
/// The longest pause: each trial window that does not pay doubles the next pause, from
/// [`PAUSE_WINDOWS`] up to this (a training loop whose sizes come back too rarely pays a trial
/// window per 64 paused ones instead of per 8).
pub(crate) const MAX_PAUSE_WINDOWS: u32 = 64;

/// Bounds of one thread cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    /// Largest block managed.
    pub(crate) max_block: usize,
    /// Most bytes kept in bins.
    pub(crate) max_bytes: usize,
    /// Blocks of this size or more are never managed (PyTorch's oversize blocks).
    pub(crate) max_split_size: usize,
}

/// What the owner knows about one of its descriptors.
#[derive(Clone, Copy, Debug)]
struct Meta {
    ptr: u64,
    block_size: usize,
    rounded: usize,
    stream: StreamId,
    kind: PoolKind,
    /// The key's home slot (`home_slot(stream, rounded)`).
    home: u16,
    /// In a bin (the owner's view: it cached the block and has not taken it back).
    in_bin: bool,
}

/// One bin: up to [`SLOT_CAP`] blocks of one `(stream, rounded size)` key (a cache line).
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
struct Slot {
    /// The key's rounded size; 0 for a slot no key holds.
    size: usize,
    stream: StreamId,
    len: u8,
    strikes: u8,
    /// When the key was last seen (the cache's tick): empty slots are reused oldest first.
    seen: u32,
    idx: [u32; SLOT_CAP],
}

const EMPTY_SLOT: Slot = Slot {
    size: 0,
    stream: StreamId(0),
    len: 0,
    strikes: 0,
    seen: 0,
    idx: [0; SLOT_CAP],
};

/// The row of [`Local::occupied`] for a pool.
#[inline(always)]
fn kind_row(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

#[inline]
fn home_slot(stream: StreamId, rounded: usize) -> usize {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let h = ((rounded as u64 >> 9) ^ stream.0.wrapping_mul(K)).wrapping_mul(K);
    (h >> (64 - SLOTS.trailing_zeros())) as usize
}

/// What a free found in the owner's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Give {
    /// The block went into a bin.
    Cached,
    /// The block was already cached: a double free.
    DoubleFree,
    /// Take the locked path (no room, `record_stream`, caching off for now).
    Slow,
    /// Not managed here: take the locked path (which need not look again: see
    /// [`take_not_mine`](Local::take_not_mine)).
    NotMine,
}

/// Blocks a slot eviction took out of their bin (descriptor indices).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Evicted {
    pub(crate) idx: [u32; SLOT_CAP],
    pub(crate) len: usize,
}

/// The owner's half of one thread cache.
#[derive(Debug)]
pub(crate) struct Local {
    pub(crate) shared: Arc<Shared>,
    chunks: Vec<Arc<Chunk>>,
    /// By descriptor index: what the owner knows of a managed block, `None` for a vacant
    /// descriptor.
    meta: Vec<Option<Meta>>,
    vacant: Vec<u32>,
    index: AddrMap<u32>,
    /// A direct-mapped subset of `index` (the blocks registered or taken last), checked first.
    recent: [Option<(u64, u32)>; RECENT],
    slots: Box<[Slot; SLOTS]>,
    /// One bit per slot holding cached blocks, by the pool of the slot's key
    /// ([`kind_row`]), so that the scans before a miss visit only that pool's slots.
    occupied: [[u64; SLOTS / 64]; 2],
    bounds: Bounds,
    pub(crate) cached_bytes: usize,
    pub(crate) cached_count: usize,
    pub(crate) live_count: usize,
    /// The delta's `current` values (`3 * quantity + pool`): a copy of what the shared counters
    /// give, kept by their only writer (this thread) as it writes them, so that a hit reads
    /// no atomics for its peak candidates.
    cur: [i64; 9],
    /// The largest `cur` values since the last synchronisation.
    pub(crate) hi: [i64; 9],
    /// The user-view values at the last synchronisation, less `cur` then: `base + hi` is the
    /// peak candidate of the interval.
    pub(crate) base: Five,
    /// The peak epoch `base` belongs to.
    pub(crate) epoch: u64,
    /// A hit or a cached free happened since the last synchronisation.
    pub(crate) dirty: bool,
    /// The delta changed on the locked path (a block retired) since the last synchronisation,
    /// or a locked allocation folded the hits in and left the publication to its closing
    /// synchronisation (Note [One synchronisation per miss] in `front/mod.rs`): either way the
    /// next synchronisation publishes the delta.
    pub(crate) retired: bool,
    /// No cached block is larger than this (an upper bound; 0 when none is cached).
    max_cached: usize,
    /// Counts key sightings on the locked path (for [`Slot::seen`]).
    tick: u32,
    /// Admission control: misses and hits in this window, and windows left paused.
    window_misses: u32,
    window_hits: u32,
    paused: u32,
    /// This pause's live blocks went back to the core (Note [Dormant front]).
    handed_back: bool,
    /// The length of the last pause (0 after a productive window).
    pause: u32,
    /// The address the last free found unmanaged here, until the locked path takes the answer
    /// or a block is registered.
    not_mine: Option<u64>,
}

impl Local {
    pub(crate) fn new(shared: Arc<Shared>, bounds: Bounds) -> Self {
        Local {
            shared,
            chunks: Vec::new(),
            meta: Vec::new(),
            vacant: Vec::new(),
            index: AddrMap::default(),
            recent: [None; RECENT],
            slots: Box::new([EMPTY_SLOT; SLOTS]),
            occupied: [[0; SLOTS / 64]; 2],
            bounds,
            cached_bytes: 0,
            cached_count: 0,
            live_count: 0,
            cur: [0; 9],
            hi: [0; 9],
            base: Five::default(),
            epoch: 0,
            dirty: false,
            retired: false,
            max_cached: 0,
            tick: 0,
            window_misses: 0,
            window_hits: 0,
            paused: 0,
            handed_back: false,
            pause: 0,
            not_mine: None,
        }
    }

    /// What the owner knows of descriptor `i`; `None` when it is vacant.
    #[inline(always)]
    fn meta_of(&self, i: u32) -> Option<&Meta> {
        self.meta.get(i as usize).and_then(Option::as_ref)
    }

    #[inline(always)]
    fn meta_mut(&mut self, i: u32) -> Option<&mut Meta> {
        self.meta.get_mut(i as usize).and_then(Option::as_mut)
    }

    #[inline]
    fn desc(&self, i: u32) -> Option<&Desc> {
        self.chunks
            .get(i as usize / CHUNK)
            .map(|c| &c.0[i as usize % CHUNK])
    }

    /// The delta's `current` values (`3 * quantity + pool`): what the shared counters give
    /// (this thread is their only writer; see [`cur`](Self::cur)'s field).
    #[inline(always)]
    pub(crate) fn cur(&self) -> [i64; 9] {
        self.cur
    }

    /// Counts `v = [count, bytes, requested]` as allocated in pool `p` (1 small, 2 large): in
    /// the shared counters and in [`cur`](Self::cur).
    #[inline(always)]
    fn count_allocated(&mut self, p: usize, v: [i64; 3]) {
        self.shared.counters.hit(p, v);
        let p = p % 3;
        for (q, &x) in v.iter().enumerate() {
            self.cur[3 * q] += x;
            self.cur[3 * q + p] += x;
        }
    }

    /// Counts `v` as freed in pool `p`: in the shared counters and in [`cur`](Self::cur).
    #[inline(always)]
    fn count_freed(&mut self, p: usize, v: [i64; 3]) {
        self.shared.counters.cache(p, v);
        let p = p % 3;
        for (q, &x) in v.iter().enumerate() {
            self.cur[3 * q] -= x;
            self.cur[3 * q + p] -= x;
        }
    }

    /// Updates slot `s`'s bit in [`occupied`](Self::occupied) (a slot's key, and so its pool,
    /// changes only while the slot is empty, so the bit is always in its key's row).
    #[inline(always)]
    fn mark(&mut self, s: usize) {
        let bit = 1u64 << (s % 64);
        let row = &mut self.occupied[kind_row(pool_kind(self.slots[s].size))];
        if self.slots[s].len > 0 {
            row[s / 64] |= bit;
        } else {
            row[s / 64] &= !bit;
        }
    }

    #[inline]
    fn find_slot(&self, stream: StreamId, rounded: usize) -> Option<usize> {
        let i = home_slot(stream, rounded);
        [i, i ^ 1].into_iter().find(|&s| {
            let slot = &self.slots[s];
            slot.size == rounded && slot.stream == stream
        })
    }

    /// A cache hit: a cached block for `(stream, rounded)`, now live for a request of `req`
    /// bytes. Returns `(address, block size)`.
    #[inline]
    pub(crate) fn take(
        &mut self,
        stream: StreamId,
        rounded: usize,
        req: usize,
    ) -> Option<(u64, usize)> {
        // A quiet cache's misses skip the bin look-up.
        if self.cached_count == 0 {
            return None;
        }
        let s = self.find_slot(stream, rounded)?;
        let slot = self.slots.get_mut(s)?;
        let len = slot.len.checked_sub(1)?;
        let i = *slot.idx.get(len as usize)?;
        // What the hit needs of the block, read before the compare-and-swap (a binned
        // descriptor always has its record).
        let m = self.meta.get_mut(i as usize)?.as_mut()?;
        let (ptr, bs, kind) = (m.ptr, m.block_size, m.kind);
        let d = self
            .chunks
            .get(i as usize / CHUNK)
            .map(|c| &c.0[i as usize % CHUNK])?;
        // A flush may have taken it (GONE): the locked path cleans up.
        d.transition(CACHED, LIVE).ok()?;
        d.set_user_req(req);
        m.in_bin = false;
        slot.len = len;
        if slot.strikes != 0 {
            slot.strikes = 0;
        }
        if len == 0 {
            self.occupied[kind_row(pool_kind(rounded))][s / 64] &= !(1u64 << (s % 64));
        }
        self.cached_bytes -= bs;
        self.cached_count -= 1;
        self.live_count += 1;
        self.dirty = true;
        self.window_hits = self.window_hits.wrapping_add(1);
        let p = pool_index(kind);
        let v = [1, bs as i64, req as i64];
        self.count_allocated(p, v);
        // The peak candidates: a store only when a value passes its high-water mark.
        for (h, &c) in self.hi.iter_mut().zip(&self.cur) {
            if c > *h {
                *h = c;
            }
        }
        Some((ptr, bs))
    }

    /// A free of `ptr`: into a bin when it is managed here, live, there is room, and
    /// `may_cache`.
    #[inline]
    pub(crate) fn give(&mut self, ptr: u64, may_cache: bool) -> Give {
        let h = recent_slot(ptr);
        let i = match self.recent[h] {
            Some((p, i)) if p == ptr => i,
            _ => match self.index.get(&ptr) {
                Some(&i) => {
                    self.recent[h] = Some((ptr, i));
                    i
                }
                None => {
                    self.not_mine = Some(ptr);
                    return Give::NotMine;
                }
            },
        };
        // The descriptor must be the block at `ptr`: a vacant one, or one reused for another
        // block, never takes the free.
        // Held (mutably) to the end: the record is marked binned without a second look-up.
        let Some(m) = self.meta.get_mut(i as usize).and_then(Option::as_mut) else {
            return Give::Slow;
        };
        if m.ptr != ptr {
            return Give::Slow;
        }
        let (bs, rounded, stream, kind, home) = (
            m.block_size,
            m.rounded,
            m.stream,
            m.kind,
            m.home as usize % SLOTS,
        );
        let Some(d) = self
            .chunks
            .get(i as usize / CHUNK)
            .map(|c| &c.0[i as usize % CHUNK])
        else {
            return Give::Slow;
        };
        if !may_cache
            || self.paused > 0
            || self.cached_bytes + bs > self.bounds.max_bytes
            || d.needs_core.load(std::sync::atomic::Ordering::Relaxed)
        {
            return Give::Slow;
        }
        // The bin, whether an empty slot must first take the key, and its length: all decided
        // before the compare-and-swap, so that nothing is looked at twice after it.
        let (s, fresh, len) = {
            let (a, b) = (&self.slots[home], &self.slots[home ^ 1]);
            if a.size == rounded && a.stream == stream {
                (home, false, a.len as usize)
            } else if b.size == rounded && b.stream == stream {
                (home ^ 1, false, b.len as usize)
            } else if a.len == 0 {
                (home, true, 0)
            } else if b.len == 0 {
                (home ^ 1, true, 0)
            } else {
                return Give::Slow;
            }
        };
        if len >= SLOT_CAP {
            return Give::Slow;
        }
        match d.transition(LIVE, CACHED) {
            Ok(()) => {}
            Err(CACHED) => return Give::DoubleFree,
            Err(_) => return Give::Slow,
        }
        let req = d.user_req();
        let slot = &mut self.slots[s];
        if fresh {
            *slot = Slot {
                size: rounded,
                stream,
                ..EMPTY_SLOT
            };
        }
        if let Some(e) = slot.idx.get_mut(len) {
            *e = i;
        }
        slot.len = len as u8 + 1;
        if len == 0 {
            self.occupied[kind_row(pool_kind(rounded))][s / 64] |= 1u64 << (s % 64);
        }
        m.in_bin = true;
        self.cached_bytes += bs;
        self.cached_count += 1;
        self.max_cached = self.max_cached.max(rounded);
        self.live_count -= 1;
        self.dirty = true;
        let p = pool_index(kind);
        let v = [1, bs as i64, req as i64];
        self.count_freed(p, v);
        Give::Cached
    }

    // ---- locked path (the caller holds the core lock) ---------------------------------------

    /// Whether the last free of this thread found `ptr` unmanaged here (no block was registered
    /// since: only this thread registers blocks here); forgets the answer.
    #[inline]
    pub(crate) fn take_not_mine(&mut self, ptr: u64) -> bool {
        self.not_mine.take() == Some(ptr)
    }

    /// Counts a miss; returns whether the cache is active (admitting blocks). A cache that got
    /// fewer than [`HITS_PER_MISS`] hits per miss over the last window of [`WINDOW`] misses
    /// (random sizes, or sizes that come back too rarely) pauses for [`PAUSE_WINDOWS`] windows,
    /// then tries again; each further trial that does not pay doubles the pause, up to
    /// [`MAX_PAUSE_WINDOWS`].
    pub(crate) fn note_miss(&mut self) -> bool {
        self.window_misses += 1;
        if self.window_misses >= WINDOW {
            let productive = f64::from(self.window_hits) >= f64::from(WINDOW) * HITS_PER_MISS;
            if self.paused > 0 {
                self.paused -= 1;
            } else if !productive {
                // Each unproductive trial doubles the next pause.
                self.pause = (self.pause * 2).clamp(PAUSE_WINDOWS, MAX_PAUSE_WINDOWS);
                self.paused = self.pause;
            } else {
                self.pause = 0;
            }
            self.window_misses = 0;
            self.window_hits = 0;
        }
        if self.paused == 0 {
            self.handed_back = false;
        }
        self.paused == 0
    }

    /// Once per pause, when nothing is cached: the live blocks this cache manages go back to
    /// the core, which holds them as allocated already (a block live in a cache counts the
    /// same in the user view as in the core's unless a hit served it for another requested
    /// size; those stay). Returns their addresses, for the owner map. A paused cache caches no
    /// free, so without this its long-lived blocks (weights, optimizer state) would keep it
    /// managing blocks, and every free looking it up, for good (Note [Dormant front]).
    pub(crate) fn hand_back_live(&mut self) -> Vec<u64> {
        if self.paused == 0 || self.handed_back || self.cached_count > 0 || self.live_count == 0 {
            return Vec::new();
        }
        self.handed_back = true;
        let mut out = Vec::new();
        let entries: Vec<(u64, u32)> = self.index.iter().map(|(&p, &i)| (p, i)).collect();
        for (ptr, i) in entries {
            let Some(d) = self.desc(i) else {
                continue;
            };
            let v = d.view();
            if v.ptr != ptr || v.user_req != v.core_req || d.transition(LIVE, VACANT).is_err() {
                continue;
            }
            self.live_count -= 1;
            self.forget(i, ptr);
            out.push(ptr);
        }
        out
    }

    /// Paused and managing no block at all (none live, none cached, none taken away and not yet
    /// cleaned up, no counters left to publish): while every cache is so, the allocator may
    /// skip the front altogether (Note [Dormant front]). Publishes the answer in the shared half
    /// for the other threads' locked paths.
    pub(crate) fn publish_ready(&mut self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let ready = self.paused > 0
            && self.cached_count == 0
            && self.live_count == 0
            && !self.dirty
            && !self.retired
            && !self.shared.taken_pending.load(Relaxed);
        if self.shared.ready.load(Relaxed) != ready {
            self.shared.ready.store(ready, Relaxed);
        }
        ready
    }

    /// Nothing to do on the locked path: no hit possible before the next synchronisation (see
    /// [`may_hit`](Self::may_hit)), no hit or cached free since the last one, nothing taken
    /// away.
    pub(crate) fn idle(&self) -> bool {
        !self.may_hit()
            && !self.dirty
            && !self
                .shared
                .taken_pending
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a hit may happen before the next synchronisation: a block is cached, or a live
    /// one may be freed into a bin (not while paused).
    pub(crate) fn may_hit(&self) -> bool {
        self.cached_count > 0 || (self.live_count > 0 && self.paused == 0)
    }

    /// The descriptor index and state of a block managed here.
    pub(crate) fn find(&self, ptr: u64) -> Option<(u32, u32)> {
        let &i = self.index.get(&ptr)?;
        let d = self.desc(i)?;
        Some((i, d.state.load(std::sync::atomic::Ordering::Acquire)))
    }

    /// Whether a new block for `(stream, rounded)` should be managed here. A key is admitted on
    /// its second sighting: the first only marks a free probe slot with it (the oldest seen), so
    /// sizes that never come back cost no bookkeeping. A key whose probe slots other keys hold
    /// strikes the weaker one; at [`EVICT_STRIKES`] that slot gives way: its blocks come back in
    /// `evicted` (for [`evict`](Self::evict)) and the key takes it.
    pub(crate) fn claim(
        &mut self,
        stream: StreamId,
        rounded: usize,
        evicted: &mut Evicted,
    ) -> bool {
        evicted.len = 0;
        self.tick = self.tick.wrapping_add(1);
        let home = home_slot(stream, rounded);
        let mut free: Option<usize> = None;
        for s in [home, home ^ 1] {
            let (size, st, len, seen) = {
                let slot = &self.slots[s];
                (slot.size, slot.stream, slot.len, slot.seen)
            };
            if size == rounded && st == stream {
                self.slots[s].seen = self.tick;
                return (len as usize) < SLOT_CAP;
            }
            if len == 0 && free.is_none_or(|f| self.slots[f].seen > seen) {
                free = Some(s);
            }
        }
        if let Some(s) = free {
            self.slots[s] = Slot {
                size: rounded,
                stream,
                seen: self.tick,
                ..EMPTY_SLOT
            };
            return false;
        }
        let (a, b) = (home, home ^ 1);
        let victim = if self.slots[a].strikes >= self.slots[b].strikes {
            a
        } else {
            b
        };
        let slot = &mut self.slots[victim];
        slot.strikes = slot.strikes.saturating_add(1);
        if slot.strikes < EVICT_STRIKES {
            return false;
        }
        let n = slot.len as usize;
        evicted.idx[..n].copy_from_slice(&slot.idx[..n]);
        evicted.len = n;
        slot.len = 0;
        // Clears the bit in the old key's row (the new key's pool may differ).
        self.mark(victim);
        self.slots[victim] = Slot {
            size: rounded,
            stream,
            seen: self.tick,
            ..EMPTY_SLOT
        };
        for k in 0..n {
            if let Some(m) = self.meta_mut(evicted.idx[k]) {
                m.in_bin = false;
            }
        }
        true
    }

    /// The bins holding blocks that the core's best fit could choose for a `(stream, rounded)`
    /// request: of `stream`, in the same pool, of at least `rounded` bytes (one bit per slot;
    /// all zero when none).
    pub(crate) fn candidates(&mut self, stream: StreamId, rounded: usize) -> [u64; SLOTS / 64] {
        let mut mask = [0u64; SLOTS / 64];
        if self.cached_count == 0 {
            self.max_cached = 0;
            return mask;
        }
        if rounded > self.max_cached {
            return mask;
        }
        let row = kind_row(pool_kind(rounded));
        for (w, m) in mask.iter_mut().enumerate() {
            let mut bits = self.occupied[row][w];
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let slot = &self.slots[w * 64 + b];
                if slot.stream == stream && slot.size >= rounded {
                    *m |= 1 << b;
                }
            }
        }
        mask
    }

    /// Gives back the blocks of the bins in `mask` (from [`candidates`](Self::candidates)): each
    /// leaves its bin and the delta and goes to `f`, which frees it in the core (where it merges
    /// with its free neighbours).
    pub(crate) fn drain(&mut self, mask: [u64; SLOTS / 64], mut f: impl FnMut(DescView)) {
        for (w, &m) in mask.iter().enumerate() {
            let mut bits = m;
            while bits != 0 {
                let s = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let slot = self.slots[s];
                self.slots[s].len = 0;
                self.mark(s);
                for &i in &slot.idx[..slot.len as usize] {
                    if let Some(m) = self.meta_mut(i) {
                        m.in_bin = false;
                    }
                    if let Some(v) = self.evict(i) {
                        f(v);
                    }
                }
            }
        }
    }

    /// Takes out of their bins up to `out.len()` cached blocks of `stream` in pool `kind` whose
    /// address `pred` accepts, for the core (each leaves the delta as in
    /// [`evict`](Self::evict)); writes their addresses to `out` and returns how many. The
    /// other blocks keep their bins and their order.
    pub(crate) fn take_where(
        &mut self,
        stream: StreamId,
        kind: PoolKind,
        mut pred: impl FnMut(u64) -> bool,
        out: &mut [u64],
    ) -> usize {
        let mut n = 0;
        if self.cached_count == 0 {
            return n;
        }
        let row = kind_row(kind);
        for w in 0..SLOTS / 64 {
            let mut bits = self.occupied[row][w];
            while bits != 0 && n < out.len() {
                let s = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if self.slots[s].stream != stream {
                    continue;
                }
                let slot = self.slots[s];
                let mut keep = 0;
                for &i in &slot.idx[..slot.len as usize] {
                    let take = n < out.len() && self.meta_of(i).is_some_and(|m| pred(m.ptr));
                    if !take {
                        self.slots[s].idx[keep] = i;
                        keep += 1;
                        continue;
                    }
                    if let Some(m) = self.meta_mut(i) {
                        m.in_bin = false;
                    }
                    // `None`: a flush of another thread took it (it returns it to the core).
                    if let Some(v) = self.evict(i) {
                        out[n] = v.ptr;
                        n += 1;
                    }
                }
                self.slots[s].len = keep as u8;
                self.mark(s);
            }
        }
        n
    }

    /// Takes back an evicted cached block for the core: its contribution leaves the delta.
    /// `None` if it was not cached any more.
    pub(crate) fn evict(&mut self, i: u32) -> Option<DescView> {
        let d = self.desc(i)?;
        d.transition(CACHED, VACANT).ok()?;
        let v = d.view();
        self.count_freed(pool_index(v.kind), v.contribution(CACHED));
        self.retired = true;
        self.cached_count -= 1;
        self.cached_bytes -= v.block_size;
        self.forget(i, v.ptr);
        Some(v)
    }

    /// Takes back a live block of this thread for the core (a free that cannot be cached).
    /// `Err(state)` when it is not live.
    pub(crate) fn retire_live(&mut self, i: u32) -> Result<DescView, u32> {
        let d = self.desc(i).ok_or(VACANT)?;
        d.transition(LIVE, VACANT)?;
        let v = d.view();
        self.count_freed(pool_index(v.kind), v.contribution(LIVE));
        self.retired = true;
        self.live_count -= 1;
        self.forget(i, v.ptr);
        Ok(v)
    }

    fn forget(&mut self, i: u32, ptr: u64) {
        if self.index.get(&ptr) == Some(&i) {
            self.index.remove(&ptr);
        }
        let r = &mut self.recent[recent_slot(ptr)];
        if *r == Some((ptr, i)) {
            *r = None;
        }
        if let Some(m) = self.meta.get_mut(i as usize) {
            *m = None;
        }
        self.vacant.push(i);
    }

    /// Starts managing a block the core just allocated for a user on this thread; returns its
    /// descriptor index.
    pub(crate) fn register(&mut self, v: &DescView, rounded: usize, stream: StreamId) -> u32 {
        self.not_mine = None;
        let i = match self.vacant.pop() {
            Some(i) => i,
            None => {
                let n = self.meta.len();
                if n % CHUNK == 0 {
                    let c = Arc::new(Chunk::default());
                    self.shared.chunks.lock().push(Arc::clone(&c));
                    self.chunks.push(c);
                }
                self.meta.push(None);
                n as u32
            }
        };
        if let Some(d) = self.desc(i) {
            d.fill(v);
        }
        if let Some(m) = self.meta.get_mut(i as usize) {
            *m = Some(Meta {
                ptr: v.ptr,
                block_size: v.block_size,
                rounded,
                stream,
                kind: v.kind,
                home: home_slot(stream, rounded) as u16,
                in_bin: false,
            });
        }
        self.index.insert(v.ptr, i);
        self.recent[recent_slot(v.ptr)] = Some((v.ptr, i));
        self.live_count += 1;
        i
    }

    /// Cleans up after blocks other threads took away (flushed or freed): each leaves the bins
    /// and the index, and its contribution moves from the foreign account (through `f`) back into
    /// this cache's delta as retired.
    pub(crate) fn process_taken(&mut self, mut f: impl FnMut(&Taken)) {
        // Pushers set the flag under the core lock, which the caller holds too.
        if !self
            .shared
            .taken_pending
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        self.shared
            .taken_pending
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let taken = std::mem::take(&mut *self.shared.taken.lock());
        for t in &taken {
            let i = t.desc;
            let Some(m) = self.meta_of(i).copied() else {
                continue;
            };
            if m.in_bin {
                if let Some(s) = self.find_slot(m.stream, m.rounded) {
                    let slot = &mut self.slots[s];
                    let n = slot.len as usize;
                    if let Some(k) = slot.idx[..n].iter().position(|&x| x == i) {
                        slot.idx.copy_within(k + 1..n, k);
                        slot.len -= 1;
                    }
                    self.mark(s);
                }
                self.cached_count -= 1;
                self.cached_bytes -= m.block_size;
            } else {
                self.live_count -= 1;
            }
            self.count_freed(pool_index(t.kind), t.contribution);
            self.retired = true;
            f(t);
            if let Some(d) = self.desc(i) {
                d.state.store(VACANT, std::sync::atomic::Ordering::Release);
            }
            self.forget(i, m.ptr);
        }
        // Keep the queue's buffer for next time (no allocation on the next flush).
        let mut q = self.shared.taken.lock();
        if q.is_empty() {
            let mut taken = taken;
            taken.clear();
            *q = taken;
        }
    }

    /// Checks the owner's structures against the descriptors: the bins hold exactly the
    /// `CACHED` descriptors, each once, under its key; a live block is in no bin; every managed
    /// descriptor agrees with the owner's record of it (address), and only managed ones have a
    /// record; the index and the recent-address cache hold exactly the managed blocks under their
    /// own addresses; the counters match. Call after [`process_taken`](Self::process_taken).
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.cur != self.shared.counters.currents() {
            return Err(format!(
                "the owner's copy of the delta's current values {:?} is not the counters' {:?}",
                self.cur,
                self.shared.counters.currents()
            ));
        }
        let mut binned = vec![false; self.meta.len()];
        let (mut cached, mut cached_bytes) = (0usize, 0usize);
        for (s, slot) in self.slots.iter().enumerate() {
            let bit = |row: usize| self.occupied[row][s / 64] >> (s % 64) & 1 == 1;
            let row = kind_row(pool_kind(slot.size));
            if bit(row) != (slot.len > 0) || bit(1 - row) {
                return Err(format!(
                    "slot {s}'s occupancy bits disagree with its length"
                ));
            }
            for &i in &slot.idx[..slot.len as usize] {
                let m = self.meta_of(i).ok_or("a bin names a vacant descriptor")?;
                let st = self
                    .desc(i)
                    .map(|d| d.state.load(std::sync::atomic::Ordering::Acquire));
                if st != Some(CACHED) || !m.in_bin || binned[i as usize] {
                    return Err(format!(
                        "bin entry {i} at {:#x} is not a cached block binned once (state {st:?}: \
                         a live block must never sit in a bin)",
                        m.ptr
                    ));
                }
                if (m.rounded, m.stream) != (slot.size, slot.stream) {
                    return Err(format!("block {i} sits under another key"));
                }
                binned[i as usize] = true;
                cached += 1;
                cached_bytes += m.block_size;
            }
        }
        let mut live = 0usize;
        let mut indexed = 0usize;
        for (i, m) in self.meta.iter().enumerate() {
            let d = self.desc(i as u32);
            let st = d.map(|d| d.state.load(std::sync::atomic::Ordering::Acquire));
            match st {
                Some(LIVE) => live += 1,
                Some(CACHED) if !binned[i] => return Err(format!("cached block {i} is in no bin")),
                Some(GONE) => return Err(format!("block {i} taken away but not cleaned up")),
                _ => {}
            }
            let managed = matches!(st, Some(LIVE) | Some(CACHED));
            match (m, d) {
                (Some(m), Some(d)) if managed => {
                    indexed += 1;
                    if d.view().ptr != m.ptr {
                        return Err(format!("descriptor {i} and its record name other blocks"));
                    }
                    if st == Some(LIVE) && m.in_bin {
                        return Err(format!("live block {i} at {:#x} is marked binned", m.ptr));
                    }
                    if self.index.get(&m.ptr) != Some(&(i as u32)) {
                        return Err(format!("managed block {i} is missing from the index"));
                    }
                }
                (None, _) if !managed => {}
                _ => {
                    return Err(format!(
                        "descriptor {i} (state {st:?}) has a record: {}",
                        m.is_some()
                    ));
                }
            }
        }
        if indexed != self.index.len() {
            return Err("the index holds blocks that are not managed".into());
        }
        for &(ptr, i) in self.recent.iter().flatten() {
            if self.index.get(&ptr) != Some(&i) || self.meta_of(i).map(|m| m.ptr) != Some(ptr) {
                return Err(format!(
                    "the recent-address cache names block {i} at {ptr:#x} wrongly"
                ));
            }
        }
        if (cached, cached_bytes, live) != (self.cached_count, self.cached_bytes, self.live_count) {
            return Err("cached/live counters disagree with a recount".into());
        }
        Ok(())
    }
}

/// This thread's caches, by allocator id.
#[derive(Debug)]
struct Table(Vec<(u64, Local)>);

impl Drop for Table {
    fn drop(&mut self) {
        for (_, local) in self.0.drain(..) {
            local.shared.thread_exited();
        }
    }
}

thread_local! {
    static TABLE: RefCell<Table> = const { RefCell::new(Table(Vec::new())) };
}

/// Runs `f` on this thread's cache for allocator `id`; `None` when it has none, or the table is
/// in use or gone (the thread is exiting).
#[inline]
pub(crate) fn with_local<R>(id: u64, f: impl FnOnce(&mut Local) -> R) -> Option<R> {
    TABLE
        .try_with(|t| {
            let mut t = t.try_borrow_mut().ok()?;
            let (_, local) = t.0.iter_mut().find(|(i, _)| *i == id)?;
            Some(f(local))
        })
        .ok()
        .flatten()
}

/// Runs `f` on this thread's cache for allocator `id`, creating it with `make` first if there
/// is none (dropping caches of allocators that no longer exist). `None` when the table is in use
/// or gone, or `make` declines.
pub(crate) fn with_local_or_make<R>(
    id: u64,
    make: impl FnOnce() -> Option<Local>,
    f: impl FnOnce(&mut Local) -> R,
) -> Option<R> {
    TABLE
        .try_with(|t| {
            let mut t = t.try_borrow_mut().ok()?;
            let pos = match t.0.iter().position(|(i, _)| *i == id) {
                Some(p) => p,
                None => {
                    let local = make()?;
                    // Only this table still holds the shared half of a dropped allocator's cache.
                    t.0.retain(|(_, l)| Arc::strong_count(&l.shared) > 1);
                    t.0.push((id, local));
                    t.0.len() - 1
                }
            };
            t.0.get_mut(pos).map(|(_, local)| f(local))
        })
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::front::shared::DescView;
    use std::sync::atomic::AtomicUsize;

    fn local_with_block(ptr: u64) -> Local {
        let shared = Arc::new(Shared::new(Arc::new(AtomicUsize::new(0))));
        let mut l = Local::new(
            shared,
            Bounds {
                max_block: 1 << 28,
                max_bytes: 1 << 30,
                max_split_size: usize::MAX,
            },
        );
        let v = DescView {
            ptr,
            block_size: 4096,
            kind: PoolKind::Small,
            core_req: 4096,
            user_req: 4096,
        };
        assert_eq!(l.register(&v, 4096, StreamId(0)), 0);
        l
    }

    #[test]
    fn sentinel_addresses_never_match_a_descriptor() {
        let mut l = local_with_block(0x10_0000);
        for p in [0, u64::MAX, u64::MAX - 511, 0x10_0000 + 512] {
            assert_eq!(l.give(p, true), Give::NotMine, "{p:#x}");
        }
        assert_eq!(l.cached_count, 0);
        l.check().unwrap();
        assert_eq!(l.give(0x10_0000, true), Give::Cached);
        l.check().unwrap();
        assert_eq!(l.give(0x10_0000, true), Give::DoubleFree);
    }

    /// The checker sees a recent-address entry that would hand a live block to a bogus free (the
    /// #14 defect: an empty entry matched `u64::MAX`), and a live block marked binned.
    #[test]
    fn the_checker_sees_aliasing_entries() {
        let mut l = local_with_block(0x10_0000);
        l.check().unwrap();
        l.recent[recent_slot(u64::MAX)] = Some((u64::MAX, 0));
        assert!(l.check().unwrap_err().contains("recent-address"));
        let mut l = local_with_block(0x10_0000);
        l.recent[recent_slot(0x20_0000)] = Some((0x20_0000, 0));
        assert!(l.check().is_err());
        let mut l = local_with_block(0x10_0000);
        if let Some(m) = l.meta_mut(0) {
            m.in_bin = true;
        }
        assert!(l.check().unwrap_err().contains("live block 0"));
    }
}
