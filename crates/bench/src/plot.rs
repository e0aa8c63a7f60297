//! The bench's charts, as SVG text drawn with `plotters` (SVG backend only: no fonts, no system
//! libraries): bars per configuration for W1, and time series that overlay the configurations
//! for W4 and W6, as the field report's vdbench charts compare writeback, deferred and
//! writethrough on one chart.
//!
//! Every chart has a title, labelled axes with ticks and a light grid, and one legend for the
//! whole figure (a coloured swatch and the configuration's name per entry). A line is one
//! `<polyline>` (the legend uses swatches, not line segments, so a chart has one polyline per
//! series drawn); a bar is one `<rect>`.
//!
//! Invariants: only the points and values given are drawn (nothing is smoothed or
//! extrapolated); a configuration in the legend whose line is missing from a panel is named
//! there in a "no data for ..." note with the caller's reason, in the middle of the panel when
//! nothing else is drawn in it (the axes still are); a series of one or two points also gets a
//! marker per point, so it is visible even where a line is not; the palette is the caller's,
//! so one configuration has one colour in every chart of a run; a panel with a log axis
//! (IOPS, which differ by orders of magnitude between configurations) spans whole powers of
//! ten from below its smallest positive value, and draws a 0 on its floor.

use anyhow::{anyhow, Result};
use plotters::chart::MeshStyle;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A colour, as red, green, blue.
pub type Rgb = (u8, u8, u8);

/// Width of every chart, in pixels.
const WIDTH: u32 = 900;
/// Height of one time-series panel.
const PANEL_HEIGHT: u32 = 230;
/// Height of the bar chart's plotting area, axes included.
const BARS_HEIGHT: u32 = 420;
/// Room for the title, and for one row of the legend.
const TITLE_HEIGHT: u32 = 30;
const LEGEND_ROW: u32 = 22;
const FONT: &str = "sans-serif";

/// One legend entry: a configuration and its colour.
#[derive(Clone, Copy, Debug)]
pub struct Key<'a> {
    pub label: &'a str,
    pub color: Rgb,
}

/// One configuration's line in a time-series panel: (seconds, value) points.
pub struct Line<'a> {
    pub key: Key<'a>,
    pub points: &'a [(f64, f64)],
    /// Why there may be no points, for the panel's "no data for ..." note.
    pub empty_why: &'a str,
}

/// One panel of a time-series figure; the figure's panels share the time axis.
pub struct Panel<'a> {
    /// The y axis' description, with its unit.
    pub y_desc: &'a str,
    /// The top of the y axis when it is fixed (a percentage), else from the data.
    pub y_max: Option<f64>,
    /// A logarithmic y axis (rates that differ by orders of magnitude between
    /// configurations: on a linear axis every line under the fastest one lies flat on the
    /// floor). Its bottom is the power of ten below the smallest positive value; a value of 0
    /// is drawn on the bottom.
    pub log: bool,
    pub lines: Vec<Line<'a>>,
}

/// One configuration's bars: a value per group (None: not measured, no bar).
pub struct BarSeries<'a> {
    pub key: Key<'a>,
    pub values: Vec<Option<f64>>,
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing a chart: {e}")
}

fn color((r, g, b): Rgb) -> RGBColor {
    RGBColor(r, g, b)
}

/// A tick label: no decimals from 10 on, thousands as "k" from 10,000 on.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if a >= 10.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Rows the legend needs at `WIDTH` (entries laid left to right, wrapped).
fn legend_layout<'a>(keys: &[Key<'a>]) -> Vec<Vec<(i32, Key<'a>)>> {
    let mut rows: Vec<Vec<(i32, Key<'a>)>> = vec![Vec::new()];
    let mut x = 60;
    for k in keys {
        // About 0.6 em a character (the SVG's 13-point text is 10.5 px).
        let w = 30 + (k.label.chars().count() as i32 * 6);
        if x + w > WIDTH as i32 - 20 && !rows.last().expect("one row").is_empty() {
            rows.push(Vec::new());
            x = 60;
        }
        rows.last_mut().expect("one row").push((x, *k));
        x += w + 16;
    }
    rows
}

/// The title and the legend across the top of `area`; returns the height they took.
fn header<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    keys: &[Key],
) -> Result<u32> {
    area.draw(&Text::new(
        title.to_string(),
        (WIDTH as i32 / 2, 8),
        (FONT, 17)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Top)),
    ))
    .map_err(err)?;
    let rows = legend_layout(keys);
    for (r, row) in rows.iter().enumerate() {
        let y = (TITLE_HEIGHT + r as u32 * LEGEND_ROW) as i32 + 4;
        for (x, k) in row {
            area.draw(&Rectangle::new(
                [(*x, y), (*x + 18, y + 12)],
                color(k.color).filled(),
            ))
            .map_err(err)?;
            area.draw(&Text::new(
                k.label.to_string(),
                (*x + 24, y + 6),
                (FONT, 13)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))
            .map_err(err)?;
        }
    }
    Ok(TITLE_HEIGHT + rows.len() as u32 * LEGEND_ROW + 8)
}

