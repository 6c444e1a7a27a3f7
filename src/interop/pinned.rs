//! Cached pinned host buffers for cudarc: [`PinnedAllocator`] (a handle to a
//! [`PinnedCache`] over [`CudaHost`], or to a [`PagedPinnedCache`] over host pages from
//! [`CudaDevice::host_pages`]) and [`CachedPinned<T>`], a page-locked buffer that cudarc
//! takes wherever it takes a `HostSlice` (`memcpy_htod`, `memcpy_dtoh`, `clone_htod`) and whose
//! memory returns to the cache when dropped.
//!
//! Event rules (cudarc's `PinnedHostSlice`, kept): each buffer has one CUDA event (created with
//! `CU_EVENT_BLOCKING_SYNC`, as cudarc's); every stream use first waits on it and, while the
//! context manages stream synchronization, records it after the work is queued (cudarc's own
//! `SyncOnDrop::Record` does the recording); host access (`as_slice`, `as_mut_slice`, ...)
//! synchronizes it first. Three cases cudarc leaves to the user are made safe here, because a
//! dropped buffer's memory goes to a new owner that may write it at once:
//!
//! * a use while the context does **not** manage synchronization (one stream only, or event
//!   tracking off) on the legacy or per-thread default stream marks the buffer; host access and
//!   the drop then make the legacy default stream wait on the event and record it there, which
//!   orders it after every blocking stream of the context (the only kind cudarc makes while it
//!   counts no stream of its own) and after every use the event covered before. A use on those
//!   two streams marks the buffer while synchronization is managed too (in case the context
//!   stops managing it before cudarc records): host access after it then also waits for work
//!   queued on the legacy stream after the copy, which cudarc's own buffer does not;
//! * a use on any other stream while synchronization is not managed (a borrowed stream, event
//!   tracking off), or on a stream of another context, is made synchronous
//!   (`SyncOnDrop::Sync`): the copy is done when cudarc's call returns;
//! * a use on any other stream while synchronization *is* managed marks the buffer too: cudarc
//!   records the event only if the context still manages synchronization when the use ends, so
//!   the drop, exclusive host access, and shared host access after a marked write, that find it
//!   no longer managing synchronize the context first, once (Note [Management that ends
//!   mid-use], at `use_on`).
//!
//! Where cudarc's drop synchronizes the event and frees, a dropped `CachedPinned` does not block
//! (except after a use the last point marks, once the context no longer manages
//! synchronization: then it synchronizes the context): an event that may still be pending is
//! handed to the cache as a [`HostFence`] ([`PinnedCache::free_after`]), and the block is reused
//! only once a query says the event completed; the event then returns to a pool, so a cache hit
//! creates no event. A buffer never used on a stream is freed with no query at all.
//!
//! May use: `host`, `backend::cuda`, cudarc, `interop` helpers.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DeviceRepr, DriverError, HostSlice, SyncOnDrop,
    ValidAsZeroBits, sys,
};
use parking_lot::Mutex;

use crate::backend::BackendError;
use crate::backend::cuda::{CudaDevice, RelaxedCaptureMode, driver};
use crate::config::AllocatorConfig;
use crate::host::{
    CudaHost, HostBackend, HostFence, HostPtr, PagedPinnedCache, PinMethod, PinnedCache,
    PinnedConfig, PinnedError, PinnedInvariantViolation, PinnedStats,
};

/// The alignment of every host-pages block: the device allocator rounds sizes to 512 bytes.
const PAGES_ALIGNMENT: usize = 512;

/// Host waits for pending buffers an allocation of [`PinnedAllocator::with_defaults`] makes before
/// it maps more host pages (as [`PinnedConfig`]'s default `max_pending_waits`).
pub const DEFAULT_PENDING_WAITS: u32 = 4;

/// Most events a pool keeps; an event returned to a full pool is destroyed.
const EVENT_POOL_CAP: usize = 4096;

/// Completed events waiting for the next buffer.
#[derive(Default)]
struct EventPool {
    events: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    fn put(&self, event: CudaEvent) {
        let displaced = {
            let mut g = self.events.lock();
            if g.len() < EVENT_POOL_CAP {
                g.push(event);
                None
            } else {
                Some(event)
            }
        };
        drop(displaced);
    }
}

/// A buffer's event handed to the cache at the drop: complete once the buffer's last use is.
struct EventFence {
    event: Option<CudaEvent>,
    pool: Arc<EventPool>,
}

impl fmt::Debug for EventFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventFence").finish_non_exhaustive()
    }
}

