//! SVG plots of a suite's latency distributions, one file per picture:
//! `cdf-<workload>.svg` overlays every target's latency CDF (log latency axis, so a 10× tail
//! is as visible as a 10× median), and `hist-<workload>-<target>.svg` shows one target's
//! latency histogram in log-spaced buckets. Drawn from the stored results alone, so old JSON
//! files can be plotted again.

use super::results::{RunResult, SuiteResults};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

fn file_name(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn err(e: impl std::fmt::Display) -> String {
    format!("plotting: {e}")
}

/// Microsecond bounds of a set of runs' latencies, padded for a log axis.
fn bounds_us(runs: &[&RunResult]) -> Option<(f64, f64)> {
    let values = runs
        .iter()
        .flat_map(|r| r.cdf.iter().map(|&(_, ns)| ns as f64 / 1e3));
    let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    (hi > 0.0).then(|| ((lo * 0.8).max(0.1), hi * 1.25))
}

fn cdf_plot(path: &Path, workload: &str, runs: &[&RunResult]) -> Result<(), String> {
    let Some((lo, hi)) = bounds_us(runs) else {
        return Ok(());
    };
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{workload}: latency CDF"), ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..100f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency (µs, log scale)")
        .y_desc("percentile")
        .draw()
        .map_err(err)?;
    for (i, run) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points = run.cdf.iter().map(|&(p, ns)| (ns as f64 / 1e3, p));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(format!(
                "{} (p50 {:.0} µs, p99 {:.0} µs)",
                run.target,
                run.latency.p50_ns as f64 / 1e3,
                run.latency.p99_ns as f64 / 1e3
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

fn histogram_plot(path: &Path, run: &RunResult, color: RGBAColor) -> Result<(), String> {
    if run.buckets.is_empty() {
        return Ok(());
    }
    // Bucket i spans (previous upper bound, its upper bound].
    let mut bars = Vec::with_capacity(run.buckets.len());
    let mut lower_us = (run.buckets[0].0 as f64 / 1e3 / 1.25).max(0.01);
    for &(upper_ns, count) in &run.buckets {
        let upper_us = upper_ns as f64 / 1e3;
        if count > 0 {
            bars.push((
                lower_us,
                upper_us,
                count as f64 * 100.0 / run.ops.max(1) as f64,
            ));
        }
        lower_us = upper_us;
    }
    let lo = bars.first().map_or(0.1, |b| b.0).max(0.01);
    let hi = bars.last().map_or(1.0, |b| b.1) * 1.1;
    let top = bars.iter().map(|b| b.2).fold(0.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (960, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{} on {}: latency histogram ({} ops)",
                run.workload, run.target, run.ops
            ),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..top.max(1.0))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency (µs, log scale)")
        .y_desc("% of operations")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(
            bars.iter()
                .map(|&(a, b, share)| Rectangle::new([(a, 0.0), (b, share)], color.filled())),
        )
        .map_err(err)?;
    root.present().map_err(err)
}

/// Writes every plot for `results` into `dir`; returns the files.
pub fn write_plots(results: &SuiteResults, dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    let targets = results.targets();
    for workload in results.workloads() {
        // The first repeat of each target stands for it in the pictures.
        let runs: Vec<&RunResult> = targets
            .iter()
            .filter_map(|t| results.runs_of(&workload, t).next())
            .collect();
        let path = dir.join(format!("cdf-{}.svg", file_name(&workload)));
        cdf_plot(&path, &workload, &runs)?;
        files.push(path);
        for (i, run) in runs.iter().enumerate() {
            let path = dir.join(format!(
                "hist-{}-{}.svg",
                file_name(&workload),
                file_name(&run.target)
            ));
            histogram_plot(&path, run, Palette99::pick(i).to_rgba())?;
            files.push(path);
        }
    }
    Ok(files)
}
