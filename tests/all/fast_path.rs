//! The fast path (per-thread front caches, `cca_fast_path:True`): cache hits, and that it respects
//! `empty_cache`, growth, the OOM path, the fraction cap, double-free detection, `record_stream`,
//! the history recorder, snapshots, thread exit and several allocators per thread; and that its
//! statistics equal the plain core's for the same single-threaded program.

// Test helpers outside `#[test]` functions unwrap too: a failure is the test failing.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::{MIB, with_config};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn fast() -> AllocatorConfig {
    AllocatorConfig::builder().fast_path(true).build().unwrap()
}

fn fast_on(capacity: usize) -> CachingAllocator<SimDevice> {
    with_config(capacity, fast())
}

/// One pair of `size`: the front cache admits a size on its second miss, so the next allocation
/// of it becomes managed (and its free cached).
fn admit(a: &CachingAllocator<SimDevice>, size: usize) {
    let x = a.allocate(size, S0).unwrap();
    a.free(x.ptr).unwrap();
}

#[test]
fn the_knob_is_on_in_the_default_and_off_in_pytorchs_presets() {
    assert!(!AllocatorConfig::pytorch().fast_path);
    assert!(!Preset::Pytorch.config().fast_path);
    assert!(!Preset::PytorchExpandable.config().fast_path);
    assert!(AllocatorConfig::default().fast_path);
    assert!(Preset::Default.config().fast_path);
    assert!(
        AllocatorConfig::parse("cca_fast_path:True")
            .unwrap()
            .fast_path
    );
    assert!(!AllocatorConfig::parse("").unwrap().fast_path);
    let on = AllocatorConfig {
        fast_path: true,
        ..AllocatorConfig::default()
    };
    let a = CachingAllocator::new(SimDevice::default(), on).unwrap();
    assert!(a.fast_path());
    assert!(a.config().fast_path);
    assert!(!with_config(1 << 30, AllocatorConfig::pytorch()).fast_path());
}

#[test]
fn a_hit_returns_the_same_block_and_stats_count_it_freed_while_cached() {
    let a = fast_on(1 << 30);
    // A size is admitted to the front cache the second time it misses.
    let w = a.allocate(1000, S0).unwrap();
    a.free(w.ptr).unwrap();
    assert_eq!(a.flush_thread_caches(), 0, "first sighting: not cached");
    let x = a.allocate(1000, S0).unwrap();
    assert_eq!(x.ptr, w.ptr);
    assert_eq!(a.memory_stats().memory_allocated(), 1024);
    a.free(x.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_allocated(), 0, "allocated bytes drop on free");
    assert_eq!(st.active_bytes.get(StatType::All).current, 0);
    assert_eq!(st.requested_bytes.get(StatType::All).current, 0);
    assert_eq!(st.allocation.get(StatType::SmallPool).freed, 2);
    let y = a.allocate(700, S0).unwrap();
    assert_eq!((y.ptr, y.block_size, y.size), (x.ptr, 1024, 700));
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).allocated, 3);
    assert_eq!(st.requested_bytes.get(StatType::All).current, 700);
    assert_eq!(st.requested_bytes.get(StatType::All).allocated, 2700);
    assert_eq!(st.num_device_alloc, 1);
    // Another stream or another size class is not a hit.
    let z = a.allocate(700, S1).unwrap();
    assert_ne!(z.ptr, y.ptr);
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.flush_thread_caches(), 1);
    assert_eq!(a.flush_thread_caches(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_returns_front_cached_blocks_and_releases_their_segments() {
    let a = fast_on(1 << 30);
    admit(&a, 30 * MIB);
    let xs: Vec<_> = (0..4).map(|_| a.allocate(30 * MIB, S0).unwrap()).collect();
    for x in &xs {
        a.free(x.ptr).unwrap();
    }
    let st = a.memory_stats();
    assert_eq!(st.memory_allocated(), 0);
    assert_eq!(st.memory_reserved(), 4 * 30 * MIB as i64);
    // The snapshot shows the front-cached blocks as inactive.
    let snap = a.snapshot();
    assert!(
        snap.iter()
            .flat_map(|s| &s.blocks)
            .all(|b| b.state == BlockState::Inactive)
    );
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert_eq!(a.backend().counters().live_segments, 0);
    a.check_invariants().unwrap();
}

#[test]
fn front_caches_are_flushed_before_the_core_grows() {
    let a = fast_on(1 << 30);
    admit(&a, 8 * MIB);
    // 8 MiB from a 20 MiB segment: the 12 MiB tail stays free in the core.
    let x = a.allocate(8 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap(); // front-cached, unmerged
    // 14 MiB fits nowhere in the core until the cached block merges with its tail again.
    let y = a.allocate(14 * MIB, S0).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.num_device_alloc, 1, "no new segment");
    assert_eq!(st.memory_reserved(), 20 * MIB as i64);
    assert_eq!(y.ptr, x.ptr);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn the_oom_path_gets_memory_held_in_front_caches() {
    // 64 MiB device: two 20 MiB segments sit in this thread's cache; 60 MiB only fits once they
    // are flushed and released.
    let a = fast_on(64 * MIB);
    admit(&a, 20 * MIB);
    let x = a.allocate(20 * MIB, S0).unwrap();
    let y = a.allocate(20 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 40 * MIB as i64);
    // Both sit in the front cache (unmerged: still allocated for the core).
    assert_eq!(a.memory_stats().memory_allocated(), 0);
    let z = a.allocate(60 * MIB, S0).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 60 * MIB as i64);
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
    a.free(z.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn the_oom_path_gets_memory_held_in_another_threads_cache() {
    let a = fast_on(64 * MIB);
    std::thread::scope(|s| {
        s.spawn(|| {
            admit(&a, 20 * MIB);
            let x = a.allocate(20 * MIB, S0).unwrap();
            let y = a.allocate(20 * MIB, S0).unwrap();
            a.free(x.ptr).unwrap();
            a.free(y.ptr).unwrap();
            // Keep the thread (and its cache) alive while the main thread allocates.
            let z = {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::scope(|s2| {
                    s2.spawn(|| tx.send(a.allocate(60 * MIB, S0)).unwrap());
                });
                rx.recv().unwrap()
            };
            let z = z.unwrap();
            a.free(z.ptr).unwrap();
        });
    });
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().live_segments, 0);
}

#[test]
fn the_fraction_cap_counts_and_reclaims_front_cached_memory() {
    let a = fast_on(1 << 30);
    a.set_memory_fraction(0.1).unwrap(); // ~102 MiB
    admit(&a, 20 * MIB);
    let xs: Vec<_> = (0..4).map(|_| a.allocate(20 * MIB, S0).unwrap()).collect();
    for x in &xs {
        a.free(x.ptr).unwrap();
    }
    let big = a.allocate(100 * MIB, S0).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 100 * MIB as i64);
    assert!(st.memory_reserved() as f64 <= 0.1 * (1u64 << 30) as f64);
    a.free(big.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn double_frees_are_errors_on_every_path() {
    let a = fast_on(1 << 30);
    admit(&a, 4096);
    admit(&a, 8192);
    // Cached in this thread's front cache.
    let x = a.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    assert!(matches!(
        a.record_stream(x.ptr, S1),
        Err(AllocError::FreedPointer { .. })
    ));
    // After a flush the core reports it.
    a.flush_thread_caches();
    assert!(a.free(x.ptr).is_err());
    a.check_invariants().unwrap();
    // Freed from another thread, then again from this one.
    let y = a.allocate(8192, S0).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| a.free(y.ptr).unwrap());
    });
    assert!(a.free(y.ptr).is_err());
    // Cached here, freed again from another thread.
    let z = a.allocate(8192, S0).unwrap();
    a.free(z.ptr).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| assert!(matches!(a.free(z.ptr), Err(AllocError::DoubleFree { .. }))));
    });
    // Unknown and interior pointers are still the core's errors.
    let w = a.allocate(4096, S0).unwrap();
    assert!(matches!(
        a.free(w.ptr.offset(512)),
        Err(AllocError::InteriorPointer { .. })
    ));
    assert!(matches!(
        a.free(DeviceAddr(0xdead_0000)),
        Err(AllocError::UnknownPointer { .. })
    ));
    a.free(w.ptr).unwrap();
    a.check_invariants().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current, 0);
}

