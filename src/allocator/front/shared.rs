//! The part of a thread cache other threads may touch: one descriptor per managed block (its
//! state word and what the core needs to take it back), the cache's statistics counters, and the
//! queue of blocks other threads took away.
//!
//! A descriptor's state moves `VACANT → LIVE ⇄ CACHED → GONE → VACANT`. Only the owner thread
//! makes `VACANT → LIVE`, `LIVE ⇄ CACHED` and `GONE → VACANT`; any thread holding the core lock
//! may take a block away with `CACHED → GONE` (a flush) or `LIVE → GONE` (a free from another
//! thread). The two-way transitions are compare-and-swaps, so a flush and a hit, or two racing
//! frees, never both win: one atomic operation per fast operation, and no lock.
//!
//! The counters are written by the owner only (plain loads and stores of atomics, no
//! read-modify-write) and read by anyone summing statistics, through a sequence lock so that a
//! reader sees them as they were at one instant (see [`Counters`]); the peak bookkeeping stays
//! in the owner's half. May use: `delta`, `size_class`.
#![forbid(unsafe_code)]

use std::sync::Arc;

use super::delta::{Acc, Delta};
use super::sync::{
    AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Mutex, Ordering, fence, wait,
};
use crate::size_class::PoolKind;

/// Descriptors per chunk.
pub(crate) const CHUNK: usize = 64;

/// Descriptor states.
pub(crate) const VACANT: u32 = 0;
/// Handed to a user.
pub(crate) const LIVE: u32 = 1;
/// Freed by its user, kept in the owner's bin.
pub(crate) const CACHED: u32 = 2;
/// Taken back to the core by another thread; the owner has not cleaned up yet.
pub(crate) const GONE: u32 = 3;

const RELAXED: Ordering = Ordering::Relaxed;

/// One managed block as other threads see it.
#[derive(Debug, Default)]
pub(crate) struct Desc {
    pub(crate) state: AtomicU32,
    /// `record_stream` was called on it: its free must go through the core.
    pub(crate) needs_core: AtomicBool,
    large: AtomicBool,
    ptr: AtomicU64,
    block_size: AtomicU64,
    core_req: AtomicU64,
    user_req: AtomicU64,
}

/// A plain copy of a descriptor's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DescView {
    pub(crate) ptr: u64,
    pub(crate) block_size: usize,
    pub(crate) kind: PoolKind,
    /// The requested size the core recorded.
    pub(crate) core_req: usize,
    /// The current user's requested size.
    pub(crate) user_req: usize,
}

impl DescView {
    /// The block's contribution to its cache's delta (user view − core view) in `state`:
    /// `(count, bytes, requested bytes)`.
    pub(crate) fn contribution(&self, state: u32) -> [i64; 3] {
        match state {
            LIVE => [0, 0, self.user_req as i64 - self.core_req as i64],
            CACHED => [-1, -(self.block_size as i64), -(self.core_req as i64)],
            _ => [0, 0, 0],
        }
    }
}

impl Desc {
    /// Fills a vacant descriptor (owner only) and publishes it as `LIVE`.
    pub(crate) fn fill(&self, v: &DescView) {
        self.ptr.store(v.ptr, RELAXED);
        self.block_size.store(v.block_size as u64, RELAXED);
        self.core_req.store(v.core_req as u64, RELAXED);
        self.user_req.store(v.user_req as u64, RELAXED);
        self.large.store(v.kind == PoolKind::Large, RELAXED);
        self.needs_core.store(false, RELAXED);
        self.state.store(LIVE, Ordering::Release);
    }

    /// The fields (read after an acquiring load or exchange of `state`).
    pub(crate) fn view(&self) -> DescView {
        DescView {
            ptr: self.ptr.load(RELAXED),
            block_size: self.block_size.load(RELAXED) as usize,
            kind: if self.large.load(RELAXED) {
                PoolKind::Large
            } else {
                PoolKind::Small
            },
            core_req: self.core_req.load(RELAXED) as usize,
            user_req: self.user_req.load(RELAXED) as usize,
        }
    }

    /// The current user's requested size.
    #[inline]
    pub(crate) fn user_req(&self) -> usize {
        self.user_req.load(RELAXED) as usize
    }

    /// Records the current user's requested size (owner only, while it holds the block live).
    #[inline]
    pub(crate) fn set_user_req(&self, req: usize) {
        self.user_req.store(req as u64, RELAXED);
    }

    /// `from → to`, once.
    #[inline]
    pub(crate) fn transition(&self, from: u32, to: u32) -> Result<(), u32> {
        self.state
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }
}

