//! `SimHost`: a deterministic simulated host that page-locks nothing.
//!
//! It hands out disjoint host ranges from a fixed capacity (addresses far above the simulated
//! device's, so a [`SimDevice`]'s use tracking can cover both), models what pinning costs (per
//! call and per byte, for pin and unpin, defaults near the H100 host's figures in
//! `docs/pinned.md`), counts every call and injects faults on pin and unpin. Streams, events and
//! their faults are the lent [`SimDevice`]'s: queue work that reads or writes a pinned block with
//! [`SimDevice::use_range`] (`DeviceAddr(block address)`), finish it with
//! [`SimDevice::complete_work`], and check hand-outs with [`SimDevice::check_handout`].
//!
//! No clocks, no randomness: any run replays exactly. May use: `backend`.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::BackendError;
use crate::backend::sim::SimDevice;

use super::{HostBackend, HostPtr, Pinned};

/// Where simulated host ranges start: far above any simulated device address.
const HOST_BASE: usize = 1 << 52;

/// Capacity and cost model of a [`SimHost`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimHostConfig {
    /// Bytes the host can pin in all.
    pub capacity: usize,
    /// Alignment of pinned ranges (a power of two). Default 4096 (a page).
    pub alignment: usize,
    /// Modelled nanoseconds per pin call. Default 150 µs.
    pub pin_ns_per_call: u64,
    /// Modelled picoseconds per pinned byte. Default 500 (about 0.52 s per GiB).
    pub pin_ps_per_byte: u64,
    /// Modelled nanoseconds per unpin call. Default 20 µs.
    pub unpin_ns_per_call: u64,
    /// Modelled picoseconds per unpinned byte. Default 150 (about 0.16 s per GiB).
    pub unpin_ps_per_byte: u64,
}

impl Default for SimHostConfig {
    fn default() -> Self {
        SimHostConfig {
            capacity: 64 << 30,
            alignment: 4096,
            pin_ns_per_call: 150_000,
            pin_ps_per_byte: 500,
            unpin_ns_per_call: 20_000,
            unpin_ps_per_byte: 150,
        }
    }
}

/// A pin or unpin call that [`SimHost::fail_next`] can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimHostFault {
    /// The next `pin` answers [`BackendError::OutOfMemory`].
    PinOutOfMemory,
    /// The next `pin` answers [`BackendError::Injected`].
    PinError,
    /// The next `unpin` answers [`BackendError::Injected`] (the range stays pinned).
    UnpinError,
}

/// What a [`SimHost`] was asked to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimHostCounters {
    /// Successful pins.
    pub pins: u64,
    /// Successful unpins.
    pub unpins: u64,
    /// Failed pin or unpin calls (faults and capacity).
    pub failures: u64,
    /// Bytes pinned now.
    pub pinned_bytes: usize,
    /// Most bytes pinned at once.
    pub peak_pinned_bytes: usize,
    /// Modelled nanoseconds of every successful pin and unpin.
    pub modelled_nanos: u64,
}

#[derive(Debug, Default)]
struct Inner {
    live: BTreeMap<usize, usize>,
    cursor: usize,
    faults: Vec<SimHostFault>,
    counters: SimHostCounters,
    calls: u64,
}

/// The simulated host: page-locking modelled, events lent by a [`SimDevice`].
#[derive(Debug)]
pub struct SimHost {
    device: Arc<SimDevice>,
    config: SimHostConfig,
    inner: Mutex<Inner>,
}

