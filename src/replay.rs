//! The replay engine: runs a [`Trace`] through a [`CachingAllocator`] and reports what happened.
//!
//! It is the one interpreter shared by property tests, fuzzing, golden-trace tests, benches and
//! the CLI. On [`SimDevice`] it is fully deterministic (unless host timing is asked for).
//!
//! Timing a long replay: the loop makes no heap allocation, but it walks the trace's events and
//! a table of live ids (tens of megabytes for a long trace), so its wall time depends on the
//! program's heap. `cca` uses mimalloc, whose arenas sit in transparent huge pages: the recorded
//! `generate` trace replays at 57–60 ns per event there against 72–76 with glibc's heap (Note
//! [The tool's heap] in `src/bin/cca/main.rs`). A program timing replays does well to do the same.
//!
//! Note [Address-faithful replay]: PyTorch breaks best-fit ties by address, so where new segments
//! land changes later decisions. To reproduce a recorded run exactly, the simulated device is
//! asked to place each new segment where the recorded run had it: at the address of the
//! recorded `SegmentAlloc` that precedes the allocation (PyTorch snapshots), or, in a log without
//! segment events, at the recorded address of the allocation itself (which is the new segment's
//! base, since a split keeps the front of a block for the request). A hint is used once and only
//! if that range is free on the simulated device; otherwise the device picks a fresh address.
//!
//! May use: `allocator`, `trace`, `backend`, `int_hash`, `op_clock`.
#![forbid(unsafe_code)]

use crate::allocator::{CachingAllocator, FragmentationReport};
use crate::backend::sim::{SimCounters, SimDevice};
use crate::backend::{DeviceAddr, DeviceBackend, StreamId};
use crate::error::{AllocError, OomVerdict};
use crate::int_hash::IntMap;
use crate::op_clock::{OpClock, OpTimes, Sampler};
use crate::stats::MemoryStats;
use crate::trace::{Trace, TraceOp};

/// How a replay places new segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// Put new segments where the recorded run had them (see Note [Address-faithful replay]).
    #[default]
    AddressFaithful,
    /// Let the device choose (fresh increasing addresses on `SimDevice`).
    Fresh,
}

/// Replay options.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Segment placement.
    pub placement: Placement,
    /// Measure host time per operation (makes results timing-dependent; off by default).
    pub timing: bool,
    /// With `timing`: time one operation in this many, at pseudo-random gaps that are the same
    /// in every run (0 or 1: every operation). The untimed operations run without a clock read
    /// around them; [`LatencySummary`] then describes the timed sample and says its size (see
    /// Note [Sampled op times] in `op_clock.rs`).
    pub time_one_in: u32,
    /// Stop at the first out-of-memory error instead of counting it and going on.
    pub stop_on_oom: bool,
    /// Run the invariant checker after every event (slow; for tests).
    pub check_invariants: bool,
}

/// Host time per operation, in nanoseconds, over the timed operations (all of them, or the
/// sample [`ReplayOptions::time_one_in`] asks for).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencySummary {
    /// Operations timed.
    pub timed_ops: u64,
    /// Mean.
    pub mean_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Maximum (of the timed operations: with a sample, a lower bound of the run's).
    pub max_ns: u64,
}

