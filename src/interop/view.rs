//! `CachedView` and `CachedViewMut`: borrowed sub-ranges of a [`CachedSlice`], with the same
//! cudarc traits and cudarc's stream ordering. Each carries, while the buffer has cudarc events,
//! a cudarc view of the same bytes cut from the buffer's event shell, through which every use
//! waits and records exactly as a `CudaView` of a `CudaSlice` would. A shared view holds a typed
//! `CudaView<'a, T>` (cut from the byte shell with cudarc's `transmute`), so it converts into
//! cudarc's type ([`CachedView::into_cuda_view`]); a mutable view holds a typed `CudaViewMut` when
//! the buffer has a typed shell (`CachedSlice::as_cuda_slice`), else a byte one. May use:
//! `interop::slice`, `interop::allocator`, `interop::events`.
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
use super::slice::{byte_range, resolve, unordered_kernel_use, untracked};
use crate::{DeviceAddr, Result};

/// The cudarc view a [`CachedViewMut`] uses for its events.
pub(super) enum ViewEvents<'a, T> {
    /// A typed view of the buffer's typed shell.
    Typed(CudaViewMut<'a, T>),
    /// A byte view of the buffer's byte shell (same address; its length may run past the view).
    Bytes(CudaViewMut<'a, u8>),
    /// No events.
    None,
}

impl<T> ViewEvents<'_, T> {
    fn is_some(&self) -> bool {
        !matches!(self, ViewEvents::None)
    }
}

macro_rules! view_common {
    ($name:ident) => {
        impl<'a, T> $name<'a, T> {
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
            pub fn device_ptr_raw(&self) -> DeviceAddr {
                DeviceAddr(self.ptr)
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
                self.alloc.record_stream(DeviceAddr(self.base), id)
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
                    .field("ptr", &DeviceAddr(self.ptr))
                    .field("len", &self.len)
                    .field("buffer", &DeviceAddr(self.base))
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
    };
}

/// A shared view of part of a [`CachedSlice`](super::CachedSlice) (like cudarc's `CudaView`).
/// Get one with [`CachedSlice::get`](super::CachedSlice::get) /
/// [`slice`](super::CachedSlice::slice) or [`as_view`](super::CachedSlice::as_view).
pub struct CachedView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Start of the whole allocation (what `record_stream` names).
    base: sys::CUdeviceptr,
    stream: &'a Arc<CudaStream>,
    alloc: &'a CudaAllocator,
    /// cudarc's view of the same values with the buffer's events, when it has them.
    cu: Option<CudaView<'a, T>>,
    marker: PhantomData<&'a [T]>,
}

/// An exclusive view of part of a [`CachedSlice`](super::CachedSlice) (like cudarc's
/// `CudaViewMut`). Get one with [`CachedSlice::get_mut`](super::CachedSlice::get_mut) /
/// [`slice_mut`](super::CachedSlice::slice_mut),
/// [`as_view_mut`](super::CachedSlice::as_view_mut) or
/// [`split_at_mut`](super::CachedSlice::split_at_mut).
pub struct CachedViewMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Start of the whole allocation (what `record_stream` names).
    base: sys::CUdeviceptr,
    stream: &'a Arc<CudaStream>,
    alloc: &'a CudaAllocator,
    /// cudarc's view of the same bytes with the buffer's events, when it has them.
    cu: ViewEvents<'a, T>,
    marker: PhantomData<&'a mut [T]>,
}

view_common!(CachedView);
view_common!(CachedViewMut);

impl<'a, T> CachedView<'a, T> {
    pub(super) fn new(
        ptr: sys::CUdeviceptr,
        len: usize,
        base: sys::CUdeviceptr,
        stream: &'a Arc<CudaStream>,
        alloc: &'a CudaAllocator,
        cu: Option<CudaView<'a, T>>,
    ) -> Self {
        CachedView {
            ptr,
            len,
            base,
            stream,
            alloc,
            cu,
            marker: PhantomData,
        }
    }

