//! GPU tests of graph capture through the cudarc interop (`CudaAllocator::capture_pool`):
//! a kernel sequence that allocates and frees inside a global-mode capture, replayed 100 times
//! while other work allocates and frees between the replays. `#[ignore]`d like `cuda.rs`:
//! `--ignored` runs them on a machine with a GPU.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Barrier, OnceLock};

use cuda_caching_allocator::backend::cuda::CudaDevice;
use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
use cuda_caching_allocator::{
    AllocError, AllocatorConfig, AllocatorConfigBuilder, DeviceAddr, DeviceBackend, StatType,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg, result, sys,
};

const KERNELS: &str = r#"
__device__ unsigned int mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
extern "C" __global__ void fill_pattern(unsigned int* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = mix((unsigned int)i * 0x9E3779B9u + seed);
}
extern "C" __global__ void spin_fill_pattern(unsigned int* p, unsigned long long n,
                                             unsigned int seed, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = mix((unsigned int)i * 0x9E3779B9u + seed);
}
extern "C" __global__ void add(const unsigned int* a, const unsigned int* b, unsigned int* c,
                               unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        c[i] = a[i] + b[i];
}
"#;

/// The host twin of `fill_pattern`.
fn pattern(i: u64, seed: u32) -> u32 {
    let mut x = (i as u32).wrapping_mul(0x9E37_79B9).wrapping_add(seed);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

struct Gpu {
    ctx: Arc<CudaContext>,
    fill: CudaFunction,
    add: CudaFunction,
}

fn gpu(test: &str) -> &'static Gpu {
    crate::util::require_gpu(test);
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let ctx = CudaContext::new(0).unwrap();
        // As cudarc's own capture tests do: with event tracking on, every use of a buffer waits
        // on its events, and the driver refuses waits on events recorded outside the capture
        // (CUDA_ERROR_INVALID_VALUE at the first launch, seen on an H100). cudarc's `CudaSlice`
        // and the cache's buffers behave alike there; a capturing program orders by hand.
        // SAFETY: this context object's buffers are created after this call, and the tests
        // order their streams themselves (the graph and the checks run on one stream).
        unsafe { ctx.disable_event_tracking() };
        let module = crate::util::load_module(&ctx, KERNELS);
        Gpu {
            fill: module.load_function("fill_pattern").unwrap(),
            add: module.load_function("add").unwrap(),
            ctx,
        }
    })
}

/// Ends the stream's capture if the test panics while it is open.
struct EndCaptureOnPanic<'a>(&'a Arc<CudaStream>);

impl Drop for EndCaptureOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.end_capture(sys::CUgraphInstantiate_flags(0));
        }
    }
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn uninit(alloc: &CudaAllocator, stream: &Arc<CudaStream>, len: usize) -> CachedSlice<u32> {
    // SAFETY: `u32` is valid for every bit pattern, and every buffer is written before it is
    // read.
    unsafe { alloc.alloc::<u32>(stream, len) }.unwrap()
}

fn fill(g: &Gpu, stream: &Arc<CudaStream>, buf: &mut CachedSlice<u32>, seed: u32) {
    let cfg = grid(buf.len());
    let n = buf.len() as u64;
    let mut b = stream.launch_builder(&g.fill);
    b.arg(&mut *buf).arg(&n).arg(&seed);
    // SAFETY: fill_pattern(unsigned*, u64, u32) writes the `n` values the buffer holds.
    unsafe { b.launch(cfg) }.unwrap();
}

fn add(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    a: &CachedSlice<u32>,
    b: &CachedSlice<u32>,
    c: &mut CachedSlice<u32>,
) {
    assert!(a.len() == c.len() && b.len() == c.len());
    let cfg = grid(c.len());
    let n = c.len() as u64;
    let mut l = stream.launch_builder(&g.add);
    l.arg(a).arg(b).arg(&mut *c).arg(&n);
    // SAFETY: add(const unsigned*, const unsigned*, unsigned*, u64) reads `n` values of `a` and
    // `b` and writes `n` of `c`, all holding `n` (checked above).
    unsafe { l.launch(cfg) }.unwrap();
}

