//! Errors: values that say what happened and what to do about it.
//!
//! [`AllocError`] is the one error type of the allocator's public API; out of memory carries a full
//! [`OomReport`] with a verdict (device full, fraction cap reached, or fragmented). May use:
//! `backend` value types, `config::ConfigError`.
#![forbid(unsafe_code)]

use std::fmt;

use crate::allocator::MemPoolId;
use crate::backend::{BackendError, DeviceAddr, StreamId};
use crate::config::ConfigError;
use crate::format::format_size;

/// Result alias with [`AllocError`] as the default error.
pub type Result<T, E = AllocError> = std::result::Result<T, E>;

/// Why an allocation could not be satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OomVerdict {
    /// The device itself has no room: free memory elsewhere, or use a larger device. Also the
    /// verdict when the fraction cap is reached too, since raising the fraction alone cannot
    /// make room then.
    DeviceFull,
    /// The per-process memory-fraction cap was reached before the device was full: raise the
    /// fraction, or free memory.
    FractionCapReached,
    /// Enough bytes sit free in the cache for the request's stream and size class, but no free
    /// block is large enough: try expandable segments (where they are off),
    /// `max_split_size_mb`, or freeing long-lived blocks.
    Fragmented,
    /// The request (its segment, or with expandable segments the whole pages its block covers)
    /// is larger than the device's whole memory: no freeing makes room; split the allocation or
    /// use a larger device.
    LargerThanDevice,
    /// Enough bytes sit free in the pools the request was served from, but in blocks it could
    /// not use: blocks of other streams (a cached block serves its own stream; the cross-stream
    /// mechanisms, where on, take only what they can order safely) or of the other size class
    /// (blocks of at most 1 MiB and larger ones are cached apart). Allocate on the stream that
    /// freed them, or free the live blocks that keep their segments.
    CachedForOtherStreams,
}

impl fmt::Display for OomVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OomVerdict::DeviceFull => "the device is full",
            OomVerdict::FractionCapReached => "the per-process memory fraction cap is reached",
            OomVerdict::Fragmented => {
                "the cache is fragmented: enough free cached bytes, but no free block large enough"
            }
            OomVerdict::LargerThanDevice => "the request is larger than the device's whole memory",
            OomVerdict::CachedForOtherStreams => {
                "enough free cached bytes, but in blocks of other streams or of the other size \
                 class, which this request could not use"
            }
        })
    }
}

