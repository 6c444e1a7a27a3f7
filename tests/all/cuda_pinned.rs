//! GPU tests of the pinned host cache on CUDA (issue #16): `PinnedCache<CudaHost>` and the cudarc
//! interop (`PinnedAllocator`, `CachedPinned<T>` as cudarc's `HostSlice`).
//!
//! The reuse-after-copy probe queues a host-to-device copy behind a delay kernel, frees the
//! pinned buffer at once, allocates the same size again and overwrites it on the host: the copied
//! data must be the original. It runs through `CachedPinned` on a context that manages stream
//! synchronization (cudarc records the buffer's event), on a single-stream context (the legacy
//! stream fence), and through the raw cache with `record_stream`; the control arm frees through
//! the raw cache without declaring the stream, so the block is reused at once and the race must
//! show, or the probe proves nothing. `#[ignore]`d like `cuda.rs` (`--include-ignored` runs them), single-threaded.
#![cfg(feature = "cuda")]

use std::sync::{Arc, OnceLock};

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::BackendError;
use cuda_caching_allocator::backend::cuda::CudaDevice;
use cuda_caching_allocator::host::{
    CudaHost, HostFence, HostPtr, PagedPinnedCache, PinMethod, PinnedCache, PinnedConfig,
};
use cuda_caching_allocator::interop::{CudaAllocator, PinnedAllocator};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DeviceSlice, HostSlice,
    LaunchConfig, PushKernelArg, SyncOnDrop, result, sys,
};

use crate::util::{require_gpu, under_sanitizer};

const TRIALS: usize = 10;
/// Values per buffer: 4 MiB of `u32`.
const N: usize = 1 << 20;
/// About 20 ms of spinning at 2 GHz: long enough for the host to free, reallocate and overwrite.
const SPIN: i64 = 40_000_000;

const KERNELS: &str = r#"
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
extern "C" __global__ void spin_fill(unsigned int* p, unsigned long long n, unsigned int v,
                                     long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = v + (unsigned int)i;
}
"#;

struct Kernels {
    spin: CudaFunction,
    spin_fill: CudaFunction,
}

fn kernels(ctx: &Arc<CudaContext>) -> Kernels {
    let module = crate::util::load_module(ctx, KERNELS);
    Kernels {
        spin: module.load_function("spin").unwrap(),
        spin_fill: module.load_function("spin_fill").unwrap(),
    }
}

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (256, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn pattern(v: u32) -> Vec<u32> {
    (0..N as u32).map(|i| v.wrapping_add(i)).collect()
}

/// Queues the delay kernel on `s`: the next work on `s` starts about 20 ms later.
fn delay(k: &Kernels, s: &Arc<CudaStream>) {
    let mut l = s.launch_builder(&k.spin);
    l.arg(&SPIN);
    // SAFETY: spin(long long) touches no memory.
    unsafe { l.launch(one_block()) }.unwrap();
}

/// A context object of device 0 (its own stream count and tracking flag) with `streams` new
/// streams; the work stream is the last new one, or the default stream with none.
fn setup(streams: usize) -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).unwrap();
    let mut s = ctx.default_stream();
    for _ in 0..streams {
        s = ctx.new_stream().unwrap();
    }
    (ctx, s)
}

