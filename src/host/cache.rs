//! `PinnedCache`: exact-size sub-allocation from pinned slabs, with stream-ordered reuse.
//!
//! Algorithm (`docs/pinned.md`):
//!
//! 1. A request rounds up to the alignment only. If blocks wait for events, their events are
//!    queried first (none is polled when none waits); completed ones return to the free ranges.
//! 2. Best fit: the smallest free range, over all slabs, that holds the request (ties: lowest
//!    slab, lowest offset); the rest of the range stays free (split). With `max_fit_waste`, a
//!    request larger than a slab skips a range more than `1 + max_fit_waste` times its size.
//! 3. With [`PendingPolicy::Wait`] (the default), if blocks waiting for their events would hold
//!    the request once freed (with their free neighbours), the cache waits on the host for the
//!    oldest such block's events, outside its lock, and goes back to step 1; at most
//!    `max_pending_waits` times per request.
//! 4. Otherwise a new slab of `slab_size` bytes (or the request's size, if larger) is pinned.
//!    If that would pass the cap, wholly free slabs are unpinned first; if it still would, a slab
//!    of exactly the request's size is tried; if even that would, the error names the cap. If
//!    pinning runs out of memory, wholly free slabs are unpinned and pinning is tried once more.
//! 5. A free returns the block at once if no stream was declared for it; otherwise one event is
//!    recorded per declared stream and the block waits until all completed, then merges with its
//!    free neighbours.
//!
//! Note [Pinned unsafe]: the only `unsafe` here calls `HostBackend::unpin` (the slab came from
//! `pin` on the same backend and is idle: no live block and no block waiting for events, so no
//! queued work the cache was told of still uses it) and `DeviceBackend::destroy_event` (the event
//! came from `create_event` on the backend's device and is destroyed once).

use std::collections::{BTreeMap, BTreeSet};

use parking_lot::{Mutex, MutexGuard};

use crate::backend::{BackendError, DeviceBackend, EventHandle, StreamId};

use super::slab::Slab;
use super::{
    HostBackend, HostFence, HostPtr, PendingPolicy, PinnedConfig, PinnedError, PinnedStats,
};

/// A block handed out by [`PinnedCache::alloc`]: where it is and how many bytes were asked for.
/// A plain value: freeing it is the caller's job ([`PinnedCache::free`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedBlock {
    /// Start of the block (aligned to the cache's alignment).
    pub ptr: HostPtr,
    /// Bytes asked for.
    pub size: usize,
}

#[derive(Debug)]
struct Live {
    base: usize,
    len: usize,
    requested: usize,
    streams: Vec<StreamId>,
}

#[derive(Debug)]
struct Waiting {
    addr: usize,
    base: usize,
    len: usize,
    events: Vec<EventHandle>,
    /// Completions handed in by the caller ([`PinnedCache::free_after`]).
    fences: Vec<Box<dyn HostFence>>,
    /// Streams whose work could be fenced neither by an event nor by a synchronization.
    unfenced: Vec<StreamId>,
    /// Order of the free (older first): [`PendingPolicy::Wait`] waits for the oldest block.
    seq: u64,
    /// An allocation took this block's events and fences out to wait for them without the lock
    /// (`Claim`); the block stays waiting until that allocation gives them back.
    claimed: bool,
    /// A host wait for its events or fences failed: allocations no longer wait for it (a
    /// failure such as an event recorded inside a graph capture repeats); queries still free it.
    wait_failed: bool,
}

/// The events and fences of one waiting block, taken out of the state by an allocation that
/// waits for them on the host without holding the lock ([`PendingPolicy::Wait`]).
#[derive(Debug)]
struct Claim {
    addr: usize,
    events: Vec<EventHandle>,
    fences: Vec<Box<dyn HostFence>>,
}

/// What waiting for a [`Claim`] left: the events that completed (back to the spare list) and the
/// events and fences whose wait failed (back to the block).
#[derive(Debug)]
struct Settled {
    addr: usize,
    done: Vec<EventHandle>,
    events: Vec<EventHandle>,
    fences: Vec<Box<dyn HostFence>>,
    /// At least one event or fence was waited for successfully.
    waited: bool,
}

