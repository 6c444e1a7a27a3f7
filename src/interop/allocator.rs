//! `CudaAllocator`: the shared handle to one device's caching allocator, and the typed
//! allocation helpers (`alloc`, `alloc_zeros`, `htod`, `dtoh`) that return [`CachedSlice`]s.
//!
//! The handle exposes the core's statistics and controls, but not its safe pointer-level
//! `free`: the memory of a live [`CachedSlice`] must never be freed under it, so freeing by
//! pointer is `unsafe` here ([`CudaAllocator::free`]). May use: the core, `backend::cuda`,
//! `interop::slice`, `interop::events`.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{self as cu, CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};
use parking_lot::Mutex;

use super::events::ShellPool;
use super::pinned::{CachedPinned, PinnedAllocator};
use super::{driver_error, registry::AllocatorRegistry, slice::CachedSlice};
use crate::allocator::{
    FragmentationReport, FreeOutcome, InvariantViolation, SegmentObserver, SegmentSnapshot,
};
use crate::backend::DeviceBackend;
use crate::backend::call_times::DeviceCallTimes;
use crate::backend::cuda::CudaDevice;
use crate::host::PinnedError;
use crate::trace::Trace;
use crate::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, DeviceAddr, MemPoolId, MemoryStats,
    PoolCheckpoint, PoolFilter, PoolRestore, Result, StreamId,
};

/// A handle to the caching allocator of one CUDA device. Cloning it clones two `Arc`s; every
/// clone and every [`CachedSlice`] made from it share one cache.
///
/// It offers the core [`CachingAllocator`]'s statistics and controls (`memory_stats`,
/// `memory_summary`, `empty_cache`, `set_memory_fraction`, …) and its raw `allocate`; freeing by
/// pointer is [`unsafe`](Self::free), since a pointer may belong to a live [`CachedSlice`].
///
/// ```no_run
/// use cuda_caching_allocator::interop::CudaAllocator;
/// use cudarc::driver::CudaContext;
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let alloc = CudaAllocator::shared(0)?;            // the device's allocator, from the registry
/// let buf = alloc.htod(&stream, &[1.0f32, 2.0, 3.0])?; // a CachedSlice<f32>
/// assert_eq!(alloc.dtoh(&buf)?, [1.0, 2.0, 3.0]);
/// drop(buf);                                         // back to the cache, not to the driver
/// println!("{}", alloc.memory_summary(true));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct CudaAllocator {
    pub(super) inner: Arc<CachingAllocator<CudaDevice>>,
    /// cudarc event shells kept by block address (see `interop::events`).
    shells: Arc<ShellPool>,
    /// The admitted-stream count at which the next admission releases unused streams.
    next_release: Arc<AtomicUsize>,
    /// The pinned host cache of [`alloc_pinned`](Self::alloc_pinned), made on first use.
    pinned: Arc<OnceLock<PinnedAllocator>>,
    /// Blocks of buffers dropped inside a capture, held out of reuse by the private pool whose
    /// graph may use them (`MemPoolId::DEFAULT`: an unrouted capture, held for the cache's
    /// life); Note [Drops inside a capture] in `interop::slice`.
    held: Arc<Mutex<HashMap<MemPoolId, Vec<u64>>>>,
}

/// The admitted-stream count below which admissions never look for unused streams.
const RELEASE_STREAMS_FROM: usize = 64;

impl fmt::Debug for CudaAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocator")
            .field("device", self.inner.backend())
            .finish_non_exhaustive()
    }
}

impl CudaAllocator {
    /// A new allocator of its own on the device of `ctx`, with `config`. Most programs want
    /// [`CudaAllocator::shared`] instead, so that one cache serves the whole process.
    ///
    /// # Errors
    /// A backend error when the device cannot be queried; a configuration error from the core.
    pub fn new(ctx: Arc<CudaContext>, config: AllocatorConfig) -> Result<Self> {
        let device = CudaDevice::new(ctx).map_err(|source| AllocError::Backend {
            operation: "CudaDevice::new",
            source,
        })?;
        Self::from_device(device, config)
    }

