//! Loading traces, resolving configurations, running replays with a progress bar, and `convert`.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cuda_caching_allocator::trace::{
    CsvExportOptions, ImportOptions, ImportReport, Imported, SnapshotExportOptions, Trace,
    TraceFormat, TraceOp, export_rmm_csv_file, export_snapshot_file, read_trace_file,
};
use cuda_caching_allocator::{
    AllocatorConfig, CachingAllocator, DeviceBackend, Placement, Preset, ReplayOptions,
    ReplayReport, SimConfig, SimDevice, format_size, replay_observed,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::report::thousands;
use crate::{ConvertArgs, DeviceArg, PlacementArg, TraceArgs};

/// Boxed error for the command line.
pub(crate) type CliResult<T> = Result<T, Box<dyn std::error::Error>>;

/// `--quiet`: no progress on stderr.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Turns progress output off (`--quiet`) or on.
pub(crate) fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// After how long a finished step is reported on a stderr that is not a terminal (where no
/// spinner shows): 2 s, or `CCA_PROGRESS_AFTER_MS` milliseconds.
/// A value that is not a whole number of milliseconds is reported once and the 2 s kept.
fn report_after() -> Duration {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let bad = match std::env::var("CCA_PROGRESS_AFTER_MS") {
        Err(std::env::VarError::NotPresent) => return Duration::from_secs(2),
        Ok(v) if v.trim().is_empty() => return Duration::from_secs(2),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) => return Duration::from_millis(ms),
            Err(_) => format!("={v:?} is not a whole number of milliseconds"),
        },
        Err(std::env::VarError::NotUnicode(_)) => " is not valid UTF-8".to_owned(),
    };
    if !WARNED.swap(true, Ordering::Relaxed) {
        say!("cca: warning: CCA_PROGRESS_AFTER_MS{bad}; steps are reported after 2 s");
    }
    Duration::from_secs(2)
}

/// A step of unknown length (loading, converting, writing): a spinner with the elapsed time on
/// stderr while it runs where stderr is a terminal, and, where it is not, one line when the step
/// took longer than [`report_after`]. Nothing with `--quiet`.
pub(crate) struct Step {
    bar: ProgressBar,
    what: String,
    started: Instant,
}

impl Step {
    pub(crate) fn start(what: String) -> Step {
        let target = if quiet() {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        };
        let bar = ProgressBar::with_draw_target(None, target);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(what.clone());
        if !quiet() {
            bar.enable_steady_tick(Duration::from_millis(120));
        }
        Step {
            bar,
            what,
            started: Instant::now(),
        }
    }

    /// Ends the step; `detail` (e.g. "12,355 events") goes into the line a non-terminal gets.
    pub(crate) fn done(self, detail: &str) {
        self.bar.finish_and_clear();
        let took = self.started.elapsed();
        if !quiet() && !std::io::stderr().is_terminal() && took >= report_after() {
            say!(
                "cca: {}: {detail} in {:.1} s",
                self.what,
                took.as_secs_f64()
            );
        }
    }
}

/// `cca convert --device-memory`'s default, the other subcommands' `80GiB`.
const DEFAULT_DEVICE_MEMORY: u64 = 80 << 30;

/// Parses `123`, `80GiB`, `512MiB`, `1.5TiB` (binary units, powers of 1024) and `80GB`,
/// `64kB` (SI units, powers of 1000). A bare `K`, `M`, `G` or `T` is refused as ambiguous.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("'{s}' is not a size (try 80GiB or 1073741824)");
    let value: f64 = num.trim().parse().map_err(|_| not_a_size())?;
    let unit = unit.trim();
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "k" | "m" | "g" | "t" => {
            let u = unit.to_ascii_uppercase();
            return Err(format!(
                "'{s}' is ambiguous: write {num}{u}iB (powers of 1024) or {num}{u}B (powers of 1000)",
                num = num.trim()
            ));
        }
        _ => {
            return Err(format!(
                "unknown size unit '{unit}' in '{s}' (use B, KiB, MiB, GiB, TiB or kB, MB, GB, TB)"
            ));
        }
    };
    let out_of_range = || format!("size '{s}' is out of range");
    // A whole number is multiplied exactly (an `f64` rounds byte counts above 2^53); a
    // fraction (`1.5GiB`) goes through the `f64`.
    let bytes = match num.trim().parse::<u64>() {
        Ok(whole) => whole.checked_mul(mult).ok_or_else(out_of_range)?,
        Err(_) => {
            let bytes = value * mult as f64;
            if !(bytes.is_finite() && bytes >= 1.0 && bytes < 2f64.powi(62)) {
                return Err(out_of_range());
            }
            bytes as u64
        }
    };
    if !(1..1 << 62).contains(&bytes) {
        return Err(out_of_range());
    }
    Ok(bytes)
}

