//! `HostFence`: a completion the caller hands to [`PinnedCache::free_after`](super::PinnedCache::free_after),
//! for work the cache did not see declared (an event that cudarc recorded after a copy, say).
//! May use: `backend` values.

use std::fmt;

use crate::backend::BackendError;

/// Something that completes once the queued work that used a freed block is done; the cache
/// reuses the block only after [`query`](Self::query) answered `Ok(true)` (or
/// [`wait`](Self::wait) returned `Ok(())`). The fence is dropped once complete (a pooled event
/// goes back to its pool from its `Drop`), inside the cache's lock, and
/// [`query`](Self::query) too is called with that lock held (at the free and at each
/// allocation that finds blocks waiting): neither its `Drop` nor its `query` may call the cache
/// (the lock is not re-entrant; the thread would wait on itself).
pub trait HostFence: Send + fmt::Debug {
    /// Whether the work is done, without waiting (a CUDA event query). An error counts as "not
    /// yet": the block stays out of reuse.
    ///
    /// # Errors
    ///
    /// The backend's error; the cache treats it as incomplete.
    fn query(&mut self) -> Result<bool, BackendError>;

    /// Blocks until the work is done: used when the cache is dropped, and by an allocation that
    /// would otherwise pin ([`PendingPolicy::Wait`](super::PendingPolicy::Wait); then called
    /// without the cache's lock, from the allocating thread).
    ///
    /// # Errors
    ///
    /// The backend's error. At the drop, the block then stays pinned (leaked) rather than
    /// reused; in an allocation, the block keeps waiting for a query to say complete.
    fn wait(&mut self) -> Result<(), BackendError>;
}
