//! Configuration: PyTorch's size constants, the typed [`AllocatorConfig`] with its builder, the
//! named presets, and (in `parse`) PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! Policy is data: the `pytorch` preset is PyTorch 2.11's behaviour, the crate's own default is
//! another configuration of the same machinery. May use: nothing internal.
#![forbid(unsafe_code)]

mod difference;
mod parse;

use std::fmt;

pub use difference::SettingDifference;
pub use parse::ENV_VAR;

/// One mebibyte.
pub const MIB: usize = 1 << 20;
/// `kMinBlockSize`: every request is rounded to at least 512 bytes, and to a multiple of it.
pub const MIN_BLOCK_SIZE: usize = 512;
/// `kSmallSize`: the largest "small" request (after rounding) is 1 MiB.
pub const SMALL_SIZE: usize = MIB;
/// `kSmallBuffer`: small requests are packed into 2 MiB segments.
pub const SMALL_BUFFER: usize = 2 * MIB;
/// `kMinLargeAlloc`: requests between 1 and 10 MiB use large-segment-size segments.
pub const MIN_LARGE_ALLOC: usize = 10 * MIB;
/// `kRoundLarge`: segments for requests of 10 MiB or more are rounded up to 2 MiB.
pub const ROUND_LARGE: usize = 2 * MIB;
/// `kLargeBuffer`: the default large segment size, 20 MiB.
pub const LARGE_BUFFER: usize = 20 * MIB;
/// Requests of this size or more are rejected outright (1 EiB), as PyTorch rejects them.
pub const MAX_ALLOCATION_SIZE: u64 = 1 << 60;
/// Number of `roundup_power2_divisions` buckets (1 MiB .. 64 GiB, one per power of two).
pub const ROUNDUP_POWER2_BUCKETS: usize = 16;
/// The most `roundup_power2_divisions` a bucket may have: the largest power of two whose
/// product with [`MIN_BLOCK_SIZE`] is still a size (2^54 on 64-bit targets). Division rounding
/// applies only to requests above `512 * divisions`, so a larger count could never apply;
/// PyTorch checks only that the count is a power of two, and its `512 * divisions` overflows.
const MAX_ROUNDUP_POWER2_DIVISIONS: usize =
    1 << (usize::BITS - 1 - MIN_BLOCK_SIZE.trailing_zeros());

/// A configuration string or value that cannot be used. The message names what was wrong, in
/// PyTorch's words where PyTorch has them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// A named configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// PyTorch 2.11's defaults, exactly.
    Pytorch,
    /// PyTorch 2.11 with `expandable_segments:True`.
    PytorchExpandable,
    /// This crate's own default (see [`AllocatorConfig::default`]).
    Default,
    /// The default with fewer, larger physical handles: up to 64 MiB, one handle per growth,
    /// growths of at least 20 MiB (`cca_max_handle_size_mb:64,cca_handle_per_growth:True,`
    /// `cca_min_growth_mb:20` on top of the default). The point of #11's trade-off curve for
    /// programs that start often: on an H100 its growth replays the shipped traces cold at
    /// 0.72–1.05 × PyTorch's own allocator's time (the default: 5.5–22 ×; measured without the
    /// fast path, which it keeps on like the default), reserving 1.009–1.019 × the peak live
    /// bytes on those traces on `SimDevice`, but up to 1.11 × on the synthetic stress traces and
    /// 1.064 × on the recorded `generate` client (`gpu/traces/`), whose peak is small beside its
    /// 20 MiB growths (the default: ≤ 1.02 everywhere); see `benches/README.md`.
    LeanFast,
}

impl Preset {
    /// Every preset, in a stable order.
    pub const ALL: [Preset; 4] = [
        Preset::Default,
        Preset::Pytorch,
        Preset::PytorchExpandable,
        Preset::LeanFast,
    ];

