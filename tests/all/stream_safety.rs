//! The stream-safety rule (`DESIGN.md` rule 3): a block is never reused, unmapped, released,
//! moved to another stream or handed to a page-reuse move while work that used it may still be
//! queued, on any stream that used it. SimDevice models queued uses (`SimDevice::use_range`) and
//! logs every breach it sees (frees and unmaps of used memory; hand-outs to a stream not ordered
//! after the use, checked by the programs' runner for every allocation the cache returns).
//!
//! The random programs come from `programs.rs` with the `uses` mix: allocations on several
//! streams, uses on the allocation's stream, uses on other streams declared with
//! `record_stream` or ordered back by an event wait, frees, `empty_cache`, fraction changes,
//! work completed on streams in random order, synchronizes. They run with every configuration
//! family (PyTorch, PyTorch with expandable segments, the crate's default with page reuse, the
//! fast path, cross-stream reuse, borrowed blocks, and all of them at once), single-threaded
//! with the model's checks after every step, and multi-threaded on the fast path with threads
//! freeing each other's blocks.

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Run, random_program, run_threads};
use crate::util::{MIB, with_config};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

/// Every configuration family, each alone and all together.
const CONFIGS: &[&str] = &[
    "cca_preset:pytorch",
    "cca_preset:pytorch,max_split_size_mb:24,garbage_collection_threshold:0.5",
    "cca_preset:pytorch-expandable",
    "cca_preset:default",
    "cca_preset:default,cca_page_reuse:segment",
    "cca_preset:default,cca_borrow_blocks:True",
    "cca_preset:pytorch,cca_fast_path:True",
    "cca_preset:pytorch,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_fast_path:True,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_fast_path:True,cca_cross_stream_reuse:True,cca_borrow_blocks:True,cca_large_page_size_mb:4,cca_max_handle_size_mb:12",
];

fn config_strategy() -> impl Strategy<Value = AllocatorConfig> {
    proptest::sample::select(CONFIGS).prop_map(|s| AllocatorConfig::parse(s).unwrap())
}

fn uses_mix(event_faults: bool) -> Mix {
    Mix {
        min_size: 1,
        all_streams: true,
        event_faults,
        uses: true,
    }
}

fn all_on() -> AllocatorConfig {
    AllocatorConfig::parse(CONFIGS[CONFIGS.len() - 1]).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(96),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_multi_stream_programs_never_give_away_memory_in_use(
        config in config_strategy(),
        capacity_mib in 48usize..320,
        ops in random_program(uses_mix(false)),
    ) {
        let mut run = Run::new(capacity_mib, config);
        run.run_checked(&ops)?;
    }

    /// Event faults too: a failed record falls back to a synchronize, a failed handover to
    /// growth; neither may give memory away early.
    #[test]
    fn programs_with_event_faults_never_give_away_memory_in_use(
        config in config_strategy(),
        capacity_mib in 48usize..320,
        ops in random_program(uses_mix(true)),
    ) {
        let mut run = Run::new(capacity_mib, config);
        run.run_checked(&ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(24),
        ..ProptestConfig::default()
    })]

    /// Threads on the fast path share one allocator: each runs its own program, freeing and
    /// using whatever is live, also other threads' blocks; the device answers event queries up
    /// to two calls late.
    #[test]
    fn threads_freeing_each_others_blocks_never_give_away_memory_in_use(
        config in proptest::sample::select(&CONFIGS[5..]),
        lag in 0u32..3,
        programs in proptest::collection::vec(random_program(uses_mix(false)), 2..5),
    ) {
        let a = with_config(256 * MIB, AllocatorConfig::parse(config).unwrap());
        a.backend().set_event_query_lag(lag);
        if let Err(e) = run_threads(&a, &programs) {
            return Err(TestCaseError::fail(e));
        }
    }
}

// ---- the model catches a broken rule -------------------------------------------------------

/// A use on another stream that the user forgot to declare with `record_stream` is exactly what
/// the rule cannot protect: the cache reuses the block on its own stream while that work is
/// queued. The device's model sees it (so a cache that broke the rule would be seen too).
#[test]
fn an_undeclared_use_on_another_stream_is_caught_at_the_hand_out() {
    let a = with_config(256 * MIB, AllocatorConfig::pytorch());
    let sim = a.backend();
    let x = a.allocate(MIB, S0).unwrap();
    let used = sim.use_range(S1, x.ptr, x.size);
    a.free(x.ptr).unwrap();
    let y = a.allocate(MIB, S0).unwrap();
    assert_eq!(y.ptr, x.ptr, "the block is reused at once on its stream");
    assert!(!sim.check_handout(y.stream, y.ptr, y.block_size));
    let v = sim.violations();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].kind, SimViolationKind::Handout { stream: S0 });
    assert_eq!(v[0].pending, used);
    // Declared, the same program is clean: the block waits for S1's event.
    let z = a.allocate(MIB, S0).unwrap();
    sim.use_range(S1, z.ptr, z.size);
    a.record_stream(z.ptr, S1).unwrap();
    a.free(z.ptr).unwrap();
    let w = a.allocate(MIB, S0).unwrap();
    assert_ne!(w.ptr, z.ptr);
    assert!(sim.check_handout(w.stream, w.ptr, w.block_size));
    assert_eq!(sim.violations().len(), 1);
}

