//! `CachedSlice<T>`: an owned typed device buffer from the cache, usable wherever cudarc takes a
//! `CudaSlice<T>` through its traits, with cudarc's stream ordering. May use: the core,
//! `backend::cuda`, `interop::view`, `interop::events`.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    self as cu, CudaStream, DeviceRepr, LaunchArgs, PushKernelArg, SyncOnDrop, sys,
};

use super::allocator::CudaAllocator;
use super::events::EventShell;
use super::view::{CachedView, CachedViewMut};
use crate::backend::cuda::stream_id;
use crate::{DevicePtr, Result, StreamId};

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
/// stay with the block's address in the allocator and are reused by the next buffer there, so a
/// cache hit creates no CUDA event. A context with one stream, or with event tracking off, makes
/// no event and orders nothing, as cudarc does; [`record_stream`](Self::record_stream) (PyTorch's
/// rule) then declares a use on another stream.
///
/// A zero-length buffer has the null pointer and takes no memory.
pub struct CachedSlice<T> {
    /// The `CUdeviceptr`; kernel arguments point at this field when no shell exists, so it must
    /// stay in place while borrowed (it does: pushing borrows `self`).
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    alloc: CudaAllocator,
    /// cudarc's read/write events for this buffer, made (or taken back from the allocator's
    /// pool) once the context manages stream synchronization.
    shell: OnceLock<EventShell>,
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
            .field("ptr", &DevicePtr(self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream_id())
            .field("device", &self.alloc.ordinal())
            .field("events", &self.shell.get().is_some())
            .finish()
    }
}

impl<T> Drop for CachedSlice<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Some(mut shell) = self.shell.take() {
            if managing(&self.stream) {
                // cudarc's free rule: the freeing stream (the allocation stream, in whose order
                // the cache reuses the block) waits for the buffer's last read and last write on
                // every stream. A write use on it does exactly those two waits; its record is
                // not needed (the block is free from here on), so the guard is forgotten (it
                // holds only references).
                let (_, record) = cu::DevicePtrMut::<u8>::device_ptr_mut(&mut *shell, &self.stream);
                std::mem::forget(record);
            }
            self.alloc.shells().put(self.ptr, shell);
        }
        // SAFETY: the buffer owns the block at `self.ptr` (it came from this allocator and no
        // other handle frees it); it is never used again after this point.
        if let Err(e) = unsafe { self.alloc.free(DevicePtr(self.ptr)) } {
            // Nothing can be returned from Drop; the memory stays with the cache as a leak.
            if !std::thread::panicking() {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DevicePtr(self.ptr), error = %e, "freeing a CachedSlice failed");
            }
        }
    }
}

/// Whether cudarc manages stream synchronization for buffers of `stream`'s context.
#[inline]
pub(super) fn managing(stream: &CudaStream) -> bool {
    stream.context().is_managing_stream_synchronization()
}

