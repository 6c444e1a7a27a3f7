//! `cca plot`: reserved and allocated bytes over the trace, one pair of lines per configuration,
//! drawn with plotters (PNG or SVG by the output's extension) in an embedded font, so no system
//! fonts are needed.

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::PlotArgs;
use crate::load::{self, CliResult};

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

struct Series {
    label: String,
    points: Vec<(usize, u64, u64)>,
}

/// `cca plot`.
pub(crate) fn plot(a: &PlotArgs) -> CliResult<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded font could not be loaded")?;
    let cols = load::columns(&a.presets, &a.configs, &["pytorch", "default"])?;
    let trace = load::load_trace(&a.trace.trace, a.trace.lenient, a.trace.max_import_bytes)?;
    let points = (a.width as usize).max(100);
    let mut series = Vec::new();
    for c in &cols {
        let run = load::run(&trace, &c.config, &a.trace, &c.label, points)?;
        series.push(Series {
            label: c.label.clone(),
            points: run.timeline,
        });
    }
    let out = a.output.to_string_lossy().to_ascii_lowercase();
    let title = a
        .trace
        .trace
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .unwrap_or_default();
    if out.ends_with(".svg") {
        let root = SVGBackend::new(&a.output, (a.width, a.height)).into_drawing_area();
        draw(root, &title, &series)?;
    } else if out.ends_with(".png") {
        let root = BitMapBackend::new(&a.output, (a.width, a.height)).into_drawing_area();
        draw(root, &title, &series)?;
    } else {
        return Err(format!(
            "cannot tell the image format of '{}': use .png or .svg",
            a.output.display()
        )
        .into());
    }
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    series: &[Series],
) -> CliResult<()>
where
    DB::ErrorType: 'static,
{
    let gib = (1u64 << 30) as f64;
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_x = series
        .iter()
        .flat_map(|s| s.points.last())
        .map(|p| p.0)
        .max()
        .unwrap_or(1)
        .max(1);
    let max_y = series
        .iter()
        .flat_map(|s| s.points.iter())
        .map(|p| p.2)
        .max()
        .unwrap_or(1) as f64
        / gib
        * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{title}: reserved (solid) and allocated (dashed) bytes"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0usize..max_x, 0f64..max_y.max(1e-3))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("event")
        .y_desc("GiB")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().map(|p| (p.0, p.2 as f64 / gib)),
                colour.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(DashedLineSeries::new(
                s.points.iter().map(|p| (p.0, p.1 as f64 / gib)),
                6,
                4,
                colour.stroke_width(1),
            ))
            .map_err(|e| e.to_string())?;
    }
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
