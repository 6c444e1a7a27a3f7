//! `docs/configuration.md` against the parser and the presets: every key of its two tables
//! parses; each documented range holds at its bounds; each documented default is PyTorch's
//! (`AllocatorConfig::pytorch()`), and the crate's default differs from it exactly where a row
//! says "X in the default"; each named field exists; every key `to_settings` can write has a
//! row; the default's configuration string and `lean-fast`'s keys are the presets' own.

use std::collections::BTreeSet;

use cuda_caching_allocator::{AllocatorConfig, PageReuse, Preset};

fn doc() -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap()
}

/// One row of a key table.
#[derive(Debug)]
struct Row {
    line: usize,
    keys: Vec<String>,
    value: String,
    field: String,
}

/// The cells of a table row, split on `|` but not on `\|`, with `\|` read as `|`.
fn cells(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = line.trim().trim_start_matches('|').chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cur.push('|');
                chars.next();
            }
            '|' => out.push(std::mem::take(&mut cur).trim().to_owned()),
            _ => cur.push(c),
        }
    }
    out
}

/// The code spans of a text.
fn spans(text: &str) -> Vec<String> {
    text.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect()
}

/// The rows of the tables whose header is `| key | value (default) | field | meaning |`.
fn rows(doc: &str) -> Vec<Row> {
    let mut out = Vec::new();
    let mut in_table = false;
    for (i, line) in doc.lines().enumerate() {
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let c = cells(line);
        if c.first().map(String::as_str) == Some("key") {
            in_table = c.get(1).map(String::as_str) == Some("value (default)");
            continue;
        }
        if !in_table || c[0].starts_with("---") {
            continue;
        }
        assert_eq!(c.len(), 4, "docs/configuration.md:{}: {line}", i + 1);
        out.push(Row {
            line: i + 1,
            keys: spans(&c[0]),
            value: c[1].clone(),
            field: c[2].trim_matches('`').to_owned(),
        });
    }
    out
}

fn parse(key: &str, value: &str) -> Result<AllocatorConfig, String> {
    AllocatorConfig::parse(&format!("{key}:{value}")).map_err(|e| e.to_string())
}

