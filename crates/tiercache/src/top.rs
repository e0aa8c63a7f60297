//! `tiercache top`: a live view of a running server, refreshed every second from the admin
//! socket's `metrics` request (`crate::metrics::Sample`): per volume, reads and writes per
//! second by result with their MiB/s, the hit ratio, latency percentiles, dirty data and its
//! trend, writeback, and the cache set's occupancy, health and connections.
//!
//! Rates are differences between two samples divided by the server's own clock between them
//! (`uptime_seconds`), so a slow admin round trip does not skew them; percentiles come from
//! the difference of the latency histograms, so they describe the last interval only.
//! `--once` prints the same view as plain text from two samples `interval` apart, for
//! scripts and tests.
//!
//! Invariants: every line fits in 80 columns (the live view draws inside a border, so its
//! lines are at most 78), whatever the numbers: each column has a fixed width and its number
//! is formatted to fit it (k/M suffixes), and a name that is too long is cut; the live view
//! keeps at most `TREND_SAMPLES` samples of each volume's dirty data for the trend; the
//! terminal is restored when the view ends, also on error and panic (`ratatui::restore`).

use crate::metrics::hist::HistSnapshot;
use crate::metrics::{Sample, VolumeSample};
use crate::units::human;
use anyhow::{bail, Context, Result};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use std::collections::{BTreeMap, VecDeque};
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

/// Dirty-data samples kept per volume for the trend (one per refresh).
pub const TREND_SAMPLES: usize = 30;
/// Width of a row of the view: 80 columns less the live view's border.
pub const WIDTH: usize = 78;

const SPARK: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
const NAME_WIDTH: usize = 10;

/// Asks the server for one sample.
pub fn fetch(admin: &Path) -> Result<Sample> {
    let r = crate::admin::request(admin, &serde_json::json!({"cmd": "metrics"}), &mut |_| {})?;
    serde_json::from_value(r["metrics"].clone()).context("reading the server's metrics reply")
}

/// One volume over one interval, ready to print.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeView {
    pub name: String,
    pub mode: String,
    pub state: String,
    /// Reads per second: hit, miss, bypass (and their MiB/s together).
    pub reads: [f64; 3],
    pub read_mib_s: f64,
    /// Writes per second: writeback, writethrough, bypass (and their MiB/s together).
    pub writes: [f64; 3],
    pub write_mib_s: f64,
    /// Failed requests per second (all operations).
    pub errors: f64,
    /// The engine's hits over hits and misses in the interval (`None`: no such reads).
    pub hit_ratio: Option<f64>,
    /// p50 and p99 in seconds over the interval.
    pub read_latency: Option<(f64, f64)>,
    pub write_latency: Option<(f64, f64)>,
    pub dirty_bytes: u64,
    /// Change of dirty data per second over the trend window.
    pub dirty_per_s: f64,
    /// Dirty data over the trend window, oldest first.
    pub dirty_trend: Vec<u64>,
    pub writeback: String,
    pub writeback_bytes_s: f64,
    pub cached_bytes: u64,
    pub size_bytes: u64,
}

fn series<'a>(v: &'a VolumeSample, op: &str, result: &str) -> Option<&'a HistSnapshot> {
    v.requests
        .iter()
        .find(|s| s.op == op && s.result == result)
        .map(|s| &s.latency)
}

fn series_bytes(v: &VolumeSample, op: &str) -> u64 {
    v.requests
        .iter()
        .filter(|s| s.op == op && s.result != "error")
        .map(|s| s.bytes)
        .sum()
}

/// Everything of `op` except errors, merged.
fn merged(v: &VolumeSample, op: &str) -> HistSnapshot {
    v.requests
        .iter()
        .filter(|s| s.op == op && s.result != "error")
        .fold(HistSnapshot::default(), |acc, s| acc.plus(&s.latency))
}

fn counter(v: &VolumeSample, k: &str) -> u64 {
    v.counters.get(k).copied().unwrap_or(0)
}