    /// A sub-view of `range` (relative to this view), or `None` when out of bounds (cudarc's
    /// `CudaView::try_slice`).
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'a, T>> {
        let (start, end) = resolve(range, self.len)?;
        let cu = self.cu.as_ref().and_then(|v| v.try_slice(start..end));
        Some(CachedView::new(
            self.offset(start),
            end - start,
            self.base,
            self.stream,
            self.alloc,
            cu,
        ))
    }

    /// cudarc's `CudaView::try_slice`: the same as [`get`](Self::get).
    pub fn try_slice(&self, bounds: impl RangeBounds<usize>) -> Option<CachedView<'a, T>> {
        self.get(bounds)
    }

    /// cudarc's `CudaView::slice`.
    ///
    /// # Panics
    /// When `bounds` is out of range, as cudarc's does; [`get`](Self::get) returns `None`.
    pub fn slice(&self, bounds: impl RangeBounds<usize>) -> CachedView<'a, T> {
        match self.get(bounds) {
            Some(v) => v,
            None => panic!(
                "CachedView::slice: range out of bounds for a view of {}",
                self.len
            ),
        }
    }

    /// cudarc's `CudaView::try_split_at`: `[0, mid)` and `[mid, len)`, or `None` when
    /// `mid > len`.
    pub fn try_split_at(&self, mid: usize) -> Option<(CachedView<'a, T>, CachedView<'a, T>)> {
        Some((self.get(..mid)?, self.get(mid..)?))
    }

    /// cudarc's `CudaView::split_at`.
    ///
    /// # Panics
    /// When `mid > len`, as cudarc's does.
    pub fn split_at(&self, mid: usize) -> (CachedView<'a, T>, CachedView<'a, T>) {
        match self.try_split_at(mid) {
            Some(v) => v,
            None => panic!("CachedView::split_at: {mid} is past the end ({})", self.len),
        }
    }

    /// cudarc's `CudaView::chunks_exact`: consecutive views of `chunk_size` values.
    ///
    /// # Panics
    /// When `chunk_size` is 0 (an empty view too: cudarc's divides its length by the chunk
    /// size), or `len` is not a multiple of `chunk_size`, as cudarc's does.
    pub fn chunks_exact(&self, chunk_size: usize) -> impl Iterator<Item = CachedView<'a, T>> + '_ {
        let chunks = match self.len.checked_rem(chunk_size) {
            Some(0) => self.len / chunk_size,
            None => panic!("CachedView::chunks_exact: a chunk size of 0"),
            Some(_) => panic!(
                "CachedView::chunks_exact: {} values do not split into chunks of {chunk_size}",
                self.len
            ),
        };
        (0..chunks).filter_map(move |i| self.get(i * chunk_size..(i + 1) * chunk_size))
    }

    /// A view of the first `len` values of `S` from this view's start (cudarc's
    /// `CudaView::transmute`), or `None` when they do not fit.
    ///
    /// # Safety
    /// 1. The bytes read through the view are valid values of `S`.
    pub unsafe fn transmute<S>(&self, len: usize) -> Option<CachedView<'a, S>> {
        if len.checked_mul(std::mem::size_of::<S>())? > self.num_bytes() {
            return None;
        }
        // SAFETY: `len` values of `S` fit (checked above); validity is obligation 1.
        let cu = self
            .cu
            .as_ref()
            .and_then(|v| unsafe { v.transmute::<S>(len) });
        Some(CachedView::new(
            self.ptr,
            len,
            self.base,
            self.stream,
            self.alloc,
            cu,
        ))
    }

    /// This view as cudarc's `CudaView<'a, T>` (the same address, length and events), or `None`
    /// when the buffer has no cudarc events (event tracking off: get the view from
    /// [`CachedSlice::as_cuda_view`](super::CachedSlice::as_cuda_view) then). Its `stream()` is
    /// the shell's stream: the buffer's stream when it has a typed shell, else the context's
    /// default stream.
    pub fn into_cuda_view(self) -> Option<CudaView<'a, T>> {
        self.cu
    }
}

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

impl<T> cu::DevicePtr<T> for CachedView<'_, T> {
    /// The address; `stream` first waits for the buffer's last write and the guard records the
    /// read, as for cudarc's views.
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        match &self.cu {
            Some(v) => cu::DevicePtr::<T>::device_ptr(v, stream),
            None if self.base == 0 => (self.ptr, SyncOnDrop::Record(None)),
            None => (
                self.ptr,
                untracked(self.alloc, self.base, self.stream, stream),
            ),
        }
    }
}