/// `[start, end)` of a buffer.
fn range(b: &CachedSlice<u32>) -> (u64, u64) {
    let p: DeviceAddr = b.device_ptr_raw();
    (p.0, p.0 + (b.len() * 4) as u64)
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// Captures `out = 2 * (x + pattern(7))` with three temporaries allocated and freed inside the
/// capture, replays it 100 times with a new `x` each time while other work (on the graph's
/// stream and on another) allocates, writes and frees between the replays, and checks every
/// replay's result and that no other allocation ever lands on the graph's memory.
fn replay_while_other_work_allocates(test: &str, config: AllocatorConfig) {
    let g = gpu(test);
    const N: usize = 1 << 20; // 4 MiB per buffer: the large pool
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), config).unwrap();
    let stream = g.ctx.new_stream().unwrap();
    let other = g.ctx.new_stream().unwrap();
    let mut x = uninit(&alloc, &stream, N);
    let mut out = uninit(&alloc, &stream, N);
    // Cached free blocks of the temporaries' sizes, outside the graph: the capture must not
    // take them, and later work must not get the graph's.
    drop((uninit(&alloc, &stream, N), uninit(&alloc, &stream, N / 4)));

    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    // A failed assertion inside the capture must not leave a global-mode capture open: that
    // would fail every later driver call of the process (and so every later test).
    let capturing = EndCaptureOnPanic(&stream);
    let pool = alloc.capture_pool(&stream).unwrap();
    assert!(alloc.capture_underway());
    let mut graph_ranges = Vec::new();
    {
        let mut t1 = uninit(&alloc, &stream, N);
        fill(g, &stream, &mut t1, 7);
        let mut t2 = uninit(&alloc, &stream, N);
        add(g, &stream, &x, &t1, &mut t2);
        graph_ranges.extend([range(&t1), range(&t2)]);
        drop(t1); // freed inside the capture: back to the graph's pool
        let mut t3 = uninit(&alloc, &stream, N);
        graph_ranges.push(range(&t3));
        add(g, &stream, &t2, &t2, &mut t3);
        let mut small = uninit(&alloc, &stream, N / 4);
        graph_ranges.push(range(&small));
        fill(g, &stream, &mut small, 3); // work on a small temporary, result unused
        add(g, &stream, &t3, &x, &mut out);
        add(g, &stream, &out, &x, &mut t2);
        // out = t3 again, through one more temporary round trip.
        add(g, &stream, &t3, &t2, &mut out);
        drop((t2, t3, small));
    }
    std::mem::forget(capturing);
    let graph = pool
        .end_capture(&stream, sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture recorded kernels");
    assert!(!alloc.capture_underway());
    alloc.check_invariants().unwrap();

    let sizes = [N, N / 4, N / 2, 3 * N, 1000, N];
    for replay in 0..100u32 {
        let seed = 1000 + replay;
        fill(g, &stream, &mut x, seed);
        graph.launch().unwrap();
        // Other work while the replay may still be running: allocations on both streams that
        // write garbage and are freed at once.
        for (k, &len) in sizes.iter().enumerate() {
            let s = if k % 2 == 0 { &stream } else { &other };
            let mut junk = uninit(&alloc, s, len);
            for r in &graph_ranges {
                assert!(
                    !overlaps(range(&junk), *r),
                    "replay {replay}: an allocation of {len} u32 got the graph's memory"
                );
            }
            fill(g, s, &mut junk, 0xdead_0000 + replay);
            drop(junk);
        }
        let host = alloc.dtoh(&out).unwrap();
        for (i, &v) in host.iter().enumerate().step_by(997) {
            let i = i as u64;
            let xi = pattern(i, seed);
            let t3 = xi.wrapping_add(pattern(i, 7)).wrapping_mul(2);
            let t2 = t3.wrapping_add(xi).wrapping_add(xi);
            assert_eq!(v, t3.wrapping_add(t2), "replay {replay}, element {i}");
        }
    }
    stream.synchronize().unwrap();
    other.synchronize().unwrap();
    alloc.check_invariants().unwrap();
    let reserved = alloc.memory_stats().memory_reserved();
    // Dropping the graph releases its pool; empty_cache then gives its memory back.
    drop(graph);
    alloc.empty_cache().unwrap();
    let after = alloc.memory_stats().memory_reserved();
    assert!(
        after < reserved,
        "the graph's pool was released: {after} < {reserved}"
    );
    drop((x, out));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.memory_stats().memory_reserved(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_capture_replays_with_private_pool_pytorch() {
    replay_while_other_work_allocates(
        "cuda_capture_replays_with_private_pool_pytorch",
        AllocatorConfig::pytorch(),
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_capture_replays_with_private_pool_default_fast_path() {
    replay_while_other_work_allocates(
        "cuda_capture_replays_with_private_pool_default_fast_path",
        AllocatorConfigBuilder::from_config(AllocatorConfig::default())
            .fast_path(true)
            .cross_stream_reuse(true)
            .build()
            .unwrap(),
    );
}

/// Runs `call` on this thread while another thread holds a global-mode capture of a kernel on a
/// stream of its own; returns how that capture ended.
fn during_a_global_capture(g: &Gpu, call: &dyn Fn()) -> Result<bool, DriverError> {
    let cap = g.ctx.new_stream().unwrap();
    let n = 1usize << 20;
    let mut buf = cap.alloc_zeros::<u32>(n).unwrap();
    cap.synchronize().unwrap();
    let (begun, called) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            cap.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
                .unwrap();
            let (n64, seed) = (n as u64, 5u32);
            let mut b = cap.launch_builder(&g.fill);
            b.arg(&mut buf).arg(&n64).arg(&seed);
            // SAFETY: fill_pattern(unsigned*, u64, u32) writes the `n` values `buf` holds.
            let launched = unsafe { b.launch(grid(n)) };
            begun.wait();
            called.wait();
            let ended = cap.end_capture(sys::CUgraphInstantiate_flags(0));
            launched.and(ended).map(|graph| graph.is_some())
        });
        begun.wait();
        call();
        called.wait();
        t.join().unwrap()
    })
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_event_queries_during_another_threads_global_capture_leave_it_valid() {
    let g = gpu("cuda_event_queries_during_another_threads_global_capture_leave_it_valid");
    let dev = CudaDevice::new(Arc::clone(&g.ctx)).unwrap();
    let other = g.ctx.new_stream().unwrap();
    let other_id = dev.admit_stream(&other).unwrap();
    let ev = dev.create_event().unwrap();
    let raw = g.ctx.new_event(None).unwrap();
    let work = || {
        let mut w = other.alloc_zeros::<u32>(1 << 22).unwrap();
        other.memset_zeros(&mut w).unwrap();
        dev.record_event(ev, other_id).unwrap();
        raw.record(&other).unwrap();
        w
    };
    // The control: a query in the thread's default mode invalidates the other thread's capture
    // (so this test can fail).
    let _w = work();
    let control = during_a_global_capture(g, &|| {
        // SAFETY: `raw` is a live event of this context.
        let r = unsafe { result::event::query(raw.cu_event()) };
        assert!(
            r.is_err(),
            "a default-mode query during a global capture: {r:?}"
        );
    });
    assert!(
        control.is_err(),
        "the control query should have invalidated the capture: {control:?}"
    );
    // The backend's queries, waits and stream synchronizations are made in relaxed mode.
    let _w = work();
    let ended = during_a_global_capture(g, &|| {
        dev.query_event(ev).unwrap();
        dev.synchronize_event(ev).unwrap();
        dev.synchronize_stream(other_id).unwrap();
    });
    assert_eq!(ended, Ok(true), "the capture must end with its graph");
    other.synchronize().unwrap();
    // SAFETY: the event was made by this backend, and its only record has completed (the
    // stream was synchronized); nothing uses it afterwards.
    unsafe { dev.destroy_event(ev) }.unwrap();
}

/// Slabs of the pinned host cache pinned (`cuMemHostAlloc`, `cuMemHostRegister`) and unpinned
/// while another thread captures in global mode (cudarc's and PyTorch's default): the capture
/// must end with its graph and the cache's calls succeed (Note [Pinning beside a capture] in
/// `src/host/cuda.rs`; found by an adversarial review). The control shows the hazard: a plain
/// `cuMemHostAlloc` in the thread's default mode invalidates the capture.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_pinned_slabs_during_another_threads_global_capture_leave_it_valid() {
    use cuda_caching_allocator::PinnedConfig;
    use cuda_caching_allocator::host::PinMethod;
    use cuda_caching_allocator::interop::PinnedAllocator;
    let g = gpu("cuda_pinned_slabs_during_another_threads_global_capture_leave_it_valid");
    let control = during_a_global_capture(g, &|| {
        // SAFETY: 1 MiB of page-locked host memory, freed right away if it was made.
        if let Ok(p) = unsafe { result::malloc_host(1 << 20, 0) } {
            // SAFETY: `p` came from `malloc_host` just now and nothing uses it.
            let _ = unsafe { result::free_host(p) };
        }
    });
    assert!(
        control.is_err(),
        "the control cuMemHostAlloc should have invalidated the capture: {control:?}"
    );
    let methods = [
        PinMethod::HostAlloc,
        PinMethod::Register {
            min_size: 1 << 20,
            touch_threads: 2,
        },
    ];
    for method in methods {
        let pinned = PinnedAllocator::with_method(
            Arc::clone(&g.ctx),
            PinnedConfig::default().with_slab_size(4 << 20),
            method,
        )
        .unwrap();
        let got = std::sync::Mutex::new(None);
        let ended = during_a_global_capture(g, &|| {
            // A miss: the cache pins a new slab on this thread.
            *got.lock().unwrap() = Some(pinned.alloc_pinned_zeros::<u32>(1 << 10));
        });
        let buf = got.into_inner().unwrap().unwrap();
        assert_eq!(
            ended,
            Ok(true),
            "{method:?}: pinning must leave the capture valid"
        );
        let buf = buf.unwrap_or_else(|e| panic!("{method:?}: the pin failed: {e}"));
        drop(buf);
        let ended = during_a_global_capture(g, &|| {
            // The slab is idle: empty_cache unpins it on this thread.
            assert_eq!(
                pinned.empty_cache().unwrap(),
                4 << 20,
                "{method:?}: one slab unpinned"
            );
        });
        assert_eq!(
            ended,
            Ok(true),
            "{method:?}: unpinning must leave the capture valid"
        );
    }
}

