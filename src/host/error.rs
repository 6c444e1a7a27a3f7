//! `PinnedError`: what the pinned host cache can fail with. May use: `backend` values.

use crate::backend::{BackendError, StreamId};
use crate::format::format_size;

use super::HostPtr;

/// What a [`PinnedCache`](super::PinnedCache) call can fail with. Each variant says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PinnedError {
    /// Pinning the request would exceed the configured cap, even after releasing every wholly
    /// free slab. Free pinned blocks, or raise `max_pinned`.
    #[error(
        "pinning {} more would exceed the pinned host memory cap max_pinned = {} ({} pinned now, request of {}); free pinned blocks or raise max_pinned",
        format_size(*.would_pin as u64), format_size(*.cap as u64), format_size(*.pinned as u64),
        format_size(*.requested as u64)
    )]
    CapExceeded {
        /// The cap (`PinnedConfig::max_pinned`).
        cap: usize,
        /// Bytes pinned now.
        pinned: usize,
        /// Bytes the new slab would pin.
        would_pin: usize,
        /// The request's size.
        requested: usize,
    },
    /// A request the cache cannot serve as asked (zero size, a size that overflows).
    #[error("invalid pinned request: {0}")]
    InvalidRequest(String),
    /// The configuration is unusable (alignment not a power of two or above the backend's,
    /// zero slab size).
    #[error("invalid pinned cache configuration: {0}")]
    InvalidConfig(String),
    /// The pointer is not a live block of this cache (never handed out, or already freed).
    /// Nothing changed.
    #[error("{ptr} is not a live pinned block of this cache")]
    UnknownBlock {
        /// The rejected pointer.
        ptr: HostPtr,
    },
    /// The block was freed, but ordering its reuse after `stream` failed (the event and the
    /// stream synchronization both failed). The block stays out of reuse until a later
    /// [`empty_cache`](super::PinnedCache::empty_cache) synchronizes the stream.
    #[error("could not order reuse after {stream}: {source}")]
    Fence {
        /// The stream that could not be fenced.
        stream: StreamId,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// The allocator under a [`PagedPinnedCache`](super::PagedPinnedCache) failed: out of
    /// memory (its report says why), a refused block or a driver error. Nothing was lost.
    #[error("pinned host pages: {0}")]
    Allocator(crate::error::AllocError),
    /// The host backend failed (pinning ran out of memory, a driver error, an injected fault).
    #[error("pinned host backend: {0}")]
    Backend(#[from] BackendError),
}