impl HostFence for EventFence {
    /// Queried (and waited on) in relaxed capture mode: in the thread's default mode the call
    /// would invalidate a global-mode capture running on another thread
    /// (`gpu/probes/capture_queries.cu`). An event recorded inside a capture stays illegal to
    /// query in any mode.
    fn query(&mut self) -> Result<bool, BackendError> {
        match &self.event {
            Some(e) => {
                let _relaxed = RelaxedCaptureMode::enter()?;
                e.try_is_complete().map_err(|e| driver("cuEventQuery", e))
            }
            None => Ok(true),
        }
    }

    fn wait(&mut self) -> Result<(), BackendError> {
        match &self.event {
            Some(e) => {
                let _relaxed = RelaxedCaptureMode::enter()?;
                e.synchronize().map_err(|e| driver("cuEventSynchronize", e))
            }
            None => Ok(()),
        }
    }
}

impl Drop for EventFence {
    fn drop(&mut self) {
        // Dropped by the cache once the query or the wait said complete (or with the cache).
        if let Some(e) = self.event.take() {
            self.pool.put(e);
        }
    }
}

/// Where a [`PinnedAllocator`]'s memory comes from.
enum Engine {
    /// Exact-size blocks of pinned slabs ([`PinnedCache`] over [`CudaHost`]).
    Slabs(Box<PinnedCache<CudaHost>>),
    /// The device allocator's default over host pages ([`PagedPinnedCache`] over
    /// [`CudaDevice::host_pages`], its blocks on the device's quiet stream).
    Pages {
        cache: Box<PagedPinnedCache<CudaDevice>>,
        ctx: Arc<CudaContext>,
    },
}

impl Engine {
    fn alloc(&self, bytes: usize) -> Result<HostPtr, PinnedError> {
        match self {
            Engine::Slabs(c) => c.alloc(bytes).map(|b| b.ptr),
            Engine::Pages { cache, .. } => cache.alloc(bytes),
        }
    }

    fn free(&self, ptr: HostPtr) -> Result<(), PinnedError> {
        match self {
            Engine::Slabs(c) => c.free(ptr),
            Engine::Pages { cache, .. } => cache.free(ptr),
        }
    }

    fn free_after(&self, ptr: HostPtr, fence: Box<dyn HostFence>) -> Result<(), PinnedError> {
        match self {
            Engine::Slabs(c) => c.free_after(ptr, fence),
            Engine::Pages { cache, .. } => cache.free_after(ptr, fence),
        }
    }
}

struct PinnedInner {
    engine: Engine,
    events: Arc<EventPool>,
}

/// A handle to a caching allocator of pinned host memory on one CUDA context (cheap to clone;
/// clones share the cache). Buffers come from [`alloc_pinned`](Self::alloc_pinned) (cudarc's
/// `CudaContext::alloc_pinned`, cached) and friends.
///
/// ```no_run
/// use cuda_caching_allocator::host::PinnedConfig;
/// use cuda_caching_allocator::interop::PinnedAllocator;
/// use cudarc::driver::CudaContext;
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let pinned = PinnedAllocator::new(ctx.clone(), PinnedConfig::default())?;
/// let mut staging = pinned.alloc_pinned_zeros::<f32>(1 << 20)?;
/// staging.as_mut_slice()?.fill(1.0);
/// let dev = stream.clone_htod(&staging)?;     // async copy from cached pinned memory
/// drop(staging);                              // reused once the copy is done, never before
/// let back = pinned.alloc_pinned_zeros::<f32>(1 << 20)?;
/// # drop((dev, back));
/// println!("{}", pinned.summary());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct PinnedAllocator {
    inner: Arc<PinnedInner>,
}

