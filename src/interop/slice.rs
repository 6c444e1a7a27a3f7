//! `CachedSlice<T>`: an owned typed device buffer from the cache, usable wherever cudarc takes a
//! `CudaSlice<T>` through its traits, with cudarc's stream ordering. May use: the core,
//! `backend::cuda`, `interop::view`, `interop::events`.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    self as cu, CudaStream, DeviceRepr, LaunchArgs, PushKernelArg, SyncOnDrop, sys,
};

use super::allocator::CudaAllocator;
use super::events::{EventShell, TypedShell};
use super::view::{CachedView, CachedViewMut, ViewEvents};
use crate::backend::cuda::stream_id;
use crate::{DeviceAddr, Result, StreamId};

/// `len` values of `T` in device memory owned by a caching allocator; dropping it returns the
/// memory to the cache (never to the driver directly, and without synchronizing).
///
/// It implements cudarc's [`DeviceSlice`](cu::DeviceSlice), [`DevicePtr`](cu::DevicePtr),
/// [`DevicePtrMut`](cu::DevicePtrMut) and [`PushKernelArg`] (for `&buf` and `&mut buf`), so
/// `stream.memcpy_htod(&host, &mut buf)`, `stream.memcpy_dtod(&a, &mut b)`,
/// `stream.memset_zeros(&mut buf)`, `stream.launch_builder(&f).arg(&mut buf)` and cuBLAS's
/// `gemm(cfg, &a, &b, &mut c)` accept it unchanged.
///
/// # Streams: cudarc's rules
///
/// Across streams it behaves exactly as cudarc's `CudaSlice`: while the context manages stream
/// synchronization (more than one stream, event tracking on — cudarc's default), a stream that
/// reads the buffer first waits for its last write, a stream that writes it first waits for its
/// last reads and write, every use records the buffer's read or write event, and dropping the
/// buffer makes its allocation stream wait for every stream's last use before the memory goes
/// back to the cache. The two events are cudarc's own (see the `interop::events` module): they
/// stay with the block's address in the allocator and are taken back by the next buffer there at
/// its first use, so a cache hit creates no CUDA event; a first use while the buffer's stream is
/// capturing makes new events instead, as cudarc's `alloc` gives each buffer (Note [Event shells
/// and captures]). With event tracking off no event is made, and with one stream the events
/// order nothing, as cudarc's; [`record_stream`](Self::record_stream) (PyTorch's rule) then
/// declares a use on another stream.
///
/// A zero-length buffer has the null pointer and takes no memory.
pub struct CachedSlice<T> {
    /// The `CUdeviceptr`; kernel arguments point at this field when no shell exists, so it must
    /// stay in place while borrowed (it does: pushing borrows `self`).
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The cache block's size (at least the buffer's bytes): a shell made for the pool covers
    /// it, so that a later, larger buffer at this address can take it too.
    block_size: usize,
    stream: Arc<CudaStream>,
    alloc: CudaAllocator,
    /// cudarc's read/write events for this buffer, made (or taken back from the allocator's
    /// pool) at its first use while the context manages stream synchronization (Note [Event
    /// shells and captures]).
    shell: OnceLock<EventShell>,
    /// The shell was made for a first use while the buffer's stream was capturing: its events
    /// may be recorded inside the capture, so it is destroyed with the buffer, never pooled.
    captured: AtomicBool,
    /// cudarc's own `CudaSlice<T>` over the same memory, made on request
    /// ([`as_cuda_slice`](Self::as_cuda_slice)); once it exists, every new use goes through its
    /// events.
    typed: OnceLock<TypedShell<T>>,
    /// The `CudaSlice<T>` handed out by an `as_cuda_slice` while event tracking was off: without
    /// events, and used for nothing else (Note [Typed buffers made while tracking is off]).
    typed_untracked: OnceLock<TypedShell<T>>,
    /// The byte shell's uses are folded into the typed shell's events (`prepare_mut`): once a
    /// mutable use follows the typed shell's making, nothing records on the byte shell again.
    folded: bool,
    marker: PhantomData<*const T>,
}

// SAFETY: the buffer holds no `T` on the host, only a device address, a stream handle, the
// allocator handle and cudarc events (all `Send + Sync`); cudarc's `CudaSlice<T>` is `Send + Sync`
// for every `T` for the same reason.
unsafe impl<T> Send for CachedSlice<T> {}
// SAFETY: as for `Send`; every `&self` method is safe to call from several threads (the lazily
// made event shell sits in a `OnceLock`).
unsafe impl<T> Sync for CachedSlice<T> {}

impl<T> fmt::Debug for CachedSlice<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedSlice")
            .field("ptr", &DeviceAddr(self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream_id())
            .field("device", &self.alloc.ordinal())
            .field("events", &self.has_events())
            .finish()
    }
}

impl<T> Drop for CachedSlice<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // cudarc binds the buffer's context for its waits and event destructions; the caller's
        // current context is put back afterwards, as after every call of the cache.
        let restore = crate::backend::cuda::callers_context();
        self.release();
        drop(restore);
    }
}

impl<T> CachedSlice<T> {
    /// The drop's work: the waits, the event shells, and the block back to the cache (or held).
    fn release(&mut self) {
        // Note [Drops inside a capture]. A failed query keeps the shell out of the pool (as at a
        // first use) but frees the block: holding every block of a driver that cannot answer
        // would hold them all.
        let status = self.own_capture_status();
        self.retire_events(status);
        if status == Some(true) && self.hold_for_graph() {
            return;
        }
        // SAFETY: the buffer owns the block at `self.ptr` (it came from this allocator and no
        // other handle frees it); it is never used again after this point.
        if let Err(e) = unsafe { self.alloc.free(DeviceAddr(self.ptr)) } {
            // Nothing can be returned from Drop; the memory stays with the cache as a leak.
            if !std::thread::panicking() {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DeviceAddr(self.ptr), error = %e, "freeing a CachedSlice failed");
            }
        }
    }

    /// The drop's work on the events, also `leak`'s: the allocation stream's waits, the typed
    /// shells destroyed, the byte shell kept, quarantined or destroyed, and a kernel's use
    /// without events settled. `status` is the buffer's stream's capture status (`None`: the
    /// query failed).
    //
    // Note [Leaked buffers end their events as dropped ones]: `leak` ended the buffer's events
    // by letting its fields drop (the byte shell destroyed, never kept, and inside a capture
    // waiting on the legacy default stream), left a kernel's use without events unsettled (the
    // allocation stream did not wait for it, where `leak` promises the waits of a drop, and its
    // mark stayed with the address for a later buffer there), and left the caller's context
    // replaced by the buffer's. It now does the drop's work on the events, with the caller's
    // context put back, and only keeps the block
    // (`cuda_a_leak_waits_for_a_kernel_use_without_events`,
    // `cuda_a_leak_keeps_the_callers_context_and_the_blocks_events`).
    fn retire_events(&mut self, status: Option<bool>) {
        let in_capture = status.unwrap_or(true);
        let waited = self.wait_last_uses();
        // The typed shell (if any) is destroyed: its events were made for this buffer only.
        // It lives on the buffer's stream (whose waits a capture records with the buffer's
        // drop) and ends as cudarc's own buffer does, errors included.
        let typed = self.typed.take();
        let had_typed = typed.is_some();
        drop(typed);
        drop(self.typed_untracked.take());
        if let Some(mut shell) = self.shell.take() {
            if in_capture && !*self.captured.get_mut() {
                // A pooled shell lives on the legacy default stream: its destruction waits.
                self.alloc.shells().quarantine(shell);
                self.evict_stale_kept_shell(in_capture);
            } else if waited && !in_capture {
                if had_typed {
                    // Note [Kept shells after a typed one]: the uses since the typed shell's
                    // making recorded only its events, which the allocation stream has just
                    // waited for; the kept shell's write is recorded after those waits, so the
                    // block's next buffer orders a first use elsewhere after them too.
                    record_write_on(&mut shell, &self.stream);
                }
                pool_shell(&self.alloc, self.ptr, shell);
            } else {
                // Note [Event shells and captures]: events that may be recorded inside a
                // capture are destroyed, never kept (the drop waits on them on the shell's
                // stream, as a `CudaSlice`'s drop does, and leaves the context the error a
                // `CudaSlice` dropped after its capture leaves).
                drop(shell);
                self.evict_stale_kept_shell(in_capture);
            }
        }
        // Note [Uses without events]: a kernel may still use it.
        self.alloc
            .shells()
            .settle_unordered(self.ptr, self.stream.context());
    }
}

