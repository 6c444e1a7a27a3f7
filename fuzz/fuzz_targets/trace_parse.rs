//! Arbitrary bytes into both trace importers (strict and lenient): they must never panic, and
//! whatever they accept must survive export → import unchanged, in its own format and across to
//! the other one.
#![no_main]

use cuda_caching_allocator::trace::{
    CsvExportOptions, ImportOptions, PickleValue, RmmLog, Snapshot, SnapshotExportOptions, Trace,
    TraceEvent, TraceOp, check_memory_viz, export_rmm_csv, export_snapshot, read_rmm_csv,
    read_snapshot, read_trace,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for options in [ImportOptions::strict(), ImportOptions::lenient()] {
        if let Ok(snap) = read_snapshot(data, &options) {
            snapshot_round_trip(&snap, &options);
        }
        if let Ok(log) = read_rmm_csv(data, &options) {
            csv_round_trip(&log, &options);
        }
    }
    let _ = read_trace(data, &ImportOptions::default());
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
