//! [`Trace`] (plus an optional final segment state) → a PyTorch memory snapshot pickle that
//! PyTorch's memory_viz page and `torch.cuda._memory_viz` open, and [`final_segments`], which
//! derives that state from a trace's segment events when the caller has none.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::Path;

use super::compress::{gzip, write_file};
use super::event::{Trace, TraceOp};
use super::export::{AddressBook, LiveAlloc};
use super::io_error::TraceIoError;
use super::pickle::PickleValue;
use super::pickle_write::write_pickle;
use super::snapshot::{SegmentPool, Snapshot, SnapshotBlock, SnapshotBlockState, SnapshotSegment};

/// PyTorch's minimum block size: derived active blocks are rounded up to it.
const MIN_BLOCK_SIZE: u64 = 512;

/// How to export a snapshot.
///
/// ```
/// use cuda_caching_allocator::trace::{PickleValue, SnapshotExportOptions};
/// let options = SnapshotExportOptions::default()
///     .with_device(1)
///     .with_allocator_settings(PickleValue::dict([("PYTORCH_CUDA_ALLOC_CONF", PickleValue::Str(String::new()))]));
/// assert_eq!(options.device, 1);
/// assert!(!options.gzip);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct SnapshotExportOptions {
    /// The device whose `device_traces` entry holds the trace (the entries before it are empty
    /// lists). Default 0.
    pub device: usize,
    /// Gzip the pickle. Default off: memory_viz and `pickle.load` read plain pickles only (the
    /// importers read both).
    pub gzip: bool,
    /// The final segment state (the `segments` key); `None` (default) derives it from the trace
    /// with [`final_segments`].
    pub segments: Option<Vec<SnapshotSegment>>,
    /// The `allocator_settings` dict; `None` (default) writes an empty dict.
    pub allocator_settings: Option<PickleValue>,
    /// The `external_annotations` list; empty by default.
    pub external_annotations: Vec<PickleValue>,
}

impl SnapshotExportOptions {
    /// Puts the trace under `device_traces[device]`.
    pub fn with_device(mut self, device: usize) -> Self {
        self.device = device;
        self
    }

    /// Gzips the output.
    pub fn with_gzip(mut self, gzip: bool) -> Self {
        self.gzip = gzip;
        self
    }

    /// Writes `segments` as the final segment state.
    pub fn with_segments(mut self, segments: Vec<SnapshotSegment>) -> Self {
        self.segments = Some(segments);
        self
    }

    /// Writes the segments of an allocator's state (anything that implements
    /// [`ToSnapshotSegments`], such as `CachingAllocator::snapshot()`'s result) as the final
    /// segment state, for the device set so far (call [`with_device`](Self::with_device) first).
    pub fn with_allocator_segments<S: ToSnapshotSegments + ?Sized>(mut self, segments: &S) -> Self {
        self.segments = Some(segments.to_snapshot_segments(self.device));
        self
    }

    /// Writes `settings` as `allocator_settings`.
    pub fn with_allocator_settings(mut self, settings: PickleValue) -> Self {
        self.allocator_settings = Some(settings);
        self
    }

    /// Writes `annotations` as `external_annotations`.
    pub fn with_external_annotations(mut self, annotations: Vec<PickleValue>) -> Self {
        self.external_annotations = annotations;
        self
    }
}

/// A final segment state the snapshot exporter can write. Implemented here for
/// [`SnapshotSegment`] slices and vectors, and by the allocator for its own segment snapshots,
/// so this layer depends on nothing above it.
pub trait ToSnapshotSegments {
    /// The segments as a snapshot lists them, on device `device`.
    fn to_snapshot_segments(&self, device: usize) -> Vec<SnapshotSegment>;
}

impl ToSnapshotSegments for [SnapshotSegment] {
    fn to_snapshot_segments(&self, device: usize) -> Vec<SnapshotSegment> {
        self.iter()
            .map(|s| SnapshotSegment {
                device,
                ..s.clone()
            })
            .collect()
    }
}

impl ToSnapshotSegments for Vec<SnapshotSegment> {
    fn to_snapshot_segments(&self, device: usize) -> Vec<SnapshotSegment> {
        self.as_slice().to_snapshot_segments(device)
    }
}

