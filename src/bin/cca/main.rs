//! `cca`: the allocator researchers' workbench.
//!
//! `cca replay` runs a trace (PyTorch snapshot pickle or RMM CSV, plain or gzipped) through the
//! caching allocator on a simulated device, or with `--device cuda[:N]` on a real GPU (a binary
//! built with the `cuda` feature), and reports peaks, ratios, device calls and host time, beside
//! PyTorch's own figures when a `reference.json` is found; `cca compare` puts several
//! configurations side by side; `cca convert` translates between formats or exports a run through
//! this allocator; `cca plot` draws reserved and allocated bytes over the trace.

/// Writes a line to stderr, ignoring a failed write: `eprintln!` panics when stderr is a closed
/// pipe (`cca ... 2>&1 | head -1`), and a reader that went away is not an error of the run.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod gpu;
mod load;
mod plot;
mod reference;
mod report;

/// Note [The tool's heap]: the global allocator is mimalloc, not the system allocator. The replay
/// loop itself makes no heap allocation, but it walks tens of megabytes (the trace's events, the
/// table of live ids, the simulator's maps), and mimalloc backs its arenas with transparent huge
/// pages where the kernel allows them on request (`madvise`): 147 of the process's 152 MB were
/// in huge pages during a replay, none with glibc. With glibc, `cca` replayed the recorded
/// `generate` trace at 72–76 ns per event, with mimalloc at 57–60, the same decisions either
/// way (`benches/README.md`, "The tool's heap").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::load::ColumnFlag;

/// Command-line interface.
#[derive(Parser, Debug)]
#[command(
    name = "cca",
    version,
    about = "Replay, compare, convert and plot GPU allocation traces with cuda-caching-allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a trace through one configuration and report what happened.
    Replay(ReplayArgs),
    /// Replay a trace through several configurations and print them side by side.
    Compare(CompareArgs),
    /// Convert a trace between formats, or export a run through this allocator.
    Convert(ConvertArgs),
    /// Plot reserved and allocated bytes over a trace (PNG or SVG by the output's extension).
    Plot(PlotArgs),
}

/// Segment placement on the simulated device.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum PlacementArg {
    /// Put new segments where the recorded run had them (reproduces PyTorch's tie-breaking).
    Faithful,
    /// Fresh increasing addresses.
    Fresh,
}

/// The x axis of `cca plot`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum XAxisArg {
    /// Time where the trace has timestamps, else the event index.
    Auto,
    /// Seconds since the first event (an error for a trace without timestamps).
    Time,
    /// The event index.
    Event,
}

/// The device a replay runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceArg {
    /// The simulated device (`SimDevice`): deterministic, host-only.
    Sim,
    /// CUDA device N through the CUDA backend (`CudaDevice`): real `cuMemAlloc` / `cuMemFree`
    /// (or page maps with expandable segments).
    Cuda(usize),
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Sim => f.write_str("sim"),
            DeviceArg::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Parses `sim`, `cuda` (device 0) or `cuda:N`.
fn parse_device(s: &str) -> Result<DeviceArg, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "sim" => Ok(DeviceArg::Sim),
        "cuda" => Ok(DeviceArg::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(DeviceArg::Cuda)
            .ok_or_else(|| {
                format!("unknown device '{s}': use sim, cuda or cuda:N (N = 0, 1, ...)")
            }),
    }
}

