//! The physical pages under a live allocation, for sharing it with another process: what
//! PyTorch's `ExpandableSegment::share` writes into a CUDA IPC handle of an expandable segment.
//! May use: `state`.
#![forbid(unsafe_code)]

use super::CachingAllocator;
use crate::backend::{DeviceAddr, DeviceBackend, PhysicalHandle};
use crate::error::{AllocError, Result};

/// The physical handles that hold one live allocation of an expandable segment, in address
/// order: mapped side by side from `start`, each of `handle_bytes` bytes, they cover the
/// allocation, which begins `offset` bytes after `start`.
///
/// Another process that imports the handles (`cuMemImportFromShareableHandle` of descriptors
/// exported from them) and maps them in this order at consecutive addresses sees the allocation
/// at its mapping's base plus `offset`. The handles stay the cache's: they hold the allocation
/// only while it is allocated here, and the bytes around it belong to other allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPages {
    /// Address of the first handle's first byte.
    pub start: DeviceAddr,
    /// Where the allocation begins, counted from `start`.
    pub offset: usize,
    /// Bytes of each handle.
    pub handle_bytes: usize,
    /// The handles, in address order.
    pub handles: Vec<PhysicalHandle>,
}

impl<B: DeviceBackend> CachingAllocator<B> {
    /// The physical handles under the live allocation at `ptr`, for sharing it with another
    /// process, or `None` when it lies in a fixed segment (one `allocate` of the backend, which
    /// the driver shares whole: `cuIpcGetMemHandle` of the segment's base, see
    /// [`base_allocation`](Self::base_allocation)).
    ///
    /// The handles are valid while the allocation stays allocated; a handle the cache releases
    /// later (after the allocation was freed) stays alive in a process that imported it until
    /// that process releases it too.
    ///
    /// # Errors
    /// [`AllocError::NotShareable`] when `ptr` is not a live allocation of this allocator, or
    /// when the handles under it differ in size (possible only with
    /// `cca_max_handle_size_mb`), which an importer cannot map side by side.
    pub fn shareable_pages(&self, ptr: DeviceAddr) -> Result<Option<SharedPages>> {
        self.with_shareable_pages(ptr, false, |pages, _| Ok(pages.clone()))
    }

    /// Exports the pages under the live allocation at `ptr`: runs `export` on
    /// [`shareable_pages`](Self::shareable_pages)'s answer and this allocator's backend under the
    /// cache's lock (no handle it names can be released meanwhile), and once `export` succeeds
    /// counts the allocation as exported: when it is freed, the backend's
    /// [`release_export`](DeviceBackend::release_export) is called for each of its handles that
    /// no other exported allocation lies on. When `export` fails, `release_export` is called at
    /// once for each handle no live exported allocation lies on (an export that failed part-way
    /// may have exported some). `None` (and `export` not run) for a fixed segment.
    /// `CudaAllocator::export_pages` (feature `cuda`) is this with `CudaDevice::export_handle`.
    ///
    /// # Errors
    /// As [`shareable_pages`](Self::shareable_pages), and `export`'s own.
    pub fn export_pages_with<R>(
        &self,
        ptr: DeviceAddr,
        export: impl FnOnce(&SharedPages, &B) -> Result<R>,
    ) -> Result<Option<R>> {
        self.with_shareable_pages(ptr, true, export)
    }

    /// Runs `f` on [`shareable_pages`](Self::shareable_pages)'s answer (with the backend) under
    /// the cache's lock, so that no handle it names can be released meanwhile. With `export`,
    /// a success of `f` counts the allocation as exported: when it is freed, the backend is told
    /// to let go of the exports of the handles no other exported allocation lies on
    /// ([`DeviceBackend::release_export`]).
    pub(crate) fn with_shareable_pages<R>(
        &self,
        ptr: DeviceAddr,
        export: bool,
        f: impl FnOnce(&SharedPages, &B) -> Result<R>,
    ) -> Result<Option<R>> {
        let mut st = self.lock();
        if self.freed_into_a_thread_cache(&st, ptr) {
            return Err(AllocError::NotShareable {
                ptr,
                reason: format!("{ptr} is not a live allocation of this allocator (it was freed)"),
            });
        }
        match st.handles_under(ptr.0) {
            Ok(None) => Ok(None),
            Ok(Some((start, handle_bytes, handles))) => {
                let pages = SharedPages {
                    start: DeviceAddr(start),
                    offset: (ptr.0 - start) as usize,
                    handle_bytes,
                    handles,
                };
                let r = match f(&pages, &self.backend) {
                    Ok(r) => r,
                    Err(e) => {
                        if export {
                            // An export that failed part-way may have exported some of the
                            // handles (CUDA: descriptors opened before the process ran out of
                            // them), which no allocation counts: let them go now, except those a
                            // live exported allocation holds. Kept, they would stay open until
                            // the page is released, which page reuse may put off for good.
                            for &h in &pages.handles {
                                if !st.st.exported_handles.contains_key(&h.0) {
                                    self.backend.release_export(h);
                                }
                            }
                        }
                        return Err(e);
                    }
                };
                if export {
                    st.st.mark_exported(ptr.0, &pages.handles);
                    // The free must reach the core, which lets the export go: a front cache
                    // would keep the block, still exported, for its next user.
                    if let Some(front) = &self.front {
                        front.free_through_core(&mut st.front, ptr)?;
                    }
                }
                Ok(Some(r))
            }
            Err(reason) => Err(AllocError::NotShareable { ptr, reason }),
        }
    }
}
