//! `PinnedConfig`: slab size, alignment and the cap on pinned bytes. May use: nothing.

/// How a [`PinnedCache`](super::PinnedCache) carves and bounds pinned memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedConfig {
    /// Bytes pinned per slab. A request larger than this gets a slab of its own, of exactly its
    /// (aligned) size. Default 64 MiB.
    pub slab_size: usize,
    /// Alignment of every block (a power of two, at most the backend's); sizes round up to it.
    /// Default 256 bytes.
    pub alignment: usize,
    /// Cap on pinned bytes (all slabs together); `None` for no cap. Default `None`.
    pub max_pinned: Option<usize>,
}

impl Default for PinnedConfig {
    fn default() -> Self {
        PinnedConfig {
            slab_size: 64 << 20,
            alignment: 256,
            max_pinned: None,
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

    /// This configuration with a cap of `max_pinned` bytes (`None`: no cap).
    pub fn with_max_pinned(mut self, max_pinned: Option<usize>) -> Self {
        self.max_pinned = max_pinned;
        self
    }
}