#[derive(Args, Debug, Clone)]
struct TraceArgs {
    /// The trace: a PyTorch snapshot pickle or an RMM CSV log, plain or gzipped.
    trace: PathBuf,
    /// Where to replay: `sim` (the simulated device), or `cuda` / `cuda:N` to allocate for real on
    /// CUDA device N (needs a cca built with `--features cli,cuda`).
    #[arg(long, default_value = "sim", value_parser = parse_device)]
    device: DeviceArg,
    /// Simulated device memory: bytes, or with a unit, binary (80GiB, 512MiB) or SI (141GB =
    /// 141 x 10^9); with `--device cuda` the GPU's own memory applies instead.
    #[arg(long, default_value = "80GiB", value_parser = load::parse_bytes)]
    device_memory: u64,
    /// Segment placement on the simulated device (with `--device cuda` the driver places
    /// segments).
    #[arg(long, value_enum, default_value_t = PlacementArg::Faithful)]
    placement: PlacementArg,
    /// Simulated device only: every event query answers "not complete" this many times first, a
    /// model of a device running behind the host (its launch-ahead): page fences and
    /// `record_stream` events are seen complete later (`SimDevice::set_event_query_lag`; 0 = off).
    #[arg(long, default_value_t = 0)]
    query_lag: u32,
    /// Simulated device only: give it an unmap helper, as a CUDA device has (the default's
    /// `cca_unmap_helper` then leaves moved pages' old mappings to it;
    /// `SimDevice::set_unmap_helper`). Without it the growing thread unmaps, as on a backend
    /// with no helper.
    #[arg(long)]
    unmap_helper: bool,
    /// Host time per operation: time one allocation or free in N, picked at pseudo-random gaps
    /// that are the same every run (1: every operation). Default: 16 on the simulated device,
    /// where two clock reads cost about as much as a cached operation and timing them all slows
    /// the replay by about half; 1 with `--device cuda`, where rare device calls dominate the
    /// mean.
    /// The host-ns figures are those of the timed operations (JSON `ns_per_op_timed`: how many);
    /// wall ns per op is the whole loop's either way. Not for `plot`, which shows no host times.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    time_every: Option<u32>,
    /// Skip frees of unknown allocations instead of failing (snapshots with a truncated history).
    #[arg(long)]
    lenient: bool,
    /// Of a snapshot with several devices' histories (`device_traces`), read device N's
    /// (default: the first device that has one; a note names the others).
    #[arg(long, value_name = "N")]
    snapshot_device: Option<usize>,
    /// PyTorch's figures for the trace (default: reference.json beside the trace, if any), for
    /// `replay` and `compare` (`plot` draws none).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// The most bytes the trace import may hold: the decompressed input, and separately what is
    /// built from it (raise it for a trace that really is larger).
    #[arg(long, default_value = "4GiB", value_parser = load::parse_bytes)]
    max_import_bytes: u64,
    /// No progress on stderr (by default a terminal shows spinners and bars for long steps, and
    /// other stderrs get one line for each step that took more than 2 seconds).
    #[arg(short, long)]
    quiet: bool,
}

impl TraceArgs {
    /// `--time-every`, or its default for the device.
    fn time_every(&self) -> u32 {
        self.time_every.unwrap_or(match self.device {
            DeviceArg::Sim => 16,
            DeviceArg::Cuda(_) => 1,
        })
    }
}

#[derive(Args, Debug)]
struct ReplayArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// A named configuration: default (the crate's: expandable segments with page reuse),
    /// pytorch, pytorch-expandable, lean-fast (the default with 64 MiB handles and 20 MiB
    /// growths: faster cold starts, a little more memory). With neither --preset nor --config:
    /// default.
    #[arg(long)]
    preset: Option<String>,
    /// A configuration string in PyTorch's syntax. Alone it is read as PyTorch reads it, on top
    /// of PyTorch's defaults (as CUDA_CACHING_ALLOCATOR_CONF and AllocatorConfig::parse read
    /// it); with --preset, on top of that preset. `cca_preset:default,KEY:VALUE` builds on the
    /// crate's default. An empty string sets nothing (alone: PyTorch's defaults, so labelled).
    #[arg(long)]
    config: Option<String>,
    /// Print one JSON object instead of text (it holds the statistics at peak that --summary
    /// prints).
    #[arg(long, conflicts_with = "summary")]
    json: bool,
    /// Also print PyTorch's memory_summary() table at the moment reserved bytes peaked (its
    /// device ID is the trace's: the snapshot device whose history was read, 0 for an RMM log).
    #[arg(long)]
    summary: bool,
    /// Report a run in which allocations failed out of memory and exit 0 (without it such a run
    /// is reported, marked failed, and cca exits with status 1).
    #[arg(long)]
    allow_oom: bool,
}