    /// A new allocator of its own over `device`.
    ///
    /// # Errors
    /// A configuration error from the core.
    pub fn from_device(device: CudaDevice, config: AllocatorConfig) -> Result<Self> {
        Ok(CudaAllocator {
            inner: Arc::new(CachingAllocator::new(device, config)?),
            shells: Arc::new(ShellPool::default()),
            next_release: Arc::new(AtomicUsize::new(RELEASE_STREAMS_FROM)),
            pinned: Arc::new(OnceLock::new()),
            held: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// The process-wide allocator of device `ordinal`, created on first use by the
    /// [global registry](AllocatorRegistry::global) (configured from `CUDA_CACHING_ALLOCATOR_CONF`
    /// or PyTorch's `PYTORCH_CUDA_ALLOC_CONF`).
    ///
    /// # Errors
    /// No CUDA driver, no such device, or a bad configuration in the environment.
    pub fn shared(ordinal: usize) -> Result<&'static CudaAllocator> {
        AllocatorRegistry::global().get(ordinal)
    }

    /// The process-wide allocator of `stream`'s device: [`shared`](Self::shared) with the
    /// stream's ordinal, checked up front against the stream's context. This is the one line a
    /// cudarc port adds before its allocation sites (`docs/migrating-from-cudarc.md`):
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let stream = cudarc::driver::CudaContext::new(0)?.default_stream();
    /// let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    /// let x = alloc.alloc_zeros::<f32>(&stream, 1024)?; // was: stream.alloc_zeros::<f32>(1024)?
    /// # drop(x);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// The allocator serves every stream of the device, not only `stream`; calling this again
    /// (for any stream of the device) returns the same allocator.
    ///
    /// # Errors
    /// As [`shared`](Self::shared): no CUDA driver, no such device, or a bad configuration in
    /// the environment. [`AllocError::InvalidStream`] when `stream` belongs to a context other
    /// than its device's primary context (one made by cudarc's `CudaContext::new_non_primary`
    /// or `new_cig`, say), whose streams the shared allocator cannot serve: make an allocator of
    /// that context with [`CudaAllocator::new`] instead.
    pub fn for_stream(stream: &CudaStream) -> Result<&'static CudaAllocator> {
        let ctx = stream.context();
        let alloc = Self::shared(ctx.ordinal())?;
        if ctx.cu_ctx() != alloc.context().cu_ctx() {
            let id = crate::backend::cuda::stream_id(stream);
            return Err(AllocError::InvalidStream {
                stream: id,
                source: crate::BackendError::InvalidStream {
                    stream: id,
                    reason: format!(
                        "the stream belongs to a context of device {} other than its primary \
                         context, which the shared allocator uses; make an allocator of that \
                         context with CudaAllocator::new",
                        ctx.ordinal()
                    ),
                },
            });
        }
        Ok(alloc)
    }

    /// The shared core allocator.
    ///
    /// # Safety
    /// 1. Nothing is freed through it ([`CachingAllocator::free`]) that a live [`CachedSlice`] or
    ///    view owns, nor anything twice: see [`free`](Self::free).
    pub unsafe fn core(&self) -> &Arc<CachingAllocator<CudaDevice>> {
        &self.inner
    }

    /// Whether `a` and `b` are handles to the same cache.
    pub fn ptr_eq(a: &CudaAllocator, b: &CudaAllocator) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    /// The pool of cudarc event shells.
    pub(super) fn shells(&self) -> &ShellPool {
        &self.shells
    }

    /// Holds the block at `ptr` (its buffer was dropped inside a capture) until pool `pool` is
    /// released (Note [Drops inside a capture] in `interop::slice`).
    pub(super) fn hold_for_graph(&self, pool: MemPoolId, ptr: u64) {
        self.held.lock().entry(pool).or_default().push(ptr);
    }

    /// Frees the blocks held for pool `pool`'s graphs (its last use was given back).
    fn free_held(&self, pool: MemPoolId) {
        let ptrs = self.held.lock().remove(&pool).unwrap_or_default();
        for p in ptrs {
            // SAFETY: the block's buffer was dropped (it is owned by nothing else), and the
            // graphs of the pool that could still use it are gone with the pool's last use.
            if let Err(e) = unsafe { self.free(DeviceAddr(p)) } {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DeviceAddr(p), pool = %pool, error = %e, "freeing a block held for a graph failed");
            }
        }
    }

