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

/// The smallest shipped trace.
#[cfg(feature = "cli")]
fn shipped_trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces/resnet50_train.csv.gz")
}

/// Runs the `cca` binary.
#[cfg(feature = "cli")]
fn cca(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cca"))
        .args(args)
        .output()
        .expect("the cca binary runs")
}

/// `cca plot` shares `replay`'s trace flags, but draws no reference figures and no host times:
/// `--reference` (even a file that does not exist) and `--time-every` were accepted and
/// silently ignored. They are errors now, naming the flag.
#[cfg(feature = "cli")]
#[test]
fn plot_refuses_the_flags_it_does_not_use() {
    let t = shipped_trace();
    let out_path = scratch_file("plot_flags.svg", b"");
    let _ = std::fs::remove_file(&out_path);
    let (t, o) = (t.to_str().unwrap(), out_path.to_str().unwrap());
    for extra in [
        &["--reference", "/nonexistent/reference.json"][..],
        &["--time-every", "4"][..],
    ] {
        let mut args = vec!["plot", t, "-o", o, "-q", "--preset", "pytorch"];
        args.extend_from_slice(extra);
        let out = cca(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {stderr}");
        assert!(stderr.contains(extra[0]), "{extra:?}: {stderr}");
        assert!(!out_path.exists(), "{extra:?}: a plot was written");
    }
    let out = cca(&["plot", t, "-o", o, "-q", "--preset", "pytorch"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(out_path.exists());
}

/// A run capped by a memory fraction below 1 fails out of memory long before the device is full;
/// the failure's advice was "raise --device-memory", which does not help (the cap is a share of
/// the device). The advice names the fraction now, in the report and the warning alike.
#[cfg(feature = "cli")]
#[test]
fn oom_under_a_memory_fraction_names_the_fraction() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let cfg = "per_process_memory_fraction:0.02";
    for args in [
        vec!["replay", t, "-q", "--config", cfg],
        vec!["compare", t, "-q", "--config", cfg],
    ] {
        let out = cca(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let warning = all
            .lines()
            .find(|l| l.starts_with("cca: warning:"))
            .unwrap_or_default();
        let (_, advice) = warning
            .split_once("failed out of memory")
            .unwrap_or_else(|| panic!("{args:?}: {all}"));
        assert!(advice.contains("memory fraction"), "{args:?}: {warning}");
    }
    // Without a fraction the advice is still the device's memory.
    let out = cca(&["replay", t, "-q", "--device-memory", "2GiB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("raise --device-memory"), "{stderr}");
    assert!(!stderr.contains("memory fraction"), "{stderr}");
}

/// The advice of a failed run followed only whether a fraction below 1 appeared in the
/// configuration or the trace: under a fraction of 0.5 on a 2 GiB device it said to raise the
/// fraction, though most allocations failed for want of device memory or to fragmentation, and
/// the same run at a fraction of 1.0 still fails. The report now counts the allocator's verdicts
/// (`oom_verdicts` in the JSON) and the advice follows them.
#[cfg(feature = "cli")]
#[test]
fn oom_advice_follows_the_allocators_verdicts() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let base = ["--preset", "pytorch", "--device-memory", "2GiB", "-q"];
    let capped: Vec<&str> = ["replay", t, "--config", "per_process_memory_fraction:0.5"]
        .into_iter()
        .chain(base)
        .collect();
    let out = cca(&capped);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("cca: warning:"))
        .unwrap_or_default();
    assert!(warning.contains("memory fraction"), "{warning}");
    assert!(warning.contains("raise --device-memory"), "{warning}");
    // The same run without the cap still fails: the fraction was not all of it.
    let uncapped: Vec<&str> = ["replay", t, "--config", "per_process_memory_fraction:1.0"]
        .into_iter()
        .chain(base)
        .chain(["--json"])
        .collect();
    let out = cca(&uncapped);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let verdicts = &v["oom_verdicts"];
    let total: u64 = [
        "device_full",
        "fraction_cap_reached",
        "fragmented",
        "larger_than_device",
        "cached_for_other_streams",
    ]
    .iter()
    .map(|k| verdicts[k].as_u64().unwrap())
    .sum();
    assert!(total > 0, "{verdicts}");
    assert_eq!(total, v["failed_allocs"].as_u64().unwrap(), "{verdicts}");
    assert_eq!(verdicts["fraction_cap_reached"], 0, "{verdicts}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("memory fraction"), "{stderr}");
}

/// `--device-memory` (and `--max-import-bytes`) went through an `f64`: a byte count above 2^53
/// came back rounded (9007199254740993 reported as ...992) and the largest accepted values
/// (below 2^62) were refused as out of range. Whole numbers are exact now.
#[cfg(feature = "cli")]
#[test]
fn whole_byte_counts_are_exact() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    for bytes in ["9007199254740993", "4611686018427387903"] {
        let out = cca(&["replay", t, "-q", "--json", "--device-memory", bytes]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{bytes}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["device_memory"].to_string(), bytes);
    }
    let out = cca(&["replay", t, "-q", "--device-memory", "4611686018427387904"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("out of range"));
}

/// A run with allocations that failed out of memory skips the trace's frees of them; the
/// library's report counts them (`skipped_frees`), but `replay --json` and `compare --json`
/// left the count out, and the text said nothing of it. Both carry it now.
#[cfg(feature = "cli")]
#[test]
fn skipped_frees_are_reported() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let small = [
        "-q",
        "--allow-oom",
        "--device-memory",
        "1GiB",
        "--preset",
        "pytorch",
    ];
    let json = |args: &[&str]| -> serde_json::Value {
        let out = cca(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mut args = vec!["replay", t, "--json"];
    args.extend_from_slice(&small);
    let v = json(&args);
    let skipped = v["skipped_frees"].as_u64().expect("a skipped_frees key");
    let failed = v["failed_allocs"].as_u64().unwrap();
    assert!(skipped > 0 && skipped <= failed, "{skipped} of {failed}");
    args[0] = "compare";
    assert_eq!(json(&args)[0]["skipped_frees"].as_u64(), Some(skipped));
    // The text says it too: replay as a line, compare as a row.
    let expected = format!("{}", skipped);
    for command in ["replay", "compare"] {
        let mut args = vec![command, t];
        args.extend_from_slice(&small);
        let out = cca(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with("skipped frees"))
            .unwrap_or_else(|| panic!("{command}: {stdout}"));
        let digits: String = line.chars().filter(char::is_ascii_digit).collect();
        assert_eq!(digits, expected, "{command}: {line}");
    }
    // A run without failures has none, and no such line.
    let v = json(&["replay", t, "-q", "--json", "--preset", "pytorch"]);
    assert_eq!(v["skipped_frees"].as_u64(), Some(0));
    let out = cca(&["replay", t, "-q", "--preset", "pytorch"]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("skipped frees"));
}

/// `replay --summary` headed PyTorch's table "device ID 0" whatever device the trace came from:
/// a snapshot's history of device 1 (read by default when it is the only one, or picked with
/// `--snapshot-device 1`) printed "device ID 0". The table names the trace's device now.
#[cfg(feature = "cli")]
#[test]
fn summary_names_the_traces_device() {
    use cuda_caching_allocator::trace::{PickleValue, write_pickle};
    let entry = |action: &str, addr: i128| {
        PickleValue::dict([
            ("action", PickleValue::Str(action.into())),
            ("addr", PickleValue::Int(addr)),
            ("size", PickleValue::Int(1 << 20)),
            ("stream", PickleValue::Int(0)),
            ("time_us", PickleValue::Int(1)),
        ])
    };
    let history = || {
        PickleValue::List(vec![
            entry("alloc", 1 << 40),
            entry("free_requested", 1 << 40),
        ])
    };
    // Device 0 without a history, devices 1 and 2 with one each.
    let snapshot = PickleValue::dict([(
        "device_traces",
        PickleValue::List(vec![PickleValue::List(vec![]), history(), history()]),
    )]);
    let path = scratch_file("device_1_and_2.pickle", &write_pickle(&snapshot).unwrap());
    let p = path.to_str().unwrap();
    let heading = |extra: &[&str]| {
        let mut args = vec!["replay", p, "-q", "--summary", "--preset", "pytorch"];
        args.extend_from_slice(extra);
        let out = cca(&args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {stdout}");
        let line = stdout
            .lines()
            .find(|l| l.contains("memory summary, device ID"))
            .unwrap_or_else(|| panic!("{extra:?}: {stdout}"))
            .to_owned();
        let (_, id) = line.split_once("device ID").unwrap_or_default();
        id.trim_matches(|c: char| c == '|' || c.is_whitespace())
            .to_owned()
    };
    assert_eq!(heading(&[]), "1");
    assert_eq!(heading(&["--snapshot-device", "2"]), "2");
    // An RMM log names no device: 0.
    let t = shipped_trace();
    let out = cca(&["replay", t.to_str().unwrap(), "-q", "--summary"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("memory summary, device ID 0 "));
}

/// `--config ""` is PyTorch's defaults (an empty `PYTORCH_CUDA_ALLOC_CONF`, and the `resolved`
/// string of PyTorch's defaults, which `--config` reads back), but its column and JSON
/// `configuration` were labelled by its empty text. It is labelled by what it is now.
#[cfg(feature = "cli")]
#[test]
fn an_empty_config_string_is_labelled() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let label = "PyTorch's defaults";
    let json = |args: &[&str]| -> serde_json::Value {
        let out = cca(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let v = json(&["replay", t, "-q", "--json", "--config", ""]);
    assert_eq!(v["configuration"], label);
    assert_eq!(v["preset"], "pytorch");
    let v = json(&[
        "compare", t, "-q", "--json", "--config", "", "--config", " ",
    ]);
    assert_eq!(v[0]["configuration"], label);
    assert_eq!(v[1]["configuration"], label);
    let v = json(&[
        "replay", t, "-q", "--json", "--preset", "default", "--config", "",
    ]);
    assert_eq!(v["configuration"], "default");
    // The compare table's column is headed by the label, and no line starts with ": ".
    let out = cca(&["compare", t, "-q", "--config", "", "--preset", "pytorch"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.starts_with(&format!("{label}: "))),
        "{stdout}"
    );
    assert!(!stdout.lines().any(|l| l.starts_with(": ")), "{stdout}");
    let header = stdout
        .lines()
        .find(|l| l.starts_with("resnet50_train"))
        .unwrap_or_default();
    assert!(header.contains(label), "{stdout}");
    let out = cca(&["replay", t, "-q", "--config", ""]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("configuration  {label}\n")),
        "{stdout}"
    );
}

/// `cca compare` put the columns of `--preset` first and those of `--config` after them,
/// whatever the command line's order; they follow the command line now (each flag's values
/// in their own order, as before).
#[cfg(feature = "cli")]
#[test]
fn compare_columns_follow_the_command_line() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let out = cca(&[
        "compare",
        t,
        "-q",
        "--json",
        "--config",
        "max_split_size_mb:256",
        "--preset=pytorch",
        "--config",
        "roundup_power2_divisions:4",
        "--preset",
        "default",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let labels: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["configuration"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "max_split_size_mb:256",
            "pytorch",
            "roundup_power2_divisions:4",
            "default"
        ]
    );
    // The table's header too.
    let out = cca(&[
        "compare",
        t,
        "-q",
        "--config",
        "max_split_size_mb:256",
        "--preset",
        "pytorch",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let header = stdout
        .lines()
        .find(|l| l.starts_with("resnet50_train"))
        .unwrap_or_default();
    let (c, p) = (header.find("max_split_size_mb:256"), header.find("pytorch"));
    assert!(c.is_some() && p.is_some() && c < p, "{stdout}");
}

/// With expandable segments on a huge simulated device, a 2^59-byte request made the growth
/// create one physical handle per page for hours (and the simulator's table of them would fill
/// the host's memory). `SimDevice` holds at most `MAX_PHYSICAL_HANDLES` now: the replay stops
/// within seconds with an error naming the event and the limit.
#[cfg(feature = "cli")]
#[test]
fn a_huge_expandable_growth_stops_at_the_handle_limit() {
    use std::time::{Duration, Instant};
    let size = 1u64 << 59;
    let log = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,{size},0\n\
         1,1,free,0x1000,{size},0\n"
    );
    let path = scratch_file("huge_growth.csv", log.as_bytes());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cca"))
        .args([
            "replay",
            path.to_str().unwrap(),
            "-q",
            "--preset",
            "pytorch-expandable",
            "--device-memory",
            "4000000000000000000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the cca binary runs");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the replay still ran after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("event 0") && stderr.contains("MAX_PHYSICAL_HANDLES"),
        "{stderr}"
    );
    // The message names the limit in figures: they must stay the constant's.
    assert!(stderr.contains("2,097,152"), "{stderr}");
    assert_eq!(
        cuda_caching_allocator::SimDevice::MAX_PHYSICAL_HANDLES,
        2_097_152
    );
}

/// A run that fails out of memory under `--allow-oom` said "or pass --allow-oom to accept it",
/// advice for a flag that was given; it now says the failures were accepted with it.
#[cfg(feature = "cli")]
#[test]
fn an_accepted_oom_does_not_advise_the_flag_given() {
    let t = shipped_trace();
    let t = t.to_str().unwrap();
    let out = cca(&["replay", t, "--device-memory", "2GiB", "--allow-oom"]);
    assert_eq!(out.status.code(), Some(0), "accepted");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("failed out of memory"), "{all}");
    assert!(!all.contains("pass --allow-oom"), "{all}");
    assert!(all.contains("accepted with --allow-oom"), "{all}");
    // Without the flag the advice stays.
    let out = cca(&["replay", t, "-q", "--device-memory", "2GiB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("pass --allow-oom"), "{stderr}");
}