/// Regression (#14): with the fast path, `free(u64::MAX)` matched an empty entry of the
/// recent-address cache (keyed by `u64::MAX`, naming descriptor 0), cached the block a user
/// still held, and handed it out again to the next allocation of its size.
#[test]
fn bogus_pointers_never_reach_a_managed_block() {
    let a = fast_on(1 << 30);
    let other = fast_on(1 << 30);
    admit(&a, 4096);
    admit(&other, 8192);
    // Managed by this thread's cache, descriptor 0, held by the user throughout.
    let x = a.allocate(4096, S0).unwrap();
    let foreign = other.allocate(8192, S0).unwrap();
    let mut bogus = vec![
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 511,
        u64::MAX - 512,
        u64::MAX - 4095,
        1u64 << 63,
        1,
        512,
        x.ptr.0 + 1,
        x.ptr.0 + 512,
        x.ptr.0 + 4095,
        x.ptr.0.wrapping_sub(512),
    ];
    if foreign.ptr != x.ptr {
        bogus.push(foreign.ptr.0);
    }
    for p in bogus {
        let r = a.free(DeviceAddr(p));
        assert!(
            matches!(
                r,
                Err(AllocError::UnknownPointer { .. } | AllocError::InteriorPointer { .. })
            ),
            "free({p:#x}) gave {r:?}"
        );
        a.check_invariants().unwrap();
        let y = a.allocate(4096, S0).unwrap();
        assert_ne!(y.ptr, x.ptr, "free({p:#x}) handed a live block out twice");
        a.free(y.ptr).unwrap();
        let st = a.memory_stats();
        assert_eq!(
            st.allocation.get(StatType::All).current,
            1,
            "after free({p:#x})"
        );
    }
    // The null pointer is a no-op, and touches no managed block either.
    a.free(DeviceAddr(0)).unwrap();
    let y = a.allocate(4096, S0).unwrap();
    assert_ne!(y.ptr, x.ptr);
    a.free(y.ptr).unwrap();
    // The real free still works, once.
    a.free(x.ptr).unwrap();
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    other.free(foreign.ptr).unwrap();
    a.check_invariants().unwrap();
    other.check_invariants().unwrap();
}

