//! CUDA graphs: buffers allocated before the capture, two kernels and a copy captured on one
//! stream, the graph replayed ten times with fresh input each time. As in cudarc's own capture
//! tests, event tracking is off (every use is on the capturing stream, and the driver refuses
//! waits on events recorded outside a capture).
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void scale_add(const float* x, float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void square(float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] * y[i];
}
"#;

const N: usize = 1 << 14;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    // SAFETY: set before any buffer of this context object exists; the program orders its one
    // stream itself.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let scale_add = module.load_function("scale_add")?;
    let square = module.load_function("square")?;

    let mut x = alloc.alloc_zeros::<f32>(&stream, N)?;
    let mut y = alloc.alloc_zeros::<f32>(&stream, N)?;
    let mut snapshot = alloc.alloc_zeros::<f32>(&stream, N)?;
    stream.synchronize()?;

    let n = N as u32;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut launch = stream.launch_builder(&scale_add);
    launch.arg(&x).arg(&mut y).arg(&0.5f32).arg(&n);
    // SAFETY: (const float*, float*, float, unsigned) with `n` floats in both buffers.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    let mut launch = stream.launch_builder(&square);
    launch.arg(&mut y).arg(&n);
    // SAFETY: (float*, unsigned) with `n` floats in `y`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    stream.memcpy_dtod(&y, &mut snapshot)?;
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))?
        .ok_or("the capture recorded no work")?;

    for replay in 0..10u32 {
        let input: Vec<f32> = (0..N).map(|i| ((i as u32 + replay) % 8) as f32).collect();
        stream.memcpy_htod(&input, &mut x)?;
        stream.memset_zeros(&mut y)?;
        graph.launch()?;
    }
    crate::report("after_replays", &stream.clone_dtoh(&snapshot)?);
    crate::report("y", &stream.clone_dtoh(&y)?);
    Ok(())
}
