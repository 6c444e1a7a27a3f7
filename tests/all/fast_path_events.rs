//! The fast path against the plain core when frees wait for `record_stream` events answered
//! late. A fast-path hit does not poll the core's pending events (only an allocation that reaches
//! the core runs `process_events`); these tests pin down what that changes and what it does not
//! (Note [Hits do not poll events] in `src/allocator/front/mod.rs`):
//!
//! * no hit ever serves a block whose events have not completed (the safety rule);
//! * between two misses, a free whose events completed still reads as pending (`active*`,
//!   `requested_bytes`, the snapshot's `active_pending_free`), as if the device had answered
//!   later; the next miss processes it, and from then on the current values agree again, while
//!   the peaks of `active`, `active_bytes` and `requested_bytes` may stay higher;
//! * with events that complete by device state (work done, not a count of queries), every
//!   decision a miss takes is the plain core's: addresses, reserved bytes, retries, OOMs;
//! * `SimDevice::set_event_query_lag` counts queries, and hits make none, so under it a miss can
//!   see an event incomplete that the plain core, having polled it at every allocation, saw
//!   complete: a model artifact, which the OOM path's synchronization bounds (no extra OOM).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::{MIB, with_config};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn pytorch(fast_path: bool) -> AllocatorConfig {
    AllocatorConfig {
        fast_path,
        ..AllocatorConfig::pytorch()
    }
}

/// Pairs of `size` on `S0` until the size is admitted: its next block is managed by this
/// thread's front cache and its free is cached (with the fast path on).
fn warm(a: &CachingAllocator<SimDevice>, size: usize) {
    for _ in 0..3 {
        let x = a.allocate(size, S0).unwrap();
        a.free(x.ptr).unwrap();
    }
}

fn state_of(a: &CachingAllocator<SimDevice>, ptr: DeviceAddr) -> Option<BlockState> {
    a.snapshot()
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.address == ptr)
        .map(|b| b.state)
}

/// The safety rule: a block freed while another stream's queued work still uses it is never
/// served by a hit, however many hits of its very size follow, in the crate's default (expandable
/// segments, page reuse) and in PyTorch's configuration with the fast path, at every query lag.
#[test]
fn a_pending_block_is_never_served_by_a_hit() {
    for config in [AllocatorConfig::default(), pytorch(true)] {
        for size in [4096, 64 * 1024, 8 * MIB] {
            for lag in 0..4 {
                let a = with_config(1 << 30, config.clone());
                let sim = a.backend();
                sim.set_event_query_lag(lag);
                warm(&a, size);
                let x = a.allocate(size, S0).unwrap();
                sim.use_range(S1, x.ptr, x.block_size);
                a.record_stream(x.ptr, S1).unwrap();
                assert_eq!(
                    a.free_with_outcome(x.ptr).unwrap(),
                    FreeOutcome::AwaitingStreams
                );
                for round in 0..200 {
                    let y = a.allocate(size, S0).unwrap();
                    assert!(sim.check_handout(S0, y.ptr, y.block_size));
                    assert_ne!(y.ptr, x.ptr, "size {size} lag {lag} round {round}");
                    a.free(y.ptr).unwrap();
                }
                assert_eq!(state_of(&a, x.ptr), Some(BlockState::ActivePendingFree));
                sim.complete_work(S1);
                // Misses process the events (one query each: `lag` of them answer late); the
                // block is the core's to give again.
                for k in 0..=lag as usize {
                    let z = a.allocate(size + 4096 * (k + 1), S0).unwrap();
                    assert!(sim.check_handout(S0, z.ptr, z.block_size));
                    a.free(z.ptr).unwrap();
                }
                assert_ne!(state_of(&a, x.ptr), Some(BlockState::ActivePendingFree));
                assert!(sim.violations().is_empty(), "{:?}", sim.violations());
                a.check_invariants().unwrap();
            }
        }
    }
}