/// Everything known about an out-of-memory failure, in PyTorch's terms.
#[derive(Clone, Debug, PartialEq)]
pub struct OomReport {
    /// Device ordinal.
    pub device: usize,
    /// The user's request in bytes.
    pub requested_bytes: usize,
    /// The request after rounding (the block size).
    pub rounded_bytes: usize,
    /// The device allocation the cache tried to make (PyTorch prints this as "Tried to allocate").
    pub segment_bytes: usize,
    /// The stream of the request.
    pub stream: StreamId,
    /// Device memory in all.
    pub device_total: usize,
    /// Device memory free, as the device reported it after the retries.
    pub device_free: usize,
    /// The fraction cap in bytes, when one is set.
    pub limit_bytes: Option<usize>,
    /// Bytes allocated to live allocations (rounded block sizes).
    pub allocated_bytes: usize,
    /// Bytes reserved from the device by this cache.
    pub reserved_bytes: usize,
    /// Free cached bytes of private pools (CUDA graphs, `MemPool`): reserved, but served only
    /// to allocations routed to their pool (or, from a pool marked `use_on_oom`, on out of
    /// memory). PyTorch's message counts them as "allocated in private pools".
    pub private_pool_free_bytes: usize,
    /// The largest free cached block (any stream) of the pools the request was served from
    /// (the default pools, or the private pool it was routed to), in bytes.
    pub largest_free_block: usize,
    /// The largest free cached block on the request's stream, in its size class of those
    /// pools, in bytes.
    pub largest_free_block_on_stream: usize,
    /// Fragmentation of those pools' free memory: `1 - largest free / total free` (0 when
    /// empty).
    pub external_fragmentation: f64,
    /// Whether the configuration grows expandable segments: then a fragmented cache is not
    /// advised to turn them on (nor is a request routed to a private pool, whose fixed segments
    /// the setting does not change).
    pub expandable_segments: bool,
    /// The diagnosis.
    pub verdict: OomVerdict,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            format_size(self.segment_bytes as u64),
            self.device,
            format_size(self.device_total as u64),
            format_size(self.device_free as u64),
        )?;
        if let Some(limit) = self.limit_bytes {
            write!(f, "{} allowed; ", format_size(limit as u64))?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by the cache, ",
            format_size(self.allocated_bytes as u64)
        )?;
        if self.private_pool_free_bytes > 0 {
            write!(
                f,
                "{} is cached in private pools (CUDA graphs, MemPool) for their own allocations, ",
                format_size(self.private_pool_free_bytes as u64)
            )?;
        }
        write!(
            f,
            "and {} is reserved by the cache but unallocated \
             (largest free cached block {}, {} on {}; external fragmentation {:.1}%). \
             Request: {} bytes ({} rounded). Verdict: {}.",
            format_size(
                self.reserved_bytes
                    .saturating_sub(self.allocated_bytes)
                    .saturating_sub(self.private_pool_free_bytes) as u64
            ),
            format_size(self.largest_free_block as u64),
            format_size(self.largest_free_block_on_stream as u64),
            self.stream,
            self.external_fragmentation * 100.0,
            self.requested_bytes,
            self.rounded_bytes,
            self.verdict,
        )?;
        match self.verdict {
            OomVerdict::DeviceFull => write!(
                f,
                " Free memory held elsewhere on the device, or reduce the working set."
            ),
            OomVerdict::FractionCapReached => {
                write!(f, " Raise the memory fraction or free memory.")
            }
            OomVerdict::Fragmented if self.expandable_segments => write!(
                f,
                " Expandable segments are on already: the free cached bytes lie scattered between \
                 live blocks; free live blocks between them to join them, or allocate less at once."
            ),
            OomVerdict::Fragmented => write!(
                f,
                " If reserved but unallocated memory is large try expandable_segments:True to avoid fragmentation."
            ),
            OomVerdict::LargerThanDevice => write!(
                f,
                " No freeing can make room: split the allocation or use a device with more memory."
            ),
            OomVerdict::CachedForOtherStreams => write!(
                f,
                " Cached blocks of other streams or of the other size class could not serve this \
                 request: allocate on the stream that freed the memory, or free the live blocks \
                 that keep its segments."
            ),
        }
    }
}

