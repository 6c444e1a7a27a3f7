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
mod int_hash;
#[cfg(feature = "cuda-unpinned")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-unpinned")))]
pub mod interop;
mod op_clock;
pub mod replay;
pub mod size_class;
pub mod stats;
pub mod synth;
pub mod trace;

pub use allocator::{
    Allocation, BlockSnapshot, BlockState, CachingAllocator, FragmentationReport, FreeBucket,
    FreeOutcome, InvariantViolation, MemPoolId, OwnedAllocation, PoolCheckpoint, PoolFilter,
    PoolRestore, SegmentAction, SegmentEvent, SegmentObserver, SegmentSnapshot, SharedPages,
    capture_filter, memory_summary,
};
pub use backend::call_times::{CALL_KINDS, DeviceCallTimes};
pub use backend::sim::{
    FaultKind, SimCaptureMode, SimCaptureViolation, SimConfig, SimCosts, SimCounters, SimDevice,
    SimEventCall, SimStreamWait, SimUse, SimViolation, SimViolationKind,
};
pub use backend::{
    BackendError, DeviceAddr, DeviceBackend, EventHandle, FinishedUnmaps, MemInfo, PhysicalHandle,
    StreamId,
};
pub use config::{
    AllocatorConfig, AllocatorConfigBuilder, ConfigError, PageReuse, Preset, SettingDifference,
};
pub use error::{AllocError, OomReport, OomVerdict, Result};
pub use format::format_size;
pub use host::{
    HostBackend, HostPtr, PendingPolicy, PinnedBlock, PinnedCache, PinnedConfig, PinnedError,
    PinnedStats, SimHost, SimHostConfig,
};
pub use replay::{
    OomVerdictCounts, Placement, ReplayError, ReplayOptions, ReplayReport, replay, replay_observed,
    replay_with,
};
pub use size_class::{PoolKind, round_size};
pub use stats::{MemoryStats, Stat, StatArray, StatType};

/// The Rust blocks of the README and of the guides in `docs/` (the crate docs above are
/// `docs/overview.md`), compiled as doc tests. Some need the CUDA bindings (`no_run` there: no GPU
/// in CI), so they are compiled with the `cuda` feature, as CI's test command has it;
/// `tests/all/docs.rs` checks that every file with a Rust block is listed here.
#[cfg(all(doctest, feature = "cuda"))]
mod guide_doctests {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/cuda.md")]
    struct Cuda;
    #[doc = include_str!("../docs/migrating-from-cudarc.md")]
    struct MigratingFromCudarc;
    #[doc = include_str!("../docs/streams-and-graphs.md")]
    struct StreamsAndGraphs;
    #[doc = include_str!("../docs/researchers-guide.md")]
    #[cfg(feature = "trace-io")]
    struct ResearchersGuide;
}
