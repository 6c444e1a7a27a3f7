//! The hazard log of [`SimDevice`](super::SimDevice): queued uses of device memory, the waits
//! that order streams, and the breaches of the safety rule the device saw. May use: `backend`.
//!
//! Note [Queued uses]: a use is (stream S, unit k, range). It is *complete* once S completed its
//! unit k (directly, through a synchronize, or through a stream that waited on an event recorded
//! after it). A complete use constrains nothing. An incomplete use makes these a violation:
//!
//! * `free` of a segment or `unmap` of pages overlapping its range: the bytes leave their
//!   address while the work may still run. Pages can only be released or mapped elsewhere (moved)
//!   after being unmapped, which the device enforces, so the `unmap` check covers releases and
//!   page moves; address ranges can only be released with nothing mapped in them.
//! * a hand-out ([`SimDevice::check_handout`](super::SimDevice::check_handout)) of an
//!   overlapping range to stream X, unless X == S or X's next work is ordered after unit k of S:
//!   X waited on an event recorded on a
//!   stream T at a point that is itself ordered after unit k of S (transitively, over every
//!   `stream_wait_event` so far). The new owner's work is queued after the hand-out, so this is
//!   exactly "every use is complete or ordered before the new owner's work".
//!
//! The hand-out check also sees through aliases: a handle mapped at two address ranges at once
//! (as lent pages are, Note [Lent pages] in the allocator) makes a use of one range a use of the
//! same bytes in the other, for as long as both mappings are in place. (Unmapping one range
//! takes nothing from the other, and a handle cannot be released while mapped anywhere.)

use std::collections::BTreeMap;

use super::Inner;
use crate::backend::{DeviceAddr, EventHandle, StreamId};

/// One successful `stream_wait_event` the simulated device saw (see
/// [`SimDevice::stream_waits`](super::SimDevice::stream_waits)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimStreamWait {
    /// The stream made to wait.
    pub stream: StreamId,
    /// The event it waits on.
    pub event: EventHandle,
    /// Where the event was recorded when the wait was issued: the recording stream and the units
    /// of work submitted to it by then. `None`: the event was never recorded, so the wait waits
    /// for nothing (as in CUDA).
    pub recorded: Option<(StreamId, u64)>,
    /// Units of work submitted to `stream` before the wait.
    pub position: u64,
}

/// One unit of simulated work that reads or writes device memory (see
/// [`SimDevice::use_range`](super::SimDevice::use_range)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimUse {
    /// The stream the work is queued on.
    pub stream: StreamId,
    /// Its position on the stream: the stream's `unit`-th unit of work (counting from 1).
    pub unit: u64,
    /// The first byte it uses.
    pub ptr: DeviceAddr,
    /// Bytes it uses.
    pub len: usize,
}

impl SimUse {
    fn overlaps(&self, ptr: u64, len: usize) -> bool {
        let end = ptr.saturating_add(len as u64);
        let uend = self.ptr.0.saturating_add(self.len as u64);
        self.ptr.0 < end && ptr < uend
    }
}

/// What the cache did to memory that incomplete queued work still used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimViolationKind {
    /// A segment was freed to the device.
    Free,
    /// Pages were unmapped (to be released, or moved elsewhere).
    Unmap,
    /// The range was handed out to a new owner on `stream`, which is not ordered after the use.
    Handout {
        /// The new owner's stream.
        stream: StreamId,
    },
}

/// One breach of the safety rule the simulated device saw (see Note [Queued uses] in the module
/// source and [`SimDevice::violations`](super::SimDevice::violations)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimViolation {
    /// What the cache did.
    pub kind: SimViolationKind,
    /// The range it did it to: start.
    pub ptr: DeviceAddr,
    /// The range it did it to: bytes.
    pub len: usize,
    /// The incomplete use it broke.
    pub pending: SimUse,
}

impl std::fmt::Display for SimViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            SimViolationKind::Free => "freed".to_string(),
            SimViolationKind::Unmap => "unmapped".to_string(),
            SimViolationKind::Handout { stream } => format!("handed out to stream {stream}"),
        };
        write!(
            f,
            "{}+{} {what} while unit {} of stream {} still used {}+{}",
            self.ptr,
            self.len,
            self.pending.unit,
            self.pending.stream,
            self.pending.ptr,
            self.pending.len
        )
    }
}

/// A wait not yet known to be satisfied, with the ordering numbers that decide it.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpenWait {
    /// The wait as logged.
    pub(super) wait: SimStreamWait,
    /// Global order of the wait among records and waits.
    pub(super) seq: u64,
    /// Global order of the record the wait captured.
    pub(super) record_seq: u64,
}

