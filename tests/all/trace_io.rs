//! Trace import and export on the real traces shipped in `examples/traces` and on small hand-made ones: round trips
//! (import → export → import gives the same events), cross-format agreement, memory_viz opcode
//! constraints, and typed errors on malformed input.
#![cfg(feature = "trace-io")]

use std::path::PathBuf;

use cuda_caching_allocator::trace::*;

const TRACES: [&str; 3] = ["gpt2_train", "resnet50_train", "bert_varlen"];

/// The small hand-made files of `tests/data/trace-io` (`make.py` there writes them).
fn data(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/trace-io")).join(name)
}

/// The real traces shipped in `examples/traces`: PyTorch's snapshots (`NAME.pickle.gz`, gzipped
/// copies of the pickles PyTorch wrote) and the RMM logs (`NAME.csv.gz`).
fn shipped(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/traces")).join(name)
}

/// The bytes of `NAME.pickle` as PyTorch wrote it (the shipped file, decompressed).
fn pickle_bytes(name: &str) -> Vec<u8> {
    let file = std::fs::File::open(shipped(&format!("{name}.pickle.gz"))).unwrap();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::MultiGzDecoder::new(file), &mut bytes).unwrap();
    bytes
}

fn count(trace: &Trace, pick: fn(&TraceOp) -> bool) -> usize {
    trace.events.iter().filter(|e| pick(&e.op)).count()
}

fn alloc_free_only(trace: &Trace) -> Vec<TraceEvent> {
    trace
        .events
        .iter()
        .filter(|e| matches!(e.op, TraceOp::Alloc { .. } | TraceOp::Free { .. }))
        .cloned()
        .collect()
}

