//! Graph capture on the simulated device: private pools (`begin_allocate_to_pool` /
//! `end_allocate_to_pool` / `release_pool`), pool isolation with every policy on, pool sharing,
//! release, deferred `record_stream` frees, the rules while a capture is underway (no illegal
//! device call under a global-mode capture), out of memory during a capture, bad pool calls, and
//! a property test of programs mixing captured and uncaptured work.

use std::collections::BTreeMap;
use std::sync::Arc;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::MIB;

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

pub(crate) fn sim_alloc(capacity: usize, config: AllocatorConfig) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::with_capacity(capacity), config).unwrap()
}

fn overlaps(a: &Allocation, b: &Allocation) -> bool {
    a.ptr.0 < b.ptr.0 + b.block_size as u64 && b.ptr.0 < a.ptr.0 + a.block_size as u64
}

/// Opens a global-mode capture on `stream` and routes it into `pool`.
pub(crate) fn capture(a: &CachingAllocator<SimDevice>, stream: StreamId, pool: MemPoolId) -> u64 {
    let id = a
        .backend()
        .begin_capture(stream, SimCaptureMode::Global)
        .unwrap();
    a.begin_allocate_to_capture(pool, id).unwrap();
    id
}

pub(crate) fn end(a: &CachingAllocator<SimDevice>, stream: StreamId, pool: MemPoolId) {
    a.backend().end_capture(stream).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
}

#[test]
fn captured_allocations_go_to_the_private_pool_and_their_frees_return_there() {
    for (name, config) in crate::util::four_configs() {
        let a = sim_alloc(1 << 30, config);
        // A cached default-pool block of the size the capture will ask for (freed several times
        // so that the fast path manages it).
        let mut before = Vec::new();
        for _ in 0..4 {
            let x = a.allocate(4096, S0).unwrap();
            before.push(x);
            a.free(x.ptr).unwrap();
        }
        let pool = MemPoolId::new_graph();
        capture(&a, S0, pool);
        assert!(a.capture_underway());
        let x = a.allocate(4096, S0).unwrap();
        assert!(
            before.iter().all(|b| !overlaps(b, &x)),
            "{name}: a captured allocation got a default-pool block"
        );
        a.check_invariants().unwrap();
        a.free(x.ptr).unwrap();
        let y = a.allocate(4096, S0).unwrap();
        assert_eq!(
            y.ptr, x.ptr,
            "{name}: a free during the capture returns to the pool"
        );
        // Uncaptured work on another stream meanwhile stays in the default pools.
        let z = a.allocate(4096, S1).unwrap();
        assert!(!overlaps(&z, &y), "{name}");
        end(&a, S0, pool);
        assert!(!a.capture_underway());
        a.free(y.ptr).unwrap();
        // After the capture the same request on the same stream is served from the default pool.
        let w = a.allocate(4096, S0).unwrap();
        assert!(
            !overlaps(&w, &y),
            "{name}: an uncaptured allocation got the graph's block"
        );
        assert!(
            before.iter().any(|b| b.ptr == w.ptr),
            "{name}: default block reused"
        );
        a.check_invariants().unwrap();
        for p in [w, z] {
            a.free(p.ptr).unwrap();
        }
        assert_eq!(a.pool_use_count(pool), Some(1));
        a.release_pool(pool).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.pool_use_count(pool), None);
        assert_eq!(a.memory_stats().memory_reserved(), 0, "{name}");
        a.check_invariants().unwrap();
        assert!(a.backend().capture_violations().is_empty(), "{name}");
    }
}

#[test]
fn private_blocks_are_never_served_to_uncaptured_work() {
    for (name, config) in crate::util::four_configs() {
        let a = sim_alloc(1 << 30, config);
        let pool = MemPoolId::new_graph();
        capture(&a, S0, pool);
        let sizes = [512, 4096, 300 << 10, 3 * MIB, 12 * MIB, 25 * MIB];
        let graph: Vec<Allocation> = sizes.iter().map(|&s| a.allocate(s, S0).unwrap()).collect();
        // Half freed during the capture, half after it.
        for g in &graph[..3] {
            a.free(g.ptr).unwrap();
        }
        end(&a, S0, pool);
        for g in &graph[3..] {
            a.free(g.ptr).unwrap();
        }
        // Uncaptured work of every size on every stream, with cache flushes in between.
        for round in 0..3 {
            let mut live = Vec::new();
            for &s in &sizes {
                for stream in [S0, S1, S2] {
                    let x = a.allocate(s, stream).unwrap();
                    for g in &graph {
                        assert!(
                            !overlaps(&x, g),
                            "{name}: round {round}: {x:?} overlaps the graph's {g:?}"
                        );
                    }
                    live.push(x);
                }
            }
            for x in live {
                a.free(x.ptr).unwrap();
            }
            a.flush_thread_caches();
            a.check_invariants().unwrap();
        }
        // A second replay-time capture into the same pool finds the graph's blocks again.
        a.create_pool(pool).unwrap();
        capture(&a, S0, pool);
        let again = a.allocate(sizes[0], S0).unwrap();
        assert!(graph.iter().any(|g| overlaps(g, &again)), "{name}");
        a.free(again.ptr).unwrap();
        end(&a, S0, pool);
        a.check_invariants().unwrap();
        assert!(a.backend().capture_violations().is_empty(), "{name}");
    }
}

