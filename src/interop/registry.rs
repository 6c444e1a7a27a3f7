//! `AllocatorRegistry`: one caching allocator per CUDA device, created on first use.
//!
//! Lookups after creation take no lock (a `OnceLock` per device), which keeps the C entry points
//! of `interop::raw` cheap. May use: `interop::allocator`, `backend::cuda`, `config`, `stats`.

use std::fmt;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::allocator::CudaAllocator;
use crate::backend::cuda::{self, CudaDevice};
use crate::config::ConfigError;
use crate::{AllocError, AllocatorConfig, BackendError, MemoryStats, Result, SegmentObserver};

/// One [`CudaAllocator`] per device ordinal, created lazily with one configuration.
///
/// The [global](AllocatorRegistry::global) registry backs [`CudaAllocator::shared`] and the
/// [`raw`](super::raw) API; build your own with [`AllocatorRegistry::new`] to choose the
/// configuration in code.
pub struct AllocatorRegistry {
    config: std::result::Result<AllocatorConfig, ConfigError>,
    /// One slot per device, sized on first use from the device count.
    slots: OnceLock<Box<[OnceLock<CudaAllocator>]>>,
    /// Serializes creation (of the slot table and of each allocator) and guards the segment
    /// observer given to every allocator, now and when created.
    creating: Mutex<Option<SegmentObserver>>,
}

impl fmt::Debug for AllocatorRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let created: Vec<usize> = self.created().into_iter().map(|(i, _)| i).collect();
        f.debug_struct("AllocatorRegistry")
            .field("config", &self.config)
            .field("created", &created)
            .finish()
    }
}

/// The process-wide registry ([`AllocatorRegistry::global`]).
static GLOBAL: OnceLock<AllocatorRegistry> = OnceLock::new();

impl AllocatorRegistry {
    /// A registry whose allocators all use `config`.
    pub fn new(config: AllocatorConfig) -> Self {
        AllocatorRegistry {
            config: Ok(config),
            slots: OnceLock::new(),
            creating: Mutex::new(None),
        }
    }

    /// The process-wide registry. Its configuration is read once from the environment
    /// (`CUDA_CACHING_ALLOCATOR_CONF`, else `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`), read
    /// as [`AllocatorConfig::parse`] reads it; the crate's default when none is set. A bad setting
    /// is reported by every [`get`](Self::get).
    pub fn global() -> &'static AllocatorRegistry {
        GLOBAL.get_or_init(|| AllocatorRegistry {
            config: AllocatorConfig::from_env_or(AllocatorConfig::default()),
            slots: OnceLock::new(),
            creating: Mutex::new(None),
        })
    }

    /// The process-wide registry if something has reached it already (its configuration is then
    /// fixed), without reading the environment: a check of a configuration about to be used can
    /// compare it with the one in force.
    pub fn global_if_read() -> Option<&'static AllocatorRegistry> {
        GLOBAL.get()
    }

    fn slots(&self) -> Result<&[OnceLock<CudaAllocator>]> {
        if let Some(slots) = self.slots.get() {
            return Ok(slots);
        }
        let _guard = self.creating.lock();
        if let Some(slots) = self.slots.get() {
            return Ok(slots);
        }
        let count = cuda::device_count().map_err(|source| AllocError::Backend {
            operation: "cuDeviceGetCount",
            source,
        })?;
        Ok(self
            .slots
            .get_or_init(|| (0..count).map(|_| OnceLock::new()).collect()))
    }

    /// The allocator of device `ordinal`, created (with its device's primary context) on first
    /// use.
    ///
    /// # Errors
    /// No CUDA driver, no such device, a driver error while opening it, or a bad configuration.
    pub fn get(&self, ordinal: usize) -> Result<&CudaAllocator> {
        let slots = self.slots()?;
        let Some(slot) = slots.get(ordinal) else {
            return Err(AllocError::Backend {
                operation: "AllocatorRegistry::get",
                source: BackendError::InvalidArgument {
                    operation: "AllocatorRegistry::get",
                    reason: format!(
                        "device {ordinal} does not exist ({} CUDA devices)",
                        slots.len()
                    ),
                },
            });
        };
        if let Some(alloc) = slot.get() {
            return Ok(alloc);
        }
        let guard = self.creating.lock();
        if let Some(alloc) = slot.get() {
            return Ok(alloc);
        }
        let config = self.config.clone()?;
        let device = CudaDevice::open(ordinal).map_err(|source| AllocError::Backend {
            operation: "CudaDevice::open",
            source,
        })?;
        let alloc = CudaAllocator::from_device(device, config)?;
        if let Some(observer) = &*guard {
            alloc.set_segment_observer(Some(Arc::clone(observer)));
        }
        tracing::debug!(target: "cuda_caching_allocator", ordinal, "created the device's caching allocator");
        Ok(slot.get_or_init(|| alloc))
    }

    /// The configuration every allocator of this registry uses (read once from the environment
    /// for the [global](Self::global) registry).
    ///
    /// # Errors
    /// The configuration error, when the setting it was read from is bad.
    pub fn config(&self) -> std::result::Result<AllocatorConfig, ConfigError> {
        self.config.clone()
    }

    /// Sets (or, with `None`, removes) the segment observer of every allocator of this registry,
    /// those created already and those created later
    /// ([`CachingAllocator::set_segment_observer`](crate::CachingAllocator::set_segment_observer);
    /// the observer reads [`SegmentEvent::device`](crate::SegmentEvent::device) to tell them
    /// apart).
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        let mut guard = self.creating.lock();
        for (_, alloc) in self.created() {
            alloc.set_segment_observer(observer.clone());
        }
        *guard = observer;
    }

    /// The allocator of device `ordinal` if it was created already (never creates one).
    pub fn get_if_created(&self, ordinal: usize) -> Option<&CudaAllocator> {
        self.slots.get()?.get(ordinal)?.get()
    }

    /// The allocators created so far, by ordinal.
    pub fn created(&self) -> Vec<(usize, &CudaAllocator)> {
        let Some(slots) = self.slots.get() else {
            return Vec::new();
        };
        slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.get()?)))
            .collect()
    }

    /// The statistics of every created allocator, by ordinal.
    pub fn memory_stats(&self) -> Vec<(usize, MemoryStats)> {
        self.created()
            .into_iter()
            .map(|(i, a)| (i, a.memory_stats()))
            .collect()
    }

    /// Empties the cache of every created allocator.
    ///
    /// # Errors
    /// The first error; the remaining devices are still emptied.
    pub fn empty_cache_all(&self) -> Result<()> {
        let mut first = Ok(());
        for (_, alloc) in self.created() {
            if let Err(e) = alloc.empty_cache() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}
