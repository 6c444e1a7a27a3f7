//! Segment events (`CachingAllocator::set_segment_observer`) on the simulated device: each
//! event is told while the device agrees (a segment is still live when its `Free` arrives, a
//! mapping is in place at its `Map` and gone at its `Unmap`), every allocation handed out lies
//! inside memory the observer was told about, nothing is left once the cache is emptied, and
//! private pools' events carry the pool's id. PyTorch's trace trackers (NCCL's user-buffer
//! registration among them) rely on exactly this. Also `base_allocation`, the segment a live
//! allocation belongs to, against the snapshot.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use cuda_caching_allocator::*;

use crate::util::MIB;

type Alloc = CachingAllocator<SimDevice>;

/// What the observer has been told: live ranges by address, and every event in order.
#[derive(Default)]
struct Seen {
    ranges: BTreeMap<u64, usize>,
    events: Vec<SegmentEvent>,
    errors: Vec<String>,
}

fn overlaps(ranges: &BTreeMap<u64, usize>, addr: u64, size: usize) -> bool {
    ranges
        .range(..addr + size as u64)
        .next_back()
        .is_some_and(|(&a, &s)| a + s as u64 > addr)
}

/// An allocator over a simulated device with an observer that checks each event against the
/// device at the moment it is told.
fn observed(config: AllocatorConfig) -> (Arc<Alloc>, Arc<Mutex<Seen>>) {
    let sim = SimDevice::new(SimConfig {
        capacity: 8 << 30,
        ..SimConfig::default()
    });
    let a = Arc::new(CachingAllocator::new(sim, config).unwrap());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let weak: Weak<Alloc> = Arc::downgrade(&a);
    let s = Arc::clone(&seen);
    a.set_segment_observer(Some(Arc::new(move |e: &SegmentEvent| {
        let mut s = s.lock().unwrap();
        let (addr, size) = (e.addr.0, e.size);
        // While the allocator is dropped its Weak no longer upgrades: no device check then.
        if let Some(a) = weak.upgrade() {
            let dev = a.backend();
            let in_segments = dev
                .live_segments()
                .iter()
                .any(|&(p, n)| p.0 == addr && n == size);
            let mapped = dev
                .live_mappings()
                .iter()
                .filter(|&&(p, n)| p.0 >= addr && p.0 + n as u64 <= addr + size as u64)
                .map(|&(_, n)| n)
                .sum::<usize>();
            let ok = match e.action {
                SegmentAction::Alloc | SegmentAction::Free => in_segments,
                SegmentAction::Map => mapped == size,
                SegmentAction::Unmap => mapped == 0,
                // Told of a block, not of device memory: checked by the test that makes them.
                SegmentAction::FreeCompleted => true,
                _ => false,
            };
            if !ok {
                s.errors.push(format!("{e:?}: the device disagrees"));
            }
        }
        match e.action {
            SegmentAction::Alloc | SegmentAction::Map => {
                if overlaps(&s.ranges, addr, size) {
                    s.errors
                        .push(format!("{e:?}: overlaps a range told earlier"));
                }
                s.ranges.insert(addr, size);
            }
            SegmentAction::Free => {
                if s.ranges.remove(&addr) != Some(size) {
                    s.errors.push(format!("{e:?}: no such segment was told"));
                }
            }
            SegmentAction::FreeCompleted => {}
            _ => {
                // An unmap may cover parts of earlier maps: cut [addr, addr + size) out.
                let end = addr + size as u64;
                let hit: Vec<(u64, usize)> = s
                    .ranges
                    .range(..end)
                    .filter(|&(&a, &n)| a + n as u64 > addr)
                    .map(|(&a, &n)| (a, n))
                    .collect();
                let covered: usize = hit
                    .iter()
                    .map(|&(a, n)| ((a + n as u64).min(end) - a.max(addr)) as usize)
                    .sum();
                if covered != size {
                    s.errors
                        .push(format!("{e:?}: unmaps {covered} bytes told mapped"));
                }
                for (a, n) in hit {
                    s.ranges.remove(&a);
                    if a < addr {
                        s.ranges.insert(a, (addr - a) as usize);
                    }
                    if a + n as u64 > end {
                        s.ranges.insert(end, (a + n as u64 - end) as usize);
                    }
                }
            }
        }
        s.events.push(*e);
    })));
    (a, seen)
}

fn covered(s: &Seen, ptr: u64, size: usize) -> bool {
    // Told ranges may abut (pages mapped one growth at a time): walk them.
    let mut at = ptr;
    let end = ptr + size.max(1) as u64;
    while at < end {
        match s.ranges.range(..=at).next_back() {
            Some((&a, &n)) if a + n as u64 > at => at = a + n as u64,
            _ => return false,
        }
    }
    true
}

