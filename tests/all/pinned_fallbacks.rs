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
