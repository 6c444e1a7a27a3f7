//! Interop with cudarc and with C: cached device memory that existing cudarc code accepts
//! unchanged, one allocator per device, and a raw-pointer API for FFI.
//!
//! * [`CudaAllocator`]: a cheap-to-clone handle to a [`CachingAllocator`](crate::CachingAllocator)
//!   over a [`CudaDevice`](crate::backend::cuda::CudaDevice), made from a cudarc `CudaContext` or
//!   taken from the per-device [`AllocatorRegistry`].
//! * [`CachedSlice<T>`]: an owned typed buffer that returns to the cache when dropped. It
//!   implements cudarc's `DeviceSlice`, `DevicePtr` and `DevicePtrMut` and can be pushed as a
//!   kernel argument (`&buf` and `&mut buf`), so `memcpy_*`, `memset_zeros`, kernel launches and
//!   cuBLAS take it where they took a `CudaSlice`. [`CachedView`] and [`CachedViewMut`] are its
//!   sub-ranges.
//! * [`raw`]: allocate and free by device ordinal and raw stream handle, for C callers and
//!   PyTorch's pluggable-allocator interface (see `examples/torch_plugin.rs`).
//!
//! Streams work as in PyTorch: a buffer belongs to the stream it was allocated on and is reused
//! in that stream's order without synchronization. Before a buffer is used on another stream,
//! call [`CachedSlice::record_stream`] with that stream, or the cache may hand the memory to a
//! new owner while the other stream still uses it. No CUDA event is created per allocation.
//!
//! Together with `backend/cuda.rs`, this module is the only code that names `cudarc`. May use:
//! the core (`CachingAllocator`), `backend::cuda`, `config`, `error`, `stats`.

mod allocator;
mod capture;
pub mod raw;
mod registry;
mod slice;
mod view;

pub use allocator::CudaAllocator;
pub use capture::{CapturedGraph, GraphPool};
pub use registry::AllocatorRegistry;
pub use slice::CachedSlice;
pub use view::{CachedView, CachedViewMut};

use crate::{AllocError, BackendError};

/// A cudarc driver error as an [`AllocError`] (out of memory stays out of memory).
fn driver_error(operation: &'static str, e: cudarc::driver::DriverError) -> AllocError {
    let source = if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::OutOfMemory
    } else {
        BackendError::Driver {
            operation,
            source: Box::new(e),
        }
    };
    AllocError::Backend { operation, source }
}
