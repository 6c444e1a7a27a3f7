//! The device-time model of the simulated device: what each call costs, and the counters a
//! run accumulates. May use: `backend`.
//!
//! Note [Device-time model]: the host time a driver call takes is nearly independent of the
//! bytes involved: `cuMemCreate` of 2, 20 or 64 MiB costs 10–14 µs, and `cuMemSetAccess` costs
//! about 30 µs per physical handle even when set over a range covering many handles. So the model
//! charges a fixed cost per successful call ([`SimCosts`], H100 figures by default), and `map`
//! (which maps a handle and sets its access, as `CudaDevice` does) is charged as one `cuMemMap`
//! plus one `cuMemSetAccess`. Failed calls are counted as before and charged nothing. A
//! synchronization is charged a fixed 50 µs; what it really costs depends on the work queued
//! ahead of it (and it stalls the host's launch-ahead), which the model leaves out, so a figure
//! with synchronizations in it is a lower bound.

use crate::backend::call_times::CALL_KINDS;

/// The device-time model: host nanoseconds each kind of device call costs, charged once per
/// successful call (see Note [Device-time model] in the module source).
///
/// The defaults are medians measured on an H100 (driver 580) by the lead; the CUDA driver calls
/// each field stands for are named on the field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimCosts {
    /// `allocate` (`cuMemAlloc`): 34 µs.
    pub allocate_ns: u64,
    /// `free` (`cuMemFree`): 29 µs.
    pub free_ns: u64,
    /// `reserve_address_range` (`cuMemAddressReserve`): 28 µs.
    pub reserve_ns: u64,
    /// `release_address_range` (`cuMemAddressFree`): 28 µs (not measured; taken equal to a
    /// reservation).
    pub release_range_ns: u64,
    /// `create_physical` (`cuMemCreate`), per handle whatever its size: 14 µs (measured 14 µs
    /// for 2 MiB, 10.5 µs for 20 MiB, 12.6 µs for 64 MiB: the cost is per handle, not per byte).
    pub create_ns: u64,
    /// `release_physical` (`cuMemRelease`), per handle: 15 µs.
    pub release_ns: u64,
    /// The `cuMemMap` half of `map`, per handle: 3 µs.
    pub map_ns: u64,
    /// The `cuMemSetAccess` half of `map`, per handle: 30 µs (it costs per handle also when set
    /// over a range of several handles, so the model charges it once per mapped handle).
    pub set_access_ns: u64,
    /// `unmap` (`cuMemUnmap`), per handle: 21 µs.
    pub unmap_ns: u64,
    /// `synchronize` (`cuCtxSynchronize`) on an idle device: 50 µs. A real synchronization also
    /// waits for queued work and stalls the host's launch-ahead, which the model does not price.
    pub synchronize_ns: u64,
    /// `synchronize_stream` (`cuStreamSynchronize`): 50 µs, with the same caveat.
    pub stream_synchronize_ns: u64,
    /// `create_event` (`cuEventCreate`): 2 µs (events are pooled, so this is rare).
    pub event_create_ns: u64,
    /// `record_event` (`cuEventRecord`): 2 µs.
    pub event_record_ns: u64,
    /// `query_event` (`cuEventQuery`): 1 µs.
    pub event_query_ns: u64,
    /// `stream_wait_event` (`cuStreamWaitEvent`): 2 µs (the host returns at once; the wait
    /// happens on the device).
    pub stream_wait_event_ns: u64,
}

impl Default for SimCosts {
    /// The H100 figures on each field.
    fn default() -> Self {
        const US: u64 = 1000;
        SimCosts {
            allocate_ns: 34 * US,
            free_ns: 29 * US,
            reserve_ns: 28 * US,
            release_range_ns: 28 * US,
            create_ns: 14 * US,
            release_ns: 15 * US,
            map_ns: 3 * US,
            set_access_ns: 30 * US,
            unmap_ns: 21 * US,
            synchronize_ns: 50 * US,
            stream_synchronize_ns: 50 * US,
            event_create_ns: 2 * US,
            event_record_ns: 2 * US,
            event_query_ns: US,
            stream_wait_event_ns: 2 * US,
        }
    }
}