impl VolumeView {
    /// The view of `now` since `before` (same volume, by uuid); `trend` is the dirty data of
    /// earlier refreshes with their times (oldest first; may be empty).
    pub fn of(before: &VolumeSample, now: &VolumeSample, dt: f64, trend: &[(f64, u64)]) -> Self {
        let dt = dt.max(1e-3);
        let rate = |op: &str, result: &str| {
            let c = |v| series(v, op, result).map_or(0, HistSnapshot::count);
            c(now).saturating_sub(c(before)) as f64 / dt
        };
        let mib_s = |op| {
            series_bytes(now, op).saturating_sub(series_bytes(before, op)) as f64
                / dt
                / (1u64 << 20) as f64
        };
        let pct = |op| {
            let h = merged(now, op).since(&merged(before, op));
            Some((h.quantile(0.5)?, h.quantile(0.99)?))
        };
        let delta = |k| counter(now, k).saturating_sub(counter(before, k));
        let (hits, misses) = (delta("cache_hits"), delta("cache_misses"));
        let errors: u64 = now
            .requests
            .iter()
            .filter(|s| s.result == "error")
            .map(|s| {
                let b = series(before, &s.op, "error").map_or(0, HistSnapshot::count);
                s.latency.count().saturating_sub(b)
            })
            .sum();
        let (dirty_per_s, dirty_trend) = match trend.first() {
            Some(&(t0, d0)) if trend.len() > 1 => {
                let (t1, d1) = trend[trend.len() - 1];
                (
                    (d1 as f64 - d0 as f64) / (t1 - t0).max(1e-3),
                    trend.iter().map(|&(_, d)| d).collect(),
                )
            }
            _ => (
                (now.dirty_bytes as f64 - before.dirty_bytes as f64) / dt,
                vec![before.dirty_bytes, now.dirty_bytes],
            ),
        };
        let wb = &now.writeback;
        VolumeView {
            name: now.name.clone(),
            mode: match now.cache_mode.as_str() {
                "writethrough" => "wt",
                "writeback" => "wb",
                "writearound" => "wa",
                "none" => "none",
                other => other,
            }
            .to_string(),
            state: now.state.clone(),
            reads: [
                rate("read", "hit"),
                rate("read", "miss"),
                rate("read", "bypass"),
            ],
            read_mib_s: mib_s("read"),
            writes: [
                rate("write", "writeback"),
                rate("write", "writethrough"),
                rate("write", "bypass"),
            ],
            write_mib_s: mib_s("write"),
            errors: errors as f64 / dt,
            hit_ratio: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
            read_latency: pct("read"),
            write_latency: pct("write"),
            dirty_bytes: now.dirty_bytes,
            dirty_per_s,
            dirty_trend,
            writeback: match wb.state() {
                "active" => wb.rate.clone(),
                s => s.to_string(),
            },
            writeback_bytes_s: delta("writeback_bytes") as f64 / dt,
            cached_bytes: now.cached_bytes,
            size_bytes: now.size_bytes,
        }
    }
}

/// A rate in at most 6 columns: "123", "12.3k", "1.2M".
fn count_rate(v: f64) -> String {
    if v < 9_999.5 {
        format!("{v:.0}")
    } else if v < 999_500.0 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{:.1}M", v / 1e6)
    }
}

/// MiB/s in at most 7 columns.
fn mib_rate(v: f64) -> String {
    if v < 99_999.5 {
        format!("{v:.1}")
    } else {
        format!("{:.0}k", v / 1024.0)
    }
}

/// Seconds as "85µs", "1.2ms", "3.40s".
fn secs(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0}µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{s:.2}s")
    }
}

fn signed_bytes_s(v: f64) -> String {
    let sign = if v < 0.0 { "-" } else { "+" };
    format!("{sign}{}/s", human(v.abs() as u64))
}

fn sparkline(values: &[u64]) -> String {
    let (lo, hi) = (
        values.iter().copied().min().unwrap_or(0),
        values.iter().copied().max().unwrap_or(0),
    );
    values
        .iter()
        .map(|&v| {
            if hi == lo {
                SPARK[if hi == 0 { 0 } else { 3 }]
            } else {
                SPARK[(u128::from(v - lo) * 7 / u128::from(hi - lo)) as usize]
            }
        })
        .collect()
}

fn cut(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(width - 1).collect();
        t.push('~');
        t
    }
}

/// The column heads of the volume rows.
pub fn header() -> String {
    format!(
        "{:<NAME_WIDTH$} {:<4} {:>4} {:>6} {:>6} {:>6} {:>7} {:>6} {:>6} {:>6} {:>7}",
        "VOLUME",
        "MODE",
        "HIT%",
        "R hit",
        "R miss",
        "R byp",
        "R MiB/s",
        "W wb",
        "W wt",
        "W byp",
        "W MiB/s"
    )
}

