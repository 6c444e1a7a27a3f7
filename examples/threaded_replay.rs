//! Replays a trace on the simulated device with every event issued from the thread the trace
//! names (`TraceEvent::thread`; one replay thread per distinct id), in the trace's order, one
//! event at a time: what the per-thread front caches of the fast path see in a program that
//! allocates from several threads (FSDP2: the forward on the training loop's thread, the
//! backward and its all-gathers on autograd's). `cca replay` runs every event on one thread.
//!
//! ```text
//! cargo run --release --example threaded_replay --features trace-io -- TRACE [LAG] [CONFIG...]
//! ```
//!
//! `TRACE` is a trace with thread ids (an RMM-style CSV log such as `gpu/clients.py --record
//! --record-threads` writes); `LAG` the simulated device's event-query lag (default 0);
//! `CONFIG`s are configuration strings (default: the crate's default with and without the fast
//! path). Prints, per configuration, peak reserved over peak live bytes, the device calls, the
//! modeled device time and the host ns of the allocator's own calls (mean and median per call),
//! first with every event on one thread (`replay`, every operation timed) and then on its own
//! thread (each `allocate` and `free` timed around the call; the hand-over between threads is
//! not counted, but it leaves each call starting on a thread that just woke up).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use cuda_caching_allocator::trace::{ImportOptions, Trace, TraceOp, read_trace_file};
use cuda_caching_allocator::{
    AllocatorConfig, CachingAllocator, DeviceAddr, ReplayOptions, SimDevice, StreamId, replay,
};

/// What a replay thread is asked to do.
enum Job {
    Alloc { id: u64, size: usize, stream: u64 },
    Free { id: u64 },
}