    /// The preset's name (`pytorch`, `pytorch-expandable`, `default`, `lean-fast`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Pytorch => "pytorch",
            Preset::PytorchExpandable => "pytorch-expandable",
            Preset::Default => "default",
            Preset::LeanFast => "lean-fast",
        }
    }

    /// The preset of that name.
    ///
    /// # Errors
    /// A [`ConfigError`] listing the known names.
    pub fn from_name(name: &str) -> Result<Preset, ConfigError> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                ConfigError::new(format!(
                    "unknown preset '{name}'; known presets: {}",
                    Preset::ALL.map(Preset::name).join(", ")
                ))
            })
    }

    /// The configuration of this preset.
    pub fn config(self) -> AllocatorConfig {
        match self {
            Preset::Pytorch => AllocatorConfig::pytorch(),
            Preset::PytorchExpandable => AllocatorConfig {
                expandable_segments: true,
                ..AllocatorConfig::pytorch()
            },
            Preset::Default => AllocatorConfig::default(),
            Preset::LeanFast => AllocatorConfig {
                expandable_max_handle_size: Some(64 * MIB),
                expandable_handle_per_growth: true,
                expandable_min_growth: 20 * MIB,
                ..AllocatorConfig::default()
            },
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Every knob of the caching allocator. Fields use PyTorch's names (in bytes where PyTorch's
/// keys say `_mb`). Build one with [`AllocatorConfig::builder`], a preset, or
/// [`AllocatorConfig::parse`].
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks of this size or more are never split ("oversize"); `usize::MAX` = unlimited.
    pub max_split_size: usize,
    /// How much larger than an oversize request a cached oversize block may be.
    pub max_non_split_rounding: usize,
    /// Segment size for 1–10 MiB requests (and the large pool's expandable page size).
    pub large_segment_size: usize,
    /// Per-bucket power-of-two divisions for rounding (0 or 1: plain 512-byte rounding).
    pub roundup_power2_divisions: [usize; ROUNDUP_POWER2_BUCKETS],
    /// Age-based garbage collection of cached large blocks, in `(0, 1)`; 0 = off. Active only
    /// with a memory fraction below 1.
    pub garbage_collection_threshold: f64,
    /// Grow per-stream virtual-memory segments instead of allocating fixed segments.
    pub expandable_segments: bool,
    /// The per-process memory fraction cap in `[0, 1]`; 1 = no cap.
    pub per_process_memory_fraction: f64,
    /// Accepted for compatibility; the cache keeps its lock around device allocations.
    pub release_lock_on_cudamalloc: bool,
    /// Fail at once (skipping the release-and-retry chain) when the fraction cap would be
    /// exceeded.
    pub throw_on_cudamalloc_oom: bool,
    /// PyTorch's graph-topology reuse of blocks freed during a capture. Not implemented: `true`
    /// logs a warning and behaves as `false` (such blocks wait for the capture's end).
    pub graph_capture_record_stream_reuse: bool,
    /// Page size of the large pool's expandable segments, in bytes (crate key
    /// `cca_large_page_size_mb`). `None` uses `large_segment_size`, as PyTorch does (20 MiB pages);
    /// the small pool always uses 2 MiB pages. Must be a multiple of the device's virtual-memory
    /// granularity.
    pub expandable_large_page_size: Option<usize>,
    /// The largest physical handle an expandable segment creates when it grows, in bytes
    /// (crate key `cca_max_handle_size_mb`). `None`: one handle per page, as PyTorch does.
    /// Larger handles mean fewer create and map calls for a big growth; page reuse and
    /// `empty_cache` can only unmap a handle that lies wholly inside a free block.
    pub expandable_max_handle_size: Option<usize>,
    /// The fewest bytes a growing expandable segment maps at once (crate key
    /// `cca_min_growth_mb`; 0 = just what the request lacks, as PyTorch does). Growing ahead of
    /// need merges the next small growths into this one: fewer create and map calls, at the cost
    /// of up to this many free mapped bytes at the segment's end.
    pub expandable_min_growth: usize,
    /// Whether a growth creates its new memory as one physical handle (up to
    /// `expandable_max_handle_size`) instead of splitting the last page off as a handle of its
    /// own (crate key `cca_handle_per_growth`). One handle per growth halves the create and map
    /// calls; the last page, which usually also holds the start of the next block, then cannot
    /// be reused apart from the rest.
    pub expandable_handle_per_growth: bool,
    /// Where an expandable segment finds physical pages when it grows (crate key
    /// `cca_page_reuse`). PyTorch always creates new ones ([`PageReuse::Off`]).
    pub page_reuse: PageReuse,
    /// How far reserved bytes may exceed the allocated bytes (after the request) before a
    /// growing expandable segment reuses free pages instead of creating new ones, as a fraction
    /// (crate key `cca_page_reuse_slack`; 0 = always reuse first). Reuse costs an unmap and
    /// a map per range (and a fence event or a stream synchronization, `page_reuse_fence`); the
    /// slack trades a bounded amount of memory (peak reserved stays near `(1 + slack) × peak
    /// allocated`) for fewer device calls.
    pub page_reuse_slack: f64,
    /// How page reuse makes sure a free page's queued work is done before it unmaps the page
    /// (crate key `cca_page_reuse_fence`). `true`: by events — an event recorded on the page's
    /// stream after the free is queried, never waited for, and pages whose event has not
    /// completed stay where they are (the growth creates new memory instead and reuses them
    /// later). `false`: by synchronizing the page's stream first, as PyTorch does before it
    /// unmaps. Without page reuse it changes nothing.
    pub page_reuse_fence: bool,
    /// Whether a growth may take free pages whose fence is still pending by *lending* them
    /// (crate key `cca_page_lending`; needs `page_reuse_fence`): the page's physical memory is
    /// mapped a second time where the growth needs it, the growing stream waits for an event
    /// recorded on the page's stream (stream-ordered, no host wait), and the old mapping is
    /// unmapped later, once a fence query shows its work complete. `false`: such pages stay
    /// where they are and the growth creates new memory. See `docs/algorithm.md`, step 23b.
    pub page_lending: bool,
    /// Whether the unmaps of pages a growth moved run on a helper thread when the backend has
    /// one (crate key `cca_unmap_helper`; a CUDA device does, the simulated device only when
    /// asked): the growth maps the pages where it needs them first and leaves their old mapping
    /// in place, and the helper unmaps it while the program runs on. `false`: the growing thread
    /// unmaps them itself. See `docs/algorithm.md`, step 23e.
    pub unmap_helper: bool,
    /// How many pages page reuse may move while the allocated bytes stay below their peak, as a
    /// multiple of the pages reserved (crate key `cca_page_move_budget`; 0 = no budget). Once a
    /// workload that no longer raises its peak has moved that many, growths create the pages
    /// they lack instead of moving free ones, so a steady workload stops paying an unmap and a
    /// map per page; the count starts again when the peak rises (Note [Page-move budget];
    /// `docs/algorithm.md`, step 23d).
    pub page_move_budget: u64,
    /// Whether the fraction cap counts only the physical bytes a growth really creates (crate key
    /// `cca_precise_cap`). PyTorch counts the whole segment size `get_allocation_size` gives,
    /// even when expandable segments map less or reuse pages.
    pub precise_fraction_cap: bool,
    /// Per-thread front caches in front of the core (crate key `cca_fast_path`): cache hits and
    /// frees of this thread's blocks take no lock. On in the default and `lean-fast`, off in the
    /// `pytorch` presets (which must reproduce PyTorch's statistics exactly: a block held in a
    /// thread's front cache counts as freed). See `benches/README.md`.
    pub fast_path: bool,
    /// Whether idle cached memory of one stream may serve another stream (crate key
    /// `cca_cross_stream_reuse`). PyTorch reuses a block only on the stream it was allocated for;
    /// with this on, an allocation that finds no fitting free block of its own stream, before
    /// the cache would grow, takes a wholly free cached segment of another stream of the same
    /// pool: an event recorded on the old stream and waited on by the new one orders the work
    /// (no host synchronization), then the segment belongs to the new stream. Opt-in: off in
    /// every preset (see `docs/algorithm.md`, "Cross-stream reuse").
    pub cross_stream_reuse: bool,
    /// Whether an allocation may *borrow* a free block of another stream of the same pool where
    /// it lies (crate key `cca_borrow_blocks`; needs expandable segments): when no free block of
    /// its own stream fits, before the cache grows, the best-fitting free large-pool block of
    /// another stream serves it if that stream's queued work on the block is known complete (a
    /// completed page fence; a block still pending is left where it is: no wait of any kind).
    /// The block stays in its segment; its free records an event on the borrowing stream, and it
    /// returns to its own stream once that completes. No page is unmapped or mapped. Opt-in: off
    /// in every preset. See `docs/algorithm.md`, step 27b.
    pub borrow_blocks: bool,
    /// The original configuration string, when parsed from one.
    pub settings: String,
}

/// Where an expandable segment finds physical pages when it grows.
///
/// Reusing a page means unmapping a whole free page from a free cached block (once its queued
/// work is known complete, see `page_reuse_fence`) and mapping the same physical memory where the growth
/// needs it, instead of creating new memory: GMLake's "stitching" on top of PyTorch's expandable
/// segments. It trades device calls (one unmap and one map per reused range) for reserved bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum PageReuse {
    /// Always create new physical pages (PyTorch). Key value `off`.
    #[default]
    Off,
    /// Reuse free pages of the same segment (same stream and pool). Key value `segment`.
    Segment,
    /// Reuse free pages of any expandable segment with the same page size: any stream, and the
    /// other pool too when both pools use one page size. Key value `device`.
    Device,
}

