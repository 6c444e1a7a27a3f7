//! The caching allocator: [`CachingAllocator`] over any [`DeviceBackend`].
//!
//! All mutable state of the core sits in one `State` behind one `parking_lot::Mutex` (PyTorch's
//! one mutex per device), with the fast path's bookkeeping beside it; the algorithm is in
//! `state.rs`, the invariant checker in `invariants.rs`, the summary table in `summary.rs`. With
//! `fast_path` on, per-thread front caches (`front/`) serve cache hits and frees before the lock
//! is taken. May use: everything below it (backend, config, size_class, stats, int_hash).

mod block;
mod device_calls;
mod fragmentation;
mod front;
mod history;
mod invariants;
mod pool;
mod pool_checkpoint;
mod segment_events;
mod shared_pages;
mod snapshot;
mod state;
mod summary;

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::{Mutex, MutexGuard};

pub use fragmentation::{FragmentationReport, FreeBucket};
pub use invariants::InvariantViolation;
pub use pool_checkpoint::{PoolCheckpoint, PoolRestore};
pub use segment_events::{SegmentAction, SegmentEvent, SegmentObserver};
pub use shared_pages::SharedPages;
pub use snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};
pub use state::{MemPoolId, PoolFilter, capture_filter};
pub use summary::memory_summary;

use crate::backend::{DeviceAddr, DeviceBackend, StreamId};
use crate::config::AllocatorConfig;
use crate::error::{AllocError, Result};
use crate::stats::{MemoryStats, Stat};
use crate::trace::{Trace, TraceOp, TraceSource};
use front::{FastFree, Front, FrontLocked};
use history::History;
use state::State;

/// One live allocation: what [`CachingAllocator::allocate`] returns.
///
/// It is a plain record; give it back with [`CachingAllocator::free`] (or use
/// [`CachingAllocator::allocate_owned`] for a handle that frees itself on drop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "an allocation that is not freed stays allocated"]
pub struct Allocation {
    /// Device address (null for a zero-byte request).
    pub ptr: DeviceAddr,
    /// Requested size in bytes.
    pub size: usize,
    /// Size of the block backing it (the rounded size).
    pub block_size: usize,
    /// The stream it was allocated on (and may be reused on without synchronization).
    pub stream: StreamId,
}

/// What a free did with its block ([`CachingAllocator::free_with_outcome`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FreeOutcome {
    /// The block is back in the cache (or in the calling thread's fast-path cache).
    Cached,
    /// The block waits for the work that streams recorded with
    /// [`CachingAllocator::record_stream`] had queued by the free; a
    /// [`SegmentAction::FreeCompleted`] event names it when it is back.
    AwaitingStreams,
}

/// A PyTorch-style caching allocator over a device backend.
///
/// ```
/// use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, SimDevice, StreamId};
/// let alloc = CachingAllocator::new(SimDevice::with_capacity(1 << 30), AllocatorConfig::pytorch()).unwrap();
/// let a = alloc.allocate(1000, StreamId::DEFAULT).unwrap();
/// assert_eq!(a.block_size, 1024);
/// alloc.free(a.ptr).unwrap();
/// let b = alloc.allocate(1000, StreamId::DEFAULT).unwrap(); // a cache hit: same block
/// assert_eq!(a.ptr, b.ptr);
/// assert_eq!(alloc.memory_stats().num_device_alloc, 1);
/// # alloc.free(b.ptr).unwrap();
/// ```
///
/// Dropping the allocator gives its cached memory back to the device as
/// [`empty_cache`](Self::empty_cache) does, so it waits for the device's queued work on that
/// memory first. Allocations still live then stay valid: the memory under them is never released
/// (it is leaked, with a `tracing` warning naming how many), nor are the free segments of private
/// pools still in use (a captured graph may replay into them), while the rest of the cache is
/// released. With a graph capture underway nothing is released, nor while unwinding from a panic
/// with allocations live.
pub struct CachingAllocator<B: DeviceBackend> {
    backend: B,
    state: Mutex<Locked>,
    /// The per-thread front caches, when `fast_path` is on.
    front: Option<Front>,
    /// Reserved bytes and segments, copied out at the end of every locked operation.
    mirror: Mirror,
}

/// Note [Reserved mirror]: reserved bytes and the segment count change only under the lock
/// (front caches never change them), so every guard of the lock copies them into two atomics as
/// it is dropped, before the unlock. A read of the atomics then gives the values as of the end of
/// the last locked operation, which are the values now: the replay loop reads them after every
/// allocation without taking the lock ([`CachingAllocator::reserved_and_segments`]).
#[derive(Debug, Default)]
struct Mirror {
    reserved: AtomicI64,
    segments: AtomicI64,
}

/// The allocator's lock held: the state, with [`Mirror`] refreshed on drop.
struct Guard<'a> {
    guard: MutexGuard<'a, Locked>,
    mirror: &'a Mirror,
}

