//! Many threads at once on one allocator with the fast path on (and off): allocations and frees
//! of mixed sizes on private and shared streams, frees of other threads' blocks, `empty_cache`,
//! flushes and stats reads racing them. Afterwards the invariants hold, the statistics add up,
//! and every byte goes back to the device.

// Test helpers outside `#[test]` functions unwrap too: a failure is the test failing.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use cuda_caching_allocator::*;

use crate::util::{MIB, with_config};

/// A small deterministic generator (xorshift), one per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Mostly a few recurring sizes (so the front caches hit and get flushed while busy), some
/// random ones.
fn size(r: &mut Rng) -> usize {
    const RECURRING: [usize; 6] = [512, 4096, 65536, MIB, 3 * MIB, 12 * MIB];
    match r.below(10) {
        0..=5 => RECURRING[r.below(RECURRING.len() as u64) as usize],
        6 | 7 => 1 + r.below(8192) as usize,
        8 => 8192 + r.below(2 * MIB as u64) as usize,
        _ => MIB + r.below(24 * MIB as u64) as usize,
    }
}

fn stress(config: AllocatorConfig, threads: usize, ops: usize) {
    let a = with_config(16 << 30, config);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<Allocation>()).unzip();
    // Blocks handed over and not yet freed, all threads together: a descheduled thread must not
    // pile up the others' hand-overs (on a 2-core machine it is descheduled for milliseconds).
    let in_flight = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for (t, rx) in receivers.into_iter().enumerate() {
            let a = &a;
            let in_flight = &in_flight;
            let senders = senders.clone();
            s.spawn(move || {
                let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678_9abc_def1));
                let own = StreamId(t as u64 + 1);
                let mut live: Vec<Allocation> = Vec::new();
                for i in 0..ops {
                    // Frees handed over by other threads.
                    while let Ok(x) = rx.try_recv() {
                        a.free(x.ptr).unwrap();
                        in_flight.fetch_sub(1, Ordering::Relaxed);
                    }
                    // At most 48 live blocks and 256 MiB per thread.
                    let live_bytes: usize = live.iter().map(|x| x.block_size).sum();
                    let roll = if live.len() >= 48 || live_bytes >= 256 * MIB {
                        50 + r.below(40)
                    } else {
                        r.below(100)
                    };
                    match roll {
                        0..=49 => {
                            let stream = if r.below(4) == 0 { StreamId(0) } else { own };
                            let x = a.allocate(size(&mut r), stream).unwrap();
                            assert!(!x.ptr.is_null());
                            live.push(x);
                        }
                        50..=89 => {
                            if !live.is_empty() {
                                let k = r.below(live.len() as u64) as usize;
                                let x = live.swap_remove(k);
                                a.free(x.ptr).unwrap();
                            }
                        }
                        90..=95 => {
                            // Hand one to another thread to free.
                            if let Some(x) = live.pop() {
                                let to = r.below(senders.len() as u64) as usize;
                                if in_flight.fetch_add(1, Ordering::Relaxed) >= 64
                                    || senders[to].send(x).is_err()
                                {
                                    in_flight.fetch_sub(1, Ordering::Relaxed);
                                    a.free(x.ptr).unwrap();
                                }
                            }
                        }
                        96 => a.empty_cache().unwrap(),
                        97 => {
                            a.flush_thread_caches();
                        }
                        _ => {
                            let st = a.memory_stats();
                            assert!(st.memory_allocated() <= st.memory_reserved());
                        }
                    }
                    if i % 512 == 0 {
                        // A quick hot loop of same-size pairs (cache hits).
                        for _ in 0..64 {
                            let x = a.allocate(4096, own).unwrap();
                            a.free(x.ptr).unwrap();
                        }
                    }
                }
                for x in live {
                    a.free(x.ptr).unwrap();
                }
                drop(senders);
                // Frees still in flight to this thread.
                for x in rx {
                    a.free(x.ptr).unwrap();
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                }
            });
        }
        drop(senders);
    });
    a.check_invariants().unwrap();
    let st = a.memory_stats();
    for arr in [
        &st.allocation,
        &st.active,
        &st.allocated_bytes,
        &st.active_bytes,
        &st.requested_bytes,
    ] {
        for t in StatType::ALL {
            let s = arr.get(t);
            assert_eq!(s.current, 0, "{:?}", s);
            assert_eq!(s.allocated, s.freed, "{:?}", s);
            assert!(s.peak > 0 || t != StatType::All);
        }
    }
    assert_eq!(st.num_ooms, 0);
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.memory_reserved(), 0, "memory held somewhere");
    assert_eq!(a.backend().counters().live_segments, 0);
    a.check_invariants().unwrap();
}

