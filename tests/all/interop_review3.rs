//! GPU probes of a third adversarial review of the cudarc interop (`src/interop/`), found by
//! reading the interactions of the new pieces: each runs a hazard `TRIALS` times in a probe arm
//! and control arms that differ only in the suspected trigger (one of them, where cudarc has the
//! same API, the plain-cudarc program). Each asserts what cudarc's own buffers give (or the
//! crate's own promise, where cudarc promises nothing), so it FAILS while the hazard is real.
//! `#[ignore]`d like `cuda_streams.rs` (`--ignored` runs them).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError, PushKernelArg, result, sys,
};

use crate::spin::{JUNK, Kernels, N, NO_SPIN, expected, fill, grid, kernels, slow_copy, spin_grid};
use crate::util::require_gpu;

const TRIALS: usize = 20;

/// `spin(NO_SPIN)` on `s`: a kernel that touches no memory.
fn empty_kernel(s: &CudaStream, k: &Kernels) -> Result<(), DriverError> {
    let mut l = s.launch_builder(&k.spin);
    l.arg(&NO_SPIN);
    // SAFETY: spin(long long) touches no memory.
    unsafe { l.launch(spin_grid()) }.map(|_| ())
}

// ---- R3-1: a first use inside a capture leaves the address's stale kept shell in the pool ------

/// Hazard (d) of `cuda_streams.rs` (a cache hit's first use on a third stream must wait for the
/// block's last reads) after a buffer whose first use came inside a capture (of another stream,
/// through `DevicePtr`, which names the using stream): `shell_on` makes new events for it and
/// leaves the address's kept shell in the pool; its drop destroys the new shell (never pooled),
/// so the next buffer at the address takes the kept one, whose events predate that buffer's
/// uses, and no new shell is anchored. Returns (wrong trials, trials at the same address twice).
fn first_use_in_capture_then_hit(trigger: bool) -> (usize, usize) {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    let s3 = ctx.new_stream().unwrap();
    let s4 = ctx.new_stream().unwrap();
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let (mut wrong, mut same) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 31;
        // SAFETY: u32 is valid for every bit pattern; it is written before being read.
        let mut a: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        fill!(s1, k, &mut a, v, NO_SPIN, grid()).unwrap();
        s1.synchronize().unwrap();
        let base = a.device_ptr_raw();
        drop(a); // its shell stays with `base`
        // SAFETY: u32 is valid for every bit pattern (it holds `a`'s values, `v + i`).
        let c: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        // The first use of `c`: a read on s4, inside a capture of s4 (probe) or not (control).
        if trigger {
            s4.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
        }
        {
            let (_, record) = DevicePtr::<u32>::device_ptr(&c, &s4);
            let launched = empty_kernel(&s4, &k);
            drop(record);
            launched.unwrap();
        }
        if trigger {
            let graph = s4.end_capture(sys::CUgraphInstantiate_flags(0));
            assert!(
                matches!(graph, Ok(Some(_))),
                "the capture is valid: {:?}",
                graph.err()
            );
        }
        assert_eq!(ctx.check_err(), Ok(()), "nothing kept in the context");
        let mut z: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        slow_copy!(s2, k, &c, &mut z);
        drop(c); // s1 waits for the slow read
        // SAFETY: u32 is valid for every bit pattern; it is overwritten before being read.
        let mut d: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        if d.device_ptr_raw() == base {
            same += 1;
        }
        fill!(s3, k, &mut d, JUNK, NO_SPIN, grid()).unwrap(); // first use, on a third stream
        if z.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
        drop((d, z));
        assert_eq!(ctx.check_err(), Ok(()), "nothing kept in the context");
    }
    (wrong, same)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review3_first_use_in_capture_leaves_a_stale_kept_shell() {
    require_gpu("review3_first_use_in_capture_leaves_a_stale_kept_shell");
    let probe = first_use_in_capture_then_hit(true);
    let control = first_use_in_capture_then_hit(false);
    println!("R3-1 (wrong, same address): probe {probe:?}, control {control:?}");
    assert_eq!(
        (probe.1, control.1),
        (TRIALS, TRIALS),
        "the block must be reused"
    );
    assert_eq!(
        (probe.0, control.0),
        (0, 0),
        "a cache hit's first use on a third stream overtook the previous buffer's last read"
    );
}

