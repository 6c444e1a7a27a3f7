//! Model checking of the fast path's cross-thread protocol with `shuttle`: the shared half of a
//! thread cache (`src/allocator/front/shared.rs`: the descriptor state machine and the
//! statistics counters' sequence lock) is compiled here against shuttle's instrumented atomics
//! and mutex (through the `sync` module below, which stands in for `front/sync.rs`), and driven
//! by threads that play the owner, a flushing thread and freeing threads the way `front/mod.rs`
//! and `front/local.rs` do. Shuttle runs each scenario under many schedules (random, and PCT,
//! which finds bugs that need a few preemptions at the right places) and fails on the first
//! schedule that breaks an assertion; the failing schedule replays from the printed seed.
//!
//! What is checked: a hit racing a flush, and two frees of one block racing (the owner's cached
//! free against another thread's free, and two other threads), end with exactly one winner and
//! statistics that recount; a thread that exits with cached blocks has all of them taken back
//! by the next reclaim; a statistics read racing the owner's updates sees the counters of one
//! instant. Shuttle explores interleavings under sequential consistency: the memory orderings
//! themselves are argued in `shared.rs`, not checked here.

#![allow(clippy::unwrap_used, dead_code, unreachable_pub)]

/// What `shared.rs` and `delta.rs` import from the crate, for their copy compiled here.
mod size_class {
    pub(crate) use cuda_caching_allocator::size_class::PoolKind;
}

mod stats {
    pub(crate) use cuda_caching_allocator::stats::{MemoryStats, StatArray, StatType};
}

/// `front/sync.rs` with shuttle's primitives.
mod sync {
    pub(crate) use shuttle::sync::atomic::{
        AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };

    /// A waiting reader lets the scheduler run another thread (a spin would never end under a
    /// model checker that runs one thread at a time).
    pub(crate) fn wait(_spins: u32) {
        shuttle::thread::yield_now();
    }

    /// `parking_lot::Mutex`'s interface over shuttle's mutex.
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(v: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(v))
        }

        pub(crate) fn lock(&self) -> shuttle::sync::MutexGuard<'_, T> {
            self.0.lock().unwrap()
        }
    }
}

#[path = "../src/allocator/front/delta.rs"]
mod delta;
#[path = "../src/allocator/front/shared.rs"]
mod shared;

use std::sync::Arc;

use cuda_caching_allocator::size_class::PoolKind;
use delta::Delta;
use shared::{CACHED, DescView, GONE, LIVE, Shared, VACANT};
use shuttle::sync::Mutex as CoreLock;
use shuttle::sync::atomic::{AtomicUsize, Ordering};
use shuttle::thread;