/// What a replay measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayReport {
    /// Events in the trace.
    pub events: usize,
    /// Allocation events.
    pub allocs: usize,
    /// Free events.
    pub frees: usize,
    /// Largest sum of requested bytes of live allocations.
    pub peak_live_bytes: u64,
    /// Peak `allocated_bytes.all` (rounded sizes).
    pub peak_allocated_bytes: u64,
    /// Peak `reserved_bytes.all`.
    pub peak_reserved_bytes: u64,
    /// Largest number of segments at once.
    pub segment_count_peak: u64,
    /// Device allocations (`num_device_alloc`).
    pub num_device_alloc: u64,
    /// Device frees (`num_device_free`).
    pub num_device_free: u64,
    /// Out-of-memory errors met.
    pub num_ooms: u64,
    /// Allocations that needed the final flush-and-retry.
    pub num_alloc_retries: u64,
    /// Cached segments handed from one stream to another (`cca_cross_stream_reuse`;
    /// [`CachingAllocator::cross_stream_handovers`] at the end).
    pub cross_stream_handovers: u64,
    /// Runs of pending pages lent to a growth (`cca_page_lending`;
    /// [`CachingAllocator::page_loans`] at the end).
    pub page_loans: u64,
    /// Old mappings of moved pages handed to the backend's unmap helper (`cca_unmap_helper`;
    /// [`CachingAllocator::unmaps_handed_off`] at the end; 0 on a backend without a helper).
    pub unmaps_handed_off: u64,
    /// Allocations that borrowed another stream's idle free block (`cca_borrow_blocks`;
    /// [`CachingAllocator::blocks_borrowed`] at the end).
    pub blocks_borrowed: u64,
    /// Allocations that failed out of memory and were skipped (with `stop_on_oom` off). This
    /// counts every such failure, also those PyTorch's `num_ooms` leaves out (a request of 1 EB
    /// or more is refused before the allocator tries).
    pub failed_allocs: usize,
    /// Frees skipped because their allocation had failed.
    pub skipped_frees: usize,
    /// The failed allocations of `failed_allocs` that the allocator refused with an
    /// out-of-memory report, by its verdict (what stopped each one).
    pub oom_verdicts: OomVerdictCounts,
    /// Host time per alloc/free, when measured.
    pub latency: Option<LatencySummary>,
    /// All statistics at the moment reserved bytes peaked.
    pub stats_at_peak: MemoryStats,
    /// The fragmentation report at the moment reserved bytes peaked (first reached).
    pub fragmentation_at_peak: FragmentationReport,
    /// All statistics at the end.
    pub final_stats: MemoryStats,
    /// Device calls of each kind during the replay, as [`SimCounters::call_counts`] names them;
    /// empty unless the replay ran on a [`SimDevice`] (see [`ReplayReport::add_device_cost`]).
    pub device_calls: Vec<(&'static str, u64)>,
    /// The simulated device's modeled time for those calls, in nanoseconds (Note [Device-time
    /// model] in `backend/sim/costs.rs`); `None` unless the replay ran on a [`SimDevice`].
    pub modeled_device_ns: Option<u64>,
    /// Of [`modeled_device_ns`](Self::modeled_device_ns), the time of the unmap helper's jobs
    /// (`SimDevice::set_unmap_helper`, `cca_unmap_helper`): off the allocating thread. `None`
    /// unless the replay ran on a [`SimDevice`].
    pub modeled_helper_ns: Option<u64>,
}

/// Out-of-memory failures of a replay by the allocator's verdict ([`OomVerdict`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OomVerdictCounts {
    /// [`OomVerdict::DeviceFull`].
    pub device_full: u64,
    /// [`OomVerdict::FractionCapReached`].
    pub fraction_cap_reached: u64,
    /// [`OomVerdict::Fragmented`].
    pub fragmented: u64,
    /// [`OomVerdict::LargerThanDevice`].
    pub larger_than_device: u64,
    /// [`OomVerdict::CachedForOtherStreams`].
    pub cached_for_other_streams: u64,
}

impl OomVerdictCounts {
    /// Counts one failure of verdict `v`.
    pub fn add(&mut self, v: OomVerdict) {
        match v {
            OomVerdict::DeviceFull => self.device_full += 1,
            OomVerdict::FractionCapReached => self.fraction_cap_reached += 1,
            OomVerdict::Fragmented => self.fragmented += 1,
            OomVerdict::LargerThanDevice => self.larger_than_device += 1,
            OomVerdict::CachedForOtherStreams => self.cached_for_other_streams += 1,
        }
    }

    /// All the failures counted.
    pub fn total(&self) -> u64 {
        self.device_full
            + self.fraction_cap_reached
            + self.fragmented
            + self.larger_than_device
            + self.cached_for_other_streams
    }
}

