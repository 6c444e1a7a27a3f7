//! Random mixes and trace replay, ns per operation (each alloc and each free is one operation),
//! for the `pytorch` preset, the same with the fast path (`pytorch+fast`) and the crate's default
//! (expandable segments with page reuse; the fast path is on there), on `SimDevice`:
//!
//! * `mix/2000-live-512B-64MiB`: 2,000 live allocations of log-uniform sizes in 512 B – 64 MiB,
//!   a random one freed and replaced per step (PyTorch's measured mix in
//!   `pytorch-allocator.md` §11);
//! * `mix/20000-live-512B-1MiB`: the same with 20,000 live allocations of 512 B – 1 MiB;
//! * `replay/<trace>` (with `--features trace-io`): the shipped RMM CSV traces
//!   (`examples/traces/*.csv.gz`) replayed on a fresh allocator, as `reference.json`'s
//!   `replay_ns_per_op_h200`.
//!
//! Run: `cargo bench --bench mixes` (add `--features trace-io` for the replay rows).

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, SimDevice, StreamId};

fn alloc(config: &AllocatorConfig) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::with_capacity(1 << 40), config.clone())
        .expect("allocator over SimDevice")
}

fn mixes(c: &mut Criterion) {
    let mixes = [
        (
            "2000-live-512B-64MiB",
            support::Mix::new(2000, 512, 64 << 20, 50_000, 7),
        ),
        (
            "20000-live-512B-1MiB",
            support::Mix::new(20_000, 512, 1 << 20, 50_000, 11),
        ),
    ];
    let traces = support::shipped_traces(&support::traces_dir());
    for (preset, config) in support::configs(true) {
        let mut g = c.benchmark_group(format!("mix/{preset}"));
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .sample_size(10);
        for (name, mix) in &mixes {
            let a = alloc(&config);
            let ops = 2 * mix.steps.len() as u64;
            g.bench_function(*name, |b| {
                b.iter_custom(|iters| {
                    // Whole runs of the mix until `iters` operations are covered, scaled back.
                    let runs = iters.div_ceil(ops).max(1);
                    let mut t = Duration::ZERO;
                    for _ in 0..runs {
                        t += mix.run(&a, StreamId(0));
                    }
                    t.mul_f64(iters as f64 / (runs * ops) as f64)
                });
            });
        }
        g.finish();
        if traces.is_empty() {
            continue;
        }
        let mut g = c.benchmark_group(format!("replay/{preset}"));
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .sample_size(10);
        for trace in &traces {
            let ops = trace.steps.len() as u64;
            g.bench_function(&trace.name, |b| {
                b.iter_custom(|iters| {
                    let runs = iters.div_ceil(ops).max(1);
                    let mut t = Duration::ZERO;
                    for _ in 0..runs {
                        // A fresh allocator per replay: its first segments are part of the cost.
                        let a = alloc(&config);
                        t += trace.run(&a, &|s| StreamId(s));
                    }
                    t.mul_f64(iters as f64 / (runs * ops) as f64)
                });
            });
        }
        g.finish();
    }
}

criterion_group!(benches, mixes);
criterion_main!(benches);
