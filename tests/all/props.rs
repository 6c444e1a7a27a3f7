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

    /// Reading or resetting statistics changes no decision (Note [The policy's own peak]): the
    /// crate's default runs a random program twice, once with every statistics call a program
    /// can make after each operation, and hands out the same addresses and makes the same
    /// device calls.
    #[test]
    fn statistics_calls_change_no_decision(
        fast in any::<bool>(),
        capacity_mib in 64usize..400,
        ops in random_program(Mix { min_size: 0, all_streams: false, event_faults: false, uses: false }),
    ) {
        let config = AllocatorConfig::parse(if fast {
            "cca_preset:default"
        } else {
            "cca_preset:default,cca_fast_path:False"
        })
        .unwrap();
        let mut plain = Run::new(capacity_mib, config.clone());
        let mut probed = Run::new(capacity_mib, config);
        for (i, op) in ops.iter().enumerate() {
            plain.step(op)?;
            probed.step(op)?;
            let a = &probed.a;
            let _ = a.memory_stats();
            let _ = a.memory_reserved();
            match i % 3 {
                0 => a.reset_peak_stats(),
                1 => a.reset_accumulated_stats(),
                _ => {
                    let _ = a.snapshot();
                }
            }
            prop_assert_eq!(
                plain.live.keys().collect::<Vec<_>>(),
                probed.live.keys().collect::<Vec<_>>(),
                "live addresses differ after operation {} ({:?})",
                i,
                op
            );
        }
        prop_assert_eq!(
            plain.a.backend().counters().call_counts(),
            probed.a.backend().counters().call_counts()
        );
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
