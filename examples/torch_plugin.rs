//! A shared library with PyTorch's pluggable-allocator C ABI, over the per-device registry of
//! `cuda_caching_allocator`. Build it with
//! `cargo build --release --example torch_plugin --features cuda`, which writes
//! `target/release/examples/libtorch_plugin.so`, then in Python, before any CUDA allocation:
//!
//! ```python
//! import cuda_caching_allocator.torch as cca   # python/ in this repository
//! cca.enable(library="target/release/examples/libtorch_plugin.so")
//! ```
//!
//! Besides `cca_alloc` / `cca_free` it exports the hooks PyTorch's `CUDAPluggableAllocator`
//! takes from Python through `.allocator()`: `cca_record_stream` (`set_record_stream_fn`, which
//! `Tensor.record_stream` reaches: NCCL process groups, FSDP, DDP and prefetchers call it),
//! `cca_reset` (`set_reset_fn`, `torch.cuda.empty_cache()`), `cca_memory_fraction_hook`
//! (`set_memory_fraction_fn`) and `cca_init` (`set_init_fn`). `python/cuda_caching_allocator`
//! loads the library and registers all of them: `cuda_caching_allocator.torch.enable(...)`.
//! It also exports `cca_memory_stat` (any `torch.cuda.memory_stats()` key),
//! `cca_print_summary`, `cca_empty_cache`, `cca_reset_peak_stats` and
//! `cca_set_memory_fraction`, and `cca_bench_alloc_free` (host cost of one allocate + free).
//!
//! Nothing unwinds across the C boundary: every entry point runs under `catch_unwind`; errors
//! become a null pointer or a negative status and a line on stderr.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cuda_caching_allocator::interop::{AllocatorRegistry, raw};
use cuda_caching_allocator::{DeviceBackend, DevicePtr, MemPoolId, PoolFilter, StreamId};
use parking_lot::Mutex;

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
        // SAFETY: PyTorch frees each pointer it got from `cca_alloc` once, and owns no typed
        // buffer of the registry; its streams are declared through `cca_record_stream`.
        if let Err(e) = unsafe { raw::free(device, DevicePtr(ptr.addr() as u64)) } {
            eprintln!("cuda_caching_allocator: cca_free({ptr:?}, device {device}) failed: {e}");
        }
    })
}

/// `void record_stream(void* ptr, cudaStream_t stream)`, PyTorch's pluggable `record_stream`
/// hook (`Tensor.record_stream`, set with `allocator().set_record_stream_fn`): the allocation at
/// `ptr` is used on `stream`, so its memory is reused only after the work queued there by the time
/// it is freed has completed. Errors go to stderr (the hook returns nothing).
///
/// # Safety
/// `stream` is a live stream of the device that owns `ptr` and outlives the allocation (PyTorch's
/// streams do).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guarded("cca_record_stream", (), || {
        if ptr.is_null() {
            return;
        }
        let (p, s) = (DevicePtr(ptr.addr() as u64), StreamId(stream.addr() as u64));
        // SAFETY: the caller's promise about `stream` is `raw::record_stream_on_owner`'s
        // obligation.
        if let Err(e) = unsafe { raw::record_stream_on_owner(p, s) } {
            eprintln!("cuda_caching_allocator: cca_record_stream({p}, {s}) failed: {e}");
        }
    })
}

/// `void reset()`, PyTorch's pluggable `empty_cache` hook (`set_reset_fn`): returns every
/// device's cached, unused memory to the driver. Errors go to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_reset() {
    guarded("cca_reset", (), || {
        if let Err(e) = AllocatorRegistry::global().empty_cache_all() {
            eprintln!("cuda_caching_allocator: empty_cache failed: {e}");
        }
    })
}

/// `void memory_fraction(double fraction, int device)`, PyTorch's pluggable
/// `set_per_process_memory_fraction` hook (`set_memory_fraction_fn`). Errors go to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_memory_fraction_hook(fraction: f64, device: c_int) {
    let _ = cca_set_memory_fraction(device, fraction);
}

/// `void init(int device_count)`, PyTorch's pluggable `init` hook (`set_init_fn`): reports a bad
/// configuration on stderr now rather than at the first allocation.
#[unsafe(no_mangle)]
pub extern "C" fn cca_init(device_count: c_int) {
    let _ = device_count;
    let _ = cca_check_config();
}

/// Checks the configuration the devices' caches will use (`CUDA_CACHING_ALLOCATOR_CONF`, else
/// PyTorch's variables, read as `AllocatorConfig::parse` reads them; the crate's default when
/// none is set): 0 when it is good, -1 otherwise, with the
/// reason on stderr. The Python loader calls it before installing the allocator.
#[unsafe(no_mangle)]
pub extern "C" fn cca_check_config() -> c_int {
    guarded(
        "cca_check_config",
        -1,
        || match cuda_caching_allocator::AllocatorConfig::from_env_or(
            cuda_caching_allocator::AllocatorConfig::default(),
        ) {
            Ok(_) => 0,
            Err(e) => {
                eprintln!("cuda_caching_allocator: bad configuration: {e}");
                -1
            }
        },
    )
}

// ---- CUDA graph private pools -------------------------------------------------------------------