/// A fixed block of descriptors (chunks never move, so the owner indexes them without a lock).
#[derive(Debug)]
pub(crate) struct Chunk(pub(crate) [Desc; CHUNK]);

impl Default for Chunk {
    fn default() -> Self {
        Chunk(std::array::from_fn(|_| Desc::default()))
    }
}

/// A block another thread took away: its descriptor and the delta contribution it moved into
/// the cache's foreign account.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Taken {
    pub(crate) desc: u32,
    pub(crate) kind: PoolKind,
    pub(crate) contribution: [i64; 3],
}

/// Index of `(quantity, pool, field)` in [`Counters`]: quantity 0–2 (count, bytes, requested),
/// pool 1–2 (small, large), field 0 (`allocated`) or 1 (`freed`).
#[inline(always)]
fn slot(q: usize, p: usize, f: usize) -> usize {
    q * 4 + (p - 1) * 2 + f
}

/// The statistics delta of one cache: written by the owner only (plain loads and stores of
/// atomics), read by whoever sums the statistics.
///
/// Only `allocated` and `freed` are stored, per pool: every change of `current` is a change of
/// one of them (a hit allocates, a cached free or a retirement frees), so `current` is their
/// difference and `all` the pools' sum, both formed on read. A hit or a cached free writes three
/// counters.
///
/// Note [Consistent counter reads]: `current` is a difference of two counters that the owner
/// moves while other threads read them, so reading them one by one could pair an old
/// `allocated` with a new `freed` (a current far below zero, which raised or lowered the
/// user-view peaks too). The owner wraps each update in a sequence lock: `seq` turns odd, the
/// counters change, `seq` turns even again. A reader on another thread ([`Counters::delta`])
/// copies the counters between two reads of `seq` and retries until both are the same even
/// value, so it gets the counters as they were at one instant between two updates. The writer
/// never waits (two extra stores of a word it alone writes, on its own cache line); a reader
/// retries only while the owner is mid-update, which takes a few instructions and never
/// blocks (the locked path's updates happen under the lock the reader holds).
#[derive(Debug)]
#[repr(align(64))]
pub(crate) struct Counters {
    /// The sequence word: odd while the owner updates the counters.
    seq: AtomicU64,
    /// Quantity (count, bytes, requested) × pool (small, large) × (allocated, freed).
    d: [AtomicI64; 12],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            seq: AtomicU64::new(0),
            d: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

#[inline(always)]
fn bump(a: &AtomicI64, v: i64) {
    a.store(a.load(RELAXED) + v, RELAXED);
}

/// Index of a pool in the three-slot arrays (`all` is 0).
#[inline(always)]
pub(crate) fn pool_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

impl Counters {
    /// Adds `v` to the three counters of field `f` (0 `allocated`, 1 `freed`) in pool `p`, as one
    /// update of the sequence lock (owner only: see Note [Consistent counter reads]).
    #[inline(always)]
    fn update(&self, p: usize, f: usize, v: [i64; 3]) {
        let s = self.seq.load(RELAXED);
        self.seq.store(s.wrapping_add(1), RELAXED);
        // Orders the odd `seq` before the counter stores for a reader that sees any of them.
        fence(Ordering::Release);
        bump(&self.d[slot(0, p, f)], v[0]);
        bump(&self.d[slot(1, p, f)], v[1]);
        bump(&self.d[slot(2, p, f)], v[2]);
        self.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    /// A cache hit (owner only): `v = [1, bytes, requested]` allocated in pool `p` (1 or 2).
    #[inline(always)]
    pub(crate) fn hit(&self, p: usize, v: [i64; 3]) {
        self.update(p, 0, v);
    }

    /// A free into the owner's bin (owner only): `v = [1, bytes, requested]` freed in pool `p`.
    #[inline(always)]
    pub(crate) fn cache(&self, p: usize, v: [i64; 3]) {
        self.update(p, 1, v);
    }

    /// The twelve counters as they were at one instant between two updates (any thread: see
    /// Note [Consistent counter reads]).
    pub(crate) fn snapshot(&self) -> [i64; 12] {
        let mut spins = 0u32;
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before % 2 == 0 {
                let v: [i64; 12] = std::array::from_fn(|k| self.d[k].load(RELAXED));
                // Orders the counter loads before the second `seq` load: if any of them saw a
                // store of a later update, that update's odd `seq` is visible below.
                fence(Ordering::Acquire);
                if self.seq.load(RELAXED) == before {
                    return v;
                }
            }
            // The owner is mid-update (a few instructions, unless it was preempted there).
            spins += 1;
            wait(spins);
        }
    }

