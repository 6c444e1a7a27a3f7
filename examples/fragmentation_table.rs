//! Prints the fragmentation table of `benches/README.md`: every shipped trace replayed on the
//! simulated device under the presets `pytorch`, `pytorch-expandable` and `default`, with peak
//! reserved bytes, their ratio to peak live bytes, device calls, and PyTorch's and
//! cudaMallocAsync's own figures from `reference.json` where there are any.
//!
//! ```text
//! cargo run --release --example fragmentation_table --features trace-io
//! ```
//!
//! Without `trace-io` only the synthetic stress traces are replayed. The real traces are read
//! from `../shared/traces/*.pickle` when that directory exists, else from the shipped
//! `examples/traces/*.csv.gz`.
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::Preset;
use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;

#[path = "../benches/support/table_rows.rs"]
mod table_rows;
use table_rows::gb;

/// The synthetic traces' seed.
const SEED: u64 = 1;

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
    eprintln!("(built without `trace-io`: the real traces are left out)");
    Vec::new()
}

fn reference() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/traces/reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn main() {
    let mut traces = real_traces();
    for w in Workload::ALL {
        traces.push((format!("{} (seed {SEED})", w.name()), w.trace(SEED)));
    }
    let refs = reference();
    println!(
        "| trace | peak live GB | configuration | peak reserved GB | reserved / live | device calls: maps + unmaps (or segment allocs + frees) | driver calls: allocate, create, map, unmap, release | stream syncs | OOMs |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|");
    for (name, trace) in &traces {
        let rows: Vec<_> = [Preset::Pytorch, Preset::PytorchExpandable, Preset::Default]
            .into_iter()
            .map(|p| table_rows::row(name, trace, p))
            .collect();
        let live = rows[0].0.peak_live_bytes;
        for (_, line) in &rows {
            println!("{line}");
        }
        let key = name.as_str();
        if let Some(t) = refs["traces"].get(key) {
            let ratio = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as f64 / live as f64;
            for (label, entry) in [
                ("PyTorch 2.11 (recorded)", &t["pytorch_default"]),
                (
                    "PyTorch 2.11 expandable_segments (recorded)",
                    &t["pytorch_expandable"],
                ),
                ("cudaMallocAsync (recorded)", &t["cudaMallocAsync"]),
            ] {
                let calls = entry["memory_stats"]["num_device_alloc"]
                    .as_u64()
                    .map_or("–".to_string(), |n| format!("{n} + 0"));
                println!(
                    "| {name} | {} | {label} | {} | {:.3} | {calls} | – | – | – |",
                    gb(live),
                    gb(entry["peak_reserved_bytes"].as_u64().unwrap_or(0)),
                    ratio(&entry["peak_reserved_bytes"]),
                );
            }
        }
    }
}
