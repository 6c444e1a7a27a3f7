//! Out-of-memory reports checked against what actually stopped the allocation: each situation
//! is built on `SimDevice`, and the verdict and advice are held to what the same program does
//! when it follows them.

use cuda_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, DeviceBackend, MemPoolId,
    OomVerdict, Preset, SimDevice, StreamId,
};

use crate::util::*;

const S0: StreamId = StreamId::DEFAULT;

/// Three 6 MiB blocks and a 1.5 MiB one back to back in one 20 MiB segment, the first and third
/// freed, then every device allocation failing: an 8 MiB request finds 12 MiB free in two
/// 6 MiB holes (fragmented). Returns the live blocks.
fn two_holes(a: &CachingAllocator<SimDevice>) -> Vec<Allocation> {
    let p: Vec<_> = [6 * MIB, 6 * MIB, 6 * MIB, 3 * MIB / 2]
        .iter()
        .map(|&n| a.allocate(n, S0).unwrap())
        .collect();
    a.free(p[0].ptr).unwrap();
    a.free(p[2].ptr).unwrap();
    a.backend().fail_allocations_above(Some(0));
    vec![p[1], p[3]]
}

/// Another process holds all but `left` bytes of the device.
fn leave_free(a: &CachingAllocator<SimDevice>, left: usize) {
    let free = a.backend().mem_info().unwrap().free;
    a.backend().allocate(free - left, StreamId(99)).unwrap();
}

