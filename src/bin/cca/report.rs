//! `cca replay` and `cca compare`: text tables and JSON.

use cuda_caching_allocator::{OomVerdictCounts, ReplayReport, memory_summary};
use serde_json::{Map, Value, json};

use crate::load::{self, CliResult, Labelled, Run};

/// Appends a formatted line to a `String` (writing to a `String` cannot fail).
macro_rules! outln {
    ($o:expr) => {
        $o.push('\n')
    };
    ($o:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($o, $($arg)*);
    }};
}

/// Appends formatted text to a `String`.
macro_rules! out {
    ($o:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = write!($o, $($arg)*);
    }};
}

/// Writes `text` to stdout. A reader that went away (`cca replay ... | head -1`) ends the output
/// quietly: a closed pipe is not an error of the run.
///
/// # Errors
/// Any other write error.
pub(crate) fn emit(text: &str) -> CliResult<()> {
    use std::io::Write as _;
    // Columns padded for an empty last cell leave spaces at line ends: drop them.
    let mut trimmed = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let body = line.strip_suffix('\n');
        trimmed.push_str(body.unwrap_or(line).trim_end());
        if body.is_some() {
            trimmed.push('\n');
        }
    }
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(trimmed.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// Why a run's figures are not results: an empty trace, or allocations that failed out of
/// memory. `None` for a run that completed.
fn failure(r: &ReplayReport) -> Option<Failure> {
    if r.allocs == 0 {
        Some(Failure::Empty)
    } else if r.failed_allocs > 0 || r.num_ooms > 0 {
        let failed = r.num_ooms.max(r.failed_allocs as u64);
        // Requests of 1 EB or more fail before the allocator tries (PyTorch refuses them
        // likewise): `failed_allocs` counts them, `num_ooms` does not.
        let too_large = (r.failed_allocs as u64).saturating_sub(r.num_ooms);
        Some(Failure::Oom(failed, too_large))
    } else {
        None
    }
}

/// What went wrong in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// The trace has no allocations.
    Empty,
    /// This many allocations failed out of memory, the second figure of them because they
    /// asked for 1 EB or more.
    Oom(u64, u64),
}

impl Failure {
    /// The JSON `status` value.
    fn status(self) -> &'static str {
        match self {
            Failure::Empty => "empty",
            Failure::Oom(..) => "oom",
        }
    }

    /// In words; `verdicts`: what stopped each failed allocation, as the allocator judged it;
    /// `capped`: a memory fraction below 1 capped the run (the advice where no verdict was
    /// recorded); `accepted`: `--allow-oom` was given (the advice then says so instead of
    /// suggesting it).
    fn describe(self, verdicts: &OomVerdictCounts, capped: bool, accepted: bool) -> String {
        let accept = if accepted {
            "; accepted with --allow-oom"
        } else {
            ", or pass --allow-oom to accept it"
        };
        match self {
            Failure::Empty => "the trace has no allocations: nothing was measured".to_string(),
            Failure::Oom(n, too_large) => {
                let advice = if too_large == n {
                    format!(
                        "{} for 1 EB or more, which no device memory serves and PyTorch refuses \
                         too{}",
                        if n == 1 { "it asks" } else { "they ask" },
                        if accepted {
                            "; accepted with --allow-oom"
                        } else {
                            "; pass --allow-oom to accept the run"
                        }
                    )
                } else if too_large > 0 {
                    format!(
                        "{} of them ask for 1 EB or more, which no device memory serves; for \
                         the others {}{accept}",
                        thousands(too_large),
                        raise(verdicts, capped)
                    )
                } else {
                    format!("{}{accept}", raise(verdicts, capped))
                };
                format!(
                    "{} allocation{} failed out of memory: the figures describe a failed run \
                     ({advice})",
                    thousands(n),
                    if n == 1 { "" } else { "s" }
                )
            }
        }
    }
}

/// The fraction's advice: a share of the device, which a larger device lifts only in proportion.
const RAISE_FRACTION: &str = "the run is capped by a memory fraction below 1 \
     (per_process_memory_fraction in the configuration, or the trace's set_memory_fraction): \
     raise it";

