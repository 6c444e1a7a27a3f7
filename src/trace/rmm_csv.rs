//! RMM `logging_resource_adaptor` CSV logs (`Thread,Time,Action,Pointer,Size,Stream`) →
//! [`RmmLog`], and [`Trace`] → such a log. The mapping is specified in `docs/trace-format.md`.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use super::compress::{decompress_if_gzip, gzip, read_file_limited, write_file};
use super::event::{Trace, TraceEvent, TraceOp, TraceSource};
use super::export::{AddressBook, LiveAlloc};
use super::import::{AllocFailure, ByteBudget, ImportOptions, ImportReport, Pairing};
use super::io_error::{Position, TraceIoError};

/// The header the exporter writes.
pub const RMM_CSV_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

const NS_PER_US: u64 = 1_000;
const NS_PER_DAY: u64 = 86_400 * 1_000_000_000;
const NS_HALF_DAY: u64 = NS_PER_DAY / 2;

/// An RMM CSV log, imported.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RmmLog {
    /// The trace (`source` = [`TraceSource::RmmCsv`]).
    pub trace: Trace,
    /// The log's thread ids, indexed by the small thread numbers of the trace events.
    pub threads: Vec<String>,
    /// What the import counted and skipped.
    pub report: ImportReport,
}

/// Imports an RMM `logging_resource_adaptor` CSV log, plain or gzipped (detected by the magic
/// bytes).
///
/// The first line is the header; columns are found by name (case-insensitive, any order,
/// unknown columns ignored); `Action`, `Pointer` and `Size` are required, a missing `Thread`,
/// `Time` or `Stream` reads as 0. Rows: `allocate` → [`TraceOp::Alloc`] (ids 0, 1, 2, ...;
/// `addr` = the pointer), `free` → [`TraceOp::Free`] of the live allocation at the pointer (its
/// `Size` is not checked), `allocate failure` → [`ImportReport::alloc_failures`]. `Pointer` is
/// hex (`0x...`), decimal, or `(nil)` (0); `Stream` is decimal or hex. `Time` is integer
/// microseconds or `HH:MM:SS.ffffff`, one of the two throughout the log (at most microsecond
/// resolution is kept; when the clock goes back by more than 12 hours a day is added, so logs
/// running past midnight stay ordered). Thread ids (any text) become 0, 1, 2, ... in order of first appearance among the
/// rows that make events. Blank lines are skipped; fields may be double-quoted but contain no
/// commas. Pairing is strict unless [`ImportOptions::lenient`] is set.
///
/// ```
/// use cuda_caching_allocator::trace::{read_rmm_csv, ImportOptions, TraceOp};
/// let log = "Thread,Time,Action,Pointer,Size,Stream\n\
///            140245,14:02:11.123456,allocate,0x7f3a00000000,4096,0x0\n\
///            140245,14:02:11.123460,free,0x7f3a00000000,4096,0x0\n";
/// let log = read_rmm_csv(log.as_bytes(), &ImportOptions::default())?;
/// assert_eq!(log.trace.events[1].op, TraceOp::Free { id: 0 });
/// assert_eq!(log.threads, ["140245"]);
/// # Ok::<(), cuda_caching_allocator::trace::TraceIoError>(())
/// ```
///
/// # Errors
/// [`TraceIoError::Gzip`] (corrupt gzip), [`TraceIoError::Csv`] naming the line for a bad
/// header or row (also a `Time` of the other form than the first row's), and in strict mode [`TraceIoError::UnmatchedFree`] /
/// [`TraceIoError::AddressInUse`].
pub fn read_rmm_csv(bytes: &[u8], options: &ImportOptions) -> Result<RmmLog, TraceIoError> {
    read_rmm_csv_plain(&decompress_if_gzip(bytes, options.max_bytes)?, options)
}

/// [`read_rmm_csv`] on the contents of a file.
///
/// # Errors
/// [`TraceIoError::File`] when the file cannot be read, else as [`read_rmm_csv`].
pub fn read_rmm_csv_file(
    path: impl AsRef<Path>,
    options: &ImportOptions,
) -> Result<RmmLog, TraceIoError> {
    read_rmm_csv(
        &read_file_limited(path.as_ref(), options.max_bytes)?,
        options,
    )
}