/// A device call that frees or unmaps used memory is logged by the device itself, whatever
/// called it. `empty_cache` waits for the work queued on the segment's stream first (a device
/// synchronize for fixed segments, a stream synchronize before unmapping pages), so it passes;
/// a direct call that skips the wait is caught.
#[test]
fn freeing_or_unmapping_used_memory_is_caught_by_the_device() {
    for config in [AllocatorConfig::pytorch(), AllocatorConfig::default()] {
        let a = with_config(256 * MIB, config);
        let sim = a.backend();
        let x = a.allocate(4 * MIB, S0).unwrap();
        let used = sim.use_range(S0, x.ptr, x.size);
        a.free(x.ptr).unwrap();
        // The cache synchronizes before releasing, so nothing is caught...
        a.empty_cache().unwrap();
        assert!(sim.violations().is_empty());
        assert!(sim.pending_uses().is_empty(), "{used:?} completed");
        // ...but a backend call that skips it is.
        let x = a.allocate(4 * MIB, S0).unwrap();
        sim.use_range(S2, x.ptr, 512);
        let segs = sim.live_segments();
        let maps = sim.live_mappings();
        if let Some(&(p, n)) = segs.first() {
            // SAFETY: the simulated device never touches memory; the allocator is not used
            // again on this range (the test only checks the device's log).
            let _ = unsafe { sim.free(p, n, S0) };
            assert_eq!(sim.violations()[0].kind, SimViolationKind::Free);
        } else {
            let &(p, n) = maps.first().unwrap();
            // SAFETY: as above.
            let _ = unsafe { sim.unmap(p, n) };
            assert_eq!(sim.violations()[0].kind, SimViolationKind::Unmap);
        }
        std::mem::forget(a);
    }
}

// ---- each path obeys the rule --------------------------------------------------------------

