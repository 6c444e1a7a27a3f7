//! cuBLAS: a single-precision matrix product, a strided batch of them and a matrix-vector
//! product, on small-integer inputs (every sum is exact, so any summation order agrees).
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, Gemv, GemvConfig, StridedBatchedConfig};
use cudarc::driver::CudaContext;

const M: usize = 64;
const K: usize = 48;
const N: usize = 32;
const BATCH: usize = 4;

fn gemm_config(m: usize, n: usize, k: usize) -> GemmConfig<f32> {
    GemmConfig {
        transa: CUBLAS_OP_N,
        transb: CUBLAS_OP_N,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        alpha: 1.0,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0,
        ldc: m as i32,
    }
}

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let blas = CudaBlas::new(stream.clone())?;

    let a_host: Vec<f32> = (0..M * K).map(|i| (i % 7) as f32 - 3.0).collect();
    let b_host: Vec<f32> = (0..K * N).map(|i| (i % 5) as f32 - 2.0).collect();
    let a = alloc.clone_htod(&stream, &a_host)?;
    let b = alloc.clone_htod(&stream, &b_host)?;
    let mut c = alloc.alloc_zeros::<f32>(&stream, M * N)?;
    // SAFETY: column-major `a` is M x K, `b` is K x N and `c` is M x N, as the config says.
    unsafe { blas.gemm(gemm_config(M, N, K), &a, &b, &mut c) }?;
    crate::report("gemm", &stream.clone_dtoh(&c)?);

    let a_batch: Vec<f32> = (0..BATCH * M * K).map(|i| (i % 11) as f32 - 5.0).collect();
    let b_batch: Vec<f32> = (0..BATCH * K * N).map(|i| (i % 3) as f32 - 1.0).collect();
    let a_batch = alloc.clone_htod(&stream, &a_batch)?;
    let b_batch = alloc.clone_htod(&stream, &b_batch)?;
    let mut c_batch = alloc.alloc_zeros::<f32>(&stream, BATCH * M * N)?;
    let cfg = StridedBatchedConfig {
        gemm: gemm_config(M, N, K),
        batch_size: BATCH as i32,
        stride_a: (M * K) as i64,
        stride_b: (K * N) as i64,
        stride_c: (M * N) as i64,
    };
    // SAFETY: BATCH matrices of the shapes above, packed at the strides of `cfg`.
    unsafe { blas.gemm_strided_batched(cfg, &a_batch, &b_batch, &mut c_batch) }?;
    crate::report("gemm_strided_batched", &stream.clone_dtoh(&c_batch)?);

    let x = alloc.clone_htod(&stream, &vec![1.0f32; K])?;
    let mut y = alloc.alloc_zeros::<f32>(&stream, M)?;
    let cfg = GemvConfig {
        trans: CUBLAS_OP_N,
        m: M as i32,
        n: K as i32,
        alpha: 2.0,
        lda: M as i32,
        incx: 1,
        beta: 0.0,
        incy: 1,
    };
    // SAFETY: `a` is M x K column-major, `x` holds K values and `y` M.
    unsafe { blas.gemv(cfg, &a, &x, &mut y) }?;
    crate::report("gemv", &stream.clone_dtoh(&y)?);
    Ok(())
}
