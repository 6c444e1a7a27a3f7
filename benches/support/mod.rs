//! Workloads shared by the criterion suites and `examples/gpu_bench.rs`, generic over the
//! device backend: warm alloc+free pairs, threads doing pairs at once, random mixes, and trace
//! replay from the shipped RMM CSV logs (with feature `trace-io`, for the crate's importer).
//!
//! Each workload returns the wall time of the work it was asked to do; callers divide.
#![allow(dead_code)]

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use cuda_caching_allocator::{
    Allocation, AllocatorConfig, CachingAllocator, DeviceBackend, StreamId,
};

/// The pair sizes of `reference.json`'s `pairs_ns_h200`.
pub(crate) const PAIR_SIZES: [usize; 5] = [512, 64 << 10, 1 << 20, 8 << 20, 64 << 20];
/// The thread counts of `reference.json`'s `threads_ns_per_pair_h200`.
pub(crate) const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
/// The pair size of the thread measurements (1 MiB, as in `reference.json`).
pub(crate) const THREAD_PAIR_SIZE: usize = 1 << 20;

/// The configurations compared: the `pytorch` preset, the same with the fast path
/// (`pytorch+fast`, `cca_fast_path:True`), and, with `all`, the crate's default (expandable
/// segments with page reuse and the fast path) and the default without the fast path
/// (`default-nofast`).
pub(crate) fn configs(all: bool) -> Vec<(&'static str, AllocatorConfig)> {
    let mut v = vec![
        ("pytorch", AllocatorConfig::pytorch()),
        (
            "pytorch+fast",
            AllocatorConfig {
                fast_path: true,
                ..AllocatorConfig::pytorch()
            },
        ),
    ];
    if all {
        v.push(("default", AllocatorConfig::default()));
        v.push((
            "default-nofast",
            AllocatorConfig {
                fast_path: false,
                ..AllocatorConfig::default()
            },
        ));
    }
    v
}

/// Human name of a size (`512 B`, `64 KiB`, `1 MiB`).
pub(crate) fn size_name(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else if size >= 1 << 10 {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

/// `iters` warm alloc+free pairs of `size` bytes on `stream` (one warm-up pair first, untimed).
///
/// # Panics
/// If the allocator fails (a benchmark cannot go on).
pub(crate) fn pairs<B: DeviceBackend>(
    a: &CachingAllocator<B>,
    size: usize,
    stream: StreamId,
    iters: u64,
) -> Duration {
    let x = a.allocate(size, stream).expect("warm-up allocation");
    a.free(x.ptr).expect("warm-up free");
    let t = Instant::now();
    for _ in 0..iters {
        let x = a.allocate(black_box(size), stream).expect("allocate");
        a.free(black_box(x.ptr)).expect("free");
    }
    t.elapsed()
}

/// `threads` threads, each doing `pairs_per_thread` warm pairs of `size` bytes on
/// `stream_of(thread)`, started together; returns the wall time from the first start until the
/// last finish (aggregate ns per pair = wall / (threads × pairs_per_thread)).
///
/// # Panics
/// If the allocator fails.
pub(crate) fn threads<B: DeviceBackend>(
    a: &CachingAllocator<B>,
    threads: usize,
    size: usize,
    pairs_per_thread: u64,
    stream_of: &(dyn Fn(usize) -> StreamId + Sync),
) -> Duration {
    let (warm, start) = (Barrier::new(threads), Barrier::new(threads));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (warm, start) = (&warm, &start);
                s.spawn(move || {
                    let stream = stream_of(t);
                    // Warm this thread's cache before the clock starts, twice: the first round
                    // grows the cache while other threads do too (growth flushes every front
                    // cache, and the default configuration may move pages between streams), the
                    // second runs once every thread holds its memory.
                    for barrier in [warm, start] {
                        for _ in 0..16 {
                            let x = a.allocate(size, stream).expect("warm-up allocation");
                            a.free(x.ptr).expect("warm-up free");
                        }
                        barrier.wait();
                    }
                    let t0 = Instant::now();
                    for _ in 0..pairs_per_thread {
                        let x = a.allocate(black_box(size), stream).expect("allocate");
                        a.free(black_box(x.ptr)).expect("free");
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        // Wall time: from the first thread's start to the last one's end (with more threads than
        // cores, threads run one after another, and their own times would overlap nothing).
        let spans: Vec<(Instant, Instant)> = handles
            .into_iter()
            .map(|h| h.join().expect("benchmark thread"))
            .collect();
        match (
            spans.iter().map(|s| s.0).min(),
            spans.iter().map(|s| s.1).max(),
        ) {
            (Some(first), Some(last)) => last.duration_since(first),
            _ => Duration::ZERO,
        }
    })
}

/// A small deterministic generator (xorshift).
#[derive(Clone, Debug)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next value.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Log-uniform in `[lo, hi]`.
    pub(crate) fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        let (l, h) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((l + u * (h - l)).exp() as usize).clamp(lo, hi)
    }
}

/// A random mix: `live` slots filled with log-uniform sizes in `[lo, hi]`, then `steps` times a
/// random slot is freed and refilled with a new size (2 operations per step).
#[derive(Clone, Debug)]
pub(crate) struct Mix {
    /// Slots.
    pub(crate) live: usize,
    /// `(slot, new size)` per step.
    pub(crate) steps: Vec<(usize, usize)>,
    /// Initial sizes.
    pub(crate) initial: Vec<usize>,
}

impl Mix {
    /// A mix with a fixed seed.
    pub(crate) fn new(live: usize, lo: usize, hi: usize, steps: usize, seed: u64) -> Self {
        let mut r = Rng(seed | 1);
        let initial = (0..live).map(|_| r.log_uniform(lo, hi)).collect();
        let steps = (0..steps)
            .map(|_| ((r.next() % live as u64) as usize, r.log_uniform(lo, hi)))
            .collect();
        Mix {
            live,
            steps,
            initial,
        }
    }

    /// Fills the slots (untimed), runs the steps (timed), frees everything (untimed). Returns
    /// the time of the steps; ns per operation = time / (2 × steps).
    ///
    /// # Panics
    /// If the allocator fails.
    pub(crate) fn run<B: DeviceBackend>(
        &self,
        a: &CachingAllocator<B>,
        stream: StreamId,
    ) -> Duration {
        let mut slots: Vec<Allocation> = self
            .initial
            .iter()
            .map(|&s| a.allocate(s, stream).expect("fill"))
            .collect();
        let t = Instant::now();
        for &(k, size) in &self.steps {
            a.free(slots[k].ptr).expect("free");
            slots[k] = a.allocate(size, stream).expect("allocate");
        }
        let d = t.elapsed();
        for x in slots {
            a.free(x.ptr).expect("free");
        }
        d
    }
}

/// One operation of a compiled trace: allocation slots stand for the recorded pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) enum TraceStep {
    /// Allocate `size` bytes on `stream` into `slot`.
    Alloc {
        /// Slot index.
        slot: u32,
        /// Requested bytes.
        size: usize,
        /// Stream.
        stream: u64,
    },
    /// Free the allocation in `slot`.
    Free {
        /// Slot index.
        slot: u32,
    },
}