/// Runs `launch` inside a thread-local capture of `stream`; returns the capture's outcome and
/// the launch's.
fn in_capture(
    stream: &Arc<CudaStream>,
    launch: impl FnOnce() -> Result<(), DriverError>,
) -> (
    Result<Option<cudarc::driver::CudaGraph>, DriverError>,
    Result<(), DriverError>,
) {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let guard = EndCaptureOnPanic(stream);
    let launched = launch();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    std::mem::forget(guard);
    (graph, launched)
}

/// Launches `graph` and checks, through the driver (not cudarc, whose uses would wait on the
/// events recorded inside the capture), that `ptr` holds `fill_pattern(seed)`.
fn check_graph_fill(graph: &cudarc::driver::CudaGraph, stream: &CudaStream, ptr: u64, seed: u32) {
    let len = 1usize << 20;
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    let mut back = vec![0u32; len];
    // SAFETY: `ptr` holds `len` u32 of a live buffer, written by the synchronized stream.
    unsafe { result::memcpy_dtoh_sync(&mut back, ptr) }.unwrap();
    assert!(
        back.iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, seed)),
        "the graph's fill"
    );
}

/// A context object with event tracking on (cudarc's default) and two streams, so that cudarc
/// orders streams through each buffer's events, and the `fill_pattern` kernel loaded there.
fn tracking_setup() -> (
    Arc<CudaContext>,
    Arc<CudaStream>,
    Arc<CudaStream>,
    CudaFunction,
) {
    let ctx = CudaContext::new(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    assert!(ctx.is_managing_stream_synchronization());
    let module = crate::util::load_module(&ctx, KERNELS);
    let fill_fn = module.load_function("fill_pattern").unwrap();
    (ctx, s, s2, fill_fn)
}

/// What cudarc's own buffer leaves in the context at its drop: allocated on `alloc_on`, first
/// used (a memset) inside a capture of `capture_on`, which must capture, and dropped after the
/// graph ran.
fn cudarc_drop_after_capture(
    ctx: &CudaContext,
    alloc_on: &Arc<CudaStream>,
    capture_on: &Arc<CudaStream>,
    len: usize,
) -> Result<(), DriverError> {
    // SAFETY: `u32` is valid for every bit pattern, and nothing reads the values.
    let mut x = unsafe { alloc_on.alloc::<u32>(len) }.unwrap();
    let (graph, launched) = in_capture(capture_on, || capture_on.memset_zeros(&mut x));
    launched.unwrap();
    let graph = graph
        .expect("cudarc's fresh buffer captures")
        .expect("a graph");
    assert_eq!(ctx.check_err(), Ok(()));
    graph.launch().unwrap();
    capture_on.synchronize().unwrap();
    drop(graph);
    drop(x);
    let dropped = ctx.check_err();
    ctx.synchronize().unwrap();
    let _ = ctx.check_err();
    dropped
}

/// Note [Event shells and captures], with event tracking on and two streams (cudarc orders
/// streams through each buffer's events). cudarc's own `alloc` gives a buffer new events, so a
/// buffer first used inside a capture captures. A cached buffer must do the same on a cache
/// hit, where the block's kept events were recorded outside the capture (the driver refuses a
/// wait on them inside it: `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), and the events it records
/// inside the capture must not be handed to the next buffer at that address (a wait on them
/// outside the capture fails with `CUDA_ERROR_INVALID_VALUE`, and cudarc keeps that error for
/// the context's next call). Each arm's dropping is compared with cudarc's own `CudaSlice`.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_buffer_first_used_inside_a_capture_captures_like_a_fresh_cuda_slice() {
    crate::util::require_gpu(
        "a_buffer_first_used_inside_a_capture_captures_like_a_fresh_cuda_slice",
    );
    let (ctx, s, _second, fill_fn) = tracking_setup();
    let len = 1usize << 20;
    let cudarc_drop = cudarc_drop_after_capture(&ctx, &s, &s, len);
    println!("cudarc's CudaSlice dropped after its capture: {cudarc_drop:?}");

    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    for hit in [false, true] {
        // A cache hit: the block's previous buffer recorded its events outside a capture. A
        // miss: a size never allocated before, so no kept events at that address.
        let n = if hit { len } else { len + 4096 };
        let before = if hit {
            let a = alloc.alloc_zeros::<u32>(&s, n).unwrap();
            let p = a.device_ptr_raw();
            drop(a);
            assert_eq!(
                alloc.kept_event_pairs(),
                1,
                "the used buffer's events are kept"
            );
            Some(p)
        } else {
            None
        };
        let mut b = uninit(&alloc, &s, n);
        if let Some(p) = before {
            assert_eq!(b.device_ptr_raw(), p, "a cache hit");
        }
        let p = b.device_ptr_raw();
        let (graph, launched) = in_capture(&s, || {
            let (n64, seed) = (len as u64, 9u32);
            let mut l = s.launch_builder(&fill_fn);
            l.arg(&mut b).arg(&n64).arg(&seed);
            // SAFETY: fill_pattern(unsigned*, u64, u32) writes `len` values; `b` holds at least
            // `len`.
            unsafe { l.launch(grid(len)) }.map(|_| ())
        });
        assert!(
            launched.is_ok() && ctx.check_err().is_ok(),
            "hit {hit}: the launch inside the capture: {launched:?}"
        );
        let graph = graph
            .unwrap_or_else(|e| panic!("hit {hit}: the capture failed: {e:?}"))
            .expect("a graph");
        check_graph_fill(&graph, &s, p.0, 9);
        drop(graph);
        drop(b);
        let ours_drop = ctx.check_err();
        assert_eq!(
            ours_drop, cudarc_drop,
            "hit {hit}: dropping after the capture, as cudarc's own buffer"
        );
        s.synchronize().unwrap();
        let _ = ctx.check_err();
        // The next buffer at that address is used outside any capture: its events must be new
        // or complete, never the captured ones.
        let c = alloc.alloc_zeros::<u32>(&s, n).unwrap();
        assert_eq!(c.device_ptr_raw(), p, "hit {hit}: the same block again");
        s.synchronize().unwrap();
        assert_eq!(
            ctx.check_err(),
            Ok(()),
            "hit {hit}: the next buffer at the captured buffer's address waited on captured events"
        );
        drop(c);
        s.synchronize().unwrap();
        alloc.empty_cache().unwrap();
    }
}

