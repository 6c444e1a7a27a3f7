//! The host page-locking backend: where pinned slabs come from.
//!
//! A separate, small trait beside [`DeviceBackend`]: a host backend pins and unpins host memory,
//! reports how long that took (the cache adds it to its statistics; the time is the backend's to
//! measure or model, never the cache's), and lends a device whose event calls order reuse.
//! May use: `backend` values.

use std::fmt;

use crate::backend::{BackendError, DeviceBackend};

/// A host address of pinned memory. `0` is never a valid block or slab address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostPtr(pub usize);

impl HostPtr {
    /// The raw address.
    #[inline]
    pub const fn addr(self) -> usize {
        self.0
    }

    /// This address moved forward by `bytes` (wrapping; the cache only forms in-slab offsets).
    #[inline]
    pub const fn offset(self, bytes: usize) -> HostPtr {
        HostPtr(self.0.wrapping_add(bytes))
    }
}

impl fmt::Debug for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A freshly pinned range and what pinning it cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// Start of the range.
    pub ptr: HostPtr,
    /// Nanoseconds the backend spent pinning (measured on a real host, modelled on `SimHost`).
    pub nanos: u64,
}

/// Pins and unpins host memory, and lends a device for events.
///
/// # Safety
///
/// Implementors promise that
///
/// 1. every range [`pin`](Self::pin) returns is non-null, aligned to
///    [`alignment`](Self::alignment), `size` bytes long and disjoint from every other range it
///    handed out, until it is unpinned;
/// 2. the range stays valid host memory, usable by asynchronous copies of
///    [`device`](Self::device)'s streams, until it is unpinned.
///
/// The cache relies on these to hand out non-overlapping blocks.
pub unsafe trait HostBackend: Send + Sync {
    /// The device whose event calls order reuse of freed blocks.
    type Device: DeviceBackend;

    /// The device lent for events (`create_event`, `record_event`, `query_event`, ...).
    fn device(&self) -> &Self::Device;

    /// The alignment every pinned range has (a power of two).
    fn alignment(&self) -> usize;

    /// Pins `size` bytes (`size > 0`).
    ///
    /// # Errors
    ///
    /// [`BackendError::OutOfMemory`] when the host cannot pin that much; other errors from the
    /// driver or injected faults.
    fn pin(&self, size: usize) -> Result<Pinned, BackendError>;

    /// Unpins a range and returns the nanoseconds it took.
    ///
    /// # Errors
    ///
    /// Driver errors or injected faults; the range then stays pinned and owned by the caller.
    ///
    /// # Safety
    ///
    /// 1. `ptr`/`size` come from one earlier [`pin`](Self::pin) on `self`, not yet unpinned.
    /// 2. No queued work on any stream still reads or writes the range.
    unsafe fn unpin(&self, ptr: HostPtr, size: usize) -> Result<u64, BackendError>;
}