#[test]
fn real_snapshots_import_with_expected_counts() {
    // (allocs, frees, segment_allocs, segments) as Python's pickle.load counts them.
    let expected = [
        (6179, 6176, 154, 154),
        (3690, 3687, 118, 118),
        (24344, 24341, 245, 245),
    ];
    for (name, (allocs, frees, seg_allocs, segments)) in TRACES.iter().zip(expected) {
        let snap = read_snapshot_file(
            shipped(&format!("{name}.pickle.gz")),
            &ImportOptions::default(),
        )
        .unwrap();
        let t = &snap.trace;
        assert_eq!(t.source, TraceSource::PytorchSnapshot);
        assert_eq!(t.version, TRACE_FORMAT_VERSION);
        assert_eq!(
            count(t, |op| matches!(op, TraceOp::Alloc { .. })),
            allocs,
            "{name}"
        );
        assert_eq!(
            count(t, |op| matches!(op, TraceOp::Free { .. })),
            frees,
            "{name}"
        );
        assert_eq!(
            count(t, |op| matches!(op, TraceOp::SegmentAlloc { .. })),
            seg_allocs,
            "{name}"
        );
        assert_eq!(snap.segments.len(), segments, "{name}");
        assert_eq!(
            snap.report.skipped.get("free_completed"),
            Some(&(frees as u64)),
            "{name}"
        );
        assert_eq!(snap.report.live_at_end, 3, "{name}");
        assert_eq!(snap.report.unmatched_frees, 0);
        assert_eq!((snap.device, snap.device_count), (0, 1));
        assert_eq!(snap.alloc_conf(), Some(""));
        assert!(!snap.external_annotations.is_empty());
        // Ids are sequential and every free names a live id.
        let mut live = std::collections::HashSet::new();
        let mut next = 0;
        for e in &t.events {
            match e.op {
                TraceOp::Alloc { id, addr, .. } => {
                    assert_eq!(id, next);
                    assert!(addr.is_some());
                    next += 1;
                    live.insert(id);
                }
                TraceOp::Free { id } => assert!(live.remove(&id)),
                _ => {}
            }
        }
        // Times are the recorded microseconds in nanoseconds, non-decreasing.
        assert!(t.events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        assert!(
            t.events
                .iter()
                .all(|e| e.time_ns % 1000 == 0 && e.time_ns > 0)
        );
        for s in &snap.segments {
            s.check_tiling().unwrap();
        }
        // PyTorch's own pickles meet memory_viz's constraints too (a check of the checker).
        check_memory_viz(&pickle_bytes(name)).unwrap();
    }
}

#[test]
fn real_snapshots_round_trip_and_meet_memory_viz() {
    for name in TRACES {
        let snap = read_snapshot_file(
            shipped(&format!("{name}.pickle.gz")),
            &ImportOptions::default(),
        )
        .unwrap();
        let bytes = snap.export().unwrap();
        check_memory_viz(&bytes).unwrap();
        let back = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(back.trace, snap.trace, "{name}");
        assert_eq!(back.segments, snap.segments, "{name}");
        assert!(
            back.allocator_settings
                .as_ref()
                .unwrap()
                .same_as(snap.allocator_settings.as_ref().unwrap())
        );
        assert_eq!(back.external_annotations, snap.external_annotations);
        // The exported pickle writes free_completed after each free_requested.
        assert_eq!(
            back.report.skipped.get("free_completed"),
            snap.report.skipped.get("free_completed")
        );

        // Gzipped, through a file, with the format detected.
        let dir = std::env::temp_dir().join(format!("cca-trace-io-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("snap.pickle.gz");
        let options = SnapshotExportOptions::default()
            .with_gzip(true)
            .with_allocator_segments(&snap.segments);
        export_snapshot_file(&path, &snap.trace, &options).unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert!(is_gzip(&raw));
        let imported = read_trace_file(&path, &ImportOptions::default()).unwrap();
        assert_eq!(imported.format, TraceFormat::PytorchSnapshot);
        assert_eq!(imported.trace, snap.trace);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn real_csv_logs_agree_with_the_snapshots_and_round_trip() {
    for name in TRACES {
        let snap = read_snapshot_file(
            shipped(&format!("{name}.pickle.gz")),
            &ImportOptions::default(),
        )
        .unwrap();
        let log = read_rmm_csv_file(
            shipped(&format!("{name}.csv.gz")),
            &ImportOptions::default(),
        )
        .unwrap();
        assert_eq!(log.trace.source, TraceSource::RmmCsv);
        assert_eq!(log.threads, ["0"]);
        // The CSV holds the snapshot's alloc / free_requested events: same ids, sizes, addresses, times.
        assert_eq!(log.trace.events, alloc_free_only(&snap.trace), "{name}");

        // Exporting the snapshot's trace reproduces the shared CSV (which ends lines with CRLF,
        // as Python's csv module does; the exporter writes LF, as RMM does).
        let mut shared_text = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::MultiGzDecoder::new(
                std::fs::File::open(shipped(&format!("{name}.csv.gz"))).unwrap(),
            ),
            &mut shared_text,
        )
        .unwrap();
        shared_text.retain(|&b| b != b'\r');
        assert!(
            export_rmm_csv(&snap.trace, &CsvExportOptions::default()).unwrap() == shared_text,
            "{name}"
        );

        // CSV → CSV (gzipped) → same events.
        let bytes =
            export_rmm_csv(&log.trace, &CsvExportOptions::default().with_gzip(true)).unwrap();
        let back = read_rmm_csv(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(back.trace, log.trace, "{name}");
        assert_eq!(
            read_trace(&bytes, &ImportOptions::default())
                .unwrap()
                .format,
            TraceFormat::RmmCsv
        );

        // Snapshot → CSV → the snapshot's alloc/free events.
        let bytes = export_rmm_csv(&snap.trace, &CsvExportOptions::default()).unwrap();
        let back = read_rmm_csv(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(back.trace.events, alloc_free_only(&snap.trace), "{name}");

        // CSV → snapshot (segments derived: none, the log has no segment events) → same events.
        let bytes = export_snapshot(&log.trace, &SnapshotExportOptions::default()).unwrap();
        check_memory_viz(&bytes).unwrap();
        let back = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(back.trace.events, log.trace.events, "{name}");
        assert!(back.segments.is_empty());
    }
}

#[test]
fn derived_final_segments_match_pytorchs_on_real_traces() {
    for name in TRACES {
        let snap = read_snapshot_file(
            shipped(&format!("{name}.pickle.gz")),
            &ImportOptions::default(),
        )
        .unwrap();
        let derived = final_segments(&snap.trace, 0).unwrap();
        let spans = |segs: &[SnapshotSegment]| {
            let mut v: Vec<_> = segs
                .iter()
                .map(|s| (s.address, s.total_size, s.pool))
                .collect();
            v.sort_unstable_by_key(|&(a, ..)| a);
            v
        };
        assert_eq!(spans(&derived), spans(&snap.segments), "{name}");
        let active = |segs: &[SnapshotSegment]| {
            let mut v: Vec<_> = segs
                .iter()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state == SnapshotBlockState::ActiveAllocated)
                .map(|b| (b.address, b.requested_size))
                .collect();
            v.sort_unstable();
            v
        };
        assert_eq!(active(&derived), active(&snap.segments), "{name}");
        // Exporting without segments derives them and passes memory_viz's constraints.
        let bytes = export_snapshot(&snap.trace, &SnapshotExportOptions::default()).unwrap();
        check_memory_viz(&bytes).unwrap();
        assert_eq!(
            read_snapshot(&bytes, &ImportOptions::default())
                .unwrap()
                .segments,
            derived
        );
    }
}

/// A small hand-made trace with every operation, two streams, threads, tags and times.
fn hand_made() -> Trace {
    let mut t = Trace::new(TraceSource::Synthetic);
    let base = 0x7f00_0000_0000u64;
    let ops = [
        TraceOp::SegmentAlloc {
            addr: base,
            size: 2 << 20,
            stream: 0,
        },
        TraceOp::Alloc {
            id: 0,
            size: 1000,
            stream: 0,
            addr: Some(base),
        },
        TraceOp::Alloc {
            id: 1,
            size: 512,
            stream: 0,
            addr: Some(base + 1024),
        },
        TraceOp::SegmentMap {
            addr: base + (64 << 20),
            size: 2 << 20,
            stream: 7,
        },
        TraceOp::Alloc {
            id: 2,
            size: 3 << 20,
            stream: 7,
            addr: Some(base + (64 << 20)),
        },
        TraceOp::Free { id: 0 },
        TraceOp::EmptyCache,
        TraceOp::SegmentMap {
            addr: base + (66 << 20),
            size: 2 << 20,
            stream: 7,
        },
        TraceOp::Free { id: 2 },
        TraceOp::SegmentUnmap {
            addr: base + (64 << 20),
            size: 2 << 20,
            stream: 7,
        },
        TraceOp::SetFraction { fraction: 0.5 },
        TraceOp::Alloc {
            id: 3,
            size: 1,
            stream: 0,
            addr: Some(base),
        },
    ];
    for (i, op) in ops.into_iter().enumerate() {
        t.events.push(TraceEvent {
            op,
            time_ns: 1_000_000 + 1000 * i as u64,
            thread: (i % 3) as u32,
            tag: (i == 1).then(|| "phase:forward".into()),
        });
    }
    t
}

#[test]
fn hand_made_trace_round_trips_through_both_formats() {
    let t = hand_made();
    let representable = |keep_segments: bool| -> Vec<TraceEvent> {
        t.events
            .iter()
            .filter(|e| match e.op {
                TraceOp::EmptyCache | TraceOp::SetFraction { .. } => false,
                TraceOp::Alloc { .. } | TraceOp::Free { .. } => true,
                _ => keep_segments,
            })
            .cloned()
            .collect()
    };

    // Snapshot: threads are not represented (all 0), tags are (user_metadata).
    let bytes = export_snapshot(&t, &SnapshotExportOptions::default()).unwrap();
    check_memory_viz(&bytes).unwrap();
    let snap = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
    let mut expected = representable(true);
    expected.iter_mut().for_each(|e| e.thread = 0);
    assert_eq!(snap.trace.events, expected);
    // Final state: the small segment with id 1 and id 3 live, the mapped range that remains.
    assert_eq!(snap.segments.len(), 2);
    assert!(snap.segments[1].is_expandable);
    assert_eq!(snap.segments[0].allocated_size(), 512 + 512);
    // import → export → import is the identity from here on.
    let again = read_snapshot(&snap.export().unwrap(), &ImportOptions::default()).unwrap();
    assert_eq!((again.trace, again.segments), (snap.trace, snap.segments));

    // CSV: threads are represented (renumbered in order of first appearance), tags and segment
    // events are not.
    let bytes = export_rmm_csv(&t, &CsvExportOptions::default()).unwrap();
    let log = read_rmm_csv(&bytes, &ImportOptions::default()).unwrap();
    let mut expected = representable(false);
    let mut seen: Vec<u32> = Vec::new();
    for e in &mut expected {
        e.tag = None;
        if !seen.contains(&e.thread) {
            seen.push(e.thread);
        }
        e.thread = seen.iter().position(|&t| t == e.thread).unwrap() as u32;
    }
    assert_eq!(
        log.threads,
        seen.iter().map(u32::to_string).collect::<Vec<_>>()
    );
    assert_eq!(log.trace.events, expected);
    let again = read_rmm_csv(
        &export_rmm_csv(&log.trace, &CsvExportOptions::default()).unwrap(),
        &ImportOptions::default(),
    )
    .unwrap();
    assert_eq!(again.trace, log.trace);
}

#[test]
fn allocations_without_addresses_get_synthetic_ones() {
    let mut t = Trace::new(TraceSource::Synthetic);
    for id in 0..4 {
        t.push(TraceOp::Alloc {
            id,
            size: 100 * (id + 1),
            stream: 0,
            addr: None,
        });
    }
    t.push(TraceOp::Free { id: 1 });
    t.push(TraceOp::Free { id: 3 });
    for bytes in [
        export_snapshot(&t, &SnapshotExportOptions::default()).unwrap(),
        export_rmm_csv(&t, &CsvExportOptions::default()).unwrap(),
    ] {
        let back = read_trace(&bytes, &ImportOptions::default()).unwrap().trace;
        let mut addrs = Vec::new();
        for (a, b) in t.events.iter().zip(&back.events) {
            match (&a.op, &b.op) {
                (
                    TraceOp::Alloc { id, size, .. },
                    TraceOp::Alloc {
                        id: id2,
                        size: size2,
                        addr,
                        ..
                    },
                ) => {
                    assert_eq!((id, size), (id2, size2));
                    addrs.push(addr.unwrap());
                }
                (x, y) => assert_eq!(x, y),
            }
        }
        addrs.dedup();
        assert_eq!(addrs.len(), 4);
    }
}

#[test]
fn truncated_history_needs_lenient_import() {
    // A ring buffer that dropped the first allocation: its free arrives without an alloc.
    let entry = |action: &str, addr: i128| {
        PickleValue::dict([
            ("action", PickleValue::Str(action.into())),
            ("addr", PickleValue::Int(addr)),
            ("size", PickleValue::Int(512)),
            ("stream", PickleValue::Int(0)),
            ("time_us", PickleValue::Int(5)),
        ])
    };
    let bytes = write_pickle(&PickleValue::dict([
        ("segments", PickleValue::List(vec![])),
        (
            "device_traces",
            PickleValue::List(vec![PickleValue::List(vec![
                entry("free_requested", 0x1000),
                entry("free_completed", 0x1000),
                entry("alloc", 0x2000),
                entry("oom", 0),
            ])]),
        ),
    ]))
    .unwrap();
    let err = read_snapshot(&bytes, &ImportOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            TraceIoError::UnmatchedFree {
                at: Position::Event(0),
                addr: 0x1000
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("trace entry 0"), "{err}");
    let snap = read_snapshot(&bytes, &ImportOptions::lenient()).unwrap();
    assert_eq!(snap.report.unmatched_frees, 1);
    assert_eq!(snap.report.alloc_failures.len(), 1);
    assert_eq!(snap.report.alloc_failures[0].at, Position::Event(3));
    assert_eq!(snap.trace.events.len(), 1);
}

#[test]
fn malformed_inputs_get_typed_errors() {
    let opts = ImportOptions::default();
    // Not a pickle, for both importers.
    assert!(matches!(
        read_snapshot(b"Thread,Time\n", &opts),
        Err(TraceIoError::Pickle { offset: 0, .. })
    ));
    assert!(matches!(
        read_rmm_csv(b"\x80\x04}.", &opts),
        Err(TraceIoError::Csv { line: 1, .. })
    ));
    // A pickle of another shape.
    let list = write_pickle(&PickleValue::List(vec![PickleValue::Int(1)])).unwrap();
    assert!(matches!(
        read_snapshot(&list, &opts),
        Err(TraceIoError::Snapshot { .. })
    ));
    let wrong = write_pickle(&PickleValue::dict([(
        "device_traces",
        PickleValue::List(vec![PickleValue::Int(1)]),
    )]))
    .unwrap();
    let err = read_snapshot(&wrong, &opts).unwrap_err();
    assert!(err.to_string().contains("device_traces[0]"), "{err}");
    // A class reference is refused, not executed.
    let global = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93.";
    let err = read_snapshot(global, &opts).unwrap_err();
    assert!(err.to_string().contains("STACK_GLOBAL"), "{err}");
    // CSV free of an unknown pointer: strict error with the line, lenient count.
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n1,1,allocate,0x10,8,0\n1,2,free,0x20,8,0\n";
    assert!(matches!(
        read_rmm_csv(csv.as_bytes(), &opts),
        Err(TraceIoError::UnmatchedFree {
            at: Position::Line(3),
            addr: 0x20
        })
    ));
    assert_eq!(
        read_rmm_csv(csv.as_bytes(), &ImportOptions::lenient())
            .unwrap()
            .report
            .unmatched_frees,
        1
    );

    // Truncated gzip and truncated pickle.
    let gz = std::fs::read(shipped("gpt2_train.csv.gz")).unwrap();
    assert!(matches!(
        read_rmm_csv(&gz[..gz.len() / 2], &opts),
        Err(TraceIoError::Gzip { .. })
    ));
    assert!(matches!(
        read_trace(&gz[..gz.len() - 4], &opts),
        Err(TraceIoError::Gzip { .. })
    ));
    let pickle = pickle_bytes("resnet50_train");
    for cut in [1, 2, 100, pickle.len() / 2, pickle.len() - 1] {
        let err = read_snapshot(&pickle[..cut], &opts).unwrap_err();
        assert!(
            matches!(err, TraceIoError::Pickle { .. }),
            "cut {cut}: {err}"
        );
    }
    // Flipped bytes never panic (errors or other data are both fine).
    for i in (0..pickle.len()).step_by(pickle.len() / 41) {
        let mut damaged = pickle.clone();
        damaged[i] ^= 0x5a;
        let _ = read_snapshot(&damaged, &ImportOptions::lenient());
    }
}

#[test]
fn python_written_snapshots_in_protocols_2_and_4() {
    let opts = ImportOptions::default();
    let p4 = read_snapshot_file(data("tiny_snapshot_p4.pickle"), &opts).unwrap();
    assert_eq!(
        read_snapshot_file(data("tiny_snapshot_p2.pickle"), &opts).unwrap(),
        p4
    );
    assert_eq!(
        read_snapshot_file(data("tiny_snapshot_p4.pickle.gz"), &opts).unwrap(),
        p4
    );
    let base = 0x7f00_0000_0000u64;
    let mapped = 0x7f00_0400_0000u64;
    let ops: Vec<TraceOp> = p4.trace.events.iter().map(|e| e.op.clone()).collect();
    assert_eq!(
        ops,
        vec![
            TraceOp::SegmentAlloc {
                addr: base,
                size: 2 << 20,
                stream: 0
            },
            TraceOp::Alloc {
                id: 0,
                size: 100,
                stream: 0,
                addr: Some(base)
            },
            TraceOp::Alloc {
                id: 1,
                size: 300,
                stream: 0,
                addr: Some(base + 512)
            },
            TraceOp::Free { id: 1 },
            TraceOp::SegmentMap {
                addr: mapped,
                size: 2 << 20,
                stream: 7
            },
        ]
    );
    assert_eq!(p4.trace.events[1].tag.as_deref(), Some("fwd"));
    assert_eq!(p4.trace.events[3].time_ns, 1_003_000);
    assert_eq!((p4.device, p4.device_count), (0, 2));
    assert_eq!(p4.alloc_conf(), Some("expandable_segments:True"));
    assert_eq!(p4.report.alloc_failures.len(), 1);
    let oom = &p4.report.alloc_failures[0];
    assert_eq!(
        (oom.at, oom.size, oom.device_free),
        (Position::Event(6), 1 << 40, Some(1024))
    );
    assert_eq!(p4.report.skipped.get("free_completed"), Some(&1));
    assert_eq!(p4.report.skipped.get("snapshot"), Some(&1));
    assert_eq!(p4.report.live_at_end, 1);
    assert_eq!(p4.segments.len(), 2);
    assert_eq!(
        p4.segments[0].blocks[0].state,
        SnapshotBlockState::ActiveAllocated
    );
    assert_eq!(
        (
            p4.segments[0].allocated_size(),
            p4.segments[0].requested_size()
        ),
        (512, 100)
    );
    assert!(p4.segments[1].is_expandable && p4.segments[1].pool == SegmentPool::Large);
    assert_eq!(p4.device_segments().count(), 2);

    let bytes = p4.export().unwrap();
    check_memory_viz(&bytes).unwrap();
    let back = read_snapshot(&bytes, &opts).unwrap();
    assert_eq!((&back.trace, &back.segments), (&p4.trace, &p4.segments));
    assert!(
        back.allocator_settings
            .unwrap()
            .same_as(p4.allocator_settings.as_ref().unwrap())
    );
    // The trace is on device 0, device 1 is left out of the export: one device trace.
    assert_eq!(back.device_count, 1);
    // Python's own output in both protocols stays within memory_viz's opcodes (a check of the
    // checker: BINPUT in protocol 2, FRAME and MEMOIZE in protocol 4).
    check_memory_viz(&std::fs::read(data("tiny_snapshot_p2.pickle")).unwrap()).unwrap();
    check_memory_viz(&std::fs::read(data("tiny_snapshot_p4.pickle")).unwrap()).unwrap();
}

#[test]
fn rmm_logs_with_clock_and_microsecond_times() {
    let opts = ImportOptions::default();
    let log = read_rmm_csv_file(data("rmm_clock.csv"), &opts).unwrap();
    assert_eq!(
        read_rmm_csv_file(data("rmm_clock.csv.gz"), &opts).unwrap(),
        log
    );
    assert_eq!(log.threads, ["140245", "140246"]);
    let t: Vec<(u32, u64)> = log
        .trace
        .events
        .iter()
        .map(|e| (e.thread, e.time_ns))
        .collect();
    let day = 86_400_000_000_000u64;
    assert_eq!(
        t,
        vec![(0, day - 1_000_000), (1, day + 1_000), (0, day + 2_000)]
    );
    assert_eq!(log.report.alloc_failures.len(), 1);
    assert_eq!(log.report.alloc_failures[0].at, Position::Line(3));
    assert_eq!(log.report.live_at_end, 1);
    let us = read_trace_file(data("rmm_us.csv"), &opts).unwrap();
    assert_eq!(us.format, TraceFormat::RmmCsv);
    assert_eq!(us.trace.events[1].time_ns, 1_795_313_682_992_463_000);
    for log in [log.trace, us.trace] {
        let again = read_rmm_csv(
            &export_rmm_csv(&log, &CsvExportOptions::default()).unwrap(),
            &opts,
        )
        .unwrap();
        assert_eq!(again.trace, log);
    }
}

#[test]
fn allocator_state_exports_as_final_segments() {
    use cuda_caching_allocator::{CachingAllocator, Preset, SimDevice, StreamId};
    for preset in [Preset::Pytorch, Preset::PytorchExpandable] {
        let alloc = CachingAllocator::new(SimDevice::default(), preset.config()).unwrap();
        alloc.record_history(usize::MAX);
        let small = alloc.allocate(1000, StreamId::DEFAULT).unwrap();
        let big = alloc.allocate(30 << 20, StreamId::DEFAULT).unwrap();
        let other = alloc.allocate(5 << 20, StreamId(7)).unwrap();
        let _keep = alloc.allocate(3 << 20, StreamId::DEFAULT).unwrap();
        alloc.free(big.ptr).unwrap();
        alloc.free(small.ptr).unwrap();
        let _ = other;
        let (trace, dropped) = alloc.history();
        assert_eq!(dropped, 0);
        let segments = alloc.snapshot().to_snapshot_segments(0);
        for s in &segments {
            s.check_tiling().unwrap();
        }
        let options = SnapshotExportOptions::default().with_allocator_segments(&alloc.snapshot());
        let bytes = export_snapshot(&trace, &options).unwrap();
        check_memory_viz(&bytes).unwrap();
        let back = read_snapshot(&bytes, &ImportOptions::default()).unwrap();
        assert_eq!(back.segments, segments, "{preset:?}");
        // memory_viz consistency: the allocated blocks are exactly the allocations live at the end.
        let mut active: Vec<(u64, u64)> = segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == SnapshotBlockState::ActiveAllocated)
            .map(|b| (b.address, b.requested_size))
            .collect();
        active.sort_unstable();
        let mut live = std::collections::BTreeMap::new();
        for e in &back.trace.events {
            match e.op {
                TraceOp::Alloc { id, size, addr, .. } => {
                    live.insert(id, (addr.unwrap(), size));
                }
                TraceOp::Free { id } => {
                    live.remove(&id);
                }
                _ => {}
            }
        }
        let mut expected: Vec<(u64, u64)> = live.into_values().collect();
        expected.sort_unstable();
        assert_eq!(active, expected, "{preset:?}");
        // The recorded trace's segment events derive the same segment spans.
        let derived = final_segments(&back.trace, 0).unwrap();
        let spans = |v: &[SnapshotSegment]| {
            v.iter()
                .map(|s| (s.address, s.total_size))
                .collect::<Vec<_>>()
        };
        assert_eq!(spans(&derived), spans(&segments), "{preset:?}");
    }
}

/// An RMM row whose `Pointer` is the text `(nil)` makes no event, whatever its size: an
/// `allocate` or `free` of it is counted in `ImportReport::skipped` (`allocate (nil)`, `free
/// (nil)`), and an `allocate failure` stays a failure in the report. docs/trace-format.md
/// said `(nil)` was read as address 0.
#[test]
fn csv_nil_pointer_rows_are_skipped_and_counted() {
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n\
        0,1,allocate,(nil),0,0\n\
        0,2,allocate,(nil),4096,0\n\
        0,3,free,(nil),4096,0\n\
        0,4,allocate failure,(nil),1024,0\n\
        0,5,allocate,0x0,512,0\n";
    let log = read_rmm_csv(csv, &ImportOptions::default()).unwrap();
    assert_eq!(log.report.skipped.get("allocate (nil)"), Some(&2));
    assert_eq!(log.report.skipped.get("free (nil)"), Some(&1));
    assert_eq!(log.report.alloc_failures.len(), 1);
    // Only the written `0x0` is an allocation, at address 0.
    assert_eq!(log.trace.events.len(), 1);
    assert!(matches!(
        log.trace.events[0].op,
        TraceOp::Alloc {
            addr: Some(0),
            size: 512,
            ..
        }
    ));
}