impl ReplayReport {
    /// Fills [`device_calls`](Self::device_calls),
    /// [`modeled_device_ns`](Self::modeled_device_ns) and
    /// [`modeled_helper_ns`](Self::modeled_helper_ns) from a simulated device's counters taken
    /// before and after the replay.
    pub fn add_device_cost(&mut self, before: &SimCounters, after: &SimCounters) {
        self.device_calls = after
            .call_counts()
            .iter()
            .zip(before.call_counts())
            .map(|(&(name, a), (_, b))| (name, a.saturating_sub(b)))
            .collect();
        self.modeled_device_ns = Some(
            after
                .modeled_device_ns
                .saturating_sub(before.modeled_device_ns),
        );
        self.modeled_helper_ns = Some(
            after
                .modeled_helper_ns
                .saturating_sub(before.modeled_helper_ns),
        );
    }

    /// The count of device calls of kind `name` (a [`SimCounters::call_counts`] name); 0 when
    /// unknown or not measured.
    pub fn device_call(&self, name: &str) -> u64 {
        self.device_calls
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |&(_, c)| c)
    }

    /// Peak reserved ÷ peak live bytes (1.0 is the floor); 0 for an empty trace.
    pub fn reserved_over_live(&self) -> f64 {
        if self.peak_live_bytes == 0 {
            0.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_live_bytes as f64
        }
    }

    /// The fragmentation ratio: `1 - peak allocated / peak reserved` (GMLake's and STWeaver's),
    /// the two peaks taken wherever each was reached. The fragmentation at the moment reserved
    /// bytes peaked is another figure: the field
    /// [`fragmentation_at_peak`](Self::fragmentation_at_peak)'s
    /// [`fragmentation()`](FragmentationReport::fragmentation).
    pub fn fragmentation_ratio(&self) -> f64 {
        if self.peak_reserved_bytes == 0 {
            0.0
        } else {
            1.0 - self.peak_allocated_bytes as f64 / self.peak_reserved_bytes as f64
        }
    }
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A `Free` names an id with no live allocation.
    #[error("event {index}: free of allocation id {id}, which is not live")]
    UnknownId {
        /// Event index (from 0).
        index: usize,
        /// The id.
        id: u64,
    },
    /// An `Alloc` reuses an id that is still live.
    #[error("event {index}: allocation id {id} is already live")]
    DuplicateId {
        /// Event index.
        index: usize,
        /// The id.
        id: u64,
    },
    /// The allocator failed (out of memory with `stop_on_oom`, or a device error).
    #[error("event {index}: {source}")]
    Allocator {
        /// Event index.
        index: usize,
        /// The error.
        #[source]
        source: AllocError,
    },
    /// The invariant checker found a violation.
    #[error("event {index}: invariant violated: {violation}")]
    Invariant {
        /// Event index.
        index: usize,
        /// The violation.
        violation: crate::allocator::InvariantViolation,
    },
}

/// Replays `trace` on `alloc`. `hint` receives placement hints (see
/// Note [Address-faithful replay]); pass `None` for a device that cannot place segments.
///
/// # Errors
/// A [`ReplayError`] naming the event index.
pub fn replay_with<B: DeviceBackend>(
    alloc: &CachingAllocator<B>,
    trace: &Trace,
    opts: &ReplayOptions,
    hint: Option<&dyn Fn(Option<u64>)>,
) -> Result<ReplayReport, ReplayError> {
    replay_loop(alloc, trace, opts, hint, None)
}

/// Like [`replay_with`], calling `observer(event index, live requested bytes, allocator)` after
/// every event (for progress bars and timelines). The observer reads what it needs, e.g.
/// [`CachingAllocator::memory_reserved`] and [`CachingAllocator::memory_allocated`]; the loop
/// itself reads no statistics after a free.
///
/// # Errors
/// A [`ReplayError`] naming the event index.
pub fn replay_observed<B: DeviceBackend>(
    alloc: &CachingAllocator<B>,
    trace: &Trace,
    opts: &ReplayOptions,
    hint: Option<&dyn Fn(Option<u64>)>,
    observer: &mut dyn FnMut(usize, u64, &CachingAllocator<B>),
) -> Result<ReplayReport, ReplayError> {
    replay_loop(alloc, trace, opts, hint, Some(observer))
}

