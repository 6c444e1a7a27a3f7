//! The port pairs of `examples/ports`: every program's two versions (plain cudarc, cached) are
//! compared line by line, the changed lines counted, and the counts checked against the table in
//! `docs/migrating-from-cudarc.md` and against the port's goals: allocation sites only (each
//! changed line is an allocation, a bridge to cudarc's types, or the one line per function that
//! gets the allocator, written out in full so that no `use` line is needed), a median of at most
//! 6 changed lines, none in functions that only take buffers. Needs no GPU and no feature: it
//! reads the sources. `cargo test --test all ports:: -- --nocapture` prints the per-program
//! table and the median.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The diff of one pair, in lines.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PairDiff {
    name: String,
    /// Lines of `plain.rs`.
    lines: usize,
    /// Lines only in `plain.rs` / only in `cached.rs`.
    removed: usize,
    added: usize,
    /// Per hunk the larger of its removed and added lines, summed: a line rewritten in place
    /// counts once.
    changed: usize,
    /// Changed lines outside `fn main` (in the program's other functions and its imports).
    changed_outside_main: usize,
}

fn ports_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/ports")
}

/// The longest common subsequence of `a` and `b`, as pairs of matching indices.
fn lcs(a: &[&str], b: &[&str]) -> Vec<(usize, usize)> {
    let (n, m) = (a.len(), b.len());
    let mut len = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            len[i][j] = if a[i] == b[j] {
                len[i + 1][j + 1] + 1
            } else {
                len[i + 1][j].max(len[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < n && j < m {
        if a[i] == b[j] {
            out.push((i, j));
            i += 1;
            j += 1;
        } else if len[i + 1][j] >= len[i][j + 1] {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// The hunks of the diff from `a` to `b`: (first line of `a`, removed lines, added lines).
fn hunks(a: &[&str], b: &[&str]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    let ends = [(a.len(), b.len())];
    for &(mi, mj) in lcs(a, b).iter().chain(ends.iter()) {
        if mi > i || mj > j {
            out.push((i, mi - i, mj - j));
        }
        i = mi + 1;
        j = mj + 1;
    }
    out
}

fn diff_pair(name: &str, plain: &str, cached: &str) -> PairDiff {
    let a: Vec<&str> = plain.lines().collect();
    let b: Vec<&str> = cached.lines().collect();
    let main_start = a
        .iter()
        .position(|l| l.starts_with("pub(crate) fn main("))
        .unwrap_or_else(|| panic!("{name}/plain.rs has no `pub(crate) fn main(`"));
    let mut d = PairDiff {
        name: name.to_string(),
        lines: a.len(),
        removed: 0,
        added: 0,
        changed: 0,
        changed_outside_main: 0,
    };
    for (at, removed, added) in hunks(&a, &b) {
        d.removed += removed;
        d.added += added;
        d.changed += removed.max(added);
        if at < main_start {
            d.changed_outside_main += removed.max(added);
        }
    }
    d
}

/// Every pair under `examples/ports`, by name.
fn all_pairs() -> Vec<PairDiff> {
    let mut out = Vec::new();
    for entry in fs::read_dir(ports_dir()).unwrap() {
        let path = entry.unwrap().path();
        if !path.is_dir() {
            continue;
        }
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let plain = fs::read_to_string(path.join("plain.rs"))
            .unwrap_or_else(|e| panic!("{name}/plain.rs: {e}"));
        let cached = fs::read_to_string(path.join("cached.rs"))
            .unwrap_or_else(|e| panic!("{name}/cached.rs: {e}"));
        out.push(diff_pair(&name, &plain, &cached));
    }
    out.sort_by(|x, y| x.name.cmp(&y.name));
    out
}

/// The guide's table of the pairs and their median, as the test expects it.
fn table(pairs: &[PairDiff]) -> String {
    let mut s = String::from(
        "| program | lines | changed | removed / added | changed outside `main` |\n\
         | --- | ---: | ---: | ---: | ---: |\n",
    );
    for p in pairs {
        s.push_str(&format!(
            "| `{}` | {} | {} | -{} / +{} | {} |\n",
            p.name, p.lines, p.changed, p.removed, p.added, p.changed_outside_main
        ));
    }
    let changed = pairs.iter().map(|p| p.changed);
    s.push_str(&format!(
        "\nChanged lines: {} to {}, median {}.\n",
        changed.clone().min().unwrap_or(0),
        changed.max().unwrap_or(0),
        median_changed(pairs)
    ));
    s
}

#[test]
fn diff_counts_lines_once_per_rewrite() {
    let plain = "a\nb\nc\nd\n";
    let cached = "a\nB\nc\nx\nd\ne\n";
    let d = diff_pair(
        "t",
        &format!("pub(crate) fn main() {{\n{plain}"),
        &format!("pub(crate) fn main() {{\n{cached}"),
    );
    // b -> B (one rewrite), + x, + e.
    assert_eq!((d.removed, d.added, d.changed), (1, 3, 3));
    assert_eq!(d.changed_outside_main, 0);
    let d = diff_pair(
        "t",
        "use x;\npub(crate) fn main() {\n}\n",
        "use y;\nuse z;\npub(crate) fn main() {\n}\n",
    );
    assert_eq!((d.changed, d.changed_outside_main), (2, 2));
}

#[test]
fn every_pair_is_run_by_the_example() {
    let names: BTreeSet<String> = all_pairs().into_iter().map(|p| p.name).collect();
    let main = fs::read_to_string(ports_dir().join("main.rs")).unwrap();
    let start = main
        .find("pairs!(")
        .expect("main.rs declares its pairs with pairs!(..)");
    let end = start + main[start..].find(");").unwrap();
    let listed: BTreeSet<String> = main[start + "pairs!(".len()..end]
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(
        names, listed,
        "directories under examples/ports vs. pairs!(..) in main.rs"
    );
    assert!(
        names.len() >= 15,
        "at least 15 port pairs, found {}",
        names.len()
    );
}

/// Whether `line` is the allocator's handle as the guide writes it: one statement, with the full
/// path, so that a port needs no `use` line.
fn is_handle_line(line: &str) -> bool {
    let l = line.trim();
    let Some(arg) = l
        .strip_prefix("let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(")
        .and_then(|rest| rest.strip_suffix(")?;"))
    else {
        return false;
    };
    // One stream expression (`&stream`, `stream`): nothing else on the line.
    let name = arg.strip_prefix('&').unwrap_or(arg);
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether `line`, added by a port, is one that the guide's recipe calls for: the allocator's
/// handle, an allocation through it, a capture pool, or a bridge to cudarc's types.
fn is_allocation_site(line: &str) -> bool {
    let l = line.trim();
    is_handle_line(l)
        || [
            "alloc.alloc::<",
            "alloc.alloc_zeros::<",
            "alloc.clone_htod(",
            "alloc.clone_dtod(",
            "alloc.null::<",
            "alloc.capture_pool(",
        ]
        .iter()
        .any(|call| l.contains(call))
        || [".as_cuda_slice()", ".as_cuda_view()", ".as_cuda_view_mut()"]
            .iter()
            .any(|bridge| l.contains(bridge))
        // `pool.end_capture(&stream, flags)` instead of `stream.end_capture(flags)`.
        || l == "let graph = pool"
        || l.starts_with(".end_capture(&stream, ")
}

/// The median of the pairs' changed lines (the upper one of an even count).
fn median_changed(pairs: &[PairDiff]) -> usize {
    let mut changed: Vec<usize> = pairs.iter().map(|p| p.changed).collect();
    changed.sort_unstable();
    changed[changed.len() / 2]
}

/// The goal of #13 for a typical program: at most this many changed lines (the median).
const TYPICAL_PORT_GOAL: usize = 6;

#[test]
fn ports_change_allocation_sites_only() {
    let pairs = all_pairs();
    println!("{}", table(&pairs));
    for entry in fs::read_dir(ports_dir()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let plain = fs::read_to_string(dir.join("plain.rs")).unwrap();
        let cached = fs::read_to_string(dir.join("cached.rs")).unwrap();
        let (a, b): (Vec<&str>, Vec<&str>) = (plain.lines().collect(), cached.lines().collect());
        let kept: BTreeSet<usize> = lcs(&a, &b).into_iter().map(|(_, j)| j).collect();
        // The function each handle line is in: one handle per function at most.
        let mut function = "";
        let mut handles = BTreeSet::new();
        for (j, line) in b.iter().enumerate() {
            if ["fn ", "pub fn ", "pub(crate) fn "]
                .iter()
                .any(|item| line.starts_with(item))
            {
                function = line;
            }
            let added = !kept.contains(&j);
            assert!(
                !added || is_allocation_site(line),
                "{}/cached.rs:{}: a change that is not an allocation site: {line}",
                dir.display(),
                j + 1
            );
            if is_handle_line(line) {
                assert!(added, "{}: the plain version has the handle", dir.display());
                assert!(
                    handles.insert(function),
                    "{}/cached.rs:{}: a second allocator handle in `{function}`",
                    dir.display(),
                    j + 1
                );
            }
        }
        assert!(
            !handles.is_empty(),
            "{}: the port never gets the allocator",
            dir.display()
        );
    }
    let median = median_changed(&pairs);
    println!("median changed lines: {median} (goal: at most {TYPICAL_PORT_GOAL})");
    for p in &pairs {
        assert!(p.changed > 0, "{}: the two versions are identical", p.name);
        assert!(
            p.removed <= p.added,
            "{}: the port removed more than it added",
            p.name
        );
    }
    assert!(
        median <= TYPICAL_PORT_GOAL,
        "a typical port changes {median} lines, more than the goal of {TYPICAL_PORT_GOAL}"
    );
    let buffers_only = pairs.iter().find(|p| p.name == "buffer_fn").unwrap();
    // The functions that only take buffers: no change at all, not even an import.
    assert_eq!(buffers_only.changed_outside_main, 0, "{buffers_only:?}");
}

#[test]
fn the_site_check_rejects_other_changes() {
    assert!(is_allocation_site(
        "    let x = alloc.clone_htod(&stream, &host)?;"
    ));
    assert!(!is_allocation_site("    stream.synchronize()?;"));
    assert!(!is_allocation_site("    let alloc_count = 3;"));
    // The handle: exactly the guide's line, one statement, one stream argument.
    let handle =
        "    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;";
    assert!(is_handle_line(handle) && is_allocation_site(handle));
    assert!(is_handle_line(
        "let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(stream)?;"
    ));
    for other in [
        "use cuda_caching_allocator::interop::CudaAllocator;",
        "let alloc = CudaAllocator::for_stream(&stream)?;",
        "let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?; \
         stream.synchronize()?;",
        "let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&s)?; let y = 1;",
        "let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&{ f(); s })?;",
        "let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream()?;",
    ] {
        assert!(!is_handle_line(other), "{other}");
    }
    assert!(!is_allocation_site(
        "use cuda_caching_allocator::interop::CudaAllocator;"
    ));
}

#[test]
fn functions_that_only_take_buffers_do_not_change() {
    let dir = ports_dir().join("buffer_fn");
    let plain = fs::read_to_string(dir.join("plain.rs")).unwrap();
    let cached = fs::read_to_string(dir.join("cached.rs")).unwrap();
    let functions = |s: &str| -> String {
        let start = s.find("\n/// `out = a * x + b * y`").unwrap();
        let end = s.find("\npub(crate) fn main(").unwrap();
        s[start..end].to_string()
    };
    assert_eq!(functions(&plain), functions(&cached));
}

#[test]
fn the_guide_table_matches_the_pairs() {
    let guide = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/migrating-from-cudarc.md"),
    )
    .unwrap();
    let start_marker = "<!-- ports-table: generated by tests/all/ports.rs -->\n";
    let start = guide.find(start_marker).expect("the guide's table marker") + start_marker.len();
    let end = start + guide[start..].find("<!-- /ports-table -->").unwrap();
    let expected = table(&all_pairs());
    assert_eq!(
        guide[start..end],
        expected,
        "docs/migrating-from-cudarc.md's table is stale; it should read:\n{expected}"
    );
}
