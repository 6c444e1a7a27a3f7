//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) → [`Snapshot`]: the selected
//! device's trace as a [`Trace`], the final segment state as [`SnapshotSegment`]s, and the
//! allocator settings. The mapping is specified in `docs/trace-format.md`.
#![forbid(unsafe_code)]

use std::path::Path;

use super::compress::{decompress_if_gzip, read_file_limited};
use super::event::{Trace, TraceEvent, TraceOp, TraceSource};
use super::import::{AllocFailure, ByteBudget, ImportOptions, ImportReport, Pairing};
use super::io_error::{Position, TraceIoError};
use super::pickle::PickleValue;
use super::pickle_read::{self, Id, Obj, Pickle};

/// Largest segment PyTorch puts in its small pool (`kSmallBuffer`, 2 MiB).
const SMALL_SEGMENT_MAX: u64 = 2 << 20;

/// The pool a segment belongs to (the snapshot's `segment_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentPool {
    /// `"small"`: allocations of at most 1 MiB, in 2 MiB segments.
    Small,
    /// `"large"`: everything else.
    Large,
}

impl SegmentPool {
    /// The snapshot's spelling: `"small"` or `"large"`.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentPool::Small => "small",
            SegmentPool::Large => "large",
        }
    }

    /// The pool PyTorch would have put a segment of `total_size` bytes in: small up to 2 MiB.
    pub fn for_segment_size(total_size: u64) -> Self {
        if total_size <= SMALL_SEGMENT_MAX {
            SegmentPool::Small
        } else {
            SegmentPool::Large
        }
    }
}

/// The state of a block in a snapshot segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SnapshotBlockState {
    /// `"active_allocated"`: handed out and not freed.
    ActiveAllocated,
    /// `"active_pending_free"`: freed by the user, waiting for stream events (also read from
    /// the docstring's spelling `"active_awaiting_free"`).
    ActivePendingFree,
    /// `"inactive"`: free, cached.
    Inactive,
}

impl SnapshotBlockState {
    /// The snapshot's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotBlockState::ActiveAllocated => "active_allocated",
            SnapshotBlockState::ActivePendingFree => "active_pending_free",
            SnapshotBlockState::Inactive => "inactive",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "active_allocated" => Some(SnapshotBlockState::ActiveAllocated),
            "active_pending_free" | "active_awaiting_free" => {
                Some(SnapshotBlockState::ActivePendingFree)
            }
            "inactive" => Some(SnapshotBlockState::Inactive),
            _ => None,
        }
    }

    /// Allocated or pending free.
    pub fn is_active(self) -> bool {
        !matches!(self, SnapshotBlockState::Inactive)
    }
}

/// A block of a snapshot segment. Blocks tile their segment: the first starts at the segment's
/// address, each next one where the previous ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotBlock {
    /// Start address.
    pub address: u64,
    /// Size in bytes (rounded, as the allocator carved it).
    pub size: u64,
    /// The request it serves (stale for inactive blocks in PyTorch's own snapshots).
    pub requested_size: u64,
    /// Allocated, pending free, or free.
    pub state: SnapshotBlockState,
}

/// A device segment in a snapshot's final state (`segments` entries). Stack frames are not
/// kept; the exporter writes `frames: []`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSegment {
    /// Device ordinal.
    pub device: usize,
    /// Base address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Stream handle value.
    pub stream: u64,
    /// `segment_type`.
    pub pool: SegmentPool,
    /// `segment_pool_id` (`(0, 0)` outside private pools).
    pub pool_id: (u64, u64),
    /// Whether it is an expandable segment.
    pub is_expandable: bool,
    /// The blocks, by address.
    pub blocks: Vec<SnapshotBlock>,
}

impl SnapshotSegment {
    /// Bytes in allocated blocks (the snapshot's `allocated_size`).
    pub fn allocated_size(&self) -> u64 {
        self.sum(
            |b| b.state == SnapshotBlockState::ActiveAllocated,
            |b| b.size,
        )
    }

