//! Unmaps off the allocating thread (`cca_unmap_helper`, Note [Unmaps off the allocating
//! thread]): with a backend that has a helper (`SimDevice::set_unmap_helper`, the simulated
//! stand-in for `CudaDevice`'s thread), the old mappings of moved pages are unmapped by the
//! helper after the growth (the simulated helper runs its jobs when the cache waits for them,
//! before the next growth plans). Random programs check the device's hazard
//! log and the invariants after every step; replays check memory, synchronizations and that the
//! helper did the unmapping; directed cases check `empty_cache` and a new peer while jobs wait.
use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;
use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::lagged_programs::{CONFIGS, lending_heavy_ops};
use crate::programs::{Mix, Op, Run, random_program};
use crate::util::MIB;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    /// Lending-heavy random programs (faults included, so some of the helper's unmaps fail)
    /// under every page-reuse configuration, event queries answered 0 to 2 times late.
    #[test]
    fn programs_with_the_helper(
        config in proptest::sample::select(CONFIGS).prop_map(|s| AllocatorConfig::parse(s).unwrap()),
        capacity_mib in 40usize..160,
        lag in 0u32..3,
        ops in lending_heavy_ops(),
    ) {
        let mut run = Run::new(capacity_mib, config);
        run.a.backend().set_event_query_lag(lag);
        run.a.backend().set_unmap_helper(true);
        run.run_checked(&ops)?;
    }

    /// The helper changes nothing a program sees (Note [Unmaps off the allocating thread]):
    /// lending-heavy and general random programs without injected faults, under every
    /// page-reuse configuration and event-query lags, give the same allocations, statistics
    /// and page loans after every step with the helper as without it.
    #[test]
    fn programs_behave_the_same_with_and_without_the_helper(
        config in proptest::sample::select(CONFIGS),
        capacity_mib in 32usize..200,
        lag in 0u32..4,
        ops in prop_oneof![
            lending_heavy_ops(),
            random_program(Mix { min_size: 1, all_streams: true, event_faults: false, uses: true }),
        ],
    ) {
        let ops: Vec<Op> = ops
            .into_iter()
            .filter(|op| !matches!(op, Op::FailNextCall { .. } | Op::FailEvent { .. } | Op::FailSync))
            .collect();
        same_with_and_without_helper(config, capacity_mib, lag, &ops)?;
    }
}

/// A replay of `trace` on a simulated device with or without an unmap helper, with event
/// queries answered `lag` times late.
fn replayed(
    trace: &Trace,
    config: &str,
    lag: u32,
    helper: bool,
) -> (ReplayReport, CachingAllocator<SimDevice>) {
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    dev.set_unmap_helper(helper);
    let alloc = CachingAllocator::new(dev, AllocatorConfig::parse(config).unwrap()).unwrap();
    let r = replay(&alloc, trace, &ReplayOptions::default()).unwrap();
    (r, alloc)
}

/// On the synthetic stress traces the default with a helper stays at the memory floor without
/// synchronizing, the helper does the unmapping the growths leave, the device logs no hazard,
/// and `empty_cache` leaves nothing mapped (it waits for the helper's queue).
#[test]
fn the_helper_unmaps_what_growths_move_and_memory_stays_lean() {
    for w in [Workload::TransformerVarlen, Workload::ManyStreams] {
        let t = w.trace(1);
        for lag in [0, 1, 4] {
            let (inline, a0) = replayed(&t, "cca_preset:default", lag, false);
            assert_eq!(a0.unmaps_handed_off(), 0);
            let (r, alloc) = replayed(&t, "cca_preset:default", lag, true);
            let syncs = r.device_call("synchronize") + r.device_call("stream_synchronize");
            assert_eq!(
                syncs,
                0,
                "{} query lag {lag}: {:?}",
                w.name(),
                r.device_calls
            );
            assert!(
                r.reserved_over_live() <= 1.02,
                "{} query lag {lag}: {:.4} (inline {:.4})",
                w.name(),
                r.reserved_over_live(),
                inline.reserved_over_live()
            );
            assert!(
                alloc.unmaps_handed_off() > 0,
                "{} query lag {lag}: nothing handed off",
                w.name()
            );
            let sim = alloc.backend();
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
            alloc.empty_cache().unwrap();
            assert!(
                sim.live_mappings().is_empty(),
                "{} query lag {lag}",
                w.name()
            );
            assert_eq!(sim.counters().reserved_bytes, 0);
            assert_eq!(alloc.check_invariants(), Ok(()));
        }
        // Off by configuration: the helper is there, the growths unmap themselves.
        let (_, off) = replayed(&t, "cca_preset:default,cca_unmap_helper:False", 1, true);
        assert_eq!(off.unmaps_handed_off(), 0, "{}", w.name());
    }
}

