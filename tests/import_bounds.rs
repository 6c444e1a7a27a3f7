//! Trace import is bounded in memory (#14): a gzip bomb and pickle memo bombs, a few KiB to a
//! few hundred KiB each and built here, fail fast with [`TraceIoError::TooLarge`] (naming the
//! limit and how to raise it) while this thread's heap stays within a small multiple of the
//! limit. Before, a 2 MB `.gz` decompressed to 4 GB before the format was even detected, and an
//! 8 KB `.pickle.gz` asked for 32 GiB and aborted the process.
//!
//! Its own test binary: a counting global allocator tracks the peak heap of the calling thread,
//! and the tests run one at a time on it.
#![cfg(feature = "trace-io")]
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

use cuda_caching_allocator::trace::{ImportOptions, TraceIoError, read_snapshot, read_trace};

/// Counts this thread's live and peak heap bytes.
struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn track(grow: usize, shrink: usize) {
    // `try_with`: no counting while the thread-locals are being torn down.
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add(grow).saturating_sub(shrink);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counting
// touches only const-initialised thread-locals of plain integers (no allocation, no reentry).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size(), 0);
        // SAFETY: forwarded unchanged; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(0, layout.size());
        // SAFETY: `ptr` came from `System` through `alloc`/`realloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size, layout.size());
        // SAFETY: as for `dealloc`; `new_size` is the caller's, forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns its result with the peak heap growth of this thread meanwhile.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get) - base)
}

const MIB: usize = 1 << 20;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn assert_too_large(err: &TraceIoError, limit: u64) {
    assert!(
        matches!(err, TraceIoError::TooLarge { limit: l, .. } if *l == limit),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!("import limit of {limit} bytes"))
            && text.contains("ImportOptions::with_max_bytes")
            && text.contains("--max-import-bytes"),
        "{text}"
    );
}

/// 1 GiB of CSV-looking text from 1024 concatenated gzip members of 1 MiB each (about 1 MB of
/// input): the import stops one byte past a 16 MiB limit.
#[test]
fn a_gzip_bomb_stops_at_the_limit() {
    let mut member = b"Thread,Time,Action,Pointer,Size,Stream\n".to_vec();
    member.resize(MIB, b' ');
    let member = gzip(&member);
    let bomb: Vec<u8> = member
        .iter()
        .copied()
        .cycle()
        .take(member.len() * 1024)
        .collect();
    assert!(bomb.len() < 2 * MIB, "{} bytes", bomb.len());
    let limit = 16 * MIB as u64;
    let options = ImportOptions::default().with_max_bytes(limit);
    let (res, peak) = peak_during(|| read_trace(&bomb, &options));
    assert_too_large(&res.unwrap_err(), limit);
    assert!(peak < 3 * limit as usize, "peak heap {peak} bytes");
    // The same input within a large enough limit decompresses (and then fails as a CSV log
    // without rows' columns would: whatever it is, not the limit).
    let member_only = ImportOptions::default().with_max_bytes(2 * MIB as u64);
    let err = read_trace(&member, &member_only).err();
    assert!(
        !matches!(err, Some(TraceIoError::TooLarge { .. })),
        "{err:?}"
    );
}

// ---- a hand-assembled pickle ------------------------------------------------------------------

fn unicode(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'X'); // BINUNICODE
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s);
}

/// `{"device_traces": [[entry, entry, ...]], "allocator_settings": [tag, tag, ...]}` where the
/// one `segment_alloc` entry (with a `tag_len`-byte `user_metadata`) is referenced `refs` times
/// through the memo, and the allocator settings list references the tag string `settings_refs`
/// times.
fn memo_bomb(tag_len: usize, refs: usize, settings_refs: usize) -> Vec<u8> {
    let mut p = vec![0x80, 4, b'}']; // PROTO 4, EMPTY_DICT
    unicode(&mut p, b"device_traces");
    p.extend_from_slice(b"]]}("); // outer list, inner list, entry dict, MARK
    unicode(&mut p, b"action");
    unicode(&mut p, b"segment_alloc");
    for k in ["addr", "size", "stream", "time_us"] {
        unicode(&mut p, k.as_bytes());
        p.extend_from_slice(b"K\x01"); // BININT1 1
    }
    unicode(&mut p, b"user_metadata");
    unicode(&mut p, &vec![b't'; tag_len]);
    p.push(0x94); // MEMOIZE: memo 0 = the tag
    p.push(b'u'); // SETITEMS
    p.push(0x94); // MEMOIZE: memo 1 = the entry
    p.push(b'a'); // APPEND it to the inner list
    p.push(b'(');
    for _ in 1..refs {
        p.extend_from_slice(b"h\x01"); // BINGET 1
    }
    p.push(b'e'); // APPENDS
    p.push(b'a'); // inner list into the outer one
    p.push(b's'); // root["device_traces"] = outer
    unicode(&mut p, b"allocator_settings");
    p.extend_from_slice(b"](");
    for _ in 0..settings_refs {
        p.extend_from_slice(b"h\x00"); // BINGET 0
    }
    p.extend_from_slice(b"es."); // APPENDS, SETITEM, STOP
    p
}

/// 64 KiB tags copied into 100,000 events ask for 6.5 GB from a 260 KB pickle (a few KiB
/// gzipped); under a 64 MiB limit the import stops after about a thousand events.
#[test]
fn a_pickle_memo_bomb_in_the_trace_stops_at_the_limit() {
    let bomb = memo_bomb(64 << 10, 100_000, 0);
    let packed = gzip(&bomb);
    assert!(packed.len() < 16 << 10, "{} bytes gzipped", packed.len());
    let limit = 64 * MIB as u64;
    let options = ImportOptions::default().with_max_bytes(limit);
    for input in [&bomb, &packed] {
        let (res, peak) = peak_during(|| read_snapshot(input, &options));
        assert_too_large(&res.unwrap_err(), limit);
        assert!(peak < 3 * limit as usize, "peak heap {peak} bytes");
    }
    // A few references are fine, and their bytes are accounted for.
    let small = read_snapshot(&memo_bomb(64 << 10, 4, 0), &options).unwrap();
    assert_eq!(small.trace.events.len(), 4);
    assert!(small.report.materialised_bytes >= 4 * (64 << 10));
}

/// The same through the values kept as they are (`allocator_settings`).
#[test]
fn a_pickle_memo_bomb_in_the_settings_stops_at_the_limit() {
    let limit = 64 * MIB as u64;
    let options = ImportOptions::default().with_max_bytes(limit);
    // 20,000 references to a 64 KiB string: 1.3 GB from 100 KB.
    let bomb = memo_bomb(64 << 10, 1, 20_000);
    let (res, peak) = peak_during(|| read_snapshot(&bomb, &options));
    assert_too_large(&res.unwrap_err(), limit);
    assert!(peak < 3 * limit as usize, "peak heap {peak} bytes");
}