impl Waiting {
    /// Nothing left to wait for, and no allocation holds its events (`Claim`).
    fn is_done(&self) -> bool {
        !self.claimed
            && self.events.is_empty()
            && self.fences.is_empty()
            && self.unfenced.is_empty()
    }
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) slabs: BTreeMap<usize, Slab>,
    /// Every free range of every slab: (length, slab base, offset).
    pub(super) free_index: BTreeSet<(usize, usize, usize)>,
    live: BTreeMap<usize, Live>,
    waiting: Vec<Waiting>,
    spare_events: Vec<EventHandle>,
    /// The next `Waiting::seq`.
    next_seq: u64,
    pub(super) stats: PinnedStats,
}

impl State {
    /// Every live and waiting block as (address, aligned length).
    pub(super) fn owned_ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.live
            .iter()
            .map(|(&a, l)| (a, l.len))
            .chain(self.waiting.iter().map(|w| (w.addr, w.len)))
    }

    /// (allocated, requested, pending) bytes summed from the blocks.
    pub(super) fn byte_totals(&self) -> (usize, usize, usize) {
        let allocated = self.live.values().map(|l| l.len).sum();
        let requested = self.live.values().map(|l| l.requested).sum();
        let pending = self.waiting.iter().map(|w| w.len).sum();
        (allocated, requested, pending)
    }
}

/// A caching allocator for pinned host memory over a [`HostBackend`]. All methods take `&self`;
/// one mutex guards the state.
#[derive(Debug)]
pub struct PinnedCache<H: HostBackend> {
    host: H,
    config: PinnedConfig,
    state: Mutex<State>,
}

fn round_up(n: usize, align: usize) -> Option<usize> {
    n.checked_add(align - 1).map(|v| v & !(align - 1))
}

impl<H: HostBackend> PinnedCache<H> {
    /// A cache over `host` with `config`.
    ///
    /// # Errors
    ///
    /// [`PinnedError::InvalidConfig`] if the alignment is not a power of two or exceeds the
    /// backend's, or the slab size is zero or more than `i64::MAX` bytes (what the statistics
    /// count).
    pub fn new(host: H, config: PinnedConfig) -> Result<Self, PinnedError> {
        if !config.alignment.is_power_of_two() {
            return Err(PinnedError::InvalidConfig(format!(
                "alignment {} is not a power of two",
                config.alignment
            )));
        }
        if config.alignment > host.alignment() {
            return Err(PinnedError::InvalidConfig(format!(
                "alignment {} exceeds the host backend's alignment {}",
                config.alignment,
                host.alignment()
            )));
        }
        if let Some(waste) = config.max_fit_waste {
            if !(waste.is_finite() && waste >= 0.0) {
                return Err(PinnedError::InvalidConfig(format!(
                    "max_fit_waste {waste} is not a finite number >= 0"
                )));
            }
        }
        if let Some(slack) = config.max_slack {
            if !(slack.is_finite() && slack >= 0.0) {
                return Err(PinnedError::InvalidConfig(format!(
                    "max_slack {slack} is not a finite number >= 0"
                )));
            }
        }
        if config.slab_size == 0 {
            return Err(PinnedError::InvalidConfig("slab_size is zero".into()));
        }
        // The slab size in force is the one rounded up to the alignment: `i64::MAX` itself
        // rounds to 2^63, which the statistics cannot count either.
        let slab_size = round_up(config.slab_size, config.alignment)
            .filter(|&s| i64::try_from(s).is_ok())
            .ok_or_else(|| {
                PinnedError::InvalidConfig(format!(
                    "slab_size {} (rounded up to the alignment of {}) is more than the \
                     statistics can count ({} bytes)",
                    config.slab_size,
                    config.alignment,
                    i64::MAX
                ))
            })?;
        let config = PinnedConfig {
            slab_size,
            ..config
        };
        Ok(PinnedCache {
            host,
            config,
            state: Mutex::new(State::default()),
        })
    }

    /// The host backend.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// The configuration in force (slab size rounded up to the alignment).
    pub fn config(&self) -> PinnedConfig {
        self.config
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> PinnedStats {
        self.state.lock().stats.clone()
    }

    /// The statistics as one line ([`PinnedStats::summary`]).
    pub fn summary(&self) -> String {
        self.state.lock().stats.summary()
    }

    /// Resets every peak to the current value.
    pub fn reset_peak_stats(&self) {
        let mut g = self.state.lock();
        let s = &mut g.stats;
        for st in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.pending_bytes,
            &mut s.slabs,
        ] {
            st.reset_peak();
        }
    }

