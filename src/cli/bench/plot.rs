//! A chart as an SVG file, written by hand: panels stacked one above the other on one time
//! axis, each with its own y axis, grid, lines and legend, and events marked across all of
//! them (a vertical line where each began, a light band while it lasted, its label above).
//! The fleet run draws its throughput, latency and backlog with it; a picture of a few
//! hundred points needs no plotting library.

use std::fmt::Write;

/// What to draw.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    /// The shared x axis: its label (e.g. `seconds since the load began`) and its end.
    pub x_label: String,
    pub x_max: f64,
    pub panels: Vec<Panel>,
    pub markers: Vec<Marker>,
}

/// One panel: its lines over the shared x axis.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Shown above the panel, with the unit (`p99 latency, ms`).
    pub title: String,
    pub series: Vec<Series>,
}

/// One line. A point whose y is `None` (nothing measured then) breaks the line.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, Option<f64>)>,
}

/// An event: a vertical line at `at` across every panel, and a band until `until`.
#[derive(Debug, Clone)]
pub struct Marker {
    pub at: f64,
    pub until: Option<f64>,
    pub label: String,
}

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 24.0;
/// Above the first panel: the chart's title and two rows of marker labels.
const TOP: f64 = 74.0;
const PANEL_HEIGHT: f64 = 170.0;
/// Between panels: the next panel's title and legend.
const GAP: f64 = 34.0;
const BOTTOM: f64 = 46.0;
/// The lines' colours, in order within a panel.
const COLOURS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
/// About how many ticks an axis gets.
const Y_TICKS: f64 = 4.0;
const X_TICKS: f64 = 10.0;

