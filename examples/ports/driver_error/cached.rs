//! cudarc's error style: `fn main() -> Result<(), DriverError>` with `?` on every call, a helper
//! that returns `DriverError`, an allocation larger than the device that fails with
//! `CUDA_ERROR_OUT_OF_MEMORY` and is handled, and `try_slice` / `try_split_at` out of range.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};

/// A buffer of `bytes` bytes, written once, or the driver's error.
fn try_buffer(stream: &Arc<CudaStream>, bytes: usize) -> Result<Vec<u8>, DriverError> {
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(stream)?;
    let mut buf = alloc.alloc_zeros::<u8>(stream, bytes)?;
    stream.memcpy_htod(&[1u8, 2, 3, 4], &mut buf.slice_mut(..4))?;
    let head = stream.clone_dtoh(&buf.slice(..8))?;
    Ok(head)
}

pub(crate) fn main() -> Result<(), DriverError> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;

    println!("small buffer: {:?}", try_buffer(&stream, 1 << 20)?);
    let too_big = ctx.total_mem()? * 2;
    match try_buffer(&stream, too_big) {
        Ok(_) => println!("twice the device memory: allocated?"),
        Err(DriverError(code)) => println!("twice the device memory: {code:?}"),
    }
    // The failure leaves the device usable.
    println!("after the failure: {:?}", try_buffer(&stream, 4096)?);

    let data = alloc.clone_htod(&stream, &[5.0f32; 100])?;
    println!("try_slice(90..110): {}", data.try_slice(90..110).is_some());
    println!("try_slice(90..100): {}", data.try_slice(90..100).is_some());
    println!("try_split_at(101): {}", data.try_split_at(101).is_some());
    let summed: f32 = stream.clone_dtoh(&data)?.iter().sum();
    println!("sum: {summed}");
    Ok(())
}
