//! The pinned host cache (`host` module) on `SimHost`: exact-size sub-allocation, split and
//! merge, the cap, faults, statistics, stream-ordered reuse, a property test over random
//! programs with faults, and the pinned-bytes ratio against PyTorch's power-of-two policy.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_caching_allocator::host::{
    HostOp, PinnedInvariantViolation, PowerOfTwoModel, SimHostFault, mixed_workload,
};
use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::{Flag, FlagFence};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// A stream that never runs work: hand-outs are checked against it, so any incomplete use of a
/// handed-out range counts as a violation.
const NEW_OWNER: StreamId = StreamId(0xfeed);

fn cache_with(config: PinnedConfig) -> (Arc<SimDevice>, PinnedCache<SimHost>) {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(dev.clone(), SimHostConfig::default());
    (dev, PinnedCache::new(host, config).unwrap())
}

fn small() -> PinnedConfig {
    PinnedConfig::default().with_slab_size(MIB)
}

fn ok(c: &PinnedCache<SimHost>) {
    c.check_invariants().unwrap();
}

#[test]
fn sizes_are_exact_up_to_the_alignment() {
    let (_, c) = cache_with(small());
    let a = c.alloc(1000).unwrap();
    let b = c.alloc(3000).unwrap();
    assert_eq!(a.size, 1000);
    assert_eq!(
        b.ptr.addr(),
        a.ptr.addr() + 1024,
        "split at the aligned size"
    );
    let s = c.stats();
    assert_eq!(s.allocated_bytes.current, 1024 + 3072);
    assert_eq!(s.requested_bytes.current, 4000);
    assert_eq!(s.reserved_bytes.current, MIB as i64);
    assert_eq!(s.slabs.current, 1);
    ok(&c);
    let (_, c64) = cache_with(small().with_alignment(64));
    let a = c64.alloc(100).unwrap();
    let b = c64.alloc(100).unwrap();
    assert_eq!(b.ptr.addr() - a.ptr.addr(), 128);
}

#[test]
fn free_merges_neighbours_and_best_fit_picks_the_smallest_hole() {
    let (_, c) = cache_with(small());
    let blocks: Vec<_> = (0..6).map(|_| c.alloc(64 * KIB).unwrap()).collect();
    // Holes: one of 64 KiB (block 1), one of 128 KiB (blocks 3 and 4, merged).
    c.free(blocks[1].ptr).unwrap();
    c.free(blocks[3].ptr).unwrap();
    c.free(blocks[4].ptr).unwrap();
    ok(&c);
    let x = c.alloc(100 * KIB).unwrap();
    assert_eq!(
        x.ptr, blocks[3].ptr,
        "the merged 128 KiB hole is the only fit"
    );
    let y = c.alloc(40 * KIB).unwrap();
    assert_eq!(
        y.ptr, blocks[1].ptr,
        "the 64 KiB hole beats the slab's large tail"
    );
    let z = c.alloc(10 * KIB).unwrap();
    assert_eq!(
        z.ptr.addr(),
        y.ptr.addr() + 40 * KIB,
        "the 24 KiB rest beats the 28 KiB rest"
    );
    ok(&c);
    for b in [blocks[0], blocks[2], blocks[5], x, y, z] {
        c.free(b.ptr).unwrap();
    }
    ok(&c);
    // Wholly merged again: one free range of the whole slab.
    let whole = c.alloc(MIB).unwrap();
    assert_eq!(whole.ptr, blocks[0].ptr);
    assert_eq!(c.stats().slabs.current, 1);
}

#[test]
fn a_large_request_gets_an_exact_slab_and_empty_cache_unpins() {
    let (_, c) = cache_with(small());
    let big = c.alloc(3 * MIB + 5).unwrap();
    assert_eq!(c.stats().reserved_bytes.current, (3 * MIB + 256) as i64);
    assert_eq!(c.empty_cache().unwrap(), 0, "a live block keeps its slab");
    c.free(big.ptr).unwrap();
    assert_eq!(c.empty_cache().unwrap(), 3 * MIB + 256);
    assert_eq!(c.host().live_ranges(), vec![]);
    let s = c.stats();
    assert_eq!(
        (s.num_pins, s.num_unpins, s.reserved_bytes.current),
        (1, 1, 0)
    );
    assert_eq!(s.reserved_bytes.peak, (3 * MIB + 256) as i64);
    ok(&c);
}

#[test]
fn the_cap_is_enforced_with_an_error_naming_it() {
    let (_, c) = cache_with(small().with_max_pinned(Some(2 * MIB)));
    let a = c.alloc(MIB).unwrap();
    let b = c.alloc(600 * KIB).unwrap();
    // A full slab would pass the cap; an exact-size one fits.
    assert_eq!(c.stats().reserved_bytes.current, (MIB + MIB) as i64);
    let err = c.alloc(MIB).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, PinnedError::CapExceeded { cap, .. } if cap == 2 * MIB));
    assert!(msg.contains("max_pinned = 2.00 MiB"), "{msg}");
    ok(&c);
    // Freeing a makes its slab idle: the cap path unpins it and pins anew.
    c.free(a.ptr).unwrap();
    let d = c.alloc(900 * KIB).unwrap();
    assert!(c.stats().reserved_bytes.current <= (2 * MIB) as i64);
    c.free(b.ptr).unwrap();
    c.free(d.ptr).unwrap();
    ok(&c);
}