    /// Bytes in active blocks, allocated or pending free (`active_size`).
    pub fn active_size(&self) -> u64 {
        self.sum(|b| b.state.is_active(), |b| b.size)
    }

    /// Requested bytes of active blocks (`requested_size`).
    pub fn requested_size(&self) -> u64 {
        self.sum(|b| b.state.is_active(), |b| b.requested_size)
    }

    fn sum(
        &self,
        pick: impl Fn(&SnapshotBlock) -> bool,
        value: impl Fn(&SnapshotBlock) -> u64,
    ) -> u64 {
        self.blocks
            .iter()
            .filter(|b| pick(b))
            .map(value)
            .fold(0, u64::saturating_add)
    }

    /// Checks that the blocks tile the segment (memory_viz recomputes block addresses by adding
    /// up sizes from the segment's base, so they must).
    ///
    /// # Errors
    /// A description of the first gap, overlap or size mismatch.
    pub fn check_tiling(&self) -> Result<(), String> {
        let mut cursor = self.address;
        for (i, block) in self.blocks.iter().enumerate() {
            if block.address != cursor {
                return Err(format!(
                    "block {i} starts at {:#x}, expected {cursor:#x}",
                    block.address
                ));
            }
            cursor = cursor
                .checked_add(block.size)
                .ok_or_else(|| format!("block {i} ends beyond 2^64"))?;
        }
        let end = self
            .address
            .checked_add(self.total_size)
            .ok_or("the segment ends beyond 2^64")?;
        if cursor != end {
            return Err(format!(
                "blocks end at {cursor:#x}, the segment at {end:#x}"
            ));
        }
        Ok(())
    }
}

/// A PyTorch memory snapshot, imported.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Snapshot {
    /// The selected device's trace (`source` = [`TraceSource::PytorchSnapshot`]).
    pub trace: Trace,
    /// The device whose trace was read.
    pub device: usize,
    /// Length of `device_traces`.
    pub device_count: usize,
    /// The final segment state, all devices, as listed.
    pub segments: Vec<SnapshotSegment>,
    /// `allocator_settings`, when present.
    pub allocator_settings: Option<PickleValue>,
    /// `external_annotations` (`record_function` ranges), when present.
    pub external_annotations: Vec<PickleValue>,
    /// What the import counted and skipped.
    pub report: ImportReport,
}

impl Snapshot {
    /// The `PYTORCH_CUDA_ALLOC_CONF` string the recorded run used, when the settings hold one.
    pub fn alloc_conf(&self) -> Option<&str> {
        self.allocator_settings
            .as_ref()?
            .get("PYTORCH_CUDA_ALLOC_CONF")?
            .as_str()
    }

    /// The segments of the selected device.
    pub fn device_segments(&self) -> impl Iterator<Item = &SnapshotSegment> {
        self.segments
            .iter()
            .filter(move |s| s.device == self.device)
    }
}

/// Imports a PyTorch memory snapshot pickle, plain or gzipped (detected by the magic bytes).
///
/// Entries of the selected device trace map as follows (ids number allocations 0, 1, 2, ...;
/// a `free_requested` at address A frees the live allocation at A):
/// `alloc` → [`TraceOp::Alloc`] (size = the requested size, `addr` = the address),
/// `free_requested` → [`TraceOp::Free`], `segment_alloc` / `segment_free` / `segment_map` /
/// `segment_unmap` → the `Segment*` operations, `oom` → [`ImportReport::alloc_failures`];
/// `free_completed`, `snapshot` and unknown actions are skipped and counted. `time_us` becomes
/// `time_ns = time_us * 1000`; a non-empty `user_metadata` becomes the event's tag.
/// Pairing is strict unless [`ImportOptions::lenient`] is set.
///
/// ```no_run
/// use cuda_caching_allocator::trace::{read_snapshot_file, ImportOptions};
/// let snap = read_snapshot_file("snapshot.pickle", &ImportOptions::default())?;
/// println!("{} events, {} segments", snap.trace.events.len(), snap.segments.len());
/// # Ok::<(), cuda_caching_allocator::trace::TraceIoError>(())
/// ```
///
/// # Errors
/// [`TraceIoError::Gzip`] (corrupt gzip), [`TraceIoError::Pickle`] (not a pickle of plain
/// data, damaged), [`TraceIoError::Snapshot`] (a pickle of another shape, naming the entry and
/// key), [`TraceIoError::NoSuchDevice`], and in strict mode [`TraceIoError::UnmatchedFree`] /
/// [`TraceIoError::AddressInUse`].
pub fn read_snapshot(bytes: &[u8], options: &ImportOptions) -> Result<Snapshot, TraceIoError> {
    read_snapshot_plain(&decompress_if_gzip(bytes, options.max_bytes)?, options)
}