/// What [`replay_observed`] calls after every event.
type Observer<'a, B> = &'a mut dyn FnMut(usize, u64, &CachingAllocator<B>);

/// The loop of [`replay_with`] and [`replay_observed`].
///
/// Note [Lean replay loop]: reserved bytes and the segment count rise only inside an
/// allocation (a free, `empty_cache` and a fraction change never raise them), so the loop reads
/// them, under one lock and without copying the statistics, only after an `Alloc` event; the
/// full statistics and the fragmentation report are taken only at a new reserved peak. Live
/// trace ids sit in a table indexed by id ([`LiveIds`]; ids beyond the trace's length in a map
/// with the integer hasher of `int_hash`), a placement hint is cleared only when one may be pending,
/// and host times are read from the cheap clock of `op_clock` (Note [Op clock]), around the
/// operations its sampler picks (Note [Sampled op times]).
// Out of line: callgrind's `--toggle-collect='*replay_loop*'` measures the loop by this name.
#[inline(never)]
fn replay_loop<B: DeviceBackend>(
    alloc: &CachingAllocator<B>,
    trace: &Trace,
    opts: &ReplayOptions,
    hint: Option<&dyn Fn(Option<u64>)>,
    mut observer: Option<Observer<'_, B>>,
) -> Result<ReplayReport, ReplayError> {
    let has_segment_events = trace
        .events
        .iter()
        .any(|e| matches!(e.op, TraceOp::SegmentAlloc { .. }));
    let faithful = opts.placement == Placement::AddressFaithful && hint.is_some();
    // Whether a placement hint may be pending on the device (set and not yet cleared).
    let mut hint_pending = true;
    let mut set_hint = |a: Option<u64>| {
        if let Some(h) = hint {
            if a.is_some() || hint_pending {
                h(a);
            }
            hint_pending = a.is_some();
        }
    };
    let mut live = LiveIds::new(trace.events.len());
    let mut failed: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut report = ReplayReport {
        events: trace.events.len(),
        ..ReplayReport::default()
    };
    let mut live_bytes: u64 = 0;
    let clock = opts.timing.then(OpClock::start);
    let mut times = if opts.timing {
        OpTimes::new()
    } else {
        OpTimes::default()
    };
    let mut sampler = Sampler::one_in(opts.time_one_in);
    // Whether to time the next operation: with a clock, when the sampler picks it.
    let mut timed = move || clock.filter(|_| sampler.next());
    let (mut peak_reserved, mut peak_segments) = (0i64, 0i64);
    note_peak(alloc, &mut report, &mut peak_reserved, &mut peak_segments);

    for (index, ev) in trace.events.iter().enumerate() {
        match &ev.op {
            TraceOp::Alloc {
                id,
                size,
                stream,
                addr,
            } => {
                report.allocs += 1;
                if live.contains(*id) {
                    return Err(ReplayError::DuplicateId { index, id: *id });
                }
                if faithful && !has_segment_events {
                    set_hint(*addr);
                }
                let c = timed();
                let t0 = c.map(|c| c.ticks());
                let r = alloc.allocate(*size as usize, StreamId(*stream));
                if let (Some(c), Some(t0)) = (c, t0) {
                    times.push(c.ticks().saturating_sub(t0));
                }
                if faithful {
                    set_hint(None);
                }
                match r {
                    Ok(a) => {
                        live.insert(*id, (a.ptr, *size));
                        live_bytes += size;
                        report.peak_live_bytes = report.peak_live_bytes.max(live_bytes);
                    }
                    Err(e) if e.is_out_of_memory() && !opts.stop_on_oom => {
                        if let Some(oom) = e.oom_report() {
                            report.oom_verdicts.add(oom.verdict);
                        }
                        report.failed_allocs += 1;
                        failed.insert(*id);
                    }
                    Err(source) => return Err(ReplayError::Allocator { index, source }),
                }
                note_peak(alloc, &mut report, &mut peak_reserved, &mut peak_segments);
            }
            TraceOp::Free { id } => {
                report.frees += 1;
                let Some((ptr, size)) = live.remove(*id) else {
                    if failed.remove(id) {
                        report.skipped_frees += 1;
                        continue;
                    }
                    return Err(ReplayError::UnknownId { index, id: *id });
                };
                let c = timed();
                let t0 = c.map(|c| c.ticks());
                let r = alloc.free(ptr);
                if let (Some(c), Some(t0)) = (c, t0) {
                    times.push(c.ticks().saturating_sub(t0));
                }
                r.map_err(|source| ReplayError::Allocator { index, source })?;
                live_bytes -= size;
            }
            TraceOp::EmptyCache => {
                alloc
                    .empty_cache()
                    .map_err(|source| ReplayError::Allocator { index, source })?;
            }
            TraceOp::SetFraction { fraction } => {
                alloc
                    .set_memory_fraction(*fraction)
                    .map_err(|source| ReplayError::Allocator { index, source })?;
            }
            TraceOp::SegmentAlloc { addr, .. } => {
                if faithful {
                    set_hint(Some(*addr));
                }
            }
            TraceOp::SegmentFree { .. }
            | TraceOp::SegmentMap { .. }
            | TraceOp::SegmentUnmap { .. } => {}
        }
        if let Some(observe) = observer.as_mut() {
            observe(index, live_bytes, alloc);
        }
        if opts.check_invariants {
            alloc
                .check_invariants()
                .map_err(|violation| ReplayError::Invariant { index, violation })?;
        }
    }
    let st = alloc.memory_stats();
    report.peak_allocated_bytes = st.max_memory_allocated().max(0) as u64;
    report.peak_reserved_bytes = st.max_memory_reserved().max(0) as u64;
    report.segment_count_peak = peak_segments.max(0) as u64;
    report.num_device_alloc = st.num_device_alloc as u64;
    report.num_device_free = st.num_device_free as u64;
    report.num_ooms = st.num_ooms as u64;
    report.num_alloc_retries = st.num_alloc_retries as u64;
    report.cross_stream_handovers = alloc.cross_stream_handovers();
    report.page_loans = alloc.page_loans();
    report.unmaps_handed_off = alloc.unmaps_handed_off();
    report.blocks_borrowed = alloc.blocks_borrowed();
    report.final_stats = st;
    if let Some(c) = clock {
        report.latency = times.summary(c.ns_per_tick()).map(|t| LatencySummary {
            timed_ops: t.count,
            mean_ns: t.mean_ns,
            p50_ns: t.p50_ns,
            p99_ns: t.p99_ns,
            max_ns: t.max_ns,
        });
    }
    Ok(report)
}