/// The fast path: a managed block used on another stream and declared goes through the core's
/// events instead of the front cache, on the owner's free and on another thread's.
#[test]
fn fast_path_frees_of_declared_blocks_wait_for_their_streams() {
    let a = with_config(256 * MIB, all_on());
    let sim = a.backend();
    for _ in 0..3 {
        let x = a.allocate(MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
    }
    let x = a.allocate(MIB, S0).unwrap();
    sim.use_range(S1, x.ptr, x.size);
    a.record_stream(x.ptr, S1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| a.free(x.ptr).unwrap());
    });
    for stream in [S0, S2] {
        let y = a.allocate(MIB, stream).unwrap();
        assert!(sim.check_handout(y.stream, y.ptr, y.block_size), "{y:?}");
        a.free(y.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Page reuse moves the free pages of one stream's segment to another's growth: only after the
/// old stream's work is done (it synchronizes that stream), so a use there completes first.
#[test]
fn page_reuse_moves_pages_only_after_their_stream_finished() {
    let a = with_config(
        64 * MIB,
        AllocatorConfig::parse("cca_preset:default,cca_page_lending:False").unwrap(),
    );
    let sim = a.backend();
    let x = a.allocate(40 * MIB, S0).unwrap();
    let used = sim.use_range(S0, x.ptr, x.size);
    a.free(x.ptr).unwrap();
    let unmaps = sim.counters().unmap_calls;
    let y = a.allocate(40 * MIB, S1).unwrap();
    assert!(sim.counters().unmap_calls > unmaps, "pages moved to S1");
    assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
    assert!(!sim.pending_uses().contains(&used));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Lent pages (Note [Lent pages]): the pages of a block still used on S0 serve S1 without a
/// synchronization, through an event wait; their old mapping goes only once the use completed.
#[test]
fn lent_pages_are_ordered_by_an_event_wait_and_unmapped_after_their_use() {
    let a = with_config(64 * MIB, AllocatorConfig::default());
    let sim = a.backend();
    let x = a.allocate(40 * MIB, S0).unwrap();
    let used = sim.use_range(S0, x.ptr, x.size);
    a.free(x.ptr).unwrap();
    let before = sim.counters();
    let y = a.allocate(40 * MIB, S1).unwrap();
    let c = sim.counters();
    assert_eq!(
        (c.synchronize_calls, c.stream_synchronize_calls),
        (before.synchronize_calls, before.stream_synchronize_calls),
        "no synchronization: {c:?}"
    );
    assert_eq!(c.unmap_calls, before.unmap_calls, "the old mapping stays");
    assert_eq!(
        c.stream_waits,
        before.stream_waits + 1,
        "S1 waits on S0's event"
    );
    assert!(
        sim.pending_uses().contains(&used),
        "the use is still queued"
    );
    // The same bytes, seen through the new mapping: S1 is ordered after the use.
    assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
    // A third stream that waited for nothing would not be.
    assert!(!sim.check_handout(S2, y.ptr, y.block_size));
    let caught = sim.violations().len();
    assert_eq!(caught, 1, "{:?}", sim.violations());
    a.check_invariants().unwrap();
    sim.complete_work(S0);
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(sim.violations().len(), caught);
    assert_eq!(sim.counters().reserved_bytes, 0);
}

// ---- regressions -----------------------------------------------------------------------------

/// A free whose stream event cannot be recorded falls back to synchronizing the stream; when
/// that fails too (and the device synchronize after it), the block must stay out of the cache
/// until a later attempt succeeds, not go back to the pool while the other stream may still use
/// it.
#[test]
fn a_free_whose_event_and_synchronizes_fail_keeps_the_block_out_of_the_cache() {
    for config in [AllocatorConfig::pytorch(), all_on()] {
        let a = with_config(256 * MIB, config);
        let sim = a.backend();
        let x = a.allocate(MIB, S0).unwrap();
        sim.use_range(S1, x.ptr, x.size);
        a.record_stream(x.ptr, S1).unwrap();
        sim.fail_next_event_call(SimEventCall::Record);
        sim.fail_next_synchronize();
        sim.fail_next_synchronize();
        assert!(a.free(x.ptr).is_err(), "the failure is reported");
        assert!(a.free(x.ptr).is_err(), "the pointer is gone for the user");
        a.check_invariants().unwrap();
        assert_eq!(a.memory_stats().memory_allocated(), 0);
        let y = a.allocate(MIB, S0).unwrap();
        assert_ne!(y.ptr, x.ptr, "pending on S1");
        assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
        a.check_invariants().unwrap();
        // The next attempt records the event; once S1 finishes, the block is reused.
        sim.complete_work(S1);
        let z = a.allocate(MIB, S0).unwrap();
        assert!(sim.check_handout(z.stream, z.ptr, z.block_size));
        a.free(z.ptr).unwrap();
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.memory_stats().memory_reserved(), 0);
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        a.check_invariants().unwrap();
    }
}

/// When the retry of such a parked block fails again at the next allocation, that allocation
/// (on another stream, with room) still succeeds: the block stays parked, and `empty_cache`
/// reports the failure (found by a review: the allocation failed with the retry's error).
#[test]
fn a_parked_blocks_failed_retry_does_not_fail_an_unrelated_allocation() {
    for config in [AllocatorConfig::pytorch(), all_on()] {
        let a = with_config(256 * MIB, config);
        let sim = a.backend();
        let x = a.allocate(4096, S0).unwrap();
        sim.use_range(S1, x.ptr, x.size);
        a.record_stream(x.ptr, S1).unwrap();
        for _ in 0..2 {
            sim.fail_next_event_call(SimEventCall::Record);
            sim.fail_next_synchronize();
            sim.fail_next_synchronize();
        }
        assert!(a.free(x.ptr).is_err(), "parked");
        let y = a.allocate(8 * MIB, S2).unwrap();
        assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
        a.check_invariants().unwrap();
        sim.complete_work(S1);
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.memory_stats().memory_reserved(), 0);
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        a.check_invariants().unwrap();
    }
}

/// `forget_stream` (how the cudarc interop releases streams nothing holds any more) forgets a
/// stream only once nothing in the cache refers to it: not while a block of the stream is
/// allocated or cached, nor while a block lists it as a user, nor while an event recorded on it
/// is outstanding. A forgotten stream is validated again at its next allocation.
#[test]
fn a_stream_is_forgotten_only_when_nothing_refers_to_it() {
    for config in [AllocatorConfig::pytorch(), AllocatorConfig::default()] {
        let a = with_config(256 * MIB, config);
        let sim = a.backend();
        let released = std::cell::Cell::new(0);
        let forget = |s: StreamId| {
            a.forget_stream(s, || {
                released.set(released.get() + 1);
                true
            })
        };
        let x = a.allocate(MIB, S1).unwrap();
        assert!(!forget(S1), "an allocated block belongs to S1");
        a.free(x.ptr).unwrap();
        assert!(!forget(S1), "S1's free block is still cached");
        assert_eq!(
            released.get(),
            0,
            "release runs only when the stream is forgotten"
        );

        // S2 used a block of S0: listed while allocated, then an event recorded on it.
        let y = a.allocate(MIB, S0).unwrap();
        sim.use_range(S2, y.ptr, y.size);
        a.record_stream(y.ptr, S2).unwrap();
        assert!(!forget(S2), "y lists S2 among its users");
        a.free(y.ptr).unwrap();
        assert!(
            !forget(S2),
            "the event recorded on S2 at y's free is outstanding"
        );
        sim.complete_work(S2);
        a.empty_cache().unwrap();
        assert!(forget(S2));
        assert_eq!(released.get(), 1);

        // A release that refuses keeps the stream.
        assert!(!a.forget_stream(S1, || false));
        a.empty_cache().unwrap();
        assert!(forget(S1), "empty_cache released S1's cached block");
        assert_eq!(released.get(), 2);
        // Forgotten, S1 is validated again at its next allocation.
        sim.reject_stream(S1);
        assert!(matches!(
            a.allocate(MIB, S1),
            Err(AllocError::InvalidStream { stream: S1, .. })
        ));
        a.check_invariants().unwrap();
    }
}