/// [`read_snapshot`] on the contents of a file.
///
/// # Errors
/// [`TraceIoError::File`] when the file cannot be read, else as [`read_snapshot`].
pub fn read_snapshot_file(
    path: impl AsRef<Path>,
    options: &ImportOptions,
) -> Result<Snapshot, TraceIoError> {
    read_snapshot(
        &read_file_limited(path.as_ref(), options.max_bytes)?,
        options,
    )
}

/// A shape error at `path`.
fn shape(event: Option<usize>, path: impl Into<String>, detail: impl Into<String>) -> TraceIoError {
    TraceIoError::Snapshot {
        event,
        path: path.into(),
        detail: detail.into(),
    }
}

/// The integer `id` as a `u64`, or what is wrong with it.
fn to_u64(p: &Pickle, id: Id) -> Result<u64, String> {
    match p.obj(id) {
        Obj::Int(i) => u64::try_from(*i)
            .map_err(|_| format!("expected a non-negative integer below 2^64, found {i}")),
        other => Err(format!("expected an integer, found {}", other.kind())),
    }
}

/// The trace-entry keys the importer reads.
#[derive(Default)]
struct EntryFields {
    action: Option<Id>,
    addr: Option<Id>,
    size: Option<Id>,
    stream: Option<Id>,
    time_us: Option<Id>,
    user_metadata: Option<Id>,
    device_free: Option<Id>,
}

/// Dict items the reader may visit in all: Note [Scans of shared dicts].
fn scan_budget(p: &Pickle) -> usize {
    p.ops().saturating_mul(16).saturating_add(1024)
}

/// Charges `n` dict items to `scan`.
///
/// Note [Scans of shared dicts]: a pickle memo reference (two bytes) lets one dict stand for
/// every entry or segment, and reading a dict by key visits its items, so a small file of one
/// wide dict shared by many entries made the import's work grow with entries × keys (an
/// adversarial review: 320 KB, 40,000 entries sharing one 40,000-key dict, still importing
/// after minutes). Real snapshots share nothing: each dict's items were written by opcodes of
/// their own, so the items visited stay a few times the opcode count. Past 16 per opcode the
/// import stops with an error naming the place.
fn charge_scan(scan: &mut usize, n: usize) -> Result<(), &'static str> {
    *scan = scan
        .checked_sub(n)
        .ok_or("shared references expand the snapshot's dicts beyond its size")?;
    Ok(())
}

/// Reads one trace entry's fields by key (later duplicates win, as in Python).
fn entry_fields(p: &Pickle, items: &[(Id, Id)]) -> EntryFields {
    let mut f = EntryFields::default();
    for &(k, v) in items {
        let slot = match p.str_of(k) {
            Some("action") => &mut f.action,
            Some("addr") => &mut f.addr,
            Some("size") => &mut f.size,
            Some("stream") => &mut f.stream,
            Some("time_us") => &mut f.time_us,
            Some("user_metadata") => &mut f.user_metadata,
            Some("device_free") => &mut f.device_free,
            _ => continue,
        };
        *slot = Some(v);
    }
    f
}