#[test]
fn every_handed_out_block_lies_in_told_memory_and_nothing_is_left_after_empty_cache() {
    for (name, config) in crate::util::four_configs() {
        let (a, seen) = observed(config);
        let mut live: Vec<(DeviceAddr, usize)> = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let stream = StreamId(x % 3);
            if live.len() < 40 && (x >> 8) % 3 != 0 {
                let size = match (x >> 16) % 4 {
                    0 => ((x >> 20) % 4096 + 1) as usize,
                    1 => ((x >> 20) % (900 << 10) + 1) as usize,
                    2 => ((x >> 20) % (30 * MIB as u64) + 1) as usize,
                    _ => ((x >> 20) % (130 * MIB as u64) + 1) as usize,
                };
                let al = a.allocate(size, stream).unwrap();
                let s = seen.lock().unwrap();
                assert!(
                    covered(&s, al.ptr.0, size),
                    "{name} step {step}: block {} + {size} lies outside the told memory",
                    al.ptr
                );
                live.push((al.ptr, size));
            } else if !live.is_empty() {
                let i = (x >> 24) as usize % live.len();
                let (p, _) = live.swap_remove(i);
                // Work still queued on the stream keeps the block's fence pending: page reuse
                // then lends pages instead of moving them (Note [Lent pages]).
                a.backend().submit_work(stream);
                a.free(p).unwrap();
            }
            if step % 5 == 4 {
                a.backend().complete_work(StreamId((x >> 32) % 3));
            }
            if step % 700 == 699 {
                a.empty_cache().unwrap();
            }
        }
        for (p, _) in live.drain(..) {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        if name.starts_with("default") {
            assert!(a.page_loans() > 0, "{name}: the workload lent no pages");
        }
        let s = seen.lock().unwrap();
        assert!(
            s.errors.is_empty(),
            "{name}: {:?}",
            &s.errors[..s.errors.len().min(5)]
        );
        assert!(!s.events.is_empty(), "{name}: no events");
        assert!(
            s.ranges.is_empty(),
            "{name}: {} ranges still told live after empty_cache: {:?}",
            s.ranges.len(),
            s.ranges.iter().take(3).collect::<Vec<_>>()
        );
        assert!(a.backend().live_segments().is_empty() && a.backend().live_mappings().is_empty());
    }
}

#[test]
fn pytorch_preset_tells_whole_segments_and_the_default_tells_pages() {
    let (a, seen) = observed(AllocatorConfig::pytorch());
    let al = a.allocate(1 << 20, StreamId(0)).unwrap();
    a.free(al.ptr).unwrap();
    a.empty_cache().unwrap();
    let actions: Vec<SegmentAction> = seen
        .lock()
        .unwrap()
        .events
        .iter()
        .map(|e| e.action)
        .collect();
    assert_eq!(actions, [SegmentAction::Alloc, SegmentAction::Free]);
    let e = seen.lock().unwrap().events[0];
    assert_eq!(
        (e.size, e.stream, e.pool, e.device),
        (2 << 20, StreamId(0), MemPoolId::DEFAULT, 0)
    );
    assert_eq!(SegmentAction::Alloc.pytorch_name(), "segment_alloc");

    let (a, seen) = observed(AllocatorConfig::default());
    let al = a.allocate(5 << 20, StreamId(1)).unwrap();
    a.free(al.ptr).unwrap();
    a.empty_cache().unwrap();
    let s = seen.lock().unwrap();
    let kinds: Vec<SegmentAction> = s.events.iter().map(|e| e.action).collect();
    assert!(kinds.contains(&SegmentAction::Map) && kinds.contains(&SegmentAction::Unmap));
    assert!(!kinds.contains(&SegmentAction::Alloc), "{kinds:?}");
    assert!(s.events.iter().all(|e| e.stream == StreamId(1)));
}

