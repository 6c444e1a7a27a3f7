//! The core's only `unsafe`: the device calls whose contracts the core discharges.
//!
//! Each wrapper states which obligation of [`DeviceBackend`] it meets and why; every caller in
//! `state.rs` passes only segments, events and pages it owns.

use crate::backend::{
    BackendError, DeviceAddr, DeviceBackend, EventHandle, PhysicalHandle, StreamId,
};

/// Frees a whole segment.
///
/// The caller passes a segment the cache allocated with `backend.allocate(size, stream)` and still
/// owns wholly free (one free block spanning it), after `backend.synchronize()` has drained all
/// queued work since the segment's last use.
pub(crate) fn free_segment<B: DeviceBackend>(
    backend: &B,
    ptr: DeviceAddr,
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

/// Maps one physical page handle the cache holds at `va` inside its own reservation.
pub(crate) fn map_page<B: DeviceBackend>(
    backend: &B,
    va: DeviceAddr,
    size: usize,
    handle: PhysicalHandle,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `va..va+size` is one page of a reservation the cache made
    // (`reserve_address_range`) whose page table (`VmSegment::pages`) records it as unmapped;
    // obligation 2: `handle` came from `create_physical(size)` with the segment's page size and
    // is live (the cache holds each handle in exactly one place: a segment's page table or the
    // spare list, and takes it out of the spare list before this call; it is released only once
    // mapped nowhere). It may still be mapped at a lent block's old address (Note [Lent pages]):
    // the driver maps one handle at several ranges, and the new owner's stream was made to wait
    // for the old uses before this mapping was handed out.
    unsafe { backend.map(va, size, handle) }
}

/// Unmaps one page the cache mapped; its physical handle stays live (spare or reused).
pub(crate) fn unmap_page<B: DeviceBackend>(
    backend: &B,
    va: DeviceAddr,
    size: usize,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: the range is exactly one earlier `map_page` (pages are mapped one
    // at a time at page-aligned addresses and recorded in the segment's page table, or in a
    // lent block's list of old mappings); obligation 2: the page lies wholly inside a free block
    // (no allocated or event-pending block overlaps it) or a lent block, and the caller saw a
    // fence covering the block's free stamp complete or synchronized the page's stream first
    // (Note [Page fences], Note [Lent pages]), so no queued work uses it.
    unsafe { backend.unmap(va, size) }
}

/// Queues the unmaps of pages the cache mapped on the backend's helper thread (Note [Unmaps off
/// the allocating thread]); their physical handles stay live.
pub(crate) fn unmap_pages_later<B: DeviceBackend>(
    backend: &B,
    ranges: Vec<(DeviceAddr, usize)>,
) -> Result<u64, BackendError> {
    // SAFETY: `unmap_page`'s obligations hold for each range: each is one old mapping of a lent
    // block (Note [Lent pages]), exactly one earlier `map_page`, whose fence the caller saw
    // complete, so no queued work uses it. They hold until the job is reported finished: the
    // block stays lent (never merged, mapped over or filed unmapped) while its job runs, and a
    // handle still mapped at a lent block's old address is neither taken from the spare pages
    // nor released (`handle_lent`; `empty_cache` waits for the helper first).
    unsafe { backend.unmap_later(ranges) }
}

/// Releases a physical page that is mapped nowhere (never mapped, or unmapped already).
pub(crate) fn release_unmapped_page<B: DeviceBackend>(
    backend: &B,
    handle: PhysicalHandle,
    size: usize,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `handle`/`size` come from one `create_physical`; obligation 2: the
    // cache took the handle out of every page table (it was never mapped, or `unmap_page`
    // succeeded), so it is mapped nowhere.
    unsafe { backend.release_physical(handle, size) }
}

/// Releases an address reservation with nothing mapped in it.
pub(crate) fn release_range<B: DeviceBackend>(
    backend: &B,
    base: DeviceAddr,
    size: usize,
) -> Result<(), BackendError> {
    // SAFETY: obligation 1: `base`/`size` are one reservation the cache made; obligation 2: the
    // cache unmapped every page of it before calling (the segment is one unmapped block).
    unsafe { backend.release_address_range(base, size) }
}
