//! `CudaHost`: the pinned host backend on CUDA (feature `cuda`).
//!
//! Slabs come from `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE` (pinned for every context,
//! so one cache can serve copies on any device) and go back with `cuMemFreeHost`. The other way,
//! `cuMemHostRegister` over memory touched by several threads first, pins about ten times faster
//! per GiB on the H100 host (49 ms vs 535 ms, page touching dominating) but needs the touch
//! threads and an allocator for the pages; it is not implemented — `docs/pinned.md` says what to
//! measure before choosing it. Pin and unpin times are measured here with a monotonic clock and
//! reported to the cache. Events come from the lent [`CudaDevice`]. May use: `host`, `backend`,
//! cudarc.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::backend::BackendError;
use crate::backend::cuda::{CudaDevice, driver};

use super::{HostBackend, HostPtr, Pinned};

/// `cuMemHostAlloc` returns page-aligned memory.
const HOST_PAGE: usize = 4096;

fn nanos_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Pinned host memory from `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)`, events from a
/// [`CudaDevice`].
#[derive(Debug)]
pub struct CudaHost {
    device: Arc<CudaDevice>,
}

impl CudaHost {
    /// A host backend whose events come from `device` (whose context is made current for the
    /// driver calls).
    pub fn new(device: Arc<CudaDevice>) -> Self {
        CudaHost { device }
    }
}

// SAFETY: `cuMemHostAlloc` returns a fresh, non-null, page-aligned (4096, a multiple of every
// alignment this backend reports) range of `size` bytes, disjoint from every other live host
// allocation and valid page-locked memory, usable by async copies of every context (PORTABLE),
// until `cuMemFreeHost`.
unsafe impl HostBackend for CudaHost {
    type Device = Arc<CudaDevice>;

    fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    fn alignment(&self) -> usize {
        HOST_PAGE
    }

    fn pin(&self, size: usize) -> Result<Pinned, BackendError> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let t = Instant::now();
        // SAFETY: `cuMemHostAlloc` with a valid out-pointer (cudarc's) and flags; the context is
        // current on this thread.
        let ptr = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| driver("cuMemHostAlloc", e))?;
        let nanos = nanos_since(t);
        if ptr.is_null() {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemHostAlloc",
                reason: "the driver returned a null pointer".into(),
            });
        }
        Ok(Pinned {
            ptr: HostPtr(ptr as usize),
            nanos,
        })
    }

    unsafe fn unpin(&self, ptr: HostPtr, _size: usize) -> Result<u64, BackendError> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let t = Instant::now();
        // SAFETY: the caller's obligations: `ptr` came from one `cuMemHostAlloc` above, not yet
        // freed, and no queued work still uses it.
        unsafe { result::free_host(ptr.0 as *mut std::ffi::c_void) }
            .map_err(|e| driver("cuMemFreeHost", e))?;
        Ok(nanos_since(t))
    }
}