#[test]
fn private_pool_segments_carry_the_pool_id_and_removing_the_observer_stops_events() {
    for (name, config) in crate::util::four_configs() {
        let (a, seen) = observed(config);
        let pool = MemPoolId::new_user();
        a.create_pool(pool).unwrap();
        a.begin_allocate_to_pool(pool, Box::new(|s| s == StreamId(2)))
            .unwrap();
        let inside = a.allocate(3 << 20, StreamId(2)).unwrap();
        let outside = a.allocate(3 << 20, StreamId(0)).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        {
            let s = seen.lock().unwrap();
            let pools: Vec<MemPoolId> = s.events.iter().map(|e| e.pool).collect();
            assert!(pools.contains(&pool), "{name}: {pools:?}");
            assert!(pools.contains(&MemPoolId::DEFAULT), "{name}: {pools:?}");
            for e in &s.events {
                let want = if e.stream == StreamId(2) {
                    pool
                } else {
                    MemPoolId::DEFAULT
                };
                assert_eq!(e.pool, want, "{name}: {e:?}");
            }
        }
        a.free(inside.ptr).unwrap();
        a.free(outside.ptr).unwrap();
        a.set_segment_observer(None);
        let before = seen.lock().unwrap().events.len();
        a.release_pool(pool).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(seen.lock().unwrap().events.len(), before, "{name}");
        assert!(seen.lock().unwrap().errors.is_empty(), "{name}");
    }
}

/// The `FreeCompleted` events so far, as (address, size, stream).
fn completed(seen: &Mutex<Seen>) -> Vec<(u64, usize, StreamId)> {
    let s = seen.lock().unwrap();
    s.events
        .iter()
        .filter(|e| e.action == SegmentAction::FreeCompleted)
        .map(|e| (e.addr.0, e.size, e.stream))
        .collect()
}

/// PyTorch's `free_completed` for blocks whose free waited on recorded streams: a free that puts
/// its block back at once answers `Cached` and is told nothing; one whose block waits for
/// another stream's work answers `AwaitingStreams`, and the observer is told once (the
/// allocation's address, requested size and stream) when the allocator finds that work done,
/// at an allocation that reaches the core or at `empty_cache`, and also for a free deferred
/// while a pool routing is underway.
#[test]
fn an_awaited_free_is_told_once_its_streams_work_is_done() {
    let (s0, s1) = (StreamId(0), StreamId(1));
    for (name, config) in crate::util::four_configs() {
        let (a, seen) = observed(config);
        let x = a.allocate(3 * MIB + 5, s0).unwrap();
        a.record_stream(x.ptr, s1).unwrap();
        a.backend().submit_work(s1);
        assert_eq!(
            a.free_with_outcome(x.ptr).unwrap(),
            FreeOutcome::AwaitingStreams,
            "{name}"
        );
        // Sizes not seen before, so that each allocation reaches the core and looks at events.
        let y = a.allocate(5 * MIB + 17, s0).unwrap();
        assert!(
            completed(&seen).is_empty(),
            "{name}: told before the work completed"
        );
        a.backend().complete_work(s1);
        let z = a.allocate(7 * MIB + 123, s0).unwrap();
        assert_eq!(completed(&seen), [(x.ptr.0, 3 * MIB + 5, s0)], "{name}");
        // A plain free, and a use recorded on the allocation's own stream: back at once.
        assert_eq!(
            a.free_with_outcome(y.ptr).unwrap(),
            FreeOutcome::Cached,
            "{name}"
        );
        a.record_stream(z.ptr, s0).unwrap();
        assert_eq!(
            a.free_with_outcome(z.ptr).unwrap(),
            FreeOutcome::Cached,
            "{name}"
        );
        // Waiting, then told by empty_cache's synchronization.
        let w = a.allocate(MIB + 1, s0).unwrap();
        a.record_stream(w.ptr, s1).unwrap();
        a.backend().submit_work(s1);
        assert_eq!(
            a.free_with_outcome(w.ptr).unwrap(),
            FreeOutcome::AwaitingStreams,
            "{name}"
        );
        a.empty_cache().unwrap();
        assert_eq!(completed(&seen).len(), 2, "{name}");
        assert_eq!(completed(&seen)[1], (w.ptr.0, MIB + 1, s0), "{name}");
        // Deferred while a routing is underway (no event may be recorded then), told after.
        let pool = MemPoolId::new_user();
        a.create_pool(pool).unwrap();
        let v = a.allocate(2 * MIB + 3, s0).unwrap();
        a.record_stream(v.ptr, s1).unwrap();
        a.begin_allocate_to_pool(pool, Box::new(|s| s == StreamId(2)))
            .unwrap();
        assert_eq!(
            a.free_with_outcome(v.ptr).unwrap(),
            FreeOutcome::AwaitingStreams,
            "{name}"
        );
        a.end_allocate_to_pool(pool).unwrap();
        a.backend().complete_work(s1);
        let u = a.allocate(11 * MIB + 1, s0).unwrap();
        a.free(u.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(completed(&seen).len(), 3, "{name}: {:?}", completed(&seen));
        assert_eq!(completed(&seen)[2], (v.ptr.0, 2 * MIB + 3, s0), "{name}");
        a.release_pool(pool).unwrap();
        a.check_invariants().unwrap();
        assert!(seen.lock().unwrap().errors.is_empty(), "{name}");
    }
}

#[test]
fn a_refused_free_is_followed_by_an_alloc_of_the_same_segment() {
    let (a, seen) = observed(AllocatorConfig::pytorch());
    let al = a.allocate(1 << 20, StreamId(0)).unwrap();
    a.free(al.ptr).unwrap();
    a.backend().fail_next_call(FaultKind::Error);
    assert!(a.empty_cache().is_err());
    assert_eq!(
        a.backend().live_segments().len(),
        1,
        "the refused segment stays"
    );
    a.empty_cache().unwrap();
    let s = seen.lock().unwrap();
    let actions: Vec<SegmentAction> = s.events.iter().map(|e| e.action).collect();
    use SegmentAction::{Alloc, Free};
    assert_eq!(actions, [Alloc, Free, Alloc, Free]);
    assert!(s.errors.is_empty(), "{:?}", s.errors);
    assert!(s.ranges.is_empty());
}

#[test]
fn a_panicking_observer_is_removed_and_the_cache_goes_on() {
    for (name, config) in crate::util::four_configs() {
        let a = crate::util::with_config(1 << 30, config);
        let calls = Arc::new(Mutex::new(0u32));
        let c = Arc::clone(&calls);
        a.set_segment_observer(Some(Arc::new(move |_: &SegmentEvent| {
            *c.lock().unwrap() += 1;
            panic!("observer fails");
        })));
        let x = a.allocate(5 << 20, StreamId(0)).unwrap();
        let y = a.allocate(300 << 10, StreamId(1)).unwrap();
        a.free(x.ptr).unwrap();
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            *calls.lock().unwrap(),
            1,
            "{name}: told again after it panicked"
        );
        a.check_invariants().unwrap();
        assert_eq!(a.memory_stats().memory_reserved(), 0, "{name}");
    }
}

