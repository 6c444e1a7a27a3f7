//! `SimDevice`: a deterministic simulated device that never touches real memory.
//!
//! It hands out disjoint address ranges from a configurable capacity, counts every call, tracks
//! reserved bytes and their peak, models events on simulated streams and virtual memory (address
//! reservations, physical pages, map/unmap), and injects faults on demand: fail the Nth device
//! call, fail every allocation above a size, report a chosen free figure.
//!
//! Streams are counters of submitted and completed units of work ([`SimDevice::submit_work`],
//! [`SimDevice::complete_work`]). An event completes once its stream has completed the work
//! submitted before it was recorded; [`stream_wait_event`](DeviceBackend::stream_wait_event)
//! makes the waiting stream depend on that point of the recorded stream (completing the waiting
//! stream's later work completes it too), and every wait is logged for tests
//! ([`SimDevice::stream_waits`]).
//!
//! Queued *uses* of memory are modelled too: [`SimDevice::use_range`] queues one unit of work on
//! a stream that reads or writes a device range. The device itself then checks the cache's
//! safety rule (`DESIGN.md` rule 3, Note [Queued uses] in `uses.rs`) wherever memory is taken away
//! (`free` of a segment, `unmap` of pages) and, through [`SimDevice::check_handout`], wherever
//! the cache hands memory out; every breach is logged as a [`SimViolation`]
//! ([`SimDevice::violations`]).
//!
//! Placement is deterministic: by default each new range goes at the lowest free address at or
//! above a moving cursor ("fresh addresses"); [`SimDevice::place_next_at`] asks for the next
//! segment at a given address instead, which trace replay uses to put segments exactly where the
//! recorded run had them (see Note [Address-faithful replay] in `replay.rs`).
//!
//! Graph capture is modelled too ([`SimDevice::begin_capture`] / [`SimDevice::end_capture`],
//! [`DeviceBackend::stream_capture_id`]): a stream that waits on an event recorded in a capture
//! joins it, and every call that CUDA would refuse, or that would invalidate the capture, while a
//! capture in [`SimCaptureMode::Global`] is underway is logged as a [`SimCaptureViolation`]
//! (synchronizations, event queries, frees, unmaps and releases; allocation and map calls unless
//! made in relaxed mode, which this device does by default, as `CudaDevice` does).
//!
//! Every call is priced by a device-time model ([`SimCosts`] in [`SimConfig::costs`]; Note
//! [Device-time model] in `costs.rs`): [`SimCounters::modeled_device_ns`] is the total so far, and
//! [`SimCounters::call_counts`] the count of each kind of call.
//!
//! No clocks, no randomness, no hash-order: any run replays exactly. May use: `backend`.
//!
//! The parts live beside this file: `costs` (the device-time model and the counters), `uses`
//! (the hazard log: Note [Queued uses]), `capture` (graph capture), `tests`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use parking_lot::Mutex;

mod capture;
mod costs;
mod uses;

use capture::CaptureClass;
pub use capture::{SimCaptureMode, SimCaptureViolation};
pub use costs::{SimCosts, SimCounters};
use uses::OpenWait;
pub use uses::{SimStreamWait, SimUse, SimViolation, SimViolationKind};

use super::{
    BackendError, DeviceAddr, DeviceBackend, EventHandle, FinishedUnmaps, MemInfo, PhysicalHandle,
    StreamId,
};

/// What an injected fault looks like to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The call answers [`BackendError::OutOfMemory`] (the cache's retry path runs).
    OutOfMemory,
    /// The call answers [`BackendError::Injected`] (an error the cache passes on).
    Error,
}

/// An event call that [`SimDevice::fail_next_event_call`] can make fail. Event calls are not
/// numbered with the device calls [`SimDevice::fail_call`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimEventCall {
    /// `create_event`.
    Create,
    /// `record_event`.
    Record,
    /// `stream_wait_event`.
    StreamWait,
}

impl SimEventCall {
    fn operation(self) -> &'static str {
        match self {
            SimEventCall::Create => "create_event",
            SimEventCall::Record => "record_event",
            SimEventCall::StreamWait => "stream_wait_event",
        }
    }
}

/// Static description of a simulated device.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device memory in bytes (segments plus physical pages may not exceed it).
    pub capacity: usize,
    /// Alignment of every returned address; a power of two.
    pub alignment: usize,
    /// Virtual-memory page granularity (`None`: no virtual-memory support).
    pub vm_granularity: Option<usize>,
    /// The lowest address handed out; non-zero.
    pub base_address: u64,
    /// Device ordinal reported to the cache.
    pub device_index: usize,
    /// What each call costs in the device-time model (see [`SimCosts`]).
    pub costs: SimCosts,
}