/// Three lines per volume (see `header` for the first).
pub fn volume_lines(v: &VolumeView) -> [String; 3] {
    let hit = v
        .hit_ratio
        .map_or("-".to_string(), |r| format!("{:.0}", r * 100.0));
    let first = format!(
        "{:<NAME_WIDTH$} {:<4} {:>4} {:>6} {:>6} {:>6} {:>7} {:>6} {:>6} {:>6} {:>7}",
        cut(&v.name, NAME_WIDTH),
        cut(&v.mode, 4),
        hit,
        count_rate(v.reads[0]),
        count_rate(v.reads[1]),
        count_rate(v.reads[2]),
        mib_rate(v.read_mib_s),
        count_rate(v.writes[0]),
        count_rate(v.writes[1]),
        count_rate(v.writes[2]),
        mib_rate(v.write_mib_s),
    );
    let lat = |l: Option<(f64, f64)>| {
        l.map_or("-".to_string(), |(p50, p99)| {
            format!("p50 {} p99 {}", secs(p50), secs(p99))
        })
    };
    let mut second = format!(
        "  latency read {:<22} write {:<22}",
        lat(v.read_latency),
        lat(v.write_latency)
    );
    if v.errors > 0.0 {
        second = format!("{} errors/s {}", second.trim_end(), count_rate(v.errors));
    }
    let third = format!(
        "  dirty {} {} {}  wb {} {}/s  cached {} {}",
        human(v.dirty_bytes),
        signed_bytes_s(v.dirty_per_s),
        sparkline(&v.dirty_trend),
        v.writeback,
        human(v.writeback_bytes_s as u64),
        human(v.cached_bytes),
        v.state
    );
    [
        cut(&first, WIDTH),
        cut(second.trim_end(), WIDTH),
        cut(&third, WIDTH),
    ]
}

/// The lines above the volumes: the cache set's occupancy and health, connections.
pub fn summary_lines(now: &Sample, dt: f64) -> Vec<String> {
    let mut out = Vec::new();
    match (&now.cache_set, &now.without_cache) {
        (Some(c), _) => {
            let health = match &c.degraded {
                Some(why) => format!("DEGRADED ({why})"),
                None => "ok".to_string(),
            };
            out.push(cut(
                &format!(
                    "cache {}, {}% in use, health {health}, errors {}, connections {}, \
                     interval {dt:.1}s",
                    human(c.total_bytes),
                    c.in_use_pct,
                    c.errors_total,
                    now.listeners.iter().map(|l| l.connections).sum::<u64>()
                ),
                WIDTH,
            ));
            out.push(cut(
                &format!(
                    "  clean {}  dirty {}  unused {}  metadata {}",
                    human(c.clean_bytes),
                    human(c.dirty_bytes),
                    human(c.unused_bytes),
                    human(c.metadata_bytes)
                ),
                WIDTH,
            ));
        }
        (None, why) => out.push(cut(
            &format!(
                "serving WITHOUT the cache device: {}",
                why.as_deref().unwrap_or("?")
            ),
            WIDTH,
        )),
    }
    out
}

/// Views of every volume of `now` that `before` knows too (a volume attached in between
/// shows from the next refresh on).
pub fn views(
    before: &Sample,
    now: &Sample,
    trends: &BTreeMap<String, VecDeque<(f64, u64)>>,
) -> Vec<VolumeView> {
    let dt = now.uptime_seconds - before.uptime_seconds;
    now.volumes
        .iter()
        .filter_map(|v| {
            let b = before.volumes.iter().find(|b| b.uuid == v.uuid)?;
            let trend: Vec<(f64, u64)> = trends
                .get(&v.uuid)
                .map(|t| t.iter().copied().collect())
                .unwrap_or_default();
            Some(VolumeView::of(b, v, dt, &trend))
        })
        .collect()
}

/// The whole view as plain lines (`--once`, and the live view's content).
pub fn text_lines(
    before: &Sample,
    now: &Sample,
    trends: &BTreeMap<String, VecDeque<(f64, u64)>>,
) -> Vec<String> {
    let mut out = summary_lines(now, now.uptime_seconds - before.uptime_seconds);
    out.push(header());
    for v in views(before, now, trends) {
        out.extend(volume_lines(&v));
    }
    out
}

/// `tiercache top --once`: two samples `interval` apart, printed as text.
pub fn once(admin: &Path, interval: Duration) -> Result<()> {
    let before = fetch(admin)?;
    std::thread::sleep(interval);
    let now = fetch(admin)?;
    for l in text_lines(&before, &now, &BTreeMap::new()) {
        println!("{l}");
    }
    Ok(())
}

fn record_trends(trends: &mut BTreeMap<String, VecDeque<(f64, u64)>>, s: &Sample) {
    trends.retain(|uuid, _| s.volumes.iter().any(|v| &v.uuid == uuid));
    for v in &s.volumes {
        let t = trends.entry(v.uuid.clone()).or_default();
        t.push_back((s.uptime_seconds, v.dirty_bytes));
        while t.len() > TREND_SAMPLES {
            t.pop_front();
        }
    }
}

