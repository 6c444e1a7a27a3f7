//! Checks of the code blocks in `README.md` and `docs/*.md`: every fenced block names its
//! language; every Rust block is compiled as a doc test (no `ignore`, and its file is included by
//! `src/lib.rs`); the shell blocks name features, examples, test targets, `cca` subcommands
//! and files that exist; every `cargo test` command, in a block or a code span, is one that
//! cargo takes (one test-name filter before `--`); and every flag of a `cca` command in a block,
//! and every flag the tool's guides name in a code span, is one `cca` takes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `README.md` and every `docs/*.md`, as paths relative to the package root.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// A fenced code block: where it opens, its info string and its lines.
#[derive(Debug)]
struct Block {
    at: String,
    info: String,
    body: Vec<String>,
}

/// The fenced blocks of a Markdown text (fences may be indented, as in list items).
fn blocks(file: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            match open.take() {
                None => {
                    open = Some(Block {
                        at: format!("{file}:{}", i + 1),
                        info: rest.trim().to_owned(),
                        body: Vec::new(),
                    })
                }
                Some(b) => out.push(b),
            }
        } else if let Some(b) = open.as_mut() {
            b.body.push(trimmed.to_owned());
        }
    }
    assert!(open.is_none(), "{file}: a code block is never closed");
    out
}

fn all_blocks() -> Vec<Block> {
    markdown_files()
        .iter()
        .flat_map(|f| blocks(f, &std::fs::read_to_string(root().join(f)).unwrap()))
        .collect()
}

/// The feature names of `Cargo.toml`.
fn features() -> BTreeSet<String> {
    let toml = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let section = toml.split("\n[features]\n").nth(1).unwrap();
    let section = section.split("\n[").next().unwrap();
    section
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .map(|l| l.split('=').next().unwrap().trim().to_owned())
        .collect()
}

/// The words after `flag` in `line` (`--flag value` or `--flag=value`).
fn values_of<'a>(line: &'a str, flag: &str) -> Vec<&'a str> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if *w == flag {
            if let Some(v) = words.get(i + 1) {
                out.push(*v);
            }
        } else if let Some(v) = w.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            out.push(v);
        }
    }
    out
}

const LANGUAGES: [&str; 8] = ["rust", "sh", "toml", "text", "python", "diff", "json", "c"];

#[test]
fn every_code_block_names_its_language() {
    let blocks = all_blocks();
    assert!(blocks.len() > 30, "only {} blocks found", blocks.len());
    for b in &blocks {
        let lang = b.info.split(',').next().unwrap();
        assert!(
            LANGUAGES.contains(&lang),
            "{}: the block's language is {:?}; name one of {LANGUAGES:?} (an unnamed block is \
             compiled as Rust by rustdoc)",
            b.at,
            b.info
        );
    }
}

#[test]
fn every_rust_block_is_compiled_as_a_doc_test() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let mut rust_files = BTreeSet::new();
    for b in all_blocks() {
        let mut words = b.info.split(',');
        if words.next() != Some("rust") {
            continue;
        }
        for attr in words {
            assert!(
                attr == "no_run" || attr == "should_panic",
                "{}: `{attr}` keeps the block from being compiled or run as a doc test",
                b.at
            );
        }
        rust_files.insert(b.at.split(':').next().unwrap().to_owned());
    }
    assert!(rust_files.contains("README.md"), "{rust_files:?}");
    for file in rust_files {
        assert!(
            lib.contains(&format!("include_str!(\"../{file}\")")),
            "{file} has Rust blocks but src/lib.rs does not include it as a doc test"
        );
    }
}