/// The probe through `CachedPinned`: returns (trials whose copy saw the overwrite, trials whose
/// second buffer got the first one's address without a host wait for the copy).
/// With `default_first`, the buffer is first copied on the legacy default stream too, so that its
/// event must cover a blocking and a non-blocking stream at once.
/// With `pages`, the buffers come from [`PinnedAllocator::host_pages`].
fn cached_probe(streams: usize, default_first: bool, pages: bool) -> (usize, usize) {
    let (ctx, s) = setup(streams);
    let legacy = ctx.default_stream();
    let k = kernels(&ctx);
    let pinned = if pages {
        PinnedAllocator::host_pages(Arc::clone(&ctx), 4).unwrap()
    } else {
        PinnedAllocator::new(Arc::clone(&ctx), PinnedConfig::default()).unwrap()
    };
    let (mut wrong, mut reused) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 3;
        let src = pinned.pinned_from_slice(&pattern(v)).unwrap();
        let mut dev: CudaSlice<u32> = s.alloc_zeros(N).unwrap();
        s.synchronize().unwrap();
        if default_first {
            let mut first: CudaSlice<u32> = legacy.alloc_zeros(N).unwrap();
            legacy.memcpy_htod(&src, &mut first).unwrap();
        }
        delay(&k, &s);
        s.memcpy_htod(&src, &mut dev).unwrap();
        // Complete once the copy is: the block handed out again while it is not is the bug this
        // probe looks for. Reuse after a wait for the copy (the cache's `PendingPolicy::Wait`,
        // the paged cache's wait, or a drop that synchronized: Note [Overlapping uses of one
        // buffer]) is the rule working.
        let copied = s.record_event(None).unwrap();
        let before = src.host_ptr();
        drop(src);
        let mut again = pinned.alloc_pinned_zeros::<u32>(N).unwrap();
        if again.host_ptr() == before && !copied.is_complete() {
            reused += 1;
        }
        again.as_mut_slice().unwrap().fill(0xDEAD_BEEF);
        let got = s.clone_dtoh(&dev).unwrap();
        if got != pattern(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    pinned.check_invariants().unwrap();
    (wrong, reused)
}

/// Writes `pattern(v)` into the `N` values at `host`, then queues their copy to a new device
/// buffer on `s` behind the delay kernel; returns the buffer.
///
/// # Safety
/// `host` holds `N` values of pinned memory owned by the caller, which stays allocated until `s`
/// is synchronized.
unsafe fn copy_behind_delay(
    k: &Kernels,
    s: &Arc<CudaStream>,
    host: HostPtr,
    v: u32,
) -> CudaSlice<u32> {
    // SAFETY: the caller's obligation: `N` values owned by the caller.
    let values = unsafe { std::slice::from_raw_parts_mut(host.addr() as *mut u32, N) };
    values.copy_from_slice(&pattern(v));
    let mut dev: CudaSlice<u32> = s.alloc_zeros(N).unwrap();
    s.synchronize().unwrap();
    delay(k, s);
    {
        let (dptr, _record) = dev.device_ptr_mut(s);
        // SAFETY: `dptr` holds `N` values; `values` stays allocated until `s` is synchronized
        // (the caller's obligation).
        unsafe { result::memcpy_htod_async(dptr, &values[..], s.cu_stream()) }.unwrap();
    }
    dev
}

/// The probe through the raw cache: `fenced` declares the copy's stream before the free, the
/// control arm does not. Returns (wrong, reused) as `cached_probe`.
fn raw_probe(fenced: bool) -> (usize, usize) {
    let (ctx, s) = setup(1);
    let k = kernels(&ctx);
    let device = Arc::new(CudaDevice::new(Arc::clone(&ctx)).unwrap());
    let stream = device.admit_stream(&s).unwrap();
    let cache = PinnedCache::new(CudaHost::new(device), PinnedConfig::default()).unwrap();
    let bytes = N * std::mem::size_of::<u32>();
    let (mut wrong, mut reused) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 5;
        let a = cache.alloc(bytes).unwrap();
        // SAFETY: the block holds `bytes` bytes of pinned memory handed to this test alone, kept
        // allocated (by the cache) until the stream is synchronized at the end of the trial.
        let dev = unsafe { copy_behind_delay(&k, &s, a.ptr, v) };
        if fenced {
            cache.record_stream(a.ptr, stream).unwrap();
        }
        cache.free(a.ptr).unwrap();
        let b = cache.alloc(bytes).unwrap();
        if b.ptr == a.ptr {
            reused += 1;
        }
        // SAFETY: `b` is handed to this test alone (the control arm overwrites memory the queued
        // copy still reads: a data race on plain integers, which is what the arm measures).
        unsafe { std::slice::from_raw_parts_mut(b.ptr.addr() as *mut u32, N) }.fill(0xDEAD_BEEF);
        let got = s.clone_dtoh(&dev).unwrap();
        if got != pattern(v) {
            wrong += 1;
        }
        cache.free(b.ptr).unwrap();
        ctx.synchronize().unwrap();
    }
    cache.check_invariants().unwrap();
    (wrong, reused)
}

