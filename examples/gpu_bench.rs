//! Host-side allocator timings in the shape of `reference.json` (PyTorch's own figures on an
//! H200 host), for the `pytorch` preset without and with the fast path (`cca_fast_path:True`) and
//! the crate's default (expandable segments with page reuse, fast path on) with and without it,
//! on a real GPU or on `SimDevice`:
//!
//! * warm alloc+free pairs at 512 B, 64 KiB, 1 MiB, 8 MiB and 64 MiB (ns per pair, one thread);
//! * 1, 2, 4, 8 and 16 threads doing 1 MiB pairs at once, each on its own stream and all on the
//!   default stream (aggregate ns per pair: wall time ÷ all threads' pairs);
//! * replay of each shipped trace (`examples/traces/*.csv.gz`, needs feature `trace-io`), ns per
//!   operation, on a fresh allocator (its first device allocations included);
//! * two random mixes (ns per operation).
//!
//! ```text
//! cargo run --release --example gpu_bench --features cuda,trace-io -- --device cuda
//! cargo run --release --example gpu_bench --features trace-io -- --device sim
//! ```
//!
//! For a GPU machine without Rust, build here and carry the binary (see `benches/README.md`):
//! `cargo build --release --example gpu_bench --features cuda,trace-io`, then run
//! `gpu_bench --device cuda` from the repository root there (it finds `examples/traces`).
//!
//! With `--interop` (CUDA only) it measures instead what a cudarc buffer of the cache costs
//! while cudarc orders streams (two streams, event tracking on): a warm `alloc_zeros` of 1 KiB
//! (its memset is the buffer's first use) and its drop, and the capture-status query that a
//! buffer's first use makes (Note [Event shells and captures] in `src/interop/slice.rs`).
//!
//! Options: `--device cuda|sim` (default `sim`), `--ordinal N` (CUDA device, default 0),
//! `--quick` (fewer repetitions), `--interop`, `--traces DIR` (default: the crate's `examples/traces`),
//! `--json FILE` (also write the figures as JSON). Each figure is the median of 5 runs (2 with
//! `--quick`). Only the lines under `#[cfg(feature = "cuda")]` name the CUDA backend; the rest is
//! generic over `DeviceBackend`.

#[path = "../benches/support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cuda_caching_allocator::{
    AllocError, AllocatorConfig, CachingAllocator, DeviceBackend, SimDevice, StreamId,
};

/// PyTorch 2.11 on the H200 host (`reference.json`): pair ns for `PAIR_SIZES`, native and
/// cudaMallocAsync.
const REF_PAIRS: [(f64, f64); 5] = [
    (785.6, 1180.0),
    (834.2, 1201.6),
    (530.5, 695.0),
    (500.9, 891.7),
    (372.6, 691.6),
];
/// PyTorch 2.11 on the H200 host: aggregate ns per 1 MiB pair for `THREADS`, native and
/// cudaMallocAsync.
const REF_THREADS: [(f64, f64); 5] = [
    (782.9, 727.1),
    (1295.0, 2176.2),
    (2157.0, 3693.9),
    (2969.3, 3083.6),
    (3630.7, 3709.5),
];
/// PyTorch 2.11 on the H200 host: replay ns per operation (trace, native, cudaMallocAsync).
const REF_REPLAY: [(&str, f64, f64); 3] = [
    ("bert_varlen", 2912.0, 1021.0),
    ("gpt2_train", 1058.0, 2245.0),
    ("resnet50_train", 1587.0, 1726.0),
];

