#![doc = include_str!("../docs/overview.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_debug_implementations)]

mod allocator;
pub mod backend;
pub mod config;
mod error;
mod format;
pub mod host;
#[cfg(feature = "cuda-unpinned")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-unpinned")))]
pub mod interop;
pub mod replay;
pub mod size_class;
pub mod stats;
pub mod synth;
pub mod trace;

pub use allocator::{
    Allocation, BlockSnapshot, BlockState, CachingAllocator, FragmentationReport, FreeBucket,
    InvariantViolation, MemPoolId, OwnedAllocation, PoolFilter, SegmentSnapshot, capture_filter,
    memory_summary,
};
pub use backend::sim::{
    FaultKind, SimCaptureMode, SimCaptureViolation, SimConfig, SimCosts, SimCounters, SimDevice,
    SimEventCall, SimStreamWait, SimUse, SimViolation, SimViolationKind,
};
pub use backend::{
    BackendError, DeviceBackend, DevicePtr, EventHandle, MemInfo, PhysicalHandle, StreamId,
};
pub use config::{AllocatorConfig, AllocatorConfigBuilder, ConfigError, PageReuse, Preset};
pub use error::{AllocError, OomReport, OomVerdict, Result};
pub use format::format_size;
pub use host::{
    HostBackend, HostPtr, PinnedBlock, PinnedCache, PinnedConfig, PinnedError, PinnedStats,
    SimHost, SimHostConfig,
};
pub use replay::{
    Placement, ReplayError, ReplayOptions, ReplayReport, replay, replay_observed, replay_with,
};
pub use size_class::{PoolKind, round_size};
pub use stats::{MemoryStats, Stat, StatArray, StatType};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