/// The trace that `--trace` and its import flags name ([`load_trace`]).
pub(crate) fn load_trace_of(t: &TraceArgs) -> CliResult<Trace> {
    load_trace(&t.trace, t.lenient, t.max_import_bytes, t.snapshot_device)
}

/// The trace that `--trace` and its import flags name, with what else the import tells (the
/// snapshot device whose history it is: [`load_imported`]).
pub(crate) fn load_imported_of(t: &TraceArgs) -> CliResult<Imported> {
    load_imported(&t.trace, t.lenient, t.max_import_bytes, t.snapshot_device)
}

/// Reads a trace file in any supported format, holding at most `max_bytes` (the
/// `--max-import-bytes` flag); of a snapshot, the history of `snapshot_device` (the
/// `--snapshot-device` flag; `None`: the first device that has one).
pub(crate) fn load_trace(
    path: &Path,
    lenient: bool,
    max_bytes: u64,
    snapshot_device: Option<usize>,
) -> CliResult<Trace> {
    Ok(load_imported(path, lenient, max_bytes, snapshot_device)?.trace)
}

/// [`load_trace`], with what else the import tells (a snapshot's settings).
fn load_imported(
    path: &Path,
    lenient: bool,
    max_bytes: u64,
    snapshot_device: Option<usize>,
) -> CliResult<Imported> {
    let mut options = if lenient {
        ImportOptions::lenient()
    } else {
        ImportOptions::strict()
    }
    .with_max_bytes(max_bytes);
    if let Some(d) = snapshot_device {
        options = options.with_device(d);
    }
    let step = Step::start(format!("loading {}", path.display()));
    let imported = read_trace_file(path, &options).map_err(|e| {
        // Name the file where the error does not already (a truncated gzip, a bad record).
        let (shown, text) = (path.display().to_string(), e.to_string());
        if text.contains(&shown) {
            text
        } else {
            format!("{shown}: {text}")
        }
    })?;
    step.done(&format!("{} events", imported.trace.events.len()));
    if snapshot_device.is_some() && imported.format != TraceFormat::PytorchSnapshot {
        return Err(format!(
            "{}: --snapshot-device applies to PyTorch snapshots, and this file is an RMM CSV log",
            path.display()
        )
        .into());
    }
    let with_records = &imported.report.devices_with_records;
    if snapshot_device.is_none() && with_records.len() > 1 {
        let list: Vec<String> = with_records.iter().map(usize::to_string).collect();
        say!(
            "cca: note: {}: the snapshot holds allocator histories of devices {}; this run reads \
             device {}'s (choose another with --snapshot-device N)",
            path.display(),
            list.join(", "),
            imported.report.device.unwrap_or(0)
        );
    }
    for note in import_notes(&imported.report) {
        say!("cca: note: {}: {note}", path.display());
    }
    if imported.format == TraceFormat::PytorchSnapshot && imported.report.records == 0 {
        // The usual cause: torch.cuda.memory._snapshot() without the history turned on first.
        say!(
            "cca: note: {}: the snapshot holds no allocator history (its device_traces are \
             empty): turn it on before the run with \
             torch.cuda.memory._record_memory_history(max_entries=...), then dump the snapshot \
             (docs/researchers-guide.md, section 1)",
            path.display()
        );
    }
    Ok(imported)
}

