//! `CudaDevice`: the [`DeviceBackend`] of a real CUDA device, over cudarc's driver API.
//!
//! Segments come from `cuMemAlloc` and go back through `cuMemFree`; events are created with
//! `CU_EVENT_DISABLE_TIMING` (the cache pools them); the virtual-memory group maps physical pages
//! (`cuMemCreate`) into reserved address ranges (`cuMemAddressReserve`) for expandable segments.
//! Every driver call first makes this device's context current on the calling thread, because the
//! cache may be called from any thread and for any device, and afterwards puts back the context
//! that was current before (as PyTorch's `CUDAGuard` does), so a caller's current device is never
//! changed behind its back.
//!
//! ## Graph capture
//!
//! [`DeviceBackend::stream_capture_id`] answers with the driver's `cuStreamGetCaptureInfo`
//! (looked up at run time: the newest of `_v3`, `_v2` and the original the driver exports, so it
//! works whatever CUDA version cudarc was built for), and every allocation call (`cuMemAlloc`,
//! `cuMemAddressReserve`, `cuMemCreate`, `cuMemMap` with `cuMemSetAccess`) runs with the calling
//! thread's capture mode exchanged to relaxed and restored afterwards
//! (`cuThreadExchangeStreamCaptureMode`, PyTorch's `CUDAStreamCaptureModeGuard` around
//! `cudaMalloc`): in the default global mode these "potentially unsafe" calls would invalidate a
//! capture underway on any thread. The cache itself makes no synchronization, event query, free or
//! unmap while a capture is underway.
//!
//! This file and `src/interop/` are the only places that name `cudarc`; its types never reach the
//! core. May use: `backend` (the trait and its value types).
//!
//! ## Raw handles and soundness
//!
//! The trait passes streams and events as plain numbers ([`StreamId`], [`EventHandle`]) to safe
//! methods. Handing the driver a number that is not a live handle is undefined behaviour, so
//! `CudaDevice` only passes on handles it knows to be live:
//! * events: the ones it created and has not destroyed (a set, checked on each event call);
//! * streams: the legacy and per-thread default streams, plus streams *admitted* with
//!   [`CudaDevice::admit_stream`] (which keeps the cudarc stream alive until the interop layer
//!   releases it: once nothing else holds it and the cache no longer refers to it) or
//!   the `unsafe` [`CudaDevice::admit_raw_stream`] (whose caller promises the stream outlives its
//!   use). [`DeviceBackend::validate_stream`] rejects every other stream.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{CudaContext, CudaStream, sys};
use parking_lot::{Mutex, RwLock};

mod imported;
mod unmap_helper;

pub use imported::ImportedPages;

use super::call_times::{CallClock, CallKind, DeviceCallTimes};
use super::{
    BackendError, DeviceAddr, DeviceBackend, EventHandle, FinishedUnmaps, MemInfo, PhysicalHandle,
    StreamId,
};

/// `CU_STREAM_LEGACY`: the legacy default stream's explicit handle.
const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`: the per-thread default stream's handle.
const STREAM_PER_THREAD: u64 = 0x2;
/// The alignment `cuMemAlloc` documents for every allocation.
const CUDA_ALIGNMENT: usize = 256;

/// The [`StreamId`] of a cudarc stream: its raw `CUstream` handle value.
pub fn stream_id(stream: &CudaStream) -> StreamId {
    StreamId(stream.cu_stream().addr() as u64)
}

/// Whether a CUDA driver library can be loaded on this machine and reports at least one device.
///
/// Call this before anything else that touches CUDA when the program must also run on machines
/// without a GPU: cudarc loads `libcuda` lazily and panics when it is missing, while this only
/// answers `false`.
pub fn cuda_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// The number of CUDA devices.
///
/// # Errors
/// [`BackendError::NoDriver`] when no CUDA driver library can be loaded; a driver error when
/// `cuInit` or the count fails (no usable device, driver too old for the bindings).
pub fn device_count() -> Result<usize, BackendError> {
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names; it has no
    // preconditions (cudarc marks it unsafe because opening a library runs its initialisers, and
    // libcuda's initialisers are sound to run at any time).
    if !unsafe { sys::is_culib_present() } {
        return Err(BackendError::NoDriver);
    }
    result::init().map_err(|e| driver("cuInit", e))?;
    let n = result::device::get_count().map_err(|e| driver("cuDeviceGetCount", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// A driver error as a [`BackendError`] (out of memory stays out of memory, so the cache
/// releases and retries).
pub(crate) fn driver(operation: &'static str, e: DriverError) -> BackendError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::OutOfMemory
    } else {
        BackendError::Driver {
            operation,
            source: Box::new(e),
        }
    }
}

/// The context current on the calling thread (null when none), as `cuCtxGetCurrent` reports it.
fn current_context() -> Result<sys::CUcontext, BackendError> {
    result::ctx::get_current()
        .map(|c| c.unwrap_or(std::ptr::null_mut()))
        .map_err(|e| driver("cuCtxGetCurrent", e))
}

/// A scope in which one context is current on the calling thread; dropping it puts back the
/// context that was current before (or none), like PyTorch's `CUDAGuard`. When the context was
/// current already, it costs one `cuCtxGetCurrent` and restores nothing.
#[must_use = "the context is restored when the guard drops"]
struct ContextGuard {
    /// The context to put back, when this guard replaced it (null: none was current).
    restore: Option<sys::CUcontext>,
}

impl ContextGuard {
    /// Makes `ctx` current on the calling thread until the guard drops.
    fn bind(ctx: &CudaContext) -> Result<Self, BackendError> {
        let previous = current_context()?;
        if previous == ctx.cu_ctx() {
            return Ok(ContextGuard { restore: None });
        }
        // SAFETY: `ctx.cu_ctx()` is a live context: the `CudaContext` retains it (primary
        // context) or owns it until it drops, and the caller borrows it for this call.
        unsafe { result::ctx::set_current(ctx.cu_ctx()) }
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        Ok(ContextGuard {
            restore: Some(previous),
        })
    }

    /// Remembers the calling thread's current context, to put it back when the guard drops
    /// (around calls that bind a context themselves, such as cudarc's `CudaContext::new`).
    fn save() -> Result<Self, BackendError> {
        Ok(ContextGuard {
            restore: Some(current_context()?),
        })
    }
}

/// Remembers the calling thread's current context and puts it back when the returned guard
/// drops (`None` when it could not be read): for work that lets cudarc bind a context.
pub(crate) fn callers_context() -> Option<impl Drop> {
    ContextGuard::save().ok()
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let Some(previous) = self.restore else {
            return;
        };
        if current_context().is_ok_and(|c| c == previous) {
            return;
        }
        // SAFETY: `previous` is null (pops the context this guard made current, leaving the
        // thread with none, as it was) or the context that was current on this thread when the
        // guard was made, moments ago on the same thread. A context current on a thread stays
        // valid until it is destroyed, and CUDA makes whoever destroys a context responsible for
        // no other call using it meanwhile (`cuCtxDestroy`); primary contexts are only reset
        // through `cuDevicePrimaryCtxReset`, under the same rule.
        if let Err(e) = unsafe { result::ctx::set_current(previous) } {
            tracing::error!(target: "cuda_caching_allocator", %e, "cuCtxSetCurrent could not restore the caller's context");
        }
    }
}

/// The calling thread's stream-capture mode exchanged to relaxed until the guard drops (PyTorch's
/// `CUDAStreamCaptureModeGuard`), so that allocation calls, and queries of and waits on events
/// and streams that take no part in a capture, made while another thread captures in global mode
/// do not invalidate that capture. In the thread's default mode each of them fails with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the other thread's capture; relaxed,
/// each succeeds and the capture ends well (`gpu/probes/capture_queries.cu`, H200, driver 580).
/// A captured event or a capturing stream stays illegal to query in any mode; the allocator never
/// queries those (Note [Capture underway]).
#[must_use = "the capture mode is restored when the guard drops"]
pub(crate) struct RelaxedCaptureMode {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCaptureMode {
    /// Exchanges the calling thread's capture mode to relaxed until the guard drops.
    ///
    /// # Errors
    /// [`BackendError::Driver`] if the driver refuses the exchange.
    pub(crate) fn enter() -> Result<Self, BackendError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a live local holding a valid mode; the driver writes the thread's
        // previous mode into it.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
            .result()
            .map_err(|e| driver("cuThreadExchangeStreamCaptureMode", e))?;
        Ok(RelaxedCaptureMode { previous: mode })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`: a live local holding the mode the driver gave us back.
        if let Err(e) = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result() {
            tracing::error!(target: "cuda_caching_allocator", %e, "cuThreadExchangeStreamCaptureMode could not restore the thread's capture mode");
        }
    }
}