/// The first graph goes (reset, or collected by Python) while a second captures into its pool:
/// its use goes, the routing's own stays until the routing ends. Before, every release during a
/// routing was refused, and the interop's `GraphPool`, which gives its use back once on drop,
/// leaked it for good (an adversarial review).
#[test]
fn a_graphs_use_goes_while_another_capture_routes_into_the_pool() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let pool = MemPoolId::new_user();
    capture(&a, S0, pool);
    end(&a, S0, pool);
    capture(&a, S1, pool);
    a.release_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), Some(1));
    let e = a.release_pool(pool).unwrap_err();
    assert!(e.to_string().contains("end_allocate_to_pool"), "{e}");
    end(&a, S1, pool);
    a.release_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), None);
    a.check_invariants().unwrap();
}

#[test]
fn two_captures_share_one_pool() {
    let a = sim_alloc(1 << 30, AllocatorConfig::default());
    let pool = MemPoolId::new_user();
    capture(&a, S0, pool);
    let x = a.allocate(MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    end(&a, S0, pool);
    assert_eq!(a.pool_use_count(pool), Some(1));
    // The second graph captures into the first one's pool (PyTorch's `pool=g1.pool()`).
    capture(&a, S1, pool);
    assert_eq!(a.pool_use_count(pool), Some(2));
    // Different stream, so a different block of the same pool (blocks are per stream).
    let y = a.allocate(MIB, S1).unwrap();
    assert_ne!(y.ptr, x.ptr);
    a.free(y.ptr).unwrap();
    end(&a, S1, pool);
    // A third on the first stream reuses the first graph's block.
    capture(&a, S0, pool);
    let z = a.allocate(MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    a.free(z.ptr).unwrap();
    end(&a, S0, pool);
    assert_eq!(a.pool_use_count(pool), Some(3));
    let reserved = a.memory_stats().memory_reserved();
    for left in [2, 1] {
        a.release_pool(pool).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.pool_use_count(pool), Some(left));
        assert_eq!(a.memory_stats().memory_reserved(), reserved, "still in use");
    }
    a.release_pool(pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.pool_use_count(pool), None);
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn release_and_empty_cache_return_the_memory_once_the_blocks_are_free() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let pool = MemPoolId::new_graph();
    capture(&a, S0, pool);
    let kept = a.allocate(5 * MIB, S0).unwrap(); // its own 20 MiB segment
    let gone = a.allocate(1000, S0).unwrap(); // a 2 MiB segment
    end(&a, S0, pool);
    a.free(gone.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(
        st.memory_reserved(),
        22 * MIB as i64,
        "private memory counts as reserved"
    );
    assert_eq!(st.memory_allocated(), 5 * MIB as i64);
    // In use: empty_cache leaves the pool alone.
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 22 * MIB as i64);
    // Released: the free segment goes back at the next empty_cache, not before.
    a.release_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), Some(0));
    assert_eq!(a.memory_stats().memory_reserved(), 22 * MIB as i64);
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 20 * MIB as i64);
    assert_eq!(a.backend().counters().live_segments, 1);
    // A released pool's id cannot be routed to again while it holds memory.
    let err = a
        .begin_allocate_to_pool(pool, Box::new(|_| true))
        .unwrap_err();
    assert!(matches!(err, AllocError::InvalidPool { .. }), "{err}");
    assert!(err.to_string().contains("empty_cache"), "{err}");
    // The live block returns to its (freeable) pool, and goes at the next empty_cache.
    a.free(kept.ptr).unwrap();
    let again = a.allocate(5 * MIB, S0).unwrap();
    assert_ne!(
        again.ptr, kept.ptr,
        "a freeable pool's block is not served to anyone"
    );
    a.free(again.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.pool_use_count(pool), None);
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn frees_with_recorded_streams_are_deferred_until_the_capture_ends() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let sim = a.backend();
    let x = a.allocate(4096, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    sim.submit_work(S1);
    let pool = MemPoolId::new_graph();
    capture(&a, S2, pool);
    let records = sim.counters().event_records;
    let queries = sim.counters().event_queries;
    a.free(x.ptr).unwrap();
    assert_eq!(
        sim.counters().event_records,
        records,
        "no event during the capture"
    );
    let st = a.memory_stats();
    assert_eq!(
        st.active.get(StatType::All).current,
        1,
        "the block stays active"
    );
    assert_eq!(st.allocation.get(StatType::All).current, 0);
    let pending = a.snapshot()[0].blocks[0].state;
    assert_eq!(pending, BlockState::ActivePendingFree);
    a.check_invariants().unwrap();
    // Neither uncaptured nor captured work gets it, and no event is queried.
    let y = a.allocate(4096, S0).unwrap();
    assert_ne!(y.ptr, x.ptr);
    let g = a.allocate(4096, S2).unwrap();
    assert_ne!(g.ptr, x.ptr);
    assert_eq!(sim.counters().event_queries, queries);
    end(&a, S2, pool);
    assert_eq!(
        sim.counters().event_records,
        records + 1,
        "recorded at the end"
    );
    a.check_invariants().unwrap();
    // Still pending until S1's work is done.
    a.free(y.ptr).unwrap();
    let z = a.allocate(4096, S0).unwrap();
    assert_eq!(z.ptr, y.ptr);
    sim.complete_work(S1);
    let w = a.allocate(4096, S0).unwrap();
    assert_eq!(w.ptr, x.ptr, "free once the stream's work completed");
    for p in [z, w, g] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
    assert!(sim.capture_violations().is_empty());
}

