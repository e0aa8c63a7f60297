//! Benchmark results: ratios to `hdd` and `ssd`, the Markdown tables, `results.json`, and SVG
//! line charts of the time series (written by hand: three polylines need no plotting crate).
//!
//! Invariant: every number written comes from a `Row` or `Series` measured in this run; a
//! ratio is present only when the reference row of the same workload step exists.

use super::{Params, Scale, WORKLOADS};
use anyhow::Result;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Row {
    pub workload: String,
    pub step: String,
    pub config: String,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub mean_lat_us: f64,
    pub p99_lat_us: f64,
    pub hit_ratio_pct: Option<f64>,
    pub cache_written_mib: Option<f64>,
    pub seconds: f64,
    pub ratio_hdd: Option<f64>,
    pub ratio_ssd: Option<f64>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Series {
    pub workload: String,
    pub config: String,
    pub iops: Vec<(f64, f64)>,
    pub dirty_mib: Vec<(f64, f64)>,
    pub in_use_pct: Vec<(f64, f64)>,
}

/// Fills the ratio columns: a row's throughput over the `hdd` (`ssd`) row of the same step.
/// For W7, where less time is better, the ratio is the reference time over this time.
pub fn ratios(rows: &mut [Row]) {
    let find = |rows: &[Row], r: &Row, cfg: &str| {
        rows.iter()
            .find(|x| {
                x.config == cfg
                    && x.workload == r.workload
                    && (x.step == r.step || r.workload == "W7")
            })
            .map(|x| {
                if r.workload == "W7" {
                    x.seconds
                } else {
                    x.iops
                }
            })
    };
    let copy = rows.to_vec();
    for r in rows.iter_mut() {
        let mine = if r.workload == "W7" {
            r.seconds
        } else {
            r.iops
        };
        let ratio = |reference: Option<f64>| {
            reference.filter(|v| *v > 0.0 && mine > 0.0).map(|v| {
                if r.workload == "W7" {
                    v / mine
                } else {
                    mine / v
                }
            })
        };
        r.ratio_hdd = ratio(find(&copy, r, "hdd"));
        r.ratio_ssd = ratio(find(&copy, r, "ssd"));
    }
}

/// A value with `digits` decimals, or "n/a" when it was not measured.
pub fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "n/a".into())
}

/// Writes results.md, results.json and one SVG per plotted workload and configuration.
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
    for n in notices {
        writeln!(md, "> {n}\n")?;
    }
    for (w, what) in WORKLOADS {
        let wr: Vec<&Row> = rows.iter().filter(|r| r.workload == w).collect();
        if wr.is_empty() {
            continue;
        }
        writeln!(md, "## {w}: {what}\n")?;
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
            writeln!(
                md,
                "| step | config | IOPS | MiB/s | mean µs | p99 µs | hit % | cache MiB written | ×hdd | ×ssd |\n|---|---|---|---|---|---|---|---|---|---|"
            )?;
            for r in wr {
                writeln!(
                    md,
                    "| {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {} | {} | {} | {} |",
                    r.step,
                    r.config,
                    r.iops,
                    r.bw_mib_s,
                    r.mean_lat_us,
                    r.p99_lat_us,
                    opt(r.hit_ratio_pct, 0),
                    opt(r.cache_written_mib, 1),
                    opt(r.ratio_hdd, 2),
                    opt(r.ratio_ssd, 2)
                )?;
            }
        }
        writeln!(md)?;
    }
    let mut plots = Vec::new();
    for s in series {
        let name = format!("{}-{}.svg", s.workload.to_lowercase(), s.config);
        std::fs::write(dir.join(&name), svg(s))?;
        plots.push(name);
    }
    if !plots.is_empty() {
        writeln!(md, "## Time series\n")?;
        for p in &plots {
            writeln!(md, "![{p}]({p})")?;
        }
    }
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

/// Three stacked line charts (IOPS, dirty MiB, occupancy %) against seconds.
fn svg(s: &Series) -> String {
    let (w, h, pad) = (640.0, 160.0, 40.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<text x=\"{pad}\" y=\"16\" font-size=\"13\">{} on {}</text>\n",
        3.0 * h + 30.0,
        s.workload,
        s.config
    );
    let t_max = [&s.iops, &s.dirty_mib, &s.in_use_pct]
        .iter()
        .flat_map(|v| v.iter().map(|p| p.0))
        .fold(1.0f64, f64::max);
    for (i, (label, pts)) in [
        ("IOPS", &s.iops),
        ("dirty MiB", &s.dirty_mib),
        ("cache in use %", &s.in_use_pct),
    ]
    .into_iter()
    .enumerate()
    {
        let top = 30.0 + i as f64 * h;
        let y_max = pts.iter().map(|p| p.1).fold(1.0f64, f64::max) * 1.1;
        let _ = write!(
            out,
            "<rect x=\"{pad}\" y=\"{top}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>\n<text x=\"{}\" y=\"{}\">{label} (max {:.0})</text>\n",
            w - 2.0 * pad,
            h - 30.0,
            pad + 4.0,
            top + 12.0,
            y_max / 1.1
        );
        let poly: Vec<String> = pts
            .iter()
            .map(|&(t, v)| {
                let x = pad + t / t_max * (w - 2.0 * pad);
                let y = top + (h - 30.0) * (1.0 - v / y_max);
                format!("{x:.1},{y:.1}")
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n<text x=\"{}\" y=\"{}\">{t_max:.0} s</text>",
            poly.join(" "),
            w - pad - 30.0,
            top + h - 18.0
        );
    }
    out.push_str("</svg>\n");
    out
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
}
