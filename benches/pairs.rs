//! Warm alloc+free pair latency on one thread, by size (the sizes of `reference.json`'s
//! `pairs_ns_h200`: 512 B, 64 KiB, 1 MiB, 8 MiB, 64 MiB), for the `pytorch` preset without and
//! with the fast path (`pytorch+fast`), on `SimDevice` (host cost alone).
//! Criterion's time per iteration is ns per pair.
//!
//! Run: `cargo bench --bench pairs`.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use cuda_caching_allocator::{CachingAllocator, SimDevice, StreamId};

fn pairs(c: &mut Criterion) {
    for (preset, config) in support::configs(false) {
        let mut g = c.benchmark_group(format!("pair/{preset}"));
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .sample_size(30);
        for size in support::PAIR_SIZES {
            let a = CachingAllocator::new(SimDevice::with_capacity(1 << 40), config.clone())
                .expect("allocator over SimDevice");
            g.bench_with_input(
                BenchmarkId::from_parameter(support::size_name(size)),
                &size,
                |b, &size| b.iter_custom(|iters| support::pairs(&a, size, StreamId(0), iters)),
            );
        }
        g.finish();
    }
}

criterion_group!(benches, pairs);
criterion_main!(benches);
