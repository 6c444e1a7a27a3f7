//! Prints the device-cost table of `benches/README.md` (#11): every shipped trace and every
//! synthetic stress trace replayed on the simulated device under the presets `pytorch` and
//! `default`, with reserved ÷ live bytes, the device-time model's figure (`modeled_device_ns`,
//! H100 call costs), the default's cost over `pytorch`'s, synchronizations, and the driver calls
//! behind the figure. The default is also replayed with the device answering event queries
//! late (`SimDevice::set_event_query_lag`, rows `query lag N`), which prices the memory that
//! event-fenced page reuse holds back while its fences are pending.
//!
//! ```text
//! cargo run --release --example device_cost_table --features trace-io
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

/// The event-query lags of the extra `default` rows (`SimDevice::set_event_query_lag`): a
/// device running behind the host, so that page fences are seen complete later.
const LAGS: [u32; 2] = [1, 4];

fn run(trace: &Trace, config: AllocatorConfig) -> ReplayReport {
    run_lagged(trace, config, 0)
}

fn run_lagged(trace: &Trace, config: AllocatorConfig, lag: u32) -> ReplayReport {
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    let alloc = CachingAllocator::new(dev, config).unwrap();
    replay(&alloc, trace, &ReplayOptions::default()).unwrap()
}

#[cfg(feature = "trace-io")]
fn real_traces() -> Vec<(String, Trace)> {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let root = env!("CARGO_MANIFEST_DIR");
    ["gpt2_train", "resnet50_train", "bert_varlen"]
        .iter()
        .map(|name| {
            let path = format!("{root}/examples/traces/{name}.csv.gz");
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

fn main() {
    let mut traces = real_traces();
    for w in Workload::ALL {
        traces.push((format!("{} (seed {SEED})", w.name()), w.trace(SEED)));
    }
    // A configuration string as the first argument replaces the default (for sweeps).
    let default = match std::env::args().nth(1) {
        Some(s) => AllocatorConfig::parse(&s).unwrap(),
        None => Preset::Default.config(),
    };
    println!(
        "| trace | configuration | reserved / live | modeled device ms | × pytorch | syncs | allocate, create, map, unmap, release | event record, query, wait |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (name, trace) in &traces {
        let base = run(trace, Preset::Pytorch.config());
        let ours = run(trace, default.clone());
        let lagged: Vec<(String, ReplayReport)> = LAGS
            .iter()
            .map(|&lag| {
                (
                    format!("default, query lag {lag}"),
                    run_lagged(trace, default.clone(), lag),
                )
            })
            .collect();
        let base_ns = base.modeled_device_ns.unwrap_or(0).max(1) as f64;
        let rows = [
            ("pytorch".to_string(), &base),
            ("default".to_string(), &ours),
        ]
        .into_iter()
        .chain(lagged.iter().map(|(l, r)| (l.clone(), r)));
        for (label, r) in rows {
            let ns = r.modeled_device_ns.unwrap_or(0) as f64;
            let c = |k: &str| r.device_call(k);
            println!(
                "| {name} | `{label}` | {:.4} | {:.2} | {:.2} | {} | {}, {}, {}, {}, {} | {}, {}, {} |",
                r.reserved_over_live(),
                ns / 1e6,
                ns / base_ns,
                c("synchronize") + c("stream_synchronize"),
                c("allocate"),
                c("create"),
                c("map"),
                c("unmap"),
                c("release") + c("free"),
                c("event_record"),
                c("event_query"),
                c("stream_wait_event"),
            );
        }
    }
}
