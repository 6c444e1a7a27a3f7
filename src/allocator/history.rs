//! The history recorder: a bounded ring buffer of the allocator's own events (allocations,
//! frees, segment allocations and releases, cache flushes, fraction changes), off by default.
//!
//! When off it costs one branch on a field the allocator already holds under its lock. When on,
//! each event costs a ring-buffer push and, for allocations, a map insert. The recorded history is
//! a [`Trace`] in the crate's one operation language, so it replays here and exports to PyTorch's
//! snapshot pickle or RMM CSV. May use: `trace`, `backend` values.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use crate::backend::{DeviceAddr, StreamId};
use crate::trace::{Trace, TraceEvent, TraceOp, TraceSource};

/// A bounded ring buffer of events.
#[derive(Debug)]
pub(crate) struct History {
    capacity: usize,
    events: VecDeque<TraceEvent>,
    /// Live allocation address → id.
    live: HashMap<u64, u64>,
    next_id: u64,
    start: Instant,
    /// Events dropped because the buffer was full.
    pub(crate) dropped: u64,
}

fn thread_index() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    thread_local! { static ID: u32 = NEXT.fetch_add(1, Ordering::Relaxed); }
    // A thread past its thread-locals' destruction (a free from a static destructor at exit).
    ID.try_with(|id| *id).unwrap_or(u32::MAX)
}

impl History {
    pub(crate) fn new(capacity: usize) -> Self {
        History {
            capacity: capacity.max(1),
            events: VecDeque::with_capacity(capacity.clamp(1, 1 << 16)),
            live: HashMap::new(),
            next_id: 1,
            start: Instant::now(),
            dropped: 0,
        }
    }

    fn push(&mut self, op: TraceOp) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.dropped += 1;
        }
        let time_ns = self.start.elapsed().as_nanos() as u64;
        self.events.push_back(TraceEvent {
            op,
            time_ns,
            thread: thread_index(),
            tag: None,
        });
    }

    pub(crate) fn alloc(&mut self, ptr: DeviceAddr, size: usize, stream: StreamId) {
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(ptr.0, id);
        self.push(TraceOp::Alloc {
            id,
            size: size as u64,
            stream: stream.0,
            addr: Some(ptr.0),
        });
    }

    pub(crate) fn free(&mut self, ptr: DeviceAddr) {
        if let Some(id) = self.live.remove(&ptr.0) {
            self.push(TraceOp::Free { id });
        }
    }

    pub(crate) fn segment_alloc(&mut self, ptr: DeviceAddr, size: usize, stream: StreamId) {
        self.push(TraceOp::SegmentAlloc {
            addr: ptr.0,
            size: size as u64,
            stream: stream.0,
        });
    }

    pub(crate) fn segment_free(&mut self, ptr: DeviceAddr, size: usize, stream: StreamId) {
        self.push(TraceOp::SegmentFree {
            addr: ptr.0,
            size: size as u64,
            stream: stream.0,
        });
    }

    pub(crate) fn op(&mut self, op: TraceOp) {
        self.push(op);
    }

    /// The recorded events as a trace. Frees whose allocation fell out of the buffer are left out,
    /// so the trace always replays.
    pub(crate) fn to_trace(&self) -> Trace {
        let mut trace = Trace::new(TraceSource::Recorded);
        let mut seen: HashSet<u64> = HashSet::new();
        for ev in &self.events {
            match ev.op {
                TraceOp::Alloc { id, .. } => {
                    seen.insert(id);
                }
                TraceOp::Free { id } if !seen.contains(&id) => continue,
                _ => {}
            }
            trace.events.push(ev.clone());
        }
        trace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_drops_oldest_and_orphan_frees() {
        let mut h = History::new(3);
        h.alloc(DeviceAddr(512), 10, StreamId(0));
        h.alloc(DeviceAddr(1024), 10, StreamId(0));
        h.free(DeviceAddr(512));
        h.free(DeviceAddr(1024));
        assert_eq!(h.dropped, 1);
        let t = h.to_trace();
        // The first alloc fell out, so its free is dropped too.
        assert_eq!(t.events.len(), 2);
        assert!(matches!(t.events[0].op, TraceOp::Alloc { id: 2, .. }));
        assert!(matches!(t.events[1].op, TraceOp::Free { id: 2 }));
        h.free(DeviceAddr(4096)); // unknown: ignored
        assert_eq!(h.to_trace().events.len(), 2);
    }
}