/// A trace compiled for timing: steps over a dense slot table.
#[derive(Clone, Debug)]
pub(crate) struct CompiledTrace {
    /// The trace's name (file stem).
    pub(crate) name: String,
    /// The steps.
    pub(crate) steps: Vec<TraceStep>,
    /// Slots needed.
    pub(crate) slots: usize,
}

impl CompiledTrace {
    /// Compiles `(is_alloc, key, size, stream)` events (the key names an allocation: a pointer
    /// or an id): frees of keys never allocated are dropped.
    pub(crate) fn compile(
        name: &str,
        events: impl Iterator<Item = (bool, u64, usize, u64)>,
    ) -> Self {
        let mut by_ptr = std::collections::HashMap::new();
        let mut free_slots: Vec<u32> = Vec::new();
        let mut slots = 0u32;
        let mut steps = Vec::new();
        for (alloc, ptr, size, stream) in events {
            if alloc {
                let slot = free_slots.pop().unwrap_or_else(|| {
                    slots += 1;
                    slots - 1
                });
                by_ptr.insert(ptr, slot);
                steps.push(TraceStep::Alloc { slot, size, stream });
            } else if let Some(slot) = by_ptr.remove(&ptr) {
                free_slots.push(slot);
                steps.push(TraceStep::Free { slot });
            }
        }
        CompiledTrace {
            name: name.to_string(),
            steps,
            slots: slots as usize,
        }
    }

    /// Replays the steps (timed) and frees what is left (untimed); ns per operation = time /
    /// `steps.len()`. `stream_of` maps recorded stream values to the backend's streams.
    ///
    /// # Panics
    /// If the allocator fails.
    pub(crate) fn run<B: DeviceBackend>(
        &self,
        a: &CachingAllocator<B>,
        stream_of: &dyn Fn(u64) -> StreamId,
    ) -> Duration {
        let mut slots: Vec<Option<Allocation>> = vec![None; self.slots];
        let t = Instant::now();
        for step in &self.steps {
            match *step {
                TraceStep::Alloc { slot, size, stream } => {
                    slots[slot as usize] =
                        Some(a.allocate(size, stream_of(stream)).expect("allocate"));
                }
                TraceStep::Free { slot } => {
                    if let Some(x) = slots[slot as usize].take() {
                        a.free(x.ptr).expect("free");
                    }
                }
            }
        }
        let d = t.elapsed();
        for x in slots.into_iter().flatten() {
            a.free(x.ptr).expect("free");
        }
        d
    }
}

/// Reads a trace file with the crate's importer (RMM CSV or PyTorch snapshot, plain or gzipped)
/// and compiles it.
#[cfg(feature = "trace-io")]
pub(crate) fn read_trace(path: &std::path::Path) -> Option<CompiledTrace> {
    use cuda_caching_allocator::trace::{ImportOptions, TraceOp, read_trace_file};
    let trace = read_trace_file(path, &ImportOptions::lenient()).ok()?.trace;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .map_or("trace", |n| n.split('.').next().unwrap_or(n))
        .to_string();
    // Allocation ids stand in for pointers.
    let events = trace.events.iter().filter_map(|e| match e.op {
        TraceOp::Alloc {
            id, size, stream, ..
        } => Some((true, id, size as usize, stream)),
        TraceOp::Free { id } => Some((false, id, 0, 0)),
        _ => None,
    });
    Some(CompiledTrace::compile(&name, events))
}

/// The shipped traces (`examples/traces/*.csv.gz`), sorted by name; empty without `trace-io`.
pub(crate) fn shipped_traces(dir: &std::path::Path) -> Vec<CompiledTrace> {
    #[cfg(feature = "trace-io")]
    {
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.to_str()
                            .is_some_and(|s| s.ends_with(".csv.gz") || s.ends_with(".csv"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        paths.sort();
        paths.iter().filter_map(|p| read_trace(p)).collect()
    }
    #[cfg(not(feature = "trace-io"))]
    {
        let _ = dir;
        Vec::new()
    }
}

/// The directory of the shipped traces: `examples/traces` under the current directory when it
/// exists (a binary carried to another machine, run from a checkout), else under this crate.
pub(crate) fn traces_dir() -> std::path::PathBuf {
    let here = std::path::PathBuf::from("examples/traces");
    if here.is_dir() {
        here
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces")
    }
}