/// PyTorch's `MempoolId_t` (`std::pair<unsigned long long, unsigned long long>`), passed by value.
/// The pair's copy and move constructors are defaulted and its destructor trivial, so the
/// Itanium C++ ABI passes it as this C struct of two 64-bit integers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MempoolId {
    /// `first`: a graph's own pool counter (`(n, 0)`).
    pub first: u64,
    /// `second`: a user pool counter (`(0, n)`, `graph_pool_handle()`).
    pub second: u64,
}

/// Capture ids already bound to a pool by an active routing, per device: a routing whose filter
/// meets the stream of another pool's capture must not claim it.
static BOUND_CAPTURES: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());

/// `void begin_allocate_to_pool(int device, MempoolId_t pool, std::function<bool(cudaStream_t)>)`,
/// PyTorch's `set_begin_allocate_to_pool` hook, called by `CUDAGraph::capture_begin` just before
/// `cudaStreamBeginCapture`. PyTorch's filter is a C++ `std::function`, passed by value and so (a
/// type with a non-trivial destructor) by invisible reference: `filter` is its address, which a C
/// ABI cannot call and which is not used. The routing instead asks the driver for each allocating
/// stream's capture id and binds the first capture, not bound by another routing of the device,
/// that allocates after this call: the capture PyTorch is about to begin.
///
/// # Safety
/// Called by PyTorch with a device ordinal and a pool id; `filter` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_begin_allocate_to_pool(
    device: c_int,
    pool: MempoolId,
    filter: *const c_void,
) {
    let _ = filter;
    guarded("cca_begin_allocate_to_pool", (), || {
        let Some(ordinal) = ordinal(device) else {
            eprintln!("cuda_caching_allocator: begin_allocate_to_pool: bad device {device}");
            return;
        };
        let alloc = match AllocatorRegistry::global().get(ordinal) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("cuda_caching_allocator: begin_allocate_to_pool(device {device}): {e}");
                return;
            }
        };
        let bound = Arc::new(AtomicU64::new(0));
        let mine = Arc::clone(&bound);
        let filter: PoolFilter = Box::new(move |stream| {
            let Ok(Some(id)) = alloc.device().stream_capture_id(stream) else {
                return false;
            };
            let have = mine.load(Ordering::Acquire);
            if have != 0 {
                return have == id;
            }
            let mut taken = BOUND_CAPTURES.lock();
            if taken.iter().any(|&(d, c)| d == ordinal && c == id) {
                return false;
            }
            taken.push((ordinal, id));
            mine.store(id, Ordering::Release);
            true
        });
        ROUTES
            .lock()
            .push((ordinal, pool.first, pool.second, bound));
        if let Err(e) = alloc.begin_allocate_to_pool(MemPoolId(pool.first, pool.second), filter) {
            ROUTES
                .lock()
                .retain(|r| !(r.0 == ordinal && r.1 == pool.first && r.2 == pool.second));
            eprintln!(
                "cuda_caching_allocator: begin_allocate_to_pool(device {device}, pool ({}, {})) failed: {e}",
                pool.first, pool.second
            );
        }
    })
}

/// An active routing of the hooks: device, pool id, and the capture id bound to it (0 until bound).
type Route = (usize, u64, u64, Arc<AtomicU64>);

/// The active routings of the hooks.
static ROUTES: Mutex<Vec<Route>> = Mutex::new(Vec::new());

/// `void end_allocate_to_pool(int device, MempoolId_t pool)`, PyTorch's
/// `set_end_allocate_to_pool_fn` hook (`CUDAGraph::capture_end`): stops routing allocations into
/// `pool`. Errors go to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_end_allocate_to_pool(device: c_int, pool: MempoolId) {
    guarded("cca_end_allocate_to_pool", (), || {
        let Some(ordinal) = ordinal(device) else {
            return;
        };
        let mut routes = ROUTES.lock();
        if let Some(i) = routes
            .iter()
            .position(|r| r.0 == ordinal && r.1 == pool.first && r.2 == pool.second)
        {
            let (_, _, _, bound) = routes.remove(i);
            let id = bound.load(Ordering::Acquire);
            BOUND_CAPTURES
                .lock()
                .retain(|&(d, c)| !(d == ordinal && c == id));
        }
        drop(routes);
        if let Some(alloc) = AllocatorRegistry::global().get_if_created(ordinal) {
            if let Err(e) = alloc.end_allocate_to_pool(MemPoolId(pool.first, pool.second)) {
                eprintln!(
                    "cuda_caching_allocator: end_allocate_to_pool(device {device}, pool ({}, {})) failed: {e}",
                    pool.first, pool.second
                );
            }
        }
    })
}

/// `void release_pool(int device, MempoolId_t pool)`, PyTorch's `set_release_pool` hook
/// (`CUDAGraph::reset` and the graph's destruction): gives back one use of `pool`; its memory
/// returns to the device at the next `empty_cache` once unused. Errors go to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_release_pool(device: c_int, pool: MempoolId) {
    guarded("cca_release_pool", (), || {
        let Some(alloc) =
            ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d))
        else {
            return;
        };
        if let Err(e) = alloc.release_pool(MemPoolId(pool.first, pool.second)) {
            eprintln!(
                "cuda_caching_allocator: release_pool(device {device}, pool ({}, {})) failed: {e}",
                pool.first, pool.second
            );
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
                // SAFETY: the pair's own allocation, freed once.
                unsafe { raw::free(device, a.ptr) }
            } else {
                let a = alloc.allocate(size, stream)?;
                // SAFETY: the pair's own allocation, freed once.
                unsafe { alloc.free(a.ptr) }
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
