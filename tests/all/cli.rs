//! The `cca` binary end to end (feature `cli`): the replay device flag, and that `--device cuda`
//! on a machine that cannot run it is a clear error with a non-zero exit, never a panic.
#![cfg(feature = "cli")]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The smallest shipped trace.
fn trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces/resnet50_train.csv.gz")
}

fn cca(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cca"))
        .args(args)
        .output()
        .expect("the cca binary runs")
}

/// Whether this machine can run `--device cuda` (then the error tests do not apply).
fn cuda_works() -> bool {
    #[cfg(feature = "cuda-unpinned")]
    {
        cuda_caching_allocator::backend::cuda::cuda_available()
    }
    #[cfg(not(feature = "cuda-unpinned"))]
    {
        false
    }
}

/// Asserts that `out` is the clear `--device cuda` error of this build: exit status 1, the
/// reason on stderr, nothing on stdout, no panic.
fn assert_clear_cuda_error(out: &Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
    assert!(out.stdout.is_empty(), "{what}: printed a report");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "{what}: {stderr}"
    );
    assert!(
        stderr.starts_with("cca: --device cuda:"),
        "{what}: {stderr}"
    );
    let expected = if cfg!(feature = "cuda-unpinned") {
        "no CUDA driver was found on this machine"
    } else {
        "this cca was built without CUDA support"
    };
    assert!(stderr.contains(expected), "{what}: {stderr}");
}

#[test]
fn cli_replay_on_cuda_without_a_usable_cuda_is_a_clear_error() {
    if cuda_works() {
        println!("skipped: this machine has a working CUDA driver");
        return;
    }
    let t = trace();
    let t = t.to_str().unwrap();
    for args in [
        vec!["replay", t, "--device", "cuda"],
        vec![
            "replay", t, "--device", "cuda:1", "--preset", "pytorch", "--json",
        ],
        vec!["compare", t, "--device", "cuda:0"],
    ] {
        assert_clear_cuda_error(&cca(&args), &args.join(" "));
    }
}

#[test]
fn cli_device_flag_rejects_unknown_devices() {
    let t = trace();
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1"] {
        let out = cca(&["replay", t.to_str().unwrap(), "--device", bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("use sim, cuda or cuda:N"),
            "{bad}: {stderr}"
        );
    }
}

