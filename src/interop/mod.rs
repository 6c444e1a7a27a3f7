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
//! Streams work as in cudarc: a buffer belongs to the stream it was allocated on and is reused in
//! that stream's order; while the context manages stream synchronization (more than one stream,
//! event tracking on), every use through cudarc waits for conflicting uses on other streams and
//! records cudarc's read/write events, and a dropped buffer's memory is reused only after every
//! stream's last use of it. The events stay with the block's address and are reused by the next
//! buffer there: a cache hit creates no CUDA event, and a single-stream program makes none. See
//! [`CachedSlice`] and `docs/streams-and-graphs.md`.
//!
//! Together with `backend/cuda.rs`, this module is the only code that names `cudarc`. May use:
//! the core (`CachingAllocator`), `backend::cuda`, `config`, `error`, `stats`.

mod allocator;
mod capture;
mod events;
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