#[test]
fn bad_input_is_rejected_and_leaves_the_cache_intact() {
    let (_, c) = cache_with(small());
    assert!(matches!(c.alloc(0), Err(PinnedError::InvalidRequest(_))));
    assert!(matches!(
        c.alloc(usize::MAX),
        Err(PinnedError::InvalidRequest(_))
    ));
    let a = c.alloc(10).unwrap();
    c.free(a.ptr).unwrap();
    assert!(matches!(
        c.free(a.ptr),
        Err(PinnedError::UnknownBlock { .. })
    ));
    assert!(matches!(
        c.free(HostPtr(0)),
        Err(PinnedError::UnknownBlock { .. })
    ));
    assert!(matches!(
        c.record_stream(a.ptr, StreamId(1)),
        Err(PinnedError::UnknownBlock { .. })
    ));
    ok(&c);
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    for bad in [
        small().with_alignment(100),
        small().with_alignment(8192),
        small().with_slab_size(0),
    ] {
        let host = SimHost::new(dev.clone(), SimHostConfig::default());
        assert!(matches!(
            PinnedCache::new(host, bad),
            Err(PinnedError::InvalidConfig(_))
        ));
    }
    dev.reject_stream(StreamId(9));
    let (d2, c2) = cache_with(small());
    d2.reject_stream(StreamId(9));
    let b = c2.alloc(10).unwrap();
    assert!(c2.record_stream(b.ptr, StreamId(9)).is_err());
    assert_eq!(c2.streams_of(b.ptr).unwrap(), vec![]);
}

#[test]
fn pin_faults_and_out_of_memory_retry() {
    let (_, c) = cache_with(small());
    c.host().fail_next(SimHostFault::PinError);
    assert!(matches!(c.alloc(10), Err(PinnedError::Backend(_))));
    ok(&c);
    // Out of memory with an idle slab: the slab is unpinned and pinning retried.
    let a = c.alloc(10).unwrap();
    c.free(a.ptr).unwrap();
    c.host().fail_next(SimHostFault::PinOutOfMemory);
    let big = c.alloc(2 * MIB).unwrap();
    let s = c.stats();
    assert_eq!((s.num_pins, s.num_unpins, s.slabs.current), (2, 1, 1));
    c.free(big.ptr).unwrap();
    // Unpin fault: the slab stays pinned and cached, the error is returned.
    c.host().fail_next(SimHostFault::UnpinError);
    assert!(c.empty_cache().is_err());
    assert_eq!(c.stats().slabs.current, 1);
    ok(&c);
    assert_eq!(c.empty_cache().unwrap(), 2 * MIB);
}

#[test]
fn out_of_memory_retries_when_some_idle_slabs_unpinned_and_one_did_not() {
    let (_, c) = cache_with(small());
    let (a, b) = (c.alloc(MIB).unwrap(), c.alloc(MIB).unwrap());
    c.free(a.ptr).unwrap();
    c.free(b.ptr).unwrap();
    // The pin runs out of memory; of the two idle slabs one unpins and one fails to: the
    // freed slab is enough, so pinning is tried once more and succeeds.
    c.host().fail_next(SimHostFault::PinOutOfMemory);
    c.host().fail_next(SimHostFault::UnpinError);
    let big = c.alloc(2 * MIB).unwrap();
    let s = c.stats();
    assert_eq!((s.num_pins, s.num_unpins, s.slabs.current), (3, 1, 2));
    ok(&c);
    c.free(big.ptr).unwrap();
    assert_eq!(c.empty_cache().unwrap(), 3 * MIB);
    ok(&c);
}

/// A host that would pin anything (capacity `usize::MAX`): a request beyond what the byte
/// statistics (`i64`) can count is refused before any pin, naming the limit. Before, a request
/// of 2^63 bytes was pinned and every byte statistic turned negative (adversarial review); one
/// of nearly `usize::MAX` reached the host, whose address space overflowed.
#[test]
fn a_request_beyond_what_the_statistics_count_is_refused() {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(
        dev,
        SimHostConfig {
            capacity: usize::MAX,
            ..SimHostConfig::default()
        },
    );
    let c = PinnedCache::new(host, PinnedConfig::default()).unwrap();
    for size in [1 << 63, usize::MAX - MIB] {
        let r = c.alloc(size);
        assert!(
            matches!(&r, Err(PinnedError::InvalidRequest(m)) if m.contains("statistics")),
            "{size}: {:?}",
            r.map(|b| b.ptr)
        );
        assert_eq!(c.host().counters().pins, 0, "nothing pinned");
    }
    let st = c.stats();
    assert!(st.reserved_bytes.current == 0 && st.allocated_bytes.current == 0);
    ok(&c);
    let a = c.alloc(MIB).unwrap();
    c.free(a.ptr).unwrap();
    ok(&c);
}