/// A chart's frame in `area`: margins, and room for the axes' labels (`x_labels_px` high
/// below, for one or two lines of text).
fn frame<'a, 'b, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, plotters::coord::Shift>,
    x_labels_px: u32,
) -> ChartBuilder<'a, 'b, DB> {
    let mut b = ChartBuilder::on(area);
    b.margin_left(10)
        .margin_right(25)
        .margin_top(6)
        .margin_bottom(8)
        .x_label_area_size(x_labels_px)
        .y_label_area_size(70);
    b
}

/// Every chart's grid and label styles: light grey lines at the ticks, one faint line
/// between, 12-point tick labels and 13-point axis descriptions.
fn grid<'m, 'a, 'b, X, Y, DB>(
    m: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB>
where
    X: plotters::coord::ranged1d::Ranged,
    Y: plotters::coord::ranged1d::Ranged,
    DB: DrawingBackend,
{
    m.max_light_lines(1)
        .light_line_style(RGBColor(240, 240, 240))
        .bold_line_style(RGBColor(205, 205, 205))
        .axis_desc_style((FONT, 13))
        .label_style((FONT, 12))
}

/// The "no data for ..." notes of a panel: the lines without points, grouped by reason.
fn empty_notes(lines: &[Line]) -> Vec<String> {
    let mut whys: Vec<&str> = Vec::new();
    for l in lines.iter().filter(|l| l.points.is_empty()) {
        if !whys.contains(&l.empty_why) {
            whys.push(l.empty_why);
        }
    }
    whys.iter()
        .map(|why| {
            let who: Vec<&str> = lines
                .iter()
                .filter(|l| l.points.is_empty() && l.empty_why == *why)
                .map(|l| l.key.label)
                .collect();
            let note = format!("no data for {}", who.join(", "));
            if why.is_empty() {
                note
            } else {
                format!("{note}: {why}")
            }
        })
        .collect()
}