/// The cudarc buffer whose events a use goes through: the typed shell once it exists (it is then
/// the buffer's only event pair for new uses), else the byte shell, else none.
pub(super) enum Events<'a, T> {
    /// The typed shell (`as_cuda_slice` was called).
    Typed(&'a cu::CudaSlice<T>),
    /// The pooled byte shell.
    Bytes(&'a cu::CudaSlice<u8>),
    /// No events: cudarc orders nothing, or they could not be made.
    None,
}

/// [`Events`] for a mutable use.
pub(super) enum EventsMut<'a, T> {
    /// The typed shell.
    Typed(&'a mut cu::CudaSlice<T>),
    /// The pooled byte shell.
    Bytes(&'a mut cu::CudaSlice<u8>),
    /// No events.
    None,
}

/// Whether cudarc manages stream synchronization for buffers of `stream`'s context.
#[inline]
pub(super) fn managing(stream: &CudaStream) -> bool {
    stream.context().is_managing_stream_synchronization()
}

/// The guard for a use with no event shell: nothing to record when cudarc orders nothing, a
/// synchronize of the using stream after the use when it should have and the shell could not be
/// made (the use is then complete before anything else can conflict with it).
///
/// The buffer at `base` (its owner's address) first settles a kernel's use without events
/// (Note [Uses without events]).
#[inline]
pub(super) fn untracked<'a>(
    alloc: &CudaAllocator,
    base: sys::CUdeviceptr,
    owner: &CudaStream,
    using: &'a CudaStream,
) -> SyncOnDrop<'a> {
    if managing(owner) {
        alloc.shells().settle_unordered(base, owner.context());
        SyncOnDrop::sync_stream(using)
    } else {
        SyncOnDrop::Record(None)
    }
}

/// A kernel argument of the buffer at `base` without events while cudarc orders streams.
//
// Note [Uses without events]: while cudarc orders streams, a buffer whose events could not be
// made (cudarc's own `alloc` would have failed) orders its uses by synchronization instead. A
// copy or memset through `DevicePtr` synchronizes its stream after the use (`untracked`), but a
// kernel argument is pushed before the launch, on a stream the builder does not tell: so the
// push first waits for every earlier use (a context synchronization if a kernel used the buffer
// without events before), and marks the buffer, so that its next use of any kind, and its drop,
// synchronize the context first. The mark is kept by address in the allocator's shell pool,
// where views find it too. Nothing of this runs while the events exist.
pub(super) fn unordered_kernel_use(
    alloc: &CudaAllocator,
    base: sys::CUdeviceptr,
    owner: &CudaStream,
) {
    if base != 0 && managing(owner) {
        let shells = alloc.shells();
        shells.settle_unordered(base, owner.context());
        shells.mark_unordered(base);
    }
}

/// Whether a new shell made for a buffer of `stream` is anchored there (Note [New shells start
/// at the allocation stream]): the stream has work queued, and is not a default stream beside a
/// capture.
//
// Note [No anchor on a default stream beside a capture]: a query of, or a record on, the legacy
// default stream while a blocking stream of the device is capturing is an implicit dependency
// on that capture and invalidates it, where cudarc's first use of a buffer allocated on the
// default stream touches only the using stream (`review3_legacy_first_use_beside_a_blocking_
// capture`: 20 of 20 captures invalidated). For the legacy and per-thread default streams the
// driver is first asked whether the stream may be touched (`cuStreamIsCapturing`, which answers
// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` then); on anything but "not capturing" the shell is not
// anchored. Left: the grown-block hazard the anchor closes stays open for such a buffer while a
// blocking stream captures.
fn anchor_wanted(stream: &CudaStream) -> bool {
    if (stream.cu_stream() as usize) <= 2 {
        // SAFETY: `stream` is a live stream of the caller's (or a default stream's handle),
        // borrowed for the call.
        match unsafe { cu::result::stream::is_capturing(stream.cu_stream()) } {
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => {}
            _ => return false,
        }
    }
    !stream_idle(stream)
}

/// Whether `stream` has no work queued (`cuStreamQuery`, in relaxed capture mode so that a
/// global capture elsewhere stays valid); `false` when the driver cannot tell. The stream's
/// context is current (the shell's making bound it).
fn stream_idle(stream: &CudaStream) -> bool {
    let Ok(_relaxed) = crate::backend::cuda::RelaxedCaptureMode::enter() else {
        return false;
    };
    // SAFETY: `stream` is a live stream of the caller's, borrowed for the call.
    let r = unsafe { sys::cuStreamQuery(stream.cu_stream()) };
    r == sys::CUresult::CUDA_SUCCESS
}

/// A write use of `shell` on `stream` that queues nothing: `stream` waits for the shell's last
/// reads and write, then the shell's write event is recorded there (both only while cudarc
/// orders streams, by its own rule).
//
// Note [Kept shells after a typed one]: once `as_cuda_slice` made a buffer's typed shell, every
// use records the typed events only, and the byte shell's events stop at the typed shell's
// making. The drop makes the allocation stream wait for both pairs, but only the byte shell is
// kept for the block's next buffer, whose first use on a third stream waits on the kept
// events alone: it would run beside the old buffer's last uses through the typed shell
// (`review2_typed_shell_kept_events`). So the kept shell's write is recorded on the allocation
// stream after the drop's waits when a typed shell existed.
fn record_write_on(shell: &mut EventShell, stream: &CudaStream) {
    let (_, record) = cu::DevicePtrMut::<u8>::device_ptr_mut(&mut **shell, stream);
    drop(record);
}

/// The inheritance of `try_as_cuda_slice` (the typed shell's write recorded after the byte
/// shell's last write) on a new non-blocking stream of `ctx`'s device, outside the capture of
/// the buffer's stream.
///
/// # Errors
/// A backend error when the stream could not be made, or the thread's capture mode not relaxed.
//
// Note [Typed shells made inside a capture]: a byte shell taken outside a capture carries events
// recorded outside it (the buffer's own uses, or the block's previous buffer's), and the
// inheritance made the capturing allocation stream wait on its write: the driver refuses that
// wait (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`) and invalidates the capture, though cudarc's
// `&CudaSlice<T>` is a borrow that queues nothing; and it recorded the typed shell's write inside
// the capture, where no eager use can wait on it afterwards (`CUDA_ERROR_INVALID_VALUE`).
// Skipping it would let a use after the capture, on a third stream, run beside the byte shell's
// last write (the typed shell is the buffer's only event pair from its making). So, while the
// buffer's stream may be capturing and its byte shell was not made inside a capture, the
// inheritance runs on a stream of its own, made for it and outside every capture (relaxed mode:
// a global capture elsewhere stays valid): it waits for the byte shell's last write there and
// records the typed shell's write there, queuing nothing in the capture. Uses of the typed
// shell inside the capture then wait on an event recorded outside it and fail as a `CudaSlice`
// used before a capture does; eager uses after it are ordered after the byte shell's last write
// (`a_typed_buffer_made_inside_a_capture_leaves_it_valid_and_orders_later_reads`). A byte shell
// made inside the capture (`captured`) holds events of that capture only: the allocation stream
// waits on them inside it, as before (a wait from a stream outside the capture would fork that
// stream into it).
fn inherit_beside_capture<T>(
    ctx: &Arc<cu::CudaContext>,
    bytes: &cu::CudaSlice<u8>,
    typed: &mut cu::CudaSlice<T>,
) -> Result<()> {
    let _relaxed = crate::backend::cuda::RelaxedCaptureMode::enter().map_err(|source| {
        crate::AllocError::Backend {
            operation: "cuThreadExchangeStreamCaptureMode",
            source,
        }
    })?;
    // Binding takes cudarc's pending error (`check_err`): it is set aside and put back, so that
    // neither the binding fails on it nor the program loses it.
    let pending = ctx.check_err();
    let bound = ctx.bind_to_thread();
    ctx.record_err(pending);
    bound.map_err(|e| super::driver_error("cuCtxSetCurrent", e))?;
    let raw = cu::result::stream::create(cu::result::stream::StreamKind::NonBlocking)
        .map_err(|e| super::driver_error("cuStreamCreate", e))?;
    {
        // SAFETY: `raw` is a live stream of `ctx`'s context, made just above; it is destroyed
        // only after this wrapper is dropped, at the end of this block.
        let side = unsafe { ctx.wrap_borrowed_stream(raw) };
        // Only the wait: recording the byte shell's read here would replace its last readers.
        let (_, g) = cu::DevicePtr::<u8>::device_ptr(bytes, &side);
        std::mem::forget(g);
        let (_, g) = cu::DevicePtrMut::<T>::device_ptr_mut(typed, &side);
        drop(g);
    }
    // SAFETY: `raw` was made above and nothing uses it any more (the wrapper is dropped); the
    // driver destroys it once its queued wait and record are done.
    unsafe { cu::result::stream::destroy(raw) }
        .map_err(|e| super::driver_error("cuStreamDestroy", e))
}