/// A page moved between streams with its unmap left to a helper that has not run: the old
/// range stays out of use (lent), `enable_peer_access` grants no range the helper is
/// unmapping, and `empty_cache` waits for the helper before it releases the handle.
/// The default on a simulated device of `capacity` with a helper, where `first` bytes allocated
/// and freed on stream 0 (idle once a fence shows it: no work was queued) are then moved by
/// growths of 8 MiB on stream 1, which fill the device until one hands its old mappings to the
/// helper. Returns the allocator and the blocks held on stream 1.
fn pages_moved_off_thread(
    capacity: usize,
    first: usize,
) -> (CachingAllocator<SimDevice>, Vec<Allocation>) {
    let dev = SimDevice::with_capacity(capacity);
    dev.set_unmap_helper(true);
    let a = CachingAllocator::new(dev, AllocatorConfig::default()).unwrap();
    let x = a.allocate(first, StreamId::DEFAULT).unwrap();
    a.free(x.ptr).unwrap();
    let mut held = Vec::new();
    while let Ok(y) = a.allocate(8 * MIB, StreamId(1)) {
        held.push(y);
        if a.unmaps_handed_off() > 0 {
            break;
        }
    }
    assert!(
        a.unmaps_handed_off() > 0,
        "no page moved with its unmap handed off"
    );
    (a, held)
}

#[test]
fn queued_unmaps_keep_the_old_range_out_of_use_until_the_helper_ran() {
    let (a, held) = pages_moved_off_thread(64 * MIB, 8 * MIB);
    let sim = a.backend();
    // The old mappings are still there: more mapped than reserved.
    let mapped: usize = sim.live_mappings().iter().map(|m| m.1).sum();
    assert!(
        mapped as i64 > a.memory_stats().memory_reserved(),
        "{mapped}"
    );
    assert_eq!(a.check_invariants(), Ok(()));
    a.enable_peer_access(1).unwrap();
    let mapped_after: usize = sim.live_mappings().iter().map(|m| m.1).sum();
    assert_eq!(mapped_after as i64, a.memory_stats().memory_reserved());
    for y in held {
        a.free(y.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert!(sim.live_mappings().is_empty());
    assert_eq!(sim.counters().reserved_bytes, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(a.check_invariants(), Ok(()));
}

/// A helper job that fails (an injected error on its first unmap) leaves its block lent, with
/// its old mapping in place, and the growing thread unmaps it on the next try: here
/// `empty_cache`, which waits for the helper, sees the failure, unmaps inline and releases
/// everything.
#[test]
fn a_failed_helper_job_leaves_the_block_lent_and_is_unmapped_on_the_next_try() {
    let (a, held) = pages_moved_off_thread(64 * MIB, 8 * MIB);
    let sim = a.backend();
    let unmaps = sim.counters().unmap_calls;
    for y in held {
        a.free(y.ptr).unwrap();
    }
    // The next counted device call is the helper's first unmap, run when `empty_cache` waits.
    sim.fail_next_call(FaultKind::Error);
    a.empty_cache().unwrap();
    assert!(
        sim.counters().unmap_calls > unmaps,
        "the failed range was unmapped after all"
    );
    assert!(sim.live_mappings().is_empty());
    assert_eq!(sim.counters().reserved_bytes, 0);
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(a.check_invariants(), Ok(()));
}

/// `cca replay --unmap-helper` gives the simulated device a helper and reports what went to
/// it (pages, and the modeled time of its unmaps, part of the total); without the flag nothing
/// does.
#[cfg(feature = "cli")]
#[test]
fn cca_replay_reports_what_went_to_the_helper() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/gpu/traces/ckpt.pickle.gz");
    let handed = |extra: &[&str]| -> (u64, u64, u64) {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cca"))
            .args(["replay", trace, "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["unmaps_handed_off"].as_u64().unwrap(),
            v["modeled_helper_ns"].as_u64().unwrap(),
            v["modeled_device_ns"].as_u64().unwrap(),
        )
    };
    assert_eq!(handed(&[]).0, 0);
    assert_eq!(handed(&[]).1, 0);
    let (pages, helper_ns, total_ns) = handed(&["--unmap-helper"]);
    assert!(pages > 0);
    assert!(
        helper_ns > 0 && helper_ns < total_ns,
        "{helper_ns} of {total_ns}"
    );
}

/// The helper is a thread of its own: a queued job may run at once, while work queued before
/// the hand-off still uses the range. The simulated helper runs its jobs late (when the cache
/// waits for them), so it checks the ranges for incomplete uses when they are queued as well, as if the
/// job ran then; a check only when the job runs misses uses that completed in between.
#[test]
fn the_simulated_helper_checks_for_uses_when_a_job_is_queued() {
    let sim = SimDevice::with_capacity(64 * MIB);
    sim.set_unmap_helper(true);
    let s = StreamId(1);
    let va = sim.reserve_address_range(8 * MIB).unwrap();
    let h = sim.create_physical(2 * MIB).unwrap();
    // SAFETY: `va` is a fresh reservation, `h` a fresh handle of the size mapped.
    unsafe { sim.map(va, 2 * MIB, h).unwrap() };
    sim.use_range(s, va, 4096);
    // SAFETY: simulated memory; the point is the breach being logged (the range is in use).
    let ticket = unsafe { sim.unmap_later(vec![(va, 2 * MIB)]).unwrap() };
    sim.complete_work(s);
    sim.wait_unmaps();
    let done = sim.finished_unmaps(&[ticket]);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].unmapped, 1);
    let v = sim.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, SimViolationKind::Unmap);
    // SAFETY: unmapped by the job.
    unsafe { sim.release_physical(h, 2 * MIB).unwrap() };
    // SAFETY: nothing mapped there.
    unsafe { sim.release_address_range(va, 8 * MIB).unwrap() };
}