impl Deref for Guard<'_> {
    type Target = Locked;
    #[inline]
    fn deref(&self) -> &Locked {
        &self.guard
    }
}

impl DerefMut for Guard<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut Locked {
        &mut self.guard
    }
}

impl Drop for Guard<'_> {
    #[inline]
    fn drop(&mut self) {
        let stats = &self.guard.st.stats;
        self.mirror
            .reserved
            .store(stats.memory_reserved(), Ordering::Relaxed);
        self.mirror.segments.store(
            stats.segment.get(crate::stats::StatType::All).current,
            Ordering::Relaxed,
        );
    }
}

/// What the allocator's one lock guards: the core's state and the fast path's bookkeeping.
#[derive(Debug)]
struct Locked {
    st: State,
    front: FrontLocked,
}

impl Deref for Locked {
    type Target = State;
    fn deref(&self) -> &State {
        &self.st
    }
}

impl DerefMut for Locked {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl<B: DeviceBackend> fmt::Debug for CachingAllocator<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("CachingAllocator")
            .field("device", &self.backend.device_index())
            .field("reserved_bytes", &st.total_allocated_memory)
            .field("allocated_bytes", &st.stats.memory_allocated())
            .field("segments", &st.segments.len())
            .field("fast_path", &self.front.is_some())
            .finish()
    }
}

impl<B: DeviceBackend> CachingAllocator<B> {
    /// An allocator over `backend` with `config` (validated).
    ///
    /// # Errors
    /// [`AllocError::Config`] for an invalid configuration, or an expandable page size that is
    /// not a multiple of the device's virtual-memory granularity; [`AllocError::Backend`] if the
    /// device's memory size cannot be read, or its alignment is not a power of two.
    pub fn new(backend: B, config: AllocatorConfig) -> Result<Self> {
        config.validate()?;
        let total = backend
            .mem_info()
            .map_err(|source| AllocError::Backend {
                operation: "mem_info",
                source,
            })?
            .total;
        let align = backend.alignment();
        if !align.is_power_of_two() {
            return Err(AllocError::Backend {
                operation: "alignment",
                source: crate::backend::BackendError::InvalidArgument {
                    operation: "alignment",
                    reason: format!(
                        "the backend reports an alignment of {align} bytes, which is not a power \
                         of two (a SimConfig's alignment must be one)"
                    ),
                },
            });
        }
        let granularity = backend.vm_granularity();
        if let Some(g) = granularity {
            config.validate_for_granularity(g)?;
        }
        if let Ok(info) = backend.mem_info() {
            config.validate_for_device(info.total)?;
        }
        let front = config.fast_path.then(|| Front::new(&config));
        let alloc = CachingAllocator {
            backend,
            state: Mutex::new(Locked {
                st: State::new(config, total, granularity),
                front: FrontLocked::default(),
            }),
            front,
            mirror: Mirror::default(),
        };
        // Fills the mirror (Note [Reserved mirror]).
        drop(alloc.lock());
        Ok(alloc)
    }

