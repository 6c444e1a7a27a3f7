//! Cross-stream reuse (`cca_cross_stream_reuse:True`, #4): a wholly free cached segment of one
//! stream serves another stream after an event wait instead of a new segment. The handover, the
//! wait on the right streams without a host synchronization, best fit and the pools' rules,
//! pending `record_stream` blocks never handed over, event failures falling back cleanly,
//! expandable segments, the fast path, the fraction cap and the OOM path, a property test over
//! multi-stream programs, and the replay measurement on the many-streams workload.

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Op, Run, random_program};
use crate::util::{MIB, segment_stream, with_config};

const T: StreamId = StreamId(1);
const S: StreamId = StreamId(2);
const U: StreamId = StreamId(3);

fn on(base: AllocatorConfig) -> AllocatorConfig {
    AllocatorConfigBuilder::from_config(base)
        .cross_stream_reuse(true)
        .build()
        .unwrap()
}

fn pytorch_on(capacity: usize) -> CachingAllocator<SimDevice> {
    with_config(capacity, on(AllocatorConfig::pytorch()))
}

/// A stream's segment, freed whole: one allocation of `size` on `stream`, freed.
fn free_segment_on(a: &CachingAllocator<SimDevice>, size: usize, stream: StreamId) -> DeviceAddr {
    let x = a.allocate(size, stream).unwrap();
    a.free(x.ptr).unwrap();
    x.ptr
}

#[test]
fn a_free_segment_of_another_stream_serves_the_request_after_an_event_wait() {
    let a = pytorch_on(1 << 30);
    let sim = a.backend();
    let x = a.allocate(3 * MIB, T).unwrap();
    sim.submit_work(T); // a kernel on T still uses x
    a.free(x.ptr).unwrap();
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, x.ptr, "the segment was handed over");
    assert_eq!(y.stream, S);
    assert_eq!(a.cross_stream_handovers(), 1);
    let st = a.memory_stats();
    assert_eq!(st.num_device_alloc, 1, "no new segment");
    assert_eq!(sim.counters().allocate_calls, 1);
    // S waits on an event recorded on T after T's work; the host never blocked.
    let waits = sim.stream_waits();
    assert_eq!(waits.len(), 1);
    assert_eq!(waits[0].stream, S);
    assert_eq!(waits[0].recorded, Some((T, 1)));
    assert_eq!(sim.counters().synchronize_calls, 0);
    assert!(sim.has_pending_work(T));
    sim.complete_work(S);
    assert!(!sim.has_pending_work(T), "S's work is ordered after T's");
    // The segment is S's now, split by the normal rules.
    let snap = a.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].stream, S);
    let states: Vec<(usize, BlockState)> =
        snap[0].blocks.iter().map(|b| (b.size, b.state)).collect();
    assert_eq!(
        states,
        vec![
            (3 * MIB, BlockState::ActiveAllocated),
            (17 * MIB, BlockState::Inactive)
        ]
    );
    // T has no segment left: it grows.
    let z = a.allocate(3 * MIB, T).unwrap();
    assert_eq!(a.memory_stats().num_device_alloc, 2);
    assert_eq!(segment_stream(&a, z.ptr), T);
    // PyTorch's 122 keys stay PyTorch's.
    assert_eq!(a.memory_stats().to_map().len(), 122);
    a.check_invariants().unwrap();
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    a.reset_accumulated_stats();
    assert_eq!(a.cross_stream_handovers(), 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters().live_segments, 0);
    a.check_invariants().unwrap();
}

#[test]
fn off_in_every_preset_and_the_pytorch_rule_holds_then() {
    for p in Preset::ALL {
        assert!(!p.config().cross_stream_reuse, "{p}");
    }
    assert!(!AllocatorConfig::default().cross_stream_reuse);
    assert!(!AllocatorConfig::pytorch().cross_stream_reuse);
    for p in Preset::ALL {
        let a = with_config(1 << 30, p.config());
        let x = free_segment_on(&a, 3 * MIB, T);
        let y = a.allocate(3 * MIB, S).unwrap();
        assert_ne!(y.ptr, x, "{p}: blocks belong to their stream");
        assert_eq!(a.cross_stream_handovers(), 0);
        assert!(a.backend().stream_waits().is_empty());
        a.free(y.ptr).unwrap();
        a.check_invariants().unwrap();
    }
}