#[test]
fn pin_time_comes_from_the_backend_and_the_summary_reports_it() {
    let (_, c) = cache_with(small());
    let a = c.alloc(10).unwrap();
    let b = c.alloc(5 * MIB).unwrap();
    c.free(a.ptr).unwrap();
    c.free(b.ptr).unwrap();
    c.empty_cache().unwrap();
    let s = c.stats();
    assert_eq!(
        s.pin_nanos + s.unpin_nanos,
        c.host().counters().modelled_nanos
    );
    // Modelled: 150 µs per call plus 0.5 ns per byte.
    assert_eq!(s.pin_nanos, 2 * 150_000 + (6 * MIB as u64) / 2);
    let line = c.summary();
    assert!(
        line.starts_with("pinned host: allocated 0 bytes (peak 5.00 MiB)"),
        "{line}"
    );
    assert!(line.contains("2 pins (3.446 ms)"), "{line}");
    assert!(!line.contains('\n'));
}

#[test]
fn a_block_used_on_a_stream_is_reused_only_after_the_work_completes() {
    let (dev, c) = cache_with(small());
    let s = StreamId(7);
    let a = c.alloc(64 * KIB).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), 64 * KIB);
    c.record_stream(a.ptr, s).unwrap();
    c.free(a.ptr).unwrap();
    assert_eq!(c.waiting_blocks(), 1);
    let b = c.alloc(64 * KIB).unwrap();
    assert_ne!(b.ptr, a.ptr, "the in-flight block must not be reused");
    assert!(dev.check_handout(NEW_OWNER, DeviceAddr(b.ptr.addr() as u64), 64 * KIB));
    dev.complete_work(s);
    let d = c.alloc(64 * KIB).unwrap();
    assert_eq!(d.ptr, a.ptr, "reused once its event completed");
    assert!(dev.check_handout(NEW_OWNER, DeviceAddr(d.ptr.addr() as u64), 64 * KIB));
    assert!(dev.violations().is_empty());
    assert_eq!(c.stats().num_event_records, 1);
    ok(&c);
}

#[test]
fn no_event_is_polled_when_none_is_pending() {
    let (_, c) = cache_with(small());
    for _ in 0..10 {
        let a = c.alloc(1000).unwrap();
        c.free(a.ptr).unwrap();
    }
    let s = c.stats();
    assert_eq!((s.num_event_records, s.num_event_queries), (0, 0));
    assert_eq!(s.num_cache_hits, 9);
}

#[test]
fn a_block_freed_after_a_fence_is_reused_only_once_the_fence_completed() {
    let (_, c) = cache_with(small());
    let flag = Arc::new(Flag::default());
    let a = c.alloc(64 * KIB).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    assert_eq!(c.waiting_blocks(), 1);
    assert_eq!(c.stats().pending_bytes.current, 64 * KIB as i64);
    let b = c.alloc(64 * KIB).unwrap();
    assert_ne!(b.ptr, a.ptr, "the fenced block must not be reused");
    ok(&c);
    let queries = flag.queries.load(Ordering::SeqCst);
    assert_eq!(queries, 2, "one query at the free, one at the next alloc");
    flag.done.store(true, Ordering::SeqCst);
    let d = c.alloc(64 * KIB).unwrap();
    assert_eq!(d.ptr, a.ptr, "reused once the fence completed");
    assert_eq!(c.waiting_blocks(), 0);
    // Nothing pending: no further query.
    c.free(d.ptr).unwrap();
    let e = c.alloc(64 * KIB).unwrap();
    assert_eq!(flag.queries.load(Ordering::SeqCst), queries + 1);
    assert_eq!(c.stats().num_event_queries, queries as u64 + 1);
    c.free(e.ptr).unwrap();
    c.free(b.ptr).unwrap();
    ok(&c);
}

#[test]
fn a_complete_fence_frees_at_once_and_an_unknown_block_is_refused() {
    let (_, c) = cache_with(small());
    let flag = Arc::new(Flag::default());
    flag.done.store(true, Ordering::SeqCst);
    let a = c.alloc(4096).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    assert_eq!(c.waiting_blocks(), 0);
    assert_eq!(flag.queries.load(Ordering::SeqCst), 1);
    assert!(matches!(
        c.free_after(a.ptr, Box::new(FlagFence(flag.clone()))),
        Err(PinnedError::UnknownBlock { ptr }) if ptr == a.ptr
    ));
    assert_eq!(c.alloc(4096).unwrap().ptr, a.ptr);
    ok(&c);
}

#[test]
fn dropping_the_cache_waits_for_pending_fences() {
    let (_, c) = cache_with(small());
    let flag = Arc::new(Flag::default());
    let a = c.alloc(4096).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    assert_eq!(flag.waits.load(Ordering::SeqCst), 0);
    drop(c);
    assert_eq!(flag.waits.load(Ordering::SeqCst), 1);
}

