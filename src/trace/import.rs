//! What the importers share: [`ImportOptions`] (strict or lenient pairing, device choice), the
//! [`ImportReport`] of what was skipped or counted, the address-to-id pairing of allocations and
//! frees, and format detection ([`read_trace`], [`read_trace_file`]).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use crate::int_hash::IntMap;
use std::path::Path;

use super::compress::{decompress_if_gzip, read_file_limited};
use super::event::Trace;
use super::io_error::{Position, TraceIoError};
use super::pickle::PickleValue;
use super::{rmm_csv, snapshot};

/// How to import a trace.
///
/// The default is **strict**: a free of an address no live allocation holds, or an allocation
/// at an address that is still live, is an error. **Lenient** import skips such frees (counting
/// them in [`ImportReport::unmatched_frees`]) and re-binds such addresses to the new allocation
/// (counting them in [`ImportReport::rebound_addresses`]; the earlier allocation then stays live
/// for the rest of the trace). Use lenient import for PyTorch snapshots recorded with a limited
/// `max_entries`, whose history starts after some allocations were made.
///
/// ```
/// use cuda_caching_allocator::trace::ImportOptions;
/// let strict = ImportOptions::default();
/// assert!(!strict.lenient);
/// let lenient = ImportOptions::lenient().with_device(1);
/// assert!(lenient.lenient);
/// assert_eq!(lenient.device, Some(1));
/// ```
///
/// Memory is bounded by [`max_bytes`](Self::max_bytes) (default
/// [`DEFAULT_MAX_IMPORT_BYTES`], 4 GiB): an input whose decompressed bytes, or whose imported
/// trace, tags and values, would exceed it fails with [`TraceIoError::TooLarge`] instead of
/// exhausting memory (a few KiB of gzip or of pickle memo references can otherwise ask for
/// tens of GiB).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportOptions {
    /// Skip and count unmatched frees and re-bind live addresses instead of failing.
    pub lenient: bool,
    /// The device whose trace a snapshot import reads; `None` (the default) picks the first
    /// device with a non-empty trace (device 0 when all are empty). CSV import ignores it.
    pub device: Option<usize>,
    /// The most bytes an import may hold, counted twice over: the (decompressed) input, and
    /// separately what is built from it: trace events, tags, and values, where a pickle's
    /// shared (memoised) object counts once per reference. Default
    /// [`DEFAULT_MAX_IMPORT_BYTES`].
    pub max_bytes: u64,
}

/// The default [`ImportOptions::max_bytes`]: 4 GiB, several hundred times the largest real
/// trace this crate ships or tests with (a 5.3 MB snapshot pickle, which imports into about
/// 10 MB).
pub const DEFAULT_MAX_IMPORT_BYTES: u64 = 4 << 30;

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            lenient: false,
            device: None,
            max_bytes: DEFAULT_MAX_IMPORT_BYTES,
        }
    }
}

impl ImportOptions {
    /// Strict pairing (the default): unmatched frees and re-used live addresses are errors.
    pub fn strict() -> Self {
        ImportOptions::default()
    }

    /// Lenient pairing: unmatched frees are skipped and counted, live addresses re-bound.
    pub fn lenient() -> Self {
        ImportOptions {
            lenient: true,
            ..ImportOptions::default()
        }
    }

    /// Sets [`max_bytes`](Self::max_bytes), the import's memory bound.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Reads the trace of `device` from a snapshot.
    pub fn with_device(mut self, device: usize) -> Self {
        self.device = Some(device);
        self
    }
}

/// What an import counted, skipped or could not represent in the trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportReport {
    /// Input records read: entries of the selected device trace, or CSV data rows.
    pub records: u64,
    /// Frees of addresses no live allocation held, skipped (lenient import only).
    pub unmatched_frees: u64,
    /// Allocations at an address that an earlier allocation still held (lenient import only).
    pub rebound_addresses: u64,
    /// Allocations never freed by the end of the trace.
    pub live_at_end: u64,
    /// Failed allocations (`oom` snapshot entries, `allocate failure` CSV rows): the trace
    /// model has no operation for them.
    pub alloc_failures: Vec<AllocFailure>,
    /// Records that map to no trace operation, counted by action (`free_completed`,
    /// `snapshot`, and any action this importer does not know).
    pub skipped: BTreeMap<String, u64>,
    /// Bytes the import built from the input and counted against
    /// [`ImportOptions::max_bytes`]: trace events, tags and values (not the input itself).
    pub materialised_bytes: u64,
    /// A snapshot's device whose trace was read (`None` for a CSV log).
    pub device: Option<usize>,
    /// A snapshot's devices whose `device_traces` entry holds records, in order (empty for a CSV
    /// log): more than one means the other devices' histories were not read.
    pub devices_with_records: Vec<usize>,
}

