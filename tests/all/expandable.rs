//! Expandable segments: PyTorch 2.11's rules (one growable range per stream and pool, pages
//! mapped on growth and unmapped only by `empty_cache` / the OOM path, the expandable best-fit
//! walk, splitting down to 512 bytes, PyTorch's stats), this crate's page reuse, invariants after
//! every operation of random programs, and fault injection at every device call.

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Run, random_program};
use crate::util::{MIB, with_config};

fn pytorch_expandable() -> AllocatorConfig {
    Preset::PytorchExpandable.config()
}

#[test]
fn one_range_per_stream_and_pool_grows_by_pages() {
    let a = with_config(1 << 30, pytorch_expandable());
    let x = a.allocate(3 * MIB, StreamId(0)).unwrap();
    let c = a.backend().counters();
    assert_eq!(c.reserve_calls, 1);
    assert_eq!(
        (c.create_physical_calls, c.map_calls),
        (1, 1),
        "one 20 MiB page"
    );
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 20 * MIB as i64);
    assert_eq!(
        st.segment.get(StatType::All).current,
        0,
        "map does not bump `segment`"
    );
    assert_eq!(st.num_device_alloc, 1);
    // 30 MiB more: the free 17 MiB at the end plus one more page... two pages, one map range.
    let y = a.allocate(30 * MIB, StreamId(0)).unwrap();
    assert_eq!(
        y.ptr.0,
        x.ptr.0 + 3 * MIB as u64,
        "tiles right after the first block"
    );
    let c = a.backend().counters();
    assert_eq!((c.reserve_calls, c.create_physical_calls), (1, 2));
    assert_eq!(a.memory_stats().num_device_alloc, 2);
    // The small pool and another stream get ranges of their own.
    let z = a.allocate(1000, StreamId(0)).unwrap();
    let w = a.allocate(5 * MIB, StreamId(7)).unwrap();
    let c = a.backend().counters();
    assert_eq!(c.reserve_calls, 3);
    assert_eq!(
        a.memory_stats().memory_reserved(),
        (40 + 2 + 20) * MIB as i64
    );
    // Snapshots report one segment per contiguous mapped range, as PyTorch does.
    let snap = a.snapshot();
    assert_eq!(snap.len(), 3);
    assert!(snap.iter().all(|s| s.is_expandable));
    assert!(
        snap.iter()
            .flat_map(|s| &s.blocks)
            .all(|b| b.state != BlockState::Unmapped)
    );
    assert_eq!(
        snap.iter().map(|s| s.total_size).sum::<usize>(),
        62 * MIB,
        "snapshots cover the mapped bytes"
    );
    for p in [x, y, z, w] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn frees_never_unmap_and_empty_cache_releases_everything() {
    let a = with_config(1 << 30, pytorch_expandable());
    let xs: Vec<_> = [5 * MIB, 25 * MIB, 700 * 1024, 64 * MIB]
        .into_iter()
        .map(|s| a.allocate(s, StreamId(0)).unwrap())
        .collect();
    let reserved = a.memory_stats().memory_reserved();
    for x in &xs {
        a.free(x.ptr).unwrap();
    }
    assert_eq!(a.memory_stats().memory_reserved(), reserved);
    assert_eq!(a.backend().counters().unmap_calls, 0);
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 0);
    assert_eq!(
        st.num_device_free, 2,
        "one unmap per free block (one per pool)"
    );
    let c = a.backend().counters();
    assert_eq!(c.reserved_bytes, 0);
    assert_eq!(
        c.release_range_calls, c.reserve_calls,
        "empty ranges are released"
    );
    assert_eq!(c.release_physical_calls, c.create_physical_calls);
    assert!(a.backend().live_mappings().is_empty());
    a.check_invariants().unwrap();
}