#[test]
fn a_failed_event_falls_back_to_synchronizing_the_stream() {
    let (dev, c) = cache_with(small());
    let s = StreamId(3);
    let a = c.alloc(4096).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), 4096);
    c.record_stream(a.ptr, s).unwrap();
    dev.fail_next_event_call(SimEventCall::Record);
    c.free(a.ptr).unwrap();
    assert_eq!(c.waiting_blocks(), 0, "the stream was synchronized instead");
    assert!(!dev.has_pending_work(s));
    assert_eq!(c.stats().num_stream_syncs, 1);
    // Both fail: the free reports the fence error, the block waits for empty_cache.
    let b = c.alloc(4096).unwrap();
    assert_eq!(b.ptr, a.ptr);
    dev.use_range(s, DeviceAddr(b.ptr.addr() as u64), 4096);
    c.record_stream(b.ptr, s).unwrap();
    dev.fail_next_event_call(SimEventCall::Record);
    dev.fail_next_synchronize();
    assert!(matches!(c.free(b.ptr), Err(PinnedError::Fence { stream, .. }) if stream == s));
    assert_eq!(c.waiting_blocks(), 1);
    let d = c.alloc(4096).unwrap();
    assert_ne!(d.ptr, b.ptr);
    ok(&c);
    c.free(d.ptr).unwrap();
    c.empty_cache().unwrap();
    assert_eq!(c.waiting_blocks(), 0);
    assert_eq!(c.stats().slabs.current, 0);
    assert!(dev.violations().is_empty());
    ok(&c);
}

/// Allocates a block that fills a 1 MiB slab, queues a copy that reads it on `s` and frees it:
/// the block waits for the copy's event.
fn pending_full_slab(dev: &SimDevice, c: &PinnedCache<SimHost>, s: StreamId) -> PinnedBlock {
    let a = c.alloc(MIB).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), MIB);
    c.record_stream(a.ptr, s).unwrap();
    c.free(a.ptr).unwrap();
    assert_eq!(c.waiting_blocks(), 1);
    a
}

#[test]
fn an_allocation_waits_for_a_pending_copy_rather_than_pin() {
    // Regression (#16): every block that would serve the request waits for a copy's event, so
    // the cache used to pin a new slab; it now waits on the host for the oldest such event.
    let (dev, c) = cache_with(small());
    assert_eq!(c.config().pending, PendingPolicy::Wait, "the default");
    let s = StreamId(5);
    let a = pending_full_slab(&dev, &c, s);
    let b = c.alloc(MIB).unwrap();
    assert_eq!(b.ptr, a.ptr, "the pending block was reused after its copy");
    let st = c.stats();
    assert_eq!(st.num_pins, 1, "no new slab");
    assert_eq!(st.num_pending_waits, 1, "the wait was made");
    assert_eq!(st.pending_bytes.current, 0);
    assert_eq!(c.waiting_blocks(), 0);
    assert!(!dev.has_pending_work(s), "the wait completed the copy");
    assert!(dev.check_handout(NEW_OWNER, DeviceAddr(b.ptr.addr() as u64), MIB));
    assert!(dev.violations().is_empty());
    assert!(c.summary().contains("1 pending waits"), "{}", c.summary());
    ok(&c);
    // The event went back to the spare list: the next free reuses it.
    c.record_stream(b.ptr, s).unwrap();
    c.free(b.ptr).unwrap();
    assert_eq!(dev.counters().events_created, 1);

    // A caller's fence (the cudarc interop frees this way) is waited for the same way.
    let (_, c) = cache_with(small());
    let flag = Arc::new(Flag::default());
    let a = c.alloc(MIB).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    let b = c.alloc(MIB).unwrap();
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(flag.waits.load(Ordering::SeqCst), 1);
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (1, 1));
    ok(&c);

    // PendingPolicy::Grow keeps the old behaviour: a new slab, the block left waiting.
    let (dev, c) = cache_with(small().with_pending(PendingPolicy::Grow));
    let a = pending_full_slab(&dev, &c, s);
    let b = c.alloc(MIB).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 0));
    assert_eq!(c.waiting_blocks(), 1);
    assert!(dev.has_pending_work(s));
    ok(&c);
}

#[test]
fn a_double_buffered_pipeline_pins_once_and_waits_for_its_copies() {
    // The shape of examples/pinned_bench.rs's pipeline: a staging buffer per batch, its copy
    // queued on a copy stream, freed at once; the host runs ahead of the copies. One 4 MiB slab
    // holds four 1 MiB batches in flight; the fifth waits for the oldest copy.
    let run = |pending: PendingPolicy| {
        let (dev, c) = cache_with(
            PinnedConfig::default()
                .with_slab_size(4 * MIB)
                .with_pending(pending),
        );
        let copy = StreamId(1);
        for _ in 0..64 {
            let b = c.alloc(MIB).unwrap();
            assert!(dev.check_handout(NEW_OWNER, DeviceAddr(b.ptr.addr() as u64), MIB));
            dev.use_range(copy, DeviceAddr(b.ptr.addr() as u64), MIB);
            c.record_stream(b.ptr, copy).unwrap();
            c.free(b.ptr).unwrap();
            ok(&c);
        }
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
        c.stats()
    };
    let wait = run(PendingPolicy::Wait);
    assert_eq!(wait.num_pins, 1, "no pin after the first slab");
    assert_eq!(wait.num_pending_waits, 60);
    assert_eq!(wait.reserved_bytes.peak, 4 * MIB as i64);
    let grow = run(PendingPolicy::Grow);
    assert_eq!(
        grow.num_pins, 16,
        "without waiting, a slab per four batches"
    );
    assert_eq!(grow.num_pending_waits, 0);
    assert_eq!(grow.reserved_bytes.peak, 64 * MIB as i64);
    println!(
        "pipeline (sim, 64 x 1 MiB, 4 MiB slabs): wait {} pins ({:.1} ms modelled), grow {} pins ({:.1} ms)",
        wait.num_pins,
        wait.pin_nanos as f64 / 1e6,
        grow.num_pins,
        grow.pin_nanos as f64 / 1e6
    );
}