/// Column positions found in the header.
#[derive(Debug)]
struct Columns {
    count: usize,
    thread: Option<usize>,
    time: Option<usize>,
    action: usize,
    pointer: usize,
    size: usize,
    stream: Option<usize>,
}

/// A field without surrounding blanks and double quotes.
fn unquote(field: &str) -> &str {
    let field = field.trim();
    field
        .strip_prefix('"')
        .and_then(|f| f.strip_suffix('"'))
        .unwrap_or(field)
}

fn parse_header(line: &str, number: u64) -> Result<Columns, TraceIoError> {
    let mut found: [Option<usize>; 6] = [None; 6];
    const NAMES: [&str; 6] = ["thread", "time", "action", "pointer", "size", "stream"];
    let fields: Vec<&str> = line.split(',').collect();
    for (i, field) in fields.iter().enumerate() {
        let name = unquote(field).to_ascii_lowercase();
        if let Some(k) = NAMES.iter().position(|&n| n == name) {
            if found[k].replace(i).is_some() {
                return Err(TraceIoError::csv(
                    number,
                    format!("column {} appears twice in the header", NAMES[k]),
                ));
            }
        }
    }
    let required = |k: usize| {
        found[k].ok_or_else(|| {
            TraceIoError::csv(
                number,
                format!(
                    "the header has no {} column (expected {RMM_CSV_HEADER}, found {line:?})",
                    NAMES[k]
                ),
            )
        })
    };
    Ok(Columns {
        count: fields.len(),
        thread: found[0],
        time: found[1],
        action: required(2)?,
        pointer: required(3)?,
        size: required(4)?,
        stream: found[5],
    })
}

/// Parses digits as a decimal `u64`.
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Parses `0x...` hex or decimal.
fn hex_or_decimal(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            u64::from_str_radix(hex, 16).ok()
        }
        Some(_) => None,
        None => decimal(s),
    }
}

/// A parsed `Time` field.
///
/// Note [One form of time]: integer microseconds count from an origin the writer chose (an
/// exporter's `time_ns / 1000`, often since the epoch), clock times from midnight. A log whose
/// `Time` column mixes the two has no common origin, and its clock times' midnight wraps would
/// be judged against each other only, so its times would be meaningless (a plot's time axis
/// jumping by decades): the import refuses such a log, naming the first row of the other form.
enum Time {
    /// Integer microseconds, as nanoseconds.
    Absolute(u64),
    /// `HH:MM:SS.ffffff`, as nanoseconds since midnight.
    Clock(u64),
}

