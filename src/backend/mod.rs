//! The device backend: everything the cache needs from a device, and nothing more.
//!
//! A backend hands out *segments* (exact-size device allocations bound to a stream), reports free
//! and total memory, and synchronizes. Two optional capability groups fit in without breaking
//! implementors, because each method has a default that answers
//! [`BackendError::Unsupported`]:
//!
//! * **events** (create / record / query / synchronize / stream-wait / destroy), used for
//!   `record_stream` and cross-stream reuse;
//! * **virtual memory** (reserve an address range; create, map, unmap and release physical pages),
//!   used by expandable segments.
//! * **capture status** ([`DeviceBackend::stream_capture_id`], default "no capture"), used to
//!   route the allocations of a graph capture to a private pool.
//!
//! This module names no concrete device. [`sim::SimDevice`] is the deterministic host-only device;
//! `cuda::CudaDevice` (behind the `cuda` feature) drives a real GPU through cudarc. May use:
//! nothing internal but value types.

use std::fmt;

pub mod call_times;
#[cfg(feature = "cuda-unpinned")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-unpinned")))]
pub mod cuda;
pub mod sim;

/// An opaque device address. Never dereferenced on the host. `0` is the null pointer, which is
/// what a zero-byte allocation returns (as in PyTorch).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceAddr(pub u64);

impl DeviceAddr {
    /// The null device pointer.
    pub const NULL: DeviceAddr = DeviceAddr(0);

    /// The raw address.
    #[inline]
    pub const fn addr(self) -> u64 {
        self.0
    }

    /// Whether this is the null pointer.
    #[inline]
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }

    /// This address moved forward by `bytes`.
    #[inline]
    pub const fn offset(self, bytes: usize) -> DeviceAddr {
        DeviceAddr(self.0.wrapping_add(bytes as u64))
    }
}

impl fmt::Debug for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An opaque stream identifier: the raw `CUstream` handle value on CUDA (`0` is the legacy
/// default stream), any number on the simulated device. Free blocks are ordered by this value
/// first, as PyTorch orders them by the stream handle.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The default (legacy null) stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {:#x}", self.0)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An opaque event handle issued by [`DeviceBackend::create_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventHandle(pub u64);

/// An opaque physical-memory handle issued by [`DeviceBackend::create_physical`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysicalHandle(pub u64);

/// Free and total device memory in bytes, as `cudaMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: usize,
    /// Bytes of device memory in all.
    pub total: usize,
}

/// One finished job of [`DeviceBackend::unmap_later`].
#[derive(Debug)]
pub struct FinishedUnmaps {
    /// The ticket `unmap_later` returned.
    pub ticket: u64,
    /// How many of the job's ranges were unmapped, from the first, in order.
    pub unmapped: usize,
    /// The error that stopped the job at range `unmapped` (the rest stay mapped), if any.
    pub error: Option<BackendError>,
}