/// Schedules per scenario and strategy (a few seconds in all in a debug build).
fn iterations() -> usize {
    std::env::var("SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

/// Runs `f` under random schedules and under PCT with up to 3 preemptions, with room on the
/// stack for descriptor chunks.
fn explore(f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let config = || {
        let mut c = shuttle::Config::new();
        c.stack_size = 1 << 20;
        c
    };
    let g = Arc::clone(&f);
    shuttle::Runner::new(
        shuttle::scheduler::RandomScheduler::new(iterations()),
        config(),
    )
    .run(move || g());
    shuttle::Runner::new(
        shuttle::scheduler::PctScheduler::new(3, iterations()),
        config(),
    )
    .run(move || f());
}

const VIEW: DescView = DescView {
    ptr: 0x10_0000,
    block_size: 4096,
    kind: PoolKind::Small,
    core_req: 4000,
    user_req: 4000,
};

/// A cache with one block in descriptor 0, in `state` (with its counters as the owner leaves
/// them), and the lock-guarded foreign account of the front's bookkeeping.
fn cache_with_block(state: u32) -> (Arc<Shared>, Arc<CoreLock<Delta>>) {
    let cell = Arc::new(Shared::new(Arc::new(AtomicUsize::new(0))));
    let chunk = Arc::new(shared::Chunk::default());
    chunk.0[0].fill(&VIEW);
    cell.chunks.lock().push(chunk);
    if state == CACHED {
        // What `Local::give` does: the CAS, then the counters.
        cell.desc(0).unwrap().0.0[0]
            .transition(LIVE, CACHED)
            .unwrap();
        cell.counters.cache(1, [1, 4096, 4000]);
    }
    (cell, Arc::new(CoreLock::new(Delta::default())))
}

fn with_desc<R>(cell: &Shared, f: impl FnOnce(&shared::Desc) -> R) -> R {
    let (c, k) = cell.desc(0).unwrap();
    f(&c.0[k])
}

/// The front's recount: the cache's delta plus its foreign account equals the contribution of
/// the block's state (a `GONE` block was returned to the core: it contributes nothing).
fn recounts(cell: &Shared, foreign: &Delta) {
    let mut have = cell.counters.delta();
    have.add(foreign);
    let state = with_desc(cell, |d| d.state.load(Ordering::Acquire));
    let v = with_desc(cell, |d| d.view());
    let c = v.contribution(state);
    let cur = have.currents();
    assert_eq!(
        [cur[0], cur[3], cur[6]],
        c,
        "state {state}: delta + foreign = {cur:?}"
    );
}

/// A flush (`Front::steal_cached`) of the block, under the core lock: `CACHED → GONE` and its
/// contribution into the foreign account. Returns whether it took the block.
fn flush(cell: &Shared, lock: &CoreLock<Delta>) -> bool {
    let mut foreign = lock.lock().unwrap();
    with_desc(cell, |d| {
        if d.transition(CACHED, GONE).is_ok() {
            let v = d.view();
            foreign.retire(v.kind, v.contribution(CACHED), 1);
            true
        } else {
            false
        }
    })
}

/// A free by a thread that does not own the block (`Front::free_elsewhere`), under the core
/// lock: `LIVE → GONE`; `Err(state)` when it lost.
fn foreign_free(cell: &Shared, lock: &CoreLock<Delta>) -> Result<(), u32> {
    let mut foreign = lock.lock().unwrap();
    with_desc(cell, |d| {
        d.transition(LIVE, GONE)?;
        let v = d.view();
        foreign.retire(v.kind, v.contribution(LIVE), 1);
        Ok(())
    })
}

#[test]
fn a_hit_and_a_flush_never_both_take_a_cached_block() {
    explore(|| {
        let (cell, lock) = cache_with_block(CACHED);
        let owner = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                // `Local::take`: the CAS, then the user's size and the counters.
                with_desc(&cell, |d| {
                    if d.transition(CACHED, LIVE).is_ok() {
                        d.set_user_req(3000);
                        cell.counters.hit(1, [1, 4096, 3000]);
                        true
                    } else {
                        false
                    }
                })
            })
        };
        let flusher = {
            let (cell, lock) = (Arc::clone(&cell), Arc::clone(&lock));
            thread::spawn(move || flush(&cell, &lock))
        };
        let (hit, flushed) = (owner.join().unwrap(), flusher.join().unwrap());
        assert!(
            hit ^ flushed,
            "hit {hit}, flush {flushed}: exactly one must take the block"
        );
        let state = with_desc(&cell, |d| d.state.load(Ordering::Acquire));
        assert_eq!(state, if hit { LIVE } else { GONE });
        recounts(&cell, &lock.lock().unwrap());
    });
}

#[test]
fn the_owners_cached_free_and_another_threads_free_never_both_win() {
    explore(|| {
        let (cell, lock) = cache_with_block(LIVE);
        let owner = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                // `Local::give`.
                with_desc(&cell, |d| {
                    let r = d.transition(LIVE, CACHED);
                    if r.is_ok() {
                        cell.counters.cache(1, [1, 4096, d.user_req() as i64]);
                    }
                    r
                })
            })
        };
        let other = {
            let (cell, lock) = (Arc::clone(&cell), Arc::clone(&lock));
            thread::spawn(move || foreign_free(&cell, &lock))
        };
        let (cached, freed) = (owner.join().unwrap(), other.join().unwrap());
        match (cached, freed) {
            // The other thread's free finds the block cached: a double free.
            (Ok(()), Err(s)) => assert_eq!(s, CACHED),
            // The owner's fast free finds it gone: the locked path reports it.
            (Err(s), Ok(())) => assert_eq!(s, GONE),
            other => panic!("exactly one free must win: {other:?}"),
        }
        recounts(&cell, &lock.lock().unwrap());
    });
}