/// Imports an already decompressed snapshot.
pub(crate) fn read_snapshot_plain(
    plain: &[u8],
    options: &ImportOptions,
) -> Result<Snapshot, TraceIoError> {
    let p = pickle_read::parse(plain)?;
    let root = p.root();
    if p.dict_items(root).is_none() {
        return Err(shape(
            None,
            "the top level",
            format!("expected a dict, found {}", p.obj(root).kind()),
        ));
    }
    let traces_id = p.dict_get(root, "device_traces").ok_or_else(|| {
        shape(
            None,
            "device_traces",
            "missing: not a PyTorch memory snapshot",
        )
    })?;
    let traces = p.list_items(traces_id).ok_or_else(|| {
        shape(
            None,
            "device_traces",
            format!("expected a list, found {}", p.obj(traces_id).kind()),
        )
    })?;
    let mut per_device = Vec::with_capacity(traces.len());
    for (d, &t) in traces.iter().enumerate() {
        let list = p.list_items(t).ok_or_else(|| {
            shape(
                None,
                format!("device_traces[{d}]"),
                format!("expected a list, found {}", p.obj(t).kind()),
            )
        })?;
        per_device.push(list);
    }
    let device = match options.device {
        Some(d) if d < per_device.len() => d,
        Some(d) => {
            return Err(TraceIoError::NoSuchDevice {
                device: d,
                available: per_device.len(),
            });
        }
        None => per_device.iter().position(|l| !l.is_empty()).unwrap_or(0),
    };
    let entries = per_device.get(device).copied().unwrap_or_default();
    let mut budget = ByteBudget::new(options.max_bytes);
    let (trace, mut report) = read_entries(&p, device, entries, options, &mut budget)?;
    let segments = match p.dict_get(root, "segments") {
        Some(id) => read_segments(&p, id)?,
        None => Vec::new(),
    };
    let allocator_settings = match p.dict_get(root, "allocator_settings") {
        Some(id) => Some(
            p.to_value(id, &mut budget)
                .map_err(|e| settings_error("allocator_settings", e))?,
        ),
        None => None,
    };
    let external_annotations = match p.dict_get(root, "external_annotations") {
        Some(id) => match p
            .to_value(id, &mut budget)
            .map_err(|e| settings_error("external_annotations", e))?
        {
            PickleValue::List(items) => items,
            other => vec![other],
        },
        None => Vec::new(),
    };
    report.materialised_bytes = budget.used();
    report.device = Some(device);
    report.devices_with_records = (0..per_device.len())
        .filter(|&d| !per_device[d].is_empty())
        .collect();
    Ok(Snapshot {
        trace,
        device,
        device_count: per_device.len(),
        segments,
        allocator_settings,
        external_annotations,
        report,
    })
}

/// A conversion error under `key`; the import limit stays its own error.
fn settings_error(key: &str, e: TraceIoError) -> TraceIoError {
    match e {
        TraceIoError::TooLarge { .. } => e,
        other => shape(None, key, other.to_string()),
    }
}