#[test]
fn shell_blocks_name_features_examples_tests_and_commands_that_exist() {
    let features = features();
    let subcommands = ["replay", "compare", "convert", "plot"];
    let mut checked = 0;
    for b in all_blocks().iter().filter(|b| b.info == "sh") {
        for line in &b.body {
            let line = line.split("  #").next().unwrap();
            for list in values_of(line, "--features") {
                for f in list.split(',') {
                    assert!(features.contains(f), "{}: no feature `{f}`: {line}", b.at);
                    checked += 1;
                }
            }
            for e in values_of(line, "--example") {
                let path: PathBuf = root().join(format!("examples/{e}.rs"));
                assert!(path.exists(), "{}: no example `{e}`: {line}", b.at);
                checked += 1;
            }
            if line.starts_with("cargo test") || line.starts_with("cargo bench") {
                for t in values_of(line, "--test")
                    .into_iter()
                    .chain(values_of(line, "--bench"))
                {
                    let file = if line.starts_with("cargo test") {
                        root().join(format!("tests/{t}"))
                    } else {
                        root().join(format!("benches/{t}.rs"))
                    };
                    assert!(
                        file.exists() || file.with_extension("rs").exists(),
                        "{}: no target `{t}`: {line}",
                        b.at
                    );
                    checked += 1;
                }
            }
            // `cca SUB` and `cargo run ... -- SUB` (of `cca`, not of an example, whose arguments
            // are its own): the subcommand exists; a shipped trace exists.
            let words: Vec<&str> = line.split_whitespace().collect();
            let sub = match words.as_slice() {
                ["cca", sub, ..] => Some(*sub),
                ["cargo", "run", rest @ ..] if !rest.contains(&"--example") => rest
                    .iter()
                    .position(|w| *w == "--")
                    .and_then(|i| rest.get(i + 1).copied()),
                _ => None,
            };
            if let Some(sub) = sub {
                assert!(
                    subcommands.contains(&sub) || sub.starts_with('-'),
                    "{}: `cca {sub}` is not a subcommand: {line}",
                    b.at
                );
                checked += 1;
            }
            for w in &words {
                if w.starts_with("examples/traces/") {
                    assert!(root().join(w).exists(), "{}: no file {w}: {line}", b.at);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 10, "only {checked} names checked");
}

/// Every `cargo test` command the docs give, in code spans and in shell blocks, as the words
/// from `cargo` on (a leading `VAR=value` and the other commands of a chain are left out; a span `... --test ...` that shortens a
/// command given before it reads as `cargo test --test ...`).
fn cargo_test_commands() -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(root().join(&file)).unwrap();
        // Code spans: the text between pairs of backticks on a line (fences are skipped).
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                continue;
            }
            for (n, span) in line.split('`').enumerate() {
                if n % 2 == 1 && span.contains("cargo test") {
                    out.push((format!("{file}:{}", i + 1), span.to_owned()));
                } else if let Some(rest) = span.strip_prefix("... --test ").filter(|_| n % 2 == 1) {
                    out.push((
                        format!("{file}:{}", i + 1),
                        format!("cargo test --test {rest}"),
                    ));
                }
            }
        }
        for b in blocks(&file, &text).iter().filter(|b| b.info == "sh") {
            for line in &b.body {
                let line = line.split("  #").next().unwrap();
                if line.contains("cargo test") {
                    out.push((b.at.clone(), line.to_owned()));
                }
            }
        }
    }
    // One command of a chain (`a && cargo test ...`, `cargo test ... | tee`).
    out.into_iter()
        .flat_map(|(at, line)| {
            line.split(['&', ';', '|'])
                .filter(|cmd| cmd.contains("cargo test"))
                .map(|cmd| {
                    let words: Vec<String> = cmd
                        .split_whitespace()
                        .skip_while(|w| *w != "cargo")
                        .map(str::to_owned)
                        .collect();
                    (at.clone(), words)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `cargo test` takes one test-name filter before `--` (more are cargo's "unexpected argument"
/// error); further filters go after `--`, to the test harness. A filter `MODULE::...` given
/// with `--test all` names a module of `tests/all`.
#[test]
fn cargo_test_commands_take_one_filter_before_the_separator() {
    // cargo's flags of `cargo test` that take a value.
    const WITH_VALUE: [&str; 11] = [
        "--features",
        "-F",
        "--test",
        "--bench",
        "--example",
        "--bin",
        "-p",
        "--package",
        "--profile",
        "--target",
        "--manifest-path",
    ];
    let commands = cargo_test_commands();
    assert!(
        commands.len() >= 20,
        "only {} commands found",
        commands.len()
    );
    for (at, words) in &commands {
        let before: Vec<&String> = words.iter().skip(2).take_while(|w| *w != "--").collect();
        let mut filters = Vec::new();
        let mut skip = false;
        for w in &before {
            if skip {
                skip = false;
            } else if WITH_VALUE.contains(&w.as_str()) {
                skip = true;
            } else if !w.starts_with('-') {
                filters.push(w.as_str());
            }
        }
        assert!(
            filters.len() <= 1,
            "{at}: `{}` gives cargo {} test-name filters before `--` ({filters:?}); cargo takes \
             one: put the others after `--`",
            words.join(" "),
            filters.len()
        );
        let all = values_of(&words.join(" "), "--test").contains(&"all");
        let after = words.iter().skip_while(|w| *w != "--").skip(1);
        for f in filters.iter().copied().chain(after.map(String::as_str)) {
            if let (true, Some((module, _))) = (all, f.split_once("::")) {
                assert!(
                    root().join(format!("tests/all/{module}.rs")).exists(),
                    "{at}: no module tests/all/{module}.rs for the filter `{f}`"
                );
            }
        }
    }
}

/// The flags of `cca SUB`, read from its `--help`.
#[cfg(feature = "cli")]
fn cca_flags(sub: &str) -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cca"))
        .args([sub, "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "cca {sub} --help failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_owned)
        .collect()
}

/// Every flag a `cca` command in a shell block of the docs gives, and every flag a code span of
/// the docs names, is one that `cca` takes (the subcommand's own in a command).
#[cfg(feature = "cli")]
#[test]
fn cca_flags_in_the_docs_exist() {
    let subcommands = ["replay", "compare", "convert", "plot"];
    let flags: std::collections::BTreeMap<&str, BTreeSet<String>> =
        subcommands.iter().map(|s| (*s, cca_flags(s))).collect();
    let any_flags: BTreeSet<String> = flags.values().flatten().cloned().collect();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(root().join(&file)).unwrap();
        for b in blocks(&file, &text).iter().filter(|b| b.info == "sh") {
            // A command continued with `\` is one line.
            let joined = b.body.join("\n").replace("\\\n", " ");
            for line in joined.lines() {
                let line = line.split("  #").next().unwrap();
                let words: Vec<&str> = line.split_whitespace().collect();
                let rest = match words.as_slice() {
                    ["cca", rest @ ..] => rest,
                    ["cargo", "run", rest @ ..] if !rest.contains(&"--example") => {
                        match rest.iter().position(|w| *w == "--") {
                            Some(i) => &rest[i + 1..],
                            None => continue,
                        }
                    }
                    _ => continue,
                };
                let Some(sub) = rest.first().and_then(|s| flags.get(s)) else {
                    continue;
                };
                for w in rest.iter().filter(|w| w.starts_with("--")) {
                    let flag = w.split('=').next().unwrap();
                    assert!(
                        sub.contains(flag),
                        "{}: `cca {}` takes no `{flag}`: {line}",
                        b.at,
                        rest[0]
                    );
                    checked += 1;
                }
            }
        }
    }
    // Code spans naming a flag, in the guides that describe the tool: a span that starts with
    // a flag (`--device cuda`), or a `cca` command (`cca replay --json`, the subcommand's own
    // flags). Spans are read over the whole text, outside fenced blocks, since one may run on
    // to the next line.
    for file in ["docs/researchers-guide.md", "docs/configuration.md"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let mut fenced = false;
        let prose: Vec<&str> = text
            .lines()
            .map(|l| {
                if l.starts_with("```") {
                    fenced = !fenced;
                    return "";
                }
                if fenced { "" } else { l }
            })
            .collect();
        let prose = prose.join("\n");
        let mut line = 1;
        for (n, part) in prose.split('`').enumerate() {
            if n % 2 == 1 {
                let words: Vec<&str> = part.split_whitespace().collect();
                let (takes, named): (&BTreeSet<String>, &[&str]) = match words.as_slice() {
                    ["cca", sub, rest @ ..] if flags.contains_key(sub) => (&flags[sub], rest),
                    ["cca", rest @ ..] => (&any_flags, rest),
                    [first, ..] if first.starts_with("--") => (&any_flags, &words[..]),
                    _ => (&any_flags, &[]),
                };
                for w in named.iter().filter(|w| w.starts_with("--")) {
                    let flag = w
                        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                        .next()
                        .unwrap();
                    assert!(
                        takes.contains(flag),
                        "{file}:{line}: `cca` takes no `{flag}` (`{part}`)"
                    );
                    checked += 1;
                }
            }
            line += part.matches('\n').count();
        }
    }
    assert!(checked >= 40, "only {checked} flags checked");
}
