//! cuBLASLt: a matrix product with a fused bias and ReLU epilogue, then a strided batch without
//! epilogue, on small-integer inputs (exact sums). The handle is created once and kept:
//! `CudaBlasLT::new` allocates its workspace through cudarc in both versions.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::CudaContext;

const M: usize = 96;
const K: usize = 64;
const N: usize = 40;
const BATCH: usize = 3;

fn config(batch: Option<usize>) -> MatmulConfig {
    MatmulConfig {
        transa: false,
        transb: false,
        transc: false,
        m: M as u64,
        n: N as u64,
        k: K as u64,
        alpha: 1.0,
        lda: M as i64,
        ldb: K as i64,
        beta: 0.0,
        ldc: M as i64,
        stride_a: batch.map(|_| (M * K) as i64),
        stride_b: batch.map(|_| (K * N) as i64),
        stride_c: batch.map(|_| (M * N) as i64),
        stride_bias: None,
        batch_size: batch.map(|b| b as i32),
    }
}

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let blas = CudaBlasLT::new(stream.clone())?;

    let a_host: Vec<f32> = (0..M * K).map(|i| (i % 9) as f32 - 4.0).collect();
    let b_host: Vec<f32> = (0..K * N).map(|i| (i % 4) as f32 - 1.0).collect();
    let bias_host: Vec<f32> = (0..M).map(|i| (i % 13) as f32 - 6.0).collect();
    let a = alloc.clone_htod(&stream, &a_host)?;
    let b = alloc.clone_htod(&stream, &b_host)?;
    let bias = alloc.clone_htod(&stream, &bias_host)?;
    let mut c = alloc.alloc_zeros::<f32>(&stream, M * N)?;
    // SAFETY: column-major `a` is M x K, `b` K x N, `c` M x N and `bias` holds M values.
    unsafe {
        blas.matmul(
            config(None),
            &a,
            &b,
            &mut c,
            Some(&bias),
            Some(&Activation::Relu),
        )
    }?;
    crate::report("matmul_bias_relu", &stream.clone_dtoh(&c)?);

    let a_batch: Vec<f32> = (0..BATCH * M * K).map(|i| (i % 5) as f32 - 2.0).collect();
    let b_batch: Vec<f32> = (0..BATCH * K * N).map(|i| (i % 7) as f32 - 3.0).collect();
    let a_batch = alloc.clone_htod(&stream, &a_batch)?;
    let b_batch = alloc.clone_htod(&stream, &b_batch)?;
    let mut c_batch = alloc.alloc_zeros::<f32>(&stream, BATCH * M * N)?;
    // SAFETY: BATCH matrices of the shapes above, packed at the strides of the config.
    unsafe {
        blas.matmul(
            config(Some(BATCH)),
            &a_batch,
            &b_batch,
            &mut c_batch,
            None,
            None,
        )
    }?;
    crate::report("matmul_batched", &stream.clone_dtoh(&c_batch)?);
    Ok(())
}
