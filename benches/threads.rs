//! Aggregate throughput of 1/2/4/8/16 threads doing warm 1 MiB alloc+free pairs at once, each
//! thread on its own stream and all on one shared stream, for the `pytorch` preset without and
//! with the fast path (`pytorch+fast`), on `SimDevice`. Criterion's time per iteration is the
//! aggregate ns per pair (wall time ÷ pairs of all threads), as in `reference.json`'s
//! `threads_ns_per_pair_h200`; lower is better, and perfect scaling divides it by the thread
//! count (as far as the machine has cores).
//!
//! Run: `cargo bench --bench threads`.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use cuda_caching_allocator::{CachingAllocator, SimDevice, StreamId};

fn threads(c: &mut Criterion) {
    for (preset, config) in support::configs(false) {
        for (label, own) in [("own-stream", true), ("shared-stream", false)] {
            let mut g = c.benchmark_group(format!("threads/{preset}/{label}"));
            g.warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2))
                .sample_size(10);
            for n in support::THREADS {
                let a = CachingAllocator::new(SimDevice::with_capacity(1 << 40), config.clone())
                    .expect("allocator over SimDevice");
                let stream_of = move |t: usize| {
                    if own {
                        StreamId(t as u64 + 1)
                    } else {
                        StreamId(0)
                    }
                };
                g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
                    b.iter_custom(|iters| {
                        let per_thread = (iters / n as u64).max(1);
                        let wall = support::threads(
                            &a,
                            n,
                            support::THREAD_PAIR_SIZE,
                            per_thread,
                            &stream_of,
                        );
                        // Scale to `iters` pairs in all.
                        wall.mul_f64(iters as f64 / (per_thread * n as u64) as f64)
                    });
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, threads);
criterion_main!(benches);