/// What lifts the limits the failed allocations met, by the allocator's verdicts: the memory
/// fraction for those the cap stopped, the device's memory for those the device stopped, and
/// for those the cache could not serve from the free bytes it held (fragmented, or held for
/// other streams or the other size class) more memory or another configuration. A run without
/// verdicts (none recorded) falls back on whether a fraction below 1 capped it.
fn raise(v: &OomVerdictCounts, capped: bool) -> String {
    if v.total() == 0 {
        return if capped {
            RAISE_FRACTION.to_string()
        } else {
            "raise --device-memory".to_string()
        };
    }
    let device = v.device_full + v.larger_than_device;
    let cache = v.fragmented + v.cached_for_other_streams;
    let mut parts = Vec::new();
    let of = |n: u64| {
        if n == v.total() {
            String::new()
        } else {
            format!("{} of them: ", thousands(n))
        }
    };
    if v.fraction_cap_reached > 0 {
        parts.push(format!("{}{RAISE_FRACTION}", of(v.fraction_cap_reached)));
    }
    if device > 0 {
        parts.push(format!(
            "{}the device's memory ran out: raise --device-memory",
            of(device)
        ));
    }
    if cache > 0 {
        parts.push(format!(
            "{}enough bytes sat free in the cache, but fragmented or held for other streams: \
             raise --device-memory or try another configuration (`--json` gives each verdict)",
            of(cache)
        ));
    }
    parts.join("; ")
}

/// A run to check: its label, its report, and whether a memory fraction below 1 capped it
/// ([`load::fraction_capped`]).
pub(crate) type Checked<'a> = (&'a str, &'a ReplayReport, bool);