// SAFETY: with cudarc's view, the argument is pushed by cudarc's implementation for
// `&CudaView<T>`, which points at that view's `CUdeviceptr` (equal to this view's address)
// inside `*arg`, borrowed for `'b` (longer than the builder's `'a`), and waits for the buffer's
// last write and records its read on the launch stream. Without one it points at `arg.ptr`, a
// `CUdeviceptr` (`u64`, a `DeviceRepr`) inside `*arg`, equally borrowed. The kernel receives the
// view's device address by value either way.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b CachedView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedView<'c, T>) -> &mut Self {
        match &arg.cu {
            Some(v) => <Self as PushKernelArg<&'b CudaView<'c, T>>>::arg(self, v),
            None => {
                unordered_kernel_use(arg.alloc, arg.base, arg.stream);
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
            }
        }
    }
}

impl<'a, T> CachedViewMut<'a, T> {
    pub(super) fn new(
        ptr: sys::CUdeviceptr,
        len: usize,
        base: sys::CUdeviceptr,
        stream: &'a Arc<CudaStream>,
        alloc: &'a CudaAllocator,
        cu: ViewEvents<'a, T>,
    ) -> Self {
        CachedViewMut {
            ptr,
            len,
            base,
            stream,
            alloc,
            cu,
            marker: PhantomData,
        }
    }