/// A program that exercises every mechanism that synchronizes or queries: pending events,
/// expandable segments with page reuse, cross-stream reuse, garbage collection under a cap.
fn busy_program_during_capture(a: &CachingAllocator<SimDevice>) -> Vec<Allocation> {
    let sim = a.backend();
    let mut live = Vec::new();
    let x = a.allocate(3 * MIB, S1).unwrap();
    a.record_stream(x.ptr, S2).unwrap();
    sim.submit_work(S2);
    a.free(x.ptr).unwrap(); // pending event, queried by the next allocation outside a capture
    for i in 0..6 {
        let y = a.allocate((i + 1) * 7 * MIB, S1).unwrap();
        a.free(y.ptr).unwrap(); // free cached memory page reuse or a handover could take
    }
    let pool = MemPoolId::new_graph();
    capture(a, S0, pool);
    let quiet = |c: SimCounters| (c.event_queries, c.synchronize_calls);
    let before = quiet(sim.counters());
    for i in 0..40usize {
        let s = [1000, 64 << 10, 3 * MIB, 11 * MIB, 30 * MIB][i % 5];
        let stream = if i % 3 == 0 { S2 } else { S0 };
        let p = a.allocate(s, stream).unwrap();
        if i % 2 == 0 {
            a.record_stream(p.ptr, S1).unwrap();
            a.free(p.ptr).unwrap();
        } else {
            live.push(p);
        }
        a.check_invariants().unwrap();
    }
    assert!(matches!(
        a.empty_cache(),
        Err(AllocError::CaptureUnderway { .. })
    ));
    // Legal or not (a relaxed query of an event recorded outside the capture is legal), the
    // cache neither queries nor synchronizes while a capture is underway (Note [Capture
    // underway], PyTorch's rule).
    assert_eq!(quiet(sim.counters()), before);
    end(a, S0, pool);
    live
}

#[test]
fn no_illegal_device_call_during_a_global_mode_capture() {
    for (name, config) in crate::util::four_configs() {
        let config = AllocatorConfigBuilder::from_config(config)
            .memory_fraction(0.9)
            .garbage_collection_threshold(0.5)
            .build()
            .unwrap();
        let a = sim_alloc(2 << 30, config);
        let live = busy_program_during_capture(&a);
        let v = a.backend().capture_violations();
        assert!(v.is_empty(), "{name}: {v:?}");
        for p in live {
            a.free(p.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
    }
}

#[test]
fn the_violation_log_catches_allocation_calls_made_outside_relaxed_mode() {
    // The control for the test above: a backend that did not exchange the capture mode around
    // its allocation calls would be caught.
    let a = sim_alloc(1 << 30, AllocatorConfig::default());
    a.backend().set_relaxed_allocation_calls(false);
    let pool = MemPoolId::new_graph();
    capture(&a, S0, pool);
    let x = a.allocate(MIB, S0).unwrap();
    let v = a.backend().capture_violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].operation, "allocate");
    assert_eq!(v[0].mode, SimCaptureMode::Global);
    a.free(x.ptr).unwrap();
    end(&a, S0, pool);
    // And a synchronization during a capture is logged whatever the mode exchange.
    let sim = SimDevice::default();
    sim.begin_capture(S0, SimCaptureMode::Global).unwrap();
    sim.synchronize().unwrap();
    assert_eq!(sim.capture_violations()[0].operation, "synchronize");
    sim.end_capture(S0).unwrap();
    let relaxed = SimDevice::default();
    relaxed.begin_capture(S0, SimCaptureMode::Relaxed).unwrap();
    relaxed.synchronize().unwrap();
    assert!(relaxed.capture_violations().is_empty());
}

