//! Property tests: random programs of operations (alloc / free / empty_cache / set_fraction /
//! record_stream on several streams, with injected device faults) run against a model of the live
//! allocations. After every step: the invariants hold; no two live allocations overlap; each lies
//! inside a live device segment; the stats identities hold.

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::programs::{Mix, Run, random_program};

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

/// The common checks plus the statistics' identities.
fn check_model(run: &Run) -> Result<(), TestCaseError> {
    run.check()?;
    let st = run.a.memory_stats();
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
        ops in random_program(Mix { min_size: 0, all_streams: false, event_faults: false, uses: false }),
    ) {
        let mut run = Run::new(capacity_mib, config);
        for op in &ops {
            run.step(op)?;
            check_model(&run)?;
        }
        run.drain()?;
        check_model(&run)?;
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
