//! Memory another process shares page by page: [`ImportedPages`] maps the physical handles
//! under one of its allocations, taken as POSIX file descriptors from that process
//! (`pidfd_open` + `pidfd_getfd`, Linux 5.6 or newer) and imported with
//! `cuMemImportFromShareableHandle`, side by side in a fresh address range of this device. This is
//! how PyTorch opens a CUDA IPC handle of an expandable segment (`ExpandableSegment::fromShared`),
//! and how the package opens its own (`CudaDevice::export_handle` is the other side).
//! May use: `backend::cuda`.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use parking_lot::Mutex;

use super::{ContextGuard, CudaDevice, RelaxedCaptureMode, device_location, driver};
use crate::backend::{BackendError, DeviceAddr};

/// Another process's pages, mapped here: `handles.len()` handles of `handle_bytes` bytes each,
/// side by side from [`ptr`](Self::ptr). Dropping it waits for this device's work to finish (the
/// mapping may still be in use by queued kernels, as PyTorch waits before it unmaps), then
/// unmaps, releases the imported handles and frees the address range. The exporting process's
/// memory lives on until both sides have let go of it.
pub struct ImportedPages {
    ctx: Arc<CudaContext>,
    base: u64,
    /// Bytes of address space reserved at `base` (0 once freed).
    reserved: usize,
    /// The device's list of imported ranges, which holds this one while it is mapped.
    listed: Option<Arc<Mutex<HashMap<u64, usize>>>>,
    handle_bytes: usize,
    handles: Vec<u64>,
}

impl std::fmt::Debug for ImportedPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPages")
            .field("ptr", &DeviceAddr(self.base))
            .field("handle_bytes", &self.handle_bytes)
            .field("handles", &self.handles.len())
            .finish()
    }
}

impl ImportedPages {
    /// Where the first handle is mapped.
    pub fn ptr(&self) -> DeviceAddr {
        DeviceAddr(self.base)
    }

    /// Bytes mapped (all handles).
    pub fn size(&self) -> usize {
        self.handle_bytes * self.handles.len()
    }

    /// Unmaps `mapped` handles from the base, releases every handle and frees the address
    /// range, logging what fails: the undo of a failed import, and the drop.
    fn teardown(&mut self, mapped: usize) {
        if let Some(list) = self.listed.take() {
            list.lock().remove(&self.base);
        }
        for i in 0..mapped {
            let va = self.base + (i * self.handle_bytes) as u64;
            // SAFETY: handle `i` was mapped at `va` with exactly `handle_bytes` bytes, and the
            // caller made sure no work uses it any more.
            if let Err(e) = unsafe { sys::cuMemUnmap(va, self.handle_bytes) }.result() {
                tracing::warn!(target: "cuda_caching_allocator", %e, "cuMemUnmap of an imported page failed");
            }
        }
        for &h in &self.handles {
            // SAFETY: `h` was imported by this value and is mapped nowhere now.
            if let Err(e) = unsafe { sys::cuMemRelease(h) }.result() {
                tracing::warn!(target: "cuda_caching_allocator", %e, "cuMemRelease of an imported page failed");
            }
        }
        self.handles.clear();
        if self.reserved > 0 {
            // SAFETY: the range was reserved by this value with this size, and nothing is
            // mapped in it any more.
            let r = unsafe { sys::cuMemAddressFree(self.base, self.reserved) }.result();
            if let Err(e) = r {
                tracing::warn!(target: "cuda_caching_allocator", %e, "cuMemAddressFree of an imported range failed");
            }
            self.reserved = 0;
        }
    }
}

impl Drop for ImportedPages {
    fn drop(&mut self) {
        if self.handles.is_empty() && self.reserved == 0 {
            return; // a failed import, undone already
        }
        let Ok(_bound) = ContextGuard::bind(&self.ctx) else {
            tracing::warn!(target: "cuda_caching_allocator", "could not bind the context to unmap imported pages; they are leaked");
            return;
        };
        // SAFETY: the context is current; waiting for it is always allowed.
        if let Err(e) = unsafe { sys::cuCtxSynchronize() }.result() {
            tracing::warn!(target: "cuda_caching_allocator", %e, "cuCtxSynchronize before unmapping imported pages failed; they are leaked");
            return;
        }
        let n = self.handles.len();
        self.teardown(n);
    }
}

/// Closes a descriptor when dropped.
struct Fd(libc::c_long);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor was opened by this module and is closed only here.
        unsafe { libc::close(self.0 as libc::c_int) };
    }
}

/// What `err` from `call` means for importing another process's memory.
fn os_error(operation: &'static str, err: io::Error) -> BackendError {
    let source = match err.raw_os_error() {
        Some(libc::ENOSYS) => io::Error::other(format!(
            "{err}: this kernel lacks the system call (Linux 5.6 or newer is needed to take \
             another process's descriptors)"
        )),
        Some(libc::EPERM) => io::Error::other(format!(
            "{err}: the kernel does not let this process take the sharing process's descriptors \
             (ptrace rules: same user, and Yama's kernel.yama.ptrace_scope at most 1 with the \
             sharer a descendant, or 0)"
        )),
        Some(libc::ESRCH) => io::Error::other(format!("{err}: the sharing process has exited")),
        _ => err,
    };
    BackendError::Os { operation, source }
}