/// Regression (#14, found by the `ops` fuzz target): an out-of-memory on stream `u64::MAX`
/// panicked in the OOM report (the search for the stream's largest free block ran up to stream
/// `u64::MAX + 1`, wrapped to 0), with the fast path and without.
#[test]
fn an_out_of_memory_on_the_last_stream_is_an_error() {
    for fast_path in [false, true] {
        let a = with_config(
            64 * MIB,
            AllocatorConfig {
                fast_path,
                ..AllocatorConfig::pytorch()
            },
        );
        for s in [StreamId(u64::MAX), StreamId(u64::MAX - 1), S0] {
            // A free block of the large pool on `s`, in a segment a live block keeps.
            let x = a.allocate(4 * MIB, s).unwrap();
            let y = a.allocate(4 * MIB, s).unwrap();
            a.free(y.ptr).unwrap();
            let e = a.allocate(256 * MIB, s).unwrap_err();
            assert!(e.is_out_of_memory(), "{e}");
            a.free(x.ptr).unwrap();
            a.empty_cache().unwrap();
        }
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_free_from_another_thread_returns_the_block() {
    let a = fast_on(1 << 30);
    let xs: Vec<_> = (0..16)
        .map(|k| a.allocate(4096 * (k + 1), S0).unwrap())
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for x in &xs {
                a.free(x.ptr).unwrap();
            }
        });
    });
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current, 0);
    assert_eq!(st.memory_allocated(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn record_stream_blocks_go_through_the_core_events() {
    let a = fast_on(1 << 30);
    admit(&a, MIB);
    let x = a.allocate(MIB, S0).unwrap();
    a.backend().submit_work(S1);
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_allocated(), 0);
    assert_eq!(
        st.active.get(StatType::All).current,
        1,
        "pending on the side stream's event"
    );
    // Not reusable until the work completes.
    let y = a.allocate(MIB, S0).unwrap();
    assert_ne!(y.ptr, x.ptr);
    a.backend().complete_work(S1);
    let z = a.allocate(MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    for p in [y, z] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn the_history_recorder_sees_every_operation() {
    let a = fast_on(1 << 30);
    admit(&a, 4096);
    let x = a.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.record_history(100);
    for _ in 0..3 {
        let y = a.allocate(4096, S0).unwrap();
        a.free(y.ptr).unwrap();
    }
    let (trace, dropped) = a.history();
    assert_eq!(dropped, 0);
    let allocs = trace
        .events
        .iter()
        .filter(|e| matches!(e.op, trace::TraceOp::Alloc { .. }))
        .count();
    let frees = trace
        .events
        .iter()
        .filter(|e| matches!(e.op, trace::TraceOp::Free { .. }))
        .count();
    assert_eq!((allocs, frees), (3, 3));
    a.stop_history();
    let y = a.allocate(4096, S0).unwrap();
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn caches_of_exited_threads_are_taken_back() {
    let a = fast_on(1 << 30);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..10 {
                let x = a.allocate(3 * MIB, S0).unwrap();
                a.free(x.ptr).unwrap();
            }
        });
    });
    // The exited thread's cache holds one block; the next locked operation takes it back.
    assert_eq!(a.memory_stats().memory_allocated(), 0);
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert_eq!(a.backend().counters().live_segments, 0);
    a.check_invariants().unwrap();
}

#[test]
fn a_block_allocated_by_an_exited_thread_can_still_be_freed() {
    let a = fast_on(1 << 30);
    let x = std::thread::scope(|s| s.spawn(|| a.allocate(5000, S0).unwrap()).join().unwrap());
    a.free(x.ptr).unwrap();
    assert!(a.free(x.ptr).is_err());
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().live_segments, 0);
}