/// `cuStreamGetCaptureInfo` in whichever version the driver exports (the later ones take
/// optional out-parameters, passed as null).
#[derive(Clone, Copy)]
enum CaptureInfoFn {
    /// `cuStreamGetCaptureInfo_v3(stream, status, id, graph, deps, edge_data, num_deps)`.
    V3(
        unsafe extern "C" fn(
            sys::CUstream,
            *mut sys::CUstreamCaptureStatus,
            *mut u64,
            *mut std::ffi::c_void,
            *mut std::ffi::c_void,
            *mut std::ffi::c_void,
            *mut usize,
        ) -> sys::CUresult,
    ),
    /// `cuStreamGetCaptureInfo_v2(stream, status, id, graph, deps, num_deps)`.
    V2(
        unsafe extern "C" fn(
            sys::CUstream,
            *mut sys::CUstreamCaptureStatus,
            *mut u64,
            *mut std::ffi::c_void,
            *mut std::ffi::c_void,
            *mut usize,
        ) -> sys::CUresult,
    ),
    /// `cuStreamGetCaptureInfo(stream, status, id)` (CUDA 10.1).
    V1(
        unsafe extern "C" fn(
            sys::CUstream,
            *mut sys::CUstreamCaptureStatus,
            *mut u64,
        ) -> sys::CUresult,
    ),
}

/// The driver's `cuStreamGetCaptureInfo`, looked up once (`None`: the driver exports none).
fn capture_info_fn() -> Option<CaptureInfoFn> {
    static FN: std::sync::OnceLock<Option<CaptureInfoFn>> = std::sync::OnceLock::new();
    *FN.get_or_init(|| {
        // SAFETY: `culib` opens the driver library cudarc already loaded to reach this point
        // (every caller made a context first). Each symbol is looked up under its documented C
        // signature, which the function-pointer types above spell with the same argument and
        // return types (the optional out-parameters as untyped pointers, the same ABI).
        unsafe {
            let lib = sys::culib();
            if let Ok(f) = lib.get(b"cuStreamGetCaptureInfo_v3") {
                return Some(CaptureInfoFn::V3(*f));
            }
            if let Ok(f) = lib.get(b"cuStreamGetCaptureInfo_v2") {
                return Some(CaptureInfoFn::V2(*f));
            }
            if let Ok(f) = lib.get(b"cuStreamGetCaptureInfo") {
                return Some(CaptureInfoFn::V1(*f));
            }
            None
        }
    })
}

fn to_stream(stream: StreamId) -> sys::CUstream {
    std::ptr::without_provenance_mut(stream.0 as usize)
}

fn to_event(event: EventHandle) -> sys::CUevent {
    std::ptr::without_provenance_mut(event.0 as usize)
}

