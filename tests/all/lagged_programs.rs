//! Physical page reuse stays safe with a device running behind the host: random programs (the
//! full operation mix of `programs.rs`, event and synchronize faults included; many queued uses
//! for lent pages) under thirteen page-reuse configurations,
//! each with an event-query lag of 0 to 4 (`SimDevice::set_event_query_lag`), checked by the
//! device's hazard log, `check_handout` and the invariants after every step; plus directed
//! cases of lent pages, `record_stream` and chained loans checked by physical handle. Written by
//! an adversarial review of page fences and lending, which found no defect (`stream_safety`'s
//! threaded programs run lagged too).
use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Run, random_program};
use crate::util::{MIB, with_config};

pub(crate) const CONFIGS: &[&str] = &[
    "cca_preset:default",
    "cca_preset:default,cca_borrow_blocks:True",
    "cca_preset:default,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_fast_path:False",
    "cca_preset:default,cca_page_move_budget:0",
    "cca_preset:default,cca_page_move_budget:0,cca_page_reuse_slack:0",
    "cca_preset:default,cca_fast_path:True,cca_cross_stream_reuse:True,cca_borrow_blocks:True,cca_large_page_size_mb:4,cca_max_handle_size_mb:12",
    "cca_preset:default,cca_max_handle_size_mb:8,cca_page_move_budget:0",
    "cca_preset:default,cca_large_page_size_mb:4,cca_page_move_budget:0,cca_page_reuse_slack:0",
    "cca_preset:default,cca_min_growth_mb:8,cca_page_move_budget:0",
    "cca_preset:default,cca_handle_per_growth:True,cca_max_handle_size_mb:16,cca_page_move_budget:0",
    "cca_preset:default,cca_page_reuse:segment,cca_page_move_budget:0",
    "cca_preset:default,cca_cross_stream_reuse:True,cca_borrow_blocks:True,cca_page_move_budget:0,cca_page_reuse_slack:0",
];

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn lagged_programs(
        config in proptest::sample::select(CONFIGS).prop_map(|s| AllocatorConfig::parse(s).unwrap()),
        capacity_mib in 32usize..200,
        lag in 0u32..4,
        ops in random_program(Mix { min_size: 1, all_streams: true, event_faults: true, uses: true }),
    ) {
        let mut run = Run::new(capacity_mib, config);
        run.a.backend().set_event_query_lag(lag);
        run.run_checked(&ops)?;
    }
}

pub(crate) fn lending_heavy_ops() -> impl Strategy<Value = Vec<crate::programs::Op>> {
    use crate::programs::Op;
    let arms = prop_oneof![
        10 => ((1usize..=24 * MIB), 0u64..4).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        8 => any::<usize>().prop_map(|pick| Op::Use { pick }),
        3 => (any::<usize>(), 0u64..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (any::<usize>(), 0u64..4).prop_map(|(pick, stream)| Op::UseJoined { pick, stream }),
        2 => (0u64..4).prop_map(|stream| Op::CompleteWork { stream }),
        2 => (0u64..4).prop_map(|stream| Op::SubmitWork { stream }),
        1 => (0u8..3).prop_map(|call| Op::FailEvent { call }),
        1 => any::<bool>().prop_map(|oom| Op::FailNextCall { oom }),
        1 => Just(Op::EmptyCache),
    ];
    proptest::collection::vec(arms, 1..250)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn lending_heavy(
        config in proptest::sample::select(CONFIGS).prop_map(|s| AllocatorConfig::parse(s).unwrap()),
        capacity_mib in 40usize..160,
        lag in 0u32..3,
        ops in lending_heavy_ops(),
    ) {
        let mut run = Run::new(capacity_mib, config);
        run.a.backend().set_event_query_lag(lag);
        run.run_checked(&ops)?;
    }
}

// ---- directed scenarios (the brief's recipes), checked by hand as well as by the device ----

const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);
const S3: StreamId = StreamId(3);

/// Physical handles mapped under `[ptr, ptr + len)`.
fn handles_under(sim: &SimDevice, ptr: DeviceAddr, len: usize) -> Vec<PhysicalHandle> {
    sim.live_mapped_handles()
        .into_iter()
        .filter(|&(va, n, _)| va.0 < ptr.0 + len as u64 && ptr.0 < va.0 + n as u64)
        .map(|(_, _, h)| h)
        .collect()
}

