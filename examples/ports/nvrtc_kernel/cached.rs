//! Kernels compiled at run time with NVRTC: an affine map over `f32`, a per-block sum and an
//! integer kernel, launched on buffers made from host data and zeros.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void affine(const float* x, float* y, float a, float b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
extern "C" __global__ void block_sum(const float* x, float* out, unsigned int n) {
    __shared__ float acc[256];
    unsigned int i = blockIdx.x * 256 + threadIdx.x;
    acc[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) acc[threadIdx.x] += acc[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = acc[0];
}
extern "C" __global__ void collatz_steps(const unsigned int* x, unsigned int* steps, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long v = x[i];
    unsigned int s = 0;
    while (v > 1 && s < 1000) { v = (v & 1) ? 3 * v + 1 : v / 2; s++; }
    steps[i] = s;
}
"#;

const N: usize = 10_000;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let affine = module.load_function("affine")?;
    let block_sum = module.load_function("block_sum")?;
    let collatz = module.load_function("collatz_steps")?;

    let host: Vec<f32> = (0..N).map(|i| (i % 251) as f32).collect();
    let x = alloc.clone_htod(&stream, &host)?;
    let mut y = alloc.alloc_zeros::<f32>(&stream, N)?;
    let n = N as u32;
    let mut launch = stream.launch_builder(&affine);
    launch
        .arg(&x)
        .arg(&mut y)
        .arg(&3.0f32)
        .arg(&-1.0f32)
        .arg(&n);
    // SAFETY: (const float*, float*, float, float, unsigned) with `n` floats in both buffers.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    crate::report("affine", &stream.clone_dtoh(&y)?);

    let blocks = N.div_ceil(256);
    let mut sums = alloc.alloc_zeros::<f32>(&stream, blocks)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&block_sum);
    launch.arg(&y).arg(&mut sums).arg(&n);
    // SAFETY: (const float*, float*, unsigned): `y` holds `n` floats, `sums` one per block.
    unsafe { launch.launch(cfg) }?;
    crate::report("block_sum", &stream.clone_dtoh(&sums)?);

    let starts: Vec<u32> = (1..=N as u32).collect();
    let xs = alloc.clone_htod(&stream, &starts)?;
    let mut steps = alloc.alloc_zeros::<u32>(&stream, N)?;
    let mut launch = stream.launch_builder(&collatz);
    launch.arg(&xs).arg(&mut steps).arg(&n);
    // SAFETY: (const unsigned*, unsigned*, unsigned) with `n` values in both buffers.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    crate::report("collatz_steps", &stream.clone_dtoh(&steps)?);
    Ok(())
}