/// What the import left out of the trace, in words: records that a replay will not see. Skipped
/// bookkeeping records (`free_completed`, `snapshot` and the like) are not news and are not
/// named.
fn import_notes(r: &ImportReport) -> Vec<String> {
    let counts = [
        (
            r.unmatched_frees,
            "free",
            "of an address no live allocation held skipped (--lenient)",
        ),
        (
            r.rebound_addresses,
            "allocation",
            "at an address an earlier allocation still held (--lenient): the earlier one \
             stays live to the end",
        ),
        (
            r.alloc_failures.len() as u64,
            "allocation",
            "that failed in the recorded run (`oom` entries, `allocate failure` rows) not \
             replayed",
        ),
    ];
    counts
        .into_iter()
        .filter(|&(n, ..)| n > 0)
        .map(|(n, noun, what)| {
            let plural = if n == 1 { "" } else { "s" };
            format!("{} {noun}{plural} {what}", thousands(n))
        })
        .collect()
}

/// One configuration to run, with its label.
#[derive(Clone, Debug)]
pub(crate) struct Labelled {
    pub(crate) label: String,
    pub(crate) preset: Option<Preset>,
    pub(crate) config: AllocatorConfig,
}

/// The label of an empty (or blank) configuration string: what PyTorch reads it as, in the
/// words the `resolved` line uses for it.
pub(crate) const EMPTY_CONFIG_LABEL: &str = "PyTorch's defaults";

/// The configuration of `--preset` and `--config`, by the one rule of the crate: a string alone
/// is read as PyTorch reads it (on top of PyTorch's defaults, as `AllocatorConfig::parse` and
/// `CUDA_CACHING_ALLOCATOR_CONF`); with `--preset` it applies on top of that preset; neither
/// gives the crate's default.
///
/// The label is the preset's name, the string, or both (`preset + string`). An empty or blank
/// string sets nothing (PyTorch reads an empty `PYTORCH_CUDA_ALLOC_CONF` so, and it is the
/// `resolved` string of PyTorch's defaults, which `--config` reads back): alone it is labelled
/// [`EMPTY_CONFIG_LABEL`], with a preset by the preset's name (it changes nothing on top of
/// one), never by the empty text.
pub(crate) fn resolve(preset: Option<&str>, config: Option<&str>) -> CliResult<Labelled> {
    let p = preset.map(Preset::from_name).transpose()?;
    let (label, config) = match (p, config) {
        (Some(p), Some(c)) if c.trim().is_empty() => {
            (p.name().to_string(), p.config().with_settings(c)?)
        }
        (None, Some(c)) if c.trim().is_empty() => {
            (EMPTY_CONFIG_LABEL.to_string(), AllocatorConfig::parse(c)?)
        }
        (Some(p), Some(c)) => (format!("{p} + {c}"), p.config().with_settings(c)?),
        (Some(p), None) => (p.name().to_string(), p.config()),
        (None, Some(c)) => (c.to_string(), AllocatorConfig::parse(c)?),
        (None, None) => (Preset::Default.name().to_string(), Preset::Default.config()),
    };
    Ok(Labelled {
        label,
        preset: config.matching_preset(),
        config,
    })
}

/// Which flag gave a column of `compare` / `plot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ColumnFlag {
    /// `--preset`.
    Preset,
    /// `--config`.
    Config,
}

/// The columns of `compare` / `plot`: the presets and configuration strings in `order`, the
/// command line's (`presets` and `configs` each in their own order; values `order` does not
/// reach follow, presets first); `fallback`'s presets where there are none.
pub(crate) fn columns(
    presets: &[String],
    configs: &[String],
    order: &[ColumnFlag],
    fallback: &[&str],
) -> CliResult<Vec<Labelled>> {
    let mut out = Vec::new();
    let (mut presets, mut configs) = (presets.iter(), configs.iter());
    for flag in order {
        match flag {
            ColumnFlag::Preset => {
                if let Some(p) = presets.next() {
                    out.push(resolve(Some(p), None)?);
                }
            }
            ColumnFlag::Config => {
                if let Some(c) = configs.next() {
                    out.push(resolve(None, Some(c))?);
                }
            }
        }
    }
    for p in presets {
        out.push(resolve(Some(p), None)?);
    }
    for c in configs {
        out.push(resolve(None, Some(c))?);
    }
    if out.is_empty() {
        for p in fallback {
            out.push(resolve(Some(p), None)?);
        }
    }
    Ok(out)
}

