//! Porting cudarc code: cudarc's names on the cached types, `From<AllocError> for DriverError`,
//! and the bridges to cudarc's concrete types (`as_cuda_slice`, view conversions). The error
//! mapping runs everywhere; the rest are GPU tests, `#[ignore]`d like `cuda.rs`
//! (`--ignored` runs them on a machine with a GPU), and every port below is also a
//! compile-time check of the signatures: a cudarc name with the wrong argument or return type
//! fails the build of this file.
#![cfg(feature = "cuda")]

use std::sync::{Arc, OnceLock};

use cuda_caching_allocator::interop::{CachedSlice, CachedView, CachedViewMut, CudaAllocator};
use cuda_caching_allocator::{AllocError, AllocatorConfig, BackendError};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PushKernelArg, sys::CUresult,
};

const KERNELS: &str = r#"
extern "C" __global__ void spin_fill(float* p, unsigned int n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"#;

struct Gpu {
    ctx: Arc<CudaContext>,
    spin_fill: CudaFunction,
}

fn gpu(test: &str) -> &'static Gpu {
    crate::util::require_gpu(test);
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let ctx = CudaContext::new(0).unwrap();
        let module = crate::util::load_module(&ctx, KERNELS);
        Gpu {
            spin_fill: module.load_function("spin_fill").unwrap(),
            ctx,
        }
    })
}

/// About 20 ms of spinning on current GPUs: long enough that a missing wait shows.
const SPIN: i64 = 40_000_000;

/// Fills `dst` (any kernel argument) with `v` on `stream` after spinning.
macro_rules! spin_fill {
    ($g:expr, $stream:expr, $dst:expr, $n:expr, $v:expr) => {{
        let n32 = $n as u32;
        let v: f32 = $v;
        let mut launch = $stream.launch_builder(&$g.spin_fill);
        launch.arg($dst).arg(&n32).arg(&v).arg(&SPIN);
        // SAFETY: the kernel's signature matches the four arguments; it writes `n` floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }.unwrap();
    }};
}