/// What a hit leaves behind: the side stream's work completed, but no miss has polled its event
/// since, so the fast path still shows the block pending where the plain core shows it free.
/// Reserved memory, allocations and allocated bytes agree throughout; the next miss serves the
/// same address in both, and afterwards only the peaks of the counters a pending block holds up
/// differ.
#[test]
fn hits_leave_a_completed_free_pending_until_the_next_miss() {
    let run = |fast: bool| {
        let a = with_config(1 << 30, pytorch(fast));
        let sim = a.backend();
        // The 4 MiB segment first: a growth to a new peak would flush the front caches (Note
        // [Flush before a new peak]), and the hits below must find their blocks cached.
        let first = a.allocate(4 * MIB, S0).unwrap();
        a.free(first.ptr).unwrap();
        warm(&a, MIB);
        // Two 1 MiB blocks for the hits below (cached in the front with the fast path on).
        let (p, q) = (a.allocate(MIB, S0).unwrap(), a.allocate(MIB, S0).unwrap());
        a.free(p.ptr).unwrap();
        a.free(q.ptr).unwrap();
        let x = a.allocate(4 * MIB, S0).unwrap();
        assert_eq!(x.ptr, first.ptr);
        sim.submit_work(S1);
        a.record_stream(x.ptr, S1).unwrap();
        a.free(x.ptr).unwrap();
        sim.complete_work(S1);
        let queries = sim.counters().event_queries;
        let hits = [a.allocate(MIB, S0).unwrap(), a.allocate(MIB, S0).unwrap()];
        // The plain core polled the event at the first allocation; the hits polled nothing.
        assert_eq!(sim.counters().event_queries - queries, u64::from(!fast));
        let between = (a.memory_stats().to_map(), state_of(&a, x.ptr));
        for h in hits {
            a.free(h.ptr).unwrap();
        }
        // A miss: the events are processed and the freed block is reused.
        let z = a.allocate(4 * MIB, S0).unwrap();
        assert_eq!(
            z.ptr, x.ptr,
            "fast path {fast}: the miss reuses the freed block"
        );
        a.free(z.ptr).unwrap();
        a.check_invariants().unwrap();
        (between, a.memory_stats().to_map())
    };
    let ((off_between, off_state), off_after) = run(false);
    let ((on_between, on_state), on_after) = run(true);
    assert_eq!(off_state, Some(BlockState::Inactive));
    assert_eq!(on_state, Some(BlockState::ActivePendingFree));
    for k in [
        "allocation.all.current",
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "segment.all.current",
        "num_alloc_retries",
        "num_sync_all_streams",
    ] {
        assert_eq!(on_between[k], off_between[k], "{k} between the misses");
    }
    assert_eq!(off_between["active_bytes.all.current"], 2 * MIB as i64);
    assert_eq!(on_between["active_bytes.all.current"], 6 * MIB as i64);
    assert_eq!(off_between["active.all.current"], 2);
    assert_eq!(on_between["active.all.current"], 3);
    // After the miss: every current value agrees; the pending block's stay raised three peaks.
    for (k, v) in &off_after {
        if k.starts_with("inactive_split") {
            continue; // cached blocks do not merge (Note [Candidates go back before a miss])
        }
        let raised = (k.starts_with("active.")
            || k.starts_with("active_bytes.")
            || k.starts_with("requested_bytes."))
            && k.ends_with(".peak");
        if raised {
            assert!(on_after[k] >= *v, "{k}");
        } else if k.ends_with(".current") || k.starts_with("num_") || k.starts_with("reserved") {
            assert_eq!(on_after[k], *v, "{k} after the miss");
        }
    }
    assert_eq!(off_after["active_bytes.all.peak"], 4 * MIB as i64);
    assert_eq!(on_after["active_bytes.all.peak"], 6 * MIB as i64);
}

