//! The allocation hooks with PyTorch's pluggable-allocator signatures (`alloc`, `free`,
//! `record_stream`, `reset`, memory fraction, `init`), the configuration check, the cache-wide
//! commands (`empty_cache`, peak reset, fraction) and a host-cost probe. Formerly
//! `examples/torch_plugin.rs`.

use std::ffi::{c_int, c_void};
use std::time::Instant;

use cuda_caching_allocator::interop::{AllocatorRegistry, raw};
use cuda_caching_allocator::{AllocError, AllocatorConfig, DeviceAddr, FreeOutcome, StreamId};

use crate::error::{KIND_OTHER, fail, fail_alloc, guarded, print_line};

/// A C device ordinal as an index, or `None` when negative.
pub(crate) fn ordinal(device: c_int) -> Option<usize> {
    usize::try_from(device).ok()
}

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)`: `size` bytes on `device` for
/// `stream`, from the device's cache; NULL on failure ([`cca_last_error`](crate::cca_last_error)
/// says why; [`cca_last_error_kind`](crate::cca_last_error_kind) is 1 when out of memory).
///
/// # Safety
/// `stream` is a default-stream handle or a live stream of `device`'s primary context that
/// outlives every allocation made on it (PyTorch's streams do).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded("cca_alloc", std::ptr::null_mut(), || {
        let (Ok(size), Some(device)) = (usize::try_from(size), ordinal(device)) else {
            fail(
                KIND_OTHER,
                format!("cca_alloc: bad size {size} or device {device}"),
            );
            return std::ptr::null_mut();
        };
        let stream = StreamId(stream.addr() as u64);
        // SAFETY: the caller's promise about `stream` is exactly `raw::alloc`'s obligations.
        match unsafe { raw::alloc(device, size, stream) } {
            Ok(a) => std::ptr::with_exposed_provenance_mut(a.ptr.addr() as usize),
            Err(e) => {
                fail_alloc(
                    &format!("cca_alloc({size} bytes, device {device}, {stream})"),
                    &e,
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`: returns `ptr` to the
/// device's cache (`size` and `stream` are known to the cache already). Errors are recorded.
///
/// # Safety
/// `ptr` is null or came from [`cca_alloc`] on `device` and was not freed since, and nothing
/// uses it afterwards (the cache hands its bytes to the next allocation); work on streams other
/// than its allocation stream no longer uses it, unless they were declared with
/// [`cca_record_stream`]. A pointer the cache does not know is refused (an error is recorded),
/// but one it handed out again after a free cannot be told from its new owner's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_free(
    ptr: *mut c_void,
    _size: isize,
    device: c_int,
    _stream: *mut c_void,
) {
    guarded("cca_free", (), || {
        let Some(device) = ordinal(device) else {
            fail(KIND_OTHER, format!("cca_free: bad device {device}"));
            return;
        };
        // SAFETY: the caller's promise above (PyTorch frees each pointer it got from `cca_alloc`
        // once, owns no typed buffer of the registry, and declares its streams through
        // `cca_record_stream`) is `raw::free`'s obligation.
        if let Err(e) = unsafe { raw::free(device, DeviceAddr(ptr.addr() as u64)) } {
            fail_alloc(&format!("cca_free({ptr:?}, device {device})"), &e);
        }
    })
}

/// [`cca_free`] with its outcome returned: 0 when the block is back in the cache, 1 when it
/// waits for the work of streams recorded on it (the segment callback's action 4 names it when
/// it is back: PyTorch's `free_completed`), -1 on an error (recorded). The C++ shim writes its
/// `free_completed` trace entries from these.
///
/// # Safety
/// As [`cca_free`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_free_checked(
    ptr: *mut c_void,
    _size: isize,
    device: c_int,
    _stream: *mut c_void,
) -> c_int {
    guarded("cca_free_checked", -1, || {
        let Some(device) = ordinal(device) else {
            fail(KIND_OTHER, format!("cca_free_checked: bad device {device}"));
            return -1;
        };
        // SAFETY: as in `cca_free`: the caller's promise is `raw::free_with_outcome`'s obligation.
        match unsafe { raw::free_with_outcome(device, DeviceAddr(ptr.addr() as u64)) } {
            Ok(FreeOutcome::AwaitingStreams) => 1,
            Ok(_) => 0,
            Err(e) => {
                fail_alloc(&format!("cca_free_checked({ptr:?}, device {device})"), &e);
                -1
            }
        }
    })
}