#[test]
fn best_fit_takes_the_smallest_adequate_whole_segment_of_the_pool() {
    let a = pytorch_on(1 << 30);
    // Allocate everything first (a later miss would take an earlier free segment).
    let held: Vec<Allocation> = [
        (25 * MIB, StreamId(1)), // 26 MiB segment
        (3 * MIB, StreamId(3)),  // 20 MiB segment
        (12 * MIB, StreamId(5)), // 12 MiB segment
        (1000, StreamId(6)),     // 2 MiB small-pool segment
    ]
    .into_iter()
    .map(|(size, s)| a.allocate(size, s).unwrap())
    .collect();
    // A split segment is not wholly free: never handed over.
    let p = a.allocate(3 * MIB, StreamId(7)).unwrap();
    let q = a.allocate(3 * MIB, StreamId(7)).unwrap();
    for x in held.iter().chain([&p]) {
        a.free(x.ptr).unwrap();
    }
    let [big, mid, fit, small] = [0, 1, 2, 3].map(|i| held[i].ptr);
    assert_eq!(a.cross_stream_handovers(), 0);
    let devs = a.memory_stats().num_device_alloc;

    let x = a.allocate(11 * MIB, S).unwrap();
    assert_eq!(x.ptr, fit, "the smallest segment that fits");
    let y = a.allocate(15 * MIB, S).unwrap();
    assert_eq!(y.ptr, mid);
    let z = a.allocate(22 * MIB, S).unwrap();
    assert_eq!(z.ptr, big);
    assert_eq!(a.memory_stats().num_device_alloc, devs);
    assert_eq!(a.cross_stream_handovers(), 3);
    // Nothing large is left to hand over: the small pool's segment and the split one stay.
    let w = a.allocate(16 * MIB, S).unwrap();
    assert_eq!(a.memory_stats().num_device_alloc, devs + 1);
    assert_eq!(segment_stream(&a, small), StreamId(6));
    assert_eq!(segment_stream(&a, p.ptr), StreamId(7));
    // The small pool hands over too.
    let v = a.allocate(1000, S).unwrap();
    assert_eq!(v.ptr, small);
    assert_eq!(a.cross_stream_handovers(), 4);
    a.check_invariants().unwrap();
    for ptr in [x.ptr, y.ptr, z.ptr, w.ptr, v.ptr, q.ptr] {
        a.free(ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn oversize_rules_apply_to_handed_over_segments() {
    let a = with_config(
        1 << 30,
        on(AllocatorConfig::parse("max_split_size_mb:24").unwrap()),
    );
    let oversize = free_segment_on(&a, 30 * MIB, T);
    let huge = free_segment_on(&a, 100 * MIB, U);
    // A normal request never takes an oversize block.
    let x = a.allocate(3 * MIB, S).unwrap();
    assert_ne!(x.ptr, oversize);
    assert_eq!(a.cross_stream_handovers(), 0);
    // An oversize request takes one at most `max_non_split_rounding` larger.
    let y = a.allocate(28 * MIB, S).unwrap();
    assert_eq!(y.ptr, oversize);
    let z = a.allocate(25 * MIB, S).unwrap();
    assert_ne!(z.ptr, huge, "100 MiB is more than 20 MiB above 25 MiB");
    assert_eq!(a.cross_stream_handovers(), 1);
    assert_eq!(y.block_size, 30 * MIB, "oversize blocks are not split");
    a.check_invariants().unwrap();
    for p in [x.ptr, y.ptr, z.ptr] {
        a.free(p).unwrap();
    }
}

#[test]
fn blocks_pending_on_record_stream_events_are_never_handed_over() {
    let a = pytorch_on(1 << 30);
    let sim = a.backend();
    let x = a.allocate(3 * MIB, T).unwrap();
    a.record_stream(x.ptr, U).unwrap();
    sim.submit_work(U);
    a.free(x.ptr).unwrap();
    // x waits for U: its segment is not free.
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_ne!(y.ptr, x.ptr);
    assert_eq!(a.cross_stream_handovers(), 0);
    assert_eq!(a.memory_stats().num_device_alloc, 2);
    // Also when the waiting stream is the one asking.
    let w = a.allocate(3 * MIB, U).unwrap();
    assert_ne!(w.ptr, x.ptr);
    assert_eq!(a.cross_stream_handovers(), 0);
    a.check_invariants().unwrap();
    // Once U is done, the next miss drains the event and the whole segment can go.
    sim.complete_work(U);
    let z = a.allocate(18 * MIB, S).unwrap();
    assert_eq!(z.ptr, x.ptr);
    assert_eq!(a.cross_stream_handovers(), 1);
    assert_eq!(a.memory_stats().num_device_alloc, 3);
    a.check_invariants().unwrap();
    for p in [y.ptr, w.ptr, z.ptr] {
        a.free(p).unwrap();
    }
}

#[test]
fn a_failed_event_call_falls_back_to_growth_and_changes_nothing() {
    for call in [
        SimEventCall::Create,
        SimEventCall::Record,
        SimEventCall::StreamWait,
    ] {
        let a = pytorch_on(1 << 30);
        let sim = a.backend();
        let x = free_segment_on(&a, 3 * MIB, T);
        sim.fail_next_event_call(call);
        let y = a.allocate(3 * MIB, S).unwrap();
        assert_ne!(y.ptr, x, "{call:?}: a new segment instead");
        assert_eq!(a.memory_stats().num_device_alloc, 2, "{call:?}");
        assert_eq!(a.cross_stream_handovers(), 0);
        assert!(sim.stream_waits().is_empty());
        assert_eq!(segment_stream(&a, x), T, "{call:?}: T keeps its segment");
        a.check_invariants().unwrap();
        // The next miss hands it over; the pooled event is reused, not leaked.
        let z = a.allocate(18 * MIB, S).unwrap();
        assert_eq!(z.ptr, x, "{call:?}");
        assert_eq!(a.cross_stream_handovers(), 1);
        assert_eq!(sim.counters().events_created, 1, "{call:?}");
        a.check_invariants().unwrap();
        a.free(y.ptr).unwrap();
        a.free(z.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters().live_segments, 0);
        assert_eq!(a.memory_stats().memory_reserved(), 0);
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_failed_device_allocation_after_a_skipped_handover_is_reported_as_before() {
    // An event failure and then a device failure: the error is the device's, nothing leaks.
    let a = pytorch_on(1 << 30);
    let sim = a.backend();
    let x = free_segment_on(&a, 3 * MIB, T);
    sim.fail_next_event_call(SimEventCall::Record);
    sim.fail_next_call(FaultKind::Error);
    assert!(matches!(
        a.allocate(3 * MIB, S),
        Err(AllocError::Backend { .. })
    ));
    assert_eq!(segment_stream(&a, x), T);
    a.check_invariants().unwrap();
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn handovers_come_before_the_cap_and_the_out_of_memory_path() {
    // Without the option, S's request passes the cap only after the OOM path frees T's segment.
    for reuse in [false, true] {
        let mut config = AllocatorConfig::pytorch();
        config.cross_stream_reuse = reuse;
        let a = with_config(1 << 30, config);
        a.set_memory_fraction((40 * MIB) as f64 / (1u64 << 30) as f64)
            .unwrap();
        let held = a.allocate(20 * MIB, S).unwrap();
        let x = free_segment_on(&a, 20 * MIB, T);
        let y = a.allocate(15 * MIB, S).unwrap();
        let st = a.memory_stats();
        if reuse {
            assert_eq!(y.ptr, x);
            assert_eq!(st.num_device_alloc, 2);
            assert_eq!((st.num_alloc_retries, st.num_sync_all_streams), (0, 0));
            assert_eq!(st.num_device_free, 0);
        } else {
            assert_eq!(st.num_alloc_retries, 1, "flush and retry");
            assert_eq!(st.num_device_free, 1);
            assert_eq!(st.num_device_alloc, 3);
        }
        assert!(st.memory_reserved() <= (40 * MIB) as i64);
        a.check_invariants().unwrap();
        a.free(held.ptr).unwrap();
        a.free(y.ptr).unwrap();
    }
    // On a full device too.
    let a = pytorch_on(40 * MIB);
    let held = a.allocate(20 * MIB, S).unwrap();
    let x = free_segment_on(&a, 20 * MIB, T);
    let y = a.allocate(20 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    assert_eq!(a.memory_stats().num_ooms, 0);
    // And a request nothing can serve is still an OOM with the usual report.
    let err = a.allocate(20 * MIB, U).unwrap_err();
    assert!(err.is_out_of_memory());
    a.check_invariants().unwrap();
    a.free(held.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().live_segments, 0);
}

#[test]
fn garbage_collection_waits_for_the_handover() {
    let a = with_config(
        1 << 30,
        on(AllocatorConfig::parse("garbage_collection_threshold:0.5").unwrap()),
    );
    a.set_memory_fraction((60 * MIB) as f64 / (1u64 << 30) as f64)
        .unwrap();
    let held = a.allocate(20 * MIB, S).unwrap();
    let x = free_segment_on(&a, 20 * MIB, T);
    // Reserved 40 MiB > 0.5 × 60 MiB: a miss would collect T's segment; the handover uses it.
    let y = a.allocate(20 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    assert_eq!(a.memory_stats().num_device_free, 0);
    a.check_invariants().unwrap();
    a.free(held.ptr).unwrap();
    a.free(y.ptr).unwrap();
}

fn expandable_on() -> AllocatorConfig {
    on(Preset::PytorchExpandable.config())
}

#[test]
fn a_wholly_free_expandable_segment_moves_with_its_pages() {
    let a = with_config(1 << 30, expandable_on());
    let sim = a.backend();
    let x = free_segment_on(&a, 3 * MIB, T);
    let before = sim.counters();
    assert_eq!((before.reserve_calls, before.map_calls), (1, 1));
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    assert_eq!(a.cross_stream_handovers(), 1);
    let after = sim.counters();
    assert_eq!((after.reserve_calls, after.map_calls), (1, 1), "no growth");
    assert_eq!(segment_stream(&a, y.ptr), S);
    assert_eq!(sim.stream_waits()[0].stream, S);
    // S grows in the range it got; T reserves a new one.
    let g = a.allocate(30 * MIB, S).unwrap();
    assert_eq!(g.ptr.0, x.0 + (3 * MIB) as u64);
    assert_eq!(sim.counters().reserve_calls, 1);
    let z = a.allocate(3 * MIB, T).unwrap();
    assert_eq!(sim.counters().reserve_calls, 2);
    a.check_invariants().unwrap();
    // A range with a live block is not wholly free.
    let p = a.allocate(3 * MIB, U).unwrap();
    let q = a.allocate(3 * MIB, U).unwrap();
    a.free(p.ptr).unwrap();
    let v = a.allocate(3 * MIB, StreamId(9)).unwrap();
    assert_ne!(v.ptr, p.ptr);
    assert_eq!(a.cross_stream_handovers(), 1);
    for ptr in [y.ptr, g.ptr, z.ptr, q.ptr, v.ptr] {
        a.free(ptr).unwrap();
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    let c = sim.counters();
    assert_eq!(c.reserved_bytes, 0);
    assert!(sim.live_mappings().is_empty());
    assert_eq!(c.reserve_calls, c.release_range_calls);
    a.check_invariants().unwrap();
}

#[test]
fn the_default_with_the_option_hands_over_expandable_segments_too() {
    let a = with_config(1 << 30, on(AllocatorConfig::default()));
    let x = free_segment_on(&a, 3 * MIB, T);
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    assert_eq!(a.cross_stream_handovers(), 1);
    assert_eq!(a.backend().counters().synchronize_calls, 0);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn the_fast_path_gives_its_cached_blocks_back_before_a_handover() {
    let a = with_config(
        1 << 30,
        on(AllocatorConfig::builder().fast_path(true).build().unwrap()),
    );
    // Admit 3 MiB to this thread's front cache on T (second miss), then cache a block.
    let w = free_segment_on(&a, 3 * MIB, T);
    let x = a.allocate(3 * MIB, T).unwrap();
    assert_eq!(x.ptr, w);
    a.free(x.ptr).unwrap();
    // The block sits in the front cache (allocated for the core); S's miss flushes it, the
    // segment becomes wholly free, and S gets it.
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, w);
    assert_eq!(a.cross_stream_handovers(), 1);
    assert_eq!(a.memory_stats().num_device_alloc, 1);
    a.check_invariants().unwrap();
    a.free(y.ptr).unwrap();
    // S's frees and hits use S's bins from now on.
    let z = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(z.ptr, w);
    a.free(z.ptr).unwrap();
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().live_segments, 0);
}

#[test]
fn history_and_snapshot_follow_the_new_stream() {
    let a = pytorch_on(1 << 30);
    a.record_history(1000);
    let x = free_segment_on(&a, 3 * MIB, T);
    let y = a.allocate(3 * MIB, S).unwrap();
    assert_eq!(y.ptr, x);
    let (trace, _) = a.history();
    let streams: Vec<u64> = trace
        .events
        .iter()
        .filter_map(|e| match e.op {
            trace::TraceOp::Alloc { stream, .. } => Some(stream),
            _ => None,
        })
        .collect();
    assert_eq!(streams, vec![T.0, S.0]);
    // The recorded history replays (with the option: the same handover).
    let b = pytorch_on(1 << 30);
    let r = replay(&b, &trace, &ReplayOptions::default()).unwrap();
    assert_eq!(r.cross_stream_handovers, 1);
    assert_eq!(r.num_device_alloc, 1);
    a.free(y.ptr).unwrap();
}

// ---- replay measurement -------------------------------------------------------------------

fn replay_many_streams(config: AllocatorConfig, seed: u64) -> (ReplayReport, SimCounters) {
    let trace = Workload::ManyStreams.trace(seed);
    let a = with_config(80 << 30, config);
    let r = replay(&a, &trace, &ReplayOptions::default()).unwrap();
    let c = a.backend().counters();
    (r, c)
}

#[test]
fn many_streams_reserve_less_with_the_option() {
    // Figures in benches/README.md ("Cross-stream reuse"); `examples/cross_stream_table.rs`
    // prints them for every trace.
    let (off, _) = replay_many_streams(AllocatorConfig::pytorch(), 1);
    let (with, _) = replay_many_streams(on(AllocatorConfig::pytorch()), 1);
    println!(
        "synth_many_streams seed 1, pytorch: peak reserved {} -> {} bytes ({:.3} -> {:.3} x live), {} handovers, {} -> {} segments allocated",
        off.peak_reserved_bytes,
        with.peak_reserved_bytes,
        off.reserved_over_live(),
        with.reserved_over_live(),
        with.cross_stream_handovers,
        off.num_device_alloc,
        with.num_device_alloc
    );
    assert_eq!(off.cross_stream_handovers, 0);
    assert_eq!(off.num_device_alloc, 129, "the pytorch preset is unchanged");
    assert!(with.cross_stream_handovers > 0);
    assert!(
        (with.peak_reserved_bytes as f64) < 0.6 * off.peak_reserved_bytes as f64,
        "{} vs {}",
        with.peak_reserved_bytes,
        off.peak_reserved_bytes
    );
    assert!(with.num_device_alloc < off.num_device_alloc);
    assert_eq!(with.num_ooms, 0);

    let (off, _) = replay_many_streams(Preset::PytorchExpandable.config(), 1);
    let (with, _) = replay_many_streams(expandable_on(), 1);
    println!(
        "synth_many_streams seed 1, pytorch-expandable: {:.3} -> {:.3} x live, {} handovers",
        off.reserved_over_live(),
        with.reserved_over_live(),
        with.cross_stream_handovers
    );
    assert!(with.peak_reserved_bytes < off.peak_reserved_bytes);
}

#[test]
fn the_default_with_the_option_keeps_its_waste_goal_and_syncs_less() {
    // Page reuse synchronizing (the default fences with events instead, below).
    let synced = AllocatorConfig {
        page_reuse_fence: false,
        ..AllocatorConfig::default()
    };
    for seed in [1, 2] {
        let (off, c_off) = replay_many_streams(synced.clone(), seed);
        let (with, c_with) = replay_many_streams(on(synced.clone()), seed);
        println!(
            "synth_many_streams seed {seed}, default: {:.4} -> {:.4} x live, range ops {} -> {}, stream syncs {} -> {}",
            off.reserved_over_live(),
            with.reserved_over_live(),
            off.num_device_alloc + off.num_device_free,
            with.num_device_alloc + with.num_device_free,
            c_off.synchronize_calls,
            c_with.synchronize_calls
        );
        assert!(with.reserved_over_live() <= 1.03);
        assert!(c_with.synchronize_calls < c_off.synchronize_calls);
        // The default fences page reuse with events: no synchronization with or without.
        let (off, c_off) = replay_many_streams(AllocatorConfig::default(), seed);
        let (with, c_with) = replay_many_streams(on(AllocatorConfig::default()), seed);
        assert!(off.reserved_over_live() <= 1.03 && with.reserved_over_live() <= 1.03);
        assert_eq!((c_off.synchronize_calls, c_with.synchronize_calls), (0, 0));
    }
    // A single-stream workload never hands over, so nothing changes there.
    let trace = Workload::TransformerVarlen.trace(1);
    let a = with_config(80 << 30, on(AllocatorConfig::default()));
    let r = replay(&a, &trace, &ReplayOptions::default()).unwrap();
    assert_eq!(r.cross_stream_handovers, 0);
}

// ---- property test ------------------------------------------------------------------------

fn config_strategy() -> impl Strategy<Value = AllocatorConfig> {
    prop_oneof![
        Just("".to_string()),
        Just("max_split_size_mb:24".to_string()),
        Just("garbage_collection_threshold:0.4,max_split_size_mb:20".to_string()),
        Just("roundup_power2_divisions:4,large_segment_size_mb:12".to_string()),
        Just("cca_fast_path:True".to_string()),
        Just("expandable_segments:True".to_string()),
        Just("cca_preset:default".to_string()),
        Just("cca_preset:default,cca_fast_path:True".to_string()),
    ]
    .prop_map(|s| {
        let key = "cca_cross_stream_reuse:True";
        let full = if s.is_empty() {
            key.to_string()
        } else {
            format!("{s},{key}")
        };
        AllocatorConfig::parse(&full).unwrap()
    })
}

/// The common checks plus the handovers' own: a live block never changes stream, and every
/// handover issued exactly one wait.
fn check(run: &Run) -> Result<(), TestCaseError> {
    run.check()?;
    let (a, live) = (&run.a, &run.live);
    let sim = a.backend();
    // A handover never moves a live block: each allocation's segment is still its stream's.
    let snap = a.snapshot();
    for x in live.values() {
        let seg = snap.iter().find(|s| {
            s.blocks
                .iter()
                .any(|b| b.address == x.ptr && b.state == BlockState::ActiveAllocated)
        });
        prop_assert!(
            seg.is_some_and(|s| s.stream == x.stream),
            "{} changed stream",
            x.ptr
        );
    }
    // Every handover issued exactly one wait; the only other waits are page loans' (at most
    // one per loan, none for a loan on the page's own stream).
    let waits = sim.counters().stream_waits;
    prop_assert!(waits >= a.cross_stream_handovers());
    prop_assert!(waits <= a.cross_stream_handovers() + a.page_loans());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn multi_stream_programs_with_handovers_stay_consistent_and_leak_nothing(
        config in config_strategy(),
        capacity_mib in 64usize..400,
        ops in random_program(Mix { min_size: 1, all_streams: true, event_faults: true, uses: false }),
    ) {
        prop_assert!(config.cross_stream_reuse);
        let mut run = Run::new(capacity_mib, config);
        for op in &ops {
            let before = run.a.cross_stream_handovers();
            run.step(op)?;
            if let Op::Alloc { stream, .. } = *op {
                if run.a.cross_stream_handovers() > before {
                    // The new stream waits on the old one's work queued so far.
                    let w = *run.a.backend().stream_waits().last().unwrap();
                    prop_assert_eq!(w.stream, StreamId(stream));
                    let (from, at) = w.recorded.unwrap();
                    prop_assert_ne!(from, StreamId(stream));
                    prop_assert_eq!(at, run.submitted[from.0 as usize]);
                }
            }
            check(&run)?;
        }
        run.drain()?;
        check(&run)?;
    }
}