#[test]
fn two_foreign_frees_of_one_block_have_one_winner() {
    explore(|| {
        let (cell, lock) = cache_with_block(LIVE);
        let frees: Vec<_> = (0..2)
            .map(|_| {
                let (cell, lock) = (Arc::clone(&cell), Arc::clone(&lock));
                thread::spawn(move || foreign_free(&cell, &lock))
            })
            .collect();
        let wins = frees
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(Result::is_ok)
            .count();
        assert_eq!(wins, 1);
        recounts(&cell, &lock.lock().unwrap());
    });
}

/// The allocator's next locked operation after a thread exit (`Front::reclaim_exited`): when
/// the exit count is set, clear it and take every cached block of exited caches.
fn reclaim(cell: &Shared, exits: &AtomicUsize, lock: &CoreLock<Delta>) -> usize {
    let mut foreign = lock.lock().unwrap();
    if exits.load(Ordering::Acquire) == 0 {
        return 0;
    }
    exits.store(0, Ordering::Release);
    if !cell.exited.load(Ordering::Acquire) {
        return 0;
    }
    let mut n = 0;
    cell.each_desc(|_, d| {
        if d.transition(CACHED, GONE).is_ok() {
            let v = d.view();
            foreign.retire(v.kind, v.contribution(CACHED), 1);
            n += 1;
        }
    });
    n
}

#[test]
fn a_thread_that_exits_with_cached_blocks_gives_them_all_back() {
    explore(|| {
        let exits = Arc::new(AtomicUsize::new(0));
        let cell = Arc::new(Shared::new(Arc::clone(&exits)));
        let chunk = Arc::new(shared::Chunk::default());
        for k in 0..3 {
            chunk.0[k].fill(&DescView {
                ptr: 0x10_0000 + 4096 * k as u64,
                ..VIEW
            });
        }
        cell.chunks.lock().push(chunk);
        let lock = Arc::new(CoreLock::new(Delta::default()));
        let owner = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                // Two blocks freed into the bins, one kept live; then the thread ends.
                for k in 0..2 {
                    let (c, i) = cell.desc(k).unwrap();
                    c.0[i].transition(LIVE, CACHED).unwrap();
                    cell.counters.cache(1, [1, 4096, 4000]);
                }
                cell.thread_exited();
            })
        };
        // Locked operations of another thread, racing the exit.
        let other = {
            let (cell, exits, lock) = (Arc::clone(&cell), Arc::clone(&exits), Arc::clone(&lock));
            thread::spawn(move || reclaim(&cell, &exits, &lock) + reclaim(&cell, &exits, &lock))
        };
        owner.join().unwrap();
        let taken = other.join().unwrap() + reclaim(&cell, &exits, &lock);
        assert_eq!(
            taken, 2,
            "every cached block of the exited thread comes back, once"
        );
        let mut states = Vec::new();
        cell.each_desc(|_, d| states.push(d.state.load(Ordering::Acquire)));
        assert_eq!(&states[..3], &[GONE, GONE, LIVE]);
        assert!(states[3..].iter().all(|&s| s == VACANT));
        let mut have = cell.counters.delta();
        have.add(&lock.lock().unwrap());
        assert_eq!(have.currents()[0], 0, "the live block contributes nothing");
    });
}

#[test]
fn a_stats_read_sees_the_counters_of_one_instant() {
    explore(|| {
        let (cell, _) = cache_with_block(CACHED);
        let owner = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                // Hits and cached frees of the block, as a hot loop makes them.
                for _ in 0..2 {
                    cell.counters.hit(1, [1, 4096, 3000]);
                    cell.counters.cache(1, [1, 4096, 3000]);
                }
            })
        };
        let reader = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || {
                for _ in 0..2 {
                    let d = cell.counters.delta();
                    let cur = d.currents();
                    // Between updates the block is cached (−1) or live (0), never anything else.
                    assert!(
                        matches!((cur[0], cur[3]), (-1, -4096) | (0, 0)),
                        "torn read: count {}, bytes {}",
                        cur[0],
                        cur[3]
                    );
                    assert_eq!(d.count[0].allocated - d.count[0].freed, cur[0]);
                }
            })
        };
        owner.join().unwrap();
        reader.join().unwrap();
        assert_eq!(cell.counters.delta().currents()[0], -1);
    });
}
