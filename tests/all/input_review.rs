//! Bad input outside the allocation core, from an adversarial review; each test failed on the
//! code before its fix: snapshot pickles whose dicts are shared by memo references (work grew
//! with entries × keys), an export to an impossible device ordinal (a panic), builder sizes that
//! did not come back through `to_settings`, RMM's null pointer taken as an address, and an
//! expandable page larger than the device.
#![cfg(feature = "trace-io")]

use std::io::Write as _;

use cuda_caching_allocator::trace::*;
use cuda_caching_allocator::*;

fn bare(c: AllocatorConfig) -> AllocatorConfig {
    AllocatorConfig {
        settings: String::new(),
        ..c
    }
}

fn gzipped(bytes: &[u8]) -> usize {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(bytes).unwrap();
    e.finish().unwrap().len()
}

/// A snapshot whose `device_traces[0]` holds `n` references (memo gets, 2 bytes each) to one
/// dict: an unknown action and `k` junk integer keys.
fn shared_entry_snapshot(k: u32, n: u32) -> Vec<u8> {
    let mut b = vec![0x80u8, 4, b'}', 0x8c, 13];
    b.extend_from_slice(b"device_traces");
    b.extend_from_slice(b"]]}\x94("); // outer list, inner list, the dict (memo 0), MARK
    b.extend_from_slice(b"\x8c\x06action\x8c\x01x");
    for j in 0..k {
        b.push(b'J');
        b.extend_from_slice(&(j as i32).to_le_bytes());
        b.push(b'N');
    }
    b.extend_from_slice(b"u0("); // SETITEMS, POP the dict, MARK
    for _ in 0..n {
        b.extend_from_slice(b"h\x00");
    }
    b.extend_from_slice(b"eas."); // APPENDS, APPEND, SETITEM, STOP
    b
}

/// A snapshot whose `segments` list holds `n` references to one segment dict with `k` junk keys.
fn shared_segment_snapshot(k: u32, n: u32) -> Vec<u8> {
    let mut b = vec![0x80u8, 4, b'}', 0x8c, 13];
    b.extend_from_slice(b"device_traces");
    b.extend_from_slice(b"]s\x8c\x08segments]}\x94(");
    b.extend_from_slice(b"\x8c\x07addressK\x01\x8c\x0atotal_sizeK\x01");
    for j in 0..k {
        b.push(b'J');
        b.extend_from_slice(&(j as i32).to_le_bytes());
        b.push(b'N');
    }
    b.extend_from_slice(b"u0(");
    for _ in 0..n {
        b.extend_from_slice(b"h\x00");
    }
    b.extend_from_slice(b"es.");
    b
}

/// A pickle memo reference lets one wide dict stand for every entry (or segment), and reading a
/// dict by key visits its items: the work grew with entries × keys (40,000 × 40,000 from 320
/// KB). The import now stops with an error naming the place once the items visited pass 16 per
/// opcode (Note [Scans of shared dicts]).
#[test]
fn snapshot_dicts_shared_by_memo_references_are_refused() {
    for (what, bytes) in [
        ("entries", shared_entry_snapshot(40_000, 40_000)),
        ("segments", shared_segment_snapshot(20_000, 20_000)),
    ] {
        let n = bytes.len();
        let z = gzipped(&bytes);
        let e = read_snapshot(&bytes, &ImportOptions::default()).unwrap_err();
        assert!(
            e.to_string().contains("shared references"),
            "{what} ({n} bytes, {z} gzipped): {e}"
        );
    }
    // One shared dict of a few keys under a few entries is far within the budget.
    assert!(read_snapshot(&shared_entry_snapshot(4, 8), &ImportOptions::default()).is_ok());
}