impl PageReuse {
    /// The key value (`off`, `segment`, `device`).
    pub fn name(self) -> &'static str {
        match self {
            PageReuse::Off => "off",
            PageReuse::Segment => "segment",
            PageReuse::Device => "device",
        }
    }
}

impl AllocatorConfig {
    /// PyTorch 2.11's defaults.
    pub fn pytorch() -> Self {
        AllocatorConfig {
            max_split_size: usize::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            large_segment_size: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_POWER2_BUCKETS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            per_process_memory_fraction: 1.0,
            release_lock_on_cudamalloc: false,
            throw_on_cudamalloc_oom: false,
            graph_capture_record_stream_reuse: false,
            expandable_large_page_size: None,
            expandable_max_handle_size: None,
            expandable_min_growth: 0,
            expandable_handle_per_growth: false,
            page_reuse: PageReuse::Off,
            page_reuse_slack: 0.0,
            page_reuse_fence: false,
            page_lending: false,
            unmap_helper: false,
            page_move_budget: 0,
            precise_fraction_cap: false,
            fast_path: false,
            cross_stream_reuse: false,
            borrow_blocks: false,
            settings: String::new(),
        }
    }

    /// A builder starting from PyTorch's defaults, as [`AllocatorConfig::parse`] does (start
    /// from another configuration, such as the crate's default, with
    /// [`AllocatorConfigBuilder::from_config`]).
    pub fn builder() -> AllocatorConfigBuilder {
        AllocatorConfigBuilder {
            config: AllocatorConfig::pytorch(),
        }
    }