/// A `CUmemLocation` naming device `ordinal`.
///
/// Built field by field from a zeroed value, because its layout differs in name (but not in
/// place) across CUDA versions: `{ type_: u32, id: i32 }` up to 13.1, `{ type_: u32, union { id:
/// i32, .. } }` from 13.2. The device id sits at byte 4 in every version.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    // SAFETY: `CUmemLocation` is plain old data (an enum with a zero variant, `INVALID`, and an
    // integer or a union of integers); all-zero bytes are a valid value of it.
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: the assertion above pins the size to 8 bytes, `type_` (a `repr(u32)` enum) fills
    // bytes 0..4, and the device id (`int`, or the union whose first member is that `int`) fills
    // bytes 4..8 with 4-byte alignment; the pointer is derived from a live local and in bounds.
    unsafe {
        let id = std::ptr::from_mut(&mut location)
            .cast::<u8>()
            .add(4)
            .cast::<i32>();
        id.write(ordinal);
    }
    location
}

/// A `CUmemLocation` naming the host (`CU_MEM_LOCATION_TYPE_HOST`, whose id the driver ignores).
fn host_location() -> sys::CUmemLocation {
    let mut location = device_location(0);
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
    location
}

/// Allocation properties for pinned memory on device `ordinal`, or page-locked host memory when
/// `host` is set.
/// Whether `cuMemCreate` refused the shareable handle type it was asked for (rather than
/// failing for want of memory or for another reason).
fn refuses_handle_type(r: sys::CUresult) -> bool {
    matches!(
        r,
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
            | sys::CUresult::CUDA_ERROR_NOT_PERMITTED
            | sys::CUresult::CUDA_ERROR_INVALID_VALUE
    )
}

fn alloc_prop(ordinal: i32, host: bool) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is plain old data (integers, enums with a zero variant, a null
    // pointer, a byte array); all-zero bytes are a valid value: no shareable handle types, no
    // compression, no flags.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = if host {
        host_location()
    } else {
        device_location(ordinal)
    };
    prop
}

/// The host's memory as `/proc/meminfo` reports it: (`MemAvailable`, `MemTotal`) in bytes.
fn host_mem_info() -> Result<MemInfo, BackendError> {
    let unsupported = || BackendError::Unsupported("host memory figures (/proc/meminfo)");
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|_| unsupported())?;
    let field = |name: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: usize = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    };
    let total = field("MemTotal:").ok_or_else(unsupported)?;
    let free = field("MemAvailable:")
        .or_else(|| field("MemFree:"))
        .ok_or_else(unsupported)?;
    Ok(MemInfo { free, total })
}

/// One CUDA device as a [`DeviceBackend`]. See the module documentation.
///
/// ```no_run
/// use cuda_caching_allocator::backend::cuda::CudaDevice;
/// use cuda_caching_allocator::{DeviceBackend, StreamId};
/// let device = CudaDevice::open(0)?;
/// let ptr = device.allocate(1 << 20, StreamId::DEFAULT)?;
/// // SAFETY: `ptr` came from `allocate` above with this size, and no work uses it.
/// unsafe { device.free(ptr, 1 << 20, StreamId::DEFAULT)? };
/// # Ok::<(), cuda_caching_allocator::BackendError>(())
/// ```
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    ordinal: i32,
    total: usize,
    /// `Some(granularity)` when the device supports virtual memory management.
    granularity: Option<usize>,
    /// Admitted streams (see the module documentation); the cudarc ones are kept alive here.
    streams: RwLock<HashMap<u64, Option<Arc<CudaStream>>>>,
    /// Live events created by this device.
    events: Mutex<HashSet<u64>>,
    /// Host time spent in each kind of driver call ([`CudaDevice::call_times`]), the unmap
    /// helper's included.
    clock: Arc<CallClock>,
    /// The thread that unmaps moved pages' old mappings ([`DeviceBackend::unmap_later`]).
    unmapper: unmap_helper::UnmapHelper,
    /// The process that made this device: a forked child has no helper thread (nor CUDA).
    pid: u32,
    /// Hands out page-locked host memory instead of device memory ([`CudaDevice::host_pages`]).
    host: bool,
    /// A stream this device created through the driver and destroys when dropped
    /// ([`CudaDevice::quiet_stream`]).
    quiet: Option<u64>,
    /// Other devices granted access to everything `map` maps ([`DeviceBackend::add_peer`]).
    peers: Mutex<Vec<i32>>,
    /// Whether device pages are created exportable as POSIX file descriptors (as PyTorch's
    /// expandable segments are); cleared for good the first time the driver refuses that.
    exportable: AtomicBool,
    /// Descriptors exported from physical handles ([`CudaDevice::export_handle`]), by handle;
    /// each is closed when its handle is released.
    exported: Mutex<HashMap<u64, i32>>,
    /// Other processes' pages mapped here ([`CudaDevice::import_pages`]), base → bytes, so that
    /// a peer added later is granted them too (as PyTorch's `enablePeerAccess` grants its opened
    /// handles).
    imports: Arc<Mutex<HashMap<u64, usize>>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("total", &self.total)
            .field("vm_granularity", &self.granularity)
            .field("host_memory", &self.host)
            .field("admitted_streams", &self.streams.read().len())
            .field("live_events", &self.events.lock().len())
            .finish_non_exhaustive()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // The helper finishes its queued unmaps first (the allocator that queued them is gone;
        // in a forked child it forgets the parent's thread instead).
        self.unmapper.stop();
        for (_, fd) in self.exported.get_mut().drain() {
            // SAFETY: `fd` is a descriptor `export_handle` opened and nothing else closes.
            unsafe { libc::close(fd) };
        }
        let Some(quiet) = self.quiet else {
            return;
        };
        let Ok(_bound) = ContextGuard::bind(&self.ctx) else {
            tracing::warn!(target: "cuda_caching_allocator", "could not bind the context to destroy the host-pages stream; it is leaked");
            return;
        };
        // SAFETY: `quiet` is the stream `with_memory` created on this context and nobody else
        // owns; the allocator that used it owned this device and is gone (the device drops last),
        // and the driver finishes any work still queued on it before freeing it.
        if let Err(e) = unsafe { result::stream::destroy(to_stream(StreamId(quiet))) } {
            tracing::warn!(target: "cuda_caching_allocator", %e, "cuStreamDestroy of the host-pages stream failed");
        }
    }
}