/// The `key:value` items of a configuration's `to_settings` string.
fn items(c: &AllocatorConfig) -> Vec<(String, String)> {
    let s = c.to_settings();
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for ch in s.chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out.into_iter()
        .map(|i| {
            let (k, v) = i.split_once(':').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn value_of(c: &AllocatorConfig, key: &str) -> Option<String> {
    items(c).into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// A value cell split into its range and its last parenthesized group (the defaults).
fn range_and_default(value: &str) -> (&str, Option<&str>) {
    let Some(body) = value.strip_suffix(')') else {
        return (value, None);
    };
    let mut depth = 0;
    for (i, ch) in body.char_indices().rev() {
        match ch {
            ')' => depth += 1,
            '(' if depth == 0 => return (body[..i].trim(), Some(&body[i + 1..])),
            '(' => depth -= 1,
            _ => {}
        }
    }
    panic!("unbalanced parentheses in {value:?}")
}

fn is_literal(v: &str) -> bool {
    v == "True" || v == "False" || (!v.is_empty() && v.parse::<f64>().is_ok())
}

/// The bounds of an interval written `open a, b close` (`[0.5, 1]`, `(0, 1)`).
fn interval(range: &str, open: char, close: char) -> Option<(f64, f64)> {
    let (a, b) = range
        .strip_prefix(open)?
        .strip_suffix(close)?
        .split_once(", ")?;
    Some((a.parse().unwrap(), b.parse().unwrap()))
}

/// Checks the documented range at its bounds; returns false when the cell names no range this
/// test knows.
fn check_range(at: &str, key: &str, range: &str) -> bool {
    let ok = |v: &str| assert!(parse(key, v).is_ok(), "{at}: {key}:{v} refused");
    let refused = |v: &str| assert!(parse(key, v).is_err(), "{at}: {key}:{v} accepted");
    let range = range.trim_start_matches("MiB").trim();
    if let Some(n) = range.strip_prefix("≥ ") {
        let n: u64 = n.parse().unwrap();
        ok(&n.to_string());
        if n > 0 {
            refused(&(n - 1).to_string());
        }
    } else if let Some(n) = range.strip_prefix("> ") {
        let n: u64 = n.parse().unwrap();
        refused(&n.to_string());
        ok(&(n + 1).to_string());
    } else if let Some((a, b)) = interval(range, '[', ']') {
        ok(&a.to_string());
        ok(&b.to_string());
        refused(&(a - 0.01).to_string());
        refused(&(b + 0.01).to_string());
    } else if let Some((a, b)) = interval(range, '(', ')') {
        refused(&a.to_string());
        refused(&b.to_string());
        ok(&((a + b) / 2.0).to_string());
    } else if range == "bool" || range == "`True`/`False`" {
        ok("True");
        ok("False");
        refused("true");
    } else if range.starts_with("`N` or `[") {
        // A power of two alone, or in a list (where 0 is taken too).
        ok("4");
        ok("[64:0,>:4]");
        refused("3");
        refused("0");
        refused("[64:3]");
    } else if range == "integer" {
        ok("0");
        ok("8");
        refused("-1");
    } else if range.contains(" | ") {
        for v in spans(range) {
            ok(&v);
        }
        refused("nope");
    } else {
        return false;
    }
    true
}

#[test]
fn every_documented_key_parses_with_its_range_and_default() {
    let doc = doc();
    let rows = rows(&doc);
    assert!(rows.len() >= 25, "only {} rows found", rows.len());
    let pytorch = AllocatorConfig::pytorch();
    let default = AllocatorConfig::default();
    let fields = format!("{pytorch:?}");
    for row in &rows {
        let at = format!("docs/configuration.md:{}", row.line);
        assert!(!row.keys.is_empty(), "{at}: no key");
        for key in &row.keys {
            let e = parse(key, "x").err().unwrap_or_default();
            assert!(
                !e.contains("Unrecognized key"),
                "{at}: the parser does not know `{key}`: {e}"
            );
        }
        if row.field == "—" {
            continue;
        }
        let key = row.keys[0].as_str();
        assert!(
            fields.contains(&format!(" {}: ", row.field)),
            "{at}: AllocatorConfig has no field `{}`",
            row.field
        );
        let (range, defaults) = range_and_default(&row.value);
        assert!(
            check_range(&at, key, range),
            "{at}: unknown range {range:?}"
        );
        let defaults = defaults.unwrap_or_else(|| panic!("{at}: no default in {:?}", row.value));
        let (base, in_default) = match defaults.split_once("; ") {
            Some((b, d)) => (b, d.strip_suffix(" in the default")),
            None => (defaults, None),
        };
        let (base, every_preset) = match base.split_once(", ") {
            Some((b, rest)) => {
                assert_eq!(rest, "in every preset", "{at}");
                (b, true)
            }
            None => (base, false),
        };
        // PyTorch's default: a literal value parses to PyTorch's defaults (words such as
        // "unlimited" or "one page" are read by people only).
        let base = base.trim_matches('`');
        let parsed = parse(key, base);
        if is_literal(base) || parsed.is_ok() {
            let c = parsed.unwrap_or_else(|e| panic!("{at}: {key}:{base} refused: {e}"));
            assert_eq!(
                c.to_settings(),
                "",
                "{at}: {key}:{base} is not PyTorch's default"
            );
        }
        // The crate's default: where the row says so, and only there.
        match in_default {
            Some(d) => {
                let d = d.trim_matches('`');
                let c = AllocatorConfig::parse(&format!("cca_preset:default,{key}:{d}"))
                    .unwrap_or_else(|e| panic!("{at}: {key}:{d} refused: {e}"));
                assert_eq!(
                    c.to_settings(),
                    default.to_settings(),
                    "{at}: the default's {key} is not {d}"
                );
                assert!(value_of(&default, key).is_some(), "{at}: {key}");
            }
            None => assert_eq!(
                value_of(&default, key),
                None,
                "{at}: the default sets {key}; the row says nothing of it"
            ),
        }
        if every_preset {
            for p in Preset::ALL {
                assert_eq!(
                    value_of(&p.config(), key),
                    None,
                    "{at}: preset {p} sets {key}"
                );
            }
        }
    }
}

/// Every key `to_settings` writes, for a configuration that differs from PyTorch's defaults in
/// every field, has a row.
#[test]
fn every_key_the_crate_writes_is_documented() {
    let documented: BTreeSet<String> = rows(&doc()).into_iter().flat_map(|r| r.keys).collect();
    let all = AllocatorConfig {
        max_split_size: 64 << 20,
        max_non_split_rounding: 64 << 20,
        large_segment_size: 64 << 20,
        roundup_power2_divisions: [4; 16],
        garbage_collection_threshold: 0.5,
        expandable_segments: true,
        per_process_memory_fraction: 0.5,
        release_lock_on_cudamalloc: true,
        throw_on_cudamalloc_oom: true,
        graph_capture_record_stream_reuse: true,
        expandable_large_page_size: Some(2 << 20),
        expandable_max_handle_size: Some(8 << 20),
        expandable_min_growth: 4 << 20,
        expandable_handle_per_growth: true,
        page_reuse: PageReuse::Device,
        page_reuse_slack: 0.5,
        page_reuse_fence: true,
        page_lending: true,
        unmap_helper: true,
        page_move_budget: 3,
        precise_fraction_cap: true,
        fast_path: true,
        cross_stream_reuse: true,
        borrow_blocks: true,
        settings: String::new(),
    };
    let written = items(&all);
    assert_eq!(written.len(), 24, "{}", all.to_settings());
    for (key, _) in written {
        assert!(
            documented.contains(&key),
            "`{key}` has no row in docs/configuration.md"
        );
    }
}

/// The `cca_preset` row names every preset; the configuration string the text gives for
/// `AllocatorConfig::default()` and the keys it gives for `lean-fast` are the presets' own.
#[test]
fn presets_as_documented() {
    let doc = doc();
    let row = rows(&doc)
        .into_iter()
        .find(|r| r.keys == ["cca_preset"])
        .unwrap();
    let names: BTreeSet<String> = spans(&row.value).into_iter().collect();
    let known: BTreeSet<String> = Preset::ALL.iter().map(|p| p.name().to_owned()).collect();
    assert_eq!(names, known);

    let line = doc
        .lines()
        .find(|l| l.starts_with("| `cca_preset`"))
        .unwrap();
    let lean = line
        .split("`lean-fast` is the default with `")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .unwrap();
    let c = AllocatorConfig::parse(&format!("cca_preset:default,{lean}")).unwrap();
    assert_eq!(c.to_settings(), Preset::LeanFast.config().to_settings());

    // "`AllocatorConfig::default()` is `...,`\n`...` on top of PyTorch's defaults": the spans
    // between the first and " on top of", joined.
    let from = doc.find("`AllocatorConfig::default()` is `").unwrap();
    let text = &doc[from..];
    let text = &text[..text.find(" on top of").unwrap()];
    let string: String = spans(text).into_iter().skip(1).collect();
    assert_eq!(string, AllocatorConfig::default().to_settings());
    assert_eq!(
        AllocatorConfig::parse(&string).unwrap().matching_preset(),
        Some(Preset::Default)
    );
}