    /// How many blocks are held out of reuse because their buffers were dropped inside a graph
    /// capture (see [`CachedSlice`]'s stream rules): until the capture's pool is released (a
    /// [`CapturedGraph`](super::CapturedGraph) dropped), or for the cache's life when no pool
    /// received the capture. They count as allocated in [`memory_stats`](Self::memory_stats).
    pub fn blocks_held_for_graphs(&self) -> usize {
        self.held.lock().values().map(Vec::len).sum()
    }

    /// How many cudarc event shells the allocator keeps for reuse (each holds two CUDA events;
    /// see [`CachedSlice`]'s stream rules). `empty_cache` destroys them.
    pub fn kept_event_pairs(&self) -> usize {
        self.shells.len()
    }

    /// Allocates `size` bytes on `stream` (raw; see [`CachingAllocator::allocate`]). Typed code
    /// should use [`alloc`](Self::alloc) and friends, which free on drop.
    ///
    /// # Errors
    /// As [`CachingAllocator::allocate`].
    pub fn allocate(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        self.inner.allocate(size, stream)
    }

    /// Returns the allocation at `ptr` to the cache (raw; see [`CachingAllocator::free`]).
    ///
    /// # Errors
    /// As [`CachingAllocator::free`]: an unknown, interior or already freed pointer.
    ///
    /// # Safety
    /// 1. `ptr` came from [`allocate`](Self::allocate) on this cache (or on the same device's
    ///    raw API) and is not owned by a [`CachedSlice`]: a buffer frees its own memory when
    ///    dropped, and freeing it under a live buffer lets the cache hand its bytes to a new owner
    ///    while safe code still reads and writes them.
    /// 2. No work queued on a stream other than the allocation's still uses the memory, unless
    ///    that stream was declared with [`record_stream`](Self::record_stream).
    pub unsafe fn free(&self, ptr: DeviceAddr) -> Result<()> {
        self.inner.free(ptr)
    }

    /// [`free`](Self::free), telling whether the block still waits for recorded streams' work
    /// (see [`CachingAllocator::free_with_outcome`]).
    ///
    /// # Errors
    /// As [`free`](Self::free).
    ///
    /// # Safety
    /// As [`free`](Self::free).
    pub unsafe fn free_with_outcome(&self, ptr: DeviceAddr) -> Result<FreeOutcome> {
        self.inner.free_with_outcome(ptr)
    }

    /// Marks the allocation at `ptr` as used on `stream` (PyTorch's `recordStream`); see
    /// [`CachingAllocator::record_stream`].
    ///
    /// # Errors
    /// As [`CachingAllocator::record_stream`].
    pub fn record_stream(&self, ptr: DeviceAddr, stream: StreamId) -> Result<()> {
        self.inner.record_stream(ptr, stream)
    }

    /// Returns cached, unused memory to the driver and destroys the kept cudarc event shells; see
    /// [`CachingAllocator::empty_cache`].
    ///
    /// # Errors
    /// As [`CachingAllocator::empty_cache`].
    pub fn empty_cache(&self) -> Result<()> {
        // The core first: it refuses while a graph capture is underway, and then the kept shells
        // must stay too (destroying them waits on their events on the legacy default stream,
        // which a global-mode capture forbids).
        self.inner.empty_cache()?;
        // Dropping shells and streams lets cudarc bind this device's context: the caller's
        // current context is put back afterwards.
        self.device().with_callers_context(|| {
            self.shells.clear();
            self.release_unused_streams();
        });
        Ok(())
    }