impl Inner {
    /// Completes `stream`'s work up to `upto` units (and the waits queued there before that point:
    /// before unit `upto`, or at it and ordered before `seq_limit`), and, through those waits,
    /// the recorded streams' work they wait for.
    pub(super) fn finish(&mut self, stream: StreamId, upto: u64, seq_limit: u64) {
        let mut work = vec![(stream, upto, seq_limit)];
        while let Some((s, upto, limit)) = work.pop() {
            let st = self.streams.entry(s).or_default();
            st.1 = st.1.max(upto.min(st.0));
            self.open_waits.retain(|w| {
                let covered = w.wait.stream == s
                    && (w.wait.position < upto || (w.wait.position == upto && w.seq < limit));
                if covered {
                    if let Some((t, at)) = w.wait.recorded {
                        work.push((t, at, w.record_seq));
                    }
                }
                !covered
            });
        }
    }

    /// Whether `stream` has completed its work before unit `upto` and the waits queued before the
    /// point ordered `seq` (an event record's).
    pub(super) fn done(&self, stream: StreamId, upto: u64, seq: u64) -> bool {
        if self.streams.get(&stream).map_or(0, |s| s.1) < upto {
            return false;
        }
        self.open_waits.iter().all(|w| {
            let before = w.wait.stream == stream
                && (w.wait.position < upto || (w.wait.position == upto && w.seq < seq));
            // A wait's record is ordered before the wait, so the recursion ends.
            !before
                || w.wait
                    .recorded
                    .is_none_or(|(t, at)| self.done(t, at, w.record_seq))
        })
    }

    /// Forgets the uses that completed.
    pub(super) fn prune_uses(&mut self) {
        let uses = std::mem::take(&mut self.uses);
        self.uses = uses
            .into_iter()
            .filter(|u| !self.done(u.stream, u.unit, 0))
            .collect();
    }

    /// The physical memory under `[va, va + len)`: (handle, first byte, end byte) of each
    /// mapping overlapping it, clipped to it.
    fn physical_pieces(&self, va: u64, len: usize) -> Vec<(u64, u64, u64)> {
        let end = va.saturating_add(len as u64);
        let first = self
            .mappings
            .range(..=va)
            .next_back()
            .map_or(va, |(&s, _)| s);
        self.mappings
            .range(first..end)
            .filter_map(|(&s, &(size, h))| {
                let (lo, hi) = (s.max(va), (s + size as u64).min(end));
                (lo < hi).then_some((h, lo - s, hi - s))
            })
            .collect()
    }

    /// Whether `[a, a + a_len)` and `[b, b + b_len)` share physical memory through the current
    /// mappings (a handle mapped at two ranges: Note [Queued uses], aliases).
    fn aliases(&self, a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
        let pa = self.physical_pieces(a, a_len);
        if pa.is_empty() {
            return false;
        }
        let pb = self.physical_pieces(b, b_len);
        pa.iter()
            .any(|&(h, lo, hi)| pb.iter().any(|&(g, l2, h2)| g == h && lo < h2 && l2 < hi))
    }

    /// Logs a violation of `kind` for every incomplete use overlapping `[ptr, ptr + len)` that
    /// `allowed` does not excuse; returns how many.
    pub(super) fn check_range(
        &mut self,
        kind: SimViolationKind,
        ptr: u64,
        len: usize,
        allowed: &dyn Fn(&SimUse) -> bool,
    ) -> usize {
        self.prune_uses();
        let found: Vec<SimViolation> = self
            .uses
            .iter()
            .filter(|u| {
                // Unmapping or freeing one range takes nothing from an alias of it; handing a
                // range out hands out every alias's bytes too.
                let alias = matches!(kind, SimViolationKind::Handout { .. })
                    && self.aliases(u.ptr.0, u.len, ptr, len);
                (u.overlaps(ptr, len) || alias) && !allowed(u)
            })
            .map(|&pending| SimViolation {
                kind,
                ptr: DeviceAddr(ptr),
                len,
                pending,
            })
            .collect();
        let n = found.len();
        self.violations.extend(found);
        n
    }

    /// Per stream, the last point ordered before the next work `target` will run, as (units of
    /// work, order of the record or wait): its own units and waits so far, and through every
    /// `stream_wait_event` (transitively) the recorded points of the streams it waited on. A wait
    /// queued at `(position, seq)` precedes a point `(units, seq')` when `(position, seq)` is
    /// smaller, as in `done`.
    pub(super) fn ordered_before(&self, target: StreamId) -> BTreeMap<StreamId, (u64, u64)> {
        let mut frontier = BTreeMap::new();
        let next = self.streams.get(&target).map_or(0, |s| s.0);
        frontier.insert(target, (next, u64::MAX));
        let mut changed = true;
        while changed {
            changed = false;
            for w in &self.wait_log {
                let Some((t, at)) = w.wait.recorded else {
                    continue;
                };
                let reached = frontier
                    .get(&w.wait.stream)
                    .is_some_and(|&f| (w.wait.position, w.seq) < f);
                let point = (at, w.record_seq);
                if reached && frontier.get(&t).is_none_or(|&f| f < point) {
                    frontier.insert(t, point);
                    changed = true;
                }
            }
        }
        frontier
    }
}