impl Default for SimConfig {
    /// 80 GiB, 512-byte alignment, 2 MiB virtual-memory pages, addresses from `0x7f00_0000_0000`,
    /// the H100 call costs of [`SimCosts::default`].
    fn default() -> Self {
        SimConfig {
            capacity: 80 << 30,
            alignment: 512,
            vm_granularity: Some(2 << 20),
            base_address: 0x7f00_0000_0000,
            device_index: 0,
            costs: SimCosts::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RangeKind {
    Segment,
    Reservation,
}

#[derive(Debug)]
struct Inner {
    config: SimConfig,
    /// Live address ranges: start → (size, kind). Disjoint.
    ranges: BTreeMap<u64, (usize, RangeKind)>,
    cursor: u64,
    hint: Option<u64>,
    /// Physical handles: id → size.
    physical: BTreeMap<u64, usize>,
    next_physical: u64,
    /// Mappings: va → (size, handle).
    mappings: BTreeMap<u64, (usize, u64)>,
    /// Handles whose export the cache let go of (`release_export`), in order.
    released_exports: Vec<u64>,
    /// Live mappings per physical handle (absent: none), so `release_physical` checks "still
    /// mapped" without scanning every mapping.
    maps_of_handle: BTreeMap<u64, u32>,
    /// Devices added with `add_peer`.
    peers: Vec<usize>,
    /// Per mapping (by address), the peer devices granted access to it.
    peer_access: BTreeMap<u64, Vec<usize>>,
    counters: SimCounters,
    fail_calls: BTreeMap<u64, FaultKind>,
    fail_above: Option<usize>,
    reported_free: Option<usize>,
    rejected_streams: BTreeSet<StreamId>,
    /// Per stream: (work submitted, work completed).
    streams: BTreeMap<StreamId, (u64, u64)>,
    /// Live events: id → recorded (stream, submitted count, order of the record), or `None` if
    /// never recorded.
    events: BTreeMap<u64, Option<(StreamId, u64, u64)>>,
    next_event: u64,
    /// Order of records and waits.
    seq: u64,
    /// Every successful `stream_wait_event`, in order, with its ordering numbers.
    wait_log: Vec<OpenWait>,
    /// Waits whose recorded point is not known to have completed.
    open_waits: Vec<OpenWait>,
    /// Event calls made to fail next, one each.
    fail_events: Vec<SimEventCall>,
    /// Synchronize calls (`synchronize`, `synchronize_stream`) made to fail next.
    fail_syncs: u64,
    /// Queued uses not yet known to be complete.
    uses: Vec<SimUse>,
    /// Every breach of the safety rule seen, in order.
    violations: Vec<SimViolation>,
    /// Streams taking part in a capture: stream → (capture id, mode, origin stream).
    captures: BTreeMap<StreamId, (u64, SimCaptureMode, StreamId)>,
    /// Events recorded in a capture: event → capture id.
    captured_events: BTreeMap<u64, u64>,
    last_capture: u64,
    /// Allocation and map calls, and queries and waits outside a capture, are made in relaxed
    /// capture mode (as `CudaDevice` does).
    relaxed_allocation_calls: bool,
    capture_violations: Vec<SimCaptureViolation>,
    /// Queries an event recorded from now on answers "not complete" first
    /// ([`SimDevice::set_event_query_lag`]).
    query_lag: u32,
    /// Per event: lagging queries left.
    lag_left: BTreeMap<u64, u32>,
    /// Whether the device has an unmap helper ([`SimDevice::set_unmap_helper`]).
    unmap_helper: bool,
    /// Queued unmap jobs, in order.
    unmap_jobs: VecDeque<UnmapJob>,
    /// Jobs that ran and were not yet reported.
    unmap_done: Vec<FinishedUnmaps>,
    /// The next job's ticket.
    next_ticket: u64,
}

/// A job of the simulated unmap helper: its ticket, the ranges (address, bytes) to unmap in
/// order, and the incomplete uses of its ranges logged when it was queued (not logged twice
/// when it runs).
type UnmapJob = (u64, Vec<(u64, usize)>, Vec<SimUse>);

/// A deterministic simulated device. See the module documentation.
///
/// ```
/// use cuda_caching_allocator::{DeviceBackend, SimDevice, StreamId};
/// let sim = SimDevice::with_capacity(64 << 20);
/// let p = sim.allocate(2 << 20, StreamId::DEFAULT).unwrap();
/// assert_eq!(sim.counters().reserved_bytes, 2 << 20);
/// // SAFETY: `p` came from `allocate` above with this size and no work uses it.
/// unsafe { sim.free(p, 2 << 20, StreamId::DEFAULT).unwrap() };
/// assert_eq!(sim.counters().live_segments, 0);
/// ```
#[derive(Debug)]
pub struct SimDevice {
    inner: Mutex<Inner>,
}

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice::new(SimConfig::default())
    }
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align).saturating_mul(align)
}