impl CudaDevice {
    /// Maps here the pages process `pid` shares: `fds` are descriptors **in that process**
    /// (numbers from its `export_handle`, or from a PyTorch CUDA IPC handle of an expandable
    /// segment), each of a physical handle of `handle_bytes` bytes, in address order.
    ///
    /// # Errors
    /// [`BackendError::InvalidArgument`] for no descriptors or a size that is not a positive
    /// multiple of this device's granularity; [`BackendError::Unsupported`] without virtual
    /// memory management or for host pages; [`BackendError::Os`] when the descriptors cannot be
    /// taken (the process exited, the kernel is too old or forbids it); a driver error from the
    /// import, reservation or mapping. Nothing is left imported or mapped after an error.
    pub fn import_pages(
        &self,
        pid: i32,
        handle_bytes: usize,
        fds: &[i32],
    ) -> Result<ImportedPages, BackendError> {
        const OP: &str = "import_pages";
        let gran = self
            .granularity
            .filter(|_| !self.host)
            .ok_or(BackendError::Unsupported(
                "importing another process's device pages",
            ))?;
        let bad = |reason: String| BackendError::InvalidArgument {
            operation: OP,
            reason,
        };
        if fds.is_empty() {
            return Err(bad("no descriptors to import".into()));
        }
        if handle_bytes == 0 || handle_bytes % gran != 0 {
            return Err(bad(format!(
                "handle size {handle_bytes} is not a positive multiple of the granularity {gran}"
            )));
        }
        let total = handle_bytes
            .checked_mul(fds.len())
            .ok_or_else(|| bad(format!("{} handles of {handle_bytes} bytes", fds.len())))?;
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        let mut pages = ImportedPages {
            ctx: Arc::clone(&self.ctx),
            base: 0,
            reserved: 0,
            listed: None,
            handle_bytes,
            handles: Vec::with_capacity(fds.len()),
        };
        // SAFETY: a plain system call with integer arguments.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if pidfd < 0 {
            return Err(os_error("pidfd_open", io::Error::last_os_error()));
        }
        let pidfd = Fd(pidfd);
        for &fd in fds {
            // SAFETY: a plain system call with integer arguments; `pidfd.0` is open.
            let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.0, fd, 0) };
            if mine < 0 {
                let err = os_error("pidfd_getfd", io::Error::last_os_error());
                pages.teardown(0);
                return Err(err);
            }
            let mine = Fd(mine);
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `h` is a live local; the POSIX descriptor handle type takes the
            // descriptor's value in place of a pointer (`mine` is open for the call).
            let r = unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    mine.0 as usize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            if let Err(e) = r.result() {
                pages.teardown(0);
                return Err(driver("cuMemImportFromShareableHandle", e));
            }
            pages.handles.push(h);
        }
        drop(pidfd);
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a live local; `total` is a positive multiple of the granularity.
        if let Err(e) = unsafe { sys::cuMemAddressReserve(&mut base, total, 0, 0, 0) }.result() {
            pages.teardown(0);
            return Err(driver("cuMemAddressReserve", e));
        }
        (pages.base, pages.reserved) = (base, total);
        for i in 0..pages.handles.len() {
            let va = base + (i * handle_bytes) as u64;
            // SAFETY: `[va, va + handle_bytes)` lies in the range reserved above with nothing
            // mapped there, and handle `i` is a live imported handle. The driver refuses a size
            // larger than the handle; a smaller one maps the handle's first bytes only, so a
            // wrong `handle_bytes` (the exporter's word, as in PyTorch's format) gives wrong
            // bytes, never memory outside the handle.
            let r = unsafe { sys::cuMemMap(va, handle_bytes, 0, pages.handles[i], 0) };
            if let Err(e) = r.result() {
                pages.teardown(i);
                return Err(driver("cuMemMap", e));
            }
        }
        let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // Held until the range is listed: a peer added meanwhile is granted it either here or by
        // `add_peer` (which holds this lock while it walks the list).
        let peers = self.peers.lock();
        let access: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(peers.iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: device_location(d),
                flags: rw,
            })
            .collect();
        // SAFETY: the whole range was mapped just above; `access` is a live vector of
        // `access.len()` descriptors.
        let r = unsafe { sys::cuMemSetAccess(base, total, access.as_ptr(), access.len()) };
        if let Err(e) = r.result() {
            let n = pages.handles.len();
            pages.teardown(n);
            return Err(driver("cuMemSetAccess", e));
        }
        pages.listed = Some(Arc::clone(&self.imports));
        self.imports.lock().insert(base, total);
        drop(peers);
        Ok(pages)
    }
}