impl CudaDevice {
    /// A backend on the device of `ctx`.
    ///
    /// # Errors
    /// A driver error when the context cannot be bound or the device queried.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self, BackendError> {
        Self::with_memory(ctx, false)
    }

    /// A backend on the context of `ctx` whose memory is **page-locked host memory**: the same
    /// streams, events and address reservations as [`new`](Self::new)'s, but physical pages are
    /// created on the host (`cuMemCreate` with `CU_MEM_LOCATION_TYPE_HOST`) and mapped with
    /// read-write access for both this device and the host, so a mapped address is a host
    /// pointer that asynchronous copies of the context use at pinned bandwidth; plain segments
    /// come from `cuMemHostAlloc` and [`mem_info`](DeviceBackend::mem_info) reports the host's
    /// memory (`/proc/meminfo`). A [`CachingAllocator`](crate::CachingAllocator) over it is a
    /// pinned host cache whose expandable segments move host pages
    /// ([`PagedPinnedCache`](crate::host::PagedPinnedCache)); it does not know that the host
    /// writes the memory outside stream order, so it needs that wrapper's fenced frees.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`BackendError::Unsupported`] when the device cannot map host
    /// pages (no virtual memory management) or the host's memory cannot be read.
    pub fn host_pages(ctx: Arc<CudaContext>) -> Result<Self, BackendError> {
        let device = Self::with_memory(ctx, true)?;
        if device.granularity.is_none() {
            return Err(BackendError::Unsupported(
                "host pages (the device has no virtual memory management)",
            ));
        }
        Ok(device)
    }

    /// Whether this backend hands out host memory ([`host_pages`](Self::host_pages)).
    pub fn is_host_memory(&self) -> bool {
        self.host
    }

    /// The admitted stream a host-pages backend ([`host_pages`](Self::host_pages)) places its
    /// blocks on: a non-blocking stream created through the driver (`cuStreamCreate`), not
    /// through cudarc, so the context's stream count, and with it cudarc's event tracking, stays
    /// as the program left it; nothing is queued on it but the allocator's own event records.
    /// Destroyed with the device. `None` for device memory.
    pub fn quiet_stream(&self) -> Option<StreamId> {
        self.quiet.map(StreamId)
    }

    fn with_memory(ctx: Arc<CudaContext>, host: bool) -> Result<Self, BackendError> {
        let bound = ContextGuard::bind(&ctx)?;
        let ordinal = i32::try_from(ctx.ordinal()).map_err(|_| BackendError::InvalidArgument {
            operation: "CudaDevice::new",
            reason: format!("device ordinal {} out of range", ctx.ordinal()),
        })?;
        let total = if host {
            host_mem_info()?.total
        } else {
            ctx.total_mem().map_err(|e| driver("cuDeviceTotalMem", e))?
        };
        let vmm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )
            .map_err(|e| driver("cuDeviceGetAttribute", e))?;
        let granularity = if vmm > 0 {
            let prop = alloc_prop(ordinal, host);
            let mut granularity = 0usize;
            // SAFETY: both pointers point to live locals of the right types for the call's
            // duration; `prop` is a valid property value (see `alloc_prop`).
            let r = unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            };
            r.result()
                .map_err(|e| driver("cuMemGetAllocationGranularity", e))?;
            (granularity > 0).then_some(granularity)
        } else {
            None
        };
        let mut streams = HashMap::new();
        let quiet = if host {
            // The context is bound (above). A stream of our own, not cudarc's: see
            // `quiet_stream`.
            let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| driver("cuStreamCreate", e))?;
            let id = raw.addr() as u64;
            streams.insert(id, None);
            Some(id)
        } else {
            None
        };
        drop(bound);
        Ok(CudaDevice {
            ctx,
            ordinal,
            total,
            granularity,
            streams: RwLock::new(streams),
            events: Mutex::new(HashSet::new()),
            clock: Arc::default(),
            unmapper: unmap_helper::UnmapHelper::default(),
            pid: std::process::id(),
            host,
            quiet,
            peers: Mutex::new(Vec::new()),
            exportable: AtomicBool::new(!host),
            exported: Mutex::new(HashMap::new()),
            imports: Arc::default(),
        })
    }

    /// Whether this device's pages are created exportable (`false` for host pages, and once the
    /// driver refused a shareable handle type).
    pub fn exports_pages(&self) -> bool {
        self.exportable.load(Ordering::Relaxed)
    }

    /// A POSIX file descriptor for the physical handle `handle` (`cuMemExportToShareableHandle`),
    /// which another process takes with `pidfd_getfd` and imports
    /// ([`CudaDevice::import_pages`]). Exported once per handle (about half a millisecond alone)
    /// and kept open until [`release_export`](DeviceBackend::release_export) (the cache calls it
    /// when the last exported allocation on the handle is freed: every importer has taken the
    /// descriptor by then; or at once when the export it belonged to failed on a later handle
    /// and no exported allocation holds this one) or until the handle is released.
    ///
    /// # Errors
    /// [`BackendError::InvalidArgument`] for host pages; a driver error when the handle was
    /// created without a shareable type (the driver refused one, warned when it happened) or
    /// the process has no descriptor left (`EMFILE`: raise `ulimit -n`).
    ///
    /// # Safety
    /// `handle` is a live physical handle created by this device and not released.
    pub unsafe fn export_handle(&self, handle: PhysicalHandle) -> Result<i32, BackendError> {
        if self.host {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemExportToShareableHandle",
                reason: "host pages are not shared between processes".into(),
            });
        }
        let mut exported = self.exported.lock();
        if let Some(&fd) = exported.get(&handle.0) {
            return Ok(fd);
        }
        let _bound = self.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` is a live local of the type the POSIX descriptor handle type writes;
        // `handle` is live by the caller's promise.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast(),
                handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        r.result()
            .map_err(|e| driver("cuMemExportToShareableHandle", e))?;
        exported.insert(handle.0, fd);
        Ok(fd)
    }

    /// The driver calls the cache made through this device so far and the host time spent
    /// inside them, by kind (each timed whole: context binding and argument checks included).
    /// Two readings and [`DeviceCallTimes::since`] give an interval's figures.
    pub fn call_times(&self) -> DeviceCallTimes {
        self.clock.snapshot()
    }

    /// A backend on device `ordinal`, through its primary context (the one the CUDA runtime and
    /// PyTorch use).
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when no CUDA driver is installed; a driver error when the
    /// device does not exist or its context cannot be created.
    pub fn open(ordinal: usize) -> Result<Self, BackendError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(BackendError::InvalidArgument {
                operation: "CudaDevice::open",
                reason: format!("device {ordinal} does not exist ({count} CUDA devices)"),
            });
        }
        // cudarc's `CudaContext::new` makes the new context current; put back the caller's.
        let _restore = ContextGuard::save()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
        CudaDevice::new(ctx)
    }

    /// The cudarc context this device allocates in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes this device's context current on the calling thread until the guard drops (which
    /// puts the caller's context back, or none).
    pub(crate) fn bind(&self) -> Result<impl Drop + use<>, BackendError> {
        ContextGuard::bind(&self.ctx)
    }

    fn is_default_stream(stream: StreamId) -> bool {
        matches!(stream.0, 0 | STREAM_LEGACY | STREAM_PER_THREAD)
    }

    /// Whether `stream` may be handed to the driver (a default stream or an admitted one).
    pub fn is_admitted(&self, stream: StreamId) -> bool {
        Self::is_default_stream(stream) || self.streams.read().contains_key(&stream.0)
    }

    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        if self.is_admitted(stream) {
            Ok(())
        } else {
            Err(BackendError::InvalidStream {
                stream,
                reason: "not admitted to this CudaDevice (use CudaDevice::admit_stream)".into(),
            })
        }
    }

    /// Admits a cudarc stream, so that the cache may allocate on it and record events on it, and
    /// returns its [`StreamId`]. The device keeps a clone of the `Arc`, so the stream stays alive
    /// while the cache may still use it, until the device is dropped or the stream released
    /// (`CudaAllocator::release_unused_streams`, which drops streams that nothing else holds and
    /// the cache no longer refers to). Admitting twice is cheap.
    ///
    /// # Errors
    /// [`BackendError::InvalidStream`] when the stream belongs to another context.
    pub fn admit_stream(&self, stream: &Arc<CudaStream>) -> Result<StreamId, BackendError> {
        self.admit_stream_counted(stream).map(|(id, _)| id)
    }

    /// [`admit_stream`](Self::admit_stream), also returning the number of admitted streams when
    /// this call admitted a new one (`None` when the stream was known or a default stream).
    pub(crate) fn admit_stream_counted(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<(StreamId, Option<usize>), BackendError> {
        let id = stream_id(stream);
        if Self::is_default_stream(id) || self.streams.read().contains_key(&id.0) {
            return Ok((id, None));
        }
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(BackendError::InvalidStream {
                stream: id,
                reason: format!(
                    "the stream belongs to the context of device {}, not device {}",
                    stream.context().ordinal(),
                    self.ordinal
                ),
            });
        }
        let mut streams = self.streams.write();
        streams
            .entry(id.0)
            .or_insert_with(|| Some(Arc::clone(stream)));
        Ok((id, Some(streams.len())))
    }

    /// How many streams are admitted (cudarc and raw ones; the default streams do not count).
    pub fn admitted_stream_count(&self) -> usize {
        self.streams.read().len()
    }

    /// The admitted cudarc streams that nothing but this device holds any more: no buffer, view,
    /// cudarc object or user keeps their `Arc`, so no new work can be queued on them.
    pub fn unheld_streams(&self) -> Vec<StreamId> {
        self.streams
            .read()
            .iter()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| Arc::strong_count(s) == 1))
            .map(|(&id, _)| StreamId(id))
            .collect()
    }

    /// Takes the device's hold on the admitted cudarc stream `stream` out of the admitted set, if
    /// nothing else holds it; the caller drops it (cudarc then destroys the stream, which lets
    /// its queued work finish). Afterwards the stream is no longer admitted.
    pub(crate) fn take_unheld_stream(&self, stream: StreamId) -> Option<Arc<CudaStream>> {
        let mut streams = self.streams.write();
        let held = streams
            .get(&stream.0)?
            .as_ref()
            .is_none_or(|s| Arc::strong_count(s) > 1);
        if held {
            return None;
        }
        streams.remove(&stream.0).flatten()
    }

    /// Runs `f` and then puts back the calling thread's current context, as every call of this
    /// device does: for work that lets cudarc bind this device's context (dropping cudarc
    /// streams, events or slices binds it).
    pub(crate) fn with_callers_context<R>(&self, f: impl FnOnce() -> R) -> R {
        let guard = callers_context();
        let out = f();
        drop(guard);
        out
    }

    /// Admits a raw `CUstream` handle (from C, or from PyTorch through the pluggable-allocator
    /// interface). The handle's context is checked against this device's.
    ///
    /// # Errors
    /// [`BackendError::InvalidStream`] when the stream belongs to another context; a driver error
    /// when the query fails.
    ///
    /// # Safety
    /// 1. `stream` is `0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, or a live stream handle.
    /// 2. The stream stays alive for as long as this device may use it: until every block
    ///    allocated on it or recorded with it has been released, or until the device is dropped.
    pub unsafe fn admit_raw_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        if self.is_admitted(stream) {
            return Ok(());
        }
        let _bound = self.bind()?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: obligation 1 makes `stream` a live stream handle; `ctx` is a live local.
        let r = unsafe { sys::cuStreamGetCtx(to_stream(stream), &mut ctx) };
        r.result().map_err(|e| driver("cuStreamGetCtx", e))?;
        if ctx != self.ctx.cu_ctx() {
            return Err(BackendError::InvalidStream {
                stream,
                reason: format!(
                    "the stream does not belong to the context of device {}",
                    self.ordinal
                ),
            });
        }
        self.streams.write().entry(stream.0).or_insert(None);
        Ok(())
    }

    /// Events created by this device and not yet destroyed (the cache pools them, so this stays
    /// small; the GPU tests check that plain allocation creates none).
    pub fn live_event_count(&self) -> usize {
        self.events.lock().len()
    }

    fn check_event(&self, event: EventHandle, operation: &'static str) -> Result<(), BackendError> {
        if self.events.lock().contains(&event.0) {
            Ok(())
        } else {
            Err(BackendError::InvalidArgument {
                operation,
                reason: format!("unknown event {:#x}", event.0),
            })
        }
    }
}

