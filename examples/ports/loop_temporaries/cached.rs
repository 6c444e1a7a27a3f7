//! A training-loop shape: fifty steps, each allocating activations and gradients of varying
//! sizes, running a forward and a backward kernel, reducing into a kept parameter buffer and
//! dropping the temporaries. With cudarc every step goes to the driver; with the cache the
//! steps after the first reuse its blocks.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void forward(const float* w, const float* x, float* act, unsigned int n,
                                   unsigned int p) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = w[i % p] * x[i]; act[i] = v > 0.0f ? v : 0.0f; }
}
extern "C" __global__ void backward(const float* act, float* grad, unsigned int n, unsigned int p) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p) return;
    float g = 0.0f;
    for (unsigned int i = j; i < n; i += p) g += act[i];
    grad[j] = g;
}
extern "C" __global__ void sgd(float* w, const float* grad, float lr, unsigned int p) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < p) w[j] = w[j] - lr * grad[j];
}
"#;

const P: usize = 256;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let forward = module.load_function("forward")?;
    let backward = module.load_function("backward")?;
    let sgd = module.load_function("sgd")?;

    let w_host: Vec<f32> = (0..P).map(|j| ((j % 9) as f32 - 2.0) * 0.125).collect();
    let mut w = alloc.clone_htod(&stream, &w_host)?;
    let p = P as u32;
    for step in 0..50usize {
        let n = P * (16 + (step * 37) % 200);
        let x_host: Vec<f32> = (0..n).map(|i| ((i + step) % 5) as f32 * 0.25).collect();
        let x = alloc.clone_htod(&stream, &x_host)?;
        let mut act = alloc.alloc_zeros::<f32>(&stream, n)?;
        let mut grad = alloc.alloc_zeros::<f32>(&stream, P)?;
        let n32 = n as u32;
        let mut launch = stream.launch_builder(&forward);
        launch.arg(&w).arg(&x).arg(&mut act).arg(&n32).arg(&p);
        // SAFETY: (const float*, const float*, float*, unsigned, unsigned): `w` holds `p`
        // floats, `x` and `act` hold `n32`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }?;
        let mut launch = stream.launch_builder(&backward);
        launch.arg(&act).arg(&mut grad).arg(&n32).arg(&p);
        // SAFETY: (const float*, float*, unsigned, unsigned) with `n32` and `p` floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(p)) }?;
        let mut launch = stream.launch_builder(&sgd);
        launch.arg(&mut w).arg(&grad).arg(&1e-4f32).arg(&p);
        // SAFETY: (float*, const float*, float, unsigned) with `p` floats in both.
        unsafe { launch.launch(LaunchConfig::for_num_elems(p)) }?;
        if step % 10 == 9 {
            crate::report(&format!("w after step {step}"), &stream.clone_dtoh(&w)?);
        }
    }
    Ok(())
}