#[test]
fn the_snapshot_names_the_private_pool_of_an_empty_segment() {
    for (name, config) in crate::util::four_configs() {
        let a = crate::util::with_config(1 << 30, config);
        let pool = MemPoolId::new_user();
        a.create_pool(pool).unwrap();
        a.begin_allocate_to_pool(pool, Box::new(|s| s == StreamId(2)))
            .unwrap();
        let x = a.allocate(3 << 20, StreamId(2)).unwrap();
        let y = a.allocate(3 << 20, StreamId(0)).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        a.free(x.ptr).unwrap();
        let snap = a.snapshot();
        let holding = |p: DeviceAddr| {
            snap.iter()
                .find(|s| p.0 >= s.address.0 && p.0 < s.address.0 + s.total_size as u64)
                .unwrap()
        };
        assert_eq!(
            holding(x.ptr).private_pool,
            pool,
            "{name}: the emptied pool segment"
        );
        assert_eq!(holding(x.ptr).allocated_size(), 0, "{name}");
        assert_eq!(holding(y.ptr).private_pool, MemPoolId::DEFAULT, "{name}");
        a.free(y.ptr).unwrap();
    }
}

#[test]
fn base_allocation_names_the_segment_the_snapshot_lists_for_every_live_allocation() {
    for (name, config) in crate::util::four_configs() {
        let a = crate::util::with_config(4 << 30, config);
        let mut live: Vec<DeviceAddr> = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for step in 0..1500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if live.len() < 30 && (x >> 8) % 3 != 0 {
                let size = match (x >> 16) % 3 {
                    0 => ((x >> 20) % 8192 + 1) as usize,
                    1 => ((x >> 20) % (3 * MIB as u64) + 1) as usize,
                    _ => ((x >> 20) % (70 * MIB as u64) + 1) as usize,
                };
                live.push(a.allocate(size, StreamId(x % 2)).unwrap().ptr);
            } else if !live.is_empty() {
                let p = live.swap_remove((x >> 24) as usize % live.len());
                a.free(p).unwrap();
            }
            if step % 97 == 0 {
                let snap = a.snapshot();
                for &p in &live {
                    let seg = snap
                        .iter()
                        .find(|s| p.0 >= s.address.0 && p.0 < s.address.0 + s.total_size as u64)
                        .unwrap();
                    assert_eq!(
                        a.base_allocation(p),
                        Some((seg.address, seg.total_size)),
                        "{name} step {step}: {p}"
                    );
                }
            }
        }
        assert_eq!(a.base_allocation(DeviceAddr(12345)), None, "{name}");
        if let Some(&p) = live.first() {
            assert_eq!(
                a.base_allocation(DeviceAddr(p.0 + 1)),
                None,
                "{name}: inside a block"
            );
        }
    }
}