    /// Parses PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax (`key:value,key:[k:v,...]`) on top of
    /// PyTorch's defaults, with PyTorch's keys, values and error messages.
    ///
    /// This is the one meaning of a configuration string throughout the crate: the environment
    /// variables ([`AllocatorConfig::from_env_or`]) and `cca --config` without `--preset` read
    /// a string the same way. The crate's key `cca_preset:NAME` starts over from a preset, so
    /// `cca_preset:default,max_split_size_mb:256` builds on the crate's default instead.
    ///
    /// ```
    /// use cuda_caching_allocator::AllocatorConfig;
    /// let c = AllocatorConfig::parse("max_split_size_mb:128,roundup_power2_divisions:[256:4,>:1]").unwrap();
    /// assert_eq!(c.max_split_size, 128 << 20);
    /// assert!(AllocatorConfig::parse("bogus:1").unwrap_err().to_string().contains("Unrecognized key 'bogus'"));
    /// ```
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad key, token or value.
    pub fn parse(settings: &str) -> Result<Self, ConfigError> {
        AllocatorConfig::pytorch().with_settings(settings)
    }

    /// Applies a configuration string on top of `self` (keys not named keep their values, except
    /// `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold`, which
    /// PyTorch resets to their defaults on every parse).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad key, token or value.
    pub fn with_settings(self, settings: &str) -> Result<Self, ConfigError> {
        parse::apply(self, settings)
    }

    /// The configuration from the environment: `CUDA_CACHING_ALLOCATOR_CONF` if set, else
    /// `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`, read as [`AllocatorConfig::parse`]
    /// reads it (on top of PyTorch's defaults, so a string means what it means to PyTorch, on the
    /// command line and in [`AllocatorConfig::parse`]); `base` when none is set. A string that
    /// should build on the crate's default starts with `cca_preset:default`.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the variable and what was wrong in it, including a value that
    /// is set but not valid UTF-8.
    pub fn from_env_or(base: AllocatorConfig) -> Result<Self, ConfigError> {
        for var in [ENV_VAR, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"] {
            match std::env::var(var) {
                Ok(value) => {
                    return AllocatorConfig::parse(&value)
                        .map_err(|e| ConfigError::new(format!("{var}: {}", e.message())));
                }
                // Set but unreadable is an error, not "unset": a later variable must not
                // silently apply in its place.
                Err(std::env::VarError::NotUnicode(raw)) => {
                    return Err(ConfigError::new(format!(
                        "{var}: the value is not valid UTF-8 ({})",
                        raw.to_string_lossy()
                    )));
                }
                Err(std::env::VarError::NotPresent) => {}
            }
        }
        Ok(base)
    }

