//! `CudaAllocator`: the shared handle to one device's caching allocator, and the typed
//! allocation helpers (`alloc`, `alloc_zeros`, `htod`, `dtoh`) that return [`CachedSlice`]s.
//! May use: the core, `backend::cuda`, `interop::slice`.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use cudarc::driver::{self as cu, CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::{driver_error, registry::AllocatorRegistry, slice::CachedSlice};
use crate::backend::cuda::CudaDevice;
use crate::{AllocError, AllocatorConfig, CachingAllocator, Result, StreamId};

/// A handle to the caching allocator of one CUDA device. Cloning it clones an `Arc`; every clone
/// and every [`CachedSlice`] made from it share one cache.
///
/// It dereferences to the core [`CachingAllocator`], so `memory_stats`, `memory_summary`,
/// `empty_cache`, `set_memory_fraction` and the raw `allocate` / `free` are available on it.
///
/// ```no_run
/// use cuda_caching_allocator::interop::CudaAllocator;
/// use cudarc::driver::CudaContext;
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let alloc = CudaAllocator::shared(0)?;            // the device's allocator, from the registry
/// let buf = alloc.htod(&stream, &[1.0f32, 2.0, 3.0])?; // a CachedSlice<f32>
/// assert_eq!(alloc.dtoh(&buf)?, [1.0, 2.0, 3.0]);
/// drop(buf);                                         // back to the cache, not to the driver
/// println!("{}", alloc.memory_summary(true));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct CudaAllocator {
    inner: Arc<CachingAllocator<CudaDevice>>,
}

impl fmt::Debug for CudaAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocator")
            .field("device", self.inner.backend())
            .finish_non_exhaustive()
    }
}

impl Deref for CudaAllocator {
    type Target = CachingAllocator<CudaDevice>;

    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl CudaAllocator {
    /// A new allocator of its own on the device of `ctx`, with `config`. Most programs want
    /// [`CudaAllocator::shared`] instead, so that one cache serves the whole process.
    ///
    /// # Errors
    /// A backend error when the device cannot be queried; a configuration error from the core.
    pub fn new(ctx: Arc<CudaContext>, config: AllocatorConfig) -> Result<Self> {
        let device = CudaDevice::new(ctx).map_err(|source| AllocError::Backend {
            operation: "CudaDevice::new",
            source,
        })?;
        Self::from_device(device, config)
    }

    /// A new allocator of its own over `device`.
    ///
    /// # Errors
    /// A configuration error from the core.
    pub fn from_device(device: CudaDevice, config: AllocatorConfig) -> Result<Self> {
        Ok(CudaAllocator {
            inner: Arc::new(CachingAllocator::new(device, config)?),
        })
    }

    /// The process-wide allocator of device `ordinal`, created on first use by the
    /// [global registry](AllocatorRegistry::global) (configured from `CUDA_CACHING_ALLOCATOR_CONF`
    /// or PyTorch's `PYTORCH_CUDA_ALLOC_CONF`).
    ///
    /// # Errors
    /// No CUDA driver, no such device, or a bad configuration in the environment.
    pub fn shared(ordinal: usize) -> Result<&'static CudaAllocator> {
        AllocatorRegistry::global().get(ordinal)
    }

    /// The shared core allocator.
    pub fn as_arc(&self) -> &Arc<CachingAllocator<CudaDevice>> {
        &self.inner
    }

    /// The CUDA backend.
    pub fn device(&self) -> &CudaDevice {
        self.inner.backend()
    }

    /// The cudarc context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.inner.backend().context()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.backend().ordinal()
    }

    /// Admits `stream` to the backend (see [`CudaDevice::admit_stream`]) and returns its id.
    ///
    /// # Errors
    /// [`AllocError::InvalidStream`] when the stream belongs to another device.
    pub fn admit(&self, stream: &Arc<CudaStream>) -> Result<StreamId> {
        self.device()
            .admit_stream(stream)
            .map_err(|source| AllocError::InvalidStream {
                stream: crate::backend::cuda::stream_id(stream),
                source,
            })
    }

    /// Allocates room for `len` values of `T` on `stream`, uninitialised.
    ///
    /// # Errors
    /// Out of memory (with the core's report), a stream of another device, or a size overflow.
    ///
    /// # Safety
    /// 1. The contents are whatever the memory held before (another buffer's data). Do not read
    ///    them as `T` before writing them unless every bit pattern is a valid `T`.
    pub unsafe fn alloc<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CachedSlice<T>> {
        let size = std::mem::size_of::<T>();
        let bytes = len.checked_mul(size).ok_or(AllocError::TooLarge {
            requested: (len as u64).saturating_mul(size as u64),
        })?;
        let id = self.admit(stream)?;
        let a = self.inner.allocate(bytes, id)?;
        Ok(CachedSlice::from_parts(
            a.ptr,
            len,
            Arc::clone(stream),
            self.clone(),
        ))
    }

    /// Allocates `len` zeroed values of `T` on `stream` (the memset is queued on `stream`).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the memset.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CachedSlice<T>> {
        // SAFETY: the contents are overwritten with zeros below, a valid `T` (`ValidAsZeroBits`),
        // before anyone can read them.
        let mut buf = unsafe { self.alloc::<T>(stream, len) }?;
        if len > 0 {
            stream
                .memset_zeros(&mut buf)
                .map_err(|e| driver_error("cuMemsetD8Async", e))?;
        }
        Ok(buf)
    }

    /// Copies `src` to a new buffer on `stream`; returns once the copy is done.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or a driver error from the copy.
    pub fn htod<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        src: &[T],
    ) -> Result<CachedSlice<T>> {
        // SAFETY: every element is written by the copy below before anyone can read it.
        let mut buf = unsafe { self.alloc::<T>(stream, src.len()) }?;
        if !src.is_empty() {
            stream
                .memcpy_htod(src, &mut buf)
                .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        }
        Ok(buf)
    }

    /// Copies a device buffer or view (ours or cudarc's) to a new `Vec` on the buffer's stream;
    /// returns once the copy is done.
    ///
    /// # Errors
    /// A driver error from the copy.
    pub fn dtoh<T: DeviceRepr, S: cu::DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        if src.is_empty() {
            return Ok(Vec::new());
        }
        src.stream()
            .clone_dtoh(src)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))
    }
}
