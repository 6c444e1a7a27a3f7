//! `CachingAllocator::shareable_pages` on the simulated device: the physical handles it names for
//! a live allocation are exactly the ones the device has mapped under it, side by side, through
//! page reuse moving pages between segments; fixed segments answer `None`; pointers that are not
//! live allocations are refused with `NotShareable` and leave the cache intact. (The CUDA side,
//! exporting the handles as descriptors and mapping them in another process, is
//! `tests/all/cuda.rs` and `gpu/probes/cuda_ipc.py`.)

use std::collections::{BTreeMap, HashMap};

use cuda_caching_allocator::*;

use crate::util::{MIB, with_config};

/// Checks `shareable_pages` of the live allocation `(ptr, size)` against the device's mappings.
fn check_pages(a: &CachingAllocator<SimDevice>, ptr: DeviceAddr, size: usize) {
    let pages = a
        .shareable_pages(ptr)
        .unwrap()
        .expect("an allocation of an expandable segment has pages");
    let mapped: BTreeMap<u64, (usize, PhysicalHandle)> = a
        .backend()
        .live_mapped_handles()
        .into_iter()
        .map(|(va, n, h)| (va.0, (n, h)))
        .collect();
    let hb = pages.handle_bytes;
    assert!(hb > 0 && !pages.handles.is_empty(), "{pages:?}");
    assert_eq!(pages.start.0 + pages.offset as u64, ptr.0, "{pages:?}");
    assert!(
        pages.offset < hb,
        "the first handle holds the start: {pages:?}"
    );
    assert!(
        pages.offset + size.max(1) <= hb * pages.handles.len(),
        "the handles cover {size} bytes: {pages:?}"
    );
    assert!(
        pages.offset + size.max(1) > hb * (pages.handles.len() - 1),
        "no handle beyond the allocation's end: {pages:?}"
    );
    for (i, h) in pages.handles.iter().enumerate() {
        let va = pages.start.0 + (i * hb) as u64;
        assert_eq!(
            mapped.get(&va),
            Some(&(hb, *h)),
            "handle {i} of {ptr} ({size} bytes) is the one mapped at {}",
            DeviceAddr(va)
        );
    }
}

/// A deterministic churn of allocations and frees on two streams that makes the default move
/// pages between segments; checks every live allocation every few steps. With `busy`, each
/// allocation's stream gets queued work that completes only every few steps, so page fences stay
/// pending and growths lend pages (Note [Lent pages]).
fn churn(a: &CachingAllocator<SimDevice>, steps: usize, check: impl FnMut(DeviceAddr, usize)) {
    churn_with(a, steps, false, check)
}

fn churn_with(
    a: &CachingAllocator<SimDevice>,
    steps: usize,
    busy: bool,
    mut check: impl FnMut(DeviceAddr, usize),
) {
    let streams = [StreamId::DEFAULT, StreamId(7)];
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for step in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = match x % 6 {
            0 => 512 + (x >> 8) as usize % 4096,
            1 => MIB + (x >> 8) as usize % MIB,
            2 => 3 * MIB + (x >> 8) as usize % (5 * MIB),
            3 => 20 * MIB + (x >> 8) as usize % (30 * MIB),
            4 => 2 * MIB,
            _ => 700 * 1024,
        };
        if live.len() > 24 || (x >> 40) % 3 == 0 && !order.is_empty() {
            let i = (x >> 20) as usize % order.len();
            let p = order.swap_remove(i);
            live.remove(&p);
            a.free(DeviceAddr(p)).unwrap();
        } else {
            let s = streams[(x >> 33) as usize % 2];
            let got = a.allocate(size, s).unwrap();
            live.insert(got.ptr.0, size);
            order.push(got.ptr.0);
            if busy {
                a.backend().submit_work(s);
            }
        }
        if busy && step % 7 == 0 {
            a.backend().complete_work(streams[step / 7 % 2]);
        }
        if step % 16 == 0 {
            for (&p, &n) in &live {
                check(DeviceAddr(p), n);
            }
        }
    }
    for p in order {
        a.free(DeviceAddr(p)).unwrap();
    }
}

