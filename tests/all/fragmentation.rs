//! The fragmentation report (identities, histogram, metrics, text), its place in the replay
//! report, and the waste goal of the default configuration: peak reserved at most 1.03 × peak
//! live bytes on the synthetic stress traces and on the real traces shipped in `examples/traces`.

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::*;

use crate::util::{MIB, with_config};

#[test]
fn report_accounts_for_every_reserved_byte() {
    let a = with_config(1 << 30, AllocatorConfig::pytorch());
    let x = a.allocate(3 * MIB, StreamId(0)).unwrap();
    let y = a.allocate(5 * MIB, StreamId(0)).unwrap();
    let z = a.allocate(1000, StreamId(0)).unwrap();
    let w = a.allocate(1000, StreamId(0)).unwrap();
    a.free(x.ptr).unwrap();
    a.free(z.ptr).unwrap();
    let r = a.fragmentation();
    // One 20 MiB large segment: [x free 3][y 5][free 12]; one 2 MiB small segment:
    // [z free 1024][w 1024][free].
    assert_eq!(r.reserved_bytes, 22 * MIB);
    assert_eq!(r.allocated_bytes, 5 * MIB + 1024);
    assert_eq!(r.requested_bytes, 5 * MIB + 1000);
    assert_eq!(r.internal_waste(), 24);
    assert_eq!(r.free_blocks, 4);
    assert_eq!(r.largest_free_block, 12 * MIB);
    assert_eq!(
        r.reserved_bytes,
        r.allocated_bytes + r.pending_free_bytes + r.free_bytes + r.spare_bytes
    );
    assert_eq!(r.histogram.iter().map(|b| b.count).sum::<usize>(), 4);
    assert_eq!(
        r.histogram.iter().map(|b| b.bytes).sum::<usize>(),
        r.free_bytes
    );
    for b in &r.histogram {
        assert!(b.min_size.is_power_of_two() && b.count > 0);
    }
    let buckets: Vec<usize> = r.histogram.iter().map(|b| b.min_size).collect();
    assert_eq!(buckets, vec![1024, MIB, 2 * MIB, 8 * MIB]);
    let frag = 1.0 - r.allocated_bytes as f64 / r.reserved_bytes as f64;
    assert!((r.fragmentation() - frag).abs() < 1e-12);
    let ext = 1.0 - (12 * MIB) as f64 / r.free_bytes as f64;
    assert!((r.external_fragmentation() - ext).abs() < 1e-12);
    assert!(r.sawicki_fragmentation > 0.0 && r.sawicki_fragmentation < 1.0);
    let text = a.fragmentation_summary();
    for needle in [
        "Fragmentation report",
        "fragmentation 1 - allocated/reserved",
        "external fragmentation 1 - largest free/total free",
        "free blocks by size",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
    // PyTorch's table stays PyTorch's.
    assert!(!a.memory_summary(false).contains("Fragmentation"));
    a.free(y.ptr).unwrap();
    a.free(w.ptr).unwrap();
    let empty = a.fragmentation();
    assert_eq!(empty.allocated_bytes, 0);
    assert_eq!(empty.free_blocks, 2);
    assert_eq!(empty.external_fragmentation(), 1.0 - 20.0 / 22.0);
    a.empty_cache().unwrap();
    let none = a.fragmentation();
    assert_eq!(none, FragmentationReport::default());
    assert_eq!(none.fragmentation(), 0.0);
    assert_eq!(none.external_fragmentation(), 0.0);
}

#[test]
fn pending_frees_are_counted_apart() {
    let a = with_config(1 << 30, AllocatorConfig::default());
    let x = a.allocate(4 * MIB, StreamId(0)).unwrap();
    a.backend().submit_work(StreamId(3));
    a.record_stream(x.ptr, StreamId(3)).unwrap();
    a.free(x.ptr).unwrap();
    let r = a.fragmentation();
    assert_eq!(r.pending_free_bytes, 4 * MIB);
    assert_eq!(r.allocated_bytes, 0);
    assert_eq!(
        r.reserved_bytes,
        r.allocated_bytes + r.pending_free_bytes + r.free_bytes + r.spare_bytes
    );
}

#[test]
fn replay_reports_fragmentation_at_peak_reserved() {
    let trace = Workload::KvCacheGeneration.trace(3);
    let alloc = CachingAllocator::new(SimDevice::default(), AllocatorConfig::pytorch()).unwrap();
    let r = replay(&alloc, &trace, &ReplayOptions::default()).unwrap();
    let f = &r.fragmentation_at_peak;
    assert_eq!(f.reserved_bytes as u64, r.peak_reserved_bytes);
    assert_eq!(
        f.reserved_bytes,
        f.allocated_bytes + f.pending_free_bytes + f.free_bytes + f.spare_bytes
    );
    assert!(f.fragmentation() > 0.0);
}

/// Peak reserved over peak live bytes of `trace` under the default configuration.
fn default_ratio(trace: &trace::Trace) -> (f64, ReplayReport) {
    let alloc = CachingAllocator::new(SimDevice::default(), AllocatorConfig::default()).unwrap();
    let r = replay(&alloc, trace, &ReplayOptions::default()).unwrap();
    alloc.check_invariants().unwrap();
    (r.reserved_over_live(), r)
}

#[test]
fn default_wastes_at_most_three_percent_on_the_synthetic_stress_traces() {
    for w in Workload::ALL {
        for seed in [1, 2] {
            let (ratio, r) = default_ratio(&w.trace(seed));
            assert_eq!(r.num_ooms, 0, "{} seed {seed}", w.name());
            assert!(
                ratio <= 1.03,
                "{} seed {seed}: peak reserved {} is {ratio:.4} × peak live {}",
                w.name(),
                r.peak_reserved_bytes,
                r.peak_live_bytes
            );
        }
    }
}

#[test]
fn pytorch_wastes_more_than_the_default_on_the_synthetic_stress_traces() {
    for w in [Workload::TransformerVarlen, Workload::ManyStreams] {
        let trace = w.trace(1);
        let alloc =
            CachingAllocator::new(SimDevice::default(), AllocatorConfig::pytorch()).unwrap();
        let pytorch = replay(&alloc, &trace, &ReplayOptions::default()).unwrap();
        let (ours, _) = default_ratio(&trace);
        assert!(
            pytorch.reserved_over_live() > ours + 0.1,
            "{}: pytorch {:.3} vs default {ours:.3}",
            w.name(),
            pytorch.reserved_over_live()
        );
    }
}

#[cfg(feature = "trace-io")]
mod shared_traces {
    use std::path::PathBuf;

    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};

    use super::default_ratio;

    #[test]
    fn default_wastes_at_most_three_percent_on_the_shared_traces() {
        for name in ["gpt2_train", "resnet50_train", "bert_varlen"] {
            let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/traces"))
                .join(format!("{name}.pickle.gz"));
            let trace = read_trace_file(&path, &ImportOptions::strict())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .trace;
            let (ratio, r) = default_ratio(&trace);
            assert!(
                ratio <= 1.03,
                "{name}: peak reserved {} is {ratio:.4} × peak live {}",
                r.peak_reserved_bytes,
                r.peak_live_bytes
            );
        }
    }
}

