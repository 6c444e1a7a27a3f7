//! GPU tests of the CUDA backend and the cudarc interop. Each is `#[ignore]`d with the reason, so
//! `cargo test` lists it as ignored on a machine without a GPU; `--ignored` runs them (and a
//! machine where no CUDA device works fails them). The `multi_gpu` tests need two GPUs.
//!
//! Kernels are CUDA C compiled at run time with NVRTC. Run the suite single-threaded
//! (`--test-threads=1`): several tests read device-wide free memory. `gpu/run.sh` runs it, and
//! again under `compute-sanitizer --tool memcheck`.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Barrier, OnceLock};

use cuda_caching_allocator::backend::cuda::{CudaDevice, stream_id};
use cuda_caching_allocator::host::{CudaHost, PinnedCache, PinnedConfig};
use cuda_caching_allocator::interop::{AllocatorRegistry, CachedSlice, CudaAllocator, raw};
use cuda_caching_allocator::{
    AllocError, AllocatorConfig, DeviceAddr, DeviceBackend, OomVerdict, StreamId,
};
use cudarc::driver::{
    CudaContext, CudaFunction, DevicePtr as _, LaunchConfig, PushKernelArg, result, sys,
};

use crate::util::under_sanitizer;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

const KERNELS: &str = r#"
__device__ unsigned int mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
__device__ unsigned int pattern(unsigned long long i, unsigned int seed) {
    return mix((unsigned int)i * 0x9E3779B9u + seed) ^ (unsigned int)(i >> 32);
}
extern "C" __global__ void fill_pattern(unsigned int* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = pattern(i, seed);
}
extern "C" __global__ void check_pattern(const unsigned int* p, unsigned long long n,
                                         unsigned int seed, unsigned int* bad) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        if (p[i] != pattern(i, seed)) atomicAdd(bad, 1u);
}
extern "C" __global__ void spin_then_fill(unsigned int* p, unsigned long long n,
                                          unsigned int seed, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = pattern(i, seed);
}
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// The host twin of the kernels' `pattern`.
fn pattern(i: u64, seed: u32) -> u32 {
    let mut x = (i as u32).wrapping_mul(0x9E37_79B9).wrapping_add(seed);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x ^ (i >> 32) as u32
}

struct Gpu {
    ctx: Arc<CudaContext>,
    fill: CudaFunction,
    check: CudaFunction,
    spin_fill: CudaFunction,
    axpy: CudaFunction,
}

/// The shared GPU fixture; fails the test when no CUDA device works.
fn gpu(test: &str) -> &'static Gpu {
    crate::util::require_gpu(test);
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let ctx = CudaContext::new(0).unwrap();
        let module = crate::util::load_module(&ctx, KERNELS);
        Gpu {
            fill: module.load_function("fill_pattern").unwrap(),
            check: module.load_function("check_pattern").unwrap(),
            spin_fill: module.load_function("spin_then_fill").unwrap(),
            axpy: module.load_function("axpy").unwrap(),
            ctx,
        }
    })
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A private allocator with PyTorch's configuration (clean statistics per test).
fn private(g: &Gpu) -> CudaAllocator {
    CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::pytorch()).unwrap()
}

/// An uninitialised cached buffer of `len` plain integers or floats (valid for any bits).
fn uninit<T: cudarc::driver::DeviceRepr>(
    alloc: &CudaAllocator,
    stream: &Arc<cudarc::driver::CudaStream>,
    len: usize,
) -> CachedSlice<T> {
    // SAFETY: the tests use this for `u8`, `u32` and `f64`, valid for every bit pattern, and
    // write before they compare contents.
    unsafe { alloc.alloc::<T>(stream, len) }.unwrap()
}

/// Fills a cached buffer or view (passed as `&mut buf`, the `&mut` kernel-argument path) with
/// the pattern of `seed` on `stream`.
macro_rules! fill {
    ($g:expr, $stream:expr, $buf:expr, $n:expr, $seed:expr) => {{
        let n: usize = $n;
        let n64 = n as u64;
        let seed: u32 = $seed;
        let mut b = $stream.launch_builder(&$g.fill);
        b.arg($buf).arg(&n64).arg(&seed);
        // SAFETY: fill_pattern(unsigned*, u64, u32) writes `n` values of a buffer holding `n`.
        unsafe { b.launch(grid(n)) }.unwrap();
    }};
}

/// Counts the values of a cached buffer or view (passed as `&buf`, the `&` kernel-argument path)
/// that differ from `seed`'s pattern.
macro_rules! bad {
    ($g:expr, $alloc:expr, $stream:expr, $buf:expr, $n:expr, $seed:expr) => {{
        let n: usize = $n;
        let n64 = n as u64;
        let seed: u32 = $seed;
        let mut bad = $alloc.alloc_zeros::<u32>($stream, 1).unwrap();
        let mut b = $stream.launch_builder(&$g.check);
        b.arg($buf).arg(&n64).arg(&seed).arg(&mut bad);
        // SAFETY: check_pattern reads `n` values of a buffer holding `n`, and one counter.
        unsafe { b.launch(grid(n)) }.unwrap();
        $alloc.dtoh(&bad).unwrap()[0]
    }};
}

// ---- interop paths ----------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_htod_dtoh_dtod_memset_roundtrip() {
    let g = gpu("cuda_htod_dtoh_dtod_memset_roundtrip");
    let alloc = private(g);
    let stream = g.ctx.default_stream();
    let host: Vec<u32> = (0..100_003u64).map(|i| pattern(i, 7)).collect();
    let a = alloc.htod(&stream, &host).unwrap();
    assert_eq!(alloc.dtoh(&a).unwrap(), host);
    assert_eq!(a.to_vec().unwrap(), host);
    // dtod between cached buffers, and to and from cudarc's own CudaSlice.
    let mut b = uninit::<u32>(&alloc, &stream, host.len());
    stream.memcpy_dtod(&a, &mut b).unwrap();
    let mut cudarc_slice = stream.alloc_zeros::<u32>(host.len()).unwrap();
    stream.memcpy_dtod(&b, &mut cudarc_slice).unwrap();
    let mut c = alloc.alloc_zeros::<u32>(&stream, host.len()).unwrap();
    stream.memcpy_dtod(&cudarc_slice, &mut c).unwrap();
    assert_eq!(stream.clone_dtoh(&c).unwrap(), host);
    // memcpy_htod into an existing buffer and memset_zeros on it.
    let mut d = alloc.alloc_zeros::<u32>(&stream, 10).unwrap();
    assert_eq!(d.to_vec().unwrap(), vec![0; 10]);
    stream.memcpy_htod(&host[..10], &mut d).unwrap();
    assert_eq!(d.to_vec().unwrap(), &host[..10]);
    stream.memset_zeros(&mut d).unwrap();
    assert_eq!(d.to_vec().unwrap(), vec![0; 10]);
    // memcpy_dtoh into an existing host slice.
    let mut out = vec![0u32; host.len()];
    stream.memcpy_dtoh(&a, &mut out).unwrap();
    assert_eq!(out, host);
    // An empty buffer is the null pointer and copies as empty.
    let e = alloc.htod::<u32>(&stream, &[]).unwrap();
    assert!(e.is_empty() && e.device_ptr_raw().is_null());
    assert!(alloc.dtoh(&e).unwrap().is_empty());
    drop((a, b, c, d, e));
    assert_eq!(alloc.memory_stats().memory_allocated(), 0);
    alloc.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_kernel_args_by_ref_and_mut_and_views() {
    let g = gpu("cuda_kernel_args_by_ref_and_mut_and_views");
    let alloc = private(g);
    let stream = g.ctx.default_stream();
    let n = 1usize << 20;
    // &mut buf and &buf
    let mut buf = uninit::<u32>(&alloc, &stream, n);
    fill!(g, &stream, &mut buf, n, 11);
    assert_eq!(bad!(g, &alloc, &stream, &buf, n, 11), 0);
    assert_eq!(
        bad!(g, &alloc, &stream, &buf, n, 12),
        n as u32,
        "the check kernel must see wrong seeds"
    );
    // Views: a sub-range read through &view, halves written through &mut view.
    let mid = n / 2 + 3;
    {
        let (mut lo, mut hi) = buf.split_at_mut_checked(mid).unwrap();
        fill!(g, &stream, &mut lo, mid, 21);
        fill!(g, &stream, &mut hi, n - mid, 22);
    }
    let lo = buf.get(..mid).unwrap();
    let hi = buf.get(mid..).unwrap();
    assert_eq!(bad!(g, &alloc, &stream, &lo, mid, 21), 0);
    assert_eq!(bad!(g, &alloc, &stream, &hi, n - mid, 22), 0);
    let host = alloc.dtoh(&buf.get(mid - 2..mid + 2).unwrap()).unwrap();
    assert_eq!(
        host,
        [
            pattern(mid as u64 - 2, 21),
            pattern(mid as u64 - 1, 21),
            pattern(0, 22),
            pattern(1, 22)
        ]
    );
    let nested = hi.get(5..9).unwrap();
    assert_eq!(
        nested.to_vec().unwrap(),
        (5..9).map(|i| pattern(i, 22)).collect::<Vec<_>>()
    );
    assert!(buf.get(..n + 1).is_none() && buf.split_at_checked(n + 1).is_none());
    // A mutable view as a copy target, and cudarc's traits on a view.
    let src = alloc.htod(&stream, &[1u32, 2, 3, 4]).unwrap();
    let tail_addr = buf.device_ptr_raw().offset((n - 4) * 4).addr();
    let mut tail = buf.get_mut(n - 4..).unwrap();
    stream.memcpy_dtod(&src, &mut tail).unwrap();
    stream
        .memset_zeros(&mut tail.get_mut(..2).unwrap())
        .unwrap();
    assert_eq!(tail.to_vec().unwrap(), [0, 0, 3, 4]);
    let (p, _sync) = tail.device_ptr(&stream);
    assert_eq!(p, tail_addr);
    // axpy with float buffers: &x and &mut y.
    let x = alloc.htod(&stream, &[1.0f32, 2.0, 3.0]).unwrap();
    let mut y = alloc.htod(&stream, &[10.0f32, 20.0, 30.0]).unwrap();
    let n3 = 3u32;
    let mut b = stream.launch_builder(&g.axpy);
    b.arg(&2.0f32).arg(&x).arg(&mut y).arg(&n3);
    // SAFETY: axpy(float, const float*, float*, unsigned) over 3 values of 3-value buffers.
    unsafe { b.launch(LaunchConfig::for_num_elems(3)) }.unwrap();
    assert_eq!(y.to_vec().unwrap(), [12.0, 24.0, 36.0]);
}