impl ImportReport {
    pub(crate) fn skip(&mut self, action: &str) {
        // Copy the name only the first time: a shared name repeated in every record must not
        // be copied once per record.
        match self.skipped.get_mut(action) {
            Some(n) => *n += 1,
            None => {
                self.skipped.insert(action.to_owned(), 1);
            }
        }
    }
}

/// The bytes an import may still build ([`ImportOptions::max_bytes`]).
#[derive(Debug)]
pub(crate) struct ByteBudget {
    left: u64,
    limit: u64,
}

impl ByteBudget {
    pub(crate) fn new(limit: u64) -> Self {
        ByteBudget { left: limit, limit }
    }

    /// Takes `n` bytes for `what`.
    ///
    /// # Errors
    /// [`TraceIoError::TooLarge`] when fewer than `n` are left.
    pub(crate) fn charge(&mut self, n: usize, what: &'static str) -> Result<(), TraceIoError> {
        match self.left.checked_sub(n as u64) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(TraceIoError::TooLarge {
                what,
                limit: self.limit,
            }),
        }
    }

    /// Bytes taken so far.
    pub(crate) fn used(&self) -> u64 {
        self.limit - self.left
    }
}

/// A recorded allocation failure.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocFailure {
    /// Where it was recorded.
    pub at: Position,
    /// Size in bytes (PyTorch records the rounded size, RMM the requested one).
    pub size: u64,
    /// Stream handle value.
    pub stream: u64,
    /// Time in nanoseconds, as the trace events count it.
    pub time_ns: u64,
    /// Free device memory at the time, when recorded (PyTorch's `device_free`).
    pub device_free: Option<u64>,
}

impl AllocFailure {
    pub(crate) fn new(
        at: Position,
        size: u64,
        stream: u64,
        time_ns: u64,
        device_free: Option<u64>,
    ) -> Self {
        AllocFailure {
            at,
            size,
            stream,
            time_ns,
            device_free,
        }
    }
}

/// Pairs frees with allocations by address and numbers allocations 0, 1, 2, ...
#[derive(Debug)]
pub(crate) struct Pairing {
    live: IntMap<u64>,
    next_id: u64,
    lenient: bool,
}

impl Pairing {
    pub(crate) fn new(options: &ImportOptions) -> Self {
        Pairing {
            live: IntMap::default(),
            next_id: 0,
            lenient: options.lenient,
        }
    }

    /// A new allocation at `addr`: returns its id.
    pub(crate) fn alloc(
        &mut self,
        addr: u64,
        at: Position,
        report: &mut ImportReport,
    ) -> Result<u64, TraceIoError> {
        let id = self.next_id;
        if let Some(&live_id) = self.live.get(&addr) {
            if !self.lenient {
                return Err(TraceIoError::AddressInUse { at, addr, live_id });
            }
            report.rebound_addresses += 1;
        }
        self.live.insert(addr, id);
        self.next_id += 1;
        Ok(id)
    }

    /// A free of `addr`: the id it frees, or `None` when skipped (lenient).
    pub(crate) fn free(
        &mut self,
        addr: u64,
        at: Position,
        report: &mut ImportReport,
    ) -> Result<Option<u64>, TraceIoError> {
        match self.live.remove(&addr) {
            Some(id) => Ok(Some(id)),
            None if self.lenient => {
                report.unmatched_frees += 1;
                Ok(None)
            }
            None => Err(TraceIoError::UnmatchedFree { at, addr }),
        }
    }

    /// Allocations not freed so far.
    pub(crate) fn live(&self) -> u64 {
        self.live.len() as u64
    }
}

/// The two file formats the importers read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TraceFormat {
    /// A PyTorch memory snapshot pickle (`torch.cuda.memory._dump_snapshot`).
    PytorchSnapshot,
    /// An RMM `logging_resource_adaptor` CSV log.
    RmmCsv,
}

/// Recognises an input by its first bytes (after gzip decompression, which the caller does):
/// a pickle starts with `PROTO` (`0x80`); an RMM log's header, its first non-blank line (after
/// a UTF-8 byte-order mark, as the CSV reader reads it), names the `Action` and `Pointer`
/// columns. `None` when neither.
pub fn detect_format(plain: &[u8]) -> Option<TraceFormat> {
    if plain.first() == Some(&0x80) {
        return Some(TraceFormat::PytorchSnapshot);
    }
    let text = plain.strip_prefix(b"\xef\xbb\xbf").unwrap_or(plain);
    let first_line = text
        .split(|&b| b == b'\n')
        .find(|line| !line.iter().all(u8::is_ascii_whitespace))
        .unwrap_or_default();
    let header = String::from_utf8_lossy(first_line).to_ascii_lowercase();
    (header.contains("action") && header.contains("pointer")).then_some(TraceFormat::RmmCsv)
}

