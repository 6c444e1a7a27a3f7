//! `PinnedStats`: the pinned host cache's statistics and its one-line summary.
//! May use: `stats`, `format`.

#![forbid(unsafe_code)]

use crate::format::format_size;
use crate::stats::Stat;

/// Statistics of a [`PinnedCache`](super::PinnedCache), in the core's vocabulary: *allocated*
/// bytes are live blocks at their aligned size, *requested* bytes the sizes asked for,
/// *reserved* bytes the pinned slabs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes of live blocks (aligned sizes). For a `PagedPinnedCache` also the blocks waiting
    /// for their fences or declared streams: the device cache under it holds them allocated
    /// until then (its `stats` says so).
    pub allocated_bytes: Stat,
    /// Bytes asked for by live blocks (for a `PagedPinnedCache`, waiting ones too, as above).
    pub requested_bytes: Stat,
    /// Bytes pinned (all slabs).
    pub reserved_bytes: Stat,
    /// Bytes of blocks freed by the user but waiting for stream events before reuse (aligned
    /// sizes; for a `PagedPinnedCache` the requested sizes of the blocks waiting for a fence
    /// handed to `free_after`, not those held for streams declared with `record_stream`).
    pub pending_bytes: Stat,
    /// Number of slabs pinned (for a `PagedPinnedCache`: host page handles held, mapped or
    /// spare).
    pub slabs: Stat,
    /// Successful allocations.
    pub num_allocs: u64,
    /// Allocations served from cached slabs without pinning (for a `PagedPinnedCache`,
    /// allocations less growths: an allocation that grew twice takes one off the count besides
    /// being no hit itself).
    pub num_cache_hits: u64,
    /// Frees.
    pub num_frees: u64,
    /// Slabs pinned.
    pub num_pins: u64,
    /// Slabs unpinned.
    pub num_unpins: u64,
    /// Nanoseconds spent pinning, as the host backend measured (or modelled) them.
    pub pin_nanos: u64,
    /// Nanoseconds spent unpinning, as the host backend measured (or modelled) them.
    pub unpin_nanos: u64,
    /// Events recorded at frees.
    pub num_event_records: u64,
    /// Event queries made to find reusable blocks.
    pub num_event_queries: u64,
    /// Stream synchronizations made because recording an event failed, or at `empty_cache`.
    pub num_stream_syncs: u64,
    /// Host waits for a waiting block's events made by allocations that would otherwise have
    /// pinned ([`PendingPolicy::Wait`](super::PendingPolicy::Wait)).
    pub num_pending_waits: u64,
}

impl PinnedStats {
    /// One line: allocated, reserved, slabs, requested, pending, pins and their time, host waits
    /// for pending blocks.
    pub fn summary(&self) -> String {
        let sz = |v: i64| format_size(u64::try_from(v).unwrap_or(0));
        format!(
            "pinned host: allocated {} (peak {}), requested {} (peak {}), reserved {} (peak {}) in {} slabs (peak {}), pending {}; {} allocs ({} cached), {} frees; {} pins ({:.3} ms), {} unpins ({:.3} ms), {} pending waits",
            sz(self.allocated_bytes.current),
            sz(self.allocated_bytes.peak),
            sz(self.requested_bytes.current),
            sz(self.requested_bytes.peak),
            sz(self.reserved_bytes.current),
            sz(self.reserved_bytes.peak),
            self.slabs.current,
            self.slabs.peak,
            sz(self.pending_bytes.current),
            self.num_allocs,
            self.num_cache_hits,
            self.num_frees,
            self.num_pins,
            self.pin_nanos as f64 / 1e6,
            self.num_unpins,
            self.unpin_nanos as f64 / 1e6,
            self.num_pending_waits,
        )
    }
}