#[test]
fn several_allocators_share_a_thread() {
    let a = fast_on(1 << 30);
    let b = fast_on(1 << 30);
    let x = a.allocate(4096, S0).unwrap();
    let y = b.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    b.free(y.ptr).unwrap();
    assert_eq!(a.allocate(4096, S0).unwrap().ptr, x.ptr);
    assert_eq!(b.allocate(4096, S0).unwrap().ptr, y.ptr);
    a.free(x.ptr).unwrap();
    drop(a);
    let c = fast_on(1 << 30);
    let z = c.allocate(4096, S0).unwrap();
    c.free(z.ptr).unwrap();
    b.free(y.ptr).unwrap();
    b.check_invariants().unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn peak_and_accumulated_resets_follow_the_user_view() {
    let a = fast_on(1 << 30);
    admit(&a, MIB);
    let x = a.allocate(MIB, S0).unwrap();
    let y = a.allocate(MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    assert_eq!(a.memory_stats().max_memory_allocated(), 2 * MIB as i64);
    a.reset_peak_stats();
    assert_eq!(a.memory_stats().max_memory_allocated(), 0);
    let z = a.allocate(MIB, S0).unwrap(); // a hit
    assert_eq!(a.memory_stats().max_memory_allocated(), MIB as i64);
    a.reset_accumulated_stats();
    let st = a.memory_stats();
    let s = st.allocated_bytes.get(StatType::All);
    assert_eq!((s.current, s.allocated, s.freed), (MIB as i64, 0, 0));
    a.free(z.ptr).unwrap();
    a.flush_thread_caches();
    let st = a.memory_stats();
    let s = st.allocated_bytes.get(StatType::All);
    assert_eq!((s.current, s.allocated, s.freed), (0, 0, MIB as i64));
    a.check_invariants().unwrap();
}

/// One deterministic single-threaded program: pairs, LIFO batches and a mix of sizes on two
/// streams, with a peak reset and an accumulated reset in the middle.
fn program(a: &CachingAllocator<SimDevice>) {
    let sizes = [
        512,
        1000,
        4096,
        65536,
        MIB,
        3 * MIB,
        8 * MIB,
        12 * MIB,
        64 * MIB,
    ];
    for round in 0..6 {
        for (k, &size) in sizes.iter().enumerate() {
            let s = if k % 3 == 0 { S1 } else { S0 };
            let x = a.allocate(size + round, s).unwrap();
            a.free(x.ptr).unwrap();
            let batch: Vec<_> = (0..5).map(|j| a.allocate(size - j, s).unwrap()).collect();
            for x in batch.iter().rev() {
                a.free(x.ptr).unwrap();
            }
        }
        if round == 2 {
            a.reset_peak_stats();
        }
        if round == 4 {
            a.reset_accumulated_stats();
        }
    }
    let keep: Vec<_> = sizes.iter().map(|&s| a.allocate(s, S0).unwrap()).collect();
    for x in keep.iter().step_by(2) {
        a.free(x.ptr).unwrap();
    }
}

/// Keys whose values may differ with the fast path on, and why. A block in a front cache is not
/// merged with its free neighbours until it is flushed, so the core holds other free blocks
/// meanwhile: it counts fewer, or other, free blocks inside split segments (`inactive_split*`),
/// and its best fit may hand out a large block with an unsplit tail (under 1 MiB) where the plain
/// core would split a merged block exactly, which moves the `allocated` / `freed` / `peak` of
/// `allocated_bytes` and `active_bytes` by that tail. In this program the live set's
/// `allocated_bytes.current`, and every segment count, stays the same.
fn differs_by_design(key: &str) -> bool {
    key.starts_with("inactive_split")
        || ((key.starts_with("allocated_bytes.") || key.starts_with("active_bytes."))
            && !key.ends_with(".current"))
}

#[test]
fn stats_equal_the_plain_core_for_a_single_threaded_program() {
    let off = with_config(4 << 30, AllocatorConfig::pytorch());
    let on = with_config(4 << 30, fast());
    program(&off);
    program(&on);
    on.check_invariants().unwrap();
    let (m_off, m_on) = (off.memory_stats().to_map(), on.memory_stats().to_map());
    for (k, v) in &m_off {
        if !differs_by_design(k) {
            assert_eq!(m_on[k], *v, "{k}");
        }
    }
    // After a flush the caches are empty and the segments the same.
    assert!(on.flush_thread_caches() > 0);
    let m_on = on.memory_stats().to_map();
    for k in [
        "reserved_bytes.all.current",
        "segment.all.current",
        "allocated_bytes.all.current",
    ] {
        assert_eq!(m_on[k], m_off[k], "{k} after a flush");
    }
    on.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, stream: u64 },
    Free { pick: usize },
    Flush,
    EmptyCache,
    ResetPeak,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 1usize..=4096,
        3 => 4096usize..=(MIB + 4096),
        2 => MIB..=(12 * MIB),
        1 => (10 * MIB)..=(48 * MIB),
    ];
    prop_oneof![
        10 => (size, 0u64..2).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::Flush),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeak),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    /// Random single-threaded programs: with the fast path on, the invariants hold after every
    /// step, and the counters that depend only on the user's calls (allocation counts, requested
    /// bytes: current, peak, allocated, freed) equal the plain core's.
    #[test]
    fn random_programs_match_the_plain_core(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        let off = with_config(8 << 30, AllocatorConfig::pytorch());
        let on = with_config(8 << 30, fast());
        let mut live: BTreeMap<u64, (Allocation, Allocation)> = BTreeMap::new();
        let mut n = 0u64;
        for op in ops {
            match op {
                Op::Alloc { size, stream } => {
                    let x = off.allocate(size, StreamId(stream)).unwrap();
                    let y = on.allocate(size, StreamId(stream)).unwrap();
                    prop_assert_eq!(x.size, y.size);
                    live.insert(n, (x, y));
                    n += 1;
                }
                Op::Free { pick } => {
                    if !live.is_empty() {
                        let key = *live.keys().nth(pick % live.len()).unwrap();
                        let (x, y) = live.remove(&key).unwrap();
                        off.free(x.ptr).unwrap();
                        on.free(y.ptr).unwrap();
                        prop_assert!(on.free(y.ptr).is_err(), "double free accepted");
                    }
                }
                Op::Flush => { on.flush_thread_caches(); }
                Op::EmptyCache => {
                    off.empty_cache().unwrap();
                    on.empty_cache().unwrap();
                }
                Op::ResetPeak => {
                    off.reset_peak_stats();
                    on.reset_peak_stats();
                }
            }
            if let Err(v) = on.check_invariants() {
                return Err(TestCaseError::fail(format!("invariant: {v}")));
            }
            let (a, b) = (off.memory_stats(), on.memory_stats());
            for (name, x, y) in [
                ("allocation", &a.allocation, &b.allocation),
                ("active", &a.active, &b.active),
                ("requested_bytes", &a.requested_bytes, &b.requested_bytes),
            ] {
                for t in StatType::ALL {
                    prop_assert_eq!(x.get(t), y.get(t), "{}.{}", name, t.name());
                }
            }
            prop_assert_eq!(
                b.memory_allocated() as usize,
                live.values().map(|(_, y)| y.block_size).sum::<usize>()
            );
            prop_assert!(b.max_memory_allocated() >= b.memory_allocated());
        }
        for (_, (x, y)) in std::mem::take(&mut live) {
            off.free(x.ptr).unwrap();
            on.free(y.ptr).unwrap();
        }
        on.empty_cache().unwrap();
        prop_assert_eq!(on.memory_stats().memory_reserved(), 0);
        prop_assert_eq!(on.backend().counters().live_segments, 0);
    }
}