/// Exports `trace` as a PyTorch memory snapshot pickle.
///
/// Events map to trace entries: `Alloc` → `alloc`; `Free` → `free_requested` followed by
/// `free_completed` (both with the allocation's address, size and stream, at the free's time);
/// `SegmentAlloc` / `SegmentFree` / `SegmentMap` / `SegmentUnmap` → `segment_alloc` /
/// `segment_free` / `segment_map` / `segment_unmap`. `EmptyCache` and `SetFraction` have no
/// entry and are left out. Allocations without a recorded address get synthetic ones above
/// every recorded address. `time_us = time_ns / 1000`; a tag becomes `user_metadata`.
///
/// [`SnapshotExportOptions::segments`] is the final state (`segments` key); `None` derives it
/// with [`final_segments`]. The pickle uses only the opcodes memory_viz implements
/// ([`check_memory_viz`](super::check_memory_viz) passes on it).
///
/// ```
/// use cuda_caching_allocator::trace::*;
/// let mut trace = Trace::new(TraceSource::Synthetic);
/// trace.push(TraceOp::SegmentAlloc { addr: 0x7f00_0000_0000, size: 2 << 20, stream: 0 });
/// trace.push(TraceOp::Alloc { id: 0, size: 1000, stream: 0, addr: Some(0x7f00_0000_0000) });
/// let bytes = export_snapshot(&trace, &SnapshotExportOptions::default())?;
/// check_memory_viz(&bytes)?;
/// let back = read_snapshot(&bytes, &ImportOptions::default())?;
/// assert_eq!(back.trace.events, trace.events);
/// assert_eq!(back.segments[0].blocks[0].state, SnapshotBlockState::ActiveAllocated);
/// # Ok::<(), TraceIoError>(())
/// ```
///
/// # Errors
/// [`TraceIoError::Export`] naming the event for a free of an id that is not live, an id
/// allocated twice, an address later re-used while its allocation was live, or a value above
/// `2^63 - 1`; [`TraceIoError::MemoryViz`] for segments whose blocks do not tile them or
/// settings memory_viz cannot read, or a device ordinal above [`MAX_EXPORT_DEVICE`].
pub fn export_snapshot(
    trace: &Trace,
    options: &SnapshotExportOptions,
) -> Result<Vec<u8>, TraceIoError> {
    if options.device > MAX_EXPORT_DEVICE {
        // The trace goes under `device_traces[device]`, after an empty list per lower device.
        return Err(TraceIoError::memory_viz(format!(
            "device ordinal {} is above {MAX_EXPORT_DEVICE}: the snapshot would list that many \
             empty device traces before it",
            options.device
        )));
    }
    let entries = trace_entries(trace)?;
    let derived;
    let segments = match &options.segments {
        Some(segments) => segments,
        None => {
            derived = final_segments(trace, options.device)?;
            &derived
        }
    };
    let segment_values = segments
        .iter()
        .enumerate()
        .map(|(i, s)| segment_value(i, s))
        .collect::<Result<Vec<_>, _>>()?;
    let mut device_traces = vec![PickleValue::List(Vec::new()); options.device];
    device_traces.push(PickleValue::List(entries));
    let top = PickleValue::dict([
        ("segments", PickleValue::List(segment_values)),
        ("device_traces", PickleValue::List(device_traces)),
        (
            "allocator_settings",
            options
                .allocator_settings
                .clone()
                .unwrap_or(PickleValue::Dict(Vec::new())),
        ),
        (
            "external_annotations",
            PickleValue::List(options.external_annotations.clone()),
        ),
    ]);
    let bytes = write_pickle(&top)?;
    if options.gzip {
        gzip(&bytes)
    } else {
        Ok(bytes)
    }
}

/// [`export_snapshot`] into a file (created or truncated).
///
/// # Errors
/// As [`export_snapshot`], plus [`TraceIoError::File`] when the file cannot be written.
pub fn export_snapshot_file(
    path: impl AsRef<Path>,
    trace: &Trace,
    options: &SnapshotExportOptions,
) -> Result<(), TraceIoError> {
    write_file(path.as_ref(), &export_snapshot(trace, options)?)
}

impl Snapshot {
    /// Exports this snapshot again: its trace under its device, its segments, settings and
    /// annotations. Importing the result gives back the same trace, segments and settings.
    ///
    /// # Errors
    /// As [`export_snapshot`].
    pub fn export(&self) -> Result<Vec<u8>, TraceIoError> {
        let mut options = SnapshotExportOptions::default()
            .with_device(self.device)
            .with_segments(self.segments.clone())
            .with_external_annotations(self.external_annotations.clone());
        options.allocator_settings = self.allocator_settings.clone();
        export_snapshot(&self.trace, &options)
    }
}

/// The highest device ordinal a snapshot export accepts (far above any machine's GPU count).
pub const MAX_EXPORT_DEVICE: usize = 1 << 16;