    /// The configuration as a string in PyTorch's syntax that [`AllocatorConfig::parse`] reads
    /// back to this configuration: the keys whose values differ from PyTorch's defaults, in a
    /// stable order (empty for PyTorch's defaults). Sizes are written in whole MiB, as the keys
    /// take them (a size set directly in a field that is not a whole number of MiB is written
    /// rounded down). Reports print it as the resolved configuration.
    ///
    /// ```
    /// use cuda_caching_allocator::AllocatorConfig;
    /// let s = AllocatorConfig::default().to_settings();
    /// assert!(s.starts_with("expandable_segments:True"));
    /// let back = AllocatorConfig::parse(&s).unwrap();
    /// assert_eq!(back.to_settings(), s);
    /// ```
    pub fn to_settings(&self) -> String {
        let d = AllocatorConfig::pytorch();
        let mut out: Vec<String> = Vec::new();
        let flag = |b: bool| if b { "True" } else { "False" };
        if self.expandable_segments != d.expandable_segments {
            out.push(format!(
                "expandable_segments:{}",
                flag(self.expandable_segments)
            ));
        }
        if self.max_split_size != d.max_split_size {
            out.push(format!("max_split_size_mb:{}", self.max_split_size / MIB));
        }
        if self.max_non_split_rounding != d.max_non_split_rounding {
            out.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding / MIB
            ));
        }
        if self.large_segment_size != d.large_segment_size {
            out.push(format!(
                "large_segment_size_mb:{}",
                self.large_segment_size / MIB
            ));
        }
        let div = &self.roundup_power2_divisions;
        if div != &d.roundup_power2_divisions {
            if div.iter().all(|&v| v == div[0]) && div[0].is_power_of_two() {
                out.push(format!("roundup_power2_divisions:{}", div[0]));
            } else {
                // Bucket `i` starts at 2^i MiB; the last bucket is everything above.
                let mut items: Vec<String> = div
                    .iter()
                    .take(ROUNDUP_POWER2_BUCKETS - 1)
                    .enumerate()
                    .map(|(i, v)| format!("{}:{v}", 1usize << i))
                    .collect();
                items.push(format!(">:{}", div[ROUNDUP_POWER2_BUCKETS - 1]));
                out.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if self.garbage_collection_threshold != d.garbage_collection_threshold {
            out.push(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        if self.per_process_memory_fraction != d.per_process_memory_fraction {
            out.push(format!(
                "per_process_memory_fraction:{}",
                self.per_process_memory_fraction
            ));
        }
        if self.release_lock_on_cudamalloc != d.release_lock_on_cudamalloc {
            out.push(format!(
                "release_lock_on_cudamalloc:{}",
                flag(self.release_lock_on_cudamalloc)
            ));
        }
        if self.throw_on_cudamalloc_oom != d.throw_on_cudamalloc_oom {
            out.push(format!(
                "throw_on_cudamalloc_oom:{}",
                flag(self.throw_on_cudamalloc_oom)
            ));
        }
        if self.graph_capture_record_stream_reuse != d.graph_capture_record_stream_reuse {
            out.push(format!(
                "graph_capture_record_stream_reuse:{}",
                flag(self.graph_capture_record_stream_reuse)
            ));
        }
        if let Some(p) = self.expandable_large_page_size {
            out.push(format!("cca_large_page_size_mb:{}", p / MIB));
        }
        if let Some(p) = self.expandable_max_handle_size {
            out.push(format!("cca_max_handle_size_mb:{}", p / MIB));
        }
        if self.expandable_min_growth != d.expandable_min_growth {
            out.push(format!(
                "cca_min_growth_mb:{}",
                self.expandable_min_growth / MIB
            ));
        }
        if self.expandable_handle_per_growth != d.expandable_handle_per_growth {
            out.push(format!(
                "cca_handle_per_growth:{}",
                flag(self.expandable_handle_per_growth)
            ));
        }
        if self.page_reuse != d.page_reuse {
            out.push(format!("cca_page_reuse:{}", self.page_reuse.name()));
        }
        if self.page_reuse_slack != d.page_reuse_slack {
            out.push(format!("cca_page_reuse_slack:{}", self.page_reuse_slack));
        }
        if self.page_reuse_fence != d.page_reuse_fence {
            out.push(format!(
                "cca_page_reuse_fence:{}",
                flag(self.page_reuse_fence)
            ));
        }
        if self.page_lending != d.page_lending {
            out.push(format!("cca_page_lending:{}", flag(self.page_lending)));
        }
        if self.unmap_helper != d.unmap_helper {
            out.push(format!("cca_unmap_helper:{}", flag(self.unmap_helper)));
        }
        if self.page_move_budget != d.page_move_budget {
            out.push(format!("cca_page_move_budget:{}", self.page_move_budget));
        }
        if self.precise_fraction_cap != d.precise_fraction_cap {
            out.push(format!(
                "cca_precise_cap:{}",
                flag(self.precise_fraction_cap)
            ));
        }
        if self.fast_path != d.fast_path {
            out.push(format!("cca_fast_path:{}", flag(self.fast_path)));
        }
        if self.cross_stream_reuse != d.cross_stream_reuse {
            out.push(format!(
                "cca_cross_stream_reuse:{}",
                flag(self.cross_stream_reuse)
            ));
        }
        if self.borrow_blocks != d.borrow_blocks {
            out.push(format!("cca_borrow_blocks:{}", flag(self.borrow_blocks)));
        }
        out.join(",")
    }

    /// The preset this configuration equals (ignoring [`settings`](Self::settings)), if any.
    pub fn matching_preset(&self) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| {
            let mut c = p.config();
            c.settings.clone_from(&self.settings);
            c == *self
        })
    }

    /// Checks the large pool's expandable page size against a device's virtual-memory
    /// granularity (the size every physical handle is a multiple of). A page that is not a whole
    /// number of granules cannot be created, and silently falling back to fixed segments would
    /// change what the configuration means; a device whose granularity does not divide the small
    /// pool's fixed 2 MiB page (no key can change it) falls back to fixed segments, as one
    /// without virtual memory does.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the key that sets the page size.
    pub(crate) fn validate_for_granularity(&self, granularity: usize) -> Result<(), ConfigError> {
        if !self.expandable_segments || granularity == 0 || SMALL_BUFFER % granularity != 0 {
            return Ok(());
        }
        let (page, key) = self.large_page_and_key();
        if page % granularity == 0 {
            return Ok(());
        }
        Err(ConfigError::new(format!(
            "{key}: expandable segments map the large pool in pages of {} MiB, which is not a \
             multiple of this device's virtual-memory granularity ({} KiB); pick a multiple of it",
            page / MIB,
            granularity / 1024
        )))
    }

    /// The large pool's expandable page size and the key that sets it.
    fn large_page_and_key(&self) -> (usize, &'static str) {
        match self.expandable_large_page_size {
            Some(page) => (page, "cca_large_page_size_mb"),
            None => (self.large_segment_size, "large_segment_size_mb"),
        }
    }

    /// Checks, for a device of `total` bytes, that the large pool's expandable page fits in it:
    /// a larger page fails every large allocation, and the out-of-memory report then names the
    /// request's segment, not the page (an adversarial review). `total == 0` (unknown) passes.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the key that sets the page size.
    pub(crate) fn validate_for_device(&self, total: usize) -> Result<(), ConfigError> {
        if !self.expandable_segments || total == 0 {
            return Ok(());
        }
        let (page, key) = self.large_page_and_key();
        if page <= total {
            return Ok(());
        }
        Err(ConfigError::new(format!(
            "{key}: expandable segments map the large pool in pages of {} MiB, more than this \
             device's whole memory ({})",
            page / MIB,
            crate::format::format_size(total as u64)
        )))
    }

    /// Checks every value's range.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_split_size < LARGE_BUFFER {
            return Err(ConfigError::new(format!(
                "CachingAllocator option max_split_size_mb too small, must be >= {}",
                LARGE_BUFFER / MIB
            )));
        }
        if self.max_non_split_rounding < LARGE_BUFFER {
            return Err(ConfigError::new(format!(
                "CachingAllocator option max_non_split_rounding_mb too small, must be >= {}",
                LARGE_BUFFER / MIB
            )));
        }
        if self.large_segment_size <= MIN_LARGE_ALLOC
            || self.large_segment_size % MIB != 0
            || self.large_segment_size as u64 >= MAX_ALLOCATION_SIZE
        {
            return Err(ConfigError::new(format!(
                "CachingAllocator option large_segment_size_mb must be a whole number of MiB > {} and < {}",
                MIN_LARGE_ALLOC / MIB,
                MAX_ALLOCATION_SIZE / MIB as u64
            )));
        }
        for &d in &self.roundup_power2_divisions {
            if d != 0 && !d.is_power_of_two() {
                return Err(ConfigError::new(
                    "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                ));
            }
            if d > MAX_ROUNDUP_POWER2_DIVISIONS {
                return Err(ConfigError::new(format!(
                    "roundup_power2_divisions: {d} divisions is too many (at most \
                     {MAX_ROUNDUP_POWER2_DIVISIONS} = 2^{}, so that 512 bytes times the count \
                     is still a size; more could never apply)",
                    MAX_ROUNDUP_POWER2_DIVISIONS.trailing_zeros()
                )));
            }
        }
        let gc = self.garbage_collection_threshold;
        if !(gc == 0.0 || (gc > 0.0 && gc < 1.0)) {
            return Err(ConfigError::new(
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            ));
        }
        if let Some(p) = self.expandable_large_page_size {
            if p < MIB || p % MIB != 0 {
                return Err(ConfigError::new(
                    "cca_large_page_size_mb must be a whole, positive number of MiB",
                ));
            }
        }
        if let Some(p) = self.expandable_max_handle_size {
            if p < MIB || p % MIB != 0 {
                return Err(ConfigError::new(
                    "cca_max_handle_size_mb must be a whole, positive number of MiB",
                ));
            }
        }
        let slack = self.page_reuse_slack;
        if !(0.0..=1.0).contains(&slack) {
            return Err(ConfigError::new(
                "cca_page_reuse_slack is invalid, set it in [0.0, 1.0]",
            ));
        }
        let f = self.per_process_memory_fraction;
        if !(0.0..=1.0).contains(&f) {
            return Err(ConfigError::new(
                "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
            ));
        }
        Ok(())
    }

    /// The rounding divisions that apply to a request of `size` bytes (PyTorch's bucket rule:
    /// `clamp(log2(size) - 20, 0, 15)`).
    #[inline]
    pub fn divisions_for(&self, size: usize) -> usize {
        let log_size = usize::BITS as usize - 1 - size.max(1).leading_zeros() as usize;
        let index = log_size.saturating_sub(20).min(ROUNDUP_POWER2_BUCKETS - 1);
        self.roundup_power2_divisions[index]
    }
}