/// Reads `len` u32 at `ptr` through the driver (no cudarc use: no event waited on).
fn read_raw(ptr: u64, len: usize) -> Vec<u32> {
    let mut back = vec![0u32; len];
    // SAFETY: `ptr` holds `len` u32 of a live buffer; the callers synchronized its writers.
    unsafe { result::memcpy_dtoh_sync(&mut back, ptr) }.unwrap();
    back
}

/// Note [Event shells and captures], a capture on another stream than the buffer's own (as a
/// program capturing on a side stream does), with event tracking on:
/// 1. a first use whose stream cudarc names (`memset_zeros` on the capturing stream, through
///    `DevicePtrMut`) makes new events, on a cache hit too, so the capture succeeds, and the
///    next buffer at that address is used outside the capture with no error;
/// 2. a first use that names no stream (a kernel argument) on a fresh block takes pool-ready
///    events that the capture records; the drop after the capture finds its waits refused and
///    destroys them, so the next buffer at that address again gets no error.
///
/// Each drop after a capture leaves the context the error cudarc's own buffer leaves.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_first_use_inside_a_capture_on_another_stream_leaves_no_captured_events() {
    crate::util::require_gpu(
        "a_first_use_inside_a_capture_on_another_stream_leaves_no_captured_events",
    );
    let (ctx, s, s2, fill_fn) = tracking_setup();
    let len = 1usize << 20;
    let launch_fill = |buf: &mut CachedSlice<u32>, seed: u32| {
        let n = len as u64;
        let mut l = s2.launch_builder(&fill_fn);
        l.arg(buf).arg(&n).arg(&seed);
        // SAFETY: fill_pattern(unsigned*, u64, u32) writes `len` values; the buffers hold at
        // least `len`.
        unsafe { l.launch(grid(len)) }.map(|_| ())
    };

    // What cudarc's own buffer (allocated on `s`, captured on `s2`) leaves at its drop.
    let cudarc_drop = cudarc_drop_after_capture(&ctx, &s, &s2, len);
    println!("cudarc's CudaSlice dropped after a capture on another stream: {cudarc_drop:?}");

    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let arms: [(&str, bool, usize); 3] = [
        ("memset, fresh block", false, len + 4096),
        ("memset, cache hit", true, len),
        ("kernel argument, fresh block", false, len + 8192),
    ];
    for (arm, hit, n) in arms {
        if hit {
            let a = alloc.alloc_zeros::<u32>(&s, n).unwrap();
            drop(a);
            assert!(
                alloc.kept_event_pairs() >= 1,
                "{arm}: the used buffer's events are kept"
            );
        }
        let mut b = uninit(&alloc, &s, n);
        let p = b.device_ptr_raw().0;
        // SAFETY: the buffer's `n` u32, written through the driver (no cudarc use, no event).
        unsafe { result::memset_d8_sync(p, 0xAB, n * 4) }.unwrap();
        ctx.synchronize().unwrap();
        let memset = arm.starts_with("memset");
        let (graph, launched) = in_capture(&s2, || {
            if memset {
                s2.memset_zeros(&mut b)
            } else {
                launch_fill(&mut b, 21)
            }
        });
        assert!(
            launched.is_ok() && ctx.check_err().is_ok(),
            "{arm}: the use inside the capture: {launched:?}"
        );
        let graph = graph
            .unwrap_or_else(|e| panic!("{arm}: the capture failed: {e:?}"))
            .expect("a graph");
        graph.launch().unwrap();
        s2.synchronize().unwrap();
        let back = read_raw(p, len);
        if memset {
            assert!(back.iter().all(|&v| v == 0), "{arm}: the graph's memset");
        } else {
            assert!(
                back.iter()
                    .enumerate()
                    .all(|(i, &v)| v == pattern(i as u64, 21)),
                "{arm}: the graph's fill"
            );
        }
        drop(graph);
        drop(b);
        assert_eq!(
            ctx.check_err(),
            cudarc_drop,
            "{arm}: dropping after the capture, as cudarc's own buffer"
        );
        ctx.synchronize().unwrap();
        let _ = ctx.check_err();
        let c = alloc.alloc_zeros::<u32>(&s, n).unwrap();
        assert_eq!(c.device_ptr_raw().0, p, "{arm}: the same block again");
        s.synchronize().unwrap();
        assert_eq!(
            ctx.check_err(),
            Ok(()),
            "{arm}: the next buffer at that address waited on captured events"
        );
        drop(c);
        s.synchronize().unwrap();
        alloc.empty_cache().unwrap();
    }
}

