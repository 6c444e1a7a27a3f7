//! cudarc's stream ordering for cached buffers: an [`EventShell`] is a cudarc `CudaSlice<u8>` over
//! cached memory that exists only for its read and write events, and a [`ShellPool`] keeps shells
//! with their block's address after the buffer is dropped, so that a buffer reallocated at that
//! address takes them back instead of creating CUDA events.
//!
//! cudarc tracks cross-stream use through two events per `CudaSlice` (read and write), recorded on
//! every use and waited on before a conflicting use and before the free. Those fields are private
//! to cudarc, and its kernel-launch builder only waits and records for its own buffer and view
//! types. Giving each cached buffer a shell of cudarc's own type makes every cudarc path (copies,
//! memsets, kernel launches, cuBLAS) apply cudarc's exact rules, with cudarc's own code.
//!
//! A shell never frees memory: its drop calls `CudaSlice::leak`, which waits on its events on the
//! default stream and destroys them, and returns the address without freeing it. Shells are made
//! while event tracking is on (cudarc's default, where each of its own buffers has its events),
//! one stream or more (Note [Events whenever tracking is on] in `interop::slice`); with one stream
//! they order nothing, and a cache hit takes its address's kept shell, so a warmed-up program
//! creates no events.
//!
//! The pool also quarantines the shells of buffers dropped inside a capture until no capture is
//! underway, and marks the buffers a kernel used without events (Notes [Drops inside a capture]
//! and [Uses without events] in `interop::slice`).
//!
//! May use: `cudarc`, `interop` helpers, `error`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, sys};
use parking_lot::Mutex;

use crate::{AllocError, BackendError};

/// Most shells a pool keeps; a shell returned to a full pool is destroyed instead. Each holds two
/// CUDA events and nothing else.
pub(super) const POOL_CAP: usize = 8192;

/// cudarc's buffer type over cached memory, kept for its read and write events (and, typed, to
/// lend `&CudaSlice<T>`). Dropping it never frees the memory: its drop calls `CudaSlice::leak`,
/// which waits on the events on the shell's stream, destroys them and hands back the address.
pub(super) struct Shell<T>(ManuallyDrop<CudaSlice<T>>);

/// The pooled byte shell of a block (see the module docs).
pub(super) type EventShell = Shell<u8>;

/// A `CudaSlice<T>` over a cached buffer's memory, made on the buffer's own stream when a program
/// asks for cudarc's concrete type (`CachedSlice::as_cuda_slice`). Its events are the buffer's
/// from the moment it exists (see `interop::slice`), so it is never pooled: it is made at most
/// once per buffer.
pub(super) type TypedShell<T> = Shell<T>;

impl<T> fmt::Debug for Shell<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shell")
            .field("len", &self.0.len())
            .finish_non_exhaustive()
    }
}

impl<T> Deref for Shell<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl<T> DerefMut for Shell<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}

impl<T> Drop for Shell<T> {
    fn drop(&mut self) {
        // SAFETY: the field is never used again: this is the shell's drop.
        let slice = unsafe { ManuallyDrop::take(&mut self.0) };
        // Waits on the events, destroys them, frees nothing: the memory belongs to the cache.
        let _ = slice.leak();
    }
}

/// Event-shell creations left to fail ([`fail_next_event_shells`]).
static FAIL_SHELLS: AtomicUsize = AtomicUsize::new(0);

/// Test hook, not part of the API: the next `n` event-shell creations of every cache in the
/// process fail as when cudarc cannot create a buffer's events, so that the GPU tests reach the
/// paths of Note [Uses without events] in `interop::slice`.
#[doc(hidden)]
pub fn fail_next_event_shells(n: usize) {
    FAIL_SHELLS.store(n, Ordering::SeqCst);
}

