//! Measures borrowed blocks (`cca_borrow_blocks`, Note [Borrowed blocks]; #11): the recorded
//! multi-stream clients (`gpu/traces/{fsdp,ddp,sidestream}.pickle.gz`, with `trace-io`) and the
//! synthetic stress traces (seeds 1–4) replayed on the simulated device under the crate's
//! default without and with the key, at event-query lags 0, 1 and 4 (a device running behind the
//! host): peak reserved over peak live bytes, page moves (unmaps), maps, events recorded and
//! queried, stream waits, blocks borrowed, page loans and the modeled device time.
//!
//! ```text
//! cargo run --release --example borrow_table --features trace-io
//! ```
//!
//! An argument keeps only the traces whose name contains it (`... -- fsdp`). The figures are
//! recorded in `benches/README.md` ("Borrowed blocks").
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;
use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, ReplayOptions, SimDevice, replay};

fn row(name: &str, trace: &Trace, borrow: bool, lag: u32) {
    let config = AllocatorConfig {
        borrow_blocks: borrow,
        ..AllocatorConfig::default()
    };
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    let alloc = CachingAllocator::new(dev, config).unwrap();
    let r = replay(&alloc, trace, &ReplayOptions::default()).unwrap();
    println!(
        "| {name} | {lag} | {} | {:.4} | {} | {} | {} / {} | {} | {} | {} | {:.1} |",
        if borrow { "borrowing" } else { "default" },
        r.reserved_over_live(),
        r.device_call("unmap"),
        r.device_call("map"),
        r.device_call("event_record"),
        r.device_call("event_query"),
        r.device_call("stream_wait_event"),
        r.blocks_borrowed,
        r.page_loans,
        r.modeled_device_ns.unwrap_or(0) as f64 / 1e6,
    );
}

#[cfg(feature = "trace-io")]
fn recorded() -> Vec<(String, Trace)> {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let root = env!("CARGO_MANIFEST_DIR");
    ["fsdp", "ddp", "sidestream"]
        .iter()
        .map(|name| {
            let path = format!("{root}/gpu/traces/{name}.pickle.gz");
            let trace = read_trace_file(&path, &ImportOptions::default())
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .trace;
            (name.to_string(), trace)
        })
        .collect()
}

#[cfg(not(feature = "trace-io"))]
fn recorded() -> Vec<(String, Trace)> {
    Vec::new()
}

fn main() {
    let only = std::env::args().nth(1).unwrap_or_default();
    let mut traces = recorded();
    for w in Workload::ALL {
        for seed in 1..=4 {
            traces.push((format!("{} (seed {seed})", w.name()), w.trace(seed)));
        }
    }
    println!(
        "| trace | query lag | configuration | reserved / live | unmaps | maps | events recorded / queried | stream waits | borrowed | page loans | modeled ms |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, trace) in traces.iter().filter(|(n, _)| n.contains(&only)) {
        for lag in [0, 1, 4] {
            row(name, trace, false, lag);
            row(name, trace, true, lag);
        }
    }
}