/// A `u64` as a pickle integer that memory_viz reads (at most `2^63 - 1`).
fn int(event: usize, what: &str, value: u64) -> Result<PickleValue, TraceIoError> {
    i64::try_from(value)
        .map(|v| PickleValue::Int(i128::from(v)))
        .map_err(|_| {
            TraceIoError::export(
                event,
                format!("{what} {value:#x} is above 2^63 - 1, which memory_viz cannot read"),
            )
        })
}

/// The `device_traces` entries of `trace`.
fn trace_entries(trace: &Trace) -> Result<Vec<PickleValue>, TraceIoError> {
    let mut book = AddressBook::new(trace);
    let mut entries = Vec::with_capacity(trace.events.len() + trace.events.len() / 2);
    for (i, event) in trace.events.iter().enumerate() {
        let time_us = int(i, "time_us", event.time_ns / 1000)?;
        let entry = |action: &str, addr: u64, size: u64, stream: u64, tag: Option<&str>| {
            let mut items = vec![
                ("action", PickleValue::Str(action.into())),
                ("addr", int(i, "address", addr)?),
                ("size", int(i, "size", size)?),
                ("stream", int(i, "stream", stream)?),
                ("time_us", time_us.clone()),
                ("frames", PickleValue::List(Vec::new())),
            ];
            if let Some(tag) = tag {
                items.push(("user_metadata", PickleValue::Str(tag.into())));
            }
            Ok::<_, TraceIoError>(PickleValue::dict(items))
        };
        let tag = event.tag.as_deref();
        match event.op {
            TraceOp::Alloc {
                id,
                size,
                stream,
                addr,
            } => {
                let live = book.alloc(i, id, size, stream, addr)?;
                entries.push(entry("alloc", live.addr, size, stream, tag)?);
            }
            TraceOp::Free { id } => {
                let LiveAlloc { addr, size, stream } = book.free(i, id)?;
                entries.push(entry("free_requested", addr, size, stream, tag)?);
                entries.push(entry("free_completed", addr, size, stream, None)?);
            }
            TraceOp::SegmentAlloc { addr, size, stream } => {
                entries.push(entry("segment_alloc", addr, size, stream, tag)?)
            }
            TraceOp::SegmentFree { addr, size, stream } => {
                entries.push(entry("segment_free", addr, size, stream, tag)?)
            }
            TraceOp::SegmentMap { addr, size, stream } => {
                entries.push(entry("segment_map", addr, size, stream, tag)?)
            }
            TraceOp::SegmentUnmap { addr, size, stream } => {
                entries.push(entry("segment_unmap", addr, size, stream, tag)?);
            }
            TraceOp::EmptyCache | TraceOp::SetFraction { .. } => {}
        }
    }
    Ok(entries)
}

/// One `segments` entry.
fn segment_value(index: usize, s: &SnapshotSegment) -> Result<PickleValue, TraceIoError> {
    s.check_tiling().map_err(|d| {
        TraceIoError::memory_viz(format!("segment {index} at {:#x}: {d}", s.address))
    })?;
    let int = |what: &str, value: u64| {
        i64::try_from(value)
            .map(|v| PickleValue::Int(i128::from(v)))
            .map_err(|_| {
                TraceIoError::memory_viz(format!(
                    "segment {index}: {what} {value:#x} is above 2^63 - 1"
                ))
            })
    };
    let blocks = s
        .blocks
        .iter()
        .map(|b| {
            Ok(PickleValue::dict([
                ("address", int("block address", b.address)?),
                ("size", int("block size", b.size)?),
                ("requested_size", int("requested size", b.requested_size)?),
                ("state", PickleValue::Str(b.state.as_str().into())),
                ("frames", PickleValue::List(Vec::new())),
            ]))
        })
        .collect::<Result<Vec<_>, TraceIoError>>()?;
    Ok(PickleValue::dict([
        ("device", int("device", s.device as u64)?),
        ("address", int("address", s.address)?),
        ("total_size", int("total_size", s.total_size)?),
        ("allocated_size", int("allocated_size", s.allocated_size())?),
        ("active_size", int("active_size", s.active_size())?),
        ("requested_size", int("requested_size", s.requested_size())?),
        ("stream", int("stream", s.stream)?),
        ("segment_type", PickleValue::Str(s.pool.as_str().into())),
        (
            "segment_pool_id",
            PickleValue::Tuple(vec![
                int("pool id", s.pool_id.0)?,
                int("pool id", s.pool_id.1)?,
            ]),
        ),
        ("is_expandable", PickleValue::Bool(s.is_expandable)),
        ("frames", PickleValue::List(Vec::new())),
        ("blocks", PickleValue::List(blocks)),
    ]))
}