/// A replay's report plus, when asked for, a downsampled timeline of (event, allocated, reserved).
pub(crate) struct Run {
    pub(crate) report: ReplayReport,
    pub(crate) timeline: Vec<(usize, u64, u64)>,
    /// Wall-clock time of the whole replay loop (allocations, frees and the replay's own
    /// bookkeeping: statistics after every event, fragmentation at each new peak).
    pub(crate) wall: Duration,
    /// What the replay ran on, in words.
    pub(crate) device: String,
    /// The device's memory in bytes (the simulated capacity, or the GPU's total).
    pub(crate) device_memory: u64,
}

impl Run {
    /// Wall-clock nanoseconds per allocation or free (0 for a trace without either).
    pub(crate) fn wall_ns_per_op(&self) -> f64 {
        let ops = self.report.allocs + self.report.frees;
        if ops == 0 {
            0.0
        } else {
            self.wall.as_nanos() as f64 / ops as f64
        }
    }
}

/// Whether a memory fraction below 1 caps a replay of `trace` under `config`: the
/// configuration's `per_process_memory_fraction`, or a `set_memory_fraction` event of the trace.
pub(crate) fn fraction_capped(trace: &Trace, config: &AllocatorConfig) -> bool {
    config.per_process_memory_fraction < 1.0
        || trace
            .events
            .iter()
            .any(|e| matches!(e.op, TraceOp::SetFraction { fraction } if fraction < 1.0))
}

/// Replays `trace` under `config` on the device `args.device` names, with a progress bar on
/// stderr for runs that last more than a second.
pub(crate) fn run(
    trace: &Trace,
    config: &AllocatorConfig,
    args: &TraceArgs,
    label: &str,
    points: usize,
) -> CliResult<Run> {
    if config.garbage_collection_threshold > 0.0 && !fraction_capped(trace, config) {
        // As in PyTorch, the threshold acts only under a memory fraction.
        say!(
            "cca: note: {label}: garbage_collection_threshold acts only under a memory fraction \
             below 1 (set_per_process_memory_fraction, or per_process_memory_fraction in the \
             configuration), which neither this trace nor the configuration sets: it changes \
             nothing in this run"
        );
    }
    match args.device {
        DeviceArg::Sim => run_sim(trace, config, args, label, points),
        DeviceArg::Cuda(ordinal) => {
            crate::gpu::run(trace, config, ordinal, label, points, args.time_every())
        }
    }
}

/// Replays `trace` on a fresh simulated device.
fn run_sim(
    trace: &Trace,
    config: &AllocatorConfig,
    args: &TraceArgs,
    label: &str,
    points: usize,
) -> CliResult<Run> {
    let device = SimDevice::new(SimConfig {
        capacity: args.device_memory as usize,
        ..SimConfig::default()
    });
    device.set_event_query_lag(args.query_lag);
    device.set_unmap_helper(args.unmap_helper);
    let alloc = CachingAllocator::new(device, config.clone())?;
    let placement = match args.placement {
        PlacementArg::Faithful => Placement::AddressFaithful,
        PlacementArg::Fresh => Placement::Fresh,
    };
    let dev = alloc.backend();
    let hint = |a: Option<u64>| match a {
        Some(addr) => dev.place_next_at(addr),
        None => dev.clear_placement_hint(),
    };
    let before = dev.counters();
    let (mut report, timeline, wall) = replay_timed(
        &alloc,
        trace,
        placement,
        Some(&hint),
        label,
        points,
        args.time_every(),
    )?;
    report.add_device_cost(&before, &dev.counters());
    Ok(Run {
        report,
        timeline,
        wall,
        device: format!(
            "simulated, {}, {} placement",
            format_size(args.device_memory),
            match args.placement {
                PlacementArg::Faithful => "address-faithful",
                PlacementArg::Fresh => "fresh-address",
            }
        ),
        device_memory: args.device_memory,
    })
}

/// A replay's report, timeline of (event, allocated, reserved) and wall-clock time.
pub(crate) type Timed = (ReplayReport, Vec<(usize, u64, u64)>, Duration);

