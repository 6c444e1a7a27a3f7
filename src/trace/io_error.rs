//! The error type of trace import and export ([`TraceIoError`]) and the [`Position`] it names.
#![forbid(unsafe_code)]

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Where in an input a problem was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Position {
    /// A line of a CSV log, counted from 1 (the header is line 1).
    Line(u64),
    /// An entry of a snapshot's device trace, counted from 0 (the index into
    /// `device_traces[device]`).
    Event(usize),
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Line(line) => write!(f, "line {line}"),
            Position::Event(index) => write!(f, "trace entry {index}"),
        }
    }
}

/// Why a trace could not be imported or exported.
///
/// Every variant says where the problem is (a file, a byte offset, a CSV line, a snapshot entry
/// or a trace event) and what was wrong; none of the importers or exporters panics on bad input.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceIoError {
    /// A file could not be opened, read, created or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Writing the exported bytes to the caller's writer failed.
    #[error("cannot write the exported trace: {0}")]
    Write(#[source] io::Error),
    /// The input starts with the gzip magic bytes but does not decompress (corrupt or truncated).
    #[error(
        "gzip data is corrupt or truncated (after {decompressed} decompressed bytes): {source}"
    )]
    Gzip {
        /// Bytes decompressed before the error.
        decompressed: u64,
        /// The decoder's error.
        #[source]
        source: io::Error,
    },
    /// The import would hold more bytes than [`ImportOptions::max_bytes`](super::ImportOptions)
    /// allows: the decompressed input, or what is built from it (trace events, tags, values;
    /// a pickle's shared references count once per use). Raise the limit with
    /// `ImportOptions::with_max_bytes` or `cca --max-import-bytes` for a larger trace.
    #[error(
        "{what} exceed the import limit of {limit} bytes (raise it with \
         ImportOptions::with_max_bytes, or cca --max-import-bytes)"
    )]
    TooLarge {
        /// What grew past the limit: "the decompressed input", "the imported trace", ...
        what: &'static str,
        /// The limit in bytes.
        limit: u64,
    },
    /// The input is neither a pickle nor a CSV log with a header naming `Action` and `Pointer`
    /// (format detection in [`read_trace`](super::read_trace)).
    #[error("{}", unknown_format(start))]
    UnknownFormat {
        /// The first bytes of the (decompressed) input, lossily as text.
        start: String,
    },
    /// The input is not a pickle this crate reads, or is damaged. `offset` is the byte offset of
    /// the opcode in the (decompressed) input.
    #[error("pickle, byte {offset}: {detail}")]
    Pickle {
        /// Byte offset in the decompressed input.
        offset: u64,
        /// What was wrong.
        detail: String,
    },
    /// The pickle decoded, but is not a PyTorch memory snapshot of the expected shape.
    #[error("snapshot, at {path}: {detail}")]
    Snapshot {
        /// The entry of the selected device trace, when the problem is inside one.
        event: Option<usize>,
        /// Where in the snapshot, e.g. `device_traces[0][17].size`.
        path: String,
        /// What was wrong.
        detail: String,
    },
    /// The requested device has no entry in `device_traces`.
    #[error("the snapshot has {available} device trace(s); device {device} does not exist")]
    NoSuchDevice {
        /// The requested device.
        device: usize,
        /// Length of `device_traces`.
        available: usize,
    },
    /// A CSV log has a malformed header or row.
    #[error("CSV line {line}: {detail}")]
    Csv {
        /// Line number, from 1 (the header is line 1).
        line: u64,
        /// What was wrong.
        detail: String,
    },
    /// A free names an address that no live allocation holds. With limited history (PyTorch's
    /// `max_entries` ring buffer) this is expected for allocations made before the window:
    /// import with [`ImportOptions::lenient`](super::ImportOptions::lenient) to skip and count
    /// such frees.
    #[error(
        "{at}: free of address {addr:#x}, which no live allocation holds (if the history is \
         truncated, import leniently to skip such frees: `cca replay --lenient` (and the \
         other subcommands), or \
         ImportOptions::lenient)"
    )]
    UnmatchedFree {
        /// The offending line or entry.
        at: Position,
        /// The freed address.
        addr: u64,
    },
    /// An allocation returned an address that an earlier allocation still holds (its free is
    /// missing). Lenient import re-binds the address to the new allocation instead.
    #[error(
        "{at}: allocation at address {addr:#x}, which allocation id {live_id} still holds \
         (its free is missing)"
    )]
    AddressInUse {
        /// The offending line or entry.
        at: Position,
        /// The address.
        addr: u64,
        /// The id of the allocation that holds it.
        live_id: u64,
    },
    /// A trace cannot be exported as it is (e.g. a free of an id that is not live).
    #[error("trace event {event}: {detail}")]
    Export {
        /// Index into [`Trace::events`](super::Trace::events).
        event: usize,
        /// What was wrong.
        detail: String,
    },
    /// A value or an opcode that PyTorch's memory_viz unpickler cannot read (an integer wider
    /// than 8 bytes, a bytes object, a set, a class reference, ...).
    #[error("not readable by memory_viz: {detail}")]
    MemoryViz {
        /// What was wrong.
        detail: String,
    },
}

impl TraceIoError {
    pub(crate) fn pickle(offset: usize, detail: impl Into<String>) -> Self {
        TraceIoError::Pickle {
            offset: offset as u64,
            detail: detail.into(),
        }
    }

    pub(crate) fn csv(line: u64, detail: impl Into<String>) -> Self {
        TraceIoError::Csv {
            line,
            detail: detail.into(),
        }
    }

    pub(crate) fn export(event: usize, detail: impl Into<String>) -> Self {
        TraceIoError::Export {
            event,
            detail: detail.into(),
        }
    }

    pub(crate) fn memory_viz(detail: impl Into<String>) -> Self {
        TraceIoError::MemoryViz {
            detail: detail.into(),
        }
    }
}

/// The message of [`TraceIoError::UnknownFormat`]: "empty file" for an empty input, else the
/// input's first bytes, and what each format starts with.
fn unknown_format(start: &str) -> String {
    let expected = format!(
        "a PyTorch snapshot pickle starts with byte 0x80, an RMM CSV log with the header \
         {}",
        super::rmm_csv::RMM_CSV_HEADER
    );
    if start.is_empty() {
        format!("empty file: neither a PyTorch snapshot pickle nor an RMM CSV log ({expected})")
    } else {
        format!(
            "neither a PyTorch snapshot pickle nor an RMM CSV log (the input starts with \
             {start:?}; {expected})"
        )
    }
}