/// A trace read by [`read_trace`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Imported {
    /// The detected format.
    pub format: TraceFormat,
    /// The trace.
    pub trace: Trace,
    /// What the import counted and skipped.
    pub report: ImportReport,
    /// A snapshot's `allocator_settings`, when present (`None` for a CSV log).
    pub allocator_settings: Option<PickleValue>,
}

/// Imports a PyTorch snapshot or an RMM CSV log, plain or gzipped, detecting which
/// ([`detect_format`]). Use [`read_snapshot`](super::read_snapshot) to also get a snapshot's
/// segments.
///
/// # Errors
/// [`TraceIoError::Gzip`] for corrupt gzip data, [`TraceIoError::UnknownFormat`] when the
/// input is neither format, and the errors of [`read_snapshot`](super::read_snapshot) or
/// [`read_rmm_csv`](super::read_rmm_csv).
pub fn read_trace(bytes: &[u8], options: &ImportOptions) -> Result<Imported, TraceIoError> {
    let plain = decompress_if_gzip(bytes, options.max_bytes)?;
    match detect_format(&plain) {
        Some(TraceFormat::PytorchSnapshot) => {
            let snap = snapshot::read_snapshot_plain(&plain, options)?;
            Ok(Imported {
                format: TraceFormat::PytorchSnapshot,
                trace: snap.trace,
                report: snap.report,
                allocator_settings: snap.allocator_settings,
            })
        }
        Some(TraceFormat::RmmCsv) => {
            let log = rmm_csv::read_rmm_csv_plain(&plain, options)?;
            Ok(Imported {
                format: TraceFormat::RmmCsv,
                trace: log.trace,
                report: log.report,
                allocator_settings: None,
            })
        }
        None => {
            let start = String::from_utf8_lossy(&plain[..plain.len().min(32)]).into_owned();
            Err(TraceIoError::UnknownFormat { start })
        }
    }
}

/// [`read_trace`] on the contents of a file.
///
/// # Errors
/// [`TraceIoError::File`] when the file cannot be read, else as [`read_trace`].
pub fn read_trace_file(
    path: impl AsRef<Path>,
    options: &ImportOptions,
) -> Result<Imported, TraceIoError> {
    read_trace(
        &read_file_limited(path.as_ref(), options.max_bytes)?,
        options,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_pairing_errors_and_lenient_counts() {
        let mut report = ImportReport::default();
        let mut strict = Pairing::new(&ImportOptions::strict());
        assert_eq!(
            strict.alloc(0x100, Position::Line(2), &mut report).unwrap(),
            0
        );
        assert!(matches!(
            strict.alloc(0x100, Position::Line(3), &mut report),
            Err(TraceIoError::AddressInUse {
                addr: 0x100,
                live_id: 0,
                ..
            })
        ));
        assert!(matches!(
            strict.free(0x200, Position::Line(4), &mut report),
            Err(TraceIoError::UnmatchedFree {
                addr: 0x200,
                at: Position::Line(4)
            })
        ));
        assert_eq!(
            strict.free(0x100, Position::Line(5), &mut report).unwrap(),
            Some(0)
        );

        let mut lenient = Pairing::new(&ImportOptions::lenient());
        assert_eq!(
            lenient
                .alloc(0x100, Position::Event(0), &mut report)
                .unwrap(),
            0
        );
        assert_eq!(
            lenient
                .alloc(0x100, Position::Event(1), &mut report)
                .unwrap(),
            1
        );
        assert_eq!(
            lenient
                .free(0x100, Position::Event(2), &mut report)
                .unwrap(),
            Some(1)
        );
        assert_eq!(
            lenient
                .free(0x100, Position::Event(3), &mut report)
                .unwrap(),
            None
        );
        assert_eq!((report.rebound_addresses, report.unmatched_frees), (1, 1));
    }

    #[test]
    fn detects_formats() {
        assert_eq!(
            detect_format(b"\x80\x04}."),
            Some(TraceFormat::PytorchSnapshot)
        );
        assert_eq!(
            detect_format(b"Thread,Time,Action,Pointer,Size,Stream\n"),
            Some(TraceFormat::RmmCsv)
        );
        assert_eq!(detect_format(b"hello"), None);
        assert!(matches!(
            read_trace(b"hello", &ImportOptions::default()),
            Err(TraceIoError::UnknownFormat { .. })
        ));
    }
}