/// `void record_stream(void* ptr, cudaStream_t stream)`, PyTorch's pluggable `record_stream`
/// hook (`Tensor.record_stream`): the allocation at `ptr` is used on `stream`, so its memory is
/// reused only after the work queued there by the time it is freed has completed. Errors are
/// recorded (the hook returns nothing).
///
/// # Safety
/// `stream` is a live stream of the device that owns `ptr` and outlives the allocation (PyTorch's
/// streams do).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    // SAFETY: the caller's promise is `record_on_owner`'s.
    unsafe { record_on_owner("cca_record_stream", ptr, stream) };
}

/// [`cca_record_stream`] with its outcome returned: 0 when the use was recorded, -1 when it
/// was not (the error is recorded too). The C++ shim orders a block's reuse through it, where
/// reading the thread's last error would not do: during the thread's exit that record is gone,
/// and a failure would read as success.
///
/// # Safety
/// As [`cca_record_stream`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_record_stream_checked(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    // SAFETY: the caller's promise is `record_on_owner`'s.
    unsafe { record_on_owner("cca_record_stream_checked", ptr, stream) }
}

/// Records the use of the allocation at `ptr` on `stream` with the cache that owns it (`what`
/// names the entry point in errors): 0 when recorded, -1 when not (a null `ptr` quietly).
///
/// # Safety
/// As [`cca_record_stream`].
unsafe fn record_on_owner(what: &str, ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guarded(what, -1, || {
        if ptr.is_null() {
            return -1;
        }
        let (p, s) = (
            DeviceAddr(ptr.addr() as u64),
            StreamId(stream.addr() as u64),
        );
        // SAFETY: the caller's promise about `stream` is `raw::record_stream_on_owner`'s
        // obligation.
        match unsafe { raw::record_stream_on_owner(p, s) } {
            Ok(_) => 0,
            Err(e) => {
                fail_alloc(&format!("{what}({p}, {s})"), &e);
                -1
            }
        }
    })
}

/// `void reset()`, PyTorch's pluggable `empty_cache` hook: returns every device's cached, unused
/// memory to the driver. Errors are recorded.
#[unsafe(no_mangle)]
pub extern "C" fn cca_reset() {
    guarded("cca_reset", (), || {
        // Device by device, so that a capture on one device does not hide another's error.
        let mut first = None;
        for (device, alloc) in AllocatorRegistry::global().created() {
            if let Err(e) = as_pytorch_empties(alloc.empty_cache()) {
                first.get_or_insert((device, e));
            }
        }
        if let Some((device, e)) = first {
            fail_alloc(&format!("empty_cache (device {device})"), &e);
        }
    })
}

/// `empty_cache`'s result as PyTorch gives it: while a graph capture or a `use_mem_pool` routes
/// allocations on the device, PyTorch's `release_cached_blocks` leaves the cache as it is and
/// raises nothing (`torch.cuda.graph` calls `empty_cache()` on entry, `~MemPool` from a
/// destructor), where the crate refuses with `CaptureUnderway` and changes nothing.
fn as_pytorch_empties(r: Result<(), AllocError>) -> Result<(), AllocError> {
    match r {
        Err(AllocError::CaptureUnderway { .. }) => Ok(()),
        other => other,
    }
}

/// `void memory_fraction(double fraction, int device)`, PyTorch's pluggable
/// `set_per_process_memory_fraction` hook. Errors are recorded.
#[unsafe(no_mangle)]
pub extern "C" fn cca_memory_fraction_hook(fraction: f64, device: c_int) {
    let _ = cca_set_memory_fraction(device, fraction);
}

/// `void init(int device_count)`, PyTorch's pluggable `init` hook: reports a bad configuration now
/// rather than at the first allocation.
#[unsafe(no_mangle)]
pub extern "C" fn cca_init(device_count: c_int) {
    let _ = device_count;
    let _ = cca_check_config();
}