impl Default for AllocatorConfig {
    /// The crate's own default, chosen by measurement (`benches/README.md`): PyTorch's
    /// algorithm with expandable segments, 2 MiB pages in both pools (so either pool can use the
    /// other's free pages), page reuse across the device with 1% slack, and a fraction cap that
    /// counts only newly created memory. On the shared PyTorch traces and the synthetic stress
    /// traces it reserves at most about 1.015 × the peak live bytes (PyTorch: 1.12–2.21×; PyTorch
    /// with expandable segments: 1.01–1.58×). As a configuration string:
    /// `expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device,`
    /// `cca_page_reuse_slack:0.01,cca_page_reuse_fence:True,cca_page_lending:True,`
    /// `cca_unmap_helper:True,cca_page_move_budget:8,cca_precise_cap:True,cca_fast_path:True`. Page reuse is
    /// fenced by events, so the default never synchronizes a stream or the device outside
    /// `empty_cache` and the out-of-memory path.
    ///
    /// Borrowed blocks (`cca_borrow_blocks:True`) stay off: on `SimDevice` they cut the FSDP2
    /// recording's page moves by two thirds at the same peak, but on two H200s the FSDP2 client
    /// was no faster with them (1.023 × native against 1.014 without, in one run) and made as
    /// many page moves per step after warm-up (`benches/README.md`, "Borrowed blocks").
    ///
    /// The per-thread fast path (`cca_fast_path:True`) is on: per-thread front caches serve cache
    /// hits without the lock, and a growth takes back only its own stream's cached blocks, so
    /// threads on their own streams scale (16 threads: 12.6 × one thread's pairs on an H100 host,
    /// where without it they fell to a fortieth; see `benches/README.md`).
    ///
    /// On a backend without virtual memory it falls back to PyTorch's fixed segments.
    ///
    /// Cross-stream reuse (`cca_cross_stream_reuse:True`) stays off: with page reuse on, it
    /// leaves peak reserved bytes where they are (it cuts the range operations of the
    /// multi-stream synthetic workload to about a third; page moves are fenced by events, so
    /// there are no stream synchronizations to cut) and makes a stream wait for another's queued
    /// work, which the simulated device cannot price (see `docs/configuration.md`).
    fn default() -> Self {
        AllocatorConfig {
            expandable_segments: true,
            expandable_large_page_size: Some(SMALL_BUFFER),
            page_reuse: PageReuse::Device,
            page_reuse_slack: 0.01,
            page_reuse_fence: true,
            page_lending: true,
            unmap_helper: true,
            page_move_budget: 8,
            precise_fraction_cap: true,
            fast_path: true,
            ..AllocatorConfig::pytorch()
        }
    }
}

