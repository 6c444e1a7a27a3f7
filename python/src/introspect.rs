//! What PyTorch reads back: the statistics in `DeviceStats`' layout (`torch.cuda.memory_stats()`
//! and every `memory_*` function), one statistic by key, the memory fraction, the segments and
//! blocks of a snapshot (`torch.cuda.memory._snapshot()`), the largest cached block
//! (`cacheInfo`, cuDNN's benchmark workspace) and the base of an allocation's segment.

use std::ffi::{CStr, c_char, c_int, c_void};

use cuda_caching_allocator::interop::AllocatorRegistry;
use cuda_caching_allocator::{BlockState, DeviceAddr, PoolKind, Stat, StatArray, StatType};

use crate::error::{KIND_OTHER, fail, guarded};
use crate::hooks::ordinal;
use crate::pools::MempoolId;

/// The version of this C ABI; the C++ shim refuses a library of another version.
pub(crate) const ABI_VERSION: c_int = 7;

/// The C ABI's version (7: `cca_next_routing`; 6: `cca_last_oom_sizes`; 5: `cca_export_pages`, `cca_import_pages`, `cca_close_imported`,
/// `cca_restore_pool`, `cca_set_use_on_oom`, `cca_set_no_split`, `cca_record_stream_checked`,
/// `cca_free_checked` and the segment callback's action 4; 4:
/// `cca_settings_not_applied`; 3: segment events, `CcaSegment::pool`): bumped whenever a signature or
/// struct changes.
#[unsafe(no_mangle)]
pub extern "C" fn cca_abi_version() -> c_int {
    ABI_VERSION
}

/// One statistic: PyTorch's `Stat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CcaStat {
    /// The current value.
    pub current: i64,
    /// The highest value since the last peak reset.
    pub peak: i64,
    /// The sum of increases since the last accumulated reset.
    pub allocated: i64,
    /// The sum of decreases since the last accumulated reset.
    pub freed: i64,
}

impl From<&Stat> for CcaStat {
    fn from(s: &Stat) -> Self {
        CcaStat {
            current: s.current,
            peak: s.peak,
            allocated: s.allocated,
            freed: s.freed,
        }
    }
}

fn array(a: &StatArray) -> [CcaStat; 3] {
    StatType::ALL.map(|t| CcaStat::from(a.get(t)))
}

/// PyTorch's `DeviceStats`, field for field (each array is `all`, `small_pool`, `large_pool`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CcaDeviceStats {
    /// Live allocations.
    pub allocation: [CcaStat; 3],
    /// Device segments.
    pub segment: [CcaStat; 3],
    /// Allocated or pending blocks.
    pub active: [CcaStat; 3],
    /// Free blocks that are parts of a split segment.
    pub inactive_split: [CcaStat; 3],
    /// Bytes handed out (rounded sizes).
    pub allocated_bytes: [CcaStat; 3],
    /// Bytes reserved from the device.
    pub reserved_bytes: [CcaStat; 3],
    /// Bytes of active blocks.
    pub active_bytes: [CcaStat; 3],
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: [CcaStat; 3],
    /// Bytes requested by callers (unrounded).
    pub requested_bytes: [CcaStat; 3],
    /// Allocations at or above the maximum split size.
    pub oversize_allocations: CcaStat,
    /// Segments at or above the maximum split size.
    pub oversize_segments: CcaStat,
    /// Allocations that had to release cached memory and retry.
    pub num_alloc_retries: i64,
    /// Out-of-memory failures.
    pub num_ooms: i64,
    /// Synchronizations of every stream.
    pub num_sync_all_streams: i64,
    /// Device allocations (`cuMemAlloc` and mappings).
    pub num_device_alloc: i64,
    /// Device frees.
    pub num_device_free: i64,
    /// The maximum split size (`max_split_size_mb`), bytes.
    pub max_split_size: i64,
}

/// The statistics of a device whose cache was never used: all zeros but `max_split_size`, which
/// is the configured one (-1 for no limit) that the cache will report once made, as PyTorch's
/// statistics of an unused device carry it (PyTorch makes every device's cache at `init`). A bad
/// configuration, which no cache can be made with, reads as PyTorch's default (-1).
fn unused_device_stats() -> CcaDeviceStats {
    let max_split_size = match AllocatorRegistry::global().config() {
        Ok(c) if c.max_split_size != usize::MAX => i64::try_from(c.max_split_size).unwrap_or(-1),
        _ => -1,
    };
    CcaDeviceStats {
        max_split_size,
        ..CcaDeviceStats::default()
    }
}