/// The chart as an SVG document.
pub fn svg(chart: &Chart) -> String {
    let panels = chart.panels.len().max(1);
    let height = panel_top(panels - 1) + PANEL_HEIGHT + BOTTOM;
    let plot_width = WIDTH - LEFT - RIGHT;
    let x_max = if chart.x_max > 0.0 { chart.x_max } else { 1.0 };
    let x = |v: f64| LEFT + v.clamp(0.0, x_max) / x_max * plot_width;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape(&chart.title)
    );
    let x_step = nice_step(x_max / X_TICKS);
    for (i, panel) in chart.panels.iter().enumerate() {
        draw_panel(&mut out, panel, i, &x, x_max, x_step, i + 1 == panels);
    }
    let bottom = panel_top(panels - 1) + PANEL_HEIGHT;
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_width / 2.0,
        bottom + 36.0,
        escape(&chart.x_label)
    );
    for (i, marker) in chart.markers.iter().enumerate() {
        let (from, until) = (x(marker.at), marker.until.map(x));
        if let Some(until) = until.filter(|u| *u > from) {
            for p in 0..panels {
                let _ = writeln!(
                    out,
                    r##"<rect x="{from:.1}" y="{:.1}" width="{:.1}" height="{PANEL_HEIGHT}" fill="#888888" fill-opacity="0.13"/>"##,
                    panel_top(p),
                    until - from
                );
            }
        }
        let label_y = TOP - 26.0 + 14.0 * (i % 2) as f64;
        let _ = writeln!(
            out,
            r##"<line x1="{from:.1}" y1="{:.1}" x2="{from:.1}" y2="{bottom:.1}" stroke="#444444" stroke-dasharray="4 3"/>"##,
            label_y + 3.0
        );
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{label_y:.1}" fill="#444444">{}</text>"##,
            from + 3.0,
            escape(&marker.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Where panel `i`'s plot area begins.
fn panel_top(i: usize) -> f64 {
    TOP + GAP + i as f64 * (PANEL_HEIGHT + GAP)
}

fn draw_panel(
    out: &mut String,
    panel: &Panel,
    i: usize,
    x: &dyn Fn(f64) -> f64,
    x_max: f64,
    x_step: f64,
    last: bool,
) {
    let top = panel_top(i);
    let bottom = top + PANEL_HEIGHT;
    let right = WIDTH - RIGHT;
    let y_data_max = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().filter_map(|(_, y)| *y))
        .filter(|y| y.is_finite())
        .fold(0.0_f64, f64::max);
    let y_step = nice_step(if y_data_max > 0.0 {
        y_data_max / Y_TICKS
    } else {
        1.0
    });
    let y_max = (y_data_max / y_step).ceil().max(1.0) * y_step;
    let y = |v: f64| bottom - v.clamp(0.0, y_max) / y_max * PANEL_HEIGHT;
    let _ = writeln!(out, r#"<g class="panel">"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{:.1}" font-weight="bold">{}</text>"#,
        top - 9.0,
        escape(&panel.title)
    );
    // The legend, after the title.
    let mut legend_x = LEFT + 8.0 * panel.title.chars().count() as f64 + 28.0;
    for (n, series) in panel.series.iter().enumerate() {
        let colour = COLOURS[n % COLOURS.len()];
        let _ = writeln!(
            out,
            r#"<line x1="{legend_x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2"/>"#,
            top - 13.0,
            legend_x + 18.0,
            top - 13.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            legend_x + 22.0,
            top - 9.0,
            escape(&series.name)
        );
        legend_x += 22.0 + 6.5 * series.name.chars().count() as f64 + 20.0;
    }
    // Grid and y ticks.
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let ty = y(tick);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{right}" y2="{ty:.1}" stroke="#e4e4e4"/>"##
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            ty + 4.0,
            tick_label(tick, y_step)
        );
        tick += y_step;
    }
    let mut tick = 0.0;
    while tick <= x_max + x_step / 1000.0 {
        let tx = x(tick);
        let _ = writeln!(
            out,
            r##"<line x1="{tx:.1}" y1="{top:.1}" x2="{tx:.1}" y2="{bottom:.1}" stroke="#f0f0f0"/>"##
        );
        if last {
            let _ = writeln!(
                out,
                r#"<text x="{tx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                bottom + 16.0,
                tick_label(tick, x_step)
            );
        }
        tick += x_step;
    }
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{:.1}" height="{PANEL_HEIGHT}" fill="none" stroke="#999999"/>"##,
        right - LEFT
    );
    for (n, series) in panel.series.iter().enumerate() {
        let path = path(&series.points, x, &y);
        if !path.is_empty() {
            let _ = writeln!(
                out,
                r#"<path d="{path}" fill="none" stroke="{}" stroke-width="1.6" stroke-linejoin="round"/>"#,
                COLOURS[n % COLOURS.len()]
            );
        }
    }
    let _ = writeln!(out, "</g>");
}

/// An SVG path through the points, a new stroke after each point without a value.
fn path(points: &[(f64, Option<f64>)], x: &dyn Fn(f64) -> f64, y: &dyn Fn(f64) -> f64) -> String {
    let mut d = String::new();
    let mut pen_down = false;
    for (px, py) in points {
        match py.filter(|v| v.is_finite()) {
            Some(py) if px.is_finite() => {
                let _ = write!(
                    d,
                    "{}{:.1} {:.1} ",
                    if pen_down { "L" } else { "M" },
                    x(*px),
                    y(py)
                );
                pen_down = true;
            }
            _ => pen_down = false,
        }
    }
    d.trim_end().to_string()
}

/// A step of 1, 2, 2.5 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|step| *step >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude)
}