/// (managed, single-stream, managed after a default-stream copy, raw fenced, raw control),
/// computed once and printed for the log.
fn results() -> &'static [(usize, usize); 5] {
    static R: OnceLock<[(usize, usize); 5]> = OnceLock::new();
    R.get_or_init(|| {
        let r = [
            cached_probe(2, false, false),
            cached_probe(0, false, false),
            cached_probe(2, true, false),
            raw_probe(true),
            raw_probe(false),
        ];
        println!(
            "pinned reuse-after-copy probes, {TRIALS} trials each (wrong, reused): CachedPinned managed {:?}, CachedPinned single-stream {:?}, CachedPinned managed after a default-stream copy {:?}, raw cache with record_stream {:?}; control (raw, no fence) {:?}",
            r[0], r[1], r[2], r[3], r[4]
        );
        r
    })
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_freed_pinned_buffer_is_reused_only_after_its_copy() {
    require_gpu("a_freed_pinned_buffer_is_reused_only_after_its_copy");
    let [managed, single, both, raw, control] = *results();
    assert_eq!(
        both.0, 0,
        "CachedPinned (default stream, then another): the copy saw the new owner's data"
    );
    assert_eq!(
        managed.0, 0,
        "CachedPinned (managed): the copy saw the new owner's data"
    );
    assert_eq!(
        single.0, 0,
        "CachedPinned (single stream): the copy saw the new owner's data"
    );
    assert_eq!(
        raw.0, 0,
        "raw cache with record_stream: the copy saw the new owner's data"
    );
    assert_eq!(
        managed.1 + single.1 + both.1 + raw.1,
        0,
        "a block was reused before its copy ended"
    );
    if !under_sanitizer() {
        assert!(control.1 > 0, "control arm never reused the block");
        assert!(
            control.0 > 0,
            "control arm: the reuse-after-copy race did not show"
        );
    }
}

/// The probe through a raw [`PagedPinnedCache`] over host pages: `fenced` frees with a fence
/// (an event recorded behind the copy), the control arm frees at once. Returns (wrong, reused).
fn paged_raw_probe(fenced: bool) -> (usize, usize) {
    let (ctx, s) = setup(1);
    let k = kernels(&ctx);
    let device = CudaDevice::host_pages(Arc::clone(&ctx)).unwrap();
    let own = ctx.new_stream().unwrap();
    let id = device.admit_stream(&own).unwrap();
    let cache = PagedPinnedCache::new(device, id, AllocatorConfig::default(), 0).unwrap();
    let bytes = N * std::mem::size_of::<u32>();
    let (mut wrong, mut reused) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 7;
        let a = cache.alloc(bytes).unwrap();
        // SAFETY: the block holds `bytes` bytes of host pages (mapped with host access) handed
        // to this test alone, kept mapped until the stream is synchronized at the end of the
        // trial.
        let dev = unsafe { copy_behind_delay(&k, &s, a, v) };
        if fenced {
            let ev = ctx.new_event(None).unwrap();
            ev.record(&s).unwrap();
            cache.free_after(a, Box::new(EventFence(ev))).unwrap();
        } else {
            cache.free(a).unwrap();
        }
        let b = cache.alloc(bytes).unwrap();
        if b == a {
            reused += 1;
        }
        // SAFETY: as in `raw_probe`: the control arm races the queued copy on purpose.
        unsafe { std::slice::from_raw_parts_mut(b.addr() as *mut u32, N) }.fill(0xDEAD_BEEF);
        let got = s.clone_dtoh(&dev).unwrap();
        if got != pattern(v) {
            wrong += 1;
        }
        cache.free(b).unwrap();
        ctx.synchronize().unwrap();
    }
    cache.check_invariants().unwrap();
    (wrong, reused)
}

/// A CUDA event as the paged cache's fence.
#[derive(Debug)]
struct EventFence(cudarc::driver::CudaEvent);

impl HostFence for EventFence {
    fn query(&mut self) -> Result<bool, BackendError> {
        self.0.try_is_complete().map_err(|e| BackendError::Driver {
            operation: "cuEventQuery",
            source: Box::new(e),
        })
    }