    /// Hands out a block of at least `size` bytes (exactly `size` rounded up to the alignment).
    ///
    /// Blocks only with [`PendingPolicy::Wait`], and only where it would otherwise pin: then it
    /// waits on the host for the events of a block freed after asynchronous work (at most
    /// [`PinnedConfig::max_pending_waits`] times), without holding the cache's lock.
    ///
    /// # Errors
    ///
    /// [`PinnedError::InvalidRequest`] for a zero or overflowing size, or one whose slab would
    /// take the pinned bytes past `i64::MAX` (what the statistics count);
    /// [`PinnedError::CapExceeded`] when a new slab would pass `max_pinned`;
    /// [`PinnedError::Backend`] when pinning fails.
    pub fn alloc(&self, size: usize) -> Result<PinnedBlock, PinnedError> {
        if size == 0 {
            return Err(PinnedError::InvalidRequest(
                "size 0: a pinned block must hold at least one byte".into(),
            ));
        }
        let len = round_up(size, self.config.alignment).ok_or_else(|| {
            PinnedError::InvalidRequest(format!("size {size} overflows when aligned"))
        })?;
        if i64::try_from(len).is_err() {
            // The statistics count bytes in `i64`: no host pins this much, but a backend that
            // claimed to would turn every byte statistic negative.
            return Err(PinnedError::InvalidRequest(format!(
                "size {size} is more than the statistics can count ({} bytes)",
                i64::MAX
            )));
        }
        let mut g = self.state.lock();
        let mut waits = 0u32;
        // Note [The fit rule gives way]: the fit rule only prefers an exact slab to a much larger
        // free range; once no slab can be pinned (the cap, or the host out of memory: the error
        // kept here), a free range it refused still serves the request, and so does a waiting
        // block it refused to wait for.
        let mut no_slab: Option<PinnedError> = None;
        let (base, offset) = loop {
            if !g.waiting.is_empty() {
                self.poll_waiting(&mut g);
            }
            let hit = if no_slab.is_some() {
                g.free_index.range((len, 0, 0)..).next().copied()
            } else {
                self.best_fit(&g, len)
            };
            if let Some((_, base, offset)) = hit {
                g.stats.num_cache_hits += 1;
                break (base, offset);
            }
            let claim = if self.may_wait(&g, waits) {
                self.claim_pending(&mut g, len, no_slab.is_none())
            } else {
                None
            };
            if let Some(claim) = claim {
                waits += 1;
                let settled = MutexGuard::unlocked(&mut g, || self.wait_claim(claim));
                self.settle(&mut g, settled);
                continue;
            }
            if let Some(e) = no_slab {
                return Err(e);
            }
            match self.grow(&mut g, len, size) {
                Ok(base) => break (base, 0),
                Err(e) => no_slab = Some(e),
            }
        };
        self.carve(&mut g, base, offset, len);
        let addr = base + offset;
        g.live.insert(
            addr,
            Live {
                base,
                len,
                requested: size,
                streams: Vec::new(),
            },
        );
        g.stats.allocated_bytes.increase(len as i64);
        g.stats.requested_bytes.increase(size as i64);
        g.stats.num_allocs += 1;
        self.after_op(&g, "alloc");
        Ok(PinnedBlock {
            ptr: HostPtr(addr),
            size,
        })
    }

    /// Declares that queued work on `stream` uses the live block at `ptr` (as PyTorch's
    /// `record_stream`): its free will record an event on `stream` and its reuse will wait for it.
    ///
    /// # Errors
    ///
    /// [`PinnedError::UnknownBlock`] if `ptr` is not live; [`PinnedError::Backend`] if the
    /// device rejects the stream. Nothing changes on error.
    pub fn record_stream(&self, ptr: HostPtr, stream: StreamId) -> Result<(), PinnedError> {
        self.host.device().validate_stream(stream)?;
        let mut g = self.state.lock();
        let live = g
            .live
            .get_mut(&ptr.0)
            .ok_or(PinnedError::UnknownBlock { ptr })?;
        if !live.streams.contains(&stream) {
            live.streams.push(stream);
        }
        Ok(())
    }

    /// The streams declared for the live block at `ptr`, in declaration order.
    ///
    /// # Errors
    ///
    /// [`PinnedError::UnknownBlock`] if `ptr` is not live.
    pub fn streams_of(&self, ptr: HostPtr) -> Result<Vec<StreamId>, PinnedError> {
        let g = self.state.lock();
        g.live
            .get(&ptr.0)
            .map(|l| l.streams.clone())
            .ok_or(PinnedError::UnknownBlock { ptr })
    }

