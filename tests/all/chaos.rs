//! Chaos: several threads at once run random `allocate`, `free`, `record_stream`,
//! `empty_cache` and `set_memory_fraction` on one allocator over a `SimDevice` that is made to
//! fail device and event calls at random, with the invariant checker after every few steps and
//! once more at the end (with the `invariant-checks` feature the allocator also checks after
//! every operation). Afterwards every byte goes back to the device.
//!
//! CI runs a fixed number of steps per thread and configuration. The soak job (`.ci/soak`) sets
//! `CCA_CHAOS_SECS=N` to run each configuration for N seconds instead, and reads the figures this
//! test prints (`chaos: ...` lines: operations, faults injected, errors seen, violations).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuda_caching_allocator::*;

use crate::util::{MIB, with_config};

/// SplitMix64, one per thread (seeded by thread index: a failing run replays up to scheduling).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What all threads did, summed.
#[derive(Default)]
struct Tally {
    ops: AtomicU64,
    faults_injected: AtomicU64,
    ooms: AtomicU64,
    errors: AtomicU64,
    violations: AtomicU64,
}

/// Sizes from 1 byte to 48 MiB, log-uniform-ish, with some recurring ones.
fn size(r: &mut Rng) -> usize {
    match r.below(8) {
        0..=2 => [512, 4096, MIB, 3 * MIB, 12 * MIB][r.below(5) as usize],
        3..=5 => {
            let bits = 1 + r.below(21);
            1 + r.below(1 << bits) as usize
        }
        _ => MIB + r.below(48 * MIB as u64) as usize,
    }
}

/// One thread's loop: `steps` operations, or until `stop` is set.
fn worker(
    a: &CachingAllocator<SimDevice>,
    thread: u64,
    steps: u64,
    stop: &AtomicBool,
    tally: &Tally,
) {
    let mut r = Rng(0xc4a0_5eed ^ (thread << 32));
    let mut live: Vec<DeviceAddr> = Vec::new();
    let streams = [StreamId(0), StreamId(1 + thread), StreamId(100)];
    let sim = a.backend();
    let mut step = 0u64;
    while step < steps && !stop.load(Ordering::Relaxed) {
        step += 1;
        let stream = streams[r.below(streams.len() as u64) as usize];
        let result = match r.below(100) {
            0..=39 => a.allocate(size(&mut r), stream).map(|x| live.push(x.ptr)),
            40..=69 if !live.is_empty() => {
                let i = r.below(live.len() as u64) as usize;
                let p = live.swap_remove(i);
                let res = a.free(p);
                if matches!(res, Err(AllocError::Backend { .. })) {
                    // A failed event record leaves the allocation live: free it again later.
                    live.push(p);
                }
                res
            }
            70..=77 if !live.is_empty() => {
                let p = live[r.below(live.len() as u64) as usize];
                sim.submit_work(stream);
                a.record_stream(p, stream)
            }
            78..=84 => {
                sim.complete_work(stream);
                Ok(())
            }
            85..=87 => a.empty_cache(),
            88..=89 => a.set_memory_fraction([1.0, 0.9, 0.6, 0.3][r.below(4) as usize]),
            90..=95 => {
                let kind = if r.below(2) == 0 {
                    FaultKind::OutOfMemory
                } else {
                    FaultKind::Error
                };
                sim.fail_next_call(kind);
                tally.faults_injected.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            96..=97 => {
                let call = [
                    SimEventCall::Create,
                    SimEventCall::Record,
                    SimEventCall::StreamWait,
                ][r.below(3) as usize];
                sim.fail_next_event_call(call);
                tally.faults_injected.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            _ => a.check_invariants().map_err(|v| {
                eprintln!("chaos: thread {thread} step {step}: {v}");
                tally.violations.fetch_add(1, Ordering::Relaxed);
                AllocError::Unsupported {
                    operation: "check_invariants",
                    capability: "an allocator whose invariants hold",
                }
            }),
        };
        tally.ops.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(()) => {}
            Err(AllocError::OutOfMemory(_)) => {
                tally.ooms.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                tally.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    // Free what is left; an injected event failure may refuse a free once or twice.
    for p in live {
        let mut tries = 0;
        while let Err(e) = a.free(p) {
            tries += 1;
            assert!(
                matches!(e, AllocError::Backend { .. }) && tries < 100,
                "thread {thread}: free at the end: {e}"
            );
        }
    }
}

/// Runs `threads` workers on one allocator with `config` for `steps` steps each or `duration`,
/// then checks that nothing is live, the invariants hold and every byte goes back.
fn chaos(config: AllocatorConfig, name: &str, threads: u64, steps: u64, duration: Duration) {
    let a = Arc::new(with_config(4 << 30, config));
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let tally = Tally::default();
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (a, stop, tally, done) = (&a, &stop, &tally, &done);
            s.spawn(move || {
                worker(a, t, steps, stop, tally);
                done.fetch_add(1, Ordering::Relaxed);
            });
        }
        while start.elapsed() < duration && done.load(Ordering::Relaxed) < threads {
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let sim = a.backend();
    sim.clear_faults();
    for stream in 0..=100 {
        sim.complete_work(StreamId(stream));
    }
    a.flush_thread_caches();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_allocated(), 0, "{name}: bytes still allocated");
    assert_eq!(st.memory_reserved(), 0, "{name}: bytes still reserved");
    assert_eq!(sim.counters().reserved_bytes, 0, "{name}: device bytes");
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "chaos: {name}: {threads} threads, {:.1} s, {} operations, {} faults injected, {} OOMs, \
         {} other errors, {} device calls, {} violations",
        start.elapsed().as_secs_f64(),
        get(&tally.ops),
        get(&tally.faults_injected),
        get(&tally.ooms),
        get(&tally.errors),
        sim.counters().device_calls,
        get(&tally.violations),
    );
    assert_eq!(get(&tally.violations), 0, "{name}: invariant violations");
}

#[test]
fn chaos_threads_with_faults_keep_the_invariants() {
    let secs: Option<u64> = std::env::var("CCA_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    let (steps, duration) = match secs {
        Some(s) => (u64::MAX, Duration::from_secs(s)),
        None => (1_000, Duration::from_secs(3600)),
    };
    let configs = [
        ("pytorch", Preset::Pytorch.config()),
        ("pytorch-expandable", Preset::PytorchExpandable.config()),
        ("default", Preset::Default.config()),
        (
            "default+fast_path+cross_stream",
            AllocatorConfig::builder()
                .fast_path(true)
                .cross_stream_reuse(true)
                .build()
                .unwrap(),
        ),
    ];
    // The fast-path configuration once showed "front cache delta of allocation.all.current is
    // -1 but a recount gives 0" (once in 360,942 operations): the invariant checker read a
    // cache's counters while its owner was between a descriptor change and the counter update.
    // The checker now waits out such an operation in flight; after that, 80 s of this harness
    // on that configuration (5,687,802 operations) saw no violation.
    let configs = &configs[..];
    let per = duration / configs.len() as u32;
    for (name, config) in configs {
        chaos(config.clone(), name, 4, steps, per);
    }
}
