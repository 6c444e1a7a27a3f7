//! Arbitrary bytes into both trace importers (strict and lenient): they must never panic, and
//! whatever they accept must survive export → import unchanged, in its own format and across to
//! the other one.
//!
//! Size-amplification oracle: a counting global allocator records the peak heap of each import
//! call, which must stay within a fixed multiple of the (decompressed) input plus a few times the
//! import limit (`ImportOptions::max_bytes`, set small here). A few bytes that make the importer
//! hold gigabytes (a gzip bomb, pickle memo references copied per use) fail the target. Run it
//! with a large `-max_len` (e.g. 262144) so that such inputs can be reached.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use cuda_caching_allocator::trace::{
    CsvExportOptions, DEFAULT_MAX_IMPORT_BYTES, ImportOptions, PickleValue, RmmLog, Snapshot, SnapshotExportOptions, Trace,
    TraceEvent, TraceOp, check_memory_viz, export_rmm_csv, export_snapshot, is_gzip,
    read_rmm_csv, read_snapshot, read_trace,
};
use libfuzzer_sys::fuzz_target;

/// Live and peak heap bytes (libFuzzer runs the target on one thread).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counting
// only updates two atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` through `alloc` / `realloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grow(new_size);
        // SAFETY: as for `dealloc`; `new_size` is the caller's, forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The import limit the target runs under.
const LIMIT: u64 = 1 << 20;
/// Heap bytes an import may hold per byte of plain input (the pickle machine's arena, stack and
/// memo; the CSV reader's events and thread names).
const PER_INPUT_BYTE: usize = 256;

/// Runs `import` and checks its peak heap against the amplification bound.
fn bounded<T>(what: &str, data: &[u8], import: impl FnOnce() -> T) -> T {
    // Gzip may expand up to the limit; plain input is what it is.
    let plain = if is_gzip(data) { LIMIT as usize } else { data.len() };
    let bound = PER_INPUT_BYTE * plain + 4 * LIMIT as usize + (1 << 20);
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = import();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    assert!(
        peak <= bound,
        "{what}: {} input bytes made the import hold {peak} bytes (bound {bound})",
        data.len()
    );
    out
}

fuzz_target!(|data: &[u8]| {
    for options in [ImportOptions::strict(), ImportOptions::lenient()] {
        let options = options.with_max_bytes(LIMIT);
        if let Ok(snap) = bounded("read_snapshot", data, || read_snapshot(data, &options)) {
            assert!(snap.report.materialised_bytes <= LIMIT);
            snapshot_round_trip(&snap, &options);
        }
        if let Ok(log) = bounded("read_rmm_csv", data, || read_rmm_csv(data, &options)) {
            assert!(log.report.materialised_bytes <= LIMIT);
            csv_round_trip(&log, &options);
        }
    }
    let options = ImportOptions::default().with_max_bytes(LIMIT);
    let _ = bounded("read_trace", data, || read_trace(data, &options));
});

/// The trace's `Alloc` and `Free` events with what a CSV log cannot hold cleared.
fn alloc_free(trace: &Trace, keep_threads: bool) -> Vec<TraceEvent> {
    trace
        .events
        .iter()
        .filter(|e| matches!(e.op, TraceOp::Alloc { .. } | TraceOp::Free { .. }))
        .map(|e| TraceEvent {
            tag: None,
            thread: if keep_threads { e.thread } else { 0 },
            ..e.clone()
        })
        .collect()
}

fn snapshot_round_trip(snap: &Snapshot, options: &ImportOptions) {
    // What the exporters write back may be larger than the input: re-import it unlimited.
    let options = &options.clone().with_max_bytes(DEFAULT_MAX_IMPORT_BYTES);
    let same_device = options.clone().with_device(snap.device);
    // Export may refuse what memory_viz cannot read (values above 2^63 - 1, blocks that do not
    // tile their segment, bytes or sets in the settings); what it writes must be readable by
    // memory_viz and read back to the same trace, segments and settings.
    if let Ok(bytes) = snap.export() {
        check_memory_viz(&bytes).expect("exported snapshot breaks memory_viz's constraints");
        let back = read_snapshot(&bytes, &same_device).expect("exported snapshot does not import");
        assert_eq!(back.trace, snap.trace);
        assert_eq!(back.segments, snap.segments);
        // A snapshot without `allocator_settings` exports an empty dict.
        let empty = PickleValue::Dict(Vec::new());
        let settings = |s: &Option<PickleValue>| s.clone().unwrap_or_else(|| empty.clone());
        assert!(settings(&back.allocator_settings).same_as(&settings(&snap.allocator_settings)));
        assert_eq!(
            back.external_annotations.len(),
            snap.external_annotations.len()
        );
    }
    // Across to CSV: the alloc / free events survive (tags and segment events cannot).
    let csv = export_rmm_csv(&snap.trace, &CsvExportOptions::default())
        .expect("an imported snapshot's trace must export as CSV");
    let log = read_rmm_csv(&csv, options).expect("exported CSV does not import");
    assert_eq!(log.trace.events, alloc_free(&snap.trace, false));
}

fn csv_round_trip(log: &RmmLog, options: &ImportOptions) {
    let options = &options.clone().with_max_bytes(DEFAULT_MAX_IMPORT_BYTES);
    let bytes = export_rmm_csv(&log.trace, &CsvExportOptions::default())
        .expect("an imported log's trace must export as CSV");
    let back = read_rmm_csv(&bytes, options).expect("exported CSV does not import");
    assert_eq!(back.trace, log.trace);
    assert_eq!(back.threads.len(), log.threads.len());
    // Across to a snapshot (threads are not represented there).
    if let Ok(bytes) = export_snapshot(&log.trace, &SnapshotExportOptions::default()) {
        check_memory_viz(&bytes).expect("exported snapshot breaks memory_viz's constraints");
        let snap = read_snapshot(&bytes, options).expect("exported snapshot does not import");
        assert_eq!(snap.trace.events, alloc_free(&log.trace, false));
        assert!(snap.segments.is_empty());
    }
}
