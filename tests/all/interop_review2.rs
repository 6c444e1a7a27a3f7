//! GPU probes of an adversarial review of the cudarc interop (`src/interop/`), found by reading:
//! each runs a hazard `TRIALS` times with a spinning kernel that makes a missing wait visible,
//! in a probe arm and in control arms that differ only in the suspected trigger (one of them,
//! where cudarc has the same API, the plain-cudarc program). Each asserts what cudarc's own
//! buffers give (or the crate's own promise, where cudarc promises nothing), so it FAILS while
//! the hazard is real. `#[ignore]`d like `cuda_streams.rs` (`--ignored` runs them).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DeviceSlice, PushKernelArg,
    SyncOnDrop, sys,
};

use crate::spin::{JUNK, N, NO_SPIN, SPIN, expected, fill, grid, kernels, slow_copy, spin_grid};
use crate::util::require_gpu;

const TRIALS: usize = 20;

// ---- R2-1: a typed shell's uses are missing from the kept byte shell -------------------------

/// Hazard (d) of `cuda_streams.rs` (a cache hit's first use on a third stream must wait for the
/// block's last reads, which only the kept byte shell orders), after `as_cuda_slice`: from the
/// typed shell's making on, every use records the typed events, and the drop pools the byte
/// shell whose events miss them. Returns (wrong trials, trials that reused the block).
fn typed_hit_on_a_third_stream(trigger: bool) -> (usize, usize) {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    let s3 = ctx.new_stream().unwrap();
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let (mut wrong, mut reused) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 17;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
        fill!(s1, k, &mut x, v, NO_SPIN, grid()).unwrap();
        s1.synchronize().unwrap();
        if trigger {
            let _ = x.as_cuda_slice(); // from here on, uses record the typed events
        }
        let mut z: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        slow_copy!(s2, k, &x, &mut z);
        let before = x.device_ptr_raw();
        drop(x);
        // SAFETY: u32 is valid for every bit pattern; it is overwritten before being read.
        let mut x2: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        if x2.device_ptr_raw() == before {
            reused += 1;
        }
        fill!(s3, k, &mut x2, JUNK, NO_SPIN, grid()).unwrap(); // first use, on a third stream
        if z.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    (wrong, reused)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review2_typed_shell_kept_events() {
    require_gpu("review2_typed_shell_kept_events");
    let probe = typed_hit_on_a_third_stream(true);
    let control = typed_hit_on_a_third_stream(false);
    println!("R2-1 typed shell, (wrong, reused): probe {probe:?}, control {control:?}");
    assert_eq!(
        (probe.1, control.1),
        (TRIALS, TRIALS),
        "the block must be reused"
    );
    assert_eq!(
        (probe.0, control.0),
        (0, 0),
        "a cache hit's first use on a third stream overtook the block's last read"
    );
}

// ---- R2-2: a buffer of a context object that manages nothing, used on one that does ---------

#[derive(Clone, Copy, Debug)]
enum ObjArm {
    /// The cached buffer pushed directly (`&x`, `&mut x`): the suspected trigger.
    CachedDirect,
    /// The same through views (`as_view`, `as_view_mut`), which take the shell while tracking
    /// is on.
    CachedViews,
    /// cudarc's own `CudaSlice`.
    Cudarc,
}

/// Context object B (no stream of its own: it manages nothing) allocates `x` on its default
/// stream; object A (two streams: it manages synchronization) reads `x` in a slow kernel on a1,
/// then a kernel on a2 overwrites it. cudarc decides per launch stream (`LaunchArgs::arg` asks
/// `self.stream.context()`, A) and `x` has events (tracking was on at its allocation): the write
/// waits for the read. Returns the trials whose read saw the overwrite.
fn other_object_kernel_uses(arm: ObjArm) -> usize {
    let ctx_a = CudaContext::new(0).unwrap();
    let a1 = ctx_a.new_stream().unwrap();
    let a2 = ctx_a.new_stream().unwrap();
    let ctx_b = CudaContext::new(0).unwrap();
    let db = ctx_b.default_stream();
    assert!(ctx_a.is_managing_stream_synchronization());
    assert!(!ctx_b.is_managing_stream_synchronization() && ctx_b.is_event_tracking());
    let k = kernels(&ctx_a);
    let alloc = CudaAllocator::new(Arc::clone(&ctx_b), AllocatorConfig::default()).unwrap();
    let mut wrong = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 19;
        let got = match arm {
            ObjArm::Cudarc => {
                let mut x: CudaSlice<u32> = db.alloc_zeros(N).unwrap();
                fill!(db, k, &mut x, v, NO_SPIN, grid()).unwrap();
                db.synchronize().unwrap();
                let mut z: CudaSlice<u32> = a1.alloc_zeros(N).unwrap();
                slow_copy!(a1, k, &x, &mut z);
                fill!(a2, k, &mut x, JUNK, NO_SPIN, grid()).unwrap();
                let got = a1.clone_dtoh(&z).unwrap();
                ctx_a.synchronize().unwrap();
                got
            }
            ObjArm::CachedDirect | ObjArm::CachedViews => {
                let mut x: CachedSlice<u32> = alloc.alloc_zeros(&db, N).unwrap();
                fill!(db, k, &mut x, v, NO_SPIN, grid()).unwrap();
                db.synchronize().unwrap();
                let mut z: CachedSlice<u32> = alloc.alloc_zeros(&a1, N).unwrap();
                if matches!(arm, ObjArm::CachedDirect) {
                    slow_copy!(a1, k, &x, &mut z);
                    fill!(a2, k, &mut x, JUNK, NO_SPIN, grid()).unwrap();
                } else {
                    let xv = x.as_view();
                    slow_copy!(a1, k, &xv, &mut z);
                    let mut xm = x.as_view_mut();
                    fill!(a2, k, &mut xm, JUNK, NO_SPIN, grid()).unwrap();
                }
                let got = z.to_vec().unwrap();
                ctx_a.synchronize().unwrap();
                got
            }
        };
        if got != expected(v) {
            wrong += 1;
        }
    }
    wrong
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review2_other_object_kernel_uses() {
    require_gpu("review2_other_object_kernel_uses");
    let cudarc = other_object_kernel_uses(ObjArm::Cudarc);
    let views = other_object_kernel_uses(ObjArm::CachedViews);
    let direct = other_object_kernel_uses(ObjArm::CachedDirect);
    println!("R2-2 wrong trials: cudarc {cudarc}, cached views {views}, cached direct {direct}");
    assert_eq!(cudarc, 0, "cudarc's own buffers order this program");
    assert_eq!(views, 0, "views of the cached buffer");
    assert_eq!(
        direct, 0,
        "the cached buffer pushed directly must order as cudarc's"
    );
}

// ---- R2-3: a grown block's new shell orders nothing --------------------------------------------

/// Hazard (d) when the freed block merged with its free neighbour and the next buffer at its
/// address is larger: the kept shell is too short (`ShellPool::take_kept`), a new one is made,
/// and the first use on a third stream waits for nothing. PyTorch's rules: the 4 MiB buffer
/// splits a new 20 MiB segment, its drop merges it back, and the 8 MiB buffer (probe) or the
/// 4 MiB one (control) starts at the same address. Returns (wrong trials, trials at the same
/// address).
fn grown_block_on_a_third_stream(trigger: bool) -> (usize, usize) {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    let s3 = ctx.new_stream().unwrap();
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::pytorch()).unwrap();
    let (mut wrong, mut same) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 23;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
        fill!(s1, k, &mut x, v, NO_SPIN, grid()).unwrap();
        s1.synchronize().unwrap();
        let mut z: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        slow_copy!(s2, k, &x, &mut z);
        let before = x.device_ptr_raw();
        drop(x);
        let len = if trigger { 2 * N } else { N };
        // SAFETY: u32 is valid for every bit pattern; it is overwritten before being read.
        let mut x2: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, len) }.unwrap();
        if x2.device_ptr_raw() == before {
            same += 1;
        }
        fill!(s3, k, &mut x2, JUNK, NO_SPIN, grid()).unwrap(); // the old buffer's N values
        if z.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
        drop((x2, z));
        alloc.empty_cache().unwrap(); // a new segment and no kept shell for the next trial
    }
    (wrong, same)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review2_grown_block_first_use() {
    require_gpu("review2_grown_block_first_use");
    let probe = grown_block_on_a_third_stream(true);
    let control = grown_block_on_a_third_stream(false);
    println!("R2-3 grown block, (wrong, same address): probe {probe:?}, control {control:?}");
    assert_eq!(
        (probe.1, control.1),
        (TRIALS, TRIALS),
        "the next buffer must start at the freed block's address"
    );
    assert_eq!(
        (probe.0, control.0),
        (0, 0),
        "a first use on a third stream overtook the freed block's last read"
    );
}

