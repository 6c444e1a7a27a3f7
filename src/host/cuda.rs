//! `CudaHost`: the pinned host backend on CUDA (feature `cuda`).
//!
//! Two ways to pin a slab, chosen per slab by [`PinMethod`]:
//!
//! * `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)` (pinned for every context, so one cache can serve
//!   copies on any device), freed with `cuMemFreeHost`;
//! * `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)` over fresh anonymous memory (`mmap`, 2 MiB
//!   aligned, transparent huge pages asked for with `madvise`) that several threads touched
//!   first, unregistered with `cuMemHostUnregister` and unmapped. Measured on the H100 host
//!   (`gpu/probes/pin_register.cu`, `docs/pinned.md`): 3.4 ms against 33.7 ms for 64 MiB and 58 ms
//!   against 489 ms for 1 GiB, unpinning 1.6 ms against 10.2 ms and 21 ms against 103 ms, copies
//!   at the same bandwidth; from 4 to 32 MiB 1.8–6.7 × faster in a second run; at 2 MiB not
//!   settled (no faster in one run, copies from it slower in another).
//!
//! The default registers slabs of 4 MiB and more and allocates smaller ones (and a slab whose
//! registration fails for another reason than memory: out of memory is the cache's to handle).
//! A device that says it cannot register host memory
//! (`CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` = 0) allocates every slab, and so does a host
//! once the driver refused a registration as not supported or not permitted, without mapping
//! and touching memory it cannot pin. Pin and unpin
//! times are measured here with a monotonic clock and reported to the cache. Events come from the
//! lent [`CudaDevice`]. May use: `host`, `backend`, cudarc, libc.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cudarc::driver::result;
use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::backend::BackendError;
use crate::backend::cuda::{CudaDevice, RelaxedCaptureMode, driver};
use crate::int_hash::IntMap;

use super::{HostBackend, HostPtr, Pinned};

/// `cuMemHostAlloc` returns page-aligned memory; registered slabs are 2 MiB aligned.
const HOST_PAGE: usize = 4096;

/// Registered slabs start on a 2 MiB boundary (the transparent huge page size on x86-64).
const HUGE_PAGE: usize = 2 << 20;

fn nanos_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// How [`CudaHost`] pins a slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PinMethod {
    /// `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)` for every slab.
    HostAlloc,
    /// `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)` over fresh anonymous memory touched by up
    /// to `touch_threads` threads (one per 8 MiB at most) for slabs of at least `min_size` bytes;
    /// `cuMemHostAlloc` for smaller ones and for a slab whose registration fails for another
    /// reason than memory (out of memory is returned, for the cache to unpin idle slabs and
    /// retry). Every slab is allocated outside Linux, on a device without
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`, and once the driver has refused a registration as not supported or not permitted
    /// ([`CudaHost::registration_refused`]).
    Register {
        /// The smallest slab that is registered rather than allocated.
        min_size: usize,
        /// The most threads that touch a slab's pages before it is registered (at least 1).
        touch_threads: usize,
    },
}

impl Default for PinMethod {
    /// `Register { min_size: 4 MiB, touch_threads: 8 }`: the sizes where registration measured
    /// 1.8–16 × faster than `cuMemHostAlloc` on the H100 host at the same copy bandwidth, with
    /// the thread count measured (2 MiB slabs, where the measurements disagree, keep
    /// `cuMemHostAlloc`).
    fn default() -> Self {
        PinMethod::Register {
            min_size: 4 << 20,
            touch_threads: 8,
        }
    }
}

/// A registered slab's mapping, to undo at unpin: the `mmap` base and length.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    base: usize,
    len: usize,
}

/// Pinned host memory from `cuMemHostAlloc` or `cuMemHostRegister` ([`PinMethod`]), events
/// from a [`CudaDevice`].
#[derive(Debug)]
pub struct CudaHost {
    device: Arc<CudaDevice>,
    method: PinMethod,
    /// Registered slabs by start address (absent: the slab came from `cuMemHostAlloc`).
    registered: Mutex<IntMap<Mapping>>,
    /// The device cannot register host memory, or the host refused a registration for another
    /// reason than memory: every later slab comes from `cuMemHostAlloc` (Note [Registration
    /// refused]).
    refused: AtomicBool,
}

// Note [Registration refused]: a registered slab is mapped, advised and touched page by page
// (several threads faulting in up to the whole slab) before `cuMemHostRegister` is asked. A host
// that cannot register (the device attribute says so, or the driver answers `NOT_SUPPORTED` /
// `NOT_PERMITTED`, as virtualised platforms do) would pay that touch for every slab and then
// throw the memory away. So the attribute is read once when the backend is made, and the first
// such refusal is remembered: later slabs go straight to `cuMemHostAlloc`. Other failures are
// about the one call and are not remembered: out of memory (the cache unpins idle slabs and
// retries, and the next registration may succeed), and an argument the driver rejects (a size
// it would not take once allocated that slab and nothing else, `an_exact_slab_of_a_size_off_the_
// page_is_registered`). The method a caller chose stays what `method` reports; the refusal shows
// in `registration_refused`.