impl SimHost {
    /// A simulated host with `config`, lending `device` for streams and events.
    pub fn new(device: Arc<SimDevice>, config: SimHostConfig) -> Self {
        SimHost {
            device,
            config,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The device lent for streams and events.
    pub fn sim_device(&self) -> &Arc<SimDevice> {
        &self.device
    }

    /// The configuration.
    pub fn config(&self) -> SimHostConfig {
        self.config
    }

    /// The counters so far.
    pub fn counters(&self) -> SimHostCounters {
        self.inner.lock().counters
    }

    /// The pinned ranges now, by address.
    pub fn live_ranges(&self) -> Vec<(HostPtr, usize)> {
        self.inner
            .lock()
            .live
            .iter()
            .map(|(&a, &l)| (HostPtr(a), l))
            .collect()
    }

    /// Arms one fault for the next matching call (faults of a kind fire in arming order).
    pub fn fail_next(&self, fault: SimHostFault) {
        self.inner.lock().faults.push(fault);
    }

    /// Disarms every pending fault.
    pub fn clear_faults(&self) {
        self.inner.lock().faults.clear();
    }

    fn take_fault(g: &mut Inner, pick: impl Fn(SimHostFault) -> bool) -> Option<SimHostFault> {
        let i = g.faults.iter().position(|&f| pick(f))?;
        Some(g.faults.remove(i))
    }

    fn cost(calls_ns: u64, ps_per_byte: u64, size: usize) -> u64 {
        calls_ns.saturating_add(ps_per_byte.saturating_mul(size as u64) / 1000)
    }
}

// SAFETY: ranges are placed at the lowest free address at or above a moving cursor, checked
// disjoint against the map of live ranges, aligned to `alignment`, never null (they start at
// `HOST_BASE`); nothing is dereferenced, so the "valid memory" promise holds vacuously for a
// simulated device that never touches memory.
unsafe impl HostBackend for SimHost {
    type Device = Arc<SimDevice>;

    fn device(&self) -> &Arc<SimDevice> {
        &self.device
    }

    fn alignment(&self) -> usize {
        self.config.alignment
    }

    fn pin(&self, size: usize) -> Result<Pinned, BackendError> {
        let mut g = self.inner.lock();
        g.calls += 1;
        let call = g.calls;
        if let Some(f) = Self::take_fault(&mut g, |f| {
            matches!(f, SimHostFault::PinOutOfMemory | SimHostFault::PinError)
        }) {
            g.counters.failures += 1;
            return Err(match f {
                SimHostFault::PinOutOfMemory => BackendError::OutOfMemory,
                _ => BackendError::Injected {
                    operation: "pin",
                    call,
                },
            });
        }
        let align = self.config.alignment.max(1);
        let len = size
            .checked_add(align - 1)
            .map(|v| v & !(align - 1))
            .filter(|&l| l > 0)
            .ok_or_else(|| BackendError::InvalidArgument {
                operation: "pin",
                reason: format!("size {size}"),
            })?;
        if g.counters.pinned_bytes.saturating_add(len) > self.config.capacity {
            g.counters.failures += 1;
            return Err(BackendError::OutOfMemory);
        }
        // Lowest gap at or above the cursor that holds `len`.
        let mut at = HOST_BASE.max(g.cursor);
        for (&a, &l) in g.live.range(..) {
            if a + l <= at {
                continue;
            }
            if a >= at.saturating_add(len) {
                break;
            }
            at = a + l;
        }
        // No room left in the simulated address space (a capacity near `usize::MAX`).
        let Some(end) = at.checked_add(len) else {
            g.counters.failures += 1;
            return Err(BackendError::OutOfMemory);
        };
        g.cursor = end;
        g.live.insert(at, len);
        g.counters.pins += 1;
        g.counters.pinned_bytes += len;
        g.counters.peak_pinned_bytes = g.counters.peak_pinned_bytes.max(g.counters.pinned_bytes);
        let nanos = Self::cost(
            self.config.pin_ns_per_call,
            self.config.pin_ps_per_byte,
            len,
        );
        g.counters.modelled_nanos = g.counters.modelled_nanos.saturating_add(nanos);
        Ok(Pinned {
            ptr: HostPtr(at),
            nanos,
        })
    }

    unsafe fn unpin(&self, ptr: HostPtr, size: usize) -> Result<u64, BackendError> {
        let mut g = self.inner.lock();
        g.calls += 1;
        let call = g.calls;
        if Self::take_fault(&mut g, |f| f == SimHostFault::UnpinError).is_some() {
            g.counters.failures += 1;
            return Err(BackendError::Injected {
                operation: "unpin",
                call,
            });
        }
        let align = self.config.alignment.max(1);
        let len = size.checked_add(align - 1).map(|v| v & !(align - 1));
        if g.live.get(&ptr.0).copied() != len {
            return Err(BackendError::InvalidArgument {
                operation: "unpin",
                reason: format!("{ptr} ({size} bytes) is not a pinned range"),
            });
        }
        let len = g.live.remove(&ptr.0).unwrap_or(0);
        g.counters.unpins += 1;
        g.counters.pinned_bytes -= len;
        let nanos = Self::cost(
            self.config.unpin_ns_per_call,
            self.config.unpin_ps_per_byte,
            len,
        );
        g.counters.modelled_nanos = g.counters.modelled_nanos.saturating_add(nanos);
        Ok(nanos)
    }
}
