//! Zeroed and uninitialised buffers: `alloc_zeros` of several element types, `alloc` filled by a
//! copy, `memset_zeros` of a whole buffer and of a range, and the empty buffer `null`.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use cudarc::driver::{CudaContext, DriverError};

const N: usize = 5000;

pub(crate) fn main() -> Result<(), DriverError> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;

    let zeros_f64 = alloc.alloc_zeros::<f64>(&stream, N)?;
    let zeros_u8 = alloc.alloc_zeros::<u8>(&stream, N + 3)?;
    crate::report("zeros_f64", &stream.clone_dtoh(&zeros_f64)?);
    crate::report("zeros_u8", &stream.clone_dtoh(&zeros_u8)?);

    // SAFETY: every element is written by the copy below before it is read.
    let mut filled = unsafe { alloc.alloc::<u32>(&stream, N) }?;
    let host: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    stream.memcpy_htod(&host, &mut filled)?;
    crate::report("alloc_then_copy", &stream.clone_dtoh(&filled)?);
    stream.memset_zeros(&mut filled.slice_mut(N / 3..2 * N / 3))?;
    crate::report("range_zeroed", &stream.clone_dtoh(&filled)?);
    stream.memset_zeros(&mut filled)?;
    crate::report("all_zeroed", &stream.clone_dtoh(&filled)?);

    let empty = alloc.null::<f32>(&stream)?;
    println!("null: len {} empty {}", empty.len(), empty.is_empty());
    let empty_zeros = alloc.alloc_zeros::<i32>(&stream, 0)?;
    println!("alloc_zeros(0): len {}", empty_zeros.len());
    Ok(())
}