fn parse_time(s: &str) -> Result<Time, String> {
    if let Some(us) = decimal(s) {
        return us
            .checked_mul(NS_PER_US)
            .map(Time::Absolute)
            .ok_or_else(|| format!("time {s} µs overflows"));
    }
    let bad = || format!("time {s:?} is neither integer microseconds nor HH:MM:SS.ffffff");
    let (hms, frac) = s.split_once('.').unwrap_or((s, ""));
    let mut parts = hms.split(':');
    let (Some(h), Some(m), Some(sec), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let two = |x: &str| (matches!(x.len(), 1 | 2)).then(|| decimal(x)).flatten();
    let (Some(h), Some(m), Some(sec)) = (decimal(h).filter(|_| h.len() <= 6), two(m), two(sec))
    else {
        return Err(bad());
    };
    if m >= 60 || sec >= 60 || (s.contains('.') && (frac.is_empty() || frac.len() > 9)) {
        return Err(bad());
    }
    // Keep microseconds: the first six fractional digits, right-padded with zeros.
    let us_digits: String = frac.chars().chain(std::iter::repeat('0')).take(6).collect();
    let us = if frac.is_empty() {
        0
    } else {
        decimal(&us_digits).ok_or_else(bad)?
    };
    let seconds = h * 3600 + m * 60 + sec;
    Ok(Time::Clock(seconds * 1_000_000_000 + us * NS_PER_US))
}

/// Imports an already decompressed log.
pub(crate) fn read_rmm_csv_plain(
    plain: &[u8],
    options: &ImportOptions,
) -> Result<RmmLog, TraceIoError> {
    let mut trace = Trace::new(TraceSource::RmmCsv);
    let mut report = ImportReport::default();
    let mut pairing = Pairing::new(options);
    let mut threads: Vec<String> = Vec::new();
    let mut thread_ids: HashMap<String, u32> = HashMap::new();
    let mut columns: Option<Columns> = None;
    let mut day_offset = 0u64;
    let mut last_clock: Option<u64> = None;
    // The first row with a time: its line, and whether the time was a clock time (Note [One
    // form of time]).
    let mut time_form: Option<(u64, bool)> = None;
    let mut budget = ByteBudget::new(options.max_bytes);
    let what = "the imported trace's events";

    let plain = plain.strip_prefix(b"\xef\xbb\xbf").unwrap_or(plain);
    for (index, raw) in plain.split(|&b| b == b'\n').enumerate() {
        let number = index as u64 + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let line = std::str::from_utf8(raw)
            .map_err(|e| TraceIoError::csv(number, format!("not UTF-8 text ({e})")))?;
        if line.trim().is_empty() {
            continue;
        }
        let Some(cols) = &columns else {
            columns = Some(parse_header(line, number)?);
            continue;
        };
        report.records += 1;
        let fields: Vec<&str> = line.split(',').map(unquote).collect();
        if fields.len() != cols.count {
            return Err(TraceIoError::csv(
                number,
                format!(
                    "{} fields, but the header has {} columns",
                    fields.len(),
                    cols.count
                ),
            ));
        }
        let field = |col: Option<usize>| col.and_then(|c| fields.get(c).copied()).unwrap_or("");
        let bad = |what: &str, value: &str| {
            TraceIoError::csv(
                number,
                format!(
                    "{what} {value:?} {}",
                    match what {
                        "Pointer" => "is not a hex (0x...), decimal or (nil) address",
                        "Size" => "is not a decimal byte count",
                        "Stream" => "is not a decimal or hex stream handle",
                        _ => "is not valid",
                    }
                ),
            )
        };
        let pointer_text = field(Some(cols.pointer));
        let nil = pointer_text == "(nil)";
        let pointer = if nil {
            0
        } else {
            hex_or_decimal(pointer_text).ok_or_else(|| bad("Pointer", pointer_text))?
        };
        let size_text = field(Some(cols.size));
        let size = decimal(size_text).ok_or_else(|| bad("Size", size_text))?;
        let stream_text = field(cols.stream);
        let stream = if stream_text.is_empty() {
            0
        } else {
            hex_or_decimal(stream_text).ok_or_else(|| bad("Stream", stream_text))?
        };
        let time_text = field(cols.time);
        let time_ns = if cols.time.is_none() {
            0
        } else {
            let time = parse_time(time_text).map_err(|d| TraceIoError::csv(number, d))?;
            let clock = matches!(time, Time::Clock(_));
            match time_form {
                None => time_form = Some((number, clock)),
                Some((first, was_clock)) if was_clock != clock => {
                    let form = |c: bool| {
                        if c {
                            "a clock time (HH:MM:SS.ffffff)"
                        } else {
                            "integer microseconds"
                        }
                    };
                    return Err(TraceIoError::csv(
                        number,
                        format!(
                            "time {time_text:?} is {}, but line {first}'s is {}: a log's Time \
                             column holds one form throughout (the two count from different \
                             origins, so the times of a mix are meaningless)",
                            form(clock),
                            form(was_clock)
                        ),
                    ));
                }
                Some(_) => {}
            }
            match time {
                Time::Absolute(ns) => ns,
                Time::Clock(ns) => {
                    let overflow =
                        || TraceIoError::csv(number, "time overflows a u64 of nanoseconds");
                    let mut t = ns.checked_add(day_offset).ok_or_else(overflow)?;
                    if last_clock.is_some_and(|last| t.saturating_add(NS_HALF_DAY) < last) {
                        day_offset = day_offset.checked_add(NS_PER_DAY).ok_or_else(overflow)?;
                        t = t.checked_add(NS_PER_DAY).ok_or_else(overflow)?;
                    }
                    last_clock = Some(t);
                    t
                }
            }
        };
        let at = Position::Line(number);
        let action = field(Some(cols.action));
        let lower = action.to_ascii_lowercase();
        if nil && (lower == "allocate" || lower == "free") {
            // The null pointer (`(nil)`, what RMM's resources return for 0 bytes) is no address
            // (a written `0x0`, which only an export of another format's address 0 makes, stays
            // one, so that such a trace comes back the same):
            // keyed as one, two such allocations looked like one address handed out twice, and
            // a free of it is a no-op. Counted as skipped, by action.
            report.skip(&format!("{lower} (nil)"));
            continue;
        }
        let op = match lower.as_str() {
            "allocate" => {
                let id = pairing.alloc(pointer, at, &mut report)?;
                TraceOp::Alloc {
                    id,
                    size,
                    stream,
                    addr: Some(pointer),
                }
            }
            "free" => match pairing.free(pointer, at, &mut report)? {
                Some(id) => TraceOp::Free { id },
                None => continue,
            },
            "allocate failure" => {
                budget.charge(std::mem::size_of::<AllocFailure>(), what)?;
                report
                    .alloc_failures
                    .push(AllocFailure::new(at, size, stream, time_ns, None));
                continue;
            }
            _ => {
                return Err(TraceIoError::csv(
                    number,
                    format!(
                        "unknown action {action:?} (expected allocate, free or allocate failure)"
                    ),
                ));
            }
        };
        let name = field(cols.thread);
        let thread = match thread_ids.get(name) {
            Some(&t) => t,
            None => {
                let t = u32::try_from(threads.len())
                    .map_err(|_| TraceIoError::csv(number, "more than 2^32 distinct threads"))?;
                budget.charge(name.len().saturating_mul(2), what)?;
                thread_ids.insert(name.to_owned(), t);
                threads.push(name.to_owned());
                t
            }
        };
        budget.charge(std::mem::size_of::<TraceEvent>(), what)?;
        trace.events.push(TraceEvent {
            op,
            time_ns,
            thread,
            tag: None,
        });
    }
    if columns.is_none() {
        return Err(TraceIoError::csv(
            1,
            format!("empty input: expected the header {RMM_CSV_HEADER}"),
        ));
    }
    report.live_at_end = pairing.live();
    report.materialised_bytes = budget.used();
    Ok(RmmLog {
        trace,
        threads,
        report,
    })
}

/// How to export an RMM CSV log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CsvExportOptions {
    /// Gzip the log. Default off.
    pub gzip: bool,
}