/// Note [Candidates go back before a miss] in `front/mod.rs`: replaying the shipped PyTorch traces
/// with the fast path on reserves what the same configuration reserves without it (within 0.2%),
/// for PyTorch's configuration and for the crate's default.
#[cfg(feature = "trace-io")]
#[test]
fn front_caches_keep_pytorchs_peak_reserved_on_the_shipped_traces() {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces");
    for name in ["resnet50_train", "gpt2_train", "bert_varlen"] {
        let trace = read_trace_file(dir.join(format!("{name}.csv.gz")), &ImportOptions::strict())
            .unwrap()
            .trace;
        let peak = |config: AllocatorConfig| {
            let a = with_config(80 << 30, config);
            let r = replay(&a, &trace, &ReplayOptions::default()).unwrap();
            a.check_invariants().unwrap();
            r.peak_reserved_bytes as f64
        };
        let (torch, fast) = (peak(AllocatorConfig::pytorch()), peak(fast()));
        assert!(
            fast <= torch * 1.002,
            "{name}: {fast} reserved with the fast path, {torch} without"
        );
        // The same for the crate's default (expandable segments) with the fast path switched on.
        let with_fast_path = AllocatorConfig {
            fast_path: true,
            ..AllocatorConfig::default()
        };
        let (plain, default) = (peak(AllocatorConfig::default()), peak(with_fast_path));
        assert!(
            default <= plain * 1.002,
            "{name}: {default} reserved by the default, {plain} without its fast path"
        );
    }
}

#[test]
fn a_cache_that_does_not_pay_pauses_and_tries_again_after_longer_pauses() {
    let a = fast_on(1 << 30);
    let misses = |n: usize, from: usize| {
        for k in 0..n {
            let x = a.allocate(4096 + 512 * (from + k), S0).unwrap();
            a.free(x.ptr).unwrap();
        }
    };
    let pairs = || {
        for _ in 0..4 {
            let x = a.allocate(1000, S1).unwrap();
            a.free(x.ptr).unwrap();
        }
        a.flush_thread_caches()
    };
    assert_eq!(pairs(), 1, "active: the recurring size is cached");
    // A window of misses with no hits: the cache pauses, and caches nothing meanwhile.
    misses(300, 0);
    assert_eq!(pairs(), 0, "paused");
    // After the pause it tries again.
    misses(8 * 256, 300);
    assert_eq!(pairs(), 1, "active again");
    // A trial window that does not pay doubles the pause: 16 windows now.
    misses(300, 3000);
    misses(14 * 256, 4000);
    assert_eq!(pairs(), 0, "still paused after 8 windows and more");
    misses(2 * 256, 8000);
    assert_eq!(pairs(), 1, "active again after 16 windows");
    a.check_invariants().unwrap();
}