// ---- R3-2: a typed shell made inside a capture after a write inside it ------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum TypedArm {
    /// The capture writes `x`, then `x.as_cuda_slice()`: the suspected trigger.
    WriteThenTyped,
    /// The capture writes another cached buffer `y`, then `x.as_cuda_slice()`.
    OtherWriteThenTyped,
    /// cudarc's own buffer written in the capture, then borrowed as `&CudaSlice`.
    Cudarc,
}

/// `x`'s byte shell is made before a capture of its own stream with no event recorded (a fresh
/// address, idle stream); inside the capture a kernel writes `x` (its byte shell's write is
/// recorded inside the capture), then `as_cuda_slice` runs `inherit_beside_capture`: its side
/// stream, outside the capture, waits on that write, which joins it to the capture, records
/// the typed write there and is destroyed unjoined. cudarc's `&CudaSlice<T>` is a borrow that
/// queues nothing. Returns the trials whose capture or `as_cuda_slice` failed.
fn typed_after_a_write_in_capture(arm: TypedArm) -> usize {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let _s2 = ctx.new_stream().unwrap();
    assert!(ctx.is_managing_stream_synchronization());
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let mut failed = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 37;
        // SAFETY: u32 is valid for every bit pattern; it is written before being read.
        let x: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        // SAFETY: as above.
        let mut y: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
        // SAFETY: as above (cudarc's own allocation, fresh events).
        let mut xc: CudaSlice<u32> = unsafe { s1.alloc::<u32>(N) }.unwrap();
        s1.synchronize().unwrap();
        let mut x = x;
        // First uses outside the capture that record nothing: new shells on an idle stream.
        let _ = x.as_view();
        let _ = y.as_view();
        assert!(x.has_events() && y.has_events());
        s1.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let launched = match arm {
            TypedArm::WriteThenTyped => fill!(s1, k, &mut x, v, NO_SPIN, grid()),
            TypedArm::OtherWriteThenTyped => fill!(s1, k, &mut y, v, NO_SPIN, grid()),
            TypedArm::Cudarc => fill!(s1, k, &mut xc, v, NO_SPIN, grid()),
        };
        let typed_ok = match arm {
            TypedArm::Cudarc => {
                let borrowed: &CudaSlice<u32> = &xc;
                borrowed.len() == N
            }
            _ => x.try_as_cuda_slice().is_ok(),
        };
        let graph = s1.end_capture(sys::CUgraphInstantiate_flags(0));
        if launched.is_err() || !typed_ok || !matches!(graph, Ok(Some(_))) {
            failed += 1;
        }
        drop(graph);
        ctx.synchronize().unwrap();
        // The events recorded inside the capture refuse the drops' waits afterwards, as
        // cudarc's own buffer's do: that error is not what this probe measures.
        drop((x, y, xc));
        let _ = ctx.check_err();
        ctx.synchronize().unwrap();
        let _ = ctx.check_err();
        alloc.empty_cache().unwrap(); // no kept shell for the next trial
    }
    failed
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review3_typed_shell_after_a_write_in_capture() {
    require_gpu("review3_typed_shell_after_a_write_in_capture");
    let cudarc = typed_after_a_write_in_capture(TypedArm::Cudarc);
    let other = typed_after_a_write_in_capture(TypedArm::OtherWriteThenTyped);
    let probe = typed_after_a_write_in_capture(TypedArm::WriteThenTyped);
    println!("R3-2 failed trials: cudarc {cudarc}, other buffer written {other}, probe {probe}");
    assert_eq!(cudarc, 0, "cudarc's borrow leaves the capture valid");
    assert_eq!(other, 0, "as_cuda_slice after another buffer's write");
    assert_eq!(
        probe, 0,
        "as_cuda_slice after the buffer's own write inside the capture must leave it valid"
    );
}

