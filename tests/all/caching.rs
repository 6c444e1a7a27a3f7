//! Behaviour of the caching core at PyTorch's edges: reuse, split, merge, streams, oversize
//! blocks, the fraction cap, the OOM path, bad input, `record_stream`, stats and the summary.

use cuda_caching_allocator::*;

use crate::util::{MIB, pytorch_on, with_config};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

#[test]
fn cached_block_is_reused_without_a_device_call() {
    let a = pytorch_on(1 << 30);
    let x = a.allocate(1000, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.allocate(700, S0).unwrap();
    assert_eq!(x.ptr, y.ptr);
    assert_eq!(y.block_size, 1024);
    assert_eq!(a.memory_stats().num_device_alloc, 1);
    assert_eq!(a.backend().counters().allocate_calls, 1);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn small_requests_pack_into_one_2mib_segment() {
    let a = pytorch_on(1 << 30);
    let x = a.allocate(1, S0).unwrap();
    let y = a.allocate(512, S0).unwrap();
    let z = a.allocate(MIB, S0).unwrap();
    assert_eq!(y.ptr.0, x.ptr.0 + 512);
    assert_eq!(z.ptr.0, y.ptr.0 + 512);
    let st = a.memory_stats();
    assert_eq!(st.segment.get(StatType::SmallPool).current, 1);
    assert_eq!(st.memory_reserved(), 2 * MIB as i64);
    // The 2 MiB - 1 MiB - 1 KiB tail is one inactive split block.
    assert_eq!(st.inactive_split.get(StatType::All).current, 1);
    assert_eq!(
        st.inactive_split_bytes.get(StatType::All).current,
        (MIB - 1024) as i64
    );
    for p in [x, y, z] {
        a.free(p.ptr).unwrap();
        a.check_invariants().unwrap();
    }
    let st = a.memory_stats();
    assert_eq!(
        st.inactive_split.get(StatType::All).current,
        0,
        "all merged back into one block"
    );
}

#[test]
fn large_pool_split_rule_keeps_up_to_1mib_of_slack() {
    let a = pytorch_on(1 << 30);
    // 1 MiB + 1 byte: large pool, 20 MiB segment, remainder > 1 MiB: split.
    let x = a.allocate(MIB + 1, S0).unwrap();
    assert_eq!(x.block_size, MIB + 512);
    assert_eq!(a.memory_stats().memory_reserved(), 20 * MIB as i64);
    // 19 MiB request from the 20 MiB - (1 MiB + 512) remainder: remainder 523776 < 1 MiB: no split.
    let y = a.allocate(18 * MIB, S0).unwrap();
    assert_eq!(
        y.ptr.0,
        x.ptr.0 + (MIB + 512) as u64,
        "best fit takes the cached remainder"
    );
    assert_eq!(a.memory_stats().segment.get(StatType::All).current, 1);
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    // The merged 20 MiB block serves an 11 MiB request (split: 9 MiB > 1 MiB remains).
    let z = a.allocate(11 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    assert_eq!(a.memory_stats().memory_reserved(), 20 * MIB as i64);
    // With the cache busy, 10 MiB and more get their own segment rounded up to 2 MiB.
    let w = a.allocate(11 * MIB, S0).unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 32 * MIB as i64);
    a.free(z.ptr).unwrap();
    a.free(w.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_breaks_ties_by_address() {
    let a = pytorch_on(1 << 30);
    let blocks: Vec<_> = (0..4).map(|_| a.allocate(12 * MIB, S0).unwrap()).collect();
    let mut sorted = blocks.clone();
    sorted.sort_by_key(|b| b.ptr);
    a.free(sorted[3].ptr).unwrap();
    a.free(sorted[1].ptr).unwrap();
    let again = a.allocate(12 * MIB, S0).unwrap();
    assert_eq!(
        again.ptr, sorted[1].ptr,
        "the lower of two equal free blocks"
    );
    for b in [again, sorted[0], sorted[2]] {
        a.free(b.ptr).unwrap();
    }
}

#[test]
fn free_blocks_are_reused_only_on_their_stream() {
    let a = pytorch_on(1 << 30);
    let x = a.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.allocate(4096, S1).unwrap();
    assert_ne!(x.ptr, y.ptr);
    assert_eq!(a.memory_stats().num_device_alloc, 2);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_releases_only_wholly_free_segments() {
    let a = pytorch_on(1 << 30);
    let x = a.allocate(4096, S0).unwrap();
    let y = a.allocate(30 * MIB, S0).unwrap();
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!(
        st.memory_reserved(),
        2 * MIB as i64,
        "the small segment is still in use"
    );
    assert_eq!(st.num_device_free, 1);
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert_eq!(a.backend().counters().live_segments, 0);
    a.check_invariants().unwrap();
}

#[test]
fn oversize_blocks_follow_max_split_size_rules() {
    let cfg = AllocatorConfig::parse("max_split_size_mb:40").unwrap();
    let a = with_config(1 << 30, cfg);
    let big = a.allocate(100 * MIB, S0).unwrap();
    assert_eq!(a.memory_stats().oversize_allocations.current, 1);
    assert_eq!(a.memory_stats().oversize_segments.current, 1);
    a.free(big.ptr).unwrap();
    // A normal request never takes a cached oversize block.
    let small = a.allocate(12 * MIB, S0).unwrap();
    assert_ne!(small.ptr, big.ptr);
    // An oversize request takes it only within max_non_split_rounding (20 MiB) and never splits it.
    let near = a.allocate(90 * MIB, S0).unwrap();
    assert_eq!(near.ptr, big.ptr);
    assert_eq!(near.block_size, 100 * MIB);
    a.free(near.ptr).unwrap();
    let far = a.allocate(60 * MIB, S0).unwrap();
    assert_ne!(far.ptr, big.ptr, "100 MiB >= 60 + 20 MiB: not reused");
    a.free(far.ptr).unwrap();
    a.free(small.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn release_available_cached_blocks_frees_oversize_blocks_before_a_full_flush() {
    let cfg = AllocatorConfig::parse("max_split_size_mb:20").unwrap();
    let a = with_config(100 * MIB, cfg);
    let x = a.allocate(40 * MIB, S0).unwrap();
    let y = a.allocate(40 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    // 70 MiB needs both cached 40 MiB blocks released; no full flush, so no retry is counted.
    let z = a.allocate(70 * MIB, S0).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.num_alloc_retries, 0);
    assert_eq!(st.num_device_free, 2);
    a.free(z.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn fraction_cap_is_checked_before_the_device() {
    let a = pytorch_on(1000 * MIB);
    a.set_memory_fraction(0.1).unwrap();
    let x = a.allocate(60 * MIB, S0).unwrap();
    let calls = a.backend().counters().allocate_calls;
    let err = a.allocate(60 * MIB, S0).unwrap_err();
    assert_eq!(
        a.backend().counters().allocate_calls,
        calls,
        "no device call above the cap"
    );
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::FractionCapReached);
    assert_eq!(r.limit_bytes, Some(100 * MIB));
    let msg = err.to_string();
    assert!(msg.contains("100.00 MiB allowed;"), "{msg}");
    assert!(msg.contains("Tried to allocate 60.00 MiB"), "{msg}");
    let st = a.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
    // Still usable; lifting the cap makes the request succeed.
    a.set_memory_fraction(1.0).unwrap();
    let y = a.allocate(60 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    assert!(matches!(
        a.set_memory_fraction(1.5),
        Err(AllocError::InvalidFraction(_))
    ));
    assert!(a.set_memory_fraction(f64::NAN).is_err());
    a.check_invariants().unwrap();
}

#[test]
fn lowering_the_cap_below_reserved_keeps_live_allocations() {
    let a = pytorch_on(1000 * MIB);
    let x = a.allocate(300 * MIB, S0).unwrap();
    a.set_memory_fraction(0.1).unwrap();
    a.check_invariants().unwrap();
    assert!(a.allocate(300 * MIB, S0).is_err());
    a.free(x.ptr).unwrap();
    // The cached 300 MiB block serves a smaller request by splitting: no device call.
    let y = a.allocate(50 * MIB, S0).unwrap();
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn oom_flushes_the_cache_and_retries_once() {
    let a = pytorch_on(64 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    // Cached 40 MiB block on stream 0 cannot serve stream 1; the flush frees it.
    let y = a.allocate(40 * MIB, S1).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_sync_all_streams, 1);
    assert_eq!(st.num_device_free, 1);
    a.free(y.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn oom_verdicts_name_the_cause() {
    // Larger than the whole device: no freeing helps, and the message does not say otherwise.
    let a = pytorch_on(64 * MIB);
    let err = a.allocate(100 * MIB, S0).unwrap_err();
    assert_eq!(
        err.oom_report().unwrap().verdict,
        OomVerdict::LargerThanDevice
    );
    let text = err.to_string();
    assert!(text.starts_with(
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of 64.00 MiB"
    ));
    assert!(
        text.contains("the request is larger than the device's whole memory")
            && !text.contains("held elsewhere"),
        "{text}"
    );
    // Device full: half the device is live, and the request needs more than the rest.
    let x = a.allocate(40 * MIB, S0).unwrap();
    let err = a.allocate(30 * MIB, S0).unwrap_err();
    assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::DeviceFull);
    a.free(x.ptr).unwrap();
    // Free whole segments are flushed first; then the device is full.
    let a = pytorch_on(64 * MIB);
    let pieces: Vec<_> = (0..6).map(|_| a.allocate(10 * MIB, S0).unwrap()).collect();
    for p in pieces.iter().step_by(2) {
        a.free(p.ptr).unwrap();
    }
    a.backend().fail_allocations_above(Some(0)); // the device refuses everything now
    let err = a.allocate(25 * MIB, S0).unwrap_err();
    let r = err.oom_report().unwrap();
    assert_eq!(
        r.verdict,
        OomVerdict::DeviceFull,
        "flush released the free 10 MiB segments: {r:?}"
    );
    a.backend().clear_faults();
    for p in pieces.iter().skip(1).step_by(2) {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();

    // Fragmented: 12 MiB free in one segment, in two 6 MiB pieces; an 8 MiB request cannot fit.
    let a = pytorch_on(64 * MIB);
    let p: Vec<_> = [6 * MIB, 6 * MIB, 6 * MIB, 3 * MIB / 2]
        .iter()
        .map(|&n| a.allocate(n, S0).unwrap())
        .collect();
    assert_eq!(
        a.memory_stats().segment.get(StatType::All).current,
        1,
        "all four share one 20 MiB segment"
    );
    a.free(p[0].ptr).unwrap();
    a.free(p[2].ptr).unwrap();
    a.backend().fail_allocations_above(Some(0));
    let err = a.allocate(8 * MIB, S0).unwrap_err();
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Fragmented, "{r:?}");
    assert_eq!(r.largest_free_block, 6 * MIB);
    assert!((r.external_fragmentation - 0.5).abs() < 1e-9);
    assert!(err.to_string().contains("fragmented"));
    // The same free bytes do not serve another stream: the verdict says so instead of
    // "fragmented" (the report's largest block on that stream is 0).
    let s3 = StreamId(3);
    let err = a.allocate(4 * MIB, s3).unwrap_err();
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::CachedForOtherStreams, "{r:?}");
    assert_eq!(r.largest_free_block_on_stream, 0);
    assert!(
        err.to_string()
            .contains("in blocks of other streams or of the other size class"),
        "{err}"
    );
    // A request routed to a private pool is judged by that pool's free blocks: the default
    // pools' 12 MiB free do not make it "fragmented".
    let pool = MemPoolId::new_user();
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let err = a.allocate(4 * MIB, S0).unwrap_err();
    a.end_allocate_to_pool(pool).unwrap();
    assert_eq!(
        err.oom_report().unwrap().verdict,
        OomVerdict::DeviceFull,
        "{err}"
    );
    a.backend().clear_faults();
    a.free(p[1].ptr).unwrap();
    a.free(p[3].ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let a = pytorch_on(1 << 30);
    let zero = a.allocate(0, S0).unwrap();
    assert!(zero.ptr.is_null());
    a.free(zero.ptr).unwrap();
    assert_eq!(a.memory_stats(), {
        let b = pytorch_on(1 << 30);
        b.memory_stats()
    });
    assert!(matches!(
        a.allocate(1 << 60, S0),
        Err(AllocError::TooLarge { .. })
    ));
    assert!(
        a.allocate(usize::MAX, S0)
            .unwrap_err()
            .to_string()
            .contains("more than 1EB")
    );
    let x = a.allocate(4096, S0).unwrap();
    let before = a.memory_stats();
    assert!(matches!(
        a.free(DeviceAddr(12345)),
        Err(AllocError::UnknownPointer { .. })
    ));
    assert!(matches!(
        a.free(x.ptr.offset(512)),
        Err(AllocError::InteriorPointer { .. })
    ));
    a.free(x.ptr).unwrap();
    let after_free = a.memory_stats();
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    assert_eq!(a.memory_stats(), after_free);
    assert_ne!(before, after_free);
    a.backend().reject_stream(StreamId(99));
    let err = a.allocate(10, StreamId(99)).unwrap_err();
    assert!(matches!(err, AllocError::InvalidStream { .. }), "{err}");
    assert!(matches!(
        a.record_stream(DeviceAddr(4), S1),
        Err(AllocError::UnknownPointer { .. })
    ));
    // A stream the device rejects is refused at `record_stream` too, before anything changes
    // (it used to be listed and met only at the free, whose event record then failed).
    let y = a.allocate(4096, S0).unwrap();
    let before = a.memory_stats();
    let err = a.record_stream(y.ptr, StreamId(99)).unwrap_err();
    assert!(
        matches!(
            err,
            AllocError::InvalidStream {
                stream: StreamId(99),
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(a.memory_stats(), before);
    a.free(y.ptr).unwrap();
    assert_eq!(
        a.backend().counters().synchronize_calls,
        0,
        "the free synchronized"
    );
    a.check_invariants().unwrap();
}

#[test]
fn record_stream_defers_reuse_until_the_other_stream_is_done() {
    let a = pytorch_on(1 << 30);
    let side = StreamId(7);
    let x = a.allocate(8192, S0).unwrap();
    a.backend().submit_work(side); // a long kernel on the side stream reads x
    a.record_stream(x.ptr, side).unwrap();
    a.record_stream(x.ptr, S0).unwrap(); // own stream: ignored
    a.free(x.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current, 0);
    assert_eq!(
        st.active.get(StatType::All).current,
        1,
        "pending free stays active"
    );
    let y = a.allocate(8192, S0).unwrap();
    assert_ne!(y.ptr, x.ptr, "not reused while the side stream runs");
    let snap = a.snapshot();
    assert!(
        snap.iter()
            .flat_map(|s| &s.blocks)
            .any(|b| b.state == BlockState::ActivePendingFree)
    );
    a.check_invariants().unwrap();
    a.backend().complete_work(side);
    let z = a.allocate(8192, S0).unwrap();
    assert_eq!(z.ptr, x.ptr, "reused once the event completed");
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_waits_for_pending_events() {
    let a = pytorch_on(1 << 30);
    let side = StreamId(3);
    let x = a.allocate(8192, S0).unwrap();
    a.backend().submit_work(side);
    a.record_stream(x.ptr, side).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 0);
    assert_eq!(st.num_sync_all_streams, 1);
    a.check_invariants().unwrap();
}

#[test]
fn garbage_collection_frees_old_cached_blocks_under_a_cap() {
    let cfg = AllocatorConfig::parse("garbage_collection_threshold:0.5").unwrap();
    let a = with_config(1000 * MIB, cfg);
    a.set_memory_fraction(0.5).unwrap(); // cap 500 MiB, GC above 250 MiB
    let olds: Vec<_> = (0..12).map(|_| a.allocate(22 * MIB, S0).unwrap()).collect();
    for o in &olds {
        a.free(o.ptr).unwrap();
    }
    assert_eq!(a.memory_stats().memory_reserved(), (12 * 22 * MIB) as i64);
    // A miss with 264 MiB reserved (> 0.5 x 500 MiB) runs GC before asking the device.
    let n = a.allocate(30 * MIB, S0).unwrap();
    let st = a.memory_stats();
    assert!(st.num_device_free > 0, "GC released aged blocks");
    assert_eq!(st.num_alloc_retries, 0, "without a flush");
    a.free(n.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn stats_resets_and_summary() {
    let a = pytorch_on(1 << 30);
    let x = a.allocate(5 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.max_memory_allocated(), (5 * MIB) as i64);
    a.reset_peak_stats();
    assert_eq!(a.memory_stats().max_memory_allocated(), 0);
    a.reset_accumulated_stats();
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.get(StatType::All).allocated, 0);
    assert_eq!(st.num_device_alloc, 0);
    assert_eq!(
        st.memory_reserved(),
        (20 * MIB) as i64,
        "current values survive resets"
    );
    let s = a.memory_summary(false);
    assert!(s.contains("PyTorch CUDA memory summary, device ID 0"));
    assert!(
        s.contains("| GPU reserved memory   |  20480 KiB |  20480 KiB |      0 B   |      0 B   |"),
        "{s}"
    );
    assert_eq!(a.memory_stats().max_split_size, -1);
}

#[test]
fn owned_allocations_free_on_drop() {
    let a = std::sync::Arc::new(pytorch_on(1 << 30));
    {
        let o = a.allocate_owned(1 << 20, S0).unwrap();
        assert_eq!(o.len(), 1 << 20);
        // One name per field of `Allocation` (#15).
        let r = o.allocation();
        assert_eq!(
            (o.ptr(), o.size(), o.block_size(), o.stream()),
            (r.ptr, r.size, r.block_size, r.stream)
        );
        assert_eq!(o.stream(), S0);
        assert!(!o.is_empty());
        assert_eq!(a.memory_stats().memory_allocated(), 1 << 20);
    }
    assert_eq!(a.memory_stats().memory_allocated(), 0);
}

#[test]
fn allocator_is_send_and_sync_and_threads_agree() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CachingAllocator<SimDevice>>();
    let a = std::sync::Arc::new(pytorch_on(8 << 30));
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..400usize {
                    let size = 1 + (i * 7919 + t as usize * 104729) % (3 * MIB);
                    live.push(a.allocate(size, StreamId(t % 3)).unwrap());
                    if i % 3 == 0 {
                        let x = live.swap_remove((i * 31) % live.len());
                        a.free(x.ptr).unwrap();
                    }
                    if i % 97 == 0 {
                        a.empty_cache().unwrap();
                    }
                }
                live
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().unwrap());
    }
    a.check_invariants().unwrap();
    let want: usize = all.iter().map(|x| x.block_size).sum();
    assert_eq!(a.memory_stats().memory_allocated(), want as i64);
    all.sort_by_key(|x| x.ptr);
    for w in all.windows(2) {
        assert!(w[0].ptr.0 + w[0].block_size as u64 <= w[1].ptr.0, "overlap");
    }
    for x in all {
        a.free(x.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn recorded_history_replays_to_the_same_figures() {
    let a = pytorch_on(8 << 30);
    a.record_history(1 << 16);
    let mut live = Vec::new();
    for i in 0..300usize {
        live.push(
            a.allocate(1 + (i * 104_729) % (24 * MIB), StreamId((i % 2) as u64))
                .unwrap(),
        );
        if i % 3 == 2 {
            let x = live.swap_remove(i % live.len());
            a.free(x.ptr).unwrap();
        }
        if i == 150 {
            a.empty_cache().unwrap();
        }
    }
    let (trace, dropped) = a.history();
    assert_eq!(dropped, 0);
    assert!(
        trace
            .events
            .iter()
            .any(|e| matches!(e.op, trace::TraceOp::SegmentAlloc { .. }))
    );
    let b = pytorch_on(8 << 30);
    let r = replay(
        &b,
        &trace,
        &ReplayOptions {
            check_invariants: true,
            ..Default::default()
        },
    )
    .unwrap();
    let st = a.memory_stats();
    assert_eq!(r.peak_reserved_bytes as i64, st.max_memory_reserved());
    assert_eq!(r.final_stats, st);
    // The replayed allocator placed every segment where the recorded one had it.
    assert_eq!(b.snapshot(), a.snapshot());
    a.stop_history();
    assert!(a.history().0.events.is_empty());
    for x in live {
        a.free(x.ptr).unwrap();
    }
}

/// Dropping the allocator with an allocation still live gives the rest of its cache back to the
/// device (it kept every cached byte before, with only a `tracing` warning), and the memory
/// under the live allocation stays mapped, so its pointer stays valid.
#[test]
fn dropping_the_allocator_with_a_live_allocation_releases_the_rest_of_the_cache() {
    for (name, config) in crate::util::four_configs() {
        let dev = SimDevice::with_capacity(1 << 30);
        let keep = {
            let a = CachingAllocator::new(&dev, config).unwrap();
            let keep = a.allocate(MIB, S0).unwrap();
            let big = a.allocate(100 * MIB, S0).unwrap();
            let other = a.allocate(4096, StreamId(2)).unwrap();
            a.free(big.ptr).unwrap();
            a.free(other.ptr).unwrap();
            assert!(
                dev.counters().reserved_bytes >= 102 * MIB,
                "{name}: {:?}",
                dev.counters()
            );
            keep
        };
        let c = dev.counters();
        assert_eq!(
            c.reserved_bytes,
            2 * MIB,
            "{name}: only the live MiB's 2 MiB stays"
        );
        let held = |start: DeviceAddr, size: usize| {
            start.0 <= keep.ptr.0 && keep.ptr.0 + keep.size as u64 <= start.0 + size as u64
        };
        assert!(
            dev.live_segments().iter().any(|&(a, s)| held(a, s))
                || dev
                    .live_mapped_handles()
                    .iter()
                    .any(|&(a, s, _)| held(a, s)),
            "{name}: the live allocation's memory is still there"
        );
    }
}

/// `record_stream` of a freed pointer says the pointer is no longer live, not "double free"
/// (the user freed it once), with the fast path on and off.
#[test]
fn record_stream_of_a_freed_pointer_names_the_pointer_freed() {
    for (name, config) in crate::util::four_configs() {
        let a = with_config(1 << 30, config);
        let x = a.allocate(4096, S0).unwrap();
        a.free(x.ptr).unwrap();
        let before = a.memory_stats();
        let err = a.record_stream(x.ptr, S1).unwrap_err();
        assert!(
            matches!(err, AllocError::FreedPointer { ptr, operation: "record_stream" } if ptr == x.ptr),
            "{name}: {err}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "record_stream: {} is not a live allocation (it was freed before)",
                x.ptr
            ),
            "{name}"
        );
        assert_eq!(a.memory_stats(), before, "{name}");
        // free still calls a second free what it is.
        assert!(
            matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })),
            "{name}"
        );
        a.check_invariants().unwrap();
    }
}