    /// Takes the allocator's one lock.
    #[inline]
    fn lock(&self) -> Guard<'_> {
        Guard {
            guard: self.state.lock(),
            mirror: &self.mirror,
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A copy of the configuration in force.
    pub fn config(&self) -> AllocatorConfig {
        self.lock().config.clone()
    }

    /// Allocates `size` bytes for use on `stream`. A request of 0 bytes returns a null pointer and
    /// touches nothing (as PyTorch does).
    ///
    /// # Errors
    /// [`AllocError::OutOfMemory`] after the whole retry chain (with a report and verdict);
    /// [`AllocError::TooLarge`] for 1 EiB or more; [`AllocError::InvalidStream`] for a stream the
    /// backend rejects; [`AllocError::Backend`] for other device failures. The allocator stays
    /// intact after any error.
    pub fn allocate(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        if let Some(front) = &self.front {
            if !front.dormant() {
                if let Some(a) = front.try_alloc(size, stream) {
                    return Ok(a);
                }
            }
        }
        self.allocate_locked(size, stream)
    }

    /// `allocate` under the lock (everything but a front-cache hit), out of line so that the
    /// hit path keeps a small frame.
    #[inline(never)]
    fn allocate_locked(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        let r = match &self.front {
            Some(front) => front.alloc_locked(st, fl, &self.backend, size, stream),
            None => st.malloc(&self.backend, size, stream),
        };
        if let (Some(h), Ok(a)) = (&mut st.history, &r) {
            if !a.ptr.is_null() {
                h.alloc(a.ptr, size, stream);
            }
        }
        self.after_op(st, "allocate");
        r
    }

    /// Frees the allocation starting at `ptr` (a null pointer is a no-op). The block goes back to
    /// the cache at once, or once the streams recorded with
    /// [`record_stream`](Self::record_stream) finished their work.
    ///
    /// # Errors
    /// [`AllocError::DoubleFree`], [`AllocError::InteriorPointer`] or
    /// [`AllocError::UnknownPointer`] for a pointer that is not a live allocation (nothing
    /// changes); [`AllocError::Backend`] if recording a stream event failed and waiting for
    /// that stream failed too: the allocation is gone for the caller, but its block stays out of
    /// the cache until a later attempt (at the next allocation or `empty_cache`) fences or waits
    /// for the stream.
    pub fn free(&self, ptr: DeviceAddr) -> Result<()> {
        if let Some(front) = self.front.as_ref().filter(|f| !f.dormant()) {
            if let FastFree::Done(r) = front.try_free(ptr) {
                return r;
            }
        }
        self.free_locked(ptr).map(|_| ())
    }

    /// [`free`](Self::free), telling whether the block is back in the cache or still waits for
    /// the work of streams recorded with [`record_stream`](Self::record_stream). A segment
    /// observer ([`set_segment_observer`](Self::set_segment_observer)) is told
    /// [`SegmentAction::FreeCompleted`] when such a block comes back: with both, a caller can
    /// write PyTorch's `free_requested` / `free_completed` trace entries as PyTorch does.
    ///
    /// # Errors
    /// As [`free`](Self::free).
    pub fn free_with_outcome(&self, ptr: DeviceAddr) -> Result<FreeOutcome> {
        if let Some(front) = self.front.as_ref().filter(|f| !f.dormant()) {
            if let FastFree::Done(r) = front.try_free(ptr) {
                return r.map(|()| FreeOutcome::Cached);
            }
        }
        self.free_locked(ptr)
    }

    /// `free` under the lock (everything but a free into this thread's front cache), out of line
    /// so that the fast path keeps a small frame.
    #[inline(never)]
    fn free_locked(&self, ptr: DeviceAddr) -> Result<FreeOutcome> {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        st.last_free_awaited = false;
        let r = match &self.front {
            // Note [Dormant front] (front/mod.rs): no cache manages a block.
            Some(front) if !front.dormant() => front.free_locked(st, fl, &self.backend, ptr),
            _ => st.free(&self.backend, ptr),
        };
        if let (Some(h), Ok(())) = (&mut st.history, &r) {
            h.free(ptr);
        }
        let awaited = std::mem::take(&mut st.last_free_awaited);
        self.after_op(st, "free");
        r.map(|()| {
            if awaited {
                FreeOutcome::AwaitingStreams
            } else {
                FreeOutcome::Cached
            }
        })
    }

    /// Marks the live allocation at `ptr` as used by `stream` too: when it is freed, its block is
    /// not reused until the work queued on `stream` by then has finished (PyTorch's
    /// `record_stream`).
    ///
    /// # Errors
    /// [`AllocError::InvalidStream`] when the device rejects `stream`;
    /// [`AllocError::FreedPointer`] for a pointer freed before at which a free block still
    /// starts; else the other pointer errors of [`free`](Self::free) (a freed block merged into
    /// a neighbour's reads as an interior pointer, a released one as unknown). Nothing changes on
    /// an error.
    pub fn record_stream(&self, ptr: DeviceAddr, stream: StreamId) -> Result<()> {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        st.admit_stream(&self.backend, stream)?;
        let r = match &self.front {
            Some(front) => front.record_stream_locked(st, fl, ptr, stream),
            None => st.record_stream(ptr, stream),
        };
        // The pointer checks are free's: a freed pointer is no double free here.
        r.map_err(|e| match e {
            AllocError::DoubleFree { ptr } => AllocError::FreedPointer {
                ptr,
                operation: "record_stream",
            },
            e => e,
        })
    }

    /// Whether `ptr` was freed into some thread's fast-path cache: the core still counts it
    /// allocated, but it is no live allocation to its user.
    fn freed_into_a_thread_cache(&self, locked: &Locked, ptr: DeviceAddr) -> bool {
        self.front
            .as_ref()
            .is_some_and(|f| f.is_cached(&locked.front, ptr.0))
    }

    /// Forgets `stream` if nothing in the cache refers to it any more: no mapped block (allocated,
    /// pending or cached free) belongs to it, nor pages lent away while its work on them was still
    /// queued (Note [Lent pages]; the old range of pages moved when idle, whose unmap is left to
    /// the unmap helper, counts as unmapped, as it is without the helper), no block lists it among
    /// the streams using it (`record_stream`), and no event recorded on it is outstanding. Then, still under the
    /// cache's lock, `release` runs (a backend drops its hold on the stream there) and, when it
    /// returns `true`, the stream is dropped from the streams the cache has validated, so a later
    /// allocation on the same id validates it again. Returns whether the stream was forgotten.
    ///
    /// `release` runs under the cache's lock: it must not call back into this allocator.
    pub fn forget_stream(&self, stream: StreamId, release: impl FnOnce() -> bool) -> bool {
        let mut guard = self.lock();
        let st = &mut guard.st;
        if st.stream_referenced(stream) || !release() {
            return false;
        }
        st.forget_known_stream(stream);
        true
    }

    /// Releases every wholly free cached segment to the device, after waiting for pending stream
    /// events, and the free segments of freeable private pools. With the fast path on, every
    /// thread's front cache is flushed back first.
    ///
    /// # Errors
    /// [`AllocError::CaptureUnderway`] while a graph capture is underway (nothing changes);
    /// [`AllocError::Backend`] if a device call failed; what was released before stays released.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.lock();
        if st.capture_underway() {
            return Err(AllocError::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        if let Some(h) = &mut st.history {
            h.op(TraceOp::EmptyCache);
        }
        if let Some(front) = &self.front {
            let Locked { st, front: fl } = &mut *st;
            front.flush(st, fl, &self.backend);
        }
        let r = st.release_cached_blocks(&self.backend);
        self.after_op(&st, "empty_cache");
        r
    }

    // ---- private pools (graph capture) -------------------------------------------------------

    /// PyTorch's `createOrIncrefPool`: makes private pool `pool` with a use count of 1, or adds
    /// one use to it. Give each use back with [`release_pool`](Self::release_pool).
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] for the default pool `(0, 0)`, or for a pool that was released
    /// and still holds memory (call [`empty_cache`](Self::empty_cache) first).
    pub fn create_pool(&self, pool: MemPoolId) -> Result<()> {
        self.lock().create_or_incref_pool(pool).map(|_| ())
    }

    /// PyTorch's `beginAllocateToPool`: adds one use to private pool `pool` (making it if new)
    /// and routes every allocation on a stream `filter` accepts into it, until
    /// [`end_allocate_to_pool`](Self::end_allocate_to_pool). Routings are searched newest first.
    /// While any routing is active a capture is underway
    /// ([`capture_underway`](Self::capture_underway)): the cache makes no event query,
    /// synchronization or release, and the fast path is bypassed (`docs/algorithm.md`).
    ///
    /// The pool's blocks are served only to allocations routed to it; their frees (during the
    /// routing or after) return them to it. The pool's memory goes back to the device only after
    /// its last use was given back with [`release_pool`](Self::release_pool), at the next
    /// [`empty_cache`](Self::empty_cache) (or out-of-memory release).
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] for the default pool, a pool already being routed to, or a
    /// released pool that still holds memory.
    pub fn begin_allocate_to_pool(&self, pool: MemPoolId, filter: PoolFilter) -> Result<()> {
        self.begin_route(pool, Some(filter), None)
    }

