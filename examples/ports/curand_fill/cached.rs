//! cuRAND: uniform, normal and log-normal fills from one seeded generator, re-seeded to show
//! that the same seed gives the same numbers, and a fill of a sub-range through a view.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::curand::CudaRng;
use cudarc::driver::CudaContext;

const N: usize = 1 << 16;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
    let mut rng = CudaRng::new(20_240_613, stream.clone())?;

    let mut uniform = alloc.alloc_zeros::<f32>(&stream, N)?;
    rng.fill_with_uniform(&mut uniform)?;
    crate::report("uniform", &stream.clone_dtoh(&uniform)?);

    let mut normal = alloc.alloc_zeros::<f64>(&stream, N)?;
    rng.fill_with_normal(&mut normal, 1.5, 0.25)?;
    crate::report("normal", &stream.clone_dtoh(&normal)?);

    let mut log_normal = alloc.alloc_zeros::<f32>(&stream, N)?;
    rng.fill_with_log_normal(&mut log_normal, 0.0, 0.5)?;
    crate::report("log_normal", &stream.clone_dtoh(&log_normal)?);

    rng.set_seed(20_240_613)?;
    rng.set_offset(0)?;
    let mut again = alloc.alloc_zeros::<f32>(&stream, N)?;
    rng.fill_with_uniform(&mut again)?;
    let same = stream.clone_dtoh(&again)? == stream.clone_dtoh(&uniform)?;
    println!("re-seeded uniform equal: {same}");

    let mut part = alloc.alloc_zeros::<u32>(&stream, N)?;
    rng.fill_with_uniform(&mut part.slice_mut(N / 4..N / 2))?;
    crate::report("uniform_u32_view", &stream.clone_dtoh(&part)?);
    Ok(())
}