impl fmt::Debug for PinnedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedAllocator")
            .field("host_pages", &self.is_host_pages())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl PinnedAllocator {
    /// A pinned cache of its own on `ctx`, with `config`.
    ///
    /// # Errors
    /// [`PinnedError::Backend`] when the device cannot be queried; [`PinnedError::InvalidConfig`]
    /// for a bad configuration.
    pub fn new(ctx: Arc<CudaContext>, config: PinnedConfig) -> Result<Self, PinnedError> {
        Self::with_method(ctx, config, PinMethod::default())
    }

    /// Like [`new`](Self::new), pinning slabs with `method` ([`PinMethod`]: `cuMemHostAlloc`, or
    /// `cuMemHostRegister` over memory touched by several threads, the default for slabs of
    /// 4 MiB and more).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_method(
        ctx: Arc<CudaContext>,
        config: PinnedConfig,
        method: PinMethod,
    ) -> Result<Self, PinnedError> {
        let device = CudaDevice::new(ctx)?;
        let cache = PinnedCache::new(CudaHost::with_method(Arc::new(device), method), config)?;
        Ok(Self::from_engine(Engine::Slabs(Box::new(cache))))
    }

    /// A pinned cache on `ctx` whose memory is **host pages reused page by page**: the crate's
    /// device allocator (its default configuration: expandable segments, 2 MiB pages, page
    /// reuse) over [`CudaDevice::host_pages`], behind a [`PagedPinnedCache`] that reuses a
    /// dropped buffer only after its last copy and waits for up to `max_pending_waits` pending
    /// buffers before it maps more. It keeps the pinned bytes near the bytes in use where slabs
    /// strand memory (`docs/pinned.md`), at the cost of page moves. The buffers, their event
    /// rules and the statistics are the same as [`new`](Self::new)'s (see [`stats`](Self::stats)
    /// for what a pin is here).
    ///
    /// # Errors
    /// [`PinnedError::Backend`] when the device cannot map host pages or a stream cannot be
    /// created.
    pub fn host_pages(ctx: Arc<CudaContext>, max_pending_waits: u32) -> Result<Self, PinnedError> {
        let device = CudaDevice::host_pages(Arc::clone(&ctx))?;
        let id = device
            .quiet_stream()
            .ok_or(PinnedError::Backend(BackendError::Unsupported(
                "host pages without their stream",
            )))?;
        let cache = Box::new(PagedPinnedCache::new(
            device,
            id,
            AllocatorConfig::default(),
            max_pending_waits,
        )?);
        Ok(Self::from_engine(Engine::Pages { cache, ctx }))
    }

    /// The crate's default pinned cache on `ctx`: [`host_pages`](Self::host_pages) with
    /// [`DEFAULT_PENDING_WAITS`] waits where the device can map host pages (it keeps the pinned
    /// bytes within a few percent of those in use, `docs/pinned.md`), else slabs
    /// ([`new`](Self::new) with the default [`PinnedConfig`]).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_defaults(ctx: Arc<CudaContext>) -> Result<Self, PinnedError> {
        match Self::host_pages(Arc::clone(&ctx), DEFAULT_PENDING_WAITS) {
            Ok(p) => Ok(p),
            // Nothing was allocated yet: a device or driver that cannot map host pages (no
            // virtual memory management, a driver older than host locations) gets slabs.
            Err(PinnedError::Backend(e)) => {
                tracing::debug!(target: "cuda_caching_allocator", %e, "host pages unavailable; pinned slabs instead");
                Self::new(ctx, PinnedConfig::default())
            }
            Err(e) => Err(e),
        }
    }

    fn from_engine(engine: Engine) -> Self {
        PinnedAllocator {
            inner: Arc::new(PinnedInner {
                engine,
                events: Arc::new(EventPool::default()),
            }),
        }
    }

    /// Caps the pinned bytes of a host-pages cache ([`PagedPinnedCache::set_max_pinned`]).
    ///
    /// # Errors
    /// [`PinnedError::InvalidConfig`] for a slab cache (its cap is
    /// [`PinnedConfig::max_pinned`], fixed at construction); as
    /// [`PagedPinnedCache::set_max_pinned`] otherwise.
    pub fn set_max_pinned(&self, cap: Option<usize>) -> Result<(), PinnedError> {
        match &self.inner.engine {
            Engine::Slabs(_) => Err(PinnedError::InvalidConfig(
                "a slab cache takes its cap from PinnedConfig::max_pinned at construction".into(),
            )),
            Engine::Pages { cache, .. } => cache.set_max_pinned(cap),
        }
    }

    /// Whether the memory is host pages ([`host_pages`](Self::host_pages)) rather than slabs.
    pub fn is_host_pages(&self) -> bool {
        matches!(self.inner.engine, Engine::Pages { .. })
    }

    /// The cudarc context the events and the pinning calls use.
    pub fn context(&self) -> &Arc<CudaContext> {
        match &self.inner.engine {
            Engine::Slabs(c) => c.host().device().context(),
            Engine::Pages { ctx, .. } => ctx,
        }
    }

    /// The driver calls made for host pages and the host time inside them
    /// ([`CudaDevice::call_times`]); `None` for slabs.
    pub fn host_page_call_times(&self) -> Option<crate::DeviceCallTimes> {
        match &self.inner.engine {
            Engine::Slabs(_) => None,
            Engine::Pages { cache, .. } => Some(cache.core().backend().call_times()),
        }
    }

    /// A copy of the statistics ([`PinnedStats`]). For host pages the pinning figures are the
    /// driver's: a *pin* is a host page mapped where a block needs it (created, or moved from
    /// where it lay free), an *unpin* a page unmapped (moved away or returned), and their times
    /// are the host time inside every call that makes pages usable (create, map, access) and
    /// unusable (unmap, release).
    pub fn stats(&self) -> PinnedStats {
        match &self.inner.engine {
            Engine::Slabs(c) => c.stats(),
            Engine::Pages { cache, .. } => {
                let mut st = cache.stats();
                let calls = cache.core().backend().call_times();
                let count = |kind: &str| calls.get(kind).map_or(0, |(n, _)| n);
                let nanos = |kinds: &[&str]| -> u64 {
                    kinds
                        .iter()
                        .map(|k| calls.get(k).map_or(0, |(_, ns)| ns))
                        .sum()
                };
                st.num_pins = count("map");
                st.num_unpins = count("unmap");
                st.pin_nanos = nanos(&["reserve", "create", "map", "set_access"]);
                st.unpin_nanos = nanos(&["unmap", "release", "release_range"]);
                st
            }
        }
    }

    /// The statistics as one line.
    pub fn summary(&self) -> String {
        self.stats().summary()
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        match &self.inner.engine {
            Engine::Slabs(c) => c.reset_peak_stats(),
            Engine::Pages { cache, .. } => cache.reset_peak_stats(),
        }
    }

    /// The configuration in force (for host pages: the default slab configuration, of which
    /// only the alignment, 512 bytes, applies).
    pub fn config(&self) -> PinnedConfig {
        match &self.inner.engine {
            Engine::Slabs(c) => c.config(),
            Engine::Pages { .. } => PinnedConfig::default().with_alignment(PAGES_ALIGNMENT),
        }
    }

    /// Freed buffers whose last copy has not been seen complete yet.
    pub fn waiting_blocks(&self) -> usize {
        match &self.inner.engine {
            Engine::Slabs(c) => c.waiting_blocks(),
            Engine::Pages { cache, .. } => cache.waiting_blocks(),
        }
    }

    /// Events kept for the next buffers (each a CUDA event).
    pub fn kept_events(&self) -> usize {
        self.inner.events.events.lock().len()
    }

    /// Unpins every wholly free slab (unmaps every free host page) and destroys the kept events;
    /// returns the bytes released. Blocks still waiting for their copies stay pinned.
    ///
    /// # Errors
    /// As [`PinnedCache::empty_cache`].
    pub fn empty_cache(&self) -> Result<usize, PinnedError> {
        let freed = match &self.inner.engine {
            Engine::Slabs(c) => c.empty_cache(),
            Engine::Pages { cache, .. } => cache.empty_cache(),
        };
        let events = std::mem::take(&mut *self.inner.events.events.lock());
        drop(events);
        freed
    }

    /// Runs the pinned cache's invariant checker.
    ///
    /// # Errors
    /// The first violated invariant.
    pub fn check_invariants(&self) -> Result<(), PinnedInvariantViolation> {
        match &self.inner.engine {
            Engine::Slabs(c) => c.check_invariants(),
            Engine::Pages { cache, .. } => cache.check_invariants(),
        }
    }

    fn event(&self) -> Result<CudaEvent, PinnedError> {
        if let Some(e) = self.inner.events.events.lock().pop() {
            return Ok(e);
        }
        self.context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| PinnedError::Backend(driver("cuEventCreate", e)))
    }

    /// Page-locked room for `len` values of `T`, from the cache (cudarc's
    /// `CudaContext::alloc_pinned`, without a `cuMemHostAlloc` on a cache hit). `len == 0` gives
    /// an empty buffer with no memory and no event. Where the cache would otherwise pin while
    /// dropped buffers still wait for their copies, it waits for the oldest such copy instead
    /// ([`PendingPolicy::Wait`](crate::host::PendingPolicy), the default).
    ///
    /// # Errors
    /// [`PinnedError::InvalidRequest`] when `len * size_of::<T>()` overflows;
    /// [`PinnedError::CapExceeded`] past the cap; [`PinnedError::Backend`] when pinning or
    /// creating the buffer's event fails.
    ///
    /// # Safety
    /// 1. The contents are whatever the memory held before (another buffer's data): do not read
    ///    them as `T` before writing them unless every bit pattern is a valid `T`.
    pub unsafe fn alloc_pinned<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CachedPinned<T>, PinnedError> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            PinnedError::InvalidRequest(format!(
                "{len} values of {} bytes overflow",
                std::mem::size_of::<T>()
            ))
        })?;
        if bytes == 0 {
            return Ok(CachedPinned {
                ptr: NonNull::dangling(),
                len,
                block: None,
                event: None,
                used: AtomicBool::new(false),
                first_stream: AtomicU64::new(0),
                streams_differ: AtomicBool::new(false),
                lazy: AtomicBool::new(false),
                unrecorded_on: Mutex::new(Vec::new()),
                unrecorded_write: AtomicBool::new(false),
                alloc: self.clone(),
                marker: PhantomData,
            });
        }
        if std::mem::align_of::<T>() > self.config().alignment {
            return Err(PinnedError::InvalidRequest(format!(
                "values of alignment {} exceed the cache's alignment {}",
                std::mem::align_of::<T>(),
                self.config().alignment
            )));
        }
        let event = self.event()?;
        let block = match self.inner.engine.alloc(bytes) {
            Ok(b) => b,
            Err(e) => {
                self.inner.events.put(event);
                return Err(e);
            }
        };
        let Some(ptr) = NonNull::new(block.addr() as *mut T) else {
            // Unreachable by the backend's contract (ranges are never null); give it back.
            let _ = self.inner.engine.free(block);
            self.inner.events.put(event);
            return Err(PinnedError::InvalidRequest("null pinned block".into()));
        };
        Ok(CachedPinned {
            ptr,
            len,
            block: Some(block),
            event: Some(event),
            used: AtomicBool::new(false),
            first_stream: AtomicU64::new(0),
            streams_differ: AtomicBool::new(false),
            lazy: AtomicBool::new(false),
            unrecorded_on: Mutex::new(Vec::new()),
            unrecorded_write: AtomicBool::new(false),
            alloc: self.clone(),
            marker: PhantomData,
        })
    }

    /// `len` zeroed values of `T` in page-locked memory from the cache (zeroed on the host).
    ///
    /// # Errors
    /// As [`alloc_pinned`](Self::alloc_pinned).
    pub fn alloc_pinned_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CachedPinned<T>, PinnedError> {
        // SAFETY: every byte is written with zero below before anyone reads it; zero bits are a
        // valid `T` (`ValidAsZeroBits`).
        let buf = unsafe { self.alloc_pinned::<T>(len) }?;
        if let Some(block) = buf.block {
            // SAFETY: the block holds `len * size_of::<T>()` bytes handed to `buf` alone, and no
            // stream uses it yet.
            unsafe {
                std::ptr::write_bytes(block.addr() as *mut u8, 0, len * std::mem::size_of::<T>())
            };
        }
        Ok(buf)
    }

    /// A copy of `src` in page-locked memory from the cache (copied on the host).
    ///
    /// # Errors
    /// As [`alloc_pinned`](Self::alloc_pinned).
    pub fn pinned_from_slice<T: DeviceRepr + Copy>(
        &self,
        src: &[T],
    ) -> Result<CachedPinned<T>, PinnedError> {
        // SAFETY: every element is written by the copy below before anyone reads it.
        let buf = unsafe { self.alloc_pinned::<T>(src.len()) }?;
        if buf.block.is_some() {
            // SAFETY: `buf` owns `src.len()` values of room at `ptr`, disjoint from `src` (it is
            // pinned memory of the cache), and no stream uses it yet.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf.ptr.as_ptr(), src.len()) };
        }
        Ok(buf)
    }
}