/// A typed builder for [`AllocatorConfig`]; `build` validates.
///
/// ```
/// use cuda_caching_allocator::AllocatorConfig;
/// let c = AllocatorConfig::builder().max_split_size_mb(512).memory_fraction(0.5).build().unwrap();
/// assert_eq!(c.max_split_size, 512 << 20);
/// assert!(AllocatorConfig::builder().max_split_size_mb(4).build().is_err());
/// ```
#[derive(Clone, Debug)]
pub struct AllocatorConfigBuilder {
    config: AllocatorConfig,
}

/// `mb` MiB in bytes, at most the largest whole number of MiB a `usize` holds, as the parser
/// (and PyTorch's) reads a `_mb` key: so that every built configuration is a whole number of MiB
/// and comes back the same through `to_settings` and `parse` (a saturated `usize::MAX` did not).
fn whole_mib(mb: usize) -> usize {
    mb.min(usize::MAX / MIB) * MIB
}

impl AllocatorConfigBuilder {
    /// Starts from another configuration.
    pub fn from_config(config: AllocatorConfig) -> Self {
        AllocatorConfigBuilder { config }
    }

    /// `max_split_size_mb`.
    pub fn max_split_size_mb(mut self, mb: usize) -> Self {
        self.config.max_split_size = whole_mib(mb);
        self
    }

    /// `max_non_split_rounding_mb`.
    pub fn max_non_split_rounding_mb(mut self, mb: usize) -> Self {
        self.config.max_non_split_rounding = whole_mib(mb);
        self
    }

    /// `large_segment_size_mb`.
    pub fn large_segment_size_mb(mut self, mb: usize) -> Self {
        self.config.large_segment_size = whole_mib(mb);
        self
    }

    /// `roundup_power2_divisions:N` for every bucket.
    pub fn roundup_power2_divisions(mut self, divisions: usize) -> Self {
        self.config.roundup_power2_divisions = [divisions; ROUNDUP_POWER2_BUCKETS];
        self
    }