    /// A shared sub-view of `range` (relative to this view), or `None` when out of bounds
    /// (cudarc's `CudaViewMut::try_slice`).
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let cu = match &self.cu {
            ViewEvents::Typed(v) => v.try_slice(start..end),
            ViewEvents::Bytes(v) => v.try_slice(byte_range::<T>(start, end)).and_then(|v| {
                // SAFETY: the bytes are the buffer's values of `T`.
                unsafe { v.transmute::<T>(end - start) }
            }),
            ViewEvents::None => None,
        };
        Some(CachedView::new(
            self.offset(start),
            end - start,
            self.base,
            self.stream,
            self.alloc,
            cu,
        ))
    }

    /// cudarc's `CudaViewMut::try_slice`: the same as [`get`](Self::get).
    pub fn try_slice(&self, bounds: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        self.get(bounds)
    }

    /// cudarc's `CudaViewMut::slice`.
    ///
    /// # Panics
    /// When `bounds` is out of range, as cudarc's does.
    pub fn slice(&self, bounds: impl RangeBounds<usize>) -> CachedView<'_, T> {
        match self.get(bounds) {
            Some(v) => v,
            None => panic!(
                "CachedViewMut::slice: range out of bounds for a view of {}",
                self.len
            ),
        }
    }

    /// A mutable sub-view of `range` (relative to this view), or `None` when out of bounds
    /// (cudarc's `CudaViewMut::try_slice_mut`).
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len)?;
        let ptr = self.offset(start);
        let cu = match &mut self.cu {
            ViewEvents::Typed(v) => v.try_slice_mut(start..end).map(ViewEvents::Typed),
            ViewEvents::Bytes(v) => v
                .try_slice_mut(byte_range::<T>(start, end))
                .map(ViewEvents::Bytes),
            ViewEvents::None => None,
        };
        Some(CachedViewMut::new(
            ptr,
            end - start,
            self.base,
            self.stream,
            self.alloc,
            cu.unwrap_or(ViewEvents::None),
        ))
    }

    /// cudarc's `CudaViewMut::try_slice_mut`: the same as [`get_mut`](Self::get_mut).
    pub fn try_slice_mut(
        &mut self,
        bounds: impl RangeBounds<usize>,
    ) -> Option<CachedViewMut<'_, T>> {
        self.get_mut(bounds)
    }

    /// cudarc's `CudaViewMut::slice_mut`.
    ///
    /// # Panics
    /// When `bounds` is out of range, as cudarc's does.
    pub fn slice_mut(&mut self, bounds: impl RangeBounds<usize>) -> CachedViewMut<'_, T> {
        let len = self.len;
        match self.get_mut(bounds) {
            Some(v) => v,
            None => panic!("CachedViewMut::slice_mut: range out of bounds for a view of {len}"),
        }
    }

    /// This view as a shared view (cudarc's `CudaViewMut::as_view`).
    pub fn as_view(&self) -> CachedView<'_, T> {
        let len = self.len;
        let cu = match &self.cu {
            ViewEvents::Typed(v) => Some(v.as_view()),
            // SAFETY: the bytes are the buffer's values of `T`.
            ViewEvents::Bytes(v) => unsafe { v.transmute::<T>(len) },
            ViewEvents::None => None,
        };
        CachedView::new(self.ptr, len, self.base, self.stream, self.alloc, cu)
    }

    /// This view as a shared view for its whole lifetime (cudarc's `CudaViewMut::into_view`).
    pub fn into_view(self) -> CachedView<'a, T> {
        let len = self.len;
        let cu = match self.cu {
            ViewEvents::Typed(v) => Some(v.into_view()),
            // SAFETY: the bytes are the buffer's values of `T`.
            ViewEvents::Bytes(v) => unsafe { v.into_view().transmute::<T>(len) },
            ViewEvents::None => None,
        };
        CachedView::new(self.ptr, len, self.base, self.stream, self.alloc, cu)
    }

    /// Two disjoint mutable sub-views, `[0, mid)` and `[mid, len)`, or `None` when `mid > len`
    /// (cudarc's `CudaViewMut::try_split_at_mut`).
    pub fn split_at_mut_checked(
        &mut self,
        mid: usize,
    ) -> Option<(CachedViewMut<'_, T>, CachedViewMut<'_, T>)> {
        if mid > self.len {
            return None;
        }
        let second = self.offset(mid);
        let (cu_a, cu_b) = match &mut self.cu {
            ViewEvents::Typed(v) => match v.try_split_at_mut(mid) {
                Some((x, y)) => (ViewEvents::Typed(x), ViewEvents::Typed(y)),
                None => (ViewEvents::None, ViewEvents::None),
            },
            ViewEvents::Bytes(v) => match v.try_split_at_mut(mid * std::mem::size_of::<T>()) {
                Some((x, y)) => (ViewEvents::Bytes(x), ViewEvents::Bytes(y)),
                None => (ViewEvents::None, ViewEvents::None),
            },
            ViewEvents::None => (ViewEvents::None, ViewEvents::None),
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

    /// cudarc's `CudaViewMut::try_split_at_mut`: the same as
    /// [`split_at_mut_checked`](Self::split_at_mut_checked).
    pub fn try_split_at_mut(
        &mut self,
        mid: usize,
    ) -> Option<(CachedViewMut<'_, T>, CachedViewMut<'_, T>)> {
        self.split_at_mut_checked(mid)
    }

    /// cudarc's `CudaViewMut::split_at_mut`.
    ///
    /// # Panics
    /// When `mid > len`, as cudarc's does.
    pub fn split_at_mut(&mut self, mid: usize) -> (CachedViewMut<'_, T>, CachedViewMut<'_, T>) {
        let len = self.len;
        match self.split_at_mut_checked(mid) {
            Some(v) => v,
            None => panic!("CachedViewMut::split_at_mut: {mid} is past the end ({len})"),
        }
    }

    /// A shared view of the first `len` values of `S` from this view's start (cudarc's
    /// `CudaViewMut::transmute`), or `None` when they do not fit.
    ///
    /// # Safety
    /// 1. The bytes read through the view are valid values of `S`.
    pub unsafe fn transmute<S>(&self, len: usize) -> Option<CachedView<'_, S>> {
        if len.checked_mul(std::mem::size_of::<S>())? > self.num_bytes() {
            return None;
        }
        let cu = match &self.cu {
            // SAFETY: `len` values of `S` fit (checked above); validity is obligation 1.
            ViewEvents::Typed(v) => unsafe { v.transmute::<S>(len) },
            // SAFETY: as above; the byte view is at least as long as this view.
            ViewEvents::Bytes(v) => unsafe { v.transmute::<S>(len) },
            ViewEvents::None => None,
        };
        Some(CachedView::new(
            self.ptr,
            len,
            self.base,
            self.stream,
            self.alloc,
            cu,
        ))
    }

    /// A mutable view of the first `len` values of `S` from this view's start (cudarc's
    /// `CudaViewMut::transmute_mut`), or `None` when they do not fit.
    ///
    /// # Safety
    /// 1. The bytes read through the view are valid values of `S`, and the values of `S` written
    ///    through it leave valid values of `T` wherever the memory is read as `T` afterwards.
    pub unsafe fn transmute_mut<S>(&mut self, len: usize) -> Option<CachedViewMut<'_, S>> {
        let bytes = len.checked_mul(std::mem::size_of::<S>())?;
        if bytes > self.num_bytes() {
            return None;
        }
        let cu = match &mut self.cu {
            // SAFETY: `len` values of `S` fit (checked above); validity is obligation 1.
            ViewEvents::Typed(v) => unsafe { v.transmute_mut::<S>(len) }.map(ViewEvents::Typed),
            ViewEvents::Bytes(v) => v.try_slice_mut(..bytes).map(ViewEvents::Bytes),
            ViewEvents::None => None,
        };
        Some(CachedViewMut::new(
            self.ptr,
            len,
            self.base,
            self.stream,
            self.alloc,
            cu.unwrap_or(ViewEvents::None),
        ))
    }

    /// This view as cudarc's `CudaViewMut<'a, T>`, or `None` unless the buffer has a typed shell
    /// (it has one once [`CachedSlice::as_cuda_slice`](super::CachedSlice::as_cuda_slice) was
    /// called; [`CachedSlice::as_cuda_view_mut`](super::CachedSlice::as_cuda_view_mut) makes it).
    pub fn into_cuda_view_mut(self) -> Option<CudaViewMut<'a, T>> {
        match self.cu {
            ViewEvents::Typed(v) => Some(v),
            _ => None,
        }
    }
}