impl Inner {
    /// `Err` for a stream the device was told to reject ([`SimDevice::reject_stream`]): every
    /// call on a stream checks it, as the CUDA backend checks its admitted streams.
    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        if self.rejected_streams.contains(&stream) {
            return Err(BackendError::InvalidStream {
                stream,
                reason: "rejected by the simulated device".into(),
            });
        }
        Ok(())
    }

    fn overlaps(&self, start: u64, size: usize) -> Option<u64> {
        let end = start.saturating_add(size as u64);
        // The last range starting before `end` is the only candidate that can overlap.
        let (&s, &(len, _)) = self.ranges.range(..end).next_back()?;
        if s + len as u64 > start {
            Some(s + len as u64)
        } else {
            None
        }
    }

    /// An aligned free address range of `size` bytes: the hint if it fits, else the first gap
    /// at or above the cursor, else (the address space above it used up) the first gap above
    /// `base_address`. `None` when no gap is left; the cursor moves only on success.
    fn place(&mut self, size: usize, use_hint: bool) -> Option<u64> {
        let align = self.config.alignment.max(1) as u64;
        if use_hint {
            if let Some(h) = self.hint.take() {
                if h != 0
                    && h % align == 0
                    && h.checked_add(size as u64).is_some()
                    && self.overlaps(h, size).is_none()
                {
                    return Some(h);
                }
            }
        }
        let base = self.config.base_address.max(1);
        let at = self
            .first_gap(self.cursor.max(base), size, align)
            .or_else(|| self.first_gap(base, size, align))?;
        self.cursor = at.checked_add(size as u64)?;
        Some(at)
    }

    /// The first aligned start at or above `from` where `size` bytes overlap no live range and
    /// end below 2^64 (checked arithmetic throughout).
    fn first_gap(&self, from: u64, size: usize, align: u64) -> Option<u64> {
        let mut at = align_up(from, align);
        loop {
            at.checked_add(size as u64)?;
            match self.overlaps(at, size) {
                Some(end) => at = align_up(end, align),
                None => return Some(at),
            }
        }
    }

    fn next_call(&mut self, size: Option<usize>) -> Result<(), (u64, FaultKind)> {
        self.counters.device_calls += 1;
        let n = self.counters.device_calls;
        if let Some(kind) = self.fail_calls.remove(&n) {
            return Err((n, kind));
        }
        if let (Some(limit), Some(size)) = (self.fail_above, size) {
            if size > limit {
                return Err((n, FaultKind::OutOfMemory));
            }
        }
        Ok(())
    }

    fn used(&self) -> usize {
        self.counters.reserved_bytes
    }

    /// Fails the call if a fault of this kind is pending; `count` is the calls of this kind so far.
    fn event_fault(&mut self, call: SimEventCall, count: u64) -> Result<(), BackendError> {
        match self.fail_events.iter().position(|&c| c == call) {
            Some(i) => {
                self.fail_events.remove(i);
                Err(BackendError::Injected {
                    operation: call.operation(),
                    call: count + 1,
                })
            }
            None => Ok(()),
        }
    }

    /// Fails a synchronize call if one was armed.
    fn sync_fault(&mut self, operation: &'static str) -> Result<(), BackendError> {
        if self.fail_syncs == 0 {
            return Ok(());
        }
        self.fail_syncs -= 1;
        Err(BackendError::Injected {
            operation,
            call: self.counters.synchronize_calls,
        })
    }

    /// Refuses `operation` of `size` bytes unless the device has virtual memory and `size` is a
    /// positive multiple of its granularity.
    fn check_granular(&self, operation: &'static str, size: usize) -> Result<(), BackendError> {
        let Some(gran) = self.config.vm_granularity else {
            return Err(BackendError::Unsupported("virtual memory"));
        };
        if size == 0 || size % gran != 0 {
            return Err(BackendError::InvalidArgument {
                operation,
                reason: format!("size {size} is not a positive multiple of {gran}"),
            });
        }
        Ok(())
    }

    /// Whether `size` more bytes fit in the capacity.
    fn fits(&self, size: usize) -> bool {
        self.used().saturating_add(size) <= self.config.capacity
    }

    /// Adds one call's modeled time (the cost `pick` selects) to the total.
    fn bill(&mut self, pick: fn(&SimCosts) -> u64) {
        let ns = pick(&self.config.costs);
        self.counters.modeled_device_ns = self.counters.modeled_device_ns.saturating_add(ns);
    }

    fn charge(&mut self, size: usize) -> bool {
        if !self.fits(size) {
            return false;
        }
        self.counters.reserved_bytes += size;
        self.counters.peak_reserved_bytes = self
            .counters
            .peak_reserved_bytes
            .max(self.counters.reserved_bytes);
        true
    }
}

fn fault(operation: &'static str, (call, kind): (u64, FaultKind)) -> BackendError {
    match kind {
        FaultKind::OutOfMemory => BackendError::OutOfMemory,
        FaultKind::Error => BackendError::Injected { operation, call },
    }
}

impl SimDevice {
    /// The most physical handles ([`create_physical`](DeviceBackend::create_physical)) the
    /// simulated device holds at once: 2,097,152, 4 TiB of 2 MiB pages (a real GPU's memory is
    /// well under 100,000 of them). Note [Handle limit]: each handle costs the simulator host
    /// memory and time, so a growth of expandable segments on a huge simulated device (a 2^59
    /// byte request with `capacity` near 2^62) would otherwise create handles for hours and
    /// exhaust the host's memory; the call past the limit fails with
    /// [`BackendError::Unsupported`] instead (not `OutOfMemory`: a larger capacity does not
    /// help), which stops a replay with an error naming the event, after a few seconds.
    pub const MAX_PHYSICAL_HANDLES: usize = 1 << 21;

    /// A simulated device with the given configuration.
    pub fn new(config: SimConfig) -> Self {
        let cursor = config.base_address.max(1);
        SimDevice {
            inner: Mutex::new(Inner {
                config,
                ranges: BTreeMap::new(),
                cursor,
                hint: None,
                physical: BTreeMap::new(),
                next_physical: 1,
                mappings: BTreeMap::new(),
                released_exports: Vec::new(),
                peers: Vec::new(),
                peer_access: BTreeMap::new(),
                maps_of_handle: BTreeMap::new(),
                counters: SimCounters::default(),
                fail_calls: BTreeMap::new(),
                fail_above: None,
                reported_free: None,
                rejected_streams: BTreeSet::new(),
                streams: BTreeMap::new(),
                events: BTreeMap::new(),
                next_event: 1,
                seq: 0,
                wait_log: Vec::new(),
                open_waits: Vec::new(),
                fail_events: Vec::new(),
                fail_syncs: 0,
                uses: Vec::new(),
                violations: Vec::new(),
                captures: BTreeMap::new(),
                captured_events: BTreeMap::new(),
                last_capture: 0,
                relaxed_allocation_calls: true,
                capture_violations: Vec::new(),
                query_lag: 0,
                lag_left: BTreeMap::new(),
                unmap_helper: false,
                unmap_jobs: VecDeque::new(),
                unmap_done: Vec::new(),
                next_ticket: 1,
            }),
        }
    }

    /// A simulated device of `capacity` bytes, other settings default.
    pub fn with_capacity(capacity: usize) -> Self {
        SimDevice::new(SimConfig {
            capacity,
            ..SimConfig::default()
        })
    }

    /// The configuration this device was built with.
    pub fn config(&self) -> SimConfig {
        self.inner.lock().config.clone()
    }

    /// The peer devices granted access to the mapping at `va` ([`DeviceBackend::add_peer`],
    /// [`DeviceBackend::grant_peer`]), or `None` when nothing is mapped at `va`.
    pub fn peers_with_access(&self, va: DeviceAddr) -> Option<Vec<usize>> {
        let g = self.inner.lock();
        g.mappings.get(&va.0)?;
        Some(g.peer_access.get(&va.0).cloned().unwrap_or_default())
    }

    /// A copy of the call counters and memory figures.
    pub fn counters(&self) -> SimCounters {
        self.inner.lock().counters.clone()
    }