impl<T> Shell<T> {
    /// The `CudaContext` object the shell was made under.
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        self.0.stream().context()
    }

    /// A new shell of `len` values at `ptr` on `stream`, with two new events (cudarc's
    /// `CudaStream::upgrade_device_ptr`).
    ///
    /// # Errors
    /// A backend error when cudarc could not create the events.
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len * size_of::<T>())` is device memory of `stream`'s device that the cache
    ///    has handed to the caller and that stays allocated while the shell is used for it, and
    ///    holds values of `T` as far as anyone reading it through the shell can tell.
    pub(super) unsafe fn on_stream(
        stream: &Arc<CudaStream>,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<Self, AllocError> {
        if FAIL_SHELLS
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(no_events());
        }
        // cudarc's event creation binds the context, which takes the error cudarc kept for the
        // program's next call (`CudaContext::check_err`); it is taken first and put back, so that
        // neither the creation fails on it nor the program loses it.
        let pending = stream.context().check_err();
        // cudarc unwraps the event creation inside `upgrade_device_ptr`; a failure there must not
        // unwind through the caller, so it is caught and reported as an error.
        // SAFETY: obligation 1 is the caller's; the slice is never dropped as a `CudaSlice` (see
        // `Drop for Shell`), so cudarc never frees the memory.
        let made = catch_unwind(AssertUnwindSafe(|| unsafe {
            stream.upgrade_device_ptr::<T>(ptr, len)
        }));
        stream.context().record_err(pending);
        match made {
            Ok(slice) => Ok(Shell(ManuallyDrop::new(slice))),
            Err(_) => Err(no_events()),
        }
    }
}

impl Shell<u8> {
    /// A new byte shell of `len` bytes at `ptr` on the context's default stream (pooled shells
    /// outlive the buffers, so they hold no user stream).
    ///
    /// # Errors
    /// As [`Shell::on_stream`].
    ///
    /// # Safety
    /// As [`Shell::on_stream`], for `ctx`'s device.
    pub(super) unsafe fn new(
        ctx: &Arc<CudaContext>,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<Self, AllocError> {
        // SAFETY: the caller's obligations; bytes are valid for every bit pattern.
        unsafe { Self::on_stream(&ctx.default_stream(), ptr, len) }
    }
}

/// The error of a failed event creation inside cudarc.
fn no_events() -> AllocError {
    AllocError::Backend {
        operation: "cuEventCreate",
        source: BackendError::Driver {
            operation: "cuEventCreate",
            source: "cudarc could not create the read/write events of a buffer".into(),
        },
    }
}

/// Destroys `shell` leaving cudarc's pending error as it was: the destruction waits on the
/// shell's events on its stream, and a wait on events recorded inside a capture that has ended
/// fails (`CUDA_ERROR_INVALID_VALUE`); that failure is the shell's, not the program's. cudarc
/// records it in the context object the shell was made under (its stream's), which need not be
/// the caller's: a pool keeps shells of several objects of one device (Note [Shells of one
/// context object]), so that object's error is the one set aside and put back.
pub(super) fn destroy_quietly<T>(shell: Shell<T>) {
    let ctx = Arc::clone(shell.context());
    let pending = ctx.check_err();
    drop(shell);
    let _ = ctx.check_err();
    ctx.record_err(pending);
}

/// Shells kept by block address after their buffers were dropped, and the quarantined ones.
#[derive(Default)]
pub(super) struct ShellPool {
    shells: Mutex<HashMap<sys::CUdeviceptr, EventShell>>,
    /// Shells of buffers dropped while their stream was capturing: their events may be recorded
    /// inside the capture, so no later buffer may take them, and destroying them waits on their
    /// events on the legacy default stream, which must wait until no capture is underway
    /// (Note [Drops inside a capture] in `interop::slice`).
    quarantine: Mutex<Vec<EventShell>>,
    /// Buffers (by address) used as a kernel argument without events while cudarc orders
    /// streams: their next use or drop synchronizes the context first (Note [Uses without
    /// events] in `interop::slice`).
    unordered: Mutex<HashSet<sys::CUdeviceptr>>,
    /// `unordered`'s length, read without the lock.
    unordered_len: AtomicUsize,
}

impl fmt::Debug for ShellPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShellPool")
            .field("kept", &self.shells.lock().len())
            .field("quarantined", &self.quarantine.lock().len())
            .finish()
    }
}

impl ShellPool {
    /// The shell kept for `ptr` if there is one covering `need` bytes and made under the same
    /// `CudaContext` object as `ctx` (left in the pool otherwise); makes none.
    ///
    /// Note [Shells of one context object]: cudarc decides per `Arc<CudaContext>` whether it
    /// orders uses across streams (`is_managing_stream_synchronization`, from the streams made
    /// through that object), and a shell's waits ask the object it was made under. Two objects
    /// for one device can share a cache (the registry hands out one allocator per device), so a
    /// shell kept by a buffer of one object, taken by a buffer of another, would order that
    /// buffer's uses by the first object's state: none at all once the first stops managing.
    /// A kept shell is therefore taken only by a buffer of its own object (an adversarial
    /// review, by reading; not yet run on a GPU).
    pub(super) fn take_kept(
        &self,
        ctx: &Arc<CudaContext>,
        ptr: sys::CUdeviceptr,
        need: usize,
    ) -> Option<EventShell> {
        let mut shells = self.shells.lock();
        match shells.get(&ptr) {
            Some(shell) if shell.len() >= need && Arc::ptr_eq(shell.context(), ctx) => {
                shells.remove(&ptr)
            }
            _ => None,
        }
    }

    /// Keeps `shell` for the next buffer at `ptr`; returns the shell left out, for the caller
    /// to destroy (`shell` itself when the pool is full, else the one it replaced at `ptr`, if
    /// any: Note [Displaced shells] in `interop::slice`).
    #[must_use = "a displaced shell is destroyed through `interop::slice::pool_shell`"]
    pub(super) fn put(&self, ptr: sys::CUdeviceptr, shell: EventShell) -> Option<EventShell> {
        let mut shells = self.shells.lock();
        if shells.len() >= POOL_CAP && !shells.contains_key(&ptr) {
            Some(shell)
        } else {
            shells.insert(ptr, shell)
        }
    }

    /// Takes the shell kept for `ptr`, whatever its length and context object (to be destroyed
    /// or quarantined: Note [A stale kept shell goes] in `interop::slice`).
    pub(super) fn evict(&self, ptr: sys::CUdeviceptr) -> Option<EventShell> {
        self.shells.lock().remove(&ptr)
    }

    /// Destroys every kept and quarantined shell (their events), for `empty_cache`.
    pub(super) fn clear(&self) {
        let all = std::mem::take(&mut *self.shells.lock());
        for (_, shell) in all {
            destroy_quietly(shell);
        }
        self.destroy_quarantined();
    }

    /// Keeps `shell` out of reuse until [`destroy_quarantined`](Self::destroy_quarantined).
    pub(super) fn quarantine(&self, shell: EventShell) {
        self.quarantine.lock().push(shell);
    }

    /// Destroys the quarantined shells (call it only while no capture is underway).
    pub(super) fn destroy_quarantined(&self) {
        let all = std::mem::take(&mut *self.quarantine.lock());
        for shell in all {
            destroy_quietly(shell);
        }
    }

    /// How many shells are kept.
    pub(super) fn len(&self) -> usize {
        self.shells.lock().len()
    }

    /// Marks the buffer at `base` as used by a kernel without events.
    pub(super) fn mark_unordered(&self, base: sys::CUdeviceptr) {
        let mut set = self.unordered.lock();
        set.insert(base);
        self.unordered_len.store(set.len(), Ordering::Release);
    }

    /// Before a use or the drop of the buffer at `base`: if a kernel used it without events,
    /// waits for all of the context's work (and forgets the mark). A failed wait is kept in
    /// cudarc's context for the program's next call, as cudarc keeps its own.
    pub(super) fn settle_unordered(&self, base: sys::CUdeviceptr, ctx: &CudaContext) {
        if self.unordered_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let had = {
            let mut set = self.unordered.lock();
            let had = set.remove(&base);
            self.unordered_len.store(set.len(), Ordering::Release);
            had
        };
        if had {
            // cudarc binds the context to synchronize; the caller's is put back.
            let restore = crate::backend::cuda::callers_context();
            ctx.record_err(ctx.synchronize());
            drop(restore);
        }
    }

    /// How many shells are quarantined.
    pub(super) fn quarantined(&self) -> usize {
        self.quarantine.lock().len()
    }
}