impl<T> CachedSlice<T> {
    /// Removes the shell kept at this buffer's address when the buffer's own is not kept (Note
    /// [A stale kept shell goes]).
    //
    // Note [A stale kept shell goes]: a buffer whose own shell is not kept at its drop (made for
    // a first use inside a capture, quarantined, or its waits refused) may leave in the pool the
    // shell of the address's *previous* buffer: a first use inside a capture makes new events
    // without taking the kept ones, and a thread that lost the first-use race put its taken
    // shell back. The block's next buffer would take that shell, whose events predate every use
    // of the buffer just dropped, and its first use on a third stream would not wait for them
    // (`review3_first_use_in_capture_leaves_a_stale_kept_shell`). So the kept shell goes too
    // (quarantined inside a capture or while one is routed, destroyed otherwise), and the next
    // buffer makes a new one, which Note [New shells start at the allocation stream] orders
    // after the drop's waits.
    fn evict_stale_kept_shell(&self, in_capture: bool) {
        if let Some(stale) = self.alloc.shells().evict(self.ptr) {
            retire_shell(&self.alloc, stale, in_capture);
        }
    }
}

/// Keeps `shell` in the allocator's pool for the next buffer at `ptr`, and destroys the shell
/// the pool leaves out (Note [Displaced shells]).
//
// Note [Displaced shells]: a shell returned to a full pool, or one replaced at its address (the
// block's next buffer made its own: the kept one was too short, or of another context object;
// or another thread's first use won the race), was dropped at once, and its drop
// (`CudaSlice::leak`) waits on its events on the legacy default stream: while a capture is
// underway, of a blocking stream in any thread, that wait is an implicit dependency on the
// capturing stream and invalidates the capture (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), though
// the buffer's own stream is not capturing. It now goes where the drop of a buffer inside a
// capture sends its shell: quarantined while the cache knows of a capture underway (a routed
// one, `capture_underway`), destroyed when it ends (`GraphPool::finish`, `empty_cache`), and
// otherwise destroyed at once, leaving cudarc's pending error as it was (`destroy_quietly`)
// (`a_shell_displaced_during_a_capture_of_a_blocking_stream_leaves_it_valid`). Left: the
// destruction still waits on the legacy default stream (cudarc's `leak` is the only way to end
// a `CudaSlice` without freeing, and its waits are its own), and a capture the cache does not
// route (no `capture_pool`) is not known to it.
fn pool_shell(alloc: &CudaAllocator, ptr: sys::CUdeviceptr, shell: EventShell) {
    if let Some(displaced) = alloc.shells().put(ptr, shell) {
        retire_shell(alloc, displaced, false);
    }
}

/// Ends a shell that leaves the pool for good: quarantined while `in_capture` or while the cache
/// knows of a routed capture underway, destroyed at once otherwise keeping cudarc's pending
/// error (Note [Displaced shells], Note [A stale kept shell goes]).
fn retire_shell(alloc: &CudaAllocator, shell: EventShell, in_capture: bool) {
    if in_capture || alloc.inner.capture_underway() {
        alloc.shells().quarantine(shell);
    } else {
        super::events::destroy_quietly(shell);
    }
}

/// Resolves `bounds` against `len` as `start..end`, or `None` when out of range.
pub(super) fn resolve(bounds: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match bounds.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match bounds.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then_some((start, end))
}

impl<T> CachedSlice<T> {
    pub(super) fn from_parts(
        ptr: DeviceAddr,
        len: usize,
        block_size: usize,
        stream: Arc<CudaStream>,
        alloc: CudaAllocator,
    ) -> Self {
        CachedSlice {
            ptr: ptr.0,
            len,
            block_size,
            stream,
            alloc,
            shell: OnceLock::new(),
            captured: AtomicBool::new(false),
            typed: OnceLock::new(),
            typed_untracked: OnceLock::new(),
            folded: false,
            marker: PhantomData,
        }
    }

