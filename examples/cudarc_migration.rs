//! The same cudarc program twice: with cudarc's own allocation (`CudaStream::alloc_zeros`,
//! `clone_htod`, `clone_dtoh`), and with cached allocation through
//! `cuda_caching_allocator::interop`. Only the allocation calls change; copies, kernel launches
//! and cuBLAS take the cached buffers unchanged. `docs/migrating-from-cudarc.md` walks through
//! the diff.
//!
//! Run: `cargo run --release --example cudarc_migration --features cuda,cublas` (without `cublas`
//! the matrix multiply is left out). Without a GPU it says so and exits successfully.

use std::error::Error;
use std::sync::Arc;

use cuda_caching_allocator::backend::cuda::cuda_available;
use cuda_caching_allocator::interop::CudaAllocator;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

const KERNEL: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

const N: usize = 1 << 20;

/// Before: cudarc allocates and frees every buffer through the driver (and creates two events
/// per buffer when several streams are in use).
fn with_cudarc(stream: &Arc<CudaStream>, axpy: &CudaFunction) -> Result<Vec<f32>, Box<dyn Error>> {
    let host_x: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let x = stream.clone_htod(&host_x)?;
    let mut y = stream.alloc_zeros::<f32>(N)?;
    let mut tmp = stream.alloc_zeros::<f32>(N)?;
    stream.memcpy_dtod(&x, &mut tmp)?;
    let n = N as u32;
    let mut launch = stream.launch_builder(axpy);
    launch.arg(&2.0f32).arg(&tmp).arg(&mut y).arg(&n);
    // SAFETY: `axpy` takes (float, const float*, float*, unsigned int), and both buffers hold
    // `n` floats, which the kernel's bounds check respects.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    Ok(stream.clone_dtoh(&y)?)
}

/// After: the same program with cached buffers. Dropping a buffer returns it to the cache, so a
/// second run allocates nothing from the driver.
fn with_cache(
    alloc: &CudaAllocator,
    stream: &Arc<CudaStream>,
    axpy: &CudaFunction,
) -> Result<Vec<f32>, Box<dyn Error>> {
    let host_x: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let x = alloc.htod(stream, &host_x)?; // was: stream.clone_htod(&host_x)
    let mut y = alloc.alloc_zeros::<f32>(stream, N)?; // was: stream.alloc_zeros::<f32>(N)
    let mut tmp = alloc.alloc_zeros::<f32>(stream, N)?; // was: stream.alloc_zeros::<f32>(N)
    stream.memcpy_dtod(&x, &mut tmp)?;
    let n = N as u32;
    let mut launch = stream.launch_builder(axpy);
    launch.arg(&2.0f32).arg(&tmp).arg(&mut y).arg(&n);
    // SAFETY: as above: the cached buffers hold `n` floats each.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    Ok(stream.clone_dtoh(&y)?) // unchanged: cudarc's copies take cached buffers
}

/// cuBLAS takes cached buffers through the same `DevicePtr` / `DevicePtrMut` traits.
#[cfg(feature = "cublas")]
fn matmul(alloc: &CudaAllocator, stream: &Arc<CudaStream>) -> Result<(), Box<dyn Error>> {
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    let (m, k, n) = (64usize, 32usize, 16usize);
    // Column-major: A is m×k, B is k×n, C = A·B is m×n.
    let a_host: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32).collect();
    let b_host: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let a = alloc.htod(stream, &a_host)?;
    let b = alloc.htod(stream, &b_host)?;
    let mut c = alloc.alloc_zeros::<f32>(stream, m * n)?;
    let blas = CudaBlas::new(Arc::clone(stream))?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: m as i32,
    };
    // SAFETY: the leading dimensions and sizes match the three buffers' lengths.
    unsafe { blas.gemm(cfg, &a, &b, &mut c) }?;
    let got = alloc.dtoh(&c)?;
    let mut worst = 0.0f32;
    for col in 0..n {
        for row in 0..m {
            let want: f32 = (0..k)
                .map(|p| a_host[row + p * m] * b_host[p + col * k])
                .sum();
            worst = worst.max((got[row + col * m] - want).abs());
        }
    }
    println!("cuBLAS sgemm on cached buffers: max abs error {worst}");
    if worst > 1e-3 {
        return Err(format!("gemm result off by {worst}").into());
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    if !cuda_available() {
        println!(
            "cudarc_migration: no CUDA driver or device found; nothing to run (this is not an error)."
        );
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(KERNEL)?)?;
    let axpy = module.load_function("axpy")?;

    let expected = with_cudarc(&stream, &axpy)?;
    let alloc = CudaAllocator::for_stream(&stream)?;
    let first = with_cache(alloc, &stream, &axpy)?;
    let device_allocs_after_first = alloc.memory_stats().num_device_alloc;
    let second = with_cache(alloc, &stream, &axpy)?;
    let stats = alloc.memory_stats();
    if first != expected || second != expected {
        return Err("cached and uncached results differ".into());
    }
    println!(
        "axpy on {N} floats: results identical; device allocations: {} after the first run, {} after the second (cache hits)",
        device_allocs_after_first, stats.num_device_alloc
    );
    #[cfg(feature = "cublas")]
    matmul(alloc, &stream)?;
    println!("{}", alloc.memory_summary(true));
    Ok(())
}