#[test]
fn queries_outside_a_capture_are_legal_in_relaxed_mode_and_captured_events_never() {
    // `gpu/probes/capture_queries.cu`: while another thread captures in global mode, an event
    // query, an event wait or a stream query in the thread's default mode invalidates the
    // capture; exchanged to relaxed (as `CudaDevice` does) each is legal, as long as the event
    // was not recorded in the capture and the stream is not capturing.
    let sim = SimDevice::default();
    let e = sim.create_event().unwrap();
    sim.submit_work(S1);
    sim.record_event(e, S1).unwrap();
    let cap = sim.begin_capture(S0, SimCaptureMode::Global).unwrap();
    sim.query_event(e).unwrap();
    sim.synchronize_event(e).unwrap();
    sim.synchronize_stream(S1).unwrap();
    assert!(sim.capture_violations().is_empty());
    // A backend without the exchange would be caught.
    sim.set_relaxed_allocation_calls(false);
    sim.query_event(e).unwrap();
    sim.set_relaxed_allocation_calls(true);
    let v = sim.capture_violations();
    assert_eq!((v.len(), v[0].operation), (1, "query_event"), "{v:?}");
    // An event recorded in the capture, or the capturing stream itself: illegal in any mode.
    let inside = sim.create_event().unwrap();
    sim.record_event(inside, S0).unwrap();
    sim.query_event(inside).unwrap();
    sim.synchronize_stream(S0).unwrap();
    let ops: Vec<_> = sim.capture_violations()[1..]
        .iter()
        .map(|v| v.operation)
        .collect();
    assert_eq!(ops, ["query_event", "synchronize_stream"]);
    assert!(sim.capture_violations().iter().all(|v| v.capture == cap));
    sim.end_capture(S0).unwrap();
    // Once the capture has ended its events may be queried again.
    sim.query_event(inside).unwrap();
    assert_eq!(sim.capture_violations().len(), 3);
}