#[cfg(feature = "cublas")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_cublas_gemm_on_cached_buffers() {
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    let g = gpu("cuda_cublas_gemm_on_cached_buffers");
    let alloc = private(g);
    let stream = g.ctx.new_stream().unwrap();
    let (m, k, n) = (96usize, 64usize, 80usize);
    let a_host: Vec<f64> = (0..m * k).map(|i| ((i * 7) % 13) as f64 - 6.0).collect();
    let b_host: Vec<f64> = (0..k * n).map(|i| ((i * 5) % 11) as f64 - 5.0).collect();
    let a = alloc.htod(&stream, &a_host).unwrap();
    let b = alloc.htod(&stream, &b_host).unwrap();
    // C is a view into a larger buffer, to check views through cuBLAS too.
    let mut c_buf = alloc.alloc_zeros::<f64>(&stream, m * n + 100).unwrap();
    let blas = CudaBlas::new(Arc::clone(&stream)).unwrap();
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        alpha: 1.0f64,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0f64,
        ldc: m as i32,
    };
    {
        let mut c = c_buf.get_mut(100..).unwrap();
        // SAFETY: sizes and leading dimensions match the buffers.
        unsafe { blas.gemm(cfg, &a, &b, &mut c) }.unwrap();
    }
    let got = c_buf.get(100..).unwrap().to_vec().unwrap();
    for col in 0..n {
        for row in 0..m {
            let want: f64 = (0..k)
                .map(|p| a_host[row + p * m] * b_host[p + col * k])
                .sum();
            assert_eq!(got[row + col * m], want, "C[{row},{col}]");
        }
    }
    assert_eq!(&c_buf.to_vec().unwrap()[..100], &[0.0; 100][..]);
}

// ---- data integrity ---------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_data_survives_reuse_split_and_merge() {
    let g = gpu("cuda_data_survives_reuse_split_and_merge");
    let alloc = private(g);
    let stream = g.ctx.default_stream();
    // A deterministic mix of small and large sizes (in u32 values).
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut live: Vec<(CachedSlice<u32>, u32)> = Vec::new();
    let mut seed = 0u32;
    let mut allocs = 0i64;
    for round in 0..600 {
        let r = next();
        if !live.is_empty() && r % 3 == 0 {
            let i = (r >> 8) as usize % live.len();
            let (buf, s) = live.swap_remove(i);
            assert_eq!(
                bad!(g, &alloc, &stream, &buf, buf.len(), s),
                0,
                "round {round}"
            );
        } else {
            let len = match r % 4 {
                0 => 1 + (r >> 8) as usize % 1000,         // < 4 KiB: small pool
                1 => 1 + (r >> 8) as usize % (256 * 1024), // up to 1 MiB: small pool
                2 => (1 << 18) + (r >> 8) as usize % (1 << 21), // 1-9 MiB: 20 MiB segments
                _ => (3 << 20) + (r >> 8) as usize % (1 << 22), // 12-28 MiB: large
            };
            let mut buf = uninit::<u32>(&alloc, &stream, len);
            seed = seed.wrapping_add(1);
            allocs += 1;
            fill!(g, &stream, &mut buf, len, seed);
            live.push((buf, seed));
        }
    }
    for (buf, s) in &live {
        assert_eq!(bad!(g, &alloc, &stream, buf, buf.len(), *s), 0);
    }
    let stats = alloc.memory_stats();
    println!(
        "integrity: {allocs} allocations served by {} device allocations",
        stats.num_device_alloc
    );
    assert!(
        stats.num_device_alloc < allocs,
        "the cache should reuse blocks"
    );
    drop(live);
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.memory_stats().memory_allocated(), 0);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.memory_stats().memory_reserved(), 0);

    // Split and merge inside one 20 MiB segment: three 4 MiB blocks sit back to back; freeing
    // them merges the segment again, and a 12 MiB request reuses its start.
    let n4 = MIB; // 4 MiB of u32
    let mut parts: Vec<CachedSlice<u32>> =
        (0..3).map(|_| uninit::<u32>(&alloc, &stream, n4)).collect();
    let base = parts[0].device_ptr_raw();
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(
            p.device_ptr_raw(),
            base.offset(i * 4 * MIB),
            "blocks are split from one segment"
        );
    }
    for (i, p) in parts.iter_mut().enumerate() {
        fill!(g, &stream, p, n4, 100 + i as u32);
    }
    let middle = parts.remove(1);
    drop(middle);
    let mut again = uninit::<u32>(&alloc, &stream, n4);
    assert_eq!(
        again.device_ptr_raw(),
        base.offset(4 * MIB),
        "the freed middle block is reused"
    );
    fill!(g, &stream, &mut again, n4, 200);
    assert_eq!(bad!(g, &alloc, &stream, &parts[0], n4, 100), 0);
    assert_eq!(bad!(g, &alloc, &stream, &parts[1], n4, 102), 0);
    assert_eq!(bad!(g, &alloc, &stream, &again, n4, 200), 0);
    drop((parts, again));
    let mut merged = uninit::<u32>(&alloc, &stream, 3 * n4);
    assert_eq!(
        merged.device_ptr_raw(),
        base,
        "the segment merged back into one block"
    );
    fill!(g, &stream, &mut merged, 3 * n4, 300);
    assert_eq!(bad!(g, &alloc, &stream, &merged, 3 * n4, 300), 0);
    drop(merged);
    alloc.check_invariants().unwrap();
    assert_eq!(
        g.ctx
            .default_stream()
            .synchronize()
            .map_err(|e| e.to_string()),
        Ok(())
    );
    assert_eq!(
        alloc.device().live_event_count(),
        0,
        "plain allocation creates no CUDA events"
    );
}

// ---- streams ----------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_record_stream_holds_the_block_until_the_other_stream_is_done() {
    let g = gpu("cuda_record_stream_holds_the_block_until_the_other_stream_is_done");
    let alloc = private(g);
    let a = g.ctx.new_stream().unwrap();
    let b = g.ctx.new_stream().unwrap();
    let n = 5 * MIB; // 20 MiB of u32: exactly one segment, no remainder to split off
    let seed_b = 0xB;
    let seed_a = 0xA;

    // Control: without another stream's use, a freed block comes straight back.
    let first = uninit::<u32>(&alloc, &a, n);
    let p1 = first.device_ptr_raw();
    drop(first);
    let second = uninit::<u32>(&alloc, &a, n);
    assert_eq!(second.device_ptr_raw(), p1, "control: same-stream reuse");

    // A long kernel on stream B writes the buffer; the buffer is recorded on B and dropped.
    let mut buf = second;
    let cycles: i64 = 1_500_000_000; // about 0.75 s at 2 GHz
    let n64 = n as u64;
    let mut launch = b.launch_builder(&g.spin_fill);
    launch.arg(&mut buf).arg(&n64).arg(&seed_b).arg(&cycles);
    // SAFETY: spin_then_fill(unsigned*, u64, u32, i64) writes `n` values of an `n`-value buffer.
    unsafe { launch.launch(grid(n)) }.unwrap();
    let done_b = b.record_event(None).unwrap();
    buf.record_stream(&b).unwrap();
    drop(buf);
    let events_before = alloc.device().live_event_count();

    // While B runs, the same request on A must get other memory.
    let mut other = uninit::<u32>(&alloc, &a, n);
    let serialized = done_b.is_complete();
    if serialized {
        // Only possible where launches block (compute-sanitizer serializes them): then reuse is
        // allowed and only the data check below means something.
        assert!(
            under_sanitizer(),
            "the kernel on B finished too early: the test needs a slower kernel"
        );
        println!(
            "record_stream: kernel finished before the check (serialized launches); reuse check skipped"
        );
    } else {
        assert_ne!(
            other.device_ptr_raw(),
            p1,
            "the block was reused while stream B still wrote it"
        );
    }
    fill!(g, &a, &mut other, n, seed_a);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    // B's late write went to the old block only; A's buffer is intact.
    assert_eq!(bad!(g, &alloc, &a, &other, n, seed_a), 0);
    assert!(
        events_before >= 1,
        "record_stream made the cache record an event"
    );

    if serialized {
        return;
    }
    // Once B is done, the block is reusable on A again.
    let back = uninit::<u32>(&alloc, &a, n);
    assert_eq!(
        back.device_ptr_raw(),
        p1,
        "the block returns once B finished"
    );
    assert_eq!(
        bad!(g, &alloc, &a, &back, n, seed_b),
        0,
        "B's kernel completed its writes into the old block"
    );
    drop((back, other));
    alloc.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_cross_stream_reuse_orders_the_new_stream_after_the_old() {
    let g = gpu("cuda_cross_stream_reuse_orders_the_new_stream_after_the_old");
    let config = AllocatorConfig::builder()
        .cross_stream_reuse(true)
        .build()
        .unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), config).unwrap();
    let t = g.ctx.new_stream().unwrap();
    let s = g.ctx.new_stream().unwrap();
    let n = 5 * MIB; // 20 MiB of u32: exactly one segment, no remainder to split off
    let seed_t = 0x7;
    let seed_s = 0x5;

    // A long kernel on T writes the buffer; the buffer is freed on T while it runs (PyTorch's
    // rule: reusable on T at once, its work being ordered there).
    let mut buf = uninit::<u32>(&alloc, &t, n);
    let p = buf.device_ptr_raw();
    let cycles: i64 = 1_500_000_000; // about 0.75 s at 2 GHz
    let n64 = n as u64;
    let mut launch = t.launch_builder(&g.spin_fill);
    launch.arg(&mut buf).arg(&n64).arg(&seed_t).arg(&cycles);
    // SAFETY: spin_then_fill(unsigned*, u64, u32, i64) writes `n` values of an `n`-value buffer.
    unsafe { launch.launch(grid(n)) }.unwrap();
    let done_t = t.record_event(None).unwrap();
    drop(buf);
    let segments = alloc.memory_stats().num_device_alloc;

    // S has no cached block: with the option on it gets T's wholly free segment, without a new
    // segment and without the host waiting for T.
    let mut mine = uninit::<u32>(&alloc, &s, n);
    let running = !done_t.is_complete();
    assert_eq!(mine.device_ptr_raw(), p, "T's segment was handed over");
    assert_eq!(alloc.cross_stream_handovers(), 1);
    assert_eq!(
        alloc.memory_stats().num_device_alloc,
        segments,
        "no new segment"
    );
    if !running {
        // Only possible where launches block (compute-sanitizer serializes them).
        assert!(
            under_sanitizer(),
            "T's kernel finished before the handover: the host waited, or the kernel is too short"
        );
    }

    // S writes its own pattern. The handover made S wait on an event recorded on T after the
    // kernel, so S's write lands after T's late write, never under it.
    fill!(g, &s, &mut mine, n, seed_s);
    s.synchronize().unwrap();
    assert!(
        done_t.is_complete(),
        "S's work finished, so T's kernel before the handover's event did too"
    );
    assert_eq!(
        bad!(g, &alloc, &s, &mine, n, seed_s),
        0,
        "S reads its own pattern: T's kernel did not write over it"
    );
    t.synchronize().unwrap();
    assert_eq!(bad!(g, &alloc, &s, &mine, n, seed_s), 0);
    drop(mine);
    assert_eq!(
        alloc.memory_stats().num_device_alloc,
        segments + 1,
        "one small segment for the checks"
    );
    alloc.check_invariants().unwrap();
}