/// Maps the entries of one device trace, charging each event and tag to `budget`.
fn read_entries(
    p: &Pickle,
    device: usize,
    entries: &[Id],
    options: &ImportOptions,
    budget: &mut ByteBudget,
) -> Result<(Trace, ImportReport), TraceIoError> {
    let mut trace = Trace::new(TraceSource::PytorchSnapshot);
    let mut report = ImportReport::default();
    let mut pairing = Pairing::new(options);
    let mut scan = scan_budget(p);
    for (i, &entry) in entries.iter().enumerate() {
        report.records += 1;
        let path = |key: &str| format!("device_traces[{device}][{i}]{key}");
        let items = p.dict_items(entry).ok_or_else(|| {
            shape(
                Some(i),
                path(""),
                format!("expected a dict, found {}", p.obj(entry).kind()),
            )
        })?;
        charge_scan(&mut scan, items.len()).map_err(|d| shape(Some(i), path(""), d))?;
        let f = entry_fields(p, items);
        let action_id = f
            .action
            .ok_or_else(|| shape(Some(i), path(""), "no action"))?;
        let action = p.str_of(action_id).ok_or_else(|| {
            shape(
                Some(i),
                path(".action"),
                format!("expected a string, found {}", p.obj(action_id).kind()),
            )
        })?;
        let required = |slot: Option<Id>, key: &str| -> Result<u64, TraceIoError> {
            let id = slot.ok_or_else(|| {
                shape(
                    Some(i),
                    path(""),
                    format!("`{action}` entry without `{key}`"),
                )
            })?;
            to_u64(p, id).map_err(|d| shape(Some(i), path(&format!(".{key}")), d))
        };
        let optional = |slot: Option<Id>, key: &str| -> Result<Option<u64>, TraceIoError> {
            slot.map(|id| to_u64(p, id).map_err(|d| shape(Some(i), path(&format!(".{key}")), d)))
                .transpose()
        };
        let stream = optional(f.stream, "stream")?.unwrap_or(0);
        let time_ns = match optional(f.time_us, "time_us")? {
            Some(us) => us.checked_mul(1000).ok_or_else(|| {
                shape(
                    Some(i),
                    path(".time_us"),
                    format!("{us} µs overflows a u64 of nanoseconds"),
                )
            })?,
            None => 0,
        };
        let at = Position::Event(i);
        let op = match action {
            "alloc" => {
                let addr = required(f.addr, "addr")?;
                let size = required(f.size, "size")?;
                let id = pairing.alloc(addr, at, &mut report)?;
                TraceOp::Alloc {
                    id,
                    size,
                    stream,
                    addr: Some(addr),
                }
            }
            "free_requested" => match pairing.free(required(f.addr, "addr")?, at, &mut report)? {
                Some(id) => TraceOp::Free { id },
                None => continue,
            },
            "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" => {
                let addr = required(f.addr, "addr")?;
                let size = required(f.size, "size")?;
                match action {
                    "segment_alloc" => TraceOp::SegmentAlloc { addr, size, stream },
                    "segment_free" => TraceOp::SegmentFree { addr, size, stream },
                    "segment_map" => TraceOp::SegmentMap { addr, size, stream },
                    _ => TraceOp::SegmentUnmap { addr, size, stream },
                }
            }
            "oom" => {
                let size = optional(f.size, "size")?.unwrap_or(0);
                let device_free = optional(f.device_free, "device_free")?;
                budget.charge(
                    std::mem::size_of::<AllocFailure>(),
                    "the imported trace's events and tags",
                )?;
                report.alloc_failures.push(AllocFailure::new(
                    at,
                    size,
                    stream,
                    time_ns,
                    device_free,
                ));
                continue;
            }
            other => {
                report.skip(other);
                continue;
            }
        };
        let tag = f
            .user_metadata
            .and_then(|id| p.str_of(id))
            .filter(|s| !s.is_empty());
        // Each event copies its tag: a tag shared by reference (a pickle memo) costs its bytes
        // once per event.
        budget.charge(
            std::mem::size_of::<TraceEvent>().saturating_add(tag.map_or(0, str::len)),
            "the imported trace's events and tags",
        )?;
        let tag = tag.map(Box::from);
        trace.events.push(TraceEvent {
            op,
            time_ns,
            thread: 0,
            tag,
        });
    }
    report.live_at_end = pairing.live();
    Ok((trace, report))
}

