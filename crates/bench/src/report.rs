//! Benchmark results: ratios to `hdd` and `ssd`, the Markdown tables, `results.json`, and the
//! charts ([`super::plot`]): `w1.svg`, W1's IOPS as bars per step and configuration, and
//! `w4.svg` / `w6.svg`, the plotted step's time series (IOPS, dirty data, cache occupancy)
//! with every configuration overlaid. Each chart is embedded under its workload's table.
//!
//! Invariant: every number written comes from a `Row` or `Series` measured in this run; a
//! ratio is present only when the reference row of the same workload step exists, and the
//! `×hdd` reference is the disk alone of the same kind ([`Disk::hdd_reference`]: `hdd+nonrot`
//! for rows on the non-rotational disk); W6's warm-up rows get no ratio (ratios compare its
//! steady rows); one configuration has one colour in every chart.

use super::catalogue::{Params, Scale, WORKLOADS};
use super::plot::{self, BarSeries, Key, Line, Panel, Rgb};
use super::procs::{self, Disk};
pub use super::results::{Phase, Row, Series};
use anyhow::Result;
use std::fmt::Write as _;
use std::path::Path;

/// Fills the ratio columns: a row's throughput over that of the reference row of the same step:
/// the disk alone of the same kind for `×hdd`, `ssd` for `×ssd`. For W7, where less time is
/// better, the ratio is the reference time over this time. W6's warm-up rows get none.
pub fn ratios(rows: &mut [Row]) {
    let value = |r: &Row| {
        if r.workload == "W7" {
            r.seconds
        } else {
            r.iops
        }
    };
    let copy = rows.to_vec();
    let find = |r: &Row, cfg: &str| {
        copy.iter()
            .find(|x| {
                x.config == cfg
                    && x.workload == r.workload
                    && (x.step == r.step || r.workload == "W7")
            })
            .map(value)
    };
    for r in rows.iter_mut() {
        if r.phase == Some(Phase::WarmUp) {
            continue;
        }
        let mine = value(r);
        let ratio = |reference: Option<f64>| {
            reference.filter(|v| *v > 0.0 && mine > 0.0).map(|v| {
                if r.workload == "W7" {
                    v / mine
                } else {
                    mine / v
                }
            })
        };
        r.ratio_hdd = ratio(find(r, &r.disk.hdd_reference()));
        r.ratio_ssd = ratio(find(r, "ssd"));
    }
}

/// A value with `digits` decimals, or "n/a" when it was not measured.
pub fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "n/a".into())
}