/// `CudaDevice`'s helper thread runs in relaxed capture mode for its whole life, so its unmaps
/// are legal while another thread captures in global mode; the simulated helper's are too (they
/// were logged as capture violations, which the real helper cannot cause).
#[test]
fn the_simulated_helpers_unmaps_are_relaxed_like_the_threads() {
    let sim = SimDevice::with_capacity(64 * MIB);
    sim.set_unmap_helper(true);
    let va = sim.reserve_address_range(8 * MIB).unwrap();
    let h = sim.create_physical(2 * MIB).unwrap();
    // SAFETY: `va` is a fresh reservation, `h` a fresh handle of the size mapped.
    unsafe { sim.map(va, 2 * MIB, h).unwrap() };
    // SAFETY: one live mapping that no work uses, left alone until the job is reported.
    let ticket = unsafe { sim.unmap_later(vec![(va, 2 * MIB)]).unwrap() };
    sim.begin_capture(StreamId(2), SimCaptureMode::Global)
        .unwrap();
    sim.wait_unmaps();
    assert_eq!(sim.finished_unmaps(&[ticket])[0].unmapped, 1);
    assert!(
        sim.capture_violations().is_empty(),
        "{:?}",
        sim.capture_violations()
    );
    // An unmap on the caller's thread is still one.
    let h2 = sim.create_physical(2 * MIB).unwrap();
    let va2 = va.offset(2 * MIB);
    // SAFETY: a free part of the reservation, a fresh handle of the size mapped.
    unsafe { sim.map(va2, 2 * MIB, h2).unwrap() };
    // SAFETY: the mapping made above, unused.
    unsafe { sim.unmap(va2, 2 * MIB).unwrap() };
    assert_eq!(sim.capture_violations().len(), 1);
    sim.end_capture(StreamId(2)).unwrap();
    for h in [h, h2] {
        // SAFETY: unmapped above.
        unsafe { sim.release_physical(h, 2 * MIB).unwrap() };
    }
    // SAFETY: nothing mapped there.
    unsafe { sim.release_address_range(va, 8 * MIB).unwrap() };
}

/// Two simulated devices alike but for the unmap helper, each with an allocator of `config`.
fn with_and_without_helper(config: &str, capacity_mib: usize) -> [CachingAllocator<SimDevice>; 2] {
    [false, true].map(|helper| {
        let dev = SimDevice::with_capacity(capacity_mib * MIB);
        dev.set_unmap_helper(helper);
        CachingAllocator::new(dev, AllocatorConfig::parse(config).unwrap()).unwrap()
    })
}