    /// The byte event shell, taken at the buffer's first use while event tracking is on (Note
    /// [Events whenever tracking is on], Note [Event shells and captures]). `None` while tracking
    /// is off, or when the events could not be made (logged; uses then synchronize instead, see
    /// [`untracked`]).
    //
    // Note [Events whenever tracking is on]: cudarc gives a buffer its two events at its
    // allocation whenever event tracking is on, and every view of it borrows them; whether a use
    // waits and records is decided at the use, from the `CudaContext` objects involved (the
    // buffer's stream's for a copy's wait, the using stream's for a kernel argument and for
    // every record), so the events start ordering once some object manages synchronization. A
    // buffer here takes its shell at its first use (Note [Event shells and captures]) while
    // tracking is on, one stream or more, and from then on cudarc's own code decides each use
    // through the shell. The first version took it only while the buffer's own object managed
    // synchronization, and three programs lost cudarc's order: a view made while the context
    // had one stream stayed event-less after `new_stream`, so a later write did not wait for a
    // kernel reading through it (`cuda_a_view_made_before_a_second_stream_orders_later_
    // writes`); a buffer of an object with no stream of its own, used on another object's
    // streams, pushed bare pointers (`review2_other_object_kernel_uses`); and a use that began
    // before another thread's `new_stream` went unrecorded, where cudarc records it
    // (`review2_management_starting_mid_copy`). The shell comes from the address's kept one,
    // so a cache hit still creates no event; with one stream the events record nothing
    // (cudarc's rule).
    //
    // Note [Event shells and captures]: a shell kept in the pool carries events recorded for the
    // address's previous buffer, and inside a stream capture the driver refuses a wait on an
    // event recorded outside it (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, which invalidates the
    // capture; `gpu/probes/capture_event_wait.cu`), where cudarc's own `alloc` gives a buffer
    // new events, never recorded, that a capture may wait on. So a buffer takes its shell at
    // its first use, not at its allocation: while the buffer's stream is capturing (or the
    // query fails) it makes new events on its own stream and keeps them out of the pool at its
    // drop, since events recorded inside a capture cannot be waited on outside it afterwards
    // (`CUDA_ERROR_INVALID_VALUE`, same probe) and would poison the next buffer at that
    // address; otherwise it takes the pooled shell, whose old events are complete in the
    // allocation stream's order (the previous buffer's drop made that stream wait on them) and
    // order a first use on another stream after the previous buffer's last uses.
    //
    // `using` is the stream of the use when the caller knows it (cudarc's `DevicePtr` and
    // `DevicePtrMut`): a first use there makes new events while that stream is capturing too.
    // Kernel arguments and views do not know theirs: a first use through them inside a capture
    // on another stream than the buffer's takes the kept events, and fails as a `CudaSlice`
    // used before the capture does; and a view made before a capture took its events then. New
    // events that such a use records inside a capture are caught at the drop: after the
    // capture, waits on them fail, and a shell whose waits failed is destroyed, not kept
    // (`wait_last_uses`).
    fn shell_on(&self, using: Option<&CudaStream>) -> Option<&EventShell> {
        if let Some(shell) = self.shell.get() {
            return Some(shell);
        }
        if self.ptr == 0 || !self.stream.context().is_event_tracking() {
            return None;
        }
        // Making or destroying events, the anchor's record and the synchronization below bind
        // the buffer's context; a first view binds nothing in cudarc, so wherever one of them
        // runs the caller's current context is put back (taking a kept shell makes no driver
        // call, and no guard: a warm cycle stays as cheap).
        // Note [Uses without events]: events made now would not order this use after a kernel
        // that used the buffer without them.
        self.alloc
            .shells()
            .settle_unordered(self.ptr, self.stream.context());
        let capturing = self.may_be_captured(using);
        let mut restore = None;
        let made = if capturing {
            restore = Some(crate::backend::cuda::callers_context());
            // SAFETY: the buffer owns `[ptr, ptr + num_bytes)` until it is dropped, and this
            // shell lives inside it and is destroyed with it.
            unsafe { EventShell::on_stream(&self.stream, self.ptr, self.num_bytes()) }
        } else if let Some(kept) =
            self.alloc
                .shells()
                .take_kept(self.stream.context(), self.ptr, self.num_bytes())
        {
            Ok(kept)
        } else {
            restore = Some(crate::backend::cuda::callers_context());
            // SAFETY: the buffer owns its block `[ptr, ptr + block_size)` until it is dropped
            // (`num_bytes <= block_size`), and the shell lives inside it (or, afterwards, in the
            // allocator's pool, unused until a buffer owns that address again).
            let made = unsafe {
                EventShell::new(
                    self.stream.context(),
                    self.ptr,
                    self.block_size.max(self.num_bytes()),
                )
            };
            made.map(|mut shell| {
                if anchor_wanted(&self.stream) {
                    self.anchor_new_shell(&mut shell);
                }
                shell
            })
        };
        match made {
            Ok(shell) => {
                // Another thread may have made one meanwhile: then theirs is used, and ours goes
                // back to the pool (a kept or pool-ready one) or is destroyed (new events).
                match self.shell.set(shell) {
                    Ok(()) if capturing => self.captured.store(true, Ordering::Relaxed),
                    Ok(()) => {}
                    Err(ours) => {
                        restore.get_or_insert_with(crate::backend::cuda::callers_context);
                        if capturing {
                            drop(ours);
                        } else {
                            pool_shell(&self.alloc, self.ptr, ours);
                        }
                    }
                }
                drop(restore);
                self.shell.get()
            }
            Err(e) => {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DeviceAddr(self.ptr), error = %e, "no events for a CachedSlice: its uses synchronize their stream instead");
                None
            }
        }
    }

    /// Records a new shell's write on the allocation stream (Note [New shells start at the
    /// allocation stream]).
    //
    // Note [New shells start at the allocation stream]: a cached block's previous buffer was
    // dropped with its allocation stream waiting for its last uses on every stream, and the
    // block's next buffer on that stream is ordered after them; its first use on a *third*
    // stream is ordered only through the events it takes. The address's kept shell carries
    // those last uses; a new shell (none kept, one too short because the block grew by a merge,
    // the merged neighbours' kept at their own addresses, one of another context object, one
    // destroyed after a capture) would carry nothing, and the third stream would run beside the
    // previous buffers' last kernels (`review2_grown_block_first_use`: 20 of 20 trials wrong).
    // So a new shell made outside a capture starts with its write recorded on the allocation
    // stream, when that stream still has work queued: a first use elsewhere waits for the
    // point where the drops before it waited. An idle stream has nothing left to wait for
    // (every wait queued there is done), and then nothing is recorded: cudarc's own fresh
    // buffer carries no recorded event, and a first use of it inside a capture on another
    // stream is legal, where a wait on an event recorded outside the capture invalidates it
    // (`a_first_use_inside_a_capture_on_another_stream_leaves_no_captured_events`). Left: a
    // new shell made while the allocation stream is busy, first used inside a capture on
    // another stream, invalidates that capture (an error, as for a kept shell's events; never
    // a wrong result). While cudarc orders nothing, nothing is recorded (its own rule).
    fn anchor_new_shell(&self, shell: &mut EventShell) {
        record_write_on(shell, &self.stream);
    }

    /// At a drop while the buffer's stream is capturing: holds the block for the capture's
    /// graph, unless it is memory of the capture's own pool (which goes back there, as in
    /// PyTorch). Returns whether it was held (Note [Drops inside a capture]).
    //
    // Note [Drops inside a capture]: cudarc's drop inside a capture queues a captured
    // `cuMemFreeAsync`, so the memory stays the graph's: nothing else gets it before the graph
    // runs. A cached block freed there would be served at once to the next allocation, eager
    // work included, while every launch of the graph still reads and writes it. So a buffer
    // dropped while its stream is capturing gives its block back only if the block is memory of
    // the private pool that receives the capture (the graph's own memory, which PyTorch reuses
    // within the capture too); any other block is held out of reuse until that pool's last use
    // is given back (its `CapturedGraph` dropped), or, when no pool receives the capture, for
    // the cache's life (`CudaAllocator::blocks_held_for_graphs` counts them). The drop's waits
    // are captured on the buffer's stream, as cudarc's are; its event shell is quarantined,
    // not kept: its events may be recorded inside the capture, and destroying it waits on the
    // legacy default stream, which waits until no capture is underway (`GraphPool::finish`,
    // `empty_cache`). A buffer whose own stream is not capturing, dropped inside a capture on
    // another stream that used it, is freed as before: the allocator cannot see that use (and
    // cudarc's own buffer frees its memory then too, on its own stream).
    fn hold_for_graph(&self) -> bool {
        let sid = self.stream_id();
        let routed = self.alloc.inner.routed_pool(sid);
        if routed.is_some() && self.alloc.inner.pool_of(DeviceAddr(self.ptr)) == routed {
            return false;
        }
        self.alloc
            .hold_for_graph(routed.unwrap_or(crate::MemPoolId::DEFAULT), self.ptr);
        true
    }

    /// Whether the buffer's stream is capturing (`CudaAllocator::capture_of`); `None` when the
    /// query failed.
    fn own_capture_status(&self) -> Option<bool> {
        match self.alloc.capture_of(&self.stream, self.stream_id()) {
            Ok(c) => Some(c.is_some()),
            Err(e) => {
                tracing::debug!(target: "cuda_caching_allocator", stream = %self.stream_id(), error = %e, "capture status unknown");
                None
            }
        }
    }

    /// Whether a first use now may be recorded inside a stream capture: the buffer's stream is
    /// capturing, or `using` (the stream of the use, when known) is, or a query failed. A
    /// legacy default stream never captures and is not asked (the driver may answer for the
    /// streams it synchronizes with instead).
    fn may_be_captured(&self, using: Option<&CudaStream>) -> bool {
        if self.own_capture_status() != Some(false) {
            return true;
        }
        // The null handle and `CU_STREAM_LEGACY` (0x1).
        let legacy = |s: &CudaStream| (s.cu_stream() as usize) <= 1;
        let Some(u) = using.filter(|u| !legacy(u) && u.cu_stream() != self.stream.cu_stream())
        else {
            return false;
        };
        // SAFETY: `u` is a live stream of the caller's, borrowed for the call.
        !matches!(
            unsafe { cu::result::stream::is_capturing(u.cu_stream()) },
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        )
    }

    /// The events a shared use goes through (see [`Events`]).
    pub(super) fn events(&self) -> Events<'_, T> {
        self.events_on(None)
    }

    /// [`events`](Self::events) for a use on `using` (see `shell_on`).
    fn events_on(&self, using: Option<&CudaStream>) -> Events<'_, T> {
        if let Some(typed) = self.typed.get() {
            return Events::Typed(typed);
        }
        match self.shell_on(using) {
            Some(shell) => Events::Bytes(shell),
            None => Events::None,
        }
    }

    /// Prepares a mutable use: makes the byte shell if cudarc now orders streams and no typed
    /// shell exists, and, when both exist, folds the byte shell's last uses into the typed
    /// shell's events (uses through views made before the typed shell existed recorded only the
    /// byte shell's events; with `&mut self` no such view is alive any more).
    fn prepare_mut(&mut self) {
        self.prepare_mut_on(None);
    }

    /// [`prepare_mut`](Self::prepare_mut) for a use on `using` (see `shell_on`).
    fn prepare_mut_on(&mut self, using: Option<&CudaStream>) {
        if self.typed.get().is_none() {
            let _ = self.shell_on(using);
            return;
        }
        self.fold_byte_shell();
    }

    /// Folds the byte shell's last uses into the typed shell's events, once (see `prepare_mut`).
    fn fold_byte_shell(&mut self) {
        if self.folded || !managing(&self.stream) {
            return;
        }
        if let (Some(typed), Some(bytes)) = (self.typed.get_mut(), self.shell.get_mut()) {
            // The allocation stream waits for the byte shell's last reads and write, then records
            // the typed shell's write: whoever waits on the typed events from now on also waits
            // for every use recorded on the byte shell. Once: every use from the typed shell's
            // making on goes through its events, and the views that took the byte shell before
            // it borrowed the buffer, so none is left at this mutable use; folding again would
            // make each later write wait for all the work queued on the allocation stream.
            let (_, g) = cu::DevicePtrMut::<u8>::device_ptr_mut(&mut **bytes, &self.stream);
            drop(g);
            let (_, g) = cu::DevicePtrMut::<T>::device_ptr_mut(&mut **typed, &self.stream);
            drop(g);
        }
        self.folded = true;
    }

    /// The buffer's address, stream, allocator and events, borrowed apart, made ready for a
    /// mutable use on `using` (see `shell_on`).
    fn parts_mut_on(
        &mut self,
        using: Option<&CudaStream>,
    ) -> (
        sys::CUdeviceptr,
        &Arc<CudaStream>,
        &CudaAllocator,
        EventsMut<'_, T>,
    ) {
        self.prepare_mut_on(using);
        self.split_parts()
    }

    /// The buffer's address, stream, allocator and current events, borrowed apart.
    fn split_parts(
        &mut self,
    ) -> (
        sys::CUdeviceptr,
        &Arc<CudaStream>,
        &CudaAllocator,
        EventsMut<'_, T>,
    ) {
        let CachedSlice {
            ptr,
            stream,
            alloc,
            shell,
            typed,
            ..
        } = self;
        let events = match (typed.get_mut(), shell.get_mut()) {
            (Some(t), _) => EventsMut::Typed(&mut **t),
            (None, Some(b)) => EventsMut::Bytes(b),
            (None, None) => EventsMut::None,
        };
        (*ptr, &*stream, &*alloc, events)
    }

    /// cudarc's free rule: the allocation stream (in whose order the cache reuses the block)
    /// waits for the buffer's last reads and writes on every stream, through every event pair it
    /// has. A write use on it does exactly those waits; its record is not needed (the block is
    /// free from here on, or leaked), so the guard is forgotten (it holds only references).
    /// Returns whether the byte shell's events may be kept for the next buffer at this address:
    /// not when a wait failed (events recorded inside a capture that has ended refuse waits,
    /// `CUDA_ERROR_INVALID_VALUE`: cudarc's own drop records that error too, and it is left for
    /// the program's next call as cudarc leaves it), nor for a shell made for a captured first
    /// use (its own drop, `CudaSlice::leak`, does the waits on this same stream).
    fn wait_last_uses(&mut self) -> bool {
        if *self.captured.get_mut() {
            return false;
        }
        if !managing(&self.stream) {
            return true;
        }
        let stream = &self.stream;
        // The typed shell, if any, needs no wait here: it lives on this same stream, and the drop
        // that follows (`CudaSlice::leak`) makes the stream wait for its last read and write.
        let Some(shell) = self.shell.get_mut() else {
            return true;
        };
        // cudarc records a failed wait in the context (`record_err`) instead of returning it:
        // the error held before is taken aside, the waits' own is read, and what cudarc would
        // hold afterwards is put back (the waits' error, else the earlier one).
        let ctx = stream.context();
        let pending = ctx.check_err();
        let (_, record) = cu::DevicePtrMut::<u8>::device_ptr_mut(&mut **shell, stream);
        std::mem::forget(record);
        let waited = ctx.check_err();
        let keep = waited.is_ok();
        ctx.record_err(if waited.is_err() { waited } else { pending });
        keep
    }

    /// Takes the block's kept byte shell, if there is one, as this buffer's (its first use).
    fn adopt_kept_shell(&self) -> Option<&EventShell> {
        let kept =
            self.alloc
                .shells()
                .take_kept(self.stream.context(), self.ptr, self.num_bytes())?;
        if let Err(kept) = self.shell.set(kept) {
            // Another thread's first use made one meanwhile.
            pool_shell(&self.alloc, self.ptr, kept);
        }
        self.shell.get()
    }

    /// The buffer as cudarc's own `CudaSlice<T>`, for APIs that name that type (cuFile's
    /// `buf_register`, cuBLASLt `matmul`, a framework's storage accessor). The first call makes
    /// a cudarc buffer over the same memory on the buffer's stream (two CUDA events while event
    /// tracking is on); from then on every use of the buffer, through either type, records and
    /// waits on that buffer's events, so cudarc's stream ordering holds across both paths. Only a
    /// shared reference is handed out: a `CudaSlice` frees its memory through the driver when
    /// dropped, so none may be moved out (mutable access goes through
    /// [`as_cuda_view_mut`](Self::as_cuda_view_mut)). Programs that never call it pay nothing.
    ///
    /// # Errors
    /// A backend error when cudarc could not create the events.
    pub fn try_as_cuda_slice(&self) -> Result<&cu::CudaSlice<T>> {
        if let Some(typed) = self.typed.get() {
            return Ok(typed);
        }
        // cudarc binds the buffer's context to make the shell's events and to order it; a
        // `&CudaSlice` binds nothing, so the caller's current context is put back.
        let _restore = crate::backend::cuda::callers_context();
        if !self.stream.context().is_event_tracking() {
            return self.untracked_cuda_slice();
        }
        // SAFETY: the buffer owns `[ptr, ptr + num_bytes)` holding its values of `T` until it is
        // dropped; the typed shell lives inside it and is destroyed (never freeing) in its drop.
        let mut typed = unsafe { TypedShell::<T>::on_stream(&self.stream, self.ptr, self.len) }?;
        // A first use through the typed shell takes the block's kept byte shell, if any, so that
        // its events still order this buffer's first uses; new events would carry nothing to
        // inherit, and none are made, nor kept ones taken inside a capture (Note [Event shells
        // and captures]).
        let bytes = match self.shell.get() {
            _ if !managing(&self.stream) => None,
            Some(bytes) => Some(bytes),
            None if self.may_be_captured(None) => None,
            None => self.adopt_kept_shell(),
        };
        if let Some(bytes) = bytes {
            if !self.captured.load(Ordering::Relaxed) && self.may_be_captured(None) {
                // Note [Typed shells made inside a capture].
                inherit_beside_capture(self.stream.context(), bytes, &mut typed)?;
            } else {
                // The typed shell inherits the last write recorded on the byte shell: the
                // allocation stream waits for it, then records the typed shell's write. (Readers
                // only ever wait for writes; writers fold the byte shell in, see `prepare_mut`.)
                let (_, g) = cu::DevicePtr::<u8>::device_ptr(&**bytes, &self.stream);
                drop(g);
                let (_, g) = cu::DevicePtrMut::<T>::device_ptr_mut(&mut *typed, &self.stream);
                drop(g);
            }
        }
        // Another thread may have made one meanwhile: then ours is destroyed and theirs is used.
        let _ = self.typed.set(typed);
        match self.typed.get() {
            Some(typed) => Ok(typed),
            None => Err(crate::AllocError::Unsupported {
                operation: "CachedSlice::as_cuda_slice",
                capability: "a typed cudarc buffer",
            }),
        }
    }

    /// `as_cuda_slice` while event tracking is off (Note [Typed buffers made while tracking is
    /// off]).
    //
    // Note [Typed buffers made while tracking is off]: cudarc makes a `CudaSlice` without events
    // while event tracking is off (`upgrade_device_ptr`, as `alloc`), and it stays without them.
    // A typed shell made then and kept as the buffer's event pair would take every later use of
    // the buffer off ordering, also after tracking is back on, where the buffer (allocated while
    // tracking was on, as cudarc's would have been) keeps its events
    // (`cuda_a_typed_shell_made_while_tracking_was_off_keeps_ordering`). So that event-less
    // `CudaSlice` is kept apart, only to be lent: the buffer's own uses keep going through its
    // byte shell, and a later `as_cuda_slice` while tracking is on makes the typed shell with
    // events. Uses through the lent reference are unordered, as those of any `CudaSlice` made
    // while tracking was off (`disable_event_tracking`'s contract).
    fn untracked_cuda_slice(&self) -> Result<&cu::CudaSlice<T>> {
        if let Some(lent) = self.typed_untracked.get() {
            return Ok(lent);
        }
        // SAFETY: as in `try_as_cuda_slice`: the shell lives inside the buffer and is destroyed,
        // never freeing, in its drop.
        let lent = unsafe { TypedShell::<T>::on_stream(&self.stream, self.ptr, self.len) }?;
        // Another thread may have made one meanwhile: then ours is destroyed and theirs is lent.
        let _ = self.typed_untracked.set(lent);
        match self.typed_untracked.get() {
            Some(lent) => Ok(lent),
            None => Err(crate::AllocError::Unsupported {
                operation: "CachedSlice::as_cuda_slice",
                capability: "a typed cudarc buffer",
            }),
        }
    }

    /// The buffer as cudarc's own `CudaSlice<T>`; see
    /// [`try_as_cuda_slice`](Self::try_as_cuda_slice).
    ///
    /// # Panics
    /// When cudarc cannot create the buffer's events (as cudarc's own `upgrade_device_ptr`
    /// panics then); use `try_as_cuda_slice` to get an error instead.
    pub fn as_cuda_slice(&self) -> &cu::CudaSlice<T> {
        match self.try_as_cuda_slice() {
            Ok(s) => s,
            Err(e) => panic!("CachedSlice::as_cuda_slice: {e}"),
        }
    }

    /// The whole buffer as cudarc's `CudaView<'_, T>` (through
    /// [`as_cuda_slice`](Self::as_cuda_slice)).
    ///
    /// # Panics
    /// As [`as_cuda_slice`](Self::as_cuda_slice).
    pub fn as_cuda_view(&self) -> cu::CudaView<'_, T> {
        self.as_cuda_slice().as_view()
    }

    /// The whole buffer as cudarc's `CudaViewMut<'_, T>`, with the events of
    /// [`as_cuda_slice`](Self::as_cuda_slice).
    ///
    /// # Errors
    /// A backend error when cudarc could not create the events.
    pub fn try_as_cuda_view_mut(&mut self) -> Result<cu::CudaViewMut<'_, T>> {
        self.try_as_cuda_slice()?;
        // Folding the byte shell in binds the buffer's context; cudarc's `as_view_mut` binds
        // nothing.
        let restore = (!self.folded).then(crate::backend::cuda::callers_context);
        self.prepare_mut();
        drop(restore);
        match (self.typed.get_mut(), self.typed_untracked.get_mut()) {
            (Some(typed), _) => Ok(typed.as_view_mut()),
            (None, Some(lent)) => Ok(lent.as_view_mut()),
            (None, None) => Err(crate::AllocError::Unsupported {
                operation: "CachedSlice::as_cuda_view_mut",
                capability: "a typed cudarc buffer",
            }),
        }
    }

    /// The whole buffer as cudarc's `CudaViewMut<'_, T>`; see
    /// [`try_as_cuda_view_mut`](Self::try_as_cuda_view_mut).
    ///
    /// # Panics
    /// As [`as_cuda_slice`](Self::as_cuda_slice).
    pub fn as_cuda_view_mut(&mut self) -> cu::CudaViewMut<'_, T> {
        match self.try_as_cuda_view_mut() {
            Ok(v) => v,
            Err(e) => panic!("CachedSlice::as_cuda_view_mut: {e}"),
        }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes (`len * size_of::<T>()`).
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address (null for an empty buffer).
    pub fn device_ptr_raw(&self) -> DeviceAddr {
        DeviceAddr(self.ptr)
    }

    /// The stream the buffer was allocated on (and is freed on).
    pub fn alloc_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream the buffer was allocated on and is returned to the cache on (cudarc's
    /// `CudaSlice::stream`; the same as [`alloc_stream`](Self::alloc_stream)).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device ordinal (cudarc's `CudaSlice::ordinal`).
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The cudarc context of the buffer's device (cudarc's `CudaSlice::context`).
    pub fn context(&self) -> &Arc<cu::CudaContext> {
        self.stream.context()
    }

    /// The [`StreamId`] of [`alloc_stream`](Self::alloc_stream).
    pub fn stream_id(&self) -> StreamId {
        stream_id(&self.stream)
    }

    /// The allocator the buffer returns to.
    pub fn allocator(&self) -> &CudaAllocator {
        &self.alloc
    }

    /// Whether the buffer carries cudarc's read/write events (it was used while the context
    /// manages stream synchronization, or [`as_cuda_slice`](Self::as_cuda_slice) was called); see
    /// the type's docs.
    pub fn has_events(&self) -> bool {
        self.shell.get().is_some() || self.typed.get().is_some()
    }

    /// Gives up ownership of the memory without returning it to the cache, and returns its
    /// address (cudarc's `CudaSlice::leak`). The buffer's events end as when it is dropped: the
    /// allocation stream first waits for its last uses, and its event pair stays with the
    /// block's address for a later buffer there. The block stays allocated in the cache (the
    /// statistics count it) until it is freed with the `unsafe` [`CudaAllocator::free`].
    pub fn leak(mut self) -> sys::CUdeviceptr {
        let ptr = self.ptr;
        if ptr != 0 {
            // Note [Leaked buffers end their events as dropped ones].
            let restore = crate::backend::cuda::callers_context();
            let status = self.own_capture_status();
            self.retire_events(status);
            drop(restore);
        }
        // With a null address the drop does nothing more.
        self.ptr = 0;
        ptr
    }

    /// Marks the buffer as used on `stream` (PyTorch's `Tensor.record_stream`): when it is
    /// dropped, the cache records an event on `stream` and reuses the memory only after the work
    /// queued there by then is done. Needed only where cudarc does not order the use itself
    /// (event tracking off, or work queued on `stream` outside cudarc). Recording the allocation
    /// stream is a no-op. The stream is admitted to the device and kept alive by it.
    ///
    /// # Errors
    /// A stream of another device, or an error of the core.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.ptr == 0 {
            return Ok(());
        }
        let id = self.alloc.admit(stream)?;
        if id == self.stream_id() {
            return Ok(());
        }
        self.alloc.record_stream(DeviceAddr(self.ptr), id)
    }

    /// A view of `range`, or `None` when it is out of bounds (cudarc's `try_slice`).
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let cu = match self.events() {
            Events::Typed(t) => t.try_slice(start..end),
            // SAFETY: the bytes are this buffer's values of `T`.
            Events::Bytes(b) => b
                .try_slice(byte_range::<T>(start, end))
                .and_then(|v| unsafe { v.transmute::<T>(end - start) }),
            Events::None => None,
        };
        Some(CachedView::new(
            self.offset(start),
            end - start,
            self.ptr,
            &self.stream,
            &self.alloc,
            cu,
        ))
    }

    /// A mutable view of `range`, or `None` when it is out of bounds (cudarc's
    /// `try_slice_mut`).
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let ptr = self.offset(start);
        let (base, stream, alloc, events) = self.parts_mut_on(None);
        let cu = match events {
            EventsMut::Typed(t) => t.try_slice_mut(start..end).map(ViewEvents::Typed),
            EventsMut::Bytes(b) => b
                .try_slice_mut(byte_range::<T>(start, end))
                .map(ViewEvents::Bytes),
            EventsMut::None => None,
        };
        Some(CachedViewMut::new(
            ptr,
            end - start,
            base,
            stream,
            alloc,
            cu.unwrap_or(ViewEvents::None),
        ))
    }

    /// The whole buffer as a view.
    pub fn as_view(&self) -> CachedView<'_, T> {
        let len = self.len;
        let cu = match self.events() {
            Events::Typed(t) => Some(t.as_view()),
            // SAFETY: the bytes are this buffer's values of `T`.
            Events::Bytes(b) => unsafe { b.transmute::<T>(len) },
            Events::None => None,
        };
        CachedView::new(self.ptr, len, self.ptr, &self.stream, &self.alloc, cu)
    }

    /// The whole buffer as a mutable view.
    pub fn as_view_mut(&mut self) -> CachedViewMut<'_, T> {
        let len = self.len;
        let (ptr, stream, alloc, events) = self.parts_mut_on(None);
        let cu = match events {
            EventsMut::Typed(t) => ViewEvents::Typed(t.as_view_mut()),
            EventsMut::Bytes(b) => b
                .try_slice_mut(byte_range::<T>(0, len))
                .map_or(ViewEvents::None, ViewEvents::Bytes),
            EventsMut::None => ViewEvents::None,
        };
        CachedViewMut::new(ptr, len, ptr, stream, alloc, cu)
    }

    /// Two views, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at_checked(&self, mid: usize) -> Option<(CachedView<'_, T>, CachedView<'_, T>)> {
        Some((self.get(..mid)?, self.get(mid..)?))
    }

    /// Two disjoint mutable views, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at_mut_checked(
        &mut self,
        mid: usize,
    ) -> Option<(CachedViewMut<'_, T>, CachedViewMut<'_, T>)> {
        if mid > self.len {
            return None;
        }
        let second = self.offset(mid);
        let len = self.len;
        let (base, stream, alloc, events) = self.parts_mut_on(None);
        let (cu_a, cu_b) = match events {
            EventsMut::Typed(t) => match t.try_split_at_mut(mid) {
                Some((x, y)) => (ViewEvents::Typed(x), ViewEvents::Typed(y)),
                None => (ViewEvents::None, ViewEvents::None),
            },
            // The byte shell may be longer than the buffer (it covers the block); the second
            // part's length is never used, only its address and events.
            EventsMut::Bytes(b) => match b.try_split_at_mut(mid * std::mem::size_of::<T>()) {
                Some((x, y)) => (ViewEvents::Bytes(x), ViewEvents::Bytes(y)),
                None => (ViewEvents::None, ViewEvents::None),
            },
            EventsMut::None => (ViewEvents::None, ViewEvents::None),
        };
        // Both views borrow `self` mutably for their lifetime and cover disjoint ranges.
        Some((
            CachedViewMut::new(base, mid, base, stream, alloc, cu_a),
            CachedViewMut::new(second, len - mid, base, stream, alloc, cu_b),
        ))
    }

    /// cudarc's `try_slice`: the same as [`get`](Self::get).
    pub fn try_slice(&self, bounds: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        self.get(bounds)
    }

    /// cudarc's `slice`: a view of `bounds`.
    ///
    /// # Panics
    /// When `bounds` is out of range, as cudarc's `slice` does; [`get`](Self::get) returns
    /// `None` instead.
    pub fn slice(&self, bounds: impl RangeBounds<usize>) -> CachedView<'_, T> {
        let len = self.len;
        match self.get(bounds) {
            Some(v) => v,
            None => panic!("CachedSlice::slice: range out of bounds for a buffer of {len}"),
        }
    }

    /// cudarc's `try_slice_mut`: the same as [`get_mut`](Self::get_mut).
    pub fn try_slice_mut(
        &mut self,
        bounds: impl RangeBounds<usize>,
    ) -> Option<CachedViewMut<'_, T>> {
        self.get_mut(bounds)
    }

    /// cudarc's `slice_mut`: a mutable view of `bounds`.
    ///
    /// # Panics
    /// When `bounds` is out of range, as cudarc's `slice_mut` does; [`get_mut`](Self::get_mut)
    /// returns `None` instead.
    pub fn slice_mut(&mut self, bounds: impl RangeBounds<usize>) -> CachedViewMut<'_, T> {
        let len = self.len;
        match self.get_mut(bounds) {
            Some(v) => v,
            None => panic!("CachedSlice::slice_mut: range out of bounds for a buffer of {len}"),
        }
    }

    /// cudarc's `try_split_at`: the same as [`split_at_checked`](Self::split_at_checked).
    pub fn try_split_at(&self, mid: usize) -> Option<(CachedView<'_, T>, CachedView<'_, T>)> {
        self.split_at_checked(mid)
    }

    /// cudarc's `split_at`.
    ///
    /// # Panics
    /// When `mid > len`, as cudarc's `split_at` does.
    pub fn split_at(&self, mid: usize) -> (CachedView<'_, T>, CachedView<'_, T>) {
        let len = self.len;
        match self.split_at_checked(mid) {
            Some(v) => v,
            None => panic!("CachedSlice::split_at: {mid} is past the end ({len})"),
        }
    }

    /// cudarc's `try_split_at_mut`: the same as
    /// [`split_at_mut_checked`](Self::split_at_mut_checked).
    pub fn try_split_at_mut(
        &mut self,
        mid: usize,
    ) -> Option<(CachedViewMut<'_, T>, CachedViewMut<'_, T>)> {
        self.split_at_mut_checked(mid)
    }

    /// cudarc's `split_at_mut`.
    ///
    /// # Panics
    /// When `mid > len`, as cudarc's `split_at_mut` does.
    pub fn split_at_mut(&mut self, mid: usize) -> (CachedViewMut<'_, T>, CachedViewMut<'_, T>) {
        let len = self.len;
        match self.split_at_mut_checked(mid) {
            Some(v) => v,
            None => panic!("CachedSlice::split_at_mut: {mid} is past the end ({len})"),
        }
    }

    /// A view of the first `len` values of `S` in the buffer's memory (cudarc's `transmute`), or
    /// `None` when they do not fit.
    ///
    /// # Safety
    /// 1. The bytes read through the view are valid values of `S`.
    pub unsafe fn transmute<S>(&self, len: usize) -> Option<CachedView<'_, S>> {
        let bytes = len.checked_mul(std::mem::size_of::<S>())?;
        if bytes > self.num_bytes() {
            return None;
        }
        let cu = match self.events() {
            // SAFETY: `len` values of `S` fit (checked above); validity is obligation 1.
            Events::Typed(t) => unsafe { t.transmute::<S>(len) },
            // SAFETY: as above (the byte shell is at least as long as the buffer).
            Events::Bytes(b) => unsafe { b.transmute::<S>(len) },
            Events::None => None,
        };
        Some(CachedView::new(
            self.ptr,
            len,
            self.ptr,
            &self.stream,
            &self.alloc,
            cu,
        ))
    }

    /// A mutable view of the first `len` values of `S` in the buffer's memory (cudarc's
    /// `transmute_mut`), or `None` when they do not fit.
    ///
    /// # Safety
    /// 1. The bytes read through the view are valid values of `S`, and the values of `S` written
    ///    through it leave valid values of `T` wherever the buffer is read as `T` afterwards.
    pub unsafe fn transmute_mut<S>(&mut self, len: usize) -> Option<CachedViewMut<'_, S>> {
        let bytes = len.checked_mul(std::mem::size_of::<S>())?;
        if bytes > self.num_bytes() {
            return None;
        }
        let (ptr, stream, alloc, events) = self.parts_mut_on(None);
        let cu = match events {
            // SAFETY: `len` values of `S` fit (checked above); validity is obligation 1.
            EventsMut::Typed(t) => unsafe { t.transmute_mut::<S>(len) }.map(ViewEvents::Typed),
            EventsMut::Bytes(b) => b.try_slice_mut(..bytes).map(ViewEvents::Bytes),
            EventsMut::None => None,
        };
        Some(CachedViewMut::new(
            ptr,
            len,
            ptr,
            stream,
            alloc,
            cu.unwrap_or(ViewEvents::None),
        ))
    }

    fn offset(&self, elements: usize) -> sys::CUdeviceptr {
        if self.ptr == 0 {
            return 0;
        }
        self.ptr + (elements * std::mem::size_of::<T>()) as u64
    }
}

