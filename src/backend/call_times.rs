//! Host time spent inside device calls, by kind: how a backend that drives a real device shows
//! where the allocator's own time goes (a growth that maps forty pages, a fence query per
//! allocation), beside PyTorch's call counts (`num_device_alloc` / `num_device_free`), which say
//! how often but not how long. `CallClock` is what the backend keeps (two relaxed atomic adds
//! per call, next to calls that cost microseconds); [`DeviceCallTimes`] is what it reports.
//!
//! The kinds and their names ([`CALL_KINDS`]) are also those under which the simulated device
//! reports its calls ([`SimCounters::call_counts`](super::sim::SimCounters::call_counts), `cca
//! replay --json`'s `device_calls`), so a replay's modeled figures and a real run's measured
//! ones line up. May use: nothing internal.
// `CudaDevice` is the clock's one user: without the CUDA features only the report type is used.
#![cfg_attr(not(feature = "cuda-unpinned"), allow(dead_code))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The kinds of device call, in the order [`DeviceCallTimes`] reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum CallKind {
    Allocate = 0,
    Free,
    Reserve,
    ReleaseRange,
    Create,
    Map,
    SetAccess,
    Unmap,
    Release,
    Synchronize,
    StreamSynchronize,
    EventCreate,
    EventRecord,
    EventQuery,
    StreamWaitEvent,
}

/// The number of kinds.
const KINDS: usize = 15;

/// The names of the kinds of driver call, in the order [`DeviceCallTimes`] holds them.
pub const CALL_KINDS: [&str; KINDS] = [
    "allocate",
    "free",
    "reserve",
    "release_range",
    "create",
    "map",
    "set_access",
    "unmap",
    "release",
    "synchronize",
    "stream_synchronize",
    "event_create",
    "event_record",
    "event_query",
    "stream_wait_event",
];

/// Counts and times the calls of one backend (shared by every thread that calls it).
#[derive(Debug, Default)]
pub(crate) struct CallClock {
    calls: [AtomicU64; KINDS],
    ns: [AtomicU64; KINDS],
}

impl CallClock {
    /// Starts timing one call of `kind`; the time is added when the returned guard drops
    /// (error paths included: a failed call took its time too).
    #[inline]
    pub(crate) fn start(&self, kind: CallKind) -> CallTimer<'_> {
        CallTimer {
            clock: self,
            kind,
            start: Instant::now(),
        }
    }

    /// The counts and times so far.
    pub(crate) fn snapshot(&self) -> DeviceCallTimes {
        let mut t = DeviceCallTimes::default();
        for i in 0..KINDS {
            t.calls[i] = self.calls[i].load(Ordering::Relaxed);
            t.ns[i] = self.ns[i].load(Ordering::Relaxed);
        }
        t
    }
}

/// One call being timed ([`CallClock::start`]).
#[must_use = "the call is timed until the guard drops"]
pub(crate) struct CallTimer<'a> {
    clock: &'a CallClock,
    kind: CallKind,
    start: Instant,
}

impl Drop for CallTimer<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let i = self.kind as usize;
        self.clock.calls[i].fetch_add(1, Ordering::Relaxed);
        self.clock.ns[i].fetch_add(ns, Ordering::Relaxed);
    }
}

/// Device calls made so far and the host nanoseconds spent inside them, per kind (the names of
/// [`CALL_KINDS`]). `map` is the mapping alone; the access rights it sets right after are
/// `set_access`; `stream_synchronize` also counts waits on one event (`cuEventSynchronize`, in
/// the cache's synchronize-everything path). Read it twice and take [`since`](Self::since) to measure an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCallTimes {
    /// Calls of each kind, indexed as [`CALL_KINDS`].
    pub calls: [u64; KINDS],
    /// Host nanoseconds spent inside the calls of each kind, indexed as [`CALL_KINDS`].
    pub ns: [u64; KINDS],
}

impl DeviceCallTimes {
    /// `(calls, nanoseconds)` of the kind named `kind` (one of [`CALL_KINDS`]), or of every kind
    /// together for `"all"`; `None` for any other name.
    pub fn get(&self, kind: &str) -> Option<(u64, u64)> {
        if kind == "all" {
            return Some(self.total());
        }
        let i = CALL_KINDS.iter().position(|k| *k == kind)?;
        Some((self.calls[i], self.ns[i]))
    }

    /// `(calls, nanoseconds)` over every kind.
    pub fn total(&self) -> (u64, u64) {
        (
            self.calls.iter().fold(0u64, |a, &b| a.saturating_add(b)),
            self.ns.iter().fold(0u64, |a, &b| a.saturating_add(b)),
        )
    }

    /// `(name, calls, nanoseconds)` for each kind, in the order of [`CALL_KINDS`].
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64, u64)> + '_ {
        CALL_KINDS
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, self.calls[i], self.ns[i]))
    }

    /// What was added between `earlier` (an older reading of the same backend) and `self`.
    pub fn since(&self, earlier: &DeviceCallTimes) -> DeviceCallTimes {
        let mut d = DeviceCallTimes::default();
        for i in 0..KINDS {
            d.calls[i] = self.calls[i].saturating_sub(earlier.calls[i]);
            d.ns[i] = self.ns[i].saturating_sub(earlier.ns[i]);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_call_counts_once_under_its_kind() {
        let clock = CallClock::default();
        {
            let _t = clock.start(CallKind::Unmap);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        drop(clock.start(CallKind::EventQuery));
        let t = clock.snapshot();
        let (calls, ns) = t.get("unmap").unwrap();
        assert_eq!(calls, 1);
        assert!(ns >= 2_000_000, "{ns} ns for a 2 ms call");
        assert_eq!(t.get("event_query").unwrap().0, 1);
        assert_eq!(t.get("map"), Some((0, 0)));
        assert_eq!(t.get("all").unwrap().0, 2);
        assert_eq!(t.get("nope"), None);
        assert_eq!(t.iter().count(), CALL_KINDS.len());
    }

    #[test]
    fn since_subtracts_an_earlier_reading() {
        let clock = CallClock::default();
        drop(clock.start(CallKind::Map));
        let before = clock.snapshot();
        drop(clock.start(CallKind::Map));
        drop(clock.start(CallKind::SetAccess));
        let d = clock.snapshot().since(&before);
        assert_eq!(d.get("map").unwrap().0, 1);
        assert_eq!(d.get("set_access").unwrap().0, 1);
        assert_eq!(d.total().0, 2);
    }

    #[test]
    fn the_names_are_those_of_the_simulated_devices_call_counts() {
        let sim = crate::backend::sim::SimDevice::default().counters();
        let names: Vec<&str> = sim.call_counts().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, CALL_KINDS);
    }
}