impl CsvExportOptions {
    /// Gzips the output.
    pub fn with_gzip(mut self, gzip: bool) -> Self {
        self.gzip = gzip;
        self
    }
}

/// Exports `trace` as an RMM CSV log: the header [`RMM_CSV_HEADER`], then one row per `Alloc`
/// (`allocate`) and `Free` (`free`, with the allocation's pointer, size and stream):
/// `Thread` = the event's thread number, `Time` = integer microseconds (`time_ns / 1000`),
/// `Pointer` = `0x`-hex (allocations without a recorded address get synthetic ones above every
/// recorded address), `Size` and `Stream` decimal. Segment events, `EmptyCache` and
/// `SetFraction` have no RMM row and are left out, as are tags.
///
/// # Errors
/// [`TraceIoError::Export`] naming the event for a free of an id that is not live, an id
/// allocated twice, or an address later re-used while its allocation was live.
pub fn export_rmm_csv(trace: &Trace, options: &CsvExportOptions) -> Result<Vec<u8>, TraceIoError> {
    let mut book = AddressBook::new(trace);
    let mut out = String::with_capacity(64 * trace.events.len() + 64);
    out.push_str(RMM_CSV_HEADER);
    out.push('\n');
    for (i, event) in trace.events.iter().enumerate() {
        let (action, LiveAlloc { addr, size, stream }) = match event.op {
            TraceOp::Alloc {
                id,
                size,
                stream,
                addr,
            } => ("allocate", book.alloc(i, id, size, stream, addr)?),
            TraceOp::Free { id } => ("free", book.free(i, id)?),
            _ => continue,
        };
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{},{},{action},{addr:#x},{size},{stream}",
            event.thread,
            event.time_ns / NS_PER_US
        );
    }
    if options.gzip {
        gzip(out.as_bytes())
    } else {
        Ok(out.into_bytes())
    }
}