/// The replay loop shared by every device: host time per operation (of one operation in
/// `time_every`, Note [Sampled op times] in the library's `op_clock.rs`), a timeline of `points`
/// points (each the maximum over its bucket of events, so no peak is lost), a progress bar on
/// stderr once the run has lasted a second, and the loop's wall-clock time.
pub(crate) fn replay_timed<B: DeviceBackend>(
    alloc: &CachingAllocator<B>,
    trace: &Trace,
    placement: Placement,
    hint: Option<&dyn Fn(Option<u64>)>,
    label: &str,
    points: usize,
    time_every: u32,
) -> CliResult<Timed> {
    let opts = ReplayOptions {
        placement,
        timing: true,
        time_one_in: time_every,
        ..ReplayOptions::default()
    };
    let total = trace.events.len();
    let started = Instant::now();
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} events ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_string());
    let mut progress = Progress {
        bar,
        started,
        shown: false,
    };
    let mut timeline = Timeline {
        every: total.checked_div(points).map_or(usize::MAX, |e| e.max(1)),
        total,
        bucket: (0, 0),
        points: Vec::new(),
    };
    // The observer runs after every event: its common case is two tests, the work is out of line.
    let report = replay_observed(alloc, trace, &opts, hint, &mut |i, _live, alloc| {
        if points > 0 {
            timeline.observe(i, alloc);
        }
        if i % 4096 == 0 {
            progress.tick(i);
        }
    })?;
    let wall = started.elapsed();
    progress.bar.finish_and_clear();
    let timeline = timeline.points;
    Ok((report, timeline, wall))
}

/// The progress bar of [`replay_timed`], drawn once the run has lasted a second.
struct Progress {
    bar: ProgressBar,
    started: Instant,
    shown: bool,
}