/// Writes `device`'s statistics into `*out`: 0 when written, 1 when the device's cache was never
/// used (`*out` is then all zeros but `max_split_size`, the configured one), -1 for a null `out`
/// or a negative device.
///
/// # Safety
/// `out` is null or points to writable memory for one [`CcaDeviceStats`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_device_stats(device: c_int, out: *mut CcaDeviceStats) -> c_int {
    guarded("cca_device_stats", -1, || {
        let Some(d) = ordinal(device) else {
            return -1;
        };
        if out.is_null() {
            return -1;
        }
        let (stats, status) = match AllocatorRegistry::global().get_if_created(d) {
            Some(a) => {
                let s = a.memory_stats();
                let c = CcaDeviceStats {
                    allocation: array(&s.allocation),
                    segment: array(&s.segment),
                    active: array(&s.active),
                    inactive_split: array(&s.inactive_split),
                    allocated_bytes: array(&s.allocated_bytes),
                    reserved_bytes: array(&s.reserved_bytes),
                    active_bytes: array(&s.active_bytes),
                    inactive_split_bytes: array(&s.inactive_split_bytes),
                    requested_bytes: array(&s.requested_bytes),
                    oversize_allocations: CcaStat::from(&s.oversize_allocations),
                    oversize_segments: CcaStat::from(&s.oversize_segments),
                    num_alloc_retries: s.num_alloc_retries,
                    num_ooms: s.num_ooms,
                    num_sync_all_streams: s.num_sync_all_streams,
                    num_device_alloc: s.num_device_alloc,
                    num_device_free: s.num_device_free,
                    max_split_size: s.max_split_size,
                };
                (c, 0)
            }
            None => (unused_device_stats(), 1),
        };
        // SAFETY: `out` is non-null and, by the caller's promise, writable for one struct.
        unsafe { out.write(stats) };
        status
    })
}

/// One statistic of `device`'s cache by its `torch.cuda.memory_stats()` key (for example
/// `"reserved_bytes.all.peak"`), or one of the crate's own device-call figures:
/// `"device_calls.KIND"` (calls made) and `"device_ns.KIND"` (host nanoseconds spent inside
/// them), `KIND` one of `cuda_caching_allocator::CALL_KINDS` or `all`; -1 when the key is
/// unknown or the device's cache is unused.
///
/// # Safety
/// `key` is null or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_memory_stat(device: c_int, key: *const c_char) -> i64 {
    guarded("cca_memory_stat", -1, || {
        if key.is_null() {
            return -1;
        }
        // SAFETY: the caller passes a valid NUL-terminated string.
        let Ok(key) = unsafe { CStr::from_ptr(key) }.to_str() else {
            return -1;
        };
        let device = ordinal(device);
        if let Some((what, kind)) = key.split_once('.') {
            let pick: Option<fn((u64, u64)) -> u64> = match what {
                "device_calls" => Some(|(calls, _)| calls),
                "device_ns" => Some(|(_, ns)| ns),
                _ => None,
            };
            if let Some(pick) = pick {
                return device
                    .and_then(cuda_caching_allocator::interop::raw::device_call_times)
                    .and_then(|t| t.get(kind))
                    .map_or(-1, |v| i64::try_from(pick(v)).unwrap_or(i64::MAX));
            }
        }
        device
            .and_then(cuda_caching_allocator::interop::raw::memory_stats)
            .and_then(|s| s.get(key))
            .unwrap_or(-1)
    })
}

/// Resets the accumulated statistics (`allocated` / `freed` counters, retries, OOMs, device
/// calls) of `device`'s cache (nothing when it was never used).
#[unsafe(no_mangle)]
pub extern "C" fn cca_reset_accumulated_stats(device: c_int) {
    guarded("cca_reset_accumulated_stats", (), || {
        if let Some(a) = ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d))
        {
            a.reset_accumulated_stats();
        }
    })
}

/// The memory fraction of `device`'s cache (1.0 when uncapped); for a cache never used, the
/// configured one (`per_process_memory_fraction`) that it will apply once made, 1.0 with a bad
/// configuration.
#[unsafe(no_mangle)]
pub extern "C" fn cca_memory_fraction(device: c_int) -> f64 {
    guarded("cca_memory_fraction", 1.0, || {
        match ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d)) {
            Some(a) => a.memory_fraction(),
            None => AllocatorRegistry::global()
                .config()
                .map_or(1.0, |c| c.per_process_memory_fraction),
        }
    })
}

/// One segment of a snapshot, for [`cca_snapshot`]'s callback.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CcaSegment {
    /// Base address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// The stream it serves (`cudaStream_t` value).
    pub stream: u64,
    /// 1 for the large pool, 0 for the small pool.
    pub is_large: c_int,
    /// 1 for one mapped range of an expandable segment.
    pub is_expandable: c_int,
    /// How many blocks follow for this segment.
    pub num_blocks: u64,
    /// The private pool it belongs to (`(0, 0)`: the default pools), also when it is empty.
    pub pool: MempoolId,
}