    /// Asks for the next segment (or address reservation) at `addr`. The hint is used once; it
    /// is ignored when the range there is not free or `addr` is misaligned.
    pub fn place_next_at(&self, addr: u64) {
        self.inner.lock().hint = Some(addr);
    }

    /// Drops a pending placement hint.
    pub fn clear_placement_hint(&self) {
        self.inner.lock().hint = None;
    }

    /// Makes device call number `n` (counting from 1 over allocate, free, reserve, release,
    /// create/release physical, map and unmap) fail with `kind`.
    pub fn fail_call(&self, n: u64, kind: FaultKind) {
        self.inner.lock().fail_calls.insert(n, kind);
    }

    /// Makes the next device call fail with `kind`.
    pub fn fail_next_call(&self, kind: FaultKind) {
        let mut g = self.inner.lock();
        let n = g.counters.device_calls + 1;
        g.fail_calls.insert(n, kind);
    }

    /// Makes every allocation (segment or physical) larger than `limit` bytes fail as out of
    /// memory; `None` lifts the limit.
    pub fn fail_allocations_above(&self, limit: Option<usize>) {
        self.inner.lock().fail_above = limit;
    }

    /// Makes `mem_info` report `free` bytes free instead of the true figure; `None` restores it.
    pub fn report_free(&self, free: Option<usize>) {
        self.inner.lock().reported_free = free;
    }

    /// Makes the next call of `call`'s kind fail with [`BackendError::Injected`] (its `call`
    /// field is the number of calls of that kind, counting this one). Each use arms one failure.
    pub fn fail_next_event_call(&self, call: SimEventCall) {
        self.inner.lock().fail_events.push(call);
    }

    /// Makes the next `synchronize` or `synchronize_stream` call fail with
    /// [`BackendError::Injected`] (nothing completes then). Each use arms one failure.
    pub fn fail_next_synchronize(&self) {
        self.inner.lock().fail_syncs += 1;
    }

    /// Clears every pending fault.
    pub fn clear_faults(&self) {
        let mut g = self.inner.lock();
        g.fail_events.clear();
        g.fail_syncs = 0;
        g.fail_calls.clear();
        g.fail_above = None;
        g.reported_free = None;
    }

    /// Makes the device reject `stream` (as a destroyed or foreign stream).
    pub fn reject_stream(&self, stream: StreamId) {
        self.inner.lock().rejected_streams.insert(stream);
    }

    /// Makes every event recorded from now on answer "not complete" to its first `queries`
    /// [`query_event`](DeviceBackend::query_event) calls, whatever work it waits for: a coarse
    /// model of a device running behind the host (its launch-ahead), under which a fence or
    /// `record_stream` event is seen complete only some queries after it was recorded. 0 (the
    /// default) turns it off. Only what the host observes changes: work completes as before, so
    /// the queued-uses checks are unaffected (a late answer is a conservative one).
    pub fn set_event_query_lag(&self, queries: u32) {
        self.inner.lock().query_lag = queries;
    }

    /// Gives the device an unmap helper ([`DeviceBackend::unmaps_off_thread`]), as a CUDA device
    /// has, or (`false`, the default) takes it away. A job queued by
    /// [`unmap_later`](DeviceBackend::unmap_later) runs, in queue order, when
    /// [`wait_unmaps`](DeviceBackend::wait_unmaps) is called (the cache waits before each growth
    /// plans, Note [Unmaps off the allocating thread]); until then its ranges stay mapped. As
    /// the real helper may run a job at once, a job's ranges are checked for incomplete uses
    /// ([`violations`](Self::violations)) when it is queued as well as when it runs; its unmaps
    /// are made in relaxed capture mode, as the real helper's are, and billed to
    /// [`SimCounters::modeled_helper_ns`] as well. Deterministic: no thread is involved.
    pub fn set_unmap_helper(&self, on: bool) {
        self.inner.lock().unmap_helper = on;
    }

    /// Queues one unit of simulated work on `stream`; events recorded after it stay pending until
    /// [`complete_work`](Self::complete_work) or a synchronize.
    pub fn submit_work(&self, stream: StreamId) {
        self.inner.lock().streams.entry(stream).or_default().0 += 1;
    }

    /// Finishes all simulated work queued on `stream`, and, through the events it was made to
    /// wait on, the work of other streams before those events were recorded.
    pub fn complete_work(&self, stream: StreamId) {
        let mut g = self.inner.lock();
        let upto = g.streams.get(&stream).map_or(0, |s| s.0);
        g.finish(stream, upto, u64::MAX);
    }

    /// Every successful `stream_wait_event` so far, in order: which stream waited on which
    /// event, recorded where. Tests use it to check that work was ordered without a host
    /// synchronization.
    pub fn stream_waits(&self) -> Vec<SimStreamWait> {
        self.inner.lock().wait_log.iter().map(|w| w.wait).collect()
    }

    /// Queues one unit of simulated work on `stream` that reads or writes `[ptr, ptr + len)`,
    /// and returns it. Until it completes ([`complete_work`](Self::complete_work), a
    /// synchronize, or an event wait that orders it), the device checks that the range is not
    /// freed, unmapped or handed to a new owner that is not ordered after it (Note [Queued
    /// uses] in the module source); breaches are logged in [`violations`](Self::violations).
    pub fn use_range(&self, stream: StreamId, ptr: DeviceAddr, len: usize) -> SimUse {
        let mut g = self.inner.lock();
        let st = g.streams.entry(stream).or_default();
        st.0 += 1;
        let u = SimUse {
            stream,
            unit: st.0,
            ptr,
            len,
        };
        if len > 0 {
            g.uses.push(u);
        }
        u
    }

