//! How the default pays for page moves over a long variable-length training run (#11): the
//! synthetic transformer workload (`synth::TransformerParams`, sequences of 64..1024 tokens drawn
//! per step) run for many steps on the simulated device, with the device calls of each window of
//! steps, so that one can read whether page moves stop once the layout settles (the page-move
//! budget's "rent, then buy", `docs/algorithm.md`, step 23d) or go on for ever. The recorded
//! clients of `gpu/traces` are 30–40 steps long; a user trains for thousands.
//!
//! ```text
//! cargo run --release --example long_varlen -- [STEPS] [WINDOW] [CONFIG ...]
//! ```
//!
//! Defaults: 400 steps, windows of 50 steps, seed 1 (`CCA_SEED=N` for another), the default
//! configuration and `pytorch`. Each
//! CONFIG is a configuration string (`cca_preset:default,cca_page_move_budget:2`). Per window it
//! prints unmap and create calls and the modeled device ms; per configuration the reserved ÷
//! live bytes of the whole run.
#![allow(clippy::unwrap_used)]

use cuda_caching_allocator::synth::TransformerParams;
use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, ReplayOptions, SimDevice};

/// The synthetic trace's seed unless `CCA_SEED` names another.
const SEED: u64 = 1;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: u64 = args.first().map_or(400, |s| s.parse().unwrap());
    let window: u64 = args.get(1).map_or(50, |s| s.parse().unwrap());
    let mut configs: Vec<String> = args.iter().skip(2).cloned().collect();
    if configs.is_empty() {
        configs = vec!["cca_preset:default".into(), "cca_preset:pytorch".into()];
    }
    let seed: u64 = std::env::var("CCA_SEED").map_or(SEED, |s| s.parse().unwrap());
    let trace = TransformerParams {
        steps,
        ..TransformerParams::default()
    }
    .generate(seed);
    let events = trace.events.len() as u64;
    // `CCA_RESET_PEAK=1`: reset the peak statistics at every step, as a training loop that logs
    // each step's peak memory does (`torch.cuda.reset_peak_memory_stats()`).
    let reset_each_step = std::env::var_os("CCA_RESET_PEAK").is_some();
    let windows = steps.div_ceil(window);
    println!(
        "synth_transformer_varlen (seed {seed}), {steps} steps, {events} events; windows of \
         {window} steps (by event index: the steps are of similar event counts)\n"
    );
    for c in &configs {
        let config = AllocatorConfig::parse(c).unwrap();
        let alloc = CachingAllocator::new(SimDevice::default(), config).unwrap();
        // Per window: (unmaps, creates, modeled ns) at its end, and the window's highest
        // reserved and live bytes.
        let mut ends = vec![(0u64, 0u64, 0u64); windows as usize];
        let mut highs = vec![(0usize, 0u64); windows as usize];
        let mut step_seen = 0u64;
        let report = cuda_caching_allocator::replay::replay_observed(
            &alloc,
            &trace,
            &ReplayOptions::default(),
            None,
            &mut |i, live, a| {
                let step = i as u64 * steps / events;
                if reset_each_step && step != step_seen {
                    a.reset_peak_stats();
                }
                step_seen = step;
                let w = (step / window).min(windows - 1) as usize;
                let k = a.backend().counters();
                ends[w] = (k.unmap_calls, k.create_physical_calls, k.modeled_device_ns);
                highs[w].0 = highs[w].0.max(k.reserved_bytes);
                highs[w].1 = highs[w].1.max(live);
            },
        )
        .unwrap();
        println!(
            "{c}: reserved / live {:.4}, modeled device ms {:.1}",
            report.reserved_over_live(),
            alloc.backend().counters().modeled_device_ns as f64 / 1e6
        );
        println!(
            "| steps | unmaps | creates | modeled device ms | peak reserved so far ÷ peak live so far |\n\
             |---|---:|---:|---:|---:|"
        );
        let mut prev = (0u64, 0u64, 0u64);
        let (mut res, mut live) = (0usize, 0u64);
        for (w, &e) in ends.iter().enumerate() {
            res = res.max(highs[w].0);
            live = live.max(highs[w].1);
            // A window with no event of its own (none can be) keeps the previous end.
            let e = if e == (0, 0, 0) { prev } else { e };
            println!(
                "| {}–{} | {} | {} | {:.1} | {:.4} |",
                w as u64 * window + 1,
                ((w as u64 + 1) * window).min(steps),
                e.0 - prev.0,
                e.1 - prev.1,
                (e.2 - prev.2) as f64 / 1e6,
                res as f64 / live.max(1) as f64
            );
            prev = e;
        }
        println!();
    }
}