#[test]
fn memory_handles_count_the_physical_handles_held() {
    // Expandable: one handle per page created, given back by `empty_cache`.
    let a = with_config(1 << 30, AllocatorConfig::default());
    let xs: Vec<_> = [5 * MIB, 25 * MIB, 700 * 1024, 64 * MIB]
        .into_iter()
        .map(|s| a.allocate(s, StreamId(0)).unwrap())
        .collect();
    let held = |a: &CachingAllocator<SimDevice>| {
        let c = a.backend().counters();
        (c.create_physical_calls - c.release_physical_calls) as i64
    };
    let h = a.memory_handles();
    assert!(h.current > 1, "several pages: {h:?}");
    assert_eq!(h.current, held(&a));
    assert_eq!((h.peak, h.allocated, h.freed), (h.current, h.current, 0));
    for x in &xs {
        a.free(x.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    let after = a.memory_handles();
    assert_eq!(
        (after.current, after.peak, after.freed),
        (0, h.current, h.current),
        "empty_cache gives every handle back; the peak stays"
    );
    a.reset_peak_stats();
    a.reset_accumulated_stats();
    assert_eq!(a.memory_handles(), Stat::default());
    a.check_invariants().unwrap();

    // Fixed segments: one handle per segment, as `segment` counts them.
    let p = with_config(1 << 30, AllocatorConfig::pytorch());
    let ys: Vec<_> = [5 * MIB, 25 * MIB, 700 * 1024]
        .into_iter()
        .map(|s| p.allocate(s, StreamId(0)).unwrap())
        .collect();
    let seg = *p.memory_stats().segment.get(StatType::All);
    assert_eq!(p.memory_handles().current, seg.current);
    assert_eq!(p.memory_handles().current, 3);
    for y in &ys {
        p.free(y.ptr).unwrap();
    }
    p.empty_cache().unwrap();
    assert_eq!(
        (p.memory_handles().current, p.memory_handles().peak),
        (0, 3)
    );
}

#[test]
fn empty_cache_unmaps_only_whole_free_pages() {
    let a = with_config(1 << 30, pytorch_expandable());
    // 3 pages of 20 MiB; keep a block in the middle page alive.
    let x = a.allocate(25 * MIB, StreamId(0)).unwrap();
    let keep = a.allocate(2 * MIB, StreamId(0)).unwrap();
    let y = a.allocate(30 * MIB, StreamId(0)).unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 60 * MIB as i64);
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    // Page 0 ([0, 20)) is wholly free; page 1 holds `keep` ([25, 27)); page 2 ([40, 60)) is
    // wholly free.
    assert_eq!(a.memory_stats().memory_reserved(), 20 * MIB as i64);
    assert_eq!(a.memory_stats().num_device_free, 2);
    a.check_invariants().unwrap();
    // No free block holds 22 MiB: growth maps the lowest hole, which with the free 5 MiB after
    // it has room.
    let z = a.allocate(22 * MIB, StreamId(0)).unwrap();
    assert_eq!(z.ptr, x.ptr);
    assert_eq!(a.memory_stats().memory_reserved(), 40 * MIB as i64);
    a.free(keep.ptr).unwrap();
    a.free(z.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().reserved_bytes, 0);
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_prefers_a_block_that_cannot_grow() {
    let a = with_config(1 << 30, pytorch_expandable());
    let x = a.allocate(4 * MIB, StreamId(0)).unwrap();
    let b = a.allocate(6 * MIB, StreamId(0)).unwrap();
    let c = a.allocate(6 * MIB, StreamId(0)).unwrap();
    // Free: [16, 20) MiB next to the unmapped tail; now also [4, 10) MiB in the middle.
    a.free(b.ptr).unwrap();
    let d = a.allocate(4 * MIB, StreamId(0)).unwrap();
    assert_eq!(
        d.ptr, b.ptr,
        "the 6 MiB hole has the smaller expandable size than the 4 MiB block at the tail"
    );
    // The same request under PyTorch's fixed segments takes the exact fit.
    let f = with_config(1 << 30, AllocatorConfig::pytorch());
    let fx = f.allocate(4 * MIB, StreamId(0)).unwrap();
    let fb = f.allocate(6 * MIB, StreamId(0)).unwrap();
    let fc = f.allocate(6 * MIB, StreamId(0)).unwrap();
    f.free(fb.ptr).unwrap();
    let fd = f.allocate(4 * MIB, StreamId(0)).unwrap();
    assert_eq!(fd.ptr.0, fc.ptr.0 + 6 * MIB as u64);
    for p in [x, c, d] {
        a.free(p.ptr).unwrap();
    }
    for p in [fx, fc, fd] {
        f.free(p.ptr).unwrap();
    }
}

#[test]
fn large_blocks_split_down_to_512_bytes_and_skip_inactive_split() {
    let a = with_config(1 << 30, pytorch_expandable());
    let x = a.allocate(2 * MIB, StreamId(0)).unwrap();
    let y = a.allocate(2 * MIB, StreamId(0)).unwrap();
    a.free(x.ptr).unwrap();
    // 2 MiB - 512 from a 2 MiB free block: fixed segments keep the slack in the block;
    // expandable segments split the 512 bytes off.
    let z = a.allocate(2 * MIB - 512, StreamId(0)).unwrap();
    assert_eq!(z.block_size, 2 * MIB - 512);
    let st = a.memory_stats();
    assert_eq!(st.inactive_split.get(StatType::All).current, 0);
    assert_eq!(st.inactive_split_bytes.get(StatType::All).peak, 0);
    for p in [y, z] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn reservations_cover_nine_eighths_of_the_device() {
    let a = with_config(1 << 30, pytorch_expandable());
    let x = a.allocate(MIB, StreamId(0)).unwrap();
    let y = a.allocate(3 * MIB, StreamId(0)).unwrap();
    // The next reservation is placed after the previous ones: their size shows in the gap.
    let z = a.allocate(3 * MIB, StreamId(1)).unwrap();
    let small_va = (9 * (1usize << 30) / 8).div_ceil(2 * MIB) * 2 * MIB;
    let large_va = (9 * (1usize << 30) / 8).div_ceil(20 * MIB) * 20 * MIB;
    assert_eq!(y.ptr.0 - x.ptr.0, small_va as u64);
    assert_eq!(z.ptr.0 - y.ptr.0, large_va as u64);
    for p in [x, y, z] {
        a.free(p.ptr).unwrap();
    }
}

#[test]
fn without_virtual_memory_the_default_falls_back_to_fixed_segments() {
    let sim = SimDevice::new(SimConfig {
        vm_granularity: None,
        ..SimConfig::default()
    });
    let a = CachingAllocator::new(sim, AllocatorConfig::default()).unwrap();
    let x = a.allocate(3 * MIB, StreamId(0)).unwrap();
    assert_eq!(a.backend().counters().allocate_calls, 1);
    assert_eq!(a.memory_stats().segment.get(StatType::All).current, 1);
    a.free(x.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_page_size_off_the_granularity_is_refused_not_turned_into_fixed_segments() {
    // A 3 MiB page cannot be made of 2 MiB handles: the allocator says so, naming the key,
    // instead of quietly running PyTorch's fixed segments under an expandable configuration.
    for (conf, key) in [
        (
            "cca_preset:default,cca_large_page_size_mb:3",
            "cca_large_page_size_mb",
        ),
        (
            "expandable_segments:True,large_segment_size_mb:21",
            "large_segment_size_mb",
        ),
    ] {
        let config = AllocatorConfig::parse(conf).unwrap();
        let err = CachingAllocator::new(SimDevice::default(), config).unwrap_err();
        assert!(matches!(err, AllocError::Config(_)), "{conf}: {err}");
        let msg = err.to_string();
        assert!(msg.contains(key) && msg.contains("granularity"), "{msg}");
    }
    // A multiple of the granularity, and the same odd size without expandable segments, stand.
    for conf in [
        "cca_preset:default,cca_large_page_size_mb:4",
        "large_segment_size_mb:21",
    ] {
        let a = CachingAllocator::new(SimDevice::default(), AllocatorConfig::parse(conf).unwrap())
            .unwrap();
        let x = a.allocate(3 * MIB, StreamId(0)).unwrap();
        a.free(x.ptr).unwrap();
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_backend_alignment_that_is_not_a_power_of_two_is_refused() {
    let sim = SimDevice::new(SimConfig {
        alignment: 3,
        ..SimConfig::default()
    });
    let err = CachingAllocator::new(sim, AllocatorConfig::default()).unwrap_err();
    assert!(err.to_string().contains("not a power of two"), "{err}");
}

/// Every 2 MiB page mapped now, by address (the default maps one handle per page).
fn mapped_pages<B: DeviceBackend>(a: &CachingAllocator<B>) -> Vec<DeviceAddr> {
    a.snapshot()
        .iter()
        .filter(|s| s.is_expandable)
        .flat_map(|s| (0..s.total_size / (2 * MIB)).map(move |k| s.address.offset(k * 2 * MIB)))
        .collect()
}

#[test]
fn peer_access_reaches_every_mapped_page_now_and_later() {
    // Mapped pages are reachable only by the devices their access was set for: a peer copy
    // from another device into memory of the default failed with "invalid argument" under
    // PyTorch until the allocator granted the peer access, as PyTorch's addPeerAccess does.
    let a = CachingAllocator::new(SimDevice::default(), AllocatorConfig::default()).unwrap();
    let x = a.allocate(5 * MIB, StreamId(0)).unwrap();
    let y = a.allocate(100_000, StreamId(0)).unwrap();
    let before = mapped_pages(&a);
    assert!(before.len() >= 4, "{before:?}");
    for &va in &before {
        assert_eq!(a.backend().peers_with_access(va), Some(vec![]), "{va}");
    }
    let calls = a.backend().counters().set_access_calls;
    a.enable_peer_access(1).unwrap();
    for &va in &before {
        assert_eq!(a.backend().peers_with_access(va), Some(vec![1]), "{va}");
    }
    let granted = a.backend().counters().set_access_calls - calls;
    assert_eq!(granted as usize, before.len(), "one grant per mapping");
    // Again: nothing to do.
    a.enable_peer_access(1).unwrap();
    assert_eq!(
        a.backend().counters().set_access_calls - calls,
        granted,
        "a second call grants nothing"
    );
    // Pages mapped later carry the peer from the start.
    let z = a.allocate(40 * MIB, StreamId(0)).unwrap();
    let after = mapped_pages(&a);
    assert!(after.len() > before.len());
    for &va in &after {
        assert_eq!(a.backend().peers_with_access(va), Some(vec![1]), "{va}");
    }
    // Its own device is not a peer, and the allocator is intact after the refusal.
    let err = a.enable_peer_access(0).unwrap_err();
    assert!(err.to_string().contains("not a peer"), "{err}");
    for p in [x, y, z] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
    // Fixed segments: the driver's peer access covers them; nothing to grant.
    let fixed = CachingAllocator::new(SimDevice::default(), AllocatorConfig::pytorch()).unwrap();
    let p = fixed.allocate(MIB, StreamId(0)).unwrap();
    fixed.enable_peer_access(1).unwrap();
    fixed.free(p.ptr).unwrap();
}

#[test]
fn peer_access_is_granted_per_allocator_and_again_after_a_failure() {
    // Two allocators sharing one backend: the second learns nothing from the backend knowing
    // the peer already, and grants its own pages.
    let dev = SimDevice::default();
    let a = CachingAllocator::new(&dev, AllocatorConfig::default()).unwrap();
    let b = CachingAllocator::new(&dev, AllocatorConfig::default()).unwrap();
    let xa = a.allocate(6 * MIB, StreamId(0)).unwrap();
    let xb = b.allocate(6 * MIB, StreamId(0)).unwrap();
    a.enable_peer_access(1).unwrap();
    b.enable_peer_access(1).unwrap();
    for va in mapped_pages(&a).into_iter().chain(mapped_pages(&b)) {
        assert_eq!(dev.peers_with_access(va), Some(vec![1]), "{va}");
    }
    a.free(xa.ptr).unwrap();
    b.free(xb.ptr).unwrap();

    // A grant that fails part-way: the call errs, and calling again grants every page.
    let c = CachingAllocator::new(SimDevice::default(), AllocatorConfig::default()).unwrap();
    let x = c.allocate(6 * MIB, StreamId(0)).unwrap();
    c.backend().fail_next_call(FaultKind::Error);
    assert!(c.enable_peer_access(2).is_err());
    c.enable_peer_access(2).unwrap();
    for va in mapped_pages(&c) {
        assert_eq!(c.backend().peers_with_access(va), Some(vec![2]), "{va}");
    }
    c.free(x.ptr).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn growth_reuses_free_pages_instead_of_creating_new_ones() {
    let a = with_config(1 << 30, AllocatorConfig::default());
    let x = a.allocate(40 * MIB, StreamId(0)).unwrap();
    let y = a.allocate(MIB + 512, StreamId(0)).unwrap();
    a.free(x.ptr).unwrap();
    let created = a.backend().counters().create_physical_calls;
    // 60 MiB does not fit the 40 MiB hole: the hole's 19 whole free pages move to the tail.
    let z = a.allocate(60 * MIB, StreamId(0)).unwrap();
    let c = a.backend().counters();
    assert!(c.unmap_calls >= 19, "{c:?}");
    assert!(
        c.create_physical_calls - created <= 12,
        "created {} new pages",
        c.create_physical_calls - created
    );
    let st = a.memory_stats();
    assert!(
        st.memory_reserved() as usize <= 64 * MIB,
        "{}",
        st.memory_reserved()
    );
    assert_eq!(st.memory_reserved() as usize, c.reserved_bytes);
    a.check_invariants().unwrap();
    // PyTorch keeps the hole mapped and creates every page of the growth (three 20 MiB pages).
    let p = with_config(1 << 30, pytorch_expandable());
    let px = p.allocate(40 * MIB, StreamId(0)).unwrap();
    let py = p.allocate(MIB + 512, StreamId(0)).unwrap();
    p.free(px.ptr).unwrap();
    let pz = p.allocate(60 * MIB, StreamId(0)).unwrap();
    assert_eq!(p.memory_stats().memory_reserved(), 120 * MIB as i64);
    for q in [y, z] {
        a.free(q.ptr).unwrap();
    }
    for q in [py, pz] {
        p.free(q.ptr).unwrap();
    }
}

#[test]
fn pages_move_between_pools_and_streams_with_their_reserved_bytes() {
    let a = with_config(1 << 30, AllocatorConfig::default());
    let big = a.allocate(32 * MIB, StreamId(1)).unwrap();
    a.free(big.ptr).unwrap();
    let before = a.memory_stats();
    assert_eq!(
        before.reserved_bytes.get(StatType::LargePool).current,
        32 * MIB as i64
    );
    // Small blocks on another stream: reserved memory is already above the peak allocated bytes
    // plus the 1% slack, so their pages come from the large pool's free block.
    let mut small = Vec::new();
    for _ in 0..16 {
        small.push(a.allocate(MIB, StreamId(2)).unwrap());
    }
    let st = a.memory_stats();
    let c = a.backend().counters();
    assert!(c.unmap_calls > 0, "{c:?}");
    assert_eq!(st.memory_reserved() as usize, c.reserved_bytes);
    assert!(
        st.memory_reserved() as usize <= 34 * MIB,
        "{}",
        st.memory_reserved()
    );
    assert_eq!(
        st.reserved_bytes.get(StatType::SmallPool).current
            + st.reserved_bytes.get(StatType::LargePool).current,
        st.memory_reserved()
    );
    assert!(st.reserved_bytes.get(StatType::SmallPool).current >= 16 * MIB as i64);
    assert_eq!(
        c.synchronize_calls, 0,
        "reuse fences the page's old stream with an event, never a synchronize"
    );
    assert!(c.event_records > 0, "{c:?}");
    for s in small {
        a.free(s.ptr).unwrap();
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().reserved_bytes, 0);
}

/// A 32 MiB block of stream 1 still used by queued work on stream 1 is freed; stream 2 grows
/// twice by 16 MiB. Returns the counters and reserved MiB after each growth, and the violations.
fn fenced_growths(conf: &str, lag: u32, fail_record: bool) -> [(SimCounters, usize); 2] {
    let a = with_config(1 << 30, AllocatorConfig::parse(conf).unwrap());
    let (s, t) = (StreamId(1), StreamId(2));
    let dev = a.backend();
    dev.set_event_query_lag(lag);
    let x = a.allocate(32 * MIB, s).unwrap();
    dev.use_range(s, x.ptr, 32 * MIB);
    a.free(x.ptr).unwrap();
    if fail_record {
        dev.fail_next_event_call(SimEventCall::Record);
    }
    let y = a.allocate(16 * MIB, t).unwrap();
    let first = (
        dev.counters(),
        a.memory_stats().memory_reserved() as usize / MIB,
    );
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    dev.complete_work(s);
    let z = a.allocate(16 * MIB, t).unwrap();
    let second = (
        dev.counters(),
        a.memory_stats().memory_reserved() as usize / MIB,
    );
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.check_invariants().unwrap();
    for p in [y, z] {
        a.free(p.ptr).unwrap();
    }
    [first, second]
}

const NO_LENDING: &str = "cca_preset:default,cca_page_lending:False";

#[test]
fn pending_pages_are_lent_with_an_event_wait_and_unmapped_once_idle() {
    // The default: the fence recorded on stream 1 has not completed, so the pages cannot be
    // unmapped; they are lent instead (Note [Lent pages]): mapped a second time for stream 2,
    // which waits on the fence's event. Nothing is created, nothing synchronized.
    let [(c1, r1), (c2, r2)] = fenced_growths("cca_preset:default", 0, false);
    assert_eq!(
        (
            c1.synchronize_calls,
            c1.stream_synchronize_calls,
            c1.unmap_calls
        ),
        (0, 0, 0),
        "{c1:?}"
    );
    assert_eq!((c1.event_records, c1.stream_waits), (1, 1), "{c1:?}");
    assert_eq!((c1.create_physical_calls, c1.map_calls), (16, 24), "{c1:?}");
    assert_eq!(r1, 32, "the 16 MiB came from the pending block");
    // Once the work completed, the next growth unmaps the old mappings (8 pages) and reuses the
    // other 8 idle pages of the block; still nothing created or synchronized.
    assert_eq!(
        (c2.synchronize_calls, c2.stream_synchronize_calls),
        (0, 0),
        "{c2:?}"
    );
    assert_eq!(c2.unmap_calls, 16, "{c2:?}");
    assert_eq!(c2.create_physical_calls, 16, "{c2:?}");
    assert_eq!(r2, 32);
}

#[test]
fn page_reuse_fences_with_events_and_never_synchronizes() {
    // Without lending: the fence recorded on stream 1 has not completed, so the pages stay
    // mapped (unmapping them under the queued work would fault it) and 16 MiB are created; once
    // the work completes the next growth reuses them. No synchronization anywhere.
    let [(c1, r1), (c2, r2)] = fenced_growths(NO_LENDING, 0, false);
    assert_eq!((c1.synchronize_calls, c1.unmap_calls), (0, 0), "{c1:?}");
    assert_eq!(c1.event_records, 1, "one fence on stream 1: {c1:?}");
    assert_eq!(r1, 48);
    assert_eq!(c2.synchronize_calls, 0, "{c2:?}");
    assert_eq!(c2.unmap_calls, 8, "eight 2 MiB pages reused: {c2:?}");
    assert_eq!(c2.create_physical_calls, c1.create_physical_calls);
    assert_eq!(c2.event_records, 1, "the pending fence served: {c2:?}");
    assert_eq!(r2, 48);
    // The PyTorch-like setting synchronizes stream 1 and reuses at once.
    let [(c1, r1), _] = fenced_growths("cca_preset:default,cca_page_reuse_fence:False", 0, false);
    assert_eq!(c1.stream_synchronize_calls, 1, "{c1:?}");
    assert_eq!((c1.unmap_calls, c1.event_records), (8, 0), "{c1:?}");
    assert_eq!(r1, 32);
}

#[test]
fn a_late_fence_delays_reuse_and_a_failed_one_costs_memory_only() {
    // The default lends the pending pages at the first growth; at the second the fence is seen
    // complete (third query) and the rest of the block is reused; the old mappings go at a
    // later growth or `empty_cache`.
    let [(c1, r1), (c2, r2)] = fenced_growths("cca_preset:default", 2, false);
    assert_eq!((c1.unmap_calls, c1.stream_waits, r1), (0, 1, 32), "{c1:?}");
    assert_eq!(
        (c2.synchronize_calls, c2.unmap_calls, c2.stream_waits, r2),
        (0, 8, 1, 32),
        "{c2:?}"
    );
    // Without lending, the device answers the first two queries of each event late: the second
    // growth still sees the fence pending and creates its pages too.
    let [(c1, r1), (c2, r2)] = fenced_growths(NO_LENDING, 2, false);
    assert_eq!((c1.unmap_calls, r1), (0, 48), "{c1:?}");
    assert_eq!(
        (c2.synchronize_calls, c2.unmap_calls, r2),
        (0, 0, 64),
        "{c2:?}"
    );
    // One late query only: the fence recorded at the first growth is seen complete at the next.
    let [_, (c2, r2)] = fenced_growths(NO_LENDING, 1, false);
    assert_eq!(
        (c2.synchronize_calls, c2.unmap_calls, r2),
        (0, 8, 48),
        "{c2:?}"
    );
    // The fence cannot be recorded: no reuse then, no synchronize; the next growth fences.
    // (With lending, the lending step records its own event, which succeeds.)
    let [(c1, r1), _] = fenced_growths("cca_preset:default", 0, true);
    assert_eq!(
        (c1.synchronize_calls, c1.stream_waits, r1),
        (0, 1, 32),
        "{c1:?}"
    );
    let [(c1, r1), (c2, r2)] = fenced_growths(NO_LENDING, 0, true);
    assert_eq!(
        (c1.synchronize_calls, c1.unmap_calls, r1),
        (0, 0, 48),
        "{c1:?}"
    );
    assert_eq!(
        (c2.synchronize_calls, c2.unmap_calls, r2),
        (0, 8, 48),
        "{c2:?}"
    );
}

#[test]
fn page_reuse_is_policy() {
    let run = |conf: &str| {
        let a = with_config(1 << 30, AllocatorConfig::parse(conf).unwrap());
        let x = a.allocate(40 * MIB, StreamId(0)).unwrap();
        let y = a.allocate(MIB + 512, StreamId(0)).unwrap();
        let other = a.allocate(20 * MIB, StreamId(3)).unwrap();
        a.free(other.ptr).unwrap();
        a.free(x.ptr).unwrap();
        let z = a.allocate(60 * MIB, StreamId(0)).unwrap();
        a.check_invariants().unwrap();
        let r = a.memory_stats().memory_reserved() as usize / MIB;
        for p in [y, z] {
            a.free(p.ptr).unwrap();
        }
        r
    };
    let base = "expandable_segments:True,cca_large_page_size_mb:2";
    assert_eq!(run(base), 2 + 40 + 20 + 60);
    let same_segment = run(&format!("{base},cca_page_reuse:segment"));
    let device = run(&format!("{base},cca_page_reuse:device"));
    assert!(same_segment < 2 + 40 + 20 + 60, "{same_segment}");
    assert!(device < same_segment, "{device} vs {same_segment}");
    assert!(device <= 64, "{device}");
}

#[test]
fn precise_cap_counts_only_new_pages() {
    // Cap 64 MiB: a 30 MiB request needs only 10 new pages after 40 MiB of free pages are
    // reused; PyTorch's check counts the whole 30 MiB on top of 42 MiB reserved and fails.
    let cap = |conf: &str| {
        let a = with_config(1 << 30, AllocatorConfig::parse(conf).unwrap());
        a.set_memory_fraction(64.0 / 1024.0).unwrap();
        let x = a.allocate(40 * MIB, StreamId(0)).unwrap();
        let _y = a.allocate(MIB + 512, StreamId(0)).unwrap();
        a.free(x.ptr).unwrap();
        let z = a.allocate(50 * MIB, StreamId(0));
        a.check_invariants().unwrap();
        let retries = a.memory_stats().num_alloc_retries;
        (z.is_ok(), retries)
    };
    let base = "expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device";
    assert_eq!(cap(&format!("{base},cca_precise_cap:True")), (true, 0));
    // Without the precise check the cache is flushed first (then the retry fits).
    assert_eq!(cap(base), (true, 1));
}

#[test]
fn max_handle_size_creates_fewer_larger_handles() {
    let conf = "expandable_segments:True,cca_large_page_size_mb:2,cca_max_handle_size_mb:16";
    let a = with_config(1 << 30, AllocatorConfig::parse(conf).unwrap());
    let x = a.allocate(100 * MIB, StreamId(0)).unwrap();
    let c = a.backend().counters();
    // 50 pages: six handles of 8 pages, then the last two pages one by one (the last page
    // always gets a handle of its own).
    assert_eq!(c.create_physical_calls, 8, "{c:?}");
    assert_eq!(c.create_physical_calls, c.map_calls);
    a.free(x.ptr).unwrap();
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.backend().counters().reserved_bytes, 0);
    a.check_invariants().unwrap();
}

#[test]
fn history_records_maps_and_unmaps() {
    let a = with_config(1 << 30, pytorch_expandable());
    a.record_history(100);
    let x = a.allocate(3 * MIB, StreamId(0)).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    let (t, _) = a.history();
    let maps = t
        .events
        .iter()
        .filter(|e| matches!(e.op, trace::TraceOp::SegmentMap { .. }))
        .count();
    let unmaps = t
        .events
        .iter()
        .filter(|e| matches!(e.op, trace::TraceOp::SegmentUnmap { .. }))
        .count();
    assert_eq!((maps, unmaps), (1, 1));
}

// ---- fault injection -----------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc(usize, u64),
    Free(usize),
    Empty,
}

fn program() -> Vec<Step> {
    use Step::*;
    vec![
        Alloc(300, 0),
        Alloc(3 * MIB, 0),
        Alloc(12 * MIB, 1),
        Alloc(600 * 1024, 1),
        Free(1),
        Alloc(25 * MIB, 0),
        Free(0),
        Alloc(2 * MIB, 1),
        Free(2),
        Alloc(40 * MIB, 0),
        Free(3),
        Alloc(5000, 2),
        Empty,
        Free(5),
        Alloc(30 * MIB, 1),
        Alloc(MIB, 0),
        Free(9),
        Alloc(33 * MIB, 0),
    ]
}

fn run_program(config: &AllocatorConfig, fail: Option<(u64, FaultKind)>) -> u64 {
    let sim = SimDevice::with_capacity(1 << 30);
    if let Some((n, k)) = fail {
        sim.fail_call(n, k);
    }
    let a = CachingAllocator::new(sim, config.clone()).unwrap();
    let mut slots: Vec<Option<Allocation>> = Vec::new();
    for step in program() {
        match step {
            Step::Alloc(size, s) => match a.allocate(size, StreamId(s)) {
                Ok(x) => slots.push(Some(x)),
                Err(e) => {
                    assert!(
                        e.is_out_of_memory() || matches!(e, AllocError::Backend { .. }),
                        "{e}"
                    );
                    slots.push(None);
                }
            },
            Step::Free(i) => {
                if let Some(x) = slots.get_mut(i).and_then(Option::take) {
                    a.free(x.ptr).unwrap();
                }
            }
            Step::Empty => {
                let _ = a.empty_cache();
            }
        }
        a.check_invariants()
            .unwrap_or_else(|v| panic!("after {step:?} with fault {fail:?}: {v}"));
        let live: Vec<&Allocation> = slots.iter().flatten().collect();
        let st = a.memory_stats();
        assert_eq!(
            st.allocation.get(StatType::All).current as usize,
            live.len()
        );
        // Nothing lost: every physical page the device holds is counted as reserved.
        assert_eq!(
            st.memory_reserved() as usize,
            a.backend().counters().reserved_bytes,
            "after {step:?} with fault {fail:?}"
        );
    }
    for x in slots.into_iter().flatten() {
        a.free(x.ptr).unwrap();
    }
    a.backend().clear_faults();
    a.empty_cache().unwrap();
    let c = a.backend().counters();
    assert_eq!(a.memory_stats().memory_reserved(), 0, "fault {fail:?}");
    assert_eq!(c.reserved_bytes, 0, "fault {fail:?}");
    assert_eq!(c.release_range_calls, c.reserve_calls, "fault {fail:?}");
    assert!(a.backend().live_mappings().is_empty());
    a.check_invariants().unwrap();
    c.device_calls
}

#[test]
fn every_virtual_memory_call_can_fail() {
    let configs = [
        pytorch_expandable(),
        AllocatorConfig::default(),
        AllocatorConfig::parse(
            "expandable_segments:True,cca_large_page_size_mb:2,cca_max_handle_size_mb:8,cca_page_reuse:segment",
        )
        .unwrap(),
    ];
    for config in &configs {
        let calls = run_program(config, None);
        assert!(calls >= 10, "the program makes {calls} device calls");
        for n in 1..=calls + 2 {
            for kind in [FaultKind::Error, FaultKind::OutOfMemory] {
                run_program(config, Some((n, kind)));
            }
        }
    }
}

// ---- random programs -----------------------------------------------------------------------

fn config_strategy() -> impl Strategy<Value = AllocatorConfig> {
    prop_oneof![
        Just("expandable_segments:True".to_string()),
        Just("expandable_segments:True,max_split_size_mb:24".to_string()),
        Just("expandable_segments:True,cca_page_reuse:segment".to_string()),
        Just("expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device,cca_page_reuse_slack:0.01,cca_precise_cap:True".to_string()),
        Just("expandable_segments:True,cca_large_page_size_mb:4,cca_max_handle_size_mb:12,cca_page_reuse:device".to_string()),
        Just("expandable_segments:True,garbage_collection_threshold:0.5,cca_page_reuse:device".to_string()),
    ]
    .prop_map(|s| AllocatorConfig::parse(&s).unwrap())
}

/// The common checks (every live byte mapped) plus expandable segments' own: no fixed segment,
/// and the fragmentation report's bytes add up.
fn check_model(run: &Run) -> Result<(), TestCaseError> {
    run.check()?;
    let a = &run.a;
    let st = a.memory_stats();
    prop_assert_eq!(st.segment.get(StatType::All).current, 0);
    let frag = a.fragmentation();
    prop_assert_eq!(
        frag.reserved_bytes,
        frag.allocated_bytes + frag.pending_free_bytes + frag.free_bytes + frag.spare_bytes
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_programs_keep_expandable_segments_consistent(
        config in config_strategy(),
        capacity_mib in 64usize..400,
        ops in random_program(Mix { min_size: 1, all_streams: false, event_faults: false, uses: false }),
    ) {
        let mut run = Run::new(capacity_mib, config);
        for op in &ops {
            run.step(op)?;
            check_model(&run)?;
        }
        run.drain()?;
        check_model(&run)?;
    }
}
