//! The fast path (per-thread front caches) against the plain core on programs an adversarial
//! review wrote: the same peaks, `record_stream` honoured on a block another thread manages,
//! an export let go at the free. Each runs the program with `cca_fast_path` off and on, and
//! failed on the code before its fix.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::mpsc;

use cuda_caching_allocator::*;

use crate::util::{MIB, with_config};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn config(fast_path: bool) -> AllocatorConfig {
    AllocatorConfig::builder()
        .fast_path(fast_path)
        .build()
        .unwrap()
}

type Job = Box<dyn FnOnce(&CachingAllocator<SimDevice>) + Send>;

/// A second thread, kept alive between steps (its front cache is thread-local); `run` executes
/// one step on it and waits for it, so that one thread at a time uses the allocator.
struct Worker {
    tx: Option<mpsc::Sender<(Job, mpsc::Sender<()>)>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn new(a: &Arc<CachingAllocator<SimDevice>>) -> Self {
        let (tx, rx) = mpsc::channel::<(Job, mpsc::Sender<()>)>();
        let a = Arc::clone(a);
        let handle = std::thread::spawn(move || {
            for (job, done) in rx {
                job(&a);
                done.send(()).unwrap();
            }
        });
        Worker {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    fn run(&self, job: impl FnOnce(&CachingAllocator<SimDevice>) + Send + 'static) {
        let (done_tx, done_rx) = mpsc::channel();
        self.tx
            .as_ref()
            .unwrap()
            .send((Box::new(job), done_tx))
            .unwrap();
        done_rx.recv().unwrap();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// `(allocation, allocated_bytes, requested_bytes)` peaks (`all`).
fn peaks(s: &MemoryStats) -> (i64, i64, i64) {
    (
        s.allocation.get(StatType::All).peak,
        s.allocated_bytes.get(StatType::All).peak,
        s.requested_bytes.get(StatType::All).peak,
    )
}

/// `reset_peak_stats` clears the thread's `dirty` flag without publishing its delta
/// into `known`; the next miss then raises the peaks to `core + known`, where `known` still
/// counts the front-cached block as allocated. One thread, no hit in between.
#[test]
fn reset_peak_then_a_miss_keeps_the_plain_cores_peaks() {
    let run = |fast_path: bool| {
        let a = with_config(1 << 30, config(fast_path));
        // First sighting of (S0, 1 MiB): not managed.
        let w = a.allocate(MIB, S0).unwrap();
        a.free(w.ptr).unwrap();
        // A free 4 MiB block in the core, so that the miss below needs no growth (a growth
        // flushes, which would publish the delta and hide the defect).
        let v = a.allocate(4 * MIB, S0).unwrap();
        a.free(v.ptr).unwrap();
        // Second sighting: managed; its free goes into the front cache.
        let x = a.allocate(MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
        a.reset_peak_stats();
        let z = a.allocate(4 * MIB, S0).unwrap();
        let s = a.memory_stats();
        a.free(z.ptr).unwrap();
        peaks(&s)
    };
    let (plain, fast) = (run(false), run(true));
    assert_eq!(
        fast, plain,
        "(allocation, allocated_bytes, requested_bytes) peaks after reset_peak_stats and one \
         4 MiB allocation: fast path {fast:?}, plain core {plain:?}"
    );
}

/// Thread B caches a block in its front cache (delta changed, not yet published);
/// the main thread's growth flushes it (`foreign` moves into `known`), and the main thread's
/// closing synchronisation raises the peaks to `core + known`, where `known` holds B's stale
/// `published` (0) plus the flushed block's foreign contribution (+1 block, +1 MiB). One thread
/// at a time uses the allocator, for which Note [Peaks with several threads] promises exact
/// peaks.
#[test]
fn a_flush_of_another_threads_cache_keeps_the_plain_cores_peaks() {
    let run = |fast_path: bool| {
        let a = Arc::new(with_config(1 << 30, config(fast_path)));
        let b = Worker::new(&a);
        b.run(|a| {
            for _ in 0..2 {
                let x = a.allocate(MIB, S0).unwrap();
                a.free(x.ptr).unwrap(); // the second free is front-cached
            }
        });
        // Main thread: a 4 MiB allocation that grows (and so flushes B's S0 block first).
        let z = a.allocate(4 * MIB, S0).unwrap();
        let s = a.memory_stats();
        a.free(z.ptr).unwrap();
        drop(b);
        peaks(&s)
    };
    let (plain, fast) = (run(false), run(true));
    assert_eq!(
        fast, plain,
        "(allocation, allocated_bytes, requested_bytes) peaks: fast path {fast:?}, plain core \
         {plain:?} (max 1 MiB, then 4 MiB, never both)"
    );
}

/// `record_stream_locked` trusts the calling thread's own index: an entry left
/// `GONE` there (its block was freed by another thread and not cleaned up yet) hides that the
/// same address is now a live block managed by *another* thread's cache. `needs_core` is not
/// set on that block, so its owner's free caches it in the front and the next allocation hands
/// it out at once, while the work recorded on S1 is still pending.
#[test]
fn record_stream_on_a_block_another_thread_manages_under_a_stale_own_entry() {
    for fast_path in [false, true] {
        let a = Arc::new(with_config(1 << 30, config(fast_path)));
        let b = Worker::new(&a);
        // Main thread: (S0, 4096) admitted; x managed by the main thread's cache, live.
        let w = a.allocate(4096, S0).unwrap();
        a.free(w.ptr).unwrap();
        let x = a.allocate(4096, S0).unwrap();
        let (tx, rx) = mpsc::channel();
        // B: first sighting of the key; then B frees x (LIVE → GONE in the main thread's cache,
        // back to the core) and allocates the key again: the same address, now managed by B.
        b.run(move |a| {
            let w = a.allocate(4096, S0).unwrap();
            a.free(w.ptr).unwrap();
            a.free(x.ptr).unwrap();
            let y = a.allocate(4096, S0).unwrap();
            tx.send(y).unwrap();
        });
        let y = rx.recv().unwrap();
        assert_eq!(y.ptr, x.ptr, "the setting: B got x's address again");
        // Main thread: the block is used on S1 too, whose work is still queued.
        a.backend().submit_work(S1);
        a.record_stream(y.ptr, S1).unwrap();
        // B frees it and allocates the same size again.
        let (tx, rx) = mpsc::channel();
        b.run(move |a| {
            a.free(y.ptr).unwrap();
            let z = a.allocate(4096, S0).unwrap();
            tx.send(z).unwrap();
        });
        let z = rx.recv().unwrap();
        assert_ne!(
            z.ptr, y.ptr,
            "fast_path={fast_path}: the block was handed out again while the work recorded on \
             S1 (record_stream) is pending"
        );
        a.backend().complete_work(S1);
        let p = z.ptr;
        b.run(move |a| a.free(p).unwrap());
        drop(b);
    }
}

/// An exported allocation (`export_pages_with`) managed by the front cache: its free
/// goes into the thread's cache, so the core's `unexport` never runs and the backend is not
/// told to let go of the export (the contract: "when it is freed, the backend's
/// `release_export` is called"); a hit then hands the still-exported block to the next user.
/// The crate's default configuration (expandable segments, fast path on).
#[test]
fn an_exported_allocation_lets_its_export_go_when_freed() {
    for fast_path in [false, true] {
        let config = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
            .fast_path(fast_path)
            .build()
            .unwrap();
        let a = with_config(4 << 30, config);
        // (S0, 4096) admitted, so that x is managed by this thread's front cache.
        let w = a.allocate(4096, S0).unwrap();
        a.free(w.ptr).unwrap();
        let x = a.allocate(4096, S0).unwrap();
        let handles = a
            .export_pages_with(x.ptr, |pages, _| Ok(pages.handles.clone()))
            .unwrap()
            .unwrap();
        a.free(x.ptr).unwrap();
        assert_eq!(
            a.backend().released_exports(),
            handles,
            "fast_path={fast_path}: the export is let go when the allocation is freed"
        );
    }
}