/// Byte range of elements `[start, end)` of `T`.
pub(super) fn byte_range<T>(start: usize, end: usize) -> std::ops::Range<usize> {
    let size = std::mem::size_of::<T>();
    start * size..end * size
}

impl<T: DeviceRepr> CachedSlice<T> {
    /// Copies the buffer to a new `Vec` on its stream; returns once the copy is done.
    ///
    /// # Errors
    /// A driver error from the copy.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.alloc.dtoh(self)
    }

    /// A copy of the buffer in a new buffer from the same cache, on the same stream (cudarc's
    /// `CudaSlice::try_clone`, which allocates through the driver instead).
    ///
    /// # Errors
    /// Out of memory (as `CUDA_ERROR_OUT_OF_MEMORY`) or a driver error from the copy.
    pub fn try_clone(&self) -> std::result::Result<Self, cu::DriverError> {
        // SAFETY: every value is written by the copy below before anyone can read it.
        let mut dst = unsafe { self.alloc.alloc::<T>(&self.stream, self.len) }?;
        if self.len > 0 {
            self.stream.memcpy_dtod(self, &mut dst)?;
        }
        Ok(dst)
    }
}

/// cudarc's `Clone` for `CudaSlice`: a copy from the same cache (see
/// [`try_clone`](CachedSlice::try_clone)). Like cudarc's, it panics when the copy cannot be
/// made; call `try_clone` to get the error instead.
impl<T: DeviceRepr> Clone for CachedSlice<T> {
    fn clone(&self) -> Self {
        match self.try_clone() {
            Ok(c) => c,
            Err(e) => panic!("CachedSlice::clone: {e}"),
        }
    }
}