/// Checks the configuration the devices' caches will use (`CUDA_CACHING_ALLOCATOR_CONF`, else
/// PyTorch's variables, read as `AllocatorConfig::parse` reads them; the crate's default when
/// none is set): 0 when it is good and, if the caches have read their configuration already,
/// the same as theirs; -1 otherwise ([`cca_last_error`](crate::cca_last_error) says why). The
/// Python package calls it before installing the allocator.
///
/// Note [Configuration fixed at enable]: the caches read the environment once, the first time
/// any of them is reached (`AllocatorRegistry::global`). The shim reaches them when it is
/// installed; the pluggable route reached them only at the first allocation, so a program that
/// changed `PYTORCH_CUDA_ALLOC_CONF` after `enable()` ran another configuration than the one
/// checked (a bad one then failed every allocation). The package now fixes it at `enable()` on
/// both routes (`cca_config_expandable`), and this check refuses an environment that says
/// otherwise than the configuration in force, naming both.
#[unsafe(no_mangle)]
pub extern "C" fn cca_check_config() -> c_int {
    guarded("cca_check_config", -1, || {
        let now = match AllocatorConfig::from_env_or(AllocatorConfig::default()) {
            Ok(c) => c,
            Err(e) => {
                fail(KIND_OTHER, format!("bad configuration: {e}"));
                return -1;
            }
        };
        match AllocatorRegistry::global_if_read().map(AllocatorRegistry::config) {
            None => 0,
            Some(Ok(fixed)) if fixed == now => 0,
            Some(Ok(fixed)) => {
                fail(
                    KIND_OTHER,
                    format!(
                        "the caches run {} (fixed when they first read it); the environment now \
                         says {}: a running process keeps its configuration",
                        settings_text(&fixed),
                        settings_text(&now)
                    ),
                );
                -1
            }
            Some(Err(e)) => {
                fail(KIND_OTHER, format!("bad configuration (read earlier): {e}"));
                -1
            }
        }
    })
}

/// `config` as a settings string, PyTorch's defaults named (their string is empty).
fn settings_text(config: &AllocatorConfig) -> String {
    let s = config.to_settings();
    if s.is_empty() {
        "PyTorch's defaults (no settings)".to_owned()
    } else {
        s
    }
}

/// Prints PyTorch's `memory_summary()` table of `device`'s cache to stderr.
#[unsafe(no_mangle)]
pub extern "C" fn cca_print_summary(device: c_int) {
    guarded("cca_print_summary", (), || {
        match ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d)) {
            Some(alloc) => print_line(format_args!("{}", alloc.memory_summary(false))),
            None => print_line(format_args!(
                "cuda_caching_allocator: device {device}'s cache was never used"
            )),
        }
    })
}

/// Returns `device`'s cached, unused memory to the driver; 0 on success (also when a capture or
/// `use_mem_pool` routes allocations on the device: the cache is then left as it is, as PyTorch
/// leaves its default pool), -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cca_empty_cache(device: c_int) -> c_int {
    guarded("cca_empty_cache", -1, || {
        let Some(device) = ordinal(device) else {
            fail(KIND_OTHER, format!("cca_empty_cache: bad device {device}"));
            return -1;
        };
        match as_pytorch_empties(raw::empty_cache(device)) {
            Ok(()) => 0,
            Err(e) => {
                fail_alloc(&format!("cca_empty_cache(device {device})"), &e);
                -1
            }
        }
    })
}

/// Resets the peak statistics of `device`'s cache (nothing when the cache was never used).
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

/// Lets device `peer` read and write `device`'s cache (every page mapped now and later), as
/// PyTorch's `enablePeerAccess(peer, device)` does for its expandable segments; 0 on success, -1
/// on failure. The driver's peer access itself is the caller's (the shim enables it first).
#[unsafe(no_mangle)]
pub extern "C" fn cca_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guarded("cca_enable_peer_access", -1, || {
        let (Some(owner), Some(peer_ordinal)) = (ordinal(device), ordinal(peer)) else {
            fail(
                KIND_OTHER,
                format!("cca_enable_peer_access: bad device {device} or peer {peer}"),
            );
            return -1;
        };
        match AllocatorRegistry::global()
            .get(owner)
            .and_then(|a| a.enable_peer_access(peer_ordinal))
        {
            Ok(()) => 0,
            Err(e) => {
                fail_alloc(
                    &format!("enable peer access of device {peer} to device {device}"),
                    &e,
                );
                -1
            }
        }
    })
}

/// Caps `device`'s cache at `fraction` of the device's memory; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cca_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    guarded("cca_set_memory_fraction", -1, || {
        let Some(ordinal) = ordinal(device) else {
            fail(
                KIND_OTHER,
                format!("cca_set_memory_fraction: bad device {device}"),
            );
            return -1;
        };
        match AllocatorRegistry::global()
            .get(ordinal)
            .and_then(|a| a.set_memory_fraction(fraction))
        {
            Ok(()) => 0,
            Err(e) => {
                fail_alloc(
                    &format!("set_per_process_memory_fraction({fraction}, device {device})"),
                    &e,
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
        let pair = || -> Result<(), AllocError> {
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
