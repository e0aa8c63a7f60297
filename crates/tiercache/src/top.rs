//! `tiercache top`: a live view of a running server, refreshed every second from the admin
//! socket's `metrics` request (`crate::metrics::Sample`): per volume, reads per second as the
//! engine classifies them (bcache's `cache_hits`, `cache_misses`, `cache_bypass_hits` +
//! `cache_bypass_misses`, the counters `stats` shows), writes per second by the devices that
//! served them, their MiB/s, the hit ratio, latency percentiles, dirty data and its trend,
//! writeback, and the cache set's occupancy, health and connections.
//!
//! Rates are differences between two samples divided by the server's own clock between them
//! (`uptime_seconds`), so a slow admin round trip does not skew them; percentiles come from
//! the difference of the latency histograms, so they describe the last interval only.
//! `--once` prints the same view as plain text (or, with `--json`, its numbers: the counts
//! over the interval as well as the rates) from two samples `interval` apart, for scripts and
//! tests.
//!
//! Invariants: every number is what `stats`/`status` say over the same interval — the read
//! counts and hit ratio are the engine's counters (the hit ratio rounded down, as `stats`
//! does), dirty and cached data and the writeback state are `status`'s (`idle` means nothing
//! is dirty, and then no writeback rate is shown), the dirty trend is the change of dirty data
//! over the interval; every line fits in 80 columns (the live view draws inside a border, so
//! its lines are at most 78) and 5 volumes fit in 24 rows, whatever the numbers: each column
//! has a fixed width and its number is formatted to fit it (k/M suffixes, sizes as "117M");
//! only unbounded text (a volume name, a degraded cache's reason) is cut, with '~'; the live
//! view keeps at most `TREND_SAMPLES` samples of each volume's dirty data for the sparkline;
//! the terminal is restored when the view ends, also on error and panic (`ratatui::restore`).

use crate::metrics::hist::HistSnapshot;
use crate::metrics::{Sample, VolumeSample};
use anyhow::{bail, Context, Result};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use std::collections::{BTreeMap, VecDeque};
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

/// Dirty-data samples kept per volume for the sparkline (one per refresh).
pub const TREND_SAMPLES: usize = 10;
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
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VolumeView {
    pub name: String,
    pub mode: String,
    pub state: String,
    /// Reads in the interval as the engine counts them: hit, miss, bypass (bcache's
    /// `cache_hits`, `cache_misses`, `cache_bypass_hits` + `cache_bypass_misses`).
    pub read_counts: [u64; 3],
    /// The same per second.
    pub reads: [f64; 3],
    pub read_mib_s: f64,
    /// Writes per second: writeback, writethrough, bypass (and their MiB/s together).
    pub writes: [f64; 3],
    pub write_mib_s: f64,
    /// Failed requests per second (all operations).
    pub errors: f64,
    /// Hits in percent of hits and misses in the interval, rounded down as `stats` does
    /// (`None`: no such reads).
    pub hit_ratio_pct: Option<u64>,
    /// p50 and p99 in seconds over the interval.
    pub read_latency: Option<(f64, f64)>,
    pub write_latency: Option<(f64, f64)>,
    pub dirty_bytes: u64,
    /// Change of dirty data per second over the interval.
    pub dirty_per_s: f64,
    /// Dirty data over the last refreshes, oldest first (the sparkline).
    pub dirty_trend: Vec<u64>,
    /// `status`'s writeback state: paused, failing, idle (nothing dirty), delayed, running.
    pub writeback: String,
    /// Bytes written back in the interval (the engine's `writeback_bytes`), and per second.
    pub writeback_bytes: u64,
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
        let read_counts = [
            hits,
            misses,
            delta("cache_bypass_hits") + delta("cache_bypass_misses"),
        ];
        let errors: u64 = now
            .requests
            .iter()
            .filter(|s| s.result == "error")
            .map(|s| {
                let b = series(before, &s.op, "error").map_or(0, HistSnapshot::count);
                s.latency.count().saturating_sub(b)
            })
            .sum();
        let mut dirty_trend: Vec<u64> = trend.iter().map(|&(_, d)| d).collect();
        if dirty_trend.len() < 2 {
            dirty_trend = vec![before.dirty_bytes, now.dirty_bytes];
        }
        let writeback_bytes = delta("writeback_bytes");
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
            read_counts,
            reads: read_counts.map(|n| n as f64 / dt),
            read_mib_s: mib_s("read"),
            writes: [
                rate("write", "writeback"),
                rate("write", "writethrough"),
                rate("write", "bypass"),
            ],
            write_mib_s: mib_s("write"),
            errors: errors as f64 / dt,
            hit_ratio_pct: (hits + misses > 0).then(|| hits * 100 / (hits + misses)),
            read_latency: pct("read"),
            write_latency: pct("write"),
            dirty_bytes: now.dirty_bytes,
            dirty_per_s: (now.dirty_bytes as f64 - before.dirty_bytes as f64) / dt,
            dirty_trend,
            writeback: if now.writeback.status.is_empty() {
                // A server from before `status` was in the sample.
                now.writeback.state().to_string()
            } else {
                now.writeback.status.clone()
            },
            writeback_bytes,
            writeback_bytes_s: writeback_bytes as f64 / dt,
            cached_bytes: now.cached_bytes,
            size_bytes: now.size_bytes,
        }
    }
}