/// Warns on stderr about every failed run, and returns the error that ends `cca` with status 1
/// unless only OOMs failed and `allow_oom` accepts them.
pub(crate) fn check_failures(runs: &[Checked<'_>], allow_oom: bool) -> CliResult<()> {
    let mut fatal = Vec::new();
    for &(label, r, capped) in runs {
        if let Some(f) = failure(r) {
            say!(
                "cca: warning: {label}: {}",
                f.describe(&r.oom_verdicts, capped, allow_oom)
            );
            if f == Failure::Empty || !allow_oom {
                fatal.push(format!("{label}: {}", f.status()));
            }
        }
    }
    if fatal.is_empty() {
        Ok(())
    } else {
        Err(format!("the run failed ({})", fatal.join(", ")).into())
    }
}

/// The resolved configuration in words: the string PyTorch's syntax gives for it.
fn resolved(label: &Labelled) -> String {
    let s = label.config.to_settings();
    let s = if s.is_empty() {
        "PyTorch's defaults".to_string()
    } else {
        s
    };
    match label.preset {
        Some(p) => format!("{s}  (= preset {p})"),
        None => s,
    }
}
use crate::reference::{self, Reference};
use crate::{CompareArgs, ReplayArgs, TraceArgs};

pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The JSON object for one run (the keys `--json` promises, and more).
fn run_json(label: &Labelled, run: &Run, trace_args: &TraceArgs) -> Value {
    let r = &run.report;
    let lat = r.latency.unwrap_or_default();
    let stats: Map<String, Value> = r
        .stats_at_peak
        .to_map()
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    let mut out = json!({
        "trace": trace_args.trace.display().to_string(),
        "configuration": label.label,
        "settings": label.config.settings,
        "resolved_settings": label.config.to_settings(),
        "preset": label.preset.map(|p| p.name()),
        "status": failure(r).map_or("ok", Failure::status),
        "failed": failure(r).is_some(),
        "device": trace_args.device.to_string(),
        "device_description": run.device,
        "device_memory": run.device_memory,
        "events": r.events,
        "allocs": r.allocs,
        "frees": r.frees,
        "peak_live_bytes": r.peak_live_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "reserved_over_live": r.reserved_over_live(),
        "fragmentation_ratio": r.fragmentation_ratio(),
        "fragmentation_at_peak_reserved": r.fragmentation_at_peak.fragmentation(),
        "segment_count_peak": r.segment_count_peak,
        "num_device_alloc": r.num_device_alloc,
        "num_device_free": r.num_device_free,
        "num_ooms": r.num_ooms,
        "failed_allocs": r.failed_allocs,
        "skipped_frees": r.skipped_frees,
        "oom_verdicts": {
            "device_full": r.oom_verdicts.device_full,
            "fraction_cap_reached": r.oom_verdicts.fraction_cap_reached,
            "fragmented": r.oom_verdicts.fragmented,
            "larger_than_device": r.oom_verdicts.larger_than_device,
            "cached_for_other_streams": r.oom_verdicts.cached_for_other_streams,
        },
        "num_alloc_retries": r.num_alloc_retries,
        "cross_stream_handovers": r.cross_stream_handovers,
        "page_loans": r.page_loans,
        "unmaps_handed_off": r.unmaps_handed_off,
        "blocks_borrowed": r.blocks_borrowed,
        "device_calls": device_calls_json(r),
        "modeled_device_ns": r.modeled_device_ns,
        "ns_per_op": lat.mean_ns,
        "ns_per_op_timed": lat.timed_ops,
        "ns_per_op_p50": lat.p50_ns,
        "ns_per_op_p99": lat.p99_ns,
        "ns_per_op_max": lat.max_ns,
        "wall_s": run.wall.as_secs_f64(),
        "wall_ns_per_op": run.wall_ns_per_op(),
        "stats_at_peak": stats,
    });
    // Beside the rest (one more key in the macro passes its recursion limit).
    out["modeled_helper_ns"] = json!(r.modeled_helper_ns);
    out
}

/// The device calls of a simulated run by kind (`null` on a real device).
fn device_calls_json(r: &ReplayReport) -> Value {
    if r.modeled_device_ns.is_none() {
        return Value::Null;
    }
    Value::Object(
        r.device_calls
            .iter()
            .map(|&(k, v)| (k.to_string(), json!(v)))
            .collect(),
    )
}

fn reference_json(reference: &Reference) -> Value {
    json!({
        "torch": reference.torch,
        "pytorch_default_peak_reserved_bytes": reference.default_reserved,
        "pytorch_default_peak_allocated_bytes": reference.default_allocated,
        "pytorch_default_segment_count_peak": reference.default_segments,
        "pytorch_default_num_device_alloc": reference.default_device_allocs,
        "pytorch_expandable_peak_reserved_bytes": reference.expandable_reserved,
        "cudaMallocAsync_peak_reserved_bytes": reference.async_reserved,
        "pytorch_replay_ns_per_op": reference.torch_ns_per_op,
        "cudaMallocAsync_replay_ns_per_op": reference.async_ns_per_op,
    })
}

/// `cca replay`.
pub(crate) fn replay(a: &ReplayArgs) -> CliResult<()> {
    let label = load::resolve(a.preset.as_deref(), a.config.as_deref())?;
    let imported = load::load_imported_of(&a.trace)?;
    // The device the trace was recorded on (a snapshot's; a CSV log names none): the summary's.
    let recorded_device = imported.report.device.unwrap_or(0);
    let trace = imported.trace;
    // Before the replay: a bad --reference must not cost one.
    let reference = reference::find(&a.trace.trace, a.trace.reference.as_deref())?;
    let run = load::run(&trace, &label.config, &a.trace, &label.label, 0)?;
    let r = &run.report;
    let capped = load::fraction_capped(&trace, &label.config);
    let mut o = String::new();
    if a.json {
        let mut v = run_json(&label, &run, &a.trace);
        if let (Some(obj), Some(rf)) = (v.as_object_mut(), &reference) {
            obj.insert("pytorch_reference".into(), reference_json(rf));
        }
        outln!(o, "{}", serde_json::to_string_pretty(&v)?);
        emit(&o)?;
        return check_failures(&[(&label.label, r, capped)], a.allow_oom);
    }
    let (ref_res, ref_alloc, ref_name) = match &reference {
        Some(rf) => rf.for_preset(label.preset),
        None => (None, None, "PyTorch"),
    };
    let mark = |ours: u64, theirs: Option<u64>| match theirs {
        Some(t) if t == ours => format!("{:>18}  exact", thousands(t)),
        Some(t) => format!(
            "{:>18}  {:+.3}%",
            thousands(t),
            (ours as f64 / t as f64 - 1.0) * 100.0
        ),
        None => String::new(),
    };
    let lat = r.latency.unwrap_or_default();
    outln!(o, "trace          {}", a.trace.trace.display());
    outln!(o, "configuration  {}", label.label);
    outln!(o, "resolved       {}", resolved(&label));
    outln!(o, "device         {}", run.device);
    if let Some(f) = failure(r) {
        outln!(
            o,
            "status         FAILED: {}",
            f.describe(&r.oom_verdicts, capped, a.allow_oom)
        );
    }
    outln!(o);
    let header = match &reference {
        Some(rf) => format!("{ref_name} {} (reference.json)", rf.torch),
        None => String::new(),
    };
    outln!(o, "{:<26}{:>18}  {header}", "", "this run");
    // A reference figure that is not of this configuration is printed only where it says so.
    // A snapshot's events include its segment observations, which a CSV log has no rows for:
    // say so where they differ from the allocations and frees.
    let others = r.events.saturating_sub(r.allocs + r.frees);
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "events",
        thousands(r.events as u64),
        if others > 0 {
            format!(
                "({} allocations and frees, {} other: segment observations, cache empties, \
                 fraction changes)",
                thousands((r.allocs + r.frees) as u64),
                thousands(others as u64)
            )
        } else {
            String::new()
        }
    );
    outln!(o, "{:<26}{:>18}", "allocations", thousands(r.allocs as u64));
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "peak live (requested)",
        thousands(r.peak_live_bytes),
        mark(
            r.peak_live_bytes,
            reference.as_ref().and_then(|x| x.peak_live_bytes)
        )
    );
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "peak allocated bytes",
        thousands(r.peak_allocated_bytes),
        mark(r.peak_allocated_bytes, ref_alloc)
    );
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "peak reserved bytes",
        thousands(r.peak_reserved_bytes),
        mark(r.peak_reserved_bytes, ref_res)
    );
    let ref_ratio = match (ref_res, reference.as_ref().and_then(|x| x.peak_live_bytes)) {
        (Some(res), Some(live)) => format!("{:>18.4}", ratio(res, live)),
        _ => String::new(),
    };
    outln!(
        o,
        "{:<26}{:>18.4}  {ref_ratio}",
        "reserved / live",
        r.reserved_over_live()
    );
    let default_only = |v: Option<u64>| {
        if label.preset == Some(cuda_caching_allocator::Preset::Pytorch) {
            mark(r.segment_count_peak, v)
        } else {
            String::new()
        }
    };
    outln!(
        o,
        "{:<26}{:>18.2}%  (1 - peak allocated / peak reserved, each peak where it was reached)",
        "fragmentation ratio",
        r.fragmentation_ratio() * 100.0
    );
    outln!(
        o,
        "{:<26}{:>18.2}%  (1 - allocated / reserved when reserved bytes peaked)",
        "fragmentation at peak",
        r.fragmentation_at_peak.fragmentation() * 100.0
    );
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "segments at peak",
        thousands(r.segment_count_peak),
        default_only(reference.as_ref().and_then(|x| x.default_segments))
    );
    if label.config.expandable_segments && r.segment_count_peak == 0 {
        outln!(
            o,
            "{:<26}{:>18}  (expandable segments: reserved memory grows by mapped pages in a \
             reserved address range, which the segment statistic does not count)",
            "",
            ""
        );
    }
    outln!(
        o,
        "{:<26}{:>18}",
        "device allocs",
        thousands(r.num_device_alloc)
    );
    outln!(
        o,
        "{:<26}{:>18}",
        "device frees",
        thousands(r.num_device_free)
    );
    if let Some(ns) = r.modeled_device_ns {
        outln!(
            o,
            "{:<26}{:>18}",
            "modeled device time",
            format!("{:.3} ms", ns as f64 / 1e6)
        );
        if let Some(h) = r.modeled_helper_ns.filter(|&h| h > 0) {
            outln!(
                o,
                "{:<26}{:>18}",
                "  of it on the helper",
                format!("{:.3} ms", h as f64 / 1e6)
            );
        }
        let calls: Vec<String> = r
            .device_calls
            .iter()
            .filter(|(_, c)| *c > 0)
            .map(|(k, c)| format!("{k} {}", thousands(*c)))
            .collect();
        outln!(o, "{:<26}{:>18}  {}", "device calls", "", calls.join(", "));
    }
    outln!(
        o,
        "{:<26}{:>18}",
        "OOMs / retries",
        format!("{} / {}", r.num_ooms, r.num_alloc_retries)
    );
    if r.failed_allocs > 0 {
        outln!(
            o,
            "{:<26}{:>18}",
            "failed allocations",
            thousands(r.failed_allocs as u64)
        );
    }
    if r.skipped_frees > 0 {
        outln!(
            o,
            "{:<26}{:>18}  (frees of allocations that failed: nothing to free)",
            "skipped frees",
            thousands(r.skipped_frees as u64)
        );
    }
    outln!(
        o,
        "{:<26}{:>18}  {}",
        "host ns per op (mean)",
        format!("{:.0}", lat.mean_ns),
        reference
            .as_ref()
            .and_then(|x| {
                x.torch_ns_per_op.map(|t| {
                    let asyncmax = x
                        .async_ns_per_op
                        .map_or(String::new(), |a| format!("; cudaMallocAsync {a}"));
                    // PyTorch's figure includes its driver calls; this run's host time has
                    // none (the simulated device costs nothing), so add the modeled device time
                    // per operation for the figure to set beside it.
                    let ops = (r.allocs + r.frees).max(1) as f64;
                    let with_device = r.modeled_device_ns.map_or(String::new(), |ns| {
                        format!(
                            "; this run with its modeled device time: {:.0}",
                            lat.mean_ns + ns as f64 / ops
                        )
                    });
                    format!(
                        "{t:>18}  (PyTorch native{asyncmax}, driver calls included, measured on \
                         another machine: {}{with_device})",
                        x.device
                    )
                })
            })
            .unwrap_or_default()
    );
    outln!(
        o,
        "{:<26}{:>18}",
        "host ns p50 / p99",
        format!("{} / {}", lat.p50_ns, lat.p99_ns)
    );
    outln!(o, "{:<26}{:>18}", "host ns max", thousands(lat.max_ns));
    outln!(
        o,
        "{:<26}{:>18}  (host ns: of these operations, one in {} timed)",
        "host ns timed ops",
        thousands(lat.timed_ops),
        a.trace.time_every()
    );
    outln!(
        o,
        "{:<26}{:>18}",
        "wall time",
        format!("{:.3} s", run.wall.as_secs_f64())
    );
    outln!(
        o,
        "{:<26}{:>18}",
        "wall ns per op",
        format!("{:.0}", run.wall_ns_per_op())
    );
    outln!(
        o,
        "{:<26}{:>18}  (host and wall times of this run: measured on this machine)",
        "",
        ""
    );
    if let Some(rf) = &reference {
        if let (Some(e), Some(live)) = (rf.expandable_reserved, rf.peak_live_bytes) {
            outln!(
                o,
                "{:<26}{:>18}  PyTorch expandable_segments: {} ({:.4}x live)",
                "",
                "",
                thousands(e),
                ratio(e, live)
            );
        }
        if let (Some(e), Some(live)) = (rf.async_reserved, rf.peak_live_bytes) {
            outln!(
                o,
                "{:<26}{:>18}  cudaMallocAsync:             {} ({:.4}x live)",
                "",
                "",
                thousands(e),
                ratio(e, live)
            );
        }
    }
    if a.summary {
        outln!(
            o,
            "\nAt peak reserved:\n{}",
            memory_summary(&r.stats_at_peak, recorded_device, false)
        );
    }
    emit(&o)?;
    check_failures(&[(&label.label, r, capped)], a.allow_oom)
}