#[test]
fn alloc_errors_become_driver_errors_with_the_closest_code() {
    let code = |e: AllocError| DriverError::from(e).0;
    assert_eq!(
        code(AllocError::TooLarge {
            requested: u64::MAX
        }),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(
        code(AllocError::Backend {
            operation: "cuMemAlloc",
            source: BackendError::OutOfMemory
        }),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY
    );
    // A driver error keeps its own code.
    assert_eq!(
        code(AllocError::Backend {
            operation: "cuMemcpyDtoHAsync",
            source: BackendError::Driver {
                operation: "cuMemcpyDtoHAsync",
                source: Box::new(DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED)),
            }
        }),
        CUresult::CUDA_ERROR_LAUNCH_FAILED
    );
    assert_eq!(
        code(AllocError::Backend {
            operation: "x",
            source: BackendError::Driver {
                operation: "x",
                source: "no code".into(),
            }
        }),
        CUresult::CUDA_ERROR_UNKNOWN
    );
    assert_eq!(
        code(AllocError::InvalidFraction(2.0)),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        code(AllocError::UnknownPointer {
            ptr: cuda_caching_allocator::DeviceAddr(0x1000)
        }),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        code(AllocError::CaptureUnderway {
            operation: "empty_cache"
        }),
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(
        code(AllocError::Unsupported {
            operation: "x",
            capability: "events"
        }),
        CUresult::CUDA_ERROR_NOT_SUPPORTED
    );
    // The configuration error of a bad allocator config, through `?`.
    fn port() -> Result<(), DriverError> {
        let parsed: Result<AllocatorConfig, AllocError> =
            AllocatorConfig::parse("max_split_size_mb:banana").map_err(AllocError::from);
        let config = parsed?;
        drop(config);
        Ok(())
    }
    assert_eq!(port().unwrap_err().0, CUresult::CUDA_ERROR_INVALID_VALUE);
}

/// A cudarc program's allocation layer, ported: every line is cudarc's name with cudarc's
/// argument and return types (`Cached*` for `Cuda*`), in a function returning `DriverError`.
fn ported(alloc: &CudaAllocator, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
    let host: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let a: CachedSlice<f32> = alloc.clone_htod(stream, &host)?;
    let pinned = {
        // SAFETY: every value is written below before it is read.
        let mut p = unsafe { stream.context().alloc_pinned::<f32>(8) }?;
        p.as_mut_slice()?.copy_from_slice(&host);
        p
    };
    let from_pinned: CachedSlice<f32> = alloc.clone_htod(stream, &pinned)?;
    let mut b: CachedSlice<f32> = alloc.clone_dtod(stream, &a)?;
    let empty: CachedSlice<f32> = alloc.null(stream)?;
    assert!(empty.is_empty());

    let v: CachedView<'_, f32> = a.slice(2..6);
    let (lo, hi): (CachedView<'_, f32>, CachedView<'_, f32>) = v.split_at(2);
    assert_eq!((lo.len(), hi.len()), (2, 2));
    assert_eq!(stream.clone_dtoh(&hi)?, [4.0, 5.0]);
    let chunks: Vec<Vec<f32>> = a
        .as_view()
        .chunks_exact(4)
        .map(|c| stream.clone_dtoh(&c))
        .collect::<Result<_, _>>()?;
    assert_eq!(chunks, [host[..4].to_vec(), host[4..].to_vec()]);
    assert!(a.try_slice(..9).is_none());
    assert!(a.try_split_at(9).is_none());
    // SAFETY: every bit pattern is a valid `u32`.
    let bits: Option<CachedView<'_, u32>> = unsafe { a.transmute::<u32>(8) };
    assert_eq!(stream.clone_dtoh(&bits.unwrap())?[1], 1.0f32.to_bits());

    {
        let (mut x, mut y): (CachedViewMut<'_, f32>, CachedViewMut<'_, f32>) = b.split_at_mut(4);
        stream.memset_zeros(&mut x)?;
        let mut tail = y.slice_mut(2..);
        stream.memcpy_htod(&[9.0f32, 9.0], &mut tail)?;
        let _shared: CachedView<'_, f32> = y.into_view();
    }
    assert_eq!(
        Vec::<f32>::try_from(b.try_clone()?)?,
        [0.0, 0.0, 0.0, 0.0, 4.0, 5.0, 9.0, 9.0]
    );
    {
        // cudarc's `CudaViewMut::transmute_mut`.
        let mut v: CachedViewMut<'_, f32> = b.slice_mut(..);
        // SAFETY: every bit pattern is a valid `u32`, and `f32` bits written are valid `f32`.
        let mut bits: CachedViewMut<'_, u32> = unsafe { v.transmute_mut::<u32>(2) }.unwrap();
        stream.memcpy_htod(&[2.5f32.to_bits(); 2], &mut bits)?;
        // SAFETY: as above.
        assert!(unsafe { v.transmute_mut::<u32>(9) }.is_none());
        // And of a view that starts inside the buffer (its byte events run past its end).
        let (_, mut tail) = b.split_at_mut(6);
        // SAFETY: as above.
        let mut last: CachedViewMut<'_, u32> = unsafe { tail.transmute_mut::<u32>(2) }.unwrap();
        stream.memcpy_htod(&[7.5f32.to_bits(); 2], &mut last)?;
    }
    assert_eq!(
        Vec::<f32>::try_from(b.try_clone()?)?,
        [2.5, 2.5, 0.0, 0.0, 4.0, 5.0, 7.5, 7.5]
    );
    let c = b.clone();
    assert_eq!(c.stream().cu_stream(), stream.cu_stream());
    assert_eq!(c.ordinal(), stream.context().ordinal());
    assert_eq!(c.context().cu_ctx(), stream.context().cu_ctx());
    assert_eq!(stream.clone_dtoh(&from_pinned)?, host);

    // `leak` keeps the block allocated until it is freed by pointer.
    let allocated = alloc.memory_stats().memory_allocated();
    let ptr = c.leak();
    assert_eq!(alloc.memory_stats().memory_allocated(), allocated);
    stream.synchronize()?;
    // SAFETY: the leaked buffer owned the block and nothing uses it any more.
    unsafe { alloc.free(cuda_caching_allocator::DeviceAddr(ptr)) }?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cudarc_names_port_with_cudarcs_signatures() {
    let g = gpu("cudarc_names_port_with_cudarcs_signatures");
    let alloc = CudaAllocator::new(g.ctx.clone(), AllocatorConfig::pytorch()).unwrap();
    ported(&alloc, &g.ctx.default_stream()).unwrap();
    // Again with two streams in the context (cudarc orders them: views carry events).
    let other = g.ctx.new_stream().unwrap();
    ported(&alloc, &other).unwrap();
}

/// An op written against cudarc's concrete types, as frameworks and cuFile/NCCL wrappers are.
fn read_cuda_slice(x: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> Vec<f32> {
    stream.clone_dtoh(x).unwrap()
}

fn read_cuda_view(x: CudaView<'_, f32>, stream: &Arc<CudaStream>) -> Vec<f32> {
    stream.clone_dtoh(&x).unwrap()
}

fn zero_cuda_view(mut x: CudaViewMut<'_, f32>, stream: &Arc<CudaStream>) {
    stream.memset_zeros(&mut x).unwrap();
}

/// Once a buffer has its cudarc `CudaSlice` (`as_cuda_slice`), a write on another stream waits
/// for the buffer's own last uses, as cudarc's does, not for unrelated work queued on the
/// buffer's allocation stream since: the byte events fold into the typed ones once, at the first
/// mutable use after the `CudaSlice` is made (before, every mutable use folded them again on
/// the allocation stream, so each such write waited for everything queued there).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_write_after_as_cuda_slice_waits_only_for_the_buffers_own_uses() {
    let g = gpu("a_write_after_as_cuda_slice_waits_only_for_the_buffers_own_uses");
    let a_stream = g.ctx.new_stream().unwrap();
    let b_stream = g.ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(g.ctx.clone(), AllocatorConfig::default()).unwrap();
    const N: usize = 1 << 16;
    let mut buf = alloc.alloc_zeros::<f32>(&a_stream, N).unwrap();
    spin_fill!(g, &a_stream, &mut buf, N, 1.0);
    let _ = buf.as_cuda_slice();
    // The first write after it: ordered after A's fill (the fold).
    b_stream.memset_zeros(&mut buf).unwrap();
    assert!(b_stream.clone_dtoh(&buf).unwrap().iter().all(|&x| x == 0.0));
    b_stream.synchronize().unwrap();

    // Unrelated long work on the allocation stream, then another write of `buf` on B.
    let mut other = alloc.alloc_zeros::<f32>(&a_stream, N).unwrap();
    let (n32, v, cycles) = (N as u32, 5.0f32, 1_500_000_000i64); // about 0.75 s
    let mut launch = a_stream.launch_builder(&g.spin_fill);
    launch.arg(&mut other).arg(&n32).arg(&v).arg(&cycles);
    // SAFETY: spin_fill(float*, unsigned, float, long long) writes `N` floats of `other`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }.unwrap();
    let a_done = a_stream.record_event(None).unwrap();
    spin_fill!(g, &b_stream, &mut buf, N, 2.0);
    b_stream.synchronize().unwrap();
    let a_busy = !a_done.is_complete();
    a_stream.synchronize().unwrap();
    assert!(b_stream.clone_dtoh(&buf).unwrap().iter().all(|&x| x == 2.0));
    assert!(
        a_stream
            .clone_dtoh(&other)
            .unwrap()
            .iter()
            .all(|&x| x == 5.0)
    );
    if !a_busy && crate::util::under_sanitizer() {
        println!("serialized launches: the allocation stream's work ended first; check skipped");
    } else {
        assert!(
            a_busy,
            "B's write waited for unrelated work queued on the buffer's allocation stream"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn as_cuda_slice_shares_the_buffers_stream_ordering() {
    let g = gpu("as_cuda_slice_shares_the_buffers_stream_ordering");
    let a_stream = g.ctx.new_stream().unwrap();
    let b_stream = g.ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(g.ctx.clone(), AllocatorConfig::pytorch()).unwrap();
    const N: usize = 1 << 16;
    let mut buf = alloc.alloc_zeros::<f32>(&a_stream, N).unwrap();

    // A slow write through the cached path on A, then a read through cudarc's type on B: B must
    // wait for it (the typed shell inherits the byte shell's last write).
    spin_fill!(g, &a_stream, &mut buf, N, 1.0);
    let seen = read_cuda_slice(buf.as_cuda_slice(), &b_stream);
    assert!(seen.iter().all(|&x| x == 1.0), "B read before A's write");

    // A slow write through cudarc's view on B, then a read through the cached path on A.
    {
        let mut view = buf.as_cuda_view_mut();
        spin_fill!(g, &b_stream, &mut view, N, 2.0);
    }
    assert!(a_stream.clone_dtoh(&buf).unwrap().iter().all(|&x| x == 2.0));

    // A cached view converts into cudarc's view with the same events.
    spin_fill!(g, &a_stream, &mut buf, N, 3.0);
    let v = buf.slice(..N / 2).into_cuda_view().unwrap();
    assert!(read_cuda_view(v, &b_stream).iter().all(|&x| x == 3.0));
    let half = buf.slice_mut(N / 2..).into_cuda_view_mut().unwrap();
    zero_cuda_view(half, &b_stream);
    let all = a_stream.clone_dtoh(&buf).unwrap();
    assert!(all[..N / 2].iter().all(|&x| x == 3.0) && all[N / 2..].iter().all(|&x| x == 0.0));

    // Dropped on A: the block is reused only after B's last use.
    let ptr = buf.device_ptr_raw();
    {
        let mut view = buf.as_cuda_view_mut();
        spin_fill!(g, &b_stream, &mut view, N, 4.0);
    }
    drop(buf);
    let again = alloc.alloc_zeros::<f32>(&a_stream, N).unwrap();
    assert_eq!(again.device_ptr_raw(), ptr, "the block was not reused");
    assert!(
        a_stream
            .clone_dtoh(&again)
            .unwrap()
            .iter()
            .all(|&x| x == 0.0)
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn for_stream_is_the_shared_allocator_of_the_streams_device() {
    let g = gpu("for_stream_is_the_shared_allocator_of_the_streams_device");
    let stream = g.ctx.new_stream().unwrap();
    // The port's one added line: `&Arc<CudaStream>` and `&CudaStream` both work.
    let alloc = CudaAllocator::for_stream(&stream).unwrap();
    let shared = CudaAllocator::shared(g.ctx.ordinal()).unwrap();
    assert!(CudaAllocator::ptr_eq(alloc, shared));
    let default_stream = g.ctx.default_stream();
    let plain: &CudaStream = &default_stream;
    assert!(CudaAllocator::ptr_eq(
        alloc,
        CudaAllocator::for_stream(plain).unwrap()
    ));
    let x = alloc.htod(&stream, &[1.0f32, 2.0, 3.0]).unwrap();
    assert_eq!(alloc.dtoh(&x).unwrap(), [1.0, 2.0, 3.0]);
    drop(x);
    // A stream of every device gets that device's allocator (another context object of a
    // device shares its primary context).
    for ordinal in 0..CudaContext::device_count().unwrap() as usize {
        let s = CudaContext::new(ordinal).unwrap().new_stream().unwrap();
        let a = CudaAllocator::for_stream(&s).unwrap();
        assert_eq!(a.ordinal(), ordinal);
        assert!(CudaAllocator::ptr_eq(
            a,
            CudaAllocator::shared(ordinal).unwrap()
        ));
    }
    // A stream of a context other than the primary one: refused here, with the way out named,
    // rather than at its first allocation.
    let private = CudaContext::new_non_primary(0, 0).unwrap();
    let s = private.new_stream().unwrap();
    let err = CudaAllocator::for_stream(&s).unwrap_err();
    assert!(
        matches!(
            err,
            AllocError::InvalidStream {
                source: BackendError::InvalidStream { .. },
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("primary context") && msg.contains("CudaAllocator::new"),
        "{msg}"
    );
    // Destroying the private context pops it off this thread's context stack again.
    drop(s);
    drop(private);
    // The shared allocator is intact and still serves its device.
    let y = alloc.alloc_zeros::<f32>(&stream, 16).unwrap();
    assert_eq!(alloc.dtoh(&y).unwrap(), [0.0; 16]);
}