    /// Checks a hand-out: the cache just gave `[ptr, ptr + len)` to a new owner on `stream`.
    /// Every incomplete use of an overlapping range must be on `stream` itself or ordered
    /// before `stream`'s next work by event waits; each one that is not is logged as a
    /// [`SimViolationKind::Handout`] violation. Returns whether the hand-out was clean.
    ///
    /// The cache does not call this (it cannot tell a hand-out from any other return value);
    /// tests call it, or wrap the allocator so that every allocation it returns is checked.
    pub fn check_handout(&self, stream: StreamId, ptr: DeviceAddr, len: usize) -> bool {
        let mut g = self.inner.lock();
        let frontier = g.ordered_before(stream);
        let allowed = |u: &SimUse| {
            u.stream == stream || frontier.get(&u.stream).is_some_and(|&(f, _)| f >= u.unit)
        };
        g.check_range(SimViolationKind::Handout { stream }, ptr.0, len, &allowed) == 0
    }

    /// Every breach of the safety rule seen so far, in order (see
    /// [`use_range`](Self::use_range)).
    pub fn violations(&self) -> Vec<SimViolation> {
        self.inner.lock().violations.clone()
    }

    /// The queued uses not yet complete, in the order they were queued.
    pub fn pending_uses(&self) -> Vec<SimUse> {
        let mut g = self.inner.lock();
        g.prune_uses();
        g.uses.clone()
    }

    /// Whether any simulated work is still pending on `stream`.
    pub fn has_pending_work(&self, stream: StreamId) -> bool {
        self.inner
            .lock()
            .streams
            .get(&stream)
            .is_some_and(|&(sub, done)| done < sub)
    }

    /// Starts a capture on `stream` (cudarc's `CudaStream::begin_capture`); returns its id.
    /// Streams that wait on an event recorded in the capture join it.
    ///
    /// # Errors
    /// [`BackendError::InvalidArgument`] when `stream` is capturing already.
    pub fn begin_capture(
        &self,
        stream: StreamId,
        mode: SimCaptureMode,
    ) -> Result<u64, BackendError> {
        let mut g = self.inner.lock();
        if g.captures.contains_key(&stream) {
            return Err(BackendError::InvalidArgument {
                operation: "begin_capture",
                reason: format!("stream {stream} is capturing already"),
            });
        }
        g.last_capture += 1;
        let id = g.last_capture;
        g.captures.insert(stream, (id, mode, stream));
        Ok(id)
    }

    /// Ends the capture that `stream` started (cudarc's `CudaStream::end_capture`), for it and
    /// every stream joined into it; returns the capture's id.
    ///
    /// # Errors
    /// [`BackendError::InvalidArgument`] when `stream` did not start a capture that is underway.
    pub fn end_capture(&self, stream: StreamId) -> Result<u64, BackendError> {
        let mut g = self.inner.lock();
        let Some(&(id, _, origin)) = g.captures.get(&stream) else {
            return Err(BackendError::InvalidArgument {
                operation: "end_capture",
                reason: format!("stream {stream} is not capturing"),
            });
        };
        if origin != stream {
            return Err(BackendError::InvalidArgument {
                operation: "end_capture",
                reason: format!("stream {stream} joined a capture that {origin} started"),
            });
        }
        g.captures.retain(|_, c| c.0 != id);
        Ok(id)
    }

    /// Whether allocation and map calls, and queries of and waits on events and streams outside
    /// a capture, are made in relaxed capture mode (on by default, as `CudaDevice` makes them);
    /// tests switch it off to see the violations a backend without the mode exchange would
    /// cause.
    pub fn set_relaxed_allocation_calls(&self, relaxed: bool) {
        self.inner.lock().relaxed_allocation_calls = relaxed;
    }

    /// Every call so far that was illegal under a global or thread-local capture underway at the
    /// time (a device synchronization, a free, unmap or release; an allocation, a map, or a query
    /// of or wait on an event or stream not made in relaxed mode), and every query of or wait
    /// on an event recorded in a capture still underway or a capturing stream, in any mode, in
    /// order.
    pub fn capture_violations(&self) -> Vec<SimCaptureViolation> {
        self.inner.lock().capture_violations.clone()
    }

    /// Live segments as `(address, size)`, in address order.
    pub fn live_segments(&self) -> Vec<(DeviceAddr, usize)> {
        self.inner
            .lock()
            .ranges
            .iter()
            .filter(|(_, (_, k))| *k == RangeKind::Segment)
            .map(|(&a, &(s, _))| (DeviceAddr(a), s))
            .collect()
    }

    /// The handles whose export the cache let go of ([`DeviceBackend::release_export`]: the
    /// last exported allocation on them was freed), in order.
    pub fn released_exports(&self) -> Vec<PhysicalHandle> {
        self.inner
            .lock()
            .released_exports
            .iter()
            .map(|&h| PhysicalHandle(h))
            .collect()
    }

    /// Live mappings as `(address, size, physical handle mapped there)`, in address order.
    pub fn live_mapped_handles(&self) -> Vec<(DeviceAddr, usize, PhysicalHandle)> {
        self.inner
            .lock()
            .mappings
            .iter()
            .map(|(&a, &(s, h))| (DeviceAddr(a), s, PhysicalHandle(h)))
            .collect()
    }

    /// Live mappings as `(address, size)`, in address order.
    pub fn live_mappings(&self) -> Vec<(DeviceAddr, usize)> {
        self.inner
            .lock()
            .mappings
            .iter()
            .map(|(&a, &(s, _))| (DeviceAddr(a), s))
            .collect()
    }
}