/// `cca compare`.
pub(crate) fn compare(a: &CompareArgs) -> CliResult<()> {
    let cols = load::columns(
        &a.presets,
        &a.configs,
        &a.order,
        &["pytorch", "pytorch-expandable", "default"],
    )?;
    let trace = load::load_trace_of(&a.trace)?;
    let reference = reference::find(&a.trace.trace, a.trace.reference.as_deref())?;
    let mut runs = Vec::new();
    for c in &cols {
        runs.push(load::run(&trace, &c.config, &a.trace, &c.label, 0)?);
    }
    let failures: Vec<Checked<'_>> = cols
        .iter()
        .zip(&runs)
        .map(|(c, r)| {
            let capped = load::fraction_capped(&trace, &c.config);
            (c.label.as_str(), &r.report, capped)
        })
        .collect();
    let mut o = String::new();
    if a.json {
        let arr: Vec<Value> = cols
            .iter()
            .zip(&runs)
            .map(|(c, r)| {
                let mut v = run_json(c, r, &a.trace);
                if let (Some(obj), Some(rf)) = (v.as_object_mut(), &reference) {
                    obj.insert("pytorch_reference".into(), reference_json(rf));
                }
                v
            })
            .collect();
        outln!(o, "{}", serde_json::to_string_pretty(&arr)?);
        emit(&o)?;
        return check_failures(&failures, a.allow_oom);
    }
    let w = cols
        .iter()
        .map(|c| c.label.len())
        .max()
        .unwrap_or(0)
        .max(16)
        + 2;
    if let Some(run) = runs.first() {
        outln!(o, "device: {}", run.device);
    }
    for c in &cols {
        outln!(o, "{}: {}", c.label, resolved(c));
    }
    outln!(o);
    out!(
        o,
        "{:<24}",
        a.trace
            .trace
            .file_name()
            .map(|f| f.to_string_lossy().to_string())
            .unwrap_or_default()
    );
    for c in &cols {
        out!(o, "{:>w$}", c.label);
    }
    outln!(o);
    out!(o, "{:<24}", "status");
    for r in &runs {
        let status = match failure(&r.report) {
            None => "ok".to_string(),
            Some(Failure::Empty) => "FAILED: empty".to_string(),
            Some(Failure::Oom(n, _)) => format!("FAILED: {} OOMs", thousands(n)),
        };
        out!(o, "{:>w$}", status);
    }
    outln!(o);
    type Row = (&'static str, fn(&ReplayReport) -> String);
    let rows: [Row; 14] = [
        ("peak live bytes", |r| thousands(r.peak_live_bytes)),
        ("peak allocated bytes", |r| {
            thousands(r.peak_allocated_bytes)
        }),
        ("peak reserved bytes", |r| thousands(r.peak_reserved_bytes)),
        ("reserved / live", |r| {
            format!("{:.4}", r.reserved_over_live())
        }),
        ("fragmentation ratio", |r| {
            format!("{:.2}%", r.fragmentation_ratio() * 100.0)
        }),
        ("fragmentation at peak", |r| {
            format!("{:.2}%", r.fragmentation_at_peak.fragmentation() * 100.0)
        }),
        ("segments at peak", |r| thousands(r.segment_count_peak)),
        ("device allocs", |r| thousands(r.num_device_alloc)),
        ("device frees", |r| thousands(r.num_device_free)),
        ("modeled device ms", |r| {
            r.modeled_device_ns
                .map_or("-".to_string(), |ns| format!("{:.3}", ns as f64 / 1e6))
        }),
        ("synchronizations", |r| {
            thousands(r.device_call("synchronize") + r.device_call("stream_synchronize"))
        }),
        ("OOMs / retries", |r| {
            format!("{} / {}", r.num_ooms, r.num_alloc_retries)
        }),
        ("host ns per op (mean)", |r| {
            format!("{:.0}", r.latency.unwrap_or_default().mean_ns)
        }),
        ("host ns p99", |r| {
            thousands(r.latency.unwrap_or_default().p99_ns)
        }),
    ];
    let row = |o: &mut String, (name, f): Row| {
        out!(o, "{name:<24}");
        for r in &runs {
            out!(o, "{:>w$}", f(&r.report));
        }
        outln!(o);
    };
    let any_skipped = runs.iter().any(|r| r.report.skipped_frees > 0);
    for (name, f) in rows {
        row(&mut o, (name, f));
        // Frees of allocations that failed, after the OOMs, where a run has any.
        if any_skipped && name == "OOMs / retries" {
            row(
                &mut o,
                ("skipped frees", |r| thousands(r.skipped_frees as u64)),
            );
        }
    }
    out!(o, "{:<24}", "wall ns per op");
    for r in &runs {
        out!(o, "{:>w$}", format!("{:.0}", r.wall_ns_per_op()));
    }
    outln!(o);
    outln!(
        o,
        "(host and wall times: measured on this machine; host ns: one operation in {} timed)",
        a.trace.time_every()
    );
    if cols
        .iter()
        .zip(&runs)
        .any(|(c, r)| c.config.expandable_segments && r.report.segment_count_peak == 0)
    {
        outln!(
            o,
            "(segments at peak 0 with expandable segments: reserved memory grows by mapped pages \
             in a reserved address range, which the segment statistic does not count)"
        );
    }
    if let Some(rf) = reference {
        outln!(o);
        let live = rf.peak_live_bytes.unwrap_or(0);
        for (name, v) in [
            ("PyTorch default", rf.default_reserved),
            ("PyTorch expandable", rf.expandable_reserved),
            ("cudaMallocAsync", rf.async_reserved),
        ] {
            if let Some(v) = v {
                outln!(
                    o,
                    "{:<24}{:>18} reserved ({:.4}x live)   [reference.json, torch {}]",
                    name,
                    thousands(v),
                    ratio(v, live),
                    rf.torch
                );
            }
        }
    }
    emit(&o)?;
    check_failures(&failures, a.allow_oom)
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(15286140928), "15,286,140,928");
    }
}
