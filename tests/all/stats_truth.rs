//! Do the statistics tell the truth under the crate's own policies? Random programs (several
//! streams, `record_stream`, queued uses, an event-query lag, faults, peak resets) under the
//! default configuration and its variants, checking after every step that `memory_stats()`,
//! `snapshot()`, `fragmentation()` and the device's own books agree: the snapshot's blocks
//! recount the allocation, active, requested, inactive-split, segment and oversize counters;
//! the snapshot's segments plus spare pages are the reserved bytes and lie in device memory;
//! fragmentation's parts sum to the reserved bytes; peaks are the largest values reached since
//! the last reset. Written by an adversarial review of the statistics.
use std::collections::BTreeMap;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Op, Run, random_program};

const CONFIGS: &[&str] = &[
    "cca_preset:default",
    "cca_preset:default,cca_fast_path:False",
    "cca_preset:default,cca_cross_stream_reuse:True,cca_borrow_blocks:True",
    "cca_preset:default,cca_page_move_budget:0,cca_page_reuse_slack:0",
    "cca_preset:default,cca_large_page_size_mb:4,cca_max_handle_size_mb:12",
    "cca_preset:default,max_split_size_mb:20",
    "cca_preset:default,expandable_segments:False",
    "cca_preset:default,expandable_segments:False,max_split_size_mb:20",
    "cca_preset:pytorch",
];

/// Per pool (`all`, small, large) sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct P3([i64; 3]);

impl P3 {
    fn add(&mut self, pool: PoolKind, n: i64) {
        self.0[0] += n;
        self.0[match pool {
            PoolKind::Small => 1,
            PoolKind::Large => 2,
        }] += n;
    }
}

fn cur(a: &StatArray) -> P3 {
    P3([
        a.get(StatType::All).current,
        a.get(StatType::SmallPool).current,
        a.get(StatType::LargePool).current,
    ])
}

/// Peaks a program must see: the largest allocated bytes (per pool) and device reserved bytes
/// after any step since the last reset.
#[derive(Default)]
struct Peaks {
    allocated: P3,
    reserved: i64,
}

