//! `PinnedConfig`: slab size, alignment, the cap on pinned bytes, the slack and fit rules, and
//! what an allocation does when only blocks waiting for their events would serve it
//! ([`PendingPolicy`]). May use: nothing.

/// What [`PinnedCache::alloc`](super::PinnedCache::alloc) does when no free range holds the
/// request, so that it would have to pin a new slab, while blocks freed after asynchronous work
/// (waiting for their events or fences) would hold it once that work is done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PendingPolicy {
    /// Wait on the host for the oldest such block's events (`cuEventSynchronize`, or
    /// [`HostFence::wait`](super::HostFence::wait)), without holding the cache's lock, then
    /// reuse it; at most [`PinnedConfig::max_pending_waits`] waits per allocation, then pin.
    /// Waiting for a copy in flight costs its remaining time; pinning costs about 0.5 s per GiB
    /// and keeps the memory pinned (`docs/pinned.md`). The default.
    #[default]
    Wait,
    /// Pin a new slab at once and leave the waiting blocks to complete on their own (the
    /// behaviour before the wait rule: the host never blocks in `alloc`, but a producer running
    /// ahead of its copies pins without bound).
    Grow,
}

/// How a [`PinnedCache`](super::PinnedCache) carves and bounds pinned memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PinnedConfig {
    /// Bytes pinned per slab. A request larger than this gets a slab of its own, of exactly its
    /// (aligned) size. Default 64 MiB.
    pub slab_size: usize,
    /// Alignment of every block (a power of two, at most the backend's); sizes round up to it.
    /// Default 256 bytes.
    pub alignment: usize,
    /// Cap on pinned bytes (all slabs together); `None` for no cap. Default `None`.
    pub max_pinned: Option<usize>,
    /// Slack rule: before pinning a new slab, if the pinned bytes would exceed `1 + max_slack`
    /// times the bytes in use (live and waiting blocks plus the request), wholly free slabs are
    /// unpinned (largest first) and, if still needed, the new slab is cut to the request's size.
    /// `None`: slabs are kept until `empty_cache`, the cap or an out-of-memory. Default `None`;
    /// [`PinnedConfig::tight`] sets it.
    pub max_slack: Option<f64>,
    /// Fit rule: a request larger than `slab_size` takes a free range only if the range is at
    /// most `1 + max_fit_waste` times the request; otherwise it pins a slab of its own size.
    /// `None`: best fit takes any range. Default `None`; [`PinnedConfig::frugal`] sets it.
    pub max_fit_waste: Option<f64>,
    /// What an allocation does when it would have to pin while blocks waiting for their events
    /// would serve it. Default [`PendingPolicy::Wait`].
    pub pending: PendingPolicy,
    /// With [`PendingPolicy::Wait`]: the most host waits one allocation makes before it pins
    /// (each wait is for one block's events; another thread may take the block first, hence
    /// more than one). `0` behaves as [`PendingPolicy::Grow`]. Default 4.
    pub max_pending_waits: u32,
}

impl Default for PinnedConfig {
    fn default() -> Self {
        PinnedConfig {
            slab_size: 64 << 20,
            alignment: 256,
            max_pinned: None,
            max_slack: None,
            max_fit_waste: None,
            pending: PendingPolicy::Wait,
            max_pending_waits: 4,
        }
    }
}

impl PinnedConfig {
    /// This configuration with `slab_size` bytes per slab.
    pub fn with_slab_size(mut self, slab_size: usize) -> Self {
        self.slab_size = slab_size;
        self
    }

    /// This configuration with block alignment `alignment`.
    pub fn with_alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Pinned bytes kept close to the bytes in use, at the price of more pinning: 4 MiB slabs,
    /// `max_slack` 0.05. On the mixed workload of `compare.rs` (simulated) it pins 1.237x the
    /// peak requested with 41 pins, against 1.431x and 10 pins for the default
    /// (`docs/pinned.md`).
    pub fn tight() -> Self {
        PinnedConfig {
            slab_size: 4 << 20,
            max_slack: Some(0.05),
            ..PinnedConfig::default()
        }
    }

    /// Pinned bytes within a few percent of the bytes in use, at a large price in pinning:
    /// 2 MiB slabs, `max_slack` 0.05, `max_fit_waste` 0.25. On the mixed workload of
    /// `compare.rs` (simulated) it pins 1.032x the peak requested, but pins about 800 times (a
    /// third of the allocations; 8.4 s of modelled pinning against 0.34 s by default): for hosts
    /// short of RAM with few distinct sizes, not for mixed sizes where pinning time matters
    /// (`docs/pinned.md`).
    pub fn frugal() -> Self {
        PinnedConfig {
            slab_size: 2 << 20,
            max_slack: Some(0.05),
            max_fit_waste: Some(0.25),
            ..PinnedConfig::default()
        }
    }

    /// This configuration with the fit rule at `max_fit_waste` (`None`: off).
    pub fn with_max_fit_waste(mut self, max_fit_waste: Option<f64>) -> Self {
        self.max_fit_waste = max_fit_waste;
        self
    }

    /// This configuration with the slack rule at `max_slack` (`None`: off).
    pub fn with_max_slack(mut self, max_slack: Option<f64>) -> Self {
        self.max_slack = max_slack;
        self
    }

    /// This configuration with `pending` as the policy for allocations that only waiting blocks
    /// would serve.
    pub fn with_pending(mut self, pending: PendingPolicy) -> Self {
        self.pending = pending;
        self
    }

    /// This configuration with at most `max_pending_waits` host waits per allocation.
    pub fn with_max_pending_waits(mut self, max_pending_waits: u32) -> Self {
        self.max_pending_waits = max_pending_waits;
        self
    }

    /// This configuration with a cap of `max_pinned` bytes (`None`: no cap).
    pub fn with_max_pinned(mut self, max_pinned: Option<usize>) -> Self {
        self.max_pinned = max_pinned;
        self
    }
}