/// Lent pages on the real driver (Note [Lent pages]): a block of stream T is freed while a long
/// kernel on T will still write it; a growth for stream S takes its pages while that kernel runs
/// (mapped a second time, S waiting on an event of T's), S writes its own pattern through the new
/// mapping, and must read it back: without the event wait, T's late write through the old mapping
/// would land over it (the same physical bytes). Then the old mapping goes and the cache empties.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_lent_pages_order_the_new_stream_after_the_old() {
    let g = gpu("cuda_lent_pages_order_the_new_stream_after_the_old");
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    let t = g.ctx.new_stream().unwrap();
    let s = g.ctx.new_stream().unwrap();
    let n = 5 * MIB; // 20 MiB of u32: ten 2 MiB pages
    let (seed_t, seed_s) = (0x17, 0x25);
    let mut buf = uninit::<u32>(&alloc, &t, n);
    let cycles: i64 = 1_500_000_000; // about 0.75 s at 2 GHz
    let n64 = n as u64;
    let mut launch = t.launch_builder(&g.spin_fill);
    launch.arg(&mut buf).arg(&n64).arg(&seed_t).arg(&cycles);
    // SAFETY: spin_then_fill(unsigned*, u64, u32, i64) writes `n` values of an `n`-value buffer.
    unsafe { launch.launch(grid(n)) }.unwrap();
    let done_t = t.record_event(None).unwrap();
    drop(buf);
    alloc.flush_thread_caches();
    let reserved = alloc.memory_stats().memory_reserved();

    // No free block of S, and the 1 % slack does not cover 20 MiB: the growth lends T's pages.
    let mut mine = uninit::<u32>(&alloc, &s, n);
    let running = !done_t.is_complete();
    assert!(alloc.page_loans() >= 1, "T's pending pages were lent");
    assert_eq!(
        alloc.memory_stats().memory_reserved(),
        reserved,
        "no new memory for S"
    );
    if !running {
        assert!(
            under_sanitizer(),
            "T's kernel finished before the loan: the host waited, or the kernel is too short"
        );
    }
    fill!(g, &s, &mut mine, n, seed_s);
    s.synchronize().unwrap();
    assert!(
        done_t.is_complete(),
        "S's work finished, so T's kernel before the loan's event did too"
    );
    assert_eq!(
        bad!(g, &alloc, &s, &mine, n, seed_s),
        0,
        "S reads its own pattern: T's late write did not land over it"
    );
    t.synchronize().unwrap();
    assert_eq!(bad!(g, &alloc, &s, &mine, n, seed_s), 0);
    drop(mine);
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.memory_stats().memory_reserved(), 0);
}

/// Unmaps off the allocating thread (`cca_unmap_helper`, on in the default): stream 0's idle
/// pages move to stream 1's growth mapped first, their old mapping left to the device's helper
/// thread; stream 1 writes and reads its pattern through the new mapping while the helper
/// unmaps the old one, stream 0's next growth and its data are right too, and `empty_cache`
/// (which waits for the helper) returns every byte. Without the key nothing is handed off.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_moved_pages_are_unmapped_by_the_helper_and_keep_their_data() {
    let g = gpu("cuda_moved_pages_are_unmapped_by_the_helper_and_keep_their_data");
    for (config, helper) in [
        ("cca_preset:default", true),
        ("cca_preset:default,cca_unmap_helper:False", false),
    ] {
        let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::parse(config).unwrap())
            .unwrap();
        let s0 = g.ctx.new_stream().unwrap();
        let s1 = g.ctx.new_stream().unwrap();
        let n = 5 * MIB; // 20 MiB of u32: ten 2 MiB pages
        let mut a = uninit::<u32>(&alloc, &s0, n);
        fill!(g, &s0, &mut a, n, 0x31);
        assert_eq!(bad!(g, &alloc, &s0, &a, n, 0x31), 0);
        s0.synchronize().unwrap();
        drop(a);
        alloc.flush_thread_caches();
        let reserved = alloc.memory_stats().memory_reserved();
        let t0 = alloc.device_call_times();
        // No free block of stream 1, and the 1 % slack does not cover 20 MiB: the growth moves
        // stream 0's idle pages.
        let mut b = uninit::<u32>(&alloc, &s1, n);
        let grown = alloc.device_call_times().since(&t0);
        assert_eq!(
            alloc.memory_stats().memory_reserved(),
            reserved,
            "{config}: pages moved, none made"
        );
        if helper {
            assert!(
                alloc.unmaps_handed_off() >= 1,
                "{config}: nothing handed to the helper"
            );
        } else {
            assert_eq!(alloc.unmaps_handed_off(), 0, "{config}");
            assert!(
                grown.get("unmap").unwrap().0 >= 1,
                "{config}: the growth unmapped: {grown:?}"
            );
        }
        fill!(g, &s1, &mut b, n, 0x47);
        assert_eq!(
            bad!(g, &alloc, &s1, &b, n, 0x47),
            0,
            "{config}: stream 1 reads its pattern"
        );
        // Stream 0 grows again: its old range comes back once the helper is done with it.
        let mut c = uninit::<u32>(&alloc, &s0, n);
        fill!(g, &s0, &mut c, n, 0x59);
        assert_eq!(
            bad!(g, &alloc, &s0, &c, n, 0x59),
            0,
            "{config}: stream 0's new block"
        );
        assert_eq!(
            bad!(g, &alloc, &s1, &b, n, 0x47),
            0,
            "{config}: stream 1's block kept"
        );
        s0.synchronize().unwrap();
        s1.synchronize().unwrap();
        drop(b);
        drop(c);
        alloc.check_invariants().unwrap();
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.memory_stats().memory_reserved(), 0, "{config}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_blocks_belong_to_their_stream() {
    let g = gpu("cuda_blocks_belong_to_their_stream");
    let alloc = private(g);
    let s1 = g.ctx.new_stream().unwrap();
    let s2 = g.ctx.new_stream().unwrap();
    let s3 = g.ctx.default_stream();
    let x = uninit::<u8>(&alloc, &s1, 3 * MIB);
    let p = x.device_ptr_raw();
    assert_eq!(x.stream_id(), stream_id(&s1));
    drop(x);
    let y = uninit::<u8>(&alloc, &s2, 3 * MIB);
    assert_ne!(
        y.device_ptr_raw(),
        p,
        "a block freed on s1 is not reused on s2"
    );
    let z = uninit::<u8>(&alloc, &s3, 3 * MIB);
    assert_ne!(z.device_ptr_raw(), p, "nor on the default stream");
    let w = uninit::<u8>(&alloc, &s1, 3 * MIB);
    assert_eq!(w.device_ptr_raw(), p, "but it is reused on s1");
    drop((y, z, w));
    assert_eq!(alloc.memory_stats().num_device_alloc, 3);
    alloc.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_many_streams_in_parallel_keep_their_data() {
    let g = gpu("cuda_many_streams_in_parallel_keep_their_data");
    let alloc = private(g);
    let streams: Vec<_> = (0..6).map(|_| g.ctx.new_stream().unwrap()).collect();
    let mut bufs = Vec::new();
    for round in 0..20u32 {
        for (i, s) in streams.iter().enumerate() {
            let len = (i + 1) * 50_000 + round as usize * 1000;
            let mut buf = uninit::<u32>(&alloc, s, len);
            fill!(g, s, &mut buf, len, round * 16 + i as u32);
            bufs.push((buf, round * 16 + i as u32));
        }
        // Free every other buffer while the kernels may still run: same-stream reuse is ordered.
        if round % 2 == 1 {
            bufs.retain(|(_, seed)| seed % 2 == 0);
        }
    }
    for (buf, seed) in &bufs {
        assert_eq!(
            bad!(g, &alloc, buf.alloc_stream(), buf, buf.len(), *seed),
            0
        );
    }
    drop(bufs);
    alloc.check_invariants().unwrap();
}

// ---- threads ----------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_eight_threads_share_one_device() {
    let g = gpu("cuda_eight_threads_share_one_device");
    let alloc = private(g);
    let threads = 12;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let alloc = alloc.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let stream = g.ctx.new_stream().unwrap();
                barrier.wait();
                let mut held: Vec<(CachedSlice<u32>, u32)> = Vec::new();
                let mut bad = 0;
                for i in 0..150u32 {
                    let len = 1 + ((i as usize * 7919 + t * 104_729) % 600_000);
                    let seed = (t as u32) << 16 | i;
                    let mut buf = uninit::<u32>(&alloc, &stream, len);
                    fill!(g, &stream, &mut buf, len, seed);
                    held.push((buf, seed));
                    if held.len() > 6 {
                        let (old, s) = held.remove((i as usize) % held.len());
                        bad += bad!(g, &alloc, &stream, &old, old.len(), s);
                    }
                }
                for (buf, s) in &held {
                    bad += bad!(g, &alloc, &stream, buf, buf.len(), *s);
                }
                bad
            })
        })
        .collect();
    let bad: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(bad, 0);
    alloc.check_invariants().unwrap();
    let stats = alloc.memory_stats();
    assert_eq!(stats.memory_allocated(), 0);
    assert!(stats.memory_reserved() > 0);
}

// ---- OOM, fraction cap, empty_cache -----------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_fraction_cap_oom_is_clear_and_recoverable() {
    let g = gpu("cuda_fraction_cap_oom_is_clear_and_recoverable");
    let alloc = private(g);
    let stream = g.ctx.default_stream();
    let total = alloc.device().mem_info().unwrap().total;
    alloc
        .set_memory_fraction(GIB as f64 / total as f64)
        .unwrap();
    let a = uninit::<u8>(&alloc, &stream, 600 * MIB);
    let err = alloc.alloc_zeros::<u8>(&stream, 600 * MIB).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let report = err.oom_report().expect("an OOM report");
    assert_eq!(report.verdict, OomVerdict::FractionCapReached, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("CUDA out of memory") && msg.contains("Tried to allocate"),
        "{msg}"
    );
    println!("fraction-cap OOM message: {msg}");
    drop(a);
    let b = uninit::<u8>(&alloc, &stream, 600 * MIB);
    drop(b);
    assert_eq!(alloc.memory_stats().num_ooms, 1);

    // More than the device has.
    alloc.set_memory_fraction(1.0).unwrap();
    let err = alloc.alloc_zeros::<u8>(&stream, total + GIB).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(
        err.oom_report().map(|r| r.verdict),
        Some(OomVerdict::LargerThanDevice),
        "{err}"
    );
    let c = alloc.alloc_zeros::<u8>(&stream, 8 * MIB).unwrap();
    assert_eq!(
        c.to_vec()
            .unwrap()
            .iter()
            .map(|&x| x as usize)
            .sum::<usize>(),
        0
    );
    drop(c);
    alloc.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_empty_cache_returns_memory_to_the_device() {
    let g = gpu("cuda_empty_cache_returns_memory_to_the_device");
    let alloc = private(g);
    let stream = g.ctx.default_stream();
    let before = alloc.device().mem_info().unwrap().free;
    let bufs: Vec<_> = (0..4)
        .map(|_| uninit::<u8>(&alloc, &stream, 512 * MIB))
        .collect();
    let during = alloc.device().mem_info().unwrap().free;
    assert!(
        before - during >= 2 * GIB,
        "free fell by {} MiB",
        (before - during) / MIB
    );
    drop(bufs);
    let cached = alloc.device().mem_info().unwrap().free;
    assert!(cached < before - GIB, "freeing keeps the memory cached");
    assert!(alloc.memory_stats().memory_reserved() >= 2 * GIB as i64);
    alloc.empty_cache().unwrap();
    let after = alloc.device().mem_info().unwrap().free;
    assert!(
        after >= cached + 2 * GIB - 64 * MIB,
        "free rose by {} MiB only",
        (after - cached) / MIB
    );
    assert_eq!(alloc.memory_stats().memory_reserved(), 0);
    println!(
        "empty_cache: free {} -> {} -> {} MiB",
        before / MIB,
        cached / MIB,
        after / MIB
    );
}

