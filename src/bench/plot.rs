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

    let plot_error = |e: &dyn std::fmt::Display| BenchError::Plot(e.to_string());
    let root = SVGBackend::new(path, (900, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    let (top, bottom) = root.split_vertically(380);

    let mut ops_chart = ChartBuilder::on(&top)
        .caption("Store throughput (ADD + GET)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range.clone().log_scale(), 0.0..max_ops)
        .map_err(|e| plot_error(&e))?;
    ops_chart
        .configure_mesh()
        .max_light_lines(2)
        .x_desc("connections")
        .y_desc("ops/s")
        .y_label_formatter(&|v| format!("{:.0}k", v / 1000.0))
        .draw()
        .map_err(|e| plot_error(&e))?;

    let mut p99_chart = ChartBuilder::on(&bottom)
        .caption("p99 latency per operation", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range.log_scale(), 0.0..max_p99)
        .map_err(|e| plot_error(&e))?;
    p99_chart
        .configure_mesh()
        .max_light_lines(2)
        .x_desc("connections")
        .y_desc("p99 µs")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| plot_error(&e))?;

    for (i, (target, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let ops: Vec<(u32, f64)> = points
            .iter()
            .map(|r| (r.conns as u32, r.ops_per_s))
            .collect();
        let p99: Vec<(u32, f64)> = points
            .iter()
            .map(|r| (r.conns as u32, r.latency.p99_us))
            .collect();
        ops_chart
            .draw_series(LineSeries::new(ops.clone(), color.stroke_width(2)))
            .map_err(|e| plot_error(&e))?
            .label(*target)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        ops_chart
            .draw_series(ops.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| plot_error(&e))?;
        p99_chart
            .draw_series(LineSeries::new(p99.clone(), color.stroke_width(2)))
            .map_err(|e| plot_error(&e))?
            .label(*target)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        p99_chart
            .draw_series(p99.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| plot_error(&e))?;
    }
    for chart in [&mut ops_chart, &mut p99_chart] {
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| plot_error(&e))?;
    }
    root.present().map_err(|e| plot_error(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::LatencySummary;

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