/// A page move counts as a device free (`num_device_free`, one per unmapped range) in the
/// allocation that moved the pages, with the helper as without it: counted only once the
/// helper's job came back, the count lagged a growth behind, and a
/// `reset_accumulated_stats` in between kept the difference for good.
#[test]
fn a_page_move_counts_as_a_device_free_when_it_is_made() {
    let config = "cca_preset:default,cca_page_reuse_slack:0";
    let [off, on] = with_and_without_helper(config, 64);
    for a in [&off, &on] {
        // 16 MiB on stream 0, freed (no work queued: idle once a fence shows it), then 16 MiB
        // on stream 1, which moves stream 0's pages (no slack for new ones).
        let x = a.allocate(16 * MIB, StreamId::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        let y = a.allocate(16 * MIB, StreamId(1)).unwrap();
        assert_eq!(a.memory_stats().memory_reserved(), 16 * MIB as i64);
        assert_eq!(a.unmaps_handed_off() > 0, a.backend().unmaps_off_thread());
        a.reset_accumulated_stats();
        // Another growth: the helper's job comes back first.
        let z = a.allocate(2 * MIB, StreamId(1)).unwrap();
        a.free(z.ptr).unwrap();
        a.free(y.ptr).unwrap();
    }
    assert_eq!(
        on.memory_stats().num_device_free,
        off.memory_stats().num_device_free
    );
    for a in [&off, &on] {
        a.empty_cache().unwrap();
        assert_eq!(a.check_invariants(), Ok(()));
        assert!(a.backend().violations().is_empty());
    }
    assert_eq!(
        on.memory_stats().num_device_free,
        off.memory_stats().num_device_free
    );
}

/// Runs `ops` (no injected faults: the helper's unmaps are device calls made later, so a fault
/// would hit another call) on two simulated devices alike but for the unmap helper, event
/// queries answered `lag` times late, and checks that the program sees the same cache: the same
/// allocations, statistics, page loans and reserved bytes after every step, and the same
/// statistics once drained.
fn same_with_and_without_helper(
    config: &str,
    capacity_mib: usize,
    lag: u32,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let [mut off, mut on] = [false, true].map(|helper| {
        let run = Run::new(capacity_mib, AllocatorConfig::parse(config).unwrap());
        run.a.backend().set_event_query_lag(lag);
        run.a.backend().set_unmap_helper(helper);
        run
    });
    for (i, op) in ops.iter().enumerate() {
        off.step(op)?;
        on.step(op)?;
        on.check()?;
        prop_assert_eq!(
            off.live.keys().collect::<Vec<_>>(),
            on.live.keys().collect::<Vec<_>>(),
            "allocations after step {} ({:?})",
            i,
            op
        );
        prop_assert_eq!(
            off.a.memory_stats(),
            on.a.memory_stats(),
            "statistics after step {} ({:?})",
            i,
            op
        );
        prop_assert_eq!(off.a.page_loans(), on.a.page_loans(), "step {}", i);
        prop_assert_eq!(off.a.memory_handles(), on.a.memory_handles(), "step {}", i);
    }
    off.drain()?;
    on.drain()?;
    prop_assert_eq!(off.a.memory_stats(), on.a.memory_stats());
    prop_assert_eq!(off.a.page_loans(), on.a.page_loans());
    Ok(())
}

/// Fences are polled before a growth plans while loans of pending pages are left, as without
/// the helper: a loan the helper had just unmapped used to skip that poll, so with event
/// queries answered late a fence was seen complete one query later than without the helper and
/// the next growth lent a page it would have moved (a page loan more, found by an adversarial
/// review comparing programs with and without the helper).
#[test]
fn fences_are_polled_before_a_growth_as_without_the_helper() {
    let ops = [
        Op::Alloc {
            size: 2 * MIB + 1,
            stream: 0,
        },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 8 * MIB + 1,
            stream: 0,
        },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 20 * MIB + 1,
            stream: 1,
        },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 12 * MIB + 1,
            stream: 0,
        },
        Op::CompleteWork { stream: 0 },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 12 * MIB + 1,
            stream: 1,
        },
        Op::Alloc {
            size: 2 * MIB + 1,
            stream: 1,
        },
    ];
    let config = "cca_preset:default,cca_handle_per_growth:True,cca_max_handle_size_mb:16,\
                  cca_page_move_budget:0";
    same_with_and_without_helper(config, 40, 2, &ops).unwrap();
}