/// Writes results.md, results.json and the charts (`w1.svg`, and `wN.svg` for each workload
/// with time series).
pub fn write(
    dir: &Path,
    scale: Scale,
    p: &Params,
    rows: &[Row],
    series: &[Series],
    notices: &[String],
) -> Result<()> {
    let machine = machine();
    let date = date();
    let mut md = String::new();
    writeln!(
        md,
        "# tiercache bench ({scale:?} scale, {date})\n\nMachine: {machine}. Emulated disk {} MiB, cache {} MiB, {} s per timed step (W4's sync writes: until 70 % of the cache is written, at most {} s). {}\n",
        p.disk_bytes >> 20,
        p.cache_bytes >> 20,
        p.runtime_s,
        p.w4_cap_s,
        match p.mem_limit_bytes {
            Some(b) => format!(
                "`+memlimit`: each server process in a memory cgroup of {} MiB, page cache included.",
                b >> 20
            ),
            None => "No `+memlimit` configurations (--mem-limit 0).".into(),
        }
    )?;
    writeln!(
        md,
        "`+nonrot`: the same emulated HDD started with `--rotational false`, so it does not report itself rotational (column \"disk\"); {} s per timed step. ×hdd: over the disk alone of the same kind, same step (`hdd+nonrot` for `+nonrot` rows); ×ssd: over `ssd`. W6 runs in {} s intervals until {} consecutive ones (not the first) differ by at most {:.0} % in IOPS, and by {} points in hit % and {} in `in_use` % (tiercache: a cache still filling is warming up), at most {} s: a warm-up row (s: time to steady) and a steady row per configuration; ratios compare steady rows. p99 is n/a there (fio reports it for the whole run only).\n",
        p.nonrot_runtime_s,
        p.w6.interval_s,
        p.w6.intervals,
        p.w6.iops_tolerance * 100.0,
        p.w6.hit_tolerance_pct,
        p.w6.in_use_tolerance_pct,
        p.w6.cap_s
    )?;
    for n in notices {
        writeln!(md, "> {n}\n")?;
    }
    let charts = charts(rows, series)?;
    for (_, name, svg) in &charts {
        std::fs::write(dir.join(name), svg)?;
    }
    for (w, what) in WORKLOADS {
        let wr: Vec<&Row> = rows.iter().filter(|r| r.workload == w).collect();
        if wr.is_empty() {
            continue;
        }
        writeln!(md, "## {w}: {what}\n")?;
        // The steps this run measured (a smaller scale leaves some out).
        writeln!(md, "{}\n", steps_run(&wr))?;
        if w == "W7" {
            writeln!(
                md,
                "| step | config | seconds | MiB/s | ×hdd (time) |\n|---|---|---|---|---|"
            )?;
            for r in wr {
                writeln!(
                    md,
                    "| {} | {} | {:.1} | {:.2} | {} |",
                    r.step,
                    r.config,
                    r.seconds,
                    r.bw_mib_s,
                    opt(r.ratio_hdd, 2)
                )?;
            }
        } else {
            table(&mut md, &wr)?;
        }
        writeln!(md)?;
        for (_, name, _) in charts.iter().filter(|c| c.0 == w) {
            writeln!(md, "![{w}]({name})\n")?;
        }
    }
    let plots: Vec<&str> = charts.iter().map(|c| c.1.as_str()).collect();
    std::fs::write(dir.join("results.md"), &md)?;
    let json = serde_json::json!({
        "date": date,
        "machine": machine,
        "scale": scale,
        "params": p,
        "notices": notices,
        "rows": rows,
        "series": series,
        "plots": plots,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    Ok(())
}

/// One workload's table. The disk column appears when a row ran on the non-rotational disk, the
/// seconds column when a row is a W6 phase.
/// "Steps run: a, b, c." from a workload's rows, in order, each named once.
fn steps_run(rows: &[&Row]) -> String {
    format!(
        "Steps run: {}.",
        in_order(rows.iter().map(|r| r.step.as_str())).join(", ")
    )
}

fn table(md: &mut String, rows: &[&Row]) -> Result<()> {
    let disk = rows.iter().any(|r| r.disk == Disk::NonRotational);
    let secs = rows.iter().any(|r| r.phase.is_some());
    let mut head = vec!["step", "config"];
    head.extend(disk.then_some("disk"));
    head.extend(secs.then_some("s"));
    head.extend([
        "IOPS",
        "MiB/s",
        "mean µs",
        "p99 µs",
        "hit %",
        "cache MiB written",
        "×hdd",
        "×ssd",
    ]);
    writeln!(
        md,
        "| {} |\n|{}",
        head.join(" | "),
        "---|".repeat(head.len())
    )?;
    for r in rows {
        let step = match r.phase {
            Some(Phase::NotSteady) => {
                format!("{}, NOT reached: the last {:.0} s", r.step, r.seconds)
            }
            _ => r.step.clone(),
        };
        let mut cells = vec![step, r.config.clone()];
        cells.extend(disk.then(|| r.disk.describe().to_string()));
        cells.extend(secs.then(|| format!("{:.1}", r.seconds)));
        cells.extend([
            format!("{:.0}", r.iops),
            format!("{:.1}", r.bw_mib_s),
            format!("{:.0}", r.mean_lat_us),
            opt(r.p99_lat_us, 0),
            opt(r.hit_ratio_pct, 0),
            opt(r.cache_written_mib, 1),
            opt(r.ratio_hdd, 2),
            opt(r.ratio_ssd, 2),
        ]);
        writeln!(md, "| {} |", cells.join(" | "))?;
    }
    Ok(())
}

/// Now, in UTC to the minute, for report headers.
pub fn date() -> String {
    std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The machine, for report headers: cores, CPU model, RAM.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| kib >> 20)
        .unwrap_or(0);
    format!("{cores} cores ({cpu}), {mem_gib} GiB")
}

/// One colour per configuration (matplotlib's "tab10"), the same in every chart; a `+nonrot`
/// configuration gets its rotational twin's colour, lightened.
fn color(config: &str) -> Rgb {
    if let Some(twin) = config
        .contains(procs::NONROT)
        .then(|| config.replacen(procs::NONROT, "", 1))
    {
        let (r, g, b) = color(&twin);
        let light = |c: u8| c + (255 - c) / 2;
        return (light(r), light(g), light(b));
    }
    match config {
        "hdd" => (127, 127, 127),
        "ssd" => (23, 190, 207),
        "tiercache-writethrough" => (31, 119, 180),
        "tiercache-writeback" => (255, 127, 14),
        "tiercache-writearound" => (44, 160, 44),
        "nbdkit-cache" => (214, 39, 40),
        "tiercache-writeback+memlimit" => (140, 86, 75),
        "nbdkit-cache+memlimit" => (227, 119, 194),
        c if c.ends_with(procs::MEMLIMIT) => (188, 189, 34),
        _ => (148, 103, 189),
    }
}

/// The distinct values of `items`, in the order they first appear.
fn in_order<'a>(items: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<&str> = Vec::new();
    for i in items {
        if !v.contains(&i) {
            v.push(i);
        }
    }
    v
}

