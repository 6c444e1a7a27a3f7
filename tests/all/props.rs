//! Property tests: random programs of operations (alloc / free / empty_cache / set_fraction /
//! record_stream on several streams, with injected device faults) run against a model of the live
//! allocations. After every step: the invariants hold; no two live allocations overlap; each lies
//! inside a live device segment; the stats identities hold.

use std::collections::BTreeMap;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::MIB;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, stream: u64 },
    Free { pick: usize },
    EmptyCache,
    SetFraction { fraction: f64 },
    RecordStream { pick: usize, stream: u64 },
    CompleteWork { stream: u64 },
    FailNextCall { oom: bool },
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..=4096,
        3 => 4096usize..=(MIB + 4096),
        2 => MIB..=(12 * MIB),
        1 => (10 * MIB)..=(48 * MIB),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::EmptyCache),
        1 => prop_oneof![Just(1.0), 0.05f64..1.0].prop_map(|fraction| Op::SetFraction { fraction }),
        2 => (any::<usize>(), 0u64..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0u64..4).prop_map(|stream| Op::CompleteWork { stream }),
        1 => any::<bool>().prop_map(|oom| Op::FailNextCall { oom }),
    ]
}

fn config_strategy() -> impl Strategy<Value = AllocatorConfig> {
    prop_oneof![
        Just("".to_string()),
        Just("max_split_size_mb:24".to_string()),
        Just("roundup_power2_divisions:4".to_string()),
        Just("roundup_power2_divisions:[1:2,8:4,>:8],max_non_split_rounding_mb:24".to_string()),
        Just("garbage_collection_threshold:0.4,max_split_size_mb:20".to_string()),
        Just("large_segment_size_mb:12".to_string()),
    ]
    .prop_map(|s| AllocatorConfig::parse(&s).unwrap())
}

fn check_model(
    a: &CachingAllocator<SimDevice>,
    live: &BTreeMap<u64, Allocation>,
) -> Result<(), TestCaseError> {
    if let Err(v) = a.check_invariants() {
        return Err(TestCaseError::fail(format!("invariant: {v}")));
    }
    let segments = a.backend().live_segments();
    let mut prev_end = 0u64;
    for x in live.values() {
        prop_assert!(x.ptr.0 >= prev_end, "live allocations overlap at {}", x.ptr);
        prev_end = x.ptr.0 + x.block_size as u64;
        let inside = segments
            .iter()
            .any(|&(base, size)| x.ptr.0 >= base.0 && prev_end <= base.0 + size as u64);
        prop_assert!(inside, "{} lies outside every device segment", x.ptr);
        prop_assert!(x.block_size >= x.size);
    }
    let st = a.memory_stats();
    prop_assert_eq!(
        st.allocation.get(StatType::All).current as usize,
        live.len()
    );
    prop_assert_eq!(
        st.memory_allocated() as usize,
        live.values().map(|x| x.block_size).sum::<usize>()
    );
    prop_assert!(st.memory_allocated() <= st.memory_reserved());
    prop_assert_eq!(
        st.memory_reserved() as usize,
        a.backend().counters().reserved_bytes
    );
    for arr in [
        &st.allocated_bytes,
        &st.reserved_bytes,
        &st.active_bytes,
        &st.requested_bytes,
        &st.segment,
    ] {
        for t in StatType::ALL {
            let s = arr.get(t);
            prop_assert!(s.peak >= s.current && s.current >= 0);
            prop_assert_eq!(s.allocated - s.freed, s.current);
        }
    }
    prop_assert!(
        st.requested_bytes.get(StatType::All).current <= st.active_bytes.get(StatType::All).current
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(96),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_programs_keep_the_allocator_consistent(
        config in config_strategy(),
        capacity_mib in 64usize..400,
        ops in proptest::collection::vec(op_strategy(), 1..160),
    ) {
        let a = CachingAllocator::new(SimDevice::with_capacity(capacity_mib * MIB), config).unwrap();
        let mut live: BTreeMap<u64, Allocation> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Alloc { size, stream } => match a.allocate(size, StreamId(stream)) {
                    Ok(x) if x.ptr.is_null() => prop_assert_eq!(size, 0),
                    Ok(x) => {
                        prop_assert!(live.insert(x.ptr.0, x).is_none(), "pointer handed out twice");
                    }
                    Err(e) => prop_assert!(
                        e.is_out_of_memory() || matches!(e, AllocError::Backend { .. }),
                        "unexpected error {}", e
                    ),
                },
                Op::Free { pick } => {
                    if !live.is_empty() {
                        let key = *live.keys().nth(pick % live.len()).unwrap();
                        let x = live.remove(&key).unwrap();
                        a.free(x.ptr).unwrap();
                        let double_free = a.free(x.ptr).is_err();
                        prop_assert!(double_free, "double free accepted");
                    }
                }
                Op::EmptyCache => {
                    let _ = a.empty_cache();
                }
                Op::SetFraction { fraction } => a.set_memory_fraction(fraction).unwrap(),
                Op::RecordStream { pick, stream } => {
                    if !live.is_empty() {
                        let x = *live.values().nth(pick % live.len()).unwrap();
                        a.backend().submit_work(StreamId(stream));
                        a.record_stream(x.ptr, StreamId(stream)).unwrap();
                    }
                }
                Op::CompleteWork { stream } => a.backend().complete_work(StreamId(stream)),
                Op::FailNextCall { oom } => a.backend().fail_next_call(if oom { FaultKind::OutOfMemory } else { FaultKind::Error }),
            }
            check_model(&a, &live)?;
        }
        a.backend().clear_faults();
        for x in std::mem::take(&mut live).into_values() {
            a.free(x.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        prop_assert_eq!(a.memory_stats().memory_reserved(), 0);
        prop_assert_eq!(a.backend().counters().live_segments, 0);
        check_model(&a, &live)?;
    }

    #[test]
    fn size_class_laws(size in 1usize..(1usize << 40), divisions in prop_oneof![Just(0usize), Just(1), Just(2), Just(4), Just(8), Just(16)]) {
        let c = AllocatorConfig::builder().roundup_power2_divisions(divisions).build().unwrap();
        let r = round_size(size, &c);
        prop_assert!(r >= size);
        prop_assert_eq!(r % 512, 0);
        prop_assert_eq!(round_size(r, &c), r, "rounding is idempotent");
        prop_assert!(round_size(size + 1, &c) >= r, "rounding is monotonic");
        let seg = size_class::segment_size(r, &c);
        prop_assert!(seg >= r);
    }
}
