//! The acceptance test of the `pytorch` preset: replaying each real training trace on the
//! simulated device, from the PyTorch snapshot pickle and from the RMM CSV log alike, gives
//! PyTorch 2.11's own peak reserved bytes, peak allocated bytes and peak segment count exactly,
//! and all 122 `memory_stats()` values at the end of the run.
#![cfg(feature = "trace-io")]

use std::path::PathBuf;

use cuda_caching_allocator::trace::{ImportOptions, Trace, read_trace_file};
use cuda_caching_allocator::*;

const TRACES: [&str; 3] = ["gpt2_train", "resnet50_train", "bert_varlen"];

fn shipped(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/traces")).join(name)
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(shipped("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(path: &PathBuf) -> Trace {
    read_trace_file(path, &ImportOptions::strict())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trace
}

fn run(trace: &Trace, placement: Placement) -> ReplayReport {
    let alloc = CachingAllocator::new(SimDevice::default(), AllocatorConfig::pytorch()).unwrap();
    let r = replay(
        &alloc,
        trace,
        &ReplayOptions {
            placement,
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    alloc.check_invariants().unwrap();
    r
}

fn assert_exact(name: &str, source: &str, r: &ReplayReport, want: &serde_json::Value) {
    let d = &want["pytorch_default"];
    let u = |v: &serde_json::Value| v.as_u64().unwrap();
    assert_eq!(
        r.peak_reserved_bytes,
        u(&d["peak_reserved_bytes"]),
        "{name} ({source}): peak reserved"
    );
    assert_eq!(
        r.peak_allocated_bytes,
        u(&d["peak_allocated_bytes"]),
        "{name} ({source}): peak allocated"
    );
    assert_eq!(
        r.segment_count_peak,
        u(&d["segment_count_peak"]),
        "{name} ({source}): peak segments"
    );
    assert_eq!(
        r.num_device_alloc,
        u(&d["num_device_alloc"]),
        "{name} ({source}): device allocs"
    );
    assert_eq!(
        r.peak_live_bytes,
        u(&want["peak_live_bytes"]),
        "{name} ({source}): peak live"
    );
    let ours = r.final_stats.to_map();
    let theirs = d["memory_stats"].as_object().unwrap();
    assert_eq!(ours.len(), theirs.len(), "{name}: key count");
    for (k, v) in theirs {
        assert_eq!(
            ours.get(k).copied(),
            v.as_i64(),
            "{name} ({source}): memory_stats[{k}]"
        );
    }
}

#[test]
fn pytorch_preset_reproduces_pytorch_from_the_csv_logs() {
    let refs = reference();
    for name in TRACES {
        let trace = load(&shipped(&format!("{name}.csv.gz")));
        assert_exact(
            name,
            "csv",
            &run(&trace, Placement::AddressFaithful),
            &refs["traces"][name],
        );
    }
}

#[test]
fn pytorch_preset_reproduces_pytorch_from_the_snapshot_pickles() {
    let refs = reference();
    for name in TRACES {
        let path = shipped(&format!("{name}.pickle.gz"));
        let trace = load(&path);
        assert_exact(
            name,
            "pickle",
            &run(&trace, Placement::AddressFaithful),
            &refs["traces"][name],
        );
    }
}

#[test]
fn fresh_placement_lands_within_a_tenth_of_a_percent() {
    let refs = reference();
    for name in TRACES {
        let trace = load(&shipped(&format!("{name}.csv.gz")));
        let r = run(&trace, Placement::Fresh);
        let want = refs["traces"][name]["pytorch_default"]["peak_reserved_bytes"]
            .as_u64()
            .unwrap() as f64;
        let off = (r.peak_reserved_bytes as f64 / want - 1.0).abs();
        // The shared README's "up to 0.1%" is rounded: its own bert_varlen figures
        // (9,403,629,568 instead of 9,414,115,328 reserved) are 0.111% apart.
        assert!(
            off <= 0.0012,
            "{name}: fresh placement is {:.4}% off",
            off * 100.0
        );
    }
}
