//! What the published crate ships and what docs.rs builds, read from `Cargo.toml`: the `include`
//! patterns are anchored at the package root, docs.rs documents every feature with the `docsrs`
//! cfg that marks feature-gated items, release builds carry no debug info, and every feature does
//! something. `cargo publish --dry-run` itself needs the network, so CI does not run it; its last
//! result is in `docs/testing.md`.

use std::path::Path;

use toml::{Table, Value};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifest() -> Table {
    std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap()
}

fn table<'a>(t: &'a Table, path: &[&str]) -> &'a Table {
    path.iter().fold(t, |t, key| {
        t.get(*key)
            .and_then(Value::as_table)
            .unwrap_or_else(|| panic!("Cargo.toml: no table [{}]", path.join(".")))
    })
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

/// Every `.rs` file under `dir`, concatenated.
fn sources(dir: &Path, out: &mut String) {
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

#[test]
fn include_patterns_are_anchored_at_the_package_root() {
    let m = manifest();
    let include = strings(&table(&m, &["package"])["include"]);
    assert!(include.contains(&"/src/**/*") && include.contains(&"/tests/**/*"));
    for pattern in include {
        // Regression (#15): an unanchored pattern matches at any depth, so `README.md` shipped
        // `gpu/probes/README.md` too.
        assert!(
            pattern.starts_with('/'),
            "Cargo.toml: include pattern {pattern:?} is not anchored: it matches in every folder"
        );
    }
}

#[test]
fn docs_rs_builds_every_feature_with_the_docsrs_cfg() {
    let m = manifest();
    let docs_rs = table(&m, &["package", "metadata", "docs", "rs"]);
    assert_eq!(docs_rs.get("all-features"), Some(&Value::Boolean(true)));
    assert_eq!(strings(&docs_rs["rustdoc-args"]), ["--cfg", "docsrs"]);
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    assert!(lib.contains("#![cfg_attr(docsrs, feature(doc_cfg))]"));
    let package = table(&m, &["package"]);
    for key in [
        "repository",
        "homepage",
        "documentation",
        "readme",
        "license",
    ] {
        assert!(package.contains_key(key), "Cargo.toml: no package.{key}");
    }
}

#[test]
fn release_builds_carry_no_debug_info() {
    let m = manifest();
    let profiles = table(&m, &["profile"]);
    // `[profile.release]` keeps cargo's default (no debug info), or says so.
    if let Some(release) = profiles.get("release").and_then(Value::as_table) {
        let debug = release.get("debug");
        assert!(
            matches!(
                debug,
                None | Some(Value::Boolean(false)) | Some(Value::Integer(0))
            ),
            "[profile.release] debug = {debug:?}"
        );
    }
    // Profilers get line tables from the bench and `profiling` profiles instead.
    assert_eq!(
        table(&m, &["profile", "bench"]).get("debug"),
        Some(&Value::Integer(1))
    );
    assert_eq!(
        table(&m, &["profile", "profiling"]).get("inherits"),
        Some(&Value::String("release".into()))
    );
}

/// Regression (#15): the `arbitrary` feature enabled an optional dependency that no code used.
#[test]
fn every_feature_does_something_and_the_docs_list_it() {
    let m = manifest();
    let features = table(&m, &["features"]);
    let mut code = String::new();
    sources(&root().join("src"), &mut code);
    let gated = |name: &str| code.contains(&format!("feature = \"{name}\""));
    let used_dep = |dep: &str| code.contains(&format!("{}::", dep.replace('-', "_")));
    // A feature does something when code is gated on it, it enables a dependency that code
    // uses, a dependency's feature, or another feature that does something.
    fn effective(
        name: &str,
        features: &Table,
        gated: &dyn Fn(&str) -> bool,
        used_dep: &dyn Fn(&str) -> bool,
    ) -> bool {
        gated(name)
            || strings(&features[name])
                .iter()
                .any(|item| match item.strip_prefix("dep:") {
                    Some(dep) => used_dep(dep),
                    None if item.contains('/') => true,
                    None => effective(item, features, gated, used_dep),
                })
    }
    let overview = std::fs::read_to_string(root().join("docs/overview.md")).unwrap();
    for name in features.keys().filter(|n| *n != "default") {
        assert!(
            effective(name, features, &gated, &used_dep),
            "feature `{name}` gates no code and enables nothing that code uses"
        );
        assert!(
            overview.contains(&format!("`{name}`")),
            "docs/overview.md's feature list lacks `{name}`"
        );
    }
    assert!(features.contains_key("cuda") && features.contains_key("trace-io"));
}