/// Note [Dormant front]: a paused cache with nothing cached hands its live blocks back to the
/// core, and while every cache is so, allocations and frees skip the front. Blocks managed
/// before the pause (long-lived ones, as weights) are then freed by their thread and by
/// another one: each goes back to the core once, the statistics equal those of the same
/// program without the fast path, and the cache hits again after its pause.
#[test]
fn a_paused_cache_hands_back_its_live_blocks_and_the_front_sleeps() {
    let run = |config: AllocatorConfig| {
        let a = std::sync::Arc::new(with_config(1 << 30, config));
        let mut kept = Vec::new();
        for size in [6000, 7000, 9000] {
            admit(&a, size);
            kept.push(a.allocate(size, S0).unwrap().ptr);
        }
        // Three windows of misses with no hits: paused, then dormant.
        for k in 0..3 * 256 {
            let x = a.allocate(20_000 + 512 * k, S0).unwrap();
            a.free(x.ptr).unwrap();
        }
        a.check_invariants().unwrap();
        a.free(kept[0]).unwrap();
        assert!(matches!(
            a.free(kept[0]),
            Err(AllocError::DoubleFree { .. })
        ));
        let (b, p) = (std::sync::Arc::clone(&a), kept[1]);
        std::thread::spawn(move || b.free(p).unwrap())
            .join()
            .unwrap();
        a.check_invariants().unwrap();
        let paused_pairs = {
            for _ in 0..4 {
                let x = a.allocate(1000, S1).unwrap();
                a.free(x.ptr).unwrap();
            }
            a.flush_thread_caches()
        };
        // The rest of the pause (8 windows of 256 misses from the end of the first), then a
        // trial window in which one size recurs.
        for k in 0..6 * 256 - 4 {
            let x = a.allocate(600_000 + 512 * k, S0).unwrap();
            a.free(x.ptr).unwrap();
        }
        let active_pairs = {
            for _ in 0..4 {
                let x = a.allocate(1000, S1).unwrap();
                a.free(x.ptr).unwrap();
            }
            a.flush_thread_caches()
        };
        a.free(kept[2]).unwrap();
        a.check_invariants().unwrap();
        (paused_pairs, active_pairs, a.memory_stats())
    };
    let (paused, active, fast) = run(fast());
    assert_eq!((paused, active), (0, 1), "paused, then active again");
    let (_, _, plain) = run(AllocatorConfig::builder().fast_path(false).build().unwrap());
    for (name, f, p) in [
        ("allocation", fast.allocation, plain.allocation),
        (
            "allocated_bytes",
            fast.allocated_bytes,
            plain.allocated_bytes,
        ),
        (
            "requested_bytes",
            fast.requested_bytes,
            plain.requested_bytes,
        ),
        ("active_bytes", fast.active_bytes, plain.active_bytes),
    ] {
        let (f, p) = (f.get(StatType::All), p.get(StatType::All));
        assert_eq!((f.current, f.peak), (p.current, p.peak), "{name}");
        assert_eq!(f.current, 0, "{name}: everything freed");
    }
}

/// Note [Dormant front] under threads: four threads go through pauses (dormant periods),
/// trials and hits at their own pace, each also freeing blocks another thread allocated (some
/// managed, some handed back); at the end everything is freed exactly once, the statistics are
/// zero and the invariants hold.
#[test]
fn threads_going_dormant_and_waking_free_each_others_blocks_once() {
    use std::sync::{Arc, mpsc};
    let a = Arc::new(fast_on(1 << 32));
    let (tx, rx) = mpsc::channel::<(usize, u64)>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let handles: Vec<_> = (0..4usize)
        .map(|t| {
            let (a, tx, rx) = (Arc::clone(&a), tx.clone(), Arc::clone(&rx));
            std::thread::spawn(move || {
                let mut freed = 0usize;
                for round in 0..3usize {
                    // Kept blocks of a recurring size (managed once admitted), handed over.
                    admit(&a, 4096 * (t + 1));
                    for _ in 0..4 {
                        let x = a.allocate(4096 * (t + 1), S0).unwrap();
                        tx.send((t, x.ptr.0)).unwrap();
                    }
                    // Misses enough for a pause, and another thread's blocks freed meanwhile.
                    for k in 0..10 * 256 + 100 * t {
                        let x = a.allocate(50_000 + 512 * (k + 3000 * round + 10_000 * t), S0);
                        a.free(x.unwrap().ptr).unwrap();
                        if k >= 5 * 256 && k % 128 == 0 {
                            if let Ok((_, p)) = rx.lock().unwrap().try_recv() {
                                a.free(DeviceAddr(p)).unwrap();
                                freed += 1;
                            }
                        }
                    }
                    // Hits of one size (a trial that pays, once the pause is over).
                    for _ in 0..64 {
                        let x = a.allocate(1000 + t, S1).unwrap();
                        a.free(x.ptr).unwrap();
                    }
                }
                freed
            })
        })
        .collect();
    drop(tx);
    let mut freed: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    while let Ok((_, p)) = rx.lock().unwrap().try_recv() {
        a.free(DeviceAddr(p)).unwrap();
        freed += 1;
    }
    assert_eq!(freed, 4 * 3 * 4, "every handed-over block freed once");
    a.check_invariants().unwrap();
    let s = a.memory_stats();
    for (name, v) in [
        ("allocation", s.allocation),
        ("allocated_bytes", s.allocated_bytes),
        ("requested_bytes", s.requested_bytes),
    ] {
        assert_eq!(v.get(StatType::All).current, 0, "{name}");
    }
}