/// A device range the recorded run held at the end of the trace.
#[derive(Clone, Copy, Debug)]
struct HeldRange {
    size: u64,
    stream: u64,
    expandable: bool,
}

/// Derives the final segment state of `trace` on `device`: the ranges its `SegmentAlloc` /
/// `SegmentMap` events hold at the end (adjacent mapped ranges of one stream merged, as
/// memory_viz merges them), each tiled by blocks: one `active_allocated` block per allocation
/// live at the end whose address lies inside (its size rounded up to 512 bytes, clipped to the
/// next allocation and the segment end), `inactive` blocks in between. Allocations outside every
/// segment are left out, so a trace without segment events yields no segments.
///
/// # Errors
/// [`TraceIoError::Export`] when the trace's frees do not pair (see [`export_snapshot`]).
pub fn final_segments(trace: &Trace, device: usize) -> Result<Vec<SnapshotSegment>, TraceIoError> {
    let mut book = AddressBook::new(trace);
    let mut held: BTreeMap<u64, HeldRange> = BTreeMap::new();
    for (i, event) in trace.events.iter().enumerate() {
        match event.op {
            TraceOp::Alloc {
                id,
                size,
                stream,
                addr,
            } => {
                book.alloc(i, id, size, stream, addr)?;
            }
            TraceOp::Free { id } => {
                book.free(i, id)?;
            }
            TraceOp::SegmentAlloc { addr, size, stream } => {
                held.insert(
                    addr,
                    HeldRange {
                        size,
                        stream,
                        expandable: false,
                    },
                );
            }
            TraceOp::SegmentFree { addr, .. } => {
                held.remove(&addr);
            }
            TraceOp::SegmentMap { addr, size, stream } => map_range(&mut held, addr, size, stream),
            TraceOp::SegmentUnmap { addr, size, .. } => unmap_range(&mut held, addr, size),
            TraceOp::EmptyCache | TraceOp::SetFraction { .. } => {}
        }
    }
    let live = book.live_by_address();
    let mut segments = Vec::with_capacity(held.len());
    for (&address, range) in &held {
        let end = address.saturating_add(range.size);
        let inside = live.iter().filter(|a| a.addr >= address && a.addr < end);
        segments.push(SnapshotSegment {
            device,
            address,
            total_size: end - address,
            stream: range.stream,
            pool: SegmentPool::for_segment_size(range.size),
            pool_id: (0, 0),
            is_expandable: range.expandable,
            blocks: tile(address, end, inside),
        });
    }
    Ok(segments)
}

/// Blocks tiling `[start, end)` around the live allocations (sorted by address) inside it.
fn tile<'a>(start: u64, end: u64, live: impl Iterator<Item = &'a LiveAlloc>) -> Vec<SnapshotBlock> {
    let live: Vec<&LiveAlloc> = live.collect();
    let mut blocks = Vec::new();
    let mut cursor = start;
    for (k, a) in live.iter().enumerate() {
        if a.addr < cursor {
            continue; // overlaps the previous block (re-bound address): not representable
        }
        let limit = live[k + 1..]
            .iter()
            .map(|n| n.addr)
            .find(|&n| n > a.addr)
            .unwrap_or(end)
            .min(end);
        let rounded = a
            .size
            .max(1)
            .checked_next_multiple_of(MIN_BLOCK_SIZE)
            .unwrap_or(u64::MAX);
        let size = rounded.min(limit - a.addr);
        if a.addr > cursor {
            blocks.push(SnapshotBlock {
                address: cursor,
                size: a.addr - cursor,
                requested_size: 0,
                state: SnapshotBlockState::Inactive,
            });
        }
        blocks.push(SnapshotBlock {
            address: a.addr,
            size,
            requested_size: a.size.min(size),
            state: SnapshotBlockState::ActiveAllocated,
        });
        cursor = a.addr + size;
    }
    if cursor < end {
        blocks.push(SnapshotBlock {
            address: cursor,
            size: end - cursor,
            requested_size: 0,
            state: SnapshotBlockState::Inactive,
        });
    }
    blocks
}