#[test]
fn waiting_is_bounded_and_skips_blocks_it_cannot_help() {
    let s = StreamId(2);
    // max_pending_waits 0: no wait, a new slab.
    let (dev, c) = cache_with(small().with_max_pending_waits(0));
    pending_full_slab(&dev, &c, s);
    c.alloc(MIB).unwrap();
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 0));

    // A pending block too small, even with its free neighbours: no wait.
    let (dev, c) = cache_with(small());
    let live = c.alloc(512 * KIB).unwrap();
    let a = c.alloc(256 * KIB).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), 256 * KIB);
    c.record_stream(a.ptr, s).unwrap();
    c.free(a.ptr).unwrap();
    c.alloc(600 * KIB).unwrap();
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 0));
    // ... but one that fits with its free neighbour (256 KiB pending + 256 KiB free): a wait.
    let b = c.alloc(500 * KIB).unwrap();
    assert_eq!(b.ptr, a.ptr);
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 1));
    c.free(live.ptr).unwrap();
    ok(&c);

    // A wait that fails: the allocation pins instead, the failure is not counted as a wait,
    // and no later allocation waits for that block again (a failure such as an event recorded
    // inside a graph capture repeats); the block keeps waiting for a query to say done.
    let (_, c) = cache_with(small().with_max_pending_waits(3));
    let flag = Arc::new(Flag::default());
    flag.fail_wait.store(true, Ordering::SeqCst);
    let a = c.alloc(MIB).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    let b = c.alloc(MIB).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(flag.waits.load(Ordering::SeqCst), 1);
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 0));
    assert_eq!(c.waiting_blocks(), 1);
    let b2 = c.alloc(MIB).unwrap();
    assert_eq!(
        flag.waits.load(Ordering::SeqCst),
        1,
        "a block whose wait failed is not waited for again"
    );
    assert_eq!(c.stats().num_pending_waits, 0);
    c.free(b2.ptr).unwrap();
    ok(&c);

    // A claim whose event wait succeeds and whose fence wait fails: one wait counted (a real
    // one was made), the block keeps waiting for its fence and is not waited for again.
    let (dev, c) = cache_with(small().with_max_pending_waits(3));
    let flag = Arc::new(Flag::default());
    flag.fail_wait.store(true, Ordering::SeqCst);
    let a = c.alloc(MIB).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), MIB);
    c.record_stream(a.ptr, s).unwrap();
    c.free_after(a.ptr, Box::new(FlagFence(flag.clone())))
        .unwrap();
    let b = c.alloc(MIB).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert!(!dev.has_pending_work(s), "the event wait was made");
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 1));
    let b2 = c.alloc(MIB).unwrap();
    assert_eq!(flag.waits.load(Ordering::SeqCst), 1, "not waited for again");
    assert_eq!(c.waiting_blocks(), 1);
    c.free(b.ptr).unwrap();
    c.free(b2.ptr).unwrap();
    ok(&c);
    flag.done.store(true, Ordering::SeqCst);
    assert_eq!(
        c.alloc(MIB).unwrap().ptr,
        a.ptr,
        "reused once a query says done"
    );

    // A block whose stream could be fenced neither by an event nor a synchronization: waiting
    // cannot clear it, so a new slab is pinned at once.
    let (dev, c) = cache_with(small());
    let a = c.alloc(MIB).unwrap();
    dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), MIB);
    c.record_stream(a.ptr, s).unwrap();
    dev.fail_next_event_call(SimEventCall::Record);
    dev.fail_next_synchronize();
    assert!(c.free(a.ptr).is_err());
    let b = c.alloc(MIB).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert_eq!((c.stats().num_pins, c.stats().num_pending_waits), (2, 0));
    assert!(dev.violations().is_empty());
    ok(&c);
}

