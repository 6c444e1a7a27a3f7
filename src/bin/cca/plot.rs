//! `cca plot`: reserved and allocated bytes over the trace, one pair of lines per configuration,
//! drawn with plotters (PNG or SVG by the output's extension) in an embedded font, so no system
//! fonts are needed.
//!
//! Lines that coincide stay visible: each configuration's reserved line is drawn thinner than
//! the one before it (so equal lines show as nested bands of colour), carries its own marker
//! shape at positions staggered between configurations, and its allocated line has its own dash
//! pattern. The legend says which line style is which quantity, and each configuration's peak
//! reserved bytes are marked and labelled. The x axis is the time of the trace's events where it
//! has timestamps (`--x-axis auto` or `time`), else the event index.

use std::fs::OpenOptions;
use std::path::Path;

use cuda_caching_allocator::format_size;
use cuda_caching_allocator::trace::Trace;
use plotters::prelude::*;
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::load::{self, CliResult};
use crate::report;
use crate::{PlotArgs, XAxisArg};

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Marker shapes, one per configuration in turn.
const SHAPES: usize = 4;

/// How many markers each configuration's reserved line carries.
const MARKERS: usize = 12;

/// The legend's entries for the two line styles.
const RESERVED_KEY: &str = "solid line: reserved";
const ALLOCATED_KEY: &str = "dashed line: allocated";

/// One configuration's curve: (x, allocated bytes, reserved bytes).
struct Series {
    label: String,
    points: Vec<(f64, u64, u64)>,
}

/// What the x axis shows.
#[derive(Clone, Copy, Debug, PartialEq)]
enum XAxis {
    /// The event index.
    Event,
    /// Seconds since the first event, from the trace's timestamps, starting at `origin_ns`.
    Seconds { origin_ns: u64 },
}

impl XAxis {
    /// The axis `arg` asks for on `trace`: `auto` is time where the trace has timestamps.
    fn pick(arg: XAxisArg, trace: &Trace) -> CliResult<XAxis> {
        let first = trace.events.first().map_or(0, |e| e.time_ns);
        let last = trace.events.last().map_or(0, |e| e.time_ns);
        let timed = last > first;
        match arg {
            XAxisArg::Event => Ok(XAxis::Event),
            XAxisArg::Auto if !timed => Ok(XAxis::Event),
            XAxisArg::Time if !timed => Err(
                "--x-axis time: the trace has no timestamps (its events all carry the same time); \
                 use --x-axis event"
                    .into(),
            ),
            XAxisArg::Auto | XAxisArg::Time => Ok(XAxis::Seconds { origin_ns: first }),
        }
    }

    /// The x coordinate of event `i`.
    fn x(self, trace: &Trace, i: usize) -> f64 {
        match self {
            XAxis::Event => i as f64,
            XAxis::Seconds { origin_ns } => trace
                .events
                .get(i)
                .map_or(0.0, |e| e.time_ns.saturating_sub(origin_ns) as f64 / 1e9),
        }
    }

    fn description(self) -> &'static str {
        match self {
            XAxis::Event => "event",
            XAxis::Seconds { .. } => "time since the first event (s)",
        }
    }
}

/// Fails, naming `path`, when the plot cannot be written there; leaves an existing file as it is
/// and removes the probe when there was none. Run before the replays, which may take a while.
fn check_writable(path: &Path) -> CliResult<()> {
    let existed = path.exists();
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("cannot write the plot to '{}': {e}", path.display()))?;
    if !existed {
        // The probe file is empty; the plot is written after the replays.
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Fails for the trace flags `plot` shares with `replay` but has no use for: the plot draws no
/// reference figures (`--reference`) and no host times (`--time-every`), and a flag that is
/// accepted must not be silently ignored.
fn refuse_unused_flags(a: &PlotArgs) -> CliResult<()> {
    if let Some(r) = &a.trace.reference {
        return Err(format!(
            "--reference {}: cca plot draws no reference figures; cca replay and cca compare \
             print them",
            r.display()
        )
        .into());
    }
    if a.trace.time_every.is_some() {
        return Err(
            "--time-every: cca plot shows no host times; cca replay and cca compare \
                    report them"
                .into(),
        );
    }
    Ok(())
}

/// `cca plot`.
pub(crate) fn plot(a: &PlotArgs) -> CliResult<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded font could not be loaded")?;
    let out = a.output.to_string_lossy().to_ascii_lowercase();
    let svg = if out.ends_with(".svg") {
        true
    } else if out.ends_with(".png") {
        false
    } else {
        return Err(format!(
            "cannot tell the image format of '{}': use .png or .svg",
            a.output.display()
        )
        .into());
    };
    refuse_unused_flags(a)?;
    check_writable(&a.output)?;
    let cols = load::columns(&a.presets, &a.configs, &a.order, &["pytorch", "default"])?;
    let trace = load::load_trace_of(&a.trace)?;
    let axis = XAxis::pick(a.x_axis, &trace)?;
    let points = (a.width as usize).max(100);
    let mut series = Vec::new();
    let mut reports = Vec::new();
    for c in &cols {
        let run = load::run(&trace, &c.config, &a.trace, &c.label, points)?;
        reports.push((
            c.label.as_str(),
            run.report,
            load::fraction_capped(&trace, &c.config),
        ));
        series.push(Series {
            label: c.label.clone(),
            points: run
                .timeline
                .iter()
                .map(|&(i, allocated, reserved)| (axis.x(&trace, i), allocated, reserved))
                .collect(),
        });
    }
    let title = a
        .trace
        .trace
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .unwrap_or_default();
    let written = if svg {
        let root = SVGBackend::new(&a.output, (a.width, a.height)).into_drawing_area();
        draw(root, &title, axis, &series)
    } else {
        let root = BitMapBackend::new(&a.output, (a.width, a.height)).into_drawing_area();
        draw(root, &title, axis, &series)
    };
    written.map_err(|e| format!("cannot write the plot to '{}': {e}", a.output.display()))?;
    say!("wrote {}", a.output.display());
    // As `replay` and `compare`: a run whose allocations failed is drawn, but said so.
    let runs: Vec<report::Checked<'_>> = reports.iter().map(|(l, r, c)| (*l, r, *c)).collect();
    report::check_failures(&runs, a.allow_oom)
}

