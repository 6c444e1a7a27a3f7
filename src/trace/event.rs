//! The trace model: a list of timed operations on an allocator.
//!
//! Allocation ids are assigned by whoever writes the trace (importers number allocations in
//! order); a `Free` names the id of an earlier `Alloc`. Recorded addresses and recorded segment
//! events are *observations* of the original run: replay uses them only as placement hints (see
//! Note [Address-faithful replay] in `replay.rs`), never as commands.
#![forbid(unsafe_code)]

/// Version of the trace model and of its documented text form.
pub const TRACE_FORMAT_VERSION: u32 = 1;

/// Where a trace came from.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum TraceSource {
    /// A PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`).
    PytorchSnapshot,
    /// An RMM `logging_resource_adaptor` CSV log.
    RmmCsv,
    /// Recorded by this crate's own history recorder.
    Recorded,
    /// Generated (synthetic workloads, property tests, fuzzing).
    #[default]
    Synthetic,
}

/// One operation of a trace.
#[derive(Clone, Debug, PartialEq)]
pub enum TraceOp {
    /// A request for `size` bytes on `stream`; `addr` is the address the recorded run returned,
    /// when known.
    Alloc {
        /// Allocation id, unique within the trace.
        id: u64,
        /// Requested (unrounded) size in bytes.
        size: u64,
        /// Stream handle value.
        stream: u64,
        /// Address in the recorded run, if known.
        addr: Option<u64>,
    },
    /// The free of allocation `id`.
    Free {
        /// Id of an earlier `Alloc`.
        id: u64,
    },
    /// `empty_cache()`: release every wholly free cached segment.
    EmptyCache,
    /// `set_memory_fraction(fraction)`.
    SetFraction {
        /// The new fraction, in `[0, 1]`.
        fraction: f64,
    },
    /// The recorded run allocated a device segment here (a placement observation).
    SegmentAlloc {
        /// Segment base address.
        addr: u64,
        /// Segment size in bytes.
        size: u64,
        /// Stream handle value.
        stream: u64,
    },
    /// The recorded run freed a device segment (an observation).
    SegmentFree {
        /// Segment base address.
        addr: u64,
        /// Segment size in bytes.
        size: u64,
        /// Stream handle value.
        stream: u64,
    },
    /// The recorded run mapped pages of an expandable segment (an observation).
    SegmentMap {
        /// First mapped address.
        addr: u64,
        /// Mapped bytes.
        size: u64,
        /// Stream handle value.
        stream: u64,
    },
    /// The recorded run unmapped pages of an expandable segment (an observation).
    SegmentUnmap {
        /// First unmapped address.
        addr: u64,
        /// Unmapped bytes.
        size: u64,
        /// Stream handle value.
        stream: u64,
    },
}

/// One timed operation.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// What happened.
    pub op: TraceOp,
    /// When, in nanoseconds since an arbitrary origin (0 when unknown).
    pub time_ns: u64,
    /// The issuing thread (0 when unknown).
    pub thread: u32,
    /// An optional free-form tag (a phase name, a call site).
    pub tag: Option<Box<str>>,
}

impl TraceEvent {
    /// An untimed event on thread 0 without a tag.
    pub fn new(op: TraceOp) -> Self {
        TraceEvent {
            op,
            time_ns: 0,
            thread: 0,
            tag: None,
        }
    }
}

/// A whole trace.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Trace {
    /// Model version ([`TRACE_FORMAT_VERSION`] for traces made by this crate).
    pub version: u32,
    /// Where it came from.
    pub source: TraceSource,
    /// Device memory of the recording device in bytes, when known.
    pub device_total: Option<u64>,
    /// The operations, in order.
    pub events: Vec<TraceEvent>,
}

impl Trace {
    /// An empty trace of the current version.
    pub fn new(source: TraceSource) -> Self {
        Trace {
            version: TRACE_FORMAT_VERSION,
            source,
            device_total: None,
            events: Vec::new(),
        }
    }

    /// Appends an untimed event.
    pub fn push(&mut self, op: TraceOp) {
        self.events.push(TraceEvent::new(op));
    }

    /// Number of `Alloc` operations.
    pub fn alloc_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e.op, TraceOp::Alloc { .. }))
            .count()
    }
}