/// Page-locked host memory for `len` values of `T` from a [`PinnedAllocator`]: cudarc's
/// `PinnedHostSlice<T>`, cached. It implements cudarc's `HostSlice<T>`, so
/// `stream.memcpy_htod(&buf, &mut dev)`, `stream.memcpy_dtoh(&dev, &mut buf)` and
/// `stream.clone_htod(&buf)` take it (and so does [`CudaAllocator::clone_htod`](super::CudaAllocator::clone_htod)).
/// Copies are asynchronous; host access waits for them (see the module's event rules), and the
/// memory returns to the cache when the buffer is dropped, reused only after its last copy.
pub struct CachedPinned<T> {
    ptr: NonNull<T>,
    len: usize,
    /// The cache block (`None` for an empty buffer).
    block: Option<HostPtr>,
    event: Option<CudaEvent>,
    /// Used on a stream since the last exclusive host access: the event may be pending.
    used: AtomicBool,
    /// The first stream the buffer was used on (its handle + 1; 0 before any use).
    first_stream: AtomicU64,
    /// Used on two streams or more: uses that overlapped fence only the last record (Note
    /// [Overlapping uses of one buffer]).
    streams_differ: AtomicBool,
    /// Used on a default stream while the context did not manage synchronization: the event must
    /// be recorded on the legacy default stream before it fences anything.
    lazy: AtomicBool,
    /// The context objects of the streams the buffer was used on, other than the default ones,
    /// while that object managed synchronization, and not synchronized by the buffer since:
    /// cudarc recorded the event only if the stream's object still managed it when the use's
    /// `SyncOnDrop` dropped (Note [Management that ends mid-use]). The stream's object, not the
    /// event's: a shared cache's events belong to its own object, which need not manage
    /// anything while the program's does.
    unrecorded_on: Mutex<Vec<Arc<CudaContext>>>,
    /// A write (a copy into the buffer) was marked in `unrecorded_on` since the last context
    /// synchronization of host access: shared host access waits for the context only then
    /// (Note [Management that ends mid-use]).
    unrecorded_write: AtomicBool,
    alloc: PinnedAllocator,
    marker: PhantomData<T>,
}