    /// `roundup_power2_divisions` per bucket (bucket `i` covers `[2^i, 2^(i+1))` MiB).
    pub fn roundup_power2_divisions_per_bucket(
        mut self,
        divisions: [usize; ROUNDUP_POWER2_BUCKETS],
    ) -> Self {
        self.config.roundup_power2_divisions = divisions;
        self
    }

    /// `garbage_collection_threshold`.
    pub fn garbage_collection_threshold(mut self, threshold: f64) -> Self {
        self.config.garbage_collection_threshold = threshold;
        self
    }

    /// `expandable_segments`.
    pub fn expandable_segments(mut self, on: bool) -> Self {
        self.config.expandable_segments = on;
        self
    }

    /// `per_process_memory_fraction`.
    pub fn memory_fraction(mut self, fraction: f64) -> Self {
        self.config.per_process_memory_fraction = fraction;
        self
    }

    /// `cca_large_page_size_mb`: the large pool's expandable page size.
    pub fn expandable_large_page_size_mb(mut self, mb: usize) -> Self {
        self.config.expandable_large_page_size = Some(whole_mib(mb));
        self
    }

    /// `cca_max_handle_size_mb`: the largest physical handle a growth creates.
    pub fn expandable_max_handle_size_mb(mut self, mb: usize) -> Self {
        self.config.expandable_max_handle_size = Some(whole_mib(mb));
        self
    }

    /// `cca_min_growth_mb`: the fewest bytes a growing expandable segment maps at once.
    pub fn expandable_min_growth_mb(mut self, mb: usize) -> Self {
        self.config.expandable_min_growth = whole_mib(mb);
        self
    }

    /// `cca_handle_per_growth`: one physical handle per growth.
    pub fn expandable_handle_per_growth(mut self, on: bool) -> Self {
        self.config.expandable_handle_per_growth = on;
        self
    }

    /// `cca_page_reuse`.
    pub fn page_reuse(mut self, reuse: PageReuse) -> Self {
        self.config.page_reuse = reuse;
        self
    }

    /// `cca_page_reuse_slack`.
    pub fn page_reuse_slack(mut self, slack: f64) -> Self {
        self.config.page_reuse_slack = slack;
        self
    }

    /// `cca_page_reuse_fence` (crate-specific): fence page reuse by events instead of stream
    /// synchronizations.
    pub fn page_reuse_fence(mut self, on: bool) -> Self {
        self.config.page_reuse_fence = on;
        self
    }

    /// `cca_page_lending` (crate-specific): let a growth lend free pages whose fence is pending
    /// (map them a second time, order by an event wait, unmap the old mapping later).
    pub fn page_lending(mut self, on: bool) -> Self {
        self.config.page_lending = on;
        self
    }

    /// `cca_unmap_helper` (crate-specific): unmap moved pages' old mappings on the backend's
    /// helper thread, when it has one. See [`AllocatorConfig::unmap_helper`].
    pub fn unmap_helper(mut self, on: bool) -> Self {
        self.config.unmap_helper = on;
        self
    }

    /// `cca_page_move_budget` (crate-specific): below the peak of allocated bytes, page reuse
    /// moves at most `budget` × the reserved pages before growths create instead (0 = no
    /// budget). See [`AllocatorConfig::page_move_budget`].
    pub fn page_move_budget(mut self, budget: u64) -> Self {
        self.config.page_move_budget = budget;
        self
    }

    /// `cca_precise_cap`.
    pub fn precise_fraction_cap(mut self, on: bool) -> Self {
        self.config.precise_fraction_cap = on;
        self
    }

    /// `throw_on_cudamalloc_oom`.
    pub fn throw_on_cudamalloc_oom(mut self, on: bool) -> Self {
        self.config.throw_on_cudamalloc_oom = on;
        self
    }

    /// `cca_fast_path` (crate-specific): per-thread front caches that serve cache hits without the
    /// global lock.
    pub fn fast_path(mut self, on: bool) -> Self {
        self.config.fast_path = on;
        self
    }

    /// `cca_cross_stream_reuse` (crate-specific): an allocation that finds no free block of its
    /// own stream takes a wholly free cached segment of another stream (ordered by an event
    /// wait) before the cache grows.
    pub fn cross_stream_reuse(mut self, on: bool) -> Self {
        self.config.cross_stream_reuse = on;
        self
    }

    /// `cca_borrow_blocks` (crate-specific): an allocation that finds no free block of its own
    /// stream borrows another stream's free large-pool block where it lies (one whose page fence
    /// has completed) before the cache grows. See [`AllocatorConfig::borrow_blocks`].
    pub fn borrow_blocks(mut self, on: bool) -> Self {
        self.config.borrow_blocks = on;
        self
    }

    /// Validates and returns the configuration.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad value.
    pub fn build(self) -> Result<AllocatorConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
