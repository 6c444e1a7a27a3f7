//! Views: sub-ranges with `slice` / `slice_mut`, halves with `split_at` / `split_at_mut`,
//! `chunks_exact` over a view, and `transmute` to read the same bytes as another type; kernels
//! and copies take the views as they take whole buffers.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void add(const float* a, const float* b, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void negate(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = -x[i];
}
"#;

const N: usize = 4096;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let add = module.load_function("add")?;
    let negate = module.load_function("negate")?;

    let host: Vec<f32> = (0..N).map(|i| (i % 100) as f32 * 0.5).collect();
    let mut data = alloc.clone_htod(&stream, &host)?;
    let mut sums = alloc.alloc_zeros::<f32>(&stream, N / 2)?;

    let half = (N / 2) as u32;
    let (left, right) = data.split_at(N / 2);
    let mut launch = stream.launch_builder(&add);
    launch.arg(&left).arg(&right).arg(&mut sums).arg(&half);
    // SAFETY: (const float*, const float*, float*, unsigned): three ranges of `half` floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(half)) }?;
    crate::report("split_at_sum", &stream.clone_dtoh(&sums)?);

    let quarter = (N / 4) as u32;
    let mut tail = data.slice_mut(3 * N / 4..);
    let mut launch = stream.launch_builder(&negate);
    launch.arg(&mut tail).arg(&quarter);
    // SAFETY: (float*, unsigned) with `quarter` floats in the view.
    unsafe { launch.launch(LaunchConfig::for_num_elems(quarter)) }?;
    crate::report("slice_mut_negated", &stream.clone_dtoh(&data)?);

    let (mut lo, mut hi) = sums.split_at_mut(N / 4);
    stream.memcpy_dtod(&data.slice(..N / 4), &mut lo)?;
    stream.memset_zeros(&mut hi)?;
    let middle = lo.slice(N / 8..N / 4);
    crate::report("split_at_mut_middle", &stream.clone_dtoh(&middle)?);
    crate::report("split_at_mut", &stream.clone_dtoh(&sums)?);

    let whole = data.slice(..);
    for (k, chunk) in whole.chunks_exact(N / 8).enumerate() {
        crate::report(&format!("chunk {k}"), &stream.clone_dtoh(&chunk)?);
    }
    let (first, _) = whole.split_at(16);
    crate::report("view_split_at", &stream.clone_dtoh(&first.slice(4..12))?);

    // SAFETY: every bit pattern is a valid u32, and N f32 are N u32.
    let bits = unsafe { data.transmute::<u32>(N) }.ok_or("transmute to u32")?;
    crate::report("transmute_u32", &stream.clone_dtoh(&bits)?);
    // SAFETY: as above, for the first N / 2 values as bytes.
    let bytes = unsafe { data.transmute::<u8>(2 * N) }.ok_or("transmute to u8")?;
    crate::report("transmute_u8", &stream.clone_dtoh(&bytes)?);
    println!(
        "try_slice past the end: {}",
        data.try_slice(N - 1..N + 1).is_none()
    );
    Ok(())
}
