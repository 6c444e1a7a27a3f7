//! CUDA graphs with allocations inside the capture: the captured work allocates, uses and
//! frees two temporaries, and the graph is replayed on new input. cudarc records them as the
//! graph's own stream-ordered allocations; the cached version gives the capture a private pool
//! (`capture_pool`), as PyTorch does, so replays reuse the graph's memory. Event tracking is off,
//! as in cudarc's capture tests.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void add(const float* a, const float* b, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void times(const float* a, float k, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = k * a[i];
}
"#;

const N: usize = 1 << 16;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    // SAFETY: set before any buffer of this context object exists; the program orders its one
    // stream itself.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let add = module.load_function("add")?;
    let times = module.load_function("times")?;

    let mut x = alloc.alloc_zeros::<f32>(&stream, N)?;
    let mut out = alloc.alloc_zeros::<f32>(&stream, N)?;
    stream.synchronize()?;

    let n = N as u32;
    let cfg = LaunchConfig::for_num_elems(n);
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
    let pool = alloc.capture_pool(&stream)?;
    {
        let mut doubled = alloc.alloc_zeros::<f32>(&stream, N)?;
        let mut launch = stream.launch_builder(&times);
        launch.arg(&x).arg(&2.0f32).arg(&mut doubled).arg(&n);
        // SAFETY: (const float*, float, float*, unsigned) with `n` floats in both buffers.
        unsafe { launch.launch(cfg) }?;
        let mut sum = alloc.alloc_zeros::<f32>(&stream, N)?;
        let mut launch = stream.launch_builder(&add);
        launch.arg(&doubled).arg(&x).arg(&mut sum).arg(&n);
        // SAFETY: (const float*, const float*, float*, unsigned) with `n` floats in each.
        unsafe { launch.launch(cfg) }?;
        drop(doubled);
        let mut launch = stream.launch_builder(&add);
        launch.arg(&sum).arg(&sum).arg(&mut out).arg(&n);
        // SAFETY: as above.
        unsafe { launch.launch(cfg) }?;
    }
    let graph = pool
        .end_capture(&stream, CUgraphInstantiate_flags(0))?
        .ok_or("the capture recorded no work")?;

    for replay in 0..5u32 {
        let input: Vec<f32> = (0..N)
            .map(|i| ((i as u32 * 7 + replay) % 10) as f32)
            .collect();
        stream.memcpy_htod(&input, &mut x)?;
        graph.launch()?;
        crate::report(&format!("replay {replay}"), &stream.clone_dtoh(&out)?);
    }
    Ok(())
}