/// Adds a mapped range of an expandable segment, merging it with adjacent mapped ranges of the
/// same stream.
fn map_range(held: &mut BTreeMap<u64, HeldRange>, addr: u64, size: u64, stream: u64) {
    let mergeable = |r: &HeldRange| r.expandable && r.stream == stream;
    let (mut start, mut total) = (addr, size);
    if let Some((&prev, range)) = held.range(..addr).next_back() {
        if mergeable(range) && prev.checked_add(range.size) == Some(addr) {
            start = prev;
            total = total.saturating_add(range.size);
        }
    }
    if let Some(end) = addr.checked_add(size) {
        if let Some(next) = held.get(&end).copied().filter(|r| mergeable(r)) {
            held.remove(&end);
            total = total.saturating_add(next.size);
        }
    }
    held.insert(
        start,
        HeldRange {
            size: total,
            stream,
            expandable: true,
        },
    );
}

/// Removes `[addr, addr + size)` from the held range containing it, keeping what is left on
/// either side.
fn unmap_range(held: &mut BTreeMap<u64, HeldRange>, addr: u64, size: u64) {
    let Some((&start, &range)) = held.range(..=addr).next_back() else {
        return;
    };
    let end = start.saturating_add(range.size);
    if addr >= end {
        return;
    }
    held.remove(&start);
    if addr > start {
        held.insert(
            start,
            HeldRange {
                size: addr - start,
                ..range
            },
        );
    }
    let cut_end = addr.saturating_add(size);
    if cut_end < end {
        held.insert(
            cut_end,
            HeldRange {
                size: end - cut_end,
                ..range
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event::TraceSource;

    #[test]
    fn final_segments_tile_live_allocations() {
        let mut t = Trace::new(TraceSource::Synthetic);
        t.push(TraceOp::SegmentAlloc {
            addr: 0x10000,
            size: 0x10000,
            stream: 0,
        });
        t.push(TraceOp::Alloc {
            id: 0,
            size: 100,
            stream: 0,
            addr: Some(0x10000),
        });
        t.push(TraceOp::Alloc {
            id: 1,
            size: 600,
            stream: 0,
            addr: Some(0x10200),
        });
        t.push(TraceOp::Alloc {
            id: 2,
            size: 600,
            stream: 0,
            addr: Some(0x10600),
        });
        t.push(TraceOp::Free { id: 0 });
        let segs = final_segments(&t, 0).unwrap();
        assert_eq!(segs.len(), 1);
        let s = &segs[0];
        s.check_tiling().unwrap();
        let shape: Vec<_> = s
            .blocks
            .iter()
            .map(|b| (b.address, b.size, b.state))
            .collect();
        assert_eq!(
            shape,
            vec![
                (0x10000, 0x200, SnapshotBlockState::Inactive),
                (0x10200, 0x400, SnapshotBlockState::ActiveAllocated),
                (0x10600, 0x400, SnapshotBlockState::ActiveAllocated),
                (0x10a00, 0x10000 - 0xa00, SnapshotBlockState::Inactive),
            ]
        );
        assert_eq!((s.allocated_size(), s.requested_size()), (0x800, 1200));
        assert_eq!(s.pool, SegmentPool::Small);
    }

    #[test]
    fn mapped_ranges_merge_and_split() {
        let mut held = BTreeMap::new();
        map_range(&mut held, 0x200, 0x100, 0);
        map_range(&mut held, 0x100, 0x100, 0);
        map_range(&mut held, 0x300, 0x100, 0);
        map_range(&mut held, 0x400, 0x100, 7);
        let spans: Vec<_> = held.iter().map(|(&a, r)| (a, r.size, r.stream)).collect();
        assert_eq!(spans, vec![(0x100, 0x300, 0), (0x400, 0x100, 7)]);
        unmap_range(&mut held, 0x200, 0x80);
        let spans: Vec<_> = held.iter().map(|(&a, r)| (a, r.size)).collect();
        assert_eq!(spans, vec![(0x100, 0x100), (0x280, 0x180), (0x400, 0x100)]);
        unmap_range(&mut held, 0x400, 0x100);
        assert_eq!(held.len(), 2);
    }

    #[test]
    fn unrepresentable_values_are_export_errors() {
        let mut t = Trace::new(TraceSource::Synthetic);
        t.push(TraceOp::Alloc {
            id: 0,
            size: 1,
            stream: u64::MAX,
            addr: Some(0x1000),
        });
        let err = export_snapshot(&t, &SnapshotExportOptions::default()).unwrap_err();
        assert!(
            matches!(err, TraceIoError::Export { event: 0, .. }),
            "{err}"
        );
        let mut t = Trace::new(TraceSource::Synthetic);
        t.push(TraceOp::Free { id: 3 });
        assert!(matches!(
            export_snapshot(&t, &SnapshotExportOptions::default()),
            Err(TraceIoError::Export { event: 0, .. })
        ));
    }
}