#[derive(Clone, Debug)]
struct Args {
    device: String,
    ordinal: usize,
    quick: bool,
    traces: PathBuf,
    json: Option<PathBuf>,
    interop: bool,
    /// `--pairs-rounds N`: only the cached pairs, `N` rounds (0: the whole benchmark).
    pair_rounds: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        device: "sim".into(),
        ordinal: 0,
        quick: false,
        traces: support::traces_dir(),
        json: None,
        interop: false,
        pair_rounds: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => args.device = it.next().ok_or("--device needs cuda or sim")?,
            "--ordinal" => {
                args.ordinal = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or("--ordinal needs a number")?;
            }
            "--quick" => args.quick = true,
            "--interop" => args.interop = true,
            "--traces" => args.traces = it.next().ok_or("--traces needs a directory")?.into(),
            "--json" => args.json = Some(it.next().ok_or("--json needs a file")?.into()),
            "--pairs-rounds" => {
                args.pair_rounds = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|&n: &usize| n > 0)
                    .ok_or("--pairs-rounds needs a number of rounds ≥ 1")?;
            }
            // `cargo bench` passes `--bench`; ignore it.
            "--bench" => {}
            "-h" | "--help" => {
                return Err(
                    "usage: gpu_bench [--device cuda|sim] [--ordinal N] [--quick] \
                            [--traces DIR] [--json FILE] [--interop] [--pairs-rounds N]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument '{other}' (try --help)")),
        }
    }
    if !matches!(args.device.as_str(), "cuda" | "sim") {
        return Err(format!("unknown device '{}': use cuda or sim", args.device));
    }
    Ok(args)
}

/// The median of `runs` measurements of `ns per op`.
fn median(runs: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..runs).map(|_| f()).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Iterations that take about `target` given a probe of `probe` iterations.
fn calibrate(probe: u64, target: Duration, f: &mut dyn FnMut(u64) -> Duration) -> u64 {
    let t = f(probe).as_secs_f64().max(1e-9);
    ((target.as_secs_f64() / t) * probe as f64).clamp(probe as f64, 5e7) as u64
}

/// ns per warm pair of `size` bytes on `a`: calibrated to about `target` per run, one run to
/// warm, then the median of `runs`.
fn pair_ns<B: DeviceBackend>(
    a: &CachingAllocator<B>,
    size: usize,
    stream: StreamId,
    runs: usize,
    target: Duration,
) -> f64 {
    let mut f = |n: u64| support::pairs(a, size, stream, n);
    let iters = calibrate(1000, target, &mut f);
    f(iters);
    median(runs, || f(iters).as_nanos() as f64 / iters as f64)
}

/// The figures of one configuration.
#[derive(Clone, Debug, Default)]
struct Figures {
    pairs: Vec<f64>,
    threads_own: Vec<f64>,
    threads_shared: Vec<f64>,
    replay: Vec<(String, f64)>,
    mixes: Vec<(String, f64)>,
}

/// Runs every measurement for `config` on allocators from `make`. `streams` are 16 distinct
/// streams the backend accepts (one per thread), `shared` the stream all threads share.
fn measure<B: DeviceBackend>(
    make: &dyn Fn(AllocatorConfig) -> Result<CachingAllocator<B>, AllocError>,
    config: &AllocatorConfig,
    streams: &[StreamId],
    shared: StreamId,
    args: &Args,
    traces: &[support::CompiledTrace],
) -> Result<Figures, AllocError> {
    let runs = if args.quick { 2 } else { 5 };
    let target = Duration::from_millis(if args.quick { 50 } else { 200 });
    let mut fig = Figures::default();
    {
        // Warm the CPU (frequency, caches, this thread's tables) so the first size is not
        // penalised.
        let a = make(config.clone())?;
        let mut f = |n: u64| support::pairs(&a, 4096, shared, n);
        let iters = calibrate(1000, target, &mut f);
        f(iters);
    }
    for size in support::PAIR_SIZES {
        let a = make(config.clone())?;
        fig.pairs.push(pair_ns(&a, size, shared, runs, target));
        eprint!(".");
    }
    for (own, out) in [
        (true, &mut fig.threads_own),
        (false, &mut fig.threads_shared),
    ] {
        for n in support::THREADS {
            let a = make(config.clone())?;
            let stream_of = |t: usize| {
                if own {
                    streams[t % streams.len()]
                } else {
                    shared
                }
            };
            let mut f =
                |per: u64| support::threads(&a, n, support::THREAD_PAIR_SIZE, per, &stream_of);
            let per = calibrate(200, target, &mut f);
            out.push(median(runs, || {
                f(per).as_nanos() as f64 / (per * n as u64) as f64
            }));
            eprint!(".");
        }
    }
    for trace in traces {
        let ops = trace.steps.len().max(1) as f64;
        let ns = median(runs, || {
            let a = make(config.clone()).expect("allocator");
            trace.run(&a, &|_| shared).as_nanos() as f64 / ops
        });
        fig.replay.push((trace.name.clone(), ns));
        eprint!(".");
    }
    for (name, mix) in [
        (
            "mix: 2,000 live, 512 B – 64 MiB",
            support::Mix::new(
                2000,
                512,
                64 << 20,
                if args.quick { 20_000 } else { 100_000 },
                7,
            ),
        ),
        (
            "mix: 20,000 live, 512 B – 1 MiB",
            support::Mix::new(
                20_000,
                512,
                1 << 20,
                if args.quick { 20_000 } else { 100_000 },
                11,
            ),
        ),
    ] {
        let a = make(config.clone())?;
        let ops = 2.0 * mix.steps.len() as f64;
        fig.mixes.push((
            name.to_string(),
            median(runs, || mix.run(&a, shared).as_nanos() as f64 / ops),
        ));
        eprint!(".");
    }
    Ok(fig)
}