#[test]
fn a_pinned_allocation_during_another_threads_capture_is_legal() {
    // A block of the pinned cache waits for a copy's event; a global-mode capture starts on
    // another stream; the next pinned allocation polls (and, with waits, waits on) the event,
    // which the backend does in relaxed mode: no capture violation (found by a review).
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(dev.clone(), SimHostConfig::default());
    let c = PinnedCache::new(host, PinnedConfig::default().with_slab_size(MIB)).unwrap();
    let a = c.alloc(MIB).unwrap();
    dev.use_range(S1, DeviceAddr(a.ptr.addr() as u64), MIB);
    c.record_stream(a.ptr, S1).unwrap();
    c.free(a.ptr).unwrap();
    dev.begin_capture(S2, SimCaptureMode::Global).unwrap();
    let b = c.alloc(MIB).unwrap();
    assert!(
        dev.capture_violations().is_empty(),
        "{:?}",
        dev.capture_violations()
    );
    dev.end_capture(S2).unwrap();
    c.free(b.ptr).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn out_of_memory_during_a_capture_is_a_clear_error_without_releases() {
    let a = sim_alloc(64 * MIB, AllocatorConfig::pytorch());
    let sim = a.backend();
    // 40 MiB cached (free) in the default pool: outside a capture they would be released.
    let big = a.allocate(40 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    let pool = MemPoolId::new_graph();
    capture(&a, S0, pool);
    let (syncs, frees) = (sim.counters().synchronize_calls, sim.counters().free_calls);
    let err = a.allocate(30 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory());
    assert!(err.oom_report().is_some());
    match &err {
        AllocError::CaptureOutOfMemory { pool: p, .. } => assert_eq!(*p, pool),
        other => panic!("expected CaptureOutOfMemory, got {other}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("during a graph capture"), "{msg}");
    assert!(msg.contains(&pool.to_string()), "{msg}");
    assert!(msg.contains("CUDA out of memory"), "{msg}");
    assert_eq!(sim.counters().synchronize_calls, syncs);
    assert_eq!(sim.counters().free_calls, frees);
    assert!(sim.capture_violations().is_empty());
    a.check_invariants().unwrap();
    // The allocator is intact: smaller captured work still fits, and after the capture the
    // ordinary chain releases the cached block.
    let small = a.allocate(MIB, S0).unwrap();
    a.free(small.ptr).unwrap();
    end(&a, S0, pool);
    let after = a.allocate(30 * MIB, S1).unwrap();
    a.free(after.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn bad_pool_calls_are_clear_errors_that_change_nothing() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let err = a
        .begin_allocate_to_pool(MemPoolId::DEFAULT, Box::new(|_| true))
        .unwrap_err();
    assert!(err.to_string().contains("default pool"), "{err}");
    assert!(a.create_pool(MemPoolId(0, 0)).is_err());
    assert!(!a.capture_underway());
    let pool = MemPoolId::new_user();
    let err = a.end_allocate_to_pool(pool).unwrap_err();
    assert!(err.to_string().contains("not being routed"), "{err}");
    assert!(matches!(
        a.release_pool(pool),
        Err(AllocError::InvalidPool { .. })
    ));
    a.begin_allocate_to_pool(pool, Box::new(|s| s == S1))
        .unwrap();
    let err = a
        .begin_allocate_to_pool(pool, Box::new(|_| true))
        .unwrap_err();
    assert!(err.to_string().contains("already"), "{err}");
    let err = a.release_pool(pool).unwrap_err();
    assert!(err.to_string().contains("end_allocate_to_pool"), "{err}");
    assert_eq!(a.pool_use_count(pool), Some(1));
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
    assert_eq!(
        a.pool_use_count(pool),
        None,
        "an empty released pool is forgotten"
    );
    assert!(a.release_pool(pool).is_err());
    a.check_invariants().unwrap();
}

#[test]
fn the_newest_routing_wins_and_a_thread_filter_routes_without_a_capture() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let (p1, p2) = (MemPoolId::new_user(), MemPoolId::new_user());
    a.begin_allocate_to_pool(p1, Box::new(|_| true)).unwrap();
    let x = a.allocate(1000, S0).unwrap();
    a.begin_allocate_to_pool(p2, Box::new(|s| s == S0)).unwrap();
    let y = a.allocate(1000, S0).unwrap();
    let z = a.allocate(1000, S1).unwrap();
    a.end_allocate_to_pool(p2).unwrap();
    a.end_allocate_to_pool(p1).unwrap();
    for p in [x, y, z] {
        a.free(p.ptr).unwrap();
    }
    // Which pool each went to shows in where the same requests land when routed again.
    for (pool, stream, want) in [(p1, S0, x), (p2, S0, y), (p1, S1, z)] {
        a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
        let again = a.allocate(1000, stream).unwrap();
        assert_eq!(again.ptr, want.ptr, "{pool} on {stream}");
        a.free(again.ptr).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
    }
    let uncaptured = a.allocate(1000, S0).unwrap();
    assert!([x, y, z].iter().all(|p| p.ptr != uncaptured.ptr));
    a.free(uncaptured.ptr).unwrap();
    a.check_invariants().unwrap();
}

/// `routed_pool` names the pool an allocation on a stream would be served from now, and
/// `pool_of` the pool a live allocation's memory is (the cudarc interop asks both at a drop
/// inside a capture: Note [Drops inside a capture]).
#[test]
fn routed_pool_and_pool_of_name_the_private_pools() {
    for (name, config) in crate::util::four_configs() {
        let a = sim_alloc(1 << 30, config);
        let before = a.allocate(4096, S0).unwrap();
        assert_eq!(a.routed_pool(S0), None, "{name}: no routing yet");
        let pool = MemPoolId::new_graph();
        capture(&a, S0, pool);
        assert_eq!(
            a.routed_pool(S0),
            Some(pool),
            "{name}: the capturing stream"
        );
        assert_eq!(
            a.routed_pool(S1),
            None,
            "{name}: a stream outside the capture"
        );
        let inside = a.allocate(4096, S0).unwrap();
        assert_eq!(a.pool_of(inside.ptr), Some(pool), "{name}");
        assert_eq!(a.pool_of(before.ptr), None, "{name}: default-pool memory");
        assert_eq!(
            a.pool_of(DeviceAddr(u64::MAX)),
            None,
            "{name}: no allocation there"
        );
        assert_eq!(
            a.pool_of(inside.ptr.offset(512)),
            None,
            "{name}: an interior address"
        );
        a.free(inside.ptr).unwrap();
        assert_eq!(a.pool_of(inside.ptr), None, "{name}: freed");
        end(&a, S0, pool);
        assert_eq!(a.routed_pool(S0), None, "{name}: the routing ended");
        a.free(before.ptr).unwrap();
        a.release_pool(pool).unwrap();
        a.check_invariants().unwrap();
    }
}

#[test]
fn streams_joined_into_a_capture_are_routed_too() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let sim = a.backend();
    let pool = MemPoolId::new_graph();
    capture(&a, S0, pool);
    // Fork: S1 waits on an event recorded in the capture, so it joins it.
    let ev = sim.create_event().unwrap();
    sim.record_event(ev, S0).unwrap();
    sim.stream_wait_event(S1, ev).unwrap();
    assert_eq!(
        sim.stream_capture_id(S1).unwrap(),
        sim.stream_capture_id(S0).unwrap()
    );
    let forked = a.allocate(4096, S1).unwrap();
    // The public helper builds the same filter from a backend handle.
    let handle = std::sync::Arc::new(SimDevice::default());
    let id = handle.begin_capture(S2, SimCaptureMode::Global).unwrap();
    let f = capture_filter(std::sync::Arc::clone(&handle), id);
    assert!(f(S2) && !f(S0));
    handle.end_capture(S2).unwrap();
    assert!(!f(S2));
    let outside = a.allocate(4096, S2).unwrap();
    end(&a, S0, pool);
    assert_eq!(sim.stream_capture_id(S1).unwrap(), None);
    a.free(forked.ptr).unwrap();
    a.free(outside.ptr).unwrap();
    // S1's uncaptured allocation now must not get the forked block.
    let later = a.allocate(4096, S1).unwrap();
    assert_ne!(later.ptr, forked.ptr);
    a.free(later.ptr).unwrap();
    a.check_invariants().unwrap();
    // SAFETY: the event came from `create_event` above and is destroyed once.
    unsafe { sim.destroy_event(ev).unwrap() };
}

// ---- property test ------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, stream: u64 },
    Free { pick: usize },
    Begin { stream: u64, share: bool },
    End,
    Release { pick: usize },
    EmptyCache,
    RecordStream { pick: usize, stream: u64 },
    SubmitWork { stream: u64 },
    CompleteWork { stream: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 1usize..=4096,
        3 => 4096usize..=(MIB + 4096),
        2 => MIB..=(12 * MIB),
        1 => (10 * MIB)..=(40 * MIB),
    ];
    prop_oneof![
        10 => (size, 0..3u64).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (0..3u64, any::<bool>()).prop_map(|(stream, share)| Op::Begin { stream, share }),
        2 => Just(Op::End),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => Just(Op::EmptyCache),
        2 => (any::<usize>(), 0..3u64).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0..3u64).prop_map(|stream| Op::SubmitWork { stream }),
        1 => (0..3u64).prop_map(|stream| Op::CompleteWork { stream }),
    ]
}

/// Runs `ops`, checking after each step: the invariants; no illegal device call; no live
/// allocations overlap; an uncaptured allocation never overlaps a block a private pool still
/// holds, and a captured one never overlaps another pool's.
fn run_program(config: AllocatorConfig, ops: &[Op]) -> Result<(), TestCaseError> {
    let a = sim_alloc(256 * MIB, config);
    let sim = a.backend();
    let mut live: Vec<(Allocation, MemPoolId)> = Vec::new();
    // Blocks each pool has handed out (by pool), forgotten when the pool is.
    let mut private: BTreeMap<MemPoolId, Vec<Allocation>> = BTreeMap::new();
    let mut open: Option<(StreamId, MemPoolId)> = None;
    let mut ended: Vec<MemPoolId> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc { size, stream } => {
                let stream = StreamId(stream);
                let pool = match open {
                    Some((s, p)) if s == stream => p,
                    _ => MemPoolId::DEFAULT,
                };
                match a.allocate(size, stream) {
                    Ok(x) => {
                        for (p, blocks) in &private {
                            if *p != pool {
                                for b in blocks {
                                    prop_assert!(
                                        !overlaps(&x, b),
                                        "{x:?} (pool {pool}) overlaps {b:?} of pool {p}"
                                    );
                                }
                            }
                        }
                        for (y, _) in &live {
                            prop_assert!(!overlaps(&x, y), "{x:?} overlaps live {y:?}");
                        }
                        if !pool.is_default() {
                            private.entry(pool).or_default().push(x);
                        }
                        live.push((x, pool));
                    }
                    Err(e) => prop_assert!(e.is_out_of_memory(), "{e}"),
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let (x, _) = live.swap_remove(pick % live.len());
                    a.free(x.ptr).unwrap();
                }
            }
            Op::Begin { stream, share } => {
                if open.is_none() {
                    let pool = match ended.last() {
                        Some(&p) if share && a.pool_use_count(p).is_some_and(|n| n > 0) => p,
                        _ => MemPoolId::new_graph(),
                    };
                    capture(&a, StreamId(stream), pool);
                    open = Some((StreamId(stream), pool));
                }
            }
            Op::End => {
                if let Some((s, p)) = open.take() {
                    end(&a, s, p);
                    ended.push(p);
                }
            }
            Op::Release { pick } => {
                let releasable: Vec<usize> = (0..ended.len())
                    .filter(|&i| open.is_none_or(|(_, p)| p != ended[i]))
                    .collect();
                if !releasable.is_empty() {
                    let p = ended.remove(releasable[pick % releasable.len()]);
                    // A pool shared by several captures is in `ended` once per capture.
                    a.release_pool(p).unwrap();
                }
            }
            Op::EmptyCache => {
                let r = a.empty_cache();
                if open.is_some() {
                    let refused = matches!(r, Err(AllocError::CaptureUnderway { .. }));
                    prop_assert!(refused, "empty_cache during a capture: {r:?}");
                } else {
                    r.unwrap();
                }
            }
            Op::RecordStream { pick, stream } => {
                if !live.is_empty() {
                    let (x, _) = live[pick % live.len()];
                    a.record_stream(x.ptr, StreamId(stream)).unwrap();
                }
            }
            Op::SubmitWork { stream } => sim.submit_work(StreamId(stream)),
            Op::CompleteWork { stream } => sim.complete_work(StreamId(stream)),
        }
        private.retain(|p, _| a.pool_use_count(*p).is_some());
        if let Err(v) = a.check_invariants() {
            return Err(TestCaseError::fail(format!("after {op:?}: {v}")));
        }
        let v = sim.capture_violations();
        prop_assert!(v.is_empty(), "after {op:?}: {v:?}");
    }
    // Drain: everything comes back.
    if let Some((s, p)) = open.take() {
        end(&a, s, p);
        ended.push(p);
    }
    for (x, _) in live.drain(..) {
        a.free(x.ptr).unwrap();
    }
    for p in ended {
        a.release_pool(p).unwrap();
    }
    for s in 0..3 {
        sim.complete_work(StreamId(s));
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    prop_assert_eq!(a.memory_stats().memory_reserved(), 0);
    prop_assert_eq!(sim.counters().reserved_bytes, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_programs_keep_private_pools_isolated(
        which in 0..4usize,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let (_, config) = crate::util::four_configs().swap_remove(which);
        run_program(config, &ops)?;
    }
}

/// `set_use_on_oom` (PyTorch's `torch.cuda.MemPool(use_on_oom=True)`): an allocation of the
/// default pools that would fail with out of memory takes a free block of the pool, which stays
/// the pool's (it goes back there when freed, also with the fast path on); without the mark the
/// same allocation fails.
#[test]
fn an_allocation_about_to_fail_takes_a_free_block_of_a_use_on_oom_pool() {
    for (name, config) in crate::util::four_configs() {
        let a = crate::util::with_config(64 * MIB, config);
        let s = StreamId::DEFAULT;
        let pool = use_on_oom_pool_holding(&a, 40 * MIB);
        for round in 0..3 {
            // The device has 24 MiB left: only the pool's free 40 MiB can serve 30 MiB.
            let y = a.allocate(30 * MIB, s).unwrap();
            assert_eq!(a.pool_of(y.ptr), Some(pool), "{name}, round {round}");
            a.free(y.ptr).unwrap();
            a.check_invariants().unwrap();
        }
        // Freed, the block went back to the pool: a small default allocation does not get it.
        let z = a.allocate(MIB, s).unwrap();
        assert_eq!(a.pool_of(z.ptr), None, "{name}");
        a.free(z.ptr).unwrap();
        a.set_use_on_oom(pool, false).unwrap();
        let err = a.allocate(30 * MIB, s).unwrap_err();
        assert!(matches!(err, AllocError::OutOfMemory(_)), "{name}: {err}");
        // The message tells the pool's free memory apart from the cache's own.
        assert!(
            err.to_string()
                .contains("40.00 MiB is cached in private pools (CUDA graphs, MemPool)"),
            "{name}: {err}"
        );
        assert!(matches!(
            a.set_use_on_oom(MemPoolId::new_user(), true),
            Err(AllocError::InvalidPool { .. })
        ));
        a.check_invariants().unwrap();
    }
}

/// PyTorch's `try_mempool_fallback` runs right after the first failed device allocation,
/// *before* `release_available_cached_blocks` and `release_cached_blocks` ("try to use memory
/// pools that have opted in as overflow before expensive memory freeing operations"). So with a
/// use_on_oom pool holding a fitting free block and the default pool holding a releasable cached
/// segment, PyTorch serves the request from the pool: nothing is released, no retry is counted,
/// reserved memory stays. Under `AllocatorConfig::pytorch()` the crate must do the same.
#[test]
fn a_use_on_oom_pool_serves_before_the_cache_is_released_as_in_pytorch() {
    let a = crate::util::with_config(64 * MIB, AllocatorConfig::pytorch());
    let s = StreamId::DEFAULT;
    let pool = use_on_oom_pool_holding(&a, 40 * MIB);
    // A cached 12 MiB segment of the default pool: 12 MiB of the device stay free.
    let d = a.allocate(12 * MIB, s).unwrap();
    a.free(d.ptr).unwrap();
    let before = a.memory_stats();
    assert_eq!(before.memory_reserved(), (52 * MIB) as i64);
    // 16 MiB does not fit the device's 12 MiB: PyTorch takes the pool's block next.
    let y = a.allocate(16 * MIB, s).unwrap();
    assert_eq!(a.pool_of(y.ptr), Some(pool));
    let after = a.memory_stats();
    assert_eq!(after.num_alloc_retries, before.num_alloc_retries);
    assert_eq!(after.memory_reserved(), before.memory_reserved());
    assert_eq!(after.num_device_free, before.num_device_free);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

/// A new user pool marked `use_on_oom` holding one free block of `bytes` (allocated on the
/// default stream while routed there, then freed).
fn use_on_oom_pool_holding(a: &CachingAllocator<SimDevice>, bytes: usize) -> MemPoolId {
    let pool = MemPoolId::new_user();
    a.create_pool(pool).unwrap();
    a.set_use_on_oom(pool, true).unwrap();
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let x = a.allocate(bytes, StreamId::DEFAULT).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.free(x.ptr).unwrap();
    pool
}

/// `torch.cuda.MemPool(no_split=True)` (Note [No-split pools]): a block of such a pool is handed
/// out whole, so each allocation owns its block: two 4 MiB allocations take a 20 MiB segment
/// each (one shared segment in a pool that splits), two 512-byte ones a 2 MiB block each; a freed
/// block serves a later, smaller allocation of the pool whole; the statistics count whole blocks.
#[test]
fn a_no_split_pool_hands_every_block_out_whole() {
    for (name, config) in crate::util::four_configs() {
        let a = crate::util::with_config(1 << 30, config);
        let s = StreamId::DEFAULT;
        let pools = [MemPoolId::new_user(), MemPoolId::new_user()];
        let [whole, split] = pools;
        for p in pools {
            a.create_pool(p).unwrap();
        }
        a.set_no_split(whole, true).unwrap();
        let mut got = Vec::new();
        for p in pools {
            a.begin_allocate_to_pool(p, Box::new(|_| true)).unwrap();
            let sizes = [4 * MIB, 4 * MIB, 512, 512];
            got.push(sizes.map(|n| a.allocate(n, s).unwrap()));
            a.end_allocate_to_pool(p).unwrap();
        }
        let segments_of = |p: MemPoolId| {
            let mut v: Vec<(PoolKind, usize)> = a
                .snapshot()
                .iter()
                .filter(|g| g.private_pool == p)
                .map(|g| (g.pool, g.total_size))
                .collect();
            v.sort();
            v
        };
        let (small, large) = (2 * MIB, 20 * MIB);
        assert_eq!(
            segments_of(whole),
            [
                (PoolKind::Small, small),
                (PoolKind::Small, small),
                (PoolKind::Large, large),
                (PoolKind::Large, large)
            ],
            "{name}"
        );
        assert_eq!(
            segments_of(split),
            [(PoolKind::Small, small), (PoolKind::Large, large)],
            "{name}"
        );
        let block_sizes = |g: &[Allocation; 4]| g.map(|x| x.block_size);
        assert_eq!(block_sizes(&got[0]), [large, large, small, small], "{name}");
        assert_eq!(block_sizes(&got[1]), [4 * MIB, 4 * MIB, 512, 512], "{name}");
        // Allocated bytes count the whole blocks of the no-split pool.
        let allocated = a.memory_stats().allocated_bytes.get(StatType::All).current;
        assert_eq!(
            allocated,
            (2 * large + 2 * small + 8 * MIB + 1024) as i64,
            "{name}"
        );
        // A freed block serves a smaller allocation of the pool whole, at its address.
        a.free(got[0][0].ptr).unwrap();
        a.begin_allocate_to_pool(whole, Box::new(|_| true)).unwrap();
        let again = a.allocate(2 * MIB, s).unwrap();
        a.end_allocate_to_pool(whole).unwrap();
        assert_eq!(
            (again.ptr, again.block_size),
            (got[0][0].ptr, large),
            "{name}"
        );
        assert_eq!(segments_of(whole).len(), 4, "{name}");
        a.check_invariants().unwrap();
        // Everything back, both pools released and emptied: the pools are forgotten.
        a.free(again.ptr).unwrap();
        for x in got[0][1..].iter().chain(&got[1]) {
            a.free(x.ptr).unwrap();
        }
        for p in pools {
            // One use for the pool's making and one per routing into it (PyTorch's
            // `use_mem_pool` releases each routing's use when it ends).
            while a.pool_use_count(p).is_some_and(|n| n > 0) {
                a.release_pool(p).unwrap();
            }
        }
        a.empty_cache().unwrap();
        assert_eq!(a.pool_use_count(whole), None, "{name}");
        assert!(matches!(
            a.set_no_split(whole, true),
            Err(AllocError::InvalidPool { .. })
        ));
        a.check_invariants().unwrap();
    }
}