// SAFETY: the buffer owns its memory (a block of the cache) as a `Box<[T]>` would; the event is
// `Send + Sync` (cudarc), the flags are atomics, the context objects sit behind a mutex and the
// allocator handle is `Send + Sync`.
unsafe impl<T: Send> Send for CachedPinned<T> {}
// SAFETY: shared access only reads the memory (or hands it to cudarc as `&[T]`).
unsafe impl<T: Sync> Sync for CachedPinned<T> {}

impl<T> fmt::Debug for CachedPinned<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedPinned")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The first of `objects` (context objects a buffer was used through) that no longer manages
/// stream synchronization: cudarc may have left that use unrecorded. One is enough: a use marks
/// only objects equal to its buffer's event's context (`use_on`), so all of them are objects of
/// one driver context, and synchronizing any of them waits for every use marked through each.
fn no_longer_managing(objects: &[Arc<CudaContext>]) -> Option<Arc<CudaContext>> {
    objects
        .iter()
        .find(|c| !c.is_managing_stream_synchronization())
        .cloned()
}

/// Whether `stream` is ordered by the legacy default stream: the legacy stream itself
/// (`NULL`, `CU_STREAM_LEGACY`) or the per-thread default stream, both blocking.
fn legacy_ordered(stream: &CudaStream) -> bool {
    matches!(stream.cu_stream() as usize, 0..=2)
}