/// the export's device ordinal sizes a vector of empty device traces unchecked.
#[test]
fn snapshot_export_to_an_impossible_device_is_an_error() {
    let mut t = Trace::new(TraceSource::Synthetic);
    t.push(TraceOp::Alloc {
        id: 0,
        size: 512,
        stream: 0,
        addr: None,
    });
    let r = std::panic::catch_unwind(|| {
        export_snapshot(
            &t,
            &SnapshotExportOptions::default().with_device(usize::MAX),
        )
    });
    assert!(
        matches!(r, Ok(Err(_))),
        "export_snapshot with device usize::MAX panicked instead of returning an error"
    );
}

/// sizes the builder accepts do not survive `to_settings` → `parse`, and the builder
/// and the parser give different configurations for the same number of MiB.
#[test]
fn builder_sizes_round_trip_through_to_settings() {
    let built = [
        AllocatorConfig::builder()
            .max_non_split_rounding_mb(usize::MAX)
            .build()
            .unwrap(),
        AllocatorConfig::builder()
            .expandable_min_growth_mb(usize::MAX)
            .build()
            .unwrap(),
    ];
    let mut mismatches = Vec::new();
    for c in built {
        let s = c.to_settings();
        let back = AllocatorConfig::parse(&s).unwrap();
        if bare(back.clone()) != bare(c.clone()) {
            mismatches.push(format!(
                "{s}: max_non_split_rounding {} -> {}, expandable_min_growth {} -> {}",
                c.max_non_split_rounding,
                back.max_non_split_rounding,
                c.expandable_min_growth,
                back.expandable_min_growth
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "parse(to_settings(c)) != c:\n{}",
        mismatches.join("\n")
    );
}

/// the RMM importer keys allocations by address, and the null pointer `(nil)` (0,
/// what RMM's resources return for a zero-byte request) is taken as a real, live address.
#[test]
fn csv_null_pointer_is_not_a_live_address() {
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n\
        0,1,allocate,(nil),0,0\n\
        0,2,allocate,(nil),0,0\n\
        0,3,free,(nil),0,0\n\
        0,4,free,(nil),0,0\n";
    let strict = read_rmm_csv(csv, &ImportOptions::default());
    assert!(
        strict.is_ok(),
        "two zero-byte allocations at (nil): {}",
        strict.unwrap_err()
    );
    let lenient = read_rmm_csv(csv, &ImportOptions::lenient()).unwrap();
    assert_eq!(
        (lenient.report.rebound_addresses, lenient.report.live_at_end),
        (0, 0)
    );
    // Only the text `(nil)` is the null pointer: an address 0 of another format, exported as
    // `0x0`, comes back as it was (the `trace_parse` fuzz target's round trip found the first
    // version of this fix dropping it).
    let mut t = Trace::new(TraceSource::Synthetic);
    t.push(TraceOp::Alloc {
        id: 0,
        size: 100,
        stream: 0,
        addr: Some(0),
    });
    let csv = export_rmm_csv(&t, &CsvExportOptions::default()).unwrap();
    let back = read_rmm_csv(&csv, &ImportOptions::default()).unwrap();
    assert_eq!(
        back.trace.events.len(),
        1,
        "{}",
        String::from_utf8_lossy(&csv)
    );
}

/// an expandable page larger than the device is accepted, and every large
/// allocation then fails with an out-of-memory error that asks for the wrong size, blames a
/// full device with all of it free, and names no key.
#[test]
fn expandable_page_larger_than_the_device_is_named() {
    let config =
        AllocatorConfig::parse("cca_preset:default,cca_large_page_size_mb:1048576").unwrap();
    let alloc = match CachingAllocator::new(SimDevice::default(), config) {
        Err(e) => {
            assert!(e.to_string().contains("cca_large_page_size_mb"), "{e}");
            return;
        }
        Ok(a) => a,
    };
    let e = alloc
        .allocate(3 << 20, StreamId(0))
        .unwrap_err()
        .to_string();
    assert!(!e.contains("the device is full"), "80 GiB free, yet: {e}");
    assert!(
        e.contains("cca_large_page_size_mb") || e.contains("1024.00 GiB"),
        "{e}"
    );
}