/// Draws one frame: the view's lines in a bordered box, scrolled by `scroll` lines, with a
/// footer of keys.
pub fn draw(frame: &mut ratatui::Frame, lines: &[String], scroll: u16, status: &str) {
    let area = frame.area();
    let styled: Vec<Line> = lines
        .iter()
        .map(|l| {
            if l.starts_with("VOLUME") {
                Line::from(Span::styled(
                    l.clone(),
                    Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED),
                ))
            } else if l.contains("health DEGRADED") || l.starts_with("serving WITHOUT") {
                Line::from(Span::styled(
                    l.clone(),
                    Style::default().add_modifier(Modifier::BOLD),
                ))
            } else {
                Line::from(l.clone())
            }
        })
        .collect();
    let block = Block::bordered()
        .title(" tiercache top ")
        .title_bottom(format!(" {status} "));
    frame.render_widget(
        Paragraph::new(styled).block(block).scroll((scroll, 0)),
        area,
    );
}

/// `tiercache top`: the live view until q, Esc or Ctrl-C.
pub fn live(admin: &Path, interval: Duration) -> Result<()> {
    if !std::io::stdout().is_terminal() {
        bail!("`tiercache top` needs a terminal; use `tiercache top --once` for plain text");
    }
    let mut before = fetch(admin)?;
    let mut trends = BTreeMap::new();
    record_trends(&mut trends, &before);
    let mut terminal = ratatui::init();
    let result = (|| -> Result<()> {
        let mut lines = vec!["waiting for the second sample...".to_string()];
        let mut scroll = 0u16;
        let mut next = Instant::now() + interval;
        loop {
            let status = format!("q quit  ↑↓ scroll  every {:.1}s", interval.as_secs_f64());
            terminal.draw(|f| draw(f, &lines, scroll, &status))?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()? {
                    if k.kind != KeyEventKind::Press {
                        continue;
                    }
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                            return Ok(())
                        }
                        KeyCode::Down => scroll = scroll.saturating_add(1),
                        KeyCode::Up => scroll = scroll.saturating_sub(1),
                        _ => {}
                    }
                }
                continue;
            }
            next = Instant::now() + interval;
            let now = fetch(admin)?;
            record_trends(&mut trends, &now);
            lines = text_lines(&before, &now, &trends);
            before = now;
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::test_samples::{sample, volume};

    #[test]
    fn rates_and_percentiles_are_per_interval() {
        let a = volume("data", 100, 1 << 20, 100);
        let b = volume("data", 300, 3 << 20, 300);
        let v = VolumeView::of(&a, &b, 2.0, &[]);
        assert_eq!(v.reads, [100.0, 0.0, 0.0]);
        assert!((v.read_mib_s - 100.0 * 4096.0 / 1048576.0).abs() < 1e-9);
        assert_eq!(v.hit_ratio, Some(1.0));
        assert!((v.dirty_per_s - 1048576.0).abs() < 1e-6);
        // All in (50, 100] µs.
        let (p50, p99) = v.read_latency.unwrap();
        assert!(p50 > 50e-6 && p99 <= 100e-6, "{p50} {p99}");
        assert_eq!(v.write_latency, None);
        assert_eq!(v.writeback, "2%");
    }

    #[test]
    fn every_line_fits_80_columns_even_with_huge_numbers() {
        let mut big = volume(
            "a-very-long-volume-name-indeed",
            u64::MAX / 8192,
            u64::MAX / 4,
            1,
        );
        big.writeback.error = Some("EIO".into());
        let a = sample(0.0, vec![volume("a-very-long-volume-name-indeed", 0, 0, 0)]);
        let b = sample(0.001, vec![big]);
        for l in text_lines(&a, &b, &BTreeMap::new()) {
            assert!(
                l.chars().count() <= WIDTH,
                "{} columns: {l}",
                l.chars().count()
            );
        }
    }

    #[test]
    fn the_live_view_shows_every_volume_in_80x24() {
        let vols = |n| {
            (0..5)
                .map(|i| volume(&format!("vol{i}"), n, 0, n))
                .collect()
        };
        let (a, b) = (sample(0.0, vols(0)), sample(1.0, vols(50)));
        let lines = text_lines(&a, &b, &BTreeMap::new());
        let backend = ratatui::backend::TestBackend::new(80, 24);
        let mut t = ratatui::Terminal::new(backend).unwrap();
        t.draw(|f| draw(f, &lines, 0, "q quit")).unwrap();
        let buf = t.backend().buffer();
        let rows: Vec<String> = (0..24)
            .map(|y| (0..80).map(|x| buf[(x, y)].symbol()).collect::<String>())
            .collect();
        let screen = rows.join("\n");
        for i in 0..5 {
            assert!(
                screen.contains(&format!("vol{i} ")),
                "vol{i} missing:\n{screen}"
            );
        }
        assert!(
            screen.contains("R MiB/s") && screen.contains("W MiB/s"),
            "{screen}"
        );
        assert!(screen.contains("37% in use"), "{screen}");
    }
}