/// cudarc's `TryFrom<CudaSlice<T>> for Vec<T>`: copies the buffer to the host on its stream,
/// then returns the buffer to the cache.
impl<T: Clone + Default + DeviceRepr> TryFrom<CachedSlice<T>> for Vec<T> {
    type Error = cu::DriverError;

    fn try_from(value: CachedSlice<T>) -> std::result::Result<Self, Self::Error> {
        if value.is_empty() {
            return Ok(Vec::new());
        }
        value.stream.clone_dtoh(&value)
    }
}

impl<T> cu::DeviceSlice<T> for CachedSlice<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> cu::DevicePtr<T> for CachedSlice<T> {
    /// The address; `stream` first waits for the buffer's last write and the guard records the
    /// read, as for cudarc's `CudaSlice`.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self.events_on(Some(stream)) {
            Events::Typed(t) => cu::DevicePtr::<T>::device_ptr(t, stream),
            Events::Bytes(b) => {
                let (_, sync) = cu::DevicePtr::<u8>::device_ptr(b, stream);
                (self.ptr, sync)
            }
            Events::None if self.ptr == 0 => (0, SyncOnDrop::Record(None)),
            Events::None => (
                self.ptr,
                untracked(&self.alloc, self.ptr, &self.stream, stream),
            ),
        }
    }
}