/// Where `s` first reached its largest reserved bytes: (x, bytes).
fn peak(s: &Series) -> Option<(f64, u64)> {
    s.points
        .iter()
        .fold(None, |best, &(x, _, reserved)| match best {
            Some((_, b)) if b >= reserved => best,
            _ => Some((x, reserved)),
        })
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    axis: XAxis,
    series: &[Series],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let gib = (1u64 << 30) as f64;
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_x = series
        .iter()
        .flat_map(|s| s.points.iter())
        .map(|p| p.0)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let max_y = series
        .iter()
        .flat_map(|s| s.points.iter())
        .map(|p| p.2)
        .max()
        .unwrap_or(1) as f64
        / gib
        * 1.08;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{title}: reserved and allocated memory"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..max_x, 0f64..max_y.max(1e-3))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(axis.description())
        .x_label_formatter(&|x| match axis {
            XAxis::Event => format!("{x:.0}"),
            XAxis::Seconds { .. } => format!("{x:.2}"),
        })
        .y_desc("GiB")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    let n = series.len();
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        // Drawn first, drawn widest: a later line on top of an equal one leaves a band of this
        // colour on each side.
        let width = 2 + 2 * (n - 1 - i) as u32;
        let reserved: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0, p.2 as f64 / gib)).collect();
        let anno = chart
            .draw_series(LineSeries::new(
                reserved.iter().copied(),
                colour.stroke_width(width),
            ))
            .map_err(|e| e.to_string())?
            .label(s.label.clone());
        let line = move |(x, y): (i32, i32)| {
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (24, 0)], colour.stroke_width(2))
        };
        let style = colour.filled();
        match i % SHAPES {
            0 => anno.legend(move |c| line(c) + Circle::new((12, 0), 4, style)),
            1 => anno.legend(move |c| line(c) + TriangleMarker::new((12, 0), 5, style)),
            2 => anno.legend(move |c| line(c) + Rectangle::new([(8, -4), (16, 4)], style)),
            _ => anno.legend(move |c| line(c) + Cross::new((12, 0), 5, colour.stroke_width(2))),
        };
        // Markers at positions staggered between configurations, so each shows on equal lines.
        let stride = (reserved.len() / MARKERS).max(1);
        let offset = stride * i / n.max(1);
        let at: Vec<(f64, f64)> = reserved
            .iter()
            .skip(offset)
            .step_by(stride)
            .copied()
            .collect();
        let drawn = match i % SHAPES {
            0 => chart.draw_series(at.iter().map(|&p| Circle::new(p, 4, style))),
            1 => chart.draw_series(at.iter().map(|&p| TriangleMarker::new(p, 5, style))),
            2 => chart.draw_series(
                at.iter()
                    .map(|&p| EmptyElement::at(p) + Rectangle::new([(-4, -4), (4, 4)], style)),
            ),
            _ => chart.draw_series(at.iter().map(|&p| Cross::new(p, 5, colour.stroke_width(2)))),
        };
        drawn.map_err(|e| e.to_string())?;
        // The allocated bytes, dashed, with a dash pattern of its own.
        chart
            .draw_series(DashedLineSeries::new(
                s.points.iter().map(|p| (p.0, p.1 as f64 / gib)),
                4 + 3 * i as u32,
                3 + i as u32,
                colour.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
    }
    // Each configuration's peak reserved bytes: a ringed point and a label, the labels stacked
    // so that equal peaks do not hide each other; to the left of the point in the right half.
    for (i, s) in series.iter().enumerate() {
        let Some((x, bytes)) = peak(s) else {
            continue;
        };
        let colour = COLOURS[i % COLOURS.len()];
        let right_half = x > max_x / 2.0;
        let (dx, h) = if right_half {
            (-10, HPos::Right)
        } else {
            (10, HPos::Left)
        };
        let font = ("sans-serif", 14)
            .into_font()
            .color(&colour)
            .pos(Pos::new(h, VPos::Center));
        let text = format!("peak {} ({})", format_size(bytes), s.label);
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((x, bytes as f64 / gib))
                    + Circle::new((0, 0), 7, BLACK.stroke_width(2))
                    + Text::new(text, (dx, 18 * i as i32 + 12), font),
            ))
            .map_err(|e| e.to_string())?;
    }
    // The key to the line styles.
    chart
        .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
        .map_err(|e| e.to_string())?
        .label(RESERVED_KEY)
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(2)));
    chart
        .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
        .map_err(|e| e.to_string())?
        .label(ALLOCATED_KEY)
        .legend(|(x, y)| {
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (8, 0)], BLACK.stroke_width(2))
                + PathElement::new(vec![(14, 0), (24, 0)], BLACK.stroke_width(2))
        });
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