#[test]
fn threads_waiting_for_pending_blocks_never_hand_out_in_flight_memory() {
    // Each thread: alloc, a copy on its own stream, free; the waits run without the lock.
    let (dev, c) = cache_with(small());
    let c = Arc::new(c);
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (dev, c) = (dev.clone(), c.clone());
            scope.spawn(move || {
                let s = StreamId(10 + t);
                for _ in 0..200 {
                    let b = c.alloc(256 * KIB).unwrap();
                    let p = DeviceAddr(b.ptr.addr() as u64);
                    assert!(dev.check_handout(StreamId(100 + t), p, 256 * KIB));
                    dev.use_range(s, p, 256 * KIB);
                    c.record_stream(b.ptr, s).unwrap();
                    c.free(b.ptr).unwrap();
                }
            });
        }
    });
    ok(&c);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    let st = c.stats();
    assert!(st.num_pending_waits > 0);
    assert_eq!(st.num_allocs, 800);
    println!("4 threads: {}", c.summary());
}

#[test]
fn invariant_violations_display_their_check() {
    let v = PinnedInvariantViolation {
        check: "free_index",
        detail: "x".into(),
    };
    assert_eq!(v.to_string(), "free_index: x");
}

/// Runs `ops` on the cache and on the power-of-two model; returns (cache peak reserved, model
/// pinned, peak requested).
fn ratios(ops: &[HostOp], slab: usize) -> (usize, usize, usize) {
    let (a, b, c, _) = ratios_with(ops, PinnedConfig::default().with_slab_size(slab));
    (a, b, c)
}

/// As `ratios`, with any configuration; also returns the cache's statistics.
fn ratios_with(ops: &[HostOp], config: PinnedConfig) -> (usize, usize, usize, PinnedStats) {
    let (_, c) = cache_with(config);
    let mut model = PowerOfTwoModel::default();
    let mut live: BTreeMap<usize, (PinnedBlock, usize)> = BTreeMap::new();
    let mut requested = 0usize;
    let mut peak = 0usize;
    for op in ops {
        match *op {
            HostOp::Alloc { slot, size } => {
                if let Some((b, r)) = live.remove(&slot) {
                    c.free(b.ptr).unwrap();
                    model.free(r);
                    requested -= b.size;
                }
                let b = c.alloc(size).unwrap();
                let r = model.alloc(size);
                requested += size;
                peak = peak.max(requested);
                live.insert(slot, (b, r));
            }
            HostOp::Free { slot } => {
                if let Some((b, r)) = live.remove(&slot) {
                    c.free(b.ptr).unwrap();
                    model.free(r);
                    requested -= b.size;
                }
            }
        }
    }
    ok(&c);
    let reserved = c.stats().reserved_bytes.peak as usize;
    (reserved, model.pinned, peak, c.stats())
}

#[test]
fn mixed_sizes_pin_far_less_than_power_of_two_rounding() {
    let ops = mixed_workload(42, 4000, 48, 64 * MIB);
    let (cache, pow2, peak) = ratios(&ops, 64 * MIB);
    let (rc, rp) = (cache as f64 / peak as f64, pow2 as f64 / peak as f64);
    println!(
        "mixed workload: peak requested {:.1} MiB; cache reserved {:.1} MiB ({rc:.3}x); power-of-two model {:.1} MiB ({rp:.3}x)",
        peak as f64 / MIB as f64,
        cache as f64 / MIB as f64,
        pow2 as f64 / MIB as f64
    );
    assert!(
        rc < rp,
        "the cache must pin less than power-of-two rounding"
    );
    // Measured 1.431x (cache) vs 2.181x (power of two); the 1.05x target is not met
    // by best fit over 64 MiB slabs on this workload (docs/pinned.md).
    assert!(rc <= 1.5, "cache ratio {rc:.3}");
    assert!(rp >= 1.9, "power-of-two ratio {rp:.3}");
    // The slack rule (`PinnedConfig::tight`: 4 MiB slabs, max_slack 0.05): measured 1.237x
    // with 41 pins and 31 unpins (the default: 1.431x, 10 pins).
    let (tight, _, tpeak, st) = ratios_with(&ops, PinnedConfig::tight());
    let rt = tight as f64 / tpeak as f64;
    println!(
        "tight: {:.1} MiB ({rt:.3}x), {} pins, {} unpins, {:.0} ms pinning (modelled)",
        tight as f64 / MIB as f64,
        st.num_pins,
        st.num_unpins,
        st.pin_nanos as f64 / 1e6
    );
    assert!(rt <= 1.25, "tight ratio {rt:.3}");
    assert!(st.num_unpins > 0, "the slack rule unpinned idle slabs");
    // The fit rule on top (`PinnedConfig::frugal`): measured 1.032x, at 796 pins.
    let (frugal, _, fpeak, st) = ratios_with(&ops, PinnedConfig::frugal());
    let rf = frugal as f64 / fpeak as f64;
    println!(
        "frugal: {:.1} MiB ({rf:.3}x), {} pins, {} unpins, {:.0} ms pinning (modelled)",
        frugal as f64 / MIB as f64,
        st.num_pins,
        st.num_unpins,
        st.pin_nanos as f64 / 1e6
    );
    assert!(rf <= 1.05, "frugal ratio {rf:.3}: the issue's target");
}