/// [`export_rmm_csv`] into a file (created or truncated).
///
/// # Errors
/// As [`export_rmm_csv`], plus [`TraceIoError::File`] when the file cannot be written.
pub fn export_rmm_csv_file(
    path: impl AsRef<Path>,
    trace: &Trace,
    options: &CsvExportOptions,
) -> Result<(), TraceIoError> {
    write_file(path.as_ref(), &export_rmm_csv(trace, options)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<RmmLog, TraceIoError> {
        read_rmm_csv(text.as_bytes(), &ImportOptions::default())
    }

    #[test]
    fn reads_rmm_style_rows() {
        let log = read(
            "Thread,Time,Action,Pointer,Size,Stream\r\n\
             140245,14:02:11.123456,allocate,0x7f3a00000000,4096,0x0\r\n\
             \r\n\
             abc,14:02:11.5,allocate failure,(nil),1073741824,0x0\n\
             777,14:02:12,allocate,0x7f3a00001000,512,0x5600\n\
             140245,14:02:12.000001,free,0x7f3a00000000,4096,0x0\n",
        )
        .unwrap();
        let ops: Vec<_> = log
            .trace
            .events
            .iter()
            .map(|e| (e.op.clone(), e.thread, e.time_ns))
            .collect();
        let t0 = (14 * 3600 + 2 * 60 + 11) * 1_000_000_000u64;
        assert_eq!(
            ops,
            vec![
                (
                    TraceOp::Alloc {
                        id: 0,
                        size: 4096,
                        stream: 0,
                        addr: Some(0x7f3a_0000_0000)
                    },
                    0,
                    t0 + 123_456_000
                ),
                (
                    TraceOp::Alloc {
                        id: 1,
                        size: 512,
                        stream: 0x5600,
                        addr: Some(0x7f3a_0000_1000)
                    },
                    1,
                    t0 + 1_000_000_000
                ),
                (TraceOp::Free { id: 0 }, 0, t0 + 1_000_001_000),
            ]
        );
        assert_eq!(log.threads, ["140245", "777"]);
        assert_eq!(log.report.alloc_failures.len(), 1);
        assert_eq!(log.report.alloc_failures[0].at, Position::Line(4));
        assert_eq!(log.report.alloc_failures[0].size, 1 << 30);
        assert_eq!((log.report.records, log.report.live_at_end), (4, 1));
    }

    #[test]
    fn columns_by_name_and_midnight_wrap() {
        let log = read(
            "action,pointer,size,time\n\
             allocate,4096,8,23:59:59.999999\n\
             free,4096,8,00:00:00.000001\n",
        )
        .unwrap();
        let times: Vec<u64> = log.trace.events.iter().map(|e| e.time_ns).collect();
        assert_eq!(times[1] - times[0], 2_000);
        assert_eq!(
            log.trace.events[0].op,
            TraceOp::Alloc {
                id: 0,
                size: 8,
                stream: 0,
                addr: Some(4096)
            }
        );
    }

    /// A `Time` column that mixes integer microseconds and clock times was read silently, each
    /// row by its own origin; it is refused, naming the row of the other form.
    #[test]
    fn a_mix_of_time_forms_is_refused() {
        let header = "Thread,Time,Action,Pointer,Size,Stream\n";
        for (rows, first, other) in [
            (
                "1,5,allocate,0x10,8,0\n1,10:00:00.000001,free,0x10,8,0\n",
                "integer microseconds",
                "a clock time",
            ),
            (
                "1,10:00:00.000001,allocate,0x10,8,0\n1,5,free,0x10,8,0\n",
                "a clock time",
                "integer microseconds",
            ),
        ] {
            let err = read(&format!("{header}\n{rows}")).unwrap_err();
            match &err {
                TraceIoError::Csv { line: 4, detail } => assert!(
                    detail.contains(&format!("is {other}"))
                        && detail.contains(&format!("line 3's is {first}")),
                    "{detail}"
                ),
                other => panic!("{rows}: {other}"),
            }
        }
        // One form throughout, either one, still reads.
        for rows in [
            "1,5,allocate,0x10,8,0\n1,7,free,0x10,8,0\n",
            "1,10:00:00,allocate,0x10,8,0\n1,10:00:01,free,0x10,8,0\n",
        ] {
            assert!(read(&format!("{header}{rows}")).is_ok(), "{rows}");
        }
    }

    #[test]
    fn bad_rows_name_their_line() {
        let header = "Thread,Time,Action,Pointer,Size,Stream\n";
        let cases = [
            ("1,2,allocate,0x10,8\n", "5 fields"),
            ("1,2,allocate,0xZZ,8,0\n", "Pointer"),
            ("1,2,allocate,0x10,-8,0\n", "Size"),
            ("1,2,allocate,0x10,8,s\n", "Stream"),
            ("1,25:61:00,allocate,0x10,8,0\n", "time"),
            ("1,1:00:00.,allocate,0x10,8,0\n", "time"),
            ("1,2,reallocate,0x10,8,0\n", "unknown action"),
        ];
        for (row, needle) in cases {
            let err = read(&format!("{header}1,1,allocate,0x99,1,0\n{row}")).unwrap_err();
            match &err {
                TraceIoError::Csv { line: 3, detail } => {
                    assert!(detail.contains(needle), "{row}: {detail}")
                }
                other => panic!("{row}: {other}"),
            }
        }
        assert!(matches!(read(""), Err(TraceIoError::Csv { line: 1, .. })));
        assert!(matches!(
            read("Thread,Time,Size\n"),
            Err(TraceIoError::Csv { line: 1, .. })
        ));
        assert!(matches!(
            read(&format!("{header}1,2,free,0x10,8,0\n")),
            Err(TraceIoError::UnmatchedFree {
                at: Position::Line(2),
                addr: 0x10
            })
        ));
        let bad_utf8 = b"Action,Pointer,Size\n\xff\xfe\n";
        assert!(matches!(
            read_rmm_csv(bad_utf8, &ImportOptions::default()),
            Err(TraceIoError::Csv { line: 2, .. })
        ));
    }

    #[test]
    fn export_then_import_gives_the_same_events() {
        let log = read(
            "Thread,Time,Action,Pointer,Size,Stream\n\
             t1,10,allocate,0x1000,100,0\n\
             t2,11,allocate,0x2000,200,3\n\
             t2,12,free,0x1000,100,0\n\
             t1,13,allocate failure,(nil),9,0\n\
             t1,14,allocate,0x1000,50,0\n",
        )
        .unwrap();
        for gz in [false, true] {
            let bytes =
                export_rmm_csv(&log.trace, &CsvExportOptions::default().with_gzip(gz)).unwrap();
            let back = read_rmm_csv(&bytes, &ImportOptions::default()).unwrap();
            assert_eq!(back.trace, log.trace);
        }
        let text =
            String::from_utf8(export_rmm_csv(&log.trace, &CsvExportOptions::default()).unwrap())
                .unwrap();
        assert!(
            text.starts_with(
                "Thread,Time,Action,Pointer,Size,Stream\n0,10,allocate,0x1000,100,0\n"
            ),
            "{text}"
        );
        assert!(text.contains("1,12,free,0x1000,100,0\n"), "{text}");
    }
}
