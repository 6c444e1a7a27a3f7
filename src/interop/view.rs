//! `CachedView` and `CachedViewMut`: borrowed sub-ranges of a [`CachedSlice`], with the same
//! cudarc traits. cudarc's own `CudaView` can only be made from a `CudaSlice` (its fields are
//! private), hence these. May use: `interop::slice`, `interop::allocator`.
//!
//! [`CachedSlice`]: super::CachedSlice

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;

use cudarc::driver::{
    self as cu, CudaStream, DeviceRepr, LaunchArgs, PushKernelArg, SyncOnDrop, sys,
};

use super::allocator::CudaAllocator;
use super::slice::resolve;
use crate::{DevicePtr, Result};

macro_rules! view_common {
    ($name:ident) => {
        impl<'a, T> $name<'a, T> {
            pub(super) fn new(
                ptr: sys::CUdeviceptr,
                len: usize,
                base: sys::CUdeviceptr,
                stream: &'a Arc<CudaStream>,
                alloc: &'a CudaAllocator,
            ) -> Self {
                $name {
                    ptr,
                    len,
                    base,
                    stream,
                    alloc,
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

            /// A sub-view of `range` (relative to this view), or `None` when out of bounds.
            pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
                let (start, end) = resolve(range, self.len)?;
                Some(CachedView::new(
                    self.offset(start),
                    end - start,
                    self.base,
                    self.stream,
                    self.alloc,
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
            /// The address, with nothing to record (no per-buffer events).
            fn device_ptr<'b>(
                &'b self,
                _stream: &'b CudaStream,
            ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
                (self.ptr, SyncOnDrop::Record(None))
            }
        }

        // SAFETY: the pushed argument points at `arg.ptr`, a `CUdeviceptr` (`u64`, a
        // `DeviceRepr`) inside `*arg`, which stays borrowed, in place and alive for `'b`, longer
        // than the builder's `'a`; the kernel receives the view's device address by value.
        unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b $name<'c, T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: &'b $name<'c, T>) -> &mut Self {
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
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
    marker: PhantomData<&'a mut [T]>,
}

view_common!(CachedView);
view_common!(CachedViewMut);

impl<T> Clone for CachedView<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for CachedView<'_, T> {}

impl<'a, T> CachedViewMut<'a, T> {
    /// A mutable sub-view of `range` (relative to this view), or `None` when out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        Some(CachedViewMut::new(
            self.offset(start),
            end - start,
            self.base,
            self.stream,
            self.alloc,
        ))
    }

    /// Two disjoint mutable sub-views, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`.
    pub fn split_at_mut_checked(
        self,
        mid: usize,
    ) -> Option<(CachedViewMut<'a, T>, CachedViewMut<'a, T>)> {
        if mid > self.len {
            return None;
        }
        let second = self.offset(mid);
        Some((
            CachedViewMut::new(self.ptr, mid, self.base, self.stream, self.alloc),
            CachedViewMut::new(second, self.len - mid, self.base, self.stream, self.alloc),
        ))
    }
}

impl<T> cu::DevicePtrMut<T> for CachedViewMut<'_, T> {
    /// The address, with nothing to record (no per-buffer events).
    fn device_ptr_mut<'b>(
        &'b mut self,
        _stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

// SAFETY: as for `&CachedViewMut` (see `view_common!`); the exclusive borrow only adds that no
// one else uses the view from the host meanwhile.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut CachedViewMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedViewMut<'c, T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}