/// What a backend call can fail with. Each variant says what the caller can do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no room for the request. The cache reacts by releasing cached segments and
    /// retrying; a direct caller can free memory and try again.
    #[error("the device is out of memory")]
    OutOfMemory,
    /// The backend does not accept this stream (destroyed, foreign to this device, or unknown).
    /// Use a stream created on this backend's device.
    #[error("stream {stream} is not valid on this device: {reason}")]
    InvalidStream {
        /// The rejected stream.
        stream: StreamId,
        /// Why the backend rejected it.
        reason: String,
    },
    /// The backend lacks this optional capability (events or virtual memory). Choose a
    /// configuration that does not need it.
    #[error("{0} is not supported by this backend")]
    Unsupported(&'static str),
    /// No CUDA driver library could be loaded on this machine (`libcuda.so.1` and its other
    /// names): run on a machine with an NVIDIA driver, or use the simulated device.
    #[error("no CUDA driver was found on this machine (libcuda.so.1 could not be loaded)")]
    NoDriver,
    /// An argument the backend cannot act on (a pointer or handle it never issued, a size that is
    /// not a multiple of its granularity). This is a bug in the caller.
    #[error("invalid argument to {operation}: {reason}")]
    InvalidArgument {
        /// The backend call.
        operation: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A fault injected on purpose by a test (see `SimDevice`'s fault plan).
    #[error("injected fault in {operation} (device call #{call})")]
    Injected {
        /// The backend call that failed.
        operation: &'static str,
        /// The index of the failing device call, counting from 1.
        call: u64,
    },
    /// An operating-system call failed: taking another process's descriptors to import its
    /// memory (`pidfd_open`, `pidfd_getfd`). The message names the call and the reason.
    #[error("{operation} failed: {source}")]
    Os {
        /// The system call.
        operation: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The driver reported an error; the device or context may be unusable.
    #[error("{operation} failed: {source}")]
    Driver {
        /// The backend call.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl BackendError {
    /// Whether the error means "no room", after which freeing cache and retrying can help.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, BackendError::OutOfMemory)
    }
}

/// Raw device memory and the few device services the cache needs.
///
/// Everything is `&self`: backends synchronize internally (the cache calls them under its own
/// lock, but stats readers and other allocators may share a backend).
///
/// # Safety
///
/// Implementors promise:
/// 1. every range `[ptr, ptr + size)` returned by [`allocate`](Self::allocate) (and every mapped
///    range of a reserved address range) is non-null, aligned to [`alignment`](Self::alignment),
///    and disjoint from every other live range this backend has handed out, until it is freed;
/// 2. the memory stays valid for device work on any stream of this device until it is freed;
/// 3. `mem_info().total` does not change over the backend's life.
///
/// The cache relies on these to hand out non-overlapping blocks; a backend that breaks them makes
/// the cache hand the same bytes to two owners.
pub unsafe trait DeviceBackend: Send + Sync {
    /// The device ordinal this backend allocates on (for messages and the registry).
    fn device_index(&self) -> usize {
        0
    }

    /// The alignment every segment start is guaranteed to have (CUDA: at least 256 bytes).
    fn alignment(&self) -> usize;

    /// Free and total device memory.
    ///
    /// # Errors
    /// A driver error if the query fails.
    fn mem_info(&self) -> Result<MemInfo, BackendError>;

    /// Allocates a segment of exactly `size` bytes for use on `stream`.
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] when the device is full (the cache then releases cache and
    /// retries); any other error is passed to the caller unchanged.
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddr, BackendError>;

    /// Returns a segment to the device.
    ///
    /// # Errors
    /// A driver or injected error; the segment then stays allocated and the caller keeps it.
    ///
    /// # Safety
    /// 1. `ptr` and `size` come from one earlier [`allocate`](Self::allocate) on `self` and were
    ///    not freed since.
    /// 2. No queued work on any stream still reads or writes the range.
    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: StreamId,
    ) -> Result<(), BackendError>;

    /// Blocks until all queued work on the device is done.
    ///
    /// # Errors
    /// A driver error.
    fn synchronize(&self) -> Result<(), BackendError>;

    /// Checks that `stream` can be used on this device. Called once per stream the cache has not
    /// seen before; the default accepts every stream.
    ///
    /// # Errors
    /// [`BackendError::InvalidStream`] for a stream the backend rejects.
    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        let _ = stream;
        Ok(())
    }

    /// Blocks until all queued work on `stream` is done. Defaults to [`synchronize`](Self::synchronize).
    ///
    /// # Errors
    /// A driver error.
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        let _ = stream;
        self.synchronize()
    }

    // ---- graph capture ------------------------------------------------------------------------

    /// The id of the graph capture `stream` is taking part in (as `cuStreamGetCaptureInfo`
    /// reports it: the origin stream's capture, also for streams joined into it), or `None` when
    /// it is not capturing. Must be cheap and legal during a capture: the cache calls it under its
    /// lock for each allocation while a capture routing is active. The default, `Ok(None)`, means
    /// a backend without capture support.
    ///
    /// A backend with capture support also promises that its allocation calls
    /// ([`allocate`](Self::allocate), [`reserve_address_range`](Self::reserve_address_range),
    /// [`create_physical`](Self::create_physical), [`map`](Self::map)) are legal during a capture
    /// in any capture mode (CUDA: made with the calling thread's capture mode exchanged to
    /// relaxed), since the cache may have to grow while a capture is underway. The cache itself
    /// makes no synchronization, event query, free, unmap or release while a capture is underway.
    ///
    /// # Errors
    /// A driver error (the cache then treats the stream as not capturing).
    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        let _ = stream;
        Ok(None)
    }

    // ---- events -------------------------------------------------------------------------------

    /// Creates an event (timing disabled). The cache pools events, so this is rare.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when the backend has no events.
    fn create_event(&self) -> Result<EventHandle, BackendError> {
        Err(BackendError::Unsupported("events"))
    }

    /// Records `event` on `stream`: it completes once the work queued there so far is done.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] or a driver error.
    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        let _ = (event, stream);
        Err(BackendError::Unsupported("events"))
    }

    /// Whether the work before `event` is done (never blocks).
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] or a driver error.
    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        let _ = event;
        Err(BackendError::Unsupported("events"))
    }

    /// Blocks until the work before `event` is done.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] or a driver error.
    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        let _ = event;
        Err(BackendError::Unsupported("events"))
    }

    /// Makes future work on `stream` wait for `event` (no host blocking).
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] or a driver error.
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        let _ = (stream, event);
        Err(BackendError::Unsupported("events"))
    }

    /// Destroys an event.
    ///
    /// # Errors
    /// A driver error.
    ///
    /// # Safety
    /// 1. `event` came from [`create_event`](Self::create_event) on `self` and was not destroyed.
    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        let _ = event;
        Err(BackendError::Unsupported("events"))
    }

    // ---- virtual memory -----------------------------------------------------------------------

    /// The physical page granularity when the backend supports virtual memory, else `None`.
    fn vm_granularity(&self) -> Option<usize> {
        None
    }

    /// Reserves `size` bytes of device virtual address space (no physical memory).
    ///
    /// # Errors
    /// [`BackendError::Unsupported`], or out of address space.
    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        let _ = size;
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Releases an address range.
    ///
    /// # Errors
    /// A driver error.
    ///
    /// # Safety
    /// 1. `base`/`size` come from one [`reserve_address_range`](Self::reserve_address_range) on
    ///    `self`, not released since.
    /// 2. Nothing is mapped in the range.
    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        let _ = (base, size);
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Creates `size` bytes of physical memory (a multiple of the granularity).
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] when the device is full.
    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        let _ = size;
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Releases physical memory.
    ///
    /// # Errors
    /// A driver error.
    ///
    /// # Safety
    /// 1. `handle`/`size` come from one [`create_physical`](Self::create_physical) on `self`.
    /// 2. The handle is mapped nowhere.
    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        size: usize,
    ) -> Result<(), BackendError> {
        let _ = (handle, size);
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Maps `handle` (of exactly `size` bytes) at `va` and makes it readable and writable by
    /// this device.
    ///
    /// # Errors
    /// A driver error; nothing is mapped then.
    ///
    /// # Safety
    /// 1. `[va, va + size)` lies in one reserved range of `self` and nothing is mapped there.
    /// 2. `handle` is a live physical handle of `self` of exactly `size` bytes.
    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let _ = (va, size, handle);
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Unmaps `[va, va + size)`.
    ///
    /// # Errors
    /// A driver error; the mapping then stays.
    ///
    /// # Safety
    /// 1. The range is exactly one earlier [`map`](Self::map) on `self`.
    /// 2. No queued work still reads or writes it.
    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        let _ = (va, size);
        Err(BackendError::Unsupported("virtual memory"))
    }

    /// Whether [`unmap_later`](Self::unmap_later) runs unmaps on a helper thread, off the
    /// caller's (Note [Unmaps off the allocating thread] in `src/allocator/state/lending.rs`).
    /// The default: `false`.
    fn unmaps_off_thread(&self) -> bool {
        false
    }

    /// Queues the unmaps of `ranges`, to run in the order given on a helper thread, and returns
    /// the job's ticket; [`finished_unmaps`](Self::finished_unmaps) reports it once it ran.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when the backend has no helper (the default), or when the
    /// helper cannot be started; nothing is queued then.
    ///
    /// # Safety
    /// For every range, [`unmap`](Self::unmap)'s obligations, which must hold until the job is
    /// reported finished: nothing is mapped over a queued range, and its physical handle is not
    /// released, before then.
    unsafe fn unmap_later(&self, ranges: Vec<(DeviceAddr, usize)>) -> Result<u64, BackendError> {
        let _ = ranges;
        Err(BackendError::Unsupported("unmaps on a helper thread"))
    }

    /// Which of the jobs `tickets` names (tickets [`unmap_later`](Self::unmap_later) returned)
    /// have finished, each reported once; the others stay queued or running. The default: none.
    fn finished_unmaps(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        let _ = tickets;
        Vec::new()
    }

    /// Blocks until every job queued by [`unmap_later`](Self::unmap_later) has finished (their
    /// results still come from [`finished_unmaps`](Self::finished_unmaps)). The default returns
    /// at once.
    fn wait_unmaps(&self) {}

    /// Lets device `peer` read and write what [`map`](Self::map) maps from now on, beside this
    /// backend's own device. Returns whether `peer` is new to the backend (allocators sharing a
    /// backend each grant their own mapped pages all the same). Mapped memory is
    /// reachable only by the devices its access was set for (the driver's peer access covers
    /// `cuMemAlloc` memory, not mappings); see [`grant_peer`](Self::grant_peer) for the ranges
    /// already mapped.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] without virtual memory (there is nothing to grant then);
    /// [`BackendError::InvalidArgument`] for a peer that is not another device of this machine.
    fn add_peer(&self, peer: usize) -> Result<bool, BackendError> {
        let _ = peer;
        Err(BackendError::Unsupported("peer access to mapped memory"))
    }

    /// Forgets what was exported of physical handle `handle` for other processes (the
    /// descriptor `CudaDevice::export_handle` keeps open), once no allocation shared from it is
    /// live any more: every process that was to import it has done so. The cache calls it when
    /// the last exported allocation on the handle is freed, and when an export of an allocation
    /// on the handle failed while no live exported allocation lies on it (a failed export may
    /// have exported some handles before it stopped). The default does nothing.
    fn release_export(&self, handle: PhysicalHandle) {
        let _ = handle;
    }

    /// Grants device `peer` read and write access to `[va, va + size)`.
    ///
    /// # Errors
    /// A driver error; the range keeps the access it had.
    ///
    /// # Safety
    /// The range is exactly one earlier [`map`](Self::map) on `self`, still mapped.
    unsafe fn grant_peer(
        &self,
        va: DeviceAddr,
        size: usize,
        peer: usize,
    ) -> Result<(), BackendError> {
        let _ = (va, size, peer);
        Err(BackendError::Unsupported("peer access to mapped memory"))
    }
}