// ---- registry and raw API ---------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_registry_gives_one_allocator_per_device_and_raw_api_works() {
    let g = gpu("cuda_registry_gives_one_allocator_per_device_and_raw_api_works");
    let registry = AllocatorRegistry::global();
    let a = registry.get(0).unwrap();
    let b = CudaAllocator::shared(0).unwrap();
    assert!(CudaAllocator::ptr_eq(a, b));
    let count = CudaContext::device_count().unwrap() as usize;
    assert!(registry.get(count).is_err());
    let stream = g.ctx.new_stream().unwrap();
    let sid = StreamId(stream.cu_stream().addr() as u64);
    // SAFETY: `stream` is a live stream of device 0 and outlives its use here (it is kept alive
    // by the test until the end, after the free).
    let raw_alloc = unsafe { raw::alloc(0, 3000, sid) }.unwrap();
    assert!(!raw_alloc.ptr.is_null() && raw_alloc.block_size >= 3000);
    let stats = raw::memory_stats(0).unwrap();
    assert!(stats.memory_allocated() >= 3000);
    assert!(registry.memory_stats().iter().any(|(d, _)| *d == 0));
    // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
    unsafe { raw::free(0, raw_alloc.ptr) }.unwrap();
    assert!(matches!(
        // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
        unsafe { raw::free(0, raw_alloc.ptr) },
        Err(AllocError::DoubleFree { .. })
    ));
    // SAFETY: a bogus pointer the cache never handed out: refused without touching memory.
    assert!(unsafe { raw::free(0, DeviceAddr(0x1000)) }.is_err());
    raw::empty_cache(0).unwrap();
    // Another context object of the same device shares its primary context: admitted.
    let other = CudaContext::new(0).unwrap().new_stream().unwrap();
    assert!(a.admit(&other).is_ok(), "same device, same primary context");
}

// ---- backend: virtual memory ------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_backend_virtual_memory_reserve_map_write_read_unmap() {
    let g = gpu("cuda_backend_virtual_memory_reserve_map_write_read_unmap");
    let dev = CudaDevice::new(Arc::clone(&g.ctx)).unwrap();
    let Some(gran) = dev.vm_granularity() else {
        panic!("this GPU reports no virtual memory management support");
    };
    let va = dev.reserve_address_range(8 * gran).unwrap();
    let h1 = dev.create_physical(2 * gran).unwrap();
    let h2 = dev.create_physical(gran).unwrap();
    // SAFETY: both ranges lie inside the fresh reservation, do not overlap, and the handles are
    // live and of exactly these sizes.
    unsafe {
        dev.map(va.offset(gran), 2 * gran, h1).unwrap();
        dev.map(va.offset(3 * gran), gran, h2).unwrap();
    }
    // Write both mappings (contiguous: [gran, 4 gran)) with one kernel, read them back.
    let stream = g.ctx.default_stream();
    let n = 3 * gran / 4;
    let ptr = va.offset(gran).addr();
    let n64 = n as u64;
    let seed = 77u32;
    let mut launch = stream.launch_builder(&g.fill);
    launch.arg(&ptr).arg(&n64).arg(&seed);
    // SAFETY: the kernel writes `n` u32 = 3 granules, exactly the two mapped, accessible ranges.
    unsafe { launch.launch(grid(n)) }.unwrap();
    stream.synchronize().unwrap();
    let mut host = vec![0u32; n];
    g.ctx.bind_to_thread().unwrap();
    // SAFETY: the source range is mapped and readable; `host` holds `n` values.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, ptr) }.unwrap();
    assert!(
        host.iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, seed))
    );
    // SAFETY: each range is exactly one mapping made above, and the stream was synchronized.
    unsafe {
        dev.unmap(va.offset(gran), 2 * gran).unwrap();
        dev.unmap(va.offset(3 * gran), gran).unwrap();
        dev.release_physical(h1, 2 * gran).unwrap();
        dev.release_physical(h2, gran).unwrap();
        dev.release_address_range(va, 8 * gran).unwrap();
    }
    assert!(
        dev.reserve_address_range(gran + 1).is_err(),
        "sizes must be granule multiples"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_backend_events_and_streams() {
    let g = gpu("cuda_backend_events_and_streams");
    let dev = CudaDevice::new(Arc::clone(&g.ctx)).unwrap();
    let s = g.ctx.new_stream().unwrap();
    let sid = stream_id(&s);
    assert!(
        dev.validate_stream(sid).is_err(),
        "unknown streams are refused"
    );
    assert_eq!(dev.admit_stream(&s).unwrap(), sid);
    dev.validate_stream(sid).unwrap();
    dev.validate_stream(StreamId::DEFAULT).unwrap();
    let ev = dev.create_event().unwrap();
    // A long kernel, then the event: not ready, then ready after synchronize_event.
    let mut buf = uninit::<u32>(&private(g), &s, 1024);
    let (n64, seed, cycles) = (1024u64, 1u32, 400_000_000i64);
    let mut launch = s.launch_builder(&g.spin_fill);
    launch.arg(&mut buf).arg(&n64).arg(&seed).arg(&cycles);
    // SAFETY: writes 1024 values of a 1024-value buffer.
    unsafe { launch.launch(grid(1024)) }.unwrap();
    dev.record_event(ev, sid).unwrap();
    assert!(
        !dev.query_event(ev).unwrap(),
        "the event waits for the kernel"
    );
    let other = g.ctx.new_stream().unwrap();
    let oid = dev.admit_stream(&other).unwrap();
    dev.stream_wait_event(oid, ev).unwrap();
    dev.synchronize_event(ev).unwrap();
    assert!(dev.query_event(ev).unwrap());
    dev.synchronize_stream(oid).unwrap();
    dev.synchronize().unwrap();
    // SAFETY: created above and not destroyed.
    unsafe { dev.destroy_event(ev) }.unwrap();
    // SAFETY: a second destroy is refused by the handle check, not passed to the driver.
    assert!(unsafe { dev.destroy_event(ev) }.is_err());
    assert!(dev.query_event(ev).is_err());
    assert!(
        dev.record_event(dev.create_event().unwrap(), StreamId(0xdead_beef))
            .is_err()
    );
    // Raw segments.
    let p = dev.allocate(MIB, sid).unwrap();
    assert_eq!(p.addr() % dev.alignment() as u64, 0);
    // SAFETY: from allocate above; nothing uses it.
    unsafe { dev.free(p, MIB, sid) }.unwrap();
    let info = dev.mem_info().unwrap();
    assert!(
        dev.allocate(info.total + GIB, sid)
            .unwrap_err()
            .is_out_of_memory()
    );
    assert!(info.free <= info.total && info.total > GIB);
}

// ---- segment events ---------------------------------------------------------------------------

/// Whether a physical allocation is mapped at `addr` (the driver hands out its handle).
fn mapped_at(addr: u64) -> bool {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer; the address is only looked up.
    let r = unsafe {
        sys::cuMemRetainAllocationHandle(
            &mut handle,
            std::ptr::with_exposed_provenance_mut(addr as usize),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return false;
    }
    // SAFETY: the handle was retained just above; releasing drops only that reference.
    unsafe { sys::cuMemRelease(handle) };
    true
}

/// The driver's allocation range holding `addr`, when there is one.
fn address_range(addr: u64) -> Option<(u64, usize)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: both out-pointers are valid; the address is only looked up.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some((base, size))
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_segment_events_agree_with_the_driver_when_told() {
    use cuda_caching_allocator::{SegmentAction, SegmentEvent};
    use std::sync::Mutex;
    let g = gpu("cuda_segment_events_agree_with_the_driver_when_told");
    for (name, config) in [
        ("pytorch", AllocatorConfig::pytorch()),
        ("default", AllocatorConfig::default()),
    ] {
        let alloc = CudaAllocator::new(Arc::clone(&g.ctx), config).unwrap();
        let seen: Arc<Mutex<(Vec<SegmentEvent>, Vec<String>)>> = Arc::default();
        let s = Arc::clone(&seen);
        alloc.set_segment_observer(Some(Arc::new(move |e: &SegmentEvent| {
            // Told under the cache's lock, on the allocating thread, with its context current.
            let ok = match e.action {
                SegmentAction::Alloc | SegmentAction::Free => {
                    address_range(e.addr.0) == Some((e.addr.0, e.size))
                }
                SegmentAction::Map => {
                    mapped_at(e.addr.0) && mapped_at(e.addr.0 + e.size as u64 - 1)
                }
                SegmentAction::Unmap => !mapped_at(e.addr.0),
                _ => false,
            };
            let mut s = s.lock().unwrap();
            if !ok {
                s.1.push(format!("{e:?}: the driver disagrees"));
            }
            s.0.push(*e);
        })));
        let s1 = g.ctx.new_stream().unwrap();
        let (d0, d1) = (StreamId::DEFAULT, alloc.admit(&s1).unwrap());
        let mut live = Vec::new();
        for (i, mb) in [1usize, 7, 30, 90, 3, 64, 12].iter().enumerate() {
            let stream = if i % 2 == 0 { d0 } else { d1 };
            live.push(alloc.allocate(mb * MIB + 4096 * i, stream).unwrap());
            if i % 3 == 2 {
                // SAFETY: from `allocate` on this cache, owned by no buffer, never used by work.
                unsafe { alloc.free(live.remove(0).ptr) }.unwrap();
            }
        }
        for a in live.drain(..) {
            // SAFETY: as above.
            unsafe { alloc.free(a.ptr) }.unwrap();
        }
        s1.synchronize().unwrap();
        alloc.empty_cache().unwrap();
        let (events, errors) = std::mem::take(&mut *seen.lock().unwrap());
        assert!(errors.is_empty(), "{name}: {errors:?}");
        let kinds: Vec<SegmentAction> = events.iter().map(|e| e.action).collect();
        if name == "pytorch" {
            assert!(kinds.contains(&SegmentAction::Alloc) && kinds.contains(&SegmentAction::Free));
        } else {
            assert!(kinds.contains(&SegmentAction::Map) && kinds.contains(&SegmentAction::Unmap));
        }
        assert_eq!(alloc.memory_stats().memory_reserved(), 0, "{name}");
    }
}

// ---- expandable segments (issue #5) -------------------------------------------------------------

/// Growth page by page keeps every earlier buffer's data, and `empty_cache` unmaps and releases the
/// pages (device free memory rises), under PyTorch's expandable preset and the crate default.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_expandable_growth_keeps_data_and_empty_cache_returns_pages() {
    let g = gpu("cuda_expandable_growth_keeps_data_and_empty_cache_returns_pages");
    for (name, config) in [
        (
            "pytorch-expandable",
            cuda_caching_allocator::Preset::PytorchExpandable.config(),
        ),
        ("default", AllocatorConfig::default()),
    ] {
        let alloc = CudaAllocator::new(Arc::clone(&g.ctx), config).unwrap();
        assert!(
            alloc.device().vm_granularity().is_some(),
            "the device supports virtual memory"
        );
        let stream = g.ctx.default_stream();
        let before = alloc.device().mem_info().unwrap().free;
        // Growing sizes, as a batch that grows step by step: 3, 5, 7, ... MiB (u32 values), plus
        // small buffers in between.
        let mut live: Vec<(CachedSlice<u32>, u32)> = Vec::new();
        for i in 0..40u32 {
            let len = ((3 + 2 * i as usize) * MIB) / 4;
            let mut buf = uninit::<u32>(&alloc, &stream, len);
            fill!(g, &stream, &mut buf, len, 1000 + i);
            live.push((buf, 1000 + i));
            let mut small = uninit::<u32>(&alloc, &stream, 100 + i as usize * 37);
            let n = small.len();
            fill!(g, &stream, &mut small, n, 5000 + i);
            live.push((small, 5000 + i));
            if i % 3 == 2 {
                // Free an older buffer so later growth reuses and remaps its pages.
                let (old, s) = live.remove(0);
                assert_eq!(
                    bad!(g, &alloc, &stream, &old, old.len(), s),
                    0,
                    "{name}: step {i}"
                );
            }
        }
        for (buf, s) in &live {
            assert_eq!(
                bad!(g, &alloc, &stream, buf, buf.len(), *s),
                0,
                "{name}: after growth"
            );
        }
        alloc.check_invariants().unwrap();
        let st = alloc.memory_stats();
        let reserved = st.memory_reserved() as usize;
        println!(
            "expandable {name}: peak reserved {} MiB, peak allocated {} MiB, {} maps, {} unmaps",
            st.max_memory_reserved() / MIB as i64,
            st.max_memory_allocated() / MIB as i64,
            st.num_device_alloc,
            st.num_device_free
        );
        drop(live);
        let cached = alloc.device().mem_info().unwrap().free;
        alloc.empty_cache().unwrap();
        let after = alloc.device().mem_info().unwrap().free;
        assert_eq!(
            alloc.memory_stats().memory_reserved(),
            0,
            "{name}: every page released"
        );
        assert!(
            after + 64 * MIB >= cached + reserved,
            "{name}: free rose by {} MiB of {} MiB reserved",
            (after.saturating_sub(cached)) / MIB,
            reserved / MIB
        );
        assert!(
            after + 64 * MIB >= before,
            "{name}: memory back to where it started"
        );
        alloc.check_invariants().unwrap();
    }
}

/// The driver calls the cache makes are counted and timed by kind: a growth of the default
/// (2 MiB pages) shows as creates, maps and access settings matching PyTorch's `num_device_alloc`
/// count of mapped ranges and the pages mapped, each with host time; cached reuse adds none; and
/// `empty_cache` shows as unmaps and releases.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_device_call_times_count_and_time_every_driver_call() {
    let g = gpu("cuda_device_call_times_count_and_time_every_driver_call");
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    let stream = g.ctx.default_stream();
    let t0 = alloc.device_call_times();
    let a = uninit::<u8>(&alloc, &stream, 40 * MIB);
    let b = uninit::<u8>(&alloc, &stream, 3 * MIB);
    let grown = alloc.device_call_times().since(&t0);
    let pages = alloc.memory_stats().memory_reserved() as u64 / (2 * MIB as u64);
    let (creates, create_ns) = grown.get("create").unwrap();
    let (maps, map_ns) = grown.get("map").unwrap();
    let (access, access_ns) = grown.get("set_access").unwrap();
    println!(
        "growth to {pages} pages: create {creates} ({create_ns} ns), map {maps} ({map_ns} ns), \
         set_access {access} ({access_ns} ns), all {:?}",
        grown.total()
    );
    assert!(
        pages >= 22,
        "40 + 3 MiB need at least 22 pages of 2 MiB, got {pages}"
    );
    assert_eq!(creates, pages, "one create per 2 MiB page");
    assert_eq!(maps, pages, "one map per page");
    assert_eq!(access, pages, "access set once per mapped page");
    assert!(create_ns > 0 && map_ns > 0 && access_ns > 0);
    assert!(grown.total().1 >= create_ns + map_ns + access_ns);
    drop(a);
    drop(b);
    let before_reuse = alloc.device_call_times();
    let again = uninit::<u8>(&alloc, &stream, 40 * MIB);
    let reused = alloc.device_call_times().since(&before_reuse);
    assert_eq!(
        reused.get("create").unwrap().0 + reused.get("map").unwrap().0,
        0,
        "a cached block makes no driver call: {reused:?}"
    );
    drop(again);
    stream.synchronize().unwrap();
    let before_empty = alloc.device_call_times();
    alloc.empty_cache().unwrap();
    let emptied = alloc.device_call_times().since(&before_empty);
    assert_eq!(
        emptied.get("unmap").unwrap().0,
        pages,
        "every page unmapped"
    );
    assert_eq!(
        emptied.get("release").unwrap().0,
        pages,
        "every page released"
    );
    assert!(emptied.get("unmap").unwrap().1 > 0);
    let via_registry = raw::device_call_times(usize::MAX);
    assert!(
        via_registry.is_none(),
        "no cache for a device that does not exist"
    );
}