/// Under a fraction cap, another process fills the device: the growth fits under the cap (the
/// default counts only the pages a growth creates) but not on the device. The report said "the
/// per-process memory fraction cap is reached" and advised raising the fraction, which fails
/// the same way; raising it does not help, the device is full. Under PyTorch's preset both
/// limits stop the 20 MiB segment: the device is the one that raising the fraction cannot lift.
#[test]
fn the_cap_verdict_only_when_the_cap_and_not_the_device_stops_it() {
    for (name, config) in [
        ("default", AllocatorConfig::default()),
        ("lean-fast", Preset::LeanFast.config()),
        ("pytorch-expandable", Preset::PytorchExpandable.config()),
        ("pytorch", AllocatorConfig::pytorch()),
    ] {
        let a = with_config(1 << 30, config);
        a.set_memory_fraction(0.5).unwrap();
        let live = a.allocate(500 * MIB, S0).unwrap();
        leave_free(&a, 4 * MIB);
        let err = a.allocate(6 * MIB, S0).unwrap_err();
        let r = err.oom_report().unwrap();
        assert_eq!(r.verdict, OomVerdict::DeviceFull, "{name}: {err}");
        assert_eq!(r.device_free, 4 * MIB, "{name}");
        // Following the advice the cap verdict gives does not help: the device is the limit.
        a.set_memory_fraction(1.0).unwrap();
        let again = a.allocate(6 * MIB, S0).unwrap_err();
        assert_eq!(
            again.oom_report().unwrap().verdict,
            OomVerdict::DeviceFull,
            "{name}"
        );
        // The allocator is intact, and a request that fits the device's 4 MiB is served.
        a.check_invariants().unwrap();
        let small = a.allocate(MIB / 2, S0).unwrap();
        a.free(small.ptr).unwrap();
        a.free(live.ptr).unwrap();
        a.check_invariants().unwrap();
    }
    // With room on the device the cap is the cause, under every preset.
    for (name, config) in [
        ("default", AllocatorConfig::default()),
        ("pytorch-expandable", Preset::PytorchExpandable.config()),
        ("pytorch", AllocatorConfig::pytorch()),
    ] {
        let a = with_config(1 << 30, config);
        a.set_memory_fraction(0.5).unwrap();
        let live = a.allocate(500 * MIB, S0).unwrap();
        let err = a.allocate(30 * MIB, S0).unwrap_err();
        assert_eq!(
            err.oom_report().unwrap().verdict,
            OomVerdict::FractionCapReached,
            "{name}: {err}"
        );
        a.set_memory_fraction(1.0).unwrap();
        let x = a.allocate(30 * MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
        a.free(live.ptr).unwrap();
        a.check_invariants().unwrap();
    }
}

/// Expandable segments map only the pages a request needs: the 20 MiB segment size of a
/// 1–10 MiB request is not what the device must hold. On a 16 MiB device with 10 MiB live, an
/// 8 MiB request under the default was judged "larger than the device's whole memory: no
/// freeing can make room", and after freeing the live 10 MiB the same request succeeded. The
/// other way round, PyTorch's expandable preset maps 20 MiB pages: a 45 MiB request needs three
/// (60 MiB) on a 50 MiB device that is wholly free, and was judged "the device is full".
#[test]
fn larger_than_the_device_counts_what_an_expandable_growth_maps() {
    for (name, config) in [
        ("default", AllocatorConfig::default()),
        ("lean-fast", Preset::LeanFast.config()),
    ] {
        let a = with_config(16 * MIB, config);
        let live = a.allocate(10 * MIB, S0).unwrap();
        let err = a.allocate(8 * MIB, S0).unwrap_err();
        let r = err.oom_report().unwrap();
        assert_eq!(r.verdict, OomVerdict::DeviceFull, "{name}: {err}");
        assert!(
            !err.to_string().contains("No freeing can make room"),
            "{name}"
        );
        a.check_invariants().unwrap();
        a.free(live.ptr).unwrap();
        let x = a.allocate(8 * MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
        // A request the device can never hold is still named so.
        let err = a.allocate(17 * MIB, S0).unwrap_err();
        assert_eq!(
            err.oom_report().unwrap().verdict,
            OomVerdict::LargerThanDevice,
            "{name}"
        );
        a.check_invariants().unwrap();
    }
    let a = with_config(50 * MIB, Preset::PytorchExpandable.config());
    let err = a.allocate(45 * MIB, S0).unwrap_err();
    assert_eq!(
        err.oom_report().unwrap().verdict,
        OomVerdict::LargerThanDevice,
        "{err}"
    );
    // Nothing else is on the device: whatever the report says, freeing cannot help.
    assert_eq!(a.backend().mem_info().unwrap().free, 50 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.check_invariants().unwrap();
}

/// With expandable segments on, a fragmented cache was told "try expandable_segments:True to
/// avoid fragmentation": the setting in force. What joins the scattered free bytes is freeing
/// the live blocks between them, and the advice says so now; under PyTorch's preset (fixed
/// segments) PyTorch's own advice stays.
#[test]
fn fragmented_advice_under_expandable_segments_is_not_to_turn_them_on() {
    for (name, config) in [
        ("default", AllocatorConfig::default()),
        ("lean-fast", Preset::LeanFast.config()),
        ("pytorch-expandable", Preset::PytorchExpandable.config()),
    ] {
        let a = with_config(1 << 30, config);
        // 1.5 MiB blocks back to back; every other one freed leaves 30 MiB free, none of it
        // a whole page.
        let xs: Vec<_> = (0..40)
            .map(|_| a.allocate(3 * MIB / 2, S0).unwrap())
            .collect();
        for x in xs.iter().skip(1).step_by(2) {
            a.free(x.ptr).unwrap();
        }
        a.backend().fail_allocations_above(Some(0));
        let err = a.allocate(5 * MIB, S0).unwrap_err();
        let r = err.oom_report().unwrap();
        assert_eq!(r.verdict, OomVerdict::Fragmented, "{name}: {err}");
        assert!(r.expandable_segments, "{name}");
        let text = err.to_string();
        assert!(
            !text.contains("try expandable_segments:True"),
            "{name}: {text}"
        );
        assert!(text.contains("free live blocks"), "{name}: {text}");
        // Following it: freeing the two live blocks between three free ones joins 7.5 MiB.
        a.free(xs[2].ptr).unwrap();
        a.free(xs[4].ptr).unwrap();
        let x = a.allocate(5 * MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
        a.backend().clear_faults();
        a.check_invariants().unwrap();
    }
    // Fixed segments: PyTorch's advice, which expandable segments do follow.
    let a = pytorch_on(64 * MIB);
    two_holes(&a);
    let err = a.allocate(8 * MIB, S0).unwrap_err();
    assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::Fragmented);
    assert!(!err.oom_report().unwrap().expandable_segments);
    assert!(
        err.to_string()
            .ends_with("If reserved but unallocated memory is large try expandable_segments:True to avoid fragmentation."),
        "{err}"
    );
}

/// A request routed to a private pool is judged by that pool's free blocks, but the report's
/// block figures were the default pools': a private pool with 12 MiB free in two 6 MiB blocks
/// was "fragmented" beside "largest free cached block 0 bytes, 0 bytes on 0x0; external
/// fragmentation 0.0%", figures that contradict the verdict. They describe the pools the
/// request was served from now, as the verdict does.
#[test]
fn a_routed_requests_block_figures_are_its_pools() {
    let a = pytorch_on(64 * MIB);
    // The default pool holds a 20 MiB free segment of its own that the routed request cannot use.
    let d = a.allocate(20 * MIB, S0).unwrap();
    a.free(d.ptr).unwrap();
    let (err, live) = routed_two_holes(&a);
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Fragmented, "{err}");
    assert_eq!(r.private_pool_free_bytes, 12 * MIB);
    assert_eq!(r.largest_free_block, 6 * MIB, "{err}");
    assert_eq!(r.largest_free_block_on_stream, 6 * MIB, "{err}");
    assert!((r.external_fragmentation - 0.5).abs() < 1e-9, "{err}");
    free_after_faults(&a, &live);
}

/// A request routed to a private pool under the default configuration (expandable segments on)
/// was advised to "try expandable_segments:True" when the pool was fragmented: private pools
/// keep fixed segments, which the setting does not change, so it cannot help them.
#[test]
fn a_routed_request_under_expandable_segments_is_not_told_to_turn_them_on() {
    let a = with_config(64 * MIB, AllocatorConfig::default());
    let (err, live) = routed_two_holes(&a);
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Fragmented, "{err}");
    assert!(r.expandable_segments, "{err}");
    assert!(
        !err.to_string().contains("try expandable_segments:True"),
        "{err}"
    );
    free_after_faults(&a, &live);
}

/// [`two_holes`] inside a routing to a new private pool, and the error of an 8 MiB request
/// routed there; returns it with the live blocks.
fn routed_two_holes(a: &CachingAllocator<SimDevice>) -> (AllocError, Vec<Allocation>) {
    let pool = MemPoolId::new_user();
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let live = two_holes(a);
    let err = a.allocate(8 * MIB, S0).unwrap_err();
    a.end_allocate_to_pool(pool).unwrap();
    (err, live)
}

/// Lets the device allocate again, frees `live` and checks the allocator.
fn free_after_faults(a: &CachingAllocator<SimDevice>, live: &[Allocation]) {
    a.backend().clear_faults();
    for x in live {
        a.free(x.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

/// With `throw_on_cudamalloc_oom` a request the cap refuses fails at once, without releasing
/// the cache. The verdict then looked at the free cached bytes the skipped release would have
/// returned and said "in blocks of other streams ... allocate on the stream that freed the
/// memory, or free the live blocks that keep its segments" with no live block anywhere: the cap
/// refused it, and after `empty_cache` the same request succeeds.
#[test]
fn throw_on_cudamalloc_oom_names_the_cap() {
    let config = AllocatorConfig::pytorch()
        .with_settings("throw_on_cudamalloc_oom:True")
        .unwrap();
    let a = with_config(1 << 30, config);
    a.set_memory_fraction(0.5).unwrap();
    let x = a.allocate(400 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let err = a.allocate(400 * MIB, StreamId(1)).unwrap_err();
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::FractionCapReached, "{err}");
    assert_eq!(r.allocated_bytes, 0);
    assert_eq!(r.reserved_bytes, 400 * MIB);
    a.empty_cache().unwrap();
    let w = a.allocate(400 * MIB, StreamId(1)).unwrap();
    a.free(w.ptr).unwrap();
    a.empty_cache().unwrap();
    // Same stream, two cached segments: not "fragmented" either.
    let y = a.allocate(200 * MIB, S0).unwrap();
    let z = a.allocate(200 * MIB, S0).unwrap();
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    let err = a.allocate(300 * MIB, S0).unwrap_err();
    assert_eq!(
        err.oom_report().unwrap().verdict,
        OomVerdict::FractionCapReached,
        "{err}"
    );
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    let w = a.allocate(400 * MIB, StreamId(1)).unwrap();
    a.free(w.ptr).unwrap();
    a.check_invariants().unwrap();
}