    /// Frees the live block at `ptr`. With no stream declared, the bytes are reusable at once;
    /// otherwise an event is recorded on each declared stream and reuse waits for all of them.
    /// If recording an event fails, the stream is synchronized instead.
    ///
    /// # Errors
    ///
    /// [`PinnedError::UnknownBlock`] if `ptr` is not live (nothing changes);
    /// [`PinnedError::Fence`] if a stream could be fenced neither by an event nor by a
    /// synchronization: the block is freed but stays out of reuse until
    /// [`empty_cache`](Self::empty_cache) manages to synchronize that stream.
    pub fn free(&self, ptr: HostPtr) -> Result<(), PinnedError> {
        self.free_fenced(ptr, None)
    }

    /// Frees the live block at `ptr` as [`free`](Self::free) does, and also keeps it out of
    /// reuse until `fence` completed: for work the cache was not told of through
    /// [`record_stream`](Self::record_stream), such as an event cudarc recorded after a copy
    /// (the cudarc interop's `CachedPinned` frees this way). A fence that is already complete
    /// costs one query and the block is reusable at once.
    ///
    /// # Errors
    ///
    /// As [`free`](Self::free); on [`PinnedError::UnknownBlock`] the fence is dropped.
    pub fn free_after(&self, ptr: HostPtr, fence: Box<dyn HostFence>) -> Result<(), PinnedError> {
        self.free_fenced(ptr, Some(fence))
    }

    fn free_fenced(
        &self,
        ptr: HostPtr,
        fence: Option<Box<dyn HostFence>>,
    ) -> Result<(), PinnedError> {
        let mut g = self.state.lock();
        let live = g
            .live
            .remove(&ptr.0)
            .ok_or(PinnedError::UnknownBlock { ptr })?;
        g.stats.allocated_bytes.decrease(live.len as i64);
        g.stats.requested_bytes.decrease(live.requested as i64);
        g.stats.num_frees += 1;
        let mut events = Vec::new();
        let mut unfenced = Vec::new();
        let mut first_err = None;
        for &stream in &live.streams {
            match self.fence(&mut g, stream) {
                Ok(Some(ev)) => events.push(ev),
                Ok(None) => {}
                Err(e) => {
                    unfenced.push(stream);
                    if first_err.is_none() {
                        first_err = Some(PinnedError::Fence { stream, source: e });
                    }
                }
            }
        }
        let mut fences = Vec::new();
        if let Some(mut f) = fence {
            g.stats.num_event_queries += 1;
            if !matches!(f.query(), Ok(true)) {
                fences.push(f);
            }
        }
        if events.is_empty() && unfenced.is_empty() && fences.is_empty() {
            self.release_block(&mut g, live.base, ptr.0);
        } else {
            g.stats.pending_bytes.increase(live.len as i64);
            let seq = g.next_seq;
            g.next_seq = seq.wrapping_add(1);
            g.waiting.push(Waiting {
                addr: ptr.0,
                base: live.base,
                len: live.len,
                events,
                fences,
                unfenced,
                seq,
                claimed: false,
                wait_failed: false,
            });
        }
        self.after_op(&g, "free");
        first_err.map_or(Ok(()), Err)
    }

    /// Unpins every wholly free slab (after collecting blocks whose events completed, and
    /// synchronizing streams that could not be fenced at their free) and destroys cached
    /// events. Returns the bytes unpinned.
    ///
    /// # Errors
    ///
    /// [`PinnedError::Backend`] if unpinning a slab failed: that slab stays pinned and cached;
    /// the others are released.
    pub fn empty_cache(&self) -> Result<usize, PinnedError> {
        let mut g = self.state.lock();
        for i in 0..g.waiting.len() {
            let streams = match g.waiting.get(i) {
                Some(w) => w.unfenced.clone(),
                None => break,
            };
            for stream in streams {
                g.stats.num_stream_syncs += 1;
                if self.host.device().synchronize_stream(stream).is_ok() {
                    if let Some(w) = g.waiting.get_mut(i) {
                        w.unfenced.retain(|&s| s != stream);
                    }
                }
            }
        }
        if !g.waiting.is_empty() {
            self.poll_waiting(&mut g);
        }
        for ev in std::mem::take(&mut g.spare_events) {
            // SAFETY: Note [Pinned unsafe]: spare events came from `create_event` on this
            // device and leave the spare list here, so each is destroyed once.
            let _ = unsafe { self.host.device().destroy_event(ev) };
        }
        let result = self.release_idle(&mut g);
        self.after_op(&g, "empty_cache");
        result
    }