/// A rate in at most 6 columns: "123", "12.3k", "1.2M".
fn count_rate(v: f64) -> String {
    if v < 9_999.5 {
        return format!("{v:.0}");
    }
    let mut v = v / 1e3;
    for unit in ["k", "M", "G", "T", "P"] {
        if v < 999.95 {
            return format!("{v:.1}{unit}");
        }
        v /= 1e3;
    }
    format!("{v:.1}E")
}

/// MiB/s in at most 7 columns.
fn mib_rate(v: f64) -> String {
    if v < 9_999.95 {
        format!("{v:.1}")
    } else {
        count_rate(v)
    }
}

/// Seconds in at most 6 columns: "85µs", "1.2ms", "3.40s", "120s", "3.5h".
fn secs(s: f64) -> String {
    if s < 999.5e-6 {
        format!("{:.0}µs", s * 1e6)
    } else if s < 9.995e-3 {
        format!("{:.1}ms", s * 1e3)
    } else if s < 0.9995 {
        format!("{:.0}ms", s * 1e3)
    } else if s < 9.995 {
        format!("{s:.2}s")
    } else if s < 9_999.5 {
        format!("{s:.0}s")
    } else {
        format!("{:.1}h", (s / 3600.0).min(9_999.0))
    }
}

/// Bytes in at most 5 columns: "512B", "4.0K", "117M", "1023G".
pub fn short(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1023.5 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes}B")
    } else if v < 9.95 {
        format!("{v:.1}{}", UNITS[u])
    } else {
        format!("{v:.0}{}", UNITS[u])
    }
}