/// Whether the `n` u32 at `ptr` hold `fill_pattern(seed)` (read through the driver).
fn holds_pattern(ptr: u64, n: usize, seed: u32) -> bool {
    read_raw(ptr, n)
        .iter()
        .enumerate()
        .all(|(i, &v)| v == pattern(i as u64, seed))
}

/// Runs `body` inside a thread-local capture of `stream` routed into a new pool of `alloc`
/// (`capture_pool`), and returns the graph with its pool.
fn routed_capture(
    alloc: &CudaAllocator,
    stream: &Arc<CudaStream>,
    body: impl FnOnce(),
) -> cuda_caching_allocator::interop::CapturedGraph {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let guard = EndCaptureOnPanic(stream);
    let pool = alloc.capture_pool(stream).unwrap();
    body();
    let graph = pool
        .end_capture(stream, sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    std::mem::forget(guard);
    graph
}

/// The shared fixture (event tracking off), a new stream and a cache of its own with the
/// default configuration.
fn stream_and_cache(test: &str) -> (&'static Gpu, Arc<CudaStream>, CudaAllocator) {
    let g = gpu(test);
    let s = g.ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    (g, s, alloc)
}

/// Note [Allocations inside a capture]: cudarc's `stream.alloc` inside a capture is a graph
/// memory node that the graph owns, but a cached block would be served again to eager work once
/// the buffer is dropped, while every launch still writes it. A typed allocation on a capturing
/// stream that no pool receives is refused with `UnroutedCapture` (the capture stays valid);
/// with `capture_pool` the same allocation is served from the graph's pool.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn an_allocation_on_a_capturing_stream_without_a_pool_is_refused() {
    let test = "an_allocation_on_a_capturing_stream_without_a_pool_is_refused";
    let (g, s, alloc) = stream_and_cache(test);
    let n = 1usize << 20;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let guard = EndCaptureOnPanic(&s);
    let refused = alloc.alloc_zeros::<u32>(&s, n);
    assert!(
        matches!(refused, Err(AllocError::UnroutedCapture { .. })),
        "a typed allocation inside an unrouted capture: {refused:?}"
    );
    let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("capture_pool"), "{message}");
    assert_eq!(
        alloc
            .memory_stats()
            .allocated_bytes
            .get(StatType::All)
            .current,
        0
    );
    let pool = alloc.capture_pool(&s).unwrap();
    let mut t = uninit(&alloc, &s, n);
    fill(g, &s, &mut t, 4);
    let p = t.device_ptr_raw().0;
    let graph = pool
        .end_capture(&s, sys::CUgraphInstantiate_flags(0))
        .expect("the capture stayed valid")
        .expect("a graph");
    std::mem::forget(guard);
    graph.launch().unwrap();
    s.synchronize().unwrap();
    assert!(holds_pattern(p, n, 4), "the graph's fill");
    drop(t);
    drop(graph);
    assert_eq!(g.ctx.check_err(), Ok(()));
}

/// Note [Graph pools live as long as their graphs]: a capture ended with cudarc's own
/// `end_capture` leaves the program a graph the pool does not know about. The `GraphPool`
/// dropped on its own keeps its use (the graph still writes its memory after an `empty_cache`,
/// and no eager buffer lands there); `adopt` ties such a graph to its pool, whose use then goes
/// back with the graph; the unsafe `release_pool` gives the first pool back once its graph is
/// gone.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_graph_pool_dropped_without_its_graph_keeps_its_memory() {
    let test = "a_graph_pool_dropped_without_its_graph_keeps_its_memory";
    let (g, s, alloc) = stream_and_cache(test);
    let n = 1usize << 20;
    let flags = sys::CUgraphInstantiate_flags(0);
    let capture_fill = |seed: u32| {
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let guard = EndCaptureOnPanic(&s);
        let mut pool = alloc.capture_pool(&s).unwrap();
        let mut t = uninit(&alloc, &s, n);
        fill(g, &s, &mut t, seed);
        let p = t.device_ptr_raw().0;
        drop(t); // the pool's own memory: back to the pool
        let graph = s.end_capture(flags).unwrap().expect("a graph");
        std::mem::forget(guard);
        pool.finish().unwrap();
        (pool, graph, p)
    };

    let (pool, graph, p) = capture_fill(6);
    let id = pool.id();
    drop(pool);
    assert_eq!(
        alloc.pool_use_count(id),
        Some(1),
        "a pool dropped without its graph keeps its use"
    );
    alloc.empty_cache().unwrap();
    check_graph_fill(&graph, &s, p, 6);
    let other = uninit(&alloc, &s, n);
    assert!(
        !overlaps(range(&other), (p, p + 4 * n as u64)),
        "an eager buffer landed on the graph's memory"
    );
    drop(other);

    let (pool2, graph2, p2) = capture_fill(8);
    let id2 = pool2.id();
    let captured = pool2.adopt(graph2).unwrap();
    captured.launch().unwrap();
    s.synchronize().unwrap();
    assert!(holds_pattern(p2, n, 8), "the adopted graph's fill");
    drop(captured);
    assert!(
        alloc.pool_use_count(id2).is_none_or(|u| u == 0),
        "an adopted graph's pool goes back with it"
    );

    drop(graph);
    // SAFETY: the only graph captured into `id` was dropped just above.
    unsafe { alloc.release_pool(id) }.unwrap();
    assert!(alloc.pool_use_count(id).is_none_or(|u| u == 0));
    alloc.empty_cache().unwrap();
    assert_eq!(g.ctx.check_err(), Ok(()));
}