/// Peak reserved bytes, peak live bytes, device calls (map, unmap, create), modeled ns, and the
/// host ns the allocator's own calls took (allocate and free, each timed around the call): the
/// mean and the median per call.
struct Outcome {
    peak_reserved: u64,
    peak_live: u64,
    calls: Vec<(&'static str, u64)>,
    modeled_ns: u64,
    host_ns_mean: f64,
    host_ns_p50: u64,
}

fn threaded(trace: &Trace, config: AllocatorConfig, lag: u32) -> Outcome {
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    let alloc = Arc::new(CachingAllocator::new(dev, config).unwrap());
    let before = alloc.backend().counters();
    let live: Arc<Mutex<HashMap<u64, (DeviceAddr, u64)>>> = Arc::default();
    let mut workers: HashMap<u32, mpsc::SyncSender<Job>> = HashMap::new();
    let (done_tx, done_rx) = mpsc::sync_channel::<()>(0);
    let mut handles = Vec::new();
    let mut live_bytes = 0u64;
    let mut peak_live = 0u64;
    let mut peak_reserved = 0u64;
    let host_ns: Arc<Mutex<Vec<u64>>> = Arc::default();
    for ev in &trace.events {
        let job = match ev.op {
            TraceOp::Alloc {
                id, size, stream, ..
            } => {
                live_bytes += size;
                peak_live = peak_live.max(live_bytes);
                Job::Alloc {
                    id,
                    size: size as usize,
                    stream,
                }
            }
            TraceOp::Free { id } => Job::Free { id },
            _ => continue,
        };
        let tx = workers.entry(ev.thread).or_insert_with(|| {
            let (tx, rx) = mpsc::sync_channel::<Job>(0);
            let alloc = Arc::clone(&alloc);
            let live = Arc::clone(&live);
            let host_ns = Arc::clone(&host_ns);
            let done = done_tx.clone();
            handles.push(thread::spawn(move || {
                for job in rx {
                    match job {
                        Job::Alloc { id, size, stream } => {
                            let t = Instant::now();
                            let a = alloc.allocate(size, StreamId(stream)).expect("allocate");
                            let ns = t.elapsed().as_nanos() as u64;
                            host_ns.lock().unwrap().push(ns);
                            live.lock().unwrap().insert(id, (a.ptr, size as u64));
                        }
                        Job::Free { id } => {
                            let (ptr, _) = live.lock().unwrap().remove(&id).expect("known id");
                            let t = Instant::now();
                            alloc.free(ptr).expect("free");
                            let ns = t.elapsed().as_nanos() as u64;
                            host_ns.lock().unwrap().push(ns);
                        }
                    }
                    done.send(()).unwrap();
                }
            }));
            tx
        });
        let freed = match job {
            Job::Free { id } => live.lock().unwrap().get(&id).map_or(0, |v| v.1),
            Job::Alloc { .. } => 0,
        };
        tx.send(job).unwrap();
        done_rx.recv().unwrap();
        live_bytes -= freed;
        peak_reserved = peak_reserved.max(alloc.memory_reserved() as u64);
    }
    drop(workers);
    for h in handles {
        h.join().unwrap();
    }
    let mut times = std::mem::take(&mut *host_ns.lock().unwrap());
    let after = alloc.backend().counters();
    let calls = after
        .call_counts()
        .iter()
        .zip(before.call_counts())
        .map(|(&(n, a), (_, b))| (n, a - b))
        .filter(|(n, _)| ["create", "map", "unmap"].contains(n))
        .collect();
    Outcome {
        peak_reserved,
        peak_live,
        calls,
        modeled_ns: after.modeled_device_ns - before.modeled_device_ns,
        host_ns_mean: mean(&times),
        host_ns_p50: median(&mut times),
    }
}

fn one_thread(trace: &Trace, config: AllocatorConfig, lag: u32) -> Outcome {
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    let alloc = CachingAllocator::new(dev, config).unwrap();
    let options = ReplayOptions {
        timing: true,
        time_one_in: 1,
        ..ReplayOptions::default()
    };
    let r = replay(&alloc, trace, &options).unwrap();
    Outcome {
        peak_reserved: r.peak_reserved_bytes,
        peak_live: r.peak_live_bytes,
        calls: ["create", "map", "unmap"]
            .iter()
            .map(|n| (*n, r.device_call(n)))
            .collect(),
        modeled_ns: r.modeled_device_ns.unwrap_or(0),
        host_ns_mean: r.latency.as_ref().map_or(f64::NAN, |l| l.mean_ns),
        host_ns_p50: r.latency.as_ref().map_or(0, |l| l.p50_ns),
    }
}

fn mean(v: &[u64]) -> f64 {
    v.iter().sum::<u64>() as f64 / v.len().max(1) as f64
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: threaded_replay TRACE [LAG] [CONFIG...]");
    let lag: u32 = args.next().map_or(0, |s| s.parse().expect("LAG"));
    let mut configs: Vec<String> = args.collect();
    if configs.is_empty() {
        configs = vec![
            "cca_preset:default".into(),
            "cca_preset:default,cca_fast_path:False".into(),
        ];
    }
    let trace = read_trace_file(&path, &ImportOptions::strict())
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trace;
    let mut threads: Vec<u32> = trace.events.iter().map(|e| e.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    println!(
        "{path}: {} events, {} threads, query lag {lag}",
        trace.events.len(),
        threads.len()
    );
    println!(
        "| configuration | replay | reserved / live | create | map | unmap | modeled ms | host ns per call: mean, median |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for c in &configs {
        let config = AllocatorConfig::parse(c).unwrap();
        for (name, o) in [
            ("one thread", one_thread(&trace, config.clone(), lag)),
            (
                "threads of the trace",
                threaded(&trace, config.clone(), lag),
            ),
        ] {
            let get = |k: &str| o.calls.iter().find(|(n, _)| *n == k).map_or(0, |v| v.1);
            println!(
                "| `{c}` | {name} | {:.4} | {} | {} | {} | {:.1} | {:.0}, {} |",
                o.peak_reserved as f64 / o.peak_live.max(1) as f64,
                get("create"),
                get("map"),
                get("unmap"),
                o.modeled_ns as f64 / 1e6,
                o.host_ns_mean,
                o.host_ns_p50
            );
        }
    }
}
