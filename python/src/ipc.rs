//! CUDA IPC of the crate's expandable pages: the exporting side of PyTorch's `'e'` handles
//! (descriptors of the physical pages under one allocation) and the importing side (mapping
//! another process's pages, from this package or from PyTorch's own expandable segments). The
//! shim writes and reads PyTorch's handle format; this module only moves descriptors and
//! mappings.

use std::ffi::{c_int, c_void};

use cuda_caching_allocator::DeviceAddr;
use cuda_caching_allocator::backend::cuda::ImportedPages;
use cuda_caching_allocator::interop::AllocatorRegistry;

use crate::error::{KIND_OTHER, fail, fail_alloc, guarded};
use crate::hooks::ordinal;

/// The pages under the live allocation at `ptr` of `device`'s cache, exported for another
/// process: returns how many handles there are, writing their descriptors to `fds` (room for
/// `cap`; when `cap` is smaller nothing is written and the count tells the room needed), the
/// bytes of each handle to `*handle_bytes`, where the allocation begins in the importer's mapping
/// to `*offset` and this process's id to `*pid`. Returns 0 when the allocation lies in a
/// `cuMemAlloc` segment (share it with `cudaIpcGetMemHandle` instead), -1 on failure, a null
/// `handle_bytes`, `offset` or `pid`, or a null `fds` with `cap > 0`, included
/// ([`cca_last_error`](crate::cca_last_error) says why). The descriptors stay the cache's.
///
/// # Safety
/// `fds` is null or writable for `cap` `int`s; `handle_bytes`, `offset` and `pid` are null or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_export_pages(
    device: c_int,
    ptr: u64,
    fds: *mut c_int,
    cap: usize,
    handle_bytes: *mut u64,
    offset: *mut u64,
    pid: *mut c_int,
) -> isize {
    guarded("cca_export_pages", -1, || {
        if handle_bytes.is_null() || offset.is_null() || pid.is_null() || (fds.is_null() && cap > 0)
        {
            fail(KIND_OTHER, "cca_export_pages: null output pointer".into());
            return -1;
        }
        let Some(a) = ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d))
        else {
            fail(
                KIND_OTHER,
                format!("cca_export_pages: device {device} has no cache"),
            );
            return -1;
        };
        let pages = match a.export_pages(DeviceAddr(ptr)) {
            Ok(Some(p)) => p,
            Ok(None) => return 0,
            Err(e) => {
                fail_alloc("sharing a CUDA tensor with another process", &e);
                return -1;
            }
        };
        if pages.fds.len() <= cap {
            // SAFETY: writable for `cap` ints by the caller's promise, and `len <= cap`.
            unsafe { std::ptr::copy_nonoverlapping(pages.fds.as_ptr(), fds, pages.fds.len()) };
        }
        // SAFETY: writable by the caller's promise.
        unsafe {
            handle_bytes.write(pages.handle_bytes as u64);
            offset.write(pages.offset as u64);
            pid.write(pages.pid);
        }
        pages.fds.len() as isize
    })
}

/// Maps on `device` the pages process `pid` exported: `n` of its descriptors `fds`, each of a
/// handle of `handle_bytes` bytes, side by side. Returns an opaque token for
/// [`cca_close_imported`] and writes the mapping's address to `*ptr`; null on failure, a null
/// `ptr` or a null `fds` with `n > 0` included ([`cca_last_error`](crate::cca_last_error) says
/// why; nothing stays mapped).
///
/// # Safety
/// `fds` is null or readable for `n` `int`s; `ptr` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_import_pages(
    device: c_int,
    pid: c_int,
    handle_bytes: u64,
    fds: *const c_int,
    n: usize,
    ptr: *mut u64,
) -> *mut c_void {
    guarded("cca_import_pages", std::ptr::null_mut(), || {
        if ptr.is_null() || (fds.is_null() && n > 0) {
            fail(KIND_OTHER, "cca_import_pages: null pointer argument".into());
            return std::ptr::null_mut();
        }
        let a = match ordinal(device).map(|d| AllocatorRegistry::global().get(d)) {
            Some(Ok(a)) => a,
            Some(Err(e)) => {
                fail_alloc("opening a CUDA tensor of another process", &e);
                return std::ptr::null_mut();
            }
            None => {
                fail(KIND_OTHER, format!("cca_import_pages: no device {device}"));
                return std::ptr::null_mut();
            }
        };
        let fds: &[c_int] = if n == 0 {
            &[]
        } else {
            // SAFETY: readable for `n` ints by the caller's promise.
            unsafe { std::slice::from_raw_parts(fds, n) }
        };
        let Ok(bytes) = usize::try_from(handle_bytes) else {
            fail(
                KIND_OTHER,
                format!("cca_import_pages: handle size {handle_bytes}"),
            );
            return std::ptr::null_mut();
        };
        match a.device().import_pages(pid, bytes, fds) {
            Ok(pages) => {
                // SAFETY: writable by the caller's promise.
                unsafe { ptr.write(pages.ptr().addr()) };
                Box::into_raw(Box::new(pages)).cast()
            }
            Err(e) => {
                fail(
                    KIND_OTHER,
                    format!(
                        "opening a CUDA tensor of process {pid} (pages of another process): {e}"
                    ),
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// Unmaps what [`cca_import_pages`] mapped (after this device's queued work is done) and lets go
/// of the other process's memory.
///
/// # Safety
/// `token` is null or a token of [`cca_import_pages`] not closed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_close_imported(token: *mut c_void) {
    guarded("cca_close_imported", (), || {
        if !token.is_null() {
            // SAFETY: a live token of `cca_import_pages` (a boxed `ImportedPages`), by the
            // caller's promise, closed only here.
            drop(unsafe { Box::from_raw(token.cast::<ImportedPages>()) });
        }
    })
}
