//! The trade-off of #11, measured: sweeps the expandable-growth knobs (largest physical handle,
//! one handle per growth, minimum growth, page-reuse slack) on top of the crate's default, replays
//! every shipped trace and every synthetic stress trace on the simulated device, and prints per
//! point the worst reserved ÷ live bytes over all traces and the worst modeled device time over the
//! `pytorch` preset's (shipped traces, and all traces), then the Pareto front of the two.
//!
//! ```text
//! cargo run --release --example growth_sweep --features trace-io
//! ```
//!
//! Without `trace-io` only the synthetic traces are replayed.
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;
use cuda_caching_allocator::{
    AllocatorConfig, CachingAllocator, Preset, ReplayOptions, ReplayReport, SimDevice, replay,
};

/// The synthetic traces' seed.
const SEED: u64 = 1;

fn run(trace: &Trace, config: AllocatorConfig) -> ReplayReport {
    let alloc = CachingAllocator::new(SimDevice::default(), config).unwrap();
    replay(&alloc, trace, &ReplayOptions::default()).unwrap()
}

#[cfg(feature = "trace-io")]
fn real_traces() -> Vec<(String, Trace, bool)> {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let root = env!("CARGO_MANIFEST_DIR");
    ["gpt2_train", "resnet50_train", "bert_varlen"]
        .iter()
        .map(|name| {
            let path = format!("{root}/examples/traces/{name}.csv.gz");
            let trace = read_trace_file(&path, &ImportOptions::strict())
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .trace;
            (name.to_string(), trace, true)
        })
        .collect()
}

#[cfg(not(feature = "trace-io"))]
fn real_traces() -> Vec<(String, Trace, bool)> {
    eprintln!("(built without `trace-io`: the real traces are left out)");
    Vec::new()
}

/// One point of the sweep and what it measured.
struct Point {
    config: String,
    worst_memory: f64,
    worst_memory_shipped: f64,
    worst_cost_shipped: f64,
    worst_cost_all: f64,
    syncs: u64,
}

fn main() {
    let mut traces = real_traces();
    for w in Workload::ALL {
        traces.push((w.name().to_string(), w.trace(SEED), false));
    }
    let base: Vec<f64> = traces
        .iter()
        .map(|(_, t, _)| {
            run(t, Preset::Pytorch.config())
                .modeled_device_ns
                .unwrap_or(1) as f64
        })
        .collect();
    let mut grid: Vec<String> = vec!["cca_preset:default".to_string()];
    for cap in [8, 16, 32, 64, 128, 256] {
        for growth in [0, 8, 20, 64] {
            for slack in ["0.01", "0.015"] {
                grid.push(format!(
                    "cca_preset:default,cca_max_handle_size_mb:{cap},cca_handle_per_growth:True,\
                     cca_min_growth_mb:{growth},cca_page_reuse_slack:{slack}"
                ));
            }
        }
    }
    let mut points = Vec::new();
    for config in grid {
        let parsed = AllocatorConfig::parse(&config).unwrap();
        let mut p = Point {
            config: config.trim_start_matches("cca_preset:default,").to_string(),
            worst_memory: 0.0,
            worst_memory_shipped: 0.0,
            worst_cost_shipped: 0.0,
            worst_cost_all: 0.0,
            syncs: 0,
        };
        for ((_, trace, shipped), base_ns) in traces.iter().zip(&base) {
            let r = run(trace, parsed.clone());
            let cost = r.modeled_device_ns.unwrap_or(0) as f64 / base_ns.max(1.0);
            let mem = r.reserved_over_live();
            p.worst_memory = p.worst_memory.max(mem);
            p.worst_cost_all = p.worst_cost_all.max(cost);
            if *shipped {
                p.worst_memory_shipped = p.worst_memory_shipped.max(mem);
                p.worst_cost_shipped = p.worst_cost_shipped.max(cost);
            }
            p.syncs += r.device_call("synchronize") + r.device_call("stream_synchronize");
        }
        points.push(p);
    }
    println!(
        "| growth (on top of the default) | worst reserved / live, all | shipped | worst × pytorch modeled time, shipped | all | syncs |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for p in &points {
        println!(
            "| `{}` | {:.4} | {:.4} | {:.2} | {:.2} | {} |",
            p.config,
            p.worst_memory,
            p.worst_memory_shipped,
            p.worst_cost_shipped,
            p.worst_cost_all,
            p.syncs
        );
    }
    // Pareto front on (worst memory over all traces, worst cost over the shipped traces; over
    // all traces when built without `trace-io`).
    if !traces.iter().any(|(_, _, shipped)| *shipped) {
        for p in &mut points {
            p.worst_cost_shipped = p.worst_cost_all;
        }
    }
    println!(
        "\nPareto front (worst reserved / live over all traces against worst cost over the shipped traces):\n"
    );
    let mut front: Vec<&Point> = points
        .iter()
        .filter(|p| {
            !points.iter().any(|q| {
                q.worst_memory <= p.worst_memory
                    && q.worst_cost_shipped <= p.worst_cost_shipped
                    && (q.worst_memory < p.worst_memory
                        || q.worst_cost_shipped < p.worst_cost_shipped)
            })
        })
        .collect();
    front.sort_by(|a, b| a.worst_memory.total_cmp(&b.worst_memory));
    for p in front {
        println!(
            "- {:.4} × live, {:.2} × pytorch: `{}`",
            p.worst_memory, p.worst_cost_shipped, p.config
        );
    }
}