/// The guard for a use with no event shell: nothing to record when cudarc orders nothing, a
/// synchronize of the using stream after the use when it should have and the shell could not be
/// made (the use is then complete before anything else can conflict with it).
#[inline]
pub(super) fn untracked<'a>(owner: &CudaStream, using: &'a CudaStream) -> SyncOnDrop<'a> {
    if managing(owner) {
        SyncOnDrop::sync_stream(using)
    } else {
        SyncOnDrop::Record(None)
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
        ptr: DevicePtr,
        len: usize,
        stream: Arc<CudaStream>,
        alloc: CudaAllocator,
        shell: Option<EventShell>,
    ) -> Self {
        let cell = OnceLock::new();
        if let Some(shell) = shell {
            let _ = cell.set(shell);
        }
        CachedSlice {
            ptr: ptr.0,
            len,
            stream,
            alloc,
            shell: cell,
            marker: PhantomData,
        }
    }

    /// The event shell, made now when the context manages stream synchronization and the buffer
    /// has none yet (the context gained a second stream after the allocation). `None` when
    /// cudarc orders nothing, or when the events could not be made (logged; uses then
    /// synchronize instead, see [`untracked`]).
    pub(super) fn shell(&self) -> Option<&EventShell> {
        if let Some(shell) = self.shell.get() {
            return Some(shell);
        }
        if self.ptr == 0 || !managing(&self.stream) {
            return None;
        }
        // SAFETY: the buffer owns `[ptr, ptr + num_bytes)` until it is dropped, and the shell
        // lives inside it (or, afterwards, in the allocator's pool, unused until a buffer owns
        // that address again).
        match unsafe {
            self.alloc.shells().take(
                self.stream.context(),
                self.ptr,
                self.num_bytes(),
                self.num_bytes(),
            )
        } {
            Ok(shell) => {
                // Another thread may have made one meanwhile: then ours is dropped (its events
                // destroyed) and theirs is used.
                let _ = self.shell.set(shell);
                self.shell.get()
            }
            Err(e) => {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DevicePtr(self.ptr), error = %e, "no events for a CachedSlice: its uses synchronize their stream instead");
                None
            }
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
    pub fn device_ptr_raw(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }

    /// The stream the buffer was allocated on (and is freed on).
    pub fn alloc_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The [`StreamId`] of [`alloc_stream`](Self::alloc_stream).
    pub fn stream_id(&self) -> StreamId {
        stream_id(&self.stream)
    }

    /// The allocator the buffer returns to.
    pub fn allocator(&self) -> &CudaAllocator {
        &self.alloc
    }

    /// Whether the buffer carries cudarc's read/write events (the context manages stream
    /// synchronization); see the type's docs.
    pub fn has_events(&self) -> bool {
        self.shell.get().is_some()
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
        self.alloc.record_stream(DevicePtr(self.ptr), id)
    }

    /// Byte range of elements `[start, end)`.
    fn byte_range(start: usize, end: usize) -> std::ops::Range<usize> {
        let size = std::mem::size_of::<T>();
        start * size..end * size
    }

    /// A view of `range`, or `None` when it is out of bounds.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let cu = self
            .shell()
            .and_then(|s| s.try_slice(Self::byte_range(start, end)));
        Some(CachedView::new(
            self.offset(start),
            end - start,
            self.ptr,
            &self.stream,
            &self.alloc,
            cu,
        ))
    }

    /// A mutable view of `range`, or `None` when it is out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let ptr = self.offset(start);
        let _ = self.shell();
        let CachedSlice {
            ptr: base,
            stream,
            alloc,
            shell,
            ..
        } = self;
        let cu = shell
            .get_mut()
            .and_then(|s| s.try_slice_mut(Self::byte_range(start, end)));
        Some(CachedViewMut::new(
            ptr,
            end - start,
            *base,
            stream,
            alloc,
            cu,
        ))
    }

    /// The whole buffer as a view.
    pub fn as_view(&self) -> CachedView<'_, T> {
        let cu = self.shell().and_then(|s| s.try_slice(..self.num_bytes()));
        CachedView::new(self.ptr, self.len, self.ptr, &self.stream, &self.alloc, cu)
    }

    /// The whole buffer as a mutable view.
    pub fn as_view_mut(&mut self) -> CachedViewMut<'_, T> {
        let len = self.len;
        let ptr = self.ptr;
        let bytes = self.num_bytes();
        let _ = self.shell();
        let CachedSlice {
            stream,
            alloc,
            shell,
            ..
        } = self;
        let cu = shell.get_mut().and_then(|s| s.try_slice_mut(..bytes));
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
        let (a, b) = (self.ptr, self.offset(mid));
        let (len, mid_bytes) = (self.len, mid * std::mem::size_of::<T>());
        let _ = self.shell();
        let CachedSlice {
            ptr: base,
            stream,
            alloc,
            shell,
            ..
        } = self;
        // The shell may be longer than the buffer (it covers the block); the second part's length
        // is never used, only its address and events.
        let (cu_a, cu_b) = match shell.get_mut().and_then(|s| s.try_split_at_mut(mid_bytes)) {
            Some((x, y)) => (Some(x), Some(y)),
            None => (None, None),
        };
        // Both views borrow `self` mutably for their lifetime and cover disjoint ranges.
        Some((
            CachedViewMut::new(a, mid, *base, stream, alloc, cu_a),
            CachedViewMut::new(b, len - mid, *base, stream, alloc, cu_b),
        ))
    }

    fn offset(&self, elements: usize) -> sys::CUdeviceptr {
        if self.ptr == 0 {
            return 0;
        }
        self.ptr + (elements * std::mem::size_of::<T>()) as u64
    }
}

impl<T: DeviceRepr> CachedSlice<T> {
    /// Copies the buffer to a new `Vec` on its stream; returns once the copy is done.
    ///
    /// # Errors
    /// A driver error from the copy.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.alloc.dtoh(self)
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
        match self.shell() {
            Some(shell) => {
                let (_, sync) = cu::DevicePtr::<u8>::device_ptr(&**shell, stream);
                (self.ptr, sync)
            }
            None if self.ptr == 0 => (0, SyncOnDrop::Record(None)),
            None => (self.ptr, untracked(&self.stream, stream)),
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
        let _ = self.shell();
        let ptr = self.ptr;
        match self.shell.get_mut() {
            Some(shell) => {
                let (_, sync) = cu::DevicePtrMut::<u8>::device_ptr_mut(&mut **shell, stream);
                (ptr, sync)
            }
            None if ptr == 0 => (0, SyncOnDrop::Record(None)),
            None => (ptr, untracked(&self.stream, stream)),
        }
    }
}

// SAFETY: with an event shell, the argument is pushed by cudarc's own implementation for
// `&CudaSlice<u8>`, which points at the shell's `CUdeviceptr` (equal to the buffer's address)
// inside `*arg`, borrowed for `'b` (longer than the builder's `'a`), and waits for the last write
// and records the read on the launch stream. Without one, it points at `arg.ptr`, a `CUdeviceptr`
// (`u64`, a `DeviceRepr`) inside `*arg`, equally borrowed. Either way the kernel receives the
// buffer's device address by value, exactly as for a `CudaSlice`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedSlice<T>) -> &mut Self {
        match arg.shell() {
            Some(shell) => <Self as PushKernelArg<&'b cu::CudaSlice<u8>>>::arg(self, &**shell),
            None => <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr),
        }
    }
}

// SAFETY: as for `&CachedSlice<T>`, through cudarc's implementation for `&mut CudaSlice<u8>`
// (waits for the last reads and write, records the write); the exclusive borrow only adds that no
// one else uses the buffer from the host meanwhile.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedSlice<T>) -> &mut Self {
        let _ = arg.shell();
        let CachedSlice { ptr, shell, .. } = arg;
        match shell.get_mut() {
            Some(shell) => {
                <Self as PushKernelArg<&'b mut cu::CudaSlice<u8>>>::arg(self, &mut **shell)
            }
            None => <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &*ptr),
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