/// A signed byte rate in at most 8 columns: "+4.0K/s", "-117M/s".
fn signed_bytes_s(v: f64) -> String {
    let sign = if v < 0.0 { "-" } else { "+" };
    format!("{sign}{}/s", short(v.abs() as u64))
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
    let hit = v.hit_ratio_pct.map_or("-".to_string(), |r| r.to_string());
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
    // At most 2 + 9 + 21 + 8 + 21 + 8 + 6 = 75 columns.
    let mut second = format!(
        "  lat read {:<21}  write {:<21}",
        lat(v.read_latency),
        lat(v.write_latency)
    );
    if v.errors > 0.0 {
        second = format!("{}  err/s {}", second.trim_end(), count_rate(v.errors));
    }
    // Writeback's rate only while there is dirty data to write back ("idle": none).
    let wb = match v.writeback.as_str() {
        "idle" | "paused" => v.writeback.clone(),
        w => format!("{w} {}/s", short(v.writeback_bytes_s as u64)),
    };
    // At most 2 + 6 + 5 + 1 + 8 + 1 + TREND_SAMPLES + 5 + 15 + 9 + 5 + 1 + 9 = 77 columns.
    let third = format!(
        "  dirty {} {} {}  wb {}  cached {} {}",
        short(v.dirty_bytes),
        signed_bytes_s(v.dirty_per_s),
        sparkline(&v.dirty_trend),
        wb,
        short(v.cached_bytes),
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
            let health = if c.degraded.is_some() {
                "DEGRADED"
            } else {
                "ok"
            };
            // At most 6 + 5 + 2 + 11 + 9 + 8 + 9 + 6 + 14 + 6 + 8 = 84 columns only with
            // counts of millions: errors and connections take k/M suffixes.
            out.push(cut(
                &format!(
                    "cache {}, {}% in use, health {health}, errors {}, connections {}, \
                     every {dt:.1}s",
                    short(c.total_bytes),
                    c.in_use_pct,
                    count_rate(c.errors_total as f64),
                    count_rate(now.listeners.iter().map(|l| l.connections).sum::<u64>() as f64)
                ),
                WIDTH,
            ));
            out.push(cut(
                &format!(
                    "  clean {}  dirty {}  unused {}  metadata {}",
                    short(c.clean_bytes),
                    short(c.dirty_bytes),
                    short(c.unused_bytes),
                    short(c.metadata_bytes)
                ),
                WIDTH,
            ));
            if let Some(why) = &c.degraded {
                out.push(cut(&format!("  degraded: {why}"), WIDTH));
            }
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

/// `tiercache top --once`: two samples `interval` apart, printed as text or as JSON (the
/// interval in seconds, the cache set's occupancy at its end, and each volume's view).
pub fn once(admin: &Path, interval: Duration, as_json: bool) -> Result<()> {
    let before = fetch(admin)?;
    std::thread::sleep(interval);
    let now = fetch(admin)?;
    if as_json {
        let v = serde_json::json!({
            "interval_seconds": now.uptime_seconds - before.uptime_seconds,
            "cache": now.cache_set,
            "without_cache": now.without_cache,
            "volumes": views(&before, &now, &BTreeMap::new()),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
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
            } else if l.contains("health DEGRADED")
                || l.starts_with("  degraded:")
                || l.starts_with("serving WITHOUT")
            {
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
        assert_eq!(v.read_counts, [200, 0, 0]);
        assert_eq!(v.reads, [100.0, 0.0, 0.0]);
        assert!((v.read_mib_s - 100.0 * 4096.0 / 1048576.0).abs() < 1e-9);
        assert_eq!(v.hit_ratio_pct, Some(100));
        assert!((v.dirty_per_s - 1048576.0).abs() < 1e-6);
        // All in (50, 100] µs.
        let (p50, p99) = v.read_latency.unwrap();
        assert!(p50 > 50e-6 && p99 <= 100e-6, "{p50} {p99}");
        assert_eq!(v.write_latency, None);
        assert_eq!(v.writeback, "running");
    }

    #[test]
    fn reads_are_the_engines_counts_and_misses_count() {
        // Requests the export saw as hits only; the engine counted misses and bypasses (a
        // miss whose fill went on another thread, a bypassed read of a full cache).
        let mut a = volume("data", 0, 0, 0);
        let mut b = volume("data", 10, 0, 3);
        for (v, n) in [(&mut a, 0u64), (&mut b, 1)] {
            v.counters.insert("cache_misses".into(), 7 * n);
            v.counters.insert("cache_bypass_hits".into(), 2 * n);
            v.counters.insert("cache_bypass_misses".into(), 5 * n);
        }
        let v = VolumeView::of(&a, &b, 1.0, &[]);
        assert_eq!(v.read_counts, [3, 7, 7]);
        // 3 of 10, rounded down as `stats` does.
        assert_eq!(v.hit_ratio_pct, Some(30));
        let line = volume_lines(&v)[0].clone();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cols[2..6], ["30", "3", "7", "7"], "{line}");
    }

    #[test]
    fn writeback_idle_means_nothing_dirty_and_shows_no_rate() {
        let mut a = volume("data", 0, 8 << 20, 0);
        let mut b = volume("data", 0, 0, 0);
        a.counters.insert("writeback_bytes".into(), 0);
        b.counters.insert("writeback_bytes".into(), 8 << 20);
        b.writeback.share = 0.0;
        b.writeback.status = "idle".into();
        let v = VolumeView::of(&a, &b, 1.0, &[]);
        assert_eq!(v.writeback_bytes, 8 << 20);
        let third = volume_lines(&v)[2].clone();
        assert!(third.contains(" wb idle  cached"), "{third}");
        // Dirty data and no rate of the controller: `status` says delayed, and so does top.
        b.dirty_bytes = 4 << 20;
        b.writeback.status = "delayed".into();
        let v = VolumeView::of(&a, &b, 1.0, &[]);
        assert!(
            volume_lines(&v)[2].contains(" wb delayed 8.0M/s"),
            "{:?}",
            volume_lines(&v)
        );
    }

    #[test]
    fn the_dirty_trend_follows_dirty_data_over_the_interval() {
        // Dirty data rose earlier in the sparkline's window, and falls now: the trend falls.
        let a = volume("data", 0, 187 << 20, 0);
        let b = volume("data", 0, 117 << 20, 0);
        let window = [(0.0, 10 << 20), (9.0, 187 << 20), (10.0, 117 << 20)];
        let v = VolumeView::of(&a, &b, 1.0, &window);
        assert!(
            (v.dirty_per_s + (70 << 20) as f64).abs() < 1.0,
            "{}",
            v.dirty_per_s
        );
        assert!(
            volume_lines(&v)[2].contains("dirty 117M -70M/s"),
            "{:?}",
            volume_lines(&v)
        );
        assert_eq!(v.dirty_trend, [10 << 20, 187 << 20, 117 << 20]);
    }

    #[test]
    fn short_sizes_take_at_most_5_columns() {
        for (b, s) in [
            (0, "0B"),
            (1000, "1000B"),
            (1023, "1023B"),
            (1024, "1.0K"),
            (4096, "4.0K"),
            (117 << 20, "117M"),
            ((1 << 30) - 1, "1.0G"),
            (u64::MAX, "16E"),
        ] {
            assert_eq!(short(b), s);
        }
        for p in 0..64 {
            for b in [1u64 << p, (1u64 << p) - 1, (1u64 << p) / 10 * 9] {
                assert!(short(b).len() <= 5, "{b}: {}", short(b));
            }
        }
    }

    #[test]
    fn every_line_fits_80_columns_even_with_huge_numbers() {
        for name in ["a-very-long-volume-name-indeed", "vol"] {
            for status in ["failing", "detaching", "running", "delayed"] {
                let mut big = volume(name, u64::MAX / 8192, u64::MAX / 4, 1);
                big.writeback.error = Some("EIO".into());
                big.writeback.status = status.into();
                big.state = "detaching".into();
                big.cached_bytes = u64::MAX / 3;
                big.counters.insert("writeback_bytes".into(), u64::MAX / 2);
                // Every request slow (the open-ended last bucket), errors among them.
                for s in &mut big.requests {
                    s.latency.buckets[crate::metrics::hist::BUCKETS - 1] = u64::MAX / 64;
                }
                let a = sample(0.0, vec![volume(name, 0, 0, 0)]);
                let mut b = sample(0.001, vec![big]);
                let c = b.cache_set.as_mut().unwrap();
                c.total_bytes = u64::MAX;
                c.errors_total = u64::MAX;
                let lines = text_lines(&a, &b, &BTreeMap::new());
                for l in &lines {
                    assert!(
                        l.chars().count() <= WIDTH,
                        "{} columns: {l}",
                        l.chars().count()
                    );
                    // Numbers fit their columns: only a name is ever cut.
                    if name == "vol" {
                        assert!(!l.ends_with('~'), "cut: {l}");
                    }
                }
            }
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