/// A segment whose pages a growth moved away, their unmaps left to the helper, is wholly free
/// for a cross-stream handover (`cca_cross_stream_reuse`) as it is without the helper: the old
/// ranges of idle moves used to count as lent, so another stream grew instead of taking it.
#[test]
fn a_segment_whose_pages_moved_is_handed_over_as_without_the_helper() {
    let config = "cca_preset:default,cca_cross_stream_reuse:True";
    let [off, on] = with_and_without_helper(config, 64);
    for a in [&off, &on] {
        // Stream 0's segment: 2 MiB held (so that stream 1 does not take the segment whole),
        // 22 MiB freed (no work queued: idle once a fence shows it).
        let x = a.allocate(2 * MIB, StreamId::DEFAULT).unwrap();
        let w = a.allocate(22 * MIB, StreamId::DEFAULT).unwrap();
        a.free(w.ptr).unwrap();
        // Stream 1's growth moves some of stream 0's idle pages (under the peak, no slack).
        let y = a.allocate(8 * MIB, StreamId(1)).unwrap();
        assert_eq!(a.unmaps_handed_off() > 0, a.backend().unmaps_off_thread());
        a.free(x.ptr).unwrap();
        // Stream 2 has nothing: it takes stream 0's segment, wholly free now.
        let z = a.allocate(2 * MIB, StreamId(2)).unwrap();
        a.free(z.ptr).unwrap();
        a.free(y.ptr).unwrap();
    }
    assert_eq!(off.cross_stream_handovers(), 1);
    assert_eq!(on.cross_stream_handovers(), off.cross_stream_handovers());
    assert_eq!(on.memory_stats(), off.memory_stats());
    for a in [&off, &on] {
        assert_eq!(a.check_invariants(), Ok(()));
        a.empty_cache().unwrap();
        assert!(a.backend().live_mappings().is_empty());
        assert!(a.backend().violations().is_empty());
        assert_eq!(a.check_invariants(), Ok(()));
    }
}

/// A stream whose every page moved to another stream's segment, their unmaps left to the
/// helper, is no longer referenced by the cache (`forget_stream`), as without the helper: the
/// old ranges of idle moves used to keep it referenced until the next growth.
#[test]
fn a_stream_whose_pages_all_moved_can_be_forgotten_as_without_the_helper() {
    let config = "cca_preset:default,cca_page_reuse_slack:0";
    let [off, on] = with_and_without_helper(config, 64);
    for a in [&off, &on] {
        let x = a.allocate(16 * MIB, StreamId(2)).unwrap();
        a.free(x.ptr).unwrap();
        // No slack for new pages: stream 1's growth takes every page of stream 2's segment.
        let y = a.allocate(16 * MIB, StreamId(1)).unwrap();
        assert_eq!(a.unmaps_handed_off() > 0, a.backend().unmaps_off_thread());
        assert!(
            a.forget_stream(StreamId(2), || true),
            "helper {}",
            a.backend().unmaps_off_thread()
        );
        assert_eq!(a.check_invariants(), Ok(()));
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        assert!(a.backend().live_mappings().is_empty());
        assert!(a.backend().violations().is_empty());
    }
    assert_eq!(on.memory_stats(), off.memory_stats());
}

