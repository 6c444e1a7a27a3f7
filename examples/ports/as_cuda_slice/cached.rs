//! Code written against cudarc's concrete types: a library function taking `&CudaSlice<f32>`,
//! one taking a `CudaView` by value, and one taking a `CudaViewMut`, called on a second stream
//! right after the first stream wrote the buffer, so that cudarc's events must order the two.
//! The cached version hands them the buffer through `as_cuda_slice` / `as_cuda_view` /
//! `as_cuda_view_mut`.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void ramp(float* x, float start, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = start;
        for (int k = 0; k < 100; k++) v += 0.01f;
        x[i] = v + (float)(i % 64);
    }
}
"#;

/// A third-party function that takes cudarc's own buffer type: its sum of squares, on `stream`.
fn sum_of_squares(stream: &Arc<CudaStream>, x: &CudaSlice<f32>) -> Result<f64, DriverError> {
    let host = stream.clone_dtoh(x)?;
    Ok(host.iter().map(|&v| f64::from(v) * f64::from(v)).sum())
}

/// A third-party function that takes a `CudaView` by value: its maximum, on `stream`.
fn max_of(stream: &Arc<CudaStream>, view: CudaView<'_, f32>) -> Result<f32, DriverError> {
    let host = stream.clone_dtoh(&view)?;
    Ok(host.iter().copied().fold(f32::MIN, f32::max))
}

/// A third-party function that writes through a `CudaViewMut`, on `stream`.
fn write_ones(stream: &Arc<CudaStream>, mut view: CudaViewMut<'_, f32>) -> Result<(), DriverError> {
    let ones = vec![1.0f32; view.len()];
    stream.memcpy_htod(&ones, &mut view)
}

const N: usize = 1 << 20;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let first = ctx.default_stream();
    let second = first.fork()?;
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&first)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let ramp: CudaFunction = module.load_function("ramp")?;

    let mut x = alloc.alloc_zeros::<f32>(&first, N)?;
    let n = N as u32;
    let mut launch = first.launch_builder(&ramp);
    launch.arg(&mut x).arg(&2.0f32).arg(&n);
    // SAFETY: (float*, float, unsigned) with `n` floats in `x`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;

    let squares = sum_of_squares(&second, x.as_cuda_slice())?;
    println!("sum of squares: {squares}");
    println!("max: {}", max_of(&second, x.as_cuda_view())?);
    write_ones(&second, x.as_cuda_view_mut())?;
    let mut launch = first.launch_builder(&ramp);
    launch.arg(&mut x).arg(&-1.0f32).arg(&n);
    // SAFETY: as above.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    crate::report("after_both_streams", &first.clone_dtoh(&x)?);
    Ok(())
}
