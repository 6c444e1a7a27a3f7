//! Thread scaling round by round (#11, goal 5): `N` threads, each on its own stream, do 1 MiB
//! allocate + free pairs on one allocator in successive rounds (fresh threads each round, as
//! `gpu_bench` spawns them; two warm-up bursts of 16 pairs behind barriers, then the timed
//! pairs). Prints, per round, the aggregate ns per pair (wall time from the first thread's start
//! to the last one's end, over all pairs), the slowest and fastest thread's time, and the driver
//! calls made during the timed part with the host time inside them (`CudaDevice::call_times`;
//! on `SimDevice`, its device calls and their modeled time). `gpu_bench` reports one median over
//! its rounds; this shows whether a slow figure is the steady state or the rounds in which the
//! streams' memory is still being rearranged (pages moved between the streams' segments at the
//! memory floor).
//!
//! ```text
//! cargo run --release --example thread_settling -- [sim|cuda] [THREADS] [PAIRS] [CONFIG]
//! cargo run --release --example thread_settling --features cuda -- cuda 16 200000
//! ```
//!
//! Defaults: `sim`, 16 threads, 200,000 pairs per thread and round, the crate's default
//! configuration; 6 rounds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use cuda_caching_allocator::{
    AllocatorConfig, CachingAllocator, DeviceBackend, SimDevice, StreamId,
};

/// Rounds per run.
const ROUNDS: usize = 6;
/// Bytes per allocation.
const SIZE: usize = 1 << 20;

/// One round: the aggregate ns per pair, the fastest and slowest thread's timed part, and what
/// `probe` reports between the timed parts' start and end (driver calls and their ns).
fn round<B: DeviceBackend>(
    a: &CachingAllocator<B>,
    streams: &[StreamId],
    threads: usize,
    pairs: u64,
    probe: &(dyn Fn() -> (u64, u64) + Sync),
) -> (f64, Duration, Duration, (u64, u64)) {
    let (warm, start, end) = (
        Barrier::new(threads),
        Barrier::new(threads),
        Barrier::new(threads),
    );
    let spans = Mutex::new(Vec::new());
    let calls = Mutex::new(((0, 0), (0, 0)));
    std::thread::scope(|s| {
        for t in 0..threads {
            let (warm, start, end, spans, calls) = (&warm, &start, &end, &spans, &calls);
            let stream = streams[t % streams.len()];
            s.spawn(move || {
                for barrier in [warm, start] {
                    for _ in 0..16 {
                        let x = a.allocate(SIZE, stream).expect("warm-up allocation");
                        a.free(x.ptr).expect("warm-up free");
                    }
                    barrier.wait();
                }
                if t == 0 {
                    calls.lock().unwrap().0 = probe();
                }
                let t0 = Instant::now();
                for _ in 0..pairs {
                    let x = a
                        .allocate(std::hint::black_box(SIZE), stream)
                        .expect("allocate");
                    a.free(std::hint::black_box(x.ptr)).expect("free");
                }
                spans.lock().unwrap().push((t0, Instant::now()));
                end.wait();
                if t == 0 {
                    calls.lock().unwrap().1 = probe();
                }
            });
        }
    });
    let spans = spans.into_inner().unwrap();
    let first = spans.iter().map(|s| s.0).min().unwrap();
    let last = spans.iter().map(|s| s.1).max().unwrap();
    let fastest = spans.iter().map(|s| s.1 - s.0).min().unwrap();
    let slowest = spans.iter().map(|s| s.1 - s.0).max().unwrap();
    let ((c0, n0), (c1, n1)) = calls.into_inner().unwrap();
    let ns = (last - first).as_nanos() as f64 / (pairs * threads as u64) as f64;
    (ns, fastest, slowest, (c1 - c0, n1 - n0))
}

fn report<B: DeviceBackend>(
    label: &str,
    a: &CachingAllocator<B>,
    streams: &[StreamId],
    threads: usize,
    pairs: u64,
    probe: &(dyn Fn() -> (u64, u64) + Sync),
) {
    println!("{label}, {threads} thread(s), {pairs} pairs each per round");
    println!(
        "| round | aggregate ns / pair | fastest thread | slowest thread | driver calls in the timed part | µs in them |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in 0..ROUNDS {
        let (ns, fast, slow, (calls, call_ns)) = round(a, streams, threads, pairs, probe);
        println!(
            "| {r} | {ns:.1} | {:.2} ms | {:.2} ms | {calls} | {} |",
            fast.as_secs_f64() * 1e3,
            slow.as_secs_f64() * 1e3,
            call_ns / 1000
        );
    }
}

#[cfg(feature = "cuda")]
fn cuda(threads: usize, pairs: u64, config: AllocatorConfig, label: &str) {
    use cuda_caching_allocator::backend::cuda::CudaDevice;
    let device = CudaDevice::open(0).expect("CUDA device 0");
    // 16 streams of the device's context, admitted; `keep` holds them alive to the end.
    let mut keep = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..16 {
        let s = device.context().new_stream().expect("stream");
        streams.push(device.admit_stream(&s).expect("admit"));
        keep.push(s);
    }
    let a = CachingAllocator::new(&device, config).expect("allocator");
    let probe = || device.call_times().total();
    report(label, &a, &streams, threads, pairs, &probe);
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: usize, _: u64, _: AllocatorConfig, _: &str) {
    eprintln!("built without the CUDA backend: add --features cuda");
    std::process::exit(2);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let device = args.next().unwrap_or_else(|| "sim".into());
    let threads: usize = args.next().map_or(16, |s| s.parse().expect("THREADS"));
    let pairs: u64 = args.next().map_or(200_000, |s| s.parse().expect("PAIRS"));
    let settings = args.next().unwrap_or_else(|| "cca_preset:default".into());
    let config = AllocatorConfig::parse(&settings).expect("CONFIG");
    let label = format!("`{settings}` on {device}");
    if device == "cuda" {
        cuda(threads, pairs, config, &label);
    } else {
        let a =
            CachingAllocator::new(SimDevice::with_capacity(1 << 40), config).expect("allocator");
        let streams: Vec<StreamId> = (1..=16).map(StreamId).collect();
        // The simulated device's calls, and their modeled time in place of measured time.
        let probe = || {
            let c = a.backend().counters();
            (c.device_calls, c.modeled_device_ns)
        };
        report(&label, &a, &streams, threads, pairs, &probe);
    }
}