/// The out-of-memory path with expandable segments on a real device: a fraction cap stops growth
/// with a clear error, the allocator stays usable, and an absurd request is refused cleanly.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_expandable_oom_path_is_clear_and_recoverable() {
    let g = gpu("cuda_expandable_oom_path_is_clear_and_recoverable");
    for config in [
        cuda_caching_allocator::Preset::PytorchExpandable.config(),
        AllocatorConfig::default(),
    ] {
        let alloc = CudaAllocator::new(Arc::clone(&g.ctx), config).unwrap();
        let stream = g.ctx.default_stream();
        let total = alloc.device().mem_info().unwrap().total;
        alloc
            .set_memory_fraction(GIB as f64 / total as f64)
            .unwrap();
        let mut a = uninit::<u32>(&alloc, &stream, 600 * MIB / 4);
        fill!(g, &stream, &mut a, a.len(), 7);
        let err = match alloc.alloc_zeros::<u8>(&stream, 600 * MIB) {
            Err(e) => e,
            Ok(_) => panic!("600 MiB more must not fit under a 1 GiB cap"),
        };
        let report = err.oom_report().expect("an out-of-memory report");
        assert!(
            matches!(
                report.verdict,
                OomVerdict::FractionCapReached | OomVerdict::Fragmented
            ),
            "{err}"
        );
        println!("expandable OOM: {err}");
        assert_eq!(
            bad!(g, &alloc, &stream, &a, a.len(), 7),
            0,
            "live data survives the OOM path"
        );
        drop(a);
        let b = alloc.alloc_zeros::<u8>(&stream, 600 * MIB).unwrap();
        assert_eq!(b.len(), 600 * MIB);
        drop(b);
        alloc.set_memory_fraction(1.0).unwrap();
        assert!(
            alloc.alloc_zeros::<u8>(&stream, total + GIB).is_err(),
            "more than the device"
        );
        alloc.check_invariants().unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.memory_stats().memory_reserved(), 0);
    }
}

// ---- context binding (issue #4) -----------------------------------------------------------------

/// The calling thread's current context (null when none).
fn current_ctx() -> sys::CUcontext {
    result::ctx::get_current()
        .unwrap()
        .unwrap_or(std::ptr::null_mut())
}

/// A context managing stream synchronization with two streams, a cache on it, and a launcher of
/// `spin_then_fill` (about 0.75 s) on the second stream.
fn without_events_setup(
    test: &str,
) -> (
    &'static Gpu,
    Arc<cudarc::driver::CudaStream>,
    Arc<cudarc::driver::CudaStream>,
    CudaAllocator,
) {
    let g = gpu(test);
    let a = g.ctx.new_stream().unwrap();
    let b = g.ctx.new_stream().unwrap();
    assert!(g.ctx.is_managing_stream_synchronization());
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    (g, a, b, alloc)
}

/// Writes `buf` (`MIB` values) with `seed` on `stream` after spinning about 0.75 s, its events
/// failing to be made if it has none yet (the test hook).
fn spin_without_events(
    g: &Gpu,
    stream: &Arc<cudarc::driver::CudaStream>,
    buf: &mut CachedSlice<u32>,
    seed: u32,
) {
    let (n64, cycles) = (MIB as u64, 1_500_000_000i64);
    cuda_caching_allocator::interop::fail_next_event_shells(1);
    let mut launch = stream.launch_builder(&g.spin_fill);
    launch.arg(&mut *buf).arg(&n64).arg(&seed).arg(&cycles);
    cuda_caching_allocator::interop::fail_next_event_shells(0);
    // SAFETY: spin_then_fill(unsigned*, u64, u32, i64) writes `MIB` values; `buf` holds at
    // least that many.
    unsafe { launch.launch(grid(MIB)) }.unwrap();
    assert!(!buf.has_events(), "the hook made the events fail");
}

/// Note [Uses without events]: while cudarc orders streams, a buffer whose events could not be
/// made (forced with the test hook) orders a kernel's use by synchronization: a copy on another
/// stream after a long kernel wrote the buffer sees the kernel's values.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_copy_after_a_kernel_use_without_events_sees_its_write() {
    let (g, a, b, alloc) =
        without_events_setup("cuda_a_copy_after_a_kernel_use_without_events_sees_its_write");
    let mut buf = uninit::<u32>(&alloc, &a, MIB);
    spin_without_events(g, &b, &mut buf, 0x51);
    let back = a.clone_dtoh(&buf).unwrap();
    assert!(
        back.iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, 0x51)),
        "a copy on another stream ran before the kernel's write"
    );
    assert_eq!(g.ctx.check_err(), Ok(()));
}

/// Note [Uses without events]: the drop of a buffer without events waits for a kernel still
/// writing it, so the block's next buffer is not overwritten.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_the_drop_of_a_buffer_without_events_waits_for_its_kernel() {
    let (g, a, b, alloc) =
        without_events_setup("cuda_the_drop_of_a_buffer_without_events_waits_for_its_kernel");
    let n = MIB + 1024;
    let mut buf = uninit::<u32>(&alloc, &a, n);
    spin_without_events(g, &b, &mut buf, 0x52);
    let p = buf.device_ptr_raw();
    drop(buf);
    let mut next = uninit::<u32>(&alloc, &a, n);
    assert_eq!(next.device_ptr_raw(), p, "the same block again");
    fill!(g, &a, &mut next, MIB, 0x53);
    ctx_sync(&g.ctx);
    let back = a.clone_dtoh(&next).unwrap();
    assert!(
        back[..MIB]
            .iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, 0x53)),
        "a kernel of the dropped buffer wrote its block's next buffer"
    );
    assert_eq!(g.ctx.check_err(), Ok(()));
}

fn ctx_sync(ctx: &CudaContext) {
    ctx.synchronize().unwrap();
}