/// A block whose work on S1 is still queued is freed; S2 grows. Whatever S2 gets that shares
/// physical memory with the old block must come with an S2 wait on an S1 event recorded after
/// the old use.
#[test]
fn lent_pages_are_waited_for() {
    for lag in [0, 3] {
        let a = with_config(1 << 30, AllocatorConfig::default());
        let sim = a.backend();
        sim.set_event_query_lag(lag);
        let x = a.allocate(32 * MIB, S1).unwrap();
        let used = sim.use_range(S1, x.ptr, x.size);
        let old = handles_under(sim, x.ptr, x.block_size);
        a.free(x.ptr).unwrap();
        let y = a.allocate(16 * MIB, S2).unwrap();
        let shared: Vec<_> = handles_under(sim, y.ptr, y.block_size)
            .into_iter()
            .filter(|h| old.contains(h))
            .collect();
        assert!(sim.has_pending_work(S1));
        assert!(
            !shared.is_empty(),
            "lag {lag}: the pending pages were lent (the case under test)"
        );
        {
            let ordered = sim.stream_waits().iter().any(|w| {
                w.stream == S2 && w.recorded.is_some_and(|(s, at)| s == S1 && at >= used.unit)
            });
            assert!(ordered, "lag {lag}: {shared:?} reused without a wait");
        }
        assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
        // empty_cache with the work still queued: it must wait, not unmap under it.
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        assert_eq!(sim.counters().reserved_bytes, 0);
    }
}

/// record_stream on S2 with S2's work queued: the block stays out of reuse until S2's event
/// completes, whatever S3 grows meanwhile (lending, reuse) and whatever events fail.
#[test]
fn record_stream_blocks_stay_out() {
    for fail in [
        None,
        Some(SimEventCall::Record),
        Some(SimEventCall::StreamWait),
    ] {
        let a = with_config(1 << 30, AllocatorConfig::default());
        let sim = a.backend();
        let x = a.allocate(32 * MIB, S1).unwrap();
        sim.use_range(S1, x.ptr, x.size);
        sim.use_range(S2, x.ptr, x.size);
        a.record_stream(x.ptr, S2).unwrap();
        a.free(x.ptr).unwrap();
        sim.complete_work(S1);
        if let Some(c) = fail {
            sim.fail_next_event_call(c);
        }
        let mut live = Vec::new();
        for s in [S3, S1, S3] {
            let y = a.allocate(12 * MIB, s).unwrap();
            assert!(sim.check_handout(y.stream, y.ptr, y.block_size), "{fail:?}");
            live.push(y);
        }
        assert!(
            sim.violations().is_empty(),
            "{fail:?}: {:?}",
            sim.violations()
        );
        a.check_invariants().unwrap();
        for y in live {
            a.free(y.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        assert!(sim.violations().is_empty());
    }
}

/// A chain of loans: S1's pending pages lent to S2, S2's block freed with its own work queued
/// and lent on to S3, S1 completing first or last; then settles and empty_cache.
#[test]
fn chained_loans() {
    for s1_first in [true, false] {
        let a = with_config(1 << 30, AllocatorConfig::default());
        let sim = a.backend();
        let x = a.allocate(32 * MIB, S1).unwrap();
        sim.use_range(S1, x.ptr, x.size);
        a.free(x.ptr).unwrap();
        let y = a.allocate(30 * MIB, S2).unwrap();
        assert!(sim.check_handout(y.stream, y.ptr, y.block_size));
        sim.use_range(S2, y.ptr, y.size);
        a.free(y.ptr).unwrap();
        if s1_first {
            sim.complete_work(S1);
        }
        let z = a.allocate(30 * MIB, S3).unwrap();
        assert!(sim.check_handout(z.stream, z.ptr, z.block_size));
        sim.use_range(S3, z.ptr, z.size);
        a.free(z.ptr).unwrap();
        let w = a.allocate(30 * MIB, S1).unwrap();
        assert!(sim.check_handout(w.stream, w.ptr, w.block_size));
        a.check_invariants().unwrap();
        a.free(w.ptr).unwrap();
        a.empty_cache().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        assert_eq!(sim.counters().reserved_bytes, 0);
        assert!(a.page_loans() >= 1);
    }
}