/// Reads the `segments` list.
fn read_segments(p: &Pickle, list: Id) -> Result<Vec<SnapshotSegment>, TraceIoError> {
    let items = p.list_items(list).ok_or_else(|| {
        shape(
            None,
            "segments",
            format!("expected a list, found {}", p.obj(list).kind()),
        )
    })?;
    // Shared references could multiply blocks (the same block list under many segments);
    // real snapshots never share, so anything far beyond the opcode count is refused.
    let mut budget = p.ops().saturating_mul(2).saturating_add(1024);
    let mut scan = scan_budget(p);
    let mut out = Vec::with_capacity(items.len());
    for (s, &seg) in items.iter().enumerate() {
        let path = |key: &str| format!("segments[{s}]{key}");
        let seg_items = p.dict_items(seg).ok_or_else(|| {
            shape(
                None,
                path(""),
                format!("expected a dict, found {}", p.obj(seg).kind()),
            )
        })?;
        // Eight keys, each looked up by a scan of the items.
        charge_scan(&mut scan, seg_items.len().saturating_mul(8))
            .map_err(|d| shape(None, path(""), d))?;
        let get = |key: &str| {
            seg_items
                .iter()
                .rev()
                .find(|&&(k, _)| p.str_of(k) == Some(key))
                .map(|&(_, v)| v)
        };
        let int = |key: &str| -> Result<Option<u64>, TraceIoError> {
            get(key)
                .map(|id| to_u64(p, id).map_err(|d| shape(None, path(&format!(".{key}")), d)))
                .transpose()
        };
        let address = int("address")?.ok_or_else(|| shape(None, path(""), "no address"))?;
        let total_size =
            int("total_size")?.ok_or_else(|| shape(None, path(""), "no total_size"))?;
        let stream = int("stream")?.unwrap_or(0);
        let device = match int("device")? {
            Some(d) => usize::try_from(d)
                .map_err(|_| shape(None, path(".device"), "device ordinal too large"))?,
            None => 0,
        };
        let pool = match get("segment_type") {
            None => SegmentPool::for_segment_size(total_size),
            Some(id) => match p.str_of(id) {
                Some("small") => SegmentPool::Small,
                Some("large") => SegmentPool::Large,
                _ => {
                    return Err(shape(
                        None,
                        path(".segment_type"),
                        "expected \"small\" or \"large\"",
                    ));
                }
            },
        };
        let pool_id = match get("segment_pool_id") {
            None => (0, 0),
            Some(id) => match p.sequence_items(id) {
                Some(&[a, b]) => {
                    let part =
                        |x| to_u64(p, x).map_err(|d| shape(None, path(".segment_pool_id"), d));
                    (part(a)?, part(b)?)
                }
                _ => {
                    return Err(shape(
                        None,
                        path(".segment_pool_id"),
                        "expected a pair of integers",
                    ));
                }
            },
        };
        let is_expandable = match get("is_expandable").map(|id| p.obj(id)) {
            None => false,
            Some(Obj::Bool(b)) => *b,
            Some(Obj::Int(i)) => *i != 0,
            Some(other) => {
                return Err(shape(
                    None,
                    path(".is_expandable"),
                    format!("expected a bool, found {}", other.kind()),
                ));
            }
        };
        let blocks = match get("blocks") {
            None => Vec::new(),
            Some(id) => read_blocks(p, id, address, &path, &mut budget, &mut scan)?,
        };
        out.push(SnapshotSegment {
            device,
            address,
            total_size,
            stream,
            pool,
            pool_id,
            is_expandable,
            blocks,
        });
    }
    Ok(out)
}

/// Keys a block's dict is searched for, each by a scan of its items.
const BLOCK_KEYS: usize = 5;