/// The charts of a run: (workload, file name, SVG). W1 as bars, each workload with time series
/// as one overlaid figure.
fn charts(rows: &[Row], series: &[Series]) -> Result<Vec<(String, String, String)>> {
    let mut out = Vec::new();
    let w1: Vec<&Row> = rows.iter().filter(|r| r.workload == "W1").collect();
    if !w1.is_empty() {
        let steps = in_order(w1.iter().map(|r| r.step.as_str()));
        let configs = in_order(w1.iter().map(|r| r.config.as_str()));
        let groups: Vec<String> = steps
            .iter()
            // "read-seq (cold)" on two lines: "read-seq", "cold".
            .map(|s| s.replace(" (", "\n").replace(')', ""))
            .collect();
        let bars: Vec<BarSeries> = configs
            .iter()
            .map(|c| BarSeries {
                key: Key {
                    label: c,
                    color: color(c),
                },
                values: steps
                    .iter()
                    .map(|s| {
                        w1.iter()
                            .find(|r| r.config == *c && r.step == *s)
                            .map(|r| r.iops)
                    })
                    .collect(),
            })
            .collect();
        let svg = plot::bars(
            "W1: 4 KiB QD1 IOPS per step and configuration, cold then warm",
            "IOPS (log scale)",
            &groups,
            &bars,
        )?;
        out.push(("W1".to_string(), "w1.svg".to_string(), svg));
    }
    for w in in_order(series.iter().map(|s| s.workload.as_str())) {
        let ws: Vec<&Series> = series.iter().filter(|s| s.workload == w).collect();
        let keys: Vec<Key> = ws
            .iter()
            .map(|s| Key {
                label: &s.config,
                color: color(&s.config),
            })
            .collect();
        // Only tiercache answers the admin `stats` the dirty and occupancy samples come from.
        let lines = |pick: fn(&Series) -> &[(f64, f64)], iops: bool| -> Vec<Line> {
            ws.iter()
                .zip(&keys)
                .map(|(s, k)| Line {
                    key: *k,
                    points: pick(s),
                    empty_why: if iops {
                        "fio logged no whole second (the step was shorter)"
                    } else if s.config.starts_with("tiercache-") {
                        "no sample was taken"
                    } else {
                        "only tiercache reports it"
                    },
                })
                .collect()
        };
        let panels = [
            Panel {
                y_desc: "IOPS (log scale)",
                y_max: None,
                log: true,
                lines: lines(|s| &s.iops, true),
            },
            Panel {
                y_desc: "dirty data (MiB)",
                y_max: None,
                log: false,
                lines: lines(|s| &s.dirty_mib, false),
            },
            Panel {
                y_desc: "cache in use (%)",
                y_max: Some(100.0),
                log: false,
                lines: lines(|s| &s.in_use_pct, false),
            },
        ];
        let title = format!("{w}: {}, every configuration over time", ws[0].step);
        let svg = plot::time_series(&title, &keys, &panels)?;
        out.push((w.to_string(), format!("{}.svg", w.to_lowercase()), svg));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_compare_the_same_step() {
        let row = |cfg: &str, iops: f64| Row {
            workload: "W5".into(),
            step: "randread".into(),
            config: cfg.into(),
            iops,
            ..Row::default()
        };
        let mut rows = vec![
            row("hdd", 100.0),
            row("ssd", 10000.0),
            row("tiercache-writeback", 5000.0),
        ];
        ratios(&mut rows);
        assert_eq!(rows[2].ratio_hdd, Some(50.0));
        assert_eq!(rows[2].ratio_ssd, Some(0.5));
        assert_eq!(rows[0].ratio_hdd, Some(1.0));
    }

    #[test]
    fn ratios_use_the_disk_alone_of_the_same_kind_and_skip_warm_up() {
        let row = |cfg: &str, disk: Disk, phase: Option<Phase>, iops: f64| Row {
            workload: "W6".into(),
            step: if phase == Some(Phase::WarmUp) {
                "zipf (warm-up)"
            } else {
                "zipf (steady)"
            }
            .into(),
            config: cfg.into(),
            iops,
            disk,
            phase,
            ..Row::default()
        };
        let (rot, flat) = (Disk::Rotational, Disk::NonRotational);
        let mut rows = vec![
            row("hdd", rot, Some(Phase::WarmUp), 100.0),
            row("hdd", rot, Some(Phase::Steady), 200.0),
            row("hdd+nonrot", flat, Some(Phase::Steady), 400.0),
            row("tiercache-writeback", rot, Some(Phase::WarmUp), 1000.0),
            row("tiercache-writeback", rot, Some(Phase::NotSteady), 2000.0),
            row(
                "tiercache-writeback+nonrot",
                flat,
                Some(Phase::Steady),
                2000.0,
            ),
            row("ssd", Disk::None, Some(Phase::Steady), 4000.0),
        ];
        ratios(&mut rows);
        let hdd: Vec<Option<f64>> = rows.iter().map(|r| r.ratio_hdd).collect();
        assert_eq!(
            hdd,
            [
                None,
                Some(1.0),
                Some(1.0),
                None,
                Some(10.0),
                Some(5.0),
                Some(20.0)
            ]
        );
        assert_eq!(rows[5].ratio_ssd, Some(0.5));
        assert_eq!(rows[3].ratio_ssd, None);
        let mut md = String::new();
        table(&mut md, &rows.iter().collect::<Vec<_>>()).unwrap();
        assert!(
            md.starts_with("| step | config | disk | s | IOPS |"),
            "{md}"
        );
        assert!(
            md.contains("| tiercache-writeback+nonrot | non-rotational |"),
            "{md}"
        );
        assert!(md.contains("(steady), NOT reached: the last 0 s"), "{md}");
        assert_ne!(color("hdd"), color("hdd+nonrot"));
    }

    #[test]
    fn a_workload_lists_the_steps_it_ran() {
        let row = |step: &str, cfg: &str| Row {
            workload: "W1".into(),
            step: step.into(),
            config: cfg.into(),
            ..Row::default()
        };
        // The tiny scale's W1: reads only, for two configurations.
        let rows = [
            row("read-seq (cold)", "hdd"),
            row("read-seq (cold)", "ssd"),
            row("read-random (cold)", "hdd"),
            row("read-seq (warm)", "hdd"),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        assert_eq!(
            steps_run(&refs),
            "Steps run: read-seq (cold), read-random (cold), read-seq (warm)."
        );
        let w1 = WORKLOADS.iter().find(|w| w.0 == "W1").unwrap().1;
        assert!(!w1.contains("write-seq"), "{w1}");
    }

    #[test]
    fn one_w1_bar_chart_and_one_overlaid_figure_per_plotted_workload() {
        let row = |step: &str, cfg: &str, iops: f64| Row {
            workload: "W1".into(),
            step: step.into(),
            config: cfg.into(),
            iops,
            ..Row::default()
        };
        let rows = vec![
            row("read-seq (cold)", "hdd", 150.0),
            row("read-seq (cold)", "tiercache-writeback", 900.0),
            row("read-seq (warm)", "hdd", 160.0),
            row("read-seq (warm)", "tiercache-writeback", 20_000.0),
        ];
        let series = |w: &str, cfg: &str, tc: bool| Series {
            workload: w.into(),
            step: "sync randwrite".into(),
            config: cfg.into(),
            iops: vec![(1.0, 100.0), (2.0, 120.0)],
            dirty_mib: if tc {
                vec![(0.0, 1.0), (1.0, 5.0)]
            } else {
                vec![]
            },
            in_use_pct: if tc {
                vec![(0.0, 2.0), (1.0, 9.0)]
            } else {
                vec![]
            },
        };
        let s = vec![
            series("W4", "hdd", false),
            series("W4", "tiercache-writeback", true),
            series("W6", "hdd", false),
        ];
        let charts = charts(&rows, &s).unwrap();
        let names: Vec<&str> = charts.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["w1.svg", "w4.svg", "w6.svg"]);
        let w1 = &charts[0].2;
        assert!(w1.contains(">\nread-seq\n</text>") && w1.contains(">\nwarm\n</text>"));
        // Background, two legend swatches, four bars.
        assert_eq!(w1.matches("<rect").count(), 7);
        let w4 = &charts[1].2;
        for cfg in ["hdd", "tiercache-writeback"] {
            assert!(
                w4.contains(&format!(">\n{cfg}\n</text>")),
                "no legend for {cfg}"
            );
        }
        // hdd: an IOPS line; writeback: IOPS, dirty and occupancy lines.
        let lines = w4.matches("stroke-width=\"2\"").count();
        assert_eq!(lines, 4, "{w4}");
        // hdd has no dirty or occupancy line, and W6 ran only on hdd: the panels say why.
        let why = "no data for hdd: only tiercache reports it";
        assert_eq!(w4.matches(why).count(), 2, "{w4}");
        assert_eq!(charts[2].2.matches(why).count(), 2);
    }
}