fn table(device: &str, figs: &[(&str, Figures)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "device: {device}\n");
    let names: Vec<String> = figs.iter().map(|(n, _)| format!("`{n}`")).collect();
    let _ = writeln!(
        s,
        "| measurement | {} | PyTorch native (H200 ref) | cudaMallocAsync (H200 ref) |",
        names.join(" | ")
    );
    let _ = writeln!(s, "|---|{}---:|---:|", "---:|".repeat(figs.len()));
    let row = |s: &mut String, label: String, get: &dyn Fn(&Figures) -> f64, r: String| {
        let cells: Vec<String> = figs.iter().map(|(_, f)| format!("{:.0}", get(f))).collect();
        let _ = writeln!(s, "| {label} | {} | {r} |", cells.join(" | "));
    };
    for (i, size) in support::PAIR_SIZES.iter().enumerate() {
        row(
            &mut s,
            format!("pair, {} (ns)", support::size_name(*size)),
            &|f| f.pairs.get(i).copied().unwrap_or(f64::NAN),
            format!("{:.0} | {:.0}", REF_PAIRS[i].0, REF_PAIRS[i].1),
        );
    }
    for own in [true, false] {
        let label = if own { "own stream" } else { "shared stream" };
        for (i, n) in support::THREADS.iter().enumerate() {
            let r = if own {
                format!("{:.0} | {:.0}", REF_THREADS[i].0, REF_THREADS[i].1)
            } else {
                "– | –".into()
            };
            row(
                &mut s,
                format!("{n} thread(s), 1 MiB pairs, {label} (aggregate ns/pair)"),
                &|f| {
                    let v = if own {
                        &f.threads_own
                    } else {
                        &f.threads_shared
                    };
                    v.get(i).copied().unwrap_or(f64::NAN)
                },
                r,
            );
        }
    }
    let first = figs.first().map(|(_, f)| f.clone()).unwrap_or_default();
    for (i, (name, _)) in first.replay.iter().enumerate() {
        let r = REF_REPLAY
            .iter()
            .find(|(n, _, _)| n == name)
            .map_or("– | –".to_string(), |(_, a, b)| {
                format!("{a:.0} | {b:.0}")
            });
        row(
            &mut s,
            format!("replay {name} (ns/op)"),
            &|f| f.replay.get(i).map_or(f64::NAN, |x| x.1),
            r,
        );
    }
    for (i, (name, _)) in first.mixes.iter().enumerate() {
        row(
            &mut s,
            format!("{name} (ns/op)"),
            &|f| f.mixes.get(i).map_or(f64::NAN, |x| x.1),
            "– | –".into(),
        );
    }
    let _ = writeln!(s);
    for (name, f) in figs {
        let one = f.threads_own.first().copied().unwrap_or(f64::NAN);
        let sixteen = f.threads_own.last().copied().unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "`{name}`, own streams: 16 threads give {:.1}× one thread's throughput (goal ≥ 8×)",
            one / sixteen
        );
    }
    s
}