/// Raises the segment peak, and at a new reserved peak takes the statistics and the
/// fragmentation report (Note [Lean replay loop]; the common case is two atomic loads and two
/// comparisons, in line).
#[inline(always)]
fn note_peak<B: DeviceBackend>(
    alloc: &CachingAllocator<B>,
    report: &mut ReplayReport,
    peak_reserved: &mut i64,
    peak_segments: &mut i64,
) {
    let (reserved, segments) = alloc.reserved_and_segments();
    *peak_segments = (*peak_segments).max(segments);
    if reserved > *peak_reserved {
        *peak_reserved = reserved;
        take_peak(alloc, report);
    }
}

/// The statistics and the fragmentation report at a new reserved peak.
#[cold]
#[inline(never)]
fn take_peak<B: DeviceBackend>(alloc: &CachingAllocator<B>, report: &mut ReplayReport) {
    report.stats_at_peak = alloc.memory_stats();
    report.fragmentation_at_peak = alloc.fragmentation();
}

/// The live allocations of a replay by trace id: `(address, requested size)`.
///
/// Importers number allocations from 0 in event order, so a trace's ids are below its length
/// and mostly come in increasing order: those sit in a table indexed by id that grows at its end
/// (no hashing, and no memory touched beyond the ids seen), any other id in a hash map.
struct LiveIds {
    /// Entry `id`: `[address, requested size]`, or `[_, NOT_LIVE]`.
    table: Vec<[u64; 2]>,
    /// Ids from `limit` on (and any allocation of `NOT_LIVE` bytes, which none can be).
    sparse: IntMap<(DeviceAddr, u64)>,
    limit: usize,
}

