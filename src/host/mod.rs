//! Pinned (page-locked) host memory: a caching allocator for the host buffers that asynchronous
//! copies need.
//!
//! Pinning is slow (about half a second per GiB with `cuMemHostAlloc`, see `docs/pinned.md`),
//! so [`PinnedCache`] pins large *slabs* once and hands out **exact-size** pieces of them
//! (rounded only to the alignment, never to a power of two), best fit over the free ranges of
//! every slab, splitting on hand-out and merging neighbours on return. Slabs are unpinned by
//! [`PinnedCache::empty_cache`] and bounded by a cap on pinned bytes.
//!
//! Reuse follows the crate's one safety rule (`DESIGN.md` rule 3): a block freed after work on
//! streams the caller declared ([`PinnedCache::record_stream`]) gets one event per stream at the
//! free, and is reused only once every event completed.
//!
//! Page-locking comes from a [`HostBackend`]; events come from its device
//! ([`HostBackend::device`], the existing [`DeviceBackend`](crate::DeviceBackend) event calls).
//! [`SimHost`] is the deterministic simulated host over a [`SimDevice`](crate::SimDevice); the
//! CUDA host backend (`CudaHost`) lives in
//! `host/cuda.rs` behind the `cuda` feature.
//!
//! Files: `backend.rs` (the trait and its values), `config.rs`, `error.rs`, `fence.rs`
//! (completions handed in at a free), `slab.rs` (one slab's
//! free ranges), `cache.rs` (the cache), `stats.rs` (statistics and the summary line),
//! `invariants.rs`, `pages.rs` ([`PagedPinnedCache`]: the device allocator over host pages, with
//! fenced frees), `sim.rs` (`SimHost`), `compare.rs` (a mixed workload and a model of PyTorch's
//! power-of-two policy), `cuda.rs` (feature `cuda`).

mod backend;
mod cache;
mod compare;
mod config;
#[cfg(feature = "cuda-unpinned")]
mod cuda;
mod error;
mod fence;
mod invariants;
mod pages;
mod sim;
mod slab;
mod stats;

pub use backend::{HostBackend, HostPtr, Pinned};
pub use cache::{PinnedBlock, PinnedCache};
pub use compare::{HostOp, PowerOfTwoModel, mixed_workload};
pub use config::{PendingPolicy, PinnedConfig};
#[cfg(feature = "cuda-unpinned")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-unpinned")))]
pub use cuda::{CudaHost, PinMethod};
pub use error::PinnedError;
pub use fence::HostFence;
pub use invariants::PinnedInvariantViolation;
pub use pages::PagedPinnedCache;
pub use sim::{SimHost, SimHostConfig, SimHostCounters, SimHostFault};
pub use stats::PinnedStats;