/// Re-records `ev` on the legacy default stream of its context, after making that stream wait
/// for what `ev` fenced so far: the event then covers every earlier use (those on non-blocking
/// streams through the wait, those on blocking streams through the legacy stream's order).
fn fence_on_legacy(ev: &CudaEvent) -> Result<(), DriverError> {
    let legacy = ev.context().default_stream();
    legacy.wait(ev)?;
    ev.record(&legacy)
}

impl<T> CachedPinned<T> {
    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The buffer's address, without waiting for its copies: for comparing and logging, not
    /// for reading or writing (use [`as_slice`](Self::as_slice) and friends, which wait).
    pub fn host_ptr(&self) -> HostPtr {
        HostPtr(self.ptr.as_ptr() as usize)
    }

    /// The allocator the memory returns to.
    pub fn allocator(&self) -> &PinnedAllocator {
        &self.alloc
    }

    /// The context of the buffer's event.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.alloc.context()
    }

    /// Waits until no queued copy uses the memory (host access). `exclusive`: nobody else can
    /// queue a use meanwhile (`&mut self`), so the marks can be cleared.
    fn sync_host(&self, exclusive: bool) -> Result<(), DriverError> {
        let Some(ev) = &self.event else {
            return Ok(());
        };
        if self.lazy.load(Ordering::Acquire) {
            fence_on_legacy(ev)?;
            if exclusive {
                self.lazy.store(false, Ordering::Release);
            }
        }
        // Note [Management that ends mid-use]. The marks are cleared only by a synchronization
        // that ran (and only by an exclusive access: a shared one may race a new use).
        // Shared access waits only for a write that may be unrecorded: a write needs `&mut self`,
        // so every write marked before this `&self` access was queued before it, and none is
        // marked during it; reads still running change nothing the host reads. Exclusive access
        // (the host is about to write) waits for every marked use.
        let unmanaged = no_longer_managing(&self.unrecorded_on.lock());
        if let Some(ctx) = unmanaged
            && (exclusive || self.unrecorded_write.load(Ordering::Acquire))
        {
            ctx.synchronize()?;
            self.unrecorded_write.store(false, Ordering::Release);
            if exclusive {
                self.unrecorded_on.lock().clear();
            }
        }
        if self.used.load(Ordering::Acquire) {
            ev.synchronize()?;
            if exclusive {
                self.used.store(false, Ordering::Release);
            }
        }
        Ok(())
    }
}