fn check_truth(run: &Run, peaks: &mut Peaks) -> Result<(), TestCaseError> {
    let a = &run.a;
    let sim = a.backend();
    let st = a.memory_stats();
    let snap = a.snapshot();
    let max_split = st.get("max_split_size").unwrap();
    let max_split = if max_split < 0 { i64::MAX } else { max_split };

    // Recount from the snapshot.
    let (mut allocs, mut alloc_bytes) = (P3::default(), P3::default());
    let (mut active, mut active_bytes, mut requested) =
        (P3::default(), P3::default(), P3::default());
    let (mut segs, mut seg_bytes) = (P3::default(), P3::default());
    let (mut oversize_segs, mut oversize_allocs) = (0i64, 0i64);
    let mut largest_inactive = 0usize;
    let mut live_by_ptr = BTreeMap::new();
    for s in &snap {
        let n = s.total_size as i64;
        seg_bytes.add(s.pool, n);
        prop_assert_eq!(
            s.total_size,
            s.blocks.iter().map(|b| b.size).sum::<usize>(),
            "segment {} size is not its blocks'",
            s.address
        );
        if !s.is_expandable {
            segs.add(s.pool, 1);
            if n >= max_split {
                oversize_segs += 1;
            }
        }
        for b in &s.blocks {
            let size = b.size as i64;
            match b.state {
                BlockState::ActiveAllocated => {
                    allocs.add(s.pool, 1);
                    alloc_bytes.add(s.pool, size);
                    if size >= max_split {
                        oversize_allocs += 1;
                    }
                    live_by_ptr.insert(b.address.0, b.size);
                }
                BlockState::Inactive => largest_inactive = largest_inactive.max(b.size),
                _ => {}
            }
            if matches!(
                b.state,
                BlockState::ActiveAllocated | BlockState::ActivePendingFree
            ) {
                active.add(s.pool, 1);
                active_bytes.add(s.pool, size);
                requested.add(s.pool, b.requested_size as i64);
            }
        }
    }
    // The model's live allocations are the snapshot's allocated blocks.
    let model: BTreeMap<u64, usize> = run.live.values().map(|x| (x.ptr.0, x.block_size)).collect();
    prop_assert_eq!(&live_by_ptr, &model, "snapshot's allocated blocks");
    for (name, have, want) in [
        ("allocation", cur(&st.allocation), allocs),
        ("allocated_bytes", cur(&st.allocated_bytes), alloc_bytes),
        ("active", cur(&st.active), active),
        ("active_bytes", cur(&st.active_bytes), active_bytes),
        ("requested_bytes", cur(&st.requested_bytes), requested),
        ("segment", cur(&st.segment), segs),
    ] {
        prop_assert_eq!(have, want, "{} (all, small, large) vs the snapshot", name);
    }
    prop_assert_eq!(
        st.oversize_segments.current,
        oversize_segs,
        "oversize_segments"
    );
    prop_assert_eq!(
        st.oversize_allocations.current,
        oversize_allocs,
        "oversize_allocations"
    );

    // The device's books: fixed segments, mapped ranges.
    let dev_segs = sim.live_segments();
    prop_assert_eq!(
        dev_segs.len() as i64,
        st.segment.get(StatType::All).current,
        "device segments vs segment.all.current"
    );
    let mut ranges: Vec<(u64, u64)> = dev_segs
        .iter()
        .copied()
        .chain(sim.live_mappings())
        .map(|(p, s)| (p.0, p.0 + s as u64))
        .collect();
    ranges.sort_unstable();
    for s in &snap {
        let (lo, hi) = (s.address.0, s.address.0 + s.total_size as u64);
        let mut at = lo;
        for &(p, e) in &ranges {
            if p <= at && at < e {
                at = e;
            }
        }
        prop_assert!(
            at >= hi,
            "snapshot segment {} is not device memory",
            s.address
        );
    }

    // Fragmentation (flushes the front caches: the user's view must not move).
    let f = a.fragmentation();
    let st2 = a.memory_stats();
    // A flush merges front-cached blocks into the core, which then counts them as inactive
    // splits (docs/stats.md); nothing else may move.
    let strip = |m: BTreeMap<String, i64>| -> BTreeMap<String, i64> {
        m.into_iter()
            .filter(|(k, _)| !k.starts_with("inactive_split"))
            .collect()
    };
    prop_assert_eq!(
        strip(st2.to_map()),
        strip(st.to_map()),
        "memory_stats() changed across fragmentation()"
    );
    // Before the flush the core leaves front-cached blocks out of the inactive splits; after
    // it, the snapshot's free blocks in split fixed segments are exactly the inactive splits.
    let (mut split2, mut split_bytes2) = (P3::default(), P3::default());
    for s in a
        .snapshot()
        .iter()
        .filter(|s| !s.is_expandable && s.blocks.len() > 1)
    {
        for b in s.blocks.iter().filter(|b| b.state == BlockState::Inactive) {
            split2.add(s.pool, 1);
            split_bytes2.add(s.pool, b.size as i64);
        }
    }
    prop_assert_eq!(
        cur(&st2.inactive_split),
        split2,
        "inactive_split vs the snapshot"
    );
    prop_assert_eq!(
        cur(&st2.inactive_split_bytes),
        split_bytes2,
        "inactive_split_bytes vs the snapshot"
    );
    let reserved = st.memory_reserved();
    prop_assert_eq!(f.reserved_bytes as i64, reserved, "fragmentation reserved");
    prop_assert_eq!(
        f.allocated_bytes as i64,
        st.memory_allocated(),
        "fragmentation allocated"
    );
    prop_assert_eq!(
        f.pending_free_bytes as i64,
        st.active_bytes.get(StatType::All).current - st.memory_allocated(),
        "fragmentation pending"
    );
    prop_assert_eq!(
        f.allocated_bytes + f.pending_free_bytes + f.free_bytes + f.spare_bytes,
        f.reserved_bytes,
        "fragmentation parts"
    );
    prop_assert_eq!(
        seg_bytes.0[0] + f.spare_bytes as i64,
        reserved,
        "snapshot segments + spare pages vs reserved"
    );
    prop_assert_eq!(f.largest_free_block, largest_inactive, "largest free block");
    for (k, t) in [(1, StatType::SmallPool), (2, StatType::LargePool)] {
        prop_assert!(
            seg_bytes.0[k] <= st.reserved_bytes.get(t).current,
            "snapshot bytes of pool {:?} above its reserved bytes",
            t
        );
    }
    prop_assert_eq!(reserved as usize, sim.counters().reserved_bytes);

    // Peaks since the last reset.
    for (i, t) in StatType::ALL.into_iter().enumerate() {
        peaks.allocated.0[i] = peaks.allocated.0[i].max(st.allocated_bytes.get(t).current);
        prop_assert_eq!(
            st.allocated_bytes.get(t).peak,
            peaks.allocated.0[i],
            "allocated_bytes.{}.peak",
            t.name()
        );
    }
    peaks.reserved = peaks.reserved.max(reserved);
    // The device's peak may be higher: pages a growth created and released again when it failed
    // part-way were never reserved, as in PyTorch (docs/stats.md).
    let rp = st.reserved_bytes.get(StatType::All).peak;
    prop_assert!(
        rp >= peaks.reserved,
        "reserved peak {} below {}",
        rp,
        peaks.reserved
    );
    prop_assert!(
        rp as usize <= sim.counters().peak_reserved_bytes,
        "reserved peak {} above the device's {}",
        rp,
        sim.counters().peak_reserved_bytes
    );
    // Physical handles: one per fixed segment and per page handle held.
    let c = sim.counters();
    prop_assert_eq!(
        a.memory_handles().current,
        (c.live_segments as u64 + c.create_physical_calls - c.release_physical_calls) as i64,
        "memory_handles vs the device"
    );
    // Device calls behind num_device_alloc / num_device_free.
    prop_assert!(st.num_device_alloc as u64 >= c.allocate_calls);
    prop_assert!(st.num_device_alloc as u64 <= c.allocate_calls + c.map_calls);
    prop_assert!(st.num_device_free as u64 >= c.free_calls);
    prop_assert!(st.num_device_free as u64 <= c.free_calls + c.unmap_calls);
    prop_assert_eq!(
        c.map_calls > 0,
        st.num_device_alloc as u64 > c.allocate_calls
    );
    prop_assert_eq!(c.unmap_calls > 0, st.num_device_free as u64 > c.free_calls);
    for (name, s) in [
        ("allocated_bytes", &st.allocated_bytes),
        ("reserved_bytes", &st.reserved_bytes),
        ("allocation", &st.allocation),
        ("active", &st.active),
        ("active_bytes", &st.active_bytes),
        ("requested_bytes", &st.requested_bytes),
        ("segment", &st.segment),
        ("inactive_split", &st.inactive_split),
        ("inactive_split_bytes", &st.inactive_split_bytes),
    ] {
        for t in StatType::ALL {
            let x = s.get(t);
            prop_assert!(
                x.peak >= x.current,
                "{}.{}.peak below current",
                name,
                t.name()
            );
            prop_assert_eq!(
                x.current,
                x.allocated - x.freed,
                "{}.{}: current != allocated - freed",
                name,
                t.name()
            );
        }
    }
    Ok(())
}