#[test]
fn the_pages_named_are_the_handles_mapped_under_the_allocation() {
    let a = with_config(16 << 30, AllocatorConfig::default());
    for size in [1, 512, MIB, 2 * MIB, 3 * MIB + 5, 20 * MIB, 64 * MIB + 4096] {
        let got = a.allocate(size, StreamId::DEFAULT).unwrap();
        check_pages(&a, got.ptr, size);
    }
    let unmaps_before = a.backend().counters().unmap_calls;
    churn(&a, 3000, |p, n| check_pages(&a, p, n));
    assert!(
        a.backend().counters().unmap_calls > unmaps_before,
        "the churn moved pages (page reuse unmapped some)"
    );
    a.check_invariants().unwrap();
}

#[test]
fn the_pages_named_are_right_while_pages_are_lent() {
    let a = with_config(16 << 30, AllocatorConfig::default());
    churn_with(&a, 3000, true, |p, n| check_pages(&a, p, n));
    assert!(a.page_loans() > 0, "the churn lent pages");
    a.check_invariants().unwrap();
}

#[test]
fn fixed_segments_have_no_pages_to_share() {
    let a = with_config(4 << 30, AllocatorConfig::pytorch());
    for size in [512, 3 * MIB, 64 * MIB] {
        let got = a.allocate(size, StreamId::DEFAULT).unwrap();
        assert_eq!(a.shareable_pages(got.ptr).unwrap(), None);
    }
}

#[test]
fn pointers_that_are_not_live_allocations_are_refused_and_nothing_changes() {
    let without_fast_path = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .fast_path(false)
        .build()
        .unwrap();
    // The default has the fast path on: a block freed into the thread's cache is still allocated
    // in the core's books, and must be refused all the same.
    for config in [AllocatorConfig::default(), without_fast_path] {
        refused_with(config);
    }
}

fn refused_with(config: AllocatorConfig) {
    let a = with_config(4 << 30, config);
    // Sizes seen before are kept by the fast path's cache when freed.
    for _ in 0..8 {
        let p = a.allocate(3 * MIB, StreamId::DEFAULT).unwrap().ptr;
        a.free(p).unwrap();
    }
    let keep = a.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
    let gone = a.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    a.free(gone.ptr).unwrap();
    let before = a.snapshot();
    for (what, p) in [
        ("freed", gone.ptr),
        ("interior", DeviceAddr(keep.ptr.0 + 4096)),
        ("foreign", DeviceAddr(0x7000_0000_0000)),
        ("null", DeviceAddr(0)),
    ] {
        let err = a.shareable_pages(p).unwrap_err();
        assert!(
            matches!(err, AllocError::NotShareable { ptr, .. } if ptr == p),
            "{what}: {err}"
        );
        assert!(
            err.to_string().contains("not a live allocation"),
            "{what}: {err}"
        );
    }
    assert_eq!(a.snapshot(), before);
    assert_eq!(
        a.base_allocation(gone.ptr),
        None,
        "freed: no base allocation either"
    );
    a.check_invariants().unwrap();
    check_pages(&a, keep.ptr, 5 * MIB);
}

#[test]
fn handles_of_mixed_sizes_are_refused_with_the_reason() {
    // Larger handles, one per growth: an allocation may lie across handles of two sizes, which
    // an importer cannot map side by side.
    let config = AllocatorConfig::parse(
        "cca_preset:default,cca_max_handle_size_mb:64,cca_handle_per_growth:True",
    )
    .unwrap();
    let a = with_config(16 << 30, config);
    let (mut shared, mut mixed) = (0, 0);
    churn(&a, 3000, |p, n| match a.shareable_pages(p) {
        Ok(Some(_)) => {
            check_pages(&a, p, n);
            shared += 1;
        }
        Ok(None) => panic!("{p}: expandable segments have pages"),
        Err(e) => {
            assert!(e.to_string().contains("different sizes"), "{e}");
            mixed += 1;
        }
    });
    assert!(shared > 0 && mixed > 0, "{shared} shared, {mixed} refused");
    a.check_invariants().unwrap();
}

