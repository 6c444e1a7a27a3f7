//! `PagedPinnedCache`: pinned host memory reused page by page, the device allocator's default
//! (expandable segments, 2 MiB pages, page reuse) run over a backend whose pages are host pages.
//!
//! [`PinnedCache`](super::PinnedCache) carves fixed slabs, and a request for a slab-sized block
//! needs a nearly empty slab: on a mixed-size workload it pins 1.3–1.5 × what is in use
//! (`docs/pinned.md`). Here the memory is a [`CachingAllocator`] whose backend maps page-locked
//! host pages into reserved address ranges (`CudaDevice::host_pages`: `cuMemCreate` with
//! `CU_MEM_LOCATION_TYPE_HOST`, access for the device and the host; any
//! [`DeviceBackend`] on `SimDevice`). The core packs blocks into its ranges and moves free pages
//! to where a block must grow, so the pinned bytes stay near the bytes in use, at the price of
//! page moves (unmap, map, access) instead of pins.
//!
//! What the core does not know is that the host writes a block outside stream order: it reuses a
//! block freed on its stream at once, which is right for device memory (later work on the stream
//! is queued after the earlier) and wrong for a host buffer that a queued copy still reads. So
//! every block lives on one stream of its own that no work uses, and a block used by copies is
//! given back through [`free_after`](PagedPinnedCache::free_after) with a [`HostFence`]: it
//! reaches the core only once the fence says complete (queried oldest first at each allocation,
//! never when none is waiting). [`record_stream`](PagedPinnedCache::record_stream) is the
//! core's own rule (events recorded at the free) for callers that name their streams.
//!
//! Back-pressure: an allocation that finds fewer cached bytes than it needs while blocks wait
//! for their fences first waits on the host for the oldest (at most `max_pending_waits`, outside
//! every lock), as [`PendingPolicy::Wait`](super::PendingPolicy::Wait) does for slabs, so a
//! producer running ahead of its copies reuses memory instead of mapping more.
//!
//! May use: `allocator`, `backend`, `config`, `stats`, `host` values.

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::{HostFence, HostPtr, PinnedError, PinnedInvariantViolation, PinnedStats};
use crate::allocator::CachingAllocator;
use crate::backend::{DeviceAddr, DeviceBackend, StreamId};
use crate::config::AllocatorConfig;
use crate::stats::{Stat, StatType};

/// A block freed by the user whose fence has not been seen complete.
struct Waiting {
    ptr: usize,
    size: usize,
    fence: Box<dyn HostFence>,
    /// A host wait for the fence failed: allocations no longer wait for it (a failure such as
    /// an event recorded inside a graph capture repeats); queries still free it.
    wait_failed: bool,
}

#[derive(Default)]
struct Book {
    /// Live blocks handed out: address → requested size.
    live: HashMap<usize, usize>,
    /// Freed blocks waiting for their fences, oldest first.
    waiting: VecDeque<Waiting>,
    pending_bytes: Stat,
}

/// Pinned host memory from a [`CachingAllocator`] over host pages, with fenced frees. See the
/// module documentation.
pub struct PagedPinnedCache<B: DeviceBackend> {
    core: CachingAllocator<B>,
    stream: StreamId,
    max_pending_waits: u32,
    book: Mutex<Book>,
    /// `book.waiting.len()`, read without the lock so that an allocation with nothing waiting
    /// makes no query.
    waiting: AtomicUsize,
    num_allocs: AtomicU64,
    num_frees: AtomicU64,
    num_queries: AtomicU64,
    num_waits: AtomicU64,
}