impl<T> cu::DevicePtrMut<T> for CachedSlice<T> {
    /// The address; `stream` first waits for the buffer's last reads and write and the guard
    /// records the write, as for cudarc's `CudaSlice`.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let (ptr, own, alloc, events) = self.parts_mut_on(Some(stream));
        match events {
            EventsMut::Typed(t) => cu::DevicePtrMut::<T>::device_ptr_mut(t, stream),
            EventsMut::Bytes(b) => {
                let (_, sync) = cu::DevicePtrMut::<u8>::device_ptr_mut(b, stream);
                (ptr, sync)
            }
            EventsMut::None if ptr == 0 => (0, SyncOnDrop::Record(None)),
            EventsMut::None => (ptr, untracked(alloc, ptr, own, stream)),
        }
    }
}

// SAFETY: with an event shell, the argument is pushed by cudarc's own implementation for
// `&CudaSlice<T>` or `&CudaSlice<u8>`, which points at the shell's `CUdeviceptr` (equal to the
// buffer's address) inside `*arg`, borrowed for `'b` (longer than the builder's `'a`), and waits
// for the last write and records the read on the launch stream. Without one, it points at
// `arg.ptr`, a `CUdeviceptr` (`u64`, a `DeviceRepr`) inside `*arg`, equally borrowed. Either way
// the kernel receives the buffer's device address by value, exactly as for a `CudaSlice`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedSlice<T>) -> &mut Self {
        match arg.events() {
            Events::Typed(t) => <Self as PushKernelArg<&'b cu::CudaSlice<T>>>::arg(self, t),
            Events::Bytes(b) => <Self as PushKernelArg<&'b cu::CudaSlice<u8>>>::arg(self, b),
            Events::None => {
                unordered_kernel_use(&arg.alloc, arg.ptr, &arg.stream);
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
            }
        }
    }
}