/// One block of a snapshot, for [`cca_snapshot`]'s callback.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CcaBlock {
    /// Start address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// The requested size while allocated (0 otherwise).
    pub requested_size: u64,
    /// 0 allocated (`active_allocated`), 1 freed but waiting for stream events
    /// (`active_pending_free`), 2 free and cached (`inactive`).
    pub state: c_int,
}

// The layouts the C++ shim (`csrc/cca_shim.cpp`) asserts too.
const _: () = assert!(std::mem::size_of::<CcaDeviceStats>() == 976);
const _: () = assert!(std::mem::size_of::<CcaSegment>() == 56);
const _: () = assert!(std::mem::offset_of!(CcaSegment, pool) == 40);
const _: () = assert!(std::mem::size_of::<CcaBlock>() == 32);
const _: () = assert!(std::mem::size_of::<crate::MempoolId>() == 16);

fn state_code(s: BlockState) -> c_int {
    match s {
        BlockState::ActiveAllocated => 0,
        BlockState::ActivePendingFree => 1,
        BlockState::Inactive | BlockState::Unmapped => 2,
    }
}

/// Walks a snapshot of `device`'s cache: `segment(ctx, &seg)` for each segment in address
/// order, then `block(ctx, &blk)` for each of its blocks in address order. 0 when walked, 1 when
/// the device's cache was never used (no callback), -1 for a negative device or a null callback
/// (the error is recorded).
///
/// # Safety
/// The callbacks may be called with `ctx` and pointers valid only during the call; they must not
/// call into this library.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_snapshot(
    device: c_int,
    segment: Option<extern "C" fn(*mut c_void, *const CcaSegment)>,
    block: Option<extern "C" fn(*mut c_void, *const CcaBlock)>,
    ctx: *mut c_void,
) -> c_int {
    guarded("cca_snapshot", -1, || {
        let (Some(segment), Some(block)) = (segment, block) else {
            fail(KIND_OTHER, "cca_snapshot: null callback".into());
            return -1;
        };
        let Some(d) = ordinal(device) else {
            return -1;
        };
        let Some(a) = AllocatorRegistry::global().get_if_created(d) else {
            return 1;
        };
        for s in a.snapshot() {
            let seg = CcaSegment {
                address: s.address.addr(),
                total_size: s.total_size as u64,
                stream: s.stream.0,
                is_large: c_int::from(s.pool == PoolKind::Large),
                is_expandable: c_int::from(s.is_expandable),
                num_blocks: s.blocks.len() as u64,
                pool: MempoolId {
                    first: s.private_pool.0,
                    second: s.private_pool.1,
                },
            };
            segment(ctx, &seg);
            for b in &s.blocks {
                let blk = CcaBlock {
                    address: b.address.addr(),
                    size: b.size as u64,
                    requested_size: b.requested_size as u64,
                    state: state_code(b.state),
                };
                block(ctx, &blk);
            }
        }
        0
    })
}

/// PyTorch's `cacheInfo`: the size of the largest free cached block of `device` (0 when none or
/// the cache was never used). cuDNN's benchmark mode sizes its workspace with it.
#[unsafe(no_mangle)]
pub extern "C" fn cca_cache_info(device: c_int) -> u64 {
    guarded("cca_cache_info", 0, || {
        ordinal(device)
            .and_then(|d| AllocatorRegistry::global().get_if_created(d))
            .map_or(0, |a| {
                a.snapshot()
                    .iter()
                    .flat_map(|s| s.blocks.iter())
                    .filter(|b| b.state == BlockState::Inactive)
                    .map(|b| b.size as u64)
                    .max()
                    .unwrap_or(0)
            })
    })
}

/// PyTorch's `getBaseAllocation`: the base address of the segment (of `device`'s cache) that
/// holds the live allocation at `ptr` (an expandable segment's mapped run around it), with its
/// size in `*size` when `size` is not null; 0 when no live allocation starts at `ptr`.
///
/// # Safety
/// `size` is null or writable for one `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_base_allocation(device: c_int, ptr: u64, size: *mut u64) -> u64 {
    guarded("cca_base_allocation", 0, || {
        let Some((base, total)) = ordinal(device)
            .and_then(|d| AllocatorRegistry::global().get_if_created(d))
            .and_then(|a| a.base_allocation(DeviceAddr(ptr)))
        else {
            return 0;
        };
        if !size.is_null() {
            // SAFETY: non-null, and writable by the caller's promise.
            unsafe { size.write(total as u64) };
        }
        base.addr()
    })
}