    /// Releases the admitted cudarc streams that are no longer used: nothing but the allocator
    /// holds the stream (no buffer, view or handle of the program), and the cache no longer
    /// refers to it — no block, cached free ones included, belongs to it, none lists it as a
    /// user (`record_stream`), and no event recorded on it is outstanding. The allocator drops
    /// its `Arc`, so cudarc destroys the stream (its queued work still finishes). Returns how
    /// many were released.
    ///
    /// It runs by itself from [`empty_cache`](Self::empty_cache) and whenever admitting a new
    /// stream doubles the admitted count since the last release (from 64 on), so a program that
    /// forks a stream per task keeps a bounded number of them. A stream whose cached free blocks
    /// keep it is released by the next `empty_cache`.
    pub fn release_unused_streams(&self) -> usize {
        let device = self.device();
        let mut released = 0;
        for id in device.unheld_streams() {
            let mut taken = None;
            let forgotten = self.inner.forget_stream(id, || {
                taken = device.take_unheld_stream(id);
                taken.is_some()
            });
            // Dropped here, outside the cache's lock: cudarc destroys the stream (and binds its
            // context to do so; the caller's current context is put back).
            if let Some(stream) = taken {
                device.with_callers_context(|| drop(stream));
            }
            released += usize::from(forgotten);
        }
        let left = device.admitted_stream_count();
        self.next_release.store(
            left.saturating_mul(2).max(RELEASE_STREAMS_FROM),
            Ordering::Relaxed,
        );
        released
    }