// SAFETY: as for `&CachedSlice<T>`, through cudarc's implementations for `&mut CudaSlice<T>` and
// `&mut CudaSlice<u8>` (waits for the last reads and write, records the write); the exclusive
// borrow only adds that no one else uses the buffer from the host meanwhile.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedSlice<T>) -> &mut Self {
        arg.prepare_mut();
        let CachedSlice {
            ptr,
            shell,
            typed,
            alloc,
            stream,
            ..
        } = arg;
        match (typed.get_mut(), shell.get_mut()) {
            (Some(t), _) => <Self as PushKernelArg<&'b mut cu::CudaSlice<T>>>::arg(self, &mut **t),
            (None, Some(b)) => {
                <Self as PushKernelArg<&'b mut cu::CudaSlice<u8>>>::arg(self, &mut **b)
            }
            (None, None) => {
                unordered_kernel_use(alloc, *ptr, stream);
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &*ptr)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::resolve;

    #[test]
    fn ranges_resolve_like_slices() {
        assert_eq!(resolve(.., 10), Some((0, 10)));
        assert_eq!(resolve(2..5, 10), Some((2, 5)));
        assert_eq!(resolve(2..=5, 10), Some((2, 6)));
        assert_eq!(resolve(..=9, 10), Some((0, 10)));
        assert_eq!(resolve(10.., 10), Some((10, 10)));
        assert_eq!(resolve(..11, 10), None);
        assert_eq!(
            resolve(
                (std::ops::Bound::Included(6), std::ops::Bound::Excluded(5)),
                10
            ),
            None
        );
        assert_eq!(resolve(..=usize::MAX, 10), None);
    }
}