/// `set_event_query_lag` counts queries: the plain core polls a pending event at every
/// allocation, the fast path only at misses, so under a lag a miss can see an event incomplete
/// that the plain core saw complete. Roomy, the fast path then grows where the plain core reused
/// the block; at the memory's edge its OOM path synchronizes the events and retries, and the
/// allocation succeeds in both (one retry and one device-wide wait more): no OOM the plain core
/// would not have.
#[test]
fn under_a_query_lag_hits_delay_what_a_miss_sees() {
    for (capacity, grows) in [(1 << 30, true), (20 * MIB, false)] {
        let run = |fast: bool| {
            let a = with_config(capacity, pytorch(fast));
            let sim = a.backend();
            sim.set_event_query_lag(3);
            // The segment first, so that no growth flushes the warmed front cache.
            let first = a.allocate(12 * MIB, S0).unwrap();
            a.free(first.ptr).unwrap();
            warm(&a, MIB);
            let x = a.allocate(12 * MIB, S0).unwrap();
            assert_eq!(x.ptr, first.ptr);
            a.record_stream(x.ptr, S1).unwrap();
            a.free(x.ptr).unwrap();
            for _ in 0..3 {
                let h = a.allocate(MIB, S0).unwrap();
                a.free(h.ptr).unwrap();
            }
            let z = a.allocate(12 * MIB, S0).unwrap();
            a.check_invariants().unwrap();
            (z.ptr == x.ptr, a.memory_stats().to_map())
        };
        let (off_reused, off) = run(false);
        let (on_reused, on) = run(true);
        assert!(
            off_reused,
            "the plain core polled the event complete and reused the block"
        );
        if grows {
            assert!(!on_reused);
            assert_eq!(on["segment.large_pool.current"], 2);
            assert_eq!(off["segment.large_pool.current"], 1);
            assert_eq!(on["num_alloc_retries"], 0);
        } else {
            assert_eq!(on["num_alloc_retries"], off["num_alloc_retries"] + 1);
            assert_eq!(on["num_sync_all_streams"], off["num_sync_all_streams"] + 1);
            assert_eq!(on["segment.large_pool.current"], 1);
        }
        assert_eq!(on["num_ooms"], 0);
        assert_eq!(off["num_ooms"], 0);
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A small request (the front's sizes) or one above the front's bound (always the core's).
    Alloc {
        size: usize,
        stream: u64,
    },
    Free {
        pick: usize,
    },
    /// Work on `stream` that uses the picked allocation, declared with `record_stream`.
    RecordStream {
        pick: usize,
        stream: u64,
    },
    Submit {
        stream: u64,
    },
    Complete {
        stream: u64,
    },
    EmptyCache,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        3 => proptest::sample::select(vec![4096usize, 8192, 65536]),
        2 => (257 * MIB)..=(700 * MIB),
    ];
    prop_oneof![
        10 => (size, 0u64..2).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        4 => (any::<usize>(), 1u64..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (1u64..3).prop_map(|stream| Op::Submit { stream }),
        3 => (1u64..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

/// The statistics a miss's decisions set, which must agree at every step.
fn decided(k: &str) -> bool {
    k.starts_with("allocation.")
        || k.starts_with("reserved_bytes.large_pool.")
        || k.starts_with("segment.large_pool.")
        || (k.starts_with("allocated_bytes.") && k.ends_with(".current"))
        || matches!(k, "num_alloc_retries" | "num_ooms" | "num_sync_all_streams")
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    /// Random programs of `record_stream` frees whose events complete by device state (query
    /// lag 0, work submitted and completed at random): the large allocations (always the core's)
    /// get the same addresses and the same out-of-memory outcomes with the fast path on and off,
    /// the decided statistics agree at every step, no hand-out breaks the safety rule, and the
    /// fast path's `active` count is never below the plain core's (a pending block can only
    /// stay pending longer).
    #[test]
    fn misses_decide_alike_when_events_complete_by_device_state(
        capacity_mib in 600usize..3000,
        ops in proptest::collection::vec(op_strategy(), 1..150),
    ) {
        let off = with_config(capacity_mib * MIB, pytorch(false));
        let on = with_config(capacity_mib * MIB, pytorch(true));
        let mut live: BTreeMap<u64, (Allocation, Allocation)> = BTreeMap::new();
        let mut n = 0u64;
        let pick = |live: &BTreeMap<u64, (Allocation, Allocation)>, p: usize| {
            (!live.is_empty()).then(|| *live.keys().nth(p % live.len()).unwrap())
        };
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Alloc { size, stream } => {
                    let s = StreamId(stream);
                    match (off.allocate(size, s), on.allocate(size, s)) {
                        (Ok(x), Ok(y)) => {
                            prop_assert!(on.backend().check_handout(s, y.ptr, y.block_size));
                            if size > 256 * MIB {
                                prop_assert_eq!(x.ptr, y.ptr, "op {}", i);
                            }
                            live.insert(n, (x, y));
                            n += 1;
                        }
                        (Err(a), Err(b)) => {
                            prop_assert!(a.is_out_of_memory() && b.is_out_of_memory());
                        }
                        (x, y) => prop_assert!(false, "op {} {:?}: off {:?}, on {:?}", i, op, x.map(|a| a.ptr), y.map(|a| a.ptr)),
                    }
                }
                Op::Free { pick: p } => {
                    if let Some(k) = pick(&live, p) {
                        let (x, y) = live.remove(&k).unwrap();
                        off.free(x.ptr).unwrap();
                        on.free(y.ptr).unwrap();
                    }
                }
                Op::RecordStream { pick: p, stream } => {
                    if let Some(k) = pick(&live, p) {
                        let (x, y) = live[&k];
                        let s = StreamId(stream);
                        off.backend().use_range(s, x.ptr, x.block_size);
                        on.backend().use_range(s, y.ptr, y.block_size);
                        off.record_stream(x.ptr, s).unwrap();
                        on.record_stream(y.ptr, s).unwrap();
                    }
                }
                Op::Submit { stream } => {
                    off.backend().submit_work(StreamId(stream));
                    on.backend().submit_work(StreamId(stream));
                }
                Op::Complete { stream } => {
                    off.backend().complete_work(StreamId(stream));
                    on.backend().complete_work(StreamId(stream));
                }
                Op::EmptyCache => {
                    off.empty_cache().unwrap();
                    on.empty_cache().unwrap();
                }
            }
            if let Err(v) = on.check_invariants() {
                return Err(TestCaseError::fail(format!("invariant: {v}")));
            }
            prop_assert!(on.backend().violations().is_empty(), "{:?}", on.backend().violations());
            let (a, b) = (off.memory_stats().to_map(), on.memory_stats().to_map());
            for (k, v) in &a {
                if decided(k) {
                    prop_assert_eq!(b[k], *v, "op {} {:?}: {}", i, op, k);
                }
            }
            prop_assert!(b["active.all.current"] >= a["active.all.current"], "op {}", i);
        }
    }
}