#[derive(Args, Debug)]
struct CompareArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// Presets to compare (repeatable; each is a column, and the columns of --preset and
    /// --config follow the command line's order). With neither --preset nor --config: pytorch,
    /// pytorch-expandable and default.
    #[arg(long = "preset")]
    presets: Vec<String>,
    /// Configuration strings to compare (repeatable; each is a column, in the command line's
    /// order among the presets). Each is read as PyTorch reads it, on top of PyTorch's defaults,
    /// as `cca replay --config` without --preset reads it; start one with `cca_preset:default,`
    /// to build on the crate's default.
    #[arg(long = "config")]
    configs: Vec<String>,
    /// The order in which --preset and --config were given ([`column_order`]).
    #[arg(skip)]
    order: Vec<ColumnFlag>,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
    /// Report runs in which allocations failed out of memory and exit 0 (without it cca exits
    /// with status 1 when any column failed).
    #[arg(long)]
    allow_oom: bool,
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// Input trace (pickle or CSV, plain or gzipped).
    input: PathBuf,
    /// Output file: `.pickle` (PyTorch snapshot, opens in memory_viz) or `.csv`; add `.gz` to compress.
    output: PathBuf,
    /// Export a replay of the input through this preset instead of the input itself: the snapshot
    /// then holds this allocator's segments, blocks and segment events. (Without `--run` or
    /// `--config` the input's events are exported as they are, with a snapshot's
    /// `allocator_settings`.)
    #[arg(long)]
    run: Option<String>,
    /// Export a replay through this configuration string in PyTorch's syntax: alone on top of
    /// PyTorch's defaults, with `--run` on top of that preset (as `cca replay --config` reads
    /// it).
    #[arg(long)]
    config: Option<String>,
    /// Simulated device memory for the replay of `--run` or `--config` (an error without one)
    /// [default: 80GiB].
    #[arg(long, value_parser = load::parse_bytes)]
    device_memory: Option<u64>,
    /// With `--run` or `--config`: write the export of a run in which allocations failed out of
    /// memory (the failed ones are missing from it) and exit 0; without it such a run is
    /// reported, nothing is written, and cca exits with status 1.
    #[arg(long)]
    allow_oom: bool,
    /// Skip frees of unknown allocations instead of failing.
    #[arg(long)]
    lenient: bool,
    /// Of a snapshot with several devices' histories, read device N's (default: the first
    /// device that has one).
    #[arg(long, value_name = "N")]
    snapshot_device: Option<usize>,
    /// The most bytes the trace import may hold: the decompressed input, and separately what is
    /// built from it (raise it for a trace that really is larger).
    #[arg(long, default_value = "4GiB", value_parser = load::parse_bytes)]
    max_import_bytes: u64,
    /// No progress on stderr (by default a terminal shows a spinner for each step, and other
    /// stderrs get one line for each step that took more than 2 seconds).
    #[arg(short, long)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct PlotArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// Output image: `.png` or `.svg`.
    #[arg(short, long)]
    output: PathBuf,
    /// Presets to plot (repeatable; default: pytorch and default). The configurations of
    /// --preset and --config are drawn and listed in the command line's order.
    #[arg(long = "preset")]
    presets: Vec<String>,
    /// Configuration strings to plot (repeatable; read on top of PyTorch's defaults, as
    /// `cca replay --config` without --preset reads them).
    #[arg(long = "config")]
    configs: Vec<String>,
    /// The order in which --preset and --config were given ([`column_order`]).
    #[arg(skip)]
    order: Vec<ColumnFlag>,
    /// Image width in pixels, 200 to 8192.
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(200..=8192))]
    width: u32,
    /// Image height in pixels, 150 to 8192.
    #[arg(long, default_value_t = 700, value_parser = clap::value_parser!(u32).range(150..=8192))]
    height: u32,
    /// The x axis: `time` (seconds since the first event, from the trace's timestamps), `event`
    /// (the event index), or `auto`: time where the trace has timestamps, else the event index.
    #[arg(long, value_enum, default_value_t = XAxisArg::Auto)]
    x_axis: XAxisArg,
    /// Exit 0 although allocations failed out of memory in a plotted run (the image is written
    /// either way; without it cca warns and exits with status 1, as `replay` does).
    #[arg(long)]
    allow_oom: bool,
}

/// The order in which a subcommand's `--preset` and `--config` values were given, one entry per
/// value: clap keeps each flag's values in order, but not how the two flags interleave, which
/// their indices on the command line tell.
fn column_order(m: &ArgMatches) -> Vec<ColumnFlag> {
    let mut at: Vec<(usize, ColumnFlag)> = Vec::new();
    for (id, flag) in [
        ("presets", ColumnFlag::Preset),
        ("configs", ColumnFlag::Config),
    ] {
        if let Some(indices) = m.indices_of(id) {
            at.extend(indices.map(|i| (i, flag)));
        }
    }
    at.sort_unstable_by_key(|&(i, _)| i);
    at.into_iter().map(|(_, flag)| flag).collect()
}

/// The command line, with the order of `compare`'s and `plot`'s columns filled in.
fn parse() -> Cli {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| {
        e.format(&mut Cli::command()).exit();
    });
    if let Some((_, sub)) = matches.subcommand() {
        match &mut cli.command {
            Command::Compare(a) => a.order = column_order(sub),
            Command::Plot(a) => a.order = column_order(sub),
            Command::Replay(_) | Command::Convert(_) => {}
        }
    }
    cli
}

fn main() -> ExitCode {
    let cli = parse();
    load::set_quiet(match &cli.command {
        Command::Replay(a) => a.trace.quiet,
        Command::Compare(a) => a.trace.quiet,
        Command::Convert(a) => a.quiet,
        Command::Plot(a) => a.trace.quiet,
    });
    let result = match cli.command {
        Command::Replay(a) => report::replay(&a),
        Command::Compare(a) => report::compare(&a),
        Command::Convert(a) => load::convert(&a),
        Command::Plot(a) => plot::plot(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("cca: {e}");
            ExitCode::FAILURE
        }
    }
}
