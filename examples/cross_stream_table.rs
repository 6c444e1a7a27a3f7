//! Measures cross-stream reuse (`cca_cross_stream_reuse`, #4): every synthetic stress trace
//! (seeds 1–4) and, with `trace-io`, every shipped real trace, replayed on the simulated device
//! under the presets `pytorch`, `pytorch-expandable` and `default`, each without and with the
//! option: peak reserved bytes, their ratio to peak live bytes, handovers, device calls (PyTorch's
//! unit: segment allocations + frees, or range maps + unmaps), stream synchronizations,
//! address ranges reserved for expandable segments, and OOMs.
//!
//! ```text
//! cargo run --release --example cross_stream_table --features trace-io
//! ```
//!
//! An argument keeps only the traces whose name contains it (`... -- many_streams`). The
//! figures are recorded in `benches/README.md` ("Cross-stream reuse").
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::Preset;
use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;

#[path = "../benches/support/table_rows.rs"]
mod table_rows;

#[cfg(feature = "trace-io")]
fn real_traces() -> Vec<(String, Trace)> {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let root = env!("CARGO_MANIFEST_DIR");
    ["gpt2_train", "resnet50_train", "bert_varlen"]
        .iter()
        .map(|name| {
            let pickle = format!("{root}/../shared/traces/{name}.pickle");
            let path = if std::path::Path::new(&pickle).exists() {
                pickle
            } else {
                format!("{root}/examples/traces/{name}.csv.gz")
            };
            let trace = read_trace_file(&path, &ImportOptions::strict())
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .trace;
            (name.to_string(), trace)
        })
        .collect()
}

#[cfg(not(feature = "trace-io"))]
fn real_traces() -> Vec<(String, Trace)> {
    Vec::new()
}

fn main() {
    // An optional argument keeps only the traces whose name contains it.
    let only = std::env::args().nth(1).unwrap_or_default();
    let mut traces = real_traces();
    for w in Workload::ALL {
        for seed in 1..=4 {
            traces.push((format!("{} (seed {seed})", w.name()), w.trace(seed)));
        }
    }
    println!(
        "| trace | configuration | peak reserved GB | reserved / live | handovers | device calls | stream syncs | address ranges reserved | OOMs |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, trace) in traces.iter().filter(|(n, _)| n.contains(&only)) {
        for preset in [Preset::Pytorch, Preset::PytorchExpandable, Preset::Default] {
            for on in [false, true] {
                println!("{}", table_rows::cross_stream_row(name, trace, preset, on));
            }
        }
    }
}
