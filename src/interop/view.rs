//! `CachedView` and `CachedViewMut`: borrowed sub-ranges of a [`CachedSlice`], with the same
//! cudarc traits and cudarc's stream ordering. cudarc's own `CudaView` can only be made from a
//! `CudaSlice`, hence these; each carries, while cudarc manages stream synchronization, a cudarc
//! view of the same bytes cut from the buffer's event shell, through which every use waits and
//! records exactly as a `CudaView` of a `CudaSlice` would. May use: `interop::slice`,
//! `interop::allocator`, `interop::events`.
//!
//! [`CachedSlice`]: super::CachedSlice

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;

use cudarc::driver::{
    self as cu, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, PushKernelArg,
    SyncOnDrop, sys,
};

use super::allocator::CudaAllocator;
use super::slice::{resolve, untracked};
use crate::{DevicePtr, Result};

/// Byte range of elements `[start, end)` of `T`.
fn bytes_of<T>(start: usize, end: usize) -> std::ops::Range<usize> {
    let size = std::mem::size_of::<T>();
    start * size..end * size
}

macro_rules! view_common {
    ($name:ident, $cu:ident) => {
        impl<'a, T> $name<'a, T> {
            pub(super) fn new(
                ptr: sys::CUdeviceptr,
                len: usize,
                base: sys::CUdeviceptr,
                stream: &'a Arc<CudaStream>,
                alloc: &'a CudaAllocator,
                cu: Option<$cu<'a, u8>>,
            ) -> Self {
                $name {
                    ptr,
                    len,
                    base,
                    stream,
                    alloc,
                    cu,
                    marker: PhantomData,
                }
            }

            /// The number of values.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the view holds no values.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The size in bytes.
            pub fn num_bytes(&self) -> usize {
                self.len * std::mem::size_of::<T>()
            }

            /// The device address of the first value.
            pub fn device_ptr_raw(&self) -> DevicePtr {
                DevicePtr(self.ptr)
            }

            /// Marks the whole underlying buffer as used on `stream`; see
            /// [`CachedSlice::record_stream`](super::CachedSlice::record_stream).
            ///
            /// # Errors
            /// A stream of another device, or an error of the core.
            pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
                if self.base == 0 {
                    return Ok(());
                }
                let id = self.alloc.admit(stream)?;
                if id == crate::backend::cuda::stream_id(self.stream) {
                    return Ok(());
                }
                self.alloc.record_stream(DevicePtr(self.base), id)
            }

            /// A shared sub-view of `range` (relative to this view), or `None` when out of
            /// bounds.
            pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
                let (start, end) = resolve(range, self.len)?;
                let cu = self
                    .cu
                    .as_ref()
                    .and_then(|v| v.try_slice(bytes_of::<T>(start, end)));
                Some(CachedView::new(
                    self.offset(start),
                    end - start,
                    self.base,
                    self.stream,
                    self.alloc,
                    cu,
                ))
            }

            fn offset(&self, elements: usize) -> sys::CUdeviceptr {
                if self.ptr == 0 {
                    return 0;
                }
                self.ptr + (elements * std::mem::size_of::<T>()) as u64
            }
        }

        impl<T: DeviceRepr> $name<'_, T> {
            /// Copies the view to a new `Vec` on the buffer's stream; returns once it is done.
            ///
            /// # Errors
            /// A driver error from the copy.
            pub fn to_vec(&self) -> Result<Vec<T>> {
                self.alloc.dtoh(self)
            }
        }

        impl<T> fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("ptr", &DevicePtr(self.ptr))
                    .field("len", &self.len)
                    .field("buffer", &DevicePtr(self.base))
                    .field("events", &self.cu.is_some())
                    .finish()
            }
        }

        impl<T> cu::DeviceSlice<T> for $name<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                self.stream
            }
        }

        impl<T> cu::DevicePtr<T> for $name<'_, T> {
            /// The address; `stream` first waits for the buffer's last write and the guard
            /// records the read, as for cudarc's views.
            fn device_ptr<'b>(
                &'b self,
                stream: &'b CudaStream,
            ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
                match &self.cu {
                    Some(v) => {
                        let (_, sync) = cu::DevicePtr::<u8>::device_ptr(v, stream);
                        (self.ptr, sync)
                    }
                    None if self.base == 0 => (self.ptr, SyncOnDrop::Record(None)),
                    None => (self.ptr, untracked(self.stream, stream)),
                }
            }
        }
    };
}

/// A shared view of part of a [`CachedSlice`](super::CachedSlice) (like cudarc's `CudaView`).
/// Get one with [`CachedSlice::get`](super::CachedSlice::get) or
/// [`as_view`](super::CachedSlice::as_view).
pub struct CachedView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Start of the whole allocation (what `record_stream` names).
    base: sys::CUdeviceptr,
    stream: &'a Arc<CudaStream>,
    alloc: &'a CudaAllocator,
    /// cudarc's view of the same bytes with the buffer's events, when it has them.
    cu: Option<CudaView<'a, u8>>,
    marker: PhantomData<&'a [T]>,
}

