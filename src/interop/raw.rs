//! The raw-pointer API: allocate and free device memory by device ordinal and raw `CUstream`
//! handle, through the [global registry](super::AllocatorRegistry::global). This is what C
//! callers and PyTorch need (the `cuda-caching-allocator-torch` crate in `python/src` wraps it
//! in `extern "C"` functions); Rust code should prefer [`CachedSlice`](super::CachedSlice).
//!
//! Errors are values here too; turning them into a null pointer and a log line, and keeping
//! panics from crossing the C boundary, is the job of the `extern "C"` layer.
//! May use: `interop::registry`, `backend::cuda`, the core.

use super::registry::AllocatorRegistry;
use crate::{
    AllocError, Allocation, DeviceAddr, DeviceCallTimes, FreeOutcome, MemoryStats, Result, StreamId,
};

/// Allocates `size` bytes on device `device` for use on `stream`, from the device's shared
/// cache. A `size` of 0 returns an allocation with the null pointer.
///
/// # Errors
/// Out of memory (with the core's report), no such device, or a stream of another device.
///
/// # Safety
/// 1. `stream` is `0` (the legacy default stream), `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`,
///    or a live `CUstream` of device `device`'s primary context.
/// 2. That stream stays alive while the cache may use it: until every block allocated on it (or
///    recorded on it with [`record_stream`]) has been freed and reused, or until the process
///    ends. Streams of PyTorch's stream pools live for the whole process.
pub unsafe fn alloc(device: usize, size: usize, stream: StreamId) -> Result<Allocation> {
    let alloc = AllocatorRegistry::global().get(device)?;
    // SAFETY: obligations 1 and 2 are the caller's, passed on unchanged.
    unsafe { alloc.device().admit_raw_stream(stream) }
        .map_err(|source| AllocError::InvalidStream { stream, source })?;
    alloc.allocate(size, stream)
}

/// Returns `ptr` (from [`alloc`] on the same device) to the cache. Freeing the null pointer does
/// nothing.
///
/// # Errors
/// No such device, or a pointer this device's cache did not hand out (or already took back).
///
/// # Safety
/// 1. `ptr` came from [`alloc`] on device `device` and nothing else frees it: in particular it is
///    not the memory of a [`CachedSlice`](super::CachedSlice) (the registry's allocators also
///    serve [`CudaAllocator::shared`](super::CudaAllocator::shared)), whose bytes the cache would
///    otherwise hand to a new owner while safe code still uses them.
/// 2. Work queued on streams other than the allocation's no longer uses the memory, unless those
///    streams were declared with [`record_stream`].
pub unsafe fn free(device: usize, ptr: DeviceAddr) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    let alloc = AllocatorRegistry::global().get(device)?;
    // SAFETY: the caller's obligations 1 and 2 are `CudaAllocator::free`'s.
    unsafe { alloc.free(ptr) }
}

/// [`free`], telling whether the block still waits for the work of streams recorded with
/// [`record_stream`] ([`CachingAllocator::free_with_outcome`](crate::CachingAllocator::free_with_outcome)).
///
/// # Errors
/// As [`free`].
///
/// # Safety
/// As [`free`].
pub unsafe fn free_with_outcome(device: usize, ptr: DeviceAddr) -> Result<FreeOutcome> {
    if ptr.is_null() {
        return Ok(FreeOutcome::Cached);
    }
    let alloc = AllocatorRegistry::global().get(device)?;
    // SAFETY: the caller's obligations are `CudaAllocator::free_with_outcome`'s.
    unsafe { alloc.free_with_outcome(ptr) }
}

/// Marks the allocation at `ptr` as used on `stream` (PyTorch's `recordStream`).
///
/// # Errors
/// No such device, a pointer this device's cache does not know, or a stream of another device.
///
/// # Safety
/// The obligations of [`alloc`] for `stream`.
pub unsafe fn record_stream(device: usize, ptr: DeviceAddr, stream: StreamId) -> Result<()> {
    let alloc = AllocatorRegistry::global().get(device)?;
    // SAFETY: the caller's obligations, passed on unchanged.
    unsafe { alloc.device().admit_raw_stream(stream) }
        .map_err(|source| AllocError::InvalidStream { stream, source })?;
    alloc.record_stream(ptr, stream)
}

/// Marks the allocation at `ptr` as used on `stream`, on whichever device's shared cache owns it,
/// and returns that device (PyTorch's pluggable `record_stream` hook names no device).
///
/// # Errors
/// A pointer no created cache owns ([`AllocError::UnknownPointer`] from the last device tried, or
/// when no cache exists), or the owner's error (a stream of another device).
///
/// # Safety
/// The obligations of [`alloc`] for `stream`, on the owning device.
pub unsafe fn record_stream_on_owner(ptr: DeviceAddr, stream: StreamId) -> Result<usize> {
    let mut last = AllocError::UnknownPointer { ptr };
    for (device, alloc) in AllocatorRegistry::global().created() {
        // SAFETY: the caller's obligations for the owning device; a stream of another device is
        // refused by the admission, which checks the stream's context.
        if let Err(source) = unsafe { alloc.device().admit_raw_stream(stream) } {
            last = AllocError::InvalidStream { stream, source };
            continue;
        }
        match alloc.record_stream(ptr, stream) {
            Ok(()) => return Ok(device),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The statistics of device `device`'s shared cache, or `None` when it was never used.
pub fn memory_stats(device: usize) -> Option<MemoryStats> {
    Some(
        AllocatorRegistry::global()
            .get_if_created(device)?
            .memory_stats(),
    )
}

/// The driver calls device `device`'s shared cache made and the host time spent inside them, by
/// kind ([`CudaDevice::call_times`](crate::backend::cuda::CudaDevice::call_times)), or `None`
/// when the cache was never used.
pub fn device_call_times(device: usize) -> Option<DeviceCallTimes> {
    Some(
        AllocatorRegistry::global()
            .get_if_created(device)?
            .device_call_times(),
    )
}

/// Returns the cached, unused memory of device `device` to the driver (no-op when the device's
/// cache was never used).
///
/// # Errors
/// A driver error from synchronizing or freeing.
pub fn empty_cache(device: usize) -> Result<()> {
    match AllocatorRegistry::global().get_if_created(device) {
        Some(alloc) => alloc.empty_cache(),
        None => Ok(()),
    }
}