/// An allocation as `Run::step` makes it; an out-of-memory error's figures must be the
/// statistics' and the free blocks' at the moment it is returned.
fn alloc_checked(run: &mut Run, size: usize, stream: StreamId) -> Result<(), TestCaseError> {
    let a = &run.a;
    match a.allocate(size, stream) {
        Ok(x) if x.ptr.is_null() => prop_assert_eq!(size, 0),
        Ok(x) => {
            a.backend().check_handout(x.stream, x.ptr, x.block_size);
            prop_assert!(run.live.insert(x.ptr.0, x).is_none());
        }
        Err(AllocError::OutOfMemory(r)) => {
            let st = a.memory_stats();
            prop_assert_eq!(
                r.allocated_bytes as i64,
                st.memory_allocated(),
                "OOM report allocated"
            );
            prop_assert_eq!(
                r.reserved_bytes as i64,
                st.memory_reserved(),
                "OOM report reserved"
            );
            let f = a.fragmentation();
            prop_assert_eq!(
                r.largest_free_block,
                f.largest_free_block,
                "OOM report largest free"
            );
            prop_assert!(r.allocated_bytes <= r.reserved_bytes);
        }
        Err(e) => prop_assert!(
            matches!(e, AllocError::Backend { .. }),
            "unexpected error {}",
            e
        ),
    }
    Ok(())
}

fn run_truth(
    config: AllocatorConfig,
    capacity_mib: usize,
    lag: u32,
    ops: &[(Op, bool)],
) -> Result<(), TestCaseError> {
    let mut run = Run::new(capacity_mib, config);
    run.a.backend().set_event_query_lag(lag);
    let mut peaks = Peaks::default();
    for (op, reset) in ops {
        if *reset {
            run.a.reset_peak_stats();
            let st = run.a.memory_stats();
            for (i, t) in StatType::ALL.into_iter().enumerate() {
                peaks.allocated.0[i] = st.allocated_bytes.get(t).current;
            }
            peaks.reserved = st.memory_reserved();
        }
        match *op {
            Op::Alloc { size, stream } => alloc_checked(&mut run, size, StreamId(stream))?,
            _ => run.step(op)?,
        }
        run.check()?;
        check_truth(&run, &mut peaks)?;
    }
    run.drain()?;
    check_truth(&run, &mut peaks)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    #[test]
    fn stats_tell_the_truth(
        config in proptest::sample::select(CONFIGS),
        capacity_mib in 32usize..200,
        lag in 0u32..3,
        ops in random_program(Mix { min_size: 1, all_streams: true, event_faults: true, uses: true })
            .prop_flat_map(|ops| {
                let n = ops.len();
                (Just(ops), proptest::collection::vec(proptest::bool::weighted(0.05), n))
            })
            .prop_map(|(ops, resets)| ops.into_iter().zip(resets).collect::<Vec<_>>()),
    ) {
        run_truth(AllocatorConfig::parse(config).unwrap(), capacity_mib, lag, &ops)?;
    }
}