/// Note [Drops inside a capture]: cudarc's drop inside a capture is a captured
/// `cuMemFreeAsync`, so the memory stays the graph's. A cached buffer made before the capture,
/// written inside it and dropped there, is held for the graph: an eager buffer of the same size
/// made after the capture lands elsewhere, and the graph's launch leaves it intact; the block
/// goes back when the graph (and its pool) is dropped.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_buffer_made_before_a_capture_and_dropped_inside_it_is_held_for_the_graph() {
    let test = "a_buffer_made_before_a_capture_and_dropped_inside_it_is_held_for_the_graph";
    let (g, s, alloc) = stream_and_cache(test);
    let n = 1usize << 20;
    let mut b = uninit(&alloc, &s, n);
    fill(g, &s, &mut b, 1);
    s.synchronize().unwrap();
    let p = b.device_ptr_raw().0;
    let allocated = |a: &CudaAllocator| a.memory_stats().allocated_bytes.get(StatType::All).current;

    let graph = routed_capture(&alloc, &s, || {
        fill(g, &s, &mut b, 3);
        drop(b);
        assert_eq!(alloc.blocks_held_for_graphs(), 1, "held for the graph");
    });
    assert_eq!(
        allocated(&alloc),
        (4 * n) as i64,
        "the held block counts as allocated"
    );

    let mut v = uninit(&alloc, &s, n);
    assert!(
        !overlaps(range(&v), (p, p + 4 * n as u64)),
        "an eager buffer landed on memory the graph writes"
    );
    fill(g, &s, &mut v, 11);
    graph.launch().unwrap();
    s.synchronize().unwrap();
    let vp = v.device_ptr_raw().0;
    assert!(
        holds_pattern(vp, n, 11),
        "the graph's launch changed an eager buffer"
    );
    assert!(holds_pattern(p, n, 3), "the graph's fill of the held block");
    drop(v);
    drop(graph);
    assert_eq!(
        alloc.blocks_held_for_graphs(),
        0,
        "given back with the graph"
    );
    assert_eq!(allocated(&alloc), 0);
    alloc.empty_cache().unwrap();
    assert_eq!(g.ctx.check_err(), Ok(()));
}

/// Note [Drops inside a capture], with event tracking on: a buffer whose events exist before
/// the capture (a view took them, recording nothing) and are recorded inside it, dropped inside
/// the capture, does not hand those events to the block's next buffer (a wait on them outside
/// the capture fails and cudarc keeps the error, so that buffer's writes would go unrecorded):
/// they are quarantined and destroyed when the capture ends, leaving the context no error.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_buffer_dropped_inside_a_capture_quarantines_its_events() {
    crate::util::require_gpu("a_buffer_dropped_inside_a_capture_quarantines_its_events");
    let (ctx, s, _s2, _fill) = tracking_setup();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let n = 1usize << 20;
    let mut b = uninit(&alloc, &s, n);
    let p = b.device_ptr_raw().0;
    let _ = b.as_view();
    assert!(b.has_events(), "the view took the buffer's events");
    let graph = routed_capture(&alloc, &s, || {
        s.memset_zeros(&mut b).unwrap();
        drop(b);
        assert_eq!(
            alloc.quarantined_event_pairs(),
            1,
            "quarantined inside the capture"
        );
        assert_eq!(
            alloc.kept_event_pairs(),
            0,
            "never kept for the next buffer"
        );
    });
    assert_eq!(
        alloc.quarantined_event_pairs(),
        0,
        "destroyed after the capture"
    );
    assert_eq!(ctx.check_err(), Ok(()));
    graph.launch().unwrap();
    s.synchronize().unwrap();
    drop(graph);
    // The block is back: its next buffer's uses record their events with no error.
    let c = alloc.alloc_zeros::<u32>(&s, n).unwrap();
    assert_eq!(c.device_ptr_raw().0, p, "the same block again");
    s.synchronize().unwrap();
    assert_eq!(ctx.check_err(), Ok(()));
    drop(c);
    s.synchronize().unwrap();
    alloc.empty_cache().unwrap();
}