    /// Checks every invariant of the cache's state (`invariants.rs`).
    ///
    /// # Errors
    ///
    /// The first violated invariant.
    pub fn check_invariants(&self) -> Result<(), super::PinnedInvariantViolation> {
        super::invariants::check(&self.state.lock(), &self.config)
    }

    /// Number of freed blocks still waiting for stream events.
    pub fn waiting_blocks(&self) -> usize {
        self.state.lock().waiting.len()
    }

    fn after_op(&self, st: &State, op: &str) {
        #[cfg(feature = "invariant-checks")]
        if let Err(v) = super::invariants::check(st, &self.config) {
            // The `invariant-checks` feature exists to stop tests at the first corrupted state;
            // it is never on in production builds.
            panic!("pinned cache invariant violated after {op}: {v}");
        }
        let _ = (st, op);
    }

    /// Records an event on `stream`, or synchronizes it if that fails. `Ok(None)`: synchronized.
    fn fence(&self, g: &mut State, stream: StreamId) -> Result<Option<EventHandle>, BackendError> {
        let dev = self.host.device();
        let ev = match g.spare_events.pop() {
            Some(ev) => Ok(ev),
            None => dev.create_event(),
        };
        let recorded: Result<(), BackendError> = match ev {
            Ok(ev) => match dev.record_event(ev, stream) {
                Ok(()) => {
                    g.stats.num_event_records += 1;
                    return Ok(Some(ev));
                }
                Err(e) => {
                    g.spare_events.push(ev);
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        tracing::debug!(?stream, error = ?recorded.err(), "pinned free: event failed, synchronizing the stream");
        g.stats.num_stream_syncs += 1;
        dev.synchronize_stream(stream).map(|()| None)
    }

    /// Queries the events of waiting blocks; returns completed blocks to the free ranges.
    fn poll_waiting(&self, g: &mut State) {
        let dev = self.host.device();
        let mut i = 0;
        while i < g.waiting.len() {
            let mut done = Vec::new();
            let mut queries = 0;
            if let Some(w) = g.waiting.get_mut(i) {
                w.events.retain(|&ev| {
                    queries += 1;
                    let complete = matches!(dev.query_event(ev), Ok(true));
                    if complete {
                        done.push(ev);
                    }
                    !complete
                });
            }
            if let Some(w) = g.waiting.get_mut(i) {
                w.fences.retain_mut(|f| {
                    queries += 1;
                    !matches!(f.query(), Ok(true))
                });
            }
            g.stats.num_event_queries += queries;
            g.spare_events.extend(done);
            let finished = g.waiting.get(i).is_some_and(Waiting::is_done);
            if finished {
                let w = g.waiting.swap_remove(i);
                g.stats.pending_bytes.decrease(w.len as i64);
                self.release_block(g, w.base, w.addr);
            } else {
                i += 1;
            }
        }
    }

    /// The smallest free range that holds `len` bytes and that the fit rule accepts, as
    /// (length, slab base, offset).
    fn best_fit(&self, g: &State, len: usize) -> Option<(usize, usize, usize)> {
        let hit = g.free_index.range((len, 0, 0)..).next().copied()?;
        // A larger range wastes more, so if the smallest one is refused all are.
        (!self.fit_refuses(len, hit.0)).then_some(hit)
    }

    /// The fit rule (`PinnedConfig::max_fit_waste`): a request that would get a slab of its own
    /// takes no range much larger than itself; it pins an exact slab instead.
    fn fit_refuses(&self, len: usize, have: usize) -> bool {
        self.config.max_fit_waste.is_some_and(|waste| {
            len > self.config.slab_size && have as f64 > len as f64 * (1.0 + waste)
        })
    }

    /// Whether an allocation that made `waits` host waits may wait for a waiting block
    /// ([`PendingPolicy::Wait`], fewer than `max_pending_waits` waits so far, a block waiting).
    fn may_wait(&self, g: &State, waits: u32) -> bool {
        self.config.pending == PendingPolicy::Wait
            && waits < self.config.max_pending_waits
            && !g.waiting.is_empty()
    }

    /// [`PendingPolicy::Wait`]: picks the oldest waiting block that, once its events complete,
    /// gives back a range (the block with its free neighbours) that holds `len` bytes and that
    /// the fit rule accepts (if `honour_fit`: not once no slab could be had); takes its events and fences out and marks it claimed. `None` if no
    /// block qualifies (blocks with an unfenced stream never do: no wait can clear them).
    fn claim_pending(&self, g: &mut State, len: usize, honour_fit: bool) -> Option<Claim> {
        let mut best: Option<(u64, usize)> = None;
        for (i, w) in g.waiting.iter().enumerate() {
            if w.claimed
                || w.wait_failed
                || !w.unfenced.is_empty()
                || (w.events.is_empty() && w.fences.is_empty())
                || best.is_some_and(|(seq, _)| seq <= w.seq)
            {
                continue;
            }
            let Some(merged) = g
                .slabs
                .get(&w.base)
                .and_then(|slab| slab.merged_len(w.addr.saturating_sub(w.base)))
            else {
                continue;
            };
            if merged >= len && !(honour_fit && self.fit_refuses(len, merged)) {
                best = Some((w.seq, i));
            }
        }
        let w = g.waiting.get_mut(best?.1)?;
        w.claimed = true;
        Some(Claim {
            addr: w.addr,
            events: std::mem::take(&mut w.events),
            fences: std::mem::take(&mut w.fences),
        })
    }

    /// Waits on the host for a claimed block's events and fences; called without the lock.
    /// Fences that completed are dropped here, outside the lock.
    fn wait_claim(&self, claim: Claim) -> Settled {
        let dev = self.host.device();
        let mut settled = Settled {
            addr: claim.addr,
            done: Vec::new(),
            events: Vec::new(),
            fences: Vec::new(),
            waited: false,
        };
        for ev in claim.events {
            match dev.synchronize_event(ev) {
                Ok(()) => {
                    settled.waited = true;
                    settled.done.push(ev);
                }
                Err(e) => {
                    tracing::debug!(error = ?e, "pinned alloc: waiting for a pending block's event failed");
                    settled.events.push(ev);
                }
            }
        }
        for mut f in claim.fences {
            match f.wait() {
                Ok(()) => settled.waited = true,
                Err(e) => {
                    tracing::debug!(error = ?e, "pinned alloc: waiting for a pending block's fence failed");
                    settled.fences.push(f);
                }
            }
        }
        settled
    }

    /// Gives a claimed block back its unfinished events and fences; if none is left, the block
    /// returns to the free ranges.
    fn settle(&self, g: &mut State, s: Settled) {
        let failed = !s.events.is_empty() || !s.fences.is_empty();
        if s.waited {
            g.stats.num_pending_waits += 1;
        }
        g.spare_events.extend(s.done);
        let Some(i) = g.waiting.iter().position(|w| w.claimed && w.addr == s.addr) else {
            // Cannot happen (a claimed block leaves `waiting` only here); keep the events.
            g.spare_events.extend(s.events);
            return;
        };
        let finished = match g.waiting.get_mut(i) {
            Some(w) => {
                w.claimed = false;
                w.wait_failed |= failed;
                w.events.extend(s.events);
                w.fences.extend(s.fences);
                w.is_done()
            }
            None => false,
        };
        if finished {
            let w = g.waiting.swap_remove(i);
            g.stats.pending_bytes.decrease(w.len as i64);
            self.release_block(g, w.base, w.addr);
        }
    }

    /// Returns the used range at `addr` of slab `base` to the free ranges.
    fn release_block(&self, g: &mut State, base: usize, addr: usize) {
        let Some(slab) = g.slabs.get_mut(&base) else {
            return;
        };
        if let Some(m) = slab.give_back(addr - base) {
            for (off, len) in m.absorbed.into_iter().flatten() {
                g.free_index.remove(&(len, base, off));
            }
            g.free_index.insert((m.merged.1, base, m.merged.0));
        }
    }

    /// Marks `len` bytes at `offset` of slab `base` used; the rest of the range stays free.
    fn carve(&self, g: &mut State, base: usize, offset: usize, len: usize) {
        let Some(slab) = g.slabs.get_mut(&base) else {
            return;
        };
        if let Some(&have) = slab.free.get(&offset) {
            g.free_index.remove(&(have, base, offset));
        }
        if let Some((rest_off, rest_len)) = slab.take(offset, len) {
            g.free_index.insert((rest_len, base, rest_off));
        }
    }

    /// Pins a new slab for a request of `len` aligned bytes; returns its base.
    fn grow(&self, g: &mut State, len: usize, requested: usize) -> Result<usize, PinnedError> {
        let exact = len;
        let mut slab_len = len.max(self.config.slab_size);
        if let Some(cap) = self.config.max_pinned {
            let pinned = |g: &State| g.stats.reserved_bytes.current.max(0) as usize;
            if pinned(g).saturating_add(slab_len) > cap {
                let _ = self.release_idle(g);
            }
            if pinned(g).saturating_add(slab_len) > cap {
                slab_len = exact;
            }
            if pinned(g).saturating_add(slab_len) > cap {
                return Err(PinnedError::CapExceeded {
                    cap,
                    pinned: pinned(g),
                    would_pin: slab_len,
                    requested,
                });
            }
        }
        if let Some(slack) = self.config.max_slack {
            slab_len = self.make_room(g, len, slab_len, slack);
        }
        // The byte statistics are `i64`: each request fits (`alloc` checks), but the slabs
        // together must too, or the reserved bytes saturate and later unpins drive them below
        // zero. Treated as a cap no configuration can raise.
        let countable = |g: &State, slab_len: usize| {
            i64::try_from(slab_len)
                .ok()
                .and_then(|l| g.stats.reserved_bytes.current.max(0).checked_add(l))
                .is_some()
        };
        if !countable(g, slab_len) {
            let _ = self.release_idle(g);
        }
        if !countable(g, slab_len) {
            slab_len = exact;
        }
        if !countable(g, slab_len) {
            return Err(PinnedError::InvalidRequest(format!(
                "pinning {slab_len} more bytes beside the {} pinned would pass what the \
                 statistics can count ({} bytes); free pinned blocks first",
                g.stats.reserved_bytes.current,
                i64::MAX
            )));
        }
        let pinned = match self.host.pin(slab_len) {
            Ok(p) => p,
            Err(e) if e.is_out_of_memory() => {
                // Retry when any slab was unpinned, also when another one failed to unpin.
                let freed = self.release_idle_partial(g).0;
                let again = if freed > 0 {
                    self.host.pin(slab_len)
                } else {
                    Err(e)
                };
                match again {
                    Ok(p) => p,
                    // A slab of the request's size may still be had where a whole slab is
                    // not, as under the cap.
                    Err(e) if e.is_out_of_memory() && slab_len > exact => {
                        slab_len = exact;
                        self.host.pin(slab_len)?
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let base = pinned.ptr.0;
        g.stats.pin_nanos = g.stats.pin_nanos.saturating_add(pinned.nanos);
        g.stats.num_pins += 1;
        g.stats.reserved_bytes.increase(slab_len as i64);
        g.stats.slabs.increase(1);
        g.slabs.insert(base, Slab::new(slab_len));
        g.free_index.insert((slab_len, base, 0));
        Ok(base)
    }

    /// The slack rule (`PinnedConfig::max_slack`) before pinning `slab_len` bytes for a request
    /// of `len` aligned bytes: if the pinned bytes would pass `(1 + slack)` times the bytes in use
    /// (live and waiting blocks, plus the request), wholly free slabs are unpinned, largest
    /// first, until they would not; if that is not enough, the new slab shrinks to the request's
    /// size. Returns the slab size to pin.
    fn make_room(&self, g: &mut State, len: usize, slab_len: usize, slack: f64) -> usize {
        let in_use = |g: &State| {
            (g.stats.allocated_bytes.current.max(0) + g.stats.pending_bytes.current.max(0)) as usize
        };
        let budget = ((in_use(g).saturating_add(len)) as f64 * (1.0 + slack.max(0.0))) as usize;
        let reserved = |g: &State| g.stats.reserved_bytes.current.max(0) as usize;
        let mut slab_len = slab_len;
        if reserved(g).saturating_add(slab_len) > budget {
            self.release_idle_down_to(g, budget.saturating_sub(slab_len));
        }
        if reserved(g).saturating_add(slab_len) > budget && slab_len > len {
            slab_len = len;
            self.release_idle_down_to(g, budget.saturating_sub(slab_len));
        }
        slab_len
    }

    /// Unpins idle slabs, largest first, until at most `target` bytes stay pinned (or no idle
    /// slab is left). A slab whose unpin fails stays pinned and cached.
    fn release_idle_down_to(&self, g: &mut State, target: usize) {
        let mut idle: Vec<(usize, usize)> = g
            .slabs
            .iter()
            .filter(|(_, s)| s.is_idle())
            .map(|(&b, s)| (s.size, b))
            .collect();
        idle.sort_unstable_by(|a, b| b.cmp(a));
        for (size, base) in idle {
            if g.stats.reserved_bytes.current.max(0) as usize <= target {
                break;
            }
            let _ = self.unpin_slab(g, base, size);
        }
    }

    /// Unpins the idle slab at `base` of `size` bytes and drops it from the state.
    fn unpin_slab(&self, g: &mut State, base: usize, size: usize) -> Result<(), PinnedError> {
        // SAFETY: Note [Pinned unsafe]: callers pass one slab from `pin` on this backend, still
        // pinned (it is in `slabs`), and idle: no live block and no block waiting for events
        // lies in it.
        let nanos = unsafe { self.host.unpin(HostPtr(base), size) }?;
        g.slabs.remove(&base);
        g.free_index.remove(&(size, base, 0));
        g.stats.unpin_nanos = g.stats.unpin_nanos.saturating_add(nanos);
        g.stats.num_unpins += 1;
        g.stats.reserved_bytes.decrease(size as i64);
        g.stats.slabs.decrease(1);
        Ok(())
    }

    /// Unpins every idle slab; returns the bytes unpinned, or the first unpin error (after
    /// trying every slab).
    fn release_idle(&self, g: &mut State) -> Result<usize, PinnedError> {
        let (freed, first_err) = self.release_idle_partial(g);
        first_err.map_or(Ok(freed), Err)
    }

    /// Unpins every idle slab; returns the bytes unpinned and the first unpin error, if any
    /// (every slab is tried: the bytes count those that were unpinned).
    fn release_idle_partial(&self, g: &mut State) -> (usize, Option<PinnedError>) {
        let idle: Vec<(usize, usize)> = g
            .slabs
            .iter()
            .filter(|(_, s)| s.is_idle())
            .map(|(&b, s)| (b, s.size))
            .collect();
        let mut freed = 0;
        let mut first_err = None;
        for (base, size) in idle {
            match self.unpin_slab(g, base, size) {
                Ok(()) => freed += size,
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        (freed, first_err)
    }
}

impl<H: HostBackend> Drop for PinnedCache<H> {
    /// Waits for blocks still waiting on events, destroys every event, and unpins the slabs
    /// that hold no live block and no unfenced block; slabs still holding those are left pinned
    /// (leaked), since work may still use them.
    fn drop(&mut self) {
        let dev = self.host.device();
        let g = self.state.get_mut();
        for w in &mut g.waiting {
            // A block still claimed here lost its events and fences to an allocation whose wait
            // unwound (a fence's `wait` panicked) and never settled: nothing says its work is
            // done, so it keeps its slab pinned.
            let mut synced = !w.claimed;
            for &ev in &w.events {
                synced &= dev.synchronize_event(ev).is_ok();
            }
            for f in &mut w.fences {
                synced &= f.wait().is_ok();
            }
            w.fences.clear();
            if !synced {
                // Keep the block out of the slab so the slab stays pinned.
                w.unfenced.push(StreamId::DEFAULT);
            }
            let events = std::mem::take(&mut w.events);
            g.spare_events.extend(events);
        }
        for ev in std::mem::take(&mut g.spare_events) {
            // SAFETY: Note [Pinned unsafe]: every event came from `create_event` on this device
            // and sits in exactly one list, which is emptied here.
            let _ = unsafe { dev.destroy_event(ev) };
        }
        let waiting = std::mem::take(&mut g.waiting);
        for w in waiting {
            if w.unfenced.is_empty() {
                if let Some(slab) = g.slabs.get_mut(&w.base) {
                    slab.give_back(w.addr - w.base);
                }
            }
        }
        for (&base, slab) in &g.slabs {
            if slab.is_idle() {
                // SAFETY: Note [Pinned unsafe]: the slab came from `pin` on this backend and is
                // idle (no live block; every waiting block's events were synchronized above).
                let _ = unsafe { self.host.unpin(HostPtr(base), slab.size) };
            }
        }
    }
}