#[test]
fn cli_replay_on_the_simulated_device_reports_wall_time() {
    let t = trace();
    let out = cca(&[
        "replay",
        t.to_str().unwrap(),
        "--device",
        "sim",
        "--preset",
        "pytorch",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"], "sim");
    assert_eq!(v["configuration"], "pytorch");
    // Two fragmentation figures, each under its own name (one name served the first before).
    let ratio = v["fragmentation_ratio"].as_f64().unwrap();
    let at_peak = v["fragmentation_at_peak_reserved"].as_f64().unwrap();
    let (alloc, reserved) = (
        v["peak_allocated_bytes"].as_f64().unwrap(),
        v["peak_reserved_bytes"].as_f64().unwrap(),
    );
    assert!((ratio - (1.0 - alloc / reserved)).abs() < 1e-12);
    assert!((0.0..1.0).contains(&at_peak) && at_peak >= ratio - 1e-12);
    assert!(v.get("fragmentation_at_peak").is_none());
    assert!(
        v["device_description"]
            .as_str()
            .unwrap()
            .starts_with("simulated")
    );
    assert!(v["wall_s"].as_f64().unwrap() > 0.0);
    assert!(v["wall_ns_per_op"].as_f64().unwrap() > 0.0);
    assert!(v["peak_reserved_bytes"].as_u64().unwrap() > 0);
    // The text report names the device and the wall time too.
    let out = cca(&["replay", t.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("device         simulated"), "{text}");
    assert!(text.contains("wall ns per op"), "{text}");
}

/// Host time per operation: by default on the simulated device one operation in 16 is timed
/// (Note [Sampled op times]), `--time-every 1` times every allocation and free; the allocator's
/// decisions are the same either way.
#[test]
fn replay_times_a_sample_of_operations_or_every_one() {
    let t = trace();
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", t.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        let out = cca(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (every, sampled) = (run(&["--time-every", "1"]), run(&[]));
    let ops = every["allocs"].as_u64().unwrap() + every["frees"].as_u64().unwrap();
    assert_eq!(every["ns_per_op_timed"].as_u64().unwrap(), ops);
    let timed = sampled["ns_per_op_timed"].as_u64().unwrap();
    assert!(
        timed > ops / 32 && timed < ops / 8,
        "{timed} of {ops} timed"
    );
    for key in [
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "num_device_alloc",
    ] {
        assert_eq!(every[key], sampled[key], "{key}");
    }
    let out = cca(&["replay", t.to_str().unwrap(), "--time-every", "0"]);
    assert!(!out.status.success());
}

/// Writes `contents` to a fresh file `name` under the tests' scratch folder.
fn scratch_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// Asserts that `out` ended without a panic (exit 101 or a panic message).
fn assert_no_panic(out: &Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(101), "{what}: {stderr}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

/// Regression (#14): the out-of-memory path built the next stream's key with a wrapping add,
/// so a stream handle of `u64::MAX` with a free block in the pool made `BTreeSet::range`
/// panic (exit 101) in `cca replay` and `cca convert --run`.
#[test]
fn cli_oom_on_the_last_stream_handle_does_not_panic() {
    // Two 4 MiB blocks share one 20 MiB segment; freeing one leaves a free block that the
    // OOM path cannot release (its segment is in use), so the pool is not empty there.
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n\
        0,1,allocate,0x1000,4194304,18446744073709551615\n\
        0,2,allocate,0x2000,4194304,18446744073709551615\n\
        0,3,free,0x1000,4194304,18446744073709551615\n\
        0,4,allocate,0x3000,68719476736,0xffffffffffffffff\n";
    let t = scratch_file("last_stream.csv", csv);
    let t = t.to_str().unwrap();
    let out_pickle = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/last_stream.pickle");
    for args in [
        vec!["replay", t, "--device-memory", "16GiB"],
        vec![
            "replay",
            t,
            "--device-memory",
            "16GiB",
            "--preset",
            "pytorch",
        ],
        vec![
            "replay",
            t,
            "--device-memory",
            "16GiB",
            "--preset",
            "pytorch-expandable",
        ],
        vec![
            "convert",
            t,
            out_pickle.to_str().unwrap(),
            "--run",
            "pytorch",
            "--device-memory",
            "16GiB",
        ],
    ] {
        let out = cca(&args);
        assert_no_panic(&out, &args.join(" "));
    }
}

/// Regression (#14): `--reference` with a missing or non-JSON file was ignored (exit 0);
/// `cca plot --width 70000 --height 70000` panicked inside plotters. Both are clear errors now.
#[test]
fn cli_bad_reference_and_plot_sizes_are_errors() {
    let t = trace();
    let t = t.to_str().unwrap();
    let not_json = scratch_file("not_json.json", b"{ this is not json");
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/no_such_reference.json");
    for (reference, says) in [
        (missing.to_str().unwrap(), "no_such_reference.json"),
        (not_json.to_str().unwrap(), "not JSON"),
    ] {
        let out = cca(&["replay", t, "--reference", reference]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{reference}: {stderr}");
        assert!(stderr.starts_with("cca: --reference"), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert_no_panic(&out, reference);
    }
    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/big.png");
    for (w, h) in [("70000", "70000"), ("0", "700"), ("1200", "100000")] {
        let out = cca(&[
            "plot",
            t,
            "-o",
            png.to_str().unwrap(),
            "--width",
            w,
            "--height",
            h,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{w}x{h}: {stderr}");
        assert!(stderr.contains("is not in"), "{w}x{h}: {stderr}");
        assert_no_panic(&out, "plot");
    }
}

/// `--max-import-bytes` bounds the import: the shipped trace fails below its size with the
/// limit named, and imports at the default.
#[test]
fn cli_max_import_bytes_is_the_import_limit() {
    let t = trace();
    let out = cca(&["replay", t.to_str().unwrap(), "--max-import-bytes", "64KiB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("import limit of 65536 bytes") && stderr.contains("--max-import-bytes"),
        "{stderr}"
    );
}

/// Regression (#15): `cca replay ... | head -1` panicked ("failed printing to stdout: Broken
/// pipe", exit 101), as did `--summary` and `compare`. A reader that goes away ends the output
/// quietly with status 0.
#[test]
fn cli_closed_stdout_ends_quietly() {
    let t = trace();
    let t = t.to_str().unwrap();
    for args in [
        vec!["replay", t],
        vec!["replay", t, "--summary"],
        vec!["replay", t, "--json"],
        vec!["compare", t, "--preset", "pytorch"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cca"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Close the read end before cca writes anything (loading the trace takes longer).
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let what = args.join(" ");
        assert_no_panic(&out, &what);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Regression (#15): a replay in which 947 allocations failed out of memory, and a replay of an
/// empty trace, exited 0 with an ordinary table. Both warn on stderr, are marked in the text and
/// the JSON, and exit 1; `--allow-oom` accepts OOMs (not an empty trace).
#[test]
fn cli_failed_runs_do_not_look_like_results() {
    let t = trace();
    let t = t.to_str().unwrap();
    let out = cca(&[
        "replay",
        t,
        "--preset",
        "pytorch",
        "--device-memory",
        "1GiB",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stdout.contains("status         FAILED: "), "{stdout}");
    assert!(stderr.contains("cca: warning: pytorch: "), "{stderr}");
    assert!(stderr.contains("failed out of memory"), "{stderr}");
    let out = cca(&[
        "replay",
        t,
        "--preset",
        "pytorch",
        "--device-memory",
        "1GiB",
        "--json",
        "--allow-oom",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "oom");
    assert_eq!(v["failed"], true);
    assert!(v["num_ooms"].as_u64().unwrap() > 0);
    let out = cca(&["compare", t, "--device-memory", "1GiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAILED: "));

    let empty = scratch_file(
        "empty_trace.csv",
        b"Thread,Time,Action,Pointer,Size,Stream\n",
    );
    let empty = empty.to_str().unwrap();
    for args in [
        vec!["replay", empty],
        vec!["replay", empty, "--allow-oom", "--json"],
    ] {
        let out = cca(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", args.join(" "));
        assert!(stderr.contains("the trace has no allocations"), "{stderr}");
        assert!(!stderr.contains("no allocator history"), "{stderr}");
    }
    // A snapshot without history (taken without _record_memory_history): the note says how to
    // record one.
    let snap = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("cli")
        .join("no_history.pickle");
    let snap = snap.to_str().unwrap();
    let out = cca(&["convert", empty, snap]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cca(&["replay", snap]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the snapshot holds no allocator history"),
        "{stderr}"
    );
    assert!(stderr.contains("_record_memory_history"), "{stderr}");
    let out = cca(&["replay", t, "--json"]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "ok");
}

/// A progress setting that is not a number was ignored without a word; it is named once.
#[test]
fn cli_a_bad_progress_setting_is_named() {
    let t = trace();
    let out = Command::new(env!("CARGO_BIN_EXE_cca"))
        .args(["replay", t.to_str().unwrap(), "--json"])
        .env("CCA_PROGRESS_AFTER_MS", "banana")
        .output()
        .expect("the cca binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(
        stderr
            .matches("CCA_PROGRESS_AFTER_MS=\"banana\" is not a whole number")
            .count(),
        1,
        "{stderr}"
    );
}

/// Regression (#15): `--json --summary` ignored `--summary`, and `80GB` was read as 80 GiB.
#[test]
fn cli_inputs_are_not_silently_ignored() {
    let t = trace();
    let t = t.to_str().unwrap();
    let out = cca(&["replay", t, "--json", "--summary"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    let out = cca(&["replay", t, "--device-memory", "80G"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ambiguous"));
    let out = cca(&["replay", t, "--device-memory", "80GB", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device_memory"], 80_000_000_000u64);
}

/// Regression (#15): `--config S` without `--preset` applied S on top of the crate's default,
/// while `AllocatorConfig::parse(S)` and `CUDA_CACHING_ALLOCATOR_CONF=S` read it on top of
/// PyTorch's. One rule now: a string alone is read as `parse` reads it; with `--preset` it
/// applies on top of the preset; and every report prints the resolved configuration.
#[test]
fn cli_config_string_means_what_parse_reads() {
    use cuda_caching_allocator::AllocatorConfig;
    let t = trace();
    let t = t.to_str().unwrap();
    let json = |args: &[&str]| -> serde_json::Value {
        let out = cca(args);
        assert_eq!(out.status.code(), Some(0), "{}", args.join(" "));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let s = "max_split_size_mb:256";
    let v = json(&["replay", t, "--config", s, "--json"]);
    assert_eq!(
        v["resolved_settings"],
        AllocatorConfig::parse(s).unwrap().to_settings()
    );
    assert_eq!(v["resolved_settings"], s);
    let v = json(&["replay", t, "--preset", "default", "--config", s, "--json"]);
    let on_default = AllocatorConfig::default().with_settings(s).unwrap();
    assert_eq!(v["resolved_settings"], on_default.to_settings());
    let v = json(&[
        "replay",
        t,
        "--config",
        &format!("cca_preset:default,{s}"),
        "--json",
    ]);
    assert_eq!(v["resolved_settings"], on_default.to_settings());
    let v = json(&[
        "replay",
        t,
        "--config",
        "expandable_segments:True",
        "--json",
    ]);
    assert_eq!(v["preset"], "pytorch-expandable");
    let v = json(&["compare", t, "--config", s, "--json"]);
    assert_eq!(v[0]["resolved_settings"], s);
    let out = cca(&["replay", t]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "resolved       {}  (= preset default)",
            AllocatorConfig::default().to_settings()
        )),
        "{text}"
    );
    assert!(text.contains("fragmentation at peak"), "{text}");
    assert!(text.contains("fragmentation ratio"), "{text}");
    assert!(text.contains("measured on this machine"), "{text}");
    assert!(text.contains("segment statistic does not count"), "{text}");
    let help = cca(&["replay", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("With neither --preset nor --config: default"),
        "{help}"
    );
}

/// Regression (#15): error texts a user can act on. An empty file said `starts with ""`; an
/// unmatched free said "import leniently" without naming the flag; a CSV with the wrong columns
/// names the expected header.
#[test]
fn cli_trace_errors_say_what_to_do() {
    let empty = scratch_file("empty_file.csv", b"");
    let out = cca(&["replay", empty.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("empty file"), "{stderr}");
    assert!(!stderr.contains("starts with \"\""), "{stderr}");
    let unmatched = scratch_file(
        "unmatched_free.csv",
        b"Thread,Time,Action,Pointer,Size,Stream\n0,1,free,0x1000,512,0\n",
    );
    let out = cca(&["replay", unmatched.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--lenient"), "{stderr}");
    let other = scratch_file("other.csv", b"when,what,where\n1,2,3\n");
    let out = cca(&["replay", other.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Thread,Time,Action,Pointer,Size,Stream"),
        "{stderr}"
    );
    let out = cca(&[
        "replay",
        trace().to_str().unwrap(),
        "--config",
        "expandable_segments:yes",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("key 'expandable_segments' takes True or False"),
        "{stderr}"
    );
}

/// The texts of an SVG's `<text>` elements.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| t.split_once('>'))
        .filter_map(|(_, rest)| rest.split_once("</text>"))
        .map(|(text, _)| text.trim().to_owned())
        .collect()
}

/// Regression (#15): the plot's legend did not say which line style is which quantity, no peak
/// was marked, and the x axis was the event index even where the trace has timestamps.
#[test]
fn cli_plot_has_a_line_style_key_peak_labels_and_a_time_axis() {
    let t = trace();
    let t = t.to_str().unwrap();
    let svg = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/plot.svg");
    std::fs::create_dir_all(svg.parent().unwrap()).unwrap();
    let svg_arg = svg.to_str().unwrap();
    let plot = |extra: &[&str]| {
        let mut args = vec![
            "plot", t, "-o", svg_arg, "--preset", "pytorch", "--preset", "default",
        ];
        args.extend_from_slice(extra);
        let out = cca(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        svg_texts(&std::fs::read_to_string(&svg).unwrap())
    };
    let texts = plot(&[]);
    for want in [
        "solid line: reserved",
        "dashed line: allocated",
        "pytorch",
        "default",
        "time since the first event (s)",
    ] {
        assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
    }
    // One peak label per configuration, with the peak reserved bytes (the pytorch figure is
    // PyTorch's own peak for this trace, 3.35 GiB).
    let peaks: Vec<&String> = texts.iter().filter(|t| t.starts_with("peak ")).collect();
    assert_eq!(peaks.len(), 2, "{texts:?}");
    assert!(
        peaks.iter().any(|p| *p == "peak 3.35 GiB (pytorch)"),
        "{peaks:?}"
    );
    assert!(peaks.iter().any(|p| p.ends_with("(default)")), "{peaks:?}");
    let texts = plot(&["--x-axis", "event"]);
    assert!(texts.iter().any(|t| t == "event"), "{texts:?}");

    // A trace without timestamps: `auto` falls back to the event index, `time` is an error.
    let untimed = scratch_file(
        "untimed.csv",
        b"Thread,Time,Action,Pointer,Size,Stream\n\
          0,0,allocate,0x1000,4194304,0\n\
          0,0,free,0x1000,4194304,0\n",
    );
    let out = cca(&["plot", untimed.to_str().unwrap(), "-o", svg_arg]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let texts = svg_texts(&std::fs::read_to_string(&svg).unwrap());
    assert!(texts.iter().any(|t| t == "event"), "{texts:?}");
    let out = cca(&[
        "plot",
        untimed.to_str().unwrap(),
        "-o",
        svg_arg,
        "--x-axis",
        "time",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no timestamps"), "{stderr}");
}

/// Regression (#15): a plot to a path that cannot be written printed the backend's Debug dump
/// without the path, after all the replays.
#[test]
fn cli_plot_to_a_bad_path_names_the_path() {
    let t = trace();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/no_such_dir");
    for name in ["memory.png", "memory.svg"] {
        let path = dir.join(name);
        let out = cca(&["plot", t.to_str().unwrap(), "-o", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.starts_with(&format!(
                "cca: cannot write the plot to '{}': ",
                path.display()
            )),
            "{stderr}"
        );
        assert!(!stderr.contains("Os {"), "a Debug dump: {stderr}");
        assert_no_panic(&out, name);
        assert!(!path.exists());
    }
}

/// Regression (#15): loading and converting a large trace printed nothing for seconds. Where
/// stderr is not a terminal, each step that took longer than `CCA_PROGRESS_AFTER_MS` (2 s by
/// default; 0 here, so that the small trace qualifies) gets one line; `--quiet` prints none.
#[test]
fn cli_long_steps_report_progress_unless_quiet() {
    let t = trace();
    let out_path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/progress.csv");
    std::fs::create_dir_all(out_path.parent().unwrap()).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "convert",
            t.to_str().unwrap(),
            out_path.to_str().unwrap(),
            "--run",
            "pytorch",
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_cca"))
            .args(&args)
            .env("CCA_PROGRESS_AFTER_MS", "0")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = run(&[]);
    for step in [
        "cca: loading ",
        "cca: replaying through pytorch: ",
        "cca: writing ",
    ] {
        assert!(stderr.contains(step), "{step} not in {stderr}");
    }
    assert!(stderr.contains("events in "), "{stderr}");
    for quiet in ["--quiet", "-q"] {
        let stderr = run(&[quiet]);
        assert!(!stderr.contains("cca: "), "{quiet}: {stderr}");
        assert!(stderr.starts_with("wrote "), "{quiet}: {stderr}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_cca"))
        .args(["replay", t.to_str().unwrap(), "--quiet"])
        .env("CCA_PROGRESS_AFTER_MS", "0")
        .output()
        .unwrap();
    assert!(out.stderr.is_empty(), "{out:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_cca"))
        .args(["replay", t.to_str().unwrap()])
        .env("CCA_PROGRESS_AFTER_MS", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cca: loading "), "{stderr}");
}

/// Regression: a trace allocation of 1 EB or more (refused before the allocator tries, so
/// PyTorch's `num_ooms` does not count it) vanished from the replay, which then reported `ok`;
/// `cca plot` drew failed runs and exited 0. Both fail now, `plot` still writing the image.
#[test]
fn cli_refused_allocations_fail_the_run_and_plot_says_so() {
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n\
        0,1,allocate,0x10,18446744073709551615,0\n\
        0,2,allocate,0x20,100,0\n\
        0,3,free,0x20,100,0\n";
    let t = scratch_file("exabyte.csv", csv);
    let t = t.to_str().unwrap();
    let out = cca(&["replay", t, "--json"]);
    assert_no_panic(&out, "replay --json");
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "oom");
    assert_eq!(v["failed_allocs"], 1);
    let out = cca(&["replay", t]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("status         FAILED: 1 allocation failed"),
        "{stdout}"
    );
    assert!(stdout.contains("failed allocations"), "{stdout}");

    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/exabyte.png");
    let _ = std::fs::remove_file(&png);
    let p = png.to_str().unwrap();
    let out = cca(&["plot", t, "-o", p]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("failed out of memory"), "{stderr}");
    assert!(png.exists(), "the image is written either way");
    let out = cca(&["plot", t, "-o", p, "--allow-oom"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Regression: what a lenient import skipped, and the failed allocations a recorded run logged,
/// were never shown; they are notes on stderr now, naming the file.
#[test]
fn cli_import_notes_say_what_the_replay_does_not_see() {
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n\
        0,1,allocate,0x10,4096,0\n\
        0,2,free,0x99,4096,0\n\
        0,3,allocate failure,0x0,68719476736,0\n\
        0,4,free,0x10,4096,0\n";
    let t = scratch_file("skipped.csv", csv);
    let t = t.to_str().unwrap();
    let out = cca(&["replay", t, "--lenient", "--quiet"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("skipped.csv: 1 free of an address no live allocation held skipped"),
        "{stderr}"
    );
    assert!(
        stderr.contains("1 allocation that failed in the recorded run"),
        "{stderr}"
    );
    // A clean import prints no note.
    let clean = trace();
    let out = cca(&["replay", clean.to_str().unwrap(), "--quiet"]);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("note:"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Regression: with stderr a closed pipe, `cca`'s warnings panicked (exit 101) instead of
/// ending with the run's own status.
#[test]
fn cli_closed_stderr_does_not_panic() {
    let t = trace();
    let t = t.to_str().unwrap();
    for (args, code) in [
        (vec!["replay", t, "--device-memory", "1GiB"], 1),
        (vec!["replay", "/nonexistent/trace.csv"], 1),
        (vec!["replay", t], 0),
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_cca"))
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(writer)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{}", args.join(" "));
    }
}

/// A snapshot of a two-GPU process holds two allocator histories: `cca` says which one it
/// replays and names the others, `--snapshot-device N` picks one (a missing device and a CSV log
/// are clear errors).
#[test]
fn cli_snapshot_device_picks_one_of_several_histories() {
    use cuda_caching_allocator::trace::{PickleValue, write_pickle};
    const MIB: i128 = 1 << 20;
    let entry = |action: &str, addr: i128, size: i128, t: i128| {
        PickleValue::dict([
            ("action", PickleValue::Str(action.into())),
            ("addr", PickleValue::Int(addr)),
            ("size", PickleValue::Int(size)),
            ("stream", PickleValue::Int(0)),
            ("time_us", PickleValue::Int(t)),
        ])
    };
    // Device 0: 1 MiB live at most; device 1: 8 MiB.
    let dev0 = vec![
        entry("alloc", 1 << 40, MIB, 1),
        entry("free_requested", 1 << 40, MIB, 2),
    ];
    let dev1 = vec![
        entry("alloc", 2 << 40, 4 * MIB, 1),
        entry("alloc", (2 << 40) + 4 * MIB, 4 * MIB, 2),
        entry("free_requested", 2 << 40, 4 * MIB, 3),
    ];
    let snapshot = PickleValue::dict([(
        "device_traces",
        PickleValue::List(vec![PickleValue::List(dev0), PickleValue::List(dev1)]),
    )]);
    let dir = std::env::temp_dir().join(format!("cca-snapshot-device-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("two_gpus.pickle");
    std::fs::write(&path, write_pickle(&snapshot).unwrap()).unwrap();
    let p = path.to_str().unwrap();
    let peak = |out: &Output| {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["peak_live_bytes"].as_u64().unwrap(), stderr)
    };
    let (live, stderr) = peak(&cca(&["replay", p, "--json", "--quiet"]));
    assert_eq!(live, 1 << 20);
    assert!(
        stderr.contains("allocator histories of devices 0, 1; this run reads device 0's")
            && stderr.contains("--snapshot-device N"),
        "{stderr}"
    );
    let (live, stderr) = peak(&cca(&[
        "replay",
        p,
        "--json",
        "--quiet",
        "--snapshot-device",
        "1",
    ]));
    assert_eq!(live, 8 << 20);
    assert!(!stderr.contains("allocator histories"), "{stderr}");
    let out = cca(&["replay", p, "--quiet", "--snapshot-device", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the snapshot has 2 device trace(s); device 2 does not exist"),
        "{stderr}"
    );
    let t = trace();
    let out = cca(&[
        "replay",
        t.to_str().unwrap(),
        "--quiet",
        "--snapshot-device",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--snapshot-device applies to PyTorch snapshots"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `cca convert --run` of a run whose allocations failed out of memory writes nothing and exits 1
/// (it wrote a snapshot missing the failed allocations and exited 0 before), unless
/// `--allow-oom`; a CSV export counts the rows it wrote.
#[test]
fn cli_convert_run_refuses_a_failed_run() {
    let dir = std::env::temp_dir().join(format!("cca-convert-oom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("run.pickle");
    let (t, o) = (trace(), out.to_str().unwrap().to_string());
    let args = [
        "convert",
        t.to_str().unwrap(),
        &o,
        "--run",
        "pytorch",
        "--device-memory",
        "256MiB",
        "--quiet",
    ];
    let failed = cca(&args);
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("allocations failed out of memory") && stderr.contains("--allow-oom"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing is written for a failed run");
    let accepted = cca(&[&args[..], &["--allow-oom"]].concat());
    assert_eq!(
        accepted.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&accepted.stderr)
    );
    assert!(out.exists());
    // A configuration string of one's own, as `replay --config` reads it.
    let mine = dir.join("mine.pickle");
    let run = cca(&[
        "convert",
        t.to_str().unwrap(),
        mine.to_str().unwrap(),
        "--config",
        "max_split_size_mb:40",
        "--quiet",
    ]);
    assert_eq!(
        run.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(mine.exists());
    let plain_oom = cca(&[
        "convert",
        t.to_str().unwrap(),
        mine.to_str().unwrap(),
        "--allow-oom",
    ]);
    assert_eq!(plain_oom.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&plain_oom.stderr).contains("--allow-oom applies to a replay"));
    let csv = dir.join("copy.csv");
    let copied = cca(&["convert", t.to_str().unwrap(), csv.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&copied.stderr);
    assert_eq!(copied.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("allocation and free rows"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A CSV export of a trace that has only allocations and frees said "the trace's other 0
/// events have no CSV row"; the note appears only when there are such events.
#[test]
fn cli_convert_to_csv_names_other_events_only_when_there_are_some() {
    let out = std::env::temp_dir().join(format!("cca-convert-rows-{}.csv", std::process::id()));
    let t = trace();
    let run = cca(&["convert", t.to_str().unwrap(), out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("allocation and free rows"), "{stderr}");
    assert!(!stderr.contains("other 0 events"), "{stderr}");
    std::fs::remove_file(&out).unwrap();
}

/// `cca convert --device-memory` sizes the device of a replay (`--run`, `--config`); without
/// one it was ignored without a word (a plain conversion replays nothing), where `--allow-oom`
/// in the same place is refused. It is refused the same way now, before the trace is read.
#[test]
fn cli_convert_device_memory_without_a_replay_is_refused() {
    let out = std::env::temp_dir().join(format!("cca-convert-mem-{}.csv", std::process::id()));
    let t = trace();
    let plain = cca(&[
        "convert",
        t.to_str().unwrap(),
        out.to_str().unwrap(),
        "--device-memory",
        "1GiB",
        "--quiet",
    ]);
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert_eq!(plain.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--device-memory applies to a replay") && stderr.contains("--run"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing is written");
    // With a replay it applies (and the default device fits the trace).
    for extra in [
        &["--run", "pytorch", "--device-memory", "80GiB"][..],
        &["--run", "pytorch"],
    ] {
        let run = cca(&[
            &["convert", t.to_str().unwrap(), out.to_str().unwrap(), "-q"],
            extra,
        ]
        .concat());
        assert_eq!(
            run.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert!(out.exists());
        std::fs::remove_file(&out).unwrap();
    }
}

/// A trace that asks for 1 EB at once fails whatever the device memory: the warning says so
/// instead of advising more `--device-memory`.
#[test]
fn cli_a_request_of_an_exabyte_is_not_a_device_memory_problem() {
    let dir = std::env::temp_dir().join(format!("cca-exabyte-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.csv");
    std::fs::write(
        &path,
        "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x1000,2000000000000000000,0\n\
         0,2,allocate,0x2000,1024,0\n0,3,free,0x2000,1024,0\n",
    )
    .unwrap();
    let out = cca(&["replay", path.to_str().unwrap(), "--quiet"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("it asks for 1 EB or more"), "{stderr}");
    assert!(!stderr.contains("raise --device-memory"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A plain `cca convert` of a snapshot to a snapshot keeps its `allocator_settings` (it wrote an
/// empty dict before).
#[test]
fn cli_convert_keeps_a_snapshots_allocator_settings() {
    use cuda_caching_allocator::trace::{
        ImportOptions, PickleValue, read_snapshot_file, write_pickle,
    };
    let entry = |action: &str, t: i128| {
        PickleValue::dict([
            ("action", PickleValue::Str(action.into())),
            ("addr", PickleValue::Int(1 << 40)),
            ("size", PickleValue::Int(4096)),
            ("stream", PickleValue::Int(0)),
            ("time_us", PickleValue::Int(t)),
        ])
    };
    let settings = PickleValue::dict([
        (
            "PYTORCH_CUDA_ALLOC_CONF",
            PickleValue::Str("expandable_segments:True".into()),
        ),
        ("max_split_size", PickleValue::Int(-1)),
    ]);
    let snapshot = PickleValue::dict([
        (
            "device_traces",
            PickleValue::List(vec![PickleValue::List(vec![
                entry("alloc", 1),
                entry("free_requested", 2),
            ])]),
        ),
        ("allocator_settings", settings.clone()),
    ]);
    let dir = std::env::temp_dir().join(format!("cca-convert-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (input, output) = (dir.join("in.pickle"), dir.join("out.pickle"));
    std::fs::write(&input, write_pickle(&snapshot).unwrap()).unwrap();
    let out = cca(&[
        "convert",
        input.to_str().unwrap(),
        output.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = read_snapshot_file(&output, &ImportOptions::default()).unwrap();
    assert_eq!(back.allocator_settings, Some(settings));
    std::fs::remove_dir_all(&dir).unwrap();
}