    /// [`begin_allocate_to_pool`](Self::begin_allocate_to_pool) with the filter "the streams
    /// the backend reports as capturing into `capture_id`"
    /// ([`DeviceBackend::stream_capture_id`]): the capture's origin stream and every stream
    /// joined into it (forked through an event wait).
    ///
    /// # Errors
    /// As [`begin_allocate_to_pool`](Self::begin_allocate_to_pool).
    pub fn begin_allocate_to_capture(&self, pool: MemPoolId, capture_id: u64) -> Result<()> {
        self.begin_route(pool, None, Some(capture_id))
    }

    fn begin_route(
        &self,
        pool: MemPoolId,
        filter: Option<PoolFilter>,
        capture: Option<u64>,
    ) -> Result<()> {
        let mut guard = self.lock();
        guard.begin_allocate_to_pool(pool, filter, capture)?;
        if let Some(front) = &self.front {
            front.set_routing(true);
        }
        Ok(())
    }

    /// PyTorch's `endAllocateToPool`: stops routing allocations into `pool` (the pool and its
    /// blocks stay). When no routing is left, the frees deferred during the capture record their
    /// stream events.
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] when allocations are not being routed to `pool`;
    /// [`AllocError::Backend`] when recording a deferred stream event failed (the routing ended
    /// all the same).
    pub fn end_allocate_to_pool(&self, pool: MemPoolId) -> Result<()> {
        let mut guard = self.lock();
        let r = guard.end_allocate_to_pool(&self.backend, pool);
        if let Some(front) = &self.front {
            front.set_routing(guard.capture_underway());
        }
        self.after_op(&guard, "end_allocate_to_pool");
        r
    }

    /// PyTorch's `releasePool`: gives back one use of `pool`. At 0 the pool is freeable: its
    /// free segments go back to the device at the next [`empty_cache`](Self::empty_cache) (or
    /// out-of-memory release), and blocks still allocated from it return to it when freed and
    /// are released at a later one.
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] for an unknown pool, one still being routed to, or one whose
    /// uses were all given back already.
    pub fn release_pool(&self, pool: MemPoolId) -> Result<()> {
        self.lock().release_pool(pool)
    }

    /// PyTorch's `setUseOnOOM` (`torch.cuda.MemPool(use_on_oom=True)`): whether an allocation
    /// of the default pools whose device allocation failed may take a free block of private pool
    /// `pool` instead, before any cached memory is released (PyTorch's `try_mempool_fallback`). The block stays the pool's (it goes
    /// back there when freed); no memory is made for the pool on such an allocation's behalf.
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] when there is no such private pool.
    pub fn set_use_on_oom(&self, pool: MemPoolId, on: bool) -> Result<()> {
        self.lock().set_use_on_oom(pool, on)
    }

    /// PyTorch's `setNoSplit` (`torch.cuda.MemPool(no_split=True)`): whether blocks of private
    /// pool `pool` are handed out whole, never split, so that each allocation of the pool owns
    /// its block (symmetric memory's one signal pad per allocation). Only splitting changes:
    /// sizes are rounded and segments made as for any pool, so a 512-byte allocation of such a
    /// pool holds a whole 2 MiB block and a 4 MiB one a whole 20 MiB segment, and a freed block
    /// serves a later, smaller allocation of the pool whole (Note [No-split pools]).
    ///
    /// # Errors
    /// [`AllocError::InvalidPool`] when there is no such private pool.
    pub fn set_no_split(&self, pool: MemPoolId, on: bool) -> Result<()> {
        self.lock().set_no_split(pool, on)
    }

    /// The use count of private pool `pool` (`None` when there is no such pool: never made, or
    /// released and emptied).
    pub fn pool_use_count(&self, pool: MemPoolId) -> Option<u32> {
        self.lock().graph.use_count(pool)
    }

    /// The private pool an allocation on `stream` would be served from now: that of the newest
    /// routing whose filter accepts the stream, or `None` for the default pools (also when no
    /// routing is active, and when a capture routing's query of the stream fails: an
    /// allocation would then fail).
    pub fn routed_pool(&self, stream: StreamId) -> Option<MemPoolId> {
        self.lock().routed_pool(&self.backend, stream)
    }

    /// The private pool whose memory the live allocation at `ptr` is: `None` for memory of the
    /// default pools, and when no live allocation starts at `ptr`.
    pub fn pool_of(&self, ptr: DeviceAddr) -> Option<MemPoolId> {
        self.lock().pool_of_allocation(ptr.0)
    }

    /// The base address and size of the segment holding the live allocation at `ptr` (PyTorch's
    /// `getBaseAllocation`): a fixed segment whole, or the mapped run of an expandable segment
    /// around it, as the [snapshot](Self::snapshot) lists segments. `None` when no live
    /// allocation starts at `ptr`. A lookup through the block list, not a snapshot.
    pub fn base_allocation(&self, ptr: DeviceAddr) -> Option<(DeviceAddr, usize)> {
        let guard = self.lock();
        if self.freed_into_a_thread_cache(&guard, ptr) {
            return None;
        }
        let (base, size) = snapshot::base_of_allocation(&guard, ptr.0)?;
        Some((DeviceAddr(base), size))
    }

    /// Whether a graph capture is underway: some routing to a private pool is active
    /// (PyTorch: `captures_underway` is not empty).
    pub fn capture_underway(&self) -> bool {
        self.lock().capture_underway()
    }

    /// Lets device `peer` read and write this allocator's memory, as PyTorch's
    /// `enablePeerAccess` does for its expandable segments: mapped pages are reachable only by
    /// the devices their access was set for (the driver's peer access covers `cuMemAlloc`
    /// memory, not mappings), so every page mapped now is granted to `peer`, and every page
    /// mapped later is too. The driver's own peer access between the two contexts
    /// (`cuCtxEnablePeerAccess`) is the caller's; with fixed segments it is all there is, and
    /// this call does nothing. Calling it again for the same peer does nothing.
    ///
    /// # Errors
    /// [`AllocError::Backend`] for a peer the backend rejects (this device, one that does not
    /// exist or cannot reach this one) or a driver error while granting; pages granted before
    /// the error keep their access, pages mapped later are granted as well, and calling again
    /// grants every page again.
    pub fn enable_peer_access(&self, peer: usize) -> Result<()> {
        let mut st = self.lock();
        if !st.expandable || st.peers.contains(&peer) {
            return Ok(());
        }
        // The backend may be shared with other allocators (`&D`, `Arc<D>`) and know the peer
        // already; this allocator's pages are granted either way.
        match self.backend.add_peer(peer) {
            Ok(_) => {}
            Err(crate::backend::BackendError::Unsupported(_)) => return Ok(()),
            Err(source) => {
                return Err(AllocError::Backend {
                    operation: "add_peer",
                    source,
                });
            }
        }
        // Old mappings the helper is unmapping are not granted: wait for it, and take back
        // what it finished (Note [Unmaps off the allocating thread]).
        st.collect_unmaps(&self.backend);
        let segments = st.vm_segments.values().flat_map(|seg| {
            seg.handles
                .iter()
                .map(move |(&first, &(_, pages))| (seg.page_addr(first), pages * seg.page_size))
        });
        let lent = st
            .lent
            .iter()
            .flat_map(|r| r.maps.iter().map(|&(va, bytes, _)| (va, bytes)));
        for (va, bytes) in segments.chain(lent) {
            // SAFETY: each range is exactly one mapping the state holds: a segment's handle
            // mapped at its first page (Note [Page reuse] keeps `handles` equal to the live
            // mappings), or a lent block's old mapping, still in place until it is unmapped.
            unsafe { self.backend.grant_peer(DeviceAddr(va), bytes, peer) }.map_err(|source| {
                AllocError::Backend {
                    operation: "grant_peer",
                    source,
                }
            })?;
        }
        // Only now: a call that failed part-way grants everything again when retried.
        st.peers.push(peer);
        Ok(())
    }

    /// Caps the bytes this allocator reserves at `fraction × device total` (1.0 lifts the cap).
    /// The cap is checked before every device allocation.
    ///
    /// # Errors
    /// [`AllocError::InvalidFraction`] outside `[0, 1]`.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidFraction(fraction));
        }
        let mut st = self.lock();
        if let Some(h) = &mut st.history {
            h.op(TraceOp::SetFraction { fraction });
        }
        st.apply_fraction(fraction);
        Ok(())
    }

    /// The memory fraction in force.
    pub fn memory_fraction(&self) -> f64 {
        self.lock().config.per_process_memory_fraction
    }

    /// A copy of all statistics. With the fast path on, the per-thread counters are summed in:
    /// a block in a front cache counts as freed (see `benches/README.md` for the exact meaning
    /// of each counter then).
    pub fn memory_stats(&self) -> MemoryStats {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        match &self.front {
            Some(front) => front.stats(st, fl),
            None => st.stats,
        }
    }

    /// Bytes reserved from the device now (PyTorch's `torch.cuda.memory_reserved()`): one lock
    /// and one counter read, without the copy of every statistic that
    /// [`memory_stats`](Self::memory_stats) makes. Front caches never change it.
    pub fn memory_reserved(&self) -> i64 {
        self.lock().st.stats.memory_reserved()
    }

    /// Bytes handed out now (PyTorch's `torch.cuda.memory_allocated()`). Without the fast path
    /// this is one lock and one counter read; with it the per-thread counters are summed in as
    /// [`memory_stats`](Self::memory_stats) sums them (a block in a front cache counts as freed).
    pub fn memory_allocated(&self) -> i64 {
        if self.front.is_some() {
            return self.memory_stats().memory_allocated();
        }
        self.lock().st.stats.memory_allocated()
    }

    /// Reserved bytes and device segments now, without the lock (Note [Reserved mirror]; the
    /// replay loop's check for a new peak after each allocation).
    #[inline]
    pub(crate) fn reserved_and_segments(&self) -> (i64, i64) {
        (
            self.mirror.reserved.load(Ordering::Relaxed),
            self.mirror.segments.load(Ordering::Relaxed),
        )
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&self) {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        match &self.front {
            Some(front) => front.reset_peak(st, fl),
            None => st.reset_peak_stats(),
        }
    }

    /// `reset_accumulated_memory_stats` (also resets
    /// [`cross_stream_handovers`](Self::cross_stream_handovers),
    /// [`page_loans`](Self::page_loans) and [`blocks_borrowed`](Self::blocks_borrowed)).
    pub fn reset_accumulated_stats(&self) {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        st.cross_stream_handovers = 0;
        st.page_loans = 0;
        st.unmaps_handed_off = 0;
        st.blocks_borrowed = 0;
        st.handles.reset_accumulated();
        match &self.front {
            Some(front) => front.reset_accumulated(st, fl),
            None => st.stats.reset_accumulated(),
        }
    }

    /// How many cached segments were handed from one stream to another
    /// (`cca_cross_stream_reuse`, see `docs/algorithm.md`) since the allocator was made or the
    /// accumulated statistics were last reset. Not one of PyTorch's `memory_stats()` keys
    /// (PyTorch has no such policy); always 0 with the option off.
    pub fn cross_stream_handovers(&self) -> u64 {
        self.lock().cross_stream_handovers
    }

    /// How many runs of free pages whose queued work was still pending were lent to a growing
    /// segment (`cca_page_lending`, Note [Lent pages] in `docs/algorithm.md`, step 23b: mapped
    /// a second time, ordered by an event wait, unmapped at the old address once idle) since
    /// the allocator was made or the accumulated statistics were last reset. Not one of
    /// PyTorch's `memory_stats()` keys; always 0 with the option off.
    pub fn page_loans(&self) -> u64 {
        self.lock().page_loans
    }

    /// How many old mappings of moved pages were handed to the backend's helper thread to unmap
    /// (`cca_unmap_helper`, Note [Unmaps off the allocating thread] in `docs/algorithm.md`, step
    /// 23e) since the allocator was made or the accumulated statistics were last reset. Not one
    /// of PyTorch's `memory_stats()` keys; always 0 with the option off or a backend without a
    /// helper.
    pub fn unmaps_handed_off(&self) -> u64 {
        self.lock().unmaps_handed_off
    }

    /// Device memory allocations backing [`memory_reserved`](Self::memory_reserved): one per
    /// segment of fixed size (a `cudaMalloc`), one per physical handle of an expandable segment
    /// (a `cuMemCreate`, mapped or spare), with their peak and the counts made and given back
    /// since the allocator was made or the accumulated statistics were last reset. The driver's
    /// costs are per handle rather than per byte (`benches/README.md`, device cost), so this
    /// says what a growth or an `empty_cache` costs. Not one of PyTorch's `memory_stats()` keys
    /// (its `segment` statistic counts fixed segments only; expandable segments do not touch
    /// it).
    pub fn memory_handles(&self) -> Stat {
        self.lock().handles
    }

    /// How many allocations borrowed an idle free block of another stream where it lay
    /// (`cca_borrow_blocks`, Note [Borrowed blocks] in `docs/algorithm.md`, step 27b) since the
    /// allocator was made or the accumulated statistics were last reset. Not one of PyTorch's
    /// `memory_stats()` keys; always 0 with the option off.
    pub fn blocks_borrowed(&self) -> u64 {
        self.lock().blocks_borrowed
    }

    /// Gives every block held in the per-thread front caches back to the core (where it merges
    /// with its free neighbours); returns how many. The allocator does this by itself before it
    /// would reserve more memory, on [`empty_cache`](Self::empty_cache) and on the
    /// out-of-memory path; 0 when the fast path is off.
    pub fn flush_thread_caches(&self) -> usize {
        match &self.front {
            Some(front) => {
                let mut guard = self.lock();
                let Locked { st, front: fl } = &mut *guard;
                front.flush(st, fl, &self.backend)
            }
            None => 0,
        }
    }

    /// Whether the fast path (per-thread front caches) is on.
    pub fn fast_path(&self) -> bool {
        self.front.is_some()
    }

    /// PyTorch's `memory_summary()` table for this allocator.
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        let stats = self.memory_stats();
        summary::memory_summary(&stats, self.backend.device_index(), abbreviated)
    }

    /// Where the reserved bytes are now and how fragmented the free memory is: reserved,
    /// allocated, requested, pending and free bytes, the largest free block, a power-of-two
    /// histogram of free block sizes, and the metrics `1 − allocated/reserved` and
    /// `1 − largest free/total free`. Costs one walk over the blocks. With the fast path on, the
    /// per-thread front caches are flushed first (their blocks would count as allocated).
    pub fn fragmentation(&self) -> FragmentationReport {
        let mut guard = self.lock();
        if let Some(front) = &self.front {
            let Locked { st, front: fl } = &mut *guard;
            front.flush(st, fl, &self.backend);
        }
        fragmentation::take(&guard)
    }

    /// [`fragmentation`](Self::fragmentation) as text (kept apart from
    /// [`memory_summary`](Self::memory_summary), whose table is PyTorch's, line for line).
    pub fn fragmentation_summary(&self) -> String {
        self.fragmentation().to_string()
    }

    /// The segments and their blocks, in address order (PyTorch's `memory_snapshot()`).
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let guard = self.lock();
        let mut segments = snapshot::take(&guard.st);
        if let Some(front) = &self.front {
            front.annotate(&guard.front, &mut segments);
        }
        segments
    }

    /// Starts recording this allocator's history in a ring buffer of `capacity` events (the
    /// oldest are dropped when it is full), discarding any earlier recording. Recording is off by
    /// default and costs one branch per operation while off.
    pub fn record_history(&self, capacity: usize) {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        if let Some(front) = &self.front {
            front.set_history(st, fl, &self.backend, true);
        }
        st.history = Some(History::new(capacity));
    }

    /// Sets (or, with `None`, removes) the observer told of every segment this allocator
    /// allocates, frees, maps or unmaps from now on ([`SegmentEvent`]): what PyTorch's trace
    /// trackers see. The observer runs while the allocator's lock is held, so it sees each event
    /// before any other thread can use the memory concerned (a `Free` before the memory goes back
    /// to the driver); it must not call into this allocator.
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        self.lock().st.segment_observer = segment_events::ObserverSlot(observer);
    }

    /// Stops recording and discards the history.
    pub fn stop_history(&self) {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        if let Some(front) = &self.front {
            front.set_history(st, fl, &self.backend, false);
        }
        st.history = None;
    }

    /// The recorded history as a trace (empty when not recording), and the number of events
    /// dropped from the ring so far. Frees whose allocation was dropped are left out.
    pub fn history(&self) -> (Trace, u64) {
        match &self.lock().history {
            Some(h) => (h.to_trace(), h.dropped),
            None => (Trace::new(TraceSource::Recorded), 0),
        }
    }

    /// Runs every invariant check. With the fast path on, call it while no other thread is
    /// allocating or freeing (their front caches are read without stopping them).
    ///
    /// # Errors
    /// The first [`InvariantViolation`] found, naming the invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        let mut guard = self.lock();
        let Locked { st, front: fl } = &mut *guard;
        invariants::check(st)?;
        match &self.front {
            Some(front) => front.check(st, fl),
            None => Ok(()),
        }
    }

    #[inline]
    fn after_op(&self, st: &State, op: &str) {
        #[cfg(feature = "invariant-checks")]
        if let Err(v) = invariants::check(st) {
            // The `invariant-checks` feature exists to stop tests and fuzzing at the first
            // corrupted state; it is never on in production builds.
            panic!("allocator invariant violated after {op}: {v}");
        }
        let _ = (st, op);
    }
}