/// A tick's value with as many decimals as its step needs (0.25: two).
fn tick_label(value: f64, step: f64) -> String {
    let decimals = (0..6)
        .find(|d| {
            let scaled = step * 10f64.powi(*d);
            (scaled - scaled.round()).abs() < 1e-6
        })
        .unwrap_or(6) as usize;
    format!("{value:.decimals$}")
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_round_numbers_at_least_the_raw_step() {
        for (raw, step) in [
            (0.0, 1.0),
            (-3.0, 1.0),
            (f64::NAN, 1.0),
            (0.7, 1.0),
            (1.0, 1.0),
            (1.2, 2.0),
            (2.2, 2.5),
            (3.0, 5.0),
            (7.0, 10.0),
            (16.5, 20.0),
            (240.0, 250.0),
            (0.03, 0.05),
        ] {
            let got = nice_step(raw);
            assert!((got - step).abs() < 1e-9, "{raw}: {got}, not {step}");
        }
    }

    #[test]
    fn tick_labels_have_the_decimals_their_step_needs() {
        assert_eq!(tick_label(20.0, 10.0), "20");
        assert_eq!(tick_label(0.5, 0.5), "0.5");
        assert_eq!(tick_label(0.75, 0.25), "0.75");
        assert_eq!(tick_label(0.05, 0.05), "0.05");
    }

    fn chart() -> Chart {
        let line = |name: &str, points: Vec<(f64, Option<f64>)>| Series {
            name: name.into(),
            points,
        };
        Chart {
            title: "fleet <run> & churn".into(),
            x_label: "seconds".into(),
            x_max: 100.0,
            panels: vec![
                Panel {
                    title: "completed/s".into(),
                    series: vec![line(
                        "completed",
                        (0..=100).map(|t| (t as f64, Some(5.0))).collect(),
                    )],
                },
                Panel {
                    title: "p99 latency, ms".into(),
                    series: vec![line(
                        "p99",
                        vec![
                            (0.0, Some(900.0)),
                            (1.0, None),
                            (2.0, Some(1200.0)),
                            (3.0, Some(f64::NAN)),
                        ],
                    )],
                },
                Panel {
                    title: "backlog".into(),
                    series: vec![
                        line("in flight", vec![(0.0, Some(3.0)), (50.0, Some(7.0))]),
                        line("queue pending", vec![]),
                    ],
                },
            ],
            markers: vec![
                Marker {
                    at: 20.0,
                    until: Some(35.0),
                    label: "rolling restart".into(),
                },
                Marker {
                    at: 60.0,
                    until: None,
                    label: "gateway \"2\" killed".into(),
                },
            ],
        }
    }

    #[test]
    fn a_chart_has_its_panels_lines_legend_and_markers() {
        let svg = svg(&chart());
        assert!(
            svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
            "{svg}"
        );
        assert!(svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<g class=\"panel\">").count(), 3);
        // One path per series with points: the empty one draws nothing.
        assert_eq!(svg.matches("<path ").count(), 3);
        // The gap breaks the p99 line: two strokes, and NaN never reaches the file.
        let p99 = svg
            .lines()
            .filter(|l| l.starts_with("<path "))
            .nth(1)
            .expect("the p99 line");
        assert_eq!(p99.matches('M').count(), 2, "{p99}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        // Titles and labels escaped; the legend names every series.
        assert!(svg.contains("fleet &lt;run&gt; &amp; churn"));
        assert!(svg.contains("gateway &quot;2&quot; killed"));
        for name in ["completed", "p99", "in flight", "queue pending"] {
            assert!(svg.contains(&format!(">{name}</text>")), "{name}");
        }
        // Each marker's line, and a band in every panel for the one that lasted.
        assert_eq!(svg.matches("stroke-dasharray").count(), 2);
        assert_eq!(svg.matches("fill-opacity=\"0.13\"").count(), 3);
        // The y axis of the latency panel reaches past its highest point.
        assert!(
            svg.contains(">1200</text>") || svg.contains(">1500</text>"),
            "{svg}"
        );
    }

    #[test]
    fn a_chart_without_data_still_draws() {
        let empty = Chart {
            title: String::new(),
            x_label: String::new(),
            x_max: 0.0,
            panels: vec![Panel {
                title: "nothing".into(),
                series: vec![],
            }],
            markers: vec![],
        };
        let svg = svg(&empty);
        assert!(svg.contains("<g class=\"panel\">") && svg.ends_with("</svg>\n"));
        assert!(!svg.contains("NaN"));
    }
}