fn json(device: &str, figs: &[(&str, Figures)]) -> String {
    let f = |fig: &Figures| {
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let named = |v: &[(String, f64)]| {
            v.iter()
                .map(|(n, x)| format!("\"{n}\": {x:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "{{\"pairs_ns\": [{}], \"threads_own_ns_per_pair\": [{}], \"threads_shared_ns_per_pair\": [{}], \"replay_ns_per_op\": {{{}}}, \"mixes_ns_per_op\": {{{}}}}}",
            list(&fig.pairs),
            list(&fig.threads_own),
            list(&fig.threads_shared),
            named(&fig.replay),
            named(&fig.mixes)
        )
    };
    let configs: Vec<String> = figs
        .iter()
        .map(|(n, fig)| format!("\"{n}\": {}", f(fig)))
        .collect();
    format!(
        "{{\"device\": \"{device}\", \"pair_sizes\": {:?}, \"threads\": {:?}, {}}}\n",
        support::PAIR_SIZES,
        support::THREADS,
        configs.join(", ")
    )
}

/// The host's cost of one uncontended compare-and-swap and of one uncontended mutex lock and
/// unlock, in ns (the fast path's floor is two compare-and-swaps per pair; the core's path takes
/// a mutex per operation).
fn host_atomics() -> (f64, f64) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let n = 20_000_000u64;
    let a = AtomicU64::new(0);
    let cas = median(3, || {
        let t = std::time::Instant::now();
        for i in 0..n {
            let _ = std::hint::black_box(&a).compare_exchange(
                i,
                i + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        t.elapsed().as_nanos() as f64 / n as f64
    });
    let m = parking_lot::Mutex::new(0u64);
    let lock = median(3, || {
        let t = std::time::Instant::now();
        for _ in 0..n {
            *std::hint::black_box(&m).lock() += 1;
        }
        t.elapsed().as_nanos() as f64 / n as f64
    });
    (cas, lock)
}

/// Measures both configurations on one backend and prints the table.
fn run<B: DeviceBackend>(
    device: &str,
    make: &dyn Fn(AllocatorConfig) -> Result<CachingAllocator<B>, AllocError>,
    streams: &[StreamId],
    shared: StreamId,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    if args.pair_rounds > 0 {
        return pair_rounds(device, make, shared, args);
    }
    let traces = support::shipped_traces(&args.traces);
    if traces.is_empty() {
        eprintln!(
            "no traces replayed (build with --features trace-io; traces looked for in {})",
            args.traces.display()
        );
    }
    let mut figs = Vec::new();
    for (name, config) in support::configs(true) {
        eprint!("{name} ");
        figs.push((
            name,
            measure(make, &config, streams, shared, args, &traces)?,
        ));
        eprintln!();
    }
    let (cas, lock) = host_atomics();
    println!("{}", table(device, &figs));
    println!("host: uncontended compare-and-swap {cas:.1} ns, mutex lock + unlock {lock:.1} ns");
    if let Some(path) = &args.json {
        std::fs::write(path, json(device, &figs))?;
    }
    Ok(())
}

/// `--pairs-rounds N`: the cached pair alone, under the configurations with the fast path
/// (`pytorch+fast` and `default`), interleaved: each round measures every size under each
/// configuration (a fresh allocator per size, the median of 5 runs as in the whole benchmark),
/// the order of the configurations alternating between rounds, so that the host's drift falls
/// on both alike. Prints every round, then per size and configuration the median and range over
/// the rounds, and writes them with `--json`.
fn pair_rounds<B: DeviceBackend>(
    device: &str,
    make: &dyn Fn(AllocatorConfig) -> Result<CachingAllocator<B>, AllocError>,
    shared: StreamId,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let configs: Vec<(&str, AllocatorConfig)> = support::configs(true)
        .into_iter()
        .filter(|(name, _)| matches!(*name, "pytorch+fast" | "default"))
        .collect();
    let runs = if args.quick { 2 } else { 5 };
    let target = Duration::from_millis(if args.quick { 50 } else { 200 });
    {
        // Warm the CPU as `measure` does.
        let a = make(configs[0].1.clone())?;
        pair_ns(&a, 4096, shared, 1, target);
    }
    let sizes = support::PAIR_SIZES;
    // got[config][size]: one figure per round.
    let mut got = vec![vec![Vec::new(); sizes.len()]; configs.len()];
    println!("device: {device}\n");
    println!(
        "| round | configuration | {} |",
        sizes.map(support::size_name).join(" | ")
    );
    println!("|---:|---|{}", "---:|".repeat(sizes.len()));
    for round in 0..args.pair_rounds {
        for k in 0..configs.len() {
            let c = if round % 2 == 0 {
                k
            } else {
                configs.len() - 1 - k
            };
            let (name, config) = &configs[c];
            let mut cells = Vec::new();
            for (i, &size) in sizes.iter().enumerate() {
                let a = make(config.clone())?;
                let ns = pair_ns(&a, size, shared, runs, target);
                got[c][i].push(ns);
                cells.push(format!("{ns:.1}"));
            }
            println!("| {round} | `{name}` | {} |", cells.join(" | "));
        }
    }
    println!(
        "\nover {} rounds, ns per pair: median (min–max)\n",
        args.pair_rounds
    );
    println!(
        "| configuration | {} | rounds with every size ≤ 60 ns |",
        sizes.map(support::size_name).join(" | ")
    );
    println!("|---|{}---:|", "---:|".repeat(sizes.len()));
    let mut json = String::from("{");
    let _ = write!(
        json,
        "\"device\":\"{device}\",\"rounds\":{}",
        args.pair_rounds
    );
    for (c, (name, _)) in configs.iter().enumerate() {
        let mut cells = Vec::new();
        let _ = write!(json, ",\"{name}\":{{");
        for (i, &size) in sizes.iter().enumerate() {
            let mut v = got[c][i].clone();
            v.sort_by(f64::total_cmp);
            let (lo, mid, hi) = (v[0], v[v.len() / 2], v[v.len() - 1]);
            cells.push(format!("{mid:.1} ({lo:.1}–{hi:.1})"));
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(json, "{sep}\"{size}\":{:?}", got[c][i]);
        }
        json.push('}');
        let all_under = (0..args.pair_rounds)
            .filter(|&r| got[c].iter().all(|per_size| per_size[r] <= 60.0))
            .count();
        println!(
            "| `{name}` | {} | {all_under} of {} |",
            cells.join(" | "),
            args.pair_rounds
        );
    }
    json.push('}');
    if let Some(path) = &args.json {
        std::fs::write(path, json)?;
    }
    Ok(())
}

fn sim(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let streams: Vec<StreamId> = (1..=16).map(StreamId).collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    run(
        &format!("SimDevice (host cost only; {cores} CPU cores)"),
        &|c| CachingAllocator::new(SimDevice::with_capacity(1 << 40), c),
        &streams,
        StreamId::DEFAULT,
        args,
    )
}

#[cfg(feature = "cuda")]
fn cuda(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    use cuda_caching_allocator::backend::cuda::CudaDevice;
    let device = CudaDevice::open(args.ordinal)?;
    // 16 streams of the device's context, admitted so the cache may allocate on them; `keep`
    // holds them alive until the end.
    let mut keep = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..16 {
        let s = device.context().new_stream()?;
        streams.push(device.admit_stream(&s)?);
        keep.push(s);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let name = format!("CUDA device {} ({cores} CPU cores)", args.ordinal);
    run(
        &name,
        &|c| CachingAllocator::new(&device, c),
        &streams,
        StreamId::DEFAULT,
        args,
    )
}

/// `--interop`: a warm cudarc buffer cycle of the cache (`alloc_zeros` of 256 `u32` on one of two
/// streams with event tracking on, then drop), ns per cycle, and the capture-status query of a
/// buffer's first use, ns per query; each the median of 7 runs (3 with `--quick`).
#[cfg(feature = "cuda")]
fn interop(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    use std::sync::Arc;
    use std::time::Instant;

    use cuda_caching_allocator::backend::cuda::stream_id;
    use cuda_caching_allocator::interop::CudaAllocator;

    let ctx = cudarc::driver::CudaContext::new(args.ordinal)?;
    let s = ctx.new_stream()?;
    let _other = ctx.new_stream()?;
    if !ctx.is_managing_stream_synchronization() {
        return Err("cudarc does not order streams in this context".into());
    }
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default())?;
    let runs = if args.quick { 3 } else { 7 };
    let mut failed: Option<Box<dyn std::error::Error>> = None;
    let mut cycle = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            match alloc.alloc_zeros::<u32>(&s, 256) {
                Ok(b) => drop(b),
                Err(e) => failed = Some(e.into()),
            }
        }
        t.elapsed()
    };
    cycle(1000);
    let n = calibrate(1000, Duration::from_millis(200), &mut cycle);
    let cycle_ns = median(runs, || cycle(n).as_nanos() as f64 / n as f64);
    let id = stream_id(&s);
    let dev = alloc.device();
    let mut query = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(dev.stream_capture_id(id).ok());
        }
        t.elapsed()
    };
    let n = calibrate(1000, Duration::from_millis(200), &mut query);
    let query_ns = median(runs, || query(n).as_nanos() as f64 / n as f64);
    // The same cycle through cudarc's own allocation (driver memory, two new events each).
    let mut own = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            match s.alloc_zeros::<u32>(256) {
                Ok(b) => drop(b),
                Err(e) => failed = Some(e.into()),
            }
        }
        t.elapsed()
    };
    let n = calibrate(100, Duration::from_millis(200), &mut own);
    let own_ns = median(runs, || own(n).as_nanos() as f64 / n as f64);
    // One stream (a context object with no stream of its own, cudarc's default tracking): the
    // cache's buffers take their address's kept event pair at the first use (Note [Events
    // whenever tracking is on]); cudarc's make two events per buffer.
    let ctx1 = cudarc::driver::CudaContext::new(args.ordinal)?;
    let d1 = ctx1.default_stream();
    let alloc1 = CudaAllocator::new(Arc::clone(&ctx1), AllocatorConfig::default())?;
    let mut single = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            match alloc1.alloc_zeros::<u32>(&d1, 256) {
                Ok(b) => drop(b),
                Err(e) => failed = Some(e.into()),
            }
        }
        t.elapsed()
    };
    single(1000);
    let n = calibrate(1000, Duration::from_millis(200), &mut single);
    let single_ns = median(runs, || single(n).as_nanos() as f64 / n as f64);
    let mut single_own = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            match d1.alloc_zeros::<u32>(256) {
                Ok(b) => drop(b),
                Err(e) => failed = Some(e.into()),
            }
        }
        t.elapsed()
    };
    let n = calibrate(100, Duration::from_millis(200), &mut single_own);
    let single_own_ns = median(runs, || single_own(n).as_nanos() as f64 / n as f64);
    if let Some(e) = failed {
        return Err(e);
    }
    d1.synchronize()?;
    s.synchronize()?;
    println!(
        "| CUDA device {} | cudarc buffer cycle (alloc_zeros 1 KiB + drop, two streams, event tracking) | {cycle_ns:.0} ns |",
        args.ordinal
    );
    println!(
        "| CUDA device {} | the same through cudarc's own alloc_zeros | {own_ns:.0} ns |",
        args.ordinal
    );
    println!(
        "| CUDA device {} | cudarc buffer cycle, one stream (default stream, event tracking) | {single_ns:.0} ns |",
        args.ordinal
    );
    println!(
        "| CUDA device {} | the same through cudarc's own alloc_zeros | {single_own_ns:.0} ns |",
        args.ordinal
    );
    println!(
        "| CUDA device {} | capture-status query | {query_ns:.0} ns |",
        args.ordinal
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn interop(_: &Args) -> Result<(), Box<dyn std::error::Error>> {
    Err("--interop needs the CUDA backend: add --features cuda".into())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Args) -> Result<(), Box<dyn std::error::Error>> {
    Err("built without the CUDA backend: add --features cuda".into())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let r = if args.interop {
        interop(&args)
    } else if args.device == "cuda" {
        cuda(&args)
    } else {
        sim(&args)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
