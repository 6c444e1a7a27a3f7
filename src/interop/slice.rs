//! `CachedSlice<T>`: an owned typed device buffer from the cache, usable wherever cudarc takes a
//! `CudaSlice<T>` through its traits. May use: the core, `backend::cuda`, `interop::view`.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cudarc::driver::{
    self as cu, CudaStream, DeviceRepr, LaunchArgs, PushKernelArg, SyncOnDrop, sys,
};

use super::allocator::CudaAllocator;
use super::view::{CachedView, CachedViewMut};
use crate::backend::cuda::stream_id;
use crate::{DevicePtr, Result, StreamId};

/// `len` values of `T` in device memory owned by a caching allocator; dropping it returns the
/// memory to the cache (never to the driver directly, and without synchronizing).
///
/// It belongs to the stream it was allocated on: the cache reuses its memory in that stream's
/// order. Before using it on another stream, call [`record_stream`](Self::record_stream) (as with
/// PyTorch's `Tensor.record_stream`).
///
/// It implements cudarc's [`DeviceSlice`](cu::DeviceSlice), [`DevicePtr`](cu::DevicePtr),
/// [`DevicePtrMut`](cu::DevicePtrMut) and [`PushKernelArg`] (for `&buf` and `&mut buf`), so
/// `stream.memcpy_htod(&host, &mut buf)`, `stream.memcpy_dtod(&a, &mut b)`,
/// `stream.memset_zeros(&mut buf)`, `stream.launch_builder(&f).arg(&mut buf)` and cuBLAS's
/// `gemm(cfg, &a, &b, &mut c)` accept it unchanged. Unlike a `CudaSlice`, it carries no CUDA
/// events: ordering across streams is the caller's, as in PyTorch.
///
/// A zero-length buffer has the null pointer and takes no memory.
pub struct CachedSlice<T> {
    /// The `CUdeviceptr`; kernel arguments point at this field, so it must stay in place while
    /// borrowed (it does: pushing borrows `self`).
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    alloc: CudaAllocator,
    marker: PhantomData<T>,
}

impl<T> fmt::Debug for CachedSlice<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedSlice")
            .field("ptr", &DevicePtr(self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream_id())
            .field("device", &self.alloc.ordinal())
            .finish()
    }
}

impl<T> Drop for CachedSlice<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Err(e) = self.alloc.free(DevicePtr(self.ptr)) {
            // Nothing can be returned from Drop; the memory stays with the cache as a leak.
            if !std::thread::panicking() {
                tracing::error!(target: "cuda_caching_allocator", ptr = %DevicePtr(self.ptr), error = %e, "freeing a CachedSlice failed");
            }
        }
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
    ) -> Self {
        CachedSlice {
            ptr: ptr.0,
            len,
            stream,
            alloc,
            marker: PhantomData,
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

    /// The stream the buffer was allocated on.
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

    /// Marks the buffer as used on `stream` (PyTorch's `Tensor.record_stream`): when it is
    /// dropped, the cache records an event on `stream` and reuses the memory only after the work
    /// queued there by then is done. Recording the allocation stream is a no-op. The stream is
    /// admitted to the device and kept alive by it.
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

    /// A view of `range`, or `None` when it is out of bounds.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        Some(CachedView::new(
            self.offset(start),
            end - start,
            self.ptr,
            &self.stream,
            &self.alloc,
        ))
    }

    /// A mutable view of `range`, or `None` when it is out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        Some(CachedViewMut::new(
            self.offset(start),
            end - start,
            self.ptr,
            &self.stream,
            &self.alloc,
        ))
    }

    /// The whole buffer as a view.
    pub fn as_view(&self) -> CachedView<'_, T> {
        CachedView::new(self.ptr, self.len, self.ptr, &self.stream, &self.alloc)
    }

    /// The whole buffer as a mutable view.
    pub fn as_view_mut(&mut self) -> CachedViewMut<'_, T> {
        CachedViewMut::new(self.ptr, self.len, self.ptr, &self.stream, &self.alloc)
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
        // Both views borrow `self` mutably for their lifetime and cover disjoint ranges.
        Some((
            CachedViewMut::new(a, mid, self.ptr, &self.stream, &self.alloc),
            CachedViewMut::new(b, self.len - mid, self.ptr, &self.stream, &self.alloc),
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
    /// The address, with nothing to record (no per-buffer events).
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> cu::DevicePtrMut<T> for CachedSlice<T> {
    /// The address, with nothing to record (no per-buffer events).
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

// SAFETY: the pushed argument is a pointer to `arg.ptr`, a `CUdeviceptr` (`u64`, a `DeviceRepr`)
// that lives inside `*arg`, which stays borrowed (and so in place and alive) for `'b`, longer than
// the launch builder `'a`; the kernel receives the buffer's device address by value, exactly as
// for a `CudaSlice`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedSlice<T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CachedSlice<T>`; the exclusive borrow only adds that no one else uses the
// buffer from the host meanwhile.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedSlice<T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
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
