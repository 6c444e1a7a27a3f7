//! Probes of cudarc-equivalence hazards an adversarial review of the interop found by reading
//! (twenty-second session; no GPU was left to run them): each returns how many of `TRIALS`
//! results were wrong in the probe arm and in a control arm that differs only in the suspected
//! trigger, behind a spin kernel of about 20 ms. cudarc's own `CudaSlice` would give 0 in both.
//! R7-1 (a kept event shell taken by a buffer of another `CudaContext` object) is fixed, Note
//! [Shells of one context object]; R7-2 (a view made while one stream existed stays event-less)
//! and R7-3 (`as_cuda_slice` while event tracking is off) are suspected and not fixed: their
//! tests assert what cudarc does, so a failure on a GPU confirms the hazard.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};

use crate::util::require_gpu;

const TRIALS: usize = 10;
const N: usize = 1 << 20;
const SPIN: i64 = 40_000_000;

const KERNELS: &str = r#"
extern "C" __global__ void spin_fill(unsigned int* p, unsigned long long n, unsigned int v,
                                     long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = v + (unsigned int)i;
}
extern "C" __global__ void spin_copy(const unsigned int* src, unsigned int* dst,
                                     unsigned long long n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"#;

fn kernels(ctx: &Arc<CudaContext>) -> (CudaFunction, CudaFunction) {
    let m = crate::util::load_module(ctx, KERNELS);
    (
        m.load_function("spin_fill").unwrap(),
        m.load_function("spin_copy").unwrap(),
    )
}

fn spin_grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (2, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn expected(v: u32) -> Vec<u32> {
    (0..N as u32).map(|i| v.wrapping_add(i)).collect()
}

/// R7-1: a kept event shell made under context object A, taken by a buffer of context object B
/// (same device, same cache, both on the legacy default stream, so the same block). cudarc's
/// `DevicePtr` impls gate their waits on the *shell's* context (A), which no longer manages
/// synchronization once A's streams are gone. Read-after-write: a slow kernel on B's stream
/// writes `x`, `x.to_vec()` on the default stream reads it.
fn shell_of_another_context_object(trigger: bool) -> (usize, usize) {
    let ctx_b = CudaContext::new(0).unwrap();
    let s2 = ctx_b.new_stream().unwrap();
    let _s3 = ctx_b.new_stream().unwrap();
    let db = ctx_b.default_stream();
    let (spin_fill, _) = kernels(&ctx_b);
    let alloc = CudaAllocator::new(Arc::clone(&ctx_b), AllocatorConfig::default()).unwrap();
    let mut first = None;
    if trigger {
        let ctx_a = CudaContext::new(0).unwrap();
        let a1 = ctx_a.new_stream().unwrap();
        let a2 = ctx_a.new_stream().unwrap();
        let da = ctx_a.default_stream();
        let w: CachedSlice<u32> = alloc.alloc_zeros(&da, N).unwrap(); // byte shell made under A
        first = Some(w.device_ptr_raw());
        da.synchronize().unwrap();
        drop(w); // shell kept at its address
        drop((a1, a2)); // A manages nothing any more (its object lives on in the shell)
    }
    let n = N as u64;
    let (mut wrong, mut same) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 7;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&db, N).unwrap();
        if Some(x.device_ptr_raw()) == first {
            same += 1;
        }
        db.synchronize().unwrap();
        let mut l = s2.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes N values of an N-value buffer.
        unsafe { l.launch(spin_grid()) }.unwrap();
        if x.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx_b.synchronize().unwrap();
    }
    (wrong, same)
}

/// R7-2: a view made while the context had one stream carries no events; after `new_stream`
/// and a use that makes the buffer's shell, a kernel reads through the old view on s2 (marked
/// only), and a later write through the buffer (shell exists: no settle) does not wait for it.
fn stale_view(trigger: bool) -> usize {
    let mut wrong = 0;
    let n = N as u64;
    let zero = 0i64;
    for trial in 0..TRIALS {
        let ctx = CudaContext::new(0).unwrap(); // fresh object: one stream
        let d = ctx.default_stream();
        let (spin_fill, spin_copy) = kernels(&ctx);
        let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
        let v = 1000 * trial as u32 + 11;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&d, N).unwrap();
        let mut l = d.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&zero);
        // SAFETY: as above.
        unsafe { l.launch(spin_grid()) }.unwrap();
        d.synchronize().unwrap();
        let mut z: CachedSlice<u32>;
        {
            let early = trigger.then(|| x.as_view()); // no events: one stream
            let s2 = ctx.new_stream().unwrap(); // cudarc now manages synchronization
            let _ = x.to_vec().unwrap(); // makes the byte shell (nothing marked yet)
            let late = x.as_view(); // control: a view with events
            let view = early.as_ref().unwrap_or(&late);
            z = alloc.alloc_zeros(&s2, N).unwrap();
            let mut c = s2.launch_builder(&spin_copy);
            c.arg(view).arg(&mut z).arg(&n).arg(&SPIN);
            // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) on two N-value buffers.
            unsafe { c.launch(spin_grid()) }.unwrap();
        }
        d.memset_zeros(&mut x).unwrap(); // must wait for the copy's read (cudarc: read event)
        if z.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    wrong
}

/// R7-3: `as_cuda_slice` first called while event tracking is off makes a typed shell without
/// events, which then takes precedence for every use, also after tracking is back on. cudarc's
/// buffer allocated while tracking was on keeps its events.
fn typed_shell_without_events(trigger: bool) -> usize {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    let (spin_fill, _) = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let n = N as u64;
    let mut wrong = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 13;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap(); // tracking on
        s1.synchronize().unwrap();
        if trigger {
            // SAFETY: nothing is in flight; tracking comes back on below.
            unsafe { ctx.disable_event_tracking() };
        }
        let _ = x.as_cuda_slice();
        // SAFETY: as above.
        unsafe { ctx.enable_event_tracking() };
        let mut l = s1.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: as above.
        unsafe { l.launch(spin_grid()) }.unwrap();
        let mut y: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        s2.memcpy_dtod(&x, &mut y).unwrap();
        if y.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    wrong
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_kept_shell_serves_only_its_own_context_object() {
    require_gpu("cuda_a_kept_shell_serves_only_its_own_context_object");
    let (probe, control) = (
        shell_of_another_context_object(true),
        shell_of_another_context_object(false),
    );
    println!("other-context shell: probe (wrong, same block) {probe:?}, control {control:?}");
    assert!(
        probe.1 > 0,
        "the probe never got the first object's block: {probe:?}"
    );
    assert_eq!(
        (probe.0, control.0),
        (0, 0),
        "cudarc would order every read"
    );
}

#[test]
#[ignore = "needs a CUDA GPU; suspected hazard R7-2 of the interop review, not yet confirmed or fixed"]
fn cuda_a_view_made_before_a_second_stream_orders_later_writes() {
    require_gpu("cuda_a_view_made_before_a_second_stream_orders_later_writes");
    let (probe, control) = (stale_view(true), stale_view(false));
    assert_eq!(
        (probe, control),
        (0, 0),
        "wrong results: probe {probe}, control {control}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU; suspected hazard R7-3 of the interop review, not yet confirmed or fixed"]
fn cuda_a_typed_shell_made_while_tracking_was_off_keeps_ordering() {
    require_gpu("cuda_a_typed_shell_made_while_tracking_was_off_keeps_ordering");
    let (probe, control) = (
        typed_shell_without_events(true),
        typed_shell_without_events(false),
    );
    assert_eq!(
        (probe, control),
        (0, 0),
        "wrong results: probe {probe}, control {control}"
    );
}