/// Reads one segment's `blocks` list; a block without `address` starts where the previous ends
/// (older snapshots), one without `requested_size` requested its whole size.
fn read_blocks(
    p: &Pickle,
    list: Id,
    base: u64,
    seg_path: &dyn Fn(&str) -> String,
    budget: &mut usize,
    scan: &mut usize,
) -> Result<Vec<SnapshotBlock>, TraceIoError> {
    let items = p.list_items(list).ok_or_else(|| {
        shape(
            None,
            seg_path(".blocks"),
            format!("expected a list, found {}", p.obj(list).kind()),
        )
    })?;
    let mut blocks = Vec::with_capacity(items.len().min(*budget));
    let mut cursor = base;
    for (b, &block) in items.iter().enumerate() {
        let path = |key: &str| seg_path(&format!(".blocks[{b}]{key}"));
        *budget = budget.checked_sub(1).ok_or_else(|| {
            shape(
                None,
                path(""),
                "shared references expand the segment list beyond its size",
            )
        })?;
        let block_items = p.dict_items(block).ok_or_else(|| {
            shape(
                None,
                path(""),
                format!("expected a dict, found {}", p.obj(block).kind()),
            )
        })?;
        // Each key looked up by a scan of the items (Note [Scans of shared dicts]).
        charge_scan(scan, block_items.len().saturating_mul(BLOCK_KEYS))
            .map_err(|d| shape(None, path(""), d))?;
        let get = |key: &str| {
            block_items
                .iter()
                .rev()
                .find(|&&(k, _)| p.str_of(k) == Some(key))
                .map(|&(_, v)| v)
        };
        let int = |key: &str| -> Result<Option<u64>, TraceIoError> {
            get(key)
                .map(|id| to_u64(p, id).map_err(|d| shape(None, path(&format!(".{key}")), d)))
                .transpose()
        };
        let size = int("size")?.ok_or_else(|| shape(None, path(""), "no size"))?;
        let address = int("address")?.unwrap_or(cursor);
        let requested_size = int("requested_size")?.unwrap_or(size);
        let state_id = get("state").ok_or_else(|| shape(None, path(""), "no state"))?;
        let state = p
            .str_of(state_id)
            .and_then(SnapshotBlockState::parse)
            .ok_or_else(|| {
                shape(
                    None,
                    path(".state"),
                    "expected \"active_allocated\", \"active_pending_free\" or \"inactive\"",
                )
            })?;
        cursor = address.saturating_add(size);
        blocks.push(SnapshotBlock {
            address,
            size,
            requested_size,
            state,
        });
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::pickle_write::write_pickle;

    fn entry(action: &str, addr: i128, size: i128, time_us: i128) -> PickleValue {
        PickleValue::dict([
            ("action", PickleValue::Str(action.into())),
            ("addr", PickleValue::Int(addr)),
            ("size", PickleValue::Int(size)),
            ("stream", PickleValue::Int(0)),
            ("time_us", PickleValue::Int(time_us)),
        ])
    }

    fn snapshot_bytes(entries: Vec<PickleValue>) -> Vec<u8> {
        write_pickle(&PickleValue::dict([
            ("segments", PickleValue::List(vec![])),
            (
                "device_traces",
                PickleValue::List(vec![PickleValue::List(entries)]),
            ),
        ]))
        .unwrap()
    }

    #[test]
    fn maps_actions_and_pairs_by_address() {
        let bytes = snapshot_bytes(vec![
            entry("segment_alloc", 0x1000, 4096, 1),
            entry("alloc", 0x1000, 100, 2),
            entry("alloc", 0x1200, 200, 3),
            entry("free_requested", 0x1000, 100, 4),
            entry("free_completed", 0x1000, 100, 5),
            entry("snapshot", 0, 0, 6),
            entry("alloc", 0x1000, 50, 7),
        ]);
        let snap = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
        let ops: Vec<_> = snap.trace.events.iter().map(|e| e.op.clone()).collect();
        assert_eq!(
            ops,
            vec![
                TraceOp::SegmentAlloc {
                    addr: 0x1000,
                    size: 4096,
                    stream: 0
                },
                TraceOp::Alloc {
                    id: 0,
                    size: 100,
                    stream: 0,
                    addr: Some(0x1000)
                },
                TraceOp::Alloc {
                    id: 1,
                    size: 200,
                    stream: 0,
                    addr: Some(0x1200)
                },
                TraceOp::Free { id: 0 },
                TraceOp::Alloc {
                    id: 2,
                    size: 50,
                    stream: 0,
                    addr: Some(0x1000)
                },
            ]
        );
        assert_eq!(snap.trace.events[3].time_ns, 4000);
        assert_eq!(snap.report.skipped.get("free_completed"), Some(&1));
        assert_eq!(snap.report.skipped.get("snapshot"), Some(&1));
        assert_eq!((snap.report.records, snap.report.live_at_end), (7, 2));
    }

    #[test]
    fn unmatched_free_is_strict_by_default_and_counted_when_lenient() {
        let bytes = snapshot_bytes(vec![
            entry("alloc", 0x1000, 1, 0),
            entry("free_requested", 0x2000, 1, 0),
        ]);
        let err = read_snapshot(&bytes, &ImportOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                TraceIoError::UnmatchedFree {
                    at: Position::Event(1),
                    addr: 0x2000
                }
            ),
            "{err}"
        );
        let snap = read_snapshot(&bytes, &ImportOptions::lenient()).unwrap();
        assert_eq!(snap.report.unmatched_frees, 1);
        assert_eq!(snap.trace.events.len(), 1);
    }

    #[test]
    fn shape_errors_name_the_entry_and_key() {
        let mut bad = entry("alloc", 0x1000, 1, 0);
        if let PickleValue::Dict(items) = &mut bad {
            items[2].1 = PickleValue::Str("big".into());
        }
        let bytes = snapshot_bytes(vec![entry("alloc", 0x2000, 1, 0), bad]);
        let err = read_snapshot(&bytes, &ImportOptions::default()).unwrap_err();
        match &err {
            TraceIoError::Snapshot { event, path, .. } => {
                assert_eq!(*event, Some(1));
                assert_eq!(path, "device_traces[0][1].size");
            }
            other => panic!("{other}"),
        }
        let no_traces = write_pickle(&PickleValue::dict([(
            "segments",
            PickleValue::List(vec![]),
        )]))
        .unwrap();
        assert!(
            read_snapshot(&no_traces, &ImportOptions::default())
                .unwrap_err()
                .to_string()
                .contains("device_traces")
        );
        let not_dict = write_pickle(&PickleValue::List(vec![])).unwrap();
        assert!(matches!(
            read_snapshot(&not_dict, &ImportOptions::default()),
            Err(TraceIoError::Snapshot { .. })
        ));
    }

    #[test]
    fn device_choice() {
        let bytes = write_pickle(&PickleValue::dict([(
            "device_traces",
            PickleValue::List(vec![
                PickleValue::List(vec![]),
                PickleValue::List(vec![entry("alloc", 1, 1, 0)]),
            ]),
        )]))
        .unwrap();
        let snap = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(
            (snap.device, snap.device_count, snap.trace.events.len()),
            (1, 2, 1)
        );
        assert_eq!(
            (snap.report.device, &snap.report.devices_with_records[..]),
            (Some(1), &[1][..])
        );
        let snap = read_snapshot(&bytes, &ImportOptions::default().with_device(0)).unwrap();
        assert_eq!((snap.device, snap.trace.events.len()), (0, 0));
        assert_eq!(snap.report.device, Some(0));
        assert!(matches!(
            read_snapshot(&bytes, &ImportOptions::default().with_device(2)),
            Err(TraceIoError::NoSuchDevice {
                device: 2,
                available: 2
            })
        ));
    }

    #[test]
    fn segment_tiling_check() {
        let block = |address, size| SnapshotBlock {
            address,
            size,
            requested_size: size,
            state: SnapshotBlockState::Inactive,
        };
        let mut seg = SnapshotSegment {
            device: 0,
            address: 0x1000,
            total_size: 0x300,
            stream: 0,
            pool: SegmentPool::Small,
            pool_id: (0, 0),
            is_expandable: false,
            blocks: vec![block(0x1000, 0x100), block(0x1100, 0x200)],
        };
        seg.check_tiling().unwrap();
        seg.blocks[1].address = 0x1180;
        assert!(seg.check_tiling().is_err());
        seg.blocks[1].address = 0x1100;
        seg.total_size = 0x400;
        assert!(seg.check_tiling().is_err());
    }
}