/// A cached buffer's drop lets cudarc bind the buffer's context (its event waits and
/// destructions); like every other call of the cache, it puts the caller's current context
/// back. Seen first on two GPUs (`cuda_multi_gpu_each_call_binds_its_device_and_restores_the_callers_context`);
/// on one, the caller's context is none at all.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_cached_buffers_drop_puts_back_the_callers_context() {
    let g = gpu("cuda_a_cached_buffers_drop_puts_back_the_callers_context");
    let s = g.ctx.new_stream().unwrap();
    let side = g.ctx.new_stream().unwrap();
    assert!(g.ctx.is_managing_stream_synchronization());
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    let n = MIB;
    let mut buf = uninit::<u32>(&alloc, &s, n);
    fill!(g, &side, &mut buf, n, 0x31);
    assert!(
        buf.has_events(),
        "the use on the side stream took the buffer's events"
    );
    set_current(std::ptr::null_mut());
    drop(buf);
    let after = current_ctx();
    set_current(g.ctx.cu_ctx());
    assert!(
        after.is_null(),
        "the drop left a context current: {after:?}"
    );
    alloc.empty_cache().unwrap();
}

/// Makes `ctx` current on the calling thread (null: none).
fn set_current(ctx: sys::CUcontext) {
    // SAFETY: the tests pass null or the primary context of a fixture, which the fixture's
    // `CudaContext` retains for the whole process.
    unsafe { result::ctx::set_current(ctx) }.unwrap();
}

/// Where `ptr` lives: the ordinal of the device whose memory it is
/// (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`) and the context it was allocated in
/// (`CU_POINTER_ATTRIBUTE_CONTEXT`; `None` for virtual-memory mappings, which belong to no
/// context). `any` is pushed as the current context for the query (unified addressing answers for
/// every device's pointers from any context) and popped again, so the caller's current context is
/// unchanged.
fn where_is(any: &CudaContext, ptr: DeviceAddr) -> (i32, Option<sys::CUcontext>) {
    // SAFETY: `any` is a live context (its `CudaContext` retains it); it is popped below.
    unsafe { sys::cuCtxPushCurrent_v2(any.cu_ctx()) }
        .result()
        .unwrap();
    let mut ordinal: i32 = -1;
    // SAFETY: this attribute writes one `int` into the live local `ordinal`.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ordinal).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr.0,
        )
    };
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: this attribute writes one `CUcontext` into the live local `ctx`.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ctx).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            ptr.0,
        )
    };
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above into a live local.
    unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }
        .result()
        .unwrap();
    assert_eq!(popped, any.cu_ctx());
    r.result()
        .unwrap_or_else(|e| panic!("cuPointerGetAttribute(DEVICE_ORDINAL, {ptr}): {e}"));
    let ctx = (rc.result().is_ok() && !ctx.is_null()).then_some(ctx);
    (ordinal, ctx)
}

/// The backend leaves the caller's current context as it found it (none, or another one), as
/// PyTorch's `CUDAGuard` does: a C caller's or the CUDA runtime's current device must not change
/// because the cache made a driver call. Runs on one GPU.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_calls_leave_the_callers_current_context_as_they_found_it() {
    let g = gpu("cuda_calls_leave_the_callers_current_context_as_they_found_it");
    // A fresh thread has no current context; opening a device, creating a registry allocator and
    // every kind of driver call leave it with none.
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(current_ctx().is_null(), "a fresh thread has no context");
            let dev = CudaDevice::open(0).unwrap();
            assert!(
                current_ctx().is_null(),
                "CudaDevice::open left a context current"
            );
            drop(dev);
            set_current(std::ptr::null_mut());
            let registry = AllocatorRegistry::new(AllocatorConfig::pytorch());
            let alloc = registry.get(0).unwrap();
            assert!(
                current_ctx().is_null(),
                "AllocatorRegistry::get left a context current"
            );
            let a = alloc.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
            assert!(current_ctx().is_null(), "allocate left a context current");
            assert_eq!(where_is(&g.ctx, a.ptr).0, 0);
            assert_eq!(where_is(&g.ctx, a.ptr).1, Some(g.ctx.cu_ctx()));
            assert!(alloc.device().mem_info().unwrap().total > GIB);
            let ev = alloc.device().create_event().unwrap();
            alloc.device().record_event(ev, StreamId::DEFAULT).unwrap();
            alloc.device().synchronize_event(ev).unwrap();
            assert!(alloc.device().query_event(ev).unwrap());
            // SAFETY: created above, destroyed once.
            unsafe { alloc.device().destroy_event(ev) }.unwrap();
            // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
            unsafe { alloc.free(a.ptr) }.unwrap();
            alloc.empty_cache().unwrap();
            assert!(
                current_ctx().is_null(),
                "a driver call left a context current"
            );
            assert_eq!(alloc.memory_stats().memory_reserved(), 0);
            // The pinned host cache's pins and unpins too (they once left the device's context
            // current behind them).
            let host = CudaHost::new(Arc::new(CudaDevice::open(0).unwrap()));
            let pinned = PinnedCache::new(host, PinnedConfig::default()).unwrap();
            let block = pinned.alloc(3 * MIB).unwrap();
            assert!(current_ctx().is_null(), "a pin left a context current");
            pinned.free(block.ptr).unwrap();
            assert!(pinned.empty_cache().unwrap() > 0, "nothing was unpinned");
            assert!(current_ctx().is_null(), "an unpin left a context current");
        });
    });
    // With the device's own context current, it stays current (and nothing is restored).
    let ctx0 = g.ctx.cu_ctx();
    set_current(ctx0);
    let alloc = private(g);
    let a = alloc.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
    unsafe { alloc.free(a.ptr) }.unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(current_ctx(), ctx0);
}

// ---- several GPUs (issue #4 item 4) -----------------------------------------------------------

/// One device's fixture for the multi-GPU tests: its primary context and the kernels loaded into
/// it (a module belongs to one context).
struct DeviceGpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    fill: CudaFunction,
    check: CudaFunction,
}

/// Every visible device's fixture; fails the test when fewer than two devices work (`gpu/run.sh`
/// leaves the `multi_gpu` tests out on a machine with one GPU, and says so).
fn gpus(test: &str) -> &'static [DeviceGpu] {
    gpu(test);
    static GPUS: OnceLock<Vec<DeviceGpu>> = OnceLock::new();
    let all = GPUS.get_or_init(|| {
        let n = CudaContext::device_count().unwrap() as usize;
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS).unwrap();
        (0..n)
            .map(|ordinal| {
                let ctx = CudaContext::new(ordinal).unwrap();
                let module = ctx.load_module(ptx.clone()).unwrap();
                DeviceGpu {
                    ordinal,
                    fill: module.load_function("fill_pattern").unwrap(),
                    check: module.load_function("check_pattern").unwrap(),
                    ctx,
                }
            })
            .collect()
    });
    assert!(
        all.len() >= 2,
        "{test} needs at least 2 GPUs ({} visible); leave it out with --skip multi_gpu",
        all.len()
    );
    all
}

/// The registry's allocator of each device allocates in that device's memory (and, for
/// `cuMemAlloc` segments, in its primary context), on that device's streams; kernels on each
/// device write and read the data; a stream of another device is refused with nothing allocated.
/// Under PyTorch's configuration (plain segments) and the crate default (expandable segments).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_each_device_allocates_from_its_own_allocator() {
    let gs = gpus("cuda_multi_gpu_each_device_allocates_from_its_own_allocator");
    for (name, config) in [
        ("pytorch", AllocatorConfig::pytorch()),
        ("default", AllocatorConfig::default()),
    ] {
        let registry = AllocatorRegistry::new(config);
        // Created last device first: the order of creation must not matter.
        for dg in gs.iter().rev() {
            let alloc = registry.get(dg.ordinal).unwrap();
            assert_eq!(alloc.ordinal(), dg.ordinal);
            assert_eq!(alloc.device().device_index(), dg.ordinal);
            assert_eq!(
                alloc.context().cu_ctx(),
                dg.ctx.cu_ctx(),
                "{name}: the allocator of device {} uses the device's primary context",
                dg.ordinal
            );
        }
        assert!(registry.get(gs.len()).is_err(), "no such device");
        let mut held = Vec::new();
        for dg in gs {
            let alloc = registry.get(dg.ordinal).unwrap();
            let stream = dg.ctx.new_stream().unwrap();
            for (i, len) in [1000usize, 300_000, 5 * MIB].into_iter().enumerate() {
                let seed = (dg.ordinal as u32) << 8 | i as u32;
                let mut buf = uninit::<u32>(alloc, &stream, len);
                fill!(dg, &stream, &mut buf, len, seed);
                let (ordinal, ctx) = where_is(&gs[0].ctx, buf.device_ptr_raw());
                assert_eq!(
                    ordinal, dg.ordinal as i32,
                    "{name}: a buffer of device {}'s allocator lies in device {ordinal}'s memory",
                    dg.ordinal
                );
                if name == "pytorch" {
                    assert_eq!(
                        ctx,
                        Some(dg.ctx.cu_ctx()),
                        "{name}: allocated in the device's primary context"
                    );
                }
                held.push((dg, buf, seed));
            }
        }
        // Every buffer's data, checked by a kernel on its own device and copied to the host.
        for (dg, buf, seed) in &held {
            let alloc = registry.get(dg.ordinal).unwrap();
            assert_eq!(
                bad!(dg, alloc, buf.alloc_stream(), buf, buf.len(), *seed),
                0,
                "{name}: device {}",
                dg.ordinal
            );
            let head = alloc.dtoh(&buf.get(..4).unwrap()).unwrap();
            assert_eq!(head, (0..4).map(|i| pattern(i, *seed)).collect::<Vec<_>>());
        }
        // A stream of device 1 on device 0's allocator: refused, nothing allocated.
        let a0 = registry.get(0).unwrap();
        let s1 = gs[1].ctx.new_stream().unwrap();
        let before = a0.memory_stats();
        let err = a0.alloc_zeros::<u32>(&s1, 16).unwrap_err();
        assert!(matches!(err, AllocError::InvalidStream { .. }), "{err}");
        println!("multi-GPU, {name}: foreign stream refused: {err}");
        assert_eq!(a0.memory_stats(), before);
        assert!(a0.admit(&s1).is_err());
        drop(held);
        let created = registry.created();
        assert_eq!(created.len(), gs.len());
        for (d, alloc) in created {
            alloc.check_invariants().unwrap();
            assert_eq!(
                alloc.memory_stats().memory_allocated(),
                0,
                "{name}: device {d}"
            );
        }
        registry.empty_cache_all().unwrap();
        for (d, stats) in registry.memory_stats() {
            assert_eq!(stats.memory_reserved(), 0, "{name}: device {d}");
        }
    }
}