impl Progress {
    #[inline(never)]
    fn tick(&mut self, i: usize) {
        if !self.shown && !quiet() && self.started.elapsed() > Duration::from_secs(1) {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        self.bar.set_position(i as u64);
    }
}

/// The timeline of [`replay_timed`]: a point per `every` events, each the maximum of allocated
/// and reserved bytes over its bucket.
struct Timeline {
    every: usize,
    total: usize,
    bucket: (u64, u64),
    points: Vec<(usize, u64, u64)>,
}

impl Timeline {
    #[inline(never)]
    fn observe<B: DeviceBackend>(&mut self, i: usize, alloc: &CachingAllocator<B>) {
        let (a, r) = (
            alloc.memory_allocated().max(0) as u64,
            alloc.memory_reserved().max(0) as u64,
        );
        self.bucket = (self.bucket.0.max(a), self.bucket.1.max(r));
        if (i + 1) % self.every == 0 || i + 1 == self.total {
            self.points.push((i, self.bucket.0, self.bucket.1));
            self.bucket = (0, 0);
        }
    }
}

/// `cca convert`.
pub(crate) fn convert(a: &ConvertArgs) -> CliResult<()> {
    // The output format and the preset first: a typo must not cost a load and a replay.
    let out = a.output.to_string_lossy().to_ascii_lowercase();
    let gzip = out.ends_with(".gz");
    let stem = out.trim_end_matches(".gz");
    let pickle = if stem.ends_with(".pickle") || stem.ends_with(".pkl") {
        true
    } else if stem.ends_with(".csv") {
        false
    } else {
        return Err(format!(
            "cannot tell the output format of '{}': use .pickle or .csv (optionally .gz)",
            a.output.display()
        )
        .into());
    };
    let config = if a.run.is_some() || a.config.is_some() {
        Some(resolve(a.run.as_deref(), a.config.as_deref())?)
    } else if a.allow_oom {
        return Err("--allow-oom applies to a replay: add --run PRESET or --config STRING".into());
    } else if a.device_memory.is_some() {
        return Err(
            "--device-memory applies to a replay: add --run PRESET or --config STRING (a plain \
             conversion replays nothing)"
                .into(),
        );
    } else {
        None
    };
    let imported = load_imported(&a.input, a.lenient, a.max_import_bytes, a.snapshot_device)?;
    let trace = imported.trace;
    let (trace, segments) = match config {
        None => (trace, None),
        Some(Labelled { label, config, .. }) => {
            let device = SimDevice::new(SimConfig {
                capacity: a.device_memory.unwrap_or(DEFAULT_DEVICE_MEMORY) as usize,
                ..SimConfig::default()
            });
            let capped = fraction_capped(&trace, &config);
            let alloc = CachingAllocator::new(device, config)?;
            alloc.record_history(usize::MAX);
            let step = Step::start(format!("replaying through {label}"));
            let report = cuda_caching_allocator::replay(&alloc, &trace, &ReplayOptions::default())?;
            step.done(&format!("{} events", thousands(trace.events.len() as u64)));
            // A failed run is not a result: its export lacks the failed allocations. (A trace
            // without allocations exports as it is.)
            if report.allocs > 0 {
                crate::report::check_failures(&[(label.as_str(), &report, capped)], a.allow_oom)?;
            }
            let (recorded, _) = alloc.history();
            (recorded, Some(alloc.snapshot()))
        }
    };
    // A plain conversion of a snapshot keeps its `allocator_settings`.
    let settings = if segments.is_none() {
        imported.allocator_settings
    } else {
        None
    };
    let step = Step::start(format!("writing {}", a.output.display()));
    let written = if pickle {
        let mut options = SnapshotExportOptions::default().with_gzip(gzip);
        if let Some(segs) = &segments {
            options = options.with_allocator_segments(segs);
        }
        if let Some(settings) = settings {
            options = options.with_allocator_settings(settings);
        }
        export_snapshot_file(&a.output, &trace, &options)?;
        format!("{} events", thousands(trace.events.len() as u64))
    } else {
        export_rmm_csv_file(
            &a.output,
            &trace,
            &CsvExportOptions::default().with_gzip(gzip),
        )?;
        // An RMM log has rows for allocations and frees only.
        let rows = trace
            .events
            .iter()
            .filter(|e| matches!(e.op, TraceOp::Alloc { .. } | TraceOp::Free { .. }))
            .count();
        match trace.events.len() - rows {
            0 => format!("{} allocation and free rows", thousands(rows as u64)),
            other => format!(
                "{} allocation and free rows; the trace's other {} event{} no CSV row",
                thousands(rows as u64),
                thousands(other as u64),
                if other == 1 { " has" } else { "s have" }
            ),
        }
    };
    step.done(&written);
    say!("wrote {} ({written})", a.output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{EMPTY_CONFIG_LABEL, parse_bytes, resolve};
    use cuda_caching_allocator::Preset;

    /// An empty or blank `--config` is labelled by what it is, never by its empty text: alone
    /// PyTorch's defaults, with a preset the preset, which it leaves as it is.
    #[test]
    fn an_empty_config_is_labelled_by_what_it_is() {
        for blank in ["", " ", "\t"] {
            let alone = resolve(None, Some(blank)).unwrap();
            assert_eq!(alone.label, EMPTY_CONFIG_LABEL);
            assert_eq!(alone.preset, Some(Preset::Pytorch));
            for p in Preset::ALL {
                let on_top = resolve(Some(p.name()), Some(blank)).unwrap();
                assert_eq!(on_top.label, p.name());
                assert_eq!(on_top.preset, Some(p), "{p}");
                assert_eq!(on_top.config.to_settings(), p.config().to_settings(), "{p}");
            }
        }
        assert_eq!(
            resolve(None, Some("max_split_size_mb:256")).unwrap().label,
            "max_split_size_mb:256"
        );
        assert_eq!(
            resolve(Some("pytorch"), Some("max_split_size_mb:256"))
                .unwrap()
                .label,
            "pytorch + max_split_size_mb:256"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        // Regression (#15): `80GB` read as 80 GiB.
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("64kB"), Ok(64_000));
        let e = parse_bytes("141G").unwrap_err();
        assert!(
            e.contains("ambiguous") && e.contains("141GiB") && e.contains("141GB"),
            "{e}"
        );
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
        assert_eq!(parse_bytes("9007199254740993"), Ok(9_007_199_254_740_993));
        assert_eq!(parse_bytes("4611686018427387903"), Ok((1 << 62) - 1));
        assert!(parse_bytes("4611686018427387904").is_err());
        assert!(parse_bytes("18446744073709551615GiB").is_err());
    }
}
