//! Sweeps the page-reuse slack (`cca_page_reuse_slack`) of the default over every trace the
//! repository has: the three shipped traces, our five recorded clients (`gpu/traces/`) and the
//! four synthetic stress workloads at seeds 1–8, each on the simulated device with event
//! queries answered at once and one query late (`SimDevice::set_event_query_lag`). Per trace and
//! slack it prints reserved ÷ live bytes, the device-time model's figure and the unmap calls
//! (each a page that page reuse moved), so that the memory a larger slack costs can be read
//! beside the page moves it saves (#11, `benches/README.md`, "Page-reuse slack against FSDP2's
//! growth steps").
//!
//! ```text
//! cargo run --release --example slack_sweep --features trace-io -- 0.01 0.0125 0.015
//! ```
//!
//! With no argument it compares the default's slack (0.01) with 0.015. An argument that is not a
//! number is a configuration string on top of the default (`cca_max_handle_size_mb:4`), so that
//! other growth knobs can be swept over the same traces:
//!
//! ```text
//! cargo run --release --example slack_sweep --features trace-io -- 0.01 cca_max_handle_size_mb:4
//! ```
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::{ImportOptions, Trace, read_trace_file};
use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, ReplayOptions, SimDevice, replay};

/// The synthetic workloads' seeds.
const SEEDS: std::ops::RangeInclusive<u64> = 1..=8;

/// The event-query lags of each slack's two columns.
const LAGS: [u32; 2] = [0, 1];

fn read(path: &str) -> Trace {
    read_trace_file(path, &ImportOptions::strict())
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trace
}

fn traces() -> Vec<(String, Trace)> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut out = Vec::new();
    for name in ["gpt2_train", "resnet50_train", "bert_varlen"] {
        out.push((
            name.to_string(),
            read(&format!("{root}/examples/traces/{name}.csv.gz")),
        ));
    }
    for name in ["generate", "ckpt", "sidestream", "ddp", "fsdp"] {
        out.push((
            name.to_string(),
            read(&format!("{root}/gpu/traces/{name}.pickle.gz")),
        ));
    }
    for seed in SEEDS {
        for w in Workload::ALL {
            out.push((format!("{} (seed {seed})", w.name()), w.trace(seed)));
        }
    }
    out
}

fn main() {
    let mut slacks: Vec<String> = std::env::args().skip(1).collect();
    if slacks.is_empty() {
        slacks = vec!["0.01".into(), "0.015".into()];
    }
    let configs: Vec<AllocatorConfig> = slacks
        .iter()
        .map(|s| {
            let extra = if s.parse::<f64>().is_ok() {
                format!("cca_page_reuse_slack:{s}")
            } else {
                s.clone()
            };
            AllocatorConfig::parse(&format!("cca_preset:default,{extra}")).unwrap()
        })
        .collect();
    let mut header = String::from("| trace |");
    let mut rule = String::from("|---|");
    for s in &slacks {
        for lag in LAGS {
            header += &format!(" {s}, lag {lag}: reserved / live, modeled ms, unmaps |");
            rule += "---|";
        }
    }
    println!("{header}\n{rule}");
    for (name, trace) in traces() {
        let mut line = format!("| {name} |");
        for config in &configs {
            for lag in LAGS {
                let dev = SimDevice::default();
                dev.set_event_query_lag(lag);
                let alloc = CachingAllocator::new(dev, config.clone()).unwrap();
                let r = replay(&alloc, &trace, &ReplayOptions::default()).unwrap();
                line += &format!(
                    " {:.4}, {:.1}, {} |",
                    r.reserved_over_live(),
                    r.modeled_device_ns.unwrap_or(0) as f64 / 1e6,
                    r.device_call("unmap")
                );
            }
        }
        println!("{line}");
    }
}