#[test]
fn an_export_is_let_go_when_the_last_exported_allocation_on_its_page_is_freed() {
    let config = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .fast_path(false)
        .build()
        .unwrap();
    let a = with_config(4 << 30, config);
    let export = |p: DeviceAddr| {
        a.export_pages_with(p, |pages, _| Ok(pages.handles.clone()))
            .unwrap()
            .unwrap()
    };
    // Two small allocations on one page, a large one on pages of its own.
    let x = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
    let y = a.allocate(8192, StreamId::DEFAULT).unwrap().ptr;
    let big = a.allocate(5 * MIB, StreamId::DEFAULT).unwrap().ptr;
    let (hx, hy, hbig) = (export(x), export(y), export(big));
    assert_eq!(hx, hy, "one page holds both small allocations");
    assert_eq!(export(x), hx, "exporting again counts once");
    assert!(a.backend().released_exports().is_empty());
    a.free(x).unwrap();
    assert!(
        a.backend().released_exports().is_empty(),
        "y still lies on the page"
    );
    a.free(big).unwrap();
    assert_eq!(
        a.backend().released_exports(),
        hbig,
        "big's pages are let go"
    );
    a.free(y).unwrap();
    let mut want = hbig.clone();
    want.extend(hy);
    assert_eq!(a.backend().released_exports(), want, "then the small page");
    // Allocations never exported let nothing go.
    let z = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
    a.free(z).unwrap();
    assert_eq!(a.backend().released_exports(), want);
    a.check_invariants().unwrap();
}

/// An export that fails part-way (CUDA: the process ran out of descriptors after exporting a
/// few of the pages) has opened descriptors the allocation never counts: the cache lets go of
/// the exports of its pages at once, except those a live exported allocation holds. Before,
/// they stayed open until the page was released (with the default's page reuse, possibly never),
/// leaving the process at its descriptor limit after a failed share.
#[test]
fn a_failed_export_lets_go_of_the_pages_no_exported_allocation_holds() {
    let config = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .fast_path(false)
        .build()
        .unwrap();
    let a = with_config(4 << 30, config);
    let fail = |p: DeviceAddr| {
        let err = a
            .export_pages_with(p, |_, _| -> Result<()> {
                Err(AllocError::Unsupported {
                    operation: "test export",
                    capability: "nothing",
                })
            })
            .unwrap_err();
        assert!(err.to_string().contains("test export"), "{err}");
    };
    let x = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
    let y = a.allocate(8192, StreamId::DEFAULT).unwrap().ptr;
    let big = a.allocate(5 * MIB, StreamId::DEFAULT).unwrap().ptr;
    let hx = a
        .export_pages_with(x, |pages, _| Ok(pages.handles.clone()))
        .unwrap()
        .unwrap();
    let hbig = a.shareable_pages(big).unwrap().unwrap().handles;
    fail(big);
    assert_eq!(
        a.backend().released_exports(),
        hbig,
        "a failed export lets go of the pages it may have exported"
    );
    fail(y);
    assert_eq!(
        a.backend().released_exports(),
        hbig,
        "y's page stays exported: x's export holds it"
    );
    a.free(big).unwrap();
    a.free(y).unwrap();
    assert_eq!(
        a.backend().released_exports(),
        hbig,
        "the failed exports counted nothing"
    );
    a.free(x).unwrap();
    let mut want = hbig;
    want.extend(hx);
    assert_eq!(a.backend().released_exports(), want, "x's page goes with x");
    a.check_invariants().unwrap();
}