/// Errors of the allocator's public API. Each variant's documentation says what the caller can do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// No memory could be found after every retry. The allocator is intact; free memory, empty the
    /// cache of other allocators, raise the fraction cap, or use expandable segments (see the
    /// report's verdict).
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// The request is absurdly large (at least 1 EiB), as PyTorch rejects it. Check the size.
    #[error(
        "CUDA out of memory. Tried to allocate more than 1EB memory ({requested} bytes requested)"
    )]
    TooLarge {
        /// The requested size.
        requested: u64,
    },
    /// `ptr` was already freed (it is the start of a free cached block). Fix the double free.
    #[error("double free: {ptr} is not allocated (it was freed before)")]
    DoubleFree {
        /// The pointer.
        ptr: DeviceAddr,
    },
    /// `ptr` was freed before (a free block still starts there), so `operation` (which needs a
    /// live allocation, as [`record_stream`](crate::CachingAllocator::record_stream) does)
    /// cannot apply to it. Call it while the allocation is live.
    #[error("{operation}: {ptr} is not a live allocation (it was freed before)")]
    FreedPointer {
        /// The pointer.
        ptr: DeviceAddr,
        /// What was asked of it.
        operation: &'static str,
    },
    /// `ptr` lies inside memory this cache reserved but is not the start of a live allocation.
    /// Free the pointer that `allocate` returned, not an interior pointer.
    #[error(
        "{ptr} is not the start of a live allocation of this allocator (it points into segment {segment})"
    )]
    InteriorPointer {
        /// The pointer.
        ptr: DeviceAddr,
        /// The segment it points into.
        segment: DeviceAddr,
    },
    /// `ptr` was never handed out by this allocator. Free it with the allocator that made it.
    #[error("{ptr} was never allocated by this allocator (foreign pointer)")]
    UnknownPointer {
        /// The pointer.
        ptr: DeviceAddr,
    },
    /// The backend rejected the stream. Use a live stream of this device.
    #[error("stream {stream} rejected: {source}")]
    InvalidStream {
        /// The stream.
        stream: StreamId,
        /// The backend's reason.
        #[source]
        source: BackendError,
    },
    /// A memory fraction outside `[0, 1]` (or not a number).
    #[error("invalid memory fraction {0}: allowed range is 0~1")]
    InvalidFraction(f64),
    /// A bad configuration string or value. Fix the configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The operation needs a backend capability (events, virtual memory) this backend lacks.
    #[error("{operation} needs {capability}, which this backend does not support")]
    Unsupported {
        /// What was attempted.
        operation: &'static str,
        /// The missing capability.
        capability: &'static str,
    },
    /// Out of memory while a graph capture was underway. During a capture the cache neither
    /// synchronizes nor releases cached memory (that would invalidate the capture), so the
    /// release-and-retry chain did not run. Make room before capturing: `empty_cache`, a smaller
    /// working set, or a warm-up run of the captured work so that its memory is cached already.
    #[error(
        "out of memory during a graph capture (allocation routed to {}): the cache does not release cached memory or synchronize while a capture is underway; free memory or call empty_cache before the capture. {report}",
        pool_name(*.pool)
    )]
    CaptureOutOfMemory {
        /// The private pool the allocation was routed to (`MemPoolId::DEFAULT` when it was not
        /// routed).
        pool: MemPoolId,
        /// What an ordinary out-of-memory error would report.
        report: Box<OomReport>,
    },
    /// An operation that would synchronize or release memory was called while a graph capture
    /// is underway. Call it after `end_allocate_to_pool` for every routing.
    #[error(
        "{operation} is not allowed while a graph capture is underway (a routing to a private pool is active)"
    )]
    CaptureUnderway {
        /// What was attempted.
        operation: &'static str,
    },
    /// A typed cudarc allocation (`interop::CudaAllocator::alloc` and friends, feature `cuda`)
    /// on a stream that is capturing a CUDA graph no private pool receives. cudarc's
    /// own allocation there is a graph memory node that the graph owns; cached memory would go
    /// back to other work when the buffer is dropped while the graph still uses it. Open a pool
    /// for the capture with `CudaAllocator::capture_pool(&stream)` right after `begin_capture`.
    #[error(
        "stream {stream} is capturing a CUDA graph (capture id {capture_id}) that no private pool receives: cached memory allocated there would be handed to other work while the graph still uses it; call CudaAllocator::capture_pool(&stream) after begin_capture"
    )]
    UnroutedCapture {
        /// The capturing stream.
        stream: StreamId,
        /// The driver's id of the capture.
        capture_id: u64,
    },
    /// A private-pool call named a pool it cannot act on. The message says which rule was broken.
    #[error("memory pool {pool}: {reason}")]
    InvalidPool {
        /// The pool id.
        pool: MemPoolId,
        /// What was wrong.
        reason: &'static str,
    },
    /// The allocation at `ptr` cannot be shared with another process (see
    /// [`CachingAllocator::shareable_pages`](crate::CachingAllocator::shareable_pages)): it is not
    /// a live allocation, or its pages cannot be mapped side by side elsewhere. The message says
    /// which; the allocator is unchanged.
    #[error("cannot share {ptr} with another process: {reason}")]
    NotShareable {
        /// The pointer.
        ptr: DeviceAddr,
        /// What was wrong.
        reason: String,
    },
    /// A device call failed with something other than "out of memory". The allocator's state is
    /// unchanged by the failed call; the device itself may be unusable.
    #[error("device call {operation} failed: {source}")]
    Backend {
        /// The backend call.
        operation: &'static str,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

impl AllocError {
    /// Whether this is an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory(_)
                | AllocError::TooLarge { .. }
                | AllocError::CaptureOutOfMemory { .. }
        )
    }

    /// The out-of-memory report, if this is one.
    pub fn oom_report(&self) -> Option<&OomReport> {
        match self {
            AllocError::OutOfMemory(r) | AllocError::CaptureOutOfMemory { report: r, .. } => {
                Some(r)
            }
            _ => None,
        }
    }
}

fn pool_name(pool: MemPoolId) -> String {
    if pool.is_default() {
        "the default pool".into()
    } else {
        format!("private pool {pool}")
    }
}