/// An exclusive view of part of a [`CachedSlice`](super::CachedSlice) (like cudarc's
/// `CudaViewMut`). Get one with [`CachedSlice::get_mut`](super::CachedSlice::get_mut),
/// [`as_view_mut`](super::CachedSlice::as_view_mut) or
/// [`split_at_mut_checked`](super::CachedSlice::split_at_mut_checked).
pub struct CachedViewMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Start of the whole allocation (what `record_stream` names).
    base: sys::CUdeviceptr,
    stream: &'a Arc<CudaStream>,
    alloc: &'a CudaAllocator,
    /// cudarc's view of the same bytes with the buffer's events, when it has them.
    cu: Option<CudaViewMut<'a, u8>>,
    marker: PhantomData<&'a mut [T]>,
}

view_common!(CachedView, CudaView);
view_common!(CachedViewMut, CudaViewMut);

impl<T> Clone for CachedView<'_, T> {
    fn clone(&self) -> Self {
        CachedView {
            ptr: self.ptr,
            len: self.len,
            base: self.base,
            stream: self.stream,
            alloc: self.alloc,
            cu: self.cu.as_ref().and_then(|v| v.try_slice(..)),
            marker: PhantomData,
        }
    }
}

// SAFETY: with cudarc's view, the argument is pushed by cudarc's implementation for
// `&CudaView<u8>`, which points at that view's `CUdeviceptr` (equal to this view's address)
// inside `*arg`, borrowed for `'b` (longer than the builder's `'a`), and waits for the buffer's
// last write and records its read on the launch stream. Without one it points at `arg.ptr`, a
// `CUdeviceptr` (`u64`, a `DeviceRepr`) inside `*arg`, equally borrowed. The kernel receives the
// view's device address by value either way.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b CachedView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedView<'c, T>) -> &mut Self {
        match &arg.cu {
            Some(v) => <Self as PushKernelArg<&'b CudaView<'c, u8>>>::arg(self, v),
            None => <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr),
        }
    }
}

impl<'a, T> CachedViewMut<'a, T> {
    /// A mutable sub-view of `range` (relative to this view), or `None` when out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let ptr = self.offset(start);
        let cu = self
            .cu
            .as_mut()
            .and_then(|v| v.try_slice_mut(bytes_of::<T>(start, end)));
        Some(CachedViewMut::new(
            ptr,
            end - start,
            self.base,
            self.stream,
            self.alloc,
            cu,
        ))
    }

    /// This view as a shared view (cudarc's `CudaViewMut::as_view`).
    pub fn as_view(&self) -> CachedView<'_, T> {
        let cu = self.cu.as_ref().and_then(|v| v.try_slice(..));
        CachedView::new(self.ptr, self.len, self.base, self.stream, self.alloc, cu)
    }

    /// Two disjoint mutable sub-views, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at_mut_checked(
        &mut self,
        mid: usize,
    ) -> Option<(CachedViewMut<'_, T>, CachedViewMut<'_, T>)> {
        if mid > self.len {
            return None;
        }
        let second = self.offset(mid);
        let (cu_a, cu_b) = match self
            .cu
            .as_mut()
            .and_then(|v| v.try_split_at_mut(mid * std::mem::size_of::<T>()))
        {
            Some((x, y)) => (Some(x), Some(y)),
            None => (None, None),
        };
        Some((
            CachedViewMut::new(self.ptr, mid, self.base, self.stream, self.alloc, cu_a),
            CachedViewMut::new(
                second,
                self.len - mid,
                self.base,
                self.stream,
                self.alloc,
                cu_b,
            ),
        ))
    }
}

impl<T> cu::DevicePtrMut<T> for CachedViewMut<'_, T> {
    /// The address; `stream` first waits for the buffer's last reads and write and the guard
    /// records the write, as for cudarc's `CudaViewMut`.
    fn device_ptr_mut<'b>(
        &'b mut self,
        stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        let ptr = self.ptr;
        match &mut self.cu {
            Some(v) => {
                let (_, sync) = cu::DevicePtrMut::<u8>::device_ptr_mut(v, stream);
                (ptr, sync)
            }
            None if self.base == 0 => (ptr, SyncOnDrop::Record(None)),
            None => (ptr, untracked(self.stream, stream)),
        }
    }
}

// SAFETY: as for `&CachedView` above, through cudarc's implementation for `&mut CudaViewMut<u8>`
// (waits for the last reads and write, records the write); the exclusive borrow only adds that
// no one else uses the view from the host meanwhile.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut CachedViewMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedViewMut<'c, T>) -> &mut Self {
        let CachedViewMut { ptr, cu, .. } = arg;
        match cu {
            Some(v) => <Self as PushKernelArg<&'b mut CudaViewMut<'c, u8>>>::arg(self, v),
            None => <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &*ptr),
        }
    }
}
