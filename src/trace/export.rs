//! What the exporters share: the address book that gives every allocation of a trace the
//! address its export carries (the recorded one, or a synthetic one above every recorded
//! address), and refuses traces whose frees a reader pairing by address would misread.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::event::{Trace, TraceOp};
use super::io_error::TraceIoError;

/// Synthetic addresses start at or above this (a typical CUDA heap neighbourhood), aligned to
/// 2 MiB above the highest recorded address.
const SYNTHETIC_FLOOR: u64 = 0x7f00_0000_0000;
/// Alignment of the first synthetic address.
const SYNTHETIC_ALIGN: u64 = 2 << 20;
/// Spacing granularity of synthetic addresses (PyTorch's minimum block size).
const SYNTHETIC_STEP: u64 = 512;

/// A live allocation as the exporters write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LiveAlloc {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: u64,
}

/// Allocation id → address, with the holder of each address.
#[derive(Debug)]
pub(crate) struct AddressBook {
    by_id: HashMap<u64, LiveAlloc>,
    holder: HashMap<u64, u64>,
    next_synthetic: Option<u64>,
}

impl AddressBook {
    /// An empty book whose synthetic addresses lie above every address `trace` records.
    pub(crate) fn new(trace: &Trace) -> Self {
        let recorded_end = trace
            .events
            .iter()
            .filter_map(|e| match e.op {
                TraceOp::Alloc {
                    addr: Some(addr),
                    size,
                    ..
                } => Some(addr.saturating_add(size)),
                TraceOp::SegmentAlloc { addr, size, .. }
                | TraceOp::SegmentFree { addr, size, .. }
                | TraceOp::SegmentMap { addr, size, .. }
                | TraceOp::SegmentUnmap { addr, size, .. } => Some(addr.saturating_add(size)),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let next_synthetic = recorded_end
            .max(SYNTHETIC_FLOOR)
            .checked_next_multiple_of(SYNTHETIC_ALIGN);
        AddressBook {
            by_id: HashMap::new(),
            holder: HashMap::new(),
            next_synthetic,
        }
    }

    /// Allocation `id` of event `event`: records and returns it with its export address.
    pub(crate) fn alloc(
        &mut self,
        event: usize,
        id: u64,
        size: u64,
        stream: u64,
        addr: Option<u64>,
    ) -> Result<LiveAlloc, TraceIoError> {
        if self.by_id.contains_key(&id) {
            return Err(TraceIoError::export(
                event,
                format!("allocation id {id} is allocated again while live"),
            ));
        }
        let addr = match addr {
            Some(addr) => addr,
            None => {
                let addr = self.next_synthetic.ok_or_else(|| {
                    TraceIoError::export(
                        event,
                        "no room left above the recorded addresses for a synthetic address",
                    )
                })?;
                let step = size.max(1).checked_next_multiple_of(SYNTHETIC_STEP);
                self.next_synthetic = step.and_then(|step| addr.checked_add(step));
                addr
            }
        };
        let live = LiveAlloc { addr, size, stream };
        self.by_id.insert(id, live);
        self.holder.insert(addr, id);
        Ok(live)
    }

    /// The free of allocation `id` at event `event`: returns what it frees.
    pub(crate) fn free(&mut self, event: usize, id: u64) -> Result<LiveAlloc, TraceIoError> {
        let live = self.by_id.remove(&id).ok_or_else(|| {
            TraceIoError::export(
                event,
                format!("free of allocation id {id}, which is not live"),
            )
        })?;
        match self.holder.get(&live.addr) {
            Some(&holder) if holder == id => {
                self.holder.remove(&live.addr);
                Ok(live)
            }
            other => {
                let now = other.map_or_else(
                    || "no allocation".to_string(),
                    |h| format!("allocation id {h}"),
                );
                Err(TraceIoError::export(
                    event,
                    format!(
                        "free of allocation id {id} at {:#x}, an address a later allocation took over \
                         (now held by {now}): a reader pairing frees by address would misread it",
                        live.addr
                    ),
                ))
            }
        }
    }

    /// Allocations live now, by address.
    pub(crate) fn live_by_address(&self) -> Vec<LiveAlloc> {
        let mut live: Vec<LiveAlloc> = self.by_id.values().copied().collect();
        live.sort_by_key(|a| (a.addr, a.size, a.stream));
        live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_addresses_are_disjoint_and_above_recorded_ones() {
        let mut trace = Trace::default();
        trace.push(TraceOp::Alloc {
            id: 0,
            size: 100,
            stream: 0,
            addr: Some(0x7f10_0000_0000),
        });
        let mut book = AddressBook::new(&trace);
        let a = book.alloc(0, 1, 1000, 0, None).unwrap();
        let b = book.alloc(1, 2, 0, 0, None).unwrap();
        let c = book.alloc(2, 3, 1, 0, None).unwrap();
        assert_eq!(a.addr, 0x7f10_0020_0000);
        assert_eq!(b.addr, a.addr + 1024);
        assert_eq!(c.addr, b.addr + 512);
    }

    #[test]
    fn refuses_ambiguous_frees_and_unknown_ids() {
        let mut book = AddressBook::new(&Trace::default());
        book.alloc(0, 0, 8, 0, Some(0x1000)).unwrap();
        assert!(book.alloc(1, 0, 8, 0, Some(0x2000)).is_err());
        book.alloc(2, 1, 8, 0, Some(0x1000)).unwrap();
        let err = book.free(3, 0).unwrap_err();
        assert!(err.to_string().contains("took over"), "{err}");
        assert!(book.free(4, 7).is_err());
        assert_eq!(book.free(5, 1).unwrap().addr, 0x1000);
    }
}
