//! Host round trips: `memcpy_dtoh` into an existing `Vec` and array, `Vec::try_from` consuming a
//! buffer, `clone_dtoh` of a view, and the buffer's `ordinal`, `context` and `stream`.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::CudaContext;

const N: usize = 777;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;

    let host: Vec<f64> = (0..N).map(|i| (i as f64).sqrt()).collect();
    let buf = alloc.clone_htod(&stream, &host)?;
    let mut into_vec = vec![0.0f64; N];
    stream.memcpy_dtoh(&buf, &mut into_vec)?;
    crate::report("memcpy_dtoh_vec", &into_vec);
    let mut into_array = [0.0f64; 16];
    stream.memcpy_dtoh(&buf.slice(100..116), &mut into_array)?;
    crate::report("memcpy_dtoh_array", &into_array);
    crate::report("clone_dtoh_view", &stream.clone_dtoh(&buf.slice(N - 10..))?);

    println!(
        "ordinal {} same context {} same stream {}",
        buf.ordinal(),
        buf.context().cu_ctx() == ctx.cu_ctx(),
        buf.stream().cu_stream() == stream.cu_stream()
    );
    let owned: Vec<f64> = Vec::try_from(buf)?;
    crate::report("vec_try_from", &owned);

    let ints = alloc.clone_htod(&stream, &(0..N as u64).map(|i| i * i).collect::<Vec<_>>())?;
    crate::report("u64", &Vec::try_from(ints)?);
    Ok(())
}