impl<B: DeviceBackend> fmt::Debug for PagedPinnedCache<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedPinnedCache")
            .field("stream", &self.stream)
            .field("reserved", &self.core.memory_reserved())
            .field("allocated", &self.core.memory_allocated())
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<B: DeviceBackend> PagedPinnedCache<B> {
    /// A cache over `backend` (whose pages must be host memory for real use:
    /// `CudaDevice::host_pages`), placing every block on `stream`, a stream **no work is queued
    /// on** (the core's page fences are recorded there and must complete at once), with the
    /// core's `config` (the crate's default: [`AllocatorConfig::default`]) and at most
    /// `max_pending_waits` host waits per allocation (`0`: never wait, map more).
    ///
    /// # Errors
    /// [`PinnedError::Backend`] when the backend rejects `stream`; [`PinnedError::Allocator`]
    /// when the configuration is unusable.
    pub fn new(
        backend: B,
        stream: StreamId,
        config: AllocatorConfig,
        max_pending_waits: u32,
    ) -> Result<Self, PinnedError> {
        backend.validate_stream(stream)?;
        let core = CachingAllocator::new(backend, config).map_err(PinnedError::Allocator)?;
        Ok(PagedPinnedCache {
            core,
            stream,
            max_pending_waits,
            book: Mutex::new(Book::default()),
            waiting: AtomicUsize::new(0),
            num_allocs: AtomicU64::new(0),
            num_frees: AtomicU64::new(0),
            num_queries: AtomicU64::new(0),
            num_waits: AtomicU64::new(0),
        })
    }

    /// The allocator underneath (its statistics, summary, snapshot, fragmentation report).
    pub fn core(&self) -> &CachingAllocator<B> {
        &self.core
    }

    /// The stream every block is placed on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// `size` bytes of pinned host memory, reused from the cache when it can be (never a block
    /// whose fence is pending), else mapped. Waits first for pending blocks when the cache holds
    /// fewer free bytes than `size` (see the module documentation).
    ///
    /// # Errors
    /// [`PinnedError::InvalidRequest`] for `size == 0`; [`PinnedError::Allocator`] when the core
    /// fails (out of memory, with its report; a driver error). Nothing is lost either way.
    pub fn alloc(&self, size: usize) -> Result<HostPtr, PinnedError> {
        if size == 0 {
            return Err(PinnedError::InvalidRequest("size 0".into()));
        }
        self.reap(false);
        let mut waits = 0;
        while waits < self.max_pending_waits && self.waiting.load(Ordering::Acquire) > 0 {
            let cached = self.core.memory_reserved() - self.core.memory_allocated();
            if cached >= i64::try_from(size).unwrap_or(i64::MAX) {
                break;
            }
            if !self.wait_oldest() {
                break;
            }
            waits += 1;
        }
        let a = self
            .core
            .allocate(size, self.stream)
            .map_err(PinnedError::Allocator)?;
        self.book.lock().live.insert(a.ptr.0 as usize, size);
        self.num_allocs.fetch_add(1, Ordering::Relaxed);
        Ok(HostPtr(a.ptr.0 as usize))
    }

    /// Gives a block back for reuse at once: no queued work may use it any more (none was ever
    /// queued, or the caller waited for it).
    ///
    /// # Errors
    /// [`PinnedError::UnknownBlock`] when `ptr` is not a live block of this cache (nothing
    /// changes); [`PinnedError::Allocator`] when the core refuses it.
    pub fn free(&self, ptr: HostPtr) -> Result<(), PinnedError> {
        if self.book.lock().live.remove(&ptr.addr()).is_none() {
            return Err(PinnedError::UnknownBlock { ptr });
        }
        self.num_frees.fetch_add(1, Ordering::Relaxed);
        self.core
            .free(DeviceAddr(ptr.addr() as u64))
            .map_err(PinnedError::Allocator)
    }

    /// Gives a block back to be reused only after `fence` completes (an event recorded after
    /// its last copy). A fence already complete frees at once.
    ///
    /// # Errors
    /// As [`free`](Self::free); the fence is dropped with an unknown block.
    pub fn free_after(
        &self,
        ptr: HostPtr,
        mut fence: Box<dyn HostFence>,
    ) -> Result<(), PinnedError> {
        {
            let mut book = self.book.lock();
            let Some(size) = book.live.remove(&ptr.addr()) else {
                return Err(PinnedError::UnknownBlock { ptr });
            };
            self.num_queries.fetch_add(1, Ordering::Relaxed);
            if !matches!(fence.query(), Ok(true)) {
                book.pending_bytes.increase(size as i64);
                book.waiting.push_back(Waiting {
                    ptr: ptr.addr(),
                    size,
                    fence,
                    wait_failed: false,
                });
                self.waiting.store(book.waiting.len(), Ordering::Release);
                self.num_frees.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        drop(fence);
        self.num_frees.fetch_add(1, Ordering::Relaxed);
        self.core
            .free(DeviceAddr(ptr.addr() as u64))
            .map_err(PinnedError::Allocator)
    }

    /// Declares that work queued on `stream` uses the block: at its free the core records an
    /// event there and reuses the block only after it (the device cache's `record_stream`).
    ///
    /// # Errors
    /// [`PinnedError::UnknownBlock`] for a pointer that is not live here;
    /// [`PinnedError::Allocator`] when the stream is rejected.
    pub fn record_stream(&self, ptr: HostPtr, stream: StreamId) -> Result<(), PinnedError> {
        if !self.book.lock().live.contains_key(&ptr.addr()) {
            return Err(PinnedError::UnknownBlock { ptr });
        }
        self.core
            .record_stream(DeviceAddr(ptr.addr() as u64), stream)
            .map_err(PinnedError::Allocator)
    }

    /// Caps the pinned bytes (mapped host pages) at `cap` bytes, `None` for no cap: the core's
    /// fraction cap, set to `cap` over the backend's total memory. An allocation that would map
    /// past it first releases free pages, then fails with an out-of-memory error whose report
    /// names the cap; nothing already mapped is taken away.
    ///
    /// # Errors
    /// [`PinnedError::Backend`] when the backend cannot report its memory.
    pub fn set_max_pinned(&self, cap: Option<usize>) -> Result<(), PinnedError> {
        let total = self.core.backend().mem_info()?.total.max(1);
        let fraction = cap.map_or(1.0, |c| ((c as f64 + 0.5) / total as f64).min(1.0));
        self.core
            .set_memory_fraction(fraction)
            .map_err(PinnedError::Allocator)
    }

    /// Blocks freed but still waiting for their fences.
    pub fn waiting_blocks(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Returns every free page to the host (the core's `empty_cache`, after freeing every
    /// waiting block whose fence has completed, whatever its place in the queue; blocks still
    /// waiting for their fences stay mapped) and the bytes it released.
    ///
    /// # Errors
    /// [`PinnedError::Allocator`] from the core.
    pub fn empty_cache(&self) -> Result<usize, PinnedError> {
        self.reap(true);
        let before = self.core.memory_reserved();
        self.core.empty_cache().map_err(PinnedError::Allocator)?;
        Ok(usize::try_from(before - self.core.memory_reserved()).unwrap_or(0))
    }

    /// The statistics in the pinned cache's vocabulary: *reserved* bytes are the mapped host
    /// pages; *allocated* and *requested* bytes count blocks waiting for their fences too (the
    /// core holds them until then; `pending_bytes` says how many); `slabs` counts the host page
    /// handles held, mapped or spare ([`CachingAllocator::memory_handles`]; its peak is the most
    /// held at once); a *pin* is a growth (`num_device_alloc`), an *unpin* an unmapped range
    /// (`num_device_free`). The
    /// pinning times are 0: a generic backend has no clock the cache could read without making
    /// results depend on the machine (`PinnedAllocator::stats` fills them, and the pins, from
    /// the driver's call times).
    pub fn stats(&self) -> PinnedStats {
        let m = self.core.memory_stats();
        let book = self.book.lock();
        let allocs = self.num_allocs.load(Ordering::Relaxed);
        let grew = u64::try_from(m.num_device_alloc).unwrap_or(0);
        PinnedStats {
            allocated_bytes: *m.allocated_bytes.get(StatType::All),
            requested_bytes: *m.requested_bytes.get(StatType::All),
            reserved_bytes: *m.reserved_bytes.get(StatType::All),
            pending_bytes: book.pending_bytes,
            slabs: self.core.memory_handles(),
            num_allocs: allocs,
            num_cache_hits: allocs.saturating_sub(grew),
            num_frees: self.num_frees.load(Ordering::Relaxed),
            num_pins: grew,
            num_unpins: u64::try_from(m.num_device_free).unwrap_or(0),
            pin_nanos: 0,
            unpin_nanos: 0,
            num_event_records: 0,
            num_event_queries: self.num_queries.load(Ordering::Relaxed),
            num_stream_syncs: u64::try_from(m.num_sync_all_streams).unwrap_or(0),
            num_pending_waits: self.num_waits.load(Ordering::Relaxed),
        }
    }

    /// The statistics as one line.
    pub fn summary(&self) -> String {
        self.stats().summary()
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.core.reset_peak_stats();
        self.book.lock().pending_bytes.reset_peak();
    }

    /// Runs the core's invariant checker (check `core`), then checks that no block is both live
    /// and waiting (`waiting_not_live`) and that the pending bytes are the waiting blocks'
    /// (`pending_bytes`).
    ///
    /// # Errors
    /// The first violated invariant.
    pub fn check_invariants(&self) -> Result<(), PinnedInvariantViolation> {
        self.core
            .check_invariants()
            .map_err(|v| PinnedInvariantViolation {
                check: "core",
                detail: v.to_string(),
            })?;
        let book = self.book.lock();
        if let Some(w) = book.waiting.iter().find(|w| book.live.contains_key(&w.ptr)) {
            return Err(PinnedInvariantViolation {
                check: "waiting_not_live",
                detail: format!("{:#x} is both live and waiting for its fence", w.ptr),
            });
        }
        let pending: usize = book.waiting.iter().map(|w| w.size).sum();
        if i64::try_from(pending).ok() != Some(book.pending_bytes.current) {
            return Err(PinnedInvariantViolation {
                check: "pending_bytes",
                detail: format!(
                    "pending bytes {} but {} bytes wait",
                    book.pending_bytes.current, pending
                ),
            });
        }
        Ok(())
    }

    /// Frees waiting blocks whose fences now say complete. `every`: all of them, whatever their
    /// place (`empty_cache`: fences of different copy streams complete in no common order, so one
    /// that never completes must not keep finished blocks behind it mapped); otherwise the oldest
    /// ones, stopping at the first that is not complete (one query on the allocation path).
    /// Makes no query when none wait.
    fn reap(&self, every: bool) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut done = Vec::new();
        {
            let mut book = self.book.lock();
            let mut keep = VecDeque::new();
            while let Some(mut w) = book.waiting.pop_front() {
                self.num_queries.fetch_add(1, Ordering::Relaxed);
                match w.fence.query() {
                    Ok(true) => {
                        book.pending_bytes.decrease(w.size as i64);
                        done.push(w);
                    }
                    // Pending: the blocks behind it were freed later and are most likely
                    // pending too (unless `every`).
                    Ok(false) if !every => {
                        book.waiting.push_front(w);
                        break;
                    }
                    // A failed query says nothing of the blocks behind it (an event recorded
                    // inside a graph capture fails for ever): kept, and the scan goes on.
                    _ => keep.push_back(w),
                }
            }
            // The pending ones kept in order, ahead of any not looked at (put back one by one:
            // nothing moves when none was kept, the usual case on the allocation path).
            while let Some(w) = keep.pop_back() {
                book.waiting.push_front(w);
            }
            self.waiting.store(book.waiting.len(), Ordering::Release);
        }
        for w in done {
            self.give_back(w);
        }
    }

    /// Takes the oldest waiting block whose wait has not failed before, waits for its fence
    /// without any lock held and frees it. `false` when none is left to wait for or the wait
    /// failed (the block then waits for a query to say complete, at the back, and is not waited
    /// for again).
    fn wait_oldest(&self) -> bool {
        let Some(mut w) = ({
            let mut book = self.book.lock();
            let w = book
                .waiting
                .iter()
                .position(|w| !w.wait_failed)
                .and_then(|i| book.waiting.remove(i));
            if let Some(w) = &w {
                book.pending_bytes.decrease(w.size as i64);
            }
            self.waiting.store(book.waiting.len(), Ordering::Release);
            w
        }) else {
            return false;
        };
        if w.fence.wait().is_err() {
            w.wait_failed = true;
            let mut book = self.book.lock();
            book.pending_bytes.increase(w.size as i64);
            book.waiting.push_back(w);
            self.waiting.store(book.waiting.len(), Ordering::Release);
            return false;
        }
        self.num_waits.fetch_add(1, Ordering::Relaxed);
        self.give_back(w);
        true
    }

    /// Hands a block whose fence completed to the core.
    fn give_back(&self, w: Waiting) {
        drop(w.fence);
        if let Err(e) = self.core.free(DeviceAddr(w.ptr as u64)) {
            tracing::error!(target: "cuda_caching_allocator", ptr = w.ptr, %e, "a fenced pinned block was refused by its allocator; it stays out of reuse");
        }
    }
}

impl<B: DeviceBackend> Drop for PagedPinnedCache<B> {
    fn drop(&mut self) {
        let waiting = std::mem::take(&mut self.book.get_mut().waiting);
        for mut w in waiting {
            if w.fence.wait().is_ok() {
                self.give_back(w);
            } else {
                // Still read by a copy, maybe: keep its pages mapped (leaked) rather than reuse.
                tracing::warn!(target: "cuda_caching_allocator", ptr = w.ptr, "pinned block dropped with its fence unanswered; its pages stay mapped");
                std::mem::forget(w.fence);
            }
        }
    }
}
