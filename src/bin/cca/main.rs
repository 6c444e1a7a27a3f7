//! `cca`: the allocator researchers' workbench.
//!
//! `cca replay` runs a trace (PyTorch snapshot pickle or RMM CSV, plain or gzipped) through the
//! caching allocator on a simulated device and reports peaks, ratios, device calls and host time,
//! beside PyTorch's own figures when a `reference.json` is found; `cca compare` puts several
//! configurations side by side; `cca convert` translates between formats or exports a run through
//! this allocator; `cca plot` draws reserved and allocated bytes over the trace.

mod load;
mod plot;
mod reference;
mod report;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

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

#[derive(Args, Debug, Clone)]
struct TraceArgs {
    /// The trace: a PyTorch snapshot pickle or an RMM CSV log, plain or gzipped.
    trace: PathBuf,
    /// Simulated device memory (bytes, or with a unit: 80GiB, 141G, 512MiB).
    #[arg(long, default_value = "80GiB", value_parser = load::parse_bytes)]
    device_memory: u64,
    /// Segment placement.
    #[arg(long, value_enum, default_value_t = PlacementArg::Faithful)]
    placement: PlacementArg,
    /// Skip frees of unknown allocations instead of failing (snapshots with a truncated history).
    #[arg(long)]
    lenient: bool,
    /// PyTorch's figures for the trace (default: reference.json beside the trace, if any).
    #[arg(long)]
    reference: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// A named configuration: pytorch, pytorch-expandable, default.
    #[arg(long)]
    preset: Option<String>,
    /// A configuration string in PyTorch's syntax, applied on top of the preset.
    #[arg(long)]
    config: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also print PyTorch's memory_summary() table at the moment reserved bytes peaked.
    #[arg(long)]
    summary: bool,
}

#[derive(Args, Debug)]
struct CompareArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// Presets to compare (repeatable).
    #[arg(long = "preset")]
    presets: Vec<String>,
    /// Configuration strings to compare (repeatable; each is a column on top of the crate default).
    #[arg(long = "config")]
    configs: Vec<String>,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// Input trace (pickle or CSV, plain or gzipped).
    input: PathBuf,
    /// Output file: `.pickle` (PyTorch snapshot, opens in memory_viz) or `.csv`; add `.gz` to compress.
    output: PathBuf,
    /// Export a replay of the input through this preset instead of the input itself: the snapshot
    /// then holds this allocator's segments, blocks and segment events.
    #[arg(long)]
    run: Option<String>,
    /// Simulated device memory for `--run`.
    #[arg(long, default_value = "80GiB", value_parser = load::parse_bytes)]
    device_memory: u64,
    /// Skip frees of unknown allocations instead of failing.
    #[arg(long)]
    lenient: bool,
}

#[derive(Args, Debug)]
struct PlotArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// Output image: `.png` or `.svg`.
    #[arg(short, long)]
    output: PathBuf,
    /// Presets to plot (repeatable; default: pytorch and default).
    #[arg(long = "preset")]
    presets: Vec<String>,
    /// Configuration strings to plot (repeatable).
    #[arg(long = "config")]
    configs: Vec<String>,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1200)]
    width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = 700)]
    height: u32,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(a) => report::replay(&a),
        Command::Compare(a) => report::compare(&a),
        Command::Convert(a) => load::convert(&a),
        Command::Plot(a) => plot::plot(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cca: {e}");
            ExitCode::FAILURE
        }
    }
}