// ---- R3-3: `stream_idle` queries the legacy default stream beside a blocking capture ----------

#[derive(Clone, Copy, Debug, PartialEq)]
enum LegacyArm {
    /// The cached buffer's first use comes during the capture: the suspected trigger.
    CachedFirstUseInside,
    /// The cached buffer's first use comes before the capture.
    CachedFirstUseBefore,
    /// cudarc's own buffer on the default stream.
    Cudarc,
}

/// A buffer allocated on the context's default (legacy) stream is read by a kernel on a
/// non-blocking stream while a *blocking* stream (another library's, wrapped) is capturing.
/// cudarc waits and records on the non-blocking stream only. The cached buffer's first use
/// makes a new shell and asks `cuStreamQuery` of its allocation stream, the legacy stream,
/// which synchronizes with every blocking stream: beside a capturing one, that query is an
/// implicit dependency on it. Returns the trials whose capture failed.
fn legacy_first_use_beside_a_blocking_capture(arm: LegacyArm) -> usize {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let d = ctx.default_stream();
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    ctx.bind_to_thread().unwrap();
    let raw = result::stream::create(result::stream::StreamKind::Default).unwrap();
    // SAFETY: `raw` is a live stream of `ctx`'s context, destroyed after the wrapper is dropped.
    let blocking = unsafe { ctx.wrap_borrowed_stream(raw) };
    let mut failed = 0;
    for _ in 0..TRIALS {
        // SAFETY: u32 is valid for every bit pattern; the kernel only reads the values.
        let x: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&d, N) }.unwrap();
        // SAFETY: as above (cudarc's own allocation).
        let xc: CudaSlice<u32> = unsafe { d.alloc::<u32>(N) }.unwrap();
        // SAFETY: as above (written by the copy before anyone reads it).
        let mut z: CudaSlice<u32> = unsafe { s1.alloc::<u32>(N) }.unwrap();
        ctx.synchronize().unwrap();
        if arm == LegacyArm::CachedFirstUseBefore {
            let _ = x.as_view();
        }
        blocking
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let inside = empty_kernel(&blocking, &k);
        let n = N as u64;
        let mut l = s1.launch_builder(&k.spin_copy);
        match arm {
            LegacyArm::Cudarc => l.arg(&xc),
            _ => l.arg(&x),
        };
        l.arg(&mut z).arg(&n).arg(&NO_SPIN);
        // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) on two `N`-value buffers.
        let read = unsafe { l.launch(grid()) };
        let graph = blocking.end_capture(sys::CUgraphInstantiate_flags(0));
        if inside.is_err() || read.is_err() || !matches!(graph, Ok(Some(_))) {
            failed += 1;
        }
        drop(graph);
        let _ = ctx.check_err();
        ctx.synchronize().unwrap();
        drop((x, xc, z));
        ctx.synchronize().unwrap();
        let _ = ctx.check_err();
        alloc.empty_cache().unwrap(); // a new shell for the next trial's buffer
    }
    drop(blocking);
    // SAFETY: made above; nothing uses it any more.
    unsafe { result::stream::destroy(raw) }.unwrap();
    failed
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn review3_legacy_first_use_beside_a_blocking_capture() {
    require_gpu("review3_legacy_first_use_beside_a_blocking_capture");
    let cudarc = legacy_first_use_beside_a_blocking_capture(LegacyArm::Cudarc);
    let before = legacy_first_use_beside_a_blocking_capture(LegacyArm::CachedFirstUseBefore);
    let probe = legacy_first_use_beside_a_blocking_capture(LegacyArm::CachedFirstUseInside);
    println!(
        "R3-3 failed captures: cudarc {cudarc}, first use before {before}, first use inside {probe}"
    );
    assert_eq!(cudarc, 0, "cudarc's own buffer leaves the capture valid");
    assert_eq!(before, 0, "a first use before the capture");
    assert_eq!(
        probe, 0,
        "a first use during another stream's capture must leave it valid"
    );
}