// SAFETY: forwarding every call to the referent keeps all three promises of `D`.
unsafe impl<D: DeviceBackend + ?Sized> DeviceBackend for &D {
    fn device_index(&self) -> usize {
        (**self).device_index()
    }
    fn alignment(&self) -> usize {
        (**self).alignment()
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        (**self).mem_info()
    }
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddr, BackendError> {
        (**self).allocate(size, stream)
    }
    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        // SAFETY: the caller's obligations 1-2 are forwarded unchanged.
        unsafe { (**self).free(ptr, size, stream) }
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        (**self).synchronize()
    }
    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        (**self).validate_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        (**self).synchronize_stream(stream)
    }
    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        (**self).stream_capture_id(stream)
    }
    fn create_event(&self) -> Result<EventHandle, BackendError> {
        (**self).create_event()
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        (**self).record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        (**self).query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        (**self).synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        (**self).stream_wait_event(stream, event)
    }
    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        // SAFETY: obligation 1 is forwarded unchanged.
        unsafe { (**self).destroy_event(event) }
    }
    fn vm_granularity(&self) -> Option<usize> {
        (**self).vm_granularity()
    }
    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        (**self).reserve_address_range(size)
    }
    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).release_address_range(base, size) }
    }
    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        (**self).create_physical(size)
    }
    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).release_physical(handle, size) }
    }
    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).map(va, size, handle) }
    }
    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).unmap(va, size) }
    }
    fn unmaps_off_thread(&self) -> bool {
        (**self).unmaps_off_thread()
    }
    unsafe fn unmap_later(&self, ranges: Vec<(DeviceAddr, usize)>) -> Result<u64, BackendError> {
        // SAFETY: the obligations are forwarded unchanged.
        unsafe { (**self).unmap_later(ranges) }
    }
    fn finished_unmaps(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        (**self).finished_unmaps(tickets)
    }
    fn wait_unmaps(&self) {
        (**self).wait_unmaps();
    }
    fn add_peer(&self, peer: usize) -> Result<bool, BackendError> {
        (**self).add_peer(peer)
    }
    fn release_export(&self, handle: PhysicalHandle) {
        (**self).release_export(handle)
    }
    unsafe fn grant_peer(
        &self,
        va: DeviceAddr,
        size: usize,
        peer: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: the obligation is forwarded unchanged.
        unsafe { (**self).grant_peer(va, size, peer) }
    }
}