/// As above, with the buffer's stream on another `CudaContext` object of the same device than
/// the cache's: the quarantined shell was made under the stream's object, where cudarc records
/// its failed waits at the destruction after the capture, so that is the object whose error is
/// set aside and put back (the first version cleared the cache's object and left the stream's
/// object a `CUDA_ERROR_INVALID_VALUE` the program never caused).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_quarantined_shell_of_another_context_object_leaves_that_object_no_error() {
    crate::util::require_gpu(
        "a_quarantined_shell_of_another_context_object_leaves_that_object_no_error",
    );
    let (ctx_a, s, _s2, _fill) = tracking_setup();
    let ctx_b = CudaContext::new(0).unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&ctx_b), AllocatorConfig::default()).unwrap();
    let n = 1usize << 20;
    let mut b = uninit(&alloc, &s, n);
    let _ = b.as_view();
    assert!(b.has_events(), "the view took the buffer's events");
    let graph = routed_capture(&alloc, &s, || {
        s.memset_zeros(&mut b).unwrap();
        drop(b);
        assert_eq!(alloc.quarantined_event_pairs(), 1, "quarantined");
    });
    assert_eq!(
        alloc.quarantined_event_pairs(),
        0,
        "destroyed after the capture"
    );
    assert_eq!(ctx_a.check_err(), Ok(()), "the stream's context object");
    assert_eq!(ctx_b.check_err(), Ok(()), "the cache's context object");
    graph.launch().unwrap();
    s.synchronize().unwrap();
    drop(graph);
    alloc.empty_cache().unwrap();
}

/// Note [Typed shells made inside a capture], with event tracking on: a buffer written on a
/// second stream by a slow kernel before a capture of its own stream, whose `try_as_cuda_slice`
/// is called inside the capture (a borrow of cudarc's type, which queues nothing for cudarc's
/// own buffer), must leave the capture valid (the first version made the capturing stream wait
/// on the byte shell's write, recorded outside the capture: `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`),
/// and a read of the typed buffer on a third stream after the capture must still see the slow
/// kernel's write. The control arm reads the same memory through the driver at the same point,
/// ordered by nothing: it must see the old values, or the kernel was too short to tell.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_typed_buffer_made_inside_a_capture_leaves_it_valid_and_orders_later_reads() {
    crate::util::require_gpu(
        "a_typed_buffer_made_inside_a_capture_leaves_it_valid_and_orders_later_reads",
    );
    let (ctx, s, s2, _fill) = tracking_setup();
    let s3 = ctx.new_stream().unwrap();
    let spin = crate::util::load_module(&ctx, KERNELS)
        .load_function("spin_fill_pattern")
        .unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let len = 1usize << 20;
    // A scratch block written inside the capture, through the driver (no events).
    // SAFETY: a plain allocation of `len` u32, freed at the end of the test.
    let scratch = unsafe { result::malloc_sync(len * 4) }.unwrap();
    for probe in [true, false] {
        let arm = if probe { "probe" } else { "control" };
        let mut b = alloc.alloc_zeros::<u32>(&s, len).unwrap();
        ctx.synchronize().unwrap();
        let (n64, seed, cycles) = (len as u64, 0x77u32, 1_000_000_000i64);
        let mut l = s2.launch_builder(&spin);
        l.arg(&mut b).arg(&n64).arg(&seed).arg(&cycles);
        // SAFETY: spin_fill_pattern(unsigned*, u64, u32, i64) writes `len` values of a buffer
        // holding `len`; it runs on only two blocks, leaving the device free for the reads.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (2, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        assert!(b.has_events(), "{arm}: the kernel took the buffer's events");
        let (graph, launched) = in_capture(&s, || {
            if probe {
                if let Err(e) = b.try_as_cuda_slice() {
                    panic!("{arm}: as_cuda_slice: {e}");
                }
            }
            // SAFETY: `scratch` holds `len * 4` bytes.
            unsafe { result::memset_d8_async(scratch, 0x5A, len * 4, s.cu_stream()) }
        });
        assert!(launched.is_ok(), "{arm}: inside the capture: {launched:?}");
        let graph = graph
            .unwrap_or_else(|e| panic!("{arm}: the capture failed: {e:?}"))
            .expect("a graph");
        assert_eq!(
            ctx.check_err(),
            Ok(()),
            "{arm}: no error kept in the context"
        );
        let fresh = if probe {
            s3.clone_dtoh(b.as_cuda_slice()).unwrap()
        } else {
            read_raw(b.device_ptr_raw().0, len)
        };
        let sees = fresh
            .iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, seed));
        println!("{arm}: the read after the capture saw the slow kernel's write: {sees}");
        assert_eq!(
            sees, probe,
            "{arm}: the probe's read must wait for the kernel; the control's must not"
        );
        ctx.synchronize().unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();
        drop(graph);
        drop(b);
        ctx.synchronize().unwrap();
        assert_eq!(ctx.check_err(), Ok(()), "{arm}: the drop");
    }
    // SAFETY: allocated above; every use is synchronized.
    unsafe { result::free_sync(scratch) }.unwrap();
    alloc.empty_cache().unwrap();
}

/// A blocking stream (`CU_STREAM_DEFAULT`, which the legacy default stream synchronizes with) of
/// `ctx`'s device, wrapped for cudarc; destroy it with `result::stream::destroy` after use.
fn blocking_stream(ctx: &Arc<CudaContext>) -> (sys::CUstream, Arc<CudaStream>) {
    ctx.bind_to_thread().unwrap();
    let raw = result::stream::create(result::stream::StreamKind::Default).unwrap();
    // SAFETY: `raw` is a live stream of `ctx`'s context, destroyed by the caller after the
    // wrapper and every use of it.
    (raw, unsafe { ctx.wrap_borrowed_stream(raw) })
}