// SAFETY: (1) `allocate` returns what `cuMemAlloc` returned: a non-null (checked) range of the
// requested size, aligned to at least 256 bytes (the driver's documented guarantee, reported by
// `alignment`), which the driver never hands out again before `cuMemFree`; `reserve_address_range`
// likewise returns a fresh, non-null range from `cuMemAddressReserve`, so every range mapped into
// it is disjoint from all segments. (2) Memory from `cuMemAlloc` or mapped with read-write access
// for this device stays valid for work on every stream of the context until it is freed or
// unmapped, which only the cache's unsafe calls do. (3) `mem_info().total` is the device's total
// memory as `cuMemGetInfo` reports it, a constant of the hardware. In host mode
// (`CudaDevice::host_pages`) the same holds with `cuMemHostAlloc` / `cuMemFreeHost` for
// `cuMemAlloc` / `cuMemFree` (page-aligned, PORTABLE, so usable by every stream of the context),
// host pages for device pages (mapped read-write for this device), and the host's total memory,
// read once at construction, for the device's.
unsafe impl DeviceBackend for CudaDevice {
    fn device_index(&self) -> usize {
        self.ctx.ordinal()
    }

    fn alignment(&self) -> usize {
        CUDA_ALIGNMENT
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        if self.host {
            // The total must stay the constant of `new`'s reading (contract 3).
            return host_mem_info().map(|m| MemInfo {
                free: m.free.min(self.total),
                total: self.total,
            });
        }
        let _bound = self.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        Ok(MemInfo { free, total })
    }