impl SimCosts {
    /// A model in which every call is free (counts only).
    pub fn zero() -> Self {
        SimCosts {
            allocate_ns: 0,
            free_ns: 0,
            reserve_ns: 0,
            release_range_ns: 0,
            create_ns: 0,
            release_ns: 0,
            map_ns: 0,
            set_access_ns: 0,
            unmap_ns: 0,
            synchronize_ns: 0,
            stream_synchronize_ns: 0,
            event_create_ns: 0,
            event_record_ns: 0,
            event_query_ns: 0,
            stream_wait_event_ns: 0,
        }
    }
}

/// Call counters and memory figures of a [`SimDevice`](super::SimDevice).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful `allocate` calls.
    pub allocate_calls: u64,
    /// `allocate` calls that failed (out of memory or injected).
    pub failed_allocate_calls: u64,
    /// Successful `free` calls.
    pub free_calls: u64,
    /// `synchronize` and `synchronize_stream` calls together (see `stream_synchronize_calls`).
    pub synchronize_calls: u64,
    /// `synchronize_stream` calls (also counted in `synchronize_calls`).
    pub stream_synchronize_calls: u64,
    /// `reserve_address_range` calls that succeeded.
    pub reserve_calls: u64,
    /// `release_address_range` calls that succeeded.
    pub release_range_calls: u64,
    /// `create_physical` calls that succeeded.
    pub create_physical_calls: u64,
    /// `release_physical` calls that succeeded.
    pub release_physical_calls: u64,
    /// `map` calls that succeeded.
    pub map_calls: u64,
    /// Access settings (`cuMemSetAccess`): one per successful `map`, which sets the access of
    /// the handle it maps.
    pub set_access_calls: u64,
    /// `unmap` calls that succeeded.
    pub unmap_calls: u64,
    /// Events created.
    pub events_created: u64,
    /// Event records.
    pub event_records: u64,
    /// Event queries.
    pub event_queries: u64,
    /// `stream_wait_event` calls that succeeded.
    pub stream_waits: u64,
    /// Device calls made so far (the index that fault injection counts).
    pub device_calls: u64,
    /// Bytes of device memory in use now (segments plus physical pages).
    pub reserved_bytes: usize,
    /// The largest `reserved_bytes` seen.
    pub peak_reserved_bytes: usize,
    /// Live segments (from `allocate`).
    pub live_segments: usize,
    /// Modeled device time of every call so far, in nanoseconds ([`SimCosts`]).
    pub modeled_device_ns: u64,
    /// Of [`modeled_device_ns`](Self::modeled_device_ns), what the unmap helper's jobs took
    /// ([`SimDevice::set_unmap_helper`](super::SimDevice::set_unmap_helper)): driver time off the allocating thread.
    pub modeled_helper_ns: u64,
}

impl SimCounters {
    /// The count of each kind of device call, under the names `cca replay --json` reports
    /// (`device_calls`), in a fixed order.
    pub fn call_counts(&self) -> [(&'static str, u64); 15] {
        // In the order of `CALL_KINDS`, whose names these are (one list for measured and modeled
        // figures).
        let counts = [
            self.allocate_calls,
            self.free_calls,
            self.reserve_calls,
            self.release_range_calls,
            self.create_physical_calls,
            self.map_calls,
            self.set_access_calls,
            self.unmap_calls,
            self.release_physical_calls,
            self.synchronize_calls - self.stream_synchronize_calls,
            self.stream_synchronize_calls,
            self.events_created,
            self.event_records,
            self.event_queries,
            self.stream_waits,
        ];
        std::array::from_fn(|i| (CALL_KINDS[i], counts[i]))
    }
}
