//! Pinned host memory (cudarc's own `PinnedHostSlice`): an upload from pinned memory, a kernel,
//! a download into pinned memory, and a pinned buffer reused for a second upload while the first
//! copy's event keeps the order.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void triple(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 3.0f * x[i];
}
"#;

const N: usize = 1 << 18;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let triple = module.load_function("triple")?;

    // SAFETY: every element is written below before the buffer is read.
    let mut pinned = unsafe { ctx.alloc_pinned::<f32>(N) }?;
    for (i, v) in pinned.as_mut_slice()?.iter_mut().enumerate() {
        *v = (i % 1000) as f32;
    }
    let mut dev = alloc.clone_htod(&stream, &pinned)?;
    // cudarc records the pinned buffer's event only in multi-stream mode (its
    // `is_managing_stream_synchronization`): with one stream, `as_mut_slice` does not wait for
    // the upload above, so the program waits for it before rewriting the buffer.
    stream.synchronize()?;
    for v in pinned.as_mut_slice()?.iter_mut() {
        *v = -1.0;
    }
    let n = N as u32;
    let mut launch = stream.launch_builder(&triple);
    launch.arg(&mut dev).arg(&n);
    // SAFETY: (float*, unsigned) with `n` floats in `dev`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;

    // SAFETY: written by the copy below before it is read.
    let mut back = unsafe { ctx.alloc_pinned::<f32>(N) }?;
    stream.memcpy_dtoh(&dev, &mut back)?;
    // The same rule: `as_slice` does not wait for the download in a one-stream program.
    stream.synchronize()?;
    crate::report("pinned_roundtrip", back.as_slice()?);

    let second = alloc.clone_htod(&stream, &pinned)?;
    crate::report("second_upload", &stream.clone_dtoh(&second)?);

    let mut part = alloc.alloc_zeros::<f32>(&stream, N / 2)?;
    stream.memcpy_htod(&back.as_slice()?[..N / 2], &mut part)?;
    crate::report("htod_from_pinned_slice", &stream.clone_dtoh(&part)?);
    Ok(())
}
