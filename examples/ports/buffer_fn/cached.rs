//! Library functions that only take buffers (generic over cudarc's `DevicePtr` /
//! `DevicePtrMut`, the way cudarc's own copy, launch and cuBLAS functions are written): they
//! need no change at all, and only `main`'s allocations differ between the two versions.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void axpby(float a, const float* x, float b, const float* y, float* out,
                                 unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + b * y[i];
}
"#;

/// `out = a * x + b * y` on `stream`.
fn axpby<X: DevicePtr<f32>, Y: DevicePtr<f32>, O: DevicePtrMut<f32>>(
    stream: &Arc<CudaStream>,
    kernel: &CudaFunction,
    a: f32,
    x: &X,
    b: f32,
    y: &Y,
    out: &mut O,
) -> Result<(), DriverError> {
    let n = out.len() as u32;
    assert!(x.len() >= out.len() && y.len() >= out.len());
    let (xp, _x_done) = x.device_ptr(stream);
    let (yp, _y_done) = y.device_ptr(stream);
    let (op, _out_done) = out.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(kernel);
    launch.arg(&a).arg(&xp).arg(&b).arg(&yp).arg(&op).arg(&n);
    // SAFETY: the kernel takes (float, const float*, float, const float*, float*, unsigned),
    // and the pointers cover `n` floats each (checked above); the guards keep cudarc's events.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    Ok(())
}

/// Zeroes `dst`, then copies `src` into its front (`src` must not be longer).
fn copy_and_pad<S: DevicePtr<f32>, D: DevicePtrMut<f32>>(
    stream: &Arc<CudaStream>,
    src: &S,
    dst: &mut D,
) -> Result<(), DriverError> {
    assert!(src.len() <= dst.len());
    stream.memset_zeros(dst)?;
    stream.memcpy_dtod(src, dst)
}

/// The buffer's contents on the host.
fn download<S: DevicePtr<f32>>(stream: &Arc<CudaStream>, src: &S) -> Result<Vec<f32>, DriverError> {
    stream.clone_dtoh(src)
}

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let kernel = module.load_function("axpby")?;

    let x_host: Vec<f32> = (0..2048).map(|i| (i % 10) as f32).collect();
    let y_host: Vec<f32> = (0..2048).map(|i| (i % 3) as f32).collect();
    let x = alloc.clone_htod(&stream, &x_host)?;
    let y = alloc.clone_htod(&stream, &y_host)?;
    let mut out = alloc.alloc_zeros::<f32>(&stream, 2048)?;
    axpby(&stream, &kernel, 2.0, &x, -1.0, &y, &mut out)?;
    crate::report("axpby", &download(&stream, &out)?);

    let mut padded = alloc.alloc_zeros::<f32>(&stream, 3000)?;
    copy_and_pad(&stream, &out, &mut padded)?;
    crate::report("copy_and_pad", &download(&stream, &padded)?);

    let (lo, hi) = x.split_at(1024);
    let mut half = alloc.alloc_zeros::<f32>(&stream, 1024)?;
    axpby(&stream, &kernel, 1.0, &lo, 1.0, &hi, &mut half)?;
    crate::report("axpby_views", &download(&stream, &half.slice(..512))?);
    Ok(())
}