    /// The delta now, read consistently (any thread).
    pub(crate) fn delta(&self) -> Delta {
        let d = self.snapshot();
        let acc = |q: usize, p: usize| {
            let allocated = d[slot(q, p, 0)];
            let freed = d[slot(q, p, 1)];
            Acc {
                current: allocated - freed,
                allocated,
                freed,
            }
        };
        let triple = |q: usize| {
            let (small, large) = (acc(q, 1), acc(q, 2));
            let all = Acc {
                current: small.current + large.current,
                allocated: small.allocated + large.allocated,
                freed: small.freed + large.freed,
            };
            [all, small, large]
        };
        Delta {
            count: triple(0),
            bytes: triple(1),
            req: triple(2),
        }
    }

    /// The `current` values (`3 * quantity + pool`, pool 0 = `all`), for the owner (the only
    /// writer, so its plain loads see its own last update whole; it keeps a copy of them as it
    /// writes, which the invariant checker compares with this); other threads use
    /// [`delta`](Self::delta).
    pub(crate) fn currents(&self) -> [i64; 9] {
        let mut c = [0; 9];
        for q in 0..3 {
            let small = self.d[slot(q, 1, 0)].load(RELAXED) - self.d[slot(q, 1, 1)].load(RELAXED);
            let large = self.d[slot(q, 2, 0)].load(RELAXED) - self.d[slot(q, 2, 1)].load(RELAXED);
            c[3 * q] = small + large;
            c[3 * q + 1] = small;
            c[3 * q + 2] = large;
        }
        c
    }

    /// The number of blocks in the owner's bins (minus the delta's `allocation.all.current`),
    /// before other threads' flushes are cleaned up (any thread).
    pub(crate) fn count_current(&self) -> i64 {
        self.delta().count[0].current
    }
}

/// The shared half of one thread cache.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    /// Every chunk of descriptors, for threads that flush this cache.
    pub(crate) chunks: Mutex<Vec<Arc<Chunk>>>,
    /// Blocks other threads took away, for the owner to clean up.
    pub(crate) taken: Mutex<Vec<Taken>>,
    /// Whether `taken` may be non-empty (set by whoever pushes, under the core lock).
    pub(crate) taken_pending: AtomicBool,
    /// The owner thread has exited.
    pub(crate) exited: AtomicBool,
    /// The allocator's count of exited caches to reclaim.
    pub(crate) exits: Arc<AtomicUsize>,
    /// The owner's cache was, at its last locked allocation, paused and managing no block
    /// ([`Local::publish_ready`](super::local::Local::publish_ready); written by the owner under
    /// the core lock, read under it: Note [Dormant front]).
    pub(crate) ready: AtomicBool,
}

impl Shared {
    pub(crate) fn new(exits: Arc<AtomicUsize>) -> Self {
        Shared {
            counters: Counters::default(),
            chunks: Mutex::new(Vec::new()),
            taken: Mutex::new(Vec::new()),
            taken_pending: AtomicBool::new(false),
            exited: AtomicBool::new(false),
            exits,
            ready: AtomicBool::new(false),
        }
    }

    /// The descriptor `i`, when it exists.
    pub(crate) fn desc(&self, i: u32) -> Option<(Arc<Chunk>, usize)> {
        let chunks = self.chunks.lock();
        let c = chunks.get(i as usize / CHUNK)?;
        Some((Arc::clone(c), i as usize % CHUNK))
    }

    /// Marks the live block `i` as used by another stream: its free goes through the core.
    pub(crate) fn mark_needs_core(&self, i: u32) {
        if let Some((c, k)) = self.desc(i) {
            c.0[k].needs_core.store(true, Ordering::Release);
        }
    }

    /// The state of descriptor `i`.
    pub(crate) fn state(&self, i: u32) -> u32 {
        self.desc(i)
            .map_or(VACANT, |(c, k)| c.0[k].state.load(Ordering::Acquire))
    }

    /// Marks the owner thread gone.
    pub(crate) fn thread_exited(&self) {
        self.exited.store(true, Ordering::Release);
        self.exits.fetch_add(1, Ordering::Release);
    }

    /// Every descriptor in a state of `states`, with its index (for flushes and checks).
    pub(crate) fn each_desc(&self, mut f: impl FnMut(u32, &Desc)) {
        let chunks = self.chunks.lock();
        for (ci, c) in chunks.iter().enumerate() {
            for (k, d) in c.0.iter().enumerate() {
                f((ci * CHUNK + k) as u32, d);
            }
        }
    }
}