/// Statistics and caches are per device: allocating on device 1 leaves device 0's statistics
/// exactly as they were (and the other way round), `empty_cache` on device 1 releases device 1's
/// memory only, and device 0's cached block is still served from its cache afterwards.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_stats_and_empty_cache_are_per_device() {
    let gs = gpus("cuda_multi_gpu_stats_and_empty_cache_are_per_device");
    let registry = AllocatorRegistry::new(AllocatorConfig::pytorch());
    let (d0, d1) = (&gs[0], &gs[1]);
    let (a0, a1) = (registry.get(0).unwrap(), registry.get(1).unwrap());
    // Device 0 holds one live buffer and one cached block.
    let s0 = d0.ctx.default_stream();
    let live0 = uninit::<u8>(a0, &s0, 3 * MIB);
    let cached0 = uninit::<u8>(a0, &s0, 64 * MIB);
    let cached0_ptr = cached0.device_ptr_raw();
    drop(cached0);
    let stats0 = a0.memory_stats();
    assert!(stats0.memory_reserved() >= stats0.memory_allocated() + 64 * MIB as i64);
    let untouched = a1.memory_stats();
    assert_eq!(
        (untouched.memory_reserved(), untouched.num_device_alloc),
        (0, 0),
        "device 1 untouched so far"
    );

    // Device 1 allocates, writes and frees 256 MiB: device 0's statistics do not move.
    let s1 = d1.ctx.new_stream().unwrap();
    let mut bufs1 = Vec::new();
    for i in 0..4u32 {
        let len = 64 * MIB / 4;
        let mut b = uninit::<u32>(a1, &s1, len);
        fill!(d1, &s1, &mut b, len, 40 + i);
        bufs1.push((b, 40 + i));
    }
    assert_eq!(
        a0.memory_stats(),
        stats0,
        "device 1's allocations moved device 0's statistics"
    );
    assert!(a1.memory_stats().memory_allocated() >= 256 * MIB as i64);
    for (b, seed) in &bufs1 {
        assert_eq!(bad!(d1, a1, &s1, b, b.len(), *seed), 0);
    }
    drop(bufs1);
    let stats1 = a1.memory_stats();
    assert_eq!(stats1.memory_allocated(), 0);
    assert!(stats1.memory_reserved() >= 256 * MIB as i64);
    let per_device = registry.memory_stats();
    assert_eq!(per_device, vec![(0, stats0), (1, stats1)]);

    // empty_cache on device 1 releases device 1's cached memory, and only that.
    let free0 = a0.device().mem_info().unwrap().free;
    let free1 = a1.device().mem_info().unwrap().free;
    a1.empty_cache().unwrap();
    assert_eq!(a1.memory_stats().memory_reserved(), 0);
    assert_eq!(
        a0.memory_stats(),
        stats0,
        "empty_cache on device 1 touched device 0's cache"
    );
    let free0_after = a0.device().mem_info().unwrap().free;
    let free1_after = a1.device().mem_info().unwrap().free;
    println!(
        "multi-GPU empty_cache on device 1: device 0 free {} -> {} MiB, device 1 free {} -> {} MiB",
        free0 / MIB,
        free0_after / MIB,
        free1 / MIB,
        free1_after / MIB
    );
    assert!(
        free1_after + 16 * MIB >= free1 + 256 * MIB,
        "device 1's free memory rose by {} MiB only",
        free1_after.saturating_sub(free1) / MIB
    );
    assert!(
        free0_after.abs_diff(free0) < 16 * MIB,
        "device 0's free memory moved by {} MiB",
        free0_after.abs_diff(free0) / MIB
    );
    // Device 0's cached block is still cached: the same request reuses it, no device call.
    let again = uninit::<u8>(a0, &s0, 64 * MIB);
    assert_eq!(again.device_ptr_raw(), cached0_ptr);
    assert_eq!(a0.memory_stats().num_device_alloc, stats0.num_device_alloc);

    // And the other way round: device 0's traffic leaves device 1's statistics alone.
    let stats1 = a1.memory_stats();
    let more0 = uninit::<u8>(a0, &s0, 100 * MIB);
    drop((more0, again, live0));
    a0.empty_cache().unwrap();
    assert_eq!(a1.memory_stats(), stats1);
    assert_eq!(a0.memory_stats().memory_reserved(), 0);
    for (_, alloc) in registry.created() {
        alloc.check_invariants().unwrap();
    }
}

/// Freeing (or recording) a pointer of device 1 through device 0's allocator is refused as a
/// foreign pointer, and nothing is lost: both caches are unchanged, the data is intact, and the
/// owner frees it normally. The same through the raw API, where a stream of the wrong device is
/// refused too.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_foreign_pointer_is_refused_and_nothing_is_lost() {
    let gs = gpus("cuda_multi_gpu_foreign_pointer_is_refused_and_nothing_is_lost");
    let (d0, d1) = (&gs[0], &gs[1]);
    for (name, config) in [
        ("pytorch", AllocatorConfig::pytorch()),
        (
            "default + fast path",
            AllocatorConfig::default()
                .with_settings("cca_fast_path:True")
                .unwrap(),
        ),
    ] {
        let registry = AllocatorRegistry::new(config);
        let (a0, a1) = (registry.get(0).unwrap(), registry.get(1).unwrap());
        let n = MIB; // u32 values
        let p1 = a1.allocate(4 * n, StreamId::DEFAULT).unwrap();
        let addr1 = p1.ptr.addr();
        let s1 = d1.ctx.default_stream();
        fill!(d1, &s1, &addr1, n, 0x51);
        s1.synchronize().unwrap();
        let (st0, st1) = (a0.memory_stats(), a1.memory_stats());
        // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
        let err = unsafe { a0.free(p1.ptr) }.unwrap_err();
        println!("multi-GPU, {name}: {err}");
        assert!(
            matches!(err, AllocError::UnknownPointer { ptr } if ptr == p1.ptr),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("foreign pointer"), "{err}");
        assert!(a0.record_stream(p1.ptr, StreamId::DEFAULT).is_err());
        assert_eq!(a0.memory_stats(), st0, "{name}: device 0's cache changed");
        assert_eq!(a1.memory_stats(), st1, "{name}: device 1's cache changed");
        a0.check_invariants().unwrap();
        a1.check_invariants().unwrap();
        // The data is intact and the owner frees it.
        assert_eq!(bad!(d1, a1, &s1, &addr1, n, 0x51), 0, "{name}");
        // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
        unsafe { a1.free(p1.ptr) }.unwrap();
        assert!(
            // SAFETY: a second free of the same pointer: refused without touching memory.
            unsafe { a1.free(p1.ptr) }.is_err(),
            "{name}: a second free is refused"
        );
        // The other way round.
        let p0 = a0.allocate(1000, StreamId::DEFAULT).unwrap();
        assert!(matches!(
            // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
            unsafe { a1.free(p0.ptr) },
            Err(AllocError::UnknownPointer { .. })
        ));
        // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
        unsafe { a0.free(p0.ptr) }.unwrap();
        for (d, alloc) in registry.created() {
            alloc.check_invariants().unwrap();
            assert_eq!(
                alloc.memory_stats().memory_allocated(),
                0,
                "{name}: device {d}"
            );
        }
        registry.empty_cache_all().unwrap();
    }

    // The raw API (the global registry): by ordinal, with streams checked against the device.
    let s0 = d0.ctx.new_stream().unwrap();
    let sid0 = stream_id(&s0);
    // SAFETY: the legacy default stream is always valid.
    let r1 = unsafe { raw::alloc(1, 4096, StreamId::DEFAULT) }.unwrap();
    assert_eq!(where_is(&d0.ctx, r1.ptr).0, 1);
    let allocated1 = raw::memory_stats(1).unwrap().memory_allocated();
    assert!(matches!(
        // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
        unsafe { raw::free(0, r1.ptr) },
        Err(AllocError::UnknownPointer { .. })
    ));
    assert_eq!(raw::memory_stats(1).unwrap().memory_allocated(), allocated1);
    // SAFETY: `s0` is a live stream of device 0, kept alive until the end of the test.
    let wrong = unsafe { raw::alloc(1, 4096, sid0) };
    assert!(
        matches!(wrong, Err(AllocError::InvalidStream { .. })),
        "{wrong:?}"
    );
    // SAFETY: as above.
    let wrong = unsafe { raw::record_stream(1, r1.ptr, sid0) };
    assert!(matches!(wrong, Err(AllocError::InvalidStream { .. })));
    // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
    unsafe { raw::free(1, r1.ptr) }.unwrap();
    raw::empty_cache(1).unwrap();
}