/// Whether `e`, from `cuMemHostRegister`, says that this host does not register memory at all
/// (Note [Registration refused]).
fn refuses_registration(e: &BackendError) -> bool {
    let BackendError::Driver { source, .. } = e else {
        return false;
    };
    source
        .downcast_ref::<result::DriverError>()
        .is_some_and(|d| {
            matches!(
                d.0,
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_NOT_PERMITTED
            )
        })
}

impl CudaHost {
    /// A host backend whose events come from `device` (whose context is made current for the
    /// driver calls), pinning with the default [`PinMethod`].
    pub fn new(device: Arc<CudaDevice>) -> Self {
        Self::with_method(device, PinMethod::default())
    }

    /// A host backend pinning with `method`.
    pub fn with_method(device: Arc<CudaDevice>, method: PinMethod) -> Self {
        // Note [Registration refused]. A failed query leaves registration to be tried.
        let unsupported = matches!(method, PinMethod::Register { .. })
            && device
                .context()
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)
                .is_ok_and(|v| v == 0);
        if unsupported {
            tracing::debug!(target: "cuda_caching_allocator", "the device cannot register host memory; pinned slabs come from cuMemHostAlloc");
        }
        CudaHost {
            device,
            method,
            registered: Mutex::new(IntMap::default()),
            refused: AtomicBool::new(unsupported),
        }
    }

    /// The pin method asked for (see [`registration_refused`](Self::registration_refused) for
    /// whether registration is still tried).
    pub fn method(&self) -> PinMethod {
        self.method
    }

    /// Whether registration is no longer tried: the device cannot register host memory
    /// (`CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` = 0), or the driver refused a registration
    /// as not supported or not permitted. Every slab then comes from `cuMemHostAlloc`.
    pub fn registration_refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Slabs pinned by registration and not yet unpinned.
    pub fn registered_slabs(&self) -> usize {
        self.registered.lock().len()
    }

    /// Makes the device's context current for the driver calls until the guard drops, which
    /// puts the caller's context back (a pin or unpin must not leave the calling thread on
    /// another device: a caller that never made a context current keeps none).
    fn bind(&self) -> Result<impl Drop + use<>, BackendError> {
        self.device.bind()
    }

    fn alloc_host(size: usize) -> Result<HostPtr, BackendError> {
        // SAFETY: `cuMemHostAlloc` with a valid out-pointer (cudarc's) and flags; the caller made
        // the context current on this thread.
        let ptr = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| driver("cuMemHostAlloc", e))?;
        if ptr.is_null() {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemHostAlloc",
                reason: "the driver returned a null pointer".into(),
            });
        }
        Ok(HostPtr(ptr as usize))
    }
}

#[cfg(target_os = "linux")]
mod register {
    //! The `cuMemHostRegister` path: map, advise, touch, register; and its undoing.
    use cudarc::driver::sys;

    use super::{HUGE_PAGE, Mapping};
    use crate::backend::BackendError;
    use crate::backend::cuda::driver;