impl<T: ValidAsZeroBits> CachedPinned<T> {
    /// Waits for every queued copy of the buffer, then its address (cudarc's `as_ptr`).
    ///
    /// # Errors
    /// A driver error from the event calls.
    pub fn as_ptr(&self) -> Result<*const T, DriverError> {
        self.sync_host(false)?;
        Ok(self.ptr.as_ptr())
    }

    /// Waits for every queued copy of the buffer, then its address (cudarc's `as_mut_ptr`).
    ///
    /// # Errors
    /// A driver error from the event calls.
    pub fn as_mut_ptr(&mut self) -> Result<*mut T, DriverError> {
        self.sync_host(true)?;
        Ok(self.ptr.as_ptr())
    }

    /// Waits for every queued copy of the buffer, then the values (cudarc's `as_slice`).
    ///
    /// # Errors
    /// A driver error from the event calls.
    pub fn as_slice(&self) -> Result<&[T], DriverError> {
        self.sync_host(false)?;
        // SAFETY: `ptr` holds `len` values owned by this buffer (or is dangling with `len == 0`),
        // initialised as the caller of `alloc_pinned` promised, and no queued copy writes them
        // (writes need `&mut self`; the copies queued before were waited for above).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// Waits for every queued copy of the buffer, then the values (cudarc's `as_mut_slice`).
    ///
    /// # Errors
    /// A driver error from the event calls.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], DriverError> {
        self.sync_host(true)?;
        // SAFETY: as in `as_slice`; `&mut self` excludes every other access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }
}

impl<T> CachedPinned<T> {
    /// The stream rules of the module docs for one use on `stream`.
    /// `write`: the use writes the buffer (a copy into it).
    fn use_on<'a>(&'a self, stream: &'a CudaStream, write: bool) -> SyncOnDrop<'a> {
        let Some(ev) = &self.event else {
            return SyncOnDrop::Sync(None);
        };
        let ctx = stream.context();
        // cudarc's rule: every use waits for the previous ones. A buffer not used yet has none
        // to wait for: its event may come from the pool, recorded (and complete) for an earlier
        // buffer, and inside a graph capture a wait on an event recorded outside it fails and
        // invalidates the capture (`gpu/probes/capture_event_wait.cu`), where cudarc's fresh
        // event would not.
        if self.used.load(Ordering::Acquire) {
            if self.lazy.load(Ordering::Acquire) && !ctx.is_managing_stream_synchronization() {
                // A use on a default stream while the context managed nothing left the event
                // unrecorded: it is recorded on the legacy stream first, so that this use waits
                // for that one (as host access and the drop do), where the module's rule
                // promises every use waits for the previous ones
                // (`pinned_review_a_lazy_default_stream_use_is_not_waited_for_by_the_next_use`).
                // While the context manages synchronization cudarc recorded that use itself.
                ctx.record_err(fence_on_legacy(ev));
            }
            ctx.record_err(stream.wait(ev));
        }
        if **ctx != **ev.context() {
            return SyncOnDrop::sync_stream(stream);
        }
        self.used.store(true, Ordering::Release);
        let handle = stream.cu_stream() as u64 + 1;
        if let Err(first) =
            self.first_stream
                .compare_exchange(0, handle, Ordering::AcqRel, Ordering::Acquire)
            && first != handle
        {
            self.streams_differ.store(true, Ordering::Release);
        }
        let legacy = legacy_ordered(stream);
        if legacy {
            // Also when synchronization is managed: if the context stops managing it before
            // cudarc records (its last stream dropped on another thread), the legacy record at
            // host access or drop still fences this use.
            self.lazy.store(true, Ordering::Release);
        }
        if ctx.is_managing_stream_synchronization() {
            if !legacy {
                // Note [Management that ends mid-use]: cudarc decides twice whether the context
                // manages synchronization: here, when the use begins, and again when the
                // `SyncOnDrop` returned below drops after the copy is queued, where it records
                // only if the context still manages it. Dropping the context's last stream of
                // its own in between (another thread, or this one) or turning event tracking off
                // leaves the copy unrecorded. On the default streams the legacy fence covers
                // it; on any other stream (a borrowed one, which cudarc does not count) the
                // dropped buffer's block would be reused under the copy. So the use marks the
                // buffer, and host access or the drop that finds management off synchronizes
                // the context first (where cudarc's own drop is covered by the implicit
                // synchronization of `cuMemFreeHost`). Shared host access does so only while a
                // marked write has not been waited for: the host only reads then, and a copy
                // that reads the buffer changes nothing it sees; the exclusive access and the
                // drop wait for every marked use, and only they clear the marks. (It once
                // synchronized the context at every `as_slice` once the program's streams were
                // gone: `pinned_review_shared_host_access_after_management_ends_...`.) Not covered: management turned back on
                // before that check without a completed context synchronization (`fork`, or
                // another thread inside `new_stream` before its synchronization, or
                // `enable_event_tracking`): the drop then trusts an event cudarc did not record.
                let mut on = self.unrecorded_on.lock();
                if !on.iter().any(|c| Arc::ptr_eq(c, ctx)) {
                    on.push(Arc::clone(ctx));
                }
                if write {
                    self.unrecorded_write.store(true, Ordering::Release);
                }
            }
            SyncOnDrop::Record(Some((ev, stream)))
        } else if legacy {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::sync_stream(stream)
        }
    }
}

impl<T> HostSlice<T> for CachedPinned<T> {
    fn len(&self) -> usize {
        self.len
    }

