//! SVG plots of a comparison: TTFT CDF per router, and per-replica KV
//! utilisation over time (one panel per router).

use std::path::Path;

use plotters::prelude::*;

use crate::summary::RunSummary;

/// Distinct colours for up to ten routers (then they repeat).
const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn colour(i: usize) -> RGBColor {
    COLOURS.get(i % COLOURS.len()).copied().unwrap_or(BLACK)
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// TTFT CDF, one line per router, log-scaled time axis.
pub fn ttft_cdf(runs: &[RunSummary], path: &Path) -> PlotResult {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let all = runs
        .iter()
        .flat_map(|r| r.ttft_quantiles_ms.iter().copied());
    let max = all.clone().fold(1.0f64, f64::max) * 1.2;
    let min = all.fold(f64::MAX, f64::min).clamp(0.1, max / 10.0) * 0.8;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Time to first token, CDF (modelled time)",
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((min..max).log_scale(), 0.0..1.0f64)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let n = run.ttft_quantiles_ms.len().max(1) as f64;
        // At most ~2000 points per line keeps the SVG small.
        let step = (run.ttft_quantiles_ms.len() / 2000).max(1);
        let points = run
            .ttft_quantiles_ms
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == run.ttft_quantiles_ms.len())
            .map(|(k, v)| (v.max(min), (k + 1) as f64 / n));
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(format!("{} (p99 {:.0} ms)", run.router, run.ttft_ms.p99))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Per-replica KV utilisation over time, one panel per router.
pub fn kv_timeline(runs: &[RunSummary], path: &Path) -> PlotResult {
    let cols = 2usize;
    let rows = runs.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (1000, (260 * rows + 40) as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "KV-cache utilisation per replica over time (modelled seconds)",
        ("sans-serif", 22),
    )?;
    let panels = root.split_evenly((rows, cols));
    let t_max = runs
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.t_s))
        .fold(1.0f64, f64::max);
    for (run, panel) in runs.iter().zip(panels.iter()) {
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{}: spread {:.2}, mean {:.2}",
                    run.router, run.kv_spread_mean, run.kv_mean
                ),
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..t_max, 0.0..1.0f64)?;
        chart.configure_mesh().x_labels(6).y_labels(5).draw()?;
        let engines = run
            .samples
            .iter()
            .map(|s| s.engines.len())
            .max()
            .unwrap_or(0);
        // At most ~600 points per line and 32 lines keep the SVG small.
        let step = (run.samples.len() / 600).max(1);
        for e in 0..engines.min(32) {
            let points = run
                .samples
                .iter()
                .step_by(step)
                .filter_map(|s| s.engines.get(e).copied().flatten().map(|r| (s.t_s, r.kv)));
            chart.draw_series(LineSeries::new(points, colour(e).stroke_width(1)))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Grouped bars: one group per category, one bar per series.
pub fn bars(
    path: &Path,
    title: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
    y_desc: &str,
    log: bool,
) -> PlotResult {
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let values = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|v| v.is_finite() && *v > 0.0);
    let max = values.clone().fold(1e-9f64, f64::max) * 1.3;
    let min = values.fold(f64::MAX, f64::min).min(max / 10.0) * 0.8;
    let n = categories.len().max(1);
    let k = series.len().max(1);
    let width = 1.0 / (k as f64 + 1.0);
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(36)
        .y_label_area_size(60);
    let label = |x: &f64| {
        let i = x.floor() as usize;
        if (x - x.floor() - 0.5).abs() < 1e-6 {
            categories.get(i).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let rect = |i: usize, j: usize, v: f64, base: f64| {
        let x0 = i as f64 + width * (j as f64 + 0.5);
        Rectangle::new([(x0, base), (x0 + width, v.max(base))], colour(j).filled())
    };
    if log {
        let mut chart = builder.build_cartesian_2d(0.0..n as f64, (min..max).log_scale())?;
        chart
            .configure_mesh()
            .x_labels(2 * n + 1)
            .x_label_formatter(&label)
            .y_desc(y_desc)
            .disable_x_mesh()
            .draw()?;
        for (j, (name, v)) in series.iter().enumerate() {
            let c = colour(j);
            chart
                .draw_series(
                    v.iter()
                        .enumerate()
                        .filter(|(_, v)| v.is_finite() && **v > 0.0)
                        .map(|(i, &v)| rect(i, j, v, min)),
                )?
                .label(name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    } else {
        let mut chart = builder.build_cartesian_2d(0.0..n as f64, 0.0..max)?;
        chart
            .configure_mesh()
            .x_labels(2 * n + 1)
            .x_label_formatter(&label)
            .y_desc(y_desc)
            .disable_x_mesh()
            .draw()?;
        for (j, (name, v)) in series.iter().enumerate() {
            let c = colour(j);
            chart
                .draw_series(
                    v.iter()
                        .enumerate()
                        .filter(|(_, v)| v.is_finite())
                        .map(|(i, &v)| rect(i, j, v, 0.0)),
                )?
                .label(name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Lines over a log-scaled x axis, one per series (NaN points skipped).
pub fn lines(
    path: &Path,
    title: &str,
    xs: &[f64],
    series: &[(String, Vec<f64>)],
    x_desc: &str,
    y_desc: &str,
) -> PlotResult {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_min = xs.iter().copied().fold(f64::MAX, f64::min).max(1.0) * 0.8;
    let x_max = xs.iter().copied().fold(1.0f64, f64::max) * 1.25;
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|v| v.is_finite())
        .fold(1e-9f64, f64::max)
        * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    for (j, (name, v)) in series.iter().enumerate() {
        let c = colour(j);
        let points: Vec<(f64, f64)> = xs
            .iter()
            .copied()
            .zip(v.iter().copied())
            .filter(|(_, y)| y.is_finite())
            .collect();
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