/// The mixed workload with every block used by a copy on one stream before it is freed; the
/// stream's work completes only every `lag` operations (copies in flight when blocks are
/// freed). Returns (peak reserved, peak requested, statistics).
fn mixed_with_copies(
    ops: &[HostOp],
    config: PinnedConfig,
    lag: usize,
) -> (usize, usize, PinnedStats) {
    let (dev, c) = cache_with(config);
    let s = StreamId(9);
    let mut live: BTreeMap<usize, PinnedBlock> = BTreeMap::new();
    let (mut requested, mut peak) = (0usize, 0usize);
    for (i, op) in ops.iter().enumerate() {
        let slot = match *op {
            HostOp::Alloc { slot, .. } | HostOp::Free { slot } => slot,
        };
        if let Some(b) = live.remove(&slot) {
            c.free(b.ptr).unwrap();
            requested -= b.size;
        }
        if let HostOp::Alloc { size, .. } = *op {
            let b = c.alloc(size).unwrap();
            let p = DeviceAddr(b.ptr.addr() as u64);
            assert!(dev.check_handout(NEW_OWNER, p, size));
            dev.use_range(s, p, size);
            c.record_stream(b.ptr, s).unwrap();
            requested += size;
            peak = peak.max(requested);
            live.insert(slot, b);
        }
        if i % lag == lag - 1 {
            dev.complete_work(s);
        }
    }
    assert!(dev.violations().is_empty());
    ok(&c);
    (c.stats().reserved_bytes.peak as usize, peak, c.stats())
}

#[test]
fn mixed_sizes_with_copies_in_flight_pin_less_when_waiting() {
    // Blocks fenced by pending copies: Grow pins around them, Wait reuses them after a wait.
    let ops = mixed_workload(42, 4000, 48, 64 * MIB);
    let (wait, peak, ws) = mixed_with_copies(&ops, PinnedConfig::default(), 16);
    let (grow, gpeak, gs) = mixed_with_copies(
        &ops,
        PinnedConfig::default().with_pending(PendingPolicy::Grow),
        16,
    );
    assert_eq!(peak, gpeak);
    let (rw, rg) = (wait as f64 / peak as f64, grow as f64 / peak as f64);
    println!(
        "mixed with copies in flight (lag 16): wait {rw:.3}x, {} pins ({:.0} ms modelled), {} waits; grow {rg:.3}x, {} pins ({:.0} ms)",
        ws.num_pins,
        ws.pin_nanos as f64 / 1e6,
        ws.num_pending_waits,
        gs.num_pins,
        gs.pin_nanos as f64 / 1e6
    );
    assert!(ws.num_pending_waits > 0);
    assert!(wait < grow, "waiting pins less: {rw:.3}x vs {rg:.3}x");
    assert!(ws.num_pins < gs.num_pins);
}

#[test]
fn the_fit_rule_pins_an_exact_slab_rather_than_split_a_much_larger_range() {
    let cfg = PinnedConfig::default()
        .with_slab_size(MIB)
        .with_max_fit_waste(Some(0.25));
    let (_, c) = cache_with(cfg);
    let big = c.alloc(8 * MIB).unwrap();
    c.free(big.ptr).unwrap();
    // 5 MiB: the idle 8 MiB range is 1.6x the request, past 1.25x: a 5 MiB slab is pinned.
    let a = c.alloc(5 * MIB).unwrap();
    assert_ne!(a.ptr, big.ptr);
    assert_eq!(c.stats().reserved_bytes.current, 13 * MIB as i64);
    // 7 MiB: 8 MiB is within 1.25x, so it is taken (split as usual).
    let b = c.alloc(7 * MIB).unwrap();
    assert_eq!(b.ptr, big.ptr);
    // At most a slab: the rule does not apply; the 1 MiB rest of the 8 MiB range serves it.
    let d = c.alloc(64 * KIB).unwrap();
    assert_eq!(d.ptr.addr(), big.ptr.addr() + 7 * MIB);
    assert_eq!(c.stats().num_pins, 2);
    ok(&c);
    for bad in [-1.0, f64::NAN] {
        let dev = Arc::new(SimDevice::with_capacity(1 << 30));
        let host = SimHost::new(dev, SimHostConfig::default());
        let err = PinnedCache::new(host, cfg.with_max_fit_waste(Some(bad))).unwrap_err();
        assert!(err.to_string().contains("max_fit_waste"), "{err}");
    }
}