/// Several threads at once, each driving one device (two per device), on threads that never
/// touched any device: each thread's first call creates or finds its device's allocator in a
/// shared registry, allocates in that device's memory without leaving a context current on the
/// thread, then runs an allocate / fill / check / free loop on a stream of its device.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_threads_drive_their_own_devices_at_once() {
    let gs = gpus("cuda_multi_gpu_threads_drive_their_own_devices_at_once");
    let registry = AllocatorRegistry::new(AllocatorConfig::pytorch());
    let per_device = 2;
    let barrier = Barrier::new(gs.len() * per_device);
    let results: Vec<(usize, u32)> = std::thread::scope(|scope| {
        let handles: Vec<_> = gs
            .iter()
            .flat_map(|dg| (0..per_device).map(move |t| (dg, t)))
            .map(|(dg, t)| {
                let (registry, barrier) = (&registry, &barrier);
                scope.spawn(move || {
                    assert!(current_ctx().is_null(), "a fresh thread has no context");
                    barrier.wait();
                    // The first calls on this thread: through the core API, before any cudarc call.
                    let alloc = registry.get(dg.ordinal).unwrap();
                    let probe = alloc.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
                    assert!(
                        current_ctx().is_null(),
                        "device {}'s allocator left a context current",
                        dg.ordinal
                    );
                    assert_eq!(where_is(&dg.ctx, probe.ptr).0, dg.ordinal as i32);
                    // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
                    unsafe { alloc.free(probe.ptr) }.unwrap();
                    let stream = dg.ctx.new_stream().unwrap();
                    let mut held: Vec<(CachedSlice<u32>, u32)> = Vec::new();
                    let mut bad = 0;
                    for i in 0..120u32 {
                        let len =
                            1 + ((i as usize * 7919 + t * 104_729 + dg.ordinal * 31) % 600_000);
                        let seed = (dg.ordinal as u32) << 24 | (t as u32) << 16 | i;
                        let mut buf = uninit::<u32>(alloc, &stream, len);
                        fill!(dg, &stream, &mut buf, len, seed);
                        if i % 30 == 0 {
                            let (ordinal, _) = where_is(&dg.ctx, buf.device_ptr_raw());
                            assert_eq!(ordinal, dg.ordinal as i32);
                        }
                        held.push((buf, seed));
                        if held.len() > 6 {
                            let (old, s) = held.remove(i as usize % held.len());
                            bad += bad!(dg, alloc, &stream, &old, old.len(), s);
                        }
                    }
                    for (buf, s) in &held {
                        bad += bad!(dg, alloc, &stream, buf, buf.len(), *s);
                    }
                    (dg.ordinal, bad)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (d, bad) in &results {
        assert_eq!(*bad, 0, "device {d}: corrupted values");
    }
    let created = registry.created();
    assert_eq!(created.len(), gs.len(), "one allocator per device");
    for (d, alloc) in created {
        alloc.check_invariants().unwrap();
        let st = alloc.memory_stats();
        println!(
            "multi-GPU threads: device {d}: {} allocations, {} device allocations, peak reserved {} MiB",
            st.allocation
                .get(cuda_caching_allocator::StatType::All)
                .allocated,
            st.num_device_alloc,
            st.max_memory_reserved() / MIB as i64
        );
        assert_eq!(st.memory_allocated(), 0, "device {d}");
        // Each device served exactly its own threads' requests: per thread the probe, 120
        // buffers, and one check counter per buffer checked (114 in the loop, 6 at the end).
        assert_eq!(
            st.allocation
                .get(cuda_caching_allocator::StatType::All)
                .allocated,
            per_device as i64 * (1 + 120 + 114 + 6),
            "device {d}"
        );
    }
    registry.empty_cache_all().unwrap();
}

/// Each call binds its device's context, whatever is current on the thread (none, device 0's,
/// device 1's), and puts the caller's back: allocations land on the allocator's device, events
/// are created and recorded on it, `empty_cache` frees through it; a block used on a second
/// stream of device 1 and freed while device 0's context is current is recorded on device 1.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_each_call_binds_its_device_and_restores_the_callers_context() {
    let gs = gpus("cuda_multi_gpu_each_call_binds_its_device_and_restores_the_callers_context");
    let registry = AllocatorRegistry::new(AllocatorConfig::pytorch());
    let (d0, d1) = (&gs[0], &gs[1]);
    let (a0, a1) = (registry.get(0).unwrap(), registry.get(1).unwrap());
    for (current, name) in [
        (std::ptr::null_mut(), "no context"),
        (d0.ctx.cu_ctx(), "device 0's context"),
        (d1.ctx.cu_ctx(), "device 1's context"),
    ] {
        set_current(current);
        for (dg, alloc) in [(d0, a0), (d1, a1)] {
            let d = dg.ordinal;
            let a = alloc.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
            assert_eq!(
                current_ctx(),
                current,
                "allocate on device {d} with {name} current"
            );
            let (ordinal, ctx) = where_is(&d0.ctx, a.ptr);
            assert_eq!(
                ordinal, d as i32,
                "allocate on device {d} with {name} current"
            );
            assert_eq!(ctx, Some(dg.ctx.cu_ctx()));
            assert!(alloc.device().mem_info().unwrap().free > 0);
            let ev = alloc.device().create_event().unwrap();
            alloc.device().record_event(ev, StreamId::DEFAULT).unwrap();
            alloc.device().synchronize_event(ev).unwrap();
            assert!(alloc.device().query_event(ev).unwrap());
            // SAFETY: created above, destroyed once.
            unsafe { alloc.device().destroy_event(ev) }.unwrap();
            alloc.device().synchronize().unwrap();
            // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
            unsafe { alloc.free(a.ptr) }.unwrap();
            alloc.empty_cache().unwrap();
            assert_eq!(
                current_ctx(),
                current,
                "device {d}'s calls with {name} current"
            );
            assert_eq!(alloc.memory_stats().memory_reserved(), 0);
        }
    }

    // record_stream across streams of device 1, the free made while device 0's context is current.
    let s1 = d1.ctx.new_stream().unwrap();
    let side = d1.ctx.new_stream().unwrap();
    let n = MIB;
    let mut buf = uninit::<u32>(a1, &s1, n);
    fill!(d1, &side, &mut buf, n, 0x77);
    buf.record_stream(&side).unwrap();
    set_current(d0.ctx.cu_ctx());
    drop(buf);
    assert_eq!(current_ctx(), d0.ctx.cu_ctx());
    assert!(
        a1.device().live_event_count() >= 1,
        "the free recorded an event on device 1's side stream"
    );
    side.synchronize().unwrap();
    set_current(d0.ctx.cu_ctx());
    let next = a1.allocate(4 * n, stream_id(&s1)).unwrap();
    assert_eq!(current_ctx(), d0.ctx.cu_ctx());
    // SAFETY: a raw allocation of this test, owned by no buffer, freed once here.
    unsafe { a1.free(next.ptr) }.unwrap();
    a1.empty_cache().unwrap();
    assert_eq!(current_ctx(), d0.ctx.cu_ctx());
    assert_eq!(a1.memory_stats().memory_reserved(), 0);
    assert_eq!(a0.memory_stats().memory_reserved(), 0);
    a1.check_invariants().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_exported_pages_map_the_same_bytes_elsewhere() {
    let g = gpu("cuda_exported_pages_map_the_same_bytes_elsewhere");
    g.ctx.bind_to_thread().unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&g.ctx), AllocatorConfig::default()).unwrap();
    let me = std::process::id() as i32;
    let mut kept_fds = Vec::new();
    let open = |fd: i32| {
        // SAFETY: F_GETFD only reads the descriptor table.
        unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
    };
    // Sizes in the small pool, across pages, and one on pages that page reuse moved: the first
    // 30 MiB is freed and its pages go to the next growth.
    let first = alloc.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    // SAFETY: from `allocate` on this cache, owned by no buffer, never used by work.
    unsafe { alloc.free(first.ptr) }.unwrap();
    let spacer = alloc.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    for size in [4096usize, 3 * MIB + 256, 20 * MIB, 29 * MIB] {
        let a = alloc.allocate(size, StreamId::DEFAULT).unwrap();
        let host: Vec<u32> = (0..size / 4).map(|i| pattern(i as u64, 7)).collect();
        // SAFETY: `a` holds `size` bytes; the context is current on this thread.
        unsafe { result::memcpy_htod_sync(a.ptr.0, &host) }.unwrap();
        let pages = alloc
            .export_pages(a.ptr)
            .unwrap()
            .expect("the default maps pages");
        assert_eq!(pages.pid, me);
        assert_eq!(
            pages.fds.len(),
            (pages.offset + size).div_ceil(pages.handle_bytes)
        );
        let again = alloc.export_pages(a.ptr).unwrap().unwrap();
        assert_eq!(
            again, pages,
            "a page is exported once and its descriptor kept"
        );
        let imported = alloc
            .device()
            .import_pages(me, pages.handle_bytes, &pages.fds)
            .unwrap();
        assert_eq!(imported.size(), pages.fds.len() * pages.handle_bytes);
        let view = imported.ptr().0 + pages.offset as u64;
        assert_ne!(view, a.ptr.0, "a second mapping of the same memory");
        let mut back = vec![0u32; size / 4];
        // SAFETY: the imported mapping covers `size` bytes from `view`.
        unsafe { result::memcpy_dtoh_sync(&mut back, view) }.unwrap();
        assert!(
            back == host,
            "{size} bytes: the import reads what the allocation holds"
        );
        let other: Vec<u32> = host.iter().map(|x| !x).collect();
        // SAFETY: as above.
        unsafe { result::memcpy_htod_sync(view, &other) }.unwrap();
        // SAFETY: `a` holds `size` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut back, a.ptr.0) }.unwrap();
        assert!(
            back == other,
            "{size} bytes: the allocation reads what the import wrote"
        );
        drop(imported);
        assert!(
            pages.fds.iter().all(|&fd| open(fd)),
            "descriptors open while the exported allocation lives"
        );
        kept_fds.extend(pages.fds);
        // SAFETY: as above; the copies above were synchronous.
        unsafe { alloc.free(a.ptr) }.unwrap();
    }
    // Bad input: a process that does not exist, a descriptor it does not have, a size that is
    // not the handles'.
    // (The spacer's pages are exported for this: the freed allocations' descriptors are closed.)
    let dev = alloc.device();
    let live = alloc.export_pages(spacer.ptr).unwrap().unwrap();
    let e = dev.import_pages(i32::MAX, 2 * MIB, &[3]).unwrap_err();
    assert!(e.to_string().contains("pidfd_open"), "{e}");
    let e = dev.import_pages(me, 2 * MIB, &[1 << 20]).unwrap_err();
    assert!(e.to_string().contains("pidfd_getfd"), "{e}");
    let e = dev
        .import_pages(me, 2 * MIB + 1, &[live.fds[0]])
        .unwrap_err();
    assert!(e.to_string().contains("granularity"), "{e}");
    let e = dev.import_pages(me, 4 * MIB, &[live.fds[0]]).unwrap_err();
    assert!(e.to_string().contains("cuMemMap"), "{e}");
    kept_fds.extend(live.fds);
    // SAFETY: as above.
    unsafe { alloc.free(spacer.ptr) }.unwrap();
    alloc.empty_cache().unwrap();
    // Freed exported allocations (flushed from the thread's cache by empty_cache) and released
    // pages close their descriptors (a number may be taken again by the driver meanwhile, so a
    // few may read as open).
    kept_fds.sort_unstable();
    kept_fds.dedup();
    let still = kept_fds.iter().filter(|&&fd| open(fd)).count();
    assert!(
        still <= kept_fds.len() / 4,
        "{still} of {} descriptors still open after empty_cache",
        kept_fds.len()
    );
    // Fixed segments have no pages: the caller shares them with cuIpcGetMemHandle.
    let fixed = private(g);
    let a = fixed.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(fixed.export_pages(a.ptr).unwrap(), None);
    // SAFETY: as above.
    unsafe { fixed.free(a.ptr) }.unwrap();
}

/// Pages of another process (here this one's, imported through `pidfd_getfd` as another
/// process would) mapped on device 0 are granted to device 1 when peer access is enabled later,
/// as PyTorch's `enablePeerAccess` grants the handles it opened: a kernel on device 1 reads them.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_multi_gpu_imported_pages_are_granted_to_a_peer_added_later() {
    let gs = gpus("cuda_multi_gpu_imported_pages_are_granted_to_a_peer_added_later");
    let (g0, g1) = (&gs[0], &gs[1]);
    let a0 = CudaAllocator::new(Arc::clone(&g0.ctx), AllocatorConfig::default()).unwrap();
    let a1 = CudaAllocator::new(Arc::clone(&g1.ctx), AllocatorConfig::default()).unwrap();
    let n = (7 * MIB) / 4;
    let seed = 0x5eed;
    let s0 = g0.ctx.default_stream();
    let mut src = uninit::<u32>(&a0, &s0, n);
    fill!(g0, &s0, &mut src, n, seed);
    s0.synchronize().unwrap();
    let pages = a0.export_pages(src.device_ptr_raw()).unwrap().unwrap();
    let imported = a0
        .device()
        .import_pages(std::process::id() as i32, pages.handle_bytes, &pages.fds)
        .unwrap();
    let view = imported.ptr().0 + pages.offset as u64;
    // Device 1 gets access now: the driver's peer access between the contexts, and the cache's
    // (which grants mapped pages, the imported ones among them).
    g1.ctx.bind_to_thread().unwrap();
    // SAFETY: both contexts are live; enabling twice only reports "already enabled".
    let _ = unsafe { sys::cuCtxEnablePeerAccess(g0.ctx.cu_ctx(), 0) };
    a0.enable_peer_access(1).unwrap();
    let s1 = g1.ctx.default_stream();
    let n64 = n as u64;
    let mut bad = a1.alloc_zeros::<u32>(&s1, 1).unwrap();
    let mut b = s1.launch_builder(&g1.check);
    b.arg(&view).arg(&n64).arg(&seed).arg(&mut bad);
    // SAFETY: check_pattern reads `n` values from `view`, which the imported mapping covers and
    // device 1 was just granted, and writes one counter of its own device.
    unsafe { b.launch(grid(n)) }.unwrap();
    assert_eq!(
        a1.dtoh(&bad).unwrap()[0],
        0,
        "device 1 reads the imported pages"
    );
    drop(imported);
    drop(src);
}
