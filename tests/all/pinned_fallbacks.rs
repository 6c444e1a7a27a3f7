//! The pinned host cache refuses no request it can serve: the fit rule gives way to a free
//! range when no slab can be pinned, and out of memory falls back to a slab of the request's
//! size, as the cap does (adversarial review; each test failed on the code before). `SimHost`.

use std::sync::Arc;

use cuda_caching_allocator::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// A cache over a `SimHost` that can pin at most `capacity` bytes.
fn cache_on_host_of(
    config: PinnedConfig,
    capacity: usize,
) -> (Arc<SimDevice>, PinnedCache<SimHost>) {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(
        dev.clone(),
        SimHostConfig {
            capacity,
            ..SimHostConfig::default()
        },
    );
    (dev, PinnedCache::new(host, config).unwrap())
}

/// `frugal()` ("for hosts short of RAM") on a host that can pin 8 MiB: a 7 MiB slab holds one
/// 4 KiB block and 7 MiB - 4 KiB free. A 4 MiB request fits in that free range, but the fit
/// rule refuses it (more than 1.25 x the request), the cache tries to pin a 4 MiB slab, the
/// host has 1 MiB left, nothing is idle: the allocation fails although the cache holds room.
#[test]
fn the_fit_rule_gives_way_when_the_host_is_out_of_memory() {
    let (_, c) = cache_on_host_of(PinnedConfig::frugal(), 8 * MIB);
    let a = c.alloc(7 * MIB).unwrap();
    c.free(a.ptr).unwrap();
    let small = c.alloc(4 * KIB).unwrap();
    assert_eq!(small.ptr, a.ptr, "carved from the 7 MiB slab");
    let r = c.alloc(4 * MIB);
    assert!(
        r.is_ok(),
        "7 MiB - 4 KiB are free in a pinned slab, yet: {:?}; {}",
        r.map(|b| b.ptr),
        c.summary()
    );
}

/// The same under the cap: `CapExceeded` although a free range of the cache holds the request.
#[test]
fn the_fit_rule_gives_way_under_the_cap() {
    let cfg = PinnedConfig::frugal().with_max_pinned(Some(8 * MIB));
    let (_, c) = cache_on_host_of(cfg, 64 * MIB);
    let a = c.alloc(7 * MIB).unwrap();
    c.free(a.ptr).unwrap();
    let small = c.alloc(4 * KIB).unwrap();
    assert_eq!(small.ptr, a.ptr);
    let r = c.alloc(4 * MIB);
    assert!(
        r.is_ok(),
        "7 MiB - 4 KiB are free in a pinned slab, yet: {:?}",
        r.map(|b| b.ptr)
    );
}

/// When the cap is in the way, the cache tries a slab of exactly the request's size; when the
/// host runs out of memory it retries only the full slab. A 1 MiB slab is in use and the host
/// has 512 KiB left: a 4 KiB request fails with out-of-memory, where the same situation under a
/// cap succeeds with a 4 KiB slab.
#[test]
fn out_of_memory_tries_a_slab_of_the_request_size() {
    let cfg = PinnedConfig::default().with_slab_size(MIB);
    // Under a cap of 1.5 MiB: served by an exact-size slab.
    let (_, capped) = cache_on_host_of(cfg.with_max_pinned(Some(MIB + MIB / 2)), 64 * MIB);
    let _held = capped.alloc(MIB).unwrap();
    assert!(
        capped.alloc(4 * KIB).is_ok(),
        "the cap path pins an exact slab"
    );
    // On a host that can pin 1.5 MiB: refused.
    let (_, c) = cache_on_host_of(cfg, MIB + MIB / 2);
    let _held = c.alloc(MIB).unwrap();
    let r = c.alloc(4 * KIB);
    assert!(
        r.is_ok(),
        "512 KiB could still be pinned, yet: {:?}",
        r.map(|b| b.ptr)
    );
}

/// The same with the room behind a copy in flight: `frugal()` under a cap of 8 MiB, one 8 MiB
/// slab whose only block was freed after a copy still queued. A 3 MiB request (above the 2 MiB slab size, where the fit rule applies): no free range;
/// waiting for the copy would give back 8 MiB, which the fit rule refuses (more than 1.25 x the request), so the cache did not wait; the cap then refused a new slab and the allocation failed
/// with `CapExceeded`, where the same cache without the fit rule waits and serves it. The wait
/// rule gives way as the free ranges do: the block is waited for, and its range serves.
#[test]
fn the_fit_rule_gives_way_to_a_pending_block_under_the_cap() {
    let s = StreamId(5);
    for waste in [Some(0.25), None] {
        let cfg = PinnedConfig::frugal()
            .with_max_fit_waste(waste)
            .with_max_pinned(Some(8 * MIB));
        let (dev, c) = cache_on_host_of(cfg, 64 * MIB);
        let a = c.alloc(8 * MIB).unwrap();
        dev.use_range(s, DeviceAddr(a.ptr.addr() as u64), 8 * MIB);
        c.record_stream(a.ptr, s).unwrap();
        c.free(a.ptr).unwrap();
        assert_eq!(c.waiting_blocks(), 1);
        let r = c.alloc(3 * MIB);
        assert!(
            r.is_ok(),
            "fit waste {waste:?}: a copy's wait frees 8 MiB, yet: {:?}; {}",
            r.map(|b| b.ptr),
            c.summary()
        );
        let b = r.unwrap();
        assert_eq!(
            b.ptr, a.ptr,
            "fit waste {waste:?}: served from the waited-for block"
        );
        assert!(dev.check_handout(StreamId(0xfeed), DeviceAddr(b.ptr.addr() as u64), b.size));
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
        assert_eq!(c.stats().num_pending_waits, 1);
        assert_eq!(c.host().counters().pins, 1, "nothing more pinned");
        c.check_invariants().unwrap();
    }
}