/// Note [Displaced shells]: while a routed capture of a blocking stream is underway, a buffer
/// of another stream (not capturing) is dropped and its shell replaces the block's kept one (of
/// another `CudaContext` object, so the buffer made its own). The replaced shell's destruction
/// waits on its events on the legacy default stream, which the capture of a blocking stream
/// forbids (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`): it must be quarantined until the capture ends.
/// The control arm makes that very wait inside the same kind of capture, and must find the
/// capture invalidated (or the probe proves nothing on this driver).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_shell_displaced_during_a_capture_of_a_blocking_stream_leaves_it_valid() {
    crate::util::require_gpu(
        "a_shell_displaced_during_a_capture_of_a_blocking_stream_leaves_it_valid",
    );
    let (ctx_a, s, _s2, _fill) = tracking_setup();
    let ctx_b = CudaContext::new(0).unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&ctx_a), AllocatorConfig::default()).unwrap();
    let (raw_cap, cap) = blocking_stream(&ctx_a);
    let n = 1usize << 20;
    // SAFETY: a plain allocation of `n` u32, freed at the end of the test.
    let scratch = unsafe { result::malloc_sync(n * 4) }.unwrap();
    for probe in [true, false] {
        let arm = if probe { "probe" } else { "control" };
        // The block's kept shell, of `ctx_a`'s object, with its write recorded.
        let a = alloc.alloc_zeros::<u32>(&s, n).unwrap();
        let p = a.device_ptr_raw();
        drop(a);
        s.synchronize().unwrap();
        assert_eq!(
            alloc.kept_event_pairs(),
            1,
            "{arm}: the used buffer's events are kept"
        );
        // The same stream through `ctx_b`'s object: the next buffer there gets the block but
        // not its kept shell, and makes its own.
        // SAFETY: `s` outlives this wrapper (dropped with `b` below, before `s`).
        let sb = unsafe { ctx_b.wrap_borrowed_stream(s.cu_stream()) };
        let b = uninit(&alloc, &sb, n);
        assert_eq!(b.device_ptr_raw(), p, "{arm}: the same block again");
        let _ = b.as_view();
        assert!(
            b.has_events(),
            "{arm}: the view made the buffer's own shell"
        );
        cap.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let guard = EndCaptureOnPanic(&cap);
        let pool = alloc.capture_pool(&cap).unwrap();
        // SAFETY: `scratch` holds `n * 4` bytes.
        unsafe { result::memset_d8_async(scratch, 0x5A, n * 4, cap.cu_stream()) }.unwrap();
        if probe {
            drop(b);
            assert_eq!(
                alloc.quarantined_event_pairs(),
                1,
                "{arm}: the displaced shell waits for the capture's end"
            );
        } else {
            drop(b);
            // What the displaced shell's destruction did: a wait on the legacy default stream
            // for an event recorded outside the capture.
            let ev = ctx_a.new_event(None).unwrap();
            ev.record(&s).unwrap();
            let waited = ctx_a.default_stream().wait(&ev);
            println!("{arm}: a wait on the legacy default stream inside the capture: {waited:?}");
        }
        let ended = pool.end_capture(&cap, sys::CUgraphInstantiate_flags(0));
        std::mem::forget(guard);
        let ended_ok = ended.is_ok();
        println!("{arm}: the capture's end: {:?}", ended.as_ref().map(|_| ()));
        drop(ended);
        assert_eq!(
            ended_ok, probe,
            "{arm}: the probe's capture must stay valid; the control's wait must invalidate it"
        );
        assert_eq!(
            alloc.quarantined_event_pairs(),
            0,
            "{arm}: destroyed after the capture"
        );
        ctx_a.synchronize().unwrap();
        let _ = ctx_a.check_err();
        let _ = ctx_b.check_err();
        alloc.empty_cache().unwrap();
    }
    // SAFETY: allocated above; every use is synchronized.
    unsafe { result::free_sync(scratch) }.unwrap();
    drop(cap);
    // SAFETY: made by `blocking_stream`; its wrapper is dropped and its work synchronized.
    unsafe { result::stream::destroy(raw_cap) }.unwrap();
}

/// `CudaAllocator::restore_pool` frees every allocation of the pool that is live, and it was a
/// safe function: a `CachedSlice` routed into the pool (here by `begin_allocate_to_pool`, as
/// PyTorch's `use_mem_pool`) lost its block while it still owned it, and the next allocation in
/// the pool got the same bytes: two live buffers on one range, written by two kernels, and the
/// old buffer's drop later freeing the new one's block. `restore_pool` is now `unsafe` (its
/// caller promises that no live buffer owns an allocation of the pool; a `compile_fail` doctest
/// keeps safe code from calling it); this test breaks that promise on purpose and shows the
/// overlap it would cause.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_restore_pool_frees_the_block_of_a_live_cached_slice() {
    const N: usize = 1 << 20;
    let g = gpu("cuda_restore_pool_frees_the_block_of_a_live_cached_slice");
    let alloc = CudaAllocator::new(g.ctx.clone(), AllocatorConfig::default()).unwrap();
    let stream = g.ctx.new_stream().unwrap();
    // A pool with one segment: a capture that allocates, writes and frees a buffer in it.
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    let graph = {
        let _end = EndCaptureOnPanic(&stream);
        let pool = alloc.capture_pool(&stream).unwrap();
        let mut t = uninit(&alloc, &stream, N);
        fill(g, &stream, &mut t, 1);
        drop(t);
        pool.end_capture(&stream, sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("the capture recorded a kernel")
    };
    let id = graph.pool().id();
    let sid = cuda_caching_allocator::backend::cuda::stream_id(&stream);
    let checkpoint = alloc.pool_checkpoint(id).unwrap();
    alloc
        .begin_allocate_to_pool(id, Box::new(move |s| s == sid))
        .unwrap();
    let mut live = uninit(&alloc, &stream, N);
    alloc.end_allocate_to_pool(id).unwrap();
    fill(g, &stream, &mut live, 2);
    stream.synchronize().unwrap();
    // SAFETY: deliberately broken (obligation 1): `live` owns an allocation of the pool.
    let restored = unsafe { alloc.restore_pool(&checkpoint) }.unwrap();
    assert!(
        restored.freed.contains(&live.device_ptr_raw()),
        "the restore freed the live buffer's block: {restored:?}"
    );
    alloc
        .begin_allocate_to_pool(id, Box::new(move |s| s == sid))
        .unwrap();
    let other = uninit(&alloc, &stream, N);
    alloc.end_allocate_to_pool(id).unwrap();
    assert!(
        overlaps(range(&live), range(&other)),
        "a new buffer in the pool lands on the live one's bytes"
    );
    // Keep the test itself from freeing the same block twice.
    let _ = live.leak();
    drop(other);
    drop(graph);
}
