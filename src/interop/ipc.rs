//! Sharing cached memory with other processes, page by page: [`CudaAllocator::export_pages`]
//! gives the descriptors of the physical pages under one allocation, which another process maps
//! with [`CudaDevice::import_pages`](crate::backend::cuda::CudaDevice::import_pages) — PyTorch's
//! CUDA IPC of expandable segments, for the crate's default configuration. May use: `allocator`,
//! `backend::cuda`.

use super::CudaAllocator;
use crate::backend::DeviceAddr;
use crate::error::{AllocError, Result};

/// One allocation's pages, exported: process `pid`'s descriptors `fds` of physical handles of
/// `handle_bytes` bytes each, which an importer maps side by side in this order; the allocation
/// begins `offset` bytes into that mapping.
///
/// The descriptors are the cache's (open until it releases the handles): pass their numbers to
/// the other process, never close them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedPages {
    /// The exporting process (this one).
    pub pid: i32,
    /// Bytes of each handle.
    pub handle_bytes: usize,
    /// Where the allocation begins in the importer's mapping.
    pub offset: usize,
    /// The handles' descriptors in this process, in address order.
    pub fds: Vec<i32>,
}

impl CudaAllocator {
    /// The descriptors of the physical pages under the live allocation at `ptr`, for another
    /// process to map them ([`CudaDevice::import_pages`]), or `None` when it lies in a fixed
    /// segment (`cuMemAlloc` memory: share the segment with `cuIpcGetMemHandle` of
    /// [`base_allocation`](Self::base_allocation)'s base instead).
    ///
    /// The other process sees the allocation's bytes, not a copy, while this process keeps it
    /// allocated: freeing it here hands the bytes to later allocations, so keep it allocated until
    /// the importer is done (PyTorch's reference counting of shared CUDA tensors does this).
    /// Each page is exported once, under the cache's lock (1 GiB of 2 MiB pages took 57.6 ms the
    /// first time on an H200 with driver 580, 0.2 ms again), and its descriptor stays open while
    /// an exported allocation on the page is live: it is closed when the last one is freed (the
    /// importers have taken it by then) or the page is released; an export that fails part-way
    /// closes the descriptors it opened that no exported allocation holds. A process needs as many
    /// descriptors as the pages of the allocations it shares at once (`ulimit -n`).
    ///
    /// # Errors
    /// [`AllocError::NotShareable`]: not a live allocation, pages of mixed sizes, or pages the
    /// driver would not create exportable (it refused the descriptor handle type; the error says
    /// to share from `cca_preset:pytorch`); [`AllocError::Backend`] when the driver cannot
    /// export a page otherwise (no descriptor left, for one).
    ///
    /// [`CudaDevice::import_pages`]: crate::backend::cuda::CudaDevice::import_pages
    pub fn export_pages(&self, ptr: DeviceAddr) -> Result<Option<ExportedPages>> {
        self.inner.with_shareable_pages(ptr, true, |pages, dev| {
            let fds = pages
                .handles
                .iter()
                // SAFETY: the handles lie under a live allocation and the cache's lock is held,
                // so none is released during the call.
                .map(|&h| unsafe { dev.export_handle(h) })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|source| {
                    if dev.exports_pages() {
                        AllocError::Backend {
                            operation: "cuMemExportToShareableHandle",
                            source,
                        }
                    } else {
                        AllocError::NotShareable {
                            ptr,
                            reason: format!(
                                "the driver refused to create this device's pages exportable \
                                 (as POSIX file descriptors), so other processes cannot import \
                                 them ({source}); share from a process whose allocator uses \
                                 cuMemAlloc segments (cca_preset:pytorch)"
                            ),
                        }
                    }
                })?;
            Ok(ExportedPages {
                pid: std::process::id() as i32,
                handle_bytes: pages.handle_bytes,
                offset: pages.offset,
                fds,
            })
        })
    }
}