// ---- R2-4: management that starts between a use's wait and its record ----------------------

/// A copy destination that makes the context's first stream when cudarc asks for its pointer
/// (after the source's `device_ptr`, before the copy is queued), then queues slow work on the
/// copy's stream: what another thread's `new_stream` does in that window.
struct StreamMakingDst<'a, D> {
    inner: &'a mut D,
    ctx: Arc<CudaContext>,
    spin: &'a CudaFunction,
    made: Option<Arc<CudaStream>>,
}

impl<D: DeviceSlice<u32>> DeviceSlice<u32> for StreamMakingDst<'_, D> {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

impl<D: DevicePtrMut<u32>> DevicePtrMut<u32> for StreamMakingDst<'_, D> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.made = Some(self.ctx.new_stream().unwrap()); // synchronizes the context
        let mut l = stream.launch_builder(self.spin);
        l.arg(&SPIN);
        // SAFETY: spin(long long) touches no memory.
        unsafe { l.launch(spin_grid()) }.unwrap();
        self.inner.device_ptr_mut(stream)
    }
}

/// On a context object with no stream of its own, `d.memcpy_dtod(&x, dst)` where `dst` makes the
/// first stream `y` mid-copy; then `y` zeroes `x`. cudarc's `SyncOnDrop` for `x` asks again
/// when it drops (after the copy is queued), now records `x`'s read, and `y`'s write waits for
/// it. Returns the trials whose copy saw the zeros.
fn management_starting_mid_copy(cached: bool) -> usize {
    let ctx = CudaContext::new(0).unwrap();
    let d = ctx.default_stream();
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let mut wrong = 0;
    for trial in 0..TRIALS {
        assert!(
            !ctx.is_in_multi_stream_mode(),
            "the previous trial's stream is gone"
        );
        let v = 1000 * trial as u32 + 29;
        let got = if cached {
            let mut x: CachedSlice<u32> = alloc.alloc_zeros(&d, N).unwrap();
            fill!(d, k, &mut x, v, NO_SPIN, grid()).unwrap();
            d.synchronize().unwrap();
            let mut out: CachedSlice<u32> = alloc.alloc_zeros(&d, N).unwrap();
            let y = {
                let mut dst = StreamMakingDst {
                    inner: &mut out,
                    ctx: Arc::clone(&ctx),
                    spin: &k.spin,
                    made: None,
                };
                d.memcpy_dtod(&x, &mut dst).unwrap();
                dst.made.unwrap()
            };
            y.memset_zeros(&mut x).unwrap();
            let got = out.to_vec().unwrap();
            ctx.synchronize().unwrap();
            drop((x, out));
            drop(y);
            got
        } else {
            let mut x: CudaSlice<u32> = d.alloc_zeros(N).unwrap();
            fill!(d, k, &mut x, v, NO_SPIN, grid()).unwrap();
            d.synchronize().unwrap();
            let mut out: CudaSlice<u32> = d.alloc_zeros(N).unwrap();
            let y = {
                let mut dst = StreamMakingDst {
                    inner: &mut out,
                    ctx: Arc::clone(&ctx),
                    spin: &k.spin,
                    made: None,
                };
                d.memcpy_dtod(&x, &mut dst).unwrap();
                dst.made.unwrap()
            };
            y.memset_zeros(&mut x).unwrap();
            let got = d.clone_dtoh(&out).unwrap();
            ctx.synchronize().unwrap();
            drop((x, out));
            drop(y);
            got
        };
        if got != expected(v) {
            wrong += 1;
        }
    }
    wrong
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review2_management_starting_mid_copy() {
    require_gpu("review2_management_starting_mid_copy");
    let cudarc = management_starting_mid_copy(false);
    let cached = management_starting_mid_copy(true);
    println!("R2-4 wrong trials: cudarc {cudarc}, cached {cached}");
    assert_eq!(
        cudarc, 0,
        "cudarc records the read when its SyncOnDrop drops"
    );
    assert_eq!(cached, 0, "the cached buffer must record it too");
}