#[test]
fn the_slack_rule_unpins_idle_slabs_and_cuts_new_slabs_to_the_request() {
    let cfg = PinnedConfig::default()
        .with_slab_size(4 * MIB)
        .with_max_slack(Some(0.05));
    let (_, c) = cache_with(cfg);
    // In use 1 MiB: a 4 MiB slab would pass the budget (1.05 MiB), so the slab is cut to 1 MiB.
    let live = c.alloc(MIB).unwrap();
    assert_eq!(c.stats().reserved_bytes.current, MIB as i64);
    // Within the budget: exact slabs (larger than the slab size), kept when freed.
    let a = c.alloc(5 * MIB).unwrap();
    let b = c.alloc(6 * MIB).unwrap();
    c.free(a.ptr).unwrap();
    c.free(b.ptr).unwrap();
    assert_eq!(c.stats().reserved_bytes.current, 12 * MIB as i64);
    assert_eq!(c.stats().num_unpins, 0);
    // 7 MiB fits no free range: in use would be 8 MiB, budget 8.4 MiB, so the idle slabs go
    // (the 6 MiB one first, then the 5 MiB one) and a 7 MiB slab is pinned.
    let d = c.alloc(7 * MIB).unwrap();
    let s = c.stats();
    assert_eq!(s.num_unpins, 2);
    assert_eq!(s.reserved_bytes.current, 8 * MIB as i64);
    ok(&c);
    // No idle slab left: the new slab is cut to the request.
    let e = c.alloc(512 * KIB).unwrap();
    assert_eq!(
        c.stats().reserved_bytes.current,
        (8 * MIB + 512 * KIB) as i64
    );
    assert_eq!(c.stats().num_unpins, 2);
    for p in [live.ptr, d.ptr, e.ptr] {
        c.free(p).unwrap();
    }
    ok(&c);
    // Without the rule the idle slabs stay.
    let (_, keep) = cache_with(cfg.with_max_slack(None));
    let a = keep.alloc(5 * MIB).unwrap();
    keep.free(a.ptr).unwrap();
    keep.alloc(7 * MIB).unwrap();
    assert_eq!(keep.stats().num_unpins, 0);
    assert_eq!(keep.stats().reserved_bytes.current, 12 * MIB as i64);
    for bad in [-0.5, f64::NAN, f64::INFINITY] {
        let dev = Arc::new(SimDevice::with_capacity(1 << 30));
        let host = SimHost::new(dev, SimHostConfig::default());
        let err = PinnedCache::new(host, cfg.with_max_slack(Some(bad))).unwrap_err();
        assert!(err.to_string().contains("max_slack"), "{err}");
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
    Use(usize, u64),
    Complete(u64),
    EmptyCache,
    Fault(u8),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![1usize..4096, 4096usize..(256 * KIB), (256 * KIB)..(3 * MIB)].prop_map(Op::Alloc),
        4 => any::<usize>().prop_map(Op::Free),
        3 => (any::<usize>(), 1u64..4).prop_map(|(i, s)| Op::Use(i, s)),
        2 => (1u64..4).prop_map(Op::Complete),
        1 => Just(Op::EmptyCache),
        1 => (0u8..5).prop_map(Op::Fault),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_programs_never_hand_out_in_flight_or_live_memory(
        ops in proptest::collection::vec(op_strategy(), 1..120),
        cap in prop_oneof![Just(None), Just(Some(6 * MIB))],
        slack in prop_oneof![Just(None), Just(Some(0.05))],
        waste in prop_oneof![Just(None), Just(Some(0.25))],
        pending in prop_oneof![Just(PendingPolicy::Wait), Just(PendingPolicy::Grow)],
    ) {
        let (dev, c) = cache_with(
            PinnedConfig::default()
                .with_slab_size(MIB)
                .with_max_pinned(cap)
                .with_max_slack(slack)
                .with_max_fit_waste(waste)
                .with_pending(pending),
        );
        let mut live: Vec<PinnedBlock> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(size) => match c.alloc(size) {
                    Ok(b) => {
                        let (lo, hi) = (b.ptr.addr(), b.ptr.addr() + b.size);
                        for o in &live {
                            prop_assert!(hi <= o.ptr.addr() || o.ptr.addr() + o.size <= lo,
                                "{b:?} overlaps live {o:?}");
                        }
                        prop_assert!(dev.check_handout(NEW_OWNER, DeviceAddr(lo as u64), b.size),
                            "{b:?} handed out while in flight: {:?}", dev.violations());
                        live.push(b);
                    }
                    Err(PinnedError::CapExceeded { .. } | PinnedError::Backend(_)) => {}
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::Free(i) if !live.is_empty() => {
                    let b = live.swap_remove(i % live.len());
                    match c.free(b.ptr) {
                        Ok(()) | Err(PinnedError::Fence { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Use(i, s) if !live.is_empty() => {
                    let b = live[i % live.len()];
                    dev.use_range(StreamId(s), DeviceAddr(b.ptr.addr() as u64), b.size);
                    c.record_stream(b.ptr, StreamId(s)).unwrap();
                }
                Op::Complete(s) => dev.complete_work(StreamId(s)),
                Op::EmptyCache => { let _ = c.empty_cache(); }
                Op::Fault(k) => match k {
                    0 => c.host().fail_next(SimHostFault::PinOutOfMemory),
                    1 => c.host().fail_next(SimHostFault::PinError),
                    2 => c.host().fail_next(SimHostFault::UnpinError),
                    3 => dev.fail_next_event_call(SimEventCall::Record),
                    _ => { dev.fail_next_event_call(SimEventCall::Create); dev.fail_next_synchronize(); }
                },
                _ => {}
            }
            c.check_invariants().map_err(|v| TestCaseError::fail(v.to_string()))?;
            prop_assert!(dev.violations().is_empty(), "{:?}", dev.violations());
            let s = c.stats();
            let live_bytes: usize = live.iter().map(|b| b.size).sum();
            prop_assert_eq!(s.requested_bytes.current as usize, live_bytes);
        }
    }
}
