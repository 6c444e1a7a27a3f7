//! Traces: the one operation language used by property tests, fuzzing, golden tests, benches and
//! the CLI, plus (behind the `trace-io` feature) import from PyTorch snapshot pickles and RMM CSV
//! logs and export back to both.
//!
//! The model is versioned ([`TRACE_FORMAT_VERSION`]) and specified in `docs/trace-format.md`.
//! May use: `int_hash` (plain values only otherwise).
//!
//! With `trace-io`: `read_snapshot` / `export_snapshot` (PyTorch memory snapshots, which
//! PyTorch's memory_viz page opens), `read_rmm_csv` / `export_rmm_csv` (RMM
//! `logging_resource_adaptor` logs), `read_trace` (either, detected), all plain or gzipped, with
//! typed errors (`TraceIoError`) and strict or lenient pairing (`ImportOptions`).
#![forbid(unsafe_code)]

mod event;

pub use event::{TRACE_FORMAT_VERSION, Trace, TraceEvent, TraceOp, TraceSource};

#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod compress;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod export;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod import;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod io_error;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod pickle;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod pickle_read;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod pickle_write;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod rmm_csv;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod snapshot;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
mod snapshot_export;

#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use compress::is_gzip;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use import::{
    AllocFailure, DEFAULT_MAX_IMPORT_BYTES, ImportOptions, ImportReport, Imported, TraceFormat,
    detect_format, read_trace, read_trace_file,
};
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use io_error::{Position, TraceIoError};
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use pickle::{PickleValue, check_memory_viz, parse_pickle};
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use pickle_write::write_pickle;
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use rmm_csv::{
    CsvExportOptions, RMM_CSV_HEADER, RmmLog, export_rmm_csv, export_rmm_csv_file, read_rmm_csv,
    read_rmm_csv_file,
};
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use snapshot::{
    SegmentPool, Snapshot, SnapshotBlock, SnapshotBlockState, SnapshotSegment, read_snapshot,
    read_snapshot_file,
};
#[cfg(feature = "trace-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-io")))]
pub use snapshot_export::{
    MAX_EXPORT_DEVICE, SnapshotExportOptions, ToSnapshotSegments, export_snapshot,
    export_snapshot_file, final_segments,
};