/// Note [Dormant front]: a cache that was ready (paused, managing nothing) and becomes active
/// again must stop saying so at once. Here thread A's pause ends and A's cache manages a block;
/// then thread B, paused with nothing, makes a locked allocation: the front must not go dormant
/// on A's stale answer (a free of A's block would then bypass A's cache).
#[test]
fn a_cache_active_again_keeps_the_front_awake() {
    use std::sync::{Arc, mpsc};
    type Job = Box<dyn FnOnce(&CachingAllocator<SimDevice>) + Send>;
    let a = Arc::new(fast_on(1 << 32));
    // Thread B, kept alive between steps (its cache is thread-local).
    let (tx, rx) = mpsc::channel::<(Job, mpsc::Sender<()>)>();
    let b = {
        let a = Arc::clone(&a);
        std::thread::spawn(move || {
            for (job, done) in rx {
                job(&a);
                done.send(()).unwrap();
            }
        })
    };
    let on_b = |job: Job| {
        let (done_tx, done_rx) = mpsc::channel();
        tx.send((job, done_tx)).unwrap();
        done_rx.recv().unwrap();
    };
    let misses = |a: &CachingAllocator<SimDevice>, n: usize, from: usize| {
        for k in 0..n {
            let x = a.allocate(40_000 + 512 * (from + k), S0).unwrap();
            a.free(x.ptr).unwrap();
        }
    };
    // Both caches pause (a window of misses each) and say they are ready.
    on_b(Box::new(move |a| misses(a, 300, 100_000)));
    misses(&a, 300, 0);
    // A's pause ends (8 windows after the first); A admits a size and keeps a managed block.
    misses(&a, 8 * 256, 1000);
    admit(&a, 6000);
    let kept = a.allocate(6000, S0).unwrap();
    // B, still paused, allocates under the lock.
    on_b(Box::new(move |a| misses(a, 1, 200_000)));
    a.check_invariants().unwrap();
    a.free(kept.ptr).unwrap();
    assert!(matches!(
        a.free(kept.ptr),
        Err(AllocError::DoubleFree { .. })
    ));
    a.check_invariants().unwrap();
    drop(tx);
    b.join().unwrap();
}

/// Note [Dormant front]: a thread without a cache yet, allocating while the front is dormant
/// (the only cache, another thread's, paused), gets its cache and its hits.
#[test]
fn a_new_thread_wakes_a_dormant_front() {
    let a = std::sync::Arc::new(fast_on(1 << 32));
    let b = std::sync::Arc::clone(&a);
    let (paused_tx, paused_rx) = std::sync::mpsc::channel();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        for k in 0..300 {
            let x = b.allocate(40_000 + 512 * k, S0).unwrap();
            b.free(x.ptr).unwrap();
        }
        paused_tx.send(()).unwrap();
        end_rx.recv().unwrap();
    });
    paused_rx.recv().unwrap();
    admit(&a, 6000);
    let x = a.allocate(6000, S0).unwrap();
    a.free(x.ptr).unwrap();
    assert_eq!(
        a.flush_thread_caches(),
        1,
        "this thread's cache held the freed block"
    );
    a.check_invariants().unwrap();
    end_tx.send(()).unwrap();
    t.join().unwrap();
}

/// A cache pays when it hits at least twice per miss over a window (`HITS_PER_MISS`): one hit
/// per miss is not enough (on FSDP2 such caches held blocks out of page reuse's reach and cost
/// more in page moves than their hits saved), three hits per miss are.
#[test]
fn a_cache_pays_only_at_two_hits_per_miss() {
    for (hits, active) in [(1, false), (3, true)] {
        let a = fast_on(1 << 30);
        for k in 0..300 {
            let m = a.allocate(4096 + 512 * k, S0).unwrap();
            a.free(m.ptr).unwrap();
            for _ in 0..hits {
                let h = a.allocate(1000, S1).unwrap();
                a.free(h.ptr).unwrap();
            }
        }
        a.flush_thread_caches();
        for _ in 0..4 {
            let x = a.allocate(1000, S1).unwrap();
            a.free(x.ptr).unwrap();
        }
        assert_eq!(
            a.flush_thread_caches(),
            usize::from(active),
            "{hits} hit(s) per miss: the cache is {}",
            if active { "active" } else { "paused" }
        );
        a.check_invariants().unwrap();
    }
}

/// Note [Stream-sparing flush]: a growth of stream S0 takes back only S0's cached blocks. Under
/// the default (device-wide page reuse), taking another thread's S1 block would let the growth
/// move its pages, and that thread would miss and grow in turn.
#[test]
fn a_growth_spares_other_streams_front_caches() {
    let config = AllocatorConfig::parse("cca_preset:default,cca_fast_path:True").unwrap();
    let a = &with_config(1 << 30, config);
    let (to_main, from_worker) = std::sync::mpsc::channel();
    let (to_worker, from_main) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            for _ in 0..2 {
                // Two misses of (S1, 4 MiB) admit the key to this thread's cache.
                let w = a.allocate(4 * MIB, S1).unwrap();
                a.free(w.ptr).unwrap();
            }
            let x = a.allocate(4 * MIB, S1).unwrap();
            a.free(x.ptr).unwrap(); // cached in this thread's front cache
            to_main.send(x.ptr).unwrap();
            from_main.recv().unwrap(); // the main thread grew meanwhile
            let maps = a.backend().counters().map_calls;
            let y = a.allocate(4 * MIB, S1).unwrap();
            assert_eq!(y.ptr, x.ptr, "a cache hit");
            assert_eq!(a.backend().counters().map_calls, maps, "no growth");
            a.free(y.ptr).unwrap();
        });
        let _cached = from_worker.recv().unwrap();
        let maps = a.backend().counters().map_calls;
        let big = a.allocate(64 * MIB, S0).unwrap();
        assert!(
            a.backend().counters().map_calls > maps,
            "the main thread grew"
        );
        to_worker.send(()).unwrap();
        // Keep `big` until the worker is done, so that its pages cannot serve the worker.
        std::thread::sleep(std::time::Duration::from_millis(50));
        a.free(big.ptr).unwrap();
    });
    a.check_invariants().unwrap();
}