impl<B: DeviceBackend> CachingAllocator<B> {
    /// Allocates like [`allocate`](Self::allocate) and returns a handle that frees itself on drop.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    pub fn allocate_owned(
        self: &Arc<Self>,
        size: usize,
        stream: StreamId,
    ) -> Result<OwnedAllocation<B>> {
        let allocation = self.allocate(size, stream)?;
        Ok(OwnedAllocation {
            allocator: Arc::clone(self),
            allocation,
        })
    }
}

impl<B: DeviceBackend> Drop for CachingAllocator<B> {
    fn drop(&mut self) {
        let Locked { st, front: fl } = self.state.get_mut();
        if let Some(front) = &self.front {
            front.shutdown(st, fl, &self.backend);
        }
        let live = st.active.len();
        // What empty_cache releases holds no live allocation: release it also when some are
        // left (their memory stays, so their pointers stay valid). Not while unwinding with
        // allocations live: the release waits for the device, where work on them may never end.
        let released = if (live > 0 && std::thread::panicking()) || st.capture_underway() {
            Err("not released (a panic or a capture underway)".to_string())
        } else {
            st.release_cached_blocks(&self.backend)
                .map_err(|e| format!("the release failed: {e}"))
        };
        if live > 0 && !std::thread::panicking() {
            let after = st.total_allocated_memory;
            match released {
                Ok(()) => {
                    tracing::warn!(target: "cuda_caching_allocator", live, bytes = st.stats.memory_allocated(), still_reserved = after, "allocator dropped with live allocations: the memory under them is leaked, with what private pools still in use keep; the rest of the cache was released")
                }
                Err(why) => {
                    tracing::warn!(target: "cuda_caching_allocator", live, bytes = st.stats.memory_allocated(), still_reserved = after, why, "allocator dropped with live allocations: the memory under them is leaked, and the cache was not released")
                }
            }
        }
        st.destroy_events(&self.backend);
    }
}