    fn wait(&mut self) -> Result<(), BackendError> {
        self.0.synchronize().map_err(|e| BackendError::Driver {
            operation: "cuEventSynchronize",
            source: Box::new(e),
        })
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_freed_host_pages_buffer_is_reused_only_after_its_copy() {
    require_gpu("a_freed_host_pages_buffer_is_reused_only_after_its_copy");
    let r = [
        cached_probe(2, false, true),
        cached_probe(0, false, true),
        cached_probe(2, true, true),
        paged_raw_probe(true),
        paged_raw_probe(false),
    ];
    println!(
        "host pages reuse-after-copy probes, {TRIALS} trials each (wrong, reused): CachedPinned managed {:?}, single-stream {:?}, managed after a default-stream copy {:?}, raw paged cache with a fence {:?}; control (raw, no fence) {:?}",
        r[0], r[1], r[2], r[3], r[4]
    );
    for (i, what) in [
        "managed",
        "single stream",
        "default stream, then another",
        "raw with a fence",
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(
            r[i].0, 0,
            "host pages ({what}): the copy saw the new owner's data"
        );
        assert_eq!(
            r[i].1, 0,
            "host pages ({what}): reused before its copy ended"
        );
    }
    if !under_sanitizer() {
        assert!(r[4].1 > 0, "control arm never reused the block");
        assert!(
            r[4].0 > 0,
            "control arm: the reuse-after-copy race did not show"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn host_pages_round_trip_across_pages_and_page_moves() {
    require_gpu("host_pages_round_trip_across_pages_and_page_moves");
    let ctx = CudaContext::new(0).unwrap();
    let pinned = PinnedAllocator::host_pages(Arc::clone(&ctx), 4).unwrap();
    assert!(pinned.is_host_pages());
    // The cache's own stream is the driver's, not cudarc's: a context with no stream of its own
    // stays in single-stream mode (cudarc's event tracking unchanged).
    assert!(
        !ctx.is_in_multi_stream_mode(),
        "building the host-pages cache switched the context to multi-stream mode"
    );
    let s = ctx.new_stream().unwrap();
    // Sizes that span many 2 MiB pages and, freed and asked for in another order, make the
    // allocator move free pages (unmap, map elsewhere): every buffer must still carry its data
    // through the device and back.
    let mut held = Vec::new();
    for round in 0..6u32 {
        for (j, &n) in [3 * N, N / 3 + 5, 5 * N + 17, 1000].iter().enumerate() {
            let v = round * 100 + j as u32;
            let src: Vec<u32> = (0..n as u32).map(|i| v.wrapping_mul(7919) ^ i).collect();
            let h = pinned.pinned_from_slice(&src).unwrap();
            let d = s.clone_htod(&h).unwrap();
            let mut back = pinned.alloc_pinned_zeros::<u32>(n).unwrap();
            s.memcpy_dtoh(&d, &mut back).unwrap();
            assert_eq!(back.as_slice().unwrap(), &src[..], "round {round} size {n}");
            if (round + j as u32) % 2 == 0 {
                held.push(h);
            }
        }
        if round % 2 == 1 {
            held.drain(..held.len() / 2);
        }
    }
    drop(held);
    pinned.check_invariants().unwrap();
    let st = pinned.stats();
    let calls = pinned.host_page_call_times().unwrap();
    println!(
        "host pages round trip: {}; unmaps {:?}",
        st.summary(),
        calls.get("unmap")
    );
    assert!(st.num_pins > 0);
    assert!(pinned.empty_cache().unwrap() > 0);
    assert_eq!(pinned.stats().reserved_bytes.current, 0);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cached_pinned_round_trips_through_cudarc() {
    require_gpu("cached_pinned_round_trips_through_cudarc");
    for streams in [0, 2] {
        let (ctx, s) = setup(streams);
        let k = kernels(&ctx);
        let pinned = PinnedAllocator::new(Arc::clone(&ctx), PinnedConfig::default()).unwrap();
        // htod from cached pinned memory (clone_htod, memcpy_htod), dtoh into it.
        let src = pinned.pinned_from_slice(&pattern(17)).unwrap();
        let dev = s.clone_htod(&src).unwrap();
        let mut back = pinned.alloc_pinned_zeros::<u32>(N).unwrap();
        s.memcpy_dtoh(&dev, &mut back).unwrap();
        assert_eq!(
            back.as_slice().unwrap(),
            &pattern(17)[..],
            "streams {streams}"
        );
        // Host access waits for a dtoh queued behind a slow kernel.
        let mut slow: CudaSlice<u32> = s.alloc_zeros(N).unwrap();
        let (n, v) = (N as u64, 99u32);
        let mut fill = s.launch_builder(&k.spin_fill);
        fill.arg(&mut slow).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes `N` values of an `N`-value buffer.
        unsafe { fill.launch(grid()) }.unwrap();
        s.memcpy_dtoh(&slow, &mut back).unwrap();
        assert_eq!(
            back.as_slice().unwrap(),
            &pattern(99)[..],
            "streams {streams}: as_slice waited"
        );
        // A second round is served from the cache: no new pin.
        let pins = pinned.stats().num_pins;
        drop((src, back));
        ctx.synchronize().unwrap();
        let again = pinned.pinned_from_slice(&pattern(5)).unwrap();
        let dev2 = s.clone_htod(&again).unwrap();
        assert_eq!(s.clone_dtoh(&dev2).unwrap(), pattern(5));
        assert_eq!(
            pinned.stats().num_pins,
            pins,
            "streams {streams}: a cache hit pinned"
        );
        assert!(pinned.stats().num_cache_hits > 0);
        drop(again);
        ctx.synchronize().unwrap();
        pinned.check_invariants().unwrap();
        println!("streams {streams}: {}", pinned.summary());
        // Empty: zero-length buffers need no memory.
        let empty = pinned.pinned_from_slice::<u32>(&[]).unwrap();
        assert!(empty.is_empty());
        drop(empty);
        assert!(pinned.empty_cache().unwrap() > 0);
        assert_eq!(pinned.stats().reserved_bytes.current, 0);
        assert_eq!(pinned.kept_events(), 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn caching_allocator_takes_cached_pinned_buffers() {
    require_gpu("caching_allocator_takes_cached_pinned_buffers");
    let ctx = CudaContext::new(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    // SAFETY: every value is written below before it is read.
    let mut host = unsafe { alloc.alloc_pinned::<f32>(4096) }.unwrap();
    for (i, x) in host.as_mut_slice().unwrap().iter_mut().enumerate() {
        *x = i as f32;
    }
    let dev = alloc.clone_htod(&s, &host).unwrap();
    assert_eq!(alloc.dtoh(&dev).unwrap(), host.as_slice().unwrap());
    let stats = alloc.pinned().unwrap().stats();
    assert_eq!(stats.num_allocs, 1);
    assert_eq!(stats.requested_bytes.current, 4096 * 4);
    drop(host);
    s.synchronize().unwrap();
    // Unused buffers: alloc + free makes no event query once nothing is pending.
    let p = alloc.pinned().unwrap();
    // SAFETY: never read.
    drop(unsafe { p.alloc_pinned::<u8>(1 << 16) }.unwrap());
    assert_eq!(p.waiting_blocks(), 0);
    let queries = p.stats().num_event_queries;
    for _ in 0..100 {
        // SAFETY: never read.
        drop(unsafe { p.alloc_pinned::<u8>(1 << 16) }.unwrap());
    }
    assert_eq!(
        p.stats().num_event_queries,
        queries,
        "polled without pending copies"
    );
    assert_eq!(p.waiting_blocks(), 0);
    // A copy still queued when the buffer is dropped: the block waits, then returns.
    let k = kernels(&ctx);
    let src = p.pinned_from_slice(&pattern(1)).unwrap();
    let mut d: CudaSlice<u32> = s.alloc_zeros(N).unwrap();
    delay(&k, &s);
    s.memcpy_htod(&src, &mut d).unwrap();
    drop(src);
    assert_eq!(
        p.waiting_blocks(),
        1,
        "dropped during the copy: waiting for its event"
    );
    s.synchronize().unwrap();
    drop(p.pinned_from_slice(&[0u8; 16]).unwrap());
    assert_eq!(p.waiting_blocks(), 0, "returned once the event completed");
    assert_eq!(s.clone_dtoh(&d).unwrap(), pattern(1));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn registered_and_allocated_slabs_both_round_trip() {
    require_gpu("registered_and_allocated_slabs_both_round_trip");
    let (ctx, s) = setup(1);
    for (name, method) in [
        ("cuMemHostAlloc", PinMethod::HostAlloc),
        (
            "register",
            PinMethod::Register {
                min_size: 0,
                touch_threads: 4,
            },
        ),
    ] {
        // Through the raw cache, to see which way its slabs were pinned.
        let host =
            CudaHost::with_method(Arc::new(CudaDevice::new(Arc::clone(&ctx)).unwrap()), method);
        // The device registers host memory, so the backend still tries registration (Note
        // [Registration refused]).
        let supported = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
            )
            .unwrap();
        assert_eq!(supported, 1, "this device does not register host memory");
        assert!(!host.registration_refused(), "{name}: registration off");
        let cache = PinnedCache::new(host, PinnedConfig::default()).unwrap();
        let block = cache.alloc(4 * N).unwrap();
        assert_eq!(
            cache.host().registered_slabs(),
            usize::from(name == "register"),
            "{name}: slabs registered"
        );
        cache.check_invariants().unwrap();
        cache.free(block.ptr).unwrap();
        assert!(cache.empty_cache().unwrap() > 0, "{name}: nothing unpinned");
        assert_eq!(
            cache.host().registered_slabs(),
            0,
            "{name}: still registered"
        );
        // Through cudarc: htod from a cached buffer, dtoh into another, both in slabs pinned
        // this way, a slow kernel in front so that the copies are truly asynchronous.
        let k = kernels(&ctx);
        let pinned =
            PinnedAllocator::with_method(Arc::clone(&ctx), PinnedConfig::default(), method)
                .unwrap();
        let src = pinned.pinned_from_slice(&pattern(41)).unwrap();
        delay(&k, &s);
        let dev = s.clone_htod(&src).unwrap();
        let mut back = pinned.alloc_pinned_zeros::<u32>(N).unwrap();
        s.memcpy_dtoh(&dev, &mut back).unwrap();
        assert_eq!(back.as_slice().unwrap(), &pattern(41)[..], "{name}");
        assert_eq!(
            pinned.stats().num_pins,
            1,
            "{name}: one slab for both buffers"
        );
        drop((src, back));
        ctx.synchronize().unwrap();
        pinned.check_invariants().unwrap();
        assert!(
            pinned.empty_cache().unwrap() > 0,
            "{name}: nothing unpinned"
        );
    }
}

/// A device buffer from `cuMemAlloc` with no cudarc events: cudarc's `CudaSlice` waits on its
/// own events before every use, and inside a capture a wait on an event recorded outside it
/// invalidates the capture (`gpu/probes/capture_event_wait.cu`), so the capture probe copies
/// into this instead.
struct RawDst {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<u32> for RawDst {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtrMut<u32> for RawDst {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// A copy from a pinned buffer captured into a CUDA graph reads the buffer again at every launch
/// of the graph, so the cache must never hand that memory out again. cudarc records the buffer's
/// event after the copy, inside the capture; once the capture has ended the driver refuses to
/// query or wait on that event (`CUDA_ERROR_INVALID_VALUE` until it is recorded again outside a
/// capture, `gpu/probes/capture_event_wait.cu`), and the cache takes a failed query as "not
/// yet". Probe, for both engines: capture a copy from a fresh buffer (whose pooled event was
/// recorded for an earlier buffer, which a wait inside the capture must not touch), drop it,
/// allocate and overwrite buffers of the same size, launch the graph, and check what it copied.
/// The control arm copies outside a capture: the next buffer of that size then gets the same
/// address (so the address check can fail).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_pinned_buffer_copied_inside_a_capture_is_never_reused() {
    require_gpu("a_pinned_buffer_copied_inside_a_capture_is_never_reused");
    for pages in [false, true] {
        let (ctx, s) = setup(2);
        let pinned = if pages {
            PinnedAllocator::host_pages(Arc::clone(&ctx), 4).unwrap()
        } else {
            PinnedAllocator::new(Arc::clone(&ctx), PinnedConfig::default()).unwrap()
        };
        // Control: a copy outside a capture, waited for; the buffer's memory (and its event,
        // recorded by cudarc) come back.
        let c = pinned.pinned_from_slice(&pattern(1)).unwrap();
        let scratch = s.clone_htod(&c).unwrap();
        s.synchronize().unwrap();
        let c_addr = c.host_ptr();
        drop(c);
        let again = pinned.pinned_from_slice(&pattern(2)).unwrap();
        assert_eq!(
            again.host_ptr(),
            c_addr,
            "pages {pages}: control: a buffer whose copy is done is the best fit again"
        );
        drop((again, scratch));
        s.synchronize().unwrap();

        let src = pinned.pinned_from_slice(&pattern(7)).unwrap();
        let src_addr = src.host_ptr();
        // SAFETY: a fresh device allocation of `N` u32, freed below.
        let raw = unsafe { result::malloc_sync(N * 4) }.unwrap();
        let mut dst = RawDst {
            ptr: raw,
            len: N,
            stream: Arc::clone(&s),
        };
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let copied = s.memcpy_htod(&src, &mut dst);
        let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
        copied.unwrap();
        let graph = graph.unwrap().expect("the capture recorded the copy");
        drop(src);
        assert!(
            pinned.waiting_blocks() >= 1,
            "pages {pages}: the captured buffer must wait"
        );
        let mut others = Vec::new();
        for i in 0..8u32 {
            let b = pinned.pinned_from_slice(&pattern(100 + i)).unwrap();
            assert_ne!(
                b.host_ptr(),
                src_addr,
                "pages {pages}: the captured buffer was handed out again"
            );
            others.push(b);
        }
        for launch in 0..3 {
            graph.launch().unwrap();
            s.synchronize().unwrap();
            let mut back = vec![0u32; N];
            // SAFETY: `raw` holds `N` u32, alive here; the stream that wrote it is synchronized.
            unsafe { result::memcpy_dtoh_sync(&mut back, raw) }.unwrap();
            assert!(
                back == pattern(7),
                "pages {pages}, launch {launch}: the graph copied someone else's data"
            );
        }
        drop(others);
        assert!(pinned.waiting_blocks() >= 1, "pages {pages}");
        println!("pages {pages}: {}", pinned.summary());
        drop(graph);
        s.synchronize().unwrap();
        // SAFETY: `raw` came from `malloc_sync` and no queued work uses it any more.
        unsafe { result::free_sync(raw) }.unwrap();
    }
}

/// Note [Management that ends mid-use] (`src/interop/pinned.rs`): cudarc asks whether the
/// context manages synchronization when a use begins and again when the use's `SyncOnDrop`
/// drops, and records the buffer's event only if it still does. Probe, for both engines: a copy
/// on a borrowed stream (one cudarc does not count) made as cudarc's `memcpy_htod` makes it, with
/// the context's only stream of its own dropped between the use's start and its end (what another
/// thread may do), queued behind a delay kernel; then the buffer is dropped, a buffer of the same
/// size allocated and overwritten on the host. The copy must have read the original values. On
/// the library before the fix the event stays unrecorded, the block is reused at once and the
/// copy reads the new owner's values (10 of 10 trials, H200). Two premise checks (the delay
/// kernel still running at the drop, the block reused) keep the probe from passing vacuously.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_copy_cudarc_leaves_unrecorded_is_still_waited_for() {
    require_gpu("a_copy_cudarc_leaves_unrecorded_is_still_waited_for");
    for pages in [false, true] {
        let ctx = CudaContext::new(0).unwrap();
        let k = kernels(&ctx);
        let pinned = if pages {
            PinnedAllocator::host_pages(Arc::clone(&ctx), 4).unwrap()
        } else {
            PinnedAllocator::new(Arc::clone(&ctx), PinnedConfig::default()).unwrap()
        };
        ctx.bind_to_thread().unwrap();
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        // SAFETY: `raw` is a stream of this context's device, kept until `borrowed` and every
        // use of it are gone (destroyed at the end of this iteration, after a synchronization).
        let borrowed = unsafe { ctx.wrap_borrowed_stream(raw) };
        let mut wrong = 0;
        for trial in 0..TRIALS {
            // The context's only stream of its own: while it lives, synchronization is managed.
            let own = ctx.new_stream().unwrap();
            assert!(ctx.is_managing_stream_synchronization());
            let v = 1000 * trial as u32 + 9;
            let src = pinned.pinned_from_slice(&pattern(v)).unwrap();
            let mut dev: CudaSlice<u32> = borrowed.alloc_zeros(N).unwrap();
            borrowed.synchronize().unwrap();
            delay(&k, &borrowed);
            // Completes when the delay kernel does: the premise check before the drop below.
            let marker = borrowed.record_event(None).unwrap();
            {
                // SAFETY: cudarc's contract for `stream_synced_slice`: the slice is used only by
                // work queued on `borrowed` (the copy below) before `record` drops.
                let (values, record) = unsafe { src.stream_synced_slice(&borrowed) };
                drop(own);
                assert!(!ctx.is_managing_stream_synchronization());
                let (dptr, record_dev) = dev.device_ptr_mut(&borrowed);
                // SAFETY: `dptr` holds `N` values, `values` `N` pinned values; the host memory
                // stays allocated (the cache owns it after the drop), and whether it is handed
                // out again before the copy ends is what this test checks.
                unsafe { result::memcpy_htod_async(dptr, values, borrowed.cu_stream()) }.unwrap();
                drop(record_dev);
                drop(record);
            }
            if !under_sanitizer() {
                // Premise: the copy is still queued behind the delay kernel when the buffer drops
                // (else the probe would pass without testing anything).
                assert!(
                    !marker.is_complete(),
                    "pages {pages}: premise not met: the delay kernel ended before the drop"
                );
            }
            let src_addr = src.host_ptr();
            drop(src);
            let mut again = pinned.alloc_pinned_zeros::<u32>(N).unwrap();
            // Premise: the next buffer of that size gets the dropped one's block (once its copy
            // is waited for, with the fix; at once, without it), so its overwrite is what the
            // copy would read.
            assert_eq!(
                again.host_ptr(),
                src_addr,
                "pages {pages}: premise not met: the dropped buffer's block was not reused"
            );
            again.as_mut_slice().unwrap().fill(0xDEAD_BEEF);
            let got = borrowed.clone_dtoh(&dev).unwrap();
            if got != pattern(v) {
                wrong += 1;
            }
            ctx.synchronize().unwrap();
        }
        println!("unrecorded-use probe, pages {pages}: {wrong} of {TRIALS} trials wrong");
        pinned.check_invariants().unwrap();
        drop(borrowed);
        ctx.synchronize().unwrap();
        // SAFETY: `raw` came from `stream::create`; nothing uses it any more.
        unsafe { result::stream::destroy(raw) }.unwrap();
        assert_eq!(
            wrong, 0,
            "pages {pages}: a copy cudarc left unrecorded saw the new owner's data"
        );
    }
}

/// Note [Management that ends mid-use], with the cache on a context object of its own (as a
/// shared allocator's is) and the program's streams on another object of the same device: the
/// mark of a use goes with the stream's object, whose management decides whether cudarc
/// recorded the event. The cache's object has no stream and manages nothing; the first version
/// asked it, and every drop after a copy on one of the program's streams synchronized the whole
/// context (here: waited for a delay kernel queued on an unrelated stream), where cudarc's
/// buffer only waits for its own event. The copy's result is checked too.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_pinned_buffer_of_another_context_object_drops_without_synchronizing() {
    require_gpu("a_pinned_buffer_of_another_context_object_drops_without_synchronizing");
    let cache_ctx = CudaContext::new(0).unwrap();
    let pinned = PinnedAllocator::new(Arc::clone(&cache_ctx), PinnedConfig::default()).unwrap();
    assert!(!cache_ctx.is_managing_stream_synchronization());
    let (ctx, s1) = setup(2);
    let s2 = ctx.new_stream().unwrap();
    assert!(ctx.is_managing_stream_synchronization());
    let k = kernels(&ctx);
    let mut synchronized = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 21;
        let src = pinned.pinned_from_slice(&pattern(v)).unwrap();
        let dev: CudaSlice<u32> = s1.clone_htod(&src).unwrap();
        delay(&k, &s2);
        let marker = s2.record_event(None).unwrap();
        drop(src);
        // The delay kernel (about 20 ms) is still running when the drop returns, unless the drop
        // synchronized the context.
        if marker.is_complete() {
            synchronized += 1;
        }
        assert_eq!(
            s1.clone_dtoh(&dev).unwrap(),
            pattern(v),
            "the copy's values"
        );
        ctx.synchronize().unwrap();
    }
    pinned.check_invariants().unwrap();
    if !under_sanitizer() {
        assert_eq!(
            synchronized, 0,
            "drops that waited for an unrelated stream's kernel, of {TRIALS}"
        );
    }
}

/// Probe (review, not settled without a GPU): a request larger than a slab gets an exact slab of
/// its aligned size, which need not be a whole number of 4 KiB pages (the cache aligns to 256
/// bytes). From 4 MiB on `CudaHost` registers slabs, and if `cuMemHostRegister` refuses a size
/// that is not a multiple of the page size, `pin` falls back to `cuMemHostAlloc` without a word:
/// every such slab then pays an mmap, a touch of every page and a failed registration before the
/// allocation. This checks that the exact slab was registered and that a copy through it
/// round-trips.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn an_exact_slab_of_a_size_off_the_page_is_registered() {
    require_gpu("an_exact_slab_of_a_size_off_the_page_is_registered");
    let (ctx, s) = setup(1);
    let host = CudaHost::new(Arc::new(CudaDevice::new(Arc::clone(&ctx)).unwrap()));
    let cache = PinnedCache::new(host, PinnedConfig::default()).unwrap();
    // 64 MiB + 4 KiB + 256: above the default 64 MiB slab, so an exact slab of this size.
    let bytes = (64 << 20) + 4096 + 256;
    let block = cache.alloc(bytes).unwrap();
    assert_eq!(
        cache.stats().reserved_bytes.current,
        bytes as i64,
        "exact slab"
    );
    assert_eq!(
        cache.host().registered_slabs(),
        1,
        "a slab of {bytes} bytes was not registered (cuMemHostAlloc instead)"
    );
    assert!(
        !cache.host().registration_refused(),
        "a slab's failure turned registration off"
    );
    let n = bytes / 4;
    // SAFETY: the block is `bytes` long, pinned, and used only by this test until freed.
    let host_words = unsafe { std::slice::from_raw_parts_mut(block.ptr.addr() as *mut u32, n) };
    for (i, w) in host_words.iter_mut().enumerate() {
        *w = i as u32 ^ 0x5a5a_5a5a;
    }
    let dev = s.clone_htod(&host_words[..]).unwrap();
    // cudarc takes a plain slice for pageable memory and does not wait for the copy; this one
    // is pinned, so the copy runs asynchronously and must be done before the host overwrites
    // its source (without this wait the test failed once on an H200, twenty-sixth session).
    s.synchronize().unwrap();
    host_words.fill(0);
    s.memcpy_dtoh(&dev, &mut host_words[..]).unwrap();
    s.synchronize().unwrap();
    assert!(
        host_words
            .iter()
            .enumerate()
            .all(|(i, &w)| w == i as u32 ^ 0x5a5a_5a5a),
        "the round trip through the exact slab changed the data"
    );
    cache.free(block.ptr).unwrap();
    assert!(cache.empty_cache().unwrap() > 0);
    assert_eq!(cache.host().registered_slabs(), 0);
}