/// Notes in grey, one a line, from `at`: centred there, or right-aligned below it.
fn notes<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    at: (i32, i32),
    centred: bool,
    lines: &[String],
) -> Result<()> {
    let (pos, size, step) = if centred {
        (Pos::new(HPos::Center, VPos::Center), 14, 20)
    } else {
        (Pos::new(HPos::Right, VPos::Top), 12, 16)
    };
    let first = if centred {
        at.1 - (lines.len() as i32 - 1) * step / 2
    } else {
        at.1
    };
    for (i, text) in lines.iter().enumerate() {
        area.draw(&Text::new(
            text.clone(),
            (at.0, first + i as i32 * step),
            (FONT, size)
                .into_font()
                .color(&RGBColor(110, 110, 110))
                .pos(pos),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// Stacked panels over a shared time axis (seconds), each overlaying the lines of the
/// configurations that have points in it, under one legend of `keys`.
pub fn time_series(title: &str, keys: &[Key], panels: &[Panel]) -> Result<String> {
    let legend_rows = legend_layout(keys).len() as u32;
    let top = TITLE_HEIGHT + legend_rows * LEGEND_ROW + 8;
    let height = top + PANEL_HEIGHT * panels.len().max(1) as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (head, body) = root.split_vertically(header(&root, title, keys)?);
        let _ = head;
        let t_max = panels
            .iter()
            .flat_map(|p| &p.lines)
            .flat_map(|l| l.points.iter().map(|p| p.0))
            .fold(0.0f64, f64::max)
            .max(1.0);
        for (panel, area) in panels
            .iter()
            .zip(body.split_evenly((panels.len().max(1), 1)))
        {
            let y_data = panel
                .lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1))
                .fold(0.0f64, f64::max);
            let y_max = panel.y_max.unwrap_or((y_data * 1.1).max(1.0));
            // Draws the panel's axes and lines on `chart` (linear or logarithmic y), with
            // every y at least `floor`; whether a line was drawn.
            macro_rules! draw_panel {
                ($chart:expr, $floor:expr) => {{
                    let chart = $chart;
                    grid(&mut chart.configure_mesh())
                        .x_desc("time (s)")
                        .y_desc(panel.y_desc)
                        .x_labels(10)
                        .y_labels(6)
                        .x_label_formatter(&|v| tick(*v))
                        .y_label_formatter(&|v| tick(*v))
                        .draw()
                        .map_err(err)?;
                    let mut drawn = false;
                    for l in panel.lines.iter().filter(|l| !l.points.is_empty()) {
                        let c = color(l.key.color);
                        let points = l.points.iter().map(|&(t, y)| (t, y.max($floor)));
                        chart
                            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
                            .map_err(err)?;
                        if l.points.len() <= 2 {
                            chart
                                .draw_series(points.map(|p| Circle::new(p, 4, c.filled())))
                                .map_err(err)?;
                        }
                        drawn = true;
                    }
                    drawn
                }};
            }
            let (drawn, mid, corner) = if panel.log {
                let min = panel
                    .lines
                    .iter()
                    .flat_map(|l| l.points.iter().map(|p| p.1))
                    .filter(|&y| y > 0.0)
                    .fold(f64::INFINITY, f64::min);
                let lo = if min.is_finite() {
                    10f64.powf(min.log10().floor())
                } else {
                    1.0
                };
                let hi = 10f64.powf(y_max.max(lo * 10.0).log10().ceil());
                let mut chart = frame(&area, 38)
                    .build_cartesian_2d(0.0..t_max, (lo..hi).log_scale())
                    .map_err(err)?;
                let drawn = draw_panel!(&mut chart, lo);
                let mid = chart.backend_coord(&(t_max / 2.0, (lo * hi).sqrt()));
                (drawn, mid, chart.backend_coord(&(t_max, hi)))
            } else {
                let mut chart = frame(&area, 38)
                    .build_cartesian_2d(0.0..t_max, 0.0..y_max)
                    .map_err(err)?;
                let drawn = draw_panel!(&mut chart, f64::MIN);
                let mid = chart.backend_coord(&(t_max / 2.0, y_max / 2.0));
                (drawn, mid, chart.backend_coord(&(t_max, y_max)))
            };
            let empty = empty_notes(&panel.lines);
            if !drawn {
                let mut all = vec!["no data".to_string()];
                all.extend(empty);
                notes(&root, mid, true, &all)?;
            } else if !empty.is_empty() {
                let (x, y) = corner;
                notes(&root, (x - 8, y + 6), false, &empty)?;
            }
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Grouped bars on a logarithmic axis: one group per entry of `groups` (a label of up to two
/// lines, split at '\n'), one bar per series in each, under one legend of the series.
pub fn bars(title: &str, y_desc: &str, groups: &[String], series: &[BarSeries]) -> Result<String> {
    let keys: Vec<Key> = series.iter().map(|s| s.key).collect();
    let legend_rows = legend_layout(&keys).len() as u32;
    let height = TITLE_HEIGHT + legend_rows * LEGEND_ROW + 8 + BARS_HEIGHT;
    let values: Vec<f64> = series
        .iter()
        .flat_map(|s| s.values.iter().flatten().copied())
        .filter(|v| *v > 0.0)
        .collect();
    // Whole decades around the data, so the axis reads 1, 10, 100, ...; the bottom at least 3×
    // below the smallest bar, so that every bar shows.
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    let lo = 10f64.powf((min / 3.0).log10().floor());
    let hi = 10f64.powf(values.iter().copied().fold(0.0, f64::max).log10().ceil());
    let (lo, hi) = if values.is_empty() {
        (1.0, 10.0)
    } else if hi <= lo {
        (lo, lo * 10.0)
    } else {
        (lo, hi)
    };
    let n = groups.len().max(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (_, body) = root.split_vertically(header(&root, title, &keys)?);
        let mut chart = frame(&body, 44)
            .build_cartesian_2d(0.0..n as f64, (lo..hi).log_scale())
            .map_err(err)?;
        grid(&mut chart.configure_mesh())
            .disable_x_mesh()
            .x_labels(n + 1)
            .x_label_formatter(&|_| String::new())
            .y_desc(y_desc)
            .y_label_formatter(&|v| tick(*v))
            .draw()
            .map_err(err)?;
        let width = 0.8 / series.len().max(1) as f64;
        for (j, s) in series.iter().enumerate() {
            let c = color(s.key.color);
            let bars = s.values.iter().enumerate().filter_map(|(i, v)| {
                let v = v.filter(|v| *v > 0.0)?;
                let x0 = i as f64 + 0.1 + j as f64 * width;
                Some(Rectangle::new([(x0, lo), (x0 + width, v)], c.filled()))
            });
            chart.draw_series(bars).map_err(err)?;
        }
        for (i, g) in groups.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64 + 0.5, lo));
            for (k, line) in g.split('\n').take(2).enumerate() {
                root.draw(&Text::new(
                    line.to_string(),
                    (x, y + 8 + k as i32 * 15),
                    (FONT, 12)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Center, VPos::Top)),
                ))
                .map_err(err)?;
            }
        }
        if values.is_empty() {
            let mid = chart.backend_coord(&(n as f64 / 2.0, (lo * hi).sqrt()));
            notes(&root, mid, true, &["no data".to_string()])?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HDD: Key = Key {
        label: "hdd",
        color: (127, 127, 127),
    };
    const WB: Key = Key {
        label: "tiercache-writeback",
        color: (255, 127, 14),
    };

    fn line<'a>(key: Key<'a>, points: &'a [(f64, f64)], empty_why: &'a str) -> Line<'a> {
        Line {
            key,
            points,
            empty_why,
        }
    }

    fn count(svg: &str, what: &str) -> usize {
        svg.matches(what).count()
    }

    /// Data lines in a colour (axes and ticks are polylines too, but black and thin).
    fn lines_in(svg: &str, (r, g, b): Rgb) -> usize {
        svg.lines()
            .filter(|l| {
                l.starts_with("<polyline")
                    && l.contains(&format!(
                        "stroke=\"#{r:02X}{g:02X}{b:02X}\" stroke-width=\"2\""
                    ))
            })
            .count()
    }

    /// The text elements' contents, trimmed.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..t.find("</text>")?];
                Some(body.trim().to_string())
            })
            .collect()
    }

    /// Writes the chart for a look when TIERCACHE_PLOT_DIR is set.
    fn keep(name: &str, svg: &str) {
        if let Some(dir) = std::env::var_os("TIERCACHE_PLOT_DIR") {
            std::fs::write(std::path::Path::new(&dir).join(name), svg).unwrap();
        }
    }

    #[test]
    fn time_series_overlays_every_configuration_with_axes_and_a_legend() {
        let hdd = [(1.0, 120.0), (2.0, 110.0), (3.0, 130.0)];
        let wb = [
            (1.0, 9000.0),
            (2.0, 12000.0),
            (3.0, 11000.0),
            (4.0, 10500.0),
        ];
        let dirty = [(0.0, 0.0), (1.0, 20.0), (2.0, 41.0), (3.0, 60.0)];
        let svg = time_series(
            "W4 test",
            &[HDD, WB],
            &[
                Panel {
                    y_desc: "IOPS",
                    y_max: None,
                    log: false,
                    lines: vec![line(HDD, &hdd, ""), line(WB, &wb, "")],
                },
                Panel {
                    y_desc: "dirty (MiB)",
                    y_max: None,
                    log: false,
                    lines: vec![line(HDD, &[], "not reported"), line(WB, &dirty, "")],
                },
            ],
        )
        .unwrap();
        keep("series.svg", &svg);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let t = texts(&svg);
        // One legend entry per configuration, the title, both axes of both panels.
        for label in [
            "hdd",
            "tiercache-writeback",
            "W4 test",
            "IOPS",
            "dirty (MiB)",
        ] {
            assert_eq!(
                t.iter().filter(|s| *s == label).count(),
                1,
                "{label}: {t:?}"
            );
        }
        assert_eq!(t.iter().filter(|s| *s == "time (s)").count(), 2, "{t:?}");
        // Ticks: the time axis reaches 4 s, the IOPS axis 12,000 (shown as "12k" or below).
        assert!(t.iter().any(|s| s == "4"), "{t:?}");
        assert!(t.iter().any(|s| s.ends_with('k')), "{t:?}");
        // One line per series with points: hdd's IOPS, writeback's IOPS and dirty data.
        assert_eq!(lines_in(&svg, HDD.color), 1, "{svg}");
        assert_eq!(lines_in(&svg, WB.color), 2, "{svg}");
        // Legend swatches are rectangles, not lines.
        assert_eq!(count(&svg, "<rect"), 1 + 2, "{svg}");
        // hdd has no dirty line: the panel says so, in its corner.
        let notes: Vec<&String> = t.iter().filter(|s| s.starts_with("no data")).collect();
        assert_eq!(notes, ["no data for hdd: not reported"], "{t:?}");
    }

    /// The vertical extent, in pixels, of the data line in a colour.
    fn line_height(svg: &str, (r, g, b): Rgb) -> i64 {
        let l = svg
            .lines()
            .find(|l| {
                l.starts_with("<polyline")
                    && l.contains(&format!("stroke=\"#{r:02X}{g:02X}{b:02X}\""))
            })
            .unwrap();
        let pts = &l[l.find("points=\"").unwrap() + 8..];
        let ys: Vec<i64> = pts[..pts.find('"').unwrap()]
            .split_whitespace()
            .map(|p| p.split(',').nth(1).unwrap().parse().unwrap())
            .collect();
        ys.iter().max().unwrap() - ys.iter().min().unwrap()
    }

    #[test]
    fn a_log_axis_keeps_lines_far_below_the_fastest_visible() {
        // W6's shape: the ssd near 25k IOPS (with a second of none at all, drawn on the
        // floor), tiercache-writeback between 300 and 900.
        let ssd: Vec<(f64, f64)> = (0..20)
            .map(|t| {
                (
                    t as f64,
                    if t == 7 {
                        0.0
                    } else {
                        25_000.0 - 50.0 * t as f64
                    },
                )
            })
            .collect();
        let wb: Vec<(f64, f64)> = (0..20)
            .map(|t| (t as f64, 300.0 + 30.0 * t as f64))
            .collect();
        let panel = |log| Panel {
            y_desc: "IOPS",
            y_max: None,
            log,
            lines: vec![line(HDD, &ssd, ""), line(WB, &wb, "")],
        };
        let linear = time_series("W6 linear", &[HDD, WB], &[panel(false)]).unwrap();
        let log = time_series("W6 log", &[HDD, WB], &[panel(true)]).unwrap();
        keep("w6-linear.svg", &linear);
        keep("w6-log.svg", &log);
        // The panel is 230 px high: linear squeezes 300..900 into a few pixels on the floor;
        // on the log axis it spans half a decade of three.
        let (flat, spread) = (line_height(&linear, WB.color), line_height(&log, WB.color));
        assert!(
            flat < 8 && spread > 4 * flat,
            "linear {flat} px, log {spread} px"
        );
        // Powers of ten as ticks, from 100 (below the smallest positive value) to 100k.
        let t = texts(&log);
        for tick in ["100", "1000", "10k", "100k"] {
            assert!(t.iter().any(|s| s == tick), "{tick}: {t:?}");
        }
    }

    #[test]
    fn empty_and_short_series_say_so() {
        let one = [(0.2, 5.0)];
        let svg = time_series(
            "W4 tiny",
            &[HDD, WB],
            &[
                Panel {
                    y_desc: "IOPS",
                    y_max: None,
                    log: true,
                    lines: vec![
                        line(HDD, &[], "fio logged no full second"),
                        line(WB, &[], "fio logged no full second"),
                    ],
                },
                Panel {
                    y_desc: "cache in use (%)",
                    y_max: Some(100.0),
                    log: false,
                    lines: vec![line(WB, &one, "")],
                },
            ],
        )
        .unwrap();
        keep("empty.svg", &svg);
        let t = texts(&svg);
        for note in [
            "no data",
            "no data for hdd, tiercache-writeback: fio logged no full second",
        ] {
            assert!(t.iter().any(|s| s == note), "{note}: {t:?}");
        }
        // The single sample is a line of one point and a visible marker.
        assert_eq!(lines_in(&svg, HDD.color), 0);
        assert_eq!(lines_in(&svg, WB.color), 1);
        assert_eq!(count(&svg, "<circle"), 1);
        assert!(t.iter().any(|s| s == "100"), "{t:?}");
    }

    #[test]
    fn bars_one_per_measured_value_on_a_log_axis() {
        let groups = vec![
            "read-seq\ncold".to_string(),
            "read-random\ncold".to_string(),
        ];
        let svg = bars(
            "W1 test",
            "IOPS (log scale)",
            &groups,
            &[
                BarSeries {
                    key: HDD,
                    values: vec![Some(150.0), Some(90.0)],
                },
                BarSeries {
                    key: WB,
                    values: vec![Some(20_000.0), None],
                },
            ],
        )
        .unwrap();
        keep("bars.svg", &svg);
        let t = texts(&svg);
        for label in [
            "hdd",
            "tiercache-writeback",
            "read-seq",
            "read-random",
            "cold",
        ] {
            assert!(t.iter().any(|s| s == label), "{label}: {t:?}");
        }
        assert!(t.iter().any(|s| s == "IOPS (log scale)"));
        // Decades from 10 to 100,000.
        for decade in ["10", "100", "100k"] {
            assert!(t.iter().any(|s| s == decade), "{decade}: {t:?}");
        }
        // Background, two legend swatches, three bars.
        assert_eq!(count(&svg, "<rect"), 1 + 2 + 3, "{svg}");
        let empty = bars("W1", "IOPS", &groups, &[]).unwrap();
        assert!(texts(&empty).iter().any(|s| s == "no data"));
    }
}