impl Inner {
    /// Runs the first queued unmap job, as the helper would, and files its result. Its unmaps
    /// are made in relaxed capture mode, as `CudaDevice`'s helper thread makes them: legal while
    /// another thread captures.
    fn run_unmap_job(&mut self) {
        let Some((ticket, ranges, logged)) = self.unmap_jobs.pop_front() else {
            return;
        };
        let mut unmapped = 0;
        let mut error = None;
        for (va, size) in ranges {
            match self.unmap_checked(DeviceAddr(va), size, true, &|u| logged.contains(u)) {
                Ok(()) => unmapped += 1,
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        self.unmap_done.push(FinishedUnmaps {
            ticket,
            unmapped,
            error,
        });
    }

    /// `unmap`'s work, under the lock: `by_helper` for the helper's unmap (relaxed in capture
    /// mode, so not subject to another thread's capture, and billed to the helper's time too);
    /// uses `logged` accepts were logged as violations already.
    fn unmap_checked(
        &mut self,
        va: DeviceAddr,
        size: usize,
        by_helper: bool,
        logged: &dyn Fn(&SimUse) -> bool,
    ) -> Result<(), BackendError> {
        let g = self;
        let handle = match g.mappings.get(&va.0) {
            Some(&(s, h)) if s == size => h,
            _ => {
                return Err(BackendError::InvalidArgument {
                    operation: "unmap",
                    reason: format!("{va}+{size} is not one mapping"),
                });
            }
        };
        if !by_helper {
            g.capture_call("unmap", CaptureClass::Unsafe);
        }
        if let Err(f) = g.next_call(None) {
            return Err(fault("unmap", f));
        }
        g.check_range(SimViolationKind::Unmap, va.0, size, logged);
        g.mappings.remove(&va.0);
        g.peer_access.remove(&va.0);
        if let Some(n) = g.maps_of_handle.get_mut(&handle) {
            *n -= 1;
            if *n == 0 {
                g.maps_of_handle.remove(&handle);
            }
        }
        g.counters.unmap_calls += 1;
        g.bill(|c| c.unmap_ns);
        if by_helper {
            let ns = g.config.costs.unmap_ns;
            g.counters.modeled_helper_ns = g.counters.modeled_helper_ns.saturating_add(ns);
        }
        Ok(())
    }
}

// SAFETY: (1) `place` only returns ranges that overlap no live range (checked against `ranges`,
// which holds every live segment and reservation), aligned to `alignment`, and non-null because
// `base_address` is at least 1 and hints of 0 are refused; mappings are checked to lie inside one
// reservation and not to overlap another mapping. (2) Nothing is ever dereferenced, so the
// "memory" stays valid until freed. (3) `capacity` never changes.
unsafe impl DeviceBackend for SimDevice {
    fn device_index(&self) -> usize {
        self.inner.lock().config.device_index
    }

    fn alignment(&self) -> usize {
        self.inner.lock().config.alignment
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        let g = self.inner.lock();
        let total = g.config.capacity;
        let free = g.reported_free.unwrap_or(total - g.used().min(total));
        Ok(MemInfo { free, total })
    }

    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddr, BackendError> {
        let mut g = self.inner.lock();
        if size == 0 {
            return Err(BackendError::InvalidArgument {
                operation: "allocate",
                reason: "size 0".into(),
            });
        }
        if g.rejected_streams.contains(&stream) {
            return Err(BackendError::InvalidStream {
                stream,
                reason: "rejected by the simulated device".into(),
            });
        }
        g.capture_call("allocate", CaptureClass::Allocation);
        if let Err(f) = g.next_call(Some(size)) {
            g.counters.failed_allocate_calls += 1;
            g.hint = None;
            return Err(fault("allocate", f));
        }
        // Out of memory, or (after 2^64 bytes of placements) out of address space: either way
        // nothing is charged and the cursor stays.
        let at = match g.fits(size).then(|| g.place(size, true)).flatten() {
            Some(at) if g.charge(size) => at,
            _ => {
                g.counters.failed_allocate_calls += 1;
                g.hint = None;
                return Err(BackendError::OutOfMemory);
            }
        };
        g.ranges.insert(at, (size, RangeKind::Segment));
        g.counters.allocate_calls += 1;
        g.bill(|c| c.allocate_ns);
        g.counters.live_segments += 1;
        Ok(DeviceAddr(at))
    }

    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        _stream: StreamId,
    ) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        match g.ranges.get(&ptr.0) {
            Some(&(s, RangeKind::Segment)) if s == size => {}
            _ => {
                return Err(BackendError::InvalidArgument {
                    operation: "free",
                    reason: format!("{ptr} with size {size} is not a live segment"),
                });
            }
        }
        g.capture_call("free", CaptureClass::Unsafe);
        if let Err(f) = g.next_call(None) {
            return Err(fault("free", f));
        }
        g.check_range(SimViolationKind::Free, ptr.0, size, &|_| false);
        g.ranges.remove(&ptr.0);
        g.counters.reserved_bytes -= size;
        g.counters.free_calls += 1;
        g.bill(|c| c.free_ns);
        g.counters.live_segments -= 1;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        g.capture_call("synchronize", CaptureClass::Unsafe);
        g.counters.synchronize_calls += 1;
        g.sync_fault("synchronize")?;
        g.bill(|c| c.synchronize_ns);
        for s in g.streams.values_mut() {
            s.1 = s.0;
        }
        g.open_waits.clear();
        g.uses.clear();
        Ok(())
    }

    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.inner.lock().check_stream(stream)
    }

    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        g.check_stream(stream)?;
        let capture = g.stream_capture(stream);
        g.capture_call("synchronize_stream", CaptureClass::Query { capture });
        g.counters.synchronize_calls += 1;
        g.counters.stream_synchronize_calls += 1;
        g.sync_fault("synchronize_stream")?;
        g.bill(|c| c.stream_synchronize_ns);
        let upto = g.streams.get(&stream).map_or(0, |s| s.0);
        g.finish(stream, upto, u64::MAX);
        Ok(())
    }

    fn create_event(&self) -> Result<EventHandle, BackendError> {
        let mut g = self.inner.lock();
        let made = g.counters.events_created;
        g.event_fault(SimEventCall::Create, made)?;
        let id = g.next_event;
        g.next_event += 1;
        g.events.insert(id, None);
        g.counters.events_created += 1;
        g.bill(|c| c.event_create_ns);
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        g.check_stream(stream)?;
        let records = g.counters.event_records;
        g.event_fault(SimEventCall::Record, records)?;
        match g.captures.get(&stream).map(|c| c.0) {
            Some(capture) => g.captured_events.insert(event.0, capture),
            None => g.captured_events.remove(&event.0),
        };
        let submitted = g.streams.get(&stream).map_or(0, |s| s.0);
        g.seq += 1;
        let seq = g.seq;
        match g.events.get_mut(&event.0) {
            Some(slot) => *slot = Some((stream, submitted, seq)),
            None => {
                return Err(BackendError::InvalidArgument {
                    operation: "record_event",
                    reason: format!("unknown event {}", event.0),
                });
            }
        }
        let lag = g.query_lag;
        if lag > 0 {
            g.lag_left.insert(event.0, lag);
        } else {
            g.lag_left.remove(&event.0);
        }
        g.counters.event_records += 1;
        g.bill(|c| c.event_record_ns);
        Ok(())
    }

    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        let mut g = self.inner.lock();
        let capture = g.event_capture(event.0);
        g.capture_call("query_event", CaptureClass::Query { capture });
        g.counters.event_queries += 1;
        g.bill(|c| c.event_query_ns);
        match g.events.get(&event.0) {
            Some(None) => Ok(true),
            Some(&Some((stream, at, seq))) => {
                if let Some(left) = g.lag_left.get_mut(&event.0) {
                    *left -= 1;
                    if *left == 0 {
                        g.lag_left.remove(&event.0);
                    }
                    return Ok(false);
                }
                Ok(g.done(stream, at, seq))
            }
            None => Err(BackendError::InvalidArgument {
                operation: "query_event",
                reason: format!("unknown event {}", event.0),
            }),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        let capture = g.event_capture(event.0);
        g.capture_call("synchronize_event", CaptureClass::Query { capture });
        match g.events.get(&event.0).copied() {
            Some(Some((stream, at, seq))) => {
                g.finish(stream, at, seq);
                Ok(())
            }
            Some(None) => Ok(()),
            None => Err(BackendError::InvalidArgument {
                operation: "synchronize_event",
                reason: format!("unknown event {}", event.0),
            }),
        }
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        g.check_stream(stream)?;
        let Some(&recorded) = g.events.get(&event.0) else {
            return Err(BackendError::InvalidArgument {
                operation: "stream_wait_event",
                reason: format!("unknown event {}", event.0),
            });
        };
        let waits = g.counters.stream_waits;
        g.event_fault(SimEventCall::StreamWait, waits)?;
        // Waiting on an event recorded in a capture joins the capture (a forked stream).
        if let Some(&capture) = g.captured_events.get(&event.0) {
            if !g.captures.contains_key(&stream) {
                let joined = g.captures.values().find(|c| c.0 == capture).copied();
                if let Some(c) = joined {
                    g.captures.insert(stream, c);
                }
            }
        }
        g.seq += 1;
        let wait = SimStreamWait {
            stream,
            event,
            recorded: recorded.map(|(s, at, _)| (s, at)),
            position: g.streams.get(&stream).map_or(0, |s| s.0),
        };
        let seq = g.seq;
        g.wait_log.push(OpenWait {
            wait,
            seq,
            record_seq: recorded.map_or(0, |r| r.2),
        });
        if let Some((t, at, record_seq)) = recorded {
            // Already satisfied (the recorded point completed): nothing to wait for.
            if !g.done(t, at, record_seq) {
                let seq = g.seq;
                g.open_waits.push(OpenWait {
                    wait,
                    seq,
                    record_seq,
                });
            }
        }
        g.counters.stream_waits += 1;
        g.bill(|c| c.stream_wait_event_ns);
        Ok(())
    }

    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        match self.inner.lock().events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(BackendError::InvalidArgument {
                operation: "destroy_event",
                reason: format!("unknown event {}", event.0),
            }),
        }
    }

    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        Ok(self.inner.lock().captures.get(&stream).map(|c| c.0))
    }

    fn vm_granularity(&self) -> Option<usize> {
        self.inner.lock().config.vm_granularity
    }

    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        let mut g = self.inner.lock();
        g.check_granular("reserve_address_range", size)?;
        g.capture_call("reserve_address_range", CaptureClass::Allocation);
        if let Err(f) = g.next_call(None) {
            return Err(fault("reserve_address_range", f));
        }
        let Some(at) = g.place(size, true) else {
            return Err(BackendError::OutOfMemory);
        };
        g.ranges.insert(at, (size, RangeKind::Reservation));
        g.counters.reserve_calls += 1;
        g.bill(|c| c.reserve_ns);
        Ok(DeviceAddr(at))
    }

    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        match g.ranges.get(&base.0) {
            Some(&(s, RangeKind::Reservation)) if s == size => {}
            _ => {
                return Err(BackendError::InvalidArgument {
                    operation: "release_address_range",
                    reason: format!("{base} with size {size} is not a live reservation"),
                });
            }
        }
        let end = base.0 + size as u64;
        if g.mappings.range(base.0..end).next().is_some() {
            return Err(BackendError::InvalidArgument {
                operation: "release_address_range",
                reason: format!("{base} still has mapped pages"),
            });
        }
        g.capture_call("release_address_range", CaptureClass::Unsafe);
        if let Err(f) = g.next_call(None) {
            return Err(fault("release_address_range", f));
        }
        g.ranges.remove(&base.0);
        g.counters.release_range_calls += 1;
        g.bill(|c| c.release_range_ns);
        Ok(())
    }

    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        let mut g = self.inner.lock();
        g.check_granular("create_physical", size)?;
        g.capture_call("create_physical", CaptureClass::Allocation);
        if let Err(f) = g.next_call(Some(size)) {
            return Err(fault("create_physical", f));
        }
        // Note [Handle limit] on `SimDevice::MAX_PHYSICAL_HANDLES` (a device too small for the
        // request still answers out of memory).
        if g.physical.len() >= SimDevice::MAX_PHYSICAL_HANDLES && g.fits(size) {
            return Err(BackendError::Unsupported(
                "more than 2,097,152 physical handles at once (SimDevice::MAX_PHYSICAL_HANDLES: \
                 fewer, larger handles, cca_max_handle_size_mb, or a smaller request stay under \
                 it)",
            ));
        }
        if !g.charge(size) {
            return Err(BackendError::OutOfMemory);
        }
        let id = g.next_physical;
        g.next_physical += 1;
        g.physical.insert(id, size);
        g.counters.create_physical_calls += 1;
        g.bill(|c| c.create_ns);
        Ok(PhysicalHandle(id))
    }

    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        size: usize,
    ) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        if g.physical.get(&handle.0) != Some(&size) {
            return Err(BackendError::InvalidArgument {
                operation: "release_physical",
                reason: format!("handle {} of size {size} is not live", handle.0),
            });
        }
        if g.maps_of_handle.contains_key(&handle.0) {
            return Err(BackendError::InvalidArgument {
                operation: "release_physical",
                reason: format!("handle {} is still mapped", handle.0),
            });
        }
        g.capture_call("release_physical", CaptureClass::Unsafe);
        if let Err(f) = g.next_call(None) {
            return Err(fault("release_physical", f));
        }
        g.physical.remove(&handle.0);
        g.counters.reserved_bytes -= size;
        g.counters.release_physical_calls += 1;
        g.bill(|c| c.release_ns);
        Ok(())
    }

    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        let bad = |reason: String| BackendError::InvalidArgument {
            operation: "map",
            reason,
        };
        if g.physical.get(&handle.0) != Some(&size) {
            return Err(bad(format!(
                "handle {} of size {size} is not live",
                handle.0
            )));
        }
        let inside = g
            .ranges
            .range(..=va.0)
            .next_back()
            .is_some_and(|(&s, &(len, k))| {
                k == RangeKind::Reservation && va.0 + size as u64 <= s + len as u64
            });
        if !inside {
            return Err(bad(format!("{va}+{size} is not inside one reservation")));
        }
        let end = va.0 + size as u64;
        let clash = g
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(&s, &(len, _))| s + len as u64 > va.0);
        if clash {
            return Err(bad(format!("{va}+{size} overlaps a mapping")));
        }
        g.capture_call("map", CaptureClass::Allocation);
        if let Err(f) = g.next_call(None) {
            return Err(fault("map", f));
        }
        g.mappings.insert(va.0, (size, handle.0));
        if !g.peers.is_empty() {
            let peers = g.peers.clone();
            g.peer_access.insert(va.0, peers);
        }
        *g.maps_of_handle.entry(handle.0).or_insert(0) += 1;
        g.counters.map_calls += 1;
        g.counters.set_access_calls += 1;
        g.bill(|c| c.map_ns);
        g.bill(|c| c.set_access_ns);
        Ok(())
    }

    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        self.inner.lock().unmap_checked(va, size, false, &|_| false)
    }

    fn unmaps_off_thread(&self) -> bool {
        self.inner.lock().unmap_helper
    }

    unsafe fn unmap_later(&self, ranges: Vec<(DeviceAddr, usize)>) -> Result<u64, BackendError> {
        let mut g = self.inner.lock();
        if !g.unmap_helper {
            return Err(BackendError::Unsupported("unmaps on a helper thread"));
        }
        let ticket = g.next_ticket;
        g.next_ticket += 1;
        let ranges: Vec<(u64, usize)> = ranges.into_iter().map(|(va, size)| (va.0, size)).collect();
        // The helper may run the job at once: a use still incomplete now is broken (checked
        // here, not only when the simulated job runs, by which time it may have completed).
        let mut logged = Vec::new();
        for &(va, size) in &ranges {
            let before = g.violations.len();
            g.check_range(SimViolationKind::Unmap, va, size, &|_| false);
            logged.extend(g.violations[before..].iter().map(|v| v.pending));
        }
        g.unmap_jobs.push_back((ticket, ranges, logged));
        Ok(ticket)
    }

    fn finished_unmaps(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        let mut g = self.inner.lock();
        let (mine, others) = std::mem::take(&mut g.unmap_done)
            .into_iter()
            .partition(|f| tickets.contains(&f.ticket));
        g.unmap_done = others;
        mine
    }

    fn wait_unmaps(&self) {
        let mut g = self.inner.lock();
        while !g.unmap_jobs.is_empty() {
            g.run_unmap_job();
        }
    }

    fn release_export(&self, handle: PhysicalHandle) {
        self.inner.lock().released_exports.push(handle.0);
    }

    fn add_peer(&self, peer: usize) -> Result<bool, BackendError> {
        let mut g = self.inner.lock();
        if g.config.vm_granularity.is_none() {
            return Err(BackendError::Unsupported("peer access to mapped memory"));
        }
        if peer == g.config.device_index {
            return Err(BackendError::InvalidArgument {
                operation: "add_peer",
                reason: format!("device {peer} is this device, not a peer"),
            });
        }
        if g.peers.contains(&peer) {
            return Ok(false);
        }
        g.peers.push(peer);
        Ok(true)
    }

    unsafe fn grant_peer(
        &self,
        va: DeviceAddr,
        size: usize,
        peer: usize,
    ) -> Result<(), BackendError> {
        let mut g = self.inner.lock();
        if !matches!(g.mappings.get(&va.0), Some(&(s, _)) if s == size) {
            return Err(BackendError::InvalidArgument {
                operation: "grant_peer",
                reason: format!("{va}+{size} is not one mapping"),
            });
        }
        if let Err(f) = g.next_call(None) {
            return Err(fault("grant_peer", f));
        }
        let granted = g.peer_access.entry(va.0).or_default();
        if !granted.contains(&peer) {
            granted.push(peer);
        }
        g.counters.set_access_calls += 1;
        g.bill(|c| c.set_access_ns);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
