//! Fuzz target `ops`: arbitrary programs of allocator operations (alloc / free / double free /
//! foreign free / empty_cache / set_fraction / record_stream on several streams, with injected
//! device faults) on a small simulated device, under every configuration family. After every step
//! the invariant checker runs (the `invariant-checks` feature panics on a violation) and a model of
//! the live allocations must agree with the allocator: no overlap, every block inside a device
//! segment, stats identities.
#![no_main]

use std::collections::BTreeMap;

use cuda_caching_allocator::{
    Allocation, AllocatorConfig, CachingAllocator, DevicePtr, FaultKind, SimDevice, StatType, StreamId,
};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const MIB: usize = 1 << 20;
const CONFIGS: [&str; 10] = [
    "",
    "max_split_size_mb:20",
    "roundup_power2_divisions:[1:2,4:4,>:8],max_non_split_rounding_mb:24",
    "garbage_collection_threshold:0.5",
    "expandable_segments:True",
    "large_segment_size_mb:12,roundup_power2_divisions:4",
    // The crate's default (AllocatorConfig::default()), and page reuse in multi-page handles.
    "expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device,cca_page_reuse_slack:0.01,cca_precise_cap:True",
    "expandable_segments:True,cca_large_page_size_mb:4,cca_max_handle_size_mb:12,cca_page_reuse:segment",
    // Cross-stream reuse, with fixed segments and with the default.
    "max_split_size_mb:24,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_cross_stream_reuse:True",
];

fn size(u: &mut Unstructured) -> Result<usize> {
    Ok(match u.int_in_range(0..=9u8)? {
        0 => 0,
        1..=4 => u.int_in_range(1..=65536)?,
        5..=7 => u.int_in_range(65536..=(3 * MIB))?,
        8 => u.int_in_range((3 * MIB)..=(24 * MIB))?,
        _ => u.int_in_range((24 * MIB)..=(80 * MIB))?,
    })
}

fn check(a: &CachingAllocator<SimDevice>, live: &BTreeMap<u64, Allocation>) {
    a.check_invariants().expect("invariants");
    let segments = a.backend().live_segments();
    let mappings = a.backend().live_mappings();
    let mut prev_end = 0;
    for x in live.values() {
        assert!(x.ptr.0 >= prev_end, "overlapping allocations");
        prev_end = x.ptr.0 + x.block_size as u64;
        let inside = |ranges: &[(DevicePtr, usize)]| {
            ranges.iter().any(|&(b, s)| x.ptr.0 >= b.0 && prev_end <= b.0 + s as u64)
        };
        assert!(inside(&segments) || !mappings.is_empty(), "allocation outside every segment");
    }
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current as usize, live.len());
    assert_eq!(st.memory_allocated() as usize, live.values().map(|x| x.block_size).sum::<usize>());
    assert!(st.memory_allocated() <= st.memory_reserved());
    assert_eq!(st.memory_reserved() as usize, a.backend().counters().reserved_bytes);
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let config = AllocatorConfig::parse(CONFIGS[u.int_in_range(0..=CONFIGS.len() - 1)?]).expect("config");
    let capacity = u.int_in_range(32..=256usize)? * MIB;
    let a = CachingAllocator::new(SimDevice::with_capacity(capacity), config).expect("allocator");
    let mut live: BTreeMap<u64, Allocation> = BTreeMap::new();
    let mut freed: Vec<DevicePtr> = Vec::new();
    for _ in 0..u.int_in_range(1..=200u32)? {
        match u.int_in_range(0..=11u8)? {
            0..=4 => {
                let s = size(&mut u)?;
                let stream = StreamId(u.int_in_range(0..=2)?);
                match a.allocate(s, stream) {
                    Ok(x) if x.ptr.is_null() => assert_eq!(s, 0),
                    Ok(x) => assert!(live.insert(x.ptr.0, x).is_none(), "pointer handed out twice"),
                    Err(e) => assert!(e.is_out_of_memory() || e.to_string().contains("device call"), "{e}"),
                }
            }
            5..=7 if !live.is_empty() => {
                let k = *live.keys().nth(u.choose_index(live.len())?).expect("key");
                let x = live.remove(&k).expect("live");
                a.free(x.ptr).expect("free of a live allocation");
                freed.push(x.ptr);
            }
            8 if !freed.is_empty() => {
                let p = freed[u.choose_index(freed.len())?];
                if !live.contains_key(&p.0) {
                    assert!(a.free(p).is_err(), "double free accepted");
                }
                assert!(a.free(DevicePtr(u.int_in_range(1..=4096u64)?)).is_err());
            }
            9 => {
                let _ = a.empty_cache();
            }
            10 => {
                let f = if u.arbitrary()? { 1.0 } else { f64::from(u.int_in_range(5..=100u8)?) / 100.0 };
                a.set_memory_fraction(f).expect("fraction");
            }
            _ => match u.int_in_range(0..=3u8)? {
                0 => a.backend().fail_next_call(if u.arbitrary()? { FaultKind::OutOfMemory } else { FaultKind::Error }),
                1 if !live.is_empty() => {
                    let x = *live.values().nth(u.choose_index(live.len())?).expect("live");
                    let s = StreamId(u.int_in_range(0..=3)?);
                    a.backend().submit_work(s);
                    a.record_stream(x.ptr, s).expect("record_stream");
                }
                _ => a.backend().complete_work(StreamId(u.int_in_range(0..=3)?)),
            },
        }
        check(&a, &live);
    }
    a.backend().clear_faults();
    for x in std::mem::take(&mut live).into_values() {
        a.free(x.ptr).expect("final free");
    }
    a.empty_cache().expect("final empty_cache");
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    check(&a, &live);
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