#[path = "../../benches/support/table_rows.rs"]
mod table_rows;

/// The fragmentation table of `benches/README.md` (printed by `examples/fragmentation_table.rs`)
/// is what the code does today: every simulated row, shipped traces (from the CSV logs, which
/// give the pickles' figures) and synthetic ones at seed 1, appears in the README as it is
/// printed now. A change that moves a figure must regenerate the table.
#[cfg(feature = "trace-io")]
#[test]
fn the_readme_fragmentation_table_is_current() {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/README.md")).unwrap();
    let mut traces = Vec::new();
    for name in ["gpt2_train", "resnet50_train", "bert_varlen"] {
        let path = format!(
            "{}/examples/traces/{name}.csv.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        let t = read_trace_file(&path, &ImportOptions::strict())
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trace;
        traces.push((name.to_owned(), t));
    }
    for w in Workload::ALL {
        traces.push((format!("{} (seed 1)", w.name()), w.trace(1)));
    }
    let mut stale = Vec::new();
    for (name, trace) in &traces {
        for preset in [Preset::Pytorch, Preset::PytorchExpandable, Preset::Default] {
            let (_, line) = table_rows::row(name, trace, preset);
            if !readme.lines().any(|l| l == line) {
                stale.push(line);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "benches/README.md's fragmentation table lacks these rows (regenerate it with \
         `cargo run --release --example fragmentation_table --features trace-io`):\n{}",
        stale.join("\n")
    );
}

/// The cross-stream table of `benches/README.md` (printed by `examples/cross_stream_table.rs`)
/// lists `synth_many_streams` at seeds 1–4, the only workload that hands segments over: every
/// such row is what the code does today.
#[test]
fn the_readme_cross_stream_table_is_current() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/README.md")).unwrap();
    let mut stale = Vec::new();
    for seed in 1..=4 {
        let name = format!("{} (seed {seed})", Workload::ManyStreams.name());
        let trace = Workload::ManyStreams.trace(seed);
        for preset in [Preset::Pytorch, Preset::PytorchExpandable, Preset::Default] {
            for on in [false, true] {
                let line = table_rows::cross_stream_row(&name, &trace, preset, on);
                if !readme.lines().any(|l| l == line) {
                    stale.push(line);
                }
            }
        }
    }
    assert!(
        stale.is_empty(),
        "benches/README.md's cross-stream table lacks these rows (regenerate them with \
         `cargo run --release --example cross_stream_table --features trace-io -- many_streams`):\n{}",
        stale.join("\n")
    );
}