    fn allocate(&self, size: usize, _stream: StreamId) -> Result<DeviceAddr, BackendError> {
        if size == 0 {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemAlloc",
                reason: "size 0".into(),
            });
        }
        let _timed = self.clock.start(CallKind::Allocate);
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        let ptr = if self.host {
            // SAFETY: the context is bound to this thread (above); `size` is non-zero. PORTABLE
            // makes the memory usable by every context; with unified addressing (every device
            // with virtual memory management) the host pointer is also the device pointer.
            let p = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| driver("cuMemHostAlloc", e))?;
            p as u64
        } else {
            // SAFETY: the context is bound to this thread (above); `size` is non-zero. The
            // returned memory is owned by the caller until `free`.
            unsafe { result::malloc_sync(size) }.map_err(|e| driver("cuMemAlloc", e))?
        };
        if ptr == 0 {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemAlloc",
                reason: "the driver returned a null pointer".into(),
            });
        }
        Ok(DeviceAddr(ptr))
    }

    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        _size: usize,
        _stream: StreamId,
    ) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::Free);
        let _bound = self.bind()?;
        if self.host {
            // SAFETY: the caller's obligation 1 makes `ptr` a live `cuMemHostAlloc` pointer of
            // this backend (`allocate` in host mode); obligation 2 says no queued work uses it.
            return unsafe { result::free_host(ptr.0 as usize as *mut std::ffi::c_void) }
                .map_err(|e| driver("cuMemFreeHost", e));
        }
        // SAFETY: the caller's obligation 1 makes `ptr` a live `cuMemAlloc` pointer of this
        // context (bound above); obligation 2 says no queued work still uses it (and `cuMemFree`
        // itself waits for the device).
        unsafe { result::free_sync(ptr.0) }.map_err(|e| driver("cuMemFree", e))
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::Synchronize);
        let _bound = self.bind()?;
        result::ctx::synchronize().map_err(|e| driver("cuCtxSynchronize", e))
    }

    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.check_stream(stream)
    }

    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        self.check_stream(stream)?;
        let Some(f) = capture_info_fn() else {
            return Err(BackendError::Unsupported("cuStreamGetCaptureInfo"));
        };
        let _bound = self.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: u64 = 0;
        let null = std::ptr::null_mut();
        // SAFETY: `stream` is admitted (a default stream or one kept alive by this device,
        // checked above); `status` and `id` are live locals; the optional out-parameters are null,
        // which every version documents as "not wanted".
        let r = unsafe {
            match f {
                CaptureInfoFn::V3(f) => f(
                    to_stream(stream),
                    &mut status,
                    &mut id,
                    null,
                    null,
                    null,
                    std::ptr::null_mut(),
                ),
                CaptureInfoFn::V2(f) => f(
                    to_stream(stream),
                    &mut status,
                    &mut id,
                    null,
                    null,
                    std::ptr::null_mut(),
                ),
                CaptureInfoFn::V1(f) => f(to_stream(stream), &mut status, &mut id),
            }
        };
        r.result()
            .map_err(|e| driver("cuStreamGetCaptureInfo", e))?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
            // An invalidated capture keeps its id until it ends; routing its allocations to its
            // pool keeps them away from other work until then.
            _ => Some(id),
        })
    }

    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::StreamSynchronize);
        self.check_stream(stream)?;
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        // SAFETY: `check_stream` passed, so `stream` is a default stream or an admitted live
        // stream of this context (bound above).
        unsafe { result::stream::synchronize(to_stream(stream)) }
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    fn create_event(&self) -> Result<EventHandle, BackendError> {
        let _timed = self.clock.start(CallKind::EventCreate);
        let _bound = self.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate", e))?;
        let handle = EventHandle(event.addr() as u64);
        self.events.lock().insert(handle.0);
        Ok(handle)
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::EventRecord);
        self.check_event(event, "cuEventRecord")?;
        self.check_stream(stream)?;
        let _bound = self.bind()?;
        // SAFETY: the event is live (created here, not destroyed: checked) and the stream is a
        // default or admitted live stream of this context (checked).
        unsafe { result::event::record(to_event(event), to_stream(stream)) }
            .map_err(|e| driver("cuEventRecord", e))
    }

    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        let _timed = self.clock.start(CallKind::EventQuery);
        self.check_event(event, "cuEventQuery")?;
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        // SAFETY: the event is live (checked above).
        match unsafe { result::event::query(to_event(event)) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(driver("cuEventQuery", e)),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::StreamSynchronize);
        self.check_event(event, "cuEventSynchronize")?;
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        // SAFETY: the event is live (checked above).
        unsafe { result::event::synchronize(to_event(event)) }
            .map_err(|e| driver("cuEventSynchronize", e))
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::StreamWaitEvent);
        self.check_event(event, "cuStreamWaitEvent")?;
        self.check_stream(stream)?;
        let _bound = self.bind()?;
        // SAFETY: the event is live and the stream a default or admitted live stream (checked).
        unsafe {
            result::stream::wait_event(
                to_stream(stream),
                to_event(event),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver("cuStreamWaitEvent", e))
    }

    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        // Removing first makes a concurrent second destroy of the same handle fail cleanly.
        if !self.events.lock().remove(&event.0) {
            return Err(BackendError::InvalidArgument {
                operation: "cuEventDestroy",
                reason: format!("unknown event {:#x}", event.0),
            });
        }
        let _bound = self.bind()?;
        // SAFETY: the event was live (it was in the set, which only `create_event` fills) and is
        // destroyed once (it left the set above); obligation 1 of the caller is thereby checked.
        unsafe { result::event::destroy(to_event(event)) }.map_err(|e| driver("cuEventDestroy", e))
    }

    fn vm_granularity(&self) -> Option<usize> {
        self.granularity
    }

    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        let gran = self
            .granularity
            .ok_or(BackendError::Unsupported("virtual memory"))?;
        if size == 0 || size % gran != 0 {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemAddressReserve",
                reason: format!("size {size} is not a positive multiple of the granularity {gran}"),
            });
        }
        let _timed = self.clock.start(CallKind::Reserve);
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a live local; alignment 0 (the default), no fixed address, no flags.
        let r = unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) };
        r.result().map_err(|e| driver("cuMemAddressReserve", e))?;
        Ok(DeviceAddr(base))
    }

    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::ReleaseRange);
        let _bound = self.bind()?;
        // SAFETY: the caller's obligations: `base`/`size` are one live reservation of this device
        // and nothing is mapped in it.
        unsafe { sys::cuMemAddressFree(base.0, size) }
            .result()
            .map_err(|e| driver("cuMemAddressFree", e))
    }

    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        let gran = self
            .granularity
            .ok_or(BackendError::Unsupported("virtual memory"))?;
        if size == 0 || size % gran != 0 {
            return Err(BackendError::InvalidArgument {
                operation: "cuMemCreate",
                reason: format!("size {size} is not a positive multiple of the granularity {gran}"),
            });
        }
        let _timed = self.clock.start(CallKind::Create);
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        let mut prop = alloc_prop(self.ordinal, self.host);
        let exportable = self.exportable.load(Ordering::Relaxed);
        if exportable {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` and `prop` are live locals; `prop` describes pinned memory on this
        // device or on the host; `size` is a positive multiple of the granularity (checked
        // above, the granularity of that same kind of memory).
        let mut r = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        if exportable && refuses_handle_type(r) {
            // The driver cannot make this memory exportable (as PyTorch, fall back to memory
            // that other processes cannot import, and say so once).
            self.exportable.store(false, Ordering::Relaxed);
            tracing::warn!(target: "cuda_caching_allocator", device = self.ordinal, result = ?r, "cuMemCreate refused exportable memory; pages of this device cannot be shared with other processes");
            prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
            // SAFETY: as above.
            r = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        }
        r.result().map_err(|e| driver("cuMemCreate", e))?;
        Ok(PhysicalHandle(handle))
    }

    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        _size: usize,
    ) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::Release);
        let _bound = self.bind()?;
        // SAFETY: the caller's obligations: `handle` is a live handle of this device, mapped
        // nowhere.
        unsafe { sys::cuMemRelease(handle.0) }
            .result()
            .map_err(|e| driver("cuMemRelease", e))?;
        if let Some(fd) = self.exported.lock().remove(&handle.0) {
            // SAFETY: `fd` was exported from the handle just released and nothing else closes
            // it; a process that imported it holds its own reference to the memory.
            unsafe { libc::close(fd) };
        }
        Ok(())
    }

    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let mapping = self.clock.start(CallKind::Map);
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        // SAFETY: the caller's obligations: `[va, va + size)` lies in one reservation of this
        // device with nothing mapped, and `handle` is a live handle of exactly `size` bytes.
        unsafe { sys::cuMemMap(va.0, size, 0, handle.0, 0) }
            .result()
            .map_err(|e| driver("cuMemMap", e))?;
        drop(mapping);
        let _timed = self.clock.start(CallKind::SetAccess);
        let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let mut access = vec![sys::CUmemAccessDesc {
            location: device_location(self.ordinal),
            flags: rw,
        }];
        // Host pages are granted to the host as well, so the mapped address is a host pointer.
        if self.host {
            access.push(sys::CUmemAccessDesc {
                location: host_location(),
                flags: rw,
            });
        }
        // Devices that enabled peer access to this one reach its mappings only if granted.
        access.extend(self.peers.lock().iter().map(|&p| sys::CUmemAccessDesc {
            location: device_location(p),
            flags: rw,
        }));
        // SAFETY: the range was mapped just above; `access` is a live vector of `access.len()`
        // descriptors.
        let r = unsafe { sys::cuMemSetAccess(va.0, size, access.as_ptr(), access.len()) };
        if let Err(e) = r.result() {
            // SAFETY: undoes the mapping made above, which no work can have used yet (it had no
            // access rights). A failure here leaves the mapping, which the error reports.
            let undo = unsafe { sys::cuMemUnmap(va.0, size) }.result();
            if let Err(u) = undo {
                tracing::error!(target: "cuda_caching_allocator", %u, "cuMemUnmap after a failed cuMemSetAccess failed");
            }
            return Err(driver("cuMemSetAccess", e));
        }
        Ok(())
    }

    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::Unmap);
        let _bound = self.bind()?;
        // SAFETY: the caller's obligations: the range is exactly one earlier `map` of this device
        // and no queued work uses it.
        unsafe { sys::cuMemUnmap(va.0, size) }
            .result()
            .map_err(|e| driver("cuMemUnmap", e))
    }

    /// Device memory only (a host-pages device unmaps on the caller's thread), with virtual
    /// memory, in the process that made the device.
    fn unmaps_off_thread(&self) -> bool {
        !self.host && self.granularity.is_some() && std::process::id() == self.pid
    }

    unsafe fn unmap_later(&self, ranges: Vec<(DeviceAddr, usize)>) -> Result<u64, BackendError> {
        if !self.unmaps_off_thread() {
            return Err(BackendError::Unsupported("unmaps on a helper thread"));
        }
        // SAFETY: the caller's obligations, forwarded: each range is one live mapping of this
        // device, unused by queued work and left alone until the job is reported finished.
        unsafe { self.unmapper.submit(&self.ctx, &self.clock, ranges) }
    }

    fn finished_unmaps(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        self.unmapper.finished(tickets)
    }

    fn wait_unmaps(&self) {
        self.unmapper.wait();
    }

    fn release_export(&self, handle: PhysicalHandle) {
        if let Some(fd) = self.exported.lock().remove(&handle.0) {
            // SAFETY: `fd` was exported from `handle` by `export_handle` and nothing else closes
            // it; the processes that imported it hold their own references.
            unsafe { libc::close(fd) };
        }
    }

    fn add_peer(&self, peer: usize) -> Result<bool, BackendError> {
        if self.granularity.is_none() {
            return Err(BackendError::Unsupported("peer access to mapped memory"));
        }
        let count = device_count()?;
        let id = i32::try_from(peer)
            .ok()
            .filter(|&p| p != self.ordinal && peer < count);
        let Some(id) = id else {
            return Err(BackendError::InvalidArgument {
                operation: "add_peer",
                reason: format!(
                    "device {peer} is not a peer of device {}: this machine has {count} device(s)",
                    self.ordinal
                ),
            });
        };
        let mut peers = self.peers.lock();
        if peers.contains(&id) {
            return Ok(false);
        }
        // A peer the driver cannot give access would fail every later `map`'s access setting.
        let own = result::device::get(self.ordinal).map_err(|e| driver("cuDeviceGet", e))?;
        let other = result::device::get(id).map_err(|e| driver("cuDeviceGet", e))?;
        let mut can: std::ffi::c_int = 0;
        // SAFETY: `can` is a live local the driver writes; both devices come from `cuDeviceGet`.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, other, own) }
            .result()
            .map_err(|e| driver("cuDeviceCanAccessPeer", e))?;
        if can == 0 {
            return Err(BackendError::InvalidArgument {
                operation: "add_peer",
                reason: format!(
                    "device {peer} cannot access device {}'s memory (cuDeviceCanAccessPeer)",
                    self.ordinal
                ),
            });
        }
        peers.push(id);
        // Pages of other processes mapped here: granted now (they are mapped nowhere else).
        let imports = self.imports.lock();
        if !imports.is_empty() {
            let _bound = self.bind()?;
            let desc = sys::CUmemAccessDesc {
                location: device_location(id),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            for (&base, &size) in imports.iter() {
                // SAFETY: `[base, base + size)` is an imported range, wholly mapped while it is
                // listed (its drop takes it out of the list, under this lock, before unmapping).
                unsafe { sys::cuMemSetAccess(base, size, &desc, 1) }
                    .result()
                    .map_err(|e| driver("cuMemSetAccess", e))?;
            }
        }
        Ok(true)
    }

    unsafe fn grant_peer(
        &self,
        va: DeviceAddr,
        size: usize,
        peer: usize,
    ) -> Result<(), BackendError> {
        let _timed = self.clock.start(CallKind::SetAccess);
        let id = i32::try_from(peer).map_err(|_| BackendError::InvalidArgument {
            operation: "grant_peer",
            reason: format!("device {peer} is out of range"),
        })?;
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter()?;
        let access = sys::CUmemAccessDesc {
            location: device_location(id),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the caller's obligation: the range is exactly one mapping of this device,
        // still mapped; `access` is one live descriptor.
        unsafe { sys::cuMemSetAccess(va.0, size, &access, 1) }
            .result()
            .map_err(|e| driver("cuMemSetAccess", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_puts_the_device_id_at_byte_four() {
        let loc = device_location(3);
        // SAFETY: reading the 8 bytes of a live, fully initialised 8-byte value.
        let bytes: [u8; 8] = unsafe { std::mem::transmute(loc) };
        assert_eq!(&bytes[4..], &3i32.to_ne_bytes());
        assert_eq!(
            &bytes[..4],
            &(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32).to_ne_bytes()
        );
    }

    #[test]
    fn out_of_memory_maps_to_its_own_variant() {
        assert!(
            driver("x", DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)).is_out_of_memory()
        );
        let other = driver("x", DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert!(matches!(other, BackendError::Driver { operation: "x", .. }));
        assert!(std::error::Error::source(&other).is_some());
    }

    #[test]
    fn default_streams_are_always_admitted() {
        for s in [0, STREAM_LEGACY, STREAM_PER_THREAD] {
            assert!(CudaDevice::is_default_stream(StreamId(s)));
        }
        assert!(!CudaDevice::is_default_stream(StreamId(0x1234)));
    }
}