/// The out-of-memory path still takes every stream's cached blocks back.
#[test]
fn the_oom_path_takes_other_streams_front_cached_blocks() {
    let config = AllocatorConfig::parse("cca_preset:default,cca_fast_path:True").unwrap();
    let a = &with_config(64 * MIB, config);
    let (to_main, from_worker) = std::sync::mpsc::channel();
    let (to_worker, from_main) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            for _ in 0..2 {
                let w = a.allocate(20 * MIB, S1).unwrap();
                a.free(w.ptr).unwrap();
            }
            let x = a.allocate(20 * MIB, S1).unwrap();
            let y = a.allocate(20 * MIB, S1).unwrap();
            a.free(x.ptr).unwrap();
            a.free(y.ptr).unwrap();
            to_main.send(()).unwrap();
            from_main.recv().unwrap();
        });
        from_worker.recv().unwrap();
        // 60 MiB on S0 fits only once S1's cached 40 MiB is flushed and its pages reused.
        let z = a.allocate(60 * MIB, S0);
        to_worker.send(()).unwrap(); // before any assertion: the worker must not wait forever
        a.free(z.unwrap().ptr).unwrap();
    });
    a.check_invariants().unwrap();
}

/// Note [Flush before a new peak], its limit to the large pool: 16 threads, each on its own
/// stream, doing 1 MiB (small-pool) pairs at once, in rounds of fresh threads on one allocator
/// (as `gpu_bench` and `examples/thread_settling.rs` run them). Once a round's threads have
/// warmed up behind a barrier, their pairs are cache hits and make no device call. When every
/// small-pool growth that raised the reserved peak flushed all the other threads' caches, page
/// reuse moved the flushed blocks' pages to the growing stream and the next thread missed and
/// grew in turn: device calls in every round's timed part.
#[test]
fn many_streams_at_the_floor_settle_without_moving_pages_while_warm() {
    use std::sync::{Barrier, Mutex};
    const THREADS: usize = 16;
    let a = with_config(1 << 30, AllocatorConfig::default());
    let mut timed_calls = 0u64;
    for _round in 0..4 {
        let (warm, start, end) = (
            Barrier::new(THREADS),
            Barrier::new(THREADS),
            Barrier::new(THREADS),
        );
        let calls = Mutex::new((0u64, 0u64));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (warm, start, end, calls, a) = (&warm, &start, &end, &calls, &a);
                s.spawn(move || {
                    let stream = StreamId(1 + t as u64);
                    for barrier in [warm, start] {
                        for _ in 0..16 {
                            let x = a.allocate(MIB, stream).unwrap();
                            a.free(x.ptr).unwrap();
                        }
                        barrier.wait();
                    }
                    if t == 0 {
                        calls.lock().unwrap().0 = a.backend().counters().device_calls;
                    }
                    for _ in 0..2000 {
                        let x = a.allocate(MIB, stream).unwrap();
                        a.free(x.ptr).unwrap();
                    }
                    end.wait();
                    if t == 0 {
                        calls.lock().unwrap().1 = a.backend().counters().device_calls;
                    }
                });
            }
        });
        let (before, after) = calls.into_inner().unwrap();
        timed_calls += after - before;
    }
    assert_eq!(timed_calls, 0, "device calls while every thread was warm");
    a.check_invariants().unwrap();
}

/// `gpu/host_pair.py`'s same-thread pattern (`gpu/fifo_ring_trace.py` writes it as a trace):
/// sixteen sizes of a transformer step in turn, each allocation freeing the one made eight
/// before. Page reuse moves pages in the first few thousand pairs; the default's cache must
/// still settle into hits afterwards. Before Note [Cached blocks next to free memory] bounded
/// what a miss gives back, every miss gave back blocks that then missed in turn, and the cache
/// stayed paused with nothing in it.
#[test]
fn a_ring_of_mixed_sizes_keeps_hitting_after_page_reuse() {
    const SIZES: [usize; 16] = [
        3072,
        1 << 20,
        2359296,
        4718592,
        6291456,
        9437184,
        512,
        25165824,
        12582912,
        3072,
        786432,
        100663296,
        2359296,
        49152,
        6291456,
        37748736,
    ];
    let a = with_config(80 << 30, AllocatorConfig::default());
    let mut ring: [Option<DeviceAddr>; 8] = [None; 8];
    let mut cached_at_checks = Vec::new();
    for i in 0..40_000 {
        let x = a.allocate(SIZES[i % SIZES.len()], S0).unwrap();
        if let Some(old) = ring[i % 8].replace(x.ptr) {
            a.free(old).unwrap();
        }
        // Every 5,000 pairs once page reuse is done: how many blocks the cache holds (the
        // flush empties it; a working cache fills again within a few rounds).
        if i >= 15_000 && i % 5_000 == 0 {
            cached_at_checks.push(a.flush_thread_caches());
        }
    }
    for p in ring.into_iter().flatten() {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
    assert!(
        a.backend().counters().unmap_calls > 0,
        "page reuse moved no page: the test lost its setting"
    );
    assert!(
        cached_at_checks.iter().all(|&n| n >= 4),
        "blocks in the front cache at each check: {cached_at_checks:?} (a paused cache holds none)"
    );
}