    /// Lets device `peer` read and write this cache's memory (its mapped pages, now and later);
    /// call it after enabling the driver's peer access from `peer`'s context to this device's
    /// (cudarc: `CudaContext::enable_peer_access`, or `cuCtxEnablePeerAccess`), before a kernel
    /// or copy on `peer` touches a buffer of this cache. See
    /// [`CachingAllocator::enable_peer_access`].
    ///
    /// # Errors
    /// As [`CachingAllocator::enable_peer_access`].
    pub fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.inner.enable_peer_access(peer)
    }

    /// Caps the cache at `fraction` of the device's memory; see
    /// [`CachingAllocator::set_memory_fraction`].
    ///
    /// # Errors
    /// As [`CachingAllocator::set_memory_fraction`].
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        self.inner.set_memory_fraction(fraction)
    }

    /// The memory-fraction cap in force.
    pub fn memory_fraction(&self) -> f64 {
        self.inner.memory_fraction()
    }

    /// PyTorch's `memory_stats()`; see [`CachingAllocator::memory_stats`].
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner.memory_stats()
    }

    /// The driver calls this cache made so far and the host time spent inside them, by kind
    /// ([`CudaDevice::call_times`]): where the allocator's own time goes, beside the counts of
    /// [`memory_stats`](Self::memory_stats) (`num_device_alloc` / `num_device_free`).
    pub fn device_call_times(&self) -> DeviceCallTimes {
        self.inner.backend().call_times()
    }

    /// Resets the peak statistics.
    pub fn reset_peak_stats(&self) {
        self.inner.reset_peak_stats()
    }

    /// Resets the accumulated statistics.
    pub fn reset_accumulated_stats(&self) {
        self.inner.reset_accumulated_stats()
    }

    /// PyTorch's `memory_summary()` table; see [`CachingAllocator::memory_summary`].
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        self.inner.memory_summary(abbreviated)
    }

    /// The fragmentation report; see [`CachingAllocator::fragmentation`].
    pub fn fragmentation(&self) -> FragmentationReport {
        self.inner.fragmentation()
    }

    /// The fragmentation report as text.
    pub fn fragmentation_summary(&self) -> String {
        self.inner.fragmentation_summary()
    }

    /// The segments and their blocks; see [`CachingAllocator::snapshot`].
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.inner.snapshot()
    }

    /// Starts recording the allocation history; see [`CachingAllocator::record_history`].
    pub fn record_history(&self, capacity: usize) {
        self.inner.record_history(capacity)
    }

    /// Stops recording the history.
    pub fn stop_history(&self) {
        self.inner.stop_history()
    }

    /// The recorded history; see [`CachingAllocator::history`].
    pub fn history(&self) -> (Trace, u64) {
        self.inner.history()
    }

    /// Runs the invariant checker; see [`CachingAllocator::check_invariants`].
    ///
    /// # Errors
    /// The first violated invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_invariants()
    }

    /// Lets an allocation about to fail with out of memory take free blocks of private pool
    /// `pool` ([`CachingAllocator::set_use_on_oom`]).
    ///
    /// # Errors
    /// As [`CachingAllocator::set_use_on_oom`].
    pub fn set_use_on_oom(&self, pool: MemPoolId, on: bool) -> Result<()> {
        self.inner.set_use_on_oom(pool, on)
    }

    /// Hands blocks of private pool `pool` out whole, never split
    /// ([`CachingAllocator::set_no_split`]).
    ///
    /// # Errors
    /// As [`CachingAllocator::set_no_split`].
    pub fn set_no_split(&self, pool: MemPoolId, on: bool) -> Result<()> {
        self.inner.set_no_split(pool, on)
    }

    /// The layout of private pool `pool` now ([`CachingAllocator::pool_checkpoint`]).
    ///
    /// # Errors
    /// As [`CachingAllocator::pool_checkpoint`].
    pub fn pool_checkpoint(&self, pool: MemPoolId) -> Result<PoolCheckpoint> {
        self.inner.pool_checkpoint(pool)
    }

    /// Restores a private pool to a checkpoint ([`CachingAllocator::restore_pool`]): every
    /// allocation of the pool that is live now is freed, and the checkpoint's allocations are
    /// made again (they are the caller's to free).
    ///
    /// ```compile_fail
    /// # fn f(alloc: &cuda_caching_allocator::interop::CudaAllocator,
    /// #      cp: &cuda_caching_allocator::PoolCheckpoint) {
    /// // It frees live allocations: safe code cannot call it.
    /// let _ = alloc.restore_pool(cp);
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`CachingAllocator::restore_pool`].
    ///
    /// # Safety
    /// 1. No allocation of the pool that is live now is owned by a live [`CachedSlice`] (or a
    ///    view of one), nor by anything else that will use or free it afterwards: the restore
    ///    frees them all (the pointers in [`PoolRestore::freed`]), and the cache hands their
    ///    bytes to new owners (the checkpoint's allocations among them). This is
    ///    [`free`](Self::free)'s obligation for each of them.
    /// 2. Work queued on streams other than an allocation's own no longer uses it, unless those
    ///    streams were declared with [`record_stream`](Self::record_stream).
    pub unsafe fn restore_pool(&self, checkpoint: &PoolCheckpoint) -> Result<PoolRestore> {
        self.inner.restore_pool(checkpoint)
    }

    /// The base address and size of the segment holding the live allocation at `ptr`
    /// ([`CachingAllocator::base_allocation`]).
    pub fn base_allocation(&self, ptr: DeviceAddr) -> Option<(DeviceAddr, usize)> {
        self.inner.base_allocation(ptr)
    }

    /// Sets (or, with `None`, removes) the observer told of every segment this cache
    /// allocates, frees, maps or unmaps ([`CachingAllocator::set_segment_observer`]).
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        self.inner.set_segment_observer(observer);
    }

    /// The configuration in force.
    pub fn config(&self) -> AllocatorConfig {
        self.inner.config()
    }

    /// Hands every thread cache's blocks back to the core; see
    /// [`CachingAllocator::flush_thread_caches`].
    pub fn flush_thread_caches(&self) -> usize {
        self.inner.flush_thread_caches()
    }

    /// Whether the fast path is on.
    pub fn fast_path(&self) -> bool {
        self.inner.fast_path()
    }

    /// Routes allocations on the streams `filter` accepts into private pool `pool`; see
    /// [`CachingAllocator::begin_allocate_to_pool`]. For cudarc captures prefer
    /// [`capture_pool`](Self::capture_pool).
    ///
    /// # Errors
    /// As [`CachingAllocator::begin_allocate_to_pool`].
    pub fn begin_allocate_to_pool(&self, pool: MemPoolId, filter: PoolFilter) -> Result<()> {
        self.inner.begin_allocate_to_pool(pool, filter)
    }

    /// Stops routing allocations into `pool`; see [`CachingAllocator::end_allocate_to_pool`].
    ///
    /// # Errors
    /// As [`CachingAllocator::end_allocate_to_pool`].
    pub fn end_allocate_to_pool(&self, pool: MemPoolId) -> Result<()> {
        self.inner.end_allocate_to_pool(pool)
    }

    /// Gives back one use of private pool `pool`; see [`CachingAllocator::release_pool`]. At
    /// the pool's last use, the blocks held for its graphs (buffers dropped inside its captures)
    /// go back to the cache too. Pools of [`capture_pool`](Self::capture_pool) give their use
    /// back by themselves (`CapturedGraph`'s drop, or the unsafe `GraphPool::release`).
    ///
    /// # Errors
    /// As [`CachingAllocator::release_pool`].
    ///
    /// # Safety
    /// 1. No graph captured into `pool` is launched after its last use is given back: its memory
    ///    goes to other buffers and, at the next `empty_cache`, back to the driver.
    pub unsafe fn release_pool(&self, pool: MemPoolId) -> Result<()> {
        self.inner.release_pool(pool)?;
        if self.inner.pool_use_count(pool).is_none_or(|n| n == 0) {
            self.free_held(pool);
        }
        Ok(())
    }

    /// How many cudarc event shells are quarantined: those of buffers dropped while their stream
    /// was capturing, destroyed once no capture is underway (see [`CachedSlice`]).
    pub fn quarantined_event_pairs(&self) -> usize {
        self.shells.quarantined()
    }

    /// The use count of private pool `pool`; see [`CachingAllocator::pool_use_count`].
    pub fn pool_use_count(&self, pool: MemPoolId) -> Option<u32> {
        self.inner.pool_use_count(pool)
    }

    /// Whether a graph capture is underway; see [`CachingAllocator::capture_underway`].
    pub fn capture_underway(&self) -> bool {
        self.inner.capture_underway()
    }

    /// Segments handed from one stream to another; see
    /// [`CachingAllocator::cross_stream_handovers`].
    pub fn cross_stream_handovers(&self) -> u64 {
        self.inner.cross_stream_handovers()
    }

    /// [`CachingAllocator::page_loans`].
    pub fn page_loans(&self) -> u64 {
        self.inner.page_loans()
    }

    /// [`CachingAllocator::unmaps_handed_off`].
    pub fn unmaps_handed_off(&self) -> u64 {
        self.inner.unmaps_handed_off()
    }

    /// [`CachingAllocator::blocks_borrowed`].
    pub fn blocks_borrowed(&self) -> u64 {
        self.inner.blocks_borrowed()
    }

    /// The CUDA backend.
    pub fn device(&self) -> &CudaDevice {
        self.inner.backend()
    }

    /// The cudarc context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.inner.backend().context()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.backend().ordinal()
    }

    /// Admits `stream` to the backend (see [`CudaDevice::admit_stream`]) and returns its id. An
    /// admission that doubles the admitted count since the last release first releases the
    /// unused streams ([`release_unused_streams`](Self::release_unused_streams)).
    ///
    /// # Errors
    /// [`AllocError::InvalidStream`] when the stream belongs to another device.
    pub fn admit(&self, stream: &Arc<CudaStream>) -> Result<StreamId> {
        let (id, admitted) = self
            .device()
            .admit_stream_counted(stream)
            .map_err(|source| AllocError::InvalidStream {
                stream: crate::backend::cuda::stream_id(stream),
                source,
            })?;
        if admitted.is_some_and(|n| n >= self.next_release.load(Ordering::Relaxed)) {
            self.release_unused_streams();
        }
        Ok(id)
    }

    /// The pinned host cache of this allocator's context ([`PinnedAllocator::with_defaults`]:
    /// host pages where the device maps them, else slabs of the default
    /// [`PinnedConfig`](crate::host::PinnedConfig)), made
    /// on first use and shared by every clone of the handle.
    ///
    /// # Errors
    /// [`PinnedError::Backend`] when the device cannot be queried.
    pub fn pinned(&self) -> std::result::Result<&PinnedAllocator, PinnedError> {
        if let Some(p) = self.pinned.get() {
            return Ok(p);
        }
        let made = PinnedAllocator::with_defaults(Arc::clone(self.context()))?;
        // A racing thread may have set it first: then `made` is dropped unused.
        let _ = self.pinned.set(made);
        self.pinned.get().ok_or_else(|| {
            PinnedError::InvalidConfig("the pinned cache could not be installed".into())
        })
    }

    /// Page-locked host memory for `len` values of `T` from [`pinned`](Self::pinned) (cudarc's
    /// `CudaContext::alloc_pinned`, cached: no `cuMemHostAlloc` on a cache hit).
    ///
    /// # Errors
    /// As [`PinnedAllocator::alloc_pinned`].
    ///
    /// # Safety
    /// 1. As [`PinnedAllocator::alloc_pinned`]: the contents are another buffer's old data.
    pub unsafe fn alloc_pinned<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> std::result::Result<CachedPinned<T>, PinnedError> {
        // SAFETY: the caller's obligation, passed on.
        unsafe { self.pinned()?.alloc_pinned(len) }
    }

    /// Allocates room for `len` values of `T` on `stream`, uninitialised.
    ///
    /// # Errors
    /// Out of memory (with the core's report), a stream of another device, or a size overflow;
    /// [`AllocError::UnroutedCapture`] when `stream` is capturing a graph without a
    /// [`capture_pool`](Self::capture_pool) (or another routing) for it, and
    /// [`AllocError::Backend`] when its capture status cannot be read.
    ///
    /// # Safety
    /// 1. The contents are whatever the memory held before (another buffer's data). Do not read
    ///    them as `T` before writing them unless every bit pattern is a valid `T`.
    pub unsafe fn alloc<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CachedSlice<T>> {
        let size = std::mem::size_of::<T>();
        let bytes = len.checked_mul(size).ok_or(AllocError::TooLarge {
            requested: (len as u64).saturating_mul(size as u64),
        })?;
        let id = self.admit(stream)?;
        self.refuse_unrouted_capture(stream, id)?;
        let a = self.inner.allocate(bytes, id)?;
        // While cudarc manages stream synchronization, the buffer takes its read/write events at
        // its first use (the block's kept ones, or new ones inside a capture: Note [Event shells
        // and captures] in `interop::slice`).
        Ok(CachedSlice::from_parts(
            a.ptr,
            len,
            a.block_size,
            Arc::clone(stream),
            self.clone(),
        ))
    }

    /// The driver's id of the capture that `stream` (admitted as `id`) takes part in, if any. A
    /// legacy default stream never captures and is not asked (the driver may answer for the
    /// streams it synchronizes with instead).
    ///
    /// # Errors
    /// [`AllocError::Backend`] when the capture status cannot be read.
    pub(super) fn capture_of(&self, stream: &CudaStream, id: StreamId) -> Result<Option<u64>> {
        // The null handle and `CU_STREAM_LEGACY` (0x1).
        if (stream.cu_stream() as usize) <= 1 {
            return Ok(None);
        }
        self.device()
            .stream_capture_id(id)
            .map_err(|source| AllocError::Backend {
                operation: "cuStreamGetCaptureInfo",
                source,
            })
    }

    /// Refuses a typed allocation on a stream capturing a graph that no routing sends to a
    /// private pool (Note [Allocations inside a capture] in `interop::capture`).
    fn refuse_unrouted_capture(&self, stream: &CudaStream, id: StreamId) -> Result<()> {
        match self.capture_of(stream, id)? {
            Some(capture_id) if self.inner.routed_pool(id).is_none() => {
                Err(AllocError::UnroutedCapture {
                    stream: id,
                    capture_id,
                })
            }
            _ => Ok(()),
        }
    }

    /// Allocates `len` zeroed values of `T` on `stream` (the memset is queued on `stream`).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the memset.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CachedSlice<T>> {
        // SAFETY: the contents are overwritten with zeros below, a valid `T` (`ValidAsZeroBits`),
        // before anyone can read them.
        let mut buf = unsafe { self.alloc::<T>(stream, len) }?;
        if len > 0 {
            stream
                .memset_zeros(&mut buf)
                .map_err(|e| driver_error("cuMemsetD8Async", e))?;
        }
        Ok(buf)
    }

    /// Copies `src` to a new buffer on `stream`; returns once the copy is done.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the copy.
    pub fn htod<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        src: &[T],
    ) -> Result<CachedSlice<T>> {
        // SAFETY: every element is written by the copy below before anyone can read it.
        let mut buf = unsafe { self.alloc::<T>(stream, src.len()) }?;
        if !src.is_empty() {
            stream
                .memcpy_htod(src, &mut buf)
                .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        }
        Ok(buf)
    }

    /// Copies `src` (a slice, a `Vec`, an array or cudarc's `PinnedHostSlice`) to a new buffer on
    /// `stream` (cudarc's `CudaStream::clone_htod`). The copy goes through cudarc's
    /// `memcpy_htod`, so a pinned source keeps cudarc's semantics: the copy is asynchronous, waits
    /// for the pinned buffer's last use and records its event, and writing the pinned memory
    /// through cudarc afterwards waits for the copy.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the copy.
    pub fn clone_htod<T: DeviceRepr, Src: cu::HostSlice<T> + ?Sized>(
        &self,
        stream: &Arc<CudaStream>,
        src: &Src,
    ) -> Result<CachedSlice<T>> {
        // SAFETY: every element is written by the copy below before anyone can read it.
        let mut buf = unsafe { self.alloc::<T>(stream, src.len()) }?;
        if src.len() > 0 {
            stream
                .memcpy_htod(src, &mut buf)
                .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        }
        Ok(buf)
    }

    /// Copies a device buffer or view (ours or cudarc's) to a new buffer on `stream` (cudarc's
    /// `CudaStream::clone_dtod`, which allocates through the driver instead).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the copy.
    pub fn clone_dtod<T: DeviceRepr, Src: cu::DevicePtr<T>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &Src,
    ) -> Result<CachedSlice<T>> {
        // SAFETY: every element is written by the copy below before anyone can read it.
        let mut buf = unsafe { self.alloc::<T>(stream, src.len()) }?;
        if !src.is_empty() {
            stream
                .memcpy_dtod(src, &mut buf)
                .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))?;
        }
        Ok(buf)
    }

    /// An empty buffer on `stream` (cudarc's `CudaStream::null`): the null address, no memory,
    /// no driver call.
    ///
    /// # Errors
    /// A stream of another device.
    pub fn null<T>(&self, stream: &Arc<CudaStream>) -> Result<CachedSlice<T>> {
        self.admit(stream)?;
        Ok(CachedSlice::from_parts(
            DeviceAddr(0),
            0,
            0,
            Arc::clone(stream),
            self.clone(),
        ))
    }

    /// Copies a device buffer or view (ours or cudarc's) to a new `Vec` on the buffer's stream;
    /// returns once the copy is done.
    ///
    /// # Errors
    /// A driver error from the copy.
    pub fn dtoh<T: DeviceRepr, S: cu::DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        if src.is_empty() {
            return Ok(Vec::new());
        }
        src.stream()
            .clone_dtoh(src)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))
    }
}
