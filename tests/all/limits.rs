//! Input at the limits (#14): huge requests, huge stream handles, address-space exhaustion on
//! the simulated device, synthetic-workload parameters at their edges.

use cuda_caching_allocator::*;

use crate::util::with_config;

const GIB: usize = 1 << 30;

/// Regression (#14): a request that cannot fit the device created pages one at a time until
/// memory ran out before failing (on the OOM path's every retry): a 1 TiB request on a 16 GiB
/// device took thousands of device calls (seconds, and ~37 s with small pages). Now it fails
/// before anything is reserved, created or mapped, and leaves the allocator intact.
#[test]
fn a_request_larger_than_the_device_fails_before_mapping_anything() {
    for preset in Preset::ALL {
        for fraction in [1.0, 0.5] {
            let a = with_config(16 * GIB, preset.config());
            a.set_memory_fraction(fraction).unwrap();
            let keep = a.allocate(64 << 20, StreamId(0)).unwrap();
            for request in [1usize << 40, 17 * GIB, 9 * GIB] {
                if fraction == 1.0 && request == 9 * GIB {
                    continue; // fits
                }
                let before = a.backend().counters();
                let err = a.allocate(request, StreamId(0)).unwrap_err();
                let AllocError::OutOfMemory(report) = &err else {
                    panic!("{preset:?} {request}: {err}");
                };
                let after = a.backend().counters();
                let calls = after.device_calls - before.device_calls;
                assert!(
                    calls <= 4,
                    "{preset:?}, fraction {fraction}, {request} bytes: {calls} device calls\n{after:?}"
                );
                assert_eq!(after.create_physical_calls, before.create_physical_calls);
                assert_eq!(after.reserve_calls, before.reserve_calls);
                let verdict = if request > 16 * GIB {
                    OomVerdict::LargerThanDevice
                } else {
                    OomVerdict::FractionCapReached
                };
                assert_eq!(report.verdict, verdict, "{preset:?} {fraction} {request}");
                a.check_invariants().unwrap();
            }
            a.free(keep.ptr).unwrap();
            a.check_invariants().unwrap();
        }
    }
}

/// Regression (#14): the simulated device's address cursor advanced by every placement and
/// overflowed (a panic) after 2^64 bytes of them, e.g. ~16 near-1-EiB reservations released
/// again. Placement uses checked arithmetic now: it starts over above the base address when
/// the space above the cursor is used up, and is out of memory only when no gap is left.
#[test]
fn the_simulated_address_space_never_wraps() {
    let sim = SimDevice::new(SimConfig {
        capacity: usize::MAX,
        ..SimConfig::default()
    });
    let eib = 1usize << 60;
    let mut last = None;
    for _ in 0..40 {
        let va = sim.reserve_address_range(eib).unwrap();
        assert!(va.0.checked_add(eib as u64).is_some(), "{va}");
        // SAFETY: `va` is a reservation of `eib` bytes made above, with nothing mapped.
        unsafe { sim.release_address_range(va, eib).unwrap() };
        let p = sim.allocate(eib, StreamId(0)).unwrap();
        assert!(p.0.checked_add(eib as u64).is_some(), "{p}");
        // SAFETY: `p` came from `allocate` above with this size and no work uses it.
        unsafe { sim.free(p, eib, StreamId(0)).unwrap() };
        last = Some(p);
    }
    assert!(last.is_some());
    // Space for 15 such ranges at most lies above the base address: holding them all, the
    // next one is out of memory, not a wrapped address.
    let mut held = Vec::new();
    let err = loop {
        match sim.reserve_address_range(eib) {
            Ok(va) => held.push(va),
            Err(e) => break e,
        }
        assert!(held.len() <= 16, "more ranges than the address space holds");
    };
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(held.len(), 15);
}

/// A simulated device "as large as can be" (`SimDevice::with_capacity(usize::MAX)`, what a
/// program writes to take memory out of the picture) under expandable segments: sizing a new
/// segment's address range as PyTorch does (the device's memory and an eighth more) overflowed,
/// a panic in a debug build. The range now stops at the largest request the cache serves, so
/// allocations on several streams and in both pools succeed there.
#[test]
fn expandable_segments_on_a_simulated_device_of_usize_max_bytes() {
    for capacity in [usize::MAX, usize::MAX - usize::MAX / 9, 1 << 63] {
        for preset in Preset::ALL {
            let a = with_config(capacity, preset.config());
            let mut live = Vec::new();
            for stream in 0..4 {
                for size in [512, 30 << 20, 5 * GIB] {
                    let block = a.allocate(size, StreamId(stream)).unwrap_or_else(|e| {
                        panic!("{preset:?}, {capacity} bytes, stream {stream}, {size}: {e}")
                    });
                    live.push(block.ptr);
                }
            }
            for p in live {
                a.free(p).unwrap();
            }
            a.empty_cache().unwrap();
            a.check_invariants().unwrap();
        }
    }
}

/// A simulated device smaller than one expandable page is refused naming the page's key, with
/// the device's true size: sizes below 1 MiB read "0 MiB" (`--device-memory 1` said the device
/// had none) and others were cut to whole MiB.
#[test]
fn a_device_smaller_than_a_page_is_refused_with_its_true_size() {
    for (capacity, shown) in [(1, "1 bytes"), (1536 << 10, "1.50 MiB")] {
        let sim = SimDevice::new(SimConfig {
            capacity,
            ..SimConfig::default()
        });
        let e = CachingAllocator::new(sim, AllocatorConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cca_large_page_size_mb"), "{e}");
        assert!(e.contains(&format!("({shown})")), "{capacity} bytes: {e}");
    }
}

/// Regression (#14): `ManyStreamsParams` with a size range that the per-iteration scale
/// divides below its minimum (or a reversed one) panicked with "min > max" in `clamp`.
#[test]
fn many_streams_params_at_their_edges_generate() {
    for sizes in [(4 << 10, 8 << 10), (1 << 20, 1 << 10), (0, 0), (1, 1)] {
        let p = synth::ManyStreamsParams {
            streams: 2,
            iterations: 3,
            depth: 4,
            sizes,
            weights: 1 << 20,
        };
        let trace = p.generate(7);
        assert!(!trace.events.is_empty(), "{sizes:?}");
    }
}