    /// Maps `size` bytes of fresh anonymous memory starting on a 2 MiB boundary, asks for huge
    /// pages, touches every 4 KiB page with up to `threads` threads (one per 8 MiB at most) and
    /// registers it; returns the registered start and the mapping to undo.
    pub(super) fn pin(size: usize, threads: usize) -> Result<(usize, Mapping), BackendError> {
        let len = size
            .checked_add(HUGE_PAGE)
            .ok_or(BackendError::OutOfMemory)?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no
        // existing memory is touched. The result is checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(BackendError::OutOfMemory);
        }
        let map = Mapping {
            base: base as usize,
            len,
        };
        let start = (map.base + HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
        // SAFETY: `[start, start + size)` lies inside the mapping just made (the mapping has
        // `HUGE_PAGE` bytes of slack for the rounding up). A failed advice only costs huge pages,
        // so its result is ignored.
        unsafe { libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
        touch(start, size, threads);
        // SAFETY: the range is valid, writable host memory of this process, not registered
        // before; PORTABLE makes it usable by every context.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                start as *mut std::ffi::c_void,
                size,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result();
        if let Err(e) = r {
            // SAFETY: the mapping made above, never handed out.
            unsafe { unmap(map) };
            return Err(driver("cuMemHostRegister", e));
        }
        Ok((start, map))
    }

    /// Writes one byte of every 4 KiB page of `[start, start + size)` so that the kernel backs
    /// it now, spread over up to `threads` threads (faulting pages in parallelises; pinning
    /// then finds them present).
    fn touch(start: usize, size: usize, threads: usize) {
        const PAGE: usize = 4096;
        let n = threads.clamp(1, (size / (8 << 20)).max(1));
        let chunk = size.div_ceil(n).div_ceil(PAGE) * PAGE;
        let work = |lo: usize| {
            let hi = (lo + chunk).min(size);
            let mut off = lo;
            while off < hi {
                // SAFETY: `start + off` lies inside the mapping (`off < size`), which nothing
                // else uses yet; each thread writes a disjoint range of pages.
                unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
                off += PAGE;
            }
        };
        if n == 1 {
            work(0);
            return;
        }
        std::thread::scope(|s| {
            for i in 1..n {
                let w = &work;
                // A thread the system refuses (`spawn` would panic): this thread touches that
                // chunk itself.
                if std::thread::Builder::new()
                    .spawn_scoped(s, move || w(i * chunk))
                    .is_err()
                {
                    w(i * chunk);
                }
            }
            work(0);
        });
    }

    /// Unregisters a registered slab.
    ///
    /// # Safety
    /// `start` was registered by [`pin`] and no queued work still uses it.
    pub(super) unsafe fn unregister(start: usize) -> Result<(), BackendError> {
        // SAFETY: the caller's obligations.
        unsafe { sys::cuMemHostUnregister(start as *mut std::ffi::c_void) }
            .result()
            .map_err(|e| driver("cuMemHostUnregister", e))
    }

    /// Unmaps a mapping made by [`pin`].
    ///
    /// # Safety
    /// The mapping is no longer registered and nothing uses it.
    pub(super) unsafe fn unmap(map: Mapping) {
        // SAFETY: the caller's obligations; the range is exactly one mapping made by `pin`. A
        // failure (which would leave address space mapped, never memory in use) is ignored.
        unsafe { libc::munmap(map.base as *mut libc::c_void, map.len) };
    }
}

// SAFETY: `cuMemHostAlloc` returns a fresh, non-null, page-aligned (4096, a multiple of every
// alignment this backend reports) range of `size` bytes, disjoint from every other live host
// allocation and valid page-locked memory, usable by async copies of every context (PORTABLE),
// until `cuMemFreeHost`. A registered slab is a fresh anonymous mapping of this process (disjoint
// from every other), 2 MiB aligned, registered PORTABLE as a whole, and stays mapped and
// registered until `unpin`.
unsafe impl HostBackend for CudaHost {
    type Device = Arc<CudaDevice>;

    fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    fn alignment(&self) -> usize {
        HOST_PAGE
    }