/// Best fit's growable room (the unmapped block after a free block, `docs/algorithm.md` step
/// 20) counts the old ranges of idle moves whose unmaps the helper has not given back as the
/// unmapped room they are without the helper: counted as nothing, an allocation between two
/// growths took another free block with the helper than without it (found by a random program
/// run with and without the helper, shrunk to these steps).
#[test]
fn best_fit_counts_a_moved_range_as_room_to_grow_as_without_the_helper() {
    let ops = [
        Op::Alloc { size: 1, stream: 0 },
        Op::Free { pick: 0 },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: MIB + 1,
            stream: 0,
        },
        Op::Alloc {
            size: MIB + 1,
            stream: 1,
        },
        Op::Alloc { size: 1, stream: 0 },
        Op::Free { pick: 0 },
        Op::Free { pick: 0 },
        Op::Free { pick: 0 },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 14 * MIB + 1,
            stream: 1,
        },
        Op::Free { pick: 0 },
        Op::Alloc {
            size: 12 * MIB + 1,
            stream: 0,
        },
        Op::Use { pick: 0 },
        Op::Alloc {
            size: MIB + 1,
            stream: 0,
        },
        Op::Alloc { size: 1, stream: 0 },
        Op::Alloc {
            size: 6099457,
            stream: 0,
        },
        Op::Use { pick: 0 },
        Op::Alloc { size: 1, stream: 1 },
        Op::Alloc {
            size: 1239041,
            stream: 0,
        },
        Op::Free {
            pick: 3076541447885946615,
        },
        Op::Alloc {
            size: MIB + 1,
            stream: 0,
        },
        Op::Alloc {
            size: 15202305,
            stream: 1,
        },
        Op::Alloc { size: 1, stream: 1 },
        Op::Alloc { size: 1, stream: 1 },
        Op::Alloc { size: 1, stream: 0 },
        Op::Free {
            pick: 1174227166084976997,
        },
        Op::Free {
            pick: 1807415970794177292,
        },
        Op::Alloc {
            size: 24643073,
            stream: 1,
        },
        Op::Free {
            pick: 8774341153693122227,
        },
        Op::Alloc {
            size: 6 * MIB + 1,
            stream: 1,
        },
        Op::EmptyCache,
        Op::Alloc { size: 1, stream: 1 },
        Op::Free {
            pick: 9042486527942031427,
        },
        Op::UseJoined {
            pick: 6539017075919210628,
            stream: 2,
        },
        Op::Alloc {
            size: 9353217,
            stream: 0,
        },
        Op::Alloc { size: 1, stream: 1 },
        Op::Free {
            pick: 1566143484617608468,
        },
        Op::Free {
            pick: 13489654759869857835,
        },
        Op::Free {
            pick: 1548932179873471236,
        },
        Op::Free {
            pick: 7954775634543290596,
        },
        Op::Alloc {
            size: 10 * MIB + 1,
            stream: 1,
        },
        Op::Free {
            pick: 12824158351830224,
        },
        Op::Free {
            pick: 9551943647819277301,
        },
        Op::Alloc { size: 1, stream: 0 },
        Op::Alloc {
            size: 13632513,
            stream: 0,
        },
        Op::Alloc {
            size: MIB + 1,
            stream: 1,
        },
    ];
    same_with_and_without_helper("cca_preset:default,cca_fast_path:False", 122, 0, &ops).unwrap();
}

/// A graph capture begun while the helper's jobs are queued: the capture's growths (private
/// pool, no page reuse) and a growth of the default pools on another stream map nothing over the
/// old ranges (they stay lent: no growth waits for the helper during a capture) and take no
/// handle still mapped there; after the capture the next growth takes the jobs back and
/// `empty_cache` releases everything.
#[test]
fn a_capture_begun_while_unmaps_are_queued_leaves_the_old_ranges_alone() {
    let (a, held) = pages_moved_off_thread(96 * MIB, 16 * MIB);
    let sim = a.backend();
    let queued: usize =
        sim.live_mappings().iter().map(|m| m.1).sum::<usize>() - a.memory_reserved() as usize;
    assert!(queued > 0);
    let pool = MemPoolId(0, 7);
    a.begin_allocate_to_pool(pool, Box::new(|s| s == StreamId(3)))
        .unwrap();
    // Each fills the device until it is out of memory (a map over a queued range, or a
    // handle released while mapped, would be a device error instead).
    let fill = |size: usize, stream: StreamId| {
        let mut got = Vec::new();
        loop {
            match a.allocate(size, stream) {
                Ok(c) => got.push(c),
                Err(e) => {
                    assert!(e.is_out_of_memory(), "{e}");
                    return got;
                }
            }
        }
    };
    let captured = fill(4 * MIB, StreamId(3));
    let other = fill(2 * MIB, StreamId(2));
    assert!(!captured.is_empty());
    assert_eq!(a.check_invariants(), Ok(()));
    // The old ranges are still mapped: the capture waited for no helper job.
    let held_bytes: usize = sim
        .live_mappings()
        .iter()
        .chain(&sim.live_segments())
        .map(|m| m.1)
        .sum();
    assert_eq!(held_bytes - a.memory_reserved() as usize, queued);
    a.end_allocate_to_pool(pool).unwrap();
    for c in captured.into_iter().chain(other).chain(held) {
        a.free(c.ptr).unwrap();
    }
    a.release_pool(pool).unwrap();
    a.empty_cache().unwrap();
    assert!(sim.live_mappings().is_empty());
    assert_eq!(sim.counters().reserved_bytes, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert!(
        sim.capture_violations().is_empty(),
        "{:?}",
        sim.capture_violations()
    );
    assert_eq!(a.check_invariants(), Ok(()));
}
