//! The core's only `unsafe`: the device calls whose contracts the core discharges.
//!
//! Each wrapper states which obligation of [`DeviceBackend`] it meets and why; every caller in
//! `state.rs` passes only segments, events and pages it owns.
// The page and range wrappers serve expandable segments.
#![allow(dead_code)]

use crate::backend::{
    BackendError, DeviceBackend, DevicePtr, EventHandle, PhysicalHandle, StreamId,
};

/// Frees a whole segment.
///
/// The caller passes a segment the cache allocated with `backend.allocate(size, stream)` and still
/// owns wholly free (one free block spanning it), after `backend.synchronize()` has drained all
/// queued work since the segment's last use.
pub(crate) fn free_segment<B: DeviceBackend>(
    backend: &B,
    ptr: DevicePtr,
    size: usize,
    stream: StreamId,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `ptr`/`size` are exactly one live segment of this backend (the cache
    // records each segment at allocation and removes the record only after a successful free).
    // Obligation 2: the caller synchronized the device after the segment's last use, and the
    // segment holds no allocated or event-pending block, so no queued work touches it.
    unsafe { backend.free(ptr, size, stream) }
}

/// Destroys a pooled event the cache created and no longer has recorded anywhere.
pub(crate) fn destroy_event<B: DeviceBackend>(
    backend: &B,
    event: EventHandle,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: the event came from `backend.create_event()` and the cache's pool
    // holds each handle once, removing it before this call.
    unsafe { backend.destroy_event(event) }
}

/// Maps one physical page handle the cache created at `va` inside its own reservation.
pub(crate) fn map_page<B: DeviceBackend>(
    backend: &B,
    va: DevicePtr,
    size: usize,
    handle: PhysicalHandle,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `va..va+size` lies in a reservation the cache made and tracks page by
    // page as unmapped; obligation 2: `handle` was just created with exactly `size` bytes.
    unsafe { backend.map(va, size, handle) }
}

/// Unmaps and releases one page the cache mapped.
pub(crate) fn unmap_page<B: DeviceBackend>(
    backend: &B,
    va: DevicePtr,
    size: usize,
    handle: PhysicalHandle,
) -> Result<(), BackendError> {
    // SAFETY: `unmap` obligation 1: the range is exactly one earlier `map_page`; obligation 2: the
    // caller synchronized after the page's last use and no allocated block overlaps it.
    unsafe { backend.unmap(va, size) }?;
    // SAFETY: `release_physical` obligation 1: `handle`/`size` come from one `create_physical`;
    // obligation 2: it was mapped only at `va`, which was just unmapped.
    unsafe { backend.release_physical(handle, size) }
}

/// Releases a physical page that was created but never mapped (a failed map).
pub(crate) fn release_unmapped_page<B: DeviceBackend>(
    backend: &B,
    handle: PhysicalHandle,
    size: usize,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `handle`/`size` come from one `create_physical`; obligation 2: the map
    // of this handle failed, so it is mapped nowhere.
    unsafe { backend.release_physical(handle, size) }
}

/// Releases an address reservation with nothing mapped in it.
pub(crate) fn release_range<B: DeviceBackend>(
    backend: &B,
    base: DevicePtr,
    size: usize,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `base`/`size` are one reservation the cache made; obligation 2: the
    // cache unmapped every page of it before calling.
    unsafe { backend.release_address_range(base, size) }
}
