//! Segment events for PyTorch's trace trackers (`attachAllocatorTraceTracker`): the C++ shim
//! sets one C callback that every device's cache calls when it allocates, frees, maps or unmaps
//! device memory, and turns each call into PyTorch's `SEGMENT_ALLOC` / `SEGMENT_FREE` /
//! `SEGMENT_MAP` / `SEGMENT_UNMAP` trace entry. NCCL's user-buffer registration
//! (`TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK`, `ProcessGroupNCCL.register_mem_pool`)
//! registers and deregisters segments from those entries.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cuda_caching_allocator::interop::AllocatorRegistry;
use cuda_caching_allocator::{SegmentAction, SegmentEvent};

use crate::error::{KIND_OTHER, fail, guarded};
use crate::pools::MempoolId;

/// `void cb(void* ctx, int action, int device, uint64_t addr, uint64_t size, void* stream,
/// MempoolId pool)`; `action` is 0 alloc, 1 free, 2 map, 3 unmap (of segments or pages), 4 a
/// block whose free waited for recorded streams is back in the cache (`addr` the allocation's
/// address, `size` its requested size; see `cca_free_checked`).
pub type SegmentCallback =
    extern "C" fn(*mut c_void, c_int, c_int, u64, u64, *mut c_void, MempoolId);

/// The callback and its context, as the observer closure holds them.
struct CCallback {
    cb: SegmentCallback,
    ctx: *mut c_void,
}

// SAFETY: `cca_set_segment_callback`'s caller promises that `cb` may be called with `ctx` from
// any thread, concurrently.
unsafe impl Send for CCallback {}
// SAFETY: as above.
unsafe impl Sync for CCallback {}

impl CCallback {
    fn call(&self, e: &SegmentEvent) {
        let action = match e.action {
            SegmentAction::Alloc => 0,
            SegmentAction::Free => 1,
            SegmentAction::Map => 2,
            SegmentAction::Unmap => 3,
            SegmentAction::FreeCompleted => 4,
            // An action this C ABI version has no number for is not passed on.
            _ => return,
        };
        (self.cb)(
            self.ctx,
            action,
            c_int::try_from(e.device).unwrap_or(c_int::MAX),
            e.addr.0,
            e.size as u64,
            std::ptr::with_exposed_provenance_mut(e.stream.0 as usize),
            MempoolId {
                first: e.pool.0,
                second: e.pool.1,
            },
        );
    }
}

/// Sets (or, with a null `cb`, removes) the callback every device's cache calls for each segment
/// event, on the devices' caches created so far and those created later. The callback runs while
/// the cache's lock is held (a `free` event before the memory goes back to the driver); it must
/// not call into this library. Returns 0.
///
/// # Safety
/// `cb` may be called with `ctx` from any thread, concurrently, until the callback is replaced or
/// removed; `ctx` must stay valid that long.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_set_segment_callback(
    cb: Option<SegmentCallback>,
    ctx: *mut c_void,
) -> c_int {
    guarded("cca_set_segment_callback", -1, || {
        let observer = cb.map(|cb| {
            let c = CCallback { cb, ctx };
            let observer: cuda_caching_allocator::SegmentObserver =
                Arc::new(move |e: &SegmentEvent| c.call(e));
            observer
        });
        AllocatorRegistry::global().set_segment_observer(observer);
        0
    })
}

/// Whether the configuration the devices' caches use (the global registry's, read once from the
/// environment) maps pages into expandable segments: 1 yes, 0 no, -1 a bad configuration
/// ([`cca_last_error`](crate::cca_last_error) says why). The shim tells PyTorch, which turns its
/// NCCL registration hook off under expandable segments as it does for its own. A device without
/// virtual memory management runs fixed segments all the same; the answer stays 1 there (the
/// hook then stays off where it could have run: registration is lost, nothing goes stale).
#[unsafe(no_mangle)]
pub extern "C" fn cca_config_expandable() -> c_int {
    guarded(
        "cca_config_expandable",
        -1,
        || match AllocatorRegistry::global().config() {
            Ok(c) => c_int::from(c.expandable_segments),
            Err(e) => {
                fail(KIND_OTHER, format!("bad configuration: {e}"));
                -1
            }
        },
    )
}