/// An allocation that returns to its allocator's cache when dropped.
///
/// Each field of [`Allocation`] has an accessor of the same name (`ptr()`, `size()`,
/// `block_size()`, `stream()`); `len()` is `size()` under the name collections use.
pub struct OwnedAllocation<B: DeviceBackend> {
    allocator: Arc<CachingAllocator<B>>,
    allocation: Allocation,
}

impl<B: DeviceBackend> OwnedAllocation<B> {
    /// The allocation record.
    pub fn allocation(&self) -> Allocation {
        self.allocation
    }

    /// Device address.
    pub fn ptr(&self) -> DeviceAddr {
        self.allocation.ptr
    }

    /// Requested size in bytes (the same as [`OwnedAllocation::size`]).
    pub fn len(&self) -> usize {
        self.allocation.size
    }

    /// Requested size in bytes: [`Allocation::size`]'s name for it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, SimDevice, StreamId};
    /// let alloc = Arc::new(CachingAllocator::new(SimDevice::with_capacity(1 << 30), AllocatorConfig::pytorch())?);
    /// let owned = alloc.allocate_owned(1000, StreamId::DEFAULT)?;
    /// assert_eq!(owned.size(), 1000);
    /// assert_eq!(owned.size(), owned.allocation().size);
    /// assert_eq!(owned.size(), owned.len());
    /// # Ok::<(), cuda_caching_allocator::AllocError>(())
    /// ```
    pub fn size(&self) -> usize {
        self.allocation.size
    }

    /// Size of the block backing it in bytes: [`Allocation::block_size`].
    pub fn block_size(&self) -> usize {
        self.allocation.block_size
    }

    /// The stream it was allocated on: [`Allocation::stream`].
    pub fn stream(&self) -> StreamId {
        self.allocation.stream
    }

    /// Whether the allocation is empty (0 bytes).
    pub fn is_empty(&self) -> bool {
        self.allocation.size == 0
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<CachingAllocator<B>> {
        &self.allocator
    }
}

impl<B: DeviceBackend> fmt::Debug for OwnedAllocation<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("OwnedAllocation")
            .field(&self.allocation)
            .finish()
    }
}

impl<B: DeviceBackend> Drop for OwnedAllocation<B> {
    fn drop(&mut self) {
        if let Err(e) = self.allocator.free(self.allocation.ptr) {
            tracing::error!(target: "cuda_caching_allocator", error = %e, "freeing an owned allocation failed");
        }
    }
}
