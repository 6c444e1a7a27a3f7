//! A shared library with PyTorch's pluggable-allocator C ABI, over the per-device registry of
//! `cuda_caching_allocator`. Build it with
//! `cargo build --release --example torch_plugin --features cuda`, which writes
//! `target/release/examples/libtorch_plugin.so`, then in Python, before any CUDA allocation:
//!
//! ```python
//! import torch
//! alloc = torch.cuda.memory.CUDAPluggableAllocator("libtorch_plugin.so", "cca_alloc", "cca_free")
//! torch.cuda.memory.change_current_allocator(alloc)
//! ```
//!
//! Besides `cca_alloc` / `cca_free` it exports `cca_memory_stat` (any `torch.cuda.memory_stats()`
//! key), `cca_print_summary`, `cca_empty_cache`, `cca_reset_peak_stats` and
//! `cca_set_memory_fraction`, and `cca_bench_alloc_free` (host cost of one allocate + free);
//! `gpu/torch_client.py` calls them through `ctypes`.
//!
//! Nothing unwinds across the C boundary: every entry point runs under `catch_unwind`; errors
//! become a null pointer or a negative status and a line on stderr.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use cuda_caching_allocator::interop::{AllocatorRegistry, raw};
use cuda_caching_allocator::{DevicePtr, StreamId};

/// Runs `f`, turning a panic into `fallback` and a line on stderr.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            eprintln!("cuda_caching_allocator: panic in {what}; returning an error to the caller");
            fallback
        }
    }
}

fn ordinal(device: c_int) -> Option<usize> {
    usize::try_from(device).ok()
}

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)`: `size` bytes on `device` for
/// `stream`, from the device's cache; NULL on failure (the reason goes to stderr).
///
/// # Safety
/// `stream` is a default-stream handle or a live stream of `device`'s primary context that
/// outlives every allocation made on it (PyTorch's streams do).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded("cca_alloc", std::ptr::null_mut(), || {
        let (Ok(size), Some(device)) = (usize::try_from(size), ordinal(device)) else {
            eprintln!("cuda_caching_allocator: cca_alloc: bad size {size} or device {device}");
            return std::ptr::null_mut();
        };
        let stream = StreamId(stream.addr() as u64);
        // SAFETY: the caller's promise about `stream` is exactly `raw::alloc`'s obligations.
        match unsafe { raw::alloc(device, size, stream) } {
            Ok(a) => std::ptr::with_exposed_provenance_mut(a.ptr.addr() as usize),
            Err(e) => {
                eprintln!(
                    "cuda_caching_allocator: cca_alloc({size} bytes, device {device}, {stream}) failed: {e}"
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`: returns `ptr` to the
/// device's cache (`size` and `stream` are known to the cache already). Errors go to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_free(ptr: *mut c_void, _size: isize, device: c_int, _stream: *mut c_void) {
    guarded("cca_free", (), || {
        let Some(device) = ordinal(device) else {
            eprintln!("cuda_caching_allocator: cca_free: bad device {device}");
            return;
        };
        if let Err(e) = raw::free(device, DevicePtr(ptr.addr() as u64)) {
            eprintln!("cuda_caching_allocator: cca_free({ptr:?}, device {device}) failed: {e}");
        }
    })
}

/// One statistic of `device`'s cache by its `torch.cuda.memory_stats()` key (for example
/// `"reserved_bytes.all.peak"`); -1 when the key is unknown or the device's cache is unused.
///
/// # Safety
/// `key` is a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_memory_stat(device: c_int, key: *const c_char) -> i64 {
    guarded("cca_memory_stat", -1, || {
        if key.is_null() {
            return -1;
        }
        // SAFETY: the caller passes a valid NUL-terminated string.
        let Ok(key) = unsafe { CStr::from_ptr(key) }.to_str() else {
            return -1;
        };
        ordinal(device)
            .and_then(raw::memory_stats)
            .and_then(|s| s.get(key))
            .unwrap_or(-1)
    })
}

/// Prints PyTorch's `memory_summary()` table of `device`'s cache to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_print_summary(device: c_int) {
    guarded("cca_print_summary", (), || {
        match ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d)) {
            Some(alloc) => eprintln!("{}", alloc.memory_summary(false)),
            None => eprintln!("cuda_caching_allocator: device {device}'s cache was never used"),
        }
    })
}

/// Returns `device`'s cached, unused memory to the driver; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cca_empty_cache(device: c_int) -> c_int {
    guarded("cca_empty_cache", -1, || {
        let Some(device) = ordinal(device) else {
            return -1;
        };
        match raw::empty_cache(device) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("cuda_caching_allocator: cca_empty_cache(device {device}) failed: {e}");
                -1
            }
        }
    })
}

/// Resets the peak statistics of `device`'s cache.
#[unsafe(no_mangle)]
pub extern "C" fn cca_reset_peak_stats(device: c_int) {
    guarded("cca_reset_peak_stats", (), || {
        if let Some(alloc) =
            ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d))
        {
            alloc.reset_peak_stats();
        }
    })
}

/// Caps `device`'s cache at `fraction` of the device's memory; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cca_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    guarded("cca_set_memory_fraction", -1, || {
        let Some(device) = ordinal(device) else {
            return -1;
        };
        match AllocatorRegistry::global()
            .get(device)
            .and_then(|a| a.set_memory_fraction(fraction))
        {
            Ok(()) => 0,
            Err(e) => {
                eprintln!(
                    "cuda_caching_allocator: cca_set_memory_fraction({device}, {fraction}) failed: {e}"
                );
                -1
            }
        }
    })
}

/// Host time of one allocate + free pair of `size` bytes on `stream`, in nanoseconds, averaged
/// over `iters` pairs after one warm-up pair (a cache hit every time): `path` 0 goes through
/// the raw API as `cca_alloc` / `cca_free` do (registry lookup, stream admission, core), `path` 1
/// calls the core directly. -1 on error.
///
/// # Safety
/// As [`cca_alloc`] for `stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_bench_alloc_free(
    device: c_int,
    size: isize,
    stream: *mut c_void,
    iters: c_int,
    path: c_int,
) -> f64 {
    guarded("cca_bench_alloc_free", -1.0, || {
        let (Ok(size), Some(device), Ok(iters)) =
            (usize::try_from(size), ordinal(device), u32::try_from(iters))
        else {
            return -1.0;
        };
        let stream = StreamId(stream.addr() as u64);
        let Ok(alloc) = AllocatorRegistry::global().get(device) else {
            return -1.0;
        };
        let pair = || -> Result<(), cuda_caching_allocator::AllocError> {
            if path == 0 {
                // SAFETY: the caller's promise about `stream` is `raw::alloc`'s obligations.
                let a = unsafe { raw::alloc(device, size, stream) }?;
                raw::free(device, a.ptr)
            } else {
                let a = alloc.allocate(size, stream)?;
                alloc.free(a.ptr)
            }
        };
        if pair().is_err() {
            return -1.0;
        }
        let t0 = Instant::now();
        for _ in 0..iters {
            if pair().is_err() {
                return -1.0;
            }
        }
        t0.elapsed().as_nanos() as f64 / f64::from(iters.max(1))
    })
}