impl<T> cu::DevicePtr<T> for CachedViewMut<'_, T> {
    /// The address; `stream` first waits for the buffer's last write and the guard records the
    /// read, as for cudarc's views.
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        match &self.cu {
            ViewEvents::Typed(v) => cu::DevicePtr::<T>::device_ptr(v, stream),
            ViewEvents::Bytes(v) => {
                let (_, sync) = cu::DevicePtr::<u8>::device_ptr(v, stream);
                (self.ptr, sync)
            }
            ViewEvents::None if self.base == 0 => (self.ptr, SyncOnDrop::Record(None)),
            ViewEvents::None => (
                self.ptr,
                untracked(self.alloc, self.base, self.stream, stream),
            ),
        }
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
            ViewEvents::Typed(v) => cu::DevicePtrMut::<T>::device_ptr_mut(v, stream),
            ViewEvents::Bytes(v) => {
                let (_, sync) = cu::DevicePtrMut::<u8>::device_ptr_mut(v, stream);
                (ptr, sync)
            }
            ViewEvents::None if self.base == 0 => (ptr, SyncOnDrop::Record(None)),
            ViewEvents::None => (ptr, untracked(self.alloc, self.base, self.stream, stream)),
        }
    }
}

// SAFETY: as for `&CachedView` above, through cudarc's implementations for
// `&mut CudaViewMut<T>` and `&mut CudaViewMut<u8>` (waits for the last reads and write, records
// the write); the exclusive borrow only adds that no one else uses the view from the host
// meanwhile.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut CachedViewMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedViewMut<'c, T>) -> &mut Self {
        let CachedViewMut {
            ptr,
            cu,
            base,
            stream,
            alloc,
            ..
        } = arg;
        match cu {
            ViewEvents::Typed(v) => {
                <Self as PushKernelArg<&'b mut CudaViewMut<'c, T>>>::arg(self, v)
            }
            ViewEvents::Bytes(v) => {
                <Self as PushKernelArg<&'b mut CudaViewMut<'c, u8>>>::arg(self, v)
            }
            ViewEvents::None => {
                unordered_kernel_use(alloc, *base, stream);
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &*ptr)
            }
        }
    }
}
