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
//! * [`PinnedAllocator`] and [`CachedPinned<T>`]: cached page-locked host buffers (the
//!   [`host`](crate::host) cache over `CudaHost`) that cudarc's `memcpy_htod`, `memcpy_dtoh` and
//!   `clone_htod` take as a `HostSlice`, with cudarc's event rules; a dropped buffer's memory is
//!   reused only after its last copy. [`CudaAllocator::alloc_pinned`] uses one per allocator.
//! * [`raw`]: allocate and free by device ordinal and raw stream handle, for C callers and
//!   PyTorch (the `python/` package's native library wraps it: `docs/pytorch.md`).
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
mod ipc;
mod pinned;
pub mod raw;
mod registry;
mod slice;
mod view;

pub use allocator::CudaAllocator;
pub use capture::{CapturedGraph, GraphPool};
#[doc(hidden)]
pub use events::fail_next_event_shells;
pub use ipc::ExportedPages;
pub use pinned::{CachedPinned, DEFAULT_PENDING_WAITS, PinnedAllocator};
pub use registry::AllocatorRegistry;
pub use slice::CachedSlice;
pub use view::{CachedView, CachedViewMut};

use crate::{AllocError, BackendError};

/// A cudarc driver error as an [`AllocError`] (out of memory stays out of memory).
fn driver_error(operation: &'static str, e: cudarc::driver::DriverError) -> AllocError {
    AllocError::Backend {
        operation,
        source: crate::backend::cuda::driver(operation, e),
    }
}

/// An allocator error as cudarc's `DriverError`, so that `?` on the allocator's calls works in
/// functions that return `Result<_, DriverError>` (as cudarc programs' `main` often does). The
/// `CUresult` is the driver's own code when the error came from the driver, and otherwise the
/// closest one:
///
/// | `AllocError` | `CUresult` |
/// | --- | --- |
/// | `OutOfMemory`, `TooLarge`, `CaptureOutOfMemory`, a backend out-of-memory | `CUDA_ERROR_OUT_OF_MEMORY` |
/// | `Backend` carrying a driver error | that error's code |
/// | `InvalidStream` | `CUDA_ERROR_INVALID_HANDLE` |
/// | `DoubleFree`, `FreedPointer`, `InteriorPointer`, `UnknownPointer`, `InvalidFraction`, `Config`, `InvalidPool`, `Backend` with an invalid argument | `CUDA_ERROR_INVALID_VALUE` |
/// | `Unsupported`, `Backend` with an unsupported capability | `CUDA_ERROR_NOT_SUPPORTED` |
/// | `CaptureUnderway`, `UnroutedCapture` | `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` |
/// | anything else (an injected fault, a backend error without a code) | `CUDA_ERROR_UNKNOWN` |
///
/// The conversion keeps only the code: the out-of-memory report and the message are lost, so log
/// or inspect the `AllocError` first where they matter.
impl From<AllocError> for cudarc::driver::DriverError {
    fn from(e: AllocError) -> Self {
        cudarc::driver::DriverError(result_code(&e))
    }
}

/// A pinned-cache error as cudarc's `DriverError` (only the code survives, as for
/// `AllocError`): a cap or out-of-memory is `CUDA_ERROR_OUT_OF_MEMORY`, a bad request or
/// configuration or an unknown block `CUDA_ERROR_INVALID_VALUE`, a backend or fence error its
/// driver code (`CUDA_ERROR_UNKNOWN` when it has none), an allocator error (host pages) as the
/// table above.
impl From<crate::host::PinnedError> for cudarc::driver::DriverError {
    fn from(e: crate::host::PinnedError) -> Self {
        use crate::host::PinnedError as P;
        use cudarc::driver::sys::CUresult as R;
        cudarc::driver::DriverError(match &e {
            P::CapExceeded { .. } => R::CUDA_ERROR_OUT_OF_MEMORY,
            P::InvalidRequest(_) | P::InvalidConfig(_) | P::UnknownBlock { .. } => {
                R::CUDA_ERROR_INVALID_VALUE
            }
            P::Fence { source, .. } | P::Backend(source) => backend_code(source),
            P::Allocator(a) => result_code(a),
        })
    }
}

/// The `CUresult` that stands for a backend error.
fn backend_code(source: &BackendError) -> cudarc::driver::sys::CUresult {
    use cudarc::driver::sys::CUresult as R;
    match source {
        BackendError::OutOfMemory => R::CUDA_ERROR_OUT_OF_MEMORY,
        BackendError::InvalidStream { .. } => R::CUDA_ERROR_INVALID_HANDLE,
        BackendError::InvalidArgument { .. } => R::CUDA_ERROR_INVALID_VALUE,
        BackendError::Unsupported(_) => R::CUDA_ERROR_NOT_SUPPORTED,
        BackendError::NoDriver => R::CUDA_ERROR_NO_DEVICE,
        BackendError::Driver { source, .. } => source
            .downcast_ref::<cudarc::driver::DriverError>()
            .map_or(R::CUDA_ERROR_UNKNOWN, |d| d.0),
        _ => R::CUDA_ERROR_UNKNOWN,
    }
}

/// The `CUresult` that stands for `e` (see `From<AllocError> for DriverError`).
fn result_code(e: &AllocError) -> cudarc::driver::sys::CUresult {
    use cudarc::driver::sys::CUresult as R;
    match e {
        AllocError::OutOfMemory(_)
        | AllocError::TooLarge { .. }
        | AllocError::CaptureOutOfMemory { .. } => R::CUDA_ERROR_OUT_OF_MEMORY,
        AllocError::InvalidStream { .. } => R::CUDA_ERROR_INVALID_HANDLE,
        AllocError::DoubleFree { .. }
        | AllocError::FreedPointer { .. }
        | AllocError::InteriorPointer { .. }
        | AllocError::UnknownPointer { .. }
        | AllocError::InvalidFraction(_)
        | AllocError::Config(_)
        | AllocError::InvalidPool { .. }
        | AllocError::NotShareable { .. } => R::CUDA_ERROR_INVALID_VALUE,
        AllocError::Unsupported { .. } => R::CUDA_ERROR_NOT_SUPPORTED,
        AllocError::CaptureUnderway { .. } | AllocError::UnroutedCapture { .. } => {
            R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        }
        AllocError::Backend { source, .. } => backend_code(source),
    }
}
