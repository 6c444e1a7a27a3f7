//! The acceptance test of the `pytorch-expandable` preset: replaying each real training
//! trace (snapshot pickle and RMM CSV log) gives PyTorch 2.11's own figures with
//! `expandable_segments:True` exactly: peak reserved and allocated bytes and all 122
//! `memory_stats()` values at the end of the run, whatever the placement of the address
//! reservations (recorded addresses, fresh increasing ones, or decreasing ones).
#![cfg(feature = "trace-io")]

use std::cell::Cell;
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

#[derive(Clone, Copy, Debug)]
enum Where {
    Recorded,
    Increasing,
    Decreasing,
}

fn run(trace: &Trace, placement: Where) -> ReplayReport {
    let alloc =
        CachingAllocator::new(SimDevice::default(), Preset::PytorchExpandable.config()).unwrap();
    let dev = alloc.backend();
    let opts = |placement| ReplayOptions {
        placement,
        ..ReplayOptions::default()
    };
    let r = match placement {
        Where::Recorded => replay(&alloc, trace, &opts(Placement::AddressFaithful)),
        Where::Increasing => replay(&alloc, trace, &opts(Placement::Fresh)),
        Where::Decreasing => {
            // Each new reservation goes 128 GiB below the previous one.
            let seen = Cell::new(0u64);
            let hint = |_: Option<u64>| {
                let calls = dev.counters().reserve_calls;
                seen.set(seen.get().max(calls));
                dev.place_next_at(0x7fff_0000_0000 - (seen.get() + 1) * (128 << 30));
            };
            replay_with(
                &alloc,
                trace,
                &opts(Placement::AddressFaithful),
                Some(&hint),
            )
        }
    }
    .unwrap();
    alloc.check_invariants().unwrap();
    if let Where::Decreasing = placement {
        // The reservations really went to the top of the address space, one below the other.
        let bases: Vec<u64> = alloc.snapshot().iter().map(|s| s.address.0).collect();
        assert!(!bases.is_empty());
        assert!(
            bases
                .iter()
                .all(|&b| b >= 0x7fff_0000_0000 - 2 * (128 << 30))
        );
    }
    r
}

fn assert_exact(name: &str, source: &str, r: &ReplayReport, want: &serde_json::Value) {
    let d = &want["pytorch_expandable"];
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
fn pytorch_expandable_reproduces_pytorch_from_the_csv_logs_at_any_placement() {
    let refs = reference();
    for name in TRACES {
        let trace = load(&shipped(&format!("{name}.csv.gz")));
        for placement in [Where::Recorded, Where::Increasing, Where::Decreasing] {
            let r = run(&trace, placement);
            assert_exact(
                name,
                &format!("csv, {placement:?}"),
                &r,
                &refs["traces"][name],
            );
        }
    }
}

#[test]
fn pytorch_expandable_reproduces_pytorch_from_the_snapshot_pickles() {
    let refs = reference();
    for name in TRACES {
        let path = shipped(&format!("{name}.pickle.gz"));
        let trace = load(&path);
        let r = run(&trace, Where::Recorded);
        assert_exact(name, "pickle", &r, &refs["traces"][name]);
    }
}