    unsafe fn stream_synced_slice<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (&'a [T], SyncOnDrop<'a>) {
        let record = self.use_on(stream, false);
        // SAFETY: `ptr` holds `len` values owned by this buffer (dangling with `len == 0`); the
        // copy that reads them is ordered after earlier uses (the wait above).
        let slice = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        (slice, record)
    }

    unsafe fn stream_synced_mut_slice<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (&'a mut [T], SyncOnDrop<'a>) {
        let record = self.use_on(stream, true);
        // SAFETY: as above; `&mut self` makes the copy the only writer.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) };
        (slice, record)
    }
}

impl<T> Drop for CachedPinned<T> {
    fn drop(&mut self) {
        let Some(block) = self.block else {
            return;
        };
        let cache = &self.alloc.inner.engine;
        let pool = &self.alloc.inner.events;
        let Some(ev) = self.event.take() else {
            return;
        };
        // Note [Management that ends mid-use]: a use that cudarc may have left unrecorded.
        if let Some(ctx) = no_longer_managing(self.unrecorded_on.get_mut()) {
            if let Err(e) = ctx.synchronize() {
                // Not waited for: the copy may still run, so the memory must never be handed
                // out again. Leak the block (and the event with it); the error goes to the
                // context, as cudarc's own drops report theirs.
                tracing::warn!(
                    ?block,
                    error = %e,
                    "pinned buffer could not be waited for; its block stays out of reuse"
                );
                ctx.record_err(Err::<(), _>(e));
                std::mem::forget(ev);
                return;
            }
        }
        // Note [Overlapping uses of one buffer]: a buffer has one event, and two uses on two
        // streams that overlap (threads copying from one `&CachedPinned` at once: both wait on
        // the event's old state, and the last record wins) leave it fencing one copy only.
        // cudarc's buffer has the same one event, but its drop synchronizes it and then frees
        // with `cuMemFreeHost`, which waits for the device; the cache would hand the block out
        // while the other copy still reads it (`pinned_review_concurrent_uses_fence_only_the_
        // last_record`). So a buffer used on more than one stream synchronizes its context at
        // the drop, as cudarc's free does; one used on a single stream still drops without
        // blocking. Left: host access keeps cudarc's own rule (the event only), with its gap.
        if *self.streams_differ.get_mut() && *self.used.get_mut() {
            let ctx = Arc::clone(ev.context());
            if let Err(e) = ctx.synchronize() {
                tracing::warn!(
                    ?block,
                    error = %e,
                    "pinned buffer used on several streams could not be waited for; its block stays out of reuse"
                );
                ctx.record_err(Err::<(), _>(e));
                std::mem::forget(ev);
                return;
            }
        }
        if *self.lazy.get_mut() {
            let ctx = Arc::clone(ev.context());
            if fence_on_legacy(&ev).is_err() && ctx.synchronize().is_err() {
                // Neither fenced nor waited for: the copies may still run, so the memory must
                // never be handed out again. Leak the block (and the event with it).
                tracing::warn!(
                    ?block,
                    "pinned buffer could not be fenced; its block stays out of reuse"
                );
                std::mem::forget(ev);
                return;
            }
        }
        if *self.used.get_mut() {
            let fence = EventFence {
                event: Some(ev),
                pool: Arc::clone(pool),
            };
            // Unknown block: impossible (the buffer owns it); the fence then just drops.
            let _ = cache.free_after(block, Box::new(fence));
        } else {
            pool.put(ev);
            let _ = cache.free(block);
        }
    }
}