/// Operations per thread: `STRESS_OPS` (for longer runs), else `default`.
fn ops(default: usize) -> usize {
    std::env::var("STRESS_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn many_threads_with_the_fast_path() {
    stress(
        AllocatorConfig {
            fast_path: true,
            ..AllocatorConfig::default()
        },
        8,
        ops(3000),
    );
}

#[test]
fn many_threads_without_the_fast_path() {
    stress(AllocatorConfig::pytorch(), 4, ops(1500));
}

/// Regression (#14): `memory_stats()` read while other threads hit their front caches paired an
/// old `allocated` with a new `freed` of one cache (reported currents down to −509,193
/// allocations). Each worker holds at most `HELD` blocks of at most `BIG` bytes, so any order of
/// its operations keeps the user-view currents within `0..=THREADS * HELD` blocks and
/// `0..=THREADS * HELD * BIG` bytes, and the peaks too; every read must stay inside, with
/// `allocated − freed = current` and `current ≤ peak`. Two readers read for `STATS_READ_MS`
/// milliseconds (default 3000; a torn read needs a reader preempted inside its read, which on
/// a loaded 2-core machine happens within about a second).
#[test]
fn stats_read_during_fast_path_hits_stay_within_bounds() {
    const THREADS: usize = 3;
    const READERS: usize = 2;
    const HELD: usize = 3;
    const SIZES: [usize; 3] = [512, 4096, 65536];
    const BIG: usize = 65536;
    let millis = std::env::var("STATS_READ_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000u64);
    let a = with_config(
        1 << 30,
        AllocatorConfig {
            fast_path: true,
            ..AllocatorConfig::pytorch()
        },
    );
    let stop = AtomicUsize::new(0);
    let max_blocks = (THREADS * HELD) as i64;
    let max_bytes = (THREADS * HELD * BIG) as i64;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, stop) = (&a, &stop);
            s.spawn(move || {
                let stream = StreamId(t as u64);
                let mut live: Vec<Allocation> = Vec::new();
                let mut i = 0usize;
                while stop.load(Ordering::Relaxed) < READERS {
                    let size = SIZES[(i * 7 + t) % SIZES.len()];
                    if live.len() == HELD {
                        a.free(live.remove(i % HELD).ptr).unwrap();
                    }
                    live.push(a.allocate(size, stream).unwrap());
                    i += 1;
                }
                for x in live {
                    a.free(x.ptr).unwrap();
                }
            });
        }
        for _ in 0..READERS {
            let (a, stop) = (&a, &stop);
            s.spawn(move || {
                // Stops the workers on a failed assertion too.
                struct Done<'a>(&'a AtomicUsize);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let _done = Done(stop);
                let until = std::time::Instant::now() + std::time::Duration::from_millis(millis);
                let mut reads = 0u64;
                while std::time::Instant::now() < until {
                    let st = a.memory_stats();
                    reads += 1;
                    for (name, arr, max) in [
                        ("allocation", &st.allocation, max_blocks),
                        ("active", &st.active, max_blocks),
                        ("allocated_bytes", &st.allocated_bytes, max_bytes),
                        ("active_bytes", &st.active_bytes, max_bytes),
                        ("requested_bytes", &st.requested_bytes, max_bytes),
                    ] {
                        for t in StatType::ALL {
                            let v = arr.get(t);
                            assert!(
                                (0..=max).contains(&v.current)
                                    && v.current <= v.peak
                                    && v.peak <= max,
                                "read {reads}: {name}.{} = {v:?} outside 0..={max}",
                                t.name()
                            );
                            assert_eq!(v.allocated - v.freed, v.current, "{name}.{}", t.name());
                        }
                    }
                    assert!(st.memory_allocated() <= st.memory_reserved());
                }
            });
        }
    });
    a.check_invariants().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current, 0);
}