    fn pin(&self, size: usize) -> Result<Pinned, BackendError> {
        let _bound = self.bind()?;
        // Note [Pinning beside a capture]: `cuMemHostRegister` and `cuMemHostAlloc` in the
        // thread's default capture mode fail while another thread captures in global mode (the
        // default of cudarc and PyTorch), and invalidate that capture, as the device backend's
        // allocation calls would (`RelaxedCaptureMode`); relaxed they are legal.
        let _relaxed = RelaxedCaptureMode::enter()?;
        let t = Instant::now();
        match self.method {
            #[cfg(target_os = "linux")]
            PinMethod::Register {
                min_size,
                touch_threads,
            } if size >= min_size && !self.refused.load(Ordering::Relaxed) => {
                match register::pin(size, touch_threads) {
                    Ok((start, map)) => {
                        let nanos = nanos_since(t);
                        self.registered.lock().insert(start as u64, map);
                        Ok(Pinned {
                            ptr: HostPtr(start),
                            nanos,
                        })
                    }
                    // Out of memory stays out of memory (the cache unpins idle slabs and retries);
                    // a host that refuses registration itself (some virtualised or older platforms
                    // do) gets this slab and every later one from `cuMemHostAlloc` (Note
                    // [Registration refused]).
                    Err(BackendError::OutOfMemory) => Err(BackendError::OutOfMemory),
                    Err(e) => {
                        if refuses_registration(&e) {
                            self.refused.store(true, Ordering::Relaxed);
                            tracing::warn!(target: "cuda_caching_allocator", error = %e, size, "cuMemHostRegister refused; this slab and later ones come from cuMemHostAlloc");
                        } else {
                            tracing::debug!(target: "cuda_caching_allocator", error = %e, size, "cuMemHostRegister failed; this slab comes from cuMemHostAlloc");
                        }
                        let ptr = Self::alloc_host(size)?;
                        Ok(Pinned {
                            ptr,
                            nanos: nanos_since(t),
                        })
                    }
                }
            }
            _ => {
                let ptr = Self::alloc_host(size)?;
                Ok(Pinned {
                    ptr,
                    nanos: nanos_since(t),
                })
            }
        }
    }

    unsafe fn unpin(&self, ptr: HostPtr, _size: usize) -> Result<u64, BackendError> {
        let _bound = self.bind()?;
        // Note [Pinning beside a capture]: the same for `cuMemHostUnregister` / `cuMemFreeHost`.
        let _relaxed = RelaxedCaptureMode::enter()?;
        let t = Instant::now();
        let map = self.registered.lock().get(&(ptr.0 as u64)).copied();
        match map {
            #[cfg(target_os = "linux")]
            Some(map) => {
                // SAFETY: the caller's obligations: `ptr` is a live slab of this backend (this
                // one registered by `register::pin`) and no queued work still uses it.
                unsafe { register::unregister(ptr.0) }?;
                self.registered.lock().remove(&(ptr.0 as u64));
                // SAFETY: unregistered just now, and the cache hands out nothing of it any more.
                unsafe { register::unmap(map) };
            }
            #[cfg(not(target_os = "linux"))]
            Some(_) => {
                return Err(BackendError::InvalidArgument {
                    operation: "cuMemHostUnregister",
                    reason: "slabs are registered only on Linux".into(),
                });
            }
            None => {
                // SAFETY: the caller's obligations: `ptr` came from one `cuMemHostAlloc` above,
                // not yet freed, and no queued work still uses it.
                unsafe { result::free_host(ptr.0 as *mut std::ffi::c_void) }
                    .map_err(|e| driver("cuMemFreeHost", e))?;
            }
        }
        Ok(nanos_since(t))
    }
}

#[cfg(test)]
mod tests {
    use cudarc::driver::{DriverError, sys};

    use super::refuses_registration;
    use crate::backend::BackendError;
    use crate::backend::cuda::driver;

    #[test]
    fn only_a_platform_refusal_is_remembered() {
        let refusal = |code| refuses_registration(&driver("cuMemHostRegister", DriverError(code)));
        assert!(refusal(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED));
        assert!(refusal(sys::CUresult::CUDA_ERROR_NOT_PERMITTED));
        // About the one call: memory, or an argument the driver would not take.
        assert!(!refusal(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(!refusal(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert!(!refusal(
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        ));
        assert!(!refuses_registration(&BackendError::OutOfMemory));
        assert!(!refuses_registration(&BackendError::Unsupported("x")));
    }
}