// SAFETY: as for `&D`: every call is forwarded to the shared referent.
unsafe impl<D: DeviceBackend + ?Sized> DeviceBackend for std::sync::Arc<D> {
    fn device_index(&self) -> usize {
        (**self).device_index()
    }
    fn alignment(&self) -> usize {
        (**self).alignment()
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        (**self).mem_info()
    }
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddr, BackendError> {
        (**self).allocate(size, stream)
    }
    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        // SAFETY: the caller's obligations 1-2 are forwarded unchanged.
        unsafe { (**self).free(ptr, size, stream) }
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        (**self).synchronize()
    }
    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        (**self).validate_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        (**self).synchronize_stream(stream)
    }
    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        (**self).stream_capture_id(stream)
    }
    fn create_event(&self) -> Result<EventHandle, BackendError> {
        (**self).create_event()
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        (**self).record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        (**self).query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        (**self).synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        (**self).stream_wait_event(stream, event)
    }
    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        // SAFETY: obligation 1 is forwarded unchanged.
        unsafe { (**self).destroy_event(event) }
    }
    fn vm_granularity(&self) -> Option<usize> {
        (**self).vm_granularity()
    }
    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        (**self).reserve_address_range(size)
    }
    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).release_address_range(base, size) }
    }
    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        (**self).create_physical(size)
    }
    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).release_physical(handle, size) }
    }
    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).map(va, size, handle) }
    }
    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        unsafe { (**self).unmap(va, size) }
    }
    fn unmaps_off_thread(&self) -> bool {
        (**self).unmaps_off_thread()
    }
    unsafe fn unmap_later(&self, ranges: Vec<(DeviceAddr, usize)>) -> Result<u64, BackendError> {
        // SAFETY: the obligations are forwarded unchanged.
        unsafe { (**self).unmap_later(ranges) }
    }
    fn finished_unmaps(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        (**self).finished_unmaps(tickets)
    }
    fn wait_unmaps(&self) {
        (**self).wait_unmaps();
    }
    fn add_peer(&self, peer: usize) -> Result<bool, BackendError> {
        (**self).add_peer(peer)
    }
    fn release_export(&self, handle: PhysicalHandle) {
        (**self).release_export(handle)
    }
    unsafe fn grant_peer(
        &self,
        va: DeviceAddr,
        size: usize,
        peer: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: the obligation is forwarded unchanged.
        unsafe { (**self).grant_peer(va, size, peer) }
    }
}