/// The size of a table entry whose id is not live.
const NOT_LIVE: u64 = u64::MAX;

impl LiveIds {
    fn new(events: usize) -> Self {
        LiveIds {
            table: Vec::with_capacity((events / 2).saturating_add(4096)),
            sparse: IntMap::default(),
            limit: events.saturating_add(1024),
        }
    }

    /// The table index of `id`, when the table may hold it.
    #[inline]
    fn index(&self, id: u64) -> Option<usize> {
        usize::try_from(id).ok().filter(|&i| i < self.limit)
    }

    #[inline]
    fn contains(&self, id: u64) -> bool {
        let in_table = self
            .index(id)
            .and_then(|i| self.table.get(i))
            .is_some_and(|e| e[1] != NOT_LIVE);
        in_table || (!self.sparse.is_empty() && self.sparse.contains_key(&id))
    }

    #[inline]
    fn insert(&mut self, id: u64, (addr, size): (DeviceAddr, u64)) {
        match self.index(id) {
            Some(i) if size != NOT_LIVE => {
                if i >= self.table.len() {
                    self.table.resize(i, [0, NOT_LIVE]);
                    self.table.push([addr.0, size]);
                } else if let Some(e) = self.table.get_mut(i) {
                    *e = [addr.0, size];
                }
            }
            _ => {
                self.sparse.insert(id, (addr, size));
            }
        }
    }

    #[inline]
    fn remove(&mut self, id: u64) -> Option<(DeviceAddr, u64)> {
        let entry = self.index(id).and_then(|i| self.table.get_mut(i));
        if let Some(e) = entry.filter(|e| e[1] != NOT_LIVE) {
            let [addr, size] = *e;
            e[1] = NOT_LIVE;
            return Some((DeviceAddr(addr), size));
        }
        if self.sparse.is_empty() {
            None
        } else {
            self.sparse.remove(&id)
        }
    }
}

/// Replays `trace` on an allocator over a [`SimDevice`], honouring `opts.placement`, and reports
/// the device calls the replay made and their modeled time
/// ([`ReplayReport::device_calls`], [`ReplayReport::modeled_device_ns`]).
///
/// ```
/// use cuda_caching_allocator::{replay, AllocatorConfig, CachingAllocator, ReplayOptions, SimDevice};
/// use cuda_caching_allocator::trace::{Trace, TraceOp, TraceSource};
/// let mut t = Trace::new(TraceSource::Synthetic);
/// t.push(TraceOp::Alloc { id: 1, size: 3 << 20, stream: 0, addr: None });
/// t.push(TraceOp::Free { id: 1 });
/// let alloc = CachingAllocator::new(SimDevice::default(), AllocatorConfig::pytorch()).unwrap();
/// let r = replay(&alloc, &t, &ReplayOptions::default()).unwrap();
/// assert_eq!(r.peak_reserved_bytes, 20 << 20);
/// assert_eq!(r.device_call("allocate"), 1);
/// assert!(r.modeled_device_ns.is_some_and(|ns| ns > 0));
/// ```
///
/// # Errors
/// A [`ReplayError`] naming the event index.
pub fn replay(
    alloc: &CachingAllocator<SimDevice>,
    trace: &Trace,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let dev = alloc.backend();
    let hint = |a: Option<u64>| match a {
        Some(addr) => dev.place_next_at(addr),
        None => dev.clear_placement_hint(),
    };
    let before = dev.counters();
    let mut report = replay_with(alloc, trace, opts, Some(&hint))?;
    report.add_device_cost(&before, &dev.counters());
    Ok(report)
}
