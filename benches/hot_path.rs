//! The core's four hot operations on `SimDevice` (host cost alone), for the `pytorch` preset, the
//! same with the fast path (`pytorch+fast`) and the crate's default (expandable segments with
//! page reuse; the fast path is on there):
//!
//! * `hit`: a warm alloc+free pair served by a cached block as it is (16 MiB: a whole segment, no
//!   split or merge; with the fast path, a front-cache hit);
//! * `split`: an allocation that splits a cached block (4 KiB out of a 2 MiB segment), per
//!   allocation;
//! * `merge`: a free that merges with its free neighbours, per free (with the fast path the free
//!   goes to the front cache and the merge happens at the flush, which is included);
//! * `miss`: an allocation that needs a new device segment (30 MiB), per allocation.
//!
//! Run: `cargo bench --bench hot_path`.

#[path = "support/mod.rs"]
mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use cuda_caching_allocator::{Allocation, AllocatorConfig, CachingAllocator, SimDevice, StreamId};

const S: StreamId = StreamId(0);
/// Blocks per batch for split / merge / miss.
const BATCH: u64 = 64;

fn alloc(config: &AllocatorConfig) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::with_capacity(1 << 40), config.clone())
        .expect("allocator over SimDevice")
}

type Live = Vec<Allocation>;

/// Runs `iters` operations in batches of [`BATCH`]: `setup` (untimed), `timed(n)`, `teardown`
/// (untimed), all on one list of live allocations.
fn batched(
    iters: u64,
    setup: impl Fn(&mut Live),
    timed: impl Fn(&mut Live, u64),
    teardown: impl Fn(&mut Live),
) -> Duration {
    let mut live = Live::new();
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        setup(&mut live);
        let t = Instant::now();
        timed(&mut live, n);
        total += t.elapsed();
        teardown(&mut live);
        left -= n;
    }
    total
}

fn hot_path(c: &mut Criterion) {
    for (preset, config) in support::configs(true) {
        let mut g = c.benchmark_group(format!("hot_path/{preset}"));
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .sample_size(20);

        let a = alloc(&config);
        g.bench_function("hit", |b| {
            b.iter_custom(|iters| support::pairs(&a, 16 << 20, S, iters));
        });

        // Split: allocations of 4 KiB, each cut from the free tail of a 2 MiB segment.
        let a = alloc(&config);
        g.bench_function("split", |b| {
            b.iter_custom(|iters| {
                batched(
                    iters,
                    |_| {},
                    |live, n| {
                        for _ in 0..n {
                            live.push(a.allocate(black_box(4096), S).expect("allocate"));
                        }
                    },
                    |live| {
                        for x in live.drain(..).rev() {
                            a.free(x.ptr).expect("free");
                        }
                        a.flush_thread_caches();
                    },
                )
            });
        });

        // Merge: frees of 4 KiB blocks next to free space (and the flush that merges them, with
        // the fast path).
        let a = alloc(&config);
        g.bench_function("merge", |b| {
            b.iter_custom(|iters| {
                batched(
                    iters,
                    |live| {
                        for _ in 0..BATCH {
                            live.push(a.allocate(4096, S).expect("allocate"));
                        }
                    },
                    |live, n| {
                        let keep = live.len().saturating_sub(n as usize);
                        for x in live.drain(keep..).rev() {
                            a.free(black_box(x.ptr)).expect("free");
                        }
                        a.flush_thread_caches();
                    },
                    |live| {
                        for x in live.drain(..) {
                            a.free(x.ptr).expect("free");
                        }
                        a.flush_thread_caches();
                    },
                )
            });
        });

        // Miss: allocations that each need a new 30 MiB segment.
        let a = alloc(&config);
        g.bench_function("miss", |b| {
            b.iter_custom(|iters| {
                batched(
                    iters,
                    |_| {},
                    |live, n| {
                        for _ in 0..n {
                            live.push(a.allocate(black_box(30 << 20), S).expect("allocate"));
                        }
                    },
                    |live| {
                        for x in live.drain(..) {
                            a.free(x.ptr).expect("free");
                        }
                        a.empty_cache().expect("empty_cache");
                    },
                )
            });
        });
        g.finish();
    }
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
