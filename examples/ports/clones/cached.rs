//! Copies that make new buffers: `clone_htod` from a `Vec` and an array, `clone_dtod` of a
//! buffer and of a view, `try_clone` and `clone`, and `clone_dtoh`; each copy is then changed
//! on its own to show that it owns its memory.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use cudarc::driver::{CudaContext, DriverError};

const N: usize = 3000;

pub(crate) fn main() -> Result<(), DriverError> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;

    let host: Vec<i32> = (0..N as i32).map(|i| i * 3 - 500).collect();
    let original = alloc.clone_htod(&stream, &host)?;
    let small = alloc.clone_htod(&stream, &[7u8, 1, 2, 9])?;
    let mut dtod = alloc.clone_dtod(&stream, &original)?;
    let window = alloc.clone_dtod(&stream, &original.slice(100..164))?;
    let mut tried = original.try_clone()?;
    let cloned = tried.clone();

    stream.memset_zeros(&mut dtod.slice_mut(..N / 2))?;
    stream.memcpy_htod(&[-1i32; 10], &mut tried.slice_mut(5..15))?;

    crate::report("original", &stream.clone_dtoh(&original)?);
    crate::report("small", &stream.clone_dtoh(&small)?);
    crate::report("clone_dtod_half_zeroed", &stream.clone_dtoh(&dtod)?);
    crate::report("clone_dtod_window", &stream.clone_dtoh(&window)?);
    crate::report("try_clone_patched", &stream.clone_dtoh(&tried)?);
    crate::report("clone_of_clone", &stream.clone_dtoh(&cloned)?);
    println!(
        "lengths: {} {} {}",
        original.len(),
        window.len(),
        small.len()
    );
    Ok(())
}
