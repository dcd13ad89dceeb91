//! `--plot FILE.svg`: throughput and p99 latency against the number of connections.
//!
//! Two charts one above the other, sharing a logarithmic connection axis, one line per
//! target (results from several targets in one file are drawn as separate series). It
//! draws what it is given and measures nothing.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::report::ThroughputResult;
use super::BenchError;

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// One of the two charts: connections (log scale) against a value.
type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<LogCoord<u32>, plotters::coord::types::RangedCoordf64>,
>;

/// How a chart writes its value axis's labels.
type YLabel<'f> = &'f dyn Fn(&f64) -> String;

/// For `map_err`: plotters' error as the bench's.
fn plot_error(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot(e.to_string())
}

/// Draws `results` into an SVG at `path`.
pub(super) fn throughput_svg(path: &Path, results: &[ThroughputResult]) -> Result<(), BenchError> {
    if results.is_empty() {
        return Err(BenchError::Plot(
            "there are no throughput results to plot".into(),
        ));
    }
    let mut series: BTreeMap<&str, Vec<&ThroughputResult>> = BTreeMap::new();
    for r in results {
        series.entry(r.target.as_str()).or_default().push(r);
    }
    for points in series.values_mut() {
        points.sort_by_key(|r| r.conns);
    }
    let max_conns = results.iter().map(|r| r.conns).max().unwrap_or(1).max(2) as u32;
    let min_conns = results.iter().map(|r| r.conns).min().unwrap_or(1).max(1) as u32;
    let max_ops = results.iter().map(|r| r.ops_per_s).fold(1.0, f64::max) * 1.15;
    let max_p99 = results.iter().map(|r| r.latency.p99_us).fold(1.0, f64::max) * 1.15;
    let x_range = (min_conns.saturating_sub(min_conns / 4).max(1))..(max_conns + max_conns / 4 + 1);

    let root = SVGBackend::new(path, (900, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let (top, bottom) = root.split_vertically(380);
    let thousands = |v: &f64| format!("{:.0}k", v / 1000.0);
    let whole = |v: &f64| format!("{v:.0}");
    let mut ops_chart = chart(
        &top,
        "Store throughput (ADD + GET)",
        x_range.clone(),
        (max_ops, "ops/s", &thousands),
    )?;
    let mut p99_chart = chart(
        &bottom,
        "p99 latency per operation",
        x_range,
        (max_p99, "p99 µs", &whole),
    )?;
    for (i, (target, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let ops = points.iter().map(|r| (r.conns as u32, r.ops_per_s));
        line(&mut ops_chart, ops.collect(), color, target)?;
        let p99 = points.iter().map(|r| (r.conns as u32, r.latency.p99_us));
        line(&mut p99_chart, p99.collect(), color, target)?;
    }
    for chart in [&mut ops_chart, &mut p99_chart] {
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(plot_error)?;
    }
    root.present().map_err(plot_error)?;
    Ok(())
}

/// A chart on `area` with its caption, mesh and axes: connections on `x_range`, the
/// value from 0 to `max`, named `desc`, its labels written by `label`.
fn chart<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    caption: &str,
    x_range: std::ops::Range<u32>,
    (max, desc, label): (f64, &str, YLabel<'_>),
) -> Result<Chart<'a, 'b>, BenchError> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range.log_scale(), 0.0..max)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .max_light_lines(2)
        .x_desc("connections")
        .y_desc(desc)
        .y_label_formatter(label)
        .draw()
        .map_err(plot_error)?;
    Ok(chart)
}

/// One target's line and points on `chart`, with its legend entry.
fn line(
    chart: &mut Chart<'_, '_>,
    points: Vec<(u32, f64)>,
    color: RGBColor,
    target: &str,
) -> Result<(), BenchError> {
    chart
        .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
        .map_err(plot_error)?
        .label(target)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
        .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::LatencySummary;

    fn point(target: &str, conns: usize, ops: f64, p99: f64) -> ThroughputResult {
        ThroughputResult {
            target: target.into(),
            conns,
            client_threads: 1,
            seconds: 1.0,
            ops: ops as u64,
            ops_per_s: ops,
            client_cpu_us_per_op: None,
            server_cpu_us_per_op: None,
            latency: LatencySummary {
                mean_us: p99 / 3.0,
                p50_us: p99 / 3.0,
                p90_us: p99 / 2.0,
                p99_us: p99,
                p999_us: p99 * 2.0,
                max_us: p99 * 3.0,
            },
        }
    }

    #[test]
    fn writes_an_svg_with_both_charts_and_every_series() {
        let dir = std::env::temp_dir().join(format!("rdzv-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        let results = [
            point("rdzv", 1, 50_000.0, 30.0),
            point("rdzv", 64, 300_000.0, 400.0),
            point("rdzv", 512, 250_000.0, 3000.0),
            point("pytorch", 64, 100_000.0, 1100.0),
        ];
        throughput_svg(&path, &results).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.contains("Store throughput"));
        assert!(svg.contains("p99 latency"));
        assert!(svg.contains("pytorch") && svg.contains("rdzv"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nothing_to_plot_is_an_error() {
        let err = throughput_svg(Path::new("/nonexistent/x.svg"), &[]).unwrap_err();
        assert!(err.to_string().contains("no throughput results"));
    }
}
