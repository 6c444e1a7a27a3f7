//! Adversarial review of the researcher tools (`cca`, replay, trace import): each test failed on
//! the code before its fix.
#![cfg(feature = "trace-io")]

use std::path::PathBuf;

use cuda_caching_allocator::trace::{ImportOptions, read_rmm_csv, read_trace};

/// Writes `contents` to a fresh file `name` under the tests' scratch folder.
#[allow(dead_code)]
fn scratch_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tools_review");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// An RMM log's header is its first non-blank line (`docs/trace-format.md` 2.3), and
/// `read_rmm_csv` reads a log that starts with blank lines; `read_trace` (and so every `cca`
/// command) refused the same bytes as "neither a PyTorch snapshot pickle nor an RMM CSV log".
#[test]
fn a_csv_log_after_blank_lines_is_detected_as_one() {
    let log = b"\n\r\n  \nThread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,100,0\n";
    let direct = read_rmm_csv(log, &ImportOptions::strict()).unwrap();
    let detected = read_trace(log, &ImportOptions::strict()).unwrap();
    assert_eq!(detected.trace, direct.trace);
    // With a byte-order mark before the blank lines too.
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend_from_slice(log);
    assert_eq!(
        read_trace(&bom, &ImportOptions::strict()).unwrap().trace,
        direct.trace
    );
}
